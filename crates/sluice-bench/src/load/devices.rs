//! The device load generator: N MQTT device connections in one process, each publishing bench
//! payloads at its own rate, measuring PUBACK latency.
//!
//! Owns: one tokio task per device (connect, publish schedule, PUBACK bookkeeping, reconnect)
//! and the run's counters, ack-latency histogram and report. Does not own: the runtime (the
//! caller provides a multi-threaded one) or what happens to messages after the broker.
//!
//! Model, per device `i` of `n` (0-based):
//! - Connects at `start + ramp·i/n` as client id `{client_prefix}-{i}` (clean session/start),
//!   keep-alive 60 s (a PINGREQ goes out after 30 s without any write), TCP_NODELAY. The first
//!   `round(n · high_share)` devices (lowest indices) are *high-priority* devices and use client
//!   id `{client_prefix}-hi-{i}` instead (for a gateway's `[priority] devices` patterns); their
//!   topic and payload are the same as everyone's.
//! - Publishes to `{topic_prefix}/{i}` at `rate` messages per second: *periodic* arrivals with a
//!   random phase (first send after U(0, 1/rate) s, then every 1/rate s on a fixed schedule, so
//!   a late send does not shift later ones), or *Poisson* arrivals (exponential gaps, mean
//!   1/rate). A send that is late is still made; the worst lateness is reported
//!   (`max_send_lag_ms`) so a reader can tell whether the generator kept up.
//! - Payload: [`crate::payload`] header (device index, per-device sequence number that survives
//!   reconnects, send time), then filler to a size drawn uniformly from the payload range.
//! - QoS 1: at most `max_inflight` PUBLISHes await PUBACK per device (default 64; with MQTT 5
//!   also capped by the broker's Receive Maximum). A tick that finds the window full is skipped
//!   and counted (`skipped_inflight_full`) rather than queued: overflow policy = counted drop at
//!   the source. Ack latency = PUBACK decoded − PUBLISH handed to the socket (monotonic clock),
//!   reported for the whole run and for PUBLISHes written after the ramp plus an optional settle
//!   time (steady state).
//! - On any failure (connect refused, reset, malformed packet, refused CONNACK) the connection
//!   is dropped, PUBLISHes still awaiting PUBACK are counted as `unacknowledged` (there is no
//!   retransmission: the device reconnects with a clean session), and the device reconnects
//!   after an exponential back-off with jitter (100 ms doubling to 5 s). `connect_failures`
//!   counts attempts that never reached CONNACK; `reconnects` counts sessions lost after
//!   CONNACK.
//! - At `start + duration` publishing stops; each device waits up to `drain_timeout` for its
//!   outstanding PUBACKs, sends DISCONNECT and closes.
//! - Runs of at most [`PER_DEVICE_REPORT_MAX`] devices also report every device on its own
//!   (client id, sent, acknowledged, steady-state ack latency); bigger runs only the totals, so
//!   reports of big fleets stay small.
//!
//! Efficiency (16,384 devices × 10 msg/s is a design target): one task per device sleeping on
//! tokio's shared timer wheel with one re-armed `Sleep`; no allocation per message — the filler
//! is one `'static` buffer shared by every device (slicing it is free), the topic is a
//! reference-counted string built once per device, each device reuses its read and write
//! buffers, and the header is patched into the encoded packet in place (the payload is the tail
//! of a PUBLISH). Counters are relaxed atomics; latencies go to a histogram sharded 64 ways.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::{Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng as _, RngCore as _, SeedableRng as _};
use serde::Serialize;
use sluice_proto::mqtt::{
    encode, reason, Connect, Decoder, Disconnect, Packet, Properties, ProtocolVersion, Publish, QoS,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use crate::conn::handshake;
use crate::harness::procfs::{round1, round3, CpuMeter, CpuUsage, Pid};
use crate::payload::{unix_now_ns, PayloadHeader, HEADER_LEN};
use crate::stats::{LatencySummary, ShardedHistogram};

mod session;

use session::device;

/// Largest payload the generator will build (the filler buffer is this large at most).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Keep-alive announced in CONNECT, in seconds.
const KEEP_ALIVE_S: u16 = 60;
/// A PINGREQ is sent after this long without any write.
const PING_AFTER: Duration = Duration::from_secs(30);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const HISTOGRAM_SHARDS: usize = 64;
/// Runs of at most this many devices report each device separately (`per_device`).
pub const PER_DEVICE_REPORT_MAX: u32 = 64;

/// Payload sizes, in bytes, drawn uniformly from `min..=max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PayloadSize {
    pub min: usize,
    pub max: usize,
}

