//! The gateway's configuration: one TOML file → a validated [`Config`].
//!
//! Owns: the config types (their field names are a contract other modules code against),
//! defaults, parsing with key-path errors, semantic validation, and printing the effective
//! config back as TOML. Does not own: acting on the values (each subsystem reads its section).
//!
//! Invariants:
//! - Unknown keys are rejected, and every parse error names the key path
//!   (`uplink[0].forwrd: unknown field ...`) and, where known, the line and column.
//! - Sizes and durations carry units in the file (`"64MiB"`, `"30s"`); bare numbers are errors.
//! - A `Config` returned by [`load`] or [`parse`] has passed [`Config::validate`], including that
//!   every referenced file (CA bundle, certificate, key, password) can be opened.
//! - `parse(&config.to_toml())` yields a config equal to `config`.
//! - Secrets are referenced by path; `Debug` never prints a password or password hash.
//! - Relative file paths are resolved by [`load`] against the config file's directory (and
//!   stored resolved); [`parse`] leaves them relative to the working directory.
//!
//! The file format is documented option by option in `config/sluice.example.toml`.

mod acl;
mod cluster;
mod coap;
mod function;
pub mod kafka;
mod lanes;
mod limits;
mod mqtt_tls;
mod multipath;
mod onem2m;
mod phd;
mod spool;
mod state;
mod units;
mod uplink;
mod validate;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_coap;
#[cfg(test)]
mod tests_coap_dtls;
#[cfg(test)]
mod tests_files;
#[cfg(test)]
mod tests_mqtt_tls;

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use acl::{read_acl_file, AclAction, AclConfig, AclFile, AclPermission, AclRuleConfig};
pub use coap::{CoapConfig, CoapDtlsConfig, CoapProxyConfig, ProxyTarget, PskTable};
pub use function::{
    command_takes_fd3, dead_letter_topic, parse_remote_url, FunctionConfig, Prewarm, RemoteUrl,
    SocketMode, FUNCTION_SINK_PREFIX,
};
pub use lanes::{AggregateConfig, Flush, PackFormat, PriorityConfig};
pub use limits::LimitsConfig;
pub use mqtt_tls::{MqttTlsConfig, MqttWsConfig, MqttWssConfig, TlsMinVersion, DEFAULT_WS_PATH};
pub use multipath::MultipathConfig;
pub use onem2m::{
    mbs_bytes as onem2m_mbs_bytes, DEFAULT_CONTAINER as ONEM2M_DEFAULT_CONTAINER, MQTT_ONLY_KEYS,
    ONEM2M_ONLY_KEYS,
};
pub use phd::{PhdConfig, PhdTlsConfig};
pub use spool::{
    DrainOrder, FsyncMode, Share, SpoolAck, SpoolConfig, WhenFull, RECORD_OVERHEAD_BYTES,
};
pub use state::StateConfig;
pub use units::{ByteSize, ParseByteSizeError};
pub use uplink::{
    MqttProtocol, ParseUplinkUrlError, Password, PathConfig, UplinkConfig, UplinkUrl,
};

/// Loads the config file at `path`, or the built-in defaults when `path` is `None`.
pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
    let Some(path) = path else {
        let config = Config::default();
        config.validate()?;
        return Ok(config);
    };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut config = deserialize(&text)?;
    if let Some(dir) = path.parent() {
        config.resolve_relative_paths(dir);
    }
    config.validate()?;
    Ok(config)
}

/// Parses and validates config text. Relative file paths are relative to the working directory.
pub fn parse(text: &str) -> Result<Config, ConfigError> {
    let config = deserialize(text)?;
    config.validate()?;
    Ok(config)
}

/// Like [`parse`] but does not check that referenced files exist (for linting a config on a
/// machine other than the gateway, and for testing the example file).
pub fn parse_unchecked_files(text: &str) -> Result<Config, ConfigError> {
    let config = deserialize(text)?;
    validate::check(&config, validate::Files::Unchecked)?;
    Ok(config)
}

