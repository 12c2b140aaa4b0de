//! Fuzz target for the Kafka uplink's SASL/SCRAM client reading a server's messages
//! (crates/sluice/src/sink/kafka/scram.rs): server-first (nonce, salt, iteration count,
//! errors) and server-final (the signature).
//!
//! Checks, besides "no panic": a client-final is only built for a server nonce that extends
//! ours and an iteration count within the bounds, and it carries that nonce; a server-final is
//! accepted only after a client-final (there is nothing to check it against before).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::sink::kafka::scram::{Mechanism, ScramClient, MAX_ITERATIONS, MIN_ITERATIONS};

fuzz_target!(|data: &[u8]| {
    let (first, last) = data.split_at(data.len() / 2);
    let fresh = ScramClient::with_nonce(Mechanism::Sha256, "u", "p", "fuzznonce");
    assert!(fresh.verify_server_final(last).is_err());
    let mut c = ScramClient::with_nonce(Mechanism::Sha256, "u", "p", "fuzznonce");
    if let Ok(fin) = c.client_final(first) {
        let text = std::str::from_utf8(first).expect("accepted, so UTF-8");
        let nonce = text
            .split(',')
            .find_map(|a| a.strip_prefix("r="))
            .expect("accepted, so it has a nonce");
        assert!(nonce.starts_with("fuzznonce") && nonce.len() > "fuzznonce".len());
        assert!(fin.starts_with(&format!("c=biws,r={nonce},p=")));
        let iters: u32 = text
            .split(',')
            .find_map(|a| a.strip_prefix("i="))
            .and_then(|i| i.parse().ok())
            .expect("accepted, so it has an iteration count");
        assert!((MIN_ITERATIONS..=MAX_ITERATIONS).contains(&iters));
        let _ = c.verify_server_final(last);
    }
});
