//! Cloud → device (downlink) end to end: a real gateway, a real cloud Mosquitto over TLS 1.3,
//! local MQTT subscribers. The gateway keeps one persistent downlink subscription per uplink
//! (shard 0's normal session), delivers each cloud command to the local subscribers of every
//! shard, and acknowledges it to the cloud only after that delivery was accepted.

mod common;

use std::time::Duration;

use common::{device, device_opts, eventually, gateway, ids_on_shards, metric_sum, Cloud, Gate};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, TestClient};

const RECEIVE: &str = "receive = [\"cmd/#\"]";

/// Publishes probes from the cloud until every local client got one: the downlink
/// subscription (and, for subscribers on other shards, the cross-shard path) is in place.
async fn wait_for_downlink(app: &mut TestClient, locals: &mut [&mut TestClient]) {
    let mut got = vec![false; locals.len()];
    for attempt in 0..60 {
        app.publish(
            "cmd/probe",
            format!("probe-{attempt}").into_bytes(),
            QoS::AtLeastOnce,
            false,
        )
        .await
        .expect("cloud accepts the probe");
        for (i, local) in locals.iter_mut().enumerate() {
            while let Ok(Some(p)) = local.recv(Duration::from_millis(200)).await {
                got[i] |= p.topic == "cmd/probe";
            }
        }
        if got.iter().all(|g| *g) {
            return;
        }
    }
    panic!("the downlink never reached every local subscriber: {got:?}");
}

/// Payloads of `topic` received within `idle` of each other.
async fn received_on(client: &mut TestClient, topic: &str, idle: Duration) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while let Ok(Some(p)) = client.recv(idle).await {
        if p.topic == topic {
            out.push(p.payload.to_vec());
        }
    }
    out
}

fn downlink_messages(gw: &sluice::app::RunningGateway) -> f64 {
    metric_sum(&gw.metrics_text(), "sluice_uplink_downlink_messages_total")
}

