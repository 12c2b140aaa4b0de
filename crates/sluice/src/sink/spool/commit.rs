//! Appends and group commits of one [`UplinkSpool`], reopening after a failure, and the
//! cloud's acknowledgements applied to the engine.
//!
//! Owns: [`UplinkSpool::append`] (the `when_full` policy: waits under `block` for QoS ≥ 1,
//! drops QoS 0, counted; `drop-oldest` releases devices waiting for the dropped records),
//! the commit task (`commit_loop`: group commit on the blocking pool, `fsync` policy,
//! ack-only commits at most every `ACK_COMMIT_PERIOD`, one last commit at shutdown), device
//! acknowledgements under `ack = "spool"` once their record is durable, the reopen after a
//! failed commit (`fail`), and applying cloud acks to the engine's ack window with the rest
//! kept in [`AckRanges`](super::AckRanges). Does not own: reading records for the uplink
//! (`feed.rs`), or when a message is finished (the uplink, through
//! [`Stored::acknowledge`](super::Stored::acknowledge)).
//!
//! A full or read-only file system is not a failure (see `sluice_spool`'s stalled state):
//! the engine keeps the refused batch, so the devices waiting for it keep waiting (PUBACK
//! withheld, connections kept); new appends wait like under `when_full = "block"` (QoS 0 is
//! dropped, counted); the feeder and the cloud's acks go on; the commit task commits every
//! `STALL_RETRY` (each commit persists acks, trims, and probes the storage) until the engine
//! accepts again. Entering, lasting and leaving the stall are logged (`observe_stall`: WARN
//! at most every `STALL_WARN_EVERY`, INFO when it ends) and exported as metrics and status.
//!
//! Invariants: a device token waiting for a commit is completed only after the commit that
//! holds its record (a failed commit drops it uncompleted, so its device resends); no
//! `inner` borrow is held across an await; an ack that finds `inner` borrowed is deferred,
//! never lost.

use std::rc::Rc;
use std::time::{Duration, Instant};

use sluice_proto::mqtt::QoS;
use sluice_spool::{Dropped, Spool, SpoolError, SpoolSeq, StallReason};
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use super::metrics::{STALL_NONE, STALL_NO_SPACE, STALL_READ_ONLY};
use super::open::{log_recovery, update_gauges};
use super::{
    record, shutdown_signal, AckRanges, Appended, Inner, UplinkSpool, ACK_COMMIT_PERIOD,
    REOPEN_PAUSE, STALL_RETRY, STALL_WARN_EVERY,
};
use crate::config::SpoolAck;
use crate::message::ack::AckToken;

