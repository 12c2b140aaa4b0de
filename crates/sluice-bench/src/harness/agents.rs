//! The per-device agent: the SegaNet paper's "native" gateway design, in which every device has
//! its own OS process holding its own TLS MQTT session to the cloud. The `seganet` scenario
//! starts one `sluice-bench agent` process per device and puts the whole set under test.
//!
//! Owns: one agent's event loop — a plain-TCP MQTT listener that serves one device connection
//! at a time, one TLS 1.3 MQTT 3.1.1 session to the cloud broker (clean session, keep-alive
//! 60 s, reconnected with back-off), and the table of QoS 1 messages forwarded but not yet
//! acknowledged by the cloud. Does not own: the runtime (the `agent` subcommand runs this on a
//! `current_thread` tokio runtime to keep each process to one thread), spawning agents or
//! measuring them (see [`crate::scenarios::seganet`]).
//!
//! Message path and the acknowledgement rule: the device's QoS 1 PUBLISH gets a fresh cloud
//! packet id and is written to the cloud session; the device receives its PUBACK only when the
//! cloud's PUBACK for that message arrives ("ack after cloud ack", like sluice and like the
//! paper's agent). While the cloud session is down the agent still accepts the device (CONNACK)
//! and keeps its PUBLISHes in the table; on reconnect every unacknowledged one is sent again
//! with DUP set. QoS 0 PUBLISHes are forwarded if the cloud session is up and dropped (counted
//! in a debug log) otherwise. A PUBACK from the cloud for a device connection that has since
//! closed is dropped: that device session is gone (clean session).
//!
//! Bounds and overflow policy: at most `max_inflight` messages await a cloud PUBACK; when the
//! table is full the agent stops reading from the device (backpressure through TCP). Packets
//! are at most [`MAX_PACKET`] bytes from either side. Device bytes never panic the agent: a
//! malformed packet, a second CONNECT, QoS 2 or a subscription closes the device connection
//! (the agent only carries uplink telemetry), and the agent accepts the next one.
//!
//! Readiness: once listening and connected to the cloud for the first time, the agent writes
//! its listening address to `ready_file` (via a temporary file and a rename, so a reader never
//! sees half a line). Orphan guard: the agent exits when its parent process changes (the
//! scenario runner died), so a crashed run leaves no thousands of processes behind.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::BytesMut;
use rustls::ClientConfig;
use sluice_proto::mqtt::{
    encode, ConnAck, Connect, Decoder, Packet, Properties, ProtocolVersion, PubResponse, Publish,
    QoS,
};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, Instant};

use crate::conn::{handshake, open, tls_client_config, BrokerIo};

/// Largest MQTT packet accepted from the device or the cloud.
pub const MAX_PACKET: usize = 256 * 1024;
/// Keep-alive announced to the cloud, seconds; a PINGREQ goes out every half of it.
const CLOUD_KEEP_ALIVE_S: u16 = 60;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often the orphan guard looks at the parent pid.
const PARENT_CHECK: Duration = Duration::from_secs(2);

/// What one agent needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The cloud broker's TLS 1.3 MQTT address.
    pub cloud: SocketAddr,
    /// CA certificate(s) (PEM) that signed the cloud broker's certificate.
    pub ca_file: PathBuf,
    /// Name the cloud certificate is verified against (an IP address is checked against IP SANs).
    pub server_name: String,
    /// MQTT client id of the cloud session.
    pub client_id: String,
    /// QoS 1 messages awaiting a cloud PUBACK, at most (then the device is not read).
    pub max_inflight: u16,
    /// Written with the listening address once the first cloud session is up.
    pub ready_file: Option<PathBuf>,
    /// TCP connect + TLS handshake + CONNACK time limit for the cloud session.
    pub connect_timeout: Duration,
    /// Exit when the parent process is no longer this pid (orphan guard; `None`: off).
    pub parent_pid: Option<u32>,
}

