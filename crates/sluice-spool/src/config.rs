//! What a spool is told when it opens: when a commit fsyncs ([`FsyncPolicy`]), what an
//! append does at the size bound ([`FullPolicy`]), and the [`SpoolConfig`] with its
//! validation. Owns no state; units are in the field names.

use std::time::Duration;

use crate::frame::{self, SEGMENT_HEADER_LEN};
use crate::spool::SpoolError;

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

/// What [`crate::Spool::append`] does when `max_bytes` would be exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullPolicy {
    /// Refuse with [`crate::SpoolError::Full`]: the caller back-pressures devices.
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
