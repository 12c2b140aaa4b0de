//! The gateway-wide DTLS server context: one OpenSSL `SslContext` (DTLS 1.2 only, PSK
//! and/or certificate suites, the PSK callback, the cookie callbacks) and the secret the
//! stateless cookies are keyed with. Built once at start from `[coap.dtls]`, shared by the
//! shards (`Arc`).
//!
//! Owns: the OpenSSL configuration, the PSK table, the cookie secret, and reading the
//! authenticated identity off a finished handshake. Does not own: sessions (`super::session`)
//! or the wire format of the stateless exchange (`super::hello`).
//!
//! Invariants: only DTLS 1.2 is negotiated; a PSK identity not in the table, or not UTF-8,
//! fails the handshake (the callback returns no key); with `client_ca_file` a certificate-
//! mode device must present a certificate that chains to it (`FAIL_IF_NO_PEER_CERT`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::sign::Signer;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslMode, SslOptions, SslRef,
    SslVerifyMode, SslVersion,
};

use crate::config::{CoapDtlsConfig, ConfigError};

/// Length of the cookies sluice hands out (RFC 6347 allows up to 255 bytes).
pub const COOKIE_LEN: usize = 16;
/// A cookie is valid in the window it was made in and the next one.
const COOKIE_WINDOW: Duration = Duration::from_secs(60);
/// Cipher suites: PSK ones (RFC 7252 §9.1.3.1 names TLS_PSK_WITH_AES_128_CCM_8) and, in
/// certificate mode, ECDHE with AEAD (§9.1.3.3 names ECDHE_ECDSA_WITH_AES_128_CCM_8).
const CIPHERS: &str = "PSK-AES128-CCM8:PSK-AES128-CCM:PSK-AES128-GCM-SHA256:PSK-AES256-GCM-SHA384:\
ECDHE-PSK-AES128-CBC-SHA256:PSK:ECDHE-ECDSA-AES128-CCM8:ECDHE-ECDSA-AES128-GCM-SHA256:\
ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384:\
!aNULL:!eNULL:!NULL";

/// Why the DTLS context could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("coap.dtls: OpenSSL refused the configuration ({what}): {source}")]
    OpenSsl {
        what: &'static str,
        #[source]
        source: ErrorStack,
    },
}

fn ossl<T>(what: &'static str, r: Result<T, ErrorStack>) -> Result<T, ContextError> {
    r.map_err(|source| ContextError::OpenSsl { what, source })
}

/// What every shard's DTLS listener shares.
pub struct DtlsContext {
    pub ssl: SslContext,
    /// Where a session's expected cookie is kept for the cookie callbacks.
    cookie_index: Index<Ssl, Vec<u8>>,
    /// HMAC key of the stateless cookies (random, per process).
    cookie_key: PKey<openssl::pkey::Private>,
    pub config: CoapDtlsConfig,
    /// Whether certificate-mode devices must present a client certificate.
    pub client_certs: bool,
}

impl std::fmt::Debug for DtlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DtlsContext")
            .field("listen", &self.config.listen)
            .field("client_certs", &self.client_certs)
            .finish_non_exhaustive()
    }
}

impl DtlsContext {
    /// Build from `[coap.dtls]` (its files are read here).
    pub fn new(config: &CoapDtlsConfig) -> Result<Arc<DtlsContext>, ContextError> {
        let psk = Arc::new(config.read_psk_file()?);
        let mut b = ossl("DTLS method", SslContextBuilder::new(SslMethod::dtls()))?;
        ossl(
            "DTLS 1.2 minimum",
            b.set_min_proto_version(Some(SslVersion::DTLS1_2)),
        )?;
        ossl(
            "DTLS 1.2 maximum",
            b.set_max_proto_version(Some(SslVersion::DTLS1_2)),
        )?;
        b.set_options(
            SslOptions::COOKIE_EXCHANGE
                | SslOptions::NO_QUERY_MTU
                | SslOptions::NO_RENEGOTIATION
                | SslOptions::CIPHER_SERVER_PREFERENCE
                | SslOptions::NO_TICKET,
        );
        b.set_mode(SslMode::RELEASE_BUFFERS);
        ossl("cipher list", b.set_cipher_list(CIPHERS))?;
        if config.psk_file.is_some() {
            let table = psk.clone();
            b.set_psk_server_callback(move |_ssl, identity, out| {
                Ok(match identity.and_then(|i| table.key(i)) {
                    Some(key) if key.len() <= out.len() => {
                        out[..key.len()].copy_from_slice(key);
                        key.len()
                    }
                    // Unknown identity: no key, the handshake fails.
                    _ => 0,
                })
            });
        }
        let mut client_certs = false;
        if let (Some(cert), Some(key)) = (&config.cert_file, &config.key_file) {
            ossl("cert_file", b.set_certificate_chain_file(cert))?;
            ossl("key_file", b.set_private_key_file(key, SslFiletype::PEM))?;
            ossl("key_file matches cert_file", b.check_private_key())?;
            if let Some(ca) = &config.client_ca_file {
                ossl("client_ca_file", b.set_ca_file(ca))?;
                b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
                client_certs = true;
            }
        }
        let cookie_index = ossl("ex_data index", Ssl::new_ex_index::<Vec<u8>>())?;
        // OpenSSL asks for a cookie when it sends a HelloVerifyRequest and checks the one a
        // ClientHello carries. sluice did that exchange already (`super::hello`) before this
        // session existed; the session only re-plays it, with the cookie the device holds.
        b.set_cookie_generate_cb(move |ssl, out| {
            let cookie = ssl.ex_data(cookie_index).map(Vec::as_slice).unwrap_or(&[]);
            let n = cookie.len().min(out.len());
            out[..n].copy_from_slice(&cookie[..n]);
            Ok(n)
        });
        b.set_cookie_verify_cb(move |ssl, cookie| {
            ssl.ex_data(cookie_index)
                .is_some_and(|c| !c.is_empty() && c.as_slice() == cookie)
        });
        let mut secret = [0u8; 32];
        ossl("random cookie key", openssl::rand::rand_bytes(&mut secret))?;
        let cookie_key = ossl("cookie key", PKey::hmac(&secret))?;
        Ok(Arc::new(DtlsContext {
            ssl: b.build(),
            cookie_index,
            cookie_key,
            config: config.clone(),
            client_certs,
        }))
    }

