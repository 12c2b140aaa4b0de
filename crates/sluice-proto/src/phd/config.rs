//! Configurations (fact sheet §5, §7): the object table of an agent's configuration — which
//! handle measures what, in which unit, and how its fixed-format observations are laid out —
//! the configuration report (MDC_NOTI_CONFIG) that carries one, its response, and the standard
//! configurations a manager knows without a report.
//!
//! Owns: [`ObjectTable`] and [`MetricObject`]; decoding and encoding a ConfigReport's
//! event-info; checking a table before it is stored ([`ObjectTable::check`]); the built-in
//! standard tables ([`standard`]). Does not own: where tables are stored or for whom (the
//! gateway's agent table), scan-report decoding (`scan.rs`).
//!
//! # Wire format (ConfigReport, the event-info of a confirmed event report of type 0x0D1C)
//! `config-report-id u16 · config-obj-list SEQUENCE OF { obj-class u16 · obj-handle u16 ·
//! attributes AttributeList }`, where AttributeList = SEQUENCE OF { attribute-id u16 ·
//! value ANY }. Attributes this module reads: Type (0x092F), Unit-Code (0x0996),
//! Attribute-Value-Map (0x0A55), Metric-Id-List (0x0A76: the components of a compound).
//! Unknown attributes are skipped (each carries its length).
//!
//! # Invariants
//! - At most [`MAX_OBJECTS`] objects and [`MAX_MAP`] value-map entries per object: a config
//!   report is agent input and the table is kept (and persisted) by the manager.
//! - A table that passes [`ObjectTable::check`] has unique non-zero handles, and every
//!   value-map entry of a known attribute has that attribute's length.

use std::sync::OnceLock;

use bytes::{Bytes, BytesMut};

use super::mder::{DecodeError, Reader, Writer};

/// MDC_NOTI_CONFIG.
pub const NOTI_CONFIG: u16 = 0x0D1C;

/// Most objects a table may hold.
pub const MAX_OBJECTS: usize = 64;
/// Most value-map entries per object.
pub const MAX_MAP: usize = 16;

/// Object classes (partition OBJ).
pub mod class {
    pub const METRIC_ENUM: u16 = 5;
    pub const METRIC_NU: u16 = 6;
    pub const METRIC_SA_RT: u16 = 9;
}

/// Attribute ids (fact sheet §12).
pub mod attr {
    pub const ID_TYPE: u16 = 0x092F;
    pub const ID_MODEL: u16 = 0x0928;
    pub const UNIT_CODE: u16 = 0x0996;
    pub const ATTRIBUTE_VAL_MAP: u16 = 0x0A55;
    pub const ID_PHYSIO_LIST: u16 = 0x0A76;
    pub const METRIC_SPEC_SMALL: u16 = 0x0A46;
    pub const METRIC_STRUCT_SMALL: u16 = 0x0A73;
    pub const SUPPLEMENTAL_TYPES: u16 = 0x0A61;
    pub const NU_VAL_OBS_BASIC: u16 = 0x0A4C;
    pub const NU_VAL_OBS_SIMP: u16 = 0x0A56;
    pub const NU_VAL_OBS: u16 = 0x0950;
    pub const NU_CMPD_VAL_OBS_BASIC: u16 = 0x0A75;
    pub const NU_CMPD_VAL_OBS_SIMP: u16 = 0x0A74;
    pub const NU_CMPD_VAL_OBS: u16 = 0x094B;
    pub const TIME_STAMP_ABS: u16 = 0x0990;
    /// The MDS clock; some oximeters put it in value maps where 0x0990 belongs (§13 quirk).
    pub const TIME_ABS: u16 = 0x0987;
    pub const TIME_STAMP_REL: u16 = 0x0991;
    pub const TIME_STAMP_REL_HI_RES: u16 = 0x09E9;
    pub const MSMT_STAT: u16 = 0x0947;
    pub const ENUM_OBS_VAL_SIMP_OID: u16 = 0x0A49;
    pub const TIME_PD_MSMT_ACTIVE: u16 = 0x0A59;
    pub const SYS_ID: u16 = 0x0984;
    pub const DEV_CONFIG_ID: u16 = 0x0A44;
}

