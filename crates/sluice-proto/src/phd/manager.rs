//! The manager's side of one agent connection (fact sheet §3–§9), sans-IO: APDUs and `now`
//! in, [`Output`]s (APDUs to send, facts for the gateway) out, one timer to wake for.
//!
//! Owns: the association state ([`State`]), the association decision (AARQ → AARE), the
//! configuration exchange, the timers, and the APDU-level rules (what is a violation in which
//! state and how it is answered). Does not own: sockets, clocks, where configurations are
//! stored (a [`ConfigLookup`] is asked; an accepted table is handed out as
//! [`Output::ConfigAccepted`] to be stored), what measurements become, or when a confirmed
//! report is confirmed — the gateway confirms it ([`confirmation`]) once its measurements
//! are delivered.
//!
//! # States (the manager's, after 20601's table as Antidote implements it)
//! - [`State::Unassociated`]: connected, waiting for an AARQ (association timer). The
//!   issue's "associating" is the instant between an AARQ and its AARE: the decision is
//!   synchronous, so no APDU is ever read in it.
//! - [`State::Configuring`]: AARE accepted-unknown-config sent; waiting for the config
//!   report (configuration timer → ABRT configuration-timeout).
//! - [`State::Operating`]: reports are decoded and confirmed. A GET of the MDS attributes
//!   is sent on entry (when configured); its answer is awaited with the response timer
//!   (→ ABRT response-timeout).
//! - [`State::Disassociating`]: the manager sent RLRQ; waiting for RLRE (release timer →
//!   ABRT undefined).
//!
//! After a release or an abort the connection stays open and is Unassociated again (the
//! agent may associate anew); an Unassociated connection that stays silent for the
//! association timeout is closed ([`Output::Close`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::apdu::{
    abort, result, Aare, Aarq, Apdu, DataApdu, DataMessage, DataProto, PhdAssociationInformation,
    DATA_PROTO_20601,
};
use super::config::{config_result, encode_config_response, standard, ObjectTable, NOTI_CONFIG};
use super::mder::DecodeError;
use super::scan::{self, ScanReport};

/// assoc-version1.
pub const ASSOC_VERSION_1: u32 = 0x8000_0000;
/// protocol-version1 bit.
pub const PROTOCOL_VERSION_1: u32 = 0x8000_0000;
/// MDER bit of encoding-rules.
pub const MDER: u16 = 0x8000;
/// ROER error-value access-denied.
pub const ROER_ACCESS_DENIED: u16 = 2;
/// ROER error-value protocol-violation.
pub const ROER_PROTOCOL_VIOLATION: u16 = 23;
/// ROER error-value not-allowed-by-object.
pub const ROER_NOT_ALLOWED_BY_OBJECT: u16 = 24;
/// RORJ problem unrecognized-operation.
pub const RORJ_UNRECOGNIZED_OPERATION: u16 = 101;

/// The manager's settings.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The manager's EUI-64, sent in every AARE.
    pub system_id: [u8; 8],
    /// Silence allowed while unassociated (before an AARQ) before the connection is closed.
    pub association_timeout: Duration,
    /// Wait for the config report after accepted-unknown-config.
    pub configuration_timeout: Duration,
    /// Wait for the answer to the manager's own confirmed invokes (the MDS GET).
    pub response_timeout: Duration,
    /// Wait for RLRE after the manager's RLRQ.
    pub release_timeout: Duration,
    /// Ask the agent for its MDS attributes (system id, model, time) once operating.
    pub get_mds: bool,
    /// The invoke-id of the manager's first request on a connection (then counting up).
    pub first_invoke_id: u16,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            system_id: [0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11],
            association_timeout: Duration::from_secs(10),
            configuration_timeout: Duration::from_secs(10),
            response_timeout: Duration::from_secs(3),
            release_timeout: Duration::from_secs(10),
            get_mds: true,
            first_invoke_id: 0x3456,
        }
    }
}

/// Where the manager looks up configurations it already knows.
pub trait ConfigLookup {
    /// The table of `config_id` for the agent `system_id`: a standard one, or an extended one
    /// stored for this agent earlier.
    fn known(&self, system_id: &[u8], config_id: u16) -> Option<Arc<ObjectTable>>;

