//! The shared harness every scenario runs on:
//! - systems under test as processes: [`sut`] (sluice with a generated config, the Mosquitto
//!   bridge, the floor), [`agents`] (one agent process per device) started as a fleet by
//!   [`agent_fleet`];
//! - the cloud broker and its PKI ([`cloud`]); libcoap's `coap-server-notls` as an upstream
//!   CoAP server or a forward proxy ([`libcoap`]);
//! - network namespaces, a veth link and tc on it ([`netns`]); a cuttable TCP link ([`link`]);
//! - what the machine can hold and admission checks ([`limits`]), a CPU cage for the SUT
//!   ([`cgroup`]);
//! - the disk a scenario writes to ([`disk`]);
//! - the run phases ramp → settle → steady → drain, the cloud sink and RSS sampling ([`phases`]);
//! - `/proc` sampling ([`procfs`]), sluice's `/metrics` ([`metrics`]) and the machine and commit header of reports ([`machine`]).
//!
//! Invariant: every process, namespace and cgroup started here is a guard whose `Drop` stops or
//! removes it, so a scenario that fails half-way leaves nothing behind.

pub mod agent_fleet;
pub mod agents;
pub mod cgroup;
pub mod cloud;
pub mod disk;
pub mod libcoap;
pub mod limits;
pub mod link;
pub mod machine;
pub mod metrics;
pub mod netns;
pub mod phases;
pub mod procfs;
pub mod sut;
