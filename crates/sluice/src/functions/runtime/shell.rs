//! The runtime thread's event loop: a thin shell around the scaler. It reads each handle
//! (waiting, in flight, per-instance use), feeds the scaler, and carries out its actions:
//! spawning instances, publishing the instance set, draining and signalling stopped ones,
//! reaping exits, and moving the instance metrics.
//!
//! Owns: the process (`process::Proc`) of every instance, the life cycle of each (standby →
//! starting → up → draining → terminating → killed → reaped), timers. Does not own: any
//! scaling decision (`scaler`), clone/exec details (`process`), the status API (`super`).
//!
//! # Life of an instance
//! 0. Standby (inherit mode, while no instance is up): its socket is bound, listening and
//!    published with no process; a dispatcher that takes a slot on it writes the request
//!    into the backlog and sends a demand. The scaler's next start takes it over (same
//!    `Instance`, so the slots taken stay counted).
//! 1. Spawned (`instances_starting` + 1). Inherit mode: published as soon as its socket
//!    listens, before the process is started (requests queue in the kernel backlog while it
//!    starts). Port mode: a task connects with backoff (1 ms doubling to 50 ms) until it
//!    succeeds — then published — or `start_timeout` passes — then stopped and counted as a
//!    crash. Detect (`socket = "auto"`, until one instance told): like port mode, but the
//!    task also watches the fd-3 socket's accept queue (one probe connection waits there);
//!    the first of "the queue drained" and "`$PORT` accepts" decides the function's mode for
//!    the rest of the run (logged at info, shown in status), and the instance is published
//!    at the address it serves.
//! 2. Stopped by the scaler: retired (dispatchers take no new slot), published without it;
//!    if a dispatcher took a slot just before (rare), re-checked with a short timer (1 ms
//!    doubling to 100 ms) until its in-flight count is 0; then SIGTERM to its process group
//!    and SIGKILL after `grace`.
//! 3. Reaped on SIGCHLD (`try_wait` on each child: no global `waitpid(-1)`). Its gauge goes
//!    down (`instances_running` if it answered, else `instances_starting`). An exit that no
//!    stop asked for is a crash: counted, logged at warn with the exit status, and reported to
//!    the scaler, which holds restarts back.
//!
//! Invariants: the loop never busy-waits — every timer is a deadline computed from stored
//! state, and a timer only exists for a stopping instance or a scaler wake. The published set
//! holds exactly the instances that are up and not retired, oldest first. The readiness
//! channel is unbounded but carries at most one message per starting instance (at most
//! `max_instances` per function). SIGCHLD is process-wide: any child's exit wakes the loop
//! once, for one `try_wait` per instance.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::process::{self, signal_group};
use super::scaler::{Action, Input, Scaler, ScalerConfig, StopReason, Usage, View};
use super::{FunctionSnapshot, InstanceSnapshot};
use crate::config::{Prewarm, SocketMode};
use crate::functions::predict::gbdt::{GbdtPolicy, GbdtPolicyParams};
use crate::functions::predict::histogram::{HistogramParams, HistogramPolicy};
use crate::functions::predict::Policy;
use crate::functions::{FunctionHandle, Instance, RuntimeCmd};

/// First re-check of a stopped instance that still had a request in flight.
const DRAIN_RECHECK_MIN: Duration = Duration::from_millis(1);
const DRAIN_RECHECK_MAX: Duration = Duration::from_millis(100);
/// Port mode: first and longest pause between connection attempts while an instance starts.
const CONNECT_RETRY_MIN: Duration = Duration::from_millis(1);
const CONNECT_RETRY_MAX: Duration = Duration::from_millis(50);
/// At shutdown, how long after the last SIGKILL to wait for the reaping.
const KILL_REAP_WAIT: Duration = Duration::from_secs(2);

