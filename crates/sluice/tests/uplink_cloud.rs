//! The uplink session against a real Mosquitto "cloud" over TLS 1.3 with certificates
//! generated at test time. Each test runs the uplink the way a shard does: one current-thread
//! runtime, one `LocalSet`, `spawn_local`. A `TestClient` subscribed on the cloud broker plays
//! the cloud application; `DeviceAcks` plays the device connection waiting for its PUBACKs.

mod common;
#[path = "uplink_cloud/failures.rs"]
mod failures;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use common::{run_local, wait_until};
use sluice::config::{MqttProtocol, UplinkConfig, UplinkUrl};
use sluice::message::ack::{AckToken, DeviceAcks};
use sluice::sink::{self as uplink, UplinkError, UplinkMessage, UplinkMetrics, UplinkQueue};
use sluice::telemetry::metrics::PromWriter;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const DEVICES: usize = 5;
const PER_DEVICE: usize = 100;

fn cloud_config(pki: &TestPki, broker: &Mosquitto, protocol: MqttProtocol) -> UplinkConfig {
    let url = UplinkUrl {
        tls: true,
        host: "127.0.0.1".into(),
        port: broker.tls_port(),
    };
    let mut cfg = UplinkConfig::new("cloud", url);
    cfg.ca_file = Some(pki.ca_path().to_path_buf());
    cfg.server_name = Some("localhost".into());
    cfg.client_id = "gw".into();
    cfg.protocol = protocol;
    cfg.inflight = 64;
    cfg.keep_alive = Duration::from_secs(5);
    cfg.connect_timeout = Duration::from_secs(5);
    cfg.reconnect_min = Duration::from_millis(50);
    cfg.reconnect_max = Duration::from_millis(300);
    cfg
}

