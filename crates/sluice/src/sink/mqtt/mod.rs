//! The MQTT transport: one MQTT client connection per (shard, uplink, lane) to a cloud broker,
//! the first [`Transport`] behind an [`Outbox`].
//!
//! Owns: connecting (TCP with the lane's socket marks, TLS 1.3, CONNECT/CONNACK), the link's
//! limits (window = `min(inflight, broker Receive Maximum)` capped at 65534 so a SUBSCRIBE
//! always finds a free packet id; the broker's Maximum Packet Size; Retain Available; Server
//! Keep Alive), encoding a PUBLISH per message (topic mapped by [`UplinkRoute`], DUP on a
//! resend, retain only where available, bigger than the broker's Maximum Packet Size →
//! [`Unsendable`]) or per SenML pack (the aggregate topic, MQTT 5 content type), turning
//! PUBACKs into [`Feedback`] ([`classify_refusal`]), keep-alive, the downlink, DISCONNECT at
//! shutdown, and reporting the high lane's source port. Does not own: any queueing,
//! packing, ordering, windowing, retry or spool logic (the outbox's).
//!
//! Cluster (`urls`): each attempt connects to one node, shard `i` first to node `i mod n`,
//! then the node after the previous attempt's, whether that attempt failed or its link
//! dropped (`failover.rs`); the outbox resends what was unacknowledged, as after any
//! reconnect, and the host name is resolved again on every attempt.
//!
//! Per connection: TCP (`connect_timeout` covers TCP, TLS and CONNACK) → TLS 1.3 → CONNECT
//! (client id `"{client_id}-{shard}"`; clean, except the downlink session: shard 0's normal
//! lane when `receive` is set, persistent) → CONNACK → for the downlink session, SUBSCRIBE
//! `receive` filters (QoS 1) unless the broker kept the session (MQTT 5: always, with Retain
//! Handling 1 when it did). Downlink PUBLISHes are delivered in arrival order by
//! [`Transport::settle`] and a QoS 1 one is PUBACKed only once delivery was accepted.
//!
//! # Downlink
//! One session per uplink subscribes to the `receive` filters: shard 0's normal lane. It is
//! persistent — stable client id `"{client_id}-0"`, `clean_start = false` with a Session
//! Expiry Interval of `downlink_session_expiry` (MQTT 5) or clean session = 0 (3.1.1) — so the
//! broker keeps the subscription and the QoS 1 commands published while the gateway is away.
//! It subscribes again whenever the CONNACK says the session was not present (MQTT 5 also
//! re-subscribes with Retain Handling 1 when it was, so changed filters take effect). A
//! reload that changes `receive` (the shared [`UplinkRoute`]) is followed on the running
//! connection: UNSUBSCRIBE for the filters that went, SUBSCRIBE for the new ones, one change
//! at a time ([`Transport::follow_route`]); what a kept session still holds from before is
//! unsubscribed at reconnect. Every
//! other session starts clean and subscribes to nothing, so each command crosses the WAN
//! once. A QoS 1 command is acknowledged to the cloud only after the [`crate::sink::Downlink`]
//! future resolved (the shard accepted it for every local subscriber, see `shard::router`);
//! at-least-once: a command delivered just before a connection loss comes again.
//!
//! # Refusal codes
//! PUBACK 0x97 Quota exceeded and 0x91 Packet identifier in use are temporary; 0x80/0x83 are
//! unclear (temporary until they persist, see the outbox); 0x87, 0x90, 0x99 and the rest are
//! permanent, and the code reaches an MQTT 5 device in its PUBACK (3.1.1: an ordinary PUBACK).
//!
//! Keep-alive: PINGREQ when nothing was written *or* nothing was read for `keep_alive` (the
//! broker's Server Keep Alive wins in MQTT 5); the connection is dead when nothing was read for
//! 1.5 × `keep_alive`. Writes that stall for that long (at least 5 s) also end the connection.
//!
//! Sizes: we accept packets up to [`MAX_INCOMING_PACKET_BYTES`] and (MQTT 5) tell the broker so,
//! together with a Receive Maximum of [`DOWNLINK_RECEIVE_MAXIMUM`]; we request no topic aliases.
//! In MQTT 5 the downlink subscription sets No Local, so messages the downlink session itself
//! publishes are not echoed back when `forward` and `receive` overlap; those other shards'
//! sessions publish are (different client ids), so with several shards keep the two apart.
//!
//! Invariant: a packet id handed out as a [`crate::sink::transport::SendId`] is not reused until its PUBACK came or
//! the connection ended.

