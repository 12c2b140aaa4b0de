//! The gateway side of the durable spool (`[spool]`): store-and-forward between a shard's
//! device connections and its uplink sessions.
//!
//! Owns: one [`UplinkSpool`] per (shard, uplink) — a `sluice_spool::Spool` in
//! `DIR/{uplink}/shard-{n}/` — with its group-commit task, its feeder task (spool → uplink
//! queue, live and backlog streams), device acknowledgements under `ack = "spool"`, cloud
//! acknowledgements back into the spool, and the spool metrics. Does not own: the disk format
//! or recovery (`sluice-spool`), the record body format (`record`), routing (`shard/router.rs`)
//! or sending (`sink/`).
//!
//! # Path of one message
//! `shard/router.rs` encodes a normal-lane message once ([`record`]) and calls
//! [`UplinkSpool::append`] for every uplink that forwards it (cheap: a copy into the open
//! batch). The commit task takes the batch with `begin_commit`, runs the blocking
//! `CommitJob` on tokio's blocking pool (`spawn_blocking`) and applies it; everything appended
//! meanwhile goes into the next batch (group commit). `fsync = "interval"` commits every
//! `fsync_interval`; `always` and `never` commit as soon as anything is appended (`never`
//! writes without fsync). After a commit, under `ack = "spool"`, every device whose record is
//! now durable gets its PUBACK (through its [`AckToken`]). The feeder reads committed records
//! into the uplink queue (a bounded read-ahead: each stream at most half the queue's bytes;
//! the reads themselves on the blocking pool),
//! each carrying a spool [`AckToken`]; the cloud's PUBACK (or a counted, final drop in the
//! uplink) completes it, which acknowledges the record here ([`AckRanges`] holds acks that
//! are ahead of the engine's ack window) and, under `ack = "cloud"`, then the device.
//! Acknowledged records are trimmed by later commits (whole segments).
//!
//! # Live and backlog
//! The feeder hands records to the uplink only while its session is connected. When the
//! session connects, every record not yet handed over (what piled up during the outage, or
//! everything unacknowledged after a restart) becomes *backlog*, a range of seqs; records
//! appended afterwards are *live*. The two are separate FIFO streams in the uplink queue; the
//! session sends live messages first and lets the backlog use at most `drain_share` of the
//! inflight window while live messages wait (all of it when none wait), so neither starves
//! (see `UplinkQueue::take_next` and the session's `backlog_turn`). Per-device order holds
//! within each stream; the two streams interleave, so a device's live message may reach the
//! cloud before its older backlog. `drain_order = "newest-first"` reads the backlog from its
//! newest record down, which reverses per-device order within the backlog by design; it frees
//! spool space only when the drain reaches the oldest record (the engine trims below its ack
//! cursor).
//!
//! # Decisions
//! - **High lane:** high-priority messages bypass the spool: they keep today's in-memory
//!   queue with cloud-ack semantics (urgent data must not wait behind a commit or a backlog).
//! - **QoS 0:** spooled like QoS 1 (one path, per-device order across QoS levels, survives a
//!   restart), sent at QoS 0 and trimmed once written. When the spool is full under `block`, a
//!   QoS 0 message is dropped and counted (`sluice_spool_dropped_full_total`, and
//!   `sluice_mqtt_dropped_total{reason="spool_full"}`) instead of waiting.
//! - **Full:** under `block` a QoS 1 append waits until a commit has trimmed space (the device
//!   connection stops reading: back-pressure); under `drop-oldest` the engine removes the
//!   oldest segment, counted; a device waiting for those records is acknowledged (the drop is
//!   the configured policy), as for the uplink's other counted drops.
//! - **Failures:** a failed commit poisons the engine; the commit task logs an ERROR and
//!   reopens the spool (recovery decides from disk what is durable) after a pause. Devices
//!   whose records were in the failed batch get no PUBACK (they resend after reconnecting);
//!   everything unacknowledged is read again as backlog (duplicates, never loss).
//! - **Shutdown:** after the uplink sessions stopped, one last commit persists the ack cursor.
//!   After a crash, everything committed and unacknowledged is sent again (at-least-once).
//! - **Fewer shards than before:** a `shard-N` directory with `N >= shards` and unacknowledged
//!   records is opened at start-up (WARN) and drained as backlog by shard `N % shards` into
//!   the same uplink (nothing is appended to it; an INFO line says when it is empty and may be
//!   removed). It counts in the status `spool` totals, not in the per-shard metrics. A
//!   directory of an uplink that is no longer configured is named in a WARN and left alone.
//!
//! # Bounds (memory is independent of the spool's size)
//! - disk: the engine's `max_bytes` (`spool.max_size` split over shards and uplinks), with
//!   the `when_full` policy above;
//! - the read-ahead in the uplink queue: half of the lane's queue bytes per stream;
//! - device tokens waiting for a commit or for the cloud: at most `mqtt.receive_maximum` per
//!   connected device (the device connection's own bound);
//! - the uncommitted batch: the engine's `max_batch_bytes` (appends wait for the running
//!   commit beyond it);
//! - out-of-order cloud acks: [`ENGINE_ACK_WINDOW`] seqs in the engine, the rest as ranges
//!   ([`AckRanges`]: one entry per gap, not per record);
//! - backlog ranges: `MAX_BACKLOG_RANGES` (one per outage during a drain; beyond, the newest
//!   two merge and the live records between them are sent again).
//!
//! Everything here runs on the shard thread (`Rc`, `RefCell`; no borrow is held across an
//! await); the disk work runs on the blocking pool: the commit job, reopening, and every read
//! of committed records (`Spool::begin_read` → `ReadJob` → `finish_read`: a backlog after an
//! outage is not in the page cache, and the shard must keep serving its devices while it is
//! read). The feeder runs one read at a time per spool, so the read-ahead bound and the
//! order of each stream are as if it read inline; a read whose stream changed while it was
//! out (a reconnect, a reopen, a trimmed or dropped segment) is discarded and done again
//! from the current cursor. Damaged records are handled exactly as before: the read returns
//! the records before the damage and fails next with the cursor on it, and the feeder skips
//! that one seq.