/// ConfigReportRsp results (§7).
pub mod config_result {
    pub const ACCEPTED: u16 = 0;
    pub const UNSUPPORTED: u16 = 1;
    pub const STANDARD_UNKNOWN: u16 = 2;
}

/// One object of a configuration (a metric: numeric, enumeration or real-time sample array).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricObject {
    pub class: u16,
    pub handle: u16,
    /// TYPE: (partition, code); partition 2 (SCADA) for measurements.
    pub kind: (u16, u16),
    pub unit: Option<u16>,
    /// Attribute-Value-Map: (attribute-id, length) of each attribute in a fixed observation.
    pub value_map: Vec<(u16, u16)>,
    /// Metric-Id-List: the codes of a compound's components (e.g. sys, dia, mean).
    pub components: Vec<u16>,
}

/// The objects of one configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectTable {
    pub config_id: u16,
    pub objects: Vec<MetricObject>,
}

/// Why a configuration report cannot be accepted (the answer is unsupported-config).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigProblem {
    #[error("no objects")]
    Empty,
    #[error("{0} objects exceed the limit of {MAX_OBJECTS}")]
    TooManyObjects(usize),
    #[error("object handle 0 is the MDS")]
    HandleZero,
    #[error("object handle {0} appears twice")]
    DuplicateHandle(u16),
    #[error("object {0} has no Type")]
    NoType(u16),
    #[error("object {handle}: attribute {attr:#06x} with length {len} (expected {expected})")]
    BadMapLength {
        handle: u16,
        attr: u16,
        len: u16,
        expected: u16,
    },
}

/// The fixed length of an attribute as it appears in a value map, when it has one.
/// Compounds are `4 + n × element`, checked separately.
pub fn attr_len(attr_id: u16) -> Option<u16> {
    Some(match attr_id {
        attr::NU_VAL_OBS_BASIC | attr::MSMT_STAT | attr::ENUM_OBS_VAL_SIMP_OID => 2,
        attr::NU_VAL_OBS_SIMP | attr::TIME_STAMP_REL | attr::TIME_PD_MSMT_ACTIVE => 4,
        attr::TIME_STAMP_ABS | attr::TIME_ABS | attr::TIME_STAMP_REL_HI_RES => 8,
        attr::NU_VAL_OBS => 10,
        _ => return None,
    })
}

fn compound_element(attr_id: u16) -> Option<u16> {
    match attr_id {
        attr::NU_CMPD_VAL_OBS_BASIC => Some(2),
        attr::NU_CMPD_VAL_OBS_SIMP => Some(4),
        attr::NU_CMPD_VAL_OBS => Some(10),
        _ => None,
    }
}

impl ObjectTable {
    pub fn object(&self, handle: u16) -> Option<&MetricObject> {
        self.objects.iter().find(|o| o.handle == handle)
    }

    /// Decode a ConfigReport (the event-info of an MDC_NOTI_CONFIG report).
    pub fn decode_report(info: Bytes) -> Result<ObjectTable, DecodeError> {
        let mut r = Reader::new(info);
        let config_id = r.u16("config-report-id")?;
        let (count, mut list) = r.seq("config-obj-list")?;
        if count > MAX_OBJECTS {
            return Err(DecodeError::BadSequence {
                what: "config-obj-list (too many objects)",
                count,
                len: MAX_OBJECTS,
            });
        }
        let mut objects = Vec::with_capacity(count);
        for _ in 0..count {
            let class = list.u16("obj-class")?;
            let handle = list.u16("obj-handle")?;
            let mut object = MetricObject {
                class,
                handle,
                kind: (0, 0),
                unit: None,
                value_map: Vec::new(),
                components: Vec::new(),
            };
            let (n, mut attrs) = list.seq("attribute-list")?;
            for _ in 0..n {
                let id = attrs.u16("attribute-id")?;
                let mut v = Reader::new(attrs.octets("attribute-value")?);
                match id {
                    attr::ID_TYPE => object.kind = (v.u16("TYPE partition")?, v.u16("TYPE code")?),
                    attr::UNIT_CODE => object.unit = Some(v.u16("unit-code")?),
                    attr::ATTRIBUTE_VAL_MAP => {
                        let (m, mut map) = v.seq("attribute-value-map")?;
                        if m > MAX_MAP {
                            return Err(DecodeError::BadSequence {
                                what: "attribute-value-map (too many entries)",
                                count: m,
                                len: MAX_MAP,
                            });
                        }
                        for _ in 0..m {
                            object
                                .value_map
                                .push((map.u16("value-map id")?, map.u16("value-map length")?));
                        }
                        map.finish("attribute-value-map")?;
                    }
                    attr::ID_PHYSIO_LIST => {
                        let (m, mut ids) = v.seq("metric-id-list")?;
                        for _ in 0..m.min(MAX_MAP) {
                            object.components.push(ids.u16("metric-id")?);
                        }
                    }
                    _ => {} // skipped: it carried its own length
                }
            }
            attrs.finish("attribute-list")?;
            objects.push(object);
        }
        list.finish("config-obj-list")?;
        // Trailing bytes after the report are tolerated (some agents pad).
        Ok(ObjectTable { config_id, objects })
    }

