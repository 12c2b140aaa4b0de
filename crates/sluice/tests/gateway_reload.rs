//! Reload without restart (issue 29 item 3): `SIGHUP` and `POST /api/v1/reload` re-read the
//! config file and apply what can change live while devices keep publishing; a broken file
//! is refused with its reason and changes nothing; what needs a restart is reported.
//!
//! Real peers: the `sluice run` process (SIGHUP), a cloud Mosquitto over TLS 1.3, MQTT
//! devices on real sockets, certificates generated at test time.

//! Uplinks added and removed by a reload: `gateway_reload_uplinks.rs`.

mod common;
mod reload_support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Cloud;
use reload_support::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, TestClient, TestPki};

/// Kills the child if the test ends early.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait (up to 20 s) until `/metrics` has `line`.
fn wait_for_metric(addr: SocketAddr, line: &str, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice exited ({status}) while waiting for {line}");
        }
        let text = metrics(addr);
        if text.lines().any(|l| l == line) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no {line} in /metrics within 20 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sum of the `sluice_uplink_messages_acked_total` lines of `lane`.
fn acked_on_lane(text: &str, lane: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("sluice_uplink_messages_acked_total{"))
        .filter(|l| l.contains(&format!("lane=\"{lane}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn hup(child: &Child) {
    let pid = i32::try_from(child.id()).expect("a pid fits i32");
    // SAFETY: kill(2) on our own child's pid; no memory is shared.
    let rc = unsafe { libc::kill(pid, libc::SIGHUP) };
    assert_eq!(rc, 0, "kill -HUP");
}

struct Ports {
    mqtt: u16,
    admin: u16,
}

fn write_config(path: &Path, ports: &Ports, token: &Path, uplink: &str, more: &str) {
    std::fs::write(
        path,
        format!(
            "[gateway]\nshards = 2\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:{}\"\n[coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:{}\"\ntoken_file = \"{}\"\n{more}\n{uplink}",
            ports.mqtt,
            ports.admin,
            token.display()
        ),
    )
    .expect("write the config");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_changes_filters_mapping_and_priority_without_dropping_a_device() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, log, token) = (
        dir.path().join("sluice.toml"),
        dir.path().join("sluice.log"),
        dir.path().join("token"),
    );
    std::fs::write(&token, TOKEN).expect("write the token");
    let ports = Ports {
        mqtt: sluice_testkit::free_port().expect("a free port"),
        admin: sluice_testkit::free_port().expect("a free port"),
    };
    let mqtt = SocketAddr::from(([127, 0, 0, 1], ports.mqtt));
    let admin_addr = SocketAddr::from(([127, 0, 0, 1], ports.admin));
    // Before: only a/# goes to the cloud, unchanged; a high lane exists (one priority-1
    // device, not among the load) but carries nothing.
    let before_uplink = cloud.uplink_toml(None, "forward = [\"a/#\"]");
    let before_more = "[priority.devices]\n\"nobody\" = 1\n";
    write_config(&config, &ports, &token, &before_uplink, before_more);
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "-c"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .stdout(std::fs::File::create(&log).expect("log file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("start sluice");
    let mut guard = Guard(child);
    wait_for_metric(
        admin_addr,
        "sluice_reloads_total{result=\"unchanged\"} 0",
        &mut guard.0,
    );
    let seen = watch_cloud(cloud.subscriber("watch", "#").await);
    let load = Load::start(mqtt, 32).await;

    wait_cloud(&seen, 0, 40, "a/ messages", |t| t.starts_with("a/")).await;
    let before = since(&seen, 0);
    assert!(
        before.iter().all(|t| t.starts_with("a/")),
        "before the reload only a/# is forwarded: {:?}",
        before.iter().find(|t| !t.starts_with("a/"))
    );
    assert_eq!(acked_on_lane(&metrics(admin_addr), "high"), 0.0);

    // 1. SIGHUP: forward b/# under site/, and every load device is priority 1.
    let after_uplink = cloud.uplink_toml(None, "forward = [\"b/#\"]\ntopic_prefix = \"site/\"");
    let after_more = "[priority.devices]\n\"load-*\" = 1\n";
    write_config(&config, &ports, &token, &after_uplink, after_more);
    hup(&guard.0);
    wait_for_metric(
        admin_addr,
        "sluice_reloads_total{result=\"applied\"} 1",
        &mut guard.0,
    );
    // Messages queued before the reload may still leave; then only site/b/ ones.
    let first = wait_cloud(&seen, 0, 1, "site/b/ messages", |t| {
        t.starts_with("site/b/")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mark = seen.lock().unwrap().len().max(first);
    wait_cloud(&seen, mark, 40, "site/b/ messages", |t| {
        t.starts_with("site/b/")
    })
    .await;
    let after = since(&seen, mark);
    assert!(
        after.iter().all(|t| t.starts_with("site/b/load-")),
        "after the reload only b/# is forwarded, under site/: {:?}",
        after.iter().find(|t| !t.starts_with("site/b/"))
    );
    // The priority table changed under connected devices: their messages take the high lane.
    let deadline = Instant::now() + Duration::from_secs(10);
    while acked_on_lane(&metrics(admin_addr), "high") < 20.0 {
        assert!(
            Instant::now() < deadline,
            "the high lane did not carry the load devices' messages:\n{}",
            metrics(admin_addr)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // 2. POST, a broken file: refused with its reason; nothing changes.
    std::fs::write(
        &config,
        format!(
            "{}\n[mqtt]\nno_such_key = 1\n",
            std::fs::read_to_string(&config).unwrap()
        ),
    )
    .expect("write a broken config");
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["result"], "invalid", "{answer}");
    let error = answer["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("mqtt") && (error.contains("no_such_key") || error.contains("duplicate")),
        "the reason names the problem: {answer}"
    );
    let mark = seen.lock().unwrap().len();
    wait_cloud(&seen, mark, 20, "site/b/ messages", |t| {
        t.starts_with("site/b/")
    })
    .await;
    assert!(
        since(&seen, mark)
            .iter()
            .all(|t| t.starts_with("site/b/load-")),
        "a refused file changes nothing: {:?}",
        since(&seen, mark)
    );
    wait_for_metric(
        admin_addr,
        "sluice_reloads_total{result=\"invalid\"} 1",
        &mut guard.0,
    );

    // 3. POST without the token: refused before anything is read (ADR 0010).
    let (status, _) = admin(admin_addr, "POST", "/api/v1/reload", None).expect("POST");
    assert_eq!(status, 401);

    // 4. POST, a restart-only change (another listen address) with a live one (the log
    //    level): the first reported, the second applied; devices still connect where they
    //    did.
    let moved = Ports {
        mqtt: sluice_testkit::free_port().expect("a free port"),
        admin: ports.admin,
    };
    write_config(
        &config,
        &moved,
        &token,
        &after_uplink,
        &format!("{after_more}[log]\nlevel = \"debug\"\n"),
    );
    let asked = Instant::now();
    let (status, answer) = post_reload(admin_addr);
    eprintln!(
        "measured: POST /api/v1/reload under load answered in {:?}",
        asked.elapsed()
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "restart_needed", "{answer}");
    let named = |list: &str, key: &str| {
        answer[list]
            .as_array()
            .is_some_and(|a| a.iter().any(|k| k == key))
    };
    assert!(named("restart_needed", "mqtt.listen"), "{answer}");
    assert!(named("applied", "log.level"), "{answer}");
    let (probe, ack) = TestClient::connect(mqtt, ConnectOpts::v311("probe"))
        .await
        .expect("the running listener still accepts");
    assert_eq!(ack.code, 0);
    // The new log level is in force: a device leaving is logged at DEBUG.
    probe.disconnect().await.expect("DISCONNECT");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !strip_ansi(&std::fs::read_to_string(&log).unwrap_or_default())
        .lines()
        .any(|l| {
            l.contains("DEBUG") && l.contains("device connection closed") && l.contains("probe")
        })
    {
        assert!(
            Instant::now() < deadline,
            "no DEBUG line after log.level = \"debug\" was applied"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    load.stop_and_check(10).await;
    let text = strip_ansi(&std::fs::read_to_string(&log).expect("read the log"));
    for wanted in [
        "configuration reloaded: every change is in force",
        "configuration reload refused",
        "restart_needed=mqtt.listen",
    ] {
        assert!(text.contains(wanted), "no {wanted:?} in the log:\n{text}");
    }
    assert!(
        guard.0.try_wait().expect("try_wait").is_none(),
        "sluice still runs"
    );
}

/// `text` without terminal colour sequences (`ESC [ … m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_and_acl_changes_apply_to_new_connects_and_connected_devices_stay() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let acl = dir.path().join("acl.toml");
    let hash = |p: &str| sluice::control::admission::hash_password(p.as_bytes()).unwrap();
    let alice = format!(
        "[[mqtt.users]]\nusername = \"alice\"\npassword_hash = \"{}\"\n",
        hash("alice-pw")
    );
    let bob = format!(
        "[[mqtt.users]]\nusername = \"bob\"\npassword_hash = \"{}\"\n",
        hash("bob-pw")
    );
    std::fs::write(&acl, "").expect("write the ACL file");
    let acl_section = format!("[acl]\nfile = \"{}\"\n", acl.display());
    std::fs::write(
        &path,
        base_config(dir.path(), &format!("{acl_section}{alice}")),
    )
    .unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let login = |id: &str, user: &str, pw: &str| {
        let mut opts = ConnectOpts::v5(id);
        opts.username = Some(user.to_string());
        opts.password = Some(bytes::Bytes::copy_from_slice(pw.as_bytes()));
        opts
    };
    let (mut a, ack) = TestClient::connect(gw.mqtt_addr, login("dev-a", "alice", "alice-pw"))
        .await
        .expect("alice connects");
    assert_eq!(ack.code, 0);
    let (_, ack) = TestClient::connect(gw.mqtt_addr, login("dev-b", "bob", "bob-pw"))
        .await
        .expect("CONNACK");
    assert_ne!(ack.code, 0, "bob is not a user yet");
    assert_eq!(
        a.publish("secret/1", "x", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0,
        "no ACL rule yet"
    );

    // bob added; the ACL file (same name, new contents) denies secret/#.
    std::fs::write(
        &acl,
        "[[rule]]\ndevices = \"*\"\naction = \"publish\"\ntopics = [\"secret/#\"]\npermission = \"deny\"\n",
    )
    .unwrap();
    std::fs::write(
        &path,
        base_config(dir.path(), &format!("{acl_section}{alice}{bob}")),
    )
    .unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    let applied: Vec<&str> = answer["applied"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        applied.contains(&"mqtt.users") && applied.contains(&"acl"),
        "{answer}"
    );

    let (mut b, ack) = TestClient::connect(gw.mqtt_addr, login("dev-b", "bob", "bob-pw"))
        .await
        .expect("bob connects");
    assert_eq!(ack.code, 0, "bob is a user now");
    assert_eq!(
        b.publish("secret/2", "x", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0x87,
        "the new rule refuses bob"
    );
    // alice's connection stayed; her next publish meets the new rules too.
    a.ping().await.expect("alice is still connected");
    assert_eq!(
        a.publish("secret/3", "x", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0x87
    );
    assert_eq!(
        a.publish("open/1", "x", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    gw.shutdown();
}

/// Copy the PKI's server certificate and key to `dir/server.pem`, `dir/server.key`.
fn install_server_cert(pki: &TestPki, dir: &Path) {
    std::fs::copy(pki.server_cert_path(), dir.join("server.pem")).unwrap();
    std::fs::copy(pki.server_key_path(), dir.join("server.key")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_swap_serves_new_tls_connects_while_old_connections_stay() {
    let (old_pki, new_pki) = (TestPki::generate(), TestPki::generate());
    let dir = tempfile::tempdir().expect("temp dir");
    install_server_cert(&old_pki, dir.path());
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        base_config(
            dir.path(),
            &format!(
                "[mqtt.tls]\nlisten = \"127.0.0.1:0\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
                dir.path().join("server.pem").display(),
                dir.path().join("server.key").display()
            ),
        ),
    )
    .unwrap();
    let gw = gateway_from(&path);
    let tls_addr = gw.tls_addr.expect("the TLS listener");
    let admin_addr = gw.admin_addr.expect("admin");
    let over_tls = |pki: &TestPki, id: &str| {
        ConnectOpts::new(ProtocolVersion::V5, id)
            .with_tls(pki.rustls_client_config(false), "localhost")
    };
    let (mut old, ack) = TestClient::connect(tls_addr, over_tls(&old_pki, "old-tls"))
        .await
        .expect("a device trusting the old CA connects");
    assert_eq!(ack.code, 0);

    // Same file names, new contents: nothing in the config file itself changed.
    install_server_cert(&new_pki, dir.path());
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "mqtt.tls certificate", "{answer}");

    let (_new, ack) = TestClient::connect(tls_addr, over_tls(&new_pki, "new-tls"))
        .await
        .expect("a device trusting the new CA connects: the new certificate is served");
    assert_eq!(ack.code, 0);
    assert!(
        TestClient::connect(tls_addr, over_tls(&old_pki, "old-ca-only"))
            .await
            .is_err(),
        "a device trusting only the old CA is refused: the old certificate is no longer served"
    );
    // The connection made before the swap keeps working.
    assert_eq!(
        old.publish("t/1", "x", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    old.ping().await.expect("the old TLS connection stays");

    // A broken key file is refused, and the certificate in force stays.
    std::fs::write(dir.path().join("server.key"), "not a key").unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 422, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap_or_default()
            .contains("mqtt.tls"),
        "{answer}"
    );
    let (_again, ack) = TestClient::connect(tls_addr, over_tls(&new_pki, "new-tls-2"))
        .await
        .expect("the new certificate is still served");
    assert_eq!(ack.code, 0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregation_is_switched_on_and_off_live_between_packs() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let write = |aggregate: &str| {
        let uplink = cloud.uplink_toml(None, &format!("forward = [\"#\"]\n{aggregate}"));
        std::fs::write(&path, base_config(dir.path(), &uplink)).unwrap();
    };
    write("");
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen = watch_cloud(cloud.subscriber("watch", "#").await);
    let load = Load::start(gw.mqtt_addr, 2).await;
    wait_cloud(&seen, 0, 20, "messages on their own topics", |t| {
        t.starts_with("a/")
    })
    .await;

    // On: every message packed into SenML on the aggregate topic (min_devices 0).
    write("[uplink.aggregate]\nenabled = true\nmin_devices = 0\nmax_delay = \"50ms\"\ntopic = \"packs/senml\"\n");
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["applied"][0], "uplink.cloud.aggregate", "{answer}");
    let first = wait_cloud(&seen, 0, 1, "packs", |t| t == "packs/senml").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mark = seen.lock().unwrap().len().max(first);
    wait_cloud(&seen, mark, 5, "packs", |t| t == "packs/senml").await;
    assert!(
        since(&seen, mark).iter().all(|t| t == "packs/senml"),
        "while aggregating, only packs: {:?}",
        since(&seen, mark)
    );

    // Off again: messages on their own topics.
    write("");
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    let first = wait_cloud(&seen, mark, 1, "single messages", |t| t.starts_with("b/")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mark = seen.lock().unwrap().len().max(first);
    wait_cloud(&seen, mark, 20, "single messages", |t| t.starts_with("a/")).await;
    assert!(
        since(&seen, mark).iter().all(|t| t != "packs/senml"),
        "aggregation is off again"
    );
    load.stop_and_check(10).await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uplinks_new_roots_apply_at_its_next_connect_and_its_connection_stays() {
    let cloud = Cloud::start();
    let stranger = TestPki::generate();
    let gate = common::Gate::start(cloud.broker.tls_addr()).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("cloud-ca.pem");
    std::fs::copy(cloud.pki.ca_path(), &ca).unwrap();
    let path = dir.path().join("sluice.toml");
    // The uplink trusts the CA copied to `ca` (replacing `ca_file` below with ours).
    let uplink = cloud
        .uplink_toml(Some(gate.addr), "forward = [\"#\"]")
        .replace(
            &format!("ca_file = \"{}\"", cloud.pki.ca_path().display()),
            &format!("ca_file = \"{}\"", ca.display()),
        );
    std::fs::write(&path, base_config(dir.path(), &uplink)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let seen = watch_cloud(cloud.subscriber("watch", "#").await);
    let (mut device, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v311("dev"))
        .await
        .expect("device");
    let mut n = 0u32;
    let mut publish_until =
        async |device: &mut TestClient, what: &str, want: &dyn Fn(&str) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(20);
            let from = seen.lock().unwrap().len();
            loop {
                device
                    .publish(&format!("t/{n}"), "x", QoS::AtMostOnce, false)
                    .await
                    .expect("the device stays connected");
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
                if since(&seen, from).iter().any(|t| want(t)) {
                    return;
                }
                assert!(Instant::now() < deadline, "{what} within 20 s");
            }
        };
    publish_until(&mut device, "the cloud receives", &|_| true).await;

    // Another CA, same file name: applied for the next connect; the connection stays.
    std::fs::copy(stranger.ca_path(), &ca).unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["applied"][0], "uplink.cloud certificates (next connect)",
        "{answer}"
    );
    publish_until(
        &mut device,
        "the current uplink connection still carries",
        &|_| true,
    )
    .await;

    // Cut the link: the reconnect meets a server certificate the new roots do not trust.
    let failures = |text: &str| common::metric_sum(text, "sluice_uplink_connect_failures_total");
    gate.set_open(false);
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate.set_open(true);
    // With the gate open, only the roots can make reconnects fail (one failure may still be
    // the gate's, counted late).
    let before = failures(&metrics(admin_addr));
    let deadline = Instant::now() + Duration::from_secs(20);
    while failures(&metrics(admin_addr)) < before + 3.0 {
        assert!(
            Instant::now() < deadline,
            "reconnects with the stranger CA did not fail:\n{}",
            metrics(admin_addr)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The right CA again: the next reconnect succeeds and messages flow.
    std::fs::copy(cloud.pki.ca_path(), &ca).unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    publish_until(
        &mut device,
        "messages after the right roots came back",
        &|_| true,
    )
    .await;
    device
        .ping()
        .await
        .expect("the device stayed connected throughout");
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_filters_follow_a_reload_on_the_running_cloud_session() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let write = |receive: &str| {
        let uplink = cloud.uplink_toml(None, &format!("forward = []\nreceive = [{receive}]"));
        std::fs::write(&path, base_config(dir.path(), &uplink)).unwrap();
    };
    write("\"cmd/a/#\"");
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let (mut device, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v311("listener"))
        .await
        .expect("device");
    assert_eq!(
        device
            .subscribe(&[("cmd/#", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1]
    );
    let mut commander = cloud.client("commander").await;
    // Publish `probe` from the cloud until the device receives one (the downlink
    // subscription is made asynchronously); returns the topic received.
    let mut first_through = async |device: &mut TestClient, probe: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            commander
                .publish(probe, "x", QoS::AtLeastOnce, false)
                .await
                .expect("cloud publish");
            if let Some(p) = device
                .recv(Duration::from_millis(200))
                .await
                .expect("device")
            {
                return p.topic.to_string();
            }
            assert!(
                Instant::now() < deadline,
                "{probe} never reached the device"
            );
        }
    };
    assert_eq!(first_through(&mut device, "cmd/a/1").await, "cmd/a/1");

    // Reload: cmd/b/# instead of cmd/a/#, on the same cloud connection.
    let connects = |text: &str| common::metric_sum(text, "sluice_uplink_connects_total");
    let connects_before = connects(&metrics(admin_addr));
    write("\"cmd/b/#\"");
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["applied"][0], "uplink.cloud.receive", "{answer}");
    // Drain what was still on its way, then: a cmd/b/ message arrives...
    while device
        .recv(Duration::from_millis(200))
        .await
        .unwrap()
        .is_some()
    {}
    let topic = first_through(&mut device, "cmd/b/1").await;
    assert!(topic.starts_with("cmd/b/"), "{topic}");
    while device
        .recv(Duration::from_millis(200))
        .await
        .unwrap()
        .is_some()
    {}
    // ...and cmd/a/ no longer does: of the two published in this order, only the second.
    commander
        .publish("cmd/a/2", "x", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    commander
        .publish("cmd/b/2", "x", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let next = device
        .recv(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("cmd/b/2 arrives");
    assert_eq!(next.topic, "cmd/b/2", "cmd/a/# was unsubscribed");
    assert_eq!(
        connects(&metrics(admin_addr)),
        connects_before,
        "the cloud session was not reconnected"
    );
    device.ping().await.expect("the device stayed connected");
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_publish_rate_applies_to_devices_connecting_afterwards() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, base_config(dir.path(), "")).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let (mut before, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v311("before"))
        .await
        .expect("device");
    std::fs::write(
        &path,
        base_config(
            dir.path(),
            "[limits]\npublish_rate = 1\npublish_burst = 1\n",
        ),
    )
    .unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["applied"][0], "limits", "{answer}");
    let dropped =
        || common::metric_sum(&metrics(admin_addr), "sluice_limits_publish_dropped_total");
    // The device connected before keeps its (unlimited) rate.
    for i in 0..20 {
        before
            .publish(&format!("t/{i}"), "x", QoS::AtMostOnce, false)
            .await
            .unwrap();
    }
    before.ping().await.expect("before is connected");
    assert_eq!(dropped(), 0.0, "the earlier device is not limited");
    // A device connecting now meets 1 message a second: a burst of QoS 0 is cut.
    let (mut after, _) = TestClient::connect(gw.mqtt_addr, ConnectOpts::v311("after"))
        .await
        .expect("device");
    for i in 0..20 {
        after
            .publish(&format!("t/{i}"), "x", QoS::AtMostOnce, false)
            .await
            .unwrap();
    }
    after.ping().await.expect("after is connected");
    assert!(
        dropped() >= 10.0,
        "the new rate drops a burst: {}",
        dropped()
    );
    gw.shutdown();
}
