//! Kafka's framing: a request is a 4-byte length, the request header (api key, version,
//! correlation id, client id) and the body, encoded with the `kafka-protocol` codec; a
//! response is a 4-byte length, the response header (correlation id, then tagged fields for a
//! flexible answer) and the body, decoded by sluice's own bounded decoders (`answers.rs`;
//! `kafka-protocol`'s preallocate arrays from counts on the wire).
//!
//! Owns: encoding requests into a write buffer, cutting responses out of a read buffer within
//! [`MAX_RESPONSE`], the response header, and what a broker's error code means for a record
//! ([`classify`]). Does not own: which requests to send (the transport), the request schemas
//! (`kafka-protocol`) or the answer bodies (`answers.rs`).
//!
//! The versions sluice speaks are fixed ([`METADATA_V`], [`INIT_PRODUCER_ID_V`],
//! [`PRODUCE_V`]): every broker since Kafka 3.0 takes them.

use bytes::{Buf, BufMut, BytesMut};
use kafka_protocol::messages::{ApiKey, RequestHeader};
use kafka_protocol::protocol::{Encodable, HeaderVersion, StrBytes};

use super::answers::{Answer, Reader};

use crate::sink::transport::RefusalClass;
use crate::sink::RejectReason;

/// Metadata v9: flexible, topic names (v10+ adds topic ids, which sluice does not need).
pub const METADATA_V: i16 = 9;
/// InitProducerId v4: producer id and epoch in the request (epoch bumps, KIP-360).
pub const INIT_PRODUCER_ID_V: i16 = 4;
/// Produce v9: flexible, topic names (v13 switches to topic ids).
pub const PRODUCE_V: i16 = 9;
/// The largest response sluice reads (a Metadata answer for a big cluster stays far below).
pub const MAX_RESPONSE: usize = 8 * 1024 * 1024;

