//! `TestClient`: a small MQTT 3.1.1 / 5.0 client for tests, built on sluice-proto's codec.
//!
//! Owns: one connection (plain TCP or TLS via tokio-rustls), its read buffer, the client-side
//! packet-id space and the acknowledgement side of QoS 1/2 flows. Does not own: reconnects,
//! keep-alive (no PINGREQ is sent unless [`TestClient::ping`] is called — use `keep_alive: 0`
//! or ping for long idle tests), topic aliases, flow control against the server's receive
//! maximum. It is deliberately simple and sequential: no background task; every method reads
//! the socket only while it waits, so it works on a current-thread runtime.
//!
//! Behaviour while waiting (inside any method that reads):
//! - incoming QoS 1 PUBLISH → PUBACK sent at once; QoS 2 PUBLISH → PUBREC sent at once and the
//!   message delivered once (a redelivery of an id awaiting PUBREL is not delivered again);
//!   PUBREL → PUBCOMP (reason 0x92 in MQTT 5 if the id is unknown);
//! - PUBREC for our QoS 2 publish with a success reason → PUBREL sent at once;
//! - packets nobody is waiting for (publishes, acks of [`TestClient::publish_no_wait`]) are kept
//!   in an inbox, in arrival order, for later [`TestClient::recv`] / [`TestClient::wait_ack`];
//!   PINGRESP, PUBREL and successful PUBREC are consumed by the client itself.
//!
//! Bounds: the inbox holds at most [`MAX_INBOX`] packets — beyond that the waiting call fails
//! (the test is not draining what it subscribed to); packets up to 16 MiB by default; a QoS > 0
//! packet id stays in use until its final ack is collected (by `publish` or `wait_ack`).
//! Invariant: nothing the peer sends can make the client panic; bad bytes become errors.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use sluice_proto::mqtt::{
    encode, reason, ConnAck, Connect, Decoder, Disconnect, Packet, Properties, ProtocolVersion,
    PubResponse, Publish, QoS, SubAck, Subscribe, SubscribeFilter, SubscriptionOptions,
    Unsubscribe, Will,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout_at, Instant};
use tokio_rustls::TlsConnector;

/// Default largest packet the client accepts from the server.
pub const DEFAULT_MAX_PACKET_SIZE: usize = 16 * 1024 * 1024;
/// Default time allowed for connect + CONNACK and for each acknowledgement.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most packets kept unread in the inbox before a waiting call fails.
pub const MAX_INBOX: usize = 1_000_000;
/// How many bytes the read buffer grows by before each socket read.
const READ_CHUNK: usize = 16 * 1024;

/// How to connect. Build with [`ConnectOpts::new`], [`ConnectOpts::v311`] or
/// [`ConnectOpts::v5`] and adjust the public fields.
#[derive(Clone)]
pub struct ConnectOpts {
    pub version: ProtocolVersion,
    pub client_id: String,
    /// "Clean session" (3.1.1) / "clean start" (5). Default true.
    pub clean_start: bool,
    /// Seconds; 0 disables keep-alive. Default 60. The client never pings on its own.
    pub keep_alive: u16,
    pub will: Option<Will>,
    pub username: Option<String>,
    pub password: Option<Bytes>,
    /// TLS client config and the server name to verify (e.g. "localhost"); `None` = plain TCP.
    pub tls: Option<(Arc<ClientConfig>, String)>,
    /// CONNECT properties (MQTT 5 only; must stay empty for 3.1.1).
    pub properties: Properties,
    /// Largest packet accepted from the server. Default [`DEFAULT_MAX_PACKET_SIZE`].
    pub max_packet_size: usize,
    /// Deadline for TCP connect + TLS handshake + CONNACK, and the default for each ack wait.
    pub timeout: Duration,
}

