//! The spool when its storage gives out: a full disk (`ENOSPC`) or a read-only file system
//! (`EROFS`), injected at every write point or held for a while, on the fault-injecting
//! file system. What must hold (docs/spool.md, "When the disk is full or read-only"): the
//! spool stalls instead of failing (appends refused, nothing needs a reopen), no record
//! reported durable is lost, records appended but refused by the storage are written once it
//! takes writes again, reading, acknowledging and trimming go on (and free the disk), a
//! restart on a full disk works, and the spool accepts again without a reopen.

mod common;

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::sync::Arc;
use std::time::Duration;

use common::{body, small_config};
use sluice_spool::fault::FaultFs;
use sluice_spool::{
    FsyncPolicy, Spool, SpoolConfig, SpoolError, SpoolSeq, StallReason, RESERVE_BYTES,
};

fn open(fs: &FaultFs, cfg: SpoolConfig) -> Spool {
    Spool::open_with_fs(Arc::new(fs.clone()), "/spool", cfg)
        .expect("open")
        .0
}

/// Every unacknowledged committed record, in order, as (seq, body).
fn unacked(spool: &mut Spool) -> Vec<(u64, Vec<u8>)> {
    let mut cur = spool.read_cursor();
    let mut out = Vec::new();
    while spool.read(&mut cur, 1000, 1 << 20, &mut out).expect("read") > 0 {}
    out.into_iter()
        .map(|r| (r.seq.0, r.body.to_vec()))
        .collect()
}

/// What a workload saw: records the spool accepted (seq → body index) and how far it said
/// they were durable.
#[derive(Default)]
struct Seen {
    accepted: BTreeMap<u64, u64>,
    durable: u64,
    acked: u64,
    next_body: u64,
}

impl Seen {
    fn append(&mut self, spool: &mut Spool) -> Result<(), SpoolError> {
        let i = self.next_body + 1;
        let a = spool.append(&body(i))?;
        self.next_body = i;
        self.accepted.insert(a.seq.0, i);
        Ok(())
    }

    /// Acks every durable record up to `lag` below the durable point.
    fn ack_lagging(&mut self, spool: &mut Spool, lag: u64) {
        let to = self.durable.saturating_sub(lag);
        while self.acked < to {
            self.acked += 1;
            spool
                .ack(SpoolSeq(self.acked))
                .expect("ack a durable record");
        }
    }

    /// The records that must be readable: accepted, reported durable, not acknowledged.
    fn check_readable(&self, spool: &mut Spool, what: &str) {
        let got: BTreeMap<u64, Vec<u8>> = unacked(spool).into_iter().collect();
        for (&seq, &i) in self
            .accepted
            .iter()
            .filter(|(&s, _)| s > self.acked && s <= self.durable)
        {
            assert_eq!(
                got.get(&seq).map(Vec::as_slice),
                Some(&body(i)[..]),
                "{what}: durable record {seq} lost or changed"
            );
        }
    }
}

/// A fsync that failed poisons the spool (the page cache cannot be trusted after it), whatever
/// its errno; every other write refused for want of space or writability must not.
fn allowed_poison(e: &SpoolError) -> bool {
    matches!(e, SpoolError::Io { op, .. } if op.starts_with("fsync"))
}

/// One scripted workload: rounds of appends and a commit, the cloud acking behind.
/// Returns whether the spool was poisoned (by an allowed failure).
fn workload(spool: &mut Spool, seen: &mut Seen, rounds: usize) -> bool {
    for round in 0..rounds {
        for _ in 0..3 {
            match seen.append(spool) {
                Ok(()) | Err(SpoolError::Stalled { .. }) => {}
                Err(e) => {
                    assert!(
                        allowed_poison(&e) || matches!(e, SpoolError::Poisoned),
                        "{e}"
                    );
                    return true;
                }
            }
        }
        match spool.commit() {
            Ok(c) => seen.durable = seen.durable.max(c.durable_through.0),
            Err(e) => {
                assert!(
                    allowed_poison(&e),
                    "round {round}: the storage stall poisoned the spool: {e}"
                );
                return true;
            }
        }
        if round % 4 == 3 {
            seen.ack_lagging(spool, 5);
        }
    }
    false
}

