//! What the uplink does when the cloud cannot take a message: too big for the broker's Maximum
//! Packet Size (alone or inside a SenML pack), refused for good (MQTT 5 PUBACK 0x87 Not
//! authorized, from a real Mosquitto with an ACL) or refused for now (0x97 Quota exceeded, from
//! a small fault-injecting broker: Mosquitto never sends it). Nothing a device had acknowledged
//! may be lost with a pack-mate, and a temporary refusal is resent, in order, after a backoff.
//! The same fault-injecting broker also holds a downlink command's delivery back, to observe
//! that its PUBACK waits for the local delivery.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use common::fault_broker::{quota_broker, COMMAND_ID};
use common::{run_local, wait_until};
use sluice::config::{ByteSize, MqttProtocol, UplinkConfig, UplinkUrl};
use sluice::message::ack::{AckToken, DeviceAcks};
use sluice::sink::{self as uplink, DropReason, UplinkMessage, UplinkMetrics, UplinkQueue};
use sluice::telemetry::metrics::PromWriter;
use sluice_proto::mqtt::{ProtocolVersion, Publish, QoS};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};
use tokio::sync::watch;
use tokio::task::JoinHandle;

fn base_config(url: UplinkUrl) -> UplinkConfig {
    let mut cfg = UplinkConfig::new("cloud", url);
    cfg.client_id = "gw".into();
    cfg.protocol = MqttProtocol::V5;
    cfg.inflight = 64;
    cfg.keep_alive = Duration::from_secs(5);
    cfg.connect_timeout = Duration::from_secs(5);
    cfg.reconnect_min = Duration::from_millis(50);
    cfg.reconnect_max = Duration::from_millis(300);
    cfg
}

fn tls_config(pki: &TestPki, broker: &Mosquitto) -> UplinkConfig {
    let mut cfg = base_config(UplinkUrl {
        tls: true,
        host: "127.0.0.1".into(),
        port: broker.tls_port(),
    });
    cfg.ca_file = Some(pki.ca_path().to_path_buf());
    cfg.server_name = Some("localhost".into());
    cfg
}