impl fmt::Debug for ConnectOpts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectOpts")
            .field("version", &self.version)
            .field("client_id", &self.client_id)
            .field("clean_start", &self.clean_start)
            .field("keep_alive", &self.keep_alive)
            .field("will", &self.will)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.as_ref().map(|(_, name)| name))
            .field("properties", &self.properties)
            .field("max_packet_size", &self.max_packet_size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ConnectOpts {
    /// Clean start, keep-alive 60 s, no will, no credentials, plain TCP.
    pub fn new(version: ProtocolVersion, client_id: impl Into<String>) -> ConnectOpts {
        ConnectOpts {
            version,
            client_id: client_id.into(),
            clean_start: true,
            keep_alive: 60,
            will: None,
            username: None,
            password: None,
            tls: None,
            properties: Properties::default(),
            max_packet_size: DEFAULT_MAX_PACKET_SIZE,
            timeout: DEFAULT_TIMEOUT,
        }
    }
    /// [`ConnectOpts::new`] for MQTT 3.1.1.
    pub fn v311(client_id: impl Into<String>) -> ConnectOpts {
        ConnectOpts::new(ProtocolVersion::V311, client_id)
    }
    /// [`ConnectOpts::new`] for MQTT 5.0.
    pub fn v5(client_id: impl Into<String>) -> ConnectOpts {
        ConnectOpts::new(ProtocolVersion::V5, client_id)
    }
    /// Connect over TLS with `config`, verifying the server certificate for `server_name`.
    pub fn with_tls(mut self, config: Arc<ClientConfig>, server_name: impl Into<String>) -> Self {
        self.tls = Some((config, server_name.into()));
        self
    }
}

/// Byte stream the client talks over: plain TCP or TLS over TCP.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// What one attempt to read the next packet produced. Short-lived (returned and matched at
/// once), so the size of the `Packet` variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Incoming {
    Packet(Packet),
    /// A QoS 2 redelivery already delivered once; acknowledged, not to be delivered again.
    Duplicate,
    TimedOut,
    Closed(String),
}

/// An MQTT test client; see the module documentation for its behaviour while waiting.
pub struct TestClient {
    io: Box<dyn Io>,
    peer: SocketAddr,
    version: ProtocolVersion,
    decoder: Decoder,
    read_buf: BytesMut,
    write_buf: BytesMut,
    inbox: VecDeque<Packet>,
    /// Incoming QoS 2 ids we sent PUBREC for and await PUBREL on.
    awaiting_pubrel: HashSet<u16>,
    /// Our packet ids whose flow has not been collected yet.
    ids_in_use: HashSet<u16>,
    next_packet_id: u16,
    ack_timeout: Duration,
    /// Set once the peer closed the connection (EOF or error), with the reason.
    closed: Option<String>,
}

