//! The outbox in front of a transport: the bounded queue and SenML packing.

pub mod pack;
pub mod queue;