/// A running uplink session and everything a test observes it through.
struct Uplink {
    queue: Rc<UplinkQueue>,
    metrics: Arc<UplinkMetrics>,
    downlink: Rc<RefCell<Vec<uplink::CloudMessage>>>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

fn start_uplink(cfg: UplinkConfig, capacity_bytes: usize) -> Uplink {
    let tls = uplink::client_tls_config(&cfg).expect("TLS config from generated PKI");
    let queue = Rc::new(UplinkQueue::new(capacity_bytes));
    let metrics = Arc::new(UplinkMetrics::new());
    let downlink = Rc::new(RefCell::new(Vec::new()));
    let sink = downlink.clone();
    let (shutdown, rx) = watch::channel(false);
    let task = uplink::spawn(
        uplink::SessionSeed {
            shard: 0,
            lane: uplink::Lane::Normal,
            route: uplink::UplinkRoute::new(&cfg),
            cfg: Rc::new(cfg),
            tls: Some(tls),
            queue: queue.clone(),
            downlink: Rc::new(move |p: uplink::CloudMessage| -> uplink::DownlinkDelivery {
                sink.borrow_mut().push(p);
                Box::pin(async {})
            }),
            metrics: metrics.clone(),
            // No devices connected: the normal lane never aggregates here.
            live_devices: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            on_port: None,
            feeders: Default::default(),
            links: None,
            function: None,
        },
        rx,
    );
    Uplink {
        queue,
        metrics,
        downlink,
        shutdown,
        task,
    }
}

impl Uplink {
    async fn stop(self) {
        self.shutdown.send(true).expect("session still listening");
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("session task ends promptly on shutdown")
            .expect("session task did not panic");
    }
}

/// Message `i` of device `d`: distinct, variable-length, binary payloads.
fn payload(d: usize, i: usize) -> Bytes {
    let mut p = format!("d{d}-m{i}:").into_bytes();
    p.extend((0..(i * 37 + d * 11) % 300).map(|k| (k * 7 + i + d) as u8));
    Bytes::from(p)
}

fn device_topic(d: usize) -> String {
    format!("dev/{d}/data")
}

fn message(d: usize, i: usize, acks: &Rc<DeviceAcks>) -> UplinkMessage {
    UplinkMessage {
        device: ByteString::from(format!("device-{d}")),
        topic: ByteString::from(device_topic(d)),
        payload: payload(d, i),
        qos: QoS::AtLeastOnce,
        retain: false,
        received_at: Instant::now(),
        // Device packet ids 1..=PER_DEVICE.
        ack: Some(AckToken::new(acks, (i + 1) as u16)),
        content_type: None,
        user_properties: None,
        stored: None,
    }
}

async fn subscriber(pki: &TestPki, broker: &Mosquitto, id: &str, filter: &str) -> TestClient {
    let opts = ConnectOpts::v5(id).with_tls(pki.rustls_client_config(false), "localhost");
    let (mut client, connack) = TestClient::connect(broker.tls_addr(), opts)
        .await
        .expect("subscriber connects");
    assert_eq!(connack.code, 0);
    assert_eq!(
        client
            .subscribe(&[(filter, QoS::AtLeastOnce)])
            .await
            .expect("SUBACK"),
        vec![1]
    );
    client
}

/// Receive until `want` messages arrived or nothing came for `idle`; returns them per device.
async fn collect(client: &mut TestClient, want: usize, idle: Duration) -> Vec<Vec<Bytes>> {
    let mut per_device = vec![Vec::new(); DEVICES];
    let mut got = 0;
    while got < want {
        let Some(p) = client
            .recv(idle)
            .await
            .expect("subscriber connection stays up")
        else {
            break;
        };
        let d: usize = p
            .topic
            .split('/')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("dev/<n>/data topic");
        per_device[d].push(p.payload);
        got += 1;
    }
    per_device
}

fn drain_all(acks: &[Rc<DeviceAcks>], into: &mut [Vec<u16>]) {
    for (d, a) in acks.iter().enumerate() {
        into[d].extend(a.drain());
    }
}

fn delivers_in_order_and_acks_every_message(protocol: MqttProtocol, version: &str) {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut sub = subscriber(&pki, &broker, "cloud-app", "dev/#").await;
        // Small enough that the 500 messages (~54 KB) back-pressure the devices.
        let up = start_uplink(cloud_config(&pki, &broker, protocol), 24 * 1024);
        let acks: Vec<Rc<DeviceAcks>> = (0..DEVICES).map(|_| DeviceAcks::new()).collect();
        let devices: Vec<JoinHandle<()>> = (0..DEVICES)
            .map(|d| {
                let (queue, acks) = (up.queue.clone(), acks[d].clone());
                tokio::task::spawn_local(async move {
                    for i in 0..PER_DEVICE {
                        queue.push(message(d, i, &acks)).await;
                    }
                })
            })
            .collect();

        let received = collect(&mut sub, DEVICES * PER_DEVICE, Duration::from_secs(10)).await;
        for (d, got) in received.iter().enumerate() {
            let expected: Vec<Bytes> = (0..PER_DEVICE).map(|i| payload(d, i)).collect();
            assert_eq!(
                got.len(),
                PER_DEVICE,
                "device {d}: every message reached the cloud once"
            );
            assert!(
                got == &expected,
                "device {d}: payloads byte-for-byte and in order"
            );
        }
        for dev in devices {
            dev.await.expect("device task");
        }
        let mut acked = vec![Vec::new(); DEVICES];
        wait_until("every ack token", Duration::from_secs(5), || {
            drain_all(&acks, &mut acked);
            acked.iter().map(Vec::len).sum::<usize>() == DEVICES * PER_DEVICE
        })
        .await;
        for (d, ids) in acked.iter().enumerate() {
            let unique: BTreeSet<u16> = ids.iter().copied().collect();
            assert_eq!(
                unique.len(),
                PER_DEVICE,
                "device {d}: each packet id acked exactly once"
            );
            assert_eq!(unique, (1..=PER_DEVICE as u16).collect(), "device {d}");
        }

        let m = &up.metrics;
        assert_eq!(m.state(), "connected");
        assert_eq!(m.connects.get(), 1);
        assert_eq!(m.messages_sent.get(), 500);
        assert_eq!(m.messages_acked.get(), 500);
        assert_eq!(m.ack_latency.count(), 500);
        assert_eq!(m.inflight.get(), 0);
        assert_eq!(m.queue_messages.get(), 0);
        assert_eq!(
            m.queue_bytes.get(),
            0,
            "every reserved byte released after PUBACK"
        );
        let per_write = m.messages_per_write();
        println!(
            "{version}: 500 messages in {} writes ({per_write:.1} messages/write), {} bytes",
            m.writes.get(),
            m.bytes_written.get()
        );
        assert!(
            per_write > 1.0,
            "bulk pushes are coalesced into shared writes ({per_write})"
        );

        let mut w = PromWriter::new();
        m.render(&mut w, "0", "cloud", "normal");
        let text = w.finish();
        assert!(text.contains(
            "sluice_uplink_messages_acked_total{shard=\"0\",uplink=\"cloud\",lane=\"normal\"} 500"
        ));
        assert!(text.contains(
            "sluice_uplink_ack_latency_seconds_count{shard=\"0\",uplink=\"cloud\",lane=\"normal\"} 500"
        ));

        up.stop().await;
        broker
            .wait_for_log_async("Client gw-0 disconnected.", Duration::from_secs(5))
            .await
            .expect("shutdown sends DISCONNECT");
    });
}

