//! The session task: one MQTT client connection to the cloud broker, reconnected forever.
//!
//! One task per (shard, uplink), spawned with `spawn_local` on the shard's `LocalSet`. The task
//! owns the inflight map outright (no `RefCell`); it shares only the [`UplinkQueue`] with the
//! shard's device connections.
//!
//! Per connection: TCP (`connect_timeout` covers TCP, TLS and CONNACK) → TLS 1.3 → CONNECT
//! (client id `"{client_id}-{shard}"`; clean, except the downlink session: shard 0's normal
//! lane when `receive` is set, persistent, see the `uplink` module docs) → CONNACK → for the
//! downlink session, SUBSCRIBE `receive` filters (QoS 1) unless the broker kept the session
//! (MQTT 5: always, with Retain Handling 1 when it did) → serve loop. Downlink PUBLISHes are
//! delivered in arrival order and a QoS 1 one is PUBACKed only once delivery was accepted.
//!
//! Messages leave in queue order. While aggregating, a message is packed only if the pack
//! stays within what the broker's Maximum Packet Size leaves for a pack's payload; otherwise
//! the pack is sealed first, and a message no pack can hold is sent alone in its place
//! (`alone`). A PUBACK failure code either pauses sending for a backoff, after which every
//! unacknowledged message is requeued in send order and resent (temporary), or is counted,
//! logged and completed (permanent); see `classify_refusal`. The serve loop first writes everything it can — pending control
//! packets plus as many queued messages as the inflight window and [`MAX_BATCH_BYTES`] allow,
//! encoded into one buffer and written with one `write_all` + flush — then waits for the first
//! of: shutdown, bytes from the broker, a message queued while the window is open, or the
//! keep-alive timer. A lone message is therefore written as soon as it is queued; batching only
//! happens when messages are already waiting.
//!
//! Keep-alive: PINGREQ when nothing was written *or* nothing was read for `keep_alive` (the
//! broker's Server Keep Alive wins in MQTT 5); the connection is dead when nothing was read for
//! 1.5 × `keep_alive`. Writes that stall for that long (at least 5 s) also end the connection.
//!
//! Sizes: we accept packets up to [`MAX_INCOMING_PACKET_BYTES`] and (MQTT 5) tell the broker so,
//! together with a Receive Maximum of [`DOWNLINK_RECEIVE_MAXIMUM`]; we request no topic aliases.
//! Our window is `min(inflight, broker Receive Maximum)`, capped at 65534 so that a SUBSCRIBE
//! always finds a free packet id. In MQTT 5 the downlink subscription sets No Local, so
//! messages the downlink session itself publishes are not echoed back when `forward` and
//! `receive` overlap; those other shards' sessions publish are (different client ids), so
//! with several shards keep the two apart.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use rand::Rng;
use rustls::pki_types::ServerName;
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Disconnect, Packet, Properties, ProtocolVersion, PubResponse,
    Publish, QoS, Subscribe, SubscribeFilter, SubscriptionOptions,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tracing::{debug, info, trace, warn};

use crate::sink::outbox::pack::{Packer, SealedPack};
use crate::sink::outbox::queue::Queued;
use crate::sink::{
    connack_reason, socket, DropReason, Lane, RejectReason, UplinkError, UplinkMessage,
    UplinkMetrics, UplinkQueue, UplinkRoute, UplinkState,
};
use crate::config::{MqttProtocol, UplinkConfig};

/// Most encoded bytes put into one write (tokio-rustls splits it into 16 KiB TLS records).
pub const MAX_BATCH_BYTES: usize = 64 * 1024;
/// Largest packet accepted from the cloud broker (MQTT 5: sent as Maximum Packet Size).
pub const MAX_INCOMING_PACKET_BYTES: usize = 1024 * 1024;
/// MQTT 5 Receive Maximum we announce: downlink QoS 1 messages unacknowledged at once.
pub const DOWNLINK_RECEIVE_MAXIMUM: u16 = 64;
/// A connection that stayed up this long (or `reconnect_max`, if longer) resets the backoff.
const STABLE_CONNECTION: Duration = Duration::from_secs(10);
/// Bound on writing DISCONNECT and closing TLS at shutdown.
const SHUTDOWN_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
const READ_CHUNK: usize = 16 * 1024;
/// Our inflight window never exceeds this, leaving one packet id for SUBSCRIBE.
const MAX_WINDOW: usize = u16::MAX as usize - 1;
/// PUBACK 0x80/0x83 are retried like a quota until this many refusal rounds passed without
/// any success in between; then they count as permanent (`persistent_error`).
const PERSISTENT_ERROR_ROUNDS: u32 = 8;
/// At most one WARN per refusal reason per this long (the counter has every one).
const REJECT_WARN_EVERY: Duration = Duration::from_secs(60);
/// Floor of the refusal backoff, whatever the config says (a zero delay would spin).
const MIN_REFUSAL_DELAY: Duration = Duration::from_millis(10);

/// Everything one session task needs.
pub struct SessionSeed {
    pub shard: usize,
    pub lane: Lane,
    pub cfg: Rc<UplinkConfig>,
    /// Must be `Some` when `cfg.url.tls` (see [`crate::sink::client_tls_config`]).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub queue: Rc<UplinkQueue>,
    /// Called on the shard thread with every PUBLISH the cloud sends (topic unchanged); a
    /// QoS 1 one is acknowledged to the cloud once the returned future resolved. Only shard
    /// 0's normal lane subscribes to `receive` (see the module docs of `uplink`).
    pub downlink: crate::sink::Downlink,
    pub metrics: Arc<UplinkMetrics>,
    /// Devices connected to the whole gateway (decides whether the normal lane aggregates).
    pub live_devices: Arc<AtomicUsize>,
    /// Observes the high lane's source port (for `install_tc`): `Some(port)` on connect,
    /// `None` when the connection ends.
    pub on_port: Option<Box<dyn Fn(Option<u16>)>>,
}

/// Start the session task of one uplink lane on this shard. Must be called inside a
/// `LocalSet`. The task runs until `shutdown` becomes `true` (or its sender is dropped); it
/// then sends DISCONNECT if connected, leaves unacknowledged messages in the queue and returns.
pub fn spawn(seed: SessionSeed, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    let SessionSeed {
        shard,
        lane,
        cfg,
        tls,
        queue,
        downlink,
        metrics,
        live_devices,
        on_port,
    } = seed;
    let version = match cfg.protocol {
        MqttProtocol::V311 => ProtocolVersion::V311,
        MqttProtocol::V5 => ProtocolVersion::V5,
    };
    queue.attach_metrics(metrics.clone());
    let client_id = match lane {
        Lane::Normal => cfg.session_client_id(shard),
        Lane::High => cfg.high_session_client_id(shard),
    };
    let packer =
        (lane == Lane::Normal && cfg.aggregate.enabled).then(|| Packer::new(&cfg.aggregate));
    let cfg_refused = (cfg.refused_retry_min, cfg.refused_retry_max);
    let session = Session {
        shard,
        lane,
        client_id: ByteString::from(client_id),
        route: UplinkRoute::new(&cfg),
        packer,
        sealed: None,
        live_devices,
        on_port,
        inflight_backlog: 0,
        last_took_backlog: false,
        pack_mix: (0, 0),
        tls: tls.map(TlsConnector::from),
        cfg,
        queue,
        downlink,
        metrics,
        version,
        inflight: HashMap::new(),
        next_packet_id: 1,
        pending_subscribe: None,
        send_seq: 0,
        alone: VecDeque::new(),
        downlink_pending: VecDeque::new(),
        refused: Vec::new(),
        paused_until: None,
        refusal_backoff: Backoff::new(
            cfg_refused.0.max(MIN_REFUSAL_DELAY),
            cfg_refused.1.max(MIN_REFUSAL_DELAY),
        ),
        refusal_rounds: 0,
        reject_warned: [None; RejectReason::ALL.len()],
    };
    tokio::task::spawn_local(session.run(shutdown))
}