mod acks;
mod metrics;
pub mod record;

pub use acks::AckRanges;
pub use metrics::SpoolMetrics;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytestring::ByteString;
use sluice_proto::mqtt::QoS;
use sluice_spool::{
    Dropped, FsyncPolicy, ReadCursor, RecoveryReport, Spool, SpoolError, SpoolRecord, SpoolSeq,
};
use tokio::sync::{watch, Notify};
use tracing::{debug, error, info, warn};

use crate::config::{Config, DrainOrder, SpoolAck};
use crate::edge::ack::{AckToken, SpoolAcker};
use crate::sink::{UplinkMessage, UplinkQueue};

/// Out-of-order acks the engine holds per spool (its `ack_window`); acks further ahead wait
/// in [`AckRanges`].
pub const ENGINE_ACK_WINDOW: u64 = 8192;
/// Most records read from the spool at a time.
const READ_BATCH: usize = 4096;
/// Most record bytes read at a time (the engine reads about this much per call).
const READ_BYTES: usize = 256 << 10;
/// Most separate backlog ranges kept; beyond, the newest two merge (their gap is re-sent).
const MAX_BACKLOG_RANGES: usize = 1024;
/// Pause before reopening a spool after a failure.
const REOPEN_PAUSE: Duration = Duration::from_secs(1);
/// Ack-only commits (cursor moves, trims) happen at most this often.
const ACK_COMMIT_PERIOD: Duration = Duration::from_millis(10);

/// Why the spools could not be opened at start-up.
#[derive(Debug, thiserror::Error)]
pub enum SpoolStartError {
    /// The spool directory could not be opened or recovered (local; fix the disk or path).
    #[error("cannot open spool {dir}: {source}")]
    Open {
        dir: PathBuf,
        #[source]
        source: SpoolError,
    },
}

/// A spool opened (and recovered) at start-up, on its way to its shard thread.
pub struct OpenedSpool {
    pub spool: Spool,
    pub dir: PathBuf,
    pub engine: sluice_spool::SpoolConfig,
    pub metrics: Arc<SpoolMetrics>,
}

/// The spool directory of one uplink on one shard.
pub fn spool_dir(base: &Path, uplink: &str, shard: usize) -> PathBuf {
    base.join(uplink).join(format!("shard-{shard}"))
}

/// Every spool the gateway runs, opened and recovered at start-up.
#[derive(Default)]
pub struct OpenedSpools {
    /// `[uplink][shard]`.
    pub per_uplink: Vec<Vec<OpenedSpool>>,
    /// Spools of shard indexes no longer configured (the shard count went down), with
    /// unacknowledged records: `(uplink index, former shard index, spool)`. Shard
    /// `former % shards` drains them into that uplink's backlog; nothing is appended to them.
    pub former: Vec<(usize, usize, OpenedSpool)>,
}

