//! The `connections` scenario: how many idle device connections a system under test (SUT)
//! holds on this machine, what each costs in resident memory, and how fast they connect.
//!
//! Owns: the idle-connection fleet ([`IdleFleet`]: connect, CONNECT/CONNACK timing, hold with
//! keep-alive, disconnect), the `idle` worker protocol for spreading connections over child
//! processes, open-file limits (reading `/proc/<pid>/limits`, raising this process's soft
//! limit), RSS sampling until stable, and the report. Does not own: the SUTs (sluice via
//! [`crate::harness::sut::SluiceChild`], Mosquitto via `sluice-testkit`).
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
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::BytesMut;
use serde::{Deserialize, Serialize};
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Disconnect, Packet, Properties, ProtocolVersion,
};
use sluice_testkit::Mosquitto;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, Instant};

use crate::conn::handshake;
use crate::harness::machine::{machine, Machine};
use crate::harness::procfs::{self, round1, round3, Pid};
use crate::harness::sut::SluiceChild;
use crate::load::devices::version_name;
use crate::payload::unix_now_ns;
pub use crate::report::write_json;
use crate::stats::{latency_histogram, record_us, LatencySummary};

/// Files left unused below a SUT's limit when the target is "max" (accept slack, logs, the
/// odd file a SUT opens later).
pub const FD_MARGIN: u64 = 16;

// ------------------------------------------------------------------------------------------
// Open-file limits
// ------------------------------------------------------------------------------------------

/// RLIMIT_NOFILE of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdLimit {
    pub soft: u64,
    pub hard: u64,
}

/// The "Max open files" line of `/proc/<pid>/limits` ("unlimited" reads as `u64::MAX`).
pub fn fd_limit(pid: Pid) -> anyhow::Result<FdLimit> {
    let path = match pid {
        Pid::OwnProcess => "/proc/self/limits".to_string(),
        Pid::Other(p) => format!("/proc/{p}/limits"),
    };
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_fd_limit(&text).with_context(|| format!("parsing {path}"))
}

/// Parse the "Max open files" line of a `/proc/<pid>/limits` text.
pub fn parse_fd_limit(limits: &str) -> anyhow::Result<FdLimit> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .ok_or_else(|| anyhow!("no \"Max open files\" line"))?;
    let mut values = line["Max open files".len()..].split_whitespace().map(|v| {
        if v == "unlimited" {
            Ok(u64::MAX)
        } else {
            v.parse::<u64>()
                .with_context(|| format!("{v:?} is not a number"))
        }
    });
    let soft = values.next().ok_or_else(|| anyhow!("no soft limit"))??;
    let hard = values.next().ok_or_else(|| anyhow!("no hard limit"))??;
    Ok(FdLimit { soft, hard })
}

/// Open files of a process right now (entries of `/proc/<pid>/fd`).
pub fn open_fds(pid: Pid) -> anyhow::Result<u64> {
    let path = match pid {
        Pid::OwnProcess => "/proc/self/fd".to_string(),
        Pid::Other(p) => format!("/proc/{p}/fd"),
    };
    Ok(std::fs::read_dir(&path)
        .with_context(|| format!("listing {path}"))?
        .count() as u64)
}

/// This process's limit before and after [`raise_fd_limit`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct FdLimitChange {
    pub before: FdLimit,
    pub after: FdLimit,
}

