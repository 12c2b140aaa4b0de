//! Model-based property test of the delivery model at the spool's level: the spool over a
//! fault-injecting, crash-simulating file system, driven by random schedules and checked
//! against a plain in-memory model (in the spirit of Vector's disk-buffer model tests).
//!
//! The schedule's operations are what the gateway does to a spool: a device publishes
//! (`append`), a group commit (inline, or split: the job taken, run later, appends and reads
//! continuing meanwhile) after which the device is acknowledged, the uplink reads committed
//! records to send (inline or as an off-thread read job), the cloud acknowledges them in or
//! out of order or refuses them (for now: resent later; for good: finished, counted), the
//! link drops and comes back (everything unacknowledged is resent), and the storage fails:
//! injected I/O errors (a plain one poisons the spool; `ENOSPC` or `EROFS` at any write
//! point stalls it), the disk full (`ENOSPC` after a short write) and freed, the file system
//! remounted read-only and writable, power loss (unsynced bytes dropped, torn tails, unsynced
//! directory changes lost) with or without a commit job that ran but was never applied, and a
//! plain reopen. Segments are small, so rollover and trimming happen all the time; both
//! `when_full` policies run.
//!
//! Stalls (ADR 0015): while the storage refuses writes for want of space or writability the
//! spool is stalled, not poisoned. The model's rules for it: an append refused with `Stalled`
//! is not acknowledged to its device (nothing of it is in the spool); a commit that reports a
//! stall may leave its batch pending (`durable_through` below what it was to commit), those
//! devices keep waiting and are acknowledged by the later commit that writes it (a commit
//! that reports no stall commits everything appended before it); reads, acks and trims go on.
//!
//! The model keeps every body ever appended (bodies carry a unique id, so a body identifies
//! one append), the records reported durable (the device got its PUBACK: `acked`), and what
//! the cloud accepted or refused for good. Checked after every step:
//! - reads return exactly the committed records in seq order, each with the body it was
//!   appended with (no record that was never appended, none skipped);
//! - after every reopen the spool resumes at or above the last ack cursor a commit reported
//!   persisted (records acknowledged and persisted never come back), and every record the
//!   device was acknowledged for, not acknowledged by the cloud or dropped by drop-oldest,
//!   is there: the set of unacknowledged records recovered is a superset of the model's;
//!   and no seq that was ever read for sending is assigned again (a cloud ack in flight names
//!   its record by seq);
//! - every record drop-oldest removed is reported to the caller (the engine's counter equals
//!   what `Appended::dropped` and `Spool::take_dropped` reported);
//! - a stalled spool refuses every append with `Stalled` (and an append refused so leaves the
//!   spool stalled); a commit reports the spool's stall state; no commit reports a record
//!   appended after its job was taken as durable;
//! - the size bounds: the spool's accounting within `max_bytes`, every segment file within
//!   `segment_bytes`, all segment files together within `max_bytes` (right after an open, one
//!   segment header more; from there the spool only shrinks until it is within the bound).
//!
//! `MODEL_STATS=1` prints what each schedule exercised; `MODEL_DEBUG=1` traces it.
//!
//! At the end the faults stop, the spool is reopened, its first commit must end any stall
//! (the disk has room and is writable), and it is connected and drained: every record a
//! device was acknowledged for reached the cloud at least once, or was refused for good, or
//! was dropped by drop-oldest (counted); and once everything is acknowledged, commits trim
//! the spool back to at most two segments.
//!
//! `PROPTEST_CASES` raises the number of schedules (default below).

mod common;
#[path = "model/regressions.rs"]
mod regressions;

use common::FullFs;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::ErrorKind;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use proptest::prelude::*;
use sluice_spool::fault::FaultFs;
use sluice_spool::{
    parse_segment_name, CommitJob, FullPolicy, ReadCursor, ReadJob, Spool, SpoolConfig, SpoolError,
    SpoolFs, SpoolSeq, SEGMENT_HEADER_LEN,
};

