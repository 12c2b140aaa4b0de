//! SenML JSON (`application/senml+json`): a JSON array of objects keyed by the labels `bn`,
//! `n`, `v`, … (see the module above for the table).
//!
//! Decoding goes through serde_json (its recursion limit bounds nesting; its
//! `float_roundtrip` feature makes decimal → double exact, which the encoder's round trip
//! relies on) straight into raw records, without building a `serde_json::Value` tree. Values
//! of unknown labels are skipped unparsed. Encoding writes one object per record; numbers
//! print as integers when integral within ±2^53, else in Rust's shortest round-trip form, so
//! they parse back to the same double.

use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::fields::{base64url_encode, DataEncoding, Field, Label, RawRecord, Resolver, Scalar};
use super::{Record, SenmlError, Value};

/// Integers up to this magnitude are exact in a double and print without a fraction.
const MAX_EXACT_INTEGER: f64 = 9_007_199_254_740_992.0; // 2^53

pub(super) fn decode(bytes: &[u8], resolver: &mut Resolver) -> Result<(), SenmlError> {
    let pack: Pack = serde_json::from_slice(bytes).map_err(|e| SenmlError::Json(e.to_string()))?;
    let records = match pack {
        Pack::Records(records) => records,
        Pack::NotAnArray(found) => return Err(SenmlError::NotAnArray { found }),
    };
    for record in records {
        let index = resolver.len();
        let entries = match record {
            Object::Entries(entries) => entries,
            Object::NotAnObject(found) => {
                return Err(SenmlError::RecordNotAMap {
                    record: index,
                    found,
                })
            }
        };
        let mut raw = RawRecord::default();
        for (label, scalar) in entries {
            match label {
                Label::Field(field) => raw.set(index, field, scalar, DataEncoding::Base64Url)?,
                Label::Ignored => {}
                refused => {
                    if let Some(e) = refused.refusal(index) {
                        return Err(e);
                    }
                }
            }
        }
        resolver.push(raw)?;
    }
    Ok(())
}

/// Append record `record` as a JSON object.
pub(super) fn write_record(record: &Record, out: &mut Vec<u8>) {
    out.push(b'{');
    write_label(Field::Name, out);
    write_string(&record.name, out);
    if record.time != 0.0 {
        write_label(Field::Time, out);
        write_number(record.time, out);
    }
    if let Some(unit) = &record.unit {
        write_label(Field::Unit, out);
        write_string(unit, out);
    }
    match &record.value {
        None => {}
        Some(Value::Number(v)) => {
            write_label(Field::Value, out);
            write_number(*v, out);
        }
        Some(Value::String(s)) => {
            write_label(Field::StringValue, out);
            write_string(s, out);
        }
        Some(Value::Bool(b)) => {
            write_label(Field::BoolValue, out);
            out.extend_from_slice(if *b { b"true" } else { b"false" });
        }
        Some(Value::Data(d)) => {
            write_label(Field::DataValue, out);
            let mut text = String::with_capacity(d.len().div_ceil(3) * 4);
            base64url_encode(d, &mut text);
            out.push(b'"');
            out.extend_from_slice(text.as_bytes());
            out.push(b'"');
        }
    }
    if let Some(sum) = record.sum {
        write_label(Field::Sum, out);
        write_number(sum, out);
    }
    if let Some(ut) = record.update_time {
        write_label(Field::UpdateTime, out);
        write_number(ut, out);
    }
    out.push(b'}');
}

/// `"label":`, preceded by a comma unless it is the object's first member.
fn write_label(field: Field, out: &mut Vec<u8>) {
    if out.last() != Some(&b'{') {
        out.push(b',');
    }
    out.push(b'"');
    out.extend_from_slice(field.json_label().as_bytes());
    out.extend_from_slice(b"\":");
}

/// A JSON string literal: `"` and `\` escaped, control characters as `\u00XX`, everything
/// else as UTF-8.
fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x00..=0x1f => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0x0f)]);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

/// A finite number (callers check) that parses back to the same double.
fn write_number(n: f64, out: &mut Vec<u8>) {
    use std::io::Write as _;
    // Invariant: writing to a Vec<u8> cannot fail, so the io::Result carries nothing.
    let _ = if n.fract() == 0.0 && n.abs() <= MAX_EXACT_INTEGER {
        // Exact: the value is an integer of at most 54 bits.
        write!(out, "{}", n as i64)
    } else {
        // Debug prints the shortest digits that round-trip, with an exponent for very large
        // or small magnitudes (`1e300`, `5e-324`): valid JSON numbers either way.
        write!(out, "{n:?}")
    };
}

