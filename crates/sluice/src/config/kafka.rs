//! The Kafka side of `[[uplink]]` (`protocol = "kafka"`, issue 33): its keys, their checks,
//! their defaults, and printing a Kafka uplink back as TOML.
//!
//! Owns: the key lists ([`KAFKA_ONLY_KEYS`], [`SHARED_WITH_KAFKA`], [`not_for_kafka`]), the raw-TOML check that a
//! Kafka uplink names its cluster with `brokers` (not `url`/`urls`) and sets no key of another
//! protocol, filling `url`/`urls` in from `brokers` after serde ([`fill_brokers`], so the TLS,
//! server-name and duplicate checks every node of an uplink gets apply to the brokers too),
//! the semantic checks of the Kafka keys ([`check`]), and the printed form
//! ([`fix_printed_uplinks`]). Does not own: speaking Kafka (`crate::sink::kafka`).
//!
//! Invariant: `parse(&config.to_toml())` equals `config` for Kafka uplinks (the printer writes
//! `brokers` and leaves out `url`/`urls` and the MQTT keys, which only carry defaults here).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, MqttProtocol, UplinkConfig, UplinkUrl};

/// Keys only a Kafka uplink may set.
pub const KAFKA_ONLY_KEYS: &[&str] = &[
    "brokers",
    "security_protocol",
    "sasl_mechanism",
    "topic",
    "compression",
];

/// The keys of MQTT and oneM2M uplinks that a Kafka uplink shares with them (each with the
/// same meaning).
pub const SHARED_WITH_KAFKA: &[&str] = &[
    "client_id",
    "username",
    "password_file",
    "inflight",
    "request_timeout",
];

/// A key of another protocol that a Kafka uplink may not set: `url`, and every MQTT-only and
/// oneM2M-only key except [`SHARED_WITH_KAFKA`].
pub fn not_for_kafka(key: &str) -> bool {
    key == "url"
        || ((super::onem2m::MQTT_ONLY_KEYS.contains(&key)
            || super::onem2m::ONEM2M_ONLY_KEYS.contains(&key))
            && !SHARED_WITH_KAFKA.contains(&key))
}

/// Default `topic`: the local topic, `/` written as `.`.
pub const DEFAULT_TOPIC: &str = "{topic}";
/// Default `request_timeout` for Kafka (a produce with `acks = all` waits for the replicas).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Most brokers in `brokers` (a bootstrap list, not the cluster's inventory).
pub const MAX_BROKERS: usize = 16;

/// How the cluster is reached (Kafka's `security.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecurityProtocol {
    /// TLS (the default).
    #[default]
    Ssl,
    /// TLS, then SASL/SCRAM.
    SaslSsl,
    /// Unencrypted (needs `allow_plaintext = true`).
    Plaintext,
    /// Unencrypted, then SASL/SCRAM (needs `allow_plaintext = true`).
    SaslPlaintext,
}

impl SecurityProtocol {
    pub fn tls(self) -> bool {
        matches!(self, SecurityProtocol::Ssl | SecurityProtocol::SaslSsl)
    }
    pub fn sasl(self) -> bool {
        matches!(
            self,
            SecurityProtocol::SaslSsl | SecurityProtocol::SaslPlaintext
        )
    }
}

/// `sasl_mechanism`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SaslMechanism {
    #[default]
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
}

/// `compression` of record batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KafkaCompression {
    None,
    /// The default: cheap on a small gateway's CPU, and what the consumer sees is unchanged.
    #[default]
    Lz4,
    Zstd,
}

impl UplinkConfig {
    /// Whether this uplink produces to Apache Kafka.
    pub fn is_kafka(&self) -> bool {
        self.protocol == MqttProtocol::Kafka
    }
    /// `topic`, or its default.
    pub fn kafka_topic(&self) -> &str {
        self.topic.as_deref().unwrap_or(DEFAULT_TOPIC)
    }
    /// `request_timeout`, or Kafka's default.
    pub fn kafka_request_timeout(&self) -> Duration {
        self.request_timeout.unwrap_or(DEFAULT_REQUEST_TIMEOUT)
    }
}