/// Why a config could not be loaded. Each message names the file, line, or key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file itself could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML.
    #[error("config syntax error at line {line}, column {column}: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    /// A key is unknown, missing, or its value has the wrong type or form.
    #[error("{key}: {message}{}", location_suffix(*.line, *.column))]
    Value {
        /// Dotted key path, e.g. `uplink[0].forward`.
        key: String,
        message: String,
        line: Option<usize>,
        column: Option<usize>,
    },
    /// Values are well-formed but not acceptable (alone or together).
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
    /// A file the config refers to cannot be opened.
    #[error("{key}: cannot read {path}: {source}")]
    File {
        key: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ConfigError {
    /// The key path at fault, if the error concerns one key.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Value { key, .. }
            | ConfigError::Invalid { key, .. }
            | ConfigError::File { key, .. } => Some(key),
            ConfigError::Read { .. } | ConfigError::Syntax { .. } => None,
        }
    }
}

fn location_suffix(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(" (line {l}, column {c})"),
        (Some(l), None) => format!(" (line {l})"),
        _ => String::new(),
    }
}

/// The whole file: `[gateway]`, `[mqtt]`, `[coap]`, `[admin]`, `[log]`, `[priority]`, `[spool]`,
/// `[multipath]`, `[phd]`, `[acl]`, `[limits]` and any
/// number of `[[uplink]]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub gateway: GatewayConfig,
    pub mqtt: MqttConfig,
    pub coap: CoapConfig,
    pub admin: AdminConfig,
    pub log: LogConfig,
    pub priority: PriorityConfig,
    pub spool: SpoolConfig,
    /// Retained messages and persistent sessions across restarts (`crate::state`).
    pub state: StateConfig,
    pub multipath: MultipathConfig,
    pub phd: PhdConfig,
    /// Authorization for every edge (`control/acl/`, ADR 0008).
    pub acl: AclConfig,
    /// Per-device rates, connection rates, flapping devices (ADR 0008).
    pub limits: LimitsConfig,
    /// What a reload does with what it removes (`app/reload.rs`, ADR 0013).
    pub reload: ReloadConfig,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub uplink: Vec<UplinkConfig>,
    /// Edge functions (`config/function.rs`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub function: Vec<FunctionConfig>,
}

impl Config {
    /// The effective config as TOML, units written back (`"30s"`, `"64MiB"`); [`parse`] accepts it.
    pub fn to_toml(&self) -> String {
        // Invariant: every type in Config serializes to TOML (no maps with non-string keys,
        // `None` fields are skipped, tables come after plain values in every struct).
        if self.uplink.iter().any(|u| u.function.is_some()) {
            let mut file = self.clone();
            file.uplink.retain(|u| u.function.is_none());
            return file.to_toml();
        }
        if !self
            .uplink
            .iter()
            .any(|u| u.is_onem2m() || u.is_kafka() || !u.urls.is_empty())
        {
            return toml::to_string(self).expect("Config is always representable as TOML");
        }
        // oneM2M uplinks print their url as http(s):// and without MQTT keys (`onem2m.rs`);
        // an uplink with `urls` prints no `url` (`cluster.rs`).
        let mut table =
            toml::Table::try_from(self).expect("Config is always representable as TOML");
        if let Some(toml::Value::Array(uplinks)) = table.get_mut("uplink") {
            onem2m::fix_printed_uplinks(uplinks, &self.uplink);
            cluster::fix_printed_uplinks(uplinks, &self.uplink);
            kafka::fix_printed_uplinks(uplinks, &self.uplink);
        }
        toml::to_string(&table).expect("a TOML table is always representable as TOML")
    }

    /// The config the gateway runs: every `[[function]]` appended to `uplink` as its sink
    /// entry (`function.{name}`), so functions get outboxes, queues, spools and metrics like
    /// uplinks. Idempotent. The file's own view ([`Config::to_toml`]) never shows these.
    pub fn with_function_sinks(mut self) -> Config {
        if self.uplink.iter().any(|u| u.function.is_some()) {
            return self;
        }
        let entries: Vec<UplinkConfig> = self
            .function
            .iter()
            .map(|f| std::sync::Arc::new(f.clone()).sink_entry())
            .collect();
        self.uplink.extend(entries);
        self
    }

