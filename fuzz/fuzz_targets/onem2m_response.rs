//! Fuzz target for the oneM2M transport's HTTP/1.1 response decoder
//! (crates/sluice/src/sink/onem2m/http.rs): the CSE's pipelined responses.
//!
//! Decodes the input as a stream of responses until it fails or needs more bytes, whole and
//! in two pieces (the first input byte picks the split point). Checks, besides "no panic":
//! `Ok(None)` consumes nothing but whole interim (1xx) responses, a decoded body is within
//! the bound, and both ways give the same responses.
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
            let whole_before = buf.clone();
            match decode(&mut buf) {
                Ok(Some(r)) => {
                    assert!(r.body.len() <= MAX_BODY_BYTES);
                    out.push(r);
                }
                Ok(None) => {
                    if buf.len() != before {
                        // Only interim responses may go: what was removed starts a 1xx head.
                        // (Empty lines before a head are skipped, RFC 9112 §2.2.)
                        let removed = &whole_before[..before - buf.len()];
                        let start = removed.iter().position(|b| !matches!(b, b'\r' | b'\n'));
                        let removed = &removed[start.unwrap_or(removed.len())..];
                        assert!(
                            removed.starts_with(b"HTTP/1.") && removed.get(9) == Some(&b'1'),
                            "Ok(None) consumed bytes that are not a 1xx response"
                        );
                    }
                    break;
                }
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}
