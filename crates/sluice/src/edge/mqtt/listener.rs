//! The MQTT device listeners: accept, secure (TLS handshake, WebSocket upgrade), read
//! CONNECT, admit, place on a shard.
//!
//! Owns: the device listening sockets — plain TCP (`[mqtt] listen`), TLS (`[mqtt.tls]`),
//! WebSocket (`[mqtt.ws]`) and WebSocket over TLS (`[mqtt.wss]`) — each new connection until
//! its CONNECT is admitted or refused, the `max_connections` bound at accept (one count for
//! all listeners), and the hand-over to the device's shard (`ShardCmd::Adopt`, the shard
//! chosen by hashing the client id). Every listener runs the same path: [`MqttListener`]'s
//! accept loop, then `open` (nothing for plain TCP; the TLS handshake; the WebSocket
//! upgrade; both for wss — `edge/mqtt/stream/`), then the CONNECT read, admission and
//! hand-over, which see only a [`DeviceReader`]/[`DeviceWriter`] pair.
//!
//! Does not own: the admission rules and password checks (`control::admission`), the session
//! and everything after CONNACK (`edge/mqtt/connection.rs` on the shard), subscription
//! snapshots or the admin endpoint (the control-plane thread).
//!
//! Runs on a thread of its own (`sluice-listener`, a current-thread runtime started last and
//! joined first by `app/`), so a reconnect storm — sockets that never send CONNECT, logins
//! queueing for password checks — costs this thread and never the control plane's snapshot
//! publication, the admin API or a shard. Each accepted socket gets `connect_timeout` to
//! finish its TLS handshake and WebSocket upgrade and deliver a complete, valid CONNECT (a
//! peer that never finishes a handshake costs only this thread and one `max_connections`
//! slot until then); a refused device gets a CONNACK with the reason and is closed. A TLS
//! listener with `identity_from_cert` admits a device by its certificate's name (CN, else
//! first DNS SAN, else first URI SAN) instead of its CONNECT's username and password.
//!
//! Invariants: the number of open device connections (here and on the shards) is bounded by
//! `max_connections`: beyond it, new sockets are closed at once (counted, logged at most once
//! a second); a connection's count is released here unless a shard took it over. Password
//! checks are bounded by admission (`auth_concurrency` running on this runtime's blocking
//! pool, `auth_queue` waiting, each wait ending at the CONNECT deadline); logins beyond are
//! refused as busy.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use bytestring::ByteString;
use sluice_proto::mqtt::{encode, ConnAck, Decoder, Packet, Properties};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::control::admission::{Admission, Refusal, TransportIdentity};
use crate::control::ControlMetrics;
use crate::edge::mqtt::stream::{self, DeviceReader, DeviceWriter, Link, StreamKind};
use crate::shard::{hash, Adopted, ShardCmd};
use crate::telemetry::metrics::{Counter, PromWriter};

pub struct MqttListener {
    pub admission: Admission,
    pub shards: Vec<mpsc::Sender<ShardCmd>>,
    pub live_connections: Arc<AtomicUsize>,
    pub max_connections: usize,
    pub max_packet_size: usize,
    pub connect_timeout: Duration,
    pub metrics: Arc<ControlMetrics>,
    /// `[limits]` connection rates (`control/limits.rs`).
    pub limits: Arc<crate::control::limits::ConnectLimits>,
}

/// What the connections of one listening socket speak under MQTT.
#[derive(Clone)]
pub enum ListenerKind {
    /// MQTT over TCP, as it always was.
    Plain,
    /// MQTT over TLS.
    Tls(Arc<TlsPolicy>),
    /// MQTT over WebSocket on `path`.
    Ws { path: String },
    /// MQTT over WebSocket over TLS.
    Wss { path: String, tls: Arc<TlsPolicy> },
}

impl ListenerKind {
    pub fn stream_kind(&self) -> StreamKind {
        match self {
            ListenerKind::Plain => StreamKind::Tcp,
            ListenerKind::Tls(_) => StreamKind::Tls,
            ListenerKind::Ws { .. } => StreamKind::Ws,
            ListenerKind::Wss { .. } => StreamKind::Wss,
        }
    }
}

