//! `[spool]`: the durable spool between the shards and the uplinks (store-and-forward).
//!
//! Owns: the config types, their defaults, and the derived per-spool engine settings
//! ([`SpoolConfig::engine_config`]). Does not own: checking them against the rest of the
//! config (`validate.rs`) or running the spool (`crate::sink::spool`).
//!
//! Without `dir` there is no spool and the gateway behaves exactly as before: messages wait
//! in memory (`gateway.max_buffered`) and devices are acknowledged after the cloud.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::units::{self, ByteSize};

/// `[spool]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpoolConfig {
    /// Directory of the spool; absent: no spool. Holds `{uplink}/shard-{n}/` per uplink and
    /// shard.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// When a device's QoS 1 PUBLISH is acknowledged.
    pub ack: SpoolAck,
    /// What a group commit does.
    pub fsync: FsyncMode,
    /// Group-commit period with `fsync = "interval"`.
    #[serde(with = "units::duration")]
    pub fsync_interval: Duration,
    /// A segment file is sealed when it reaches this size.
    pub segment_size: ByteSize,
    /// Bound on all spool files of the gateway, split evenly over shards and uplinks.
    pub max_size: ByteSize,
    /// What happens when a spool reaches its share of `max_size`.
    pub when_full: WhenFull,
    /// Share (0 < share <= 1) of the uplink's inflight window the backlog may use while live
    /// messages are waiting; with nothing live waiting it may use the whole window.
    pub drain_share: Share,
    /// In which order the backlog is sent after an outage.
    pub drain_order: DrainOrder,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            dir: None,
            ack: SpoolAck::Spool,
            fsync: FsyncMode::Interval,
            fsync_interval: Duration::from_millis(10),
            segment_size: ByteSize::mib(16),
            max_size: ByteSize::gib(4),
            when_full: WhenFull::Block,
            drain_share: Share::from_permille(500),
            drain_order: DrainOrder::OldestFirst,
        }
    }
}

/// Bytes a record body takes beyond topic + payload + device id (see `crate::sink::spool::record`).
pub const RECORD_OVERHEAD_BYTES: u64 = 32;

impl SpoolConfig {
    /// Whether the gateway runs a spool.
    pub fn enabled(&self) -> bool {
        self.dir.is_some()
    }

    /// Largest record body: a whole device packet plus the device id and the record header.
    pub fn max_record_bytes(max_packet_size: ByteSize, max_client_id_len: usize) -> u64 {
        max_packet_size.as_u64() + max_client_id_len.max(64) as u64 + RECORD_OVERHEAD_BYTES
    }

    /// Each spool's share of `max_size` (one spool per shard and uplink).
    pub fn max_bytes_per_spool(&self, shards: usize, uplinks: usize) -> u64 {
        self.max_size.as_u64() / (shards.max(1) as u64 * uplinks.max(1) as u64)
    }

    /// The storage engine's settings for one spool.
    pub fn engine_config(
        &self,
        shards: usize,
        uplinks: usize,
        max_record_bytes: u64,
        ack_window: u64,
    ) -> sluice_spool::SpoolConfig {
        let max_record = u32::try_from(max_record_bytes).unwrap_or(u32::MAX / 2);
        sluice_spool::SpoolConfig {
            segment_bytes: self.segment_size.as_u64(),
            max_bytes: self.max_bytes_per_spool(shards, uplinks),
            when_full: match self.when_full {
                WhenFull::Block => sluice_spool::FullPolicy::Block,
                WhenFull::DropOldest => sluice_spool::FullPolicy::DropOldest,
            },
            fsync: match self.fsync {
                FsyncMode::Always => sluice_spool::FsyncPolicy::Always,
                FsyncMode::Interval => sluice_spool::FsyncPolicy::Interval(self.fsync_interval),
                FsyncMode::Never => sluice_spool::FsyncPolicy::Never,
            },
            max_record_bytes: max_record,
            // Room for one maximal record plus a generous batch of small ones.
            max_batch_bytes: (16u64 << 20).max(2 * max_record_bytes + 64),
            ack_window,
        }
    }
}

/// `ack`: when a device's QoS 1 PUBLISH is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpoolAck {
    /// After the group commit that holds it (store-and-forward; devices do not wait for the
    /// cloud).
    Spool,
    /// After the cloud's PUBACK, as without a spool; the spool still bounds memory and keeps
    /// messages across a gateway crash.
    Cloud,
}

/// `fsync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FsyncMode {
    /// A commit (with fsync) as soon as anything was appended; every batch is durable alone.
    Always,
    /// A group commit (with fsync) every `fsync_interval`.
    Interval,
    /// Commits write but never fsync: only for tests on tmpfs (a power cut loses data).
    Never,
}

/// `when_full`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WhenFull {
    /// Back-pressure: devices' publishes wait (QoS 1) or are dropped and counted (QoS 0).
    Block,
    /// Drop the oldest segment, sent or not; counted in `sluice_spool_dropped_oldest_total`.
    DropOldest,
}

/// `drain_order`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrainOrder {
    /// The backlog is sent in arrival order (per-device order kept).
    OldestFirst,
    /// The backlog is sent newest record first (freshest data first; per-device order is
    /// reversed within the backlog by design).
    NewestFirst,
}

/// A fraction in (0, 1], kept in thousandths so the config stays `Eq`. Written as a TOML
/// float (`0.5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Share(u16);

impl Share {
    pub const fn from_permille(p: u16) -> Share {
        Share(p)
    }
    pub fn permille(self) -> u16 {
        self.0
    }
    pub fn as_f64(self) -> f64 {
        f64::from(self.0) / 1000.0
    }
    /// `ceil(share × n)`, at least 1 when `n > 0`.
    pub fn of(self, n: usize) -> usize {
        (n * usize::from(self.0))
            .div_ceil(1000)
            .max(usize::from(n > 0))
    }
}

impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_f64())
    }
}

impl Serialize for Share {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.as_f64())
    }
}

impl<'de> Deserialize<'de> for Share {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ShareVisitor;
        impl Visitor<'_> for ShareVisitor {
            type Value = Share;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a fraction greater than 0 and at most 1, e.g. 0.5")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Share, E> {
                if !(v > 0.0 && v <= 1.0) {
                    return Err(E::custom(format!(
                        "{v} is not a fraction greater than 0 and at most 1 (e.g. 0.5)"
                    )));
                }
                let p = (v * 1000.0).round().clamp(1.0, 1000.0) as u16;
                Ok(Share(p))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Share, E> {
                if v == 1 {
                    return Ok(Share(1000));
                }
                Err(E::custom(format!(
                    "{v} is not a fraction greater than 0 and at most 1 (e.g. 0.5)"
                )))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Share, E> {
                self.visit_i64(i64::try_from(v).unwrap_or(i64::MAX))
            }
        }
        d.deserialize_any(ShareVisitor)
    }
}
