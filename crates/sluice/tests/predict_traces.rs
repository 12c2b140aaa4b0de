//! Synthetic traces replayed through the autoscaler's prediction policies
//! (`sluice::functions::predict`) the way the runtime drives them
//! ([`replay`]: decide at every arrival and every `next_wake`, sleep in
//! between), in accelerated (simulated) time at real scale: 1 min intervals
//! and histogram bins, 24 h days, three-day traces.
//!
//! Policies: always-warm, fixed keep-alive of 90 s (Knative's defaults: 60 s
//! stable window + 30 s grace), the histogram policy and the GBDT predictor,
//! both with their default parameters (the same for every trace: nothing is
//! tuned per trace).
//!
//! Traces (each for several seeds): the five of
//! `sluice::functions::predict::traces` (periodic with jitter, Poisson,
//! bursty on/off, diurnal-poisson, and the IoT-realistic diurnal-timers),
//! described there; the benchmark's prediction part replays the same ones
//! through the real autoscaler.
//!
//! The target, asserted on `periodic` and `diurnal-timers` for every
//! seed: the predictive policy (GBDT; the histogram policy is printed, not
//! asserted) has at most 1/4 of the cold starts of
//! fixed keep-alive with no more instance-seconds. Tolerance: none on
//! instance-seconds; cold starts may exceed `fixed / 4` by [`COLD_SLACK`] on a
//! single seed (the median over seeds must meet it exactly).
//!
//! On `diurnal-poisson` the target is out of reach of *any* policy, shown
//! with the oracle bound of `traces::OracleBound` (arrivals are Poisson, so
//! the least expected cold starts for a warm-time budget are had by warming
//! the instants of highest rate): at fixed keep-alive's instance-seconds that
//! bound is printed next to `fixed / 4`.

use sluice::functions::predict::gbdt::GbdtPolicy;
use sluice::functions::predict::histogram::{HistogramParams, HistogramPolicy};
use sluice::functions::predict::traces::{OracleBound, Trace, DAY, HOUR, MIN, SEC};
use sluice::functions::predict::{replay, simulate, AlwaysWarm, FixedKeepAlive, Policy, Replay};

const END: u64 = 3 * DAY;
/// Knative's defaults: 60 s stable window + 30 s grace.
const FIXED_KEEP: u64 = 90 * SEC;
const SEEDS: [u64; 5] = [19, 20, 21, 22, 23];
/// Cold starts above `fixed / 4` allowed on a single seed.
const COLD_SLACK: u64 = 2;
const POLICIES: [&str; 4] = ["always-warm", "fixed-90s", "histogram", "gbdt"];

fn policy(name: &str) -> Box<dyn Policy> {
    match name {
        "always-warm" => Box::new(AlwaysWarm),
        "fixed-90s" => Box::new(FixedKeepAlive::new(FIXED_KEEP)),
        "histogram" => Box::new(HistogramPolicy::new(HistogramParams::default())),
        _ => Box::new(GbdtPolicy::default()),
    }
}

/// Replays `trace` through every policy; checks what must hold on any trace.
fn run_all(trace: &[u64]) -> Vec<Replay> {
    let rows: Vec<Replay> = POLICIES
        .iter()
        .map(|name| replay(policy(name).as_mut(), trace, END))
        .collect();
    let always = rows[0].stats;
    for (name, r) in POLICIES.iter().zip(&rows) {
        assert_eq!(r.stats.arrivals, trace.len() as u64, "{name}");
        assert!(r.stats.cold_starts <= r.stats.arrivals, "{name}");
        if *name != "always-warm" {
            assert!(r.stats.cold_starts >= 1, "{name}: the first is cold");
        }
        assert!(
            r.stats.warm_ms <= always.warm_ms,
            "{name} above always-warm"
        );
    }
    assert!(always.cold_starts <= 1);
    assert_eq!(always.warm_ms, END);
    assert_eq!(rows[0].wakeups, 0, "always-warm never wakes");
    rows
}

