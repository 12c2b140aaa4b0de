//! Streaming validation of one segment file: which byte ranges hold valid frames, which are
//! damaged.
//!
//! Owns: the scan used by recovery, `verify` and `dump`. Does not own: deciding what to do
//! about damage (recovery does). Invariants: memory is bounded by the read window
//! ([`WINDOW_BYTES`] or one maximal frame) plus at most [`MAX_BAD_RANGES`] ranges; every
//! byte of the file ends up in exactly one good run or bad range; the scan always
//! terminates (each step advances at least one byte).
//!
//! A frame at offset `p` is accepted when its header fits, `len <= max_record_bytes`, the
//! frame ends inside the file, `floor < seq < ceiling`, `seq` is greater than the previous
//! accepted seq in this file, and its crc32c matches. After a rejected frame the scan
//! resynchronises: it tries every following byte offset until a frame is accepted (the bytes
//! in between form one bad range) or the file ends (the bad range reaches end of file: a
//! torn or damaged tail). A run holds consecutive seqs; an accepted frame whose seq skips ahead
//! starts a new run.

use std::io;

use crate::frame::{self, FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, SEGMENT_MAGIC};
use crate::fs::SpoolFile;

/// Bytes read from disk at a time while scanning.
pub const WINDOW_BYTES: usize = 1 << 20;
/// At most this many bad ranges are told apart in one file; after that the rest of the file
/// is one bad range.
pub const MAX_BAD_RANGES: usize = 256;

/// A forward-moving read window over a file.
pub(crate) struct Window<'a> {
    file: &'a dyn SpoolFile,
    file_len: u64,
    base: u64,
    buf: Vec<u8>,
    chunk: usize,
}

impl<'a> Window<'a> {
    pub(crate) fn new(file: &'a dyn SpoolFile, file_len: u64, chunk: usize) -> Self {
        Window {
            file,
            file_len,
            base: 0,
            buf: Vec::new(),
            chunk,
        }
    }

    /// Bytes `[off, off+len)`; the caller guarantees `off + len <= file_len`.
    pub(crate) fn get(&mut self, off: u64, len: usize) -> io::Result<&[u8]> {
        let end = off + len as u64;
        if off < self.base || end > self.base + self.buf.len() as u64 {
            let want = (self.file_len - off).min(self.chunk.max(len) as u64) as usize;
            self.buf.resize(want, 0);
            self.file.read_exact_at(&mut self.buf, off)?;
            self.base = off;
        }
        let start = (off - self.base) as usize;
        Ok(&self.buf[start..start + len])
    }
}

/// Limits that decide whether a frame is acceptable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub max_record_bytes: u32,
    /// Accepted seqs are greater than this.
    pub floor: u64,
    /// Accepted seqs are less than this.
    pub ceiling: u64,
}

/// Contiguous valid frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Byte offset of the first frame.
    pub start: u64,
    /// Byte offset just past the last frame.
    pub end: u64,
    /// Seq of the first frame.
    pub first_seq: u64,
    /// Seq of the last frame.
    pub last_seq: u64,
    /// Number of frames.
    pub records: u64,
}

/// Bytes that hold no acceptable frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadRange {
    /// Byte offset where the damage starts.
    pub start: u64,
    /// Byte offset just past it.
    pub end: u64,
}

/// The result of scanning one file.
#[derive(Debug, Clone, Default)]
pub(crate) struct SegmentScan {
    pub file_len: u64,
    pub header_ok: bool,
    pub runs: Vec<Run>,
    /// In file order; the header counts as bad when it is not [`SEGMENT_MAGIC`].
    pub bad: Vec<BadRange>,
}

impl SegmentScan {
    pub(crate) fn records(&self) -> u64 {
        self.runs.iter().map(|r| r.records).sum()
    }
    pub(crate) fn last_seq(&self) -> Option<u64> {
        self.runs.last().map(|r| r.last_seq)
    }
    /// True when the only damage is a bad range that runs to end of file after an intact
    /// header and first run: what an interrupted append leaves.
    pub(crate) fn only_torn_tail(&self) -> bool {
        self.header_ok
            && self.bad.len() == 1
            && self.bad[0].end == self.file_len
            && self.runs.len() <= 1
    }
}

/// Checks the frame at `off`; returns its header when acceptable.
fn accept(
    w: &mut Window<'_>,
    off: u64,
    bounds: &Bounds,
    prev_seq: u64,
) -> io::Result<Option<frame::FrameHeader>> {
    if off + FRAME_HEADER_LEN as u64 > w.file_len {
        return Ok(None);
    }
    let Some(h) = frame::parse_header(w.get(off, FRAME_HEADER_LEN)?) else {
        return Ok(None);
    };
    if h.len > bounds.max_record_bytes
        || h.seq <= bounds.floor
        || h.seq >= bounds.ceiling
        || h.seq <= prev_seq
        || off + h.frame_len() > w.file_len
    {
        return Ok(None);
    }
    let bytes = w.get(off, h.frame_len() as usize)?;
    Ok(frame::check_frame(bytes).then_some(h))
}

/// Scans a whole segment file, calling `on_record(seq, body)` for every accepted frame.
pub(crate) fn scan_segment(
    file: &dyn SpoolFile,
    file_len: u64,
    bounds: Bounds,
    mut on_record: impl FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<SegmentScan> {
    let mut w = Window::new(file, file_len, WINDOW_BYTES);
    let mut scan = SegmentScan {
        file_len,
        ..Default::default()
    };
    if file_len < SEGMENT_HEADER_LEN {
        if file_len > 0 {
            scan.bad.push(BadRange {
                start: 0,
                end: file_len,
            });
        }
        return Ok(scan);
    }
    scan.header_ok = w.get(0, SEGMENT_HEADER_LEN as usize)? == SEGMENT_MAGIC;
    let mut bad_start = (!scan.header_ok).then_some(0u64);
    let mut pos = SEGMENT_HEADER_LEN;
    let mut prev_seq = 0u64;
    let mut run: Option<Run> = None;
    while pos < file_len {
        if scan.bad.len() >= MAX_BAD_RANGES {
            bad_start.get_or_insert(pos);
            pos = file_len;
            break;
        }
        match accept(&mut w, pos, &bounds, prev_seq)? {
            Some(h) => {
                if let Some(start) = bad_start.take() {
                    scan.bad.push(BadRange { start, end: pos });
                }
                let end = pos + h.frame_len();
                let body = &w.get(pos, h.frame_len() as usize)?[FRAME_HEADER_LEN..];
                on_record(h.seq, body)?;
                prev_seq = h.seq;
                match run.as_mut() {
                    Some(r) if r.end == pos && h.seq == r.last_seq + 1 => {
                        r.end = end;
                        r.last_seq = h.seq;
                        r.records += 1;
                    }
                    _ => {
                        if let Some(r) = run.take() {
                            scan.runs.push(r);
                        }
                        run = Some(Run {
                            start: pos,
                            end,
                            first_seq: h.seq,
                            last_seq: h.seq,
                            records: 1,
                        });
                    }
                }
                pos = end;
            }
            None => {
                bad_start.get_or_insert(pos);
                pos += 1;
            }
        }
    }
    if let Some(r) = run.take() {
        scan.runs.push(r);
    }
    if let Some(start) = bad_start {
        scan.bad.push(BadRange {
            start,
            end: file_len.max(pos),
        });
    }
    Ok(scan)
}
