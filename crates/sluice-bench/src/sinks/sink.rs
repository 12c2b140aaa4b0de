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
//!   [`crate::stats::SequenceTracker`]. PUBACKs of one read batch are written together.
//! - SenML packs (a gateway batching device payloads): a PUBLISH that is not a bench payload
//!   but that [`senml::sniff`] recognises and [`senml::decode`] accepts is a pack. Every record
//!   whose value is data (`vd`) holding a bench payload counts exactly as if that payload had
//!   arrived as its own PUBLISH at the pack's arrival time (dedup, order, latency); other
//!   records count as `foreign`, as do PUBLISHes that are neither bench payloads nor packs.
//!   `received` stays the number of PUBLISHes; `packs` and `records_in_packs` say how many of
//!   them were packs and what they held.
//! - Optional per-device latency ([`SinkConfig::per_device`]): one histogram per device index
//!   below [`crate::stats::MAX_PER_DEVICE_LATENCY`] (first arrivals only), reported as
//!   [`DeviceLatency`] lines.
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
use sluice_proto::senml;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

use crate::conn::{self, BrokerIo};
use crate::harness::procfs::{round3, CpuMeter, CpuUsage, Pid};
use crate::payload::{unix_now_ns, PayloadHeader};
use crate::stats::{
    latency_histogram, record_us, LatencySummary, Observation, PerDeviceLatency, SequenceTracker,
};

pub use crate::stats::DeviceLatency;

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
    /// Also measure latency per device ([`SinkReport::per_device`]).
    pub per_device: bool,
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
            per_device: false,
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
    /// Every PUBLISH received, duplicates, foreign ones and SenML packs included.
    pub received: u64,
    /// PUBLISHes that were SenML packs (each counted once in `received`).
    pub packs: u64,
    /// Records in those packs, bench payloads or not.
    pub records_in_packs: u64,
    /// Distinct (device, sequence) pairs, whether they came alone or in packs.
    pub unique: u64,
    pub duplicates: u64,
    /// Unique messages that arrived after a higher sequence number of the same device.
    pub order_violations: u64,
    /// Sequence numbers below a device's highest received that never arrived.
    pub gaps: u64,
    /// Bench messages outside the tracked bounds.
    pub untracked: u64,
    /// PUBLISHes that are neither bench payloads nor SenML packs, plus pack records that do
    /// not hold a bench payload.
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
    /// Per-device latency of first arrivals, by device index; empty unless
    /// [`SinkConfig::per_device`] was set.
    pub per_device: Vec<DeviceLatency>,
    /// First arrivals of devices with an index too high for a per-device histogram
    /// ([`crate::stats::MAX_PER_DEVICE_LATENCY`]); they still count everywhere else.
    pub per_device_omitted: u64,
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

/// Statistics owned by the sink task. Sans-IO: the caller hands in each payload with its
/// arrival time.
struct Tally {
    tracker: SequenceTracker,
    latency: Histogram<u64>,
    latency_steady: Histogram<u64>,
    /// `Some` when per-device latency was asked for.
    per_device: Option<PerDeviceLatency>,
    received: u64,
    packs: u64,
    records_in_packs: u64,
    foreign: u64,
}

impl Tally {
    fn new(expect_devices: u32, per_device: bool) -> Tally {
        Tally {
            tracker: SequenceTracker::with_expected_devices(expect_devices),
            latency: latency_histogram(),
            latency_steady: latency_histogram(),
            per_device: per_device.then(PerDeviceLatency::default),
            received: 0,
            packs: 0,
            records_in_packs: 0,
            foreign: 0,
        }
    }

    /// Account for one PUBLISH payload that arrived at `now_ns` (ns since the epoch); send
    /// times at or after `steady_from_ns` also count as steady state.
    fn observe_publish(&mut self, payload: &[u8], now_ns: u64, steady_from_ns: u64) {
        self.received += 1;
        if let Ok(header) = PayloadHeader::parse(payload) {
            self.observe_bench(header, now_ns, steady_from_ns);
            return;
        }
        let pack = senml::sniff(payload).and_then(|format| senml::decode(format, payload).ok());
        let Some(records) = pack else {
            self.foreign += 1;
            return;
        };
        self.packs += 1;
        self.records_in_packs += records.len() as u64;
        for record in records {
            let header = match &record.value {
                Some(senml::Value::Data(data)) => PayloadHeader::parse(data).ok(),
                _ => None,
            };
            match header {
                Some(header) => self.observe_bench(header, now_ns, steady_from_ns),
                None => self.foreign += 1,
            }
        }
    }