    /// Whether `table`, just reported by the agent `system_id`, may be accepted and stored.
    /// A gateway says no when it already holds a *different* table for the same system id
    /// and config id (taught by whoever claimed that system id first): the report is then
    /// answered unsupported-config and the association aborted ([`Output::ConfigConflict`]).
    /// Default: yes.
    fn may_learn(&self, _system_id: &[u8], _table: &ObjectTable) -> bool {
        true
    }
}

/// Only the built-in standard configurations.
pub struct StandardOnly;

impl ConfigLookup for StandardOnly {
    fn known(&self, _system_id: &[u8], config_id: u16) -> Option<Arc<ObjectTable>> {
        standard(config_id).map(|t| Arc::new(t.clone()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Unassociated,
    Configuring,
    Operating,
    Disassociating,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Unassociated => "unassociated",
            State::Configuring => "configuring",
            State::Operating => "operating",
            State::Disassociating => "disassociating",
        }
    }
}

/// Who the associated agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentInfo {
    pub system_id: [u8; 8],
    /// The configuration in use (the AARQ's, or the accepted report's).
    pub config_id: u16,
}

/// What a protocol violation was (counted and logged by the gateway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// An APDU not allowed in the current state (answered with ABRT).
    UnexpectedApdu,
    /// A report or config whose inner structure does not decode (ABRT).
    Malformed,
    /// An invoke the manager does not serve (answered RORJ).
    UnsupportedInvoke,
    /// A report outside Operating (answered ROER).
    ReportNotOperating,
    /// Observations that could not be read (unknown handle, length not matching the map).
    SkippedObservations,
}

/// What the gateway must do or know after an input.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Send(Apdu),
    /// The agent is associated with a configuration the manager knew.
    Associated {
        agent: AgentInfo,
    },
    /// The agent is associated; its configuration is being learnt.
    Configuring {
        agent: AgentInfo,
    },
    /// AARQ refused with this AARE result.
    Rejected {
        result: u16,
    },
    /// A config report was accepted: store it for (system id, config id).
    ConfigAccepted {
        agent: AgentInfo,
        table: Arc<ObjectTable>,
    },
    /// A config report was refused because the lookup holds a different table for the same
    /// system id and config id ([`ConfigLookup::may_learn`]): answered unsupported-config,
    /// then the association aborted.
    ConfigConflict {
        agent: AgentInfo,
    },
    /// A config report was answered unsupported-config (or standard-config-unknown).
    ConfigRefused {
        config_id: u16,
        result: u16,
    },
    /// Measurements. A `confirmed` one must be answered with [`confirmation`] (`invoke_id`,
    /// `obj_handle`, `event_type`) once delivered.
    Report {
        invoke_id: u16,
        confirmed: bool,
        obj_handle: u16,
        event_type: u16,
        report: ScanReport,
    },
    /// The agent's MDS attributes (an AttributeList: count · length · elements).
    MdsAttributes(Bytes),
    /// The association ended normally (RLRQ/RLRE).
    Released,
    /// The association was aborted: by the agent, or by the manager with `reason`.
    Aborted {
        by_agent: bool,
        reason: u16,
    },
    Violation(Violation),
    /// Close the transport.
    Close,
}

/// The confirmation of a confirmed event report (§8), sent once its measurements are
/// delivered.
pub fn confirmation(invoke_id: u16, obj_handle: u16, event_type: u16) -> Apdu {
    DataApdu::confirm(invoke_id, obj_handle, event_type)
}

/// The answer to a confirmed event report whose measurements the gateway could not make safe
/// (an uplink refused them for good): ROER with `error` (e.g. [`ROER_ACCESS_DENIED`]) and an
/// empty parameter, in place of the confirmation. 20601 answers any confirmed invoke with
/// rors, roer or rorj; an agent that gets no rors keeps the measurement unconfirmed.
pub fn report_refused(invoke_id: u16, error: u16) -> Apdu {
    Apdu::Prst(DataApdu {
        invoke_id,
        message: DataMessage::Error {
            error,
            parameter: Bytes::new(),
        },
    })
}

