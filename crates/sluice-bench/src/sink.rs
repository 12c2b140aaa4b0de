//! The sink: one MQTT subscriber on the (cloud) broker that receives the bench messages and
//! measures what arrived — end-to-end latency, uniques, duplicates, order violations, gaps.
//!
//! Owns: one broker connection (TLS 1.3 via [`crate::conn`] or plain), its subscription, the
//! PUBACKs it owes, and the received-message statistics. Does not own: knowing how many
//! messages were sent (the caller passes that in to get a delivery ratio).
//!
//! Behaviour:
//! - [`start_sink`] connects and returns only once SUBACK granted the subscription, so a caller
//!   can start devices afterwards knowing nothing is missed.
//! - Session: a per-run unique client id with a persistent session (3.1.1 clean session off;
//!   MQTT 5 session expiry 300 s), so if the connection drops the broker queues QoS 1 messages
//!   and the sink reconnects (back-off 100 ms → 5 s) and collects them; reconnects are counted.
//! - Each PUBLISH: payload header decoded ([`crate::payload`]); end-to-end latency = wall clock
//!   now − send timestamp (same machine), recorded for first arrivals only (duplicates would
//!   measure a retransmission, not the path); sequence bookkeeping in
//!   [`crate::stats::SequenceTracker`]; payloads without the bench header are counted as
//!   `foreign`. PUBACKs of one read batch are written together.
//! - Keep-alive 60 s; a PINGREQ goes out every 30 s.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::BytesMut;
use hdrhistogram::Histogram;
use serde::Serialize;
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Disconnect, Packet, Properties, ProtocolVersion, PubResponse, QoS,
    Subscribe, SubscribeFilter, SubscriptionOptions,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

use crate::conn::{self, BrokerIo};
use crate::payload::{unix_now_ns, PayloadHeader};
use crate::procfs::{round3, CpuMeter, CpuUsage, Pid};
use crate::stats::{latency_histogram, record_us, LatencySummary, Observation, SequenceTracker};

const KEEP_ALIVE_S: u16 = 60;
const PING_EVERY: Duration = Duration::from_secs(30);
const SESSION_EXPIRY_S: u32 = 300;
const SUBSCRIBE_PACKET_ID: u16 = 1;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const READ_BUFFER: usize = 64 * 1024;

/// TLS settings of the sink's connection.
#[derive(Debug, Clone)]
pub struct SinkTls {
    /// PEM file of the CA certificates trusted to sign the broker's certificate.
    pub ca_file: PathBuf,
    /// Optional client certificate chain and key (PEM).
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Name to verify the broker's certificate against (an IP address or DNS name).
    pub server_name: String,
}

/// Everything the sink needs.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    pub broker: std::net::SocketAddr,
    /// `None`: plain TCP.
    pub tls: Option<SinkTls>,
    /// Topic filter to subscribe to.
    pub topic: String,
    /// Subscription QoS (0 or 1).
    pub qos: QoS,
    pub protocol: ProtocolVersion,
    pub client_id: String,
    /// Devices expected (pre-sizes the tracker; reports how many were never heard from).
    pub expect_devices: u32,
    pub connect_timeout: Duration,
    /// Print a progress line to stderr this often (`None`: never).
    pub progress_every: Option<Duration>,
}

impl SinkConfig {
    /// Defaults: plain TCP, topic `#`, QoS 1, MQTT 3.1.1, a unique client id.
    pub fn new(broker: std::net::SocketAddr) -> SinkConfig {
        SinkConfig {
            broker,
            tls: None,
            topic: "#".to_string(),
            qos: QoS::AtLeastOnce,
            protocol: ProtocolVersion::V311,
            client_id: format!(
                "bench-sink-{}-{}",
                std::process::id(),
                unix_now_ns() % 1_000_000_000
            ),
            expect_devices: 0,
            connect_timeout: Duration::from_secs(10),
            progress_every: Some(Duration::from_secs(5)),
        }
    }
}

