//! The live spool of one shard: append, group commit, read, ack, trim, bound.
//!
//! Owns: the in-memory index of segments (one small summary per segment, never per record),
//! the uncommitted batch, the ack window and the size bound. Does not own: recovery (see
//! `recovery`), the frame layout (see `frame`), or any clock or runtime: the caller decides
//! when to commit and where the blocking part of a commit runs.
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
//!   reopened and recovery decides from the disk what is durable.

use std::collections::{BTreeSet, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::cursor;
use crate::frame::{self, FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, SEGMENT_MAGIC};
use crate::fs::{segment_path, RealFs, SpoolFile, SpoolFs};
use crate::recovery::{self, RecoveryReport};
use crate::scan::Window;

/// Sequence number of a record: assigned by [`Spool::append`], consecutive from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SpoolSeq(pub u64);

impl std::fmt::Display for SpoolSeq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// When a commit fsyncs. The caller schedules commits; this says what a commit does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// The caller commits after every batch it reads from devices; each commit fsyncs.
    Always,
    /// The caller commits on a timer of this period; each commit fsyncs (group commit).
    Interval(Duration),
    /// Commits write but never fsync: for tests on tmpfs. A crash loses anything.
    Never,
}

impl FsyncPolicy {
    /// The commit period the caller should use (`None`: commit per batch).
    pub fn interval(&self) -> Option<Duration> {
        match self {
            FsyncPolicy::Interval(d) => Some(*d),
            _ => None,
        }
    }
}

/// What [`Spool::append`] does when `max_bytes` would be exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullPolicy {
    /// Refuse with [`SpoolError::Full`]: the caller back-pressures devices.
    Block,
    /// Remove the oldest segments, unacknowledged or not, and count them.
    DropOldest,
}

/// Spool configuration. Units are in the field names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolConfig {
    /// A segment is sealed when the next frame would take it past this size.
    pub segment_bytes: u64,
    /// Bound on all segment files together (headers and frames, committed or not).
    pub max_bytes: u64,
    /// What happens at `max_bytes`.
    pub when_full: FullPolicy,
    /// What a commit does.
    pub fsync: FsyncPolicy,
    /// Largest record body accepted.
    pub max_record_bytes: u32,
    /// Bound on bytes appended but not yet handed to a commit job.
    pub max_batch_bytes: u64,
    /// Acks may run at most this many seqs ahead of the ack cursor (the uplink's inflight
    /// window); it bounds the out-of-order ack set.
    pub ack_window: u64,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            segment_bytes: 64 << 20,
            max_bytes: 1 << 30,
            when_full: FullPolicy::Block,
            fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
            max_record_bytes: 1 << 20,
            max_batch_bytes: 16 << 20,
            ack_window: 65_536,
        }
    }
}

impl SpoolConfig {
    /// Checks the relations the spool relies on.
    pub fn validate(&self) -> Result<(), SpoolError> {
        let max_frame = frame::frame_len(self.max_record_bytes as usize);
        let bad = |what: &'static str| Err(SpoolError::Config(what));
        if self.max_record_bytes == 0 || self.max_record_bytes > u32::MAX / 2 {
            return bad("max_record_bytes must be between 1 and 2 GiB");
        }
        if self.segment_bytes < SEGMENT_HEADER_LEN + max_frame {
            return bad("segment_bytes must hold the header and one maximal record");
        }
        if self.max_bytes < 2 * self.segment_bytes {
            return bad("max_bytes must be at least two segments");
        }
        if self.max_batch_bytes < max_frame {
            return bad("max_batch_bytes must hold one maximal record");
        }
        if self.ack_window == 0 {
            return bad("ack_window must be at least 1");
        }
        Ok(())
    }
}