/// The thread's main future: serves until `stop` fires (or its sender is dropped), then
/// stops every instance.
pub(super) async fn run(
    handles: Vec<Arc<FunctionHandle>>,
    mut cmds: mpsc::UnboundedReceiver<RuntimeCmd>,
    mut stop: oneshot::Receiver<()>,
    mut sigchld: tokio::signal::unix::Signal,
    snapshot: Arc<ArcSwap<Vec<FunctionSnapshot>>>,
) {
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let mut shell = Shell {
        by_index: handles
            .iter()
            .enumerate()
            .map(|(i, h)| (h.index, i))
            .collect(),
        functions: handles.into_iter().map(Function::new).collect(),
        ready_tx,
        snapshot,
    };
    for fi in 0..shell.functions.len() {
        shell.drive(fi, Input::Wake);
    }
    shell.keep_standbys();
    shell.publish_status();
    let mut cmds_open = true;
    loop {
        let deadline = shell.next_deadline();
        tokio::select! {
            biased;
            _ = &mut stop => break,
            _ = sigchld.recv() => shell.reap(true),
            Some(r) = ready_rx.recv() => shell.on_readiness(r),
            cmd = cmds.recv(), if cmds_open => match cmd {
                Some(cmd) => shell.on_cmd(cmd),
                None => cmds_open = false,
            },
            _ = sleep_until(deadline), if deadline.is_some() => shell.on_timers(),
        }
        shell.keep_standbys();
        shell.publish_status();
    }
    shell.shutdown(&mut sigchld).await;
    shell.publish_status();
}

async fn sleep_until(deadline: Option<Instant>) {
    if let Some(d) = deadline {
        tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await;
    }
}

struct Shell {
    functions: Vec<Function>,
    /// Handle index (config order) → position in `functions`.
    by_index: HashMap<usize, usize>,
    ready_tx: mpsc::UnboundedSender<Readiness>,
    snapshot: Arc<ArcSwap<Vec<FunctionSnapshot>>>,
}

struct Function {
    handle: Arc<FunctionHandle>,
    scaler: Scaler,
    /// Start order.
    locals: Vec<Local>,
    /// Scaled to zero with an inherited socket: the next instance's socket, bound and listening
    /// and published, with no process yet (see [`Instance::standby`]).
    standby: Option<(process::Prepared, Arc<Instance>)>,
    /// `socket = "auto"`: the socket its first detected instance served (kept for this run).
    detected: Option<SocketMode>,
}

struct Local {
    inst: Arc<Instance>,
    child: process::Proc,
    pid: u32,
    phase: Phase,
    /// In the published set.
    published: bool,
    /// Port mode: did not accept a connection within `start_timeout` (its exit is a crash).
    failed_start: bool,
    ready_task: Option<JoinHandle<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Port mode, not connectable yet (not published).
    Starting,
    Up,
    /// Stopped while a request was in flight: re-checked at `recheck_at`.
    Draining {
        recheck_at: Instant,
        step: Duration,
    },
    Terminating {
        kill_at: Instant,
    },
    Killed,
}

impl Phase {
    fn stopping(self) -> bool {
        matches!(
            self,
            Phase::Draining { .. } | Phase::Terminating { .. } | Phase::Killed
        )
    }
}

/// A port-mode instance accepted a connection (`ok`) or did not within `start_timeout`; a
/// detecting one (`socket = "auto"`) also says which socket it served, and its address.
#[derive(Debug)]
struct Readiness {
    fi: usize,
    id: u64,
    ok: bool,
    detected: Option<(SocketMode, SocketAddr)>,
}

impl Function {
    fn new(handle: Arc<FunctionHandle>) -> Function {
        let cfg = ScalerConfig::of(&handle.cfg);
        let policy: Option<Box<dyn Policy>> = match handle.cfg.prewarm {
            Prewarm::Off => None,
            Prewarm::Predict => Some(Box::new(HistogramPolicy::new(HistogramParams {
                fallback_keep_ms: cfg.idle_ms,
                ..HistogramParams::default()
            }))),
            Prewarm::Gbdt => Some(Box::new(GbdtPolicy::new(GbdtPolicyParams {
                fallback_keep_ms: cfg.idle_ms,
                ..GbdtPolicyParams::default()
            }))),
        };
        Function {
            scaler: Scaler::new(cfg, policy),
            handle,
            locals: Vec::new(),
            standby: None,
            detected: None,
        }
    }

    /// How its next instance gets its socket.
    fn plan(&self) -> process::Plan {
        process::Plan::of(&self.handle.cfg, self.detected)
    }

    fn name(&self) -> &str {
        self.handle.name()
    }

    fn publish(&self) {
        self.publish_with(self.standby.as_ref().map(|(_, i)| i.clone()));
    }

