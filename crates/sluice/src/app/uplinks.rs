//! The control side's table of sinks (uplinks and function sinks), keyed by a stable id.
//!
//! Owns: [`UplinkId`] (given when a sink is attached: at start in config order, later the
//! next unused number; never reused while the process runs), [`UplinkEntry`] (what the admin
//! shows of one sink: its name, its `[shard]` lane and spool counters, its `install_tc`
//! status, its lifecycle state) and [`UplinkTable`] (the entries in config order, replaced
//! copy-on-write and read with one atomic load). Does not own: the sinks themselves (each
//! shard's `crate::sink::Sink` and its tasks), the counters' meaning (`crate::sink`,
//! `crate::sink::spool`), or deciding when a sink is added or removed (`reload.rs`, ADR 0013).
//!
//! Invariants:
//! - An id names one sink for the life of the process: a sink removed and added again under
//!   the same name gets a new id, so nothing of the old one (a late counter, a spool handle,
//!   a shard's answer) can be taken for the new one.
//! - Removing an entry never moves another entry's counters: readers find a sink by id or
//!   name, never by position, so the entries after it keep their series.
//! - Readers never lock: [`UplinkTable::load`] is one `arc-swap` load; writers (start-up and
//!   the serialized reloads) publish a new vector sharing the entries' `Arc`s.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::sink::spool::SpoolMetrics;
use crate::sink::LaneMetrics;

/// A sink's identity for the life of the process (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UplinkId(pub u32);

/// Where a sink is in its life (ADR 0013, "What the admin shows").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    /// Added by a reload; not every shard has attached it yet.
    Attaching = 0,
    /// Every shard runs it.
    Running = 1,
    /// Removed by a reload; shards are draining what it holds.
    Draining = 2,
    /// Removed by a reload and every shard stopped it; kept (at most [`KEPT_REMOVED`]) so
    /// its last counts stay visible.
    Removed = 3,
}

/// Removed entries kept in the table (the oldest goes first; one added again under the same
/// name replaces its removed entry), so the table stays bounded across any number of reloads.
pub const KEPT_REMOVED: usize = 8;

impl EntryState {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryState::Attaching => "attaching",
            EntryState::Running => "running",
            EntryState::Draining => "draining",
            EntryState::Removed => "removed",
        }
    }

    fn from_u8(v: u8) -> EntryState {
        match v {
            0 => EntryState::Attaching,
            2 => EntryState::Draining,
            3 => EntryState::Removed,
            _ => EntryState::Running,
        }
    }
}

/// One sink as the admin sees it.
#[derive(Debug)]
pub struct UplinkEntry {
    pub id: UplinkId,
    pub name: String,
    /// Per shard: its lanes' counters (shared with the shard that counts into them).
    pub lanes: Vec<LaneMetrics>,
    /// Per shard: its spool's counters; empty without `[spool] dir`.
    pub spools: Vec<Arc<SpoolMetrics>>,
    /// `null`, or whether `install_tc` succeeded.
    pub tc: serde_json::Value,
    state: AtomicU8,
}

impl UplinkEntry {
    pub fn new(
        id: UplinkId,
        name: String,
        lanes: Vec<LaneMetrics>,
        spools: Vec<Arc<SpoolMetrics>>,
        tc: serde_json::Value,
        state: EntryState,
    ) -> UplinkEntry {
        UplinkEntry {
            id,
            name,
            lanes,
            spools,
            tc,
            state: AtomicU8::new(state as u8),
        }
    }

