//! Scenario runner: the whole device → system under test → cloud comparison on this machine.
//!
//! Owns: the `core` scenario — certificates, a cloud Mosquitto (TLS 1.3 listener only), the
//! system under test (sluice as a child process, an edge Mosquitto bridging to the cloud, the
//! kernel floor that forwards nothing, or the relay floor that forwards with nothing else),
//! an in-process sink and device fleet, resource sampling of the SUT, and the report (JSON and a
//! Markdown summary). Does not own: the gateway or the brokers themselves.
//!
//! Order of one run (each SUT gets a fresh PKI, cloud broker and sink):
//! 1. Cloud Mosquitto with a TLS 1.3 listener; the sink connects over TLS and subscribes to `#`
//!    (QoS 1) before anything publishes.
//! 2. The SUT starts and connects upstream; the runner waits until the cloud broker logs the
//!    SUT's client (`sluice-gw-*` or `sluice-edge-bridge`), then 1 s more.
//! 3. Devices run for `duration` (connections ramped over `ramp`) against the SUT's plain MQTT
//!    port. The *steady-state window* is `[start + ramp + settle, start + duration]` (settle
//!    defaults to 0; at tens of thousands of connections the connection storm of the ramp
//!    takes a second or two to digest, and a settle time keeps it out of the window): SUT CPU
//!    (utime + stime from `/proc/<pid>/stat`), cloud-broker CPU and this tool's CPU are measured
//!    over exactly that window, and µs of SUT CPU per message divides by the PUBACKs the devices
//!    received in it (PUBLISHes sent, for QoS 0).
//! 4. The SUT's VmRSS is sampled every second from start to the end of the drain.
//!    Latencies are reported for messages sent in that window (steady state) and for the
//!    whole run (the connection ramp included).
//! 5. Drain: after devices stop publishing, each waits up to `drain_max` for its outstanding
//!    PUBACKs before it disconnects (closing earlier would throw away what the kernel still
//!    holds for a back-pressuring SUT); then wait until the sink has every message, or nothing
//!    new arrived for `drain_idle`, or `drain_max` passed. Then the sink reports and the SUT is
//!    stopped (SIGTERM, then SIGKILL after 5 s).
//!
//! Everything shares the machine's cores: the report records `nproc`, the CPU model, this tool's
//! own CPU and the cloud broker's CPU so a reader can judge contention.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use tokio::time::Instant;

use crate::harness::cloud::start_tls_cloud;
use crate::harness::machine::{loadavg, machine, Machine};
use crate::harness::phases::{cloud_sink, Phases, RssSampler};
use crate::harness::procfs::{self, round1, round3, CpuMeter, Pid};
use crate::harness::sut::{require_sluice_bin, start_sut, AggregateOpts, Sut, SutSpec};
use crate::load::devices::{
    spawn_devices, version_name, Arrivals, DeviceTls, DevicesConfig, DevicesReport, PayloadSize,
};
use crate::sinks::sink::SinkReport;
use crate::stats::LatencySummary;

mod markdown;
pub use markdown::markdown;
use markdown::run_summary_line;

/// Parameters of the `core` scenario.
#[derive(Debug, Clone)]
pub struct CoreScenario {
    pub devices: u32,
    pub rate_per_device: f64,
    pub duration: Duration,
    pub ramp: Duration,
    /// The steady-state window starts this long after the ramp.
    pub settle: Duration,
    pub payload: PayloadSize,
    pub protocol: ProtocolVersion,
    pub qos: QoS,
    pub arrivals: Arrivals,
    /// Run in this order.
    pub suts: Vec<Sut>,
    pub sluice_bin: PathBuf,
    /// The `sluice-bench` executable that serves `floor` (the running one, for the CLI).
    pub floor_bin: PathBuf,
    /// `[gateway] shards` for sluice (0 = one per core but one, at least one).
    pub sluice_shards: u32,
    /// `[uplink.aggregate]` for sluice.
    pub sluice_aggregate: AggregateOpts,
    /// Drain ends when nothing new arrived at the sink for this long…
    pub drain_idle: Duration,
    /// …or after this long at most.
    pub drain_max: Duration,
    /// Recorded in the report.
    pub command_line: String,
    /// Progress lines on stderr.
    pub progress_every: Option<Duration>,
    /// Devices speak MQTT over TLS 1.3 to the SUT's TLS listener (sluice `[mqtt.tls]`, the edge
    /// Mosquitto's TLS listener; not the floor), with the run's PKI.
    pub device_tls: bool,
    /// TOML appended to sluice's generated config (its text; `--sluice-extra FILE`).
    pub sluice_extra: Option<String>,
    /// Dashboards held open on sluice's admin endpoint during the run (`--dashboards N`;
    /// sluice only): each loads the page, then reads `/api/v1/events`.
    pub dashboards: u32,
}