/// Opens every (uplink, shard) spool, logging each recovery report. Directories of shard
/// indexes no longer configured are opened too and drained by a current shard (WARN); a
/// directory of an uplink that is not configured is named in a WARN and left alone (there is
/// nowhere to send it).
pub fn open_all(config: &Config, shards: usize) -> Result<OpenedSpools, SpoolStartError> {
    let Some(base) = &config.spool.dir else {
        return Ok(OpenedSpools::default());
    };
    let record_max = crate::config::SpoolConfig::max_record_bytes(
        config.mqtt.max_packet_size,
        config.mqtt.max_client_id_len,
    );
    let engine =
        config
            .spool
            .engine_config(shards, config.uplink.len(), record_max, ENGINE_ACK_WINDOW);
    warn_unknown_uplinks(base, config);
    let mut all = Vec::new();
    for u in &config.uplink {
        let mut per_shard = Vec::new();
        for shard in 0..shards {
            let dir = spool_dir(base, &u.name, shard);
            let (spool, report) =
                Spool::open(&dir, engine.clone()).map_err(|source| SpoolStartError::Open {
                    dir: dir.clone(),
                    source,
                })?;
            log_recovery(shard, &u.name, &dir, &spool, &report);
            let metrics = Arc::new(SpoolMetrics::default());
            update_gauges(&spool, &metrics);
            per_shard.push(OpenedSpool {
                spool,
                dir,
                engine: engine.clone(),
                metrics,
            });
        }
        all.push(per_shard);
    }
    let mut former = Vec::new();
    for (ui, u) in config.uplink.iter().enumerate() {
        for index in former_shards(&base.join(&u.name), shards) {
            let dir = spool_dir(base, &u.name, index);
            let (spool, report) =
                Spool::open(&dir, engine.clone()).map_err(|source| SpoolStartError::Open {
                    dir: dir.clone(),
                    source,
                })?;
            log_recovery(index, &u.name, &dir, &spool, &report);
            let unacked = (spool.next_seq().0 - 1).saturating_sub(spool.ack_cursor().0);
            if unacked == 0 {
                info!(uplink = %u.name, dir = %dir.display(), shards, "spool directory of a shard index no longer configured holds nothing unacknowledged; it can be removed");
                continue;
            }
            warn!(uplink = %u.name, dir = %dir.display(), shards, unacked, drained_by = index % shards, "spool directory of a shard index no longer configured (fewer shards now); a current shard drains it");
            let metrics = Arc::new(SpoolMetrics::default());
            update_gauges(&spool, &metrics);
            former.push((
                ui,
                index,
                OpenedSpool {
                    spool,
                    dir,
                    engine: engine.clone(),
                    metrics,
                },
            ));
        }
    }
    Ok(OpenedSpools {
        per_uplink: all,
        former,
    })
}

/// Indexes of `shard-N` directories under `uplink_dir` with `N >= shards`, ascending.
fn former_shards(uplink_dir: &Path, shards: usize) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(uplink_dir) else {
        return Vec::new();
    };
    let mut v: Vec<usize> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("shard-")?
                .parse::<usize>()
                .ok()
        })
        .filter(|&n| n >= shards)
        .collect();
    v.sort_unstable();
    v
}

fn log_recovery(shard: usize, uplink: &str, dir: &Path, spool: &Spool, r: &RecoveryReport) {
    let unacked = spool.next_seq().0 - 1 - spool.ack_cursor().0.min(spool.next_seq().0 - 1);
    if r.is_clean() {
        info!(
            shard,
            uplink,
            dir = %dir.display(),
            segments = r.segments_scanned,
            records = r.records_found,
            unacked,
            cursor = ?r.cursor,
            "spool recovered"
        );
    } else {
        warn!(
            shard,
            uplink,
            dir = %dir.display(),
            segments = r.segments_scanned,
            records = r.records_found,
            unacked,
            skipped_ranges = r.skipped_ranges,
            skipped_bytes = r.skipped_bytes,
            torn_tails = r.torn_tails.len(),
            quarantined = r.quarantined.len(),
            cursor = ?r.cursor,
            "spool recovered with damage skipped (see DIR/quarantine)"
        );
    }
}

/// WARN about spool directories of uplinks that are not configured.
fn warn_unknown_uplinks(base: &Path, config: &Config) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() && !config.uplink.iter().any(|u| u.name == name) {
            warn!(dir = %e.path().display(), "spool directory of an uplink that is not configured; its records are not sent");
        }
    }
}

