//! One access control list for every edge (`[acl]`, ADR 0008), end to end: MQTT 3.1.1 and 5
//! devices, CoAP devices and a PHD agent against a real in-process gateway over real sockets.
//! Each test asserts what a device or a subscriber would notice: the reason codes it gets,
//! what reaches (and does not reach) other devices, and the denial counter.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::coap::{request, CoapDevice};
use common::*;
use sluice::app::RunningGateway;
use sluice_proto::coap::{opt, Code, MsgType};
use sluice_proto::mqtt::{Properties, ProtocolVersion, QoS, Will};
use sluice_testkit::phd::{bcd_time, AgentSpec, PhdAgent, PhdDevice, Reading};
use sluice_testkit::{ConnectOpts, TestClient};

const T: Duration = Duration::from_secs(10);
const QUIET: Duration = Duration::from_millis(400);

/// Default deny; every device may publish and subscribe under `devices/{its id}/`; users
/// `ops-*` may read everything under `devices/`.
const ACL: &str = r#"
[acl]
default = "deny"
[[acl.rule]]
devices = "*"
action = "all"
topics = ["devices/%c/#"]
permission = "allow"
[[acl.rule]]
users = "ops-*"
action = "subscribe"
topics = ["devices/#"]
permission = "allow"
"#;

fn start(extra: &str) -> RunningGateway {
    let hash = sluice::control::admission::hash_password(b"pw").unwrap();
    gateway_mqtt(
        2,
        &format!(
            "allow_anonymous = true\n[[mqtt.users]]\nusername = \"ops-1\"\npassword_hash = \"{hash}\"\n"
        ),
        &format!("{ACL}\n{extra}"),
    )
}

