//! The live spool of one shard: append, group commit, read, ack, trim, bound.
//!
//! Owns: the in-memory index of segments (one small summary per segment, never per record),
//! the uncommitted batch, the ack window and the size bound. Does not own: recovery (see
//! `recovery`), the frame layout (see `frame`), or any clock or runtime: the caller decides
//! when to commit and where the blocking part of a commit runs. Split by job: the blocking
//! half of a commit is in `commit`, reading (and [`ReadJob`]) in `read`, the configuration in
//! `config`, the errors in `error`; this file keeps the state and every change to it.
//!
//! Threading: a [`Spool`] is used from one thread (the shard's). Its methods do no blocking
//! I/O except opening or removing a segment file at rotation or drop-oldest, and
//! [`Spool::read`] (reading committed bytes). A commit is split so the blocking part runs
//! elsewhere: [`Spool::begin_commit`] takes the uncommitted batch and returns a [`CommitJob`]
//! (`Send`); [`CommitJob::run`] writes, fsyncs and persists the ack cursor (run it on a
//! dedicated thread or `spawn_blocking`); [`Spool::finish_commit`] applies its outcome and
//! says up to which seq records are durable. Appends continue while a job runs; one job at a
//! time. [`Spool::commit`] does all three inline (tests, tools). Reads are split the same
//! way: [`Spool::begin_read`] snapshots the segment index into a [`ReadJob`] (`Send`),
//! [`ReadJob::run`] reads as [`Spool::read`] does, and [`Spool::finish_read`] hands back the
//! records, or discards them if a segment was removed meanwhile (the caller reads again);
//! one read job at a time, alongside a commit job.
//!
//! Invariants:
//! - seqs are assigned consecutively from 1 and never reused while the process runs;
//! - readers see only committed records (`seq <= durable_seq()`), in seq order;
//! - `ack_cursor()` only advances, over a contiguous prefix of acknowledged (or no longer
//!   existing) seqs; out-of-order acks are held in a set bounded by `ack_window`;
//! - a segment file is removed only when every record in it is at or below an ack cursor
//!   that is already persisted, or by drop-oldest (counted);
//! - after any failed write or fsync the spool is poisoned: the page cache can no longer be
//!   trusted, so every later call fails with [`SpoolError::Poisoned`] until the spool is
//!   reopened and recovery decides from the disk what is durable;
//! - except a write refused because the file system is full or read-only (undone by the
//!   commit job, see `commit`): the spool is then *stalled* ([`Spool::stalled`]): appends are
//!   refused with [`SpoolError::Stalled`], the refused batch stays in memory and is written by
//!   a later commit, reads, acks, cursor writes and trims go on, and every commit job probes
//!   the storage (writes the space reserve anew) until one succeeds and the stall ends. On a
//!   full disk the active segment is sealed at its committed end, so that the cloud's acks can
//!   free its blocks.

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use crate::config::{FsyncPolicy, FullPolicy, SpoolConfig};
pub(crate) use crate::error::io_err;
pub use crate::error::SpoolError;
pub use crate::read::{ReadCursor, SpoolRecord};

use crate::commit::{CommitJob, CommitOutcome, Pending};
pub use crate::error::StallReason;
use crate::frame::{self, SEGMENT_HEADER_LEN, SEGMENT_MAGIC};
use crate::fs::{segment_path, LazyFile, RealFs, SpoolFile, SpoolFs};
use crate::read::{ReadDone, ReadJob, ReadOutcome, Reader};
use crate::recovery::{self, RecoveryReport};
use crate::reserve;

mod drop;
use drop::merge_dropped;
mod view;

/// Sequence number of a record: assigned by [`Spool::append`], consecutive from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SpoolSeq(pub u64);

impl std::fmt::Display for SpoolSeq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Segments removed by [`FullPolicy::DropOldest`] to make room for one append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// Oldest seq dropped.
    pub first: SpoolSeq,
    /// Newest seq dropped.
    pub last: SpoolSeq,
    /// Records dropped.
    pub records: u64,
    /// Segment files removed.
    pub segments: u64,
}

