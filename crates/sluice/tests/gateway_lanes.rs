//! Aggregation and priority lanes end to end (issue: batching and priority lanes), against a
//! real cloud Mosquitto with TLS 1.3: SenML packs going at once on an idle uplink, filling to
//! max_pack while it is busy (the cloud frozen with SIGSTOP), bounded by max_delay, with
//! flush = "window" and the timer rule (flush = "max_delay"), and by device count (crossing
//! the threshold up and down); high priority bypassing aggregation on its own lane; and the
//! lane sockets' marks as read back from the kernel.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{device, eventually, gateway, Cloud};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_proto::senml::{self, Format, Value};
use sluice_testkit::TestClient;

/// A payload SenML must carry as `vd`: 0xB0 is not valid UTF-8, not a CBOR array.
fn payload(device: u8, seq: u16, len: usize) -> Bytes {
    let mut p = vec![0xB0, device];
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend((0..len.saturating_sub(4)).map(|i| (i % 251) as u8));
    Bytes::from(p)
}

fn parse(p: &[u8]) -> (u8, u16) {
    assert_eq!(p[0], 0xB0, "not a test payload: {p:?}");
    (p[1], u16::from_be_bytes([p[2], p[3]]))
}

/// What the cloud received, in arrival order.
#[derive(Debug, Default)]
struct Arrivals {
    /// (device, seq, came in a pack, full payload)
    records: Vec<(u8, u16, bool, Bytes)>,
    /// Records per pack, in arrival order.
    packs: Vec<usize>,
    /// Payload bytes per pack, in arrival order.
    pack_bytes: Vec<usize>,
    pack_names: Vec<String>,
}

impl Arrivals {
    /// Sequence numbers per device in arrival order.
    fn per_device(&self) -> HashMap<u8, Vec<u16>> {
        let mut m: HashMap<u8, Vec<u16>> = HashMap::new();
        for (d, s, _, _) in &self.records {
            m.entry(*d).or_default().push(*s);
        }
        m
    }
}

/// Receive until `n` records arrived (or `timeout` passes), unpacking SenML packs.
async fn collect(
    sub: &mut TestClient,
    n: usize,
    agg_topic: &str,
    format: Format,
    timeout: Duration,
) -> Arrivals {
    let mut a = Arrivals::default();
    let deadline = Instant::now() + timeout;
    while a.records.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(p)) = sub.recv(left).await else {
            break;
        };
        if p.topic == agg_topic {
            let records = senml::decode(format, &p.payload).expect("pack decodes");
            a.packs.push(records.len());
            a.pack_bytes.push(p.payload.len());
            for r in records {
                let Some(Value::Data(bytes)) = r.value else {
                    panic!("record without vd: {r:?}");
                };
                assert!(r.time > 1.6e9, "records carry an absolute time: {}", r.time);
                let (d, s) = parse(&bytes);
                a.pack_names.push(r.name.clone());
                a.records.push((d, s, true, bytes));
            }
        } else {
            let (d, s) = parse(&p.payload);
            a.records.push((d, s, false, p.payload.clone()));
        }
    }
    a
}

/// `[uplink.aggregate]` turned on (it is off by default) with `aggregate`'s settings.
fn aggregate_toml(extra_uplink: &str, aggregate: &str) -> String {
    format!("{extra_uplink}\n[uplink.aggregate]\nenabled = true\n{aggregate}\n")
}

/// Freeze (`-STOP`) or thaw (`-CONT`) the cloud broker: while frozen, what the gateway writes
/// stays unacknowledged, so the uplink is busy for as long as the test wants.
fn signal_cloud(cloud: &Cloud, sig: &str) {
    let pid = cloud.broker.pid().expect("cloud running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill {sig} {pid}");
}

/// Wait until the gateway's (one-shard) uplink is connected: the cloud may be frozen only
/// after the handshake.
async fn uplink_connected(gw: &sluice::app::RunningGateway) {
    let up = eventually(Duration::from_secs(10), || {
        gw.status_json()["shards"][0]["uplinks"][0]["state"] == "connected"
    })
    .await;
    assert!(up, "uplink connected: {}", gw.status_json());
}

