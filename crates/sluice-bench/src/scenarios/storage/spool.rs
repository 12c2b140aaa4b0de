//! The spool engine of the storage study: T producer threads, each owning one
//! [`Spool`] (as a shard does) with its own writer thread for the blocking half of group
//! commit; and the recovery-time measurement of a large spool.
//!
//! The append loop is the one of `crates/sluice-spool/examples/append_rate.rs` (group commit
//! on a writer thread, one job in flight, `BatchFull` forces a commit), extended with the
//! `always` schedule and a deadline.

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use sluice_spool::{
    CommitJob, CommitOutcome, FsyncPolicy, RecoveryReport, Spool, SpoolConfig, SpoolError,
    SpoolRecord,
};

use super::{
    dir_bytes, Durability, EngineRun, OpenTiming, Point, RecordGen, RecoveryResult, Tally,
};

/// Spool configuration for the study: no size bound in the way; `batch_bytes` bounds the
/// uncommitted batch (when it is full the producer waits for the commit in flight and starts
/// the next one). (`Never` still commits on the window schedule: it lives in [`append`].)
pub fn config(durability: Durability, batch_bytes: u64) -> SpoolConfig {
    SpoolConfig {
        max_bytes: 1 << 40,
        max_batch_bytes: batch_bytes,
        fsync: match durability {
            Durability::Always => FsyncPolicy::Always,
            Durability::Interval(d) => FsyncPolicy::Interval(d),
            Durability::Never => FsyncPolicy::Never,
        },
        ..SpoolConfig::default()
    }
}

/// Runs one point: T spools in `point.dir/{t}`, appended by T threads, then read back by one.
pub fn run(point: &Point) -> anyhow::Result<EngineRun> {
    let cfg = config(point.durability, point.spool_batch_bytes);
    let start = Instant::now();
    let handles: Vec<_> = (0..point.threads)
        .map(|t| {
            let dir = point.dir.join(t.to_string());
            let cfg = cfg.clone();
            let p = point.clone();
            std::thread::Builder::new()
                .name(format!("spool-{t}"))
                .spawn(move || -> anyhow::Result<(Spool, u64)> {
                    let (mut spool, _) = Spool::open(&dir, cfg)
                        .with_context(|| format!("opening {}", dir.display()))?;
                    let n = append(
                        &mut spool,
                        t,
                        p.share(t),
                        p.record_bytes,
                        p.window(),
                        p.batch,
                        p.deadline,
                    )?;
                    Ok((spool, n))
                })
                .context("spawning a producer thread")
        })
        .collect::<anyhow::Result<_>>()?;
    let mut spools = Vec::with_capacity(handles.len());
    for h in handles {
        spools.push(
            h.join()
                .map_err(|_| anyhow!("a spool producer thread panicked"))??,
        );
    }
    let append_time = start.elapsed();
    let bytes_on_disk = dir_bytes(&point.dir);

    let start = Instant::now();
    let mut read_back = Tally::default();
    let mut out: Vec<SpoolRecord> = Vec::with_capacity(4096);
    for (spool, _) in &mut spools {
        let mut cur = spool.read_cursor();
        loop {
            out.clear();
            if spool.read(&mut cur, 4096, 4 << 20, &mut out)? == 0 {
                break;
            }
            for r in &out {
                read_back.add(&r.body);
            }
        }
    }
    let read_time = start.elapsed();
    Ok(EngineRun {
        appended: spools.iter().map(|(_, n)| *n).collect(),
        append_time,
        read_time,
        read_back,
        commits: spools.iter().map(|(s, _)| s.counters().commits).sum(),
        bytes_on_disk,
        bytes_note: "segment files (8 B header, 16 B frame header per record)",
        fsync_time: Some(Duration::from_nanos(
            spools
                .iter()
                .map(|(s, _)| s.counters().fsync_nanos_total)
                .sum(),
        )),
    })
}

