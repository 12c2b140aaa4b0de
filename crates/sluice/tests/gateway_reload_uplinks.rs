//! Uplinks added by a reload (issue 29 item 3, ADR 0013): an added uplink's broker starts
//! receiving while devices keep publishing; with a spool it gets its share of
//! `[spool] max_size`; what cannot be added live (`install_tc`) is named and not attached.
//! Removals: `gateway_reload_removal.rs`.
//!
//! Real peers: cloud Mosquittos over TLS 1.3, MQTT devices on real sockets, certificates
//! generated at test time.

mod common;
mod reload_support;

use std::time::{Duration, Instant};

use common::Cloud;
use reload_support::*;
use sluice_testkit::TestPki;

/// ADR 0013 step 4: a reload under load adds a second uplink; the new cloud broker starts
/// receiving, the first keeps receiving, no device is dropped or stalled, the admin lists it,
/// and a second reload of the same file does not attach it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_under_load_adds_an_uplink_and_its_broker_starts_receiving() {
    let first = Cloud::start();
    let second = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second.uplink_toml_named("second", "gw-second", None, "forward = [\"#\"]");
    std::fs::write(&path, base_config(dir.path(), &one)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_first = watch_cloud(first.subscriber("watch-1", "#").await);
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    let load = Load::start(gw.mqtt_addr, 4).await;
    wait_cloud(&seen_first, 0, 20, "messages before the reload", |_| true).await;
    assert!(since(&seen_second, 0).is_empty(), "no second uplink yet");

    std::fs::write(&path, base_config(dir.path(), &format!("{one}\n{two}"))).unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "uplink.second (added)", "{answer}");

    // The new broker receives devices' messages; the first one keeps receiving.
    let mark = seen_first.lock().unwrap().len();
    wait_cloud(&seen_second, 0, 40, "messages on the added uplink", |_| {
        true
    })
    .await;
    wait_cloud(
        &seen_first,
        mark,
        40,
        "messages on the first uplink after the reload",
        |_| true,
    )
    .await;
    // Every device keeps being acknowledged (now by both clouds), none was disconnected.
    load.stop_and_check(10).await;

    let status_json = gw.status_json();
    for shard in status_json["shards"].as_array().expect("shards") {
        let names: Vec<&str> = shard["uplinks"]
            .as_array()
            .expect("uplinks")
            .iter()
            .filter_map(|u| u["name"].as_str())
            .collect();
        assert_eq!(names, ["cloud", "second"], "{status_json}");
        // Stable ids (the started uplink 0, the added one the next), both running.
        assert_eq!(shard["uplinks"][1]["id"], 1, "{status_json}");
        assert_eq!(shard["uplinks"][1]["lifecycle"], "running", "{status_json}");
    }
    assert!(
        metrics(admin_addr).contains("uplink=\"second\""),
        "the added uplink's series are in /metrics"
    );

    // The same file again: nothing to do (not attached twice, not named as needing a restart).
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "unchanged", "{answer}");
    // The added uplink's forward filters change live like any other's.
    let two_a = two.replace("forward = [\"#\"]", "forward = [\"a/#\"]");
    std::fs::write(&path, base_config(dir.path(), &format!("{one}\n{two_a}"))).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "uplink.second.forward", "{answer}");
    // Messages of the first load still on their way from the broker to the watcher land
    // before the mark.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mark = seen_second.lock().unwrap().len();
    let load = Load::start(gw.mqtt_addr, 2).await;
    wait_cloud(
        &seen_second,
        mark,
        20,
        "a/ messages on the added uplink",
        |t| t.starts_with("a/"),
    )
    .await;
    assert!(
        since(&seen_second, mark)
            .iter()
            .all(|t| t.starts_with("a/")),
        "only a/ after the filter change: {:?}",
        since(&seen_second, mark)
    );
    // Removed again under load while its broker is reachable: what it holds is sent before
    // the deadline (nothing acknowledged unsent), devices stay connected and acknowledged.
    std::fs::write(
        &path,
        base_config(
            dir.path(),
            &format!("{one}\n[reload]\ndrain_timeout = \"5s\"\n"),
        ),
    )
    .unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert!(
        answer["applied"]
            .as_array()
            .expect("applied")
            .iter()
            .any(|k| k == "uplink.second (removed)"),
        "{answer}"
    );
    load.stop_and_check(5).await;
    assert_eq!(removed_unsent(&metrics(admin_addr), "second"), 0.0);
    gw.shutdown();
}

