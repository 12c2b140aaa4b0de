//! Incremental MQTT 3.1.1 / 5.0 decoder.
//!
//! Owns: turning bytes from a peer into [`Packet`]s and rejecting everything the specifications
//! call a Malformed Packet or a Protocol Error that can be seen in a single packet. Does not
//! own: session rules that need state (packet identifiers in flight, topic alias mapping,
//! which side may send which packet, a second CONNECT) — the session above does those.
//!
//! Wire format: byte 0 is `type << 4 | flags`; then the remaining length as a Variable Byte
//! Integer (1–4 bytes); then `remaining length` bytes of variable header and payload. The
//! layouts per packet type are those of the OASIS specifications (3.1.1 §3, 5.0 §3); MQTT 5
//! adds a property block after the variable header of most packets and allows PUBACK, PUBREC,
//! PUBREL, PUBCOMP, DISCONNECT and AUTH to end early when the reason code is 0 and there are
//! no properties.
//!
//! Order of checks, so that the same bytes give the same result however they are split:
//! packet type (and "first packet must be CONNECT"), fixed-header flags, remaining length,
//! maximum packet size, then — once the whole packet is buffered — the body.
//!
//! A remaining length that is not minimally encoded is rejected once the version is known to be
//! 5.0 (MQTT 5 §1.5.5 requires the minimal form); 3.1.1 does not require it, and a server's
//! first CONNECT is read before the version is known, so both tolerate it.
//!
//! Invariants:
//! - `Ok(None)` leaves the buffer untouched; `Ok(Some(_))` consumes exactly one packet.
//! - The size limit is checked as soon as the fixed header is readable, before any body byte
//!   is buffered or looked at. Nothing allocates more than the packet's declared size.
//! - A PUBLISH's topic and payload are slices of the input buffer, not copies.
//! - No input panics. After an error the connection must be closed (MQTT cannot resync); the
//!   buffer and decoder are then in an unspecified state.
//! - Every decoded packet is accepted by [`super::encode()`] and re-encodes to bytes that decode
//!   to an equal packet.

use bytes::BytesMut;

use super::properties::{self, Context};
use super::reason_codes::{is_allowed, CodeKind};
use super::topic::valid_topic_name;
use super::wire::{peek_varint, Reader, Varint};
use super::{
    reason, Auth, ConnAck, Connect, Disconnect, Packet, Properties, ProtocolVersion, PubResponse,
    Publish, QoS, SubAck, Subscribe, SubscribeFilter, SubscriptionOptions, UnsubAck, Unsubscribe,
    Will,
};

/// Why bytes could not be decoded. Every variant means the connection must be closed
/// (MQTT has no resynchronisation); the message says what the peer did wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("packet of {size} bytes exceeds the maximum packet size of {max} bytes")]
    PacketTooLarge { size: usize, max: usize },
    #[error("malformed remaining length (more than 4 bytes)")]
    MalformedLength,
    #[error("malformed {packet}: {reason}")]
    Malformed {
        packet: &'static str,
        reason: &'static str,
    },
    #[error("unknown packet type {0}")]
    UnknownPacketType(u8),
    #[error("unsupported protocol level {0}")]
    UnsupportedProtocolLevel(u8),
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    /// An MQTT 5 property identifier that is unknown or not allowed on this packet type.
    #[error("malformed {packet}: property 0x{property:02x} is not allowed on this packet")]
    PropertyNotAllowed { packet: &'static str, property: u32 },
    /// An MQTT 5 property that may appear once appeared again.
    #[error("protocol violation: {packet} carries the {property} property more than once")]
    DuplicateProperty {
        packet: &'static str,
        property: &'static str,
    },
}