struct Uplink {
    queue: Rc<UplinkQueue>,
    metrics: Arc<UplinkMetrics>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Runs one normal-lane session; `devices` is what it believes is connected (aggregation
/// starts above `aggregate.min_devices`).
fn start_uplink(cfg: UplinkConfig, devices: usize) -> Uplink {
    let tls = cfg
        .url
        .tls
        .then(|| uplink::client_tls_config(&cfg).expect("TLS config"));
    let queue = Rc::new(UplinkQueue::new(1024 * 1024));
    let metrics = Arc::new(UplinkMetrics::new());
    let (shutdown, rx) = watch::channel(false);
    let task = uplink::spawn(
        uplink::SessionSeed {
            shard: 0,
            lane: uplink::Lane::Normal,
            route: uplink::UplinkRoute::new(&cfg),
            cfg: Rc::new(cfg),
            tls,
            queue: queue.clone(),
            downlink: Rc::new(|_p: uplink::CloudMessage| -> uplink::DownlinkDelivery {
                Box::pin(async {})
            }),
            metrics: metrics.clone(),
            live_devices: Arc::new(AtomicUsize::new(devices)),
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

    fn metrics_text(&self) -> String {
        let mut w = PromWriter::new();
        self.metrics.render(&mut w, "0", "cloud", "normal");
        w.finish()
    }
}

fn message(topic: &str, payload: Bytes, acks: &Rc<DeviceAcks>, packet_id: u16) -> UplinkMessage {
    UplinkMessage {
        device: ByteString::from_static("dev"),
        topic: ByteString::from(topic),
        payload,
        qos: QoS::AtLeastOnce,
        retain: false,
        received_at: Instant::now(),
        ack: Some(AckToken::new(acks, packet_id)),
        content_type: None,
        user_properties: None,
        stored: None,
    }
}

async fn cloud_subscriber(pki: &TestPki, broker: &Mosquitto, filter: &str) -> TestClient {
    let opts = ConnectOpts::v5("cloud-app").with_tls(pki.rustls_client_config(false), "localhost");
    let (mut c, ack) = TestClient::connect(broker.tls_addr(), opts)
        .await
        .expect("subscriber connects");
    assert_eq!(ack.code, 0);
    assert_eq!(
        c.subscribe(&[(filter, QoS::AtLeastOnce)])
            .await
            .expect("SUBACK"),
        vec![1]
    );
    c
}

/// Every value the cloud received, in arrival order: SenML records' `vs`/`vd` text from packs
/// and the payloads of messages sent on their own.
fn values_of(p: &Publish) -> Vec<Vec<u8>> {
    if p.topic == "sluice/senml" {
        let records =
            sluice_proto::senml::decode(sluice_proto::senml::Format::Json, &p.payload).unwrap();
        records
            .into_iter()
            .map(|r| match r.value {
                Some(sluice_proto::senml::Value::String(s)) => s.into_bytes(),
                Some(sluice_proto::senml::Value::Data(d)) => d.to_vec(),
                other => panic!("unexpected record value {other:?}"),
            })
            .collect()
    } else {
        vec![p.payload.to_vec()]
    }
}

/// Before: the pack holding a message too big for the broker was dropped whole and every
/// message in it acknowledged to its device — the small pack-mates were lost.
#[test]
fn a_message_too_big_for_the_open_pack_goes_alone_and_its_pack_mates_still_arrive() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .config_line("max_packet_size 2048")
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut sub = cloud_subscriber(&pki, &broker, "#").await;
        let mut cfg = tls_config(&pki, &broker);
        cfg.aggregate.enabled = true;
        cfg.aggregate.min_devices = 0;
        cfg.aggregate.max_pack = ByteSize::kib(16);
        cfg.aggregate.max_delay = Duration::from_millis(200);
        let up = start_uplink(cfg, 1);
        let acks = DeviceAcks::new();
        let mut expected: Vec<Vec<u8>> = Vec::new();
        let mut id = 0u16;
        let mut push = |payload: Vec<u8>| {
            id += 1;
            (message("t", Bytes::from(payload), &acks, id), id)
        };
        // small, small, big (1.5 KB of text: alone it fits in 2048, with the small ones in a
        // pack it does not), small, small, then one too big for the broker even alone.
        for i in 0..5 {
            let payload = if i == 2 {
                vec![b'B'; 1500]
            } else {
                format!("small-{i}").into_bytes()
            };
            expected.push(payload.clone());
            let (m, _) = push(payload);
            up.queue.push(m).await;
        }
        let (huge, _) = push(vec![b'H'; 4096]);
        up.queue.push(huge).await;
        let mut got: Vec<Vec<u8>> = Vec::new();
        while got.len() < expected.len() {
            let Some(p) = sub.recv(Duration::from_secs(10)).await.unwrap() else {
                break;
            };
            got.extend(values_of(&p));
        }
        let short = |v: &[Vec<u8>]| -> Vec<String> {
            v.iter()
                .map(|p| match p.len() {
                    0..=20 => String::from_utf8_lossy(p).into_owned(),
                    n => format!("<{n} bytes>"),
                })
                .collect()
        };
        assert_eq!(
            short(&got),
            short(&expected),
            "every message that fits reached the cloud, in order"
        );
        assert!(
            sub.recv(Duration::from_millis(500))
                .await
                .unwrap()
                .is_none(),
            "nothing more (the 4 KiB message cannot cross a 2 KiB limit)"
        );
        let mut acked = Vec::new();
        wait_until("all six device acks", Duration::from_secs(5), || {
            acked.extend(acks.drain());
            acked.len() == 6
        })
        .await;
        // (Completion order; the device connection writes them in the device's order.)
        acked.sort_unstable();
        assert_eq!(acked, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(up.metrics.dropped(DropReason::TooLargeForCloud), 1);
        assert_eq!(up.metrics.queue_bytes.get(), 0);
        up.stop().await;
    });
}

/// A real Mosquitto with an ACL that denies one topic answers an MQTT 5 PUBLISH there with
/// PUBACK 0x87. That can never succeed: the message is counted by reason, its device token is
/// completed (so the device is not stuck), and the messages after it flow.
#[test]
fn a_publish_refused_as_not_authorized_is_counted_by_reason_and_the_next_ones_flow() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "topic readwrite dev/#\n").unwrap();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .config_lines([
            "allow_anonymous true".to_string(),
            format!("acl_file {}", acl.display()),
        ])
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut sub = cloud_subscriber(&pki, &broker, "dev/#").await;
        let up = start_uplink(tls_config(&pki, &broker), 0);
        let acks = DeviceAcks::new();
        up.queue
            .push(message("secret/x", Bytes::from_static(b"no"), &acks, 1))
            .await;
        up.queue
            .push(message("dev/1", Bytes::from_static(b"yes"), &acks, 2))
            .await;
        let got = sub
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("the allowed message");
        assert_eq!(&got.payload[..], b"yes");
        let mut acked = Vec::new();
        wait_until("both device acks", Duration::from_secs(5), || {
            acked.extend(acks.drain());
            acked.len() == 2
        })
        .await;
        assert_eq!(acked, vec![1, 2]);
        let text = up.metrics_text();
        assert!(
            text.contains("sluice_uplink_cloud_rejected_total{shard=\"0\",uplink=\"cloud\",lane=\"normal\",reason=\"not_authorized\"} 1"),
            "{text}"
        );
        assert_eq!(up.metrics.dropped(DropReason::CloudRejected), 1);
        assert_eq!(up.metrics.state(), "connected");
        up.stop().await;
    });
}