#[test]
fn enospc_or_erofs_at_every_write_point_stalls_then_resumes_and_loses_no_durable_record() {
    let cfg = small_config();
    // How many mutating operations a clean run makes.
    let clean = FaultFs::new(1);
    let mut spool = open(&clean, cfg.clone());
    let start = clean.ops();
    let mut seen = Seen::default();
    assert!(!workload(&mut spool, &mut seen, 40));
    let ops = clean.ops() - start;
    assert!(ops > 100, "the workload writes ({ops} operations)");

    let mut stalls = 0;
    let mut poisonings = 0;
    for kind in [ErrorKind::StorageFull, ErrorKind::ReadOnlyFilesystem] {
        for n in 1..=ops {
            let fs = FaultFs::new(n);
            let mut spool = open(&fs, cfg.clone());
            fs.fail_op_with(n, kind);
            let mut seen = Seen::default();
            let poisoned = workload(&mut spool, &mut seen, 40);
            let what = format!("{kind:?} at operation {n}");
            if poisoned {
                poisonings += 1;
                // An fsync failed: reopening recovers every durable record.
                spool = open(&fs, cfg.clone());
                seen.check_readable(&mut spool, &what);
                continue;
            }
            stalls += u64::from(spool.counters().stalls > 0);
            // The storage is fine again: the next commits end the stall without a reopen
            // and write what was refused.
            for _ in 0..3 {
                if spool.stalled().is_none() && spool.uncommitted_bytes() == 0 {
                    break;
                }
                let c = spool.commit().unwrap_or_else(|e| panic!("{what}: {e}"));
                seen.durable = seen.durable.max(c.durable_through.0);
            }
            assert_eq!(spool.stalled(), None, "{what}: still stalled");
            let last = *seen.accepted.keys().last().expect("accepted some");
            assert_eq!(
                seen.durable, last,
                "{what}: an accepted record never became durable"
            );
            seen.check_readable(&mut spool, &what);
            // It accepts again.
            seen.append(&mut spool)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            seen.durable = spool.commit().expect("commit").durable_through.0;
            // And a crash now loses nothing durable.
            fs.crash();
            let mut spool = open(&fs, cfg.clone());
            seen.check_readable(&mut spool, &format!("{what}, after a crash"));
        }
    }
    assert!(stalls > ops, "most injections stalled the spool ({stalls})");
    eprintln!(
        "figures: ENOSPC and EROFS each injected at every one of {ops} mutating operations: {stalls} runs stalled, {poisonings} poisoned by a failed fsync, no durable record lost"
    );
}

/// A disk of `capacity` bytes (the reserve included) under a spool whose `max_size` is far
/// larger: the disk fills long before the spool's own bound.
fn full_disk(capacity: u64, segment_bytes: u64) -> (FaultFs, SpoolConfig) {
    let fs = FaultFs::new(7);
    fs.set_capacity(Some(capacity));
    let cfg = SpoolConfig {
        segment_bytes,
        max_bytes: 64 << 20,
        max_batch_bytes: 4 << 10,
        ..small_config()
    };
    (fs, cfg)
}

/// Appends and commits until the storage refuses; returns what was seen.
fn fill(spool: &mut Spool, seen: &mut Seen) {
    for _ in 0..100_000 {
        for _ in 0..8 {
            match seen.append(spool) {
                Ok(()) => {}
                Err(SpoolError::Stalled { reason }) => {
                    assert_eq!(reason, StallReason::NoSpace);
                    return;
                }
                Err(e) => panic!("append on a filling disk: {e}"),
            }
        }
        let c = spool.commit().expect("a full disk does not fail a commit");
        seen.durable = seen.durable.max(c.durable_through.0);
    }
    panic!("the disk never filled");
}