    /// Encode as a ConfigReport event-info (what an agent sends; used by tests and the bench).
    pub fn encode_report(&self) -> Bytes {
        let mut list = BytesMut::new();
        for o in &self.objects {
            list.u16_be(o.class);
            list.u16_be(o.handle);
            let mut attrs = BytesMut::new();
            let mut n = 0;
            let mut kind = BytesMut::new();
            kind.u16_be(o.kind.0);
            kind.u16_be(o.kind.1);
            attrs.u16_be(attr::ID_TYPE);
            attrs.octets(&kind);
            n += 1;
            if let Some(unit) = o.unit {
                attrs.u16_be(attr::UNIT_CODE);
                attrs.octets(&unit.to_be_bytes());
                n += 1;
            }
            if !o.components.is_empty() {
                let ids: Vec<u8> = o.components.iter().flat_map(|c| c.to_be_bytes()).collect();
                let mut seq = BytesMut::new();
                seq.seq(o.components.len(), &ids);
                attrs.u16_be(attr::ID_PHYSIO_LIST);
                attrs.octets(&seq);
                n += 1;
            }
            if !o.value_map.is_empty() {
                let map: Vec<u8> = o
                    .value_map
                    .iter()
                    .flat_map(|(a, l)| [a.to_be_bytes(), l.to_be_bytes()].concat())
                    .collect();
                let mut seq = BytesMut::new();
                seq.seq(o.value_map.len(), &map);
                attrs.u16_be(attr::ATTRIBUTE_VAL_MAP);
                attrs.octets(&seq);
                n += 1;
            }
            list.seq(n, &attrs);
        }
        let mut out = BytesMut::new();
        out.u16_be(self.config_id);
        out.seq(self.objects.len(), &list);
        out.freeze()
    }

