//! TLS client configuration for the cloud connection: ring provider, TLS 1.3 only.
//!
//! Built once at start-up ([`client_tls_config`]) so unreadable or malformed files fail fast
//! with an error naming the file. Roots come from `ca_file` (PEM, one or more certificates);
//! without `ca_file` the system bundle is used (`SSL_CERT_FILE`, then the usual Debian, RHEL
//! and Alpine paths). A client identity is optional: `cert_file` (PEM chain, leaf first) and
//! `key_file` (PEM, PKCS#8, PKCS#1 or SEC1) must be given together.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use crate::config::UplinkConfig;
use crate::sink::UplinkError;

const SYSTEM_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
    "/etc/ssl/ca-bundle.pem",
];
const SYSTEM_BUNDLES_TEXT: &str =
    "/etc/ssl/certs/ca-certificates.crt, /etc/pki/tls/certs/ca-bundle.crt, /etc/ssl/cert.pem, /etc/ssl/ca-bundle.pem";

/// The TLS client configuration for `cfg`'s cloud connection (whether or not its url uses TLS:
/// the caller decides to call this only for `url.tls`).
pub fn client_tls_config(cfg: &UplinkConfig) -> Result<Arc<ClientConfig>, UplinkError> {
    client_config(
        cfg.ca_file.as_deref(),
        cfg.cert_file.as_deref(),
        cfg.key_file.as_deref(),
        &[&rustls::version::TLS13],
    )
}

/// A TLS client configuration from PEM files: roots from `ca_file` (else the system bundle),
/// an optional client identity, the given protocol versions. The uplink's (TLS 1.3 only) and
/// the CoAP proxy's `coaps+tcp://` upstreams (TLS 1.2 and 1.3, as RFC 8323 allows) use it.
pub fn client_config(
    ca_file: Option<&Path>,
    cert_file: Option<&Path>,
    key_file: Option<&Path>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<Arc<ClientConfig>, UplinkError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| UplinkError::TlsConfig(Box::new(e)))?;

    let ca_path = match ca_file {
        Some(p) => p.to_path_buf(),
        None => system_bundle()?,
    };
    let mut roots = RootCertStore::empty();
    for cert in read_certs("ca", &ca_path)? {
        roots
            .add(cert)
            .map_err(|source| UplinkError::BadCaCertificate {
                path: ca_path.clone(),
                source: Box::new(source),
            })?;
    }
    let builder = builder.with_root_certificates(roots);

    let config = match (cert_file, key_file) {
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => return Err(UplinkError::HalfClientIdentity { given: "cert_file" }),
        (None, Some(_)) => return Err(UplinkError::HalfClientIdentity { given: "key_file" }),
        (Some(cert), Some(key)) => {
            let chain = read_certs("cert", cert)?;
            let key_der = read_key(key)?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|source| UplinkError::BadClientIdentity {
                    cert: cert.to_path_buf(),
                    key: key.to_path_buf(),
                    source: Box::new(source),
                })?
        }
    };
    Ok(Arc::new(config))
}

fn system_bundle() -> Result<PathBuf, UplinkError> {
    if let Some(p) = std::env::var_os("SSL_CERT_FILE") {
        return Ok(PathBuf::from(p));
    }
    SYSTEM_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or(UplinkError::NoSystemRoots {
            tried: SYSTEM_BUNDLES_TEXT,
        })
}

fn open(what: &'static str, path: &Path) -> Result<BufReader<File>, UplinkError> {
    File::open(path)
        .map(BufReader::new)
        .map_err(|source| UplinkError::ReadFile {
            what,
            path: path.to_owned(),
            source,
        })
}

fn read_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, UplinkError> {
    let mut r = open(what, path)?;
    let certs = rustls_pemfile::certs(&mut r)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| UplinkError::ReadFile {
            what,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(UplinkError::NoCertificates {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, UplinkError> {
    let mut r = open("key", path)?;
    rustls_pemfile::private_key(&mut r)
        .map_err(|source| UplinkError::ReadFile {
            what: "key",
            path: path.to_owned(),
            source,
        })?
        .ok_or_else(|| UplinkError::NoPrivateKey {
            path: path.to_owned(),
        })
}