impl AgentConfig {
    /// Defaults: 64 in flight, 10 s connect time-out, no ready file, no orphan guard.
    pub fn new(cloud: SocketAddr, ca_file: PathBuf, client_id: String) -> AgentConfig {
        AgentConfig {
            cloud,
            ca_file,
            server_name: cloud.ip().to_string(),
            client_id,
            max_inflight: 64,
            ready_file: None,
            connect_timeout: Duration::from_secs(10),
            parent_pid: None,
        }
    }
}

/// A QoS 1 message forwarded (or to be forwarded) to the cloud, not yet acknowledged by it.
struct Inflight {
    cloud_packet_id: u16,
    device_packet_id: u16,
    /// Which device connection it came from; its PUBACK goes only to that connection.
    device_session: u64,
    /// Written to a cloud session at least once (a resend then carries DUP).
    written: bool,
    publish: Publish,
}

/// The device side: one accepted connection.
struct DeviceConn {
    tcp: TcpStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    decoder: Decoder,
    /// Known once CONNECT arrived.
    version: Option<ProtocolVersion>,
    session: u64,
}

/// The cloud side: an established MQTT session.
struct CloudConn {
    io: Box<dyn BrokerIo>,
    rbuf: BytesMut,
    wbuf: BytesMut,
    decoder: Decoder,
    ping_at: Instant,
}

type Connecting = Pin<Box<dyn Future<Output = anyhow::Result<CloudConn>> + Send>>;

/// The cloud session's state.
enum Cloud {
    Up(CloudConn),
    Connecting(Connecting),
    Waiting(Pin<Box<tokio::time::Sleep>>),
}

/// Run one agent on an already-bound `listener` until `shutdown` completes, the orphan guard
/// fires, or the ready file cannot be written. Device and cloud failures are never fatal.
pub async fn run_agent(
    listener: TcpListener,
    config: AgentConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let tls = tls_client_config(&config.ca_file, None)?;
    let listen_addr = listener
        .local_addr()
        .context("reading the listening address")?;
    let mut agent = Agent {
        cloud: Cloud::Connecting(connect_cloud(&config, &tls)),
        config,
        tls,
        device: None,
        next_session: 1,
        inflight: Vec::new(),
        next_cloud_packet_id: 1,
        backoff: BACKOFF_MIN,
        ready_written: false,
        listen_addr,
    };
    tokio::pin!(shutdown);
    let mut parent_check = tokio::time::interval(PARENT_CHECK);
    loop {
        let device_readable = agent.inflight.len() < usize::from(agent.config.max_inflight);
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            _ = parent_check.tick() => {
                if let Some(parent) = agent.config.parent_pid {
                    if parent_pid() != Some(parent) {
                        tracing::warn!(parent, "agent parent process is gone, exiting");
                        return Ok(());
                    }
                }
            }
            accepted = listener.accept(), if agent.device.is_none() => {
                if let Ok((tcp, _)) = accepted {
                    let _ = tcp.set_nodelay(true);
                    let session = agent.next_session;
                    agent.next_session += 1;
                    agent.device = Some(DeviceConn {
                        tcp,
                        rbuf: BytesMut::with_capacity(4096),
                        wbuf: BytesMut::with_capacity(256),
                        decoder: Decoder::server(MAX_PACKET),
                        version: None,
                        session,
                    });
                }
            }
            read = read_into(agent.device.as_mut().map(|d| (&mut d.tcp, &mut d.rbuf))),
                if agent.device.is_some() && device_readable => {
                match read {
                    Ok(0) | Err(_) => agent.close_device("device closed the connection"),
                    Ok(_) => agent.on_device_bytes().await,
                }
            }
            event = cloud_event(&mut agent.cloud) => match event {
                CloudEvent::Read(Ok(0)) => agent.cloud_lost("the cloud broker closed the connection"),
                CloudEvent::Read(Err(_)) => agent.cloud_lost("reading from the cloud broker failed"),
                CloudEvent::Read(Ok(_)) => agent.on_cloud_bytes().await,
                CloudEvent::PingDue => agent.ping_cloud().await,
                CloudEvent::Connected(Ok(conn)) => agent.on_cloud_up(conn).await?,
                CloudEvent::Connected(Err(error)) => {
                    tracing::debug!(error = %format!("{error:#}"), "cloud connect failed");
                    agent.wait_before_reconnect();
                }
                CloudEvent::RetryDue => {
                    agent.cloud = Cloud::Connecting(connect_cloud(&agent.config, &agent.tls));
                }
            },
        }
    }
}