mod failover;
mod link;
pub mod route;
pub mod socket;
pub mod tc;
pub mod tls;
mod wire;

use std::collections::{HashSet, VecDeque};
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use bytes::BytesMut;
use bytestring::ByteString;
use sluice_proto::mqtt::{Packet, ProtocolVersion, Publish};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

use crate::config::{MqttProtocol, UplinkConfig};
use crate::sink::outbox::{Feeders, Outbox, OutboxSeed};
use crate::sink::transport::{Feedback, Transport, Unsendable};
use crate::sink::{Lane, UplinkMetrics, UplinkQueue, UplinkRoute};

pub use link::classify_refusal;
pub(crate) use link::tls_error;

/// Largest packet accepted from the cloud broker (MQTT 5: sent as Maximum Packet Size).
pub const MAX_INCOMING_PACKET_BYTES: usize = 1024 * 1024;
/// MQTT 5 Receive Maximum we announce: downlink QoS 1 messages unacknowledged at once.
pub const DOWNLINK_RECEIVE_MAXIMUM: u16 = 64;

/// Everything one uplink lane's outbox and its MQTT transport need.
pub struct SessionSeed {
    pub shard: usize,
    pub lane: Lane,
    pub cfg: Rc<UplinkConfig>,
    /// Must be `Some` when `cfg.url.tls` (see [`crate::sink::client_tls_config`]).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub queue: Rc<UplinkQueue>,
    /// Called on the shard thread with every PUBLISH the cloud sends (topic unchanged); a
    /// QoS 1 one is acknowledged to the cloud once the returned future resolved. Only shard
    /// 0's normal lane subscribes to `receive` (see the module docs of `sink`).
    pub downlink: crate::sink::Downlink,
    pub metrics: Arc<UplinkMetrics>,
    /// Devices connected to the whole gateway (decides whether the normal lane aggregates).
    pub live_devices: Arc<AtomicUsize>,
    /// Observes the high lane's source port (for `install_tc`): `Some(port)` on connect,
    /// `None` when the connection ends.
    pub on_port: Option<Box<dyn Fn(Option<u16>)>>,
    /// Spools feeding `queue` (drain share, link-state hooks); empty without a spool.
    pub feeders: Feeders,
    /// Link state of the watched interfaces (`[multipath]`, paths' interfaces); `None`
    /// when no watcher runs.
    pub links: Option<crate::net::links::LinkWatch>,
    /// `Some` for a function's sink (`crate::sink::http`).
    pub function: Option<crate::sink::http::FunctionSeed>,
    /// The uplink's forward filters and topic mapping, shared with its sink on every shard
    /// and replaced by a reload (`UplinkRoute::replace`).
    pub route: UplinkRoute,
}

/// Start the outbox of one uplink lane on this shard, with an MQTT transport. Must be called
/// inside a `LocalSet`. The task runs until `shutdown` becomes `true` (or its sender is
/// dropped); it then sends DISCONNECT if connected, leaves unacknowledged messages in the
/// queue and returns.
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
        feeders,
        links: _,
        function: _,
        route,
    } = seed;
    let transport = MqttTransport::new(shard, lane, cfg.clone(), tls, downlink, metrics.clone())
        .with_port_observer(on_port)
        .with_route(route.clone());
    let outbox = Outbox::new(
        OutboxSeed {
            shard,
            lane,
            cfg,
            queue,
            metrics,
            live_devices,
            feeders,
        },
        transport,
    )
    .with_route(route);
    tokio::task::spawn_local(outbox.run(shutdown))
}