/// Packs written to the cloud so far (the gateway's own count).
fn packs_sent(gw: &sluice::app::RunningGateway) -> f64 {
    common::metric_sum(&gw.metrics_text(), "sluice_uplink_packs_sent_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_message_on_an_idle_uplink_goes_at_once_as_a_pack_of_one_despite_a_ten_second_max_delay(
) {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("sub", "#").await;
    let gw = gateway(
        1,
        &cloud.uplink_toml(
            None,
            &aggregate_toml(
                "",
                "min_devices = 0\nmax_pack = \"64KiB\"\nmax_delay = \"10s\"",
            ),
        ),
    );
    let mut d = device(&gw, "dev-lone", ProtocolVersion::V311).await;
    // Three lone messages, each sent once the one before arrived: each finds the uplink idle.
    for seq in 0..3u16 {
        let started = Instant::now();
        let id = d
            .publish_no_wait("t/lone", payload(5, seq, 50), QoS::AtLeastOnce, false)
            .await
            .unwrap();
        let a = collect(
            &mut sub,
            1,
            "sluice/senml",
            Format::Json,
            Duration::from_secs(5),
        )
        .await;
        let waited = started.elapsed();
        assert_eq!(
            a.packs,
            vec![1],
            "message {seq}: a pack of one record on the pack topic, long before max_delay (10 s); got {:?} after {waited:?}",
            a.packs
        );
        assert_eq!(a.per_device()[&5], vec![seq]);
        assert!(
            waited < Duration::from_secs(2),
            "message {seq}: arrived after {waited:?}; max_delay is 10 s"
        );
        assert_eq!(d.wait_ack(id.unwrap()).await.unwrap(), 0);
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_burst_while_the_uplink_is_busy_packs_fill_to_max_pack_and_unpack_to_exactly_what_was_sent(
) {
    for (format, fmt) in [("json", Format::Json), ("cbor", Format::Cbor)] {
        let cloud = Cloud::start();
        let mut sub = cloud.subscriber("sub", "#").await;
        let gw = gateway(
            1,
            &cloud.uplink_toml(
                None,
                &aggregate_toml(
                    "",
                    &format!("min_devices = 0\nformat = \"{format}\"\nmax_pack = \"2KiB\"\nmax_delay = \"30s\"\ntopic = \"agg/packs\""),
                ),
            ),
        );
        let mut d = device(&gw, "dev-a", ProtocolVersion::V5).await;
        // The cloud stops answering; the first message still goes at once (the uplink was
        // idle) and stays unacknowledged: from then on the uplink is busy.
        uplink_connected(&gw).await;
        signal_cloud(&cloud, "-STOP");
        let mut ids = Vec::new();
        let mut sent = Vec::new();
        let first = payload(1, 0, 300);
        sent.push(first.clone());
        ids.push(
            d.publish_no_wait("t/a", first, QoS::AtLeastOnce, false)
                .await
                .unwrap(),
        );
        let went = eventually(Duration::from_secs(5), || packs_sent(&gw) >= 1.0).await;
        if !went {
            signal_cloud(&cloud, "-CONT");
        }
        assert!(went, "{format}: the lone first message was written at once");
        // A burst of 40 × 300 B while the first is unacknowledged.
        for seq in 1..41u16 {
            let p = payload(1, seq, 300);
            sent.push(p.clone());
            ids.push(
                d.publish_no_wait("t/a", p, QoS::AtLeastOnce, false)
                    .await
                    .unwrap(),
            );
        }
        // Full packs go without waiting for the cloud (only a partial one waits for its ack).
        let full_went = eventually(Duration::from_secs(5), || packs_sent(&gw) >= 3.0).await;
        signal_cloud(&cloud, "-CONT");
        assert!(
            full_went,
            "{format}: full packs were written while the cloud was frozen"
        );
        let a = collect(&mut sub, 41, "agg/packs", fmt, Duration::from_secs(10)).await;
        assert_eq!(a.records.len(), 41, "{format}: every record arrived");
        assert!(
            a.records.iter().all(|r| r.2),
            "{format}: every record came packed"
        );
        assert_eq!(
            a.packs[0], 1,
            "{format}: the lone first message did not wait"
        );
        let burst = &a.packs[1..];
        assert!(
            burst.len() >= 2 && (41 - 1) as f64 / burst.len() as f64 > 1.0,
            "{format}: while busy, records per PUBLISH > 1: {burst:?}"
        );
        // max_pack closes a pack: every burst pack but the last reached 2 KiB, and none
        // exceeds it by more than one record.
        let (last, filled) = a.pack_bytes[1..].split_last().unwrap();
        assert!(
            filled.iter().all(|&b| (2048..2048 + 600).contains(&b)),
            "{format}: pack sizes {:?}",
            a.pack_bytes
        );
        assert!(*last < 2048 + 600, "{format}: last pack {last} B");
        assert!(
            a.pack_names.iter().all(|n| n == "dev-a/t/a"),
            "{format}: names {:?}",
            a.pack_names
        );
        for (i, (_, seq, _, bytes)) in a.records.iter().enumerate() {
            assert_eq!(*seq as usize, i, "{format}: in order");
            assert_eq!(bytes, &sent[i], "{format}: byte for byte");
        }
        // The device's acks come only once its records' packs were acknowledged by the cloud.
        for id in ids.iter().flatten() {
            assert_eq!(d.wait_ack(*id).await.unwrap(), 0);
        }
        let metrics = gw.metrics_text();
        assert!(common::metric_sum(&metrics, "sluice_uplink_pack_records_count") >= 3.0);
        gw.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_delay_bounds_how_long_a_partial_pack_waits_while_the_uplink_stays_busy() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("sub", "#").await;
    let gw = gateway(
        1,
        &cloud.uplink_toml(
            None,
            &aggregate_toml(
                "",
                "min_devices = 0\nmax_pack = \"64KiB\"\nmax_delay = \"400ms\"",
            ),
        ),
    );
    let mut d = device(&gw, "dev-b", ProtocolVersion::V311).await;
    uplink_connected(&gw).await;
    signal_cloud(&cloud, "-STOP");
    let id1 = d
        .publish_no_wait("t/b", payload(2, 0, 50), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let went = eventually(Duration::from_secs(5), || packs_sent(&gw) >= 1.0).await;
    let started = Instant::now();
    let id2 = d
        .publish_no_wait("t/b", payload(2, 1, 50), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let id3 = d
        .publish_no_wait("t/b", payload(2, 2, 50), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    // The first pack is unacknowledged for good (the cloud is frozen): the second waits for
    // max_delay, then goes anyway.
    let second = eventually(Duration::from_secs(5), || packs_sent(&gw) >= 2.0).await;
    let waited = started.elapsed();
    signal_cloud(&cloud, "-CONT");
    assert!(went, "the lone first message was written at once");
    assert!(
        second,
        "the second pack went within max_delay of its first record"
    );
    assert!(
        waited >= Duration::from_millis(350),
        "while the first partial pack is unacknowledged the next one waits (up to max_delay): went after {waited:?}"
    );
    let a = collect(
        &mut sub,
        3,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(a.packs, vec![1, 2], "the lone one, then both that waited");
    assert_eq!(a.per_device()[&2], vec![0, 1, 2]);
    for id in [id1, id2, id3] {
        assert_eq!(d.wait_ack(id.unwrap()).await.unwrap(), 0);
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_flush_max_delay_a_pack_that_does_not_fill_waits_for_max_delay_even_when_idle() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("sub", "#").await;
    let gw = gateway(
        1,
        &cloud.uplink_toml(
            None,
            &aggregate_toml(
                "",
                "min_devices = 0\nmax_pack = \"64KiB\"\nmax_delay = \"400ms\"\nflush = \"max_delay\"",
            ),
        ),
    );
    let mut d = device(&gw, "dev-t", ProtocolVersion::V311).await;
    let started = Instant::now();
    let id1 = d
        .publish_no_wait("t/t", payload(4, 0, 50), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let id2 = d
        .publish_no_wait("t/t", payload(4, 1, 50), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let a = collect(
        &mut sub,
        2,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(10),
    )
    .await;
    let waited = started.elapsed();
    assert_eq!(a.packs, vec![2], "both records in one pack");
    assert_eq!(a.per_device()[&4], vec![0, 1]);
    assert!(
        waited >= Duration::from_millis(350),
        "the timer rule: a pack below max_pack waits for max_delay: arrived after {waited:?}"
    );
    assert_eq!(d.wait_ack(id1.unwrap()).await.unwrap(), 0);
    assert_eq!(d.wait_ack(id2.unwrap()).await.unwrap(), 0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_flush_window_a_pack_waits_only_while_the_window_is_full() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("sub", "#").await;
    let gw = gateway(
        1,
        &cloud.uplink_toml(
            None,
            &aggregate_toml(
                "inflight = 2",
                "min_devices = 0\nmax_pack = \"64KiB\"\nmax_delay = \"10s\"\nflush = \"window\"",
            ),
        ),
    );
    let mut d = device(&gw, "dev-c", ProtocolVersion::V311).await;
    uplink_connected(&gw).await;
    signal_cloud(&cloud, "-STOP");
    let mut ids = Vec::new();
    // Two lone messages: the window (2) has room for both, so both go at once.
    for seq in 0..2u16 {
        ids.push(
            d.publish_no_wait("t/c", payload(3, seq, 50), QoS::AtLeastOnce, false)
                .await
                .unwrap(),
        );
        let n = f64::from(seq + 1);
        let went = eventually(Duration::from_secs(5), || packs_sent(&gw) >= n).await;
        if !went {
            signal_cloud(&cloud, "-CONT");
        }
        assert!(
            went,
            "message {seq} went at once although the first is unacknowledged"
        );
    }
    // The window is full now: the next three pack together until an ack frees a slot.
    for seq in 2..5u16 {
        ids.push(
            d.publish_no_wait("t/c", payload(3, seq, 50), QoS::AtLeastOnce, false)
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let while_full = packs_sent(&gw);
    signal_cloud(&cloud, "-CONT");
    assert_eq!(
        while_full, 2.0,
        "nothing more is written while the window is full"
    );
    let a = collect(
        &mut sub,
        5,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(a.packs, vec![1, 1, 3]);
    assert_eq!(a.per_device()[&3], vec![0, 1, 2, 3, 4]);
    for id in ids {
        assert_eq!(d.wait_ack(id.unwrap()).await.unwrap(), 0);
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_the_device_threshold_up_and_down_loses_and_reorders_nothing() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("sub", "#").await;
    // Aggregate while more than 3 devices are connected.
    let gw = gateway(
        2,
        &cloud.uplink_toml(
            None,
            &aggregate_toml(
                "",
                "min_devices = 3\nmax_pack = \"64KiB\"\nmax_delay = \"150ms\"",
            ),
        ),
    );
    let mut devs = Vec::new();
    for i in 0..2u8 {
        devs.push(device(&gw, &format!("cross-{i}"), ProtocolVersion::V5).await);
    }
    let mut seq = [0u16; 5];
    async fn round(devs: &mut [TestClient], seq: &mut [u16; 5], first: u8) {
        let mut pending = Vec::new();
        for (i, d) in devs.iter_mut().enumerate() {
            let dev = first + i as u8;
            for _ in 0..5 {
                let id = d
                    .publish_no_wait(
                        "t/x",
                        payload(dev, seq[dev as usize], 64),
                        QoS::AtLeastOnce,
                        false,
                    )
                    .await
                    .unwrap();
                seq[dev as usize] += 1;
                pending.push((i, id.unwrap()));
            }
        }
        for (i, id) in pending {
            assert_eq!(devs[i].wait_ack(id).await.unwrap(), 0);
        }
    }
    // 2 devices: below the threshold, sent one by one.
    round(&mut devs, &mut seq, 0).await;
    let below = collect(
        &mut sub,
        10,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(below.records.len(), 10);
    assert!(
        below.packs.is_empty(),
        "below the threshold nothing is packed"
    );

    // 4 devices: above it, packed. Devices 0 and 1 keep publishing across the crossing.
    for i in 2..4u8 {
        devs.push(device(&gw, &format!("cross-{i}"), ProtocolVersion::V311).await);
    }
    assert!(eventually(Duration::from_secs(5), || gw.status_json()["devices"] == 4).await);
    round(&mut devs, &mut seq, 0).await;
    let above = collect(
        &mut sub,
        20,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(above.records.len(), 20);
    assert!(
        above.records.iter().all(|r| r.2),
        "above the threshold everything is packed"
    );

    // Back to 2: one by one again.
    for d in devs.drain(2..) {
        d.disconnect().await.unwrap();
    }
    assert!(eventually(Duration::from_secs(5), || gw.status_json()["devices"] == 2).await);
    round(&mut devs, &mut seq, 0).await;
    let again = collect(
        &mut sub,
        10,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(again.records.len(), 10);
    assert!(
        again.packs.is_empty(),
        "below the threshold again nothing is packed"
    );

    // Per device: every message exactly once, in order, across both crossings.
    let mut all: HashMap<u8, Vec<u16>> = HashMap::new();
    for part in [&below, &above, &again] {
        for (d, s) in part.per_device() {
            all.entry(d).or_default().extend(s);
        }
    }
    for d in 0..4u8 {
        let want: Vec<u16> = (0..seq[d as usize]).collect();
        assert_eq!(all.get(&d).cloned().unwrap_or_default(), want, "device {d}");
    }
    assert!(
        tokio::time::timeout(
            Duration::from_millis(500),
            sub.recv(Duration::from_millis(500))
        )
        .await
        .map_or(true, |r| matches!(r, Ok(None))),
        "no duplicates trail behind"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_priority_bypasses_aggregation_and_travels_on_the_high_lane() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("sub", "#").await;
    let gw = gateway(
        1,
        &format!(
            "[priority]\ndevices = {{ \"ecg-*\" = 1 }}\ntopics = {{ \"alarms/#\" = 1 }}\n{}",
            cloud.uplink_toml(
                None,
                &aggregate_toml(
                    "",
                    "min_devices = 0\nmax_pack = \"64KiB\"\nmax_delay = \"20s\""
                ),
            )
        ),
    );
    let mut normal = device(&gw, "thermo-1", ProtocolVersion::V5).await;
    let mut ecg = device(&gw, "ecg-7", ProtocolVersion::V5).await;
    // A normal record goes in a pack (of one: the uplink is idle, so it does not wait) ...
    let held = normal
        .publish_no_wait("t/temp", payload(1, 0, 40), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    // ... while the high device's record and a normal device's alarm go on their own topics.
    assert_eq!(
        ecg.publish("ecg/7", payload(7, 0, 40), QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    let alarm = normal
        .publish_no_wait("alarms/fire", payload(1, 1, 40), QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let a = collect(
        &mut sub,
        3,
        "sluice/senml",
        Format::Json,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(a.records.len(), 3, "all three arrived");
    assert_eq!(a.packs, vec![1], "only the normal record came packed");
    let unpacked: Vec<(u8, u16)> = a
        .records
        .iter()
        .filter(|r| !r.2)
        .map(|r| (r.0, r.1))
        .collect();
    assert!(
        unpacked.contains(&(7, 0)) && unpacked.contains(&(1, 1)),
        "high records are never packed: {unpacked:?}"
    );

    let status = gw.status_json();
    let lanes = &status["shards"][0]["uplinks"][0]["lanes"];
    assert_eq!(lanes["high"]["state"], "connected", "{status}");
    // The cloud subscriber can see the records before the gateway has read the broker's
    // PUBACKs, so the acked counter may trail the arrivals by a moment.
    let carried = common::eventually(Duration::from_secs(5), || {
        common::metric_sum(
            &gw.metrics_text(),
            "sluice_uplink_messages_acked_total{shard=\"0\",uplink=\"cloud\",lane=\"high\"}",
        ) >= 2.0
    })
    .await;
    assert!(carried, "the high lane carried them");
    let _ = (held, alarm);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_sockets_carry_their_marks_as_read_back_from_the_kernel() {
    let cloud = Cloud::start();
    let gw = gateway(
        2,
        &format!(
            "[priority]\ndevices = {{ \"fire-1\" = 1 }}\n{}",
            cloud.uplink_toml(None, "notsent_lowat = \"8KiB\"")
        ),
    );
    let connected = eventually(Duration::from_secs(10), || {
        let s = gw.status_json();
        (0..2).all(|i| {
            let lanes = &s["shards"][i]["uplinks"][0]["lanes"];
            lanes["normal"]["state"] == "connected" && lanes["high"]["state"] == "connected"
        })
    })
    .await;
    assert!(
        connected,
        "both lanes of both shards connect: {}",
        gw.status_json()
    );
    let s = gw.status_json();
    for i in 0..2 {
        let lanes = &s["shards"][i]["uplinks"][0]["lanes"];
        let high = &lanes["high"]["socket"];
        assert_eq!(high["priority"], 6, "SO_PRIORITY of the high lane: {high}");
        assert_eq!(high["tos"], 0xB8, "DSCP EF of the high lane: {high}");
        let normal = &lanes["normal"]["socket"];
        assert_eq!(
            normal["notsent_lowat"], 8192,
            "TCP_NOTSENT_LOWAT of the normal lane: {normal}"
        );
        assert_eq!(normal["priority"], 0);
        assert_ne!(high["local_port"], normal["local_port"]);
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_priority_entries_there_is_no_high_lane() {
    let cloud = Cloud::start();
    let gw = gateway(1, &cloud.uplink_toml(None, ""));
    assert!(
        eventually(Duration::from_secs(10), || gw.status_json()["shards"][0]
            ["uplinks"][0]["state"]
            == "connected")
        .await
    );
    let lanes = &gw.status_json()["shards"][0]["uplinks"][0]["lanes"];
    assert!(lanes.get("high").is_none(), "{lanes}");
    gw.shutdown();
}

/// Aggregation is opt-in: with the default config and more devices than the old threshold
/// (50), a cloud application subscribed to its devices' topics gets every message, each on
/// its own topic, nothing on `sluice/senml`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_default_config_sixty_devices_each_reach_the_cloud_on_their_own_topic() {
    const DEVICES: u8 = 60;
    const PER_DEVICE: u16 = 5;
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("app", "#").await;
    let gw = gateway(2, &cloud.uplink_toml(None, ""));
    let mut devs = Vec::new();
    for i in 0..DEVICES {
        devs.push(device(&gw, &format!("meter-{i}"), ProtocolVersion::V311).await);
    }
    assert!(
        eventually(Duration::from_secs(10), || gw.status_json()["devices"]
            == u64::from(DEVICES))
        .await,
        "all devices connected before anyone publishes"
    );
    let mut pending = Vec::new();
    for seq in 0..PER_DEVICE {
        for (i, d) in devs.iter_mut().enumerate() {
            let id = d
                .publish_no_wait(
                    &format!("meters/{i}"),
                    payload(i as u8, seq, 8),
                    QoS::AtLeastOnce,
                    false,
                )
                .await
                .expect("publish sent");
            pending.push((i, id));
        }
    }
    let want = usize::from(DEVICES) * usize::from(PER_DEVICE);
    let mut per_topic: HashMap<String, Vec<u16>> = HashMap::new();
    let mut other_topics = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = 0;
    while got < want {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(p)) = sub.recv(left).await else {
            break;
        };
        got += 1;
        if let Some(i) = p.topic.strip_prefix("meters/") {
            let (d, s) = parse(&p.payload);
            assert_eq!(i, d.to_string(), "payload on its device's topic");
            per_topic.entry(p.topic.to_string()).or_default().push(s);
        } else {
            other_topics.push(p.topic.to_string());
        }
    }
    for (i, id) in pending {
        let id = id.expect("QoS 1 has a packet id");
        assert_eq!(devs[i].wait_ack(id).await.expect("PUBACK"), 0);
    }
    assert!(
        other_topics.is_empty(),
        "the cloud got {} publishes on other topics ({:?}...), not the devices' own",
        other_topics.len(),
        other_topics.first()
    );
    assert_eq!(
        per_topic.len(),
        usize::from(DEVICES),
        "every device's topic"
    );
    for (topic, seqs) in &per_topic {
        assert_eq!(
            seqs,
            &(0..PER_DEVICE).collect::<Vec<_>>(),
            "{topic}: every message, in order"
        );
    }
    gw.shutdown();
}
