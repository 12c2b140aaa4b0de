//! End-to-end tests of the spool when its storage gives out under the running gateway, on a
//! real file system: a 16 MiB tmpfs that fills up while the cloud is down (and is freed by
//! the drain), one filled by another program's file (freed by deleting it), and a tmpfs
//! remounted read-only and back. Against a real Mosquitto cloud over TLS 1.3 behind a gate
//! (`spool_support`). Each test mounts its own tmpfs (`sluice_testkit::Tmpfs`; root only: a
//! test that cannot mount prints why and passes without checking anything), unmounted when
//! it ends.
//!
//! What a user expects (docs/spool.md, "When the disk is full or read-only"): devices are
//! back-pressured (PUBACKs withheld, connections kept), nothing acknowledged is lost, the
//! cloud gets what is on disk as soon as it is reachable, and the spool accepts again without
//! a restart once there is room (or the file system is writable).

mod common;
mod spool_support;

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{TestClient, Tmpfs};
use spool_support::*;

/// A tmpfs of `size` for one test, or `None` (printing why the test skips) when it cannot
/// be mounted (not root).
fn tmpfs(size: &str) -> Option<Tmpfs> {
    match Tmpfs::mount(size) {
        Ok(fs) => Some(fs),
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

/// A numbered payload of about 1 KiB (`index_of` reads the number back).
fn kib_payload(device: &str, i: usize) -> String {
    format!("{}{}", payload(device, i), "x".repeat(1000))
}

/// Where a publishing device stopped.
struct Held {
    /// Indexes the gateway acknowledged (PUBACK).
    acked: Vec<usize>,
    /// Published and not acknowledged yet, oldest first: (index, packet id).
    pending: VecDeque<(usize, u16)>,
    /// The next index to publish.
    next: usize,
    /// Why it stopped: `None` when no PUBACK came for `hold` (back-pressure), else the error
    /// (the gateway closed the connection).
    closed: Option<String>,
}

/// Publishes `range` at QoS 1 keeping up to `window` unacknowledged, until it is done, no
/// PUBACK came for `hold`, or the connection failed.
async fn publish_until_held(
    dev: &mut TestClient,
    range: std::ops::Range<usize>,
    window: usize,
    hold: Duration,
) -> Held {
    let mut held = Held {
        acked: Vec::new(),
        pending: VecDeque::new(),
        next: range.start,
        closed: None,
    };
    keep_publishing(dev, &mut held, range.end, window, hold).await;
    held
}

/// Goes on publishing from `held.next` to `end` (see [`publish_until_held`]).
async fn keep_publishing(
    dev: &mut TestClient,
    held: &mut Held,
    end: usize,
    window: usize,
    hold: Duration,
) {
    dev.set_ack_timeout(hold);
    for i in held.next..end {
        if held.pending.len() >= window {
            let (j, id) = *held.pending.front().expect("pending");
            match dev.wait_ack(id).await {
                Ok(code) => {
                    assert_eq!(code, 0, "PUBACK code for message {j}");
                    held.acked.push(j);
                    held.pending.pop_front();
                }
                Err(e) if e.to_string().starts_with("no PUBACK") => return,
                Err(e) => {
                    held.closed = Some(format!("{e:#}"));
                    return;
                }
            }
        }
        match dev
            .publish_no_wait("dev/d1", kib_payload("d1", i), QoS::AtLeastOnce, false)
            .await
        {
            Ok(id) => {
                held.pending.push_back((i, id.expect("packet id")));
                held.next = i + 1;
            }
            Err(e) => {
                held.closed = Some(format!("{e:#}"));
                return;
            }
        }
    }
}

/// [`publish_until_held`] until the gateway says its spool is stalled (a pause of the
/// gateway alone, on a busy machine, does not count), the connection failed, or `range` is
/// done; at most ten holds.
async fn publish_until_stalled(
    gw: &sluice::app::RunningGateway,
    dev: &mut TestClient,
    range: std::ops::Range<usize>,
    window: usize,
) -> Held {
    let mut held = publish_until_held(dev, range.clone(), window, Duration::from_secs(3)).await;
    for _ in 0..10 {
        if held.closed.is_some()
            || held.next == range.end
            || metric_sum(&gw.metrics_text(), "sluice_spool_stalled{") >= 1.0
        {
            break;
        }
        keep_publishing(dev, &mut held, range.end, window, Duration::from_secs(3)).await;
    }
    held
}

/// Receives from the cloud until every index in `want` arrived (duplicates allowed) or
/// nothing came for `quiet`; returns what is still missing.
async fn receive_all(
    sub: &mut TestClient,
    want: &BTreeSet<usize>,
    quiet: Duration,
) -> BTreeSet<usize> {
    let mut missing = want.clone();
    while !missing.is_empty() {
        match sub.recv(quiet).await.expect("cloud subscriber") {
            Some(p) => {
                missing.remove(&index_of(&p.payload).1);
            }
            None => break,
        }
    }
    missing
}

fn spool_gateway(t: &GatedCloud, spool_dir: &Path) -> sluice::app::RunningGateway {
    let text = format!(
        "[spool]\ndir = \"{}\"\nfsync = \"never\"\nack = \"spool\"\n{}",
        spool_dir.display(),
        t.cloud
            .uplink_toml(Some(t.gate.addr), &format!("\n{NO_AGGREGATION}"))
    );
    gateway_mqtt(1, "max_packet_size = \"4KiB\"", &text)
}

/// The spool's state as /readyz and the status document show it.
fn readiness(gw: &sluice::app::RunningGateway) -> serde_json::Value {
    sluice::admin::health::readiness(&gw.status_json())
}

fn dir_in(fs: &Tmpfs) -> PathBuf {
    fs.path().join("spool")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_messages_reach_the_cloud_when_the_spool_disk_fills_and_the_spool_resumes_when_the_drain_frees_it(
) {
    const N: usize = 20_000;
    let Some(fs) = tmpfs("16m") else {
        return;
    };
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = spool_gateway(&t, &dir_in(&fs));
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;

    // The cloud is down: the spool fills the 16 MiB disk long before 20,000 × 1 KiB.
    let held = publish_until_stalled(&gw, &mut dev, 0..N, 16).await;
    assert!(
        held.next < N,
        "the disk never filled; spool metrics:\n{}",
        metric_lines(&gw, "sluice_spool")
    );
    assert!(held.acked.len() > 5_000, "acked only {}", held.acked.len());
    // What a user sees while the disk is full (checked after the delivery below, which is
    // what matters most).
    let metrics_full = gw.metrics_text();
    let ready_full = readiness(&gw);
    let status_full = gw.status_json();
    let still_open = held.closed.is_none() && !dev.expect_closed(Duration::from_millis(300)).await;

    // The cloud comes back: everything acknowledged to the device reaches it.
    t.gate.set_open(true);
    let reopened = std::time::Instant::now();
    let acked: BTreeSet<usize> = held.acked.iter().copied().collect();
    let missing = receive_all(&mut t.sub, &acked, Duration::from_secs(30)).await;
    eprintln!(
        "figures: {} of {N} acknowledged before the 16 MiB disk filled; all of them at the cloud {:?} after it came back",
        acked.len(),
        reopened.elapsed()
    );
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged messages did not reach the cloud (first {:?}); device stopped: {:?}; spool metrics:\n{}",
        missing.len(),
        acked.len(),
        missing.iter().next(),
        held.closed,
        metric_lines(&gw, "sluice_spool")
    );

    // While full: the device was back-pressured, not disconnected; the stall is visible.
    assert!(
        still_open,
        "the device was disconnected instead of back-pressured: {:?}",
        held.closed
    );
    assert_eq!(
        metric_sum(&metrics_full, "sluice_spool_stalled{"),
        1.0,
        "{metrics_full}"
    );
    assert!(metric_sum(&metrics_full, "sluice_spool_storage_errors_total{") >= 1.0);
    assert_eq!(
        metric_sum(&metrics_full, "sluice_spool_failures_total"),
        0.0,
        "a full disk is not a failure that reopens the spool"
    );
    assert_eq!(ready_full["ready"], false, "{ready_full}");
    assert!(
        ready_full["reason"]
            .as_str()
            .is_some_and(|r| r.contains("spool") && r.contains("no space")),
        "{ready_full}"
    );
    assert_eq!(status_full["spool"]["stalled"], "no_space", "{status_full}");

    // The drain freed the disk: the withheld PUBACKs come and the device carries on, without
    // a restart; every message reaches the cloud.
    let rest = publish_until_held(&mut dev, held.next..N, 16, Duration::from_secs(30)).await;
    assert!(rest.closed.is_none(), "device closed: {:?}", rest.closed);
    assert_eq!(rest.next, N, "the spool did not resume");
    for (j, id) in held.pending.iter().chain(rest.pending.iter()) {
        assert_eq!(dev.wait_ack(*id).await.expect("PUBACK"), 0, "message {j}");
    }
    let want: BTreeSet<usize> = (0..N).filter(|i| !acked.contains(i)).collect();
    let missing = receive_all(&mut t.sub, &want, Duration::from_secs(30)).await;
    assert!(
        missing.is_empty(),
        "{} messages after the stall did not reach the cloud (first {:?})",
        missing.len(),
        missing.iter().next()
    );
    eprintln!(
        "figures: all {N} at the cloud {:?} after it came back",
        reopened.elapsed()
    );
    assert!(
        eventually(WAIT, || metric_sum(
            &gw.metrics_text(),
            "sluice_spool_stalled{"
        ) == 0.0)
        .await
    );
    assert_eq!(readiness(&gw)["ready"], true);
    gw.shutdown();
}

/// `mount -o remount,{opts}`, retried while the kernel says the mount is busy (a commit
/// holds a segment open for writing for the instant of its write).
async fn remount_retrying(fs: &Tmpfs, opts: &str) {
    let mut last = String::new();
    for _ in 0..500 {
        match fs.remount(opts) {
            Ok(()) => return,
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("mount -o remount,{opts} kept failing: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_file_system_remounted_read_only_back_pressures_devices_and_remounting_it_read_write_resumes_the_spool(
) {
    const N: usize = 3_000;
    let Some(fs) = tmpfs("64m") else {
        return;
    };
    let mut t = GatedCloud::start_closed("dev/#").await;
    t.gate.set_open(true);
    let gw = spool_gateway(&t, &dir_in(&fs));
    assert!(eventually(WAIT, || uplink_connected(&gw)).await);
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    let before = publish_until_held(&mut dev, 0..500, 16, Duration::from_secs(10)).await;
    assert_eq!(before.next, 500);
    assert!(before.closed.is_none());

    // The operator remounts the spool's file system read-only under the running gateway
    // (possible: the spool holds no file open for writing between writes).
    remount_retrying(&fs, "ro").await;
    let held = publish_until_stalled(&gw, &mut dev, 500..N, 16).await;
    assert!(
        held.next < N,
        "the spool never noticed; spool metrics:\n{}",
        metric_lines(&gw, "sluice_spool")
    );
    let metrics_ro = gw.metrics_text();
    let ready_ro = readiness(&gw);
    let status_ro = gw.status_json();
    let still_open = held.closed.is_none() && !dev.expect_closed(Duration::from_millis(300)).await;

    // Everything acknowledged reaches the cloud meanwhile.
    let acked: BTreeSet<usize> = before.acked.iter().chain(&held.acked).copied().collect();
    let missing = receive_all(&mut t.sub, &acked, Duration::from_secs(20)).await;
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged messages did not reach the cloud (first {:?})",
        missing.len(),
        acked.len(),
        missing.iter().next()
    );
    assert!(still_open, "device disconnected: {:?}", held.closed);
    let ro = "sluice_spool_stalled{shard=\"0\",uplink=\"cloud\",reason=\"read_only\"}";
    assert_eq!(metric_sum(&metrics_ro, ro), 1.0, "{metrics_ro}");
    assert!(
        metric_sum(
            &metrics_ro,
            "sluice_spool_storage_errors_total{shard=\"0\",uplink=\"cloud\",reason=\"read_only\"}"
        ) >= 1.0
    );
    assert_eq!(metric_sum(&metrics_ro, "sluice_spool_failures_total"), 0.0);
    assert_eq!(ready_ro["ready"], false);
    assert!(
        ready_ro["reason"]
            .as_str()
            .is_some_and(|r| r.contains("read-only")),
        "{ready_ro}"
    );
    assert_eq!(status_ro["spool"]["stalled"], "read_only");

    // Writable again: the withheld PUBACKs come, the device carries on, nothing is missing.
    fs.remount("rw").expect("remount rw");
    let writable = std::time::Instant::now();
    let rest = publish_until_held(&mut dev, held.next..N, 16, Duration::from_secs(30)).await;
    assert!(rest.closed.is_none(), "device closed: {:?}", rest.closed);
    assert_eq!(rest.next, N, "the spool did not resume");
    for (j, id) in held.pending.iter().chain(rest.pending.iter()) {
        assert_eq!(dev.wait_ack(*id).await.expect("PUBACK"), 0, "message {j}");
    }
    let want: BTreeSet<usize> = (0..N).filter(|i| !acked.contains(i)).collect();
    let missing = receive_all(&mut t.sub, &want, Duration::from_secs(30)).await;
    assert!(
        missing.is_empty(),
        "{} messages after the remount did not reach the cloud (first {:?})",
        missing.len(),
        missing.iter().next()
    );
    eprintln!(
        "figures: {} acknowledged before the remount, {} more before the spool stalled read-only, all at the cloud; all {N} acknowledged and at the cloud {:?} after remount,rw",
        before.acked.len(),
        held.acked.len(),
        writable.elapsed()
    );
    assert!(
        eventually(WAIT, || metric_sum(
            &gw.metrics_text(),
            "sluice_spool_stalled{"
        ) == 0.0)
        .await
    );
    assert_eq!(readiness(&gw)["ready"], true);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_filled_by_another_program_stalls_the_spool_and_deleting_that_file_resumes_it() {
    const N: usize = 2_000;
    let Some(fs) = tmpfs("16m") else {
        return;
    };
    // The cloud is down throughout the stall, so no acknowledgement can free the spool's own
    // segments: only the operator can make room.
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = spool_gateway(&t, &dir_in(&fs));
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    let before = publish_until_held(&mut dev, 0..300, 16, Duration::from_secs(10)).await;
    assert_eq!(before.next, 300);

    // Something else on the same file system (a log, say) takes all its space.
    let filler = fs.fill("filler").expect("fill the disk");
    let held = publish_until_stalled(&gw, &mut dev, 300..N, 16).await;
    assert!(held.next < N, "the spool never noticed the full disk");
    assert!(held.closed.is_none(), "{:?}", held.closed);
    let no_space = "sluice_spool_stalled{shard=\"0\",uplink=\"cloud\",reason=\"no_space\"}";
    assert_eq!(
        metric_sum(&gw.metrics_text(), no_space),
        1.0,
        "{}",
        metric_lines(&gw, "sluice_spool")
    );
    // Still stalled a few probes later: the spool does not resume into a disk with no room.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(metric_sum(&gw.metrics_text(), no_space), 1.0);

    // The operator deletes the file: the spool accepts again by itself, cloud still down.
    std::fs::remove_file(&filler).expect("remove filler");
    let freed = std::time::Instant::now();
    let rest = publish_until_held(&mut dev, held.next..N, 16, Duration::from_secs(30)).await;
    assert!(rest.closed.is_none(), "device closed: {:?}", rest.closed);
    assert_eq!(rest.next, N, "the spool did not resume");
    for (j, id) in held.pending.iter().chain(rest.pending.iter()) {
        assert_eq!(dev.wait_ack(*id).await.expect("PUBACK"), 0, "message {j}");
    }
    let resumed = freed.elapsed();
    assert_eq!(metric_sum(&gw.metrics_text(), no_space), 0.0);

    // The cloud comes back: every message arrives.
    t.gate.set_open(true);
    let want: BTreeSet<usize> = (0..N).collect();
    let missing = receive_all(&mut t.sub, &want, Duration::from_secs(30)).await;
    assert!(missing.is_empty(), "{} messages lost", missing.len());
    eprintln!(
        "figures: disk filled by another file after {} acknowledged, {} more while it filled; all {N} acknowledged {resumed:?} after the file was deleted, all at the cloud",
        before.acked.len(),
        held.acked.len(),
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_restarted_on_a_read_only_spool_sends_what_it_holds_and_resumes_once_writable() {
    const N: usize = 600;
    let Some(fs) = tmpfs("16m") else {
        return;
    };
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = spool_gateway(&t, &dir_in(&fs));
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    let before = publish_until_held(&mut dev, 0..300, 16, Duration::from_secs(10)).await;
    assert_eq!(before.next, 300);
    for (j, id) in &before.pending {
        assert_eq!(dev.wait_ack(*id).await.expect("PUBACK"), 0, "message {j}");
    }
    drop(dev);
    gw.shutdown();

    // The file system goes read-only while the gateway is down (the kernel after an error,
    // or the operator); the gateway starts anyway and sends what its spool holds.
    fs.remount("ro").expect("remount ro");
    let gw = spool_gateway(&t, &dir_in(&fs));
    t.gate.set_open(true);
    let want: BTreeSet<usize> = (0..300).collect();
    let missing = receive_all(&mut t.sub, &want, Duration::from_secs(20)).await;
    assert!(
        missing.is_empty(),
        "{} of 300 acknowledged messages did not reach the cloud",
        missing.len()
    );

    // New messages wait: the spool cannot store them.
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    let held = publish_until_stalled(&gw, &mut dev, 300..N, 16).await;
    assert!(held.next < N && held.closed.is_none(), "{:?}", held.closed);
    let ro = "sluice_spool_stalled{shard=\"0\",uplink=\"cloud\",reason=\"read_only\"}";
    assert_eq!(
        metric_sum(&gw.metrics_text(), ro),
        1.0,
        "{}",
        metric_lines(&gw, "sluice_spool")
    );

    fs.remount("rw").expect("remount rw");
    let rest = publish_until_held(&mut dev, held.next..N, 16, Duration::from_secs(30)).await;
    assert_eq!(rest.next, N, "the spool did not resume: {:?}", rest.closed);
    for (j, id) in held.pending.iter().chain(rest.pending.iter()) {
        assert_eq!(dev.wait_ack(*id).await.expect("PUBACK"), 0, "message {j}");
    }
    let want: BTreeSet<usize> = (300..N).collect();
    let missing = receive_all(&mut t.sub, &want, Duration::from_secs(30)).await;
    assert!(missing.is_empty(), "{} messages lost", missing.len());
    gw.shutdown();
}
