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
