//! End-to-end tests of the device-facing MQTT session, part 1 (part 2, gateway_mqtt5_flow.rs:
//! Server Keep Alive, flow control, server topic aliases, shared subscriptions): MQTT 5
//! features (message expiry, subscription options and identifiers, request/response
//! properties, will delay) and the session defects fixed with them (keep-alive under
//! back-pressure, QoS 2 duplicates across reconnects, wills at the end of a session). Real
//! sockets, the gateway in-process, a real cloud Mosquitto where the cloud matters.

mod common;

use std::time::Duration;

use bytes::Bytes;
use bytestring::ByteString;
use common::packets::{opts_sub, publish};
use common::*;
use sluice_proto::mqtt::{
    Packet, Properties, ProtocolVersion, PubResponse, QoS, SubscribeFilter, SubscriptionOptions,
    Will,
};
use sluice_testkit::{ConnectOpts, TestClient};

fn will(topic: &str, delay_s: Option<u32>) -> Will {
    let properties = Properties {
        will_delay_interval: delay_s,
        ..Properties::default()
    };
    Will {
        topic: topic.into(),
        payload: Bytes::from_static(b"gone"),
        qos: QoS::AtLeastOnce,
        retain: false,
        properties,
    }
}

fn metric(gw: &sluice::app::RunningGateway, prefix: &str) -> f64 {
    metric_sum(&gw.metrics_text(), prefix)
}

// ---------------------------------------------------------------------------------------------
// Defect 3: a device the gateway stopped reading is not timed out for silence.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_pressured_device_is_not_timed_out_and_its_will_does_not_fire() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    let gw = gateway_mqtt(
        1,
        "receive_maximum = 4",
        &cloud.uplink_toml(Some(gate.addr), ""),
    );
    let mut watcher = device(&gw, "watcher", ProtocolVersion::V311).await;
    watcher
        .subscribe(&[("wills/#", QoS::AtLeastOnce)])
        .await
        .unwrap();

    let mut opts = ConnectOpts::v311("pressed");
    opts.keep_alive = 2;
    opts.will = Some(will("wills/pressed", None));
    let mut dev = device_opts(&gw, opts).await;
    let mut ids = Vec::new();
    for i in 0..6 {
        let id = dev
            .publish_no_wait("pressed/data", format!("{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap()
            .unwrap();
        ids.push(id);
    }
    // A healthy idle device beside it is still timed out (keep-alive 1 s, nothing sent).
    let mut idle_opts = ConnectOpts::v311("idle");
    idle_opts.keep_alive = 1;
    let mut idle = device_opts(&gw, idle_opts).await;

    // 3x the keep-alive with the cloud away: the pressed device sends nothing at all.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        idle.expect_closed(Duration::from_secs(3)).await,
        "an idle, unpaused device must still be timed out"
    );
    assert!(
        watcher
            .recv(Duration::from_millis(200))
            .await
            .unwrap()
            .is_none(),
        "the back-pressured device's will fired"
    );
    assert_eq!(
        metric(
            &gw,
            "sluice_mqtt_connections_closed_total{shard=\"0\",reason=\"keep_alive_timeout\"}"
        ),
        1.0,
        "only the idle device may have been timed out"
    );

    gate.set_open(true);
    dev.set_ack_timeout(Duration::from_secs(20));
    for id in ids {
        assert_eq!(dev.wait_ack(id).await.unwrap(), 0);
    }
    // Still connected and served after the pause.
    dev.ping().await.expect("still connected after the pause");
    assert!(watcher
        .recv(Duration::from_millis(200))
        .await
        .unwrap()
        .is_none());
    tokio::task::block_in_place(|| gw.shutdown());
}

// ---------------------------------------------------------------------------------------------
// Defect 8: QoS 2 duplicates across a reconnect; wills at the end of a session.

