//! The fast acknowledging sink: a minimal MQTT-over-TLS 1.3 server that stands in for the cloud
//! broker, so that the broker does not set the limit of a throughput measurement.
//!
//! Owns: the listener loop, one task per connection (TLS accept, MQTT 3.1.1/5 CONNECT →
//! CONNACK, PUBLISH → PUBACK), the message/byte counters and the end-to-end latency of bench
//! payloads, and the same receive loop used as a *measuring subscriber* on a real broker
//! ([`subscribe_measuring`]), so both kinds of cloud are measured by the same code. Does not
//! own: sessions, subscriptions, routing or retained messages — it is a sink: nothing is ever
//! delivered anywhere, and a SUBSCRIBE is answered (granted up to QoS 1) but never served.
//!
//! Protocol, per connection:
//! - The first packet must be CONNECT (else the connection is closed). CONNACK: success, no
//!   session present. MQTT 5: Receive Maximum 65,535 (the largest there is, so the client's own
//!   inflight setting is the window), Maximum Packet Size = the decoder's limit, and an
//!   Assigned Client Identifier when the client sent an empty one.
//! - PUBLISH QoS 1 → PUBACK; QoS 2 → PUBREC, then PUBREL → PUBCOMP; QoS 0 → nothing. Every
//!   PUBACK owed for one read is encoded into one buffer and written with one write, so the
//!   cost is one read and at most one write per batch of messages, whatever the batch size.
//! - PINGREQ → PINGRESP; SUBSCRIBE → SUBACK; UNSUBSCRIBE → UNSUBACK; DISCONNECT or EOF closes.
//!   Keep-alive is not enforced (a bench run is short and the peer is local).
//! - Reads go into one buffer of [`READ_BUFFER`] bytes per connection (grown only up to the
//!   largest packet, [`MAX_PACKET`]); the decoder (sluice-proto's, the only MQTT codec in the
//!   workspace) takes payloads as slices of it, without copying.
//!
//! Measurement: every PUBLISH counts (messages, payload bytes). If `measure_latency` is on and
//! the payload starts with the bench header ([`crate::payload`]), end-to-end latency = wall
//! clock now − send timestamp (sender and sink on the same machine) is recorded into a
//! [`LatencyWindow`], whose contents a caller can take at any time (per step of a step load)
//! as well as into a whole-run histogram. Payloads without the header count as `foreign`.
//! Each bench message's (device, sequence number) goes through a
//! [`SequenceTracker`] (one lock per read batch), so resends are counted as `duplicates` and
//! `unique` counts what arrived at least once; latency is recorded for first arrivals only.
//!
//! Invariants: bytes from a peer never panic; a malformed packet or protocol violation closes
//! only that connection (counted in `protocol_errors`); connections are bounded by
//! `max_connections` (beyond it a new connection is closed at once and counted).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::BytesMut;
use hdrhistogram::Histogram;
use rustls::ServerConfig;
use serde::Serialize;
use sluice_proto::mqtt::{
    encode, ConnAck, Connect, Decoder, Packet, Properties, ProtocolVersion, PubResponse, QoS,
    SubAck, Subscribe, SubscribeFilter, SubscriptionOptions, UnsubAck,
};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{timeout, Instant};
use tokio_rustls::TlsAcceptor;

use crate::conn;
use crate::harness::procfs::{round1, round3};
use crate::payload::{unix_now_ns, PayloadHeader};
use crate::stats::{latency_histogram, record_us, LatencySummary, Observation, SequenceTracker};

/// Bytes read per `read` call at most (and the initial buffer size per connection).
pub const READ_BUFFER: usize = 256 * 1024;
/// Largest MQTT packet accepted (advertised to MQTT 5 clients as Maximum Packet Size).
pub const MAX_PACKET: usize = 16 << 20;
/// Receive Maximum advertised to MQTT 5 clients.
pub const RECEIVE_MAXIMUM: u16 = u16::MAX;
/// Time a new connection has for the TLS handshake and CONNECT.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A latency histogram that can be emptied and read in one step ("what happened since the last
/// take"), shared by many tasks. Recorders lock it once per batch, not per value.
#[derive(Debug)]
pub struct LatencyWindow {
    current: Mutex<Histogram<u64>>,
}

impl Default for LatencyWindow {
    fn default() -> Self {
        LatencyWindow {
            current: Mutex::new(latency_histogram()),
        }
    }
}

