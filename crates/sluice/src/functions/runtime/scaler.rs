//! The autoscaler of one local function, sans-IO: events and `now` in, actions and the next
//! wake time out (the shape of quinn-proto). It owns no process, socket, clock or channel; the
//! runtime thread (`shell`) and [`super::replay`] drive the same code, one with the real clock
//! and processes, the other with a virtual clock and virtual instances.
//!
//! Owns: which instances should exist (starts and stops), idle deadlines, the predictor
//! (`predict::Policy`) of a function with `prewarm != off`, and the restart backoff after
//! crashes. Does not own: how an instance is started or stopped, metrics, logs, or reading the
//! shared handle — the caller passes what it read as a [`View`] and carries out [`Action`]s.
//!
//! # Model (Knative's concurrency model, measured where requests pass)
//! - Load = requests in flight + events waiting for a slot. On a demand (or while events
//!   wait) the scaler wants `ceil(load / concurrency)` instances, clamped to
//!   `[1, max_instances]`, and never fewer than `min_instances`.
//! - An instance with nothing in flight is stopped `idle` after its last use (its start when
//!   never used), newest first, down to `min_instances` — but not one that never answered
//!   while events wait (it only just became ready: its start took longer than `idle`). Its wake-up is armed at that exact
//!   deadline and re-armed from the stored last use when it fires; an instance busy at a check
//!   is re-checked `idle` later (it cannot become stoppable before). With no instance above
//!   the floor and no predictor deadline, [`Scaler::next_wake`] is `None`: nothing wakes.
//! - Predictor (`prewarm != off`): arrivals feed `Policy::on_arrival`; at each step the scaler
//!   asks `decide(now, warm)`: `run` with nothing live starts a pre-warmed instance; `run`
//!   keeps the last instance above `min_instances` (its deadline is the policy's `until_ms`,
//!   reached by `Policy::next_wake`; a `run` without `until_ms`, as `AlwaysWarm` gives, keeps
//!   it with no deadline rather than stopping it after `idle` only to pre-warm it again at
//!   once; excess capacity still goes after `idle`); not `run` stops idle
//!   instances at once (never below `min_instances`, never with requests in flight or events
//!   waiting, never a demand-started instance that has not served yet).
//! - Crashes: an instance that exits on its own holds back every start (demand, floor,
//!   pre-warm) for a backoff of 100 ms doubling to 30 s; the backoff resets once an instance
//!   has answered or lived 10 s. A demand that comes during the hold is remembered and served
//!   when it ends: no busy restart loop, and no lost demand.
//!
//! # Invariants
//! - Every wake time returned is strictly after the `now` of the step that returned it.
//! - Instance ids are unique per scaler, from 1 (0 is a remote function's pseudo-instance).
//! - An instance leaves the scaler only through [`Input::Exited`]; a stopped one counts no
//!   more as live (capacity) but stays tracked until then.

use crate::config::FunctionConfig;
use crate::functions::predict::{Decision, Policy};

/// First restart delay after a crash.
pub const RESTART_BACKOFF_MIN_MS: u64 = 100;
/// Longest restart delay.
pub const RESTART_BACKOFF_MAX_MS: u64 = 30_000;
/// An instance alive this long (or that answered) resets the backoff.
pub const HEALTHY_AFTER_MS: u64 = 10_000;

/// What the scaler needs of a function's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScalerConfig {
    /// Requests in flight per instance (≥ 1).
    pub concurrency: usize,
    /// Most instances at once (≥ 1).
    pub max_instances: usize,
    /// Instances kept even without load.
    pub min_instances: usize,
    /// An unused instance is stopped this long after its last use.
    pub idle_ms: u64,
}

