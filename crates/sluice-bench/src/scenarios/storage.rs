//! The storage study (`sluice-bench storage`): append N records with T producer threads, then
//! read them all back, for the sluice spool, SQLite and (when installed) PostgreSQL, under the
//! same durability policy; plus the recovery time of a large spool.
//!
//! Owns: the workload (record bodies, how N is split over threads), the point sweep and its
//! time cap, verification of what is read back, and the report (JSON, Markdown, PNG charts).
//! Does not own: the engines themselves (`sluice-spool`, SQLite bundled through `rusqlite`, a
//! throwaway PostgreSQL cluster started by [`postgres`]).
//!
//! # Workload
//! A point is (engine, N, T). N is the total: thread `t` of T appends `N / T` records (the first
//! `N % T` threads one more). A record body is `record_bytes` long: bytes `0..4` are the thread
//! index and `4..12` the record's index within its thread (little-endian), the rest a
//! pseudo-random filler fixed per thread, so no engine can compress or deduplicate it. Append
//! time runs from the start of the producers until the last record is durable (the final
//! commit returned). Read time is one thread scanning everything back in storage order and
//! checksumming each body ([`Tally`]); a point is verified when the count and the checksum of
//! what was read equal those of what was appended (recomputed after the timed phases).
//!
//! # Threads
//! - spool: one [`sluice_spool::Spool`] per producer thread, as the gateway has one per shard;
//!   each has its own writer thread that runs the blocking [`sluice_spool::CommitJob`]s
//!   (write + fsync), so appends continue during an fsync, one job in flight per spool. The
//!   files of all spools are on the same file system.
//! - sqlite and postgres: the T producers hand batches of records over a bounded channel to
//!   one writer connection. SQLite admits one writer at a time, so the single writer that
//!   groups everything arriving within a commit window into one transaction is the best
//!   configuration it has (several connections would queue on the write lock and each pay
//!   its own fsync); PostgreSQL gets the same shape, inserting with
//!   `INSERT .. SELECT unnest($1::bytea[])` (one round trip per producer batch).
//!
//! # Durability
//! [`Durability::Interval`] (group commit, the default every 10 ms): records become durable
//! in groups once per window. spool: `FsyncPolicy::Interval`, a commit job every window, each
//! fsyncs its files. SQLite: WAL with `synchronous=FULL` and one transaction per window: in WAL
//! mode FULL fsyncs the WAL at every commit, so each committed transaction survives power loss
//! (NORMAL would fsync only at checkpoints: not durable per group commit). PostgreSQL:
//! `fsync=on`, `synchronous_commit=on`, one transaction per window.
//! [`Durability::Always`]: the same, but one commit per producer batch of `batch` records.
//! [`Durability::Never`]: commits on the window schedule that never fsync (spool
//! `FsyncPolicy::Never`, SQLite `synchronous=OFF`, PostgreSQL `synchronous_commit=off`).
//!
//! # Time cap
//! Before a point runs, its time is predicted from the same engine's previous point at the
//! same T (scaled by N); a point predicted above `max_point_time` is skipped and the table
//! says so. A point that runs past three times the cap stops appending ("cut"), so a run
//! never hangs on a slow engine.

pub mod chart;
pub mod postgres;
pub mod spool;
pub mod sql;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::Serialize;

pub use crate::harness::disk::{default_dir, dir_bytes, file_system, FileSystem};
use crate::harness::machine::{loadavg, machine, Machine};
pub use crate::report::write_json;

mod report;

use report::{fmt_duration, fmt_rate};
pub use report::{markdown, short_count, summary_line, write_reports, ReportFiles};

/// A storage engine under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// sluice's spool, one per producer thread.
    Spool,
    /// SQLite (bundled), WAL, one writer connection.
    Sqlite,
    /// PostgreSQL, a throwaway cluster, one writer connection.
    Postgres,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Spool => "spool",
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgres",
        }
    }
}

/// When appended records are made durable (see the module docs for each engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// One commit per producer batch, each fsynced.
    Always,
    /// Group commit: one commit per window of this length, each fsynced.
    Interval(Duration),
    /// Commits on the window schedule that never fsync.
    Never,
}

