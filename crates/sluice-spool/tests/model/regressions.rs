//! Minimal schedules the model found (each failed before its fix), replayed as plain tests.

use super::*;

/// Found by this model: reopening a nearly full spool starts a new (empty) active segment,
/// and its 8-byte header takes the files past `max_bytes` (recovery cannot refuse to start,
/// and the format starts a segment per open). Appends are refused (`Full`) or drop the
/// oldest until the spool is within the bound again; the bound is documented as
/// `max_bytes` plus that one header right after an open.
#[rustfmt::skip]
#[test]
fn reopening_a_nearly_full_spool_stays_within_max_bytes() {
    use Op::*;
    let ops = [
        Append(51), Append(39), Append(2), Append(5), Append(56), Append(35), Append(2), Commit,
        Append(22), Append(49), Append(47), Append(57), Append(1), Append(58), Commit,
        Crash(false), Append(54), Append(38), Append(1), Append(52), Commit,
    ];
    run(1, false, &ops);
}

/// Found by this model: drop-oldest removed the oldest segment for an append whose rotation
/// then failed (the new segment file could not be created), and the append returned the I/O
/// error: the drop was counted in the spool's counters but reported to nobody, so the gateway
/// never counted those records (`sluice_spool_dropped_oldest_total`) while their devices,
/// waiting for the commit already out, got their PUBACK. Such a drop is now kept for
/// `Spool::take_dropped`.
#[rustfmt::skip]
#[test]
fn a_drop_before_a_failed_append_is_still_reported() {
    use Op::*;
    let ops = [
        Append(35), Append(13), Append(34), Append(1), Append(21), Append(58), Append(29),
        Append(28), Append(37), Append(9), Append(54), Append(23), Append(27), BeginCommit,
        Append(10), Append(31), Fail(2, 0), Append(53), Append(32), Append(3), Append(31),
        FinishCommit,
    ];
    run(1, true, &ops);
}

/// Found by this model: drop-oldest removed every segment holding records (sent, their
/// acknowledgements still to come; no commit after the drop), and the reopen found only empty segment files and an older cursor file, so
/// seqs started again at 1. Seqs that were durable, sent and maybe still awaiting the cloud's
/// acknowledgement were assigned to new records (an ack of the old record would acknowledge
/// the new one, unsent). Recovery now resumes above every segment file's name, and the first
/// commit after an open persists a cursor that recovery raised.
#[test]
fn seqs_are_never_reused_after_drop_oldest_emptied_the_spool() {
    use Op::*;
    let mut ops = vec![Append(59); 12];
    ops.extend([Commit, Send(20)]);
    ops.extend([Append(59); 12]);
    ops.push(Reopen);
    run(1, true, &ops);
}

/// Found by this model (the fix above, continued): a recovery that failed half way (the disk
/// full when it wrote the raised cursor) had already removed the empty segment files whose
/// names told how far seqs went; the next recovery started at 1 again. Empty files are now
/// removed only after the cursor is durable.
#[rustfmt::skip]
#[test]
fn a_failed_recovery_keeps_the_names_that_say_where_seqs_resume() {
    use Op::*;
    let ops = [Append(28), Commit, Send(1), Append(12), Append(53), Append(36), Append(21), Append(6), Append(39), Append(17), Append(12), Append(30), BeginCommit, DiskFull(true), Append(15), Append(40), Append(43), Append(43), Append(29), Append(28), Append(9), Append(45), Append(23), Reopen, Crash(false)];
    run(1098702961662763234, true, &ops);
}

/// Found by this model (the fix above, continued): after such a reopen, a crash before the
/// first commit lost the new segment's file, and with it the only trace of how far seqs went;
/// recovery now persists the raised cursor before removing empty segment files.
#[rustfmt::skip]
#[test]
fn a_crash_right_after_reopening_an_emptied_spool_does_not_reuse_seqs() {
    use Op::*;
    let ops = [
        Append(35), Append(54), Append(35), Append(20), Append(46), Commit, Append(56), Append(21),
        Fail(5, 0), Append(41), Append(53), Append(41), Append(50), Append(58), Append(18), Append(43),
        Append(54), Commit, Crash(false), Append(34), Append(34), Append(58), Append(46),
        Append(50), Append(33), Append(33), Append(56), Append(40), Append(56), Append(53),
        Append(13), Append(18), Append(47), Reopen,
    ];
    run(4847835438548052810, true, &ops);
}

/// Found by this model once it knew stalls: a commit whose cursor write the full disk
/// refused (its batch written) sealed the active segment at its committed end, and the new
/// segment's header took the spool's accounting past `max_bytes` (1025 of 1024). The seal
/// now waits while that header does not fit (another, sealed segment is there to be freed).
#[rustfmt::skip]
#[test]
fn sealing_on_a_full_disk_stays_within_max_bytes() {
    use Op::*;
    let ops = [
        Append(0), Append(10), Append(28), Append(17), Append(26), Append(30), Append(26), Commit,
        Append(0), Append(0), Append(0), Crash(false), Append(19), Append(11), Append(29),
        Append(31), Append(13), Append(39), Commit, Append(36), Append(15), Append(8), Append(40),
        Append(31), Commit, Crash(false), Append(19), Commit, Append(8), Append(29), Append(0),
        Send(1), Append(0), CloudAck(0), BeginCommit, Append(0), Fail(3, 1), Append(0),
        FinishCommit,
    ];
    run(14505948067176950008, false, &ops);
}

/// Found by this model while reconciling stalls with seq resumption: a restart on a
/// read-only file system found a header-only segment file (written by the previous run's
/// first commit) it could not remove. Kept beside the new active segment it would have taken
/// the spool past its bound; such a recovery fails (the gateway reopens it every second)
/// until the file system is writable, and only an empty spool keeps empty files it cannot
/// remove yet.
#[rustfmt::skip]
#[test]
fn a_read_only_restart_with_an_empty_segment_file_stays_within_max_bytes() {
    use Op::*;
    let ops = [
        Append(39), Append(20), Append(41), Append(30), Append(0), Append(50), Commit,
        Crash(false), Append(55), Append(15), Commit, Append(13), Append(41), Append(45),
        Append(40), Commit, Commit, Append(13), Commit, Append(57), Commit, Append(52),
        Append(48), Append(2), Append(0), Append(0), Append(0), Append(0), Commit, Crash(false),
        Commit, ReadOnly(true),
    ];
    run(1, false, &ops);
}

/// Found by this model once it remounted read-only: a segment trimmed just before a crash
/// (its removal not durable yet) came back, and a restart on a read-only file system keeps
/// it (recovery cannot remove it; the first commit that can write trims it), so the spool
/// opens above `max_bytes` by that acknowledged segment as well as the new header. The
/// model's bound after an open counts such segments.
#[rustfmt::skip]
#[test]
fn a_read_only_restart_keeps_acknowledged_segments_until_it_can_write() {
    use Op::*;
    let ops = [
        Append(4), Commit, Append(41), Append(0), Append(0), Append(35), Append(25),
        Crash(false), Append(49), Append(50), Commit, Append(18), Append(42), Append(55),
        Append(7), Append(39), Append(26), Commit, Append(0), Commit, Crash(false), Append(39),
        Send(1), Append(8), FinishCommit, Append(44), Append(50), BeginRead(1), CloudAck(0),
        Append(27), Append(57), Commit, Append(54), Commit, ReadOnly(true),
    ];
    run(7831771662683589940, false, &ops);
}
