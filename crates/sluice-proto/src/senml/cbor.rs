//! SenML CBOR (`application/senml+cbor`, RFC 8949): an array of maps keyed by the integer
//! labels −6…8 (see the module above for the table).
//!
//! Decoding, by hand: every data item starts with a head byte `major << 5 | info`; info 0–23
//! is the argument itself, 24–27 say it follows in 1/2/4/8 big-endian bytes, 28–30 are
//! reserved (malformed) and 31 means indefinite length (byte/text strings, arrays, maps; a
//! `0xff` break ends them) or, for major 7, the break itself. Majors: 0 unsigned and 1 negative
//! (−1 − argument) integers, 2 byte and 3 text strings (indefinite ones are definite chunks of
//! the same major), 4 arrays, 5 maps, 6 tags (refused: SenML needs none, and a tag would change
//! a value's meaning), 7 simple values (20 false, 21 true, 22 null, 23 undefined) and floats
//! (25 half, 26 single, 27 double). Every declared length is checked against the input left
//! before anything is read or allocated: a string needs that many bytes, an array one byte
//! per element, a map two per entry.
//!
//! Encoding, through `minicbor`'s `Encoder` (issue 29: the field's library where we are not
//! faster by hand): a map per record with only the fields present; text strings and byte
//! strings of definite length; numbers as integers when integral within [−2^64, 2^64), else
//! as a single float when that is exact, else a double. minicbor writes the shortest head for
//! every length and integer, which [`head_len`] counts for the pack writer's size.

use minicbor::data::Int;
use minicbor::encode::{Error, Write};
use minicbor::Encoder;

use super::fields::{DataEncoding, Field, Label, RawRecord, Resolver, Scalar};
use super::{Record, SenmlError, Value, MAX_DEPTH};

const MAJOR_UNSIGNED: u8 = 0;
const MAJOR_NEGATIVE: u8 = 1;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const MAJOR_MAP: u8 = 5;
const MAJOR_TAG: u8 = 6;
const MAJOR_SIMPLE: u8 = 7;

const FALSE: u8 = 20;
const TRUE: u8 = 21;
/// The byte that ends an indefinite-length item.
const BREAK: u8 = 0xff;

/// 2^64 as a double: integral numbers in [−2^64, 2^64) are written as CBOR integers.
const TWO_POW_64: f64 = 18_446_744_073_709_551_616.0;

pub(super) fn decode(bytes: &[u8], resolver: &mut Resolver) -> Result<(), SenmlError> {
    let mut r = Reader { bytes, pos: 0 };
    let (offset, head) = r.head()?;
    let count = match head {
        Head::Array(count) => r.check_count(offset, count, 1)?,
        Head::Tag(tag) => return Err(SenmlError::TagNotSupported { offset, tag }),
        other => {
            return Err(SenmlError::NotAnArray {
                found: other.kind(),
            })
        }
    };
    while r.more(count, resolver.len())? {
        let record = r.record(resolver.len())?;
        resolver.push(record)?;
    }
    if r.pos < bytes.len() {
        return Err(SenmlError::TrailingBytes {
            offset: r.pos,
            extra: bytes.len() - r.pos,
        });
    }
    Ok(())
}

/// Append `record` as a CBOR map (minicbor's encoder).
pub(super) fn write_record(record: &Record, out: &mut Vec<u8>) {
    let mut e = Encoder::new(out);
    // Writing to a Vec is infallible (its minicbor error type is `Infallible`).
    let _ = encode_record(record, &mut e);
}

