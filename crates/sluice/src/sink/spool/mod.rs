//! The gateway side of the durable spool (`[spool]`): store-and-forward between a shard's
//! device connections and its uplink sessions.
//!
//! Owns: one [`UplinkSpool`] per (shard, uplink) — a `sluice_spool::Spool` in
//! `DIR/{uplink}/shard-{n}/` — with its group-commit task, its feeder task (spool → uplink
//! queue, live and backlog streams), device acknowledgements under `ack = "spool"`, cloud
//! acknowledgements back into the spool, and the spool metrics (with `age`: read-time marks
//! for the oldest unacknowledged record's age). Does not own: the disk format
//! or recovery (`sluice-spool`), the record body format (`record`), routing (`shard/router.rs`,
//! `sink/handle.rs`) or sending (`sink/`).
//!
//! # Path of one message
//! The router offers a device message to every sink (`sink/handle.rs`, `Sink::offer`); the
//! message is encoded once ([`record`]) and [`UplinkSpool::append`]ed for every uplink that
//! forwards it on its normal lane (cheap: a copy into the open batch). The commit task takes
//! the batch with `begin_commit`, runs the blocking `CommitJob` on tokio's blocking pool
//! (`spawn_blocking`) and applies it; everything appended meanwhile goes into the next batch
//! (group commit). `fsync = "interval"` commits every
//! `fsync_interval`; `always` and `never` commit as soon as anything is appended (`never`
//! writes without fsync). After a commit, under `ack = "spool"`, every device whose record is
//! now durable gets its PUBACK (through its [`AckToken`]). The feeder reads committed records
//! into the uplink queue (a bounded read-ahead: each stream at most half the queue's bytes;
//! the reads themselves on the blocking pool), each message carrying where its record is
//! ([`Stored`]: this spool, its seq, its stream) and, under `ack = "cloud"`, its device's
//! [`AckToken`]. The cloud's PUBACK (or a counted, final drop in the uplink) finishes the
//! message (`UplinkMessage::complete_with`), which acknowledges the record here first
//! ([`AckRanges`] holds acks that are ahead of the engine's ack window) and then completes
//! the device token: acknowledgements flow one way, uplink → spool → token → device, and
//! nothing in the device's token knows about spools. Acknowledged records are trimmed by
//! later commits (whole segments). A message dropped unfinished acknowledges nothing: its
//! record is sent again after a restart.
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
//! - **Full or read-only disk:** not a failure: the engine stalls (see `commit.rs` and
//!   `sluice_spool`): appends wait as under `block` (QoS 0 dropped, counted), devices of the
//!   refused batch keep waiting for their PUBACK, the feeder and cloud acks go on and free the
//!   disk, and a commit every `STALL_RETRY` probes until the spool accepts again.
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
//!
//! # Files
//! - `mod.rs` (here): the types ([`UplinkSpool`], [`Stored`], [`Appended`]), construction
//!   and the two tasks' start, the record body of a device message ([`encode_message`]);
//! - `open.rs`: start-up — opening and recovering every spool, former shard indexes;
//! - `commit.rs`: appends, group commits, reopening after a failure, cloud acks applied;
//! - `feed.rs`: the feeder — live and backlog streams, off-shard reads, link changes;
//! - `acks.rs`, `record.rs`, `metrics.rs`: ack ranges, the record body format, the metrics.

mod acks;
mod age;
mod commit;
mod feed;
mod metrics;
mod open;
pub mod record;
#[cfg(test)]
mod tests;

pub use acks::AckRanges;
pub use metrics::SpoolMetrics;
pub use open::{
    engine_config, open_all, open_uplink, spool_dir, OpenedSpool, OpenedSpools, SpoolStartError,
};

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytestring::ByteString;
use sluice_proto::mqtt::QoS;
use sluice_spool::{FsyncPolicy, ReadCursor, Spool, SpoolSeq};
use tokio::sync::{watch, Notify};

use crate::config::{Config, DrainOrder, SpoolAck};
use crate::message::ack::AckToken;
use crate::sink::UplinkQueue;

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
/// While the spool's storage is full or read-only, a commit (which persists acks, trims and
/// probes the storage) runs this often.
const STALL_RETRY: Duration = Duration::from_secs(1);
/// While the stall lasts, its WARN is repeated this often.
const STALL_WARN_EVERY: Duration = Duration::from_secs(60);

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
    /// QoS 0 and the spool's storage is full or read-only: dropped, counted.
    DroppedStalled,
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
    /// The size bound in force: `engine.max_bytes` until a reload that adds a spooled uplink
    /// lowers this spool's share ([`UplinkSpool::set_max_bytes`]); a reopen keeps it.
    max_bytes: Cell<u64>,
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
    /// What `observe_stall` last saw and logged.
    stall_log: Cell<StallLog>,
    /// Its uplink was removed by a reload and its tasks stopped ([`UplinkSpool::take_device_tokens`]).
    removed: Cell<bool>,
}

