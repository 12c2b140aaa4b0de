//! The bench payload: a fixed binary header followed by random filler.
//!
//! Owns: the wire format of every PUBLISH payload the `devices` generator sends and the `sink`
//! decodes. Does not own: MQTT framing (sluice-proto does that) or the choice of sizes.
//!
//! Format (all integers big-endian), [`HEADER_LEN`] = 24 bytes, then filler up to the chosen
//! payload size:
//! ```text
//! offset  size  field
//!      0     4  magic            b"SLB1"
//!      4     4  device index     u32, 0-based index of the sending device in its run
//!      8     8  sequence number  u64, per device, starts at 0, +1 per PUBLISH sent
//!     16     8  send timestamp   u64, nanoseconds since the UNIX epoch (SystemTime) taken just
//!                                before the PUBLISH is written to the socket
//!     24     …  filler           random bytes (shared per run; not checked by the sink)
//! ```
//! The timestamp is wall-clock time: end-to-end latency is only meaningful when sender and sink
//! read the same clock, i.e. run on the same machine (the scenario runner guarantees that).
//!
//! Invariants: [`PayloadHeader::parse`] never panics, whatever the bytes; a payload shorter than
//! the header or with another magic is reported as an error (the sink counts it as foreign).

use std::time::{SystemTime, UNIX_EPOCH};

/// First four bytes of every bench payload.
pub const MAGIC: [u8; 4] = *b"SLB1";
/// Size of the header; the smallest payload the generator can send.
pub const HEADER_LEN: usize = 24;

/// The decoded fixed header of a bench payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadHeader {
    /// 0-based index of the sending device.
    pub device: u32,
    /// Per-device sequence number, starting at 0.
    pub seq: u64,
    /// Send time, nanoseconds since the UNIX epoch.
    pub sent_at_ns: u64,
}

/// Why a payload is not a bench payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("payload of {0} bytes is shorter than the {HEADER_LEN}-byte bench header")]
    TooShort(usize),
    #[error("payload does not start with the bench magic \"SLB1\"")]
    BadMagic,
}

impl PayloadHeader {
    /// Write the header into the first [`HEADER_LEN`] bytes of `out`.
    pub fn write_to(&self, out: &mut [u8]) -> Result<(), PayloadError> {
        let Some(header) = out.get_mut(..HEADER_LEN) else {
            return Err(PayloadError::TooShort(out.len()));
        };
        header[0..4].copy_from_slice(&MAGIC);
        header[4..8].copy_from_slice(&self.device.to_be_bytes());
        header[8..16].copy_from_slice(&self.seq.to_be_bytes());
        header[16..24].copy_from_slice(&self.sent_at_ns.to_be_bytes());
        Ok(())
    }

    /// Read the header from the front of `payload`.
    pub fn parse(payload: &[u8]) -> Result<PayloadHeader, PayloadError> {
        let Some(header) = payload.get(..HEADER_LEN) else {
            return Err(PayloadError::TooShort(payload.len()));
        };
        if header[0..4] != MAGIC {
            return Err(PayloadError::BadMagic);
        }
        Ok(PayloadHeader {
            device: u32::from_be_bytes(fixed(&header[4..8])),
            seq: u64::from_be_bytes(fixed(&header[8..16])),
            sent_at_ns: u64::from_be_bytes(fixed(&header[16..24])),
        })
    }
}

/// Nanoseconds since the UNIX epoch by the wall clock; 0 if the clock is before 1970.
pub fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Copy a slice into an array. Invariant: callers pass sub-slices of the 24-byte header with
/// constant bounds of exactly `N` bytes, so the copy cannot fail.
fn fixed<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_survives_a_round_trip_at_the_front_of_a_larger_payload() {
        let header = PayloadHeader {
            device: 7,
            seq: 1 << 40,
            sent_at_ns: 1_700_000_000_123_456_789,
        };
        let mut payload = vec![0xAA; 100];
        header
            .write_to(&mut payload)
            .expect("100 bytes hold the header");
        assert_eq!(PayloadHeader::parse(&payload), Ok(header));
        assert!(
            payload[HEADER_LEN..].iter().all(|&b| b == 0xAA),
            "filler is left alone"
        );
    }

    #[test]
    fn short_and_foreign_payloads_are_errors_not_panics() {
        assert_eq!(PayloadHeader::parse(b""), Err(PayloadError::TooShort(0)));
        assert_eq!(
            PayloadHeader::parse(&[0; 23]),
            Err(PayloadError::TooShort(23))
        );
        assert_eq!(PayloadHeader::parse(&[0; 24]), Err(PayloadError::BadMagic));
        let header = PayloadHeader {
            device: 0,
            seq: 0,
            sent_at_ns: 0,
        };
        assert_eq!(
            header.write_to(&mut [0; 10]),
            Err(PayloadError::TooShort(10))
        );
    }
}
