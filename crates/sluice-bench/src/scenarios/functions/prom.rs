//! sluice's `/metrics` as the `functions` scenario reads it: one series by labels, and the
//! `sluice_function_*_seconds` histograms (cumulative `_bucket{le=…}` lines, `_sum`,
//! `_count`) with the difference of two readings and its quantiles.
//!
//! Owns: parsing the Prometheus text exposition sluice writes (`name{l="v",…} value`, one
//! sample a line) and [`Buckets`]. Does not own: fetching it
//! ([`crate::harness::metrics`]).
//!
//! Quantiles of a fixed-bucket histogram are only known to a bucket: [`Buckets::quantile`]
//! answers the upper bound of the bucket holding it (`≤ x`), never an interpolated guess;
//! `_sum / _count` gives the exact mean.

use serde::Serialize;

/// The value of the first sample of `name` whose labels contain every `label="value"` pair in
/// `labels` (`None` if there is none).
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (label_text, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let (l, v) = r.split_once('}')?;
                (l, v)
            }
            None if rest.starts_with(' ') => ("", rest),
            None => return None,
        };
        labels
            .iter()
            .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.trim().parse().ok())?
    })
}

/// One histogram's reading: cumulative counts per upper bound (seconds, `+Inf` last), sum in
/// seconds and count.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Buckets {
    pub bounds: Vec<f64>,
    pub cumulative: Vec<u64>,
    pub sum_s: f64,
    pub count: u64,
}

impl Buckets {
    /// Read histogram `name` (the series whose labels contain `labels`) from `text`.
    pub fn read(text: &str, name: &str, labels: &[(&str, &str)]) -> Buckets {
        let bucket = format!("{name}_bucket{{");
        let mut out = Buckets::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(&bucket) else {
                continue;
            };
            let Some((label_text, value)) = rest.split_once('}') else {
                continue;
            };
            if !labels
                .iter()
                .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")))
            {
                continue;
            }
            let Some(le) = label_text
                .split(',')
                .find_map(|kv| kv.trim().strip_prefix("le=\""))
                .and_then(|v| v.strip_suffix('"'))
            else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                match le.parse() {
                    Ok(b) => b,
                    Err(_) => continue,
                }
            };
            if let Ok(c) = value.trim().parse::<f64>() {
                out.bounds.push(bound);
                out.cumulative.push(c as u64);
            }
        }
        out.sum_s = sample(text, &format!("{name}_sum"), labels).unwrap_or(0.0);
        out.count = sample(text, &format!("{name}_count"), labels).unwrap_or(0.0) as u64;
        out
    }

    /// What was recorded between `earlier` and `self` (same bounds).
    pub fn since(&self, earlier: &Buckets) -> Buckets {
        Buckets {
            bounds: self.bounds.clone(),
            cumulative: self
                .cumulative
                .iter()
                .enumerate()
                .map(|(i, c)| c.saturating_sub(earlier.cumulative.get(i).copied().unwrap_or(0)))
                .collect(),
            sum_s: (self.sum_s - earlier.sum_s).max(0.0),
            count: self.count.saturating_sub(earlier.count),
        }
    }

    /// The upper bound (seconds) of the bucket holding quantile `q` (0..1); `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = *self.cumulative.last()?;
        if total == 0 {
            return None;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        self.cumulative
            .iter()
            .position(|&c| c >= rank)
            .map(|i| self.bounds[i])
    }

    /// The exact mean in seconds (`_sum / _count`).
    pub fn mean_s(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_s / self.count as f64)
    }

    /// Share of observations at or below `bound_s` (a bucket bound), 0..1.
    pub fn share_at_most(&self, bound_s: f64) -> Option<f64> {
        let total = *self.cumulative.last()?;
        let i = self.bounds.iter().position(|&b| b >= bound_s)?;
        (total > 0).then(|| self.cumulative[i] as f64 / total as f64)
    }
}

/// A histogram's difference summarised for a report (milliseconds; quantiles as bucket
/// upper bounds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketSummary {
    pub count: u64,
    pub mean_ms: Option<f64>,
    /// Upper bound of the bucket holding the median.
    pub p50_le_ms: Option<f64>,
    /// Upper bound of the bucket holding the 99th percentile.
    pub p99_le_ms: Option<f64>,
}

impl From<&Buckets> for BucketSummary {
    fn from(b: &Buckets) -> BucketSummary {
        BucketSummary {
            count: b.count,
            mean_ms: b.mean_s().map(|s| s * 1e3),
            p50_le_ms: b.quantile(0.5).map(|s| s * 1e3),
            p99_le_ms: b.quantile(0.99).map(|s| s * 1e3),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE sluice_function_invocations_total counter
sluice_function_invocations_total{function=\"echo\",outcome=\"ok\"} 1500
sluice_function_invocations_total{function=\"echo\",outcome=\"timeout\"} 2
sluice_function_instances{function=\"echo\",state=\"running\"} 1
sluice_function_dispatch_seconds_bucket{function=\"echo\",le=\"0.0001\"} 10
sluice_function_dispatch_seconds_bucket{function=\"echo\",le=\"0.00025\"} 90
sluice_function_dispatch_seconds_bucket{function=\"echo\",le=\"0.001\"} 99
sluice_function_dispatch_seconds_bucket{function=\"echo\",le=\"+Inf\"} 100
sluice_function_dispatch_seconds_sum{function=\"echo\"} 0.02
sluice_function_dispatch_seconds_count{function=\"echo\"} 100
";

    #[test]
    fn a_series_is_found_by_its_labels() {
        let ok = sample(
            TEXT,
            "sluice_function_invocations_total",
            &[("outcome", "ok")],
        );
        assert_eq!(ok, Some(1500.0));
        let running = sample(TEXT, "sluice_function_instances", &[("state", "running")]);
        assert_eq!(running, Some(1.0));
        assert_eq!(
            sample(TEXT, "sluice_function_instances", &[("state", "starting")]),
            None
        );
        assert_eq!(
            sample(TEXT, "sluice_function_invocations", &[]),
            None,
            "a prefix is not a name"
        );
    }

    #[test]
    fn histogram_quantiles_are_bucket_upper_bounds_of_the_difference() {
        let b = Buckets::read(
            TEXT,
            "sluice_function_dispatch_seconds",
            &[("function", "echo")],
        );
        assert_eq!(b.cumulative, vec![10, 90, 99, 100]);
        assert_eq!(b.count, 100);
        assert_eq!(b.quantile(0.5), Some(0.00025));
        assert_eq!(b.quantile(0.99), Some(0.001));
        assert_eq!(b.quantile(1.0), Some(f64::INFINITY));
        assert!((b.mean_s().unwrap() - 0.0002).abs() < 1e-12);
        let earlier = Buckets {
            bounds: b.bounds.clone(),
            cumulative: vec![10, 80, 80, 80],
            sum_s: 0.01,
            count: 80,
        };
        let d = b.since(&earlier);
        assert_eq!(d.cumulative, vec![0, 10, 19, 20]);
        assert_eq!(d.quantile(0.5), Some(0.00025));
        assert_eq!(d.quantile(0.9), Some(0.001));
        assert_eq!(d.share_at_most(0.00025), Some(0.5));
        assert_eq!(Buckets::default().quantile(0.5), None);
    }
}
