//! `[coap]` and `[[coap.proxy]]`: the device-facing CoAP/UDP listener, its pub/sub resource,
//! and the upstream CoAP servers (CoAP over TCP or TLS, RFC 8323) it proxies to.
//!
//! Owns: the config types and their defaults. Does not own: acting on them (`crate::edge::coap`
//! for the listener, `crate::proxy` for the upstreams) or checks across sections
//! (`validate.rs`).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units::{self, ByteSize};

/// `[coap]`: CoAP over UDP (RFC 7252) for devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoapConfig {
    /// Listen for CoAP devices at all.
    pub enabled: bool,
    #[serde(with = "units::socket_addr")]
    pub listen: SocketAddr,
    /// First Uri-Path segment of the pub/sub resource: `coap://gw/{pubsub_path}/{topic}`.
    pub pubsub_path: String,
    /// Largest datagram read from or written to a device (RFC 7252 §4.6 suggests 1152).
    pub max_message_size: ByteSize,
    /// Block size sluice asks for and answers with (Block1/Block2, RFC 7959): 16 B .. 1 KiB,
    /// a power of two.
    pub block_size: ByteSize,
    /// Largest request body reassembled from Block1 blocks (a publish's payload); larger gets
    /// 4.13 Request Entity Too Large with Size1.
    pub max_body_size: ByteSize,
    /// Block-wise transfers in progress at once, whole gateway (each holds its body so far);
    /// beyond, a new one gets 5.03.
    pub max_block_transfers: usize,
    /// Block-wise transfers one source address (IP) may have in progress at once on a shard
    /// (an address's devices, told apart by `c=`, may be spread over the shards).
    pub max_block_transfers_per_source: usize,
    /// Bytes of request bodies being reassembled from Block1 blocks, whole gateway; a block
    /// that would go beyond gets 5.03 and its transfer is dropped.
    pub max_block_bytes: ByteSize,
    /// A Block1 transfer with no block for this long is forgotten (its slot and body freed).
    #[serde(with = "units::duration")]
    pub block_idle_timeout: Duration,
    /// Message ids remembered for de-duplication, whole gateway (RFC 7252 §4.5); the oldest
    /// is evicted, counted, when full.
    pub max_exchanges: usize,
    /// Bytes the de-duplication table may hold, whole gateway: each exchange is charged its
    /// stored answer plus a fixed overhead; the oldest is evicted, counted, when over.
    pub max_exchange_bytes: ByteSize,
    /// Bytes of the table of addresses that proved they receive (an Echo echoed, or a CON
    /// of sluice's ACKed), whole gateway; 96 B per address, the oldest forgotten when full.
    /// An address not in it gets no answer larger than 3× its request (RFC 9175 §2.4).
    pub max_verified_bytes: ByteSize,
    /// Whether a peer without an identity (plain CoAP/UDP) may publish or observe. Unset:
    /// as MQTT (`mqtt.allow_anonymous`, which defaults to false once `[[mqtt.users]]` exist).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_anonymous: Option<bool>,
    /// How long a CON's message id is remembered (EXCHANGE_LIFETIME).
    #[serde(with = "units::duration")]
    pub exchange_lifetime: Duration,
    /// How long a NON's message id is remembered (NON_LIFETIME).
    #[serde(with = "units::duration")]
    pub non_lifetime: Duration,
    /// First retransmission timeout of a CON sluice sends (ACK_TIMEOUT; ×1–1.5 at random,
    /// doubled per retransmission).
    #[serde(with = "units::duration")]
    pub ack_timeout: Duration,
    /// Retransmissions of a CON before the peer is given up (MAX_RETRANSMIT).
    pub max_retransmit: u8,
    /// A CON request whose answer is not ready after this gets an empty ACK now and its
    /// response later as a separate CON (must stay below `ack_timeout`).
    #[serde(with = "units::duration")]
    pub separate_after: Duration,
    /// Publishes waiting for a bound in the gateway (back-pressure), whole gateway; beyond,
    /// a device gets 5.03 Service Unavailable with Max-Age = `retry_after`.
    pub max_pending: usize,
    /// Max-Age of a 5.03 answer: when the device should try again.
    #[serde(with = "units::duration")]
    pub retry_after: Duration,
    /// Observe registrations (subscriptions) held at once, whole gateway.
    pub max_observers: usize,
    /// Observe registrations one source address (IP) may hold at once on a shard (as
    /// `max_block_transfers_per_source`); beyond, 5.03.
    pub max_observers_per_source: usize,
    /// An observer not confirmed for this long (no CON notification ACKed, no
    /// re-registration) gets its next notification as CON, or a CON repeating its last state
    /// if nothing is due; no ACK ends the registration (RFC 7641 §4.5 asks for 24 h at most).
    #[serde(with = "units::duration")]
    pub observer_check: Duration,
    /// Notifications queued per observer while earlier ones are unacknowledged; beyond,
    /// the oldest is dropped (counted): an observer wants the latest state.
    pub max_queued_notifications: usize,
    /// Bytes of the representations of notifications larger than `max_message_size`, whole
    /// gateway (for each CoAP edge, plain and DTLS): such a notification goes to a verified
    /// observer as its first Block2 block with an ETag (RFC 7959 §2.6), and the rest is
    /// fetched with GETs answered from the copy kept here (the latest per observer address and
    /// filter; each charged its body, its filter and 128 B; oldest forgotten first, none used
    /// after `exchange_lifetime`). A notification that cannot be kept is dropped,
    /// counted; 0B: every such notification is.
    pub max_snapshot_bytes: ByteSize,
    /// Datagrams per second one source address (ip:port) may send; beyond, its datagrams
    /// are dropped (counted) so a flood from one source cannot starve other devices. 0: no
    /// limit.
    pub source_rate: u32,
    /// Datagrams a source may send in a burst above `source_rate`.
    pub source_burst: u32,
    /// Upstream CoAP servers reached over TCP/TLS (reverse or forward proxy).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub proxy: Vec<CoapProxyConfig>,
    /// `[coap.dtls]`: CoAP over DTLS 1.2 (`coaps://`) with per-device PSKs or certificates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtls: Option<CoapDtlsConfig>,
}

