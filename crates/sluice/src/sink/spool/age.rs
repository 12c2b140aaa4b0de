//! How old the oldest unacknowledged record of a spool is, without reading the spool.
//!
//! Owns: [`AgeMarks`], a short list of (seq, time the gateway read the message) marks taken
//! as records are appended, from which the oldest unacknowledged record's read time is known
//! when the ack cursor moves (`sluice_spool_oldest_unacked_age_seconds`). Does not own: the
//! records (the engine) or the cursor (the spool's acks). Sans-IO: times are given.
//!
//! Invariants: at most [`MAX_MARKS`] marks (16 bytes each), whatever the backlog: marks are
//! at least `every` apart in read time ([`MARK_EVERY_MICROS`] at first; when the table is
//! full, `every` doubles and the marks closer than that are dropped, the oldest kept); marks
//! are in seq order and the first is the oldest record appended since the marks began. The
//! answer is never younger than the truth (records are appended in the order the shard read
//! them, give or take a mailbox hop): the mark at or before the first unacknowledged seq is
//! used, older by at most the spacing of the marks (100 ms; after thinning about
//! 2 × the backlog's time span / [`MAX_MARKS`]). Records recovered at start (appended before this process) carry no
//! mark: until they are acknowledged the age is unknown (`None`), not guessed.

use std::collections::VecDeque;

/// Most marks kept per spool (16 bytes each).
pub const MAX_MARKS: usize = 256;
/// Read times closer than this to the last mark add no mark.
pub const MARK_EVERY_MICROS: u64 = 100_000;

#[derive(Debug)]
pub struct AgeMarks {
    /// (seq, read time in µs since the Unix epoch), ascending seq.
    marks: VecDeque<(u64, u64)>,
    /// The first seq appended since the marks began (records below it are not marked).
    first_marked: Option<u64>,
    /// Least read time between two marks: [`MARK_EVERY_MICROS`], doubled each time the table
    /// fills (so the marks stay evenly spread over the whole backlog).
    every: u64,
}

impl Default for AgeMarks {
    fn default() -> Self {
        AgeMarks {
            marks: VecDeque::new(),
            first_marked: None,
            every: MARK_EVERY_MICROS,
        }
    }
}

impl AgeMarks {
    /// Record `seq`, read by the gateway at `received_us`, was appended.
    pub fn appended(&mut self, seq: u64, received_us: u64) {
        if self.first_marked.is_none() {
            self.first_marked = Some(seq);
        }
        if let Some(&(_, last)) = self.marks.back() {
            if received_us < last.saturating_add(self.every) {
                return;
            }
        }
        while self.marks.len() >= MAX_MARKS {
            // Thin: twice the spacing, keeping the oldest mark.
            self.every = self.every.saturating_mul(2);
            let every = self.every;
            let mut kept: Option<u64> = None;
            self.marks.retain(|&(_, t)| match kept {
                Some(k) if t < k.saturating_add(every) => false,
                _ => {
                    kept = Some(t);
                    true
                }
            });
        }
        self.marks.push_back((seq, received_us));
    }

    /// The read time (µs since the epoch) of the oldest record not acknowledged, given the
    /// ack cursor (every seq ≤ `ack` acknowledged) and the next seq to be appended; `None`
    /// when nothing is unacknowledged or its time is unknown. Forgets marks wholly acked.
    pub fn oldest_unacked(&mut self, ack: u64, next_seq: u64) -> Option<u64> {
        let first_unacked = ack.saturating_add(1);
        if first_unacked >= next_seq {
            // Nothing waits: the next append starts the marks again.
            *self = AgeMarks::default();
            return None;
        }
        // A mark covers the records from its seq to the next mark's: drop those wholly acked.
        while self.marks.len() >= 2 && self.marks[1].0 <= first_unacked {
            self.marks.pop_front();
        }
        match (self.first_marked, self.marks.front()) {
            (Some(first), Some(&(_, t))) if first <= first_unacked => Some(t),
            _ => None,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.marks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn the_oldest_unacked_records_time_follows_the_ack_cursor() {
        let mut m = AgeMarks::default();
        // Records 1..=30, one every 50 ms from t = 100 s.
        for seq in 1..=30u64 {
            m.appended(seq, 100 * S + (seq - 1) * 50_000);
        }
        assert_eq!(
            m.oldest_unacked(0, 31),
            Some(100 * S),
            "nothing acked: the first"
        );
        // Acked through 10: record 11 was read at 100.5 s; the answer is the mark at or before
        // it (marks every 100 ms: record 11 itself).
        assert_eq!(m.oldest_unacked(10, 31), Some(100 * S + 500_000));
        // Acked through 11: record 12 (100.55 s) is covered by the mark of record 11.
        assert_eq!(m.oldest_unacked(11, 31), Some(100 * S + 500_000));
        assert_eq!(m.oldest_unacked(30, 31), None, "all acked");
        // Appends after an empty spool start again.
        m.appended(31, 200 * S);
        assert_eq!(m.oldest_unacked(30, 32), Some(200 * S));
    }

    #[test]
    fn a_long_backlog_keeps_a_bounded_table_and_the_oldest_time_exact() {
        let mut m = AgeMarks::default();
        // One record a second for a day.
        for seq in 1..=86_400u64 {
            m.appended(seq, seq * S);
        }
        assert!(m.len() <= MAX_MARKS, "{}", m.len());
        assert_eq!(m.oldest_unacked(0, 86_401), Some(S));
        // Half acked: the answer is at most one mark spacing older than the truth.
        let t = m.oldest_unacked(43_200, 86_401).unwrap();
        let truth = 43_201 * S;
        assert!(
            t <= truth && truth - t <= 2 * 86_400 * S / MAX_MARKS as u64,
            "{t}"
        );
    }

    #[test]
    fn records_from_before_a_restart_have_no_known_age() {
        let mut m = AgeMarks::default();
        // Records 1..=5 were recovered (no marks); 6 is appended by this process.
        m.appended(6, 50 * S);
        assert_eq!(
            m.oldest_unacked(0, 7),
            None,
            "1..=5 are older than any mark"
        );
        assert_eq!(m.oldest_unacked(5, 7), Some(50 * S));
    }
}
