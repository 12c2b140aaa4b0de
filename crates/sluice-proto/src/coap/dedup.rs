//! Message-id de-duplication (RFC 7252 §4.5): a bounded table of recently seen
//! `(peer, message id)` keys, each remembered for its lifetime (EXCHANGE_LIFETIME for a CON,
//! NON_LIFETIME for a NON), holding what the exchange produced so a duplicate gets the same
//! answer.
//!
//! Owns: the table, its expiry and its bound. Does not own: clocks (the caller passes `now`)
//! or what a duplicate is answered with (the value `V` the caller stored).
//!
//! Invariants: at most `capacity` entries and at most `max_bytes` charged (each entry is
//! charged `overhead` when inserted plus what [`DedupTable::charge`] adds for its answer);
//! when full, the oldest inserted entry is evicted (counted in [`DedupTable::evictions`] when
//! it had not expired yet); an expired entry is never reported as a duplicate.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// What the table knows about a key.
#[derive(Debug, PartialEq, Eq)]
pub enum Seen<'a, V> {
    /// Not seen within its lifetime: a new exchange.
    New,
    /// Seen, and its answer is not known yet.
    InProgress,
    /// Seen and answered with this.
    Done(&'a V),
}

#[derive(Debug)]
struct Entry<V> {
    expires: Instant,
    seq: u64,
    value: Option<V>,
    /// Bytes charged for this entry (overhead + its answer).
    cost: usize,
}

/// A bounded de-duplication table.
#[derive(Debug)]
pub struct DedupTable<K, V> {
    map: HashMap<K, Entry<V>>,
    /// Insertion order: `(key, seq)`; a stale seq (the key was re-inserted) is skipped.
    order: VecDeque<(K, u64)>,
    capacity: usize,
    /// Bytes the entries may be charged in all, and what they are charged now.
    max_bytes: usize,
    bytes: usize,
    /// What an entry costs before its answer: key, entry, order slot, the caller's value.
    overhead: usize,
    seq: u64,
    evictions: u64,
    /// Paces sweeps of a full table for expired entries.
    sweeps: SweepPace,
}

/// Paces the sweeps of a full bounded table (this one, and the edge's device and per-source
/// tables): a sweep scans the whole table, so under load it may run at most once a second,
/// never once per insert.
#[derive(Debug, Default, Clone, Copy)]
pub struct SweepPace {
    last: Option<Instant>,
}

impl SweepPace {
    const EVERY: Duration = Duration::from_secs(1);

    /// Whether a sweep may run at `now`; if so, it counts as run.
    pub fn due(&mut self, now: Instant) -> bool {
        if self.last.is_some_and(|t| now < t + Self::EVERY) {
            return false;
        }
        self.last = Some(now);
        true
    }
}

impl<K: Hash + Eq + Copy, V> DedupTable<K, V> {
    /// A table of at most `capacity` entries, bounded by entries only.
    pub fn new(capacity: usize) -> Self {
        Self::with_bytes(capacity, usize::MAX, 0)
    }

    /// A table of at most `capacity` entries and `max_bytes` charged, each entry costing
    /// `overhead` plus what [`DedupTable::charge`] adds.
    pub fn with_bytes(capacity: usize, max_bytes: usize, overhead: usize) -> Self {
        DedupTable {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
            max_bytes,
            bytes: 0,
            overhead,
            seq: 0,
            evictions: 0,
            sweeps: SweepPace::default(),
        }
    }