fn print_table(trace_name: &str, seed: u64, rows: &[Replay]) {
    eprintln!(
        "{trace_name:<16} seed {seed:<3} {:<12} {:>6} {:>6} {:>8} {:>10} {:>7} {:>6}",
        "policy", "arriv", "cold", "cold %", "warm s", "warm %", "wakes"
    );
    for (name, r) in POLICIES.iter().zip(rows) {
        let s = r.stats;
        eprintln!(
            "{:<25} {name:<12} {:>6} {:>6} {:>7.1}% {:>10.0} {:>6.1}% {:>6}",
            "",
            s.arrivals,
            s.cold_starts,
            100.0 * s.cold_starts as f64 / s.arrivals.max(1) as f64,
            s.warm_ms as f64 / 1000.0,
            100.0 * s.warm_ms as f64 / END as f64,
            r.wakeups
        );
    }
}

/// Runs `trace` for every seed, prints the first seed's table and, for the
/// learned policies, the spread over seeds of cold starts and warm time
/// relative to fixed keep-alive; returns (fixed, histogram, gbdt) per seed.
fn run_seeds(trace: Trace) -> Vec<[Replay; 3]> {
    let trace_name = trace.name();
    let mut out = Vec::new();
    for (k, &seed) in SEEDS.iter().enumerate() {
        let trace = trace.generate(seed, END);
        let rows = run_all(&trace);
        if k == 0 {
            print_table(trace_name, seed, &rows);
        }
        out.push([rows[1], rows[2], rows[3]]);
    }
    for (j, name) in ["histogram", "gbdt"].iter().enumerate() {
        let per_seed: Vec<String> = out
            .iter()
            .map(|r| {
                format!(
                    "{}/{}c {:.0}%w",
                    r[j + 1].stats.cold_starts,
                    r[0].stats.cold_starts,
                    100.0 * r[j + 1].stats.warm_ms as f64 / r[0].stats.warm_ms.max(1) as f64
                )
            })
            .collect();
        eprintln!(
            "{trace_name:<16} {name:<10} vs fixed over seeds {SEEDS:?}: {}",
            per_seed.join(", ")
        );
    }
    eprintln!();
    out
}

/// The target for `pred` against `fixed`, with the stated tolerance.
fn assert_target(trace_name: &str, runs: &[[Replay; 3]], pred: usize) {
    let mut meets = 0;
    for (seed, r) in SEEDS.iter().zip(runs) {
        let (f, p) = (r[0].stats, r[pred].stats);
        assert!(
            p.warm_ms <= f.warm_ms,
            "{trace_name} seed {seed}: more instance-seconds than fixed: {p:?} vs {f:?}"
        );
        assert!(
            p.cold_starts * 4 <= f.cold_starts + 4 * COLD_SLACK,
            "{trace_name} seed {seed}: cold starts {p:?} vs fixed {f:?}"
        );
        if p.cold_starts * 4 <= f.cold_starts {
            meets += 1;
        }
    }
    assert!(
        meets * 2 > runs.len(),
        "{trace_name}: target met on {meets} of {} seeds",
        runs.len()
    );
}

#[test]
fn periodic_with_jitter_gbdt_meets_the_target() {
    let runs = run_seeds(Trace::Periodic);
    for r in &runs {
        // keep-alive shorter than the period: every arrival is cold
        assert_eq!(r[0].stats.cold_starts, r[0].stats.arrivals);
    }
    assert_target("periodic gbdt", &runs, 2);
    // the histogram policy (1 min bins, as the paper) cuts cold starts as
    // much but pre-warms up to a bin early: more instance-seconds than fixed
    // keep-alive on this trace, so the target is not asserted for it
}

#[test]
fn diurnal_timers_gbdt_meets_the_target() {
    let runs = run_seeds(Trace::DiurnalTimers);
    assert_target("diurnal-timers gbdt", &runs, 2);
}

/// The oracle bound of a Poisson trace over the test's three days.
fn oracle_bound(trace: Trace) -> OracleBound {
    let rate = trace.poisson_rate().expect("a Poisson trace");
    OracleBound::new(rate.per_min_at, END)
}

