//! A topic-filter trie: insert filters with values, find the values of every filter that
//! matches a topic name.
//!
//! Used by each shard for its devices' subscriptions and by the control plane for the
//! read-mostly snapshot of which shards subscribe to what. Matching walks the topic's levels
//! once per branch (`literal`, `+`, `#`), so cost grows with topic depth and the number of
//! matching filters, not with the number of filters stored. `$`-topics are not matched by a
//! wildcard at the first level (MQTT §4.7.2).

use std::collections::HashMap;

#[derive(Debug, Clone)]
pub struct TopicTrie<V> {
    root: Node<V>,
    len: usize,
}

#[derive(Debug, Clone)]
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

impl<V> Default for TopicTrie<V> {
    fn default() -> Self {
        TopicTrie {
            root: Node::default(),
            len: 0,
        }
    }
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

    /// Remove the entries under `filter` for which `pred` is true; returns how many.
    pub fn remove_where(&mut self, filter: &str, mut pred: impl FnMut(&V) -> bool) -> usize {
        let levels: Vec<&str> = filter.split('/').collect();
        let removed = Self::remove_rec(&mut self.root, &levels, &mut pred);
        self.len -= removed;
        removed
    }

    fn remove_rec(node: &mut Node<V>, levels: &[&str], pred: &mut impl FnMut(&V) -> bool) -> usize {
        let Some((first, rest)) = levels.split_first() else {
            let before = node.exact.len();
            node.exact.retain(|v| !pred(v));
            return before - node.exact.len();
        };
        if *first == "#" && rest.is_empty() {
            let before = node.hash.len();
            node.hash.retain(|v| !pred(v));
            return before - node.hash.len();
        }
        if *first == "+" {
            let Some(child) = node.plus.as_mut() else {
                return 0;
            };
            let n = Self::remove_rec(child, rest, pred);
            if child.is_empty() {
                node.plus = None;
            }
            n
        } else {
            let Some(child) = node.children.get_mut(*first) else {
                return 0;
            };
            let n = Self::remove_rec(child, rest, pred);
            if child.is_empty() {
                node.children.remove(*first);
            }
            n
        }
    }

    /// Call `f` for every value whose filter matches `topic`.
    pub fn for_each_match<'a>(&'a self, topic: &str, mut f: impl FnMut(&'a V)) {
        let dollar = topic.starts_with('$');
        Self::match_rec(&self.root, topic, true, dollar, &mut f);
    }

    fn match_rec<'a>(
        node: &'a Node<V>,
        rest: &str,
        first: bool,
        dollar: bool,
        f: &mut impl FnMut(&'a V),
    ) {
        let wild_ok = !(first && dollar);
        if wild_ok {
            // `#` matches this level and everything below, including the parent ("a/#" ~ "a").
            node.hash.iter().for_each(&mut *f);
        }
        let (level, tail) = match rest.find('/') {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let mut visit = |child: &'a Node<V>| match tail {
            Some(t) => Self::match_rec(child, t, false, dollar, f),
            None => {
                child.exact.iter().for_each(&mut *f);
                child.hash.iter().for_each(&mut *f);
            }
        };
        if let Some(child) = node.children.get(level) {
            visit(child);
        }
        if wild_ok {
            if let Some(child) = node.plus.as_deref() {
                visit(child);
            }
        }
    }
}

impl<V> Node<V> {
    fn is_empty(&self) -> bool {
        self.children.is_empty()
            && self.plus.is_none()
            && self.hash.is_empty()
            && self.exact.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn inserting_an_equal_value_replaces_it() {
        let mut t = TopicTrie::new();
        t.insert("x", 5);
        t.insert("x", 5);
        assert_eq!(t.len(), 1);
    }
}
