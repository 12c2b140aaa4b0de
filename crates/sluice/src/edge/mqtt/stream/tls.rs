//! MQTT over TLS: the server configuration, the handshake on the listener's thread, the
//! record layer on the shard, and the identity a client certificate gives.
//!
//! Owns: building the rustls `ServerConfig` from `[mqtt.tls]` (TLS 1.3, and 1.2 unless
//! `min_version = "1.3"`; the `ring` provider; client certificates verified against
//! `client_ca_file` with rustls' `WebPkiClientVerifier`, optional unless
//! `require_client_cert`), driving a handshake within a deadline, and [`TlsCore`]: one
//! tokio `TcpStream` plus one rustls `ServerConnection`, read and written without
//! tokio-rustls. Does not own: what the identity permits (admission) or MQTT.
//!
//! Why not tokio-rustls' `TlsStream`: the handshake runs on the listener's runtime and the
//! session continues on a shard's; a `TlsStream` cannot be rebuilt from a socket and a
//! `ServerConnection`, and it cannot be split into halves that the connection code can use
//! without a lock. rustls' `ServerConnection` is `Send` and sans-IO enough: `read_tls` /
//! `process_new_packets` / `reader()` in, `writer()` / `write_tls` out. So the socket is
//! detached after the handshake (`into_std`), sent with the `ServerConnection` to the shard,
//! and re-registered there; the two halves share this core through an `Rc`.
//!
//! Memory: rustls keeps a record buffer per connection (4 KiB once a record has been read;
//! it shrinks back to 4 KiB after a large one but is not released), plus its key schedule
//! and state; see docs/memory.md for the measured cost per idle TLS connection.
//!
//! Identity ([`cert_identity`]): the leaf certificate's subject CN, else its first DNS
//! subject alternative name, else its first URI one — Mosquitto's `use_identity_as_username`
//! uses the CN; SANs are the fallback for certificates that carry no CN, as RFC 6125 prefers.

use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::sync::Arc;

use bytes::BytesMut;
use rustls::pki_types::CertificateDer;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};
use tokio::net::TcpStream;

use crate::config::{MqttTlsConfig, TlsMinVersion};

/// Why the TLS listener cannot be set up (at start-up).
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: io::Error,
    },
    #[error("{path}: no certificate or key found in PEM")]
    Empty { path: std::path::PathBuf },
    #[error("client_ca_file: {0}")]
    Verifier(String),
    #[error("certificate and key: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Why a device's TLS handshake failed; each is a reason label of
/// `sluice_mqtt_tls_handshake_failures_total`.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("no handshake within connect_timeout")]
    Timeout,
    #[error("peer closed during the handshake")]
    Closed,
    /// A client certificate refused (unknown CA, expired, none when one is required).
    #[error("client certificate refused: {0}")]
    Certificate(rustls::Error),
    #[error("TLS protocol: {0}")]
    Protocol(rustls::Error),
    #[error("socket: {0}")]
    Io(io::Error),
}

impl HandshakeError {
    /// The metric's reason label.
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Timeout => "timeout",
            HandshakeError::Closed => "closed",
            HandshakeError::Certificate(_) => "certificate",
            HandshakeError::Protocol(_) => "protocol",
            HandshakeError::Io(_) => "io",
        }
    }
}

