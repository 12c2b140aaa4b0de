//! The live spool's errors ([`SpoolError`]), each saying whether retrying can help, the
//! helper that names the operation and path of an I/O failure, and the classification of
//! the I/O errors that mean "the storage is unavailable for writing" ([`StallReason`]: no
//! space, read-only) rather than "the storage failed".

use std::io;
use std::path::{Path, PathBuf};

/// Errors of the live spool. Each says whether retrying can help.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// The configuration is inconsistent (local, fix the config).
    #[error("invalid spool configuration: {0}")]
    Config(&'static str),
    /// `max_bytes` reached under [`crate::FullPolicy::Block`]: back-pressure and retry after acks
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
    /// [`crate::Spool::begin_commit`] while a job is in flight.
    #[error("a commit is already in flight")]
    CommitInFlight,
    /// [`crate::Spool::finish_commit`] without a job in flight.
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
    /// The spool's file system has no space left or is read-only: appends are refused
    /// (back-pressure) while reading, acknowledging and trimming go on. Retrying helps once
    /// space is freed or the file system is writable again; no reopen is needed (see
    /// [`crate::Spool::stalled`]).
    #[error("spool storage {reason}: not accepting records until {}", reason.remedy())]
    Stalled {
        /// Why.
        reason: StallReason,
    },
}

/// Why a spool stopped accepting records although it works otherwise: its file system
/// refused a write in a way that freeing space or remounting read-write undoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StallReason {
    /// No space left on the device, or a disk quota exhausted (`ENOSPC`, `EDQUOT`).
    NoSpace,
    /// The file system is read-only (`EROFS`): remounted, or by the kernel after an error.
    ReadOnly,
}

impl StallReason {
    /// Short snake_case name (metric labels, status documents): `no_space`, `read_only`.
    pub fn as_str(&self) -> &'static str {
        match self {
            StallReason::NoSpace => "no_space",
            StallReason::ReadOnly => "read_only",
        }
    }

    /// What makes the spool accept again.
    pub fn remedy(&self) -> &'static str {
        match self {
            StallReason::NoSpace => {
                "space is freed on its file system (the cloud's acknowledgements free it too)"
            }
            StallReason::ReadOnly => "its file system is writable again (mount -o remount,rw)",
        }
    }

    /// The stall an I/O error means, if it means one (`None`: a real failure).
    pub fn of(e: &io::Error) -> Option<StallReason> {
        match e.kind() {
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => Some(StallReason::NoSpace),
            io::ErrorKind::ReadOnlyFilesystem => Some(StallReason::ReadOnly),
            _ => None,
        }
    }
}

impl std::fmt::Display for StallReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StallReason::NoSpace => "has no space left",
            StallReason::ReadOnly => "is read-only",
        })
    }
}

impl SpoolError {
    /// The stall this error is (a [`SpoolError::Stalled`], or an I/O error of a stalled
    /// file system), if any.
    pub fn stall_reason(&self) -> Option<StallReason> {
        match self {
            SpoolError::Stalled { reason } => Some(*reason),
            SpoolError::Io { source, .. } => StallReason::of(source),
            _ => None,
        }
    }
}

pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> SpoolError + 'a {
    move |source| SpoolError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}
