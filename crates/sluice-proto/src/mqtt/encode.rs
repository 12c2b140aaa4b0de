//! Encoder: the exact wire form of a [`Packet`] for MQTT 3.1.1 or 5.0.
//!
//! Owns: writing packets and refusing to write what a conforming peer would reject. Does not
//! own: choosing packet identifiers, topic aliases or reason codes (the session does).
//!
//! Wire format: see the module docs of [`super`] and [`super::decode`]. Choices where the
//! specification allows more than one form:
//! - MQTT 5 PUBACK/PUBREC/PUBREL/PUBCOMP: packet id only when the reason is 0 and there are no
//!   properties; packet id + reason when there are no properties; otherwise the full form.
//!   DISCONNECT likewise (remaining length 0, 1 or more); AUTH is empty or full.
//! - Properties in ascending identifier order (properties.rs).
//! - MQTT 3.1.1: properties (including will properties) are not written. Reason codes 3.1.1
//!   cannot carry are refused with [`EncodeError::NotInVersion`] rather than dropped, except
//!   success codes (below 0x80) on PUBACK/PUBREC/PUBREL/PUBCOMP/UNSUBACK, whose meaning the
//!   3.1.1 packet itself conveys. SUBACK codes are written as they are and must be 3.1.1 codes
//!   (0, 1, 2, 0x80). DISCONNECT must have reason 0 and is always `e0 00`; AUTH does not exist.
//!
//! Invariants: `encode` either appends one complete packet to `out` or returns an error and
//! leaves `out` as it was. The body is sized in a first pass (a counting [`Sink`]) and written
//! in a second, so nothing is copied twice. Whatever `encode` accepts, the decoder accepts and
//! decodes to an equal packet (up to the normalisations above: `Some(empty)` properties on
//! PUBLISH/PUBACK-like packets decode as `None`; 3.1.1 drops properties and success codes).

use bytes::BytesMut;

