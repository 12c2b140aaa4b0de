//! SenML labels, the raw (unresolved) record both wire decoders fill, and base-field
//! resolution.
//!
//! Owns: which label means which field in JSON and CBOR, the type each field must have, the
//! per-record rules (no duplicate label, at most one value, finite numbers, `bver` ≤ 10) and
//! resolving raw records, one by one, into [`Record`]s. Does not own: reading either wire
//! form.

use bytes::Bytes;

use super::{valid_name, Record, SenmlError, Value, MAX_EXPANSION, MIN_EXPANSION_BUDGET};

/// The highest SenML version this module understands (RFC 8428's).
const SUPPORTED_VERSION: u64 = 10;

/// A registered SenML field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Field {
    BaseVersion,
    BaseName,
    BaseTime,
    BaseUnit,
    BaseValue,
    BaseSum,
    Name,
    Unit,
    Value,
    StringValue,
    BoolValue,
    Sum,
    Time,
    UpdateTime,
    DataValue,
}

impl Field {
    const ALL: [Field; 15] = [
        Field::BaseVersion,
        Field::BaseName,
        Field::BaseTime,
        Field::BaseUnit,
        Field::BaseValue,
        Field::BaseSum,
        Field::Name,
        Field::Unit,
        Field::Value,
        Field::StringValue,
        Field::BoolValue,
        Field::Sum,
        Field::Time,
        Field::UpdateTime,
        Field::DataValue,
    ];

    /// The JSON label; also how errors name the field.
    pub(super) fn json_label(self) -> &'static str {
        match self {
            Field::BaseVersion => "bver",
            Field::BaseName => "bn",
            Field::BaseTime => "bt",
            Field::BaseUnit => "bu",
            Field::BaseValue => "bv",
            Field::BaseSum => "bs",
            Field::Name => "n",
            Field::Unit => "u",
            Field::Value => "v",
            Field::StringValue => "vs",
            Field::BoolValue => "vb",
            Field::Sum => "s",
            Field::Time => "t",
            Field::UpdateTime => "ut",
            Field::DataValue => "vd",
        }
    }

    pub(super) fn cbor_label(self) -> i8 {
        match self {
            Field::BaseVersion => -1,
            Field::BaseName => -2,
            Field::BaseTime => -3,
            Field::BaseUnit => -4,
            Field::BaseValue => -5,
            Field::BaseSum => -6,
            Field::Name => 0,
            Field::Unit => 1,
            Field::Value => 2,
            Field::StringValue => 3,
            Field::BoolValue => 4,
            Field::Sum => 5,
            Field::Time => 6,
            Field::UpdateTime => 7,
            Field::DataValue => 8,
        }
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

/// What a label read from the wire means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Label {
    Field(Field),
    /// Unknown and not must-understand: skip its value.
    Ignored,
    /// A text label ending in `_`.
    MustUnderstand(String),
    /// A negative CBOR label that is not a registered base field.
    UnknownBase(i128),
}

impl Label {
    pub(super) fn from_json(label: &str) -> Label {
        match Field::ALL.iter().find(|f| f.json_label() == label) {
            Some(&field) => Label::Field(field),
            None => Label::from_unknown_text(label),
        }
    }

    /// In CBOR, text labels are never registered fields (those have integer labels).
    pub(super) fn from_unknown_text(label: &str) -> Label {
        if label.ends_with('_') {
            Label::MustUnderstand(label.to_owned())
        } else {
            Label::Ignored
        }
    }

    pub(super) fn from_cbor(label: i128) -> Label {
        match Field::ALL
            .iter()
            .find(|f| i128::from(f.cbor_label()) == label)
        {
            Some(&field) => Label::Field(field),
            None if label < 0 => Label::UnknownBase(label),
            None => Label::Ignored,
        }
    }

    /// The error for a label that cannot be skipped, if this is one.
    pub(super) fn refusal(&self, record: usize) -> Option<SenmlError> {
        match self {
            Label::MustUnderstand(label) => Some(SenmlError::MustUnderstand {
                record,
                label: label.clone(),
            }),
            Label::UnknownBase(label) => Some(SenmlError::UnknownBaseLabel {
                record,
                label: *label,
            }),
            Label::Field(_) | Label::Ignored => None,
        }
    }
}

/// A value as read from the wire, before the field's type is checked.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Scalar {
    Integer(i128),
    Float(f64),
    Text(String),
    Bytes(Vec<u8>),
    Bool(bool),
    /// Anything else (null, array, map, …), named for error messages.
    Other(&'static str),
}

