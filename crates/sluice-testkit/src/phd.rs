//! `PhdAgent`: an IEEE 11073-20601 (PHD) *agent* — the device side — for testing sluice's PHD
//! manager over real TCP, plus the pure APDU encoders it is built on.
//!
//! Owns: one TCP connection to a manager, its read buffer, the agent's invoke-id and
//! scan-report-number counters, and a small private MDER writer. Every byte follows
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
const PART_SCADA: u16 = 2;
const MOC_VMO_METRIC_NU: u16 = 6;
const ATTR_ID_MODEL: u16 = 0x0928;
const ATTR_ID_PROD_SPECN: u16 = 0x092D;
const ATTR_ID_TYPE: u16 = 0x092F;
const ATTR_SYS_ID: u16 = 0x0984;
const ATTR_TIME_ABS: u16 = 0x0987;
const ATTR_TIME_STAMP_ABS: u16 = 0x0990;
const ATTR_UNIT_CODE: u16 = 0x0996;
const ATTR_DEV_CONFIG_ID: u16 = 0x0A44;
const ATTR_METRIC_SPEC_SMALL: u16 = 0x0A46;
const ATTR_NU_VAL_OBS_BASIC: u16 = 0x0A4C;
const ATTR_ATTRIBUTE_VAL_MAP: u16 = 0x0A55;
const ATTR_NU_VAL_OBS_SIMP: u16 = 0x0A56;
const ATTR_SYS_TYPE_SPEC_LIST: u16 = 0x0A5A;
const ATTR_METRIC_STRUCT_SMALL: u16 = 0x0A73;
const ATTR_NU_CMPD_VAL_OBS_BASIC: u16 = 0x0A75;
const ATTR_ID_PHYSIO_LIST: u16 = 0x0A76;
const DATA_PROTO_ID_20601: u16 = 0x5079;
const DATA_REQ_ID_AGENT_INITIATED: u16 = 0xF000;
const EVENT_TIME_UNUSED: u32 = 0xFFFF_FFFF;
const ROER_NO_SUCH_OBJECT_INSTANCE: u16 = 1;

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

// ---------------------------------------------------------------------------------------------
// The agent on a socket.

/// What one attempt to read the next APDU produced.
enum Incoming {
    Apdu(Vec<u8>),
    Closed,
    TimedOut,
}

/// A PHD agent connected to a manager; see the module documentation for its behaviour.
pub struct PhdAgent {
    stream: TcpStream,
    peer: SocketAddr,
    spec: AgentSpec,
    aarq_fields: AarqFields,
    read_buf: Vec<u8>,
    /// APDUs that arrived while the agent waited for something else, for `read_apdu`.
    inbox: VecDeque<Vec<u8>>,
    /// Set once the manager closed the connection (EOF or error), with the reason.
    closed: Option<String>,
    next_invoke_id: u16,
    next_report_no: u16,
    response_timeout: Duration,
    answer_gets: bool,
    /// MDS Date-and-Time reported in GET responses.
    clock: [u8; 8],
    gets_answered: u64,
    confirmations_received: u64,
    reports_sent: u64,
}

impl fmt::Debug for PhdAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhdAgent")
            .field("peer", &self.peer)
            .field("spec", &self.spec)
            .field("inbox", &self.inbox.len())
            .field("closed", &self.closed)
            .field("gets_answered", &self.gets_answered)
            .field("confirmations_received", &self.confirmations_received)
            .finish_non_exhaustive()
    }
}

