//! sans-IO protocol codecs for sluice.
//!
//! Owns: byte-level encoding and decoding of device and cloud protocols, and pure helpers on
//! their data (topic validation and matching). Does not own: sockets, clocks, tasks or any
//! runtime — callers hand in bytes and get packets back, so everything here is deterministic,
//! property-tested and fuzzed. Invariant: no input bytes can make any function here panic.
//!
//! Modules: [`mqtt`] (MQTT 3.1.1 and 5.0 packets), [`phd`] (IEEE 11073-20601 APDUs), [`senml`] (SenML packs, RFC 8428, in JSON
//! and CBOR: decoding with base-field resolution, and an incremental pack writer), [`websocket`]
//! (RFC 6455 framing, server side, for MQTT over WebSocket).
#![forbid(unsafe_code)]

pub mod coap;
pub mod mqtt;
pub mod phd;
pub mod senml;
pub mod uri;
pub mod websocket;
