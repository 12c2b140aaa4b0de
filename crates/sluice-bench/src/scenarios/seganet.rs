//! The `seganet` scenario: the SegaNet paper's experiment on this machine — how gateway designs
//! scale with the number of devices N. For every system under test (SUT) and every N of the
//! sweep it runs one *point*: devices → SUT → cloud Mosquitto over TLS 1.3, QoS 1, and records
//! p99 latency, the SUT's CPU and memory, and whether the offered load was actually achieved.
//!
//! Owns: the sweep, the point's measurement (sampling over *all* SUT processes) and its verdict,
//! and the reports (`report`: JSON, Markdown, PNG charts). Uses from the harness: the sluice and
//! bridge start-up ([`crate::harness::sut::start_sut`]), the per-device agent fleet
//! ([`crate::harness::agent_fleet`]), the admission checks that refuse points the machine cannot
//! hold ([`crate::harness::limits`]), the optional CPU constraint ([`crate::harness::cgroup`]:
//! taskset + cgroup quota) and `/proc` parsing ([`crate::harness::procfs`]).
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
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{Mosquitto, TestPki};
use tokio::time::Instant;

use crate::harness::agent_fleet::{probe_agent_footprint, AgentFleet};
pub use crate::harness::agent_fleet::{KERNEL_KIB_PER_AGENT, PROBE_AGENTS};
use crate::harness::cgroup::CpuCage;
pub use crate::harness::cgroup::{Constraint, Throttling};
use crate::harness::cloud::start_tls_cloud;
use crate::harness::limits::{admit_agents, admit_connections, Limits};
use crate::harness::machine::{self, Machine};
use crate::harness::phases::{cloud_sink, Phases, RssSampler};
use crate::harness::procfs::{
    cpu_sum, per_process_pss_kib, pss_sum, read_chars, rss_sum, MachineCpu,
};
use crate::harness::procfs::{round1, round3, usage_between, CpuMeter, Pid};
use crate::harness::sut::{self, require_sluice_bin, AggregateOpts, Sut, SutSpec};
use crate::load::devices::{spawn_devices, Arrivals, DevicesConfig, PayloadSize};
use crate::report::charts::{self, Chart, ChartPoint, Series};
use crate::stats::LatencySummary;

mod report;

use report::point_line;
pub use report::{charts_of, markdown, summary, write_reports};

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
    /// `[gateway] shards` for sluice (0 = one per core but one, at least one).
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

impl SeganetScenario {
    /// The timing of every point.
    pub fn phases(&self) -> Phases {
        let s = self;
        Phases::new(s.duration, s.ramp, s.settle, s.drain_idle, s.drain_max)
    }
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
    if config.suts.contains(&SegaSut::Sluice) {
        require_sluice_bin(&config.sluice_bin)?;
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
        steady_window_s: config.phases().steady_window().as_secs_f64(),
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
    let phases = config.phases();
    let (pki, cloud) = start_tls_cloud().await?;
    let cloud_pid = cloud
        .pid()
        .ok_or_else(|| anyhow!("the cloud Mosquitto is not running"))?;

    if sut_kind == SegaSut::Agents {
        let footprint = match *agent_footprint_kib {
            Some(kib) => kib,
            None => {
                let kib = probe_agent_footprint(&config.agent_bin, &pki, &cloud).await?;
                *agent_footprint_kib = Some(kib);
                kib
            }
        };
        admit_agents(n, footprint, limits, config.memory_fraction).map_err(PointEnd::Skipped)?;
    }

    let sink = cloud_sink(&pki, &cloud, n, config.progress_every).await?;

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
    let sampler = {
        let pids = pids.clone();
        RssSampler::start(rss_start, move || Some(rss_sum(&pids)))
    };

    let mut devices_config = DevicesConfig::new(sut.targets[0]);
    if sut.targets.len() > 1 {
        devices_config.targets = sut.targets.clone();
    }
    devices_config.devices = n;
    devices_config.rate_per_device = config.rate_per_device;
    phases.apply_to(&mut devices_config);
    devices_config.payload = config.payload;
    devices_config.protocol = ProtocolVersion::V311;
    devices_config.qos = config.qos;
    devices_config.arrivals = Arrivals::Periodic;
    devices_config.progress_every = config.progress_every;
    let devices = spawn_devices(devices_config)?;
    let started = devices.started();

    phases.until_steady(started).await;
    sink.set_steady_from(crate::payload::unix_now_ns());
    let sut_cpu_start = cpu_sum(&pids);
    let cloud_cpu = CpuMeter::start(Pid::Other(cloud_pid))?;
    let tool_cpu = CpuMeter::start(Pid::OwnProcess)?;
    let machine_start = MachineCpu::read();
    let throttle_start = cage.as_ref().and_then(CpuCage::throttling);
    let window_start = Instant::now();
    let before = devices.counters().snapshot();
    let cloud_before = (sink.received(), sink.unique(), read_chars(cloud_pid));
    phases.until_end(started).await;
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

    let drain = phases.drain(&sink, devices_report.sent).await;
    let rss_end = rss_sum(&pids);
    let pss_end = pss_sum(&pids);
    let samples = sampler.stop().await;
    let sink_report = sink.stop(Some(devices_report.sent)).await?;
    let sut_config = sut.config_text.clone();
    drop(sut);
    drop(cage);
    drop(cloud);
    drop(pki);

    let peak = samples
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
            let fleet = AgentFleet::start(
                &config.agent_bin,
                config.constrained.map(|c| c.core),
                n,
                "sluice-agent",
                pki,
                cloud,
                cage,
            )
            .await?;
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
        device_tls: false,
        sluice_extra: None,
    };
    let running = sut::start_sut(core_sut, &spec, pki, cloud).await?;
    Ok(StartedSut {
        pids: vec![running.pid],
        targets: vec![running.device_addr],
        config_text: running.config_text.clone(),
        _guard: SutGuard::Core(running),
    })
}
