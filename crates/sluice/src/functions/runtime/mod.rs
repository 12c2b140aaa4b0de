//! The local function runtime: one thread, `sluice-functions`, that starts a local function's
//! instances on demand (Knative's runtime contract: an HTTP server on `$PORT`, or on an
//! inherited socket), scales them with load, stops them when idle (to zero unless
//! `min_instances`), pre-warms them when a predictor says so, and restarts crashed ones with
//! a backoff.
//!
//! Owns: the processes of local instances, the instance set each local
//! [`FunctionHandle`] publishes, the instance metrics (starts, stops, crashes, cold starts,
//! pre-warm hits and misses, the starting/running gauges) and the status shown at
//! `/api/v1/status`. Does not own: HTTP to instances (`crate::sink::http`, whose dispatchers
//! take slots from the published set and move an instance from starting to running on its
//! first answer), remote functions (`url`: no process, no runtime), or the predictors
//! (`super::predict`).
//!
//! # Shape
//! - [`scaler`]: the decisions, sans-IO (events and `now` in, start/stop actions and the next
//!   wake out), unit-tested; [`replay`] drives it on a virtual clock for benchmarks.
//! - `process`: socket, environment, clone/exec, signals (the runtime's only `unsafe`).
//! - `shell`: the thread's event loop — a thin shell that reads the handles, feeds the
//!   scaler and carries out its actions.
//!
//! # Use
//! `start(handles)` once at start-up (after the handles exist, before events flow), `status()`
//! for `/api/v1/status`, `stop()` at shutdown after the dispatchers stopped taking slots. The
//! thread shows as `sluice-function` in `ps`/`top` (Linux cuts names to 15 bytes).
//!
//! # Invariants
//! - The thread sleeps until the next event: a command from a shard (demand, arrival), a
//!   SIGCHLD, a port-mode readiness result, or a timer at an exact deadline (an idle deadline,
//!   a predictor wake, the end of a crash backoff, a stopping instance's grace). With no
//!   instance left above `min_instances` and no predictor deadline, it does not wake at all.
//! - Every instance is reaped by this thread; children die with it (`PR_SET_PDEATHSIG`), and
//!   [`Runtime::stop`] (or dropping the [`Runtime`]) stops them all: SIGTERM to each process
//!   group, SIGKILL after `grace`, then a bounded join.
//! - The command channel is unbounded by the handle's contract: a function sends at most one
//!   outstanding demand and one arrival per `ARRIVAL_GRAIN_MS`.
//! - [`Runtime::status`] reads a snapshot the thread swaps (`ArcSwap`): it never blocks the
//!   thread, and the thread never waits for it.

pub mod replay;
pub mod scaler;

/// Public for `examples/spawn_cost.rs` (the same-run measurement behind ADR 0004's addendum);
/// not an API.
#[doc(hidden)]
pub mod process;
mod shell;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::{FunctionHandle, Instance};
pub use replay::{replay, ReplayStats};
use scaler::Backoff;

/// Extra time, beyond the longest `grace`, that [`Runtime::stop`] waits for the thread.
const JOIN_SLACK: Duration = Duration::from_secs(3);

/// The running runtime; [`Runtime::stop`] it (dropping it stops it too).
#[derive(Debug)]
pub struct Runtime {
    stop_tx: Option<oneshot::Sender<()>>,
    /// The thread says it is done (a Mutex only to make the Runtime `Sync`).
    done_rx: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    snapshot: Arc<ArcSwap<Vec<FunctionSnapshot>>>,
    join_limit: Duration,
}

/// One local function as `/api/v1/status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct FunctionStatus {
    pub name: String,
    /// How its next instance gets its socket: `inherit` (fd 3), `port` (binds `$PORT`), or
    /// `detecting` (`socket = "auto"`, before its first instance served one of them).
    pub socket: &'static str,
    /// Oldest first.
    pub instances: Vec<InstanceStatus>,
    /// Instances that exited on their own (or failed to start), since sluice started.
    pub crashes: u64,
    /// Crashes since the last healthy instance (answered, or alive 10 s).
    pub consecutive_crashes: u32,
    /// How long starts are held back after the next crash, in ms.
    pub restart_backoff_ms: u64,
    /// How long starts are still held back after the last crash, in ms (0: not held).
    pub restart_held_ms: u64,
}