/// Errors of the live spool. Each says whether retrying can help.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// The configuration is inconsistent (local, fix the config).
    #[error("invalid spool configuration: {0}")]
    Config(&'static str),
    /// `max_bytes` reached under [`FullPolicy::Block`]: back-pressure and retry after acks
    /// have been committed.
    #[error(
        "spool full ({used} of {max} bytes): back-pressure devices until the cloud acknowledges"
    )]
    Full {
        /// Bytes in use.
        used: u64,
        /// The bound.
        max: u64,
    },
    /// The uncommitted batch reached `max_batch_bytes`: commit, then retry.
    #[error("uncommitted batch full ({bytes} bytes): commit before appending more")]
    BatchFull {
        /// Bytes waiting for a commit.
        bytes: u64,
    },
    /// The record is larger than `max_record_bytes` (the device's fault; retrying won't help).
    #[error("record of {len} bytes exceeds max_record_bytes ({max})")]
    RecordTooLarge {
        /// Its length.
        len: usize,
        /// The bound.
        max: u32,
    },
    /// [`Spool::begin_commit`] while a job is in flight.
    #[error("a commit is already in flight")]
    CommitInFlight,
    /// [`Spool::finish_commit`] without a job in flight.
    #[error("no commit is in flight")]
    NoCommitInFlight,
    /// An ack for a seq that is not durable yet (an uplink bug).
    #[error("ack for seq {seq}, but records are durable only through {durable}")]
    AckNotCommitted {
        /// The acked seq.
        seq: u64,
        /// Durable through.
        durable: u64,
    },
    /// An ack too far ahead of the ack cursor (the uplink's window exceeds `ack_window`).
    #[error(
        "ack for seq {seq} is more than ack_window ({window}) ahead of the ack cursor {cursor}"
    )]
    AckOutsideWindow {
        /// The acked seq.
        seq: u64,
        /// The ack cursor.
        cursor: u64,
        /// The window.
        window: u64,
    },
    /// A committed record failed its checksum on read (the medium changed it). Reopening
    /// lets recovery quarantine it.
    #[error(
        "record at {path}:{offset} failed its checksum on read; reopen the spool to quarantine it"
    )]
    CorruptRecord {
        /// Segment file.
        path: PathBuf,
        /// Byte offset.
        offset: u64,
    },
    /// Local storage failed. The spool is poisoned and must be reopened.
    #[error("spool storage failed to {op} {path}: {source}; the spool must be reopened")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// An earlier write or fsync failed; reopen the spool.
    #[error("the spool failed an earlier write or fsync and must be reopened")]
    Poisoned,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SpoolError + 'a {
    move |source| SpoolError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// A record read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolRecord {
    /// Its seq.
    pub seq: SpoolSeq,
    /// Its body, exactly as appended.
    pub body: Bytes,
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
}

/// A reader's position: the next seq it wants, plus a byte-offset hint so sequential reads
/// never rescan, and a direction. Plain data owned by the caller (e.g. the uplink).
///
/// Newest-first cursors ([`ReadCursor::newest_first`]) read committed, unacknowledged records
/// downwards from a seq to just above the ack cursor. They need no format change: each batch
/// is a forward read of the records just below the cursor inside one segment, returned in
/// reverse; a per-segment checkpoint table (every [`REV_CHECKPOINT_EVERY`]th frame's offset,
/// built on the first backward read in a segment, bounded by the segment's size) spares
/// rescanning the segment from its start for every batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadCursor {
    next: u64,
    hint: Option<(u64, u64)>,
    newest_first: bool,
}

/// Frames between two checkpoints of the newest-first reader's per-segment table.
pub const REV_CHECKPOINT_EVERY: u64 = 256;

impl ReadCursor {
    /// A cursor that starts at `seq` and reads upwards (oldest first).
    pub fn at(seq: SpoolSeq) -> Self {
        ReadCursor {
            next: seq.0.max(1),
            hint: None,
            newest_first: false,
        }
    }
    /// A cursor that reads downwards (newest first) from `seq` (clamped to the newest
    /// committed record) to the oldest unacknowledged record.
    pub fn newest_first(seq: SpoolSeq) -> Self {
        ReadCursor {
            next: seq.0,
            hint: None,
            newest_first: true,
        }
    }
    /// Whether this cursor reads newest first.
    pub fn is_newest_first(&self) -> bool {
        self.newest_first
    }
    /// The next seq this cursor will return (or a later one, if that one no longer exists).
    pub fn next_seq(&self) -> SpoolSeq {
        SpoolSeq(self.next)
    }
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    first: u64,
    /// `first - 1` while empty.
    last: u64,
    /// Bytes including not yet committed ones.
    len: u64,
    committed_len: u64,
    committed_last: u64,
}

struct Pending {
    seg_first: u64,
    path: PathBuf,
    file: Arc<dyn SpoolFile>,
    buf: Vec<u8>,
}

struct InFlight {
    through: u64,
    /// (segment first seq, length, last seq) each written segment reaches.
    reached: Vec<(u64, u64, u64)>,
    cursor: Option<u64>,
    removes: Vec<u64>,
}

/// The blocking half of a commit. `Send`: run it on another thread.
pub struct CommitJob {
    fs: Arc<dyn SpoolFs>,
    dir: PathBuf,
    writes: Vec<Pending>,
    sync: bool,
    sync_dir: bool,
    cursor: Option<u64>,
    removes: Vec<PathBuf>,
}

/// What a [`CommitJob`] did; hand it to [`Spool::finish_commit`].
pub struct CommitOutcome {
    result: Result<(Duration, u64), SpoolError>,
    buffers: Vec<Vec<u8>>,
}