#[derive(Debug, Clone, Copy)]
enum Op {
    /// A device publishes a record of `len` filler bytes.
    Append(u8),
    /// A group commit on this thread.
    Commit,
    /// A commit job taken (its batch and cursor), not run yet.
    BeginCommit,
    /// The job taken runs and is applied.
    FinishCommit,
    /// The uplink reads up to n committed records and sends them.
    Send(usize),
    /// An off-thread read of up to n records starts (on a snapshot of the segment index)...
    BeginRead(usize),
    /// ... and its outcome is taken back (discarded if a segment went meanwhile).
    FinishRead,
    /// The cloud acknowledges the i-th unit in flight (any order).
    CloudAck(usize),
    /// The cloud refuses the i-th unit in flight: for now (resent after the pause) or for
    /// good (counted, finished: its record is acknowledged in the spool).
    Refuse(usize, bool),
    /// The link drops: every unit in flight goes back to be resent.
    Disconnect,
    /// The link comes back (or a refusal's pause ends): everything to resend goes first.
    Reconnect,
    /// The n-th mutating file operation from now fails: with a plain I/O error (the spool
    /// poisons), `ENOSPC` or `EROFS` (the spool stalls), by `kind` 0, 1, 2.
    Fail(u64, u8),
    /// The disk is full (appends write a part, then fail with ENOSPC) or has room again.
    DiskFull(bool),
    /// The file system is remounted read-only (every change fails with EROFS) or writable.
    ReadOnly(bool),
    /// Power loss; with `true` a commit job that was out ran first (never applied).
    Crash(bool),
    /// The gateway reopens the spool (after a failure) without losing power.
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        14 => (0u8..60).prop_map(Op::Append),
        3 => Just(Op::Commit),
        2 => Just(Op::BeginCommit),
        2 => Just(Op::FinishCommit),
        3 => (1usize..8).prop_map(Op::Send),
        1 => (1usize..8).prop_map(Op::BeginRead),
        1 => Just(Op::FinishRead),
        5 => (0usize..100).prop_map(Op::CloudAck),
        1 => (0usize..100, any::<bool>()).prop_map(|(i, p)| Op::Refuse(i, p)),
        1 => Just(Op::Disconnect),
        2 => Just(Op::Reconnect),
        1 => (1u64..6, 0u8..3).prop_map(|(n, k)| Op::Fail(n, k)),
        1 => prop_oneof![1 => Just(true), 3 => Just(false)].prop_map(Op::DiskFull),
        1 => prop_oneof![1 => Just(true), 3 => Just(false)].prop_map(Op::ReadOnly),
        1 => any::<bool>().prop_map(Op::Crash),
        1 => Just(Op::Reopen),
    ]
}

fn config(drop_oldest: bool) -> SpoolConfig {
    SpoolConfig {
        segment_bytes: 256,
        max_bytes: 1024,
        when_full: if drop_oldest {
            FullPolicy::DropOldest
        } else {
            FullPolicy::Block
        },
        ack_window: 16,
        max_record_bytes: 80,
        max_batch_bytes: 1024,
        ..common::small_config()
    }
}

struct Harness {
    fs: FullFs,
    cfg: SpoolConfig,
    spool: Option<Spool>,
    /// The uplink's read position (the feeder's cursor).
    reader: ReadCursor,
    /// A commit job taken and not yet applied: the seq it commits through.
    job: Option<(CommitJob, u64)>,
    /// An off-thread read out, with the cursor it started from.
    read_job: Option<(ReadJob, ReadCursor)>,
    /// Reported durable (the device got its PUBACK) and neither acknowledged by the cloud
    /// with a persisted cursor, nor dropped.
    acked: BTreeMap<u64, Vec<u8>>,
    /// This incarnation's appends not yet reported durable.
    unconfirmed: BTreeMap<u64, Vec<u8>>,
    /// Every append ever: body -> seq.
    appended: HashMap<Vec<u8>, u64>,
    /// Every body a device was acknowledged for, ever.
    device_acked: HashSet<Vec<u8>>,
    /// Bodies the cloud accepted / refused for good / drop-oldest removed.
    delivered: HashSet<Vec<u8>>,
    refused: HashSet<Vec<u8>>,
    dropped: HashSet<Vec<u8>>,
    connected: bool,
    /// Units in flight (seqs, in send order) and units to resend first (in send order).
    inflight: Vec<u64>,
    resend: BTreeSet<u64>,
    /// Cloud acks the spool's window could not take yet (as the gateway's `AckRanges`).
    deferred: BTreeSet<u64>,
    /// The spool may not resume below this.
    cursor_floor: u64,
    next_id: u64,
    /// The highest seq ever read for sending: never assigned again (an acknowledgement still
    /// on its way from the cloud names a record by its seq). Seqs of records dropped or lost
    /// before anyone read them may be.
    max_sent: u64,
    /// Records drop-oldest reported removing in this incarnation.
    reported_drops: u64,
    /// Bytes the spool held at its last open when that was above `max_bytes` (shrinks).
    over_bound: u64,
    /// What happened, for `MODEL_STATS=1` (how much of the model a run exercised).
    stats: BTreeMap<&'static str, u64>,
}

