//! The `throughput` scenario: how many 1 KB QoS 1 messages per second a system under test (SUT)
//! sustains on its way to a TLS 1.3 cloud, found with a step load.
//!
//! Owns: a *pipelined* device fleet (few devices, each publishing as fast as its pacing and its
//! inflight window allow, several PUBLISHes per write), the step controller, the per-step
//! measurements and the report (JSON and Markdown). Does not own: the SUT processes (sluice via
//! [`crate::harness::sut::SluiceChild`], the bridge via `sluice-testkit`), the cloud (a Mosquitto
//! from `sluice-testkit`, or the in-process [`crate::sinks::fastsink`]).
//!
//! # Why a separate fleet from [`crate::load::devices`]
//! `devices` models many slow devices: one timer wake-up and one write per PUBLISH. At 100k+
//! msg/s on a 2-core machine that costs more CPU than the SUT. This fleet models a few fast
//! devices (default 128): each device is one task with a token bucket; when it wakes (at most
//! every `pacing_tick`, default 5 ms) it encodes every PUBLISH it is due *and* has window room
//! for into one buffer and writes it with one syscall. Acks are read in batches too.
//! - Rate: the controller sets a total offered rate, split evenly over the devices
//!   (`f64::INFINITY` = as fast as the windows allow; 0 = pause). Tokens accrue at the
//!   per-device rate and are capped at [`BURST`] worth of messages; tokens above the cap are
//!   *dropped at the source and counted*: as `window_full_drops` when the device's inflight
//!   window was full (the SUT did not acknowledge fast enough), else as `late_drops` (the
//!   generator did not get to run on time: the generator is the limit).
//! - Window: at most `window` QoS 1 PUBLISHes await PUBACK per device (default 64, sluice's
//!   default Receive Maximum; an MQTT 5 CONNACK Receive Maximum lowers it).
//! - Payload: the bench header ([`crate::payload`], send time = just before the write) then
//!   random filler; fixed size (default 1,024 bytes). Keep-alive 0 (the run is short and busy).
//! - A connection failure ends that device (counted in `device_failures`); there is no
//!   reconnect — a throughput run with a lost device is suspect and the report says so.
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
//! - `mosquitto`: a TLS 1.3 Mosquitto; a measuring subscriber ([`fastsink::subscribe_measuring`])
//!   takes everything (`#`, QoS 1) and measures e2e latency. Mosquitto's own CPU is reported.
//! - `fast-sink`: the in-process fast acknowledging sink ([`crate::sinks::fastsink`]) is the cloud; it
//!   PUBACKs at once and measures e2e latency, so the broker does not set the limit.
//!
//! The sink (or subscriber) runs on its own single-worker tokio runtime whose thread is named
//! `fastsink`, so its CPU can be told apart from the generator's (`/proc/self/task/*/stat`).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::{Bytes, BytesMut};
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng as _, RngCore as _, SeedableRng as _};
use serde::Serialize;
use sluice_proto::mqtt::{
    encode, reason, Connect, Decoder, Disconnect, Packet, Properties, ProtocolVersion, Publish, QoS,
};
use sluice_testkit::{Mosquitto, TestPki};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};

use crate::conn::handshake;
use crate::harness::machine::{loadavg, machine, Machine};
use crate::harness::procfs::{self, round1, round3, CpuMeter, Pid};
use crate::harness::sut::{SluiceChild, Sut};
use crate::load::devices::version_name;
use crate::payload::{unix_now_ns, PayloadHeader, HEADER_LEN};
pub use crate::report::write_json;
use crate::sinks::fastsink::{
    self, start_fast_sink, FastSink, FastSinkConfig, FastSinkReport, LatencyWindow,
    SubscriberConfig,
};
use crate::stats::LatencySummary;

/// Tokens above this much time's worth of messages are dropped (and counted).
pub const BURST: Duration = Duration::from_millis(50);
/// Name of the sink runtime's worker thread (≤ 15 bytes: it is the thread's `comm`).
const SINK_THREAD: &str = "fastsink";

// ------------------------------------------------------------------------------------------
// The pipelined fleet
// ------------------------------------------------------------------------------------------

