//! The `throughput` scenario: how many 1 KB QoS 1 messages per second a system under test (SUT)
//! sustains on its way to a TLS 1.3 cloud, found with a step load.
//!
//! Owns: a *pipelined* device fleet (few devices, each publishing as fast as its pacing and its
//! inflight window allow, several PUBLISHes per write), the step controller, the per-step
//! measurements and the report (JSON and Markdown). Does not own: the SUT processes (sluice via
//! [`crate::harness::sut::SluiceChild`], the bridge via `sluice-testkit`), the cloud (a Mosquitto
//! from `sluice-testkit`, or the in-process [`crate::sinks::fastsink`]).
//!
//! # The fleet
//! A pipelined fleet of a few fast devices ([`crate::load::paced`]: why it differs from
//! [`crate::load::devices`], its token buckets, windows and drop counts).
//!
//! # Step load
//! Offered rate starts at `start_rate` and is multiplied by `step_factor` after every step that
//! passes, for at most `max_steps` steps; after the first failing step, `refine_steps` bisection
//! steps between the last passing (0 if the very first step failed) and the first failing rate
//! narrow the maximum (each after a cool-down that lets the backlog drain). Each step lasts `step_duration`; its first `warmup`
//! is not measured. A step **passes** when, over its measured window:
//! - achieved (messages received by the cloud sink per second) ≥ `min_delivery` (95 %) of the
//!   offered rate,
//! - the backlog (sent − received by the cloud) grew by at most 2 % of the step's messages
//!   (or 1,000), and
//! - p99 end-to-end latency (device send → cloud sink receive) ≤ `p99_bound` (default 50 ms).
//!
//! **Maximum sustained** = the highest achieved rate of a passing step. For each step: offered,
//! sent, acknowledged and achieved rates, ack and e2e latency p50/p99, SUT CPU (% of one core
//! and µs per delivered message), cloud CPU (the Mosquitto process, or the fast sink's threads),
//! generator CPU (this process minus the sink threads), whole-machine CPU from `/proc/stat`,
//! drops, SUT RSS, and — for a failing step — what limited it.
//!
//! # Clouds
//! - `mosquitto`: a TLS 1.3 Mosquitto; a measuring subscriber ([`crate::sinks::fastsink::subscribe_measuring`])
//!   takes everything (`#`, QoS 1) and measures e2e latency. Mosquitto's own CPU is reported.
//! - `fast-sink`: the in-process fast acknowledging sink ([`crate::sinks::fastsink`]) is the cloud; it
//!   PUBACKs at once and measures e2e latency, so the broker does not set the limit.
//!
//! The sink (or subscriber) runs on its own single-worker tokio runtime whose thread is named
//! `fastsink`, so its CPU can be told apart from the generator's (`/proc/self/task/*/stat`).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::ProtocolVersion;
use sluice_testkit::{Mosquitto, TestPki};
use tokio::time::{sleep, Instant};

use crate::harness::machine::{loadavg, machine, Machine};
use crate::harness::procfs::{self, round1, round3, CpuMeter, Pid};
use crate::harness::sut::{start_bridge, SluiceChild, Sut};
use crate::load::devices::version_name;
pub use crate::report::write_json;
use crate::sinks::fastsink::{FastSink, FastSinkReport};
use crate::stats::LatencySummary;

mod report;

pub use crate::harness::cloud::Cloud;
use crate::harness::cloud::{start_cloud, CloudSide, SinkRuntime, SINK_THREAD};
use crate::harness::procfs::{
    busiest_others, machine_cpu, machine_cpu_percent, process_cpu_ticks, threads_cpu,
};
pub use crate::load::paced::{Fleet, FleetConfig, FleetCounters, FleetSnapshot, BURST};
pub use report::markdown;
use report::step_line;

