//! Shared by the reload tests (`gateway_reload*.rs`): the admin API with its token, a
//! device load that checks every device stays connected and acknowledged, a cloud watcher,
//! and gateways started in-process from a config file.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_proto::mqtt::QoS;
use sluice_testkit::{ConnectOpts, TestClient};

pub const TOKEN: &str = "reload-test-token-0123456789";

/// One request to the admin endpoint: (status code, body). `None` if it cannot connect.
pub fn admin(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

pub fn post_reload(addr: SocketAddr) -> (u16, serde_json::Value) {
    let (status, body) =
        admin(addr, "POST", "/api/v1/reload", Some(TOKEN)).expect("POST /api/v1/reload");
    let json = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("reload answer is not JSON ({e}): {body}"));
    (status, json)
}

pub fn metrics(addr: SocketAddr) -> String {
    admin(addr, "GET", "/metrics", Some(TOKEN))
        .map(|(_, b)| b)
        .unwrap_or_default()
}

/// Devices publishing QoS 1 without pause, alternately on `a/{id}/n` and `b/{id}/n`, until
/// told to stop; each hands back its client (still connected, or the error that ended it).
pub struct Load {
    stop: Arc<AtomicBool>,
    /// Per device: QoS 1 messages acknowledged so far.
    acked: Arc<Vec<std::sync::atomic::AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<(String, anyhow::Result<TestClient>, u64)>>,
}

impl Load {
    pub async fn start(addr: SocketAddr, devices: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let acked: Arc<Vec<std::sync::atomic::AtomicU64>> =
            Arc::new((0..devices).map(|_| Default::default()).collect());
        let mut tasks = Vec::new();
        for d in 0..devices {
            let id = format!("load-{d}");
            let (mut client, ack) = TestClient::connect(addr, ConnectOpts::v311(id.clone()))
                .await
                .expect("a load device connects");
            assert_eq!(ack.code, 0);
            let (stop, acked) = (stop.clone(), acked.clone());
            tasks.push(tokio::spawn(async move {
                let mut n: u64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    let topic = if n.is_multiple_of(2) { "a" } else { "b" };
                    if let Err(e) = client
                        .publish(&format!("{topic}/{id}/{n}"), "x", QoS::AtLeastOnce, false)
                        .await
                    {
                        return (id, Err(e), n);
                    }
                    n += 1;
                    acked[d].store(n, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (id, Ok(client), n)
            }));
        }
        Load { stop, acked, tasks }
    }

    /// Stop publishing once every device had `more` messages acknowledged from now on;
    /// every device must still be connected and answer a ping.
    pub async fn stop_and_check(self, more: u64) {
        let now: Vec<u64> = self
            .acked
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self
            .acked
            .iter()
            .zip(&now)
            .any(|(a, n)| a.load(Ordering::Relaxed) < n + more)
        {
            assert!(
                Instant::now() < deadline,
                "a device stopped being acknowledged: {:?} → {:?}",
                now,
                self.acked
                    .iter()
                    .map(|a| a.load(Ordering::Relaxed))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let (id, result, n) = t.await.expect("load task");
            let mut client = result.unwrap_or_else(|e| {
                panic!("{id}: its connection failed after {n} publishes: {e:#}")
            });
            eprintln!("measured: {id} published {n} QoS 1 messages, each acknowledged, across the reloads");
            client
                .ping()
                .await
                .unwrap_or_else(|e| panic!("{id}: no PINGRESP after the reloads: {e:#}"));
        }
    }
}

/// Every topic the cloud receives, in order.
pub fn watch_cloud(mut sub: TestClient) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = seen.clone();
    tokio::spawn(async move {
        while let Ok(p) = sub.recv(Duration::from_secs(60)).await {
            match p {
                Some(p) => out.lock().unwrap().push(p.topic.to_string()),
                None => return,
            }
        }
    });
    seen
}

/// Wait until the cloud has received `n` topics after index `from` for which `want` holds;
/// returns the index after the first of them.
pub async fn wait_cloud(
    seen: &Arc<Mutex<Vec<String>>>,
    from: usize,
    n: usize,
    what: &str,
    want: impl Fn(&str) -> bool,
) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        {
            let v = seen.lock().unwrap();
            let hits: Vec<usize> = (from..v.len()).filter(|&i| want(&v[i])).collect();
            if hits.len() >= n {
                return hits[0] + 1;
            }
            assert!(
                Instant::now() < deadline,
                "the cloud did not receive {n} {what} within 20 s; last topics: {:?}",
                &v[v.len().saturating_sub(10)..]
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The topics the cloud received from index `from` on.
pub fn since(seen: &Arc<Mutex<Vec<String>>>, from: usize) -> Vec<String> {
    seen.lock().unwrap()[from..].to_vec()
}

/// An in-process gateway started from `path`, with the admin token.
pub fn gateway_from(path: &Path) -> sluice::app::RunningGateway {
    let config = sluice::config::load(Some(path)).expect("valid config");
    sluice::app::Gateway::build(config)
        .expect("build")
        .with_config_file(Some(path.to_path_buf()))
        .start()
        .expect("start")
}

pub fn base_config(dir: &Path, more: &str) -> String {
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).expect("write the token");
    format!(
        "[gateway]\nshards = 2\npin_threads = false\n[mqtt]\nlisten = \"127.0.0.1:0\"\n[coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n{more}\n",
        token.display()
    )
}

/// `sluice_uplink_dropped_total{reason="uplink_removed"}` of `uplink`, all shards and lanes.
pub fn removed_unsent(text: &str, uplink: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("sluice_uplink_dropped_total{"))
        .filter(|l| l.contains(&format!("uplink=\"{uplink}\"")))
        .filter(|l| l.contains("reason=\"uplink_removed\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sum of the `name{...uplink="uplink"...}` lines.
pub fn uplink_sum(text: &str, name: &str, uplink: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| l.contains(&format!("uplink=\"{uplink}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
