//! The blocking half of a group commit ([`CommitJob`]): write each segment's share of the batch,
//! fsync per policy (each segment file once, and the directory when a segment was created),
//! persist the ack cursor, remove trimmed segments. It runs off the caller's thread; its
//! [`CommitOutcome`] goes back to `Spool::finish_commit`, which alone changes the spool's state.
//! Owns no state of its own; the buffers travel back to be reused (or, after a stall, to be
//! written again).
//!
//! A full or read-only file system ([`StallReason`]) is not a failure: a write refused with
//! `ENOSPC`/`EDQUOT`/`EROFS` is undone (each file written is cut back to its length before the
//! job, which needs no space), the space reserve is released (see `reserve`), and the job goes
//! on with the ack cursor and the trims, which free space. The outcome says what was done; the
//! batch goes back to the spool and is written by a later job. Only when the undo itself fails
//! (a read-only file system that kept part of a write) is the error a failure that poisons
//! the spool. A job of a stalled spool first writes the reserve anew and writes the batch only
//! if that worked (so the batch never eats the reserve's room).
//!
//! Order of a job: [reserve renewal, when stalled] → segment writes → fsyncs → directory fsync
//! → ack cursor → removals. The cursor only ever covers durable records, so it may be written
//! whether or not this job's batch was.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cursor;
use crate::error::{io_err, SpoolError, StallReason};
use crate::fs::{SpoolFile, SpoolFs};
use crate::reserve;

/// One segment's share of a commit: the bytes to append to its file.
pub(crate) struct Pending {
    pub(crate) seg_first: u64,
    pub(crate) path: PathBuf,
    pub(crate) file: Arc<dyn SpoolFile>,
    pub(crate) buf: Vec<u8>,
    /// The file's length before this batch (set when a job takes it): an undo cuts back to it.
    pub(crate) pre_len: u64,
}

/// The blocking half of a commit. `Send`: run it on another thread.
pub struct CommitJob {
    pub(crate) fs: Arc<dyn SpoolFs>,
    pub(crate) dir: PathBuf,
    pub(crate) writes: Vec<Pending>,
    pub(crate) sync: bool,
    pub(crate) sync_dir: bool,
    pub(crate) cursor: Option<u64>,
    pub(crate) removes: Vec<PathBuf>,
    /// The spool is stalled: write the reserve anew first, and the batch only if that worked.
    pub(crate) probe: bool,
}

/// What a [`CommitJob`] did; hand it to [`crate::Spool::finish_commit`].
pub struct CommitOutcome {
    pub(crate) result: Result<Done, SpoolError>,
    pub(crate) writes: Vec<Pending>,
}

/// What a job that did not fail did.
pub(crate) struct Done {
    pub(crate) fsync_time: Duration,
    pub(crate) fsyncs: u64,
    /// The batch is written and durable (false: undone or not tried; it goes back).
    pub(crate) data_written: bool,
    pub(crate) cursor_written: bool,
    /// How many of the removals were done (a prefix).
    pub(crate) removed: usize,
    /// The storage refused a write for want of space or writability (the first such).
    pub(crate) stall: Option<StallReason>,
    /// How many writes the storage refused so.
    pub(crate) refusals: u64,
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
            probe,
        } = self;
        let mut done = Done {
            fsync_time: Duration::ZERO,
            fsyncs: 0,
            data_written: false,
            cursor_written: false,
            removed: 0,
            stall: None,
            refusals: 0,
        };
        let refused = |done: &mut Done, r: StallReason| {
            done.refusals += 1;
            done.stall.get_or_insert(r);
            if r == StallReason::NoSpace {
                // Its blocks are for the cursor and the trims below (and a restart).
                let _ = reserve::release(&*fs, &dir);
            }
        };
        let result = (|| {
            let mut try_data = true;
            if probe {
                if let Err(e) = reserve::renew(&*fs, &dir, sync) {
                    match StallReason::of(&e) {
                        Some(r) => {
                            refused(&mut done, r);
                            try_data = false;
                        }
                        None => return Err(io_err("write space reserve in", &dir)(e)),
                    }
                }
            }
            if try_data {
                match write_batch(&writes) {
                    Ok(()) => {
                        let t = Instant::now();
                        if sync {
                            let mut last: Option<u64> = None;
                            for w in &writes {
                                if last != Some(w.seg_first) {
                                    w.file.sync().map_err(io_err("fsync", &w.path))?;
                                    done.fsyncs += 1;
                                    last = Some(w.seg_first);
                                }
                            }
                        }
                        if sync && sync_dir {
                            fs.sync_dir(&dir).map_err(io_err("fsync directory", &dir))?;
                        }
                        done.fsync_time = t.elapsed();
                        done.data_written = true;
                    }
                    Err((i, e)) => match StallReason::of(&e) {
                        Some(r) if undo(&writes[..=i]) => refused(&mut done, r),
                        _ => return Err(io_err("write", &writes[i].path)(e)),
                    },
                }
            }
            if let Some(c) = cursor {
                match cursor::write(&*fs, &dir, c, sync) {
                    Ok(()) => done.cursor_written = true,
                    Err(e) => match StallReason::of(&e) {
                        Some(r) => refused(&mut done, r),
                        None => return Err(io_err("write ack cursor in", &dir)(e)),
                    },
                }
            }
            // Removals need the cursor they rely on to be durable.
            if cursor.is_none() || done.cursor_written {
                for path in &removes {
                    match fs.remove(path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => match StallReason::of(&e) {
                            Some(r) => {
                                refused(&mut done, r);
                                break;
                            }
                            None => return Err(io_err("remove", path)(e)),
                        },
                    }
                    done.removed += 1;
                }
            }
            Ok(())
        })();
        CommitOutcome {
            result: result.map(|()| done),
            writes,
        }
    }
}

/// Appends every share; on an error, which share failed.
fn write_batch(writes: &[Pending]) -> Result<(), (usize, io::Error)> {
    for (i, w) in writes.iter().enumerate() {
        w.file.append(&w.buf).map_err(|e| (i, e))?;
    }
    Ok(())
}

/// Cuts every file written back to its length before the job (a refused append may have
/// written part of its buffer). Needs no space; fails on a read-only file system only if
/// something was written. True when every file is back at its old length.
fn undo(written: &[Pending]) -> bool {
    written.iter().all(|w| match w.file.size() {
        Ok(n) if n == w.pre_len => true,
        Ok(_) => w.file.truncate(w.pre_len).is_ok() && w.file.size().ok() == Some(w.pre_len),
        Err(_) => false,
    })
}
