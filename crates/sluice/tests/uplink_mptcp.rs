//! MPTCP through the running gateway on loopback (MPTCP works on `lo`; the multi-link cases are
//! in `multipath_netns.rs`): an `mptcp = true` uplink to a Mosquitto started under
//! `mptcpize run` shows MPTCP active in status, to a plain Mosquitto it falls back (reason
//! "peer", counted) and still delivers; `[mqtt] mptcp = true` makes the device listener an
//! MPTCP one that MPTCP and plain TCP devices both use.
//!
//! Skipped with a printed reason when the kernel has no MPTCP or `mptcpize` is missing.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{device, gateway, gateway_mqtt, Cloud};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{Mosquitto, TestPki};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn mptcp_or_skip() -> bool {
    match socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::MPTCP),
    ) {
        Ok(_) => true,
        Err(e) => {
            println!("skipped: this kernel has no MPTCP ({e})");
            false
        }
    }
}

fn have(tool: &str) -> bool {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        println!("skipped: {tool} is not installed");
    }
    ok
}

async fn get(admin: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out.split("\r\n\r\n").nth(1).unwrap_or("").to_string()
}

async fn lane_mptcp(admin: std::net::SocketAddr) -> serde_json::Value {
    let st: serde_json::Value = serde_json::from_str(&get(admin, "/api/v1/status").await).unwrap();
    st["shards"][0]["uplinks"][0]["lanes"]["normal"]["mptcp"].clone()
}

/// One message from a device reaches the cloud subscriber.
async fn one_message_arrives(cloud: &Cloud, gw: &sluice::app::RunningGateway) {
    let mut sub = cloud.subscriber("sub", "m/#").await;
    let mut d = device(gw, "dev1", ProtocolVersion::V5).await;
    assert_eq!(
        d.publish("m/1", "42", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    let p = sub
        .recv(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("delivered");
    assert_eq!(&p.payload[..], b"42");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mptcp_uplink_to_an_mptcp_broker_is_active_in_status() {
    if !mptcp_or_skip() || !have("mptcpize") {
        return;
    }
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .plain_listener(false)
        .launcher(["mptcpize", "run"])
        .start()
        .expect("mosquitto under mptcpize");
    let cloud = Cloud { pki, broker };
    let gw = gateway(1, &cloud.uplink_toml(None, "mptcp = true"));
    let admin = gw.admin_addr.unwrap();
    one_message_arrives(&cloud, &gw).await;
    let m = lane_mptcp(admin).await;
    println!("{m}");
    assert_eq!(m["asked"], true, "{m}");
    assert_eq!(m["active"], true, "{m}");
    assert!(m["fallback"].is_null(), "{m}");
    assert!(!m["subflows"].as_array().unwrap().is_empty(), "{m}");
    let metrics = get(admin, "/metrics").await;
    assert!(
        metrics
            .contains("sluice_uplink_mptcp_active{shard=\"0\",uplink=\"cloud\",lane=\"normal\"} 1"),
        "{metrics}"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mptcp_uplink_to_a_plain_broker_falls_back_counts_it_and_still_delivers() {
    if !mptcp_or_skip() {
        return;
    }
    let cloud = Cloud::start();
    let gw = gateway(1, &cloud.uplink_toml(None, "mptcp = true"));
    let admin = gw.admin_addr.unwrap();
    one_message_arrives(&cloud, &gw).await;
    let m = lane_mptcp(admin).await;
    println!("{m}");
    assert_eq!(m["asked"], true, "{m}");
    assert_eq!(m["active"], false, "{m}");
    assert_eq!(m["fallback"], "peer", "{m}");
    assert_eq!(m["fallbacks"]["peer"], 1, "{m}");
    let metrics = get(admin, "/metrics").await;
    assert!(
        metrics.contains(
            "sluice_uplink_mptcp_fallbacks_total{shard=\"0\",uplink=\"cloud\",lane=\"normal\",reason=\"peer\"} 1"
        ),
        "{metrics}"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mptcp_device_listener_serves_mptcp_and_plain_tcp_devices() {
    if !mptcp_or_skip() || !have("mptcpize") || !have("mosquitto_sub") {
        return;
    }
    let cloud = Cloud::start();
    let gw = gateway_mqtt(1, "mptcp = true", &cloud.uplink_toml(None, ""));
    let admin = gw.admin_addr.unwrap();
    let st: serde_json::Value = serde_json::from_str(&get(admin, "/api/v1/status").await).unwrap();
    assert_eq!(st["mqtt"]["mptcp"], true, "{}", st["mqtt"]);
    // An MPTCP device (mosquitto_sub with its socket made MPTCP by mptcpize) waits for one
    // message; while it is connected the kernel lists its connection as MPTCP.
    let port = gw.mqtt_addr.port().to_string();
    let mut sub = tokio::process::Command::new("mptcpize")
        .args([
            "run",
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "local/x",
            "-C",
            "1",
            "-W",
            "10",
            "-q",
            "1",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("mosquitto_sub");
    let port_filter = format!("sport = :{port}");
    let listed = common::eventually(Duration::from_secs(5), || {
        Command::new("ss")
            .args(["-MnH", "state", "established", &port_filter])
            .output()
            .is_ok_and(|o| !String::from_utf8_lossy(&o.stdout).trim().is_empty())
    })
    .await;
    assert!(
        listed,
        "the device's connection to the listener is an MPTCP one (ss -M)"
    );
    // Its SUBSCRIBE is in force (an established connection is not yet a subscription).
    assert!(
        common::eventually(Duration::from_secs(5), || {
            common::metric_sum(&gw.metrics_text(), "sluice_mqtt_subscriptions{") >= 1.0
        })
        .await,
        "mosquitto_sub's subscription is held"
    );
    // A plain TCP device publishes; the MPTCP device receives it.
    let mut d = device(&gw, "plain-dev", ProtocolVersion::V311).await;
    assert_eq!(
        d.publish("local/x", "hello", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    let mut out = String::new();
    sub.stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    assert_eq!(out.trim(), "hello");
    assert!(sub.wait().await.unwrap().success());
    gw.shutdown();
}