    /// Checks values alone and together, and that referenced files can be opened.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate::check(self, validate::Files::MustExist)
    }

    /// Valid settings that are probably not meant (e.g. plain CoAP beside MQTT logins), one
    /// sentence each: `sluice check` prints them, the gateway logs them at start.
    pub fn warnings(&self) -> Vec<String> {
        validate::warnings(self)
    }

    fn resolve_relative_paths(&mut self, base: &Path) {
        let resolve = |p: &mut Option<PathBuf>| {
            if let Some(path) = p {
                if path.is_relative() {
                    *path = base.join(&*path);
                }
            }
        };
        resolve(&mut self.spool.dir);
        resolve(&mut self.state.dir);
        resolve(&mut self.acl.file);
        for u in &mut self.uplink {
            resolve(&mut u.ca_file);
            resolve(&mut u.cert_file);
            resolve(&mut u.key_file);
            resolve(&mut u.password_file);
        }
        // A local function runs in the config file's directory unless `dir` says otherwise.
        for f in &mut self.function {
            if f.dir.is_none() && f.command.is_some() && !base.as_os_str().is_empty() {
                f.dir = Some(base.to_path_buf());
            }
            resolve(&mut f.dir);
        }
        resolve(&mut self.admin.token_file);
        resolve(&mut self.admin.cert_file);
        resolve(&mut self.admin.key_file);
        if let Some(tls) = &mut self.mqtt.tls {
            for path in [&mut tls.cert_file, &mut tls.key_file] {
                if path.is_relative() {
                    *path = base.join(&*path);
                }
            }
            resolve(&mut tls.client_ca_file);
        }
        for p in &mut self.coap.proxy {
            resolve(&mut p.ca_file);
            resolve(&mut p.cert_file);
            resolve(&mut p.key_file);
        }
        if let Some(t) = &mut self.phd.tls {
            for path in [&mut t.cert_file, &mut t.key_file] {
                if path.is_relative() {
                    *path = base.join(&*path);
                }
            }
            resolve(&mut t.client_ca_file);
        }
        if let Some(d) = &mut self.coap.dtls {
            resolve(&mut d.psk_file);
            resolve(&mut d.cert_file);
            resolve(&mut d.key_file);
            resolve(&mut d.client_ca_file);
        }
    }
}

/// The machine's host name (from /proc), else `sluice`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "sluice".to_owned())
}

/// `[gateway]`: threads and memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// This gateway's name in `sluice status`, `/api/v1/status` and `/api/v1/devices`, so a
    /// site of several gateways says which one holds which device. Absent: the host name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Data-plane shards (threads); 0 means one per available core but one, at least one
    /// ([`GatewayConfig::auto_shards`]).
    pub shards: usize,
    /// Pin each shard thread to its own core.
    pub pin_threads: bool,
    /// Capacity (messages) of each bounded inter-shard and control mailbox.
    pub mailbox_capacity: usize,
    /// Memory bound for messages waiting for the cloud, whole gateway, split evenly over shards.
    pub max_buffered: ByteSize,
    // --- Input bounds (the "bounds" part: shard/limits.rs) ---
    /// Bound on the bytes queued for devices (outboxes and inflight windows of all sessions),
    /// whole gateway, split evenly over shards.
    pub max_outbox_memory: ByteSize,
    /// Pin the control-plane threads (`sluice-control`, `sluice-listener`, `sluice-phd`) to
    /// this core (0-based), e.g. to keep them off the shards' cores. Absent: not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_core: Option<usize>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            name: None,
            shards: 0,
            pin_threads: true,
            mailbox_capacity: 4096,
            max_buffered: ByteSize::mib(64),
            // Input bounds.
            max_outbox_memory: ByteSize::mib(256),
            control_core: None,
        }
    }
}

impl GatewayConfig {
    /// Most shards a config may ask for.
    pub const MAX_SHARDS: usize = 1024;
    /// Longest `name`, in bytes.
    pub const MAX_NAME: usize = 64;

