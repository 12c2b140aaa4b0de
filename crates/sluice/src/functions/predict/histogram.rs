//! Hybrid histogram policy of Shahrad et al., "Serverless in the Wild"
//! (USENIX ATC '20), on a function's idle times (gaps between consecutive
//! arrivals).
//!
//! What it keeps: a histogram of idle times in bins of `bin_ms` (1 minute in
//! the paper; a parameter so tests can compress time) covering
//! `range_bins` bins (240 bins = 4 h in the paper), plus a count of
//! out-of-range idle times (`>= bin_ms * range_bins`). Memory is bounded by
//! `range_bins` counters; counts saturate.
//!
//! What it predicts: after each arrival, the next arrival is expected between
//! the 5th percentile (`head`) and the 99th percentile (`tail`) of the
//! in-range idle times. With `head` the lower edge of the 5th-percentile bin
//! and `tail` the upper edge of the 99th-percentile bin:
//! - pre-warm window `pw = head * (1 - margin)`: the instance is unloaded
//!   right after an arrival and pre-warmed `pw` after it (if `pw` is 0 it is
//!   simply kept);
//! - keep-alive until `tail * (1 + margin)` after the arrival, then unloaded.
//!
//! So [`Policy::decide`] runs an instance while
//! `pw <= now - last_arrival < tail * (1 + margin)`.
//!
//! Fallback (a fixed keep-alive of `fallback_keep_ms` after the last arrival,
//! never pre-warming, exactly [`super::FixedKeepAlive`]) when any of:
//! - fewer than `min_samples` idle times were recorded (too little history);
//! - more than `max_oob_ratio` of them were out of range (the paper forecasts
//!   those with ARIMA; this implementation does not, it falls back);
//! - the histogram is not representative: the coefficient of variation
//!   (std / mean) of the `range_bins` bin counts is below `min_cv` (idle
//!   times spread evenly carry no pattern).

use super::{keep_after, Decision, Policy};

/// Parameters of [`HistogramPolicy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HistogramParams {
    /// Bin width in ms (paper: 60 000).
    pub bin_ms: u64,
    /// Number of bins (paper: 240, i.e. 4 h of 1-minute bins).
    pub range_bins: usize,
    /// Head percentile, in percent (paper: 5).
    pub head_pct: u32,
    /// Tail percentile, in percent (paper: 99).
    pub tail_pct: u32,
    /// Relative margin taken off the pre-warm window and added to the
    /// keep-alive (paper: 0.10).
    pub margin: f64,
    /// Idle times needed before the histogram is used.
    pub min_samples: u64,
    /// Coefficient of variation of the bin counts below which the histogram
    /// is not representative (paper: 2).
    pub min_cv: f64,
    /// Largest share of out-of-range idle times still trusted.
    pub max_oob_ratio: f64,
    /// Keep-alive of the fallback, in ms.
    pub fallback_keep_ms: u64,
}

impl Default for HistogramParams {
    fn default() -> Self {
        HistogramParams {
            bin_ms: 60_000,
            range_bins: 240,
            head_pct: 5,
            tail_pct: 99,
            margin: 0.10,
            min_samples: 10,
            min_cv: 2.0,
            max_oob_ratio: 0.5,
            fallback_keep_ms: 90_000,
        }
    }
}

/// The windows the histogram currently yields, relative to the last arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// Unloaded from the arrival until this many ms after it.
    pub prewarm_ms: u64,
    /// Unloaded again this many ms after the arrival.
    pub keep_until_ms: u64,
}

/// Hybrid histogram policy; see the module doc.
#[derive(Debug, Clone)]
pub struct HistogramPolicy {
    params: HistogramParams,
    bins: Vec<u32>,
    oob: u64,
    samples: u64,
    last_ms: Option<u64>,
    windows: Option<Windows>,
}

impl HistogramPolicy {
    /// A policy with no history yet. `bin_ms` and `range_bins` are raised to
    /// at least 1.
    pub fn new(mut params: HistogramParams) -> Self {
        params.bin_ms = params.bin_ms.max(1);
        params.range_bins = params.range_bins.max(1);
        params.head_pct = params.head_pct.min(100);
        params.tail_pct = params.tail_pct.clamp(params.head_pct, 100);
        HistogramPolicy {
            bins: vec![0; params.range_bins],
            params,
            oob: 0,
            samples: 0,
            last_ms: None,
            windows: None,
        }
    }