fn update_gauges(spool: &Spool, m: &SpoolMetrics) {
    m.bytes.set(spool.total_bytes() as i64);
    let last = spool.next_seq().0 - 1;
    m.unacked_records
        .set(last.saturating_sub(spool.ack_cursor().0) as i64);
}

/// What happened to an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// In the spool (durable after the next commit).
    Stored,
    /// QoS 0 and the spool is full under `block`: dropped, counted.
    DroppedFull,
    /// Cannot ever be stored (larger than the largest record): dropped, counted, the device
    /// acknowledged.
    DroppedTooLarge,
    /// Waited for a failed spool to reopen, and meanwhile another message of its device was
    /// abandoned: not stored and not acknowledged, so the device resends both in order.
    NotStored,
}

/// One uplink's spool on one shard. See the module docs.
pub struct UplinkSpool {
    shard: usize,
    uplink: String,
    ack_mode: SpoolAck,
    fsync: FsyncPolicy,
    drain_order: DrainOrder,
    dir: PathBuf,
    engine: sluice_spool::SpoolConfig,
    queue: Rc<UplinkQueue>,
    metrics: Arc<SpoolMetrics>,
    inner: RefCell<Inner>,
    /// Something to commit (an append or an ack); one stored permit.
    dirty: Notify,
    /// A commit finished or the spool was reopened: blocked appenders re-try.
    committed: Notify,
    /// The feeder should look again; one stored permit.
    feed: Notify,
    link_up: Cell<bool>,
    /// The spool of a shard index no longer configured: drained, never appended to.
    former: Cell<bool>,
    /// Acks that arrived while `inner` was borrowed (never in practice; kept for safety).
    deferred_acks: RefCell<Vec<u64>>,
    /// Times the spool was reopened: a read started before a reopen is discarded.
    reopens: Cell<u64>,
}

impl std::fmt::Debug for UplinkSpool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UplinkSpool")
            .field("shard", &self.shard)
            .field("uplink", &self.uplink)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// `None` only while a reopen runs.
    spool: Option<Spool>,
    /// `ack = "spool"`: device tokens completed once their seq is durable.
    commit_waiters: VecDeque<(u64, AckToken)>,
    /// `ack = "cloud"`: device tokens handed to the uplink with their record.
    cloud_tokens: BTreeMap<u64, AckToken>,
    /// Cloud acks ahead of the engine's window.
    acks: AckRanges,
    /// The live stream's next record.
    live: ReadCursor,
    /// Backlog seq ranges `[start, end)`, oldest first.
    backlog: VecDeque<(u64, u64)>,
    /// Position inside the range being drained (front for oldest-first, back for newest).
    backlog_cur: Option<ReadCursor>,
}

impl UplinkSpool {
    pub fn new(
        shard: usize,
        uplink: &str,
        config: &Config,
        opened: OpenedSpool,
        queue: Rc<UplinkQueue>,
    ) -> Rc<UplinkSpool> {
        let OpenedSpool {
            spool,
            dir,
            engine,
            metrics,
        } = opened;
        let (live, backlog) = Self::initial_streams(&spool);
        Rc::new(UplinkSpool {
            shard,
            uplink: uplink.to_string(),
            ack_mode: config.spool.ack,
            fsync: engine.fsync,
            drain_order: config.spool.drain_order,
            dir,
            engine,
            queue,
            metrics,
            inner: RefCell::new(Inner {
                spool: Some(spool),
                commit_waiters: VecDeque::new(),
                cloud_tokens: BTreeMap::new(),
                acks: AckRanges::default(),
                live,
                backlog,
                backlog_cur: None,
            }),
            dirty: Notify::new(),
            committed: Notify::new(),
            feed: Notify::new(),
            link_up: Cell::new(false),
            former: Cell::new(false),
            deferred_acks: RefCell::new(Vec::new()),
            reopens: Cell::new(0),
        })
    }

    /// Marks this as the spool of a former shard index: it is only drained; a log line says
    /// when it is empty.
    pub fn set_former(&self) {
        self.former.set(true);
    }

    /// Everything unacknowledged in a freshly opened spool is backlog; live starts after it.
    fn initial_streams(spool: &Spool) -> (ReadCursor, VecDeque<(u64, u64)>) {
        let first = spool.ack_cursor().0 + 1;
        let next = spool.next_seq().0;
        let mut backlog = VecDeque::new();
        if next > first {
            backlog.push_back((first, next));
        }
        (ReadCursor::at(SpoolSeq(next)), backlog)
    }

