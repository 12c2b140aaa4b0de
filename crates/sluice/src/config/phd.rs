//! `[phd]`: the IEEE 11073-20601 (personal health devices) listener.
//!
//! Owns: the config type and its defaults. Does not own: acting on it (`crate::edge::phd`,
//! `crate::control::phd`) or checks across sections (`validate/phd.rs`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units::{self, ByteSize};

/// `[phd]`: health-device agents over TCP (Antidote's port is 6024). Off unless `listen` is
/// set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PhdConfig {
    /// Where agents connect, e.g. `"0.0.0.0:6024"`. Absent: no PHD listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// Local topic of each measurement: `{system_id}` (the agent's EUI-64, 16 hex digits)
    /// and `{metric}` (`spo2`, `pulse`, `bp`, `mass`, `bmi`, `temp`, `glucose`, …).
    pub topic: String,
    /// The gateway's own EUI-64 (16 hex digits), sent to agents in every association
    /// response.
    pub system_id: String,
    /// Largest APDU accepted; a larger one is answered ABRT buffer-overflow.
    pub max_apdu: ByteSize,
    /// Agent connections open at once; more are closed at accept, counted.
    pub max_connections: usize,
    /// Silence allowed before an AARQ (and after a release) before the connection closes.
    #[serde(with = "units::duration")]
    pub association_timeout: Duration,
    /// Wait for the configuration report after accepted-unknown-config (then ABRT
    /// configuration-timeout).
    #[serde(with = "units::duration")]
    pub configuration_timeout: Duration,
    /// Wait for the agent's answer to the gateway's own requests (the MDS GET; then ABRT
    /// response-timeout).
    #[serde(with = "units::duration")]
    pub response_timeout: Duration,
    /// Ask each agent for its MDS attributes (model, clock) after association.
    pub get_mds: bool,
    /// Extended configurations remembered (system id + config id → object table), so a
    /// returning agent skips the configuration exchange; the oldest is forgotten beyond.
    /// Persisted in `[spool] dir` (`phd-configs.json`) when a spool is configured.
    pub max_configs: usize,
    /// Agents listed in the agent table (associating, configuring or operating) at most;
    /// an AARQ beyond is answered rejected-transient.
    pub max_agents: usize,
    /// Agents send local time without a zone: their time stamps are read as UTC shifted by
    /// this offset (`"+01:00"`, `"-05:30"`).
    pub agent_utc_offset: String,
    /// Let an agent replace a configuration the gateway learnt for its system id and config
    /// id with a different table. Off: the first agent to teach a configuration for a system
    /// id owns it (agents have no other identity on plain TCP), and a different table for the
    /// same (system id, config id) is answered unsupported-config and the association
    /// aborted, counted in `sluice_phd_config_conflicts_total`.
    pub allow_relearn: bool,
    /// The system ids (16 hex digits each) allowed to associate; empty: every agent. Others
    /// get AARE rejected-unauthorized, counted in `sluice_phd_agents_not_allowed_total`.
    pub agents: Vec<String>,
    /// `[phd.tls]`: the listener speaks TLS (1.2 or 1.3) only. Absent: plain TCP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<PhdTlsConfig>,
    /// Experiment switch, not for production: run association and configuration on the
    /// agent's shard thread instead of the control plane (the single-plane contrast of the
    /// control-storm benchmark).
    pub single_plane: bool,
}

impl Default for PhdConfig {
    fn default() -> Self {
        PhdConfig {
            listen: None,
            topic: "phd/{system_id}/{metric}".into(),
            system_id: "8877665544332211".into(),
            max_apdu: ByteSize::kib(64),
            max_connections: 10_000,
            association_timeout: Duration::from_secs(10),
            configuration_timeout: Duration::from_secs(10),
            response_timeout: Duration::from_secs(3),
            get_mds: true,
            max_configs: 1024,
            max_agents: 10_000,
            agent_utc_offset: "+00:00".into(),
            allow_relearn: false,
            agents: Vec::new(),
            tls: None,
            single_plane: false,
        }
    }
}

/// `[phd.tls]`: TLS on the PHD listener, optionally with client certificates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhdTlsConfig {
    /// The server's certificate chain (PEM, leaf first).
    pub cert_file: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1). A secret: only its path is kept.
    pub key_file: PathBuf,
    /// CAs (PEM) that agents' client certificates must chain to. Absent: no client
    /// certificates asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
    /// Refuse agents without a valid client certificate (needs `client_ca_file`). Off: an
    /// agent may come without one (no identity but its system id), one that shows a
    /// certificate must chain to `client_ca_file`.
    #[serde(default)]
    pub require_client_cert: bool,
}

impl PhdConfig {
    /// The gateway's EUI-64; `None` when `system_id` is not 16 hex digits.
    pub fn manager_id(&self) -> Option<[u8; 8]> {
        eui64(&self.system_id)
    }

    /// The `agents` allow-list as EUI-64s: `Ok(None)` when empty (every agent allowed),
    /// `Err(entry)` for the first entry that is not 16 hex digits.
    pub fn allowed_agents(&self) -> Result<Option<Vec<[u8; 8]>>, &str> {
        if self.agents.is_empty() {
            return Ok(None);
        }
        self.agents
            .iter()
            .map(|a| eui64(a).ok_or(a.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// `agent_utc_offset` in seconds; `None` when it is not `±HH:MM`.
    pub fn utc_offset_secs(&self) -> Option<i64> {
        let s = self.agent_utc_offset.as_bytes();
        if s.len() != 6 || s[3] != b':' {
            return None;
        }
        let sign = match s[0] {
            b'+' => 1,
            b'-' => -1,
            _ => return None,
        };
        let h: i64 = self.agent_utc_offset[1..3].parse().ok()?;
        let m: i64 = self.agent_utc_offset[4..6].parse().ok()?;
        (h <= 14 && m < 60).then_some(sign * (h * 3600 + m * 60))
    }
}

/// 16 hex digits as an EUI-64.
fn eui64(text: &str) -> Option<[u8; 8]> {
    let s = text.as_bytes();
    if s.len() != 16 {
        return None;
    }
    let mut id = [0u8; 8];
    for (i, pair) in s.chunks(2).enumerate() {
        id[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(id)
}
