//! State that survives a restart: retained messages and persistent MQTT sessions written to
//! `[state] dir` and restored at start (ADR 0014, `docs/state.md`).
//!
//! Owns: the state directory (`store`: snapshot + change log, crash-consistent), the record
//! format (`record`), the image the files describe (`image`), the writer thread that
//! group-commits changes ([`StateService`]), and the hand-off of what was loaded at start
//! ([`Restored`]). Does not own: the live retained store (`control::retained`, which logs its
//! accepted changes here) or sessions (`edge::mqtt::session`, whose [`Journal`] logs each
//! change of a persistent session; `edge::mqtt::restore` rebuilds them on their shard).
//!
//! Data path: a change is a [`Record`] pushed to one mutex-guarded list ([`StateLog::push`],
//! no I/O, no allocation beyond the record); the writer thread takes the list every
//! `commit_interval`, applies it to its image, appends it to the log and fsyncs once (group
//! commit). Shards never wait for the disk. What a device is told does not wait for it
//! either: a PUBACK means what it meant before (the message is in the spool or at the cloud);
//! its effect on retained messages and on subscribers' queues is on disk within
//! `commit_interval` (a `kill -9` loses at most that window of state changes; the spool
//! keeps what went to the cloud).
//!
//! Invariants: the files always hold a state that existed (see `store`); changes waiting for
//! the writer are bounded by `max_pending` bytes: beyond it a change is dropped, counted,
//! and the next commit writes a whole snapshot from the live image instead of the log, so
//! the file never holds a log with a gap; after `freeze` (shutdown begins) no change is
//! taken, so the sessions a shutdown ends stay on disk for the next start.

pub mod image;
pub mod record;
pub mod store;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use bytestring::ByteString;

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};
pub use image::{Bounds, Image, SessionImage};
pub use record::{MonoMs, Record, StoredMessage};
pub use store::{LoadReport, StateClock, StoreError};

/// Counters of the state writer (`sluice_state_*`).
#[derive(Debug, Default)]
pub struct StateMetrics {
    pub commits: Counter,
    pub commit_micros: Counter,
    pub records: Counter,
    pub bytes_written: Counter,
    pub dropped: Counter,
    pub write_errors: Counter,
    pub compactions: Counter,
    pub pending_bytes: Gauge,
    pub log_bytes: Gauge,
    pub snapshot_bytes: Gauge,
    pub sessions: Gauge,
    pub retained: Gauge,
    pub restored_sessions: Gauge,
    pub restored_retained: Gauge,
    pub load_millis: Gauge,
    pub restore_refused: Counter,
}

impl StateMetrics {
    pub fn render(&self, w: &mut PromWriter) {
        let c = |w: &mut PromWriter, n: &str, h: &str, v: &Counter| w.counter(n, h, &[], v.get());
        let g = |w: &mut PromWriter, n: &str, h: &str, v: &Gauge| w.gauge(n, h, &[], v.get());
        c(
            w,
            "sluice_state_commits_total",
            "State group commits written and fsynced",
            &self.commits,
        );
        w.counter_f64(
            "sluice_state_commit_seconds_total",
            "Time spent writing and fsyncing state commits",
            &[],
            self.commit_micros.get() as f64 / 1e6,
        );
        c(
            w,
            "sluice_state_records_total",
            "State changes written",
            &self.records,
        );
        c(
            w,
            "sluice_state_bytes_written_total",
            "Bytes written to the state directory",
            &self.bytes_written,
        );
        c(
            w,
            "sluice_state_changes_dropped_total",
            "State changes dropped at state.max_pending (the next commit writes a snapshot)",
            &self.dropped,
        );
        c(
            w,
            "sluice_state_write_errors_total",
            "Failed state writes or fsyncs (retried as a snapshot)",
            &self.write_errors,
        );
        c(
            w,
            "sluice_state_compactions_total",
            "State snapshots written",
            &self.compactions,
        );
        c(
            w,
            "sluice_state_restore_refused_total",
            "Restored sessions or messages not taken back at start because of a bound",
            &self.restore_refused,
        );
        g(
            w,
            "sluice_state_pending_bytes",
            "State changes waiting for the writer, bytes charged",
            &self.pending_bytes,
        );
        g(
            w,
            "sluice_state_log_bytes",
            "Size of the state change log",
            &self.log_bytes,
        );
        g(
            w,
            "sluice_state_snapshot_bytes",
            "Size of the last state snapshot",
            &self.snapshot_bytes,
        );
        g(
            w,
            "sluice_state_sessions",
            "Persistent sessions in the state image",
            &self.sessions,
        );
        g(
            w,
            "sluice_state_retained_messages",
            "Retained messages in the state image",
            &self.retained,
        );
        g(
            w,
            "sluice_state_restored_sessions",
            "Persistent sessions restored at start",
            &self.restored_sessions,
        );
        g(
            w,
            "sluice_state_restored_retained_messages",
            "Retained messages restored at start",
            &self.restored_retained,
        );
        w.gauge_f64(
            "sluice_state_load_seconds",
            "Time the state directory took to load at start",
            &[],
            self.load_millis.get() as f64 / 1e3,
        );
    }
}

