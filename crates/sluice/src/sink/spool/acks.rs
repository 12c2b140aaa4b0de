//! Cloud acknowledgements that ran ahead of the spool's ack window, kept as ranges.
//!
//! The engine holds out-of-order acks in a set bounded by its `ack_window` (seqs at most that
//! far above its ack cursor). While a backlog drains, live records far above the cursor are
//! acknowledged long before the cursor gets there (and newest-first drains the backlog from
//! the top): those acks wait here until they fall inside the window. Acks arrive in runs, so
//! they are stored as disjoint inclusive ranges: memory grows with the number of gaps (about
//! the inflight window and the number of streams), not with the number of records.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent inclusive ranges of acknowledged seqs.
#[derive(Debug, Default)]
pub struct AckRanges {
    /// start → end (inclusive).
    ranges: BTreeMap<u64, u64>,
}

impl AckRanges {
    /// Adds `seq`, merging with neighbouring ranges.
    pub fn insert(&mut self, seq: u64) {
        let mut start = seq;
        let mut end = seq;
        if let Some((&s, &e)) = self.ranges.range(..=seq).next_back() {
            if e >= seq {
                return;
            }
            if e + 1 == seq {
                start = s;
                self.ranges.remove(&s);
            }
        }
        if let Some(e) = seq.checked_add(1).and_then(|n| self.ranges.remove(&n)) {
            end = e;
        }
        self.ranges.insert(start, end);
    }

    /// The lowest range.
    pub fn first(&self) -> Option<(u64, u64)> {
        self.ranges.first_key_value().map(|(&s, &e)| (s, e))
    }

    /// Forgets every seq at or below `seq`.
    pub fn remove_through(&mut self, seq: u64) {
        while let Some((s, e)) = self.first() {
            if s > seq {
                break;
            }
            self.ranges.remove(&s);
            if e > seq {
                self.ranges.insert(seq + 1, e);
                break;
            }
        }
    }

    /// Number of ranges held (for tests and the memory argument above).
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn runs_in_either_direction_merge_into_one_range() {
        let mut a = AckRanges::default();
        for s in (100..200).rev() {
            a.insert(s);
        }
        for s in 300..400 {
            a.insert(s);
        }
        assert_eq!(a.range_count(), 2);
        for s in 200..300 {
            a.insert(s);
        }
        assert_eq!(a.range_count(), 1);
        assert_eq!(a.first(), Some((100, 399)));
        a.remove_through(150);
        assert_eq!(a.first(), Some((151, 399)));
        a.remove_through(1000);
        assert!(a.is_empty());
    }

    proptest! {
        #[test]
        fn behaves_like_a_set(seqs in proptest::collection::vec(1u64..200, 0..300), cut in 0u64..220) {
            let mut a = AckRanges::default();
            let mut model = std::collections::BTreeSet::new();
            for s in &seqs {
                a.insert(*s);
                model.insert(*s);
            }
            a.remove_through(cut);
            model.retain(|&s| s > cut);
            let mut got = std::collections::BTreeSet::new();
            let mut prev_end: Option<u64> = None;
            while let Some((s, e)) = a.first() {
                prop_assert!(s <= e);
                if let Some(p) = prev_end { prop_assert!(s > p + 1, "ranges are merged"); }
                prev_end = Some(e);
                got.extend(s..=e);
                a.ranges.remove(&s);
            }
            prop_assert_eq!(got, model);
        }
    }
}