/// `[mqtt.tls]` as the listener applies it (shared by the tls and wss listeners).
pub struct TlsPolicy {
    /// Certificate, key, client CA: a reload replaces it (`app/reload.rs`); each handshake
    /// takes the current one, and a connection keeps the one it started with.
    pub config: arc_swap::ArcSwap<rustls::ServerConfig>,
    /// The certificate names the device (`identity_from_cert`).
    pub identity_from_cert: bool,
}

/// One bound listening socket and what it speaks.
pub struct DeviceListener {
    pub socket: std::net::TcpListener,
    pub kind: ListenerKind,
}

/// Refusals before CONNECT on the TLS and WebSocket listeners, by reason.
#[derive(Debug, Default)]
pub struct ListenerMetrics {
    tls_failures: [Counter; TLS_REASONS.len()],
    ws_failures: [Counter; WS_REASONS.len()],
    /// Devices admitted by their certificate's name (`identity_from_cert`).
    pub cert_identities: Counter,
    /// Devices refused for presenting no certificate where it names them.
    pub cert_missing: Counter,
}

const TLS_REASONS: [&str; 5] = ["timeout", "closed", "certificate", "protocol", "io"];
const WS_REASONS: [&str; 8] = [
    "timeout",
    "closed",
    "too_large",
    "bad_request",
    "not_found",
    "version",
    "subprotocol",
    "io",
];

impl ListenerMetrics {
    fn tls_failed(&self, reason: &str) {
        if let Some(i) = TLS_REASONS.iter().position(|r| *r == reason) {
            self.tls_failures[i].inc();
        }
    }

    fn ws_failed(&self, reason: &str) {
        if let Some(i) = WS_REASONS.iter().position(|r| *r == reason) {
            self.ws_failures[i].inc();
        }
    }

    /// TLS handshakes that failed with `reason` (tests, status).
    pub fn tls_failures(&self, reason: &str) -> u64 {
        TLS_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.tls_failures[i].get())
    }

    pub fn render(&self, w: &mut PromWriter) {
        for (reason, c) in TLS_REASONS.iter().zip(&self.tls_failures) {
            w.counter(
                "sluice_mqtt_tls_handshake_failures_total",
                "TLS handshakes on the MQTT tls/wss listeners that failed, by reason (certificate: a client certificate refused or missing)",
                &[("reason", reason)],
                c.get(),
            );
        }
        for (reason, c) in WS_REASONS.iter().zip(&self.ws_failures) {
            w.counter(
                "sluice_mqtt_ws_upgrade_failures_total",
                "WebSocket upgrades on the MQTT ws/wss listeners refused or abandoned, by reason",
                &[("reason", reason)],
                c.get(),
            );
        }
        w.counter(
            "sluice_mqtt_cert_identities_total",
            "Devices admitted by their client certificate's name (identity_from_cert)",
            &[],
            self.cert_identities.get(),
        );
        w.counter(
            "sluice_mqtt_cert_missing_total",
            "Devices refused (CONNACK not authorized) for presenting no certificate naming them where identity_from_cert is set",
            &[],
            self.cert_missing.get(),
        );
    }
}

/// A connection after its TLS handshake and WebSocket upgrade, before CONNECT.
struct Opened {
    reader: DeviceReader,
    writer: DeviceWriter,
    identity: TransportIdentity,
}

impl MqttListener {
    /// Accept on every listener until `shutdown` turns true. Must run inside a `LocalSet`.
    pub async fn serve(self, listeners: Vec<DeviceListener>, mut shutdown: watch::Receiver<bool>) {
        let this = Rc::new(self);
        let last_refusal_log = Rc::new(Cell::new(None));
        for l in listeners {
            match TcpListener::from_std(l.socket) {
                Ok(socket) => {
                    tokio::task::spawn_local(this.clone().accept_loop(
                        socket,
                        Rc::new(l.kind),
                        last_refusal_log.clone(),
                        shutdown.clone(),
                    ));
                }
                Err(error) => {
                    tracing::error!(%error, kind = l.kind.stream_kind().as_str(), "cannot register a device listener")
                }
            }
        }
        if shutdown.wait_for(|stop| *stop).await.is_err() {
            // The gateway was dropped without `shutdown`: keep accepting, as the shards keep
            // serving.
            std::future::pending::<()>().await;
        }
    }

