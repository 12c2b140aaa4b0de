//! TLS client configuration for the cloud connection: ring provider, TLS 1.3 only.
//!
//! Built once at start-up ([`client_tls_config`]) so unreadable or malformed files fail fast
//! with an error naming the file. Roots come from `ca_file` (PEM, one or more certificates);
//! without `ca_file` the system bundle is used (`SSL_CERT_FILE`, then the usual Debian, RHEL
//! and Alpine paths). A client identity is optional: `cert_file` (PEM chain, leaf first) and
//! `key_file` (PEM, PKCS#8, PKCS#1 or SEC1) must be given together.
//!
//! A reload replaces an uplink's roots and client certificate without a restart
//! ([`reloadable_client_tls`]): its configuration then verifies the server and picks its
//! certificate through a [`ReloadableClientTls`], whose current [`ClientTlsParts`] are read
//! with one atomic load at each handshake. A connection keeps what it was made with; the next
//! connect uses the new files. It also keeps the TLS session cache, emptied by a replacement:
//! a resumed session skips the server's certificate, so new roots would otherwise wait for
//! the old tickets to run out.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{
    ClientSessionMemoryCache, ClientSessionStore, ResolvesClientCert, Resumption,
    Tls12ClientSessionValue, Tls13ClientSessionValue, WebPkiServerVerifier,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

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

/// An uplink's roots (as a verifier) and client certificate, read from its files.
#[derive(Debug)]
pub struct ClientTlsParts {
    verifier: Arc<WebPkiServerVerifier>,
    identity: Option<Arc<CertifiedKey>>,
}

impl ClientTlsParts {
    /// Read `cfg`'s `ca_file` (else the system bundle), `cert_file` and `key_file`.
    pub fn load(cfg: &UplinkConfig) -> Result<ClientTlsParts, UplinkError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca_path = match cfg.ca_file.as_deref() {
            Some(p) => p.to_path_buf(),
            None => system_bundle()?,
        };
        let roots = roots_from(&ca_path)?;
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| {
                    UplinkError::TlsConfig(Box::new(rustls::Error::General(e.to_string())))
                })?;
        let identity = match (cfg.cert_file.as_deref(), cfg.key_file.as_deref()) {
            (None, None) => None,
            (Some(_), None) => return Err(UplinkError::HalfClientIdentity { given: "cert_file" }),
            (None, Some(_)) => return Err(UplinkError::HalfClientIdentity { given: "key_file" }),
            (Some(cert), Some(key)) => {
                let chain = read_certs("cert", cert)?;
                let key_der = read_key(key)?;
                let certified =
                    CertifiedKey::from_der(chain, key_der, &provider).map_err(|source| {
                        UplinkError::BadClientIdentity {
                            cert: cert.to_path_buf(),
                            key: key.to_path_buf(),
                            source: Box::new(source),
                        }
                    })?;
                Some(Arc::new(certified))
            }
        };
        Ok(ClientTlsParts { verifier, identity })
    }
}

/// The verifier and client-certificate resolver of a reloadable uplink configuration: both
/// answer from the current [`ClientTlsParts`].
#[derive(Debug)]
pub struct ReloadableClientTls {
    current: ArcSwap<ClientTlsParts>,
    /// Sessions to resume (rustls' default store, of its default size), forgotten with the
    /// parts they were verified under.
    sessions: ArcSwap<ClientSessionMemoryCache>,
}

/// Sessions kept for resumption per uplink configuration (rustls' default).
const RESUMABLE_SESSIONS: usize = 256;

impl ReloadableClientTls {
    /// Use `parts` from the next handshake on (a reload), and resume no session made before.
    pub fn replace(&self, parts: ClientTlsParts) {
        self.current.store(Arc::new(parts));
        self.sessions
            .store(Arc::new(ClientSessionMemoryCache::new(RESUMABLE_SESSIONS)));
    }
}

impl ClientSessionStore for ReloadableClientTls {
    fn set_kx_hint(&self, server_name: ServerName<'static>, group: rustls::NamedGroup) {
        self.sessions.load().set_kx_hint(server_name, group)
    }

    fn kx_hint(&self, server_name: &ServerName<'_>) -> Option<rustls::NamedGroup> {
        self.sessions.load().kx_hint(server_name)
    }

    fn set_tls12_session(&self, server_name: ServerName<'static>, value: Tls12ClientSessionValue) {
        self.sessions.load().set_tls12_session(server_name, value)
    }

    fn tls12_session(&self, server_name: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        self.sessions.load().tls12_session(server_name)
    }

    fn remove_tls12_session(&self, server_name: &ServerName<'static>) {
        self.sessions.load().remove_tls12_session(server_name)
    }

    fn insert_tls13_ticket(
        &self,
        server_name: ServerName<'static>,
        value: Tls13ClientSessionValue,
    ) {
        self.sessions.load().insert_tls13_ticket(server_name, value)
    }

    fn take_tls13_ticket(
        &self,
        server_name: &ServerName<'static>,
    ) -> Option<Tls13ClientSessionValue> {
        self.sessions.load().take_tls13_ticket(server_name)
    }
}

impl ServerCertVerifier for ReloadableClientTls {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.current.load().verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current
            .load()
            .verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current
            .load()
            .verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current.load().verifier.supported_verify_schemes()
    }
}

impl ResolvesClientCert for ReloadableClientTls {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.current.load().identity.clone()
    }

    fn has_certs(&self) -> bool {
        self.current.load().identity.is_some()
    }
}

/// [`client_tls_config`] whose roots and client certificate a reload can replace through the
/// returned [`ReloadableClientTls`] (TLS 1.3 only, like the uplink's).
pub fn reloadable_client_tls(
    cfg: &UplinkConfig,
) -> Result<(Arc<ClientConfig>, Arc<ReloadableClientTls>), UplinkError> {
    let live = Arc::new(ReloadableClientTls {
        current: ArcSwap::from_pointee(ClientTlsParts::load(cfg)?),
        sessions: ArcSwap::from_pointee(ClientSessionMemoryCache::new(RESUMABLE_SESSIONS)),
    });
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| UplinkError::TlsConfig(Box::new(e)))?
        .dangerous()
        .with_custom_certificate_verifier(live.clone())
        .with_client_cert_resolver(live.clone());
    config.resumption = Resumption::store(live.clone());
    Ok((Arc::new(config), live))
}

fn roots_from(ca_path: &Path) -> Result<RootCertStore, UplinkError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs("ca", ca_path)? {
        roots
            .add(cert)
            .map_err(|source| UplinkError::BadCaCertificate {
                path: ca_path.to_path_buf(),
                source: Box::new(source),
            })?;
    }
    Ok(roots)
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
