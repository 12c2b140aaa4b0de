//! Fuzz target for the IEEE 11073-20601 APDU layer (crates/sluice-proto/src/phd/).
//!
//! Decodes the input as a stream of APDUs until it fails or needs more bytes, whole and in two
//! pieces (the first input byte picks the split point). Checks, besides "no panic": `Ok(None)`
//! consumes nothing, both ways give the same APDUs, and every decoded APDU re-encodes to the
//! bytes it came from (MDER has one encoding per value) and decodes again to an equal APDU.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice_proto::phd::{decode_apdu, Apdu};

const MAX_APDU: usize = 65_539;

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(data.len());
    let whole = drain(&[data]);
    let pieces = drain(&[&data[..split], &data[split..]]);
    assert_eq!(whole, pieces, "result depends on how the input was split");
});

fn drain(chunks: &[&[u8]]) -> (Vec<Apdu>, bool) {
    let mut buf = BytesMut::new();
    let mut apdus = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.clone();
            match decode_apdu(&mut buf, MAX_APDU) {
                Ok(Some(a)) => {
                    let mut wire = BytesMut::new();
                    a.encode(&mut wire);
                    let used = before.len() - buf.len();
                    assert_eq!(&wire[..], &before[..used], "re-encoded bytes differ");
                    let again = decode_apdu(&mut wire, MAX_APDU);
                    assert_eq!(again.as_ref(), Ok(&Some(a.clone())), "re-decoded differs");
                    apdus.push(a);
                }
                Ok(None) => {
                    assert_eq!(buf.len(), before.len(), "Ok(None) consumed bytes");
                    break;
                }
                Err(_) => return (apdus, true),
            }
        }
    }
    (apdus, false)
}
