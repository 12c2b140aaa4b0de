//! `[[uplink]]`: one cloud MQTT broker the gateway forwards to and receives from, or (with
//! `protocol = "onem2m"`) one oneM2M CSE it forwards to (its keys: `onem2m.rs`).
//!
//! Owns: the uplink config types, the broker URL type and the protocol-version enum, and
//! reading the password file. Does not own: connecting (that is `crate::sink`) or checks
//! across fields (`validate.rs`).
//!
//! Invariants: the password never appears in `Debug` output; `UplinkUrl` always carries an
//! explicit port after parsing (8883 for `mqtts://`, 1883 for `mqtt://` when omitted).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::lanes::AggregateConfig;
use super::units::{self, ByteSize};
use super::ConfigError;

/// One cloud broker connection (one MQTT session per shard).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UplinkConfig {
    /// Unique among uplinks, `[a-zA-Z0-9_-]+`; used as a metric label.
    pub name: String,
    /// `mqtts://host[:port]` (default port 8883) or `mqtt://host[:port]` (default 1883).
    /// With `urls` (set instead of `url`), the first of them: the loader fills it in
    /// (`cluster.rs`), so code reading the scheme or the first host reads it here.
    #[serde(default = "UplinkUrl::unset")]
    pub url: UplinkUrl,
    /// Several nodes of ONE broker cluster, instead of `url`: shard `i` starts at node
    /// `i mod n` and a session moves to the next node when a connect fails or its link drops
    /// (`sink/mqtt/link.rs`). Empty: the single `url`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<UplinkUrl>,
    /// Allow an `mqtt://` (unencrypted) url.
    #[serde(default)]
    pub allow_plaintext: bool,
    /// PEM bundle of CAs trusted to sign the broker's certificate; required for `mqtts://`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain (with `key_file`) for client-certificate auth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// PEM private key for `cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// TLS SNI and certificate verification name; default: the url host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// Client id prefix; shard `n` uses `"{client_id}-{n}"`.
    #[serde(default = "default_client_id")]
    pub client_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// File whose contents (minus one final newline) are the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    #[serde(default)]
    pub protocol: MqttProtocol,
    /// Local topic filters whose messages are sent to the cloud.
    #[serde(default = "default_forward")]
    pub forward: Vec<String>,
    /// Cloud topic filters subscribed to and delivered to local subscribers.
    #[serde(default)]
    pub receive: Vec<String>,
    /// Cloud topic = `topic_prefix` + local topic.
    #[serde(default)]
    pub topic_prefix: String,
    /// Cloud topic built from `{device}` (the publishing client id) and `{topic}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic_template: Option<String>,
    /// Most QoS 1 messages unacknowledged by the broker, per session.
    #[serde(default = "default_inflight")]
    pub inflight: u16,
    #[serde(default = "default_keep_alive", with = "units::duration")]
    pub keep_alive: Duration,
    #[serde(default = "default_connect_timeout", with = "units::duration")]
    pub connect_timeout: Duration,
    #[serde(default = "default_reconnect_min", with = "units::duration")]
    pub reconnect_min: Duration,
    #[serde(default = "default_reconnect_max", with = "units::duration")]
    pub reconnect_max: Duration,
    /// TCP_NOTSENT_LOWAT of the normal lane's socket: unsent bytes the kernel may hold before
    /// the socket stops being writable, so urgent data never waits behind a deep send buffer.
    /// `"0B"` leaves the kernel default.
    #[serde(default = "default_notsent_lowat")]
    pub notsent_lowat: ByteSize,
    // --- cloud refusals and the downlink session (uplink part) ---
    /// First wait before resending messages the broker refused for now (MQTT 5 PUBACK 0x97
    /// Quota exceeded, 0x80, 0x83, 0x91); doubles per refusal round up to `refused_retry_max`.
    #[serde(default = "default_refused_retry_min", with = "units::duration")]
    pub refused_retry_min: Duration,
    #[serde(default = "default_refused_retry_max", with = "units::duration")]
    pub refused_retry_max: Duration,
    /// How long the cloud broker keeps the downlink session (its `receive` subscription and
    /// the QoS 1 commands published for it) while the gateway is disconnected. MQTT 5 Session
    /// Expiry Interval; a 3.1.1 uplink uses clean session = 0 (the broker decides how long).
    #[serde(default = "default_downlink_session_expiry", with = "units::duration")]
    pub downlink_session_expiry: Duration,
    /// Install SegaNet-style traffic control on the uplink interface (htb root, a high class
    /// for the high lane's source ports, a default class for the rest). Needs CAP_NET_ADMIN.
    #[serde(default)]
    pub install_tc: bool,
    /// Interface for `install_tc`; default: the one the kernel routes the broker through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tc_interface: Option<String>,
    /// The link rate for `install_tc`, in tc's units (`"2mbit"`, `"100mbit"`, `"1gbit"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tc_rate: Option<String>,
    // --- multipath (issue 17: `sink/paths/`, `net/`) ---
    /// Open the sessions' sockets with IPPROTO_MPTCP (RFC 8684); subflows come from the
    /// kernel's path manager (`ip mptcp endpoint`). Falls back to plain TCP, logged once and
    /// shown in status, when the kernel or the broker lacks MPTCP.
    #[serde(default)]
    pub mptcp: bool,
    /// With `paths`: pin the high lane to the path of this name (it still fails over to
    /// another path when that one is down). Absent: the high lane uses every path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane_path: Option<String>,
    /// With `paths`: a path with unacknowledged messages (or an unanswered keep-alive) that
    /// heard nothing from the broker for this long is declared dead; its messages are resent
    /// on another path.
    #[serde(default = "default_path_timeout", with = "units::duration")]
    pub path_timeout: Duration,
    /// With `paths`: each path's keep-alive probe interval while it is idle.
    #[serde(default = "default_path_keep_alive", with = "units::duration")]
    pub path_keep_alive: Duration,
    /// With `paths`: longest wait between reconnect attempts of one path (from
    /// `reconnect_min`, doubling); a link-up event on the path's interface retries at once.
    #[serde(default = "default_path_reconnect_max", with = "units::duration")]
    pub path_reconnect_max: Duration,
    /// Per-path sessions: one MQTT session per path (client id suffixed with the path's
    /// name), messages spread over the live paths. Empty: one session per lane, routed by
    /// the kernel.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathConfig>,
    // --- end multipath ---
    // --- oneM2M (`protocol = "onem2m"`, `sink/onem2m/`; checked in `onem2m.rs`) ---
    /// The CSE's SP-relative CSE-ID (`"/id-in"`); requests go to `/~{cse_id}/{cse_name}/…`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cse_id: Option<String>,
    /// The CSEBase resource name (`"cse-in"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cse_name: Option<String>,
    /// The AE-ID sluice registers with and sends as X-M2M-Origin (`"Csluice-gw"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub originator: Option<String>,
    /// The AE's resource name; default: `originator` without its leading `C`/`S`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ae_name: Option<String>,
    /// The AE's App-ID (`api`, starts with `N` or `R`); default `"Nsluice"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    /// Container names, `"{device container}/{topic container}"` (see `sink::onem2m::naming`);
    /// default `"{device}/{topic}"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// `mni` (maxNrOfInstances) of every container created; absent: the CSE decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mni: Option<u64>,
    /// `mbs` (maxByteSize) of every container created; absent: the CSE decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mbs: Option<ByteSize>,
    /// Keep-alive HTTP/1.1 connections per shard and lane; default 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<usize>,
    /// Requests written ahead of their responses on one connection; default 32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<usize>,
    /// A connection whose oldest request waited this long for its response is closed (its
    /// requests are resent on a new one); default 10s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "super::onem2m::opt_duration"
    )]
    pub request_timeout: Option<Duration>,
    // --- end oneM2M ---
    // --- Kafka (`protocol = "kafka"`, `sink/kafka/`; checked in `kafka.rs`) ---
    /// The cluster's bootstrap brokers, `host:port`; `url`/`urls` are filled in from them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub brokers: Vec<String>,
    /// `ssl` (default), `sasl_ssl`, `plaintext` or `sasl_plaintext` (Kafka's names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_protocol: Option<super::kafka::SecurityProtocol>,
    /// `SCRAM-SHA-512` (default) or `SCRAM-SHA-256`, with `username` and `password_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl_mechanism: Option<super::kafka::SaslMechanism>,
    /// The Kafka topic: `{topic}` is the local topic with `/` as `.`; default `"{topic}"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// Record batch compression: `lz4` (default), `zstd` or `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<super::kafka::KafkaCompression>,
    // --- end Kafka ---
    /// SenML aggregation of normal-priority records (a table, so it comes last).
    #[serde(default)]
    pub aggregate: AggregateConfig,
    /// `Some` for the sink entry of a `[[function]]` (never read from or written to the file:
    /// see `config/function.rs`).
    #[serde(skip)]
    pub function: Option<std::sync::Arc<super::FunctionConfig>>,
}