impl DecodeError {
    /// The MQTT 5 reason code to put in the CONNACK or DISCONNECT that closes the connection.
    pub fn reason_code(&self) -> u8 {
        match self {
            DecodeError::PacketTooLarge { .. } => reason::PACKET_TOO_LARGE,
            DecodeError::MalformedLength
            | DecodeError::Malformed { .. }
            | DecodeError::UnknownPacketType(_)
            | DecodeError::PropertyNotAllowed { .. } => reason::MALFORMED_PACKET,
            DecodeError::UnsupportedProtocolLevel(_) => reason::UNSUPPORTED_PROTOCOL_VERSION,
            DecodeError::Protocol(_) | DecodeError::DuplicateProperty { .. } => {
                reason::PROTOCOL_ERROR
            }
        }
    }
}

/// Incremental MQTT decoder. A server-side decoder starts without a version and learns it
/// from CONNECT; a client-side one is created with the version it sent.
#[derive(Debug, Clone)]
pub struct Decoder {
    version: Option<ProtocolVersion>,
    max_packet_size: usize,
}

const CONNECT: u8 = 1;
const CONNACK: u8 = 2;
const PUBLISH: u8 = 3;
const PUBACK: u8 = 4;
const PUBREC: u8 = 5;
const PUBREL: u8 = 6;
const PUBCOMP: u8 = 7;
const SUBSCRIBE: u8 = 8;
const SUBACK: u8 = 9;
const UNSUBSCRIBE: u8 = 10;
const UNSUBACK: u8 = 11;
const PINGREQ: u8 = 12;
const PINGRESP: u8 = 13;
const DISCONNECT: u8 = 14;
const AUTH: u8 = 15;

impl Decoder {
    /// Server side: the first packet must be CONNECT, which fixes the version.
    pub fn server(max_packet_size: usize) -> Decoder {
        Decoder {
            version: None,
            max_packet_size,
        }
    }
    /// Client side: packets are decoded as `version`.
    pub fn client(version: ProtocolVersion, max_packet_size: usize) -> Decoder {
        Decoder {
            version: Some(version),
            max_packet_size,
        }
    }
    pub fn version(&self) -> Option<ProtocolVersion> {
        self.version
    }
    pub fn set_max_packet_size(&mut self, max: usize) {
        self.max_packet_size = max;
    }

    /// Look ahead in `buf` (which starts at a packet boundary) for PINGREQs behind packets
    /// the caller is not handling yet (a back-pressured device's PUBLISHes): walks the
    /// complete packets by their fixed headers only, removes every well-formed PINGREQ
    /// (`0xC0 0x00`) and returns how many it removed. Stops at the first packet that is
    /// incomplete, larger than the maximum packet size or whose header is malformed: those
    /// bytes, and everything after them, are left for [`Decoder::decode`] to judge in order.
    /// Nothing else moves, so the other packets decode exactly as they would have.
    pub fn take_pingreqs(&self, buf: &mut BytesMut) -> usize {
        let mut taken = 0;
        let mut pos = 0;
        loop {
            let Some(&first) = buf.get(pos) else {
                return taken;
            };
            let (remaining, length_len) = match peek_varint(buf.get(pos + 1..).unwrap_or(&[])) {
                Varint::Complete { value, len, .. } => (value, len),
                Varint::Incomplete | Varint::TooLong => return taken,
            };
            let size = 1 + length_len + remaining;
            if size > self.max_packet_size || buf.len() - pos < size {
                return taken;
            }
            if first == PINGREQ << 4 && remaining == 0 && length_len == 1 {
                let mut tail = buf.split_off(pos);
                let _ = tail.split_to(size);
                buf.unsplit(tail);
                taken += 1;
            } else {
                pos += size;
            }
        }
    }
    /// Decode one packet from the front of `buf`, consuming its bytes. `Ok(None)`: need more.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Packet>, DecodeError> {
        let Some(&first) = buf.first() else {
            return Ok(None);
        };
        let kind = first >> 4;
        let flags = first & 0x0f;
        if self.version.is_none() && kind != CONNECT {
            return Err(DecodeError::Protocol("first packet must be CONNECT"));
        }
        let name = packet_name(kind, self.version)?;
        check_fixed_header_flags(kind, flags, name)?;

