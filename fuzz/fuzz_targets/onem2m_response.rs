//! Fuzz target for the oneM2M transport's HTTP/1.1 response decoder
//! (crates/sluice/src/sink/onem2m/http.rs): the CSE's pipelined responses.
//!
//! Decodes the input as a stream of responses until it fails or needs more bytes, whole and
//! in two pieces (the first input byte picks the split point). Checks, besides "no panic":
//! `Ok(None)` consumes nothing, a decoded body is within the bound, and both ways give the
//! same responses.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice::sink::onem2m::http::{decode, Response, MAX_BODY_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(data.len());
    let whole = drain(&[data]);
    let pieces = drain(&[&data[..split], &data[split..]]);
    assert_eq!(whole, pieces, "result depends on how the input was split");
});

fn drain(chunks: &[&[u8]]) -> (Vec<Response>, bool) {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match decode(&mut buf) {
                Ok(Some(r)) => {
                    assert!(r.body.len() <= MAX_BODY_BYTES);
                    out.push(r);
                }
                Ok(None) => {
                    assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                    break;
                }
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}
