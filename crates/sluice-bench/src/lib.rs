//! sluice-bench: the load generator and scenario runner of sluice, as a library so that tests
//! call exactly the code the `sluice-bench` binary runs.
//!
//! Owns: simulated MQTT devices ([`devices`]), the measuring subscriber ([`sink`]), the bench
//! payload format ([`payload`]), statistics ([`stats`]), `/proc` sampling ([`procfs`]), the kernel
//! floor responder ([`floor`]) and
//! whole-machine scenarios ([`scenario`], [`seganet`], [`throughput`], [`connections`],
//! [`priority`], [`outage`]). Does not own: the gateway, the brokers (Mosquitto
//! comes from `sluice-testkit`) or the MQTT codec (`sluice-proto`).
//!
//! Invariants: bytes from a broker never panic the tool; every in-flight window and buffer has a
//! bound stated where it is defined; results go to stdout or a file as JSON, everything else
//! (progress, logs) to stderr.
#![forbid(unsafe_code)]

pub mod agents;
pub mod charts;
pub mod conn;
pub mod connections;
pub mod devices;
pub mod fastsink;
pub mod floor;
pub mod outage;
pub mod payload;
pub mod priority;
pub mod procfs;
pub mod scenario;
pub mod seganet;
pub mod sink;
pub mod stats;
pub mod storage;
pub mod throughput;