fn encode_record<W: Write>(record: &Record, e: &mut Encoder<W>) -> Result<(), Error<W::Error>> {
    let entries = 1
        + usize::from(record.time != 0.0)
        + usize::from(record.unit.is_some())
        + usize::from(record.value.is_some())
        + usize::from(record.sum.is_some())
        + usize::from(record.update_time.is_some());
    e.map(entries as u64)?;
    e.i8(Field::Name.cbor_label())?.str(&record.name)?;
    if record.time != 0.0 {
        e.i8(Field::Time.cbor_label())?;
        number(e, record.time)?;
    }
    if let Some(unit) = &record.unit {
        e.i8(Field::Unit.cbor_label())?.str(unit)?;
    }
    match &record.value {
        None => {}
        Some(Value::Number(v)) => {
            e.i8(Field::Value.cbor_label())?;
            number(e, *v)?;
        }
        Some(Value::String(s)) => {
            e.i8(Field::StringValue.cbor_label())?.str(s)?;
        }
        Some(Value::Bool(b)) => {
            e.i8(Field::BoolValue.cbor_label())?.bool(*b)?;
        }
        Some(Value::Data(d)) => {
            e.i8(Field::DataValue.cbor_label())?.bytes(d)?;
        }
    }
    if let Some(sum) = record.sum {
        e.i8(Field::Sum.cbor_label())?;
        number(e, sum)?;
    }
    if let Some(ut) = record.update_time {
        e.i8(Field::UpdateTime.cbor_label())?;
        number(e, ut)?;
    }
    Ok(())
}

/// Append the head of a definite-length array of `len` items (minicbor's encoder).
pub(super) fn write_array_head(len: u64, out: &mut Vec<u8>) {
    // Writing to a Vec is infallible.
    let _ = Encoder::new(out).array(len);
}

/// Bytes of the (shortest, as minicbor writes it) head for `argument`: lets the pack writer
/// know its exact size before the array head is written.
pub(super) fn head_len(argument: u64) -> usize {
    match argument {
        0..=23 => 1,
        24..=0xff => 2,
        0x100..=0xffff => 3,
        0x1_0000..=0xffff_ffff => 5,
        _ => 9,
    }
}

/// A finite number (callers check) in the shortest exact form this encoder knows: an integer
/// when integral within [−2^64, 2^64), else a single float when that is exact, else a double.
fn number<W: Write>(e: &mut Encoder<W>, n: f64) -> Result<(), Error<W::Error>> {
    if n.fract() == 0.0 && (-TWO_POW_64..TWO_POW_64).contains(&n) {
        // Integral with |n| ≤ 2^64: exact as an i128, and within CBOR's integer range.
        if let Ok(i) = Int::try_from(n as i128) {
            e.int(i)?;
            return Ok(());
        }
    }
    if f64::from(n as f32) == n {
        e.f32(n as f32)?;
    } else {
        e.f64(n)?;
    }
    Ok(())
}

/// A decoded head (the initial byte and its argument).
#[derive(Clone, Copy, Debug)]
enum Head {
    Unsigned(u64),
    Negative(u64),
    /// `None`: indefinite length.
    Bytes(Option<u64>),
    Text(Option<u64>),
    Array(Option<u64>),
    Map(Option<u64>),
    Tag(u64),
    Simple(u8),
    Float(f64),
    Break,
}

