//! Input bounds against the real `sluice` binary: what one device sends must never take the
//! gateway down or let memory grow without bound.
//!
//! Deep topics: the gateway runs as a child process, so a crash (a stack overflow aborts the
//! whole process) shows as the process having exited, with its stderr in the failure message,
//! instead of killing the test runner; each such test asserts the process is still alive and
//! still serving other devices after the attack. Memory bounds (sessions, queued bytes,
//! retained bytes, subscriptions): an in-process gateway, observed by its devices and metrics.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{eventually, gateway_mqtt, ids_on_shards, metric_sum};
use sluice_proto::mqtt::{Packet, ProtocolVersion, QoS, Will};
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A filter/topic of 32,000 levels (`a/a/…/a`, 63,999 bytes): within MQTT's 65,535-byte
/// string and the 1 MiB packet limit.
fn deep_topic(levels: usize) -> String {
    vec!["a"; levels].join("/")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_32000_level_subscribe_and_publish_close_only_that_device_and_the_gateway_keeps_serving()
{
    let gw = GatewayProcess::start("");
    let deep = deep_topic(32_000);

    // MQTT 3.1.1: the deep filter is refused in the SUBACK (0x80); publishing to the deep
    // topic closes the connection. Before the fix the SUBSCRIBE was taken and the PUBLISH's
    // match recursed once per level: "thread 'sluice-shard-N' has overflowed its stack".
    let mut v3 = connect(gw.mqtt, ConnectOpts::v311("deep-311")).await;
    let codes_311 = v3.subscribe(&[(deep.as_str(), QoS::AtMostOnce)]).await;
    let _ = v3
        .publish_no_wait(deep.as_str(), "x", QoS::AtMostOnce, false)
        .await;
    let v3_closed = v3.expect_closed(Duration::from_secs(5)).await;
    // The connection is gone either way now, so the session ends and its subscriptions are
    // removed (before the fix: another walk once per level, and the old snapshot's drop).
    drop(v3);
    gw.assert_stays_alive(
        Duration::from_secs(3),
        "after a 32,000-level SUBSCRIBE and PUBLISH (MQTT 3.1.1)",
    );
    assert_eq!(codes_311.expect("SUBACK"), vec![0x80], "3.1.1 SUBACK");
    assert!(
        v3_closed,
        "the 3.1.1 device publishing to a 32,000-level topic is closed"
    );

    // MQTT 5: SUBACK 0x8F Topic Filter invalid; PUBLISH → DISCONNECT 0x90 Topic Name invalid.
    let mut v5 = connect(gw.mqtt, ConnectOpts::v5("deep-5")).await;
    let codes_5 = v5
        .subscribe(&[
            (deep.as_str(), QoS::AtLeastOnce),
            ("fine/#", QoS::AtLeastOnce),
        ])
        .await
        .expect("SUBACK");
    assert_eq!(
        codes_5,
        vec![0x8F, 0x01],
        "MQTT 5 SUBACK: only the deep filter refused"
    );
    let _ = v5
        .publish_no_wait(deep.as_str(), "x", QoS::AtLeastOnce, false)
        .await;
    match v5.recv_packet(Duration::from_secs(10)).await {
        Ok(Some(Packet::Disconnect(d))) => assert_eq!(d.reason, 0x90),
        other => panic!("expected DISCONNECT 0x90, got {other:?}"),
    }
    drop(v5);
    gw.assert_stays_alive(
        Duration::from_secs(1),
        "after a 32,000-level SUBSCRIBE and PUBLISH (MQTT 5)",
    );

    // A will topic beyond the limits is refused at CONNECT: 0x90 (MQTT 5), 0x05 (3.1.1).
    for (version, code) in [(ProtocolVersion::V5, 0x90), (ProtocolVersion::V311, 0x05)] {
        let mut opts = ConnectOpts::new(version, format!("deep-will-{version:?}"));
        opts.will = Some(Will {
            topic: deep.as_str().into(),
            payload: "gone".into(),
            qos: QoS::AtMostOnce,
            retain: false,
            properties: Default::default(),
        });
        let (_c, ack) = TestClient::connect(gw.mqtt, opts)
            .await
            .expect("CONNACK for a deep will topic");
        assert_eq!(ack.code, code, "{version:?} CONNACK for a deep will topic");
    }

    // Other devices, one on each shard, still publish and subscribe across shards.
    let ids = ids_on_shards("healthy", 2, 1);
    let mut sub = connect(gw.mqtt, ConnectOpts::v5(ids[0][0].clone())).await;
    assert_eq!(
        sub.subscribe(&[("ok/#", QoS::AtLeastOnce)]).await.unwrap(),
        vec![1]
    );
    let mut publ = connect(gw.mqtt, ConnectOpts::v311(ids[1][0].clone())).await;
    publ.publish("ok/1", "still here", QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK for a healthy device");
    let p = sub
        .recv(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("delivered across shards");
    assert_eq!(&p.payload[..], b"still here");
    gw.assert_alive("at the end");

    let metrics = http_get(gw.admin, "/metrics").await;
    assert_eq!(
        metric_sum(
            &metrics,
            "sluice_mqtt_subscriptions_refused_total{shard=\"0\",reason=\"topic_limit\"}"
        ) + metric_sum(
            &metrics,
            "sluice_mqtt_subscriptions_refused_total{shard=\"1\",reason=\"topic_limit\"}"
        ),
        2.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "sluice_mqtt_connections_closed_total{shard=\"0\",reason=\"topic_limit\"}"
        ) + metric_sum(
            &metrics,
            "sluice_mqtt_connections_closed_total{shard=\"1\",reason=\"topic_limit\"}"
        ),
        2.0,
        "{metrics}"
    );
}

/// With the limits raised to MQTT's own maximum, a 32,000-level subscription is stored in a
/// shard's trie and in the control plane's snapshot, matched from another shard, and removed
/// again — the tries never recurse per level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_limits_raised_to_the_protocol_maximum_deep_topics_are_routed_without_a_crash() {
    let gw = GatewayProcess::start("max_topic_levels = 65535\nmax_topic_length = \"65535B\"\n");
    let deep = deep_topic(32_000);
    let ids = ids_on_shards("deep", 2, 1);
    let mut sub = connect(gw.mqtt, ConnectOpts::v5(ids[0][0].clone())).await;
    let plus = format!("{}/+", deep_topic(31_999));
    assert_eq!(
        sub.subscribe(&[
            (deep.as_str(), QoS::AtLeastOnce),
            (plus.as_str(), QoS::AtLeastOnce)
        ])
        .await
        .expect("SUBACK"),
        vec![1, 1]
    );
    let mut publ = connect(gw.mqtt, ConnectOpts::v5(ids[1][0].clone())).await;
    publ.publish(deep.as_str(), "deep", QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK for the deep publish");
    let p = sub
        .recv(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the deep message crossed shards");
    assert_eq!(&p.payload[..], b"deep");
    assert_eq!(
        sub.unsubscribe(&[deep.as_str(), plus.as_str()])
            .await
            .unwrap(),
        vec![0, 0]
    );
    // Ending the session drops whatever is left of its subscriptions.
    sub.disconnect().await.unwrap();
    publ.publish(deep.as_str(), "again", QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK after the subscriber left");
    gw.assert_alive("after deep subscribe, publish, unsubscribe");
}

/// Everything on every shard's line of `name` (metrics are labelled by shard).
fn metric(gw: &sluice::app::RunningGateway, name: &str) -> f64 {
    metric_sum(&gw.metrics_text(), name)
}

/// With the defaults (`max_queued_bytes = "4MiB"`), an offline persistent session keeps 4
/// messages of 1,000,000 bytes, not `max_queued_messages` (1,000) of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_persistent_sessions_queue_stops_at_max_queued_bytes() {
    let gw = gateway_mqtt(1, "", "");
    let mut opts = ConnectOpts::v311("keeper");
    opts.clean_start = false;
    let mut keeper = connect(gw.mqtt_addr, opts.clone()).await;
    assert_eq!(
        keeper
            .subscribe(&[("big/#", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1]
    );
    keeper.disconnect().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &gw,
            "sluice_mqtt_connections{"
        ) == 0.0)
        .await,
        "keeper's connection ended"
    );
    let mut pusher = connect(gw.mqtt_addr, ConnectOpts::v311("pusher")).await;
    for i in 0..10u8 {
        pusher
            .publish("big/x", vec![i; 1_000_000], QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK");
    }
    let queued = metric(&gw, "sluice_mqtt_queued_bytes{");
    let (mut keeper, ack) = TestClient::connect(gw.mqtt_addr, opts).await.unwrap();
    assert!(ack.session_present, "the persistent session was kept");
    let mut got = Vec::new();
    while let Ok(Some(p)) = keeper.recv(Duration::from_secs(2)).await {
        assert_eq!(p.payload.len(), 1_000_000);
        got.push(p.payload[0]);
    }
    assert_eq!(
        got,
        vec![0, 1, 2, 3],
        "the first 4 MiB of messages, in order"
    );
    assert!(
        queued > 3_000_000.0 && queued <= 4.0 * 1024.0 * 1024.0,
        "queued bytes while offline: {queued}"
    );
    assert_eq!(
        metric(
            &gw,
            "sluice_mqtt_queue_refused_total{shard=\"0\",limit=\"session_bytes\"}"
        ),
        6.0
    );
    assert_eq!(
        metric(
            &gw,
            "sluice_mqtt_dropped_total{shard=\"0\",reason=\"session_queue_full\"}"
        ),
        6.0
    );
    // Acknowledged messages are released: nothing stays charged.
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &gw,
            "sluice_mqtt_queued_bytes{"
        ) == 0.0)
        .await,
        "queued bytes released after the acks"
    );
}

