//! End-to-end tests of the device-facing MQTT session: MQTT 5 features (message expiry,
//! subscription options and identifiers, request/response properties, server topic aliases,
//! Server Keep Alive, flow control, will delay, shared subscriptions) and the session defects
//! fixed with them (keep-alive under back-pressure, QoS 2 duplicates across reconnects, wills
//! at the end of a session). Real sockets, the gateway in-process, a real cloud Mosquitto where
//! the cloud matters.

mod common;

use std::time::Duration;

use bytes::Bytes;
use bytestring::ByteString;
use common::*;
use sluice_proto::mqtt::{
    Packet, Properties, ProtocolVersion, PubResponse, Publish, QoS, SubscribeFilter,
    SubscriptionOptions, Will,
};
use sluice_testkit::{ConnectOpts, TestClient};

fn will(topic: &str, delay_s: Option<u32>) -> Will {
    let mut properties = Properties::default();
    properties.will_delay_interval = delay_s;
    Will {
        topic: topic.into(),
        payload: Bytes::from_static(b"gone"),
        qos: QoS::AtLeastOnce,
        retain: false,
        properties,
    }
}

fn opts_sub(filter: &str, qos: QoS) -> SubscribeFilter {
    SubscribeFilter {
        filter: filter.into(),
        options: SubscriptionOptions {
            qos,
            no_local: false,
            retain_as_published: false,
            retain_handling: 0,
        },
    }
}

fn publish(topic: &str, payload: &str, qos: QoS, id: Option<u16>, props: Properties) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos,
        retain: false,
        topic: topic.into(),
        packet_id: id,
        properties: (!props.is_empty()).then(|| Box::new(props)),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
    })
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