impl Durability {
    pub fn describe(&self) -> String {
        match self {
            Durability::Always => "always (one fsynced commit per producer batch)".to_string(),
            Durability::Interval(d) => {
                format!("interval (group commit every {})", fmt_duration(*d))
            }
            Durability::Never => "never (commits without fsync)".to_string(),
        }
    }
}

/// Default bound on the bytes of one spool commit job: `SpoolConfig::default().max_batch_bytes`,
/// what the gateway runs with (see `--spool-batch-bytes`).
pub const DEFAULT_SPOOL_BATCH_BYTES: u64 = 16 << 20;

/// What to run.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// Where the files go; each point gets a fresh subdirectory, removed afterwards.
    pub dir: PathBuf,
    /// Total records per point (N).
    pub records: Vec<u64>,
    /// Producer threads per point (T).
    pub threads: Vec<usize>,
    pub record_bytes: usize,
    pub engines: Vec<Engine>,
    pub durability: Durability,
    /// The commit window for `interval` and `never`.
    pub commit_interval: Duration,
    /// Records a producer hands over (or appends) between looks at the clock; the unit of
    /// `always`.
    pub batch: usize,
    /// The spool's `max_batch_bytes`: bound on the bytes a commit job carries.
    pub spool_batch_bytes: u64,
    pub max_point_time: Duration,
    /// Skip the (engine × N × T) study (e.g. to measure recovery only).
    pub study: bool,
    /// Write a spool of this many bytes and time `Spool::open` on it.
    pub recovery_bytes: Option<u64>,
    /// Drop the page cache (needs root) before the cold open of the recovery measurement.
    pub drop_caches: bool,
    /// Bytes for [`WriteBaseline`] (0: not measured).
    pub baseline_bytes: u64,
    pub command_line: String,
}

impl StorageConfig {
    pub fn new(dir: PathBuf) -> Self {
        StorageConfig {
            dir,
            records: vec![5_000, 50_000, 500_000, 5_000_000],
            threads: vec![1, 2, 4, 8, 16, 32],
            record_bytes: 256,
            engines: vec![Engine::Spool, Engine::Sqlite, Engine::Postgres],
            durability: Durability::Interval(Duration::from_millis(10)),
            commit_interval: Duration::from_millis(10),
            batch: 64,
            spool_batch_bytes: DEFAULT_SPOOL_BATCH_BYTES,
            max_point_time: Duration::from_secs(60),
            study: true,
            recovery_bytes: None,
            drop_caches: true,
            baseline_bytes: 512 << 20,
            command_line: String::new(),
        }
    }
}

/// One point to run, as handed to an engine.
#[derive(Debug, Clone)]
pub struct Point {
    /// A fresh, empty directory for this point's files.
    pub dir: PathBuf,
    pub records: u64,
    pub threads: usize,
    pub record_bytes: usize,
    pub durability: Durability,
    pub commit_interval: Duration,
    pub batch: usize,
    pub spool_batch_bytes: u64,
    /// Producers stop appending at this instant (the point is then "cut").
    pub deadline: Instant,
}

impl Point {
    /// Records thread `t` appends.
    pub fn share(&self, t: usize) -> u64 {
        share(self.records, self.threads, t)
    }
    /// Commit window, or `None` for one commit per batch.
    pub fn window(&self) -> Option<Duration> {
        match self.durability {
            Durability::Always => None,
            Durability::Interval(d) => Some(d),
            Durability::Never => Some(self.commit_interval),
        }
    }
}

/// Records thread `t` of `threads` appends out of `records`.
pub fn share(records: u64, threads: usize, t: usize) -> u64 {
    let threads = threads.max(1) as u64;
    records / threads + u64::from((t as u64) < records % threads)
}

/// What an engine did at one point.
#[derive(Debug, Clone, Default)]
pub struct EngineRun {
    /// Records appended per thread (less than the share when cut at the deadline).
    pub appended: Vec<u64>,
    pub append_time: Duration,
    pub read_time: Duration,
    /// What the read-back scan saw.
    pub read_back: Tally,
    pub commits: u64,
    pub bytes_on_disk: u64,
    /// What `bytes_on_disk` counts.
    pub bytes_note: &'static str,
    /// Time spent in fsync by commit jobs, summed over spools (spool only).
    pub fsync_time: Option<Duration>,
}

