//! `PhdAgent`: an IEEE 11073-20601 (PHD) *agent* — the device side — for testing sluice's PHD
//! manager over real TCP, plus the pure APDU encoders it is built on.
//!
//! Owns: one TCP connection to a manager (or TLS over it: [`PhdAgent::connect_tls`]), its read
//! buffer, the agent's invoke-id and scan-report-number counters, and a small private MDER writer. Every byte follows
//! `specs/ieee-11073-20601.md` (the fact sheet) and is pinned to its vectors (`phd_*.hex`) by
//! tests. Does not own: a manager, a general MDER decoder (the agent reads only the few fields it
//! needs: AARE result, invoke ids, the ConfigReportRsp result, GET arguments), PM-stores,
//! scanners, or sluice-proto's `phd` codec (deliberately independent of it, so a bug there cannot
//! hide in a test that uses this agent).
//!
//! Wire format: APDU = choice u16 · length u16 · body, big-endian (fact sheet §1–§2). Data goes
//! in PRST (`E7 00 | L | L-2 | invoke-id | choice | length | …`). The agent sends AARQ, the
//! config report (`0x0D1C`), scan reports (fixed `0x0D1D`, variable `0x0D1E`, multi-person fixed
//! `0x0D1F`), RLRQ/RLRE/ABRT and GET responses. Object tables (fact sheet §5, §12):
//!
//! | device | config id | handles and value maps |
//! |---|---|---|
//! | pulse oximeter | `0x0190` | 1 SpO2 %, 10 pulse bpm: SFLOAT only (vectors C1, A3) |
//! | pulse oximeter | extended (≥ `0x4000`) | same handles, SFLOAT + Absolute-Time-Stamp (B3, B5) |
//! | blood pressure | `0x02BC` | 1 compound {sys, dia, mean} mmHg + time, 2 pulse bpm SFLOAT + time (E1) |
//! | weighing scale | `0x05DC` | 1 body mass kg FLOAT + time, 3 BMI kg/m² FLOAT + time (D1/D2 have handle 1 only) |
//! | glucometer | `0x06A4` | 1 capillary whole-blood glucose mg/dL SFLOAT + time |
//!
//! An extended config id of a device other than the oximeter uses that device's standard table.
//!
//! Behaviour while waiting (inside every method that reads): a manager's GET on handle 0
//! (`roiv-cmip-get`) is answered at once with the MDS attributes (System-Type-Spec-List,
//! System-Model, System-Id, Dev-Configuration-Id, Production-Specification, Date-and-Time; an
//! attribute-id list selects among them), a GET on another handle gets ROER
//! no-such-object-instance; an ABRT fails the wait; an RLRQ is answered with RLRE (normal) and
//! fails the wait (except in [`PhdAgent::release`], where it completes a release collision);
//! anything else nobody waits for is kept, in order, for [`PhdAgent::read_apdu`].
//! A confirmed report not confirmed in time makes the agent send ABRT (response-timeout, or
//! undefined with Antidote quirks, as Antidote does) and fail.
//!
//! Antidote quirks ([`AgentSpec::antidote_quirks`], the behaviour of Signove Antidote's
//! `ieee_agent`): AARQ with encoding rules MDER only and functional units 0; the device's
//! *standard* config id everywhere (AARQ, config report) whatever `config_id` says; the oximeter
//! sends every scan report unconfirmed with invoke-id `0x1111` and — as the fact sheet §15.1
//! records of Antidote's agent — 10-byte observations (SFLOAT + time stamp) although its `0x0190`
//! config report lists SFLOAT only; the other devices always send confirmed reports and wait at
//! most 3 s for the confirmation; the scale puts 4 observations (mass, BMI, mass, BMI) in one
//! report; the glucometer appends 2 zero bytes after the scan report inside the event-info (all
//! enclosing lengths count them).
//!
//! Bounds: APDUs up to the 16-bit length field (65 539 bytes); at most [`MAX_INBOX`] unread
//! APDUs. Invariant: nothing the manager sends can panic the agent — short or malformed APDUs
//! become errors or are kept for `read_apdu`. The pure encoders panic only on values the caller
//! chose out of range (see [`Reading::check`]).
//!
//! ```no_run
//! # async fn example(gateway: std::net::SocketAddr) -> anyhow::Result<()> {
//! use std::time::Duration;
//! use sluice_testkit::phd::bcd_time;
//! use sluice_testkit::{AgentSpec, PhdAgent, PhdDevice, Reading};
//!
//! let spec = AgentSpec { config_id: 0x4000, ..AgentSpec::new(PhdDevice::PulseOximeter) };
//! let mut agent = PhdAgent::connect(gateway, spec).await?;
//! let association = agent.associate().await?; // AARQ, config report if asked for
//! assert_eq!((association.aare_result, association.config_result), (3, Some(0)));
//! let reading = Reading::Oximeter { spo2: (98, 0), pulse: (72, 0) };
//! let time = bcd_time(2007, 12, 6, 12, 10, 0, 0);
//! let took = agent.report(&reading, time, Duration::from_secs(5)).await?;
//! assert!(took.is_some(), "confirmed");
//! assert_eq!(agent.release().await?, 0);
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout_at, Instant};

