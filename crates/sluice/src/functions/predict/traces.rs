//! Synthetic arrival traces for comparing pre-warm policies, and the oracle
//! bound that says how few cold starts any policy can have on a Poisson trace.
//!
//! Owns: the trace generators shared by `tests/predict_traces.rs` (which
//! asserts the target through [`super::replay`]) and the benchmark's
//! prediction part (`sluice-bench scenario functions --part predict`, which
//! replays them through the real autoscaler, `functions::runtime::replay`).
//! Does not own: any policy, engine or figure; nothing here is used by the
//! gateway at run time.
//!
//! Units: a trace is a sorted `Vec<u64>` of arrival times in ms since its
//! start (`0`), every one before the `end_ms` it was made for. Rates are
//! arrivals per minute. Every generator is deterministic in its `seed`
//! (`rand`'s `StdRng`): the same seed and `end_ms` give the same arrivals.
//!
//! The traces ([`Trace`]), at real scale (1 min, 24 h days):
//! - `periodic` ([`periodic`]): one device timer, period drawn in
//!   8..=12 min, random phase, each report jittered by ±18 s;
//! - `poisson` ([`poisson`] at [`STEADY_PER_MIN`]): 0.2 arrivals/min,
//!   memoryless: no policy can do better than keep an instance longer;
//! - `bursty` ([`bursty_rate`]): Poisson at 2/min for 30 min, then 120 min
//!   of silence, repeating from 0;
//! - `diurnal-poisson` ([`diurnal_rate`]): Poisson at `max(0, sin(2π t /
//!   day))` per min (peak 1/min at 06:00; memoryless at every instant; night
//!   is silent);
//! - `diurnal-timers` ([`diurnal_timers`], the IoT-realistic diurnal trace):
//!   three devices on timers whose period follows the time of day (10 min
//!   07:00-19:00, 30 min otherwise), one of which reports only 08:00-18:00,
//!   clocks skewed by up to ±0.1 %, each report jittered by ±10 s.
//!
//! [`OracleBound`]: on Poisson arrivals, whatever a policy knows of the
//! past, an instant `t` is warm with some probability `p(t)` independent of
//! whether an arrival comes at `t`; expected cold starts are `∫ (1 - p) λ`
//! and expected warm time `∫ p`. For a warm-time budget `B` the least
//! expected cold starts are had by warming the `B` instants of highest rate:
//! an oracle that knows the rate exactly.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One second, ms.
pub const SEC: u64 = 1000;
/// One minute, ms.
pub const MIN: u64 = 60 * SEC;
/// One hour, ms.
pub const HOUR: u64 = 60 * MIN;
/// One day, ms.
pub const DAY: u64 = 24 * HOUR;
/// The rate of the `poisson` trace, arrivals per minute.
pub const STEADY_PER_MIN: f64 = 0.2;

/// The rate of a Poisson trace.
#[derive(Debug, Clone, Copy)]
pub struct PoissonRate {
    /// The highest rate, arrivals per minute (the thinning's proposal rate).
    pub peak_per_min: f64,
    /// The rate at `t` ms, arrivals per minute.
    pub per_min_at: fn(u64) -> f64,
}

/// The synthetic traces, by name (see the module doc for what each models).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trace {
    Periodic,
    Poisson,
    Bursty,
    DiurnalPoisson,
    DiurnalTimers,
}

impl Trace {
    /// Every trace, in the order reports list them.
    pub const ALL: [Trace; 5] = [
        Trace::Periodic,
        Trace::Poisson,
        Trace::Bursty,
        Trace::DiurnalPoisson,
        Trace::DiurnalTimers,
    ];

    /// The name reports print.
    pub fn name(self) -> &'static str {
        match self {
            Trace::Periodic => "periodic",
            Trace::Poisson => "poisson",
            Trace::Bursty => "bursty",
            Trace::DiurnalPoisson => "diurnal-poisson",
            Trace::DiurnalTimers => "diurnal-timers",
        }
    }

    /// The trace's arrivals in `[0, end_ms)` for `seed`.
    pub fn generate(self, seed: u64, end_ms: u64) -> Vec<u64> {
        match self {
            Trace::Periodic => periodic(seed, end_ms),
            Trace::DiurnalTimers => diurnal_timers(seed, end_ms),
            poisson_trace => {
                let r = poisson_trace
                    .poisson_rate()
                    .expect("every other trace is Poisson");
                poisson(seed, end_ms, r.peak_per_min, r.per_min_at)
            }
        }
    }

    /// For a Poisson trace, its rate (`per_min_at` is what
    /// [`OracleBound::new`] takes). `None` for the timer traces.
    pub fn poisson_rate(self) -> Option<PoissonRate> {
        let (peak_per_min, per_min_at): (f64, fn(u64) -> f64) = match self {
            Trace::Poisson => (STEADY_PER_MIN, steady_rate),
            Trace::Bursty => (2.0, bursty_rate),
            Trace::DiurnalPoisson => (1.0, diurnal_rate),
            Trace::Periodic | Trace::DiurnalTimers => return None,
        };
        Some(PoissonRate {
            peak_per_min,
            per_min_at,
        })
    }
}

/// `t` moved by up to `by` either way (not below 0).
fn jitter(rng: &mut StdRng, t: u64, by: u64) -> u64 {
    (t + rng.gen_range(0..=2 * by)).saturating_sub(by)
}

