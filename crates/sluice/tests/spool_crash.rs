//! `kill -9` under load with `[spool] ack = "spool"`: every message a device saw acknowledged
//! reaches the cloud, whatever moment the gateway dies at.
//!
//! The real `sluice` binary runs as a child process with its spool in a temporary directory on
//! a real disk (`/var/tmp` when it is not a tmpfs; fsync must mean something) and
//! `fsync = "interval"`. A cloud Mosquitto (TLS 1.3, certificates generated now) has a
//! subscriber on `#` connected before anything is published; it talks to the broker, not to
//! sluice, so it misses nothing while sluice restarts. Devices (QoS 1, MQTT 3.1.1, a window of
//! a few PUBLISHes in flight) publish payloads naming their device and sequence number, record
//! every (device, seq) whose PUBACK they received, and after a lost connection reconnect and
//! resend everything unacknowledged with DUP set, as real devices do. A loop SIGKILLs sluice
//! at random moments and starts it again on the same config and spool directory. At the end
//! the load stops, sluice drains, and every acknowledged (device, seq) must have reached the
//! subscriber. Duplicates are allowed (at-least-once) and counted.
//!
//! No timing assertions; the whole test is bounded (well under a minute when healthy) and
//! every child process is killed by a guard, also on panic.

mod common;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use rand::{Rng, SeedableRng};
use sluice_proto::mqtt::{Packet, Publish, QoS};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};

use common::process::SluiceProcess;