impl std::str::FromStr for PayloadSize {
    type Err = String;
    /// `"100..1024"` (inclusive range) or `"512"` (fixed size).
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("{v:?} is not a size in bytes"))
        };
        let (min, max) = match s.split_once("..") {
            Some((a, b)) => (parse(a)?, parse(b.trim_start_matches('='))?),
            None => (parse(s)?, parse(s)?),
        };
        if min > max {
            return Err(format!("payload range {min}..{max} is empty"));
        }
        if min < HEADER_LEN {
            return Err(format!(
                "payloads must be at least {HEADER_LEN} bytes (the bench header)"
            ));
        }
        if max > MAX_PAYLOAD {
            return Err(format!(
                "payloads larger than {MAX_PAYLOAD} bytes are not supported"
            ));
        }
        Ok(PayloadSize { min, max })
    }
}

/// When each device publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arrivals {
    /// Every 1/rate seconds after a random phase.
    Periodic,
    /// Exponentially distributed gaps with mean 1/rate.
    Poisson,
}

/// Everything a device run needs. [`DevicesConfig::new`] gives the CLI defaults.
#[derive(Debug, Clone)]
pub struct DevicesConfig {
    /// The broker or gateway the devices connect to (plain TCP).
    pub target: std::net::SocketAddr,
    /// Per-device targets: when not empty, device `i` connects to `targets[i % len]` instead of
    /// `target` (the `seganet` scenario points each device at its own agent process).
    pub targets: Vec<std::net::SocketAddr>,
    /// Number of device connections.
    pub devices: u32,
    /// Messages per second per device; 0 = connect and stay idle.
    pub rate_per_device: f64,
    pub payload: PayloadSize,
    /// `AtMostOnce` or `AtLeastOnce`.
    pub qos: QoS,
    pub protocol: ProtocolVersion,
    /// Whole run, from the first connection attempt to the end of publishing (ramp included).
    pub duration: Duration,
    /// Connection attempts are spread evenly over this period.
    pub ramp: Duration,
    /// Steady state starts this long after the ramp (lets the system digest the connection
    /// storm); only affects which PUBLISHes count for `ack_latency_steady`.
    pub settle: Duration,
    pub topic_prefix: String,
    pub client_prefix: String,
    /// Share of high-priority devices, 0.0–1.0: the first `round(devices · high_share)` devices
    /// use client id `{client_prefix}-hi-{i}`.
    pub high_share: f64,
    pub arrivals: Arrivals,
    /// PUBLISHes awaiting PUBACK per device, at most (QoS 1).
    pub max_inflight: u16,
    /// After publishing stops, how long devices wait for outstanding PUBACKs.
    pub drain_timeout: Duration,
    /// TCP connect + CONNACK time limit.
    pub connect_timeout: Duration,
    /// Print a progress line to stderr this often (`None`: never).
    pub progress_every: Option<Duration>,
    /// Seed of the per-device random generators (phase, sizes, filler, back-off jitter).
    pub seed: u64,
    /// MQTT over TLS: the devices open a TLS 1.3 session (rustls) verified against this
    /// config's roots for this server name before CONNECT. `None`: plain TCP.
    pub tls: Option<DeviceTls>,
}