    /// Whether the table can be used to decode reports (else: unsupported-config).
    pub fn check(&self) -> Result<(), ConfigProblem> {
        if self.objects.is_empty() {
            return Err(ConfigProblem::Empty);
        }
        if self.objects.len() > MAX_OBJECTS {
            return Err(ConfigProblem::TooManyObjects(self.objects.len()));
        }
        for (i, o) in self.objects.iter().enumerate() {
            if o.handle == 0 {
                return Err(ConfigProblem::HandleZero);
            }
            if self.objects[..i].iter().any(|p| p.handle == o.handle) {
                return Err(ConfigProblem::DuplicateHandle(o.handle));
            }
            if o.kind == (0, 0) {
                return Err(ConfigProblem::NoType(o.handle));
            }
            for &(a, len) in &o.value_map {
                let expected = attr_len(a).or_else(|| {
                    let el = compound_element(a)?;
                    // A compound: count · length · n elements.
                    let n = len.checked_sub(4)? / el;
                    Some(4 + n * el)
                });
                if let Some(expected) = expected {
                    if expected != len {
                        return Err(ConfigProblem::BadMapLength {
                            handle: o.handle,
                            attr: a,
                            len,
                            expected,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

/// The event-reply-info of the manager's answer to a config report: ConfigReportRsp.
pub fn encode_config_response(config_id: u16, result: u16) -> Bytes {
    let mut b = BytesMut::with_capacity(4);
    b.u16_be(config_id);
    b.u16_be(result);
    b.freeze()
}

/// Decode a ConfigReportRsp (agents and tests read it).
pub fn decode_config_response(b: Bytes) -> Result<(u16, u16), DecodeError> {
    let mut r = Reader::new(b);
    let v = (r.u16("config-report-id")?, r.u16("config-result")?);
    r.finish("ConfigReportRsp")?;
    Ok(v)
}

fn numeric(handle: u16, code: u16, unit: u16, map: &[(u16, u16)]) -> MetricObject {
    MetricObject {
        class: class::METRIC_NU,
        handle,
        kind: (2, code),
        unit: Some(unit),
        value_map: map.to_vec(),
        components: Vec::new(),
    }
}

const SFLOAT_ONLY: &[(u16, u16)] = &[(attr::NU_VAL_OBS_BASIC, 2)];
const SFLOAT_TIME: &[(u16, u16)] = &[(attr::NU_VAL_OBS_BASIC, 2), (attr::TIME_STAMP_ABS, 8)];
const FLOAT_TIME: &[(u16, u16)] = &[(attr::NU_VAL_OBS_SIMP, 4), (attr::TIME_STAMP_ABS, 8)];

/// Standard configuration ids this manager implements.
pub const STANDARD_IDS: &[u16] = &[0x0190, 0x0191, 0x02BC, 0x0320, 0x05DC, 0x06A4];

/// The built-in table of a standard configuration (§5), or `None` for one this manager does
/// not implement (it then answers accepted-unknown-config and learns the agent's table).
///
/// The tables are Antidote's (the only public ones, fact sheet §15.1), with two additions an
/// agent may report that its table lacks: the scale's BMI (handle 3, as Antidote's own agent
/// and test data send it) and a thermometer (0x0320: body temperature in °C, FLOAT + time —
/// the fork's table is inconsistent, so this follows the scale's layout). A report whose
/// observation does not match its value map is dropped observation by observation, never
/// guessed (§5 rule 4).
pub fn standard(config_id: u16) -> Option<&'static ObjectTable> {
    static TABLES: OnceLock<Vec<ObjectTable>> = OnceLock::new();
    let tables = TABLES.get_or_init(|| {
        let bp = MetricObject {
            class: class::METRIC_NU,
            handle: 1,
            kind: (2, 0x4A04),
            unit: Some(0x0F20),
            value_map: vec![(attr::NU_CMPD_VAL_OBS_BASIC, 10), (attr::TIME_STAMP_ABS, 8)],
            components: vec![0x4A05, 0x4A06, 0x4A07],
        };
        vec![
            ObjectTable {
                config_id: 0x0190,
                objects: vec![
                    numeric(1, 0x4BB8, 0x0220, SFLOAT_ONLY),
                    numeric(10, 0x481A, 0x0AA0, SFLOAT_ONLY),
                ],
            },
            ObjectTable {
                config_id: 0x0191,
                objects: vec![
                    numeric(1, 0x4BB8, 0x0220, SFLOAT_TIME),
                    numeric(10, 0x481A, 0x0AA0, SFLOAT_TIME),
                ],
            },
            ObjectTable {
                config_id: 0x02BC,
                objects: vec![bp, numeric(2, 0x482A, 0x0AA0, SFLOAT_TIME)],
            },
            ObjectTable {
                config_id: 0x0320,
                objects: vec![numeric(1, 0x4B5C, 0x17A0, FLOAT_TIME)],
            },
            ObjectTable {
                config_id: 0x05DC,
                objects: vec![
                    numeric(1, 0xE140, 0x06C3, FLOAT_TIME),
                    numeric(3, 0xE150, 0x07A0, FLOAT_TIME),
                ],
            },
            ObjectTable {
                config_id: 0x06A4,
                objects: vec![numeric(1, 0x71B8, 0x0852, SFLOAT_TIME)],
            },
        ]
    });
    tables.iter().find(|t| t.config_id == config_id)
}
