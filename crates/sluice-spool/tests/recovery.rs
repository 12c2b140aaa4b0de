//! Recovery: torn tails at every byte, bit flips, crashes during recovery, read-only tools.

mod common;

use std::path::{Path, PathBuf};

use common::{body, open_fault, read_all, small_config};
use sluice_spool::fault::FaultFs;
use sluice_spool::{segment_path, Spool, SpoolSeq, FRAME_HEADER_LEN, QUARANTINE_DIR};

fn seg_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read_dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

/// Writes records 1..=n to a fresh real spool and closes it.
fn write_real(dir: &Path, n: u64) {
    let (mut spool, _) = Spool::open(dir, small_config()).expect("open");
    for i in 1..=n {
        spool.append(&body(i)).expect("append");
    }
    spool.commit().expect("commit");
}

#[test]
fn a_torn_tail_at_every_byte_of_the_last_record_recovers_every_earlier_record() {
    let src = tempfile::tempdir().expect("tempdir");
    write_real(src.path(), 5); // one segment
    let seg = segment_path(src.path(), 1);
    let bytes = std::fs::read(&seg).expect("read");
    let last_len = FRAME_HEADER_LEN + body(5).len();
    let last_start = bytes.len() - last_len;
    for cut in last_start..bytes.len() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(segment_path(dir.path(), 1), &bytes[..cut]).expect("write");
        let (mut spool, report) =
            Spool::open(dir.path(), small_config()).expect("recovery never refuses");
        let got = read_all(&mut spool);
        let seqs: Vec<u64> = got.iter().map(|r| r.seq.0).collect();
        assert_eq!(seqs, vec![1, 2, 3, 4], "cut at {cut}");
        for r in &got {
            assert_eq!(&r.body[..], &body(r.seq.0)[..]);
        }
        if cut == last_start {
            assert!(
                report.is_clean(),
                "a cut on a frame boundary is a clean file"
            );
        } else {
            assert_eq!(report.torn_tails.len(), 1, "cut at {cut}");
            assert_eq!(report.torn_tails[0].bytes as usize, cut - last_start);
            assert_eq!(report.torn_tails[0].seqs.first, 5);
            assert!(report.quarantined.is_empty());
        }
        assert_eq!(
            spool.next_seq(),
            SpoolSeq(5),
            "seq 5 was never durable: it is reused"
        );
    }
}

#[test]
fn a_bit_flip_in_a_middle_record_quarantines_only_that_record_and_reports_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_real(dir.path(), 40);
    let segs = seg_files(dir.path());
    assert!(segs.len() >= 3);
    // Flip one bit inside the third record of the second segment.
    let victim = &segs[1];
    let first: u64 =
        sluice_spool::parse_segment_name(victim.file_name().and_then(|n| n.to_str()).unwrap_or(""))
            .expect("segment name");
    let mut bytes = std::fs::read(victim).expect("read");
    let mut off = 8;
    for s in first..first + 2 {
        off += FRAME_HEADER_LEN + body(s).len();
    }
    let bad_seq = first + 2;
    let bad_len = (FRAME_HEADER_LEN + body(bad_seq).len()) as u64;
    bytes[off + FRAME_HEADER_LEN + 3] ^= 0x20;
    std::fs::write(victim, &bytes).expect("write");

    // verify() sees it and changes nothing.
    let before: Vec<Vec<u8>> = segs
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    let v = sluice_spool::verify(dir.path(), 128).expect("verify");
    assert_eq!(v.damaged_ranges, 1);
    assert_eq!(v.damaged[0].offset, off as u64);
    assert_eq!(v.damaged[0].bytes, bad_len);
    assert_eq!(
        (v.damaged[0].seqs.first, v.damaged[0].seqs.last),
        (bad_seq, Some(bad_seq))
    );
    let st = sluice_spool::stat(dir.path(), 128).expect("stat");
    assert_eq!(
        (st.oldest_seq, st.newest_seq, st.segments),
        (Some(1), Some(40), segs.len())
    );
    let mut dumped = Vec::new();
    sluice_spool::dump(dir.path(), 128, &mut dumped).expect("dump");
    assert_eq!(String::from_utf8_lossy(&dumped).lines().count(), 1 + 39);
    let after: Vec<Vec<u8>> = segs
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    assert_eq!(before, after, "operator tools are read-only");
    assert!(!dir.path().join(QUARANTINE_DIR).exists());

    // Recovery quarantines exactly that record; everything else stays readable.
    let (mut spool, report) = Spool::open(dir.path(), small_config()).expect("open");
    assert_eq!(report.quarantined.len(), 1, "{report:?}");
    let q = &report.quarantined[0];
    assert_eq!((q.offset, q.bytes), (off as u64, bad_len));
    assert_eq!((q.seqs.first, q.seqs.last), (bad_seq, Some(bad_seq)));
    let moved = q.moved_to.as_ref().expect("quarantined somewhere");
    assert_eq!(
        std::fs::read(moved).expect("quarantine file").len() as u64,
        bad_len
    );
    let seqs: Vec<u64> = read_all(&mut spool).iter().map(|r| r.seq.0).collect();
    let want: Vec<u64> = (1..=40).filter(|&s| s != bad_seq).collect();
    assert_eq!(seqs, want);
    drop(spool);

    // A second start finds nothing more to do.
    let (_, report) = Spool::open(dir.path(), small_config()).expect("open");
    assert!(report.is_clean(), "{report:?}");
}

