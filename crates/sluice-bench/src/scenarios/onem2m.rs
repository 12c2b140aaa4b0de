//! `scenario onem2m`: contentInstances per second into a real ACME CSE, (1) from a plain
//! keep-alive, pipelined HTTP/1.1 client beside it (the CSE's own maximum on this machine), and
//! (2) through sluice (MQTT devices, QoS 1 → sluice's oneM2M uplink → ACME), and their ratio.
//!
//! Both phases write into a fresh ACME (in-memory database, waitress server; see
//! `sluice_testkit::acme`) so neither pays for the other's resources. The plain client
//! registers an AE and one container, then keeps `connections` connections busy with
//! `pipeline` create-contentInstance requests outstanding on each (the same request sluice
//! sends: `?rcn=0`, `cnf`/`con`, base64 of a binary payload of the devices' size) and counts
//! 2001 answers in the window. The sluice phase runs `sluice run` as a child with a oneM2M
//! uplink (`connections`, `pipeline` as given, container `{device}/{last}`) and MQTT 5 devices
//! from [`crate::load::devices`] offering `devices × rate` QoS 1 messages per second; a PUBACK
//! comes only after ACME's 2001, so acknowledged messages per second in the window is the rate
//! into ACME. The window starts after the ramp and a settle time, and ends before the devices
//! stop.
//!
//! A third phase shows what sluice itself can carry when the CSE is not the limit: the same
//! sluice and devices (offering `fast_devices × rate`), but in front of a stand-in CSE in this
//! process that answers every request at once with 201 / 2001 (and checks nothing else).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::BytesMut;
use serde::Serialize;
use sluice_testkit::Acme;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::machine::{machine, Machine};
use crate::harness::sut::SluiceChild;
use crate::load::devices::{spawn_devices, DevicesConfig};

/// The parameters (CLI defaults in [`OneM2mScenario::new`]).
#[derive(Debug, Clone)]
pub struct OneM2mScenario {
    pub sluice_bin: PathBuf,
    pub sluice_shards: u32,
    /// HTTP connections: the plain client's, and sluice's `connections` per shard.
    pub connections: usize,
    /// Requests outstanding per connection (plain client) / sluice's `pipeline`.
    pub pipeline: usize,
    pub devices: u32,
    pub rate_per_device: f64,
    /// Devices of the third phase (the stand-in CSE).
    pub fast_devices: u32,
    pub payload: usize,
    pub duration: Duration,
    pub ramp: Duration,
    pub settle: Duration,
    pub command_line: String,
}

impl OneM2mScenario {
    pub fn new(sluice_bin: PathBuf) -> OneM2mScenario {
        OneM2mScenario {
            sluice_bin,
            sluice_shards: 1,
            connections: 4,
            pipeline: 16,
            devices: 10,
            rate_per_device: 50.0,
            fast_devices: 100,
            payload: 128,
            duration: Duration::from_secs(30),
            ramp: Duration::from_secs(2),
            settle: Duration::from_secs(3),
            command_line: String::new(),
        }
    }
}

/// What was measured.
#[derive(Debug, Clone, Serialize)]
pub struct OneM2mReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub sluice_shards: u32,
    pub connections: usize,
    pub pipeline: usize,
    pub devices: u32,
    pub offered_rate: f64,
    pub payload_bytes: usize,
    pub window_s: f64,
    /// contentInstances per second the plain client got created (2001).
    pub cse_max_rate: f64,
    /// Answers other than 2001 the plain client saw.
    pub cse_errors: u64,
    /// Device messages per second acknowledged through sluice (each after ACME's 2001).
    pub sluice_rate: f64,
    pub sluice_rejected: u64,
    /// `sluice_rate / cse_max_rate`.
    pub ratio: f64,
    /// Whether ≥ 2,000 contentInstances/s went through sluice into ACME.
    pub target_2000_met: bool,
    /// Third phase: devices, and `fast_devices × rate` offered through sluice to the
    /// stand-in CSE.
    pub fast_devices: u32,
    pub fast_offered_rate: f64,
    /// Messages per second acknowledged through sluice with the stand-in CSE.
    pub sluice_fast_cse_rate: f64,
}

