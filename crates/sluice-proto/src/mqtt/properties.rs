//! MQTT 5 property blocks (MQTT 5 §2.2.2): decoding, encoding and the rules on their contents.
//!
//! Owns: which property may appear on which packet (the table in §2.2.2.2), how often, and the
//! value constraints the specification calls a Protocol Error. Does not own: the packets that
//! carry a block (decode.rs / encode.rs). MQTT 3.1.1 has no properties; callers never get here
//! for 3.1.1.
//!
//! Wire format: Property Length (Variable Byte Integer, bytes that follow), then pairs of
//! identifier (Variable Byte Integer) and value, whose type depends on the identifier: Byte,
//! Two/Four Byte Integer, Variable Byte Integer, UTF-8 string, Binary Data, or a UTF-8 string
//! pair (User Property). The encoder writes properties in ascending identifier order; repeated
//! ones (Subscription Identifier, User Property) in the order of their `Vec`.
//!
//! Invariants: the decoder accepts exactly what [`encode`] can write: an identifier not allowed
//! on the packet, a duplicate single-occurrence property, or a value the specification forbids
//! is rejected by both, so an encoded block always decodes to an equal [`Properties`].

use super::decode::DecodeError;
use super::encode::EncodeError;
use super::topic::valid_topic_name;
use super::wire::{Counter, Reader, Sink, MAX_VARINT};
use super::Properties;

/// The packet (or the will inside CONNECT) a property block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Context {
    Connect,
    Will,
    ConnAck,
    Publish,
    /// PUBACK, PUBREC, PUBREL and PUBCOMP.
    PubResponse,
    Subscribe,
    SubAck,
    Unsubscribe,
    UnsubAck,
    Disconnect,
    Auth,
}

