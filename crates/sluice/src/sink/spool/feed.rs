//! The feeder of one [`UplinkSpool`]: committed records into the uplink queue, in a live
//! and a backlog stream, while the uplink is connected.
//!
//! Owns: [`UplinkSpool::link_changed`] (a connect turns everything not yet handed over into
//! a backlog range), the feeder task (`feed_loop`, `fill`), the reads on the blocking pool
//! (`read_off_shard`: one at a time per spool; a read whose stream changed while it was out
//! is discarded), the backlog ranges (oldest-first or newest-first, at most
//! `MAX_BACKLOG_RANGES`), skipping damaged or undecodable records (counted), and building
//! each outbox item: an [`UplinkMessage`] with its [`Stored`] location and, under
//! `ack = "cloud"`, its device's token. Does not own: commits or acks (`commit.rs`), the
//! queue's streams and bounds (`sink::outbox::queue`).
//!
//! Invariants: each stream's read-ahead stays within its share of the queue (the queue's
//! `stream_room`); records of a stream reach the queue in stream order; under
//! `ack = "cloud"` a record whose device had another message abandoned is not sent (the
//! device resends it after the lost one) and is acknowledged here instead.

use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};

use bytestring::ByteString;
use sluice_spool::{ReadCursor, Spool, SpoolError, SpoolRecord, SpoolSeq};
use tokio::sync::watch;
use tracing::{debug, error, warn};

use super::{
    record, shutdown_signal, Inner, Stored, UplinkSpool, MAX_BACKLOG_RANGES, READ_BATCH, READ_BYTES,
};
use crate::config::{DrainOrder, SpoolAck};
use crate::message::ack::AckToken;
use crate::sink::UplinkMessage;

impl UplinkSpool {
    pub fn link_changed(&self, up: bool) {
        if up {
            let mut inner = self.inner.borrow_mut();
            let inner = &mut *inner;
            if let Some(spool) = &inner.spool {
                let next = spool.next_seq().0;
                let from = inner.live.next_seq().0;
                if next > from {
                    if self.drain_order == DrainOrder::NewestFirst {
                        // The cursor works down the newest range: cut that range to what it has
                        // not read yet and keep it apart, so the new (newer) range goes first
                        // and the rest of the old one resumes after it.
                        if let (Some(cur), Some(back)) =
                            (inner.backlog_cur.take(), inner.backlog.back_mut())
                        {
                            back.1 = back.1.min(cur.next_seq().0.saturating_add(1));
                            if back.1 <= back.0 {
                                inner.backlog.pop_back();
                            }
                        }
                        inner.backlog.push_back((from, next));
                        if inner.backlog.len() > MAX_BACKLOG_RANGES {
                            // Merge the oldest two (not being read): the live records between
                            // them are sent again (duplicates).
                            if let (Some(a), Some(b)) =
                                (inner.backlog.pop_front(), inner.backlog.pop_front())
                            {
                                inner.backlog.push_front((a.0, b.1));
                            }
                        }
                    } else {
                        push_range(&mut inner.backlog, from, next);
                    }
                    inner.live = ReadCursor::at(SpoolSeq(next));
                }
            }
        }
        self.link_up.set(up);
        self.feed.notify_one();
    }

