//! The `seganet` scenario: the SegaNet paper's experiment on this machine — how gateway designs
//! scale with the number of devices N. For every system under test (SUT) and every N of the
//! sweep it runs one *point*: devices → SUT → cloud Mosquitto over TLS 1.3, QoS 1, and records
//! p99 latency, the SUT's CPU and memory, and whether the offered load was actually achieved.
//!
//! Owns: the sweep, starting the per-device agent fleet ([`crate::harness::agents`] processes), the
//! admission check that refuses agent points the machine cannot hold, the optional CPU
//! constraint (taskset + cgroup quota), sampling over *all* SUT processes, and the reports
//! (JSON, Markdown, PNG charts via [`crate::report::charts`]). Does not own: the sluice and bridge
//! start-up (reused from [`crate::harness::sut::start_sut`]), devices, sink, or `/proc` parsing.
//!
//! One point (each with a fresh PKI, cloud broker and sink, so points do not share state):
//! 1. Cloud Mosquitto (TLS 1.3 listener only); sink subscribed to `#` (QoS 1) over TLS 1.3.
//! 2. The SUT: `sluice` (child process; generated config, one uplink), `mosquitto-bridge` (edge
//!    Mosquitto bridging `topic # out 1`), or `agents` (N `sluice-bench agent` processes, each
//!    listening on its own port with its own TLS session to the cloud; device i → agent i).
//!    With a constraint, every SUT process is pinned to one core (taskset) and put in a child
//!    cgroup with a CPU quota; the cgroup is removed when the point ends.
//! 3. N devices for `duration` (connections ramped over `ramp`), each 10 msg/s by default,
//!    payload 100–1024 B. The steady-state window is `[start + ramp + settle, start + duration]`;
//!    CPU (utime + stime summed over every SUT process), this tool's CPU, the cloud broker's
//!    CPU and the whole machine's busy time (`/proc/stat`) are measured over exactly it.
//!    RSS is the sum of VmRSS over the SUT's processes, sampled every second; PSS (which shares
//!    out common pages, so it does not count the agents' shared binary N times) is read once
//!    at the end.
//! 4. Devices wait up to `drain_max` for their outstanding PUBACKs before they disconnect (so
//!    nothing they wrote dies in their socket buffers), then drain until the sink has
//!    everything, nothing new arrived for `drain_idle`, or `drain_max`.
//!
//! Honesty about the load: the generator costs CPU too (~12 µs per message here) and shares
//! the two cores with the SUT and the cloud broker, so every point reports the offered rate,
//! the achieved send rate in the window, this tool's CPU and a `limited_by` verdict; points
//! whose offered load was not achieved are drawn hollow in the charts.
//!
//! Admission of agent points (do not crash the machine): before N agents are started, the
//! memory they would take (N × measured per-agent PSS plus a kernel allowance, measured at the
//! previous agent point or on a probe of [`PROBE_AGENTS`] agents; from a point of 256 or more
//! agents, the drop of MemAvailable per agent if that is larger) must stay under
//! `memory_fraction` of MemAvailable, N processes must fit within 80 % of the pid, thread and
//! per-user process limits, 2N local ports (a listener and a cloud connection per agent) must
//! fit the ephemeral port range, and every point's N connections must fit the open-file limit.
//! A refused point is recorded as skipped, with the reason.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{Mosquitto, TestPki};
use tokio::sync::watch;
use tokio::time::{sleep, sleep_until, Instant};

use crate::harness::cloud::start_tls_cloud;
use crate::harness::machine::{self, Machine};
use crate::harness::procfs::{self, round1, round3, usage_between, CpuMeter, Pid};
use crate::harness::sut::{self, AggregateOpts, Sut, SutSpec};
use crate::load::devices::{spawn_devices, Arrivals, DevicesConfig, PayloadSize};
use crate::report::charts::{self, Chart, ChartPoint, Series};
use crate::sinks::sink::{start_sink, SinkConfig, SinkTls};
use crate::stats::LatencySummary;

/// Agents started to measure the per-agent footprint when no earlier point measured it.
pub const PROBE_AGENTS: u32 = 8;
/// Kernel memory per process not visible in PSS (task, stacks, page tables, sockets), KiB.
pub const KERNEL_KIB_PER_AGENT: u64 = 256;

/// A system under test of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SegaSut {
    Sluice,
    Agents,
    MosquittoBridge,
}

impl SegaSut {
    pub fn name(self) -> &'static str {
        match self {
            SegaSut::Sluice => "sluice",
            SegaSut::Agents => "agents",
            SegaSut::MosquittoBridge => "mosquitto-bridge",
        }
    }
    pub fn all() -> Vec<SegaSut> {
        vec![SegaSut::Sluice, SegaSut::Agents, SegaSut::MosquittoBridge]
    }
}

/// "Raspberry Pi-class" gateway: one core, a fraction of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Constraint {
    /// The core every SUT process is pinned to.
    pub core: u32,
    /// CPU quota of the SUT's cgroup, % of one core.
    pub quota_percent: u32,
}

/// Parameters of a sweep.
#[derive(Debug, Clone)]
pub struct SeganetScenario {
    /// Device counts, run in this order for each SUT.
    pub ns: Vec<u32>,
    /// SUTs, in this order.
    pub suts: Vec<SegaSut>,
    pub rate_per_device: f64,
    pub payload: PayloadSize,
    pub qos: QoS,
    /// Per point, ramp included.
    pub duration: Duration,
    pub ramp: Duration,
    pub settle: Duration,
    pub constrained: Option<Constraint>,
    pub sluice_bin: PathBuf,
    /// `[gateway] shards` for sluice (0 = one per core).
    pub sluice_shards: u32,
    /// `[uplink.aggregate]` for sluice.
    pub sluice_aggregate: AggregateOpts,
    /// The `sluice-bench` binary that has the `agent` subcommand.
    pub agent_bin: PathBuf,
    /// Agent points whose projected memory exceeds this share of MemAvailable are skipped.
    pub memory_fraction: f64,
    pub drain_idle: Duration,
    pub drain_max: Duration,
    /// Recorded in the report.
    pub command_line: String,
    pub progress_every: Option<Duration>,
    /// Where reports go after every point (`None`: only returned).
    pub out: Option<ReportFiles>,
}

/// Output directory and base name: `{dir}/{name}.json`, `.md`, `-p99.png`, `-cpu.png`, `-rss.png`.
#[derive(Debug, Clone)]
pub struct ReportFiles {
    pub dir: PathBuf,
    pub name: String,
}

impl ReportFiles {
    pub fn path(&self, suffix: &str) -> PathBuf {
        self.dir.join(format!("{}{suffix}", self.name))
    }
}

/// Parameters as run.
#[derive(Debug, Clone, Serialize)]
pub struct SeganetParams {
    pub ns: Vec<u32>,
    pub suts: Vec<SegaSut>,
    pub rate_per_device: f64,
    pub payload_min: usize,
    pub payload_max: usize,
    pub qos: u8,
    pub mqtt: &'static str,
    pub duration_s: f64,
    pub ramp_s: f64,
    pub settle_s: f64,
    pub steady_window_s: f64,
    pub sluice_bin: String,
    pub sluice_shards: u32,
    pub sluice_aggregate: AggregateOpts,
    pub agent_bin: String,
    pub memory_fraction: f64,
    pub drain_idle_s: f64,
    pub drain_max_s: f64,
}

