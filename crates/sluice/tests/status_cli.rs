//! `sluice status` (issue 29 item 2) against a running gateway: the real `sluice` binary reads
//! the admin endpoint of an in-process gateway whose devices publish to a real cloud Mosquitto,
//! and prints its devices, rates, uplink, queue and drops; `--watch` redraws; an unreachable
//! gateway and a missing token are clear errors with exit status 1.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

fn status(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(SLUICE)
        .arg("status")
        .args(args)
        .output()
        .expect("run sluice status");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_prints_devices_rates_uplink_queue_and_drops_of_a_running_gateway() {
    let cloud = Cloud::start();
    let gw = gateway(2, &cloud.uplink_toml(None, ""));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for d in 0..5 {
        let mut c = device(&gw, &format!("st-{d}"), ProtocolVersion::V311).await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                c.publish(
                    "fleet/st",
                    bytes::Bytes::from_static(b"x"),
                    QoS::AtLeastOnce,
                    false,
                )
                .await
                .expect("publish acked");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    let url = format!("http://{}", gw.admin_addr.expect("admin"));
    // Rates need two ticks of the gateway's overview; wait until one shows traffic.
    let deadline = Instant::now() + Duration::from_secs(15);
    let text = loop {
        let url = url.clone();
        let (code, out, err) = tokio::task::spawn_blocking(move || status(&["--admin", &url]))
            .await
            .unwrap();
        assert_eq!(code, 0, "{err}");
        let moving = out
            .lines()
            .find(|l| l.trim_start().starts_with("devices → sluice"))
            .and_then(|l| l.split_whitespace().nth(3))
            .is_some_and(|rate| rate != "0");
        if moving {
            break out;
        }
        assert!(Instant::now() < deadline, "no device traffic shown:\n{out}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    println!("{text}");
    for want in [
        "DEVICES  5",
        "mqtt 5",
        "cloud",
        "connected 2/2",
        "QUEUE",
        "no spool",
        "DROPS",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }

    // --watch redraws (clear screen, table) until killed.
    let mut child = Command::new(SLUICE)
        .args(["status", "--admin", &url, "--watch", "--interval", "200ms"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sluice status --watch");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            match stdout.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            if String::from_utf8_lossy(&buf)
                .matches("\x1b[H\x1b[2J")
                .count()
                >= 3
            {
                break;
            }
        }
        buf
    });
    let seen = tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let seen = String::from_utf8_lossy(&seen);
    assert!(
        seen.matches("\x1b[H\x1b[2J").count() >= 3,
        "no redraws:\n{seen}"
    );
    assert!(seen.matches("DEVICES  5").count() >= 3, "{seen}");

    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
}

#[test]
fn status_of_a_gateway_that_is_not_running_says_so_and_fails() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (code, out, err) = status(&["--admin", &format!("http://127.0.0.1:{port}")]);
    assert_eq!(code, 1);
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("cannot reach the admin endpoint at 127.0.0.1:")
            && err.contains("is the gateway running"),
        "{err}"
    );
}

#[test]
fn status_with_an_admin_token_needs_the_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "status-cli-token-0c4b9e\n").unwrap();
    let wrong = dir.path().join("wrong.token");
    std::fs::write(&wrong, "not-the-token-at-all-000\n").unwrap();
    let gw = gateway(1, &format!("token_file = \"{}\"\n", token.display()));
    let url = format!("http://{}", gw.admin_addr.expect("admin"));
    let (code, _, err) = status(&["--admin", &url]);
    assert_eq!(code, 1);
    assert!(err.contains("--token-file"), "{err}");
    let (code, _, err) = status(&["--admin", &url, "--token-file", wrong.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("refused the token"), "{err}");
    let (code, out, err) = status(&["--admin", &url, "--token-file", token.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("DEVICES  0"), "{out}");
}

#[test]
fn status_reads_an_https_admin_endpoint_verified_against_its_ca() {
    let pki = sluice_testkit::TestPki::generate();
    let other = sluice_testkit::TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "status-cli-tls-token-5e1a77\n").unwrap();
    let gw = gateway(
        1,
        &format!(
            "token_file = {:?}\ncert_file = {:?}\nkey_file = {:?}\n",
            token,
            pki.server_cert_path(),
            pki.server_key_path()
        ),
    );
    let port = gw.admin_addr.expect("admin").port();
    let ca = pki.ca_path().to_str().unwrap();
    let token = token.to_str().unwrap();
    // By IP (the certificate's IP SAN) and by name (its DNS SAN).
    for url in [
        format!("https://127.0.0.1:{port}"),
        format!("https://localhost:{port}"),
    ] {
        let (code, out, err) = status(&["--admin", &url, "--ca-file", ca, "--token-file", token]);
        assert_eq!(code, 0, "{url}: {err}");
        assert!(out.contains("DEVICES  0"), "{out}");
    }
    // A CA that did not sign the certificate: a clear TLS error, nothing printed.
    let url = format!("https://127.0.0.1:{port}");
    let wrong_ca = other.ca_path().to_str().unwrap();
    let (code, out, err) = status(&[
        "--admin",
        &url,
        "--ca-file",
        wrong_ca,
        "--token-file",
        token,
    ]);
    assert_eq!(code, 1);
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("TLS with the admin endpoint at 127.0.0.1:") && err.contains("--ca-file"),
        "{err}"
    );
    // Plain http to the TLS endpoint fails without hanging.
    let (code, _, err) = status(&["--admin", &format!("http://127.0.0.1:{port}")]);
    assert_eq!(code, 1, "{err}");
}

