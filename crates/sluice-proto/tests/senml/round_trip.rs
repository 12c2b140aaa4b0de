//! Round trips: records written by [`PackWriter`] decode to equal records in both formats,
//! and `encoded_len()` always predicts `finish()`.

use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::senml::{decode, sniff, Format, PackWriter};

use crate::strategies::record;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn arbitrary_records_survive_a_json_and_a_cbor_round_trip(records in vec(record(), 0..40)) {
        for format in [Format::Json, Format::Cbor] {
            let mut writer = PackWriter::new(format);
            for r in &records {
                writer.push(r).expect("generated records are valid");
                prop_assert_eq!(writer.encoded_len(), writer.clone().finish().len());
            }
            let len = writer.encoded_len();
            let bytes = writer.finish();
            prop_assert_eq!(bytes.len(), len);
            prop_assert_eq!(sniff(&bytes), Some(format));
            let decoded = decode(format, &bytes);
            prop_assert_eq!(decoded.as_deref(), Ok(&records[..]), "{:?}", String::from_utf8_lossy(&bytes));
        }
    }

    #[test]
    fn json_packs_are_valid_json_for_any_json_parser(records in vec(record(), 1..10)) {
        let mut writer = PackWriter::new(Format::Json);
        for r in &records {
            writer.push(r).expect("valid");
        }
        let bytes = writer.finish();
        let parsed: serde_json::Value = serde_json::from_slice(&bytes).expect("valid JSON");
        prop_assert_eq!(parsed.as_array().map(Vec::len), Some(records.len()));
    }

    #[test]
    fn encoded_len_is_exact_across_the_cbor_head_sizes(count in 0usize..300, r in record()) {
        let mut writer = PackWriter::new(Format::Cbor);
        for _ in 0..count {
            writer.push(&r).expect("valid");
        }
        let len = writer.encoded_len();
        let bytes = writer.finish();
        prop_assert_eq!(bytes.len(), len);
        prop_assert_eq!(decode(Format::Cbor, &bytes).map(|d| d.len()), Ok(count));
    }
}
