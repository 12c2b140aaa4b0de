//! Shared helpers for the spool's integration tests (included with `mod common;`).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use sluice_spool::fault::FaultFs;
use sluice_spool::{FsyncPolicy, FullPolicy, Spool, SpoolConfig, SpoolRecord};

pub fn small_config() -> SpoolConfig {
    SpoolConfig {
        segment_bytes: 512,
        max_bytes: 64 << 10,
        when_full: FullPolicy::Block,
        fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
        max_record_bytes: 128,
        max_batch_bytes: 16 << 10,
        ack_window: 1024,
    }
}

pub fn body(i: u64) -> Vec<u8> {
    let mut b = i.to_le_bytes().to_vec();
    b.extend(std::iter::repeat_n((i % 251) as u8, (i % 40) as usize));
    b
}

pub fn read_all(spool: &mut Spool) -> Vec<SpoolRecord> {
    let mut cur = spool.read_cursor();
    let mut out = Vec::new();
    while spool.read(&mut cur, 1000, 1 << 20, &mut out).expect("read") > 0 {}
    out
}

pub fn open_fault(fs: &FaultFs, cfg: SpoolConfig) -> (Spool, sluice_spool::RecoveryReport) {
    Spool::open_with_fs(Arc::new(fs.clone()), "/spool", cfg).expect("open")
}
