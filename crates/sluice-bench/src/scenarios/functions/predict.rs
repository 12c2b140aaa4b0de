//! Part **predict** of `scenario functions`: synthetic arrival traces replayed in compressed
//! time through sluice's pre-warm policies — cold-start rate and warm instance-time each.
//!
//! Each trace goes through each policy twice: the sans-IO simulator
//! `sluice::functions::predict::simulate` (ticks of 100 ms, execution time zero), and the
//! real autoscaler core on a virtual clock, `sluice::functions::runtime::replay` (instant
//! starts, service time 0, the shards' arrival thinning; its `idle` is the fixed keep-alive for
//! the fixed policies and the learned policies' fallback keep-alive of 5 minutes otherwise).
//! This module stays small and separate so the replay can become the only engine. The trace generators are those of `crates/sluice/tests/predict_traces.rs`
//! (private to that test), copied with their seeds: periodic with jitter (seed 19), Poisson
//! (20), bursty on/off (21), diurnal (22).
//!
//! Time: the test generates its traces compressed (one "minute" = 1 s); here they are
//! stretched back to real time (× [`STRETCH`]), so a trace is 3,000 real minutes (50 h), a
//! histogram bin and a GBDT interval are 60 s ([`U`]), Knative's keep-alive of 60 s is `U` and
//! 60 s + 30 s (its stable window plus the scale-to-zero grace period) is 1.5 `U`. Real time
//! matters for the replay: the shards tell the predictor of arrivals at most once per second
//! (`ARRIVAL_GRAIN_MS`), which in compressed time would hide most of them. Both engines run
//! on virtual clocks (50 h of trace in well under a second each). `simulate`'s tick is 6 s
//! (the test's 100 ms, stretched), so its figures are the test's.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use sluice::functions::predict::gbdt::{GbdtPolicy, GbdtPolicyParams};
use sluice::functions::predict::histogram::{HistogramParams, HistogramPolicy};
use sluice::functions::predict::{simulate, AlwaysWarm, FixedKeepAlive, Policy};
use sluice::functions::runtime::replay;

/// One "minute" of the test's compressed traces, ms.
const UC: u64 = 1000;
/// Compressed → real time.
pub const STRETCH: u64 = 60;
/// One minute, ms (a histogram bin, a GBDT interval).
pub const U: u64 = UC * STRETCH;
/// Length of every trace.
pub const END: u64 = 3000 * U;
/// The simulator's decision tick, ms.
pub const TICK: u64 = 100 * STRETCH;

/// A policy's name, the `idle` its replay runs with, and how to make a fresh one.
type PolicyCase = (&'static str, u64, fn() -> Box<dyn Policy>);

/// One policy on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    pub trace: &'static str,
    pub policy: &'static str,
    pub arrivals: u64,
    pub cold_starts: u64,
    /// cold starts ÷ arrivals, %.
    pub cold_start_percent: f64,
    /// Warm instance-time in hours.
    pub warm_instance_hours: f64,
    /// Warm instance-time as % of always-warm's.
    pub warm_percent_of_always: f64,
    /// The same three through the real autoscaler (`runtime::replay`).
    pub replay_cold_starts: u64,
    pub replay_cold_start_percent: f64,
    pub replay_warm_instance_hours: f64,
}

/// Every trace through every policy.
#[derive(Debug, Clone, Serialize)]
pub struct PredictResult {
    /// The engines: `simulate`, then `runtime::replay`.
    pub engine: &'static str,
    pub tick_ms: u64,
    /// The test's compressed traces are stretched by this.
    pub stretch: u64,
    pub trace_minutes: u64,
    pub rows: Vec<PolicyRow>,
}