    /// The windows in use, or `None` while the fallback is in use.
    pub fn windows(&self) -> Option<Windows> {
        self.windows
    }

    /// Idle times recorded so far (in and out of range).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    fn record_gap(&mut self, gap_ms: u64) {
        self.samples = self.samples.saturating_add(1);
        let bin = gap_ms / self.params.bin_ms;
        match usize::try_from(bin).ok().and_then(|b| self.bins.get_mut(b)) {
            Some(c) => *c = c.saturating_add(1),
            None => self.oob = self.oob.saturating_add(1),
        }
        self.windows = self.compute_windows();
    }

    /// Coefficient of variation of the bin counts (0 for an empty histogram).
    pub fn bin_cv(&self) -> f64 {
        let n = self.bins.len() as f64;
        let mean = self.bins.iter().map(|&c| f64::from(c)).sum::<f64>() / n;
        if mean <= 0.0 {
            return 0.0;
        }
        let var = self
            .bins
            .iter()
            .map(|&c| (f64::from(c) - mean).powi(2))
            .sum::<f64>()
            / n;
        var.sqrt() / mean
    }

    fn compute_windows(&self) -> Option<Windows> {
        let p = &self.params;
        if self.samples < p.min_samples.max(1) {
            return None;
        }
        let in_range = self.samples.saturating_sub(self.oob);
        if in_range == 0 || self.oob as f64 > p.max_oob_ratio * self.samples as f64 {
            return None;
        }
        if self.bin_cv() < p.min_cv {
            return None;
        }
        let head = self.percentile_bin(in_range, p.head_pct)?;
        let tail = self.percentile_bin(in_range, p.tail_pct)?;
        let head_edge = (head as u64).saturating_mul(p.bin_ms);
        let tail_edge = (tail as u64).saturating_add(1).saturating_mul(p.bin_ms);
        let margin = if p.margin.is_finite() {
            p.margin.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let prewarm_ms = (head_edge as f64 * (1.0 - margin)) as u64;
        let keep_until_ms =
            ((tail_edge as f64 * (1.0 + margin)) as u64).max(prewarm_ms.saturating_add(1));
        Some(Windows {
            prewarm_ms,
            keep_until_ms,
        })
    }

    /// Index of the first bin at which the cumulative count reaches `pct`
    /// percent of `total` (at least one sample).
    fn percentile_bin(&self, total: u64, pct: u32) -> Option<usize> {
        let need = (u128::from(total) * u128::from(pct)).div_ceil(100).max(1);
        let mut cum = 0u128;
        for (i, &c) in self.bins.iter().enumerate() {
            cum += u128::from(c);
            if cum >= need {
                return Some(i);
            }
        }
        None
    }
}

impl Policy for HistogramPolicy {
    fn on_arrival(&mut self, at_ms: u64) {
        match self.last_ms {
            Some(last) if at_ms >= last => {
                self.record_gap(at_ms - last);
                self.last_ms = Some(at_ms);
            }
            Some(_) => {} // out of order: no gap to learn from
            None => self.last_ms = Some(at_ms),
        }
    }

    fn decide(&self, now_ms: u64, warm: bool) -> Decision {
        let Some(w) = self.windows else {
            return keep_after(self.last_ms, self.params.fallback_keep_ms, now_ms, warm);
        };
        let Some(last) = self.last_ms else {
            return Decision::STOP;
        };
        let since = now_ms.saturating_sub(last);
        if since >= w.prewarm_ms && since < w.keep_until_ms {
            Decision {
                run: true,
                until_ms: Some(last.saturating_add(w.keep_until_ms)),
            }
        } else {
            Decision::STOP
        }
    }