/// What the sink measured.
#[derive(Debug, Clone, Serialize)]
pub struct SinkReport {
    pub broker: String,
    pub tls: bool,
    pub topic: String,
    pub qos: u8,
    /// Every PUBLISH received, duplicates and foreign ones included.
    pub received: u64,
    /// Distinct (device, sequence) pairs.
    pub unique: u64,
    pub duplicates: u64,
    /// Unique messages that arrived after a higher sequence number of the same device.
    pub order_violations: u64,
    /// Sequence numbers below a device's highest received that never arrived.
    pub gaps: u64,
    /// Bench messages outside the tracked bounds.
    pub untracked: u64,
    /// Messages without the bench header.
    pub foreign: u64,
    pub devices_seen: u64,
    pub expect_devices: u32,
    /// Messages the devices sent, when the caller knows it.
    pub sent: Option<u64>,
    /// unique ÷ sent.
    pub delivery_ratio: Option<f64>,
    /// sent − unique (negative would mean messages from an earlier run).
    pub lost: Option<i64>,
    /// Device send timestamp → sink receive, first arrivals only.
    pub e2e_latency: LatencySummary,
    /// The same for messages sent at or after the steady-state start, when one was set with
    /// [`SinkHandle::set_steady_from`].
    pub e2e_latency_steady: Option<LatencySummary>,
    pub reconnects: u64,
    pub elapsed_s: f64,
    /// This process's CPU over the sink's lifetime (includes anything else running in it).
    pub tool_cpu: CpuUsage,
}

/// Counters readable while the sink runs.
#[derive(Debug, Default)]
struct Live {
    received: AtomicU64,
    unique: AtomicU64,
    reconnects: AtomicU64,
    /// Milliseconds after start of the last PUBLISH, plus one (0 = none yet).
    last_receive_ms: AtomicU64,
    /// Send timestamps (ns since the epoch) from which latencies also count as steady state;
    /// 0 = not set.
    steady_from_ns: AtomicU64,
}

/// Statistics owned by the sink task.
struct Tally {
    tracker: SequenceTracker,
    latency: Histogram<u64>,
    latency_steady: Histogram<u64>,
    received: u64,
    foreign: u64,
}

/// A running sink.
pub struct SinkHandle {
    config: SinkConfig,
    live: Arc<Live>,
    started: Instant,
    cpu: CpuMeter,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Tally>,
}

impl std::fmt::Debug for SinkHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SinkHandle")
            .field("broker", &self.config.broker)
            .finish_non_exhaustive()
    }
}

impl SinkHandle {
    /// PUBLISHes received so far.
    pub fn received(&self) -> u64 {
        self.live.received.load(Relaxed)
    }
    /// Distinct bench messages received so far.
    pub fn unique(&self) -> u64 {
        self.live.unique.load(Relaxed)
    }
    /// Time since the last PUBLISH arrived (since start if none did).
    pub fn idle_for(&self) -> Duration {
        let last = self.live.last_receive_ms.load(Relaxed);
        let since_start = self.started.elapsed();
        if last == 0 {
            return since_start;
        }
        since_start.saturating_sub(Duration::from_millis(last - 1))
    }

    /// From now on, also record the latency of messages sent at or after `sent_at_ns`
    /// (nanoseconds since the UNIX epoch) in the steady-state histogram.
    pub fn set_steady_from(&self, sent_at_ns: u64) {
        self.live.steady_from_ns.store(sent_at_ns.max(1), Relaxed);
    }

