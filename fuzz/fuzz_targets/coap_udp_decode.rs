//! Fuzz target for the CoAP/UDP decoder (crates/sluice-proto/src/coap/message.rs).
//!
//! Feeds the input to `Message::decode_udp` as one datagram. Checks, besides "no panic": an
//! error keeps the header exactly when the 4 header bytes were there; a decoded message
//! re-encodes to exactly the input (CoAP/UDP has one encoding per message) and decodes equal
//! again; the typed option readers never panic on what decoded.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use sluice_proto::coap::{opt, Block, Message};

fuzz_target!(|data: &[u8]| {
    let datagram = Bytes::copy_from_slice(data);
    match Message::decode_udp(&datagram) {
        Err(e) => assert_eq!(e.header.is_some(), data.len() >= 4, "{e:?}"),
        Ok(message) => {
            let wire = message.to_udp();
            assert_eq!(&wire[..], data, "re-encoding differs: {message:?}");
            assert_eq!(message.options_len(), data.len() - 4 - message.token.len());
            let again = Message::decode_udp(&wire).expect("a re-encoded message decodes");
            assert_eq!(again, message);
            let _ = message.uri_path().count();
            let _ = message.query("c");
            for number in [opt::CONTENT_FORMAT, opt::BLOCK1, opt::BLOCK2, opt::OBSERVE] {
                if let Some(v) = message.uint_option(number) {
                    let _ = Block::from_uint(v).map(|b| (b.size(), b.offset()));
                }
            }
        }
    }
});
