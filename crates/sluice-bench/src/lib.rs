//! sluice-bench: the load generator and scenario runner of sluice, as a library so that tests
//! call exactly the code the `sluice-bench` binary runs.
//!
//! Layout (each folder's `mod.rs` says what it owns; the binary's flags live in `src/cli/`):
//! - [`load`]: what plays the devices (MQTT device fleets; CoAP sensors and PHD agents go here);
//! - [`sinks`]: what measures at the cloud end (subscribing sink, fast acknowledging sink, the
//!   kernel floor);
//! - [`harness`]: systems under test as processes (sluice, Mosquitto bridge, per-device agents,
//!   the floor), the cloud broker and PKI, network namespaces and tc, machine limits, the run
//!   phases (ramp → settle → steady → drain), `/proc` sampling, the machine header;
//! - [`report`]: JSON, Markdown and charts;
//! - [`scenarios`]: one module per scenario, holding only what is particular to it (how to add
//!   one: see [`scenarios`]; the index of scenarios, commands and reports: `docs/perf/README.md`);
//! - shared primitives: the bench payload format ([`payload`]), the MQTT client handshake
//!   ([`conn`]) and latency statistics ([`stats`]).
//!
//! Does not own: the gateway, the brokers (Mosquitto comes from `sluice-testkit`) or the MQTT
//! codec (`sluice-proto`).
//!
//! Invariants: bytes from a broker never panic the tool; every in-flight window and buffer has a
//! bound stated where it is defined; results go to stdout or a file as JSON, everything else
//! (progress, logs) to stderr.
// No `unsafe` but in the io_uring floor's ring module (`sinks::floor_uring::ring`, ADR 0016),
// which allows it for itself alone.
#![deny(unsafe_code)]

pub mod conn;
pub mod harness;
pub mod load;
pub mod payload;
pub mod report;
pub mod scenarios;
pub mod sinks;
pub mod stats;

/// The floor responder at its old path, for `fuzz/fuzz_targets/floor_respond.rs` (outside this
/// crate); new code uses [`sinks::floor`].
#[doc(hidden)]
pub use sinks::floor;