impl LatencyWindow {
    /// Record a batch of latencies, in µs.
    pub fn record_all(&self, micros: &[u64]) {
        if micros.is_empty() {
            return;
        }
        // A poisoned lock only means a recorder panicked mid-record; the counts stay valid.
        let mut h = self.current.lock().unwrap_or_else(|p| p.into_inner());
        for &us in micros {
            record_us(&mut h, us);
        }
    }
    /// Everything recorded since the last take (or since creation); the window starts empty.
    pub fn take(&self) -> Histogram<u64> {
        let mut h = self.current.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *h, latency_histogram())
    }
}

/// Live counters of a fast sink (or measuring subscriber).
#[derive(Debug, Default)]
pub struct SinkCounters {
    /// Connections accepted (subscriber: 1).
    pub connections_total: AtomicU64,
    /// Connections that completed CONNECT and are still open.
    pub connections_open: AtomicU64,
    /// Connections refused because `max_connections` were open.
    pub connections_refused: AtomicU64,
    /// PUBLISH packets received, any QoS.
    pub messages: AtomicU64,
    /// Payload bytes of those PUBLISHes.
    pub payload_bytes: AtomicU64,
    /// PUBACKs (and PUBRECs) sent.
    pub acks_sent: AtomicU64,
    /// PUBLISHes whose payload does not start with the bench header (when measuring latency).
    pub foreign: AtomicU64,
    /// Bench messages (device, sequence number) seen for the first time.
    pub unique: AtomicU64,
    /// Bench messages seen before (e.g. a bridge's DUP resend).
    pub duplicates: AtomicU64,
    /// Connections closed for a TLS failure, malformed packet or protocol violation.
    pub protocol_errors: AtomicU64,
}

/// Everything the receive loops share.
#[derive(Debug, Default)]
pub struct SinkStats {
    pub counters: SinkCounters,
    /// End-to-end latency of bench payloads since the last [`LatencyWindow::take`].
    pub latency_window: LatencyWindow,
    /// End-to-end latency of bench payloads over the whole run.
    latency_all: Mutex<Option<Histogram<u64>>>,
    /// Which (device, sequence number) pairs arrived (bounded: see [`SequenceTracker`]).
    tracker: Mutex<SequenceTracker>,
}

/// One bench message of a read batch: device, sequence number, e2e latency in µs.
type Seen = (u32, u64, u64);

impl SinkStats {
    /// Account for the bench messages of one batch: uniques and duplicates, and the latency of
    /// first arrivals (a duplicate would measure a resend, not the path).
    fn record_batch(&self, seen: &[Seen], firsts: &mut Vec<u64>) {
        if seen.is_empty() {
            return;
        }
        firsts.clear();
        {
            let mut tracker = self.tracker.lock().unwrap_or_else(|p| p.into_inner());
            for &(device, seq, us) in seen {
                match tracker.observe(device, seq) {
                    Observation::New | Observation::NewOutOfOrder | Observation::Untracked => {
                        firsts.push(us)
                    }
                    Observation::Duplicate => {}
                }
            }
        }
        let duplicates = (seen.len() - firsts.len()) as u64;
        self.counters.unique.fetch_add(firsts.len() as u64, Relaxed);
        self.counters.duplicates.fetch_add(duplicates, Relaxed);
        self.latency_window.record_all(firsts);
        let mut all = self.latency_all.lock().unwrap_or_else(|p| p.into_inner());
        let h = all.get_or_insert_with(latency_histogram);
        for &us in firsts.iter() {
            record_us(h, us);
        }
    }
    fn latency_all(&self) -> LatencySummary {
        let all = self.latency_all.lock().unwrap_or_else(|p| p.into_inner());
        match all.as_ref() {
            Some(h) => LatencySummary::from_histogram(h),
            None => LatencySummary::from_histogram(&latency_histogram()),
        }
    }
}

/// Configuration of a fast sink server.
#[derive(Clone)]
pub struct FastSinkConfig {
    /// TLS 1.3 server configuration (see [`tls_server_config`]).
    pub tls: Arc<ServerConfig>,
    /// Parse the bench header of each payload and record end-to-end latency.
    pub measure_latency: bool,
    /// Open connections at most; further ones are closed at once and counted.
    pub max_connections: u64,
}