/// The rustls configuration of `[mqtt.tls]` (shared by the tls and wss listeners).
pub fn server_config(cfg: &MqttTlsConfig) -> Result<Arc<ServerConfig>, TlsSetupError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&'static rustls::SupportedProtocolVersion] =
        if cfg.min_version == TlsMinVersion::Tls12 {
            &[&rustls::version::TLS13, &rustls::version::TLS12]
        } else {
            &[&rustls::version::TLS13]
        };
    let builder =
        ServerConfig::builder_with_provider(provider.clone()).with_protocol_versions(versions)?;
    let builder = match &cfg.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certs(path)? {
                roots
                    .add(cert)
                    .map_err(|e| TlsSetupError::Verifier(e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if cfg.require_client_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            builder.with_client_cert_verifier(
                verifier
                    .build()
                    .map_err(|e| TlsSetupError::Verifier(e.to_string()))?,
            )
        }
    };
    let certs = read_certs(&cfg.cert_file)?;
    let key = {
        let file = std::fs::File::open(&cfg.key_file).map_err(|source| TlsSetupError::Read {
            path: cfg.key_file.clone(),
            source,
        })?;
        rustls_pemfile::private_key(&mut io::BufReader::new(file))
            .map_err(|source| TlsSetupError::Read {
                path: cfg.key_file.clone(),
                source,
            })?
            .ok_or_else(|| TlsSetupError::Empty {
                path: cfg.key_file.clone(),
            })?
    };
    let mut config = builder.with_single_cert(certs, key)?;
    // No resumption state per device kept in the gateway: devices reconnect rarely, and a
    // ticket or cache entry per device would be memory device input can grow.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

fn read_certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let read_err = |source| TlsSetupError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_err)?;
    let certs = rustls_pemfile::certs(&mut io::BufReader::new(file))
        .collect::<Result<Vec<_>, _>>()
        .map_err(read_err)?;
    if certs.is_empty() {
        return Err(TlsSetupError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// Run the server side of a TLS handshake on `tcp` until it completes or `deadline`.
pub async fn handshake(
    tcp: TcpStream,
    config: Arc<ServerConfig>,
    deadline: tokio::time::Instant,
) -> Result<TlsCore, HandshakeError> {
    let mut conn = ServerConnection::new(config).map_err(HandshakeError::Protocol)?;
    loop {
        while conn.wants_write() {
            match conn.write_tls(&mut TcpIo(&tcp)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    within(deadline, tcp.writable()).await?
                }
                Err(e) => return Err(HandshakeError::Io(e)),
            }
        }
        if !conn.is_handshaking() {
            break;
        }
        match conn.read_tls(&mut TcpIo(&tcp)) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(_) => {
                if let Err(error) = conn.process_new_packets() {
                    // Tell the device why (the alert), as far as the socket takes it now.
                    let _ = conn.write_tls(&mut TcpIo(&tcp));
                    return Err(classify(error));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                within(deadline, tcp.readable()).await?
            }
            Err(e) => return Err(HandshakeError::Io(e)),
        }
    }
    Ok(TlsCore::new(tcp, Box::new(conn)))
}

async fn within(
    deadline: tokio::time::Instant,
    ready: impl std::future::Future<Output = io::Result<()>>,
) -> Result<(), HandshakeError> {
    match tokio::time::timeout_at(deadline, ready).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(HandshakeError::Io(e)),
        Err(_) => Err(HandshakeError::Timeout),
    }
}

fn classify(error: rustls::Error) -> HandshakeError {
    match error {
        rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented => {
            HandshakeError::Certificate(error)
        }
        other => HandshakeError::Protocol(other),
    }
}

/// The identity a verified client certificate gives: CN, else the first DNS SAN, else the
/// first URI SAN. `None` when the device presented no certificate or it names nothing.
pub fn cert_identity(conn: &ServerConnection) -> Option<String> {
    let leaf = conn.peer_certificates()?.first()?;
    let cert = webpki::EndEntityCert::try_from(leaf).ok()?;
    if let Some(cn) = common_name(cert.subject()) {
        return Some(cn);
    }
    if let Some(dns) = cert.valid_dns_names().next() {
        return Some(dns.to_string());
    }
    cert.valid_uri_names().next().map(str::to_string)
}

/// The (first) commonName in a DER Name's contents: SET { SEQUENCE { OID, value } } ...
fn common_name(mut name: &[u8]) -> Option<String> {
    const CN_OID: &[u8] = &[0x55, 0x04, 0x03];
    while !name.is_empty() {
        let (tag, rdn, rest) = der_item(name)?;
        name = rest;
        if tag != 0x31 {
            return None;
        }
        let mut rdn = rdn;
        while !rdn.is_empty() {
            let (tag, atv, rest) = der_item(rdn)?;
            rdn = rest;
            if tag != 0x30 {
                return None;
            }
            let (oid_tag, oid, value) = der_item(atv)?;
            if oid_tag != 0x06 || oid != CN_OID {
                continue;
            }
            let (value_tag, value, _) = der_item(value)?;
            // UTF8String, PrintableString, IA5String, TeletexString (as Latin-1-ish ASCII).
            if matches!(value_tag, 0x0C | 0x13 | 0x16 | 0x14) {
                return std::str::from_utf8(value)
                    .ok()
                    .filter(|s| !s.is_empty())
                    .map(str::to_string);
            }
            return None;
        }
    }
    None
}

/// One DER TLV: (tag, contents, rest). Definite lengths up to 4 bytes only.
fn der_item(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        first as usize
    } else {
        let n = (first & 0x7F) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let mut len = 0usize;
        for &b in &rest[..n] {
            len = (len << 8) | b as usize;
        }
        rest = &rest[n..];
        len
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// `io::Read`/`io::Write` over a shared tokio socket, without waiting (`WouldBlock` clears
/// tokio's readiness so the next `readable()`/`writable()` waits for the kernel).
struct TcpIo<'a>(&'a TcpStream);

impl Read for TcpIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

impl Write for TcpIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One TLS connection after its handshake: the socket and the rustls state, shared by the
/// connection's two halves (`Rc`, one task).
pub struct TlsCore {
    tcp: TcpStream,
    tls: RefCell<Box<ServerConnection>>,
}

