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

use crate::harness::machine::{loadavg, machine, Machine};
pub use crate::report::write_json;

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

/// Where the files were.
#[derive(Debug, Clone, Serialize)]
pub struct FileSystem {
    pub dir: String,
    pub fs_type: String,
    pub mount_point: String,
    pub device: String,
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

/// The file system holding `dir`, from `/proc/self/mountinfo` (longest matching mount point).
pub fn file_system(dir: &Path) -> FileSystem {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut best: Option<(String, String, String)> = None;
    if let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") {
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let Some(sep) = fields.iter().position(|f| *f == "-") else {
                continue;
            };
            let (Some(mount), Some(fs_type), Some(device)) =
                (fields.get(4), fields.get(sep + 1), fields.get(sep + 2))
            else {
                continue;
            };
            let mount = mount.replace("\\040", " ");
            if dir.starts_with(&mount) && best.as_ref().is_none_or(|b| mount.len() >= b.0.len()) {
                best = Some((mount, fs_type.to_string(), device.to_string()));
            }
        }
    }
    let (mount_point, fs_type, device) =
        best.unwrap_or_else(|| ("?".into(), "unknown".into(), "?".into()));
    FileSystem {
        dir: dir.display().to_string(),
        fs_type,
        mount_point,
        device,
    }
}

/// Apparent size of all files under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
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

fn fmt_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_secs_f64() * 1e3)
    }
}

fn status_text(p: &PointResult) -> String {
    match &p.status {
        PointStatus::Measured if p.verified => "ok".to_string(),
        PointStatus::Measured => "READ-BACK MISMATCH".to_string(),
        PointStatus::Cut => format!(
            "cut at {} of {} records{}",
            p.appended,
            p.records,
            if p.verified { "" } else { ", MISMATCH" }
        ),
        PointStatus::Skipped(why) => format!("skipped: {why}"),
        PointStatus::Failed(why) => format!("failed: {why}"),
    }
}

fn commits_text(p: &PointResult) -> String {
    match p.fsync_s {
        Some(f) => format!("{} ({f:.2})", p.commits),
        None => p.commits.to_string(),
    }
}

/// One progress line.
pub fn summary_line(p: &PointResult) -> String {
    format!(
        "{} N={} T={}: append {:.0} rec/s ({:.3} s, {} commits), read {:.0} rec/s ({:.3} s), {:.1} MiB on disk; {}",
        p.engine.name(),
        p.records,
        p.threads,
        p.append_records_per_s,
        p.append_s,
        commits_text(p),
        p.read_records_per_s,
        p.read_s,
        p.bytes_on_disk as f64 / MIB,
        status_text(p)
    )
}

/// `5000` → `5K`, `5000000` → `5M`.
pub fn short_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}K", n / 1_000),
        n => n.to_string(),
    }
}

fn fmt_rate(r: f64) -> String {
    if r <= 0.0 {
        "–".to_string()
    } else if r >= 1e6 {
        format!("{:.2} M", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1} K", r / 1e3)
    } else {
        format!("{r:.0}")
    }
}