/// Before: a PUBACK 0x97 counted as done — the device got its PUBACK, the cloud never had the
/// message. Now the refused messages are resent after a backoff, in their order, and each
/// device is acknowledged only once the cloud accepted its message.
#[test]
fn quota_exceeded_is_retried_after_a_backoff_in_order_and_acked_only_after_success() {
    run_local(async {
        let (addr, log) = quota_broker(3).await;
        let mut cfg = base_config(UplinkUrl {
            tls: false,
            host: "127.0.0.1".into(),
            port: addr.port(),
        });
        cfg.allow_plaintext = true;
        cfg.refused_retry_min = Duration::from_millis(200);
        cfg.refused_retry_max = Duration::from_secs(1);
        let up = start_uplink(cfg, 0);
        let acks = DeviceAcks::new();
        let started = Instant::now();
        for i in 0..5u16 {
            up.queue
                .push(message("dev/q", Bytes::from(format!("m{i}")), &acks, i + 1))
                .await;
        }
        let seen_acks = Rc::new(RefCell::new(Vec::new()));
        wait_until("the device acks", Duration::from_secs(10), || {
            seen_acks.borrow_mut().extend(acks.drain());
            seen_acks.borrow().len() == 5
        })
        .await;
        let took = started.elapsed();
        let payloads: Vec<Bytes> = log.lock().unwrap().publishes.clone();
        let accepted: Vec<&[u8]> = payloads.iter().map(|b| &b[..]).collect();
        // The two that were not refused went through at once; the three refused ones follow,
        // resent in their original order.
        let mut refused_order: Vec<&[u8]> = accepted
            .iter()
            .copied()
            .filter(|p| [&b"m0"[..], b"m1", b"m2"].contains(p))
            .collect();
        assert_eq!(
            accepted.len(),
            5,
            "every message accepted once: {accepted:?}"
        );
        refused_order.dedup();
        assert_eq!(refused_order, vec![&b"m0"[..], b"m1", b"m2"]);
        assert!(
            took >= Duration::from_millis(100),
            "resent only after a backoff ({took:?})"
        );
        let mut acked = seen_acks.borrow().clone();
        acked.sort_unstable();
        assert_eq!(
            acked,
            vec![1, 2, 3, 4, 5],
            "each device message acknowledged once"
        );
        assert_eq!(up.metrics.dropped(DropReason::CloudRejected), 0);
        assert!(up.metrics_text().contains("sluice_uplink_cloud_refusals_retried_total{shard=\"0\",uplink=\"cloud\",lane=\"normal\"} 3"), "{}", up.metrics_text());
        up.stop().await;
    });
}

