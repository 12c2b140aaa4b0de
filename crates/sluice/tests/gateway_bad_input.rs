//! Bad input closes only the offending connection: a healthy device streaming to the real
//! cloud broker keeps every message, in order, while others send garbage, oversized packets,
//! protocol violations, go silent, or flood the listener.

mod common;

use std::time::Duration;

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, TestClient};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_oversized_silent_and_flooding_clients_do_not_disturb_a_healthy_device() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "healthy/#").await;
    // A configured login (4 MiB per check) for the password storm; the other devices
    // connect anonymously.
    let hash = argon2_hash(b"right", 4);
    let text = format!(
        "[gateway]\nshards = 2\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\nmax_packet_size = \"4KiB\"\nconnect_timeout = \"1s\"\nallow_anonymous = true\n[[mqtt.users]]\nusername = \"meter\"\npassword_hash = \"{hash}\"\n[coap]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n{}",
        cloud.uplink_toml(None, "")
    );
    let gw = sluice::app::Gateway::build(sluice::config::parse(&text).unwrap())
        .unwrap()
        .start()
        .unwrap();
    let addr = gw.mqtt_addr;

    // The healthy device streams QoS 1 throughout.
    let healthy = tokio::spawn(async move {
        let (mut c, _) = TestClient::connect(addr, ConnectOpts::v5("healthy-1"))
            .await
            .unwrap();
        for i in 0..400u32 {
            c.publish(
                "healthy/meter",
                i.to_be_bytes().to_vec(),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .expect("healthy publish acked");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        c.disconnect().await.unwrap();
    });

    // 0. A storm of logins with wrong passwords, in flight while everything below happens.
    const LOGINS: usize = 100;
    let mut logins = tokio::task::JoinSet::new();
    for i in 0..LOGINS {
        logins.spawn(async move {
            let mut opts = ConnectOpts::v311(format!("guess-{i}"));
            opts.username = Some("meter".into());
            opts.password = Some(bytes::Bytes::from(format!("wrong-{i}")));
            opts.timeout = Duration::from_secs(60);
            TestClient::connect(addr, opts)
                .await
                .map(|(_c, ack)| ack.code)
                .map_err(|e| e.to_string())
        });
    }

    // 1. Garbage instead of CONNECT.
    let mut g = TestClient::open(addr, &ConnectOpts::v311("x"))
        .await
        .unwrap();
    g.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(
        g.expect_closed(Duration::from_secs(3)).await,
        "garbage connection closed"
    );

    // 2. A malformed remaining length after a valid CONNECT.
    let mut m = device(&gw, "malformed", ProtocolVersion::V311).await;
    m.send_raw(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x01])
        .await
        .unwrap();
    assert!(
        m.expect_closed(Duration::from_secs(3)).await,
        "malformed connection closed"
    );

    // 3. An oversized PUBLISH (8 KiB > 4 KiB limit): MQTT 5 gets DISCONNECT 0x95, then close.
    let mut o = device(&gw, "oversized", ProtocolVersion::V5).await;
    let _ = o
        .publish_no_wait("healthy/meter", vec![0u8; 8192], QoS::AtLeastOnce, false)
        .await;
    match o.recv_packet(Duration::from_secs(3)).await {
        Ok(Some(sluice_proto::mqtt::Packet::Disconnect(d))) => assert_eq!(d.reason, 0x95),
        other => panic!("expected DISCONNECT 0x95, got {other:?}"),
    }

    // 4. A protocol violation: a second CONNECT.
    let mut v = device(&gw, "violator", ProtocolVersion::V311).await;
    let again = sluice_proto::mqtt::Packet::Connect(sluice_proto::mqtt::Connect {
        protocol: ProtocolVersion::V311,
        clean_start: true,
        keep_alive: 0,
        client_id: "violator".into(),
        will: None,
        username: None,
        password: None,
        properties: Default::default(),
    });
    v.send_packet(&again).await.unwrap();
    assert!(
        v.expect_closed(Duration::from_secs(3)).await,
        "second CONNECT closes"
    );

    // 5. A silent device: keep-alive 1 s, then nothing → closed after 1.5 s.
    let mut opts = ConnectOpts::v311("silent");
    opts.keep_alive = 1;
    let mut s = device_opts(&gw, opts).await;
    assert!(
        s.expect_closed(Duration::from_secs(4)).await,
        "silent device closed by keep-alive"
    );

    // 6. A flood: 300 sockets that never send CONNECT; all dropped after connect_timeout.
    let mut flood = Vec::new();
    for _ in 0..300 {
        if let Ok(sock) = tokio::net::TcpStream::connect(addr).await {
            flood.push(sock);
        }
    }
    assert!(
        flood.len() >= 250,
        "flood connections opened: {}",
        flood.len()
    );

    healthy
        .await
        .expect("healthy device finished with every publish acknowledged");
    for i in 0..400u32 {
        let p = sub
            .recv(Duration::from_secs(5))
            .await
            .unwrap()
            .expect("healthy message in the cloud");
        assert_eq!(&p.payload[..], &i.to_be_bytes(), "healthy stream in order");
    }
    let metrics = gw.metrics_text();
    assert!(
        metric_sum(
            &metrics,
            "sluice_mqtt_connections_closed_total{shard=\"0\",reason=\"protocol_error\"}"
        ) + metric_sum(
            &metrics,
            "sluice_mqtt_connections_closed_total{shard=\"1\",reason=\"protocol_error\"}"
        ) >= 3.0,
        "{metrics}"
    );
    assert!(
        metric_sum(
            &metrics,
            "sluice_mqtt_connections_closed_total{shard=\"0\",reason=\"keep_alive_timeout\"}"
        ) + metric_sum(
            &metrics,
            "sluice_mqtt_connections_closed_total{shard=\"1\",reason=\"keep_alive_timeout\"}"
        ) >= 1.0
    );
    // Every wrong password was refused: checked (bad credentials, 4) or, beyond the two
    // check slots and their wait, refused as busy (3). None admitted.
    while let Some(done) = logins.join_next().await {
        let code = done
            .expect("login task")
            .expect("a CONNACK for every login");
        assert!(code == 4 || code == 3, "bad login answered with {code}");
    }
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_control_auth_checks_total")
            + metric_sum(&m, "sluice_control_auth_busy_total"),
        LOGINS as f64,
        "every login checked or refused as busy: {m}"
    );
    // The flood is cleared by the CONNECT timeout.
    assert!(
        eventually(Duration::from_secs(5), || metric_sum(
            &gw.metrics_text(),
            "sluice_control_handshake_failures_total"
        ) >= 250.0)
        .await
    );
    drop(flood);
    tokio::task::block_in_place(|| gw.shutdown());
}

