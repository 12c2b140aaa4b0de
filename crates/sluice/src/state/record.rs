//! State records: one change to the retained store or to a persistent session, and its bytes.
//!
//! Owns: the [`Record`] type, its body encoding ([`Record::encode`], [`Record::decode`]) and
//! the frame around each body ([`encode_frame`], [`next_frame`]). Does not own: files (see
//! `store`) or what a record does to the state (see `image`).
//!
//! Frame layout (the spool's, `sluice-spool/src/frame.rs`, all integers little-endian):
//! ```text
//! 0..4   crc32c over bytes 4..16+len
//! 4..8   len: u32, body length
//! 8..16  seq: u64, the record's number in its file (0, 1, 2, ...)
//! 16..   body: kind u8, then the kind's fields
//! ```
//! Body fields: strings are `u16 len + UTF-8`; a message is `u32 len + an MQTT 5 PUBLISH`
//! (encoded by `sluice-proto`, packet id 1 when QoS > 0, so topic, payload, QoS, retain and
//! every property round-trip through the codec the edges already fuzz) then its expiry
//! (`u8 0` none, or `u8 1 + i64` milliseconds on the writer's monotonic clock, see
//! `StateClock`); deadlines are such `i64`s too.
//!
//! Invariants: `decode(encode(r)) == r`; no input makes [`Record::decode`] or [`next_frame`]
//! panic or allocate more than the input's length; a frame whose checksum, length or body
//! does not check is reported, never half-applied.

use bytes::{BufMut, Bytes, BytesMut};
use bytestring::ByteString;
use sluice_proto::mqtt::{
    encode, Decoder, Packet, Properties, ProtocolVersion, Publish, QoS, SubscriptionOptions,
};

/// Milliseconds on the writer's monotonic clock (`StateClock`); may be negative (before it
/// started). Converted to and from `Instant`s at the edges of the state module only.
pub type MonoMs = i64;

/// Length of a frame header (crc, len, seq).
pub const FRAME_HEADER_LEN: usize = 16;
/// Largest record body accepted when reading (a message is at most `mqtt.max_packet_size`,
/// which validation caps well below this).
pub const MAX_BODY: usize = 512 << 20;

/// A message as a state file keeps it: retained, queued for a device, in flight, or a will.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    pub topic: ByteString,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    pub properties: Option<Box<Properties>>,
    pub expires_at: Option<MonoMs>,
}

/// One change. Every change names the session (MQTT client id) it applies to, except the
/// retained store's and the clock.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Opens each commit batch and snapshot: the writer's monotonic and wall-clock time then.
    Clock { mono_ms: MonoMs, wall_ms: u64 },
    /// Store a retained message; an empty payload deletes the topic's.
    Retain(StoredMessage),
    /// A device connected to a persistent session (created if new); a reconnect cancels a
    /// pending will.
    SessionOpen { client: ByteString, expiry_s: u32 },
    /// The device disconnected; the session ends at `expires_at`.
    SessionOffline {
        client: ByteString,
        expires_at: MonoMs,
    },
    /// The session ended (expired, replaced by a clean start, or no longer persistent).
    SessionEnd { client: ByteString },
    Subscribe {
        client: ByteString,
        filter: ByteString,
        options: SubscriptionOptions,
        sub_id: u32,
    },
    Unsubscribe {
        client: ByteString,
        filter: ByteString,
    },
    /// A QoS 1/2 message joins the back of the session's outbox.
    Enqueue {
        client: ByteString,
        msg: StoredMessage,
    },
    /// The outbox's front message left the session (expired, too large) without being sent.
    PopOutbox { client: ByteString },
    /// The outbox's front message was written to the device under `packet_id`.
    Send { client: ByteString, packet_id: u16 },
    /// QoS 2 out: PUBREC received, PUBREL written.
    Released { client: ByteString, packet_id: u16 },
    /// An in-flight message left the session (PUBACK, PUBCOMP, refused).
    Acked { client: ByteString, packet_id: u16 },
    /// QoS 2 in: PUBREC written for `packet_id`; at most `bound` ids are kept.
    AwaitRel {
        client: ByteString,
        packet_id: u16,
        bound: u16,
    },
    /// QoS 2 in: PUBREL received for `packet_id`.
    RelDone { client: ByteString, packet_id: u16 },
    /// A delayed will waits until `publish_at` (MQTT 5 Will Delay Interval).
    Will {
        client: ByteString,
        msg: StoredMessage,
        publish_at: MonoMs,
    },
    /// The pending will was published or cancelled.
    WillDone { client: ByteString },
    /// Every queued and in-flight message of the session was dropped.
    DropQueued { client: ByteString },
}

