//! Fuzz target for the SenML decoder (crates/sluice-proto/src/senml).
//!
//! Feeds the input to the JSON and the CBOR decoder. Checks, besides "no panic": whatever
//! decodes is accepted by `PackWriter` in both formats, `encoded_len()` equals the length
//! `finish()` returns, and the encoded pack decodes to equal records (the decoder refuses
//! NaN and infinities, so equality is meaningful).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::senml::{decode, Format, PackWriter};

fuzz_target!(|data: &[u8]| {
    for format in [Format::Json, Format::Cbor] {
        let Ok(records) = decode(format, data) else {
            continue;
        };
        for again in [Format::Json, Format::Cbor] {
            let mut writer = PackWriter::new(again);
            for record in &records {
                if let Err(e) = writer.push(record) {
                    panic!("decoded record does not re-encode: {e}: {record:?}");
                }
            }
            let len = writer.encoded_len();
            let bytes = writer.finish();
            assert_eq!(bytes.len(), len, "encoded_len() differs from finish()");
            match decode(again, &bytes) {
                Ok(decoded) => assert_eq!(decoded, records, "re-encoded pack differs"),
                Err(e) => panic!("re-encoded {again:?} pack does not decode: {e}"),
            }
        }
    }
});
