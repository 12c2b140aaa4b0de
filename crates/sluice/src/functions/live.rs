//! The gateway's functions as a set a reload changes (ADR 0013): each `[[function]]`'s
//! [`FunctionHandle`] and, for a local function, the runtime that runs its instances.
//!
//! Owns: [`FunctionSet`] — the handles in config order (read by the admin with one atomic
//! load), a runtime per local function (thread `sluice-functions`; [`runtime::start`] with
//! that one handle), adding a function (a new handle with a never reused index, its runtime
//! started) and removing one (out of the set; its runtime, and with it its instances, stopped
//! once the last holder lets go). Does not own: the function's sink on the shards (attached
//! and detached by `app/reload`, through the shards' mailboxes), the runtime's scaling
//! (`runtime`), HTTP to instances (`crate::sink::http`).
//!
//! Invariants:
//! - One runtime per local function, so removing a function stops exactly its instances and
//!   nothing else's; runtimes reap by pid, so several coexist.
//! - A handle's index is never reused: a late command of a removed function's handle can
//!   never reach another's scaler.
//! - Readers never lock: writers (start-up, the serialized reloads) publish a new vector.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use super::{runtime, FunctionHandle};
use crate::config::FunctionConfig;

/// One function and, if local, its runtime.
#[derive(Debug)]
pub struct LiveFunction {
    pub handle: Arc<FunctionHandle>,
    pub runtime: Option<Arc<runtime::Runtime>>,
}

/// Every function the gateway runs (see the module docs).
#[derive(Debug)]
pub struct FunctionSet {
    entries: ArcSwap<Vec<Arc<LiveFunction>>>,
    next_index: AtomicUsize,
    write: Mutex<()>,
}

impl FunctionSet {
    /// The functions of the configuration the gateway starts with: handles in config order
    /// (index = position), a runtime started for each local one (idle until a first event).
    pub fn start(functions: &[FunctionConfig]) -> std::io::Result<FunctionSet> {
        let mut entries = Vec::new();
        for (i, f) in functions.iter().enumerate() {
            entries.push(Arc::new(live(i, Arc::new(f.clone()))?));
        }
        Ok(FunctionSet {
            next_index: AtomicUsize::new(entries.len()),
            entries: ArcSwap::from_pointee(entries),
            write: Mutex::new(()),
        })
    }

    /// Every function now (one atomic load).
    pub fn load(&self) -> arc_swap::Guard<Arc<Vec<Arc<LiveFunction>>>> {
        self.entries.load()
    }

    /// Every function's handle now.
    pub fn handles(&self) -> Vec<Arc<FunctionHandle>> {
        self.load().iter().map(|f| f.handle.clone()).collect()
    }

    /// The function named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<LiveFunction>> {
        self.load()
            .iter()
            .find(|f| f.handle.name() == name)
            .cloned()
    }

    /// Add `cfg` at the end: a new handle (next unused index) and, if local, its runtime
    /// started. Fails only if the runtime's thread cannot be started (nothing is added).
    pub fn add(&self, cfg: Arc<FunctionConfig>) -> std::io::Result<Arc<LiveFunction>> {
        let _w = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        let added = Arc::new(live(index, cfg)?);
        let mut next: Vec<Arc<LiveFunction>> = self.load().as_ref().clone();
        next.push(added.clone());
        self.entries.store(Arc::new(next));
        Ok(added)
    }

    /// Take `name` out of the set; its runtime stops when the returned value (and any
    /// reader's copy) is dropped. `None` if it is not there.
    pub fn remove(&self, name: &str) -> Option<Arc<LiveFunction>> {
        let _w = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let mut next: Vec<Arc<LiveFunction>> = self.load().as_ref().clone();
        let at = next.iter().position(|f| f.handle.name() == name)?;
        let removed = next.remove(at);
        self.entries.store(Arc::new(next));
        Some(removed)
    }

    /// `functions` of `/api/v1/status` and the overview.
    pub fn status(&self) -> serde_json::Value {
        let entries = self.load();
        let handles: Vec<Arc<FunctionHandle>> = entries.iter().map(|f| f.handle.clone()).collect();
        let local: Vec<runtime::FunctionStatus> = entries
            .iter()
            .filter_map(|f| f.runtime.as_ref())
            .flat_map(|r| r.status())
            .collect();
        super::status_with(&handles, &local)
    }

    /// Stop every runtime (at shutdown, after the shards stopped taking slots).
    pub fn stop_all(&self) {
        let entries = self.entries.swap(Arc::new(Vec::new()));
        let runtimes: Vec<Arc<runtime::Runtime>> =
            entries.iter().filter_map(|f| f.runtime.clone()).collect();
        drop(entries);
        for rt in runtimes {
            match Arc::try_unwrap(rt) {
                Ok(rt) => rt.stop(),
                Err(rt) => drop(rt),
            }
        }
    }
}

/// A function's handle and, if local, its own runtime.
fn live(index: usize, cfg: Arc<FunctionConfig>) -> std::io::Result<LiveFunction> {
    let handle = FunctionHandle::new(index, cfg);
    let runtime = if handle.remote.is_none() && handle.cfg.is_local() {
        Some(Arc::new(runtime::start(vec![handle.clone()])?))
    } else {
        None
    };
    Ok(LiveFunction { handle, runtime })
}