    /// A fresh server-side `Ssl` that will accept the cookie `cookie` (already checked).
    pub fn new_ssl(&self, cookie: &[u8]) -> Result<Ssl, ErrorStack> {
        let mut ssl = Ssl::new(&self.ssl)?;
        ssl.set_mtu(self.config.mtu.as_u64().min(u32::MAX as u64) as u32)?;
        ssl.set_ex_data(self.cookie_index, cookie.to_vec());
        Ok(ssl)
    }

    /// The cookie for `peer` in time window `window`.
    fn cookie_in(&self, peer: SocketAddr, window: u64) -> Option<[u8; COOKIE_LEN]> {
        let mut s = Signer::new(MessageDigest::sha256(), &self.cookie_key).ok()?;
        s.update(&window.to_be_bytes()).ok()?;
        match peer {
            SocketAddr::V4(a) => s.update(&a.ip().octets()).ok()?,
            SocketAddr::V6(a) => s.update(&a.ip().octets()).ok()?,
        }
        s.update(&peer.port().to_be_bytes()).ok()?;
        let mac = s.sign_to_vec().ok()?;
        let mut c = [0u8; COOKIE_LEN];
        c.copy_from_slice(mac.get(..COOKIE_LEN)?);
        Some(c)
    }

    /// The cookie window of `now`, counted on the monotonic clock from the first cookie of
    /// this process (the key is per process): an NTP step of the wall clock neither
    /// invalidates the cookies in flight nor lengthens their life.
    fn window(now: Instant) -> u64 {
        static START: OnceLock<Instant> = OnceLock::new();
        let start = *START.get_or_init(|| now);
        now.saturating_duration_since(start).as_secs() / COOKIE_WINDOW.as_secs()
    }

    /// The cookie sluice hands `peer` now.
    pub fn cookie_for(&self, peer: SocketAddr, now: Instant) -> Option<[u8; COOKIE_LEN]> {
        self.cookie_in(peer, Self::window(now))
    }

    /// Whether `cookie` is one sluice gave `peer` in this window or the previous one.
    pub fn cookie_valid(&self, peer: SocketAddr, cookie: &[u8], now: Instant) -> bool {
        if cookie.len() != COOKIE_LEN {
            return false;
        }
        let w = Self::window(now);
        [w, w.saturating_sub(1)].into_iter().any(|w| {
            self.cookie_in(peer, w)
                .is_some_and(|c| openssl::memcmp::eq(&c, cookie))
        })
    }
}

/// The identity a finished handshake authenticated: the PSK identity, else the subject CN of
/// a verified client certificate; `None` for a certificate-mode device that was not asked for
/// one (no `client_ca_file`).
pub fn identity_of(ssl: &SslRef, client_certs: bool) -> Option<String> {
    if let Some(id) = ssl.psk_identity() {
        return std::str::from_utf8(id).ok().map(str::to_string);
    }
    if !client_certs {
        return None;
    }
    let cert = ssl.peer_certificate()?;
    let cn = cert.subject_name().entries_by_nid(Nid::COMMONNAME).next()?;
    let cn = cn.data().to_string().ok()?;
    (!cn.is_empty() && !cn.chars().any(|c| c.is_control() || matches!(c, '+' | '#'))).then_some(cn)
}
