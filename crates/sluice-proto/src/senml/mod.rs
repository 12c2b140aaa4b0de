//! SenML (RFC 8428) packs in JSON and CBOR: decoding with base-field resolution, and an
//! incremental pack encoder.
//!
//! Owns: the two wire forms of a SenML pack, resolving base fields into plain [`Record`]s, the
//! name rule ([`valid_name`]) and format sniffing. Does not own: units or their conversion,
//! relative times (a time below 2^28 means "seconds from now" — turning it into an absolute
//! time needs a clock, which the caller has and this module does not), what the records mean.
//!
//! Wire format (labels from RFC 8428 §4.1 and §6):
//!
//! | field | JSON | CBOR | type |
//! |---|---|---|---|
//! | base version | `bver` | −1 | unsigned integer (≤ 10 understood) |
//! | base name / time / unit / value / sum | `bn` `bt` `bu` `bv` `bs` | −2 … −6 | text, number, text, number, number |
//! | name, unit | `n`, `u` | 0, 1 | text |
//! | value, string / boolean / data value | `v`, `vs`, `vb`, `vd` | 2, 3, 4, 8 | number, text, boolean, data |
//! | sum, time, update time | `s`, `t`, `ut` | 5, 6, 7 | number |
//!
//! A pack is a JSON array of objects or a CBOR array of maps. `vd` is base64url text in JSON
//! (written without padding, read with or without) and a byte string in CBOR. CBOR numbers are
//! integers or floats (half, single, double); tags are not accepted. Base fields apply to the
//! record that holds them and to every later one until set again; resolving gives
//! name = `bn`+`n`, time = `bt`+`t`, unit = `u` else `bu`, value = `bv`+`v` (numbers only),
//! sum = `bs`+`s`.
//!
//! Decoding rules, beyond the types above: a label ending in `_` ("must understand") and an
//! unknown negative CBOR label are errors; other unknown labels are skipped. A label may appear
//! once per record, and a record carries at most one of `v`/`vs`/`vb`/`vd`. Numbers must be
//! finite, before and after resolution. Every resolved name must satisfy [`valid_name`].
//!
//! Invariants:
//! - [`decode`] never panics. It allocates nothing on a length it has not checked against the
//!   input left, recurses at most [`MAX_DEPTH`] levels into skipped CBOR values (serde_json
//!   bounds JSON nesting), resolves records as it reads them (no second copy of the pack), and
//!   refuses packs whose resolved records — structs, names and units — would take more than
//!   [`MAX_EXPANSION`] times the input's size (at least [`MIN_EXPANSION_BUDGET`]): a long base
//!   name carried into many one-byte records would otherwise cost quadratic memory.
//! - Whatever [`decode`] returns, [`PackWriter`] accepts and encodes, in either format, to
//!   bytes that decode to equal records (names and numbers are already checked; the writer
//!   emits no base fields, so nothing needs resolving twice).
//! - [`PackWriter::encoded_len`] is always the exact length [`PackWriter::finish`] returns.
//!
//! Layout: `fields` (labels, the raw record of one map/object, resolution), `json` and `cbor`
//! (the two wire forms, each a decoder feeding raw records to the resolver, and a record
//! encoder), `writer`
//! ([`PackWriter`]). Tests live in `tests/senml/`, the fuzz target in
//! `fuzz/fuzz_targets/senml_decode.rs`.

mod cbor;
mod fields;
mod json;
mod writer;

pub use writer::{PackMark, PackWriter};

/// How deep [`decode`] descends into nested CBOR values of unknown labels (the pack is level 1,
/// a record level 2).
pub const MAX_DEPTH: usize = 16;

/// The records [`decode`] returns (their structs plus resolved names and units) may take at
/// most this many times the input's length in bytes …
pub const MAX_EXPANSION: usize = 128;

/// … or this many bytes, whichever is more.
pub const MIN_EXPANSION_BUDGET: usize = 64 * 1024;

/// The two SenML serialisations this module reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Json,
    Cbor,
}

impl Format {
    /// The media type (`application/senml+json`, CoAP Content-Format 110, or
    /// `application/senml+cbor`, 112).
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Json => "application/senml+json",
            Format::Cbor => "application/senml+cbor",
        }
    }
}

/// The value of a record: exactly one of `v`, `vs`, `vb`, `vd`.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `v`; always finite.
    Number(f64),
    /// `vs`.
    String(String),
    /// `vb`.
    Bool(bool),
    /// `vd`: opaque bytes.
    Data(bytes::Bytes),
}

/// A resolved record (base fields already applied): name = bn+n, time = bt+t (0 when both
/// absent), unit = u or bu, value = bv+v for numbers, sum = bs+s.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Satisfies [`valid_name`].
    pub name: String,
    /// Seconds: ≥ 2^28 absolute (since the UNIX epoch), below that relative to now.
    pub time: f64,
    pub unit: Option<String>,
    pub value: Option<Value>,
    pub sum: Option<f64>,
    /// Seconds until the sensor reports a new value at the latest.
    pub update_time: Option<f64>,
}