#[test]
fn diurnal_poisson_target_is_beyond_any_policy() {
    let runs = run_seeds(Trace::DiurnalPoisson);
    let bound = oracle_bound(Trace::DiurnalPoisson);
    for (seed, r) in SEEDS.iter().zip(&runs) {
        let f = r[0].stats;
        let at_fixed = bound.cold_starts_at(f.warm_ms);
        eprintln!(
            "diurnal-poisson  seed {seed:<3} fixed {} cold at {:.0} s; target <= {}; \
             oracle bound at fixed's instance-seconds: >= {at_fixed:.1} expected cold starts",
            f.cold_starts,
            f.warm_ms as f64 / 1000.0,
            f.cold_starts / 4
        );
        // the target asks for fewer than the oracle's expectation, by far
        assert!(bound.target_beyond_any_policy(f.cold_starts, f.warm_ms));
        // and no policy beats the bound at its own instance-seconds (beyond
        // the Poisson noise of a realisation: 4 standard deviations)
        for p in r {
            let b = bound.cold_starts_at(p.stats.warm_ms);
            assert!(
                p.stats.cold_starts as f64 >= b - 4.0 * b.sqrt(),
                "{p:?} vs {b}"
            );
        }
    }
    eprintln!();
}

#[test]
fn poisson_and_bursty_sanity() {
    let runs = run_seeds(Trace::Poisson);
    let bound = oracle_bound(Trace::Poisson);
    for r in &runs {
        // memoryless at a constant rate: cold starts fall only with warm time
        for p in r {
            let b = bound.cold_starts_at(p.stats.warm_ms);
            assert!(
                p.stats.cold_starts as f64 >= b - 4.0 * b.sqrt(),
                "{p:?} vs {b}"
            );
        }
    }
    let runs = run_seeds(Trace::Bursty);
    for r in &runs {
        // bursts come every 150 min: the first arrival of each is cold for
        // fixed keep-alive, which keeps nothing through the 120 min gaps
        let bursts = (END / (150 * MIN)) as f64;
        assert!(r[0].stats.cold_starts as f64 >= bursts * 0.9, "{:?}", r[0]);
        assert!(r[0].stats.warm_ms < END / 4);
    }
}

#[test]
fn a_long_silence_costs_no_wake_ups() {
    // a day of a 10 min timer, then two days of nothing
    let trace: Vec<u64> = (0..144).map(|i| i * 10 * MIN + 17 * SEC).collect();
    let last = trace[trace.len() - 1];
    for name in POLICIES {
        let r = replay(policy(name).as_mut(), &trace, END);
        let quiet_after = r.last_wake_ms.map_or(0, |w| w.saturating_sub(last));
        eprintln!(
            "silence: {name:<12} {} wake-ups, the last {} s after the last arrival",
            r.wakeups,
            quiet_after / 1000
        );
        assert!(
            quiet_after <= 2 * HOUR,
            "{name}: woken {quiet_after} ms into the silence"
        );
    }
}

#[test]
fn replay_agrees_with_a_fine_tick_simulation() {
    // replay decides only at arrivals and next_wake; a 1 s tick decides
    // everywhere: if next_wake missed a change of decision, they would differ
    // by more than one tick per arrival
    let trace = Trace::DiurnalTimers.generate(7, END);
    let trace: Vec<u64> = trace.into_iter().filter(|&t| t < DAY).collect();
    for name in ["histogram", "gbdt"] {
        let r = replay(policy(name).as_mut(), &trace, DAY);
        let s = simulate(policy(name).as_mut(), &trace, SEC, DAY);
        let n = trace.len() as u64;
        assert!(
            r.stats.cold_starts.abs_diff(s.cold_starts) <= n / 20 + 1,
            "{name}: {r:?} vs {s:?}"
        );
        assert!(
            r.stats.warm_ms.abs_diff(s.warm_ms) <= 2 * n * SEC,
            "{name}: {r:?} vs {s:?}"
        );
    }
}

#[test]
fn learned_policies_fall_back_to_fixed_keep_alive_with_too_little_history() {
    let few = [500, 10 * MIN, 20 * MIN, 30 * MIN];
    let a = replay(&mut FixedKeepAlive::new(FIXED_KEEP), &few, HOUR);
    let mut hist = HistogramPolicy::new(HistogramParams::default());
    let mut gb = GbdtPolicy::default();
    let b = replay(&mut hist, &few, HOUR);
    let c = replay(&mut gb, &few, HOUR);
    assert!(hist.windows().is_none());
    assert!(!gb.trained());
    assert_eq!(a, b);
    assert_eq!(a, c);
}
