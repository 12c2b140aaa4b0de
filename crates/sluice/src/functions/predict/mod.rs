//! Prediction core of the edge-function autoscaler (`prewarm = "predict"`).
//!
//! Every policy is sans-IO and clock-free: time is a `u64` of milliseconds
//! since an origin chosen by the caller, arrivals are reported with
//! [`Policy::on_arrival`] and the caller asks [`Policy::decide`] whether an
//! instance should be running *now*. A [`Decision`] says `run` (start or keep
//! an instance: `true` while none is warm means pre-warm, `false` while one is
//! warm means unload) and `until_ms`, the deadline after which the instance
//! may be unloaded if nothing else happens (`None`: no deadline known).
//! [`Policy::next_wake`] says when to ask again: a runtime that sleeps until
//! then (or until the next arrival) sees every change of decision and wakes for
//! nothing else, so an idle function costs no wake-ups.
//!
//! Policies, what they predict, and when they fall back:
//! - [`AlwaysWarm`]: runs an instance all the time (upper bound of instance
//!   time, zero cold starts after the first start). Never wakes.
//! - [`FixedKeepAlive`]: Knative-like; keeps an instance for a fixed window
//!   after the last arrival (Knative's defaults: 60 s stable window + 30 s
//!   grace = 90 s) and never pre-warms. Wakes once, at the deadline. It is
//!   also the fallback of both learned policies while they have too little
//!   history.
//! - [`histogram::HistogramPolicy`]: the hybrid histogram policy of Shahrad et
//!   al. (USENIX ATC '20). Predicts the *next idle time* (gap between
//!   arrivals) from the histogram of past ones: pre-warms at the 5th
//!   percentile minus a margin after an arrival, unloads at the 99th
//!   percentile plus a margin. Falls back to fixed keep-alive with fewer than
//!   `min_samples` idle times, too many out-of-range ones, or a flat
//!   histogram. Stops asking to be woken once the keep-alive window after the
//!   last arrival is over (at most `bin_ms * range_bins * (1 + margin)` of
//!   silence, 4 h 24 min by default; in the fallback, its keep-alive).
//! - [`gbdt::GbdtPolicy`]: gradient-boosted regression trees predicting the
//!   *arrival count of each interval* (1 min) from recent per-interval counts
//!   (lags, sums at several scales, intervals since the last arrival); runs an
//!   instance while the arrivals still expected in the current interval reach
//!   a threshold. Falls back to fixed keep-alive until `min_intervals`
//!   intervals were seen and a model is trained. Stops asking to be woken once
//!   no interval until its features stop changing (at most
//!   [`gbdt::GbdtPolicyParams::silence_horizon`] intervals of silence, 64 min
//!   by default; plus one day when the time-of-day feature is on) is predicted
//!   active.
//!
//! [`simulate`] replays a trace through a policy on a fixed tick, [`replay`]
//! event by event as a runtime would (sleeping until the next arrival or
//! [`Policy::next_wake`]); both count cold starts (arrivals finding no warm
//! instance) and warm instance-time; tests and benchmarks use them to compare
//! policies (`tests/predict_traces.rs` prints the figures for synthetic
//! traces, those of [`traces`], which the benchmark replays too).

pub mod gbdt;
pub mod histogram;
pub mod traces;

/// What a policy wants right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// An instance should be running now (pre-warm it if none is, keep it if
    /// one is); `false` means unload / do not start.
    pub run: bool,
    /// Keep-alive deadline in ms since the origin, when `run`; `None` when
    /// the policy gives no deadline (always warm, or not running).
    pub until_ms: Option<u64>,
}

impl Decision {
    /// Do not run an instance.
    pub const STOP: Decision = Decision {
        run: false,
        until_ms: None,
    };
}

/// A per-function pre-warm / keep-alive policy.
pub trait Policy {
    /// An invocation arrived at `at_ms` (ms since the origin). Arrivals are
    /// expected in non-decreasing order; earlier ones must not panic.
    fn on_arrival(&mut self, at_ms: u64);
    /// Should an instance be running at `now_ms`, given whether one is warm?
    fn decide(&self, now_ms: u64, warm: bool) -> Decision;
    /// The earliest time after `now_ms` at which [`Policy::decide`] may answer differently if
    /// no arrival comes first (a pre-warm time, a keep-alive deadline); `None`: not before the
    /// next arrival. The runtime sleeps until then, so a policy with nothing to do costs no
    /// wake-ups. Default: the keep-alive deadline of a warm instance, and no pre-warm.
    fn next_wake(&self, now_ms: u64, warm: bool) -> Option<u64> {
        let d = self.decide(now_ms, warm);
        if warm && d.run {
            d.until_ms
        } else {
            None
        }
    }
}