/// How the CPU constraint was applied.
#[derive(Debug, Clone, Serialize)]
pub struct ConstraintReport {
    pub core: u32,
    pub quota_percent: u32,
    /// e.g. "taskset core 0 + cgroup v1 cpu.cfs_quota_us" or "taskset core 0 only".
    pub mechanism: String,
    /// Why cgroup v2 (or any cgroup) was not used, if it was not.
    pub notes: Vec<String>,
}

/// Outcome of one point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PointStatus {
    Measured,
    Skipped,
    Failed,
}

/// CPU throttling of the SUT's cgroup over the point (constrained runs).
#[derive(Debug, Clone, Serialize)]
pub struct Throttling {
    pub periods: u64,
    pub throttled_periods: u64,
    pub throttled_s: f64,
}

/// What a measured point measured.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub sut_processes: usize,
    /// From starting the SUT until its uplink(s) were connected.
    pub sut_start_s: f64,
    pub offered_rate: f64,
    /// PUBLISHes written per second in the steady-state window.
    pub achieved_send_rate: f64,
    /// PUBACKs received per second in the window.
    pub acked_rate: f64,
    pub sent: u64,
    pub acknowledged: u64,
    pub unique_received: u64,
    pub delivery_ratio: f64,
    pub lost: i64,
    pub duplicates: u64,
    pub order_violations: u64,
    /// PUBLISH packets reaching the cloud subscriber per second in the window (a SenML pack
    /// counts once).
    pub cloud_publishes_per_s: f64,
    /// Distinct device messages (records) reaching the cloud subscriber per second in the window.
    pub cloud_records_per_s: f64,
    /// Bytes the cloud broker read from its sockets per second in the window (TLS records from
    /// the SUT, i.e. the uplink's bytes on the wire; `rchar` of /proc/PID/io).
    pub cloud_read_bytes_per_s: f64,
    /// Device send → sink receive, messages sent in the window.
    pub e2e_latency: LatencySummary,
    /// Device PUBLISH → PUBACK, PUBLISHes written in the window.
    pub ack_latency: LatencySummary,
    /// utime + stime summed over all SUT processes over the window, % of one core.
    pub sut_cpu_percent: f64,
    pub sut_cpu_us_per_msg: f64,
    /// Sum over SUT processes of VmRSS, KiB.
    pub sut_rss_start_kib: u64,
    pub sut_rss_peak_kib: u64,
    pub sut_rss_end_kib: u64,
    /// Sum over SUT processes of PSS (smaps_rollup) at the end, KiB.
    pub sut_pss_end_kib: u64,
    /// MemAvailable right before the SUT started and at the end of the window, KiB: the drop
    /// includes kernel memory PSS does not show (and anything else that ran meanwhile).
    pub mem_available_before_kib: u64,
    pub mem_available_window_end_kib: u64,
    /// This tool (devices + sink), % of one core, over the window.
    pub tool_cpu_percent: f64,
    pub cloud_broker_cpu_percent: f64,
    /// All cores busy (non-idle, non-iowait) over the window, % of the whole machine.
    pub machine_busy_percent: f64,
    pub skipped_inflight_full: u64,
    pub unacknowledged: u64,
    pub reconnects: u64,
    pub connect_failures: u64,
    pub max_send_lag_ms: f64,
    pub limited_by: String,
    pub throttling: Option<Throttling>,
    pub steady_window_s: f64,
    pub drain_s: f64,
    pub loadavg_at_window_end: String,
    /// The generated sluice config, the bridge lines, or an agent's command line.
    pub sut_config: String,
}

/// One (SUT, N) point.
#[derive(Debug, Clone, Serialize)]
pub struct PointReport {
    pub sut: SegaSut,
    pub n: u32,
    pub status: PointStatus,
    /// Why a point was skipped or failed.
    pub reason: Option<String>,
    pub measurement: Option<Measurement>,
}

/// The whole sweep.
#[derive(Debug, Clone, Serialize)]
pub struct SeganetReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: SeganetParams,
    pub constraint: Option<ConstraintReport>,
    /// Per-agent memory estimate used for admission, KiB (PSS + kernel allowance).
    pub agent_footprint_kib: Option<u64>,
    pub points: Vec<PointReport>,
}

/// Run the sweep. Points that fail are recorded and the sweep goes on; reports are written
/// after every point when `config.out` is set.
pub async fn run_seganet(config: &SeganetScenario) -> anyhow::Result<SeganetReport> {
    validate(config)?;
    let machine = machine::machine(&config.command_line);
    let constraint = config.constrained.map(|c| {
        let (mechanism, notes) = CpuCage::describe(c);
        ConstraintReport {
            core: c.core,
            quota_percent: c.quota_percent,
            mechanism,
            notes,
        }
    });
    let mut report = SeganetReport {
        scenario: "seganet",
        machine,
        params: params(config),
        constraint,
        agent_footprint_kib: None,
        points: Vec::new(),
    };
    for &sut in &config.suts {
        for &n in &config.ns {
            eprintln!(
                "=== seganet: {} — N = {n}, {} msg/s each, {:?}{} ===",
                sut.name(),
                config.rate_per_device,
                config.duration,
                if config.constrained.is_some() {
                    " (constrained)"
                } else {
                    ""
                }
            );
            let point = run_point(config, sut, n, &mut report.agent_footprint_kib).await;
            eprintln!("{}", point_line(&point));
            report.points.push(point);
            if let Some(out) = &config.out {
                write_reports(&report, out)?;
            }
        }
    }
    Ok(report)
}

fn validate(config: &SeganetScenario) -> anyhow::Result<()> {
    if config.ns.is_empty() || config.ns.contains(&0) {
        bail!("the sweep needs device counts of at least 1");
    }
    if config.suts.is_empty() {
        bail!("no system under test selected");
    }
    if config.ramp + config.settle >= config.duration {
        bail!("ramp + settle must be shorter than the duration (the steady-state window lies between)");
    }
    if config.suts.contains(&SegaSut::Sluice) && !config.sluice_bin.is_file() {
        bail!(
            "sluice binary {} not found: build it with `cargo build --release -p sluice` or pass --sluice-bin",
            config.sluice_bin.display()
        );
    }
    if config.suts.contains(&SegaSut::Agents) && !config.agent_bin.is_file() {
        bail!("agent binary {} not found", config.agent_bin.display());
    }
    if !(config.memory_fraction > 0.0 && config.memory_fraction <= 0.9) {
        bail!("the memory fraction must be in (0, 0.9]");
    }
    Ok(())
}

fn params(config: &SeganetScenario) -> SeganetParams {
    SeganetParams {
        ns: config.ns.clone(),
        suts: config.suts.clone(),
        rate_per_device: config.rate_per_device,
        payload_min: config.payload.min,
        payload_max: config.payload.max,
        qos: config.qos as u8,
        mqtt: "3.1.1",
        duration_s: config.duration.as_secs_f64(),
        ramp_s: config.ramp.as_secs_f64(),
        settle_s: config.settle.as_secs_f64(),
        steady_window_s: config
            .duration
            .saturating_sub(config.ramp + config.settle)
            .as_secs_f64(),
        sluice_bin: config.sluice_bin.display().to_string(),
        sluice_shards: config.sluice_shards,
        sluice_aggregate: config.sluice_aggregate.clone(),
        agent_bin: config.agent_bin.display().to_string(),
        memory_fraction: config.memory_fraction,
        drain_idle_s: config.drain_idle.as_secs_f64(),
        drain_max_s: config.drain_max.as_secs_f64(),
    }
}