/// Appends records `0..count` of thread `thread` to `spool` and commits them: every `window`
/// (group commit) or after every `batch` records (`None`), the blocking half on a writer
/// thread. Returns how many were appended (fewer when `deadline` passed) — all durable.
pub fn append(
    spool: &mut Spool,
    thread: usize,
    count: u64,
    record_bytes: usize,
    window: Option<Duration>,
    batch: usize,
    deadline: Instant,
) -> anyhow::Result<u64> {
    let (job_tx, job_rx) = mpsc::sync_channel::<CommitJob>(1);
    let (done_tx, done_rx) = mpsc::sync_channel::<CommitOutcome>(1);
    let writer = std::thread::Builder::new()
        .name(format!("spool-writer-{thread}"))
        .spawn(move || {
            for job in job_rx {
                if done_tx.send(job.run()).is_err() {
                    break;
                }
            }
        })
        .context("spawning a writer thread")?;
    let mut gen = RecordGen::new(thread, record_bytes);
    let mut in_flight = false;
    let mut next_commit = Instant::now() + window.unwrap_or_default();
    let mut i = 0u64;
    let result = (|| -> anyhow::Result<()> {
        while i < count {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let end = (i + batch as u64).min(count);
            while i < end {
                match spool.append(gen.body(i)) {
                    Ok(_) => i += 1,
                    Err(SpoolError::BatchFull { .. }) => {
                        if in_flight {
                            spool.finish_commit(done_rx.recv()?)?;
                        }
                        in_flight = submit(spool, &job_tx)?;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if in_flight {
                if let Ok(outcome) = done_rx.try_recv() {
                    spool.finish_commit(outcome)?;
                    in_flight = false;
                }
            }
            match window {
                None => {
                    if in_flight {
                        spool.finish_commit(done_rx.recv()?)?;
                    }
                    in_flight = submit(spool, &job_tx)?;
                }
                Some(w) if !in_flight && now >= next_commit => {
                    in_flight = submit(spool, &job_tx)?;
                    next_commit = now + w;
                }
                Some(_) => {}
            }
        }
        if in_flight {
            spool.finish_commit(done_rx.recv()?)?;
            in_flight = false;
        }
        if submit(spool, &job_tx)? {
            spool.finish_commit(done_rx.recv()?)?;
        }
        Ok(())
    })();
    drop(job_tx);
    writer
        .join()
        .map_err(|_| anyhow!("a spool writer thread panicked"))?;
    result?;
    Ok(i)
}

/// Hands the uncommitted batch to the writer; false when there was nothing to commit.
fn submit(spool: &mut Spool, job_tx: &mpsc::SyncSender<CommitJob>) -> anyhow::Result<bool> {
    match spool.begin_commit()? {
        Some(job) => {
            job_tx
                .send(job)
                .map_err(|_| anyhow!("the spool writer thread stopped"))?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Writes a spool of about `bytes` bytes into `dir` (one producer, group commit every
/// `window`), then times `Spool::open` on it cold (after dropping the page cache when
/// `drop_caches` and allowed) and warm.
pub fn measure_recovery(
    dir: &Path,
    bytes: u64,
    record_bytes: usize,
    window: Duration,
    batch_bytes: u64,
    drop_caches: bool,
) -> anyhow::Result<RecoveryResult> {
    let frame = (record_bytes + sluice_spool::FRAME_HEADER_LEN) as u64;
    let records = bytes / frame;
    let cfg = config(Durability::Interval(window), batch_bytes);
    let start = Instant::now();
    let (written, spool_bytes) = {
        let (mut spool, _) =
            Spool::open(dir, cfg.clone()).with_context(|| format!("opening {}", dir.display()))?;
        let n = append(
            &mut spool,
            0,
            records,
            record_bytes,
            Some(window),
            64,
            Instant::now() + Duration::from_secs(3600),
        )?;
        (n, spool.total_bytes())
    };
    let write_s = start.elapsed().as_secs_f64();
    eprintln!("storage: wrote {written} records ({spool_bytes} bytes) for the recovery measurement in {write_s:.2} s");
    let dropped = if drop_caches {
        drop_page_cache()
    } else {
        "not asked".to_string()
    };
    let cold = timed_open(dir, &cfg)?;
    let warm = timed_open(dir, &cfg)?;
    // For scale: the same files read sequentially with plain 1 MiB reads, cold when allowed.
    let plain_read_cold = drop_caches && drop_page_cache() == "ok";
    let plain_read_s = read_all_files(dir)?;
    Ok(RecoveryResult {
        target_bytes: bytes,
        records_written: written,
        record_bytes,
        write_s,
        write_records_per_s: written as f64 / write_s.max(1e-9),
        spool_bytes,
        drop_caches: dropped,
        cold,
        warm,
        plain_read_s,
        plain_read_cold,
    })
}

/// Reads every file directly in `dir` with 1 MiB reads; returns the seconds taken.
fn read_all_files(dir: &Path) -> anyhow::Result<f64> {
    use std::io::Read as _;
    let mut buf = vec![0u8; 1 << 20];
    let start = Instant::now();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if !entry.file_type()?.is_file() {
            continue;
        }
        let mut f = std::fs::File::open(entry.path())?;
        while f.read(&mut buf)? > 0 {}
    }
    Ok(start.elapsed().as_secs_f64())
}

fn timed_open(dir: &Path, cfg: &SpoolConfig) -> anyhow::Result<OpenTiming> {
    let start = Instant::now();
    let (spool, report) =
        Spool::open(dir, cfg.clone()).with_context(|| format!("reopening {}", dir.display()))?;
    let open_s = start.elapsed().as_secs_f64();
    drop(spool);
    Ok(open_timing(open_s, &report))
}

fn open_timing(open_s: f64, r: &RecoveryReport) -> OpenTiming {
    OpenTiming {
        open_s,
        segments_scanned: r.segments_scanned,
        bytes_scanned: r.bytes_scanned,
        records_found: r.records_found,
        clean: r.is_clean(),
        skipped_ranges: r.skipped_ranges,
        skipped_bytes: r.skipped_bytes,
    }
}

/// `sync; echo 3 > /proc/sys/vm/drop_caches`: "ok", or why not.
fn drop_page_cache() -> String {
    let synced = std::process::Command::new("sync")
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    match std::fs::write("/proc/sys/vm/drop_caches", "3\n") {
        Ok(()) if synced => "ok".to_string(),
        Ok(()) => "ok (sync failed first)".to_string(),
        Err(e) => format!("not possible ({e}); the cold open ran on a warm page cache"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_records_are_all_durable_and_read_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), config(Durability::Never, 4 << 20)).unwrap();
        let far = Instant::now() + Duration::from_secs(60);
        let n = append(
            &mut spool,
            3,
            1000,
            40,
            Some(Duration::from_millis(1)),
            7,
            far,
        )
        .unwrap();
        assert_eq!(n, 1000);
        assert_eq!(spool.durable_seq().0, 1000);
        let mut cur = spool.read_cursor();
        let mut out = Vec::new();
        while spool.read(&mut cur, 100, 1 << 20, &mut out).unwrap() > 0 {}
        let mut g = RecordGen::new(3, 40);
        assert_eq!(out.len(), 1000);
        for (i, r) in out.iter().enumerate() {
            assert_eq!(&r.body[..], g.body(i as u64));
        }
    }

    #[test]
    fn always_commits_once_per_batch() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), config(Durability::Always, 4 << 20)).unwrap();
        let far = Instant::now() + Duration::from_secs(60);
        assert_eq!(append(&mut spool, 0, 100, 16, None, 10, far).unwrap(), 100);
        assert_eq!(spool.counters().commits, 10);
        assert_eq!(spool.durable_seq().0, 100);
    }

    #[test]
    fn a_passed_deadline_appends_nothing_and_leaves_nothing_uncommitted() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), config(Durability::Never, 4 << 20)).unwrap();
        assert_eq!(
            append(&mut spool, 0, 100, 16, None, 10, Instant::now()).unwrap(),
            0
        );
        assert_eq!(spool.uncommitted_bytes(), 0);
    }

    #[test]
    fn shares_cover_the_total() {
        assert_eq!(
            (0..3)
                .map(|t| crate::scenarios::storage::share(10, 3, t))
                .sum::<u64>(),
            10
        );
    }
}