/// The TLS the devices speak ([`DevicesConfig::tls`]).
#[derive(Clone)]
pub struct DeviceTls {
    pub config: std::sync::Arc<rustls::ClientConfig>,
    /// The name the server's certificate is verified for (an IP address checks IP SANs).
    pub server_name: String,
}

impl std::fmt::Debug for DeviceTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl DeviceTls {
    /// TLS 1.3 trusting only the CA certificates in `ca_file`, verified for `server_name`.
    pub fn from_ca_file(ca_file: &std::path::Path, server_name: &str) -> anyhow::Result<DeviceTls> {
        Ok(DeviceTls {
            config: crate::conn::tls_client_config(ca_file, None)?,
            server_name: server_name.to_string(),
        })
    }
}

impl DevicesConfig {
    /// CLI defaults against `target`: 1 device, 10 msg/s, 100..1024 B, QoS 1, MQTT 3.1.1,
    /// 60 s with a 5 s ramp, periodic arrivals, 64 in flight.
    pub fn new(target: std::net::SocketAddr) -> DevicesConfig {
        DevicesConfig {
            target,
            targets: Vec::new(),
            devices: 1,
            rate_per_device: 10.0,
            payload: PayloadSize {
                min: 100,
                max: 1024,
            },
            qos: QoS::AtLeastOnce,
            protocol: ProtocolVersion::V311,
            duration: Duration::from_secs(60),
            ramp: Duration::from_secs(5),
            settle: Duration::ZERO,
            topic_prefix: "dev".to_string(),
            client_prefix: "bench".to_string(),
            high_share: 0.0,
            arrivals: Arrivals::Periodic,
            max_inflight: 64,
            drain_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            progress_every: Some(Duration::from_secs(5)),
            seed: 0x5111_CE00,
            tls: None,
        }
    }

    /// What the uplink scenarios (kafka, onem2m, site) offer: `devices` MQTT 5 devices × `rate`
    /// QoS 1 messages per second of exactly `payload` bytes on `{topic_prefix}/…`, for
    /// `duration` with `ramp` and `settle`, no progress lines.
    pub fn steady_qos1(
        target: std::net::SocketAddr,
        devices: u32,
        rate: f64,
        payload: usize,
        (duration, ramp, settle): (Duration, Duration, Duration),
        topic_prefix: &str,
    ) -> DevicesConfig {
        let mut c = DevicesConfig::new(target);
        c.devices = devices;
        c.rate_per_device = rate;
        c.payload = PayloadSize {
            min: payload,
            max: payload,
        };
        c.qos = QoS::AtLeastOnce;
        c.protocol = ProtocolVersion::V5;
        c.duration = duration;
        c.ramp = ramp;
        c.settle = settle;
        c.topic_prefix = topic_prefix.to_string();
        c.progress_every = None;
        c
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.devices == 0 {
            bail!("at least one device is needed");
        }
        if !(self.rate_per_device.is_finite() && self.rate_per_device >= 0.0) {
            bail!("the rate must be a finite number of messages per second, 0 or more");
        }
        if self.qos == QoS::ExactlyOnce {
            bail!("QoS 2 is not supported by the generator (use 0 or 1)");
        }
        if !(self.high_share.is_finite() && (0.0..=1.0).contains(&self.high_share)) {
            bail!(
                "the high-priority share must be between 0.0 and 1.0 (got {})",
                self.high_share
            );
        }
        if self.max_inflight == 0 {
            bail!("max inflight must be at least 1");
        }
        if self.ramp > self.duration {
            bail!(
                "the ramp ({:?}) must not be longer than the duration ({:?})",
                self.ramp,
                self.duration
            );
        }
        Ok(())
    }

    /// How many devices are high-priority: `round(devices · high_share)`.
    pub fn high_devices(&self) -> u32 {
        high_devices(self.devices, self.high_share)
    }