/// Raise this process's soft open-file limit to its hard limit with util-linux `prlimit
/// --pid` (children spawned afterwards inherit it). Not raising it is not an error: the
/// returned `after` says what the limit is.
pub fn raise_fd_limit() -> anyhow::Result<FdLimitChange> {
    let before = fd_limit(Pid::OwnProcess)?;
    if before.soft < before.hard {
        let hard = if before.hard == u64::MAX {
            "unlimited".to_string()
        } else {
            before.hard.to_string()
        };
        let status = std::process::Command::new("prlimit")
            .arg("--pid")
            .arg(std::process::id().to_string())
            .arg(format!("--nofile={hard}:{hard}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match status {
            Ok(out) if out.status.success() => {}
            Ok(out) => tracing::warn!(
                stderr = %String::from_utf8_lossy(&out.stderr).trim(),
                "prlimit could not raise the open-file limit"
            ),
            Err(error) => tracing::warn!(%error, "prlimit (util-linux) is not available"),
        }
    }
    Ok(FdLimitChange {
        before,
        after: fd_limit(Pid::OwnProcess)?,
    })
}

// ------------------------------------------------------------------------------------------
// The idle fleet
// ------------------------------------------------------------------------------------------

/// Parameters of one process's share of idle connections.
#[derive(Debug, Clone)]
pub struct IdleConfig {
    pub target: SocketAddr,
    /// Connections to open.
    pub count: u32,
    /// Client ids are `{client_prefix}-{first_index + i}`.
    pub first_index: u32,
    pub client_prefix: String,
    pub protocol: ProtocolVersion,
    /// Keep-alive announced in CONNECT, seconds; a PINGREQ goes out every half of it.
    pub keep_alive_s: u16,
    /// Connection attempts in progress at once, at most.
    pub concurrency: usize,
    /// TCP connect + CONNACK time limit per attempt.
    pub connect_timeout: Duration,
}

impl IdleConfig {
    pub fn new(target: SocketAddr, count: u32) -> IdleConfig {
        IdleConfig {
            target,
            count,
            first_index: 0,
            client_prefix: "idle".to_string(),
            protocol: ProtocolVersion::V311,
            keep_alive_s: 60,
            concurrency: 256,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// How many attempts failed in one way, with one example message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailureCount {
    pub kind: String,
    pub count: u64,
    pub example: String,
}

/// What one process's idle fleet saw (also the worker's JSON line).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdleReport {
    /// "connected" (every attempt finished) or "closed" (after the hold).
    pub phase: String,
    pub attempted: u64,
    pub connected: u64,
    pub failed: u64,
    pub failures: Vec<FailureCount>,
    /// Connections the SUT closed while they were held.
    pub dropped_while_held: u64,
    /// Wall clock, ns since the UNIX epoch: first attempt started / last attempt finished.
    pub first_attempt_unix_ns: u64,
    pub last_done_unix_ns: u64,
    /// CONNECT written → CONNACK read, µs, one per connected device.
    pub connack_latencies_us: Vec<u32>,
    /// TCP connect started → CONNACK read, µs, one per connected device.
    pub connect_times_us: Vec<u32>,
    /// This process's open-file limit.
    pub fd_limit: FdLimit,
}

#[derive(Default)]
struct IdleShared {
    connected: AtomicU64,
    failed: AtomicU64,
    done: AtomicU64,
    dropped: AtomicU64,
    last_done_unix_ns: AtomicU64,
    failures: Mutex<BTreeMap<String, (u64, String)>>,
    latencies: Mutex<(Vec<u32>, Vec<u32>)>,
}

/// Idle connections held open by this process.
pub struct IdleFleet {
    config: IdleConfig,
    shared: Arc<IdleShared>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
    first_attempt_unix_ns: u64,
}

impl std::fmt::Debug for IdleFleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleFleet")
            .field("target", &self.config.target)
            .field("count", &self.config.count)
            .finish_non_exhaustive()
    }
}

impl IdleFleet {
    /// Start opening the connections (returns at once).
    pub fn open(config: IdleConfig) -> IdleFleet {
        let shared = Arc::new(IdleShared::default());
        let (stop, stop_rx) = watch::channel(false);
        let slots = Arc::new(Semaphore::new(config.concurrency.max(1)));
        let mut tasks = JoinSet::new();
        let first_attempt_unix_ns = unix_now_ns();
        for i in 0..config.count {
            tasks.spawn(idle_connection(
                config.clone(),
                config.first_index + i,
                shared.clone(),
                slots.clone(),
                stop_rx.clone(),
            ));
        }
        IdleFleet {
            config,
            shared,
            stop,
            tasks,
            first_attempt_unix_ns,
        }
    }