/// One path of a multipath uplink: where its session's socket is bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathConfig {
    /// `[a-zA-Z0-9_-]+`, unique within the uplink; the client id suffix and metric label.
    /// Default: `p{index}` (`p0`, `p1`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Local (source) address the path's socket binds to; with policy routing per source
    /// address this picks the link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<std::net::IpAddr>,
    /// Network interface the socket is bound to (SO_BINDTODEVICE, needs CAP_NET_RAW); its
    /// link state is watched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// Relative share of new devices when several paths are equally good (1..=100).
    #[serde(default = "default_path_weight")]
    pub weight: u32,
}

impl PathConfig {
    /// The path's name: `name`, else `p{index}`.
    pub fn label(&self, index: usize) -> String {
        self.name.clone().unwrap_or_else(|| format!("p{index}"))
    }
}

fn default_path_weight() -> u32 {
    1
}
fn default_path_timeout() -> Duration {
    Duration::from_secs(3)
}
fn default_path_keep_alive() -> Duration {
    Duration::from_secs(1)
}
fn default_path_reconnect_max() -> Duration {
    Duration::from_secs(1)
}

fn default_client_id() -> String {
    "sluice".to_string()
}
fn default_forward() -> Vec<String> {
    vec!["#".to_string()]
}
fn default_inflight() -> u16 {
    256
}
fn default_keep_alive() -> Duration {
    Duration::from_secs(30)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_reconnect_min() -> Duration {
    Duration::from_millis(100)
}
fn default_reconnect_max() -> Duration {
    Duration::from_secs(30)
}
fn default_refused_retry_min() -> Duration {
    Duration::from_secs(1)
}
fn default_refused_retry_max() -> Duration {
    Duration::from_secs(60)
}
fn default_downlink_session_expiry() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_notsent_lowat() -> ByteSize {
    ByteSize::kib(16)
}

impl UplinkConfig {
    /// An uplink with every optional field at its default.
    pub fn new(name: impl Into<String>, url: UplinkUrl) -> Self {
        UplinkConfig {
            name: name.into(),
            url,
            urls: Vec::new(),
            allow_plaintext: false,
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            client_id: default_client_id(),
            username: None,
            password_file: None,
            protocol: MqttProtocol::default(),
            forward: default_forward(),
            receive: Vec::new(),
            topic_prefix: String::new(),
            topic_template: None,
            inflight: default_inflight(),
            keep_alive: default_keep_alive(),
            connect_timeout: default_connect_timeout(),
            reconnect_min: default_reconnect_min(),
            reconnect_max: default_reconnect_max(),
            notsent_lowat: default_notsent_lowat(),
            refused_retry_min: default_refused_retry_min(),
            refused_retry_max: default_refused_retry_max(),
            downlink_session_expiry: default_downlink_session_expiry(),
            install_tc: false,
            tc_interface: None,
            tc_rate: None,
            mptcp: false,
            lane_path: None,
            path_timeout: default_path_timeout(),
            path_keep_alive: default_path_keep_alive(),
            path_reconnect_max: default_path_reconnect_max(),
            paths: Vec::new(),
            cse_id: None,
            cse_name: None,
            originator: None,
            ae_name: None,
            app_id: None,
            container: None,
            mni: None,
            mbs: None,
            connections: None,
            function: None,
            pipeline: None,
            request_timeout: None,
            brokers: Vec::new(),
            security_protocol: None,
            sasl_mechanism: None,
            topic: None,
            compression: None,
            aggregate: AggregateConfig::default(),
        }
    }

    /// The name used for TLS SNI and certificate verification.
    pub fn tls_server_name(&self) -> &str {
        self.server_name.as_deref().unwrap_or(&self.url.host)
    }

    /// The broker nodes this uplink may connect to, in order: `urls`, else the one `url`.
    pub fn nodes(&self) -> &[UplinkUrl] {
        if self.urls.is_empty() {
            std::slice::from_ref(&self.url)
        } else {
            &self.urls
        }
    }

    /// The TLS name of one node: `server_name` when set (one name for the whole cluster),
    /// else the node's own host.
    pub fn tls_server_name_of<'a>(&'a self, node: &'a UplinkUrl) -> &'a str {
        self.server_name.as_deref().unwrap_or(&node.host)
    }

    /// The MQTT client id of this uplink's normal-lane session on `shard`.
    pub fn session_client_id(&self, shard: usize) -> String {
        format!("{}-{shard}", self.client_id)
    }

    /// The MQTT client id of this uplink's high-lane session on `shard`.
    pub fn high_session_client_id(&self, shard: usize) -> String {
        format!("{}-{shard}-hi", self.client_id)
    }

    /// The client id of one path's session: the lane's client id, `-`, the path's name
    /// (`sluice-0-p1`, `sluice-0-hi-p1`).
    pub fn path_client_id(&self, shard: usize, high: bool, path: usize) -> String {
        let lane = if high {
            self.high_session_client_id(shard)
        } else {
            self.session_client_id(shard)
        };
        let label = self
            .paths
            .get(path)
            .map_or_else(|| format!("p{path}"), |p| p.label(path));
        format!("{lane}-{label}")
    }

    /// Reads `password_file`, if set. One trailing `\n` or `\r\n` is removed.
    pub fn read_password(&self, index: usize) -> Result<Option<Password>, ConfigError> {
        let Some(path) = &self.password_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::File {
            key: format!("uplink[{index}].password_file"),
            path: path.clone(),
            source,
        })?;
        let text = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        Ok(Some(Password(text.to_string())))
    }
}