        let (remaining, length_len) = match peek_varint(buf.get(1..).unwrap_or(&[])) {
            Varint::Complete { minimal: false, .. }
                if self.version == Some(ProtocolVersion::V5) =>
            {
                return Err(DecodeError::Malformed {
                    packet: name,
                    reason: "remaining length not minimally encoded",
                });
            }
            Varint::Complete { value, len, .. } => (value, len),
            Varint::Incomplete => return Ok(None),
            Varint::TooLong => return Err(DecodeError::MalformedLength),
        };
        // At most 1 + 4 + 268,435,455: no overflow.
        let size = 1 + length_len + remaining;
        if size > self.max_packet_size {
            return Err(DecodeError::PacketTooLarge {
                size,
                max: self.max_packet_size,
            });
        }
        if buf.len() < size {
            return Ok(None);
        }

        let body = buf.split_to(size).freeze().slice(1 + length_len..);
        let mut r = Reader::new(body, name);
        let packet = match (kind, self.version) {
            (CONNECT, _) => {
                let connect = decode_connect(&mut r)?;
                if self.version.is_none() {
                    self.version = Some(connect.protocol);
                }
                Packet::Connect(connect)
            }
            // Only CONNECT gets past the check above without a version.
            (_, None) => return Err(DecodeError::Protocol("first packet must be CONNECT")),
            (CONNACK, Some(v)) => Packet::ConnAck(decode_connack(&mut r, v)?),
            (PUBLISH, Some(v)) => Packet::Publish(decode_publish(&mut r, v, flags)?),
            (PUBACK, Some(v)) => {
                Packet::PubAck(decode_pub_response(&mut r, v, CodeKind::PubAckRec)?)
            }
            (PUBREC, Some(v)) => {
                Packet::PubRec(decode_pub_response(&mut r, v, CodeKind::PubAckRec)?)
            }
            (PUBREL, Some(v)) => {
                Packet::PubRel(decode_pub_response(&mut r, v, CodeKind::PubRelComp)?)
            }
            (PUBCOMP, Some(v)) => {
                Packet::PubComp(decode_pub_response(&mut r, v, CodeKind::PubRelComp)?)
            }
            (SUBSCRIBE, Some(v)) => Packet::Subscribe(decode_subscribe(&mut r, v)?),
            (SUBACK, Some(v)) => Packet::SubAck(decode_suback(&mut r, v)?),
            (UNSUBSCRIBE, Some(v)) => Packet::Unsubscribe(decode_unsubscribe(&mut r, v)?),
            (UNSUBACK, Some(v)) => Packet::UnsubAck(decode_unsuback(&mut r, v)?),
            (PINGREQ, Some(_)) => {
                r.finish()?;
                Packet::PingReq
            }
            (PINGRESP, Some(_)) => {
                r.finish()?;
                Packet::PingResp
            }
            (DISCONNECT, Some(v)) => Packet::Disconnect(decode_disconnect(&mut r, v)?),
            (AUTH, Some(_)) => Packet::Auth(decode_auth(&mut r)?),
            // `packet_name` rejected every other type.
            _ => return Err(DecodeError::UnknownPacketType(kind)),
        };
        Ok(Some(packet))
    }
}

fn packet_name(kind: u8, version: Option<ProtocolVersion>) -> Result<&'static str, DecodeError> {
    Ok(match kind {
        CONNECT => "CONNECT",
        CONNACK => "CONNACK",
        PUBLISH => "PUBLISH",
        PUBACK => "PUBACK",
        PUBREC => "PUBREC",
        PUBREL => "PUBREL",
        PUBCOMP => "PUBCOMP",
        SUBSCRIBE => "SUBSCRIBE",
        SUBACK => "SUBACK",
        UNSUBSCRIBE => "UNSUBSCRIBE",
        UNSUBACK => "UNSUBACK",
        PINGREQ => "PINGREQ",
        PINGRESP => "PINGRESP",
        DISCONNECT => "DISCONNECT",
        AUTH if version == Some(ProtocolVersion::V5) => "AUTH",
        _ => return Err(DecodeError::UnknownPacketType(kind)),
    })
}

