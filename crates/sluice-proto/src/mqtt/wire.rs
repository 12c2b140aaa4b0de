//! MQTT data representations (MQTT 5 §1.5, 3.1.1 §1.5): the primitives every packet is built from.
//!
//! Owns: reading them out of a packet body ([`Reader`]) and writing them to a byte sink
//! ([`Sink`], implemented by `BytesMut` for output and by [`Counter`] for sizing). Does not own:
//! packet layouts (decode.rs / encode.rs) or property blocks (properties.rs).
//!
//! Wire format:
//! - Two/Four Byte Integer: big-endian `u16` / `u32`.
//! - Variable Byte Integer: 1–4 bytes, 7 bits each, least significant group first, high bit =
//!   "more bytes follow"; maximum 268,435,455. MQTT 5 requires the minimal encoding, so a final
//!   byte of 0x00 after a continuation byte is rejected.
//! - Binary Data: `u16` length, then that many bytes.
//! - UTF-8 Encoded String: Binary Data that is well-formed UTF-8 without U+0000.
//!
//! Invariants: a [`Reader`] only hands out slices of the packet's own `Bytes` (no copies, no
//! allocation), keeps `pos <= buf.len()`, and never indexes without a bounds check, so any
//! input yields a value or a [`DecodeError`], never a panic.

use bytes::{BufMut, Bytes, BytesMut};
use bytestring::ByteString;

use super::decode::DecodeError;
use super::encode::EncodeError;

/// Largest value a Variable Byte Integer can carry (and so the largest remaining length).
pub(crate) const MAX_VARINT: usize = 268_435_455;

/// Result of peeking at a Variable Byte Integer at the front of a byte slice.
pub(crate) enum Varint {
    /// The value, the number of bytes it occupies, and whether that is the fewest possible.
    Complete {
        value: usize,
        len: usize,
        minimal: bool,
    },
    /// The slice ends before the last byte of the integer.
    Incomplete,
    /// A fifth byte would be needed.
    TooLong,
}

/// Parse a Variable Byte Integer at the front of `bytes` without consuming anything.
pub(crate) fn peek_varint(bytes: &[u8]) -> Varint {
    let mut value = 0usize;
    for i in 0..4 {
        let Some(&byte) = bytes.get(i) else {
            return Varint::Incomplete;
        };
        value |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            let minimal = i == 0 || byte != 0;
            return Varint::Complete {
                value,
                len: i + 1,
                minimal,
            };
        }
    }
    Varint::TooLong
}

/// Number of bytes the Variable Byte Integer encoding of `value` takes (`value <= MAX_VARINT`).
pub(crate) fn varint_len(value: usize) -> usize {
    match value {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// Sequential reader over one packet body (or a property block inside it).
pub(crate) struct Reader {
    buf: Bytes,
    pos: usize,
    /// Packet name for error messages.
    packet: &'static str,
}

impl Reader {
    pub(crate) fn new(buf: Bytes, packet: &'static str) -> Reader {
        Reader {
            buf,
            pos: 0,
            packet,
        }
    }

    pub(crate) fn packet(&self) -> &'static str {
        self.packet
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    pub(crate) fn malformed(&self, reason: &'static str) -> DecodeError {
        DecodeError::Malformed {
            packet: self.packet,
            reason,
        }
    }

    fn truncated(&self) -> DecodeError {
        self.malformed("packet ends inside a field")
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        let byte = *self.buf.get(self.pos).ok_or_else(|| self.truncated())?;
        self.pos += 1;
        Ok(byte)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        let bytes = self.array::<2>()?;
        Ok(u16::from_be_bytes(bytes))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        let bytes = self.array::<4>()?;
        Ok(u32::from_be_bytes(bytes))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let end = self.pos.checked_add(N).ok_or_else(|| self.truncated())?;
        let slice = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.truncated())?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        self.pos = end;
        Ok(out)
    }

    /// A Variable Byte Integer inside the body (property lengths, identifiers, values).
    pub(crate) fn varint(&mut self) -> Result<u32, DecodeError> {
        let rest = self.buf.get(self.pos..).unwrap_or(&[]);
        match peek_varint(rest) {
            Varint::Complete { minimal: false, .. } => {
                Err(self.malformed("variable byte integer not minimally encoded"))
            }
            Varint::Complete {
                value,
                len,
                minimal: true,
            } => {
                self.pos += len;
                // A 4-byte varint is at most MAX_VARINT < u32::MAX.
                u32::try_from(value).map_err(|_| self.malformed("variable byte integer overflows"))
            }
            Varint::Incomplete => Err(self.truncated()),
            Varint::TooLong => Err(self.malformed("variable byte integer longer than 4 bytes")),
        }
    }

    /// The next `n` bytes as a zero-copy slice of the packet.
    pub(crate) fn bytes(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        if n > self.remaining() {
            return Err(self.truncated());
        }
        let slice = self.buf.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(slice)
    }

    /// Binary Data: `u16` length and bytes.
    pub(crate) fn binary(&mut self) -> Result<Bytes, DecodeError> {
        let len = usize::from(self.u16()?);
        self.bytes(len)
    }

    /// UTF-8 Encoded String: `u16` length and well-formed UTF-8 without U+0000.
    pub(crate) fn string(&mut self) -> Result<ByteString, DecodeError> {
        let bytes = self.binary()?;
        utf8(bytes, self.packet)
    }

    /// A reader over the next `n` bytes (a property block); this reader skips past them.
    pub(crate) fn sub(&mut self, n: usize) -> Result<Reader, DecodeError> {
        let bytes = self.bytes(n)?;
        Ok(Reader::new(bytes, self.packet))
    }

    /// Everything left, as a zero-copy slice (PUBLISH payload, SUBACK codes).
    pub(crate) fn rest(&mut self) -> Bytes {
        let rest = self.buf.slice(self.pos.min(self.buf.len())..);
        self.pos = self.buf.len();
        rest
    }

    /// Fail if bytes are left over after the last field of the packet.
    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        if self.is_empty() {
            Ok(())
        } else {
            Err(self.malformed("trailing bytes after the last field"))
        }
    }
}