/// Parameters of the `throughput` scenario.
#[derive(Debug, Clone)]
pub struct ThroughputScenario {
    /// Run in this order, for each cloud.
    pub suts: Vec<Sut>,
    pub clouds: Vec<Cloud>,
    pub devices: u32,
    pub window: u16,
    pub payload_size: usize,
    pub protocol: ProtocolVersion,
    /// Offered rate of the first step, msg/s.
    pub start_rate: f64,
    /// Each passing step multiplies the offered rate by this (> 1).
    pub step_factor: f64,
    pub max_steps: u32,
    /// Bisection steps after the first failure.
    pub refine_steps: u32,
    pub step_duration: Duration,
    /// The first part of each step that is not measured.
    pub warmup: Duration,
    pub p99_bound: Duration,
    /// Achieved ÷ offered below this fails a step.
    pub min_delivery: f64,
    pub pacing_tick: Duration,
    pub sluice_bin: PathBuf,
    /// `[gateway] shards` (0 = one per core but one, at least one).
    pub sluice_shards: u32,
    /// `inflight` of sluice's uplink (None: sluice's default).
    pub sluice_uplink_inflight: Option<u16>,
    /// `[uplink.aggregate]` for sluice.
    pub sluice_aggregate: crate::harness::sut::AggregateOpts,
    /// Longest wait for the backlog to drain before a refinement step.
    pub cooldown_max: Duration,
    pub command_line: String,
    /// One line per step on stderr.
    pub progress: bool,
}

impl ThroughputScenario {
    /// The CLI defaults: both SUTs into both clouds, 128 devices × window 64, 1,024 B,
    /// 10k msg/s × 1.25 per step, 5 s steps with 1 s warm-up, p99 bound 50 ms.
    pub fn new(sluice_bin: PathBuf) -> ThroughputScenario {
        ThroughputScenario {
            suts: vec![Sut::Sluice, Sut::MosquittoBridge],
            clouds: vec![Cloud::FastSink, Cloud::Mosquitto],
            devices: 128,
            window: 64,
            payload_size: 1024,
            protocol: ProtocolVersion::V311,
            start_rate: 10_000.0,
            step_factor: 1.25,
            max_steps: 20,
            refine_steps: 2,
            step_duration: Duration::from_secs(5),
            warmup: Duration::from_secs(1),
            p99_bound: Duration::from_millis(50),
            min_delivery: 0.95,
            pacing_tick: Duration::from_millis(5),
            sluice_bin,
            sluice_shards: 0,
            sluice_uplink_inflight: None,
            sluice_aggregate: crate::harness::sut::AggregateOpts::default(),
            cooldown_max: Duration::from_secs(20),
            command_line: String::new(),
            progress: true,
        }
    }
}

/// Parameters as run.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputParams {
    pub devices: u32,
    pub window: u16,
    pub payload_bytes: usize,
    pub mqtt: &'static str,
    pub qos: u8,
    pub start_rate: f64,
    pub step_factor: f64,
    pub max_steps: u32,
    pub refine_steps: u32,
    pub step_s: f64,
    pub warmup_s: f64,
    pub p99_bound_ms: f64,
    pub min_delivery: f64,
    pub pacing_tick_ms: f64,
    pub sluice_bin: String,
    pub sluice_shards: u32,
    pub sluice_uplink_inflight: Option<u16>,
    pub sluice_aggregate: crate::harness::sut::AggregateOpts,
}

/// One step of the load, measured over its window (the step minus its warm-up).
#[derive(Debug, Clone, Serialize)]
pub struct StepResult {
    pub step: u32,
    /// "ramp" (geometric increase) or "refine" (bisection after the first failure).
    pub phase: &'static str,
    pub offered_rate: f64,
    /// PUBLISHes written by the generator per second.
    pub sent_rate: f64,
    /// PUBACKs from the SUT per second.
    pub acked_rate: f64,
    /// Distinct messages received by the cloud sink per second (duplicates not counted).
    pub achieved_rate: f64,
    /// Duplicate arrivals at the cloud sink in the window (e.g. a bridge's resends).
    pub duplicates: u64,
    /// achieved ÷ offered.
    pub achieved_ratio: f64,
    pub window_s: f64,
    /// Sent − received by the cloud, at the start and end of the window.
    pub backlog_start: i64,
    pub backlog_end: i64,
    /// Device send → cloud sink receive, messages received in the window.
    pub e2e_latency: LatencySummary,
    /// PUBLISH written → PUBACK read at the device, PUBACKs read in the window.
    pub ack_latency: LatencySummary,
    pub sut_cpu_percent: f64,
    /// SUT CPU µs per message received by the cloud in the window.
    pub sut_cpu_us_per_msg: f64,
    /// The cloud Mosquitto process, or the fast sink's thread.
    pub cloud_cpu_percent: f64,
    /// The measuring subscriber's thread (Mosquitto cloud only; 0 with the fast sink, whose
    /// thread is the cloud).
    pub subscriber_cpu_percent: f64,
    /// This process minus the sink thread.
    pub generator_cpu_percent: f64,
    /// All of this process (generator + sink thread).
    pub tool_cpu_percent: f64,
    /// Whole machine, from /proc/stat: % of all cores busy.
    pub machine_cpu_percent: f64,
    /// The part of `machine_cpu_percent` not used by the SUT, the cloud broker or this tool
    /// (other work on the machine, plus kernel work not charged to a process), % of all cores.
    pub other_cpu_percent: f64,
    /// Other processes that used at least 2 % of one core in the window: "comm (pid) %".
    pub other_processes: Vec<String>,
    /// Refinement steps: how long the cool-down before it waited for the backlog, and
    /// whether it fully drained (else the step starts with a backlog).
    pub cooldown_s: Option<f64>,
    pub cooldown_drained: Option<bool>,
    pub window_full_drops: u64,
    pub late_drops: u64,
    pub sut_rss_kib: u64,
    pub loadavg: String,
    pub passed: bool,
    /// "ok", or why the step failed.
    pub verdict: String,
    /// For a failing step: what most likely limited it.
    pub limited_by: Option<String>,
}

