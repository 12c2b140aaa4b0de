//! From observations to SenML (RFC 8428): what one 11073 observation becomes on its way to
//! the gateway's topics — a metric name, and the SenML records of a pack.
//!
//! Owns: the metric names (`spo2`, `pulse`, `bp`, …), the unit mapping from 11073 unit codes
//! to SenML units (fact sheet `senml-and-coap.md` §1.4), value scaling, and record times.
//! Does not own: topics or delivery (the gateway's PHD edge).
//!
//! # Records
//! Each record's name is `urn:dev:mac:{system-id hex}:{name}`; a simple observation has one
//! record named after its metric, a compound one record per component (`sys`, `dia`, `mean`
//! for blood pressure) and the metric `bp`. Times are absolute (UNIX seconds): the
//! observation's Absolute-Time-Stamp when it has one — agents send local time without a
//! zone, so it is read as UTC shifted by `agent_utc_offset` — else the gateway's receive time.
//!
//! # Units (11073 → SenML)
//! | 11073 | SenML | value |
//! |---|---|---|
//! | % (0x0220) | `/` | ÷ 100 (SpO2 98 % → 0.98) |
//! | bpm (0x0AA0) | `beat/min` | as is |
//! | mmHg (0x0F20) | `Pa` | × 133.322387415, rounded to 1 Pa |
//! | kPa (0x0F03) | `Pa` | × 1000 |
//! | kg (0x06C3), g (0x06C0) | `kg`, `g` | as is |
//! | lb (0x06E0) | `kg` | × 0.45359237 |
//! | cm (0x0511), in (0x0560) | `m` | ÷ 100, × 0.0254 |
//! | °C (0x17A0) | `Cel` | as is |
//! | kg/m² (0x07A0) | `kg/m2` | as is — **not in the SenML registry** |
//! | mg/dL (0x0852) | `mg/dL` | as is — **not in the SenML registry** |
//! | any other | no unit | as is |
//!
//! Special values (NaN, NRes, ±∞) have no SenML number: such an observation gives no record
//! and is counted as skipped. Enumerations give a `vs` record with the OID in decimal.

use bytes::Bytes;

use super::config::ObjectTable;
use super::scan::{Observation, ObservedValue, ScanReport};
use super::values::{AbsoluteTime, Decimal};
use crate::senml::{Format, PackWriter, Record, Value};

/// One observation as SenML: its metric (a topic level) and its records.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    pub metric: String,
    pub records: Vec<Record>,
}

/// The metric name of a measurement code (partition SCADA), and of each compound component.
pub fn metric_name(code: u16) -> String {
    match code {
        0x4BB8 => "spo2".into(),
        0x481A | 0x482A => "pulse".into(),
        0x4A04 => "bp".into(),
        0x4A05 => "sys".into(),
        0x4A06 => "dia".into(),
        0x4A07 => "mean".into(),
        0xE140 => "mass".into(),
        0xE144 => "height".into(),
        0xE14C => "fat".into(),
        0xE150 => "bmi".into(),
        0x4B5C => "temp".into(),
        0x71B8 => "glucose".into(),
        // The 32-bit MDC code (partition 2), as FHIR writes it.
        other => format!("mdc{}", 2 * 65536 + u32::from(other)),
    }
}

/// A specialization's name from what its first object measures (for status pages).
pub fn specialization(table: &ObjectTable) -> &'static str {
    match table.objects.first().map(|o| o.kind.1) {
        Some(0x4BB8 | 0x481A) => "pulse-oximeter",
        Some(0x4A04 | 0x482A) => "blood-pressure",
        Some(0xE140 | 0xE144 | 0xE150 | 0xE14C) => "weighing-scale",
        Some(0x71B8) => "glucose-meter",
        Some(0x4B5C) => "thermometer",
        _ => "unknown",
    }
}

