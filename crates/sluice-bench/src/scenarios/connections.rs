//! The `connections` scenario: how many idle device connections a system under test (SUT)
//! holds on this machine, what each costs in resident memory, and how fast they connect.
//!
//! Owns: the choice of N, the per-SUT run (connect, hold, disconnect), RSS sampling until
//! stable, and the report. Uses: the idle-connection fleet and its `idle` worker processes
//! ([`crate::load::idle`]), open-file limits ([`crate::harness::limits`]) and the SUTs (sluice
//! via [`crate::harness::sut::SluiceChild`], Mosquitto via `sluice-testkit`).
//!
//! # Limits on this kind of machine
//! Every process has a hard RLIMIT_NOFILE (20,000 here) that an unprivileged process cannot
//! raise. The tool raises its *soft* limit to the hard limit at start (`prlimit --pid`, so no
//! `unsafe` and no FFI crate), and the SUTs it spawns inherit that. One socket is one file, so:
//! - a SUT can hold at most `its limit − files it already has open` connections; with
//!   `n = None` ("max") the scenario targets exactly that for the first SUT, minus a margin of
//!   [`FD_MARGIN`], and uses the same N for every SUT so they are compared at equal load;
//! - the tool itself opens one socket per connection too, so connections are spread over
//!   worker processes of at most `per_process` connections (default 19,000) each —
//!   `sluice-bench idle` children — whenever one process is not enough.
//!
//! # The idle worker protocol (`sluice-bench idle`)
//! A worker opens its connections (at most `concurrency` attempts at a time), prints one JSON
//! line [`IdleReport`] with `"phase": "connected"` on stdout once every attempt finished, holds
//! the connections until its stdin closes, disconnects them and prints a second line with
//! `"phase": "closed"` (now with `dropped_while_held`). Logs go to stderr.
//!
//! # Measurements
//! - *CONNACK latency*: CONNECT written → CONNACK read. *Connect time*: TCP connect started →
//!   CONNACK read (includes waiting in the SUT's accept backlog).
//! - *Connect rate*: connections ÷ (last CONNACK − first attempt), over all workers (wall
//!   clock timestamps; same machine).
//! - *RSS per connection*: the SUT's VmRSS once stable with all connections open, minus its
//!   VmRSS once stable before the first connection, ÷ connections. "Stable": sampled every
//!   500 ms until the last four samples are within 0.5 % (or 64 KiB) of each other, for at most
//!   20 s. Kernel socket buffers are not in RSS and not counted.
//! - The SUT's open files (`/proc/<pid>/fd`) before and after, and its own limit.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::ProtocolVersion;
use sluice_testkit::Mosquitto;
use tokio::time::{sleep, Instant};

use crate::harness::limits::{fd_limit, open_fds, raise_fd_limit, FD_MARGIN};
pub use crate::harness::limits::{FdLimit, FdLimitChange};
use crate::harness::machine::{machine, Machine};
use crate::harness::procfs::{self, round1, round3, Pid};
use crate::harness::sut::{require_sluice_bin, SluiceChild};
use crate::load::devices::version_name;
pub use crate::load::idle::{FailureCount, IdleConfig, IdleReport};
use crate::load::idle::{IdleFleet, Worker};
use crate::report::markdown::{loadavg_item, machine_line};
pub use crate::report::write_json;
use crate::stats::{latency_histogram, record_us, LatencySummary};

/// The edge systems that can hold device connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EdgeSut {
    /// The sluice gateway (no uplink configured: idle devices send nothing to forward).
    Sluice,
    /// A plain Mosquitto broker as the edge.
    Mosquitto,
}

impl EdgeSut {
    pub fn name(self) -> &'static str {
        match self {
            EdgeSut::Sluice => "sluice",
            EdgeSut::Mosquitto => "mosquitto",
        }
    }
}