    /// Attempts finished so far (connected or failed).
    pub fn done(&self) -> u64 {
        self.shared.done.load(Relaxed)
    }
    pub fn connected(&self) -> u64 {
        self.shared.connected.load(Relaxed)
    }

    /// Wait until every attempt finished, then report (phase "connected").
    pub async fn wait_connected(&self) -> IdleReport {
        while self.done() < u64::from(self.config.count) {
            sleep(Duration::from_millis(20)).await;
        }
        self.report("connected")
    }

    /// Disconnect everything and report (phase "closed").
    pub async fn close(mut self) -> IdleReport {
        let _ = self.stop.send(true);
        let _ = timeout(Duration::from_secs(20), async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        self.tasks.abort_all();
        self.report("closed")
    }

    fn report(&self, phase: &str) -> IdleReport {
        let failures = self
            .shared
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(kind, (count, example))| FailureCount {
                kind: kind.clone(),
                count: *count,
                example: example.clone(),
            })
            .collect();
        let (connack, connect) = self
            .shared
            .latencies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        IdleReport {
            phase: phase.to_string(),
            attempted: self.done(),
            connected: self.connected(),
            failed: self.shared.failed.load(Relaxed),
            failures,
            dropped_while_held: self.shared.dropped.load(Relaxed),
            first_attempt_unix_ns: self.first_attempt_unix_ns,
            last_done_unix_ns: self.shared.last_done_unix_ns.load(Relaxed),
            connack_latencies_us: connack,
            connect_times_us: connect,
            fd_limit: fd_limit(Pid::OwnProcess).unwrap_or(FdLimit { soft: 0, hard: 0 }),
        }
    }
}

/// Why an attempt failed, in a few words that say whose limit it was.
fn failure_kind(error: &anyhow::Error) -> String {
    for cause in error.chain() {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return match io.raw_os_error() {
                Some(24) => "EMFILE in sluice-bench (its open-file limit)".to_string(),
                Some(23) => "ENFILE (the system-wide file limit)".to_string(),
                Some(99) => "EADDRNOTAVAIL (no free ephemeral port)".to_string(),
                Some(111) => "connection refused".to_string(),
                Some(104) => "connection reset by the SUT".to_string(),
                _ => format!("I/O error: {:?}", io.kind()),
            };
        }
    }
    let text = format!("{error:#}");
    if text.contains("no CONNACK") {
        "no CONNACK in time (the SUT accepted TCP but did not answer)".to_string()
    } else if text.contains("TCP connect timed out") {
        "TCP connect timed out".to_string()
    } else if text.contains("closed the connection") {
        "closed by the SUT before CONNACK".to_string()
    } else if text.contains("refused the connection") {
        "CONNACK refused".to_string()
    } else {
        "other".to_string()
    }
}