struct Agent {
    config: AgentConfig,
    tls: Arc<ClientConfig>,
    cloud: Cloud,
    device: Option<DeviceConn>,
    next_session: u64,
    /// Bounded by `config.max_inflight` (the device is not read while it is full).
    inflight: Vec<Inflight>,
    next_cloud_packet_id: u16,
    backoff: Duration,
    ready_written: bool,
    listen_addr: SocketAddr,
}

impl Agent {
    async fn on_cloud_up(&mut self, mut conn: CloudConn) -> anyhow::Result<()> {
        self.backoff = BACKOFF_MIN;
        // Send everything the cloud has not acknowledged, in arrival order; what an earlier
        // session already carried is marked DUP.
        let mut failed = false;
        if !self.inflight.is_empty() {
            conn.wbuf.clear();
            for entry in &mut self.inflight {
                entry.publish.dup = entry.written;
                entry.written = true;
                let packet = Packet::Publish(entry.publish.clone());
                if encode(&packet, ProtocolVersion::V311, &mut conn.wbuf).is_err() {
                    failed = true;
                }
            }
            failed |= conn.io.write_all(&conn.wbuf).await.is_err();
        }
        self.cloud = Cloud::Up(conn);
        if failed {
            self.cloud_lost("resending unacknowledged messages failed");
            return Ok(());
        }
        if !self.ready_written {
            if let Some(path) = &self.config.ready_file {
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, format!("{}\n", self.listen_addr))
                    .and_then(|()| std::fs::rename(&tmp, path))
                    .with_context(|| format!("writing the ready file {}", path.display()))?;
            }
            self.ready_written = true;
        }
        Ok(())
    }

    fn cloud_lost(&mut self, why: &'static str) {
        tracing::debug!(why, "cloud session lost");
        self.wait_before_reconnect();
    }

    fn wait_before_reconnect(&mut self) {
        self.cloud = Cloud::Waiting(Box::pin(sleep(self.backoff)));
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
    }

    fn close_device(&mut self, why: &'static str) {
        tracing::debug!(why, "device connection closed");
        self.device = None;
    }

    async fn ping_cloud(&mut self) {
        let Cloud::Up(conn) = &mut self.cloud else {
            return;
        };
        conn.ping_at = Instant::now() + Duration::from_secs(u64::from(CLOUD_KEEP_ALIVE_S) / 2);
        conn.wbuf.clear();
        let ok = encode(&Packet::PingReq, ProtocolVersion::V311, &mut conn.wbuf).is_ok()
            && conn.io.write_all(&conn.wbuf).await.is_ok();
        if !ok {
            self.cloud_lost("writing PINGREQ to the cloud failed");
        }
    }

    /// Decode and handle what the device sent, as far as the inflight bound allows; then write
    /// the replies to the device and the forwarded PUBLISHes to the cloud, one write each.
    async fn on_device_bytes(&mut self) {
        let Some(device) = self.device.as_mut() else {
            return;
        };
        device.wbuf.clear();
        if let Cloud::Up(conn) = &mut self.cloud {
            conn.wbuf.clear();
        }
        let mut close: Option<&'static str> = None;
        while self.inflight.len() < usize::from(self.config.max_inflight) {
            let packet = match device.decoder.decode(&mut device.rbuf) {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(_) => {
                    close = Some("malformed packet from the device");
                    break;
                }
            };
            match (packet, device.version) {
                (Packet::Connect(connect), None) => {
                    device.version = Some(connect.protocol);
                    let ack = Packet::ConnAck(ConnAck {
                        session_present: false,
                        code: 0,
                        properties: Properties::default(),
                    });
                    if encode(&ack, connect.protocol, &mut device.wbuf).is_err() {
                        close = Some("cannot encode CONNACK");
                        break;
                    }
                }
                (_, None) | (Packet::Connect(_), Some(_)) => {
                    close = Some("protocol violation: CONNECT expected once, first");
                    break;
                }
                (Packet::Publish(mut publish), Some(_)) => match publish.qos {
                    QoS::AtMostOnce => {
                        if let Cloud::Up(conn) = &mut self.cloud {
                            publish.dup = false;
                            publish.properties = None;
                            let _ = encode(
                                &Packet::Publish(publish),
                                ProtocolVersion::V311,
                                &mut conn.wbuf,
                            );
                        } else {
                            tracing::debug!("QoS 0 message dropped: cloud session down");
                        }
                    }
                    QoS::AtLeastOnce => {
                        let Some(device_packet_id) = publish.packet_id else {
                            close = Some("QoS 1 PUBLISH without packet id");
                            break;
                        };
                        let cloud_packet_id = next_packet_id(&mut self.next_cloud_packet_id);
                        publish.packet_id = Some(cloud_packet_id);
                        publish.dup = false;
                        publish.properties = None;
                        let mut written = false;
                        if let Cloud::Up(conn) = &mut self.cloud {
                            written = encode(
                                &Packet::Publish(publish.clone()),
                                ProtocolVersion::V311,
                                &mut conn.wbuf,
                            )
                            .is_ok();
                        }
                        self.inflight.push(Inflight {
                            cloud_packet_id,
                            device_packet_id,
                            device_session: device.session,
                            written,
                            publish,
                        });
                    }
                    QoS::ExactlyOnce => {
                        close = Some("QoS 2 is not supported by the agent");
                        break;
                    }
                },
                (Packet::PingReq, Some(version)) => {
                    let _ = encode(&Packet::PingResp, version, &mut device.wbuf);
                }
                (Packet::Disconnect(_), Some(_)) => {
                    close = Some("device sent DISCONNECT");
                    break;
                }
                (other, Some(_)) => {
                    tracing::debug!(packet = other.name(), "unsupported packet from the device");
                    close = Some("unsupported packet from the device");
                    break;
                }
            }
        }
        let device_write_failed =
            !device.wbuf.is_empty() && device.tcp.write_all(&device.wbuf).await.is_err();
        if let Cloud::Up(conn) = &mut self.cloud {
            if !conn.wbuf.is_empty() && conn.io.write_all(&conn.wbuf).await.is_err() {
                self.cloud_lost("writing to the cloud broker failed");
            }
        }
        if device_write_failed {
            close = close.or(Some("writing to the device failed"));
        }
        if let Some(why) = close {
            self.close_device(why);
        }
    }

    /// Handle what the cloud sent: PUBACKs release table entries and are relayed to the device.
    async fn on_cloud_bytes(&mut self) {
        let Cloud::Up(conn) = &mut self.cloud else {
            return;
        };
        let mut acked_before = self.inflight.len();
        if let Some(device) = self.device.as_mut() {
            device.wbuf.clear();
        }
        let mut lost: Option<&'static str> = None;
        loop {
            let packet = match conn.decoder.decode(&mut conn.rbuf) {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(_) => {
                    lost = Some("malformed packet from the cloud broker");
                    break;
                }
            };
            match packet {
                Packet::PubAck(ack) => {
                    let Some(at) = self
                        .inflight
                        .iter()
                        .position(|e| e.cloud_packet_id == ack.packet_id)
                    else {
                        continue;
                    };
                    let entry = self.inflight.remove(at);
                    if let Some(device) = self.device.as_mut() {
                        if let (Some(version), true) =
                            (device.version, device.session == entry.device_session)
                        {
                            let _ = encode(
                                &Packet::PubAck(PubResponse {
                                    packet_id: entry.device_packet_id,
                                    reason: 0,
                                    properties: None,
                                }),
                                version,
                                &mut device.wbuf,
                            );
                        }
                    }
                }
                Packet::PingResp => {}
                other => tracing::debug!(packet = other.name(), "unexpected packet from the cloud"),
            }
        }
        acked_before -= self.inflight.len();
        let mut device_write_failed = false;
        if let Some(device) = self.device.as_mut() {
            device_write_failed =
                !device.wbuf.is_empty() && device.tcp.write_all(&device.wbuf).await.is_err();
        }
        if device_write_failed {
            self.close_device("writing to the device failed");
        }
        if let Some(why) = lost {
            self.cloud_lost(why);
        }
        // Room was made in the table: packets already buffered from the device may proceed.
        if acked_before > 0 && self.device.as_ref().is_some_and(|d| !d.rbuf.is_empty()) {
            self.on_device_bytes().await;
        }
    }
}

