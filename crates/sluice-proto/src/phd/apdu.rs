//! IEEE 11073-20601 APDUs: the association, release, abort and presentation (PRST) messages,
//! and the Data APDU a PRST carries.
//!
//! Owns: decoding one APDU body by its choice tag into [`Apdu`] and encoding it back, byte for
//! byte (the golden vectors round-trip). Wire format (`../shared/specs/ieee-11073-20601.md`
//! §1–§9): `choice u16 · length u16 · body`; AARQ = assoc-version BITS-32 · SEQUENCE OF
//! {data-proto-id u16 · data-proto-info ANY}; AARE = result u16 · data-proto-id u16 ·
//! data-proto-info ANY; RLRQ/RLRE/ABRT = reason u16; PRST = OCTET STRING holding a Data APDU
//! (invoke-id u16 · CHOICE{choice u16 · length u16 · body}). Event-report infos, GET results
//! and PhdAssociationInformation are kept as bytes here and read by their own decoders.
//! Does not own: framing on a byte stream (`frame.rs`), what the manager answers (its state
//! machine).

use bytes::{Bytes, BytesMut};

use super::mder::{DecodeError, Reader, Writer};

pub const AARQ: u16 = 0xE200;
pub const AARE: u16 = 0xE300;
pub const RLRQ: u16 = 0xE400;
pub const RLRE: u16 = 0xE500;
pub const ABRT: u16 = 0xE600;
pub const PRST: u16 = 0xE700;

/// `data-proto-id` of IEEE 11073-20601.
pub const DATA_PROTO_20601: u16 = 20601;

/// AARE results (§4).
pub mod result {
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

/// ABRT reasons (§9).
pub mod abort {
    pub const UNDEFINED: u16 = 0;
    pub const BUFFER_OVERFLOW: u16 = 1;
    pub const RESPONSE_TIMEOUT: u16 = 2;
    pub const CONFIGURATION_TIMEOUT: u16 = 3;
}

/// Data APDU message choices (§6).
pub mod choice {
    pub const ROIV_EVENT_REPORT: u16 = 0x0100;
    pub const ROIV_CONFIRMED_EVENT_REPORT: u16 = 0x0101;
    pub const ROIV_GET: u16 = 0x0103;
    pub const RORS_CONFIRMED_EVENT_REPORT: u16 = 0x0201;
    pub const RORS_GET: u16 = 0x0203;
    pub const ROER: u16 = 0x0300;
    pub const RORJ: u16 = 0x0400;
}

/// One entry of an AARQ's data-proto-list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataProto {
    pub id: u16,
    /// For 20601: PhdAssociationInformation ([`PhdAssociationInformation::decode`]).
    pub info: Bytes,
}

/// Association request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aarq {
    pub assoc_version: u32,
    pub protos: Vec<DataProto>,
}

/// Association response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aare {
    pub result: u16,
    pub proto: DataProto,
}

/// PhdAssociationInformation (§3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhdAssociationInformation {
    pub protocol_version: u32,
    pub encoding_rules: u16,
    pub nomenclature_version: u32,
    pub functional_units: u32,
    pub system_type: u32,
    pub system_id: Bytes,
    pub dev_config_id: u16,
    pub data_req_mode_flags: u16,
    pub data_req_init_agent_count: u8,
    pub data_req_init_manager_count: u8,
    /// AttributeList, raw (count · length · elements); usually empty.
    pub option_list: Bytes,
}

impl PhdAssociationInformation {
    pub fn decode(b: Bytes) -> Result<PhdAssociationInformation, DecodeError> {
        let mut r = Reader::new(b);
        let info = PhdAssociationInformation {
            protocol_version: r.u32("protocol-version")?,
            encoding_rules: r.u16("encoding-rules")?,
            nomenclature_version: r.u32("nomenclature-version")?,
            functional_units: r.u32("functional-units")?,
            system_type: r.u32("system-type")?,
            system_id: r.octets("system-id")?,
            dev_config_id: r.u16("dev-config-id")?,
            data_req_mode_flags: r.u16("data-req-mode-flags")?,
            data_req_init_agent_count: r.u8("data-req-init-agent-count")?,
            data_req_init_manager_count: r.u8("data-req-init-manager-count")?,
            option_list: {
                let (count, mut body) = r.seq("option-list")?;
                let elements = body.bytes("option-list", body.remaining())?;
                let mut raw = BytesMut::new();
                raw.seq(count, &elements);
                raw.freeze()
            },
        };
        r.finish("PhdAssociationInformation")?;
        Ok(info)
    }

