//! The five broker answers the Kafka uplink reads, decoded by sluice itself: Metadata v9,
//! Produce v9, InitProducerId v4, SaslHandshake v1 and SaslAuthenticate v2 (bodies; the
//! response header is `wire::decode_response`'s, through the same [`Reader`]).
//!
//! Owns: the wire layout of those bodies (Kafka's JSON message schemas at these versions) and
//! the plain structs holding what the transport reads from them. Does not own: framing (the
//! 4-byte length and the `MAX_RESPONSE` bound, `wire.rs`), requests and record batches (still
//! encoded with `kafka-protocol`), or what the answers mean (`mod.rs`, `conn.rs`,
//! `produce.rs`).
//!
//! Why not `kafka-protocol`'s decoders: they size every array with `Vec::with_capacity(count)`
//! from the count on the wire before reading an element, so an answer declaring a huge array
//! aborts the process on allocation failure (fuzz target `kafka_response`; ADR 0017).
//!
//! # Invariants
//! - Every count and length read off the wire is checked against the bytes left in the frame
//!   before anything is allocated or skipped: an array of `n` elements of at least `m` bytes
//!   each needs `n * m` bytes left, a string or byte field of `n` bytes needs `n`. A count that
//!   cannot fit is [`WireError::Decode`], never an allocation. So a frame of `b` bytes
//!   allocates at most a small multiple of `b` (the largest struct per least encoded size).
//! - Nothing here panics on any input (property test and fuzz target); nothing reads past the
//!   frame.
//! - Fields sluice does not use are read and skipped (rack, cluster id, replica lists, epochs,
//!   authorized operations, record errors, tagged fields), so the fields after them are read
//!   at the right place. Bytes after the last field are ignored, as Kafka's own clients do.
//!
//! # Encodings (flexible versions, KIP-482)
//! Compact arrays, strings and bytes: an unsigned varint holding length + 1 (0 is null).
//! Tagged fields: an unsigned varint count, then per field its tag, its size and its bytes.
//! Non-flexible (SaslHandshake v1): int32 array counts, int16 string lengths (-1 is null).

use bytes::Bytes;
use kafka_protocol::messages::ApiKey;

use super::wire::{WireError, INIT_PRODUCER_ID_V, METADATA_V, PRODUCE_V};

/// SaslHandshake v1: the SaslAuthenticate requests that follow carry the SASL bytes.
pub const SASL_HANDSHAKE_V: i16 = 1;
/// SaslAuthenticate v2: flexible.
pub const SASL_AUTHENTICATE_V: i16 = 2;