    /// Stop, disconnect and report. `sent` (if known) gives the delivery ratio.
    pub async fn stop(self, sent: Option<u64>) -> anyhow::Result<SinkReport> {
        let _ = self.stop.send(true);
        let tally = self.task.await.context("the sink task panicked")?;
        let t = &tally.tracker;
        Ok(SinkReport {
            broker: self.config.broker.to_string(),
            tls: self.config.tls.is_some(),
            topic: self.config.topic.clone(),
            qos: self.config.qos as u8,
            received: tally.received,
            unique: t.unique,
            duplicates: t.duplicates,
            order_violations: t.order_violations,
            gaps: t.gaps(),
            untracked: t.untracked,
            foreign: tally.foreign,
            devices_seen: t.devices_seen(),
            expect_devices: self.config.expect_devices,
            sent,
            delivery_ratio: sent.map(|s| delivery_ratio(t.unique, s)),
            lost: sent.map(|s| s as i64 - t.unique as i64),
            e2e_latency: LatencySummary::from_histogram(&tally.latency),
            e2e_latency_steady: (self.live.steady_from_ns.load(Relaxed) != 0)
                .then(|| LatencySummary::from_histogram(&tally.latency_steady)),
            reconnects: self.live.reconnects.load(Relaxed),
            elapsed_s: round3(self.started.elapsed().as_secs_f64()),
            tool_cpu: self.cpu.usage()?,
        })
    }
}

/// unique ÷ sent, rounded to 6 decimals; 1.0 when nothing was sent and nothing arrived.
pub fn delivery_ratio(unique: u64, sent: u64) -> f64 {
    if sent == 0 {
        return if unique == 0 { 1.0 } else { f64::INFINITY };
    }
    (unique as f64 / sent as f64 * 1e6).round() / 1e6
}

/// Connect, subscribe (waiting for SUBACK) and start receiving in a background task.
pub async fn start_sink(config: SinkConfig) -> anyhow::Result<SinkHandle> {
    if config.qos == QoS::ExactlyOnce {
        bail!("the sink subscribes with QoS 0 or 1");
    }
    let cpu = CpuMeter::start(Pid::OwnProcess)?;
    let started = Instant::now();
    let tls = match &config.tls {
        None => None,
        Some(t) => {
            let client = t
                .client_cert
                .as_ref()
                .map(|(c, k)| (c.as_path(), k.as_path()));
            Some(conn::tls_client_config(&t.ca_file, client)?)
        }
    };
    let connection = connect_and_subscribe(&config, tls.as_ref(), true)
        .await
        .with_context(|| format!("sink connecting to {}", config.broker))?;
    let live = Arc::new(Live::default());
    let (stop, stop_rx) = watch::channel(false);
    let tally = Tally {
        tracker: SequenceTracker::with_expected_devices(config.expect_devices),
        latency: latency_histogram(),
        latency_steady: latency_histogram(),
        received: 0,
        foreign: 0,
    };
    let task = tokio::spawn(receive(
        config.clone(),
        tls,
        connection,
        tally,
        live.clone(),
        started,
        stop_rx,
    ));
    Ok(SinkHandle {
        config,
        live,
        started,
        cpu,
        stop,
        task,
    })
}

struct Connection {
    io: Box<dyn BrokerIo>,
    decoder: Decoder,
    rbuf: BytesMut,
}