/// An argon2id PHC hash of `password` costing `mib` MiB (and one pass) per check.
fn argon2_hash(password: &[u8], mib: u32) -> String {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let params = argon2::Params::new(mib * 1024, 1, 1, None).expect("argon2 params");
    let argon = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let salt = SaltString::encode_b64(b"sluice-test-salt").expect("salt");
    argon
        .hash_password(password, &salt)
        .expect("hash")
        .to_string()
}

/// This process's peak resident memory (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kib * 1024
}

/// The connection flood's login variant: hundreds of CONNECTs naming a configured user with a
/// wrong password, each of which would cost an Argon2 verification (here 4 MiB; sluice's
/// `passwd` default is 19 MiB). The checks run at most `mqtt.auth_concurrency` (default 2)
/// at a time, at most `mqtt.auth_queue` wait, the rest are refused as busy (3.1.1: 0x03);
/// nobody is admitted, the gateway's memory stays within that bound, and a device
/// publishing at QoS 1 meanwhile keeps getting its PUBACKs and the cloud all its messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_wrong_passwords_is_bounded_and_a_publishing_device_keeps_its_acks() {
    const STORM: usize = 300;
    const HASH_MIB: u64 = 4;
    const BOUND: u64 = 2; // the default mqtt.auth_concurrency
    let hash = argon2_hash(b"right", HASH_MIB as u32);

    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "steady/#").await;
    let text = format!(
        "[gateway]\nshards = 1\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\nconnect_timeout = \"4s\"\nallow_anonymous = true\n[[mqtt.users]]\nusername = \"meter\"\npassword_hash = \"{hash}\"\n[coap]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n{}",
        cloud.uplink_toml(None, "")
    );
    let gw = sluice::app::Gateway::build(sluice::config::parse(&text).unwrap())
        .unwrap()
        .start()
        .unwrap();
    let addr = gw.mqtt_addr;
    let (mut steady, _) = TestClient::connect(addr, ConnectOpts::v311("steady-1"))
        .await
        .unwrap();
    steady.set_ack_timeout(Duration::from_secs(5));
    let rss_before = peak_rss();

    // The storm: every login in flight at once, each waiting for its CONNACK.
    let mut storm = tokio::task::JoinSet::new();
    for i in 0..STORM {
        storm.spawn(async move {
            let mut opts = ConnectOpts::v311(format!("guess-{i}"));
            opts.username = Some("meter".into());
            opts.password = Some(bytes::Bytes::from(format!("wrong-{i}")));
            opts.timeout = Duration::from_secs(120);
            TestClient::connect(addr, opts)
                .await
                .map(|(_c, ack)| ack.code)
                .map_err(|e| e.to_string())
        });
    }
    // While it is in flight the device publishes at QoS 1: every PUBACK within 5 s.
    let mut sent = 0u32;
    let mut most_verifying = 0.0f64;
    while !storm.is_empty() && sent < 100_000 {
        steady
            .publish(
                "steady/meter",
                sent.to_be_bytes().to_vec(),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .unwrap_or_else(|e| {
                panic!("publish {sent} not acknowledged within 5 s during the login storm: {e}")
            });
        sent += 1;
        let m = gw.metrics_text();
        most_verifying = most_verifying.max(metric_sum(&m, "sluice_control_auth_verifications "));
        while let Some(done) = storm.try_join_next() {
            let code = done
                .expect("login task")
                .expect("every bad login gets a CONNACK");
            assert!(
                code == 4 || code == 3,
                "a wrong password is refused (4) or the check refused as busy (3), got {code}"
            );
        }
    }
    assert!(
        sent >= 10,
        "the device published only {sent} messages while the storm lasted"
    );
    let rss_growth = peak_rss().saturating_sub(rss_before);
    // Each check holds its hash's memory: unbounded, 300 checks took 1.2 GiB. The slack
    // covers the other tests of this binary running meanwhile.
    assert!(
        rss_growth <= BOUND * HASH_MIB * (1 << 20) + (256 << 20),
        "peak memory grew by {} MiB during the storm",
        rss_growth >> 20
    );
    let m = gw.metrics_text();
    assert!(
        most_verifying >= 1.0 && most_verifying <= BOUND as f64,
        "concurrent password checks seen: {most_verifying} (bound {BOUND})"
    );
    assert!(
        metric_sum(&m, "sluice_control_auth_busy_total") >= 1.0,
        "logins beyond the queue were refused as busy: {m}"
    );
    assert_eq!(
        metric_sum(&m, "sluice_control_admitted_total"),
        1.0,
        "only the steady device was admitted"
    );
    for i in 0..sent {
        let p = sub
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("steady message in the cloud");
        assert_eq!(&p.payload[..], &i.to_be_bytes(), "steady stream in order");
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_device_exceeding_receive_maximum_is_disconnected_with_0x93() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false); // cloud unreachable: nothing gets acknowledged
    let text = format!(
        "[gateway]\nshards = 1\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\nreceive_maximum = 4\n[coap]\nlisten = \"127.0.0.1:0\"\n[admin]\nenabled = false\n{}",
        cloud.uplink_toml(Some(gate.addr), "")
    );
    let gw = sluice::app::Gateway::build(sluice::config::parse(&text).unwrap())
        .unwrap()
        .start()
        .unwrap();
    let (mut d, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("greedy"))
        .await
        .unwrap();
    assert_eq!(ack.properties.receive_maximum, Some(4));
    for i in 0..4 {
        d.publish_no_wait("t", vec![i], QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    // At its limit, an MQTT 5 device is still read (it was told the limit): its PINGREQ is
    // answered, and the fifth PUBLISH, arriving on its own read, is seen as the violation.
    // (Reading stopped at the limit once, so a fifth PUBLISH that came in a later read was
    // never seen and the device just hung.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.ping()
        .await
        .expect("PINGRESP while at the receive maximum");
    d.publish_no_wait("t", vec![4], QoS::AtLeastOnce, false)
        .await
        .unwrap();
    match d.recv_packet(Duration::from_secs(10)).await {
        Ok(Some(sluice_proto::mqtt::Packet::Disconnect(x))) => assert_eq!(x.reason, 0x93),
        other => panic!("expected DISCONNECT 0x93, got {other:?}"),
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_topic_alias_is_resolved_before_routing() {
    let gw = gateway(2, "");
    let mut sub = device(&gw, "alias-sub", ProtocolVersion::V311).await;
    sub.subscribe(&[("long/topic/name", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut p = device(&gw, "alias-pub", ProtocolVersion::V5).await;
    let props = sluice_proto::mqtt::Properties {
        topic_alias: Some(3),
        ..Default::default()
    };
    let publish = |topic: &str, payload: &'static [u8], props: &sluice_proto::mqtt::Properties| {
        sluice_proto::mqtt::Packet::Publish(sluice_proto::mqtt::Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: topic.into(),
            packet_id: None,
            properties: Some(Box::new(props.clone())),
            payload: bytes::Bytes::from_static(payload),
        })
    };
    p.send_packet(&publish("long/topic/name", b"first", &props))
        .await
        .unwrap();
    p.send_packet(&publish("", b"second", &props))
        .await
        .unwrap();
    for want in [&b"first"[..], &b"second"[..]] {
        let got = sub
            .recv(Duration::from_secs(3))
            .await
            .unwrap()
            .expect("delivered");
        assert_eq!(got.topic, "long/topic/name");
        assert_eq!(&got.payload[..], want);
    }
    tokio::task::block_in_place(|| gw.shutdown());
}