#[test]
fn on_a_full_disk_the_cloud_drains_the_spool_its_acks_free_the_disk_and_appends_resume() {
    // Segments smaller than the disk, and one segment larger than the whole disk (the active
    // segment must then be sealed at its committed end for the acks to free anything).
    for segment_bytes in [2 << 10, 1 << 20] {
        let (fs, cfg) = full_disk(RESERVE_BYTES + (24 << 10), segment_bytes);
        let mut spool = open(&fs, cfg.clone());
        let mut seen = Seen::default();
        fill(&mut spool, &mut seen);
        let what = format!("segments of {segment_bytes} bytes");
        assert_eq!(spool.stalled(), Some(StallReason::NoSpace), "{what}");
        assert!(!spool.is_poisoned());
        assert!(seen.durable > 50, "{what}: {} durable", seen.durable);
        assert!(spool.counters().stalled_rejections >= 1 && spool.counters().storage_refusals >= 1);

        // The cloud reads everything durable, in order, and acknowledges it.
        let got = unacked(&mut spool);
        assert_eq!(
            got.iter().map(|r| r.0).collect::<Vec<_>>(),
            (1..=seen.durable).collect::<Vec<_>>(),
            "{what}"
        );
        seen.ack_lagging(&mut spool, 0);
        // A stalled spool still persists its cursor (with the reserve's room) and trims,
        // which frees the disk; then its probe gets through and the refused batch is written.
        let trimmed = spool.counters().segments_trimmed;
        for _ in 0..4 {
            let c = spool.commit().expect("commit while stalled");
            seen.durable = seen.durable.max(c.durable_through.0);
            if c.stalled.is_none() {
                break;
            }
        }
        assert_eq!(
            spool.stalled(),
            None,
            "{what}: the acks did not free the disk"
        );
        assert!(spool.persisted_ack_cursor() >= Some(SpoolSeq(seen.acked)));
        assert!(
            spool.counters().segments_trimmed > trimmed,
            "{what}: trimming freed nothing"
        );
        let last = *seen.accepted.keys().last().expect("accepted");
        assert_eq!(
            seen.durable, last,
            "{what}: the refused batch was not written"
        );
        // It accepts again, and seqs go on.
        for _ in 0..20 {
            seen.append(&mut spool).expect("append after the stall");
        }
        seen.durable = spool.commit().expect("commit").durable_through.0;
        seen.check_readable(&mut spool, &what);
        assert_eq!(spool.counters().stalls, 1);
    }
}

#[test]
fn a_restart_on_a_full_disk_opens_the_spool_stalled_and_drains_it() {
    let (fs, cfg) = full_disk(RESERVE_BYTES + (24 << 10), 2 << 10);
    let mut spool = open(&fs, cfg.clone());
    let mut seen = Seen::default();
    fill(&mut spool, &mut seen);
    drop(spool);
    fs.crash();
    // Whatever the crash kept, the disk is as full as it gets: nothing may need space to
    // start (the reserve was released by the refused write and cannot be written again).
    let (mut spool, report) = Spool::open_with_fs(Arc::new(fs.clone()), "/spool", cfg.clone())
        .expect("open on a full disk");
    assert!(report.quarantined.is_empty(), "{report:?}");
    seen.check_readable(&mut spool, "after a restart on a full disk");
    let stalled_at_start = spool.stalled();
    seen.ack_lagging(&mut spool, 0);
    for _ in 0..4 {
        if spool.commit().expect("commit").stalled.is_none() {
            break;
        }
    }
    assert_eq!(
        spool.stalled(),
        None,
        "started {stalled_at_start:?}; acks freed the disk"
    );
    seen.append(&mut spool).expect("append");
}

#[test]
fn a_read_only_file_system_stalls_the_spool_and_remounting_it_writable_resumes_it() {
    let fs = FaultFs::new(3);
    let cfg = SpoolConfig {
        fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
        ..small_config()
    };
    let mut spool = open(&fs, cfg.clone());
    let mut seen = Seen::default();
    for _ in 0..30 {
        seen.append(&mut spool).expect("append");
    }
    seen.durable = spool.commit().expect("commit").durable_through.0;

    fs.set_read_only(true);
    for _ in 0..5 {
        seen.append(&mut spool).expect("appends go to memory first");
    }
    let c = spool
        .commit()
        .expect("a read-only file system does not fail a commit");
    assert_eq!(c.stalled, Some(StallReason::ReadOnly));
    assert_eq!(c.durable_through.0, 30, "the refused batch is not durable");
    assert!(matches!(
        spool.append(&body(999)),
        Err(SpoolError::Stalled {
            reason: StallReason::ReadOnly
        })
    ));
    // Reading and acknowledging go on; the cursor cannot be persisted yet.
    seen.check_readable(&mut spool, "read-only");
    seen.ack_lagging(&mut spool, 10);
    let c = spool.commit().expect("probe while read-only");
    assert_eq!(c.stalled, Some(StallReason::ReadOnly));
    assert_eq!(
        spool.persisted_ack_cursor(),
        Some(SpoolSeq(0)),
        "the cursor written before"
    );

    fs.set_read_only(false);
    let c = spool.commit().expect("commit after remount rw");
    assert_eq!(c.stalled, None);
    assert_eq!(c.durable_through.0, 35, "the refused batch is written");
    assert_eq!(spool.persisted_ack_cursor(), Some(SpoolSeq(seen.acked)));
    seen.durable = 35;
    seen.append(&mut spool).expect("accepting again");
    seen.durable = spool.commit().expect("commit").durable_through.0;
    fs.crash();
    let mut spool = open(&fs, cfg);
    seen.check_readable(&mut spool, "after a crash");
}