/// Validate a UTF-8 Encoded String without copying it.
pub(crate) fn utf8(bytes: Bytes, packet: &'static str) -> Result<ByteString, DecodeError> {
    if bytes.contains(&0) {
        return Err(DecodeError::Malformed {
            packet,
            reason: "string contains U+0000",
        });
    }
    ByteString::try_from(bytes).map_err(|_| DecodeError::Malformed {
        packet,
        reason: "string is not valid UTF-8",
    })
}

/// Where encoded bytes go: the output buffer, or a [`Counter`] that only measures them.
pub(crate) trait Sink {
    fn put_slice(&mut self, bytes: &[u8]);

    fn put_u8(&mut self, value: u8) {
        self.put_slice(&[value]);
    }

    fn put_u16(&mut self, value: u16) {
        self.put_slice(&value.to_be_bytes());
    }

    fn put_u32(&mut self, value: u32) {
        self.put_slice(&value.to_be_bytes());
    }

    /// Variable Byte Integer; `value` must be at most [`MAX_VARINT`].
    fn put_varint(&mut self, value: usize) -> Result<(), EncodeError> {
        if value > MAX_VARINT {
            return Err(EncodeError::TooLarge(value));
        }
        let mut buf = [0u8; 4];
        let mut rest = value;
        let mut len = 0;
        for slot in buf.iter_mut() {
            // Truncation intended: the low 7 bits.
            let mut byte = (rest & 0x7f) as u8;
            rest >>= 7;
            if rest > 0 {
                byte |= 0x80;
            }
            *slot = byte;
            len += 1;
            if rest == 0 {
                break;
            }
        }
        self.put_slice(buf.get(..len).unwrap_or(&buf));
        Ok(())
    }

    /// Binary Data: `u16` length and bytes.
    fn put_binary(&mut self, bytes: &[u8]) -> Result<(), EncodeError> {
        let len = u16::try_from(bytes.len()).map_err(|_| EncodeError::FieldTooLong)?;
        self.put_u16(len);
        self.put_slice(bytes);
        Ok(())
    }

    /// UTF-8 Encoded String (UTF-8 is guaranteed by the type; U+0000 is rejected here).
    fn put_string(&mut self, s: &str) -> Result<(), EncodeError> {
        if s.as_bytes().contains(&0) {
            return Err(EncodeError::Invalid("string contains U+0000"));
        }
        self.put_binary(s.as_bytes())
    }
}

impl Sink for BytesMut {
    fn put_slice(&mut self, bytes: &[u8]) {
        BufMut::put_slice(self, bytes);
    }
}

/// A sink that only counts bytes: the sizing pass of the encoder.
#[derive(Debug, Default)]
pub(crate) struct Counter {
    pub(crate) len: usize,
}

impl Sink for Counter {
    fn put_slice(&mut self, bytes: &[u8]) {
        self.len = self.len.saturating_add(bytes.len());
    }
}
