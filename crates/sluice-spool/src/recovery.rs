//! Start-up recovery: turns whatever is in the spool directory into a consistent set of
//! segments, repairing what a crash or the medium damaged, and reports what it skipped.
//!
//! Owns: the recovery rules documented in the crate docs ("Recovery"). Does not own: the live
//! spool state (see `spool`). Invariants: recovery never loops (one forward pass over the
//! segments in seq order, each scan terminates), never refuses to start because of damage
//! (only an I/O error from the file system stops it), never deletes a byte that could hold an
//! unacknowledged committed record except a torn tail of the newest segment, and is
//! idempotent: a crash during recovery leaves a directory that the next recovery handles.
//! Memory: one scan window plus a summary per segment.

use std::io;
use std::path::{Path, PathBuf};

use crate::cursor::{self, CursorError};
use crate::error::StallReason;
use crate::frame::{SEGMENT_HEADER_LEN, SEGMENT_MAGIC};
use crate::fs::{parse_segment_name, segment_path, SpoolFile, SpoolFs};
use crate::reserve;
use crate::scan::{self, BadRange, Bounds, Run, SegmentScan};

/// Name of the quarantine directory inside the spool directory.
pub const QUARANTINE_DIR: &str = "quarantine";
/// At most this many skipped ranges are listed individually in a report.
pub const MAX_REPORTED_RANGES: usize = 64;

/// Seqs that may be missing because of a skipped byte range: `first..=last`, where `last`
/// is `None` when the range reaches the end of the log (nothing after it bounds it).
/// `first > last` means the damage removed no seq (e.g. garbage between two intact records).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqGap {
    /// First seq that may be missing.
    pub first: u64,
    /// Last seq that may be missing, if bounded.
    pub last: Option<u64>,
}

/// A byte range recovery skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRange {
    /// Segment file it came from.
    pub file: PathBuf,
    /// Byte offset in that file.
    pub offset: u64,
    /// Length in bytes.
    pub bytes: u64,
    /// Seqs that may have been lost with it.
    pub seqs: SeqGap,
    /// Where the bytes were moved (`None`: torn tail, truncated).
    pub moved_to: Option<PathBuf>,
}

/// What happened to the ack cursor file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CursorRecovery {
    /// Read and valid.
    #[default]
    Valid,
    /// No cursor file: everything present is delivered again.
    Missing,
    /// Damaged (reason given): everything present is delivered again.
    Damaged(String),
}

/// What recovery found and did. Bounded: at most [`MAX_REPORTED_RANGES`] ranges are listed,
/// the totals count all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segment files scanned.
    pub segments_scanned: usize,
    /// Bytes scanned.
    pub bytes_scanned: u64,
    /// Records found intact (including already-acknowledged ones).
    pub records_found: u64,
    /// Torn tails truncated from the newest segment (an interrupted append).
    pub torn_tails: Vec<SkippedRange>,
    /// Damaged ranges moved to `DIR/quarantine/`.
    pub quarantined: Vec<SkippedRange>,
    /// Total number of skipped ranges (torn and quarantined), including unlisted ones.
    pub skipped_ranges: u64,
    /// Total bytes skipped.
    pub skipped_bytes: u64,
    /// Segments that held no record and were removed.
    pub removed_empty: usize,
    /// Fully acknowledged segments removed.
    pub trimmed: usize,
    /// Leftover temporary files removed.
    pub removed_temp: usize,
    /// The ack cursor file's state.
    pub cursor: CursorRecovery,
}

impl RecoveryReport {
    /// True when recovery skipped nothing (a clean start).
    pub fn is_clean(&self) -> bool {
        self.skipped_ranges == 0 && !matches!(self.cursor, CursorRecovery::Damaged(_))
    }

    fn skip(&mut self, range: SkippedRange) {
        self.skipped_ranges += 1;
        self.skipped_bytes += range.bytes;
        if self.torn_tails.len() + self.quarantined.len() >= MAX_REPORTED_RANGES {
            return;
        }
        if range.moved_to.is_some() {
            self.quarantined.push(range);
        } else {
            self.torn_tails.push(range);
        }
    }
}

/// One recovered segment: its name equals its first seq and its seqs are consecutive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegMeta {
    pub first: u64,
    pub last: u64,
    pub len: u64,
}

