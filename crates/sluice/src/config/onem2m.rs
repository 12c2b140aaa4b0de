//! The oneM2M side of `[[uplink]]` (`protocol = "onem2m"`): which keys belong to which
//! protocol, the checks of the oneM2M keys, and printing a oneM2M uplink back as TOML.
//!
//! Owns: the two key lists ([`MQTT_ONLY_KEYS`], [`ONEM2M_ONLY_KEYS`]), the check of the raw
//! TOML that a key of the other protocol is an error with its key path (serde's defaults would
//! otherwise hide whether a key was written at all), the scheme check of the url
//! (`http(s)://` for oneM2M, `mqtt(s)://` for MQTT), the semantic checks of the oneM2M keys,
//! and the effective defaults of the optional oneM2M keys. Does not own: the fields themselves
//! (`uplink.rs`), the container template's grammar (`crate::sink::onem2m::naming`), or
//! speaking oneM2M (`crate::sink::onem2m`).
//!
//! Invariant: `parse(&config.to_toml())` still equals `config` with oneM2M uplinks — the
//! printer ([`fix_printed_uplinks`]) writes their url as `http(s)://` and leaves out the MQTT
//! keys, which for them only carry unused defaults.

use std::time::Duration;

use super::{ByteSize, ConfigError, UplinkConfig};

/// Keys that only an MQTT uplink may set.
pub const MQTT_ONLY_KEYS: &[&str] = &[
    "client_id",
    "username",
    "password_file",
    "receive",
    "topic_prefix",
    "topic_template",
    "inflight",
    "keep_alive",
    "downlink_session_expiry",
    "install_tc",
    "tc_interface",
    "tc_rate",
    "mptcp",
    "lane_path",
    "path_timeout",
    "path_keep_alive",
    "path_reconnect_max",
    "paths",
    "aggregate",
    "urls",
];

/// Keys that only a oneM2M uplink may set.
pub const ONEM2M_ONLY_KEYS: &[&str] = &[
    "cse_id",
    "cse_name",
    "originator",
    "ae_name",
    "app_id",
    "container",
    "mni",
    "mbs",
    "connections",
    "pipeline",
    "request_timeout",
];

/// Default `container` template: the device's container, then one per topic with every level
/// kept (escaped so that two different topics never share a container).
pub const DEFAULT_CONTAINER: &str = "{device}/{topic}";
/// Default `app_id` (the AE's `api`; must start with `N` or `R`).
pub const DEFAULT_APP_ID: &str = "Nsluice";
/// Default `connections`: keep-alive HTTP/1.1 connections per (shard, uplink, lane).
pub const DEFAULT_CONNECTIONS: usize = 4;
/// Default `pipeline`: requests written ahead of their responses on one connection.
pub const DEFAULT_PIPELINE: usize = 32;
/// Default `request_timeout`.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Most `connections` × `pipeline` (the uplink's inflight window).
pub const MAX_WINDOW: usize = 65_536;

impl UplinkConfig {
    /// Whether this uplink speaks oneM2M over HTTP.
    pub fn is_onem2m(&self) -> bool {
        self.protocol == super::MqttProtocol::OneM2m
    }

    /// The AE's resource name: `ae_name`, else the originator without its leading `C`/`S`
    /// (`Csluice-gw` → `sluice-gw`), else `sluice`.
    pub fn onem2m_ae_name(&self) -> String {
        if let Some(name) = &self.ae_name {
            return name.clone();
        }
        match self.originator.as_deref() {
            Some(o) if o.len() > 1 && (o.starts_with('C') || o.starts_with('S')) => o[1..].into(),
            Some(o) if !o.is_empty() => o.into(),
            _ => "sluice".into(),
        }
    }

    /// `connections`, or its default.
    pub fn onem2m_connections(&self) -> usize {
        self.connections.unwrap_or(DEFAULT_CONNECTIONS)
    }

    /// `pipeline`, or its default.
    pub fn onem2m_pipeline(&self) -> usize {
        self.pipeline.unwrap_or(DEFAULT_PIPELINE)
    }

    /// `request_timeout`, or its default.
    pub fn onem2m_request_timeout(&self) -> Duration {
        self.request_timeout.unwrap_or(DEFAULT_REQUEST_TIMEOUT)
    }

    /// `container`, or its default.
    pub fn onem2m_container(&self) -> &str {
        self.container.as_deref().unwrap_or(DEFAULT_CONTAINER)
    }

