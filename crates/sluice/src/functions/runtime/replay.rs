//! Replays an arrival trace through the real autoscaler core ([`super::scaler::Scaler`]) on a
//! virtual clock, with virtual instances that start instantly; the benchmark uses it to
//! compare pre-warm policies "through the real autoscaler" rather than through
//! `predict::simulate`'s model of it.
//!
//! Owns: the virtual clock and instances of one replay. Does not own: any decision (all of
//! them are the scaler's) or real processes.
//!
//! # What is modelled
//! - One instance that takes any number of requests at once (`concurrency` unbounded,
//!   `max_instances = 1`, `min_instances = 0`): the predictor's question is whether the
//!   function is warm, not how many instances it needs.
//! - Each arrival takes a slot if an instance is live (starting counts: in the real runtime a
//!   request queues in the kernel backlog of a starting instance); otherwise it demands, and
//!   the instance the scaler starts is a cold start. The slot is held `service_ms` (the
//!   instance's last use is then its end); a slot of 0 ms is freed at once.
//! - The predictor hears arrivals as the shards report them: at most one per
//!   [`crate::functions::ARRIVAL_GRAIN_MS`] (the same thinning as
//!   `FunctionHandle::note_arrival`), after the arrival took its slot.
//! - Stops are instantaneous; warm instance time runs from a start to its stop (or `end_ms`).
//! - A use at 0 ms reads as "never used" (the handle's convention for `last_used_ms`), so
//!   traces are best started after 0.
//!
//! Invariants: arrivals at or after `end_ms` are ignored; the run ends at `end_ms` whatever
//! the scaler's pending wakes; every loop advances the virtual clock or consumes an input.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::scaler::{Action, Input, Scaler, ScalerConfig, Usage, View};
use crate::functions::predict::Policy;
use crate::functions::ARRIVAL_GRAIN_MS;

/// Figures of one [`replay`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Arrivals replayed (those before `end_ms`).
    pub arrivals: u64,
    /// Arrivals that found no live instance (the scaler's cold starts).
    pub cold_starts: u64,
    /// Sum over instances of the time they ran, in ms.
    pub warm_instance_ms: u64,
}

#[derive(Debug)]
struct Virtual {
    id: u64,
    started_ms: u64,
    inflight: usize,
    last_used_ms: u64,
}

struct Replay {
    scaler: Scaler,
    live: Vec<Virtual>,
    /// Slot releases: (time, instance id).
    ends: BinaryHeap<Reverse<(u64, u64)>>,
    stats: ReplayStats,
}

/// Replays `arrivals_ms` (sorted here) through the scaler with `policy` and `idle_ms`, each
/// request lasting `service_ms`, from 0 to `end_ms` (see the module docs).
pub fn replay(
    policy: Box<dyn Policy>,
    arrivals_ms: &[u64],
    service_ms: u64,
    idle_ms: u64,
    end_ms: u64,
) -> ReplayStats {
    let cfg = ScalerConfig {
        concurrency: usize::MAX,
        max_instances: 1,
        min_instances: 0,
        idle_ms,
    };
    let mut r = Replay {
        scaler: Scaler::new(cfg, Some(policy)),
        live: Vec::new(),
        ends: BinaryHeap::new(),
        stats: ReplayStats::default(),
    };
    let mut sorted: Vec<u64> = arrivals_ms
        .iter()
        .copied()
        .filter(|&a| a < end_ms)
        .collect();
    sorted.sort_unstable();
    r.input(0, Input::Wake, 0);
    let mut last_reported: u64 = 0;
    for a in sorted {
        r.advance(a);
        r.stats.arrivals += 1;
        if r.live.is_empty() {
            r.input(a, Input::Demand, 1);
        }
        r.take_slot(a, service_ms);
        if last_reported == 0 || a >= last_reported + ARRIVAL_GRAIN_MS {
            last_reported = a.max(1);
            r.input(a, Input::Arrival { at_ms: a }, 0);
        }
    }
    r.advance(end_ms);
    for v in r.live.drain(..) {
        r.stats.warm_instance_ms += end_ms.saturating_sub(v.started_ms);
    }
    r.stats
}

