//! The `coap` scenario: CoAP sensors (closed loop, CoAPBench-like, [`crate::load::coap`])
//! publishing through sluice to the cloud Mosquitto, and the same load through libcoap's proxy
//! and sluice's proxy to a CoAP-over-TCP server.
//!
//! Owns: the modes, their set-up, the figures per (mode, N) and the verdicts. Does not own: the
//! generator, the cloud, sluice or libcoap.
//!
//! Modes, each run for every N in `sensors` (a fresh set of processes per point):
//! - `floor`: the generator against the in-process trivial responder ([`responder`]): the most
//!   any implementation can be measured at on this machine with this generator;
//! - `publish`: `POST /ps/bench/sensor-{i}?c=sensor-{i}` (CON, QoS 1 by default) to sluice, whose
//!   `[[uplink]]` goes to a TLS 1.3 cloud Mosquitto (aggregation off: one PUBLISH per request);
//!   the 2.04 follows the cloud's PUBACK. A subscriber on the cloud counts the PUBLISHes;
//!   delivery = PUBLISHes at the cloud ÷ 2.04s received;
//! - `proxy-libcoap`: the request (PUT or GET `/example_data`) with Proxy-Uri
//!   `coap+tcp://127.0.0.1:U/example_data` to `coap-server-notls -P ,sluice-bench-proxy`, which
//!   forwards it over TCP to an upstream `coap-server-notls` on U;
//! - `proxy-sluice`: the same request as `/cloud/example_data` to sluice with
//!   `[[coap.proxy]] name="cloud" url="coap+tcp://127.0.0.1:U" prefix="cloud"`, to the same
//!   kind of upstream.
//!
//! Per point: success responses per second and CPU of the process under test (sluice, or the
//! libcoap proxy; `/proc/<pid>/stat`) over the window `[warmup, duration]`; request→response
//! p50/p99 of requests sent in that window; timeouts; codes.
//!
//! Verdicts (issue 16): publish at the largest N: ≥ 30,000 req/s, p99 ≤ 20 ms, 100 %
//! delivered; proxy: sluice ≥ 2× libcoap's req/s at equal or lower CPU µs per request; and
//! whether the floor itself reaches 30,000 req/s (if not, no implementation could be measured
//! at the target on this machine).
//!
//! In the pure closed loop (CoAPBench: no think time) Little's law ties the figures: mean
//! latency = N ÷ rate, so "p99 ≤ 20 ms at N = 2000" needs ≥ 100,000 req/s from any
//! implementation; `--interval 64ms` caps each sensor (2000 × 1/64 ms ≈ 31,000 req/s offered)
//! so that the 30,000 req/s, p99 ≤ 20 ms target can be judged at an offered load that meets it.
//! The publish verdict prints the Little's-law figures for a pure closed-loop run.
//!
//! The final runs (release build; each about 3 minutes, 16 points):
//! ```text
//! cargo build --release -p sluice -p sluice-bench
//! # CoAPBench's closed loop, every mode, N = 250..2000:
//! target/release/sluice-bench scenario coap --sensors 250,500,1000,2000 --payload 16 \
//!     --duration 10s --warmup 3s --out docs/perf/coap.json --markdown docs/perf/coap.md
//! # the publish target at its offered load (≈ 31,000 req/s at N = 2000):
//! target/release/sluice-bench scenario coap --sensors 2000 --modes floor,publish \
//!     --interval 64ms --payload 16 --duration 10s --warmup 3s \
//!     --out docs/perf/coap-paced.json --markdown docs/perf/coap-paced.md
//! ```
//! Payloads 4 and 64 B: the same with `--payload 4` / `--payload 64`. A short trial:
//! `target/release/sluice-bench scenario coap --sensors 250,2000 --duration 5s --warmup 2s`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use sluice_proto::coap::Code;
use sluice_testkit::{Mosquitto, TestPki};
use tokio::time::{sleep, sleep_until, Instant};

use crate::harness::cloud::start_tls_cloud;
use crate::harness::libcoap::{free_udp_tcp_port, probe_coap, LibcoapServer};
use crate::harness::machine::{machine, Machine};
use crate::harness::phases::cloud_sink;
use crate::harness::procfs::{round3, CpuMeter, CpuUsage, Pid};
use crate::harness::sut::{require_sluice_bin, SluiceChild};
use crate::load::coap::responder::{self, Responder};
use crate::load::coap::tcp_upstream::TcpUpstream;
use crate::load::coap::{
    spawn_coap_load, CoapLoadConfig, CoapLoadReport, CoapWindow, RequestShape,
};
use crate::report::markdown::{loadavg_item, machine_line};
use crate::stats::LatencySummary;