/// Parameters of a pipelined device fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The SUT's device listener (plain TCP MQTT).
    pub target: SocketAddr,
    pub devices: u32,
    /// Bytes per payload (at least the 24-byte bench header).
    pub payload_size: usize,
    /// QoS 1 PUBLISHes awaiting PUBACK per device, at most.
    pub window: u16,
    pub protocol: ProtocolVersion,
    /// Client ids `{client_prefix}-{i}`, topics `{topic_prefix}/{i}`.
    pub client_prefix: String,
    pub topic_prefix: String,
    /// Shortest sleep between two sends of one device (sends are batched within it).
    pub pacing_tick: Duration,
    pub connect_timeout: Duration,
    pub seed: u64,
}

impl FleetConfig {
    /// 128 devices, 1,024-byte payloads, window 64, MQTT 3.1.1, 5 ms pacing.
    pub fn new(target: SocketAddr) -> FleetConfig {
        FleetConfig {
            target,
            devices: 128,
            payload_size: 1024,
            window: 64,
            protocol: ProtocolVersion::V311,
            client_prefix: "tput".to_string(),
            topic_prefix: "tput".to_string(),
            pacing_tick: Duration::from_millis(5),
            connect_timeout: Duration::from_secs(10),
            seed: 0x5111_CE01,
        }
    }
}

/// Live counters of a fleet.
#[derive(Debug, Default)]
pub struct FleetCounters {
    pub connected: AtomicU64,
    pub connect_failures: AtomicU64,
    /// Devices whose connection failed after CONNACK (they stop; no reconnect).
    pub device_failures: AtomicU64,
    pub sent: AtomicU64,
    pub acknowledged: AtomicU64,
    /// PUBACKs with a failure reason code (MQTT 5).
    pub rejected: AtomicU64,
    /// Offered messages not sent because the device's window was full.
    pub window_full_drops: AtomicU64,
    /// Offered messages not sent because the device task ran too late.
    pub late_drops: AtomicU64,
}

/// A copy of [`FleetCounters`].
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct FleetSnapshot {
    pub connected: u64,
    pub connect_failures: u64,
    pub device_failures: u64,
    pub sent: u64,
    pub acknowledged: u64,
    pub rejected: u64,
    pub window_full_drops: u64,
    pub late_drops: u64,
}

impl FleetCounters {
    pub fn snapshot(&self) -> FleetSnapshot {
        FleetSnapshot {
            connected: self.connected.load(Relaxed),
            connect_failures: self.connect_failures.load(Relaxed),
            device_failures: self.device_failures.load(Relaxed),
            sent: self.sent.load(Relaxed),
            acknowledged: self.acknowledged.load(Relaxed),
            rejected: self.rejected.load(Relaxed),
            window_full_drops: self.window_full_drops.load(Relaxed),
            late_drops: self.late_drops.load(Relaxed),
        }
    }
}

/// What the controller tells every device.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Control {
    /// Messages per second for each device; 0 = pause, infinity = window-limited.
    per_device_rate: f64,
    stop: bool,
}

struct FleetShared {
    config: FleetConfig,
    counters: FleetCounters,
    ack_latency: LatencyWindow,
    filler: Bytes,
    first_error: Mutex<Option<String>>,
    /// When the devices stop waiting for outstanding PUBACKs after a stop.
    drain_until: Mutex<Option<Instant>>,
}