/// Why a pack could not be decoded or a record not encoded. Record indices count from 0 in
/// pack order; byte offsets count from the start of the input. Every variant blames the
/// producer of the pack (a device or a caller); retrying the same bytes cannot help.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SenmlError {
    #[error("SenML JSON is not well-formed JSON: {0}")]
    Json(String),
    #[error("a SenML pack must be an array of records, found {found}")]
    NotAnArray { found: &'static str },
    #[error("CBOR input ends early: the item at byte {offset} is incomplete")]
    Truncated { offset: usize },
    #[error(
        "CBOR item at byte {offset} declares {declared} elements or bytes, more than the \
         {remaining} bytes left"
    )]
    LengthBeyondInput {
        offset: usize,
        declared: u64,
        remaining: usize,
    },
    #[error("CBOR is not well-formed at byte {offset}: {problem}")]
    MalformedCbor {
        offset: usize,
        problem: &'static str,
    },
    #[error("CBOR tag {tag} at byte {offset}: SenML packs carry no tags")]
    TagNotSupported { offset: usize, tag: u64 },
    #[error("CBOR value at byte {offset} nests deeper than {max} levels", max = MAX_DEPTH)]
    TooDeep { offset: usize },
    #[error("{extra} bytes follow the end of the CBOR pack at byte {offset}")]
    TrailingBytes { offset: usize, extra: usize },
    #[error("record[{record}] is {found}, not a map of labels to values")]
    RecordNotAMap { record: usize, found: &'static str },
    #[error("record[{record}] has a label that is {found}, not an integer or a text string")]
    LabelNotIntegerOrText { record: usize, found: &'static str },
    #[error("record[{record}] has the label {label} more than once")]
    DuplicateLabel { record: usize, label: &'static str },
    #[error("record[{record}] has the unknown base label {label} (negative CBOR labels must be understood)")]
    UnknownBaseLabel { record: usize, label: i128 },
    #[error("record[{record}] has the label {label:?}, which ends in '_' (must be understood) and is not supported")]
    MustUnderstand { record: usize, label: String },
    #[error("record[{record}]: {label} must be {expected}, found {found}")]
    WrongType {
        record: usize,
        label: &'static str,
        expected: &'static str,
        found: &'static str,
    },
    #[error("record[{record}]: vd is not base64url: {reason}")]
    InvalidBase64 { record: usize, reason: String },
    #[error("record[{record}]: {label} is not a finite number")]
    NotFinite { record: usize, label: &'static str },
    #[error("record[{record}] has SenML version {version}; versions up to 10 are understood")]
    UnsupportedVersion { record: usize, version: u64 },
    #[error("record[{record}] has two values, {first} and {second}; a record carries at most one")]
    MultipleValues {
        record: usize,
        first: &'static str,
        second: &'static str,
    },
    #[error(
        "record[{record}] resolves to the name {name:?}, which is not a valid SenML name \
         (non-empty; A-Z a-z 0-9 - : . / _; starting with a letter or digit)"
    )]
    InvalidName { record: usize, name: String },
    #[error(
        "record[{record}]: the resolved records would exceed {limit} bytes ({factor} times the \
         input); a long base name or unit repeated into very many short records?",
        factor = MAX_EXPANSION
    )]
    ExpansionLimit { record: usize, limit: usize },
}

/// Decode a whole pack and resolve base fields. Never panics on any input; bounded
/// recursion/allocation (a length prefix larger than the remaining input is an error, not an
/// allocation).
pub fn decode(format: Format, bytes: &[u8]) -> Result<Vec<Record>, SenmlError> {
    let mut resolver = fields::Resolver::new(bytes.len());
    match format {
        Format::Json => json::decode(bytes, &mut resolver)?,
        Format::Cbor => cbor::decode(bytes, &mut resolver)?,
    }
    Ok(resolver.finish())
}

/// Guess the format from the first byte: JSON when the first non-whitespace byte is '[', CBOR
/// when it is a CBOR array head (major type 4, 0x80..=0x9f). None otherwise.
pub fn sniff(bytes: &[u8]) -> Option<Format> {
    match bytes.first()? {
        0x80..=0x9f => Some(Format::Cbor),
        _ => match bytes
            .iter()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))?
        {
            b'[' => Some(Format::Json),
            _ => None,
        },
    }
}

/// true when `name` is a valid resolved SenML name (chars A-Z a-z 0-9 - : . / _, starts with
/// letter or digit, non-empty).
pub fn valid_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    match bytes.first() {
        Some(first) if first.is_ascii_alphanumeric() => bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b':' | b'.' | b'/' | b'_')),
        _ => false,
    }
}
