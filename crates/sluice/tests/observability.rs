//! What a Prometheus server, a Grafana dashboard and a log shipper see of a real gateway
//! (issue 29 item 6). A gateway with two shards, MQTT, CoAP and IEEE 11073 (PHD) devices, a CoAP
//! proxy upstream, a spool, two cloud uplinks (a real Mosquitto over TLS 1.3; one over two
//! paths) and a function is started and fed; its `/metrics` body, fetched over HTTP like a
//! scraper does, must
//! - pass the strict reader of `sluice_testkit::prom` (one group per family, HELP and TYPE
//!   once, no series twice, counters `_total`, base units), which names the family at fault,
//! - pass `promtool check metrics` (Debian's `prometheus` package; scripts/test installs it),
//! - contain every metric name that `deploy/grafana/sluice.json` and
//!   `deploy/prometheus/alerts.yml` use.
//!
//! The alert rules pass `promtool check rules` and their unit tests (`promtool test rules
//! deploy/prometheus/alerts.test.yml`), and `[log] format = "json"` makes the `sluice` binary
//! write one JSON object per line.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::coap::{request, CoapDevice};
use common::{gateway_sections, wait_until, Cloud};
use sluice::app::RunningGateway;
use sluice_proto::coap::{Code, MsgType};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::phd::{bcd_time, AgentSpec, PhdAgent, PhdDevice, Reading};
use sluice_testkit::prom::{self, Exposition};

const T: Duration = Duration::from_secs(10);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One `GET path` over HTTP/1.1; the body.
fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect_timeout(&addr, T).expect("connect to the admin endpoint");
    s.set_read_timeout(Some(T)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read the answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

fn promtool() -> &'static str {
    let found = Command::new("promtool")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "promtool not found: install Debian's `prometheus` package (scripts/test does)"
    );
    "promtool"
}