/// One SUT into one cloud.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputRun {
    pub sut: Sut,
    pub cloud: Cloud,
    pub sut_config: String,
    /// sluice's uplink sessions or the bridge's connection, as seen by the cloud.
    pub uplink_connections: u64,
    pub steps: Vec<StepResult>,
    /// Highest achieved rate of a passing step, msg/s (0 if none passed).
    pub max_sustained_rate: f64,
    pub max_sustained_step: Option<u32>,
    pub sut_cpu_us_per_msg_at_max: f64,
    pub sut_cpu_percent_at_max: f64,
    pub machine_cpu_percent_at_max: f64,
    /// Why the ramp stopped.
    pub stopped_because: String,
    /// What limited the first failing step (None if none failed).
    pub limited_by: Option<String>,
    pub fleet: FleetSnapshot,
    pub sink: FastSinkReport,
}

/// Everything the `throughput` scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: ThroughputParams,
    pub runs: Vec<ThroughputRun>,
}

/// Run every (cloud, SUT) combination, one after the other.
pub async fn run_throughput(config: &ThroughputScenario) -> anyhow::Result<ThroughputReport> {
    if config.suts.is_empty() || config.clouds.is_empty() {
        bail!("select at least one system under test and one cloud");
    }
    if config.warmup >= config.step_duration {
        bail!("the warm-up must be shorter than a step");
    }
    if config.step_factor.is_nan() || config.step_factor <= 1.0 {
        bail!("the step factor must be more than 1");
    }
    if !(config.start_rate.is_finite() && config.start_rate > 0.0) {
        bail!("the start rate must be a positive number of messages per second");
    }
    if config.suts.contains(&Sut::Sluice) && !config.sluice_bin.is_file() {
        bail!(
            "sluice binary {} not found: build it with `cargo build --release -p sluice` or pass --sluice-bin",
            config.sluice_bin.display()
        );
    }
    let machine = machine(&config.command_line);
    let mut runs = Vec::new();
    for &cloud in &config.clouds {
        for &sut in &config.suts {
            eprintln!(
                "=== scenario throughput: {} → {} — {} devices × window {}, {} B, steps of {:?} from {} msg/s ×{} ===",
                sut.name(),
                cloud.name(),
                config.devices,
                config.window,
                config.payload_size,
                config.step_duration,
                config.start_rate,
                config.step_factor
            );
            let run = run_one(config, sut, cloud)
                .await
                .with_context(|| format!("throughput run {} → {}", sut.name(), cloud.name()))?;
            eprintln!(
                "{} → {}: max sustained {:.0} msg/s ({:.2} µs SUT CPU per message); stopped: {}",
                sut.name(),
                cloud.name(),
                run.max_sustained_rate,
                run.sut_cpu_us_per_msg_at_max,
                run.stopped_because
            );
            runs.push(run);
        }
    }
    Ok(ThroughputReport {
        scenario: "throughput",
        machine,
        params: ThroughputParams {
            devices: config.devices,
            window: config.window,
            payload_bytes: config.payload_size,
            mqtt: version_name(config.protocol),
            qos: 1,
            start_rate: config.start_rate,
            step_factor: config.step_factor,
            max_steps: config.max_steps,
            refine_steps: config.refine_steps,
            step_s: config.step_duration.as_secs_f64(),
            warmup_s: config.warmup.as_secs_f64(),
            p99_bound_ms: config.p99_bound.as_secs_f64() * 1000.0,
            min_delivery: config.min_delivery,
            pacing_tick_ms: config.pacing_tick.as_secs_f64() * 1000.0,
            sluice_bin: config.sluice_bin.display().to_string(),
            sluice_shards: config.sluice_shards,
            sluice_uplink_inflight: config.sluice_uplink_inflight,
            sluice_aggregate: config.sluice_aggregate.clone(),
        },
        runs,
    })
}