/// The top-level value.
enum Pack {
    Records(Vec<Object>),
    NotAnArray(&'static str),
}

/// One element of the top-level array.
enum Object {
    /// Its members with labels that matter, in order; ignored labels are left out.
    Entries(Vec<(Label, Scalar)>),
    NotAnObject(&'static str),
}

impl<'de> Deserialize<'de> for Pack {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct PackVisitor;
        impl<'de> Visitor<'de> for PackVisitor {
            type Value = Pack;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a SenML pack")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Pack, A::Error> {
                let mut records = Vec::new();
                while let Some(record) = seq.next_element::<Object>()? {
                    records.push(record);
                }
                Ok(Pack::Records(records))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Pack, A::Error> {
                drain_map(map).map(Pack::NotAnArray)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Pack, E> {
                Ok(Pack::NotAnArray("a boolean"))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Pack, E> {
                Ok(Pack::NotAnArray("a number"))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Pack, E> {
                Ok(Pack::NotAnArray("a number"))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Pack, E> {
                Ok(Pack::NotAnArray("a number"))
            }
            fn visit_str<E>(self, _: &str) -> Result<Pack, E> {
                Ok(Pack::NotAnArray("a string"))
            }
            fn visit_unit<E>(self) -> Result<Pack, E> {
                Ok(Pack::NotAnArray("null"))
            }
        }
        d.deserialize_any(PackVisitor)
    }
}

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor;
        impl<'de> Visitor<'de> for ObjectVisitor {
            type Value = Object;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a SenML record")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Object, A::Error> {
                let mut entries = Vec::new();
                while let Some(label) = map.next_key::<Label>()? {
                    match label {
                        Label::Ignored => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        label => {
                            let scalar = map.next_value::<Scalar>()?;
                            entries.push((label, scalar));
                        }
                    }
                }
                Ok(Object::Entries(entries))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Object, A::Error> {
                drain_seq(seq).map(Object::NotAnObject)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Object, E> {
                Ok(Object::NotAnObject("a boolean"))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Object, E> {
                Ok(Object::NotAnObject("a number"))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Object, E> {
                Ok(Object::NotAnObject("a number"))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Object, E> {
                Ok(Object::NotAnObject("a number"))
            }
            fn visit_str<E>(self, _: &str) -> Result<Object, E> {
                Ok(Object::NotAnObject("a string"))
            }
            fn visit_unit<E>(self) -> Result<Object, E> {
                Ok(Object::NotAnObject("null"))
            }
        }
        d.deserialize_any(ObjectVisitor)
    }
}

impl<'de> Deserialize<'de> for Label {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct LabelVisitor;
        impl Visitor<'_> for LabelVisitor {
            type Value = Label;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a SenML label")
            }
            fn visit_str<E>(self, label: &str) -> Result<Label, E> {
                Ok(Label::from_json(label))
            }
        }
        d.deserialize_str(LabelVisitor)
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl<'de> Visitor<'de> for ScalarVisitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a SenML field value")
            }
            fn visit_bool<E>(self, b: bool) -> Result<Scalar, E> {
                Ok(Scalar::Bool(b))
            }
            fn visit_i64<E>(self, i: i64) -> Result<Scalar, E> {
                Ok(Scalar::Integer(i128::from(i)))
            }
            fn visit_u64<E>(self, u: u64) -> Result<Scalar, E> {
                Ok(Scalar::Integer(i128::from(u)))
            }
            fn visit_f64<E>(self, f: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(f))
            }
            fn visit_str<E>(self, s: &str) -> Result<Scalar, E> {
                Ok(Scalar::Text(s.to_owned()))
            }
            fn visit_string<E>(self, s: String) -> Result<Scalar, E> {
                Ok(Scalar::Text(s))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Other("null"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Scalar, A::Error> {
                drain_seq(seq).map(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Scalar, A::Error> {
                drain_map(map).map(Scalar::Other)
            }
        }
        d.deserialize_any(ScalarVisitor)
    }
}

fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<&'static str, A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok("an array")
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<&'static str, A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok("an object")
}