impl CoreScenario {
    /// The run's timing.
    pub fn phases(&self) -> Phases {
        let s = self;
        Phases::new(s.duration, s.ramp, s.settle, s.drain_idle, s.drain_max)
    }

    /// What the systems under test are started with.
    pub fn sut_spec(&self) -> SutSpec {
        SutSpec {
            sluice_bin: self.sluice_bin.clone(),
            floor_bin: self.floor_bin.clone(),
            sluice_shards: self.sluice_shards,
            sluice_aggregate: self.sluice_aggregate.clone(),
            devices: self.devices,
            device_tls: self.device_tls,
            sluice_extra: self.sluice_extra.clone(),
        }
    }
}

/// Parameters as run.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    pub devices: u32,
    pub rate_per_device: f64,
    pub offered_rate: f64,
    pub duration_s: f64,
    pub ramp_s: f64,
    pub settle_s: f64,
    pub steady_window_s: f64,
    pub payload_min: usize,
    pub payload_max: usize,
    pub mqtt: &'static str,
    pub qos: u8,
    pub arrivals: Arrivals,
    pub sluice_bin: String,
    pub sluice_shards: u32,
    pub sluice_aggregate: AggregateOpts,
    pub drain_idle_s: f64,
    pub drain_max_s: f64,
    /// Devices spoke MQTT over TLS 1.3 to the SUT's TLS listener.
    pub device_tls: bool,
    /// TOML appended to sluice's generated config, as given.
    pub sluice_extra_bytes: usize,
    /// Dashboards open during the run (sluice only).
    pub dashboards: u32,
}

/// Resident memory of the SUT, KiB.
#[derive(Debug, Clone, Serialize)]
pub struct RssSummary {
    /// Right before the devices started.
    pub start_kib: u64,
    pub peak_kib: u64,
    /// After the drain, right before the SUT was stopped.
    pub end_kib: u64,
    /// One sample per second from start to end.
    pub samples_kib: Vec<u64>,
}

/// One system under test, measured.
#[derive(Debug, Clone, Serialize)]
pub struct SutRun {
    pub sut: Sut,
    /// The generated sluice config, or the edge Mosquitto's bridge lines.
    pub sut_config: String,
    pub delivery_ratio: f64,
    pub sent: u64,
    pub unique_received: u64,
    pub lost: i64,
    pub duplicates: u64,
    pub order_violations: u64,
    pub gaps: u64,
    /// Device send → sink receive, messages sent in the steady-state window.
    pub e2e_latency: LatencySummary,
    /// Device PUBLISH → PUBACK from the SUT, PUBLISHes written in the steady-state window.
    pub ack_latency: LatencySummary,
    /// Device send → sink receive, whole run (ramp included).
    pub e2e_latency_all: LatencySummary,
    /// Device PUBLISH → PUBACK, whole run (ramp included).
    pub ack_latency_all: LatencySummary,
    /// SUT CPU over the steady-state window, % of one core.
    pub sut_cpu_percent: f64,
    /// SUT CPU µs per message acknowledged in the window.
    pub sut_cpu_us_per_msg: f64,
    pub sut_rss: RssSummary,
    pub steady_window_s: f64,
    pub steady_messages: u64,
    pub steady_rate: f64,
    /// Cloud Mosquitto CPU over the window, % of one core (shares the machine with the SUT).
    pub cloud_broker_cpu_percent: f64,
    /// This tool (devices + sink) over the window, % of one core.
    pub tool_cpu_percent: f64,
    pub drain_s: f64,
    /// `/proc/loadavg` at the end of the steady-state window (includes this run's own load).
    pub loadavg_at_window_end: String,
    /// sluice's `sluice-control` thread (control plane and admin endpoint, where the
    /// dashboards' streams are served) over the window, % of one core; `None` for other SUTs.
    pub control_thread_cpu_percent: Option<f64>,
    /// Dashboards open during the run, and what they received in the window.
    pub dashboards: Option<DashboardsReport>,
    pub devices: DevicesReport,
    pub sink: SinkReport,
}

