//! The MQTT transport: one MQTT client connection per (shard, uplink, lane) to a cloud broker.

pub mod route;
pub mod session;
pub mod socket;
pub mod tc;
pub mod tls;
