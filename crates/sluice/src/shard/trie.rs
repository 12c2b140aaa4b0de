//! A topic-filter trie: insert filters with values, find the values of every filter that
//! matches a topic name.
//!
//! Used by each shard for its devices' subscriptions and by the control plane for the
//! read-mostly snapshot of which shards subscribe to what. Matching walks the topic's levels
//! once per branch (`literal`, `+`, `#`), so cost grows with topic depth and the number of
//! matching filters, not with the number of filters stored; it visits each trie node at most
//! once per topic. `$`-topics are not matched by a wildcard at the first level (MQTT §4.7.2).
//!
//! Invariants:
//! - **No recursion, anywhere** (insert, match, remove, drop, debug): filters and topics come
//!   from devices and the cloud, and a trie one node per level deep must not cost stack per
//!   level. Walks keep their pending branches in a heap `Vec` (allocated only when a walk
//!   branches); `Drop` takes the tree apart with an explicit stack. The gateway also caps the
//!   levels a device may use (`mqtt.max_topic_levels`, see `shard::limits`), but the trie does
//!   not rely on it.
//! - No node is empty except the root: `remove_where` prunes the branch it empties.
//! - `len()` is the number of values stored.

use std::collections::HashMap;
use std::fmt;

pub struct TopicTrie<V> {
    root: Node<V>,
    len: usize,
}

struct Node<V> {
    children: HashMap<Box<str>, Node<V>>,
    plus: Option<Box<Node<V>>>,
    /// Values of filters ending in `#` at this node's level.
    hash: Vec<V>,
    /// Values of filters ending exactly here.
    exact: Vec<V>,
}

impl<V> Default for Node<V> {
    fn default() -> Self {
        Node {
            children: HashMap::new(),
            plus: None,
            hash: Vec::new(),
            exact: Vec::new(),
        }
    }
}

impl<V> Drop for Node<V> {
    /// Iterative: the derived drop would recurse once per level (a 32,000-level filter
    /// overflowed a shard's stack). Every descendant is detached into a heap stack and dropped
    /// from there once it has no children of its own.
    fn drop(&mut self) {
        if self.children.is_empty() && self.plus.is_none() {
            return;
        }
        let mut stack: Vec<Node<V>> = Vec::new();
        detach_children(self, &mut stack);
        while let Some(mut node) = stack.pop() {
            detach_children(&mut node, &mut stack);
            // `node` drops here with no children: no recursion.
        }
    }
}

fn detach_children<V>(node: &mut Node<V>, stack: &mut Vec<Node<V>>) {
    stack.extend(std::mem::take(&mut node.children).into_values());
    if let Some(plus) = node.plus.take() {
        stack.push(*plus);
    }
}

impl<V> Default for TopicTrie<V> {
    fn default() -> Self {
        TopicTrie {
            root: Node::default(),
            len: 0,
        }
    }
}

impl<V> fmt::Debug for TopicTrie<V> {
    /// Only the size: a derived `Debug` would recurse through the nodes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TopicTrie").field("len", &self.len).finish()
    }
}

/// One step down from a node: to a literal child or to the `+` child.
enum Edge<'f> {
    Literal(&'f str),
    Plus,
}