/// A connected fleet of pipelined devices; idle until [`Fleet::set_total_rate`].
pub struct Fleet {
    shared: Arc<FleetShared>,
    control: watch::Sender<Control>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("target", &self.shared.config.target)
            .field("devices", &self.shared.config.devices)
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// Connect every device (64 connection attempts at a time) and return once all have their
    /// CONNACK. Fails if any device cannot connect.
    pub async fn connect(config: FleetConfig) -> anyhow::Result<Fleet> {
        if config.devices == 0 {
            bail!("at least one device is needed");
        }
        if config.window == 0 {
            bail!("the inflight window must be at least 1");
        }
        if config.payload_size < HEADER_LEN
            || config.payload_size > crate::load::devices::MAX_PAYLOAD
        {
            bail!(
                "the payload size must be {HEADER_LEN}..={} bytes",
                crate::load::devices::MAX_PAYLOAD
            );
        }
        let mut filler = vec![0u8; config.payload_size];
        SmallRng::seed_from_u64(config.seed).fill_bytes(&mut filler);
        let shared = Arc::new(FleetShared {
            filler: Bytes::from(filler),
            counters: FleetCounters::default(),
            ack_latency: LatencyWindow::default(),
            first_error: Mutex::new(None),
            drain_until: Mutex::new(None),
            config,
        });
        let (control, control_rx) = watch::channel(Control {
            per_device_rate: 0.0,
            stop: false,
        });
        let connect_slots = Arc::new(Semaphore::new(64));
        let mut tasks = JoinSet::new();
        for index in 0..shared.config.devices {
            tasks.spawn(device(
                index,
                shared.clone(),
                control_rx.clone(),
                connect_slots.clone(),
            ));
        }
        let fleet = Fleet {
            shared,
            control,
            tasks,
        };
        let n = u64::from(fleet.shared.config.devices);
        let deadline = Instant::now() + fleet.shared.config.connect_timeout * 2;
        loop {
            let c = fleet.counters();
            if c.connect_failures > 0 {
                bail!(
                    "{} of {n} devices could not connect to {}: {}",
                    c.connect_failures,
                    fleet.shared.config.target,
                    fleet.first_error()
                );
            }
            if c.connected == n {
                return Ok(fleet);
            }
            if Instant::now() >= deadline {
                bail!(
                    "only {} of {n} devices connected to {} in time",
                    c.connected,
                    fleet.shared.config.target
                );
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Offer `msgs_per_s` in total, split evenly over the devices (`f64::INFINITY`: as fast as
    /// the windows allow; 0: pause).
    pub fn set_total_rate(&self, msgs_per_s: f64) {
        let per_device = msgs_per_s.max(0.0) / f64::from(self.shared.config.devices);
        self.control.send_modify(|c| c.per_device_rate = per_device);
    }

    pub fn counters(&self) -> FleetSnapshot {
        self.shared.counters.snapshot()
    }

    /// PUBLISH written → PUBACK read, for PUBACKs read since the last take.
    pub fn take_ack_latency(&self) -> Histogram<u64> {
        self.shared.ack_latency.take()
    }

    fn first_error(&self) -> String {
        self.shared
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "no error recorded".to_string())
    }

    /// Stop publishing, wait up to `drain` for outstanding PUBACKs, disconnect every device.
    pub async fn stop(mut self, drain: Duration) -> FleetSnapshot {
        *self
            .shared
            .drain_until
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + drain);
        self.control.send_modify(|c| c.stop = true);
        let _ = timeout(drain + Duration::from_secs(3), async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        self.tasks.abort_all();
        self.counters()
    }
}

/// Per-device state.
struct DeviceState {
    index: u32,
    template: Publish,
    seq: u64,
    next_packet_id: u16,
    /// (packet id, written at) of PUBLISHes awaiting PUBACK, oldest first.
    inflight: VecDeque<(u16, Instant)>,
    tokens: f64,
    refilled_at: Instant,
    rbuf: BytesMut,
    wbuf: BytesMut,
    latencies: Vec<u64>,
}

async fn device(
    index: u32,
    shared: Arc<FleetShared>,
    control: watch::Receiver<Control>,
    connect_slots: Arc<Semaphore>,
) {
    let mut connected = false;
    let result = run_device(index, &shared, control, &connect_slots, &mut connected).await;
    if let Err(error) = result {
        let counter = if connected {
            &shared.counters.device_failures
        } else {
            &shared.counters.connect_failures
        };
        counter.fetch_add(1, Relaxed);
        let text = format!("device {index}: {error:#}");
        tracing::warn!(device = index, error = %text, "throughput device failed");
        let mut first = shared.first_error.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(text);
    }
}

async fn run_device(
    index: u32,
    shared: &FleetShared,
    mut control: watch::Receiver<Control>,
    connect_slots: &Semaphore,
    connected: &mut bool,
) -> anyhow::Result<()> {
    let config = &shared.config;
    let mut decoder = Decoder::client(config.protocol, crate::conn::MAX_INBOUND_PACKET);
    let mut st = DeviceState {
        index,
        template: Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain: false,
            topic: format!("{}/{index}", config.topic_prefix).as_str().into(),
            packet_id: None,
            properties: None,
            payload: Bytes::new(),
        },
        seq: 0,
        next_packet_id: 1,
        inflight: VecDeque::with_capacity(usize::from(config.window)),
        tokens: 0.0,
        refilled_at: Instant::now(),
        rbuf: BytesMut::with_capacity(4096),
        wbuf: BytesMut::with_capacity(16 * (config.payload_size + 64)),
        latencies: Vec::with_capacity(usize::from(config.window)),
    };
    let (mut tcp, connack) = {
        let _slot = connect_slots
            .acquire()
            .await
            .map_err(|_| anyhow!("connect slots closed"))?;
        let mut tcp = timeout(config.connect_timeout, TcpStream::connect(config.target))
            .await
            .map_err(|_| anyhow!("TCP connect timed out"))?
            .context("TCP connect")?;
        tcp.set_nodelay(true).context("setting TCP_NODELAY")?;
        let connect = Connect {
            protocol: config.protocol,
            clean_start: true,
            keep_alive: 0,
            client_id: format!("{}-{index}", config.client_prefix).into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        };
        let connack = handshake(
            &mut tcp,
            connect,
            &mut st.rbuf,
            &mut st.wbuf,
            &mut decoder,
            config.connect_timeout,
        )
        .await?;
        (tcp, connack)
    };
    *connected = true;
    shared.counters.connected.fetch_add(1, Relaxed);
    let window = match connack.properties.receive_maximum {
        Some(rm) if config.protocol == ProtocolVersion::V5 => config.window.min(rm.max(1)),
        _ => config.window,
    } as usize;
    // Desynchronise the devices' wake-ups.
    st.tokens = SmallRng::seed_from_u64(config.seed ^ u64::from(index)).gen::<f64>();
    let (mut rd, mut wr) = tcp.split();
    let result: anyhow::Result<()> = async {
        loop {
            let ctl = *control.borrow_and_update();
            if ctl.stop {
                return Ok(());
            }
            let now = Instant::now();
            let rate = ctl.per_device_rate;
            let room = window - st.inflight.len().min(window);
            let due = if rate.is_infinite() {
                room
            } else {
                st.tokens += rate * now.duration_since(st.refilled_at).as_secs_f64();
                (st.tokens.max(0.0) as usize).min(room)
            };
            st.refilled_at = now;
            if due > 0 {
                build_publishes(&mut st, shared, due, now)?;
                wr.write_all(&st.wbuf).await.context("writing PUBLISHes")?;
                shared.counters.sent.fetch_add(due as u64, Relaxed);
                if rate.is_finite() {
                    st.tokens -= due as f64;
                }
            }
            let room_left = room - due;
            if rate.is_finite() {
                let cap = (rate * BURST.as_secs_f64()).max(1.0);
                let excess = (st.tokens - cap).floor();
                if excess >= 1.0 {
                    let counter = if room_left == 0 {
                        &shared.counters.window_full_drops
                    } else {
                        &shared.counters.late_drops
                    };
                    counter.fetch_add(excess as u64, Relaxed);
                    st.tokens -= excess;
                }
            }
            // Sleep until a token is due (never shorter than the pacing tick), unless the window
            // is full (then only a PUBACK can let us send) or we are paused.
            let wake = (rate > 0.0 && rate.is_finite() && room_left > 0).then(|| {
                let need = (1.0 - st.tokens).max(0.0) / rate;
                now + Duration::from_secs_f64(need.min(3600.0)).max(config.pacing_tick)
            });
            tokio::select! {
                biased;
                read = rd.read_buf(&mut st.rbuf) => {
                    if read.context("reading from the SUT")? == 0 {
                        bail!("the SUT closed the connection");
                    }
                    take_acks(&mut st, shared, &mut decoder)?;
                }
                changed = control.changed() => {
                    if changed.is_err() {
                        return Ok(()); // The controller is gone: stop.
                    }
                }
                () = sleep_until(wake.unwrap_or(now)), if wake.is_some() => {}
            }
        }
    }
    .await;
    result?;
    // Stopped: collect outstanding PUBACKs, then say goodbye.
    let drain_until = shared
        .drain_until
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or_else(Instant::now);
    while !st.inflight.is_empty() {
        match timeout_at(drain_until, rd.read_buf(&mut st.rbuf)).await {
            Err(_) => break,
            Ok(read) => {
                if read.context("reading from the SUT")? == 0 {
                    break;
                }
                take_acks(&mut st, shared, &mut decoder)?;
            }
        }
    }
    st.wbuf.clear();
    let disconnect = Packet::Disconnect(Disconnect {
        reason: 0,
        properties: Properties::default(),
    });
    encode(&disconnect, config.protocol, &mut st.wbuf).context("encoding DISCONNECT")?;
    let _ = timeout(Duration::from_secs(1), async {
        let _ = wr.write_all(&st.wbuf).await;
        let _ = wr.shutdown().await;
    })
    .await;
    Ok(())
}

/// Encode `count` PUBLISHes into the device's write buffer (replacing what was there).
fn build_publishes(
    st: &mut DeviceState,
    shared: &FleetShared,
    count: usize,
    now: Instant,
) -> anyhow::Result<()> {
    let config = &shared.config;
    let size = config.payload_size;
    let sent_at_ns = unix_now_ns();
    st.wbuf.clear();
    for _ in 0..count {
        let id = allocate_packet_id(st);
        let packet = Packet::Publish(Publish {
            packet_id: Some(id),
            payload: shared.filler.clone(),
            ..st.template.clone()
        });
        encode(&packet, config.protocol, &mut st.wbuf).context("encoding PUBLISH")?;
        let end = st.wbuf.len();
        PayloadHeader {
            device: st.index,
            seq: st.seq,
            sent_at_ns,
        }
        .write_to(&mut st.wbuf[end - size..])
        .context("writing the bench header")?;
        st.seq += 1;
        st.inflight.push_back((id, now));
    }
    Ok(())
}

/// The next packet id (1..=65535, wrapping) not awaiting a PUBACK. Terminates: at most
/// `window` ≤ 65,535 ids are in use.
fn allocate_packet_id(st: &mut DeviceState) -> u16 {
    loop {
        let id = st.next_packet_id;
        st.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
        if !st.inflight.iter().any(|&(p, _)| p == id) {
            return id;
        }
    }
}

fn take_acks(
    st: &mut DeviceState,
    shared: &FleetShared,
    decoder: &mut Decoder,
) -> anyhow::Result<()> {
    let now = Instant::now();
    let (mut acked, mut rejected) = (0u64, 0u64);
    st.latencies.clear();
    while let Some(packet) = decoder
        .decode(&mut st.rbuf)
        .context("the SUT sent a malformed packet")?
    {
        match packet {
            Packet::PubAck(ack) => {
                // Acks normally come in order: the oldest is at the front.
                let pos = match st.inflight.front() {
                    Some(&(id, _)) if id == ack.packet_id => Some(0),
                    _ => st.inflight.iter().position(|&(id, _)| id == ack.packet_id),
                };
                let Some((_, sent_at)) = pos.and_then(|p| st.inflight.remove(p)) else {
                    continue; // An ack for nothing we await: ignore.
                };
                st.latencies
                    .push(u64::try_from((now - sent_at).as_micros()).unwrap_or(u64::MAX));
                if ack.reason >= reason::UNSPECIFIED_ERROR {
                    rejected += 1;
                } else {
                    acked += 1;
                }
            }
            Packet::PingResp => {}
            Packet::Disconnect(d) => bail!("the SUT sent DISCONNECT (reason 0x{:02x})", d.reason),
            other => tracing::trace!(packet = other.name(), "ignoring an unexpected packet"),
        }
    }
    shared.ack_latency.record_all(&st.latencies);
    shared.counters.acknowledged.fetch_add(acked, Relaxed);
    shared.counters.rejected.fetch_add(rejected, Relaxed);
    if st.rbuf.capacity() - st.rbuf.len() < 256 {
        st.rbuf.reserve(4096);
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The scenario
// ------------------------------------------------------------------------------------------

/// Where the SUT's uplink goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cloud {
    /// A TLS 1.3 Mosquitto with a measuring subscriber.
    Mosquitto,
    /// The in-process fast acknowledging sink.
    FastSink,
}

impl Cloud {
    pub fn name(self) -> &'static str {
        match self {
            Cloud::Mosquitto => "mosquitto",
            Cloud::FastSink => "fast-sink",
        }
    }
}

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
    /// `[gateway] shards` (0 = one per core).
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

/// The sink's runtime: one worker thread named [`SINK_THREAD`]. Shut down without blocking
/// when dropped (dropping a runtime inside another one's task would panic).
struct SinkRuntime(Option<tokio::runtime::Runtime>);

impl SinkRuntime {
    fn new() -> anyhow::Result<SinkRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(SINK_THREAD)
            .enable_all()
            .build()
            .context("starting the sink runtime")?;
        Ok(SinkRuntime(Some(rt)))
    }
    fn handle(&self) -> anyhow::Result<tokio::runtime::Handle> {
        self.0
            .as_ref()
            .map(|rt| rt.handle().clone())
            .ok_or_else(|| anyhow!("the sink runtime is gone"))
    }
}

impl Drop for SinkRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The cloud side of one run.
struct CloudSide {
    sink: FastSink,
    /// The TLS port the SUT connects to.
    port: u16,
    /// The Mosquitto cloud, when there is one.
    broker: Option<Mosquitto>,
}

async fn start_cloud(cloud: Cloud, pki: &TestPki, rt: &SinkRuntime) -> anyhow::Result<CloudSide> {
    let handle = rt.handle()?;
    match cloud {
        Cloud::FastSink => {
            let tls = fastsink::tls_server_config(pki.server_cert_path(), pki.server_key_path())?;
            let sink = handle
                .spawn(async move {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                        .await
                        .context("binding the fast sink")?;
                    start_fast_sink(listener, FastSinkConfig::new(tls))
                })
                .await
                .context("fast sink start-up panicked")??;
            Ok(CloudSide {
                port: sink.local_addr().port(),
                sink,
                broker: None,
            })
        }
        Cloud::Mosquitto => {
            let ca = pki.ca_path().to_path_buf();
            let builder = Mosquitto::builder().tls(pki).plain_listener(false);
            let broker = tokio::task::spawn_blocking(move || builder.start())
                .await
                .context("cloud start-up panicked")?
                .context("starting the cloud Mosquitto")?;
            let subscriber = SubscriberConfig {
                broker: broker.tls_addr(),
                ca_file: Some(ca),
                server_name: "127.0.0.1".to_string(),
                topic: "#".to_string(),
                protocol: ProtocolVersion::V311,
                measure_latency: true,
            };
            let sink = handle
                .spawn(fastsink::subscribe_measuring(subscriber))
                .await
                .context("subscriber start-up panicked")??;
            Ok(CloudSide {
                port: broker.tls_port(),
                sink,
                broker: Some(broker),
            })
        }
    }
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
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\n\n\
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

async fn start_sut(
    kind: Sut,
    config: &ThroughputScenario,
    pki: &TestPki,
    cloud: &CloudSide,
) -> anyhow::Result<SutSide> {
    let expected_uplinks = match kind {
        Sut::Sluice if config.sluice_shards > 0 => u64::from(config.sluice_shards),
        Sut::Sluice => std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        Sut::MosquittoBridge => 1,
        Sut::Floor => bail!("the floor is measured by `scenario core`, not `scenario throughput`"),
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
            let lines = Mosquitto::bridge_config_lines(cloud.port, pki);
            let config_text = lines.join("\n");
            let edge = tokio::task::spawn_blocking(move || {
                Mosquitto::builder().config_lines(lines).start()
            })
            .await
            .context("edge start-up panicked")?
            .context("starting the edge Mosquitto bridge")?;
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
        Sut::Floor => unreachable!("refused above"),
    };
    // Wait until the SUT's uplink(s) are connected to the cloud.
    let deadline = Instant::now() + Duration::from_secs(15);
    match &cloud.broker {
        Some(broker) => {
            let needle = match kind {
                Sut::Sluice => "as sluice-gw",
                Sut::MosquittoBridge | Sut::Floor => "sluice-edge-bridge",
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
            Sut::Sluice => std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
            Sut::MosquittoBridge | Sut::Floor => 1,
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

fn step_line(s: &StepResult) -> String {
    format!(
        "[step {:>2} {:<6}] offered {:>8.0}  sent {:>8.0}  acked {:>8.0}  achieved {:>8.0} msg/s  \
         e2e p50/p99 {:.2}/{:.2} ms  ack p50/p99 {:.2}/{:.2} ms  SUT {:.0}% {:.2} µs/msg  cloud {:.0}%  \
         gen {:.0}%  machine {:.0}% (other {:.0}%)  drops w/l {}/{}  → {}",
        s.step,
        s.phase,
        s.offered_rate,
        s.sent_rate,
        s.acked_rate,
        s.achieved_rate,
        s.e2e_latency.p50_ms,
        s.e2e_latency.p99_ms,
        s.ack_latency.p50_ms,
        s.ack_latency.p99_ms,
        s.sut_cpu_percent,
        s.sut_cpu_us_per_msg,
        s.cloud_cpu_percent,
        s.generator_cpu_percent,
        s.machine_cpu_percent,
        s.other_cpu_percent,
        s.window_full_drops,
        s.late_drops,
        s.verdict
    ) + &if s.other_processes.is_empty() {
        String::new()
    } else {
        format!("  [others: {}]", s.other_processes.join(", "))
    }
}

/// CPU time used so far by this process's threads whose name starts with `prefix`.
fn threads_cpu(prefix: &str) -> Duration {
    let Ok(entries) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let per_second = procfs::clock_ticks_per_second();
    let mut ticks = 0u64;
    for entry in entries.flatten() {
        let dir = entry.path();
        let named = std::fs::read_to_string(dir.join("comm"))
            .map(|c| c.trim().starts_with(prefix))
            .unwrap_or(false);
        if !named {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(dir.join("stat")) {
            ticks += procfs::parse_stat_cpu_ticks(&stat).unwrap_or(0);
        }
    }
    Duration::from_nanos(ticks.saturating_mul(1_000_000_000 / per_second))
}

/// CPU ticks so far of every process: pid → (command name, utime + stime).
fn process_cpu_ticks() -> std::collections::HashMap<u32, (String, u64)> {
    let mut out = std::collections::HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let comm = stat
            .find('(')
            .zip(stat.rfind(')'))
            .and_then(|(a, b)| stat.get(a + 1..b))
            .unwrap_or("?")
            .to_string();
        if let Ok(ticks) = procfs::parse_stat_cpu_ticks(&stat) {
            out.insert(pid, (comm, ticks));
        }
    }
    out
}

/// Processes other than `ours` that used at least 2 % of one core between two snapshots,
/// busiest first, at most five: "comm (pid) N %".
fn busiest_others(
    before: &std::collections::HashMap<u32, (String, u64)>,
    after: &std::collections::HashMap<u32, (String, u64)>,
    ours: &[u32],
    wall: Duration,
) -> Vec<String> {
    let ticks_per_s = procfs::clock_ticks_per_second() as f64;
    let secs = wall.as_secs_f64().max(1e-9);
    let mut busy: Vec<(f64, String)> = after
        .iter()
        .filter(|(pid, _)| !ours.contains(pid))
        .filter_map(|(pid, (comm, ticks))| {
            let start = before.get(pid).map_or(0, |(_, t)| *t);
            let percent = ticks.saturating_sub(start) as f64 / ticks_per_s / secs * 100.0;
            (percent >= 2.0).then(|| (percent, format!("{comm} ({pid}) {percent:.0} %")))
        })
        .collect();
    busy.sort_by(|a, b| b.0.total_cmp(&a.0));
    busy.into_iter().take(5).map(|(_, s)| s).collect()
}

/// (busy, total) jiffies of all CPUs from the first line of /proc/stat.
fn machine_cpu() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().next() else {
        return (0, 0);
    };
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    // idle (4th) and iowait (5th) are not busy.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

fn machine_cpu_percent(before: (u64, u64), after: (u64, u64)) -> f64 {
    let total = after.1.saturating_sub(before.1);
    if total == 0 {
        return 0.0;
    }
    round1(after.0.saturating_sub(before.0) as f64 / total as f64 * 100.0)
}

// ------------------------------------------------------------------------------------------
// Reports
// ------------------------------------------------------------------------------------------

/// The Markdown summary: one table of maxima, then the steps of every run.
pub fn markdown(report: &ThroughputReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "### throughput: {} devices × window {}, {} B payloads, QoS 1, MQTT {}, TLS 1.3 uplink; steps of {} s ({} s warm-up) from {} msg/s ×{}, p99 bound {} ms, ≥ {:.0} % delivered\n",
        p.devices, p.window, p.payload_bytes, p.mqtt, p.step_s, p.warmup_s, p.start_rate, p.step_factor, p.p99_bound_ms, p.min_delivery * 100.0
    );
    let _ = writeln!(
        out,
        "commit `{}`{} · nproc {} · CPU {} · kernel {} · {} · loadavg at start {}\n",
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
        m.loadavg_at_start
    );
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(
        out,
        "sluice: {}\n",
        report.params.sluice_aggregate.describe()
    );
    let _ = writeln!(
        out,
        "| SUT | cloud | max sustained, msg/s | SUT CPU at max, µs/msg | SUT CPU at max, % of one core | machine CPU at max, % of all cores | what stopped the ramp | limited by |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---|---|");
    for r in &report.runs {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.2} | {:.0} | {:.0} | {} | {} |",
            r.sut.name(),
            r.cloud.name(),
            r.max_sustained_rate,
            r.sut_cpu_us_per_msg_at_max,
            r.sut_cpu_percent_at_max,
            r.machine_cpu_percent_at_max,
            r.stopped_because,
            r.limited_by.as_deref().unwrap_or("—"),
        );
    }
    for r in &report.runs {
        let _ = writeln!(
            out,
            "\n#### {} → {} ({} uplink connection{})\n",
            r.sut.name(),
            r.cloud.name(),
            r.uplink_connections,
            if r.uplink_connections == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            out,
            "| step | offered | sent | acked | achieved | e2e p50 / p99, ms | ack p50 / p99, ms | SUT CPU % | SUT µs/msg | cloud CPU % | generator CPU % | machine CPU % (other work) | drops window / late | verdict |"
        );
        let _ = writeln!(
            out,
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for s in &r.steps {
            let _ = writeln!(
                out,
                "| {}{} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} ({:.0}) | {} / {} | {}{}{}{}{} |",
                s.step,
                if s.phase == "refine" { " (refine)" } else { "" },
                s.offered_rate,
                s.sent_rate,
                s.acked_rate,
                s.achieved_rate,
                s.e2e_latency.p50_ms,
                s.e2e_latency.p99_ms,
                s.ack_latency.p50_ms,
                s.ack_latency.p99_ms,
                s.sut_cpu_percent,
                s.sut_cpu_us_per_msg,
                s.cloud_cpu_percent,
                s.generator_cpu_percent,
                s.machine_cpu_percent,
                s.other_cpu_percent,
                s.window_full_drops,
                s.late_drops,
                s.verdict,
                s.limited_by
                    .as_ref()
                    .map(|l| format!(" — limited by {l}"))
                    .unwrap_or_default(),
                if s.duplicates > 0 {
                    format!(" [{} duplicates]", s.duplicates)
                } else {
                    String::new()
                },
                match s.cooldown_drained {
                    Some(false) => " (started with a backlog: the cool-down did not drain it)",
                    _ => "",
                },
                if s.other_processes.is_empty() {
                    String::new()
                } else {
                    format!(" [other processes: {}]", s.other_processes.join(", "))
                },
            );
        }
    }
    out
}