impl Context {
    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

const CONNECT: u16 = 1 << Context::Connect as u16;
const WILL: u16 = 1 << Context::Will as u16;
const CONNACK: u16 = 1 << Context::ConnAck as u16;
const PUBLISH: u16 = 1 << Context::Publish as u16;
const PUBRESP: u16 = 1 << Context::PubResponse as u16;
const SUBSCRIBE: u16 = 1 << Context::Subscribe as u16;
const SUBACK: u16 = 1 << Context::SubAck as u16;
const UNSUBSCRIBE: u16 = 1 << Context::Unsubscribe as u16;
const UNSUBACK: u16 = 1 << Context::UnsubAck as u16;
const DISCONNECT: u16 = 1 << Context::Disconnect as u16;
const AUTH: u16 = 1 << Context::Auth as u16;

/// Name of a property and the packets it may appear on (MQTT 5 Table 2-4), by identifier.
fn info(id: u32) -> Option<(&'static str, u16)> {
    let entry = match id {
        0x01 => ("Payload Format Indicator", PUBLISH | WILL),
        0x02 => ("Message Expiry Interval", PUBLISH | WILL),
        0x03 => ("Content Type", PUBLISH | WILL),
        0x08 => ("Response Topic", PUBLISH | WILL),
        0x09 => ("Correlation Data", PUBLISH | WILL),
        0x0B => ("Subscription Identifier", PUBLISH | SUBSCRIBE),
        0x11 => ("Session Expiry Interval", CONNECT | CONNACK | DISCONNECT),
        0x12 => ("Assigned Client Identifier", CONNACK),
        0x13 => ("Server Keep Alive", CONNACK),
        0x15 => ("Authentication Method", CONNECT | CONNACK | AUTH),
        0x16 => ("Authentication Data", CONNECT | CONNACK | AUTH),
        0x17 => ("Request Problem Information", CONNECT),
        0x18 => ("Will Delay Interval", WILL),
        0x19 => ("Request Response Information", CONNECT),
        0x1A => ("Response Information", CONNACK),
        0x1C => ("Server Reference", CONNACK | DISCONNECT),
        0x1F => (
            "Reason String",
            CONNACK | PUBRESP | SUBACK | UNSUBACK | DISCONNECT | AUTH,
        ),
        0x21 => ("Receive Maximum", CONNECT | CONNACK),
        0x22 => ("Topic Alias Maximum", CONNECT | CONNACK),
        0x23 => ("Topic Alias", PUBLISH),
        0x24 => ("Maximum QoS", CONNACK),
        0x25 => ("Retain Available", CONNACK),
        0x26 => (
            "User Property",
            CONNECT
                | WILL
                | CONNACK
                | PUBLISH
                | PUBRESP
                | SUBSCRIBE
                | SUBACK
                | UNSUBSCRIBE
                | UNSUBACK
                | DISCONNECT
                | AUTH,
        ),
        0x27 => ("Maximum Packet Size", CONNECT | CONNACK),
        0x28 => ("Wildcard Subscription Available", CONNACK),
        0x29 => ("Subscription Identifier Available", CONNACK),
        0x2A => ("Shared Subscription Available", CONNACK),
        _ => return None,
    };
    Some(entry)
}

fn allowed(id: u32, ctx: Context) -> bool {
    info(id).is_some_and(|(_, mask)| mask & ctx.bit() != 0)
}

/// Read a property block (length prefix included) from `r`.
pub(crate) fn decode(r: &mut Reader, ctx: Context) -> Result<Properties, DecodeError> {
    let packet = r.packet();
    let len = r.varint()?;
    let mut r = r.sub(len as usize)?;
    let mut p = Properties::default();
    while !r.is_empty() {
        let id = r.varint()?;
        let name = match info(id) {
            Some((name, mask)) if mask & ctx.bit() != 0 => name,
            _ => {
                return Err(DecodeError::PropertyNotAllowed {
                    packet,
                    property: id,
                })
            }
        };
        let dup = || DecodeError::DuplicateProperty {
            packet,
            property: name,
        };
        macro_rules! once {
            ($field:ident, $value:expr) => {{
                if p.$field.is_some() {
                    return Err(dup());
                }
                p.$field = Some($value);
            }};
        }
        match id {
            0x01 => once!(payload_format_indicator, r.u8()?),
            0x02 => once!(message_expiry_interval, r.u32()?),
            0x03 => once!(content_type, r.string()?),
            0x08 => once!(response_topic, r.string()?),
            0x09 => once!(correlation_data, r.binary()?),
            0x0B => {
                if ctx == Context::Subscribe && !p.subscription_identifiers.is_empty() {
                    return Err(dup());
                }
                let value = r.varint()?;
                p.subscription_identifiers.push(value);
            }
            0x11 => once!(session_expiry_interval, r.u32()?),
            0x12 => once!(assigned_client_identifier, r.string()?),
            0x13 => once!(server_keep_alive, r.u16()?),
            0x15 => once!(authentication_method, r.string()?),
            0x16 => once!(authentication_data, r.binary()?),
            0x17 => once!(request_problem_information, r.u8()?),
            0x18 => once!(will_delay_interval, r.u32()?),
            0x19 => once!(request_response_information, r.u8()?),
            0x1A => once!(response_information, r.string()?),
            0x1C => once!(server_reference, r.string()?),
            0x1F => once!(reason_string, r.string()?),
            0x21 => once!(receive_maximum, r.u16()?),
            0x22 => once!(topic_alias_maximum, r.u16()?),
            0x23 => once!(topic_alias, r.u16()?),
            0x24 => once!(maximum_qos, r.u8()?),
            0x25 => once!(retain_available, r.u8()?),
            0x26 => {
                let key = r.string()?;
                let value = r.string()?;
                p.user_properties.push((key, value));
            }
            0x27 => once!(maximum_packet_size, r.u32()?),
            0x28 => once!(wildcard_subscription_available, r.u8()?),
            0x29 => once!(subscription_identifier_available, r.u8()?),
            0x2A => once!(shared_subscription_available, r.u8()?),
            // `info` returned Some, so `id` is one of the arms above.
            _ => {
                return Err(DecodeError::PropertyNotAllowed {
                    packet,
                    property: id,
                })
            }
        }
    }
    check_values(&p, ctx).map_err(DecodeError::Protocol)?;
    Ok(p)
}

/// Value rules the specification states as "It is a Protocol Error to ...".
fn check_values(p: &Properties, ctx: Context) -> Result<(), &'static str> {
    let flag = |v: Option<u8>| !matches!(v, Some(v) if v > 1);
    if !flag(p.payload_format_indicator) {
        return Err("Payload Format Indicator is not 0 or 1");
    }
    if !flag(p.request_problem_information) {
        return Err("Request Problem Information is not 0 or 1");
    }
    if !flag(p.request_response_information) {
        return Err("Request Response Information is not 0 or 1");
    }
    if !flag(p.maximum_qos) {
        return Err("Maximum QoS is not 0 or 1");
    }
    if !flag(p.retain_available) {
        return Err("Retain Available is not 0 or 1");
    }
    if !flag(p.wildcard_subscription_available) {
        return Err("Wildcard Subscription Available is not 0 or 1");
    }
    if !flag(p.subscription_identifier_available) {
        return Err("Subscription Identifier Available is not 0 or 1");
    }
    if !flag(p.shared_subscription_available) {
        return Err("Shared Subscription Available is not 0 or 1");
    }
    if p.receive_maximum == Some(0) {
        return Err("Receive Maximum is 0");
    }
    if p.maximum_packet_size == Some(0) {
        return Err("Maximum Packet Size is 0");
    }
    if p.topic_alias == Some(0) {
        return Err("Topic Alias is 0");
    }
    if p.subscription_identifiers
        .iter()
        .any(|&id| id == 0 || id as usize > MAX_VARINT)
    {
        return Err("Subscription Identifier is 0 or above 268,435,455");
    }
    if ctx == Context::Subscribe && p.subscription_identifiers.len() > 1 {
        return Err("SUBSCRIBE carries more than one Subscription Identifier");
    }
    if p.authentication_data.is_some() && p.authentication_method.is_none() {
        return Err("Authentication Data without Authentication Method");
    }
    if p.response_topic
        .as_ref()
        .is_some_and(|t| !valid_topic_name(t))
    {
        return Err("Response Topic is not a valid topic name");
    }
    Ok(())
}