async fn run_point(
    config: &SeganetScenario,
    sut: SegaSut,
    n: u32,
    agent_footprint_kib: &mut Option<u64>,
) -> PointReport {
    let limits = Limits::read();
    let outcome = match admit_connections(n, &limits) {
        Err(reason) => Err(PointEnd::Skipped(reason)),
        Ok(()) => measure_point(config, sut, n, agent_footprint_kib, &limits).await,
    };
    match outcome {
        Ok(m) => PointReport {
            sut,
            n,
            status: PointStatus::Measured,
            reason: None,
            measurement: Some(m),
        },
        Err(PointEnd::Skipped(reason)) => PointReport {
            sut,
            n,
            status: PointStatus::Skipped,
            reason: Some(reason),
            measurement: None,
        },
        Err(PointEnd::Failed(error)) => PointReport {
            sut,
            n,
            status: PointStatus::Failed,
            reason: Some(format!("{error:#}")),
            measurement: None,
        },
    }
}

enum PointEnd {
    Skipped(String),
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for PointEnd {
    fn from(e: anyhow::Error) -> Self {
        PointEnd::Failed(e)
    }
}

async fn measure_point(
    config: &SeganetScenario,
    sut_kind: SegaSut,
    n: u32,
    agent_footprint_kib: &mut Option<u64>,
    limits: &Limits,
) -> Result<Measurement, PointEnd> {
    let (pki, cloud) = start_tls_cloud().await?;
    let cloud_pid = cloud
        .pid()
        .ok_or_else(|| anyhow!("the cloud Mosquitto is not running"))?;

    if sut_kind == SegaSut::Agents {
        let footprint = match *agent_footprint_kib {
            Some(kib) => kib,
            None => {
                let kib = probe_agent_footprint(config, &pki, &cloud).await?;
                *agent_footprint_kib = Some(kib);
                kib
            }
        };
        admit_agents(n, footprint, limits, config.memory_fraction).map_err(PointEnd::Skipped)?;
    }

    let mut sink_config = SinkConfig::new(cloud.tls_addr());
    sink_config.tls = Some(SinkTls {
        ca_file: pki.ca_path().to_path_buf(),
        client_cert: None,
        server_name: "127.0.0.1".to_string(),
    });
    sink_config.expect_devices = n;
    sink_config.progress_every = config.progress_every;
    let sink = start_sink(sink_config).await?;

    let cage = config.constrained.map(CpuCage::create);
    let mem_before = Limits::read().mem_available_kib;
    let start_at = Instant::now();
    let sut = start(config, sut_kind, n, &pki, &cloud, cage.as_ref()).await?;
    let sut_start = start_at.elapsed();
    if let (Some(cage), false) = (&cage, sut_kind == SegaSut::Agents) {
        // (Agents were moved in as they started, and started under taskset.)
        cage.confine(&sut.pids, true)?;
    }
    if sut_kind == SegaSut::Agents {
        // Refine the estimate for the next (larger) point from what N agents really use.
        if let Some(per) = per_process_pss_kib(&sut.pids) {
            *agent_footprint_kib = Some(per + KERNEL_KIB_PER_AGENT);
        }
    }
    if sut_kind == SegaSut::Agents && n >= 256 {
        let drop_per_agent =
            mem_before.saturating_sub(Limits::read().mem_available_kib) / u64::from(n);
        if let Some(kib) = agent_footprint_kib.as_mut() {
            *kib = (*kib).max(drop_per_agent);
        }
    }
    let pids = sut.pids.clone();

    let rss_start = rss_sum(&pids);
    let samples = Arc::new(Mutex::new(vec![rss_start]));
    let (stop_sampling, mut sampling_stopped) = watch::channel(false);
    let sampler = {
        let samples = samples.clone();
        let pids = pids.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = sampling_stopped.changed() => return,
                    _ = tick.tick() => {
                        let pids = pids.clone();
                        if let Ok(kib) = tokio::task::spawn_blocking(move || rss_sum(&pids)).await {
                            samples.lock().unwrap_or_else(|p| p.into_inner()).push(kib);
                        }
                    }
                }
            }
        })
    };

    let mut devices_config = DevicesConfig::new(sut.targets[0]);
    if sut.targets.len() > 1 {
        devices_config.targets = sut.targets.clone();
    }
    devices_config.devices = n;
    devices_config.rate_per_device = config.rate_per_device;
    devices_config.duration = config.duration;
    devices_config.ramp = config.ramp;
    devices_config.settle = config.settle;
    devices_config.payload = config.payload;
    devices_config.protocol = ProtocolVersion::V311;
    devices_config.qos = config.qos;
    devices_config.arrivals = Arrivals::Periodic;
    devices_config.progress_every = config.progress_every;
    // Devices wait for their outstanding PUBACKs as long as the drain may take: a device that
    // closed its socket earlier would discard what the kernel still held for a back-pressuring
    // SUT, and count it lost although the SUT never received it.
    devices_config.drain_timeout = config.drain_max;
    let devices = spawn_devices(devices_config)?;
    let started = devices.started();

    sleep_until(started + config.ramp + config.settle).await;
    sink.set_steady_from(crate::payload::unix_now_ns());
    let sut_cpu_start = cpu_sum(&pids);
    let cloud_cpu = CpuMeter::start(Pid::Other(cloud_pid))?;
    let tool_cpu = CpuMeter::start(Pid::OwnProcess)?;
    let machine_start = MachineCpu::read();
    let throttle_start = cage.as_ref().and_then(CpuCage::throttling);
    let window_start = Instant::now();
    let before = devices.counters().snapshot();
    let cloud_before = (sink.received(), sink.unique(), read_chars(cloud_pid));
    sleep_until(started + config.duration).await;
    let after = devices.counters().snapshot();
    let cloud_after = (sink.received(), sink.unique(), read_chars(cloud_pid));
    let window = window_start.elapsed();
    let sut_cpu = usage_between(cpu_sum(&pids).saturating_sub(sut_cpu_start), window);
    let cloud_usage = cloud_cpu.usage()?;
    let tool_usage = tool_cpu.usage()?;
    let machine_busy = MachineCpu::read().busy_percent_since(&machine_start);
    let throttle_end = cage.as_ref().and_then(CpuCage::throttling);
    let loadavg_at_window_end = machine::loadavg();
    let mem_window_end = Limits::read().mem_available_kib;
    let devices_report = devices.wait().await?;

    let drain_start = Instant::now();
    while sink.unique() < devices_report.sent
        && sink.idle_for() < config.drain_idle
        && drain_start.elapsed() < config.drain_max
    {
        sleep(Duration::from_millis(100)).await;
    }
    let drain = drain_start.elapsed();
    let rss_end = rss_sum(&pids);
    let pss_end = pss_sum(&pids);
    let _ = stop_sampling.send(true);
    let _ = sampler.await;
    let sink_report = sink.stop(Some(devices_report.sent)).await?;
    let sut_config = sut.config_text.clone();
    drop(sut);
    drop(cage);
    drop(cloud);
    drop(pki);

    let peak = samples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .copied()
        .chain([rss_end])
        .max()
        .unwrap_or(rss_end);
    let window_s = window.as_secs_f64().max(1e-9);
    let sent_in_window = after.sent - before.sent;
    let acked_in_window = after.acknowledged - before.acknowledged;
    let per_msg = match config.qos {
        QoS::AtMostOnce => sent_in_window,
        _ => acked_in_window,
    };
    let offered_rate = config.rate_per_device * f64::from(n);
    let achieved = sent_in_window as f64 / window_s;
    let skipped = after.skipped_inflight_full - before.skipped_inflight_full;
    let limited_by = limited_by(&Verdict {
        offered_rate,
        achieved_rate: achieved,
        acked_rate: acked_in_window as f64 / window_s,
        skipped_share: skipped as f64 / (offered_rate * window_s).max(1.0),
        tool_cpu_percent: tool_usage.percent_of_one_core,
        sut_cpu_percent: sut_cpu.percent_of_one_core,
        machine_busy_percent: machine_busy,
        quota_percent: config.constrained.map(|c| c.quota_percent),
    });
    Ok(Measurement {
        sut_processes: pids.len(),
        sut_start_s: round3(sut_start.as_secs_f64()),
        offered_rate,
        achieved_send_rate: round1(achieved),
        acked_rate: round1(acked_in_window as f64 / window_s),
        sent: devices_report.sent,
        acknowledged: devices_report.acknowledged,
        unique_received: sink_report.unique,
        delivery_ratio: sink_report.delivery_ratio.unwrap_or(0.0),
        lost: sink_report.lost.unwrap_or(0),
        duplicates: sink_report.duplicates,
        order_violations: sink_report.order_violations,
        cloud_publishes_per_s: round1(
            cloud_after.0.saturating_sub(cloud_before.0) as f64 / window.as_secs_f64(),
        ),
        cloud_records_per_s: round1(
            cloud_after.1.saturating_sub(cloud_before.1) as f64 / window.as_secs_f64(),
        ),
        cloud_read_bytes_per_s: round1(
            cloud_after.2.saturating_sub(cloud_before.2) as f64 / window.as_secs_f64(),
        ),
        e2e_latency: sink_report
            .e2e_latency_steady
            .unwrap_or(sink_report.e2e_latency),
        ack_latency: devices_report.ack_latency_steady,
        sut_cpu_percent: sut_cpu.percent_of_one_core,
        sut_cpu_us_per_msg: if per_msg == 0 {
            0.0
        } else {
            round3(sut_cpu.cpu_seconds * 1e6 / per_msg as f64)
        },
        sut_rss_start_kib: rss_start,
        sut_rss_peak_kib: peak,
        sut_rss_end_kib: rss_end,
        sut_pss_end_kib: pss_end,
        mem_available_before_kib: mem_before,
        mem_available_window_end_kib: mem_window_end,
        tool_cpu_percent: tool_usage.percent_of_one_core,
        cloud_broker_cpu_percent: cloud_usage.percent_of_one_core,
        machine_busy_percent: round1(machine_busy),
        skipped_inflight_full: devices_report.skipped_inflight_full,
        unacknowledged: devices_report.unacknowledged,
        reconnects: devices_report.reconnects,
        connect_failures: devices_report.connect_failures,
        max_send_lag_ms: devices_report.max_send_lag_ms,
        limited_by,
        throttling: match (throttle_start, throttle_end) {
            (Some(a), Some(b)) => Some(Throttling {
                periods: b.periods.saturating_sub(a.periods),
                throttled_periods: b.throttled_periods.saturating_sub(a.throttled_periods),
                throttled_s: round3(b.throttled_s - a.throttled_s),
            }),
            _ => None,
        },
        steady_window_s: round3(window.as_secs_f64()),
        drain_s: round3(drain.as_secs_f64()),
        loadavg_at_window_end,
        sut_config,
    })
}