/// A secret read from a file. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Password(<redacted>)")
    }
}

/// A broker address: `mqtts://host:port` or `mqtt://host:port`. Written as that string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UplinkUrl {
    pub tls: bool,
    /// A DNS name or IP address; IPv6 without brackets.
    pub host: String,
    pub port: u16,
}

impl UplinkUrl {
    /// What `url` holds between serde and the loader when `urls` is set (never seen by the
    /// gateway: the loader refuses a table with neither key, see `cluster.rs`).
    pub(super) fn unset() -> UplinkUrl {
        UplinkUrl {
            tls: true,
            host: String::new(),
            port: 0,
        }
    }
}

/// Why a broker URL did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid uplink url {input:?}: {reason}")]
pub struct ParseUplinkUrlError {
    input: String,
    reason: &'static str,
}

impl FromStr for UplinkUrl {
    type Err = ParseUplinkUrlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseUplinkUrlError {
            input: s.to_string(),
            reason,
        };
        let scheme_end = s.find("://").ok_or_else(|| {
            err("expected mqtts://host:port (TLS) or mqtt://host:port (plaintext)")
        })?;
        // http(s) is for oneM2M uplinks (`config/onem2m.rs` checks the scheme fits the
        // protocol; the url keeps only whether it is TLS).
        let (tls, default_port) = match s[..scheme_end].to_ascii_lowercase().as_str() {
            "mqtts" => (true, 8883),
            "mqtt" => (false, 1883),
            "https" => (true, 443),
            "http" => (false, 80),
            _ => {
                return Err(err(
                    "the scheme must be mqtts:// (TLS) or mqtt:// (plaintext); https:// or http:// for oneM2M",
                ))
            }
        };
        let rest = &s[scheme_end + 3..];
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('@') {
            return Err(err(
                "credentials do not belong in the url; use username and password_file",
            ));
        }
        if rest.contains(['/', '?', '#']) {
            return Err(err("only a host and a port are allowed after the scheme"));
        }
        let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
            let end = bracketed
                .find(']')
                .ok_or_else(|| err("missing ']' after IPv6 address"))?;
            let host = &bracketed[..end];
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(err("invalid IPv6 address in brackets"));
            }
            let port = match &bracketed[end + 1..] {
                "" => None,
                after => Some(
                    after
                        .strip_prefix(':')
                        .ok_or_else(|| err("expected ':port' after ']'"))?,
                ),
            };
            (host, port)
        } else {
            match rest.split_once(':') {
                Some((host, port)) if !port.contains(':') => (host, Some(port)),
                Some(_) => {
                    return Err(err("IPv6 addresses need brackets, e.g. mqtts://[::1]:8883"))
                }
                None => (rest, None),
            }
        };
        if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c.is_control()) {
            return Err(err("missing or malformed host"));
        }
        let port = match port {
            None => default_port,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => return Err(err("the port must be a number from 1 to 65535")),
            },
        };
        Ok(UplinkUrl {
            tls,
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for UplinkUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "mqtts" } else { "mqtt" };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

impl Serialize for UplinkUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for UplinkUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct UrlVisitor;
        impl Visitor<'_> for UrlVisitor {
            type Value = UplinkUrl;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a url such as \"mqtts://broker.example.com:8883\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<UplinkUrl, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(UrlVisitor)
    }
}