impl<V: PartialEq> TopicTrie<V> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Add `value` under `filter` (the filter must already be valid). Replaces an equal value.
    pub fn insert(&mut self, filter: &str, value: V) {
        let mut node = &mut self.root;
        let mut levels = filter.split('/').peekable();
        while let Some(level) = levels.next() {
            if level == "#" && levels.peek().is_none() {
                Self::put(&mut node.hash, value, &mut self.len);
                return;
            }
            node = if level == "+" {
                node.plus.get_or_insert_with(Default::default)
            } else {
                node.children.entry(level.into()).or_default()
            };
        }
        Self::put(&mut node.exact, value, &mut self.len);
    }

    fn put(slot: &mut Vec<V>, value: V, len: &mut usize) {
        if let Some(existing) = slot.iter_mut().find(|v| **v == value) {
            *existing = value;
        } else {
            slot.push(value);
            *len += 1;
        }
    }

    /// Remove the entries under `filter` for which `pred` is true; returns how many. A branch
    /// left without values is pruned.
    pub fn remove_where(&mut self, filter: &str, mut pred: impl FnMut(&V) -> bool) -> usize {
        let (edges, slot) = split_filter(filter);
        // 1. Walk down and remove from the filter's slot.
        let mut node = &mut self.root;
        for edge in &edges {
            let next = match edge {
                Edge::Literal(level) => node.children.get_mut(*level),
                Edge::Plus => node.plus.as_deref_mut(),
            };
            let Some(next) = next else {
                return 0;
            };
            node = next;
        }
        let values = match slot {
            Slot::Hash => &mut node.hash,
            Slot::Exact => &mut node.exact,
        };
        let before = values.len();
        values.retain(|v| !pred(v));
        let removed = before - values.len();
        self.len -= removed;
        if removed == 0 || !node.is_empty() || edges.is_empty() {
            return removed;
        }
        // 2. The end node is empty: find the deepest node on the path that stays (it has
        //    values, or another branch), and cut the path's edge below it. What hangs below
        //    that edge is a chain of nodes that are now empty.
        let mut cut = 0;
        let mut node = &self.root;
        for (depth, edge) in edges.iter().enumerate() {
            if depth > 0 && (node.has_values() || node.branches() > 1) {
                cut = depth;
            }
            let next = match edge {
                Edge::Literal(level) => node.children.get(*level),
                Edge::Plus => node.plus.as_deref(),
            };
            let Some(next) = next else {
                return removed; // unreachable: step 1 walked this path
            };
            node = next;
        }
        // 3. Walk to the cut point and detach the empty chain (dropped iteratively).
        let mut node = &mut self.root;
        for edge in &edges[..cut] {
            let next = match edge {
                Edge::Literal(level) => node.children.get_mut(*level),
                Edge::Plus => node.plus.as_deref_mut(),
            };
            let Some(next) = next else {
                return removed; // unreachable: step 1 walked this path
            };
            node = next;
        }
        match edges[cut] {
            Edge::Literal(level) => drop(node.children.remove(level)),
            Edge::Plus => drop(node.plus.take()),
        }
        removed
    }

    /// Call `f` for every value whose filter matches `topic`.
    pub fn for_each_match<'a>(&'a self, topic: &str, mut f: impl FnMut(&'a V)) {
        let dollar = topic.starts_with('$');
        // Branches still to walk: (node, the topic levels below it). Allocated only when the
        // walk forks (a literal and a `+` child both match).
        let mut pending: Vec<(&'a Node<V>, &str)> = Vec::new();
        let mut current = Some((&self.root, topic));
        let mut at_root = true;
        loop {
            let (node, rest) = match current.take() {
                Some(next) => next,
                None => match pending.pop() {
                    Some(next) => next,
                    None => return,
                },
            };
            // Wildcards at the first level do not match `$` topics.
            let wild_ok = !(at_root && dollar);
            at_root = false;
            if wild_ok {
                // `#` matches this level and everything below, including the parent
                // ("a/#" ~ "a").
                node.hash.iter().for_each(&mut f);
            }
            let (level, tail) = match rest.find('/') {
                Some(i) => (&rest[..i], Some(&rest[i + 1..])),
                None => (rest, None),
            };
            let literal = node.children.get(level);
            let plus = node.plus.as_deref().filter(|_| wild_ok);
            for child in [literal, plus].into_iter().flatten() {
                match tail {
                    Some(tail) if current.is_none() => current = Some((child, tail)),
                    Some(tail) => pending.push((child, tail)),
                    None => {
                        child.exact.iter().for_each(&mut f);
                        child.hash.iter().for_each(&mut f);
                    }
                }
            }
        }
    }
}

/// Where a filter's values live in its last node.
enum Slot {
    Exact,
    Hash,
}

/// A filter as the edges from the root to its node, and the slot at that node.
fn split_filter(filter: &str) -> (Vec<Edge<'_>>, Slot) {
    let mut edges = Vec::new();
    let mut levels = filter.split('/').peekable();
    while let Some(level) = levels.next() {
        if level == "#" && levels.peek().is_none() {
            return (edges, Slot::Hash);
        }
        edges.push(if level == "+" {
            Edge::Plus
        } else {
            Edge::Literal(level)
        });
    }
    (edges, Slot::Exact)
}

