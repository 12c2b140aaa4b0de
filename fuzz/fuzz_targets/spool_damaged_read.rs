//! Fuzz target for reading a spool whose committed records the medium changed under it
//! (crates/sluice-spool/src/spool.rs `Spool::read`, both directions), driven the way the
//! gateway's feeder drives it: on `CorruptRecord` skip exactly the cursor's seq and go on.
//!
//! Input: byte 0 picks the record count (1..=64), byte 1 the records per read (1..=16) and
//! byte 2 the direction (bit 0: newest first); the rest are damage operations of 4 bytes
//! (segment index, two-byte offset, xor mask) applied to the segment files of the open spool.
//! Checks, besides "no panic" and "no endless loop": every seq is either returned or skipped,
//! exactly once; returned records come in the cursor's direction with the exact bodies that
//! were appended; and only records with a changed byte in their own frame are skipped (damage
//! to a header does not cost the records after it).
#![no_main]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sluice_spool::fault::FaultFs;
use sluice_spool::{
    FsyncPolicy, FullPolicy, ReadCursor, Spool, SpoolConfig, SpoolError, SpoolRecord, SpoolSeq,
};

fn config() -> SpoolConfig {
    SpoolConfig {
        segment_bytes: 512,
        max_bytes: 1 << 20,
        when_full: FullPolicy::Block,
        fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
        max_record_bytes: 128,
        max_batch_bytes: 64 << 10,
        ack_window: 1024,
    }
}

/// Record `seq`'s body: its seq, then a seq-dependent filler of 0..=40 bytes.
fn body(seq: u64) -> Vec<u8> {
    let mut b = seq.to_le_bytes().to_vec();
    b.extend(std::iter::repeat_n(
        (seq * 7 % 251) as u8,
        (seq * 13 % 41) as usize,
    ));
    b
}

/// A frame as the spool writes it: crc32c of bytes 4.., body length, seq, body.
fn frame(seq: u64) -> Vec<u8> {
    let body = body(seq);
    let mut f = vec![0u8; 4];
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend_from_slice(&body);
    let crc = crc32c::crc32c(&f[4..]);
    f[..4].copy_from_slice(&crc.to_le_bytes());
    f
}

fn segments(fs: &FaultFs) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs
        .paths()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

fuzz_target!(|data: &[u8]| {
    let [a, b, c, ops @ ..] = data else {
        return;
    };
    let n = u64::from(*a % 64) + 1;
    let per_read = usize::from(*b % 16) + 1;
    let newest_first = c & 1 != 0;

    let fs = FaultFs::new(0);
    let (mut spool, _) =
        Spool::open_with_fs(Arc::new(fs.clone()), "/spool", config()).expect("open");
    for seq in 1..=n {
        assert_eq!(spool.append(&body(seq)).expect("append").seq, SpoolSeq(seq));
    }
    spool.commit().expect("commit");

    // Where each record's frame is (segment, byte range), before any damage.
    let segs = segments(&fs);
    let place: Vec<(usize, std::ops::Range<usize>)> = (1..=n)
        .map(|seq| {
            let f = frame(seq);
            segs.iter()
                .enumerate()
                .find_map(|(i, p)| {
                    let bytes = fs.read_all(p).expect("segment");
                    let at = bytes.windows(f.len()).position(|w| w == f)?;
                    Some((i, at..at + f.len()))
                })
                .expect("every committed record is in a segment")
        })
        .collect();

    // Records with a byte of their own frame changed.
    let mut touched = BTreeSet::new();
    for op in ops.chunks_exact(4) {
        let i = usize::from(op[0]) % segs.len();
        let mut bytes = fs.read_all(&segs[i]).expect("segment");
        if bytes.is_empty() || op[3] == 0 {
            continue;
        }
        let at = usize::from(u16::from_le_bytes([op[1], op[2]])) % bytes.len();
        bytes[at] ^= op[3];
        fs.overwrite(&segs[i], bytes);
        for (k, (seg, range)) in place.iter().enumerate() {
            if *seg == i && range.contains(&at) {
                touched.insert(k as u64 + 1);
            }
        }
    }

    let mut cur = if newest_first {
        ReadCursor::newest_first(SpoolSeq(n))
    } else {
        spool.read_cursor()
    };
    let mut got: Vec<SpoolRecord> = Vec::new();
    let mut skipped = Vec::new();
    let mut calls = 0u64;
    loop {
        calls += 1;
        assert!(calls <= 4 * n + 8, "reading does not progress");
        let before = got.len();
        match spool.read(&mut cur, per_read, 1 << 20, &mut got) {
            Ok(0) => break,
            Ok(k) => assert_eq!(got.len(), before + k),
            Err(SpoolError::CorruptRecord { .. }) => {
                assert_eq!(got.len(), before, "a failing read returns nothing");
                let bad = cur.next_seq().0;
                assert!((1..=n).contains(&bad), "skip target {bad} out of 1..={n}");
                skipped.push(bad);
                if newest_first {
                    if bad == 1 {
                        break;
                    }
                    cur = ReadCursor::newest_first(SpoolSeq(bad - 1));
                } else {
                    cur = ReadCursor::at(SpoolSeq(bad + 1));
                }
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    let seqs: Vec<u64> = got.iter().map(|r| r.seq.0).collect();
    for w in seqs.windows(2) {
        assert!(
            if newest_first {
                w[0] > w[1]
            } else {
                w[0] < w[1]
            },
            "out of order: {seqs:?}"
        );
    }
    for r in &got {
        assert_eq!(
            &r.body[..],
            &body(r.seq.0)[..],
            "record {} changed",
            r.seq.0
        );
    }
    let mut all: Vec<u64> = seqs.iter().chain(&skipped).copied().collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (1..=n).collect::<Vec<_>>(),
        "every seq returned or skipped once (returned {seqs:?}, skipped {skipped:?})"
    );
    for seq in &skipped {
        assert!(
            touched.contains(seq),
            "record {seq} was skipped but its frame is intact (skipped {skipped:?}, damaged {touched:?})"
        );
    }
});
