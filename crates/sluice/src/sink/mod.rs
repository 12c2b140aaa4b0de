//! Sinks: where device messages leave the gateway. A sink is a generic outbox
//! ([`outbox::Outbox`]: bounded queue, spool or not, live/backlog policy, optional SenML
//! aggregation, per-device order, inflight window, retry) in front of a
//! [`transport::Transport`]; the MQTT uplink ([`mqtt`]: one MQTT client session per (shard,
//! uplink, lane) to a cloud broker, over TLS 1.3, QoS 1) is the first transport.
//!
//! Owns: a sink as the router sees it ([`Sink`]: its `forward` filters, its lanes, its
//! spool; [`Sink::offer`] takes a device message when the filters match and pushes an
//! [`UplinkMessage`] holding a share of the device's [`AckToken`]), the message on its way
//! out ([`UplinkMessage`]), lanes, the uplink errors with who is to blame ([`UplinkError`]),
//! the uplink metrics ([`UplinkMetrics`]), and the public entry point the shard uses
//! ([`spawn`] with a [`SessionSeed`]). Does not own: the router, which asks every sink
//! (`crate::shard::router`), acknowledging devices (the device connection
//! drains its `DeviceAcks`), what is done with a downlink message (the `downlink`
//! callback), or config parsing and validation (`config/`). The queueing, ordering, window
//! and retry rules are documented in [`outbox`]; connecting, keep-alive and the downlink in
//! [`mqtt`]; the contract between the two in [`transport`].
//!
//! Everything here runs on one shard thread inside a `LocalSet` (`Rc`, `RefCell`,
//! `spawn_local`, no locks); shards share nothing, so every shard has its own cloud session
//! with client id `"{client_id}-{shard}"`.
//!
//! # Path of one message
//! router → [`Sink::offer`] → `UplinkQueue::push` (reserves bytes; waits while the queue is full, which
//! stops the device connection reading its socket) → the outbox takes it when the inflight
//! window has room and has the transport encode it with others into one write → the far end's
//! ack → bytes released → [`UplinkMessage::complete_with`] (the device gets its PUBACK once
//! every uplink completed).
//!
//! With a spool (`crate::sink::spool`), the normal lane's queue is filled by the spool's feeder
//! instead of the device connections: committed records, in two streams (live and backlog,
//! see `UplinkQueue::take_next`), each carrying where it is stored ([`spool::Stored`]) and,
//! under `ack = "cloud"`, its device's token. Finishing the message
//! ([`UplinkMessage::complete_with`]) acknowledges the record in its spool and then completes
//! the device token: one way, transport → outbox → token → edge. The outbox is told its
//! feeders when it is built ([`outbox::Feeders`]): it tells them when its connection comes up
//! or ends, and lets the backlog use at most the configured drain share of its inflight
//! window while live messages wait.
//!
//! # Invariants
//! - **Bounded memory.** A message's bytes (topic + payload + [`MESSAGE_OVERHEAD_BYTES`]) are
//!   reserved when it is pushed and released only when it is finished: cloud PUBACK (QoS 1),
//!   written to the socket (QoS 0), or dropped with a counted reason. So `capacity_bytes` covers
//!   queued *and* inflight messages. Overflow policy: QoS 1 back-pressures the device
//!   ([`UplinkQueue::push`] waits); QoS 0 is dropped by the caller on [`UplinkQueue::try_push`]
//!   failure (reason `uplink_queue_full`). One message larger than the capacity is admitted
//!   when nothing else is held, so a big message can never wedge a device.
//! - **Ack after cloud ack**, with three counted exceptions where resending can never help:
//!   `too_large_for_cloud`, `invalid_for_cloud` (completed with 0x83) and `cloud_rejected`
//!   (completed with the cloud's code, which an MQTT 5 device gets in its PUBACK). QoS 0
//!   messages in a write that fails are lost (`connection_lost`), as QoS 0 allows.
//! - Network input never panics the process; a protocol error closes only this session.