/// Write a property block (length prefix included) for `ctx` to `out`.
pub(crate) fn encode<S: Sink>(
    p: &Properties,
    ctx: Context,
    out: &mut S,
) -> Result<(), EncodeError> {
    check_values(p, ctx).map_err(EncodeError::Invalid)?;
    let mut counter = Counter::default();
    write_items(p, ctx, &mut counter)?;
    out.put_varint(counter.len)?;
    write_items(p, ctx, out)
}

fn write_items<S: Sink>(p: &Properties, ctx: Context, out: &mut S) -> Result<(), EncodeError> {
    let check = |id: u32| {
        if allowed(id, ctx) {
            Ok(())
        } else {
            Err(EncodeError::PropertyNotAllowed(
                info(id).map_or("unknown property", |(n, _)| n),
            ))
        }
    };
    macro_rules! byte {
        ($id:expr, $field:ident) => {
            if let Some(v) = p.$field {
                check($id)?;
                out.put_u8($id);
                out.put_u8(v);
            }
        };
    }
    macro_rules! two {
        ($id:expr, $field:ident) => {
            if let Some(v) = p.$field {
                check($id)?;
                out.put_u8($id);
                out.put_u16(v);
            }
        };
    }
    macro_rules! four {
        ($id:expr, $field:ident) => {
            if let Some(v) = p.$field {
                check($id)?;
                out.put_u8($id);
                out.put_u32(v);
            }
        };
    }
    macro_rules! string {
        ($id:expr, $field:ident) => {
            if let Some(v) = &p.$field {
                check($id)?;
                out.put_u8($id);
                out.put_string(v)?;
            }
        };
    }
    macro_rules! binary {
        ($id:expr, $field:ident) => {
            if let Some(v) = &p.$field {
                check($id)?;
                out.put_u8($id);
                out.put_binary(v)?;
            }
        };
    }
    byte!(0x01, payload_format_indicator);
    four!(0x02, message_expiry_interval);
    string!(0x03, content_type);
    string!(0x08, response_topic);
    binary!(0x09, correlation_data);
    for &id in &p.subscription_identifiers {
        check(0x0B)?;
        out.put_u8(0x0B);
        out.put_varint(id as usize)?;
    }
    four!(0x11, session_expiry_interval);
    string!(0x12, assigned_client_identifier);
    two!(0x13, server_keep_alive);
    string!(0x15, authentication_method);
    binary!(0x16, authentication_data);
    byte!(0x17, request_problem_information);
    four!(0x18, will_delay_interval);
    byte!(0x19, request_response_information);
    string!(0x1A, response_information);
    string!(0x1C, server_reference);
    string!(0x1F, reason_string);
    two!(0x21, receive_maximum);
    two!(0x22, topic_alias_maximum);
    two!(0x23, topic_alias);
    byte!(0x24, maximum_qos);
    byte!(0x25, retain_available);
    for (key, value) in &p.user_properties {
        check(0x26)?;
        out.put_u8(0x26);
        out.put_string(key)?;
        out.put_string(value)?;
    }
    four!(0x27, maximum_packet_size);
    byte!(0x28, wildcard_subscription_available);
    byte!(0x29, subscription_identifier_available);
    byte!(0x2A, shared_subscription_available);
    Ok(())
}
