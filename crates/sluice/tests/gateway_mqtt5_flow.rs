//! End-to-end tests of the device-facing MQTT session, part 2 (part 1: gateway_mqtt5.rs):
//! MQTT 5 Server Keep Alive, flow control (the device's and the gateway's Receive Maximum),
//! server topic aliases and shared subscriptions across shards. Real sockets, the gateway
//! in-process, a real cloud Mosquitto where the cloud matters.

mod common;

use std::time::Duration;

use common::packets::{opts_sub, publish};
use common::*;
use sluice_proto::mqtt::{Packet, Properties, ProtocolVersion, PubResponse, QoS};
use sluice_testkit::{ConnectOpts, TestClient};

// ---------------------------------------------------------------------------------------------
// MQTT 5: Server Keep Alive, flow control, server topic aliases.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_keep_alive_caps_a_longer_or_absent_mqtt5_keep_alive_and_is_enforced() {
    // By default there is no limit: every device keeps what it asked for.
    let gw = gateway(1, "");
    for asked in [120u16, 0, 30, 65_535] {
        let mut o = ConnectOpts::v5(format!("ka-default-{asked}"));
        o.keep_alive = asked;
        let (_c, ack) = TestClient::connect(gw.mqtt_addr, o).await.unwrap();
        assert_eq!(ack.properties.server_keep_alive, None, "asked {asked} s");
    }
    tokio::task::block_in_place(|| gw.shutdown());

    let gw = gateway_mqtt(1, "max_keep_alive = \"60s\"", "");
    for (asked, told) in [(120u16, Some(60u16)), (0, Some(60)), (30, None)] {
        let mut o = ConnectOpts::v5(format!("ka-{asked}"));
        o.keep_alive = asked;
        let (_c, ack) = TestClient::connect(gw.mqtt_addr, o).await.unwrap();
        assert_eq!(ack.properties.server_keep_alive, told, "asked {asked} s");
    }
    tokio::task::block_in_place(|| gw.shutdown());

    let gw = gateway_mqtt(1, "max_keep_alive = \"1s\"", "");
    let mut o = ConnectOpts::v5("ka-none");
    o.keep_alive = 0;
    let (mut v5, ack) = TestClient::connect(gw.mqtt_addr, o).await.unwrap();
    assert_eq!(ack.properties.server_keep_alive, Some(1));
    let mut o = ConnectOpts::v311("ka-311");
    o.keep_alive = 0;
    let mut v311 = device_opts(&gw, o).await;
    assert!(
        v5.expect_closed(Duration::from_secs(5)).await,
        "held to the Server Keep Alive"
    );
    v311.ping()
        .await
        .expect("a 3.1.1 device keeps its own keep-alive");
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_sends_no_more_unacknowledged_messages_than_the_devices_receive_maximum() {
    let gw = gateway(1, "");
    let mut o = ConnectOpts::v5("slow-reader");
    o.properties.receive_maximum = Some(2);
    let mut dev = device_opts(&gw, o).await;
    dev.subscribe(&[("fc/#", QoS::AtLeastOnce)]).await.unwrap();
    let mut publ = device(&gw, "fc-pub", ProtocolVersion::V5).await;
    for i in 0..5 {
        publ.publish("fc/x", format!("{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    // Raw reads: the test client would acknowledge what it decodes.
    let mut decoder = sluice_proto::mqtt::Decoder::client(ProtocolVersion::V5, 1 << 20);
    let mut ids = Vec::new();
    let mut read = |bytes: Vec<u8>, ids: &mut Vec<u16>| {
        let mut buf = bytes::BytesMut::from(&bytes[..]);
        while let Ok(Some(p)) = decoder.decode(&mut buf) {
            if let Packet::Publish(p) = p {
                ids.extend(p.packet_id);
            }
        }
    };
    let (bytes, _) = dev.read_raw_until_closed(Duration::from_millis(800)).await;
    read(bytes, &mut ids);
    assert_eq!(ids.len(), 2, "sent beyond the device's Receive Maximum");
    let first = ids[0];
    dev.send_packet(&Packet::PubAck(PubResponse {
        packet_id: first,
        reason: 0,
        properties: None,
    }))
    .await
    .unwrap();
    let (bytes, _) = dev.read_raw_until_closed(Duration::from_millis(800)).await;
    read(bytes, &mut ids);
    assert_eq!(ids.len(), 3, "one more after one acknowledgement");
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreleased_qos2_messages_count_against_the_receive_maximum() {
    let gw = gateway_mqtt(1, "receive_maximum = 4", "");
    let mut dev = device(&gw, "no-pubrel", ProtocolVersion::V5).await;
    for i in 1..=5u16 {
        dev.send_packet(&publish(
            "q2/x",
            "m",
            QoS::ExactlyOnce,
            Some(i),
            Properties::default(),
        ))
        .await
        .unwrap();
        // Let the PUBREC go out before the next, so each one is finished but for PUBREL.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (bytes, closed) = dev.read_raw_until_closed(Duration::from_secs(3)).await;
    assert!(closed, "not disconnected");
    assert!(
        bytes.windows(3).any(|w| w[0] == 0xE0 && w[2] == 0x93),
        "no DISCONNECT 0x93: {bytes:?}"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_topic_aliases_stay_within_the_devices_topic_alias_maximum() {
    let gw = gateway(1, "");
    let mut o = ConnectOpts::v5("alias-dev");
    o.properties.topic_alias_maximum = Some(1);
    let mut dev = device_opts(&gw, o).await;
    dev.subscribe(&[("ta/#", QoS::ExactlyOnce)]).await.unwrap();
    let mut none = device(&gw, "alias-none", ProtocolVersion::V5).await;
    none.subscribe(&[("ta/#", QoS::ExactlyOnce)]).await.unwrap();
    let mut publ = device(&gw, "alias-pub", ProtocolVersion::V5).await;
    for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
        publ.publish("ta/x", "m", qos, false).await.unwrap();
    }
    publ.publish("ta/y", "other", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        let p = dev
            .recv(Duration::from_secs(3))
            .await
            .unwrap()
            .expect("message");
        let alias = p.properties.as_ref().and_then(|p| p.topic_alias);
        got.push((p.topic.to_string(), alias));
    }
    assert_eq!(
        got,
        [
            ("ta/x".to_string(), Some(1)),
            (String::new(), Some(1)),
            (String::new(), Some(1)),
            ("ta/y".to_string(), None),
        ]
    );
    for _ in 0..4 {
        let p = none
            .recv(Duration::from_secs(3))
            .await
            .unwrap()
            .expect("message");
        assert!(!p.topic.is_empty());
        assert_eq!(p.properties.and_then(|p| p.topic_alias), None);
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

// ---------------------------------------------------------------------------------------------
// MQTT 5: shared subscriptions.

/// Receive until a quiet `quiet`; the payloads.
async fn drain(c: &mut TestClient, quiet: Duration) -> Vec<String> {
    let mut v = Vec::new();
    while let Some(p) = c.recv(quiet).await.unwrap() {
        v.push(String::from_utf8_lossy(&p.payload).into_owned());
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_subscription_gives_each_message_to_one_member_across_shards() {
    let gw = gateway(2, "");
    let ids = ids_on_shards("share", 2, 2);
    let mut members = Vec::new();
    for id in ids.iter().flatten() {
        let (mut c, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5(id.clone()))
            .await
            .unwrap();
        assert_eq!(ack.properties.shared_subscription_available, Some(1));
        let codes = c
            .subscribe(&[("$share/workers/jobs/#", QoS::AtLeastOnce)])
            .await
            .unwrap();
        assert_eq!(codes, [1]);
        members.push(c);
    }
    let mut plain = device(&gw, "share-plain", ProtocolVersion::V5).await;
    plain
        .subscribe(&[("jobs/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut publ = device(
        &gw,
        &ids[0][0].replace("share", "share-pub"),
        ProtocolVersion::V5,
    )
    .await;
    for i in 0..40 {
        publ.publish("jobs/x", format!("{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    let mut all = Vec::new();
    for (m, c) in members.iter_mut().enumerate() {
        let got = drain(c, Duration::from_millis(800)).await;
        assert!(!got.is_empty(), "member {m} got nothing: no round robin");
        all.extend(got);
    }
    all.sort_by_key(|p| p.parse::<u32>().unwrap());
    let expected: Vec<String> = (0..40).map(|i| i.to_string()).collect();
    assert_eq!(all, expected, "each message exactly once to the group");
    assert_eq!(
        drain(&mut plain, Duration::from_millis(500)).await.len(),
        40
    );

    // Members leave; those left get everything; with none left the group is gone.
    let mut rest = members.split_off(2);
    for c in members {
        c.disconnect().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..10 {
        publ.publish("jobs/y", format!("{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    let mut n = 0;
    for c in rest.iter_mut() {
        n += drain(c, Duration::from_millis(800)).await.len();
    }
    assert_eq!(n, 10);
    for c in rest.iter_mut() {
        assert_eq!(
            c.unsubscribe(&["$share/workers/jobs/#"]).await.unwrap(),
            [0]
        );
    }
    publ.publish("jobs/z", "nobody", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    for c in rest.iter_mut() {
        assert!(c.recv(Duration::from_millis(500)).await.unwrap().is_none());
    }
    // Invalid shared filters are refused (No Local on one is refused by the decoder).
    let codes = plain
        .subscribe_with(
            vec![
                opts_sub("$share//x", QoS::AtLeastOnce),
                opts_sub("$share/g", QoS::AtLeastOnce),
            ],
            Properties::default(),
        )
        .await
        .unwrap()
        .codes;
    assert!(codes.iter().all(|c| *c >= 0x80), "{codes:?}");
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloud_command_reaches_a_shared_group_with_members_on_two_shards_once() {
    let cloud = Cloud::start();
    let gw = gateway(
        2,
        &cloud.uplink_toml(None, "receive = [\"cmd/#\"]\nforward = []"),
    );
    let ids = ids_on_shards("cmdw", 2, 1);
    let mut members = Vec::new();
    for id in ids.iter().flatten() {
        let mut c = device(&gw, id, ProtocolVersion::V5).await;
        c.subscribe(&[("$share/ops/cmd/#", QoS::AtLeastOnce)])
            .await
            .unwrap();
        members.push(c);
    }
    // The uplink sessions (shard 0's holds the downlink subscription) must be up first.
    assert!(
        eventually(Duration::from_secs(10), || gw.status_json()["shards"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["uplinks"][0]["state"] == "connected"))
        .await,
        "uplink sessions up"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut operator = cloud.client("operator").await;
    for i in 0..6 {
        operator
            .publish("cmd/reboot", format!("{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    let mut n = 0;
    for c in members.iter_mut() {
        n += drain(c, Duration::from_millis(1000)).await.len();
    }
    assert_eq!(n, 6, "each cloud message once to the group");
    tokio::task::block_in_place(|| gw.shutdown());
}
