//! Gradient-boosted regression trees on recent per-interval arrival counts
//! (the idea of Shahrad et al., USENIX ATC '20, of predicting invocations
//! with a learned model; the model is our own, in [`model`], no external
//! crate).
//!
//! What it predicts: time is cut into intervals of `interval_ms` (1 min);
//! the counts of the last `ring` intervals are kept in a ring (bounded
//! memory: `ring` counters). The model predicts the arrival count of interval
//! `i` from the completed intervals before it; empty intervals since the last
//! arrival count as zeros. The features of interval `i`, all small integers
//! (counts capped at [`COUNT_CAP`]):
//! - the counts of intervals `i-1 ..= i-lags` (a timer of period up to
//!   `lags` intervals shows as a lag: 32 min by default);
//! - the sums of the counts of the last 5, 15 and 60 intervals (the recent
//!   rate at several scales: bursts, busy hours);
//! - the intervals since the last non-empty one before `i`, capped at
//!   [`SINCE_CAP`];
//! - if `day_intervals > 0`, the hour of the day (`24 * (i mod day) / day`);
//!   off by default: it needs a ring longer than a day to be learnt.
//!
//! It retrains from the ring every `retrain_every` completed intervals (on the
//! first arrival of a new interval, so never while idle).
//!
//! Decision at `now`, in interval `i`: the arrivals still expected in `i` are
//! the prediction minus the arrivals already seen in `i`. Run an instance
//! (pre-warm) when they reach `prewarm_at`; keep a warm one while they are
//! above `keep_above`, or for `min_keep_ms` after an arrival. So a predicted
//! interval is pre-warmed from its start, and the instance is unloaded as soon
//! as the expected arrivals have come. `until_ms` is the end of the interval
//! (or of the minimum keep), when the decision is next looked at.
//!
//! Wake-ups ([`Policy::next_wake`]): while running, the end of the current
//! interval (or of the minimum keep); while not, the start of the first later
//! interval predicted active, looking ahead until the features stop changing:
//! after [`GbdtPolicyParams::silence_horizon`] intervals of silence (64 by
//! default) every feature is constant (plus the hour of the day, if on, which
//! repeats daily: then one more day is looked at). If none is, `None`: an idle
//! function costs no wake-ups. If even the all-silent features are predicted
//! active, the instance is simply kept (like [`super::AlwaysWarm`]) with no
//! deadline and no wake-up.
//!
//! Fallback: until the ring holds `min_intervals` completed intervals and a
//! model was trained, a fixed keep-alive of `fallback_keep_ms` (90 s, as
//! Knative) after the last arrival that never pre-warms, exactly
//! [`super::FixedKeepAlive`].

mod model;

use std::collections::VecDeque;

pub use model::{Gbdt, GbdtParams};

use super::{keep_after, Decision, Policy};

/// Counts (per interval and summed) are capped at this in the features.
pub const COUNT_CAP: u32 = 63;
/// Intervals since the last arrival are capped at this in the features.
pub const SINCE_CAP: u64 = 63;
/// Windows (in intervals) of the summed-count features.
const SCALES: [u64; 3] = [5, 15, 60];

/// Parameters of [`GbdtPolicy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GbdtPolicyParams {
    /// Interval width in ms.
    pub interval_ms: u64,
    /// Lagged counts used as features.
    pub lags: usize,
    /// Intervals per day for the hour-of-day feature (0: no such feature).
    pub day_intervals: u64,
    /// Intervals kept in the ring (training window).
    pub ring: usize,
    /// Completed intervals needed before the model is trained and used.
    pub min_intervals: usize,
    /// Completed intervals between retrainings.
    pub retrain_every: usize,
    /// Pre-warm when the arrivals still expected in the interval reach this.
    pub prewarm_at: f64,
    /// Keep a warm instance while the arrivals still expected are above this.
    pub keep_above: f64,
    /// Keep a warm instance at least this long after an arrival, in ms.
    pub min_keep_ms: u64,
    /// Keep-alive of the fallback, in ms.
    pub fallback_keep_ms: u64,
    /// Model parameters.
    pub model: GbdtParams,
}

impl Default for GbdtPolicyParams {
    fn default() -> Self {
        GbdtPolicyParams {
            interval_ms: 60_000,
            lags: 32,
            day_intervals: 0,
            ring: 512,
            min_intervals: 120,
            retrain_every: 60,
            prewarm_at: 0.2,
            keep_above: 0.1,
            min_keep_ms: 0,
            fallback_keep_ms: 90_000,
            model: GbdtParams::default(),
        }
    }
}