impl PhdAgent {
    /// Open a TCP connection to the manager at `addr` (nothing is sent yet).
    pub async fn connect(addr: SocketAddr, spec: AgentSpec) -> anyhow::Result<PhdAgent> {
        let deadline = Instant::now() + DEFAULT_TIMEOUT;
        let stream = timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| anyhow!("TCP connect to PHD manager {addr} timed out"))?
            .with_context(|| format!("TCP connect to PHD manager {addr}"))?;
        stream.set_nodelay(true).context("setting TCP_NODELAY")?;
        Ok(PhdAgent {
            stream,
            peer: addr,
            aarq_fields: AarqFields::for_spec(&spec),
            spec,
            read_buf: Vec::with_capacity(4096),
            inbox: VecDeque::new(),
            closed: None,
            next_invoke_id: 1,
            next_report_no: 0,
            response_timeout: DEFAULT_TIMEOUT,
            answer_gets: true,
            clock: [0x20, 0x07, 0x02, 0x01, 0x12, 0x05, 0x00, 0x00],
            gets_answered: 0,
            confirmations_received: 0,
            reports_sent: 0,
        })
    }

    pub fn spec(&self) -> &AgentSpec {
        &self.spec
    }
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
    /// AARQ fields used by [`PhdAgent::associate`] (default [`AarqFields::for_spec`]).
    pub fn set_aarq_fields(&mut self, fields: AarqFields) {
        self.aarq_fields = fields;
    }
    /// The invoke id of the next invoke the agent sends (config report, confirmed or unconfirmed
    /// report; not the Antidote oximeter's fixed `0x1111`). Ids then count up, wrapping.
    pub fn set_next_invoke_id(&mut self, invoke_id: u16) {
        self.next_invoke_id = invoke_id;
    }
    /// The scan-report-no of the next report (default 0; counts up, wrapping).
    pub fn set_next_report_no(&mut self, report_no: u16) {
        self.next_report_no = report_no;
    }
    /// How long [`PhdAgent::associate`] and [`PhdAgent::release`] wait for each answer.
    pub fn set_response_timeout(&mut self, timeout: Duration) {
        self.response_timeout = timeout;
    }
    /// Whether GETs are answered automatically (default true). When false, they are returned by
    /// [`PhdAgent::read_apdu`] like anything else.
    pub fn set_answer_gets(&mut self, answer: bool) {
        self.answer_gets = answer;
    }
    /// The MDS Date-and-Time (BCD) reported in GET responses (default 2007-02-01 12:05, as C5).
    pub fn set_clock(&mut self, time: [u8; 8]) {
        self.clock = time;
    }
    /// GETs on the MDS (handle 0) answered so far.
    pub fn gets_answered(&self) -> u64 {
        self.gets_answered
    }
    /// Scan-report confirmations received so far.
    pub fn confirmations_received(&self) -> u64 {
        self.confirmations_received
    }
    /// Scan reports sent so far (confirmed or not).
    pub fn reports_sent(&self) -> u64 {
        self.reports_sent
    }

    /// AARQ → AARE. When the AARE says accepted-unknown-config (3), sends the config report
    /// (report id = the effective config id, the device's object table) and reads the
    /// ConfigReportRsp. A rejection is `Ok` with that result; `Err` means no AARE (or no
    /// ConfigReportRsp) arrived: close, ABRT, timeout, or something else in its place.
    pub async fn associate(&mut self) -> anyhow::Result<Association> {
        let deadline = Instant::now() + self.response_timeout;
        self.send_raw(&aarq_with(&self.spec, &self.aarq_fields))
            .await
            .context("sending AARQ")?;
        let aare = self
            .wait_for("AARE", deadline, false, |apdu| {
                tag(apdu) == Some(apdu::AARE)
            })
            .await?;
        let aare_result =
            u16_at(&aare, 4).ok_or_else(|| anyhow!("manager sent an AARE without a result"))?;
        if aare_result != aare_result::ACCEPTED_UNKNOWN_CONFIG {
            return Ok(Association {
                aare_result,
                config_result: None,
            });
        }
        let invoke_id = self.allocate_invoke_id();
        let deadline = Instant::now() + self.response_timeout;
        self.send_raw(&config_report(&self.spec, invoke_id))
            .await
            .context("sending the config report")?;
        let rsp = self
            .wait_for("ConfigReportRsp", deadline, false, |apdu| {
                answers(apdu, invoke_id)
            })
            .await?;
        let data =
            parse_data(&rsp).ok_or_else(|| anyhow!("malformed answer to the config report"))?;
        check_not_error(&data, "the config report")?;
        if data.choice != data_choice::RORS_CONFIRMED_EVENT_REPORT {
            bail!(
                "manager answered the config report with data choice {:#06x}",
                data.choice
            );
        }
        // EventReportResultSimple: obj-handle · currentTime · event-type · reply-info length ·
        // ConfigReportRsp { config-report-id, config-result }.
        let event = u16_at(data.body, 6);
        if event != Some(event_type::CONFIG) {
            bail!("manager's answer to the config report has event-type {event:?}, not 0x0D1C");
        }
        let config_result = u16_at(data.body, 12)
            .ok_or_else(|| anyhow!("manager's ConfigReportRsp is too short"))?;
        Ok(Association {
            aare_result,
            config_result: Some(config_result),
        })
    }

    /// One fixed-format scan report (MDC_NOTI_SCAN_REPORT_FIXED) with `time` as the absolute
    /// time stamp where the device's value map has one. Confirmed: waits for the confirmation
    /// (rors-cmip-confirmed-event-report, same invoke id) up to `timeout` (at most 3 s with
    /// Antidote quirks) and returns how long it took; unconfirmed: returns `None`.
    pub async fn report(
        &mut self,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        self.send_report(ScanForm::Fixed, reading, time, timeout)
            .await
    }

    /// Variable-format report (MDC_NOTI_SCAN_REPORT_VAR) of the same reading; as
    /// [`PhdAgent::report`].
    pub async fn report_var(
        &mut self,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        self.send_report(ScanForm::Var, reading, time, timeout)
            .await
    }

    /// Multi-person fixed report (MDC_NOTI_SCAN_REPORT_MP_FIXED) for `person_id`; as
    /// [`PhdAgent::report`].
    pub async fn report_mp_fixed(
        &mut self,
        person_id: u16,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        self.send_report(ScanForm::MpFixed { person_id }, reading, time, timeout)
            .await
    }

    /// Any report form; what the `report*` methods share.
    pub async fn send_report(
        &mut self,
        form: ScanForm,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        if reading.device() != self.spec.device {
            bail!(
                "a {:?} agent cannot report a {:?} reading (use send_raw with scan_report for that)",
                self.spec.device,
                reading.device()
            );
        }
        reading.check()?;
        let invoke_id = if self.spec.antidote_quirks && self.spec.device == PhdDevice::PulseOximeter
        {
            ANTIDOTE_OXIMETER_INVOKE_ID
        } else {
            self.allocate_invoke_id()
        };
        let report_no = self.next_report_no;
        self.next_report_no = self.next_report_no.wrapping_add(1);
        let bytes = scan_report(
            &self.spec,
            form,
            &ReportHeader::new(invoke_id, report_no),
            reading,
            time,
        );
        let started = Instant::now();
        self.send_raw(&bytes)
            .await
            .context("sending a scan report")?;
        self.reports_sent += 1;
        if !self.spec.sends_confirmed() {
            return Ok(None);
        }
        let timeout = if self.spec.antidote_quirks {
            timeout.min(ANTIDOTE_CONFIRM_TIMEOUT)
        } else {
            timeout
        };
        let waited = self
            .wait_for(
                "scan report confirmation",
                started + timeout,
                false,
                |apdu| answers(apdu, invoke_id),
            )
            .await;
        let answer = match waited {
            Ok(answer) => answer,
            Err(e) if self.closed.is_none() && e.is::<NoAnswer>() => {
                let reason = if self.spec.antidote_quirks {
                    reason::ABORT_UNDEFINED
                } else {
                    reason::ABORT_RESPONSE_TIMEOUT
                };
                // Best effort: the error that matters is the missing confirmation.
                let _ = self.send_raw(&abrt(reason)).await;
                return Err(e.context(format!("agent sent ABRT (reason {reason})")));
            }
            Err(e) => return Err(e),
        };
        let elapsed = started.elapsed();
        let data =
            parse_data(&answer).ok_or_else(|| anyhow!("malformed answer to a scan report"))?;
        check_not_error(&data, "a scan report")?;
        if data.choice != data_choice::RORS_CONFIRMED_EVENT_REPORT {
            bail!(
                "manager answered scan report {invoke_id:#06x} with data choice {:#06x}",
                data.choice
            );
        }
        self.confirmations_received += 1;
        Ok(Some(elapsed))
    }

    /// RLRQ (reason normal) → waits for RLRE; returns its reason. An RLRQ from the manager that
    /// crosses ours is answered with RLRE and the wait for the manager's RLRE goes on.
    pub async fn release(&mut self) -> anyhow::Result<u16> {
        let deadline = Instant::now() + self.response_timeout;
        self.send_raw(&rlrq(reason::RELEASE_NORMAL))
            .await
            .context("sending RLRQ")?;
        let rlre = self
            .wait_for("RLRE", deadline, true, |apdu| tag(apdu) == Some(apdu::RLRE))
            .await?;
        u16_at(&rlre, 4).ok_or_else(|| anyhow!("manager sent an RLRE without a reason"))
    }

    /// Send ABRT with `reason` (no answer expected).
    pub async fn abort(&mut self, reason: u16) -> anyhow::Result<()> {
        self.send_raw(&abrt(reason)).await.context("sending ABRT")
    }

    /// Write `bytes` as they are (any framing, any garbage).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.response_timeout;
        timeout_at(deadline, async {
            self.stream.write_all(bytes).await?;
            self.stream.flush().await
        })
        .await
        .map_err(|_| anyhow!("writing to PHD manager {} timed out", self.peer))?
        .with_context(|| format!("writing to PHD manager {}", self.peer))
    }

    /// Next whole APDU from the manager (header + body), or `None` on EOF, within `timeout`
    /// (`Err` when none arrives in time). APDUs kept while the agent waited for something else
    /// come first. GETs are answered and not returned (see [`PhdAgent::set_answer_gets`]).
    pub async fn read_apdu(&mut self, timeout: Duration) -> anyhow::Result<Option<Vec<u8>>> {
        if let Some(apdu) = self.inbox.pop_front() {
            return Ok(Some(apdu));
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.read_next(deadline).await? {
                Incoming::Apdu(apdu) => {
                    if !self.answered_get(&apdu).await? {
                        return Ok(Some(apdu));
                    }
                }
                Incoming::Closed => return Ok(None),
                Incoming::TimedOut => {
                    bail!("no APDU from PHD manager {} within {timeout:?}", self.peer)
                }
            }
        }
    }

    /// Whether the connection is known closed by the manager, and why.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    fn allocate_invoke_id(&mut self) -> u16 {
        let id = self.next_invoke_id;
        self.next_invoke_id = self.next_invoke_id.wrapping_add(1);
        id
    }

    /// Wait until `deadline` for an APDU `wanted` accepts (looking in the inbox first), keeping
    /// others for `read_apdu`. ABRT fails the wait; RLRQ is answered with RLRE and fails it
    /// unless `rlrq_completes` (a release collision), in which case waiting goes on.
    async fn wait_for(
        &mut self,
        what: &str,
        deadline: Instant,
        rlrq_completes: bool,
        wanted: impl Fn(&[u8]) -> bool,
    ) -> anyhow::Result<Vec<u8>> {
        if let Some(at) = self.inbox.iter().position(|apdu| wanted(apdu)) {
            if let Some(apdu) = self.inbox.remove(at) {
                return Ok(apdu);
            }
        }
        loop {
            let apdu = match self.read_next(deadline).await? {
                Incoming::Apdu(apdu) => apdu,
                Incoming::Closed => bail!(
                    "PHD manager {} closed the connection while the agent waited for {what} ({})",
                    self.peer,
                    self.closed.as_deref().unwrap_or("end of stream")
                ),
                Incoming::TimedOut => return Err(anyhow!(NoAnswer(what.to_string()))),
            };
            if wanted(&apdu) {
                return Ok(apdu);
            }
            if self.answered_get(&apdu).await? {
                continue;
            }
            match tag(&apdu) {
                Some(apdu::ABRT) => bail!(
                    "PHD manager aborted (ABRT reason {:?}) while the agent waited for {what}",
                    u16_at(&apdu, 4)
                ),
                Some(apdu::RLRQ) => {
                    self.send_raw(&rlre(reason::RELEASE_NORMAL))
                        .await
                        .context("answering the manager's RLRQ")?;
                    if !rlrq_completes {
                        bail!(
                            "PHD manager released (RLRQ reason {:?}, answered) while the agent waited for {what}",
                            u16_at(&apdu, 4)
                        );
                    }
                }
                _ => {
                    if self.inbox.len() >= MAX_INBOX {
                        bail!("{MAX_INBOX} unread APDUs while waiting for {what}; drain them with read_apdu");
                    }
                    self.inbox.push_back(apdu);
                }
            }
        }
    }

    /// If `apdu` is a GET and GETs are answered, answer it and return true.
    async fn answered_get(&mut self, apdu: &[u8]) -> anyhow::Result<bool> {
        if !self.answer_gets {
            return Ok(false);
        }
        let Some(data) = parse_data(apdu) else {
            return Ok(false);
        };
        if data.choice != data_choice::ROIV_GET {
            return Ok(false);
        }
        let Some(handle) = u16_at(data.body, 0) else {
            return Ok(false);
        };
        let answer = if handle == 0 {
            let ids = attribute_ids(&data.body[2..]);
            mds_get_response_filtered(&self.spec, data.invoke_id, &ids, self.clock)
        } else {
            roer(data.invoke_id, ROER_NO_SUCH_OBJECT_INSTANCE)
        };
        self.send_raw(&answer).await.context("answering a GET")?;
        if handle == 0 {
            self.gets_answered += 1;
        }
        Ok(true)
    }

    /// The next whole APDU, reading from the socket as needed until `deadline`.
    async fn read_next(&mut self, deadline: Instant) -> anyhow::Result<Incoming> {
        loop {
            if self.read_buf.len() >= 4 {
                let total =
                    usize::from(u16::from_be_bytes([self.read_buf[2], self.read_buf[3]])) + 4;
                if self.read_buf.len() >= total {
                    let rest = self.read_buf.split_off(total);
                    let apdu = std::mem::replace(&mut self.read_buf, rest);
                    return Ok(Incoming::Apdu(apdu));
                }
            }
            if self.closed.is_some() {
                if !self.read_buf.is_empty() {
                    bail!(
                        "PHD manager {} closed the connection inside an APDU ({} bytes pending)",
                        self.peer,
                        self.read_buf.len()
                    );
                }
                return Ok(Incoming::Closed);
            }
            let mut chunk = [0u8; 4096];
            match timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return Ok(Incoming::TimedOut),
                Ok(Ok(0)) => self.closed = Some("end of stream".to_string()),
                Ok(Ok(n)) => self.read_buf.extend_from_slice(&chunk[..n]),
                Ok(Err(e)) => self.closed = Some(e.to_string()),
            }
        }
    }
}

