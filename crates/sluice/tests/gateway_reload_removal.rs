//! Uplinks removed by a reload (issue 29 item 3, ADR 0013): a removed one stops receiving,
//! drains what it holds until `[reload] drain_timeout`, and what is left is acknowledged to its
//! devices (MQTT 5 reason 0x10) and counted; no device connection closes, nothing else slows.
//!
//! Real peers: cloud Mosquittos over TLS 1.3 (one behind a relay that can cut it), MQTT
//! devices on real sockets, certificates generated at test time.

mod common;
mod reload_support;

use std::time::{Duration, Instant};

use common::{Cloud, Gate};
use reload_support::*;
use sluice_proto::mqtt::QoS;
use sluice_testkit::{ConnectOpts, TestClient};

/// ADR 0013 step 6: an uplink whose broker is cut holds QoS 1 messages that devices wait
/// for; a reload removing it answers within the drain deadline, every waiting device gets its
/// PUBACK (an MQTT 5 device with reason 0x10), stays connected and goes on being acknowledged
/// by the other uplink; the count of what was acknowledged unsent is in the answer and in
/// `sluice_uplink_dropped_total{reason="uplink_removed"}`; the removed broker receives
/// nothing more, even once reachable again; the admin shows the uplink as removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_removes_an_uplink_whose_broker_is_cut_and_waiting_devices_are_acknowledged() {
    let first = Cloud::start();
    let second = Cloud::start();
    let gate = Gate::start(second.broker.tls_addr()).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second.uplink_toml_named(
        "second",
        "gw-second",
        Some(gate.addr),
        "forward = [\"a/#\", \"b/#\", \"c/#\"]",
    );
    let drain = "[reload]\ndrain_timeout = \"1s\"\n";
    std::fs::write(
        &path,
        base_config(dir.path(), &format!("{drain}{one}\n{two}")),
    )
    .unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_first = watch_cloud(first.subscriber("watch-1", "#").await);
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    let load = Load::start(gw.mqtt_addr, 4).await;
    wait_cloud(&seen_second, 0, 20, "messages on the second uplink", |_| {
        true
    })
    .await;

    // The second broker becomes unreachable: its queue holds what devices wait for.
    gate.set_open(false);
    let (mut v5, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("v5-device"))
        .await
        .expect("an MQTT 5 device connects");
    assert_eq!(ack.code, 0);
    v5.set_ack_timeout(Duration::from_secs(30));
    let waiting = v5
        .publish_no_wait("c/v5/1", "x", QoS::AtLeastOnce, false)
        .await
        .expect("publish")
        .expect("a packet id");
    let deadline = Instant::now() + Duration::from_secs(20);
    while uplink_sum(
        &metrics(admin_addr),
        "sluice_uplink_queue_messages",
        "second",
    ) < 5.0
    {
        assert!(
            Instant::now() < deadline,
            "the cut uplink's queue did not fill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen_before = seen_second.lock().unwrap().len();
    // A device whose topics only the remaining uplink carries keeps publishing through the
    // removal: its acknowledgements must not wait for the drain.
    let stop_fast = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fast = {
        let (mut c, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v311("fast"))
            .await
            .expect("the fast device connects");
        assert_eq!(ack.code, 0);
        let stop = stop_fast.clone();
        tokio::spawn(async move {
            let (mut n, mut slowest) = (0u64, Duration::ZERO);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                c.publish(&format!("z/fast/{n}"), "x", QoS::AtLeastOnce, false)
                    .await
                    .expect("the fast device is acknowledged");
                slowest = slowest.max(t.elapsed());
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (n, slowest)
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;

    std::fs::write(&path, base_config(dir.path(), &format!("{drain}{one}"))).unwrap();
    let asked = Instant::now();
    let (status, answer) = post_reload(admin_addr);
    let took = asked.elapsed();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    assert!(
        took < Duration::from_secs(6),
        "the reload answered {took:?} after it was asked (drain_timeout 1s)"
    );
    eprintln!("measured: removing the cut uplink answered after {took:?}: {answer}");
    let line = answer["applied"]
        .as_array()
        .expect("applied")
        .iter()
        .filter_map(|k| k.as_str())
        .find(|k| k.starts_with("uplink.second (removed"))
        .unwrap_or_else(|| panic!("the removal is named: {answer}"))
        .to_string();
    let unsent: f64 = line
        .trim_start_matches("uplink.second (removed: ")
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a count of messages acknowledged unsent: {line}"));
    assert!(unsent >= 5.0, "{line}");

    stop_fast.store(true, std::sync::atomic::Ordering::Relaxed);
    let (fast_n, slowest) = fast.await.expect("fast device task");
    eprintln!(
        "measured: a device on the remaining uplink's topics published {fast_n} QoS 1 messages during the removal; slowest PUBACK {slowest:?}"
    );
    assert!(fast_n > 20, "it kept publishing ({fast_n})");
    assert!(
        slowest < Duration::from_millis(500),
        "nothing else slows while the removed uplink drains: slowest PUBACK {slowest:?}"
    );
    // The MQTT 5 device gets its PUBACK, with 0x10 (accepted, no matching subscribers).
    let code = v5
        .wait_ack(waiting)
        .await
        .expect("a PUBACK after the removal");
    assert_eq!(code, 0x10);
    // Every device goes on being acknowledged (by the first uplink alone), none dropped.
    load.stop_and_check(10).await;
    v5.ping()
        .await
        .expect("the MQTT 5 device is still connected");
    assert_eq!(
        v5.publish("c/v5/2", "x", QoS::AtLeastOnce, false)
            .await
            .expect("publish"),
        0,
        "a later message is acknowledged by the remaining uplink"
    );
    let text = metrics(admin_addr);
    assert_eq!(
        removed_unsent(&text, "second"),
        unsent,
        "counted like answered"
    );

    // The removed broker receives nothing more, even once it is reachable again.
    gate.set_open(true);
    let mark = seen_first.lock().unwrap().len();
    let load = Load::start(gw.mqtt_addr, 2).await;
    wait_cloud(
        &seen_first,
        mark,
        20,
        "messages on the first uplink",
        |_| true,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    load.stop_and_check(5).await;
    assert_eq!(
        seen_second.lock().unwrap().len(),
        seen_before,
        "the removed uplink's broker got nothing after the reload"
    );
    let status_json = gw.status_json();
    let second_entry = status_json["shards"][0]["uplinks"]
        .as_array()
        .expect("uplinks")
        .iter()
        .find(|u| u["name"] == "second")
        .cloned()
        .unwrap_or_else(|| panic!("the removed uplink is listed: {status_json}"));
    assert_eq!(second_entry["lifecycle"], "removed", "{status_json}");
    assert_eq!(second_entry["id"], 1, "{status_json}");
    // The overview (dashboard, `sluice status`) lists it with its id, lifecycle and count.
    // (computed each tick: a later one shows it)
    let deadline = Instant::now() + Duration::from_secs(10);
    let overview = loop {
        let (_, body) =
            admin(admin_addr, "GET", "/api/v1/overview", Some(TOKEN)).expect("overview");
        let doc: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        if doc["uplinks"][1]["lifecycle"] == "removed" || Instant::now() > deadline {
            break doc;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let listed: Vec<(u64, String, String)> = overview["uplinks"]
        .as_array()
        .expect("uplinks")
        .iter()
        .map(|u| {
            (
                u["id"].as_u64().unwrap_or(99),
                u["name"].as_str().unwrap_or("?").to_string(),
                u["lifecycle"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            (0, "cloud".to_string(), "running".to_string()),
            (1, "second".to_string(), "removed".to_string())
        ],
        "{overview}"
    );
    assert_eq!(
        overview["uplinks"][1]["removed_unsent"].as_f64(),
        Some(unsent),
        "{overview}"
    );
    let text = metrics(admin_addr);
    assert!(
        text.lines()
            .any(|l| l == "sluice_uplinks{lifecycle=\"removed\"} 1"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l == "sluice_uplinks{lifecycle=\"running\"} 1"),
        "{text}"
    );
    // Readiness waits for the running uplink only.
    let (code, ready) = admin(admin_addr, "GET", "/readyz", Some(TOKEN)).expect("readyz");
    assert_eq!(code, 200, "ready with the removed uplink ignored: {ready}");
    gw.shutdown();
}

/// ADR 0013, removal with a spool under `ack = "cloud"`: devices wait for the cut uplink's
/// cloud ack; the reload removes it; they get their PUBACK (0x10) and stay connected; the
/// removed uplink's spool directory stays on disk holding what it did not send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_spooled_uplink_acknowledges_its_waiting_devices_and_keeps_its_spool_on_disk() {
    let first = Cloud::start();
    let second = Cloud::start();
    let gate = Gate::start(second.broker.tls_addr()).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let spool = dir.path().join("spool");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second.uplink_toml_named("second", "gw-second", Some(gate.addr), "forward = [\"#\"]");
    let more = format!(
        "[reload]\ndrain_timeout = \"1s\"\n[spool]\ndir = \"{}\"\nack = \"cloud\"\n",
        spool.display()
    );
    std::fs::write(
        &path,
        base_config(dir.path(), &format!("{more}{one}\n{two}")),
    )
    .unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    let load = Load::start(gw.mqtt_addr, 4).await;
    wait_cloud(&seen_second, 0, 20, "messages on the second uplink", |_| {
        true
    })
    .await;
    gate.set_open(false);
    let (mut v5, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("v5-spooled"))
        .await
        .expect("an MQTT 5 device connects");
    assert_eq!(ack.code, 0);
    v5.set_ack_timeout(Duration::from_secs(30));
    let waiting = v5
        .publish_no_wait("c/v5/1", "x", QoS::AtLeastOnce, false)
        .await
        .expect("publish")
        .expect("a packet id");
    // The devices wait: the second uplink's spool holds records it cannot send.
    let deadline = Instant::now() + Duration::from_secs(20);
    while uplink_sum(
        &metrics(admin_addr),
        "sluice_spool_unacked_records",
        "second",
    ) < 5.0
    {
        assert!(
            Instant::now() < deadline,
            "the cut uplink's spool did not hold records:\n{}",
            metrics(admin_addr)
                .lines()
                .filter(|l| l.starts_with("sluice_spool_"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    std::fs::write(&path, base_config(dir.path(), &format!("{more}{one}"))).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert!(
        answer["applied"]
            .as_array()
            .expect("applied")
            .iter()
            .filter_map(|k| k.as_str())
            .any(|k| k.starts_with("uplink.second (removed: ")),
        "{answer}"
    );
    assert_eq!(
        v5.wait_ack(waiting)
            .await
            .expect("a PUBACK after the removal"),
        0x10
    );
    load.stop_and_check(10).await;
    v5.ping()
        .await
        .expect("the MQTT 5 device is still connected");
    assert!(removed_unsent(&metrics(admin_addr), "second") >= 5.0);
    // Its spool is left on disk with what it did not send.
    let shard0 = spool.join("second").join("shard-0");
    let files = std::fs::read_dir(&shard0)
        .unwrap_or_else(|e| panic!("{} is still there: {e}", shard0.display()))
        .count();
    assert!(files > 0, "{} holds its segments", shard0.display());
    gw.shutdown();
}

/// ADR 0013: an uplink the gateway started with, removed by one reload and added back by the
/// next, runs again under a new id (ids are never reused) and its broker receives again; the
/// same file once more changes nothing (no restart named for the settings it started with).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uplink_removed_and_added_back_runs_again_under_a_new_id() {
    let first = Cloud::start();
    let second = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second.uplink_toml_named("second", "gw-second", None, "forward = [\"#\"]");
    let drain = "[reload]\ndrain_timeout = \"2s\"\n";
    let both = base_config(dir.path(), &format!("{drain}{one}\n{two}"));
    std::fs::write(&path, &both).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    let load = Load::start(gw.mqtt_addr, 2).await;
    wait_cloud(&seen_second, 0, 10, "messages on the second uplink", |_| {
        true
    })
    .await;

    std::fs::write(&path, base_config(dir.path(), &format!("{drain}{one}"))).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    // Messages on their way from the broker to the watcher land before the mark.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mark = seen_second.lock().unwrap().len();

    std::fs::write(&path, &both).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "uplink.second (added)", "{answer}");
    wait_cloud(
        &seen_second,
        mark,
        10,
        "messages after it was added back",
        |_| true,
    )
    .await;
    let status_json = gw.status_json();
    let entries: Vec<(u64, String)> = status_json["shards"][0]["uplinks"]
        .as_array()
        .expect("uplinks")
        .iter()
        .map(|u| {
            (
                u["id"].as_u64().unwrap_or(99),
                u["lifecycle"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    assert_eq!(
        entries,
        [(0, "running".to_string()), (2, "running".to_string())],
        "one entry per name, the added one with a new id: {status_json}"
    );
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "unchanged", "{answer}");
    load.stop_and_check(5).await;
    gw.shutdown();
}

/// ADR 0013: what a removed uplink already holds is sent while the drain lasts. Its broker is
/// cut, so its queue holds what devices wait for; the reload removing it starts, the broker
/// becomes reachable again during the drain: the held messages reach it, the devices get a
/// plain PUBACK (0, not 0x10), and nothing is acknowledged unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_uplink_sends_what_it_holds_while_the_drain_lasts() {
    let first = Cloud::start();
    let second = Cloud::start();
    let gate = Gate::start(second.broker.tls_addr()).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second.uplink_toml_named("second", "gw-second", Some(gate.addr), "forward = [\"#\"]");
    let drain = "[reload]\ndrain_timeout = \"20s\"\n";
    std::fs::write(
        &path,
        base_config(dir.path(), &format!("{drain}{one}\n{two}")),
    )
    .unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    let load = Load::start(gw.mqtt_addr, 2).await;
    wait_cloud(&seen_second, 0, 10, "messages on the second uplink", |_| {
        true
    })
    .await;
    gate.set_open(false);
    let (mut v5, ack) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v5("v5-drained"))
        .await
        .expect("an MQTT 5 device connects");
    assert_eq!(ack.code, 0);
    v5.set_ack_timeout(Duration::from_secs(30));
    let waiting = v5
        .publish_no_wait("c/v5/held", "x", QoS::AtLeastOnce, false)
        .await
        .expect("publish")
        .expect("a packet id");
    let deadline = Instant::now() + Duration::from_secs(20);
    while uplink_sum(
        &metrics(admin_addr),
        "sluice_uplink_queue_messages",
        "second",
    ) < 3.0
    {
        assert!(
            Instant::now() < deadline,
            "the cut uplink's queue did not fill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    std::fs::write(&path, base_config(dir.path(), &format!("{drain}{one}"))).unwrap();
    let asked = Instant::now();
    let reload = tokio::task::spawn_blocking(move || post_reload(admin_addr));
    // The broker comes back while the removed uplink drains.
    tokio::time::sleep(Duration::from_millis(500)).await;
    gate.set_open(true);
    let (_, answer) = reload.await.expect("reload task");
    let took = asked.elapsed();
    eprintln!("measured: the drained removal answered after {took:?}: {answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "uplink.second (removed)", "{answer}");
    assert!(
        took < Duration::from_secs(15),
        "it answered once drained, before the 20s deadline ({took:?})"
    );
    assert_eq!(
        v5.wait_ack(waiting).await.expect("a PUBACK"),
        0,
        "sent before the deadline: a plain PUBACK"
    );
    // The held message reached the removed uplink's broker.
    wait_cloud(&seen_second, 0, 1, "the held message", |t| t == "c/v5/held").await;
    assert_eq!(removed_unsent(&metrics(admin_addr), "second"), 0.0);
    load.stop_and_check(5).await;
    gw.shutdown();
}