impl UplinkSpool {
    /// Appends one encoded record (`body`, see [`record`](super::record)). `ack` is this
    /// uplink's share of the device's token (QoS 1/2). Waits while the spool is full under
    /// `block` (QoS ≥ 1) or while a failed spool is being reopened.
    pub async fn append(&self, body: &[u8], qos: QoS, ack: Option<AckToken>) -> Appended {
        let mut counted_full = false;
        let mut counted_stalled = false;
        loop {
            if self.removed.get() {
                // Its uplink was removed by a reload (ADR 0013): nothing more is stored.
                if let Some(t) = ack {
                    self.queue.finish_removed_token(t);
                }
                return Appended::NotStored;
            }
            let committed = self.committed.notified();
            tokio::pin!(committed);
            committed.as_mut().enable();
            let (result, unreported) = {
                let mut inner = self.inner.borrow_mut();
                match inner.spool.as_mut() {
                    // An append that failed after drop-oldest removed records reports the
                    // drop apart (found by tests/model.rs in sluice-spool).
                    Some(spool) => (spool.append(body), spool.take_dropped()),
                    None => (Err(SpoolError::Poisoned), None),
                }
            };
            if let Some(d) = unreported {
                self.on_dropped(d);
            }
            match result {
                Ok(a) => {
                    self.metrics.records_appended.inc();
                    if let Some(us) = record::received_micros(body) {
                        self.inner.borrow_mut().age.appended(a.seq.0, us);
                    }
                    if let Some(d) = a.dropped {
                        self.on_dropped(d);
                    }
                    if let Some(token) = ack {
                        let mut inner = self.inner.borrow_mut();
                        match self.ack_mode {
                            SpoolAck::Spool => inner.commit_waiters.push_back((a.seq.0, token)),
                            SpoolAck::Cloud => {
                                inner.cloud_tokens.insert(a.seq.0, token);
                            }
                        }
                    }
                    self.dirty.notify_one();
                    return Appended::Stored;
                }
                Err(SpoolError::RecordTooLarge { len, max }) => {
                    debug!(shard = self.shard, uplink = %self.uplink, len, max, "message larger than the largest spool record; dropped");
                    self.metrics.dropped_too_large.inc();
                    if let Some(t) = ack {
                        t.complete();
                    }
                    return Appended::DroppedTooLarge;
                }
                Err(SpoolError::BatchFull { .. }) => {
                    // The open batch is at its bound while a commit runs: wait for it.
                    self.dirty.notify_one();
                    committed.await;
                }
                Err(SpoolError::Stalled { .. }) => {
                    if !counted_stalled {
                        self.metrics.stalled_waits.inc();
                        counted_stalled = true;
                    }
                    if let Some(spool) = self.inner.borrow().spool.as_ref() {
                        self.observe_stall(spool);
                    }
                    if qos == QoS::AtMostOnce {
                        self.metrics.dropped_stalled.inc();
                        return Appended::DroppedStalled;
                    }
                    // The commit task probes the storage every `STALL_RETRY` and wakes us.
                    self.dirty.notify_one();
                    committed.await;
                }
                Err(SpoolError::Full { .. }) => {
                    if !counted_full {
                        self.metrics.full_waits.inc();
                        counted_full = true;
                    }
                    if qos == QoS::AtMostOnce {
                        self.metrics.dropped_full.inc();
                        return Appended::DroppedFull;
                    }
                    // Make sure a commit (which persists acks and trims) comes.
                    self.dirty.notify_one();
                    committed.await;
                }
                Err(e) => {
                    debug!(shard = self.shard, uplink = %self.uplink, error = %e, "spool unavailable; append waits for the reopen");
                    self.dirty.notify_one();
                    committed.await;
                    // The failure abandoned earlier messages of this device: dropping this
                    // one's token unacknowledged keeps the device's resend in order.
                    if ack.as_ref().is_some_and(AckToken::device_abandoned) {
                        return Appended::NotStored;
                    }
                }
            }
        }
    }

    fn on_dropped(&self, d: Dropped) {
        self.metrics.dropped_oldest.add(d.records);
        let dropped: Vec<AckToken> = {
            let mut inner = self.inner.borrow_mut();
            let keep = inner.cloud_tokens.split_off(&(d.last.0 + 1));
            let gone = std::mem::replace(&mut inner.cloud_tokens, keep);
            gone.into_values().collect()
        };
        // The drop is the configured policy: devices waiting for these records are released.
        for t in dropped {
            t.complete();
        }
        debug!(shard = self.shard, uplink = %self.uplink, first = d.first.0, last = d.last.0, records = d.records, "spool full: oldest records dropped");
    }

    /// The commit task: commits whenever something was appended or acknowledged (at most
    /// every `fsync_interval` under `interval`, ack-only commits at most every
    /// `ACK_COMMIT_PERIOD`), and once more at shutdown.
    pub(super) async fn commit_loop(self: Rc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut last_commit = Instant::now();
        loop {
            // A stalled spool commits every `STALL_RETRY` whether or not anything happened:
            // each commit probes whether the storage takes writes again.
            let stalled = self.is_stalled();
            let stop = tokio::select! {
                _ = self.dirty.notified() => false,
                _ = tokio::time::sleep_until((last_commit + STALL_RETRY).into()), if stalled => false,
                _ = shutdown_signal(&mut shutdown) => true,
            };
            if !stop {
                let only_acks = self
                    .inner
                    .borrow()
                    .spool
                    .as_ref()
                    .is_some_and(|s| s.uncommitted_bytes() == 0);
                let period = match (self.fsync.interval(), only_acks) {
                    _ if self.is_stalled() => Some(STALL_RETRY),
                    (Some(d), _) => Some(d),
                    (None, true) => Some(ACK_COMMIT_PERIOD),
                    (None, false) => None,
                };
                if let Some(p) = period {
                    tokio::select! {
                        _ = tokio::time::sleep_until((last_commit + p).into()) => {}
                        _ = shutdown_signal(&mut shutdown) => {}
                    }
                }
            }
            last_commit = Instant::now();
            self.commit_once().await;
            if stop || *shutdown.borrow() {
                // One last commit for what the final one may have missed, then stop.
                self.commit_once().await;
                break;
            }
        }
    }