async fn connect_and_subscribe(
    config: &SinkConfig,
    tls: Option<&Arc<rustls::ClientConfig>>,
    first: bool,
) -> anyhow::Result<Connection> {
    let tls_args = tls
        .zip(config.tls.as_ref())
        .map(|(c, t)| (c, t.server_name.as_str()));
    let mut io = conn::open(config.broker, tls_args, config.connect_timeout).await?;
    let mut decoder = Decoder::client(config.protocol, conn::MAX_INBOUND_PACKET);
    let mut rbuf = BytesMut::with_capacity(READ_BUFFER);
    let mut wbuf = BytesMut::with_capacity(256);
    let (clean_start, properties) = match config.protocol {
        ProtocolVersion::V311 => (false, Properties::default()),
        ProtocolVersion::V5 => (
            first,
            Properties {
                session_expiry_interval: Some(SESSION_EXPIRY_S),
                ..Default::default()
            },
        ),
    };
    let connect = Connect {
        protocol: config.protocol,
        clean_start,
        keep_alive: KEEP_ALIVE_S,
        client_id: config.client_id.as_str().into(),
        will: None,
        username: None,
        password: None,
        properties,
    };
    let connack = conn::handshake(
        &mut io,
        connect,
        &mut rbuf,
        &mut wbuf,
        &mut decoder,
        config.connect_timeout,
    )
    .await?;
    if connack.session_present && !first {
        // The broker kept our subscription and queued messages; nothing more to do.
        return Ok(Connection { io, decoder, rbuf });
    }
    let subscribe = Packet::Subscribe(Subscribe {
        packet_id: SUBSCRIBE_PACKET_ID,
        filters: vec![SubscribeFilter {
            filter: config.topic.as_str().into(),
            options: SubscriptionOptions {
                qos: config.qos,
                no_local: false,
                retain_as_published: false,
                retain_handling: 0,
            },
        }],
        properties: Properties::default(),
    });
    conn::send(&mut io, &subscribe, config.protocol, &mut wbuf).await?;
    let deadline = Instant::now() + config.connect_timeout;
    loop {
        let packet = timeout(
            deadline.saturating_duration_since(Instant::now()),
            conn::read_packet(&mut io, &mut rbuf, &mut decoder),
        )
        .await
        .map_err(|_| anyhow::anyhow!("no SUBACK within {:?}", config.connect_timeout))??;
        match packet {
            Packet::SubAck(ack) if ack.packet_id == SUBSCRIBE_PACKET_ID => {
                match ack.codes.first() {
                    Some(&code) if code < 0x80 => return Ok(Connection { io, decoder, rbuf }),
                    Some(&code) => bail!(
                        "the broker refused the subscription to {:?}: code 0x{code:02x}",
                        config.topic
                    ),
                    None => bail!("SUBACK carried no return code"),
                }
            }
            // Nothing else can arrive before SUBACK on a session without a subscription
            // (the client id is unique per run); anything that does is ignored.
            other => tracing::debug!(packet = other.name(), "ignoring a packet before SUBACK"),
        }
    }
}

async fn receive(
    config: SinkConfig,
    tls: Option<Arc<rustls::ClientConfig>>,
    mut connection: Connection,
    mut tally: Tally,
    live: Arc<Live>,
    started: Instant,
    mut stop: watch::Receiver<bool>,
) -> Tally {
    let progress_every = config
        .progress_every
        .unwrap_or(Duration::from_secs(3600 * 24 * 365));
    let mut progress = tokio::time::interval_at(started + progress_every, progress_every);
    let mut last_progress = (Instant::now(), 0u64);
    let mut backoff = BACKOFF_MIN;
    loop {
        let result = receive_on(
            &config,
            &mut connection,
            &mut tally,
            &live,
            started,
            &mut stop,
            &mut progress,
            &mut last_progress,
        )
        .await;
        match result {
            Ok(()) => {
                // Asked to stop: say goodbye (best effort).
                let mut wbuf = BytesMut::new();
                let d = Packet::Disconnect(Disconnect {
                    reason: 0,
                    properties: Properties::default(),
                });
                if encode(&d, config.protocol, &mut wbuf).is_ok() {
                    let _ = timeout(Duration::from_secs(1), connection.io.write_all(&wbuf)).await;
                }
                return tally;
            }
            Err(error) => {
                tracing::warn!(broker = %config.broker, error = %format!("{error:#}"), "sink connection lost; reconnecting");
            }
        }
        // Reconnect until it works or we are told to stop.
        loop {
            if *stop.borrow() {
                return tally;
            }
            tokio::select! {
                _ = stop.changed() => return tally,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
            match connect_and_subscribe(&config, tls.as_ref(), false).await {
                Ok(c) => {
                    connection = c;
                    live.reconnects.fetch_add(1, Relaxed);
                    backoff = BACKOFF_MIN;
                    break;
                }
                Err(error) => {
                    tracing::debug!(error = %format!("{error:#}"), "sink reconnect failed")
                }
            }
        }
    }
}

/// Receive on one connection until told to stop (`Ok`) or the connection fails (`Err`).
#[allow(clippy::too_many_arguments)]
async fn receive_on(
    config: &SinkConfig,
    c: &mut Connection,
    tally: &mut Tally,
    live: &Live,
    started: Instant,
    stop: &mut watch::Receiver<bool>,
    progress: &mut tokio::time::Interval,
    last_progress: &mut (Instant, u64),
) -> anyhow::Result<()> {
    let mut wbuf = BytesMut::with_capacity(4096);
    let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        tokio::select! {
            biased;
            _ = stop.changed() => return Ok(()),
            read = c.io.read_buf(&mut c.rbuf) => {
                if read.context("reading from the broker")? == 0 {
                    bail!("the broker closed the connection");
                }
                wbuf.clear();
                handle_packets(config, c, tally, live, started, &mut wbuf)?;
                if !wbuf.is_empty() {
                    c.io.write_all(&wbuf).await.context("writing PUBACKs")?;
                }
                if c.rbuf.capacity() - c.rbuf.len() < 4096 {
                    c.rbuf.reserve(READ_BUFFER);
                }
            }
            _ = ping.tick() => {
                wbuf.clear();
                encode(&Packet::PingReq, config.protocol, &mut wbuf).context("encoding PINGREQ")?;
                c.io.write_all(&wbuf).await.context("writing PINGREQ")?;
            }
            _ = progress.tick() => {
                let (at, before) = *last_progress;
                let dt = at.elapsed().as_secs_f64().max(1e-9);
                eprintln!(
                    "[sink    {:>6.1}s] received {} ({:.0}/s)  unique {}  duplicates {}  \
                     order-violations {}  devices {}  p99 {:.1} ms",
                    started.elapsed().as_secs_f64(),
                    tally.received,
                    (tally.received - before) as f64 / dt,
                    tally.tracker.unique,
                    tally.tracker.duplicates,
                    tally.tracker.order_violations,
                    tally.tracker.devices_seen(),
                    tally.latency.value_at_quantile(0.99) as f64 / 1000.0,
                );
                *last_progress = (Instant::now(), tally.received);
            }
        }
    }
}

