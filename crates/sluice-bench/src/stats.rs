//! Statistics shared by the load generator and the sink: latency histograms and their
//! summaries, and per-device sequence tracking (unique, duplicate, out-of-order, gaps).
//!
//! Owns: the numbers that end up in the JSON reports and how they are derived. Does not own:
//! clocks (callers pass durations) or I/O.
//!
//! Latency: HDR histograms of microseconds, 1 µs to 1 h, 3 significant digits (relative error
//! ≤ 0.1 %); values above the range are clamped to it (`saturating_record`). Summaries are
//! reported in milliseconds with µs resolution.
//!
//! Sequence tracking, per device index: a bitmap of the sequence numbers seen so far and the
//! highest one seen. A message is a *duplicate* when its bit was already set; otherwise it is
//! *unique*, and additionally an *order violation* when its sequence number is lower than the
//! highest seen before it for that device. *Gaps* are sequence numbers below a device's highest
//! that were never seen (lost, or still on their way). Bounds: device indices up to
//! [`MAX_TRACKED_DEVICES`] and sequence numbers up to [`MAX_TRACKED_SEQ`] are tracked (the
//! bitmap of one device is at most 2 MiB); anything beyond is counted as `untracked`, never a
//! panic or an unbounded allocation.

use std::sync::Mutex;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest trackable latency, in µs (one hour).
const MAX_LATENCY_US: u64 = 3_600_000_000;
/// Device indices at or above this are counted as untracked.
pub const MAX_TRACKED_DEVICES: u32 = 1 << 20;
/// Sequence numbers at or above this are counted as untracked.
pub const MAX_TRACKED_SEQ: u64 = 1 << 24;

/// A latency histogram in microseconds, 1 µs to 1 h, 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    // Invariant: constant bounds that satisfy hdrhistogram's preconditions (low ≥ 1,
    // high ≥ 2·low, sigfig ≤ 5), so construction cannot fail.
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("constant histogram bounds are valid")
}

/// Record one latency, given in µs, clamping it into the histogram's range.
pub fn record_us(histogram: &mut Histogram<u64>, micros: u64) {
    histogram.saturating_record(micros.clamp(1, MAX_LATENCY_US));
}

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub count: u64,
    pub min_ms: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    /// Summarise a histogram of microseconds. An empty histogram gives all zeros.
    pub fn from_histogram(h: &Histogram<u64>) -> LatencySummary {
        if h.is_empty() {
            return LatencySummary {
                count: 0,
                min_ms: 0.0,
                mean_ms: 0.0,
                p50_ms: 0.0,
                p90_ms: 0.0,
                p99_ms: 0.0,
                p999_ms: 0.0,
                max_ms: 0.0,
            };
        }
        let ms = |us: u64| us as f64 / 1000.0;
        LatencySummary {
            count: h.len(),
            min_ms: ms(h.min()),
            mean_ms: h.mean().round() / 1000.0,
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
        }
    }
}

/// Latency of one device's first arrivals, as the sink reports it with `--per-device`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeviceLatency {
    /// 0-based device index from the bench payload header.
    pub device: u32,
    /// Messages of this device that arrived for the first time (duplicates excluded).
    pub received: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl std::fmt::Display for DeviceLatency {
    /// One human line: `device 3: 1200 received, latency mean 1.234 ms, p50 …, p99 …, max …`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device {}: {} received, latency mean {:.3} ms, p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            self.device, self.received, self.mean_ms, self.p50_ms, self.p99_ms, self.max_ms
        )
    }
}

/// One latency histogram per device, created on the device's first sample.
///
/// Bound: a histogram takes about 190 KiB, so only device indices below
/// [`MAX_PER_DEVICE_LATENCY`] get one (at most ~48 MiB); samples of higher indices are
/// counted in [`PerDeviceLatency::omitted`] instead.
#[derive(Debug, Default)]
pub struct PerDeviceLatency {
    devices: Vec<Option<Histogram<u64>>>,
    /// Samples of devices at or above [`MAX_PER_DEVICE_LATENCY`].
    pub omitted: u64,
}

/// Device indices at or above this get no per-device latency histogram.
pub const MAX_PER_DEVICE_LATENCY: u32 = 256;

impl PerDeviceLatency {
    /// Record one latency of `device`, in µs.
    pub fn record_us(&mut self, device: u32, micros: u64) {
        if device >= MAX_PER_DEVICE_LATENCY {
            self.omitted += 1;
            return;
        }
        let index = device as usize;
        if index >= self.devices.len() {
            self.devices.resize_with(index + 1, || None);
        }
        record_us(
            self.devices[index].get_or_insert_with(latency_histogram),
            micros,
        );
    }

    /// One summary per device with at least one sample, by device index.
    pub fn summaries(&self) -> Vec<DeviceLatency> {
        self.devices
            .iter()
            .enumerate()
            .filter_map(|(device, h)| {
                let s = LatencySummary::from_histogram(h.as_ref()?);
                Some(DeviceLatency {
                    device: device as u32,
                    received: s.count,
                    mean_ms: s.mean_ms,
                    p50_ms: s.p50_ms,
                    p99_ms: s.p99_ms,
                    max_ms: s.max_ms,
                })
            })
            .collect()
    }
}

/// A latency histogram split into independently locked shards, so thousands of tasks on a
/// multi-threaded runtime can record without contending on one lock. Record with any key
/// (e.g. the device index); [`ShardedHistogram::merged`] adds the shards up.
#[derive(Debug)]
pub struct ShardedHistogram {
    shards: Vec<Mutex<Histogram<u64>>>,
}

