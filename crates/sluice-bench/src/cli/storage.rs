//! The `storage` study's flags and output.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use super::command_line;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum StorageEngineChoice {
    /// The sluice spool, one per producer thread.
    Spool,
    /// SQLite (bundled) in WAL mode, one writer connection.
    Sqlite,
    /// PostgreSQL in a throwaway cluster (skipped when not installed).
    Postgres,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum DurabilityChoice {
    /// Group commit every --commit-interval, each commit fsynced.
    Interval,
    /// One fsynced commit per producer batch of --batch records.
    Always,
    /// Commit every --commit-interval without fsync.
    Never,
}

#[derive(Args)]
pub(crate) struct StorageArgs {
    /// Total records per point (N, over all threads), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "5000,50000,500000,5000000"
    )]
    records: Vec<u64>,
    /// A smaller sweep: N = 5000,50000,500000 (replaces the default --records).
    #[arg(long)]
    quick: bool,
    /// Producer threads per point (T), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    threads: Vec<usize>,
    /// Record body size in bytes (at least 12).
    #[arg(long, default_value_t = 256)]
    record_bytes: usize,
    /// Engines, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "spool,sqlite,postgres"
    )]
    engines: Vec<StorageEngineChoice>,
    /// When records are made durable.
    #[arg(long, value_enum, default_value = "interval")]
    durability: DurabilityChoice,
    /// The group-commit window (interval, never).
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    commit_interval: Duration,
    /// Records a producer appends (or hands to the writer) at a time; the commit unit of
    /// --durability always.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// The spool's max_batch_bytes: most bytes one commit job carries (a full batch makes the
    /// producer wait for the commit in flight).
    #[arg(long, default_value = "16MiB", value_parser = sluice_bench::scenarios::storage::parse_bytes)]
    spool_batch_bytes: u64,
    /// Skip a point whose predicted append+read time exceeds this; cut one that runs 3× over.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    max_point_time: Duration,
    /// Where the files go (a fresh subdirectory, removed afterwards). Default /var/tmp, or the
    /// current directory when /var/tmp is a tmpfs.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Also write a spool of this size (e.g. 1GiB) and time its recovery (Spool::open).
    #[arg(long, value_name = "SIZE", value_parser = sluice_bench::scenarios::storage::parse_bytes)]
    recovery: Option<u64>,
    /// Skip the engine × N × T study (e.g. with --recovery).
    #[arg(long)]
    no_study: bool,
    /// Before the study, time plain 1 MiB writes of this much to a new file (no fsync, and
    /// with one fsync) on the same file system, for scale; 0 skips it.
    #[arg(long, value_name = "SIZE", default_value = "512MiB", value_parser = sluice_bench::scenarios::storage::parse_bytes)]
    baseline: u64,
    /// Write the JSON report here (e.g. docs/perf/storage.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Write the Markdown report here (e.g. docs/perf/storage.md).
    #[arg(long, value_name = "FILE")]
    md: Option<PathBuf>,
    /// Chart prefix: writes PREFIX-append.png and PREFIX-read.png (default: --out without
    /// its extension; no charts without either).
    #[arg(long, value_name = "PREFIX")]
    charts: Option<PathBuf>,
}

pub(crate) async fn storage(args: StorageArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::storage::{self as st, Durability, Engine, StorageConfig};
    let dir = args.dir.unwrap_or_else(st::default_dir);
    let mut config = StorageConfig::new(dir);
    config.records = if args.quick {
        vec![5_000, 50_000, 500_000]
    } else {
        args.records
    };
    config.threads = args.threads;
    config.record_bytes = args.record_bytes;
    config.engines = args
        .engines
        .iter()
        .map(|e| match e {
            StorageEngineChoice::Spool => Engine::Spool,
            StorageEngineChoice::Sqlite => Engine::Sqlite,
            StorageEngineChoice::Postgres => Engine::Postgres,
        })
        .collect();
    config.commit_interval = args.commit_interval;
    config.durability = match args.durability {
        DurabilityChoice::Interval => Durability::Interval(args.commit_interval),
        DurabilityChoice::Always => Durability::Always,
        DurabilityChoice::Never => Durability::Never,
    };
    config.batch = args.batch;
    config.spool_batch_bytes = args.spool_batch_bytes;
    config.max_point_time = args.max_point_time;
    config.study = !args.no_study;
    config.baseline_bytes = args.baseline;
    config.recovery_bytes = args.recovery;
    config.command_line = command_line();
    let charts = args
        .charts
        .or_else(|| args.out.as_ref().map(|p| p.with_extension("")));
    let files = st::ReportFiles {
        json: args.out,
        markdown: args.md,
        charts,
    };
    let table = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        let report = st::run_storage(&config)?;
        st::write_reports(&report, &files)
    })
    .await
    .context("the storage study thread")??;
    println!("{table}");
    Ok(())
}