/// A started SUT; dropping it stops the process.
struct SutSide {
    pid: u32,
    device_addr: SocketAddr,
    config_text: String,
    _sluice: Option<SluiceChild>,
    _bridge: Option<Mosquitto>,
}

/// The generated sluice configuration of this scenario: device listener, no admin endpoint,
/// one TLS 1.3 uplink forwarding everything to the cloud on 127.0.0.1:`cloud_port`.
pub fn sluice_throughput_config(
    config: &ThroughputScenario,
    mqtt_port: u16,
    cloud_port: u16,
    ca_file: &Path,
) -> String {
    let max_connections = (u64::from(config.devices) + 1024).max(10_000);
    let inflight = config
        .sluice_uplink_inflight
        .map(|n| format!("inflight = {n}\n"))
        .unwrap_or_default();
    format!(
        "# generated by sluice-bench scenario throughput\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\nmax_sessions = {max_connections}\n\n\
         [coap]\nenabled = false\n\n\
         [admin]\nenabled = false\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://127.0.0.1:{cloud_port}\"\nca_file = \"{ca}\"\n\
         client_id = \"sluice-gw\"\nforward = [\"#\"]\n{inflight}{aggregate}",
        aggregate = config.sluice_aggregate.toml(),
        shards = config.sluice_shards,
        ca = ca_file
            .display()
            .to_string()
            .replace('\\', "\\\\")
            .replace('"', "\\\""),
    )
}

/// How many shards (so uplink sessions) sluice runs with `shards = 0` on this machine.
fn sluice_auto_shards() -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    sluice::config::GatewayConfig::auto_shards(cores) as u64
}

async fn start_sut(
    kind: Sut,
    config: &ThroughputScenario,
    pki: &TestPki,
    cloud: &CloudSide,
) -> anyhow::Result<SutSide> {
    let expected_uplinks = match kind {
        Sut::Sluice if config.sluice_shards > 0 => u64::from(config.sluice_shards),
        Sut::Sluice => sluice_auto_shards(),
        Sut::MosquittoBridge => 1,
        Sut::Floor | Sut::FloorUring | Sut::RelayFloor => {
            bail!("the floors are measured by `scenario core`, not `scenario throughput`")
        }
    };
    let side = match kind {
        Sut::Sluice => {
            let mqtt_port = sluice_testkit::free_port()?;
            let toml = sluice_throughput_config(config, mqtt_port, cloud.port, pki.ca_path());
            let child = SluiceChild::spawn(&config.sluice_bin, mqtt_port, toml)?;
            child.wait_ready().await?;
            SutSide {
                pid: child.pid(),
                device_addr: child.device_addr(),
                config_text: child.config_text().to_string(),
                _sluice: Some(child),
                _bridge: None,
            }
        }
        Sut::MosquittoBridge => {
            let (edge, config_text) = start_bridge(cloud.port, pki).await?;
            SutSide {
                pid: edge
                    .pid()
                    .ok_or_else(|| anyhow!("the edge Mosquitto is not running"))?,
                device_addr: edge.plain_addr(),
                config_text,
                _sluice: None,
                _bridge: Some(edge),
            }
        }
        Sut::Floor | Sut::FloorUring | Sut::RelayFloor => unreachable!("refused above"),
    };
    // Wait until the SUT's uplink(s) are connected to the cloud.
    let deadline = Instant::now() + Duration::from_secs(15);
    match &cloud.broker {
        Some(broker) => {
            let needle = match kind {
                Sut::Sluice => "as sluice-gw",
                Sut::MosquittoBridge | Sut::Floor | Sut::FloorUring | Sut::RelayFloor => {
                    "sluice-edge-bridge"
                }
            };
            broker
                .wait_for_log_async(needle, Duration::from_secs(15))
                .await
                .with_context(|| format!("{}'s uplink never connected", kind.name()))?;
        }
        None => {
            while cloud.sink.connections_open() < expected_uplinks {
                if Instant::now() >= deadline {
                    let tail = side
                        ._sluice
                        .as_ref()
                        .map(|c| c.stderr_tail())
                        .unwrap_or_default();
                    bail!(
                        "only {} of {expected_uplinks} uplink connections reached the fast sink in 15 s; SUT stderr:\n{tail}",
                        cloud.sink.connections_open()
                    );
                }
                sleep(Duration::from_millis(50)).await;
            }
        }
    }
    sleep(Duration::from_secs(1)).await;
    Ok(side)
}

