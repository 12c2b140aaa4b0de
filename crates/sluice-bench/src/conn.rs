//! Connection plumbing shared by the device generator and the sink: address resolution, the
//! TLS 1.3 client configuration, and the MQTT CONNECT/CONNACK and read-one-packet steps on any
//! byte stream.
//!
//! Owns: turning "HOST:PORT" and PEM files into a connected, MQTT-handshaken stream. Does not
//! own: what is sent afterwards (each role runs its own loop for efficiency) or retries.
//!
//! TLS: rustls with the `ring` provider, TLS 1.3 only, trust anchors only from the given CA file
//! (no system roots), optional client certificate. The server name is the host part of the
//! address (an IP address is verified against the certificate's IP SANs).
//!
//! Invariants: bytes from the peer never panic — decode errors, early close and time-outs are
//! errors that name the peer.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::BytesMut;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use sluice_proto::mqtt::{encode, ConnAck, Connect, Decoder, Packet, ProtocolVersion};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tokio_rustls::TlsConnector;

/// Largest packet accepted from a broker (the sink's PUBLISHes are at most a few KiB).
pub const MAX_INBOUND_PACKET: usize = 1 << 20;

/// A byte stream to a broker: plain TCP or TLS over TCP.
pub trait BrokerIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> BrokerIo for T {}

/// Resolve "HOST:PORT" (first address wins).
pub async fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    tokio::net::lookup_host(addr)
        .await
        .with_context(|| format!("resolving {addr:?} (expected HOST:PORT)"))?
        .next()
        .ok_or_else(|| anyhow!("{addr:?} resolved to no address"))
}

/// The host part of "HOST:PORT" (brackets of an IPv6 literal removed).
pub fn host_part(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// TLS 1.3-only rustls client config (ring provider) trusting only the CA certificates in
/// `ca_file`, presenting `client_cert` (certificate chain PEM, private key PEM) if given.
pub fn tls_client_config(
    ca_file: &Path,
    client_cert: Option<(&Path, &Path)>,
) -> anyhow::Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca_file)? {
        roots.add(cert).with_context(|| {
            format!(
                "{} holds a certificate rustls cannot use",
                ca_file.display()
            )
        })?;
    }
    if roots.is_empty() {
        bail!("{} holds no PEM certificate", ca_file.display());
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .context("the ring provider does not support TLS 1.3")?
            .with_root_certificates(roots);
    let config = match client_cert {
        None => builder.with_no_client_auth(),
        Some((cert_file, key_file)) => {
            let chain = read_certs(cert_file)?;
            let key = read_key(key_file)?;
            builder
                .with_client_auth_cert(chain, key)
                .context("the client key does not match its certificate")?
        }
    };
    Ok(Arc::new(config))
}

fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing PEM certificates in {}", path.display()))
}

fn read_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .with_context(|| format!("parsing the PEM private key in {}", path.display()))?
        .ok_or_else(|| anyhow!("{} holds no PEM private key", path.display()))
}

/// Open TCP (TCP_NODELAY) and, if `tls` is given, a TLS session verified for `server_name`.
pub async fn open(
    addr: SocketAddr,
    tls: Option<(&Arc<ClientConfig>, &str)>,
    connect_timeout: Duration,
) -> anyhow::Result<Box<dyn BrokerIo>> {
    let tcp = timeout(connect_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| anyhow!("TCP connect to {addr} timed out after {connect_timeout:?}"))?
        .with_context(|| format!("TCP connect to {addr}"))?;
    tcp.set_nodelay(true).context("setting TCP_NODELAY")?;
    let Some((config, name)) = tls else {
        return Ok(Box::new(tcp));
    };
    let server_name = ServerName::try_from(name.to_string())
        .with_context(|| format!("{name:?} is not a valid TLS server name"))?;
    let stream = timeout(
        connect_timeout,
        TlsConnector::from(config.clone()).connect(server_name, tcp),
    )
    .await
    .map_err(|_| anyhow!("TLS handshake with {addr} timed out after {connect_timeout:?}"))?
    .with_context(|| format!("TLS 1.3 handshake with {addr} as {name:?}"))?;
    Ok(Box::new(stream))
}

/// Encode `packet` and write it out.
pub async fn send<S: AsyncWrite + Unpin + ?Sized>(
    io: &mut S,
    packet: &Packet,
    version: ProtocolVersion,
    wbuf: &mut BytesMut,
) -> anyhow::Result<()> {
    wbuf.clear();
    encode(packet, version, wbuf).with_context(|| format!("encoding {}", packet.name()))?;
    io.write_all(wbuf)
        .await
        .with_context(|| format!("writing {}", packet.name()))?;
    Ok(())
}

/// Read until one whole packet is decoded. EOF and decode errors are errors.
pub async fn read_packet<S: AsyncRead + Unpin + ?Sized>(
    io: &mut S,
    rbuf: &mut BytesMut,
    decoder: &mut Decoder,
) -> anyhow::Result<Packet> {
    loop {
        if let Some(packet) = decoder
            .decode(rbuf)
            .context("the broker sent a malformed packet")?
        {
            return Ok(packet);
        }
        if rbuf.capacity() - rbuf.len() < 1024 {
            rbuf.reserve(4096);
        }
        let n = io.read_buf(rbuf).await.context("reading from the broker")?;
        if n == 0 {
            bail!("the broker closed the connection");
        }
    }
}

/// Send CONNECT and wait (at most `wait`) for a successful CONNACK.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin + ?Sized>(
    io: &mut S,
    connect: Connect,
    rbuf: &mut BytesMut,
    wbuf: &mut BytesMut,
    decoder: &mut Decoder,
    wait: Duration,
) -> anyhow::Result<ConnAck> {
    let version = connect.protocol;
    send(io, &Packet::Connect(connect), version, wbuf).await?;
    let packet = timeout(wait, read_packet(io, rbuf, decoder))
        .await
        .map_err(|_| anyhow!("no CONNACK within {wait:?}"))??;
    match packet {
        Packet::ConnAck(ack) if ack.code == 0 => Ok(ack),
        Packet::ConnAck(ack) => bail!(
            "the broker refused the connection: CONNACK code 0x{:02x}",
            ack.code
        ),
        other => bail!(
            "the broker sent {} before CONNACK (protocol violation)",
            other.name()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_part_strips_port_and_ipv6_brackets() {
        assert_eq!(host_part("127.0.0.1:8883"), "127.0.0.1");
        assert_eq!(host_part("localhost:1883"), "localhost");
        assert_eq!(host_part("[::1]:8883"), "::1");
    }
}
