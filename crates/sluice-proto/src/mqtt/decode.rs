//! Incremental decoder. (Implementation in progress.)

use bytes::BytesMut;
use super::{Packet, ProtocolVersion};

/// Why bytes could not be decoded. Every variant means the connection must be closed
/// (MQTT has no resynchronisation); the message says what the peer did wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("packet of {size} bytes exceeds the maximum packet size of {max} bytes")]
    PacketTooLarge { size: usize, max: usize },
    #[error("malformed remaining length (more than 4 bytes)")]
    MalformedLength,
    #[error("malformed {packet}: {reason}")]
    Malformed { packet: &'static str, reason: &'static str },
    #[error("unknown packet type {0}")]
    UnknownPacketType(u8),
    #[error("unsupported protocol level {0}")]
    UnsupportedProtocolLevel(u8),
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
}

/// Incremental MQTT decoder. A server-side decoder starts without a version and learns it
/// from CONNECT; a client-side one is created with the version it sent.
#[derive(Debug, Clone)]
pub struct Decoder {
    version: Option<ProtocolVersion>,
    max_packet_size: usize,
}

impl Decoder {
    /// Server side: the first packet must be CONNECT, which fixes the version.
    pub fn server(max_packet_size: usize) -> Decoder {
        Decoder { version: None, max_packet_size }
    }
    /// Client side: packets are decoded as `version`.
    pub fn client(version: ProtocolVersion, max_packet_size: usize) -> Decoder {
        Decoder { version: Some(version), max_packet_size }
    }
    pub fn version(&self) -> Option<ProtocolVersion> {
        self.version
    }
    pub fn set_max_packet_size(&mut self, max: usize) {
        self.max_packet_size = max;
    }
    /// Decode one packet from the front of `buf`, consuming its bytes. `Ok(None)`: need more.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Packet>, DecodeError> {
        let _ = buf;
        todo!()
    }
}