/// A wait that ended because its deadline passed.
#[derive(Debug)]
struct NoAnswer(String);

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no {} from the PHD manager in time", self.0)
    }
}

impl std::error::Error for NoAnswer {}

// ---------------------------------------------------------------------------------------------
// Reading what the manager sends (only the fields the agent needs; every access is checked).

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    let pair = bytes.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([pair[0], pair[1]]))
}

fn tag(apdu: &[u8]) -> Option<u16> {
    u16_at(apdu, 0)
}

/// The Data APDU inside a PRST.
struct DataApdu<'a> {
    invoke_id: u16,
    choice: u16,
    /// The message body, bounded by its own length field.
    body: &'a [u8],
}

fn parse_data(apdu: &[u8]) -> Option<DataApdu<'_>> {
    if tag(apdu)? != apdu::PRST {
        return None;
    }
    let invoke_id = u16_at(apdu, 6)?;
    let choice = u16_at(apdu, 8)?;
    let len = usize::from(u16_at(apdu, 10)?);
    let body = apdu.get(12..12 + len)?;
    Some(DataApdu {
        invoke_id,
        choice,
        body,
    })
}

/// Whether `apdu` is a response (rors, roer, rorj) to invoke `invoke_id`.
fn answers(apdu: &[u8], invoke_id: u16) -> bool {
    parse_data(apdu)
        .is_some_and(|data| data.invoke_id == invoke_id && matches!(data.choice >> 8, 0x02..=0x04))
}

