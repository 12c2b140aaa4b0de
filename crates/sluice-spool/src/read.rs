//! Reading committed records: the blocking half of a read ([`ReadJob`], run off the caller's
//! thread) and the [`Reader`] that both [`crate::Spool::read`] and a job use — oldest first or newest
//! first, over the segment index as it was when the read began, with the reader's caches (the
//! open segment file, the reverse index of the newest-first walk) moving in and back out.
//!
//! Owns: locating a seq in a segment (offset scan with a checked frame), the forward and
//! newest-first walks, and their bounds (records and bytes per read). Does not own: appending,
//! committing, acknowledging or removing segments (`spool.rs`), or the frame format (`frame`).
//! A read never writes: it reports damage (`CorruptRecord`) and the caller decides.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::error::{io_err, SpoolError};
use crate::frame::{self, FRAME_HEADER_LEN, SEGMENT_HEADER_LEN};
use crate::fs::{segment_path, SpoolFile, SpoolFs};
use crate::scan::Window;
use crate::spool::{RevIndex, Segment, SpoolSeq, READ_CHUNK};

/// A record read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolRecord {
    /// Its seq.
    pub seq: SpoolSeq,
    /// Its body, exactly as appended.
    pub body: Bytes,
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
    pub(crate) next: u64,
    pub(crate) hint: Option<(u64, u64)>,
    pub(crate) newest_first: bool,
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

/// The blocking half of a read (see [`crate::Spool::begin_read`]). `Send`: run it on another thread.
pub struct ReadJob {
    pub(crate) fs: Arc<dyn SpoolFs>,
    pub(crate) dir: PathBuf,
    pub(crate) segments: VecDeque<Segment>,
    pub(crate) active_first: u64,
    pub(crate) active_file: Arc<dyn SpoolFile>,
    pub(crate) durable: u64,
    pub(crate) ack: u64,
    pub(crate) read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    pub(crate) rev_index: Option<RevIndex>,
    pub(crate) removals: u64,
    pub(crate) cursor: ReadCursor,
    pub(crate) max_records: usize,
    pub(crate) max_bytes: usize,
}

/// What a [`ReadJob`] did; hand it to [`crate::Spool::finish_read`].
pub struct ReadOutcome {
    pub(crate) start: ReadCursor,
    pub(crate) done: ReadDone,
    pub(crate) read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    pub(crate) rev_index: Option<RevIndex>,
    pub(crate) removals: u64,
}

/// A finished read, as [`crate::Spool::read`] reports it.
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

/// Reads committed records: the spool's segment index and files, borrowed by [`crate::Spool::read`]
/// or owned by a [`ReadJob`], and the reader's caches (open segment file, reverse index),
/// which move in and back out.
pub(crate) struct Reader<'a> {
    pub(crate) fs: &'a dyn SpoolFs,
    pub(crate) dir: &'a Path,
    pub(crate) segments: &'a VecDeque<Segment>,
    pub(crate) active_first: u64,
    pub(crate) active_file: &'a Arc<dyn SpoolFile>,
    pub(crate) durable: u64,
    pub(crate) ack: u64,
    pub(crate) read_file: Option<(u64, Arc<dyn SpoolFile>)>,
    pub(crate) rev_index: Option<RevIndex>,
}

impl Reader<'_> {
    /// The first existing seq at or after `s`.
    fn next_existing(&self, s: u64) -> Option<u64> {
        let i = self.segments.partition_point(|seg| seg.last < s);
        self.segments.get(i).map(|seg| seg.first.max(s))
    }

    pub(crate) fn read(
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