#[test]
fn every_single_bit_flip_in_a_record_loses_at_most_that_record() {
    let fs = FaultFs::new(11);
    {
        let (mut spool, _) = open_fault(&fs, small_config());
        for i in 1..=6 {
            spool.append(&body(i)).expect("append");
        }
        spool.commit().expect("commit");
    }
    let seg = segment_path("/spool".as_ref(), 1);
    let pristine = fs.read_all(&seg).expect("segment");
    let start = 8 + FRAME_HEADER_LEN + body(1).len();
    let len = FRAME_HEADER_LEN + body(2).len();
    for bit in 0..len * 8 {
        let fs = FaultFs::new(bit as u64 + 1);
        let mut b = pristine.clone();
        b[start + bit / 8] ^= 1 << (bit % 8);
        assert!(fs.create_for_test(&seg, b));
        let (mut spool, report) = open_fault(&fs, small_config());
        let seqs: Vec<u64> = read_all(&mut spool).iter().map(|r| r.seq.0).collect();
        assert_eq!(seqs, vec![1, 3, 4, 5, 6], "bit {bit}: {report:?}");
        assert_eq!(report.skipped_ranges, 1, "bit {bit}");
    }
}

#[test]
fn a_crash_at_any_step_of_recovery_is_recovered_by_the_next_start() {
    // A spool with a damaged middle record and a torn tail.
    let make = |seed| {
        let fs = FaultFs::new(seed);
        {
            let (mut spool, _) = open_fault(&fs, small_config());
            for i in 1..=30 {
                spool.append(&body(i)).expect("append");
            }
            spool.commit().expect("commit");
        }
        let seg = segment_path("/spool".as_ref(), 1);
        let mut b = fs.read_all(&seg).expect("segment");
        b[8 + FRAME_HEADER_LEN + body(1).len() + 20] ^= 1;
        fs.overwrite(&seg, b);
        fs
    };
    let expected: Vec<u64> = {
        let fs = make(1);
        let (mut spool, _) = open_fault(&fs, small_config());
        read_all(&mut spool).iter().map(|r| r.seq.0).collect()
    };
    assert_eq!(expected.len(), 29);
    for n in 1..40 {
        let fs = make(n + 100);
        fs.fail_op(n);
        let first = sluice_spool::Spool::open_with_fs(
            std::sync::Arc::new(fs.clone()),
            "/spool",
            small_config(),
        );
        drop(first);
        fs.crash();
        let (mut spool, _) = open_fault(&fs, small_config());
        let seqs: Vec<u64> = read_all(&mut spool).iter().map(|r| r.seq.0).collect();
        assert_eq!(seqs, expected, "crash at op {n}");
    }
}

#[test]
fn a_damaged_cursor_file_redelivers_rather_than_refusing_to_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let (mut spool, _) = Spool::open(dir.path(), small_config()).expect("open");
        for i in 1..=5 {
            spool.append(&body(i)).expect("append");
        }
        spool.commit().expect("commit");
        spool.ack(SpoolSeq(2)).expect("ack");
        spool.ack(SpoolSeq(1)).expect("ack");
        spool.commit().expect("commit");
    }
    std::fs::write(dir.path().join(sluice_spool::CURSOR_FILE), b"garbage").expect("write");
    let (mut spool, report) = Spool::open(dir.path(), small_config()).expect("open");
    assert!(matches!(
        report.cursor,
        sluice_spool::CursorRecovery::Damaged(_)
    ));
    assert_eq!(read_all(&mut spool).len(), 5);
}
