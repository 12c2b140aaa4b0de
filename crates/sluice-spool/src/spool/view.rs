//! Reading a [`Spool`]: read cursors, inline reads and read jobs for the blocking pool, and
//! the accessors for its state (seqs, cursors, sizes, counters, poisoned or stalled).

use super::*;

impl Spool {
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
    /// Change the size bound while open (a reload that adds a spooled uplink lowers every
    /// spool's share). Never below two segments (as [`SpoolConfig::validate`] requires);
    /// returns the bound now in force. A spool already holding more keeps what it holds: under
    /// `Block` appends are refused until acknowledgements bring it under; under `DropOldest`
    /// the next append drops the oldest sealed segments first. Nothing held is removed here.
    pub fn set_max_bytes(&mut self, max_bytes: u64) -> u64 {
        self.cfg.max_bytes = max_bytes.max(2 * self.cfg.segment_bytes);
        self.cfg.max_bytes
    }
    /// True after a failed write or fsync: reopen.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }
    /// `Some` while the storage is full or read-only: appends are refused with
    /// [`SpoolError::Stalled`], everything else works; each commit probes the storage and the
    /// first that gets through ends the stall. No reopen is needed.
    pub fn stalled(&self) -> Option<StallReason> {
        self.stalled
    }
}
