//! Per-core data plane. (in progress)
pub mod ack;
