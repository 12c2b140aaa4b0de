//! Spool metrics: one [`SpoolMetrics`] per (shard, uplink) spool, written by its shard, read
//! by the admin thread (relaxed atomics). No per-device labels.

use crate::telemetry::metrics::{Counter, Gauge, Histogram, PromWriter};

#[derive(Debug, Default)]
pub struct SpoolMetrics {
    /// Bytes of all segment files.
    pub bytes: Gauge,
    /// The spool's size limit (its share of `spool.max_size`), the bound `bytes` grows to.
    pub max_bytes: Gauge,
    pub records_appended: Counter,
    /// Records acknowledged by the cloud (or given up by the uplink, counted there).
    pub records_acked: Counter,
    pub commits: Counter,
    /// Time from taking a batch to its commit being durable (write + fsync + cursor).
    pub commit_latency: Histogram,
    /// Backlog records not yet handed to the uplink.
    pub backlog_records: Gauge,
    /// Records removed unsent by `when_full = "drop-oldest"`.
    pub dropped_oldest: Counter,
    /// Appends that found the spool full under `when_full = "block"` (a QoS 1 publish then
    /// waits; a QoS 0 one is dropped, see `dropped_full`).
    pub full_waits: Counter,
    /// QoS 0 messages dropped because the spool was full (`block`).
    pub dropped_full: Counter,
    /// Records whose body could not be decoded (skipped and acknowledged).
    pub undecodable: Counter,
    /// Messages larger than the largest spool record (cannot happen with a consistent
    /// config; dropped, counted, the device acknowledged).
    pub dropped_too_large: Counter,
    /// Commit or I/O failures that made the gateway reopen the spool.
    pub failures: Counter,
    /// Records present but not acknowledged.
    pub unacked_records: Gauge,
    /// When the gateway read the oldest unacknowledged record, µs since the Unix epoch (0:
    /// nothing unacknowledged, or its time is not known — records recovered at start).
    pub oldest_unacked_received_us: Gauge,
    /// Reads of committed records, each run on the blocking pool (the feeder).
    pub reads: Counter,
    /// The spool's storage state: 0 accepting, 1 stalled for want of space, 2 stalled
    /// because its file system is read-only (`STALL_*`).
    pub stalled: Gauge,
    /// Writes the storage refused for want of space (`ENOSPC`, `EDQUOT`), retries included.
    pub storage_no_space: Counter,
    /// Writes the storage refused because it is read-only (`EROFS`), retries included.
    pub storage_read_only: Counter,
    /// Appends that found the spool stalled (a QoS 1 publish then waits; a QoS 0 one is
    /// dropped, see `dropped_stalled`).
    pub stalled_waits: Counter,
    /// QoS 0 messages dropped because the spool was stalled.
    pub dropped_stalled: Counter,
}

/// Values of [`SpoolMetrics::stalled`].
pub const STALL_NONE: i64 = 0;
pub const STALL_NO_SPACE: i64 = 1;
pub const STALL_READ_ONLY: i64 = 2;

impl SpoolMetrics {
    /// The stall as the status document names it (`null` when accepting).
    pub fn stalled_name(&self) -> Option<&'static str> {
        match self.stalled.get() {
            STALL_NO_SPACE => Some("no_space"),
            STALL_READ_ONLY => Some("read_only"),
            _ => None,
        }
    }
}

