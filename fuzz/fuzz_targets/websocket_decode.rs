//! Fuzz target for the WebSocket frame decoder (crates/sluice-proto/src/websocket.rs).
//!
//! Feeds the input whole and split in two (the first byte picks the split point) and checks,
//! besides "no panic", that the payload stream, the control frames and the error do not
//! depend on how the input arrived, and that no data frame larger than the limit is accepted.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice_proto::websocket::{Control, FrameDecoder, FrameError};

const MAX_FRAME: u64 = 256;

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(data.len());
    let whole = drain(&[data]);
    let pieces = drain(&[&data[..split], &data[split..]]);
    assert_eq!(whole, pieces, "result depends on how the input was split");
});

fn drain(parts: &[&[u8]]) -> (Vec<u8>, Vec<Control>, Option<FrameError>) {
    let mut d = FrameDecoder::new(MAX_FRAME);
    let mut input = BytesMut::new();
    let mut out = BytesMut::new();
    let mut controls = Vec::new();
    for part in parts {
        input.extend_from_slice(part);
        loop {
            match d.decode(&mut input, &mut out) {
                Ok(Some(c)) => controls.push(c),
                Ok(None) => break,
                Err(e) => return (out.to_vec(), controls, Some(e)),
            }
        }
    }
    (out.to_vec(), controls, None)
}