/// Inputs of the `limited_by` verdict.
#[derive(Debug, Clone, Copy)]
pub struct Verdict {
    pub offered_rate: f64,
    pub achieved_rate: f64,
    /// PUBACKs per second over the window.
    pub acked_rate: f64,
    /// Device ticks skipped because 64 PUBLISHes already awaited PUBACK, ÷ ticks offered.
    pub skipped_share: f64,
    pub tool_cpu_percent: f64,
    pub sut_cpu_percent: f64,
    pub machine_busy_percent: f64,
    pub quota_percent: Option<u32>,
}

/// What kept a point from its offered load, in words (raw figures are in the report too).
pub fn limited_by(v: &Verdict) -> String {
    if v.achieved_rate >= 0.97 * v.offered_rate {
        if v.acked_rate < 0.95 * v.achieved_rate {
            return format!(
                "SUT falling behind (acked {:.0}% of what was sent; backlog growing)",
                100.0 * v.acked_rate / v.achieved_rate.max(1e-9)
            );
        }
        return "-".to_string();
    }
    let short = format!(
        "{:.0}% of offered",
        100.0 * v.achieved_rate / v.offered_rate.max(1e-9)
    );
    if v.skipped_share > 0.02 {
        let cap = match v.quota_percent {
            Some(q) if v.sut_cpu_percent >= 0.9 * f64::from(q) => {
                format!(", SUT at its {q}% CPU quota")
            }
            _ => String::new(),
        };
        return format!(
            "SUT backpressure ({short}; {:.0}% of ticks skipped, in-flight window full{cap})",
            100.0 * v.skipped_share
        );
    }
    if v.machine_busy_percent >= 90.0 {
        return format!(
            "machine CPU saturated ({short}; generator {:.0}%, SUT {:.0}% of a core)",
            v.tool_cpu_percent, v.sut_cpu_percent
        );
    }
    format!(
        "load generator ({short}; generator {:.0}% of a core)",
        v.tool_cpu_percent
    )
}

/// A started SUT. Dropping it stops every process.
struct StartedSut {
    pids: Vec<u32>,
    /// One address for sluice and the bridge; agent i's address at index i for agents.
    targets: Vec<SocketAddr>,
    config_text: String,
    _guard: SutGuard,
}