/// Why a body did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record body ends early")]
    Short,
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    #[error("a string in the record is not UTF-8")]
    NotUtf8,
    #[error("bad value {0} in the record")]
    BadValue(u8),
    #[error("the record's message is not a valid PUBLISH")]
    BadMessage,
    #[error("{0} bytes after the record's last field")]
    Trailing(usize),
}

const CLOCK: u8 = 1;
const RETAIN: u8 = 2;
const SESSION_OPEN: u8 = 3;
const SESSION_OFFLINE: u8 = 4;
const SESSION_END: u8 = 5;
const SUBSCRIBE: u8 = 6;
const UNSUBSCRIBE: u8 = 7;
const ENQUEUE: u8 = 8;
const POP_OUTBOX: u8 = 9;
const SEND: u8 = 10;
const RELEASED: u8 = 11;
const ACKED: u8 = 12;
const AWAIT_REL: u8 = 13;
const REL_DONE: u8 = 14;
const WILL: u8 = 15;
const WILL_DONE: u8 = 16;
const DROP_QUEUED: u8 = 17;

impl Record {
    /// The body bytes of this record, appended to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            Record::Clock { mono_ms, wall_ms } => {
                out.put_u8(CLOCK);
                out.put_i64_le(*mono_ms);
                out.put_u64_le(*wall_ms);
            }
            Record::Retain(m) => {
                out.put_u8(RETAIN);
                put_msg(out, m);
            }
            Record::SessionOpen { client, expiry_s } => {
                out.put_u8(SESSION_OPEN);
                put_str(out, client);
                out.put_u32_le(*expiry_s);
            }
            Record::SessionOffline { client, expires_at } => {
                out.put_u8(SESSION_OFFLINE);
                put_str(out, client);
                out.put_i64_le(*expires_at);
            }
            Record::SessionEnd { client } => client_only(out, SESSION_END, client),
            Record::Subscribe {
                client,
                filter,
                options,
                sub_id,
            } => {
                out.put_u8(SUBSCRIBE);
                put_str(out, client);
                put_str(out, filter);
                out.put_u8(
                    options.qos as u8
                        | (options.no_local as u8) << 2
                        | (options.retain_as_published as u8) << 3
                        | (options.retain_handling & 3) << 4,
                );
                out.put_u32_le(*sub_id);
            }
            Record::Unsubscribe { client, filter } => {
                out.put_u8(UNSUBSCRIBE);
                put_str(out, client);
                put_str(out, filter);
            }
            Record::Enqueue { client, msg } => {
                out.put_u8(ENQUEUE);
                put_str(out, client);
                put_msg(out, msg);
            }
            Record::PopOutbox { client } => client_only(out, POP_OUTBOX, client),
            Record::Send { client, packet_id } => client_id(out, SEND, client, *packet_id),
            Record::Released { client, packet_id } => client_id(out, RELEASED, client, *packet_id),
            Record::Acked { client, packet_id } => client_id(out, ACKED, client, *packet_id),
            Record::AwaitRel {
                client,
                packet_id,
                bound,
            } => {
                client_id(out, AWAIT_REL, client, *packet_id);
                out.put_u16_le(*bound);
            }
            Record::RelDone { client, packet_id } => client_id(out, REL_DONE, client, *packet_id),
            Record::Will {
                client,
                msg,
                publish_at,
            } => {
                out.put_u8(WILL);
                put_str(out, client);
                put_msg(out, msg);
                out.put_i64_le(*publish_at);
            }
            Record::WillDone { client } => client_only(out, WILL_DONE, client),
            Record::DropQueued { client } => client_only(out, DROP_QUEUED, client),
        }
    }

    /// The record in `body` (exactly one body, as a frame carries it).
    pub fn decode(body: &[u8]) -> Result<Record, RecordError> {
        let mut r = Reader { b: body };
        let kind = r.u8()?;
        let rec = match kind {
            CLOCK => Record::Clock {
                mono_ms: r.i64()?,
                wall_ms: r.u64()?,
            },
            RETAIN => Record::Retain(r.msg()?),
            SESSION_OPEN => Record::SessionOpen {
                client: r.str()?,
                expiry_s: r.u32()?,
            },
            SESSION_OFFLINE => Record::SessionOffline {
                client: r.str()?,
                expires_at: r.i64()?,
            },
            SESSION_END => Record::SessionEnd { client: r.str()? },
            SUBSCRIBE => {
                let client = r.str()?;
                let filter = r.str()?;
                let bits = r.u8()?;
                if bits & 0xC0 != 0 {
                    return Err(RecordError::BadValue(bits));
                }
                let qos = QoS::from_u8(bits & 3).ok_or(RecordError::BadValue(bits))?;
                let options = SubscriptionOptions {
                    qos,
                    no_local: bits & 4 != 0,
                    retain_as_published: bits & 8 != 0,
                    retain_handling: (bits >> 4) & 3,
                };
                Record::Subscribe {
                    client,
                    filter,
                    options,
                    sub_id: r.u32()?,
                }
            }
            UNSUBSCRIBE => Record::Unsubscribe {
                client: r.str()?,
                filter: r.str()?,
            },
            ENQUEUE => Record::Enqueue {
                client: r.str()?,
                msg: r.msg()?,
            },
            POP_OUTBOX => Record::PopOutbox { client: r.str()? },
            SEND => Record::Send {
                client: r.str()?,
                packet_id: r.u16()?,
            },
            RELEASED => Record::Released {
                client: r.str()?,
                packet_id: r.u16()?,
            },
            ACKED => Record::Acked {
                client: r.str()?,
                packet_id: r.u16()?,
            },
            AWAIT_REL => Record::AwaitRel {
                client: r.str()?,
                packet_id: r.u16()?,
                bound: r.u16()?,
            },
            REL_DONE => Record::RelDone {
                client: r.str()?,
                packet_id: r.u16()?,
            },
            WILL => Record::Will {
                client: r.str()?,
                msg: r.msg()?,
                publish_at: r.i64()?,
            },
            WILL_DONE => Record::WillDone { client: r.str()? },
            DROP_QUEUED => Record::DropQueued { client: r.str()? },
            other => return Err(RecordError::UnknownKind(other)),
        };
        if !r.b.is_empty() {
            return Err(RecordError::Trailing(r.b.len()));
        }
        Ok(rec)
    }

    /// Bytes this record is charged while it waits for the writer (`state.max_pending`).
    pub fn pending_cost(&self) -> usize {
        let msg = |m: &StoredMessage| m.topic.len() + m.payload.len() + 64;
        64 + match self {
            Record::Retain(m) => msg(m),
            Record::Enqueue { msg: m, .. } | Record::Will { msg: m, .. } => msg(m),
            Record::Subscribe { filter, .. } | Record::Unsubscribe { filter, .. } => filter.len(),
            _ => 0,
        }
    }
}

