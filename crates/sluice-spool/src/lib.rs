//! sluice's durable spool: one segmented append-only log per shard, with group commit, a
//! persistent cursor of cloud-acknowledged records, a size bound, and crash recovery.
//!
//! Owns: the spool directory of one shard and everything in it; the record framing; when a
//! record counts as durable; when bytes may be deleted. Does not own: what a record means
//! (the body is opaque bytes — the gateway encodes device id, topic, QoS, payload and
//! receive time into it), when to commit (the caller drives the schedule named by
//! [`FsyncPolicy`]), threads or runtimes (see "Threading"), or metrics export (plain
//! [`SpoolCounters`]).
//!
//! Invariants: a record reported durable by a commit survives any crash until it is
//! acknowledged or dropped by drop-oldest (counted); bytes are deleted only for segments
//! wholly at or below a *persisted* ack cursor, for the torn tail of the newest segment,
//! or by drop-oldest; recovery never loops, never refuses to start because of damage, and
//! reports everything it skipped; memory is independent of the spool's size (one summary per
//! segment, a bounded read window, a bounded batch and ack window).
//!
//! # Using it
//! ```text
//! let (mut spool, report) = Spool::open(dir, cfg)?;   // recovery runs here; log `report`
//! let a = spool.append(&encoded_publish)?;            // -> SpoolSeq, cheap, no I/O
//! // every 10 ms (FsyncPolicy::Interval) or after each device batch (Always):
//! if let Some(job) = spool.begin_commit()? {
//!     let outcome = spawn_blocking(move || job.run()).await?;   // write + fsync + cursor
//!     let c = spool.finish_commit(outcome)?;          // PUBACK devices up to c.durable_through
//! }
//! let mut cur = spool.read_cursor();                   // uplink: from the first unacked
//! spool.read(&mut cur, 64, 256 << 10, &mut out)?;      // committed records only, in order
//! // ... or off the spool's thread (a backlog that is not in the page cache):
//! let job = spool.begin_read(cur, 64, 256 << 10)?;
//! let outcome = spawn_blocking(move || job.run()).await?;
//! if let Some(done) = spool.finish_read(outcome) { cur = done.cursor; /* done.records */ }
//! spool.ack(seq)?;                                     // on the cloud's PUBACK, any order
//! ```
//!
//! # Threading
//! A [`Spool`] belongs to one thread (the shard's `current_thread` runtime) and has no async
//! methods. `append`, `ack`, `begin_commit` and `finish_commit` do no blocking I/O except
//! creating a segment file at rotation (or, on a full disk, at the seal described below)
//! and removing one under drop-oldest. The blocking half
//! of a commit is a [`CommitJob`] (`Send`) that the caller runs on `spawn_blocking` or a
//! dedicated writer thread; appends continue meanwhile into the next batch (one job at a
//! time). `read` does positional reads of committed bytes (page cache in the common case);
//! its blocking form is a [`ReadJob`] (`Send`, from `begin_read`, on a snapshot of the
//! segment index) whose outcome `finish_read` takes back, or discards (`None`: read again)
//! when a segment was removed while it ran.
//! After any failed write or fsync the spool is poisoned and must be reopened: after a failed
//! fsync the page cache cannot be trusted, so only recovery from disk can say what is durable.
//!
//! # Full or read-only storage
//! A write refused with `ENOSPC`, `EDQUOT` or `EROFS` does not poison the spool (a failed
//! fsync still does, whatever its errno). The commit job undoes the batch (cuts each file back;
//! if that fails, it is a failure after all), the batch goes back into memory, and the spool is
//! *stalled* ([`Spool::stalled`], [`StallReason`]): appends are refused with
//! [`SpoolError::Stalled`]; reads, acks, cursor writes and trims go on. A full disk also
//! releases the space reserve (`DIR/space.reserve`, [`RESERVE_BYTES`]) so that the cursor can
//! be written and acknowledged segments deleted, and seals the active segment at its committed
//! end so those acks can free it. Every commit of a stalled spool writes the reserve anew
//! first and the batch only if that worked; the first that gets through ends the stall. The
//! caller keeps committing a stalled spool (e.g. every second) even when nothing happened.
//!
//! # On-disk format
//! A spool directory `DIR` holds:
//! - `DIR/{first_seq:020}.seg` — segment files, named by the seq of their first record
//!   (20 decimal digits, so names sort in seq order). Seqs start at 1 and are consecutive
//!   within a segment. A segment is sealed when the next frame would take it past
//!   [`SpoolConfig::segment_bytes`]; every open starts a new segment.
//! - `DIR/ack.cursor` — the persisted ack cursor (below).
//! - `DIR/quarantine/{segment_first_seq:020}.{offset:012}.corrupt` — damaged bytes moved
//!   aside by recovery, never read again by the spool; the operator inspects and deletes
//!   them. Not counted against `max_bytes`.
//! - `DIR/space.reserve` — [`RESERVE_BYTES`] of zeros holding blocks for bookkeeping on a full
//!   disk (see "Full or read-only storage"); absent while the disk is full. Not a segment, not
//!   counted against `max_bytes`.
//! - `*.tmp` — files being written atomically; recovery removes leftovers.
//!
//! Segment file (all integers little-endian):
//! ```text
//! offset  size  field
//! 0       8     magic b"SLSPOOL" + format version 0x01
//! 8       ...   frames, back to back
//!
//! frame:
//! 0       4     crc32c (Castagnoli) of bytes 4 .. 16+len
//! 4       4     len: u32, body length
//! 8       8     seq: u64
//! 16      len   body (opaque)
//! ```
//! A frame is valid when its checksum matches, `len <= max_record_bytes` and it lies within
//! the file. Files only ever grow by appends, except that recovery truncates them.
//!
//! Cursor file `ack.cursor`, 20 bytes: `0..8` magic `b"SLSPACK\x01"`, `8..16` cursor (u64:
//! every seq at or below it is acknowledged), `16..20` crc32c of bytes `0..16`. Replaced
//! atomically: write `ack.cursor.tmp`, fsync, rename over `ack.cursor`, fsync `DIR`.
//!
//! # Durability
//! A commit job appends the batch to the segment files, fsyncs each file written (per
//! [`FsyncPolicy`]; `Never` fsyncs nothing), fsyncs `DIR` if a segment was created, then
//! writes the cursor if it moved, then removes sealed segments wholly at or below that
//! cursor. Only after the job succeeds are its records durable and visible to readers.
//!
//! Ack cursor and duplicates: `ack(seq)` marks a record acknowledged; the in-memory cursor
//! advances over the contiguous prefix of acknowledged seqs (seqs that no longer exist
//! count as acknowledged); it is persisted by the next commit. After a crash the spool
//! resumes at the persisted cursor, so the records that can be delivered twice are exactly
//! those with `persisted cursor < seq` that were acknowledged before the crash — the
//! out-of-order acks above the in-memory cursor and the acks since the last commit. Records
//! at or below the persisted cursor never come back.
//!
//! # Size bound
//! [`SpoolConfig::max_bytes`] bounds all segment files (headers and frames, committed or
//! not). When an append would pass it, [`FullPolicy::Block`] refuses it with
//! [`SpoolError::Full`] (the shard back-pressures devices until acks are committed and
//! segments trimmed); [`FullPolicy::DropOldest`] removes the oldest segments, acknowledged or
//! not, counts them ([`SpoolCounters::dropped_oldest_records`]) and reports them in
//! [`Appended::dropped`] (or, when the append then failed, in [`Spool::take_dropped`]); the
//! ack cursor moves past them. Right after an open the files may hold one segment header more
//! than the bound (every open starts a segment); appends bring it back within.
//!
//! # Recovery
//! [`Spool::open`] runs one forward pass over the segment files in name order. Each file is
//! scanned streaming (1 MiB window); a frame at offset `p` is accepted when valid, its seq is
//! above the previous segment's last seq and below the next segment's name, and above the
//! previous frame's seq. After a rejected frame the scan resynchronises at every following
//! byte until a frame is accepted or the file ends. Then, per file:
//! 1. Intact (header ok, one run of consecutive seqs from the name's seq): kept and fsynced
//!    (a previous process may have written it without fsync). Intact but
//!    without records: removed.
//! 2. Torn tail — the newest segment, header ok, intact up to some point and nothing valid
//!    after it: truncated there (an interrupted append; those records were never reported
//!    durable). Reported in [`RecoveryReport::torn_tails`].
//! 3. Anything else (a bad header, damage followed by valid frames, damage at the end of an
//!    older segment, a name that does not match its first seq): every bad range is copied to
//!    `DIR/quarantine/`; every intact run after the first becomes its own segment file named
//!    by its first seq (written as `.tmp`, fsynced, renamed); then the original is cut to its
//!    first intact run, or removed if that run moved too. Reported in
//!    [`RecoveryReport::quarantined`] with file, offset, byte count and the seq range that
//!    may be missing. Records after the damage stay readable.
//!
//! A file too short to hold a record (at most the 8-byte header: a segment created at rotation
//! or at a start whose header was never written) is removed before any of this, and a segment
//! followed only by such files counts as the newest (so a full disk never needs a quarantine
//! copy to start).
//!
//! Every step is idempotent, so a crash during recovery is recovered by the next start. Then:
//! a missing or damaged cursor makes the spool re-deliver everything present (reported); the
//! cursor is raised to just below the oldest record present (with no record present: to just
//! below the newest segment file's name, written before the empty files are removed, so a seq
//! that was ever read is never assigned again); segments wholly at or below it are removed;
//! appends resume at `max(newest seq, cursor) + 1` in a new segment. Only an
//! I/O error from the file system stops `open` — damage never does.
//!
//! # Testing seams
//! All file access goes through [`SpoolFs`]; [`fault::FaultFs`] is an in-memory
//! implementation that injects I/O errors and simulates crashes (torn unsynced tails, lost
//! unsynced directory changes) for the model-based tests.
//!
//! # Read order
//! Readers go oldest first ([`ReadCursor::at`]) or newest first ([`ReadCursor::newest_first`],
//! the gateway's `drain_order = "newest-first"`): a direction in the cursor and a bounded
//! per-segment checkpoint table, no format change.
#![forbid(unsafe_code)]

mod commit;
mod config;
mod cursor;
mod error;
pub mod fault;
mod frame;
mod fs;
mod inspect;
mod read;
mod recovery;
mod reserve;
mod scan;
mod spool;

pub use commit::{CommitJob, CommitOutcome};
pub use cursor::{CursorError, CURSOR_FILE};
pub use frame::{FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, SEGMENT_MAGIC};
pub use fs::{parse_segment_name, segment_path, RealFs, SpoolFile, SpoolFs};
pub use inspect::{
    dump, dump_with_fs, stat, stat_with_fs, verify, verify_with_fs, InspectError, SpoolStat,
    VerifyReport,
};
pub use read::{ReadDone, ReadJob, ReadOutcome};
pub use recovery::{CursorRecovery, RecoveryReport, SeqGap, SkippedRange, QUARANTINE_DIR};
pub use reserve::{RESERVE_BYTES, RESERVE_FILE};
pub use scan::{BadRange, Run};
pub use spool::{
    Appended, Committed, Dropped, FsyncPolicy, FullPolicy, ReadCursor, Spool, SpoolConfig,
    SpoolCounters, SpoolError, SpoolRecord, SpoolSeq, StallReason,
};
