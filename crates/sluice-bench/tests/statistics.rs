//! The statistics behind the reports: percentile extraction from the latency histograms, and
//! duplicate / order-violation / gap counting on hand-made arrival sequences.

use sluice_bench::stats::{
    latency_histogram, record_us, LatencySummary, Observation, SequenceTracker, ShardedHistogram,
    MAX_TRACKED_SEQ,
};

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= expected * 0.001 + 1e-9
}

#[test]
fn percentiles_of_one_to_ten_thousand_microseconds_are_where_a_reader_expects() {
    let mut h = latency_histogram();
    for us in 1..=10_000 {
        record_us(&mut h, us);
    }
    let s = LatencySummary::from_histogram(&h);
    assert_eq!(s.count, 10_000);
    assert!(close(s.min_ms, 0.001), "min {}", s.min_ms);
    assert!(close(s.p50_ms, 5.0), "p50 {}", s.p50_ms);
    assert!(close(s.p90_ms, 9.0), "p90 {}", s.p90_ms);
    assert!(close(s.p99_ms, 9.9), "p99 {}", s.p99_ms);
    assert!(close(s.p999_ms, 9.99), "p99.9 {}", s.p999_ms);
    assert!(close(s.max_ms, 10.0), "max {}", s.max_ms);
    assert!(close(s.mean_ms, 5.0005), "mean {}", s.mean_ms);
}

#[test]
fn a_single_slow_outlier_shows_in_max_and_p999_but_not_p99() {
    let mut h = latency_histogram();
    for _ in 0..999 {
        record_us(&mut h, 200);
    }
    record_us(&mut h, 50_000);
    let s = LatencySummary::from_histogram(&h);
    assert!(close(s.p99_ms, 0.2));
    assert!(
        close(s.p999_ms, 0.2),
        "p99.9 is the 999th of 1000 values: {}",
        s.p999_ms
    );
    assert!(close(s.max_ms, 50.0));
}

#[test]
fn empty_histogram_summarises_to_zeros() {
    let s = LatencySummary::from_histogram(&latency_histogram());
    assert_eq!((s.count, s.p50_ms, s.max_ms), (0, 0.0, 0.0));
}

#[test]
fn sharded_histogram_merges_every_shard() {
    let h = ShardedHistogram::new(8);
    for key in 0..100usize {
        h.record_us(key, 1000);
    }
    let merged = h.merged();
    assert_eq!(merged.len(), 100);
    assert!(close(LatencySummary::from_histogram(&merged).p50_ms, 1.0));
}

#[test]
fn duplicates_and_order_violations_are_counted_on_a_hand_made_sequence() {
    let mut t = SequenceTracker::with_expected_devices(2);
    // Device 0: 2 is duplicated, 5 overtakes 3 and 4 (two order violations), 4 is duplicated
    // after arriving late (a duplicate, not a third violation).
    let arrivals = [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 2),
        (0, 5),
        (0, 3),
        (0, 4),
        (0, 4),
        (0, 6),
    ];
    let expected = [
        Observation::New,
        Observation::New,
        Observation::New,
        Observation::Duplicate,
        Observation::New,
        Observation::NewOutOfOrder,
        Observation::NewOutOfOrder,
        Observation::Duplicate,
        Observation::New,
    ];
    for ((device, seq), want) in arrivals.into_iter().zip(expected) {
        assert_eq!(t.observe(device, seq), want, "device {device} seq {seq}");
    }
    // Device 1: 1 never arrives (one gap); order per device is independent of device 0.
    assert_eq!(t.observe(1, 0), Observation::New);
    assert_eq!(t.observe(1, 2), Observation::New);

    assert_eq!(t.unique, 7 + 2);
    assert_eq!(t.duplicates, 2);
    assert_eq!(t.order_violations, 2);
    assert_eq!(t.gaps(), 1);
    assert_eq!(t.devices_seen(), 2);
    assert_eq!(t.untracked, 0);
}

#[test]
fn absurd_sequence_numbers_are_counted_as_untracked_without_allocating_for_them() {
    let mut t = SequenceTracker::default();
    assert_eq!(t.observe(0, MAX_TRACKED_SEQ), Observation::Untracked);
    assert_eq!(t.observe(u32::MAX, 0), Observation::Untracked);
    assert_eq!((t.untracked, t.unique, t.devices_seen()), (2, 0, 0));
}