/// What the open dashboards received during the steady-state window.
#[derive(Debug, Clone, Serialize)]
pub struct DashboardsReport {
    pub open: u32,
    /// Server-sent events received in the window, all dashboards together.
    pub events_in_window: u64,
    /// Stream bytes received in the window, all dashboards together.
    pub stream_bytes_in_window: u64,
    /// Bytes of one page load (assets and history), all dashboards together.
    pub page_load_bytes: u64,
    /// Streams that ended before the run did (should be 0).
    pub streams_ended: u64,
}

/// A row of the sluice-vs-bridge comparison.
#[derive(Debug, Clone, Serialize)]
pub struct ComparisonRow {
    pub metric: &'static str,
    pub sluice: f64,
    pub mosquitto_bridge: f64,
    /// sluice ÷ bridge.
    pub ratio: Option<f64>,
}

/// Everything the `core` scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: Params,
    pub runs: Vec<SutRun>,
    /// Present when both sluice and the bridge ran.
    pub comparison: Option<Vec<ComparisonRow>>,
    /// Present when the floor ran: each gateway's CPU per message against it.
    pub floor: Option<FloorComparison>,
    /// Present when the relay floor ran: each gateway's CPU per message against it.
    pub relay_floor: Option<RelayFloorComparison>,
}

/// CPU per message against the relay floor measured in the same invocation (first run of each).
#[derive(Debug, Clone, Serialize)]
pub struct RelayFloorComparison {
    /// µs of CPU per message for forwarding with nothing else (one TLS session, ack after ack).
    pub relay_floor_us_per_msg: f64,
    /// sluice ÷ relay floor.
    pub sluice_over_relay_floor: Option<f64>,
    /// bridge ÷ relay floor.
    pub bridge_over_relay_floor: Option<f64>,
    /// relay floor ÷ floor: the least share above the kernel floor any forwarder pays
    /// (issue 32 asks sluice ≤ 1.5× the floor).
    pub relay_floor_over_floor: Option<f64>,
    /// relay floor ÷ bridge (issue 32 asks sluice ≤ 0.6× the bridge).
    pub relay_floor_over_bridge: Option<f64>,
}

/// CPU per message of the gateways against the floor measured in the same invocation.
#[derive(Debug, Clone, Serialize)]
pub struct FloorComparison {
    /// µs of CPU per message for only terminating the device connections.
    pub floor_us_per_msg: f64,
    pub sluice_us_per_msg: Option<f64>,
    pub bridge_us_per_msg: Option<f64>,
    /// floor ÷ bridge: no gateway that terminates the devices' connections can use a smaller
    /// share of the bridge's CPU than this.
    pub floor_share_of_bridge: Option<f64>,
    /// sluice − floor: what sluice spends per message beyond the device sockets (parsing,
    /// routing, queues, the TLS uplink and its acknowledgements).
    pub sluice_above_floor_us: Option<f64>,
    /// bridge − floor.
    pub bridge_above_floor_us: Option<f64>,
    /// The io_uring floor's µs per message, when it ran too (`--sut floor,floor-uring`).
    pub floor_uring_us_per_msg: Option<f64>,
    /// io_uring floor ÷ epoll floor, same run (first run of each).
    pub uring_over_epoll: Option<f64>,
}

