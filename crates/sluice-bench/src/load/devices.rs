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
        }
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

/// Per-device state that survives reconnects.
struct DeviceState {
    index: u32,
    client_id: String,
    /// PUBLISH with topic set; cloned per message (reference counts only).
    template: Publish,
    seq: u64,
    next_send: Option<Instant>,
    rng: SmallRng,
    next_packet_id: u16,
    /// (packet id, when written) of QoS 1 PUBLISHes awaiting PUBACK.
    inflight: Vec<(u16, Instant)>,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// This device's own counters, for runs that report devices separately.
    own: Option<OwnCounters>,
}

/// One device's counters (plain integers: only its own task touches them).
struct OwnCounters {
    sent: u64,
    acknowledged: u64,
    rejected: u64,
    unacknowledged: u64,
    skipped_inflight_full: u64,
    ack_latency_steady: hdrhistogram::Histogram<u64>,
}

/// How one connection ended.
enum SessionEnd {
    /// Publishing time is over and the device closed cleanly.
    Finished,
    /// The connection failed; `connected` tells whether CONNACK had been received.
    Failed {
        connected: bool,
        error: anyhow::Error,
    },
}

/// One device, from its first connection to its last; its own tally when the run reports
/// devices separately.
async fn device(index: u32, start_at: Instant, shared: Arc<Shared>) -> Option<DeviceTally> {
    sleep_until(start_at).await;
    let config = &shared.config;
    let mut st = DeviceState {
        index,
        client_id: config.client_id(index),
        template: Publish {
            dup: false,
            qos: config.qos,
            retain: false,
            topic: format!("{}/{index}", config.topic_prefix).as_str().into(),
            packet_id: None,
            properties: None,
            payload: Bytes::new(),
        },
        seq: 0,
        next_send: None,
        rng: SmallRng::seed_from_u64(config.seed ^ (u64::from(index) << 17 | 0x9e37)),
        next_packet_id: 1,
        inflight: Vec::with_capacity(usize::from(config.max_inflight.min(256))),
        rbuf: BytesMut::with_capacity(256),
        wbuf: BytesMut::with_capacity(config.payload.max + 128),
        own: (config.devices <= PER_DEVICE_REPORT_MAX).then(|| OwnCounters {
            sent: 0,
            acknowledged: 0,
            rejected: 0,
            unacknowledged: 0,
            skipped_inflight_full: 0,
            ack_latency_steady: crate::stats::latency_histogram(),
        }),
    };
    let mut backoff = BACKOFF_MIN;
    while Instant::now() < shared.stop_at {
        let end = session(&mut st, &shared).await;
        let lost = st.inflight.len() as u64;
        st.inflight.clear();
        shared.counters.unacknowledged.fetch_add(lost, Relaxed);
        if let Some(own) = &mut st.own {
            own.unacknowledged += lost;
        }
        match end {
            SessionEnd::Finished => break,
            SessionEnd::Failed { connected, error } => {
                let counter = if connected {
                    backoff = BACKOFF_MIN;
                    &shared.counters.reconnects
                } else {
                    &shared.counters.connect_failures
                };
                counter.fetch_add(1, Relaxed);
                tracing::debug!(device = index, connected, error = %format!("{error:#}"), "device connection failed");
            }
        }
        let pause = backoff.mul_f64(st.rng.gen_range(0.5..1.5));
        backoff = (backoff * 2).min(BACKOFF_MAX);
        sleep_until((Instant::now() + pause).min(shared.stop_at)).await;
        // Ticks that fell into the outage are not made up for.
        st.next_send = None;
    }
    let high = index < config.high_devices();
    st.own.map(|own| DeviceTally {
        device: index,
        client_id: st.client_id,
        high,
        sent: own.sent,
        acknowledged: own.acknowledged,
        rejected: own.rejected,
        unacknowledged: own.unacknowledged,
        skipped_inflight_full: own.skipped_inflight_full,
        ack_latency_steady: LatencySummary::from_histogram(&own.ack_latency_steady),
    })
}

