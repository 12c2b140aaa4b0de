//! The body of one spool record: a device's PUBLISH as the uplink needs it. Sans-IO.
//!
//! Owns: the record body format (the spool's frame around it is `sluice-spool`'s). Does not
//! own: the frame, checksums (the spool checks a crc32c over the whole frame before a body
//! reaches [`decode`]) or what is done with a record.
//!
//! Format, version 1 (integers little-endian):
//! ```text
//! offset  size  field
//! 0       1     version = 0x01
//! 1       1     flags: bits 0-1 QoS (0 or 1), bit 2 retain, other bits 0
//! 2       8     received: microseconds since the Unix epoch when the gateway read it
//! 10      2     device id length D (u16)
//! 12      2     topic length T (u16)
//! 14      D     device id (UTF-8, may be empty)
//! 14+D    T     topic (UTF-8, not empty)
//! 14+D+T  ...   payload (the rest)
//! ```
//! [`decode`] is strict: a wrong version, unknown flag bits, QoS 2 or 3, lengths past the end,
//! invalid UTF-8 or an empty topic are errors, never panics.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes};
use bytestring::ByteString;
use sluice_proto::mqtt::QoS;

/// Format version written by [`encode_into`].
pub const VERSION: u8 = 1;
/// Bytes before the device id.
pub const HEADER_LEN: usize = 14;

/// The `received` field of an encoded body (µs since the Unix epoch), without decoding the
/// rest; `None` for a body shorter than the header.
pub fn received_micros(body: &[u8]) -> Option<u64> {
    let b: [u8; 8] = body.get(2..10)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

/// One device message as stored in the spool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub device: ByteString,
    pub topic: ByteString,
    /// `AtMostOnce` or `AtLeastOnce` (QoS 2 is stored as 1, as the uplink sends it).
    pub qos: QoS,
    pub retain: bool,
    /// When the gateway read it from the device.
    pub received: SystemTime,
    pub payload: Bytes,
}

/// Why a record body is not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record body is {0} bytes, shorter than the 14-byte header")]
    Truncated(usize),
    #[error("record version {0} is not supported (expected 1)")]
    Version(u8),
    #[error("record flags {0:#04x} have unknown bits or QoS above 1")]
    Flags(u8),
    #[error("record lengths (device {device}, topic {topic}) run past the body ({len} bytes)")]
    Lengths {
        device: usize,
        topic: usize,
        len: usize,
    },
    #[error("record {0} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("record topic is empty")]
    EmptyTopic,
    #[error("record {0} is longer than 65535 bytes")]
    TooLong(&'static str),
}

impl Record {
    /// Bytes [`encode_into`] writes for this record.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.device.len() + self.topic.len() + self.payload.len()
    }
}

/// Appends the encoding of `r` to `out`.
pub fn encode_into(r: &Record, out: &mut Vec<u8>) -> Result<(), RecordError> {
    let device = u16::try_from(r.device.len()).map_err(|_| RecordError::TooLong("device id"))?;
    let topic = u16::try_from(r.topic.len()).map_err(|_| RecordError::TooLong("topic"))?;
    let qos = match r.qos {
        QoS::AtMostOnce => 0u8,
        _ => 1u8,
    };
    let micros = r
        .received
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    out.reserve(r.encoded_len());
    out.put_u8(VERSION);
    out.put_u8(qos | (u8::from(r.retain) << 2));
    out.put_u64_le(micros);
    out.put_u16_le(device);
    out.put_u16_le(topic);
    out.extend_from_slice(r.device.as_bytes());
    out.extend_from_slice(r.topic.as_bytes());
    out.extend_from_slice(&r.payload);
    Ok(())
}