/// A broker answer sluice decodes: which request it answers, at which version, and whether
/// that version is flexible (response header v1 with tagged fields, compact encodings).
pub trait Answer: Sized {
    const KEY: ApiKey;
    const VERSION: i16;
    const FLEXIBLE: bool;
    /// Read the body (after the response header).
    fn read(r: &mut Reader<'_>) -> Result<Self, WireError>;
}

/// Metadata v9: the brokers and, per topic asked, its partitions' leaders.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetadataAnswer {
    pub brokers: Vec<MetadataBroker>,
    pub topics: Vec<MetadataTopic>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataBroker {
    pub node_id: i32,
    pub host: String,
    pub port: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataTopic {
    pub error_code: i16,
    /// Not nullable at v9 (nullable from v12); a null is taken as "no name" and the topic
    /// left out, as before.
    pub name: Option<String>,
    pub partitions: Vec<MetadataPartition>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataPartition {
    pub partition_index: i32,
    pub leader_id: i32,
}

/// Produce v9: per topic and partition, whether the batch was taken.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProduceAnswer {
    pub topics: Vec<ProduceTopic>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProduceTopic {
    pub name: String,
    pub partitions: Vec<ProducePartition>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducePartition {
    pub index: i32,
    pub error_code: i16,
    /// The broker's words for a refusal (logged with it).
    pub error_message: Option<String>,
}

/// InitProducerId v4: the idempotent producer's id and epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitProducerIdAnswer {
    pub error_code: i16,
    pub producer_id: i64,
    pub producer_epoch: i16,
}

/// SaslHandshake v1: whether the broker takes the mechanism, and the ones it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaslHandshakeAnswer {
    pub error_code: i16,
    pub mechanisms: Vec<String>,
}

/// SaslAuthenticate v2: the server's SASL bytes, or why it refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaslAuthenticateAnswer {
    pub error_code: i16,
    pub error_message: Option<String>,
    pub auth_bytes: Bytes,
}

// Least encoded sizes of the array elements (flexible versions: a compact string, array or
// tagged-field count is at least one byte), which bound their counts by the bytes left.
/// node_id 4, host 1, port 4, rack 1, tags 1.
const MIN_BROKER: usize = 11;
/// error_code 2, name 1, is_internal 1, partitions 1, authorized operations 4, tags 1.
const MIN_TOPIC: usize = 10;
/// error_code 2, index 4, leader 4, leader epoch 4, replicas 1, isr 1, offline 1, tags 1.
const MIN_PARTITION: usize = 18;
/// name 1, partitions 1, tags 1.
const MIN_PRODUCE_TOPIC: usize = 3;
/// index 4, error_code 2, base offset 8, log append time 8, log start offset 8,
/// record errors 1, error message 1, tags 1.
const MIN_PRODUCE_PARTITION: usize = 33;
/// batch index 4, message 1, tags 1.
const MIN_RECORD_ERROR: usize = 6;
/// An int16 string length.
const MIN_STRING16: usize = 2;

impl Answer for MetadataAnswer {
    const KEY: ApiKey = ApiKey::Metadata;
    const VERSION: i16 = METADATA_V;
    const FLEXIBLE: bool = true;

    fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        r.i32()?; // throttle_time_ms
        let n = r.compact_array(MIN_BROKER)?;
        let mut brokers = Vec::with_capacity(n);
        for _ in 0..n {
            let node_id = r.i32()?;
            let host = r.compact_string()?;
            let port = r.i32()?;
            r.skip_compact_nullable_bytes()?; // rack
            r.tagged_fields()?;
            brokers.push(MetadataBroker {
                node_id,
                host,
                port,
            });
        }
        r.skip_compact_nullable_bytes()?; // cluster_id
        r.i32()?; // controller_id
        let n = r.compact_array(MIN_TOPIC)?;
        let mut topics = Vec::with_capacity(n);
        for _ in 0..n {
            let error_code = r.i16()?;
            let name = r.compact_nullable_string()?;
            r.u8()?; // is_internal
            let n = r.compact_array(MIN_PARTITION)?;
            let mut partitions = Vec::with_capacity(n);
            for _ in 0..n {
                r.i16()?; // error_code (a leader of -1 is what matters)
                let partition_index = r.i32()?;
                let leader_id = r.i32()?;
                r.i32()?; // leader_epoch
                r.skip_compact_array(4)?; // replica_nodes
                r.skip_compact_array(4)?; // isr_nodes
                r.skip_compact_array(4)?; // offline_replicas
                r.tagged_fields()?;
                partitions.push(MetadataPartition {
                    partition_index,
                    leader_id,
                });
            }
            r.i32()?; // topic_authorized_operations
            r.tagged_fields()?;
            topics.push(MetadataTopic {
                error_code,
                name,
                partitions,
            });
        }
        r.i32()?; // cluster_authorized_operations (v8-v10)
        r.tagged_fields()?;
        Ok(MetadataAnswer { brokers, topics })
    }
}

impl Answer for ProduceAnswer {
    const KEY: ApiKey = ApiKey::Produce;
    const VERSION: i16 = PRODUCE_V;
    const FLEXIBLE: bool = true;

    fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let n = r.compact_array(MIN_PRODUCE_TOPIC)?;
        let mut topics = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.compact_string()?;
            let n = r.compact_array(MIN_PRODUCE_PARTITION)?;
            let mut partitions = Vec::with_capacity(n);
            for _ in 0..n {
                let index = r.i32()?;
                let error_code = r.i16()?;
                r.i64()?; // base_offset
                r.i64()?; // log_append_time_ms
                r.i64()?; // log_start_offset
                let errors = r.compact_array(MIN_RECORD_ERROR)?;
                for _ in 0..errors {
                    r.i32()?; // batch_index
                    r.skip_compact_nullable_bytes()?; // batch_index_error_message
                    r.tagged_fields()?;
                }
                let error_message = r.compact_nullable_string()?;
                // current_leader (tag 0) is v10+; at v9 every tag is skipped.
                r.tagged_fields()?;
                partitions.push(ProducePartition {
                    index,
                    error_code,
                    error_message,
                });
            }
            r.tagged_fields()?;
            topics.push(ProduceTopic { name, partitions });
        }
        r.i32()?; // throttle_time_ms
        r.tagged_fields()?;
        Ok(ProduceAnswer { topics })
    }
}

impl Answer for InitProducerIdAnswer {
    const KEY: ApiKey = ApiKey::InitProducerId;
    const VERSION: i16 = INIT_PRODUCER_ID_V;
    const FLEXIBLE: bool = true;

    fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        r.i32()?; // throttle_time_ms
        let error_code = r.i16()?;
        let producer_id = r.i64()?;
        let producer_epoch = r.i16()?;
        r.tagged_fields()?;
        Ok(InitProducerIdAnswer {
            error_code,
            producer_id,
            producer_epoch,
        })
    }
}

impl Answer for SaslHandshakeAnswer {
    const KEY: ApiKey = ApiKey::SaslHandshake;
    const VERSION: i16 = SASL_HANDSHAKE_V;
    const FLEXIBLE: bool = false;

    fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let error_code = r.i16()?;
        let n = r.array(MIN_STRING16)?;
        let mut mechanisms = Vec::with_capacity(n);
        for _ in 0..n {
            mechanisms.push(r.string16()?);
        }
        Ok(SaslHandshakeAnswer {
            error_code,
            mechanisms,
        })
    }
}

impl Answer for SaslAuthenticateAnswer {
    const KEY: ApiKey = ApiKey::SaslAuthenticate;
    const VERSION: i16 = SASL_AUTHENTICATE_V;
    const FLEXIBLE: bool = true;

    fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let error_code = r.i16()?;
        let error_message = r.compact_nullable_string()?;
        let auth_bytes = r.compact_bytes()?;
        r.i64()?; // session_lifetime_ms
        r.tagged_fields()?;
        Ok(SaslAuthenticateAnswer {
            error_code,
            error_message,
            auth_bytes,
        })
    }
}

