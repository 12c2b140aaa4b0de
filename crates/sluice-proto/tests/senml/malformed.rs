//! Malformed and unsupported packs give the error that names the problem and where it is;
//! tolerated variations (unknown labels, indefinite lengths, half floats, padding) decode.

use bytes::Bytes;
use sluice_proto::senml::{decode, sniff, valid_name, Format, Record, SenmlError, Value};

use crate::{hex, number};

fn json(text: &str) -> Result<Vec<Record>, SenmlError> {
    decode(Format::Json, text.as_bytes())
}

fn cbor(wire: &str) -> Result<Vec<Record>, SenmlError> {
    decode(Format::Cbor, &hex(wire))
}

fn data(name: &str, bytes: &'static [u8]) -> Record {
    Record {
        value: Some(Value::Data(Bytes::from_static(bytes))),
        ..number(name, 0.0)
    }
}

#[test]
fn a_pack_that_is_not_an_array_is_refused_saying_what_it_is() {
    assert_eq!(
        json(r#"{"n":"a"}"#),
        Err(SenmlError::NotAnArray { found: "an object" })
    );
    assert_eq!(json("3"), Err(SenmlError::NotAnArray { found: "a number" }));
    assert_eq!(cbor("a0"), Err(SenmlError::NotAnArray { found: "a map" }));
    assert_eq!(
        cbor("61 61"),
        Err(SenmlError::NotAnArray {
            found: "a text string"
        })
    );
}

#[test]
fn a_record_that_is_not_a_map_is_refused_with_its_index() {
    assert_eq!(
        json(r#"[{"n":"a","v":1},[1]]"#),
        Err(SenmlError::RecordNotAMap {
            record: 1,
            found: "an array"
        })
    );
    assert_eq!(
        cbor("82 a2 00 61 61 02 01 01"),
        Err(SenmlError::RecordNotAMap {
            record: 1,
            found: "an integer"
        })
    );
}

#[test]
fn json_syntax_errors_say_where() {
    let err = json(r#"[{"n":"a","v":1}"#).expect_err("unterminated");
    assert!(
        matches!(&err, SenmlError::Json(m) if m.contains("line 1")),
        "{err}"
    );
    assert!(matches!(json("[] x"), Err(SenmlError::Json(_))));
    assert!(matches!(json(""), Err(SenmlError::Json(_))));
    // serde_json refuses numbers beyond the double range.
    assert!(matches!(
        json(r#"[{"n":"a","v":1e400}]"#),
        Err(SenmlError::Json(_))
    ));
}

#[test]
fn fields_of_the_wrong_type_are_named_with_what_was_expected_and_found() {
    assert_eq!(
        json(r#"[{"n":"a","v":"72"}]"#),
        Err(SenmlError::WrongType {
            record: 0,
            label: "v",
            expected: "a number",
            found: "a text string"
        })
    );
    assert_eq!(
        json(r#"[{"n":"a","vb":1}]"#),
        Err(SenmlError::WrongType {
            record: 0,
            label: "vb",
            expected: "a boolean",
            found: "a number"
        })
    );
    assert_eq!(
        json(r#"[{"n":null}]"#),
        Err(SenmlError::WrongType {
            record: 0,
            label: "n",
            expected: "a text string",
            found: "null"
        })
    );
    // vd is base64url text in JSON, a byte string in CBOR.
    assert_eq!(
        json(r#"[{"n":"a","vd":[1]}]"#),
        Err(SenmlError::WrongType {
            record: 0,
            label: "vd",
            expected: "base64url text",
            found: "an array"
        })
    );
    assert_eq!(
        cbor("81 a2 00 61 61 08 62 41 51"),
        Err(SenmlError::WrongType {
            record: 0,
            label: "vd",
            expected: "a byte string",
            found: "a text string"
        })
    );
    assert_eq!(
        cbor("81 a2 00 61 61 02 f6"),
        Err(SenmlError::WrongType {
            record: 0,
            label: "v",
            expected: "a number",
            found: "null"
        })
    );
}

#[test]
fn bver_must_be_an_unsigned_integer_no_newer_than_10() {
    assert_eq!(json(r#"[{"bver":10,"n":"a"}]"#).map(|r| r.len()), Ok(1));
    assert_eq!(
        json(r#"[{"bver":11,"n":"a"}]"#),
        Err(SenmlError::UnsupportedVersion {
            record: 0,
            version: 11
        })
    );
    for bad in [r#"[{"bver":-1,"n":"a"}]"#, r#"[{"bver":10.0,"n":"a"}]"#] {
        assert!(
            matches!(
                json(bad),
                Err(SenmlError::WrongType {
                    label: "bver",
                    expected: "an unsigned integer",
                    ..
                })
            ),
            "{bad}"
        );
    }
    assert_eq!(
        cbor("81 a2 20 0b 00 61 61"),
        Err(SenmlError::UnsupportedVersion {
            record: 0,
            version: 11
        })
    );
}

#[test]
fn a_label_twice_or_two_values_in_one_record_is_refused() {
    assert_eq!(
        json(r#"[{"n":"a","v":1,"v":2}]"#),
        Err(SenmlError::DuplicateLabel {
            record: 0,
            label: "v"
        })
    );
    assert_eq!(
        cbor("81 a3 00 61 61 00 61 62 02 01"),
        Err(SenmlError::DuplicateLabel {
            record: 0,
            label: "n"
        })
    );
    assert_eq!(
        json(r#"[{"n":"a","v":1,"vs":"x"}]"#),
        Err(SenmlError::MultipleValues {
            record: 0,
            first: "v",
            second: "vs"
        })
    );
}

#[test]
fn must_understand_labels_and_unknown_base_labels_are_refused() {
    assert_eq!(
        json(r#"[{"n":"a","v":1},{"n":"b","ext_":1}]"#),
        Err(SenmlError::MustUnderstand {
            record: 1,
            label: "ext_".into()
        })
    );
    // CBOR text label "x_".
    assert_eq!(
        cbor("81 a2 00 61 61 62 78 5f 01"),
        Err(SenmlError::MustUnderstand {
            record: 0,
            label: "x_".into()
        })
    );
    // -7 is not a registered base field.
    assert_eq!(
        cbor("81 a2 00 61 61 26 01"),
        Err(SenmlError::UnknownBaseLabel {
            record: 0,
            label: -7
        })
    );
    assert_eq!(
        cbor("81 a1 41 00 01"),
        Err(SenmlError::LabelNotIntegerOrText {
            record: 0,
            found: "a byte string"
        })
    );
}

#[test]
fn unknown_labels_without_underscore_are_skipped_whatever_their_value() {
    let expected = Ok(vec![number("a", 1.0)]);
    assert_eq!(
        json(r#"[{"n":"a","zz":{"deep":[1,{"x_":null}]},"v":1,"q":"x"}]"#),
        expected
    );
    // Label 9 (unassigned), text label "foo", nested indefinite array and map, null.
    assert_eq!(
        cbor("81 a5 00 61 61 09 9f 01 bf 61 6b f6 ff ff 63 66 6f 6f f7 02 01 0a 82 f4 f5"),
        expected
    );
}

#[test]
fn cbor_tags_are_refused_wherever_they_appear() {
    for (wire, offset, tag) in [
        ("c1 80", 0, 1),                               // the pack
        ("81 c1 a0", 1, 1),                            // a record
        ("81 a2 00 61 61 02 c4 82 21 19 6a b3", 6, 4), // a decimal fraction as v
        ("81 a2 00 61 61 09 d9 d9 f7 00", 6, 55799),   // an ignored value
    ] {
        assert_eq!(
            cbor(wire),
            Err(SenmlError::TagNotSupported { offset, tag }),
            "{wire}"
        );
    }
}

#[test]
fn cbor_lengths_beyond_the_input_are_errors_not_allocations() {
    assert_eq!(
        cbor("9b 00 00 00 ff ff ff ff ff"),
        Err(SenmlError::LengthBeyondInput {
            offset: 0,
            declared: 0xff_ffff_ffff,
            remaining: 0
        })
    );
    assert_eq!(
        cbor("81 a1 00 7b ff ff ff ff ff ff ff ff"),
        Err(SenmlError::LengthBeyondInput {
            offset: 3,
            declared: u64::MAX,
            remaining: 0
        })
    );
    // A map of 3 entries needs at least 6 bytes; 4 are left.
    assert_eq!(
        cbor("81 a3 00 61 61 01"),
        Err(SenmlError::LengthBeyondInput {
            offset: 1,
            declared: 3,
            remaining: 4
        })
    );
}

#[test]
fn malformed_cbor_is_reported_with_its_offset() {
    assert_eq!(cbor(""), Err(SenmlError::Truncated { offset: 0 }));
    assert_eq!(
        cbor("82 a2 00 61 61 02 01"),
        Err(SenmlError::Truncated { offset: 7 })
    );
    // An indefinite pack without its break.
    assert_eq!(
        cbor("9f a1 00 61 61"),
        Err(SenmlError::Truncated { offset: 5 })
    );
    assert_eq!(
        cbor("81 a2 00 61 61 02 19 01"),
        Err(SenmlError::Truncated { offset: 6 })
    );
    let malformed = |wire, offset| match cbor(wire) {
        Err(SenmlError::MalformedCbor { offset: o, .. }) => assert_eq!(o, offset, "{wire}"),
        other => panic!("{wire}: {other:?}"),
    };
    malformed("81 a1 00 7c", 3); // reserved additional information
    malformed("81 ff", 1); // break in a definite array
    malformed("81 a1 00 3f", 3); // indefinite negative integer
    malformed("81 a1 00 7f 41 61 ff", 4); // byte chunk in a text string
    malformed("81 a1 00 61 ff", 3); // invalid UTF-8
    malformed("81 a2 00 61 61 09 f8 10", 6); // two-byte simple value below 32
    assert_eq!(
        cbor("80 00"),
        Err(SenmlError::TrailingBytes {
            offset: 1,
            extra: 1
        })
    );
}

#[test]
fn skipped_values_nest_at_most_max_depth() {
    let deep = |levels: usize| {
        let mut wire = "81 a2 00 61 61 09 ".to_string();
        wire.push_str(&"81 ".repeat(levels));
        wire.push_str("00");
        cbor(&wire)
    };
    assert_eq!(deep(13), Ok(vec![number_only_name("a")]));
    assert!(matches!(deep(14), Err(SenmlError::TooDeep { .. })));
    assert!(matches!(deep(100_000), Err(SenmlError::TooDeep { .. })));
    // JSON: serde_json skips nested values without recursing (and limits the recursion it
    // does use), so depth costs no stack.
    let nested = |label| {
        let deep = format!("{}0{}", "[".repeat(100_000), "]".repeat(100_000));
        json(&format!(r#"[{{"n":"a","{label}":{deep}}},{deep}]"#))
    };
    assert_eq!(
        nested("x"),
        Err(SenmlError::RecordNotAMap {
            record: 1,
            found: "an array"
        })
    );
    assert!(matches!(
        nested("v"),
        Err(SenmlError::WrongType { record: 0, .. })
    ));
}

fn number_only_name(name: &str) -> Record {
    Record {
        value: None,
        ..number(name, 0.0)
    }
}

#[test]
fn numbers_must_be_finite_before_and_after_resolution() {
    assert_eq!(
        cbor("81 a2 00 61 61 02 f9 7e 00"),
        Err(SenmlError::NotFinite {
            record: 0,
            label: "v"
        })
    );
    assert_eq!(
        cbor("81 a2 00 61 61 06 fa 7f 80 00 00"),
        Err(SenmlError::NotFinite {
            record: 0,
            label: "t"
        })
    );
    assert_eq!(
        json(r#"[{"bt":1e308,"n":"a","v":1},{"n":"b","t":1e308,"v":1}]"#),
        Err(SenmlError::NotFinite {
            record: 1,
            label: "bt + t"
        })
    );
    assert_eq!(
        json(r#"[{"bv":-1.7e308,"n":"a","v":-1.7e308}]"#),
        Err(SenmlError::NotFinite {
            record: 0,
            label: "bv + v"
        })
    );
}

#[test]
fn every_resolved_name_must_be_valid() {
    assert_eq!(
        json(r#"[{"v":1}]"#),
        Err(SenmlError::InvalidName {
            record: 0,
            name: String::new()
        })
    );
    assert_eq!(
        json(r#"[{"bn":"dev:","n":"ok","v":1},{"n":"no good","v":2}]"#),
        Err(SenmlError::InvalidName {
            record: 1,
            name: "dev:no good".into()
        })
    );
    assert_eq!(
        json(r#"[{"bn":"-dev","n":"x","v":1}]"#),
        Err(SenmlError::InvalidName {
            record: 0,
            name: "-devx".into()
        })
    );
}

#[test]
fn valid_names_follow_the_character_rules() {
    for ok in ["a", "0", "urn:dev:mac:0011:temp", "A-b_c.d/e:f", "9_"] {
        assert!(valid_name(ok), "{ok}");
    }
    for bad in [
        "", "_a", "-a", ":a", ".a", "/a", "a b", "a\u{e9}", "a#", "a\n",
    ] {
        assert!(!valid_name(bad), "{bad:?}");
    }
}

#[test]
fn base_fields_carry_forward_until_set_again() {
    let records = json(
        r#"[{"bn":"d:","bt":100,"bu":"kg","bv":10,"bs":5,"n":"a","v":1,"s":1},
            {"n":"b","v":2,"u":"g","t":-1},
            {"bn":"e:","bt":200,"n":"c","vs":"x","s":2,"ut":30}]"#,
    )
    .expect("valid pack");
    let expected = [
        (
            "d:a",
            100.0,
            "kg",
            Some(Value::Number(11.0)),
            Some(6.0),
            None,
        ),
        ("d:b", 99.0, "g", Some(Value::Number(12.0)), None, None),
        (
            "e:c",
            200.0,
            "kg",
            Some(Value::String("x".into())),
            Some(7.0),
            Some(30.0),
        ),
    ];
    assert_eq!(records.len(), expected.len());
    for (record, (name, time, unit, value, sum, ut)) in records.iter().zip(expected) {
        assert_eq!(record.name, name);
        assert_eq!(record.time, time);
        assert_eq!(record.unit.as_deref(), Some(unit));
        assert_eq!(record.value, value);
        assert_eq!(record.sum, sum);
        assert_eq!(record.update_time, ut);
    }
}

#[test]
fn cbor_indefinite_lengths_half_floats_and_big_integers_decode() {
    // [_ {_ 0: (_ "a", "b"), 2: 1.0 as half}]
    assert_eq!(
        cbor("9f bf 00 7f 61 61 61 62 ff 02 f9 3c 00 ff ff"),
        Ok(vec![number("ab", 1.0)])
    );
    for (half, value) in [
        ("c4 00", -4.0),
        ("7b ff", 65504.0),
        ("00 01", 2f64.powi(-24)),
        ("80 00", -0.0),
    ] {
        assert_eq!(
            cbor(&format!("81 a2 00 61 61 02 f9 {half}")),
            Ok(vec![number("a", value)]),
            "half {half}"
        );
    }
    assert_eq!(
        cbor("81 a2 00 61 61 02 3b ff ff ff ff ff ff ff ff"),
        Ok(vec![number("a", -18_446_744_073_709_551_616.0)])
    );
    // An indefinite byte string as vd.
    assert_eq!(
        cbor("81 a2 00 61 61 08 5f 41 01 42 02 03 ff"),
        Ok(vec![data("a", &[1, 2, 3])])
    );
}

#[test]
fn json_vd_is_base64url_with_or_without_padding() {
    for text in ["AQI", "AQI="] {
        assert_eq!(
            json(&format!(r#"[{{"n":"a","vd":"{text}"}}]"#)),
            Ok(vec![data("a", &[1, 2])]),
            "{text}"
        );
    }
    assert_eq!(
        json(r#"[{"n":"a","vd":"-_8"}]"#),
        Ok(vec![data("a", &[0xfb, 0xff])])
    );
    // The standard alphabet's + and / are not base64url.
    assert!(matches!(
        json(r#"[{"n":"a","vd":"+/8"}]"#),
        Err(SenmlError::InvalidBase64 { record: 0, .. })
    ));
}

#[test]
fn records_are_resolved_in_order_so_the_first_bad_record_is_reported() {
    // Record 0 has no name; the pack is also cut short later. The earlier problem wins.
    assert_eq!(
        cbor("82 a1 02 01 a1"),
        Err(SenmlError::InvalidName {
            record: 0,
            name: String::new()
        })
    );
}

#[test]
fn a_long_base_name_carried_into_many_empty_records_hits_the_expansion_limit() {
    let base = "a".repeat(1000);
    let mut text = format!(r#"[{{"bn":"{base}"}}"#);
    text.push_str(&",{}".repeat(5000));
    text.push(']');
    assert!(matches!(
        json(&text),
        Err(SenmlError::ExpansionLimit { .. })
    ));
    // The same in CBOR: array(5001), {-2: text(1000)}, then 5000 empty maps.
    let mut wire = hex("99 13 89 a1 21 79 03 e8");
    wire.extend(base.as_bytes());
    wire.extend(std::iter::repeat_n(0xa0, 5000));
    assert!(matches!(
        decode(Format::Cbor, &wire),
        Err(SenmlError::ExpansionLimit { .. })
    ));
    // A handful of records sharing a base name is nowhere near it.
    let mut small = format!(r#"[{{"bn":"{base}"}}"#);
    small.push_str(&",{}".repeat(10));
    small.push(']');
    assert_eq!(json(&small).map(|r| r.len()), Ok(11));
}

#[test]
fn sniff_recognises_json_arrays_and_cbor_array_heads_only() {
    assert_eq!(sniff(b"[]"), Some(Format::Json));
    assert_eq!(sniff(b" \r\n\t[{"), Some(Format::Json));
    assert_eq!(sniff(&[0x80]), Some(Format::Cbor));
    assert_eq!(sniff(&[0x9f, 0xff]), Some(Format::Cbor));
    for other in [
        &b""[..],
        b"  ",
        b"{}",
        b"SLB1",
        &[0xa0],
        &[0x7f],
        &[0xa0, b'['],
        b"x[",
    ] {
        assert_eq!(sniff(other), None, "{other:?}");
    }
}

#[test]
fn error_messages_name_the_record_and_the_field() {
    let err = json(r#"[{"n":"a","v":1},{"n":"b","v":true}]"#).expect_err("wrong type");
    assert_eq!(
        err.to_string(),
        "record[1]: v must be a number, found a boolean"
    );
    let err = cbor("81 a2 00 61 61 02 c4 82 21 19 6a b3").expect_err("tag");
    assert_eq!(
        err.to_string(),
        "CBOR tag 4 at byte 6: SenML packs carry no tags"
    );
}