#[test]
fn whatever_the_disk_size_a_full_disk_never_loses_a_durable_record_and_the_acks_always_unwedge_it()
{
    let mut runs = 0;
    for segment_bytes in [2 << 10, 1 << 20] {
        for extra in (10 << 10..48 << 10).step_by(1337) {
            let (fs, cfg) = full_disk(RESERVE_BYTES + extra, segment_bytes);
            let what = format!("disk of reserve + {extra} bytes, segments of {segment_bytes}");
            let mut spool = open(&fs, cfg.clone());
            let mut seen = Seen::default();
            fill(&mut spool, &mut seen);
            seen.check_readable(&mut spool, &what);
            // A crash while full: the restart needs no space and loses nothing durable.
            if extra % 3 == 0 {
                drop(spool);
                fs.crash();
                spool = open(&fs, cfg.clone());
                seen.check_readable(&mut spool, &format!("{what}, restarted"));
                // Records accepted but never durable are gone with the crash.
                seen.accepted.retain(|&s, _| s <= seen.durable);
            }
            seen.ack_lagging(&mut spool, 0);
            for _ in 0..4 {
                let c = spool.commit().unwrap_or_else(|e| panic!("{what}: {e}"));
                seen.durable = seen.durable.max(c.durable_through.0);
                if c.stalled.is_none() {
                    break;
                }
            }
            assert_eq!(
                spool.stalled(),
                None,
                "{what}: still stalled after the acks"
            );
            if let Some(&last) = seen.accepted.keys().last() {
                assert_eq!(
                    seen.durable, last,
                    "{what}: an accepted record was not written"
                );
            }
            seen.append(&mut spool)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            seen.durable = spool.commit().expect("commit").durable_through.0;
            seen.check_readable(&mut spool, &what);
            runs += 1;
        }
    }
    eprintln!("figures: {runs} disk sizes filled, drained and resumed");
}

#[test]
fn a_restart_on_a_read_only_file_system_opens_the_spool_drains_it_and_resumes_when_writable() {
    let fs = FaultFs::new(11);
    let cfg = small_config();
    let mut spool = open(&fs, cfg.clone());
    let mut seen = Seen::default();
    for _ in 0..40 {
        seen.append(&mut spool).expect("append");
    }
    seen.durable = spool.commit().expect("commit").durable_through.0;
    seen.ack_lagging(&mut spool, 25);
    seen.durable = spool.commit().expect("commit").durable_through.0;
    // Records acknowledged in memory after the last commit come back after the restart.
    seen.ack_lagging(&mut spool, 20);
    let persisted = spool.persisted_ack_cursor().expect("cursor written").0;
    drop(spool);
    seen.acked = persisted;

    // Remounted read-only (by the kernel after an error, or by the operator), then restarted.
    fs.set_read_only(true);
    let mut spool = open(&fs, cfg.clone());
    seen.check_readable(&mut spool, "opened read-only");
    seen.ack_lagging(&mut spool, 0);
    let _ = seen.append(&mut spool);
    let c = spool
        .commit()
        .expect("a read-only file system does not fail a commit");
    assert_eq!(c.stalled, Some(StallReason::ReadOnly));
    assert!(matches!(
        spool.append(&body(999)),
        Err(SpoolError::Stalled {
            reason: StallReason::ReadOnly
        })
    ));

    fs.set_read_only(false);
    let c = spool.commit().expect("commit once writable");
    assert_eq!(c.stalled, None);
    seen.durable = c.durable_through.0;
    assert_eq!(
        spool.persisted_ack_cursor(),
        Some(SpoolSeq(seen.acked)),
        "the acks made while read-only are persisted"
    );
    seen.append(&mut spool).expect("accepting again");
    seen.durable = spool.commit().expect("commit").durable_through.0;
    let last = *seen.accepted.keys().last().expect("accepted");
    assert_eq!(seen.durable, last);
    fs.crash();
    let mut spool = open(&fs, cfg);
    seen.check_readable(&mut spool, "after a crash");
}