#[derive(Default)]
struct Pending {
    records: Vec<Record>,
    bytes: usize,
    /// A change was dropped: the next commit writes a snapshot.
    overflowed: bool,
    frozen: bool,
    stop: bool,
}

struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
    clock: StateClock,
    max_pending: usize,
    metrics: Arc<StateMetrics>,
}

/// Where the live stores log their changes (cheap to clone, `Send + Sync`).
#[derive(Clone)]
pub struct StateLog(Arc<Shared>);

impl std::fmt::Debug for StateLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateLog")
    }
}

impl StateLog {
    pub fn clock(&self) -> &StateClock {
        &self.0.clock
    }

    pub fn metrics(&self) -> &StateMetrics {
        &self.0.metrics
    }

    /// Log one change for the next group commit (no I/O).
    pub fn push(&self, record: Record) {
        let cost = record.pending_cost();
        let Ok(mut p) = self.0.pending.lock() else {
            return;
        };
        if p.frozen {
            return;
        }
        if p.bytes + cost > self.0.max_pending {
            let first = !p.overflowed;
            p.overflowed = true;
            drop(p);
            self.0.metrics.dropped.inc();
            if first {
                tracing::warn!(max_pending = self.0.max_pending,
                    "state writer behind by state.max_pending; changes dropped until it catches up with a snapshot");
            }
            return;
        }
        p.bytes += cost;
        p.records.push(record);
        self.0.metrics.pending_bytes.set(p.bytes as i64);
    }

    /// Shutdown begins: take no more changes (what the shutdown itself ends stays on disk).
    pub fn freeze(&self) {
        if let Ok(mut p) = self.0.pending.lock() {
            p.frozen = true;
        }
        self.0.wake.notify_one();
    }
}

/// What the state directory held at start, for the stores to take back.
#[derive(Debug, Default)]
pub struct Restored {
    /// Retained messages (deadlines already on this process's clock).
    pub retained: Vec<StoredMessage>,
    /// Persistent sessions, per shard (`shard::hash::shard_for` of the client id).
    pub sessions: Vec<Vec<(ByteString, SessionImage)>>,
}

/// Why the state could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot start the state writer thread: {0}")]
    Thread(std::io::Error),
}