pub async fn run_onem2m(s: &OneM2mScenario) -> anyhow::Result<OneM2mReport> {
    crate::harness::sut::require_sluice_bin(&s.sluice_bin)?;
    let machine = machine(&s.command_line);
    let window = crate::harness::phases::uplink_window(s.duration, s.ramp, s.settle)?;

    eprintln!("onem2m: phase 1, plain pipelined HTTP client → ACME ({window:?})");
    let acme = tokio::task::spawn_blocking(Acme::start).await??;
    let (created, errors) = plain_client(acme.addr(), s, window).await?;
    drop(acme);
    let cse_max_rate = created as f64 / window.as_secs_f64();
    eprintln!("onem2m: ACME took {cse_max_rate:.0} contentInstances/s from the plain client ({errors} errors)");

    eprintln!("onem2m: phase 2, MQTT devices → sluice → ACME");
    let acme = tokio::task::spawn_blocking(Acme::start).await??;
    let (sluice_rate, sluice_rejected) = through_sluice(s, acme.addr(), s.devices, window).await?;
    drop(acme);
    eprintln!("onem2m: {sluice_rate:.0} messages/s acknowledged through sluice into ACME");

    eprintln!("onem2m: phase 3, MQTT devices → sluice → a stand-in CSE answering 2001 at once");
    let fast = FastCse::start().await?;
    let (sluice_fast_cse_rate, _) = through_sluice(s, fast.addr, s.fast_devices, window).await?;
    eprintln!(
        "onem2m: {sluice_fast_cse_rate:.0} messages/s acknowledged through sluice ({} contentInstances answered)",
        fast.created.load(Relaxed)
    );
    Ok(OneM2mReport {
        scenario: "onem2m",
        machine,
        sluice_shards: s.sluice_shards,
        connections: s.connections,
        pipeline: s.pipeline,
        devices: s.devices,
        offered_rate: f64::from(s.devices) * s.rate_per_device,
        payload_bytes: s.payload,
        window_s: window.as_secs_f64(),
        cse_max_rate,
        cse_errors: errors,
        sluice_rate,
        sluice_rejected,
        ratio: if cse_max_rate > 0.0 {
            sluice_rate / cse_max_rate
        } else {
            0.0
        },
        target_2000_met: sluice_rate >= 2000.0,
        fast_devices: s.fast_devices,
        fast_offered_rate: f64::from(s.fast_devices) * s.rate_per_device,
        sluice_fast_cse_rate,
    })
}

/// Run sluice in front of the CSE at `cse` with `devices` devices for the window: messages
/// per second acknowledged in it, and refusals.
async fn through_sluice(
    s: &OneM2mScenario,
    cse: SocketAddr,
    devices: u32,
    window: Duration,
) -> anyhow::Result<(f64, u64)> {
    let mqtt_port = sluice_testkit::free_port()?;
    let sluice = SluiceChild::spawn(&s.sluice_bin, mqtt_port, sluice_toml(s, mqtt_port, cse))?;
    sluice.wait_ready().await?;
    let run = spawn_devices(DevicesConfig::steady_qos1(
        sluice.device_addr(),
        devices,
        s.rate_per_device,
        s.payload,
        (s.duration, s.ramp, s.settle),
        "m",
    ))?;
    tokio::time::sleep(s.ramp + s.settle).await;
    let start = run.counters().snapshot();
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let end = run.counters().snapshot();
    let elapsed = t0.elapsed().as_secs_f64();
    let report = run.wait().await?;
    if end.acknowledged == start.acknowledged {
        bail!(
            "no message went through sluice; its stderr:\n{}",
            sluice.stderr_tail()
        );
    }
    Ok((
        (end.acknowledged - start.acknowledged) as f64 / elapsed,
        report.rejected,
    ))
}

/// A stand-in CSE: answers every request at once with 201 / X-M2M-RSC 2001 and an empty body,
/// counting contentInstance creates (phase 3).
struct FastCse {
    addr: SocketAddr,
    created: Arc<AtomicU64>,
}