mod handle;
pub mod http;
pub mod kafka;
mod metrics;
pub mod mqtt;
pub mod onem2m;
pub mod outbox;
pub mod paths;
pub mod spool;
pub mod transport;

pub use handle::{Offer, OfferCounters, OfferDrop, Sink};
pub use metrics::{DropReason, RejectReason, UplinkMetrics, UplinkState};
pub use mqtt::route::UplinkRoute;
pub use mqtt::tls::{
    client_tls_config, reloadable_client_tls, ClientTlsParts, ReloadableClientTls,
};
pub use mqtt::SessionSeed;
pub use mqtt::{socket, tc};
pub use outbox::pack::records_of;
pub use outbox::queue::{UplinkQueue, MESSAGE_OVERHEAD_BYTES};

/// Start the outbox of one uplink lane on this shard: over one MQTT session, with `paths`
/// over one session per path (`paths`), or for `protocol = "onem2m"` over a pool of HTTP
/// connections to a oneM2M CSE (`onem2m`). Must be called inside a `LocalSet`.
pub fn spawn(
    seed: SessionSeed,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    if seed.function.is_some() {
        http::spawn(seed, shutdown)
    } else if seed.cfg.is_onem2m() {
        onem2m::spawn(seed, shutdown)
    } else if seed.cfg.is_kafka() {
        kafka::spawn(seed, shutdown)
    } else if seed.cfg.paths.is_empty() {
        mqtt::spawn(seed, shutdown)
    } else {
        paths::spawn(seed, shutdown)
    }
}

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::QoS;

use crate::message::ack::AckToken;

/// A downlink delivery under way: resolves once the message was accepted locally (see
/// [`Downlink`]).
pub type DownlinkDelivery = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

/// One message from a far end for the local subscribers (the cloud's command), in no
/// transport's shape: what a transport hands the shard's router.
#[derive(Debug, Clone)]
pub struct CloudMessage {
    /// The topic as the far end sent it (unchanged).
    pub topic: ByteString,
    pub payload: Bytes,
    /// The guarantee it came with (local subscribers get at most this).
    pub qos: QoS,
    /// MQTT 5 application properties it carried, if any.
    pub properties: Option<Box<sluice_proto::mqtt::Properties>>,
}

/// What a transport does with each message from the far end: deliver it to the local
/// subscribers. The transport acknowledges it to the far end (MQTT: PUBACK) only after the
/// returned future resolved.
pub type Downlink = std::rc::Rc<dyn Fn(CloudMessage) -> DownlinkDelivery>;

/// Which of a shard's two sessions to an uplink carries a message (SegaNet §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Everything not urgent; aggregated into SenML packs when many devices are connected.
    Normal,
    /// Priority-1 records: own queue, own session, marked socket, never aggregated.
    High,
}

impl Lane {
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Normal => "normal",
            Lane::High => "high",
        }
    }
}

/// The metrics of one uplink's lanes on one shard.
#[derive(Debug, Clone)]
pub struct LaneMetrics {
    pub normal: std::sync::Arc<UplinkMetrics>,
    /// `Some` when the gateway runs a high lane.
    pub high: Option<std::sync::Arc<UplinkMetrics>>,
}

impl LaneMetrics {
    pub fn new(high_lane: bool) -> LaneMetrics {
        LaneMetrics {
            normal: Default::default(),
            high: high_lane.then(Default::default),
        }
    }

    /// Each lane with its metrics, normal first.
    pub fn iter(&self) -> impl Iterator<Item = (Lane, &std::sync::Arc<UplinkMetrics>)> {
        std::iter::once((Lane::Normal, &self.normal))
            .chain(self.high.iter().map(|m| (Lane::High, m)))
    }
}

/// Where high-lane sessions report their source ports (for `install_tc`'s port filters);
/// reporting never blocks a shard (the tc thread does the work).
#[derive(Debug, Clone)]
pub struct PortSink(std::sync::Arc<tc::TcManager>);