/// Parameters of the `connections` scenario.
#[derive(Debug, Clone)]
pub struct ConnectionsScenario {
    /// Run in this order; the first one fixes N when `n` is `None`.
    pub suts: Vec<EdgeSut>,
    /// Connections; `None` = as many as the first SUT's open-file limit allows.
    pub n: Option<u32>,
    /// Connections per tool process at most; more are spread over `idle` child processes.
    pub per_process: u32,
    /// Connection attempts in progress at once, per process.
    pub concurrency: usize,
    pub keep_alive_s: u16,
    pub protocol: ProtocolVersion,
    pub connect_timeout: Duration,
    /// With all N held, try this many more connections (from this process, 3 s time limit
    /// each) to show what happens at the limit; 0 = no probe.
    pub probe_beyond: u32,
    pub sluice_bin: PathBuf,
    /// `sluice-bench` itself, for the child workers.
    pub bench_bin: PathBuf,
    pub sluice_shards: u32,
    pub command_line: String,
}

impl ConnectionsScenario {
    pub fn new(sluice_bin: PathBuf, bench_bin: PathBuf) -> ConnectionsScenario {
        ConnectionsScenario {
            suts: vec![EdgeSut::Sluice, EdgeSut::Mosquitto],
            n: None,
            per_process: 19_000,
            concurrency: 256,
            keep_alive_s: 60,
            protocol: ProtocolVersion::V311,
            connect_timeout: Duration::from_secs(10),
            probe_beyond: 64,
            sluice_bin,
            bench_bin,
            sluice_shards: 0,
            command_line: String::new(),
        }
    }
}

/// Parameters as run.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectionsParams {
    /// "max" or the number asked for.
    pub n_requested: String,
    pub per_process: u32,
    pub concurrency_per_process: usize,
    pub keep_alive_s: u16,
    pub mqtt: &'static str,
    pub probe_beyond: u32,
    pub sluice_bin: String,
    pub sluice_shards: u32,
}

/// Extra connections tried while the N were held.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeResult {
    pub attempted: u64,
    pub connected: u64,
    pub failed: u64,
    pub failures: Vec<FailureCount>,
}

/// Resident memory of the SUT, KiB.
#[derive(Debug, Clone, Serialize)]
pub struct RssPhase {
    /// The stable value.
    pub kib: u64,
    pub stable: bool,
    pub samples_kib: Vec<u64>,
}

/// One SUT holding N idle connections.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectionsRun {
    pub sut: EdgeSut,
    pub sut_config: String,
    pub sut_fd_limit: FdLimit,
    pub sut_open_fds_before: u64,
    pub sut_open_fds_connected: u64,
    pub target_connections: u32,
    /// Why the target is what it is.
    pub target_reason: String,
    pub worker_processes: u32,
    pub attempted: u64,
    pub connected: u64,
    pub failed: u64,
    pub failures: Vec<FailureCount>,
    /// Connections the SUT closed while they were held.
    pub dropped_while_held: u64,
    /// The limit that was hit, if any, in words.
    pub limit_hit: String,
    /// What happened to connections beyond N.
    pub probe: Option<ProbeResult>,
    pub rss_before: RssPhase,
    pub rss_connected: RssPhase,
    /// (connected RSS − RSS before) ÷ connected, KiB.
    pub rss_per_connection_kib: f64,
    pub connect_span_s: f64,
    pub connect_rate_per_s: f64,
    pub connack_latency: LatencySummary,
    pub connect_time: LatencySummary,
    pub sut_cpu_s_during_connect: f64,
}

/// Everything the `connections` scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectionsReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: ConnectionsParams,
    /// This process's open-file limit before and after raising it.
    pub tool_fd_limit: FdLimitChange,
    pub runs: Vec<ConnectionsRun>,
}