impl FastCse {
    async fn start() -> anyhow::Result<FastCse> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let created = Arc::new(AtomicU64::new(0));
        let counter = created.clone();
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let _ = tcp.set_nodelay(true);
                    let mut buf = BytesMut::with_capacity(64 * 1024);
                    let mut out = Vec::new();
                    loop {
                        match tcp.read_buf(&mut buf).await {
                            Ok(n) if n > 0 => {}
                            _ => return,
                        }
                        out.clear();
                        while let Some(cin) = take_request(&mut buf) {
                            if cin {
                                counter.fetch_add(1, Relaxed);
                            }
                            out.extend_from_slice(
                                b"HTTP/1.1 201 Created\r\nX-M2M-RSC: 2001\r\nContent-Length: 0\r\n\r\n",
                            );
                        }
                        if tcp.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(FastCse { addr, created })
    }
}

/// Whether the first complete request in `buf` (removed) creates a contentInstance; `None`
/// while incomplete.
fn take_request(buf: &mut BytesMut) -> Option<bool> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return None,
    };
    let mut len = 0usize;
    let mut cin = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            len = std::str::from_utf8(h.value).ok()?.trim().parse().ok()?;
        } else if h.name.eq_ignore_ascii_case("content-type") {
            cin = h.value.ends_with(b"ty=4");
        }
    }
    if buf.len() < head + len {
        return None;
    }
    let _ = buf.split_to(head + len);
    Some(cin)
}

fn sluice_toml(s: &OneM2mScenario, mqtt_port: u16, acme: SocketAddr) -> String {
    let admin = sluice_testkit::free_port().unwrap_or(0);
    format!(
        "# generated by sluice-bench scenario onem2m\n[gateway]\nshards = {}\n\n[mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n[coap]\nenabled = false\n\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n\n[log]\nlevel = \"warn\"\n\n[[uplink]]\nname = \"acme\"\nurl = \"http://{acme}\"\nallow_plaintext = true\nprotocol = \"onem2m\"\ncse_id = \"/id-in\"\ncse_name = \"cse-in\"\noriginator = \"Csluice-bench\"\ncontainer = \"{{device}}/{{last}}\"\nconnections = {}\npipeline = {}\nforward = [\"#\"]\n",
        s.sluice_shards, s.connections, s.pipeline
    )
}