    /// `name`, else [`host_name`].
    pub fn effective_name(&self) -> String {
        self.name.clone().unwrap_or_else(host_name)
    }

    /// The number of shards to run: `shards`, or for 0 [`Self::auto_shards`] of the
    /// available cores.
    pub fn shard_count(&self) -> usize {
        if self.shards != 0 {
            return self.shards;
        }
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Self::auto_shards(cores)
    }

    /// `shards = 0`: one shard per core but one, and at least one (at most [`Self::MAX_SHARDS`]).
    /// A shard sleeps and wakes on its own, so below full load every extra shard adds
    /// wake-ups per message; the core left over carries the control plane, the listener and
    /// the kernel's network work, which a gateway's shards keep busy (docs/perf/core-path.md,
    /// "How many shards").
    pub fn auto_shards(cores: usize) -> usize {
        cores.saturating_sub(1).clamp(1, Self::MAX_SHARDS)
    }

    /// Each shard's share of `max_buffered`, in bytes.
    pub fn max_buffered_per_shard(&self, shard_count: usize) -> u64 {
        self.max_buffered.as_u64() / shard_count.max(1) as u64
    }
}

/// `[mqtt]`: the device-facing MQTT listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MqttConfig {
    #[serde(with = "units::socket_addr")]
    pub listen: SocketAddr,
    /// Most device connections open at once; more are refused.
    pub max_connections: usize,
    /// Largest MQTT packet accepted from or sent to a device.
    pub max_packet_size: ByteSize,
    /// Time allowed for CONNECT after the TCP accept.
    #[serde(with = "units::duration")]
    pub connect_timeout: Duration,
    /// QoS 1/2 publishes a device may have unacknowledged (advertised to MQTT 5 clients).
    pub receive_maximum: u16,
    /// QoS 1/2 messages sent to a device and awaiting its ack.
    pub max_inflight_out: u16,
    /// Topic aliases a device may use (0 disables).
    pub topic_alias_maximum: u16,
    /// Longest a persistent session is kept while its device is offline.
    #[serde(with = "units::duration")]
    pub session_expiry_max: Duration,
    /// Messages queued per device while it is offline or slow.
    pub max_queued_messages: usize,
    pub max_retained_messages: usize,
    pub max_client_id_len: usize,
    /// Assign a client id to devices that connect with an empty one.
    pub allow_empty_client_id: bool,
    /// If non-empty, client ids must start with one of these.
    pub client_id_prefixes: Vec<String>,
    /// Accept devices that present no username. Absent: false when `users` are configured,
    /// true otherwise (see [`MqttConfig::anonymous_allowed`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_anonymous: Option<bool>,
    // --- admission: password checks (`control/admission.rs`) ---
    /// Password verifications running at once; each holds its hash's memory (19 MiB for a
    /// `sluice passwd` hash), so this bounds admission's memory.
    pub auth_concurrency: usize,
    /// Logins that may wait for a verification slot (each until its `connect_timeout`);
    /// beyond, a login is refused as busy (CONNACK 0x89 / 3.1.1: 0x03).
    pub auth_queue: usize,
    // --- end admission ---

    // --- Input bounds (the "bounds" part: shard/limits.rs) ---
    /// Most levels in a topic name or filter a device may use (will topics included).
    pub max_topic_levels: usize,
    /// Longest topic name or filter a device may use.
    pub max_topic_length: ByteSize,
    /// Sessions held at once (connected and offline persistent), whole gateway.
    pub max_sessions: usize,
    /// Bytes queued per session (outbox and inflight), charged topic + payload + 256 B each.
    pub max_queued_bytes: ByteSize,
    /// Bytes of retained messages (topic + payload + 256 B each), whole gateway.
    pub max_retained_bytes: ByteSize,
    /// Subscriptions one session may hold.
    pub max_subscriptions_per_session: usize,
    /// SO_SNDBUF of each device socket: the kernel memory a device that reads slowly holds
    /// beyond its outbox. `0B`: the kernel's own (autotuned up to `net.ipv4.tcp_wmem`).
    pub send_buffer: ByteSize,
    // --- end of input bounds ---
    /// Accept devices over MPTCP (IPPROTO_MPTCP listener; plain TCP devices still connect).
    pub mptcp: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub users: Vec<UserConfig>,

    // --- MQTT 5 session options (device-facing MQTT session, edge/mqtt/connection.rs) ---
    /// Longest keep-alive an MQTT 5 device may use; a device asking for more, or for none,
    /// is told this as Server Keep Alive and held to it. Zero (the default): no limit. 3.1.1
    /// devices cannot be told, and keep their own.
    #[serde(with = "units::duration")]
    pub max_keep_alive: Duration,

    // --- Listeners besides plain TCP (`config/mqtt_tls.rs`, `edge/mqtt/stream/`) ---
    /// `[mqtt.tls]`: MQTT over TLS. Absent: no TLS listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<MqttTlsConfig>,
    /// `[mqtt.ws]`: MQTT over WebSocket. Absent: no WebSocket listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ws: Option<MqttWsConfig>,
    /// `[mqtt.wss]`: MQTT over WebSocket over TLS (with `[mqtt.tls]`'s certificate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wss: Option<MqttWssConfig>,
}

