//! The MQTT 3.1.1/5 device edge.

pub(crate) mod connection;
pub mod listener;
pub mod local;
pub mod restore;
pub mod session;
pub mod stream;
