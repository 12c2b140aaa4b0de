//! Packet types shared by the decoder and the encoder.
//!
//! One type per packet for both protocol versions; fields that exist only in MQTT 5
//! (properties, reason codes, subscription options other than QoS) are empty or zero for 3.1.1.
//! What the decoder guarantees and the encoder checks: `Publish::packet_id` is `Some` exactly
//! when QoS > 0 and is never 0 (nor any other packet identifier); a PUBLISH or will topic is a
//! valid topic name (or, in MQTT 5, empty with a Topic Alias); strings hold no U+0000; decoded
//! `Publish`/`PubResponse` properties are `None` rather than `Some(empty)`.

use bytes::Bytes;
use bytestring::ByteString;

/// Protocol level negotiated in CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProtocolVersion {
    /// MQTT 3.1.1, protocol level 4.
    V311,
    /// MQTT 5.0, protocol level 5.
    V5,
}

/// Quality of service of a message or subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QoS {
    AtMostOnce = 0,
    AtLeastOnce = 1,
    ExactlyOnce = 2,
}

impl QoS {
    pub fn from_u8(v: u8) -> Option<QoS> {
        match v {
            0 => Some(QoS::AtMostOnce),
            1 => Some(QoS::AtLeastOnce),
            2 => Some(QoS::ExactlyOnce),
            _ => None,
        }
    }
}

/// MQTT 5 properties. One struct for every packet type; each field is present only when the
/// property was on the wire (or is to be written). The decoder rejects a property that is not
/// allowed on the packet that carries it, and a duplicate of a property that may appear once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties {
    pub payload_format_indicator: Option<u8>,           // 0x01
    pub message_expiry_interval: Option<u32>,           // 0x02
    pub content_type: Option<ByteString>,               // 0x03
    pub response_topic: Option<ByteString>,             // 0x08
    pub correlation_data: Option<Bytes>,                // 0x09
    pub subscription_identifiers: Vec<u32>,             // 0x0B (varint; may repeat in PUBLISH)
    pub session_expiry_interval: Option<u32>,           // 0x11
    pub assigned_client_identifier: Option<ByteString>, // 0x12
    pub server_keep_alive: Option<u16>,                 // 0x13
    pub authentication_method: Option<ByteString>,      // 0x15
    pub authentication_data: Option<Bytes>,             // 0x16
    pub request_problem_information: Option<u8>,        // 0x17
    pub will_delay_interval: Option<u32>,               // 0x18
    pub request_response_information: Option<u8>,       // 0x19
    pub response_information: Option<ByteString>,       // 0x1A
    pub server_reference: Option<ByteString>,           // 0x1C
    pub reason_string: Option<ByteString>,              // 0x1F
    pub receive_maximum: Option<u16>,                   // 0x21
    pub topic_alias_maximum: Option<u16>,               // 0x22
    pub topic_alias: Option<u16>,                       // 0x23
    pub maximum_qos: Option<u8>,                        // 0x24
    pub retain_available: Option<u8>,                   // 0x25
    pub user_properties: Vec<(ByteString, ByteString)>, // 0x26 (may repeat)
    pub maximum_packet_size: Option<u32>,               // 0x27
    pub wildcard_subscription_available: Option<u8>,    // 0x28
    pub subscription_identifier_available: Option<u8>,  // 0x29
    pub shared_subscription_available: Option<u8>,      // 0x2A
}

impl Properties {
    pub fn is_empty(&self) -> bool {
        *self == Properties::default()
    }
}

/// A will message carried in CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Will {
    pub topic: ByteString,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// Will properties (MQTT 5 only; empty for 3.1.1).
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    pub protocol: ProtocolVersion,
    /// "Clean session" in 3.1.1, "clean start" in 5.
    pub clean_start: bool,
    /// Seconds; 0 disables keep-alive.
    pub keep_alive: u16,
    /// May be empty (the server then assigns one, or rejects it).
    pub client_id: ByteString,
    pub will: Option<Will>,
    pub username: Option<ByteString>,
    pub password: Option<Bytes>,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnAck {
    pub session_present: bool,
    /// 3.1.1 return code (0–5) or MQTT 5 reason code; see [`reason`].
    pub code: u8,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub dup: bool,
    pub qos: QoS,
    pub retain: bool,
    /// May be empty in MQTT 5 when a topic alias is used.
    pub topic: ByteString,
    /// Present iff `qos > AtMostOnce`.
    pub packet_id: Option<u16>,
    /// MQTT 5 properties; `None` when there are none (the common case: no allocation).
    pub properties: Option<Box<Properties>>,
    pub payload: Bytes,
}