    /// Look `key` up at `now`.
    pub fn check(&self, key: &K, now: Instant) -> Seen<'_, V> {
        match self.map.get(key) {
            Some(e) if e.expires > now => match &e.value {
                Some(v) => Seen::Done(v),
                None => Seen::InProgress,
            },
            _ => Seen::New,
        }
    }

    /// Remember `key` as in progress for `lifetime` from `now` (replacing an expired entry).
    pub fn insert(&mut self, key: K, lifetime: Duration, now: Instant) {
        self.expire(now);
        if self.map.len() >= self.capacity && self.sweeps.due(now) {
            // Expired entries behind a live one in the insertion order: sweep them first, so
            // a live entry is evicted (and counted) only when nothing had expired. Paced: a
            // full table under load must not cost a scan per insert.
            let mut freed = 0;
            self.map.retain(|_, e| {
                let keep = e.expires > now;
                freed += if keep { 0 } else { e.cost };
                keep
            });
            self.bytes -= freed;
        }
        while self.map.len() >= self.capacity
            || self.bytes.saturating_add(self.overhead) > self.max_bytes
        {
            if !self.pop_oldest(now) {
                break;
            }
        }
        self.seq += 1;
        let old = self.map.insert(
            key,
            Entry {
                expires: now + lifetime,
                seq: self.seq,
                value: None,
                cost: self.overhead,
            },
        );
        self.bytes += self.overhead;
        if let Some(old) = old {
            self.bytes -= old.cost;
        }
        self.order.push_back((key, self.seq));
    }

    /// Charge `key` `bytes` more (the answer it now holds), evicting the oldest other
    /// entries while the table is over `max_bytes`; an answer that does not fit even alone
    /// is not kept: the entry is removed (a duplicate is then served afresh).
    pub fn charge(&mut self, key: &K, bytes: usize, now: Instant) {
        let Some(e) = self.map.get_mut(key) else {
            return;
        };
        e.cost += bytes;
        let seq = e.seq;
        self.bytes += bytes;
        while self.bytes > self.max_bytes {
            match self.order.front() {
                Some((k, s)) if k == key && *s == seq => {
                    // Only this one is left (or it is the oldest): too large to keep.
                    self.evictions += 1;
                    self.remove(key);
                    return;
                }
                Some(_) => {
                    if !self.pop_oldest(now) {
                        break;
                    }
                }
                None => break,
            }
        }
    }

    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Store the answer of `key` (ignored when it was evicted meanwhile).
    pub fn complete(&mut self, key: &K, value: V) {
        if let Some(e) = self.map.get_mut(key) {
            e.value = Some(value);
        }
    }

    /// Forget `key` (an exchange that must be answered afresh if it comes again).
    pub fn remove(&mut self, key: &K) {
        if let Some(e) = self.map.remove(key) {
            self.bytes -= e.cost;
        }
    }

    /// Drop expired entries from the front of the insertion order.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&(key, seq)) = self.order.front() {
            match self.map.get(&key) {
                Some(e) if e.seq == seq && e.expires > now => break,
                Some(e) if e.seq == seq => {
                    self.remove(&key);
                }
                _ => {}
            }
            self.order.pop_front();
        }
        // A table of short-lived keys behind a long-lived one: keep `order` bounded too.
        if self.order.len() > self.capacity.saturating_mul(2) {
            let map = &self.map;
            self.order
                .retain(|(k, seq)| map.get(k).is_some_and(|e| e.seq == *seq));
        }
    }

    /// Evict the oldest live entry; false when there is none.
    fn pop_oldest(&mut self, now: Instant) -> bool {
        while let Some((key, seq)) = self.order.pop_front() {
            if let Some(e) = self.map.get(&key) {
                if e.seq == seq {
                    if e.expires > now {
                        self.evictions += 1;
                    }
                    self.remove(&key);
                    return true;
                }
            }
        }
        false
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Entries evicted before their lifetime ended (the table was full).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn sweeps_are_paced_to_one_a_second() {
        let t0 = Instant::now();
        let mut pace = SweepPace::default();
        assert!(pace.due(t0));
        assert!(!pace.due(t0 + Duration::from_millis(999)));
        assert!(pace.due(t0 + Duration::from_secs(1)));
    }

    #[test]
    fn a_key_is_new_then_in_progress_then_done_until_it_expires() {
        let t0 = Instant::now();
        let mut t: DedupTable<(u8, u16), &str> = DedupTable::new(8);
        assert_eq!(t.check(&(1, 7), t0), Seen::New);
        t.insert((1, 7), 10 * S, t0);
        assert_eq!(t.check(&(1, 7), t0 + S), Seen::InProgress);
        t.complete(&(1, 7), "ack");
        assert_eq!(t.check(&(1, 7), t0 + 9 * S), Seen::Done(&"ack"));
        assert_eq!(t.check(&(1, 7), t0 + 10 * S), Seen::New);
        assert_eq!(t.check(&(2, 7), t0), Seen::New, "another peer");
    }

    #[test]
    fn a_full_table_evicts_the_oldest_and_counts_it() {
        let t0 = Instant::now();
        let mut t: DedupTable<u16, ()> = DedupTable::new(3);
        for mid in 0..5 {
            t.insert(mid, 100 * S, t0);
        }
        assert_eq!(t.len(), 3);
        assert_eq!(t.evictions(), 2);
        assert_eq!(t.check(&0, t0), Seen::New);
        assert_eq!(t.check(&4, t0), Seen::InProgress);
        // Expired entries make room without counting as evictions.
        t.insert(9, 100 * S, t0 + 200 * S);
        assert_eq!(t.len(), 1);
        assert_eq!(t.evictions(), 2);
    }

    #[test]
    fn the_table_is_bounded_in_bytes_and_an_answer_too_large_alone_is_not_kept() {
        let t0 = Instant::now();
        let mut t: DedupTable<u16, ()> = DedupTable::with_bytes(1000, 1000, 100);
        for mid in 0..5 {
            t.insert(mid, 100 * S, t0);
            t.complete(&mid, ());
            t.charge(&mid, 150, t0);
        }
        // 250 B each: four fit in 1000 B.
        assert_eq!(t.len(), 4);
        assert!(t.bytes() <= 1000, "{}", t.bytes());
        assert_eq!(t.check(&0, t0), Seen::New, "the oldest went");
        assert_eq!(t.evictions(), 1);
        t.insert(9, 100 * S, t0);
        t.charge(&9, 5000, t0);
        assert_eq!(t.check(&9, t0), Seen::New, "too large to keep");
        assert!(t.bytes() <= 1000);
        t.expire(t0 + 200 * S);
        assert_eq!((t.len(), t.bytes()), (0, 0));
    }

    #[test]
    fn a_reinserted_key_is_not_removed_by_its_stale_order_entry() {
        let t0 = Instant::now();
        let mut t: DedupTable<u16, ()> = DedupTable::new(4);
        t.insert(1, S, t0);
        t.insert(2, 100 * S, t0);
        // Key 1 expired and is inserted again with a long lifetime.
        t.insert(1, 100 * S, t0 + 2 * S);
        t.expire(t0 + 3 * S);
        assert_eq!(t.check(&1, t0 + 3 * S), Seen::InProgress);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn short_lived_keys_behind_a_long_lived_one_keep_the_order_bounded() {
        let t0 = Instant::now();
        let mut t: DedupTable<u16, ()> = DedupTable::new(4);
        t.insert(0, 1000 * S, t0);
        for i in 1..1000u16 {
            let now = t0 + S * i as u32;
            t.insert(i, S / 2, now);
        }
        assert!(t.order.len() <= 2 * 4 + 1, "{}", t.order.len());
        assert_eq!(t.evictions(), 0);
    }
}
