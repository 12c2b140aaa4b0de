//! TLS client configuration for a `coaps+tcp://` upstream: ring provider, the upstream's
//! `ca_file` as the only roots, an optional client identity (`cert_file` + `key_file`).
//!
//! Owns: reading those PEM files into a rustls `ClientConfig`. The files were checked at
//! config load (`config/validate/coap_proxy.rs`); errors here name the file anyway.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use crate::config::CoapProxyConfig;

/// Why an upstream's TLS configuration cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Bad {
        path: std::path::PathBuf,
        what: String,
    },
    #[error("coaps+tcp upstream without ca_file")]
    NoCa,
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The rustls client configuration for upstream `cfg` (a `coaps+tcp://` one).
pub fn client_config(cfg: &CoapProxyConfig) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
    let ca = cfg.ca_file.as_deref().ok_or(TlsError::NoCa)?;
    let mut roots = RootCertStore::empty();
    for cert in certs(ca)? {
        roots.add(cert).map_err(|e| TlsError::Bad {
            path: ca.to_owned(),
            what: e.to_string(),
        })?;
    }
    let builder = builder.with_root_certificates(roots);
    let config = match (&cfg.cert_file, &cfg.key_file) {
        (Some(cert), Some(key)) => {
            builder.with_client_auth_cert(certs(cert)?, private_key(key)?)?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

fn open(path: &Path) -> Result<BufReader<std::fs::File>, TlsError> {
    std::fs::File::open(path)
        .map(BufReader::new)
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut open(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Bad {
            path: path.to_owned(),
            what: "no PEM certificates".into(),
        });
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut open(path)?)
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?
        .ok_or_else(|| TlsError::Bad {
            path: path.to_owned(),
            what: "no PEM private key".into(),
        })
}