impl CommitJob {
    /// Writes the batch, fsyncs per policy, persists the ack cursor and removes trimmed
    /// segments. Blocks.
    pub fn run(self) -> CommitOutcome {
        let CommitJob {
            fs,
            dir,
            writes,
            sync,
            sync_dir,
            cursor,
            removes,
        } = self;
        let result = (|| {
            for w in &writes {
                w.file.append(&w.buf).map_err(io_err("write", &w.path))?;
            }
            let mut fsync_time = Duration::ZERO;
            let mut fsyncs = 0;
            if sync {
                let t = Instant::now();
                let mut last: Option<u64> = None;
                for w in &writes {
                    if last != Some(w.seg_first) {
                        w.file.sync().map_err(io_err("fsync", &w.path))?;
                        fsyncs += 1;
                        last = Some(w.seg_first);
                    }
                }
                if sync_dir {
                    fs.sync_dir(&dir).map_err(io_err("fsync directory", &dir))?;
                }
                fsync_time = t.elapsed();
            }
            if let Some(c) = cursor {
                cursor::write(&*fs, &dir, c, sync).map_err(io_err("write ack cursor in", &dir))?;
            }
            for path in &removes {
                match fs.remove(path) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => {
                        return Err(io_err("remove", path)(e));
                    }
                    _ => {}
                }
            }
            Ok((fsync_time, fsyncs))
        })();
        CommitOutcome {
            result,
            buffers: writes.into_iter().map(|w| w.buf).collect(),
        }
    }
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
}

/// Offsets of every [`REV_CHECKPOINT_EVERY`]th frame of one segment (newest-first reads).
struct RevIndex {
    seg_first: u64,
    /// Frames are indexed up to this offset (the table grows with the segment).
    scanned_off: u64,
    points: Vec<(u64, u64)>,
}

