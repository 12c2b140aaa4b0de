//! MDER (IEEE 11073-20601 Annex F) primitives: a bounds-checked reader and a writer.
//!
//! Owns: reading and writing the fixed-layout MDER forms — big-endian integers, OCTET STRING
//! (u16 length + bytes), SEQUENCE OF (u16 count + u16 length + elements), ANY (u16 length +
//! bytes) — with every count and length checked against what encloses it. Does not own:
//! which structure a field belongs to (`apdu.rs`).
//!
//! Invariant: a [`Reader`] never reads past its end; every failure is a [`DecodeError`]
//! naming what was being read, never a panic.

use bytes::{BufMut, Bytes, BytesMut};

/// Why bytes are not a valid APDU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated: {what} needs {need} bytes, {have} left")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("{what}: {count} elements in {len} bytes do not fit")]
    BadSequence {
        what: &'static str,
        count: usize,
        len: usize,
    },
    #[error("{what}: {extra} bytes left over")]
    TrailingBytes { what: &'static str, extra: usize },
    #[error("unknown APDU choice {0:#06x}")]
    UnknownApdu(u16),
    #[error("PRST octet string length {inner} does not match its APDU length {outer}")]
    PrstLength { inner: usize, outer: usize },
    #[error("APDU of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
}

/// A cursor over one structure's bytes.
#[derive(Debug, Clone)]
pub struct Reader {
    buf: Bytes,
}

impl Reader {
    pub fn new(buf: Bytes) -> Reader {
        Reader { buf }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn need(&self, what: &'static str, need: usize) -> Result<(), DecodeError> {
        if self.buf.len() < need {
            return Err(DecodeError::Truncated {
                what,
                need,
                have: self.buf.len(),
            });
        }
        Ok(())
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.bytes(what, 1)?[0])
    }

    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let b = self.bytes(what, 2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let b = self.bytes(what, 4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// `n` raw bytes.
    pub fn bytes(&mut self, what: &'static str, n: usize) -> Result<Bytes, DecodeError> {
        self.need(what, n)?;
        Ok(self.buf.split_to(n))
    }

    /// OCTET STRING or ANY: u16 length + bytes.
    pub fn octets(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let n = self.u16(what)? as usize;
        self.bytes(what, n)
    }

    /// SEQUENCE OF: (count, a reader over exactly the elements' bytes).
    pub fn seq(&mut self, what: &'static str) -> Result<(usize, Reader), DecodeError> {
        let count = self.u16(what)? as usize;
        let len = self.u16(what)? as usize;
        let body = self.bytes(what, len)?;
        // Every element is at least 2 bytes in the structures we read; a count that cannot fit
        // is rejected before any element is read.
        if count.saturating_mul(2) > len {
            return Err(DecodeError::BadSequence { what, count, len });
        }
        Ok((count, Reader::new(body)))
    }

    /// Everything was read.
    pub fn finish(&self, what: &'static str) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes {
                what,
                extra: self.buf.len(),
            })
        }
    }
}

/// Writing helpers over a `BytesMut`.
pub trait Writer {
    fn u16_be(&mut self, v: u16);
    fn u32_be(&mut self, v: u32);
    /// OCTET STRING / ANY.
    fn octets(&mut self, b: &[u8]);
    /// SEQUENCE OF with pre-encoded elements.
    fn seq(&mut self, count: usize, elements: &[u8]);
}

impl Writer for BytesMut {
    fn u16_be(&mut self, v: u16) {
        self.put_u16(v);
    }
    fn u32_be(&mut self, v: u32) {
        self.put_u32(v);
    }
    fn octets(&mut self, b: &[u8]) {
        self.put_u16(b.len() as u16);
        self.put_slice(b);
    }
    fn seq(&mut self, count: usize, elements: &[u8]) {
        self.put_u16(count as u16);
        self.put_u16(elements.len() as u16);
        self.put_slice(elements);
    }
}