/// Result of an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// The record's seq; it is durable once a commit reports `durable_through >= seq`.
    pub seq: SpoolSeq,
    /// What drop-oldest removed to make room, if anything.
    pub dropped: Option<Dropped>,
}

/// A finished commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// Every record with a seq at or below this is durable (or was dropped / trimmed).
    pub durable_through: SpoolSeq,
    /// Time spent in fsync for this commit.
    pub fsync_time: Duration,
    /// The spool is stalled after this commit (its storage is full or read-only): see
    /// [`Spool::stalled`].
    pub stalled: Option<StallReason>,
}

/// Counters for metrics; plain numbers, copied out by the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpoolCounters {
    /// Records appended.
    pub records_appended: u64,
    /// Frame bytes appended (headers included).
    pub bytes_appended: u64,
    /// Commits finished.
    pub commits: u64,
    /// Files fsynced by commits.
    pub fsyncs: u64,
    /// Total time in fsync, nanoseconds.
    pub fsync_nanos_total: u64,
    /// Longest single commit's fsync time, nanoseconds.
    pub fsync_nanos_max: u64,
    /// Appends refused with [`SpoolError::Full`].
    pub full_rejections: u64,
    /// Records removed by drop-oldest.
    pub dropped_oldest_records: u64,
    /// Segments removed by drop-oldest.
    pub dropped_oldest_segments: u64,
    /// Segments created.
    pub segments_created: u64,
    /// Fully acknowledged segments removed.
    pub segments_trimmed: u64,
    /// Writes the storage refused for want of space or because it is read-only (each
    /// refusal, retries included).
    pub storage_refusals: u64,
    /// Appends refused with [`SpoolError::Stalled`].
    pub stalled_rejections: u64,
    /// Times the spool stopped accepting because of its storage (entered the stalled state).
    pub stalls: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Segment {
    pub(crate) first: u64,
    /// `first - 1` while empty.
    pub(crate) last: u64,
    /// Bytes including not yet committed ones.
    pub(crate) len: u64,
    pub(crate) committed_len: u64,
    pub(crate) committed_last: u64,
}

struct InFlight {
    through: u64,
    sync_dir: bool,
    probe: bool,
    /// (segment first seq, length, last seq) each written segment reaches.
    reached: Vec<(u64, u64, u64)>,
    cursor: Option<u64>,
    removes: Vec<u64>,
}

/// One shard's spool. See the module docs for threading and invariants.
pub struct Spool {
    fs: Arc<dyn SpoolFs>,
    dir: PathBuf,
    cfg: SpoolConfig,
    /// In seq order; the last one is the active segment.
    segments: VecDeque<Segment>,
    active_file: Arc<dyn SpoolFile>,
    next_seq: u64,
    durable: u64,
    ack: u64,
    acked_above: BTreeSet<u64>,
    persisted_ack: Option<u64>,
    pending: Vec<Pending>,
    pending_bytes: u64,
    dir_dirty: bool,
    in_flight: Option<InFlight>,
    total_bytes: u64,
    poisoned: bool,
    counters: SpoolCounters,
    read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    spare_bufs: Vec<Vec<u8>>,
    /// The newest-first reader's checkpoints for one segment.
    rev_index: Option<RevIndex>,
    /// Segments removed so far (trim, drop-oldest): a read job that ran across a removal is
    /// discarded ([`Spool::finish_read`]).
    removals: u64,
    /// The storage refused a write (full, read-only): appends are refused until a commit's
    /// probe succeeds.
    stalled: Option<StallReason>,
    /// What drop-oldest removed during an append that then failed (see
    /// [`Spool::take_dropped`]).
    unreported_drop: Option<Dropped>,
}

