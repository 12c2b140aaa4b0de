//! The fact sheet's worked examples (shared/specs/senml-and-coap.md §1.5–1.7): the CBOR
//! vectors (copied into tests/vectors/) and the JSON forms decode to the resolved records the
//! sheet lists.

use sluice_proto::senml::{decode, sniff, Format, Record, Value};

use crate::{assert_reencodes, hex};

const EX1_CBOR: &str = include_str!("../vectors/senml_ex1_pulseox_cbor.hex");
const EX2_CBOR: &str = include_str!("../vectors/senml_ex2_scale_cbor.hex");
const EX3_CBOR: &str = include_str!("../vectors/senml_ex3_bp_cbor.hex");

const EX1_JSON: &str = r#"[{"bn":"urn:dev:mac:1122334455667704:","bt":1700000000,"n":"spo2","u":"/","v":0.98},{"n":"pulse","u":"beat/min","v":72}]"#;
const EX2_JSON: &str = r#"[{"bn":"urn:dev:mac:1122334455667788:mass","bt":1700000000,"bu":"kg","v":76.2},{"t":60,"v":76}]"#;
const EX3_JSON: &str = r#"[{"bn":"urn:dev:mac:00220922580803cc:","bt":1700000100,"bu":"Pa","n":"sys","v":15999},{"n":"dia","v":10666},{"n":"mean","v":12666},{"n":"pulse","u":"beat/min","v":60}]"#;

fn record(name: &str, time: f64, unit: &str, value: f64) -> Record {
    Record {
        name: name.to_string(),
        time,
        unit: Some(unit.to_string()),
        value: Some(Value::Number(value)),
        sum: None,
        update_time: None,
    }
}

fn example1() -> Vec<Record> {
    vec![
        record(
            "urn:dev:mac:1122334455667704:spo2",
            1_700_000_000.0,
            "/",
            0.98,
        ),
        record(
            "urn:dev:mac:1122334455667704:pulse",
            1_700_000_000.0,
            "beat/min",
            72.0,
        ),
    ]
}

fn example2() -> Vec<Record> {
    vec![
        record(
            "urn:dev:mac:1122334455667788:mass",
            1_700_000_000.0,
            "kg",
            76.2,
        ),
        record(
            "urn:dev:mac:1122334455667788:mass",
            1_700_000_060.0,
            "kg",
            76.0,
        ),
    ]
}

fn example3() -> Vec<Record> {
    let t = 1_700_000_100.0;
    vec![
        record("urn:dev:mac:00220922580803cc:sys", t, "Pa", 15999.0),
        record("urn:dev:mac:00220922580803cc:dia", t, "Pa", 10666.0),
        record("urn:dev:mac:00220922580803cc:mean", t, "Pa", 12666.0),
        record("urn:dev:mac:00220922580803cc:pulse", t, "beat/min", 60.0),
    ]
}

fn examples() -> [(&'static str, &'static str, usize, usize, Vec<Record>); 3] {
    [
        (EX1_CBOR, EX1_JSON, 80, 120, example1()),
        (EX2_CBOR, EX2_JSON, 65, 95, example2()),
        (EX3_CBOR, EX3_JSON, 95, 167, example3()),
    ]
}

#[test]
fn every_cbor_vector_decodes_to_the_records_the_sheet_lists() {
    for (cbor, _, cbor_len, _, expected) in examples() {
        let bytes = hex(cbor);
        assert_eq!(bytes.len(), cbor_len, "vector length as the sheet states");
        assert_eq!(sniff(&bytes), Some(Format::Cbor));
        assert_eq!(decode(Format::Cbor, &bytes), Ok(expected));
    }
}

#[test]
fn every_json_example_decodes_to_the_same_records() {
    for (_, json, _, json_len, expected) in examples() {
        assert_eq!(json.len(), json_len, "example length as the sheet states");
        assert_eq!(sniff(json.as_bytes()), Some(Format::Json));
        assert_eq!(decode(Format::Json, json.as_bytes()), Ok(expected));
    }
}

#[test]
fn the_examples_re_encode_without_base_fields_to_equal_records() {
    for (_, _, _, _, expected) in examples() {
        assert_reencodes(&expected);
    }
}

#[test]
fn a_relative_time_after_a_base_time_is_an_offset_from_it() {
    // Example 2's second record: t = 60 is added to bt, not read as "60 s from now".
    let records = decode(Format::Json, EX2_JSON.as_bytes()).expect("example 2 decodes");
    assert_eq!(records[1].time - records[0].time, 60.0);
}

#[test]
fn every_strict_prefix_of_a_vector_is_an_error_not_a_panic() {
    for (cbor, json, _, _, _) in examples() {
        let bytes = hex(cbor);
        for end in 0..bytes.len() {
            let result = decode(Format::Cbor, &bytes[..end]);
            assert!(
                matches!(
                    result,
                    Err(sluice_proto::senml::SenmlError::Truncated { .. }
                        | sluice_proto::senml::SenmlError::LengthBeyondInput { .. })
                ),
                "prefix of {end} bytes: {result:?}"
            );
        }
        for end in 0..json.len() {
            assert!(
                decode(Format::Json, &json.as_bytes()[..end]).is_err(),
                "JSON prefix of {end} bytes"
            );
        }
    }
}
