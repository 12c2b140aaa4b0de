//! Idle MQTT devices: connections that connect and then only keep alive, to find how many a
//! system under test holds and what each costs. [`IdleFleet`] holds one process's share; the
//! `sluice-bench idle` worker ([`run_idle_worker`]) is that share as a child process, and a
//! `Worker` spreads the connections over this process and such children (the open-file
//! limit caps one process).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
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
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, Instant};

use crate::conn::handshake;
use crate::harness::limits::{fd_limit, FdLimit};
use crate::harness::procfs::Pid;
use crate::load::devices::version_name;
use crate::payload::unix_now_ns;
pub use crate::report::write_json;

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
pub(crate) enum Worker {
    InProcess(IdleFleet),
    Child {
        child: tokio::process::Child,
        lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    },
}

impl Worker {
    pub(crate) async fn spawn_child(
        bench_bin: &Path,
        config: &IdleConfig,
    ) -> anyhow::Result<Worker> {
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
    pub(crate) async fn connected_report(&mut self) -> anyhow::Result<IdleReport> {
        match self {
            Worker::InProcess(fleet) => Ok(fleet.wait_connected().await),
            Worker::Child { lines, .. } => read_report(lines, "connected").await,
        }
    }

    /// Disconnect this share and return its "closed" report.
    pub(crate) async fn close(self) -> anyhow::Result<IdleReport> {
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