async fn command_sent_while_cut_off_arrives_after_reconnect(protocol: &str) {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    let extra = format!("{RECEIVE}\nprotocol = \"{protocol}\"");
    let gw = gateway(2, &cloud.uplink_toml(Some(gate.addr), &extra));
    let mut local = device(&gw, "local-app", ProtocolVersion::V5).await;
    assert_eq!(
        local
            .subscribe(&[("cmd/#", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1]
    );
    let mut app = cloud.client("cloud-app").await;
    wait_for_downlink(&mut app, &mut [&mut local]).await;

    // The fault: the gateway is cut off from a broker that stays up.
    gate.set_open(false);
    let down = "sluice_uplink_state{shard=\"0\",uplink=\"cloud\",lane=\"normal\",state=\"disconnected\"} 1";
    assert!(
        eventually(Duration::from_secs(10), || gw.metrics_text().contains(down)).await,
        "the uplink notices it was cut off"
    );
    // Let the broker see the session end too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.publish("cmd/while-away", &b"reboot"[..], QoS::AtLeastOnce, false)
        .await
        .expect("the cloud accepts the command");
    gate.set_open(true);

    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while got.is_empty() && tokio::time::Instant::now() < deadline {
        got = received_on(&mut local, "cmd/while-away", Duration::from_millis(500)).await;
    }
    // Any duplicate would follow at once.
    got.extend(received_on(&mut local, "cmd/while-away", Duration::from_secs(1)).await);
    assert_eq!(
        got,
        vec![b"reboot".to_vec()],
        "the command published during the outage reaches the local subscriber, once"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

/// Before: every cloud session started clean, so a command published while the gateway was
/// reconnecting was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_published_while_the_gateway_is_cut_off_reaches_the_local_subscriber_after_reconnect(
) {
    command_sent_while_cut_off_arrives_after_reconnect("5").await;
}

/// The same over an MQTT 3.1.1 uplink (clean session = 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mqtt_311_a_command_published_while_cut_off_still_arrives_after_reconnect() {
    command_sent_while_cut_off_arrives_after_reconnect("3.1.1").await;
}

/// Before: every shard subscribed to `receive`, so each command crossed the WAN once per
/// shard (two downlink messages for one command with two shards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_shards_one_cloud_command_crosses_the_wan_once_and_reaches_each_local_subscriber_once(
) {
    let cloud = Cloud::start();
    let gw = gateway(2, &cloud.uplink_toml(None, RECEIVE));
    let ids = ids_on_shards("sub", 2, 1);
    let mut on0 = device(&gw, &ids[0][0], ProtocolVersion::V311).await;
    let mut on1 = device(&gw, &ids[1][0], ProtocolVersion::V5).await;
    for c in [&mut on0, &mut on1] {
        assert_eq!(
            c.subscribe(&[("cmd/#", QoS::AtLeastOnce)]).await.unwrap(),
            vec![1]
        );
    }
    let mut app = cloud.client("cloud-app").await;
    wait_for_downlink(&mut app, &mut [&mut on0, &mut on1]).await;
    // Probes may still be arriving; settle, then count from here.
    let _ = received_on(&mut on0, "-", Duration::from_millis(300)).await;
    let _ = received_on(&mut on1, "-", Duration::from_millis(300)).await;
    let before = downlink_messages(&gw);

    app.publish("cmd/all/reboot", &b"now"[..], QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let got0 = received_on(&mut on0, "cmd/all/reboot", Duration::from_secs(3)).await;
    let got1 = received_on(&mut on1, "cmd/all/reboot", Duration::from_secs(3)).await;
    assert_eq!(
        got0,
        vec![b"now".to_vec()],
        "shard 0's subscriber: exactly once"
    );
    assert_eq!(
        got1,
        vec![b"now".to_vec()],
        "shard 1's subscriber: exactly once"
    );
    assert_eq!(
        downlink_messages(&gw) - before,
        1.0,
        "the broker delivered the command to the gateway once, not once per shard"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

/// The cloud's PUBACK follows local delivery: a QoS 1 command for a persistent local session
/// whose device is offline is kept in that session (on another shard than the downlink
/// session's) and delivered when the device comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos1_command_for_an_offline_persistent_subscriber_is_kept_and_delivered_when_it_returns()
{
    let cloud = Cloud::start();
    let gw = gateway(2, &cloud.uplink_toml(None, RECEIVE));
    let ids = ids_on_shards("keeper", 2, 1);
    let id = ids[1][0].clone();
    let persistent = || ConnectOpts {
        clean_start: false,
        ..ConnectOpts::v311(id.clone())
    };
    let mut keeper = device_opts(&gw, persistent()).await;
    assert_eq!(
        keeper
            .subscribe(&[("cmd/#", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1]
    );
    let mut app = cloud.client("cloud-app").await;
    wait_for_downlink(&mut app, &mut [&mut keeper]).await;
    let _ = received_on(&mut keeper, "-", Duration::from_millis(300)).await;
    keeper.disconnect().await.unwrap();

    let before = downlink_messages(&gw);
    app.publish("cmd/keeper/config", &b"v2"[..], QoS::AtLeastOnce, false)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || downlink_messages(&gw) > before).await,
        "the gateway received the command"
    );
    let acked = "sluice_uplink_downlink_acked_total{shard=\"0\",uplink=\"cloud\",lane=\"normal\"}";
    assert!(
        eventually(Duration::from_secs(5), || metric_sum(
            &gw.metrics_text(),
            acked
        ) >= 1.0)
        .await,
        "the command was acknowledged to the cloud after local delivery was accepted"
    );

    let mut back = device_opts(&gw, persistent()).await;
    let got = received_on(&mut back, "cmd/keeper/config", Duration::from_secs(5)).await;
    assert_eq!(got, vec![b"v2".to_vec()]);
    tokio::task::block_in_place(|| gw.shutdown());
}

/// A broker restarted without persistence has forgotten the downlink session: the CONNACK
/// says so (session present = 0) and the gateway subscribes again. Over 3.1.1, where a kept
/// session is not re-subscribed, this is the only way back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_cloud_broker_lost_the_session_the_gateway_subscribes_again() {
    let mut cloud = Cloud::start();
    let gw = gateway(
        2,
        &cloud.uplink_toml(None, &format!("{RECEIVE}\nprotocol = \"3.1.1\"")),
    );
    let mut local = device(&gw, "local-app", ProtocolVersion::V311).await;
    local
        .subscribe(&[("cmd/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut app = cloud.client("cloud-app").await;
    wait_for_downlink(&mut app, &mut [&mut local]).await;
    drop(app);

    tokio::task::block_in_place(|| cloud.broker.restart()).expect("broker restarts");
    let mut app = cloud.client("cloud-app-2").await;
    wait_for_downlink(&mut app, &mut [&mut local]).await;
    tokio::task::block_in_place(|| gw.shutdown());
}