impl GbdtPolicyParams {
    /// Intervals of silence after which every feature but the hour of the day
    /// is constant: the longest of `lags`, the widest sum and [`SINCE_CAP`],
    /// plus one.
    pub fn silence_horizon(&self) -> u64 {
        (self.lags as u64)
            .max(SCALES[SCALES.len() - 1])
            .max(SINCE_CAP)
            .saturating_add(1)
    }
}

/// Gradient-boosted-trees pre-warm policy; see the module doc.
#[derive(Debug, Clone)]
pub struct GbdtPolicy {
    p: GbdtPolicyParams,
    /// Counts of intervals `last_idx + 1 - counts.len() ..= last_idx`; the
    /// last one (that of the last arrival) may still be open.
    counts: VecDeque<u32>,
    last_idx: u64,
    last_ms: Option<u64>,
    since_train: usize,
    model: Option<Gbdt>,
}

impl Default for GbdtPolicy {
    fn default() -> Self {
        GbdtPolicy::new(GbdtPolicyParams::default())
    }
}

impl GbdtPolicy {
    /// A policy with no history yet; sizes are raised to sane minimums.
    pub fn new(mut p: GbdtPolicyParams) -> Self {
        p.interval_ms = p.interval_ms.max(1);
        p.lags = p.lags.clamp(1, 4096);
        p.ring = p.ring.max(p.lags + 2);
        p.min_intervals = p.min_intervals.clamp(p.lags + 1, p.ring - 1);
        p.retrain_every = p.retrain_every.max(1);
        GbdtPolicy {
            p,
            counts: VecDeque::new(),
            last_idx: 0,
            last_ms: None,
            since_train: 0,
            model: None,
        }
    }

    /// The parameters in use (after the constructor's adjustments).
    pub fn params(&self) -> &GbdtPolicyParams {
        &self.p
    }

    /// Whether a model is in use (otherwise the fallback is).
    pub fn trained(&self) -> bool {
        self.model.is_some()
    }

    /// Count of interval `i` as far as known (0 before the ring, 0 for
    /// intervals after the last arrival).
    fn count(&self, i: u64) -> u32 {
        if self.counts.is_empty() || i > self.last_idx {
            return 0;
        }
        match usize::try_from(self.last_idx - i) {
            Ok(b) if b < self.counts.len() => self.counts[self.counts.len() - 1 - b],
            _ => 0,
        }
    }

    /// Intervals since the last non-empty one before `i`, capped.
    fn since(&self, i: u64) -> u64 {
        if self.counts.is_empty() {
            return SINCE_CAP;
        }
        if i > self.last_idx {
            return (i - self.last_idx).min(SINCE_CAP);
        }
        (1..=SINCE_CAP)
            .find(|&d| i.checked_sub(d).is_some_and(|j| self.count(j) > 0))
            .unwrap_or(SINCE_CAP)
    }

    fn features(&self, i: u64) -> Vec<f64> {
        let mut f = Vec::with_capacity(self.p.lags + SCALES.len() + 2);
        let lagged = |l: u64| i.checked_sub(l).map_or(0, |j| self.count(j));
        for l in 1..=self.p.lags as u64 {
            f.push(f64::from(lagged(l).min(COUNT_CAP)));
        }
        let mut sum = 0u32;
        let mut from = 1;
        for w in SCALES {
            for l in from..=w {
                sum = sum.saturating_add(lagged(l));
            }
            from = w + 1;
            f.push(f64::from(sum.min(COUNT_CAP)));
        }
        f.push(self.since(i) as f64);
        let day = self.p.day_intervals;
        if let Some(hour) = (i % day.max(1)).saturating_mul(24).checked_div(day) {
            f.push(hour as f64);
        }
        f
    }

    /// Predicted arrivals in the interval containing `now_ms` (all of them,
    /// including those already seen), if trained.
    pub fn predict_count(&self, now_ms: u64) -> Option<f64> {
        self.predict_interval(now_ms / self.p.interval_ms)
    }

    fn predict_interval(&self, i: u64) -> Option<f64> {
        let model = self.model.as_ref()?;
        Some(model.predict(&self.features(i)))
    }

