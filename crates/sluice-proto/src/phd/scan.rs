//! Measurement reports (fact sheet §8): MDC_NOTI_SCAN_REPORT_FIXED / _VAR / _MP_FIXED /
//! _MP_VAR (and the scanner objects' unbuffered and buffered forms of the same layouts)
//! decoded into [`Observation`]s with an agent's [`ObjectTable`].
//!
//! Owns: the scan-report layouts and the observed-value attributes (basic/simple/full
//! numerics, the three compound forms, enumeration OIDs, absolute time stamps, measurement
//! status). Does not own: what an observation becomes (SenML, in the gateway), the table.
//!
//! # Policy for what cannot be decoded (§5 rule 4, §8)
//! A structure whose counts and lengths do not add up is a [`DecodeError`] (the report as a
//! whole is bad). An observation that is well framed but cannot be read — its handle is not
//! in the table, the table has no value map for it, or its bytes do not match the map — is
//! left out and listed in [`ScanReport::skipped`], never guessed — with one documented
//! exception: an observation exactly 8 bytes longer than a map without a time stamp whose
//! last 8 bytes are a valid AbsoluteTime (Antidote's oximeter under 0x0190). Bytes after the
//! report inside the event-info are ignored (Antidote's glucometer sends two).

use bytes::Bytes;

use super::config::{attr, ObjectTable};
use super::mder::{DecodeError, Reader};
use super::values::{float, sfloat, AbsoluteTime, Decimal};

/// Event types of scan reports (§6), grouped by layout.
pub mod event {
    pub const SCAN_REPORT_FIXED: u16 = 0x0D1D;
    pub const SCAN_REPORT_VAR: u16 = 0x0D1E;
    pub const SCAN_REPORT_MP_FIXED: u16 = 0x0D1F;
    pub const SCAN_REPORT_MP_VAR: u16 = 0x0D20;
    pub const UNBUF_VAR: u16 = 0x0D22;
    pub const UNBUF_FIXED: u16 = 0x0D23;
    pub const UNBUF_MP_VAR: u16 = 0x0D25;
    pub const UNBUF_MP_FIXED: u16 = 0x0D26;
    pub const BUF_VAR: u16 = 0x0D28;
    pub const BUF_FIXED: u16 = 0x0D29;
    pub const BUF_MP_VAR: u16 = 0x0D2B;
    pub const BUF_MP_FIXED: u16 = 0x0D2C;
}

/// The layout of a scan report's event-info.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Fixed,
    Var,
    MpFixed,
    MpVar,
}

/// The layout of `event_type`, or `None` when it is not a scan report this module reads.
pub fn layout(event_type: u16) -> Option<Layout> {
    use event::*;
    Some(match event_type {
        SCAN_REPORT_FIXED | UNBUF_FIXED | BUF_FIXED => Layout::Fixed,
        SCAN_REPORT_VAR | UNBUF_VAR | BUF_VAR => Layout::Var,
        SCAN_REPORT_MP_FIXED | UNBUF_MP_FIXED | BUF_MP_FIXED => Layout::MpFixed,
        SCAN_REPORT_MP_VAR | UNBUF_MP_VAR | BUF_MP_VAR => Layout::MpVar,
        _ => return None,
    })
}

/// What an observation measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObservedValue {
    /// One number (basic SFLOAT, simple FLOAT, or a full Nu-Observed-Value).
    Numeric(Decimal),
    /// The components of a compound, in the order of the object's Metric-Id-List.
    Compound(Vec<Decimal>),
    /// An enumeration's OID.
    Enum(u16),
}

/// One observation of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub handle: u16,
    /// The person it belongs to (multi-person reports; `0xFFFF` = unknown person).
    pub person: Option<u16>,
    pub value: ObservedValue,
    /// A unit the observation carried itself (Nu-Observed-Value); else the object's.
    pub unit: Option<u16>,
    pub time: Option<AbsoluteTime>,
    /// Measurement-Status bits, when present.
    pub status: Option<u16>,
}