/// The protocol spoken to the far end: an MQTT version, or oneM2M over HTTP (named for its
/// first members). Written as the string `"5"`, `"3.1.1"` or `"onem2m"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MqttProtocol {
    V311,
    #[default]
    V5,
    /// oneM2M Mca over HTTP/1.1 (`sink/onem2m/`).
    OneM2m,
    /// Apache Kafka, the idempotent producer (`sink/kafka/`).
    Kafka,
}

impl MqttProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            MqttProtocol::V311 => "3.1.1",
            MqttProtocol::V5 => "5",
            MqttProtocol::OneM2m => "onem2m",
            MqttProtocol::Kafka => "kafka",
        }
    }
}

impl fmt::Display for MqttProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

const PROTOCOL_EXPECTED: &str =
    "protocol must be the string \"5\" or \"3.1.1\" (MQTT), \"onem2m\" (oneM2M over HTTP) or \"kafka\" (Apache Kafka)";

impl Serialize for MqttProtocol {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for MqttProtocol {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ProtocolVisitor;
        impl Visitor<'_> for ProtocolVisitor {
            type Value = MqttProtocol;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"5\", \"3.1.1\", \"onem2m\" or \"kafka\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MqttProtocol, E> {
                match v.trim() {
                    "5" => Ok(MqttProtocol::V5),
                    "3.1.1" => Ok(MqttProtocol::V311),
                    "onem2m" => Ok(MqttProtocol::OneM2m),
                    "kafka" => Ok(MqttProtocol::Kafka),
                    _ => Err(E::custom(PROTOCOL_EXPECTED)),
                }
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<MqttProtocol, E> {
                Err(E::custom(format!(
                    "{PROTOCOL_EXPECTED} (quote it: protocol = \"5\")"
                )))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<MqttProtocol, E> {
                Err(E::custom(format!(
                    "{PROTOCOL_EXPECTED} (quote it: protocol = \"5\")"
                )))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<MqttProtocol, E> {
                Err(E::custom(format!(
                    "{PROTOCOL_EXPECTED} (quote it: protocol = \"3.1.1\")"
                )))
            }
        }
        d.deserialize_any(ProtocolVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> UplinkUrl {
        s.parse().unwrap()
    }

    #[test]
    fn urls_default_the_port_by_scheme() {
        assert_eq!(
            url("mqtts://cloud.example.com"),
            UplinkUrl {
                tls: true,
                host: "cloud.example.com".into(),
                port: 8883
            }
        );
        assert_eq!(
            url("mqtt://10.0.0.1"),
            UplinkUrl {
                tls: false,
                host: "10.0.0.1".into(),
                port: 1883
            }
        );
        assert_eq!(url("mqtts://h:9000/").port, 9000);
        assert!(url("MQTTS://h").tls);
    }

    #[test]
    fn ipv6_urls_need_brackets_and_print_with_them() {
        let u = url("mqtts://[::1]:8884");
        assert_eq!((u.host.as_str(), u.port), ("::1", 8884));
        assert_eq!(u.to_string(), "mqtts://[::1]:8884");
        assert_eq!(url("mqtts://[fe80::1]").port, 8883);
        assert!("mqtts://::1".parse::<UplinkUrl>().is_err());
    }

    #[test]
    fn malformed_urls_are_rejected_with_a_reason() {
        for bad in [
            "cloud.example.com:8883",
            "tcp://h:1883",
            "mqtts://",
            "mqtts://h:0",
            "mqtts://h:70000",
            "mqtts://h:port",
            "mqtts://user:pw@h",
            "mqtts://h/path",
            "mqtts://h h",
        ] {
            let e = bad.parse::<UplinkUrl>().unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn urls_print_then_parse_to_the_same_value() {
        for s in [
            "mqtts://a.example:8883",
            "mqtt://b:1",
            "mqtts://[2001:db8::1]:443",
        ] {
            assert_eq!(url(s).to_string(), s);
            assert_eq!(url(&url(s).to_string()), url(s));
        }
    }

    #[test]
    fn password_debug_output_hides_the_secret() {
        let p = Password("hunter2".into());
        assert!(!format!("{p:?}").contains("hunter2"));
        assert_eq!(p.expose(), "hunter2");
    }
}
