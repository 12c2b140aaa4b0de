//! Synthetic traces replayed through the autoscaler's prediction policies
//! (`sluice::functions::predict`) with its tiny simulator: cold starts and
//! warm instance-time per policy, printed with `eprintln!` for quoting.
//! Time is compressed: one "minute" (histogram bin, GBDT interval) is 1 s.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice::functions::predict::gbdt::{GbdtPolicy, GbdtPolicyParams};
use sluice::functions::predict::histogram::{HistogramParams, HistogramPolicy};
use sluice::functions::predict::{simulate, AlwaysWarm, FixedKeepAlive, Policy, SimStats};

const U: u64 = 1000; // one compressed "minute", in ms
const END: u64 = 3000 * U;
const TICK: u64 = 100;

fn histogram() -> HistogramPolicy {
    HistogramPolicy::new(HistogramParams {
        bin_ms: U,
        range_bins: 60,
        fallback_keep_ms: 5 * U,
        ..Default::default()
    })
}

fn gbdt() -> GbdtPolicy {
    GbdtPolicy::new(GbdtPolicyParams {
        interval_ms: U,
        lags: 12,
        day_intervals: 240,
        fallback_keep_ms: 5 * U,
        ..Default::default()
    })
}

struct Row {
    name: &'static str,
    stats: SimStats,
}

/// Replays `trace` through every policy, prints and returns the figures.
fn run_all(trace_name: &str, trace: &[u64]) -> Vec<Row> {
    let mut policies: Vec<(&'static str, Box<dyn Policy>)> = vec![
        ("always-warm", Box::new(AlwaysWarm)),
        ("fixed-keep-5", Box::new(FixedKeepAlive::new(5 * U))),
        ("histogram", Box::new(histogram())),
        ("gbdt", Box::new(gbdt())),
    ];
    let mut rows = Vec::new();
    for (name, p) in policies.iter_mut() {
        let stats = simulate(p.as_mut(), trace, TICK, END);
        eprintln!(
            "trace={trace_name:<9} policy={name:<12} arrivals={:>5} cold_starts={:>5} warm_s={:>7.1} ({:>5.1}% of always-warm)",
            stats.arrivals,
            stats.cold_starts,
            stats.warm_ms as f64 / 1000.0,
            100.0 * stats.warm_ms as f64 / END as f64
        );
        rows.push(Row { name, stats });
    }
    // Properties every trace must show.
    let always = rows[0].stats;
    for r in &rows {
        assert_eq!(r.stats.arrivals, trace.len() as u64, "{}", r.name);
        assert!(r.stats.cold_starts <= r.stats.arrivals, "{}", r.name);
        assert!(
            r.stats.warm_ms <= always.warm_ms,
            "{} uses more than always-warm",
            r.name
        );
    }
    assert!(always.cold_starts <= 1);
    rows
}

fn get(rows: &[Row], name: &str) -> SimStats {
    rows.iter()
        .find(|r| r.name == name)
        .map(|r| r.stats)
        .unwrap_or_default()
}

fn periodic(rng: &mut StdRng, period: u64) -> Vec<u64> {
    (0..END / period)
        .map(|n| n * period + U / 2 + rng.gen_range(0..=600) - 300)
        .collect()
}

fn poisson(rng: &mut StdRng, rate_per_u: f64, from: u64, to: u64, out: &mut Vec<u64>) {
    let mut t = from as f64;
    loop {
        let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
        t += -u.ln() / rate_per_u * U as f64;
        if t >= to as f64 {
            return;
        }
        out.push(t as u64);
    }
}

#[test]
fn periodic_with_jitter_predictive_policies_beat_short_keep_alive() {
    let mut rng = StdRng::seed_from_u64(19);
    let trace = periodic(&mut rng, 10 * U);
    let rows = run_all("periodic", &trace);
    let fixed = get(&rows, "fixed-keep-5");
    let hist = get(&rows, "histogram");
    let gb = get(&rows, "gbdt");
    let always = get(&rows, "always-warm");
    // keep-alive shorter than the period: every arrival is cold
    assert_eq!(fixed.cold_starts, fixed.arrivals);
    assert!(
        hist.cold_starts * 10 < fixed.cold_starts,
        "histogram {hist:?} vs fixed {fixed:?}"
    );
    assert!(
        gb.cold_starts * 10 < fixed.cold_starts,
        "gbdt {gb:?} vs fixed {fixed:?}"
    );
    // and they do it with well under always-warm's instance-time
    assert!(hist.warm_ms * 2 < always.warm_ms, "{hist:?}");
    assert!(gb.warm_ms * 2 < always.warm_ms, "{gb:?}");
}

#[test]
fn poisson_arrivals() {
    let mut rng = StdRng::seed_from_u64(20);
    let mut trace = Vec::new();
    poisson(&mut rng, 0.2, 0, END, &mut trace);
    let rows = run_all("poisson", &trace);
    // memoryless gaps of mean 5 U: their 99th percentile is far beyond 5 U,
    // so the histogram keeps instances longer than the 5 U keep-alive:
    // fewer cold starts, paid for with more instance-time
    let hist = get(&rows, "histogram");
    let fixed = get(&rows, "fixed-keep-5");
    assert!(
        hist.cold_starts < fixed.cold_starts,
        "{hist:?} vs {fixed:?}"
    );
    assert!(hist.warm_ms > fixed.warm_ms, "{hist:?} vs {fixed:?}");
}

#[test]
fn bursty_on_off() {
    let mut rng = StdRng::seed_from_u64(21);
    let mut trace = Vec::new();
    let mut t = 0;
    while t < END {
        poisson(&mut rng, 2.0, t, (t + 30 * U).min(END), &mut trace);
        t += 150 * U;
    }
    run_all("bursty", &trace);
}

#[test]
fn diurnal_compressed() {
    let mut rng = StdRng::seed_from_u64(22);
    let day = 240 * U;
    let mut candidates = Vec::new();
    poisson(&mut rng, 1.0, 0, END, &mut candidates);
    // thinning: rate 1/U * max(0, sin(2 pi t / day))
    let trace: Vec<u64> = candidates
        .into_iter()
        .filter(|&t| {
            let s = (2.0 * std::f64::consts::PI * (t % day) as f64 / day as f64).sin();
            rng.gen_range(0.0..1.0) < s.max(0.0)
        })
        .collect();
    run_all("diurnal", &trace);
}

#[test]
fn learned_policies_fall_back_with_too_little_history() {
    let mut fixed = FixedKeepAlive::new(5 * U);
    let mut hist = histogram();
    let mut gb = gbdt();
    let few = [500, 10_500, 20_500, 30_500];
    let a = simulate(&mut fixed, &few, TICK, 60 * U);
    let b = simulate(&mut hist, &few, TICK, 60 * U);
    let c = simulate(&mut gb, &few, TICK, 60 * U);
    eprintln!("fallback: fixed {a:?} histogram {b:?} gbdt {c:?}");
    assert!(hist.windows().is_none());
    assert!(!gb.trained());
    assert_eq!(a, b);
    assert_eq!(a, c);
}
