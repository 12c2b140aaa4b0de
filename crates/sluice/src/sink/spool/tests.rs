//! Unit tests of the gateway side of the spool on a current-thread runtime: commits and
//! device acks, the live and backlog streams across outages, acks ahead of the engine's
//! window, and a stalled disk that must not stall the shard thread.

use super::*;
use crate::message::ack::DeviceAcks;
use crate::sink::UplinkMessage;
use bytes::Bytes;
use std::path::Path;

fn rt() -> (tokio::runtime::Runtime, tokio::task::LocalSet) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    (rt, tokio::task::LocalSet::new())
}

fn setup(dir: &Path, extra: &str, ack_window: u64) -> (Rc<UplinkSpool>, Rc<UplinkQueue>) {
    setup_with_queue(dir, extra, ack_window, 1 << 20)
}

fn setup_with_queue(
    dir: &Path,
    extra: &str,
    ack_window: u64,
    queue_bytes: usize,
) -> (Rc<UplinkSpool>, Rc<UplinkQueue>) {
    let config = crate::config::parse(&format!(
        "[spool]\ndir = \"{}\"\nfsync = \"never\"\n{extra}\n",
        dir.display()
    ))
    .expect("config");
    let mut engine = config.spool.engine_config(1, 1, 64 << 10, ack_window);
    engine.max_bytes = 64 << 20;
    let sdir = spool_dir(dir, "cloud", 0);
    let (spool, _) = Spool::open(&sdir, engine.clone()).expect("open");
    let opened = OpenedSpool {
        spool,
        dir: sdir,
        engine,
        metrics: Arc::default(),
    };
    let queue = Rc::new(UplinkQueue::new(queue_bytes));
    let spool = UplinkSpool::new(0, "cloud", &config, opened, queue.clone());
    (spool, queue)
}

fn body(i: usize) -> Vec<u8> {
    encode_message(
        &ByteString::from("dev"),
        &ByteString::from("t"),
        &Bytes::from(format!("{i}")),
        QoS::AtLeastOnce,
        false,
        Instant::now(),
    )
    .expect("encodes")
}

/// Every message the queue holds, as the session takes them: (payload, is backlog, the
/// message, to finish with `complete_with`).
fn drain_queue(q: &UplinkQueue) -> Vec<(String, bool, UplinkMessage)> {
    std::iter::from_fn(|| q.take_next(true, false))
        .map(|t| {
            // As the session does once a message is finished.
            q.release_msg(&t.msg);
            assert!(t.msg.stored.is_some(), "spooled messages know their record");
            let backlog = t.msg.is_backlog();
            let payload = String::from_utf8(t.msg.payload.to_vec()).expect("utf-8");
            (payload, backlog, t.msg)
        })
        .collect()
}

#[test]
fn a_device_is_acked_only_after_the_commit_that_holds_its_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let (spool, _q) = setup(dir.path(), "ack = \"spool\"", 64);
        let dev = DeviceAcks::new();
        let token = AckToken::new(&dev, 7);
        assert_eq!(
            spool.append(&body(1), QoS::AtLeastOnce, Some(token)).await,
            Appended::Stored
        );
        assert!(dev.drain().is_empty(), "not durable yet");
        spool.commit_once().await;
        assert_eq!(dev.drain(), vec![7]);
    });
}

#[test]
fn records_wait_while_the_link_is_down_then_drain_as_backlog_and_later_ones_are_live() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let (spool, q) = setup(dir.path(), "", 64);
        for i in 0..5 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.fill().await;
        assert!(
            q.is_empty(),
            "nothing is handed over while the uplink is down"
        );
        spool.link_changed(true);
        spool.fill().await;
        for i in 5..8 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.fill().await;
        let got = drain_queue(&q);
        let order: Vec<(String, bool)> = got.iter().map(|(p, b, _)| (p.clone(), *b)).collect();
        let want: Vec<(String, bool)> = (5..8)
            .map(|i| (i.to_string(), false))
            .chain((0..5).map(|i| (i.to_string(), true)))
            .collect();
        assert_eq!(
            order, want,
            "live first when both wait (turn = false), backlog in order"
        );
        for (_, _, t) in got {
            t.complete_with(0);
        }
        spool.commit_once().await;
        assert_eq!(spool.metrics.unacked_records.get(), 0);
    });
}

