//! MQTT 3.1.1 (protocol level 4) and MQTT 5.0 (level 5) control packets.
//!
//! One codec for the gateway (server side towards devices, client side towards the cloud), the
//! bench tool and the fuzzers. See docs/adr/0001-own-mqtt-codec.md for why it is our own.
//!
//! Wire format: fixed header (type<<4 | flags, remaining length as a 1–4 byte varint), then the
//! variable header and payload of each packet type as in the OASIS specifications. MQTT 5
//! packets carry a property block (varint length + id/value pairs) that 3.1.1 packets do not.
//!
//! Invariants:
//! - `Decoder::decode` never panics and never allocates more than the declared packet size,
//!   which is checked against the configured maximum *before* the body is buffered.
//! - Decoding is incremental: bytes may arrive split at any offset; `Ok(None)` means "need more".
//! - `encode` of a decoded packet yields bytes that decode to an equal packet (round trip).
//!
//! Layout: `types` (the packets), `decode` (incremental decoder and its errors), `encode`,
//! `properties` (MQTT 5 property blocks and which packet may carry which), `reason_codes`
//! (allowed codes per packet), `wire` (integers, varints, strings, binary data), `topic`
//! (name/filter validity and matching). Tests live in `tests/mqtt/`, the fuzz target in
//! `fuzz/fuzz_targets/mqtt_decode.rs`.

mod decode;
mod encode;
mod properties;
mod reason_codes;
pub mod topic;
mod types;
mod wire;

pub use decode::{DecodeError, Decoder};
pub use encode::{encode, EncodeError};
pub use types::*;