fn check_not_error(data: &DataApdu<'_>, what: &str) -> anyhow::Result<()> {
    match data.choice {
        data_choice::ROER => bail!(
            "manager answered {what} with ROER error-value {:?}",
            u16_at(data.body, 0)
        ),
        data_choice::RORJ => bail!(
            "manager answered {what} with RORJ problem {:?}",
            u16_at(data.body, 0)
        ),
        _ => Ok(()),
    }
}

/// The ids of a GET's attribute-id-list (count · length · ids); malformed → empty (= all).
fn attribute_ids(list: &[u8]) -> Vec<u16> {
    let (Some(count), Some(len)) = (u16_at(list, 0), u16_at(list, 2)) else {
        return Vec::new();
    };
    let Some(ids) = list.get(4..4 + usize::from(len)) else {
        return Vec::new();
    };
    ids.chunks_exact(2)
        .take(usize::from(count))
        .map(|pair| u16::from_be_bytes([pair[0], pair[1]]))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Pure encoders.

/// AARQ of `spec` with [`AarqFields::for_spec`].
pub fn aarq(spec: &AgentSpec) -> Vec<u8> {
    aarq_with(spec, &AarqFields::for_spec(spec))
}

/// AARQ of `spec` (system id, effective config id) with `fields` as given.
pub fn aarq_with(spec: &AgentSpec, fields: &AarqFields) -> Vec<u8> {
    let mut w = Mder::new();
    w.u16(apdu::AARQ);
    w.with_len(|w| {
        w.u32(fields.assoc_version);
        w.seq(1, |w| {
            w.u16(DATA_PROTO_ID_20601);
            w.with_len(|w| {
                w.u32(fields.protocol_version);
                w.u16(fields.encoding_rules);
                w.u32(fields.nomenclature_version);
                w.u32(fields.functional_units);
                w.u32(fields.system_type);
                w.octets(&spec.system_id);
                w.u16(spec.effective_config_id());
                w.u16(fields.data_req_mode_flags);
                w.u8(fields.data_req_init_agent_count);
                w.u8(fields.data_req_init_manager_count);
                w.seq(0, |_| {}); // option-list
            });
        });
    });
    w.finish()
}

/// The config report (MDC_NOTI_CONFIG, confirmed, obj-handle 0): report id = the effective
/// config id, the device's object table (see the module documentation).
pub fn config_report(spec: &AgentSpec, invoke_id: u16) -> Vec<u8> {
    let objects = object_table(spec);
    prst(invoke_id, data_choice::ROIV_CONFIRMED_EVENT_REPORT, |w| {
        event_report_body(w, EVENT_TIME_UNUSED, event_type::CONFIG, |w| {
            w.u16(spec.effective_config_id());
            w.seq(objects.len(), |w| {
                for object in &objects {
                    w.u16(MOC_VMO_METRIC_NU);
                    w.u16(object.handle);
                    w.seq(object.attributes.len(), |w| {
                        for (id, value) in &object.attributes {
                            w.u16(*id);
                            w.octets(value);
                        }
                    });
                }
            });
        });
    })
}

/// One fixed-format scan report with default header fields (event-time `0xFFFFFFFF`,
/// agent-initiated), confirmed or not per [`AgentSpec::sends_confirmed`].
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report_fixed(
    spec: &AgentSpec,
    invoke_id: u16,
    report_no: u16,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    scan_report(
        spec,
        ScanForm::Fixed,
        &ReportHeader::new(invoke_id, report_no),
        reading,
        time,
    )
}

/// [`scan_report_fixed`] in the variable format.
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report_var(
    spec: &AgentSpec,
    invoke_id: u16,
    report_no: u16,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    scan_report(
        spec,
        ScanForm::Var,
        &ReportHeader::new(invoke_id, report_no),
        reading,
        time,
    )
}

/// [`scan_report_fixed`] in the multi-person fixed format, for `person_id`.
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report_mp_fixed(
    spec: &AgentSpec,
    invoke_id: u16,
    report_no: u16,
    person_id: u16,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    scan_report(
        spec,
        ScanForm::MpFixed { person_id },
        &ReportHeader::new(invoke_id, report_no),
        reading,
        time,
    )
}

/// Any scan report. The reading decides the handles and their layout (a reading of another
/// device than `spec.device` is encoded anyway — handy for negative tests); `spec` decides
/// confirmed or not, the oximeter's time stamps, and the quirks.
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report(
    spec: &AgentSpec,
    form: ScanForm,
    header: &ReportHeader,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    if let Err(e) = reading.check() {
        panic!("scan_report: {e}");
    }
    let observations = observations(spec, reading, time);
    let choice = if spec.sends_confirmed() {
        data_choice::ROIV_CONFIRMED_EVENT_REPORT
    } else {
        data_choice::ROIV_EVENT_REPORT
    };
    let event = match form {
        ScanForm::Fixed => event_type::SCAN_REPORT_FIXED,
        ScanForm::Var => event_type::SCAN_REPORT_VAR,
        ScanForm::MpFixed { .. } => event_type::SCAN_REPORT_MP_FIXED,
    };
    let fixed = |w: &mut Mder| {
        w.seq(observations.len(), |w| {
            for obs in &observations {
                w.u16(obs.handle);
                w.with_len(|w| {
                    for (_, value) in &obs.attributes {
                        w.bytes(value);
                    }
                });
            }
        });
    };
    prst(header.invoke_id, choice, |w| {
        event_report_body(w, header.event_time, event, |w| {
            w.u16(header.data_req_id);
            w.u16(header.report_no);
            match form {
                ScanForm::Fixed => fixed(w),
                ScanForm::Var => w.seq(observations.len(), |w| {
                    for obs in &observations {
                        w.u16(obs.handle);
                        w.seq(obs.attributes.len(), |w| {
                            for (id, value) in &obs.attributes {
                                w.u16(*id);
                                w.octets(value);
                            }
                        });
                    }
                }),
                ScanForm::MpFixed { person_id } => w.seq(1, |w| {
                    w.u16(person_id);
                    fixed(w);
                }),
            }
            if spec.antidote_quirks && spec.device == PhdDevice::Glucometer {
                w.bytes(&[0, 0]);
            }
        });
    })
}

/// GET response (rors-cmip-get, handle 0) with all MDS attributes; for the oximeter with the
/// vectors' system id, config `0x0190` and `clock` 2007-02-01 12:05 this is vector C5.
pub fn mds_get_response(spec: &AgentSpec, invoke_id: u16, clock: [u8; 8]) -> Vec<u8> {
    mds_get_response_filtered(spec, invoke_id, &[], clock)
}

/// [`mds_get_response`] limited to the attribute ids in `ids` (empty = all).
pub fn mds_get_response_filtered(
    spec: &AgentSpec,
    invoke_id: u16,
    ids: &[u16],
    clock: [u8; 8],
) -> Vec<u8> {
    let attributes: Vec<(u16, Vec<u8>)> = mds_attributes(spec, clock)
        .into_iter()
        .filter(|(id, _)| ids.is_empty() || ids.contains(id))
        .collect();
    prst(invoke_id, data_choice::RORS_GET, |w| {
        w.u16(0); // obj-handle: the MDS
        w.seq(attributes.len(), |w| {
            for (id, value) in &attributes {
                w.u16(*id);
                w.octets(value);
            }
        });
    })
}

/// RLRQ with `reason`.
pub fn rlrq(reason: u16) -> Vec<u8> {
    short_apdu(apdu::RLRQ, reason)
}

/// RLRE with `reason`.
pub fn rlre(reason: u16) -> Vec<u8> {
    short_apdu(apdu::RLRE, reason)
}

/// ABRT with `reason`.
pub fn abrt(reason: u16) -> Vec<u8> {
    short_apdu(apdu::ABRT, reason)
}

/// ROER with `error_value` and an empty parameter.
fn roer(invoke_id: u16, error_value: u16) -> Vec<u8> {
    prst(invoke_id, data_choice::ROER, |w| {
        w.u16(error_value);
        w.u16(0);
    })
}

fn short_apdu(tag: u16, reason: u16) -> Vec<u8> {
    let mut w = Mder::new();
    w.u16(tag);
    w.with_len(|w| w.u16(reason));
    w.finish()
}

/// PRST around a Data APDU: `E7 00 | L | L-2 | invoke-id | choice | length | message`.
fn prst(invoke_id: u16, choice: u16, message: impl FnOnce(&mut Mder)) -> Vec<u8> {
    let mut w = Mder::new();
    w.u16(apdu::PRST);
    w.with_len(|w| {
        w.with_len(|w| {
            w.u16(invoke_id);
            w.u16(choice);
            w.with_len(message);
        });
    });
    w.finish()
}

/// EventReportArgumentSimple on the MDS (obj-handle 0).
fn event_report_body(w: &mut Mder, event_time: u32, event: u16, info: impl FnOnce(&mut Mder)) {
    w.u16(0);
    w.u32(event_time);
    w.u16(event);
    w.with_len(info);
}

/// One configuration object: handle and its attributes in wire order.
struct ConfigObject {
    handle: u16,
    attributes: Vec<(u16, Vec<u8>)>,
}

fn be(values: &[u16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_be_bytes()).collect()
}

/// A SEQUENCE OF u16 pairs / u16 values as an attribute value: count · length · items.
fn seq_value(count: usize, items: &[u16]) -> Vec<u8> {
    let mut w = Mder::new();
    w.seq(count, |w| {
        for item in items {
            w.u16(*item);
        }
    });
    w.finish()
}

/// Metric-Spec-Small of the oximeter (`0x4040`) and of the other devices (`0xF040`).
fn numeric(
    handle: u16,
    code: u16,
    spec_small: u16,
    unit: u16,
    value_map: &[(u16, u16)],
) -> ConfigObject {
    let map: Vec<u16> = value_map.iter().flat_map(|(id, len)| [*id, *len]).collect();
    ConfigObject {
        handle,
        attributes: vec![
            (ATTR_ID_TYPE, be(&[PART_SCADA, code])),
            (ATTR_METRIC_SPEC_SMALL, be(&[spec_small])),
            (ATTR_UNIT_CODE, be(&[unit])),
            (ATTR_ATTRIBUTE_VAL_MAP, seq_value(value_map.len(), &map)),
        ],
    }
}

fn object_table(spec: &AgentSpec) -> Vec<ConfigObject> {
    const SFLOAT: (u16, u16) = (ATTR_NU_VAL_OBS_BASIC, 2);
    const FLOAT: (u16, u16) = (ATTR_NU_VAL_OBS_SIMP, 4);
    const TIME: (u16, u16) = (ATTR_TIME_STAMP_ABS, 8);
    match spec.device {
        PhdDevice::PulseOximeter => {
            // Under 0x0190 Antidote's table (C1), also with quirks; extended: B3.
            let map: &[(u16, u16)] = if spec.effective_config_id() == 0x0190 {
                &[SFLOAT]
            } else {
                &[SFLOAT, TIME]
            };
            vec![
                numeric(1, 0x4BB8, 0x4040, 0x0220, map),
                numeric(10, 0x481A, 0x4040, 0x0AA0, map),
            ]
        }
        PhdDevice::BloodPressure => {
            let mut nibp = numeric(
                1,
                0x4A04,
                0xF040,
                0x0F20,
                &[(ATTR_NU_CMPD_VAL_OBS_BASIC, 10), TIME],
            );
            nibp.attributes
                .insert(2, (ATTR_METRIC_STRUCT_SMALL, be(&[0x0303])));
            nibp.attributes.insert(
                3,
                (ATTR_ID_PHYSIO_LIST, seq_value(3, &[0x4A05, 0x4A06, 0x4A07])),
            );
            vec![nibp, numeric(2, 0x482A, 0xF040, 0x0AA0, &[SFLOAT, TIME])]
        }
        PhdDevice::WeighingScale => vec![
            numeric(1, 0xE140, 0xF040, 0x06C3, &[FLOAT, TIME]),
            numeric(3, 0xE150, 0xF040, 0x07A0, &[FLOAT, TIME]),
        ],
        PhdDevice::Glucometer => vec![numeric(1, 0x71B8, 0xF040, 0x0852, &[SFLOAT, TIME])],
    }
}

/// One observation: handle and its value-map attributes (id, encoded value) in order.
struct Observation {
    handle: u16,
    attributes: Vec<(u16, Vec<u8>)>,
}

fn observations(spec: &AgentSpec, reading: &Reading, time: [u8; 8]) -> Vec<Observation> {
    let sf = |v: (i32, i8)| (ATTR_NU_VAL_OBS_BASIC, sfloat(v).to_be_bytes().to_vec());
    let fl = |v: (i32, i8)| (ATTR_NU_VAL_OBS_SIMP, float(v).to_be_bytes().to_vec());
    let ts = (ATTR_TIME_STAMP_ABS, time.to_vec());
    let obs = |handle: u16, attributes: Vec<(u16, Vec<u8>)>| Observation { handle, attributes };
    match *reading {
        Reading::Oximeter { spo2, pulse } => {
            let with_time = |v| {
                let mut attributes = vec![sf(v)];
                if spec.oximeter_time_stamped() {
                    attributes.push(ts.clone());
                }
                attributes
            };
            vec![obs(1, with_time(spo2)), obs(10, with_time(pulse))]
        }
        Reading::BloodPressure {
            systolic,
            diastolic,
            mean,
            pulse,
        } => {
            let compound = seq_value(3, &[sfloat(systolic), sfloat(diastolic), sfloat(mean)]);
            vec![
                obs(1, vec![(ATTR_NU_CMPD_VAL_OBS_BASIC, compound), ts.clone()]),
                obs(2, vec![sf(pulse), ts.clone()]),
            ]
        }
        Reading::Scale { mass_kg, bmi } => {
            let once = [
                obs(1, vec![fl(mass_kg), ts.clone()]),
                obs(3, vec![fl(bmi), ts.clone()]),
            ];
            let times = if spec.antidote_quirks { 2 } else { 1 };
            (0..times)
                .flat_map(|_| {
                    once.iter().map(|o| Observation {
                        handle: o.handle,
                        attributes: o.attributes.clone(),
                    })
                })
                .collect()
        }
        Reading::Glucose { mg_dl } => vec![obs(1, vec![sf(mg_dl), ts])],
    }
}

/// The MDS attributes a GET returns, in the order of vector C5.
fn mds_attributes(spec: &AgentSpec, clock: [u8; 8]) -> Vec<(u16, Vec<u8>)> {
    let mut model = Mder::new();
    model.text(b"TheCompany");
    model.text(spec.device.model());
    let mut system_id = Mder::new();
    system_id.octets(&spec.system_id);
    let mut prod_spec = Mder::new();
    prod_spec.seq(1, |w| {
        w.u16(1); // spec-type: serial-number
        w.u16(0); // component-id
        w.octets(b"DE124567");
    });
    vec![
        (
            ATTR_SYS_TYPE_SPEC_LIST,
            seq_value(1, &[spec.device.spec_profile(), 1]),
        ),
        (ATTR_ID_MODEL, model.finish()),
        (ATTR_SYS_ID, system_id.finish()),
        (ATTR_DEV_CONFIG_ID, be(&[spec.effective_config_id()])),
        (ATTR_ID_PROD_SPECN, prod_spec.finish()),
        (ATTR_TIME_ABS, clock.to_vec()),
    ]
}

fn sfloat_fits((mantissa, exponent): (i32, i8)) -> bool {
    (-2048..=2047).contains(&mantissa) && (-8..=7).contains(&exponent)
}

fn float_fits((mantissa, _): (i32, i8)) -> bool {
    (-8_388_608..=8_388_607).contains(&mantissa)
}

/// SFLOAT: exponent in the high 4 bits, mantissa in the low 12, both two's complement.
/// Callers check [`sfloat_fits`] first (via [`Reading::check`]).
fn sfloat((mantissa, exponent): (i32, i8)) -> u16 {
    ((exponent as u16 & 0x000F) << 12) | (mantissa as u16 & 0x0FFF)
}

/// FLOAT: exponent in the high 8 bits, mantissa in the low 24.
fn float((mantissa, exponent): (i32, i8)) -> u32 {
    (u32::from(exponent as u8) << 24) | (mantissa as u32 & 0x00FF_FFFF)
}

/// A tiny MDER writer: big-endian integers and back-patched u16 length fields.
struct Mder {
    buf: Vec<u8>,
}

impl Mder {
    fn new() -> Mder {
        Mder {
            buf: Vec::with_capacity(128),
        }
    }
    fn finish(self) -> Vec<u8> {
        self.buf
    }
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    /// A u16 length, then what `body` writes; the length is patched in afterwards.
    fn with_len(&mut self, body: impl FnOnce(&mut Mder)) {
        let at = self.buf.len();
        self.u16(0);
        body(self);
        let len = self.buf.len() - at - 2;
        // Invariant: every APDU this module builds is a few hundred bytes at most (fixed tables,
        // one reading, up to 4 observations), far below the 16-bit limit.
        let len = u16::try_from(len).expect("PHD APDU part longer than 65535 bytes");
        self.buf[at..at + 2].copy_from_slice(&len.to_be_bytes());
    }
    /// SEQUENCE OF: count, then a length around what `items` writes.
    fn seq(&mut self, count: usize, items: impl FnOnce(&mut Mder)) {
        // Same invariant as in `with_len`: counts are tiny.
        self.u16(u16::try_from(count).expect("PHD sequence longer than 65535 items"));
        self.with_len(items);
    }
    /// OCTET STRING: length + bytes.
    fn octets(&mut self, v: &[u8]) {
        self.with_len(|w| w.bytes(v));
    }
    /// Text as an OCTET STRING padded to even length with one zero byte (Annex H style, C5).
    fn text(&mut self, v: &[u8]) {
        self.with_len(|w| {
            w.bytes(v);
            if v.len() % 2 == 1 {
                w.u8(0);
            }
        });
    }
}