/// Found by the outage scenario under CPU starvation: a message written before the cut and
/// resent after the reconnect went after the first backlog records, which are later
/// messages of the same devices (the cloud saw seq 90 before seq 89).
#[test]
fn after_a_reconnect_the_live_streams_older_records_go_before_the_backlog_on_its_turn() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let (spool, q) = setup(dir.path(), "", 64);
        spool.link_changed(true);
        for i in 0..3 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.fill().await;
        // 0 and 1 are written to the cloud; the connection drops before their acks.
        let sent: Vec<_> = (0..2)
            .map(|_| q.take_next(true, false).expect("live"))
            .collect();
        spool.link_changed(false);
        q.requeue_front_queued(
            sent.into_iter()
                .map(|t| crate::sink::outbox::queue::Queued {
                    msg: t.msg,
                    resend: true,
                })
                .collect(),
        );
        for i in 3..6 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.link_changed(true);
        spool.fill().await;
        // Every take is the backlog's turn: still 0, 1, 2 (live, older) before 3, 4, 5.
        let order: Vec<String> = std::iter::from_fn(|| q.take_next(true, true))
            .map(|t| {
                q.release_msg(&t.msg);
                String::from_utf8(t.msg.payload.to_vec()).expect("utf-8")
            })
            .collect();
        assert_eq!(order, ["0", "1", "2", "3", "4", "5"]);
    });
}

#[test]
fn acks_far_ahead_of_the_engine_window_are_kept_as_ranges_and_applied_later() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let (spool, q) = setup(dir.path(), "drain_order = \"newest-first\"", 4);
        for i in 0..300 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.link_changed(true);
        let mut tokens = Vec::new();
        while tokens.len() < 300 {
            spool.fill().await;
            let got = drain_queue(&q);
            assert!(!got.is_empty(), "the feeder makes progress");
            tokens.extend(got);
        }
        let order: Vec<String> = tokens.iter().map(|(p, _, _)| p.clone()).collect();
        assert_eq!(
            order,
            (0..300).rev().map(|i| i.to_string()).collect::<Vec<_>>()
        );
        // Acks arrive newest first, up to 296 above the engine's 4-seq window.
        for (_, _, t) in tokens {
            t.complete_with(0);
        }
        let inner = spool.inner.borrow();
        let s = inner.spool.as_ref().expect("open");
        assert_eq!(s.ack_cursor(), SpoolSeq(300));
        assert!(inner.acks.is_empty());
    });
}

#[test]
fn a_second_outage_during_a_newest_first_drain_loses_and_repeats_nothing() {
    second_outage_during_a_drain(true);
}

#[test]
fn a_second_outage_during_an_oldest_first_drain_loses_and_repeats_nothing() {
    second_outage_during_a_drain(false);
}

fn second_outage_during_a_drain(newest_first: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    let order = if newest_first {
        "drain_order = \"newest-first\""
    } else {
        ""
    };
    local.block_on(&rt, async {
        // A small queue: each fill hands over only part of the backlog.
        let (spool, q) = setup_with_queue(dir.path(), order, 64, 8 << 10);
        for i in 0..100 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.link_changed(true);
        spool.fill().await;
        let mut seen: Vec<usize> = Vec::new();
        let first = drain_queue(&q);
        assert!(!first.is_empty() && first.len() < 100, "{}", first.len());
        for (p, _, t) in first {
            seen.push(p.parse().expect("number"));
            t.complete_with(0);
        }
        // The link drops mid-drain; more records pile up; it comes back.
        spool.link_changed(false);
        for i in 100..150 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        spool.link_changed(true);
        for _ in 0..100 {
            spool.fill().await;
            let got = drain_queue(&q);
            if got.is_empty() {
                break;
            }
            for (p, _, t) in got {
                seen.push(p.parse().expect("number"));
                t.complete_with(0);
            }
        }
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..150).collect::<Vec<_>>(),
            "each record once: {seen:?}"
        );
        let pos = |n: usize| seen.iter().position(|&x| x == n).expect("seen");
        if newest_first {
            assert!(
                pos(149) < pos(0),
                "the newer outage's records go before the older rest"
            );
        } else {
            assert_eq!(seen, (0..150).collect::<Vec<_>>(), "oldest first, in order");
        }
        spool.commit_once().await;
        assert_eq!(spool.metrics.unacked_records.get(), 0);
    });
}