    /// Publish the published instances and `extra` (the standby, or an instance about to
    /// start).
    fn publish_with(&self, extra: Option<Arc<Instance>>) {
        self.handle.publish_instances(
            self.locals
                .iter()
                .filter(|l| l.published)
                .map(|l| l.inst.clone())
                .chain(extra)
                .collect(),
        );
    }

    /// With no instance up (and the socket inherited), bind the next one's socket and publish
    /// it as a standby; without a process it costs one file descriptor and no CPU.
    fn keep_standby(&mut self) {
        if self.standby.is_some()
            || self.plan() != process::Plan::Inherit
            || self.locals.iter().any(|l| !l.phase.stopping())
        {
            return;
        }
        // A command that cannot be prepared fails again (and is reported) when it is started.
        let Ok(prepared) = process::prepare(&self.handle.cfg, process::Plan::Inherit) else {
            return;
        };
        let inst = Arc::new(Instance::standby(
            self.scaler.next_id(),
            prepared.addr(),
            self.handle.cfg.concurrency,
        ));
        self.standby = Some((prepared, inst));
        self.publish();
    }

    /// The scaler's wake as an instant.
    fn wake_at(&self) -> Option<Instant> {
        let w = self.scaler.next_wake()?;
        // The handle's clock first, then the instant: the result is never before the handle's
        // `w` (now_ms rounds down), so the timer never fires before the scaler's deadline.
        let now_ms = self.handle.now_ms();
        Some(Instant::now() + Duration::from_millis(w.saturating_sub(now_ms)))
    }
}

impl Shell {
    fn keep_standbys(&mut self) {
        for f in &mut self.functions {
            f.keep_standby();
        }
    }

    fn on_cmd(&mut self, cmd: RuntimeCmd) {
        match cmd {
            RuntimeCmd::Demand { index } => {
                if let Some(&fi) = self.by_index.get(&index) {
                    self.functions[fi].handle.demand_taken();
                    self.drive(fi, Input::Demand);
                }
            }
            RuntimeCmd::Arrival { index, at_ms } => {
                if let Some(&fi) = self.by_index.get(&index) {
                    self.drive(fi, Input::Arrival { at_ms });
                }
            }
        }
    }

    /// Feeds `input` (and the inputs its actions cause) to function `fi`'s scaler.
    fn drive(&mut self, fi: usize, input: Input) {
        let mut pending = VecDeque::from([input]);
        while let Some(input) = pending.pop_front() {
            let f = &mut self.functions[fi];
            let usage: Vec<Usage> = f
                .locals
                .iter()
                .map(|l| Usage {
                    id: l.inst.id,
                    // A port-mode instance not up yet counts as busy: never idle-stopped
                    // while it starts (start_timeout bounds that).
                    inflight: l.inst.inflight() + usize::from(l.phase == Phase::Starting),
                    last_used_ms: l.inst.last_used_ms(),
                    answered: l.inst.has_answered(),
                })
                .collect();
            let view = View {
                waiting: f.handle.waiting(),
                inflight: f.handle.inflight(),
                instances: &usage,
            };
            let actions = f.scaler.step(f.handle.now_ms(), input, &view);
            for action in actions {
                match action {
                    Action::Start {
                        id,
                        prewarmed,
                        cold,
                    } => {
                        if let Err(e) = self.start_instance(fi, id, prewarmed, cold) {
                            let f = &self.functions[fi];
                            f.handle.metrics.crashes.inc();
                            tracing::warn!(function = %f.name(), instance = id, error = %e, "function instance failed to start");
                            pending.push_back(Input::Exited {
                                id,
                                crashed: true,
                                answered: false,
                            });
                        }
                    }
                    Action::Stop { id, reason } => self.stop_instance(fi, id, reason),
                }
            }
        }
    }