/// `max_sessions = 3` over two shards: a new device ends the offline session idle longest on
/// its own shard, or, when its shard has none, on another shard; an evicted session's queued
/// messages are released at once, and its device comes back to a fresh session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_table_stops_at_max_sessions_evicting_offline_sessions() {
    let gw = gateway_mqtt(2, "max_connections = 3\nmax_sessions = 3", "");
    let ids = ids_on_shards("sess", 2, 4);
    let persistent = |id: &str| {
        let mut o = ConnectOpts::v311(id);
        o.clean_start = false;
        o
    };
    // a (shard 0), then b (shard 1): persistent, subscribed, offline.
    for id in [&ids[0][0], &ids[1][0]] {
        let (mut c, _) = connect_when_a_slot_frees(gw.mqtt_addr, persistent(id)).await;
        c.subscribe(&[("x/#", QoS::AtLeastOnce)]).await.unwrap();
        c.disconnect().await.unwrap();
        assert!(
            eventually(Duration::from_secs(10), || metric(
                &gw,
                "sluice_mqtt_connections{"
            ) == 0.0)
            .await
        );
    }
    // c (shard 1) fills the table and queues a message for both offline sessions.
    let (mut c, ack) =
        connect_when_a_slot_frees(gw.mqtt_addr, ConnectOpts::v5(ids[1][1].clone())).await;
    assert_eq!(ack.code, 0);
    assert_eq!(metric(&gw, "sluice_mqtt_sessions{"), 3.0);
    c.publish("x/1", vec![7u8; 10_000], QoS::AtLeastOnce, false)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &gw,
            "sluice_mqtt_queued_bytes{"
        ) > 20_000.0)
        .await,
        "both offline sessions hold the message"
    );
    // d (shard 1): its own shard's offline session b goes, although a is idle longer.
    let (_d, ack) =
        connect_when_a_slot_frees(gw.mqtt_addr, ConnectOpts::v5(ids[1][2].clone())).await;
    assert_eq!(ack.code, 0);
    assert_eq!(
        metric(&gw, "sluice_mqtt_sessions_evicted_total{shard=\"1\"}"),
        1.0
    );
    assert_eq!(metric(&gw, "sluice_mqtt_sessions{"), 3.0);
    // e (shard 1): no offline session left on shard 1, so shard 0 ends a.
    let (e, ack) =
        connect_when_a_slot_frees(gw.mqtt_addr, ConnectOpts::v311(ids[1][3].clone())).await;
    assert_eq!(ack.code, 0);
    assert_eq!(
        metric(&gw, "sluice_mqtt_sessions_evicted_total{shard=\"0\"}"),
        1.0
    );
    assert_eq!(metric(&gw, "sluice_mqtt_sessions{"), 3.0);
    assert_eq!(
        metric(&gw, "sluice_mqtt_queued_bytes{"),
        0.0,
        "the evicted sessions' queues are released at once"
    );
    // e leaves (its clean session ends); a comes back to a fresh session.
    e.disconnect().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &gw,
            "sluice_mqtt_sessions{"
        ) == 2.0)
        .await
    );
    let (_a, ack) = connect_when_a_slot_frees(gw.mqtt_addr, persistent(&ids[0][0])).await;
    assert_eq!(ack.code, 0);
    assert!(!ack.session_present, "a's session was evicted");
    assert_eq!(metric(&gw, "sluice_mqtt_sessions{"), 3.0);
    assert_eq!(metric(&gw, "sluice_mqtt_sessions_refused_total{"), 0.0);
}

