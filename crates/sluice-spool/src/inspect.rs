//! Read-only operator views of a spool directory, for `sluice spool stat|verify|dump DIR`.
//!
//! Owns: [`stat`], [`verify`], [`dump`]. Does not own: repair (recovery does that when the
//! spool opens). Invariant: nothing here creates, modifies or removes a file — files are
//! opened read-only — so these are safe to run beside a live gateway (they then see a
//! moment's state, possibly with a torn tail that is still being written).

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::cursor::{self, CursorError};
use crate::fs::{RealFs, SpoolFs};
use crate::recovery::{self, CursorRecovery, SkippedRange, MAX_REPORTED_RANGES, QUARANTINE_DIR};

/// Errors of the operator views.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// The spool directory could not be read.
    #[error("reading spool directory {path}: {source}")]
    Read {
        /// Directory.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// Writing the dump failed.
    #[error("writing dump output: {0}")]
    Write(io::Error),
}

/// Sizes and positions of a spool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpoolStat {
    /// Segment files.
    pub segments: usize,
    /// Their total size.
    pub segment_bytes: u64,
    /// The persisted ack cursor, when valid.
    pub ack_cursor: Option<u64>,
    /// State of the cursor file.
    pub cursor: CursorRecovery,
    /// Oldest seq (from the oldest segment's name).
    pub oldest_seq: Option<u64>,
    /// Newest intact seq (scans the newest non-empty segment).
    pub newest_seq: Option<u64>,
    /// Files in `DIR/quarantine/` and their total size.
    pub quarantine_files: usize,
    /// Bytes in quarantine.
    pub quarantine_bytes: u64,
}

/// What [`verify`] found: the same checks recovery makes, without acting on them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Segment files scanned.
    pub segments: usize,
    /// Bytes scanned.
    pub bytes: u64,
    /// Intact records.
    pub records: u64,
    /// Damaged byte ranges (at most [`MAX_REPORTED_RANGES`] listed; `moved_to` is `None`).
    pub damaged: Vec<SkippedRange>,
    /// Damaged ranges in total.
    pub damaged_ranges: u64,
    /// Damaged bytes in total.
    pub damaged_bytes: u64,
    /// State of the cursor file.
    pub cursor: CursorRecovery,
}

impl VerifyReport {
    /// True when nothing is damaged.
    pub fn is_clean(&self) -> bool {
        self.damaged_ranges == 0 && !matches!(self.cursor, CursorRecovery::Damaged(_))
    }
}

fn read_err(dir: &Path) -> impl FnOnce(io::Error) -> InspectError + '_ {
    move |source| InspectError::Read {
        path: dir.to_owned(),
        source,
    }
}

fn cursor_state(
    fs: &dyn SpoolFs,
    dir: &Path,
) -> Result<(Option<u64>, CursorRecovery), InspectError> {
    match cursor::read(fs, dir) {
        Ok(Some(c)) => Ok((Some(c), CursorRecovery::Valid)),
        Ok(None) => Ok((None, CursorRecovery::Missing)),
        Err(e @ CursorError::Damaged { .. }) => Ok((None, CursorRecovery::Damaged(e.to_string()))),
        Err(CursorError::Io { path, source }) => Err(InspectError::Read { path, source }),
    }
}

/// Sizes, segment count, ack cursor, oldest and newest seq of the spool in `dir`.
pub fn stat(dir: impl AsRef<Path>, max_record_bytes: u32) -> Result<SpoolStat, InspectError> {
    stat_with_fs(&RealFs, dir.as_ref(), max_record_bytes)
}

