//! The control plane stays apart from the data plane, memory stays bounded while the cloud is
//! away, and the admin endpoint serves what operators scrape.

mod common;

use std::time::{Duration, Instant};

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An argon2id hash that takes a good fraction of a second to verify in a debug build.
fn expensive_hash(password: &[u8]) -> String {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let params = argon2::Params::new(16 * 1024, 6, 1, None).expect("argon2 params");
    let a = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let salt = SaltString::encode_b64(b"sluice-test-salt").expect("salt");
    a.hash_password(password, &salt).expect("hash").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_expensive_logins_does_not_stall_connected_devices() {
    let hash = expensive_hash(b"pw");
    // Anonymous devices too (off by default once users exist); the logins queue for the two
    // check slots, so give them time.
    let gw = gateway_mqtt(
        1,
        &format!("allow_anonymous = true\nconnect_timeout = \"120s\"\n[[mqtt.users]]\nusername = \"slow\"\npassword_hash = \"{hash}\"\n"),
        "",
    );
    let mut sub = device(&gw, "listener", ProtocolVersion::V311).await;
    sub.subscribe(&[("data", QoS::AtLeastOnce)]).await.unwrap();
    let mut healthy = device(&gw, "healthy", ProtocolVersion::V311).await;

    let addr = gw.mqtt_addr;
    let storm_started = Instant::now();
    let mut storm = Vec::new();
    for i in 0..8 {
        storm.push(tokio::spawn(async move {
            let mut opts = ConnectOpts::v311(format!("login-{i}"));
            opts.username = Some("slow".into());
            opts.password = Some(bytes::Bytes::from_static(b"pw"));
            opts.timeout = Duration::from_secs(120);
            let (_c, ack) = TestClient::connect(addr, opts)
                .await
                .expect("slow login answered");
            assert_eq!(ack.code, 0, "right password admitted");
            Instant::now()
        }));
    }
    // While the admissions hash, the connected device's QoS 1 traffic flows.
    for i in 0..100u32 {
        healthy
            .publish("data", i.to_be_bytes().to_vec(), QoS::AtLeastOnce, false)
            .await
            .unwrap();
        sub.recv(Duration::from_secs(5))
            .await
            .unwrap()
            .expect("delivered during the storm");
    }
    let healthy_done = Instant::now();
    let mut last_admitted = None::<Instant>;
    for t in storm {
        let at = t.await.expect("login task");
        last_admitted = Some(last_admitted.map_or(at, |f| f.max(at)));
    }
    let last_admitted = last_admitted.expect("some login");
    assert!(
        healthy_done < last_admitted,
        "100 publishes took {:?}, but the last login was admitted after {:?}: the storm was not slow enough to prove anything",
        healthy_done - storm_started,
        last_admitted - storm_started
    );
    // A wrong password is refused with the 3.1.1 code 4.
    let mut opts = ConnectOpts::v311("intruder");
    opts.username = Some("slow".into());
    opts.password = Some(bytes::Bytes::from_static(b"nope"));
    opts.timeout = Duration::from_secs(60);
    let (_c, ack) = TestClient::connect(addr, opts).await.unwrap();
    assert_eq!(ack.code, 4);
    tokio::task::block_in_place(|| gw.shutdown());
}

/// Configuring logins closes the door to anonymous devices unless `allow_anonymous` says
/// otherwise, and `sluice check` prints the value in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_users_configured_anonymous_devices_are_refused_unless_allowed_explicitly() {
    let hash = sluice::control::admission::hash_password(b"pw").expect("hash");
    let users = format!("[[mqtt.users]]\nusername = \"meter\"\npassword_hash = \"{hash}\"\n");
    for (allow, admitted) in [("", false), ("allow_anonymous = true\n", true)] {
        let gw = gateway_mqtt(1, &format!("{allow}{users}"), "");
        let (_c, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("anon"))
            .await
            .expect("CONNACK");
        if admitted {
            assert_eq!(ack.code, 0, "explicit allow_anonymous = true admits");
        } else {
            assert_eq!(ack.code, 0x87, "anonymous refused with Not authorized");
        }
        let mut opts = ConnectOpts::v311("meter-1");
        opts.username = Some("meter".into());
        opts.password = Some(bytes::Bytes::from_static(b"pw"));
        opts.timeout = Duration::from_secs(60);
        let (_c, ack) = TestClient::connect(gw.mqtt_addr, opts).await.unwrap();
        assert_eq!(ack.code, 0, "the configured user logs in");
        tokio::task::block_in_place(|| gw.shutdown());
    }
    // No users: anonymous devices are admitted (nothing else could connect).
    let gw = gateway(1, "");
    device(&gw, "anon", ProtocolVersion::V311).await;
    tokio::task::block_in_place(|| gw.shutdown());

    let dir = tempfile::tempdir().expect("temp dir");
    for (text, want) in [
        (users.clone(), "allow_anonymous = false"),
        (String::new(), "allow_anonymous = true"),
        (
            format!("[mqtt]\nallow_anonymous = true\n{users}"),
            "allow_anonymous = true",
        ),
    ] {
        let path = dir.path().join("sluice.toml");
        std::fs::write(&path, &text).expect("write config");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("check")
            .arg("-c")
            .arg(&path)
            .output()
            .expect("run sluice check");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}: {stdout}");
        assert!(
            stdout.lines().any(|l| l == want),
            "sluice check of\n{text}\nprints {want}:\n{stdout}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_cloud_away_memory_stays_bounded_qos0_drops_are_counted_and_qos1_waits() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    let text = format!(
        "[gateway]\nshards = 1\npin_threads = false\nmax_buffered = \"128KiB\"\n[mqtt]\nlisten = \"127.0.0.1:0\"\nmax_packet_size = \"64KiB\"\n[coap]\nlisten = \"127.0.0.1:0\"\n[admin]\nenabled = false\n{}",
        cloud.uplink_toml(Some(gate.addr), "")
    );
    let gw = sluice::app::Gateway::build(sluice::config::parse(&text).unwrap())
        .unwrap()
        .start()
        .unwrap();
    let queue_bytes = |gw: &sluice::app::RunningGateway| {
        metric_sum(&gw.metrics_text(), "sluice_uplink_queue_bytes{")
    };

    // QoS 0 flood: 1,000 × 1 KiB into a 128 KiB bound.
    let mut q0 = device(&gw, "chatty", ProtocolVersion::V311).await;
    for _ in 0..1000 {
        q0.publish("t/q0", vec![7u8; 1024], QoS::AtMostOnce, false)
            .await
            .unwrap();
    }
    q0.ping().await.unwrap(); // everything before the ping was processed
    let m = gw.metrics_text();
    assert!(
        metric_sum(
            &m,
            "sluice_mqtt_dropped_total{shard=\"0\",reason=\"uplink_queue_full\"}"
        ) >= 800.0,
        "{m}"
    );
    assert!(
        queue_bytes(&gw) <= 128.0 * 1024.0,
        "queue over its bound: {}",
        queue_bytes(&gw)
    );

    // QoS 1 device pipelines 300 × 1 KiB: none acknowledged, memory within the bound.
    let mut q1 = device(&gw, "careful", ProtocolVersion::V311).await;
    q1.set_ack_timeout(Duration::from_secs(30));
    let mut ids = Vec::new();
    for i in 0..300u32 {
        let mut p = vec![0u8; 1024];
        p[..4].copy_from_slice(&i.to_be_bytes());
        ids.push(
            q1.publish_no_wait("t/q1", p, QoS::AtLeastOnce, false)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        q1.recv_packet(Duration::from_millis(200))
            .await
            .unwrap()
            .is_none(),
        "acked without a cloud"
    );
    assert!(
        queue_bytes(&gw) <= 128.0 * 1024.0 + 2048.0,
        "queue over its bound: {}",
        queue_bytes(&gw)
    );

    // The cloud comes back: every QoS 1 message is delivered and acknowledged, in order.
    let mut sub = cloud.subscriber("sub", "t/q1").await;
    gate.set_open(true);
    for id in ids {
        assert_eq!(q1.wait_ack(id).await.unwrap(), 0);
    }
    for i in 0..300u32 {
        let p = sub
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("backlog delivered");
        assert_eq!(&p.payload[..4], &i.to_be_bytes());
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoint_serves_prometheus_metrics_and_json_status() {
    let cloud = Cloud::start();
    let gw = gateway(2, &cloud.uplink_toml(None, ""));
    let mut d = device(&gw, "meter-1", ProtocolVersion::V5).await;
    d.publish("meters/1", "1", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let admin = gw.admin_addr.expect("admin enabled");

    let metrics = http_get(admin, "/metrics").await;
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    for name in [
        "sluice_mqtt_connections",
        "sluice_mqtt_messages_received_total",
        "sluice_mqtt_received_bytes_total",
        "sluice_mqtt_messages_delivered_total",
        "sluice_uplink_messages_sent_total",
        "sluice_uplink_written_bytes_total",
        "sluice_uplink_inflight_messages",
        "sluice_uplink_queue_messages",
        "sluice_mqtt_dropped_total",
        "sluice_uplink_dropped_total",
        "sluice_uplink_ack_latency_seconds_bucket",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }
    assert!(metric_sum(&metrics, "sluice_uplink_ack_latency_seconds_count") >= 1.0);

    // meter-1 is on shard 1: its acknowledged publish shows shard 1's uplink up, not shard
    // 0's, which on a loaded machine may still be in its TLS handshake. Read the status until
    // shard 0's uplink has connected too (or give up after 20 s and assert on the last one).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let json = loop {
        let status = http_get(admin, "/api/v1/status").await;
        assert!(status.starts_with("HTTP/1.1 200"));
        let body = &status[status.find("\r\n\r\n").unwrap() + 4..];
        let json: serde_json::Value = serde_json::from_str(body).expect("status is JSON");
        if json["shards"][0]["uplinks"][0]["state"] == "connected"
            || std::time::Instant::now() > deadline
        {
            break json;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(json["shards"].as_array().unwrap().len(), 2);
    assert_eq!(json["devices"], 1);
    assert_eq!(json["shards"][0]["uplinks"][0]["state"], "connected");
    tokio::task::block_in_place(|| gw.shutdown());
}

/// A reconnect storm on the device listener — logins queued behind one slow password check,
/// and every remaining connection slot held by a socket that never sends CONNECT — leaves the
/// admin API answering and two connected devices subscribing and exchanging messages across
/// shards (which needs the control plane to publish their subscriptions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_storm_stalls_neither_the_admin_api_nor_subscriptions() {
    const MAX_CONNECTIONS: usize = 40;
    const LOGINS: usize = 8;
    let hash = expensive_hash(b"pw");
    let gw = gateway_mqtt(
        2,
        &format!("allow_anonymous = true\nmax_connections = {MAX_CONNECTIONS}\nauth_concurrency = 1\nauth_queue = 16\nconnect_timeout = \"120s\"\n[[mqtt.users]]\nusername = \"slow\"\npassword_hash = \"{hash}\"\n"),
        "",
    );
    let ids = ids_on_shards("calm", 2, 1);
    let mut a = device(&gw, &ids[0][0], ProtocolVersion::V5).await;
    let mut b = device(&gw, &ids[1][0], ProtocolVersion::V311).await;
    let metric = |name: &str| metric_sum(&gw.metrics_text(), name);

    // Logins that each need the one password-check slot.
    let addr = gw.mqtt_addr;
    let mut logins = Vec::new();
    for i in 0..LOGINS {
        logins.push(tokio::spawn(async move {
            let mut opts = ConnectOpts::v311(format!("login-{i}"));
            opts.username = Some("slow".into());
            opts.password = Some(bytes::Bytes::from_static(b"pw"));
            opts.timeout = Duration::from_secs(120);
            TestClient::connect(addr, opts).await
        }));
    }
    // Every login has reached admission: its check started or it waits for the slot.
    wait_until(
        "the logins reach admission",
        Duration::from_secs(60),
        || {
            metric("sluice_control_auth_checks_total") + metric("sluice_control_auth_waiting")
                >= LOGINS as f64
        },
    )
    .await;
    // Silent sockets take every slot left, and then some: the listener refuses the excess.
    let mut silent = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        silent.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    }
    wait_until("max_connections reached", Duration::from_secs(60), || {
        metric("sluice_control_refused_total") >= 1.0
    })
    .await;

    // The admin API answers.
    let admin = gw.admin_addr.expect("admin enabled");
    let status = tokio::time::timeout(Duration::from_secs(30), http_get(admin, "/api/v1/status"))
        .await
        .expect("admin answers during the storm");
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let body = &status[status.find("\r\n\r\n").expect("head") + 4..];
    let json: serde_json::Value = serde_json::from_str(body).expect("status is JSON");
    assert!(json["devices"].as_i64().unwrap_or(0) >= 2, "{json}");

    // Both devices subscribe and hear each other across the two shards.
    let codes = a.subscribe(&[("storm/to-a", QoS::AtLeastOnce)]).await;
    assert_eq!(codes.expect("SUBACK during the storm"), vec![1]);
    let codes = b.subscribe(&[("storm/to-b", QoS::AtLeastOnce)]).await;
    assert_eq!(codes.expect("SUBACK during the storm"), vec![1]);
    b.publish("storm/to-a", "hello a", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    a.publish("storm/to-b", "hello b", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let got = a
        .recv(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a hears b");
    assert_eq!(&got.payload[..], b"hello a");
    let got = b
        .recv(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("b hears a");
    assert_eq!(&got.payload[..], b"hello b");

    // The storm passes: every queued login is admitted, and once the silent sockets go a new
    // device gets in again.
    let mut admitted = Vec::new();
    for login in logins {
        let (c, ack) = login.await.expect("login task").expect("login answered");
        assert_eq!(ack.code, 0, "right password admitted");
        admitted.push(c);
    }
    drop(silent);
    let mut late = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while late.is_none() && Instant::now() < deadline {
        match TestClient::connect(addr, ConnectOpts::v311("late")).await {
            Ok((c, ack)) if ack.code == 0 => late = Some(c),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    assert!(late.is_some(), "a device connects after the storm");
    tokio::task::block_in_place(|| gw.shutdown());
}