impl Default for CoapConfig {
    fn default() -> Self {
        CoapConfig {
            enabled: true,
            listen: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 5683)),
            pubsub_path: "ps".to_string(),
            max_message_size: ByteSize(1152),
            block_size: ByteSize::kib(1),
            max_body_size: ByteSize::kib(64),
            max_block_transfers: 1024,
            max_block_transfers_per_source: 4,
            max_block_bytes: ByteSize::mib(8),
            block_idle_timeout: Duration::from_secs(30),
            max_exchanges: 65_536,
            max_exchange_bytes: ByteSize::mib(4),
            max_verified_bytes: ByteSize::mib(1),
            allow_anonymous: None,
            exchange_lifetime: Duration::from_secs(247),
            non_lifetime: Duration::from_secs(145),
            ack_timeout: Duration::from_secs(2),
            max_retransmit: 4,
            separate_after: Duration::from_millis(1000),
            max_pending: 8192,
            retry_after: Duration::from_secs(2),
            max_observers: 10_000,
            max_observers_per_source: 64,
            observer_check: Duration::from_secs(120),
            max_queued_notifications: 16,
            max_snapshot_bytes: ByteSize::mib(4),
            source_rate: 2000,
            source_burst: 500,
            proxy: Vec::new(),
            dtls: None,
        }
    }
}

