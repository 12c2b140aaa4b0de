//! Append throughput with group commit on a writer thread.
//!
//! `cargo run --release -p sluice-spool --example append_rate -- DIR [RECORDS] [BODY_BYTES] [COMMIT_MS]`
//!
//! Appends RECORDS (default 4,000,000) records of BODY_BYTES (default 256) to a fresh spool
//! in DIR (which must not hold a spool), committing every COMMIT_MS (default 10) with the
//! fsync on a writer thread, the way a shard would. Prints records/s. Leaves the spool in DIR
//! so `recovery_time` can open it.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use sluice_spool::{CommitJob, CommitOutcome, FsyncPolicy, Spool, SpoolConfig, SpoolError};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).ok_or_else(|| {
        anyhow::anyhow!("usage: append_rate DIR [RECORDS] [BODY_BYTES] [COMMIT_MS]")
    })?;
    let records: u64 = args.get(2).map_or(Ok(4_000_000), |s| s.parse())?;
    let body_len: usize = args.get(3).map_or(Ok(256), |s| s.parse())?;
    let period = Duration::from_millis(args.get(4).map_or(Ok(10), |s| s.parse())?);
    let cfg = SpoolConfig {
        max_bytes: 64 << 30,
        max_batch_bytes: 64 << 20,
        fsync: FsyncPolicy::Interval(period),
        ..SpoolConfig::default()
    };
    let (mut spool, report) = Spool::open(dir, cfg)?;
    anyhow::ensure!(report.records_found == 0, "{dir} already holds a spool");

    let (job_tx, job_rx) = mpsc::sync_channel::<CommitJob>(1);
    let (done_tx, done_rx) = mpsc::sync_channel::<CommitOutcome>(1);
    let writer = std::thread::spawn(move || {
        for job in job_rx {
            if done_tx.send(job.run()).is_err() {
                break;
            }
        }
    });

    let body = vec![0xA5u8; body_len];
    let start = Instant::now();
    let mut next_commit = start + period;
    let mut in_flight = false;
    let mut i = 0u64;
    while i < records {
        let mut batch_full = false;
        match spool.append(&body) {
            Ok(_) => i += 1,
            Err(SpoolError::BatchFull { .. }) if in_flight => {
                spool.finish_commit(done_rx.recv()?)?;
                in_flight = false;
                batch_full = true;
            }
            Err(SpoolError::BatchFull { .. }) => batch_full = true,
            Err(e) => return Err(e.into()),
        }
        if in_flight {
            if let Ok(outcome) = done_rx.try_recv() {
                spool.finish_commit(outcome)?;
                in_flight = false;
            }
        }
        if !in_flight && (batch_full || (i.is_multiple_of(256) && Instant::now() >= next_commit)) {
            if let Some(job) = spool.begin_commit()? {
                job_tx.send(job)?;
                in_flight = true;
            }
            next_commit = Instant::now() + period;
        }
    }
    if in_flight {
        spool.finish_commit(done_rx.recv()?)?;
    }
    let last = spool.commit()?;
    let elapsed = start.elapsed();
    drop(job_tx);
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer thread panicked"))?;
    let c = spool.counters();
    println!(
        "{records} records of {body_len} B in {:.3} s: {:.0} records/s, {:.1} MiB/s of frames; durable through {}; \
         {} commits, {} fsyncs, fsync mean {:.2} ms max {:.2} ms; {} segments, {:.2} GiB",
        elapsed.as_secs_f64(),
        records as f64 / elapsed.as_secs_f64(),
        c.bytes_appended as f64 / (1 << 20) as f64 / elapsed.as_secs_f64(),
        last.durable_through,
        c.commits,
        c.fsyncs,
        c.fsync_nanos_total as f64 / c.commits.max(1) as f64 / 1e6,
        c.fsync_nanos_max as f64 / 1e6,
        spool.segment_count(),
        spool.total_bytes() as f64 / (1u64 << 30) as f64,
    );
    Ok(())
}