async fn idle_connection(
    config: IdleConfig,
    index: u32,
    shared: Arc<IdleShared>,
    slots: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    let mut rbuf = BytesMut::with_capacity(64);
    let mut wbuf = BytesMut::with_capacity(64);
    let mut decoder = Decoder::client(config.protocol, 4096);
    let opened = async {
        let _slot = slots
            .acquire()
            .await
            .map_err(|_| anyhow!("connect slots closed"))?;
        let started = Instant::now();
        let mut tcp = timeout(config.connect_timeout, TcpStream::connect(config.target))
            .await
            .map_err(|_| anyhow!("TCP connect timed out"))?
            .context("TCP connect")?;
        let _ = tcp.set_nodelay(true);
        let connect = Connect {
            protocol: config.protocol,
            clean_start: true,
            keep_alive: config.keep_alive_s,
            client_id: format!("{}-{index}", config.client_prefix).into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        };
        let connect_sent = Instant::now();
        handshake(
            &mut tcp,
            connect,
            &mut rbuf,
            &mut wbuf,
            &mut decoder,
            config
                .connect_timeout
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(1)),
        )
        .await?;
        let micros =
            |since: Instant| u32::try_from(since.elapsed().as_micros()).unwrap_or(u32::MAX);
        Ok::<_, anyhow::Error>((tcp, micros(connect_sent), micros(started)))
    }
    .await;
    let mut tcp = match opened {
        Ok((tcp, connack_us, connect_us)) => {
            {
                let mut l = shared.latencies.lock().unwrap_or_else(|p| p.into_inner());
                l.0.push(connack_us);
                l.1.push(connect_us);
            }
            shared.connected.fetch_add(1, Relaxed);
            tcp
        }
        Err(error) => {
            let kind = failure_kind(&error);
            let mut f = shared.failures.lock().unwrap_or_else(|p| p.into_inner());
            let entry = f.entry(kind).or_insert_with(|| (0, format!("{error:#}")));
            entry.0 += 1;
            drop(f);
            shared.failed.fetch_add(1, Relaxed);
            shared.last_done_unix_ns.fetch_max(unix_now_ns(), Relaxed);
            shared.done.fetch_add(1, Relaxed);
            return;
        }
    };
    shared.last_done_unix_ns.fetch_max(unix_now_ns(), Relaxed);
    shared.done.fetch_add(1, Relaxed);
    // Hold: answer nothing, ping every half keep-alive, notice a close.
    let ping_every = Duration::from_secs(u64::from(config.keep_alive_s.max(2)) / 2);
    let mut ping = tokio::time::interval_at(Instant::now() + ping_every, ping_every);
    let mut buf = [0u8; 64];
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            read = tcp.read(&mut buf) => {
                match read {
                    Ok(0) | Err(_) => {
                        shared.dropped.fetch_add(1, Relaxed);
                        return;
                    }
                    Ok(_) => {} // PINGRESP
                }
            }
            _ = ping.tick(), if config.keep_alive_s > 0 => {
                wbuf.clear();
                if encode(&Packet::PingReq, config.protocol, &mut wbuf).is_ok()
                    && tcp.write_all(&wbuf).await.is_err()
                {
                    shared.dropped.fetch_add(1, Relaxed);
                    return;
                }
            }
        }
    }
    wbuf.clear();
    let disconnect = Packet::Disconnect(Disconnect {
        reason: 0,
        properties: Properties::default(),
    });
    if encode(&disconnect, config.protocol, &mut wbuf).is_ok() {
        let _ = timeout(Duration::from_secs(2), async {
            let _ = tcp.write_all(&wbuf).await;
            let _ = tcp.shutdown().await;
        })
        .await;
    }
}

/// The `idle` worker: open, print the "connected" line, hold until stdin closes (or `hold_max`
/// passed), close, print the "closed" line.
pub async fn run_idle_worker(config: IdleConfig, hold_max: Duration) -> anyhow::Result<()> {
    let fleet = IdleFleet::open(config);
    let connected = fleet.wait_connected().await;
    print_line(&connected)?;
    // Blocking read on a thread of its own (tokio's `io-std` is not enabled in this crate).
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 256];
        loop {
            match std::io::Read::read(&mut stdin, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    });
    let _ = timeout(hold_max, stdin_closed).await;
    let closed = fleet.close().await;
    print_line(&closed)
}

fn print_line(report: &IdleReport) -> anyhow::Result<()> {
    let line = serde_json::to_string(report).context("serialising the worker report")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").context("writing to stdout")?;
    out.flush().context("flushing stdout")
}

// ------------------------------------------------------------------------------------------
// Workers: in this process or in children
// ------------------------------------------------------------------------------------------

/// One share of the connections, in this process or in a child.
enum Worker {
    InProcess(IdleFleet),
    Child {
        child: tokio::process::Child,
        lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    },
}