impl ScalerConfig {
    pub fn of(cfg: &FunctionConfig) -> ScalerConfig {
        ScalerConfig {
            concurrency: cfg.concurrency,
            max_instances: cfg.max_instances,
            min_instances: cfg.min_instances,
            idle_ms: u64::try_from(cfg.idle.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A dispatcher found no instance with room.
    Demand,
    /// Events arrived at `at_ms` (for the predictor).
    Arrival { at_ms: u64 },
    /// The wake time asked for has come (or any other reason to look again).
    Wake,
    /// Instance `id` is gone. `crashed`: it exited on its own (or never came up) rather than
    /// being stopped; `answered`: it had answered a request.
    Exited {
        id: u64,
        crashed: bool,
        answered: bool,
    },
}

/// One live instance as the caller reads it from the shared handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub id: u64,
    pub inflight: usize,
    /// Last request start or end (0: never used), on the scaler's clock.
    pub last_used_ms: u64,
    pub answered: bool,
}

/// The load as the caller reads it now.
#[derive(Debug, Clone, Copy, Default)]
pub struct View<'a> {
    /// Events waiting for a slot.
    pub waiting: usize,
    /// Requests in flight on every instance.
    pub inflight: usize,
    /// The instances the scaler started and has not heard exit (any order).
    pub instances: &'a [Usage],
}

/// What the caller must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Start instance `id`. `cold`: an event found no live instance (a cold start).
    Start {
        id: u64,
        prewarmed: bool,
        cold: bool,
    },
    /// Take instance `id` out of rotation, let its requests finish, stop it; then report
    /// [`Input::Exited`].
    Stop { id: u64, reason: StopReason },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// Unused for `idle`.
    Idle,
    /// The predictor expects no event soon.
    Predictor,
}

/// The restart backoff, as status shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Crashes since the last healthy instance.
    pub consecutive_crashes: u32,
    /// The hold after the next crash.
    pub next_delay_ms: u64,
    /// No start before this (scaler clock).
    pub hold_until_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            consecutive_crashes: 0,
            next_delay_ms: RESTART_BACKOFF_MIN_MS,
            hold_until_ms: 0,
        }
    }
}

impl Backoff {
    fn on_crash(&mut self, now_ms: u64, healthy: bool) {
        if healthy {
            self.reset();
        }
        let delay = self.next_delay_ms;
        self.hold_until_ms = now_ms.saturating_add(delay);
        self.next_delay_ms = delay.saturating_mul(2).min(RESTART_BACKOFF_MAX_MS);
        self.consecutive_crashes = self.consecutive_crashes.saturating_add(1);
    }
    fn reset(&mut self) {
        self.consecutive_crashes = 0;
        self.next_delay_ms = RESTART_BACKOFF_MIN_MS;
    }
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    id: u64,
    started_ms: u64,
    prewarmed: bool,
    stopping: bool,
}

/// The autoscaler of one function (see the module docs).
pub struct Scaler {
    cfg: ScalerConfig,
    policy: Option<Box<dyn Policy>>,
    /// In start order (oldest first: dispatchers pack load onto the oldest).
    instances: Vec<Tracked>,
    next_id: u64,
    /// A demand not yet served (held back by the crash backoff).
    demand_pending: bool,
    backoff: Backoff,
    wake_ms: Option<u64>,
}

impl std::fmt::Debug for Scaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scaler")
            .field("cfg", &self.cfg)
            .field("predictor", &self.policy.is_some())
            .field("instances", &self.instances)
            .field("demand_pending", &self.demand_pending)
            .field("backoff", &self.backoff)
            .field("wake_ms", &self.wake_ms)
            .finish()
    }
}

impl Scaler {
    /// A scaler with no instance; `policy` for `prewarm != off`. Call [`Scaler::step`] with
    /// [`Input::Wake`] once to start `min_instances`.
    pub fn new(mut cfg: ScalerConfig, policy: Option<Box<dyn Policy>>) -> Scaler {
        cfg.concurrency = cfg.concurrency.max(1);
        cfg.max_instances = cfg.max_instances.max(1).max(cfg.min_instances);
        Scaler {
            cfg,
            policy,
            instances: Vec::new(),
            next_id: 1,
            demand_pending: false,
            backoff: Backoff::default(),
            wake_ms: None,
        }
    }

    /// When the caller must call [`Scaler::step`] with [`Input::Wake`] if nothing else
    /// happens first; `None`: not before the next input.
    pub fn next_wake(&self) -> Option<u64> {
        self.wake_ms
    }

    pub fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// Instances started and not stopped.
    /// The id the next started instance gets (a standby is made with it).
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    pub fn live(&self) -> usize {
        self.instances.iter().filter(|t| !t.stopping).count()
    }

    /// Feed one input at `now_ms`, with the load read just before; returns what to do.
    pub fn step(&mut self, now_ms: u64, input: Input, view: &View<'_>) -> Vec<Action> {
        match input {
            Input::Demand => self.demand_pending = true,
            Input::Arrival { at_ms } => {
                if let Some(p) = self.policy.as_mut() {
                    p.on_arrival(at_ms);
                }
            }
            Input::Wake => {}
            Input::Exited {
                id,
                crashed,
                answered,
            } => {
                if let Some(pos) = self.instances.iter().position(|t| t.id == id) {
                    let t = self.instances.remove(pos);
                    if crashed {
                        let lived = now_ms.saturating_sub(t.started_ms);
                        self.backoff
                            .on_crash(now_ms, answered || lived >= HEALTHY_AFTER_MS);
                    }
                }
            }
        }
        let mut actions = Vec::new();
        self.reconcile(now_ms, view, &mut actions);
        actions
    }