    /// Runs one commit (if there is anything to commit); reopens the spool after a failure.
    pub(super) async fn commit_once(&self) {
        let job = {
            let mut inner = self.inner.borrow_mut();
            match inner.spool.as_mut().map(Spool::begin_commit) {
                None => return,
                Some(Ok(None)) => return,
                Some(Ok(Some(job))) => Ok(job),
                Some(Err(e)) => Err(e),
            }
        };
        let started = Instant::now();
        let outcome = match job {
            Ok(job) => tokio::task::spawn_blocking(move || job.run()).await.ok(),
            Err(e) => {
                self.fail(&e.to_string()).await;
                return;
            }
        };
        let result = {
            let mut inner = self.inner.borrow_mut();
            match (outcome, inner.spool.as_mut()) {
                (Some(o), Some(spool)) => spool.finish_commit(o).map_err(|e| e.to_string()),
                _ => Err("the commit job did not finish".to_string()),
            }
        };
        match result {
            Ok(c) => {
                self.metrics.commits.inc();
                self.metrics.commit_latency.observe(started.elapsed());
                let ready: Vec<AckToken> = {
                    let mut inner = self.inner.borrow_mut();
                    let mut v = Vec::new();
                    while inner
                        .commit_waiters
                        .front()
                        .is_some_and(|(s, _)| *s <= c.durable_through.0)
                    {
                        if let Some((_, t)) = inner.commit_waiters.pop_front() {
                            v.push(t);
                        }
                    }
                    let inner = &mut *inner;
                    if let Some(spool) = &inner.spool {
                        self.observe_stall(spool);
                        update_gauges(spool, &self.metrics);
                        let oldest = inner
                            .age
                            .oldest_unacked(spool.ack_cursor().0, spool.next_seq().0);
                        self.metrics
                            .oldest_unacked_received_us
                            .set(oldest.map_or(0, |us| i64::try_from(us).unwrap_or(i64::MAX)));
                        if self.former.get() && spool.ack_cursor().0 + 1 >= spool.next_seq().0 {
                            self.former.set(false);
                            info!(shard = self.shard, uplink = %self.uplink, dir = %self.dir.display(), "spool of a former shard index drained; the directory can be removed");
                        }
                    }
                    v
                };
                for t in ready {
                    t.complete();
                }
                self.committed.notify_waiters();
                self.feed.notify_one();
            }
            Err(e) => self.fail(&e).await,
        }
    }

    fn is_stalled(&self) -> bool {
        self.inner
            .borrow()
            .spool
            .as_ref()
            .is_some_and(|s| s.stalled().is_some())
    }

    /// Brings the stall metrics and log up to date with the engine: storage refusals counted
    /// by reason, the `stalled` gauge, a WARN when the stall starts (and every
    /// `STALL_WARN_EVERY` while it lasts) saying what to do, an INFO when it ends.
    pub(super) fn observe_stall(&self, spool: &Spool) {
        let c = spool.counters();
        let mut log = self.stall_log.get();
        let now = spool.stalled();
        let new_refusals = c.storage_refusals.saturating_sub(log.refusals_seen);
        log.refusals_seen = c.storage_refusals;
        match now.or(log.reason) {
            Some(StallReason::ReadOnly) => self.metrics.storage_read_only.add(new_refusals),
            _ => self.metrics.storage_no_space.add(new_refusals),
        }
        self.metrics.stalled.set(match now {
            None => STALL_NONE,
            Some(StallReason::NoSpace) => STALL_NO_SPACE,
            Some(StallReason::ReadOnly) => STALL_READ_ONLY,
        });
        let at = Instant::now();
        match (log.reason, now) {
            (None, Some(reason)) => {
                log.since = Some(at);
                log.warned = Some(at);
                warn!(shard = self.shard, uplink = %self.uplink, dir = %self.dir.display(), reason = reason.as_str(), blame = "local", remedy = reason.remedy(), "spool storage stalled: new device messages are refused (QoS 1 PUBACKs withheld, QoS 0 dropped and counted); what is on disk is still sent and acknowledged messages are kept; it accepts again without a restart once the storage takes writes");
            }
            (Some(was), Some(reason)) => {
                // A new reason (full, then remounted read-only) is news: say so at once.
                if was != reason
                    || log
                        .warned
                        .is_none_or(|w| at.duration_since(w) >= STALL_WARN_EVERY)
                {
                    log.warned = Some(at);
                    let stalled_s = log.since.map_or(0, |s| at.duration_since(s).as_secs());
                    warn!(shard = self.shard, uplink = %self.uplink, dir = %self.dir.display(), reason = reason.as_str(), stalled_s, remedy = reason.remedy(), "spool storage still stalled: new device messages are refused");
                }
            }
            (Some(was), None) => {
                let stalled_s = log
                    .since
                    .map_or(Duration::ZERO, |s| at.duration_since(s))
                    .as_secs_f64();
                info!(shard = self.shard, uplink = %self.uplink, dir = %self.dir.display(), reason = was.as_str(), stalled_s, "spool storage takes writes again; the spool accepts device messages");
                log.since = None;
                log.warned = None;
            }
            (None, None) => {}
        }
        log.reason = now;
        self.stall_log.set(log);
    }

