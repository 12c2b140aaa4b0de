//! Multipath uplinks over real links: a gateway namespace and a cloud namespace joined by k
//! veth pairs (`sluice_testkit::netns`), a real TLS Mosquitto in the cloud namespace (under
//! `mptcpize run` for the MPTCP case), the gateway started in-process from a thread inside the
//! gateway namespace (so all its threads and sockets live there), devices and the admin client
//! on threads inside the gateway namespace, the cloud subscriber inside the cloud namespace.
//!
//! Needs root (network namespaces); without it each test prints why it is skipped and passes.
//!
//! Asserted as a device and the cloud see it: every message a device saw acknowledged arrives,
//! each device's messages in order (duplicates of messages in flight at a failure allowed).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::app::{Gateway, RunningGateway};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::netns::{self, BedOptions, TestBed};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};

fn bed_or_skip(opts: BedOptions) -> Option<TestBed> {
    if let Err(why) = netns::available() {
        println!("skipped: {why}");
        return None;
    }
    Some(TestBed::new(opts).expect("build the test bed"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A TLS Mosquitto on the cloud's service address, started inside the cloud namespace.
fn cloud_broker(bed: &TestBed, pki: &TestPki, mptcp: bool) -> Mosquitto {
    let mut b = Mosquitto::builder()
        .tls(pki)
        .plain_listener(false)
        .bind_address(IpAddr::V4(bed.cloud_addr()));
    if mptcp {
        b = b.launcher(["mptcpize", "run"]);
    }
    bed.cloud
        .run(move || b.start())
        .expect("start the cloud broker")
}

/// Start a one-shard gateway inside the gateway namespace with this uplink section body.
fn gateway_in(bed: &TestBed, broker: SocketAddr, pki: &TestPki, uplink: &str) -> RunningGateway {
    let text = format!(
        "[gateway]\npin_threads = false\nshards = 1\n[mqtt]\nlisten = \"127.0.0.1:0\"\n[coap]\nenabled = false\n[admin]\nlisten = \"127.0.0.1:0\"\n[[uplink]]\nname = \"cloud\"\nurl = \"mqtts://{broker}\"\nca_file = \"{}\"\nserver_name = \"localhost\"\nclient_id = \"gw\"\nreconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\nkeep_alive = \"5s\"\n{uplink}\n",
        pki.ca_path().display()
    );
    let config = sluice::config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    bed.gw.run(move || {
        Gateway::build(config)
            .expect("build")
            .start()
            .expect("start")
    })
}

/// GET from the admin endpoint, from inside the gateway namespace.
fn admin_get(bed: &TestBed, admin: SocketAddr, path: &str) -> String {
    let path = path.to_string();
    bed.gw.run(move || {
        let mut s = std::net::TcpStream::connect(admin).expect("admin connect");
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.split("\r\n\r\n").nth(1).unwrap_or("").to_string()
    })
}

/// Poll `cond` every 20 ms from now; returns how long it took to hold. Panics naming `what`
/// (with the last value `cond` looked at) after `limit`.
fn until<T: std::fmt::Debug>(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> (bool, T),
) -> Duration {
    let from = Instant::now();
    loop {
        let (done, seen) = cond();
        if done {
            return from.elapsed();
        }
        assert!(
            from.elapsed() < limit,
            "{what} not within {limit:?}: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn status(bed: &TestBed, admin: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&admin_get(bed, admin, "/api/v1/status")).expect("status json")
}

fn metric(bed: &TestBed, admin: SocketAddr, prefix: &str) -> f64 {
    admin_get(bed, admin, "/metrics")
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `devices` devices each publish `each` numbered QoS 1 messages every `pace`, inside the
/// gateway namespace. Returns how many each saw acknowledged (in order, as they publish one
/// at a time).
fn run_devices(
    bed: &TestBed,
    mqtt: SocketAddr,
    devices: usize,
    each: usize,
    pace: Duration,
) -> std::thread::JoinHandle<Vec<usize>> {
    bed.gw.spawn(move || {
        runtime().block_on(async move {
            let mut tasks = Vec::new();
            for d in 0..devices {
                let (mut c, ack) = TestClient::connect(
                    mqtt,
                    ConnectOpts::new(ProtocolVersion::V5, format!("dev{d}")),
                )
                .await
                .expect("device connects");
                assert_eq!(ack.code, 0);
                c.set_ack_timeout(Duration::from_secs(30));
                tasks.push(tokio::spawn(async move {
                    let mut acked = 0;
                    for n in 0..each {
                        match c
                            .publish(&format!("m/dev{d}"), n.to_string(), QoS::AtLeastOnce, false)
                            .await
                        {
                            Ok(0) => acked += 1,
                            other => panic!("dev{d} message {n}: {other:?}"),
                        }
                        tokio::time::sleep(pace).await;
                    }
                    acked
                }));
            }
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        })
    })
}

/// A cloud subscriber inside the cloud namespace; stops when `stop` is set and nothing more
/// came for 2 s. Returns (topic, number) in arrival order.
fn subscribe(
    bed: &TestBed,
    broker: SocketAddr,
    pki: &TestPki,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<(String, usize)>> {
    let tls = pki.rustls_client_config(false);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let h = bed.cloud.spawn(move || {
        runtime().block_on(async move {
            let opts = ConnectOpts::v311("sub").with_tls(tls, "localhost");
            let (mut c, _) = TestClient::connect(broker, opts)
                .await
                .expect("subscriber connects");
            c.subscribe(&[("m/#", QoS::AtLeastOnce)])
                .await
                .expect("subscribe");
            ready_tx.send(()).unwrap();
            let mut got = Vec::new();
            let mut quiet_since = Instant::now();
            loop {
                match c.recv(Duration::from_millis(200)).await.expect("recv") {
                    Some(p) => {
                        quiet_since = Instant::now();
                        let n = String::from_utf8_lossy(&p.payload).parse().unwrap();
                        got.push((p.topic.to_string(), n));
                    }
                    None if stop.load(Ordering::Relaxed)
                        && quiet_since.elapsed() > Duration::from_secs(2) =>
                    {
                        return got;
                    }
                    None => {}
                }
            }
        })
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("subscriber ready");
    h
}

/// Every acknowledged message arrived, each device's in order (a repeat of an earlier one is
/// allowed: at-least-once). Returns the number of duplicates.
fn check(got: &[(String, usize)], acked: &[usize]) -> usize {
    let mut max: HashMap<&str, i64> = HashMap::new();
    let mut dups = 0;
    for (topic, n) in got {
        let m = max.entry(topic.as_str()).or_insert(-1);
        assert!(
            *n as i64 <= *m + 1,
            "{topic}: {n} arrived after {m}: order broken"
        );
        if (*n as i64) <= *m {
            dups += 1;
        }
        *m = (*m).max(*n as i64);
    }
    for (d, a) in acked.iter().enumerate() {
        let seen = max.get(format!("m/dev{d}").as_str()).copied().unwrap_or(-1);
        assert!(
            seen + 1 >= *a as i64,
            "dev{d}: {a} acknowledged, only up to {seen} arrived"
        );
    }
    dups
}

#[test]
fn an_mptcp_uplink_uses_two_subflows_and_survives_a_link_going_down_without_reconnecting() {
    let Some(bed) = bed_or_skip(BedOptions {
        links: 2,
        rate: Some("20mbit".into()),
        mptcp_endpoints: true,
        ..BedOptions::default()
    }) else {
        return;
    };
    let pki = TestPki::generate();
    let broker = cloud_broker(&bed, &pki, true);
    let gw = gateway_in(&bed, broker.tls_addr(), &pki, "mptcp = true");
    let admin = gw.admin_addr.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sub = subscribe(&bed, broker.tls_addr(), &pki, stop.clone());
    let devices = run_devices(&bed, gw.mqtt_addr, 8, 150, Duration::from_millis(20));

    // Subflows come from the kernel's path manager: wait for the second.
    let mut subflows = serde_json::Value::Null;
    until("a second subflow", Duration::from_secs(10), || {
        let st = status(&bed, admin);
        let m = st["shards"][0]["uplinks"][0]["lanes"]["normal"]["mptcp"].clone();
        let n = m["subflows"].as_array().map_or(0, Vec::len);
        subflows = m["subflows"].clone();
        (m["active"] == true && n >= 2, m)
    });
    println!("subflows before the cut: {subflows}");
    bed.cut(0).unwrap();
    println!("link 0 (the first subflow's) cut");
    let acked = devices.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let got = sub.join().unwrap();
    let dups = check(&got, &acked);
    println!(
        "{} messages acknowledged, {} arrived, {dups} duplicates",
        acked.iter().sum::<usize>(),
        got.len()
    );
    assert_eq!(acked.iter().sum::<usize>(), 8 * 150);
    let connects = metric(&bed, admin, "sluice_uplink_connects_total");
    assert_eq!(connects, 1.0, "the MPTCP session never reconnected");
    let st = status(&bed, admin);
    println!(
        "after: {}",
        st["shards"][0]["uplinks"][0]["lanes"]["normal"]["mptcp"]
    );
    gw.shutdown();
}

fn paths_toml(bed: &TestBed, extra: &str) -> String {
    let paths: Vec<String> = bed
        .links
        .iter()
        .map(|l| format!("{{ bind = \"{}\" }}", l.gw_addr))
        .collect();
    format!(
        "paths = [{}]\ninflight = 4\npath_timeout = \"1s\"\npath_keep_alive = \"500ms\"\npath_reconnect_max = \"500ms\"\n{extra}",
        paths.join(", ")
    )
}

/// Per shard 0 normal lane paths: name → the path's status object.
fn paths_of(st: &serde_json::Value) -> HashMap<String, serde_json::Value> {
    st["shards"][0]["uplinks"][0]["lanes"]["normal"]["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), p.clone()))
        .collect()
}

#[test]
fn per_path_sessions_lose_nothing_when_a_link_is_cut_and_use_it_again_when_it_returns() {
    let Some(bed) = bed_or_skip(BedOptions {
        links: 3,
        rate: Some("20mbit".into()),
        mptcp_endpoints: false,
        ..BedOptions::default()
    }) else {
        return;
    };
    let pki = TestPki::generate();
    let broker = cloud_broker(&bed, &pki, false);
    let gw = gateway_in(&bed, broker.tls_addr(), &pki, &paths_toml(&bed, ""));
    let admin = gw.admin_addr.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sub = subscribe(&bed, broker.tls_addr(), &pki, stop.clone());
    let devices = run_devices(&bed, gw.mqtt_addr, 12, 200, Duration::from_millis(15));
    std::thread::sleep(Duration::from_millis(800));
    let before = paths_of(&status(&bed, admin));
    for p in ["p0", "p1", "p2"] {
        assert_eq!(before[p]["state"], "up", "{before:?}");
    }
    bed.cut(1).unwrap();
    let down_after = until("the cut path down", Duration::from_secs(5), || {
        let ps = paths_of(&status(&bed, admin));
        (ps["p1"]["state"] != "up", ps)
    });
    println!("path p1 down {down_after:?} after its link was cut");
    std::thread::sleep(Duration::from_millis(700));
    let acked_before = paths_of(&status(&bed, admin))["p1"]["messages_acked"]
        .as_u64()
        .unwrap();
    bed.restore(1).unwrap();
    let back_after = until(
        "traffic on the restored path",
        Duration::from_secs(5),
        || {
            let ps = paths_of(&status(&bed, admin));
            (
                ps["p1"]["messages_acked"].as_u64().unwrap() > acked_before,
                ps,
            )
        },
    );
    println!("traffic on p1 again {back_after:?} after its link returned");
    assert!(back_after <= Duration::from_secs(2), "{back_after:?}");
    let acked = devices.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let got = sub.join().unwrap();
    let dups = check(&got, &acked);
    println!(
        "{} acknowledged, {} arrived, {dups} duplicates; paths: {:?}",
        acked.iter().sum::<usize>(),
        got.len(),
        paths_of(&status(&bed, admin))
    );
    assert_eq!(acked.iter().sum::<usize>(), 12 * 200);
    gw.shutdown();
}

#[test]
fn a_path_whose_link_blackholes_is_declared_dead_within_path_timeout() {
    let Some(bed) = bed_or_skip(BedOptions {
        links: 2,
        rate: None,
        mptcp_endpoints: false,
        ..BedOptions::default()
    }) else {
        return;
    };
    let pki = TestPki::generate();
    let broker = cloud_broker(&bed, &pki, false);
    let gw = gateway_in(&bed, broker.tls_addr(), &pki, &paths_toml(&bed, ""));
    let admin = gw.admin_addr.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sub = subscribe(&bed, broker.tls_addr(), &pki, stop.clone());
    let devices = run_devices(&bed, gw.mqtt_addr, 8, 150, Duration::from_millis(15));
    std::thread::sleep(Duration::from_millis(600));
    bed.blackhole(0).unwrap();
    let dead_after = until(
        "the blackholed path declared dead",
        Duration::from_secs(5),
        || {
            let ps = paths_of(&status(&bed, admin));
            let f = &ps["p0"]["failovers"];
            (
                f["stalled"].as_u64().unwrap() + f["dead"].as_u64().unwrap() > 0,
                ps,
            )
        },
    );
    println!("blackholed path p0 declared dead after {dead_after:?} (path_timeout 1s)");
    // path_timeout, or for an idle path 1.5 x its 1 s keep-alive; plus polling slack.
    assert!(dead_after <= Duration::from_millis(1800), "{dead_after:?}");
    let acked = devices.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let got = sub.join().unwrap();
    check(&got, &acked);
    assert_eq!(acked.iter().sum::<usize>(), 8 * 150);
    gw.shutdown();
}

#[test]
fn a_returning_link_carries_an_mptcp_subflow_again_within_two_seconds() {
    let Some(bed) = bed_or_skip(BedOptions {
        links: 2,
        rate: None,
        mptcp_endpoints: true,
        ..BedOptions::default()
    }) else {
        return;
    };
    let pki = TestPki::generate();
    let broker = cloud_broker(&bed, &pki, true);
    let gw = gateway_in(
        &bed,
        broker.tls_addr(),
        &pki,
        "mptcp = true\n[multipath]\ninterfaces = [\"g1\"]",
    );
    let admin = gw.admin_addr.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sub = subscribe(&bed, broker.tls_addr(), &pki, stop.clone());
    let devices = run_devices(&bed, gw.mqtt_addr, 4, 250, Duration::from_millis(20));
    let link1 = bed.links[1].gw_addr.to_string();
    // An established subflow leaving from link 1's address.
    // The local addresses of the established subflows leaving from link 1's address.
    let on_link1 = |st: &serde_json::Value| -> Vec<String> {
        st["shards"][0]["uplinks"][0]["lanes"]["normal"]["mptcp"]["subflows"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["state"] == "established")
            .filter_map(|f| f["local"].as_str())
            .filter(|l| l.starts_with(&format!("{link1}:")))
            .map(str::to_string)
            .collect()
    };
    let mut before = Vec::new();
    until(
        "a subflow on link 1 at the start",
        Duration::from_secs(10),
        || {
            before = on_link1(&status(&bed, admin));
            (!before.is_empty(), ())
        },
    );
    bed.cut(1).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    bed.restore(1).unwrap();
    let tx_at_restore = bed.tx_bytes(1);
    // The path is back when the kernel has made a new subflow from the link's address (the old
    // one is dead, though it may still be listed as established)...
    let back = until(
        "a new subflow on the returned link",
        Duration::from_secs(5),
        || {
            let st = status(&bed, admin);
            let now = on_link1(&st);
            (
                now.iter().any(|l| !before.contains(l)),
                (now, st["links"].clone()),
            )
        },
    );
    // ...and it carries the session's data (how soon depends on the kernel's scheduler).
    let carrying = until("data on the returned link", Duration::from_secs(10), || {
        (bed.tx_bytes(1) > tx_at_restore + 4096, bed.tx_bytes(1))
    });
    println!(
        "4 KiB of data on link 1 {:?} after it returned",
        back + carrying
    );
    let st = status(&bed, admin);
    println!(
        "subflow on link 1 again {back:?} after it returned; links: {}",
        st["links"]
    );
    assert!(back <= Duration::from_secs(2), "{back:?}");
    assert!(
        st["links"][0]["endpoint_refreshes"].as_u64().unwrap() >= 1,
        "{}",
        st["links"]
    );
    let acked = devices.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let got = sub.join().unwrap();
    check(&got, &acked);
    assert_eq!(metric(&bed, admin, "sluice_uplink_connects_total"), 1.0);
    gw.shutdown();
}

// --- The CoAP proxy with `paths` (issue 30, ADR 0012) ---

/// libcoap's `coap-server-notls` on the cloud's service address (plain TCP: per-path
/// connections need no MPTCP), started inside the cloud namespace; killed with the bed.
/// `None` (with the reason printed) when libcoap is not installed.
fn libcoap_in_cloud(bed: &TestBed) -> Option<std::process::Child> {
    if std::process::Command::new("coap-server-notls")
        .arg("-?")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_err()
    {
        println!("skipped: coap-server-notls (libcoap3-bin) is not installed");
        return None;
    }
    let child = bed
        .cloud
        .command("coap-server-notls")
        .args(["-A", &bed.cloud_addr().to_string(), "-p", "5683", "-v", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start coap-server-notls in the cloud namespace");
    let addr = SocketAddr::from((bed.cloud_addr(), 5683));
    bed.cloud.run(move || {
        let from = Instant::now();
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                from.elapsed() < Duration::from_secs(5),
                "coap-server-notls not listening"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    Some(child)
}

/// `[[coap.proxy]]` "cloud" to the bed's libcoap with one path per link.
fn proxy_paths_config(bed: &TestBed, extra: &str) -> sluice::config::Config {
    let paths: Vec<String> = bed
        .links
        .iter()
        .map(|l| format!("{{ bind = \"{}\" }}", l.gw_addr))
        .collect();
    let text = format!(
        "[[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://{}:5683\"\nprefix = \"cloud\"\npaths = [{}]\n{extra}\n",
        bed.cloud_addr(),
        paths.join(", ")
    );
    sluice::config::parse_unchecked_files(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn coap_request(
    code: sluice_proto::coap::Code,
    path: &[&str],
    payload: &[u8],
) -> sluice_proto::coap::Message {
    use sluice_proto::coap::{opt, Message, MsgType, Token};
    let mut m = Message::new(MsgType::Con, code, 1, Token::from_slice(b"d").unwrap());
    for p in path {
        m.add_option(opt::URI_PATH, bytes::Bytes::copy_from_slice(p.as_bytes()));
    }
    m.payload = bytes::Bytes::copy_from_slice(payload);
    m
}

/// Route and forward through `p` as the CoAP edge does; returns the answer and how long it took.
async fn proxy_call(
    p: &sluice::proxy::ShardProxies,
    req: sluice_proto::coap::Message,
) -> (sluice_proto::coap::Message, Duration) {
    let started = Instant::now();
    let route = p.route(&req).expect("claimed").expect("routable");
    let res = p.forward(route, req).await;
    (res, started.elapsed())
}

/// Per-path counters of upstream "cloud" on the test's one shard: name → (requests, state).
fn proxy_paths(m: &sluice::proxy::ProxyMetrics) -> Vec<(String, u64, i64)> {
    m.upstreams[0]
        .1
        .paths
        .iter()
        .map(|p| (p.name.clone(), p.requests.get(), p.state.get()))
        .collect()
}

#[test]
fn the_per_path_coap_proxy_spreads_requests_over_two_queueing_links() {
    let Some(bed) = bed_or_skip(BedOptions {
        links: 2,
        rate: Some("2mbit".into()),
        queue: netns::Queue::Ms(100),
        ..BedOptions::default()
    }) else {
        return;
    };
    let Some(_server) = libcoap_in_cloud(&bed) else {
        return;
    };
    let cfg = proxy_paths_config(&bed, "request_timeout = \"30s\"");
    // The operator's experiment of issue 30: 1,500 PUTs of 900 bytes, 64 at a time.
    let (codes, per_path, elapsed) = bed.gw.run(move || {
        runtime().block_on(tokio::task::LocalSet::new().run_until(async move {
            let metrics = Arc::new(sluice::proxy::ProxyMetrics::new(&cfg));
            let p = std::rc::Rc::new(sluice::proxy::ShardProxies::new(
                &cfg,
                metrics.clone(),
                None,
            ));
            let started = Instant::now();
            let next = std::rc::Rc::new(std::cell::Cell::new(0usize));
            let mut workers = Vec::new();
            for _ in 0..64 {
                let (p, next) = (p.clone(), next.clone());
                workers.push(tokio::task::spawn_local(async move {
                    let mut codes = Vec::new();
                    while next.get() < 1500 {
                        next.set(next.get() + 1);
                        let req = coap_request(
                            sluice_proto::coap::Code::PUT,
                            &["cloud", "example_data"],
                            &[b'x'; 900],
                        );
                        codes.push(proxy_call(&p, req).await.0.code);
                    }
                    codes
                }));
            }
            let mut codes = Vec::new();
            for w in workers {
                codes.extend(w.await.unwrap());
            }
            (codes, proxy_paths(&metrics), started.elapsed())
        }))
    });
    let link_bytes: Vec<u64> = (0..2).map(|i| bed.qdisc(i).0.bytes).collect();
    let drops: Vec<u64> = (0..2)
        .map(|i| bed.qdisc(i).0.drops + bed.qdisc(i).1.drops)
        .collect();
    println!(
        "1,500 PUTs of 900 B in {elapsed:?} ({:.0} req/s); per path (name, requests, state): {per_path:?}; bytes sent by the gateway per link {link_bytes:?}, drops {drops:?}",
        1500.0 / elapsed.as_secs_f64()
    );
    assert_eq!(codes.len(), 1500);
    assert!(
        codes.iter().all(|c| c.class() == 2),
        "every PUT answered 2.xx by the upstream: {:?}",
        codes.iter().filter(|c| c.class() != 2).collect::<Vec<_>>()
    );
    // 1,500 × 900 B ≈ 1.35 MB of requests: each link must carry a substantial share (the
    // issue's MPTCP run put 1.37 MB on one link and 1 byte on the other).
    for (i, b) in link_bytes.iter().enumerate() {
        assert!(
            *b > 400_000,
            "link {i} carried only {b} bytes: {link_bytes:?}"
        );
    }
    for (name, requests, _) in &per_path {
        assert!(*requests > 400, "path {name}: {per_path:?}");
    }
}

#[test]
fn a_cut_link_under_the_per_path_coap_proxy_retries_idempotent_requests_and_hangs_nothing() {
    let Some(bed) = bed_or_skip(BedOptions {
        links: 2,
        rate: Some("2mbit".into()),
        queue: netns::Queue::Ms(100),
        ..BedOptions::default()
    }) else {
        return;
    };
    let Some(_server) = libcoap_in_cloud(&bed) else {
        return;
    };
    let request_timeout = Duration::from_secs(5);
    let cfg = proxy_paths_config(
        &bed,
        "request_timeout = \"5s\"\npath_timeout = \"1s\"\nconnect_timeout = \"1s\"",
    );
    let bed = Arc::new(bed);
    let bed2 = bed.clone();
    let (puts, posts, before, after_cut, back) = bed.gw.run(move || {
        // The link watcher as the gateway runs it, inside the gateway namespace.
        let watcher = sluice::net::links::LinkWatcher::start(sluice::net::links::WatchSpec {
            interfaces: vec![],
            addrs: bed2.links.iter().map(|l| IpAddr::V4(l.gw_addr)).collect(),
            refresh_endpoints: false,
        })
        .expect("link watcher");
        let links = watcher.watch();
        runtime().block_on(tokio::task::LocalSet::new().run_until(async move {
            let metrics = Arc::new(sluice::proxy::ProxyMetrics::new(&cfg));
            let p = std::rc::Rc::new(sluice::proxy::ShardProxies::new(
                &cfg,
                metrics.clone(),
                Some(links),
            ));
            let stop = std::rc::Rc::new(std::cell::Cell::new(false));
            let mut workers = Vec::new();
            // 48 PUT workers (idempotent) and 16 POST workers (not), 900 B each, closed loop.
            for w in 0..64 {
                let (p, stop) = (p.clone(), stop.clone());
                let code = if w < 48 {
                    sluice_proto::coap::Code::PUT
                } else {
                    sluice_proto::coap::Code::POST
                };
                workers.push(tokio::task::spawn_local(async move {
                    let mut out = Vec::new();
                    while !stop.get() {
                        let req = coap_request(code, &["cloud", "example_data"], &[b'x'; 900]);
                        let (res, took) = proxy_call(&p, req).await;
                        out.push((code, res.code, took));
                    }
                    out
                }));
            }
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let before = proxy_paths(&metrics);
            bed2.cut(0).unwrap();
            println!("link 0 cut");
            tokio::time::sleep(Duration::from_secs(3)).await;
            let after_cut = proxy_paths(&metrics);
            bed2.restore(0).unwrap();
            println!("link 0 restored");
            let restored = Instant::now();
            let p0_at_restore = after_cut[0].1;
            let back = loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let now = proxy_paths(&metrics);
                if now[0].1 > p0_at_restore + 10 {
                    break Some(restored.elapsed());
                }
                if restored.elapsed() > Duration::from_secs(10) {
                    break None;
                }
            };
            tokio::time::sleep(Duration::from_millis(500)).await;
            stop.set(true);
            let mut all = Vec::new();
            for w in workers {
                all.extend(w.await.unwrap());
            }
            drop(watcher);
            let puts: Vec<_> = all
                .iter()
                .filter(|(c, _, _)| *c == sluice_proto::coap::Code::PUT)
                .map(|(_, r, t)| (*r, *t))
                .collect();
            let posts: Vec<_> = all
                .iter()
                .filter(|(c, _, _)| *c == sluice_proto::coap::Code::POST)
                .map(|(_, r, t)| (*r, *t))
                .collect();
            (puts, posts, before, after_cut, back)
        }))
    });
    let longest = puts
        .iter()
        .chain(posts.iter())
        .map(|(_, t)| *t)
        .max()
        .unwrap();
    let put_failed: Vec<_> = puts.iter().filter(|(c, _)| c.class() != 2).collect();
    let post_502 = posts
        .iter()
        .filter(|(c, _)| *c == sluice_proto::coap::Code::BAD_GATEWAY)
        .count();
    println!(
        "{} PUTs ({} not 2.xx), {} POSTs ({post_502} answered 5.02); longest request {longest:?}; paths before the cut {before:?}, 3 s after it {after_cut:?}; p0 carried requests again {back:?} after its link returned",
        puts.len(),
        put_failed.len(),
        posts.len()
    );
    assert!(before.iter().all(|(_, n, _)| *n > 0), "{before:?}");
    assert!(
        after_cut[1].1 > before[1].1,
        "p1 kept carrying requests: {after_cut:?}"
    );
    assert!(
        put_failed.is_empty(),
        "every PUT (idempotent) completed, retried on the other path when its own was cut: {put_failed:?}"
    );
    assert!(
        posts
            .iter()
            .all(|(c, _)| *c == sluice_proto::coap::Code::BAD_GATEWAY || c.class() < 5),
        "POSTs are answered by the upstream or 5.02, never 5.04: {:?}",
        posts
            .iter()
            .filter(|(c, _)| c.class() == 5)
            .collect::<Vec<_>>()
    );
    assert!(
        longest < request_timeout + Duration::from_millis(500),
        "nothing hangs past request_timeout: {longest:?}"
    );
    let back = back.expect("the returned link carries requests again");
    assert!(back <= Duration::from_secs(3), "{back:?}");
}
