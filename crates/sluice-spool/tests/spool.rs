//! Behaviour of the live spool: commit visibility, acks, trimming, bounds, poisoning.

mod common;

use common::{body, open_fault, read_all, small_config};
use sluice_spool::fault::FaultFs;
use sluice_spool::{FullPolicy, ReadCursor, Spool, SpoolError, SpoolSeq};

#[test]
fn records_become_readable_only_after_commit_and_in_append_order() {
    let fs = FaultFs::new(1);
    let (mut spool, report) = open_fault(&fs, small_config());
    assert!(report.is_clean());
    for i in 1..=50 {
        assert_eq!(spool.append(&body(i)).expect("append").seq, SpoolSeq(i));
    }
    assert!(
        read_all(&mut spool).is_empty(),
        "uncommitted records must not be readable"
    );
    let c = spool.commit().expect("commit");
    assert_eq!(c.durable_through, SpoolSeq(50));
    let got = read_all(&mut spool);
    assert_eq!(got.len(), 50);
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.seq, SpoolSeq(i as u64 + 1));
        assert_eq!(&r.body[..], &body(i as u64 + 1)[..]);
    }
    assert!(spool.segment_count() > 3, "small segments rotate");
}

#[test]
fn a_commit_job_runs_on_another_thread_while_appends_continue() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut spool, _) = Spool::open(dir.path(), small_config()).expect("open");
    spool.append(b"first").expect("append");
    let job = spool.begin_commit().expect("begin").expect("work to do");
    assert!(matches!(
        spool.begin_commit(),
        Err(SpoolError::CommitInFlight)
    ));
    let handle = std::thread::spawn(move || job.run());
    spool.append(b"second").expect("append during commit");
    let c = spool
        .finish_commit(handle.join().expect("job thread"))
        .expect("finish");
    assert_eq!(c.durable_through, SpoolSeq(1));
    assert_eq!(spool.commit().expect("commit").durable_through, SpoolSeq(2));
    let bodies: Vec<_> = read_all(&mut spool).into_iter().map(|r| r.body).collect();
    assert_eq!(bodies, vec![&b"first"[..], &b"second"[..]]);
}

#[test]
fn a_read_job_runs_on_another_thread_and_is_discarded_if_a_segment_went_meanwhile() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut spool, _) = Spool::open(dir.path(), small_config()).expect("open");
    for i in 1..=200 {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
    assert!(spool.segment_count() > 3, "small segments rotate");
    // Forward and newest first: the same records as an inline read, in the same order.
    for start in [
        ReadCursor::at(SpoolSeq(1)),
        ReadCursor::newest_first(SpoolSeq(200)),
    ] {
        let mut cur = start;
        let mut got = Vec::new();
        loop {
            let job = spool.begin_read(cur, 7, 1 << 10).expect("begin");
            let handle = std::thread::spawn(move || job.run());
            spool
                .append(b"during the read")
                .expect("append during a read");
            let done = spool
                .finish_read(handle.join().expect("job thread"))
                .expect("no segment removed");
            cur = done.cursor;
            if done.result.expect("read") == 0 {
                break;
            }
            got.extend(done.records.into_iter().map(|r| r.seq.0));
        }
        let mut want: Vec<u64> = (1..=200).collect();
        if start.is_newest_first() {
            want.reverse();
        }
        assert_eq!(got, want, "newest first: {}", start.is_newest_first());
    }
    // Acks trim whole segments: a job that ran across the trim is discarded.
    let job = spool
        .begin_read(ReadCursor::at(SpoolSeq(1)), 10, 1 << 20)
        .expect("begin");
    for i in 1..=100 {
        spool.ack(SpoolSeq(i)).expect("ack");
    }
    spool
        .commit()
        .expect("commit persists the cursor and trims");
    assert!(
        spool.finish_read(job.run()).is_none(),
        "discarded: read again"
    );
    let job = spool
        .begin_read(ReadCursor::at(SpoolSeq(1)), 10, 1 << 20)
        .expect("begin");
    let done = spool
        .finish_read(job.run())
        .expect("nothing removed meanwhile");
    assert!(done.result.expect("read") > 0);
    assert!(
        done.records[0].seq.0 > 1,
        "records of trimmed segments are skipped"
    );
}