/// Offsets of every [`crate::read::REV_CHECKPOINT_EVERY`]th frame of one segment (newest-first reads).
pub(crate) struct RevIndex {
    pub(crate) seg_first: u64,
    /// Frames are indexed up to this offset (the table grows with the segment).
    pub(crate) scanned_off: u64,
    pub(crate) points: Vec<(u64, u64)>,
}

/// Bytes read at a time by readers (more when one record is larger).
pub(crate) const READ_CHUNK: usize = 256 << 10;

impl Spool {
    /// Opens (recovering) the spool in `dir` on the real file system.
    pub fn open(
        dir: impl AsRef<Path>,
        cfg: SpoolConfig,
    ) -> Result<(Spool, RecoveryReport), SpoolError> {
        Self::open_with_fs(Arc::new(RealFs), dir, cfg)
    }

    /// Opens (recovering) the spool in `dir` on `fs`.
    pub fn open_with_fs(
        fs: Arc<dyn SpoolFs>,
        dir: impl AsRef<Path>,
        cfg: SpoolConfig,
    ) -> Result<(Spool, RecoveryReport), SpoolError> {
        cfg.validate()?;
        let dir = dir.as_ref().to_owned();
        let rec =
            recovery::recover(&*fs, &dir, cfg.max_record_bytes).map_err(io_err("recover", &dir))?;
        // What the file says: when recovery raised the cursor above it, the first commit
        // persists the raised one.
        let persisted_ack = rec.stored_cursor;
        let newest = rec.segments.last().map_or(0, |m| m.last);
        // Empty segment files recovery left in place: seqs resume above their names (a name
        // may be the only trace of seqs already used), and they count in the size until a
        // later recovery removes them.
        let leftover = rec
            .leftovers
            .iter()
            .map(|&(name, _)| name)
            .max()
            .unwrap_or(0);
        let leftover_bytes = rec.leftovers.iter().map(|&(_, len)| len).sum::<u64>();
        let next_seq = newest.max(rec.ack_cursor).max(leftover) + 1;
        let mut segments: VecDeque<Segment> = rec
            .segments
            .iter()
            .map(|m| Segment {
                first: m.first,
                last: m.last,
                len: m.len,
                committed_len: m.len,
                committed_last: m.last,
            })
            .collect();
        let total_bytes = segments.iter().map(|s| s.len).sum::<u64>() + leftover_bytes;
        let path = segment_path(&dir, next_seq);
        // A full or read-only file system does not stop the start: the spool opens (stalled
        // once a write is refused), and drains what it holds. The active segment's file is
        // then created by its first write, in a commit job.
        let file: Arc<dyn SpoolFile> = match fs.create(&path, true) {
            Ok(f) => f,
            Err(e) if StallReason::of(&e).is_some() => {
                Arc::new(LazyFile::new(fs.clone(), path.clone()))
            }
            Err(e) => return Err(io_err("create", &path)(e)),
        };
        let stalled = match reserve::ensure(&*fs, &dir, cfg.fsync != FsyncPolicy::Never) {
            Ok(()) => None,
            Err(e) => match StallReason::of(&e) {
                Some(r) => Some(r),
                None => return Err(io_err("write space reserve in", &dir)(e)),
            },
        };
        segments.push_back(Segment {
            first: next_seq,
            last: next_seq - 1,
            len: SEGMENT_HEADER_LEN,
            committed_len: 0,
            committed_last: next_seq - 1,
        });
        let spool = Spool {
            fs,
            cfg,
            segments,
            active_file: file.clone(),
            next_seq,
            durable: next_seq - 1,
            ack: rec.ack_cursor,
            acked_above: BTreeSet::new(),
            persisted_ack,
            pending: vec![Pending {
                seg_first: next_seq,
                path,
                file,
                buf: SEGMENT_MAGIC.to_vec(),
                pre_len: 0,
            }],
            pending_bytes: SEGMENT_HEADER_LEN,
            dir_dirty: true,
            in_flight: None,
            total_bytes: total_bytes + SEGMENT_HEADER_LEN,
            poisoned: false,
            counters: SpoolCounters {
                segments_created: 1,
                stalls: u64::from(stalled.is_some()),
                ..Default::default()
            },
            read_file: None,
            spare_bufs: Vec::new(),
            rev_index: None,
            removals: 0,
            stalled,
            unreported_drop: None,
            dir,
        };
        Ok((spool, rec.report))
    }