/// Append the frame for `record` (numbered `seq`) to `out`.
pub fn encode_frame(out: &mut BytesMut, seq: u64, record: &Record) {
    let start = out.len();
    out.put_bytes(0, FRAME_HEADER_LEN);
    record.encode(out);
    let len = (out.len() - start - FRAME_HEADER_LEN) as u32;
    out[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
    out[start + 8..start + 16].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32c::crc32c(&out[start + 4..]);
    out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
}

/// What the front of a byte run holds.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// A whole frame whose checksum matches: its record (or why its body is bad), the seq it
    /// carries and its length in bytes.
    Record {
        record: Result<Record, RecordError>,
        seq: u64,
        len: usize,
    },
    /// Nothing left.
    End,
    /// A frame cut short, or bytes that are not a frame (bad checksum, absurd length): the
    /// torn tail of a log, or damage. Nothing after it is trusted.
    Torn,
}

/// Read the frame at the front of `b`.
pub fn next_frame(b: &[u8]) -> Frame {
    if b.is_empty() {
        return Frame::End;
    }
    let Some(h) = b.get(..FRAME_HEADER_LEN) else {
        return Frame::Torn;
    };
    let crc = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    let seq = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
    if len > MAX_BODY {
        return Frame::Torn;
    }
    let Some(frame) = b.get(..FRAME_HEADER_LEN + len) else {
        return Frame::Torn;
    };
    if crc32c::crc32c(&frame[4..]) != crc {
        return Frame::Torn;
    }
    Frame::Record {
        record: Record::decode(&frame[FRAME_HEADER_LEN..]),
        seq,
        len: frame.len(),
    }
}

