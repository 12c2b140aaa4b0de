//! What a Kafka transport is told by its uplink's config ([`KafkaParams`]), built from a
//! validated `[[uplink]]` with `protocol = "kafka"` (`crate::config::kafka`).
//!
//! Owns: mapping the config's keys to the transport's parameters, and reading the SASL
//! password file. Does not own: checking the keys (`config/kafka.rs`) or using them (`mod.rs`).

use std::sync::Arc;
use std::time::Duration;

use kafka_protocol::records::Compression;

use super::scram;

/// What a Kafka transport is told by its uplink's config.
#[derive(Clone)]
pub struct KafkaParams {
    /// `host:port` of the bootstrap brokers, tried in order.
    pub brokers: Vec<String>,
    /// The topic template: `{topic}` is the local topic with `/` as `.`.
    pub topic: String,
    pub compression: Compression,
    /// `Some`: every connection is TLS, verified with this configuration.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The name every broker's certificate is verified for; `None`: each broker's own host
    /// (as the cluster advertises it).
    pub server_name: Option<String>,
    /// Our client id towards the cluster (`{client_id}-{shard}`).
    pub client_id: String,
    /// How long a request may stay unanswered.
    pub request_timeout: Duration,
    /// Messages unacknowledged at once (the outbox's window).
    pub window: usize,
    /// `Some`: every connection authenticates with SASL/SCRAM first.
    pub sasl: Option<SaslParams>,
}

/// SASL/SCRAM credentials.
#[derive(Clone)]
pub struct SaslParams {
    pub mechanism: scram::Mechanism,
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for SaslParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaslParams")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl KafkaParams {
    /// The transport's parameters for `cfg` (validated) on `shard`; `tls` is `Some` when the
    /// uplink's `security_protocol` is TLS.
    pub fn from_config(
        cfg: &crate::config::UplinkConfig,
        shard: usize,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> KafkaParams {
        use crate::config::kafka::{KafkaCompression, SaslMechanism};
        let security = cfg.security_protocol.unwrap_or_default();
        let sasl = if security.sasl() {
            // Validated: username and a readable password file are set. A file gone since
            // then gives an empty password, which the broker refuses (logged there).
            let password = cfg
                .read_password(0)
                .ok()
                .flatten()
                .map(|p| p.expose().to_string())
                .unwrap_or_default();
            Some(SaslParams {
                mechanism: match cfg.sasl_mechanism.unwrap_or_default() {
                    SaslMechanism::ScramSha256 => scram::Mechanism::Sha256,
                    SaslMechanism::ScramSha512 => scram::Mechanism::Sha512,
                },
                username: cfg.username.clone().unwrap_or_default(),
                password,
            })
        } else {
            None
        };
        KafkaParams {
            brokers: cfg
                .nodes()
                .iter()
                .map(|n| {
                    if n.host.contains(':') {
                        format!("[{}]:{}", n.host, n.port)
                    } else {
                        format!("{}:{}", n.host, n.port)
                    }
                })
                .collect(),
            topic: cfg.kafka_topic().to_string(),
            compression: match cfg.compression.unwrap_or_default() {
                KafkaCompression::None => Compression::None,
                KafkaCompression::Lz4 => Compression::Lz4,
                KafkaCompression::Zstd => Compression::Zstd,
            },
            tls: if security.tls() { tls } else { None },
            server_name: cfg.server_name.clone(),
            client_id: cfg.session_client_id(shard),
            request_timeout: cfg.kafka_request_timeout(),
            window: usize::from(cfg.inflight).max(1),
            sasl,
        }
    }
}
