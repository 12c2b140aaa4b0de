//! End-to-end tests of the core path against a real Mosquitto cloud broker over TLS 1.3 with
//! certificates generated at test time: devices → shards → uplink → cloud, and back.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use rand::{Rng, SeedableRng};
use sluice_proto::mqtt::{ProtocolVersion, QoS};

fn payload(device: usize, seq: u32, rng: &mut impl Rng) -> Bytes {
    let len = rng.gen_range(100..=1024);
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&(device as u32).to_be_bytes());
    v.extend_from_slice(&seq.to_be_bytes());
    while v.len() < len {
        v.push(rng.gen());
    }
    Bytes::from(v)
}

fn seq_of(p: &[u8]) -> (u32, u32) {
    (
        u32::from_be_bytes([p[0], p[1], p[2], p[3]]),
        u32::from_be_bytes([p[4], p[5], p[6], p[7]]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_devices_on_every_shard_reach_the_cloud_byte_for_byte_in_order() {
    const DEVICES: usize = 300;
    const PER_DEVICE: u32 = 20;
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "fleet/#").await;
    // Byte for byte on each device's own topic: with 300 devices aggregation would pack them.
    let gw = gateway(
        4,
        &cloud.uplink_toml(None, "[uplink.aggregate]\nenabled = false"),
    );

    let mut tasks = Vec::new();
    let sent: Arc<Mutex<HashMap<u32, Vec<Bytes>>>> = Arc::default();
    let (connected_tx, mut connected_rx) = tokio::sync::mpsc::channel::<()>(DEVICES);
    let release = Arc::new(tokio::sync::Notify::new());
    for d in 0..DEVICES {
        let addr = gw.mqtt_addr;
        let sent = sent.clone();
        let connected_tx = connected_tx.clone();
        let release = release.clone();
        tasks.push(tokio::spawn(async move {
            let version = if d % 2 == 0 {
                ProtocolVersion::V311
            } else {
                ProtocolVersion::V5
            };
            let opts = sluice_testkit::ConnectOpts::new(version, format!("dev-{d}"));
            let (mut c, ack) = sluice_testkit::TestClient::connect(addr, opts)
                .await
                .expect("device connects");
            assert_eq!(ack.code, 0);
            let notified = release.notified();
            connected_tx.send(()).await.expect("report connected");
            notified.await;
            let mut rng = rand::rngs::StdRng::seed_from_u64(d as u64);
            for seq in 0..PER_DEVICE {
                let p = payload(d, seq, &mut rng);
                sent.lock()
                    .unwrap()
                    .entry(d as u32)
                    .or_default()
                    .push(p.clone());
                let code = c
                    .publish(&format!("fleet/dev-{d}"), p, QoS::AtLeastOnce, false)
                    .await
                    .expect("publish acked");
                assert_eq!(code, 0);
            }
            c.disconnect().await.expect("disconnect");
        }));
    }
    for _ in 0..DEVICES {
        connected_rx.recv().await.expect("device connected");
    }
    // Every shard holds devices while they are all connected.
    let status = gw.status_json();
    let shards = status["shards"].as_array().expect("shards array");
    assert_eq!(shards.len(), 4);
    for s in shards {
        assert!(
            s["connections"].as_i64().unwrap_or(0) > 30,
            "shard underused: {status}"
        );
    }
    release.notify_waiters();
    for t in tasks {
        t.await.expect("device task");
    }

    let total = DEVICES * PER_DEVICE as usize;
    let mut received: HashMap<u32, Vec<Bytes>> = HashMap::new();
    let mut n = 0;
    while n < total {
        let Some(p) = sub
            .recv(Duration::from_secs(10))
            .await
            .expect("cloud subscriber")
        else {
            break;
        };
        let (d, _) = seq_of(&p.payload);
        assert_eq!(p.topic, format!("fleet/dev-{d}").as_str());
        received.entry(d).or_default().push(p.payload);
        n += 1;
    }
    assert_eq!(n, total, "cloud received {n} of {total}");
    let sent = sent.lock().unwrap();
    for (d, msgs) in sent.iter() {
        assert_eq!(
            received.get(d),
            Some(msgs),
            "device {d}: cloud copy differs or is out of order"
        );
    }
    let metrics = gw.metrics_text();
    assert!(
        metric_sum(&metrics, "sluice_uplink_messages_acked_total") >= total as f64,
        "{metrics}"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_broker_killed_mid_stream_loses_nothing_the_devices_saw_acknowledged() {
    let mut cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    let gw = gateway(2, &cloud.uplink_toml(Some(gate.addr), ""));
    let received: Arc<Mutex<HashSet<(u32, u32)>>> = Arc::default();

    let collect = |mut sub: sluice_testkit::TestClient,
                   received: Arc<Mutex<HashSet<(u32, u32)>>>| {
        tokio::spawn(async move {
            while let Ok(Some(p)) = sub.recv(Duration::from_secs(30)).await {
                received.lock().unwrap().insert(seq_of(&p.payload));
            }
        })
    };
    let first = collect(cloud.subscriber("sub-1", "fleet/#").await, received.clone());

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acked: Arc<Mutex<HashSet<(u32, u32)>>> = Arc::default();
    let mut devices = Vec::new();
    for d in 0..20u32 {
        let addr = gw.mqtt_addr;
        let (stop, acked) = (stop.clone(), acked.clone());
        devices.push(tokio::spawn(async move {
            let opts = sluice_testkit::ConnectOpts::v311(format!("dev-{d}"));
            let (mut c, _) = sluice_testkit::TestClient::connect(addr, opts)
                .await
                .expect("device connects");
            c.set_ack_timeout(Duration::from_secs(60));
            let mut rng = rand::rngs::StdRng::seed_from_u64(d as u64);
            let mut seq = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let p = payload(d as usize, seq, &mut rng);
                c.publish(&format!("fleet/dev-{d}"), p, QoS::AtLeastOnce, false)
                    .await
                    .expect("publish eventually acked");
                acked.lock().unwrap().insert((d, seq));
                seq += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    // The fault: the cloud broker dies mid-stream; the gateway is held off until the broker is
    // back and a subscriber is listening again. The gateway is cut off first and the broker
    // killed once its subscriber has what the broker accepted: a broker without persistence
    // loses messages it acknowledged but had not yet passed on when it is killed, which is
    // the broker's loss, not the gateway's (it happened here on a loaded machine).
    gate.set_open(false);
    let mut seen = received.lock().unwrap().len();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = received.lock().unwrap().len();
        if now == seen {
            break;
        }
        seen = now;
    }
    cloud.broker.kill().expect("kill cloud");
    let acked_before_restart = acked.lock().unwrap().len();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stalled = acked.lock().unwrap().len();
    // While the cloud is away nothing new is acknowledged to devices (at most the few whose
    // cloud PUBACK was already in flight when the broker died).
    assert!(
        stalled <= acked_before_restart + 20,
        "devices were acked without a cloud: {acked_before_restart} -> {stalled}"
    );
    cloud.broker.restart().expect("restart cloud");
    let second = collect(cloud.subscriber("sub-2", "fleet/#").await, received.clone());
    gate.set_open(true);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for d in devices {
        d.await.expect("device task");
    }
    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() > stalled,
        "publishing resumed after the restart"
    );
    let all_in = eventually(Duration::from_secs(10), || {
        acked.is_subset(&received.lock().unwrap())
    })
    .await;
    let missing: Vec<_> = acked
        .difference(&received.lock().unwrap())
        .take(5)
        .cloned()
        .collect();
    assert!(
        all_in,
        "acknowledged messages missing from the cloud, e.g. {missing:?}"
    );
    let metrics = gw.metrics_text();
    assert!(
        metric_sum(&metrics, "sluice_uplink_connects_total") >= 4.0,
        "every shard reconnected: {metrics}"
    );
    first.abort();
    second.abort();
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_publish_reaches_a_subscriber_on_another_shard_at_every_qos() {
    let gw = gateway(2, "");
    let ids = ids_on_shards("x", 2, 1);
    let mut sub = device(&gw, &ids[0][0], ProtocolVersion::V5).await;
    assert_eq!(
        sub.subscribe(&[("room/+/temp", QoS::ExactlyOnce)])
            .await
            .unwrap(),
        vec![2]
    );
    let mut publ = device(&gw, &ids[1][0], ProtocolVersion::V311).await;
    for (i, qos) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
        .into_iter()
        .enumerate()
    {
        publ.publish("room/1/temp", format!("m{i}"), qos, false)
            .await
            .unwrap();
        let got = sub
            .recv(Duration::from_secs(5))
            .await
            .unwrap()
            .expect("delivered across shards");
        assert_eq!(got.payload, format!("m{i}").as_bytes());
        assert_eq!(got.qos, qos);
    }
    let m = gw.metrics_text();
    assert!(metric_sum(&m, "sluice_shard_cross_sent_total") >= 3.0);
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_message_on_a_receive_filter_reaches_the_local_subscriber() {
    let cloud = Cloud::start();
    let gw = gateway(
        2,
        &cloud.uplink_toml(None, "receive = [\"cmd/#\"]\nforward = [\"telemetry/#\"]"),
    );
    let mut dev = device(&gw, "actuator-7", ProtocolVersion::V311).await;
    dev.subscribe(&[("cmd/actuator-7", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut app = cloud.client("cloud-app").await;
    // Wait until every shard's uplink is subscribed at the broker.
    assert!(
        eventually(Duration::from_secs(10), || gw.status_json()["shards"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["uplinks"][0]["state"] == "connected"))
        .await
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    app.publish("cmd/actuator-7", "open-valve", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let got = dev
        .recv(Duration::from_secs(5))
        .await
        .unwrap()
        .expect("downlink delivered");
    assert_eq!(got.payload, &b"open-valve"[..]);
    // Exactly once: each shard's session receives the cloud message, but only the device's own
    // shard has a subscriber.
    assert!(dev
        .recv(Duration::from_millis(300))
        .await
        .unwrap()
        .is_none());
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_message_reaches_a_later_subscriber_on_any_shard() {
    let gw = gateway(2, "");
    let ids = ids_on_shards("r", 2, 1);
    let mut publ = device(&gw, &ids[0][0], ProtocolVersion::V311).await;
    publ.publish("status/boiler", "on", QoS::AtLeastOnce, true)
        .await
        .unwrap();
    let mut late = device(&gw, &ids[1][0], ProtocolVersion::V5).await;
    late.subscribe(&[("status/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let got = late
        .recv(Duration::from_secs(5))
        .await
        .unwrap()
        .expect("retained message");
    assert_eq!(got.payload, &b"on"[..]);
    assert!(got.retain);
    // An empty retained payload deletes it.
    publ.publish("status/boiler", "", QoS::AtLeastOnce, true)
        .await
        .unwrap();
    let mut later = device(&gw, "late-2", ProtocolVersion::V311).await;
    later
        .subscribe(&[("status/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    assert!(later
        .recv(Duration::from_millis(300))
        .await
        .unwrap()
        .is_none());
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn will_is_published_when_a_device_vanishes_but_not_after_a_clean_disconnect() {
    let gw = gateway(2, "");
    let mut watcher = device(&gw, "watcher", ProtocolVersion::V311).await;
    watcher
        .subscribe(&[("wills/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let will = |id: &str| sluice_proto::mqtt::Will {
        topic: format!("wills/{id}").into(),
        payload: Bytes::from_static(b"gone"),
        qos: QoS::AtLeastOnce,
        retain: false,
        properties: Default::default(),
    };
    let mut opts = sluice_testkit::ConnectOpts::v311("vanisher");
    opts.will = Some(will("vanisher"));
    let vanisher = device_opts(&gw, opts).await;
    drop(vanisher); // socket closed without DISCONNECT
    let got = watcher
        .recv(Duration::from_secs(5))
        .await
        .unwrap()
        .expect("will published");
    assert_eq!(got.topic, "wills/vanisher");
    assert_eq!(got.payload, &b"gone"[..]);

    let mut opts = sluice_testkit::ConnectOpts::v5("polite");
    opts.will = Some(will("polite"));
    let polite = device_opts(&gw, opts).await;
    polite.disconnect().await.unwrap();
    assert!(
        watcher
            .recv(Duration::from_millis(500))
            .await
            .unwrap()
            .is_none(),
        "will sent after a clean DISCONNECT"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_session_gets_its_queued_messages_on_reconnect() {
    let gw = gateway(2, "");
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let id = format!("sleepy-{version:?}");
        let mut opts = sluice_testkit::ConnectOpts::new(version, id.clone());
        opts.clean_start = false;
        if version == ProtocolVersion::V5 {
            opts.properties.session_expiry_interval = Some(300);
        }
        let mut sleepy = device_opts(&gw, opts.clone()).await;
        sleepy
            .subscribe(&[("alerts/#", QoS::AtLeastOnce)])
            .await
            .unwrap();
        sleepy.disconnect().await.unwrap();

        let mut publ = device(&gw, "alarm-panel", ProtocolVersion::V311).await;
        for i in 0..5 {
            publ.publish("alerts/fire", format!("{i}"), QoS::AtLeastOnce, false)
                .await
                .unwrap();
        }
        publ.publish("alerts/fire", "qos0-not-kept", QoS::AtMostOnce, false)
            .await
            .unwrap();
        publ.disconnect().await.unwrap();

        let (mut back, ack) = sluice_testkit::TestClient::connect(gw.mqtt_addr, opts)
            .await
            .unwrap();
        assert!(ack.session_present, "{version:?}: session kept");
        for i in 0..5 {
            let got = back
                .recv(Duration::from_secs(5))
                .await
                .unwrap()
                .expect("queued message");
            assert_eq!(got.payload, format!("{i}").as_bytes());
        }
        assert!(back
            .recv(Duration::from_millis(300))
            .await
            .unwrap()
            .is_none());
        back.disconnect().await.unwrap();
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos1_publish_is_acknowledged_only_after_the_cloud_has_it() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    let gw = gateway(1, &cloud.uplink_toml(Some(gate.addr), ""));
    let mut sub = cloud.subscriber("sub", "#").await;
    let mut dev = device(&gw, "meter", ProtocolVersion::V5).await;
    let id = dev
        .publish_no_wait("meter/kwh", "42", QoS::AtLeastOnce, false)
        .await
        .unwrap()
        .unwrap();
    // No cloud: no PUBACK.
    assert!(
        dev.recv_packet(Duration::from_millis(700))
            .await
            .unwrap()
            .is_none(),
        "acked without the cloud"
    );
    gate.set_open(true);
    dev.set_ack_timeout(Duration::from_secs(10));
    assert_eq!(dev.wait_ack(id).await.unwrap(), 0);
    let got = sub
        .recv(Duration::from_secs(5))
        .await
        .unwrap()
        .expect("in the cloud");
    assert_eq!(got.payload, &b"42"[..]);
    tokio::task::block_in_place(|| gw.shutdown());
}
