//! sluice: an IoT edge gateway. See docs/ARCHITECTURE.md for the path of one message.
#![forbid(unsafe_code)]

pub mod admin;
pub mod config;
pub mod shard;
pub mod telemetry;
pub mod uplink;
