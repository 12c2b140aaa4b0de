//! Fuzz target for the CoAP-over-TCP framing (crates/sluice-proto/src/coap/tcp.rs).
//!
//! Decodes the input as a stream of RFC 8323 frames until it fails or needs more bytes,
//! whole and in two pieces (the first input byte picks the split point). Checks, besides
//! "no panic": `Ok(None)` consumes nothing, both ways give the same messages, and every
//! decoded message re-encodes to bytes that decode to an equal message.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice_proto::coap::{decode_tcp, encode_tcp, Message};

const MAX_MESSAGE_SIZE: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(data.len());
    let whole = drain(&[data]);
    let pieces = drain(&[&data[..split], &data[split..]]);
    assert_eq!(whole, pieces, "result depends on how the input was split");
});

fn drain(chunks: &[&[u8]]) -> (Vec<Message>, bool) {
    let mut buf = BytesMut::new();
    let mut messages = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match decode_tcp(&mut buf, MAX_MESSAGE_SIZE) {
                Ok(Some(m)) => {
                    let mut wire = BytesMut::new();
                    encode_tcp(&m, &mut wire);
                    let again = decode_tcp(&mut wire, usize::MAX);
                    assert_eq!(again.as_ref(), Ok(&Some(m.clone())), "re-encoded differs");
                    assert!(wire.is_empty(), "re-encoded message has trailing bytes");
                    messages.push(m);
                }
                Ok(None) => {
                    assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                    break;
                }
                Err(_) => return (messages, true),
            }
        }
    }
    (messages, false)
}