/// Run the `core` scenario for every configured SUT, one after the other.
pub async fn run_core(config: &CoreScenario) -> anyhow::Result<ScenarioReport> {
    if config.ramp + config.settle >= config.duration {
        bail!("ramp + settle must be shorter than the duration (the steady-state window lies between)");
    }
    if config.suts.is_empty() {
        bail!("no system under test selected");
    }
    if config.suts.contains(&Sut::Sluice) {
        require_sluice_bin(&config.sluice_bin)?;
    }
    if config.suts.iter().any(|s| s.runs_bench_bin()) && !config.floor_bin.is_file() {
        bail!(
            "sluice-bench binary {} not found",
            config.floor_bin.display()
        );
    }
    let machine = machine(&config.command_line);
    let mut runs = Vec::new();
    for &sut in &config.suts {
        eprintln!(
            "=== scenario core: {} — {} devices × {} msg/s for {:?} ===",
            sut.name(),
            config.devices,
            config.rate_per_device,
            config.duration
        );
        let run = run_one(config, sut)
            .await
            .with_context(|| format!("scenario run against {}", sut.name()))?;
        eprintln!("{}", run_summary_line(&run));
        runs.push(run);
    }
    let comparison = compare(&runs);
    let floor = compare_floor(&runs);
    let relay_floor = compare_relay_floor(&runs);
    Ok(ScenarioReport {
        scenario: "core",
        machine,
        params: Params {
            devices: config.devices,
            rate_per_device: config.rate_per_device,
            offered_rate: config.rate_per_device * f64::from(config.devices),
            duration_s: config.duration.as_secs_f64(),
            ramp_s: config.ramp.as_secs_f64(),
            settle_s: config.settle.as_secs_f64(),
            steady_window_s: config.phases().steady_window().as_secs_f64(),
            payload_min: config.payload.min,
            payload_max: config.payload.max,
            mqtt: version_name(config.protocol),
            qos: config.qos as u8,
            arrivals: config.arrivals,
            sluice_bin: config.sluice_bin.display().to_string(),
            sluice_shards: config.sluice_shards,
            sluice_aggregate: config.sluice_aggregate.clone(),
            drain_idle_s: config.drain_idle.as_secs_f64(),
            drain_max_s: config.drain_max.as_secs_f64(),
            device_tls: config.device_tls,
            sluice_extra_bytes: config.sluice_extra.as_ref().map_or(0, String::len),
            dashboards: config.dashboards,
        },
        runs,
        comparison,
        floor,
        relay_floor,
    })
}