impl std::fmt::Debug for FastSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastSinkConfig")
            .field("measure_latency", &self.measure_latency)
            .field("max_connections", &self.max_connections)
            .finish_non_exhaustive()
    }
}

impl FastSinkConfig {
    /// Latency measurement on, 1,024 connections at most.
    pub fn new(tls: Arc<ServerConfig>) -> FastSinkConfig {
        FastSinkConfig {
            tls,
            measure_latency: true,
            max_connections: 1024,
        }
    }
}

/// What a fast sink (or measuring subscriber) counted over its life.
#[derive(Debug, Clone, Serialize)]
pub struct FastSinkReport {
    /// Listening address (server) or broker address (subscriber).
    pub address: String,
    pub connections_total: u64,
    pub connections_refused: u64,
    pub protocol_errors: u64,
    pub messages: u64,
    pub payload_bytes: u64,
    pub acks_sent: u64,
    pub foreign: u64,
    /// Distinct bench messages (device, sequence number).
    pub unique: u64,
    /// Bench messages received more than once.
    pub duplicates: u64,
    /// Bench payloads: send timestamp → received here, whole run, first arrivals.
    pub e2e_latency: LatencySummary,
    pub elapsed_s: f64,
    /// messages ÷ elapsed.
    pub mean_rate: f64,
}

/// A running fast sink server or measuring subscriber. Dropping it stops the tasks.
pub struct FastSink {
    address: SocketAddr,
    stats: Arc<SinkStats>,
    started: Instant,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for FastSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastSink")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl FastSink {
    /// The listening address (server) or the broker's (subscriber).
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }
    pub fn stats(&self) -> &Arc<SinkStats> {
        &self.stats
    }
    /// PUBLISHes received so far (duplicates included).
    pub fn messages(&self) -> u64 {
        self.stats.counters.messages.load(Relaxed)
    }
    /// Distinct bench messages received so far (needs `measure_latency`).
    pub fn unique(&self) -> u64 {
        self.stats.counters.unique.load(Relaxed)
    }
    /// Connections that completed CONNECT and are open now.
    pub fn connections_open(&self) -> u64 {
        self.stats.counters.connections_open.load(Relaxed)
    }
    /// Stop accepting, close every connection and report.
    pub async fn stop(self) -> FastSinkReport {
        let _ = self.shutdown.send(true);
        let _ = timeout(Duration::from_secs(5), self.task).await;
        let c = &self.stats.counters;
        let elapsed = self.started.elapsed().as_secs_f64();
        let messages = c.messages.load(Relaxed);
        FastSinkReport {
            address: self.address.to_string(),
            connections_total: c.connections_total.load(Relaxed),
            connections_refused: c.connections_refused.load(Relaxed),
            protocol_errors: c.protocol_errors.load(Relaxed),
            messages,
            payload_bytes: c.payload_bytes.load(Relaxed),
            acks_sent: c.acks_sent.load(Relaxed),
            foreign: c.foreign.load(Relaxed),
            unique: c.unique.load(Relaxed),
            duplicates: c.duplicates.load(Relaxed),
            e2e_latency: self.stats.latency_all(),
            elapsed_s: round3(elapsed),
            mean_rate: round1(messages as f64 / elapsed.max(1e-9)),
        }
    }
}

/// A TLS 1.3-only rustls server configuration (ring provider) from a PEM certificate chain and
/// a PEM private key. No client certificate is asked for.
pub fn tls_server_config(cert_file: &Path, key_file: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let pem =
        std::fs::read(cert_file).with_context(|| format!("reading {}", cert_file.display()))?;
    let chain = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing PEM certificates in {}", cert_file.display()))?;
    if chain.is_empty() {
        bail!("{} holds no PEM certificate", cert_file.display());
    }
    let pem = std::fs::read(key_file).with_context(|| format!("reading {}", key_file.display()))?;
    let key = rustls_pemfile::private_key(&mut pem.as_slice())
        .with_context(|| format!("parsing the PEM private key in {}", key_file.display()))?
        .ok_or_else(|| anyhow!("{} holds no PEM private key", key_file.display()))?;
    let config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .context("the ring provider does not support TLS 1.3")?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .context("the private key does not match the certificate")?;
    Ok(Arc::new(config))
}