/// With the defaults (`max_subscriptions_per_session = 100`): the 101st filter gets 0x97
/// (MQTT 5) / 0x80 (3.1.1); filters the session has already may be subscribed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_beyond_max_subscriptions_per_session_get_a_suback_failure() {
    let gw = gateway_mqtt(1, "", "");
    let filters: Vec<String> = (0..101).map(|i| format!("f/{i}")).collect();
    let all: Vec<(&str, QoS)> = filters
        .iter()
        .map(|f| (f.as_str(), QoS::AtLeastOnce))
        .collect();
    let mut v5 = connect(gw.mqtt_addr, ConnectOpts::v5("many-5")).await;
    let codes = v5.subscribe(&all).await.unwrap();
    assert_eq!(&codes[..100], &[1u8; 100][..]);
    assert_eq!(codes[100], 0x97);
    assert_eq!(
        v5.subscribe(&[("f/0", QoS::AtMostOnce), ("f/100", QoS::AtMostOnce)])
            .await
            .unwrap(),
        vec![0, 0x97],
        "a held filter may be subscribed again; a new one may not"
    );
    let mut v3 = connect(gw.mqtt_addr, ConnectOpts::v311("many-311")).await;
    assert_eq!(v3.subscribe(&all[..100]).await.unwrap(), vec![1u8; 100]);
    assert_eq!(v3.subscribe(&all[100..]).await.unwrap(), vec![0x80]);
    assert_eq!(
        metric(
            &gw,
            "sluice_mqtt_subscriptions_refused_total{shard=\"0\",reason=\"quota\"}"
        ),
        3.0
    );
    assert_eq!(metric(&gw, "sluice_mqtt_subscriptions{"), 200.0);
}

