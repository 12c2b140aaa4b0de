//! The blocking half of a group commit ([`CommitJob`]): write each segment's share of the batch,
//! fsync per policy (each segment file once, and the directory when a segment was created),
//! persist the ack cursor, remove trimmed segments. It runs off the caller's thread; its
//! [`CommitOutcome`] goes back to `Spool::finish_commit`, which alone changes the spool's state.
//! Owns no state of its own; the buffers travel back to be reused.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cursor;
use crate::error::{io_err, SpoolError};
use crate::fs::{SpoolFile, SpoolFs};

/// One segment's share of a commit: the bytes to append to its file.
pub(crate) struct Pending {
    pub(crate) seg_first: u64,
    pub(crate) path: PathBuf,
    pub(crate) file: Arc<dyn SpoolFile>,
    pub(crate) buf: Vec<u8>,
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
}

/// What a [`CommitJob`] did; hand it to [`crate::Spool::finish_commit`].
pub struct CommitOutcome {
    pub(crate) result: Result<(Duration, u64), SpoolError>,
    pub(crate) buffers: Vec<Vec<u8>>,
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