impl SpoolMetrics {
    pub fn render(&self, w: &mut PromWriter, shard: &str, uplink: &str) {
        let l: &[(&str, &str)] = &[("shard", shard), ("uplink", uplink)];
        w.counter(
            "sluice_spool_reads_total",
            "Reads of committed records by the feeder, each on the blocking pool",
            l,
            self.reads.get(),
        );
        w.gauge(
            "sluice_spool_bytes",
            "Bytes of the spool's segment files.",
            l,
            self.bytes.get(),
        );
        w.gauge(
            "sluice_spool_max_bytes",
            "Size limit of the spool (its share of spool.max_size); bytes / max_bytes is how full it is.",
            l,
            self.max_bytes.get(),
        );
        let age = "Age of the oldest record not yet acknowledged by the cloud, from when the gateway read it (0 when none; no sample while records recovered at start are unacknowledged, their time being unknown).";
        let oldest = self.oldest_unacked_received_us.get();
        if self.unacked_records.get() <= 0 {
            w.gauge_f64("sluice_spool_oldest_unacked_age_seconds", age, l, 0.0);
        } else if oldest > 0 {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as i64);
            let secs = (now - oldest).max(0) as f64 / 1e6;
            w.gauge_f64("sluice_spool_oldest_unacked_age_seconds", age, l, secs);
        } else {
            w.describe(
                "sluice_spool_oldest_unacked_age_seconds",
                crate::telemetry::metrics::MetricKind::Gauge,
                age,
            );
        }
        w.counter(
            "sluice_spool_records_appended_total",
            "Device messages appended to the spool.",
            l,
            self.records_appended.get(),
        );
        w.counter(
            "sluice_spool_records_acked_total",
            "Spool records acknowledged by the cloud (then trimmed).",
            l,
            self.records_acked.get(),
        );
        w.counter(
            "sluice_spool_commits_total",
            "Group commits finished.",
            l,
            self.commits.get(),
        );
        w.histogram(
            "sluice_spool_commit_latency_seconds",
            "Time of one group commit: write, fsync (per policy) and ack cursor.",
            l,
            &self.commit_latency,
        );
        w.gauge(
            "sluice_spool_backlog_records",
            "Records that piled up while the uplink was down and are not yet handed to it.",
            l,
            self.backlog_records.get(),
        );
        w.gauge(
            "sluice_spool_unacked_records",
            "Records in the spool not yet acknowledged by the cloud.",
            l,
            self.unacked_records.get(),
        );
        w.counter(
            "sluice_spool_dropped_oldest_total",
            "Records removed unsent by when_full = \"drop-oldest\".",
            l,
            self.dropped_oldest.get(),
        );
        w.counter(
            "sluice_spool_full_total",
            "Appends that found the spool full under when_full = \"block\".",
            l,
            self.full_waits.get(),
        );
        w.counter(
            "sluice_spool_dropped_full_total",
            "QoS 0 messages dropped because the spool was full (when_full = \"block\").",
            l,
            self.dropped_full.get(),
        );
        w.counter(
            "sluice_spool_undecodable_total",
            "Spool records skipped because they failed their checksum on read or could not be decoded.",
            l,
            self.undecodable.get(),
        );
        w.counter(
            "sluice_spool_dropped_too_large_total",
            "Messages larger than the largest spool record (dropped).",
            l,
            self.dropped_too_large.get(),
        );
        w.counter(
            "sluice_spool_failures_total",
            "Spool write or fsync failures (the spool was reopened).",
            l,
            self.failures.get(),
        );
        let stalled = self.stalled.get();
        for (reason, code) in [("no_space", STALL_NO_SPACE), ("read_only", STALL_READ_ONLY)] {
            w.gauge(
                "sluice_spool_stalled",
                "1 while the spool refuses new records because its file system is full (no_space) or read-only (read_only); reading, sending and trimming go on.",
                &[("shard", shard), ("uplink", uplink), ("reason", reason)],
                i64::from(stalled == code),
            );
        }
        for (reason, n) in [
            ("no_space", self.storage_no_space.get()),
            ("read_only", self.storage_read_only.get()),
        ] {
            w.counter(
                "sluice_spool_storage_errors_total",
                "Writes the spool's file system refused for want of space (no_space: ENOSPC, EDQUOT) or because it is read-only (read_only: EROFS), retries included; each stalls the spool.",
                &[("shard", shard), ("uplink", uplink), ("reason", reason)],
                n,
            );
        }
        w.counter(
            "sluice_spool_stalled_total",
            "Appends that found the spool stalled (its file system full or read-only): a QoS 1 publish waits, a QoS 0 one is dropped.",
            l,
            self.stalled_waits.get(),
        );
        w.counter(
            "sluice_spool_dropped_stalled_total",
            "QoS 0 messages dropped because the spool was stalled (its file system full or read-only).",
            l,
            self.dropped_stalled.get(),
        );
    }

    /// The `spool` object of one shard and uplink in /api/v1/status.
    pub fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "bytes": self.bytes.get(),
            "unacked_records": self.unacked_records.get(),
            "backlog_records": self.backlog_records.get(),
            "records_appended": self.records_appended.get(),
            "records_acked": self.records_acked.get(),
            "commits": self.commits.get(),
            "dropped_oldest": self.dropped_oldest.get(),
            "full": self.full_waits.get(),
            "stalled": self.stalled_name(),
        })
    }
}