enum SutGuard {
    Core(#[allow(dead_code)] sut::RunningSut),
    Agents(#[allow(dead_code)] AgentFleet),
}

async fn start(
    config: &SeganetScenario,
    kind: SegaSut,
    n: u32,
    pki: &TestPki,
    cloud: &Mosquitto,
    cage: Option<&CpuCage>,
) -> anyhow::Result<StartedSut> {
    let core_sut = match kind {
        SegaSut::Sluice => Sut::Sluice,
        SegaSut::MosquittoBridge => Sut::MosquittoBridge,
        SegaSut::Agents => {
            let fleet = AgentFleet::start(config, n, "sluice-agent", pki, cloud, cage).await?;
            return Ok(StartedSut {
                pids: fleet.pids(),
                targets: fleet.addrs.clone(),
                config_text: fleet.command_line.clone(),
                _guard: SutGuard::Agents(fleet),
            });
        }
    };
    let spec = SutSpec {
        sluice_bin: config.sluice_bin.clone(),
        floor_bin: config.agent_bin.clone(),
        sluice_shards: config.sluice_shards,
        sluice_aggregate: config.sluice_aggregate.clone(),
        devices: n,
    };
    let running = sut::start_sut(core_sut, &spec, pki, cloud).await?;
    Ok(StartedSut {
        pids: vec![running.pid],
        targets: vec![running.device_addr],
        config_text: running.config_text.clone(),
        _guard: SutGuard::Core(running),
    })
}

/// N agent processes; dropping the fleet kills (SIGKILL) and reaps every one.
struct AgentFleet {
    children: Vec<Child>,
    addrs: Vec<SocketAddr>,
    command_line: String,
    _dir: tempfile::TempDir,
}

impl AgentFleet {
    async fn start(
        config: &SeganetScenario,
        n: u32,
        client_prefix: &str,
        pki: &TestPki,
        cloud: &Mosquitto,
        cage: Option<&CpuCage>,
    ) -> anyhow::Result<AgentFleet> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-bench-agents-")
            .tempdir()
            .context("creating the agents' directory")?;
        let log_path = dir.path().join("agents.stderr");
        let log = std::fs::File::create(&log_path).context("creating the agents' log")?;
        let agent_bin = config.agent_bin.clone();
        let ca = pki.ca_path().to_path_buf();
        let cloud_addr = cloud.tls_addr();
        let ready_dir = dir.path().to_path_buf();
        let pin = config.constrained.map(|c| c.core);
        let prefix = client_prefix.to_string();
        let parent = std::process::id();
        let command_line = format!(
            "{}{} agent --listen 127.0.0.1:0 --cloud {cloud_addr} --ca CA.pem --server-name 127.0.0.1 \
             --client-id {prefix}-I --ready-file DIR/I.ready --parent-pid {parent}",
            pin.map(|c| format!("taskset -c {c} ")).unwrap_or_default(),
            agent_bin.display(),
        );
        let spawned = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<Child>> {
            let mut children = Vec::with_capacity(n as usize);
            for i in 0..n {
                let mut cmd = match pin {
                    Some(core) => {
                        let mut c = Command::new("taskset");
                        c.arg("-c").arg(core.to_string()).arg(&agent_bin);
                        c
                    }
                    None => Command::new(&agent_bin),
                };
                cmd.arg("agent")
                    .arg("--listen")
                    .arg("127.0.0.1:0")
                    .arg("--cloud")
                    .arg(cloud_addr.to_string())
                    .arg("--ca")
                    .arg(&ca)
                    .arg("--server-name")
                    .arg("127.0.0.1")
                    .arg("--client-id")
                    .arg(format!("{prefix}-{i}"))
                    .arg("--ready-file")
                    .arg(ready_dir.join(format!("{i}.ready")))
                    .arg("--parent-pid")
                    .arg(parent.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(log.try_clone().context("sharing the agents' log")?);
                match cmd.spawn() {
                    Ok(child) => children.push(child),
                    Err(e) => {
                        kill_all(&mut children);
                        return Err(anyhow!(e).context(format!("spawning agent {i} of {n}")));
                    }
                }
            }
            Ok(children)
        })
        .await
        .map_err(|e| anyhow!("spawning agents panicked: {e}"))??;
        let mut fleet = AgentFleet {
            children: spawned,
            addrs: Vec::new(),
            command_line,
            _dir: dir,
        };
        if let Some(cage) = cage {
            cage.confine(&fleet.pids(), false)?;
        }
        fleet.wait_ready(n, &log_path).await?;
        Ok(fleet)
    }

    fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// Wait until every agent wrote its ready file (listening, cloud session up).
    async fn wait_ready(&mut self, n: u32, log_path: &Path) -> anyhow::Result<()> {
        let dir = self._dir.path().to_path_buf();
        let limit = Duration::from_secs(20) + Duration::from_millis(10) * n;
        let deadline = Instant::now() + limit;
        let mut last_liveness = Instant::now();
        loop {
            let ready = count_ready(&dir);
            if ready >= n as usize {
                break;
            }
            if last_liveness.elapsed() >= Duration::from_secs(1) {
                last_liveness = Instant::now();
                for (i, child) in self.children.iter_mut().enumerate() {
                    if let Ok(Some(status)) = child.try_wait() {
                        bail!(
                            "agent {i} exited during start-up ({status}); agents' stderr:\n{}",
                            tail(log_path, 20)
                        );
                    }
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "only {ready} of {n} agents were ready after {limit:?}; agents' stderr:\n{}",
                    tail(log_path, 20)
                );
            }
            sleep(Duration::from_millis(100)).await;
        }
        let mut addrs = Vec::with_capacity(n as usize);
        for i in 0..n {
            let path = dir.join(format!("{i}.ready"));
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            addrs.push(
                text.trim()
                    .parse()
                    .with_context(|| format!("{} holds no address", path.display()))?,
            );
        }
        self.addrs = addrs;
        Ok(())
    }
}

impl Drop for AgentFleet {
    fn drop(&mut self) {
        kill_all(&mut self.children);
    }
}

fn kill_all(children: &mut [Child]) {
    for child in children.iter_mut() {
        let _ = child.kill();
    }
    for child in children.iter_mut() {
        let _ = child.wait();
    }
}

fn count_ready(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".ready"))
                .count()
        })
        .unwrap_or(0)
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Start [`PROBE_AGENTS`] agents, read their PSS, stop them: KiB per agent (PSS + kernel).
async fn probe_agent_footprint(
    config: &SeganetScenario,
    pki: &TestPki,
    cloud: &Mosquitto,
) -> anyhow::Result<u64> {
    let fleet =
        AgentFleet::start(config, PROBE_AGENTS, "sluice-agent-probe", pki, cloud, None).await?;
    sleep(Duration::from_millis(300)).await;
    let per = per_process_pss_kib(&fleet.pids())
        .ok_or_else(|| anyhow!("could not read the probe agents' PSS"))?;
    drop(fleet);
    Ok(per + KERNEL_KIB_PER_AGENT)
}

/// System limits that bound how many processes and connections a point may use.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Limits {
    pub mem_available_kib: u64,
    pub pid_max: u64,
    pub threads_max: u64,
    /// RLIMIT_NPROC (soft) of this process.
    pub max_user_processes: u64,
    /// RLIMIT_NOFILE (soft) of this process (the devices, the sink and, inherited, the cloud
    /// broker's limit).
    pub max_open_files: u64,
    /// Threads on the machine now (`/proc/loadavg`, 4th field).
    pub tasks_now: u64,
    /// Size of the local (ephemeral) port range, `ip_local_port_range`.
    pub ephemeral_ports: u64,
}

impl Limits {
    pub fn read() -> Limits {
        let read_u64 = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let loadavg = machine::loadavg();
        Limits {
            mem_available_kib: meminfo_kib(&meminfo, "MemAvailable:").unwrap_or(0),
            pid_max: read_u64("/proc/sys/kernel/pid_max").unwrap_or(32_768),
            threads_max: read_u64("/proc/sys/kernel/threads-max").unwrap_or(u64::MAX),
            max_user_processes: soft_limit(&limits, "Max processes").unwrap_or(u64::MAX),
            max_open_files: soft_limit(&limits, "Max open files").unwrap_or(1024),
            tasks_now: loadavg
                .split_whitespace()
                .nth(3)
                .and_then(|f| f.split_once('/'))
                .and_then(|(_, total)| total.parse().ok())
                .unwrap_or(0),
            ephemeral_ports: std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
                .ok()
                .and_then(|s| {
                    let mut it = s.split_whitespace().filter_map(|x| x.parse::<u64>().ok());
                    Some(it.next_back()? + 1 - it.next()?)
                })
                .unwrap_or(28_232),
        }
    }
}

/// `KEY: value kB` from `/proc/meminfo` text.
pub fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(key))?
        .trim_start_matches(key)
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The soft limit of `name` from `/proc/<pid>/limits` text ("unlimited" → `u64::MAX`).
pub fn soft_limit(text: &str, name: &str) -> Option<u64> {
    let rest = text
        .lines()
        .find(|l| l.starts_with(name))?
        .get(name.len()..)?;
    let soft = rest.split_whitespace().next()?;
    if soft == "unlimited" {
        Some(u64::MAX)
    } else {
        soft.parse().ok()
    }
}