/// An MQTT client link to a cloud broker (see the module docs).
pub struct MqttTransport {
    shard: usize,
    lane: Lane,
    cfg: Rc<UplinkConfig>,
    tls: Option<TlsConnector>,
    version: ProtocolVersion,
    client_id: ByteString,
    route: UplinkRoute,
    downlink: crate::sink::Downlink,
    metrics: Arc<UplinkMetrics>,
    on_port: Option<Box<dyn Fn(Option<u16>)>>,
    /// The current connection, after a successful CONNACK.
    conn: Option<link::Connection>,
    /// The pending batch: encoded packets not yet written.
    out: BytesMut,
    /// Packet ids of QoS 1 PUBLISHes written on this connection and not yet answered.
    ids: HashSet<u16, crate::sink::transport::BuildIdHasher>,
    /// What one read decoded (kept: its room is reused by the next read).
    packets: Vec<Packet>,
    next_packet_id: u16,
    pending_subscribe: Option<u16>,
    /// The filters of the pending SUBSCRIBE (named when the broker refuses one).
    pending_filters: Vec<String>,
    pending_unsubscribe: Option<u16>,
    /// The `receive` filters this session asked the broker for (kept across reconnects: a
    /// persistent session holds them), and the route generation they were taken from.
    subscribed: Vec<String>,
    receive_seen: u64,
    /// Cloud PUBLISHes decoded and not yet delivered (at most what one read decodes: the
    /// broker sends no more than our Receive Maximum of QoS 1 ones unacknowledged).
    downlink_pending: VecDeque<Publish>,
    /// How the socket is opened (MPTCP, source address, interface).
    dial: crate::net::dial::Dial,
    /// This session never subscribes to the downlink (a path other than the first).
    no_downlink: bool,
    /// The current connection's key in `metrics.mptcp` (0: none kept).
    mptcp_key: u64,
    /// Which node of `urls` the next attempt takes (`failover.rs`).
    nodes: failover::NodeCursor,
}

impl MqttTransport {
    /// A transport for one lane of uplink `cfg` on `shard` (not connected yet). `tls` must be
    /// `Some` when `cfg.url.tls`.
    pub fn new(
        shard: usize,
        lane: Lane,
        cfg: Rc<UplinkConfig>,
        tls: Option<Arc<rustls::ClientConfig>>,
        downlink: crate::sink::Downlink,
        metrics: Arc<UplinkMetrics>,
    ) -> MqttTransport {
        let version = match cfg.protocol {
            MqttProtocol::V311 => ProtocolVersion::V311,
            // A oneM2M or Kafka uplink never builds an MQTT transport (`sink::spawn`).
            MqttProtocol::V5 | MqttProtocol::OneM2m | MqttProtocol::Kafka => ProtocolVersion::V5,
        };
        let client_id = match lane {
            Lane::Normal => cfg.session_client_id(shard),
            Lane::High => cfg.high_session_client_id(shard),
        };
        let cfg_mptcp = cfg.mptcp;
        MqttTransport {
            shard,
            lane,
            client_id: ByteString::from(client_id),
            route: UplinkRoute::new(&cfg),
            tls: tls.map(TlsConnector::from),
            version,
            cfg,
            downlink,
            metrics,
            on_port: None,
            conn: None,
            out: BytesMut::with_capacity(crate::sink::outbox::MAX_BATCH_BYTES + 1024),
            ids: HashSet::default(),
            packets: Vec::new(),
            next_packet_id: 1,
            pending_subscribe: None,
            pending_filters: Vec::new(),
            pending_unsubscribe: None,
            subscribed: Vec::new(),
            receive_seen: 0,
            downlink_pending: VecDeque::new(),
            dial: crate::net::dial::Dial {
                mptcp: cfg_mptcp,
                ..Default::default()
            },
            no_downlink: false,
            mptcp_key: 0,
            nodes: failover::NodeCursor::new(shard),
        }
    }

