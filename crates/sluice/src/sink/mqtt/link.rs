//! Establishing one MQTT connection to the cloud broker, and what its answers mean.
//!
//! Owns: TCP (with the lane's socket marks) to the node [`super::failover::NodeCursor`] picks,
//! TLS, CONNECT/CONNACK and what the CONNACK says
//! about the link ([`LinkLimits`]), naming TLS failures precisely, and [`classify_refusal`]
//! (PUBACK failure codes → [`RefusalClass`]). Does not own: what is sent on the connection
//! (`wire.rs`) or the retry policy (the outbox).

use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use rustls::pki_types::ServerName;
use sluice_proto::mqtt::{encode, Connect, Decoder, Packet, Properties, ProtocolVersion};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{MqttTransport, DOWNLINK_RECEIVE_MAXIMUM, MAX_INCOMING_PACKET_BYTES};
use crate::sink::transport::{LinkLimits, RefusalClass};
use crate::sink::{connack_reason, socket, RejectReason, UplinkError};

pub(super) const READ_CHUNK: usize = 16 * 1024;
/// Our inflight window never exceeds this, leaving one packet id for SUBSCRIBE.
const MAX_WINDOW: usize = u16::MAX as usize - 1;

pub(super) trait Io: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> Io for T {}

/// One established connection (after a successful CONNACK).
pub(super) struct Connection {
    pub(super) io: Box<dyn Io>,
    pub(super) rbuf: BytesMut,
    pub(super) decoder: Decoder,
    /// The broker's Maximum Packet Size (`usize::MAX` when it set none).
    pub(super) max_packet: usize,
    /// Zero disables keep-alive.
    pub(super) keep_alive: Duration,
    pub(super) retain_available: bool,
    pub(super) last_read: Instant,
    pub(super) last_write: Instant,
    pub(super) ping_outstanding: bool,
    /// One keep-alive timer for the connection, re-armed only when it fired or when the
    /// deadline moved earlier: the per-message path does not touch the timer wheel.
    pub(super) timer: Pin<Box<tokio::time::Sleep>>,
    pub(super) armed_at: Instant,
}

impl Connection {
    pub(super) fn io_timeout(&self) -> Duration {
        if self.keep_alive.is_zero() {
            Duration::from_secs(30)
        } else {
            (self.keep_alive * 3 / 2).max(Duration::from_secs(5))
        }
    }
}

/// Classify a PUBACK reason code ≥ 0x80 by what a resend can change (the outbox applies the
/// policy, e.g. an unclear code becomes permanent once it persisted).
pub fn classify_refusal(code: u8) -> RefusalClass {
    use sluice_proto::mqtt::reason::*;
    match code {
        QUOTA_EXCEEDED | PACKET_IDENTIFIER_IN_USE => RefusalClass::Temporary,
        UNSPECIFIED_ERROR | IMPLEMENTATION_SPECIFIC_ERROR => RefusalClass::Unclear,
        NOT_AUTHORIZED => RefusalClass::Permanent(RejectReason::NotAuthorized),
        TOPIC_NAME_INVALID => RefusalClass::Permanent(RejectReason::TopicNameInvalid),
        PAYLOAD_FORMAT_INVALID => RefusalClass::Permanent(RejectReason::PayloadFormatInvalid),
        _ => RefusalClass::Permanent(RejectReason::Other),
    }
}