    /// Appends one record (an opaque body; the gateway encodes device, topic, QoS, time).
    /// Cheap: copies into the uncommitted batch; does no I/O except at segment rotation or
    /// drop-oldest. The record is durable once a commit reports it.
    pub fn append(&mut self, body: &[u8]) -> Result<Appended, SpoolError> {
        if self.poisoned {
            return Err(SpoolError::Poisoned);
        }
        if let Some(reason) = self.stalled {
            self.counters.stalled_rejections += 1;
            return Err(SpoolError::Stalled { reason });
        }
        if body.len() > self.cfg.max_record_bytes as usize {
            return Err(SpoolError::RecordTooLarge {
                len: body.len(),
                max: self.cfg.max_record_bytes,
            });
        }
        let flen = frame::frame_len(body.len());
        if self.pending_bytes + flen + SEGMENT_HEADER_LEN > self.cfg.max_batch_bytes {
            return Err(SpoolError::BatchFull {
                bytes: self.pending_bytes,
            });
        }
        let mut dropped = None;
        let needs_rotation = {
            // Invariant: there is always an active segment (pushed at open, replaced only by
            // rotation, never dropped).
            let active = self.segments.back().ok_or(SpoolError::Poisoned)?;
            active.last >= active.first && active.len + flen > self.cfg.segment_bytes
        };
        let extra = if needs_rotation {
            SEGMENT_HEADER_LEN
        } else {
            0
        };
        if self.total_bytes + flen + extra > self.cfg.max_bytes {
            match self.cfg.when_full {
                FullPolicy::Block => {
                    self.counters.full_rejections += 1;
                    return Err(SpoolError::Full {
                        used: self.total_bytes,
                        max: self.cfg.max_bytes,
                    });
                }
                FullPolicy::DropOldest => {
                    dropped = self.drop_oldest(flen + extra)?;
                    if self.total_bytes + flen + extra > self.cfg.max_bytes {
                        self.counters.full_rejections += 1;
                        self.keep_unreported(dropped);
                        return Err(SpoolError::Full {
                            used: self.total_bytes,
                            max: self.cfg.max_bytes,
                        });
                    }
                }
            }
        }
        if needs_rotation {
            if let Err(e) = self.rotate() {
                self.keep_unreported(dropped);
                return Err(e);
            }
        }
        let dropped = merge_dropped(self.unreported_drop.take(), dropped);
        let seq = self.next_seq;
        let active_first = self.segments.back().map_or(seq, |s| s.first);
        if self.pending.last().map(|p| p.seg_first) != Some(active_first) {
            let buf = self.spare_bufs.pop().unwrap_or_default();
            self.pending.push(Pending {
                seg_first: active_first,
                path: segment_path(&self.dir, active_first),
                file: self.active_file.clone(),
                buf,
                pre_len: 0,
            });
        }
        if let Some(p) = self.pending.last_mut() {
            frame::encode_into(&mut p.buf, seq, body);
        }
        if let Some(s) = self.segments.back_mut() {
            s.len += flen;
            s.last = seq;
        }
        self.next_seq += 1;
        self.pending_bytes += flen;
        self.total_bytes += flen;
        self.counters.records_appended += 1;
        self.counters.bytes_appended += flen;
        Ok(Appended {
            seq: SpoolSeq(seq),
            dropped,
        })
    }

    fn poison<T>(&mut self, e: SpoolError) -> Result<T, SpoolError> {
        self.poisoned = true;
        Err(e)
    }