    /// Make this transport one path of a multipath uplink: its own client id, its socket
    /// dialled as `dial`, and the downlink subscription only when `downlink` (one path of
    /// shard 0's normal lane holds it).
    pub fn for_path(
        mut self,
        client_id: String,
        dial: crate::net::dial::Dial,
        downlink: bool,
    ) -> Self {
        self.client_id = ByteString::from(client_id);
        self.dial = dial;
        self.no_downlink = !downlink;
        self
    }

    /// When the current connection last read anything from the broker (`None`: not
    /// connected).
    pub fn last_heard(&self) -> Option<std::time::Instant> {
        self.conn.as_ref().map(|c| c.last_read)
    }

    /// Whether a PINGREQ is unanswered on the current connection.
    pub fn ping_outstanding(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.ping_outstanding)
    }

    /// Whether a connection is established.
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Report the connection's local port to `on_port` (`Some(port)` on connect, `None` when
    /// it ends): the high lane's source ports for `install_tc`.
    pub fn with_port_observer(mut self, on_port: Option<Box<dyn Fn(Option<u16>)>>) -> Self {
        self.on_port = on_port;
        self
    }

    /// Name messages by `route`, the uplink's shared route (which a reload replaces), instead
    /// of this transport's own copy of its configuration's.
    pub fn with_route(mut self, route: UplinkRoute) -> Self {
        self.route = route;
        self
    }

    /// Whether this link holds the uplink's one downlink subscription: shard 0's normal
    /// lane, when `receive` has filters.
    fn subscribes_downlink(&self) -> bool {
        self.holds_downlink() && self.route.receives()
    }

    /// Whether this link is the one that would hold the downlink subscription.
    fn holds_downlink(&self) -> bool {
        self.shard == 0 && self.lane == Lane::Normal && !self.no_downlink
    }

    /// A packet id not in use. Terminates: the outbox keeps at most the window (≤ 65534)
    /// unanswered, plus one SUBSCRIBE.
    fn alloc_packet_id(&mut self) -> u16 {
        loop {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.ids.contains(&id)
                && self.pending_subscribe != Some(id)
                && self.pending_unsubscribe != Some(id)
            {
                return id;
            }
        }
    }
}

impl Transport for MqttTransport {
    async fn connect(
        &mut self,
    ) -> Result<crate::sink::transport::LinkLimits, crate::sink::UplinkError> {
        self.open().await
    }

    fn encode(
        &mut self,
        unit: crate::sink::transport::Unit<'_>,
    ) -> Result<Option<crate::sink::transport::SendId>, Unsendable> {
        self.encode_publish(unit)
    }

    fn pending_bytes(&self) -> usize {
        self.out.len()
    }

    async fn flush(&mut self) -> Result<(), crate::sink::UplinkError> {
        self.write_out().await
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), crate::sink::UplinkError> {
        self.read_some(feedback).await
    }

    fn follow_route(&mut self) -> Result<(), crate::sink::UplinkError> {
        self.follow_receive()
    }

    async fn settle(&mut self) -> Result<(), crate::sink::UplinkError> {
        self.deliver_downlinks().await
    }

    async fn close(&mut self) {
        self.disconnect().await
    }

    fn abort(&mut self) {
        self.metrics
            .mptcp
            .on_close(std::mem::take(&mut self.mptcp_key));
        if self.conn.take().is_some() {
            if let Some(f) = &self.on_port {
                f(None);
            }
        }
        self.out.clear();
        self.ids.clear();
        self.pending_subscribe = None;
        self.pending_unsubscribe = None;
    }
}