/// [`stat`] on any [`SpoolFs`].
pub fn stat_with_fs(
    fs: &dyn SpoolFs,
    dir: &Path,
    max_record_bytes: u32,
) -> Result<SpoolStat, InspectError> {
    let (segs, _) = recovery::list_segments(fs, dir).map_err(read_err(dir))?;
    let (ack_cursor, cursor) = cursor_state(fs, dir)?;
    let mut st = SpoolStat {
        segments: segs.len(),
        segment_bytes: segs.iter().map(|s| s.1).sum(),
        ack_cursor,
        cursor,
        oldest_seq: segs.first().map(|s| s.0),
        ..Default::default()
    };
    // Newest: scan segments from the newest back until one holds a record.
    for (i, &(name, len)) in segs.iter().enumerate().rev() {
        let ceiling = segs.get(i + 1).map_or(u64::MAX, |s| s.0);
        let file = fs
            .open_read(&crate::fs::segment_path(dir, name))
            .map_err(read_err(dir))?;
        let bounds = crate::scan::Bounds {
            max_record_bytes,
            floor: name.saturating_sub(1),
            ceiling,
        };
        let scan =
            crate::scan::scan_segment(&*file, len, bounds, |_, _| Ok(())).map_err(read_err(dir))?;
        if let Some(last) = scan.last_seq() {
            st.newest_seq = Some(last);
            break;
        }
    }
    let qdir = dir.join(QUARANTINE_DIR);
    if let Ok(q) = fs.list(&qdir) {
        st.quarantine_files = q.len();
        st.quarantine_bytes = q.iter().map(|e| e.1).sum();
    }
    Ok(st)
}

/// Checks every frame of the spool in `dir` and lists damaged ranges, without repairing.
pub fn verify(dir: impl AsRef<Path>, max_record_bytes: u32) -> Result<VerifyReport, InspectError> {
    verify_with_fs(&RealFs, dir.as_ref(), max_record_bytes)
}

/// [`verify`] on any [`SpoolFs`].
pub fn verify_with_fs(
    fs: &dyn SpoolFs,
    dir: &Path,
    max_record_bytes: u32,
) -> Result<VerifyReport, InspectError> {
    let (_, cursor) = cursor_state(fs, dir)?;
    let mut rep = VerifyReport {
        cursor,
        ..Default::default()
    };
    recovery::scan_all(
        fs,
        dir,
        max_record_bytes,
        |_, _| Ok(()),
        |_, path, scan, floor, ceiling, _| {
            rep.segments += 1;
            rep.bytes += scan.file_len;
            rep.records += scan.records();
            for bad in &scan.bad {
                rep.damaged_ranges += 1;
                rep.damaged_bytes += bad.end - bad.start;
                if rep.damaged.len() < MAX_REPORTED_RANGES {
                    rep.damaged.push(SkippedRange {
                        file: path.to_owned(),
                        offset: bad.start,
                        bytes: bad.end - bad.start,
                        seqs: recovery::gap_for(bad, &scan.runs, floor, ceiling),
                        moved_to: None,
                    });
                }
            }
        },
    )
    .map_err(read_err(dir))?;
    Ok(rep)
}

/// Writes every intact record of the spool in `dir` to `out`, one per line:
/// `SEQ LEN BODY` with the body ASCII-escaped, after a first line `# ack cursor: N`.
/// Damaged ranges are skipped silently here; [`verify`] lists them.
pub fn dump(
    dir: impl AsRef<Path>,
    max_record_bytes: u32,
    out: impl Write,
) -> Result<(), InspectError> {
    dump_with_fs(&RealFs, dir.as_ref(), max_record_bytes, out)
}

/// [`dump`] on any [`SpoolFs`].
pub fn dump_with_fs(
    fs: &dyn SpoolFs,
    dir: &Path,
    max_record_bytes: u32,
    mut out: impl Write,
) -> Result<(), InspectError> {
    let (ack, _) = cursor_state(fs, dir)?;
    let ack = ack.map_or_else(|| "none".to_owned(), |c| c.to_string());
    writeln!(out, "# ack cursor: {ack}").map_err(InspectError::Write)?;
    let mut write_err = None;
    let result = recovery::scan_all(
        fs,
        dir,
        max_record_bytes,
        |seq, body| match writeln!(out, "{seq} {} {}", body.len(), body.escape_ascii()) {
            Ok(()) => Ok(()),
            Err(e) => {
                write_err = Some(e);
                Err(io::Error::other("dump output failed"))
            }
        },
        |_, _, _, _, _, _| {},
    );
    if let Some(e) = write_err {
        return Err(InspectError::Write(e));
    }
    result.map_err(read_err(dir))?;
    out.flush().map_err(InspectError::Write)
}