/// Fixed-header flags (§2.1.3 / §2.2.2): fixed values except for PUBLISH.
fn check_fixed_header_flags(kind: u8, flags: u8, packet: &'static str) -> Result<(), DecodeError> {
    let malformed = |reason| Err(DecodeError::Malformed { packet, reason });
    match kind {
        PUBLISH => {
            let qos = (flags >> 1) & 0x03;
            if qos == 3 {
                return malformed("QoS 3");
            }
            if qos == 0 && flags & 0x08 != 0 {
                return malformed("DUP set on a QoS 0 message");
            }
            Ok(())
        }
        PUBREL | SUBSCRIBE | UNSUBSCRIBE if flags != 0b0010 => {
            malformed("reserved fixed-header flags are not 0010")
        }
        PUBREL | SUBSCRIBE | UNSUBSCRIBE => Ok(()),
        _ if flags != 0 => malformed("reserved fixed-header flags are not 0000"),
        _ => Ok(()),
    }
}

fn packet_id(r: &mut Reader) -> Result<u16, DecodeError> {
    match r.u16()? {
        0 => Err(r.malformed("packet identifier is 0")),
        id => Ok(id),
    }
}

fn check_code(
    r: &Reader,
    kind: CodeKind,
    version: ProtocolVersion,
    code: u8,
) -> Result<(), DecodeError> {
    if is_allowed(kind, version, code) {
        Ok(())
    } else {
        Err(r.malformed("reason code not allowed on this packet"))
    }
}

fn optional(properties: Properties) -> Option<Box<Properties>> {
    if properties.is_empty() {
        None
    } else {
        Some(Box::new(properties))
    }
}

fn decode_connect(r: &mut Reader) -> Result<Connect, DecodeError> {
    let name = r.binary()?;
    let level = r.u8()?;
    let protocol = match (&name[..], level) {
        (b"MQTT", 4) => ProtocolVersion::V311,
        (b"MQTT", 5) => ProtocolVersion::V5,
        (b"MQTT" | b"MQIsdp", level) => return Err(DecodeError::UnsupportedProtocolLevel(level)),
        _ => return Err(r.malformed("protocol name is not MQTT")),
    };
    let v5 = protocol == ProtocolVersion::V5;

    let flags = r.u8()?;
    if flags & 0x01 != 0 {
        return Err(r.malformed("reserved connect flag is set"));
    }
    let clean_start = flags & 0x02 != 0;
    let will_flag = flags & 0x04 != 0;
    let will_qos = (flags >> 3) & 0x03;
    let will_retain = flags & 0x20 != 0;
    let password_flag = flags & 0x40 != 0;
    let username_flag = flags & 0x80 != 0;
    if !will_flag && (will_qos != 0 || will_retain) {
        return Err(r.malformed("will QoS or will retain set without a will"));
    }
    let will_qos = QoS::from_u8(will_qos).ok_or_else(|| r.malformed("will QoS 3"))?;
    if !v5 && password_flag && !username_flag {
        return Err(r.malformed("password without user name"));
    }
    let keep_alive = r.u16()?;
    let properties = if v5 {
        properties::decode(r, Context::Connect)?
    } else {
        Properties::default()
    };

    let client_id = r.string()?;
    let will = if will_flag {
        let properties = if v5 {
            properties::decode(r, Context::Will)?
        } else {
            Properties::default()
        };
        let topic = r.string()?;
        if !valid_topic_name(&topic) {
            return Err(r.malformed("will topic is not a valid topic name"));
        }
        let payload = r.binary()?;
        Some(Will {
            topic,
            payload,
            qos: will_qos,
            retain: will_retain,
            properties,
        })
    } else {
        None
    };
    let username = if username_flag {
        Some(r.string()?)
    } else {
        None
    };
    let password = if password_flag {
        Some(r.binary()?)
    } else {
        None
    };
    r.finish()?;
    Ok(Connect {
        protocol,
        clean_start,
        keep_alive,
        client_id,
        will,
        username,
        password,
        properties,
    })
}