/// Reads one response frame front to back; never reads past its end, and checks every count
/// and length against the bytes left before allocating or skipping (module invariants).
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, what }
    }

    fn error(&self, detail: String) -> WireError {
        WireError::Decode {
            what: self.what,
            detail,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.buf.len() {
            return Err(self.error(format!(
                "cut short: {n} bytes wanted, {} left",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn array_of<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array_of::<1>()?[0])
    }

    pub fn i16(&mut self) -> Result<i16, WireError> {
        Ok(i16::from_be_bytes(self.array_of()?))
    }

    pub fn i32(&mut self) -> Result<i32, WireError> {
        Ok(i32::from_be_bytes(self.array_of()?))
    }

    pub fn i64(&mut self) -> Result<i64, WireError> {
        Ok(i64::from_be_bytes(self.array_of()?))
    }

    /// An unsigned varint of at most 5 bytes (Kafka's `ByteUtils.readUnsignedVarint`).
    pub fn uvarint(&mut self) -> Result<u32, WireError> {
        let mut value: u32 = 0;
        for i in 0..5 {
            let b = self.u8()?;
            value |= u32::from(b & 0x7f) << (i * 7);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.error("a varint longer than 5 bytes".into()))
    }

    /// A compact length (varint of length + 1; `None` for null), checked to fit in the bytes
    /// left at `min` bytes per unit.
    fn compact_len(&mut self, min: usize) -> Result<Option<usize>, WireError> {
        let Some(n) = (self.uvarint()? as usize).checked_sub(1) else {
            return Ok(None);
        };
        self.fits(n, min)?;
        Ok(Some(n))
    }

    /// `n` units of at least `min` bytes each fit in the bytes left.
    fn fits(&self, n: usize, min: usize) -> Result<(), WireError> {
        match n.checked_mul(min) {
            Some(need) if need <= self.buf.len() => Ok(()),
            _ => Err(self.error(format!(
                "{n} elements of at least {min} bytes do not fit in the {} bytes left",
                self.buf.len()
            ))),
        }
    }

    fn utf8(&self, bytes: &[u8]) -> Result<String, WireError> {
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|e| self.error(format!("a string that is not UTF-8: {e}")))
    }

    /// A compact string that may be null.
    pub fn compact_nullable_string(&mut self) -> Result<Option<String>, WireError> {
        match self.compact_len(1)? {
            None => Ok(None),
            Some(n) => {
                let bytes = self.take(n)?;
                self.utf8(bytes).map(Some)
            }
        }
    }

    /// A compact string that must not be null.
    pub fn compact_string(&mut self) -> Result<String, WireError> {
        self.compact_nullable_string()?
            .ok_or_else(|| self.error("a null where a string is required".into()))
    }

    /// Compact bytes that must not be null.
    pub fn compact_bytes(&mut self) -> Result<Bytes, WireError> {
        match self.compact_len(1)? {
            None => Err(self.error("null where bytes are required".into())),
            Some(n) => Ok(Bytes::copy_from_slice(self.take(n)?)),
        }
    }

    /// A compact string or bytes that may be null, skipped.
    pub fn skip_compact_nullable_bytes(&mut self) -> Result<(), WireError> {
        if let Some(n) = self.compact_len(1)? {
            self.take(n)?;
        }
        Ok(())
    }

    /// The element count of a compact array (not nullable) whose elements take at least
    /// `min` bytes each.
    pub fn compact_array(&mut self, min: usize) -> Result<usize, WireError> {
        self.compact_len(min)?
            .ok_or_else(|| self.error("a null where an array is required".into()))
    }

    /// A compact array of fixed-size elements of `size` bytes (int32 lists), skipped.
    pub fn skip_compact_array(&mut self, size: usize) -> Result<(), WireError> {
        let n = self.compact_array(size)?;
        self.take(n * size)?; // `compact_array` checked that it fits
        Ok(())
    }

    /// The element count of a non-flexible array (int32 count, not nullable) whose elements
    /// take at least `min` bytes each.
    pub fn array(&mut self, min: usize) -> Result<usize, WireError> {
        let n = self.i32()?;
        let Ok(n) = usize::try_from(n) else {
            return Err(self.error(format!("an array of {n} elements")));
        };
        self.fits(n, min)?;
        Ok(n)
    }

    /// A non-flexible string (int16 length, not nullable).
    pub fn string16(&mut self) -> Result<String, WireError> {
        let n = self.i16()?;
        let Ok(n) = usize::try_from(n) else {
            return Err(self.error(format!("a string of {n} bytes")));
        };
        let bytes = self.take(n)?;
        self.utf8(bytes)
    }

    /// A tagged-field section, skipped (none of the tags these versions define is used).
    pub fn tagged_fields(&mut self) -> Result<(), WireError> {
        // Each field is at least a tag byte and a size byte.
        let n = self.uvarint()? as usize;
        self.fits(n, 2)?;
        for _ in 0..n {
            self.uvarint()?; // tag
            let size = self.uvarint()? as usize;
            self.take(size)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
