//! End-to-end tests of the durable spool (`[spool]`) against a real Mosquitto cloud broker over
//! TLS 1.3 (certificates generated at test time). The cloud is "down" by closing a relay in
//! front of it (`common::Gate`), so the cloud subscriber, connected straight to the broker,
//! sees everything the gateway eventually sends. Spools live in temporary directories with
//! `fsync = "never"` (nothing here tests power loss; `tests/spool_crash.rs` kills the process).
//!
//! This file: acknowledgement from the spool, order across outages and restarts, live and
//! backlog, `when_full`, `drain_order`, `ack = "cloud"`, aggregation and the high lane.
//! `gateway_spool_recovery.rs`: former shard indexes, failing spools and damaged records.

mod common;
mod spool_support;

use std::time::Duration;

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use spool_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos1_publishes_are_acked_from_the_spool_while_the_cloud_is_down_and_arrive_in_order_later()
{
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.gateway("ack = \"spool\"", "");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    dev.set_ack_timeout(Duration::from_secs(5));
    // Every PUBACK arrives although no cloud is reachable: the spool acknowledged them.
    publish_all(&mut dev, "d1", "dev/d1", 0..300, 16).await;
    assert!(!uplink_connected(&gw));
    let bytes = spool_bytes(t.dir.path());
    for i in 0..300 {
        assert!(
            contains(&bytes, payload("d1", i).as_bytes()),
            "message {i} not in the spool files"
        );
    }
    assert!(t
        .sub
        .recv(Duration::from_millis(300))
        .await
        .expect("sub")
        .is_none());

    t.gate.set_open(true);
    let got = receive(&mut t.sub, 300, WAIT).await;
    let want: Vec<(String, usize)> = (0..300).map(|i| ("d1".to_string(), i)).collect();
    assert_eq!(got, want, "every message once, in order");
    // Acknowledged records are trimmed: the unacked count drops to zero.
    assert!(
        eventually(WAIT, || gw.status_json()["spool"]["unacked_records"] == 0).await,
        "{}",
        gw.status_json()["spool"]
    );
    let metrics = gw.metrics_text();
    assert_eq!(
        metric_sum(&metrics, "sluice_spool_records_appended_total"),
        300.0
    );
    assert_eq!(
        metric_sum(&metrics, "sluice_spool_records_acked_total"),
        300.0
    );
    assert!(metric_sum(&metrics, "sluice_spool_commits_total") > 0.0);
    assert!(metrics.contains("sluice_spool_commit_latency_seconds_bucket{"));
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_records_are_delivered_after_a_gateway_restart_on_the_same_spool() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.gateway("", "");
    let mut dev = device(&gw, "d1", ProtocolVersion::V5).await;
    publish_all(&mut dev, "d1", "dev/d1", 0..120, 8).await;
    drop(dev);
    gw.shutdown();
    assert!(t
        .sub
        .recv(Duration::from_millis(200))
        .await
        .expect("sub")
        .is_none());

    // The same spool directory, the cloud reachable now.
    t.gate.set_open(true);
    let gw = t.gateway("", "");
    let got = receive(&mut t.sub, 120, WAIT).await;
    let want: Vec<(String, usize)> = (0..120).map(|i| ("d1".to_string(), i)).collect();
    assert_eq!(got, want);
    assert!(eventually(WAIT, || gw.status_json()["spool"]["unacked_records"] == 0).await);
    gw.shutdown();
    // Acknowledged and committed: a third start sends nothing again.
    let gw = t.gateway("", "");
    assert!(eventually(WAIT, || uplink_connected(&gw)).await);
    assert!(
        t.sub
            .recv(Duration::from_millis(500))
            .await
            .expect("sub")
            .is_none(),
        "nothing is re-sent"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_messages_overtake_a_draining_backlog_which_keeps_per_device_order() {
    const BACKLOG: usize = 3000;
    const LIVE: usize = 20;
    let mut t = GatedCloud::start_closed("dev/#").await;
    // A window of 2: the backlog may use one slot while live messages wait, live the other.
    let gw = t.gateway("drain_share = 0.5", "inflight = 2");
    let mut a = device(&gw, "a", ProtocolVersion::V311).await;
    let mut b = device(&gw, "b", ProtocolVersion::V311).await;
    publish_all(&mut a, "a", "dev/a", 0..BACKLOG / 2, 32).await;
    publish_all(&mut b, "b", "dev/b", 0..BACKLOG / 2, 32).await;
    let mut live = device(&gw, "live", ProtocolVersion::V311).await;

    t.gate.set_open(true);
    assert!(eventually(WAIT, || uplink_connected(&gw)).await);
    let live_task = tokio::spawn(async move {
        for i in 0..LIVE {
            live.publish("dev/live", payload("live", i), QoS::AtLeastOnce, false)
                .await
                .expect("live publish");
        }
        live
    });
    let got = receive(&mut t.sub, BACKLOG + LIVE, WAIT).await;
    let _live = live_task.await.expect("live task");
    assert_eq!(got.len(), BACKLOG + LIVE, "everything arrives");
    let first_live = got
        .iter()
        .position(|(d, _)| d == "live")
        .expect("live arrived");
    let last_backlog = got
        .iter()
        .rposition(|(d, _)| d != "live")
        .expect("backlog arrived");
    assert!(
        first_live < last_backlog,
        "a live message ({first_live}) must not wait for the whole backlog ({last_backlog})"
    );
    for dev in ["a", "b", "live"] {
        let seq: Vec<usize> = got
            .iter()
            .filter(|(d, _)| d == dev)
            .map(|(_, i)| *i)
            .collect();
        let n = if dev == "live" { LIVE } else { BACKLOG / 2 };
        assert_eq!(seq, (0..n).collect::<Vec<_>>(), "device {dev} in order");
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_with_block_stops_acknowledging_until_the_cloud_drains_it() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.small_spool_gateway("block");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    const N: usize = 200;
    let filler = "x".repeat(200);
    let mut ids = Vec::new();
    for i in 0..N {
        let id = dev
            .publish_no_wait(
                "dev/d1",
                format!("{}{filler}", payload("d1", i)),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .expect("publish")
            .expect("id");
        ids.push(id);
    }
    // Only what fits in 16 KiB (about 60 records of ~250 bytes) is acknowledged.
    dev.set_ack_timeout(Duration::from_millis(1500));
    let mut acked = 0;
    for &id in &ids {
        if dev.wait_ack(id).await.is_err() {
            break;
        }
        acked += 1;
    }
    assert!(
        acked > 10 && acked < 100,
        "acked {acked} of {N} with a 16 KiB spool"
    );
    let metrics = gw.metrics_text();
    assert!(
        metric_sum(&metrics, "sluice_spool_full_total") >= 1.0,
        "{metrics}"
    );
    assert!(metric_sum(&metrics, "sluice_spool_bytes") <= 16384.0);
    // Another device's QoS 0 message is dropped and counted rather than waiting.
    let mut other = device(&gw, "d2", ProtocolVersion::V311).await;
    other
        .publish(
            "dev/d2",
            format!("{}{}", payload("d2", 0), "y".repeat(400)),
            QoS::AtMostOnce,
            false,
        )
        .await
        .expect("QoS 0 publish");
    assert!(
        eventually(WAIT, || metric_sum(
            &gw.metrics_text(),
            "sluice_mqtt_dropped_total{shard=\"0\",reason=\"spool_full\"}"
        ) == 1.0)
        .await
    );

    // The cloud comes back: the spool drains, the device is acknowledged for everything.
    t.gate.set_open(true);
    dev.set_ack_timeout(WAIT);
    for &id in &ids[acked..] {
        assert_eq!(dev.wait_ack(id).await.expect("PUBACK after the drain"), 0);
    }
    let got = receive(&mut t.sub, N, WAIT).await;
    assert_eq!(
        got,
        (0..N).map(|i| ("d1".to_string(), i)).collect::<Vec<_>>(),
        "nothing lost, in order"
    );
    assert_eq!(
        metric_sum(&gw.metrics_text(), "sluice_spool_dropped_oldest_total"),
        0.0
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_oldest_keeps_acknowledging_and_counts_what_it_dropped() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.small_spool_gateway("drop-oldest");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    const N: usize = 200;
    let filler = "x".repeat(200);
    for i in 0..N {
        let code = dev
            .publish(
                "dev/d1",
                format!("{}{filler}", payload("d1", i)),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .expect("every publish is acknowledged");
        assert_eq!(code, 0);
    }
    let dropped = metric_sum(&gw.metrics_text(), "sluice_spool_dropped_oldest_total");
    assert!(dropped >= 100.0, "dropped {dropped}");
    assert!(
        gw.status_json()["spool"]["dropped_oldest"]
            .as_u64()
            .unwrap_or(0)
            >= 100
    );

    t.gate.set_open(true);
    let got = receive(&mut t.sub, N, Duration::from_secs(3)).await;
    let idx: Vec<usize> = got.iter().map(|(_, i)| *i).collect();
    assert_eq!(
        idx.len() as f64,
        N as f64 - dropped,
        "what was not dropped arrives: {idx:?}"
    );
    assert_eq!(idx.last(), Some(&(N - 1)), "the newest survive");
    assert!(idx.windows(2).all(|w| w[0] < w[1]), "in order: {idx:?}");
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newest_first_sends_the_backlog_freshest_record_first() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.gateway("drain_order = \"newest-first\"", "");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    publish_all(&mut dev, "d1", "dev/d1", 0..500, 16).await;
    t.gate.set_open(true);
    let got = receive(&mut t.sub, 500, WAIT).await;
    let idx: Vec<usize> = got.iter().map(|(_, i)| *i).collect();
    assert_eq!(idx, (0..500).rev().collect::<Vec<_>>(), "newest first");
    // Live messages after the drain are in order again.
    publish_all(&mut dev, "d1", "dev/d1", 500..510, 4).await;
    let got = receive(&mut t.sub, 10, WAIT).await;
    assert_eq!(
        got.iter().map(|(_, i)| *i).collect::<Vec<_>>(),
        (500..510).collect::<Vec<_>>()
    );
    assert!(eventually(WAIT, || gw.status_json()["spool"]["unacked_records"] == 0).await);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_cloud_waits_for_the_cloud_but_still_keeps_messages_across_a_restart() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.gateway("ack = \"cloud\"", "");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    dev.set_ack_timeout(Duration::from_millis(800));
    let id = dev
        .publish_no_wait("dev/d1", payload("d1", 0), QoS::AtLeastOnce, false)
        .await
        .expect("publish")
        .expect("id");
    assert!(
        dev.wait_ack(id).await.is_err(),
        "no PUBACK while the cloud is down"
    );
    gw.shutdown();
    t.gate.set_open(true);
    let gw = t.gateway("ack = \"cloud\"", "");
    let got = receive(&mut t.sub, 1, WAIT).await;
    assert_eq!(
        got,
        vec![("d1".to_string(), 0)],
        "the spooled message survives the restart"
    );
    let mut dev = device(&gw, "d2", ProtocolVersion::V311).await;
    assert_eq!(
        dev.publish("dev/d2", payload("d2", 0), QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK"),
        0
    );
    assert_eq!(
        receive(&mut t.sub, 1, WAIT).await,
        vec![("d2".to_string(), 0)]
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spooled_messages_are_aggregated_into_senml_packs_and_a_pack_ack_trims_all_its_records() {
    use sluice_proto::senml::{self, Format, Value};
    let mut t = GatedCloud::start_closed("agg/#").await;
    let text = t.config(
        "",
        "[uplink.aggregate]\nenabled = true\nmin_devices = 0\nmax_pack = \"2KiB\"\nmax_delay = \"100ms\"\ntopic = \"agg/packs\"",
    );
    let gw = gateway(1, &text);
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    publish_all(&mut dev, "d1", "t/d1", 0..200, 16).await;
    t.gate.set_open(true);
    let mut got = Vec::new();
    let mut packs = 0;
    while got.len() < 200 {
        let Some(p) = t.sub.recv(WAIT).await.expect("sub") else {
            break;
        };
        assert_eq!(p.topic, "agg/packs");
        packs += 1;
        for r in senml::decode(Format::Json, &p.payload).expect("pack decodes") {
            let Some(Value::String(s)) = r.value else {
                panic!("text payload becomes vs: {r:?}")
            };
            got.push(index_of(s.as_bytes()));
        }
    }
    assert_eq!(
        got,
        (0..200).map(|i| ("d1".to_string(), i)).collect::<Vec<_>>()
    );
    assert!(packs < 200, "records were packed: {packs} packs");
    assert!(
        eventually(WAIT, || gw.status_json()["spool"]["unacked_records"] == 0).await,
        "each pack's PUBACK acknowledges all its records: {}",
        gw.status_json()["spool"]
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_priority_messages_bypass_the_spool_and_keep_cloud_ack_semantics() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let text = format!(
        "[priority]\ndevices = {{ \"alarm\" = 1 }}\n{}",
        t.config("", NO_AGGREGATION)
    );
    let gw = gateway(1, &text);
    let mut normal = device(&gw, "n1", ProtocolVersion::V311).await;
    let mut alarm = device(&gw, "alarm", ProtocolVersion::V311).await;
    alarm.set_ack_timeout(Duration::from_millis(800));
    let id = alarm
        .publish_no_wait("dev/alarm", payload("alarm", 0), QoS::AtLeastOnce, false)
        .await
        .expect("publish")
        .expect("id");
    assert!(
        alarm.wait_ack(id).await.is_err(),
        "a high message waits for the cloud"
    );
    assert_eq!(
        normal
            .publish("dev/n1", payload("n1", 0), QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK"),
        0
    );
    let bytes = spool_bytes(t.dir.path());
    assert!(
        contains(&bytes, payload("n1", 0).as_bytes()),
        "the normal message is spooled"
    );
    assert!(
        !contains(&bytes, payload("alarm", 0).as_bytes()),
        "the high message is not"
    );
    t.gate.set_open(true);
    alarm.set_ack_timeout(WAIT);
    assert_eq!(
        alarm.wait_ack(id).await.expect("PUBACK after the cloud's"),
        0
    );
    let mut got = receive(&mut t.sub, 2, WAIT).await;
    got.sort();
    assert_eq!(got, vec![("alarm".to_string(), 0), ("n1".to_string(), 0)]);
    gw.shutdown();
}