fn invalid(key: String, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// Whether a raw `[[uplink]]` table is a Kafka one.
pub(super) fn is_kafka_table(up: &toml::Table) -> bool {
    up.get("protocol")
        .and_then(toml::Value::as_str)
        .is_some_and(|p| p.trim() == "kafka")
}

/// Before serde: a Kafka uplink sets `brokers` (a non-empty list of at most [`MAX_BROKERS`]
/// `host:port` strings) and no key [`not_for_kafka`]; no other uplink sets a Kafka key.
pub(super) fn check_raw(table: &toml::Table) -> Result<(), ConfigError> {
    let Some(toml::Value::Array(uplinks)) = table.get("uplink") else {
        return Ok(());
    };
    for (i, up) in uplinks.iter().enumerate() {
        let Some(up) = up.as_table() else { continue };
        if !is_kafka_table(up) {
            if let Some(key) = up.keys().find(|k| KAFKA_ONLY_KEYS.contains(&k.as_str())) {
                return Err(invalid(
                    format!("uplink[{i}].{key}"),
                    "applies only to Kafka uplinks (protocol = \"kafka\")",
                ));
            }
            continue;
        }
        for key in up.keys() {
            if not_for_kafka(key) {
                let why = match key.as_str() {
                    "url" | "urls" => "a Kafka uplink names its bootstrap brokers with brokers = [\"host:9093\", …]",
                    "aggregate" => "SenML aggregation cannot apply to Kafka: a pack mixes devices, and a record's key is its device",
                    "topic_prefix" | "topic_template" => "a Kafka uplink names its topic with topic = \"{topic}\" (the local topic, / as .) or a fixed name",
                    "receive" => "a Kafka uplink only produces; commands come from MQTT uplinks",
                    _ => "does not apply to Kafka uplinks (protocol = \"kafka\")",
                };
                return Err(invalid(format!("uplink[{i}].{key}"), why));
            }
        }
        match up.get("brokers") {
            None => {
                return Err(invalid(
                    format!("uplink[{i}].brokers"),
                    "missing: list the cluster's bootstrap brokers, brokers = [\"kafka1:9093\", \"kafka2:9093\"]",
                ))
            }
            Some(toml::Value::Array(list)) => {
                if list.is_empty() || list.len() > MAX_BROKERS {
                    return Err(invalid(
                        format!("uplink[{i}].brokers"),
                        format!("lists {} brokers; give 1 to {MAX_BROKERS}", list.len()),
                    ));
                }
                for (j, b) in list.iter().enumerate() {
                    let Some(b) = b.as_str() else { continue };
                    if let Err(reason) = parse_broker(b, true) {
                        return Err(invalid(format!("uplink[{i}].brokers[{j}]"), reason));
                    }
                }
            }
            // Any other type: serde names it with the key path.
            Some(_) => {}
        }
    }
    Ok(())
}

/// `host:port` (IPv6 in brackets) into a node of the uplink.
fn parse_broker(s: &str, tls: bool) -> Result<UplinkUrl, String> {
    let bad = || format!("{s:?} is not host:port (e.g. \"kafka1.example.com:9093\")");
    if s.contains("://") {
        return Err(format!(
            "{s:?}: write brokers as host:port; TLS or not is security_protocol's"
        ));
    }
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 || host.contains(['/', '[', ']', ' ']) {
        return Err(bad());
    }
    Ok(UplinkUrl {
        tls,
        host: host.to_string(),
        port,
    })
}

/// After serde: a Kafka uplink's `url`/`urls` are its brokers (TLS per `security_protocol`),
/// so every check and status line that reads nodes reads them.
pub(super) fn fill_brokers(uplinks: &mut [UplinkConfig]) {
    for u in uplinks.iter_mut().filter(|u| u.is_kafka()) {
        let tls = u.security_protocol.unwrap_or_default().tls();
        let nodes: Vec<UplinkUrl> = u
            .brokers
            .iter()
            .filter_map(|b| parse_broker(b, tls).ok())
            .collect();
        if let Some(first) = nodes.first() {
            u.url = first.clone();
        }
        u.urls = if nodes.len() > 1 { nodes } else { Vec::new() };
    }
}

/// The printed form of a Kafka uplink: `brokers`, no `url`/`urls`, no MQTT-only defaults.
pub(super) fn fix_printed_uplinks(uplinks: &mut [toml::Value], config: &[UplinkConfig]) {
    for (value, u) in uplinks.iter_mut().zip(config) {
        if !u.is_kafka() {
            continue;
        }
        let Some(t) = value.as_table_mut() else {
            continue;
        };
        t.retain(|key, _| !not_for_kafka(key));
    }
}

/// The Kafka keys' meaning: a topic template that can render, SASL credentials when
/// `security_protocol` asks for SASL (and not without), and the window.
pub(super) fn check(i: usize, u: &UplinkConfig) -> Result<(), ConfigError> {
    let key = |field: &str| format!("uplink[{i}].{field}");
    let topic = u.kafka_topic();
    let sample = topic.replace("{topic}", "a");
    if crate::sink::kafka::KafkaTransport::topic_for(topic, "a").is_err() || sample.contains('{') {
        return Err(invalid(
            key("topic"),
            format!("{topic:?}: a Kafka topic of a-z A-Z 0-9 . _ - (at most 249), where {{topic}} stands for the local topic with / as ."),
        ));
    }
    let security = u.security_protocol.unwrap_or_default();
    let creds = u.username.is_some() && u.password_file.is_some();
    if security.sasl() && !creds {
        return Err(invalid(
            key("username"),
            "security_protocol with SASL needs username and password_file",
        ));
    }
    if !security.sasl() {
        for (field, set) in [
            ("sasl_mechanism", u.sasl_mechanism.is_some()),
            ("username", u.username.is_some()),
            ("password_file", u.password_file.is_some()),
        ] {
            if set {
                return Err(invalid(
                    key(field),
                    "is for SASL: set security_protocol = \"sasl_ssl\" (or \"sasl_plaintext\")",
                ));
            }
        }
    }
    if u.inflight == 0 {
        return Err(invalid(key("inflight"), "must be at least 1"));
    }
    let t = u.kafka_request_timeout();
    if t < Duration::from_secs(1) || t > Duration::from_secs(600) {
        return Err(invalid(key("request_timeout"), "must be from 1s to 10m"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::parse;

    const BASE: &str = "[[uplink]]\nname = \"k\"\nprotocol = \"kafka\"\nbrokers = [\"127.0.0.1:9092\", \"[::1]:9093\"]\nallow_plaintext = true\nsecurity_protocol = \"plaintext\"\n";

    fn err(extra: &str) -> String {
        parse(&format!("{BASE}{extra}")).unwrap_err().to_string()
    }

    #[test]
    fn a_kafka_uplink_reads_its_brokers_as_nodes_and_prints_back_the_same() {
        let c = parse(BASE).unwrap();
        let u = &c.uplink[0];
        assert!(u.is_kafka());
        assert_eq!(u.nodes().len(), 2);
        assert_eq!(u.nodes()[1].host, "::1");
        assert_eq!(u.nodes()[1].port, 9093);
        assert!(!u.url.tls);
        assert_eq!(u.kafka_topic(), "{topic}");
        let printed = c.to_toml();
        assert!(!printed.contains("url"), "{printed}");
        assert_eq!(parse(&printed).unwrap(), c);
    }

    #[test]
    fn wrong_keys_and_values_name_the_key() {
        assert!(err("url = \"mqtt://x\"\n").contains("uplink[0].url"));
        assert!(err("receive = [\"a\"]\n").contains("uplink[0].receive"));
        assert!(err("topic = \"a b\"\n").contains("uplink[0].topic"));
        assert!(err("username = \"u\"\n").contains("uplink[0].username"));
        let no_brokers = "[[uplink]]\nname = \"k\"\nprotocol = \"kafka\"\n";
        assert!(parse(no_brokers)
            .unwrap_err()
            .to_string()
            .contains("uplink[0].brokers"));
        let tls_without_ca =
            "[[uplink]]\nname = \"k\"\nprotocol = \"kafka\"\nbrokers = [\"k:9093\"]\n";
        assert!(parse(tls_without_ca)
            .unwrap_err()
            .to_string()
            .contains("ca_file"));
        let plain_not_allowed = "[[uplink]]\nname = \"k\"\nprotocol = \"kafka\"\nbrokers = [\"k:9092\"]\nsecurity_protocol = \"plaintext\"\n";
        assert!(parse(plain_not_allowed)
            .unwrap_err()
            .to_string()
            .contains("allow_plaintext"));
        let broker_url =
            "[[uplink]]\nname = \"k\"\nprotocol = \"kafka\"\nbrokers = [\"kafka://k:9092\"]\n";
        assert!(parse(broker_url)
            .unwrap_err()
            .to_string()
            .contains("uplink[0].brokers[0]"));
        let mqtt_with_brokers = "[[uplink]]\nname = \"m\"\nurl = \"mqtt://h\"\nallow_plaintext = true\nbrokers = [\"k:1\"]\n";
        assert!(parse(mqtt_with_brokers)
            .unwrap_err()
            .to_string()
            .contains("uplink[0].brokers"));
    }
}