/// With the defaults (`max_retained_bytes = "64MiB"`): 70 retained messages of 1,000,000
/// bytes leave 67 stored and 3 refused, not 70 stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retained_store_stops_at_max_retained_bytes() {
    let gw = gateway_mqtt(1, "", "");
    let mut d = connect(gw.mqtt_addr, ConnectOpts::v311("retainer")).await;
    for i in 0..70u32 {
        d.publish(
            &format!("r/{i}"),
            vec![1u8; 1_000_000],
            QoS::AtLeastOnce,
            true,
        )
        .await
        .expect("PUBACK");
    }
    assert!(
        eventually(Duration::from_secs(20), || {
            metric(&gw, "sluice_control_retained_messages")
                + metric(&gw, "sluice_control_retained_refused_total")
                == 70.0
        })
        .await,
        "{}",
        gw.metrics_text()
    );
    assert_eq!(metric(&gw, "sluice_control_retained_messages"), 67.0);
    assert!(metric(&gw, "sluice_control_retained_bytes") <= 64.0 * 1024.0 * 1024.0);
    // Deleting one (empty payload) makes room for another.
    d.publish("r/0", Vec::new(), QoS::AtLeastOnce, true)
        .await
        .unwrap();
    d.publish("r/99", vec![2u8; 1_000_000], QoS::AtLeastOnce, true)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || {
            metric(&gw, "sluice_control_retained_messages") == 67.0
                && metric(&gw, "sluice_control_retained_refused_total") == 3.0
        })
        .await,
        "{}",
        gw.metrics_text()
    );
}

/// A will delayed beyond the session's expiry is published when the session ends (MQTT 5
/// §3.1.3.2.2), so a delayed will never outlives its session: before, it waited the full
/// delay (here an hour) in a task of its own, one per connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_delayed_beyond_the_session_expiry_is_published_when_the_session_ends() {
    let gw = gateway_mqtt(1, "", "");
    let mut watcher = connect(gw.mqtt_addr, ConnectOpts::v311("watcher")).await;
    watcher
        .subscribe(&[("wills/#", QoS::AtMostOnce)])
        .await
        .unwrap();
    let mut opts = ConnectOpts::v5("mortal");
    opts.properties.session_expiry_interval = Some(1);
    let will_props = sluice_proto::mqtt::Properties {
        will_delay_interval: Some(3600),
        ..Default::default()
    };
    opts.will = Some(Will {
        topic: "wills/mortal".into(),
        payload: "gone".into(),
        qos: QoS::AtMostOnce,
        retain: false,
        properties: will_props,
    });
    let mortal = connect(gw.mqtt_addr, opts).await;
    drop(mortal); // no DISCONNECT: the will is due
    let p = watcher
        .recv(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the will, when the 1 s session ended, not after an hour");
    assert_eq!(&p.payload[..], b"gone");
}