    /// The feeder task: fills the uplink queue, then waits until queue bytes are released
    /// or something new is committed (or the link changes).
    pub(super) async fn feed_loop(self: Rc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let space = self.queue.space_released();
            tokio::pin!(space);
            space.as_mut().enable();
            // Dropping a fill mid-read is safe: a read's result is applied only after it
            // returns, and the blocking job's outcome is then dropped.
            tokio::select! {
                _ = self.fill() => {}
                _ = shutdown_signal(&mut shutdown) => break,
            }
            tokio::select! {
                _ = &mut space => {}
                _ = self.feed.notified() => {}
                _ = shutdown_signal(&mut shutdown) => break,
            }
        }
    }

    /// Moves committed records into the uplink queue while each stream has room. Each read
    /// runs on the blocking pool ([`UplinkSpool::read_off_shard`]); the shard keeps serving
    /// its devices meanwhile, and a read whose stream changed while it was out is discarded.
    pub(super) async fn fill(self: &Rc<Self>) {
        if !self.link_up.get() {
            // What piles up now becomes backlog when the link comes back: report it as such.
            let inner = self.inner.borrow();
            if let Some(spool) = &inner.spool {
                let pending = spool.next_seq().0.saturating_sub(inner.live.next_seq().0);
                let newest_first = self.drain_order == DrainOrder::NewestFirst;
                let backlog = backlog_remaining(&inner, newest_first) + pending;
                self.metrics.backlog_records.set(backlog as i64);
            }
            return;
        }
        // Refill a stream only once a good part of its read-ahead is free (or it ran dry):
        // every read costs a chunk of up to `READ_BYTES`, so topping up one message per
        // cloud ack would copy far more than it sends.
        let min_refill = (self.queue.capacity_bytes() / 8).clamp(1, READ_BYTES);
        let room_for = |backlog: bool| {
            let room = self.queue.stream_room(backlog).min(READ_BYTES);
            if room < min_refill && self.queue.stream_waiting(backlog) > 0 {
                0
            } else {
                room
            }
        };
        let mut batch: Vec<(SpoolRecord, bool)> = Vec::new();
        // Live first.
        loop {
            let room = room_for(false);
            if room == 0 || !self.link_up.get() {
                break;
            }
            let cur = {
                let inner = self.inner.borrow();
                let Some(spool) = inner.spool.as_ref() else {
                    return;
                };
                if inner.live.next_seq() > spool.durable_seq() {
                    break; // nothing committed to read
                }
                inner.live
            };
            let done = match self
                .read_off_shard(cur, records_for(room), room, |inner| inner.live == cur)
                .await
            {
                Fetched::Stop => return,
                Fetched::Stale => continue,
                Fetched::Done(done) => done,
            };
            let mut guard = self.inner.borrow_mut();
            let inner = &mut *guard;
            let Some(spool) = inner.spool.as_mut() else {
                return;
            };
            inner.live = done.cursor;
            match done.result {
                Ok(0) => break,
                Ok(_) => {
                    batch.extend(done.records.into_iter().map(|r| (r, false)));
                    self.push_all(spool, &mut inner.cloud_tokens, &mut batch);
                }
                Err(e) if needs_reopen(&e) => return self.feed_after_reopen(&e),
                Err(e) => {
                    // The cursor is on the damaged record (see `Spool::read`).
                    let skip = inner.live.next_seq().0;
                    warn!(shard = self.shard, uplink = %self.uplink, error = %e, seq = skip, "spool record unreadable; skipped");
                    self.skip_record(spool, &mut inner.cloud_tokens, skip);
                    inner.live = ReadCursor::at(SpoolSeq(skip + 1));
                }
            }
        }
        // Then the backlog.
        let newest_first = self.drain_order == DrainOrder::NewestFirst;
        loop {
            let room = room_for(true);
            if room == 0 || !self.link_up.get() {
                break;
            }
            let (range, cur, want) = {
                let mut guard = self.inner.borrow_mut();
                let inner = &mut *guard;
                let Some(spool) = inner.spool.as_ref() else {
                    return;
                };
                let Some((start, end)) = current_range(&inner.backlog, newest_first) else {
                    break;
                };
                let durable = spool.durable_seq().0;
                let cur = *inner.backlog_cur.get_or_insert_with(|| {
                    if newest_first {
                        ReadCursor::newest_first(SpoolSeq(end - 1))
                    } else {
                        ReadCursor::at(SpoolSeq(start))
                    }
                });
                let next = cur.next_seq().0;
                let done = if newest_first {
                    next < start || next == 0
                } else {
                    next >= end
                };
                if done {
                    finish_range(&mut inner.backlog, &mut inner.backlog_cur, newest_first);
                    continue;
                }
                if next > durable {
                    // Appended before the reconnect but not committed yet: after the commit.
                    break;
                }
                let want = if newest_first {
                    records_for(room)
                } else {
                    records_for(room).min((end - next) as usize)
                };
                ((start, end), cur, want)
            };
            let (start, end) = range;
            let done = match self
                .read_off_shard(cur, want, room, |inner| {
                    inner.backlog_cur == Some(cur)
                        && current_range(&inner.backlog, newest_first) == Some(range)
                })
                .await
            {
                Fetched::Stop => return,
                Fetched::Stale => continue,
                Fetched::Done(done) => done,
            };
            let mut guard = self.inner.borrow_mut();
            let inner = &mut *guard;
            let Some(spool) = inner.spool.as_mut() else {
                return;
            };
            inner.backlog_cur = Some(done.cursor);
            match done.result {
                Ok(0) => {
                    finish_range(&mut inner.backlog, &mut inner.backlog_cur, newest_first);
                }
                Ok(_) => {
                    let mut past = false;
                    for r in done.records {
                        if r.seq.0 < start || r.seq.0 >= end {
                            past = true;
                            continue;
                        }
                        batch.push((r, true));
                    }
                    self.push_all(spool, &mut inner.cloud_tokens, &mut batch);
                    if past {
                        finish_range(&mut inner.backlog, &mut inner.backlog_cur, newest_first);
                    }
                }
                Err(e) if needs_reopen(&e) => return self.feed_after_reopen(&e),
                Err(e) => {
                    // The read stopped with the cursor on the damaged record (the
                    // records before it came back in an earlier read): skip just it.
                    let bad = done.cursor.next_seq().0;
                    warn!(shard = self.shard, uplink = %self.uplink, error = %e, seq = bad, "spool record unreadable; skipped");
                    self.skip_record(spool, &mut inner.cloud_tokens, bad);
                    inner.backlog_cur = Some(if newest_first {
                        ReadCursor::newest_first(SpoolSeq(bad.saturating_sub(1)))
                    } else {
                        ReadCursor::at(SpoolSeq(bad + 1))
                    });
                }
            }
        }
        let inner = self.inner.borrow();
        let backlog = backlog_remaining(&inner, newest_first);
        self.metrics.backlog_records.set(backlog as i64);
    }

    /// Reads from `cur` on the blocking pool (a backlog after an outage is usually not in
    /// the page cache, and the shard thread must not wait for the disk). The result counts
    /// only if, when it comes back, the spool was not reopened, the link is still up and
    /// `still_current` (the stream's cursor and range are what the read started from);
    /// otherwise it is [`Fetched::Stale`] and the caller reads again from the current state.
    async fn read_off_shard(
        &self,
        cur: ReadCursor,
        max_records: usize,
        max_bytes: usize,
        still_current: impl Fn(&Inner) -> bool,
    ) -> Fetched {
        let reopens = self.reopens.get();
        let job = {
            let mut inner = self.inner.borrow_mut();
            let Some(spool) = inner.spool.as_mut() else {
                return Fetched::Stop;
            };
            match spool.begin_read(cur, max_records, max_bytes) {
                Ok(job) => job,
                Err(e) => {
                    return Fetched::Done(sluice_spool::ReadDone {
                        cursor: cur,
                        records: Vec::new(),
                        result: Err(e),
                    })
                }
            }
        };
        self.metrics.reads.inc();
        let outcome = match tokio::task::spawn_blocking(move || job.run()).await {
            Ok(o) => o,
            Err(error) => {
                // Only a panic in the read (a bug) gets here; reading again would repeat it.
                error!(shard = self.shard, uplink = %self.uplink, %error, "spool read task failed; feeding stops until the spool is reopened");
                self.dirty.notify_one();
                return Fetched::Stop;
            }
        };
        if self.reopens.get() != reopens || !self.link_up.get() {
            return Fetched::Stale;
        }
        let mut inner = self.inner.borrow_mut();
        if !still_current(&inner) {
            return Fetched::Stale;
        }
        let Some(spool) = inner.spool.as_mut() else {
            return Fetched::Stop;
        };
        match spool.finish_read(outcome) {
            Some(done) => Fetched::Done(done),
            None => Fetched::Stale,
        }
    }

    /// Record `seq` cannot be sent (damaged or undecodable): count it and acknowledge it in
    /// the spool so it is not tried again. With `ack = "cloud"` its device still holds the
    /// message unacknowledged: dropping the device's token uncompleted closes that device's
    /// connection (abandoned, see `message::ack`), and the device resends the message.
    fn skip_record(&self, spool: &mut Spool, cloud_tokens: &mut BTreeMap<u64, AckToken>, seq: u64) {
        self.metrics.undecodable.inc();
        let _ = spool.ack(SpoolSeq(seq));
        drop(cloud_tokens.remove(&seq));
        // A commit persists the moved cursor (and refreshes the gauges).
        self.dirty.notify_one();
    }

    /// A read failed because the storage did (not one record): stop feeding and make sure
    /// the commit task runs, which reopens the spool (`fail`) and wakes the feeder after.
    fn feed_after_reopen(&self, e: &SpoolError) {
        debug!(shard = self.shard, uplink = %self.uplink, error = %e, "spool read failed; feeding waits for the reopen");
        self.dirty.notify_one();
    }

    /// Decodes records and hands them to the uplink queue (the `inner` borrow is held: the
    /// queue never calls back into the spool).
    fn push_all(
        self: &Rc<Self>,
        spool: &mut Spool,
        cloud_tokens: &mut BTreeMap<u64, AckToken>,
        batch: &mut Vec<(SpoolRecord, bool)>,
    ) {
        let now = Instant::now();
        let wall = SystemTime::now();
        for (r, backlog) in batch.drain(..) {
            let rec = match record::decode(&r.body) {
                Ok(rec) => rec,
                Err(e) => {
                    warn!(shard = self.shard, uplink = %self.uplink, seq = r.seq.0, error = %e, "spool record body undecodable; skipped");
                    self.skip_record(spool, cloud_tokens, r.seq.0);
                    continue;
                }
            };
            let device = match self.ack_mode {
                SpoolAck::Cloud => cloud_tokens.remove(&r.seq.0),
                SpoolAck::Spool => None,
            };
            // `ack = "cloud"` and an earlier message of this device was lost (e.g. a damaged
            // record): its connection is closed and the device resends this one after the
            // lost one. Sending the stored copy now would overtake the resend.
            if device.as_ref().is_some_and(AckToken::device_abandoned) {
                debug!(shard = self.shard, uplink = %self.uplink, seq = r.seq.0, "spool record of an abandoned device connection not sent; the device resends it");
                let _ = spool.ack(r.seq);
                // A commit persists the moved cursor (found by tests/delivery_model.rs).
                self.dirty.notify_one();
                continue;
            }
            let age = wall.duration_since(rec.received).unwrap_or(Duration::ZERO);
            // Copies: a slice would pin the whole read chunk (up to `READ_BYTES`) for as long
            // as the message waits for the cloud, so memory would exceed the queue's bound.
            let msg = UplinkMessage {
                device: ByteString::from(&*rec.device),
                topic: ByteString::from(&*rec.topic),
                payload: bytes::Bytes::copy_from_slice(&rec.payload),
                qos: rec.qos,
                retain: rec.retain,
                received_at: now.checked_sub(age).unwrap_or(now),
                ack: device,
                content_type: None,
                user_properties: None,
                stored: Some(Stored {
                    spool: self.clone(),
                    seq: r.seq.0,
                    backlog,
                }),
            };
            if backlog {
                self.queue.push_backlog(msg);
            } else {
                self.queue.push_live_now(msg);
            }
        }
    }
}