impl TlsCore {
    pub(super) fn new(tcp: TcpStream, conn: Box<ServerConnection>) -> TlsCore {
        TlsCore {
            tcp,
            tls: RefCell::new(conn),
        }
    }

    pub(super) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The identity its client certificate gives, if any ([`cert_identity`]).
    pub fn identity(&self) -> Option<String> {
        cert_identity(&self.tls.borrow())
    }

    /// Whether the device presented a (verified) certificate.
    pub fn has_client_cert(&self) -> bool {
        self.tls
            .borrow()
            .peer_certificates()
            .is_some_and(|c| !c.is_empty())
    }

    pub(super) fn into_parts(self) -> io::Result<(std::net::TcpStream, Box<ServerConnection>)> {
        Ok((self.tcp.into_std()?, self.tls.into_inner()))
    }

    /// Plaintext into `buf` without waiting: `Ok(0)` when the device closed (close_notify
    /// or EOF), `WouldBlock` when nothing is readable now, `InvalidData` on a TLS error
    /// (its alert is sent as far as the socket takes it).
    pub(super) fn try_read_plain(&self, buf: &mut BytesMut) -> io::Result<usize> {
        let mut tls = self.tls.borrow_mut();
        loop {
            let state = tls
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let available = state.plaintext_bytes_to_read();
            if available > 0 {
                let start = buf.len();
                buf.resize(start + available, 0);
                let read = tls.reader().read(&mut buf[start..]);
                match read {
                    Ok(n) => {
                        buf.truncate(start + n);
                        return Ok(n);
                    }
                    Err(e) => {
                        buf.truncate(start);
                        return Err(e);
                    }
                }
            }
            if state.peer_has_closed() {
                return Ok(0);
            }
            match tls.read_tls(&mut TcpIo(&self.tcp)) {
                Ok(0) => return Ok(0),
                Ok(_) => {}
                Err(e) => return Err(e),
            }
            if let Err(error) = tls.process_new_packets() {
                let _ = tls.write_tls(&mut TcpIo(&self.tcp));
                return Err(io::Error::new(io::ErrorKind::InvalidData, error));
            }
            // Records the state machine answers by itself (key updates): send them now if
            // the socket takes them; otherwise they go before the next write.
            while tls.wants_write() {
                if tls.write_tls(&mut TcpIo(&self.tcp)).is_err() {
                    break;
                }
            }
        }
    }

    /// Wait for plaintext and read it into `buf`. Cancel-safe (awaits only readiness).
    pub(super) async fn read_plain(&self, buf: &mut BytesMut) -> io::Result<usize> {
        loop {
            match self.try_read_plain(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.tcp.readable().await?,
                other => return other,
            }
        }
    }

    /// Encrypt `data` and write the records the socket takes now; returns how much of
    /// `data` rustls took (its send buffer is bounded; the rest waits for the next call).
    pub(super) fn try_write(&self, data: &[u8]) -> io::Result<usize> {
        let mut tls = self.tls.borrow_mut();
        let n = tls.writer().write(data)?;
        while tls.wants_write() {
            match tls.write_tls(&mut TcpIo(&self.tcp)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }

    /// Encrypt and write all of `data`.
    pub(super) async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        loop {
            {
                let mut tls = self.tls.borrow_mut();
                while !data.is_empty() {
                    let n = tls.writer().write(data)?;
                    if n == 0 {
                        break;
                    }
                    data = &data[n..];
                }
                loop {
                    if !tls.wants_write() {
                        if data.is_empty() {
                            return Ok(());
                        }
                        break;
                    }
                    match tls.write_tls(&mut TcpIo(&self.tcp)) {
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e),
                    }
                }
            }
            self.tcp.writable().await?;
        }
    }

    /// Send close_notify, then half-close the socket.
    pub(super) async fn shutdown(&self) -> io::Result<()> {
        self.tls.borrow_mut().send_close_notify();
        self.write_all(&[]).await?;
        super::shutdown_write(&self.tcp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_name_is_found_among_other_attributes() {
        // Name contents: SET{SEQ{OID 2.5.4.10 (O), UTF8 "org"}}, SET{SEQ{OID 2.5.4.3, UTF8 "dev-1"}}
        let name = [
            0x31, 0x0C, 0x30, 0x0A, 0x06, 0x03, 0x55, 0x04, 0x0A, 0x0C, 0x03, b'o', b'r', b'g',
            0x31, 0x0E, 0x30, 0x0C, 0x06, 0x03, 0x55, 0x04, 0x03, 0x0C, 0x05, b'd', b'e', b'v',
            b'-', b'1',
        ];
        assert_eq!(common_name(&name).as_deref(), Some("dev-1"));
        assert_eq!(common_name(&name[..14]), None);
        // Truncated input never panics.
        for i in 0..name.len() {
            let _ = common_name(&name[..i]);
        }
    }
}
