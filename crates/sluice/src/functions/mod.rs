//! Edge functions: what the shards' dispatchers (`crate::sink::http`) and the local runtime
//! (`runtime`) share about each `[[function]]`, the runtime itself, and the predictor that tells
//! the autoscaler when to pre-warm and how long to keep an idle instance (`predict`).
//!
//! Owns: [`FunctionHandle`] — one per function, shared by every shard and the runtime thread:
//! the instances that take requests now (a read-mostly snapshot swapped by the runtime),
//! in-flight slots per instance (Knative's concurrency model, counted where requests pass: no
//! sidecar, no polling), the runtime's command channel, and the function's metrics
//! ([`metrics::FunctionMetrics`]). Does not own: HTTP (the dispatcher), processes and scaling
//! decisions (`runtime`), config (`crate::config::FunctionConfig`).
//!
//! # How a request finds an instance
//! A shard's dispatcher calls [`FunctionHandle::acquire`]: the first instance (oldest first, so
//! load packs onto few instances and the rest go idle and are stopped) with fewer than
//! `concurrency` requests in flight gives a [`Slot`]; dropping the slot frees it. When none has
//! room, the dispatcher calls [`FunctionHandle::demand`] (the runtime starts an instance if
//! fewer than `max_instances` run) and waits on [`FunctionHandle::changed`], which fires when the
//! instance set changes or a slot is freed while someone waits. A local function scaled to
//! zero (socket inherited) has a standby in its set ([`Instance::standby`]): a listening socket
//! with no process, so the first event is written into the kernel backlog at once and its
//! slot asks the runtime for the process. A remote function (`url`) has
//! one pseudo-instance with `concurrency × max_instances` slots and no runtime.
//!
//! # Events to the runtime
//! Commands go over an unbounded channel, only on transitions: a demand while no instance has
//! room (at most one outstanding per function), and arrivals for the predictor (at most one per
//! [`ARRIVAL_GRAIN_MS`] per function). With no events, nothing is sent and nothing wakes.

pub mod live;
pub mod metrics;
pub mod predict;
pub mod runtime;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use arc_swap::ArcSwap;
use tokio::sync::{mpsc, Notify};

use crate::config::{FunctionConfig, RemoteUrl};
pub use metrics::FunctionMetrics;

/// Arrivals are reported to the runtime at most once per this many milliseconds per function.
pub const ARRIVAL_GRAIN_MS: u64 = 1_000;

/// What shards tell the runtime thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeCmd {
    /// An event of function `index` found no instance with room.
    Demand { index: usize },
    /// Events of function `index` arrived (`at_ms` since the handle's epoch).
    Arrival { index: usize, at_ms: u64 },
}

/// One instance that takes requests (a local process's listening socket, or the remote url).
#[derive(Debug)]
pub struct Instance {
    /// Unique per function and gateway run; 0 for a remote function's pseudo-instance.
    pub id: u64,
    /// Where to connect (`None` for a remote function: the dispatcher resolves its url).
    pub addr: Option<SocketAddr>,
    /// Requests in flight now, from every shard.
    inflight: AtomicUsize,
    /// Requests this instance may have in flight.
    capacity: usize,
    /// When it last started or finished a request, ms since the handle's epoch.
    last_used_ms: AtomicU64,
    /// Taken out of rotation (being stopped): no new requests.
    retired: AtomicBool,
    /// It has answered a request (its first answer ends a cold start).
    answered: AtomicBool,
    /// Started by the predictor rather than by an event (for pre-warm hits and misses).
    prewarmed: AtomicBool,
    /// A standby: its socket listens but no process serves it yet (see [`Instance::standby`]).
    standby: AtomicBool,
    /// When sluice started its process (a standby: when its socket was bound).
    started_at: Mutex<Instant>,
}