async fn session(st: &mut DeviceState, shared: &Shared) -> SessionEnd {
    let config = &shared.config;
    let mut decoder = Decoder::client(config.protocol, crate::conn::MAX_INBOUND_PACKET);
    let target = match config.targets.len() {
        0 => config.target,
        n => config.targets[st.index as usize % n],
    };
    let mut tcp = match timeout(config.connect_timeout, TcpStream::connect(target)).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return failed(false, anyhow!(e).context("TCP connect")),
        Err(_) => return failed(false, anyhow!("TCP connect timed out")),
    };
    let _ = tcp.set_nodelay(true);
    st.rbuf.clear();
    let connect = Connect {
        protocol: config.protocol,
        clean_start: true,
        keep_alive: KEEP_ALIVE_S,
        client_id: st.client_id.as_str().into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    };
    let connack = match handshake(
        &mut tcp,
        connect,
        &mut st.rbuf,
        &mut st.wbuf,
        &mut decoder,
        config.connect_timeout,
    )
    .await
    {
        Ok(ack) => ack,
        Err(e) => return failed(false, e),
    };
    shared.counters.connected.fetch_add(1, Relaxed);
    let result = publish_loop(st, shared, &mut tcp, &mut decoder, &connack).await;
    shared.counters.connected.fetch_sub(1, Relaxed);
    match result {
        Ok(()) => SessionEnd::Finished,
        Err(e) => failed(true, e),
    }
}

fn failed(connected: bool, error: anyhow::Error) -> SessionEnd {
    SessionEnd::Failed { connected, error }
}

async fn publish_loop(
    st: &mut DeviceState,
    shared: &Shared,
    tcp: &mut TcpStream,
    decoder: &mut Decoder,
    connack: &sluice_proto::mqtt::ConnAck,
) -> anyhow::Result<()> {
    let config = &shared.config;
    let window = match connack.properties.receive_maximum {
        Some(rm) if config.protocol == ProtocolVersion::V5 => config.max_inflight.min(rm.max(1)),
        _ => config.max_inflight,
    };
    let ping_after = match connack.properties.server_keep_alive {
        Some(ka) if ka > 0 => PING_AFTER.min(Duration::from_secs(u64::from(ka)) / 2),
        _ => PING_AFTER,
    };
    let now = Instant::now();
    if st.next_send.is_none() {
        st.next_send = first_send(st, config, now);
    }
    let mut last_write = now;
    let (mut rd, mut wr) = tcp.split();
    let sleep = sleep_until(wake_at(
        st.next_send,
        last_write + ping_after,
        shared.stop_at,
    ));
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            biased;
            read = rd.read_buf(&mut st.rbuf) => {
                if read.context("reading from the broker")? == 0 {
                    bail!("the broker closed the connection");
                }
                drain_packets(st, shared, decoder)?;
            }
            () = &mut sleep => {
                let now = Instant::now();
                if now >= shared.stop_at {
                    break;
                }
                if let Some(due) = st.next_send.filter(|&due| now >= due) {
                    let lag = u64::try_from((now - due).as_micros()).unwrap_or(u64::MAX);
                    shared.counters.max_send_lag_us.fetch_max(lag, Relaxed);
                    if config.qos == QoS::AtLeastOnce && st.inflight.len() >= usize::from(window) {
                        shared.counters.skipped_inflight_full.fetch_add(1, Relaxed);
                        if let Some(own) = &mut st.own {
                            own.skipped_inflight_full += 1;
                        }
                    } else {
                        if let Some(id) = build_publish(st, shared)? {
                            st.inflight.push((id, Instant::now()));
                        }
                        wr.write_all(&st.wbuf).await.context("writing PUBLISH")?;
                        shared.counters.sent.fetch_add(1, Relaxed);
                        if let Some(own) = &mut st.own {
                            own.sent += 1;
                        }
                        last_write = Instant::now();
                    }
                    st.next_send = next_after(st, config, due);
                } else if now >= last_write + ping_after {
                    st.wbuf.clear();
                    encode(&Packet::PingReq, config.protocol, &mut st.wbuf).context("encoding PINGREQ")?;
                    wr.write_all(&st.wbuf).await.context("writing PINGREQ")?;
                    last_write = now;
                }
                sleep.as_mut().reset(wake_at(st.next_send, last_write + ping_after, shared.stop_at));
            }
        }
    }
    // Publishing is over: collect outstanding PUBACKs, then say goodbye.
    let drain_until = shared.stop_at + config.drain_timeout;
    while !st.inflight.is_empty() {
        match timeout_at(drain_until, rd.read_buf(&mut st.rbuf)).await {
            Err(_) => break,
            Ok(read) => {
                if read.context("reading from the broker")? == 0 {
                    bail!("the broker closed the connection during the ack drain");
                }
                drain_packets(st, shared, decoder)?;
            }
        }
    }
    st.wbuf.clear();
    let disconnect = Packet::Disconnect(Disconnect {
        reason: 0,
        properties: Properties::default(),
    });
    encode(&disconnect, config.protocol, &mut st.wbuf).context("encoding DISCONNECT")?;
    // Best effort: the run is over whatever the broker does with it.
    let _ = timeout(Duration::from_secs(1), async {
        let _ = wr.write_all(&st.wbuf).await;
        let _ = wr.shutdown().await;
    })
    .await;
    Ok(())
}