/// Publish target at the largest N, req/s.
pub const TARGET_RATE: f64 = 30_000.0;
/// Publish target p99, ms.
pub const TARGET_P99_MS: f64 = 20.0;
/// sluice proxy ÷ libcoap proxy req/s target.
pub const TARGET_PROXY_RATIO: f64 = 2.0;

/// What a point puts under load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CoapMode {
    Floor,
    Publish,
    ProxyLibcoap,
    ProxySluice,
}

impl CoapMode {
    pub fn name(self) -> &'static str {
        match self {
            CoapMode::Floor => "floor",
            CoapMode::Publish => "publish",
            CoapMode::ProxyLibcoap => "proxy-libcoap",
            CoapMode::ProxySluice => "proxy-sluice",
        }
    }
}

/// The CoAP-over-TCP server behind the proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Upstream {
    /// The in-process trivial server ([`crate::load::coap::tcp_upstream`]); its CPU is this
    /// tool's.
    Responder,
    /// libcoap's `coap-server-notls` (loses pipelined requests: see `tcp_upstream`).
    Libcoap,
}

/// Parameters of the `coap` scenario.
#[derive(Debug, Clone, Serialize)]
pub struct CoapScenario {
    pub sensors: Vec<u32>,
    pub modes: Vec<CoapMode>,
    pub duration: Duration,
    pub ramp: Duration,
    pub warmup: Duration,
    pub payload: usize,
    /// Generator threads.
    pub threads: usize,
    /// Per-sensor minimum interval between request starts (zero: pure closed loop).
    pub interval: Duration,
    /// The proxy modes' method: GET or PUT.
    pub proxy_method: &'static str,
    /// The server behind both proxies.
    pub upstream: Upstream,
    pub sluice_bin: PathBuf,
    /// `[gateway] shards` (0 = one per core but one, at least one).
    pub sluice_shards: u32,
    /// After the load, wait until the cloud holds a PUBLISH per 2.04, or nothing new came for
    /// this long.
    pub drain_idle: Duration,
    pub command_line: String,
}

impl CoapScenario {
    /// Defaults: N = 250, 500, 1000, 2000; every mode; 10 s points (1 s ramp, 3 s warm-up);
    /// 16 B payloads; 2 generator threads; proxy PUT.
    pub fn new(sluice_bin: PathBuf) -> CoapScenario {
        CoapScenario {
            sensors: vec![250, 500, 1000, 2000],
            modes: vec![
                CoapMode::Floor,
                CoapMode::Publish,
                CoapMode::ProxyLibcoap,
                CoapMode::ProxySluice,
            ],
            duration: Duration::from_secs(10),
            ramp: Duration::from_secs(1),
            warmup: Duration::from_secs(3),
            payload: 16,
            threads: 2,
            interval: Duration::ZERO,
            proxy_method: "put",
            upstream: Upstream::Responder,
            sluice_bin,
            sluice_shards: 0,
            drain_idle: Duration::from_secs(3),
            command_line: String::new(),
        }
    }

    fn method(&self) -> Code {
        if self.proxy_method.eq_ignore_ascii_case("get") {
            Code::GET
        } else {
            Code::PUT
        }
    }
}

/// Publishes at the cloud against 2.04s at the sensors.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Delivery {
    /// 2.04 Changed responses the sensors received (whole run).
    pub changed: u64,
    /// PUBLISHes the cloud subscriber received.
    pub at_cloud: u64,
    /// `at_cloud ÷ changed` (1.0 = every acknowledged publish arrived).
    pub ratio: f64,
}