    pub fn state(&self) -> EntryState {
        EntryState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn set_state(&self, state: EntryState) {
        self.state.store(state as u8, Ordering::Relaxed);
    }
}

/// The table: entries in config order, growable and shrinkable at runtime.
#[derive(Debug)]
pub struct UplinkTable {
    entries: ArcSwap<Vec<Arc<UplinkEntry>>>,
    next_id: AtomicU32,
    /// Serializes writers (the reloads are serialized already; this keeps the table's own
    /// invariant without relying on it).
    write: Mutex<()>,
}

impl UplinkTable {
    /// The table a gateway starts with: ids 0, 1, 2, … in config order, every entry running.
    pub fn at_start(entries: impl IntoIterator<Item = StartEntry>) -> UplinkTable {
        let entries: Vec<Arc<UplinkEntry>> = entries
            .into_iter()
            .enumerate()
            .map(|(i, e)| {
                Arc::new(UplinkEntry::new(
                    UplinkId(i as u32),
                    e.name,
                    e.lanes,
                    e.spools,
                    e.tc,
                    EntryState::Running,
                ))
            })
            .collect();
        UplinkTable {
            next_id: AtomicU32::new(entries.len() as u32),
            entries: ArcSwap::from_pointee(entries),
            write: Mutex::new(()),
        }
    }

    /// Every entry, in config order (one atomic load).
    pub fn load(&self) -> arc_swap::Guard<Arc<Vec<Arc<UplinkEntry>>>> {
        self.entries.load()
    }

    pub fn by_name(&self, name: &str) -> Option<Arc<UplinkEntry>> {
        self.load().iter().find(|e| e.name == name).cloned()
    }

    pub fn by_id(&self, id: UplinkId) -> Option<Arc<UplinkEntry>> {
        self.load().iter().find(|e| e.id == id).cloned()
    }

    /// Add a sink at `position` in config order (clamped to the end), `Attaching`; returns
    /// its new id. A removed entry of the same name leaves the table (one entry per name).
    pub fn attach(&self, position: usize, entry: StartEntry) -> Arc<UplinkEntry> {
        let _w = lock(&self.write);
        let id = UplinkId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let added = Arc::new(UplinkEntry::new(
            id,
            entry.name,
            entry.lanes,
            entry.spools,
            entry.tc,
            EntryState::Attaching,
        ));
        let mut next: Vec<Arc<UplinkEntry>> = self.entries.load().as_ref().clone();
        next.retain(|e| !(e.state() == EntryState::Removed && e.name == added.name));
        next.insert(position.min(next.len()), added.clone());
        self.entries.store(Arc::new(next));
        added
    }

    /// The entry `id` is removed on every shard: marked `Removed` and kept, its counters
    /// visible, until [`KEPT_REMOVED`] newer removed entries push it out.
    pub fn retire(&self, id: UplinkId) {
        let _w = lock(&self.write);
        let mut next: Vec<Arc<UplinkEntry>> = self.entries.load().as_ref().clone();
        if let Some(e) = next.iter().find(|e| e.id == id) {
            e.set_state(EntryState::Removed);
        }
        let mut removed: Vec<UplinkId> = next
            .iter()
            .filter(|e| e.state() == EntryState::Removed)
            .map(|e| e.id)
            .collect();
        removed.sort();
        let excess = removed.len().saturating_sub(KEPT_REMOVED);
        if excess > 0 {
            let gone = &removed[..excess];
            next.retain(|e| !gone.contains(&e.id));
            self.entries.store(Arc::new(next));
        }
    }

    /// The entry named `name` that runs (attaching or running), if any.
    pub fn active(&self, name: &str) -> Option<Arc<UplinkEntry>> {
        self.load()
            .iter()
            .find(|e| {
                e.name == name && matches!(e.state(), EntryState::Attaching | EntryState::Running)
            })
            .cloned()
    }

