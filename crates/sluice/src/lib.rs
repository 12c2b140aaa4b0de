//! sluice: an IoT edge gateway. See docs/ARCHITECTURE.md for the path of one message.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod config;
pub mod control;
pub mod listener;
pub mod shard;
pub mod spool;
pub mod telemetry;
pub mod uplink;
