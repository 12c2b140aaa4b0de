//! The subscription store: which shards subscribe to which filters, published to the data
//! plane as a read-mostly [`SubscriptionSnapshot`] through `arc-swap`.
//!
//! Owns: the authoritative table (filter → shards with at least one subscriber), the two tries
//! a snapshot carries (ordinary filters → shard ids; shared subscriptions
//! `$share/{group}/{filter}` → one [`SharedGroup`] per group under its filter), publishing
//! them, and absorbing the snapshot's pending overlay.
//!
//! Does not own: per-device subscriptions or shared-group members (each shard keeps its own),
//! the retained replay (`retained`), or routing (`shard::router` reads the snapshot).
//!
//! Incremental publication (left-right): the store keeps two copies of the tries. `front` is
//! the one in the published snapshot; `back` is the one published before it. A publication
//! patches `back` in place — only the filters changed since `back` was published, each
//! re-synced from the table — publishes it, and the old `front` becomes the new `back`. A
//! publication therefore costs the filters it changes, not the whole table, and nothing ever
//! mutates a trie a snapshot still shows (`Arc::get_mut` proves no reader holds `back`). In
//! the rare case a reader still holds `back` (a shard mid-route since two publications ago),
//! the store builds fresh tries from the table instead, counted in
//! `sluice_control_snapshot_full_builds_total`. Memory: two copies of the tries.
//!
//! Invariants: after [`SubscriptionStore::publish`] the published tries hold exactly what a
//! from-scratch [`build`] of the table holds (the proptest below checks any sequence of adds
//! and removes); `back` differs from the table only in the filters listed in `back_stale`;
//! every publication counts once in `snapshot_rebuilds` (the metric keeps its name: it counts
//! publications); a `(filter, shard)` pair added or removed is taken off `pending` by the
//! publication that includes the change.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytestring::ByteString;
use sluice_proto::mqtt::topic;

use super::ControlMetrics;
use crate::shard::trie::TopicTrie;

/// Which shards subscribe to which filters, as the data plane reads it.
#[derive(Debug, Default, Clone)]
pub struct SubscriptionSnapshot {
    pub trie: Arc<TopicTrie<u16>>,
    /// Shared subscriptions (`$share/{group}/{filter}`), stored under their filter: each
    /// group once, with the shards that have members.
    pub shared: Arc<TopicTrie<SharedGroup>>,
    /// Filters a shard has just got its first subscriber for and the control plane has not
    /// absorbed into `trie` yet: the shard adds them itself the moment it reads the SUBSCRIBE
    /// (a copy-on-write of this short list; the tries are shared), so a message another shard
    /// routes right after is not missed for as long as the control plane takes to publish.
    /// At most [`MAX_PENDING`]; beyond that shards leave it to the control plane, which
    /// removes each entry as it absorbs it.
    pub pending: Vec<(ByteString, u16)>,
}

/// Most entries in [`SubscriptionSnapshot::pending`] (each publish checks them all).
pub const MAX_PENDING: usize = 64;

/// One shared subscription as the data plane sees it: the publishing shard picks one of
/// `shards` (round robin) and that shard picks one of its local members.
#[derive(Debug, Clone)]
pub struct SharedGroup {
    /// The whole subscription, `$share/{group}/{filter}`: the key shards know it by.
    pub key: ByteString,
    /// Shards with at least one member, ascending.
    pub shards: Vec<u16>,
}