trait Io: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> Io for T {}

/// One established connection (after a successful CONNACK).
struct Connection {
    io: Box<dyn Io>,
    rbuf: BytesMut,
    decoder: Decoder,
    /// QoS 1 messages we may have unacknowledged.
    window: usize,
    /// The broker's Maximum Packet Size (`usize::MAX` when it set none).
    max_packet: usize,
    /// Zero disables keep-alive.
    keep_alive: Duration,
    retain_available: bool,
    local_port: u16,
    /// The broker still had our session (only the downlink session asks for one).
    session_present: bool,
    /// Most encoded bytes a SenML pack may have so that its PUBLISH fits `max_packet`.
    pack_limit: usize,
}

impl Connection {
    fn io_timeout(&self) -> Duration {
        if self.keep_alive.is_zero() {
            Duration::from_secs(30)
        } else {
            (self.keep_alive * 3 / 2).max(Duration::from_secs(5))
        }
    }
}

/// What one QoS 1 PUBLISH to the cloud carried.
enum Carried {
    One(UplinkMessage),
    /// A SenML pack: its messages in order.
    Pack(Vec<UplinkMessage>),
}

impl Carried {
    fn into_messages(self) -> Vec<UplinkMessage> {
        match self {
            Carried::One(m) => vec![m],
            Carried::Pack(v) => v,
        }
    }
}

/// A QoS 1 PUBLISH written and not yet acknowledged; `seq` is its send order; `backlog`: it
/// counts against the drain share.
struct Inflight {
    seq: u64,
    carried: Carried,
    backlog: bool,
}

struct Session {
    shard: usize,
    lane: Lane,
    /// `Some` on the normal lane when aggregation is enabled.
    packer: Option<Packer>,
    /// A pack sealed and waiting for the inflight window; nothing more is taken meanwhile.
    sealed: Option<SealedPack>,
    live_devices: Arc<AtomicUsize>,
    on_port: Option<Box<dyn Fn(Option<u16>)>>,
    /// Inflight PUBLISHes carrying backlog records.
    inflight_backlog: usize,
    /// With a window of one, backlog and live alternate.
    last_took_backlog: bool,
    /// (backlog, all) records added to the open pack: the drain share while aggregating.
    pack_mix: (usize, usize),
    cfg: Rc<UplinkConfig>,
    tls: Option<TlsConnector>,
    queue: Rc<UplinkQueue>,
    downlink: crate::sink::Downlink,
    /// Cloud PUBLISHes decoded and not yet delivered (at most what one read decodes: the
    /// broker sends no more than our Receive Maximum of QoS 1 ones unacknowledged).
    downlink_pending: VecDeque<Publish>,
    metrics: Arc<UplinkMetrics>,
    route: UplinkRoute,
    version: ProtocolVersion,
    client_id: ByteString,
    inflight: HashMap<u16, Inflight>,
    next_packet_id: u16,
    pending_subscribe: Option<u16>,
    send_seq: u64,
    /// Messages to send on their own, before anything taken after them: one too big for any
    /// pack, or the messages of a pack the broker could not take.
    alone: VecDeque<Queued>,
    /// PUBLISHes the broker refused for now (with their send order), resent when the pause
    /// ends.
    refused: Vec<(u64, Carried)>,
    /// While set, nothing is sent: a temporary refusal's backoff runs until then (and until
    /// nothing is inflight), then everything unacknowledged is requeued in order.
    paused_until: Option<Instant>,
    refusal_backoff: Backoff,
    /// Refusal rounds since the last successful PUBACK.
    refusal_rounds: u32,
    /// When each permanent refusal reason was last logged.
    reject_warned: [Option<Instant>; RejectReason::ALL.len()],
}

/// What a PUBACK failure code means for the messages it refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Resend after a backoff, in order.
    Temporary,
    /// Count, log, complete the ack token: no resend can help.
    Permanent(RejectReason),
}

/// Classify a PUBACK reason code ≥ 0x80. `rounds`: refusal rounds since the last success.
fn classify_refusal(code: u8, rounds: u32) -> Refusal {
    use sluice_proto::mqtt::reason::*;
    match code {
        QUOTA_EXCEEDED | PACKET_IDENTIFIER_IN_USE => Refusal::Temporary,
        UNSPECIFIED_ERROR | IMPLEMENTATION_SPECIFIC_ERROR => {
            if rounds >= PERSISTENT_ERROR_ROUNDS {
                Refusal::Permanent(RejectReason::PersistentError)
            } else {
                Refusal::Temporary
            }
        }
        NOT_AUTHORIZED => Refusal::Permanent(RejectReason::NotAuthorized),
        TOPIC_NAME_INVALID => Refusal::Permanent(RejectReason::TopicNameInvalid),
        PAYLOAD_FORMAT_INVALID => Refusal::Permanent(RejectReason::PayloadFormatInvalid),
        _ => Refusal::Permanent(RejectReason::Other),
    }
}

/// What woke the serve loop.
enum Event {
    Shutdown,
    Read(std::io::Result<usize>),
    Queued,
    Timer,
    PackDue,
    RetryDue,
}