    /// One listening socket's accept loop (the same for every kind).
    async fn accept_loop(
        self: Rc<Self>,
        listener: TcpListener,
        kind: Rc<ListenerKind>,
        last_refusal_log: Rc<Cell<Option<Instant>>>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        // False once the gateway was dropped without `shutdown`: keep accepting, as the
        // shards keep serving, without polling a closed channel in a loop.
        let mut watching = true;
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                changed = shutdown.changed(), if watching => {
                    if changed.is_err() {
                        watching = false;
                    } else if *shutdown.borrow() {
                        return;
                    }
                    continue;
                }
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(error) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !self.limits.admit_source(peer) {
                continue; // [limits]: over the source's or the gateway's connection rate
            }
            if self.live_connections.fetch_add(1, Ordering::Relaxed) >= self.max_connections {
                self.live_connections.fetch_sub(1, Ordering::Relaxed);
                self.metrics.refused_over_limit.inc();
                if last_refusal_log
                    .get()
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(1))
                {
                    tracing::warn!(%peer, max = self.max_connections, "max_connections reached; refusing new device connections");
                    last_refusal_log.set(Some(Instant::now()));
                }
                drop(stream);
                continue;
            }
            let this = self.clone();
            let kind = kind.clone();
            tokio::task::spawn_local(async move {
                if !this.handshake(stream, peer, &kind).await {
                    this.live_connections.fetch_sub(1, Ordering::Relaxed);
                }
            });
        }
    }

    /// The TLS handshake and WebSocket upgrade of `kind`, by `deadline`. `None`: failed
    /// (counted and logged here).
    async fn open(
        &self,
        tcp: TcpStream,
        peer: std::net::SocketAddr,
        kind: &ListenerKind,
        deadline: tokio::time::Instant,
    ) -> Option<Opened> {
        let metrics = &self.metrics.listeners;
        let (link, identity) = match kind {
            ListenerKind::Plain => {
                let (rd, wr) = tcp.into_split();
                return Some(Opened {
                    reader: DeviceReader::Tcp(rd),
                    writer: DeviceWriter::Tcp(wr),
                    identity: TransportIdentity::Login,
                });
            }
            ListenerKind::Ws { .. } => (Link::Tcp(tcp), TransportIdentity::Login),
            ListenerKind::Tls(policy) | ListenerKind::Wss { tls: policy, .. } => {
                match stream::tls::handshake(tcp, policy.config.load_full(), deadline).await {
                    Ok(core) => {
                        let identity = if !policy.identity_from_cert {
                            TransportIdentity::Login
                        } else {
                            match core.identity() {
                                Some(name) => {
                                    TransportIdentity::Certificate(ByteString::from(name))
                                }
                                None => TransportIdentity::MissingCertificate,
                            }
                        };
                        (Link::Tls(core), identity)
                    }
                    Err(error) => {
                        metrics.tls_failed(error.reason());
                        self.metrics.handshake_failures.inc();
                        self.log_refusal(peer, "TLS handshake failed; closing", &error);
                        return None;
                    }
                }
            }
        };
        let path = match kind {
            ListenerKind::Ws { path } | ListenerKind::Wss { path, .. } => path,
            _ => {
                let Link::Tls(core) = link else {
                    return None; // Invariant: only the TLS kind gets here.
                };
                let core = Rc::new(core);
                return Some(Opened {
                    reader: DeviceReader::Tls(core.clone()),
                    writer: DeviceWriter::Tls(core),
                    identity,
                });
            }
        };
        match stream::ws::upgrade(link, path, self.max_packet_size as u64, deadline).await {
            Ok(core) => {
                let core = Rc::new(core);
                Some(Opened {
                    reader: DeviceReader::Ws(core.clone()),
                    writer: DeviceWriter::Ws(core),
                    identity,
                })
            }
            Err(error) => {
                metrics.ws_failed(error.reason());
                self.metrics.handshake_failures.inc();
                self.log_refusal(peer, "WebSocket upgrade refused; closing", &error);
                None
            }
        }
    }

    /// A refusal before CONNECT: logged at most once a second (a scanner or a storm of bad
    /// handshakes must not flood the log); counted by the caller.
    fn log_refusal(
        &self,
        peer: std::net::SocketAddr,
        what: &'static str,
        error: &dyn std::fmt::Display,
    ) {
        thread_local! {
            static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
        }
        let due = LAST.with(|last| {
            let due = last
                .get()
                .is_none_or(|t| t.elapsed() > Duration::from_secs(1));
            if due {
                last.set(Some(Instant::now()));
            }
            due
        });
        if due {
            tracing::info!(%peer, %error, "{}", what);
        }
    }

    /// Returns true when the connection was handed to a shard (which then owns the count).
    async fn handshake(
        &self,
        stream: TcpStream,
        peer: std::net::SocketAddr,
        kind: &ListenerKind,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + self.connect_timeout;
        let Some(Opened {
            reader: mut rd,
            writer: mut wr,
            identity,
        }) = self.open(stream, peer, kind, deadline).await
        else {
            return false;
        };
        let mut buf = BytesMut::with_capacity(512);
        let mut decoder = Decoder::server(self.max_packet_size);
        let connect = loop {
            match decoder.decode(&mut buf) {
                Ok(Some(Packet::Connect(c))) => break c,
                Ok(Some(other)) => {
                    tracing::warn!(%peer, packet = other.name(), "first packet was not CONNECT; closing");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%peer, %error, "bad CONNECT; closing");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
            }
            match tokio::time::timeout_at(deadline, rd.read_buf(&mut buf)).await {
                Ok(Ok(0)) => {
                    self.metrics.handshake_failures.inc();
                    return false;
                }
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "read failed before CONNECT");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
                Err(_) => {
                    tracing::info!(%peer, timeout_s = self.connect_timeout.as_secs_f32(), "no CONNECT in time; closing");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
            }
        };
        let mut connect = connect;
        let version = connect.protocol;
        let from_cert = matches!(identity, TransportIdentity::Certificate(_));
        if matches!(identity, TransportIdentity::MissingCertificate) {
            self.metrics.listeners.cert_missing.inc();
        }
        let assigned = match self
            .admission
            .admit_as(&mut connect, identity, deadline, &self.metrics.admission)
            .await
        {
            Ok(assigned) => assigned,
            Err(refusal) => {
                // Busy and flapping refusals come in storms; they are logged at most once a
                // second where they are decided.
                if !matches!(refusal, Refusal::Busy | Refusal::ConnectRate) {
                    tracing::info!(%peer, client_id = %connect.client_id, reason = %refusal, "device refused");
                }
                self.metrics.rejected.inc();
                let mut out = BytesMut::new();
                let ack = ConnAck {
                    session_present: false,
                    code: refusal.connack_code(version),
                    properties: Properties::default(),
                };
                if encode(&Packet::ConnAck(ack), version, &mut out).is_ok() {
                    let _ = tokio::time::timeout(Duration::from_secs(1), wr.write_all(&out)).await;
                }
                let _ = wr.shutdown().await;
                return false;
            }
        };
        self.metrics.admitted.inc();
        if from_cert {
            self.metrics.listeners.cert_identities.inc();
        }
        let shard = hash::shard_for(connect.client_id.as_bytes(), None, self.shards.len());
        let detached = match rd.detach(wr) {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%peer, %error, "cannot detach device socket for its shard");
                return false;
            }
        };
        let adopted = Adopted {
            stream: detached,
            peer,
            username: connect.username.clone(),
            username_from_cert: from_cert,
            connect,
            buffered: buf,
            assigned_client_id: assigned,
        };
        if self.shards[shard]
            .send(ShardCmd::Adopt(Box::new(adopted)))
            .await
            .is_err()
        {
            tracing::warn!(shard, "shard is gone; dropping device connection");
            return false;
        }
        true
    }
}
