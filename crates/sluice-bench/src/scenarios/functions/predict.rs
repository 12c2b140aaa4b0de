//! Part **predict** of `scenario functions`: the synthetic arrival traces of
//! `sluice::functions::predict::traces` (periodic with jitter, Poisson, bursty on/off,
//! diurnal-poisson, diurnal-timers: the same generators and seeds as
//! `crates/sluice/tests/predict_traces.rs`) replayed through sluice's pre-warm policies on
//! virtual clocks — cold starts and warm instance-time each — and the target checked.
//!
//! Owns: the choice of traces, seed and policies, the two replays of each pair, and the
//! target check ([`TargetCheck`]). Does not own: any trace generator, policy or engine (all
//! sluice's), nor the Markdown (`report.rs`).
//!
//! Traces: every one of [`Trace::ALL`] for seed [`SEED`] (the test's first seed, whose tables
//! it prints), at real scale (1 min histogram bins and GBDT intervals, 24 h days) over
//! [`END`] = 3 days, as in the test.
//!
//! Engines: the real autoscaler core on a virtual clock, `sluice::functions::runtime::replay`
//! (one instance, instant starts, service time 0, the shards' 1 s arrival grain), whose
//! figures are the ones that matter; and beside it `sluice::functions::predict::replay` (the
//! policy alone, deciding at every arrival and `next_wake`), the engine the test asserts
//! with. Both take well under a second per pair.
//!
//! Policies, with the `idle` each replay runs with: always-warm; fixed keep-alive of 60 s
//! (Knative's stable window) and of 60 s + 30 s (plus its scale-to-zero grace), each with
//! that `idle`; the histogram policy and the GBDT predictor as the runtime builds them for
//! `prewarm = "predict"` and `prewarm = "gbdt"` with `idle = "90s"` (default parameters, the
//! fallback keep-alive = `idle`; the test's policies exactly).

use serde::Serialize;
use sluice::functions::predict::gbdt::{GbdtPolicy, GbdtPolicyParams};
use sluice::functions::predict::histogram::{HistogramParams, HistogramPolicy};
use sluice::functions::predict::traces::{OracleBound, Trace, DAY, SEC};
use sluice::functions::predict::{self, AlwaysWarm, FixedKeepAlive, Policy};
use sluice::functions::runtime::replay;

/// The traces' seed.
pub const SEED: u64 = 19;
/// Length of every trace, ms.
pub const END: u64 = 3 * DAY;
/// Knative's default keep-alive (60 s stable window + 30 s grace), ms: the target's
/// baseline and the learned policies' `idle`.
pub const KNATIVE_KEEP_MS: u64 = 90 * SEC;
/// The baseline of the target.
pub const BASELINE: &str = "fixed-60s+30s";
/// The learned policies, checked against the baseline.
pub const LEARNED: [&str; 2] = ["histogram", "gbdt"];
/// The traces the target is checked on.
pub const TARGET_TRACES: [Trace; 3] =
    [Trace::Periodic, Trace::DiurnalTimers, Trace::DiurnalPoisson];

/// A policy's name, the `idle` its replay runs with, and how to make a fresh one.
type PolicyCase = (&'static str, u64, fn() -> Box<dyn Policy>);

fn policies() -> [PolicyCase; 5] {
    [
        ("always-warm", KNATIVE_KEEP_MS, || Box::new(AlwaysWarm)),
        ("fixed-60s", 60 * SEC, || {
            Box::new(FixedKeepAlive::new(60 * SEC))
        }),
        (BASELINE, KNATIVE_KEEP_MS, || {
            Box::new(FixedKeepAlive::new(KNATIVE_KEEP_MS))
        }),
        (LEARNED[0], KNATIVE_KEEP_MS, || {
            Box::new(HistogramPolicy::new(HistogramParams {
                fallback_keep_ms: KNATIVE_KEEP_MS,
                ..HistogramParams::default()
            }))
        }),
        (LEARNED[1], KNATIVE_KEEP_MS, || {
            Box::new(GbdtPolicy::new(GbdtPolicyParams {
                fallback_keep_ms: KNATIVE_KEEP_MS,
                ..GbdtPolicyParams::default()
            }))
        }),
    ]
}

/// One policy on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    pub trace: &'static str,
    pub policy: &'static str,
    /// The `idle` of the replay, ms.
    pub idle_ms: u64,
    /// Through the real autoscaler (`runtime::replay`): arrivals, cold starts, …
    pub arrivals: u64,
    pub cold_starts: u64,
    /// cold starts ÷ arrivals, %.
    pub cold_start_percent: f64,
    /// Warm instance-time, ms and hours.
    pub warm_instance_ms: u64,
    pub warm_instance_hours: f64,
    /// Warm instance-time as % of always-warm's.
    pub warm_percent_of_always: f64,
    /// The same through the policy alone (`predict::replay`, the test's engine).
    pub predict_replay_cold_starts: u64,
    pub predict_replay_warm_instance_hours: f64,
}