    fn start_instance(
        &mut self,
        fi: usize,
        id: u64,
        prewarmed: bool,
        cold: bool,
    ) -> Result<(), process::SpawnError> {
        let f = &mut self.functions[fi];
        let m = &f.handle.metrics;
        if cold {
            m.cold_starts.inc();
        }
        let plan = f.plan();
        let (prepared, inst) = match f.standby.take() {
            // The standby was made with the id the scaler gives its next instance.
            Some((prepared, inst)) if inst.id == id => {
                inst.activate(prewarmed);
                (prepared, inst)
            }
            other => {
                if let Some((_, stale)) = other {
                    stale.retire();
                }
                let prepared = process::prepare(&f.handle.cfg, plan)?;
                let inst = Arc::new(Instance::new(
                    id,
                    Some(prepared.addr()),
                    f.handle.cfg.concurrency,
                    prewarmed,
                ));
                (prepared, inst)
            }
        };
        // An inherited socket listens already: publish the instance before its process starts,
        // so the dispatchers connect and write the waiting requests into its backlog meanwhile
        // (sluice's part of a cold start does not wait for the exec).
        let early = plan == process::Plan::Inherit;
        if early {
            f.publish_with(Some(inst.clone()));
        }
        let sp = match prepared.spawn() {
            Ok(sp) => sp,
            Err(e) => {
                if early {
                    // Its backlog was reset with the socket: the dispatchers retry.
                    inst.retire();
                    f.publish();
                }
                return Err(e);
            }
        };
        m.starts.inc();
        m.instances_starting.add(1);
        tracing::debug!(function = %f.name(), instance = id, pid = sp.pid, port = sp.addr.port(), prewarmed, "function instance started");
        let mut local = Local {
            inst,
            child: sp.child,
            pid: sp.pid,
            phase: Phase::Up,
            published: true,
            failed_start: false,
            ready_task: None,
        };
        if plan != process::Plan::Inherit {
            local.phase = Phase::Starting;
            local.published = false;
            let tx = self.ready_tx.clone();
            let limit = f.handle.cfg.start_timeout;
            let addr = sp.addr;
            local.ready_task = Some(match sp.detect {
                Some(d) => tokio::spawn(async move {
                    let detected = detect_socket(d, limit).await;
                    let ok = detected.is_some();
                    let _ = tx.send(Readiness {
                        fi,
                        id,
                        ok,
                        detected,
                    });
                }),
                None => tokio::spawn(async move {
                    let ok = wait_ready(addr, limit).await;
                    let _ = tx.send(Readiness {
                        fi,
                        id,
                        ok,
                        detected: None,
                    });
                }),
            });
        }
        let publish = local.published && !early;
        f.locals.push(local);
        if publish {
            f.publish();
        }
        Ok(())
    }

    fn stop_instance(&mut self, fi: usize, id: u64, reason: StopReason) {
        let f = &mut self.functions[fi];
        let Some(l) = f.locals.iter_mut().find(|l| l.inst.id == id) else {
            return;
        };
        if l.phase.stopping() {
            return;
        }
        f.handle.metrics.stops.inc();
        tracing::debug!(function = %f.handle.name(), instance = id, ?reason, "function instance stopping");
        let republish = begin_stop(l, f.handle.cfg.grace);
        if republish {
            f.publish();
        }
    }

    fn on_readiness(&mut self, r: Readiness) {
        let Some(f) = self.functions.get_mut(r.fi) else {
            return;
        };
        let grace = f.handle.cfg.grace;
        let Some(l) = f.locals.iter_mut().find(|l| l.inst.id == r.id) else {
            return;
        };
        l.ready_task = None;
        if l.phase != Phase::Starting {
            return;
        }
        if let (true, Some((mode, addr))) = (r.ok, r.detected) {
            if l.inst.addr != Some(addr) {
                l.inst = Arc::new(l.inst.moved_to(addr));
            }
            if f.detected.is_none() {
                tracing::info!(function = %f.handle.name(), socket = mode.as_str(), port = addr.port(), "function socket detected; later instances use it");
                f.detected = Some(mode);
            }
        }
        if r.ok {
            l.phase = Phase::Up;
            l.published = true;
            f.publish();
        } else {
            tracing::warn!(function = %f.handle.name(), instance = r.id, timeout_ms = f.handle.cfg.start_timeout.as_millis() as u64, "function instance accepted no connection within start_timeout; stopping it");
            l.failed_start = true;
            begin_stop(l, grace);
        }
        self.drive(r.fi, Input::Wake);
    }