    /// An operation outside a commit job found the storage full or read-only: stall (no
    /// state was changed yet) instead of poisoning.
    fn stall_or_poison<T>(&mut self, e: SpoolError) -> Result<T, SpoolError> {
        match e.stall_reason() {
            Some(reason) => {
                self.counters.storage_refusals += 1;
                self.enter_stall(reason);
                Err(SpoolError::Stalled { reason })
            }
            None => self.poison(e),
        }
    }

    fn enter_stall(&mut self, reason: StallReason) {
        if self.stalled.is_none() {
            self.counters.stalls += 1;
        }
        self.stalled = Some(reason);
    }

    fn rotate(&mut self) -> Result<(), SpoolError> {
        let first = self.next_seq;
        let path = segment_path(&self.dir, first);
        let file = match self.fs.create(&path, true) {
            Ok(f) => f,
            Err(e) => return self.stall_or_poison(io_err("create", &path)(e)),
        };
        let mut buf = self.spare_bufs.pop().unwrap_or_default();
        buf.extend_from_slice(&SEGMENT_MAGIC);
        self.pending.push(Pending {
            seg_first: first,
            path,
            file: file.clone(),
            buf,
            pre_len: 0,
        });
        self.pending_bytes += SEGMENT_HEADER_LEN;
        self.total_bytes += SEGMENT_HEADER_LEN;
        self.segments.push_back(Segment {
            first,
            last: first - 1,
            len: SEGMENT_HEADER_LEN,
            committed_len: 0,
            committed_last: first - 1,
        });
        self.active_file = file;
        self.dir_dirty = true;
        self.counters.segments_created += 1;
        Ok(())
    }

    /// Starts a commit: takes the uncommitted batch (and the ack cursor and trims due) into a
    /// job. `Ok(None)` when there is nothing to do.
    pub fn begin_commit(&mut self) -> Result<Option<CommitJob>, SpoolError> {
        if self.poisoned {
            return Err(SpoolError::Poisoned);
        }
        if self.in_flight.is_some() {
            return Err(SpoolError::CommitInFlight);
        }
        let cursor = (self.persisted_ack != Some(self.ack)).then_some(self.ack);
        // Sealed segments wholly at or below the cursor being persisted (or already
        // persisted) go, after the cursor is durable.
        let removes: Vec<u64> = self
            .segments
            .iter()
            .take(self.segments.len().saturating_sub(1))
            .take_while(|s| s.last <= self.ack && s.committed_len == s.len)
            .map(|s| s.first)
            .collect();
        // A stalled spool always gets a job: it probes whether the storage takes writes again.
        let probe = self.stalled.is_some();
        if self.pending.is_empty()
            && cursor.is_none()
            && removes.is_empty()
            && !self.dir_dirty
            && !probe
        {
            return Ok(None);
        }
        let mut writes = std::mem::take(&mut self.pending);
        for w in &mut writes {
            w.pre_len = self
                .segments
                .iter()
                .find(|s| s.first == w.seg_first)
                .map_or(0, |s| s.committed_len);
        }
        let reached = writes
            .iter()
            .filter_map(|w| {
                self.segments
                    .iter()
                    .find(|s| s.first == w.seg_first)
                    .map(|s| (s.first, s.len, s.last))
            })
            .collect();
        self.pending_bytes = 0;
        let sync = self.cfg.fsync != FsyncPolicy::Never;
        let sync_dir = std::mem::take(&mut self.dir_dirty);
        let job = CommitJob {
            fs: self.fs.clone(),
            dir: self.dir.clone(),
            writes,
            sync,
            sync_dir,
            cursor,
            removes: removes
                .iter()
                .map(|&f| segment_path(&self.dir, f))
                .collect(),
            probe,
        };
        self.in_flight = Some(InFlight {
            through: self.next_seq - 1,
            sync_dir,
            probe,
            reached,
            cursor,
            removes,
        });
        Ok(Some(job))
    }