impl Replay {
    /// Runs every slot release and scaler wake up to and including `t`, in time order.
    fn advance(&mut self, t: u64) {
        loop {
            let wake = self.scaler.next_wake().filter(|&w| w <= t);
            let end = self
                .ends
                .peek()
                .map(|Reverse((e, _))| *e)
                .filter(|&e| e <= t);
            let release_first = match (wake, end) {
                (None, None) => return,
                (Some(w), Some(e)) => e <= w,
                (None, Some(_)) => true,
                (Some(_), None) => false,
            };
            match wake {
                Some(w) if !release_first => self.input(w, Input::Wake, 0),
                _ => self.release(),
            }
        }
    }

    fn release(&mut self) {
        if let Some(Reverse((at, id))) = self.ends.pop() {
            if let Some(v) = self.live.iter_mut().find(|v| v.id == id) {
                v.inflight -= 1;
                v.last_used_ms = at;
            }
        }
    }

    fn take_slot(&mut self, now: u64, service_ms: u64) {
        let Some(v) = self.live.first_mut() else {
            return; // the scaler started nothing (cannot happen without crashes)
        };
        v.last_used_ms = now;
        if service_ms > 0 {
            v.inflight += 1;
            self.ends.push(Reverse((now + service_ms, v.id)));
        }
    }