/// A will waiting for its delay is charged to the queued bytes (and so bounded by
/// `gateway.max_outbox_memory`); the device coming back cancels it and frees the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_will_is_charged_until_the_device_returns() {
    let gw = gateway_mqtt(1, "", "");
    let mut opts = ConnectOpts::v5("returning");
    opts.clean_start = false;
    opts.properties.session_expiry_interval = Some(3600);
    opts.will = Some(Will {
        topic: "wills/returning".into(),
        payload: vec![1u8; 10_000].into(),
        qos: QoS::AtMostOnce,
        retain: false,
        properties: sluice_proto::mqtt::Properties {
            will_delay_interval: Some(3600),
            ..Default::default()
        },
    });
    let device = connect(gw.mqtt_addr, opts.clone()).await;
    drop(device); // no DISCONNECT: the will waits for its delay
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &gw,
            "sluice_mqtt_queued_bytes{"
        ) > 10_000.0)
        .await,
        "the waiting will is charged: {}",
        metric(&gw, "sluice_mqtt_queued_bytes{")
    );
    opts.will = None;
    let (_back, ack) = connect_when_a_slot_frees(gw.mqtt_addr, opts).await;
    assert!(ack.session_present);
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &gw,
            "sluice_mqtt_queued_bytes{"
        ) == 0.0)
        .await,
        "the cancelled will's bytes are released"
    );
}

/// Connect, retrying while the listener still counts a connection that just ended against
/// `max_connections` (it closes new sockets without a CONNACK until the count drops).
async fn connect_when_a_slot_frees(
    addr: SocketAddr,
    opts: ConnectOpts,
) -> (TestClient, sluice_proto::mqtt::ConnAck) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TestClient::connect(addr, opts.clone()).await {
            Ok(connected) => return connected,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("connect {}: {e:#}", opts.client_id),
        }
    }
}