/// Serve MQTT over TLS 1.3 on an already-bound listener until the returned handle is stopped.
/// Runs on the current tokio runtime (one task for the listener, one per connection).
pub fn start_fast_sink(listener: TcpListener, config: FastSinkConfig) -> anyhow::Result<FastSink> {
    let address = listener
        .local_addr()
        .context("reading the listener address")?;
    let stats = Arc::new(SinkStats::default());
    let (shutdown, shutdown_rx) = watch::channel(false);
    let task = tokio::spawn(serve(listener, config, stats.clone(), shutdown_rx));
    Ok(FastSink {
        address,
        stats,
        started: Instant::now(),
        shutdown,
        task,
    })
}

async fn serve(
    listener: TcpListener,
    config: FastSinkConfig,
    stats: Arc<SinkStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    let acceptor = TlsAcceptor::from(config.tls.clone());
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.changed() => break,
            a = listener.accept() => a,
            // Reap finished connection tasks so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(error) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(%error, "fast sink: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        stats.counters.connections_total.fetch_add(1, Relaxed);
        if stats.counters.connections_open.load(Relaxed) >= config.max_connections {
            stats.counters.connections_refused.fetch_add(1, Relaxed);
            continue; // Dropping the socket closes it.
        }
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let stats = stats.clone();
        let shutdown = shutdown.clone();
        let measure = config.measure_latency;
        connections.spawn(async move {
            let result = async {
                let tls = timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                    .await
                    .map_err(|_| anyhow!("TLS handshake timed out"))?
                    .context("TLS 1.3 handshake")?;
                serve_connection(tls, &stats, measure, shutdown).await
            }
            .await;
            if let Err(error) = result {
                stats.counters.protocol_errors.fetch_add(1, Relaxed);
                tracing::debug!(%peer, error = %format!("{error:#}"), "fast sink connection failed");
            }
        });
    }
    // Stopping: every connection task sees the same shutdown signal.
    let _ = timeout(Duration::from_secs(2), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    connections.abort_all();
}

/// Server side of one connection: CONNECT → CONNACK, then the receive loop.
async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut io: S,
    stats: &SinkStats,
    measure_latency: bool,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut decoder = Decoder::server(MAX_PACKET);
    let mut rbuf = BytesMut::with_capacity(READ_BUFFER);
    let connect = timeout(
        HANDSHAKE_TIMEOUT,
        conn::read_packet(&mut io, &mut rbuf, &mut decoder),
    )
    .await
    .map_err(|_| anyhow!("no CONNECT within {HANDSHAKE_TIMEOUT:?}"))??;
    let Packet::Connect(connect) = connect else {
        bail!("the first packet was {}, not CONNECT", connect.name());
    };
    let version = connect.protocol;
    let mut wbuf = BytesMut::with_capacity(64 * 1024);
    encode(&connack_for(&connect), version, &mut wbuf).context("encoding CONNACK")?;
    io.write_all(&wbuf).await.context("writing CONNACK")?;
    stats.counters.connections_open.fetch_add(1, Relaxed);
    let result = receive_loop(
        &mut io,
        &mut decoder,
        &mut rbuf,
        &mut wbuf,
        version,
        stats,
        measure_latency,
        shutdown,
    )
    .await;
    stats.counters.connections_open.fetch_sub(1, Relaxed);
    let _ = timeout(Duration::from_secs(1), io.shutdown()).await;
    result
}

fn connack_for(connect: &Connect) -> Packet {
    let properties = match connect.protocol {
        ProtocolVersion::V311 => Properties::default(),
        ProtocolVersion::V5 => Properties {
            receive_maximum: Some(RECEIVE_MAXIMUM),
            maximum_packet_size: Some(MAX_PACKET as u32),
            assigned_client_identifier: connect
                .client_id
                .is_empty()
                .then(|| format!("fastsink-{}", unix_now_ns()).into()),
            ..Properties::default()
        },
    };
    Packet::ConnAck(ConnAck {
        session_present: false,
        code: 0,
        properties,
    })
}