/// ADR 0013: an added uplink whose certificate cannot be read refuses the whole reload;
/// nothing is attached and the other changes of the same file are not applied either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_uplink_with_an_unreadable_ca_refuses_the_reload_and_nothing_changes() {
    let first = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    std::fs::write(&path, base_config(dir.path(), &one)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let bad_ca = dir.path().join("not-a-ca.pem");
    std::fs::write(&bad_ca, "not a certificate\n").unwrap();
    let two = first
        .uplink_toml_named("second", "gw-second", None, "forward = [\"#\"]")
        .replace(
            &first.pki.ca_path().display().to_string(),
            &bad_ca.display().to_string(),
        );
    let one_changed = one.replace("forward = [\"#\"]", "forward = [\"a/#\"]");
    std::fs::write(
        &path,
        base_config(dir.path(), &format!("{one_changed}\n{two}")),
    )
    .unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["result"], "invalid", "{answer}");
    assert!(
        answer["error"].as_str().unwrap_or("").contains("ca_file"),
        "the reason names the setting: {answer}"
    );
    let status_json = gw.status_json();
    let names: Vec<&str> = status_json["shards"][0]["uplinks"]
        .as_array()
        .expect("uplinks")
        .iter()
        .filter_map(|u| u["name"].as_str())
        .collect();
    assert_eq!(names, ["cloud"], "nothing attached: {status_json}");
    // The same change without the bad uplink applies (the forward change was not half-applied).
    std::fs::write(&path, base_config(dir.path(), &one_changed)).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["applied"][0], "uplink.cloud.forward", "{answer}");
    gw.shutdown();
}

/// ADR 0013: with `[spool] dir` an added uplink gets a spool on every shard. Each shard's
/// spools share `max_size / shards`: the running uplink's spool is lowered to the new share,
/// and since it holds more than that (its cloud is away), the new spool's bound is the share
/// minus that excess, so the two stay within the shard's budget. The added uplink's broker
/// receives what devices publish to its topics, through its spool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_spool_an_added_uplink_gets_a_spool_within_max_size() {
    const MIB: f64 = 1024.0 * 1024.0;
    let second = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    // The first uplink's cloud is away (nothing listens there): what devices publish to its
    // topics stays in its spool.
    let away = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let head = format!(
        "[gateway]\nshards = 2\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\nmax_packet_size = \"64KiB\"\n[coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n[spool]\ndir = \"{}\"\nmax_size = \"4MiB\"\nsegment_size = \"128KiB\"\n[[uplink]]\nname = \"cloud\"\nurl = \"mqtt://{away}\"\nclient_id = \"gw-away\"\nallow_plaintext = true\nforward = [\"fill/#\"]\nreconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n",
        token.display(),
        dir.path().join("spool").display()
    );
    std::fs::write(&path, &head).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    // 1.5 MiB into each shard's spool (a device per shard), acknowledged after its commit.
    let ids = common::ids_on_shards("fill", 2, 1);
    for id in ids.iter().flatten() {
        let (mut c, ack) = sluice_testkit::TestClient::connect(
            gw.mqtt_addr,
            sluice_testkit::ConnectOpts::v311(id.clone()),
        )
        .await
        .expect("connect");
        assert_eq!(ack.code, 0);
        for n in 0..48 {
            c.publish(
                &format!("fill/{id}/{n}"),
                vec![b'f'; 32 * 1024],
                sluice_proto::mqtt::QoS::AtLeastOnce,
                false,
            )
            .await
            .expect("acknowledged after the spool commit");
        }
    }
    let text = metrics(admin_addr);
    assert_eq!(
        uplink_sum(&text, "sluice_spool_max_bytes", "cloud"),
        4.0 * MIB,
        "one uplink: each shard's spool has the shard's 2 MiB"
    );

    let two = second.uplink_toml_named("second", "gw-second", None, "forward = [\"live/#\"]");
    std::fs::write(&path, format!("{head}\n{two}")).unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "uplink.second (added)", "{answer}");
    for shard in 0..2 {
        assert!(
            dir.path()
                .join(format!("spool/second/shard-{shard}"))
                .is_dir(),
            "the added uplink's spool directory on shard {shard}"
        );
    }

    let text = metrics(admin_addr);
    for shard in 0..2 {
        let value = |name: &str, uplink: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(&format!("{name}{{")))
                .filter(|l| l.contains(&format!("shard=\"{shard}\"")))
                .filter(|l| l.contains(&format!("uplink=\"{uplink}\"")))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let held = value("sluice_spool_bytes", "cloud");
        let cloud_max = value("sluice_spool_max_bytes", "cloud");
        let second_max = value("sluice_spool_max_bytes", "second");
        println!(
            "shard {shard}: cloud holds {held} B (bound {cloud_max}), second's bound {second_max}"
        );
        assert_eq!(cloud_max, MIB, "shard {shard}: the share of two spools");
        assert!(
            held > MIB,
            "shard {shard}: the away cloud's spool holds {held}"
        );
        assert!(
            second_max < MIB && second_max >= 256.0 * 1024.0,
            "shard {shard}: the new spool's bound {second_max} is the share minus the excess"
        );
        assert!(
            held + second_max <= 2.0 * MIB,
            "shard {shard}: {held} + {second_max} within the shard's 2 MiB"
        );
    }

    // The added uplink's broker receives, through its spool.
    let seen = watch_cloud(second.subscriber("watch-2", "#").await);
    let mut c = common::device(&gw, "live-1", sluice_proto::mqtt::ProtocolVersion::V311).await;
    for n in 0..20 {
        c.publish(
            &format!("live/{n}"),
            &b"x"[..],
            sluice_proto::mqtt::QoS::AtLeastOnce,
            false,
        )
        .await
        .expect("publish");
    }
    wait_cloud(&seen, 0, 20, "messages on the added uplink", |_| true).await;
    let text = metrics(admin_addr);
    assert!(
        uplink_sum(&text, "sluice_spool_records_appended_total", "second") >= 20.0,
        "the added uplink's messages went through its spool"
    );
    gw.shutdown();
}

