//! Part **predict** of `scenario functions`: synthetic arrival traces replayed in compressed
//! time through sluice's pre-warm policies — cold-start rate and warm instance-time each.
//!
//! For now this calls the sans-IO simulator `sluice::functions::predict::simulate` (ticks of
//! 100 ms, execution time zero); it is to be switched to the runtime's own replay
//! (`sluice::functions::runtime::replay`) once that exists, so this module is kept small and
//! separate. The trace generators are those of `crates/sluice/tests/predict_traces.rs`
//! (private to that test), copied with their seeds: periodic with jitter (seed 19), Poisson
//! (20), bursty on/off (21), diurnal (22).
//!
//! Time: one "minute" of the traces (a histogram bin, a GBDT interval) is 1 s of simulated
//! time, [`U`]; a trace is 3,000 such minutes (50 h). Keep-alive windows are scaled the same
//! way: Knative's 60 s is one minute = `U`, 60 s + 30 s (its stable window plus the
//! scale-to-zero grace period) is 1.5 `U`. Warm instance-time is reported in uncompressed
//! hours (× 60).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use sluice::functions::predict::gbdt::{GbdtPolicy, GbdtPolicyParams};
use sluice::functions::predict::histogram::{HistogramParams, HistogramPolicy};
use sluice::functions::predict::{simulate, AlwaysWarm, FixedKeepAlive, Policy};

/// One compressed "minute", ms.
pub const U: u64 = 1000;
/// Length of every trace.
pub const END: u64 = 3000 * U;
/// The simulator's decision tick, ms.
pub const TICK: u64 = 100;
/// Compressed → real time.
pub const ACCELERATION: f64 = 60.0;

/// One policy on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    pub trace: &'static str,
    pub policy: &'static str,
    pub arrivals: u64,
    pub cold_starts: u64,
    /// cold starts ÷ arrivals, %.
    pub cold_start_percent: f64,
    /// Warm instance-time in real (uncompressed) hours.
    pub warm_instance_hours: f64,
    /// Warm instance-time as % of always-warm's.
    pub warm_percent_of_always: f64,
}

/// Every trace through every policy.
#[derive(Debug, Clone, Serialize)]
pub struct PredictResult {
    /// "simulate" now; "runtime-replay" once switched.
    pub engine: &'static str,
    pub tick_ms: u64,
    pub acceleration: f64,
    pub trace_minutes: u64,
    pub rows: Vec<PolicyRow>,
}

pub fn run() -> PredictResult {
    eprintln!(
        "functions: prediction, 4 synthetic traces × 5 policies (simulated, compressed time)"
    );
    let mut rows = Vec::new();
    for (trace, arrivals) in traces() {
        let mut policies: Vec<(&'static str, Box<dyn Policy>)> = vec![
            ("always-warm", Box::new(AlwaysWarm)),
            ("fixed-60s", Box::new(FixedKeepAlive::new(U))),
            ("fixed-60s+30s", Box::new(FixedKeepAlive::new(U + U / 2))),
            ("histogram", Box::new(histogram())),
            ("gbdt", Box::new(gbdt())),
        ];
        let mut always_ms = 0;
        for (policy, p) in policies.iter_mut() {
            let st = simulate(p.as_mut(), &arrivals, TICK, END);
            if *policy == "always-warm" {
                always_ms = st.warm_ms;
            }
            rows.push(PolicyRow {
                trace,
                policy,
                arrivals: st.arrivals,
                cold_starts: st.cold_starts,
                cold_start_percent: 100.0 * st.cold_starts as f64 / st.arrivals.max(1) as f64,
                warm_instance_hours: st.warm_ms as f64 * ACCELERATION / 3.6e6,
                warm_percent_of_always: 100.0 * st.warm_ms as f64 / always_ms.max(1) as f64,
            });
        }
    }
    PredictResult {
        engine: "simulate",
        tick_ms: TICK,
        acceleration: ACCELERATION,
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

/// The four traces, seeded as in the sluice test.
pub fn traces() -> Vec<(&'static str, Vec<u64>)> {
    let mut rng = StdRng::seed_from_u64(19);
    let periodic: Vec<u64> = (0..END / (10 * U))
        .map(|n| n * 10 * U + U / 2 + rng.gen_range(0..=600) - 300)
        .collect();

    let mut rng = StdRng::seed_from_u64(20);
    let mut poisson_trace = Vec::new();
    poisson(&mut rng, 0.2, 0, END, &mut poisson_trace);

    let mut rng = StdRng::seed_from_u64(21);
    let mut bursty = Vec::new();
    let mut t = 0;
    while t < END {
        poisson(&mut rng, 2.0, t, (t + 30 * U).min(END), &mut bursty);
        t += 150 * U;
    }

    let mut rng = StdRng::seed_from_u64(22);
    let day = 240 * U;
    let mut candidates = Vec::new();
    poisson(&mut rng, 1.0, 0, END, &mut candidates);
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

/// Poisson arrivals at `rate_per_u` per [`U`] in `[from, to)`, appended to `out`.
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