    /// The decision only changes at the pre-warm instant (`last + prewarm`)
    /// and at the keep-alive deadline (`last + keep_until`); after that,
    /// nothing until the next arrival. In the fallback: the keep-alive
    /// deadline of a warm instance, else nothing.
    fn next_wake(&self, now_ms: u64, warm: bool) -> Option<u64> {
        let Some(w) = self.windows else {
            return keep_after(self.last_ms, self.params.fallback_keep_ms, now_ms, warm).until_ms;
        };
        let last = self.last_ms?;
        let since = now_ms.saturating_sub(last);
        if since < w.prewarm_ms {
            Some(last.saturating_add(w.prewarm_ms))
        } else if since < w.keep_until_ms {
            Some(last.saturating_add(w.keep_until_ms))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::functions::predict::FixedKeepAlive;

    fn params() -> HistogramParams {
        HistogramParams {
            bin_ms: 1000,
            range_bins: 60,
            fallback_keep_ms: 5000,
            ..Default::default()
        }
    }

    #[test]
    fn falls_back_to_fixed_keep_alive_with_too_few_samples() {
        let mut h = HistogramPolicy::new(params());
        let mut f = FixedKeepAlive::new(5000);
        for i in 0..5u64 {
            h.on_arrival(i * 10_000);
            f.on_arrival(i * 10_000);
        }
        assert_eq!(h.windows(), None);
        for now in (40_000..60_000).step_by(500) {
            for warm in [false, true] {
                assert_eq!(
                    h.decide(now, warm),
                    f.decide(now, warm),
                    "now {now} warm {warm}"
                );
            }
        }
    }

    #[test]
    fn periodic_gaps_give_prewarm_and_keep_windows() {
        let mut h = HistogramPolicy::new(params());
        for i in 0..20u64 {
            h.on_arrival(i * 10_500);
        }
        // all gaps in bin 10: head edge 10 s, tail edge 11 s
        assert_eq!(
            h.windows(),
            Some(Windows {
                prewarm_ms: 9000,
                keep_until_ms: 12_100
            })
        );
        let last = 19 * 10_500;
        assert!(
            !h.decide(last + 100, true).run,
            "unloaded right after an arrival"
        );
        assert!(
            h.decide(last + 9000, false).run,
            "pre-warmed before the next"
        );
        assert!(h.decide(last + 12_000, true).run);
        assert!(!h.decide(last + 12_100, true).run);
    }

    #[test]
    fn next_wake_is_the_prewarm_instant_then_the_deadline_then_none() {
        let mut h = HistogramPolicy::new(params());
        for i in 0..20u64 {
            h.on_arrival(i * 10_500);
        }
        let last = 19 * 10_500;
        // windows 9000 .. 12_100 after the arrival (see above)
        assert_eq!(h.next_wake(last + 100, false), Some(last + 9000));
        assert_eq!(h.next_wake(last + 100, true), Some(last + 9000));
        assert_eq!(h.next_wake(last + 9000, true), Some(last + 12_100));
        // after the keep-alive window nothing changes until the next arrival
        assert_eq!(h.next_wake(last + 12_100, false), None);
        assert_eq!(h.next_wake(last + 86_400_000, false), None);
        // every change of decision is at a wake-up
        let mut now = last;
        let mut warm = false;
        let mut changes = Vec::new();
        while let Some(w) = h.next_wake(now, warm) {
            for t in now + 1..w {
                assert_eq!(h.decide(t, warm).run, warm, "unseen change at {t}");
            }
            now = w;
            let run = h.decide(now, warm).run;
            if run != warm {
                changes.push(now - last);
            }
            warm = run;
        }
        assert_eq!(changes, vec![9000, 12_100]);
    }

    #[test]
    fn fallback_wakes_only_at_the_keep_alive_deadline() {
        let mut h = HistogramPolicy::new(params());
        h.on_arrival(1000);
        assert_eq!(h.next_wake(1500, true), Some(6000));
        assert_eq!(h.next_wake(1500, false), None);
        assert_eq!(h.next_wake(6000, true), None);
    }

    #[test]
    fn spread_or_out_of_range_gaps_fall_back() {
        // evenly spread gaps: low coefficient of variation
        let mut h = HistogramPolicy::new(params());
        let mut t = 0;
        for i in 0..120u64 {
            t += (i % 60) * 1000 + 500;
            h.on_arrival(t);
        }
        assert!(h.bin_cv() < 2.0);
        assert_eq!(h.windows(), None);
        // gaps beyond the range
        let mut h = HistogramPolicy::new(params());
        for i in 0..20u64 {
            h.on_arrival(i * 100_000);
        }
        assert_eq!(h.windows(), None);
    }

    #[test]
    fn no_panic_on_odd_input() {
        let mut h = HistogramPolicy::new(HistogramParams {
            bin_ms: 0,
            range_bins: 0,
            min_samples: 0,
            margin: f64::NAN,
            min_cv: f64::NAN,
            head_pct: 500,
            tail_pct: 0,
            ..Default::default()
        });
        for at in [u64::MAX, 0, 5, u64::MAX, u64::MAX] {
            h.on_arrival(at);
            let _ = h.decide(at, true);
            let _ = h.decide(0, false);
        }
    }
}