/// Decodes a record body; the payload shares `body`'s memory.
pub fn decode(body: &Bytes) -> Result<Record, RecordError> {
    let b = &body[..];
    if b.len() < HEADER_LEN {
        return Err(RecordError::Truncated(b.len()));
    }
    if b[0] != VERSION {
        return Err(RecordError::Version(b[0]));
    }
    let flags = b[1];
    if flags & !0b111 != 0 || flags & 0b11 > 1 {
        return Err(RecordError::Flags(flags));
    }
    let mut micros = [0u8; 8];
    micros.copy_from_slice(&b[2..10]);
    let micros = u64::from_le_bytes(micros);
    let device = usize::from(u16::from_le_bytes([b[10], b[11]]));
    let topic = usize::from(u16::from_le_bytes([b[12], b[13]]));
    let topic_end = HEADER_LEN + device + topic;
    if topic_end > b.len() {
        return Err(RecordError::Lengths {
            device,
            topic,
            len: b.len(),
        });
    }
    let device_id = ByteString::try_from(body.slice(HEADER_LEN..HEADER_LEN + device))
        .map_err(|_| RecordError::NotUtf8("device id"))?;
    let topic_name = ByteString::try_from(body.slice(HEADER_LEN + device..topic_end))
        .map_err(|_| RecordError::NotUtf8("topic"))?;
    if topic_name.is_empty() {
        return Err(RecordError::EmptyTopic);
    }
    Ok(Record {
        device: device_id,
        topic: topic_name,
        qos: if flags & 0b11 == 0 {
            QoS::AtMostOnce
        } else {
            QoS::AtLeastOnce
        },
        retain: flags & 0b100 != 0,
        received: UNIX_EPOCH + Duration::from_micros(micros),
        payload: body.slice(topic_end..),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(
        device: &str,
        topic: &str,
        payload: &[u8],
        qos: QoS,
        retain: bool,
        micros: u64,
    ) -> Record {
        Record {
            device: ByteString::from(device),
            topic: ByteString::from(topic),
            qos,
            retain,
            received: UNIX_EPOCH + Duration::from_micros(micros),
            payload: Bytes::copy_from_slice(payload),
        }
    }

    fn encoded(r: &Record) -> Bytes {
        let mut v = Vec::new();
        encode_into(r, &mut v).expect("encodes");
        Bytes::from(v)
    }

    #[test]
    fn golden_vector_decodes_to_its_record() {
        let bytes =
            Bytes::from_static(b"\x01\x05\x40\x42\x0f\x00\x00\x00\x00\x00\x02\x00\x03\x00d1t/xhi");
        let r = decode(&bytes).expect("valid");
        assert_eq!(
            r,
            record("d1", "t/x", b"hi", QoS::AtLeastOnce, true, 1_000_000)
        );
        assert_eq!(encoded(&r), bytes);
    }

    #[test]
    fn bad_bodies_are_errors_not_panics() {
        let good = encoded(&record("d", "t", b"p", QoS::AtLeastOnce, false, 5));
        assert_eq!(decode(&good.slice(..5)), Err(RecordError::Truncated(5)));
        let mut v = good.to_vec();
        v[0] = 2;
        assert_eq!(decode(&Bytes::from(v)), Err(RecordError::Version(2)));
        for flags in [0b11u8, 0b10, 0b1000, 0x80] {
            let mut v = good.to_vec();
            v[1] = flags;
            assert_eq!(decode(&Bytes::from(v)), Err(RecordError::Flags(flags)));
        }
        let mut v = good.to_vec();
        v[12] = 200;
        assert!(matches!(
            decode(&Bytes::from(v)),
            Err(RecordError::Lengths { .. })
        ));
        let mut v = good.to_vec();
        v[14] = 0xff;
        assert_eq!(
            decode(&Bytes::from(v)),
            Err(RecordError::NotUtf8("device id"))
        );
        let empty_topic = encoded(&record("d", "x", b"", QoS::AtMostOnce, false, 0));
        let mut v = empty_topic.to_vec();
        v[12] = 0;
        // The topic byte becomes payload; the topic is empty.
        assert_eq!(decode(&Bytes::from(v)), Err(RecordError::EmptyTopic));
    }

    #[test]
    fn every_truncation_of_a_valid_body_is_an_error_or_a_shorter_payload() {
        let r = record("dev-1", "a/b", b"payload", QoS::AtLeastOnce, false, 42);
        let b = encoded(&r);
        for cut in 0..b.len() {
            match decode(&b.slice(..cut)) {
                Err(_) => assert!(cut < HEADER_LEN + 5 + 3),
                Ok(d) => assert_eq!(d.payload, r.payload.slice(..cut - (HEADER_LEN + 8))),
            }
        }
    }

    proptest! {
        #[test]
        fn round_trips(device in "[a-z0-9-]{0,40}", topic in "[a-z/]{1,60}", payload in proptest::collection::vec(any::<u8>(), 0..300),
                       qos1 in any::<bool>(), retain in any::<bool>(), micros in 0u64..(1u64 << 60)) {
            let qos = if qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
            let r = record(&device, &topic, &payload, qos, retain, micros);
            let b = encoded(&r);
            prop_assert_eq!(b.len(), r.encoded_len());
            prop_assert_eq!(decode(&b).expect("decodes"), r);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&Bytes::from(bytes));
        }
    }
}