/// Why an observation was left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    UnknownHandle,
    NoValueMap,
    LengthMismatch,
    NoValue,
}

/// A decoded scan report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanReport {
    pub data_req_id: u16,
    pub report_no: u16,
    pub observations: Vec<Observation>,
    /// Observations left out, by handle.
    pub skipped: Vec<(u16, Skip)>,
}

/// Decode the event-info of a scan report of `layout` with `table`.
pub fn decode(layout: Layout, info: Bytes, table: &ObjectTable) -> Result<ScanReport, DecodeError> {
    let mut r = Reader::new(info);
    let mut report = ScanReport {
        data_req_id: r.u16("data-req-id")?,
        report_no: r.u16("scan-report-no")?,
        observations: Vec::new(),
        skipped: Vec::new(),
    };
    match layout {
        Layout::Fixed => fixed_list(&mut r, None, table, &mut report)?,
        Layout::Var => var_list(&mut r, None, table, &mut report)?,
        Layout::MpFixed | Layout::MpVar => {
            let (count, mut people) = r.seq("scan-per")?;
            for _ in 0..count {
                let person = people.u16("person-id")?;
                if layout == Layout::MpFixed {
                    fixed_list(&mut people, Some(person), table, &mut report)?;
                } else {
                    var_list(&mut people, Some(person), table, &mut report)?;
                }
            }
            people.finish("scan-per")?;
        }
    }
    Ok(report)
}

fn fixed_list(
    r: &mut Reader,
    person: Option<u16>,
    table: &ObjectTable,
    report: &mut ScanReport,
) -> Result<(), DecodeError> {
    let (count, mut list) = r.seq("obs-scan-fixed")?;
    for _ in 0..count {
        let handle = list.u16("obj-handle")?;
        let data = list.octets("obs-val-data")?;
        let Some(object) = table.object(handle) else {
            report.skipped.push((handle, Skip::UnknownHandle));
            continue;
        };
        if object.value_map.is_empty() {
            report.skipped.push((handle, Skip::NoValueMap));
            continue;
        }
        let total: usize = object.value_map.iter().map(|&(_, l)| usize::from(l)).sum();
        let has_time = object
            .value_map
            .iter()
            .any(|&(a, _)| a == attr::TIME_STAMP_ABS || a == attr::TIME_ABS);
        // Antidote's own oximeter agent appends an Absolute-Time-Stamp to every observation
        // under 0x0190, whose table has none (fact sheet §15.1): taken only when the extra
        // 8 bytes are a valid BCD time, else the observation is skipped as any mismatch.
        let trailing_time = !has_time && data.len() == total + 8;
        if total != data.len() && !trailing_time {
            report.skipped.push((handle, Skip::LengthMismatch));
            continue;
        }
        let mut obs = Fields::default();
        let mut d = Reader::new(data);
        let mut ok = true;
        for &(id, len) in &object.value_map {
            let v = d.bytes("observed attribute", usize::from(len))?;
            ok &= obs.read(id, v);
        }
        if trailing_time {
            let v = d.bytes("trailing time stamp", 8)?;
            if !obs.read(attr::TIME_STAMP_ABS, v) {
                report.skipped.push((handle, Skip::LengthMismatch));
                continue;
            }
        }
        match obs.into_observation(handle, person) {
            Some(o) if ok => report.observations.push(o),
            _ => report.skipped.push((handle, Skip::NoValue)),
        }
    }
    list.finish("obs-scan-fixed")?;
    Ok(())
}

