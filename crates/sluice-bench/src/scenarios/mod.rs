//! The scenarios, one module each, holding only what is particular to it: its parameters, its
//! set-up, what it measures and its verdict. Everything else comes from [`crate::harness`]
//! (systems under test, cloud, namespaces, limits, phases, `/proc`), [`crate::load`] (devices),
//! [`crate::sinks`] (what measures at the cloud end) and [`crate::report`] (JSON, Markdown
//! pieces, charts).
//!
//! | module | measures | report |
//! |---|---|---|
//! | [`coap`] | CoAP sensors (closed loop) → sluice publish → TLS cloud, and libcoap's vs sluice's proxy to a CoAP-over-TCP server: req/s, p50/p99, CPU µs/request, delivery | `docs/perf/coap.md` |
//! | [`control_storm`] | a PHD control storm (association, configuration, release) rising under a steady PHD + MQTT data load, control plane vs single plane: delivered rate, p99, CPU per thread; the PHD scan-report maximum | `docs/perf/control-storm.md` |
//! | [`core`] | devices → SUT → TLS cloud: delivery, e2e/ack latency, SUT CPU per message and RSS, against the kernel floor | `docs/perf/core-path.md` |
//! | [`seganet`] | a sweep over N devices: sluice vs per-device agents vs a Mosquitto bridge; p99, CPU, memory, achieved load | `docs/perf/seganet.md` |
//! | [`throughput`] | the maximum sustained rate under a step load, per SUT and cloud | `docs/perf/throughput.md` |
//! | [`connections`] | idle connections a SUT holds, RSS per connection, connect rate | `docs/perf/connections.md` |
//! | [`priority`] | priority lanes over a rate-limited veth uplink (root) | `docs/perf/priority.md` |
//! | [`outage`] | a cloud outage under load with the durable spool: backlog, drain, order | `docs/perf/outage.md` |
//! | [`kafka`] | records/s into a real 3-node Kafka cluster: Kafka's own `kafka-producer-perf-test` (the cluster's maximum) vs MQTT devices through sluice's Kafka uplink, sluice's CPU per message, PUBACK p99 | `docs/perf/kafka.md` |
//! | [`site`] | a site of 1, 2, 3 gateways behind HAProxy (TCP) into a 3-node Kafka cluster, the same load spread over more gateways: msg/s, each gateway's CPU, HAProxy's, PUBACK p99 | `docs/perf/site.md` |
//! | [`onem2m`] | contentInstances/s into a real ACME CSE: a plain pipelined HTTP client (the CSE's maximum) vs MQTT devices through sluice's oneM2M uplink, and the ratio | `docs/perf/onem2m.md` |
//! | [`functions`] | edge functions (issue 19): sluice's CPU per event beside a local Python / compiled echo function's, idle CPU and per-thread wake-ups with the function scaled to zero, cold/warm start latency and sluice's part of it, pre-warm policies on synthetic traces | `docs/perf/functions.md` |
//! | [`hostile`] | issue 28's findings replayed by a hostile sender against a sluice binary: bytes in/out at the attacker, RSS growth, healthy devices' p99, a verdict per finding | `docs/reliability.md` |
//! | [`faults`] | issue 31's fault campaign under MQTT + CoAP + PHD load: acknowledged vs at the cloud, duplicates, order, stall, QoS 0 lost, a verdict per case | `docs/reliability.md` |
//! | [`state`] | persistent sessions + `[state] dir` on vs off under the same device load (CPU per message, p99), and restart time with a large state | `docs/perf/state.md` |
//! | [`storage`] | the spool vs SQLite vs PostgreSQL: append, read back, recovery | `docs/perf/storage.md` |
//!
//! # Adding a scenario
//! A scenario is a plain async function over the harness, in one file `scenarios/<name>.rs`
//! (a folder `scenarios/<name>/` beside it for its report or analysis when the file would pass
//! 800 lines):
//! 1. `pub struct <Name>Scenario` — the parameters, with a constructor giving the defaults.
//! 2. `pub struct <Name>Report` (`Serialize`) — `scenario`, `machine`
//!    ([`crate::harness::machine::machine`]), the parameters as run, then the figures and the
//!    verdicts.
//! 3. `pub async fn run_<name>(&<Name>Scenario) -> anyhow::Result<<Name>Report>` — build the run
//!    from the harness: [`crate::harness::cloud::start_tls_cloud`] (PKI and cloud broker),
//!    [`crate::harness::phases::cloud_sink`], [`crate::harness::sut::start_sut`] or
//!    [`crate::harness::sut::SluiceChild`], the devices ([`crate::load::devices::spawn_devices`])
//!    timed by [`crate::harness::phases::Phases`] (ramp → settle → steady window → drain), CPU
//!    with [`crate::harness::procfs::CpuMeter`], memory with
//!    [`crate::harness::phases::RssSampler`].
//! 4. `pub fn markdown(&<Name>Report) -> String` — the title, then
//!    [`crate::report::markdown::machine_line`] and the command line, then the tables and
//!    verdicts.
//! 5. The command: an `Args` struct and a function in the binary's `cli/scenarios.rs` that fill
//!    the config and call `write_outputs` (JSON to `--out`, Markdown to `--markdown`), and one
//!    variant in `main.rs`'s `ScenarioCommand`.
//! 6. A test in `tests/<name>.rs` that runs it small (seconds, a few devices), and a line in
//!    `docs/perf/README.md`.
//!
//! A new load (CoAP sensors, PHD agents) goes into [`crate::load`], a new system under test into
//! [`crate::harness`], so the next scenario can use them too.

pub mod coap;
pub mod connections;
pub mod control_storm;
pub mod core;
pub mod faults;
pub mod functions;
pub mod hostile;
pub mod kafka;
pub mod multipath;
pub mod onem2m;
pub mod outage;
pub mod priority;
pub mod seganet;
pub mod site;
pub mod state;
pub mod storage;
pub mod throughput;