/// Runs an instance all the time.
#[derive(Debug, Clone, Copy, Default)]
pub struct AlwaysWarm;

impl Policy for AlwaysWarm {
    fn on_arrival(&mut self, _at_ms: u64) {}
    fn decide(&self, _now_ms: u64, _warm: bool) -> Decision {
        Decision {
            run: true,
            until_ms: None,
        }
    }
}

/// Knative-like: keep a warm instance for `keep_ms` after the last arrival;
/// never pre-warms (a cold instance stays cold until the next arrival).
#[derive(Debug, Clone, Copy)]
pub struct FixedKeepAlive {
    keep_ms: u64,
    last_ms: Option<u64>,
}

impl FixedKeepAlive {
    /// A policy keeping an instance `keep_ms` after the last arrival.
    pub fn new(keep_ms: u64) -> Self {
        FixedKeepAlive {
            keep_ms,
            last_ms: None,
        }
    }

    /// The last arrival seen, if any.
    pub fn last_ms(&self) -> Option<u64> {
        self.last_ms
    }
}

impl Policy for FixedKeepAlive {
    fn on_arrival(&mut self, at_ms: u64) {
        self.last_ms = Some(self.last_ms.map_or(at_ms, |l| l.max(at_ms)));
    }

    fn decide(&self, now_ms: u64, warm: bool) -> Decision {
        keep_after(self.last_ms, self.keep_ms, now_ms, warm)
    }
}

/// Fixed keep-alive decision shared by the fallbacks: keep a warm instance
/// until `last + keep`, never start one.
pub(crate) fn keep_after(last_ms: Option<u64>, keep_ms: u64, now_ms: u64, warm: bool) -> Decision {
    match last_ms {
        Some(last) if warm => {
            let until = last.saturating_add(keep_ms);
            if now_ms < until {
                Decision {
                    run: true,
                    until_ms: Some(until),
                }
            } else {
                Decision::STOP
            }
        }
        _ => Decision::STOP,
    }
}

/// Figures of one [`simulate`] run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Arrivals replayed.
    pub arrivals: u64,
    /// Arrivals that found no warm instance.
    pub cold_starts: u64,
    /// Time an instance was warm (loaded), in ms.
    pub warm_ms: u64,
}

/// Replays `arrivals` (ms since the origin; sorted here) through `policy` from
/// 0 to `end_ms` in steps of `tick_ms`. At each tick start the policy decides
/// whether an instance runs during the tick; an arrival with no warm instance
/// is a cold start and leaves an instance warm until the next decision.
/// Execution time is taken as zero.
pub fn simulate(policy: &mut dyn Policy, arrivals: &[u64], tick_ms: u64, end_ms: u64) -> SimStats {
    let tick = tick_ms.max(1);
    let mut sorted = arrivals.to_vec();
    sorted.sort_unstable();
    let mut stats = SimStats::default();
    let mut warm = false;
    let mut next = 0usize;
    let mut t = 0u64;
    while t < end_ms {
        let tick_end = t.saturating_add(tick).min(end_ms);
        warm = policy.decide(t, warm).run;
        let mut warm_from = if warm { Some(t) } else { None };
        while let Some(&a) = sorted.get(next) {
            if a >= tick_end {
                break;
            }
            next += 1;
            stats.arrivals += 1;
            if !warm {
                stats.cold_starts += 1;
                warm = true;
                warm_from = Some(a.max(t));
            }
            policy.on_arrival(a);
        }
        if let Some(from) = warm_from {
            stats.warm_ms += tick_end.saturating_sub(from);
        }
        t = tick_end;
    }
    stats
}

/// Figures of one [`replay`] run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replay {
    /// Cold starts and warm time, as [`simulate`] counts them.
    pub stats: SimStats,
    /// Times the policy asked to be woken ([`Policy::next_wake`]) and was.
    pub wakeups: u64,
    /// The last of those wake-ups, if any.
    pub last_wake_ms: Option<u64>,
}