async fn run_one(config: &CoreScenario, sut_kind: Sut) -> anyhow::Result<SutRun> {
    let phases = config.phases();
    let (pki, cloud) = start_tls_cloud().await?;
    let cloud_pid = cloud
        .pid()
        .ok_or_else(|| anyhow!("the cloud Mosquitto is not running"))?;

    let sink = cloud_sink(&pki, &cloud, config.devices, config.progress_every).await?;

    let sut = start_sut(sut_kind, &config.sut_spec(), &pki, &cloud).await?;
    let sut_pid = Pid::Other(sut.pid);

    // Resource sampling.
    let rss_start = procfs::rss_kib(sut_pid)?;
    let sampler = RssSampler::start(rss_start, move || procfs::rss_kib(sut_pid).ok());

    let mut devices_config = DevicesConfig::new(sut.device_addr);
    devices_config.devices = config.devices;
    devices_config.rate_per_device = config.rate_per_device;
    phases.apply_to(&mut devices_config);
    devices_config.payload = config.payload;
    devices_config.protocol = config.protocol;
    devices_config.qos = config.qos;
    devices_config.arrivals = config.arrivals;
    devices_config.progress_every = config.progress_every;
    if config.device_tls {
        devices_config.tls = Some(DeviceTls::from_ca_file(pki.ca_path(), "127.0.0.1")?);
    }
    let devices = spawn_devices(devices_config)?;
    let started = devices.started();
    let dashboards = if sut_kind == Sut::Sluice && config.dashboards > 0 {
        let admin = crate::load::dashboards::admin_addr_from_config(&sut.config_text)?;
        Some(crate::load::dashboards::open(admin, config.dashboards))
    } else {
        None
    };
    let control_cpu = || {
        (sut_kind == Sut::Sluice)
            .then(|| crate::load::dashboards::thread_cpu_time(sut.pid, "sluice-control").ok())
            .flatten()
    };

    phases.until_steady(started).await;
    sink.set_steady_from(crate::payload::unix_now_ns());
    let dash_before = dashboards.as_ref().map(|d| {
        (
            d.counters.events.load(std::sync::atomic::Ordering::Relaxed),
            d.counters
                .stream_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    });
    let control_before = control_cpu();
    let sut_cpu = CpuMeter::start(sut_pid)?;
    let cloud_cpu = CpuMeter::start(Pid::Other(cloud_pid))?;
    let tool_cpu = CpuMeter::start(Pid::OwnProcess)?;
    let window_start = Instant::now();
    let before = devices.counters().snapshot();
    phases.until_end(started).await;
    let after = devices.counters().snapshot();
    let window = window_start.elapsed();
    let sut_usage = sut_cpu.usage()?;
    let cloud_usage = cloud_cpu.usage()?;
    let tool_usage = tool_cpu.usage()?;
    let control_thread_cpu_percent = match (control_before, control_cpu()) {
        (Some(a), Some(b)) => Some(round3(
            b.saturating_sub(a).as_secs_f64() * 100.0 / window.as_secs_f64().max(1e-9),
        )),
        _ => None,
    };
    let dashboards_report = dashboards.as_ref().zip(dash_before).map(|(d, (e0, b0))| {
        let c = &d.counters;
        let o = std::sync::atomic::Ordering::Relaxed;
        DashboardsReport {
            open: config.dashboards,
            events_in_window: c.events.load(o) - e0,
            stream_bytes_in_window: c.stream_bytes.load(o) - b0,
            page_load_bytes: c.page_bytes.load(o),
            streams_ended: c.stream_ends.load(o),
        }
    });
    drop(dashboards);
    let loadavg_at_window_end = loadavg();
    let devices_report = devices.wait().await?;

    // The floor forwards nothing: there is nothing to wait for.
    let drain = if sut_kind.is_floor() {
        Duration::ZERO
    } else {
        phases.drain(&sink, devices_report.sent).await
    };
    let rss_end = procfs::rss_kib(sut_pid)?;
    let mut samples = sampler.stop().await;
    let sink_report = sink.stop(Some(devices_report.sent)).await?;
    let sut_config = sut.config_text.clone();
    drop(sut);
    drop(cloud);
    drop(pki);

    samples.push(rss_end);
    let steady_messages = match config.qos {
        QoS::AtMostOnce => after.sent - before.sent,
        _ => after.acknowledged - before.acknowledged,
    };
    let sut_cpu_us_per_msg = if steady_messages == 0 {
        0.0
    } else {
        round3(sut_usage.cpu_seconds * 1e6 / steady_messages as f64)
    };
    Ok(SutRun {
        sut: sut_kind,
        sut_config,
        delivery_ratio: sink_report.delivery_ratio.unwrap_or(0.0),
        sent: devices_report.sent,
        unique_received: sink_report.unique,
        lost: sink_report.lost.unwrap_or(0),
        duplicates: sink_report.duplicates,
        order_violations: sink_report.order_violations,
        gaps: sink_report.gaps,
        e2e_latency: sink_report
            .e2e_latency_steady
            .unwrap_or(sink_report.e2e_latency),
        ack_latency: devices_report.ack_latency_steady,
        e2e_latency_all: sink_report.e2e_latency,
        ack_latency_all: devices_report.ack_latency,
        sut_cpu_percent: sut_usage.percent_of_one_core,
        sut_cpu_us_per_msg,
        sut_rss: RssSummary {
            start_kib: rss_start,
            peak_kib: samples.iter().copied().max().unwrap_or(rss_end),
            end_kib: rss_end,
            samples_kib: samples,
        },
        steady_window_s: round3(window.as_secs_f64()),
        steady_messages,
        steady_rate: round1(steady_messages as f64 / window.as_secs_f64().max(1e-9)),
        cloud_broker_cpu_percent: cloud_usage.percent_of_one_core,
        tool_cpu_percent: tool_usage.percent_of_one_core,
        drain_s: round3(drain.as_secs_f64()),
        loadavg_at_window_end,
        control_thread_cpu_percent,
        dashboards: dashboards_report,
        devices: devices_report,
        sink: sink_report,
    })
}

/// The sluice-vs-bridge comparison, when both ran.
fn compare(runs: &[SutRun]) -> Option<Vec<ComparisonRow>> {
    let s = runs.iter().find(|r| r.sut == Sut::Sluice)?;
    let b = runs.iter().find(|r| r.sut == Sut::MosquittoBridge)?;
    let row = |metric: &'static str, f: fn(&SutRun) -> f64| {
        let (x, y) = (f(s), f(b));
        ComparisonRow {
            metric,
            sluice: x,
            mosquitto_bridge: y,
            ratio: (y != 0.0).then(|| (x / y * 100.0).round() / 100.0),
        }
    };
    Some(vec![
        row("SUT CPU, % of one core", |r| r.sut_cpu_percent),
        row("SUT CPU per message, µs", |r| r.sut_cpu_us_per_msg),
        row("SUT peak RSS, MiB", |r| {
            round1(r.sut_rss.peak_kib as f64 / 1024.0)
        }),
        row("delivery ratio", |r| r.delivery_ratio),
        row("e2e latency p50, ms", |r| r.e2e_latency.p50_ms),
        row("e2e latency p99, ms", |r| r.e2e_latency.p99_ms),
        row("e2e latency p99.9, ms", |r| r.e2e_latency.p999_ms),
        row("ack latency p50, ms", |r| r.ack_latency.p50_ms),
        row("ack latency p99, ms", |r| r.ack_latency.p99_ms),
    ])
}