/// Read, decode every complete packet, answer them all with one write; until EOF, DISCONNECT,
/// an error or shutdown. Shared by server connections and the measuring subscriber.
#[allow(clippy::too_many_arguments)]
async fn receive_loop<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    decoder: &mut Decoder,
    rbuf: &mut BytesMut,
    wbuf: &mut BytesMut,
    version: ProtocolVersion,
    stats: &SinkStats,
    measure_latency: bool,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut seen: Vec<Seen> = Vec::with_capacity(1024);
    let mut firsts: Vec<u64> = Vec::with_capacity(1024);
    loop {
        // Packets may already be buffered (e.g. pipelined behind CONNECT).
        wbuf.clear();
        seen.clear();
        let batch = handle_buffered(decoder, rbuf, wbuf, version, measure_latency, &mut seen)?;
        let c = &stats.counters;
        if batch.messages > 0 {
            c.messages.fetch_add(batch.messages, Relaxed);
            c.payload_bytes.fetch_add(batch.payload_bytes, Relaxed);
            c.acks_sent.fetch_add(batch.acks, Relaxed);
            c.foreign.fetch_add(batch.foreign, Relaxed);
            stats.record_batch(&seen, &mut firsts);
        }
        if !wbuf.is_empty() {
            io.write_all(wbuf)
                .await
                .context("writing acknowledgements")?;
        }
        if batch.disconnect {
            return Ok(());
        }
        if rbuf.capacity() - rbuf.len() < READ_BUFFER / 4 {
            rbuf.reserve(READ_BUFFER);
        }
        tokio::select! {
            biased;
            _ = shutdown.changed() => return Ok(()),
            read = io.read_buf(rbuf) => {
                if read.context("reading")? == 0 {
                    return Ok(());
                }
            }
        }
    }
}

#[derive(Debug, Default)]
struct Batch {
    messages: u64,
    payload_bytes: u64,
    acks: u64,
    foreign: u64,
    disconnect: bool,
}

/// The bench headers of a SenML pack's `vd` records (`None` if it is not a pack of them).
fn unpack_senml(payload: &[u8]) -> Option<Vec<PayloadHeader>> {
    use sluice_proto::senml;
    let records = senml::decode(senml::sniff(payload)?, payload).ok()?;
    let headers: Vec<PayloadHeader> = records
        .iter()
        .filter_map(|r| match &r.value {
            Some(senml::Value::Data(b)) => PayloadHeader::parse(b).ok(),
            _ => None,
        })
        .collect();
    (!headers.is_empty()).then_some(headers)
}

fn handle_buffered(
    decoder: &mut Decoder,
    rbuf: &mut BytesMut,
    wbuf: &mut BytesMut,
    version: ProtocolVersion,
    measure_latency: bool,
    seen: &mut Vec<Seen>,
) -> anyhow::Result<Batch> {
    let mut batch = Batch::default();
    let now_ns = if measure_latency { unix_now_ns() } else { 0 };
    while let Some(packet) = decoder.decode(rbuf).context("malformed packet")? {
        let reply = match packet {
            Packet::Publish(p) => {
                batch.messages += 1;
                batch.payload_bytes += p.payload.len() as u64;
                if measure_latency {
                    match PayloadHeader::parse(&p.payload) {
                        Ok(h) => {
                            seen.push((h.device, h.seq, now_ns.saturating_sub(h.sent_at_ns) / 1000))
                        }
                        // A SenML pack from an aggregating gateway: one arrival per record.
                        Err(_) => match unpack_senml(&p.payload) {
                            Some(headers) => seen.extend(headers.into_iter().map(|h| {
                                (h.device, h.seq, now_ns.saturating_sub(h.sent_at_ns) / 1000)
                            })),
                            None => batch.foreign += 1,
                        },
                    }
                }
                match (p.qos, p.packet_id) {
                    (QoS::AtLeastOnce, Some(id)) => {
                        batch.acks += 1;
                        Some(Packet::PubAck(ok(id)))
                    }
                    (QoS::ExactlyOnce, Some(id)) => {
                        batch.acks += 1;
                        Some(Packet::PubRec(ok(id)))
                    }
                    _ => None,
                }
            }
            Packet::PubRel(r) => Some(Packet::PubComp(ok(r.packet_id))),
            Packet::PingReq => Some(Packet::PingResp),
            Packet::Subscribe(s) => Some(suback_for(&s)),
            Packet::Unsubscribe(u) => Some(Packet::UnsubAck(UnsubAck {
                packet_id: u.packet_id,
                codes: match version {
                    ProtocolVersion::V311 => Vec::new(),
                    ProtocolVersion::V5 => vec![0; u.filters.len()],
                },
                properties: Properties::default(),
            })),
            Packet::Disconnect(_) => {
                batch.disconnect = true;
                break;
            }
            Packet::Connect(_) => bail!("protocol violation: a second CONNECT"),
            // Acks of what a broker sends the measuring subscriber, PINGRESP, SUBACK: nothing
            // to answer.
            _ => None,
        };
        if let Some(reply) = reply {
            encode(&reply, version, wbuf).with_context(|| format!("encoding {}", reply.name()))?;
        }
    }
    Ok(batch)
}