impl<V> Node<V> {
    fn has_values(&self) -> bool {
        !self.hash.is_empty() || !self.exact.is_empty()
    }

    fn branches(&self) -> usize {
        self.children.len() + usize::from(self.plus.is_some())
    }

    fn is_empty(&self) -> bool {
        !self.has_values() && self.branches() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sluice_proto::mqtt::topic;

    fn matches(filters: &[&str], topic: &str) -> Vec<usize> {
        let mut t = TopicTrie::new();
        for (i, f) in filters.iter().enumerate() {
            t.insert(f, i);
        }
        let mut out = Vec::new();
        t.for_each_match(topic, |v| out.push(*v));
        out.sort();
        out
    }

    /// How many nodes hang below the root (including it), counted without recursion.
    fn node_count<V>(t: &TopicTrie<V>) -> usize {
        let mut stack = vec![&t.root];
        let mut n = 0;
        while let Some(node) = stack.pop() {
            n += 1;
            stack.extend(node.children.values());
            stack.extend(node.plus.as_deref());
        }
        n
    }

    #[test]
    fn wildcards_match_as_the_mqtt_spec_says() {
        let f = [
            "a/b/c", "a/+/c", "a/#", "#", "+/+/+", "a/b", "+", "a/b/c/#", "b/#",
        ];
        assert_eq!(matches(&f, "a/b/c"), vec![0, 1, 2, 3, 4, 7]);
        assert_eq!(matches(&f, "a"), vec![2, 3, 6]);
        assert_eq!(matches(&f, "a/b"), vec![2, 3, 5]);
        assert_eq!(matches(&f, "b"), vec![3, 6, 8]);
        assert_eq!(matches(&["+/+"], "/x"), vec![0]);
        assert_eq!(matches(&["a/+"], "a/"), vec![0]);
    }

    #[test]
    fn dollar_topics_are_not_matched_by_leading_wildcards() {
        let f = ["#", "+/x", "$SYS/#", "$SYS/+"];
        assert_eq!(matches(&f, "$SYS/x"), vec![2, 3]);
    }

    #[test]
    fn remove_prunes_and_counts() {
        let mut t = TopicTrie::new();
        t.insert("a/+/c", 1);
        t.insert("a/+/c", 2);
        t.insert("a/#", 3);
        assert_eq!(t.len(), 3);
        assert_eq!(t.remove_where("a/+/c", |v| *v == 1), 1);
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove_where("a/+/c", |_| true), 1);
        assert_eq!(t.remove_where("a/#", |_| true), 1);
        assert!(t.is_empty());
        assert!(t.root.is_empty());
    }

    #[test]
    fn remove_prunes_only_the_emptied_branch() {
        let mut t = TopicTrie::new();
        t.insert("a/b/c/d", 1);
        t.insert("a/b", 2);
        t.insert("a/x/y", 3);
        assert_eq!(node_count(&t), 7); // root, a, b, c, d, x, y
        assert_eq!(t.remove_where("a/b/c/d", |_| true), 1);
        assert_eq!(node_count(&t), 5); // c and d gone; b keeps its value
        assert_eq!(t.remove_where("a/x/y", |_| true), 1);
        assert_eq!(node_count(&t), 3); // root, a, b
        assert_eq!(t.remove_where("a/b", |_| true), 1);
        assert_eq!(node_count(&t), 1);
        assert_eq!(t.remove_where("a/b", |_| true), 0);
    }

    #[test]
    fn inserting_an_equal_value_replaces_it() {
        let mut t = TopicTrie::new();
        t.insert("x", 5);
        t.insert("x", 5);
        assert_eq!(t.len(), 1);
    }