pub(crate) struct Recovered {
    pub segments: Vec<SegMeta>,
    pub ack_cursor: u64,
    /// The cursor file's value, if valid (`ack_cursor` may be above it).
    pub stored_cursor: Option<u64>,
    /// Segment files without a record that could not be removed yet `(name, len)`: no record
    /// is present and the cursor raised above their names could not be written first (a full
    /// or read-only file system). Seqs resume above their names.
    pub leftovers: Vec<(u64, u64)>,
    pub report: RecoveryReport,
}

/// Segment files as `(first_seq, len)`, in seq order.
pub(crate) type SegmentList = Vec<(u64, u64)>;

/// Lists segment files in seq order, plus the other file names.
pub(crate) fn list_segments(
    fs: &dyn SpoolFs,
    dir: &Path,
) -> io::Result<(SegmentList, Vec<String>)> {
    let mut segs = Vec::new();
    let mut other = Vec::new();
    for (name, len) in fs.list(dir)? {
        match parse_segment_name(&name) {
            Some(seq) => segs.push((seq, len)),
            None => other.push(name),
        }
    }
    segs.sort_unstable();
    Ok((segs, other))
}

/// Scans every segment read-only, in order, with the bounds recovery would use.
/// `visit(name, path, scan)` sees each result; `on_record` sees every intact record.
pub(crate) fn scan_all(
    fs: &dyn SpoolFs,
    dir: &Path,
    max_record_bytes: u32,
    mut on_record: impl FnMut(u64, &[u8]) -> io::Result<()>,
    mut visit: impl FnMut(u64, &Path, &SegmentScan, u64, u64, bool),
) -> io::Result<()> {
    let (segs, _) = list_segments(fs, dir)?;
    let mut floor = 0u64;
    for (i, &(name, len)) in segs.iter().enumerate() {
        let ceiling = segs.get(i + 1).map_or(u64::MAX, |s| s.0);
        let path = segment_path(dir, name);
        let file = fs.open_read(&path)?;
        let bounds = Bounds {
            max_record_bytes,
            floor,
            ceiling,
        };
        let scan = scan::scan_segment(&*file, len, bounds, &mut on_record)?;
        visit(name, &path, &scan, floor, ceiling, i + 1 == segs.len());
        if let Some(last) = scan.last_seq() {
            floor = last;
        }
    }
    Ok(())
}

/// The seqs a bad range may have held, given the runs around it.
pub(crate) fn gap_for(bad: &BadRange, runs: &[Run], floor: u64, ceiling: u64) -> SeqGap {
    let before = runs
        .iter()
        .filter(|r| r.end <= bad.start)
        .map(|r| r.last_seq)
        .max()
        .unwrap_or(floor);
    let after = runs
        .iter()
        .filter(|r| r.start >= bad.end)
        .map(|r| r.first_seq)
        .min();
    let last = match after {
        Some(s) => Some(s - 1),
        None if ceiling == u64::MAX => None,
        None => Some(ceiling - 1),
    };
    SeqGap {
        first: before + 1,
        last,
    }
}

/// Copies `[start, end)` of `src` into a new durable file at `dst` (via a temp file),
/// optionally prefixed by the segment header. Streams with a bounded buffer.
fn copy_out(
    fs: &dyn SpoolFs,
    src: &dyn SpoolFile,
    start: u64,
    end: u64,
    dst: &Path,
    with_header: bool,
) -> io::Result<()> {
    let tmp = dst.with_extension("tmp");
    let out = fs.create(&tmp, false)?;
    if with_header {
        out.append(&SEGMENT_MAGIC)?;
    }
    let mut buf = vec![0u8; scan::WINDOW_BYTES.min((end - start) as usize)];
    let mut pos = start;
    while pos < end {
        let n = ((end - pos) as usize).min(buf.len());
        src.read_exact_at(&mut buf[..n], pos)?;
        out.append(&buf[..n])?;
        pos += n as u64;
    }
    out.sync()?;
    fs.rename(&tmp, dst)
}