mod agent;
mod encode;

pub use agent::*;
pub use encode::*;

/// The TCP port Antidote's sample manager listens on (a convention, not part of 20601).
pub const ANTIDOTE_PORT: u16 = 6024;
/// Default time allowed for connect and for each answer the agent waits for without a timeout
/// argument (AARE, ConfigReportRsp, RLRE). See [`PhdAgent::set_response_timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an agent with Antidote quirks waits for a confirmation at most.
pub const ANTIDOTE_CONFIRM_TIMEOUT: Duration = Duration::from_secs(3);
/// Invoke id of every scan report of Antidote's oximeter.
pub const ANTIDOTE_OXIMETER_INVOKE_ID: u16 = 0x1111;
/// Most APDUs kept unread before a waiting call fails (the test is not draining them).
pub const MAX_INBOX: usize = 4096;
/// The agent system id of the fact sheet's vectors (A1).
pub const VECTOR_SYSTEM_ID: [u8; 8] = [0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x04];

/// APDU choice tags (fact sheet §1).
pub mod apdu {
    pub const AARQ: u16 = 0xE200;
    pub const AARE: u16 = 0xE300;
    pub const RLRQ: u16 = 0xE400;
    pub const RLRE: u16 = 0xE500;
    pub const ABRT: u16 = 0xE600;
    pub const PRST: u16 = 0xE700;
}

/// AARE result codes (fact sheet §4).
pub mod aare_result {
    pub const ACCEPTED: u16 = 0;
    pub const REJECTED_PERMANENT: u16 = 1;
    pub const REJECTED_TRANSIENT: u16 = 2;
    pub const ACCEPTED_UNKNOWN_CONFIG: u16 = 3;
    pub const REJECTED_NO_COMMON_PROTOCOL: u16 = 4;
    pub const REJECTED_NO_COMMON_PARAMETER: u16 = 5;
    pub const REJECTED_UNKNOWN: u16 = 6;
    pub const REJECTED_UNAUTHORIZED: u16 = 7;
    pub const REJECTED_UNSUPPORTED_ASSOC_VERSION: u16 = 8;
}

/// ConfigReportRsp results (fact sheet §7).
pub mod config_result {
    pub const ACCEPTED_CONFIG: u16 = 0;
    pub const UNSUPPORTED_CONFIG: u16 = 1;
    pub const STANDARD_CONFIG_UNKNOWN: u16 = 2;
}

/// RLRQ / RLRE / ABRT reasons (fact sheet §9).
pub mod reason {
    pub const RELEASE_NORMAL: u16 = 0;
    pub const RELEASE_NO_MORE_CONFIGURATIONS: u16 = 1;
    pub const RELEASE_CONFIGURATION_CHANGED: u16 = 2;
    pub const ABORT_UNDEFINED: u16 = 0;
    pub const ABORT_BUFFER_OVERFLOW: u16 = 1;
    pub const ABORT_RESPONSE_TIMEOUT: u16 = 2;
    pub const ABORT_CONFIGURATION_TIMEOUT: u16 = 3;
}

/// Data APDU message choices (fact sheet §6).
pub mod data_choice {
    pub const ROIV_EVENT_REPORT: u16 = 0x0100;
    pub const ROIV_CONFIRMED_EVENT_REPORT: u16 = 0x0101;
    pub const ROIV_GET: u16 = 0x0103;
    pub const ROIV_SET: u16 = 0x0104;
    pub const ROIV_CONFIRMED_SET: u16 = 0x0105;
    pub const ROIV_ACTION: u16 = 0x0106;
    pub const ROIV_CONFIRMED_ACTION: u16 = 0x0107;
    pub const RORS_CONFIRMED_EVENT_REPORT: u16 = 0x0201;
    pub const RORS_GET: u16 = 0x0203;
    pub const RORS_CONFIRMED_SET: u16 = 0x0205;
    pub const RORS_CONFIRMED_ACTION: u16 = 0x0207;
    pub const ROER: u16 = 0x0300;
    pub const RORJ: u16 = 0x0400;
}