impl Head {
    fn kind(self) -> &'static str {
        match self {
            Head::Unsigned(_) | Head::Negative(_) => "an integer",
            Head::Bytes(_) => "a byte string",
            Head::Text(_) => "a text string",
            Head::Array(_) => "an array",
            Head::Map(_) => "a map",
            Head::Tag(_) => "a tag",
            Head::Simple(FALSE | TRUE) => "a boolean",
            Head::Simple(22) => "null",
            Head::Simple(23) => "undefined",
            Head::Simple(_) => "a simple value",
            Head::Float(_) => "a float",
            Head::Break => "a break",
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, offset: usize, n: usize) -> Result<&[u8], SenmlError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or(SenmlError::Truncated { offset })?;
        let taken = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(taken)
    }

    fn uint(&mut self, offset: usize, n: usize) -> Result<u64, SenmlError> {
        Ok(self
            .take(offset, n)?
            .iter()
            .fold(0u64, |acc, &b| acc << 8 | u64::from(b)))
    }

    /// Read one head; returns its offset too.
    fn head(&mut self) -> Result<(usize, Head), SenmlError> {
        let offset = self.pos;
        let initial = self.take(offset, 1)?[0];
        let (major, info) = (initial >> 5, initial & 0x1f);
        let malformed = |problem| SenmlError::MalformedCbor { offset, problem };
        let argument = match info {
            0..=23 => Some(u64::from(info)),
            24 => Some(self.uint(offset, 1)?),
            25 => Some(self.uint(offset, 2)?),
            26 => Some(self.uint(offset, 4)?),
            27 => Some(self.uint(offset, 8)?),
            28..=30 => return Err(malformed("reserved additional information 28-30")),
            _ => None,
        };
        let head = match (major, argument) {
            (MAJOR_UNSIGNED, Some(a)) => Head::Unsigned(a),
            (MAJOR_NEGATIVE, Some(a)) => Head::Negative(a),
            (MAJOR_BYTES, a) => Head::Bytes(a),
            (MAJOR_TEXT, a) => Head::Text(a),
            (MAJOR_ARRAY, a) => Head::Array(a),
            (MAJOR_MAP, a) => Head::Map(a),
            (MAJOR_TAG, Some(tag)) => Head::Tag(tag),
            (MAJOR_SIMPLE, None) => Head::Break,
            (MAJOR_SIMPLE, Some(a)) => match info {
                0..=23 => Head::Simple(info),
                24 if a < 32 => return Err(malformed("two-byte simple value below 32")),
                24 => Head::Simple(a as u8),
                25 => Head::Float(half_to_f64(a as u16)),
                26 => Head::Float(f64::from(f32::from_bits(a as u32))),
                _ => Head::Float(f64::from_bits(a)),
            },
            _ => return Err(malformed("indefinite length on an integer or tag")),
        };
        Ok((offset, head))
    }

    /// A definite count of items needing at least `min_bytes` bytes each must fit the input.
    fn check_count(
        &self,
        offset: usize,
        count: Option<u64>,
        min_bytes: u64,
    ) -> Result<Option<u64>, SenmlError> {
        if let Some(n) = count {
            let remaining = self.remaining();
            if n.saturating_mul(min_bytes) > remaining as u64 {
                return Err(SenmlError::LengthBeyondInput {
                    offset,
                    declared: n,
                    remaining,
                });
            }
        }
        Ok(count)
    }

    /// Whether another item follows in a container of `count` items (`None`: indefinite, ends
    /// at a break, which this consumes) of which `done` were read.
    fn more(&mut self, count: Option<u64>, done: usize) -> Result<bool, SenmlError> {
        match count {
            Some(n) => Ok((done as u64) < n),
            None => match self.bytes.get(self.pos) {
                Some(&BREAK) => {
                    self.pos += 1;
                    Ok(false)
                }
                Some(_) => Ok(true),
                None => Err(SenmlError::Truncated { offset: self.pos }),
            },
        }
    }

    fn record(&mut self, index: usize) -> Result<RawRecord, SenmlError> {
        let (offset, head) = self.head()?;
        let count = match head {
            Head::Map(count) => self.check_count(offset, count, 2)?,
            Head::Tag(tag) => return Err(SenmlError::TagNotSupported { offset, tag }),
            Head::Break => {
                return Err(SenmlError::MalformedCbor {
                    offset,
                    problem: "break outside an indefinite-length item",
                })
            }
            other => {
                return Err(SenmlError::RecordNotAMap {
                    record: index,
                    found: other.kind(),
                })
            }
        };
        let mut raw = RawRecord::default();
        let mut entries = 0;
        while self.more(count, entries)? {
            entries += 1;
            let label = self.label(index)?;
            if let Some(refused) = label.refusal(index) {
                return Err(refused);
            }
            match label {
                Label::Field(field) => {
                    let scalar = self.scalar(3)?;
                    raw.set(index, field, scalar, DataEncoding::ByteString)?;
                }
                _ => self.skip(3)?,
            }
        }
        Ok(raw)
    }

    fn label(&mut self, index: usize) -> Result<Label, SenmlError> {
        let (offset, head) = self.head()?;
        match head {
            Head::Unsigned(u) => Ok(Label::from_cbor(i128::from(u))),
            Head::Negative(u) => Ok(Label::from_cbor(-1 - i128::from(u))),
            Head::Text(len) => Ok(Label::from_unknown_text(
                &self.string(offset, MAJOR_TEXT, len)?,
            )),
            Head::Tag(tag) => Err(SenmlError::TagNotSupported { offset, tag }),
            Head::Break => Err(SenmlError::MalformedCbor {
                offset,
                problem: "break outside an indefinite-length item",
            }),
            other => Err(SenmlError::LabelNotIntegerOrText {
                record: index,
                found: other.kind(),
            }),
        }
    }

    /// Read a value of a known label at nesting level `depth`.
    fn scalar(&mut self, depth: usize) -> Result<Scalar, SenmlError> {
        let start = self.pos;
        let (offset, head) = self.head()?;
        Ok(match head {
            Head::Unsigned(u) => Scalar::Integer(i128::from(u)),
            Head::Negative(u) => Scalar::Integer(-1 - i128::from(u)),
            Head::Float(f) => Scalar::Float(f),
            Head::Simple(FALSE) => Scalar::Bool(false),
            Head::Simple(TRUE) => Scalar::Bool(true),
            Head::Text(len) => Scalar::Text(self.string(offset, MAJOR_TEXT, len)?),
            Head::Bytes(len) => Scalar::Bytes(self.bytes_item(offset, MAJOR_BYTES, len)?),
            Head::Tag(tag) => return Err(SenmlError::TagNotSupported { offset, tag }),
            Head::Break => {
                return Err(SenmlError::MalformedCbor {
                    offset,
                    problem: "break outside an indefinite-length item",
                })
            }
            Head::Array(_) | Head::Map(_) | Head::Simple(_) => {
                self.pos = start;
                self.skip(depth)?;
                Scalar::Other(head.kind())
            }
        })
    }

    /// Skip one well-formed item at nesting level `depth`.
    fn skip(&mut self, depth: usize) -> Result<(), SenmlError> {
        let (offset, head) = self.head()?;
        if depth > MAX_DEPTH {
            return Err(SenmlError::TooDeep { offset });
        }
        match head {
            Head::Unsigned(_) | Head::Negative(_) | Head::Simple(_) | Head::Float(_) => {}
            Head::Bytes(len) => {
                self.bytes_item(offset, MAJOR_BYTES, len)?;
            }
            Head::Text(len) => {
                self.string(offset, MAJOR_TEXT, len)?;
            }
            Head::Array(count) => {
                let count = self.check_count(offset, count, 1)?;
                let mut done = 0;
                while self.more(count, done)? {
                    done += 1;
                    self.skip(depth + 1)?;
                }
            }
            Head::Map(count) => {
                let count = self.check_count(offset, count, 2)?;
                let mut done = 0;
                while self.more(count, done)? {
                    done += 1;
                    self.skip(depth + 1)?;
                    self.skip(depth + 1)?;
                }
            }
            Head::Tag(tag) => return Err(SenmlError::TagNotSupported { offset, tag }),
            Head::Break => {
                return Err(SenmlError::MalformedCbor {
                    offset,
                    problem: "break outside an indefinite-length item",
                })
            }
        }
        Ok(())
    }

    /// The content of a byte or text string whose head (at `offset`) was just read; an
    /// indefinite one is the concatenation of its definite chunks of the same major type.
    fn bytes_item(
        &mut self,
        offset: usize,
        major: u8,
        len: Option<u64>,
    ) -> Result<Vec<u8>, SenmlError> {
        match len {
            Some(len) => Ok(self.chunk(offset, len)?.to_vec()),
            None => {
                let mut out = Vec::new();
                loop {
                    if !self.more(None, 0)? {
                        return Ok(out);
                    }
                    let (chunk_offset, head) = self.head()?;
                    let len = match (major, head) {
                        (MAJOR_BYTES, Head::Bytes(Some(len)))
                        | (MAJOR_TEXT, Head::Text(Some(len))) => len,
                        _ => {
                            return Err(SenmlError::MalformedCbor {
                                offset: chunk_offset,
                                problem: "a chunk of an indefinite-length string is not a \
                                          definite string of the same type",
                            })
                        }
                    };
                    let chunk = self.chunk(chunk_offset, len)?;
                    if major == MAJOR_TEXT && std::str::from_utf8(chunk).is_err() {
                        return Err(not_utf8(chunk_offset));
                    }
                    out.extend_from_slice(chunk);
                }
            }
        }
    }

    fn string(&mut self, offset: usize, major: u8, len: Option<u64>) -> Result<String, SenmlError> {
        let bytes = self.bytes_item(offset, major, len)?;
        String::from_utf8(bytes).map_err(|_| not_utf8(offset))
    }

    /// `len` bytes of string content, checked against the input before anything is taken.
    fn chunk(&mut self, offset: usize, len: u64) -> Result<&[u8], SenmlError> {
        let remaining = self.remaining();
        match usize::try_from(len) {
            Ok(n) if n <= remaining => self.take(offset, n),
            _ => Err(SenmlError::LengthBeyondInput {
                offset,
                declared: len,
                remaining,
            }),
        }
    }
}