/// Count and order-independent checksum of record bodies: the wrapping sum of each body's
/// CRC32C, and of its length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub records: u64,
    pub checksum: u64,
}

impl Tally {
    pub fn add(&mut self, body: &[u8]) {
        self.records += 1;
        self.checksum = self
            .checksum
            .wrapping_add(u64::from(crc32c::crc32c(body)))
            .wrapping_add((body.len() as u64) << 32);
    }
    pub fn merge(&mut self, other: Tally) {
        self.records += other.records;
        self.checksum = self.checksum.wrapping_add(other.checksum);
    }
}

/// Generates the record bodies of one producer thread (see "Workload").
#[derive(Debug, Clone)]
pub struct RecordGen {
    body: Vec<u8>,
}

impl RecordGen {
    pub fn new(thread: usize, record_bytes: usize) -> Self {
        let mut state =
            0x9E37_79B9_7F4A_7C15u64 ^ (thread as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let body = (0..record_bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect::<Vec<u8>>();
        let mut g = RecordGen { body };
        let t = (thread as u32).to_le_bytes();
        let n = g.body.len().min(4);
        g.body[..n].copy_from_slice(&t[..n]);
        g
    }
    /// The body of record `index` of this thread.
    pub fn body(&mut self, index: u64) -> &[u8] {
        let i = index.to_le_bytes();
        let end = self.body.len().min(12);
        if end > 4 {
            self.body[4..end].copy_from_slice(&i[..end - 4]);
        }
        &self.body
    }
    /// The tally of records `0..count` of thread `thread`.
    pub fn expected(thread: usize, record_bytes: usize, count: u64) -> Tally {
        let mut g = RecordGen::new(thread, record_bytes);
        let mut t = Tally::default();
        for i in 0..count {
            t.add(g.body(i));
        }
        t
    }
}

/// How a point ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum PointStatus {
    /// Ran to the end; `verified` says whether the read-back matched.
    Measured,
    /// Ran past three times the cap and stopped appending; figures cover what was appended.
    Cut,
    /// Not run: predicted to take longer than the cap.
    Skipped(String),
    /// The engine failed.
    Failed(String),
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct PointResult {
    pub engine: Engine,
    pub records: u64,
    pub threads: usize,
    pub status: PointStatus,
    pub appended: u64,
    pub append_s: f64,
    pub append_records_per_s: f64,
    pub append_mib_per_s: f64,
    pub read_s: f64,
    pub read_records_per_s: f64,
    pub total_s: f64,
    pub commits: u64,
    /// spool: seconds in fsync, summed over its spools (can exceed the wall time for T > 1).
    pub fsync_s: Option<f64>,
    pub bytes_on_disk: u64,
    pub bytes_note: String,
    /// Read-back count and checksum equal those appended.
    pub verified: bool,
    pub expected: Tally,
    pub read_back: Tally,
    pub loadavg_after: String,
}

impl PointResult {
    fn empty(engine: Engine, records: u64, threads: usize, status: PointStatus) -> Self {
        PointResult {
            engine,
            records,
            threads,
            status,
            appended: 0,
            append_s: 0.0,
            append_records_per_s: 0.0,
            append_mib_per_s: 0.0,
            read_s: 0.0,
            read_records_per_s: 0.0,
            total_s: 0.0,
            commits: 0,
            fsync_s: None,
            bytes_on_disk: 0,
            bytes_note: String::new(),
            verified: false,
            expected: Tally::default(),
            read_back: Tally::default(),
            loadavg_after: loadavg(),
        }
    }
    fn ran(&self) -> bool {
        matches!(self.status, PointStatus::Measured | PointStatus::Cut)
    }
}

/// The spool vs SQLite comparison at one thread count (the target).
#[derive(Debug, Clone, Serialize)]
pub struct Headline {
    pub records: u64,
    pub threads: usize,
    pub spool_append_records_per_s: f64,
    pub sqlite_append_records_per_s: f64,
    pub ratio: f64,
    pub meets_1m: bool,
    pub meets_20x: bool,
}

/// Recovery time of a large spool.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryResult {
    pub target_bytes: u64,
    pub records_written: u64,
    pub record_bytes: usize,
    pub write_s: f64,
    pub write_records_per_s: f64,
    pub spool_bytes: u64,
    /// `echo 3 > /proc/sys/vm/drop_caches` before the cold open: `Ok` or the error.
    pub drop_caches: String,
    pub cold: OpenTiming,
    pub warm: OpenTiming,
    /// The same files read with plain sequential 1 MiB reads, for scale.
    pub plain_read_s: f64,
    /// Whether the page cache was dropped before the plain read.
    pub plain_read_cold: bool,
}

/// One timed `Spool::open` and its `RecoveryReport`.
#[derive(Debug, Clone, Serialize)]
pub struct OpenTiming {
    pub open_s: f64,
    pub segments_scanned: usize,
    pub bytes_scanned: u64,
    pub records_found: u64,
    pub clean: bool,
    pub skipped_ranges: u64,
    pub skipped_bytes: u64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct StorageReport {
    pub machine: Machine,
    pub file_system: FileSystem,
    pub record_bytes: usize,
    pub durability: String,
    pub batch: usize,
    pub max_point_time_s: f64,
    pub engines: Vec<Engine>,
    pub postgres: String,
    pub points: Vec<PointResult>,
    pub headline: Vec<Headline>,
    pub recovery: Option<RecoveryResult>,
    /// Plain file writes on the same file system, for scale (see [`WriteBaseline`]).
    pub baseline: Option<WriteBaseline>,
    pub loadavg_at_end: String,
}

/// What the file system does with plain `write(2)`s of 1 MiB to a new file: the ceiling any
/// engine's appends meet on this machine. Measured before the study.
#[derive(Debug, Clone, Serialize)]
pub struct WriteBaseline {
    pub bytes: u64,
    /// Writing to a new file, no fsync (page cache only).
    pub new_file_mib_per_s: f64,
    /// Overwriting the same, still cached, file in place, no fsync.
    pub overwrite_mib_per_s: f64,
    /// Writing to a new file and one fsync at the end, in total.
    pub new_file_fsync_mib_per_s: f64,
}

/// Measures [`WriteBaseline`] with `bytes` in `dir` (the file is removed).
pub fn write_baseline(dir: &Path, bytes: u64) -> anyhow::Result<WriteBaseline> {
    use std::io::{Seek as _, SeekFrom};
    let chunk = vec![0x5Au8; 1 << 20];
    let chunks = (bytes >> 20).max(1);
    let timed = |f: &mut std::fs::File| -> anyhow::Result<f64> {
        let start = Instant::now();
        for _ in 0..chunks {
            f.write_all(&chunk)?;
        }
        Ok(start.elapsed().as_secs_f64())
    };
    let mib = chunks as f64;
    let path = dir.join("baseline.tmp");
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let new_s = timed(&mut f)?;
    f.seek(SeekFrom::Start(0))?;
    let over_s = timed(&mut f)?;
    drop(f);
    std::fs::remove_file(&path)?;
    let mut f = std::fs::File::create(&path)?;
    let start = Instant::now();
    timed(&mut f)?;
    f.sync_all()?;
    let sync_s = start.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(WriteBaseline {
        bytes: chunks << 20,
        new_file_mib_per_s: mib / new_s.max(1e-9),
        overwrite_mib_per_s: mib / over_s.max(1e-9),
        new_file_fsync_mib_per_s: mib / sync_s.max(1e-9),
    })
}

/// Runs the study (and the recovery measurement when asked) and returns the report.
/// Progress goes to stderr.
pub fn run_storage(config: &StorageConfig) -> anyhow::Result<StorageReport> {
    if config.record_bytes < 12 {
        bail!("--record-bytes must be at least 12 (thread and record index)");
    }
    if config.batch == 0 {
        bail!("--batch must be at least 1");
    }
    std::fs::create_dir_all(&config.dir)
        .with_context(|| format!("creating {}", config.dir.display()))?;
    let run_dir = tempfile::Builder::new()
        .prefix("sluice-storage-")
        .tempdir_in(&config.dir)
        .with_context(|| format!("creating a run directory in {}", config.dir.display()))?;
    let mut report = StorageReport {
        machine: machine(&config.command_line),
        file_system: file_system(run_dir.path()),
        record_bytes: config.record_bytes,
        durability: config.durability.describe(),
        batch: config.batch,
        max_point_time_s: config.max_point_time.as_secs_f64(),
        engines: config.engines.clone(),
        postgres: "not requested".to_string(),
        points: Vec::new(),
        headline: Vec::new(),
        recovery: None,
        baseline: None,
        loadavg_at_end: String::new(),
    };
    eprintln!(
        "storage: files in {} ({} on {}, mounted at {})",
        run_dir.path().display(),
        report.file_system.fs_type,
        report.file_system.device,
        report.file_system.mount_point
    );
    if config.baseline_bytes > 0 {
        let b = write_baseline(run_dir.path(), config.baseline_bytes)?;
        eprintln!(
            "storage: plain 1 MiB writes of {} MiB: new file {:.0} MiB/s, overwrite cached {:.0} MiB/s, new file + fsync {:.0} MiB/s",
            b.bytes >> 20,
            b.new_file_mib_per_s,
            b.overwrite_mib_per_s,
            b.new_file_fsync_mib_per_s
        );
        report.baseline = Some(b);
    }
    if config.study {
        let mut cluster = None;
        if config.engines.contains(&Engine::Postgres) {
            match postgres::Cluster::start(run_dir.path()) {
                Ok(Some(c)) => {
                    report.postgres = c.version.clone();
                    cluster = Some(c);
                }
                Ok(None) => report.postgres = postgres::NOT_INSTALLED.to_string(),
                Err(e) => report.postgres = format!("failed to start: {e:#}"),
            }
            eprintln!("storage: PostgreSQL: {}", report.postgres);
        }
        let mut records = config.records.clone();
        records.sort_unstable();
        for &engine in &config.engines {
            for &threads in &config.threads {
                let mut last: Option<(u64, f64)> = None;
                for &n in &records {
                    let result = run_point(
                        config,
                        run_dir.path(),
                        engine,
                        n,
                        threads,
                        last,
                        cluster.as_ref(),
                    );
                    if result.ran() && result.total_s > 0.0 {
                        last = Some((result.appended.max(1), result.total_s));
                    }
                    eprintln!("storage: {}", summary_line(&result));
                    report.points.push(result);
                }
            }
        }
        if let Some(c) = cluster.take() {
            c.stop();
        }
        report.headline = headline(&report.points);
    }
    if let Some(bytes) = config.recovery_bytes {
        let dir = run_dir.path().join("recovery");
        let r = spool::measure_recovery(
            &dir,
            bytes,
            config.record_bytes,
            config.commit_interval,
            config.spool_batch_bytes,
            config.drop_caches,
        )?;
        eprintln!(
            "storage: recovery of {:.2} GiB ({} records): cold open {:.3} s (drop_caches: {}), warm open {:.3} s",
            r.spool_bytes as f64 / GIB,
            r.records_written,
            r.cold.open_s,
            r.drop_caches,
            r.warm.open_s
        );
        report.recovery = Some(r);
        let _ = std::fs::remove_dir_all(&dir);
    }
    report.loadavg_at_end = loadavg();
    Ok(report)
}

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

fn run_point(
    config: &StorageConfig,
    run_dir: &Path,
    engine: Engine,
    records: u64,
    threads: usize,
    last: Option<(u64, f64)>,
    cluster: Option<&postgres::Cluster>,
) -> PointResult {
    let cap = config.max_point_time.as_secs_f64();
    if let Some((n, secs)) = last {
        let predicted = secs * records as f64 / n as f64;
        if predicted > cap {
            return PointResult::empty(
                engine,
                records,
                threads,
                PointStatus::Skipped(format!(
                    "predicted {predicted:.0} s > --max-point-time {cap:.0} s"
                )),
            );
        }
    }
    let dir = run_dir.join(format!("{}-{records}-{threads}", engine.name()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return PointResult::empty(
            engine,
            records,
            threads,
            PointStatus::Failed(format!("creating {}: {e}", dir.display())),
        );
    }
    let point = Point {
        dir: dir.clone(),
        records,
        threads,
        record_bytes: config.record_bytes,
        durability: config.durability,
        commit_interval: config.commit_interval,
        batch: config.batch,
        spool_batch_bytes: config.spool_batch_bytes,
        deadline: Instant::now() + config.max_point_time * 3,
    };
    let outcome = match engine {
        Engine::Spool => spool::run(&point),
        Engine::Sqlite => sql::run_sqlite(&point),
        Engine::Postgres => match cluster {
            Some(c) => sql::run_postgres(&point, c),
            None => Err(anyhow::anyhow!("PostgreSQL is not available")),
        },
    };
    let _ = std::fs::remove_dir_all(&dir);
    let run = match outcome {
        Ok(run) => run,
        Err(e) => {
            return PointResult::empty(
                engine,
                records,
                threads,
                PointStatus::Failed(format!("{e:#}")),
            )
        }
    };
    let mut expected = Tally::default();
    for (t, &n) in run.appended.iter().enumerate() {
        expected.merge(RecordGen::expected(t, config.record_bytes, n));
    }
    let appended: u64 = run.appended.iter().sum();
    let append_s = run.append_time.as_secs_f64();
    let read_s = run.read_time.as_secs_f64();
    let frame_mib = appended as f64 * config.record_bytes as f64 / MIB;
    PointResult {
        engine,
        records,
        threads,
        status: if appended < records {
            PointStatus::Cut
        } else {
            PointStatus::Measured
        },
        appended,
        append_s,
        append_records_per_s: rate(appended, append_s),
        append_mib_per_s: if append_s > 0.0 {
            frame_mib / append_s
        } else {
            0.0
        },
        read_s,
        read_records_per_s: rate(run.read_back.records, read_s),
        total_s: append_s + read_s,
        commits: run.commits,
        fsync_s: run.fsync_time.map(|d| d.as_secs_f64()),
        bytes_on_disk: run.bytes_on_disk,
        bytes_note: run.bytes_note.to_string(),
        verified: run.read_back == expected,
        expected,
        read_back: run.read_back,
        loadavg_after: loadavg(),
    }
}

fn rate(n: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// spool vs SQLite append rate at each thread count, at the largest N both measured in full.
pub fn headline(points: &[PointResult]) -> Vec<Headline> {
    let measured = |e: Engine, n: u64, t: usize| {
        points.iter().find(|p| {
            p.engine == e
                && p.records == n
                && p.threads == t
                && p.status == PointStatus::Measured
                && p.verified
        })
    };
    let mut threads: Vec<usize> = points.iter().map(|p| p.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    let mut out = Vec::new();
    for t in threads {
        let mut ns: Vec<u64> = points
            .iter()
            .filter(|p| p.threads == t)
            .map(|p| p.records)
            .collect();
        ns.sort_unstable();
        ns.dedup();
        let pair = ns.iter().rev().find_map(|&n| {
            Some((
                n,
                measured(Engine::Spool, n, t)?,
                measured(Engine::Sqlite, n, t)?,
            ))
        });
        if let Some((n, s, q)) = pair {
            let ratio = if q.append_records_per_s > 0.0 {
                s.append_records_per_s / q.append_records_per_s
            } else {
                0.0
            };
            out.push(Headline {
                records: n,
                threads: t,
                spool_append_records_per_s: s.append_records_per_s,
                sqlite_append_records_per_s: q.append_records_per_s,
                ratio,
                meets_1m: s.append_records_per_s >= 1e6,
                meets_20x: ratio >= 20.0,
            });
        }
    }
    out
}

/// Parses a byte size: a number with an optional unit B, KiB, MiB, GiB (or K, M, G, also
/// KB/MB/GB, all binary).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 1GiB or 512MiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KiB, MiB or GiB)"
            ))
        }
    };
    Ok((num * mult as f64).round() as u64)
}

#[cfg(test)]
mod tests;