fn decode_connack(r: &mut Reader, version: ProtocolVersion) -> Result<ConnAck, DecodeError> {
    let flags = r.u8()?;
    if flags & 0xfe != 0 {
        return Err(r.malformed("reserved acknowledge flags are set"));
    }
    let session_present = flags & 0x01 != 0;
    let code = r.u8()?;
    check_code(r, CodeKind::ConnAck, version, code)?;
    if session_present && code != 0 {
        return Err(DecodeError::Protocol(
            "CONNACK has session present with a non-zero code",
        ));
    }
    let properties = match version {
        ProtocolVersion::V5 => properties::decode(r, Context::ConnAck)?,
        ProtocolVersion::V311 => Properties::default(),
    };
    r.finish()?;
    Ok(ConnAck {
        session_present,
        code,
        properties,
    })
}

fn decode_publish(
    r: &mut Reader,
    version: ProtocolVersion,
    flags: u8,
) -> Result<Publish, DecodeError> {
    let dup = flags & 0x08 != 0;
    let retain = flags & 0x01 != 0;
    // QoS 3 was rejected with the fixed header.
    let qos = QoS::from_u8((flags >> 1) & 0x03).ok_or_else(|| r.malformed("QoS 3"))?;
    let topic = r.string()?;
    let packet_id = if qos == QoS::AtMostOnce {
        None
    } else {
        Some(packet_id(r)?)
    };
    let properties = match version {
        ProtocolVersion::V5 => optional(properties::decode(r, Context::Publish)?),
        ProtocolVersion::V311 => None,
    };
    if topic.is_empty() {
        let has_alias = properties.as_ref().is_some_and(|p| p.topic_alias.is_some());
        if !has_alias {
            return Err(match version {
                ProtocolVersion::V311 => r.malformed("empty topic name"),
                ProtocolVersion::V5 => {
                    DecodeError::Protocol("PUBLISH with empty topic and no Topic Alias")
                }
            });
        }
    } else if !valid_topic_name(&topic) {
        return Err(r.malformed("topic name contains a wildcard"));
    }
    let payload = r.rest();
    Ok(Publish {
        dup,
        qos,
        retain,
        topic,
        packet_id,
        properties,
        payload,
    })
}

fn decode_pub_response(
    r: &mut Reader,
    version: ProtocolVersion,
    kind: CodeKind,
) -> Result<PubResponse, DecodeError> {
    let packet_id = packet_id(r)?;
    let (reason, properties) = match version {
        ProtocolVersion::V311 => (0, None),
        ProtocolVersion::V5 => {
            let reason = if r.is_empty() { 0 } else { r.u8()? };
            let properties = if r.is_empty() {
                None
            } else {
                optional(properties::decode(r, Context::PubResponse)?)
            };
            (reason, properties)
        }
    };
    check_code(r, kind, version, reason)?;
    r.finish()?;
    Ok(PubResponse {
        packet_id,
        reason,
        properties,
    })
}

fn decode_subscribe(r: &mut Reader, version: ProtocolVersion) -> Result<Subscribe, DecodeError> {
    let packet_id = packet_id(r)?;
    let properties = match version {
        ProtocolVersion::V5 => properties::decode(r, Context::Subscribe)?,
        ProtocolVersion::V311 => Properties::default(),
    };
    if r.is_empty() {
        return Err(DecodeError::Protocol("SUBSCRIBE without topic filters"));
    }
    let mut filters = Vec::new();
    while !r.is_empty() {
        let filter = r.string()?;
        let byte = r.u8()?;
        let reserved = match version {
            ProtocolVersion::V311 => 0xfc,
            ProtocolVersion::V5 => 0xc0,
        };
        if byte & reserved != 0 {
            return Err(r.malformed("reserved subscription option bits are set"));
        }
        let qos = QoS::from_u8(byte & 0x03).ok_or_else(|| r.malformed("QoS 3"))?;
        let retain_handling = (byte >> 4) & 0x03;
        if retain_handling == 3 {
            return Err(r.malformed("retain handling 3"));
        }
        let no_local = byte & 0x04 != 0;
        if no_local && filter.starts_with("$share/") {
            return Err(DecodeError::Protocol(
                "No Local set on a shared subscription",
            ));
        }
        let options = SubscriptionOptions {
            qos,
            no_local,
            retain_as_published: byte & 0x08 != 0,
            retain_handling,
        };
        filters.push(SubscribeFilter { filter, options });
    }
    Ok(Subscribe {
        packet_id,
        filters,
        properties,
    })
}

