//! TLS on the PHD listener (`[phd.tls]`): the server configuration, the handshake, and the
//! agent's identity from its client certificate.
//!
//! Owns: building the rustls `ServerConfig` once at start-up (ring provider, TLS 1.2 and 1.3:
//! health devices are small and often stop at 1.2; client certificates verified against
//! `client_ca_file` when given, required with `require_client_cert`), the handshake on a
//! fresh connection (bounded by the association timeout, before any APDU is read), and
//! reading the identity — the subject CN of a verified client certificate. Does not own:
//! the records after the handshake (`conn.rs` drives the `rustls::ServerConnection`, which
//! is `Send` and so moves with the socket between the `sluice-phd` thread and the shards in
//! a [`super::Handover`]), or what the identity is bound to (`crate::control::phd`).
//!
//! The rustls connection buffers at most one TLS record of plaintext and of ciphertext on
//! either side (16 KiB each) besides what `conn.rs` reads.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::PhdTlsConfig;

/// What can go wrong building the TLS configuration (at start-up: the gateway does not start).
#[derive(Debug, thiserror::Error)]
pub enum PhdTlsError {
    #[error("cannot read phd.tls.{what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("phd.tls.{what} {path} holds no {kind}")]
    Empty {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
    },
    #[error("phd.tls: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("phd.tls.client_ca_file: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The server configuration of `[phd.tls]`.
pub fn server_config(tls: &PhdTlsConfig) -> Result<Arc<ServerConfig>, PhdTlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
    let builder = match &tls.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certs("client_ca_file", ca)? {
                roots.add(cert)?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if tls.require_client_cert {
                verifier.build()?
            } else {
                verifier.allow_unauthenticated().build()?
            };
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config =
        builder.with_single_cert(certs("cert_file", &tls.cert_file)?, key(&tls.key_file)?)?;
    Ok(Arc::new(config))
}

fn open(what: &'static str, path: &Path) -> Result<BufReader<File>, PhdTlsError> {
    File::open(path)
        .map(BufReader::new)
        .map_err(|source| PhdTlsError::Read {
            what,
            path: path.to_owned(),
            source,
        })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, PhdTlsError> {
    let certs = rustls_pemfile::certs(&mut open(what, path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| PhdTlsError::Read {
            what,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(PhdTlsError::Empty {
            what,
            path: path.to_owned(),
            kind: "certificate",
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, PhdTlsError> {
    rustls_pemfile::private_key(&mut open("key_file", path)?)
        .map_err(|source| PhdTlsError::Read {
            what: "key_file",
            path: path.to_owned(),
            source,
        })?
        .ok_or_else(|| PhdTlsError::Empty {
            what: "key_file",
            path: path.to_owned(),
            kind: "private key",
        })
}

/// Run the handshake of `tls` on `stream`; then the session tickets are written too.
pub async fn handshake(
    stream: &mut TcpStream,
    tls: &mut ServerConnection,
) -> Result<(), std::io::Error> {
    let mut scratch = vec![0u8; 4096];
    loop {
        write_pending(stream, tls).await?;
        if !tls.is_handshaking() {
            return Ok(());
        }
        let n = stream.read(&mut scratch).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let mut input = &scratch[..n];
        while !input.is_empty() {
            tls.read_tls(&mut input)?;
            if let Err(e) = tls.process_new_packets() {
                let _ = write_pending(stream, tls).await; // the alert
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
            }
        }
    }
}

/// Write what rustls has to send (handshake messages, alerts, tickets, records).
pub async fn write_pending(
    stream: &mut TcpStream,
    tls: &mut ServerConnection,
) -> Result<(), std::io::Error> {
    while tls.wants_write() {
        let mut out = Vec::new();
        tls.write_tls(&mut out)?;
        stream.write_all(&out).await?;
    }
    Ok(())
}

/// The identity of a verified client certificate: its subject CN (`None` without a
/// certificate, or without a CN that is UTF-8 of at most 64 bytes).
pub fn identity(tls: &ServerConnection) -> Option<Arc<str>> {
    let leaf = tls.peer_certificates()?.first()?;
    let cn = subject_cn(leaf.as_ref())?;
    (cn.len() <= 64).then(|| Arc::from(cn))
}

/// One DER TLV at the front of `input`: (tag, contents, rest).
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7F);
        if n == 0 || n > 3 || rest.len() < n {
            return None;
        }
        let mut len = 0usize;
        for &b in &rest[..n] {
            len = (len << 8) | usize::from(b);
        }
        rest = &rest[n..];
        len
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The subject CN (OID 2.5.4.3) of a DER certificate: Certificate = SEQUENCE { tbs SEQUENCE {
/// [0] version?, serial, signature, issuer, validity, subject, … }, … }.
fn subject_cn(cert: &[u8]) -> Option<String> {
    const CN: [u8; 3] = [0x55, 0x04, 0x03];
    let (_, cert, _) = tlv(cert)?;
    let (_, tbs, _) = tlv(cert)?;
    let (tag, _, after_version) = tlv(tbs)?;
    // Without the [0] version field the serial comes first.
    let mut rest = if tag == 0xA0 { after_version } else { tbs };
    // serial, signature, issuer, validity; then the subject.
    for _ in 0..4 {
        rest = tlv(rest)?.2;
    }
    let (_, mut subject, _) = tlv(rest)?;
    while !subject.is_empty() {
        let (_, mut rdn, next) = tlv(subject)?; // SET OF AttributeTypeAndValue
        subject = next;
        while !rdn.is_empty() {
            let (_, attr, next) = tlv(rdn)?;
            rdn = next;
            let (_, oid, value) = tlv(attr)?;
            if oid == CN {
                let (_, text, _) = tlv(value)?;
                return std::str::from_utf8(text).ok().map(str::to_owned);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subject_cn_is_read_from_a_certificate_and_garbage_gives_none() {
        let pki = sluice_testkit::TestPki::generate();
        let der = certs("cert_file", pki.client_cert_path()).unwrap()[0].to_vec();
        assert_eq!(
            subject_cn(&der).as_deref(),
            Some(sluice_testkit::certs::CLIENT_COMMON_NAME)
        );
        for cut in 0..der.len() {
            let _ = subject_cn(&der[..cut]); // never panics
        }
        assert_eq!(subject_cn(&[0x30, 0x82, 0xFF]), None);
    }
}