    /// Feeds one input (and the exits its stops cause) to the scaler and carries out its
    /// actions at `now`; `waiting` events wait for a slot.
    fn input(&mut self, now: u64, first: Input, waiting: usize) {
        let mut pending = vec![first];
        while let Some(input) = pending.pop() {
            let usage: Vec<Usage> = self
                .live
                .iter()
                .map(|v| Usage {
                    id: v.id,
                    inflight: v.inflight,
                    last_used_ms: v.last_used_ms,
                    answered: v.last_used_ms > 0,
                })
                .collect();
            let view = View {
                waiting,
                inflight: self.live.iter().map(|v| v.inflight).sum(),
                instances: &usage,
            };
            for action in self.scaler.step(now, input, &view) {
                match action {
                    Action::Start { id, cold, .. } => {
                        self.stats.cold_starts += u64::from(cold);
                        self.live.push(Virtual {
                            id,
                            started_ms: now,
                            inflight: 0,
                            last_used_ms: 0,
                        });
                    }
                    Action::Stop { id, .. } => {
                        if let Some(pos) = self.live.iter().position(|v| v.id == id) {
                            let v = self.live.remove(pos);
                            self.stats.warm_instance_ms += now.saturating_sub(v.started_ms);
                            pending.push(Input::Exited {
                                id,
                                crashed: false,
                                answered: v.last_used_ms > 0,
                            });
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::functions::predict::{simulate, AlwaysWarm, Decision, FixedKeepAlive};

    /// Bursts and gaps, every gap ≥ 1 s (so the arrival thinning changes nothing).
    fn trace() -> Vec<u64> {
        vec![
            0, 1_000, 2_000, 10_000, 11_500, 40_000, 41_000, 42_000, 43_000, 90_000,
        ]
    }

    #[test]
    fn replay_matches_simulate_for_a_fixed_keep_alive() {
        let idle = 5_000;
        let end = 120_000;
        let r = replay(Box::new(FixedKeepAlive::new(idle)), &trace(), 0, idle, end);
        let s = simulate(&mut FixedKeepAlive::new(idle), &trace(), 1, end);
        // Cold at 0, 10 000 (2 000 + 5 000 < 10 000), 40 000 and 90 000.
        assert_eq!((r.arrivals, r.cold_starts), (10, 4));
        assert_eq!((s.arrivals, s.cold_starts), (r.arrivals, r.cold_starts));
        // Warm: 0..7 000, 10 000..16 500, 40 000..48 000, 90 000..95 000.
        assert_eq!(r.warm_instance_ms, 7_000 + 6_500 + 8_000 + 5_000);
        // simulate decides at tick starts: with 1 ms ticks it is exact.
        assert_eq!(s.warm_ms, r.warm_instance_ms);
        // With 1 s ticks it keeps each instance until the tick after the deadline: the
        // difference is at most one tick per warm period, never a different cold start.
        let s = simulate(&mut FixedKeepAlive::new(idle), &trace(), 1_000, end);
        assert_eq!(s.cold_starts, r.cold_starts);
        assert!(s.warm_ms >= r.warm_instance_ms && s.warm_ms <= r.warm_instance_ms + 4 * 1_000);
    }

    #[test]
    fn replay_never_stops_a_busy_instance_and_rechecks_it_idle_later() {
        // A 2.5 s request: the policy's deadline (arrival + 1 s) passes while it runs. The
        // scaler is not told when a request ends, so it re-checks `idle` (1 s) after each
        // check that found it busy (2 000, 3 000) and stops it at 3 000. simulate takes
        // service time as zero and counts 1 s.
        let r = replay(
            Box::new(FixedKeepAlive::new(1_000)),
            &[0],
            2_500,
            1_000,
            10_000,
        );
        assert_eq!(r.cold_starts, 1);
        assert_eq!(r.warm_instance_ms, 3_000);
        let s = simulate(&mut FixedKeepAlive::new(1_000), &[0], 1, 10_000);
        assert_eq!(s.warm_ms, 1_000);
    }

    #[test]
    fn replay_always_warm_has_no_cold_start_and_runs_throughout() {
        let r = replay(Box::new(AlwaysWarm), &trace(), 10, 5_000, 100_000);
        assert_eq!(r.cold_starts, 0, "pre-warmed at 0");
        assert_eq!(r.warm_instance_ms, 100_000);
    }

    #[test]
    fn replay_survives_degenerate_input() {
        // A zero keep-alive stops the instance as soon as its request ends: both are cold.
        // The second arrival is not reported (thinned: same ms), so its instance is looked at
        // again only at the next wake, 1 ms later (wakes are strictly after `now`).
        let r = replay(Box::new(FixedKeepAlive::new(0)), &[u64::MAX, 3, 3], 0, 0, 5);
        assert_eq!((r.arrivals, r.cold_starts, r.warm_instance_ms), (2, 2, 1));
        let r = replay(Box::new(FixedKeepAlive::new(0)), &[], 0, 0, 0);
        assert_eq!(r, ReplayStats::default());
    }

    /// Expects an arrival every `period` ms: warm from 1 s before the next one to 1 s after.
    struct Periodic {
        period: u64,
        last: Option<u64>,
        announces_wakes: bool,
    }
    impl Periodic {
        fn window(&self) -> Option<(u64, u64)> {
            let last = self.last?;
            Some((last + self.period - 1_000, last + self.period + 1_000))
        }
    }
    impl Policy for Periodic {
        fn on_arrival(&mut self, at_ms: u64) {
            self.last = Some(at_ms);
        }
        fn decide(&self, now_ms: u64, _warm: bool) -> Decision {
            match self.window() {
                Some((from, until)) if (from..until).contains(&now_ms) => Decision {
                    run: true,
                    until_ms: Some(until),
                },
                _ => Decision::STOP,
            }
        }
        fn next_wake(&self, now_ms: u64, warm: bool) -> Option<u64> {
            if !self.announces_wakes {
                return (warm && self.decide(now_ms, warm).run)
                    .then(|| self.window().map(|w| w.1))
                    .flatten();
            }
            let (from, until) = self.window()?;
            [from, until].into_iter().find(|&t| t > now_ms)
        }
    }

    #[test]
    fn replay_prewarms_through_the_scaler_when_the_policy_announces_its_wake() {
        let arrivals: Vec<u64> = (0..10).map(|i| 1_000 + i * 10_000).collect();
        let policy = |announces_wakes| Periodic {
            period: 10_000,
            last: None,
            announces_wakes,
        };
        let r = replay(Box::new(policy(true)), &arrivals, 0, 500, 100_000);
        // Only the first arrival is cold; each later one finds the instance pre-warmed at
        // arrival - 1 s, stopped by the policy right after it served.
        assert_eq!((r.arrivals, r.cold_starts), (10, 1));
        assert_eq!(r.warm_instance_ms, 9 * 1_000);
        // simulate asks `decide` at every tick, so it pre-warms too; it also counts each
        // arrival's own tick warm (decided before the arrival): 1 ms more per arrival.
        let s = simulate(&mut policy(true), &arrivals, 1, 100_000);
        assert_eq!(s.cold_starts, r.cold_starts);
        assert_eq!(s.warm_ms, r.warm_instance_ms + 10);
        // The runtime sleeps until `next_wake`: a policy that keeps the default (no wake while
        // cold) is never asked in time and never pre-warms through the scaler, though
        // simulate, which polls, shows it would.
        let r = replay(Box::new(policy(false)), &arrivals, 0, 500, 100_000);
        assert_eq!(r.cold_starts, 10);
        assert_eq!(
            simulate(&mut policy(false), &arrivals, 1, 100_000).cold_starts,
            1
        );
    }
}