impl Session {
    async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.cfg.reconnect_min, self.cfg.reconnect_max);
        let stable_after = self.cfg.reconnect_max.max(STABLE_CONNECTION);
        loop {
            if *shutdown.borrow() {
                break;
            }
            self.metrics.set_state(UplinkState::Connecting);
            let connect_timeout = self.cfg.connect_timeout;
            let attempt = tokio::select! {
                r = tokio::time::timeout(connect_timeout, self.connect()) => {
                    r.unwrap_or(Err(UplinkError::ConnectTimeout(connect_timeout)))
                }
                _ = shutdown_signal(&mut shutdown) => break,
            };
            let (error, was_connected) = match attempt {
                Err(e) => {
                    self.metrics.connect_failures.inc();
                    (e, false)
                }
                Ok(mut conn) => {
                    self.metrics.connects.inc();
                    self.metrics.set_state(UplinkState::Connected);
                    if let Some(f) = &self.on_port {
                        f(Some(conn.local_port));
                    }
                    self.queue.link_changed(true);
                    info!(
                        shard = self.shard,
                        uplink = %self.cfg.name,
                        lane = self.lane.as_str(),
                        window = conn.window,
                        keep_alive = ?conn.keep_alive,
                        queued = self.queue.len(),
                        "uplink connected"
                    );
                    let up_since = Instant::now();
                    let result = self.serve(&mut conn, &mut shutdown).await;
                    self.requeue_inflight();
                    if let Some(f) = &self.on_port {
                        f(None);
                    }
                    self.queue.link_changed(false);
                    self.metrics.set_state(UplinkState::Disconnected);
                    match result {
                        Ok(()) => {
                            info!(shard = self.shard, uplink = %self.cfg.name, "uplink disconnected for shutdown");
                            break;
                        }
                        Err(e) => {
                            if up_since.elapsed() >= stable_after {
                                backoff.reset();
                            }
                            (e, true)
                        }
                    }
                }
            };
            self.metrics.set_state(UplinkState::Disconnected);
            let delay = backoff.next_delay();
            if was_connected {
                warn!(
                    shard = self.shard,
                    uplink = %self.cfg.name,
                    blame = error.blame().as_str(),
                    error = %error,
                    retry_in = ?delay,
                    "uplink connection lost; reconnecting"
                );
            } else {
                warn!(
                    shard = self.shard,
                    uplink = %self.cfg.name,
                    blame = error.blame().as_str(),
                    error = %error,
                    retry_in = ?delay,
                    "uplink connect failed; retrying"
                );
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown_signal(&mut shutdown) => break,
            }
        }
        self.metrics.set_state(UplinkState::Disconnected);
    }

    /// TCP, TLS, CONNECT, CONNACK. The caller bounds it with `connect_timeout`.
    async fn connect(&mut self) -> Result<Connection, UplinkError> {
        let cfg = self.cfg.clone();
        let host = cfg.url.host.as_str();
        let port = cfg.url.port;
        let tls = if cfg.url.tls {
            let connector = self.tls.clone().ok_or(UplinkError::TlsConfigMissing)?;
            let name = cfg.server_name.clone().unwrap_or_else(|| host.to_owned());
            let server_name = ServerName::try_from(name.clone())
                .map_err(|_| UplinkError::InvalidServerName(name))?;
            Some((connector, server_name))
        } else if !cfg.allow_plaintext {
            return Err(UplinkError::PlaintextNotAllowed);
        } else {
            None
        };
        // Read at connect time so a rotated password is picked up on the next reconnect.
        // A blocking read of a small local file, once per connection attempt.
        let password = match &cfg.password_file {
            Some(path) => Some(read_password(path)?),
            None => None,
        };

        let lowat = u32::try_from(cfg.notsent_lowat.as_u64()).unwrap_or(u32::MAX);
        let tcp: TcpStream = socket::connect(host, port, self.lane, lowat)
            .await
            .map_err(|source| UplinkError::CloudUnreachable {
                addr: format!("{host}:{port}"),
                source,
            })?;
        let local_port = match socket::marks(&tcp) {
            Ok(marks) => {
                self.metrics.set_socket_marks(&marks);
                marks.local_port
            }
            Err(_) => tcp.local_addr().map_or(0, |a| a.port()),
        };
        // We coalesce writes ourselves; Nagle would only add latency to lone messages.
        let _ = tcp.set_nodelay(true);
        let mut io: Box<dyn Io> = match tls {
            Some((connector, server_name)) => Box::new(
                connector
                    .connect(server_name, tcp)
                    .await
                    .map_err(|e| tls_error(e, UplinkError::TlsHandshake))?,
            ),
            None => Box::new(tcp),
        };

        let mut properties = Properties::default();
        let persistent = self.subscribes_downlink();
        if self.version == ProtocolVersion::V5 {
            properties.receive_maximum = Some(DOWNLINK_RECEIVE_MAXIMUM);
            properties.maximum_packet_size = Some(MAX_INCOMING_PACKET_BYTES as u32);
            if persistent {
                let secs = cfg.downlink_session_expiry.as_secs();
                properties.session_expiry_interval = Some(u32::try_from(secs).unwrap_or(u32::MAX));
            }
        }
        let connect = Packet::Connect(Connect {
            protocol: self.version,
            clean_start: !persistent,
            keep_alive: keep_alive_secs(cfg.keep_alive),
            client_id: self.client_id.clone(),
            will: None,
            username: cfg.username.as_deref().map(ByteString::from),
            password,
            properties,
        });
        let mut out = BytesMut::with_capacity(256);
        encode(&connect, self.version, &mut out)?;
        io.write_all(&out)
            .await
            .map_err(UplinkError::ConnectionLost)?;
        io.flush().await.map_err(UplinkError::ConnectionLost)?;

        let mut decoder = Decoder::client(self.version, MAX_INCOMING_PACKET_BYTES);
        let mut rbuf = BytesMut::with_capacity(READ_CHUNK);
        let connack = loop {
            if let Some(packet) = decoder.decode(&mut rbuf)? {
                match packet {
                    Packet::ConnAck(c) => break c,
                    Packet::Disconnect(d) => {
                        return Err(UplinkError::DisconnectedByCloud(d.reason))
                    }
                    other => {
                        return Err(UplinkError::Protocol(format!(
                            "expected CONNACK, got {}",
                            other.name()
                        )))
                    }
                }
            }
            rbuf.reserve(READ_CHUNK);
            // In TLS 1.3 the server checks our certificate after the handshake: its refusal
            // arrives as an alert on this first read.
            let n = io
                .read_buf(&mut rbuf)
                .await
                .map_err(|e| tls_error(e, UplinkError::ConnectionLost))?;
            if n == 0 {
                return Err(UplinkError::ClosedByCloud);
            }
        };
        if connack.code != 0 {
            return Err(UplinkError::ConnectRefused {
                code: connack.code,
                reason: connack_reason(self.version, connack.code),
            });
        }
        let p = &connack.properties;
        let receive_maximum = match p.receive_maximum {
            Some(0) => return Err(UplinkError::Protocol("CONNACK Receive Maximum 0".into())),
            Some(n) => n,
            None => u16::MAX,
        };
        if p.maximum_qos == Some(0) {
            return Err(UplinkError::CloudQoS0Only);
        }
        let keep_alive = match p.server_keep_alive {
            Some(s) => Duration::from_secs(u64::from(s)),
            None => Duration::from_secs(u64::from(keep_alive_secs(cfg.keep_alive))),
        };
        Ok(Connection {
            io,
            rbuf,
            decoder,
            window: usize::from(cfg.inflight.max(1))
                .min(usize::from(receive_maximum))
                .min(MAX_WINDOW),
            max_packet: p.maximum_packet_size.map_or(usize::MAX, |m| m as usize),
            keep_alive,
            retain_available: p.retain_available != Some(0),
            local_port,
            session_present: connack.session_present,
            pack_limit: usize::MAX,
        })
    }

    /// Serve one connection until an error (returned) or shutdown (`Ok`, DISCONNECT sent).
    async fn serve(
        &mut self,
        c: &mut Connection,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), UplinkError> {
        self.next_packet_id = 1;
        c.pack_limit = self.pack_payload_limit(c.max_packet);
        let mut out = BytesMut::with_capacity(MAX_BATCH_BYTES + 1024);
        // QoS 0 messages in `out`: finished once the write succeeds.
        let mut unacked_in_write: Vec<UplinkMessage> = Vec::new();
        if self.subscribes_downlink() && (!c.session_present || self.version == ProtocolVersion::V5)
        {
            self.encode_subscribe(&mut out, c.session_present)?;
        }
        let now = Instant::now();
        let mut last_read = now;
        let mut last_write = now;
        let mut ping_outstanding = false;
        // One timer for the connection, re-armed only when it fires or when the deadline moves
        // earlier: the per-message path does not touch the timer wheel.
        let timer = tokio::time::sleep_until(now.into());
        tokio::pin!(timer);
        let mut armed_at = now;
        // Packets that arrived together with the CONNACK.
        while let Some(packet) = c.decoder.decode(&mut c.rbuf)? {
            self.handle(packet, &mut out, &mut ping_outstanding)?;
        }
        self.deliver_downlinks(&mut out).await?;

        loop {
            let (sent, resent) = self.fill_batch(c, &mut out, &mut unacked_in_write);
            if !out.is_empty() {
                let written = write_all(c, &out, c.io_timeout()).await;
                if let Err(e) = written {
                    for msg in unacked_in_write.drain(..) {
                        self.finish_dropped(msg, DropReason::ConnectionLost);
                    }
                    return Err(e);
                }
                self.metrics.writes.inc();
                self.metrics.bytes_written.add(out.len() as u64);
                self.metrics.messages_sent.add(sent);
                self.metrics.messages_resent.add(resent);
                out.clear();
                for msg in unacked_in_write.drain(..) {
                    self.finish(msg);
                }
                last_write = Instant::now();
            }

            let window_open = self.inflight.len() < c.window;
            let held = self.sealed.is_some() || !self.alone.is_empty();
            let can_take = self.paused_until.is_none()
                && !held
                && (self.aggregating()
                    || window_open
                    || self.queue.front_needs_ack() == Some(false));
            // The pause ends at its deadline once nothing is inflight (a PUBACK re-checks).
            let retry_at = self
                .paused_until
                .filter(|at| self.inflight.is_empty() || *at > Instant::now());
            let pack_due = match &self.sealed {
                Some(_) => None,
                None => self.packer.as_ref().and_then(Packer::deadline),
            };
            let keep_alive = c.keep_alive;
            let dead_at = last_read + keep_alive * 3 / 2;
            let wake_at = if ping_outstanding {
                dead_at
            } else {
                dead_at.min(last_read.min(last_write) + keep_alive)
            };
            if wake_at < armed_at || timer.is_elapsed() {
                timer.as_mut().reset(wake_at.into());
                armed_at = wake_at;
            }
            if c.rbuf.capacity() - c.rbuf.len() < READ_CHUNK / 4 {
                c.rbuf.reserve(READ_CHUNK);
            }
            let event = tokio::select! {
                biased;
                _ = shutdown_signal(shutdown) => Event::Shutdown,
                r = c.io.read_buf(&mut c.rbuf) => Event::Read(r),
                _ = self.queue.wait_ready(), if can_take => Event::Queued,
                _ = &mut timer, if !keep_alive.is_zero() => Event::Timer,
                _ = sleep_until_opt(pack_due), if pack_due.is_some() => Event::PackDue,
                _ = sleep_until_opt(retry_at), if retry_at.is_some() => Event::RetryDue,
            };
            match event {
                Event::Shutdown => {
                    self.disconnect(c, &mut out).await;
                    return Ok(());
                }
                Event::Read(Err(e)) => return Err(UplinkError::ConnectionLost(e)),
                Event::Read(Ok(0)) => return Err(UplinkError::ClosedByCloud),
                Event::Read(Ok(_)) => {
                    last_read = Instant::now();
                    while let Some(packet) = c.decoder.decode(&mut c.rbuf)? {
                        self.handle(packet, &mut out, &mut ping_outstanding)?;
                    }
                    self.deliver_downlinks(&mut out).await?;
                    self.maybe_resume();
                }
                Event::Queued => {}
                Event::PackDue => self.seal_pack(),
                Event::RetryDue => self.maybe_resume(),
                Event::Timer => {
                    let now = Instant::now();
                    if now >= dead_at {
                        return Err(UplinkError::KeepAliveTimeout(keep_alive * 3 / 2));
                    }
                    if !ping_outstanding && now >= last_read.min(last_write) + keep_alive {
                        encode(&Packet::PingReq, self.version, &mut out)?;
                        ping_outstanding = true;
                    }
                }
            }
        }
    }

    /// Whether normal records are being packed right now: aggregation is on for this session
    /// and more devices are connected than `min_devices`.
    fn aggregating(&self) -> bool {
        self.packer.is_some()
            && self.live_devices.load(Ordering::Relaxed) > self.cfg.aggregate.min_devices
    }

    /// Seal the open pack, unless one is already waiting for the window.
    fn seal_pack(&mut self) {
        if self.sealed.is_none() {
            self.sealed = self.packer.as_mut().and_then(Packer::seal);
            self.pack_mix = (0, 0);
        }
    }

    /// Whether the backlog stream goes next (see [`drain_turn`]).
    fn backlog_turn(&self, w: usize, aggregating: bool) -> bool {
        let Some(share) = self.queue.drain_share() else {
            return false;
        };
        drain_turn(
            share,
            DrainState {
                live_waiting: self.queue.live_waiting(),
                aggregating,
                window: w,
                inflight: self.inflight.len(),
                inflight_backlog: self.inflight_backlog,
                last_took_backlog: self.last_took_backlog,
                pack_mix: self.pack_mix,
            },
        )
    }

    /// Take queued messages while the window and the batch size allow, encoding them after
    /// whatever control packets `out` already holds. Returns (PUBLISH packets, of which
    /// resends). While aggregating, messages go into the open pack instead, and a sealed pack
    /// is written as one PUBLISH; order is kept across both paths because a pack is sealed
    /// (and written first) before any message is sent on its own again. A message that would
    /// take the pack past what the broker's Maximum Packet Size allows seals the pack and
    /// starts the next one; if even an empty pack cannot hold it, it is sent alone (in its
    /// place). Nothing is taken while a temporary refusal's backoff runs.
    fn fill_batch(
        &mut self,
        c: &Connection,
        out: &mut BytesMut,
        unacked_in_write: &mut Vec<UplinkMessage>,
    ) -> (u64, u64) {
        let (mut sent, mut resent) = (0, 0);
        while out.len() < MAX_BATCH_BYTES && self.paused_until.is_none() {
            let window_open = self.inflight.len() < c.window;
            if let Some(pack) = self.sealed.take() {
                if pack.needs_ack() && !window_open {
                    self.sealed = Some(pack);
                    break;
                }
                sent += u64::from(self.write_pack(c, out, pack, unacked_in_write));
                continue;
            }
            if let Some(front) = self.alone.front() {
                if front.msg.needs_cloud_ack() && !window_open {
                    break;
                }
                if let Some(q) = self.alone.pop_front() {
                    let (s, r) = self.send_single(c, out, q, unacked_in_write);
                    sent += s;
                    resent += r;
                }
                continue;
            }
            let aggregating = self.aggregating();
            if !aggregating && self.packer.as_ref().is_some_and(|p| !p.is_empty()) {
                // Crossed below the threshold: what is packed goes before anything single.
                self.seal_pack();
                continue;
            }
            if self.packer.as_ref().is_some_and(Packer::is_full) {
                // Filled by a message that started it while the previous pack was sealed.
                self.seal_pack();
                continue;
            }
            let backlog_turn = self.backlog_turn(c.window, aggregating);
            let Some(Queued { msg, resend }) = self
                .queue
                .take_next(window_open || aggregating, backlog_turn)
            else {
                break;
            };
            let backlog = msg.is_backlog();
            self.last_took_backlog = backlog;
            if aggregating {
                self.pack_mix.0 += usize::from(backlog);
                self.pack_mix.1 += 1;
                resent += u64::from(resend);
                self.pack_or_hold(Queued { msg, resend }, c.pack_limit);
                continue;
            }
            let (s, r) = self.send_single(c, out, Queued { msg, resend }, unacked_in_write);
            sent += s;
            resent += r;
        }
        self.metrics.inflight.set(self.inflight.len() as i64);
        (sent, resent)
    }

    /// Put a message into the open pack if it fits within `limit`; otherwise seal the pack
    /// and try an empty one; a message even an empty pack cannot hold is held to go alone.
    fn pack_or_hold(&mut self, q: Queued, limit: usize) {
        let Queued { msg, resend } = q;
        let Some(packer) = self.packer.as_mut() else {
            self.alone.push_back(Queued { msg, resend });
            return;
        };
        let msg = match packer.add(msg, limit) {
            Ok(full) => {
                if full {
                    self.seal_pack();
                }
                return;
            }
            Err(msg) if packer.is_empty() => {
                self.alone.push_back(Queued { msg, resend });
                return;
            }
            Err(msg) => msg,
        };
        // The open pack is full for this message: seal it (it goes first), start a new one.
        // `sealed` is empty here: fill_batch writes (or waits for) a sealed pack first.
        self.seal_pack();
        let Some(packer) = self.packer.as_mut() else {
            return;
        };
        // If this fills the new pack at once, fill_batch seals it after the sealed one went.
        if let Err(msg) = packer.add(msg, limit) {
            self.alone.push_back(Queued { msg, resend });
        }
    }

    /// Encode one message as its own PUBLISH (or finish it with a counted drop when the
    /// broker can never take it). Returns (PUBLISH packets, of which resends).
    fn send_single(
        &mut self,
        c: &Connection,
        out: &mut BytesMut,
        q: Queued,
        unacked_in_write: &mut Vec<UplinkMessage>,
    ) -> (u64, u64) {
        let Queued { msg, resend } = q;
        let backlog = msg.is_backlog();
        let needs_ack = msg.needs_cloud_ack();
        let packet_id = needs_ack.then(|| self.alloc_packet_id());
        let publish = Packet::Publish(Publish {
            dup: resend && needs_ack,
            qos: if needs_ack {
                QoS::AtLeastOnce
            } else {
                QoS::AtMostOnce
            },
            retain: msg.retain && c.retain_available,
            topic: self.route.cloud_topic(&msg.device, &msg.topic),
            packet_id,
            properties: None,
            payload: msg.payload.clone(),
        });
        let before = out.len();
        match encode(&publish, self.version, out) {
            Err(e) => {
                out.truncate(before);
                debug!(shard = self.shard, uplink = %self.cfg.name, error = %e, "message cannot be encoded for the cloud; dropped");
                self.finish_dropped(msg, DropReason::InvalidForCloud);
                return (0, 0);
            }
            Ok(()) if out.len() - before > c.max_packet => {
                let size = out.len() - before;
                out.truncate(before);
                debug!(
                    shard = self.shard,
                    uplink = %self.cfg.name,
                    size,
                    max = c.max_packet,
                    "message exceeds the cloud broker's maximum packet size; dropped"
                );
                self.finish_dropped(msg, DropReason::TooLargeForCloud);
                return (0, 0);
            }
            Ok(()) => {}
        }
        trace!(shard = self.shard, packet_id = ?packet_id, dup = resend, "publish to cloud");
        match packet_id {
            Some(id) => {
                self.send_seq += 1;
                self.inflight_backlog += usize::from(backlog);
                self.inflight.insert(
                    id,
                    Inflight {
                        seq: self.send_seq,
                        carried: Carried::One(msg),
                        backlog,
                    },
                );
            }
            None => unacked_in_write.push(msg),
        }
        (1, u64::from(resend))
    }

    /// The PUBLISH carrying a SenML pack.
    fn pack_publish(&self, packet_id: Option<u16>, payload: Bytes) -> Packet {
        let properties = (self.version == ProtocolVersion::V5).then(|| {
            let format = self.packer.as_ref().map(Packer::format);
            Box::new(Properties {
                content_type: format.map(|f| ByteString::from_static(f.content_type())),
                ..Properties::default()
            })
        });
        Packet::Publish(Publish {
            dup: false,
            qos: if packet_id.is_some() {
                QoS::AtLeastOnce
            } else {
                QoS::AtMostOnce
            },
            retain: false,
            topic: ByteString::from(self.cfg.aggregate.topic.as_str()),
            packet_id,
            properties,
            payload,
        })
    }

    /// Most payload bytes a pack may have so that its PUBLISH stays within `max_packet`: the
    /// PUBLISH around an empty payload, plus 3 for the remaining-length field growing.
    fn pack_payload_limit(&self, max_packet: usize) -> usize {
        if max_packet == usize::MAX || self.packer.is_none() {
            return usize::MAX;
        }
        let mut probe = BytesMut::new();
        match encode(
            &self.pack_publish(Some(1), Bytes::new()),
            self.version,
            &mut probe,
        ) {
            Ok(()) => max_packet.saturating_sub(probe.len() + 3),
            // The aggregate topic cannot be encoded: no pack can be sent; every message goes
            // alone (write_pack hands a refused pack's messages over too).
            Err(_) => 0,
        }
    }

    /// Encode a sealed pack as one PUBLISH on the aggregate topic; returns whether it was
    /// written. A pack the broker cannot take (not expected: packs are kept within
    /// `pack_limit`) is not dropped: its messages go one by one, before anything later.
    fn write_pack(
        &mut self,
        c: &Connection,
        out: &mut BytesMut,
        pack: SealedPack,
        unacked_in_write: &mut Vec<UplinkMessage>,
    ) -> bool {
        let needs_ack = pack.needs_ack();
        let packet_id = needs_ack.then(|| self.alloc_packet_id());
        let publish = self.pack_publish(packet_id, pack.payload.clone());
        let before = out.len();
        let fits = match encode(&publish, self.version, out) {
            Err(_) => false,
            Ok(()) => out.len() - before <= c.max_packet,
        };
        if !fits {
            out.truncate(before);
            debug!(
                shard = self.shard,
                uplink = %self.cfg.name,
                records = pack.records,
                bytes = pack.payload.len(),
                max = c.max_packet,
                "SenML pack cannot be sent to the cloud broker; its messages go one by one"
            );
            for (i, msg) in pack.msgs.into_iter().enumerate() {
                self.alone.insert(i, Queued { msg, resend: false });
            }
            return false;
        }
        self.metrics.packs_sent.inc();
        self.metrics.records_packed.add(pack.msgs.len() as u64);
        self.metrics.pack_records.observe(pack.records as u64);
        self.metrics.pack_bytes.observe(pack.payload.len() as u64);
        trace!(shard = self.shard, packet_id = ?packet_id, records = pack.records, "pack to cloud");
        match packet_id {
            Some(id) => {
                self.send_seq += 1;
                let backlog = pack.msgs.first().is_some_and(UplinkMessage::is_backlog);
                self.inflight_backlog += usize::from(backlog);
                self.inflight.insert(
                    id,
                    Inflight {
                        seq: self.send_seq,
                        carried: Carried::Pack(pack.msgs),
                        backlog,
                    },
                );
            }
            None => unacked_in_write.extend(pack.msgs),
        }
        true
    }

    /// React to one packet from the broker; replies are appended to `out`.
    fn handle(
        &mut self,
        packet: Packet,
        out: &mut BytesMut,
        ping_outstanding: &mut bool,
    ) -> Result<(), UplinkError> {
        match packet {
            Packet::PubAck(ack) => self.on_puback(ack),
            Packet::Publish(p) => {
                if p.topic.is_empty() {
                    return Err(UplinkError::Protocol(
                        "PUBLISH with an empty topic (no topic aliases were allowed)".into(),
                    ));
                }
                if p.qos != QoS::AtMostOnce && p.packet_id.is_none() {
                    return Err(UplinkError::Protocol(
                        "QoS>0 PUBLISH without packet id".into(),
                    ));
                }
                self.metrics.downlink_messages.inc();
                // Delivered (and acknowledged) by deliver_downlinks, in arrival order.
                self.downlink_pending.push_back(p);
            }
            Packet::PubRel(r) => encode(
                &Packet::PubComp(ok_response(r.packet_id)),
                self.version,
                out,
            )?,
            Packet::SubAck(s) => {
                if self.pending_subscribe == Some(s.packet_id) {
                    self.pending_subscribe = None;
                    for (filter, code) in self.cfg.receive.iter().zip(&s.codes) {
                        if *code >= 0x80 {
                            warn!(
                                shard = self.shard,
                                uplink = %self.cfg.name,
                                filter = %filter,
                                code = format_args!("{code:#04x}"),
                                "cloud broker refused a downlink subscription"
                            );
                        }
                    }
                }
            }
            Packet::PingResp => *ping_outstanding = false,
            Packet::UnsubAck(_) => {}
            Packet::Disconnect(d) => return Err(UplinkError::DisconnectedByCloud(d.reason)),
            other => {
                return Err(UplinkError::Protocol(format!(
                    "unexpected {} from the broker",
                    other.name()
                )))
            }
        }
        Ok(())
    }

    fn on_puback(&mut self, ack: PubResponse) {
        let Some(Inflight {
            seq,
            carried,
            backlog,
        }) = self.inflight.remove(&ack.packet_id)
        else {
            // A duplicate or late PUBACK (e.g. for a packet id of an earlier connection): harmless.
            debug!(shard = self.shard, uplink = %self.cfg.name, packet_id = ack.packet_id, "PUBACK for a packet id not inflight; ignored");
            return;
        };
        self.inflight_backlog = self.inflight_backlog.saturating_sub(usize::from(backlog));
        self.metrics.inflight.set(self.inflight.len() as i64);
        if ack.reason < 0x80 {
            self.refusal_backoff.reset();
            self.refusal_rounds = 0;
            match carried {
                Carried::One(msg) => self.acked(msg),
                Carried::Pack(msgs) => msgs.into_iter().for_each(|m| self.acked(m)),
            }
            return;
        }
        let code = ack.reason;
        match classify_refusal(code, self.refusal_rounds) {
            Refusal::Temporary => {
                let n = match &carried {
                    Carried::One(_) => 1,
                    Carried::Pack(v) => v.len(),
                };
                self.metrics.refusals_retried.add(n as u64);
                self.refused.push((seq, carried));
                if self.paused_until.is_none() {
                    let delay = self.refusal_backoff.next_delay();
                    self.refusal_rounds = self.refusal_rounds.saturating_add(1);
                    self.paused_until = Some(Instant::now() + delay);
                    warn!(
                        shard = self.shard,
                        uplink = %self.cfg.name,
                        lane = self.lane.as_str(),
                        blame = "cloud",
                        code = format_args!("{code:#04x}"),
                        retry_in = ?delay,
                        "cloud broker refused messages for now; resending them in order after a backoff"
                    );
                }
            }
            Refusal::Permanent(reason) => {
                let msgs = carried.into_messages();
                self.metrics.record_rejected(reason, msgs.len() as u64);
                let now = Instant::now();
                let last = &mut self.reject_warned[reason as usize];
                if last.is_none_or(|at| now.duration_since(at) >= REJECT_WARN_EVERY) {
                    *last = Some(now);
                    warn!(
                        shard = self.shard,
                        uplink = %self.cfg.name,
                        lane = self.lane.as_str(),
                        blame = "cloud",
                        code = format_args!("{code:#04x}"),
                        reason = reason.as_str(),
                        total = self.metrics.rejected(reason),
                        "cloud broker refused a message for good; counted and acknowledged to the device (logged at most once a minute per reason)"
                    );
                }
                for msg in msgs {
                    self.finish_refused(msg, DropReason::CloudRejected, code);
                }
            }
        }
    }

    /// End a refusal pause once its deadline passed and nothing is inflight: everything
    /// unacknowledged goes back to the queue's front in send order, to be sent again.
    fn maybe_resume(&mut self) {
        let Some(at) = self.paused_until else {
            return;
        };
        if Instant::now() >= at && self.inflight.is_empty() {
            self.requeue_unacked();
        }
    }

    fn acked(&self, msg: UplinkMessage) {
        self.metrics.messages_acked.inc();
        self.metrics.ack_latency.observe(msg.received_at.elapsed());
        self.finish(msg);
    }

    /// The message is done: release its bytes and complete its ack token.
    fn finish(&self, msg: UplinkMessage) {
        self.finish_with(msg, 0);
    }

    /// [`Session::finish`] with a reason code for the device (0: success; see
    /// [`crate::edge::ack::AckToken::complete_with`]).
    fn finish_with(&self, msg: UplinkMessage, code: u8) {
        self.queue.release_msg(&msg);
        msg.complete_with(code);
    }

    /// The message can never reach the cloud: count it and complete its token with `code`
    /// (the cloud's PUBACK code, or 0x83 Implementation specific error when the gateway
    /// cannot send it at all), which an MQTT 5 device sees in its PUBACK.
    fn finish_dropped(&self, msg: UplinkMessage, reason: DropReason) {
        let code = match reason {
            DropReason::TooLargeForCloud | DropReason::InvalidForCloud => {
                sluice_proto::mqtt::reason::IMPLEMENTATION_SPECIFIC_ERROR
            }
            _ => 0,
        };
        self.finish_refused(msg, reason, code);
    }

    fn finish_refused(&self, msg: UplinkMessage, reason: DropReason, code: u8) {
        self.metrics.record_drop(reason);
        self.finish_with(msg, code);
    }

    /// Whether this session holds the uplink's one downlink subscription: shard 0's normal
    /// lane, when `receive` has filters.
    fn subscribes_downlink(&self) -> bool {
        self.shard == 0 && self.lane == Lane::Normal && !self.cfg.receive.is_empty()
    }

    /// Deliver the cloud PUBLISHes decoded so far, in order; a QoS 1 one is acknowledged to
    /// the cloud (PUBACK appended to `out`) only after the shard accepted it. (We subscribe
    /// with QoS 1, so a conforming broker never sends QoS 2; if it does, PUBREC follows
    /// delivery the same way and a resent duplicate may repeat it.)
    async fn deliver_downlinks(&mut self, out: &mut BytesMut) -> Result<(), UplinkError> {
        while let Some(p) = self.downlink_pending.pop_front() {
            let reply = match (p.qos, p.packet_id) {
                (QoS::AtLeastOnce, Some(id)) => Some(Packet::PubAck(ok_response(id))),
                (QoS::ExactlyOnce, Some(id)) => Some(Packet::PubRec(ok_response(id))),
                _ => None,
            };
            let downlink = self.downlink.clone();
            downlink(p).await;
            if let Some(reply) = reply {
                encode(&reply, self.version, out)?;
                self.metrics.downlink_acked.inc();
            }
        }
        Ok(())
    }

    /// SUBSCRIBE to the `receive` filters; `session_present`: the broker kept our session
    /// (MQTT 5 then asks for no retained messages again: Retain Handling 1).
    fn encode_subscribe(
        &mut self,
        out: &mut BytesMut,
        session_present: bool,
    ) -> Result<(), UplinkError> {
        let packet_id = self.alloc_packet_id();
        self.pending_subscribe = Some(packet_id);
        let v5 = self.version == ProtocolVersion::V5;
        let filters = self
            .cfg
            .receive
            .iter()
            .map(|f| SubscribeFilter {
                filter: ByteString::from(f.as_str()),
                options: SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
                    no_local: v5,
                    retain_as_published: false,
                    retain_handling: u8::from(session_present),
                },
            })
            .collect();
        let sub = Packet::Subscribe(Subscribe {
            packet_id,
            filters,
            properties: Properties::default(),
        });
        encode(&sub, self.version, out)?;
        Ok(())
    }

    /// A packet id not inflight. Terminates: inflight ≤ MAX_WINDOW, plus one SUBSCRIBE.
    fn alloc_packet_id(&mut self) -> u16 {
        loop {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.inflight.contains_key(&id) && self.pending_subscribe != Some(id) {
                return id;
            }
        }
    }

    /// The connection ended: requeue everything unacknowledged (see [`Session::requeue_unacked`]).
    fn requeue_inflight(&mut self) {
        self.requeue_unacked();
        self.pending_subscribe = None;
    }

    /// Put every unacknowledged message back at the front of the queue in send order: the
    /// inflight and refused ones (by send order), then a sealed pack's, then those held to go
    /// alone, then the open pack's. Ends a refusal pause.
    fn requeue_unacked(&mut self) {
        let mut pending: Vec<(u64, Carried)> = self
            .inflight
            .drain()
            .map(|(_, f)| (f.seq, f.carried))
            .chain(self.refused.drain(..))
            .collect();
        pending.sort_unstable_by_key(|(seq, _)| *seq);
        let mut msgs: Vec<UplinkMessage> = pending
            .into_iter()
            .flat_map(|(_, carried)| carried.into_messages())
            .collect();
        if let Some(sealed) = self.sealed.take() {
            msgs.extend(sealed.msgs);
        }
        msgs.extend(self.alone.drain(..).map(|q| q.msg));
        if let Some(packer) = &mut self.packer {
            msgs.extend(packer.take_messages());
        }
        self.queue.requeue_front(msgs);
        self.inflight_backlog = 0;
        self.pack_mix = (0, 0);
        self.paused_until = None;
        self.metrics.inflight.set(0);
    }

    async fn disconnect(&self, c: &mut Connection, out: &mut BytesMut) {
        let packet = Packet::Disconnect(Disconnect {
            reason: 0,
            properties: Properties::default(),
        });
        if encode(&packet, self.version, out).is_err() {
            return;
        }
        if let Err(e) = write_all(c, out, SHUTDOWN_WRITE_TIMEOUT).await {
            debug!(shard = self.shard, uplink = %self.cfg.name, error = %e, "DISCONNECT not delivered");
            return;
        }
        let _ = tokio::time::timeout(SHUTDOWN_WRITE_TIMEOUT, c.io.shutdown()).await;
    }
}