/// One POST on the wire.
fn request(target: &str, host: &str, ri: u64, ty: u8, body: &str) -> Vec<u8> {
    format!(
        "POST {target} HTTP/1.1\r\nHost: {host}\r\nX-M2M-Origin: Cbench\r\nX-M2M-RI: b{ri}\r\nX-M2M-RVI: 3\r\nAccept: application/json\r\nContent-Type: application/json;ty={ty}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Register, create a container, then pipeline creates on every connection for `window`.
async fn plain_client(
    addr: SocketAddr,
    s: &OneM2mScenario,
    window: Duration,
) -> anyhow::Result<(u64, u64)> {
    let host = addr.to_string();
    let mut setup = tokio::net::TcpStream::connect(addr).await?;
    for (target, ty, body) in [
        (
            "/~/id-in/cse-in",
            2,
            r#"{"m2m:ae": {"rn": "bench", "api": "Nbench", "rr": false, "srv": ["3"]}}"#,
        ),
        ("/~/id-in/cse-in/bench", 3, r#"{"m2m:cnt": {"rn": "c"}}"#),
    ] {
        setup
            .write_all(&request(target, &host, 0, ty, body))
            .await?;
        let mut buf = BytesMut::new();
        let rsc = loop {
            if let Some((rsc, _)) = take_response(&mut buf)? {
                break rsc;
            }
            if setup.read_buf(&mut buf).await? == 0 {
                bail!("ACME closed the set-up connection");
            }
        };
        if rsc != Some(2001) {
            bail!("ACME answered the set-up request {target} with RSC {rsc:?}");
        }
    }
    // The devices' payload: binary, so base64 (what sluice sends for it).
    let con = "A".repeat(s.payload.div_ceil(3) * 4);
    let body = format!(r#"{{"m2m:cin": {{"cnf": "application/octet-stream:2", "con": "{con}"}}}}"#);
    let created = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let counting = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = Instant::now() + s.settle + window + Duration::from_secs(1);
    let mut tasks = Vec::new();
    for c in 0..s.connections {
        let (created, errors, counting) = (created.clone(), errors.clone(), counting.clone());
        let (host, body, depth) = (host.clone(), body.clone(), s.pipeline);
        tasks.push(tokio::spawn(async move {
            let mut tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let target = "/~/id-in/cse-in/bench/c?rcn=0";
            let mut ri = (c as u64) << 40;
            let mut out = Vec::new();
            for _ in 0..depth {
                ri += 1;
                out.extend(request(target, &host, ri, 4, &body));
            }
            tcp.write_all(&out).await?;
            let mut buf = BytesMut::with_capacity(64 * 1024);
            while Instant::now() < stop {
                if tcp.read_buf(&mut buf).await? == 0 {
                    bail!("ACME closed a benchmark connection");
                }
                out.clear();
                while let Some((rsc, close)) = take_response(&mut buf)? {
                    if counting.load(Relaxed) {
                        if rsc == Some(2001) {
                            created.fetch_add(1, Relaxed);
                        } else {
                            errors.fetch_add(1, Relaxed);
                        }
                    }
                    if close {
                        bail!("ACME closes connections after each response: run it with [http.wsgi] enable=true");
                    }
                    ri += 1;
                    out.extend(request(target, &host, ri, 4, &body));
                }
                tcp.write_all(&out).await?;
            }
            anyhow::Ok(())
        }));
    }
    tokio::time::sleep(s.settle).await;
    counting.store(true, Relaxed);
    tokio::time::sleep(window).await;
    counting.store(false, Relaxed);
    let (created, errors) = (created.load(Relaxed), errors.load(Relaxed));
    for t in tasks {
        t.await??;
    }
    Ok((created, errors))
}

/// The RSC and `Connection: close` of the first complete response in `buf` (removed), if any.
/// ACME's waitress answers with Content-Length.
fn take_response(buf: &mut BytesMut) -> anyhow::Result<Option<(Option<u32>, bool)>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut res = httparse::Response::new(&mut headers);
    let head = match res.parse(buf)? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    let mut len = 0usize;
    let mut rsc = None;
    let mut close = false;
    for h in res.headers.iter() {
        let v = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            len = v.parse().context("Content-Length")?;
        } else if h.name.eq_ignore_ascii_case("x-m2m-rsc") {
            rsc = v.parse().ok();
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        }
    }
    if buf.len() < head + len {
        return Ok(None);
    }
    let _ = buf.split_to(head + len);
    Ok(Some((rsc, close)))
}

/// The Markdown summary.
pub fn markdown(r: &OneM2mReport) -> String {
    let mut out = String::from("# oneM2M uplink: contentInstances per second into ACME\n\n");
    out.push_str(&crate::report::markdown::machine_line(&r.machine, &[]));
    out.push_str(&format!(
        "\n\nCommand: `{}`\n\n| path | contentInstances/s | notes |\n|---|---:|---|\n| plain pipelined HTTP client → ACME (the CSE's maximum) | {:.0} | {} connections × {} pipelined, {} errors |\n| MQTT devices → sluice → ACME | {:.0} | {} devices offering {:.0} msg/s QoS 1, {} shard(s), {} × {} pipelined, {} refused |\n| MQTT devices → sluice → stand-in CSE (201 at once) | {:.0} | {} devices offering {:.0} msg/s: what sluice carries when the CSE is not the limit |\n\nsluice / CSE maximum: **{:.2}** · window {:.0} s · payload {} B (base64 in `con`) · ≥ 2,000/s through sluice: {}\n",
        r.machine.command_line,
        r.cse_max_rate,
        r.connections,
        r.pipeline,
        r.cse_errors,
        r.sluice_rate,
        r.devices,
        r.offered_rate,
        r.sluice_shards,
        r.connections,
        r.pipeline,
        r.sluice_rejected,
        r.sluice_fast_cse_rate,
        r.fast_devices,
        r.fast_offered_rate,
        r.ratio,
        r.window_s,
        r.payload_bytes,
        if r.target_2000_met { "yes" } else { "no" },
    ));
    out
}
