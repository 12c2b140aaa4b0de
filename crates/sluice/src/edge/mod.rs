//! Device edges: one folder per device protocol.

pub mod ack;
pub mod mqtt;