impl Worker {
    async fn spawn_child(bench_bin: &Path, config: &IdleConfig) -> anyhow::Result<Worker> {
        let mut child = tokio::process::Command::new(bench_bin)
            .arg("idle")
            .arg("--target")
            .arg(config.target.to_string())
            .arg("-n")
            .arg(config.count.to_string())
            .arg("--first-index")
            .arg(config.first_index.to_string())
            .arg("--client-prefix")
            .arg(&config.client_prefix)
            .arg("--mqtt")
            .arg(version_name(config.protocol))
            .arg("--keep-alive")
            .arg(config.keep_alive_s.to_string())
            .arg("--concurrency")
            .arg(config.concurrency.to_string())
            .arg("--connect-timeout")
            .arg(format!("{}ms", config.connect_timeout.as_millis()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning {} idle", bench_bin.display()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("the worker has no stdout pipe"))?;
        Ok(Worker::Child {
            child,
            lines: tokio::io::BufReader::new(stdout).lines(),
        })
    }

    /// The "connected" report (every attempt finished).
    async fn connected_report(&mut self) -> anyhow::Result<IdleReport> {
        match self {
            Worker::InProcess(fleet) => Ok(fleet.wait_connected().await),
            Worker::Child { lines, .. } => read_report(lines, "connected").await,
        }
    }

    /// Disconnect this share and return its "closed" report.
    async fn close(self) -> anyhow::Result<IdleReport> {
        match self {
            Worker::InProcess(fleet) => Ok(fleet.close().await),
            Worker::Child {
                mut child,
                mut lines,
            } => {
                drop(child.stdin.take()); // EOF: the worker disconnects.
                let report = timeout(Duration::from_secs(60), read_report(&mut lines, "closed"))
                    .await
                    .map_err(|_| anyhow!("a worker did not close within 60 s"))??;
                let _ = timeout(Duration::from_secs(10), child.wait()).await;
                Ok(report)
            }
        }
    }
}

async fn read_report(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    phase: &str,
) -> anyhow::Result<IdleReport> {
    let line = lines
        .next_line()
        .await
        .context("reading a worker's report")?
        .ok_or_else(|| anyhow!("a worker exited before its {phase:?} report"))?;
    let report: IdleReport =
        serde_json::from_str(&line).with_context(|| format!("a worker printed {line:?}"))?;
    if report.phase != phase {
        bail!(
            "a worker reported phase {:?}, expected {phase:?}",
            report.phase
        );
    }
    Ok(report)
}

// ------------------------------------------------------------------------------------------
// The scenario
// ------------------------------------------------------------------------------------------

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
    if config.suts.contains(&EdgeSut::Sluice) && !config.sluice_bin.is_file() {
        bail!(
            "sluice binary {} not found: build it with `cargo build --release -p sluice` or pass --sluice-bin",
            config.sluice_bin.display()
        );
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
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\n\n\
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
        "commit `{}`{} · nproc {} · CPU {} · kernel {} · {} · loadavg at start {} · sluice-bench open-file limit {}/{} → {}/{} (soft/hard)\n",
        m.commit,
        if m.worktree_dirty { " (work tree dirty)" } else { "" },
        m.nproc,
        m.cpu_model,
        m.kernel,
        m.mosquitto_version,
        m.loadavg_at_start,
        report.tool_fd_limit.before.soft,
        report.tool_fd_limit.before.hard,
        report.tool_fd_limit.after.soft,
        report.tool_fd_limit.after.hard,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_limit_is_read_from_the_max_open_files_line() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max processes             95000                95000                processes \n\
                    Max open files            1024                 20000                files     \n";
        assert_eq!(
            parse_fd_limit(text).expect("valid limits"),
            FdLimit {
                soft: 1024,
                hard: 20000
            }
        );
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(
            parse_fd_limit(unlimited).expect("valid limits").hard,
            u64::MAX
        );
        assert!(parse_fd_limit("Max processes 1 2\n").is_err());
    }
}