#[test]
fn mqtt5_uplink_delivers_500_messages_in_order_per_device_and_acks_each_device_message() {
    delivers_in_order_and_acks_every_message(MqttProtocol::V5, "MQTT 5");
}

#[test]
fn mqtt311_uplink_delivers_500_messages_in_order_per_device_and_acks_each_device_message() {
    delivers_in_order_and_acks_every_message(MqttProtocol::V311, "MQTT 3.1.1");
}

/// What it proves: when the cloud broker dies mid-stream and comes back on the same port,
/// (1) every device message is eventually acknowledged to its device, exactly once; (2) every
/// message that was not acknowledged before the crash is delivered to the cloud after the
/// restart — resent inflight messages first, then the rest — so nothing acknowledged to a
/// device is lost by the uplink and per-device order holds; (3) nothing acknowledged before
/// the crash is sent again. What it does not prove: that messages acknowledged *before* the
/// crash reached a subscriber — Mosquitto runs without persistence here, so that is the
/// broker's durability, not the uplink's.
///
/// The broker is frozen (SIGSTOP) before it is killed, so the crash always finds a full inflight
/// window of written-but-unacknowledged messages, which must be resent.
///
/// Determinism: the uplink's first reconnect waits exactly `reconnect_min` (1.5 s, no jitter
/// on the first attempt), and the test restarts the broker and subscribes within that window;
/// it asserts the uplink had not reconnected yet when the subscription was in place.
#[test]
fn broker_crash_mid_stream_loses_nothing_unacknowledged_and_keeps_order() {
    let pki = TestPki::generate();
    let mut broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut cfg = cloud_config(&pki, &broker, MqttProtocol::V5);
        cfg.inflight = 32;
        cfg.reconnect_min = Duration::from_millis(1500);
        cfg.reconnect_max = Duration::from_secs(3);
        let up = start_uplink(cfg, 1024 * 1024);
        let acks: Vec<Rc<DeviceAcks>> = (0..DEVICES).map(|_| DeviceAcks::new()).collect();
        // Devices publish at a steady pace so the crash lands mid-stream.
        let devices: Vec<JoinHandle<()>> = (0..DEVICES)
            .map(|d| {
                let (queue, acks) = (up.queue.clone(), acks[d].clone());
                tokio::task::spawn_local(async move {
                    for i in 0..PER_DEVICE {
                        queue.push(message(d, i, &acks)).await;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
            })
            .collect();

        let mut acked = vec![Vec::new(); DEVICES];
        wait_until("100 acks before the crash", Duration::from_secs(10), || {
            drain_all(&acks, &mut acked);
            acked.iter().map(Vec::len).sum::<usize>() >= 100
        })
        .await;
        // Freeze the broker first: it stops reading, so the window fills with messages that
        // are written but unacknowledged — the ones that must be resent after the crash.
        signal(&broker, "-STOP");
        wait_until("a full inflight window", Duration::from_secs(5), || {
            up.metrics.inflight.get() == 32
        })
        .await;
        let inflight_at_crash = up.metrics.inflight.get();
        broker.kill().expect("kill broker");
        wait_until(
            "the uplink to notice the crash",
            Duration::from_secs(5),
            || up.metrics.state() != "connected",
        )
        .await;
        // No acks can complete while disconnected: this is the exact pre-crash set.
        drain_all(&acks, &mut acked);
        let acked_before: Vec<BTreeSet<u16>> =
            acked.iter().map(|v| v.iter().copied().collect()).collect();
        let before_total: usize = acked_before.iter().map(BTreeSet::len).sum();

        broker.restart().expect("restart broker on the same port");
        let mut sub = subscriber(&pki, &broker, "cloud-app-after", "dev/#").await;
        assert_eq!(
            up.metrics.connects.get(),
            1,
            "the subscriber must be in place before the uplink reconnects (timing assumption)"
        );

        let expected_after = DEVICES * PER_DEVICE - before_total;
        let received = collect(&mut sub, expected_after, Duration::from_secs(10)).await;
        for dev in devices {
            dev.await.expect("device task");
        }
        wait_until("every ack token", Duration::from_secs(10), || {
            drain_all(&acks, &mut acked);
            acked.iter().map(Vec::len).sum::<usize>() == DEVICES * PER_DEVICE
        })
        .await;

        for d in 0..DEVICES {
            let unique: BTreeSet<u16> = acked[d].iter().copied().collect();
            assert_eq!(
                acked[d].len(),
                PER_DEVICE,
                "device {d}: no token completed twice"
            );
            assert_eq!(
                unique,
                (1..=PER_DEVICE as u16).collect(),
                "device {d}: every message acked"
            );
            let expected: Vec<Bytes> = (0..PER_DEVICE)
                .filter(|i| !acked_before[d].contains(&((i + 1) as u16)))
                .map(|i| payload(d, i))
                .collect();
            assert_eq!(
                received[d].len(),
                expected.len(),
                "device {d}: unacknowledged messages delivered after restart"
            );
            assert!(
                received[d] == expected,
                "device {d}: in order, none lost, none acknowledged before resent"
            );
        }
        let m = &up.metrics;
        println!(
            "crash after {before_total} acks with {inflight_at_crash} messages inflight; {} resent with DUP; \
             {} delivered after restart; connects {}",
            m.messages_resent.get(),
            expected_after,
            m.connects.get()
        );
        assert_eq!(m.connects.get(), 2);
        assert!(
            m.messages_resent.get() >= inflight_at_crash as u64,
            "inflight messages were resent"
        );
        assert!(
            before_total > 0 && before_total < DEVICES * PER_DEVICE,
            "the crash was mid-stream"
        );
        assert_eq!(m.messages_acked.get(), 500);
        assert_eq!(m.queue_bytes.get(), 0);
        up.stop().await;
    });
}

/// Send a signal to the broker process this test started.
fn signal(broker: &Mosquitto, sig: &str) {
    let pid = broker.pid().expect("broker running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill {sig} {pid}");
}

#[test]
fn cloud_publishes_on_receive_filters_reach_the_downlink_unchanged() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut app = subscriber(&pki, &broker, "cloud-app", "unused/#").await;
        // A retained command proves the subscription is in place once it arrives.
        // (0x10 "no matching subscribers" is a success in MQTT 5.)
        assert!(
            app.publish("cmd/gw/config", &b"retained"[..], QoS::AtLeastOnce, true)
                .await
                .unwrap()
                < 0x80
        );
        let mut cfg = cloud_config(&pki, &broker, MqttProtocol::V5);
        cfg.receive = vec!["cmd/#".into()];
        let up = start_uplink(cfg, 64 * 1024);
        wait_until("the retained command", Duration::from_secs(10), || {
            up.downlink.borrow().len() == 1
        })
        .await;

        let payload = Bytes::from_static(b"\x00reboot\xff");
        assert!(
            app.publish(
                "cmd/device-3/reboot",
                payload.clone(),
                QoS::AtLeastOnce,
                false
            )
            .await
            .unwrap()
                < 0x80
        );
        assert!(
            app.publish(
                "other/topic",
                &b"not subscribed"[..],
                QoS::AtLeastOnce,
                false
            )
            .await
            .unwrap()
                < 0x80
        );
        wait_until("the live command", Duration::from_secs(10), || {
            up.downlink.borrow().len() == 2
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;

        let got = up.downlink.borrow().clone();
        assert_eq!(
            got.len(),
            2,
            "only messages matching receive filters are delivered"
        );
        assert_eq!(got[0].topic, "cmd/gw/config");
        assert_eq!(&got[0].payload[..], b"retained");
        assert_eq!(got[1].topic, "cmd/device-3/reboot", "topic unchanged");
        assert_eq!(got[1].payload, payload);
        assert_eq!(got[1].qos, QoS::AtLeastOnce);
        assert_eq!(up.metrics.downlink_messages.get(), 2);
        up.stop().await;
    });
}