/// A file system whose reads block while its gate is closed: the fault of a slow disk
/// under a backlog that is not in the page cache.
#[derive(Clone, Default)]
struct GatedFs {
    gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    blocked_reads: Arc<std::sync::atomic::AtomicUsize>,
}

impl GatedFs {
    fn set_closed(&self, closed: bool) {
        *self.gate.0.lock().expect("gate") = closed;
        self.gate.1.notify_all();
    }
    fn is_closed(&self) -> bool {
        *self.gate.0.lock().expect("gate")
    }
    fn wrap(&self, f: Arc<dyn sluice_spool::SpoolFile>) -> Arc<dyn sluice_spool::SpoolFile> {
        Arc::new(GatedFile {
            fs: self.clone(),
            file: f,
        })
    }
}

struct GatedFile {
    fs: GatedFs,
    file: Arc<dyn sluice_spool::SpoolFile>,
}

impl sluice_spool::SpoolFile for GatedFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let mut closed = self.fs.gate.0.lock().expect("gate");
        if *closed {
            self.fs
                .blocked_reads
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        while *closed {
            closed = self.fs.gate.1.wait(closed).expect("gate");
        }
        drop(closed);
        self.file.read_exact_at(buf, offset)
    }
    fn append(&self, buf: &[u8]) -> std::io::Result<()> {
        self.file.append(buf)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.file.sync()
    }
    fn size(&self) -> std::io::Result<u64> {
        self.file.size()
    }
    fn truncate(&self, len: u64) -> std::io::Result<()> {
        self.file.truncate(len)
    }
}

impl sluice_spool::SpoolFs for GatedFs {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        sluice_spool::RealFs.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<(String, u64)>> {
        sluice_spool::RealFs.list(dir)
    }
    fn create(
        &self,
        path: &Path,
        exclusive: bool,
    ) -> std::io::Result<Arc<dyn sluice_spool::SpoolFile>> {
        Ok(self.wrap(sluice_spool::RealFs.create(path, exclusive)?))
    }
    fn open(&self, path: &Path) -> std::io::Result<Arc<dyn sluice_spool::SpoolFile>> {
        Ok(self.wrap(sluice_spool::RealFs.open(path)?))
    }
    fn open_read(&self, path: &Path) -> std::io::Result<Arc<dyn sluice_spool::SpoolFile>> {
        Ok(self.wrap(sluice_spool::RealFs.open_read(path)?))
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        sluice_spool::RealFs.rename(from, to)
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        sluice_spool::RealFs.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        sluice_spool::RealFs.sync_dir(dir)
    }
}