/// One (mode, N) point.
#[derive(Debug, Clone, Serialize)]
pub struct CoapPoint {
    pub mode: CoapMode,
    pub sensors: u32,
    /// The process measured (sluice, the libcoap proxy, or none for the floor).
    pub process: String,
    /// Its config or command line.
    pub process_config: String,
    pub window: CoapWindow,
    /// Requests first sent in the window.
    pub latency: LatencySummary,
    /// CPU of the process under test over the window (the floor: this tool's, responder
    /// included).
    pub cpu: CpuUsage,
    pub cpu_us_per_request: f64,
    /// The libcoap upstream's CPU (proxy modes).
    pub upstream_cpu_percent: Option<f64>,
    pub tool_cpu_percent: f64,
    pub delivery: Option<Delivery>,
    pub load: CoapLoadReport,
}

/// One verdict line.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub target: String,
    pub measured: String,
    pub met: bool,
}

/// Everything the `coap` scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct CoapReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: CoapScenario,
    pub points: Vec<CoapPoint>,
    pub verdicts: Vec<Verdict>,
}

/// Run every mode at every N.
pub async fn run_coap(config: &CoapScenario) -> anyhow::Result<CoapReport> {
    anyhow::ensure!(
        config.warmup < config.duration,
        "the warm-up must be shorter than the duration"
    );
    let uses_sluice = config
        .modes
        .iter()
        .any(|m| matches!(m, CoapMode::Publish | CoapMode::ProxySluice));
    if uses_sluice {
        require_sluice_bin(&config.sluice_bin)?;
    }
    let machine = machine(&config.command_line);
    let mut points = Vec::new();
    for &n in &config.sensors {
        for &mode in &config.modes {
            eprintln!("=== scenario coap: {} — {n} sensors ===", mode.name());
            let point = run_point(config, mode, n)
                .await
                .with_context(|| format!("{} with {n} sensors", mode.name()))?;
            eprintln!("{}", summary_line(&point));
            points.push(point);
        }
    }
    let verdicts = verdicts(&points);
    Ok(CoapReport {
        scenario: "coap",
        machine,
        params: config.clone(),
        points,
        verdicts,
    })
}

/// The processes of one point, held until it ends.
struct Setup {
    target: std::net::SocketAddr,
    request: RequestShape,
    measured: Option<(String, u32)>,
    upstream_pid: Option<u32>,
    process_config: String,
    cloud: Option<(TestPki, Mosquitto)>,
    _sluice: Option<SluiceChild>,
    _libcoap: Vec<LibcoapServer>,
    _responder: Option<Responder>,
    _tcp_upstream: Option<TcpUpstream>,
}

impl Setup {
    /// Start the upstream of `config`; its address.
    async fn upstream(&mut self, config: &CoapScenario) -> anyhow::Result<std::net::SocketAddr> {
        match config.upstream {
            Upstream::Responder => {
                let up = TcpUpstream::start().context("starting the CoAP-over-TCP upstream")?;
                let addr = up.addr();
                self.process_config =
                    format!("upstream: in-process CoAP-over-TCP responder on {addr}\n");
                self._tcp_upstream = Some(up);
                Ok(addr)
            }
            Upstream::Libcoap => {
                let up = blocking(|| LibcoapServer::server(free_udp_tcp_port()?)).await?;
                let addr = up.addr;
                self.upstream_pid = Some(up.pid());
                self.process_config = format!("upstream: {}\n", up.command_line);
                self._libcoap.push(up);
                Ok(addr)
            }
        }
    }
}