    fn reconcile(&mut self, now: u64, view: &View<'_>, actions: &mut Vec<Action>) {
        let usage = |id: u64| view.instances.iter().find(|u| u.id == id);
        // A healthy instance resets the backoff (not the current hold).
        if self.instances.iter().any(|t| {
            !t.stopping
                && (now.saturating_sub(t.started_ms) >= HEALTHY_AFTER_MS
                    || usage(t.id).is_some_and(|u| u.answered))
        }) {
            self.backoff.reset();
        }
        let mut wake: Option<u64> = None;
        let mut arm = |at: u64| {
            let at = at.max(now.saturating_add(1));
            wake = Some(wake.map_or(at, |w: u64| w.min(at)));
        };

        // Starts.
        let live = self.live();
        let decision: Option<Decision> = self.policy.as_ref().map(|p| p.decide(now, live > 0));
        let load_target = if self.demand_pending || view.waiting > 0 {
            (view.inflight.saturating_add(view.waiting))
                .div_ceil(self.cfg.concurrency)
                .clamp(1, self.cfg.max_instances)
        } else {
            0
        };
        let mut target = load_target.max(self.cfg.min_instances);
        let prewarm = target == 0 && live == 0 && decision.is_some_and(|d| d.run);
        if prewarm {
            target = 1;
        }
        if target > live {
            if now >= self.backoff.hold_until_ms {
                for k in 0..target - live {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.instances.push(Tracked {
                        id,
                        started_ms: now,
                        prewarmed: prewarm,
                        stopping: false,
                    });
                    let cold = k == 0 && live == 0 && load_target > 0;
                    actions.push(Action::Start {
                        id,
                        prewarmed: prewarm,
                        cold,
                    });
                }
                self.demand_pending = false;
            } else {
                arm(self.backoff.hold_until_ms);
            }
        } else {
            self.demand_pending = false;
        }

        // Stops, newest first.
        let floor = self.cfg.min_instances;
        let keep_floor = match decision {
            Some(d) if d.run => floor.max(1),
            _ => floor,
        };
        let policy_stop = decision.is_some_and(|d| !d.run) && view.waiting == 0;
        let mut remaining = self.live();
        for t in self.instances.iter_mut().rev() {
            if remaining <= floor {
                break;
            }
            if t.stopping {
                continue;
            }
            let Some(u) = usage(t.id) else {
                // Started by this very step (not readable yet): never stopped by it, but its
                // idle deadline is armed like any other's.
                if remaining > keep_floor || policy_stop {
                    arm(t.started_ms.saturating_add(self.cfg.idle_ms));
                }
                continue;
            };
            if u.inflight > 0 {
                if remaining > keep_floor || policy_stop {
                    arm(now.saturating_add(self.cfg.idle_ms));
                }
                continue;
            }
            let idle_deadline = u
                .last_used_ms
                .max(t.started_ms)
                .saturating_add(self.cfg.idle_ms);
            let by_policy = policy_stop && (t.prewarmed || u.last_used_ms > 0);
            // An instance that never answered while events wait is not idle, it just became
            // ready (a `$PORT` function whose start took longer than `idle`): those events
            // are about to be sent to it. Re-checked `idle` later.
            let unserved_with_events = view.waiting > 0 && !u.answered;
            let by_idle = remaining > keep_floor && now >= idle_deadline && !unserved_with_events;
            if by_policy || by_idle {
                t.stopping = true;
                remaining -= 1;
                actions.push(Action::Stop {
                    id: t.id,
                    reason: if by_policy {
                        StopReason::Predictor
                    } else {
                        StopReason::Idle
                    },
                });
            } else if remaining > keep_floor || policy_stop {
                arm(if unserved_with_events {
                    idle_deadline.max(now.saturating_add(self.cfg.idle_ms))
                } else {
                    idle_deadline
                });
            }
        }

        // The predictor's own wake (a pre-warm time, a keep-alive deadline).
        if let Some(p) = self.policy.as_ref() {
            if let Some(w) = p.next_wake(now, remaining > 0) {
                arm(w);
            }
        }
        self.wake_ms = wake;
    }
}

#[cfg(test)]
#[path = "scaler_tests.rs"]
mod tests;