/// A learned policy against the baseline on one trace, through `runtime::replay`.
#[derive(Debug, Clone, Serialize)]
pub struct LearnedVsFixed {
    pub policy: &'static str,
    pub cold_starts: u64,
    /// cold starts ÷ the baseline's.
    pub cold_start_ratio: f64,
    pub warm_instance_hours: f64,
    /// warm instance-time ÷ the baseline's.
    pub warm_ratio: f64,
    /// ≤ 1/4 of the baseline's cold starts and no more warm instance-time.
    pub meets: bool,
}

/// The target on one trace: a learned policy with at most 1/4 of the cold starts of
/// fixed keep-alive 60 s + 30 s and no more warm instance-time.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub trace: &'static str,
    pub fixed_cold_starts: u64,
    pub fixed_warm_instance_hours: f64,
    pub learned: Vec<LearnedVsFixed>,
    /// Either learned policy meets it.
    pub met: bool,
    /// Poisson traces: the least expected cold starts of any policy warm as long as the
    /// baseline (`traces::OracleBound`).
    pub oracle_cold_starts_at_fixed: Option<f64>,
    /// Poisson traces: the target asks for fewer than that bound by more than 4 standard
    /// deviations (`OracleBound::target_beyond_any_policy`).
    pub beyond_any_policy: Option<bool>,
}

/// Every trace through every policy.
#[derive(Debug, Clone, Serialize)]
pub struct PredictResult {
    /// The engines: `runtime::replay`, then `predict::replay`.
    pub engine: &'static str,
    pub seed: u64,
    pub trace_hours: u64,
    pub rows: Vec<PolicyRow>,
    pub targets: Vec<TargetCheck>,
}

pub fn run() -> PredictResult {
    eprintln!(
        "functions: prediction, {} synthetic traces × 5 policies, {} h each, seed {SEED} (runtime::replay and predict::replay, virtual clocks)",
        Trace::ALL.len(),
        END / (3600 * SEC)
    );
    let mut rows = Vec::new();
    for trace in Trace::ALL {
        let arrivals = trace.generate(SEED, END);
        let mut always_ms = 0;
        for (policy, idle_ms, make) in policies() {
            let re = replay(make(), &arrivals, 0, idle_ms, END);
            let model = predict::replay(make().as_mut(), &arrivals, END).stats;
            if policy == "always-warm" {
                always_ms = re.warm_instance_ms;
            }
            rows.push(PolicyRow {
                trace: trace.name(),
                policy,
                idle_ms,
                arrivals: re.arrivals,
                cold_starts: re.cold_starts,
                cold_start_percent: 100.0 * re.cold_starts as f64 / re.arrivals.max(1) as f64,
                warm_instance_ms: re.warm_instance_ms,
                warm_instance_hours: hours(re.warm_instance_ms),
                warm_percent_of_always: 100.0 * re.warm_instance_ms as f64
                    / always_ms.max(1) as f64,
                predict_replay_cold_starts: model.cold_starts,
                predict_replay_warm_instance_hours: hours(model.warm_ms),
            });
        }
    }
    let targets = TARGET_TRACES
        .iter()
        .filter_map(|&t| target_check(t, &rows))
        .collect();
    PredictResult {
        engine: "runtime::replay + predict::replay",
        seed: SEED,
        trace_hours: END / (3600 * SEC),
        rows,
        targets,
    }
}