/// A site of two gateways: `sluice status --devices` with both admin endpoints says which
/// gateway holds which device; `/api/v1/devices` pages by client id; a device that moves
/// shows up on its new gateway only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_devices_says_which_gateway_of_a_site_holds_which_device() {
    let gw_a = gateway_sections("shards = 2\nname = \"gw-a\"", "", "");
    let gw_b = gateway_sections("shards = 1\nname = \"gw-b\"", "", "");
    let mut on_a = Vec::new();
    for id in ["dev-3", "dev-1", "dev-2"] {
        on_a.push(device(&gw_a, id, ProtocolVersion::V5).await);
    }
    let moving = device(&gw_a, "dev-9", ProtocolVersion::V311).await;
    let _on_b = device(&gw_b, "dev-5", ProtocolVersion::V311).await;
    let url_a = format!("http://{}", gw_a.admin_addr.expect("admin"));
    let url_b = format!("http://{}", gw_b.admin_addr.expect("admin"));

    // The registry hears of connections through the control plane: wait for all five.
    let args = ["--devices", "--admin", &url_a, "--admin", &url_b].map(String::from);
    let run = |args: Vec<String>| async move {
        tokio::task::spawn_blocking(move || {
            status(&args.iter().map(String::as_str).collect::<Vec<_>>())
        })
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let (code, out, err) = run(args.to_vec()).await;
        assert_eq!(code, 0, "{err}");
        if out.contains("5 devices on 2 gateways") {
            break out;
        }
        assert!(Instant::now() < deadline, "not every device listed:\n{out}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("{text}");
    let rows: Vec<(String, String)> = text
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_string(), f[1].to_string())
        })
        .collect();
    let want: Vec<(String, String)> = [
        ("dev-1", "gw-a"),
        ("dev-2", "gw-a"),
        ("dev-3", "gw-a"),
        ("dev-5", "gw-b"),
        ("dev-9", "gw-a"),
    ]
    .iter()
    .map(|(d, g)| (d.to_string(), g.to_string()))
    .collect();
    assert_eq!(rows, want, "{text}");
    assert!(text.contains("gw-a 4, gw-b 1"), "{text}");

    // The API pages in client id order.
    let target = sluice::top::Target::new(&url_a, None, None).unwrap();
    let page = tokio::task::spawn_blocking(move || {
        let first = target.devices_page(None, 2).unwrap();
        let next = first["next"].as_str().unwrap().to_string();
        (first, target.devices_page(Some(&next), 2).unwrap())
    })
    .await
    .unwrap();
    assert_eq!(page.0["gateway"], "gw-a");
    assert_eq!(page.0["total"], 4);
    let ids = |v: &serde_json::Value| -> Vec<String> {
        v["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["client_id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids(&page.0), ["dev-1", "dev-2"]);
    assert_eq!(ids(&page.1), ["dev-3", "dev-9"]);
    assert!(page.1["next"].is_null(), "{}", page.1);

    // dev-9 loses gw-a and reconnects to gw-b.
    drop(moving);
    let _moved = device(&gw_b, "dev-9", ProtocolVersion::V311).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, out, err) = run(args.to_vec()).await;
        assert_eq!(code, 0, "{err}");
        let row = out.lines().find(|l| l.starts_with("dev-9 "));
        if out.contains("gw-a 3, gw-b 2") && row.is_some_and(|r| r.contains("gw-b")) {
            assert_eq!(out.matches("dev-9 ").count(), 1, "{out}");
            break;
        }
        assert!(Instant::now() < deadline, "dev-9 not moved:\n{out}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // One gateway down: the other's devices still print, the error goes to stderr, exit 1.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("http://127.0.0.1:{port}");
    let (code, out, err) = run(["--devices", "--admin", &url_b, "--admin", &dead]
        .map(String::from)
        .to_vec())
    .await;
    assert_eq!(code, 1);
    assert!(out.contains("2 devices on 1 gateway: gw-b 2"), "{out}");
    assert!(err.contains("cannot reach the admin endpoint"), "{err}");
    drop(on_a);
}
