//! Model-based property test: the spool over a fault-injecting file system against a plain
//! in-memory model, with injected I/O errors and crashes at arbitrary points.
//!
//! The model keeps `committed` (reported durable, not known to be gone) and every
//! `(seq, body)` ever appended (bodies carry a unique id, so a body identifies one append).
//! After every reopen, with `c` the ack cursor the spool resumes from:
//! - `c` is at least the last cursor a commit reported persisted (acked-and-trimmed records
//!   never come back);
//! - records come back in strictly increasing seq order, each with exactly the body it was
//!   appended with, and none at or below `c` (no record appears that was never appended);
//! - every committed record above `c` comes back. This includes records acknowledged in
//!   memory but above the persisted cursor: those are the only allowed duplicates.
//!   Uncommitted records (and those in a failed commit) may or may not come back.
//!
//! While running, reads return exactly the committed records in order.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use proptest::prelude::*;
use sluice_spool::fault::FaultFs;
use sluice_spool::{FullPolicy, ReadCursor, Spool, SpoolConfig, SpoolError, SpoolSeq};

#[derive(Debug, Clone)]
enum Op {
    Append(u8),
    Commit,
    Read(usize),
    Ack(usize),
    Fail(u64),
    Crash,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..60).prop_map(Op::Append),
        3 => Just(Op::Commit),
        2 => (1usize..8).prop_map(Op::Read),
        3 => (0usize..100).prop_map(Op::Ack),
        1 => (1u64..6).prop_map(Op::Fail),
        1 => Just(Op::Crash),
        1 => Just(Op::Reopen),
    ]
}

fn config(drop_oldest: bool) -> SpoolConfig {
    SpoolConfig {
        segment_bytes: 256,
        max_bytes: 2048,
        when_full: if drop_oldest {
            FullPolicy::DropOldest
        } else {
            FullPolicy::Block
        },
        ack_window: 64,
        max_record_bytes: 80,
        max_batch_bytes: 1024,
        ..common::small_config()
    }
}

struct Harness {
    fs: FaultFs,
    cfg: SpoolConfig,
    spool: Option<Spool>,
    reader: ReadCursor,
    /// Reported durable and not known to be gone.
    committed: BTreeMap<u64, Vec<u8>>,
    /// This incarnation's appends not yet reported durable.
    uncommitted: BTreeMap<u64, Vec<u8>>,
    /// Every append ever: body -> seq.
    appended: HashMap<Vec<u8>, u64>,
    /// Read but not yet acked (by this incarnation).
    delivered: Vec<u64>,
    /// The spool may not resume below this.
    cursor_floor: u64,
    next_id: u64,
}

impl Harness {
    fn open(&mut self) {
        let (spool, _report) =
            Spool::open_with_fs(Arc::new(self.fs.clone()), "/spool", self.cfg.clone())
                .expect("recovery never refuses");
        let c = spool.ack_cursor().0;
        assert!(
            c >= self.cursor_floor,
            "resumed at {c}, below the persisted cursor {}",
            self.cursor_floor
        );
        self.reader = spool.read_cursor();
        self.spool = Some(spool);
        // Read everything back and check it against the model.
        let spool = self.spool.as_mut().expect("just opened");
        let mut cur = spool.read_cursor();
        let mut got = Vec::new();
        while spool
            .read(&mut cur, 100, 1 << 20, &mut got)
            .expect("read after recovery")
            > 0
        {}
        let mut prev = c;
        for r in &got {
            assert!(r.seq.0 > prev, "seq {} after {prev}", r.seq.0);
            prev = r.seq.0;
            assert_eq!(
                self.appended.get(&r.body[..]),
                Some(&r.seq.0),
                "record {} was never appended so",
                r.seq.0
            );
        }
        if std::env::var("MODEL_DEBUG").is_ok() {
            eprintln!(
                "open: c={c} seqs={:?} report={:?} paths={:?}",
                got.iter().map(|r| r.seq.0).collect::<Vec<_>>(),
                _report,
                self.fs.paths()
            );
        }
        let present: BTreeMap<u64, Vec<u8>> =
            got.iter().map(|r| (r.seq.0, r.body.to_vec())).collect();
        for (seq, body) in self.committed.range(c + 1..) {
            assert_eq!(
                present.get(seq),
                Some(body),
                "committed record {seq} lost (cursor {c})"
            );
        }
        // Everything that survived recovery is durable now.
        self.committed = present;
        self.delivered.clear();
        self.uncommitted.clear();
        self.cursor_floor = c;
    }