/// One timer: period drawn in 8..=12 min, random phase, each report
/// jittered by ±18 s.
pub fn periodic(seed: u64, end_ms: u64) -> Vec<u64> {
    let rng = &mut StdRng::seed_from_u64(seed);
    let period = rng.gen_range(8 * MIN..=12 * MIN);
    let mut t = rng.gen_range(0..period);
    let mut out = Vec::new();
    while t < end_ms {
        out.push(jitter(rng, t, 18 * SEC));
        t += period;
    }
    out
}

/// Poisson arrivals at `rate(t)` per minute, at most `peak`, by thinning.
pub fn poisson(seed: u64, end_ms: u64, peak: f64, rate: impl Fn(u64) -> f64) -> Vec<u64> {
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut t = 0.0;
    loop {
        let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
        t += -u.ln() / peak * MIN as f64;
        if t >= end_ms as f64 {
            return out;
        }
        if rng.gen_range(0.0..1.0) * peak < rate(t as u64) {
            out.push(t as u64);
        }
    }
}

/// The `poisson` trace's rate: [`STEADY_PER_MIN`] at every instant.
pub fn steady_rate(_t: u64) -> f64 {
    STEADY_PER_MIN
}

/// The `bursty` trace's rate: 2/min for the first 30 min of every 150.
pub fn bursty_rate(t: u64) -> f64 {
    if t % (150 * MIN) < 30 * MIN {
        2.0
    } else {
        0.0
    }
}

/// The `diurnal-poisson` trace's rate: `max(0, sin(2π t / day))` per min.
pub fn diurnal_rate(t: u64) -> f64 {
    let x = 2.0 * std::f64::consts::PI * (t % DAY) as f64 / DAY as f64;
    x.sin().max(0.0)
}

/// Three device timers whose period follows the day (10 min 07:00-19:00, 30
/// min otherwise), the third reporting only 08:00-18:00, clocks skewed by up
/// to ±0.1 %, each report jittered by ±10 s.
pub fn diurnal_timers(seed: u64, end_ms: u64) -> Vec<u64> {
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for device in 0..3 {
        let skew = rng.gen_range(0.999..1.001);
        let mut t = rng.gen_range(0..10 * MIN) as f64;
        while t < end_ms as f64 {
            let hour = (t as u64 % DAY) / HOUR;
            if device != 2 || (8..18).contains(&hour) {
                out.push(jitter(rng, t as u64, 10 * SEC));
            }
            let period = if (7..19).contains(&hour) { 10 } else { 30 };
            t += (period * MIN) as f64 * skew;
        }
    }
    out.sort_unstable();
    out
}

/// Least expected cold starts of any policy warm for a given time, on
/// Poisson arrivals at a known rate over `[0, end_ms)`: warm the instants of
/// highest rate (see the module doc).
#[derive(Debug, Clone)]
pub struct OracleBound {
    /// Expected arrivals of each 1 s slot, highest first, summed from the
    /// lowest up: `tail[k]` is the expected arrivals of all but the top `k`.
    tail: Vec<f64>,
}

impl OracleBound {
    /// The bound for arrivals at `rate(t)` per minute (`t` in ms) until `end_ms`.
    pub fn new(rate: impl Fn(u64) -> f64, end_ms: u64) -> OracleBound {
        let mut slots: Vec<f64> = (0..end_ms / SEC)
            .map(|s| rate(s * SEC + SEC / 2) / 60.0)
            .collect();
        slots.sort_by(|a, b| b.total_cmp(a));
        let mut tail = vec![0.0; slots.len() + 1];
        for k in (0..slots.len()).rev() {
            tail[k] = tail[k + 1] + slots[k];
        }
        OracleBound { tail }
    }

    /// The least expected cold starts of a policy warm for `budget_ms`.
    pub fn cold_starts_at(&self, budget_ms: u64) -> f64 {
        let k = usize::try_from(budget_ms / SEC).unwrap_or(usize::MAX);
        self.tail[k.min(self.tail.len() - 1)]
    }

    /// Whether the target against a fixed keep-alive that had
    /// `fixed_cold_starts` in `fixed_warm_ms` (at most `fixed / 4` cold
    /// starts with no more warm time) asks for fewer cold starts than the
    /// oracle's expectation at that warm time, by more than 4 standard
    /// deviations of its Poisson count: beyond the reach of any policy.
    pub fn target_beyond_any_policy(&self, fixed_cold_starts: u64, fixed_warm_ms: u64) -> bool {
        let at_fixed = self.cold_starts_at(fixed_warm_ms);
        (fixed_cold_starts / 4) as f64 + 4.0 * at_fixed.sqrt() < at_fixed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_trace_is_seeded_sorted_and_inside_its_end() {
        for trace in Trace::ALL {
            let a = trace.generate(19, 3 * DAY);
            assert_eq!(a, trace.generate(19, 3 * DAY), "{trace:?}");
            assert_ne!(a, trace.generate(20, 3 * DAY), "{trace:?}");
            assert!(!a.is_empty() && a.iter().all(|&t| t < 3 * DAY), "{trace:?}");
            assert!(a.windows(2).all(|w| w[0] <= w[1]), "{trace:?}");
        }
    }

    #[test]
    fn the_oracle_bound_falls_with_warm_time() {
        let b = OracleBound::new(steady_rate, DAY);
        // 0.2/min for a day: 288 expected arrivals, all cold with no warm time
        assert!((b.cold_starts_at(0) - 288.0).abs() < 1e-6);
        assert!((b.cold_starts_at(DAY / 2) - 144.0).abs() < 1e-6);
        assert_eq!(b.cold_starts_at(2 * DAY), 0.0);
    }
}