async fn set_up(config: &CoapScenario, mode: CoapMode) -> anyhow::Result<Setup> {
    let path = "/example_data";
    let mut setup = Setup {
        target: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        request: RequestShape::publish("ps", "bench"),
        measured: None,
        upstream_pid: None,
        process_config: String::new(),
        cloud: None,
        _sluice: None,
        _libcoap: Vec::new(),
        _responder: None,
        _tcp_upstream: None,
    };
    match mode {
        CoapMode::Floor => {
            let r = Responder::start(responder::Mode::Piggybacked)?;
            setup.target = r.addr();
            setup.process_config = "in-process responder (piggybacked 2.04)".to_string();
            setup._responder = Some(r);
        }
        CoapMode::ProxyLibcoap => {
            let up = setup.upstream(config).await?;
            let proxy = blocking(|| LibcoapServer::proxy(free_udp_tcp_port()?)).await?;
            setup.target = proxy.addr;
            setup.request =
                RequestShape::forward(config.method(), &format!("coap+tcp://{up}{path}"));
            setup.measured = Some(("coap-server-notls (proxy)".to_string(), proxy.pid()));
            setup.process_config =
                format!("proxy: {}\n{}", proxy.command_line, setup.process_config);
            setup._libcoap.push(proxy);
        }
        CoapMode::Publish | CoapMode::ProxySluice => {
            let (pki, cloud) = start_tls_cloud().await?;
            let upstream = if mode == CoapMode::ProxySluice {
                Some(setup.upstream(config).await?.port())
            } else {
                None
            };
            let coap_port = free_udp_tcp_port()?;
            let mqtt_port = sluice_testkit::free_port()?;
            let toml = sluice_coap_config(
                config.sluice_shards,
                mqtt_port,
                coap_port,
                cloud.tls_port(),
                &pki,
                upstream,
            )?;
            let sluice = SluiceChild::spawn(&config.sluice_bin, mqtt_port, toml.clone())?;
            sluice.wait_ready().await?;
            sluice.wait_uplink(&cloud).await?;
            setup.target = std::net::SocketAddr::from(([127, 0, 0, 1], coap_port));
            let target = setup.target;
            blocking(move || probe_coap(target, Duration::from_secs(10)))
                .await
                .with_context(|| {
                    format!("sluice's CoAP listener; stderr:\n{}", sluice.stderr_tail())
                })?;
            if mode == CoapMode::ProxySluice {
                setup.request = RequestShape::fixed(config.method(), &format!("/cloud{path}"));
            }
            setup.measured = Some(("sluice".to_string(), sluice.pid()));
            if mode == CoapMode::Publish {
                // The cloud broker's CPU beside sluice's: on a 2-core machine, generator,
                // sluice and broker share the cores, which bounds the rate and the latency.
                setup.upstream_pid = cloud.pid();
            }
            setup.process_config.push_str(&toml);
            setup._sluice = Some(sluice);
            setup.cloud = Some((pki, cloud));
        }
    }
    Ok(setup)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .context("a blocking start-up step panicked")?
}

async fn run_point(config: &CoapScenario, mode: CoapMode, n: u32) -> anyhow::Result<CoapPoint> {
    let setup = set_up(config, mode).await?;
    let sink = match &setup.cloud {
        Some((pki, cloud)) if mode == CoapMode::Publish => {
            Some(cloud_sink(pki, cloud, 0, None).await?)
        }
        _ => None,
    };
    let mut load_config = CoapLoadConfig::new(setup.target);
    load_config.sensors = n;
    load_config.threads = config.threads;
    load_config.duration = config.duration;
    load_config.ramp = config.ramp;
    load_config.warmup = config.warmup;
    load_config.payload = config.payload;
    load_config.interval = config.interval;
    load_config.request = setup.request.clone();
    let load = spawn_coap_load(load_config)?;
    let started = Instant::from_std(load.started());
    sleep_until(started + config.warmup).await;
    let pid = match &setup.measured {
        Some((_, pid)) => Pid::Other(*pid),
        None => Pid::OwnProcess,
    };
    let cpu = CpuMeter::start(pid)?;
    let upstream_cpu = setup
        .upstream_pid
        .map(|p| CpuMeter::start(Pid::Other(p)))
        .transpose()?;
    let tool_cpu = CpuMeter::start(Pid::OwnProcess)?;
    let window_start = Instant::now();
    let before = load.counters().snapshot();
    sleep_until(started + config.duration).await;
    let after = load.counters().snapshot();
    let window = CoapWindow::between(before, after, window_start.elapsed());
    let cpu = cpu.usage()?;
    let upstream_cpu_percent = match upstream_cpu {
        Some(m) => Some(m.usage()?.percent_of_one_core),
        None => None,
    };
    let tool_cpu_percent = tool_cpu.usage()?.percent_of_one_core;
    let report = load.finish().await?;

    let delivery = match sink {
        Some(sink) => {
            let changed = report.codes.get("2.04").copied().unwrap_or(0);
            let drain_start = Instant::now();
            while sink.received() < changed
                && sink.idle_for() < config.drain_idle
                && drain_start.elapsed() < Duration::from_secs(60)
            {
                sleep(Duration::from_millis(100)).await;
            }
            let at_cloud = sink.received();
            sink.stop(None).await?;
            Some(Delivery {
                changed,
                at_cloud,
                ratio: if changed == 0 {
                    0.0
                } else {
                    (at_cloud as f64 / changed as f64 * 1e6).round() / 1e6
                },
            })
        }
        None => None,
    };
    let per_request = window.success.max(1) as f64;
    Ok(CoapPoint {
        mode,
        sensors: n,
        process: setup
            .measured
            .as_ref()
            .map(|(name, _)| name.clone())
            .unwrap_or_else(|| "sluice-bench (generator + responder)".to_string()),
        process_config: setup.process_config.clone(),
        latency: report.latency,
        cpu_us_per_request: round3(cpu.cpu_seconds * 1e6 / per_request),
        cpu,
        upstream_cpu_percent,
        tool_cpu_percent,
        delivery,
        window,
        load: report,
    })
}