impl Instance {
    pub fn new(id: u64, addr: Option<SocketAddr>, capacity: usize, prewarmed: bool) -> Instance {
        Instance {
            id,
            addr,
            inflight: AtomicUsize::new(0),
            capacity: capacity.max(1),
            last_used_ms: AtomicU64::new(0),
            retired: AtomicBool::new(false),
            answered: AtomicBool::new(false),
            prewarmed: AtomicBool::new(prewarmed),
            standby: AtomicBool::new(false),
            started_at: Mutex::new(Instant::now()),
        }
    }
    /// The next instance of a function scaled to zero, socket-activation style: the runtime
    /// binds its listening socket ahead of time and publishes it, so the first event's request
    /// is connected and written into the kernel backlog by the shard at once; taking a slot
    /// on it asks the runtime to start the process ([`FunctionHandle::acquire`]), which then
    /// [`Instance::activate`]s it (the same instance: the slots taken stay counted).
    pub fn standby(id: u64, addr: SocketAddr, capacity: usize) -> Instance {
        let i = Instance::new(id, Some(addr), capacity, false);
        i.standby.store(true, Ordering::Release);
        i
    }
    /// The same instance (id, capacity, start time, pre-warm mark) at another address: for
    /// the runtime, while it is not published, once it knows which socket its process serves.
    pub fn moved_to(&self, addr: SocketAddr) -> Instance {
        let i = Instance::new(self.id, Some(addr), self.capacity, self.prewarmed());
        *i.started_at.lock().unwrap_or_else(|e| e.into_inner()) = self.started_at();
        i
    }
    /// Its process was just started (the runtime, once, for a standby).
    pub fn activate(&self, prewarmed: bool) {
        self.prewarmed.store(prewarmed, Ordering::Release);
        *self.started_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.standby.store(false, Ordering::Release);
    }
    pub fn is_standby(&self) -> bool {
        self.standby.load(Ordering::Acquire)
    }
    pub fn prewarmed(&self) -> bool {
        self.prewarmed.load(Ordering::Acquire)
    }
    /// When sluice started its process (or, for a standby, bound its socket).
    pub fn started_at(&self) -> Instant {
        *self.started_at.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }
    /// Ms since the handle's epoch of the last request start or end (0: never used).
    pub fn last_used_ms(&self) -> u64 {
        self.last_used_ms.load(Ordering::Acquire)
    }
    /// Take it out of rotation: [`FunctionHandle::acquire`] no longer picks it.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
    /// Mark that it answered; true the first time (the end of its start-up).
    pub fn mark_answered(&self) -> bool {
        !self.answered.swap(true, Ordering::AcqRel)
    }
    pub fn has_answered(&self) -> bool {
        self.answered.load(Ordering::Acquire)
    }
    fn try_take(&self) -> bool {
        let mut cur = self.inflight.load(Ordering::Relaxed);
        loop {
            if cur >= self.capacity || self.is_retired() {
                return false;
            }
            match self.inflight.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }
}

/// One function, as every shard and the runtime see it (see the module docs).
#[derive(Debug)]
pub struct FunctionHandle {
    /// Index among the config's functions (the runtime's key).
    pub index: usize,
    pub cfg: Arc<FunctionConfig>,
    /// `Some` for a remote function (parsed `url`).
    pub remote: Option<RemoteUrl>,
    pub metrics: FunctionMetrics,
    epoch: Instant,
    instances: ArcSwap<Vec<Arc<Instance>>>,
    changed: Notify,
    /// Dispatchers waiting for a slot (events queued behind a full or missing instance).
    waiting: AtomicUsize,
    demand_pending: AtomicBool,
    last_arrival_ms: AtomicU64,
    runtime: OnceLock<mpsc::UnboundedSender<RuntimeCmd>>,
}

impl FunctionHandle {
    /// The handle of function `index`. A remote function gets its pseudo-instance at once;
    /// a local one has none until the runtime publishes some.
    pub fn new(index: usize, cfg: Arc<FunctionConfig>) -> Arc<FunctionHandle> {
        let remote = cfg.remote().and_then(Result::ok);
        let instances = match &remote {
            Some(_) => vec![Arc::new(Instance::new(0, None, cfg.max_in_flight(), false))],
            None => Vec::new(),
        };
        Arc::new(FunctionHandle {
            index,
            metrics: FunctionMetrics::default(),
            remote,
            cfg,
            epoch: Instant::now(),
            instances: ArcSwap::from_pointee(instances),
            changed: Notify::new(),
            waiting: AtomicUsize::new(0),
            demand_pending: AtomicBool::new(false),
            last_arrival_ms: AtomicU64::new(0),
            runtime: OnceLock::new(),
        })
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    /// Milliseconds since this handle's epoch (the clock of arrivals and `last_used`).
    pub fn now_ms(&self) -> u64 {
        self.ms_at(Instant::now())
    }

    /// `t` in milliseconds since this handle's epoch.
    pub fn ms_at(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Connect the runtime's command channel (once; later calls are ignored).
    pub fn attach_runtime(&self, tx: mpsc::UnboundedSender<RuntimeCmd>) {
        let _ = self.runtime.set(tx);
    }

    /// The instances taking requests now.
    pub fn instances(&self) -> arc_swap::Guard<Arc<Vec<Arc<Instance>>>> {
        self.instances.load()
    }

    /// Replace the instance set (the runtime) and wake every waiting dispatcher.
    pub fn publish_instances(&self, set: Vec<Arc<Instance>>) {
        self.instances.store(Arc::new(set));
        self.changed.notify_waiters();
    }

    /// A slot on the first instance with room, or `None` (then [`Self::demand`] and wait on
    /// [`Self::changed`]).
    pub fn acquire(self: &Arc<Self>) -> Option<Slot> {
        let set = self.instances.load();
        let inst = set.iter().find(|i| i.try_take())?.clone();
        inst.last_used_ms.store(self.now_ms(), Ordering::Release);
        if inst.is_standby() {
            // The request waits in the standby's backlog; its process is started now.
            self.demand();
        }
        Some(Slot {
            inst,
            handle: self.clone(),
        })
    }

    /// No instance had room: ask the runtime for one (at most one demand outstanding).
    pub fn demand(&self) {
        if self.remote.is_some() {
            return;
        }
        if let Some(tx) = self.runtime.get() {
            if !self.demand_pending.swap(true, Ordering::AcqRel) {
                let _ = tx.send(RuntimeCmd::Demand { index: self.index });
            }
        }
    }

    /// The runtime took the outstanding demand (the next one is sent again).
    pub fn demand_taken(&self) {
        self.demand_pending.store(false, Ordering::Release);
    }

    /// An event arrived (counted; the predictor hears of it at most once per grain).
    pub fn note_arrival(&self) {
        self.metrics.events.inc();
        if self.remote.is_some() || self.cfg.prewarm == crate::config::Prewarm::Off {
            return;
        }
        let now = self.now_ms();
        let last = self.last_arrival_ms.load(Ordering::Relaxed);
        if last != 0 && now < last + ARRIVAL_GRAIN_MS {
            return;
        }
        if self
            .last_arrival_ms
            .compare_exchange(last, now.max(1), Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            if let Some(tx) = self.runtime.get() {
                let _ = tx.send(RuntimeCmd::Arrival {
                    index: self.index,
                    at_ms: now,
                });
            }
        }
    }

    /// Fires when the instance set changes or a slot is freed while dispatchers wait. Create
    /// it (and `enable` it) *before* trying [`Self::acquire`], so a change in between is not
    /// missed; count yourself in [`Self::wait_begin`] while waiting.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// A dispatcher starts waiting for a slot (`n` events queued behind it).
    pub fn wait_begin(&self, n: usize) {
        self.waiting.fetch_add(n, Ordering::AcqRel);
    }

    /// … and stops.
    pub fn wait_end(&self, n: usize) {
        self.waiting.fetch_sub(n, Ordering::AcqRel);
    }

    /// Events waiting for a slot, gateway-wide (the autoscaler's queue term).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Requests in flight on every instance.
    pub fn inflight(&self) -> usize {
        self.instances.load().iter().map(|i| i.inflight()).sum()
    }
}

/// The `functions` array of /api/v1/status: per function its kind, counters and instances
/// (from the runtime, with pids and states, for a local function; the pseudo-instance of a
/// remote one).
pub fn status(
    functions: &[Arc<FunctionHandle>],
    runtime: Option<&runtime::Runtime>,
) -> serde_json::Value {
    let local = runtime.map(|r| r.status()).unwrap_or_default();
    status_with(functions, &local)
}

/// [`status`] with the local functions' runtime status already read.
pub fn status_with(
    functions: &[Arc<FunctionHandle>],
    local: &[runtime::FunctionStatus],
) -> serde_json::Value {
    let list: Vec<serde_json::Value> = functions
        .iter()
        .map(|f| {
            let m = &f.metrics;
            let mut v = serde_json::json!({
                "name": f.name(),
                "kind": if f.remote.is_some() { "remote" } else { "local" },
                "events": m.events.get(),
                "inflight": f.inflight(),
                "queued": f.waiting(),
                "cold_starts": m.cold_starts.get(),
                "dead_letters": m.dead_letters.get(),
                "instances": [],
            });
            if let Some(r) = local.iter().find(|r| r.name == f.name()) {
                v["instances"] = serde_json::to_value(&r.instances).unwrap_or_default();
                v["socket"] = serde_json::json!(r.socket);
                v["crashes"] = serde_json::json!(r.crashes);
                v["restart_backoff_ms"] = serde_json::json!(r.restart_backoff_ms);
            } else if f.remote.is_some() {
                v["instances"] = serde_json::json!([{
                    "id": 0,
                    "state": "running",
                    "inflight": f.inflight(),
                    "url": f.cfg.url,
                }]);
            }
            v
        })
        .collect();
    serde_json::Value::Array(list)
}

/// One request's claim on an instance; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    inst: Arc<Instance>,
    handle: Arc<FunctionHandle>,
}

impl Slot {
    pub fn instance(&self) -> &Arc<Instance> {
        &self.inst
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.inst
            .last_used_ms
            .store(self.handle.now_ms(), Ordering::Release);
        self.inst.inflight.fetch_sub(1, Ordering::AcqRel);
        if self.handle.waiting.load(Ordering::Acquire) > 0 {
            self.handle.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local(concurrency: usize) -> Arc<FunctionHandle> {
        let cfg: FunctionConfig = toml::from_str(&format!(
            "name = \"f\"\ntopics = [\"#\"]\ncommand = [\"true\"]\nconcurrency = {concurrency}\n"
        ))
        .unwrap();
        FunctionHandle::new(0, Arc::new(cfg))
    }

    #[test]
    fn slots_fill_the_oldest_instance_first_and_free_on_drop() {
        let h = local(2);
        assert!(h.acquire().is_none(), "no instance yet");
        h.publish_instances(vec![
            Arc::new(Instance::new(1, None, 2, false)),
            Arc::new(Instance::new(2, None, 2, false)),
        ]);
        let a = h.acquire().unwrap();
        let b = h.acquire().unwrap();
        let c = h.acquire().unwrap();
        assert_eq!(
            (a.instance().id, b.instance().id, c.instance().id),
            (1, 1, 2)
        );
        assert_eq!(h.inflight(), 3);
        drop(a);
        assert_eq!(h.acquire().unwrap().instance().id, 1);
        h.instances()[0].retire();
        drop(b);
        assert_eq!(
            h.acquire().unwrap().instance().id,
            2,
            "a retired instance takes nothing"
        );
    }

    #[test]
    fn a_remote_function_has_one_instance_with_every_slot() {
        let cfg: FunctionConfig = toml::from_str(
            "name = \"r\"\ntopics = [\"#\"]\nurl = \"http://127.0.0.1:8080/x\"\nconcurrency = 2\nmax_instances = 3\n",
        )
        .unwrap();
        let h = FunctionHandle::new(0, Arc::new(cfg));
        let slots: Vec<_> = (0..6).map(|_| h.acquire().unwrap()).collect();
        assert!(h.acquire().is_none());
        drop(slots);
        assert_eq!(h.inflight(), 0);
    }
}
