//! A throw-away PKI generated at test time: one CA, a server certificate and a client
//! certificate, as PEM files in a temporary directory and as ready-made rustls configs.
//!
//! Owns: key generation (ECDSA P-256 via rcgen), the PEM files and their directory (deleted
//! when the [`TestPki`] is dropped). Does not own: any listener or connection — the broker
//! launcher and the test client only read the paths and configs handed out here.
//!
//! Files written into [`TestPki::dir`]:
//! - `ca.pem`      self-signed CA certificate (CN "sluice-test-ca", CA:TRUE)
//! - `server.pem`  server certificate, SAN = DNS `localhost` + IP `127.0.0.1`, signed by the CA
//! - `server.key`  its PKCS#8 private key
//! - `client.pem`  client certificate, CN "sluice-test-client", signed by the CA
//! - `client.key`  its PKCS#8 private key
//!
//! Invariants: every certificate chains to `ca.pem`; nothing is ever read from outside the
//! directory (no system trust store), so tests are hermetic. rustls configs handed out use
//! the `ring` provider and only the protocol versions the caller asked for (TLS 1.3 by default).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig, SupportedProtocolVersion};
use tempfile::TempDir;

/// Common name of the client certificate.
pub const CLIENT_COMMON_NAME: &str = "sluice-test-client";
/// Common name of the CA certificate.
pub const CA_COMMON_NAME: &str = "sluice-test-ca";
/// DNS name the server certificate is valid for (it is also valid for IP 127.0.0.1).
pub const SERVER_NAME: &str = "localhost";

/// A CA plus a server and a client certificate, written to a temporary directory it owns.
pub struct TestPki {
    dir: TempDir,
    ca_path: PathBuf,
    server_cert_path: PathBuf,
    server_key_path: PathBuf,
    client_cert_path: PathBuf,
    client_key_path: PathBuf,
    ca_der: CertificateDer<'static>,
    server_der: CertificateDer<'static>,
    server_key_der: Vec<u8>,
    client_der: CertificateDer<'static>,
    client_key_der: Vec<u8>,
}

impl std::fmt::Debug for TestPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Private keys are left out on purpose.
        f.debug_struct("TestPki")
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

impl TestPki {
    /// Generate a fresh PKI. Panics only if key generation or a write to a fresh temporary
    /// directory fails, which means the machine (not the test) is broken; use
    /// [`TestPki::try_generate`] to handle that as an error instead.
    pub fn generate() -> TestPki {
        match TestPki::try_generate() {
            Ok(pki) => pki,
            // Invariant: generation only fails on RNG or filesystem failure of the host.
            Err(e) => panic!("generating the test PKI failed: {e:#}"),
        }
    }

    /// Generate a fresh PKI, reporting failures as errors.
    pub fn try_generate() -> anyhow::Result<TestPki> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-testkit-pki-")
            .tempdir()
            .context("creating a temporary directory for the test PKI")?;

        // CA
        let ca_key = KeyPair::generate().context("generating the CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).context("CA params")?;
        ca_params.distinguished_name = dn(CA_COMMON_NAME);
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params
            .self_signed(&ca_key)
            .context("self-signing the CA")?;

        // Server: localhost + 127.0.0.1 (rcgen turns strings that parse as IPs into IP SANs).
        let server_key = KeyPair::generate().context("generating the server key")?;
        let mut server_params =
            CertificateParams::new(vec![SERVER_NAME.to_string(), "127.0.0.1".to_string()])
                .context("server params")?;
        server_params.distinguished_name = dn(SERVER_NAME);
        server_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server_params
            .signed_by(&server_key, &ca_cert, &ca_key)
            .context("signing the server certificate")?;

        // Client
        let client_key = KeyPair::generate().context("generating the client key")?;
        let mut client_params =
            CertificateParams::new(Vec::<String>::new()).context("client params")?;
        client_params.distinguished_name = dn(CLIENT_COMMON_NAME);
        client_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = client_params
            .signed_by(&client_key, &ca_cert, &ca_key)
            .context("signing the client certificate")?;

        let write = |name: &str, contents: &str| -> anyhow::Result<PathBuf> {
            let path = dir.path().join(name);
            fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        };
        let ca_path = write("ca.pem", &ca_cert.pem())?;
        let server_cert_path = write("server.pem", &server_cert.pem())?;
        let server_key_path = write("server.key", &server_key.serialize_pem())?;
        let client_cert_path = write("client.pem", &client_cert.pem())?;
        let client_key_path = write("client.key", &client_key.serialize_pem())?;

        Ok(TestPki {
            ca_path,
            server_cert_path,
            server_key_path,
            client_cert_path,
            client_key_path,
            ca_der: ca_cert.der().clone(),
            server_der: server_cert.der().clone(),
            server_key_der: server_key.serialize_der(),
            client_der: client_cert.der().clone(),
            client_key_der: client_key.serialize_der(),
            dir,
        })
    }