/// sluice with MQTT on `mqtt_port` and the CoAP listener on `coap_port`, one TLS uplink to the cloud (aggregation off),
/// and with `proxy_upstream` a `[[coap.proxy]]` "cloud" to `coap+tcp://127.0.0.1:PORT`.
pub fn sluice_coap_config(
    shards: u32,
    mqtt_port: u16,
    coap_port: u16,
    cloud_tls_port: u16,
    pki: &TestPki,
    proxy_upstream: Option<u16>,
) -> anyhow::Result<String> {
    let admin_port = sluice_testkit::free_port()?;
    let ca = pki
        .ca_path()
        .display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let proxy = match proxy_upstream {
        Some(port) => format!(
            "\n[[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"cloud\"\n"
        ),
        None => String::new(),
    };
    Ok(format!(
        "# generated by sluice-bench scenario coap\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n\
         [coap]\nenabled = true\nlisten = \"127.0.0.1:{coap_port}\"\n{proxy}\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://127.0.0.1:{cloud_tls_port}\"\nca_file = \"{ca}\"\n\
         client_id = \"sluice-gw\"\nforward = [\"#\"]\n\n\
         [uplink.aggregate]\nenabled = false\n"
    ))
}

fn summary_line(p: &CoapPoint) -> String {
    let delivery = p
        .delivery
        .map(|d| {
            format!(
                ", delivery {:.6} ({} at cloud / {} 2.04)",
                d.ratio, d.at_cloud, d.changed
            )
        })
        .unwrap_or_default();
    format!(
        "{} N={}: {:.0} req/s, p50/p99 {:.2}/{:.2} ms, timeouts {}, unfinished {}, {} CPU {:.1}% ({:.2} µs/req), tool CPU {:.1}%{delivery}",
        p.mode.name(),
        p.sensors,
        p.window.success_rate,
        p.latency.p50_ms,
        p.latency.p99_ms,
        p.load.totals.timeouts,
        p.load.unfinished,
        p.process,
        p.cpu.percent_of_one_core,
        p.cpu_us_per_request,
        p.tool_cpu_percent,
    )
}

fn find(points: &[CoapPoint], mode: CoapMode, n: u32) -> Option<&CoapPoint> {
    points.iter().find(|p| p.mode == mode && p.sensors == n)
}

/// In the pure closed loop the mean latency is N ÷ rate (Little's law): say what the p99
/// target then demands.
fn littles_law(p: &CoapPoint) -> String {
    if p.load.interval_ms > 0.0 {
        return String::new();
    }
    let n = f64::from(p.sensors);
    format!(
        " (closed loop without think time: mean latency = N ÷ rate = {:.1} ms; a mean ≤ {TARGET_P99_MS} ms at N = {} needs ≥ {:.0} req/s; `--interval {:.0}ms` offers the target's rate, {:.0} req/s per sensor)",
        n / p.window.success_rate.max(1e-9) * 1e3,
        p.sensors,
        n / (TARGET_P99_MS / 1e3),
        (n / TARGET_RATE * 1e3 - 2.0).floor(),
        TARGET_RATE / n
    )
}

