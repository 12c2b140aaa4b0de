//! Gradient-boosted regression trees on recent per-interval arrival counts
//! (the XGBoost idea of Shahrad et al., USENIX ATC '20, with a small model of
//! our own: no external crate).
//!
//! The model ([`Gbdt`]): a constant base (mean of the targets) plus `rounds`
//! depth-limited CART regression trees, each fitted on squared error to the
//! residuals of the previous ones and added with shrinkage `learning_rate`.
//! Splits are exhaustive over every feature's sorted values.
//!
//! What the policy ([`GbdtPolicy`]) predicts: time is cut into intervals of
//! `interval_ms`; the counts of the last `ring` intervals are kept in a ring
//! (bounded memory). For interval `i` the features are the counts of
//! intervals `i-1 ..= i-lags`, the phase `i mod day_intervals` (interval of
//! the day, 0 if `day_intervals` is 0) and the number of intervals since the
//! last non-empty one (capped at `ring`). The model predicts the count of the
//! interval containing `now` from the completed intervals before it (empty
//! intervals since the last arrival count as zeros), i.e. the next interval
//! after what was observed. It retrains from the ring every
//! `retrain_every` completed intervals.
//!
//! Decision: run an instance when the predicted count is `>= prewarm_at`
//! (pre-warm at the start of an interval expected to have traffic), and keep
//! a warm instance while it is `> keep_above` (a small positive threshold
//! standing for "predicted > 0", since a regression rarely gives exactly 0).
//!
//! Fallback: until the ring holds `min_intervals` completed intervals and a
//! model was trained, a fixed keep-alive of `fallback_keep_ms` after the last
//! arrival that never pre-warms, exactly [`super::FixedKeepAlive`].

use std::collections::VecDeque;

use super::{keep_after, Decision, Policy};

/// Parameters of a [`Gbdt`] fit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GbdtParams {
    /// Number of trees.
    pub rounds: usize,
    /// Maximum depth of a tree (0: a single leaf).
    pub max_depth: usize,
    /// Shrinkage applied to every tree.
    pub learning_rate: f64,
    /// Fewest samples in a leaf.
    pub min_leaf: usize,
}

impl Default for GbdtParams {
    fn default() -> Self {
        GbdtParams {
            rounds: 20,
            max_depth: 3,
            learning_rate: 0.3,
            min_leaf: 2,
        }
    }
}

#[derive(Debug, Clone)]
enum Node {
    Leaf(f64),
    Split {
        feature: usize,
        threshold: f64,
        left: usize,
        right: usize,
    },
}

/// One regression tree; nodes in a flat vector, root at 0.
#[derive(Debug, Clone)]
struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    fn predict(&self, x: &[f64]) -> f64 {
        let mut at = 0;
        // depth is bounded by construction; the loop bound guards a bad tree
        for _ in 0..=self.nodes.len() {
            match self.nodes.get(at) {
                Some(Node::Leaf(v)) => return *v,
                Some(Node::Split {
                    feature,
                    threshold,
                    left,
                    right,
                }) => {
                    let v = x.get(*feature).copied().unwrap_or(0.0);
                    at = if v <= *threshold { *left } else { *right };
                }
                None => return 0.0,
            }
        }
        0.0
    }

    fn fit(x: &[Vec<f64>], r: &[f64], p: &GbdtParams) -> Tree {
        let mut tree = Tree { nodes: Vec::new() };
        let idx: Vec<usize> = (0..r.len()).collect();
        tree.grow(x, r, idx, p.max_depth, p.min_leaf.max(1));
        tree
    }

    /// Grows the subtree of `idx`, returns its node index.
    fn grow(
        &mut self,
        x: &[Vec<f64>],
        r: &[f64],
        idx: Vec<usize>,
        depth: usize,
        min_leaf: usize,
    ) -> usize {
        let n = idx.len();
        let sum: f64 = idx.iter().map(|&i| r[i]).sum();
        let mean = if n == 0 { 0.0 } else { sum / n as f64 };
        let me = self.nodes.len();
        self.nodes.push(Node::Leaf(mean));
        if depth == 0 || n < 2 * min_leaf {
            return me;
        }
        let Some((feature, threshold)) = best_split(x, r, &idx, sum, min_leaf) else {
            return me;
        };
        let (l, rr): (Vec<usize>, Vec<usize>) = idx
            .into_iter()
            .partition(|&i| x[i].get(feature).copied().unwrap_or(0.0) <= threshold);
        let left = self.grow(x, r, l, depth - 1, min_leaf);
        let right = self.grow(x, r, rr, depth - 1, min_leaf);
        self.nodes[me] = Node::Split {
            feature,
            threshold,
            left,
            right,
        };
        me
    }
}