impl PortSink {
    pub fn new(manager: std::sync::Arc<tc::TcManager>) -> PortSink {
        PortSink(manager)
    }
    pub fn port_up(&self, port: u16) {
        self.0.high_port_up(port);
    }
    pub fn port_down(&self, port: u16) {
        self.0.high_port_down(port);
    }
}

/// One message on its way to the cloud.
#[derive(Debug)]
pub struct UplinkMessage {
    /// The device's client id (for `{device}` in topic templates).
    pub device: ByteString,
    /// The local topic.
    pub topic: ByteString,
    pub payload: Bytes,
    /// `AtMostOnce` or `AtLeastOnce` (`ExactlyOnce` is sent as `AtLeastOnce`).
    pub qos: QoS,
    pub retain: bool,
    /// When the gateway read it from the device (start of the ack-latency histogram).
    pub received_at: Instant,
    /// The device's token, completed when the message is finished (see the module
    /// invariants): `Some` for QoS ≥ 1 from a device, or for a spool record under
    /// `ack = "cloud"`; `None` otherwise.
    pub ack: Option<AckToken>,
    /// The MQTT 5 Content Type the device gave (a function's event carries it); `None` for
    /// other devices and for spool records (the spool does not store properties).
    pub content_type: Option<ByteString>,
    /// The MQTT 5 User Properties the device gave, in order (the Kafka uplink makes them
    /// record headers); `None` when it gave none, and for spool records (as `content_type`).
    pub user_properties: Option<std::sync::Arc<[(ByteString, ByteString)]>>,
    /// `Some` for a record read from a spool: acknowledged there when the message is
    /// finished, before `ack`. Dropping the message unfinished acknowledges nothing (the
    /// record is sent again after a restart).
    pub stored: Option<spool::Stored>,
}

impl UplinkMessage {
    /// Bytes this message holds in an [`UplinkQueue`] from push until it is finished.
    pub fn cost(&self) -> usize {
        let props = self
            .user_properties
            .as_deref()
            .map_or(0, |p| p.iter().map(|(k, v)| k.len() + v.len() + 32).sum());
        self.topic.len() + self.payload.len() + props + MESSAGE_OVERHEAD_BYTES
    }

    /// The flow whose order this message keeps: its device.
    pub fn flow(&self) -> transport::Flow {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.device.as_bytes().hash(&mut h);
        transport::Flow::Device(h.finish())
    }

    /// Whether the cloud must acknowledge it (QoS ≥ 1 towards the cloud).
    pub fn needs_cloud_ack(&self) -> bool {
        self.qos != QoS::AtMostOnce
    }

    /// Whether it belongs to the backlog stream (a spool record from before the link's last
    /// connect; see `outbox::queue`).
    pub fn is_backlog(&self) -> bool {
        self.stored.as_ref().is_some_and(spool::Stored::is_backlog)
    }

    /// The message is done, with `code` for the device (0: success; see
    /// [`AckToken::complete_with`]). The one place a finished message's acknowledgement
    /// starts: its spool record first (trimmed by a later commit), then the device token.
    /// The caller has already released its queue bytes.
    pub fn complete_with(self, code: u8) {
        if let Some(stored) = self.stored {
            stored.acknowledge();
        }
        if let Some(token) = self.ack {
            token.complete_with(code);
        }
    }
}

impl UplinkMessage {
    /// Its uplink was removed by a reload before it was sent (ADR 0013): a spool record
    /// stays unacknowledged (kept on disk, sent again if the uplink comes back), the device
    /// token is completed with 0x10 ("no matching subscribers": accepted, not forwarded
    /// there). The caller has already released its queue bytes and counted it.
    pub fn complete_removed(self) {
        drop(self.stored);
        if let Some(token) = self.ack {
            token.complete_with(REMOVED_REASON);
        }
    }
}

/// The PUBACK reason a device gets for a message whose uplink a reload removed before it
/// was sent (MQTT 5 "No matching subscribers"; a 3.1.1 device gets a plain PUBACK).
pub const REMOVED_REASON: u8 = 0x10;