    /// The directory holding the PEM files; deleted when `self` is dropped.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    /// `ca.pem`: the CA certificate every other certificate chains to.
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }
    /// `server.pem`: server certificate for `localhost` and `127.0.0.1`.
    pub fn server_cert_path(&self) -> &Path {
        &self.server_cert_path
    }
    /// `server.key`: the server's PKCS#8 private key (PEM).
    pub fn server_key_path(&self) -> &Path {
        &self.server_key_path
    }
    /// `client.pem`: client certificate with CN [`CLIENT_COMMON_NAME`].
    pub fn client_cert_path(&self) -> &Path {
        &self.client_cert_path
    }
    /// `client.key`: the client's PKCS#8 private key (PEM).
    pub fn client_key_path(&self) -> &Path {
        &self.client_key_path
    }
    /// The CA certificate in DER form.
    pub fn ca_der(&self) -> &CertificateDer<'static> {
        &self.ca_der
    }

    /// A TLS 1.3-only client config that trusts only the test CA and, if `with_client_cert`,
    /// presents the client certificate when the server asks for one.
    pub fn rustls_client_config(&self, with_client_cert: bool) -> Arc<ClientConfig> {
        self.rustls_client_config_with_versions(with_client_cert, &[&rustls::version::TLS13])
    }

    /// Like [`TestPki::rustls_client_config`] but offering exactly `versions` (e.g. TLS 1.2
    /// only, to check that a server refuses it).
    ///
    /// # Panics
    /// If `versions` is empty (a bug in the test).
    pub fn rustls_client_config_with_versions(
        &self,
        with_client_cert: bool,
        versions: &[&'static SupportedProtocolVersion],
    ) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        // Invariant: the CA was generated by rcgen a moment ago and is well-formed DER.
        roots
            .add(self.ca_der.clone())
            .expect("test CA is a valid trust anchor");
        let builder = ClientConfig::builder_with_provider(ring_provider())
            .with_protocol_versions(versions)
            // Invariant: the ring provider supports both TLS 1.2 and 1.3 (the workspace enables
            // rustls' `tls12` feature), so any non-empty subset of them is consistent.
            .expect("ring provider supports the requested TLS versions")
            .with_root_certificates(roots);
        let config = if with_client_cert {
            builder
                .with_client_auth_cert(vec![self.client_der.clone()], self.client_key())
                // Invariant: the key is the one the certificate was issued for.
                .expect("generated client key matches its certificate")
        } else {
            builder.with_no_client_auth()
        };
        Arc::new(config)
    }

    /// A TLS 1.3-only server config presenting the server certificate. If
    /// `require_client_cert`, clients must present a certificate signed by the test CA.
    pub fn rustls_server_config(&self, require_client_cert: bool) -> Arc<ServerConfig> {
        let builder = ServerConfig::builder_with_provider(ring_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            // Invariant: the ring provider supports TLS 1.3.
            .expect("ring provider supports TLS 1.3");
        let builder = if require_client_cert {
            let mut roots = RootCertStore::empty();
            // Invariant: the CA was generated by rcgen a moment ago and is well-formed DER.
            roots
                .add(self.ca_der.clone())
                .expect("test CA is a valid trust anchor");
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                ring_provider(),
            )
            .build()
            // Invariant: the root store is non-empty.
            .expect("client verifier over the test CA");
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder
            .with_single_cert(vec![self.server_der.clone()], self.server_key())
            // Invariant: the key is the one the certificate was issued for.
            .expect("generated server key matches its certificate");
        Arc::new(config)
    }

    fn client_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.client_key_der.clone()))
    }
    fn server_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.server_key_der.clone()))
    }
}

fn ring_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "sluice test kit");
    dn
}