/// Whether N device connections fit this process's open-file limit (every SUT).
pub fn admit_connections(n: u32, limits: &Limits) -> Result<(), String> {
    let need = u64::from(n) + 1024;
    if need > limits.max_open_files {
        return Err(format!(
            "{n} devices need about {need} open files in sluice-bench and in the cloud broker; \
             the limit is {} (raise it with `ulimit -n`)",
            limits.max_open_files
        ));
    }
    Ok(())
}

/// Whether N agent processes of `per_agent_kib` each fit the machine (see the module docs).
pub fn admit_agents(
    n: u32,
    per_agent_kib: u64,
    limits: &Limits,
    memory_fraction: f64,
) -> Result<(), String> {
    let projected = u64::from(n) * per_agent_kib;
    let bound = (limits.mem_available_kib as f64 * memory_fraction) as u64;
    if projected > bound {
        return Err(format!(
            "{n} agents × {:.1} MiB (measured PSS + {KERNEL_KIB_PER_AGENT} KiB kernel allowance) = \
             {:.1} GiB projected, over {:.0}% of MemAvailable ({:.1} GiB)",
            per_agent_kib as f64 / 1024.0,
            projected as f64 / 1048576.0,
            memory_fraction * 100.0,
            limits.mem_available_kib as f64 / 1048576.0
        ));
    }
    let process_limit = limits
        .pid_max
        .min(limits.threads_max)
        .min(limits.max_user_processes);
    let process_bound = process_limit / 10 * 8;
    if limits.tasks_now + u64::from(n) > process_bound {
        return Err(format!(
            "{n} agent processes on top of the {} threads already running exceed 80% of the \
             process limit ({process_limit}: min of pid_max, threads-max, ulimit -u)",
            limits.tasks_now
        ));
    }
    // Each agent takes a listening port from the ephemeral range (it binds port 0) and its
    // cloud connection takes another (all go to the same cloud address, so they cannot share).
    let ports = 2 * u64::from(n) + 2048;
    if ports > limits.ephemeral_ports {
        return Err(format!(
            "{n} agents need about {ports} local ports (a listener and a cloud connection each, \
             plus slack for connections still in TIME_WAIT) but the ephemeral range \
             (ip_local_port_range) holds {}",
            limits.ephemeral_ports
        ));
    }
    Ok(())
}

/// utime + stime summed over `pids` (processes that are gone count 0).
fn cpu_sum(pids: &[u32]) -> Duration {
    pids.iter()
        .filter_map(|&p| procfs::cpu_time(Pid::Other(p)).ok())
        .sum()
}

fn rss_sum(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|&p| procfs::rss_kib(Pid::Other(p)).ok())
        .sum()
}

fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    meminfo_kib(&text, "Pss:")
}

fn pss_sum(pids: &[u32]) -> u64 {
    pids.iter().filter_map(|&p| pss_kib(p)).sum()
}

/// Mean PSS of up to 64 of `pids`, KiB.
fn per_process_pss_kib(pids: &[u32]) -> Option<u64> {
    let step = (pids.len() / 64).max(1);
    let values: Vec<u64> = pids
        .iter()
        .step_by(step)
        .filter_map(|&p| pss_kib(p))
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<u64>() / values.len() as u64)
}

/// Aggregate CPU counters of `/proc/stat` ("cpu" line), in clock ticks.
#[derive(Debug, Clone, Copy, Default)]
struct MachineCpu {
    busy: u64,
    total: u64,
}

impl MachineCpu {
    fn read() -> MachineCpu {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let fields: Vec<u64> = text
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .take(8)
            .filter_map(|f| f.parse().ok())
            .collect();
        let total: u64 = fields.iter().sum();
        let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
        MachineCpu {
            busy: total.saturating_sub(idle),
            total,
        }
    }

    fn busy_percent_since(&self, start: &MachineCpu) -> f64 {
        let total = self.total.saturating_sub(start.total);
        if total == 0 {
            return 0.0;
        }
        100.0 * self.busy.saturating_sub(start.busy) as f64 / total as f64
    }
}

/// The CPU constraint of one point: a child cgroup with a quota (v2 `cpu.max` where the cpu
/// controller is available to cgroup v2, else v1 `cpu.cfs_quota_us`), plus taskset to one core.
/// Dropping it moves any process still inside back to the parent cgroup and removes the child.
struct CpuCage {
    constraint: Constraint,
    cgroup: Option<Cgroup>,
}

#[derive(Debug, Clone)]
struct Cgroup {
    dir: PathBuf,
    parent: PathBuf,
    version: u8,
}

/// cgroup hierarchies found in `/proc/mounts`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupMounts {
    /// cgroup v2 mount point and whether "cpu" is in its `cgroup.controllers`.
    pub v2: Option<(PathBuf, bool)>,
    /// cgroup v1 mount point of the `cpu` controller.
    pub v1_cpu: Option<PathBuf>,
}

/// Find the cgroup mounts in `/proc/mounts` text; `v2_has_cpu` reads a v2 root's controllers.
pub fn parse_cgroup_mounts(mounts: &str, v2_has_cpu: impl Fn(&Path) -> bool) -> CgroupMounts {
    let mut found = CgroupMounts::default();
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(dir), Some(kind), Some(opts)) = (fields.get(1), fields.get(2), fields.get(3))
        else {
            continue;
        };
        let dir = PathBuf::from(dir);
        match *kind {
            "cgroup2" if found.v2.is_none() => {
                let cpu = v2_has_cpu(&dir);
                found.v2 = Some((dir, cpu));
            }
            "cgroup" if opts.split(',').any(|o| o == "cpu") && found.v1_cpu.is_none() => {
                found.v1_cpu = Some(dir);
            }
            _ => {}
        }
    }
    found
}

impl CpuCage {
    fn mounts() -> CgroupMounts {
        let text = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        parse_cgroup_mounts(&text, |dir| {
            std::fs::read_to_string(dir.join("cgroup.controllers"))
                .map(|c| c.split_whitespace().any(|x| x == "cpu"))
                .unwrap_or(false)
        })
    }

    /// How a constraint will be applied here, without applying it.
    fn describe(c: Constraint) -> (String, Vec<String>) {
        let probe = CpuCage::create(c);
        let mechanism = match &probe.cgroup {
            Some(g) if g.version == 2 => format!(
                "taskset to core {} + cgroup v2 cpu.max {}% of one core",
                c.core, c.quota_percent
            ),
            Some(_) => format!(
                "taskset to core {} + cgroup v1 cpu.cfs_quota_us {}% of one core",
                c.core, c.quota_percent
            ),
            None => format!("taskset to core {} only (no CPU quota)", c.core),
        };
        let mut notes = Vec::new();
        let m = CpuCage::mounts();
        match &m.v2 {
            None => notes.push("no cgroup v2 hierarchy is mounted".to_string()),
            Some((dir, false)) => notes.push(format!(
                "cgroup v2 is mounted at {} but its cpu controller is not available there \
                 (cgroup.controllers lacks \"cpu\"; on this hybrid set-up it is bound to the v1 \
                 hierarchy), so cpu.max cannot be used",
                dir.display()
            )),
            Some((_, true)) => {}
        }
        if probe.cgroup.is_none() {
            notes.push(
                "no writable cgroup with a cpu controller was found: the SUT is only pinned \
                 to one core and may use all of it"
                    .to_string(),
            );
        }
        (mechanism, notes)
    }