impl PartialEq for SharedGroup {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

pub type SharedSnapshot = Arc<ArcSwap<SubscriptionSnapshot>>;

/// The tries one snapshot carries.
#[derive(Debug, Default, Clone)]
pub struct Tries {
    pub trie: Arc<TopicTrie<u16>>,
    pub shared: Arc<TopicTrie<SharedGroup>>,
}

/// Build both tries from scratch from `filters` (filter → shards).
pub fn build(filters: &HashMap<ByteString, BTreeSet<u16>>) -> Tries {
    let mut trie = TopicTrie::new();
    let mut shared = TopicTrie::new();
    for (filter, shards) in filters {
        if let Some((_, inner)) = topic::shared_subscription(filter) {
            shared.insert(inner, shared_group(filter, shards));
            continue;
        }
        for s in shards {
            trie.insert(filter, *s);
        }
    }
    Tries {
        trie: Arc::new(trie),
        shared: Arc::new(shared),
    }
}

fn shared_group(key: &ByteString, shards: &BTreeSet<u16>) -> SharedGroup {
    SharedGroup {
        key: key.clone(),
        shards: shards.iter().copied().collect(),
    }
}

/// Make `filter`'s entries in the tries what the table says (none when it is not there).
fn sync_filter(
    filters: &HashMap<ByteString, BTreeSet<u16>>,
    trie: &mut TopicTrie<u16>,
    shared: &mut TopicTrie<SharedGroup>,
    filter: &ByteString,
) {
    let shards = filters.get(filter);
    if let Some((_, inner)) = topic::shared_subscription(filter) {
        shared.remove_where(inner, |g| g.key == *filter);
        if let Some(shards) = shards {
            shared.insert(inner, shared_group(filter, shards));
        }
        return;
    }
    // Every value in this filter's slot is a shard subscribing to exactly this filter.
    trie.remove_where(filter, |_| true);
    for s in shards.into_iter().flatten() {
        trie.insert(filter, *s);
    }
}

/// The subscription table and its published snapshot (see the module docs).
pub struct SubscriptionStore {
    filters: HashMap<ByteString, BTreeSet<u16>>,
    /// The tries of the published snapshot.
    front: Tries,
    /// The tries published before `front`: patched and published next.
    back: Tries,
    /// Filters whose entries in `back` may differ from the table.
    back_stale: HashSet<ByteString>,
    /// Filters whose shards changed since the last publication.
    touched: HashSet<ByteString>,
    /// `(filter, shard)` pairs added or removed since the last publication: off `pending`.
    absorbed: Vec<(ByteString, u16)>,
    snapshot: SharedSnapshot,
    metrics: Arc<ControlMetrics>,
}

impl SubscriptionStore {
    pub fn new(snapshot: SharedSnapshot, metrics: Arc<ControlMetrics>) -> SubscriptionStore {
        SubscriptionStore {
            filters: HashMap::new(),
            front: Tries::default(),
            back: Tries::default(),
            back_stale: HashSet::new(),
            touched: HashSet::new(),
            absorbed: Vec::new(),
            snapshot,
            metrics,
        }
    }

    /// `filter` has its first subscriber on `shard`.
    pub fn add(&mut self, shard: u16, filter: ByteString) {
        self.absorbed.push((filter.clone(), shard));
        if self
            .filters
            .entry(filter.clone())
            .or_default()
            .insert(shard)
        {
            self.touched.insert(filter);
        }
    }

    /// `filter` lost its last subscriber on `shard`.
    pub fn remove(&mut self, shard: u16, filter: ByteString) {
        self.absorbed.push((filter.clone(), shard));
        let Some(set) = self.filters.get_mut(&filter) else {
            return;
        };
        if set.remove(&shard) {
            if set.is_empty() {
                self.filters.remove(&filter);
            }
            self.touched.insert(filter);
        }
    }

    /// Publish a snapshot with every change since the last one, if there was any change (or
    /// any pending entry to absorb). Returns whether it published.
    pub fn publish(&mut self) -> bool {
        if self.touched.is_empty() && self.absorbed.is_empty() {
            return false;
        }
        let tries = if self.touched.is_empty() {
            // Only absorbed entries (filters that were already there): same tries.
            self.front.clone()
        } else {
            let next = self.patched_back();
            self.back = std::mem::replace(&mut self.front, next.clone());
            // The old front was current when published; it lacks this batch only.
            self.back_stale = std::mem::take(&mut self.touched);
            next
        };
        let absorbed = std::mem::take(&mut self.absorbed);
        self.snapshot.rcu(|old| SubscriptionSnapshot {
            trie: tries.trie.clone(),
            shared: tries.shared.clone(),
            pending: old
                .pending
                .iter()
                .filter(|p| !absorbed.contains(p))
                .cloned()
                .collect(),
        });
        self.metrics.snapshot_rebuilds.inc();
        true
    }

    /// `back` brought up to the table, in place when no reader holds it, else built afresh.
    fn patched_back(&mut self) -> Tries {
        let mut next = std::mem::take(&mut self.back);
        let stale = std::mem::take(&mut self.back_stale);
        if let (Some(trie), Some(shared)) =
            (Arc::get_mut(&mut next.trie), Arc::get_mut(&mut next.shared))
        {
            for filter in stale.iter().chain(self.touched.difference(&stale)) {
                sync_filter(&self.filters, trie, shared, filter);
            }
            return next;
        }
        self.metrics.snapshot_full_builds.inc();
        tracing::debug!(
            filters = self.filters.len(),
            "spare subscription tries still read; building afresh"
        );
        build(&self.filters)
    }