/// Whether raw bytes from the gateway hold a PUBREC (fixed header 0x50, remaining length 2
/// for 3.1.1 / 2..4 for MQTT 5) for `id`.
fn has_pubrec(bytes: &[u8], id: u16) -> bool {
    bytes
        .windows(4)
        .any(|w| w[0] == 0x50 && (2..=4).contains(&w[1]) && u16::from_be_bytes([w[2], w[3]]) == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_message_resent_after_a_reconnect_reaches_its_subscriber_once() {
    let gw = gateway(2, "");
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let topic = format!("q2/{version:?}");
        let mut sub = device(&gw, &format!("q2-sub-{version:?}"), ProtocolVersion::V5).await;
        sub.subscribe(&[(&topic, QoS::ExactlyOnce)]).await.unwrap();

        let mut opts = ConnectOpts::new(version, format!("q2-pub-{version:?}"));
        opts.clean_start = false;
        if version == ProtocolVersion::V5 {
            opts.properties.session_expiry_interval = Some(300);
        }
        let mut dev = device_opts(&gw, opts.clone()).await;
        let packet = publish(
            &topic,
            "once",
            QoS::ExactlyOnce,
            Some(7),
            Properties::default(),
        );
        dev.send_packet(&packet).await.unwrap();
        // Read raw bytes, so the test client does not answer the PUBREC with a PUBREL.
        let (bytes, closed) = dev.read_raw_until_closed(Duration::from_millis(700)).await;
        assert!(
            !closed && has_pubrec(&bytes, 7),
            "{version:?}: PUBREC expected: {bytes:?}"
        );
        drop(dev); // gone before PUBREL

        let (mut dev, ack) = TestClient::connect(gw.mqtt_addr, opts).await.unwrap();
        assert!(ack.session_present, "{version:?}: session kept");
        let Packet::Publish(mut again) = packet else {
            unreachable!()
        };
        again.dup = true;
        dev.send_packet(&Packet::Publish(again)).await.unwrap();
        // The PUBREC comes again; the test client sends PUBREL and the gateway completes.
        let mut completed = false;
        while let Some(p) = dev.recv_packet(Duration::from_secs(3)).await.unwrap() {
            if let Packet::PubComp(PubResponse { packet_id: 7, .. }) = p {
                completed = true;
                break;
            }
        }
        assert!(completed, "{version:?}: PUBCOMP after the resend");

        let first = sub.recv(Duration::from_secs(3)).await.unwrap();
        assert_eq!(first.map(|p| p.payload), Some(Bytes::from_static(b"once")));
        assert!(
            sub.recv(Duration::from_millis(800))
                .await
                .unwrap()
                .is_none(),
            "{version:?}: the resent QoS 2 message was delivered twice"
        );
        dev.disconnect().await.unwrap();
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_will_is_published_when_a_clean_start_takeover_ends_the_session() {
    let gw = gateway(2, "");
    let mut watcher = device(&gw, "will-watcher", ProtocolVersion::V5).await;
    watcher
        .subscribe(&[("wills/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let opts = |id: &str, clean: bool| {
        let mut o = ConnectOpts::v5(id);
        o.clean_start = clean;
        o.properties.session_expiry_interval = Some(300);
        o.will = Some(will(&format!("wills/{id}"), Some(30)));
        o
    };

    // Connected device taken over by a clean start: will at the takeover.
    let _first = device_opts(&gw, opts("online", true)).await;
    let _second = device_opts(&gw, opts("online", true)).await;
    let got = watcher.recv(Duration::from_secs(5)).await.unwrap();
    assert_eq!(got.map(|p| p.topic), Some(ByteString::from("wills/online")));

    // Device gone (will pending for 30 s), then a clean start: will at the takeover.
    let gone = device_opts(&gw, opts("offline", true)).await;
    drop(gone);
    assert!(
        watcher
            .recv(Duration::from_millis(700))
            .await
            .unwrap()
            .is_none(),
        "the will must wait for its delay"
    );
    let _back = device_opts(&gw, opts("offline", true)).await;
    let got = watcher.recv(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        got.map(|p| p.topic),
        Some(ByteString::from("wills/offline"))
    );

    // Device gone, then back to the same session within the delay: no will at all.
    let gone = device_opts(&gw, opts("resumer", true)).await;
    drop(gone);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _back = device_opts(&gw, opts("resumer", false)).await;
    assert!(
        watcher
            .recv(Duration::from_secs(1))
            .await
            .unwrap()
            .is_none(),
        "a reconnect within the delay cancels the will"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_is_published_at_the_earlier_of_its_delay_and_the_session_expiry() {
    let gw = gateway(1, "");
    let mut watcher = device(&gw, "will-watcher", ProtocolVersion::V5).await;
    watcher
        .subscribe(&[("wills/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    // (will delay, session expiry, earliest and latest acceptable arrival)
    let cases = [
        (30, 2, Duration::from_millis(1500), Duration::from_secs(5)),
        (2, 30, Duration::from_millis(1500), Duration::from_secs(5)),
        (30, 0, Duration::ZERO, Duration::from_secs(2)),
    ];
    for (i, (delay, expiry, earliest, latest)) in cases.into_iter().enumerate() {
        let id = format!("dw-{i}");
        let mut o = ConnectOpts::v5(id.clone());
        o.properties.session_expiry_interval = Some(expiry);
        o.will = Some(will(&format!("wills/{id}"), Some(delay)));
        let dev = device_opts(&gw, o).await;
        let start = tokio::time::Instant::now();
        drop(dev);
        let got = watcher.recv(latest + Duration::from_secs(2)).await.unwrap();
        let took = start.elapsed();
        assert_eq!(
            got.map(|p| p.topic),
            Some(ByteString::from(format!("wills/{id}"))),
            "delay {delay} s, expiry {expiry} s: no will"
        );
        assert!(
            took >= earliest && took <= latest,
            "delay {delay} s, expiry {expiry} s: will after {took:?}"
        );
    }
    tokio::task::block_in_place(|| gw.shutdown());
}

// ---------------------------------------------------------------------------------------------
// MQTT 5: message expiry, subscription options, properties, subscription identifiers.

fn expiring(secs: u32) -> Properties {
    Properties {
        message_expiry_interval: Some(secs),
        ..Properties::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_messages_expire_and_the_rest_carry_their_remaining_lifetime() {
    let gw = gateway(1, "");
    let mut opts = ConnectOpts::v5("expiry-sub");
    opts.clean_start = false;
    opts.properties.session_expiry_interval = Some(300);
    let mut sub = device_opts(&gw, opts.clone()).await;
    sub.subscribe(&[("exp/#", QoS::ExactlyOnce)]).await.unwrap();
    sub.disconnect().await.unwrap();

    let mut publ = device(&gw, "expiry-pub", ProtocolVersion::V5).await;
    let sends = [
        ("short-1", QoS::AtLeastOnce, Some(1)),
        ("short-2", QoS::ExactlyOnce, Some(1)),
        ("long-1", QoS::AtLeastOnce, Some(20)),
        ("long-2", QoS::ExactlyOnce, Some(20)),
        ("forever", QoS::AtLeastOnce, None),
    ];
    for (i, (payload, qos, expiry)) in sends.iter().enumerate() {
        let props = expiry.map(expiring).unwrap_or_default();
        let id = 100 + i as u16;
        publ.send_packet(&publish("exp/x", payload, *qos, Some(id), props))
            .await
            .unwrap();
        publ.wait_ack(id).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let (mut back, ack) = TestClient::connect(gw.mqtt_addr, opts).await.unwrap();
    assert!(ack.session_present);
    let mut got = Vec::new();
    while let Some(p) = back.recv(Duration::from_secs(2)).await.unwrap() {
        let left = p
            .properties
            .as_ref()
            .and_then(|p| p.message_expiry_interval);
        got.push((String::from_utf8_lossy(&p.payload).into_owned(), left));
    }
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["long-1", "long-2", "forever"], "{got:?}");
    for (name, left) in &got[..2] {
        let left = left.unwrap_or_else(|| panic!("{name}: no Message Expiry Interval"));
        assert!(
            (1..=18).contains(&left),
            "{name}: {left} s left after 2.5 s of 20"
        );
    }
    assert_eq!(got[2].1, None, "a message without expiry got one");
    assert_eq!(
        metric(
            &gw,
            "sluice_mqtt_dropped_total{shard=\"0\",reason=\"expired\"}"
        ),
        2.0
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

fn with_options(filter: &str, f: impl FnOnce(&mut SubscriptionOptions)) -> SubscribeFilter {
    let mut s = opts_sub(filter, QoS::ExactlyOnce);
    f(&mut s.options);
    s
}

/// The retain flags of everything that arrives until a quiet 800 ms.
async fn flags(c: &mut TestClient) -> Vec<bool> {
    let mut v = Vec::new();
    while let Some(p) = c.recv(Duration::from_millis(800)).await.unwrap() {
        v.push(p.retain);
    }
    v
}

/// Subscribe to `opt/rh/+` with this Retain Handling; the QoS of each retained message sent.
async fn count(c: &mut TestClient, handling: u8) -> Vec<u8> {
    c.subscribe_with(
        vec![with_options("opt/rh/+", |o| o.retain_handling = handling)],
        Properties::default(),
    )
    .await
    .unwrap();
    let mut qos = Vec::new();
    while let Some(p) = c.recv(Duration::from_millis(800)).await.unwrap() {
        assert!(p.retain);
        qos.push(p.qos as u8);
    }
    qos.sort();
    qos
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_local_retain_as_published_and_retain_handling_are_honoured() {
    let gw = gateway(2, "");
    // No Local: the publisher does not get its own message; another subscriber does.
    let mut a = device(&gw, "opt-a", ProtocolVersion::V5).await;
    let mut b = device(&gw, "opt-b", ProtocolVersion::V5).await;
    for c in [&mut a, &mut b] {
        c.subscribe_with(
            vec![with_options("opt/nl", |o| o.no_local = true)],
            Properties::default(),
        )
        .await
        .unwrap();
    }
    a.publish("opt/nl", "mine", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    assert!(b.recv(Duration::from_secs(3)).await.unwrap().is_some());
    assert!(
        a.recv(Duration::from_millis(500)).await.unwrap().is_none(),
        "No Local ignored"
    );

    // Retain As Published: the retain flag is kept only for subscriptions that ask for it.
    let mut rap = device(&gw, "opt-rap", ProtocolVersion::V5).await;
    rap.subscribe_with(
        vec![with_options("opt/rap", |o| o.retain_as_published = true)],
        Properties::default(),
    )
    .await
    .unwrap();
    let mut plain = device(&gw, "opt-plain", ProtocolVersion::V5).await;
    plain
        .subscribe(&[("opt/rap", QoS::AtLeastOnce)])
        .await
        .unwrap();
    a.publish("opt/rap", "not retained", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    a.publish("opt/rap", "retained", QoS::AtLeastOnce, true)
        .await
        .unwrap();
    assert_eq!(flags(&mut rap).await, [false, true]);
    assert_eq!(flags(&mut plain).await, [false, false]);

    // Retain Handling: 0 = every time, 1 = only for a new subscription, 2 = never.
    for (i, qos) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
        .into_iter()
        .enumerate()
    {
        a.publish(&format!("opt/rh/{i}"), "r", qos, true)
            .await
            .unwrap();
    }
    let mut rh = device(&gw, "opt-rh", ProtocolVersion::V5).await;
    assert_eq!(count(&mut rh, 1).await, [0, 1, 2], "new subscription");
    assert_eq!(count(&mut rh, 1).await, [0u8; 0], "existing subscription");
    assert_eq!(count(&mut rh, 0).await, [0, 1, 2]);
    assert_eq!(count(&mut rh, 0).await, [0, 1, 2]);
    let mut never = device(&gw, "opt-never", ProtocolVersion::V5).await;
    assert_eq!(count(&mut never, 2).await, [0u8; 0]);
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_response_properties_reach_the_subscriber_unchanged() {
    let gw = gateway(2, "");
    // The two ends hash to different shards, so both local and cross-shard paths carry them.
    let ids = ids_on_shards("rr", 2, 1);
    let mut requester = device(&gw, &ids[0][0], ProtocolVersion::V5).await;
    let mut responder = device(&gw, &ids[1][0], ProtocolVersion::V5).await;
    responder
        .subscribe(&[("svc/request", QoS::AtLeastOnce)])
        .await
        .unwrap();
    requester
        .subscribe(&[("svc/reply/me", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let props = Properties {
        response_topic: Some("svc/reply/me".into()),
        correlation_data: Some(Bytes::from_static(b"\x00\x01corr")),
        content_type: Some("text/plain".into()),
        payload_format_indicator: Some(1),
        user_properties: vec![("k".into(), "v".into()), ("k".into(), "w".into())],
        ..Properties::default()
    };
    requester
        .send_packet(&publish(
            "svc/request",
            "ask",
            QoS::AtLeastOnce,
            Some(1),
            props.clone(),
        ))
        .await
        .unwrap();
    requester.wait_ack(1).await.unwrap();
    let req = responder
        .recv(Duration::from_secs(3))
        .await
        .unwrap()
        .expect("request");
    let got = *req.properties.expect("properties forwarded");
    assert_eq!(got, props);
    // The responder answers on the Response Topic with the Correlation Data.
    let answer = Properties {
        correlation_data: got.correlation_data.clone(),
        ..Properties::default()
    };
    let topic = got.response_topic.clone().unwrap();
    responder
        .send_packet(&publish(
            &topic,
            "answer",
            QoS::AtLeastOnce,
            Some(2),
            answer,
        ))
        .await
        .unwrap();
    responder.wait_ack(2).await.unwrap();
    let resp = requester
        .recv(Duration::from_secs(3))
        .await
        .unwrap()
        .expect("response");
    assert_eq!(resp.payload, &b"answer"[..]);
    assert_eq!(
        resp.properties.and_then(|p| p.correlation_data),
        Some(Bytes::from_static(b"\x00\x01corr"))
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_matching_subscription_identifier_is_sent_with_the_message() {
    let gw = gateway(2, "");
    let mut dev = device(&gw, "subid", ProtocolVersion::V5).await;
    let (ack, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("subid-probe"))
        .await
        .map(|(c, a)| (a, c))
        .unwrap();
    assert_eq!(ack.properties.subscription_identifier_available, Some(1));
    for (filter, id) in [("sid/a", 2u32), ("sid/#", 3), ("sid/none/#", 0)] {
        let mut props = Properties::default();
        if id != 0 {
            props.subscription_identifiers = vec![id];
        }
        dev.subscribe_with(vec![opts_sub(filter, QoS::AtLeastOnce)], props)
            .await
            .unwrap();
    }
    let mut other = device(&gw, "subid-pub", ProtocolVersion::V5).await;
    other
        .publish("sid/a", "x", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    other
        .publish("sid/none/x", "y", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let first = dev
        .recv(Duration::from_secs(3))
        .await
        .unwrap()
        .expect("message");
    let mut ids = first
        .properties
        .map(|p| p.subscription_identifiers)
        .unwrap_or_default();
    ids.sort();
    assert_eq!(ids, [2, 3]);
    let second = dev
        .recv(Duration::from_secs(3))
        .await
        .unwrap()
        .expect("message");
    assert_eq!(
        second
            .properties
            .map(|p| p.subscription_identifiers)
            .unwrap_or_default(),
        [3],
        "only sid/# (id 3) and sid/none/# (no id) match"
    );
    // A retained message sent on subscribe carries the new subscription's identifier.
    other
        .publish("sid/kept", "r", QoS::AtLeastOnce, true)
        .await
        .unwrap();
    let props = Properties {
        subscription_identifiers: vec![77],
        ..Properties::default()
    };
    let mut late = device(&gw, "subid-late", ProtocolVersion::V5).await;
    late.subscribe_with(vec![opts_sub("sid/kept", QoS::AtLeastOnce)], props)
        .await
        .unwrap();
    let kept = late
        .recv(Duration::from_secs(3))
        .await
        .unwrap()
        .expect("retained");
    assert_eq!(
        kept.properties
            .map(|p| p.subscription_identifiers)
            .unwrap_or_default(),
        [77]
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_subscriptions_deliver_once_per_session_at_the_highest_qos() {
    let gw = gateway(1, "");
    let mut devs = Vec::new();
    for d in 0..20 {
        let mut c = device(&gw, &format!("ov-{d}"), ProtocolVersion::V5).await;
        // Many overlapping filters per session; the highest QoS among them is d % 3.
        let mut filters = vec![
            opts_sub("ov/#", QoS::AtMostOnce),
            opts_sub("ov/+/+/+", QoS::AtMostOnce),
            opts_sub("+/a/#", QoS::AtMostOnce),
            opts_sub("ov/a/b/c", QoS::AtMostOnce),
            opts_sub("#", QoS::AtMostOnce),
        ];
        filters[d % 5].options.qos = QoS::from_u8((d % 3) as u8).unwrap();
        c.subscribe_with(filters, Properties::default())
            .await
            .unwrap();
        devs.push(c);
    }
    let mut publ = device(&gw, "ov-pub", ProtocolVersion::V5).await;
    publ.publish("ov/a/b/c", "fan", QoS::ExactlyOnce, false)
        .await
        .unwrap();
    for (d, c) in devs.iter_mut().enumerate() {
        let got = c
            .recv(Duration::from_secs(3))
            .await
            .unwrap()
            .expect("delivered");
        assert_eq!(got.qos as usize, d % 3, "device {d}: QoS");
        assert!(
            c.recv(Duration::from_millis(100)).await.unwrap().is_none(),
            "device {d}: delivered twice"
        );
    }
    tokio::task::block_in_place(|| gw.shutdown());
}