/// What [`drain_turn`] looks at.
#[derive(Debug, Clone, Copy)]
struct DrainState {
    live_waiting: bool,
    aggregating: bool,
    window: usize,
    inflight: usize,
    inflight_backlog: usize,
    last_took_backlog: bool,
    /// (backlog, all) records in the open pack.
    pack_mix: (usize, usize),
}

/// Whether the backlog stream goes next when both streams may have messages (the drain
/// share). With nothing live waiting the backlog may use the whole window. Otherwise, window
/// `w`, backlog cap `cap = clamp(ceil(share × w), 1, w − 1)`: live messages take the window
/// up to `w − cap` inflight, then the backlog up to `cap`; so live messages always find
/// `w − cap ≥ 1` slots and the backlog `cap ≥ 1`, and neither starves. With a window of one
/// the two alternate. While aggregating, the share applies to the records of each pack.
fn drain_turn(share: crate::config::Share, s: DrainState) -> bool {
    if !s.live_waiting {
        return true;
    }
    if s.aggregating {
        let (b, all) = s.pack_mix;
        return b * 1000 < usize::from(share.permille()) * (all + 1);
    }
    let w = s.window;
    if w <= 1 {
        return !s.last_took_backlog;
    }
    let cap = share.of(w).clamp(1, w - 1);
    let b = s.inflight_backlog;
    let live = s.inflight.saturating_sub(b);
    live >= w - cap && b < cap
}

