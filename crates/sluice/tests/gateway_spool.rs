//! End-to-end tests of the durable spool (`[spool]`) against a real Mosquitto cloud broker over
//! TLS 1.3 (certificates generated at test time). The cloud is "down" by closing a relay in
//! front of it (`common::Gate`), so the cloud subscriber, connected straight to the broker,
//! sees everything the gateway eventually sends. Spools live in temporary directories with
//! `fsync = "never"` (nothing here tests power loss; `tests/spool_crash.rs` kills the process).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use sluice::app::RunningGateway;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::TestClient;

const WAIT: Duration = Duration::from_secs(20);

/// `[uplink]` lines that turn SenML aggregation off (one PUBLISH per spooled message).
const NO_AGGREGATION: &str = "[uplink.aggregate]\nenabled = false";

/// What every test here starts from: a cloud broker with a subscriber, a gate in front of it
/// that starts closed (the cloud is "down"), and an empty spool directory.
struct GatedCloud {
    cloud: Cloud,
    sub: TestClient,
    gate: Gate,
    dir: tempfile::TempDir,
}

impl GatedCloud {
    /// The cloud, its subscriber on `filter`, the gate closed.
    async fn start_closed(filter: &str) -> GatedCloud {
        let cloud = Cloud::start();
        let sub = cloud.subscriber("cloud-sub", filter).await;
        let gate = Gate::start(cloud.broker.tls_addr()).await;
        gate.set_open(false);
        let dir = tempfile::tempdir().expect("tempdir");
        GatedCloud {
            cloud,
            sub,
            gate,
            dir,
        }
    }

    /// `[spool]` in the spool directory (`fsync = "never"`, then `spool_extra`) and an uplink
    /// through the gate (`uplink_extra` in its section).
    fn config(&self, spool_extra: &str, uplink_extra: &str) -> String {
        format!(
            "[spool]\ndir = \"{}\"\nfsync = \"never\"\n{spool_extra}\n{}",
            self.dir.path().display(),
            self.cloud.uplink_toml(Some(self.gate.addr), uplink_extra)
        )
    }

    /// A one-shard gateway on [`GatedCloud::config`] without aggregation.
    fn gateway(&self, spool_extra: &str, uplink_extra: &str) -> RunningGateway {
        gateway(
            1,
            &self.config(spool_extra, &format!("{uplink_extra}\n{NO_AGGREGATION}")),
        )
    }

    /// A one-shard gateway with `ack` and a 1 KiB uplink queue: while the cloud is away only
    /// the first few records are read into memory, the rest stay on disk.
    fn small_queue_gateway(&self, ack: &str) -> RunningGateway {
        gateway_sections(
            "shards = 1\nmax_buffered = \"1KiB\"",
            "max_packet_size = \"1KiB\"",
            &self.config(&format!("ack = \"{ack}\""), NO_AGGREGATION),
        )
    }

    /// A one-shard gateway whose spool holds 16 KiB in 4 KiB segments, `when_full` when it is
    /// full, and devices' packets of at most 1 KiB.
    fn small_spool_gateway(&self, when_full: &str) -> RunningGateway {
        let text = self.config(
            &format!("segment_size = \"4KiB\"\nmax_size = \"16KiB\"\nwhen_full = \"{when_full}\""),
            NO_AGGREGATION,
        );
        gateway_mqtt(1, "max_packet_size = \"1KiB\"", &text)
    }
}

fn payload(device: &str, i: usize) -> String {
    format!("{device}:{i:06}:")
}

fn index_of(p: &[u8]) -> (String, usize) {
    let s = std::str::from_utf8(p).expect("utf-8 payload");
    let mut parts = s.split(':');
    let dev = parts.next().expect("device").to_string();
    let i = parts.next().expect("index").parse().expect("number");
    (dev, i)
}

/// Publishes `n` QoS 1 messages keeping up to `window` unacknowledged; returns once every
/// PUBACK arrived (fails the test after the client's ack timeout).
async fn publish_all(
    c: &mut TestClient,
    device: &str,
    topic: &str,
    range: std::ops::Range<usize>,
    window: usize,
) {
    let mut pending = std::collections::VecDeque::new();
    for i in range {
        if pending.len() >= window {
            let id = pending.pop_front().expect("pending");
            assert_eq!(c.wait_ack(id).await.expect("PUBACK"), 0);
        }
        let id = c
            .publish_no_wait(topic, payload(device, i), QoS::AtLeastOnce, false)
            .await
            .expect("publish")
            .expect("QoS 1 has a packet id");
        pending.push_back(id);
    }
    for id in pending {
        assert_eq!(c.wait_ack(id).await.expect("PUBACK"), 0);
    }
}