impl ShardedHistogram {
    /// `shards` histograms (at least one).
    pub fn new(shards: usize) -> ShardedHistogram {
        ShardedHistogram {
            shards: (0..shards.max(1))
                .map(|_| Mutex::new(latency_histogram()))
                .collect(),
        }
    }

    /// Record `micros` in the shard chosen by `key`.
    pub fn record_us(&self, key: usize, micros: u64) {
        let shard = &self.shards[key % self.shards.len()];
        // A poisoned lock only means another recorder panicked mid-record; the histogram is
        // still a valid set of counts, so keep using it.
        let mut h = shard.lock().unwrap_or_else(|p| p.into_inner());
        record_us(&mut h, micros);
    }

    /// All shards added into one histogram.
    pub fn merged(&self) -> Histogram<u64> {
        let mut total = latency_histogram();
        for shard in &self.shards {
            let h = shard.lock().unwrap_or_else(|p| p.into_inner());
            // Same bounds everywhere, and values were clamped on record: `add` cannot fail.
            let _ = total.add(&*h);
        }
        total
    }
}

/// What one received message turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// First time this (device, seq) was seen, and in order.
    New,
    /// First time seen, but a higher sequence number of the same device was seen before.
    NewOutOfOrder,
    /// Seen before.
    Duplicate,
    /// Device index or sequence number beyond the tracked bounds.
    Untracked,
}

#[derive(Debug, Default, Clone)]
struct DeviceSequences {
    seen: Vec<u64>,
    highest: Option<u64>,
    unique: u64,
}

/// Per-device sequence-number bookkeeping: uniques, duplicates, order violations and gaps.
#[derive(Debug, Default, Clone)]
pub struct SequenceTracker {
    devices: Vec<DeviceSequences>,
    /// Messages seen for the first time.
    pub unique: u64,
    /// Messages whose (device, seq) had been seen before.
    pub duplicates: u64,
    /// Unique messages with a sequence number below the highest already seen for that device.
    pub order_violations: u64,
    /// Messages outside the tracked bounds (not counted in the other fields).
    pub untracked: u64,
}

impl SequenceTracker {
    /// A tracker pre-sized for `expected_devices` devices (more are accepted).
    pub fn with_expected_devices(expected_devices: u32) -> SequenceTracker {
        let n = expected_devices.min(MAX_TRACKED_DEVICES) as usize;
        SequenceTracker {
            devices: vec![DeviceSequences::default(); n],
            ..Default::default()
        }
    }

    /// Account for one received message.
    pub fn observe(&mut self, device: u32, seq: u64) -> Observation {
        if device >= MAX_TRACKED_DEVICES || seq >= MAX_TRACKED_SEQ {
            self.untracked += 1;
            return Observation::Untracked;
        }
        let index = device as usize;
        if index >= self.devices.len() {
            self.devices
                .resize_with(index + 1, DeviceSequences::default);
        }
        let d = &mut self.devices[index];
        let (word, bit) = ((seq / 64) as usize, seq % 64);
        if word >= d.seen.len() {
            // Grow geometrically so a steadily increasing sequence costs amortised O(1).
            let new_len = (word + 1).max(d.seen.len() * 2);
            d.seen.resize(new_len, 0);
        }
        let mask = 1u64 << bit;
        if d.seen[word] & mask != 0 {
            self.duplicates += 1;
            return Observation::Duplicate;
        }
        d.seen[word] |= mask;
        d.unique += 1;
        self.unique += 1;
        match d.highest {
            Some(highest) if seq < highest => {
                self.order_violations += 1;
                Observation::NewOutOfOrder
            }
            _ => {
                d.highest = Some(seq);
                Observation::New
            }
        }
    }

    /// Devices from which at least one message was seen.
    pub fn devices_seen(&self) -> u64 {
        self.devices.iter().filter(|d| d.highest.is_some()).count() as u64
    }

    /// Sequence numbers below each device's highest that were never seen, summed.
    pub fn gaps(&self) -> u64 {
        self.devices
            .iter()
            .filter_map(|d| d.highest.map(|h| h + 1 - d.unique))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_device_latency_summarises_each_device_and_omits_high_indices() {
        let mut p = PerDeviceLatency::default();
        // Below 2048 µs the histogram is exact.
        for us in [1_000, 1_500, 2_000] {
            p.record_us(2, us);
        }
        p.record_us(0, 500);
        p.record_us(MAX_PER_DEVICE_LATENCY, 1);
        let s = p.summaries();
        assert_eq!(s.iter().map(|d| d.device).collect::<Vec<_>>(), [0, 2]);
        assert_eq!((s[0].received, s[0].max_ms), (1, 0.5));
        assert_eq!((s[1].received, s[1].mean_ms, s[1].p50_ms), (3, 1.5, 1.5));
        assert_eq!((s[1].p99_ms, s[1].max_ms), (2.0, 2.0));
        assert_eq!(p.omitted, 1);
    }

    #[test]
    fn bitmap_growth_keeps_earlier_bits() {
        let mut t = SequenceTracker::default();
        t.observe(3, 1);
        t.observe(3, 10_000);
        assert_eq!(t.observe(3, 1), Observation::Duplicate);
        assert_eq!(t.devices_seen(), 1);
        assert_eq!(t.gaps(), 10_001 - 2);
    }
}
