//! The model of [`super::GbdtPolicy`]: gradient-boosted regression trees
//! (squared error), small and dependency-free.
//!
//! A [`Gbdt`] is a constant base (mean of the targets) plus `rounds`
//! depth-limited CART regression trees, each fitted to the residuals of the
//! previous ones and added with shrinkage `learning_rate`. Split finding is
//! histogram-based, as in LightGBM or XGBoost's `hist` method: each feature is
//! cut into at most [`MAX_BINS`] bins once per fit (its distinct values when
//! there are few, as for the policy's small integer counts; quantiles
//! otherwise), and a node's best split is found from per-bin sums in
//! O(rows × features + bins × features). A split sends `x <= threshold` left,
//! the threshold being the largest value of the bin's left side.

/// Most bins per feature.
pub const MAX_BINS: usize = 64;

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
}

/// Features cut into bins, once per fit.
struct Binned {
    /// Per feature, the largest value of each bin (ascending).
    edges: Vec<Vec<f64>>,
    /// Per row, per feature, its bin.
    codes: Vec<Vec<u8>>,
}

impl Binned {
    fn new(x: &[Vec<f64>], features: usize) -> Binned {
        let val = |row: &Vec<f64>, f: usize| {
            let v = row.get(f).copied().unwrap_or(0.0);
            if v.is_finite() {
                v
            } else {
                0.0
            }
        };
        let mut edges = Vec::with_capacity(features);
        for f in 0..features {
            let mut vals: Vec<f64> = x.iter().map(|r| val(r, f)).collect();
            vals.sort_by(f64::total_cmp);
            let mut distinct = vals.clone();
            distinct.dedup();
            let e = if distinct.len() <= MAX_BINS {
                distinct
            } else {
                let mut q: Vec<f64> = (1..=MAX_BINS)
                    .map(|k| vals[(k * vals.len() / MAX_BINS).saturating_sub(1)])
                    .collect();
                q.dedup();
                q
            };
            edges.push(e);
        }
        let codes = x
            .iter()
            .map(|r| {
                (0..features)
                    .map(|f| {
                        let e = &edges[f];
                        // first bin whose edge is >= v; the last edge is the maximum
                        let b = e.partition_point(|&edge| edge < val(r, f));
                        b.min(e.len().saturating_sub(1)) as u8
                    })
                    .collect()
            })
            .collect();
        Binned { edges, codes }
    }

    /// Grows the subtree of rows `idx` fitted to `r`; returns its node index.
    fn grow(
        &self,
        tree: &mut Tree,
        r: &[f64],
        idx: Vec<usize>,
        depth: usize,
        min_leaf: usize,
    ) -> usize {
        let n = idx.len();
        let sum: f64 = idx.iter().map(|&i| r[i]).sum();
        let mean = if n == 0 { 0.0 } else { sum / n as f64 };
        let me = tree.nodes.len();
        tree.nodes.push(Node::Leaf(mean));
        if depth == 0 || n < 2 * min_leaf {
            return me;
        }
        let Some((feature, bin)) = self.best_split(r, &idx, sum, min_leaf) else {
            return me;
        };
        let (l, rr): (Vec<usize>, Vec<usize>) = idx
            .into_iter()
            .partition(|&i| usize::from(self.codes[i][feature]) <= bin);
        let left = self.grow(tree, r, l, depth - 1, min_leaf);
        let right = self.grow(tree, r, rr, depth - 1, min_leaf);
        tree.nodes[me] = Node::Split {
            feature,
            threshold: self.edges[feature][bin],
            left,
            right,
        };
        me
    }

    /// The split (feature, last bin of the left side) of `idx` with the
    /// largest reduction of squared error, if any.
    fn best_split(
        &self,
        r: &[f64],
        idx: &[usize],
        sum: f64,
        min_leaf: usize,
    ) -> Option<(usize, usize)> {
        let n = idx.len();
        let base = sum * sum / n as f64;
        let mut best: Option<(f64, usize, usize)> = None;
        let mut sums = [0.0f64; MAX_BINS];
        let mut counts = [0usize; MAX_BINS];
        for (f, e) in self.edges.iter().enumerate() {
            let bins = e.len();
            if bins < 2 {
                continue;
            }
            sums[..bins].fill(0.0);
            counts[..bins].fill(0);
            for &i in idx {
                let b = usize::from(self.codes[i][f]);
                sums[b] += r[i];
                counts[b] += 1;
            }
            let (mut left_sum, mut nl) = (0.0, 0usize);
            for b in 0..bins - 1 {
                left_sum += sums[b];
                nl += counts[b];
                if counts[b] == 0 || nl < min_leaf || n - nl < min_leaf {
                    continue;
                }
                let right_sum = sum - left_sum;
                let gain = left_sum * left_sum / nl as f64
                    + right_sum * right_sum / (n - nl) as f64
                    - base;
                if gain > 1e-12 && best.is_none_or(|(g, _, _)| gain > g) {
                    best = Some((gain, f, b));
                }
            }
        }
        best.map(|(_, f, b)| (f, b))
    }
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
    /// beyond the rows) are ignored, missing or non-finite features count as
    /// 0, non-finite targets as 0. Returns the model and the training mean
    /// squared error after each round (index 0: the base alone).
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
        if n == 0 {
            return (model, curve);
        }
        let features = x.iter().map(Vec::len).max().unwrap_or(0);
        let binned = Binned::new(x, features);
        for _ in 0..p.rounds {
            let resid: Vec<f64> = y.iter().zip(&pred).map(|(t, p)| t - p).collect();
            let mut tree = Tree { nodes: Vec::new() };
            binned.grow(
                &mut tree,
                &resid,
                (0..n).collect(),
                p.max_depth,
                p.min_leaf.max(1),
            );
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn many_distinct_values_are_cut_into_quantile_bins() {
        let x: Vec<Vec<f64>> = (0..1000).map(|i| vec![f64::from(i) / 7.0]).collect();
        let y: Vec<f64> = x
            .iter()
            .map(|r| if r[0] > 100.0 { 1.0 } else { 0.0 })
            .collect();
        let (model, curve) = Gbdt::fit(&x, &y, &GbdtParams::default());
        assert!(curve[curve.len() - 1] < 0.01, "{curve:?}");
        assert!(model.predict(&[50.0]) < 0.1);
        assert!(model.predict(&[120.0]) > 0.9);
    }

    #[test]
    fn degenerate_fits_do_not_panic() {
        let (m, c) = Gbdt::fit(&[], &[], &GbdtParams::default());
        assert_eq!(m.predict(&[]), 0.0);
        assert_eq!(c.len(), 1);
        let x = vec![vec![f64::NAN, 1.0], vec![], vec![f64::INFINITY]];
        let (m, _) = Gbdt::fit(&x, &[1.0, f64::NAN, 2.0], &GbdtParams::default());
        assert!(m.predict(&[0.0, 0.0, 9.0]).is_finite());
    }
}