pub(crate) fn recover(
    fs: &dyn SpoolFs,
    dir: &Path,
    max_record_bytes: u32,
) -> io::Result<Recovered> {
    fs.create_dir_all(dir)?;
    let mut report = RecoveryReport::default();
    let (segs, other) = list_segments(fs, dir)?;
    for name in other.iter().filter(|n| n.ends_with(".tmp")) {
        match fs.remove(&dir.join(name)) {
            Ok(()) => report.removed_temp += 1,
            // A read-only file system: a leftover temporary file is harmless (every writer
            // of one empties it first); the next start removes it.
            Err(e) if e.kind() == io::ErrorKind::ReadOnlyFilesystem => {}
            Err(e) => return Err(e),
        }
    }
    let mut stored_cursor = match cursor::read(fs, dir) {
        Ok(Some(c)) => Some(c),
        Ok(None) => {
            report.cursor = CursorRecovery::Missing;
            None
        }
        Err(e @ CursorError::Damaged { .. }) => {
            report.cursor = CursorRecovery::Damaged(e.to_string());
            None
        }
        Err(CursorError::Io { source, .. }) => return Err(source),
    };

    let qdir = dir.join(QUARANTINE_DIR);
    let mut metas: Vec<SegMeta> = Vec::new();
    let mut floor = 0u64;
    // Segment files without records `(name, len)`, removed once the cursor is settled (their
    // names count).
    let mut empties: Vec<(u64, u64)> = Vec::new();
    for (i, &(name, len)) in segs.iter().enumerate() {
        let ceiling = segs.get(i + 1).map_or(u64::MAX, |s| s.0);
        // The newest segment that can hold a record: every later file is too short for one
        // (a segment created at rotation or at a start whose header was never written, e.g.
        // because the disk was full). Its damaged tail is an interrupted append.
        let is_last = segs[i + 1..]
            .iter()
            .all(|&(_, len)| len <= SEGMENT_HEADER_LEN);
        let path = segment_path(dir, name);
        if len <= SEGMENT_HEADER_LEN {
            // No record fits: nothing to keep or quarantine (and nothing to write, which
            // matters on a full disk). Removed with the other empty files, once the cursor
            // is settled: its name may be the only trace of how far seqs went.
            empties.push((name, len));
            report.segments_scanned += 1;
            report.bytes_scanned += len;
            continue;
        }
        let file = fs.open(&path)?;
        let bounds = Bounds {
            max_record_bytes,
            floor,
            ceiling,
        };
        let scan = scan::scan_segment(&*file, len, bounds, |_, _| Ok(()))?;
        report.segments_scanned += 1;
        report.bytes_scanned += len;
        report.records_found += scan.records();
        let first_in_place = |s: &SegmentScan| {
            s.header_ok
                && match s.runs.first() {
                    Some(r) => r.start == SEGMENT_HEADER_LEN && r.first_seq == name,
                    None => true,
                }
        };

        if scan.bad.is_empty() && scan.runs.len() <= 1 && first_in_place(&scan) {
            // Intact (or header-only).
            match scan.runs.first() {
                Some(r) => {
                    // Bytes a previous process wrote but never fsynced are readable now;
                    // make them durable before anyone treats them as committed.
                    file.sync()?;
                    metas.push(SegMeta {
                        first: r.first_seq,
                        last: r.last_seq,
                        len,
                    });
                }
                None => empties.push((name, len)),
            }
        } else if is_last && scan.only_torn_tail() && first_in_place(&scan) {
            // An interrupted append: cut the tail.
            let bad = scan.bad[0];
            let keep = scan.runs.first().map_or(SEGMENT_HEADER_LEN, |r| r.end);
            report.skip(SkippedRange {
                file: path.clone(),
                offset: bad.start,
                bytes: bad.end - bad.start,
                seqs: gap_for(&bad, &scan.runs, floor, ceiling),
                moved_to: None,
            });
            match scan.runs.first() {
                Some(r) => {
                    file.truncate(keep)?;
                    file.sync()?;
                    metas.push(SegMeta {
                        first: r.first_seq,
                        last: r.last_seq,
                        len: keep,
                    });
                }
                None => empties.push((name, len)),
            }
        } else {
            // Damage: quarantine every bad range, give every later intact run its own
            // segment file, then cut the original down to its first intact run.
            fs.create_dir_all(&qdir)?;
            for bad in &scan.bad {
                let moved_to = qdir.join(format!("{name:020}.{:012}.corrupt", bad.start));
                copy_out(fs, &*file, bad.start, bad.end, &moved_to, false)?;
                report.skip(SkippedRange {
                    file: path.clone(),
                    offset: bad.start,
                    bytes: bad.end - bad.start,
                    seqs: gap_for(bad, &scan.runs, floor, ceiling),
                    moved_to: Some(moved_to),
                });
            }
            fs.sync_dir(&qdir)?;
            let keep_first = first_in_place(&scan) && !scan.runs.is_empty();
            let mut replaced = false;
            for (j, run) in scan.runs.iter().enumerate() {
                if j > 0 || !keep_first {
                    copy_out(
                        fs,
                        &*file,
                        run.start,
                        run.end,
                        &segment_path(dir, run.first_seq),
                        true,
                    )?;
                    replaced |= run.first_seq == name;
                }
                let len = run.end - run.start + SEGMENT_HEADER_LEN;
                metas.push(SegMeta {
                    first: run.first_seq,
                    last: run.last_seq,
                    len,
                });
            }
            fs.sync_dir(dir)?;
            if keep_first {
                file.truncate(scan.runs[0].end)?;
                file.sync()?;
            } else if scan.runs.is_empty() {
                empties.push((name, len));
            } else if !replaced {
                fs.remove(&path)?;
            }
        }
        if let Some(last) = scan.last_seq() {
            floor = last;
        }
    }

    // The ack cursor: a missing or damaged one re-delivers everything present.
    let oldest = metas.first().map(|m| m.first);
    let mut cursor_settled = true;
    let mut ack_cursor = match (stored_cursor, oldest) {
        (Some(c), _) => c,
        (None, Some(first)) => first - 1,
        (None, None) => 0,
    };
    // Seqs below the oldest present record are gone: count them as acknowledged. With no
    // record present, so are the seqs below every segment file's name (empty files included):
    // drop-oldest may have removed durable records before a cursor covering them was
    // written, and their seqs must not be assigned again.
    match oldest {
        Some(first) => ack_cursor = ack_cursor.max(first - 1),
        None => {
            let named = segs.iter().map(|&(name, _)| name).max().unwrap_or(1);
            ack_cursor = ack_cursor.max(named.saturating_sub(1));
            // Durable before the names that tell it go.
            if ack_cursor > stored_cursor.unwrap_or(0) {
                match write_cursor(fs, dir, ack_cursor) {
                    Ok(()) => stored_cursor = Some(ack_cursor),
                    // A full or read-only file system: the empty files stay (their names
                    // still tell), and the spool's first commit persists the raised cursor.
                    Err(e) if StallReason::of(&e).is_some() => cursor_settled = false,
                    Err(e) => return Err(e),
                }
            }
        }
    }
    // Empty files that cannot go yet stay on disk, outside the index (the next recovery
    // removes them); the spool assigns seqs above their names and counts their bytes. Only
    // when no record is present: with records, leftovers and the new active segment could
    // take the spool past its bound, so a removal the file system refuses fails recovery (the
    // gateway reopens until it can write).
    // A run copied out under an empty file's name (a damaged segment whose records start
    // below its own name) replaced that file: it is a segment of the index now, not an empty
    // file to remove (found by the `spool_recovery` fuzz target: the removal deleted the
    // records just recovered and left the index naming a missing file).
    empties.retain(|&(name, _)| !metas.iter().any(|m| m.first == name));
    let mut leftovers = Vec::new();
    for (name, len) in empties {
        if cursor_settled {
            fs.remove(&segment_path(dir, name))?;
            report.removed_empty += 1;
        } else {
            leftovers.push((name, len));
        }
    }
    // Fully acknowledged segments are removed (on a read-only file system they stay, below
    // the cursor, and the spool removes them once it can write).
    let trim = metas.iter().take_while(|m| m.last <= ack_cursor).count();
    let mut trimmed = 0;
    for m in &metas[..trim] {
        match fs.remove(&segment_path(dir, m.first)) {
            Ok(()) => trimmed += 1,
            Err(e) if e.kind() == io::ErrorKind::ReadOnlyFilesystem => break,
            Err(e) => return Err(e),
        }
    }
    metas.drain(..trimmed);
    report.trimmed += trimmed;
    // Always: a previous process may have created or removed files without syncing.
    fs.sync_dir(dir)?;
    Ok(Recovered {
        segments: metas,
        ack_cursor,
        stored_cursor,
        leftovers,
        report,
    })
}

/// Writes the raised cursor; on a full disk, once more after releasing the space reserve
/// (its blocks are there for this write).
fn write_cursor(fs: &dyn SpoolFs, dir: &Path, ack: u64) -> io::Result<()> {
    match cursor::write(fs, dir, ack, true) {
        Err(e) if StallReason::of(&e) == Some(StallReason::NoSpace) => {
            reserve::release(fs, dir)?;
            cursor::write(fs, dir, ack, true)
        }
        r => r,
    }
}
