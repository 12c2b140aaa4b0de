//! Lock-free counters, gauges and histograms, and a Prometheus text renderer.
//!
//! Naming: `sluice_<subsystem>_<what>_<unit>`; no per-device labels (cardinality stays
//! bounded by shards × uplinks × fixed reasons).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn add(&self, n: i64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn sub(&self, n: i64) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Upper bounds (seconds) of the latency histogram buckets: 50 µs … 30 s (finer below 2.5 ms,
/// where the gateway's own hops and sluice's part of a function call are read against 1 and
/// 2 ms targets).
pub const LATENCY_BUCKETS_SECONDS: [f64; 22] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005, 0.0075, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A fixed-bucket latency histogram recorded in microseconds.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_SECONDS.len()],
    /// Observations above the last bucket bound (the +Inf bucket minus the others).
    overflow: AtomicU64,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: Default::default(),
            overflow: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: std::time::Duration) {
        let micros = d.as_micros().min(u64::MAX as u128) as u64;
        let secs = micros as f64 / 1e6;
        match LATENCY_BUCKETS_SECONDS.iter().position(|b| secs <= *b) {
            Some(i) => self.buckets[i].fetch_add(1, Ordering::Relaxed),
            None => self.overflow.fetch_add(1, Ordering::Relaxed),
        };
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
    /// Per-bucket (non-cumulative) counts, then the overflow count, the sum (µs) and count.
    pub(crate) fn snapshot(&self) -> (Vec<u64>, u64, u64, u64) {
        let b = self
            .buckets
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        (
            b,
            self.overflow.load(Ordering::Relaxed),
            self.sum_micros.load(Ordering::Relaxed),
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// A fixed-bucket histogram of plain values (sizes, counts) with caller-chosen bucket bounds.
#[derive(Debug)]
pub struct ValueHistogram {
    bounds: &'static [u64],
    buckets: Box<[AtomicU64]>,
    overflow: AtomicU64,
    sum: AtomicU64,
    count: AtomicU64,
}

impl ValueHistogram {
    /// `bounds` are the buckets' inclusive upper bounds, ascending.
    pub fn new(bounds: &'static [u64]) -> ValueHistogram {
        ValueHistogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            overflow: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: u64) {
        match self.bounds.iter().position(|b| v <= *b) {
            Some(i) => self.buckets[i].fetch_add(1, Ordering::Relaxed),
            None => self.overflow.fetch_add(1, Ordering::Relaxed),
        };
        self.sum.fetch_add(v, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn sum(&self) -> u64 {
        self.sum.load(Ordering::Relaxed)
    }
}

/// Writes the Prometheus text exposition format (version 0.0.4).
#[derive(Debug, Default)]
pub struct PromWriter {
    out: String,
    described: std::collections::HashSet<String>,
}

impl PromWriter {
    pub fn new() -> Self {
        Self::default()
    }

    fn describe(&mut self, name: &str, kind: &str, help: &str) {
        if self.described.insert(name.to_string()) {
            let _ = writeln!(self.out, "# HELP {name} {help}");
            let _ = writeln!(self.out, "# TYPE {name} {kind}");
        }
    }

    fn labels(labels: &[(&str, &str)], extra: Option<(&str, &str)>) -> String {
        let mut parts: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect();
        if let Some((k, v)) = extra {
            parts.push(format!("{k}=\"{v}\""));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", parts.join(","))
        }
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.describe(name, "counter", help);
        let l = Self::labels(labels, None);
        let _ = writeln!(self.out, "{name}{l} {value}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: i64) {
        self.describe(name, "gauge", help);
        let l = Self::labels(labels, None);
        let _ = writeln!(self.out, "{name}{l} {value}");
    }

    pub fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Histogram) {
        self.describe(name, "histogram", help);
        let (buckets, overflow, sum_micros, count) = h.snapshot();
        let mut cumulative = 0;
        for (i, b) in LATENCY_BUCKETS_SECONDS.iter().enumerate() {
            cumulative += buckets[i];
            let l = Self::labels(labels, Some(("le", &b.to_string())));
            let _ = writeln!(self.out, "{name}_bucket{l} {cumulative}");
        }
        let l = Self::labels(labels, Some(("le", "+Inf")));
        let _ = writeln!(self.out, "{name}_bucket{l} {}", cumulative + overflow);
        let l = Self::labels(labels, None);
        let _ = writeln!(self.out, "{name}_sum{l} {}", sum_micros as f64 / 1e6);
        let _ = writeln!(self.out, "{name}_count{l} {count}");
    }

    pub fn value_histogram(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        h: &ValueHistogram,
    ) {
        self.describe(name, "histogram", help);
        let mut cumulative = 0;
        for (bound, bucket) in h.bounds.iter().zip(h.buckets.iter()) {
            cumulative += bucket.load(Ordering::Relaxed);
            let l = Self::labels(labels, Some(("le", &bound.to_string())));
            let _ = writeln!(self.out, "{name}_bucket{l} {cumulative}");
        }
        let l = Self::labels(labels, Some(("le", "+Inf")));
        let total = cumulative + h.overflow.load(Ordering::Relaxed);
        let _ = writeln!(self.out, "{name}_bucket{l} {total}");
        let l = Self::labels(labels, None);
        let _ = writeln!(self.out, "{name}_sum{l} {}", h.sum());
        let _ = writeln!(self.out, "{name}_count{l} {}", h.count());
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn histogram_renders_cumulative_buckets_and_inf() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(50));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(60));
        let mut w = PromWriter::new();
        w.histogram("sluice_test_latency_seconds", "test", &[("shard", "0")], &h);
        let text = w.finish();
        assert!(text.contains("sluice_test_latency_seconds_bucket{shard=\"0\",le=\"0.0001\"} 1"));
        assert!(text.contains("sluice_test_latency_seconds_bucket{shard=\"0\",le=\"0.005\"} 2"));
        assert!(text.contains("sluice_test_latency_seconds_bucket{shard=\"0\",le=\"+Inf\"} 3"));
        assert!(text.contains("sluice_test_latency_seconds_count{shard=\"0\"} 3"));
        assert_eq!(
            text.matches("# TYPE sluice_test_latency_seconds histogram")
                .count(),
            1
        );
    }
}