pub fn run() -> PredictResult {
    eprintln!(
        "functions: prediction, 4 synthetic traces × 5 policies (simulate and runtime::replay, virtual clocks)"
    );
    let mut rows = Vec::new();
    for (trace, arrivals) in traces() {
        let policies: [PolicyCase; 5] = [
            ("always-warm", 5 * U, || Box::new(AlwaysWarm)),
            ("fixed-60s", U, || Box::new(FixedKeepAlive::new(U))),
            ("fixed-60s+30s", U + U / 2, || {
                Box::new(FixedKeepAlive::new(U + U / 2))
            }),
            ("histogram", 5 * U, || Box::new(histogram())),
            ("gbdt", 5 * U, || Box::new(gbdt())),
        ];
        let mut always_ms = 0;
        for (policy, idle_ms, make) in policies {
            let st = simulate(make().as_mut(), &arrivals, TICK, END);
            let re = replay(make(), &arrivals, 0, idle_ms, END);
            if policy == "always-warm" {
                always_ms = st.warm_ms;
            }
            rows.push(PolicyRow {
                trace,
                policy,
                arrivals: st.arrivals,
                cold_starts: st.cold_starts,
                cold_start_percent: 100.0 * st.cold_starts as f64 / st.arrivals.max(1) as f64,
                warm_instance_hours: st.warm_ms as f64 / 3.6e6,
                warm_percent_of_always: 100.0 * st.warm_ms as f64 / always_ms.max(1) as f64,
                replay_cold_starts: re.cold_starts,
                replay_cold_start_percent: 100.0 * re.cold_starts as f64
                    / re.arrivals.max(1) as f64,
                replay_warm_instance_hours: re.warm_instance_ms as f64 / 3.6e6,
            });
        }
    }
    PredictResult {
        engine: "simulate + runtime::replay",
        tick_ms: TICK,
        stretch: STRETCH,
        trace_minutes: END / U,
        rows,
    }
}

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

/// The four traces in real time: the test's (same generators, same seeds), stretched.
pub fn traces() -> Vec<(&'static str, Vec<u64>)> {
    compressed_traces()
        .into_iter()
        .map(|(name, t)| (name, t.into_iter().map(|a| a * STRETCH).collect()))
        .collect()
}

/// Length of the compressed traces.
const END_C: u64 = 3000 * UC;

/// The four compressed traces, generated as in the sluice test.
fn compressed_traces() -> Vec<(&'static str, Vec<u64>)> {
    let mut rng = StdRng::seed_from_u64(19);
    let periodic: Vec<u64> = (0..END_C / (10 * UC))
        .map(|n| n * 10 * UC + UC / 2 + rng.gen_range(0..=600) - 300)
        .collect();

    let mut rng = StdRng::seed_from_u64(20);
    let mut poisson_trace = Vec::new();
    poisson(&mut rng, 0.2, 0, END_C, &mut poisson_trace);

    let mut rng = StdRng::seed_from_u64(21);
    let mut bursty = Vec::new();
    let mut t = 0;
    while t < END_C {
        poisson(&mut rng, 2.0, t, (t + 30 * UC).min(END_C), &mut bursty);
        t += 150 * UC;
    }

    let mut rng = StdRng::seed_from_u64(22);
    let day = 240 * UC;
    let mut candidates = Vec::new();
    poisson(&mut rng, 1.0, 0, END_C, &mut candidates);
    let diurnal: Vec<u64> = candidates
        .into_iter()
        .filter(|&t| {
            let s = (2.0 * std::f64::consts::PI * (t % day) as f64 / day as f64).sin();
            rng.gen_range(0.0..1.0) < s.max(0.0)
        })
        .collect();
    vec![
        ("periodic", periodic),
        ("poisson", poisson_trace),
        ("bursty", bursty),
        ("diurnal", diurnal),
    ]
}

/// Poisson arrivals at `rate_per_u` per compressed minute in `[from, to)`, appended to `out`.
fn poisson(rng: &mut StdRng, rate_per_u: f64, from: u64, to: u64, out: &mut Vec<u64>) {
    let mut t = from as f64;
    loop {
        let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
        t += -u.ln() / rate_per_u * UC as f64;
        if t >= to as f64 {
            return;
        }
        out.push(t as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_are_seeded_sorted_and_inside_the_run() {
        let a = traces();
        let b = traces();
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(x, y, "{name} is not reproducible");
            assert!(!x.is_empty() && x.iter().all(|&t| t < END), "{name}");
            assert!(x.windows(2).all(|w| w[0] <= w[1]), "{name} is not sorted");
        }
        // a periodic arrival every 10 minutes over 3,000 minutes
        assert_eq!(a[0].1.len(), 300);
    }
}