    pub fn encode(&self, out: &mut BytesMut) {
        out.u32_be(self.protocol_version);
        out.u16_be(self.encoding_rules);
        out.u32_be(self.nomenclature_version);
        out.u32_be(self.functional_units);
        out.u32_be(self.system_type);
        out.octets(&self.system_id);
        out.u16_be(self.dev_config_id);
        out.u16_be(self.data_req_mode_flags);
        out.extend_from_slice(&[
            self.data_req_init_agent_count,
            self.data_req_init_manager_count,
        ]);
        out.extend_from_slice(&self.option_list);
    }
}

/// The message a Data APDU carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataMessage {
    /// roiv-cmip-event-report (`confirmed` false) or -confirmed-event-report.
    EventReport {
        confirmed: bool,
        obj_handle: u16,
        event_time: u32,
        event_type: u16,
        info: Bytes,
    },
    /// rors-cmip-confirmed-event-report.
    EventReportResult {
        obj_handle: u16,
        current_time: u32,
        event_type: u16,
        reply_info: Bytes,
    },
    /// roiv-cmip-get: attribute ids (empty = all).
    Get {
        obj_handle: u16,
        attribute_ids: Vec<u16>,
    },
    /// rors-cmip-get: the AttributeList, raw (count · length · elements).
    GetResult { obj_handle: u16, attributes: Bytes },
    /// roer: error-value and its parameter.
    Error { error: u16, parameter: Bytes },
    /// rorj: problem.
    Reject { problem: u16 },
    /// Any other choice (set, action, …), kept as bytes.
    Other { choice: u16, body: Bytes },
}

/// A Data APDU (the content of a PRST).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataApdu {
    pub invoke_id: u16,
    pub message: DataMessage,
}

/// One APDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Apdu {
    Aarq(Aarq),
    Aare(Aare),
    Rlrq { reason: u16 },
    Rlre { reason: u16 },
    Abrt { reason: u16 },
    Prst(DataApdu),
}

impl Apdu {
    /// Decode the body of an APDU whose header said `choice` (the body is exactly `body`).
    pub fn decode(choice: u16, body: Bytes) -> Result<Apdu, DecodeError> {
        let mut r = Reader::new(body);
        let apdu = match choice {
            AARQ => {
                let assoc_version = r.u32("assoc-version")?;
                let (count, mut list) = r.seq("data-proto-list")?;
                let mut protos = Vec::with_capacity(count.min(16));
                for _ in 0..count {
                    protos.push(DataProto {
                        id: list.u16("data-proto-id")?,
                        info: list.octets("data-proto-info")?,
                    });
                }
                list.finish("data-proto-list")?;
                Apdu::Aarq(Aarq {
                    assoc_version,
                    protos,
                })
            }
            AARE => Apdu::Aare(Aare {
                result: r.u16("result")?,
                proto: DataProto {
                    id: r.u16("data-proto-id")?,
                    info: r.octets("data-proto-info")?,
                },
            }),
            RLRQ => Apdu::Rlrq {
                reason: r.u16("reason")?,
            },
            RLRE => Apdu::Rlre {
                reason: r.u16("reason")?,
            },
            ABRT => Apdu::Abrt {
                reason: r.u16("reason")?,
            },
            PRST => {
                let outer = r.remaining();
                let inner = r.octets("PRST")?;
                if inner.len() + 2 != outer {
                    return Err(DecodeError::PrstLength {
                        inner: inner.len(),
                        outer,
                    });
                }
                Apdu::Prst(DataApdu::decode(inner)?)
            }
            other => return Err(DecodeError::UnknownApdu(other)),
        };
        r.finish("APDU")?;
        Ok(apdu)
    }

    /// The APDU's choice tag.
    pub fn choice(&self) -> u16 {
        match self {
            Apdu::Aarq(_) => AARQ,
            Apdu::Aare(_) => AARE,
            Apdu::Rlrq { .. } => RLRQ,
            Apdu::Rlre { .. } => RLRE,
            Apdu::Abrt { .. } => ABRT,
            Apdu::Prst(_) => PRST,
        }
    }

    /// Append the whole APDU (header included).
    pub fn encode(&self, out: &mut BytesMut) {
        let mut body = BytesMut::new();
        match self {
            Apdu::Aarq(a) => {
                body.u32_be(a.assoc_version);
                let mut list = BytesMut::new();
                for p in &a.protos {
                    list.u16_be(p.id);
                    list.octets(&p.info);
                }
                body.seq(a.protos.len(), &list);
            }
            Apdu::Aare(a) => {
                body.u16_be(a.result);
                body.u16_be(a.proto.id);
                body.octets(&a.proto.info);
            }
            Apdu::Rlrq { reason } | Apdu::Rlre { reason } | Apdu::Abrt { reason } => {
                body.u16_be(*reason)
            }
            Apdu::Prst(d) => {
                let mut inner = BytesMut::new();
                d.encode(&mut inner);
                body.octets(&inner);
            }
        }
        out.u16_be(self.choice());
        out.u16_be(body.len() as u16);
        out.extend_from_slice(&body);
    }
}