/// Receives until `n` messages arrived or nothing came for `quiet`.
async fn receive(sub: &mut TestClient, n: usize, quiet: Duration) -> Vec<(String, usize)> {
    let mut got = Vec::new();
    while got.len() < n {
        match sub.recv(quiet).await.expect("cloud subscriber") {
            Some(p) => got.push(index_of(&p.payload)),
            None => break,
        }
    }
    got
}

/// The gateway's metric lines starting with `prefix`, for failure messages.
fn metric_lines(gw: &RunningGateway, prefix: &str) -> String {
    gw.metrics_text()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .collect::<Vec<_>>()
        .join("\n")
}

fn uplink_connected(gw: &RunningGateway) -> bool {
    gw.status_json()["shards"]
        .as_array()
        .is_some_and(|s| s.iter().all(|s| s["uplinks"][0]["state"] == "connected"))
}

/// Every segment file's bytes, concatenated.
fn spool_bytes(dir: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for entry in walk(dir) {
        if entry.extension().is_some_and(|e| e == "seg") {
            out.extend(std::fs::read(&entry).expect("read segment"));
        }
    }
    out
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Flips one byte of the payload `needle` in the spool segment that holds it, in place (the
/// running gateway's open file sees it), as a flash bit flip would.
fn damage_on_disk(dir: &Path, needle: &str) {
    let mut damaged = 0;
    for path in walk(dir) {
        if path.extension().is_none_or(|e| e != "seg") {
            continue;
        }
        let mut bytes = std::fs::read(&path).expect("read segment");
        if let Some(at) = bytes
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
        {
            bytes[at + 3] ^= 0x40;
            std::fs::write(&path, &bytes).expect("rewrite segment");
            damaged += 1;
        }
    }
    assert_eq!(damaged, 1, "{needle} is in exactly one segment");
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spool_of_a_shard_index_no_longer_configured_is_drained_by_a_current_shard() {
    let mut t = GatedCloud::start_closed("dev/#").await;
    let text = t.config("", NO_AGGREGATION);
    let gw = gateway(2, &text);
    let ids = ids_on_shards("dev", 2, 1);
    let on_shard_1 = ids[1][0].clone();
    let mut dev = device(&gw, &on_shard_1, ProtocolVersion::V311).await;
    publish_all(&mut dev, &on_shard_1, "dev/x", 0..50, 8).await;
    drop(dev);
    gw.shutdown();
    assert!(t.dir.path().join("cloud/shard-1").is_dir());

    // One shard now: shard 0 drains the former shard 1's spool.
    t.gate.set_open(true);
    let gw = gateway(1, &text);
    let got = receive(&mut t.sub, 50, WAIT).await;
    assert_eq!(
        got,
        (0..50).map(|i| (on_shard_1.clone(), i)).collect::<Vec<_>>()
    );
    assert_eq!(gw.status_json()["spool"]["former_shard_spools"], 1);
    assert!(eventually(WAIT, || gw.status_json()["spool"]["unacked_records"] == 0).await);
    gw.shutdown();
    // Acknowledged and committed at shutdown: nothing comes back on the next start.
    let gw = gateway(1, &text);
    assert!(eventually(WAIT, || uplink_connected(&gw)).await);
    assert!(t
        .sub
        .recv(Duration::from_millis(500))
        .await
        .expect("sub")
        .is_none());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_spool_closes_the_devices_it_cannot_acknowledge_and_they_resend_after_reconnecting(
) {
    let mut t = GatedCloud::start_closed("dev/#").await;
    t.gate.set_open(true);
    // 4 KiB segments (so devices' packets of at most 1 KiB): the spool soon needs a new
    // segment file.
    let gw = gateway_mqtt(
        1,
        "max_packet_size = \"1KiB\"",
        &t.config("ack = \"spool\"\nsegment_size = \"4KiB\"", NO_AGGREGATION),
    );
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    // Far beyond how long the gateway may take to close the connection, so a timeout here
    // cannot pass for a close.
    let ack_timeout = Duration::from_secs(30);
    dev.set_ack_timeout(ack_timeout);
    publish_all(&mut dev, "d1", "dev/d1", 0..10, 1).await;

    // The spool's storage fails under the running gateway: its directory disappears, so the
    // next segment file cannot be created and the commit that needs it fails.
    std::fs::remove_dir_all(t.dir.path()).expect("remove the spool directory");
    // Keep 16 messages in flight, so the commit that fails has devices waiting on it.
    let mut pending = std::collections::VecDeque::new();
    let mut first_unacked = None;
    for i in 10..20_000 {
        // The failure may hit a read of the feeder instead of a commit with devices waiting
        // on it (nothing is lost then, and the spool reopens, recreating its directory):
        // take the directory away again until a commit fails.
        if i % 256 == 0 && t.dir.path().exists() {
            let _ = std::fs::remove_dir_all(t.dir.path());
        }
        if pending.len() >= 16 {
            let (j, id) = *pending.front().expect("pending");
            let started = std::time::Instant::now();
            match dev.wait_ack(id).await {
                Ok(code) => {
                    assert_eq!(code, 0, "PUBACK code for message {j}");
                    pending.pop_front();
                }
                Err(e) => {
                    assert!(
                        started.elapsed() < ack_timeout / 2,
                        "message {j}: no PUBACK and no close for {:?}: {e:#}",
                        started.elapsed()
                    );
                    first_unacked = Some(j);
                    break;
                }
            }
        }
        match dev
            .publish_no_wait("dev/d1", payload("d1", i), QoS::AtLeastOnce, false)
            .await
        {
            Ok(id) => pending.push_back((i, id.expect("packet id"))),
            // Closed while we were writing: PUBACKs come in order, so the oldest
            // unacknowledged message is where the device starts resending.
            Err(_) => {
                first_unacked = Some(pending.front().map_or(i, |p| p.0));
                break;
            }
        }
    }
    let Some(first_unacked) = first_unacked else {
        panic!(
            "the failing spool never closed the device; spool metrics:\n{}",
            metric_lines(&gw, "sluice_spool")
        );
    };
    assert!(metric_sum(&gw.metrics_text(), "sluice_spool_failures_total") >= 1.0);
    let ack_lost = "sluice_mqtt_connections_closed_total{shard=\"0\",reason=\"ack_lost\"}";
    assert!(
        eventually(WAIT, || metric_sum(&gw.metrics_text(), ack_lost) == 1.0).await,
        "closed by reason: {}",
        metric_lines(&gw, "sluice_mqtt_connections_closed_total")
    );

    // The device reconnects and resends what it holds unacknowledged, then carries on: the
    // reopened spool acknowledges it all and the cloud gets it, in order.
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    dev.set_ack_timeout(Duration::from_secs(10));
    let last = first_unacked + 20;
    publish_all(&mut dev, "d1", "dev/d1", first_unacked..last, 4).await;
    let mut got = Vec::new();
    while got.last() != Some(&("d1".to_string(), last - 1)) {
        match t.sub.recv(WAIT).await.expect("cloud subscriber") {
            Some(p) => got.push(index_of(&p.payload)),
            None => panic!("the resent messages did not reach the cloud; got {got:?}"),
        }
    }
    let resent: Vec<usize> = got
        .iter()
        .map(|(_, i)| *i)
        .skip_while(|&i| i < first_unacked)
        .collect();
    assert_eq!(
        resent,
        (first_unacked..last).collect::<Vec<_>>(),
        "the resent messages arrive once each, in order"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_damaged_on_disk_after_it_was_acknowledged_is_skipped_counted_and_the_rest_arrive_in_order(
) {
    const N: usize = 300;
    const DAMAGED: usize = 250;
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.small_queue_gateway("spool");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    dev.set_ack_timeout(Duration::from_secs(5));
    publish_all(&mut dev, "d1", "dev/d1", 0..N, 16).await;

    // The medium changes one byte of an acknowledged, committed record that the gateway has
    // not read back yet (a flash bit flip): its checksum no longer matches.
    damage_on_disk(t.dir.path(), &payload("d1", DAMAGED));

    t.gate.set_open(true);
    let got = receive(&mut t.sub, N - 1, WAIT).await;
    let want: Vec<(String, usize)> = (0..N)
        .filter(|&i| i != DAMAGED)
        .map(|i| ("d1".to_string(), i))
        .collect();
    assert_eq!(
        got,
        want,
        "every other record once, in order; spool metrics:\n{}",
        metric_lines(&gw, "sluice_spool")
    );
    assert!(
        t.sub
            .recv(Duration::from_millis(300))
            .await
            .expect("sub")
            .is_none(),
        "the damaged record is not sent in any form"
    );
    assert_eq!(
        metric_sum(&gw.metrics_text(), "sluice_spool_undecodable_total"),
        1.0,
        "{}",
        metric_lines(&gw, "sluice_spool")
    );
    // The skipped record is acknowledged in the spool too, so nothing stays unacked and the
    // spool does not try it again.
    assert!(
        eventually(WAIT, || gw.status_json()["spool"]["unacked_records"] == 0).await,
        "{}",
        gw.status_json()["spool"]
    );
    // The device's connection carried on through all of it.
    publish_all(&mut dev, "d1", "dev/d1", N..N + 10, 4).await;
    let more = receive(&mut t.sub, 10, WAIT).await;
    assert_eq!(
        more,
        (N..N + 10)
            .map(|i| ("d1".to_string(), i))
            .collect::<Vec<_>>()
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ack_cloud_a_damaged_record_closes_its_device_which_resends_it() {
    const N: usize = 40;
    const DAMAGED: usize = 30;
    let mut t = GatedCloud::start_closed("dev/#").await;
    let gw = t.small_queue_gateway("cloud");
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    dev.set_ack_timeout(WAIT);
    // With the cloud away nothing is acknowledged: all N wait, spooled.
    let mut pending = std::collections::VecDeque::new();
    for i in 0..N {
        let id = dev
            .publish_no_wait("dev/d1", payload("d1", i), QoS::AtLeastOnce, false)
            .await
            .expect("publish")
            .expect("packet id");
        pending.push_back((i, id));
    }
    let last = payload("d1", N - 1);
    assert!(
        eventually(WAIT, || contains(
            &spool_bytes(t.dir.path()),
            last.as_bytes()
        ))
        .await,
        "all {N} messages reach the spool files"
    );
    damage_on_disk(t.dir.path(), &payload("d1", DAMAGED));

    // The cloud comes back. The messages before the damaged one are acknowledged; the
    // damaged one never can be, so the gateway closes the device's connection.
    t.gate.set_open(true);
    let mut first_unacked = None;
    while let Some(&(i, id)) = pending.front() {
        match dev.wait_ack(id).await {
            Ok(code) => {
                assert_eq!(code, 0, "PUBACK code for message {i}");
                pending.pop_front();
            }
            Err(_) => {
                first_unacked = Some(i);
                break;
            }
        }
    }
    let first_unacked = first_unacked.expect("the device was not closed");
    assert!(
        first_unacked <= DAMAGED,
        "message {DAMAGED} was acknowledged (first unacknowledged: {first_unacked})"
    );
    let ack_lost = "sluice_mqtt_connections_closed_total{shard=\"0\",reason=\"ack_lost\"}";
    // The shard counts the close after shutting the socket: the device may see it first.
    assert!(
        eventually(WAIT, || metric_sum(&gw.metrics_text(), ack_lost) >= 1.0).await,
        "closed as ack_lost: {}",
        gw.metrics_text()
    );
    assert_eq!(metric_sum(&gw.metrics_text(), ack_lost), 1.0);
    assert_eq!(
        metric_sum(&gw.metrics_text(), "sluice_spool_undecodable_total"),
        1.0
    );

    // The device reconnects and resends what it holds: the damaged message reaches the cloud
    // after all, and nothing is missing (duplicates of what the cloud already had allowed).
    let mut dev = device(&gw, "d1", ProtocolVersion::V311).await;
    publish_all(&mut dev, "d1", "dev/d1", first_unacked..N, 8).await;
    let got = receive(&mut t.sub, usize::MAX, Duration::from_secs(2)).await;
    let mut first_seen = Vec::new();
    for (_, i) in &got {
        if !first_seen.contains(i) {
            first_seen.push(*i);
        }
    }
    assert_eq!(
        first_seen,
        (0..N).collect::<Vec<_>>(),
        "every message, in order of first arrival; got {got:?}"
    );
    gw.shutdown();
}