const DEVICES: u32 = 16;
/// QoS 1 PUBLISHes a device keeps unacknowledged at most.
const WINDOW: usize = 4;
const KILLS: u32 = 24;
/// sluice lives this long (uniformly random) after accepting connections, before SIGKILL.
const LIFETIME_MS: std::ops::Range<u64> = 150..600;
/// After the load stops: the longest wait for every acknowledged message at the cloud.
const DRAIN_MAX: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_message_reaches_the_cloud_across_repeated_kill_9() {
    let started = Instant::now();
    let pki = TestPki::generate();
    let cloud = Mosquitto::builder()
        .tls(&pki)
        .plain_listener(false)
        .start()
        .expect("start the cloud mosquitto");
    let work = real_disk_tempdir();
    let spool_dir = work.path().join("spool");
    let mqtt_port = sluice_testkit::free_port().expect("a free port");
    let device_addr = SocketAddr::from(([127, 0, 0, 1], mqtt_port));
    let config_path = work.path().join("sluice.toml");
    std::fs::write(
        &config_path,
        config_toml(mqtt_port, cloud.tls_port(), pki.ca_path(), &spool_dir),
    )
    .expect("write the sluice config");

    // The cloud subscriber, connected and subscribed before anything is published.
    let received: Arc<Mutex<HashMap<(u32, u64), u32>>> = Arc::default();
    let stop_subscriber = Arc::new(AtomicBool::new(false));
    let opts = ConnectOpts::v311("crash-cloud-subscriber")
        .with_tls(pki.rustls_client_config(false), "localhost");
    let (mut subscriber, _) = TestClient::connect(cloud.tls_addr(), opts)
        .await
        .expect("connect the cloud subscriber");
    let codes = subscriber
        .subscribe(&[("#", QoS::AtLeastOnce)])
        .await
        .expect("subscribe at the cloud");
    assert_eq!(codes, vec![1], "the cloud granted QoS 1");
    let subscriber_task = tokio::spawn(collect(
        subscriber,
        received.clone(),
        stop_subscriber.clone(),
    ));

    let mut sluice = SluiceProcess::new(&config_path, work.path());
    sluice.start();
    sluice.wait_accepting(device_addr).await;

    // The load.
    let stop_load = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut devices = Vec::new();
    for d in 0..DEVICES {
        devices.push(tokio::spawn(device(
            d,
            device_addr,
            stop_load.clone(),
            sent.clone(),
        )));
    }

    // The kill loop: SIGKILL at a random moment, restart on the same config and spool.
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5B00_1C4A);
    for _ in 0..KILLS {
        let life = Duration::from_millis(rng.gen_range(LIFETIME_MS));
        tokio::time::sleep(life).await;
        sluice.kill_9();
        sluice.start();
        sluice.wait_accepting(device_addr).await;
    }
    let kills = sluice.kills;

    // Stop the load; devices wait for their outstanding acknowledgements.
    stop_load.store(true, Relaxed);
    let mut acked: Vec<(u32, u64)> = Vec::new();
    for d in devices {
        let device_acked = tokio::time::timeout(Duration::from_secs(30), d)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "a device did not get its last acknowledgements within 30 s; sluice stderr:\n{}",
                    sluice.stderr_tail()
                )
            })
            .expect("device task");
        acked.extend(device_acked);
    }

    // Drain: wait until every acknowledged message reached the cloud (or give up).
    let drain_started = Instant::now();
    let missing = loop {
        let missing: Vec<(u32, u64)> = {
            let got = received.lock().unwrap_or_else(|p| p.into_inner());
            acked
                .iter()
                .copied()
                .filter(|key| !got.contains_key(key))
                .collect()
        };
        if missing.is_empty() || drain_started.elapsed() >= DRAIN_MAX {
            break missing;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // A little longer, so late redeliveries show up in the duplicate count.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_subscriber.store(true, Relaxed);
    let subscriber_error = subscriber_task.await.expect("subscriber task");

    let got = received.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let deliveries: u64 = got.values().map(|&n| u64::from(n)).sum();
    let duplicates = deliveries - got.len() as u64;
    eprintln!(
        "spool_crash: kills {kills}, devices {DEVICES}, sent {} PUBLISHes (resends included), \
         acknowledged {} messages, reached the cloud {} distinct ({} deliveries, {} duplicates), \
         acknowledged but missing {}, \
         drain {:.2} s, whole test {:.1} s",
        sent.load(Relaxed),
        acked.len(),
        got.len(),
        deliveries,
        duplicates,
        missing.len(),
        drain_started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64(),
    );
    if let Some(error) = subscriber_error {
        panic!("the cloud subscriber failed: {error}");
    }
    assert!(kills >= 20, "only {kills} kills");
    assert!(
        acked.len() as u64 >= u64::from(DEVICES) * 10,
        "too little load to say anything: {} acknowledged messages",
        acked.len()
    );
    assert!(
        missing.is_empty(),
        "{} acknowledged messages never reached the cloud (first: {:?}); sluice stderr:\n{}",
        missing.len(),
        &missing[..missing.len().min(20)],
        sluice.stderr_tail()
    );
}

/// sluice's config: one shard per core of the test machine would vary; two shards make the
/// spool per shard and uplink (`DIR/cloud/shard-{0,1}`) part of the test on every machine.
fn config_toml(mqtt_port: u16, cloud_tls_port: u16, ca: &Path, spool_dir: &Path) -> String {
    format!(
        "[gateway]\nshards = 2\npin_threads = false\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n\
         [coap]\nlisten = \"127.0.0.1:0\"\n\n\
         [admin]\nlisten = \"127.0.0.1:0\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [spool]\ndir = \"{spool}\"\nack = \"spool\"\nfsync = \"interval\"\nfsync_interval = \"10ms\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://127.0.0.1:{cloud_tls_port}\"\nca_file = \"{ca}\"\n\
         server_name = \"localhost\"\nclient_id = \"gw-crash\"\nforward = [\"#\"]\n\
         reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n\n\
         [uplink.aggregate]\nenabled = false\n",
        spool = spool_dir.display(),
        ca = ca.display(),
    )
}

/// A temporary directory on a real disk: `/var/tmp` unless it is a tmpfs (then the
/// system temporary directory, then the target directory).
fn real_disk_tempdir() -> tempfile::TempDir {
    let candidates = [
        PathBuf::from("/var/tmp"),
        std::env::temp_dir(),
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
    ];
    for dir in candidates {
        if dir.is_dir() && !is_tmpfs(&dir) {
            if let Ok(t) = tempfile::Builder::new()
                .prefix("sluice-spool-crash-")
                .tempdir_in(&dir)
            {
                return t;
            }
        }
    }
    panic!("no directory on a real disk for the spool (every candidate is a tmpfs)");
}

/// Whether `dir` lies on a tmpfs, from the longest matching mount point in /proc/mounts.
fn is_tmpfs(dir: &Path) -> bool {
    let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else {
        return false;
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let _device = f.next()?;
            Some((PathBuf::from(f.next()?), f.next()?.to_string()))
        })
        .filter(|(mount, _)| dir.starts_with(mount))
        .max_by_key(|(mount, _)| mount.as_os_str().len())
        .is_some_and(|(_, fs)| fs == "tmpfs")
}

