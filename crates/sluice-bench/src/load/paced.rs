//! The pipelined device fleet of the throughput scenario.
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

use std::collections::VecDeque;
use std::net::SocketAddr;
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
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};

use crate::conn::handshake;
use crate::payload::{unix_now_ns, PayloadHeader, HEADER_LEN};
pub use crate::report::write_json;
use crate::sinks::fastsink::LatencyWindow;

/// Tokens above this much time's worth of messages are dropped (and counted).
pub const BURST: Duration = Duration::from_millis(50);

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
    /// MQTT username and password every device logs in with (`None`: anonymous).
    pub credentials: Option<(String, String)>,
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
            credentials: None,
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
            username: config
                .credentials
                .as_ref()
                .map(|(user, _)| user.as_str().into()),
            password: config
                .credentials
                .as_ref()
                .map(|(_, password)| Bytes::copy_from_slice(password.as_bytes())),
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