    /// Device `index`'s MQTT client id: `{client_prefix}-hi-{index}` for the high-priority
    /// devices (the lowest indices), `{client_prefix}-{index}` for the others.
    pub fn client_id(&self, index: u32) -> String {
        if index < self.high_devices() {
            format!("{}-hi-{index}", self.client_prefix)
        } else {
            format!("{}-{index}", self.client_prefix)
        }
    }
}

/// `round(devices · share)`, clamped to `0..=devices` (a share outside 0–1 is clamped too).
pub fn high_devices(devices: u32, share: f64) -> u32 {
    if !share.is_finite() {
        return 0;
    }
    let n = (f64::from(devices) * share.clamp(0.0, 1.0)).round();
    // In 0..=devices after the clamp, so the conversion is exact.
    (n as u32).min(devices)
}

/// Live counters of a run, readable while it goes on (e.g. to cut a steady-state window).
#[derive(Debug, Default)]
pub struct DeviceCounters {
    /// PUBLISHes written to a socket.
    pub sent: AtomicU64,
    /// PUBACKs with a success reason code.
    pub acknowledged: AtomicU64,
    /// PUBACKs with a failure reason code (MQTT 5, ≥ 0x80).
    pub rejected: AtomicU64,
    /// QoS 1 PUBLISHes still unacknowledged when their connection ended.
    pub unacknowledged: AtomicU64,
    /// Ticks skipped because the inflight window was full.
    pub skipped_inflight_full: AtomicU64,
    /// Sessions lost after CONNACK.
    pub reconnects: AtomicU64,
    /// Connection attempts that never got a successful CONNACK.
    pub connect_failures: AtomicU64,
    /// Devices currently connected (CONNACK received).
    pub connected: AtomicU64,
    /// Worst lateness of a send against its schedule, µs.
    pub max_send_lag_us: AtomicU64,
}

/// A copy of [`DeviceCounters`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CountersSnapshot {
    pub sent: u64,
    pub acknowledged: u64,
    pub rejected: u64,
    pub unacknowledged: u64,
    pub skipped_inflight_full: u64,
    pub reconnects: u64,
    pub connect_failures: u64,
    pub connected: u64,
}

impl DeviceCounters {
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            sent: self.sent.load(Relaxed),
            acknowledged: self.acknowledged.load(Relaxed),
            rejected: self.rejected.load(Relaxed),
            unacknowledged: self.unacknowledged.load(Relaxed),
            skipped_inflight_full: self.skipped_inflight_full.load(Relaxed),
            reconnects: self.reconnects.load(Relaxed),
            connect_failures: self.connect_failures.load(Relaxed),
            connected: self.connected.load(Relaxed),
        }
    }
}

/// Result of a device run (the `devices` subcommand prints it as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct DevicesReport {
    pub target: String,
    pub devices: u32,
    pub rate_per_device: f64,
    /// devices × rate, messages per second.
    pub offered_rate: f64,
    /// sent ÷ duration.
    pub achieved_rate: f64,
    pub mqtt: &'static str,
    pub qos: u8,
    pub payload_min: usize,
    pub payload_max: usize,
    pub arrivals: Arrivals,
    pub max_inflight: u16,
    pub duration_s: f64,
    pub ramp_s: f64,
    /// Devices with a `-hi-` client id (the first ones): `round(devices · high_share)`.
    pub high_devices: u32,
    pub sent: u64,
    pub acknowledged: u64,
    pub rejected: u64,
    pub unacknowledged: u64,
    pub skipped_inflight_full: u64,
    pub reconnects: u64,
    pub connect_failures: u64,
    pub max_send_lag_ms: f64,
    /// PUBLISH written → PUBACK decoded, whole run.
    pub ack_latency: LatencySummary,
    /// The same for PUBLISHes written after the ramp plus the settle time (steady state).
    pub ack_latency_steady: LatencySummary,
    /// This process's CPU over the run (includes anything else running in it, e.g. a sink).
    pub tool_cpu: CpuUsage,
    /// From start to the last device closing (includes the ack drain).
    pub elapsed_s: f64,
    /// Every device on its own, by index; only for runs of at most [`PER_DEVICE_REPORT_MAX`]
    /// devices (empty, and left out of the JSON, otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_device: Vec<DeviceTally>,
}