/// One device: publishes `"{device}:{seq}:"` plus filler on `crash/{device}` with up to
/// [`WINDOW`] in flight; returns every (device, seq) it received a PUBACK for. After a lost
/// connection it reconnects and resends everything unacknowledged with DUP set. Once `stop`
/// is set it sends nothing new and returns when nothing is left unacknowledged.
async fn device(
    d: u32,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) -> Vec<(u32, u64)> {
    let topic = ByteString::from(format!("crash/{d}"));
    let mut next_seq = 0u64;
    // Sent (at least once) and not acknowledged, oldest first.
    let mut unacked: VecDeque<(u64, Bytes)> = VecDeque::new();
    let mut acked = Vec::new();
    loop {
        if stop.load(Relaxed) && unacked.is_empty() {
            return acked;
        }
        let mut opts = ConnectOpts::v311(format!("crash-dev-{d}"));
        opts.timeout = Duration::from_secs(2);
        let mut client = match TestClient::connect(addr, opts).await {
            Ok((client, ack)) if ack.code == 0 => client,
            _ => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        client.set_ack_timeout(Duration::from_secs(5));
        // Packet ids in flight on this connection, oldest first, with their seqs.
        let mut in_flight: VecDeque<(u16, u64)> = VecDeque::new();
        let mut next_id: u16 = 1;
        let mut publish = |client_seq: u64, payload: Bytes, dup: bool| {
            let id = next_id;
            next_id = next_id.checked_add(1).unwrap_or(1);
            let packet = Packet::Publish(Publish {
                dup,
                qos: QoS::AtLeastOnce,
                retain: false,
                topic: topic.clone(),
                packet_id: Some(id),
                properties: None,
                payload,
            });
            (id, client_seq, packet)
        };
        let session: anyhow::Result<()> = async {
            for (seq, payload) in unacked.iter() {
                let (id, seq, packet) = publish(*seq, payload.clone(), true);
                client.send_packet(&packet).await?;
                sent.fetch_add(1, Relaxed);
                in_flight.push_back((id, seq));
            }
            loop {
                while !stop.load(Relaxed) && in_flight.len() < WINDOW {
                    let payload = payload_of(d, next_seq);
                    let (id, seq, packet) = publish(next_seq, payload.clone(), false);
                    unacked.push_back((next_seq, payload));
                    next_seq += 1;
                    client.send_packet(&packet).await?;
                    sent.fetch_add(1, Relaxed);
                    in_flight.push_back((id, seq));
                }
                let Some(&(id, seq)) = in_flight.front() else {
                    return Ok(());
                };
                let code = client.wait_ack(id).await?;
                anyhow::ensure!(code == 0, "PUBACK with reason {code:#x}");
                in_flight.pop_front();
                let (oldest, _) = unacked
                    .pop_front()
                    .expect("an in-flight message is unacked");
                assert_eq!(oldest, seq, "acknowledgements follow the send order");
                acked.push((d, seq));
            }
        }
        .await;
        if session.is_err() {
            // sluice died (or stalled): reconnect and resend the unacknowledged ones.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `"{device}:{seq}:"` padded with filler to 64–191 bytes.
fn payload_of(d: u32, seq: u64) -> Bytes {
    let mut text = format!("{d}:{seq}:").into_bytes();
    let len = 64 + (seq as usize * 31 + d as usize * 7) % 128;
    text.resize(len, b'.');
    Bytes::from(text)
}

fn parse_payload(payload: &[u8]) -> Option<(u32, u64)> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut parts = text.splitn(3, ':');
    let d = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    Some((d, seq))
}

/// The cloud subscriber: counts every delivery of every (device, seq) until `stop`. Returns
/// the error that ended it early, if any.
async fn collect(
    mut subscriber: TestClient,
    received: Arc<Mutex<HashMap<(u32, u64), u32>>>,
    stop: Arc<AtomicBool>,
) -> Option<String> {
    while !stop.load(Relaxed) {
        match subscriber.recv(Duration::from_millis(100)).await {
            Ok(Some(publish)) => {
                let Some(key) = parse_payload(&publish.payload) else {
                    return Some(format!(
                        "a PUBLISH on {} that no device sent",
                        publish.topic
                    ));
                };
                *received
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(key)
                    .or_insert(0) += 1;
            }
            Ok(None) => {}
            Err(error) => return Some(format!("{error:#}")),
        }
    }
    None
}