fn var_list(
    r: &mut Reader,
    person: Option<u16>,
    table: &ObjectTable,
    report: &mut ScanReport,
) -> Result<(), DecodeError> {
    let (count, mut list) = r.seq("obs-scan-var")?;
    for _ in 0..count {
        let handle = list.u16("obj-handle")?;
        let (n, mut attrs) = list.seq("attribute-list")?;
        let mut obs = Fields::default();
        let mut ok = true;
        for _ in 0..n {
            let id = attrs.u16("attribute-id")?;
            let v = attrs.octets("attribute-value")?;
            ok &= obs.read(id, v);
        }
        attrs.finish("attribute-list")?;
        if table.object(handle).is_none() {
            report.skipped.push((handle, Skip::UnknownHandle));
            continue;
        }
        match obs.into_observation(handle, person) {
            Some(o) if ok => report.observations.push(o),
            _ => report.skipped.push((handle, Skip::NoValue)),
        }
    }
    list.finish("obs-scan-var")?;
    Ok(())
}

/// The attributes of one observation as they are read.
#[derive(Default)]
struct Fields {
    value: Option<ObservedValue>,
    unit: Option<u16>,
    time: Option<AbsoluteTime>,
    status: Option<u16>,
}

impl Fields {
    /// Read one attribute; false when a known attribute's bytes are malformed.
    fn read(&mut self, id: u16, v: Bytes) -> bool {
        let u16_at = |i: usize| u16::from_be_bytes([v[i], v[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes([v[i], v[i + 1], v[i + 2], v[i + 3]]);
        match id {
            attr::NU_VAL_OBS_BASIC if v.len() == 2 => {
                self.value = Some(ObservedValue::Numeric(sfloat(u16_at(0))))
            }
            attr::NU_VAL_OBS_SIMP if v.len() == 4 => {
                self.value = Some(ObservedValue::Numeric(float(u32_at(0))))
            }
            attr::NU_VAL_OBS if v.len() == 10 => {
                self.status = Some(u16_at(2));
                self.unit = Some(u16_at(4));
                self.value = Some(ObservedValue::Numeric(float(u32_at(6))));
            }
            attr::NU_CMPD_VAL_OBS_BASIC | attr::NU_CMPD_VAL_OBS_SIMP | attr::NU_CMPD_VAL_OBS => {
                let Some(values) = compound(id, v.clone()) else {
                    return false;
                };
                self.value = Some(ObservedValue::Compound(values));
            }
            attr::ENUM_OBS_VAL_SIMP_OID if v.len() == 2 => {
                self.value = Some(ObservedValue::Enum(u16_at(0)))
            }
            attr::TIME_STAMP_ABS | attr::TIME_ABS if v.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&v);
                match AbsoluteTime::decode(b) {
                    Some(t) => self.time = Some(t),
                    None => return false,
                }
            }
            attr::MSMT_STAT if v.len() == 2 => self.status = Some(u16_at(0)),
            attr::NU_VAL_OBS_BASIC
            | attr::NU_VAL_OBS_SIMP
            | attr::NU_VAL_OBS
            | attr::ENUM_OBS_VAL_SIMP_OID
            | attr::TIME_STAMP_ABS
            | attr::TIME_ABS
            | attr::MSMT_STAT => return false, // a known attribute with the wrong length
            _ => {} // relative times and others: not carried on
        }
        true
    }

    fn into_observation(self, handle: u16, person: Option<u16>) -> Option<Observation> {
        Some(Observation {
            handle,
            person,
            value: self.value?,
            unit: self.unit,
            time: self.time,
            status: self.status,
        })
    }
}

/// A compound: count u16 · length u16 · count elements (SFLOAT, FLOAT or Nu-Observed-Value).
fn compound(id: u16, v: Bytes) -> Option<Vec<Decimal>> {
    let mut r = Reader::new(v);
    let (count, mut els) = r.seq("compound").ok()?;
    r.finish("compound").ok()?;
    let mut out = Vec::with_capacity(count.min(16));
    for _ in 0..count {
        out.push(match id {
            attr::NU_CMPD_VAL_OBS_BASIC => sfloat(els.u16("SFLOAT").ok()?),
            attr::NU_CMPD_VAL_OBS_SIMP => float(els.u32("FLOAT").ok()?),
            _ => {
                els.bytes("metric-id, status, unit", 6).ok()?;
                float(els.u32("FLOAT").ok()?)
            }
        });
    }
    els.finish("compound").ok()?;
    Some(out)
}