async fn ops(gw: &RunningGateway) -> TestClient {
    let mut opts = ConnectOpts::v5("ops-console");
    opts.username = Some("ops-1".into());
    opts.password = Some(Bytes::from_static(b"pw"));
    let mut c = device_opts(gw, opts).await;
    assert_eq!(
        c.subscribe(&[("devices/#", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1],
        "a users glob grants the subscription"
    );
    c
}

fn denied(gw: &RunningGateway, edge: &str, action: &str) -> f64 {
    metric_sum(
        &gw.metrics_text(),
        &format!("sluice_acl_denied_total{{edge=\"{edge}\",action=\"{action}\"}}"),
    )
}

/// The next publish the client receives, as (topic, payload); `None` when quiet.
async fn next(c: &mut TestClient, wait: Duration) -> Option<(String, String)> {
    c.recv(wait).await.unwrap().map(|p| {
        (
            p.topic.to_string(),
            String::from_utf8_lossy(&p.payload).into_owned(),
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_publishes_outside_the_devices_own_tree_get_0x87_and_reach_nobody() {
    let gw = start("");
    let mut watcher = ops(&gw).await;
    let mut d1 = device(&gw, "d1", ProtocolVersion::V5).await;

    assert_eq!(
        d1.publish("devices/d1/temp", "ok", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        d1.publish("devices/d2/temp", "spoof", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0x87,
        "PUBACK Not authorized"
    );
    assert_eq!(
        d1.publish("devices/d2/temp", "spoof2", QoS::ExactlyOnce, false)
            .await
            .unwrap(),
        0x87,
        "PUBREC Not authorized ends the QoS 2 exchange"
    );
    d1.publish("devices/d2/temp", "spoof0", QoS::AtMostOnce, false)
        .await
        .unwrap();
    assert_eq!(
        d1.publish("devices/d1/temp", "ok2", QoS::ExactlyOnce, false)
            .await
            .unwrap(),
        0,
        "the connection goes on"
    );

    assert_eq!(
        next(&mut watcher, T).await,
        Some(("devices/d1/temp".into(), "ok".into()))
    );
    assert_eq!(
        next(&mut watcher, T).await,
        Some(("devices/d1/temp".into(), "ok2".into()))
    );
    assert_eq!(
        next(&mut watcher, QUIET).await,
        None,
        "no refused message was routed"
    );
    assert_eq!(denied(&gw, "mqtt", "publish"), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_refused_publishes_are_acknowledged_but_dropped() {
    let gw = start("");
    let mut watcher = ops(&gw).await;
    let mut d1 = device(&gw, "d1", ProtocolVersion::V311).await;
    // 3.1.1 has no way to refuse a PUBLISH: an ordinary PUBACK, and the message is gone.
    assert_eq!(
        d1.publish("devices/d9/x", "spoof", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        d1.publish("devices/d1/x", "ok", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    // QoS 2: PUBREC, PUBREL, PUBCOMP as usual, and dropped.
    assert_eq!(
        d1.publish("devices/d9/y", "spoof2", QoS::ExactlyOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        next(&mut watcher, T).await,
        Some(("devices/d1/x".into(), "ok".into()))
    );
    assert_eq!(next(&mut watcher, QUIET).await, None);
    assert_eq!(denied(&gw, "mqtt", "publish"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_are_granted_only_where_an_allow_rule_covers_them() {
    let gw = start("");
    let mut d5 = device(&gw, "d1", ProtocolVersion::V5).await;
    let codes = d5
        .subscribe(&[
            ("devices/d1/+", QoS::AtLeastOnce),
            ("devices/+/temp", QoS::AtLeastOnce),
            ("#", QoS::AtLeastOnce),
            ("devices/d1/#", QoS::AtMostOnce),
            ("$share/g/devices/d1/a", QoS::AtLeastOnce),
        ])
        .await
        .unwrap();
    assert_eq!(codes, vec![1, 0x87, 0x87, 0, 1]);

    let mut d3 = device(&gw, "d3", ProtocolVersion::V311).await;
    let codes = d3
        .subscribe(&[
            ("devices/d3/#", QoS::AtLeastOnce),
            ("devices/d1/#", QoS::AtLeastOnce),
        ])
        .await
        .unwrap();
    assert_eq!(codes, vec![1, 0x80], "3.1.1 has only 0x80 Failure");

    // Default deny: an anonymous device gets nothing the users glob grants.
    let mut anon = device(&gw, "viewer", ProtocolVersion::V5).await;
    assert_eq!(
        anon.subscribe(&[("devices/#", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![0x87]
    );
    // The refused filters deliver nothing: d1's own topic reaches d1, d3's does not.
    let mut pubr = device(&gw, "d3-pub", ProtocolVersion::V5).await;
    assert_eq!(
        pubr.publish("devices/d3-pub/x", "1", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(next(&mut d5, QUIET).await, None);
    assert_eq!(denied(&gw, "mqtt", "subscribe"), 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_on_a_topic_the_device_may_not_publish_is_refused_at_connect() {
    let gw = start("");
    for (version, code) in [(ProtocolVersion::V5, 0x87), (ProtocolVersion::V311, 0x05)] {
        let mut opts = ConnectOpts::new(version, "d1");
        opts.will = Some(Will {
            topic: "devices/d2/status".into(),
            payload: Bytes::from_static(b"gone"),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: Properties::default(),
        });
        let (_c, ack) = TestClient::connect(gw.mqtt_addr, opts).await.unwrap();
        assert_eq!(ack.code, code, "{version:?}");
    }
    let mut ok = ConnectOpts::v5("d1");
    ok.will = Some(Will {
        topic: "devices/d1/status".into(),
        payload: Bytes::from_static(b"gone"),
        qos: QoS::AtLeastOnce,
        retain: false,
        properties: Properties::default(),
    });
    device_opts(&gw, ok).await;
    assert_eq!(denied(&gw, "mqtt", "publish"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coap_publishes_and_observations_outside_the_devices_tree_get_4_03() {
    let gw = start("");
    let mut watcher = ops(&gw).await;
    let mut dev = CoapDevice::new(gw.coap_addr.expect("coap")).await;

    let put = |path: &str| request(MsgType::Con, Code::PUT, path, &["c=c1"], b"21.5");
    let r = dev.exchange(put("ps/devices/c1/temp"), T).await;
    assert_eq!(r.code, Code::CHANGED);
    let r = dev.exchange(put("ps/devices/c2/temp"), T).await;
    assert_eq!(r.code, Code::FORBIDDEN);
    assert_eq!(
        next(&mut watcher, T).await,
        Some(("devices/c1/temp".into(), "21.5".into()))
    );
    assert_eq!(next(&mut watcher, QUIET).await, None);

    let observe = |path: &str| {
        let mut m = request(MsgType::Con, Code::GET, path, &["c=c1"], b"");
        m.add_uint_option(opt::OBSERVE, 0);
        m
    };
    let r = dev.exchange(observe("ps/devices/+/temp"), T).await;
    assert_eq!(r.code, Code::FORBIDDEN, "an observation is a subscription");
    let r = dev.exchange(observe("ps/devices/c1/+"), T).await;
    assert_eq!(r.code, Code::CONTENT);
    assert_eq!(denied(&gw, "coap", "publish"), 1.0);
    assert_eq!(denied(&gw, "coap", "subscribe"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phd_measurement_on_a_denied_topic_is_not_published() {
    let system_id = [0x00, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x01];
    let phd = "[phd]\nlisten = \"127.0.0.1:0\"\nresponse_timeout = \"2s\"\ntopic = \"devices/{system_id}/{metric}\"\n";
    // Agents may publish their SpO2, not their pulse.
    let rules = "[[acl.rule]]\ndevices = \"*\"\naction = \"publish\"\ntopics = [\"devices/+/pulse\"]\npermission = \"deny\"\n";
    let hash = sluice::control::admission::hash_password(b"pw").unwrap();
    let gw = gateway_mqtt(
        1,
        &format!("[[mqtt.users]]\nusername = \"ops-1\"\npassword_hash = \"{hash}\"\n"),
        &format!("{phd}\n[acl]\ndefault = \"allow\"\n{rules}"),
    );
    let mut watcher = ops(&gw).await;
    let mut agent = PhdAgent::connect(
        gw.phd_addr.expect("phd"),
        AgentSpec {
            system_id,
            device: PhdDevice::PulseOximeter,
            config_id: 0x0190,
            confirmed: true,
            antidote_quirks: false,
        },
    )
    .await
    .unwrap();
    agent.associate().await.unwrap();
    let answer = agent
        .report(
            &Reading::Oximeter {
                spo2: (98, 0),
                pulse: (72, 0),
            },
            bcd_time(2024, 1, 2, 3, 4, 5, 0),
            T,
        )
        .await;
    // Refused data is refused to the agent in its protocol: ROER access-denied (2), never a
    // confirmation as if all of it were safe.
    let error = answer.expect_err("a report with a refused measurement is not confirmed");
    assert!(
        error.to_string().contains("ROER error-value Some(2)"),
        "{error}"
    );
    let (topic, _) = next(&mut watcher, T).await.expect("spo2");
    assert_eq!(topic, "devices/001b2c3d4e5f6001/spo2");
    assert_eq!(next(&mut watcher, QUIET).await, None, "no pulse");
    assert_eq!(denied(&gw, "phd", "publish"), 1.0);
}