fn compare_floor(runs: &[SutRun]) -> Option<FloorComparison> {
    let floor = runs
        .iter()
        .find(|r| r.sut == Sut::Floor)?
        .sut_cpu_us_per_msg;
    let us = |sut| {
        runs.iter()
            .find(|r| r.sut == sut)
            .map(|r| r.sut_cpu_us_per_msg)
    };
    let (sluice, bridge) = (us(Sut::Sluice), us(Sut::MosquittoBridge));
    let uring = us(Sut::FloorUring);
    let round2 = |x: f64| (x * 100.0).round() / 100.0;
    Some(FloorComparison {
        floor_us_per_msg: floor,
        sluice_us_per_msg: sluice,
        bridge_us_per_msg: bridge,
        floor_share_of_bridge: bridge.filter(|b| *b > 0.0).map(|b| round2(floor / b)),
        sluice_above_floor_us: sluice.map(|s| round2(s - floor)),
        bridge_above_floor_us: bridge.map(|b| round2(b - floor)),
        floor_uring_us_per_msg: uring,
        uring_over_epoll: uring
            .filter(|_| floor > 0.0)
            .map(|u| (u / floor * 1000.0).round() / 1000.0),
    })
}

fn compare_relay_floor(runs: &[SutRun]) -> Option<RelayFloorComparison> {
    let us = |sut| {
        runs.iter()
            .find(|r| r.sut == sut)
            .map(|r| r.sut_cpu_us_per_msg)
    };
    let relay = us(Sut::RelayFloor)?;
    let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) if y > 0.0 => Some((x / y * 1000.0).round() / 1000.0),
        _ => None,
    };
    Some(RelayFloorComparison {
        relay_floor_us_per_msg: relay,
        sluice_over_relay_floor: ratio(us(Sut::Sluice), Some(relay)),
        bridge_over_relay_floor: ratio(us(Sut::MosquittoBridge), Some(relay)),
        relay_floor_over_floor: ratio(Some(relay), us(Sut::Floor)),
        relay_floor_over_bridge: ratio(Some(relay), us(Sut::MosquittoBridge)),
    })
}