async fn connect(addr: SocketAddr, opts: ConnectOpts) -> TestClient {
    let id = opts.client_id.clone();
    let (c, ack) = TestClient::connect(addr, opts)
        .await
        .unwrap_or_else(|e| panic!("connect {id}: {e:#}"));
    assert_eq!(ack.code, 0, "{id} refused: {ack:?}");
    c
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("admin connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The `sluice` binary as a child process on free loopback ports; killed when dropped.
struct GatewayProcess {
    mqtt: SocketAddr,
    admin: SocketAddr,
    stderr_path: PathBuf,
    child: std::sync::Mutex<Child>,
    _dir: tempfile::TempDir,
}

impl GatewayProcess {
    /// Start with two shards, the given extra `[mqtt]` lines, and wait until it accepts.
    fn start(mqtt_extra: &str) -> GatewayProcess {
        let dir = tempfile::tempdir().expect("temp dir");
        let mqtt_port = sluice_testkit::free_port().expect("free port");
        let admin_port = sluice_testkit::free_port().expect("free port");
        let config = dir.path().join("sluice.toml");
        std::fs::write(
            &config,
            format!(
                "[gateway]\nshards = 2\npin_threads = false\n\n\
                 [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n{mqtt_extra}\n\
                 [coap]\nlisten = \"127.0.0.1:0\"\n\n\
                 [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
                 [log]\nlevel = \"info\"\n"
            ),
        )
        .expect("write config");
        let stderr_path = dir.path().join("sluice.stderr");
        let child = spawn(&config, &stderr_path);
        let gw = GatewayProcess {
            mqtt: SocketAddr::from(([127, 0, 0, 1], mqtt_port)),
            admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
            stderr_path,
            child: std::sync::Mutex::new(child),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(gw.mqtt).is_err() {
            gw.assert_alive("while starting");
            assert!(Instant::now() < deadline, "sluice did not start listening");
            std::thread::sleep(Duration::from_millis(20));
        }
        gw
    }

    /// [`GatewayProcess::assert_alive`] throughout `period`.
    fn assert_stays_alive(&self, period: Duration, when: &str) {
        let end = Instant::now() + period;
        while Instant::now() < end {
            self.assert_alive(when);
            std::thread::sleep(Duration::from_millis(50));
        }
        self.assert_alive(when);
    }

    /// Panic with the exit status and stderr if the process is gone.
    fn assert_alive(&self, when: &str) {
        let mut child = self.child.lock().unwrap();
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "sluice exited ({status}) {when}; stderr:\n{}",
                tail(&self.stderr_path)
            );
        }
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        if let Ok(mut child) = self.child.lock() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn(config: &Path, stderr_path: &Path) -> Child {
    let stderr = std::fs::File::create(stderr_path).expect("stderr file");
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("run")
        .arg("-c")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("spawn sluice")
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..]
        .iter()
        .map(|l| l.get(..300).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------------------
// [limits] (ADR 0008): flapping client ids, connection rates at accept, per-device publish rates.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_client_id_is_refused_with_0x9f_and_other_devices_are_not() {
    let gw = gateway_mqtt(
        1,
        "",
        "[limits]\nflap_connects = 3\nflap_window = \"60s\"\nflap_hold = \"60s\"\n",
    );
    for (id, version, refused) in [
        ("flappy", ProtocolVersion::V5, 0x9F),
        ("flappy-311", ProtocolVersion::V311, 0x03),
    ] {
        for _ in 0..3 {
            let (c, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::new(version, id))
                .await
                .unwrap();
            assert_eq!(ack.code, 0);
            c.disconnect().await.unwrap();
        }
        let (_c, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::new(version, id))
            .await
            .unwrap();
        assert_eq!(
            ack.code, refused,
            "{id}: the fourth CONNECT within the window"
        );
    }
    let (_calm, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("calm"))
        .await
        .unwrap();
    assert_eq!(ack.code, 0, "another client id is not held");
    assert_eq!(
        metric_sum(
            &gw.metrics_text(),
            "sluice_limits_connections_refused_total{reason=\"flapping\"}"
        ),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_a_sources_rate_are_closed_at_accept_until_tokens_return() {
    let gw = gateway_mqtt(
        1,
        "",
        "[limits]\nconnect_rate_per_source = 2\nconnect_burst_per_source = 2\n",
    );
    let mut kept = Vec::new();
    for i in 0..2 {
        let (c, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5(format!("src-{i}")))
            .await
            .unwrap();
        assert_eq!(ack.code, 0);
        kept.push(c);
    }
    assert!(
        TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("src-2"))
            .await
            .is_err(),
        "the third connection in a burst of 2 is closed without a CONNACK"
    );
    assert!(
        metric_sum(
            &gw.metrics_text(),
            "sluice_limits_connections_refused_total{reason=\"source_rate\"}"
        ) >= 1.0
    );
    // A token comes back within half a second at 2/s.
    let started = Instant::now();
    loop {
        if let Ok((_c, ack)) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("src-3")).await {
            assert_eq!(ack.code, 0);
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no token came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_over_its_publish_rate_loses_qos0_and_is_slowed_for_qos1() {
    let gw = gateway_mqtt(1, "", "[limits]\npublish_rate = 10\npublish_burst = 5\n");
    let (mut watch, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("watch"))
        .await
        .unwrap();
    watch
        .subscribe(&[("rate/#", QoS::AtMostOnce)])
        .await
        .unwrap();
    let (mut fast, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("fast"))
        .await
        .unwrap();
    for i in 0..30u32 {
        fast.publish("rate/q0", i.to_be_bytes().to_vec(), QoS::AtMostOnce, false)
            .await
            .unwrap();
    }
    fast.ping().await.unwrap(); // everything before the ping was read
    let dropped = metric_sum(
        &gw.metrics_text(),
        "sluice_limits_publish_dropped_total{reason=\"rate\"}",
    );
    assert!(dropped >= 20.0, "dropped {dropped} of 30 with a burst of 5");
    let mut got = 0;
    while watch
        .recv(Duration::from_millis(300))
        .await
        .unwrap()
        .is_some()
    {
        got += 1;
    }
    assert_eq!(
        got as f64,
        30.0 - dropped,
        "what was not dropped was delivered"
    );

    // QoS 1: nothing lost, but 15 messages at 10/s take about 1.5 s.
    let started = Instant::now();
    for i in 0..15u32 {
        let code = fast
            .publish("rate/q1", i.to_be_bytes().to_vec(), QoS::AtLeastOnce, false)
            .await
            .unwrap();
        assert_eq!(code, 0);
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1000),
        "15 QoS 1 messages took {took:?}"
    );
    for _ in 0..15 {
        assert!(watch.recv(Duration::from_secs(5)).await.unwrap().is_some());
    }
    assert!(
        metric_sum(
            &gw.metrics_text(),
            "sluice_limits_publish_throttled_total{reason=\"rate\"}"
        ) >= 10.0
    );
}