impl Scalar {
    fn kind(&self) -> &'static str {
        match self {
            Scalar::Integer(_) | Scalar::Float(_) => "a number",
            Scalar::Text(_) => "a text string",
            Scalar::Bytes(_) => "a byte string",
            Scalar::Bool(_) => "a boolean",
            Scalar::Other(kind) => kind,
        }
    }
}

/// How `vd` is carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DataEncoding {
    /// JSON: base64url text, padding optional.
    Base64Url,
    /// CBOR: a byte string.
    ByteString,
}

/// One record's fields as found on the wire, before resolution.
#[derive(Debug, Default)]
pub(super) struct RawRecord {
    base_name: Option<String>,
    base_time: Option<f64>,
    base_unit: Option<String>,
    base_value: Option<f64>,
    base_sum: Option<f64>,
    name: Option<String>,
    unit: Option<String>,
    value: Option<(Field, Value)>,
    sum: Option<f64>,
    time: Option<f64>,
    update_time: Option<f64>,
    /// Bit per [`Field`] already set, to refuse duplicates.
    seen: u16,
}

impl RawRecord {
    /// Store `scalar` as `field` of record number `record`, checking its type.
    pub(super) fn set(
        &mut self,
        record: usize,
        field: Field,
        scalar: Scalar,
        data: DataEncoding,
    ) -> Result<(), SenmlError> {
        if self.seen & field.bit() != 0 {
            return Err(SenmlError::DuplicateLabel {
                record,
                label: field.json_label(),
            });
        }
        self.seen |= field.bit();
        let wrong_type = |expected: &'static str, scalar: &Scalar| SenmlError::WrongType {
            record,
            label: field.json_label(),
            expected,
            found: scalar.kind(),
        };
        let number = |scalar: Scalar| -> Result<f64, SenmlError> {
            let n = match scalar {
                // Rounds to the nearest double, as parsing the same decimal would.
                Scalar::Integer(i) => i as f64,
                Scalar::Float(f) => f,
                other => return Err(wrong_type("a number", &other)),
            };
            if n.is_finite() {
                Ok(n)
            } else {
                Err(SenmlError::NotFinite {
                    record,
                    label: field.json_label(),
                })
            }
        };
        let text = |scalar: Scalar| match scalar {
            Scalar::Text(s) => Ok(s),
            other => Err(wrong_type("a text string", &other)),
        };
        match field {
            Field::BaseVersion => match scalar {
                Scalar::Integer(v) if v >= 0 => {
                    let version = u64::try_from(v).unwrap_or(u64::MAX);
                    // Nothing else depends on the version, so it is checked, not kept.
                    if version > SUPPORTED_VERSION {
                        return Err(SenmlError::UnsupportedVersion { record, version });
                    }
                }
                other => return Err(wrong_type("an unsigned integer", &other)),
            },
            Field::BaseName => self.base_name = Some(text(scalar)?),
            Field::BaseTime => self.base_time = Some(number(scalar)?),
            Field::BaseUnit => self.base_unit = Some(text(scalar)?),
            Field::BaseValue => self.base_value = Some(number(scalar)?),
            Field::BaseSum => self.base_sum = Some(number(scalar)?),
            Field::Name => self.name = Some(text(scalar)?),
            Field::Unit => self.unit = Some(text(scalar)?),
            Field::Sum => self.sum = Some(number(scalar)?),
            Field::Time => self.time = Some(number(scalar)?),
            Field::UpdateTime => self.update_time = Some(number(scalar)?),
            Field::Value => self.set_value(record, field, Value::Number(number(scalar)?))?,
            Field::StringValue => self.set_value(record, field, Value::String(text(scalar)?))?,
            Field::BoolValue => match scalar {
                Scalar::Bool(b) => self.set_value(record, field, Value::Bool(b))?,
                other => return Err(wrong_type("a boolean", &other)),
            },
            Field::DataValue => {
                let bytes = match (data, scalar) {
                    (DataEncoding::ByteString, Scalar::Bytes(b)) => b,
                    (DataEncoding::ByteString, other) => {
                        return Err(wrong_type("a byte string", &other))
                    }
                    (DataEncoding::Base64Url, Scalar::Text(s)) => {
                        base64url_decode(&s).map_err(|e| SenmlError::InvalidBase64 {
                            record,
                            reason: e.to_string(),
                        })?
                    }
                    (DataEncoding::Base64Url, other) => {
                        return Err(wrong_type("base64url text", &other))
                    }
                };
                self.set_value(record, field, Value::Data(Bytes::from(bytes)))?
            }
        }
        Ok(())
    }

    fn set_value(&mut self, record: usize, field: Field, value: Value) -> Result<(), SenmlError> {
        if let Some((first, _)) = &self.value {
            return Err(SenmlError::MultipleValues {
                record,
                first: first.json_label(),
                second: field.json_label(),
            });
        }
        self.value = Some((field, value));
        Ok(())
    }
}