/// What came of a read run on the blocking pool.
enum Fetched {
    /// No spool (a reopen runs), or the read task failed: stop feeding for now.
    Stop,
    /// The stream, the spool's segments or the link changed while the read was out: read
    /// again from the current state.
    Stale,
    Done(sluice_spool::ReadDone),
}

/// The backlog range being drained: the oldest for oldest-first, the newest otherwise.
fn current_range(backlog: &VecDeque<(u64, u64)>, newest_first: bool) -> Option<(u64, u64)> {
    if newest_first {
        backlog.back().copied()
    } else {
        backlog.front().copied()
    }
}

/// How many records to read for `room` bytes of queue: each costs at least
/// `MESSAGE_OVERHEAD_BYTES` there, whatever its body's size.
fn records_for(room: usize) -> usize {
    (room / crate::sink::MESSAGE_OVERHEAD_BYTES).clamp(1, READ_BATCH)
}

/// Adds `[start, end)` to the backlog, merging with the newest range when adjacent.
fn push_range(backlog: &mut VecDeque<(u64, u64)>, start: u64, end: u64) {
    if let Some(last) = backlog.back_mut() {
        if last.1 == start {
            last.1 = end;
            return;
        }
    }
    backlog.push_back((start, end));
    if backlog.len() > MAX_BACKLOG_RANGES {
        // Merge the newest two: the live records between them are sent again (duplicates).
        if let (Some(b), Some(a)) = (backlog.pop_back(), backlog.pop_back()) {
            backlog.push_back((a.0, b.1));
        }
    }
}

fn finish_range(
    backlog: &mut VecDeque<(u64, u64)>,
    cur: &mut Option<ReadCursor>,
    newest_first: bool,
) {
    if newest_first {
        backlog.pop_back();
    } else {
        backlog.pop_front();
    }
    *cur = None;
}

/// Whether a read error means the storage failed (the spool is poisoned and must be
/// reopened) rather than one record being bad.
fn needs_reopen(e: &SpoolError) -> bool {
    matches!(e, SpoolError::Poisoned | SpoolError::Io { .. })
}

fn backlog_remaining(inner: &Inner, newest_first: bool) -> u64 {
    let mut total: u64 = inner.backlog.iter().map(|(s, e)| e - s).sum();
    if let (Some(cur), Some(&(s, e))) = (
        inner.backlog_cur.as_ref(),
        if newest_first {
            inner.backlog.back()
        } else {
            inner.backlog.front()
        },
    ) {
        let n = cur.next_seq().0;
        let done = if newest_first {
            e.saturating_sub(n.saturating_add(1).max(s))
        } else {
            n.saturating_sub(s).min(e - s)
        };
        total = total.saturating_sub(done);
    }
    total
}