/// Event types (fact sheet §6).
pub mod event_type {
    pub const CONFIG: u16 = 0x0D1C;
    pub const SCAN_REPORT_FIXED: u16 = 0x0D1D;
    pub const SCAN_REPORT_VAR: u16 = 0x0D1E;
    pub const SCAN_REPORT_MP_FIXED: u16 = 0x0D1F;
}

// Nomenclature (fact sheet §12).
pub(super) const PART_SCADA: u16 = 2;
pub(super) const MOC_VMO_METRIC_NU: u16 = 6;
pub(super) const ATTR_ID_MODEL: u16 = 0x0928;
pub(super) const ATTR_ID_PROD_SPECN: u16 = 0x092D;
pub(super) const ATTR_ID_TYPE: u16 = 0x092F;
pub(super) const ATTR_SYS_ID: u16 = 0x0984;
pub(super) const ATTR_TIME_ABS: u16 = 0x0987;
pub(super) const ATTR_TIME_STAMP_ABS: u16 = 0x0990;
pub(super) const ATTR_UNIT_CODE: u16 = 0x0996;
pub(super) const ATTR_DEV_CONFIG_ID: u16 = 0x0A44;
pub(super) const ATTR_METRIC_SPEC_SMALL: u16 = 0x0A46;
pub(super) const ATTR_NU_VAL_OBS_BASIC: u16 = 0x0A4C;
pub(super) const ATTR_ATTRIBUTE_VAL_MAP: u16 = 0x0A55;
pub(super) const ATTR_NU_VAL_OBS_SIMP: u16 = 0x0A56;
pub(super) const ATTR_SYS_TYPE_SPEC_LIST: u16 = 0x0A5A;
pub(super) const ATTR_METRIC_STRUCT_SMALL: u16 = 0x0A73;
pub(super) const ATTR_NU_CMPD_VAL_OBS_BASIC: u16 = 0x0A75;
pub(super) const ATTR_ID_PHYSIO_LIST: u16 = 0x0A76;
pub(super) const DATA_PROTO_ID_20601: u16 = 0x5079;
pub(super) const DATA_REQ_ID_AGENT_INITIATED: u16 = 0xF000;
pub(super) const EVENT_TIME_UNUSED: u32 = 0xFFFF_FFFF;
pub(super) const ROER_NO_SUCH_OBJECT_INSTANCE: u16 = 1;

/// The four device specializations the agent can play.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhdDevice {
    /// IEEE 11073-10404, standard config `0x0190`.
    PulseOximeter,
    /// IEEE 11073-10407, standard config `0x02BC`.
    BloodPressure,
    /// IEEE 11073-10415, standard config `0x05DC`.
    WeighingScale,
    /// IEEE 11073-10417, standard config `0x06A4`.
    Glucometer,
}

impl PhdDevice {
    /// The standard dev-config-id of this specialization.
    pub fn standard_config_id(self) -> u16 {
        match self {
            PhdDevice::PulseOximeter => 0x0190,
            PhdDevice::BloodPressure => 0x02BC,
            PhdDevice::WeighingScale => 0x05DC,
            PhdDevice::Glucometer => 0x06A4,
        }
    }

    /// MDC_DEV_SPEC_PROFILE_* (partition 8), as listed in System-Type-Spec-List.
    pub fn spec_profile(self) -> u16 {
        match self {
            PhdDevice::PulseOximeter => 0x1004,
            PhdDevice::BloodPressure => 0x1007,
            PhdDevice::WeighingScale => 0x100F,
            PhdDevice::Glucometer => 0x1011,
        }
    }

    /// Model string in System-Model (the oximeter's is the one of vector C5).
    fn model(self) -> &'static [u8] {
        match self {
            PhdDevice::PulseOximeter => b"OximeterABC",
            PhdDevice::BloodPressure => b"BloodPressureABC",
            PhdDevice::WeighingScale => b"ScaleABC",
            PhdDevice::Glucometer => b"GlucometerABC",
        }
    }
}