/// The Markdown report.
pub fn markdown(r: &StorageReport) -> String {
    let m = &r.machine;
    let mut s = String::new();
    let _ = writeln!(s, "# Storage study: sluice spool vs SQLite vs PostgreSQL\n");
    let _ = writeln!(
        s,
        "- commit `{}`{}; started {}\n- machine: {} × {}, kernel {}\n- files: `{}` — {} on `{}` (mounted at `{}`)\n\
         - load average at start `{}`, at end `{}`\n- command: `{}`",
        m.commit,
        if m.worktree_dirty { " (work tree had uncommitted changes)" } else { "" },
        m.started_at,
        m.nproc,
        m.cpu_model,
        m.kernel,
        r.file_system.dir,
        r.file_system.fs_type,
        r.file_system.device,
        r.file_system.mount_point,
        m.loadavg_at_start,
        r.loadavg_at_end,
        m.command_line
    );
    let _ = writeln!(
        s,
        "- records of {} B; durability: {}; producer batch {} records; cap per point {:.0} s\n- PostgreSQL: {}\n",
        r.record_bytes, r.durability, r.batch, r.max_point_time_s, r.postgres
    );
    if !r.headline.is_empty() {
        let _ = writeln!(
            s,
            "## Spool append vs SQLite, {} B records, {}\n",
            r.record_bytes, r.durability
        );
        let _ = writeln!(
            s,
            "Target: spool ≥ 1M records/s and ≥ 20× SQLite in the same run.\n"
        );
        let _ = writeln!(
            s,
            "| threads | N | spool append rec/s | SQLite append rec/s | ratio | ≥ 1M/s | ≥ 20× |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|:---:|:---:|");
        for h in &r.headline {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.0} | {:.1}× | {} | {} |",
                h.threads,
                short_count(h.records),
                h.spool_append_records_per_s,
                h.sqlite_append_records_per_s,
                h.ratio,
                if h.meets_1m { "yes" } else { "no" },
                if h.meets_20x { "yes" } else { "no" }
            );
        }
        s.push('\n');
    }
    if !r.points.is_empty() {
        let _ = writeln!(s, "## The storage-study table\n");
        let _ = writeln!(
            s,
            "| engine | N | threads | append rec/s | read rec/s | append s | read s | total s | commits (fsync s) | on disk MiB | load after | result |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for p in &r.points {
            if p.ran() {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {:.1} | {} | {} |",
                    p.engine.name(),
                    short_count(p.records),
                    p.threads,
                    fmt_rate(p.append_records_per_s),
                    fmt_rate(p.read_records_per_s),
                    p.append_s,
                    p.read_s,
                    p.total_s,
                    commits_text(p),
                    p.bytes_on_disk as f64 / MIB,
                    p.loadavg_after.split(' ').next().unwrap_or(""),
                    status_text(p)
                );
            } else {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | | | | | | | | | {} |",
                    p.engine.name(),
                    short_count(p.records),
                    p.threads,
                    status_text(p)
                );
            }
        }
        let notes: Vec<String> = {
            let mut v: Vec<String> = r
                .points
                .iter()
                .filter(|p| p.ran())
                .map(|p| format!("{}: {}", p.engine.name(), p.bytes_note))
                .collect();
            v.sort();
            v.dedup();
            v
        };
        let _ = writeln!(s, "\nOn disk: {}.\n", notes.join("; "));
    }
    if let Some(rec) = &r.recovery {
        let _ = writeln!(
            s,
            "## Recovery time of a {:.2} GiB spool\n",
            rec.spool_bytes as f64 / GIB
        );
        let _ = writeln!(
            s,
            "Written first: {} records of {} B in {:.2} s ({:.0} records/s, group commit). \
             Then `Spool::open` timed twice. Page cache dropped before the cold open: {}.\n",
            rec.records_written,
            rec.record_bytes,
            rec.write_s,
            rec.write_records_per_s,
            rec.drop_caches
        );
        let _ = writeln!(
            s,
            "| open | time s | segments | bytes scanned | records found | clean | skipped ranges |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|:---:|---:|");
        for (name, o) in [("cold", &rec.cold), ("warm", &rec.warm)] {
            let _ = writeln!(
                s,
                "| {name} | {:.3} | {} | {} | {} | {} | {} |",
                o.open_s,
                o.segments_scanned,
                o.bytes_scanned,
                o.records_found,
                o.clean,
                o.skipped_ranges
            );
        }
        let _ = writeln!(
            s,
            "\nFor scale: reading the same {:.2} GiB with plain sequential 1 MiB reads ({}) took {:.3} s \
             ({:.0} MiB/s).",
            rec.spool_bytes as f64 / GIB,
            if rec.plain_read_cold { "page cache dropped first" } else { "page cache as it was" },
            rec.plain_read_s,
            rec.spool_bytes as f64 / MIB / rec.plain_read_s.max(1e-9)
        );
        let _ = writeln!(
            s,
            "\nTarget < 2 s: cold {}, warm {}.\n",
            if rec.cold.open_s < 2.0 {
                "met"
            } else {
                "NOT met"
            },
            if rec.warm.open_s < 2.0 {
                "met"
            } else {
                "NOT met"
            }
        );
    }
    if let Some(b) = &r.baseline {
        let frame = (r.record_bytes + 16) as f64;
        let _ = writeln!(s, "## Plain writes on the same file system, for scale\n");
        let _ = writeln!(
            s,
            "`write(2)` of 1 MiB chunks, {} MiB in all: to a new file {:.0} MiB/s (≈ {:.2} M records/s \
             of {} B framed as {} B); overwriting the same cached file {:.0} MiB/s; to a new file plus \
             one fsync {:.0} MiB/s (≈ {:.2} M records/s).\n",
            b.bytes >> 20,
            b.new_file_mib_per_s,
            b.new_file_mib_per_s * MIB / frame / 1e6,
            r.record_bytes,
            frame,
            b.overwrite_mib_per_s,
            b.new_file_fsync_mib_per_s,
            b.new_file_fsync_mib_per_s * MIB / frame / 1e6
        );
    }
    let _ = writeln!(s, "## How to read it\n");
    let _ = writeln!(
        s,
        "- N is the total number of records of a point, split evenly over T producer threads. \
         *append rec/s* is N over the time from the first append to the return of the last commit \
         (every record durable under the policy above); *read rec/s* is one thread scanning \
         everything back in storage order, checksumming each body. *result* `ok` means the count \
         and an order-independent checksum of what was read equal those of what was appended.\n\
         - spool: one spool per producer thread (the gateway's one spool per shard), each with a \
         writer thread running its commit jobs (write + fsync) while appends go on; a commit \
         carries at most the spool's `max_batch_bytes`. SQLite: WAL, `synchronous=FULL`, one \
         writer connection fed by the producers over a bounded channel, one transaction per commit \
         window — the best SQLite can do, since it admits one writer at a time. PostgreSQL: \
         default server settings (`fsync=on`, `synchronous_commit=on`), one writer connection, \
         one `INSERT … SELECT unnest($1::bytea[])` per producer batch, one transaction per window.\n\
         - *commits* counts transactions (SQL) or commit jobs (spool, summed over spools; in \
         brackets the seconds its commit jobs spent in fsync, summed over spools). A commit \
         that takes longer than the window delays the next one, so slow storage shows as fewer, \
         larger commits rather than a missed window.\n\
         - Skipped points were predicted (from the same engine and T at a smaller N) to exceed \
         the per-point cap; *cut* points ran three times over it and stopped appending.\n\
         - Small points (5K records take a few milliseconds) measure mostly the latency of one or \
         two commits and thread start-up; the larger N, the more a figure says about throughput.\n"
    );
    let _ = writeln!(s, "## Caveats\n");
    let _ = writeln!(
        s,
        "- A shared machine: other work ran alongside (see the load averages per point and at \
         start and end); compare figures within one run, as ratios, rather than across runs.\n\
         - A virtual disk on a virtual machine: fsync latency and bandwidth are the host's, and \
         writing *new* page-cache pages costs far more than on bare metal (see \
         \"Plain writes\" above): appends of new data cannot outrun that figure, whatever the engine.\n\
         - Reads ran right after the appends, from the page cache; they measure the engines' read \
         paths, not the disk.\n\
         - Bytes on disk count different things per engine (see the line under the table).\n"
    );
    s
}