impl DeviceState {
    /// The next packet id (1..=65535, wrapping) not awaiting a PUBACK. Terminates because at
    /// most 65,535 ids exist and the window is at most 65,535 (and in practice ≤ 64).
    fn allocate_packet_id(&mut self) -> u16 {
        loop {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.inflight.iter().any(|&(p, _)| p == id) {
                return id;
            }
        }
    }
}

/// Encode the next PUBLISH of this device into its write buffer; returns its packet id (QoS 1).
fn build_publish(st: &mut DeviceState, shared: &Shared) -> anyhow::Result<Option<u16>> {
    let config = &shared.config;
    let size = if config.payload.min == config.payload.max {
        config.payload.min
    } else {
        st.rng.gen_range(config.payload.min..=config.payload.max)
    };
    let packet_id = (config.qos == QoS::AtLeastOnce).then(|| st.allocate_packet_id());
    let packet = Packet::Publish(Publish {
        packet_id,
        payload: shared.filler.slice(..size),
        ..st.template.clone()
    });
    st.wbuf.clear();
    encode(&packet, config.protocol, &mut st.wbuf).context("encoding PUBLISH")?;
    // The payload is the last `size` bytes of a PUBLISH: patch the header in place.
    let end = st.wbuf.len();
    let header = PayloadHeader {
        device: st.index,
        seq: st.seq,
        sent_at_ns: unix_now_ns(),
    };
    header
        .write_to(&mut st.wbuf[end - size..])
        .context("writing the bench header")?;
    st.seq += 1;
    Ok(packet_id)
}

/// Handle every complete packet in the read buffer.
fn drain_packets(
    st: &mut DeviceState,
    shared: &Shared,
    decoder: &mut Decoder,
) -> anyhow::Result<()> {
    while let Some(packet) = decoder
        .decode(&mut st.rbuf)
        .context("the broker sent a malformed packet")?
    {
        match packet {
            Packet::PubAck(ack) => {
                let Some(pos) = st.inflight.iter().position(|&(id, _)| id == ack.packet_id) else {
                    continue; // An ack for nothing we await (e.g. a duplicate): ignore.
                };
                let (_, sent_at) = st.inflight.swap_remove(pos);
                let micros = u64::try_from(sent_at.elapsed().as_micros()).unwrap_or(u64::MAX);
                shared.ack_latency.record_us(st.index as usize, micros);
                let steady = sent_at >= shared.steady_from;
                if steady {
                    shared
                        .ack_latency_steady
                        .record_us(st.index as usize, micros);
                }
                let rejected = ack.reason >= reason::UNSPECIFIED_ERROR;
                if rejected {
                    shared.counters.rejected.fetch_add(1, Relaxed);
                } else {
                    shared.counters.acknowledged.fetch_add(1, Relaxed);
                }
                if let Some(own) = &mut st.own {
                    if steady {
                        crate::stats::record_us(&mut own.ack_latency_steady, micros);
                    }
                    if rejected {
                        own.rejected += 1;
                    } else {
                        own.acknowledged += 1;
                    }
                }
            }
            Packet::PingResp => {}
            Packet::Disconnect(d) => {
                bail!("the broker sent DISCONNECT (reason 0x{:02x})", d.reason)
            }
            other => tracing::trace!(packet = other.name(), "ignoring an unexpected packet"),
        }
    }
    // Keep the buffer from shrinking to nothing after `split_to` in the decoder.
    if st.rbuf.capacity() - st.rbuf.len() < 64 {
        st.rbuf.reserve(256);
    }
    Ok(())
}

fn first_send(st: &mut DeviceState, config: &DevicesConfig, now: Instant) -> Option<Instant> {
    if config.rate_per_device <= 0.0 {
        return None;
    }
    let mean = 1.0 / config.rate_per_device;
    let gap = match config.arrivals {
        Arrivals::Periodic => mean * st.rng.gen::<f64>(),
        Arrivals::Poisson => exponential(&mut st.rng, mean),
    };
    Some(now + Duration::from_secs_f64(gap))
}

fn next_after(st: &mut DeviceState, config: &DevicesConfig, due: Instant) -> Option<Instant> {
    let mean = 1.0 / config.rate_per_device;
    let gap = match config.arrivals {
        Arrivals::Periodic => mean,
        Arrivals::Poisson => exponential(&mut st.rng, mean),
    };
    Some(due + Duration::from_secs_f64(gap))
}

