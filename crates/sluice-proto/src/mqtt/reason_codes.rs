//! Which reason codes each packet may carry (MQTT 5 §2.4 and the per-packet tables; 3.1.1
//! CONNACK return codes §3.2.2.3 and SUBACK return codes §3.9.3).
//!
//! Owns: the allow-lists the decoder and the encoder both check, so that a code one side
//! accepts the other side accepts too. Does not own: the meaning of the codes (see
//! [`super::reason`]) or what a session does on receiving them.

use super::ProtocolVersion;

/// The packet types that carry reason codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CodeKind {
    ConnAck,
    /// PUBACK and PUBREC.
    PubAckRec,
    /// PUBREL and PUBCOMP.
    PubRelComp,
    SubAck,
    UnsubAck,
    Disconnect,
    Auth,
}

const V3_CONNACK: &[u8] = &[0x00, 0x01, 0x02, 0x03, 0x04, 0x05];
const V3_SUBACK: &[u8] = &[0x00, 0x01, 0x02, 0x80];

const V5_CONNACK: &[u8] = &[
    0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97,
    0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F,
];
const V5_PUBACK_PUBREC: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];
const V5_PUBREL_PUBCOMP: &[u8] = &[0x00, 0x92];
const V5_SUBACK: &[u8] = &[
    0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2,
];
const V5_UNSUBACK: &[u8] = &[0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91];
const V5_DISCONNECT: &[u8] = &[
    0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
];
const V5_AUTH: &[u8] = &[0x00, 0x18, 0x19];

/// The codes `kind` may carry in `version`. 3.1.1 packets without codes allow only 0.
pub(crate) fn allowed_codes(kind: CodeKind, version: ProtocolVersion) -> &'static [u8] {
    match (version, kind) {
        (ProtocolVersion::V311, CodeKind::ConnAck) => V3_CONNACK,
        (ProtocolVersion::V311, CodeKind::SubAck) => V3_SUBACK,
        (ProtocolVersion::V311, _) => &[0x00],
        (ProtocolVersion::V5, CodeKind::ConnAck) => V5_CONNACK,
        (ProtocolVersion::V5, CodeKind::PubAckRec) => V5_PUBACK_PUBREC,
        (ProtocolVersion::V5, CodeKind::PubRelComp) => V5_PUBREL_PUBCOMP,
        (ProtocolVersion::V5, CodeKind::SubAck) => V5_SUBACK,
        (ProtocolVersion::V5, CodeKind::UnsubAck) => V5_UNSUBACK,
        (ProtocolVersion::V5, CodeKind::Disconnect) => V5_DISCONNECT,
        (ProtocolVersion::V5, CodeKind::Auth) => V5_AUTH,
    }
}

pub(crate) fn is_allowed(kind: CodeKind, version: ProtocolVersion, code: u8) -> bool {
    allowed_codes(kind, version).contains(&code)
}
