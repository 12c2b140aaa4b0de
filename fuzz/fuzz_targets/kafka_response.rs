//! Fuzz target for how the Kafka uplink reads a broker's answers
//! (crates/sluice/src/sink/kafka/wire.rs): cutting length-prefixed frames out of a read buffer
//! (`next_frame`, bounded by `MAX_RESPONSE`), the correlation id, and decoding each frame as
//! every answer the transport asks for (Metadata v9, Produce v9, InitProducerId v4,
//! SaslHandshake v1, SaslAuthenticate v2) with `kafka-protocol`'s decoders.
//!
//! Checks, besides "no panic": the same frames (or the same refusal) whether the bytes arrive
//! whole or in two reads split at an input-chosen offset, and no frame above `MAX_RESPONSE`.
#![no_main]

use bytes::BytesMut;
use kafka_protocol::messages::{
    ApiKey, InitProducerIdResponse, MetadataResponse, ProduceResponse, SaslAuthenticateResponse,
    SaslHandshakeResponse,
};
use libfuzzer_sys::fuzz_target;
use sluice::sink::kafka::wire::{
    decode_response, next_frame, peek_correlation_id, INIT_PRODUCER_ID_V, MAX_RESPONSE, METADATA_V,
    PRODUCE_V,
};

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
        let b = || BytesMut::from(&f[..]);
        let _: Result<MetadataResponse, _> =
            decode_response(b(), ApiKey::Metadata, METADATA_V, "m");
        let _: Result<ProduceResponse, _> = decode_response(b(), ApiKey::Produce, PRODUCE_V, "p");
        let _: Result<InitProducerIdResponse, _> =
            decode_response(b(), ApiKey::InitProducerId, INIT_PRODUCER_ID_V, "i");
        let _: Result<SaslHandshakeResponse, _> =
            decode_response(b(), ApiKey::SaslHandshake, 1, "h");
        let _: Result<SaslAuthenticateResponse, _> =
            decode_response(b(), ApiKey::SaslAuthenticate, 2, "a");
    }
});
