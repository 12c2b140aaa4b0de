//! sluice: an IoT edge gateway. See docs/ARCHITECTURE.md for the path of one message.
#![deny(unsafe_code)]

pub mod admin;
pub mod app;
pub mod config;
pub mod control;
pub mod edge;
pub mod functions;
pub mod message;
pub mod net;
pub mod proxy;
pub mod shard;
pub mod sink;
pub mod state;
pub mod telemetry;
pub mod top;