/// The split of `idx` with the largest reduction of squared error, if any.
fn best_split(
    x: &[Vec<f64>],
    r: &[f64],
    idx: &[usize],
    sum: f64,
    min_leaf: usize,
) -> Option<(usize, f64)> {
    let n = idx.len();
    let features = idx.first().map_or(0, |&i| x[i].len());
    let base = sum * sum / n as f64;
    let mut best: Option<(f64, usize, f64)> = None;
    let mut order = idx.to_vec();
    for f in 0..features {
        let val = |i: usize| x[i].get(f).copied().unwrap_or(0.0);
        order.sort_by(|&a, &b| val(a).total_cmp(&val(b)));
        let mut left_sum = 0.0;
        for k in 0..n - 1 {
            left_sum += r[order[k]];
            let (lv, rv) = (val(order[k]), val(order[k + 1]));
            let nl = k + 1;
            if lv == rv || nl < min_leaf || n - nl < min_leaf {
                continue;
            }
            let right_sum = sum - left_sum;
            let gain =
                left_sum * left_sum / nl as f64 + right_sum * right_sum / (n - nl) as f64 - base;
            if gain > 1e-12 && best.is_none_or(|(g, _, _)| gain > g) {
                best = Some((gain, f, lv + (rv - lv) / 2.0));
            }
        }
    }
    best.map(|(_, f, t)| (f, t))
}

/// A fitted gradient-boosted regression-trees model.
#[derive(Debug, Clone)]
pub struct Gbdt {
    base: f64,
    learning_rate: f64,
    trees: Vec<Tree>,
}

impl Gbdt {
    /// Fits `x` (rows of features) to `y`; rows beyond `y.len()` (or `y`
    /// beyond the rows) are ignored. Non-finite targets count as 0. Returns
    /// the model and the training mean squared error after each round
    /// (index 0: the base alone).
    pub fn fit(x: &[Vec<f64>], y: &[f64], p: &GbdtParams) -> (Gbdt, Vec<f64>) {
        let n = x.len().min(y.len());
        let x = &x[..n];
        let y: Vec<f64> = y[..n]
            .iter()
            .map(|&v| if v.is_finite() { v } else { 0.0 })
            .collect();
        let base = if n == 0 {
            0.0
        } else {
            y.iter().sum::<f64>() / n as f64
        };
        let lr = if p.learning_rate.is_finite() {
            p.learning_rate.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let mut model = Gbdt {
            base,
            learning_rate: lr,
            trees: Vec::new(),
        };
        let mut pred = vec![base; n];
        let mse = |pred: &[f64]| {
            if n == 0 {
                0.0
            } else {
                pred.iter()
                    .zip(&y)
                    .map(|(p, t)| (p - t).powi(2))
                    .sum::<f64>()
                    / n as f64
            }
        };
        let mut curve = vec![mse(&pred)];
        for _ in 0..p.rounds {
            if n == 0 {
                break;
            }
            let resid: Vec<f64> = y.iter().zip(&pred).map(|(t, p)| t - p).collect();
            let tree = Tree::fit(x, &resid, p);
            for (pv, row) in pred.iter_mut().zip(x) {
                *pv += lr * tree.predict(row);
            }
            model.trees.push(tree);
            curve.push(mse(&pred));
        }
        (model, curve)
    }

    /// Predicts the target of one row of features.
    pub fn predict(&self, x: &[f64]) -> f64 {
        self.base
            + self
                .trees
                .iter()
                .map(|t| self.learning_rate * t.predict(x))
                .sum::<f64>()
    }
}

/// Parameters of [`GbdtPolicy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GbdtPolicyParams {
    /// Interval width in ms.
    pub interval_ms: u64,
    /// Lagged counts used as features.
    pub lags: usize,
    /// Intervals per day for the phase feature (0: no phase).
    pub day_intervals: u64,
    /// Intervals kept in the ring (training window).
    pub ring: usize,
    /// Completed intervals needed before the model is trained and used.
    pub min_intervals: usize,
    /// Completed intervals between retrainings.
    pub retrain_every: usize,
    /// Pre-warm when the predicted count is at least this.
    pub prewarm_at: f64,
    /// Keep a warm instance while the predicted count is above this.
    pub keep_above: f64,
    /// Keep-alive of the fallback, in ms.
    pub fallback_keep_ms: u64,
    /// Model parameters.
    pub model: GbdtParams,
}