#[test]
fn out_of_order_acks_advance_the_cursor_only_over_a_contiguous_prefix() {
    let fs = FaultFs::new(2);
    let (mut spool, _) = open_fault(&fs, small_config());
    for i in 1..=10 {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
    for s in [3, 2, 5] {
        spool.ack(SpoolSeq(s)).expect("ack");
    }
    assert_eq!(spool.ack_cursor(), SpoolSeq(0));
    spool.ack(SpoolSeq(1)).expect("ack");
    assert_eq!(spool.ack_cursor(), SpoolSeq(3));
    spool.ack(SpoolSeq(4)).expect("ack");
    assert_eq!(spool.ack_cursor(), SpoolSeq(5));
    spool.ack(SpoolSeq(2)).expect("a duplicate ack is ignored");
    assert!(matches!(
        spool.ack(SpoolSeq(11)),
        Err(SpoolError::AckNotCommitted { .. })
    ));
    spool.commit().expect("commit persists the cursor");
    assert_eq!(spool.persisted_ack_cursor(), Some(SpoolSeq(5)));
    drop(spool);
    let (mut spool, _) = open_fault(&fs, small_config());
    assert_eq!(spool.ack_cursor(), SpoolSeq(5));
    let seqs: Vec<u64> = read_all(&mut spool).iter().map(|r| r.seq.0).collect();
    assert_eq!(seqs, (6..=10).collect::<Vec<_>>());
}

#[test]
fn acks_beyond_the_window_are_refused() {
    let fs = FaultFs::new(3);
    let mut cfg = small_config();
    cfg.ack_window = 4;
    let (mut spool, _) = open_fault(&fs, cfg);
    for i in 1..=10 {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
    spool.ack(SpoolSeq(4)).expect("inside the window");
    assert!(matches!(
        spool.ack(SpoolSeq(5)),
        Err(SpoolError::AckOutsideWindow { .. })
    ));
}

#[test]
fn a_segment_is_deleted_only_after_every_record_in_it_is_acked_and_the_cursor_persisted() {
    let fs = FaultFs::new(4);
    let (mut spool, _) = open_fault(&fs, small_config());
    for i in 1..=40 {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
    let segs_before = fs
        .paths()
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .count();
    let first_seg = sluice_spool::segment_path("/spool".as_ref(), 1);
    // Ack all but the last record of the first segment.
    let mut cur = spool.read_cursor();
    let mut out = Vec::new();
    spool.read(&mut cur, 1000, 1 << 20, &mut out).expect("read");
    let first_seg_records = 512 / 60; // lower bound on records per 512-byte segment
    for r in out.iter().take(first_seg_records - 1) {
        spool.ack(r.seq).expect("ack");
    }
    spool.commit().expect("commit");
    assert!(
        fs.read_all(&first_seg).is_some(),
        "a partly acked segment stays"
    );
    for r in &out {
        spool.ack(r.seq).expect("ack");
    }
    assert!(
        fs.read_all(&first_seg).is_some(),
        "nothing is deleted before the cursor is persisted"
    );
    spool.commit().expect("commit");
    assert!(
        fs.read_all(&first_seg).is_none(),
        "fully acked segments go after the commit"
    );
    let segs_after = fs
        .paths()
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .count();
    assert_eq!(
        segs_after, 1,
        "only the active segment remains (had {segs_before})"
    );
    assert_eq!(spool.counters().segments_trimmed as usize, segs_before - 1);
}

#[test]
fn block_policy_refuses_appends_when_full_until_acks_free_space() {
    let fs = FaultFs::new(5);
    let mut cfg = small_config();
    cfg.max_bytes = 2048;
    let (mut spool, _) = open_fault(&fs, cfg);
    let mut seqs = Vec::new();
    let err = loop {
        match spool.append(&[7u8; 64]) {
            Ok(a) => seqs.push(a.seq),
            Err(e) => break e,
        }
        spool.commit().expect("commit");
    };
    assert!(matches!(err, SpoolError::Full { .. }), "{err}");
    assert!(spool.total_bytes() <= 2048);
    assert_eq!(spool.counters().full_rejections, 1);
    for s in &seqs {
        spool.ack(*s).expect("ack");
    }
    spool.commit().expect("commit trims");
    spool.append(&[7u8; 64]).expect("space again after acks");
}

#[test]
fn a_lowered_bound_refuses_appends_until_acks_bring_the_spool_under_it() {
    let fs = FaultFs::new(7);
    let mut cfg = small_config();
    cfg.max_bytes = 4096;
    let (mut spool, _) = open_fault(&fs, cfg);
    let mut seqs = Vec::new();
    while spool.total_bytes() < 3000 {
        seqs.push(spool.append(&[7u8; 64]).expect("room").seq);
        spool.commit().expect("commit");
    }
    let held = spool.total_bytes();
    // Never below two segments; what it holds stays.
    assert_eq!(spool.set_max_bytes(100), 1024);
    assert_eq!(spool.set_max_bytes(2048), 2048);
    assert_eq!(spool.config().max_bytes, 2048);
    assert_eq!(spool.total_bytes(), held, "nothing held is removed");
    let err = spool.append(&[7u8; 64]).unwrap_err();
    assert!(matches!(err, SpoolError::Full { max: 2048, .. }), "{err}");
    for s in &seqs {
        spool.ack(*s).expect("ack");
    }
    spool.commit().expect("commit trims");
    while spool.append(&[7u8; 64]).is_ok() {
        spool.commit().expect("commit");
    }
    assert!(spool.total_bytes() <= 2048, "{}", spool.total_bytes());
}

#[test]
fn drop_oldest_removes_the_oldest_segment_counts_it_and_says_which_seqs() {
    let fs = FaultFs::new(6);
    let mut cfg = small_config();
    cfg.max_bytes = 2048;
    cfg.when_full = FullPolicy::DropOldest;
    let (mut spool, _) = open_fault(&fs, cfg);
    let mut dropped = None;
    for i in 1..=100u64 {
        let a = spool
            .append(&[i as u8; 64])
            .expect("never full under drop-oldest");
        spool.commit().expect("commit");
        if a.dropped.is_some() && dropped.is_none() {
            dropped = a.dropped;
        }
        assert!(spool.total_bytes() <= 2048);
    }
    let d = dropped.expect("something was dropped");
    assert_eq!(d.first, SpoolSeq(1));
    assert!(spool.counters().dropped_oldest_records >= d.records);
    let got = read_all(&mut spool);
    assert_eq!(got.last().map(|r| r.seq), Some(SpoolSeq(100)));
    assert!(got.first().map(|r| r.seq.0).unwrap_or(0) > d.last.0);
    // The reader skips what was dropped.
    let mut cur = ReadCursor::at(SpoolSeq(1));
    let mut out = Vec::new();
    spool.read(&mut cur, 1, 1 << 20, &mut out).expect("read");
    assert_eq!(out[0].seq, got[0].seq);
}

#[test]
fn a_failed_fsync_poisons_the_spool_and_reopening_recovers_the_durable_records() {
    let fs = FaultFs::new(7);
    let (mut spool, _) = open_fault(&fs, small_config());
    spool.append(b"durable").expect("append");
    spool.commit().expect("commit");
    spool.append(b"maybe").expect("append");
    fs.fail_op(2); // the append succeeds, the fsync fails
    assert!(matches!(spool.commit(), Err(SpoolError::Io { .. })));
    assert!(spool.is_poisoned());
    assert!(matches!(spool.append(b"x"), Err(SpoolError::Poisoned)));
    drop(spool);
    fs.crash();
    let (mut spool, _) = open_fault(&fs, small_config());
    let got = read_all(&mut spool);
    assert_eq!(&got[0].body[..], b"durable");
    assert!(got.len() <= 2);
}

#[test]
fn oversized_records_and_overfull_batches_are_refused_without_harm() {
    let fs = FaultFs::new(8);
    let mut cfg = small_config();
    cfg.max_batch_bytes = 1024;
    let (mut spool, _) = open_fault(&fs, cfg);
    assert!(matches!(
        spool.append(&[0u8; 129]),
        Err(SpoolError::RecordTooLarge { .. })
    ));
    let err = loop {
        if let Err(e) = spool.append(&[1u8; 100]) {
            break e;
        }
    };
    assert!(matches!(err, SpoolError::BatchFull { .. }));
    spool.commit().expect("commit");
    spool.append(&[1u8; 100]).expect("room after the commit");
}

#[test]
fn the_fsync_policy_never_does_not_fsync() {
    let fs = FaultFs::new(9);
    let mut cfg = small_config();
    cfg.fsync = sluice_spool::FsyncPolicy::Never;
    let (mut spool, _) = open_fault(&fs, cfg);
    spool.append(b"a").expect("append");
    spool.commit().expect("commit");
    assert_eq!(spool.counters().fsyncs, 0);
}

fn read_newest_first(
    spool: &mut Spool,
    from: u64,
    max_records: usize,
    max_bytes: usize,
) -> Vec<u64> {
    let mut cur = ReadCursor::newest_first(SpoolSeq(from));
    assert!(cur.is_newest_first());
    let mut out = Vec::new();
    while spool
        .read(&mut cur, max_records, max_bytes, &mut out)
        .expect("read")
        > 0
    {}
    out.iter().map(|r| r.seq.0).collect()
}

#[test]
fn a_newest_first_cursor_reads_committed_unacked_records_in_reverse_across_segments() {
    let fs = FaultFs::new(11);
    let mut cfg = small_config();
    cfg.segment_bytes = 4096;
    let (mut spool, _) = open_fault(&fs, cfg);
    for i in 1..=1200 {
        spool.append(&body(i)).expect("append");
        if i % 100 == 0 {
            spool.commit().expect("commit");
        }
    }
    for i in 1201..=1210 {
        spool.append(&body(i)).expect("append uncommitted");
    }
    assert!(spool.segment_count() > 5, "records span segments");
    for (batch, bytes) in [
        (1, 1 << 20),
        (7, 1 << 20),
        (64, 1 << 20),
        (1000, 1 << 20),
        (64, 1),
    ] {
        let got = read_newest_first(&mut spool, 5000, batch, bytes);
        let want: Vec<u64> = (1..=1200).rev().collect();
        assert_eq!(got, want, "batch {batch}, bytes {bytes}");
    }
    // Bodies are the records' own, and a start below the top reads from there.
    let mut cur = ReadCursor::newest_first(SpoolSeq(700));
    let mut out = Vec::new();
    spool.read(&mut cur, 3, 1 << 20, &mut out).expect("read");
    assert_eq!(
        out.iter().map(|r| r.seq.0).collect::<Vec<_>>(),
        vec![700, 699, 698]
    );
    for r in &out {
        assert_eq!(&r.body[..], &body(r.seq.0)[..]);
    }
    assert_eq!(cur.next_seq(), SpoolSeq(697));
}

#[test]
fn a_newest_first_cursor_stops_above_the_ack_cursor_and_sees_later_commits() {
    let fs = FaultFs::new(12);
    let (mut spool, _) = open_fault(&fs, small_config());
    for i in 1..=100 {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
    for s in 1..=40 {
        spool.ack(SpoolSeq(s)).expect("ack");
    }
    assert_eq!(
        read_newest_first(&mut spool, 100, 16, 1 << 20),
        (41..=100).rev().collect::<Vec<_>>()
    );
    for i in 101..=120 {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
    assert_eq!(
        read_newest_first(&mut spool, 120, 16, 1 << 20),
        (41..=120).rev().collect::<Vec<_>>()
    );
    // Oldest-first cursors are unchanged by the newest-first reader's table.
    let mut cur = spool.read_cursor();
    let mut out = Vec::new();
    spool.read(&mut cur, 5, 1 << 20, &mut out).expect("read");
    assert_eq!(
        out.iter().map(|r| r.seq.0).collect::<Vec<_>>(),
        vec![41, 42, 43, 44, 45]
    );
}

/// Where [`damage`] flips a byte of a record.
#[derive(Debug, Clone, Copy)]
enum Hit {
    /// The last byte of its body.
    Body,
    /// Its frame header's length field (crc32c 4 bytes, length 4, seq 8, then the body), so
    /// the headers after it can no longer be walked to.
    Length,
}

/// Flips one byte of record `seq`, wherever it is stored (media damage after the record was
/// committed; the open spool does not know).
fn damage(fs: &FaultFs, seq: u64, hit: Hit) {
    // The frame's seq field and body: unique, where a body alone may also match a header.
    let needle = [&seq.to_le_bytes()[..], &body(seq)].concat();
    let mut hits = 0;
    for path in fs.paths() {
        if path.extension().is_none_or(|e| e != "seg") {
            continue;
        }
        let mut bytes = fs.read_all(&path).expect("segment");
        if let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) {
            match hit {
                Hit::Body => bytes[at + needle.len() - 1] ^= 0x10,
                Hit::Length => bytes[at - 4] ^= 0x03,
            }
            assert!(fs.overwrite(&path, bytes));
            hits += 1;
        }
    }
    assert_eq!(hits, 1, "record {seq}'s body is stored exactly once");
}

/// Reads with `cur` until it runs dry (Ok) or hits a damaged record (Err); the seqs the
/// successful reads returned. A failing read must return nothing (callers drop its output).
fn read_until_error(
    spool: &mut Spool,
    cur: &mut ReadCursor,
    max_records: usize,
) -> (Vec<u64>, Option<SpoolError>) {
    let mut out = Vec::new();
    loop {
        let before = out.len();
        match spool.read(cur, max_records, 1 << 20, &mut out) {
            Ok(0) => return (out.iter().map(|r| r.seq.0).collect(), None),
            Ok(n) => assert_eq!(out.len(), before + n),
            Err(e) => {
                out.truncate(before);
                return (out.iter().map(|r| r.seq.0).collect(), Some(e));
            }
        }
    }
}

#[test]
fn a_record_damaged_after_commit_costs_only_itself_in_either_read_direction() {
    const LAST: u64 = 40;
    // Every position: first and last record, segment starts and ends, the middle.
    for (bad, hit, max_records) in (1..LAST).flat_map(|bad| {
        [Hit::Body, Hit::Length]
            .into_iter()
            .flat_map(move |hit| [1000, 7, 1].map(|m| (bad, hit, m)))
    }) {
        {
            let ctx = format!("record {bad} damaged ({hit:?}), max_records {max_records}");
            let fs = FaultFs::new(11);
            let (mut spool, _) = open_fault(&fs, small_config());
            for i in 1..=LAST {
                spool.append(&body(i)).expect("append");
            }
            spool.commit().expect("commit");
            assert!(spool.segment_count() > 3);
            damage(&fs, bad, hit);

            // Oldest first: everything before it, then the error with the cursor on it;
            // skipping exactly that seq reads the rest.
            let mut cur = spool.read_cursor();
            let (seqs, err) = read_until_error(&mut spool, &mut cur, max_records);
            assert_eq!(seqs, (1..bad).collect::<Vec<_>>(), "{ctx}");
            assert!(
                matches!(err, Some(SpoolError::CorruptRecord { .. })),
                "{ctx}: {err:?}"
            );
            assert_eq!(cur.next_seq(), SpoolSeq(bad), "{ctx}");
            let mut cur = ReadCursor::at(SpoolSeq(bad + 1));
            let (seqs, err) = read_until_error(&mut spool, &mut cur, max_records);
            assert_eq!(seqs, (bad + 1..=LAST).collect::<Vec<_>>(), "{ctx}");
            assert!(err.is_none(), "{ctx}: {err:?}");

            // Newest first: the same, from the other end.
            let mut cur = ReadCursor::newest_first(SpoolSeq(LAST));
            let (seqs, err) = read_until_error(&mut spool, &mut cur, max_records);
            assert_eq!(seqs, (bad + 1..=LAST).rev().collect::<Vec<_>>(), "{ctx}");
            assert!(
                matches!(err, Some(SpoolError::CorruptRecord { .. })),
                "{ctx}: {err:?}"
            );
            assert_eq!(cur.next_seq(), SpoolSeq(bad), "{ctx}");
            let mut cur = ReadCursor::newest_first(SpoolSeq(bad - 1));
            let (seqs, err) = read_until_error(&mut spool, &mut cur, max_records);
            assert_eq!(seqs, (1..bad).rev().collect::<Vec<_>>(), "{ctx}");
            assert!(err.is_none(), "{ctx}: {err:?}");
        }
    }
}