/// `[[coap.proxy]]`: one upstream CoAP server over TCP or TLS (RFC 8323). Each shard keeps
/// one connection to it (one per path with `paths`), shared by every device on the shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoapProxyConfig {
    /// Unique among proxies, `[a-zA-Z0-9_-]+`; a metric label.
    pub name: String,
    /// `coap+tcp://host[:port]` (default port 5683) or `coaps+tcp://host[:port]` (5684).
    pub url: String,
    /// Reverse proxy: requests to `coap://gw/{prefix}/rest…` go to `{url}/rest…`. Absent:
    /// only forward proxying (Proxy-Uri / Proxy-Scheme naming this upstream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Forward proxy (RFC 7252 §5.7.2): accept Proxy-Uri/Proxy-Scheme requests whose scheme,
    /// host and port name this upstream. sluice never proxies to a server not configured.
    #[serde(default)]
    pub forward: bool,
    /// PEM CAs trusted for a `coaps+tcp://` server's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// TLS SNI and verification name; default: the url host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// Requests outstanding on one shard's connection; more wait (back-pressure).
    #[serde(default = "default_max_outstanding")]
    pub max_outstanding: usize,
    /// Requests that may wait for an outstanding slot per shard; beyond, 5.03.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: usize,
    /// A request with no response after this is answered 5.04 Gateway Timeout.
    #[serde(default = "default_request_timeout", with = "units::duration")]
    pub request_timeout: Duration,
    /// Ping (7.02) an idle connection this often; no Pong within it closes the connection.
    #[serde(default = "default_ping_interval", with = "units::duration")]
    pub ping_interval: Duration,
    #[serde(default = "default_connect_timeout", with = "units::duration")]
    pub connect_timeout: Duration,
    /// Open the upstream connections with IPPROTO_MPTCP (falls back to TCP, logged once
    /// and shown in status, when the kernel or the server lacks it). Not with `paths`.
    #[serde(default)]
    pub mptcp: bool,
    /// Per-path connections (ADR 0012): one RFC 8323 connection per path per shard, each
    /// socket bound to the path's `bind` address and/or `interface`; requests go to the live
    /// path with the fewest bytes outstanding (÷ weight) that has room (`max_outstanding`
    /// per path). Empty: one connection, routed by the kernel.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<super::PathConfig>,
    /// With `paths`: a path with requests outstanding that read nothing for this long is
    /// declared dead (a blackhole sends no RST); its requests go to the other paths.
    #[serde(default = "default_path_timeout", with = "units::duration")]
    pub path_timeout: Duration,
}

fn default_path_timeout() -> Duration {
    Duration::from_secs(3)
}

fn default_max_outstanding() -> usize {
    256
}
fn default_max_waiting() -> usize {
    4096
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_ping_interval() -> Duration {
    Duration::from_secs(30)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}

/// Where a `[[coap.proxy]]` url points: scheme, host, port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyTarget {
    /// `coaps+tcp://` (TLS) rather than `coap+tcp://`.
    pub tls: bool,
    /// As written (an IPv6 literal without its brackets), lower-cased.
    pub host: String,
    pub port: u16,
}

impl ProxyTarget {
    /// The url's scheme as written in a Proxy-Uri or Proxy-Scheme.
    pub fn scheme(&self) -> &'static str {
        if self.tls {
            "coaps+tcp"
        } else {
            "coap+tcp"
        }
    }
}

impl CoapConfig {
    /// Whether a peer without an identity may publish or observe: `allow_anonymous` when
    /// set, else whatever MQTT decides for a device without a username.
    pub fn anonymous_allowed(&self, mqtt: &super::MqttConfig) -> bool {
        self.allow_anonymous.unwrap_or(mqtt.anonymous_allowed())
    }
}