/// Where the report goes.
#[derive(Debug, Clone, Default)]
pub struct ReportFiles {
    pub json: Option<PathBuf>,
    pub markdown: Option<PathBuf>,
    /// Prefix of `{prefix}-append.png` and `{prefix}-read.png`.
    pub charts: Option<PathBuf>,
}

/// Writes the JSON, Markdown and charts named in `files` (each optional); returns the
/// Markdown.
pub fn write_reports(report: &StorageReport, files: &ReportFiles) -> anyhow::Result<String> {
    let md = markdown(report);
    if let Some(path) = &files.json {
        write_json(report, path)?;
        eprintln!("storage: JSON written to {}", path.display());
    }
    if let Some(path) = &files.markdown {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("storage: Markdown written to {}", path.display());
    }
    if let Some(prefix) = files.charts.as_ref().filter(|_| !report.points.is_empty()) {
        for (metric, suffix) in [
            (chart::Metric::Append, "append"),
            (chart::Metric::Read, "read"),
        ] {
            let path = PathBuf::from(format!("{}-{suffix}.png", prefix.display()));
            chart::write_png(
                &report.points,
                metric,
                report.record_bytes,
                &report.durability,
                &path,
            )?;
            eprintln!("storage: chart written to {}", path.display());
        }
    }
    Ok(md)
}