/// Run the scenario for every configured SUT, one after the other.
pub async fn run_connections(config: &ConnectionsScenario) -> anyhow::Result<ConnectionsReport> {
    if config.suts.is_empty() {
        bail!("no system under test selected");
    }
    if config.per_process == 0 {
        bail!("per-process connections must be at least 1");
    }
    if config.suts.contains(&EdgeSut::Sluice) {
        require_sluice_bin(&config.sluice_bin)?;
    }
    let tool_fd_limit = raise_fd_limit()?;
    let machine = machine(&config.command_line);
    let mut runs = Vec::new();
    let mut n = config.n;
    for &sut in &config.suts {
        eprintln!("=== scenario connections: {} ===", sut.name());
        let run = run_one(config, sut, n, &tool_fd_limit)
            .await
            .with_context(|| format!("connections run against {}", sut.name()))?;
        eprintln!("{}", run_line(&run));
        n = Some(run.target_connections);
        runs.push(run);
    }
    Ok(ConnectionsReport {
        scenario: "connections",
        machine,
        params: ConnectionsParams {
            n_requested: config
                .n
                .map_or_else(|| "max".to_string(), |n| n.to_string()),
            per_process: config.per_process,
            concurrency_per_process: config.concurrency,
            probe_beyond: config.probe_beyond,
            keep_alive_s: config.keep_alive_s,
            mqtt: version_name(config.protocol),
            sluice_bin: config.sluice_bin.display().to_string(),
            sluice_shards: config.sluice_shards,
        },
        tool_fd_limit,
        runs,
    })
}

/// A started edge SUT; dropping it stops the process.
struct EdgeProcess {
    pid: u32,
    device_addr: SocketAddr,
    config_text: String,
    _sluice: Option<SluiceChild>,
    _mosquitto: Option<Mosquitto>,
}

/// sluice with a device listener only (no uplink, no admin endpoint) and `max_connections`
/// high enough that its open-file limit, not the config, is what bounds it.
pub fn sluice_connections_config(shards: u32, mqtt_port: u16, max_connections: u64) -> String {
    format!(
        "# generated by sluice-bench scenario connections\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\nmax_sessions = {max_connections}\n\n\
         [coap]\nenabled = false\n\n\
         [admin]\nenabled = false\n\n\
         [log]\nlevel = \"warn\"\n"
    )
}

async fn start_edge(
    sut: EdgeSut,
    config: &ConnectionsScenario,
    n: Option<u32>,
    tool_limit: &FdLimitChange,
) -> anyhow::Result<EdgeProcess> {
    match sut {
        EdgeSut::Sluice => {
            let mqtt_port = sluice_testkit::free_port()?;
            // The process limit is inherited from this tool; allow that many connections.
            let max_connections = u64::from(n.unwrap_or(0)).max(tool_limit.after.soft.min(1 << 24));
            let toml = sluice_connections_config(config.sluice_shards, mqtt_port, max_connections);
            let child = SluiceChild::spawn(&config.sluice_bin, mqtt_port, toml)?;
            child.wait_ready().await?;
            Ok(EdgeProcess {
                pid: child.pid(),
                device_addr: child.device_addr(),
                config_text: child.config_text().to_string(),
                _sluice: Some(child),
                _mosquitto: None,
            })
        }
        EdgeSut::Mosquitto => {
            let builder = Mosquitto::builder();
            let broker = tokio::task::spawn_blocking(move || builder.start())
                .await
                .context("Mosquitto start-up panicked")?
                .context("starting the edge Mosquitto")?;
            let config_text = std::fs::read_to_string(broker.config_path()).unwrap_or_default();
            Ok(EdgeProcess {
                pid: broker
                    .pid()
                    .ok_or_else(|| anyhow!("the edge Mosquitto is not running"))?,
                device_addr: broker.plain_addr(),
                config_text,
                _sluice: None,
                _mosquitto: Some(broker),
            })
        }
    }
}