/// An AARE with `result` and the manager's association information (any result: Antidote
/// keeps the full information in rejections too, vector C3).
pub fn rejection(config: &ManagerConfig, result: u16) -> Apdu {
    let info = PhdAssociationInformation {
        protocol_version: PROTOCOL_VERSION_1,
        encoding_rules: MDER,
        nomenclature_version: 0x8000_0000,
        functional_units: 0,
        system_type: 0x8000_0000,
        system_id: Bytes::copy_from_slice(&config.system_id),
        dev_config_id: 0,
        data_req_mode_flags: 0,
        data_req_init_agent_count: 0,
        data_req_init_manager_count: 0,
        option_list: Bytes::from_static(&[0, 0, 0, 0]),
    };
    let mut b = BytesMut::with_capacity(38);
    info.encode(&mut b);
    Apdu::Aare(Aare {
        result,
        proto: DataProto {
            id: DATA_PROTO_20601,
            info: b.freeze(),
        },
    })
}

/// One agent connection's manager.
#[derive(Debug, Clone)]
pub struct Manager {
    config: Arc<ManagerConfig>,
    state: State,
    agent: Option<AgentInfo>,
    table: Option<Arc<ObjectTable>>,
    deadline: Option<Instant>,
    next_invoke: u16,
    pending_get: Option<u16>,
}

