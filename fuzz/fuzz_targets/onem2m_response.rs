//! Fuzz target for the oneM2M transport's HTTP/1.1 response decoder
//! (crates/sluice/src/sink/onem2m/http.rs, `ResponseBuf`): the CSE's pipelined responses.
//!
//! Decodes the input as a stream of responses until it fails or needs more bytes, three
//! ways: whole, in two pieces (the first input byte picks the split point), and one byte per
//! read. Checks, besides "no panic": a decoded body is within the bound, all three ways give
//! the same responses and the same verdict, and the decoder's work is linear in the input
//! (bytes examined ≤ 3 per input byte plus a constant per call) however it was split: a head
//! is searched and parsed (2 per byte) and its status prefix checked (≤ 7 bytes of a head of
//! at least 14).
//!
//! The same three ways again in the one-request-at-a-time mode of the functions' HTTP sink
//! (`ResponseBuf::one_at_a_time`, then `finish` as the connection closes): the same first
//! answer or the same failure however split, a body within the bound and a close-delimited
//! answer always `close`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::sink::onem2m::http::{HttpError, Response, ResponseBuf, MAX_BODY_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(data.len());
    let whole = drain([data]);
    let pieces = drain([&data[..split], &data[split..]]);
    let bytes = drain(data.chunks(1));
    assert_eq!(whole, pieces, "result depends on how the input was split");
    assert_eq!(whole, bytes, "result differs when read one byte at a time");
    let whole = single([data]);
    assert_eq!(
        whole,
        single([&data[..split], &data[split..]]),
        "one at a time: split"
    );
    assert_eq!(
        whole,
        single(data.chunks(1)),
        "one at a time: one byte per read"
    );
});

/// The first answer on a one-request-at-a-time connection, then the close.
fn single<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> Result<Option<Response>, HttpError> {
    let mut buf = ResponseBuf::one_at_a_time();
    let answer = 'feed: {
        for chunk in chunks {
            buf.extend_from_slice(chunk);
            if let Some(r) = buf.decode()? {
                break 'feed Some(r);
            }
        }
        buf.finish()?
    };
    if let Some(r) = &answer {
        assert!(r.body.len() <= MAX_BODY_BYTES);
    }
    Ok(answer)
}

fn drain<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> (Vec<Response>, bool) {
    let mut buf = ResponseBuf::new();
    let mut out = Vec::new();
    let mut given = 0u64;
    let mut calls = 0u64;
    let mut failed = false;
    'feed: for chunk in chunks {
        buf.extend_from_slice(chunk);
        given += chunk.len() as u64;
        loop {
            calls += 1;
            match buf.decode() {
                Ok(Some(r)) => {
                    assert!(r.body.len() <= MAX_BODY_BYTES);
                    out.push(r);
                }
                Ok(None) => break,
                Err(_) => {
                    failed = true;
                    break 'feed;
                }
            }
        }
    }
    assert!(
        buf.bytes_examined() <= 3 * given + 16 * calls,
        "{} bytes examined for {given} bytes in {calls} calls",
        buf.bytes_examined()
    );
    (out, failed)
}