/// Name certificate problems and TLS alerts precisely; anything else becomes `otherwise(e)`.
fn tls_error(e: std::io::Error, otherwise: fn(std::io::Error) -> UplinkError) -> UplinkError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(why)) => {
            UplinkError::UntrustedCloudCertificate(format!("{why:?}"))
        }
        Some(rustls::Error::AlertReceived(alert)) => {
            UplinkError::TlsRejectedByCloud(format!("{alert:?}"))
        }
        _ => otherwise(e),
    }
}

fn ok_response(packet_id: u16) -> PubResponse {
    PubResponse {
        packet_id,
        reason: 0,
        properties: None,
    }
}

async fn write_all(c: &mut Connection, bytes: &[u8], limit: Duration) -> Result<(), UplinkError> {
    let write = async {
        c.io.write_all(bytes).await?;
        c.io.flush().await
    };
    match tokio::time::timeout(limit, write).await {
        Err(_) => Err(UplinkError::WriteTimeout(limit)),
        Ok(Err(e)) => Err(UplinkError::ConnectionLost(e)),
        Ok(Ok(())) => Ok(()),
    }
}

/// Sleeps until `at`; never resolves for `None` (callers also guard the branch).
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Resolves when shutdown was requested or its sender is gone.
async fn shutdown_signal(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Keep-alive in whole seconds as CONNECT carries it (sub-second values round up).
fn keep_alive_secs(d: Duration) -> u16 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.min(u64::from(u16::MAX)) as u16
}