async fn run_one(
    config: &ThroughputScenario,
    sut_kind: Sut,
    cloud_kind: Cloud,
) -> anyhow::Result<ThroughputRun> {
    let pki = tokio::task::spawn_blocking(TestPki::try_generate)
        .await
        .context("certificate generation panicked")??;
    let rt = SinkRuntime::new()?;
    let cloud = start_cloud(cloud_kind, &pki, &rt).await?;
    let sut = start_sut(sut_kind, config, &pki, &cloud).await?;
    let uplink_connections = match &cloud.broker {
        None => cloud.sink.connections_open(),
        Some(_) => match sut_kind {
            Sut::Sluice if config.sluice_shards > 0 => u64::from(config.sluice_shards),
            Sut::Sluice => sluice_auto_shards(),
            Sut::MosquittoBridge | Sut::Floor | Sut::FloorUring | Sut::RelayFloor => 1,
        },
    };

    let mut fleet_config = FleetConfig::new(sut.device_addr);
    fleet_config.devices = config.devices;
    fleet_config.window = config.window;
    fleet_config.payload_size = config.payload_size;
    fleet_config.protocol = config.protocol;
    fleet_config.pacing_tick = config.pacing_tick;
    let fleet = Fleet::connect(fleet_config).await?;

    let meters = Meters {
        sut: Pid::Other(sut.pid),
        cloud: cloud
            .broker
            .as_ref()
            .and_then(Mosquitto::pid)
            .map(Pid::Other),
    };
    let mut steps = Vec::new();
    let mut rate = config.start_rate;
    let mut last_pass: Option<f64> = None;
    let mut first_fail: Option<f64> = None;
    for _ in 0..config.max_steps {
        let step = run_step(
            config,
            &fleet,
            &cloud.sink,
            &meters,
            steps.len() as u32,
            "ramp",
            rate,
        )
        .await?;
        let passed = step.passed;
        steps.push(step);
        if passed {
            last_pass = Some(rate);
            rate *= config.step_factor;
        } else {
            first_fail = Some(rate);
            break;
        }
    }
    // If even the first step failed, bisect between 0 and it.
    if let (lo, Some(mut hi)) = (last_pass, first_fail) {
        let mut lo = lo.unwrap_or(0.0);
        for _ in 0..config.refine_steps {
            let (waited, drained) = cool_down(config, &fleet, &cloud.sink).await;
            let mid = (lo + hi) / 2.0;
            let mut step = run_step(
                config,
                &fleet,
                &cloud.sink,
                &meters,
                steps.len() as u32,
                "refine",
                mid,
            )
            .await?;
            step.cooldown_s = Some(waited);
            step.cooldown_drained = Some(drained);
            if step.passed {
                lo = mid;
            } else {
                hi = mid;
            }
            steps.push(step);
        }
    }
    fleet.set_total_rate(0.0);
    let fleet_end = fleet.stop(Duration::from_secs(5)).await;
    // Let the last messages reach the cloud.
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    while cloud.sink.unique() < fleet_end.sent && Instant::now() < drain_deadline {
        sleep(Duration::from_millis(100)).await;
    }
    let sut_config = sut.config_text.clone();
    drop(sut);
    let sink = cloud.sink.stop().await;
    drop(cloud.broker);
    drop(rt);
    drop(pki);

    let best = steps
        .iter()
        .filter(|s| s.passed)
        .max_by(|a, b| a.achieved_rate.total_cmp(&b.achieved_rate));
    let first_failed = steps.iter().find(|s| !s.passed);
    let stopped_because = match first_failed {
        Some(s) => format!(
            "step {} at {:.0} msg/s offered failed: {}",
            s.step, s.offered_rate, s.verdict
        ),
        None => format!(
            "every step passed (max steps {} reached, last offered {:.0} msg/s)",
            config.max_steps,
            steps.last().map_or(0.0, |s| s.offered_rate)
        ),
    };
    let mut notes = Vec::new();
    if fleet_end.device_failures > 0 {
        notes.push(format!(
            "{} device connections failed during the run",
            fleet_end.device_failures
        ));
    }
    Ok(ThroughputRun {
        sut: sut_kind,
        cloud: cloud_kind,
        sut_config,
        uplink_connections,
        max_sustained_rate: best.map_or(0.0, |s| s.achieved_rate),
        max_sustained_step: best.map(|s| s.step),
        sut_cpu_us_per_msg_at_max: best.map_or(0.0, |s| s.sut_cpu_us_per_msg),
        sut_cpu_percent_at_max: best.map_or(0.0, |s| s.sut_cpu_percent),
        machine_cpu_percent_at_max: best.map_or(0.0, |s| s.machine_cpu_percent),
        stopped_because: if notes.is_empty() {
            stopped_because
        } else {
            format!("{stopped_because}; {}", notes.join("; "))
        },
        limited_by: first_failed.and_then(|s| s.limited_by.clone()),
        steps,
        fleet: fleet_end,
        sink,
    })
}

