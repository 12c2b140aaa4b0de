//! The Kafka uplink end to end: MQTT devices publish QoS 1 to a gateway started from TOML
//! (`protocol = "kafka"`), the gateway produces to a real three-node Apache Kafka 4.4.0
//! cluster (KRaft, `scripts/kafka-cluster`) with `acks = all` and the idempotent producer, and
//! Kafka's own console consumer reads the records back. A device's PUBACK comes only after
//! Kafka acknowledged, so every acknowledged message must be there — also when the partition
//! leader is killed under load.
//!
//! Skipped with a printed reason when Java or Maven is missing (scripts/test installs them).

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{device_opts, gateway, metric_sum};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::ConnectOpts;
use sluice_testkit::KafkaCluster;

fn kafka_uplink(bootstrap: &str, extra: &str) -> String {
    let brokers: Vec<String> = bootstrap.split(',').map(|b| format!("{b:?}")).collect();
    format!(
        "[[uplink]]\nname = \"kafka\"\nprotocol = \"kafka\"\nbrokers = [{}]\nsecurity_protocol = \"plaintext\"\nallow_plaintext = true\nforward = [\"site/#\"]\nreconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n{extra}\n",
        brokers.join(", ")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_messages_become_records_keyed_by_device_in_order_with_the_topic_as_header() {
    let Some(cluster) = KafkaCluster::start(None) else {
        return;
    };
    cluster.create_topic("site.telemetry", 3);
    let gw = gateway(2, &kafka_uplink(&cluster.bootstrap, ""));
    const DEVICES: usize = 4;
    const EACH: usize = 50;
    let mut devs = Vec::new();
    for d in 0..DEVICES {
        let mut c = device_opts(
            &gw,
            ConnectOpts::new(ProtocolVersion::V5, &format!("dev-{d}")),
        )
        .await;
        c.set_ack_timeout(Duration::from_secs(60));
        devs.push(c);
    }
    for n in 0..EACH {
        for (d, c) in devs.iter_mut().enumerate() {
            let code = c
                .publish(
                    "site/telemetry",
                    format!("dev-{d} {n}"),
                    QoS::AtLeastOnce,
                    false,
                )
                .await
                .expect("PUBACK");
            assert_eq!(code, 0, "PUBACK of dev-{d} {n}");
        }
    }
    // MQTT 5 User Properties become record headers beside the topic.
    let props = sluice_proto::mqtt::Properties {
        user_properties: vec![
            ("site".into(), "north".into()),
            ("unit".into(), "degC".into()),
        ],
        ..Default::default()
    };
    let code = devs[0]
        .publish_with("site/telemetry", "dev-0 50", QoS::AtLeastOnce, props)
        .await
        .expect("PUBACK");
    assert_eq!(code, 0);
    let records = cluster.consume("site.telemetry", DEVICES * EACH + 1);
    assert_eq!(records.len(), DEVICES * EACH + 1, "every message once");
    let with_props = records
        .iter()
        .find(|(_, _, v)| v == "dev-0 50")
        .expect("the message with properties");
    for want in ["site:north", "unit:degC", "mqtt_topic:site/telemetry"] {
        assert!(with_props.0.contains(want), "{want} in {:?}", with_props.0);
    }
    assert!(
        !records[0].0.contains("site:north") || records[0].2 == "dev-0 50",
        "only that message has them"
    );
    let mut next: HashMap<String, usize> = HashMap::new();
    for (headers, key, value) in &records {
        assert!(headers.contains("mqtt_topic:site/telemetry"), "{headers:?}");
        let (dev, n) = value.split_once(' ').unwrap();
        assert_eq!(dev, key, "keyed by its device");
        let want = next.entry(key.clone()).or_default();
        assert_eq!(
            n.parse::<usize>().unwrap(),
            *want,
            "{key}'s records in order"
        );
        *want += 1;
    }
    let text = gw.metrics_text();
    assert!(
        metric_sum(&text, "sluice_uplink_messages_acked_total{") >= (DEVICES * EACH) as f64,
        "acks counted: {}",
        text.lines()
            .filter(|l| l.starts_with("sluice_uplink_messages_acked_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_partition_leader_under_load_loses_nothing_acknowledged() {
    let Some(cluster) = KafkaCluster::start(None) else {
        return;
    };
    // One partition: every device's records have the one leader that is killed.
    cluster.create_topic("site.load", 1);
    let leader = cluster.leader("site.load", 0);
    let gw = gateway(
        2,
        &kafka_uplink(
            &cluster.bootstrap,
            "request_timeout = \"10s\"\nconnect_timeout = \"3s\"",
        ),
    );
    const DEVICES: usize = 4;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for d in 0..DEVICES {
        let mut c = device_opts(
            &gw,
            ConnectOpts::new(ProtocolVersion::V5, &format!("dev-{d}")),
        )
        .await;
        c.set_ack_timeout(Duration::from_secs(90));
        let stop = stop.clone();
        let acks = acks.clone();
        tasks.push(tokio::spawn(async move {
            // (message number, when its PUBACK came)
            let mut acked = Vec::new();
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let code = c
                    .publish("site/load", format!("dev-{d} {n}"), QoS::AtLeastOnce, false)
                    .await
                    .expect("PUBACK");
                assert_eq!(code, 0, "PUBACK of dev-{d} {n}");
                acked.push((n, Instant::now()));
                acks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                n += 1;
            }
            acked
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let killed_at = Instant::now();
    let at_kill = acks.load(std::sync::atomic::Ordering::Relaxed);
    cluster.kill(leader);
    // Kafka moves the leadership once its controller has fenced the dead broker (its
    // session timeout, 9 s by default): wait until acknowledgements flow again, then 3 s more.
    let deadline = Instant::now() + Duration::from_secs(90);
    while acks.load(std::sync::atomic::Ordering::Relaxed) < at_kill + 50 {
        assert!(
            Instant::now() < deadline,
            "no acknowledgement 90 s after the leader was killed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut acked_by_dev = Vec::new();
    for t in tasks {
        acked_by_dev.push(t.await.unwrap());
    }
    // The stall: the longest time without any PUBACK after the kill.
    let mut times: Vec<Instant> = acked_by_dev
        .iter()
        .flatten()
        .map(|(_, t)| *t)
        .filter(|t| *t >= killed_at)
        .collect();
    times.sort();
    let mut stall = times.first().map_or(Duration::MAX, |t| *t - killed_at);
    for w in times.windows(2) {
        stall = stall.max(w[1] - w[0]);
    }
    let total: usize = acked_by_dev.iter().map(Vec::len).sum();
    let after: usize = times.len();
    println!(
        "leader {leader} killed: {total} messages acknowledged ({after} after the kill), longest stall {:.2} s",
        stall.as_secs_f64()
    );
    assert!(after > 0, "the uplink moved on to the new leader");
    // Every acknowledged message is in Kafka; first arrivals in order per device.
    let records = cluster.consume("site.load", total + 10_000);
    let mut seen: HashMap<String, Vec<usize>> = HashMap::new();
    for (_, key, value) in &records {
        let (_, n) = value.split_once(' ').unwrap();
        seen.entry(key.clone())
            .or_default()
            .push(n.parse().unwrap());
    }
    for (d, acked) in acked_by_dev.iter().enumerate() {
        let got = seen.get(&format!("dev-{d}")).cloned().unwrap_or_default();
        let mut firsts = Vec::new();
        let mut have = std::collections::HashSet::new();
        for n in &got {
            if have.insert(*n) {
                firsts.push(*n);
            }
        }
        for (n, _) in acked {
            assert!(
                have.contains(n),
                "dev-{d} {n} was acknowledged but is not in Kafka"
            );
        }
        assert!(
            firsts.windows(2).all(|w| w[0] < w[1]),
            "dev-{d}'s first arrivals in order: {firsts:?}"
        );
    }
}
