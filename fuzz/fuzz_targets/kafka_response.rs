//! Fuzz target for how the Kafka uplink reads a broker's answers
//! (crates/sluice/src/sink/kafka/wire.rs and answers.rs): cutting length-prefixed frames out
//! of a read buffer (`next_frame`, bounded by `MAX_RESPONSE`), the correlation id, and
//! decoding each frame as every answer the transport asks for (Metadata v9, Produce v9,
//! InitProducerId v4, SaslHandshake v1, SaslAuthenticate v2) with sluice's own bounded
//! decoders (`decode_response`).
//!
//! Checks, besides "no panic" (and no allocation failure: `kafka-protocol`'s decoders, used
//! before, aborted on an array count larger than the frame): the same frames (or the same
//! refusal) whether the bytes arrive whole or in two reads split at an input-chosen offset, no
//! frame above `MAX_RESPONSE`, and no decoded answer holding more elements than its frame has
//! bytes.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice::sink::kafka::answers::{
    InitProducerIdAnswer, MetadataAnswer, ProduceAnswer, SaslAuthenticateAnswer,
    SaslHandshakeAnswer,
};
use sluice::sink::kafka::wire::{decode_response, next_frame, peek_correlation_id, MAX_RESPONSE};

/// The frames cut from `bytes` fed in two reads at `split`, then whether it ended refused.
fn frames(bytes: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
    let mut rbuf = BytesMut::new();
    let mut out = Vec::new();
    for part in [&bytes[..split], &bytes[split..]] {
        rbuf.extend_from_slice(part);
        loop {
            match next_frame(&mut rbuf) {
                Ok(Some(f)) => out.push(f.to_vec()),
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, bytes)) = data.split_first() else {
        return;
    };
    let split = if bytes.is_empty() {
        0
    } else {
        first as usize % (bytes.len() + 1)
    };
    let whole = frames(bytes, bytes.len());
    let pieces = frames(bytes, split);
    assert_eq!(whole, pieces, "the same frames however the bytes are split");
    for f in &whole.0 {
        assert!(f.len() <= MAX_RESPONSE);
        let _ = peek_correlation_id(f);
        let n = f.len();
        if let Ok(m) = decode_response::<MetadataAnswer>(f, "m") {
            let partitions: usize = m.topics.iter().map(|t| t.partitions.len()).sum();
            assert!(m.brokers.len() + m.topics.len() + partitions <= n);
        }
        if let Ok(p) = decode_response::<ProduceAnswer>(f, "p") {
            let partitions: usize = p.topics.iter().map(|t| t.partitions.len()).sum();
            assert!(p.topics.len() + partitions <= n);
        }
        let _ = decode_response::<InitProducerIdAnswer>(f, "i");
        if let Ok(h) = decode_response::<SaslHandshakeAnswer>(f, "h") {
            assert!(h.mechanisms.len() <= n);
        }
        if let Ok(a) = decode_response::<SaslAuthenticateAnswer>(f, "a") {
            assert!(a.auth_bytes.len() <= n);
        }
    }
});
