//! The dashboard in a real browser (issue 29): headless Chromium, driven by Selenium from
//! tests/dashboard_support/browser.py, against an in-process gateway whose MQTT devices publish
//! to a real cloud Mosquitto over TLS while the page is open. The page must get live data, its
//! numbers must move and equal `/api/v1/status` within a refresh, no console error, no request
//! to another origin, readable at 390 px wide (no sideways scrolling); screenshots at 1280 and
//! 390 px are kept under `target/tmp/dashboard-artifacts/` (the path is printed).
//!
//! Needs `chromium`, `chromium-driver` (Debian) and `selenium` (PyPI): scripts/test installs them.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use sluice_proto::mqtt::{ProtocolVersion, QoS};

const DEVICES: usize = 12;

fn artifacts(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("dashboard-artifacts")
        .join(name);
    std::fs::create_dir_all(&dir).expect("artifact dir");
    dir
}

/// Devices that publish QoS 1 every 100 ms until `stop`.
async fn publishing_devices(
    gw: &sluice::app::RunningGateway,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for d in 0..DEVICES {
        let mut c = device(gw, &format!("dash-{d}"), ProtocolVersion::V5).await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let payload = bytes::Bytes::from(format!("{{\"n\":{n}}}"));
                c.publish(&format!("fleet/dash-{d}"), payload, QoS::AtLeastOnce, false)
                    .await
                    .expect("publish acked");
                n += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = c.disconnect().await;
        }));
    }
    tasks
}

fn run_browser(url: &str, outdir: &std::path::Path, token: Option<&str>) -> serde_json::Value {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/dashboard_support/browser.py"
    );
    let mut cmd = Command::new("python3");
    cmd.arg(script).arg(url).arg(outdir);
    if let Some(t) = token {
        cmd.arg("--token").arg(t);
    }
    let out = cmd.output().expect("run python3 browser.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named 'selenium'") {
        panic!("selenium is not installed for python3: run scripts/test (pip install selenium)");
    }
    let line = stdout.lines().last().unwrap_or("");
    let result: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|_| {
        panic!("browser.py printed no result\nstdout: {stdout}\nstderr: {stderr}")
    });
    assert!(
        result.get("error").is_none() && out.status.success(),
        "browser check failed: {result}\nstderr: {stderr}"
    );
    result
}

fn assert_page_ok(r: &serde_json::Value) {
    assert_eq!(r["devices_page"], DEVICES, "{r}");
    assert_eq!(r["devices_status"], DEVICES, "{r}");
    let seq = r["seq_moved"].as_array().unwrap();
    assert!(seq[1].as_u64() > seq[0].as_u64(), "no new overview: {r}");
    let total = r["in_total"].as_array().unwrap();
    assert!(
        total[1].as_u64().unwrap_or(0) > total[0].as_u64().unwrap_or(0),
        "the device message total did not move: {r}"
    );
    assert!(
        r["uplink_state"]
            .as_str()
            .unwrap_or("")
            .starts_with("connected"),
        "{r}"
    );
    assert!(
        r["chart_points"].as_u64().unwrap_or(0) >= 2,
        "no chart drawn: {r}"
    );
    assert_eq!(r["console_errors"], serde_json::json!([]), "{r}");
    assert_eq!(r["foreign_requests"], serde_json::json!([]), "{r}");
    let w = r["width_390"].as_array().unwrap();
    assert_eq!(w[0], 390, "{r}");
    assert!(
        w[1].as_u64().unwrap() <= 390,
        "the page scrolls sideways at 390 px: {r}"
    );
    assert_eq!(r["devices_390"], DEVICES, "{r}");
    for shot in r["screenshots"].as_array().unwrap() {
        let path = shot.as_str().unwrap();
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        assert!(size > 10_000, "screenshot {path} missing or empty");
        println!("screenshot: {path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_live_numbers_that_match_the_status_api_on_a_desktop_and_a_phone() {
    let cloud = Cloud::start();
    let gw = gateway(2, &cloud.uplink_toml(None, ""));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = publishing_devices(&gw, stop.clone()).await;
    let url = format!("http://{}", gw.admin_addr.expect("admin"));
    let outdir = artifacts("open");
    let r = tokio::task::spawn_blocking(move || run_browser(&url, &outdir, None))
        .await
        .unwrap();
    println!("browser saw: {r}");
    assert_page_ok(&r);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_token_the_dashboard_asks_for_it_once_and_then_streams() {
    const TOKEN: &str = "dashboard-token-5e1f0c9a7b3d";
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let cloud = Cloud::start();
    // `extra` follows the `[admin]` section's listen line, so this key lands in `[admin]`.
    let gw = gateway(
        2,
        &format!(
            "token_file = \"{}\"\n{}",
            token_file.display(),
            cloud.uplink_toml(None, "")
        ),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = publishing_devices(&gw, stop.clone()).await;
    let url = format!("http://{}", gw.admin_addr.expect("admin"));
    let outdir = artifacts("token");
    let r = tokio::task::spawn_blocking(move || run_browser(&url, &outdir, Some(TOKEN)))
        .await
        .unwrap();
    println!("browser saw: {r}");
    assert_eq!(r["token_form_shown"], true, "{r}");
    assert_page_ok(&r);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
}
