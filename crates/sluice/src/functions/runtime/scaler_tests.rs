//! Unit tests of the scaler core (`super`): demand, idle deadlines, scale-down order,
//! crash backoff, and the predictor's pre-warm, keep and stop.

use super::*;
use crate::functions::predict::FixedKeepAlive;

fn cfg(concurrency: usize, max: usize, min: usize, idle_ms: u64) -> ScalerConfig {
    ScalerConfig {
        concurrency,
        max_instances: max,
        min_instances: min,
        idle_ms,
    }
}

fn starts(a: &[Action]) -> Vec<u64> {
    a.iter()
        .filter_map(|a| match a {
            Action::Start { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

fn stops(a: &[Action]) -> Vec<u64> {
    a.iter()
        .filter_map(|a| match a {
            Action::Stop { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

fn idle(ids: &[u64], last_used_ms: u64) -> Vec<Usage> {
    ids.iter()
        .map(|&id| Usage {
            id,
            last_used_ms,
            ..Usage::default()
        })
        .collect()
}

#[test]
fn a_demand_starts_ceil_of_load_over_concurrency_clamped_to_max() {
    let mut s = Scaler::new(cfg(4, 3, 0, 1000), None);
    let v = View {
        waiting: 9,
        inflight: 0,
        instances: &[],
    };
    let a = s.step(0, Input::Demand, &v);
    assert_eq!(starts(&a), vec![1, 2, 3], "ceil(9 / 4) = 3");
    assert!(matches!(a[0], Action::Start { cold: true, .. }));
    assert!(
        matches!(a[1], Action::Start { cold: false, .. }),
        "one cold start per demand"
    );
    let a = s.step(1, Input::Demand, &v);
    assert!(starts(&a).is_empty(), "already at the target");
    let mut s = Scaler::new(cfg(4, 10, 0, 1000), None);
    let v = View {
        waiting: 100,
        inflight: 0,
        instances: &[],
    };
    assert_eq!(
        starts(&s.step(0, Input::Demand, &v)).len(),
        10,
        "clamped to max"
    );
    let mut s = Scaler::new(cfg(4, 3, 0, 1000), None);
    let a = s.step(0, Input::Demand, &View::default());
    assert_eq!(
        starts(&a),
        vec![1],
        "a demand starts one even with no load read yet"
    );
}

#[test]
fn a_demand_with_a_live_instance_is_no_cold_start() {
    let mut s = Scaler::new(cfg(1, 3, 0, 1000), None);
    s.step(0, Input::Demand, &View::default());
    let u = [Usage {
        id: 1,
        inflight: 1,
        last_used_ms: 5,
        answered: true,
    }];
    let v = View {
        waiting: 1,
        inflight: 1,
        instances: &u,
    };
    let a = s.step(10, Input::Demand, &v);
    assert_eq!(
        a,
        vec![Action::Start {
            id: 2,
            prewarmed: false,
            cold: false
        }]
    );
}

#[test]
fn an_idle_instance_is_stopped_at_its_exact_deadline_and_then_nothing_wakes() {
    let mut s = Scaler::new(cfg(1, 2, 0, 300), None);
    s.step(0, Input::Demand, &View::default());
    assert_eq!(
        s.next_wake(),
        Some(300),
        "armed by the step that started it"
    );
    let u = idle(&[1], 0);
    let v = View {
        instances: &u,
        ..View::default()
    };
    assert!(s.step(1, Input::Wake, &v).is_empty());
    assert_eq!(s.next_wake(), Some(300), "never used: its start + idle");
    let u = idle(&[1], 120);
    let v = View {
        instances: &u,
        ..View::default()
    };
    assert!(
        s.step(300, Input::Wake, &v).is_empty(),
        "used at 120: not yet"
    );
    assert_eq!(
        s.next_wake(),
        Some(420),
        "re-armed from the stored last use"
    );
    let a = s.step(420, Input::Wake, &v);
    assert_eq!(
        a,
        vec![Action::Stop {
            id: 1,
            reason: StopReason::Idle
        }]
    );
    assert_eq!(s.next_wake(), None);
    let a = s.step(
        430,
        Input::Exited {
            id: 1,
            crashed: false,
            answered: true,
        },
        &View::default(),
    );
    assert!(a.is_empty());
    assert_eq!(
        s.next_wake(),
        None,
        "no instance, no predictor: nothing wakes"
    );
    assert_eq!(s.backoff().hold_until_ms, 0, "a stop is no crash");
}

/// Found by issue 29's `socket = "auto"` test: a `$PORT` function whose start took longer
/// than `idle` was stopped the moment it became ready, while its event waited, and started
/// again, forever.
#[test]
fn an_instance_that_became_ready_after_idle_is_not_stopped_while_events_wait() {
    let mut s = Scaler::new(cfg(4, 1, 0, 300), None);
    let v = View {
        waiting: 1,
        inflight: 0,
        instances: &[],
    };
    assert_eq!(starts(&s.step(0, Input::Demand, &v)), vec![1]);
    let ready = idle(&[1], 0);
    let v = View {
        waiting: 1,
        inflight: 0,
        instances: &ready,
    };
    let a = s.step(500, Input::Wake, &v);
    assert!(stops(&a).is_empty(), "stopped as it became ready: {a:?}");
    assert!(
        s.next_wake().is_some_and(|w| w >= 800),
        "re-checked idle later"
    );
    // Once the event is gone and the instance still never answered, idle applies again.
    let v = View {
        waiting: 0,
        inflight: 0,
        instances: &ready,
    };
    assert_eq!(stops(&s.step(800, Input::Wake, &v)), vec![1]);
}

#[test]
fn a_busy_instance_is_rechecked_idle_later_and_never_stopped_busy() {
    let mut s = Scaler::new(cfg(1, 2, 0, 300), None);
    s.step(0, Input::Demand, &View::default());
    let u = [Usage {
        id: 1,
        inflight: 1,
        last_used_ms: 10,
        answered: false,
    }];
    let v = View {
        inflight: 1,
        instances: &u,
        ..View::default()
    };
    assert!(s.step(400, Input::Wake, &v).is_empty());
    assert_eq!(s.next_wake(), Some(700));
}

#[test]
fn scale_down_goes_newest_first_down_to_min_instances() {
    let mut s = Scaler::new(cfg(1, 3, 1, 100), None);
    let a = s.step(0, Input::Wake, &View::default());
    assert_eq!(starts(&a), vec![1], "min_instances start at once");
    assert!(!matches!(a[0], Action::Start { cold: true, .. }));
    let v = View {
        waiting: 2,
        inflight: 1,
        ..View::default()
    };
    assert_eq!(starts(&s.step(1, Input::Demand, &v)), vec![2, 3]);
    let u = idle(&[1, 2, 3], 50);
    let v = View {
        instances: &u,
        ..View::default()
    };
    let a = s.step(150, Input::Wake, &v);
    assert_eq!(
        stops(&a),
        vec![3, 2],
        "newest first, instance 1 stays (min 1)"
    );
    assert_eq!(s.next_wake(), None, "at the floor: nothing to wake for");
}

#[test]
fn crashes_hold_starts_with_a_doubling_capped_backoff_that_resets_when_healthy() {
    let mut s = Scaler::new(cfg(1, 1, 1, 100), None);
    let mut now = 0;
    assert_eq!(starts(&s.step(now, Input::Wake, &View::default())), vec![1]);
    let mut delays = Vec::new();
    for id in 1..=12u64 {
        now += 5;
        let a = s.step(
            now,
            Input::Exited {
                id,
                crashed: true,
                answered: false,
            },
            &View::default(),
        );
        assert!(a.is_empty(), "no restart before the hold ends");
        let hold = s.next_wake().unwrap();
        delays.push(hold - now);
        now = hold;
        assert_eq!(
            starts(&s.step(now, Input::Wake, &View::default())),
            vec![id + 1]
        );
    }
    assert_eq!(
        delays,
        [100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000]
    );
    assert_eq!(s.backoff().consecutive_crashes, 12);
    // Instance 13 answers: the next crash waits the minimum again.
    let u = [Usage {
        id: 13,
        answered: true,
        ..Usage::default()
    }];
    let v = View {
        instances: &u,
        ..View::default()
    };
    s.step(now + 1, Input::Wake, &v);
    assert_eq!(s.backoff().consecutive_crashes, 0);
    s.step(
        now + 2,
        Input::Exited {
            id: 13,
            crashed: true,
            answered: true,
        },
        &View::default(),
    );
    assert_eq!(s.next_wake(), Some(now + 2 + 100));
}

#[test]
fn a_demand_during_the_hold_is_served_when_it_ends() {
    let mut s = Scaler::new(cfg(1, 1, 0, 100), None);
    s.step(0, Input::Demand, &View::default());
    let crash = Input::Exited {
        id: 1,
        crashed: true,
        answered: false,
    };
    assert!(s.step(1, crash, &View::default()).is_empty());
    assert_eq!(s.next_wake(), None, "nobody waits: no restart");
    assert!(s.step(50, Input::Demand, &View::default()).is_empty());
    assert_eq!(s.next_wake(), Some(101));
    let a = s.step(101, Input::Wake, &View::default());
    assert_eq!(starts(&a), vec![2]);
    assert!(matches!(a[0], Action::Start { cold: true, .. }));
}

#[test]
fn an_instance_that_lived_ten_seconds_resets_the_backoff() {
    let mut s = Scaler::new(cfg(1, 1, 1, 100), None);
    s.step(0, Input::Wake, &View::default());
    for (id, at) in [(1, 1), (2, 200)] {
        s.step(
            at,
            Input::Exited {
                id,
                crashed: true,
                answered: false,
            },
            &View::default(),
        );
        let w = s.next_wake().unwrap();
        s.step(w, Input::Wake, &View::default());
    }
    assert_eq!(s.backoff().next_delay_ms, 400);
    s.step(
        50_000,
        Input::Exited {
            id: 3,
            crashed: true,
            answered: false,
        },
        &View::default(),
    );
    assert_eq!(s.next_wake(), Some(50_100), "it lived long: minimum hold");
}

/// Pre-warms when the policy says so and stops after its deadline.
struct Scripted {
    run_from: u64,
    run_until: u64,
}
impl Policy for Scripted {
    fn on_arrival(&mut self, _at_ms: u64) {}
    fn decide(&self, now_ms: u64, _warm: bool) -> Decision {
        if (self.run_from..self.run_until).contains(&now_ms) {
            Decision {
                run: true,
                until_ms: Some(self.run_until),
            }
        } else {
            Decision::STOP
        }
    }
    fn next_wake(&self, now_ms: u64, _warm: bool) -> Option<u64> {
        [self.run_from, self.run_until]
            .into_iter()
            .find(|&t| t > now_ms)
    }
}

#[test]
fn the_predictor_prewarms_keeps_until_its_deadline_then_stops() {
    let p = Scripted {
        run_from: 1000,
        run_until: 5000,
    };
    let mut s = Scaler::new(cfg(1, 2, 0, 300), Some(Box::new(p)));
    assert!(s.step(0, Input::Wake, &View::default()).is_empty());
    assert_eq!(s.next_wake(), Some(1000));
    let a = s.step(1000, Input::Wake, &View::default());
    assert_eq!(
        a,
        vec![Action::Start {
            id: 1,
            prewarmed: true,
            cold: false
        }]
    );
    assert_eq!(
        s.next_wake(),
        Some(5000),
        "kept past idle (300 ms) by the policy"
    );
    let u = idle(&[1], 0);
    let v = View {
        instances: &u,
        ..View::default()
    };
    assert!(s.step(2000, Input::Wake, &v).is_empty());
    let a = s.step(5000, Input::Wake, &v);
    assert_eq!(
        a,
        vec![Action::Stop {
            id: 1,
            reason: StopReason::Predictor
        }]
    );
}

#[test]
fn the_predictor_never_stops_busy_or_unserved_demand_instances() {
    let p = Scripted {
        run_from: u64::MAX,
        run_until: u64::MAX,
    };
    let mut s = Scaler::new(cfg(1, 2, 0, 300), Some(Box::new(p)));
    s.step(0, Input::Demand, &View::default());
    let u = idle(&[1], 0);
    let v = View {
        instances: &u,
        ..View::default()
    };
    assert!(
        s.step(10, Input::Wake, &v).is_empty(),
        "demand-started, not used yet: waits for idle"
    );
    let u = [Usage {
        id: 1,
        inflight: 1,
        last_used_ms: 20,
        answered: false,
    }];
    let v = View {
        inflight: 1,
        instances: &u,
        ..View::default()
    };
    assert!(s.step(30, Input::Wake, &v).is_empty(), "busy");
    let u = idle(&[1], 40);
    let v = View {
        instances: &u,
        ..View::default()
    };
    assert_eq!(
        stops(&s.step(50, Input::Wake, &v)),
        vec![1],
        "served and idle: stop"
    );
}

#[test]
fn a_fixed_keep_alive_policy_keeps_the_last_instance_until_its_deadline() {
    let mut s = Scaler::new(cfg(1, 2, 0, 300), Some(Box::new(FixedKeepAlive::new(300))));
    s.step(0, Input::Demand, &View::default());
    let u = idle(&[1], 0);
    let v = View {
        instances: &u,
        ..View::default()
    };
    s.step(0, Input::Arrival { at_ms: 0 }, &v);
    assert_eq!(s.next_wake(), Some(300));
    assert_eq!(stops(&s.step(300, Input::Wake, &v)), vec![1]);
    assert_eq!(
        s.next_wake(),
        None,
        "a keep-alive policy never pre-warms: no wake"
    );
}
