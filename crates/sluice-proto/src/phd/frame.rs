//! APDU framing on a byte stream (§1): `choice u16 · length u16 · body`, `length` bytes
//! following the header. An APDU may arrive in several reads and several in one read.
//!
//! Owns: taking whole APDUs off the front of a read buffer, with a size limit checked from the
//! header before the body is buffered. Does not own: sockets.

use bytes::{Buf, BytesMut};

use super::apdu::Apdu;
use super::mder::DecodeError;

/// Bytes of the APDU header.
pub const HEADER: usize = 4;

/// Take the next whole APDU off `buf`: `Ok(None)` when more bytes are needed; an error when
/// the header announces more than `max` bytes (an agent must then be aborted with
/// buffer-overflow) or the body does not decode (the APDU's bytes are consumed either way, so
/// the caller may answer and go on, or abort).
pub fn decode_apdu(buf: &mut BytesMut, max: usize) -> Result<Option<Apdu>, DecodeError> {
    if buf.len() < HEADER {
        return Ok(None);
    }
    let choice = u16::from_be_bytes([buf[0], buf[1]]);
    let len = u16::from_be_bytes([buf[2], buf[3]]) as usize;
    if len + HEADER > max {
        return Err(DecodeError::TooLarge {
            len: len + HEADER,
            max,
        });
    }
    if buf.len() < HEADER + len {
        return Ok(None);
    }
    buf.advance(HEADER);
    let body = buf.split_to(len).freeze();
    Apdu::decode(choice, body).map(Some)
}