    /// Whether every feature of interval `i` (and of all later ones, with
    /// no arrival in between) is that of a long silence and no phase is used.
    fn features_constant(&self, i: u64) -> bool {
        self.p.day_intervals == 0 && i >= self.last_idx.saturating_add(self.p.silence_horizon())
    }

    fn retrain(&mut self) {
        let completed = self.counts.len().saturating_sub(1);
        if completed < self.p.min_intervals {
            return;
        }
        let first = self.last_idx.saturating_sub(completed as u64);
        let mut x = Vec::new();
        let mut y = Vec::new();
        for i in first.saturating_add(self.p.lags as u64)..self.last_idx {
            x.push(self.features(i));
            y.push(f64::from(self.count(i)));
        }
        let (model, _) = Gbdt::fit(&x, &y, &self.p.model);
        self.model = Some(model);
        self.since_train = 0;
    }

    /// The model's part of the decision in interval `i` (`None`: untrained).
    fn model_run(&self, i: u64, warm: bool) -> Option<bool> {
        let pred = self.predict_interval(i)?;
        let remaining = pred - f64::from(self.count(i));
        Some(remaining >= self.p.prewarm_at || (warm && remaining > self.p.keep_above))
    }
}

impl Policy for GbdtPolicy {
    fn on_arrival(&mut self, at_ms: u64) {
        let idx = at_ms / self.p.interval_ms;
        if self.counts.is_empty() {
            self.counts.push_back(1);
            self.last_idx = idx;
            self.last_ms = Some(at_ms);
            return;
        }
        self.last_ms = Some(self.last_ms.map_or(at_ms, |l| l.max(at_ms)));
        if idx <= self.last_idx {
            let back = self.last_idx - idx;
            let len = self.counts.len();
            if let Some(c) = usize::try_from(back)
                .ok()
                .filter(|&b| b < len)
                .and_then(|b| self.counts.get_mut(len - 1 - b))
            {
                *c = c.saturating_add(1);
            }
            return;
        }
        let gap = idx - self.last_idx;
        let zeros = usize::try_from(gap - 1)
            .unwrap_or(usize::MAX)
            .min(self.p.ring);
        for _ in 0..zeros {
            self.counts.push_back(0);
        }
        self.counts.push_back(1);
        while self.counts.len() > self.p.ring {
            self.counts.pop_front();
        }
        self.last_idx = idx;
        self.since_train = self
            .since_train
            .saturating_add(usize::try_from(gap).unwrap_or(usize::MAX));
        if self.model.is_none() || self.since_train >= self.p.retrain_every {
            self.retrain();
        }
    }

    fn decide(&self, now_ms: u64, warm: bool) -> Decision {
        let i = now_ms / self.p.interval_ms;
        let Some(model_run) = self.model_run(i, warm) else {
            return keep_after(self.last_ms, self.p.fallback_keep_ms, now_ms, warm);
        };
        let model_until = if self.features_constant(i) {
            None // the same answer until the next arrival
        } else {
            Some(i.saturating_add(1).saturating_mul(self.p.interval_ms))
        };
        let keep_until = self
            .last_ms
            .map(|l| l.saturating_add(self.p.min_keep_ms))
            .filter(|&u| warm && now_ms < u);
        match (model_run, keep_until) {
            (true, Some(k)) => Decision {
                run: true,
                until_ms: model_until.map(|m| m.max(k)),
            },
            (true, None) => Decision {
                run: true,
                until_ms: model_until,
            },
            (false, Some(k)) => Decision {
                run: true,
                until_ms: Some(k),
            },
            (false, None) => Decision::STOP,
        }
    }