    fn observe_bench(&mut self, h: PayloadHeader, now_ns: u64, steady_from_ns: u64) {
        match self.tracker.observe(h.device, h.seq) {
            Observation::New | Observation::NewOutOfOrder => {
                let micros = now_ns.saturating_sub(h.sent_at_ns) / 1000;
                record_us(&mut self.latency, micros);
                if h.sent_at_ns >= steady_from_ns {
                    record_us(&mut self.latency_steady, micros);
                }
                if let Some(per_device) = &mut self.per_device {
                    per_device.record_us(h.device, micros);
                }
            }
            Observation::Duplicate | Observation::Untracked => {}
        }
    }
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
            packs: tally.packs,
            records_in_packs: tally.records_in_packs,
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
            per_device: tally
                .per_device
                .as_ref()
                .map(PerDeviceLatency::summaries)
                .unwrap_or_default(),
            per_device_omitted: tally.per_device.as_ref().map_or(0, |p| p.omitted),
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
    let tally = Tally::new(config.expect_devices, config.per_device);
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
        tally.observe_publish(&publish.payload, unix_now_ns(), steady_from);
    }
    if got_any {
        live.received.store(tally.received, Relaxed);
        live.unique.store(tally.tracker.unique, Relaxed);
        let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        live.last_receive_ms.store(ms + 1, Relaxed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use sluice_proto::senml::{Format, PackWriter, Record, Value};

    use super::*;

    const SENT_AT: u64 = 1_700_000_000_000_000_000;
    const MS: u64 = 1_000_000;

    fn payload(device: u32, seq: u64, sent_at_ns: u64) -> Vec<u8> {
        let mut bytes = vec![0x5a; 40];
        PayloadHeader {
            device,
            seq,
            sent_at_ns,
        }
        .write_to(&mut bytes)
        .expect("40 bytes hold the header");
        bytes
    }

    fn record(name: &str, value: Value) -> Record {
        Record {
            name: name.to_string(),
            time: 0.0,
            unit: None,
            value: Some(value),
            sum: None,
            update_time: None,
        }
    }

    fn data(device: u32, seq: u64) -> Record {
        record(
            &format!("urn:dev:bench:{device}:payload"),
            Value::Data(Bytes::from(payload(device, seq, SENT_AT))),
        )
    }

    fn pack(format: Format, records: &[Record]) -> Bytes {
        let mut writer = PackWriter::new(format);
        for r in records {
            writer.push(r).expect("valid record");
        }
        writer.finish()
    }

    #[test]
    fn a_pack_of_two_devices_is_counted_record_by_record() {
        for format in [Format::Json, Format::Cbor] {
            let records = [
                data(0, 0),
                data(1, 0),
                data(0, 2),
                data(0, 1), // below device 0's highest: an order violation
                data(1, 0), // a duplicate
                record("urn:dev:bench:0:temp", Value::Number(21.5)),
                record(
                    "urn:dev:bench:0:blob",
                    Value::Data(Bytes::from_static(b"not a bench payload at all")),
                ),
            ];
            let mut tally = Tally::new(2, false);
            let now = SENT_AT + 5 * MS;
            tally.observe_publish(&pack(format, &records), now, u64::MAX);
            tally.observe_publish(&payload(1, 1, SENT_AT), now, u64::MAX);
            tally.observe_publish(b"hello", now, u64::MAX);
            tally.observe_publish(b"[1, looks like SenML but is not", now, u64::MAX);

            assert_eq!(tally.received, 4, "{format:?}: PUBLISHes");
            assert_eq!((tally.packs, tally.records_in_packs), (1, 7), "{format:?}");
            let t = &tally.tracker;
            assert_eq!(t.unique, 5, "{format:?}");
            assert_eq!(t.duplicates, 1, "{format:?}");
            assert_eq!(t.order_violations, 1, "{format:?}");
            assert_eq!(t.gaps(), 0, "{format:?}");
            assert_eq!(t.devices_seen(), 2, "{format:?}");
            assert_eq!(
                tally.foreign, 4,
                "{format:?}: two pack records, two PUBLISHes"
            );
            assert_eq!(tally.latency.len(), 5, "{format:?}: first arrivals only");
            let max = tally.latency.max();
            assert!(
                tally.latency.equivalent(max, 5000),
                "{format:?}: 5 ms, got {max} µs"
            );
        }
    }

    #[test]
    fn an_empty_pack_is_a_pack_with_no_records() {
        let mut tally = Tally::new(0, false);
        tally.observe_publish(b"[]", SENT_AT, u64::MAX);
        tally.observe_publish(&[0x80], SENT_AT, u64::MAX);
        assert_eq!(
            (tally.received, tally.packs, tally.records_in_packs),
            (2, 2, 0)
        );
        assert_eq!((tally.foreign, tally.tracker.unique), (0, 0));
    }

    #[test]
    fn per_device_latency_counts_first_arrivals_of_each_device() {
        let mut tally = Tally::new(2, true);
        // Device 0: 1, 2 and 3 ms, the last one inside a pack; device 1: 10 ms, then a
        // duplicate that arrives much later and must not count.
        tally.observe_publish(&payload(0, 0, SENT_AT), SENT_AT + MS, u64::MAX);
        tally.observe_publish(&payload(0, 1, SENT_AT), SENT_AT + 2 * MS, u64::MAX);
        tally.observe_publish(&payload(1, 0, SENT_AT), SENT_AT + 10 * MS, u64::MAX);
        let packed = pack(Format::Cbor, &[data(0, 2), data(1, 0)]);
        tally.observe_publish(&packed, SENT_AT + 3 * MS, u64::MAX);
        tally.observe_publish(&payload(1, 0, SENT_AT), SENT_AT + 500 * MS, u64::MAX);

        let per_device = tally.per_device.as_ref().expect("asked for").summaries();
        assert_eq!(per_device.len(), 2);
        let (d0, d1) = (&per_device[0], &per_device[1]);
        assert_eq!((d0.device, d0.received), (0, 3));
        // HDR histograms: 3 significant digits (3 ms reads back as 3.001).
        let close = |got: f64, want: f64| (got - want).abs() <= want * 1e-3;
        assert!(
            close(d0.mean_ms, 2.0) && close(d0.p50_ms, 2.0) && close(d0.max_ms, 3.0),
            "{d0:?}"
        );
        assert_eq!((d1.device, d1.received), (1, 1));
        assert!(
            close(d1.mean_ms, 10.0) && close(d1.p99_ms, 10.0) && close(d1.max_ms, 10.0),
            "{d1:?}"
        );
        assert_eq!(tally.tracker.duplicates, 2);
    }

    #[test]
    fn per_device_latency_is_off_by_default() {
        let mut tally = Tally::new(1, SinkConfig::new(([127, 0, 0, 1], 1883).into()).per_device);
        tally.observe_publish(&payload(0, 0, SENT_AT), SENT_AT + MS, u64::MAX);
        assert!(tally.per_device.is_none());
    }
}