/// The issue's targets, against what was measured.
fn verdicts(points: &[CoapPoint]) -> Vec<Verdict> {
    let mut out = Vec::new();
    let max_n = points.iter().map(|p| p.sensors).max().unwrap_or(0);
    if let Some(f) = find(points, CoapMode::Floor, max_n) {
        out.push(Verdict {
            target: format!(
                "floor: the generator alone reaches {TARGET_RATE:.0} req/s at N = {max_n} (else the publish target is out of reach of any implementation on this machine)"
            ),
            measured: format!("{:.0} req/s, p99 {:.2} ms", f.window.success_rate, f.latency.p99_ms),
            met: f.window.success_rate >= TARGET_RATE,
        });
    }
    if let Some(p) = find(points, CoapMode::Publish, max_n) {
        let d = p.delivery.map(|d| d.ratio).unwrap_or(0.0);
        out.push(Verdict {
            target: format!(
                "publish at N = {max_n}: ≥ {TARGET_RATE:.0} req/s, p99 ≤ {TARGET_P99_MS} ms, 100 % delivered"
            ),
            measured: format!(
                "{:.0} req/s, p99 {:.2} ms, delivery {:.6}, timeouts {}{}",
                p.window.success_rate,
                p.latency.p99_ms,
                d,
                p.load.totals.timeouts,
                littles_law(p)
            ),
            met: p.window.success_rate >= TARGET_RATE
                && p.latency.p99_ms <= TARGET_P99_MS
                && d >= 1.0,
        });
    }
    let mut ns: Vec<u32> = points.iter().map(|p| p.sensors).collect();
    ns.dedup();
    for n in ns {
        let (Some(s), Some(l)) = (
            find(points, CoapMode::ProxySluice, n),
            find(points, CoapMode::ProxyLibcoap, n),
        ) else {
            continue;
        };
        let ratio = s.window.success_rate / l.window.success_rate.max(1e-9);
        out.push(Verdict {
            target: format!(
                "proxy at N = {n}: sluice ≥ {TARGET_PROXY_RATIO}× libcoap's req/s at ≤ its CPU µs/request"
            ),
            measured: format!(
                "{:.0} vs {:.0} req/s ({ratio:.2}×), {:.2} vs {:.2} µs/req",
                s.window.success_rate,
                l.window.success_rate,
                s.cpu_us_per_request,
                l.cpu_us_per_request
            ),
            met: ratio >= TARGET_PROXY_RATIO && s.cpu_us_per_request <= l.cpu_us_per_request,
        });
    }
    out
}

/// The Markdown report: one table row per point, then the verdicts.
pub fn markdown(report: &CoapReport) -> String {
    let mut out = String::new();
    let p = &report.params;
    let _ = writeln!(
        out,
        "### CoAP: closed-loop CON sensors{}, {} B payloads, {} s per point ({} s warm-up), proxy {} to {:?} upstream\n",
        if p.interval.is_zero() {
            String::new()
        } else {
            format!(" (each at most one request per {:?})", p.interval)
        },
        p.payload,
        p.duration.as_secs_f64(),
        p.warmup.as_secs_f64(),
        p.proxy_method.to_uppercase(),
        p.upstream
    );
    let m = &report.machine;
    let _ = writeln!(out, "{}\n", machine_line(m, &[loadavg_item(m)]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(
        out,
        "| mode | N | req/s | p50 / p99 ms | timeouts / unfinished | process | CPU % | CPU µs/req | upstream (proxy modes) / cloud broker (publish) CPU % | generator CPU % | delivery (cloud ÷ 2.04) |\n|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
    );
    for q in &report.points {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.2} / {:.2} | {} / {} | {} | {:.1} | {:.2} | {} | {:.1} | {} |",
            q.mode.name(),
            q.sensors,
            q.window.success_rate,
            q.latency.p50_ms,
            q.latency.p99_ms,
            q.load.totals.timeouts,
            q.load.unfinished,
            q.process,
            q.cpu.percent_of_one_core,
            q.cpu_us_per_request,
            q.upstream_cpu_percent
                .map(|c| format!("{c:.1}"))
                .unwrap_or_else(|| "–".to_string()),
            q.tool_cpu_percent,
            q.delivery
                .map(|d| format!("{:.6} ({}/{})", d.ratio, d.at_cloud, d.changed))
                .unwrap_or_else(|| "–".to_string()),
        );
    }
    let _ = writeln!(
        out,
        "\nThe floor's CPU is this tool's (generator and responder together). Everything shares {} cores.\n",
        m.nproc
    );
    let _ = writeln!(out, "**Verdicts**\n");
    for v in &report.verdicts {
        let _ = writeln!(
            out,
            "- {} {} — measured {}",
            if v.met { "MET" } else { "NOT MET" },
            v.target,
            v.measured
        );
    }
    out
}