use super::properties::{self, Context};
use super::reason_codes::{is_allowed, CodeKind};
use super::topic::valid_topic_name;
use super::wire::{varint_len, Counter, Sink, MAX_VARINT};
use super::{
    Auth, ConnAck, Connect, Disconnect, Packet, Properties, ProtocolVersion, PubResponse, Publish,
    QoS, SubAck, Subscribe, UnsubAck, Unsubscribe,
};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EncodeError {
    #[error("packet too large to encode ({0} bytes of remaining length)")]
    TooLarge(usize),
    #[error("string or binary field longer than 65535 bytes")]
    FieldTooLong,
    #[error("{0} cannot be encoded for this protocol version")]
    NotInVersion(&'static str),
    #[error("{0}")]
    Invalid(&'static str),
    /// An MQTT 5 property set on a packet type that may not carry it.
    #[error("the {0} property is not allowed on this packet type")]
    PropertyNotAllowed(&'static str),
}

/// Append the wire form of `packet` for `version` to `out`.
pub fn encode(
    packet: &Packet,
    version: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    let mut counter = Counter::default();
    write_body(packet, version, &mut counter)?;
    let remaining = counter.len;
    if remaining > MAX_VARINT {
        return Err(EncodeError::TooLarge(remaining));
    }
    let start = out.len();
    out.reserve(1 + varint_len(remaining) + remaining);
    out.put_u8(first_byte(packet));
    let written = out
        .put_varint(remaining)
        .and_then(|()| write_body(packet, version, out));
    if written.is_err() {
        out.truncate(start);
    }
    debug_assert!(written.is_err() || out.len() - start == 1 + varint_len(remaining) + remaining);
    written
}

fn first_byte(packet: &Packet) -> u8 {
    match packet {
        Packet::Connect(_) => 0x10,
        Packet::ConnAck(_) => 0x20,
        Packet::Publish(p) => {
            0x30 | (u8::from(p.dup) << 3) | ((p.qos as u8) << 1) | u8::from(p.retain)
        }
        Packet::PubAck(_) => 0x40,
        Packet::PubRec(_) => 0x50,
        Packet::PubRel(_) => 0x62,
        Packet::PubComp(_) => 0x70,
        Packet::Subscribe(_) => 0x82,
        Packet::SubAck(_) => 0x90,
        Packet::Unsubscribe(_) => 0xa2,
        Packet::UnsubAck(_) => 0xb0,
        Packet::PingReq => 0xc0,
        Packet::PingResp => 0xd0,
        Packet::Disconnect(_) => 0xe0,
        Packet::Auth(_) => 0xf0,
    }
}

fn write_body<S: Sink>(
    packet: &Packet,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    match packet {
        Packet::Connect(c) => write_connect(c, version, out),
        Packet::ConnAck(c) => write_connack(c, version, out),
        Packet::Publish(p) => write_publish(p, version, out),
        Packet::PubAck(p) => write_pub_response(p, version, CodeKind::PubAckRec, out),
        Packet::PubRec(p) => write_pub_response(p, version, CodeKind::PubAckRec, out),
        Packet::PubRel(p) => write_pub_response(p, version, CodeKind::PubRelComp, out),
        Packet::PubComp(p) => write_pub_response(p, version, CodeKind::PubRelComp, out),
        Packet::Subscribe(s) => write_subscribe(s, version, out),
        Packet::SubAck(s) => write_suback(s, version, out),
        Packet::Unsubscribe(u) => write_unsubscribe(u, version, out),
        Packet::UnsubAck(u) => write_unsuback(u, version, out),
        Packet::PingReq | Packet::PingResp => Ok(()),
        Packet::Disconnect(d) => write_disconnect(d, version, out),
        Packet::Auth(a) => write_auth(a, version, out),
    }
}

fn packet_id<S: Sink>(id: u16, out: &mut S) -> Result<(), EncodeError> {
    if id == 0 {
        return Err(EncodeError::Invalid("packet identifier is 0"));
    }
    out.put_u16(id);
    Ok(())
}

fn write_connect<S: Sink>(
    c: &Connect,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    if c.protocol != version {
        return Err(EncodeError::Invalid(
            "CONNECT protocol differs from the encoding version",
        ));
    }
    let v5 = version == ProtocolVersion::V5;
    if !v5 && c.password.is_some() && c.username.is_none() {
        return Err(EncodeError::NotInVersion("a password without a user name"));
    }
    let mut flags = 0u8;
    if c.clean_start {
        flags |= 0x02;
    }
    if let Some(will) = &c.will {
        if !valid_topic_name(&will.topic) {
            return Err(EncodeError::Invalid("will topic is not a valid topic name"));
        }
        flags |= 0x04 | ((will.qos as u8) << 3) | (u8::from(will.retain) << 5);
    }
    if c.password.is_some() {
        flags |= 0x40;
    }
    if c.username.is_some() {
        flags |= 0x80;
    }
    out.put_string("MQTT")?;
    out.put_u8(if v5 { 5 } else { 4 });
    out.put_u8(flags);
    out.put_u16(c.keep_alive);
    if v5 {
        properties::encode(&c.properties, Context::Connect, out)?;
    }
    out.put_string(&c.client_id)?;
    if let Some(will) = &c.will {
        if v5 {
            properties::encode(&will.properties, Context::Will, out)?;
        }
        out.put_string(&will.topic)?;
        out.put_binary(&will.payload)?;
    }
    if let Some(username) = &c.username {
        out.put_string(username)?;
    }
    if let Some(password) = &c.password {
        out.put_binary(password)?;
    }
    Ok(())
}

fn write_connack<S: Sink>(
    c: &ConnAck,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    if !is_allowed(CodeKind::ConnAck, version, c.code) {
        return Err(match version {
            ProtocolVersion::V311 => EncodeError::NotInVersion("this CONNACK return code"),
            ProtocolVersion::V5 => EncodeError::Invalid("reason code not allowed on CONNACK"),
        });
    }
    if c.session_present && c.code != 0 {
        return Err(EncodeError::Invalid(
            "CONNACK with session present must have code 0",
        ));
    }
    out.put_u8(u8::from(c.session_present));
    out.put_u8(c.code);
    if version == ProtocolVersion::V5 {
        properties::encode(&c.properties, Context::ConnAck, out)?;
    }
    Ok(())
}

fn write_publish<S: Sink>(
    p: &Publish,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    match (p.qos, p.packet_id) {
        (QoS::AtMostOnce, Some(_)) => {
            return Err(EncodeError::Invalid(
                "QoS 0 PUBLISH with a packet identifier",
            ))
        }
        (QoS::AtLeastOnce | QoS::ExactlyOnce, None) => {
            return Err(EncodeError::Invalid(
                "QoS 1/2 PUBLISH without a packet identifier",
            ))
        }
        _ => {}
    }
    if p.qos == QoS::AtMostOnce && p.dup {
        return Err(EncodeError::Invalid("DUP set on a QoS 0 PUBLISH"));
    }
    let v5 = version == ProtocolVersion::V5;
    if p.topic.is_empty() {
        let has_alias = p
            .properties
            .as_ref()
            .is_some_and(|p| p.topic_alias.is_some());
        if !(v5 && has_alias) {
            return Err(EncodeError::Invalid(
                "empty topic name without a Topic Alias",
            ));
        }
    } else if !valid_topic_name(&p.topic) {
        return Err(EncodeError::Invalid("topic name is not valid"));
    }
    out.put_string(&p.topic)?;
    if let Some(id) = p.packet_id {
        packet_id(id, out)?;
    }
    if v5 {
        let empty = Properties::default();
        let props = p.properties.as_deref().unwrap_or(&empty);
        properties::encode(props, Context::Publish, out)?;
    }
    out.put_slice(&p.payload);
    Ok(())
}

fn write_pub_response<S: Sink>(
    p: &PubResponse,
    version: ProtocolVersion,
    kind: CodeKind,
    out: &mut S,
) -> Result<(), EncodeError> {
    packet_id(p.packet_id, out)?;
    match version {
        ProtocolVersion::V311 => {
            if p.reason >= 0x80 {
                return Err(EncodeError::NotInVersion(
                    "a failure reason code on PUBACK/PUBREC/PUBREL/PUBCOMP",
                ));
            }
            Ok(())
        }
        ProtocolVersion::V5 => {
            if !is_allowed(kind, version, p.reason) {
                return Err(EncodeError::Invalid(
                    "reason code not allowed on this packet",
                ));
            }
            match p.properties.as_deref() {
                Some(props) if !props.is_empty() => {
                    out.put_u8(p.reason);
                    properties::encode(props, Context::PubResponse, out)
                }
                _ if p.reason != 0 => {
                    out.put_u8(p.reason);
                    Ok(())
                }
                _ => Ok(()),
            }
        }
    }
}

fn write_subscribe<S: Sink>(
    s: &Subscribe,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    if s.filters.is_empty() {
        return Err(EncodeError::Invalid("SUBSCRIBE without topic filters"));
    }
    packet_id(s.packet_id, out)?;
    if version == ProtocolVersion::V5 {
        properties::encode(&s.properties, Context::Subscribe, out)?;
    }
    for f in &s.filters {
        let o = f.options;
        if o.retain_handling > 2 {
            return Err(EncodeError::Invalid("retain handling above 2"));
        }
        if version == ProtocolVersion::V311
            && (o.no_local || o.retain_as_published || o.retain_handling != 0)
        {
            return Err(EncodeError::NotInVersion(
                "subscription options other than QoS",
            ));
        }
        if o.no_local && f.filter.starts_with("$share/") {
            return Err(EncodeError::Invalid("No Local on a shared subscription"));
        }
        out.put_string(&f.filter)?;
        out.put_u8(
            (o.qos as u8)
                | (u8::from(o.no_local) << 2)
                | (u8::from(o.retain_as_published) << 3)
                | (o.retain_handling << 4),
        );
    }
    Ok(())
}

fn write_suback<S: Sink>(
    s: &SubAck,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    if s.codes.is_empty() {
        return Err(EncodeError::Invalid("SUBACK without reason codes"));
    }
    if let Some(_code) = s
        .codes
        .iter()
        .find(|&&c| !is_allowed(CodeKind::SubAck, version, c))
    {
        return Err(match version {
            ProtocolVersion::V311 => {
                EncodeError::NotInVersion("a SUBACK return code other than 0, 1, 2, 0x80")
            }
            ProtocolVersion::V5 => EncodeError::Invalid("reason code not allowed on SUBACK"),
        });
    }
    packet_id(s.packet_id, out)?;
    if version == ProtocolVersion::V5 {
        properties::encode(&s.properties, Context::SubAck, out)?;
    }
    out.put_slice(&s.codes);
    Ok(())
}

fn write_unsubscribe<S: Sink>(
    u: &Unsubscribe,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    if u.filters.is_empty() {
        return Err(EncodeError::Invalid("UNSUBSCRIBE without topic filters"));
    }
    packet_id(u.packet_id, out)?;
    if version == ProtocolVersion::V5 {
        properties::encode(&u.properties, Context::Unsubscribe, out)?;
    }
    for filter in &u.filters {
        out.put_string(filter)?;
    }
    Ok(())
}

fn write_unsuback<S: Sink>(
    u: &UnsubAck,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    packet_id(u.packet_id, out)?;
    match version {
        ProtocolVersion::V311 => {
            if u.codes.iter().any(|&c| c >= 0x80) {
                return Err(EncodeError::NotInVersion(
                    "a failure reason code on UNSUBACK",
                ));
            }
            Ok(())
        }
        ProtocolVersion::V5 => {
            if u.codes.is_empty() {
                return Err(EncodeError::Invalid("UNSUBACK without reason codes"));
            }
            if u.codes
                .iter()
                .any(|&c| !is_allowed(CodeKind::UnsubAck, version, c))
            {
                return Err(EncodeError::Invalid("reason code not allowed on UNSUBACK"));
            }
            properties::encode(&u.properties, Context::UnsubAck, out)?;
            out.put_slice(&u.codes);
            Ok(())
        }
    }
}

fn write_disconnect<S: Sink>(
    d: &Disconnect,
    version: ProtocolVersion,
    out: &mut S,
) -> Result<(), EncodeError> {
    match version {
        ProtocolVersion::V311 if d.reason != 0 => {
            Err(EncodeError::NotInVersion("a DISCONNECT reason code"))
        }
        ProtocolVersion::V311 => Ok(()),
        ProtocolVersion::V5 => {
            if !is_allowed(CodeKind::Disconnect, version, d.reason) {
                return Err(EncodeError::Invalid(
                    "reason code not allowed on DISCONNECT",
                ));
            }
            if !d.properties.is_empty() {
                out.put_u8(d.reason);
                properties::encode(&d.properties, Context::Disconnect, out)?;
            } else if d.reason != 0 {
                out.put_u8(d.reason);
            }
            Ok(())
        }
    }
}

fn write_auth<S: Sink>(a: &Auth, version: ProtocolVersion, out: &mut S) -> Result<(), EncodeError> {
    if version == ProtocolVersion::V311 {
        return Err(EncodeError::NotInVersion("AUTH"));
    }
    if !is_allowed(CodeKind::Auth, version, a.reason) {
        return Err(EncodeError::Invalid("reason code not allowed on AUTH"));
    }
    if a.reason == 0 && a.properties.is_empty() {
        return Ok(());
    }
    out.put_u8(a.reason);
    properties::encode(&a.properties, Context::Auth, out)
}