/// One instance as `/api/v1/status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct InstanceStatus {
    pub id: u64,
    pub pid: u32,
    pub port: u16,
    /// `starting` (no answer yet), `running`, or `stopping`.
    pub state: &'static str,
    pub inflight: usize,
    pub age_ms: u64,
    pub prewarmed: bool,
}

/// What the thread publishes for [`Runtime::status`]; the live figures (in flight, answered,
/// age) are read from the instances at call time.
#[derive(Debug)]
struct FunctionSnapshot {
    handle: Arc<FunctionHandle>,
    socket: &'static str,
    instances: Vec<InstanceSnapshot>,
    backoff: Backoff,
}

#[derive(Debug)]
struct InstanceSnapshot {
    inst: Arc<Instance>,
    pid: u32,
    stopping: bool,
}

/// Starts the runtime thread for the local functions among `handles` (remote ones are
/// ignored): attaches its command channel to each, and starts `min_instances` of each at
/// once. Fails only if the thread, its tokio runtime or its SIGCHLD handler cannot be set up.
pub fn start(handles: Vec<Arc<FunctionHandle>>) -> std::io::Result<Runtime> {
    let local: Vec<Arc<FunctionHandle>> = handles
        .into_iter()
        .filter(|h| h.remote.is_none() && h.cfg.is_local())
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    // Registered before any child exists, so no exit is missed.
    let sigchld = {
        let _in_rt = rt.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?
    };
    let (tx, rx) = mpsc::unbounded_channel();
    for h in &local {
        h.attach_runtime(tx.clone());
    }
    drop(tx);
    let (stop_tx, stop_rx) = oneshot::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let snapshot = Arc::new(ArcSwap::from_pointee(Vec::new()));
    let join_limit = local.iter().map(|h| h.cfg.grace).max().unwrap_or_default() + JOIN_SLACK;
    let shared = snapshot.clone();
    let thread = std::thread::Builder::new()
        .name("sluice-functions".into())
        .spawn(move || {
            rt.block_on(shell::run(local, rx, stop_rx, sigchld, shared));
            drop(rt);
            let _ = done_tx.send(());
        })?;
    Ok(Runtime {
        stop_tx: Some(stop_tx),
        done_rx: std::sync::Mutex::new(done_rx),
        thread: Some(thread),
        snapshot,
        join_limit,
    })
}

impl Runtime {
    /// Stops every instance (SIGTERM to its process group, SIGKILL after `grace`), reaps
    /// them and joins the thread (waiting at most the longest `grace` plus a few seconds).
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// Every local function and its instances, now.
    pub fn status(&self) -> Vec<FunctionStatus> {
        self.snapshot
            .load()
            .iter()
            .map(|f| {
                let now_ms = f.handle.now_ms();
                FunctionStatus {
                    name: f.handle.name().to_owned(),
                    socket: f.socket,
                    instances: f
                        .instances
                        .iter()
                        .map(|i| InstanceStatus {
                            id: i.inst.id,
                            pid: i.pid,
                            port: i.inst.addr.map_or(0, |a| a.port()),
                            state: if i.stopping {
                                "stopping"
                            } else if i.inst.has_answered() {
                                "running"
                            } else {
                                "starting"
                            },
                            inflight: i.inst.inflight(),
                            age_ms: u64::try_from(i.inst.started_at().elapsed().as_millis())
                                .unwrap_or(u64::MAX),
                            prewarmed: i.inst.prewarmed(),
                        })
                        .collect(),
                    crashes: f.handle.metrics.crashes.get(),
                    consecutive_crashes: f.backoff.consecutive_crashes,
                    restart_backoff_ms: f.backoff.next_delay_ms,
                    restart_held_ms: f.backoff.hold_until_ms.saturating_sub(now_ms),
                }
            })
            .collect()
    }

    fn shutdown(&mut self) {
        let Some(stop) = self.stop_tx.take() else {
            return;
        };
        let _ = stop.send(());
        let done = match self.done_rx.get_mut() {
            Ok(rx) => rx.recv_timeout(self.join_limit),
            Err(poisoned) => poisoned.into_inner().recv_timeout(self.join_limit),
        };
        match done {
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                if let Some(t) = self.thread.take() {
                    let _ = t.join();
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    waited_ms = self.join_limit.as_millis() as u64,
                    "function runtime did not stop in time; leaving its thread"
                );
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_runtime_can_be_shared_with_the_admin_api() {
        fn shareable<T: Send + Sync>() {}
        shareable::<super::Runtime>();
    }
}