    /// The engine failed: log, wait, reopen (recovery decides what is durable), and read
    /// everything unacknowledged again as backlog.
    async fn fail(&self, error: &str) {
        self.metrics.failures.inc();
        error!(shard = self.shard, uplink = %self.uplink, dir = %self.dir.display(), error, blame = "local", "spool write failed; reopening it (devices waiting for this batch get no PUBACK: their connections are closed so they resend)");
        {
            let mut inner = self.inner.borrow_mut();
            inner.spool = None;
            self.reopens.set(self.reopens.get() + 1);
            inner.commit_waiters.clear();
            inner.cloud_tokens.clear();
            inner.backlog_cur = None;
        }
        loop {
            tokio::time::sleep(REOPEN_PAUSE).await;
            let dir = self.dir.clone();
            let mut cfg = self.engine.clone();
            cfg.max_bytes = self.max_bytes.get();
            let opened = tokio::task::spawn_blocking(move || Spool::open(&dir, cfg)).await;
            match opened {
                Ok(Ok((spool, report))) => {
                    log_recovery(self.shard, &self.uplink, &self.dir, &spool, &report);
                    let mut inner = self.inner.borrow_mut();
                    let (live, backlog) = Self::initial_streams(&spool);
                    inner.live = live;
                    inner.backlog = backlog;
                    inner.acks = AckRanges::default();
                    inner.spool = Some(spool);
                    break;
                }
                Ok(Err(e)) => {
                    error!(shard = self.shard, uplink = %self.uplink, dir = %self.dir.display(), error = %e, "cannot reopen the spool; retrying")
                }
                Err(e) => {
                    error!(shard = self.shard, uplink = %self.uplink, error = %e, "spool reopen task failed; retrying")
                }
            }
        }
        self.committed.notify_waiters();
        self.feed.notify_one();
    }

    /// Records the cloud ack of `seq`: into the engine as far as its ack window reaches from
    /// its cursor, the rest kept in `inner.acks` until the cursor comes close.
    fn apply_ack(&self, inner: &mut Inner, seq: u64) {
        let Some(spool) = inner.spool.as_mut() else {
            return;
        };
        inner.acks.insert(seq);
        let window = self.engine.ack_window;
        loop {
            let cursor = spool.ack_cursor().0;
            inner.acks.remove_through(cursor);
            let Some((s, e)) = inner.acks.first() else {
                break;
            };
            let limit = cursor.saturating_add(window);
            if s > limit {
                break;
            }
            let hi = e.min(limit);
            for q in s..=hi {
                if let Err(err) = spool.ack(SpoolSeq(q)) {
                    debug!(shard = self.shard, uplink = %self.uplink, seq = q, error = %err, "spool ack ignored");
                }
            }
            inner.acks.remove_through(hi);
        }
    }

    /// The cloud acknowledged (or the uplink gave up on, counted) record `seq`: see
    /// [`Stored::acknowledge`](super::Stored::acknowledge).
    pub(super) fn record_acknowledged(&self, seq: u64) {
        self.metrics.records_acked.inc();
        let Ok(mut inner) = self.inner.try_borrow_mut() else {
            self.deferred_acks.borrow_mut().push(seq);
            self.dirty.notify_one();
            return;
        };
        let deferred = std::mem::take(&mut *self.deferred_acks.borrow_mut());
        for s in deferred {
            self.apply_ack(&mut inner, s);
        }
        self.apply_ack(&mut inner, seq);
        drop(inner);
        self.dirty.notify_one();
    }
}