    fn next_wake(&self, now_ms: u64, warm: bool) -> Option<u64> {
        if self.model.is_none() {
            return keep_after(self.last_ms, self.p.fallback_keep_ms, now_ms, warm).until_ms;
        }
        let d = self.decide(now_ms, warm);
        if d.run {
            return d.until_ms;
        }
        // Not running from now on: the first later interval predicted active.
        let i = now_ms / self.p.interval_ms;
        let settled = self
            .last_idx
            .saturating_add(self.p.silence_horizon())
            .max(i);
        let horizon = settled.saturating_add(self.p.day_intervals);
        (i.saturating_add(1)..=horizon)
            .find(|&j| self.model_run(j, false) == Some(true))
            .map(|j| j.saturating_mul(self.p.interval_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::functions::predict::FixedKeepAlive;

    fn params() -> GbdtPolicyParams {
        GbdtPolicyParams {
            interval_ms: 1000,
            lags: 12,
            day_intervals: 0,
            min_intervals: 48,
            fallback_keep_ms: 5000,
            ..Default::default()
        }
    }

    #[test]
    fn falls_back_to_fixed_keep_alive_with_too_little_history() {
        let mut g = GbdtPolicy::new(params());
        let mut f = FixedKeepAlive::new(5000);
        for i in 0..4u64 {
            g.on_arrival(i * 10_000 + 500);
            f.on_arrival(i * 10_000 + 500);
        }
        assert!(!g.trained());
        for now in (30_000..50_000).step_by(250) {
            for warm in [false, true] {
                assert_eq!(g.decide(now, warm), f.decide(now, warm));
            }
        }
    }

    #[test]
    fn learns_a_period_prewarms_and_unloads_once_the_arrival_came() {
        let mut g = GbdtPolicy::new(params());
        for i in 0..30u64 {
            g.on_arrival(i * 10_000 + 500);
        }
        assert!(g.trained());
        let next = 30 * 10_000;
        assert!(
            g.decide(next, false).run,
            "pre-warm at the start of the expected interval: {:?}",
            g.predict_count(next)
        );
        assert!(
            !g.decide(next - 5000, false).run,
            "{:?}",
            g.predict_count(next - 5000)
        );
        assert!(g.decide(next + 400, true).run, "kept until it comes");
        g.on_arrival(next + 500);
        assert!(!g.decide(next + 600, true).run, "the expected arrival came");
    }

    #[test]
    fn next_wake_is_the_prewarm_instant_while_a_period_is_learnt() {
        let mut g = GbdtPolicy::new(params());
        for i in 0..30u64 {
            g.on_arrival(i * 10_000 + 500);
        }
        let last = 29 * 10_000 + 500;
        // just after the last arrival: unloaded, woken at the next interval
        // predicted active (the start of the one 10 s later), not before
        assert!(!g.decide(last + 100, true).run);
        assert_eq!(g.next_wake(last + 100, false), Some(300_000));
        assert_eq!(g.next_wake(last + 100, true), Some(300_000));
        // pre-warmed then: woken at the interval's end to look again
        assert!(g.decide(300_000, false).run);
        assert_eq!(g.next_wake(300_000, true), Some(301_000));
    }

    #[test]
    fn next_wake_is_none_after_a_long_silence() {
        let mut g = GbdtPolicy::new(params());
        for i in 0..30u64 {
            g.on_arrival(i * 10_000 + 500);
        }
        let last = 29 * 10_000 + 500;
        let h = g.params().silence_horizon() * 1000;
        // the period was missed a few times: nothing is predicted any more
        // once the lags of the last arrival are out of sight, and a runtime
        // sleeping until next_wake wakes a bounded number of times
        let mut now = last;
        let mut wakes = 0;
        let mut warm = true;
        while let Some(w) = g.next_wake(now, warm) {
            assert!(w > now, "{w} after {now}");
            now = w;
            warm = g.decide(now, warm).run;
            wakes += 1;
            assert!(wakes < 100);
        }
        assert!(now <= last + h, "woken at {now}, horizon {h}");
        assert_eq!(g.next_wake(last + h, false), None);
        assert_eq!(g.next_wake(last + 100 * h, false), None);
        assert_eq!(g.next_wake(last + 100 * h, true), None);
    }

    #[test]
    fn no_panic_on_odd_input() {
        let mut g = GbdtPolicy::new(GbdtPolicyParams {
            interval_ms: 0,
            lags: 0,
            ring: 0,
            min_intervals: 0,
            retrain_every: 0,
            model: GbdtParams {
                rounds: 3,
                max_depth: 9,
                learning_rate: f64::NAN,
                min_leaf: 0,
            },
            ..Default::default()
        });
        for at in [5, 0, u64::MAX, 3, u64::MAX, 7, 100, 101, 102] {
            g.on_arrival(at);
            let _ = g.decide(at, true);
            let _ = g.decide(0, false);
        }
        let (m, c) = Gbdt::fit(&[], &[], &GbdtParams::default());
        assert_eq!(m.predict(&[]), 0.0);
        assert_eq!(c.len(), 1);
    }
}