/// Who the agent is and how it behaves. Build with [`AgentSpec::new`] or
/// [`AgentSpec::antidote`] and adjust the public fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentSpec {
    /// EUI-64 of the agent: the manager keys stored configurations by it.
    pub system_id: [u8; 8],
    pub device: PhdDevice,
    /// A standard id (`0x0190`, `0x02BC`, `0x05DC`, `0x06A4`) or an extended one (≥ `0x4000`).
    /// Ignored with `antidote_quirks` (Antidote always uses the standard id).
    pub config_id: u16,
    /// Scan reports as roiv-cmip-confirmed-event-report (`0x0101`) or unconfirmed (`0x0100`).
    /// Ignored with `antidote_quirks` (oximeter unconfirmed, the others confirmed).
    pub confirmed: bool,
    /// Behave like Signove Antidote's `ieee_agent` (see the module documentation).
    pub antidote_quirks: bool,
}

impl AgentSpec {
    /// `device` with its standard config id, confirmed reports, no quirks, and the vectors'
    /// system id [`VECTOR_SYSTEM_ID`].
    pub fn new(device: PhdDevice) -> AgentSpec {
        AgentSpec {
            system_id: VECTOR_SYSTEM_ID,
            device,
            config_id: device.standard_config_id(),
            confirmed: true,
            antidote_quirks: false,
        }
    }

    /// [`AgentSpec::new`] with Antidote's quirks on.
    pub fn antidote(device: PhdDevice) -> AgentSpec {
        AgentSpec {
            antidote_quirks: true,
            ..AgentSpec::new(device)
        }
    }

    /// The dev-config-id the agent actually uses (AARQ, config report, MDS attribute).
    pub fn effective_config_id(&self) -> u16 {
        if self.antidote_quirks {
            self.device.standard_config_id()
        } else {
            self.config_id
        }
    }

    /// Whether scan reports go out confirmed (`0x0101`).
    pub fn sends_confirmed(&self) -> bool {
        if self.antidote_quirks {
            self.device != PhdDevice::PulseOximeter
        } else {
            self.confirmed
        }
    }

    /// Whether the oximeter's observations carry an Absolute-Time-Stamp: not under `0x0190`
    /// (Antidote's table), yes under any other id — and always with Antidote quirks (§15.1).
    fn oximeter_time_stamped(&self) -> bool {
        self.antidote_quirks || self.effective_config_id() != 0x0190
    }
}

/// The AARQ's PhdAssociationInformation fields that are not in [`AgentSpec`]. `Default` is a
/// plain agent (encoding MDER + PER `0xA000` as in vector A1, functional units 0);
/// [`AarqFields::for_spec`] applies Antidote's quirks; vector A1 is the default with
/// `functional_units: 0x4000_0000` (have-test-capability).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AarqFields {
    pub assoc_version: u32,
    pub protocol_version: u32,
    pub encoding_rules: u16,
    pub nomenclature_version: u32,
    pub functional_units: u32,
    pub system_type: u32,
    pub data_req_mode_flags: u16,
    pub data_req_init_agent_count: u8,
    pub data_req_init_manager_count: u8,
}

impl Default for AarqFields {
    fn default() -> AarqFields {
        AarqFields {
            assoc_version: 0x8000_0000,
            protocol_version: 0x8000_0000,
            encoding_rules: 0xA000,
            nomenclature_version: 0x8000_0000,
            functional_units: 0,
            system_type: 0x0080_0000,
            data_req_mode_flags: 0x0001,
            data_req_init_agent_count: 1,
            data_req_init_manager_count: 0,
        }
    }
}

impl AarqFields {
    /// What an agent of `spec` sends: the default, or MDER-only encoding with Antidote quirks.
    pub fn for_spec(spec: &AgentSpec) -> AarqFields {
        let mut fields = AarqFields::default();
        if spec.antidote_quirks {
            fields.encoding_rules = 0x8000;
        }
        fields
    }
}

/// Outcome of [`PhdAgent::associate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Association {
    /// The AARE result (see [`aare_result`]).
    pub aare_result: u16,
    /// The ConfigReportRsp result; `Some` when a config report was sent (AARE result 3).
    pub config_result: Option<u16>,
}