    fn create(c: Constraint) -> CpuCage {
        let m = CpuCage::mounts();
        let name = format!("sluice-bench-seganet-{}", std::process::id());
        let quota_us = u64::from(c.quota_percent) * 1000;
        let cgroup = match (&m.v2, &m.v1_cpu) {
            (Some((root, true)), _) => {
                let dir = root.join(&name);
                let ok = std::fs::create_dir_all(&dir).is_ok()
                    && std::fs::write(dir.join("cpu.max"), format!("{quota_us} 100000")).is_ok();
                if ok {
                    Some(Cgroup {
                        dir,
                        parent: root.clone(),
                        version: 2,
                    })
                } else {
                    let _ = std::fs::remove_dir(&dir);
                    None
                }
            }
            (_, Some(root)) => {
                let dir = root.join(&name);
                let ok = std::fs::create_dir_all(&dir).is_ok()
                    && std::fs::write(dir.join("cpu.cfs_period_us"), "100000").is_ok()
                    && std::fs::write(dir.join("cpu.cfs_quota_us"), quota_us.to_string()).is_ok();
                if ok {
                    Some(Cgroup {
                        dir,
                        parent: root.clone(),
                        version: 1,
                    })
                } else {
                    let _ = std::fs::remove_dir(&dir);
                    None
                }
            }
            _ => None,
        };
        CpuCage {
            constraint: c,
            cgroup,
        }
    }

    /// Move `pids` into the cgroup and, if `pin`, pin all their threads to the core (agents are
    /// started under `taskset` already).
    fn confine(&self, pids: &[u32], pin: bool) -> anyhow::Result<()> {
        if let Some(g) = &self.cgroup {
            for pid in pids {
                std::fs::write(g.dir.join("cgroup.procs"), pid.to_string()).with_context(|| {
                    format!("moving pid {pid} into the cgroup {}", g.dir.display())
                })?;
            }
        }
        if pin {
            for pid in pids {
                let status = Command::new("taskset")
                    .args(["-a", "-p", "-c"])
                    .arg(self.constraint.core.to_string())
                    .arg(pid.to_string())
                    .stdout(Stdio::null())
                    .status()
                    .context("running taskset")?;
                if !status.success() {
                    bail!(
                        "taskset could not pin pid {pid} to core {}",
                        self.constraint.core
                    );
                }
            }
        }
        Ok(())
    }

    /// The cgroup's throttling counters so far.
    fn throttling(&self) -> Option<Throttling> {
        let g = self.cgroup.as_ref()?;
        let text = std::fs::read_to_string(g.dir.join("cpu.stat")).ok()?;
        let field = |key: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        };
        let throttled_s = if g.version == 2 {
            field("throttled_usec ")? as f64 / 1e6
        } else {
            field("throttled_time ")? as f64 / 1e9
        };
        Some(Throttling {
            periods: field("nr_periods ")?,
            throttled_periods: field("nr_throttled ")?,
            throttled_s,
        })
    }
}

