//! End-to-end tests of the durable spool (`[spool]`) recovering from trouble, against a real
//! Mosquitto cloud broker over TLS 1.3 (certificates generated at test time): a spool of a
//! shard index no longer configured, a spool whose disk fails, records damaged on disk. The
//! cloud is "down" by closing a relay in front of it (`common::Gate`); the set-up is shared
//! with `gateway_spool.rs` (`spool_support`). Spools live in temporary directories with
//! `fsync = "never"`.

mod common;
mod spool_support;

use std::time::Duration;

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use spool_support::*;

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
    // The gateway may create a file in it while it is being removed (ENOTEMPTY): try again.
    let mut attempts = 0;
    while let Err(error) = std::fs::remove_dir_all(t.dir.path()) {
        attempts += 1;
        assert!(attempts < 20, "remove the spool directory: {error}");
        std::thread::sleep(Duration::from_millis(10));
    }
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