fn client_only(out: &mut BytesMut, kind: u8, client: &str) {
    out.put_u8(kind);
    put_str(out, client);
}

fn client_id(out: &mut BytesMut, kind: u8, client: &str, id: u16) {
    out.put_u8(kind);
    put_str(out, client);
    out.put_u16_le(id);
}

fn put_str(out: &mut BytesMut, s: &str) {
    // Client ids, topics and filters are at most 65,535 bytes (MQTT strings).
    let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.put_u16_le(b.len() as u16);
    out.put_slice(b);
}

fn put_msg(out: &mut BytesMut, m: &StoredMessage) {
    let at = out.len();
    out.put_u32_le(0);
    let publish = Publish {
        dup: false,
        qos: m.qos,
        retain: m.retain,
        topic: m.topic.clone(),
        packet_id: (m.qos != QoS::AtMostOnce).then_some(1),
        properties: m.properties.clone(),
        payload: m.payload.clone(),
    };
    // Invariant: a message the gateway holds was decoded (or built) within the codec's
    // limits, so it encodes; were it not, an empty PUBLISH body would fail to decode and the
    // record would be skipped on load, never misread.
    let _ = encode(&Packet::Publish(publish), ProtocolVersion::V5, out);
    let len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    match m.expires_at {
        None => out.put_u8(0),
        Some(t) => {
            out.put_u8(1);
            out.put_i64_le(t);
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        if self.b.len() < n {
            return Err(RecordError::Short);
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, RecordError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, RecordError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, RecordError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn i64(&mut self) -> Result<i64, RecordError> {
        Ok(self.u64()? as i64)
    }
    fn str(&mut self) -> Result<ByteString, RecordError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        let s = std::str::from_utf8(b).map_err(|_| RecordError::NotUtf8)?;
        Ok(ByteString::from(s))
    }
    fn msg(&mut self) -> Result<StoredMessage, RecordError> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        let mut buf = BytesMut::from(b);
        let mut decoder = Decoder::client(ProtocolVersion::V5, b.len().max(2));
        let publish = match decoder.decode(&mut buf) {
            Ok(Some(Packet::Publish(p))) if buf.is_empty() && !p.topic.is_empty() => p,
            _ => return Err(RecordError::BadMessage),
        };
        let expires_at = match self.u8()? {
            0 => None,
            1 => Some(self.i64()?),
            other => return Err(RecordError::BadValue(other)),
        };
        Ok(StoredMessage {
            topic: publish.topic,
            payload: publish.payload,
            qos: publish.qos,
            retain: publish.retain,
            properties: publish.properties,
            expires_at,
        })
    }
}