/// A gateway with every kind of device, a spool, an uplink and a function, after traffic
/// from each; returns it with the cloud it uses and its spool directory.
async fn busy_gateway() -> (Cloud, RunningGateway, tempfile::TempDir) {
    let cloud = Cloud::start();
    let spool = tempfile::tempdir().unwrap();
    let mut sub = cloud.subscriber("cloud-app", "#").await;
    let extra = format!(
        "[coap]\nlisten = \"127.0.0.1:0\"\n\
         [[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://127.0.0.1:{}\"\nprefix = \"px\"\n\
         [phd]\nlisten = \"127.0.0.1:0\"\nresponse_timeout = \"2s\"\n\
         [spool]\ndir = \"{}\"\nfsync = \"never\"\n\
         {}\n{}\n\
         [[function]]\nname = \"enrich\"\ntopics = [\"fn/#\"]\nurl = \"http://127.0.0.1:{}\"\n",
        closed_port(),
        spool.path().display(),
        cloud.uplink_toml(None, ""),
        multipath_uplink(&cloud),
        closed_port(),
    );
    let gw = gateway_sections("shards = 2", "", &extra);

    // MQTT: a QoS 1 publish to the cloud and one to the function (whose server is not there:
    // a dead letter).
    let mut dev = common::device(&gw, "meter-1", ProtocolVersion::V5).await;
    dev.publish("sensors/meter-1/power", &b"42"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    dev.publish("fn/meter-1", &b"{}"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    // CoAP: a confirmable publish.
    let mut coap = CoapDevice::new(gw.coap_addr().expect("coap listening")).await;
    let req = request(MsgType::Con, Code::POST, "ps/coap/th-1/temp", &[], b"21.5");
    let resp = coap.exchange(req, T).await;
    assert_eq!(resp.code, Code::CHANGED, "{resp:?}");
    // PHD: a pulse oximeter associates and reports.
    let spec = AgentSpec {
        system_id: [0x00, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x01],
        device: PhdDevice::PulseOximeter,
        config_id: 0x0190,
        confirmed: true,
        antidote_quirks: false,
    };
    let mut ox = PhdAgent::connect(gw.phd_addr.expect("phd listening"), spec)
        .await
        .unwrap();
    ox.associate().await.unwrap();
    let reading = Reading::Oximeter {
        spo2: (98, 0),
        pulse: (72, 0),
    };
    ox.report(&reading, bcd_time(2024, 1, 2, 3, 4, 5, 0), T)
        .await
        .unwrap();

    // Everything reached the cloud: the MQTT message, the CoAP one, the two PHD measurements.
    let want: BTreeSet<String> = [
        "sensors/meter-1/power",
        "coap/th-1/temp",
        "phd/001b2c3d4e5f6001/spo2",
        "phd/001b2c3d4e5f6001/pulse",
    ]
    .map(String::from)
    .into();
    let mut topics = BTreeSet::new();
    let deadline = Instant::now() + T;
    while !topics.is_superset(&want) && Instant::now() < deadline {
        if let Ok(Some(p)) = sub.recv(Duration::from_millis(500)).await {
            topics.insert(p.topic.to_string());
        }
    }
    assert!(topics.is_superset(&want), "the cloud got {topics:?}");
    let m = || gw.metrics_text();
    wait_until("the function's event is dead-lettered", T, || {
        common::metric_sum(&m(), "sluice_function_dead_letters_total") >= 1.0
    })
    .await;
    wait_until("the uplink acknowledged its messages", T, || {
        common::metric_sum(&m(), "sluice_uplink_ack_latency_seconds_count") >= 1.0
    })
    .await;
    wait_until(
        "both paths of the multipath uplink are up on both shards",
        T,
        || {
            prom::check(&m()).is_ok_and(|e| {
                e.sum(
                    "sluice_uplink_path_state",
                    &[("uplink", "multi"), ("state", "up")],
                ) == 4.0
            })
        },
    )
    .await;
    drop(ox);
    (cloud, gw, spool)
}

/// A second uplink to the same broker over two paths (source addresses 127.0.0.2 and
/// 127.0.0.3), so the per-path families are written too.
fn multipath_uplink(cloud: &Cloud) -> String {
    format!(
        "[[uplink]]\nname = \"multi\"\nurl = \"mqtts://{}\"\nca_file = \"{}\"\n\
         server_name = \"localhost\"\nclient_id = \"gw-multi\"\n\
         paths = [{{ name = \"lte\", bind = \"127.0.0.2\" }}, {{ name = \"dsl\", bind = \"127.0.0.3\" }}]\n",
        cloud.broker.tls_addr(),
        cloud.pki.ca_path().display()
    )
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn scrape(gw: &RunningGateway) -> String {
    http_get(gw.admin_addr.expect("admin listening"), "/metrics")
}

fn checked(text: &str) -> Exposition {
    prom::check(text).unwrap_or_else(|problems| {
        panic!("/metrics breaks the text format:\n{problems}\n--- body ---\n{text}")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_gateways_metrics_pass_promtool_with_one_group_per_family() {
    let promtool = promtool();
    let (_cloud, gw, _spool) = busy_gateway().await;
    let text = scrape(&gw);
    let exp = checked(&text);

    // Most of the gateway is in it: each subsystem's families, with samples.
    for family in [
        "sluice_control_devices_connected",
        "sluice_mqtt_messages_received_total",
        "sluice_coap_publishes_total",
        "sluice_phd_measurements_total",
        "sluice_uplink_state",
        "sluice_uplink_ack_latency_seconds",
        "sluice_spool_bytes",
        "sluice_spool_max_bytes",
        "sluice_function_dead_letters_total",
        "sluice_admin_refused_total",
        "sluice_coap_proxy_state",
        "sluice_uplink_path_state",
    ] {
        let f = exp
            .family(family)
            .unwrap_or_else(|| panic!("no {family} in /metrics"));
        assert!(!f.samples.is_empty(), "{family} has no sample");
    }
    assert!(
        exp.families.len() >= 120,
        "only {} families",
        exp.families.len()
    );
    // States are labels: the connected uplink is 1 under state="connected", 0 elsewhere.
    let connected = exp.sum(
        "sluice_uplink_state",
        &[
            ("uplink", "cloud"),
            ("lane", "normal"),
            ("state", "connected"),
        ],
    );
    assert_eq!(connected, 2.0, "both shards' sessions connected");
    assert_eq!(
        exp.sum(
            "sluice_uplink_state",
            &[("uplink", "cloud"), ("state", "disconnected")]
        ),
        0.0
    );
    // The proxy upstream nothing has asked for yet is disconnected, as a label.
    assert_eq!(
        exp.sum(
            "sluice_coap_proxy_state",
            &[("upstream", "cloud"), ("state", "disconnected")]
        ),
        2.0,
        "one upstream connection per shard, none connected"
    );
    // Both paths of the multipath uplink are up on every shard, and their ack time is in
    // seconds.
    assert_eq!(
        exp.sum(
            "sluice_uplink_path_state",
            &[("uplink", "multi"), ("state", "up")]
        ),
        4.0,
        "two paths on each of two shards"
    );
    let srtt = exp
        .family("sluice_uplink_path_srtt_seconds")
        .expect("the paths' ack times");
    assert!(
        srtt.samples.iter().all(|s| s.value > 0.0 && s.value < 5.0),
        "{:?}",
        srtt.samples
    );
    // Base units: the ack latency histogram is in seconds (a loopback ack takes well under 1 s).
    let fast = exp.sum(
        "sluice_uplink_ack_latency_seconds_bucket",
        &[("uplink", "cloud"), ("le", "1")],
    );
    assert!(fast >= 1.0, "acks within 1 s: {fast}");

    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    gw.shutdown();
}

/// The values of `sluice_spool_oldest_unacked_age_seconds`, one per spool.
fn spool_ages(gw: &RunningGateway) -> Vec<f64> {
    checked(&gw.metrics_text())
        .family("sluice_spool_oldest_unacked_age_seconds")
        .map(|f| f.samples.iter().map(|s| s.value).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spools_oldest_unacked_age_grows_while_the_uplink_is_down() {
    let spool = tempfile::tempdir().unwrap();
    let extra = format!(
        "[spool]\ndir = \"{}\"\nfsync = \"never\"\n\
         [[uplink]]\nname = \"down\"\nurl = \"mqtt://127.0.0.1:{}\"\nallow_plaintext = true\n\
         client_id = \"gw\"\nreconnect_min = \"1s\"\nreconnect_max = \"1s\"\n",
        spool.path().display(),
        closed_port()
    );
    let gw = common::gateway(1, &extra);
    assert_eq!(spool_ages(&gw), vec![0.0], "an empty spool is 0 s old");
    let mut dev = common::device(&gw, "meter-1", ProtocolVersion::V311).await;
    let sent = Instant::now();
    dev.publish("sensors/meter-1/power", &b"42"[..], QoS::AtLeastOnce, false)
        .await
        .expect("the spool takes it");
    wait_until("the unsent record is 0.5 s old", T, || {
        spool_ages(&gw).first().is_some_and(|a| *a >= 0.5)
    })
    .await;
    let age = spool_ages(&gw)[0];
    let bound = sent.elapsed().as_secs_f64();
    assert!(age <= bound, "{age} s, but it was sent {bound} s ago");
    gw.shutdown();
}

/// Every `sluice_…` name in a deploy file.
fn metric_names(path: &Path) -> BTreeSet<String> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("sluice_") {
        let boundary = rest[..i]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if boundary {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_name_exists_in_a_real_gateway() {
    let root = repo_root();
    let dashboard = root.join("deploy/grafana/sluice.json");
    let alerts = root.join("deploy/prometheus/alerts.yml");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&dashboard).unwrap())
            .expect("the dashboard is JSON");
    assert!(
        dash["panels"].as_array().is_some_and(|p| p.len() >= 10),
        "a dashboard with panels"
    );
    let (_cloud, gw, _spool) = busy_gateway().await;
    let exp = checked(&scrape(&gw));
    for (file, names) in [
        (&dashboard, metric_names(&dashboard)),
        (&alerts, metric_names(&alerts)),
    ] {
        assert!(names.len() >= 5, "{} names {names:?}", file.display());
        let missing: Vec<&String> = names.iter().filter(|n| !exp.has_metric(n)).collect();
        assert!(
            missing.is_empty(),
            "{} names metrics a real gateway does not expose: {missing:?}",
            file.display()
        );
    }
    gw.shutdown();
}

/// Every query of the dashboard is valid PromQL: each becomes a recording rule (Grafana's
/// `$__rate_interval` and `$instance` filled in) that `promtool check rules` parses.
#[test]
fn every_dashboard_query_is_valid_promql() {
    let promtool = promtool();
    let dashboard = repo_root().join("deploy/grafana/sluice.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&dashboard).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target has an expr");
            exprs.push((panel["title"].as_str().unwrap_or("").to_string(), expr));
        }
    }
    assert!(exprs.len() >= 30, "{} queries", exprs.len());
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (title, expr)) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*");
        rules.push_str(&format!(
            "      # {title}\n      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-queries.yml");
    std::fs::write(&file, &rules).unwrap();
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "{}\n{}\n{rules}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = promtool();
    let root = repo_root();
    for args in [
        vec!["check", "rules", "deploy/prometheus/alerts.yml"],
        vec!["test", "rules", "deploy/prometheus/alerts.test.yml"],
    ] {
        let out = Command::new(promtool)
            .args(&args)
            .current_dir(&root)
            .output()
            .expect("run promtool");
        assert!(
            out.status.success(),
            "promtool {}: {}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Kills the child if the test ends early.
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn log_format_json_writes_one_json_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    let log = dir.path().join("sluice.log");
    let admin = sluice_testkit::free_port().unwrap();
    std::fs::write(
        &config,
        format!(
            "[gateway]\nshards = 1\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\n\
             [coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n\
             [log]\nlevel = \"info\"\nformat = \"json\"\n"
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "-c"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sluice");
    let mut guard = Guard(child);
    let deadline = Instant::now() + T;
    let started = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("sluice started")) {
            break (line.to_string(), text);
        }
        if let Ok(Some(status)) = guard.0.try_wait() {
            panic!("sluice exited ({status}):\n{text}");
        }
        assert!(
            Instant::now() < deadline,
            "no start line within 10 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let (line, all) = started;
    for l in all.lines() {
        serde_json::from_str::<serde_json::Value>(l)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"));
    }
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["level"], "INFO", "{line}");
    assert_eq!(v["fields"]["message"], "sluice started", "{line}");
    assert_eq!(v["fields"]["shards"], 1, "fields stay typed: {line}");
    assert!(
        v["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
        "an RFC 3339 UTC timestamp: {line}"
    );
    assert!(v["target"]
        .as_str()
        .is_some_and(|t| t.starts_with("sluice")));
}

/// Text log lines written anywhere but a terminal (the journal under systemd, a file, a pipe
/// to a log shipper) carry no ANSI colour codes: journald stores a line with an escape byte as
/// binary (`journalctl -o json` shows its MESSAGE as an array of numbers, `-o cat` shows the
/// codes) and log shippers index the codes as text. Found by scripts/test-systemd.
#[test]
fn log_format_text_to_a_file_or_the_journal_has_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    let log = dir.path().join("sluice.log");
    let admin = sluice_testkit::free_port().unwrap();
    std::fs::write(
        &config,
        format!(
            "[gateway]\nshards = 1\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\n\
             [coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n\
             [log]\nlevel = \"info\"\nformat = \"text\"\n"
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "-c"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sluice");
    let mut guard = Guard(child);
    let deadline = Instant::now() + T;
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.lines().any(|l| l.contains("sluice started")) {
            break text;
        }
        if let Ok(Some(status)) = guard.0.try_wait() {
            panic!("sluice exited ({status}):\n{text}");
        }
        assert!(
            Instant::now() < deadline,
            "no start line within 10 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let line = text.lines().find(|l| l.contains("sluice started")).unwrap();
    assert!(
        !text.contains('\u{1b}'),
        "colour codes in a log written to a file: {line:?}"
    );
    assert!(line.contains(" INFO sluice started "), "{line:?}");
}