// --- admission (`control/admission.rs`) ---
impl MqttConfig {
    /// Whether devices without a username are admitted: `allow_anonymous` when set, else
    /// only when no `users` are configured (configuring logins closes the door by default).
    pub fn anonymous_allowed(&self) -> bool {
        self.allow_anonymous.unwrap_or(self.users.is_empty())
    }
}
// --- end admission ---

impl Default for MqttConfig {
    fn default() -> Self {
        MqttConfig {
            listen: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1883)),
            max_connections: 10_000,
            max_packet_size: ByteSize::mib(1),
            connect_timeout: Duration::from_secs(10),
            receive_maximum: 64,
            max_inflight_out: 32,
            topic_alias_maximum: 32,
            session_expiry_max: Duration::from_secs(2 * 3600),
            max_queued_messages: 1000,
            max_retained_messages: 10_000,
            max_client_id_len: 128,
            allow_empty_client_id: true,
            client_id_prefixes: Vec::new(),
            allow_anonymous: None,
            auth_concurrency: 2,
            auth_queue: 256,
            // Input bounds.
            max_topic_levels: 32,
            max_topic_length: ByteSize::kib(1),
            max_sessions: 20_000,
            max_queued_bytes: ByteSize::mib(4),
            max_retained_bytes: ByteSize::mib(64),
            max_subscriptions_per_session: 100,
            send_buffer: ByteSize(0),
            mptcp: false,
            users: Vec::new(),
            max_keep_alive: Duration::ZERO,
            tls: None,
            ws: None,
            wss: None,
        }
    }
}

/// `[[mqtt.users]]`: a device login. `Debug` redacts the hash.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    pub username: String,
    /// A PHC string, e.g. `$argon2id$v=19$m=19456,t=2,p=1$<salt>$<hash>`.
    pub password_hash: String,
}

impl fmt::Debug for UserConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserConfig")
            .field("username", &self.username)
            .field("password_hash", &"<redacted>")
            .finish()
    }
}

/// `[admin]`: the HTTP endpoint for `/metrics` and `/api/v1/status`. Its access rules are
/// in `crate::admin`: on a loopback address reading needs no token; elsewhere `token_file` is
/// required and every request carries it; writing always needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub enabled: bool,
    #[serde(with = "units::socket_addr")]
    pub listen: SocketAddr,
    /// A file holding the bearer token (a path: the token itself is never in the config,
    /// printed or logged).
    pub token_file: Option<PathBuf>,
    /// PEM certificate chain: serve the endpoint over TLS (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key for `cert_file`.
    pub key_file: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            enabled: true,
            listen: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9100)),
            token_file: None,
            cert_file: None,
            key_file: None,
        }
    }
}

/// Shortest bearer token accepted in `admin.token_file`.
pub const ADMIN_TOKEN_MIN_LEN: usize = 16;