fn not_utf8(offset: usize) -> SenmlError {
    SenmlError::MalformedCbor {
        offset,
        problem: "text string is not valid UTF-8",
    }
}

/// IEEE 754 binary16 to double (exact).
fn half_to_f64(half: u16) -> f64 {
    let sign = if half & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((half >> 10) & 0x1f);
    let mantissa = f64::from(half & 0x3ff);
    let magnitude = match exponent {
        0 => mantissa * 2f64.powi(-24),
        31 if mantissa == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        _ => (mantissa + 1024.0) * 2f64.powi(exponent - 25),
    };
    sign * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(value: Value) -> Vec<u8> {
        let r = Record {
            name: "t".into(),
            time: 0.0,
            unit: None,
            value: Some(value),
            sum: None,
            update_time: None,
        };
        let mut out = Vec::new();
        write_record(&r, &mut out);
        out
    }

    /// Byte-exact output (RFC 8949 heads, RFC 8428 labels: 0 name, 2 value, 4 boolean value):
    /// the number rule the hand-written encoder had, kept through minicbor.
    #[test]
    fn numbers_take_the_shortest_exact_form() {
        let map_name = [0xa2, 0x00, 0x61, b't', 0x02];
        let with = |tail: &[u8]| [&map_name[..], tail].concat();
        assert_eq!(encoded(Value::Number(21.0)), with(&[0x15]));
        assert_eq!(encoded(Value::Number(-500.0)), with(&[0x39, 0x01, 0xf3]));
        assert_eq!(
            encoded(Value::Number(21.5)),
            with(&[0xfa, 0x41, 0xac, 0x00, 0x00])
        );
        assert_eq!(
            encoded(Value::Number(1.1)),
            with(&[0xfb, 0x3f, 0xf1, 0x99, 0x99, 0x99, 0x99, 0x99, 0x9a])
        );
        assert_eq!(
            encoded(Value::Number(-18_446_744_073_709_551_616.0)),
            with(&[0x3b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            "-2^64 is still a CBOR integer"
        );
        assert_eq!(
            encoded(Value::Number(18_446_744_073_709_551_616.0)),
            with(&[0xfa, 0x5f, 0x80, 0x00, 0x00]),
            "2^64 is not: a single float"
        );
        assert_eq!(
            encoded(Value::Bool(true)),
            [0xa2, 0x00, 0x61, b't', 0x04, 0xf5]
        );
        let mut head = Vec::new();
        write_array_head(24, &mut head);
        assert_eq!(head, [0x98, 24]);
        assert_eq!(head_len(24), 2);
    }
}