impl Manager {
    /// A new connection: Unassociated, with the association timer running.
    pub fn new(config: Arc<ManagerConfig>, now: Instant) -> Manager {
        let deadline = Some(now + config.association_timeout);
        let next_invoke = config.first_invoke_id;
        Manager {
            config,
            state: State::Unassociated,
            agent: None,
            table: None,
            deadline,
            next_invoke,
            pending_get: None,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn agent(&self) -> Option<&AgentInfo> {
        self.agent.as_ref()
    }

    /// The table reports are decoded with (Operating only).
    pub fn table(&self) -> Option<&Arc<ObjectTable>> {
        self.table.as_ref()
    }

    /// When [`Manager::on_timeout`] must be called.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether `apdu` is for the data plane of an operating association: a measurement
    /// report, or the answer to the manager's MDS GET (agents often send it after their
    /// first report, so it need not move the connection back). Everything else is
    /// signalling.
    pub fn is_data(&self, apdu: &Apdu) -> bool {
        if self.state != State::Operating {
            return false;
        }
        match apdu {
            Apdu::Prst(DataApdu {
                message: DataMessage::EventReport { event_type, .. },
                ..
            }) => scan::layout(*event_type).is_some(),
            Apdu::Prst(DataApdu {
                invoke_id,
                message:
                    DataMessage::GetResult { .. }
                    | DataMessage::Error { .. }
                    | DataMessage::Reject { .. },
            }) => self.pending_get == Some(*invoke_id),
            _ => false,
        }
    }

    /// The transport delivered bytes that are not a valid APDU.
    pub fn on_decode_error(&mut self, err: &DecodeError, now: Instant, out: &mut Vec<Output>) {
        let reason = match err {
            DecodeError::TooLarge { .. } => abort::BUFFER_OVERFLOW,
            _ => abort::UNDEFINED,
        };
        out.push(Output::Violation(Violation::Malformed));
        let was = self.state;
        self.abort(reason, now, out);
        if reason == abort::BUFFER_OVERFLOW && was != State::Unassociated {
            // The oversize APDU's bytes are still on the stream: no way to resynchronise.
            self.deadline = None;
            out.push(Output::Close);
        }
    }

    /// One APDU from the agent.
    pub fn on_apdu(
        &mut self,
        apdu: Apdu,
        now: Instant,
        lookup: &dyn ConfigLookup,
        out: &mut Vec<Output>,
    ) {
        match (self.state, apdu) {
            (_, Apdu::Abrt { reason }) => {
                if self.state != State::Unassociated {
                    self.unassociated(now);
                    out.push(Output::Aborted {
                        by_agent: true,
                        reason,
                    });
                }
            }
            (State::Unassociated, Apdu::Aarq(aarq)) => self.associate(aarq, now, lookup, out),
            (State::Unassociated, Apdu::Rlre { .. }) => {}
            (State::Configuring | State::Operating, Apdu::Rlrq { .. }) => {
                out.push(Output::Send(Apdu::Rlre { reason: 0 }));
                self.unassociated(now);
                out.push(Output::Released);
            }
            (State::Disassociating, Apdu::Rlre { .. }) => {
                self.unassociated(now);
                out.push(Output::Released);
            }
            (State::Disassociating, Apdu::Rlrq { .. }) => {
                out.push(Output::Send(Apdu::Rlre { reason: 0 }));
            }
            (State::Disassociating, Apdu::Prst(_)) => {} // late data while releasing
            (State::Configuring, Apdu::Prst(d)) => self.configuring(d, now, lookup, out),
            (State::Operating, Apdu::Prst(d)) => self.operating(d, now, out),
            _ => {
                out.push(Output::Violation(Violation::UnexpectedApdu));
                self.abort(abort::UNDEFINED, now, out);
            }
        }
    }

    /// The deadline passed.
    pub fn on_timeout(&mut self, now: Instant, out: &mut Vec<Output>) {
        if !matches!(self.deadline, Some(d) if d <= now) {
            return;
        }
        match self.state {
            State::Unassociated => {
                self.deadline = None;
                out.push(Output::Close);
            }
            State::Configuring => self.abort(abort::CONFIGURATION_TIMEOUT, now, out),
            State::Operating => self.abort(abort::RESPONSE_TIMEOUT, now, out),
            State::Disassociating => self.abort(abort::UNDEFINED, now, out),
        }
    }

    /// The manager ends the association (shutdown): RLRQ, then wait for RLRE.
    pub fn release(&mut self, now: Instant, out: &mut Vec<Output>) {
        if matches!(self.state, State::Configuring | State::Operating) {
            out.push(Output::Send(Apdu::Rlrq { reason: 0 }));
            self.state = State::Disassociating;
            self.deadline = Some(now + self.config.release_timeout);
        }
    }

    fn unassociated(&mut self, now: Instant) {
        self.state = State::Unassociated;
        self.agent = None;
        self.table = None;
        self.pending_get = None;
        self.deadline = Some(now + self.config.association_timeout);
    }

    fn abort(&mut self, reason: u16, now: Instant, out: &mut Vec<Output>) {
        out.push(Output::Send(Apdu::Abrt { reason }));
        let was = self.state;
        self.unassociated(now);
        out.push(Output::Aborted {
            by_agent: false,
            reason,
        });
        if was == State::Unassociated {
            // Nothing to go back to: a violation before association ends the connection.
            self.deadline = None;
            out.push(Output::Close);
        }
    }

    fn aare(&self, result: u16) -> Apdu {
        rejection(&self.config, result)
    }

    fn reject(&mut self, result: u16, out: &mut Vec<Output>) {
        out.push(Output::Send(self.aare(result)));
        out.push(Output::Rejected { result });
    }

    fn associate(
        &mut self,
        aarq: Aarq,
        now: Instant,
        lookup: &dyn ConfigLookup,
        out: &mut Vec<Output>,
    ) {
        if aarq.assoc_version != ASSOC_VERSION_1 {
            return self.reject(result::REJECTED_UNSUPPORTED_ASSOC_VERSION, out);
        }
        let Some(proto) = aarq.protos.iter().find(|p| p.id == DATA_PROTO_20601) else {
            return self.reject(result::REJECTED_NO_COMMON_PROTOCOL, out);
        };
        let info = match PhdAssociationInformation::decode(proto.info.clone()) {
            Ok(info) => info,
            Err(_) => {
                out.push(Output::Violation(Violation::Malformed));
                return self.abort(abort::UNDEFINED, now, out);
            }
        };
        if info.protocol_version & PROTOCOL_VERSION_1 == 0 || info.encoding_rules & MDER == 0 {
            return self.reject(result::REJECTED_NO_COMMON_PARAMETER, out);
        }
        let Ok(system_id) = <[u8; 8]>::try_from(&info.system_id[..]) else {
            return self.reject(result::REJECTED_UNKNOWN, out);
        };
        let config_id = info.dev_config_id;
        if config_id == 0 || config_id >= 0x8000 {
            return self.reject(result::REJECTED_UNKNOWN, out);
        }
        let agent = AgentInfo {
            system_id,
            config_id,
        };
        self.agent = Some(agent.clone());
        match lookup.known(&system_id, config_id) {
            Some(table) => {
                out.push(Output::Send(self.aare(result::ACCEPTED)));
                self.table = Some(table);
                out.push(Output::Associated { agent });
                self.operate(now, out);
            }
            None => {
                out.push(Output::Send(self.aare(result::ACCEPTED_UNKNOWN_CONFIG)));
                self.state = State::Configuring;
                self.deadline = Some(now + self.config.configuration_timeout);
                out.push(Output::Configuring { agent });
            }
        }
    }

    fn operate(&mut self, now: Instant, out: &mut Vec<Output>) {
        self.state = State::Operating;
        self.deadline = None;
        if self.config.get_mds {
            let invoke_id = self.invoke_id();
            out.push(Output::Send(Apdu::Prst(DataApdu {
                invoke_id,
                message: DataMessage::Get {
                    obj_handle: 0,
                    attribute_ids: Vec::new(),
                },
            })));
            self.pending_get = Some(invoke_id);
            self.deadline = Some(now + self.config.response_timeout);
        }
    }

    fn invoke_id(&mut self) -> u16 {
        let id = self.next_invoke;
        self.next_invoke = self.next_invoke.wrapping_add(1);
        id
    }

    fn configuring(
        &mut self,
        d: DataApdu,
        now: Instant,
        lookup: &dyn ConfigLookup,
        out: &mut Vec<Output>,
    ) {
        let DataMessage::EventReport {
            confirmed: true,
            obj_handle: 0,
            event_type: NOTI_CONFIG,
            info,
            ..
        } = d.message
        else {
            return self.not_operating(d, out);
        };
        let Some(agent) = self.agent.clone() else {
            return self.abort(abort::UNDEFINED, now, out);
        };
        let respond = |config_id: u16, result: u16| {
            Apdu::Prst(DataApdu {
                invoke_id: d.invoke_id,
                message: DataMessage::EventReportResult {
                    obj_handle: 0,
                    current_time: 0,
                    event_type: NOTI_CONFIG,
                    reply_info: encode_config_response(config_id, result),
                },
            })
        };
        let table = match ObjectTable::decode_report(info) {
            Ok(t) => t,
            Err(_) => {
                out.push(Output::Violation(Violation::Malformed));
                let id = agent.config_id;
                out.push(Output::Send(respond(id, config_result::UNSUPPORTED)));
                out.push(Output::ConfigRefused {
                    config_id: id,
                    result: config_result::UNSUPPORTED,
                });
                return;
            }
        };
        let config_id = table.config_id;
        let table = if table.objects.is_empty() && config_id < 0x4000 {
            // A standard id without its table: the manager must know it.
            match lookup.known(&agent.system_id, config_id) {
                Some(t) => Ok(t),
                None => Err(config_result::STANDARD_UNKNOWN),
            }
        } else {
            table
                .check()
                .map(|()| Arc::new(table))
                .map_err(|_| config_result::UNSUPPORTED)
        };
        match table {
            Ok(table) if !lookup.may_learn(&agent.system_id, &table) => {
                out.push(Output::Send(respond(config_id, config_result::UNSUPPORTED)));
                out.push(Output::ConfigConflict {
                    agent: AgentInfo { config_id, ..agent },
                });
                self.abort(abort::UNDEFINED, now, out);
            }
            Ok(table) => {
                out.push(Output::Send(respond(config_id, config_result::ACCEPTED)));
                let agent = AgentInfo { config_id, ..agent };
                self.agent = Some(agent.clone());
                self.table = Some(table.clone());
                out.push(Output::ConfigAccepted { agent, table });
                self.operate(now, out);
            }
            Err(result) => {
                out.push(Output::Send(respond(config_id, result)));
                out.push(Output::ConfigRefused { config_id, result });
            }
        }
    }

    fn not_operating(&mut self, d: DataApdu, out: &mut Vec<Output>) {
        match d.message {
            DataMessage::EventReport { .. } => {
                out.push(Output::Violation(Violation::ReportNotOperating));
                out.push(Output::Send(Apdu::Prst(DataApdu {
                    invoke_id: d.invoke_id,
                    message: DataMessage::Error {
                        error: ROER_PROTOCOL_VIOLATION,
                        parameter: Bytes::new(),
                    },
                })));
            }
            DataMessage::Get { .. } | DataMessage::Other { .. } => {
                self.unsupported(d.invoke_id, out)
            }
            _ => {} // answers to nothing the manager asked: ignored
        }
    }

    fn unsupported(&mut self, invoke_id: u16, out: &mut Vec<Output>) {
        out.push(Output::Violation(Violation::UnsupportedInvoke));
        out.push(Output::Send(Apdu::Prst(DataApdu {
            invoke_id,
            message: DataMessage::Reject {
                problem: RORJ_UNRECOGNIZED_OPERATION,
            },
        })));
    }

    fn operating(&mut self, d: DataApdu, now: Instant, out: &mut Vec<Output>) {
        match d.message {
            DataMessage::EventReport {
                confirmed,
                obj_handle,
                event_type,
                info,
                ..
            } => {
                let Some(layout) = scan::layout(event_type) else {
                    if event_type == NOTI_CONFIG {
                        // A new configuration while operating: not allowed (§9 table).
                        out.push(Output::Violation(Violation::UnexpectedApdu));
                        return self.abort(abort::UNDEFINED, now, out);
                    }
                    // Another notification (e.g. PM-store segment data): confirmed, not read.
                    if confirmed {
                        out.push(Output::Send(confirmation(
                            d.invoke_id,
                            obj_handle,
                            event_type,
                        )));
                    }
                    return;
                };
                let Some(table) = self.table.as_ref() else {
                    return self.abort(abort::UNDEFINED, now, out);
                };
                match scan::decode(layout, info, table) {
                    Ok(report) => {
                        if !report.skipped.is_empty() {
                            out.push(Output::Violation(Violation::SkippedObservations));
                        }
                        out.push(Output::Report {
                            invoke_id: d.invoke_id,
                            confirmed,
                            obj_handle,
                            event_type,
                            report,
                        });
                    }
                    Err(_) => {
                        out.push(Output::Violation(Violation::Malformed));
                        self.abort(abort::UNDEFINED, now, out);
                    }
                }
            }
            DataMessage::GetResult { attributes, .. } if self.pending_get == Some(d.invoke_id) => {
                self.pending_get = None;
                self.deadline = None;
                out.push(Output::MdsAttributes(attributes));
            }
            DataMessage::Error { .. } | DataMessage::Reject { .. }
                if self.pending_get == Some(d.invoke_id) =>
            {
                // The agent will not tell its attributes: nothing to wait for.
                self.pending_get = None;
                self.deadline = None;
            }
            DataMessage::Get { .. } | DataMessage::Other { .. } => {
                self.unsupported(d.invoke_id, out)
            }
            _ => {}
        }
    }
}

/// Encode a list of APDUs back to back (helper for callers writing a batch).
pub fn encode_all(apdus: &[Apdu]) -> BytesMut {
    let mut b = BytesMut::new();
    for a in apdus {
        a.encode(&mut b);
    }
    b
}

/// The attributes of an MDS GET result that the gateway shows: (model strings, the agent's
/// clock). Unknown attributes are skipped; malformed ones give `None` for that part.
pub fn mds_summary(attributes: &Bytes) -> (Option<String>, Option<super::values::AbsoluteTime>) {
    use super::config::attr;
    use super::mder::Reader;
    let mut model = None;
    let mut clock = None;
    let Ok((n, mut list)) = Reader::new(attributes.clone()).seq("attribute-list") else {
        return (None, None);
    };
    for _ in 0..n {
        let (Ok(id), Ok(v)) = (list.u16("attribute-id"), list.octets("attribute-value")) else {
            break;
        };
        match id {
            attr::ID_MODEL => {
                let mut r = Reader::new(v);
                let text = |b: Bytes| {
                    String::from_utf8_lossy(&b)
                        .trim_end_matches('\0')
                        .trim()
                        .to_owned()
                };
                if let (Ok(m), Ok(d)) = (r.octets("manufacturer"), r.octets("model")) {
                    let both = format!("{} {}", text(m), text(d));
                    // Antidote's sample agent reports empty strings: no model then.
                    model = Some(both.trim().to_owned()).filter(|s| !s.is_empty());
                }
            }
            attr::TIME_ABS if v.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&v);
                clock = super::values::AbsoluteTime::decode(b);
            }
            _ => {}
        }
    }
    (model, clock)
}