impl CoapProxyConfig {
    /// Parse `url`: `coap+tcp://host[:port]` or `coaps+tcp://host[:port]`, no path, query or
    /// user info. The error says what is wrong, for `config.coap.proxy[i].url`.
    pub fn target(&self) -> Result<ProxyTarget, String> {
        let (tls, rest) = if let Some(r) = self.url.strip_prefix("coap+tcp://") {
            (false, r)
        } else if let Some(r) = self.url.strip_prefix("coaps+tcp://") {
            (true, r)
        } else {
            return Err(format!(
                "{:?} must start with coap+tcp:// or coaps+tcp://",
                self.url
            ));
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#', '@']) {
            return Err(format!(
                "{:?} must be scheme://host[:port] with no path, query or user",
                self.url
            ));
        }
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("{:?} has a '[' without ']'", self.url))?;
            (h, after.strip_prefix(':'))
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (rest, None),
            }
        };
        if host.is_empty() {
            return Err(format!("{:?} has no host", self.url));
        }
        let port = match port {
            None => {
                if tls {
                    5684
                } else {
                    5683
                }
            }
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("{:?} has a bad port {p:?}", self.url))?,
        };
        Ok(ProxyTarget {
            tls,
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

/// `[coap.dtls]`: a second CoAP listener, over DTLS 1.2 (RFC 6347, `coaps://`, RFC 7252
/// §9), whose devices are identified by their PSK identity or client certificate CN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoapDtlsConfig {
    #[serde(with = "units::socket_addr")]
    pub listen: SocketAddr,
    /// `identity:hex-key` per line (`#` comments, blank lines): the identity is the device
    /// id. Read at start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub psk_file: Option<PathBuf>,
    /// PEM server certificate chain (certificate mode; with `key_file`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// PEM CAs a device's client certificate must chain to; its subject CN is the device
    /// id. Absent: certificate-mode devices are not asked for a certificate (encrypted but
    /// anonymous).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
    /// DTLS sessions (handshaking or established) held at once, whole gateway; beyond, the
    /// least recently active one is closed (counted).
    pub max_sessions: usize,
    /// Of those, handshakes in progress at once, whole gateway (a handshake may hold far more
    /// memory than an established session: OpenSSL reassembles fragmented messages); beyond,
    /// the oldest handshake is abandoned (counted).
    pub max_handshakes: usize,
    /// A session with no datagram either way for this long is closed.
    #[serde(with = "units::duration")]
    pub idle_timeout: Duration,
    /// A handshake not finished within this is abandoned (counted as a failure).
    #[serde(with = "units::duration")]
    pub handshake_timeout: Duration,
    /// Largest DTLS datagram sluice sends (records and handshake fragments fit in it).
    pub mtu: ByteSize,
}

impl Default for CoapDtlsConfig {
    fn default() -> Self {
        CoapDtlsConfig {
            listen: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 5684)),
            psk_file: None,
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            max_sessions: 1024,
            max_handshakes: 64,
            idle_timeout: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(30),
            mtu: ByteSize(1280),
        }
    }
}

/// The pre-shared keys of `psk_file`, by identity. `Debug` prints identities, not keys.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PskTable(std::collections::HashMap<String, Vec<u8>>);

impl PskTable {
    /// The key of `identity`.
    pub fn key(&self, identity: &[u8]) -> Option<&[u8]> {
        std::str::from_utf8(identity)
            .ok()
            .and_then(|i| self.0.get(i))
            .map(Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Parse `identity:hex-key` lines. The error names the line (never the key).
    pub fn parse(text: &str) -> Result<PskTable, String> {
        let mut keys = std::collections::HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let n = n + 1;
            let (identity, hex) = line
                .rsplit_once(':')
                .ok_or_else(|| format!("line {n}: expected identity:hex-key"))?;
            if identity.is_empty() || identity.len() > 128 {
                return Err(format!("line {n}: the identity must be 1 to 128 bytes"));
            }
            if identity
                .chars()
                .any(|c| c.is_control() || matches!(c, '+' | '#'))
            {
                return Err(format!(
                    "line {n}: the identity (a device id) must not contain control characters, '+' or '#'"
                ));
            }
            let key = decode_hex(hex.trim())
                .filter(|k| (1..=64).contains(&k.len()))
                .ok_or_else(|| format!("line {n}: the key must be 1 to 64 bytes in hex"))?;
            if keys.insert(identity.to_string(), key).is_some() {
                return Err(format!("line {n}: identity {identity:?} appears twice"));
            }
        }
        Ok(PskTable(keys))
    }
}

impl std::fmt::Debug for PskTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<&String> = self.0.keys().collect();
        ids.sort();
        write!(f, "PskTable({ids:?}, keys redacted)")
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.strip_prefix("0x").unwrap_or(s);
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl CoapDtlsConfig {
    /// Reads and parses `psk_file` (empty table without one).
    pub fn read_psk_file(&self) -> Result<PskTable, super::ConfigError> {
        let Some(path) = &self.psk_file else {
            return Ok(PskTable::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| super::ConfigError::File {
            key: "coap.dtls.psk_file".into(),
            path: path.clone(),
            source,
        })?;
        PskTable::parse(&text).map_err(|reason| super::ConfigError::Invalid {
            key: "coap.dtls.psk_file".into(),
            reason: format!("{}: {reason}", path.display()),
        })
    }
}