/// `/var/tmp` (kept on disk across reboots, so not a tmpfs on usual systems), or the current
/// directory when `/var/tmp` is a tmpfs or missing.
pub fn default_dir() -> PathBuf {
    let var_tmp = PathBuf::from("/var/tmp");
    if var_tmp.is_dir() && file_system(&var_tmp).fs_type != "tmpfs" {
        var_tmp
    } else {
        PathBuf::from(".")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_split_over_threads_without_loss() {
        for (n, t) in [(5000u64, 1usize), (5000, 3), (7, 32), (5_000_000, 32)] {
            let total: u64 = (0..t).map(|i| share(n, t, i)).sum();
            assert_eq!(total, n, "N={n} T={t}");
        }
        assert_eq!(share(10, 4, 0), 3);
        assert_eq!(share(10, 4, 3), 2);
    }

    #[test]
    fn tally_is_order_independent_and_sees_changed_bytes() {
        let mut g = RecordGen::new(2, 64);
        let bodies: Vec<Vec<u8>> = (0..10).map(|i| g.body(i).to_vec()).collect();
        let mut forward = Tally::default();
        bodies.iter().for_each(|b| forward.add(b));
        let mut backward = Tally::default();
        bodies.iter().rev().for_each(|b| backward.add(b));
        assert_eq!(forward, backward);
        assert_eq!(forward, RecordGen::expected(2, 64, 10));
        let mut changed = bodies.clone();
        changed[3][40] ^= 1;
        let mut damaged = Tally::default();
        changed.iter().for_each(|b| damaged.add(b));
        assert_ne!(damaged, forward);
    }

    #[test]
    fn record_bodies_carry_thread_and_index() {
        let mut g = RecordGen::new(7, 256);
        let b = g.body(0x0102_0304_0506).to_vec();
        assert_eq!(b.len(), 256);
        assert_eq!(&b[0..4], &7u32.to_le_bytes());
        assert_eq!(&b[4..12], &0x0102_0304_0506u64.to_le_bytes());
        assert_ne!(
            RecordGen::new(8, 256).body(0),
            RecordGen::new(7, 256).body(0)
        );
    }

    #[test]
    fn byte_sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("0.5 GiB"), Ok(1 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("1 parsec").is_err());
        assert!(parse_bytes("GiB").is_err());
    }

    fn point(engine: Engine, n: u64, t: usize, rate: f64, verified: bool) -> PointResult {
        let mut p = PointResult::empty(engine, n, t, PointStatus::Measured);
        p.append_records_per_s = rate;
        p.verified = verified;
        p
    }

    #[test]
    fn headline_compares_at_the_largest_n_both_engines_measured() {
        let points = vec![
            point(Engine::Spool, 5000, 1, 1.5e6, true),
            point(Engine::Sqlite, 5000, 1, 5e4, true),
            point(Engine::Spool, 50_000, 1, 2e6, true),
            point(Engine::Sqlite, 50_000, 1, 1e5, true),
            point(Engine::Spool, 500_000, 1, 2e6, true),
            PointResult::empty(
                Engine::Sqlite,
                500_000,
                1,
                PointStatus::Skipped("slow".into()),
            ),
            point(Engine::Spool, 5000, 8, 8e5, true),
            point(Engine::Sqlite, 5000, 8, 1e5, false),
        ];
        let h = headline(&points);
        assert_eq!(h.len(), 1, "T=8 has no verified SQLite point");
        assert_eq!((h[0].records, h[0].threads), (50_000, 1));
        assert!((h[0].ratio - 20.0).abs() < 1e-9);
        assert!(h[0].meets_1m && h[0].meets_20x);
    }

    #[test]
    fn counts_print_short() {
        assert_eq!(short_count(5000), "5K");
        assert_eq!(short_count(5_000_000), "5M");
        assert_eq!(short_count(1234), "1234");
    }
}