    /// Starts the commit and feeder tasks on this shard's `LocalSet`. They end when
    /// `shutdown` turns true (the commit task after one last commit).
    pub fn spawn_tasks(
        self: &Rc<Self>,
        shutdown: watch::Receiver<bool>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        vec![
            tokio::task::spawn_local(self.clone().commit_loop(shutdown.clone())),
            tokio::task::spawn_local(self.clone().feed_loop(shutdown)),
        ]
    }

    /// Appends one encoded record (`body`, see [`record`]). `ack` is this uplink's share of
    /// the device's token (QoS 1/2). Waits while the spool is full under `block` (QoS ≥ 1)
    /// or while a failed spool is being reopened.
    pub async fn append(&self, body: &[u8], qos: QoS, ack: Option<AckToken>) -> Appended {
        let mut counted_full = false;
        loop {
            let committed = self.committed.notified();
            tokio::pin!(committed);
            committed.as_mut().enable();
            let result = {
                let mut inner = self.inner.borrow_mut();
                match inner.spool.as_mut() {
                    Some(spool) => spool.append(body),
                    None => Err(SpoolError::Poisoned),
                }
            };
            match result {
                Ok(a) => {
                    self.metrics.records_appended.inc();
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

    /// The uplink session connected (`true`) or lost its connection (`false`).
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

    // ----- commits -----

    async fn commit_loop(self: Rc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut last_commit = Instant::now();
        loop {
            let stop = tokio::select! {
                _ = self.dirty.notified() => false,
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
    async fn commit_once(&self) {
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
                    if let Some(spool) = &inner.spool {
                        update_gauges(spool, &self.metrics);
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
            let cfg = self.engine.clone();
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

    // ----- feeding the uplink -----

    async fn feed_loop(self: Rc<Self>, mut shutdown: watch::Receiver<bool>) {
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
    async fn fill(self: &Rc<Self>) {
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
    /// connection (abandoned, see `shard::ack`), and the device resends the message.
    fn skip_record(&self, spool: &mut Spool, cloud_tokens: &mut BTreeMap<u64, AckToken>, seq: u64) {
        self.metrics.undecodable.inc();
        let _ = spool.ack(SpoolSeq(seq));
        drop(cloud_tokens.remove(&seq));
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
                continue;
            }
            let age = wall.duration_since(rec.received).unwrap_or(Duration::ZERO);
            let acker: Rc<dyn SpoolAcker> = self.clone();
            // Copies: a slice would pin the whole read chunk (up to `READ_BYTES`) for as long
            // as the message waits for the cloud, so memory would exceed the queue's bound.
            let msg = UplinkMessage {
                device: ByteString::from(&*rec.device),
                topic: ByteString::from(&*rec.topic),
                payload: bytes::Bytes::copy_from_slice(&rec.payload),
                qos: rec.qos,
                retain: rec.retain,
                received_at: now.checked_sub(age).unwrap_or(now),
                ack: Some(AckToken::spooled(acker, r.seq.0, backlog, device)),
            };
            if backlog {
                self.queue.push_backlog(msg);
            } else {
                self.queue.push_live_now(msg);
            }
        }
    }

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

    /// Which stream a record token belongs to is decided when it is read; this only counts.
    pub fn metrics(&self) -> &Arc<SpoolMetrics> {
        &self.metrics
    }
}

impl SpoolAcker for UplinkSpool {
    fn cloud_acked(&self, seq: u64) {
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

/// Resolves when shutdown was requested or its sender is gone.
async fn shutdown_signal(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// The record body of a device message (encoded once per message, appended per uplink).
pub fn encode_message(
    device: &ByteString,
    topic: &ByteString,
    payload: &bytes::Bytes,
    qos: QoS,
    retain: bool,
    received_at: Instant,
) -> Option<Vec<u8>> {
    let rec = record::Record {
        device: device.clone(),
        topic: topic.clone(),
        qos,
        retain,
        received: SystemTime::now()
            .checked_sub(received_at.elapsed())
            .unwrap_or(SystemTime::UNIX_EPOCH),
        payload: payload.clone(),
    };
    let mut body = Vec::with_capacity(rec.encoded_len());
    record::encode_into(&rec, &mut body).ok()?;
    Some(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::ack::DeviceAcks;
    use bytes::Bytes;

    fn rt() -> (tokio::runtime::Runtime, tokio::task::LocalSet) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        (rt, tokio::task::LocalSet::new())
    }

    fn setup(dir: &Path, extra: &str, ack_window: u64) -> (Rc<UplinkSpool>, Rc<UplinkQueue>) {
        setup_with_queue(dir, extra, ack_window, 1 << 20)
    }

    fn setup_with_queue(
        dir: &Path,
        extra: &str,
        ack_window: u64,
        queue_bytes: usize,
    ) -> (Rc<UplinkSpool>, Rc<UplinkQueue>) {
        let config = crate::config::parse(&format!(
            "[spool]\ndir = \"{}\"\nfsync = \"never\"\n{extra}\n",
            dir.display()
        ))
        .expect("config");
        let mut engine = config.spool.engine_config(1, 1, 64 << 10, ack_window);
        engine.max_bytes = 64 << 20;
        let sdir = spool_dir(dir, "cloud", 0);
        let (spool, _) = Spool::open(&sdir, engine.clone()).expect("open");
        let opened = OpenedSpool {
            spool,
            dir: sdir,
            engine,
            metrics: Arc::default(),
        };
        let queue = Rc::new(UplinkQueue::new(queue_bytes));
        let spool = UplinkSpool::new(0, "cloud", &config, opened, queue.clone());
        (spool, queue)
    }

    fn body(i: usize) -> Vec<u8> {
        encode_message(
            &ByteString::from("dev"),
            &ByteString::from("t"),
            &Bytes::from(format!("{i}")),
            QoS::AtLeastOnce,
            false,
            Instant::now(),
        )
        .expect("encodes")
    }

    fn drain_queue(q: &UplinkQueue) -> Vec<(String, bool, AckToken)> {
        std::iter::from_fn(|| q.take_next(true, false))
            .map(|t| {
                // As the session does once a message is finished.
                q.release_msg(&t.msg);
                let backlog = crate::sink::queue_is_backlog(&t.msg);
                let payload = String::from_utf8(t.msg.payload.to_vec()).expect("utf-8");
                (
                    payload,
                    backlog,
                    t.msg.ack.expect("spooled messages carry a token"),
                )
            })
            .collect()
    }

    #[test]
    fn a_device_is_acked_only_after_the_commit_that_holds_its_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let (spool, _q) = setup(dir.path(), "ack = \"spool\"", 64);
            let dev = DeviceAcks::new();
            let token = AckToken::new(&dev, 7);
            assert_eq!(
                spool.append(&body(1), QoS::AtLeastOnce, Some(token)).await,
                Appended::Stored
            );
            assert!(dev.drain().is_empty(), "not durable yet");
            spool.commit_once().await;
            assert_eq!(dev.drain(), vec![7]);
        });
    }

    #[test]
    fn records_wait_while_the_link_is_down_then_drain_as_backlog_and_later_ones_are_live() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let (spool, q) = setup(dir.path(), "", 64);
            for i in 0..5 {
                spool.append(&body(i), QoS::AtLeastOnce, None).await;
            }
            spool.commit_once().await;
            spool.fill().await;
            assert!(
                q.is_empty(),
                "nothing is handed over while the uplink is down"
            );
            spool.link_changed(true);
            spool.fill().await;
            for i in 5..8 {
                spool.append(&body(i), QoS::AtLeastOnce, None).await;
            }
            spool.commit_once().await;
            spool.fill().await;
            let got = drain_queue(&q);
            let order: Vec<(String, bool)> = got.iter().map(|(p, b, _)| (p.clone(), *b)).collect();
            let want: Vec<(String, bool)> = (5..8)
                .map(|i| (i.to_string(), false))
                .chain((0..5).map(|i| (i.to_string(), true)))
                .collect();
            assert_eq!(
                order, want,
                "live first when both wait (turn = false), backlog in order"
            );
            for (_, _, t) in got {
                t.complete();
            }
            spool.commit_once().await;
            assert_eq!(spool.metrics.unacked_records.get(), 0);
        });
    }

    #[test]
    fn acks_far_ahead_of_the_engine_window_are_kept_as_ranges_and_applied_later() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let (spool, q) = setup(dir.path(), "drain_order = \"newest-first\"", 4);
            for i in 0..300 {
                spool.append(&body(i), QoS::AtLeastOnce, None).await;
            }
            spool.commit_once().await;
            spool.link_changed(true);
            let mut tokens = Vec::new();
            while tokens.len() < 300 {
                spool.fill().await;
                let got = drain_queue(&q);
                assert!(!got.is_empty(), "the feeder makes progress");
                tokens.extend(got);
            }
            let order: Vec<String> = tokens.iter().map(|(p, _, _)| p.clone()).collect();
            assert_eq!(
                order,
                (0..300).rev().map(|i| i.to_string()).collect::<Vec<_>>()
            );
            // Acks arrive newest first, up to 296 above the engine's 4-seq window.
            for (_, _, t) in tokens {
                t.complete();
            }
            let inner = spool.inner.borrow();
            let s = inner.spool.as_ref().expect("open");
            assert_eq!(s.ack_cursor(), SpoolSeq(300));
            assert!(inner.acks.is_empty());
        });
    }

    #[test]
    fn a_second_outage_during_a_newest_first_drain_loses_and_repeats_nothing() {
        second_outage_during_a_drain(true);
    }

    #[test]
    fn a_second_outage_during_an_oldest_first_drain_loses_and_repeats_nothing() {
        second_outage_during_a_drain(false);
    }

    fn second_outage_during_a_drain(newest_first: bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rt, local) = rt();
        let order = if newest_first {
            "drain_order = \"newest-first\""
        } else {
            ""
        };
        local.block_on(&rt, async {
            // A small queue: each fill hands over only part of the backlog.
            let (spool, q) = setup_with_queue(dir.path(), order, 64, 8 << 10);
            for i in 0..100 {
                spool.append(&body(i), QoS::AtLeastOnce, None).await;
            }
            spool.commit_once().await;
            spool.link_changed(true);
            spool.fill().await;
            let mut seen: Vec<usize> = Vec::new();
            let first = drain_queue(&q);
            assert!(!first.is_empty() && first.len() < 100, "{}", first.len());
            for (p, _, t) in first {
                seen.push(p.parse().expect("number"));
                t.complete();
            }
            // The link drops mid-drain; more records pile up; it comes back.
            spool.link_changed(false);
            for i in 100..150 {
                spool.append(&body(i), QoS::AtLeastOnce, None).await;
            }
            spool.commit_once().await;
            spool.link_changed(true);
            for _ in 0..100 {
                spool.fill().await;
                let got = drain_queue(&q);
                if got.is_empty() {
                    break;
                }
                for (p, _, t) in got {
                    seen.push(p.parse().expect("number"));
                    t.complete();
                }
            }
            let mut sorted = seen.clone();
            sorted.sort_unstable();
            assert_eq!(
                sorted,
                (0..150).collect::<Vec<_>>(),
                "each record once: {seen:?}"
            );
            let pos = |n: usize| seen.iter().position(|&x| x == n).expect("seen");
            if newest_first {
                assert!(
                    pos(149) < pos(0),
                    "the newer outage's records go before the older rest"
                );
            } else {
                assert_eq!(seen, (0..150).collect::<Vec<_>>(), "oldest first, in order");
            }
            spool.commit_once().await;
            assert_eq!(spool.metrics.unacked_records.get(), 0);
        });
    }

    /// A file system whose reads block while its gate is closed: the fault of a slow disk
    /// under a backlog that is not in the page cache.
    #[derive(Clone, Default)]
    struct GatedFs {
        gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
        blocked_reads: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl GatedFs {
        fn set_closed(&self, closed: bool) {
            *self.gate.0.lock().expect("gate") = closed;
            self.gate.1.notify_all();
        }
        fn is_closed(&self) -> bool {
            *self.gate.0.lock().expect("gate")
        }
        fn wrap(&self, f: Arc<dyn sluice_spool::SpoolFile>) -> Arc<dyn sluice_spool::SpoolFile> {
            Arc::new(GatedFile {
                fs: self.clone(),
                file: f,
            })
        }
    }

    struct GatedFile {
        fs: GatedFs,
        file: Arc<dyn sluice_spool::SpoolFile>,
    }

    impl sluice_spool::SpoolFile for GatedFile {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            let mut closed = self.fs.gate.0.lock().expect("gate");
            if *closed {
                self.fs
                    .blocked_reads
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            while *closed {
                closed = self.fs.gate.1.wait(closed).expect("gate");
            }
            drop(closed);
            self.file.read_exact_at(buf, offset)
        }
        fn append(&self, buf: &[u8]) -> std::io::Result<()> {
            self.file.append(buf)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.file.sync()
        }
        fn size(&self) -> std::io::Result<u64> {
            self.file.size()
        }
        fn truncate(&self, len: u64) -> std::io::Result<()> {
            self.file.truncate(len)
        }
    }

    impl sluice_spool::SpoolFs for GatedFs {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            sluice_spool::RealFs.create_dir_all(dir)
        }
        fn list(&self, dir: &Path) -> std::io::Result<Vec<(String, u64)>> {
            sluice_spool::RealFs.list(dir)
        }
        fn create(
            &self,
            path: &Path,
            exclusive: bool,
        ) -> std::io::Result<Arc<dyn sluice_spool::SpoolFile>> {
            Ok(self.wrap(sluice_spool::RealFs.create(path, exclusive)?))
        }
        fn open(&self, path: &Path) -> std::io::Result<Arc<dyn sluice_spool::SpoolFile>> {
            Ok(self.wrap(sluice_spool::RealFs.open(path)?))
        }
        fn open_read(&self, path: &Path) -> std::io::Result<Arc<dyn sluice_spool::SpoolFile>> {
            Ok(self.wrap(sluice_spool::RealFs.open_read(path)?))
        }
        fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
            sluice_spool::RealFs.rename(from, to)
        }
        fn remove(&self, path: &Path) -> std::io::Result<()> {
            sluice_spool::RealFs.remove(path)
        }
        fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
            sluice_spool::RealFs.sync_dir(dir)
        }
    }