/// One device's share of a run (see [`DevicesReport::per_device`]).
#[derive(Debug, Clone, Serialize)]
pub struct DeviceTally {
    /// The device index (the `device` field of its payload header, and its topic suffix).
    pub device: u32,
    pub client_id: String,
    /// Whether it is one of the high-priority devices.
    pub high: bool,
    /// PUBLISHes written to a socket.
    pub sent: u64,
    /// PUBACKs with a success reason code.
    pub acknowledged: u64,
    /// PUBACKs with a failure reason code.
    pub rejected: u64,
    /// QoS 1 PUBLISHes still unacknowledged when a connection of this device ended.
    pub unacknowledged: u64,
    /// Ticks skipped because this device's inflight window was full.
    pub skipped_inflight_full: u64,
    /// PUBLISH written → PUBACK, PUBLISHes written after ramp + settle.
    pub ack_latency_steady: LatencySummary,
}

/// A device run in progress.
#[derive(Debug)]
pub struct DevicesRun {
    counters: Arc<DeviceCounters>,
    started: Instant,
    task: tokio::task::JoinHandle<anyhow::Result<DevicesReport>>,
}

impl DevicesRun {
    /// Live counters.
    pub fn counters(&self) -> &Arc<DeviceCounters> {
        &self.counters
    }
    /// When the first device started connecting.
    pub fn started(&self) -> Instant {
        self.started
    }
    /// Wait for every device to finish and build the report.
    pub async fn wait(self) -> anyhow::Result<DevicesReport> {
        self.task.await.context("the device run panicked")?
    }
}

/// Run devices to completion.
pub async fn run_devices(config: DevicesConfig) -> anyhow::Result<DevicesReport> {
    spawn_devices(config)?.wait().await
}

/// Start a device run on the current (multi-threaded) runtime and return at once.
pub fn spawn_devices(config: DevicesConfig) -> anyhow::Result<DevicesRun> {
    config.validate()?;
    let counters = Arc::new(DeviceCounters::default());
    let started = Instant::now();
    let task = tokio::spawn(drive(config, counters.clone(), started));
    Ok(DevicesRun {
        counters,
        started,
        task,
    })
}

/// State shared read-only by every device task (plus the atomic counters).
struct Shared {
    config: DevicesConfig,
    counters: Arc<DeviceCounters>,
    ack_latency: ShardedHistogram,
    /// Only PUBLISHes written at or after `steady_from` (start + ramp).
    ack_latency_steady: ShardedHistogram,
    steady_from: Instant,
    filler: Bytes,
    stop_at: Instant,
}

