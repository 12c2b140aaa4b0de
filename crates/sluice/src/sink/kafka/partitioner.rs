//! Which partition a record goes to: Kafka's own default for a keyed record (murmur2 of the
//! key, made positive, modulo the partition count), so a device's messages land in the
//! partition any Kafka client would pick for the same key, and stay in order there.
//!
//! Owns: the hash. Does not own: the partition count (the topic's metadata) or the key (the
//! device id, chosen by the sink).

/// Kafka's `Utils.murmur2` (MurmurHash2, 32-bit, seed `0x9747b28c`), over `data`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ len as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition (of `partitions`, at least 1) Kafka's default partitioner picks for `key`.
pub fn partition_for(key: &[u8], partitions: usize) -> usize {
    let positive = (murmur2(key) & 0x7fff_ffff) as usize;
    positive % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Printed by Kafka 4.4.0's own `org.apache.kafka.common.utils.Utils.murmur2` and
    /// `toPositive(h) % n` (a ten-line Java program against kafka-clients-4.4.0.jar):
    /// (key, murmur2, partition of 3, partition of 12).
    const KAFKA: &[(&str, i32, usize, usize)] = &[
        ("", 275646681, 0, 9),
        ("a", -1563381124, 1, 4),
        ("ab", 316155434, 2, 2),
        ("abc", 479470107, 0, 3),
        ("abcd", -1323649548, 2, 8),
        ("dev-0", 886589854, 1, 10),
        ("dev-1", -1811837231, 0, 9),
        ("dev-1023", 1276898023, 1, 7),
        ("sensor/ÄÖ-42", -682408879, 1, 1),
        (
            "a-much-longer-device-identifier-0123456789",
            1083749509,
            1,
            1,
        ),
    ];

    #[test]
    fn murmur2_and_partitions_match_kafkas_own() {
        for &(key, hash, p3, p12) in KAFKA {
            assert_eq!(murmur2(key.as_bytes()), hash, "murmur2({key:?})");
            assert_eq!(partition_for(key.as_bytes(), 3), p3, "{key:?} of 3");
            assert_eq!(partition_for(key.as_bytes(), 12), p12, "{key:?} of 12");
        }
    }

    proptest::proptest! {
        #[test]
        fn a_partition_is_always_in_range(key: Vec<u8>, n in 1usize..1000) {
            proptest::prop_assert!(partition_for(&key, n) < n);
        }
    }
}
