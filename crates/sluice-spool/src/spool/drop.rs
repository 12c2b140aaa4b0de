//! `when_full = "drop-oldest"`: removing the oldest sealed segments to make room, and
//! reporting what was dropped even when the append that needed the room then failed.

use super::*;

impl Spool {
    /// Removes the oldest sealed segments until `need` more bytes fit.
    pub(super) fn drop_oldest(&mut self, need: u64) -> Result<Option<Dropped>, SpoolError> {
        let mut dropped: Option<Dropped> = None;
        while self.total_bytes + need > self.cfg.max_bytes && self.segments.len() > 1 {
            let Some(&seg) = self.segments.front() else {
                break;
            };
            let path = segment_path(&self.dir, seg.first);
            if let Err(e) = self.fs.remove(&path) {
                // The segment stays in the index; what was dropped before it is reported
                // later ([`Spool::take_dropped`]).
                self.keep_unreported(dropped);
                return self.stall_or_poison(io_err("remove", &path)(e));
            }
            self.segments.pop_front();
            self.dir_dirty = true;
            self.removals += 1;
            self.total_bytes -= seg.len;
            let before = self.pending.len();
            self.pending.retain(|p| p.seg_first != seg.first);
            if self.pending.len() != before {
                self.pending_bytes = self.pending.iter().map(|p| p.buf.len() as u64).sum();
            }
            if self.read_file.as_ref().map(|r| r.0) == Some(seg.first) {
                self.read_file = None;
            }
            let records = (seg.last + 1).saturating_sub(seg.first);
            self.counters.dropped_oldest_segments += 1;
            self.counters.dropped_oldest_records += records;
            let d = dropped.get_or_insert(Dropped {
                first: SpoolSeq(seg.first),
                last: SpoolSeq(seg.last),
                records: 0,
                segments: 0,
            });
            d.last = SpoolSeq(seg.last);
            d.records += records;
            d.segments += 1;
            if seg.last > self.ack {
                self.ack = seg.last;
            }
            self.durable = self.durable.max(seg.last.min(self.next_seq - 1));
            self.advance_ack();
        }
        Ok(dropped)
    }

    /// Keeps what drop-oldest removed during an append that fails afterwards, for
    /// [`Spool::take_dropped`] (or the next successful append's [`Appended::dropped`]).
    pub(super) fn keep_unreported(&mut self, dropped: Option<Dropped>) {
        self.unreported_drop = merge_dropped(self.unreported_drop.take(), dropped);
    }

    /// What drop-oldest removed during appends that then failed (the rotation's file could
    /// not be created, a removal failed, or the record still did not fit): those records are
    /// gone and counted in [`SpoolCounters::dropped_oldest_records`], but no [`Appended`]
    /// reported them. A caller that counts or releases dropped records takes this after an
    /// append error. A later successful append reports it in [`Appended::dropped`] instead.
    pub fn take_dropped(&mut self) -> Option<Dropped> {
        self.unreported_drop.take()
    }
}

/// Two drop-oldest reports as one (drops only ever remove the oldest records, so the ranges
/// are adjacent or `b` follows `a`).
pub(super) fn merge_dropped(a: Option<Dropped>, b: Option<Dropped>) -> Option<Dropped> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Dropped {
            first: a.first.min(b.first),
            last: a.last.max(b.last),
            records: a.records + b.records,
            segments: a.segments + b.segments,
        }),
        (a, b) => a.or(b),
    }
}