    /// `app_id`, or its default.
    pub fn onem2m_app_id(&self) -> &str {
        self.app_id.as_deref().unwrap_or(DEFAULT_APP_ID)
    }
}

fn invalid(key: String, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// Before serde: every `[[uplink]]` table sets only keys of its protocol, and its url has the
/// protocol's scheme. Errors name the key path (`uplink[1].keep_alive`).
pub(super) fn check_raw(table: &toml::Table) -> Result<(), ConfigError> {
    let Some(toml::Value::Array(uplinks)) = table.get("uplink") else {
        return Ok(());
    };
    for (i, up) in uplinks.iter().enumerate() {
        let Some(up) = up.as_table() else { continue };
        // A Kafka uplink's keys are checked in `kafka.rs`.
        if super::kafka::is_kafka_table(up) {
            continue;
        }
        let onem2m = up
            .get("protocol")
            .and_then(toml::Value::as_str)
            .is_some_and(|p| p.trim() == "onem2m");
        if let Some(url) = up.get("url").and_then(toml::Value::as_str) {
            let scheme = url
                .split_once("://")
                .map(|(s, _)| s.to_ascii_lowercase())
                .unwrap_or_default();
            let http = scheme == "http" || scheme == "https";
            if onem2m && !http {
                return Err(invalid(
                    format!("uplink[{i}].url"),
                    format!("{url:?}: a oneM2M uplink speaks HTTP; use https://host:port (TLS) or http://host:port"),
                ));
            }
            if !onem2m && http {
                return Err(invalid(
                    format!("uplink[{i}].url"),
                    format!("{url:?} is an HTTP url, but this uplink speaks MQTT; set protocol = \"onem2m\" for a oneM2M CSE, or use mqtts://"),
                ));
            }
        }
        for key in up.keys() {
            if onem2m && MQTT_ONLY_KEYS.contains(&key.as_str()) {
                let why = match key.as_str() {
                    "aggregate" => "SenML aggregation cannot apply to oneM2M: a pack mixes devices, and every contentInstance belongs to one device's container",
                    "paths" | "lane_path" | "path_timeout" | "path_keep_alive" | "path_reconnect_max" => "per-path sessions are MQTT only; a oneM2M uplink uses one pool of HTTP connections per shard and lane",
                    "mptcp" => "MPTCP uplinks are MQTT only for now",
                    "urls" => "several cluster nodes are MQTT only; a oneM2M uplink has one url (put a load balancer in front of several CSEs)",
                    _ => "applies only to MQTT uplinks, and this uplink has protocol = \"onem2m\"",
                };
                return Err(invalid(format!("uplink[{i}].{key}"), why));
            }
            if !onem2m && ONEM2M_ONLY_KEYS.contains(&key.as_str()) {
                return Err(invalid(
                    format!("uplink[{i}].{key}"),
                    "applies only to oneM2M uplinks (protocol = \"onem2m\")",
                ));
            }
        }
    }
    Ok(())
}

/// The checks of a oneM2M uplink's own keys (after the shared ones of `validate.rs`).
pub(super) fn check(i: usize, u: &UplinkConfig) -> Result<(), ConfigError> {
    let key = |field: &str| format!("uplink[{i}].{field}");
    let cse_id = u.cse_id.as_deref().ok_or_else(|| {
        invalid(
            key("cse_id"),
            "a oneM2M uplink needs cse_id, the CSE's SP-relative CSE-ID (e.g. \"/id-in\")",
        )
    })?;
    if cse_id.len() < 2
        || !cse_id.starts_with('/')
        || cse_id[1..].contains('/')
        || !is_path_safe(&cse_id[1..])
    {
        return Err(invalid(
            key("cse_id"),
            format!(
                "{cse_id:?} is not an SP-relative CSE-ID; write '/' and the id, e.g. \"/id-in\""
            ),
        ));
    }
    let cse_name = u.cse_name.as_deref().ok_or_else(|| {
        invalid(
            key("cse_name"),
            "a oneM2M uplink needs cse_name, the CSEBase resource name (e.g. \"cse-in\")",
        )
    })?;
    if !is_path_safe(cse_name) {
        return Err(invalid(
            key("cse_name"),
            format!("{cse_name:?} must be non-empty and use only letters, digits, '-', '_', '.' and '~'"),
        ));
    }
    let originator = u.originator.as_deref().ok_or_else(|| {
        invalid(
            key("originator"),
            "a oneM2M uplink needs originator, the AE-ID sluice registers with (e.g. \"Csluice-gw\")",
        )
    })?;
    if !is_path_safe(originator) {
        return Err(invalid(
            key("originator"),
            format!("{originator:?} must be non-empty and use only letters, digits, '-', '_', '.' and '~' (it is sent as X-M2M-Origin)"),
        ));
    }
    if let Some(ae) = &u.ae_name {
        if !is_path_safe(ae) {
            return Err(invalid(
                key("ae_name"),
                format!(
                    "{ae:?} must be non-empty and use only letters, digits, '-', '_', '.' and '~'"
                ),
            ));
        }
    }
    let app_id = u.onem2m_app_id();
    if !(app_id.starts_with('N') || app_id.starts_with('R')) || !is_path_safe(app_id) {
        return Err(invalid(
            key("app_id"),
            format!("{app_id:?}: an App-ID starts with 'N' (non-registered) or 'R' (registered) and uses only letters, digits, '-', '_', '.' and '~'"),
        ));
    }
    if let Err(reason) = crate::sink::onem2m::naming::ContainerTemplate::parse(u.onem2m_container())
    {
        return Err(invalid(key("container"), reason.to_string()));
    }
    if u.mni == Some(0) {
        return Err(invalid(
            key("mni"),
            "must be at least 1; omit it to let the CSE decide",
        ));
    }
    if u.mbs.is_some_and(|b| b.as_u64() == 0) {
        return Err(invalid(
            key("mbs"),
            "must be at least 1B; omit it to let the CSE decide",
        ));
    }
    let connections = u.onem2m_connections();
    let pipeline = u.onem2m_pipeline();
    if connections == 0 || connections > 256 {
        return Err(invalid(key("connections"), "must be from 1 to 256"));
    }
    if pipeline == 0 || pipeline > 4096 {
        return Err(invalid(key("pipeline"), "must be from 1 to 4096"));
    }
    if connections * pipeline > MAX_WINDOW {
        return Err(invalid(
            key("pipeline"),
            format!("connections × pipeline must be at most {MAX_WINDOW} (the inflight window)"),
        ));
    }
    if u.onem2m_request_timeout().is_zero() {
        return Err(invalid(key("request_timeout"), "must be more than 0s"));
    }
    // A oneM2M uplink forwards; `forward` may not be empty (there is no `receive`).
    if u.forward.is_empty() {
        return Err(invalid(
            key("forward"),
            "is empty, so this oneM2M uplink would carry nothing",
        ));
    }
    if u.aggregate.enabled {
        return Err(invalid(
            key("aggregate"),
            "SenML aggregation cannot apply to oneM2M: a pack mixes devices, and every contentInstance belongs to one device's container",
        ));
    }
    if !u.paths.is_empty() || u.mptcp {
        return Err(invalid(
            key("paths"),
            "per-path sessions and MPTCP are MQTT only",
        ));
    }
    Ok(())
}

/// Characters allowed unescaped in a oneM2M id or name we put into a path or header.
fn is_path_safe(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'))
}

/// The printed form of `uplinks` (the `uplink` array of a printed config) for oneM2M ones: url
/// with `http(s)://`, no MQTT keys (see the module invariant).
pub(super) fn fix_printed_uplinks(uplinks: &mut [toml::Value], config: &[UplinkConfig]) {
    for (value, u) in uplinks.iter_mut().zip(config) {
        if !u.is_onem2m() {
            continue;
        }
        let Some(t) = value.as_table_mut() else {
            continue;
        };
        for key in MQTT_ONLY_KEYS {
            t.remove(*key);
        }
        let scheme = if u.url.tls { "https" } else { "http" };
        let host = if u.url.host.contains(':') {
            format!("[{}]", u.url.host)
        } else {
            u.url.host.clone()
        };
        t.insert(
            "url".into(),
            toml::Value::String(format!("{scheme}://{host}:{}", u.url.port)),
        );
    }
}

/// serde glue for optional durations (`request_timeout`).
pub(super) mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.collect_str(&humantime::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        #[derive(Deserialize)]
        struct Wrapped(#[serde(with = "crate::config::units::duration")] Duration);
        Wrapped::deserialize(d).map(|w| Some(w.0))
    }
}

/// `mbs` as the CSE takes it (bytes).
pub fn mbs_bytes(mbs: Option<ByteSize>) -> Option<u64> {
    mbs.map(ByteSize::as_u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[[uplink]]\nname = \"in-cse\"\nurl = \"http://127.0.0.1:8080\"\nallow_plaintext = true\nprotocol = \"onem2m\"\ncse_id = \"/id-in\"\ncse_name = \"cse-in\"\noriginator = \"Csluice-gw\"\nforward = [\"phd/#\"]\n";

    fn parse(extra: &str) -> Result<crate::config::Config, ConfigError> {
        crate::config::parse_unchecked_files(&format!("{BASE}{extra}"))
    }

    fn key_of(extra: &str) -> String {
        let e = parse(extra).expect_err("must be rejected");
        e.key().unwrap_or("(none)").to_string()
    }

    #[test]
    fn a_onem2m_uplink_parses_with_defaults_and_prints_back() {
        let c = parse("").unwrap();
        let u = &c.uplink[0];
        assert!(u.is_onem2m());
        assert_eq!(
            (u.url.host.as_str(), u.url.port, u.url.tls),
            ("127.0.0.1", 8080, false)
        );
        assert_eq!(u.onem2m_ae_name(), "sluice-gw");
        assert_eq!(u.onem2m_connections() * u.onem2m_pipeline(), 128);
        let printed = c.to_toml();
        assert!(
            printed.contains("url = \"http://127.0.0.1:8080\""),
            "{printed}"
        );
        let uplink = printed.split("[[uplink]]").nth(1).unwrap();
        assert!(
            !uplink.contains("keep_alive") && !uplink.contains("client_id"),
            "{uplink}"
        );
        assert_eq!(crate::config::parse_unchecked_files(&printed).unwrap(), c);
    }

    #[test]
    fn mqtt_keys_on_a_onem2m_uplink_are_errors_with_their_key_path() {
        assert_eq!(key_of("keep_alive = \"5s\"\n"), "uplink[0].keep_alive");
        assert_eq!(key_of("client_id = \"x\"\n"), "uplink[0].client_id");
        assert_eq!(
            key_of("[uplink.aggregate]\nenabled = true\n"),
            "uplink[0].aggregate"
        );
        let e = parse("[uplink.aggregate]\nenabled = true\n").unwrap_err();
        assert!(
            e.to_string().contains("SenML aggregation cannot apply"),
            "{e}"
        );
        assert_eq!(key_of("mptcp = true\n"), "uplink[0].mptcp");
    }

    #[test]
    fn onem2m_keys_on_an_mqtt_uplink_are_errors_with_their_key_path() {
        let text = "[[uplink]]\nname = \"c\"\nurl = \"mqtt://h\"\nallow_plaintext = true\ncse_name = \"x\"\n";
        let e = crate::config::parse_unchecked_files(text).unwrap_err();
        assert_eq!(e.key(), Some("uplink[0].cse_name"), "{e}");
        let text = "[[uplink]]\nname = \"c\"\nurl = \"http://h\"\nallow_plaintext = true\n";
        let e = crate::config::parse_unchecked_files(text).unwrap_err();
        assert_eq!(e.key(), Some("uplink[0].url"), "{e}");
        assert!(e.to_string().contains("protocol = \"onem2m\""), "{e}");
    }

    #[test]
    fn onem2m_keys_are_checked() {
        let missing = BASE.replace("cse_id = \"/id-in\"\n", "");
        let e = crate::config::parse_unchecked_files(&missing).unwrap_err();
        assert_eq!(e.key(), Some("uplink[0].cse_id"));
        let mqtt_url = BASE.replace("http://", "mqtt://");
        let e = crate::config::parse_unchecked_files(&mqtt_url).unwrap_err();
        assert_eq!(e.key(), Some("uplink[0].url"));
        assert_eq!(key_of("container = \"{device}\"\n"), "uplink[0].container");
        assert_eq!(
            key_of("container = \"{dev}/{last}\"\n"),
            "uplink[0].container"
        );
        assert_eq!(key_of("app_id = \"sluice\"\n"), "uplink[0].app_id");
        assert_eq!(key_of("mni = 0\n"), "uplink[0].mni");
        assert_eq!(key_of("pipeline = 0\n"), "uplink[0].pipeline");
        assert_eq!(key_of("connections = 300\n"), "uplink[0].connections");
        let c = parse("container = \"{device}/{last}\"\nmni = 100\nmbs = \"1MiB\"\nconnections = 2\npipeline = 8\nrequest_timeout = \"3s\"\n").unwrap();
        assert_eq!(c.uplink[0].mbs, Some(ByteSize::mib(1)));
        assert_eq!(c.uplink[0].onem2m_request_timeout(), Duration::from_secs(3));
        assert_eq!(
            crate::config::parse_unchecked_files(&c.to_toml()).unwrap(),
            c
        );
    }
}