fn next_packet_id(next: &mut u16) -> u16 {
    let id = *next;
    *next = if *next == u16::MAX { 1 } else { *next + 1 };
    id
}

fn connect_cloud(config: &AgentConfig, tls: &Arc<ClientConfig>) -> Connecting {
    let addr = config.cloud;
    let name = config.server_name.clone();
    let client_id = config.client_id.clone();
    let wait = config.connect_timeout;
    let tls = tls.clone();
    Box::pin(async move {
        let mut io = open(addr, Some((&tls, &name)), wait).await?;
        let mut rbuf = BytesMut::with_capacity(4096);
        let mut wbuf = BytesMut::with_capacity(4096);
        let mut decoder = Decoder::client(ProtocolVersion::V311, MAX_PACKET);
        let connect = Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: CLOUD_KEEP_ALIVE_S,
            client_id: client_id.as_str().into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        };
        handshake(&mut io, connect, &mut rbuf, &mut wbuf, &mut decoder, wait).await?;
        Ok(CloudConn {
            io,
            rbuf,
            wbuf,
            decoder,
            ping_at: Instant::now() + Duration::from_secs(u64::from(CLOUD_KEEP_ALIVE_S) / 2),
        })
    })
}

/// Read into `buf` from `target`, or never complete when there is no target.
async fn read_into<S: AsyncRead + Unpin + ?Sized>(
    target: Option<(&mut S, &mut BytesMut)>,
) -> std::io::Result<usize> {
    let Some((io, buf)) = target else {
        return std::future::pending().await;
    };
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(4096);
    }
    io.read_buf(buf).await
}

/// What happened on the cloud side.
enum CloudEvent {
    Read(std::io::Result<usize>),
    PingDue,
    Connected(anyhow::Result<CloudConn>),
    RetryDue,
}

/// Wait for the next thing to do on the cloud side, whatever its state.
async fn cloud_event(cloud: &mut Cloud) -> CloudEvent {
    match cloud {
        Cloud::Up(conn) => {
            let ping_at = conn.ping_at;
            tokio::select! {
                read = read_into(Some((conn.io.as_mut(), &mut conn.rbuf))) => CloudEvent::Read(read),
                () = tokio::time::sleep_until(ping_at) => CloudEvent::PingDue,
            }
        }
        Cloud::Connecting(fut) => CloudEvent::Connected(fut.as_mut().await),
        Cloud::Waiting(sleep) => {
            sleep.as_mut().await;
            CloudEvent::RetryDue
        }
    }
}

/// This process's parent pid, from `/proc/self/stat` (field 4, counted after the last ')').
fn parent_pid() -> Option<u32> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    rest.split_whitespace().nth(1)?.parse().ok()
}
