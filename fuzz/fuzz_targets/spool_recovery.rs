//! Fuzz target for the spool's recovery (crates/sluice-spool/src/recovery.rs, scan.rs): the
//! decoder of whatever bytes a crash, a bad flash block or an operator left in a spool
//! directory.
//!
//! The input becomes one or two segment files (and optionally a cursor file) in an in-memory
//! `FaultFs`; byte 0 picks the shape: bit 0 puts a valid segment header in front (so the scan
//! reaches the frames), bit 1 adds a 20-byte cursor file taken from the input, bit 2 splits
//! the rest into two segment files at an input-chosen offset, the second named by an
//! input-chosen seq, and bit 3 reads the rest as a script of valid frames (correct CRC,
//! consecutive or skipping seqs) mixed with raw garbage, so that the fuzzer reaches torn
//! tails, damage between intact runs and seq gaps without having to forge CRC32C. Checks, besides "no panic": `Spool::open` succeeds (damage never stops a
//! start), recovery leaves no damaged range behind for `verify`, the records read back have
//! strictly increasing seqs and bounded bodies, a second open reads the same records, and the
//! recovered spool accepts, commits and reads back a new record after them.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "shared/spool_recovery_steps.rs"]
mod steps;

fuzz_target!(|data: &[u8]| steps::run(data));