/// Before: the downlink PUBACK was written as soon as the command was decoded, whether or not
/// the gateway could deliver it. Now the session waits for the downlink future (the shard
/// accepting the command for its local subscribers) before it acknowledges the cloud.
#[test]
fn a_downlink_command_is_acknowledged_to_the_cloud_only_after_local_delivery_was_accepted() {
    run_local(async {
        let (addr, log) = quota_broker(0).await;
        let mut cfg = base_config(UplinkUrl {
            tls: false,
            host: "127.0.0.1".into(),
            port: addr.port(),
        });
        cfg.allow_plaintext = true;
        cfg.receive = vec!["cmd/#".into()];
        let tls = None;
        let queue = Rc::new(UplinkQueue::new(64 * 1024));
        let metrics = Arc::new(UplinkMetrics::new());
        let delivered: Rc<RefCell<Vec<uplink::CloudMessage>>> = Rc::default();
        let accept = Rc::new(tokio::sync::Notify::new());
        let (sink, gate) = (delivered.clone(), accept.clone());
        let (shutdown, rx) = watch::channel(false);
        let task = uplink::spawn(
            uplink::SessionSeed {
                shard: 0,
                lane: uplink::Lane::Normal,
                route: uplink::UplinkRoute::new(&cfg),
                cfg: Rc::new(cfg),
                tls,
                queue,
                downlink: Rc::new(move |p: uplink::CloudMessage| -> uplink::DownlinkDelivery {
                    sink.borrow_mut().push(p);
                    let gate = gate.clone();
                    // Delivery is accepted only when the test says so.
                    Box::pin(async move { gate.notified().await })
                }),
                metrics: metrics.clone(),
                live_devices: Arc::new(AtomicUsize::new(0)),
                on_port: None,
                feeders: Default::default(),
                links: None,
                function: None,
            },
            rx,
        );
        wait_until(
            "the command reaches the downlink",
            Duration::from_secs(10),
            || delivered.borrow().len() == 1,
        )
        .await;
        assert_eq!(delivered.borrow()[0].topic, "cmd/valve/open");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            log.lock().unwrap().pubacks.is_empty(),
            "no PUBACK while local delivery is pending"
        );
        accept.notify_one();
        wait_until("the PUBACK to the cloud", Duration::from_secs(5), || {
            log.lock().unwrap().pubacks == vec![COMMAND_ID]
        })
        .await;
        assert_eq!(metrics.downlink_acked.get(), 1);
        shutdown.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("session ends on shutdown")
            .expect("no panic");
    });
}

/// End to end through a gateway: the cloud refuses a topic (Mosquitto ACL, PUBACK 0x87). An
/// MQTT 5 device is told so in its PUBACK; a 3.1.1 device, which has no reason codes, gets
/// an ordinary PUBACK. Both keep publishing: their next messages reach the cloud.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_is_told_the_clouds_refusal_in_its_mqtt5_puback_and_keeps_publishing() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "topic readwrite dev/#\n").unwrap();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .plain_listener(false)
        .config_lines([
            "allow_anonymous true".to_string(),
            format!("acl_file {}", acl.display()),
        ])
        .start()
        .expect("mosquitto starts");
    let cloud = common::Cloud { pki, broker };
    let mut sub = cloud_subscriber(&cloud.pki, &cloud.broker, "dev/#").await;
    let gw = common::gateway(1, &cloud.uplink_toml(None, ""));
    for (version, expected) in [(ProtocolVersion::V5, 0x87), (ProtocolVersion::V311, 0)] {
        let mut dev = common::device(&gw, &format!("dev-{version:?}"), version).await;
        let code = dev
            .publish("secret/plans", &b"x"[..], QoS::AtLeastOnce, false)
            .await
            .expect("the device gets a PUBACK");
        assert_eq!(code, expected, "{version:?}");
        let code = dev
            .publish(
                "dev/ok",
                format!("{version:?}").into_bytes(),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .expect("the next message is acknowledged");
        assert_eq!(code, 0);
        let got = sub
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("the allowed message reaches the cloud");
        assert_eq!(got.payload, Bytes::from(format!("{version:?}")));
    }
    let text = gw.metrics_text();
    assert_eq!(
        common::metric_sum(&text, "sluice_uplink_cloud_rejected_total{shard=\"0\",uplink=\"cloud\",lane=\"normal\",reason=\"not_authorized\"}"),
        2.0,
        "{text}"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}