impl DataApdu {
    pub fn decode(b: Bytes) -> Result<DataApdu, DecodeError> {
        let mut r = Reader::new(b);
        let invoke_id = r.u16("invoke-id")?;
        let choice = r.u16("message choice")?;
        let body = r.octets("message")?;
        r.finish("Data APDU")?;
        let mut m = Reader::new(body.clone());
        let message = match choice {
            choice::ROIV_EVENT_REPORT | choice::ROIV_CONFIRMED_EVENT_REPORT => {
                DataMessage::EventReport {
                    confirmed: choice == choice::ROIV_CONFIRMED_EVENT_REPORT,
                    obj_handle: m.u16("obj-handle")?,
                    event_time: m.u32("event-time")?,
                    event_type: m.u16("event-type")?,
                    info: m.octets("event-info")?,
                }
            }
            choice::RORS_CONFIRMED_EVENT_REPORT => DataMessage::EventReportResult {
                obj_handle: m.u16("obj-handle")?,
                current_time: m.u32("current-time")?,
                event_type: m.u16("event-type")?,
                reply_info: m.octets("event-reply-info")?,
            },
            choice::ROIV_GET => {
                let obj_handle = m.u16("obj-handle")?;
                let (count, mut ids) = m.seq("attribute-id-list")?;
                let mut attribute_ids = Vec::with_capacity(count.min(64));
                for _ in 0..count {
                    attribute_ids.push(ids.u16("attribute-id")?);
                }
                ids.finish("attribute-id-list")?;
                DataMessage::Get {
                    obj_handle,
                    attribute_ids,
                }
            }
            choice::RORS_GET => {
                let obj_handle = m.u16("obj-handle")?;
                let rest = m.remaining();
                let attributes = m.bytes("attribute-list", rest)?;
                // Validate the list's own count and length.
                Reader::new(attributes.clone()).seq("attribute-list")?;
                DataMessage::GetResult {
                    obj_handle,
                    attributes,
                }
            }
            choice::ROER => DataMessage::Error {
                error: m.u16("error-value")?,
                parameter: m.octets("parameter")?,
            },
            choice::RORJ => DataMessage::Reject {
                problem: m.u16("problem")?,
            },
            other => {
                let rest = m.remaining();
                DataMessage::Other {
                    choice: other,
                    body: m.bytes("message", rest)?,
                }
            }
        };
        m.finish("Data APDU message")?;
        Ok(DataApdu { invoke_id, message })
    }

    pub fn encode(&self, out: &mut BytesMut) {
        let mut body = BytesMut::new();
        let choice = match &self.message {
            DataMessage::EventReport {
                confirmed,
                obj_handle,
                event_time,
                event_type,
                info,
            } => {
                body.u16_be(*obj_handle);
                body.u32_be(*event_time);
                body.u16_be(*event_type);
                body.octets(info);
                if *confirmed {
                    choice::ROIV_CONFIRMED_EVENT_REPORT
                } else {
                    choice::ROIV_EVENT_REPORT
                }
            }
            DataMessage::EventReportResult {
                obj_handle,
                current_time,
                event_type,
                reply_info,
            } => {
                body.u16_be(*obj_handle);
                body.u32_be(*current_time);
                body.u16_be(*event_type);
                body.octets(reply_info);
                choice::RORS_CONFIRMED_EVENT_REPORT
            }
            DataMessage::Get {
                obj_handle,
                attribute_ids,
            } => {
                body.u16_be(*obj_handle);
                let ids: Vec<u8> = attribute_ids.iter().flat_map(|i| i.to_be_bytes()).collect();
                body.seq(attribute_ids.len(), &ids);
                choice::ROIV_GET
            }
            DataMessage::GetResult {
                obj_handle,
                attributes,
            } => {
                body.u16_be(*obj_handle);
                body.extend_from_slice(attributes);
                choice::RORS_GET
            }
            DataMessage::Error { error, parameter } => {
                body.u16_be(*error);
                body.octets(parameter);
                choice::ROER
            }
            DataMessage::Reject { problem } => {
                body.u16_be(*problem);
                choice::RORJ
            }
            DataMessage::Other { choice, body: b } => {
                body.extend_from_slice(b);
                *choice
            }
        };
        out.u16_be(self.invoke_id);
        out.u16_be(choice);
        out.octets(&body);
    }

    /// The confirmation of a confirmed event report (§8): same invoke-id, obj-handle and
    /// event-type, current-time 0, empty event-reply-info.
    pub fn confirm(invoke_id: u16, obj_handle: u16, event_type: u16) -> Apdu {
        Apdu::Prst(DataApdu {
            invoke_id,
            message: DataMessage::EventReportResult {
                obj_handle,
                current_time: 0,
                event_type,
                reply_info: Bytes::new(),
            },
        })
    }
}