fn ok(packet_id: u16) -> PubResponse {
    PubResponse {
        packet_id,
        reason: 0,
        properties: None,
    }
}

fn suback_for(s: &Subscribe) -> Packet {
    Packet::SubAck(SubAck {
        packet_id: s.packet_id,
        codes: s
            .filters
            .iter()
            .map(|f| (f.options.qos as u8).min(1))
            .collect(),
        properties: Properties::default(),
    })
}

/// Where a measuring subscriber connects.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    pub broker: SocketAddr,
    /// CA file to verify the broker with (TLS 1.3); `None`: plain TCP.
    pub ca_file: Option<std::path::PathBuf>,
    /// Name to verify the broker certificate against.
    pub server_name: String,
    pub topic: String,
    pub protocol: ProtocolVersion,
    pub measure_latency: bool,
}

/// Connect to a broker as a subscriber of `topic` (QoS 1, clean session, no keep-alive) and
/// measure what arrives with the fast sink's receive loop. Returns once SUBACK granted the
/// subscription.
pub async fn subscribe_measuring(config: SubscriberConfig) -> anyhow::Result<FastSink> {
    let tls = match &config.ca_file {
        Some(ca) => Some(conn::tls_client_config(ca, None)?),
        None => None,
    };
    let connect_timeout = Duration::from_secs(10);
    let mut io = conn::open(
        config.broker,
        tls.as_ref().map(|c| (c, config.server_name.as_str())),
        connect_timeout,
    )
    .await?;
    let version = config.protocol;
    let mut decoder = Decoder::client(version, MAX_PACKET);
    let mut rbuf = BytesMut::with_capacity(READ_BUFFER);
    let mut wbuf = BytesMut::with_capacity(64 * 1024);
    let connect = Connect {
        protocol: version,
        clean_start: true,
        keep_alive: 0,
        client_id: format!("bench-fastsub-{}", unix_now_ns() % 1_000_000_000).into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    };
    conn::handshake(
        &mut io,
        connect,
        &mut rbuf,
        &mut wbuf,
        &mut decoder,
        connect_timeout,
    )
    .await?;
    let subscribe = Packet::Subscribe(Subscribe {
        packet_id: 1,
        filters: vec![SubscribeFilter {
            filter: config.topic.as_str().into(),
            options: SubscriptionOptions {
                qos: QoS::AtLeastOnce,
                no_local: false,
                retain_as_published: false,
                retain_handling: 0,
            },
        }],
        properties: Properties::default(),
    });
    conn::send(&mut io, &subscribe, version, &mut wbuf).await?;
    match timeout(
        connect_timeout,
        conn::read_packet(&mut io, &mut rbuf, &mut decoder),
    )
    .await
    .map_err(|_| anyhow!("no SUBACK within {connect_timeout:?}"))??
    {
        Packet::SubAck(ack) if ack.codes.first().is_some_and(|&c| c < 0x80) => {}
        Packet::SubAck(ack) => bail!("the broker refused the subscription: {:?}", ack.codes),
        other => bail!("the broker sent {} before SUBACK", other.name()),
    }
    let stats = Arc::new(SinkStats::default());
    stats.counters.connections_total.fetch_add(1, Relaxed);
    stats.counters.connections_open.fetch_add(1, Relaxed);
    let (shutdown, shutdown_rx) = watch::channel(false);
    let task = {
        let stats = stats.clone();
        let measure = config.measure_latency;
        tokio::spawn(async move {
            let result = receive_loop(
                &mut io,
                &mut decoder,
                &mut rbuf,
                &mut wbuf,
                version,
                &stats,
                measure,
                shutdown_rx,
            )
            .await;
            stats.counters.connections_open.fetch_sub(1, Relaxed);
            if let Err(error) = result {
                stats.counters.protocol_errors.fetch_add(1, Relaxed);
                tracing::warn!(error = %format!("{error:#}"), "measuring subscriber failed");
            }
        })
    };
    Ok(FastSink {
        address: config.broker,
        stats,
        started: Instant::now(),
        shutdown,
        task,
    })
}
