//! Tests of the SenML codec through its public API: the fact sheet's vectors and examples,
//! the writer's exact output, malformed packs, round trips and arbitrary bytes.

#[path = "senml/arbitrary_bytes.rs"]
mod arbitrary_bytes;
#[path = "senml/malformed.rs"]
mod malformed;
#[path = "senml/round_trip.rs"]
mod round_trip;
#[path = "senml/strategies.rs"]
mod strategies;
#[path = "senml/vectors.rs"]
mod vectors;
#[path = "senml/writer.rs"]
mod writer;

use sluice_proto::senml::{decode, Format, PackWriter, Record, Value};

/// Bytes from a hex string with optional whitespace.
pub fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len().is_multiple_of(2), "odd number of hex digits");
    digits
        .chunks(2)
        .map(|pair| {
            let text = std::str::from_utf8(pair).expect("ascii");
            u8::from_str_radix(text, 16).expect("hex digit")
        })
        .collect()
}

/// A record with only a name and a numeric value, at time 0.
pub fn number(name: &str, value: f64) -> Record {
    Record {
        name: name.to_string(),
        time: 0.0,
        unit: None,
        value: Some(Value::Number(value)),
        sum: None,
        update_time: None,
    }
}

/// Encode `records` as one pack, checking `encoded_len` after every push.
pub fn pack(format: Format, records: &[Record]) -> Vec<u8> {
    let mut writer = PackWriter::new(format);
    for record in records {
        writer.push(record).expect("a valid record encodes");
        assert_eq!(writer.encoded_len(), writer.clone().finish().len());
    }
    assert_eq!(writer.len(), records.len());
    let len = writer.encoded_len();
    let bytes = writer.finish();
    assert_eq!(bytes.len(), len, "encoded_len() is what finish() returns");
    assert!(writer.is_empty(), "finish() resets the writer");
    bytes.to_vec()
}

/// Whatever decodes re-encodes, in both formats, to bytes that decode to the same records.
pub fn assert_reencodes(records: &[Record]) {
    for format in [Format::Json, Format::Cbor] {
        let bytes = pack(format, records);
        assert_eq!(
            decode(format, &bytes).as_deref(),
            Ok(records),
            "{format:?} re-encoding: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
}