/// One measurement, values as (mantissa, exponent): value = mantissa × 10^exponent, so tests
/// compare exactly. SFLOAT fields take mantissa −2048…2047 and exponent −8…7, FLOAT fields
/// mantissa −8 388 608…8 388 607 (specials such as NaN are plain mantissas, exponent 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// SFLOAT each: SpO2 % (handle 1), pulse bpm (handle 10).
    Oximeter { spo2: (i32, i8), pulse: (i32, i8) },
    /// SFLOAT each: compound sys/dia/mean mmHg (handle 1), pulse bpm (handle 2).
    BloodPressure {
        systolic: (i32, i8),
        diastolic: (i32, i8),
        mean: (i32, i8),
        pulse: (i32, i8),
    },
    /// FLOAT each: body mass kg (handle 1), BMI kg/m² (handle 3).
    Scale { mass_kg: (i32, i8), bmi: (i32, i8) },
    /// SFLOAT: capillary whole-blood glucose mg/dL (handle 1).
    Glucose { mg_dl: (i32, i8) },
}

impl Reading {
    /// The device that measures this.
    pub fn device(&self) -> PhdDevice {
        match self {
            Reading::Oximeter { .. } => PhdDevice::PulseOximeter,
            Reading::BloodPressure { .. } => PhdDevice::BloodPressure,
            Reading::Scale { .. } => PhdDevice::WeighingScale,
            Reading::Glucose { .. } => PhdDevice::Glucometer,
        }
    }

    /// `Err` when a value does not fit its SFLOAT / FLOAT field (the encoders would panic).
    pub fn check(&self) -> anyhow::Result<()> {
        let sfloats: &[(&str, (i32, i8))] = match *self {
            Reading::Oximeter { spo2, pulse } => &[("spo2", spo2), ("pulse", pulse)],
            Reading::BloodPressure {
                systolic,
                diastolic,
                mean,
                pulse,
            } => &[
                ("systolic", systolic),
                ("diastolic", diastolic),
                ("mean", mean),
                ("pulse", pulse),
            ],
            Reading::Glucose { mg_dl } => &[("mg_dl", mg_dl)],
            Reading::Scale { mass_kg, bmi } => {
                for (name, value) in [("mass_kg", mass_kg), ("bmi", bmi)] {
                    if !float_fits(value) {
                        bail!("{name} {value:?} does not fit a FLOAT (mantissa −8388608…8388607)");
                    }
                }
                &[]
            }
        };
        for (name, value) in sfloats {
            if !sfloat_fits(*value) {
                bail!(
                    "{name} {value:?} does not fit an SFLOAT (mantissa −2048…2047, exponent −8…7)"
                );
            }
        }
        Ok(())
    }
}

/// Which scan-report structure carries a reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanForm {
    /// MDC_NOTI_SCAN_REPORT_FIXED: observations laid out per the value maps.
    Fixed,
    /// MDC_NOTI_SCAN_REPORT_VAR: one AttributeList per handle (the value-map attributes as AVAs).
    Var,
    /// MDC_NOTI_SCAN_REPORT_MP_FIXED: the fixed observations under one person id.
    MpFixed { person_id: u16 },
}

/// The per-APDU fields of an event report that tests may want to set exactly (vector E1 has
/// event-time `0x00490050`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportHeader {
    pub invoke_id: u16,
    pub report_no: u16,
    /// RelativeTime; `0xFFFFFFFF` = not used (the default of [`ReportHeader::new`]).
    pub event_time: u32,
    /// `0xF000` = agent-initiated (the default).
    pub data_req_id: u16,
}

impl ReportHeader {
    /// Event-time `0xFFFFFFFF` (not used), data-req-id `0xF000` (agent-initiated).
    pub fn new(invoke_id: u16, report_no: u16) -> ReportHeader {
        ReportHeader {
            invoke_id,
            report_no,
            event_time: EVENT_TIME_UNUSED,
            data_req_id: DATA_REQ_ID_AGENT_INITIATED,
        }
    }
}

/// AbsoluteTime from decimal fields (each written as two BCD digits; `year` is 4 digits).
/// Fields out of range (month 13 …) are encoded anyway, so tests can send bad clocks.
pub fn bcd_time(
    year: u16,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
    second: u8,
    hundredths: u8,
) -> [u8; 8] {
    let bcd = |v: u8| ((v / 10 % 10) << 4) | (v % 10);
    // Both halves are < 100 after the modulo, so the casts cannot truncate.
    let century = (year / 100 % 100) as u8;
    let year = (year % 100) as u8;
    [
        bcd(century),
        bcd(year),
        bcd(month),
        bcd(day),
        bcd(hour),
        bcd(minute),
        bcd(second),
        bcd(hundredths),
    ]
}
