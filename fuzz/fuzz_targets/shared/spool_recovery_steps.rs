//! The steps of the `spool_recovery` fuzz target (see its file), shared with
//! `crates/sluice-spool/tests/fuzz_replay.rs`, which replays the inputs it crashed on.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sluice_spool::fault::FaultFs;
use sluice_spool::{
    segment_path, verify_with_fs, FsyncPolicy, FullPolicy, Spool, SpoolConfig, SpoolRecord,
    CURSOR_FILE, SEGMENT_MAGIC,
};

const DIR: &str = "/spool";
const MAX_RECORD: u32 = 256;

fn config() -> SpoolConfig {
    SpoolConfig {
        segment_bytes: 4096,
        max_bytes: 1 << 20,
        when_full: FullPolicy::Block,
        fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
        max_record_bytes: MAX_RECORD,
        max_batch_bytes: 64 << 10,
        ack_window: 1024,
    }
}

fn read_all(spool: &mut Spool) -> Vec<SpoolRecord> {
    let mut cur = spool.read_cursor();
    let mut out = Vec::new();
    while spool
        .read(&mut cur, 1000, 1 << 20, &mut out)
        .expect("read after recovery")
        > 0
    {}
    out
}

/// A frame as the spool writes it: crc32c of bytes 4.., body length, seq, body.
fn frame(seq: u64, body: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 4];
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend_from_slice(body);
    let crc = crc32c::crc32c(&f[4..]);
    f[..4].copy_from_slice(&crc.to_le_bytes());
    f
}

/// Script: a control byte `c`, then: `c & 0x80` → `c & 0x3f` raw bytes copied as they are;
/// otherwise a valid frame whose body is the next `c & 0x3f` bytes, with the next seq (one
/// seq skipped first when `c & 0x40`).
fn script(mut input: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut seq = 1u64;
    while let Some((&c, rest)) = input.split_first() {
        let n = usize::from(c & 0x3f).min(rest.len());
        let (chunk, rest) = rest.split_at(n);
        if c & 0x80 != 0 {
            out.extend_from_slice(chunk);
        } else {
            if c & 0x40 != 0 {
                seq += 1;
            }
            out.extend_from_slice(&frame(seq, chunk));
            seq += 1;
        }
        input = rest;
    }
    out
}

/// One input: build the files, recover, check.
pub fn run(data: &[u8]) {
    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let scripted;
    let mut rest = if shape & 8 != 0 {
        scripted = script(rest);
        &scripted[..]
    } else {
        rest
    };
    let fs = FaultFs::new(0);
    let dir = Path::new(DIR);
    if shape & 2 != 0 && rest.len() >= 20 {
        fs.create_for_test(&dir.join(CURSOR_FILE), rest[..20].to_vec());
        rest = &rest[20..];
    }
    let with_header = |bytes: &[u8]| {
        let mut file = Vec::with_capacity(bytes.len() + 8);
        if shape & 1 != 0 {
            file.extend_from_slice(&SEGMENT_MAGIC);
        }
        file.extend_from_slice(bytes);
        file
    };
    if shape & 4 != 0 && rest.len() >= 2 {
        let split = usize::from(rest[0]).min(rest.len() - 2) + 2;
        let second_seq = u64::from(rest[1]) + 1;
        let (a, b) = rest[2..].split_at(split - 2);
        fs.create_for_test(&segment_path(dir, 1), with_header(a));
        fs.create_for_test(&segment_path(dir, second_seq.max(2)), with_header(b));
    } else {
        fs.create_for_test(&segment_path(dir, 1), with_header(rest));
    }

    let (mut spool, _report) = Spool::open_with_fs(Arc::new(fs.clone()), DIR, config())
        .expect("damage must never stop the spool from opening");
    let after = verify_with_fs(&fs, dir, MAX_RECORD).expect("verify after recovery");
    assert_eq!(
        after.damaged_ranges, 0,
        "recovery left damage behind: {after:?}"
    );
    let records = read_all(&mut spool);
    for pair in records.windows(2) {
        assert!(
            pair[0].seq < pair[1].seq,
            "seqs out of order after recovery"
        );
    }
    assert!(records.iter().all(|r| r.body.len() <= MAX_RECORD as usize));
    drop(spool);

    let (mut spool, _) = Spool::open_with_fs(Arc::new(fs.clone()), DIR, config())
        .expect("a recovered spool reopens");
    let again = read_all(&mut spool);
    assert_eq!(records, again, "a second recovery changed what is readable");

    let appended = spool
        .append(b"after recovery")
        .expect("append after recovery");
    let job = spool
        .begin_commit()
        .expect("begin commit")
        .expect("something to commit");
    let committed = spool
        .finish_commit(job.run())
        .expect("commit after recovery");
    assert!(committed.durable_through >= appended.seq);
    let last = read_all(&mut spool)
        .pop()
        .expect("the new record is readable");
    assert_eq!(last.seq, appended.seq);
    assert_eq!(&last.body[..], b"after recovery");
}