fn decode_suback(r: &mut Reader, version: ProtocolVersion) -> Result<SubAck, DecodeError> {
    let packet_id = packet_id(r)?;
    let properties = match version {
        ProtocolVersion::V5 => properties::decode(r, Context::SubAck)?,
        ProtocolVersion::V311 => Properties::default(),
    };
    let codes = r.rest().to_vec();
    if codes.is_empty() {
        return Err(r.malformed("no reason codes"));
    }
    for &code in &codes {
        check_code(r, CodeKind::SubAck, version, code)?;
    }
    Ok(SubAck {
        packet_id,
        codes,
        properties,
    })
}

fn decode_unsubscribe(
    r: &mut Reader,
    version: ProtocolVersion,
) -> Result<Unsubscribe, DecodeError> {
    let packet_id = packet_id(r)?;
    let properties = match version {
        ProtocolVersion::V5 => properties::decode(r, Context::Unsubscribe)?,
        ProtocolVersion::V311 => Properties::default(),
    };
    if r.is_empty() {
        return Err(DecodeError::Protocol("UNSUBSCRIBE without topic filters"));
    }
    let mut filters = Vec::new();
    while !r.is_empty() {
        filters.push(r.string()?);
    }
    Ok(Unsubscribe {
        packet_id,
        filters,
        properties,
    })
}

fn decode_unsuback(r: &mut Reader, version: ProtocolVersion) -> Result<UnsubAck, DecodeError> {
    let packet_id = packet_id(r)?;
    match version {
        ProtocolVersion::V311 => {
            r.finish()?;
            Ok(UnsubAck {
                packet_id,
                codes: Vec::new(),
                properties: Properties::default(),
            })
        }
        ProtocolVersion::V5 => {
            let properties = properties::decode(r, Context::UnsubAck)?;
            let codes = r.rest().to_vec();
            if codes.is_empty() {
                return Err(r.malformed("no reason codes"));
            }
            for &code in &codes {
                check_code(r, CodeKind::UnsubAck, version, code)?;
            }
            Ok(UnsubAck {
                packet_id,
                codes,
                properties,
            })
        }
    }
}

fn decode_disconnect(r: &mut Reader, version: ProtocolVersion) -> Result<Disconnect, DecodeError> {
    let (reason, properties) = match version {
        ProtocolVersion::V311 => (0, Properties::default()),
        ProtocolVersion::V5 => {
            let reason = if r.is_empty() { 0 } else { r.u8()? };
            let properties = if r.is_empty() {
                Properties::default()
            } else {
                properties::decode(r, Context::Disconnect)?
            };
            (reason, properties)
        }
    };
    check_code(r, CodeKind::Disconnect, version, reason)?;
    r.finish()?;
    Ok(Disconnect { reason, properties })
}

/// AUTH (MQTT 5 only): remaining length 0 means reason 0 and no properties; otherwise both
/// the reason code and the property block are present.
fn decode_auth(r: &mut Reader) -> Result<Auth, DecodeError> {
    if r.is_empty() {
        return Ok(Auth {
            reason: 0,
            properties: Properties::default(),
        });
    }
    let reason = r.u8()?;
    check_code(r, CodeKind::Auth, ProtocolVersion::V5, reason)?;
    let properties = properties::decode(r, Context::Auth)?;
    r.finish()?;
    Ok(Auth { reason, properties })
}