/// A malformed or unexpected answer from a broker: the connection is dropped.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("a response of {0} bytes exceeds the {MAX_RESPONSE}-byte bound")]
    TooLarge(usize),
    #[error("cannot decode the {what}: {detail}")]
    Decode { what: &'static str, detail: String },
    #[error("cannot encode the {what}: {detail}")]
    Encode { what: &'static str, detail: String },
}

/// Append one request (length, header, body) to `out`.
pub fn encode_request<R: Encodable + HeaderVersion>(
    out: &mut BytesMut,
    key: ApiKey,
    version: i16,
    correlation_id: i32,
    client_id: &StrBytes,
    body: &R,
) -> Result<(), WireError> {
    let start = out.len();
    out.put_u32(0);
    let mut header = RequestHeader::default();
    header.request_api_key = key as i16;
    header.request_api_version = version;
    header.correlation_id = correlation_id;
    header.client_id = Some(client_id.clone());
    let encoded = header
        .encode(out, R::header_version(version))
        .and_then(|()| body.encode(out, version));
    if let Err(e) = encoded {
        out.truncate(start);
        return Err(WireError::Encode {
            what: "request",
            detail: e.to_string(),
        });
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// Take the next complete response out of `rbuf`: its correlation id and body (header
/// removed; `key`/`version` of the request it answers name the header's version). `Ok(None)`:
/// not complete yet. The caller looks the correlation id up to know `key` and `version`, so
/// this is split in two: [`next_frame`] then [`split_header`].
pub fn next_frame(rbuf: &mut BytesMut) -> Result<Option<BytesMut>, WireError> {
    if rbuf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([rbuf[0], rbuf[1], rbuf[2], rbuf[3]]) as usize;
    if len > MAX_RESPONSE {
        return Err(WireError::TooLarge(len));
    }
    if rbuf.len() < 4 + len {
        rbuf.reserve(4 + len - rbuf.len());
        return Ok(None);
    }
    rbuf.advance(4);
    Ok(Some(rbuf.split_to(len)))
}

/// The correlation id at the front of a response frame (the same place in every header
/// version), without consuming it.
pub fn peek_correlation_id(frame: &[u8]) -> Result<i32, WireError> {
    frame
        .get(..4)
        .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(WireError::Decode {
            what: "response header",
            detail: "shorter than a correlation id".into(),
        })
}

/// Decode a response frame: its header (v1 with tagged fields for a flexible answer, v0
/// otherwise) and then the body, with sluice's bounded decoders (`answers.rs`).
pub fn decode_response<A: Answer>(frame: &[u8], what: &'static str) -> Result<A, WireError> {
    let mut r = Reader::new(frame, what);
    r.i32()?; // correlation id, already matched by the caller
    if A::FLEXIBLE {
        r.tagged_fields()?;
    }
    A::read(&mut r)
}

/// What a broker's error code for a partition's records means (0 is success and never asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The cluster changed under us (leader moved, broker gone, replicas short, our producer
    /// id or sequence no longer known): reconnect, learn the cluster again and resend in
    /// order. At-least-once: the records may be stored already.
    Reconnect,
    /// These records can never be taken (too large, invalid, not allowed): the device gets
    /// the code.
    Refuse { code: u8, class: RefusalClass },
}

/// Kafka error codes (`org.apache.kafka.common.protocol.Errors`) a Produce answer may carry.
pub mod code {
    pub const CORRUPT_MESSAGE: i16 = 2;
    pub const UNKNOWN_TOPIC_OR_PARTITION: i16 = 3;
    pub const LEADER_NOT_AVAILABLE: i16 = 5;
    pub const NOT_LEADER_OR_FOLLOWER: i16 = 6;
    pub const REQUEST_TIMED_OUT: i16 = 7;
    pub const MESSAGE_TOO_LARGE: i16 = 10;
    pub const INVALID_TOPIC: i16 = 17;
    pub const RECORD_LIST_TOO_LARGE: i16 = 18;
    pub const NOT_ENOUGH_REPLICAS: i16 = 19;
    pub const NOT_ENOUGH_REPLICAS_AFTER_APPEND: i16 = 20;
    pub const TOPIC_AUTHORIZATION_FAILED: i16 = 29;
    pub const CLUSTER_AUTHORIZATION_FAILED: i16 = 31;
    pub const UNSUPPORTED_FOR_MESSAGE_FORMAT: i16 = 43;
    pub const OUT_OF_ORDER_SEQUENCE_NUMBER: i16 = 45;
    pub const DUPLICATE_SEQUENCE_NUMBER: i16 = 46;
    pub const INVALID_PRODUCER_EPOCH: i16 = 47;
    pub const UNKNOWN_PRODUCER_ID: i16 = 59;
    pub const KAFKA_STORAGE_ERROR: i16 = 56;
    pub const INVALID_RECORD: i16 = 87;
}

/// The table (see [`Outcome`]): codes Kafka calls retriable, and the idempotent producer's
/// own (`OUT_OF_ORDER_SEQUENCE_NUMBER`, `UNKNOWN_PRODUCER_ID`, `INVALID_PRODUCER_EPOCH`),
/// reconnect; size and validity refusals are permanent with MQTT 5's 0x95 (packet too large),
/// 0x90 (topic name invalid) or 0x99 (payload format invalid); authorization is permanent
/// with 0x87 (not authorized);
/// anything else is an unclear refusal with 0x80, retried until it persists.
pub fn classify(error_code: i16) -> Outcome {
    use code::*;
    use kafka_protocol::error::ParseResponseErrorCode;
    match error_code {
        MESSAGE_TOO_LARGE | RECORD_LIST_TOO_LARGE => Outcome::Refuse {
            code: 0x95,
            class: RefusalClass::Permanent(RejectReason::Other),
        },
        INVALID_TOPIC => Outcome::Refuse {
            code: 0x90,
            class: RefusalClass::Permanent(RejectReason::TopicNameInvalid),
        },
        CORRUPT_MESSAGE | INVALID_RECORD | UNSUPPORTED_FOR_MESSAGE_FORMAT => Outcome::Refuse {
            code: 0x99,
            class: RefusalClass::Permanent(RejectReason::PayloadFormatInvalid),
        },
        TOPIC_AUTHORIZATION_FAILED | CLUSTER_AUTHORIZATION_FAILED => Outcome::Refuse {
            code: 0x87,
            class: RefusalClass::Permanent(RejectReason::NotAuthorized),
        },
        OUT_OF_ORDER_SEQUENCE_NUMBER | UNKNOWN_PRODUCER_ID | INVALID_PRODUCER_EPOCH => {
            Outcome::Reconnect
        }
        other => match other.err() {
            Some(e) if e.is_retriable() => Outcome::Reconnect,
            _ => Outcome::Refuse {
                code: 0x80,
                class: RefusalClass::Unclear,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::kafka::answers::MetadataAnswer;
    use kafka_protocol::messages::MetadataRequest;
    use kafka_protocol::protocol::Decodable;

    #[test]
    fn a_request_is_framed_with_its_length_and_header() {
        let mut out = BytesMut::new();
        let client = StrBytes::from_static_str("sluice");
        encode_request(
            &mut out,
            ApiKey::Metadata,
            METADATA_V,
            7,
            &client,
            &MetadataRequest::default(),
        )
        .unwrap();
        let len = u32::from_be_bytes(out[..4].try_into().unwrap()) as usize;
        assert_eq!(len, out.len() - 4);
        let mut body = out.split_off(4);
        let header = RequestHeader::decode(&mut body, 2).unwrap();
        assert_eq!(header.request_api_key, ApiKey::Metadata as i16);
        assert_eq!(header.request_api_version, METADATA_V);
        assert_eq!(header.correlation_id, 7);
        assert_eq!(header.client_id.as_deref(), Some("sluice"));
    }

    #[test]
    fn frames_are_cut_only_when_complete_and_within_the_bound() {
        // A Metadata v9 answer to request 42, written out by hand (header v1: correlation id,
        // no tagged fields; body: throttle 5 ms, no brokers, null cluster id, controller 1,
        // no topics, authorized operations unset, no tagged fields).
        let body: &[u8] = &[
            0, 0, 0, 42, 0, // header
            0, 0, 0, 5, 1, 0, 0, 0, 0, 1, 1, 0x80, 0, 0, 0, 0,
        ];
        let mut resp = BytesMut::new();
        resp.put_u32(body.len() as u32);
        resp.extend_from_slice(body);
        // Byte by byte: nothing until the last byte arrives.
        let mut rbuf = BytesMut::new();
        for (i, b) in resp.iter().enumerate() {
            rbuf.put_u8(*b);
            let got = next_frame(&mut rbuf).unwrap();
            if i + 1 < resp.len() {
                assert!(got.is_none());
            } else {
                let frame = got.unwrap();
                assert_eq!(peek_correlation_id(&frame).unwrap(), 42);
                let m: MetadataAnswer = decode_response(&frame, "metadata").unwrap();
                assert_eq!(m, MetadataAnswer::default());
            }
        }
        let mut huge = BytesMut::new();
        huge.put_u32(MAX_RESPONSE as u32 + 1);
        assert!(matches!(next_frame(&mut huge), Err(WireError::TooLarge(_))));
    }

    #[test]
    fn error_codes_reconnect_or_refuse_as_the_table_says() {
        assert_eq!(classify(code::NOT_LEADER_OR_FOLLOWER), Outcome::Reconnect);
        assert_eq!(classify(code::NOT_ENOUGH_REPLICAS), Outcome::Reconnect);
        assert_eq!(
            classify(code::OUT_OF_ORDER_SEQUENCE_NUMBER),
            Outcome::Reconnect
        );
        assert_eq!(classify(code::UNKNOWN_PRODUCER_ID), Outcome::Reconnect);
        assert!(matches!(
            classify(code::MESSAGE_TOO_LARGE),
            Outcome::Refuse { code: 0x95, .. }
        ));
        assert!(matches!(
            classify(code::TOPIC_AUTHORIZATION_FAILED),
            Outcome::Refuse { code: 0x87, .. }
        ));
        assert!(matches!(
            classify(-1),
            Outcome::Refuse {
                class: RefusalClass::Unclear,
                ..
            }
        ));
    }

    proptest::proptest! {
        /// Whatever a broker sends, cutting and decoding frames never panics.
        #[test]
        fn any_bytes_are_cut_or_refused_without_panicking(bytes: Vec<u8>) {
            let mut rbuf = BytesMut::from(&bytes[..]);
            while let Ok(Some(frame)) = next_frame(&mut rbuf) {
                let _ = peek_correlation_id(&frame);
                let _: Result<MetadataAnswer, _> = decode_response(&frame, "metadata");
            }
        }
    }
}
