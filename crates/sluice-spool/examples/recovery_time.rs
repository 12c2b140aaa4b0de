//! Time to open (recover) an existing spool.
//!
//! `cargo run --release -p sluice-spool --example recovery_time -- DIR`

use std::time::Instant;

use sluice_spool::{Spool, SpoolConfig};

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: recovery_time DIR"))?;
    let start = Instant::now();
    let (spool, report) = Spool::open(
        &dir,
        SpoolConfig {
            max_bytes: 64 << 30,
            ..SpoolConfig::default()
        },
    )?;
    let elapsed = start.elapsed();
    println!(
        "recovered {} records in {} segments ({:.2} GiB scanned) in {:.3} s; clean: {}; next seq {}",
        report.records_found,
        report.segments_scanned,
        report.bytes_scanned as f64 / (1u64 << 30) as f64,
        elapsed.as_secs_f64(),
        report.is_clean(),
        spool.next_seq(),
    );
    Ok(())
}