impl fmt::Debug for TestClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestClient")
            .field("peer", &self.peer)
            .field("version", &self.version)
            .field("inbox", &self.inbox.len())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl TestClient {
    /// Connect to `addr`, send CONNECT and wait for CONNACK. Returns the CONNACK whatever its
    /// code — a refused connection is `Ok` with a non-zero `code` (the broker then closes it);
    /// `Err` means no CONNACK arrived (TCP/TLS failure, close, timeout, bad bytes).
    pub async fn connect(
        addr: SocketAddr,
        opts: ConnectOpts,
    ) -> anyhow::Result<(TestClient, ConnAck)> {
        let deadline = Instant::now() + opts.timeout;
        let mut client = TestClient::open(addr, &opts).await?;
        let connect = Connect {
            protocol: opts.version,
            clean_start: opts.clean_start,
            keep_alive: opts.keep_alive,
            client_id: ByteString::from(opts.client_id),
            will: opts.will,
            username: opts.username.map(ByteString::from),
            password: opts.password,
            properties: opts.properties,
        };
        client
            .send_packet(&Packet::Connect(connect))
            .await
            .context("sending CONNECT")?;
        match client.read_next(deadline).await? {
            Incoming::Packet(Packet::ConnAck(connack)) => Ok((client, connack)),
            Incoming::Packet(other) => {
                bail!(
                    "{addr} sent {} before CONNACK (protocol violation)",
                    other.name()
                )
            }
            Incoming::Duplicate => bail!("{addr} sent PUBLISH before CONNACK"),
            Incoming::TimedOut => bail!("no CONNACK from {addr} within {:?}", opts.timeout),
            Incoming::Closed(why) => bail!("{addr} closed the connection before CONNACK: {why}"),
        }
    }

    /// Open the TCP (and TLS, if `opts.tls`) connection but send nothing: for tests that
    /// start with malformed or unusual bytes via [`TestClient::send_raw`]. Incoming packets are
    /// decoded as `opts.version`.
    pub async fn open(addr: SocketAddr, opts: &ConnectOpts) -> anyhow::Result<TestClient> {
        let deadline = Instant::now() + opts.timeout;
        let tcp = timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| anyhow!("TCP connect to {addr} timed out after {:?}", opts.timeout))?
            .with_context(|| format!("TCP connect to {addr}"))?;
        tcp.set_nodelay(true).context("setting TCP_NODELAY")?;
        let io: Box<dyn Io> = match &opts.tls {
            None => Box::new(tcp),
            Some((config, name)) => {
                let server_name = ServerName::try_from(name.clone())
                    .with_context(|| format!("{name:?} is not a valid TLS server name"))?;
                let tls = timeout_at(
                    deadline,
                    TlsConnector::from(config.clone()).connect(server_name, tcp),
                )
                .await
                .map_err(|_| anyhow!("TLS handshake with {addr} timed out"))?
                .with_context(|| format!("TLS handshake with {addr} as {name:?}"))?;
                Box::new(tls)
            }
        };
        Ok(TestClient {
            io,
            peer: addr,
            version: opts.version,
            decoder: Decoder::client(opts.version, opts.max_packet_size),
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::with_capacity(READ_CHUNK),
            inbox: VecDeque::new(),
            awaiting_pubrel: HashSet::new(),
            ids_in_use: HashSet::new(),
            next_packet_id: 1,
            ack_timeout: opts.timeout,
            closed: None,
        })
    }

    /// The protocol version this client speaks.
    pub fn version(&self) -> ProtocolVersion {
        self.version
    }
    /// The address connected to.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
    /// Change the time each acknowledgement wait may take (default: `ConnectOpts::timeout`).
    pub fn set_ack_timeout(&mut self, timeout: Duration) {
        self.ack_timeout = timeout;
    }
    /// Publishes received but not yet taken by [`TestClient::recv`].
    pub fn buffered_publishes(&self) -> usize {
        self.inbox
            .iter()
            .filter(|p| matches!(p, Packet::Publish(_)))
            .count()
    }

    /// Publish and wait for the flow to complete: nothing for QoS 0 (returns 0 once written),
    /// PUBACK for QoS 1, PUBREC/PUBREL/PUBCOMP for QoS 2. Returns the broker's reason code
    /// (always 0 in 3.1.1; for QoS 2 the PUBREC code if it failed, else the PUBCOMP code).
    pub async fn publish(
        &mut self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
    ) -> anyhow::Result<u8> {
        match self.publish_no_wait(topic, payload, qos, retain).await? {
            None => Ok(reason::SUCCESS),
            Some(packet_id) => self.wait_ack(packet_id).await,
        }
    }

    /// Send a PUBLISH without waiting. Returns its packet id (`None` for QoS 0); collect the
    /// outcome later with [`TestClient::wait_ack`], which also frees the id.
    pub async fn publish_no_wait(
        &mut self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
    ) -> anyhow::Result<Option<u16>> {
        self.publish_no_wait_with(topic, payload, qos, retain, None)
            .await
    }

    /// [`TestClient::publish`] with MQTT 5 properties (e.g. user properties).
    pub async fn publish_with(
        &mut self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        properties: Properties,
    ) -> anyhow::Result<u8> {
        match self
            .publish_no_wait_with(topic, payload, qos, false, Some(Box::new(properties)))
            .await?
        {
            None => Ok(reason::SUCCESS),
            Some(packet_id) => self.wait_ack(packet_id).await,
        }
    }

    async fn publish_no_wait_with(
        &mut self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
        properties: Option<Box<Properties>>,
    ) -> anyhow::Result<Option<u16>> {
        let packet_id = if qos == QoS::AtMostOnce {
            None
        } else {
            Some(self.allocate_packet_id()?)
        };
        let publish = Publish {
            dup: false,
            qos,
            retain,
            topic: ByteString::from(topic),
            packet_id,
            properties,
            payload: payload.into(),
        };
        self.send_packet(&Packet::Publish(publish))
            .await
            .context("sending PUBLISH")?;
        Ok(packet_id)
    }

    /// Wait for the final acknowledgement of our publish `packet_id` (PUBACK, PUBCOMP, or a
    /// failed PUBREC) and return its reason code. Frees the packet id.
    pub async fn wait_ack(&mut self, packet_id: u16) -> anyhow::Result<u8> {
        let deadline = Instant::now() + self.ack_timeout;
        let ack = self
            .wait_for_or_fail(deadline, "PUBACK/PUBCOMP", |p| match p {
                Packet::PubAck(r) | Packet::PubComp(r) => r.packet_id == packet_id,
                Packet::PubRec(r) => r.packet_id == packet_id && r.reason >= 0x80,
                _ => false,
            })
            .await?;
        self.ids_in_use.remove(&packet_id);
        match ack {
            Packet::PubAck(r) | Packet::PubComp(r) | Packet::PubRec(r) => Ok(r.reason),
            // Invariant: the predicate above only accepts the three packet types matched here.
            other => bail!("internal error: wait_ack matched {}", other.name()),
        }
    }

    /// Subscribe to `(filter, max QoS)` pairs; returns the SUBACK codes (granted QoS or ≥ 0x80).
    pub async fn subscribe(&mut self, filters: &[(&str, QoS)]) -> anyhow::Result<Vec<u8>> {
        let filters = filters
            .iter()
            .map(|&(filter, qos)| SubscribeFilter {
                filter: ByteString::from(filter),
                options: SubscriptionOptions {
                    qos,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                },
            })
            .collect();
        Ok(self
            .subscribe_with(filters, Properties::default())
            .await?
            .codes)
    }

    /// Subscribe with full MQTT 5 options and properties; returns the whole SUBACK.
    pub async fn subscribe_with(
        &mut self,
        filters: Vec<SubscribeFilter>,
        properties: Properties,
    ) -> anyhow::Result<SubAck> {
        let packet_id = self.allocate_packet_id()?;
        let result = async {
            self.send_packet(&Packet::Subscribe(Subscribe {
                packet_id,
                filters,
                properties,
            }))
            .await
            .context("sending SUBSCRIBE")?;
            let deadline = Instant::now() + self.ack_timeout;
            match self
                .wait_for_or_fail(
                    deadline,
                    "SUBACK",
                    |p| matches!(p, Packet::SubAck(s) if s.packet_id == packet_id),
                )
                .await?
            {
                Packet::SubAck(suback) => Ok(suback),
                // Invariant: the predicate only accepts SUBACK.
                other => bail!("internal error: subscribe matched {}", other.name()),
            }
        }
        .await;
        self.ids_in_use.remove(&packet_id);
        result
    }

    /// Unsubscribe; returns the UNSUBACK reason codes (MQTT 5) or an empty list (3.1.1).
    pub async fn unsubscribe(&mut self, filters: &[&str]) -> anyhow::Result<Vec<u8>> {
        let packet_id = self.allocate_packet_id()?;
        let result = async {
            let unsubscribe = Unsubscribe {
                packet_id,
                filters: filters.iter().map(|f| ByteString::from(*f)).collect(),
                properties: Properties::default(),
            };
            self.send_packet(&Packet::Unsubscribe(unsubscribe))
                .await
                .context("sending UNSUBSCRIBE")?;
            let deadline = Instant::now() + self.ack_timeout;
            match self
                .wait_for_or_fail(
                    deadline,
                    "UNSUBACK",
                    |p| matches!(p, Packet::UnsubAck(u) if u.packet_id == packet_id),
                )
                .await?
            {
                Packet::UnsubAck(unsuback) => Ok(unsuback.codes),
                // Invariant: the predicate only accepts UNSUBACK.
                other => bail!("internal error: unsubscribe matched {}", other.name()),
            }
        }
        .await;
        self.ids_in_use.remove(&packet_id);
        result
    }

    /// Next incoming PUBLISH (buffered ones first), already acknowledged per its QoS.
    /// `Ok(None)` if none arrives within `timeout`; `Err` if the connection closed, the broker
    /// sent DISCONNECT, or it sent bytes that do not decode.
    pub async fn recv(&mut self, timeout: Duration) -> anyhow::Result<Option<Publish>> {
        if let Some(pos) = self
            .inbox
            .iter()
            .position(|p| matches!(p, Packet::Publish(_)))
        {
            if let Some(Packet::Publish(publish)) = self.inbox.remove(pos) {
                return Ok(Some(publish));
            }
        }
        let deadline = Instant::now() + timeout;
        match self
            .wait_for(deadline, "PUBLISH", |p| matches!(p, Packet::Publish(_)))
            .await
        {
            Ok(Packet::Publish(publish)) => Ok(Some(publish)),
            Ok(other) => bail!("internal error: recv matched {}", other.name()),
            Err(WaitError::TimedOut) => Ok(None),
            Err(WaitError::Failed(e)) => Err(e),
        }
    }

    /// Next packet of any kind not consumed by another call (inbox first), e.g. to see a
    /// DISCONNECT with its reason code. Publishes are acknowledged as usual. `Ok(None)` on
    /// timeout; `Err` if the connection is closed or bytes do not decode.
    pub async fn recv_packet(&mut self, timeout: Duration) -> anyhow::Result<Option<Packet>> {
        if let Some(packet) = self.inbox.pop_front() {
            return Ok(Some(packet));
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.read_next(deadline).await? {
                Incoming::Packet(packet) => return Ok(Some(packet)),
                Incoming::Duplicate => continue,
                Incoming::TimedOut => return Ok(None),
                Incoming::Closed(why) => bail!("{} closed the connection: {why}", self.peer),
            }
        }
    }

    /// Send PINGREQ and wait for PINGRESP; returns the round-trip time.
    pub async fn ping(&mut self) -> anyhow::Result<Duration> {
        let start = Instant::now();
        self.send_packet(&Packet::PingReq)
            .await
            .context("sending PINGREQ")?;
        let deadline = start + self.ack_timeout;
        self.wait_for_or_fail(deadline, "PINGRESP", |p| matches!(p, Packet::PingResp))
            .await?;
        Ok(start.elapsed())
    }

    /// Send DISCONNECT (normal disconnection, so no will) and close the connection.
    pub async fn disconnect(mut self) -> anyhow::Result<()> {
        let disconnect = Disconnect {
            reason: reason::SUCCESS,
            properties: Properties::default(),
        };
        self.send_packet(&Packet::Disconnect(disconnect))
            .await
            .context("sending DISCONNECT")?;
        // The broker may close first; a failed shutdown changes nothing for the test.
        let _ = self.io.shutdown().await;
        Ok(())
    }

    /// Encode and send any packet as-is (no packet-id bookkeeping, no waiting).
    pub async fn send_packet(&mut self, packet: &Packet) -> anyhow::Result<()> {
        self.write_buf.clear();
        encode(packet, self.version, &mut self.write_buf)
            .with_context(|| format!("encoding {}", packet.name()))?;
        let deadline = Instant::now() + self.ack_timeout;
        let (io, bytes) = (&mut self.io, &self.write_buf);
        timeout_at(deadline, async {
            io.write_all(bytes).await?;
            io.flush().await
        })
        .await
        .map_err(|_| {
            anyhow!(
                "writing {} to {} blocked for {:?}",
                packet.name(),
                self.peer,
                self.ack_timeout
            )
        })?
        .with_context(|| format!("writing {} to {}", packet.name(), self.peer))
    }

    /// Send raw bytes (for malformed-input tests).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.ack_timeout;
        let io = &mut self.io;
        timeout_at(deadline, async {
            io.write_all(bytes).await?;
            io.flush().await
        })
        .await
        .map_err(|_| anyhow!("writing raw bytes to {} blocked", self.peer))?
        .with_context(|| format!("writing raw bytes to {}", self.peer))
    }

    /// Read raw bytes (including any already buffered, undecoded ones) until the peer closes
    /// the connection or `timeout` passes. Returns the bytes and whether it closed. A reset or
    /// TLS error counts as closed.
    pub async fn read_raw_until_closed(&mut self, timeout: Duration) -> (Vec<u8>, bool) {
        let mut bytes = self.read_buf.split().to_vec();
        if self.closed.is_some() {
            return (bytes, true);
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.read_buf.reserve(READ_CHUNK);
            match timeout_at(deadline, self.io.read_buf(&mut self.read_buf)).await {
                Err(_) => return (bytes, false),
                Ok(Ok(0)) => {
                    self.closed = Some("end of stream".to_string());
                    return (bytes, true);
                }
                Ok(Ok(_)) => bytes.extend_from_slice(&self.read_buf.split()),
                Ok(Err(e)) => {
                    self.closed = Some(e.to_string());
                    return (bytes, true);
                }
            }
        }
    }

    /// Whether the peer closes the connection within `timeout` (anything it sends first is
    /// discarded).
    pub async fn expect_closed(&mut self, timeout: Duration) -> bool {
        self.read_raw_until_closed(timeout).await.1
    }

    /// [`TestClient::wait_for`] with a timeout turned into an error naming `what`.
    async fn wait_for_or_fail(
        &mut self,
        deadline: Instant,
        what: &str,
        wanted: impl FnMut(&Packet) -> bool,
    ) -> anyhow::Result<Packet> {
        let allowed = deadline.saturating_duration_since(Instant::now());
        let peer = self.peer;
        self.wait_for(deadline, what, wanted)
            .await
            .map_err(|e| match e {
                WaitError::TimedOut => anyhow!("no {what} from {peer} within {allowed:?}"),
                WaitError::Failed(e) => e,
            })
    }

    /// Wait until a packet satisfying `wanted` arrives (checking the inbox first), keeping
    /// everything else that matters in the inbox.
    async fn wait_for(
        &mut self,
        deadline: Instant,
        what: &str,
        mut wanted: impl FnMut(&Packet) -> bool,
    ) -> Result<Packet, WaitError> {
        if let Some(pos) = self.inbox.iter().position(&mut wanted) {
            if let Some(packet) = self.inbox.remove(pos) {
                return Ok(packet);
            }
        }
        loop {
            match self.read_next(deadline).await? {
                Incoming::Packet(packet) if wanted(&packet) => return Ok(packet),
                Incoming::Packet(Packet::Disconnect(d)) => {
                    return Err(WaitError::Failed(anyhow!(
                        "{} sent DISCONNECT (reason 0x{:02X}{}) while we waited for {what}",
                        self.peer,
                        d.reason,
                        d.properties
                            .reason_string
                            .as_ref()
                            .map(|s| format!(": {s}"))
                            .unwrap_or_default()
                    )))
                }
                Incoming::Packet(Packet::PingResp | Packet::PubRel(_)) => {}
                Incoming::Packet(Packet::PubRec(r)) if r.reason < 0x80 => {}
                Incoming::Packet(packet) => {
                    if self.inbox.len() >= MAX_INBOX {
                        return Err(WaitError::Failed(anyhow!(
                            "more than {MAX_INBOX} unread packets from {} while waiting for {what}; \
                             the test must drain them with recv()",
                            self.peer
                        )));
                    }
                    self.inbox.push_back(packet);
                }
                Incoming::Duplicate => {}
                Incoming::TimedOut => return Err(WaitError::TimedOut),
                Incoming::Closed(why) => {
                    return Err(WaitError::Failed(anyhow!(
                        "{} closed the connection while we waited for {what}: {why}",
                        self.peer
                    )))
                }
            }
        }
    }

    /// Decode the next packet, reading from the socket as needed until `deadline`, and perform
    /// the protocol duties it triggers (acks). `Err` only for undecodable bytes or a failed ack.
    async fn read_next(&mut self, deadline: Instant) -> anyhow::Result<Incoming> {
        loop {
            let decoded = self
                .decoder
                .decode(&mut self.read_buf)
                .with_context(|| format!("{} sent bytes that do not decode", self.peer))?;
            if let Some(packet) = decoded {
                return self.on_incoming(packet).await;
            }
            if let Some(why) = &self.closed {
                return Ok(Incoming::Closed(why.clone()));
            }
            self.read_buf.reserve(READ_CHUNK);
            match timeout_at(deadline, self.io.read_buf(&mut self.read_buf)).await {
                Err(_) => return Ok(Incoming::TimedOut),
                Ok(Ok(0)) => self.closed = Some("end of stream".to_string()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => self.closed = Some(e.to_string()),
            }
        }
    }

    async fn on_incoming(&mut self, packet: Packet) -> anyhow::Result<Incoming> {
        match &packet {
            Packet::Publish(publish) => match (publish.qos, publish.packet_id) {
                (QoS::AtMostOnce, _) => {}
                (QoS::AtLeastOnce, Some(id)) => {
                    self.send_packet(&Packet::PubAck(response(id, reason::SUCCESS)))
                        .await?;
                }
                (QoS::ExactlyOnce, Some(id)) => {
                    let first_time = self.awaiting_pubrel.insert(id);
                    self.send_packet(&Packet::PubRec(response(id, reason::SUCCESS)))
                        .await?;
                    if !first_time {
                        return Ok(Incoming::Duplicate);
                    }
                }
                (_, None) => bail!("{} sent a QoS > 0 PUBLISH without a packet id", self.peer),
            },
            Packet::PubRel(r) => {
                let code = if self.awaiting_pubrel.remove(&r.packet_id)
                    || self.version == ProtocolVersion::V311
                {
                    reason::SUCCESS
                } else {
                    reason::PACKET_IDENTIFIER_NOT_FOUND
                };
                self.send_packet(&Packet::PubComp(response(r.packet_id, code)))
                    .await?;
            }
            Packet::PubRec(r) if r.reason < 0x80 => {
                self.send_packet(&Packet::PubRel(response(r.packet_id, reason::SUCCESS)))
                    .await?;
            }
            _ => {}
        }
        Ok(Incoming::Packet(packet))
    }

    /// Next packet id not in use (1..=65535, wrapping, never 0), marked in use.
    fn allocate_packet_id(&mut self) -> anyhow::Result<u16> {
        for _ in 0..u16::MAX {
            let id = self.next_packet_id;
            self.next_packet_id = self.next_packet_id.checked_add(1).unwrap_or(1);
            if self.ids_in_use.insert(id) {
                return Ok(id);
            }
        }
        bail!("all 65535 packet ids are in use; collect acks with wait_ack()")
    }
}

/// Why [`TestClient::wait_for`] returned without the wanted packet.
enum WaitError {
    TimedOut,
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for WaitError {
    fn from(e: anyhow::Error) -> Self {
        WaitError::Failed(e)
    }
}

fn response(packet_id: u16, code: u8) -> PubResponse {
    PubResponse {
        packet_id,
        reason: code,
        properties: None,
    }
}