/// SenML unit and the value in it.
fn convert(unit: Option<u16>, d: Decimal) -> Option<(Option<&'static str>, f64)> {
    let Decimal::Value { mantissa, exponent } = d else {
        return None;
    };
    let shifted = |by: i8| {
        Decimal::Value {
            mantissa,
            exponent: exponent.saturating_add(by),
        }
        .to_f64()
    };
    let v = d.to_f64();
    let out = match unit {
        Some(0x0220) => (Some("/"), shifted(-2)),
        Some(0x0AA0) => (Some("beat/min"), v),
        Some(0x0F20) => (Some("Pa"), (v * 133.322387415).round()),
        Some(0x0F03) => (Some("Pa"), shifted(3)),
        Some(0x06C3) => (Some("kg"), v),
        Some(0x06C0) => (Some("g"), v),
        Some(0x06E0) => (Some("kg"), v * 0.45359237),
        Some(0x0511) => (Some("m"), shifted(-2)),
        Some(0x0560) => (Some("m"), v * 0.0254),
        Some(0x17A0) => (Some("Cel"), v),
        Some(0x07A0) => (Some("kg/m2"), v),
        Some(0x0852) => (Some("mg/dL"), v),
        _ => (None, v),
    };
    out.1.is_finite().then_some(out)
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// An AbsoluteTime read as UTC shifted by `offset_secs` (local = UTC + offset), in UNIX
/// seconds.
pub fn unix_time(t: &AbsoluteTime, offset_secs: i64) -> f64 {
    let days = days_from_civil(i64::from(t.year), i64::from(t.month), i64::from(t.day));
    let secs =
        days * 86_400 + i64::from(t.hour) * 3600 + i64::from(t.minute) * 60 + i64::from(t.second)
            - offset_secs;
    secs as f64 + f64::from(t.hundredths) / 100.0
}

/// An id (an EUI-64) as lowercase hex digits: the `urn:dev:mac:` name and the gateway's
/// device id of an agent.
pub fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The measurements of a report. `received` is the gateway's receive time (UNIX seconds).
/// Returns them and how many observations gave none (special values, unknown layout).
pub fn measurements(
    system_id: &[u8; 8],
    table: &ObjectTable,
    report: &ScanReport,
    received: f64,
    agent_utc_offset_secs: i64,
) -> (Vec<Measurement>, usize) {
    let base = format!("urn:dev:mac:{}:", hex(system_id));
    let mut out = Vec::with_capacity(report.observations.len());
    let mut skipped = 0;
    for obs in &report.observations {
        match one(&base, table, obs, received, agent_utc_offset_secs) {
            Some(m) => out.push(m),
            None => skipped += 1,
        }
    }
    (out, skipped)
}

fn one(
    base: &str,
    table: &ObjectTable,
    obs: &Observation,
    received: f64,
    offset: i64,
) -> Option<Measurement> {
    let object = table.object(obs.handle)?;
    let time = obs
        .time
        .as_ref()
        .map(|t| unix_time(t, offset))
        .unwrap_or(received);
    let mut metric = metric_name(object.kind.1);
    if let Some(person) = obs.person.filter(|&p| p != 0xFFFF) {
        metric = format!("{metric}-p{person}");
    }
    let unit = obs.unit.or(object.unit);
    let record = |name: String, unit: Option<&str>, value: Value| Record {
        name: format!("{base}{name}"),
        time,
        unit: unit.map(str::to_owned),
        value: Some(value),
        sum: None,
        update_time: None,
    };
    let records = match &obs.value {
        ObservedValue::Numeric(d) => {
            let (u, v) = convert(unit, *d)?;
            vec![record(metric.clone(), u, Value::Number(v))]
        }
        ObservedValue::Compound(values) => {
            let mut records = Vec::with_capacity(values.len());
            for (i, d) in values.iter().enumerate() {
                let name = object
                    .components
                    .get(i)
                    .map(|&c| metric_name(c))
                    .unwrap_or_else(|| format!("{metric}{i}"));
                let (u, v) = convert(unit, *d)?;
                records.push(record(name, u, Value::Number(v)));
            }
            records
        }
        ObservedValue::Enum(oid) => {
            vec![record(metric.clone(), None, Value::String(oid.to_string()))]
        }
    };
    Some(Measurement { metric, records })
}

/// Encode records as a SenML JSON pack.
pub fn senml_json(records: &[Record]) -> Bytes {
    let mut w = PackWriter::new(Format::Json);
    for r in records {
        // Names are built from hex and fixed metric names; values are finite: push cannot
        // fail, and a record it refused would only be missing from the pack.
        let _ = w.push(r);
    }
    w.finish()
}