impl Default for GbdtPolicyParams {
    fn default() -> Self {
        GbdtPolicyParams {
            interval_ms: 60_000,
            lags: 12,
            day_intervals: 1440,
            ring: 256,
            min_intervals: 48,
            retrain_every: 32,
            prewarm_at: 0.5,
            keep_above: 0.1,
            fallback_keep_ms: 10 * 60_000,
            model: GbdtParams::default(),
        }
    }
}

/// Gradient-boosted-trees pre-warm policy; see the module doc.
#[derive(Debug, Clone)]
pub struct GbdtPolicy {
    p: GbdtPolicyParams,
    /// Counts of intervals `last_idx + 1 - counts.len() ..= last_idx`; the
    /// last one is still open.
    counts: VecDeque<u32>,
    last_idx: u64,
    last_ms: Option<u64>,
    since_train: usize,
    model: Option<Gbdt>,
}

impl GbdtPolicy {
    /// A policy with no history yet; sizes are raised to sane minimums.
    pub fn new(mut p: GbdtPolicyParams) -> Self {
        p.interval_ms = p.interval_ms.max(1);
        p.lags = p.lags.max(1);
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

    /// Whether a model is in use (otherwise the fallback is).
    pub fn trained(&self) -> bool {
        self.model.is_some()
    }

    /// Count of interval `i` as far as known (0 outside the ring's past,
    /// 0 for intervals after the last arrival).
    fn count(&self, i: u64) -> u32 {
        if self.counts.is_empty() || i > self.last_idx {
            return 0;
        }
        let back = self.last_idx - i;
        match usize::try_from(back) {
            Ok(b) if b < self.counts.len() => self.counts[self.counts.len() - 1 - b],
            _ => 0,
        }
    }

    fn features(&self, i: u64) -> Vec<f64> {
        let mut f = Vec::with_capacity(self.p.lags + 2);
        for l in 1..=self.p.lags as u64 {
            f.push(i.checked_sub(l).map_or(0.0, |j| f64::from(self.count(j))));
        }
        let phase = if self.p.day_intervals == 0 {
            0
        } else {
            i % self.p.day_intervals
        };
        f.push(phase as f64);
        let cap = self.p.ring as u64;
        let mut since = cap;
        for d in 1..=cap {
            match i.checked_sub(d) {
                Some(j) if self.count(j) > 0 => {
                    since = d;
                    break;
                }
                Some(_) => {}
                None => break,
            }
        }
        f.push(since as f64);
        f
    }

    /// Predicted arrivals in the interval containing `now_ms`, if trained.
    pub fn predict_count(&self, now_ms: u64) -> Option<f64> {
        let model = self.model.as_ref()?;
        Some(model.predict(&self.features(now_ms / self.p.interval_ms)))
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
        let Some(pred) = self.predict_count(now_ms) else {
            return keep_after(self.last_ms, self.p.fallback_keep_ms, now_ms, warm);
        };
        let end = (now_ms / self.p.interval_ms)
            .saturating_add(1)
            .saturating_mul(self.p.interval_ms);
        if pred >= self.p.prewarm_at || (warm && pred > self.p.keep_above) {
            Decision {
                run: true,
                until_ms: Some(end),
            }
        } else {
            Decision::STOP
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::functions::predict::FixedKeepAlive;

    #[test]
    fn training_error_falls_with_rounds() {
        let x: Vec<Vec<f64>> = (0..200)
            .map(|i| vec![(i % 20) as f64, (i / 20) as f64])
            .collect();
        let y: Vec<f64> = x
            .iter()
            .map(|r| r[0] * r[0] / 10.0 + if r[1] > 4.0 { 5.0 } else { 0.0 })
            .collect();
        let p = GbdtParams {
            rounds: 50,
            max_depth: 3,
            learning_rate: 0.3,
            min_leaf: 1,
        };
        let (model, curve) = Gbdt::fit(&x, &y, &p);
        assert_eq!(curve.len(), 51);
        assert!(curve.windows(2).all(|w| w[1] <= w[0] + 1e-9), "{curve:?}");
        assert!(
            curve[50] < curve[0] / 100.0,
            "{} vs {}",
            curve[50],
            curve[0]
        );
        assert!((model.predict(&[10.0, 7.0]) - 15.0).abs() < 0.5);
    }

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
    fn learns_a_period_and_prewarms() {
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
        assert!(!g.decide(next + 1000, true).run);
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