/// An exponentially distributed value with the given mean (inverse transform sampling).
fn exponential(rng: &mut SmallRng, mean: f64) -> f64 {
    let u: f64 = rng.gen(); // [0, 1)
    -(1.0 - u).ln() * mean
}

fn wake_at(next_send: Option<Instant>, ping_at: Instant, stop_at: Instant) -> Instant {
    let wake = ping_at.min(stop_at);
    next_send.map_or(wake, |s| s.min(wake))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(devices: u32, high_share: f64) -> DevicesConfig {
        let mut c = DevicesConfig::new(std::net::SocketAddr::from(([127, 0, 0, 1], 1883)));
        c.devices = devices;
        c.high_share = high_share;
        c
    }

    #[test]
    fn the_high_share_rounds_to_whole_devices() {
        assert_eq!(high_devices(4, 0.0), 0);
        assert_eq!(high_devices(4, 0.25), 1);
        assert_eq!(high_devices(4, 0.3), 1);
        assert_eq!(high_devices(4, 0.4), 2);
        assert_eq!(high_devices(3, 0.5), 2, "1.5 rounds half away from zero");
        assert_eq!(high_devices(1, 0.49), 0);
        assert_eq!(high_devices(1, 1.0), 1);
        assert_eq!(high_devices(16384, 0.01), 164);
        assert_eq!(high_devices(10, 7.0), 10, "clamped");
        assert_eq!(high_devices(10, f64::NAN), 0);
    }

    #[test]
    fn the_lowest_indices_are_high_and_get_a_hi_client_id() {
        let c = config(4, 0.25);
        assert_eq!(c.high_devices(), 1);
        assert_eq!(c.client_id(0), "bench-hi-0");
        assert_eq!(c.client_id(1), "bench-1");
        assert_eq!(c.client_id(3), "bench-3");
        let mut c = config(5, 0.4);
        c.client_prefix = "meter".to_string();
        let ids: Vec<String> = (0..5).map(|i| c.client_id(i)).collect();
        assert_eq!(
            ids,
            ["meter-hi-0", "meter-hi-1", "meter-2", "meter-3", "meter-4"]
        );
        let c = config(3, 0.0);
        assert_eq!(c.client_id(0), "bench-0", "no share, no high devices");
    }

    #[test]
    fn a_high_share_outside_zero_to_one_is_refused() {
        for bad in [-0.1, 1.01, f64::NAN, f64::INFINITY] {
            let e = config(4, bad).validate().unwrap_err();
            assert!(e.to_string().contains("between 0.0 and 1.0"), "{e}");
        }
        for ok in [0.0, 0.5, 1.0] {
            config(4, ok).validate().expect("valid share");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn high_devices_connect_with_their_hi_client_id_and_each_device_is_reported(
    ) -> anyhow::Result<()> {
        let broker =
            tokio::task::spawn_blocking(|| sluice_testkit::Mosquitto::builder().start()).await??;
        let mut c = DevicesConfig::new(broker.plain_addr());
        c.devices = 4;
        c.high_share = 0.25;
        c.rate_per_device = 50.0;
        c.payload = PayloadSize { min: 64, max: 64 };
        c.duration = Duration::from_millis(600);
        c.ramp = Duration::from_millis(100);
        c.progress_every = None;
        let report = run_devices(c).await?;
        assert_eq!(report.high_devices, 1);
        assert_eq!(report.per_device.len(), 4);
        let ids: Vec<&str> = report
            .per_device
            .iter()
            .map(|t| t.client_id.as_str())
            .collect();
        assert_eq!(ids, ["bench-hi-0", "bench-1", "bench-2", "bench-3"]);
        assert_eq!(
            report.per_device.iter().map(|t| t.high).collect::<Vec<_>>(),
            [true, false, false, false]
        );
        let sent: u64 = report.per_device.iter().map(|t| t.sent).sum();
        assert_eq!(sent, report.sent);
        for t in &report.per_device {
            assert!(t.sent > 0, "{t:?}");
            assert_eq!(t.acknowledged, t.sent, "{t:?}");
            assert!(t.ack_latency_steady.count > 0, "{t:?}");
        }
        broker
            .wait_for_log_async("as bench-hi-0", Duration::from_secs(2))
            .await?;
        broker
            .wait_for_log_async("as bench-3", Duration::from_secs(2))
            .await?;
        Ok(())
    }
}