#[test]
fn broker_with_an_untrusted_certificate_is_retried_and_never_acked() {
    let pki = TestPki::generate();
    let other_ca = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut cfg = cloud_config(&pki, &broker, MqttProtocol::V5);
        cfg.ca_file = Some(other_ca.ca_path().to_path_buf());
        cfg.reconnect_min = Duration::from_millis(20);
        cfg.reconnect_max = Duration::from_millis(100);
        let up = start_uplink(cfg, 64 * 1024);
        let acks = DeviceAcks::new();
        up.queue.push(message(0, 0, &acks)).await;

        let mut seen_disconnected = false;
        let deadline = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < deadline {
            let state = up.metrics.state();
            assert_ne!(
                state, "connected",
                "a broker we cannot verify is never trusted"
            );
            seen_disconnected |= state == "disconnected";
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let failures = up.metrics.connect_failures.get();
        println!("untrusted broker: {failures} failed connection attempts in 1.5 s");
        assert!(
            seen_disconnected,
            "state gauge shows disconnected between attempts"
        );
        assert!(failures >= 3, "keeps retrying ({failures} attempts)");
        assert_eq!(up.metrics.connects.get(), 0);
        assert!(
            acks.drain().is_empty(),
            "nothing acknowledged to the device"
        );
        assert_eq!(up.queue.len(), 1, "the message waits for a good connection");
        up.stop().await;
    });
}

#[test]
fn client_certificate_is_presented_when_the_broker_requires_one() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .require_client_cert(true)
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut sub = {
            let opts = ConnectOpts::new(ProtocolVersion::V5, "cloud-app")
                .with_tls(pki.rustls_client_config(true), "localhost");
            let (mut c, _) = TestClient::connect(broker.tls_addr(), opts)
                .await
                .expect("subscriber connects");
            c.subscribe(&[("dev/#", QoS::AtLeastOnce)])
                .await
                .expect("SUBACK");
            c
        };
        let mut cfg = cloud_config(&pki, &broker, MqttProtocol::V311);
        cfg.cert_file = Some(pki.client_cert_path().to_path_buf());
        cfg.key_file = Some(pki.client_key_path().to_path_buf());
        let up = start_uplink(cfg, 64 * 1024);
        let acks = DeviceAcks::new();
        up.queue.push(message(2, 7, &acks)).await;
        let got = sub
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("delivered over mutual TLS");
        assert_eq!(got.payload, payload(2, 7));
        wait_until("the device ack", Duration::from_secs(5), || {
            !acks.drain().is_empty()
        })
        .await;
        up.stop().await;
    });
}