/// Who is to blame for an [`UplinkError`] (for the log line and for whoever reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The cloud broker or the network to it; retrying can help.
    Cloud,
    /// Our own configuration or files; retrying helps only once they are fixed.
    Local,
}

impl Blame {
    pub fn as_str(self) -> &'static str {
        match self {
            Blame::Cloud => "cloud",
            Blame::Local => "local",
        }
    }
}

/// What failed in the uplink.
#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    // --- start-up (TLS files) ---
    #[error("cannot read {what} file {path}: {source}")]
    ReadFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} file {path} contains no PEM certificate")]
    NoCertificates { what: &'static str, path: PathBuf },
    #[error("key file {path} contains no PEM private key (PKCS#8, PKCS#1 or SEC1)")]
    NoPrivateKey { path: PathBuf },
    #[error("CA certificate in {path} was rejected: {source}")]
    BadCaCertificate {
        path: PathBuf,
        #[source]
        source: Box<rustls::Error>,
    },
    #[error("no CA certificates: ca_file is not set and no system bundle was found (tried SSL_CERT_FILE and {tried})")]
    NoSystemRoots { tried: &'static str },
    #[error("cert_file and key_file must be set together (got only {given})")]
    HalfClientIdentity { given: &'static str },
    #[error("client certificate {cert} or key {key} was rejected: {source}")]
    BadClientIdentity {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: Box<rustls::Error>,
    },
    #[error("TLS configuration: {0}")]
    TlsConfig(#[source] Box<rustls::Error>),
    #[error("uplink url asks for TLS but no TLS client configuration was given")]
    TlsConfigMissing,
    #[error("uplink url is plaintext but allow_plaintext is false")]
    PlaintextNotAllowed,
    #[error("invalid TLS server name {0:?}")]
    InvalidServerName(String),

    // --- connecting ---
    #[error("cloud broker {addr} unreachable: {source}")]
    CloudUnreachable {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("TLS handshake with the cloud broker failed: {0}")]
    TlsHandshake(#[source] std::io::Error),
    #[error("cloud broker's certificate is not trusted: {0} (is it signed by a CA in ca_file, and valid for server_name?)")]
    UntrustedCloudCertificate(String),
    #[error("cloud broker ended TLS with alert {0} (does it require a client certificate, or reject ours?)")]
    TlsRejectedByCloud(String),
    #[error("cloud broker refused CONNECT: code {code:#04x} ({reason})")]
    ConnectRefused { code: u8, reason: &'static str },
    #[error("cloud broker supports only QoS 0 (CONNACK Maximum QoS 0)")]
    CloudQoS0Only,

    // --- connected ---
    #[error("protocol error from the cloud broker: {0}")]
    Protocol(String),
    #[error("cloud broker sent undecodable bytes: {0}")]
    Decode(#[from] sluice_proto::mqtt::DecodeError),
    #[error("encoding a packet failed: {0}")]
    Encode(#[from] sluice_proto::mqtt::EncodeError),
    #[error("connection to the cloud broker lost: {0}")]
    ConnectionLost(#[source] std::io::Error),
    #[error("cloud broker closed the connection")]
    ClosedByCloud,
    #[error("cloud broker sent DISCONNECT with reason {0:#04x}")]
    DisconnectedByCloud(u8),
    #[error("no packet from the cloud broker for {0:?} (keep-alive)")]
    KeepAliveTimeout(Duration),
    #[error("write to the cloud broker stalled for {0:?}")]
    WriteTimeout(Duration),
    #[error("every path to the cloud broker is down (last error: {0})")]
    AllPathsDown(String),

    // --- oneM2M (`onem2m/`) ---
    #[error("the oneM2M CSE refused the AE registration: HTTP {status}, RSC {rsc} (4105: the AE name is taken by another originator; 4126: the originator may not register; check originator and ae_name)")]
    AeRegistration { status: u16, rsc: u32 },
    #[error("the oneM2M CSE sent a malformed HTTP response: {0}")]
    Http(#[from] onem2m::http::HttpError),
    #[error("no response from the oneM2M CSE for {0:?}")]
    ResponseTimeout(Duration),

    // --- Kafka (`kafka/`) ---
    #[error("SASL authentication with the Kafka broker failed: {0} (check username, password_file and sasl_mechanism)")]
    SaslFailed(String),
}

impl UplinkError {
    /// Who is to blame: the cloud side (retrying can help) or our own configuration.
    pub fn blame(&self) -> Blame {
        use UplinkError::*;
        match self {
            ReadFile { .. }
            | NoCertificates { .. }
            | NoPrivateKey { .. }
            | BadCaCertificate { .. }
            | NoSystemRoots { .. }
            | HalfClientIdentity { .. }
            | BadClientIdentity { .. }
            | TlsConfig(_)
            | TlsConfigMissing
            | PlaintextNotAllowed
            | InvalidServerName(_)
            | Encode(_) => Blame::Local,
            // A CSE refusing our registration for a 4xxx reason refuses our configuration.
            AeRegistration { rsc, .. } if (4000..5000).contains(rsc) => Blame::Local,
            // A refused CONNECT for bad credentials is arguably ours, but only the cloud knows.
            CloudUnreachable { .. }
            | ConnectTimeout(_)
            | TlsHandshake(_)
            | UntrustedCloudCertificate(_)
            | TlsRejectedByCloud(_)
            | ConnectRefused { .. }
            | CloudQoS0Only
            | Protocol(_)
            | Decode(_)
            | ConnectionLost(_)
            | ClosedByCloud
            | DisconnectedByCloud(_)
            | KeepAliveTimeout(_)
            | WriteTimeout(_)
            | AllPathsDown(_)
            | AeRegistration { .. }
            | Http(_)
            | ResponseTimeout(_)
            | SaslFailed(_) => Blame::Cloud,
        }
    }
}

/// Reason text for a CONNACK code (3.1.1 return codes or MQTT 5 reason codes).
pub(crate) fn connack_reason(
    version: sluice_proto::mqtt::ProtocolVersion,
    code: u8,
) -> &'static str {
    use sluice_proto::mqtt::{reason::*, ProtocolVersion};
    match version {
        ProtocolVersion::V311 => match code {
            V3_UNACCEPTABLE_PROTOCOL_VERSION => "unacceptable protocol version",
            V3_IDENTIFIER_REJECTED => "client identifier rejected",
            V3_SERVER_UNAVAILABLE => "server unavailable",
            V3_BAD_USER_NAME_OR_PASSWORD => "bad user name or password",
            V3_NOT_AUTHORIZED => "not authorized",
            _ => "unknown return code",
        },
        ProtocolVersion::V5 => match code {
            UNSPECIFIED_ERROR => "unspecified error",
            MALFORMED_PACKET => "malformed packet",
            PROTOCOL_ERROR => "protocol error",
            IMPLEMENTATION_SPECIFIC_ERROR => "implementation specific error",
            UNSUPPORTED_PROTOCOL_VERSION => "unsupported protocol version",
            CLIENT_IDENTIFIER_NOT_VALID => "client identifier not valid",
            BAD_USER_NAME_OR_PASSWORD => "bad user name or password",
            NOT_AUTHORIZED => "not authorized",
            SERVER_UNAVAILABLE => "server unavailable",
            SERVER_BUSY => "server busy",
            PACKET_TOO_LARGE => "packet too large",
            QUOTA_EXCEEDED => "quota exceeded",
            0x8A => "banned",
            0x8C => "bad authentication method",
            0x9C => "use another server",
            0x9D => "server moved",
            0x9F => "connection rate exceeded",
            _ => "unknown reason code",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uplink_error_stays_small_enough_to_return_by_value() {
        // Callers wrap it in their own error enums (e.g. `AppError::Uplink`); keep it compact.
        assert!(
            std::mem::size_of::<UplinkError>() <= 64,
            "{}",
            std::mem::size_of::<UplinkError>()
        );
    }
}
