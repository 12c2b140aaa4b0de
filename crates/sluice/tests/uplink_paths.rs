//! Per-path sessions on loopback: a gateway whose uplink has three paths (sockets bound to
//! 127.0.0.2, .3 and .4) to a real TLS Mosquitto, through a relay that knows each path by its
//! source address — the fault injector (cut a path, blackhole it, let it back). The netns
//! version with real links is `multipath_netns.rs`.
//!
//! Asserted as a device and the cloud see it: every message a device saw acknowledged arrives,
//! each device's messages arrive in order (duplicates of messages in flight at a failure are
//! allowed: at-least-once), and the per-path status shows where traffic went.

mod common;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{device, gateway, Cloud};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the relay does with one path's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    /// Close its connections and refuse new ones.
    Cut,
    /// Keep its connections open but forward nothing either way (no RST, no FIN).
    Blackhole,
}

/// A relay in front of the broker that applies a [`Mode`] per source address.
struct PathRelay {
    addr: SocketAddr,
    modes: Arc<Mutex<HashMap<IpAddr, Mode>>>,
}

impl PathRelay {
    async fn start(upstream: SocketAddr) -> PathRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let modes: Arc<Mutex<HashMap<IpAddr, Mode>>> = Arc::default();
        let m = modes.clone();
        tokio::spawn(async move {
            loop {
                let Ok((down, peer)) = listener.accept().await else {
                    return;
                };
                let mode = |m: &Arc<Mutex<HashMap<IpAddr, Mode>>>| {
                    *m.lock().unwrap().get(&peer.ip()).unwrap_or(&Mode::Pass)
                };
                if mode(&m) == Mode::Cut {
                    continue;
                }
                let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (mut dr, mut dw) = down.into_split();
                let (mut ur, mut uw) = up.into_split();
                let (m1, m2) = (m.clone(), m.clone());
                let ip = peer.ip();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match dr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let mode = *m1.lock().unwrap().get(&ip).unwrap_or(&Mode::Pass);
                        match mode {
                            Mode::Pass => {
                                if uw.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                            Mode::Blackhole => {}
                            Mode::Cut => break,
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let r = tokio::time::timeout(Duration::from_millis(50), ur.read(&mut buf))
                            .await;
                        let mode = *m2.lock().unwrap().get(&ip).unwrap_or(&Mode::Pass);
                        if mode == Mode::Cut {
                            break;
                        }
                        let n = match r {
                            Err(_) => continue,
                            Ok(Ok(0)) | Ok(Err(_)) => break,
                            Ok(Ok(n)) => n,
                        };
                        if mode == Mode::Pass && dw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    // Dropping both halves' owners closes the device side too.
                });
            }
        });
        PathRelay { addr, modes }
    }

    fn set(&self, ip: &str, mode: Mode) {
        self.modes.lock().unwrap().insert(ip.parse().unwrap(), mode);
    }
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("admin connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The normal lane's paths of uplink 0 on every shard, summed by path name.
async fn paths_status(admin: SocketAddr) -> HashMap<String, serde_json::Value> {
    let body = http_get(admin, "/api/v1/status").await;
    let json: serde_json::Value =
        serde_json::from_str(body.split("\r\n\r\n").nth(1).unwrap_or("")).expect("status json");
    let mut out: HashMap<String, serde_json::Value> = HashMap::new();
    for shard in json["shards"].as_array().unwrap() {
        for p in shard["uplinks"][0]["lanes"]["normal"]["paths"]
            .as_array()
            .unwrap()
        {
            let name = p["name"].as_str().unwrap().to_string();
            let e = out.entry(name).or_insert(serde_json::json!({"messages_acked": 0, "failovers_stalled": 0, "failovers_dead": 0, "up": 0}));
            e["messages_acked"] = (e["messages_acked"].as_u64().unwrap()
                + p["messages_acked"].as_u64().unwrap())
            .into();
            e["failovers_stalled"] = (e["failovers_stalled"].as_u64().unwrap()
                + p["failovers"]["stalled"].as_u64().unwrap())
            .into();
            e["failovers_dead"] = (e["failovers_dead"].as_u64().unwrap()
                + p["failovers"]["dead"].as_u64().unwrap())
            .into();
            e["up"] = (e["up"].as_u64().unwrap() + u64::from(p["state"] == "up")).into();
        }
    }
    out
}

fn acked(status: &HashMap<String, serde_json::Value>, path: &str) -> u64 {
    status[path]["messages_acked"].as_u64().unwrap()
}

fn paths_toml(extra: &str) -> String {
    format!(
        "paths = [{{ bind = \"127.0.0.2\" }}, {{ bind = \"127.0.0.3\" }}, {{ bind = \"127.0.0.4\" }}]\npath_timeout = \"1s\"\npath_keep_alive = \"500ms\"\npath_reconnect_max = \"300ms\"\n{extra}"
    )
}

/// `devices` devices each publish `each` numbered QoS 1 messages, in parallel; returns once
/// every one is acknowledged. `during(k)` runs after the k-th round.
async fn publish_all(
    gw: &sluice::app::RunningGateway,
    devices: usize,
    each: usize,
    pace: Duration,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for d in 0..devices {
        let mut dev = device(gw, &format!("dev{d}"), ProtocolVersion::V5).await;
        tasks.push(tokio::spawn(async move {
            for n in 0..each {
                let code = dev
                    .publish(
                        &format!("m/dev{d}"),
                        format!("{n}"),
                        QoS::AtLeastOnce,
                        false,
                    )
                    .await
                    .expect("publish acknowledged");
                assert_eq!(code, 0, "dev{d} message {n}");
                tokio::time::sleep(pace).await;
            }
        }));
    }
    tasks
}

/// Read what the cloud subscriber got until every device's last message arrived; check
/// that each device's messages came in order (a duplicate may repeat earlier ones).
async fn check_arrivals(sub: &mut sluice_testkit::TestClient, devices: usize, each: usize) {
    let mut max: HashMap<String, i64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut dups = 0;
    while max.len() < devices || max.values().any(|m| *m < each as i64 - 1) {
        assert!(Instant::now() < deadline, "not everything arrived: {max:?}");
        let Some(p) = sub.recv(Duration::from_secs(5)).await.expect("cloud recv") else {
            continue;
        };
        let topic = p.topic.to_string();
        let n: i64 = String::from_utf8_lossy(&p.payload).parse().unwrap();
        let m = max.entry(topic.clone()).or_insert(-1);
        assert!(
            n <= *m + 1,
            "{topic}: {n} arrived after {m}: a gap, order broken"
        );
        if n <= *m {
            dups += 1;
        }
        *m = (*m).max(n);
    }
    println!("all {devices}x{each} arrived in order per device; {dups} duplicates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_paths_all_carry_traffic_and_keep_each_devices_order() {
    let cloud = Cloud::start();
    let relay = PathRelay::start(cloud.broker.tls_addr()).await;
    // A window of 4 per path session: 24 devices with a message each in flight need all three
    // paths (with room to spare, minRTT would rightly keep to the fastest ones).
    let gw = gateway(
        1,
        &cloud.uplink_toml(Some(relay.addr), &paths_toml("inflight = 4")),
    );
    let admin = gw.admin_addr.unwrap();
    let mut sub = cloud.subscriber("sub", "m/#").await;
    let tasks = publish_all(&gw, 24, 40, Duration::ZERO).await;
    for t in tasks {
        t.await.unwrap();
    }
    check_arrivals(&mut sub, 24, 40).await;
    let st = paths_status(admin).await;
    println!("paths: {st:?}");
    for p in ["p0", "p1", "p2"] {
        assert!(acked(&st, p) > 0, "path {p} carried traffic: {st:?}");
    }
    let total: u64 = ["p0", "p1", "p2"].iter().map(|p| acked(&st, p)).sum();
    assert_eq!(
        total,
        24 * 40,
        "each message acknowledged once, on one path"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_path_loses_nothing_and_traffic_returns_when_it_is_restored() {
    let cloud = Cloud::start();
    let relay = PathRelay::start(cloud.broker.tls_addr()).await;
    // A window of 4 per path: 12 devices need every path, so a restored one is used again.
    let gw = gateway(
        1,
        &cloud.uplink_toml(Some(relay.addr), &paths_toml("inflight = 4")),
    );
    let admin = gw.admin_addr.unwrap();
    let mut sub = cloud.subscriber("sub", "m/#").await;
    let tasks = publish_all(&gw, 12, 120, Duration::from_millis(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.set("127.0.0.3", Mode::Cut);
    let cut_at = acked(&paths_status(admin).await, "p1");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let during = paths_status(admin).await;
    assert_eq!(during["p1"]["up"], 0, "the cut path is down: {during:?}");
    relay.set("127.0.0.3", Mode::Pass);
    let restored = Instant::now();
    let mut back = None;
    while restored.elapsed() < Duration::from_secs(5) {
        let st = paths_status(admin).await;
        if st["p1"]["up"] == 1 && acked(&st, "p1") > cut_at {
            back = Some(restored.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = back.expect("traffic returned to the restored path");
    println!("traffic on the restored path after {back:?}");
    assert!(
        back < Duration::from_secs(2),
        "restored path carries traffic within 2 s: {back:?}"
    );
    for t in tasks {
        t.await.unwrap();
    }
    check_arrivals(&mut sub, 12, 120).await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_path_is_declared_dead_within_path_timeout_and_its_messages_complete() {
    let cloud = Cloud::start();
    let relay = PathRelay::start(cloud.broker.tls_addr()).await;
    // A window of 4 per path: 12 devices need every path, so a restored one is used again.
    let gw = gateway(
        1,
        &cloud.uplink_toml(Some(relay.addr), &paths_toml("inflight = 4")),
    );
    let admin = gw.admin_addr.unwrap();
    let mut sub = cloud.subscriber("sub", "m/#").await;
    let tasks = publish_all(&gw, 12, 100, Duration::from_millis(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.set("127.0.0.2", Mode::Blackhole);
    let holed = Instant::now();
    let mut dead = None;
    while holed.elapsed() < Duration::from_secs(5) {
        let st = paths_status(admin).await;
        if st["p0"]["failovers_stalled"].as_u64().unwrap()
            + st["p0"]["failovers_dead"].as_u64().unwrap()
            > 0
        {
            dead = Some(holed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = dead.expect("the blackholed path was declared dead");
    println!("blackholed path declared dead after {dead:?} (path_timeout 1s)");
    // path_timeout, plus the keep-alive's own bound for an idle path (1.5 x 1 s), plus slack.
    assert!(dead <= Duration::from_millis(1800), "{dead:?}");
    for t in tasks {
        t.await.unwrap();
    }
    check_arrivals(&mut sub, 12, 100).await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spooled_backlog_drains_over_every_live_path() {
    let cloud = Cloud::start();
    let relay = PathRelay::start(cloud.broker.tls_addr()).await;
    for ip in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        relay.set(ip, Mode::Cut);
    }
    let dir = tempfile::tempdir().unwrap();
    let extra = format!(
        "{}\n[spool]\ndir = \"{}\"\nack = \"spool\"\n",
        cloud.uplink_toml(Some(relay.addr), &paths_toml("inflight = 4")),
        dir.path().display()
    );
    let gw = gateway(1, &extra);
    let admin = gw.admin_addr.unwrap();
    // Every path is down: devices are acknowledged by the spool and the records wait on disk.
    let tasks = publish_all(&gw, 12, 50, Duration::ZERO).await;
    for t in tasks {
        t.await.unwrap();
    }
    let mut sub = cloud.subscriber("sub", "m/#").await;
    for ip in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        relay.set(ip, Mode::Pass);
    }
    check_arrivals(&mut sub, 12, 50).await;
    let st = paths_status(admin).await;
    println!("backlog drained: {st:?}");
    for p in ["p0", "p1", "p2"] {
        assert!(
            acked(&st, p) > 0,
            "the backlog drained over path {p} too: {st:?}"
        );
    }
    gw.shutdown();
}

/// The high lane's paths on every shard, summed by name.
async fn high_paths(admin: SocketAddr) -> HashMap<String, u64> {
    let body = http_get(admin, "/api/v1/status").await;
    let json: serde_json::Value =
        serde_json::from_str(body.split("\r\n\r\n").nth(1).unwrap_or("")).expect("status json");
    let mut out = HashMap::new();
    for shard in json["shards"].as_array().unwrap() {
        for p in shard["uplinks"][0]["lanes"]["high"]["paths"]
            .as_array()
            .into_iter()
            .flatten()
        {
            *out.entry(p["name"].as_str().unwrap().to_string())
                .or_default() += p["messages_acked"].as_u64().unwrap();
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_high_lane_pinned_to_a_path_uses_it_and_fails_over_when_it_is_down() {
    let cloud = Cloud::start();
    let relay = PathRelay::start(cloud.broker.tls_addr()).await;
    let extra = format!(
        "[priority]\ndevices = {{ \"urgent*\" = 1 }}\n{}",
        cloud.uplink_toml(
            Some(relay.addr),
            &paths_toml("paths = [{ name = \"lte\", bind = \"127.0.0.2\" }, { name = \"dsl\", bind = \"127.0.0.3\" }]\nlane_path = \"dsl\"")
                .replacen("paths = [{ bind = \"127.0.0.2\" }, { bind = \"127.0.0.3\" }, { bind = \"127.0.0.4\" }]\n", "", 1)
        )
    );
    let gw = gateway(1, &extra);
    let admin = gw.admin_addr.unwrap();
    let mut sub = cloud.subscriber("sub", "u/#").await;
    let mut urgent = device(&gw, "urgent-1", ProtocolVersion::V5).await;
    // Both high-lane paths up first (until then the lane uses whichever path is).
    let up = common::eventually(Duration::from_secs(5), || {
        let body = std::thread::scope(|s| {
            s.spawn(|| {
                let mut c = std::net::TcpStream::connect(admin).unwrap();
                std::io::Write::write_all(
                    &mut c,
                    b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                )
                .unwrap();
                let mut out = String::new();
                std::io::Read::read_to_string(&mut c, &mut out).unwrap();
                out
            })
            .join()
            .unwrap()
        });
        body.matches("\"state\":\"up\"").count() >= 4
    })
    .await;
    assert!(up, "every path of both lanes connected");
    for n in 0..20 {
        urgent
            .publish("u/1", n.to_string(), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    let pinned = high_paths(admin).await;
    println!("high lane with dsl up: {pinned:?}");
    assert_eq!(pinned["dsl"], 20, "{pinned:?}");
    assert_eq!(pinned["lte"], 0, "{pinned:?}");
    relay.set("127.0.0.3", Mode::Cut);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for n in 20..30 {
        urgent
            .publish("u/1", n.to_string(), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    let failed_over = high_paths(admin).await;
    println!("high lane with dsl cut: {failed_over:?}");
    assert!(failed_over["lte"] >= 10, "{failed_over:?}");
    let mut seen = 0;
    while seen < 30 {
        let p = sub
            .recv(Duration::from_secs(5))
            .await
            .unwrap()
            .expect("all 30 arrive");
        let n: usize = String::from_utf8_lossy(&p.payload).parse().unwrap();
        assert!(n <= seen, "in order: {n} after {seen}");
        if n == seen {
            seen += 1;
        }
    }
    gw.shutdown();
}
