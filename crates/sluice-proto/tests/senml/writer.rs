//! The pack writer's exact output, its size accounting and its refusals.

use bytes::Bytes;
use sluice_proto::senml::{decode, Format, PackWriter, Record, SenmlError, Value};

use crate::{hex, number, pack};

fn json(records: &[Record]) -> String {
    String::from_utf8(pack(Format::Json, records)).expect("JSON packs are UTF-8")
}

#[test]
fn a_minimal_record_has_only_a_name_and_a_value() {
    let r = number("a", 72.0);
    assert_eq!(json(std::slice::from_ref(&r)), r#"[{"n":"a","v":72}]"#);
    assert_eq!(pack(Format::Cbor, &[r]), hex("81 a2 00 61 61 02 18 48"));
}

#[test]
fn every_field_is_written_in_order_n_t_u_value_s_ut() {
    let r = Record {
        name: "urn:dev:mac:1122334455667704:spo2".into(),
        time: 1_700_000_000.0,
        unit: Some("/".into()),
        value: Some(Value::Number(0.98)),
        sum: Some(-3.5),
        update_time: Some(60.0),
    };
    assert_eq!(
        json(std::slice::from_ref(&r)),
        r#"[{"n":"urn:dev:mac:1122334455667704:spo2","t":1700000000,"u":"/","v":0.98,"s":-3.5,"ut":60}]"#
    );
    let mut expected = hex("81 a6 00 78 21");
    expected.extend_from_slice(b"urn:dev:mac:1122334455667704:spo2");
    // t 1700000000 (the sheet's `1a 65 53 f1 00`), u "/", v 0.98 (the sheet's double), s -3.5
    // (exact as a single float), ut 60.
    expected.extend(hex(
        "06 1a 65 53 f1 00  01 61 2f  02 fb 3f ef 5c 28 f5 c2 8f 5c  05 fa c0 60 00 00  07 18 3c",
    ));
    assert_eq!(pack(Format::Cbor, &[r]), expected);
}

#[test]
fn string_boolean_and_data_values_use_vs_vb_and_unpadded_base64url_vd() {
    let with = |value| Record {
        value: Some(value),
        ..number("x", 0.0)
    };
    let records = [
        with(Value::String("a \"q\" \\ \n é".into())),
        with(Value::Bool(true)),
        with(Value::Data(Bytes::from_static(&[0xfb, 0xff]))),
    ];
    assert_eq!(
        json(&records),
        r#"[{"n":"x","vs":"a \"q\" \\ \u000a é"},{"n":"x","vb":true},{"n":"x","vd":"-_8"}]"#
    );
    let mut expected = hex("83 a2 00 61 78 03 6c");
    expected.extend_from_slice("a \"q\" \\ \n é".as_bytes());
    expected.extend(hex("a2 00 61 78 04 f5  a2 00 61 78 08 42 fb ff"));
    assert_eq!(pack(Format::Cbor, &records), expected);
}

#[test]
fn json_numbers_print_as_integers_up_to_2_pow_53_and_shortest_round_trip_beyond() {
    let cases: [(f64, &str); 9] = [
        (0.0, "0"),
        (-0.0, "0"),
        (-17.0, "-17"),
        (9_007_199_254_740_992.0, "9007199254740992"),
        (18_014_398_509_481_984.0, "1.8014398509481984e16"),
        (0.1, "0.1"),
        (1e300, "1e300"),
        (-5e-324, "-5e-324"),
        (1_700_000_000.25, "1700000000.25"),
    ];
    for (n, text) in cases {
        assert_eq!(
            json(&[number("x", n)]),
            format!(r#"[{{"n":"x","v":{text}}}]"#)
        );
    }
}

#[test]
fn cbor_numbers_are_integers_when_integral_else_the_shortest_exact_float() {
    let cases: [(f64, &str); 8] = [
        (23.0, "17"),
        (-1.0, "20"),
        (-0.0, "00"),
        (18_446_744_073_709_549_568.0, "1b ff ff ff ff ff ff f8 00"), // largest double < 2^64
        (-18_446_744_073_709_551_616.0, "3b ff ff ff ff ff ff ff ff"), // -2^64
        (18_446_744_073_709_551_616.0, "fa 5f 80 00 00"),             // 2^64: a float
        (0.5, "fa 3f 00 00 00"),
        (0.98, "fb 3f ef 5c 28 f5 c2 8f 5c"),
    ];
    for (n, wire) in cases {
        let mut expected = hex("81 a2 00 61 78 02");
        expected.extend(hex(wire));
        assert_eq!(pack(Format::Cbor, &[number("x", n)]), expected, "{n}");
    }
}

#[test]
fn an_empty_writer_finishes_to_an_empty_pack() {
    assert_eq!(pack(Format::Json, &[]), b"[]");
    assert_eq!(pack(Format::Cbor, &[]), [0x80]);
    assert_eq!(decode(Format::Json, b"[]"), Ok(vec![]));
    assert_eq!(decode(Format::Cbor, &[0x80]), Ok(vec![]));
}

#[test]
fn encoded_len_counts_the_cbor_array_head_growing_at_24_and_256_records() {
    let mut writer = PackWriter::new(Format::Cbor);
    let r = number("n", 1.0);
    for count in 1..=300 {
        writer.push(&r).expect("valid");
        let head = match count {
            0..=23 => 1,
            24..=255 => 2,
            _ => 3,
        };
        assert_eq!(writer.encoded_len(), head + 6 * count, "{count} records");
        assert_eq!(writer.encoded_len(), writer.clone().finish().len());
    }
    let bytes = writer.finish();
    assert_eq!(&bytes[..3], &[0x99, 0x01, 0x2c], "array(300)");
    assert_eq!(decode(Format::Cbor, &bytes).map(|r| r.len()), Ok(300));
}

#[test]
fn push_refuses_invalid_names_and_non_finite_numbers_and_changes_nothing() {
    for format in [Format::Json, Format::Cbor] {
        let mut writer = PackWriter::new(format);
        writer.push(&number("ok", 1.0)).expect("valid");
        let before = (writer.len(), writer.encoded_len(), writer.clone().finish());
        let refused = [
            (number("", 1.0), "empty name"),
            (number("_x", 1.0), "name starting with _"),
            (number("a b", 1.0), "space in name"),
            (number("x", f64::NAN), "NaN value"),
            (
                Record {
                    time: f64::INFINITY,
                    ..number("x", 1.0)
                },
                "infinite time",
            ),
            (
                Record {
                    sum: Some(f64::NEG_INFINITY),
                    ..number("x", 1.0)
                },
                "infinite sum",
            ),
            (
                Record {
                    update_time: Some(f64::NAN),
                    ..number("x", 1.0)
                },
                "NaN update time",
            ),
        ];
        for (record, why) in refused {
            let err = writer.push(&record).expect_err(why);
            assert!(
                matches!(
                    err,
                    SenmlError::InvalidName { record: 1, .. }
                        | SenmlError::NotFinite { record: 1, .. }
                ),
                "{why}: {err}"
            );
            assert_eq!(
                (writer.len(), writer.encoded_len(), writer.clone().finish()),
                before,
                "{why} left the writer unchanged"
            );
        }
        assert_eq!(
            writer.push(&number("_", 1.0)),
            Err(SenmlError::InvalidName {
                record: 1,
                name: "_".into()
            })
        );
    }
}

#[test]
fn a_finished_writer_is_reusable_and_keeps_its_format() {
    for format in [Format::Json, Format::Cbor] {
        let mut writer = PackWriter::new(format);
        writer.push(&number("a", 1.0)).expect("valid");
        let first = writer.finish();
        assert!(writer.is_empty());
        assert_eq!(writer.len(), 0);
        assert_eq!(writer.format(), format);
        writer.push(&number("a", 1.0)).expect("valid");
        assert_eq!(
            writer.finish(),
            first,
            "same records, same bytes after reuse"
        );
    }
}

#[test]
fn content_types_are_the_senml_media_types() {
    assert_eq!(Format::Json.content_type(), "application/senml+json");
    assert_eq!(Format::Cbor.content_type(), "application/senml+cbor");
}

#[test]
fn rollback_to_a_mark_takes_back_exactly_the_records_pushed_since() {
    for format in [Format::Json, Format::Cbor] {
        let mut w = PackWriter::new(format);
        w.push(&number("a", 1.0)).unwrap();
        let mark = w.mark();
        let len_at_mark = w.encoded_len();
        w.push(&number("b", 2.0)).unwrap();
        w.push(&number("c", 3.0)).unwrap();
        assert_eq!(w.len(), 3);
        w.rollback(mark);
        assert_eq!(w.len(), 1);
        assert_eq!(w.encoded_len(), len_at_mark);
        w.push(&number("d", 4.0)).unwrap();
        let bytes = w.finish();
        assert_eq!(
            bytes,
            Bytes::from(pack(format, &[number("a", 1.0), number("d", 4.0)]))
        );
        // A mark from before finish() is ahead of the emptied writer: nothing happens.
        w.push(&number("e", 5.0)).unwrap();
        w.rollback(mark);
        assert_eq!(w.len(), 1);
        assert_eq!(decode(format, &w.finish()).unwrap(), vec![number("e", 5.0)]);
    }
}