    /// Applies a finished job. On failure the spool is poisoned. When the storage refused a
    /// write for want of space or writability, the batch goes back (it is written by a later
    /// commit), whatever else the job did is applied, and the spool is stalled
    /// ([`Committed::stalled`]); a stalled spool's job that went through ends the stall.
    pub fn finish_commit(&mut self, outcome: CommitOutcome) -> Result<Committed, SpoolError> {
        let Some(done) = self.in_flight.take() else {
            return Err(SpoolError::NoCommitInFlight);
        };
        let CommitOutcome { result, writes } = outcome;
        let job = match result {
            Ok(job) => job,
            Err(e) => {
                self.recycle(writes);
                return self.poison(e);
            }
        };
        if job.data_written {
            self.recycle(writes);
            self.durable = self.durable.max(done.through);
            for (first, len, last) in done.reached {
                if let Some(s) = self.segments.iter_mut().find(|s| s.first == first) {
                    s.committed_len = s.committed_len.max(len);
                    s.committed_last = s.committed_last.max(last);
                }
            }
        } else {
            self.requeue(writes, done.sync_dir);
        }
        if let (Some(c), true) = (done.cursor, job.cursor_written) {
            self.persisted_ack = Some(c);
        }
        for &first in done.removes.iter().take(job.removed) {
            if let Some(i) = self.segments.iter().position(|s| s.first == first) {
                if let Some(s) = self.segments.remove(i) {
                    self.removals += 1;
                    self.total_bytes -= s.len;
                    self.counters.segments_trimmed += 1;
                }
                if self.read_file.as_ref().map(|r| r.0) == Some(first) {
                    self.read_file = None;
                }
            }
        }
        self.counters.storage_refusals += job.refusals;
        match job.stall {
            Some(reason) => {
                self.enter_stall(reason);
                if reason == StallReason::NoSpace {
                    self.seal_at_committed_end();
                }
            }
            None if done.probe => self.stalled = None,
            None => {}
        }
        let nanos = u64::try_from(job.fsync_time.as_nanos()).unwrap_or(u64::MAX);
        self.counters.commits += 1;
        self.counters.fsyncs += job.fsyncs;
        self.counters.fsync_nanos_total += nanos;
        self.counters.fsync_nanos_max = self.counters.fsync_nanos_max.max(nanos);
        Ok(Committed {
            durable_through: SpoolSeq(self.durable),
            fsync_time: job.fsync_time,
            stalled: self.stalled,
        })
    }

    /// Keeps up to four emptied buffers for later batches.
    fn recycle(&mut self, writes: Vec<Pending>) {
        for w in writes {
            let mut b = w.buf;
            if self.spare_bufs.len() < 4 {
                b.clear();
                self.spare_bufs.push(b);
            }
        }
    }

    /// Puts a batch the storage refused back in front of what was appended meanwhile
    /// (shares of one segment joined, in seq order). Shares of segments dropped meanwhile
    /// (drop-oldest) are gone with them.
    fn requeue(&mut self, writes: Vec<Pending>, sync_dir: bool) {
        let newer = std::mem::take(&mut self.pending);
        let mut out: Vec<Pending> = Vec::with_capacity(writes.len() + newer.len());
        for p in writes.into_iter().chain(newer) {
            if !self.segments.iter().any(|s| s.first == p.seg_first) {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.seg_first == p.seg_first => {
                    last.buf.extend_from_slice(&p.buf);
                    self.recycle(vec![p]);
                }
                _ => out.push(p),
            }
        }
        self.pending_bytes = out.iter().map(|p| p.buf.len() as u64).sum();
        self.pending = out;
        self.dir_dirty |= sync_dir;
    }