    /// 100,000 levels: before the trie was made iterative, each of insert (drop), match and
    /// remove recursed once per level and overflowed the stack. Run on a thread with a
    /// 256 KiB stack, so a walk that recursed even a few bytes per level would overflow.
    #[test]
    fn a_trie_100000_levels_deep_is_built_matched_removed_and_dropped_without_recursion() {
        const LEVELS: usize = 100_000;
        let run = || {
            let deep = vec!["a"; LEVELS].join("/");
            let deep_plus = format!("{}/+", vec!["a"; LEVELS - 1].join("/"));
            let deep_hash = format!("{}/#", vec!["a"; LEVELS / 2].join("/"));
            let mut t = TopicTrie::new();
            t.insert(&deep, 1);
            t.insert(&deep_plus, 2);
            t.insert(&deep_hash, 3);
            t.insert(&vec!["+"; LEVELS].join("/"), 4);
            assert_eq!(t.len(), 4);
            let mut hits = Vec::new();
            t.for_each_match(&deep, |v| hits.push(*v));
            hits.sort();
            assert_eq!(hits, vec![1, 2, 3, 4]);
            let mut hits = Vec::new();
            t.for_each_match(&format!("{deep}/b"), |v| hits.push(*v));
            assert_eq!(hits, vec![3]);
            assert_eq!(t.remove_where(&deep, |_| true), 1);
            assert_eq!(t.remove_where(&deep_plus, |_| true), 1);
            assert_eq!(t.len(), 2);
            let mut hits = Vec::new();
            t.for_each_match(&deep, |v| hits.push(*v));
            hits.sort();
            assert_eq!(hits, vec![3, 4]);
            // The remaining half-deep chain (under deep_hash) is pruned down to its value.
            assert!(node_count(&t) < LEVELS + LEVELS / 2 + 2);
            // Dropped with a deep literal chain and a deep `+` chain still in it.
            drop(t);
            // A trie dropped without any removal first.
            let mut t = TopicTrie::new();
            t.insert(&deep, 1);
            drop(t);
        };
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(run)
            .expect("spawn small-stack thread")
            .join()
            .expect("deep trie operations did not overflow a 256 KiB stack");
    }

    /// Filters over a small alphabet so that random topics often match them.
    fn filter_strategy() -> impl Strategy<Value = String> {
        let level = prop_oneof![
            3 => Just("a".to_string()),
            3 => Just("b".to_string()),
            1 => Just(String::new()),
            1 => Just("$x".to_string()),
            3 => Just("+".to_string()),
        ];
        (prop::collection::vec(level, 1..6), any::<bool>()).prop_map(|(mut levels, hash)| {
            if hash {
                levels.push("#".to_string());
            }
            // A filter is never empty ("" alone is not a valid filter).
            match levels.join("/") {
                f if f.is_empty() => "a".to_string(),
                f => f,
            }
        })
    }

    fn topic_strategy() -> impl Strategy<Value = String> {
        let level = prop_oneof![
            3 => Just("a"),
            3 => Just("b"),
            1 => Just(""),
            1 => Just("$x"),
        ];
        // A topic name is never empty ("" alone is not a valid name).
        prop::collection::vec(level, 1..7).prop_map(|levels| match levels.join("/") {
            t if t.is_empty() => "a".to_string(),
            t => t,
        })
    }

    proptest! {
        /// The trie answers exactly what `topic::matches` (the spec's rule, one filter at a
        /// time) answers, after inserting filters and removing some of them again.
        #[test]
        fn the_trie_matches_what_the_reference_matcher_matches(
            filters in prop::collection::vec(filter_strategy(), 0..24),
            remove in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
            topics in prop::collection::vec(topic_strategy(), 1..12),
        ) {
            let mut t = TopicTrie::new();
            let mut live: Vec<(String, usize)> = Vec::new();
            for (i, f) in filters.iter().enumerate() {
                t.insert(f, i);
                live.push((f.clone(), i));
            }
            for r in &remove {
                if live.is_empty() {
                    break;
                }
                let (f, v) = live.remove(r.index(live.len()));
                prop_assert_eq!(t.remove_where(&f, |x| *x == v), 1);
            }
            prop_assert_eq!(t.len(), live.len());
            for topic_name in &topics {
                let mut got = Vec::new();
                t.for_each_match(topic_name, |v| got.push(*v));
                got.sort();
                let mut want: Vec<usize> = live
                    .iter()
                    .filter(|(f, _)| topic::matches(f, topic_name))
                    .map(|(_, v)| *v)
                    .collect();
                want.sort();
                prop_assert_eq!(got, want, "topic {:?}", topic_name);
            }
            // Removing everything leaves only the root.
            for (f, v) in live.drain(..) {
                prop_assert_eq!(t.remove_where(&f, |x| *x == v), 1);
            }
            prop_assert!(t.is_empty());
            prop_assert_eq!(node_count(&t), 1);
        }
    }
}