impl Drop for CpuCage {
    fn drop(&mut self) {
        let Some(g) = &self.cgroup else {
            return;
        };
        for _ in 0..50 {
            if std::fs::remove_dir(&g.dir).is_ok() {
                return;
            }
            let procs = std::fs::read_to_string(g.dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.split_whitespace() {
                let _ = std::fs::write(g.parent.join("cgroup.procs"), pid);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(dir = %g.dir.display(), "could not remove the benchmark cgroup");
    }
}

/// One line per point, for stderr.
fn point_line(p: &PointReport) -> String {
    match (&p.measurement, &p.reason) {
        (Some(m), _) => format!(
            "{} N={}: delivery {:.6} ({} of {}), sent {:.0}/s of {:.0}/s offered, e2e p50/p99 {:.2}/{:.2} ms, \
             ack p99 {:.2} ms, SUT CPU {:.1}% ({} processes), RSS peak {:.1} MiB, PSS {:.1} MiB, tool CPU {:.1}%, \
             machine busy {:.0}%, limited by: {}",
            p.sut.name(),
            p.n,
            m.delivery_ratio,
            m.unique_received,
            m.sent,
            m.achieved_send_rate,
            m.offered_rate,
            m.e2e_latency.p50_ms,
            m.e2e_latency.p99_ms,
            m.ack_latency.p99_ms,
            m.sut_cpu_percent,
            m.sut_processes,
            m.sut_rss_peak_kib as f64 / 1024.0,
            m.sut_pss_end_kib as f64 / 1024.0,
            m.tool_cpu_percent,
            m.machine_busy_percent,
            m.limited_by
        ),
        (None, reason) => format!(
            "{} N={}: {:?} — {}",
            p.sut.name(),
            p.n,
            p.status,
            reason.as_deref().unwrap_or("")
        ),
    }
}

/// Write `{name}.json`, `{name}.md` and the charts.
pub fn write_reports(report: &SeganetReport, out: &ReportFiles) -> anyhow::Result<()> {
    std::fs::create_dir_all(&out.dir).with_context(|| format!("creating {}", out.dir.display()))?;
    let json = serde_json::to_string_pretty(report).context("serialising the report")?;
    let json_path = out.path(".json");
    std::fs::write(&json_path, format!("{json}\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    for (suffix, chart) in charts_of(report) {
        charts::write_png(&chart, &out.path(suffix))?;
    }
    let md_path = out.path(".md");
    std::fs::write(&md_path, markdown(report, &out.name))
        .with_context(|| format!("writing {}", md_path.display()))?;
    Ok(())
}

fn series(report: &SeganetReport, value: fn(&Measurement) -> f64) -> Vec<Series> {
    report
        .params
        .suts
        .iter()
        .map(|&sut| Series {
            label: sut.name().to_string(),
            points: report
                .points
                .iter()
                .filter(|p| p.sut == sut)
                .filter_map(|p| {
                    let m = p.measurement.as_ref()?;
                    Some(ChartPoint {
                        n: f64::from(p.n),
                        value: value(m),
                        hollow: m.limited_by != "-",
                    })
                })
                .collect(),
        })
        .collect()
}

/// The charts of a report, with their file suffixes.
pub fn charts_of(report: &SeganetReport) -> Vec<(&'static str, Chart)> {
    let setting = match &report.constraint {
        Some(c) => format!(", SUT on 1 core at {}%", c.quota_percent),
        None => String::new(),
    };
    let load = format!(
        "{} msg/s per device, QoS 1, TLS 1.3 uplink{setting}",
        report.params.rate_per_device
    );
    let footnote = Some(
        "hollow marker: the point did not sustain the offered load (see 'limited by' in the report)"
            .to_string(),
    );
    vec![
        (
            "-p99.png",
            Chart {
                title: format!("p99 end-to-end latency vs devices ({load})"),
                y_label: "p99 latency, ms (log scale)".to_string(),
                log_y: true,
                footnote: footnote.clone(),
                series: series(report, |m| m.e2e_latency.p99_ms),
            },
        ),
        (
            "-cpu.png",
            Chart {
                title: format!("Gateway CPU vs devices ({load})"),
                y_label: "CPU, % of one core (all SUT processes)".to_string(),
                log_y: false,
                footnote: footnote.clone(),
                series: series(report, |m| m.sut_cpu_percent),
            },
        ),
        (
            "-rss.png",
            Chart {
                title: format!("Gateway memory vs devices ({load})"),
                y_label: "PSS at end, MiB (log scale)".to_string(),
                log_y: true,
                footnote,
                series: series(report, |m| m.sut_pss_end_kib as f64 / 1024.0),
            },
        ),
    ]
}

/// The Markdown report (machine, command, table, charts, skipped points, caveats).
pub fn markdown(report: &SeganetReport, name: &str) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "# SegaNet experiment{}: {}\n",
        if report.constraint.is_some() {
            " (constrained SUT)"
        } else {
            ""
        },
        p.suts
            .iter()
            .map(|s| match s {
                SegaSut::Sluice => "sluice",
                SegaSut::Agents => "per-device agents",
                SegaSut::MosquittoBridge => "Mosquitto bridge",
            })
            .collect::<Vec<_>>()
            .join(" vs ")
    );
    let _ = writeln!(
        out,
        "Generated by `sluice-bench scenario seganet`; raw figures in [`{name}.json`]({name}.json).\n"
    );
    let _ = writeln!(
        out,
        "commit `{}`{} · nproc {} · CPU {} · kernel {} · {} · loadavg at start {} · started {}\n",
        m.commit,
        if m.worktree_dirty {
            " (work tree dirty)"
        } else {
            ""
        },
        m.nproc,
        m.cpu_model,
        m.kernel,
        m.mosquitto_version,
        m.loadavg_at_start,
        m.started_at
    );
    let _ = writeln!(out, "```sh\n{}\n```\n", m.command_line);
    let _ = writeln!(
        out,
        "sluice: {}\n",
        report.params.sluice_aggregate.describe()
    );
    let _ = writeln!(
        out,
        "Load: N devices × {} msg/s, payload {}..{} B, QoS {}, MQTT {}; uplink TLS 1.3, QoS 1. \
         Each point {} s ({} s ramp, {} s settle, steady-state window {} s).\n",
        p.rate_per_device,
        p.payload_min,
        p.payload_max,
        p.qos,
        p.mqtt,
        p.duration_s,
        round3(p.ramp_s),
        round3(p.settle_s),
        round3(p.steady_window_s)
    );
    if let Some(c) = &report.constraint {
        let _ = writeln!(out, "Constraint: {}.", c.mechanism);
        for note in &c.notes {
            let _ = writeln!(out, "- {note}");
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "## Charts\n");
    for (suffix, chart) in charts_of(report) {
        let _ = writeln!(out, "![{}]({name}{suffix})\n", chart.title);
    }
    let _ = writeln!(out, "## Results\n");
    let _ = writeln!(out, "{}", table(report));
    let failed: Vec<&PointReport> = report
        .points
        .iter()
        .filter(|p| p.status != PointStatus::Measured)
        .collect();
    if !failed.is_empty() {
        let _ = writeln!(out, "### Points not measured\n");
        for p in failed {
            let _ = writeln!(
                out,
                "- **{} N={}** ({:?}): {}",
                p.sut.name(),
                p.n,
                p.status,
                one_line(p.reason.as_deref().unwrap_or(""))
            );
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "## How to read it\n");
    let _ = writeln!(
        out,
        "- **e2e** = sink receive time − send timestamp in the payload (same clock), messages sent \
         in the steady-state window. **ack** = device PUBLISH → PUBACK. sluice and the agents \
         acknowledge a device only after the cloud acknowledged the message; the Mosquitto bridge \
         acknowledges on receipt, so its ack latency is not like for like.\n\
         - **SUT CPU** = utime + stime summed over every SUT process (N processes for `agents`) \
         over the window, % of one core; **µs/msg** divides by the PUBACKs received in the window.\n\
         - **RSS** sums VmRSS over the SUT processes (for `agents` this counts the shared binary \
         and libraries N times); **PSS** (from smaps_rollup, at the end) shares those pages out \
         and is the better measure of memory the agents really take.\n\
         - **offered / sent / acked** rates are per second over the window. **limited by** says \
         what kept a point from sustaining its offered load (`-`: nothing): SUT \
         backpressure (device in-flight windows of 64 full, ticks skipped), the SUT falling \
         behind (sent at the offered rate but acknowledged more slowly: a backlog grows and \
         latency is dominated by queueing), the load generator, or both cores saturated. \
         Hollow markers in the charts are such points.\n\
         - **machine busy** = all non-idle CPU time of the machine over the window (both cores = \
         100%), including other users of the machine."
    );
    let _ = writeln!(out, "\n## Caveats\n");
    let _ = writeln!(
        out,
        "- Everything (devices, sink, cloud broker, SUT) shares {} cores; the load generator \
         costs CPU per message, so at large N the generator — not the SUT — may cap the rate. \
         Read `sent/s` against `offered/s` and the tool's CPU before comparing SUTs at a point.\n\
         - Other engineers' builds and benchmarks may run on the same machine: see the load \
         average at start and at the end of each window.\n\
         - One run per point; no repetitions, so differences of a few percent are within noise.",
        m.nproc
    );
    out
}

/// A multi-line reason on one line, repeated lines (e.g. the same error from many agents)
/// written once with a count.
fn one_line(text: &str) -> String {
    let mut parts: Vec<(String, usize)> = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match parts.iter_mut().find(|(l, _)| l == line) {
            Some((_, count)) => *count += 1,
            None => parts.push((line.to_string(), 1)),
        }
    }
    parts
        .into_iter()
        .map(|(line, count)| match count {
            1 => line,
            n => format!("{line} (×{n})"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn table(report: &SeganetReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| SUT | N | procs | offered/s | sent/s | acked/s | delivery | e2e p50 / p99 ms | ack p99 ms | \
         SUT CPU % | µs/msg | RSS peak MiB | PSS MiB | tool CPU % | cloud CPU % | cloud PUBLISH/s | cloud records/s | cloud bytes in/s | machine busy % | limited by | loadavg (window end) |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    );
    for p in &report.points {
        match &p.measurement {
            Some(m) => {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.6} | {:.2} / {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |",
                    p.sut.name(),
                    p.n,
                    m.sut_processes,
                    m.offered_rate,
                    m.achieved_send_rate,
                    m.acked_rate,
                    m.delivery_ratio,
                    m.e2e_latency.p50_ms,
                    m.e2e_latency.p99_ms,
                    m.ack_latency.p99_ms,
                    m.sut_cpu_percent,
                    m.sut_cpu_us_per_msg,
                    m.sut_rss_peak_kib as f64 / 1024.0,
                    m.sut_pss_end_kib as f64 / 1024.0,
                    m.tool_cpu_percent,
                    m.cloud_broker_cpu_percent,
                    m.cloud_publishes_per_s,
                    m.cloud_records_per_s,
                    m.cloud_read_bytes_per_s,
                    m.machine_busy_percent,
                    m.limited_by,
                    m.loadavg_at_window_end
                        .split_whitespace()
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" "),
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "| {} | {} | | | | | {} | | | | | | | | | | | | | see below | |",
                    p.sut.name(),
                    p.n,
                    match p.status {
                        PointStatus::Skipped => "skipped",
                        _ => "failed",
                    }
                );
            }
        }
    }
    out
}

/// The printed summary table (what the command prints at the end).
pub fn summary(report: &SeganetReport) -> String {
    table(report)
}

/// `rchar` of /proc/PID/io: bytes the process read through read-like syscalls (0 if unknown).
fn read_chars(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("rchar:").map(|v| v.trim().parse().ok()))
                .flatten()
        })
        .unwrap_or(0)
}