/// Base fields in force: set by a record, they stay until a later record sets them again.
#[derive(Default)]
struct Bases {
    name: Option<String>,
    time: Option<f64>,
    unit: Option<String>,
    value: Option<f64>,
    sum: Option<f64>,
}

/// Resolves a pack record by record as the decoders produce them, so no list of raw records
/// is ever held: applies base fields in order, checks names and resolved numbers, and charges
/// every resolved record (its struct, name and unit) against a byte budget.
pub(super) struct Resolver {
    bases: Bases,
    records: Vec<Record>,
    spent: usize,
    budget: usize,
}

impl Resolver {
    /// A resolver for a pack of `input_len` bytes: the budget is [`MAX_EXPANSION`] times that,
    /// but never below [`MIN_EXPANSION_BUDGET`].
    pub(super) fn new(input_len: usize) -> Resolver {
        Resolver {
            bases: Bases::default(),
            records: Vec::new(),
            spent: 0,
            budget: input_len
                .saturating_mul(MAX_EXPANSION)
                .max(MIN_EXPANSION_BUDGET),
        }
    }

    /// Records resolved so far; also the index of the next one.
    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    pub(super) fn push(&mut self, r: RawRecord) -> Result<(), SenmlError> {
        let index = self.records.len();
        let bases = &mut self.bases;
        if r.base_name.is_some() {
            bases.name = r.base_name;
        }
        if r.base_time.is_some() {
            bases.time = r.base_time;
        }
        if r.base_unit.is_some() {
            bases.unit = r.base_unit;
        }
        if r.base_value.is_some() {
            bases.value = r.base_value;
        }
        if r.base_sum.is_some() {
            bases.sum = r.base_sum;
        }
        let base_name = bases.name.as_deref().unwrap_or("");
        let own_name = r.name.as_deref().unwrap_or("");
        let unit_len = r
            .unit
            .as_ref()
            .or(bases.unit.as_ref())
            .map_or(0, String::len);
        // Charged before anything is allocated for this record.
        self.spent = self
            .spent
            .saturating_add(std::mem::size_of::<Record>())
            .saturating_add(base_name.len())
            .saturating_add(own_name.len())
            .saturating_add(unit_len);
        if self.spent > self.budget {
            return Err(SenmlError::ExpansionLimit {
                record: index,
                limit: self.budget,
            });
        }
        let name = [base_name, own_name].concat();
        if !valid_name(&name) {
            return Err(SenmlError::InvalidName {
                record: index,
                name,
            });
        }
        let finite = |label: &'static str, n: f64| {
            if n.is_finite() {
                Ok(n)
            } else {
                Err(SenmlError::NotFinite {
                    record: index,
                    label,
                })
            }
        };
        let time = match (bases.time, r.time) {
            (None, None) => 0.0,
            (Some(t), None) | (None, Some(t)) => t,
            (Some(bt), Some(t)) => finite("bt + t", bt + t)?,
        };
        let value = match r.value {
            Some((_, Value::Number(v))) => Some(Value::Number(match bases.value {
                Some(bv) => finite("bv + v", bv + v)?,
                None => v,
            })),
            Some((_, other)) => Some(other),
            None => None,
        };
        let sum = match (bases.sum, r.sum) {
            (Some(bs), Some(s)) => Some(finite("bs + s", bs + s)?),
            (None, s) => s,
            (Some(_), None) => None,
        };
        let unit = r.unit.or_else(|| bases.unit.clone());
        self.records.push(Record {
            name,
            time,
            unit,
            value,
            sum,
            update_time: r.update_time,
        });
        Ok(())
    }

    pub(super) fn finish(self) -> Vec<Record> {
        self.records
    }
}

/// base64url alphabet; writes no padding, reads with or without it.
const BASE64URL: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    base64::engine::GeneralPurposeConfig::new()
        .with_encode_padding(false)
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

pub(super) fn base64url_decode(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    base64::Engine::decode(&BASE64URL, text)
}

pub(super) fn base64url_encode(data: &[u8], out: &mut String) {
    base64::Engine::encode_string(&BASE64URL, data, out)
}