/// The stall as last observed (for its metrics and rate-limited log lines).
#[derive(Debug, Clone, Copy, Default)]
struct StallLog {
    reason: Option<sluice_spool::StallReason>,
    since: Option<Instant>,
    warned: Option<Instant>,
    /// The engine's `storage_refusals` counter as last exported.
    refusals_seen: u64,
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
    /// Read times of appended records, for the oldest unacknowledged record's age.
    age: age::AgeMarks,
}

/// Where a message read from a spool is stored: the outbox item's (`UplinkMessage::stored`)
/// link back to its record. Finishing the message acknowledges the record through it
/// ([`Stored::acknowledge`]); dropping it acknowledges nothing (the record is read again
/// after a restart or a reopen).
#[derive(Debug)]
pub struct Stored {
    spool: Rc<UplinkSpool>,
    seq: u64,
    /// Read as backlog (before the link's last connect), not live.
    backlog: bool,
}

impl Stored {
    /// Whether the record travels in the backlog stream (see `UplinkQueue::take_next`).
    pub fn is_backlog(&self) -> bool {
        self.backlog
    }

    /// The record's seq in its spool.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The cloud acknowledged the record (or the uplink gave up on it, counted): acknowledge
    /// it in its spool, so a later commit trims it.
    pub fn acknowledge(self) {
        self.spool.record_acknowledged(self.seq);
    }
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
            max_bytes: Cell::new(engine.max_bytes),
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
                age: age::AgeMarks::default(),
            }),
            dirty: Notify::new(),
            committed: Notify::new(),
            feed: Notify::new(),
            link_up: Cell::new(false),
            former: Cell::new(false),
            deferred_acks: RefCell::new(Vec::new()),
            reopens: Cell::new(0),
            stall_log: Cell::new(StallLog::default()),
            removed: Cell::new(false),
        })
    }

    /// Marks this as the spool of a former shard index: it is only drained; a log line says
    /// when it is empty.
    pub fn set_former(&self) {
        self.former.set(true);
    }

    /// Whether this is the spool of a former shard index (drained, never appended to).
    pub fn is_former(&self) -> bool {
        self.former.get()
    }

    /// Change this spool's share of `[spool] max_size` (a reload adding a spooled uplink,
    /// `shard/sinks.rs`): never below two segments; what it holds stays (see
    /// `sluice_spool::Spool::set_max_bytes`). Returns the bound now in force.
    pub fn set_max_bytes(&self, max: u64) -> u64 {
        let now = match self.inner.borrow_mut().spool.as_mut() {
            Some(spool) => spool.set_max_bytes(max),
            None => max.max(2 * self.engine.segment_bytes),
        };
        self.max_bytes.set(now);
        self.metrics
            .max_bytes
            .set(i64::try_from(now).unwrap_or(i64::MAX));
        now
    }

    /// Bytes its segment files hold (while it is being reopened: as last measured).
    pub fn total_bytes(&self) -> u64 {
        match self.inner.borrow().spool.as_ref() {
            Some(spool) => spool.total_bytes(),
            None => u64::try_from(self.metrics.bytes.get()).unwrap_or(0),
        }
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

    /// The spool's metrics (this shard's, this uplink's).
    pub fn metrics(&self) -> &Arc<SpoolMetrics> {
        &self.metrics
    }

    /// Its directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Its uplink was removed by a reload and its tasks stopped (ADR 0013): the device tokens
    /// it still holds (waiting for a commit, or under `ack = "cloud"` for a record not read
    /// yet), for the caller to complete. The records stay on disk unacknowledged.
    /// From then on an append (one blocked on a full spool included) stores nothing and
    /// completes its token with 0x10 at once, counted in the queue's `uplink_removed`.
    pub fn take_device_tokens(&self) -> Vec<AckToken> {
        self.removed.set(true);
        self.committed.notify_waiters();
        let mut inner = self.inner.borrow_mut();
        let mut out: Vec<AckToken> = inner.commit_waiters.drain(..).map(|(_, t)| t).collect();
        out.extend(std::mem::take(&mut inner.cloud_tokens).into_values());
        out
    }
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