    fn on_timers(&mut self) {
        let now = Instant::now();
        for f in &mut self.functions {
            let grace = f.handle.cfg.grace;
            for l in &mut f.locals {
                match l.phase {
                    Phase::Draining { recheck_at, step } if recheck_at <= now => {
                        if l.inst.inflight() == 0 {
                            terminate(l, grace);
                        } else {
                            let step = (step * 2).min(DRAIN_RECHECK_MAX);
                            l.phase = Phase::Draining {
                                recheck_at: now + step,
                                step,
                            };
                        }
                    }
                    Phase::Terminating { kill_at } if kill_at <= now => {
                        let _ = signal_group(l.pid, libc::SIGKILL);
                        l.phase = Phase::Killed;
                    }
                    _ => {}
                }
            }
        }
        for fi in 0..self.functions.len() {
            let f = &self.functions[fi];
            if f.scaler.next_wake().is_some_and(|w| w <= f.handle.now_ms()) {
                self.drive(fi, Input::Wake);
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let mut d: Option<Instant> = None;
        let mut consider = |t: Instant| d = Some(d.map_or(t, |d| d.min(t)));
        for f in &self.functions {
            if let Some(w) = f.wake_at() {
                consider(w);
            }
            for l in &f.locals {
                match l.phase {
                    Phase::Draining { recheck_at, .. } => consider(recheck_at),
                    Phase::Terminating { kill_at } => consider(kill_at),
                    _ => {}
                }
            }
        }
        d
    }

    /// Reaps every exited instance; `drive`: tell the scaler (not during shutdown).
    fn reap(&mut self, drive: bool) {
        for fi in 0..self.functions.len() {
            let mut exited = Vec::new();
            let f = &mut self.functions[fi];
            let mut i = 0;
            while i < f.locals.len() {
                match f.locals[i].child.try_wait() {
                    Ok(None) => i += 1,
                    Ok(Some(status)) => exited.push((f.locals.remove(i), Some(status))),
                    Err(_) => exited.push((f.locals.remove(i), None)), // reaped by someone else
                }
            }
            if exited.is_empty() {
                continue;
            }
            if exited.iter().any(|(l, _)| l.published) {
                f.publish();
            }
            let inputs: Vec<Input> = exited
                .into_iter()
                .map(|(l, status)| on_exit(f, l, status))
                .collect();
            if drive {
                for input in inputs {
                    self.drive(fi, input);
                }
            }
        }
    }

    fn publish_status(&self) {
        self.snapshot.store(Arc::new(
            self.functions
                .iter()
                .map(|f| FunctionSnapshot {
                    handle: f.handle.clone(),
                    socket: match f.plan() {
                        process::Plan::Inherit => "inherit",
                        process::Plan::Port => "port",
                        process::Plan::Detect => "detecting",
                    },
                    instances: f
                        .locals
                        .iter()
                        .map(|l| InstanceSnapshot {
                            inst: l.inst.clone(),
                            pid: l.pid,
                            stopping: l.phase.stopping(),
                        })
                        .collect(),
                    backoff: f.scaler.backoff(),
                })
                .collect(),
        ));
    }

    /// Stops every instance: SIGTERM now, SIGKILL after `grace`, reaps them (bounded).
    async fn shutdown(&mut self, sigchld: &mut tokio::signal::unix::Signal) {
        let now = Instant::now();
        for f in &mut self.functions {
            let grace = f.handle.cfg.grace;
            for l in &mut f.locals {
                l.inst.retire();
                l.published = false;
                if let Some(t) = l.ready_task.take() {
                    t.abort();
                }
                if !matches!(l.phase, Phase::Terminating { .. } | Phase::Killed) {
                    let _ = signal_group(l.pid, libc::SIGTERM);
                    l.phase = Phase::Terminating {
                        kill_at: now + grace,
                    };
                }
            }
            f.standby = None; // its backlog (if anything waits there) is reset
            f.handle.publish_instances(Vec::new());
        }
        let mut give_up: Option<Instant> = None;
        loop {
            self.reap(false);
            if self.functions.iter().all(|f| f.locals.is_empty()) {
                return;
            }
            let now = Instant::now();
            if give_up.is_some_and(|g| now >= g) {
                break;
            }
            self.on_timers_shutdown(now);
            if give_up.is_none()
                && self
                    .functions
                    .iter()
                    .all(|f| f.locals.iter().all(|l| l.phase == Phase::Killed))
            {
                give_up = Some(now + KILL_REAP_WAIT);
            }
            // Only the kill deadlines and the give-up matter now (not the scalers' wakes).
            let kill_at = self
                .functions
                .iter()
                .flat_map(|f| &f.locals)
                .filter_map(|l| match l.phase {
                    Phase::Terminating { kill_at } => Some(kill_at),
                    _ => None,
                })
                .min();
            let deadline = kill_at.or(give_up);
            tokio::select! {
                _ = sigchld.recv() => {}
                _ = sleep_until(deadline) => {}
            }
        }
        for f in &self.functions {
            for l in &f.locals {
                tracing::warn!(function = %f.handle.name(), instance = l.inst.id, pid = l.pid, "function instance not reaped at shutdown");
            }
        }
    }

    fn on_timers_shutdown(&mut self, now: Instant) {
        for f in &mut self.functions {
            for l in &mut f.locals {
                if let Phase::Terminating { kill_at } = l.phase {
                    if kill_at <= now {
                        let _ = signal_group(l.pid, libc::SIGKILL);
                        l.phase = Phase::Killed;
                    }
                }
            }
        }
    }
}

/// Retires `l` and starts its stop; true if it was published (the set must be republished).
fn begin_stop(l: &mut Local, grace: Duration) -> bool {
    l.inst.retire();
    if let Some(t) = l.ready_task.take() {
        t.abort();
    }
    let was_published = std::mem::replace(&mut l.published, false);
    if l.inst.inflight() > 0 {
        l.phase = Phase::Draining {
            recheck_at: Instant::now() + DRAIN_RECHECK_MIN,
            step: DRAIN_RECHECK_MIN,
        };
    } else {
        terminate(l, grace);
    }
    was_published
}

fn terminate(l: &mut Local, grace: Duration) {
    let _ = signal_group(l.pid, libc::SIGTERM);
    l.phase = Phase::Terminating {
        kill_at: Instant::now() + grace,
    };
}

/// Accounts for a reaped instance; the scaler's input for it.
fn on_exit(f: &Function, mut l: Local, status: Option<ExitStatus>) -> Input {
    if let Some(t) = l.ready_task.take() {
        t.abort();
    }
    let m = &f.handle.metrics;
    let answered = l.inst.has_answered();
    if answered {
        m.instances_running.sub(1);
    } else {
        m.instances_starting.sub(1);
    }
    let stopped = l.phase.stopping() && !l.failed_start;
    let status = status.map_or_else(|| "unknown".to_owned(), |s| s.to_string());
    if stopped {
        if l.inst.prewarmed() {
            if l.inst.last_used_ms() > 0 {
                m.prewarm_hits.inc();
            } else {
                m.prewarm_misses.inc();
            }
        }
        tracing::debug!(function = %f.name(), instance = l.inst.id, pid = l.pid, %status, "function instance stopped");
    } else {
        m.crashes.inc();
        tracing::warn!(function = %f.name(), instance = l.inst.id, pid = l.pid, %status, "function instance exited on its own");
    }
    Input::Exited {
        id: l.inst.id,
        crashed: !stopped,
        answered,
    }
}

/// `socket = "auto"`, first instance: which socket does it serve? Makes one connection to
/// its fd 3 (it waits in the accept queue) and then, with backoff (as [`wait_ready`]),
/// checks whether the queue drained (it accepts on fd 3: `Inherit`) or `$PORT` accepts a
/// connection (it bound `$PORT`: `Port`), until `limit` passes (`None`).
async fn detect_socket(d: process::Detect, limit: Duration) -> Option<(SocketMode, SocketAddr)> {
    let deadline = tokio::time::Instant::now() + limit;
    let _probe = tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect(d.fd3))
        .await
        .ok()?
        .ok()?;
    let mut pause = CONNECT_RETRY_MIN;
    loop {
        if process::accept_queue_len(&d.listener).ok()? == 0 {
            return Some((SocketMode::Inherit, d.fd3));
        }
        match tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect(d.port)).await {
            Ok(Ok(_)) => return Some((SocketMode::Port, d.port)),
            Err(_) => return None,
            Ok(Err(_)) => {}
        }
        if tokio::time::Instant::now() + pause >= deadline {
            return None;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(CONNECT_RETRY_MAX);
    }
}

/// Port mode: connects to `addr` with backoff until it accepts or `limit` passes.
async fn wait_ready(addr: SocketAddr, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    let mut pause = CONNECT_RETRY_MIN;
    loop {
        match tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => return true,
            Err(_) => return false,
            Ok(Err(_)) => {}
        }
        if tokio::time::Instant::now() + pause >= deadline {
            return false;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(CONNECT_RETRY_MAX);
    }
}
