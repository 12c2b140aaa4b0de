//! Test support for sluice: everything a test needs that is not sluice itself.
//!
//! Owns: a throw-away PKI generated at test time ([`certs`]), a real Mosquitto broker as a
//! child process ([`broker`]), an MQTT test client on sluice-proto's codec ([`client`]),
//! free-port helpers ([`ports`]).
//! Does not own: any production code path — nothing here is linked into the `sluice` binary.
//! Invariants: hermetic (temp dirs, loopback ports, no system trust store); every resource a
//! helper starts is released when its handle is dropped.
#![forbid(unsafe_code)]

pub mod broker;
pub mod certs;
pub mod client;
pub mod ports;

pub use broker::{Mosquitto, MosquittoBuilder};
pub use certs::TestPki;
pub use client::{ConnectOpts, TestClient};
pub use ports::{free_port, wait_for_port, wait_for_port_blocking};