/// Sample VmRSS every 500 ms until the last four samples agree within 0.5 % (or 64 KiB), for
/// at most `max`.
async fn stable_rss(pid: Pid, max: Duration) -> anyhow::Result<RssPhase> {
    let deadline = Instant::now() + max;
    let mut samples = Vec::new();
    loop {
        samples.push(procfs::rss_kib(pid)?);
        if samples.len() >= 4 {
            let last = &samples[samples.len() - 4..];
            let (lo, hi) = (
                last.iter().copied().min().unwrap_or(0),
                last.iter().copied().max().unwrap_or(0),
            );
            if hi - lo <= (hi / 200).max(64) {
                return Ok(RssPhase {
                    kib: hi,
                    stable: true,
                    samples_kib: samples,
                });
            }
        }
        if Instant::now() >= deadline {
            return Ok(RssPhase {
                kib: samples.last().copied().unwrap_or(0),
                stable: false,
                samples_kib: samples,
            });
        }
        sleep(Duration::from_millis(500)).await;
    }
}

async fn run_one(
    config: &ConnectionsScenario,
    sut: EdgeSut,
    n: Option<u32>,
    tool_limit: &FdLimitChange,
) -> anyhow::Result<ConnectionsRun> {
    let edge = start_edge(sut, config, n, tool_limit).await?;
    let pid = Pid::Other(edge.pid);
    let sut_fd_limit = fd_limit(pid)?;
    let rss_before = stable_rss(pid, Duration::from_secs(20)).await?;
    let sut_open_fds_before = open_fds(pid)?;
    let headroom = sut_fd_limit
        .soft
        .saturating_sub(sut_open_fds_before + FD_MARGIN);
    let (target, target_reason) = match n {
        Some(n) => (n, "as requested (or the first SUT's maximum)".to_string()),
        None => (
            u32::try_from(headroom).unwrap_or(u32::MAX),
            format!(
                "{}'s open-file limit {} − {} files open at start − margin {FD_MARGIN}",
                sut.name(),
                sut_fd_limit.soft,
                sut_open_fds_before
            ),
        ),
    };
    if target == 0 {
        bail!("the target is 0 connections ({target_reason})");
    }
    let per_process = config.per_process;
    let processes = target.div_ceil(per_process);
    eprintln!(
        "{}: opening {target} idle connections ({target_reason}) from {processes} process{}; \
         its open-file limit is {}/{} (soft/hard), {} files open",
        sut.name(),
        if processes == 1 { "" } else { "es" },
        sut_fd_limit.soft,
        sut_fd_limit.hard,
        sut_open_fds_before
    );
    let cpu = procfs::CpuMeter::start(pid)?;
    let mut workers = Vec::new();
    let share = target.div_ceil(processes);
    let mut first_index = 0;
    while first_index < target {
        let count = share.min(target - first_index);
        let mut idle = IdleConfig::new(edge.device_addr, count);
        idle.first_index = first_index;
        idle.client_prefix = format!("idle-{}", sut.name());
        idle.protocol = config.protocol;
        idle.keep_alive_s = config.keep_alive_s;
        idle.concurrency = config.concurrency;
        idle.connect_timeout = config.connect_timeout;
        let worker = if processes == 1 {
            Worker::InProcess(IdleFleet::open(idle))
        } else {
            Worker::spawn_child(&config.bench_bin, &idle).await?
        };
        workers.push(worker);
        first_index += count;
    }
    let mut connected_reports = Vec::new();
    for worker in &mut workers {
        connected_reports.push(worker.connected_report().await?);
    }
    let sut_cpu_s_during_connect = cpu.usage()?.cpu_seconds;
    let rss_connected = stable_rss(pid, Duration::from_secs(20)).await?;
    let sut_open_fds_connected = open_fds(pid)?;
    let probe = if config.probe_beyond > 0 {
        let mut idle = IdleConfig::new(edge.device_addr, config.probe_beyond);
        idle.first_index = target;
        idle.client_prefix = format!("idle-{}", sut.name());
        idle.protocol = config.protocol;
        idle.keep_alive_s = config.keep_alive_s;
        idle.concurrency = config.concurrency;
        idle.connect_timeout = Duration::from_secs(3);
        let fleet = IdleFleet::open(idle);
        let r = fleet.wait_connected().await;
        fleet.close().await;
        Some(r)
    } else {
        None
    };
    let mut closed_reports = Vec::new();
    for worker in workers {
        closed_reports.push(worker.close().await?);
    }
    let sut_config = edge.config_text.clone();
    drop(edge);

    let sum = |f: fn(&IdleReport) -> u64| connected_reports.iter().map(f).sum::<u64>();
    let attempted = sum(|r| r.attempted);
    let connected = sum(|r| r.connected);
    let failed = sum(|r| r.failed);
    let dropped_while_held = closed_reports.iter().map(|r| r.dropped_while_held).sum();
    let mut failures: BTreeMap<String, FailureCount> = BTreeMap::new();
    for f in connected_reports.iter().flat_map(|r| r.failures.iter()) {
        failures
            .entry(f.kind.clone())
            .and_modify(|e| e.count += f.count)
            .or_insert_with(|| f.clone());
    }
    let failures: Vec<FailureCount> = failures.into_values().collect();
    let first = connected_reports
        .iter()
        .map(|r| r.first_attempt_unix_ns)
        .min()
        .unwrap_or(0);
    let last = connected_reports
        .iter()
        .map(|r| r.last_done_unix_ns)
        .max()
        .unwrap_or(0);
    let span_s = last.saturating_sub(first) as f64 / 1e9;
    let summary = |f: fn(&IdleReport) -> &Vec<u32>| {
        let mut h = latency_histogram();
        for r in &connected_reports {
            for &us in f(r) {
                record_us(&mut h, u64::from(us));
            }
        }
        LatencySummary::from_histogram(&h)
    };
    let probe = probe.map(|r| ProbeResult {
        attempted: r.attempted,
        connected: r.connected,
        failed: r.failed,
        failures: r.failures,
    });
    let limit_hit = if failed == 0 {
        let beyond = match &probe {
            Some(p) if p.failed > 0 => format!(
                "; of {} more, {} connected and {} failed: {}",
                p.attempted,
                p.connected,
                p.failed,
                p.failures
                    .iter()
                    .map(|f| format!("{} × {}", f.count, f.kind))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some(p) => format!("; {} more also connected", p.connected),
            None => String::new(),
        };
        match n {
            None => format!(
                "{}'s open-file limit ({}): N is that less the files it had open{beyond}",
                sut.name(),
                sut_fd_limit.soft
            ),
            Some(_) => format!("none at N: every connection was accepted{beyond}"),
        }
    } else {
        let main = failures
            .iter()
            .max_by_key(|f| f.count)
            .map(|f| format!("{} ({} attempts, e.g. \"{}\")", f.kind, f.count, f.example))
            .unwrap_or_default();
        format!("{failed} of {attempted} attempts failed; mostly {main}")
    };
    let rss_per_connection_kib = if connected == 0 {
        0.0
    } else {
        round3(rss_connected.kib.saturating_sub(rss_before.kib) as f64 / connected as f64)
    };
    Ok(ConnectionsRun {
        sut,
        sut_config,
        sut_fd_limit,
        sut_open_fds_before,
        sut_open_fds_connected,
        target_connections: target,
        target_reason,
        worker_processes: processes,
        attempted,
        connected,
        failed,
        failures,
        dropped_while_held,
        limit_hit,
        probe,
        rss_before,
        rss_connected,
        rss_per_connection_kib,
        connect_span_s: round3(span_s),
        connect_rate_per_s: if span_s > 0.0 {
            round1(connected as f64 / span_s)
        } else {
            0.0
        },
        connack_latency: summary(|r| &r.connack_latencies_us),
        connect_time: summary(|r| &r.connect_times_us),
        sut_cpu_s_during_connect,
    })
}

fn run_line(r: &ConnectionsRun) -> String {
    format!(
        "{}: {} of {} connected ({} failed, {} dropped while held) from {} process(es); RSS {:.1} → {:.1} MiB = {:.2} KiB per connection; \
         connect rate {:.0}/s, CONNACK p50/p99 {:.2}/{:.2} ms; fd limit {} (open: {} → {}); limit hit: {}",
        r.sut.name(),
        r.connected,
        r.target_connections,
        r.failed,
        r.dropped_while_held,
        r.worker_processes,
        r.rss_before.kib as f64 / 1024.0,
        r.rss_connected.kib as f64 / 1024.0,
        r.rss_per_connection_kib,
        r.connect_rate_per_s,
        r.connack_latency.p50_ms,
        r.connack_latency.p99_ms,
        r.sut_fd_limit.soft,
        r.sut_open_fds_before,
        r.sut_open_fds_connected,
        r.limit_hit
    )
}

/// The Markdown summary: one column per SUT.
pub fn markdown(report: &ConnectionsReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "### connections: idle MQTT {} devices (keep-alive {} s), N = {}, ≤ {} per tool process\n",
        p.mqtt, p.keep_alive_s, p.n_requested, p.per_process
    );
    let _ = writeln!(
        out,
        "{}\n",
        machine_line(
            m,
            &[
                loadavg_item(m),
                format!(
                    "sluice-bench open-file limit {}/{} → {}/{} (soft/hard)",
                    report.tool_fd_limit.before.soft,
                    report.tool_fd_limit.before.hard,
                    report.tool_fd_limit.after.soft,
                    report.tool_fd_limit.after.hard
                )
            ]
        )
    );
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let mut header = String::from("| metric |");
    let mut rule = String::from("|---|");
    for r in &report.runs {
        let _ = write!(header, " {} |", r.sut.name());
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    type Row = (&'static str, fn(&ConnectionsRun) -> String);
    let rows: Vec<Row> = vec![
        ("target connections (N)", |r| {
            r.target_connections.to_string()
        }),
        ("connected / failed", |r| {
            format!("{} / {}", r.connected, r.failed)
        }),
        ("dropped by the SUT while held", |r| {
            r.dropped_while_held.to_string()
        }),
        ("SUT open-file limit (soft / hard)", |r| {
            format!("{} / {}", r.sut_fd_limit.soft, r.sut_fd_limit.hard)
        }),
        ("SUT open files before / connected", |r| {
            format!("{} / {}", r.sut_open_fds_before, r.sut_open_fds_connected)
        }),
        ("SUT RSS before / connected, MiB", |r| {
            format!(
                "{:.1} / {:.1}",
                r.rss_before.kib as f64 / 1024.0,
                r.rss_connected.kib as f64 / 1024.0
            )
        }),
        ("**RSS per idle connection, KiB**", |r| {
            format!("**{:.2}**", r.rss_per_connection_kib)
        }),
        ("connect rate, connections/s", |r| {
            format!("{:.0}", r.connect_rate_per_s)
        }),
        ("CONNACK latency p50 / p99 / max, ms", |r| {
            format!(
                "{:.2} / {:.2} / {:.2}",
                r.connack_latency.p50_ms, r.connack_latency.p99_ms, r.connack_latency.max_ms
            )
        }),
        ("connect time (TCP + CONNACK) p50 / p99, ms", |r| {
            format!(
                "{:.2} / {:.2}",
                r.connect_time.p50_ms, r.connect_time.p99_ms
            )
        }),
        ("SUT CPU while connecting, s", |r| {
            format!("{:.2}", r.sut_cpu_s_during_connect)
        }),
        ("tool processes", |r| r.worker_processes.to_string()),
        ("limit hit", |r| r.limit_hit.clone()),
    ];
    for (name, cell) in rows {
        let mut line = format!("| {name} |");
        for r in &report.runs {
            let _ = write!(line, " {} |", cell(r).replace('|', "\\|"));
        }
        let _ = writeln!(out, "{line}");
    }
    out
}