#[test]
fn a_device_on_the_shard_gets_its_puback_while_a_backlog_read_waits_for_the_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    let fs = GatedFs::default();
    // If reads ran on the shard thread, the blocked read would stall this whole test
    // (the shard's runtime): a watchdog opens the gate after 10 s so it fails instead.
    let (finished, watch_finish) = std::sync::mpsc::channel::<()>();
    let watchdog = {
        let fs = fs.clone();
        std::thread::spawn(move || {
            let _ = watch_finish.recv_timeout(Duration::from_secs(10));
            fs.set_closed(false);
        })
    };
    local.block_on(&rt, async {
        let config = crate::config::parse(&format!(
            "[spool]\ndir = \"{}\"\nfsync = \"never\"\nack = \"spool\"\n",
            dir.path().display()
        ))
        .expect("config");
        let engine = config.spool.engine_config(1, 1, 64 << 10, 64);
        let sdir = spool_dir(dir.path(), "cloud", 0);
        let (engine_spool, _) =
            Spool::open_with_fs(Arc::new(fs.clone()), &sdir, engine.clone()).expect("open");
        let opened = OpenedSpool {
            spool: engine_spool,
            dir: sdir,
            engine,
            metrics: Arc::default(),
        };
        let q = Rc::new(UplinkQueue::new(1 << 20));
        let spool = UplinkSpool::new(0, "cloud", &config, opened, q.clone());
        // A backlog piled up during an outage.
        for i in 0..50 {
            spool.append(&body(i), QoS::AtLeastOnce, None).await;
        }
        spool.commit_once().await;
        let (stop, shutdown) = watch::channel(false);
        let tasks = spool.spawn_tasks(shutdown);
        // The disk stalls; the uplink comes back and the feeder starts reading backlog.
        fs.set_closed(true);
        spool.link_changed(true);
        let stalled = tokio::time::timeout(Duration::from_secs(30), async {
            while fs.blocked_reads.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(stalled.is_ok(), "the feeder reads the backlog");
        // A device on this shard publishes meanwhile: its PUBACK comes after the commit.
        let dev = DeviceAcks::new();
        let token = AckToken::new(&dev, 9);
        assert_eq!(
            spool.append(&body(50), QoS::AtLeastOnce, Some(token)).await,
            Appended::Stored
        );
        let acked = tokio::time::timeout(Duration::from_secs(30), async {
            while dev.drain().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(acked.is_ok(), "the device is acknowledged");
        assert!(
            fs.is_closed(),
            "the device's PUBACK waited until the stalled spool read finished: the read blocked the shard thread"
        );
        // The disk recovers: the backlog, then the live record, all in order.
        fs.set_closed(false);
        let mut got: Vec<(String, bool)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.len() < 51 && Instant::now() < deadline {
            for (p, backlog, t) in drain_queue(&q) {
                got.push((p, backlog));
                t.complete_with(0);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let backlog: Vec<String> = got.iter().filter(|g| g.1).map(|g| g.0.clone()).collect();
        let live: Vec<String> = got.iter().filter(|g| !g.1).map(|g| g.0.clone()).collect();
        assert_eq!(
            backlog,
            (0..50).map(|i| i.to_string()).collect::<Vec<_>>(),
            "the backlog, in order"
        );
        assert_eq!(live, vec!["50".to_string()], "the live record");
        stop.send_replace(true);
        for t in tasks {
            t.await.expect("spool task");
        }
    });
    drop(finished);
    watchdog.join().expect("watchdog");
}

#[test]
fn with_ack_cloud_a_finished_message_acknowledges_its_record_then_its_device_and_a_dropped_one_neither(
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let (spool, q) = setup(dir.path(), "ack = \"cloud\"", 64);
        let dev = DeviceAcks::new();
        for (i, id) in [(0, 1u16), (1, 2)] {
            let token = AckToken::new(&dev, id);
            assert_eq!(
                spool.append(&body(i), QoS::AtLeastOnce, Some(token)).await,
                Appended::Stored
            );
        }
        spool.commit_once().await;
        assert!(dev.drain().is_empty(), "ack = cloud waits for the cloud");
        spool.link_changed(true);
        spool.fill().await;
        let mut got = drain_queue(&q).into_iter();
        let (_, _, first) = got.next().expect("first record");
        let (_, _, second) = got.next().expect("second record");
        assert!(
            first.ack.is_some(),
            "the device token travels with its record"
        );
        first.complete_with(0);
        assert_eq!(dev.drain(), vec![1]);
        assert!(!dev.is_abandoned());
        // Dropped unfinished: the record stays unacknowledged (sent again after a restart)
        // and its device is abandoned (its connection closes, it resends).
        drop(second);
        assert!(dev.is_abandoned());
        assert!(dev.drain().is_empty());
        spool.commit_once().await;
        assert_eq!(spool.metrics.unacked_records.get(), 1);
    });
}

#[test]
fn a_removed_uplinks_spool_hands_back_its_device_tokens_and_stores_nothing_more() {
    use sluice_proto::mqtt::ProtocolVersion::V5;
    let dir = tempfile::tempdir().expect("tempdir");
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let (spool, q) = setup(dir.path(), "ack = \"spool\"", 64);
        let dev = DeviceAcks::new();
        assert_eq!(
            spool
                .append(&body(1), QoS::AtLeastOnce, Some(AckToken::new(&dev, 1)))
                .await,
            Appended::Stored
        );
        // Not committed: the token is still held by the spool; the removal hands it back.
        let tokens = spool.take_device_tokens();
        assert_eq!(tokens.len(), 1);
        for t in tokens {
            q.finish_removed_token(t);
        }
        assert_eq!(
            spool
                .append(&body(2), QoS::AtLeastOnce, Some(AckToken::new(&dev, 2)))
                .await,
            Appended::NotStored
        );
        assert_eq!(dev.drain(), vec![1, 2]);
        assert_eq!(dev.take_reason(1, V5), 0x10);
        assert_eq!(dev.take_reason(2, V5), 0x10);
        assert!(!dev.is_abandoned());
        assert_eq!(q.removed().0, 2);
    });
}