async fn drive(
    config: DevicesConfig,
    counters: Arc<DeviceCounters>,
    started: Instant,
) -> anyhow::Result<DevicesReport> {
    let cpu = CpuMeter::start(Pid::OwnProcess)?;
    let shared = Arc::new(Shared {
        filler: make_filler(config.payload.max, config.seed),
        counters,
        ack_latency: ShardedHistogram::new(HISTOGRAM_SHARDS),
        ack_latency_steady: ShardedHistogram::new(HISTOGRAM_SHARDS),
        steady_from: started + config.ramp + config.settle,
        stop_at: started + config.duration,
        config,
    });
    let n = shared.config.devices;
    let mut tasks = JoinSet::new();
    for index in 0..n {
        let offset = shared.config.ramp.mul_f64(f64::from(index) / f64::from(n));
        tasks.spawn(device(index, started + offset, shared.clone()));
    }
    let progress = shared.config.progress_every.map(|every| {
        let shared = shared.clone();
        tokio::spawn(async move { progress_lines(&shared, started, every).await })
    });
    let mut per_device = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        if let Some(tally) = joined.context("a device task panicked")? {
            per_device.push(tally);
        }
    }
    per_device.sort_by_key(|t| t.device);
    if let Some(p) = progress {
        p.abort();
    }
    let elapsed = started.elapsed();
    let c = shared.counters.snapshot();
    let config = &shared.config;
    Ok(DevicesReport {
        target: config.target.to_string(),
        devices: n,
        rate_per_device: config.rate_per_device,
        offered_rate: config.rate_per_device * f64::from(n),
        achieved_rate: round1(c.sent as f64 / config.duration.as_secs_f64().max(1e-9)),
        mqtt: version_name(config.protocol),
        qos: config.qos as u8,
        payload_min: config.payload.min,
        payload_max: config.payload.max,
        arrivals: config.arrivals,
        max_inflight: config.max_inflight,
        duration_s: config.duration.as_secs_f64(),
        ramp_s: config.ramp.as_secs_f64(),
        high_devices: config.high_devices(),
        sent: c.sent,
        acknowledged: c.acknowledged,
        rejected: c.rejected,
        unacknowledged: c.unacknowledged,
        skipped_inflight_full: c.skipped_inflight_full,
        reconnects: c.reconnects,
        connect_failures: c.connect_failures,
        max_send_lag_ms: shared.counters.max_send_lag_us.load(Relaxed) as f64 / 1000.0,
        ack_latency: LatencySummary::from_histogram(&shared.ack_latency.merged()),
        ack_latency_steady: LatencySummary::from_histogram(&shared.ack_latency_steady.merged()),
        tool_cpu: cpu.usage()?,
        elapsed_s: round3(elapsed.as_secs_f64()),
        per_device,
    })
}

/// "3.1.1" or "5".
pub fn version_name(v: ProtocolVersion) -> &'static str {
    match v {
        ProtocolVersion::V311 => "3.1.1",
        ProtocolVersion::V5 => "5",
    }
}

/// One random buffer as large as the largest payload, leaked so that every PUBLISH can carry a
/// `'static` slice of it (no reference counting per message). One per run.
fn make_filler(len: usize, seed: u64) -> Bytes {
    let mut bytes = vec![0u8; len];
    SmallRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    Bytes::from_static(Box::leak(bytes.into_boxed_slice()))
}

async fn progress_lines(shared: &Shared, started: Instant, every: Duration) {
    let n = shared.config.devices;
    let mut last = shared.counters.snapshot();
    let mut last_at = Instant::now();
    let Ok(cpu) = CpuMeter::start(Pid::OwnProcess) else {
        return;
    };
    loop {
        tokio::time::sleep(every).await;
        let c = shared.counters.snapshot();
        let dt = last_at.elapsed().as_secs_f64().max(1e-9);
        let cpu_pct = cpu
            .usage()
            .map(|u| u.percent_of_one_core)
            .unwrap_or(f64::NAN);
        eprintln!(
            "[devices {:>6.1}s] connected {}/{}  sent {} ({:.0}/s)  acked {} ({:.0}/s)  \
             unacked {}  skipped {}  reconnects {}  connect-failures {}  tool cpu {:.0}%",
            started.elapsed().as_secs_f64(),
            c.connected,
            n,
            c.sent,
            (c.sent - last.sent) as f64 / dt,
            c.acknowledged,
            (c.acknowledged - last.acknowledged) as f64 / dt,
            c.unacknowledged,
            c.skipped_inflight_full,
            c.reconnects,
            c.connect_failures,
            cpu_pct,
        );
        last = c;
        last_at = Instant::now();
    }
}

#[cfg(test)]
mod tests;
