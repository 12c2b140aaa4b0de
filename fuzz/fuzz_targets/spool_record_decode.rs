//! Fuzz target for the gateway's spool record body decoder (crates/sluice/src/sink/spool/record.rs):
//! the bytes a spool hands back after a restart.
//!
//! Checks, besides "no panic": a body that decodes re-encodes to exactly the same bytes (the
//! decoder is strict, so there is one encoding per record), and the encoded length matches.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use sluice::sink::spool::record::{decode, encode_into};

fuzz_target!(|data: &[u8]| {
    let body = Bytes::copy_from_slice(data);
    let Ok(record) = decode(&body) else {
        return;
    };
    let mut out = Vec::new();
    encode_into(&record, &mut out).expect("a decoded record re-encodes");
    assert_eq!(out.len(), record.encoded_len());
    assert_eq!(&out[..], data, "decode/encode is not a round trip");
});
