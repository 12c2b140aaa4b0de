//! Lock-free counters, gauges and histograms, and the Prometheus text writer.
//!
//! Owns: the metric primitives every subsystem embeds (relaxed atomics: recording never locks
//! or allocates) and [`PromWriter`], which subsystems render into at scrape time and which
//! writes each family once — HELP, TYPE, then all its samples — whatever order they were
//! rendered in (docs/adr/0011-metrics-exposition.md). Does not own: which metrics exist (each
//! subsystem's `metrics.rs`) or serving them (admin/).
//!
//! Naming: `sluice_<subsystem>_<what>_<unit>` in base units (`_seconds`, `_bytes`), counters
//! `_total`, states as a label ([`PromWriter::state`]) rather than a number; no per-device
//! labels (cardinality stays bounded by shards × uplinks × lanes × fixed reasons). The
//! families are listed in docs/observability.md.

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

/// The metric type of a family, as written on its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

impl MetricKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One metric family being collected: its description and its sample lines so far.
#[derive(Debug)]
struct Family {
    name: String,
    kind: MetricKind,
    help: String,
    samples: String,
}

/// Writes the Prometheus text exposition format (version 0.0.4), one group per family.
///
/// Subsystems render into it in any order — shard by shard, uplink by uplink — and the writer
/// collects each sample under its family; [`PromWriter::finish`] then writes every family once:
/// `# HELP`, `# TYPE`, then all its samples, families in the order they were first seen. This
/// is the format's rule ("all lines for a given metric must be provided as one single group");
/// Prometheus' own parser tolerates a split family, stricter readers do not, and
/// `sluice_testkit::prom` checks it in the tests. Scraping only reads the subsystems' atomics:
/// the collection happens here, on the admin thread, never on the data path
/// (docs/adr/0011-metrics-exposition.md).
///
/// A family named again with another type is a programming error: debug builds panic naming
/// it; release builds drop the offending sample so the exposition stays parseable.
#[derive(Debug, Default)]
pub struct PromWriter {
    families: Vec<Family>,
    index: std::collections::HashMap<String, usize>,
    /// The family written last.
    last: Option<usize>,
}

impl PromWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// The sample buffer of family `name`, created on first use; `None` when the name is
    /// already a family of another type. Consecutive samples of one family (the common case)
    /// skip the map.
    fn family(&mut self, name: &str, kind: MetricKind, help: &str) -> Option<&mut String> {
        let i = match self.last {
            Some(i) if self.families[i].name == name => i,
            _ => match self.index.get(name) {
                Some(&i) => i,
                None => {
                    self.families.push(Family {
                        name: name.to_string(),
                        kind,
                        help: help.to_string(),
                        samples: String::new(),
                    });
                    self.index.insert(name.to_string(), self.families.len() - 1);
                    self.families.len() - 1
                }
            },
        };
        self.last = Some(i);
        let family = &mut self.families[i];
        if family.kind != kind {
            debug_assert!(
                false,
                "metric family {name} rendered as {} and as {}",
                family.kind.as_str(),
                kind.as_str()
            );
            return None;
        }
        Some(&mut family.samples)
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        if let Some(out) = self.family(name, MetricKind::Counter, help) {
            sample(out, name, "", labels, None, value);
        }
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: i64) {
        if let Some(out) = self.family(name, MetricKind::Gauge, help) {
            sample(out, name, "", labels, None, value);
        }
    }

    /// A counter with a fractional value (seconds spent).
    pub fn counter_f64(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        if let Some(out) = self.family(name, MetricKind::Counter, help) {
            sample(out, name, "", labels, None, Float(value));
        }
    }

    /// A gauge with a fractional value (seconds, ratios).
    pub fn gauge_f64(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        if let Some(out) = self.family(name, MetricKind::Gauge, help) {
            sample(out, name, "", labels, None, Float(value));
        }
    }

    /// A state as labels rather than a number: one sample per state in `states`, `1` for
    /// `current` and `0` for the others, each with `label="<state>"` added to `labels` (the
    /// OpenMetrics StateSet shape; `family{state="connected"} == 1` selects it).
    pub fn state(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        label: &str,
        states: &[&str],
        current: &str,
    ) {
        if let Some(out) = self.family(name, MetricKind::Gauge, help) {
            for s in states {
                sample(
                    out,
                    name,
                    "",
                    labels,
                    Some((label, s)),
                    u8::from(*s == current),
                );
            }
        }
    }

    /// Declares a family with no sample yet (so HELP/TYPE are present and every family a
    /// dashboard names exists from the start).
    pub fn describe(&mut self, name: &str, kind: MetricKind, help: &str) {
        let _ = self.family(name, kind, help);
    }

    pub fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Histogram) {
        let (buckets, overflow, sum_micros, count) = h.snapshot();
        let Some(out) = self.family(name, MetricKind::Histogram, help) else {
            return;
        };
        let mut cumulative = 0;
        for (i, b) in LATENCY_BUCKETS_SECONDS.iter().enumerate() {
            cumulative += buckets[i];
            let le = Float(*b).to_string();
            sample(out, name, "_bucket", labels, Some(("le", &le)), cumulative);
        }
        let total = cumulative + overflow;
        sample(out, name, "_bucket", labels, Some(("le", "+Inf")), total);
        let sum = Float(sum_micros as f64 / 1e6);
        sample(out, name, "_sum", labels, None, sum);
        sample(out, name, "_count", labels, None, count);
    }

    pub fn value_histogram(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        h: &ValueHistogram,
    ) {
        let Some(out) = self.family(name, MetricKind::Histogram, help) else {
            return;
        };
        let mut cumulative = 0;
        for (bound, bucket) in h.bounds.iter().zip(h.buckets.iter()) {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = bound.to_string();
            sample(out, name, "_bucket", labels, Some(("le", &le)), cumulative);
        }
        let total = cumulative + h.overflow.load(Ordering::Relaxed);
        sample(out, name, "_bucket", labels, Some(("le", "+Inf")), total);
        sample(out, name, "_sum", labels, None, h.sum());
        sample(out, name, "_count", labels, None, h.count());
    }

    /// The exposition: every family once, `# HELP` and `# TYPE` then its samples.
    pub fn finish(self) -> String {
        let len = self
            .families
            .iter()
            .map(|f| f.samples.len() + f.help.len() + 2 * f.name.len() + 24)
            .sum();
        let mut out = String::with_capacity(len);
        for f in &self.families {
            let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(&f.help));
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
            out.push_str(&f.samples);
        }
        out
    }
}