fn hours(ms: u64) -> f64 {
    ms as f64 / 3.6e6
}

/// The target on `trace` from its rows (`None` if the baseline's row is missing).
fn target_check(trace: Trace, rows: &[PolicyRow]) -> Option<TargetCheck> {
    let row = |policy: &str| {
        rows.iter()
            .find(|r| r.trace == trace.name() && r.policy == policy)
    };
    let f = row(BASELINE)?;
    let learned: Vec<LearnedVsFixed> = LEARNED
        .iter()
        .filter_map(|&name| row(name))
        .map(|p| LearnedVsFixed {
            policy: p.policy,
            cold_starts: p.cold_starts,
            cold_start_ratio: p.cold_starts as f64 / f.cold_starts.max(1) as f64,
            warm_instance_hours: hours(p.warm_instance_ms),
            warm_ratio: p.warm_instance_ms as f64 / f.warm_instance_ms.max(1) as f64,
            meets: p.cold_starts * 4 <= f.cold_starts && p.warm_instance_ms <= f.warm_instance_ms,
        })
        .collect();
    let bound = trace
        .poisson_rate()
        .map(|rate| OracleBound::new(rate.per_min_at, END));
    Some(TargetCheck {
        trace: trace.name(),
        fixed_cold_starts: f.cold_starts,
        fixed_warm_instance_hours: hours(f.warm_instance_ms),
        met: learned.iter().any(|l| l.meets),
        learned,
        oracle_cold_starts_at_fixed: bound.as_ref().map(|b| b.cold_starts_at(f.warm_instance_ms)),
        beyond_any_policy: bound
            .as_ref()
            .map(|b| b.target_beyond_any_policy(f.cold_starts, f.warm_instance_ms)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(trace: Trace, policy: &'static str, cold_starts: u64, warm_ms: u64) -> PolicyRow {
        PolicyRow {
            trace: trace.name(),
            policy,
            idle_ms: KNATIVE_KEEP_MS,
            arrivals: 1000,
            cold_starts,
            cold_start_percent: 0.0,
            warm_instance_ms: warm_ms,
            warm_instance_hours: hours(warm_ms),
            warm_percent_of_always: 0.0,
            predict_replay_cold_starts: 0,
            predict_replay_warm_instance_hours: 0.0,
        }
    }

    #[test]
    fn the_target_is_met_by_a_learned_policy_with_a_quarter_of_the_cold_starts_and_less_time() {
        let t = Trace::Periodic;
        let rows = [
            row(t, BASELINE, 400, 36_000_000),
            row(t, "histogram", 20, 36_000_001),
            row(t, "gbdt", 100, 18_000_000),
        ];
        let c = target_check(t, &rows).expect("the baseline is there");
        assert_eq!(
            c.learned.iter().map(|l| l.meets).collect::<Vec<_>>(),
            [false, true]
        );
        assert!(c.met && c.oracle_cold_starts_at_fixed.is_none());
        assert!((c.learned[1].cold_start_ratio - 0.25).abs() < 1e-12);
        assert!((c.learned[1].warm_ratio - 0.5).abs() < 1e-12);
        let rows = [row(t, BASELINE, 400, 36_000_000), row(t, "gbdt", 101, 1)];
        assert!(!target_check(t, &rows).expect("baseline").met);
        assert!(target_check(Trace::Poisson, &rows).is_none());
    }

    #[test]
    fn on_diurnal_poisson_the_oracle_bound_says_the_target_is_beyond_any_policy() {
        let t = Trace::DiurnalPoisson;
        let c = target_check(t, &[row(t, BASELINE, 600, 15 * 3_600_000)]).expect("baseline");
        assert!(c.oracle_cold_starts_at_fixed.is_some_and(|b| b > 150.0));
        assert_eq!(c.beyond_any_policy, Some(true));
    }
}