    /// The table, for tests comparing against a from-scratch [`build`].
    #[cfg(test)]
    pub(crate) fn filters(&self) -> &HashMap<ByteString, BTreeSet<u16>> {
        &self.filters
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every topic of 1–4 levels over `a`, `b`, `c`, and a `$` topic.
    fn topics() -> Vec<String> {
        let mut out = vec!["$s".to_string(), "$s/a".to_string()];
        let mut level: Vec<String> = vec![String::new()];
        for _ in 0..4 {
            let mut next = Vec::new();
            for prefix in &level {
                for l in ["a", "b", "c"] {
                    let t = if prefix.is_empty() {
                        l.to_string()
                    } else {
                        format!("{prefix}/{l}")
                    };
                    out.push(t.clone());
                    next.push(t);
                }
            }
            level = next;
        }
        out
    }

    /// The same answers for every topic: sorted shards, and sorted (group, shards).
    fn assert_same(got: &SubscriptionSnapshot, want: &Tries) -> Result<(), TestCaseError> {
        prop_assert_eq!(got.trie.len(), want.trie.len());
        prop_assert_eq!(got.shared.len(), want.shared.len());
        for t in topics() {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            got.trie.for_each_match(&t, |s| a.push(*s));
            want.trie.for_each_match(&t, |s| b.push(*s));
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(&a, &b, "shards for {}", t);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            got.shared
                .for_each_match(&t, |g| a.push((g.key.clone(), g.shards.clone())));
            want.shared
                .for_each_match(&t, |g| b.push((g.key.clone(), g.shards.clone())));
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(&a, &b, "shared groups for {}", t);
        }
        Ok(())
    }

    fn filter_strategy() -> impl Strategy<Value = String> {
        let plain = prop::collection::vec(prop::sample::select(vec!["a", "b", "+"]), 1..4)
            .prop_flat_map(|levels| {
                (Just(levels), any::<bool>()).prop_map(|(levels, hash)| {
                    let mut f = levels.join("/");
                    if hash {
                        f.push_str("/#");
                    }
                    f
                })
            });
        prop_oneof![
            3 => plain.clone(),
            1 => Just("#".to_string()),
            2 => (prop::sample::select(vec!["g", "h"]), plain)
                .prop_map(|(g, f)| format!("$share/{g}/{f}")),
        ]
    }

    /// One step: add or remove `(shard, filter)`; then maybe publish, maybe while a reader
    /// holds the snapshot.
    fn op_strategy() -> impl Strategy<Value = (bool, u16, String, u8)> {
        (any::<bool>(), 0u16..4, filter_strategy(), 0u8..4)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn an_incremental_snapshot_equals_a_from_scratch_build(
            ops in prop::collection::vec(op_strategy(), 1..80),
        ) {
            let snapshot: SharedSnapshot = Arc::new(ArcSwap::from_pointee(SubscriptionSnapshot::default()));
            let metrics = Arc::new(ControlMetrics::default());
            let mut store = SubscriptionStore::new(snapshot.clone(), metrics.clone());
            let mut readers = Vec::new();
            let mut published = 0;
            for (add, shard, filter, then) in ops {
                if add {
                    store.add(shard, filter.into());
                } else {
                    store.remove(shard, filter.into());
                }
                match then {
                    // A reader keeps the current snapshot across the next publications.
                    0 => readers.push(snapshot.load_full()),
                    1 => readers.clear(),
                    _ => {}
                }
                if then != 3 && store.publish() {
                    published += 1;
                    assert_same(&snapshot.load(), &build(store.filters()))?;
                }
            }
            if store.publish() {
                published += 1;
            }
            assert_same(&snapshot.load(), &build(store.filters()))?;
            prop_assert_eq!(metrics.snapshot_rebuilds.get(), published);
        }
    }

    #[test]
    fn publications_patch_the_spare_tries_in_place_while_no_reader_holds_them() {
        let snapshot: SharedSnapshot =
            Arc::new(ArcSwap::from_pointee(SubscriptionSnapshot::default()));
        let metrics = Arc::new(ControlMetrics::default());
        let mut store = SubscriptionStore::new(snapshot.clone(), metrics.clone());
        for i in 0..10u16 {
            store.add(i % 3, format!("f/{i}").into());
            assert!(store.publish());
        }
        assert!(!store.publish(), "nothing changed");
        assert_eq!(metrics.snapshot_full_builds.get(), 0);
        assert_eq!(metrics.snapshot_rebuilds.get(), 10);
        // A reader holding a snapshot across two publications forces one fresh build.
        let held = snapshot.load_full();
        store.add(0, "g".into());
        store.publish();
        store.add(1, "g".into());
        store.publish();
        assert_eq!(metrics.snapshot_full_builds.get(), 1);
        assert_eq!(held.trie.len(), 10, "a published snapshot never changes");
        assert_eq!(snapshot.load().trie.len(), 12);
    }
}