fn read_password(path: &std::path::Path) -> Result<Bytes, UplinkError> {
    let mut raw = std::fs::read(path).map_err(|source| UplinkError::ReadFile {
        what: "password",
        path: path.to_owned(),
        source,
    })?;
    while matches!(raw.last(), Some(b'\n' | b'\r')) {
        raw.pop();
    }
    Ok(Bytes::from(raw))
}

/// Jittered exponential backoff: attempt n waits uniformly in
/// `[max(min, d/2), d]` with `d = clamp(min · 2ⁿ, min, max)`.
#[derive(Debug)]
struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max: max.max(min),
            attempt: 0,
        }
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }

    fn next_delay(&mut self) -> Duration {
        let d = self
            .min
            .saturating_mul(1u32 << self.attempt.min(30))
            .clamp(self.min, self.max);
        self.attempt = self.attempt.saturating_add(1);
        let lo = (d / 2).max(self.min);
        let (lo_ns, hi_ns) = (lo.as_nanos() as u64, d.as_nanos() as u64);
        if hi_ns <= lo_ns {
            return d;
        }
        Duration::from_nanos(rand::thread_rng().gen_range(lo_ns..=hi_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_within_bounds_and_resets() {
        let min = Duration::from_millis(100);
        let max = Duration::from_secs(5);
        let mut b = Backoff::new(min, max);
        assert_eq!(b.next_delay(), min);
        let second = b.next_delay();
        assert!(second >= min && second <= min * 2, "{second:?}");
        for _ in 0..40 {
            let d = b.next_delay();
            assert!(d >= min && d <= max, "{d:?}");
        }
        let late = b.next_delay();
        assert!(
            late >= max / 2,
            "after many failures the delay is near the max: {late:?}"
        );
        b.reset();
        assert_eq!(b.next_delay(), min);
    }

    /// Simulates a saturated window: both streams always have messages; each step frees
    /// one random slot. Returns (backlog, live) sends.
    fn simulate(share: u16, w: usize, steps: usize) -> (usize, usize) {
        let share = crate::config::Share::from_permille(share);
        let mut inflight: Vec<bool> = Vec::new();
        let mut last = false;
        let (mut b, mut l) = (0, 0);
        for step in 0..steps {
            while inflight.len() < w {
                let s = DrainState {
                    live_waiting: true,
                    aggregating: false,
                    window: w,
                    inflight: inflight.len(),
                    inflight_backlog: inflight.iter().filter(|x| **x).count(),
                    last_took_backlog: last,
                    pack_mix: (0, 0),
                };
                last = drain_turn(share, s);
                inflight.push(last);
                if last {
                    b += 1;
                } else {
                    l += 1;
                }
            }
            inflight.remove(step * 7919 % inflight.len());
        }
        (b, l)
    }

    #[test]
    fn the_backlog_gets_its_share_of_a_saturated_window_and_live_messages_the_rest() {
        for (share, w) in [
            (500, 10),
            (250, 8),
            (100, 100),
            (900, 10),
            (1000, 4),
            (1, 4),
            (500, 1),
            (500, 2),
        ] {
            let (b, l) = simulate(share, w, 2000);
            assert!(
                b > 0 && l > 0,
                "share {share} window {w}: neither starves ({b} backlog, {l} live)"
            );
            if w > 2 && share < 1000 {
                let got = b as f64 / (b + l) as f64;
                let cap = crate::config::Share::from_permille(share)
                    .of(w)
                    .clamp(1, w - 1) as f64
                    / w as f64;
                assert!(
                    (got - cap).abs() < 0.1,
                    "share {share} window {w}: backlog got {got:.2}, cap {cap:.2}"
                );
            }
        }
    }

    #[test]
    fn without_live_messages_the_backlog_uses_the_whole_window() {
        let s = DrainState {
            live_waiting: false,
            aggregating: false,
            window: 10,
            inflight: 9,
            inflight_backlog: 9,
            last_took_backlog: true,
            pack_mix: (0, 0),
        };
        assert!(drain_turn(crate::config::Share::from_permille(100), s));
    }

    #[test]
    fn while_aggregating_each_pack_holds_about_the_share_of_backlog_records() {
        let share = crate::config::Share::from_permille(250);
        let mut mix = (0usize, 0usize);
        for _ in 0..400 {
            let s = DrainState {
                live_waiting: true,
                aggregating: true,
                window: 1,
                inflight: 0,
                inflight_backlog: 0,
                last_took_backlog: false,
                pack_mix: mix,
            };
            mix.0 += usize::from(drain_turn(share, s));
            mix.1 += 1;
        }
        assert!((95..=105).contains(&mix.0), "{mix:?}");
    }

    #[test]
    fn puback_failure_codes_are_temporary_or_permanent_by_what_a_resend_can_change() {
        use sluice_proto::mqtt::reason::*;
        for code in [QUOTA_EXCEEDED, PACKET_IDENTIFIER_IN_USE] {
            assert_eq!(classify_refusal(code, 0), Refusal::Temporary);
            assert_eq!(
                classify_refusal(code, 1000),
                Refusal::Temporary,
                "{code:#x}"
            );
        }
        for code in [UNSPECIFIED_ERROR, IMPLEMENTATION_SPECIFIC_ERROR] {
            assert_eq!(classify_refusal(code, 0), Refusal::Temporary);
            assert_eq!(
                classify_refusal(code, PERSISTENT_ERROR_ROUNDS),
                Refusal::Permanent(RejectReason::PersistentError),
                "{code:#x} that never clears is given up"
            );
        }
        assert_eq!(
            classify_refusal(NOT_AUTHORIZED, 0),
            Refusal::Permanent(RejectReason::NotAuthorized)
        );
        assert_eq!(
            classify_refusal(TOPIC_NAME_INVALID, 0),
            Refusal::Permanent(RejectReason::TopicNameInvalid)
        );
        assert_eq!(
            classify_refusal(PAYLOAD_FORMAT_INVALID, 0),
            Refusal::Permanent(RejectReason::PayloadFormatInvalid)
        );
        assert_eq!(
            classify_refusal(0xA0, 0),
            Refusal::Permanent(RejectReason::Other)
        );
    }

    #[test]
    fn keep_alive_rounds_up_to_whole_seconds() {
        assert_eq!(keep_alive_secs(Duration::from_millis(500)), 1);
        assert_eq!(keep_alive_secs(Duration::from_secs(30)), 30);
        assert_eq!(keep_alive_secs(Duration::from_secs(1_000_000)), u16::MAX);
        assert_eq!(keep_alive_secs(Duration::ZERO), 0);
    }
}
