//! Encoder. (Implementation in progress.)

use bytes::BytesMut;
use super::{Packet, ProtocolVersion};

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
}

/// Append the wire form of `packet` for `version` to `out`.
pub fn encode(packet: &Packet, version: ProtocolVersion, out: &mut BytesMut) -> Result<(), EncodeError> {
    let _ = (packet, version, out);
    todo!()
}