    /// On a full disk: ends the active segment at its last committed record and moves the
    /// records not yet written to a new segment file (created now; it needs no data blocks
    /// until its header is written). Without this, a disk smaller than a segment could never
    /// be freed by the cloud's acks, because only sealed segments are trimmed. Does nothing if
    /// the active segment has no committed record, if the file cannot be created (tried
    /// again at the next refusal), or if the new segment's header would take the spool past
    /// `max_bytes` (then it holds at least one other, sealed, segment, since `max_bytes` is
    /// two segments or more: acks free that one, and the next refusal seals).
    fn seal_at_committed_end(&mut self) {
        let Some(active) = self.segments.back().copied() else {
            return;
        };
        if active.committed_last < active.first || active.committed_len < SEGMENT_HEADER_LEN {
            return;
        }
        if self.total_bytes + SEGMENT_HEADER_LEN > self.cfg.max_bytes {
            return;
        }
        let first = active.committed_last + 1;
        let path = segment_path(&self.dir, first);
        let Ok(file) = self.fs.create(&path, true) else {
            return;
        };
        let mut buf = self.spare_bufs.pop().unwrap_or_default();
        buf.extend_from_slice(&SEGMENT_MAGIC);
        if let Some(i) = self
            .pending
            .iter()
            .position(|p| p.seg_first == active.first)
        {
            let moved = self.pending.remove(i);
            buf.extend_from_slice(&moved.buf);
            self.recycle(vec![moved]);
        }
        let moved_bytes = active.len - active.committed_len;
        if let Some(old) = self.segments.back_mut() {
            old.len = old.committed_len;
            old.last = old.committed_last;
        }
        self.pending.push(Pending {
            seg_first: first,
            path,
            file: file.clone(),
            buf,
            pre_len: 0,
        });
        self.segments.push_back(Segment {
            first,
            last: active.last,
            len: SEGMENT_HEADER_LEN + moved_bytes,
            committed_len: 0,
            committed_last: first - 1,
        });
        self.pending_bytes += SEGMENT_HEADER_LEN;
        self.total_bytes += SEGMENT_HEADER_LEN;
        self.active_file = file;
        self.dir_dirty = true;
        self.counters.segments_created += 1;
    }

    /// Begins, runs and finishes a commit on this thread (blocks for the fsync).
    pub fn commit(&mut self) -> Result<Committed, SpoolError> {
        match self.begin_commit()? {
            Some(job) => {
                let outcome = job.run();
                self.finish_commit(outcome)
            }
            None => Ok(Committed {
                durable_through: SpoolSeq(self.durable),
                fsync_time: Duration::ZERO,
                stalled: self.stalled,
            }),
        }
    }

    /// Records the cloud's acknowledgement of `seq`. Acks at or below the cursor are
    /// ignored (duplicates); acks may arrive out of order within `ack_window`.
    pub fn ack(&mut self, seq: SpoolSeq) -> Result<(), SpoolError> {
        let seq = seq.0;
        if seq <= self.ack {
            return Ok(());
        }
        if seq > self.durable {
            return Err(SpoolError::AckNotCommitted {
                seq,
                durable: self.durable,
            });
        }
        if seq - self.ack > self.cfg.ack_window {
            return Err(SpoolError::AckOutsideWindow {
                seq,
                cursor: self.ack,
                window: self.cfg.ack_window,
            });
        }
        self.acked_above.insert(seq);
        self.advance_ack();
        Ok(())
    }

    /// The first existing seq at or after `s`.
    fn next_existing(&self, s: u64) -> Option<u64> {
        let i = self.segments.partition_point(|seg| seg.last < s);
        self.segments.get(i).map(|seg| seg.first.max(s))
    }

    fn advance_ack(&mut self) {
        loop {
            let want = self.ack + 1;
            if want > self.durable {
                break;
            }
            match self.next_existing(want) {
                Some(n) if n > want => self.ack = n - 1,
                Some(n) if self.acked_above.remove(&n) => self.ack = n,
                Some(_) => break,
                None => {
                    self.ack = self.durable;
                    break;
                }
            }
        }
        if self.acked_above.first().is_some_and(|&f| f <= self.ack) {
            self.acked_above = self.acked_above.split_off(&(self.ack + 1));
        }
    }
}