/// The writer thread and the handle shards log through.
pub struct StateService {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StateService {
    /// Load `[state] dir` and start the writer. `None` without `dir`.
    pub fn open(
        config: &crate::config::Config,
        shards: usize,
        metrics: Arc<StateMetrics>,
    ) -> Result<Option<(StateService, Restored)>, StateError> {
        let Some(dir) = config.state.dir.clone() else {
            return Ok(None);
        };
        let started = Instant::now();
        let clock = StateClock::new();
        let (image, report) = store::load(&dir, Bounds::from_config(config), &clock)?;
        let restored = restored(&image, shards);
        let load_ms = started.elapsed().as_millis() as i64;
        metrics.load_millis.set(load_ms);
        metrics
            .restored_retained
            .set(restored.retained.len() as i64);
        metrics
            .restored_sessions
            .set(restored.sessions.iter().map(Vec::len).sum::<usize>() as i64);
        tracing::info!(dir = %dir.display(), generation = report.generation,
            snapshot_records = report.snapshot_records, log_records = report.log_records,
            bad_records = report.bad_records, torn_bytes = report.torn_bytes,
            bad_files = report.bad_files, retained = image.retained.len(),
            sessions = image.sessions.len(), load_ms, "state loaded");
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            clock,
            max_pending: config.state.max_pending.as_usize(),
            metrics,
        });
        let writer = Writer {
            shared: shared.clone(),
            dir,
            generation: report.generation,
            image,
            interval: config.state.commit_interval,
            max_log: config.state.max_log_size.as_u64(),
            log: None,
            snapshot_len: 0,
            buf: BytesMut::new(),
            last_error_log: None,
        };
        let thread = std::thread::Builder::new()
            .name("sluice-state".into())
            .spawn(move || writer.run())
            .map_err(StateError::Thread)?;
        Ok(Some((
            StateService {
                shared,
                thread: Some(thread),
            },
            restored,
        )))
    }

    pub fn log(&self) -> StateLog {
        StateLog(self.shared.clone())
    }

    /// Write what is pending and stop the writer.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if let Ok(mut p) = self.shared.pending.lock() {
            p.stop = true;
        }
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StateService {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

fn restored(image: &Image, shards: usize) -> Restored {
    let mut sessions: Vec<Vec<(ByteString, SessionImage)>> =
        (0..shards.max(1)).map(|_| Vec::new()).collect();
    for (client, s) in &image.sessions {
        let shard = crate::shard::hash::shard_for(client.as_bytes(), None, shards);
        sessions[shard].push((client.clone(), s.clone()));
    }
    Restored {
        retained: image.retained.values().cloned().collect(),
        sessions,
    }
}

struct Writer {
    shared: Arc<Shared>,
    dir: PathBuf,
    generation: u64,
    image: Image,
    interval: Duration,
    max_log: u64,
    /// `None` until the first snapshot of this process is written, and after a failure.
    log: Option<store::Log>,
    snapshot_len: u64,
    buf: BytesMut,
    last_error_log: Option<Instant>,
}

impl Writer {
    fn run(mut self) {
        // A new generation first: this process's clock in every file from now on.
        self.snapshot();
        loop {
            let (records, overflowed, stop) = {
                let Ok(guard) = self.shared.pending.lock() else {
                    return;
                };
                let Ok((mut p, _)) =
                    self.shared
                        .wake
                        .wait_timeout_while(guard, self.interval, |p| !p.stop)
                else {
                    return;
                };
                let records = std::mem::take(&mut p.records);
                p.bytes = 0;
                let overflowed = std::mem::take(&mut p.overflowed);
                (records, overflowed, p.stop)
            };
            self.shared.metrics.pending_bytes.set(0);
            let n = records.len() as u64;
            if !records.is_empty() || overflowed || self.log.is_none() {
                let started = Instant::now();
                let must_snapshot = overflowed || self.log.is_none();
                if must_snapshot {
                    for r in records {
                        self.image.apply(r);
                    }
                    self.snapshot();
                } else if let Some(log) = self.log.as_mut() {
                    match log.commit(&self.shared.clock, &records, &mut self.buf) {
                        Ok(bytes) => {
                            self.shared.metrics.bytes_written.add(bytes);
                            self.shared.metrics.log_bytes.set(log.len as i64);
                        }
                        Err(error) => self.failed(error),
                    }
                    for r in records {
                        self.image.apply(r);
                    }
                    let too_long = self
                        .log
                        .as_ref()
                        .is_some_and(|l| l.len > self.max_log.max(2 * self.snapshot_len));
                    if too_long {
                        self.snapshot();
                    }
                }
                self.shared.metrics.commits.inc();
                self.shared.metrics.records.add(n);
                self.shared
                    .metrics
                    .commit_micros
                    .add(started.elapsed().as_micros() as u64);
                self.shared
                    .metrics
                    .sessions
                    .set(self.image.sessions.len() as i64);
                self.shared
                    .metrics
                    .retained
                    .set(self.image.retained.len() as i64);
            }
            if stop {
                return;
            }
        }
    }

    /// Write the whole image as the next generation; on failure the next commit tries again.
    fn snapshot(&mut self) {
        let next = self.generation + 1;
        match store::compact(&self.dir, next, &self.image, &self.shared.clock) {
            Ok((log, len)) => {
                self.generation = next;
                self.snapshot_len = len;
                self.shared.metrics.compactions.inc();
                self.shared.metrics.bytes_written.add(len);
                self.shared.metrics.snapshot_bytes.set(len as i64);
                self.shared.metrics.log_bytes.set(log.len as i64);
                self.log = Some(log);
            }
            Err(error) => self.failed(error),
        }
    }

    fn failed(&mut self, error: StoreError) {
        // After a failed write or fsync the log's tail is unknown: rewrite it all next time.
        self.log = None;
        self.shared.metrics.write_errors.inc();
        let due = self
            .last_error_log
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
        if due {
            self.last_error_log = Some(Instant::now());
            tracing::error!(%error, "state write failed; retrying with a snapshot at the next commit");
        }
    }
}