impl MqttTransport {
    /// TCP, TLS, CONNECT, CONNACK (and the downlink SUBSCRIBE queued into the batch). The
    /// outbox bounds it with `connect_timeout`.
    pub(super) async fn open(&mut self) -> Result<LinkLimits, UplinkError> {
        crate::sink::transport::Transport::abort(self);
        let cfg = self.cfg.clone();
        // Which node of the cluster (`urls`; one node for `url`): the one after the last
        // attempt's, so a failed connect or a dropped link moves on (see `failover.rs`).
        let nodes = cfg.nodes();
        let index = self.nodes.take_next(nodes.len());
        let node = &nodes[index];
        let host = node.host.as_str();
        let port = node.port;
        let tls = if node.tls {
            let connector = self.tls.clone().ok_or(UplinkError::TlsConfigMissing)?;
            let name = cfg.tls_server_name_of(node).to_owned();
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
        // Resolved on every attempt (`socket::connect` looks the name up each time), so a
        // node that moved to another address is found again.
        let (tcp, mptcp_socket): (TcpStream, bool) =
            socket::connect(host, port, self.lane, lowat, &self.dial)
                .await
                .map_err(|source| UplinkError::CloudUnreachable {
                    addr: format!("{host}:{port}"),
                    source,
                })?;
        self.mptcp_key = self
            .metrics
            .mptcp
            .on_connect(&tcp, self.dial.mptcp, mptcp_socket);
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
        let now = Instant::now();
        let conn = Connection {
            io,
            rbuf,
            decoder,
            max_packet: p.maximum_packet_size.map_or(usize::MAX, |m| m as usize),
            keep_alive,
            retain_available: p.retain_available != Some(0),
            last_read: now,
            last_write: now,
            ping_outstanding: false,
            timer: Box::pin(tokio::time::sleep_until(now.into())),
            armed_at: now,
        };
        let limits = LinkLimits {
            window: usize::from(cfg.inflight.max(1))
                .min(usize::from(receive_maximum))
                .min(MAX_WINDOW),
            pack_limit: self.pack_payload_limit(conn.max_packet),
            keep_alive: Some(keep_alive),
        };
        self.next_packet_id = 1;
        if self.subscribes_downlink()
            && (!connack.session_present || self.version == ProtocolVersion::V5)
        {
            self.encode_subscribe(connack.session_present)?;
        }
        self.conn = Some(conn);
        self.nodes
            .connected(index, &cfg, self.shard, self.lane, &self.metrics);
        if let Some(f) = &self.on_port {
            f(Some(local_port));
        }
        Ok(limits)
    }
}

/// Name certificate problems and TLS alerts precisely; anything else becomes `otherwise(e)`.
pub(crate) fn tls_error(
    e: std::io::Error,
    otherwise: fn(std::io::Error) -> UplinkError,
) -> UplinkError {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::outbox::PERSISTENT_ERROR_ROUNDS;

    /// The class with the policy the outbox applies on top (see `outbox/refusal.rs`).
    fn classify(code: u8, rounds: u32) -> RefusalClass {
        match classify_refusal(code) {
            RefusalClass::Unclear if rounds >= PERSISTENT_ERROR_ROUNDS => {
                RefusalClass::Permanent(RejectReason::PersistentError)
            }
            RefusalClass::Unclear => RefusalClass::Temporary,
            class => class,
        }
    }

    #[test]
    fn puback_failure_codes_are_temporary_or_permanent_by_what_a_resend_can_change() {
        use sluice_proto::mqtt::reason::*;
        for code in [QUOTA_EXCEEDED, PACKET_IDENTIFIER_IN_USE] {
            assert_eq!(classify(code, 0), RefusalClass::Temporary);
            assert_eq!(classify(code, 1000), RefusalClass::Temporary, "{code:#x}");
        }
        for code in [UNSPECIFIED_ERROR, IMPLEMENTATION_SPECIFIC_ERROR] {
            assert_eq!(classify(code, 0), RefusalClass::Temporary);
            assert_eq!(
                classify(code, PERSISTENT_ERROR_ROUNDS),
                RefusalClass::Permanent(RejectReason::PersistentError),
                "{code:#x} that never clears is given up"
            );
        }
        assert_eq!(
            classify(NOT_AUTHORIZED, 0),
            RefusalClass::Permanent(RejectReason::NotAuthorized)
        );
        assert_eq!(
            classify(TOPIC_NAME_INVALID, 0),
            RefusalClass::Permanent(RejectReason::TopicNameInvalid)
        );
        assert_eq!(
            classify(PAYLOAD_FORMAT_INVALID, 0),
            RefusalClass::Permanent(RejectReason::PayloadFormatInvalid)
        );
        assert_eq!(
            classify(0xA0, 0),
            RefusalClass::Permanent(RejectReason::Other)
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