    /// Take the entry `id` out of the table (its counters go with it); `None` if it is not
    /// there.
    pub fn remove(&self, id: UplinkId) -> Option<Arc<UplinkEntry>> {
        let _w = lock(&self.write);
        let mut next: Vec<Arc<UplinkEntry>> = self.entries.load().as_ref().clone();
        let at = next.iter().position(|e| e.id == id)?;
        let removed = next.remove(at);
        self.entries.store(Arc::new(next));
        Some(removed)
    }
}

/// What a sink's entry is made of, before it has an id.
#[derive(Debug)]
pub struct StartEntry {
    pub name: String,
    pub lanes: Vec<LaneMetrics>,
    pub spools: Vec<Arc<SpoolMetrics>>,
    pub tc: serde_json::Value,
}

fn lock(m: &Mutex<()>) -> std::sync::MutexGuard<'_, ()> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, shards: usize) -> StartEntry {
        StartEntry {
            name: name.to_string(),
            lanes: (0..shards).map(|_| LaneMetrics::new(false)).collect(),
            spools: Vec::new(),
            tc: serde_json::Value::Null,
        }
    }

    fn names(t: &UplinkTable) -> Vec<(u32, String)> {
        t.load().iter().map(|e| (e.id.0, e.name.clone())).collect()
    }

    #[test]
    fn ids_follow_config_order_at_start_and_are_never_reused() {
        let t = UplinkTable::at_start([entry("a", 2), entry("b", 2), entry("c", 2)]);
        assert_eq!(
            names(&t),
            [(0, "a".into()), (1, "b".into()), (2, "c".into())]
        );
        assert!(t.load().iter().all(|e| e.state() == EntryState::Running));
        let b = t.by_name("b").expect("b");
        t.remove(b.id).expect("removed");
        // Added again under the same name: a new id, not 1.
        let again = t.attach(1, entry("b", 2));
        assert_eq!(again.id, UplinkId(3));
        assert_eq!(again.state(), EntryState::Attaching);
        let d = t.attach(usize::MAX, entry("d", 2));
        assert_eq!(d.id, UplinkId(4));
        assert_eq!(
            names(&t),
            [
                (0, "a".into()),
                (3, "b".into()),
                (2, "c".into()),
                (4, "d".into())
            ]
        );
        assert!(t.by_id(UplinkId(1)).is_none());
        assert!(t.remove(UplinkId(1)).is_none());
    }

    #[test]
    fn removed_entries_stay_visible_bounded_and_give_way_to_a_new_one_of_their_name() {
        let t = UplinkTable::at_start([entry("a", 1), entry("b", 1)]);
        let b = t.by_name("b").expect("b");
        t.retire(b.id);
        assert_eq!(b.state(), EntryState::Removed);
        assert!(t.active("b").is_none());
        assert_eq!(t.load().len(), 2, "kept, its counts visible");
        let again = t.attach(usize::MAX, entry("b", 1));
        assert_eq!(names(&t), [(0, "a".into()), (again.id.0, "b".into())]);
        for i in 0..(KEPT_REMOVED + 3) {
            let e = t.attach(usize::MAX, entry(&format!("x{i}"), 1));
            t.retire(e.id);
        }
        let removed = t
            .load()
            .iter()
            .filter(|e| e.state() == EntryState::Removed)
            .count();
        assert_eq!(removed, KEPT_REMOVED);
        assert!(t.by_name("x0").is_none(), "the oldest went first");
        assert!(t.active("a").is_some());
    }

    #[test]
    fn removing_the_middle_sink_leaves_the_others_counters_where_they_were() {
        let t = UplinkTable::at_start([entry("a", 2), entry("b", 2), entry("c", 2)]);
        // Shard 1 counts into c's normal lane (the shard holds the same Arc).
        let c_shard1 = t.by_name("c").expect("c").lanes[1].normal.clone();
        c_shard1.packs_sent.inc();
        let reader_before = t.load();
        t.remove(UplinkId(1)).expect("b removed");
        let c = t.by_name("c").expect("c");
        assert_eq!(c.id, UplinkId(2));
        assert!(Arc::ptr_eq(&c.lanes[1].normal, &c_shard1));
        assert_eq!(c.lanes[1].normal.packs_sent.get(), 1);
        assert_eq!(c.lanes[0].normal.packs_sent.get(), 0);
        // A reader that loaded before the removal keeps a consistent view.
        assert_eq!(reader_before.len(), 3);
        assert_eq!(t.load().len(), 2);
    }
}
