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
    let text = format!(
        "[gateway]\nshards = 2\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\nmax_packet_size = \"4KiB\"\nconnect_timeout = \"1s\"\n[admin]\nlisten = \"127.0.0.1:0\"\n{}",
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_device_exceeding_receive_maximum_is_disconnected_with_0x93() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false); // cloud unreachable: nothing gets acknowledged
    let text = format!(
        "[gateway]\nshards = 1\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\nreceive_maximum = 4\n[admin]\nenabled = false\n{}",
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
    for i in 0..5 {
        d.publish_no_wait("t", vec![i], QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    match d.recv_packet(Duration::from_secs(3)).await {
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