impl Harness {
    fn new(seed: u64, drop_oldest: bool) -> Harness {
        Harness {
            fs: FullFs {
                inner: FaultFs::new(seed),
                full: Arc::default(),
            },
            cfg: config(drop_oldest),
            spool: None,
            reader: ReadCursor::at(SpoolSeq(1)),
            job: None,
            read_job: None,
            acked: BTreeMap::new(),
            unconfirmed: BTreeMap::new(),
            appended: HashMap::new(),
            device_acked: HashSet::new(),
            delivered: HashSet::new(),
            refused: HashSet::new(),
            dropped: HashSet::new(),
            connected: true,
            inflight: Vec::new(),
            resend: BTreeSet::new(),
            deferred: BTreeSet::new(),
            cursor_floor: 0,
            next_id: 0,
            stats: BTreeMap::new(),
            over_bound: 0,
            reported_drops: 0,
            max_sent: 0,
        }
    }

    /// Opens (recovers) the spool and checks what came back against the model. A failed open
    /// (the disk full, an injected error) leaves the spool closed and must damage nothing:
    /// the next open is checked against the same model.
    fn open(&mut self) {
        self.spool = None;
        self.job = None;
        self.read_job = None;
        let opened = Spool::open_with_fs(Arc::new(self.fs.clone()), "/spool", self.cfg.clone());
        let mut spool = match opened {
            Ok((spool, report)) => {
                if std::env::var("MODEL_DEBUG").is_ok() {
                    eprintln!("recovery: {report:?}");
                }
                spool
            }
            Err(SpoolError::Io { .. }) => return self.count("open_failed"),
            Err(e) => panic!("open: {e}"),
        };
        let c = spool.ack_cursor().0;
        assert!(
            spool.next_seq().0 > self.max_sent,
            "seq {} is assigned again (it was sent before)",
            self.max_sent
        );
        assert!(
            c >= self.cursor_floor,
            "resumed at {c}, below the persisted cursor {}",
            self.cursor_floor
        );
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
            let seqs: Vec<u64> = got.iter().map(|r| r.seq.0).collect();
            eprintln!(
                "open: c={c} seqs={seqs:?} files={:?}",
                self.fs.inner.paths()
            );
        }
        let present: BTreeMap<u64, Vec<u8>> =
            got.iter().map(|r| (r.seq.0, r.body.to_vec())).collect();
        for (seq, body) in self.acked.range(c + 1..) {
            assert_eq!(
                present.get(seq),
                Some(body),
                "record {seq} acknowledged to its device is lost (cursor {c})"
            );
        }
        self.count("opens");
        let kept = self.acked.range(c + 1..).count() as u64;
        *self.stats.entry("acked_records_recovered").or_default() += kept;
        // Everything that survived recovery is durable now (a record of a failed commit may
        // have survived: its device resends it, the cloud may see both).
        self.acked = present;
        self.unconfirmed.clear();
        self.inflight.clear();
        self.resend.clear();
        self.deferred.clear();
        self.cursor_floor = c;
        // Above the bound by at most the new segment's header, and by wholly acknowledged
        // segments recovery could not remove (a read-only file system; their removal had
        // not been durable at a crash): the first commit that can write trims them. Under
        // drop-oldest also by segments whose removal was not durable yet at a crash (the
        // next append that needs the room drops them again).
        let over = spool.total_bytes().saturating_sub(self.cfg.max_bytes);
        if self.cfg.when_full == FullPolicy::Block {
            let acknowledged = self.acknowledged_segment_bytes(c);
            assert!(
                over <= SEGMENT_HEADER_LEN + acknowledged,
                "reopened {over} bytes above max_bytes ({acknowledged} in acknowledged segments)"
            );
        }
        self.over_bound = spool.total_bytes();
        self.reported_drops = 0;
        self.reader = spool.read_cursor();
        self.spool = Some(spool);
    }

    /// Bytes of segment files whose every record is at or below `cursor` (a file's records
    /// end below the next file's name).
    fn acknowledged_segment_bytes(&self, cursor: u64) -> u64 {
        let mut segs: Vec<(u64, u64)> = self
            .fs
            .inner
            .list(Path::new("/spool"))
            .expect("list")
            .into_iter()
            .filter_map(|(name, len)| parse_segment_name(&name).map(|n| (n, len)))
            .collect();
        segs.sort_unstable();
        segs.windows(2)
            .filter(|w| w[1].0 - 1 <= cursor)
            .map(|w| w[0].1)
            .sum()
    }

    fn count(&mut self, what: &'static str) {
        *self.stats.entry(what).or_default() += 1;
    }

    fn live(&mut self) -> Option<&mut Spool> {
        self.spool.as_mut().filter(|s| !s.is_poisoned())
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Append(len) => self.append(*len),
            Op::Commit => {
                if self.job.is_some() {
                    return;
                }
                let Some(spool) = self.live() else { return };
                let through = spool.next_seq().0 - 1;
                let result = spool.commit();
                self.committed(result, through);
            }
            Op::BeginCommit => {
                if self.job.is_some() {
                    return;
                }
                let Some(spool) = self.live() else { return };
                let through = spool.next_seq().0 - 1;
                match spool.begin_commit() {
                    Ok(Some(job)) => self.job = Some((job, through)),
                    Ok(None) | Err(SpoolError::Poisoned) => {}
                    Err(e) => panic!("begin_commit: {e}"),
                }
            }
            Op::FinishCommit => {
                let Some((job, through)) = self.job.take() else {
                    return;
                };
                let outcome = job.run();
                let Some(spool) = self.spool.as_mut() else {
                    return;
                };
                let result = spool.finish_commit(outcome);
                self.committed(result, through);
            }
            Op::Send(n) => {
                if !self.connected {
                    return;
                }
                let mut reader = self.reader;
                let Some(spool) = self.live() else { return };
                let mut out = Vec::new();
                match spool.read(&mut reader, *n, 1 << 20, &mut out) {
                    Ok(_) => self.sent(reader, out),
                    Err(e) => panic!("read: {e}"),
                }
            }
            Op::BeginRead(n) => {
                if !self.connected || self.read_job.is_some() {
                    return;
                }
                let reader = self.reader;
                let Some(spool) = self.live() else { return };
                let job = spool.begin_read(reader, *n, 1 << 20).expect("begin_read");
                self.read_job = Some((job, reader));
            }
            Op::FinishRead => {
                let Some((job, start)) = self.read_job.take() else {
                    return;
                };
                let outcome = job.run();
                // The feeder discards a read whose stream moved while it was out.
                let current = self.reader == start;
                let Some(spool) = self.spool.as_mut() else {
                    return;
                };
                // Discarded when a segment went meanwhile: the feeder reads again.
                let Some(done) = spool.finish_read(outcome) else {
                    return;
                };
                match done.result {
                    Ok(_) if self.connected && current => self.sent(done.cursor, done.records),
                    Ok(_) | Err(SpoolError::Poisoned) => {}
                    Err(e) => panic!("read job: {e}"),
                }
            }
            Op::CloudAck(i) => {
                if self.inflight.is_empty() {
                    return;
                }
                let seq = self.inflight.remove(i % self.inflight.len());
                self.finished(seq, false);
            }
            Op::Refuse(i, permanent) => {
                if self.inflight.is_empty() {
                    return;
                }
                let seq = self.inflight.remove(i % self.inflight.len());
                if *permanent {
                    self.finished(seq, true);
                } else {
                    self.resend.insert(seq);
                }
            }
            Op::Disconnect => {
                self.connected = false;
                self.resend.extend(self.inflight.drain(..));
            }
            Op::Reconnect => {
                self.connected = true;
                // Resent in order, ahead of anything new.
                let again = std::mem::take(&mut self.resend);
                self.inflight.extend(again);
            }
            Op::Fail(n, kind) => self.fs.inner.fail_op_with(
                *n,
                match kind {
                    0 => ErrorKind::Other,
                    1 => ErrorKind::StorageFull,
                    _ => ErrorKind::ReadOnlyFilesystem,
                },
            ),
            Op::DiskFull(full) => self.fs.full.store(*full, Ordering::Relaxed),
            Op::ReadOnly(ro) => self.fs.inner.set_read_only(*ro),
            Op::Crash(run_job) => {
                if let (true, Some((job, _))) = (run_job, self.job.take()) {
                    // The job wrote, fsynced, persisted the cursor and trimmed; the process
                    // died before applying it.
                    drop(job.run());
                }
                self.spool = None;
                if std::env::var("MODEL_DEBUG").is_ok() {
                    eprintln!("crash: files before: {:?}", self.fs.inner.paths());
                }
                self.fs.inner.crash();
                self.open();
            }
            Op::Reopen => {
                self.fs.inner.fail_op(0);
                self.open();
            }
        }
        self.check_bounds();
    }

    fn append(&mut self, len: u8) {
        let id = self.next_id;
        self.next_id += 1;
        let mut body = id.to_le_bytes().to_vec();
        body.extend(std::iter::repeat_n(len, len as usize));
        let Some(spool) = self.live() else { return };
        let was_stalled = spool.stalled();
        let result = spool.append(&body);
        if std::env::var("MODEL_DEBUG").is_ok() {
            eprintln!("  append -> {result:?}");
        }
        if let Some(reason) = was_stalled {
            assert!(
                matches!(result, Err(SpoolError::Stalled { reason: r }) if r == reason),
                "a stalled spool ({reason}) refuses appends, got {result:?}"
            );
        }
        if matches!(result, Err(SpoolError::Stalled { .. })) {
            let stalled = self.spool.as_ref().and_then(Spool::stalled);
            assert!(
                stalled.is_some(),
                "an append refused as stalled stalls the spool"
            );
        }
        match result {
            Ok(a) => {
                self.appended.insert(body.clone(), a.seq.0);
                self.unconfirmed.insert(a.seq.0, body);
                if let Some(d) = a.dropped {
                    self.on_dropped(d);
                }
            }
            Err(SpoolError::Full { .. }) => self.count("append_full"),
            Err(SpoolError::BatchFull { .. }) => self.count("append_batch_full"),
            Err(SpoolError::Io { .. }) => self.count("append_io"),
            // Refused: the device is not acknowledged (the gateway holds its PUBACK back and
            // it publishes again); nothing of it is in the spool.
            Err(SpoolError::Stalled { .. }) => self.count("append_stalled"),
            Err(e) => panic!("append: {e}"),
        }
        // Drop-oldest may have removed records before the append failed: reported apart.
        if let Some(d) = self.spool.as_mut().and_then(Spool::take_dropped) {
            self.on_dropped(d);
        }
    }

    /// Drop-oldest removed `d`: those records are gone, counted; nothing more to send.
    fn on_dropped(&mut self, d: sluice_spool::Dropped) {
        self.count("drop_oldest");
        self.reported_drops += d.records;
        let gone = d.first.0..=d.last.0;
        for (s, b) in self.acked.iter().chain(self.unconfirmed.iter()) {
            if gone.contains(s) {
                self.dropped.insert(b.clone());
            }
        }
        self.acked.retain(|s, _| !gone.contains(s));
        self.unconfirmed.retain(|s, _| !gone.contains(s));
        self.inflight.retain(|s| !gone.contains(s));
        self.resend.retain(|s| !gone.contains(s));
        if self.reader.next_seq().0 <= d.last.0 {
            self.reader = ReadCursor::at(SpoolSeq(d.last.0 + 1));
        }
    }

    /// A commit through `through` finished with `result`.
    fn committed(&mut self, result: Result<sluice_spool::Committed, SpoolError>, through: u64) {
        match result {
            Ok(c) => {
                let durable = c.durable_through.0;
                let spool = self.spool.as_ref().expect("just committed");
                assert_eq!(c.stalled, spool.stalled(), "the commit reports the stall");
                let persisted = spool.persisted_ack_cursor().map_or(0, |s| s.0);
                match c.stalled {
                    // A commit that went through commits everything appended before it.
                    None => assert!(
                        durable >= through,
                        "commit through {through} reported {durable}"
                    ),
                    // The storage refused the batch (or the probe): it stays pending, its
                    // devices wait (they are acknowledged by the commit that writes it), and
                    // nothing already durable goes (checked below and at every reopen).
                    Some(_) => {
                        self.count("commit_stalled");
                        if durable < through {
                            self.count("commit_stalled_pending");
                        }
                    }
                }
                // Records appended while the job ran are not reported durable by it.
                assert!(
                    !self
                        .unconfirmed
                        .keys()
                        .any(|&s| s > through && s <= durable),
                    "commit through {through} reported {durable}, beyond its batch"
                );
                let rest = self.unconfirmed.split_off(&(durable + 1));
                let done = std::mem::replace(&mut self.unconfirmed, rest);
                // The devices get their PUBACKs now.
                for (s, b) in done {
                    self.device_acked.insert(b.clone());
                    self.acked.insert(s, b);
                }
                self.cursor_floor = self.cursor_floor.max(persisted);
                // Records at or below the persisted cursor never come back.
                self.acked = self.acked.split_off(&(self.cursor_floor + 1));
            }
            Err(SpoolError::Io { source, .. }) => {
                self.count(if source.raw_os_error() == Some(28) {
                    "commit_enospc"
                } else {
                    "commit_io"
                })
            }
            Err(SpoolError::Poisoned) => {}
            Err(e) => panic!("commit: {e}"),
        }
    }

    /// The uplink read `out` (ending at `reader`): check it and put it in flight.
    fn sent(&mut self, reader: ReadCursor, out: Vec<sluice_spool::SpoolRecord>) {
        let from = self.reader.next_seq().0;
        let got: Vec<(u64, Vec<u8>)> = out.iter().map(|r| (r.seq.0, r.body.to_vec())).collect();
        let want: Vec<(u64, Vec<u8>)> = self
            .acked
            .range(from..)
            .take(got.len())
            .map(|(s, b)| (*s, b.clone()))
            .collect();
        assert_eq!(
            got, want,
            "reads return the committed records in order, none skipped"
        );
        for (seq, body) in &got {
            assert_eq!(self.appended.get(body), Some(seq), "never appended so");
        }
        self.inflight.extend(got.iter().map(|(s, _)| *s));
        self.max_sent = self.max_sent.max(got.last().map_or(0, |r| r.0));
        self.reader = reader;
    }

    /// The cloud accepted `seq` (or refused it for good): the outbox finishes it, which
    /// acknowledges its record in the spool.
    fn finished(&mut self, seq: u64, refused: bool) {
        if let Some(body) = self.acked.get(&seq).cloned() {
            if refused {
                self.refused.insert(body);
            } else {
                self.delivered.insert(body);
            }
        }
        self.deferred.insert(seq);
        let Some(spool) = self.spool.as_mut() else {
            return;
        };
        let mut keep = BTreeSet::new();
        for s in std::mem::take(&mut self.deferred) {
            match spool.ack(SpoolSeq(s)) {
                Ok(()) => {}
                Err(SpoolError::AckOutsideWindow { .. }) => {
                    keep.insert(s);
                }
                Err(e) => panic!("ack {s}: {e}"),
            }
        }
        self.deferred = keep;
    }

    /// Appends never take the spool past `max_bytes`. A reopen may start above it by one
    /// segment header (the new active segment's, see the regression test below); from there
    /// the spool only shrinks until it is within the bound again.
    fn check_bounds(&mut self) {
        let max = self.cfg.max_bytes;
        let files = self.fs.inner.list(Path::new("/spool")).expect("list");
        let mut on_disk = 0;
        for (name, len) in files {
            if parse_segment_name(&name).is_some() {
                assert!(
                    len <= self.cfg.segment_bytes,
                    "segment {name} has {len} bytes"
                );
                on_disk += len;
            }
        }
        let Some(spool) = &self.spool else { return };
        assert_eq!(
            spool.counters().dropped_oldest_records,
            self.reported_drops,
            "every record drop-oldest removed is reported to the caller"
        );
        let total = spool.total_bytes();
        let bound = max.max(self.over_bound);
        assert!(
            total <= bound,
            "spool accounts {total} bytes, bound {bound}"
        );
        assert!(
            on_disk <= bound,
            "segment files hold {on_disk} bytes, bound {bound}"
        );
        self.over_bound = self.over_bound.min(total);
    }

    /// No more faults: reopen, connect, send and acknowledge everything, and check that
    /// every record a device was acknowledged for reached the cloud (or was refused for good,
    /// or dropped, counted), then that the acknowledged spool is trimmed.
    fn drain(&mut self) {
        self.fs.inner.fail_op(0);
        self.fs.full.store(false, Ordering::Relaxed);
        self.fs.inner.set_read_only(false);
        self.open();
        assert!(self.spool.is_some(), "the spool opens once the faults stop");
        self.connected = true;
        self.step(&Op::Commit);
        let spool = self.spool.as_ref().expect("open");
        assert_eq!(spool.stalled(), None, "a commit with room ends the stall");
        for _ in 0..10_000 {
            self.step(&Op::Commit);
            self.step(&Op::Reconnect);
            self.step(&Op::Send(64));
            if self.inflight.is_empty() {
                break;
            }
            while !self.inflight.is_empty() {
                self.step(&Op::CloudAck(0));
            }
        }
        assert!(self.deferred.is_empty(), "acks left: {:?}", self.deferred);
        for body in &self.device_acked {
            assert!(
                self.delivered.contains(body)
                    || self.refused.contains(body)
                    || self.dropped.contains(body),
                "record {:?} was acknowledged to its device and never reached the cloud",
                self.appended.get(body)
            );
        }
        // Two commits: the first persists the cursor, the second trims what it covers.
        self.step(&Op::Commit);
        self.step(&Op::Commit);
        let spool = self.spool.as_ref().expect("open");
        assert_eq!(
            spool.ack_cursor().0 + 1,
            spool.next_seq().0,
            "all acknowledged"
        );
        assert!(
            spool.segment_count() <= 2,
            "acknowledged segments are trimmed ({} left)",
            spool.segment_count()
        );
    }
}

fn run(seed: u64, drop_oldest: bool, ops: &[Op]) {
    let mut h = Harness::new(seed, drop_oldest);
    h.open();
    for op in ops {
        if std::env::var("MODEL_DEBUG").is_ok() {
            eprintln!("{op:?}");
        }
        h.step(op);
    }
    // A final crash and recovery checks the end state, then everything is delivered.
    h.step(&Op::Crash(true));
    h.drain();
    if std::env::var("MODEL_STATS").is_ok() {
        h.stats.insert("delivered", h.delivered.len() as u64);
        h.stats.insert("refused", h.refused.len() as u64);
        h.stats.insert("dropped", h.dropped.len() as u64);
        eprintln!("model stats: {:?}", h.stats);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_spool_matches_a_simple_model_across_faults_and_crashes(
        seed in 1u64..u64::MAX,
        drop_oldest in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        run(seed, drop_oldest, &ops);
    }
}