/// ADR 0013: an uplink a reload added has its certificates reloaded like the others': added
/// trusting the wrong CA it cannot connect; the right CA under the same file name and a reload
/// make its next connect succeed, and its broker receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_uplinks_roots_are_reloaded_at_its_next_connect() {
    let first = Cloud::start();
    let second = Cloud::start();
    let stranger = TestPki::generate();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let ca = dir.path().join("second-ca.pem");
    std::fs::copy(stranger.ca_path(), &ca).unwrap();
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second
        .uplink_toml_named("second", "gw-second", None, "forward = [\"#\"]")
        .replace(
            &format!("ca_file = \"{}\"", second.pki.ca_path().display()),
            &format!("ca_file = \"{}\"", ca.display()),
        );
    std::fs::write(&path, base_config(dir.path(), &one)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    std::fs::write(&path, base_config(dir.path(), &format!("{one}\n{two}"))).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["applied"][0], "uplink.second (added)", "{answer}");
    let load = Load::start(gw.mqtt_addr, 1).await;
    // The stranger CA: its sessions fail to connect (every shard's, repeatedly).
    let failures = |text: &str| {
        text.lines()
            .filter(|l| {
                l.starts_with("sluice_uplink_connect_failures_total")
                    && l.contains("uplink=\"second\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while failures(&metrics(admin_addr)) < 3.0 {
        assert!(
            Instant::now() < deadline,
            "the added uplink's connects did not fail"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(since(&seen_second, 0).is_empty(), "nothing reached it");
    // The right CA under the same name.
    std::fs::copy(second.pki.ca_path(), &ca).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(
        answer["applied"][0], "uplink.second certificates (next connect)",
        "{answer}"
    );
    wait_cloud(
        &seen_second,
        0,
        10,
        "messages once the roots are right",
        |_| true,
    )
    .await;
    load.stop_and_check(5).await;
    gw.shutdown();
}

/// ADR 0013: an uplink with `paths` (multipath: one session per path, here two loopback
/// source addresses) is attached live; its broker receives over both paths' sessions and the
/// status lists its paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_an_uplink_with_paths_and_its_broker_starts_receiving() {
    let first = Cloud::start();
    let second = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = first.uplink_toml(None, "forward = [\"#\"]");
    let two = second.uplink_toml_named(
        "second",
        "gw-second",
        None,
        "forward = [\"#\"]\npaths = [{ name = \"p2\", bind = \"127.0.0.2\" }, { name = \"p3\", bind = \"127.0.0.3\" }]\npath_timeout = \"1s\"\npath_keep_alive = \"500ms\"\npath_reconnect_max = \"300ms\"",
    );
    std::fs::write(&path, base_config(dir.path(), &one)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen_second = watch_cloud(second.subscriber("watch-2", "#").await);
    let load = Load::start(gw.mqtt_addr, 2).await;
    std::fs::write(&path, base_config(dir.path(), &format!("{one}\n{two}"))).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "uplink.second (added)", "{answer}");
    wait_cloud(&seen_second, 0, 20, "messages over the added paths", |_| {
        true
    })
    .await;
    load.stop_and_check(5).await;
    let status_json = gw.status_json();
    let second_entry = status_json["shards"][0]["uplinks"]
        .as_array()
        .expect("uplinks")
        .iter()
        .find(|u| u["name"] == "second")
        .cloned()
        .unwrap_or_else(|| panic!("the added uplink is listed: {status_json}"));
    let paths = second_entry["lanes"]["normal"]["paths"].to_string();
    assert!(
        paths.contains("p2") && paths.contains("p3"),
        "its paths are shown: {second_entry}"
    );
    gw.shutdown();
}

/// ADR 0013: an added uplink with `install_tc = true` is not attached live (its tc tree is
/// installed with privileges at start); the reload names it and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_uplink_with_install_tc_waits_for_a_restart() {
    let first = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let one = format!(
        "[priority]\ndevices = {{ \"alarm-*\" = 1 }}\n{}",
        first.uplink_toml(None, "forward = [\"#\"]")
    );
    std::fs::write(&path, base_config(dir.path(), &one)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let two = first.uplink_toml_named(
        "second",
        "gw-second",
        None,
        "forward = [\"#\"]\ninstall_tc = true\ntc_rate = \"10mbit\"",
    );
    std::fs::write(&path, base_config(dir.path(), &format!("{one}\n{two}"))).unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "restart_needed", "{answer}");
    assert!(
        answer["restart_needed"]
            .as_array()
            .expect("restart_needed")
            .iter()
            .any(|k| k == "uplink.second (added)"),
        "{answer}"
    );
    let status_json = gw.status_json();
    assert_eq!(
        status_json["shards"][0]["uplinks"]
            .as_array()
            .expect("uplinks")
            .len(),
        1,
        "nothing attached: {status_json}"
    );
    gw.shutdown();
}