    #[test]
    fn a_device_on_the_shard_gets_its_puback_while_a_backlog_read_waits_for_the_disk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rt, local) = rt();
        let fs = GatedFs::default();
        // If reads ran on the shard thread, the blocked read would stall this whole test
        // (the shard's runtime): a watchdog opens the gate after 10 s so it fails instead.
        let (finished, watch_finish) = std::sync::mpsc::channel::<()>();
        let watchdog = {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let _ = watch_finish.recv_timeout(Duration::from_secs(10));
                fs.set_closed(false);
            })
        };
        local.block_on(&rt, async {
            let config = crate::config::parse(&format!(
                "[spool]\ndir = \"{}\"\nfsync = \"never\"\nack = \"spool\"\n",
                dir.path().display()
            ))
            .expect("config");
            let engine = config.spool.engine_config(1, 1, 64 << 10, 64);
            let sdir = spool_dir(dir.path(), "cloud", 0);
            let (engine_spool, _) =
                Spool::open_with_fs(Arc::new(fs.clone()), &sdir, engine.clone()).expect("open");
            let opened = OpenedSpool {
                spool: engine_spool,
                dir: sdir,
                engine,
                metrics: Arc::default(),
            };
            let q = Rc::new(UplinkQueue::new(1 << 20));
            let spool = UplinkSpool::new(0, "cloud", &config, opened, q.clone());
            // A backlog piled up during an outage.
            for i in 0..50 {
                spool.append(&body(i), QoS::AtLeastOnce, None).await;
            }
            spool.commit_once().await;
            let (stop, shutdown) = watch::channel(false);
            let tasks = spool.spawn_tasks(shutdown);
            // The disk stalls; the uplink comes back and the feeder starts reading backlog.
            fs.set_closed(true);
            spool.link_changed(true);
            let stalled = tokio::time::timeout(Duration::from_secs(30), async {
                while fs.blocked_reads.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            assert!(stalled.is_ok(), "the feeder reads the backlog");
            // A device on this shard publishes meanwhile: its PUBACK comes after the commit.
            let dev = DeviceAcks::new();
            let token = AckToken::new(&dev, 9);
            assert_eq!(
                spool.append(&body(50), QoS::AtLeastOnce, Some(token)).await,
                Appended::Stored
            );
            let acked = tokio::time::timeout(Duration::from_secs(30), async {
                while dev.drain().is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            assert!(acked.is_ok(), "the device is acknowledged");
            assert!(
                fs.is_closed(),
                "the device's PUBACK waited until the stalled spool read finished: the read blocked the shard thread"
            );
            // The disk recovers: the backlog, then the live record, all in order.
            fs.set_closed(false);
            let mut got: Vec<(String, bool)> = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            while got.len() < 51 && Instant::now() < deadline {
                for (p, backlog, t) in drain_queue(&q) {
                    got.push((p, backlog));
                    t.complete();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let backlog: Vec<String> = got.iter().filter(|g| g.1).map(|g| g.0.clone()).collect();
            let live: Vec<String> = got.iter().filter(|g| !g.1).map(|g| g.0.clone()).collect();
            assert_eq!(
                backlog,
                (0..50).map(|i| i.to_string()).collect::<Vec<_>>(),
                "the backlog, in order"
            );
            assert_eq!(live, vec!["50".to_string()], "the live record");
            stop.send_replace(true);
            for t in tasks {
                t.await.expect("spool task");
            }
        });
        drop(finished);
        watchdog.join().expect("watchdog");
    }
}
