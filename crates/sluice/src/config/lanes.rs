//! `[priority]` and `[uplink.aggregate]`: which records are urgent, and how normal records are
//! packed into SenML when many devices are active (SegaNet §4.2–4.3).
//!
//! Owns: the config types and their defaults. Does not own: evaluating them (that is
//! `crate::priority` and `crate::sink`) or checking them (`validate.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units::{self, ByteSize};

/// `[priority]`: per-device priorities and topic rules. 1 = high, 2 = normal (the default).
///
/// A message is high priority when its device is high or its topic matches a rule of
/// priority 1. Any priority-1 entry gives every shard a second ("high lane") session per
/// uplink; without one, there is only the normal lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    /// Client id → priority. A key ending in `*` matches every client id with that prefix;
    /// an exact key wins over a prefix, a longer prefix over a shorter one.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub devices: BTreeMap<String, u8>,
    /// Topic filter (`+`/`#` allowed) → priority.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub topics: BTreeMap<String, u8>,
}

impl PriorityConfig {
    /// Whether any device or topic is high priority (so a high lane is needed).
    pub fn has_high(&self) -> bool {
        self.devices
            .values()
            .chain(self.topics.values())
            .any(|&p| p == 1)
    }
}

/// SenML encoding of aggregated packs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PackFormat {
    /// `application/senml+json`; `vd` values are base64url.
    #[default]
    Json,
    /// `application/senml+cbor`; `vd` values are raw bytes (smaller).
    Cbor,
}

/// `[uplink.aggregate] flush`: when a pack below `max_pack` goes. Every rule sends a pack at
/// `max_pack` at once (window permitting) and one whose oldest record waited `max_delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Flush {
    /// TCP autocorking's rule (the default): at once when the uplink is idle; busy while the
    /// inflight window is full, earlier bytes are unwritten, or the last partial pack is
    /// unacknowledged (Nagle's rule in Minshall's variant: one partial pack in flight).
    #[default]
    Idle,
    /// Like `Idle` without waiting for acknowledgements: busy only while the window is full
    /// or earlier bytes are unwritten (packs hold what arrives in one loop turn).
    Window,
    /// The timer rule (SegaNet's): a pack waits for `max_pack` or `max_delay`, even a lone
    /// message on an idle uplink. The most records per PUBLISH, at `max_delay`'s latency.
    MaxDelay,
}

/// `[uplink.aggregate]`: pack normal-priority records into SenML packs when many devices are
/// connected. Off by default: packing changes what the cloud receives (packs on `topic`
/// instead of each message on its own topic), so a deployment opts in.
///
/// When a pack goes (TCP autocorking's rule, `sink/outbox/fill.rs`): at once when the uplink
/// is idle, so a lone message never waits; while it is busy, records keep packing until
/// `max_pack`, `max_delay`, or the uplink is idle again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AggregateConfig {
    /// Aggregate at all (default: off). Off: every message is published on its own topic.
    pub enabled: bool,
    /// Aggregate while more than this many devices are connected to the gateway (SegaNet: 50).
    pub min_devices: usize,
    pub format: PackFormat,
    /// A pack is published once its encoding reaches this size.
    pub max_pack: ByteSize,
    /// ... or once its oldest record has waited this long (an upper bound: a pack goes as
    /// soon as the uplink is idle).
    #[serde(with = "units::duration")]
    pub max_delay: Duration,
    /// When a pack goes before `max_pack` (see [`Flush`]).
    pub flush: Flush,
    /// The cloud topic packs are published on (topic_prefix / topic_template do not apply).
    pub topic: String,
}

impl Default for AggregateConfig {
    fn default() -> Self {
        AggregateConfig {
            enabled: false,
            min_devices: 50,
            format: PackFormat::Json,
            max_pack: ByteSize::kib(1),
            max_delay: Duration::from_secs(1),
            flush: Flush::Idle,
            topic: "sluice/senml".to_string(),
        }
    }
}