/// One sample line: `{name}{suffix}{labels…,extra} {value}`.
fn sample(
    out: &mut String,
    name: &str,
    suffix: &str,
    labels: &[(&str, &str)],
    extra: Option<(&str, &str)>,
    value: impl std::fmt::Display,
) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() || extra.is_some() {
        out.push('{');
        for (i, (k, v)) in labels.iter().copied().chain(extra).enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            escape_into(out, v);
            out.push('"');
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

/// A float sample value as the text format spells it (`+Inf`, `-Inf`, `NaN`).
struct Float(f64);

impl std::fmt::Display for Float {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.0;
        if v.is_nan() {
            f.write_str("NaN")
        } else if v.is_infinite() {
            f.write_str(if v > 0.0 { "+Inf" } else { "-Inf" })
        } else {
            write!(f, "{v}")
        }
    }
}

/// HELP text escaping: backslash and line feed.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Label value escaping: backslash, double quote, line feed.
fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Two shards rendered in turn, as the app does: each family is written once, HELP and
    /// TYPE then all its samples (the text format's one-group rule; before, the second shard's
    /// lines formed a second group of every family).
    #[test]
    fn families_rendered_shard_by_shard_come_out_as_one_group_each() {
        let c = Counter::default();
        c.add(3);
        let h = Histogram::default();
        h.observe(Duration::from_millis(1));
        let mut w = PromWriter::new();
        for shard in ["0", "1"] {
            w.counter(
                "sluice_test_messages_total",
                "test",
                &[("shard", shard)],
                c.get(),
            );
            w.gauge("sluice_test_queue_bytes", "test", &[("shard", shard)], 7);
            w.histogram(
                "sluice_test_latency_seconds",
                "test",
                &[("shard", shard)],
                &h,
            );
            w.state(
                "sluice_test_state",
                "test",
                &[("shard", shard)],
                "state",
                &["down", "up"],
                "up",
            );
        }
        let text = w.finish();
        let exp = sluice_testkit::prom::check(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(exp.families.len(), 4, "{text}");
        assert_eq!(
            exp.family("sluice_test_messages_total")
                .unwrap()
                .samples
                .len(),
            2
        );
        assert!(
            text.contains("sluice_test_state{shard=\"1\",state=\"up\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sluice_test_state{shard=\"1\",state=\"down\"} 0"),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE").count(), 4, "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        let mut w = PromWriter::new();
        w.gauge(
            "sluice_test_g",
            "a \\ help\nline",
            &[("uplink", "a\"b\\c\nd")],
            1,
        );
        let text = w.finish();
        assert!(
            text.contains("sluice_test_g{uplink=\"a\\\"b\\\\c\\nd\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("# HELP sluice_test_g a \\\\ help\\nline\n"),
            "{text}"
        );
        let exp = sluice_testkit::prom::check(&text).unwrap();
        let s = &exp.family("sluice_test_g").unwrap().samples[0];
        assert_eq!(s.label("uplink"), Some("a\"b\\c\nd"));
    }

    #[test]
    #[should_panic(expected = "metric family sluice_test_x rendered as counter and as gauge")]
    fn one_name_with_two_types_is_caught_in_tests() {
        let mut w = PromWriter::new();
        w.counter("sluice_test_x", "test", &[], 1);
        w.gauge("sluice_test_x", "test", &[], 1);
    }

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