/// Processes whose CPU each step reads.
struct Meters {
    sut: Pid,
    cloud: Option<Pid>,
}

/// Pause the load and wait until the cloud has caught up (or `cooldown_max` passed).
/// Returns how long it waited and whether everything was acknowledged and delivered.
async fn cool_down(config: &ThroughputScenario, fleet: &Fleet, sink: &FastSink) -> (f64, bool) {
    fleet.set_total_rate(0.0);
    let started = Instant::now();
    let deadline = started + config.cooldown_max;
    let drained = loop {
        let c = fleet.counters();
        if c.sent == c.acknowledged + c.rejected && sink.unique() >= c.sent {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        sleep(Duration::from_millis(100)).await;
    };
    let waited = round3(started.elapsed().as_secs_f64());
    sleep(Duration::from_millis(500)).await;
    (waited, drained)
}

async fn run_step(
    config: &ThroughputScenario,
    fleet: &Fleet,
    sink: &FastSink,
    meters: &Meters,
    index: u32,
    phase: &'static str,
    offered: f64,
) -> anyhow::Result<StepResult> {
    fleet.set_total_rate(offered);
    sleep(config.warmup).await;
    // Window start.
    let _ = fleet.take_ack_latency();
    let _ = sink.stats().latency_window.take();
    let f0 = fleet.counters();
    let s0 = sink.unique();
    let d0 = sink
        .stats()
        .counters
        .duplicates
        .load(std::sync::atomic::Ordering::Relaxed);
    let sut_cpu = CpuMeter::start(meters.sut)?;
    let cloud_cpu = meters.cloud.map(CpuMeter::start).transpose()?;
    let tool_cpu = CpuMeter::start(Pid::OwnProcess)?;
    let sink_cpu0 = threads_cpu(SINK_THREAD);
    let machine0 = machine_cpu();
    let procs0 = process_cpu_ticks();
    let t0 = Instant::now();
    sleep(config.step_duration - config.warmup).await;
    // Window end.
    let f1 = fleet.counters();
    let s1 = sink.unique();
    let d1 = sink
        .stats()
        .counters
        .duplicates
        .load(std::sync::atomic::Ordering::Relaxed);
    let window = t0.elapsed();
    let sut_usage = sut_cpu.usage()?;
    let cloud_usage = cloud_cpu.map(|m| m.usage()).transpose()?;
    let tool_usage = tool_cpu.usage()?;
    let sink_cpu = threads_cpu(SINK_THREAD).saturating_sub(sink_cpu0);
    let machine_busy = machine_cpu_percent(machine0, machine_cpu());
    let mut ours = vec![std::process::id()];
    ours.extend(
        [Some(meters.sut), meters.cloud]
            .into_iter()
            .flatten()
            .filter_map(|p| match p {
                Pid::Other(pid) => Some(pid),
                Pid::OwnProcess => None,
            }),
    );
    let other_processes = busiest_others(&procs0, &process_cpu_ticks(), &ours, t0.elapsed());
    let e2e = LatencySummary::from_histogram(&sink.stats().latency_window.take());
    let ack = LatencySummary::from_histogram(&fleet.take_ack_latency());
    let sut_rss_kib = procfs::rss_kib(meters.sut).unwrap_or(0);

    let secs = window.as_secs_f64().max(1e-9);
    let per_s = |n: u64| round1(n as f64 / secs);
    let delivered = s1.saturating_sub(s0);
    let achieved_rate = per_s(delivered);
    let sink_cpu_percent = round1(sink_cpu.as_secs_f64() / secs * 100.0);
    let window_full_drops = f1.window_full_drops - f0.window_full_drops;
    let late_drops = f1.late_drops - f0.late_drops;
    let backlog_start = f0.sent as i64 - s0 as i64;
    let backlog_end = f1.sent as i64 - s1 as i64;
    let offered_in_window = offered * secs;

    let mut reasons = Vec::new();
    let bound_ms = config.p99_bound.as_secs_f64() * 1000.0;
    if delivered == 0 {
        reasons.push("nothing reached the cloud".to_string());
    }
    if e2e.count > 0 && e2e.p99_ms > bound_ms {
        reasons.push(format!("e2e p99 {:.1} ms > {bound_ms} ms", e2e.p99_ms));
    }
    if achieved_rate < config.min_delivery * offered {
        reasons.push(format!(
            "achieved {:.1} % of offered (< {:.0} %)",
            achieved_rate / offered * 100.0,
            config.min_delivery * 100.0
        ));
    }
    let growth_allowed = (0.02 * offered_in_window).max(1000.0);
    if (backlog_end - backlog_start) as f64 > growth_allowed {
        reasons.push(format!(
            "backlog grew by {} messages",
            backlog_end - backlog_start
        ));
    }
    let passed = reasons.is_empty();
    let generator_cpu = (tool_usage.cpu_seconds - sink_cpu.as_secs_f64()).max(0.0);
    let cores = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
    let ours = sut_usage.percent_of_one_core
        + cloud_usage.map_or(0.0, |u| u.percent_of_one_core)
        + tool_usage.percent_of_one_core;
    let other_cpu_percent = round1((machine_busy - ours / cores).max(0.0));
    let limited_by = (!passed).then(|| {
        let significant = 0.01 * offered_in_window;
        let mut why = if late_drops as f64 > significant {
            "generator (devices could not send on schedule)".to_string()
        } else if window_full_drops as f64 > significant {
            "acknowledgements too slow: device inflight windows full (the SUT; for sluice, \
             which acknowledges after the cloud's PUBACK, the SUT or the cloud)"
                .to_string()
        } else if machine_busy >= 95.0 {
            "machine CPU (all cores busy)".to_string()
        } else {
            "SUT (messages queued in it or in the cloud)".to_string()
        };
        if machine_busy >= 95.0 && other_cpu_percent >= 10.0 {
            let _ = write!(
                why,
                "; machine CPU {machine_busy:.0} % of which {other_cpu_percent:.0} % other work"
            );
        }
        why
    });
    let result = StepResult {
        step: index,
        phase,
        offered_rate: round1(offered),
        sent_rate: per_s(f1.sent - f0.sent),
        acked_rate: per_s(f1.acknowledged - f0.acknowledged),
        achieved_rate,
        duplicates: d1.saturating_sub(d0),
        achieved_ratio: round3(achieved_rate / offered),
        window_s: round3(secs),
        backlog_start,
        backlog_end,
        e2e_latency: e2e,
        ack_latency: ack,
        sut_cpu_percent: sut_usage.percent_of_one_core,
        sut_cpu_us_per_msg: if delivered == 0 {
            0.0
        } else {
            round3(sut_usage.cpu_seconds * 1e6 / delivered as f64)
        },
        cloud_cpu_percent: cloud_usage.map_or(sink_cpu_percent, |u| u.percent_of_one_core),
        subscriber_cpu_percent: if cloud_usage.is_some() {
            sink_cpu_percent
        } else {
            0.0
        },
        generator_cpu_percent: round1(generator_cpu / secs * 100.0),
        tool_cpu_percent: tool_usage.percent_of_one_core,
        machine_cpu_percent: machine_busy,
        other_cpu_percent,
        other_processes,
        cooldown_s: None,
        cooldown_drained: None,
        window_full_drops,
        late_drops,
        sut_rss_kib,
        loadavg: loadavg(),
        passed,
        verdict: if passed {
            "ok".to_string()
        } else {
            reasons.join("; ")
        },
        limited_by,
    };
    if config.progress {
        eprintln!("{}", step_line(&result));
    }
    Ok(result)
}