/// Replays `arrivals` (ms since the origin; sorted here; those at or after
/// `end_ms` are dropped) through `policy` from 0 to `end_ms` the way a runtime
/// drives it: it decides at 0, at every arrival (just before it is reported,
/// then again just after) and at every [`Policy::next_wake`], and sleeps in
/// between. An arrival with no warm instance is a cold start and starts one;
/// execution time is taken as zero, starting an instance as instantaneous.
/// A `next_wake` not after the current time is taken as 1 ms later.
pub fn replay(policy: &mut dyn Policy, arrivals: &[u64], end_ms: u64) -> Replay {
    let mut sorted: Vec<u64> = arrivals.iter().copied().filter(|&a| a < end_ms).collect();
    sorted.sort_unstable();
    let mut out = Replay::default();
    let mut warm_from: Option<u64> = None;
    let mut next = 0usize;
    let mut t = 0u64;
    // Starts or stops the instance at `t` as `run` says, counting warm time.
    fn apply(run: bool, t: u64, warm_from: &mut Option<u64>, warm_ms: &mut u64) {
        match (*warm_from, run) {
            (Some(from), false) => {
                *warm_ms += t.saturating_sub(from);
                *warm_from = None;
            }
            (None, true) => *warm_from = Some(t),
            _ => {}
        }
    }
    if end_ms == 0 {
        return out;
    }
    loop {
        let run = policy.decide(t, warm_from.is_some()).run;
        apply(run, t, &mut warm_from, &mut out.stats.warm_ms);
        let wake = policy
            .next_wake(t, warm_from.is_some())
            .map(|w| w.max(t.saturating_add(1)));
        match (sorted.get(next).copied(), wake) {
            (Some(a), w) if w.is_none_or(|w| a <= w) => {
                t = a;
                let run = policy.decide(t, warm_from.is_some()).run;
                apply(run, t, &mut warm_from, &mut out.stats.warm_ms);
                out.stats.arrivals += 1;
                if warm_from.is_none() {
                    out.stats.cold_starts += 1;
                    warm_from = Some(t);
                }
                policy.on_arrival(t);
                next += 1;
            }
            (_, Some(w)) if w < end_ms => {
                t = w;
                out.wakeups += 1;
                out.last_wake_ms = Some(w);
            }
            _ => break,
        }
    }
    if let Some(from) = warm_from {
        out.stats.warm_ms += end_ms.saturating_sub(from);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_keep_alive_keeps_then_stops_and_never_prewarms() {
        let mut p = FixedKeepAlive::new(100);
        assert_eq!(p.decide(0, false), Decision::STOP);
        p.on_arrival(50);
        assert_eq!(
            p.decide(60, true),
            Decision {
                run: true,
                until_ms: Some(150)
            }
        );
        assert!(!p.decide(150, true).run);
        assert!(!p.decide(60, false).run);
        p.on_arrival(10); // out of order: ignored for the deadline
        assert_eq!(p.last_ms(), Some(50));
    }

    #[test]
    fn always_warm_runs() {
        assert!(AlwaysWarm.decide(0, false).run);
    }

    #[test]
    fn simulate_counts_cold_starts_and_warm_time() {
        let mut p = FixedKeepAlive::new(100);
        // 0: cold; 50: warm; 500: cold (kept until 150 only).
        let s = simulate(&mut p, &[500, 0, 50], 10, 1000);
        assert_eq!(s.arrivals, 3);
        assert_eq!(s.cold_starts, 2);
        // warm 0..150 and 500..610 (kept until 600, decided off at 600)
        assert_eq!(s.warm_ms, 150 + 100);
        let a = simulate(&mut AlwaysWarm, &[0, 50, 500], 10, 1000);
        assert_eq!(
            a,
            SimStats {
                arrivals: 3,
                cold_starts: 0,
                warm_ms: 1000
            }
        );
    }

    #[test]
    fn replay_wakes_only_at_deadlines_and_counts_like_simulate() {
        let trace = [0, 50, 500, 2000, 2010];
        let r = replay(&mut FixedKeepAlive::new(100), &trace, 10_000);
        // cold at 0, 500, 2000; warm 0..150, 500..600, 2000..2110
        assert_eq!(
            r.stats,
            SimStats {
                arrivals: 5,
                cold_starts: 3,
                warm_ms: 150 + 100 + 110
            }
        );
        // one wake-up per keep-alive deadline, none during the long silence
        assert_eq!(r.wakeups, 3);
        assert_eq!(r.last_wake_ms, Some(2110));
        let s = simulate(&mut FixedKeepAlive::new(100), &trace, 10, 10_000);
        assert_eq!(s, r.stats);
        let a = replay(&mut AlwaysWarm, &trace, 10_000);
        assert_eq!(
            (a.stats.cold_starts, a.stats.warm_ms, a.wakeups),
            (0, 10_000, 0)
        );
    }

    #[test]
    fn replay_survives_degenerate_input() {
        let r = replay(&mut FixedKeepAlive::new(0), &[u64::MAX, 3, 3], 5);
        assert_eq!((r.stats.arrivals, r.stats.cold_starts), (2, 2));
        assert_eq!(replay(&mut AlwaysWarm, &[1], 0), Replay::default());
    }

    #[test]
    fn simulate_survives_degenerate_input() {
        let s = simulate(&mut FixedKeepAlive::new(0), &[u64::MAX, 3], 0, 5);
        assert_eq!(s.arrivals, 1);
        assert_eq!(s.cold_starts, 1);
    }
}
