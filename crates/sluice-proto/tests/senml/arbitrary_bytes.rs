//! Arbitrary and corrupted bytes never panic the decoder, and whatever they decode to
//! re-encodes to bytes that decode to the same records (the property the fuzz target checks).

use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::senml::{decode, Format, PackWriter};

use crate::assert_reencodes;
use crate::strategies::record;

fn both_formats(bytes: &[u8]) {
    for format in [Format::Json, Format::Cbor] {
        if let Ok(records) = decode(format, bytes) {
            assert_reencodes(&records);
        }
    }
}

/// JSON-shaped text built from SenML labels and small values, so that many inputs get past
/// the syntax check into the SenML rules.
fn json_like() -> impl Strategy<Value = String> {
    let label = prop::sample::select(vec![
        "bn", "bt", "bu", "bv", "bs", "bver", "n", "u", "v", "vs", "vb", "vd", "s", "t", "ut", "x",
        "x_",
    ]);
    let value = prop::sample::select(vec![
        "\"a\"", "\"d:\"", "\"AQI\"", "\"\"", "1", "-5", "0.5", "1e308", "10", "11", "true",
        "null", "[]", "{}", "\"+/\"",
    ]);
    vec(vec((label, value), 0..5), 0..5).prop_map(|records| {
        let objects: Vec<String> = records
            .iter()
            .map(|fields| {
                let members: Vec<String> =
                    fields.iter().map(|(l, v)| format!("\"{l}\":{v}")).collect();
                format!("{{{}}}", members.join(","))
            })
            .collect();
        format!("[{}]", objects.join(","))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn arbitrary_bytes_never_panic_either_decoder(bytes in vec(any::<u8>(), 0..512)) {
        both_formats(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_a_cbor_array_head_never_panic(head in 0x80u8..=0x9f, tail in vec(any::<u8>(), 0..256)) {
        let mut bytes = vec![head];
        bytes.extend(tail);
        both_formats(&bytes);
    }

    #[test]
    fn json_shaped_text_never_panics_and_whatever_decodes_round_trips(text in json_like()) {
        both_formats(text.as_bytes());
    }

    #[test]
    fn valid_packs_with_corrupted_bytes_never_panic(
        records in vec(record(), 1..6),
        cbor in any::<bool>(),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let format = if cbor { Format::Cbor } else { Format::Json };
        let mut writer = PackWriter::new(format);
        for r in &records {
            writer.push(r).expect("valid");
        }
        let mut bytes = writer.finish().to_vec();
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        both_formats(&bytes);
        both_formats(&bytes[..cut.index(bytes.len())]);
    }
}
