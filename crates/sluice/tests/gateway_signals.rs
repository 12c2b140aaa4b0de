//! Signals to the real `sluice run` process (issue 28 finding 11: `kill -HUP` killed it).
//!
//! SIGHUP reloads the config file (issue 29: what can change live is applied, the rest is
//! named as needing a restart, `tests/gateway_reload.rs` covers what is applied), counts it in
//! `sluice_reloads_total{result}`, and never stops the gateway: afterwards the admin endpoint
//! answers and an MQTT device connects. SIGTERM stops
//! it gracefully (exit status 0, "sluice stopped" logged).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice_testkit::{ConnectOpts, TestClient};

/// Kills the child if the test ends early.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One `GET path` on the admin endpoint: the whole response, or `None` if it cannot connect.
fn admin_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Wait (up to 15 s) until `/metrics` contains `line`; returns the metrics text.
fn wait_for_metric(addr: SocketAddr, line: &str, child: &mut Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice exited ({status}) while waiting for {line}");
        }
        let text = admin_get(addr, "/metrics").unwrap_or_default();
        if text.lines().any(|l| l == line) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no {line} in /metrics within 15 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn hup(child: &Child) {
    let pid = i32::try_from(child.id()).expect("a pid fits i32");
    // SAFETY: kill(2) on our own child's pid; no memory is shared.
    let rc = unsafe { libc::kill(pid, libc::SIGHUP) };
    assert_eq!(rc, 0, "kill -HUP");
}

fn write_config(path: &Path, mqtt: u16, admin: u16, extra: &str) {
    std::fs::write(
        path,
        format!(
            "[gateway]\nshards = 1\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:{mqtt}\"\n{extra}\n[coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n"
        ),
    )
    .expect("write the config");
}

async fn device_connects(addr: SocketAddr, id: &str) {
    let (_client, ack) = TestClient::connect(addr, ConnectOpts::v311(id))
        .await
        .expect("an MQTT device connects");
    assert_eq!(ack.code, 0, "{id} accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_the_config_and_never_stops_the_gateway_and_sigterm_stops_it_cleanly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("sluice.toml");
    let log = dir.path().join("sluice.log");
    let mqtt_port = sluice_testkit::free_port().expect("a free port");
    let admin_port = sluice_testkit::free_port().expect("a free port");
    let mqtt = SocketAddr::from(([127, 0, 0, 1], mqtt_port));
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    write_config(&config, mqtt_port, admin_port, "");
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "-c"])
        .arg(&config)
        .env("RUST_LOG", "info")
        // The log goes to standard output.
        .stdout(std::fs::File::create(&log).expect("log file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("start sluice");
    let mut guard = Guard(child);
    wait_for_metric(
        admin,
        "sluice_reloads_total{result=\"unchanged\"} 0",
        &mut guard.0,
    );
    device_connects(mqtt, "before-hup").await;

    // 1. The same file: valid, unchanged.
    hup(&guard.0);
    wait_for_metric(
        admin,
        "sluice_reloads_total{result=\"unchanged\"} 1",
        &mut guard.0,
    );
    device_connects(mqtt, "after-hup-1").await;

    // 2. A changed file: valid; a restart-only setting is named in the log, and so is the log
    //    level, which RUST_LOG overrides.
    write_config(
        &config,
        mqtt_port,
        admin_port,
        "max_connections = 4321\n[log]\nlevel = \"debug\"",
    );
    hup(&guard.0);
    wait_for_metric(
        admin,
        "sluice_reloads_total{result=\"restart_needed\"} 1",
        &mut guard.0,
    );
    let text = std::fs::read_to_string(&log).expect("read the log");
    let line = text
        .lines()
        .find(|l| l.contains("take effect only at the next restart"))
        .unwrap_or_else(|| panic!("no reload line at WARN in the log:\n{text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains("mqtt.max_connections") && line.contains("log.level (RUST_LOG is set"),
        "the settings that need a restart named: {line}"
    );

    // 3. An invalid file: counted, logged, the gateway keeps running as it was.
    std::fs::write(&config, "[mqtt]\nno_such_key = 1\n").expect("write a bad config");
    hup(&guard.0);
    wait_for_metric(
        admin,
        "sluice_reloads_total{result=\"invalid\"} 1",
        &mut guard.0,
    );
    device_connects(mqtt, "after-bad-hup").await;
    assert!(
        guard.0.try_wait().expect("try_wait").is_none(),
        "sluice is still running after three SIGHUPs"
    );

    // SIGTERM: a graceful stop.
    let pid = i32::try_from(guard.0.id()).expect("a pid fits i32");
    // SAFETY: as in `hup`.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = guard.0.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "sluice did not stop within 20 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "SIGTERM exit status: {status}");
    let text = std::fs::read_to_string(&log).expect("read the log");
    assert!(text.contains("sluice stopped"), "{text}");
}