/// PUBACK, PUBREC, PUBREL and PUBCOMP share one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubResponse {
    pub packet_id: u16,
    /// MQTT 5 reason code (0 = success); always 0 for 3.1.1.
    pub reason: u8,
    pub properties: Option<Box<Properties>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriptionOptions {
    pub qos: QoS,
    /// MQTT 5 only (false for 3.1.1).
    pub no_local: bool,
    pub retain_as_published: bool,
    /// 0 = send retained on subscribe, 1 = only if new, 2 = never.
    pub retain_handling: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeFilter {
    pub filter: ByteString,
    pub options: SubscriptionOptions,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    pub packet_id: u16,
    pub filters: Vec<SubscribeFilter>,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubAck {
    pub packet_id: u16,
    /// One per filter: granted QoS (0–2) or a failure code (0x80 and up).
    pub codes: Vec<u8>,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    pub packet_id: u16,
    pub filters: Vec<ByteString>,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsubAck {
    pub packet_id: u16,
    /// MQTT 5: one reason code per filter. 3.1.1: always empty.
    pub codes: Vec<u8>,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disconnect {
    /// MQTT 5 reason code; 0 for 3.1.1.
    pub reason: u8,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    pub reason: u8,
    pub properties: Properties,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    Connect(Connect),
    ConnAck(ConnAck),
    Publish(Publish),
    PubAck(PubResponse),
    PubRec(PubResponse),
    PubRel(PubResponse),
    PubComp(PubResponse),
    Subscribe(Subscribe),
    SubAck(SubAck),
    Unsubscribe(Unsubscribe),
    UnsubAck(UnsubAck),
    PingReq,
    PingResp,
    Disconnect(Disconnect),
    /// MQTT 5 only.
    Auth(Auth),
}

impl Packet {
    /// The packet type's name as in the specification, for log lines.
    pub fn name(&self) -> &'static str {
        match self {
            Packet::Connect(_) => "CONNECT",
            Packet::ConnAck(_) => "CONNACK",
            Packet::Publish(_) => "PUBLISH",
            Packet::PubAck(_) => "PUBACK",
            Packet::PubRec(_) => "PUBREC",
            Packet::PubRel(_) => "PUBREL",
            Packet::PubComp(_) => "PUBCOMP",
            Packet::Subscribe(_) => "SUBSCRIBE",
            Packet::SubAck(_) => "SUBACK",
            Packet::Unsubscribe(_) => "UNSUBSCRIBE",
            Packet::UnsubAck(_) => "UNSUBACK",
            Packet::PingReq => "PINGREQ",
            Packet::PingResp => "PINGRESP",
            Packet::Disconnect(_) => "DISCONNECT",
            Packet::Auth(_) => "AUTH",
        }
    }
}

/// Reason and return codes used by sluice (MQTT 5 §2.4; 3.1.1 CONNACK return codes §3.2.2.3).
pub mod reason {
    pub const SUCCESS: u8 = 0x00;
    pub const GRANTED_QOS_1: u8 = 0x01;
    pub const GRANTED_QOS_2: u8 = 0x02;
    pub const DISCONNECT_WITH_WILL: u8 = 0x04;
    pub const NO_MATCHING_SUBSCRIBERS: u8 = 0x10;
    pub const NO_SUBSCRIPTION_EXISTED: u8 = 0x11;
    pub const UNSPECIFIED_ERROR: u8 = 0x80;
    pub const MALFORMED_PACKET: u8 = 0x81;
    pub const PROTOCOL_ERROR: u8 = 0x82;
    pub const IMPLEMENTATION_SPECIFIC_ERROR: u8 = 0x83;
    pub const UNSUPPORTED_PROTOCOL_VERSION: u8 = 0x84;
    pub const CLIENT_IDENTIFIER_NOT_VALID: u8 = 0x85;
    pub const BAD_USER_NAME_OR_PASSWORD: u8 = 0x86;
    pub const NOT_AUTHORIZED: u8 = 0x87;
    pub const SERVER_UNAVAILABLE: u8 = 0x88;
    pub const SERVER_BUSY: u8 = 0x89;
    pub const SESSION_TAKEN_OVER: u8 = 0x8E;
    pub const KEEP_ALIVE_TIMEOUT: u8 = 0x8D;
    pub const TOPIC_FILTER_INVALID: u8 = 0x8F;
    pub const TOPIC_NAME_INVALID: u8 = 0x90;
    pub const PACKET_IDENTIFIER_IN_USE: u8 = 0x91;
    pub const PACKET_IDENTIFIER_NOT_FOUND: u8 = 0x92;
    pub const RECEIVE_MAXIMUM_EXCEEDED: u8 = 0x93;
    pub const TOPIC_ALIAS_INVALID: u8 = 0x94;
    pub const PACKET_TOO_LARGE: u8 = 0x95;
    pub const QUOTA_EXCEEDED: u8 = 0x97;
    pub const PAYLOAD_FORMAT_INVALID: u8 = 0x99;
    pub const QOS_NOT_SUPPORTED: u8 = 0x9B;
    pub const SHARED_SUBSCRIPTIONS_NOT_SUPPORTED: u8 = 0x9E;
    pub const SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED: u8 = 0xA1;
    pub const WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED: u8 = 0xA2;

    /// 3.1.1 CONNACK return codes.
    pub const V3_UNACCEPTABLE_PROTOCOL_VERSION: u8 = 0x01;
    pub const V3_IDENTIFIER_REJECTED: u8 = 0x02;
    pub const V3_SERVER_UNAVAILABLE: u8 = 0x03;
    pub const V3_BAD_USER_NAME_OR_PASSWORD: u8 = 0x04;
    pub const V3_NOT_AUTHORIZED: u8 = 0x05;
}