fn handle_packets(
    config: &SinkConfig,
    c: &mut Connection,
    tally: &mut Tally,
    live: &Live,
    started: Instant,
    wbuf: &mut BytesMut,
) -> anyhow::Result<()> {
    let mut got_any = false;
    let steady_from = match live.steady_from_ns.load(Relaxed) {
        0 => u64::MAX,
        ns => ns,
    };
    while let Some(packet) = c
        .decoder
        .decode(&mut c.rbuf)
        .context("the broker sent a malformed packet")?
    {
        let publish = match packet {
            Packet::Publish(p) => p,
            Packet::PingResp | Packet::SubAck(_) => continue,
            Packet::Disconnect(d) => {
                bail!("the broker sent DISCONNECT (reason 0x{:02x})", d.reason)
            }
            other => {
                tracing::trace!(packet = other.name(), "ignoring an unexpected packet");
                continue;
            }
        };
        got_any = true;
        tally.received += 1;
        if let Some(packet_id) = publish.packet_id {
            if publish.qos == QoS::AtLeastOnce {
                let ack = Packet::PubAck(PubResponse {
                    packet_id,
                    reason: 0,
                    properties: None,
                });
                encode(&ack, config.protocol, wbuf).context("encoding PUBACK")?;
            }
        }
        match PayloadHeader::parse(&publish.payload) {
            Ok(h) => match tally.tracker.observe(h.device, h.seq) {
                Observation::New | Observation::NewOutOfOrder => {
                    let micros = unix_now_ns().saturating_sub(h.sent_at_ns) / 1000;
                    record_us(&mut tally.latency, micros);
                    if h.sent_at_ns >= steady_from {
                        record_us(&mut tally.latency_steady, micros);
                    }
                }
                Observation::Duplicate | Observation::Untracked => {}
            },
            Err(_) => tally.foreign += 1,
        }
    }
    if got_any {
        live.received.store(tally.received, Relaxed);
        live.unique.store(tally.tracker.unique, Relaxed);
        let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        live.last_receive_ms.store(ms + 1, Relaxed);
    }
    Ok(())
}