impl AdminConfig {
    /// Reads `token_file`, if set: one line (one trailing `\n` or `\r\n` removed) of at
    /// least [`ADMIN_TOKEN_MIN_LEN`] visible ASCII characters (what an `Authorization`
    /// header can carry).
    pub fn read_token(&self) -> Result<Option<AdminToken>, ConfigError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read(path).map_err(|source| ConfigError::File {
            key: "admin.token_file".to_string(),
            path: path.clone(),
            source,
        })?;
        let token = text
            .strip_suffix(b"\r\n")
            .or_else(|| text.strip_suffix(b"\n"))
            .unwrap_or(&text);
        if token.len() < ADMIN_TOKEN_MIN_LEN || !token.iter().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::Invalid {
                key: "admin.token_file".to_string(),
                reason: format!(
                    "{}: the token must be one line of at least {ADMIN_TOKEN_MIN_LEN} visible ASCII characters (no spaces)",
                    path.display()
                ),
            });
        }
        Ok(Some(AdminToken(token.to_vec())))
    }
}

/// The admin endpoint's bearer token. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(Vec<u8>);

impl AdminToken {
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A level (`error`, `warn`, `info`, `debug`, `trace`) or an EnvFilter directive list
    /// such as `"info,sluice::sink=debug"`.
    pub level: String,
    /// How each line is written to standard output.
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".to_string(),
            format: LogFormat::Text,
        }
    }
}

/// `[reload]`: how a reload removes an uplink or a function (ADR 0013).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReloadConfig {
    /// How long a removed uplink's (or function's) sessions keep sending what it already
    /// holds; then what is left is acknowledged to its devices unsent (MQTT 5 reason 0x10)
    /// and counted `sluice_uplink_dropped_total{reason="uplink_removed"}`.
    #[serde(with = "units::duration")]
    pub drain_timeout: std::time::Duration,
}

impl Default for ReloadConfig {
    fn default() -> Self {
        ReloadConfig {
            drain_timeout: std::time::Duration::from_secs(10),
        }
    }
}

/// `log.format`: one human-readable line per event, or one JSON object per line (for Loki,
/// Elasticsearch, journald's `JSON=` tooling, `jq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// TOML text → `Config` without semantic checks; errors carry the key path.
fn deserialize(text: &str) -> Result<Config, ConfigError> {
    // Parse once on its own so that syntax errors are told apart from bad values.
    match text.parse::<toml::Table>() {
        Err(e) => {
            let (line, column) = line_column(text, e.span());
            return Err(ConfigError::Syntax {
                line: line.unwrap_or(1),
                column: column.unwrap_or(1),
                message: one_line(e.message()),
            });
        }
        // Keys of the other protocol on an uplink (serde's defaults would hide them).
        Ok(table) => {
            onem2m::check_raw(&table)?;
            cluster::check_raw(&table)?;
            kafka::check_raw(&table)?;
        }
    }
    let mut config: Config = serde_path_to_error::deserialize(toml::Deserializer::new(text))
        .map_err(|e| {
            let key = match e.path().to_string() {
                p if p == "." || p.is_empty() => "(top level)".to_string(),
                p => p,
            };
            let inner = e.into_inner();
            let (line, column) = line_column(text, inner.span());
            ConfigError::Value {
                key,
                message: one_line(inner.message()),
                line,
                column,
            }
        })?;
    kafka::fill_brokers(&mut config.uplink);
    cluster::fill_first_node(&mut config.uplink);
    Ok(config)
}

/// toml's messages may span lines ("invalid table header\nexpected `.`, `]`").
fn one_line(message: &str) -> String {
    message
        .trim()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// 1-based line and column of the start of `span` in `text`.
fn line_column(text: &str, span: Option<std::ops::Range<usize>>) -> (Option<usize>, Option<usize>) {
    let Some(span) = span else {
        return (None, None);
    };
    let start = span.start.min(text.len());
    let Some(before) = text.get(..start) else {
        return (None, None);
    };
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (Some(line), Some(column))
}