/// Bytes read at a time by readers (more when one record is larger).
const READ_CHUNK: usize = 256 << 10;

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
        let persisted_ack =
            matches!(rec.report.cursor, recovery::CursorRecovery::Valid).then_some(rec.ack_cursor);
        let newest = rec.segments.last().map_or(0, |m| m.last);
        let next_seq = newest.max(rec.ack_cursor) + 1;
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
        let total_bytes = segments.iter().map(|s| s.len).sum::<u64>();
        let path = segment_path(&dir, next_seq);
        let file = fs.create(&path, true).map_err(io_err("create", &path))?;
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
            }],
            pending_bytes: SEGMENT_HEADER_LEN,
            dir_dirty: true,
            in_flight: None,
            total_bytes: total_bytes + SEGMENT_HEADER_LEN,
            poisoned: false,
            counters: SpoolCounters {
                segments_created: 1,
                ..Default::default()
            },
            read_file: None,
            spare_bufs: Vec::new(),
            rev_index: None,
            removals: 0,
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
                        return Err(SpoolError::Full {
                            used: self.total_bytes,
                            max: self.cfg.max_bytes,
                        });
                    }
                }
            }
        }
        if needs_rotation {
            self.rotate()?;
        }
        let seq = self.next_seq;
        let active_first = self.segments.back().map_or(seq, |s| s.first);
        if self.pending.last().map(|p| p.seg_first) != Some(active_first) {
            let buf = self.spare_bufs.pop().unwrap_or_default();
            self.pending.push(Pending {
                seg_first: active_first,
                path: segment_path(&self.dir, active_first),
                file: self.active_file.clone(),
                buf,
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

    fn rotate(&mut self) -> Result<(), SpoolError> {
        let first = self.next_seq;
        let path = segment_path(&self.dir, first);
        let file = match self.fs.create(&path, true) {
            Ok(f) => f,
            Err(e) => return self.poison(io_err("create", &path)(e)),
        };
        let mut buf = self.spare_bufs.pop().unwrap_or_default();
        buf.extend_from_slice(&SEGMENT_MAGIC);
        self.pending.push(Pending {
            seg_first: first,
            path,
            file: file.clone(),
            buf,
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

    /// Removes the oldest sealed segments until `need` more bytes fit.
    fn drop_oldest(&mut self, need: u64) -> Result<Option<Dropped>, SpoolError> {
        let mut dropped: Option<Dropped> = None;
        while self.total_bytes + need > self.cfg.max_bytes && self.segments.len() > 1 {
            let Some(seg) = self.segments.pop_front() else {
                break;
            };
            let path = segment_path(&self.dir, seg.first);
            if let Err(e) = self.fs.remove(&path) {
                return self.poison(io_err("remove", &path)(e));
            }
            self.dir_dirty = true;
            self.removals += 1;
            self.total_bytes -= seg.len;
            let before = self.pending.len();
            self.pending.retain(|p| p.seg_first != seg.first);
            if self.pending.len() != before {
                self.pending_bytes = self.pending.iter().map(|p| p.buf.len() as u64).sum();
            }
            if self.read_file.as_ref().map(|r| r.0) == Some(seg.first) {
                self.read_file = None;
            }
            let records = (seg.last + 1).saturating_sub(seg.first);
            self.counters.dropped_oldest_segments += 1;
            self.counters.dropped_oldest_records += records;
            let d = dropped.get_or_insert(Dropped {
                first: SpoolSeq(seg.first),
                last: SpoolSeq(seg.last),
                records: 0,
                segments: 0,
            });
            d.last = SpoolSeq(seg.last);
            d.records += records;
            d.segments += 1;
            if seg.last > self.ack {
                self.ack = seg.last;
            }
            self.durable = self.durable.max(seg.last.min(self.next_seq - 1));
            self.advance_ack();
        }
        Ok(dropped)
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
        if self.pending.is_empty() && cursor.is_none() && removes.is_empty() && !self.dir_dirty {
            return Ok(None);
        }
        let writes = std::mem::take(&mut self.pending);
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
        let job = CommitJob {
            fs: self.fs.clone(),
            dir: self.dir.clone(),
            writes,
            sync,
            sync_dir: std::mem::take(&mut self.dir_dirty),
            cursor,
            removes: removes
                .iter()
                .map(|&f| segment_path(&self.dir, f))
                .collect(),
        };
        self.in_flight = Some(InFlight {
            through: self.next_seq - 1,
            reached,
            cursor,
            removes,
        });
        Ok(Some(job))
    }

    /// Applies a finished job. On failure the spool is poisoned.
    pub fn finish_commit(&mut self, outcome: CommitOutcome) -> Result<Committed, SpoolError> {
        let Some(done) = self.in_flight.take() else {
            return Err(SpoolError::NoCommitInFlight);
        };
        for mut b in outcome.buffers {
            if self.spare_bufs.len() < 4 {
                b.clear();
                self.spare_bufs.push(b);
            }
        }
        let (fsync_time, fsyncs) = match outcome.result {
            Ok(v) => v,
            Err(e) => return self.poison(e),
        };
        self.durable = self.durable.max(done.through);
        for (first, len, last) in done.reached {
            if let Some(s) = self.segments.iter_mut().find(|s| s.first == first) {
                s.committed_len = s.committed_len.max(len);
                s.committed_last = s.committed_last.max(last);
            }
        }
        if let Some(c) = done.cursor {
            self.persisted_ack = Some(c);
        }
        for first in done.removes {
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
        let nanos = u64::try_from(fsync_time.as_nanos()).unwrap_or(u64::MAX);
        self.counters.commits += 1;
        self.counters.fsyncs += fsyncs;
        self.counters.fsync_nanos_total += nanos;
        self.counters.fsync_nanos_max = self.counters.fsync_nanos_max.max(nanos);
        Ok(Committed {
            durable_through: SpoolSeq(self.durable),
            fsync_time,
        })
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

    /// A read cursor at the first unacknowledged record.
    pub fn read_cursor(&self) -> ReadCursor {
        ReadCursor {
            next: self.ack + 1,
            hint: None,
            newest_first: false,
        }
    }

    /// Reads committed records from `cur` into `out` in the cursor's direction (seq order,
    /// or reverse seq order for a newest-first cursor): at most `max_records`, and stops once
    /// `max_bytes` of bodies are read (at least one record is returned when one is
    /// available). Records that no longer exist (trimmed, dropped, quarantined) are skipped;
    /// a newest-first cursor stops above the ack cursor. Returns how many were read.
    ///
    /// A record that fails its checksum ends the read: the records before it (in the cursor's
    /// direction) are returned, and the next read fails with [`SpoolError::CorruptRecord`]
    /// with `cur.next_seq()` at the damaged record, so a caller that skips exactly that seq
    /// loses nothing else.
    pub fn read(
        &mut self,
        cur: &mut ReadCursor,
        max_records: usize,
        max_bytes: usize,
        out: &mut Vec<SpoolRecord>,
    ) -> Result<usize, SpoolError> {
        if self.poisoned {
            return Err(SpoolError::Poisoned);
        }
        let mut reader = Reader {
            fs: &*self.fs,
            dir: &self.dir,
            segments: &self.segments,
            active_first: self.segments.back().map_or(0, |s| s.first),
            active_file: &self.active_file,
            durable: self.durable,
            ack: self.ack,
            read_file: self.read_file.take(),
            rev_index: self.rev_index.take(),
        };
        let result = reader.read(cur, max_records, max_bytes, out);
        let Reader {
            read_file,
            rev_index,
            ..
        } = reader;
        self.read_file = read_file;
        self.rev_index = rev_index;
        result
    }

    /// Starts a read whose blocking part runs elsewhere, like a commit: [`ReadJob::run`]
    /// reads from `cur` as [`Spool::read`] would (on a snapshot of the segment index taken
    /// now) on another thread, and [`Spool::finish_read`] hands back what it read. Appends,
    /// commits and acks continue meanwhile; the caller runs one read at a time.
    pub fn begin_read(
        &mut self,
        cur: ReadCursor,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<ReadJob, SpoolError> {
        if self.poisoned {
            return Err(SpoolError::Poisoned);
        }
        Ok(ReadJob {
            fs: self.fs.clone(),
            dir: self.dir.clone(),
            // One small summary per segment (bounded by max_bytes / segment_bytes).
            segments: self.segments.clone(),
            active_first: self.segments.back().map_or(0, |s| s.first),
            active_file: self.active_file.clone(),
            durable: self.durable,
            ack: self.ack,
            read_file: self.read_file.take(),
            rev_index: self.rev_index.take(),
            removals: self.removals,
            cursor: cur,
            max_records,
            max_bytes,
        })
    }

    /// Takes back a finished [`ReadJob`]: the cursor after the read, the records and the
    /// read's result, as [`Spool::read`] gives them. `None` when segments were removed (trim,
    /// drop-oldest) while the job ran: its files or records may be gone, so the outcome is
    /// discarded and the caller reads again from its unchanged cursor. After a failure the
    /// spool poisoned meanwhile, the result is [`SpoolError::Poisoned`].
    pub fn finish_read(&mut self, outcome: ReadOutcome) -> Option<ReadDone> {
        if outcome.removals != self.removals {
            return None;
        }
        if self.poisoned {
            return Some(ReadDone {
                cursor: outcome.start,
                records: Vec::new(),
                result: Err(SpoolError::Poisoned),
            });
        }
        self.read_file = outcome.read_file;
        self.rev_index = outcome.rev_index;
        Some(outcome.done)
    }

    /// Every record at or below this seq is durable (or was dropped / trimmed).
    pub fn durable_seq(&self) -> SpoolSeq {
        SpoolSeq(self.durable)
    }
    /// The seq the next append gets.
    pub fn next_seq(&self) -> SpoolSeq {
        SpoolSeq(self.next_seq)
    }
    /// Every record at or below this seq is acknowledged (in memory).
    pub fn ack_cursor(&self) -> SpoolSeq {
        SpoolSeq(self.ack)
    }
    /// The ack cursor as last persisted (what a restart resumes from), if written yet.
    pub fn persisted_ack_cursor(&self) -> Option<SpoolSeq> {
        self.persisted_ack.map(SpoolSeq)
    }
    /// Bytes of all segment files, including uncommitted ones.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    /// Bytes appended but not yet handed to a commit job.
    pub fn uncommitted_bytes(&self) -> u64 {
        self.pending_bytes
    }
    /// True when a commit job is out.
    pub fn commit_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }
    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }
    /// Counters for metrics.
    pub fn counters(&self) -> &SpoolCounters {
        &self.counters
    }
    /// The configuration in force.
    pub fn config(&self) -> &SpoolConfig {
        &self.cfg
    }
    /// True after a failed write or fsync: reopen.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }
}

/// The blocking half of a read (see [`Spool::begin_read`]). `Send`: run it on another thread.
pub struct ReadJob {
    fs: Arc<dyn SpoolFs>,
    dir: PathBuf,
    segments: VecDeque<Segment>,
    active_first: u64,
    active_file: Arc<dyn SpoolFile>,
    durable: u64,
    ack: u64,
    read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    rev_index: Option<RevIndex>,
    removals: u64,
    cursor: ReadCursor,
    max_records: usize,
    max_bytes: usize,
}

/// What a [`ReadJob`] did; hand it to [`Spool::finish_read`].
pub struct ReadOutcome {
    start: ReadCursor,
    done: ReadDone,
    read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    rev_index: Option<RevIndex>,
    removals: u64,
}

/// A finished read, as [`Spool::read`] reports it.
#[derive(Debug)]
pub struct ReadDone {
    /// The cursor after the read (on the damaged record after a `CorruptRecord`).
    pub cursor: ReadCursor,
    /// The records read, in the cursor's direction.
    pub records: Vec<SpoolRecord>,
    /// How many were read, or why the read failed.
    pub result: Result<usize, SpoolError>,
}

impl ReadJob {
    /// Reads (blocks on the disk).
    pub fn run(self) -> ReadOutcome {
        let mut reader = Reader {
            fs: &*self.fs,
            dir: &self.dir,
            segments: &self.segments,
            active_first: self.active_first,
            active_file: &self.active_file,
            durable: self.durable,
            ack: self.ack,
            read_file: self.read_file,
            rev_index: self.rev_index,
        };
        let mut cursor = self.cursor;
        let mut records = Vec::new();
        let result = reader.read(&mut cursor, self.max_records, self.max_bytes, &mut records);
        ReadOutcome {
            start: self.cursor,
            done: ReadDone {
                cursor,
                records,
                result,
            },
            read_file: reader.read_file,
            rev_index: reader.rev_index,
            removals: self.removals,
        }
    }
}

/// Reads committed records: the spool's segment index and files, borrowed by [`Spool::read`]
/// or owned by a [`ReadJob`], and the reader's caches (open segment file, reverse index),
/// which move in and back out.
struct Reader<'a> {
    fs: &'a dyn SpoolFs,
    dir: &'a Path,
    segments: &'a VecDeque<Segment>,
    active_first: u64,
    active_file: &'a Arc<dyn SpoolFile>,
    durable: u64,
    ack: u64,
    read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    rev_index: Option<RevIndex>,
}

impl Reader<'_> {
    /// The first existing seq at or after `s`.
    fn next_existing(&self, s: u64) -> Option<u64> {
        let i = self.segments.partition_point(|seg| seg.last < s);
        self.segments.get(i).map(|seg| seg.first.max(s))
    }

    fn read(
        &mut self,
        cur: &mut ReadCursor,
        max_records: usize,
        max_bytes: usize,
        out: &mut Vec<SpoolRecord>,
    ) -> Result<usize, SpoolError> {
        if cur.newest_first {
            return self.read_newest_first(cur, max_records, max_bytes, out);
        }
        let before = out.len();
        match self.read_forward(cur, max_records, max_bytes, out) {
            // `cur.next` stopped at the damaged record; the hint may point before it.
            Err(SpoolError::CorruptRecord { .. }) if out.len() > before => {
                cur.hint = None;
                Ok(out.len() - before)
            }
            r => r,
        }
    }

    fn read_forward(
        &mut self,
        cur: &mut ReadCursor,
        max_records: usize,
        max_bytes: usize,
        out: &mut Vec<SpoolRecord>,
    ) -> Result<usize, SpoolError> {
        let mut n = 0;
        let mut bytes = 0usize;
        while n < max_records && (n == 0 || bytes < max_bytes) && cur.next <= self.durable {
            let Some(next) = self.next_existing(cur.next) else {
                break;
            };
            if next != cur.next {
                cur.next = next;
                cur.hint = None;
            }
            let i = self.segments.partition_point(|s| s.last < cur.next);
            let Some(&seg) = self.segments.get(i) else {
                break;
            };
            if cur.next > seg.committed_last || cur.next > self.durable {
                break;
            }
            let path = segment_path(self.dir, seg.first);
            let file = self.file_for(&seg, &path)?;
            let mut off = match cur.hint {
                Some((f, off)) if f == seg.first => off,
                _ => self.locate_checked(&seg, cur.next)?,
            };
            // A damaged length field upstream (found by `locate` or the reverse index) can
            // point past the committed end.
            if off + FRAME_HEADER_LEN as u64 > seg.committed_len {
                return Err(SpoolError::CorruptRecord { path, offset: off });
            }
            let avail = seg.committed_len - off;
            let mut want = (avail as usize).min(READ_CHUNK.max(max_bytes.saturating_sub(bytes)));
            let mut hdr = [0u8; FRAME_HEADER_LEN];
            file.read_exact_at(&mut hdr, off)
                .map_err(io_err("read", &path))?;
            let first_len = frame::parse_header(&hdr).map_or(0, |h| h.frame_len());
            if first_len > avail || first_len == 0 {
                return Err(SpoolError::CorruptRecord { path, offset: off });
            }
            want = want.max(first_len as usize);
            let mut buf = BytesMut::zeroed(want);
            file.read_exact_at(&mut buf, off)
                .map_err(io_err("read", &path))?;
            let chunk = buf.freeze();
            let mut p = 0usize;
            while n < max_records && (n == 0 || bytes < max_bytes) {
                let Some(h) = frame::parse_header(&chunk[p..]) else {
                    break;
                };
                let end = p + h.frame_len() as usize;
                if end > chunk.len() {
                    break;
                }
                if h.seq != cur.next || !frame::check_frame(&chunk[p..end]) {
                    return Err(SpoolError::CorruptRecord {
                        path,
                        offset: off + p as u64,
                    });
                }
                out.push(SpoolRecord {
                    seq: SpoolSeq(h.seq),
                    body: chunk.slice(p + FRAME_HEADER_LEN..end),
                });
                n += 1;
                bytes += h.len as usize;
                cur.next += 1;
                p = end;
                if h.seq >= seg.committed_last {
                    break;
                }
            }
            off += p as u64;
            cur.hint = Some((seg.first, off));
        }
        Ok(n)
    }

    fn read_newest_first(
        &mut self,
        cur: &mut ReadCursor,
        max_records: usize,
        max_bytes: usize,
        out: &mut Vec<SpoolRecord>,
    ) -> Result<usize, SpoolError> {
        let mut n = 0usize;
        let mut bytes = 0usize;
        let mut tmp = Vec::new();
        while n < max_records && (n == 0 || bytes < max_bytes) {
            let floor = self.ack + 1;
            let top = cur.next.min(self.durable);
            if top < floor {
                cur.next = floor - 1;
                break;
            }
            // The newest segment starting at or below `top`.
            let i = self.segments.partition_point(|s| s.first <= top);
            let Some(&seg) = i.checked_sub(1).and_then(|i| self.segments.get(i)) else {
                cur.next = 0;
                break;
            };
            let hi = top.min(seg.committed_last);
            let lo_min = seg.first.max(floor);
            if hi < lo_min {
                // Nothing committed here (or all acknowledged): go below this segment.
                cur.next = seg.first.saturating_sub(1).min(top.saturating_sub(1));
                continue;
            }
            let mut k = (max_records - n).min((hi - lo_min + 1) as usize);
            // Set once damage shows in this segment: records are then found by the
            // checksum-validating scan instead of the reverse index's header walk.
            let mut scan = false;
            loop {
                let lo = hi + 1 - k as u64;
                tmp.clear();
                let located = if scan {
                    self.locate_checked(&seg, lo)
                } else {
                    self.rev_offset(&seg, lo)
                };
                let off = match located {
                    Ok(off) => off,
                    Err(SpoolError::CorruptRecord { .. }) if !scan => {
                        scan = true;
                        continue;
                    }
                    // No valid frame `lo`: it is the damaged one. Read the window above it
                    // first (the next round ends at it).
                    Err(SpoolError::CorruptRecord { .. }) if lo < hi => {
                        k = (hi - lo) as usize;
                        continue;
                    }
                    Err(e @ SpoolError::CorruptRecord { .. }) => {
                        cur.next = hi;
                        return if n > 0 { Ok(n) } else { Err(e) };
                    }
                    Err(e) => return Err(e),
                };
                let mut fwd = ReadCursor {
                    next: lo,
                    hint: Some((seg.first, off)),
                    newest_first: false,
                };
                match self.read_forward(
                    &mut fwd,
                    k,
                    max_bytes.saturating_sub(bytes).max(1),
                    &mut tmp,
                ) {
                    Ok(_) => {}
                    // The offset may have come from a damaged chain of headers: find `lo`
                    // again with the scan before taking a record for damaged.
                    Err(SpoolError::CorruptRecord { .. }) if !scan => {
                        scan = true;
                        continue;
                    }
                    // `fwd.next` is the damaged record. Below `hi`: read the window above
                    // it first (the next round ends at it).
                    Err(SpoolError::CorruptRecord { .. }) if fwd.next < hi => {
                        k = (hi - fwd.next) as usize;
                        continue;
                    }
                    // `hi` itself: return what came before it (from above), or fail with
                    // the cursor on it.
                    Err(e @ SpoolError::CorruptRecord { .. }) => {
                        cur.next = hi;
                        return if n > 0 { Ok(n) } else { Err(e) };
                    }
                    Err(e) => return Err(e),
                }
                let reached = tmp.last().map(|r| r.seq.0) == Some(hi);
                if reached || k == 1 {
                    break;
                }
                k = (k - 1).min(tmp.len().max(1));
            }
            tmp.retain(|r| r.seq.0 <= hi);
            let lowest = tmp.first().map_or(hi, |r| r.seq.0);
            for r in tmp.drain(..).rev() {
                bytes += r.body.len();
                n += 1;
                out.push(r);
            }
            cur.next = lowest - 1;
        }
        Ok(n)
    }

    /// Byte offset of a valid frame `seq` in `seg`, found by [`locate`]; `CorruptRecord` when
    /// there is none (the record is damaged).
    fn locate_checked(&mut self, seg: &Segment, seq: u64) -> Result<u64, SpoolError> {
        let path = segment_path(self.dir, seg.first);
        let file = self.file_for(seg, &path)?;
        locate(&*file, seg.committed_len, seq).map_err(|e| match e {
            Some(e) => io_err("read", &path)(e),
            None => SpoolError::CorruptRecord {
                path: path.clone(),
                offset: 0,
            },
        })
    }

    /// Byte offset of record `lo` in `seg`, walking frame headers from the nearest
    /// checkpoint at or below it (the table is extended as the segment grows).
    fn rev_offset(&mut self, seg: &Segment, lo: u64) -> Result<u64, SpoolError> {
        let path = segment_path(self.dir, seg.first);
        let file = self.file_for(seg, &path)?;
        let mut ix = match self.rev_index.take() {
            Some(ix) if ix.seg_first == seg.first => ix,
            _ => RevIndex {
                seg_first: seg.first,
                scanned_off: SEGMENT_HEADER_LEN,
                points: Vec::new(),
            },
        };
        let corrupt = |offset| SpoolError::CorruptRecord {
            path: path.clone(),
            offset,
        };
        if ix.scanned_off < seg.committed_len {
            let mut w = Window::new(&*file, seg.committed_len, 64 << 10);
            let mut off = ix.scanned_off;
            while off + FRAME_HEADER_LEN as u64 <= seg.committed_len {
                let hdr = w
                    .get(off, FRAME_HEADER_LEN)
                    .map_err(io_err("read", &path))?;
                let h = frame::parse_header(hdr).ok_or_else(|| corrupt(off))?;
                if h.frame_len() == 0 || h.seq < seg.first {
                    return Err(corrupt(off));
                }
                if (h.seq - seg.first).is_multiple_of(REV_CHECKPOINT_EVERY) {
                    ix.points.push((h.seq, off));
                }
                off += h.frame_len();
            }
            ix.scanned_off = off;
        }
        let i = ix.points.partition_point(|&(s, _)| s <= lo);
        let (mut seq, mut off) = match i.checked_sub(1).and_then(|i| ix.points.get(i)) {
            Some(&p) => p,
            None => (seg.first, SEGMENT_HEADER_LEN),
        };
        self.rev_index = Some(ix);
        let mut w = Window::new(&*file, seg.committed_len, 16 << 10);
        while seq < lo {
            if off + FRAME_HEADER_LEN as u64 > seg.committed_len {
                return Err(corrupt(off));
            }
            let hdr = w
                .get(off, FRAME_HEADER_LEN)
                .map_err(io_err("read", &path))?;
            let h = frame::parse_header(hdr).ok_or_else(|| corrupt(off))?;
            if h.seq != seq || h.frame_len() == 0 {
                return Err(corrupt(off));
            }
            off += h.frame_len();
            seq += 1;
        }
        Ok(off)
    }

    fn file_for(&mut self, seg: &Segment, path: &Path) -> Result<Arc<dyn SpoolFile>, SpoolError> {
        if seg.first == self.active_first {
            return Ok(self.active_file.clone());
        }
        if let Some((first, f)) = &self.read_file {
            if *first == seg.first {
                return Ok(f.clone());
            }
        }
        let f = self.fs.open_read(path).map_err(io_err("open", path))?;
        self.read_file = Some((seg.first, f.clone()));
        Ok(f)
    }
}

/// Byte offset of the valid frame with `seq` in a segment: walking headers, and when that
/// does not lead to it (damage on the way), by [`locate_scan`]. `Err(None)`: no valid frame
/// `seq` (the record is damaged, or the segment does not hold what the index says).
fn locate(file: &dyn SpoolFile, committed_len: u64, seq: u64) -> Result<u64, Option<io::Error>> {
    let mut w = Window::new(file, committed_len, 64 << 10);
    let mut off = SEGMENT_HEADER_LEN;
    while off + FRAME_HEADER_LEN as u64 <= committed_len {
        let Some(h) = frame::parse_header(w.get(off, FRAME_HEADER_LEN).map_err(Some)?) else {
            break;
        };
        let len = h.frame_len();
        if h.seq == seq {
            if off + len <= committed_len
                && frame::check_frame(w.get(off, len as usize).map_err(Some)?)
            {
                return Ok(off);
            }
            break;
        }
        if h.seq > seq || len == 0 {
            break;
        }
        off += len;
    }
    // Walking the headers did not lead to a valid frame `seq`: a header on the way (or the
    // record itself) is damaged.
    locate_scan(file, committed_len, seq)
}

/// [`locate`] for a segment with damage: steps over frames whose checksum matches and tries
/// every byte offset in between (as recovery's scan does), so a damaged frame costs only
/// itself. Only valid frames count, and the bytes inside them are never taken for a frame.
fn locate_scan(
    file: &dyn SpoolFile,
    committed_len: u64,
    seq: u64,
) -> Result<u64, Option<io::Error>> {
    let mut w = Window::new(file, committed_len, 64 << 10);
    let mut off = SEGMENT_HEADER_LEN;
    while off + FRAME_HEADER_LEN as u64 <= committed_len {
        if let Some(h) = frame::parse_header(w.get(off, FRAME_HEADER_LEN).map_err(Some)?) {
            let len = h.frame_len();
            if off + len <= committed_len
                && frame::check_frame(w.get(off, len as usize).map_err(Some)?)
            {
                match h.seq.cmp(&seq) {
                    std::cmp::Ordering::Equal => return Ok(off),
                    std::cmp::Ordering::Greater => return Err(None),
                    std::cmp::Ordering::Less => {
                        off += len;
                        continue;
                    }
                }
            }
        }
        off += 1;
    }
    Err(None)
}