    fn spool(&mut self) -> Option<&mut Spool> {
        self.spool.as_mut().filter(|s| !s.is_poisoned())
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Append(len) => {
                let id = self.next_id;
                self.next_id += 1;
                let mut body = id.to_le_bytes().to_vec();
                body.extend(std::iter::repeat_n(*len, *len as usize));
                let Some(spool) = self.spool() else { return };
                match spool.append(&body) {
                    Ok(a) => {
                        self.appended.insert(body.clone(), a.seq.0);
                        self.uncommitted.insert(a.seq.0, body);
                        if let Some(d) = a.dropped {
                            self.committed.retain(|&s, _| s > d.last.0);
                            self.uncommitted.retain(|&s, _| s > d.last.0);
                        }
                    }
                    Err(
                        SpoolError::Full { .. }
                        | SpoolError::BatchFull { .. }
                        | SpoolError::Io { .. },
                    ) => {}
                    Err(e) => panic!("append: {e}"),
                }
            }
            Op::Commit => {
                let Some(spool) = self.spool() else { return };
                match spool.commit() {
                    Ok(c) => {
                        let persisted = spool.persisted_ack_cursor().map_or(0, |s| s.0);
                        self.absorb_commit(c.durable_through.0);
                        self.cursor_floor = self.cursor_floor.max(persisted);
                    }
                    Err(SpoolError::Io { .. }) => {}
                    Err(e) => panic!("commit: {e}"),
                }
            }
            Op::Read(n) => {
                let mut reader = self.reader;
                let Some(spool) = self.spool() else { return };
                let mut out = Vec::new();
                spool
                    .read(&mut reader, *n, 1 << 20, &mut out)
                    .expect("read");
                let from = out.first().map_or(0, |r| r.seq.0);
                let want: Vec<(u64, Vec<u8>)> = self
                    .committed
                    .range(from..)
                    .take(out.len())
                    .map(|(s, b)| (*s, b.clone()))
                    .collect();
                let got: Vec<(u64, Vec<u8>)> =
                    out.iter().map(|r| (r.seq.0, r.body.to_vec())).collect();
                assert_eq!(got, want, "reads return the committed records in order");
                if let Some(&(first, _)) = want.first() {
                    let skipped = self
                        .committed
                        .range(self.reader.next_seq().0..first)
                        .count();
                    assert_eq!(skipped, 0, "the reader skipped committed records");
                }
                self.delivered.extend(out.iter().map(|r| r.seq.0));
                self.reader = reader;
            }
            Op::Ack(i) => {
                if self.delivered.is_empty() {
                    return;
                }
                let seq = self.delivered.swap_remove(i % self.delivered.len());
                let Some(spool) = self.spool.as_mut() else {
                    return;
                };
                match spool.ack(SpoolSeq(seq)) {
                    Ok(()) | Err(SpoolError::AckOutsideWindow { .. }) => {}
                    Err(e) => panic!("ack: {e}"),
                }
            }
            Op::Fail(n) => self.fs.fail_op(*n),
            Op::Crash => {
                self.spool = None;
                self.fs.crash();
                self.open();
            }
            Op::Reopen => {
                self.spool = None;
                self.fs.fail_op(0);
                self.open();
            }
        }
    }

    fn absorb_commit(&mut self, durable: u64) {
        let rest = self.uncommitted.split_off(&(durable + 1));
        let done = std::mem::replace(&mut self.uncommitted, rest);
        self.committed
            .extend(done.into_iter().filter(|(s, _)| *s > self.cursor_floor));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_spool_matches_a_simple_model_across_faults_and_crashes(
        seed in 1u64..u64::MAX,
        drop_oldest in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut h = Harness {
            fs: FaultFs::new(seed),
            cfg: config(drop_oldest),
            spool: None,
            reader: ReadCursor::at(SpoolSeq(1)),
            committed: BTreeMap::new(),
            appended: HashMap::new(),
            uncommitted: BTreeMap::new(),
            delivered: Vec::new(),
            cursor_floor: 0,
            next_id: 0,
        };
        h.open();
        for op in &ops {
            h.step(op);
        }
        // A final crash and recovery checks the end state too.
        h.step(&Op::Crash);
    }
}
