//! Record frames and segment headers: the byte layout of a segment file.
//!
//! Owns: encoding a record into a frame and checking a frame's header and checksum. Does not
//! own: files, scanning or recovery (see `scan`). Invariant: [`encode_into`] and
//! [`check_frame`] agree byte for byte; no input bytes make [`parse_header`] or
//! [`check_frame`] panic.
//!
//! Layout (all integers little-endian), repeated from the crate docs:
//! ```text
//! segment header  0..8   b"SLSPOOL" then format version byte 0x01
//! frame           0..4   crc32c over bytes 4..16+len (length, seq and body)
//!                 4..8   len: u32, body length in bytes
//!                 8..16  seq: u64
//!                 16..   body (len bytes, opaque)
//! ```

/// First eight bytes of every segment file: seven magic bytes and the format version.
pub const SEGMENT_MAGIC: [u8; 8] = *b"SLSPOOL\x01";
/// Length of the segment header in bytes.
pub const SEGMENT_HEADER_LEN: u64 = 8;
/// Length of a frame header (crc, len, seq) in bytes.
pub const FRAME_HEADER_LEN: usize = 16;

/// A frame header as read from disk, not yet validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Stored checksum.
    pub crc: u32,
    /// Body length in bytes.
    pub len: u32,
    /// Sequence number.
    pub seq: u64,
}

impl FrameHeader {
    /// Total frame length (header plus body).
    pub fn frame_len(&self) -> u64 {
        FRAME_HEADER_LEN as u64 + u64::from(self.len)
    }
}

/// Appends the frame for `body` with sequence number `seq` to `out`.
///
/// The caller bounds `body.len()` by the configured maximum record size, which is below
/// `u32::MAX`.
pub fn encode_into(out: &mut Vec<u8>, seq: u64, body: &[u8]) {
    let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    let mut hdr = [0u8; FRAME_HEADER_LEN];
    hdr[4..8].copy_from_slice(&len.to_le_bytes());
    hdr[8..16].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&hdr[4..]), body);
    hdr[0..4].copy_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&hdr);
    out.extend_from_slice(body);
}

/// Encoded frame length of a body of `body_len` bytes.
pub fn frame_len(body_len: usize) -> u64 {
    FRAME_HEADER_LEN as u64 + body_len as u64
}

/// Reads a frame header from the first 16 bytes of `b` (`None` if shorter).
pub fn parse_header(b: &[u8]) -> Option<FrameHeader> {
    let h = b.get(..FRAME_HEADER_LEN)?;
    let mut crc = [0u8; 4];
    let mut len = [0u8; 4];
    let mut seq = [0u8; 8];
    crc.copy_from_slice(&h[0..4]);
    len.copy_from_slice(&h[4..8]);
    seq.copy_from_slice(&h[8..16]);
    Some(FrameHeader {
        crc: u32::from_le_bytes(crc),
        len: u32::from_le_bytes(len),
        seq: u64::from_le_bytes(seq),
    })
}

/// True when `frame` (header and body, exactly one frame) carries a matching checksum.
pub fn check_frame(frame: &[u8]) -> bool {
    match parse_header(frame) {
        Some(h) if frame.len() as u64 == h.frame_len() => crc32c::crc32c(&frame[4..]) == h.crc,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_rfc3720_test_vector() {
        // RFC 3720 B.4: 32 bytes of zeros -> 0x8A9136AA; "123456789" -> 0xE3069283.
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn an_encoded_frame_has_the_documented_layout_and_checks() {
        let mut out = Vec::new();
        encode_into(&mut out, 7, b"abc");
        assert_eq!(out.len(), 19);
        assert_eq!(&out[4..8], &3u32.to_le_bytes());
        assert_eq!(&out[8..16], &7u64.to_le_bytes());
        assert_eq!(&out[16..], b"abc");
        assert_eq!(&out[0..4], &crc32c::crc32c(&out[4..]).to_le_bytes());
        assert!(check_frame(&out));
    }

    #[test]
    fn any_single_bit_flip_fails_the_check() {
        let mut out = Vec::new();
        encode_into(&mut out, 42, b"hello spool");
        for bit in 0..out.len() * 8 {
            let mut f = out.clone();
            f[bit / 8] ^= 1 << (bit % 8);
            assert!(!check_frame(&f), "bit {bit} flip went unnoticed");
        }
    }

    #[test]
    fn short_or_garbage_input_never_panics() {
        for n in 0..40 {
            let b = vec![0xFFu8; n];
            let _ = parse_header(&b);
            assert!(!check_frame(&b));
        }
    }
}
