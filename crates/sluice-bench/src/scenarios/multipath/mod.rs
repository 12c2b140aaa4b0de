//! `scenario multipath`: the multipath-proxy paper's experiment on this machine.
//!
//! k = 1, 2, 3 veth links between a gateway and a cloud network namespace
//! (`sluice_testkit::netns::TestBed`), each limited to the same rate with tbf on both ends;
//! CoAP sensors (the closed-loop generator of `scenario coap`) in the gateway namespace send
//! CON requests to sluice (a child process in the gateway namespace), whose `[[coap.proxy]]`
//! forwards them over an MPTCP `coap+tcp://` connection per shard to a CoAP-over-TCP server
//! listening with IPPROTO_MPTCP in the cloud namespace; the kernel's path manager adds one
//! subflow per extra link (`ip mptcp endpoint … subflow`). Per (k, N): successful requests/s
//! over the steady window, request latency p50/p99, sluice's CPU, the subflows sluice reports.
//! With `--kill-link-at`, link 0 (the connections' first subflow) loses its carrier at that
//! moment: the requests that failed (non-2.xx answers, timeouts, unfinished) and the longest
//! stall of throughput (consecutive 100 ms buckets under a tenth of the rate before the cut).
//!
//! Mode `coap-paths` (issue 30, ADR 0012): the same sensors and proxy, but `[[coap.proxy]]
//! paths` = one per link (each bound to its link's gateway address), one plain-TCP RFC 8323
//! connection per path, requests spread by sluice's scheduler instead of the kernel's.
//!
//! The upstream (`--upstream`): libcoap's `coap-server-notls` (default; under `mptcpize run`
//! for coap-mptcp) or the bench's own CoAP-over-TCP server. The links' tbf queue
//! (`--queue`): `drop` (a few ms: drops as soon as busy), `100ms`/`300ms` (queues like an LTE
//! uplink), `legacy` (the bed's 200 ms setting before issue 30). Each point also reports the
//! bytes, drops and overlimits of every link's qdisc on both ends.
//!
//! Mode `mqtt-paths`: MQTT devices (the `devices` generator, QoS 1, open loop at
//! `--mqtt-rate` each) in the gateway namespace publish to sluice, whose `[[uplink]]` has one
//! path per link (`paths`, each bound to its link's gateway address) to a plain-TCP Mosquitto in
//! the cloud namespace (no MPTCP there: per-path sessions are for brokers without it). Rate =
//! messages acknowledged to devices per second (after the cloud's PUBACK), latency = device
//! PUBLISH → PUBACK; with a cut, failed = messages sent and never acknowledged.
//!
//! Owns: the set-up, the sampling and the report of this scenario. Does not own: the
//! generator (`load::coap`), the server (`load::coap::tcp_upstream`), the namespaces (testkit).

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use sluice_testkit::netns::{self, BedOptions, Queue, TestBed};

use crate::harness::libcoap::{probe_coap, LibcoapServer};
use crate::harness::machine::{machine, Machine};
use crate::harness::procfs::{round3, CpuMeter, CpuUsage, Pid};
use crate::harness::sut::require_sluice_bin;
use crate::load::coap::tcp_upstream::TcpUpstream;
use crate::load::coap::{spawn_coap_load, CoapLoadConfig, CoapLoadReport, RequestShape};
use crate::report::markdown::{loadavg_item, machine_line};
use crate::stats::LatencySummary;

mod report;
pub use report::markdown;
use report::verdicts;

/// The paper's CoAP throughput over 1, 2 and 3 LTE paths (req/s), for the shape beside ours.
pub const PAPER_RATES: [(usize, &str); 3] = [(1, "1,600"), (2, "4,000–4,500"), (3, "5,900")];
const COAP_PORT: u16 = 5683;
const ADMIN_PORT: u16 = 9100;
const BUCKET: Duration = Duration::from_millis(100);

/// What carries the traffic over the links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MultipathMode {
    /// CoAP sensors → sluice's CoAP proxy → MPTCP `coap+tcp://`.
    CoapMptcp,
    /// CoAP sensors → sluice's CoAP proxy with one TCP connection per path (`paths`).
    CoapPaths,
    /// MQTT devices → sluice's per-path sessions → Mosquitto.
    MqttPaths,
}

impl MultipathMode {
    pub fn name(self) -> &'static str {
        match self {
            MultipathMode::CoapMptcp => "coap-mptcp",
            MultipathMode::CoapPaths => "coap-paths",
            MultipathMode::MqttPaths => "mqtt-paths",
        }
    }
}

/// The CoAP upstream in the cloud namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum UpstreamKind {
    /// libcoap's `coap-server-notls` (under `mptcpize run` for coap-mptcp).
    Libcoap,
    /// The bench's own CoAP-over-TCP server (`load::coap::tcp_upstream`).
    Builtin,
}

/// The scenario's parameters.
#[derive(Debug, Clone, Serialize)]
pub struct MultipathScenario {
    pub sluice_bin: PathBuf,
    pub modes: Vec<MultipathMode>,
    /// Messages per second per MQTT device (mode `mqtt-paths`).
    pub mqtt_rate: f64,
    pub links: Vec<usize>,
    pub sensors: Vec<u32>,
    /// tbf rate of every link, both directions (tc units).
    pub rate: String,
    /// tbf queue of every link; one set of points per entry.
    #[serde(serialize_with = "queue_names")]
    pub queues: Vec<Queue>,
    /// Payload bytes per request; one set of points per entry.
    pub payloads: Vec<usize>,
    pub upstream: UpstreamKind,
    pub duration: Duration,
    pub warmup: Duration,
    pub ramp: Duration,
    pub threads: usize,
    /// Cut link 0 this long after the start (`None`: no cut).
    pub kill_link_at: Option<Duration>,
    pub command_line: String,
}

impl MultipathScenario {
    pub fn new(sluice_bin: PathBuf) -> MultipathScenario {
        MultipathScenario {
            sluice_bin,
            modes: vec![MultipathMode::CoapMptcp, MultipathMode::MqttPaths],
            mqtt_rate: 20.0,
            links: vec![1, 2, 3],
            sensors: vec![250, 2000],
            rate: "1mbit".into(),
            queues: vec![Queue::Legacy],
            payloads: vec![16],
            upstream: UpstreamKind::Libcoap,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(3),
            ramp: Duration::from_secs(1),
            threads: 2,
            kill_link_at: None,
            command_line: String::new(),
        }
    }
}

fn queue_names<S: serde::Serializer>(q: &[Queue], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(q.iter().map(|q| q.name()))
}

/// One link's qdisc counters over a point (the bed is new for each point).
#[derive(Debug, Clone, Serialize)]
pub struct LinkCounters {
    /// Bytes the gateway side sent (requests, toward the cloud).
    pub gw_bytes: u64,
    /// Bytes the cloud side sent (responses).
    pub cloud_bytes: u64,
    /// Packets dropped by the two ends' tbf.
    pub drops: u64,
    /// Times the two ends' tbf held a packet back (the queue was used).
    pub overlimits: u64,
}

/// One (k, N) point.
#[derive(Debug, Clone, Serialize)]
pub struct MultipathPoint {
    pub mode: MultipathMode,
    pub queue: String,
    pub payload: usize,
    pub links: usize,
    pub sensors: u32,
    /// Successful requests per second over the steady window.
    pub rate: f64,
    pub latency: LatencySummary,
    pub sluice_cpu: CpuUsage,
    /// Subflows of sluice's upstream connections at the end (from /api/v1/status).
    pub subflows: usize,
    /// Whether every upstream connection used MPTCP.
    pub mptcp_active: bool,
    /// coap-mptcp: requests that did not succeed (non-2.xx answers, timeouts, unfinished).
    /// mqtt-paths: messages the devices never saw acknowledged by the end of the drain (an
    /// offered load above the links' capacity leaves some; none of them was acknowledged, so
    /// none is *lost* — the tests check that every acknowledged message arrives).
    pub failed: u64,
    /// With a cut: the longest run of 100 ms buckets under 10 % of the rate before it.
    pub stall_ms: Option<u64>,
    /// Successful requests per 100 ms bucket from the start.
    pub buckets: Vec<u64>,
    /// Every link's qdisc counters at the end of the point.
    pub link_counters: Vec<LinkCounters>,
    /// The generator's report.
    pub load: serde_json::Value,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub target: String,
    pub measured: String,
    pub met: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct MultipathReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: MultipathScenario,
    pub points: Vec<MultipathPoint>,
    pub verdicts: Vec<Verdict>,
}

/// Run every (k, N) point (blocking; needs root).
pub fn run_multipath(config: &MultipathScenario) -> anyhow::Result<MultipathReport> {
    netns::available()
        .map_err(|why| anyhow::anyhow!("scenario multipath needs network namespaces: {why}"))?;
    require_sluice_bin(&config.sluice_bin)?;
    anyhow::ensure!(
        config.warmup < config.duration,
        "the warm-up must be shorter than the duration"
    );
    let machine = machine(&config.command_line);
    let mut points = Vec::new();
    for &mode in &config.modes {
        for &queue in &config.queues {
            for &payload in &config.payloads {
                for &n in &config.sensors {
                    for &k in &config.links {
                        eprintln!(
                            "=== scenario multipath {}: {k} link(s) at {}, queue {}, {payload} B, N = {n} ===",
                            mode.name(),
                            config.rate,
                            queue.name()
                        );
                        let pt = PointSpec {
                            mode,
                            queue,
                            payload,
                            k,
                            n,
                        };
                        let p = run_point(config, pt).with_context(|| {
                            format!(
                                "{}: {k} links, queue {}, {payload} B, N = {n}",
                                mode.name(),
                                queue.name()
                            )
                        })?;
                        let per_link: Vec<String> = p
                            .link_counters
                            .iter()
                            .map(|l| {
                                format!("{}/{} B drops {}", l.gw_bytes, l.cloud_bytes, l.drops)
                            })
                            .collect();
                        eprintln!(
                            "{} queue {} {payload} B k={k} N={n}: {:.0} /s, p50/p99 {:.2}/{:.2} ms, subflows/paths {}, mptcp/all up {}, failed {}, stall {:?} ms, sluice CPU {:.1}%, links (gw/cloud sent) {}",
                            mode.name(), queue.name(), p.rate, p.latency.p50_ms, p.latency.p99_ms, p.subflows, p.mptcp_active, p.failed, p.stall_ms, p.sluice_cpu.percent_of_one_core, per_link.join(", ")
                        );
                        points.push(p);
                    }
                }
            }
        }
    }
    let verdicts = verdicts(config, &points);
    Ok(MultipathReport {
        scenario: "multipath",
        machine,
        params: config.clone(),
        points,
        verdicts,
    })
}

/// Which point to run.
#[derive(Debug, Clone, Copy)]
struct PointSpec {
    mode: MultipathMode,
    queue: Queue,
    payload: usize,
    k: usize,
    n: u32,
}

fn sluice_config(bed: &TestBed, mode: MultipathMode, broker_port: u16) -> String {
    if mode == MultipathMode::MqttPaths {
        let paths: Vec<String> = bed
            .links
            .iter()
            .map(|l| format!("{{ bind = \"{}\" }}", l.gw_addr))
            .collect();
        return format!(
            "# generated by sluice-bench scenario multipath (mqtt-paths)\n\
             [gateway]\nshards = 0\n\n\
             [mqtt]\nlisten = \"127.0.0.1:1883\"\nmax_connections = 20000\n\n\
             [coap]\nenabled = false\n\n\
             [admin]\nenabled = true\nlisten = \"127.0.0.1:{ADMIN_PORT}\"\n\n\
             [log]\nlevel = \"warn\"\n\n\
             [[uplink]]\nname = \"cloud\"\nurl = \"mqtt://{}:{broker_port}\"\nallow_plaintext = true\n\
             client_id = \"sluice-gw\"\nforward = [\"#\"]\npaths = [{}]\n\n\
             [uplink.aggregate]\nenabled = false\n",
            bed.cloud_addr(),
            paths.join(", ")
        );
    }
    let how = match mode {
        MultipathMode::CoapPaths => {
            let paths: Vec<String> = bed
                .links
                .iter()
                .map(|l| format!("{{ bind = \"{}\" }}", l.gw_addr))
                .collect();
            format!("paths = [{}]", paths.join(", "))
        }
        _ => "mptcp = true".to_string(),
    };
    format!(
        "# generated by sluice-bench scenario multipath ({})\n\
         [gateway]\nshards = 0\n\n\
         [mqtt]\nlisten = \"127.0.0.1:1883\"\n\n\
         [coap]\nenabled = true\nlisten = \"127.0.0.1:{COAP_PORT}\"\n\n\
         [[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://{}:{COAP_PORT}\"\nprefix = \"cloud\"\n{how}\n\
         max_outstanding = 1024\nmax_waiting = 8192\nrequest_timeout = \"30s\"\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{ADMIN_PORT}\"\n\n\
         [log]\nlevel = \"warn\"\n",
        mode.name(),
        bed.cloud_addr()
    )
}

fn admin_status(bed: &TestBed) -> anyhow::Result<serde_json::Value> {
    bed.gw.run(|| -> anyhow::Result<serde_json::Value> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", ADMIN_PORT))?;
        write!(
            s,
            "GET /api/v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let body = out.split("\r\n\r\n").nth(1).unwrap_or("");
        Ok(serde_json::from_str(body)?)
    })
}

fn run_point(config: &MultipathScenario, pt: PointSpec) -> anyhow::Result<MultipathPoint> {
    let PointSpec { mode, k, .. } = pt;
    let bed = TestBed::new(BedOptions {
        links: k,
        rate: Some(config.rate.clone()),
        mptcp_endpoints: mode == MultipathMode::CoapMptcp,
        queue: pt.queue,
    })
    .map_err(anyhow::Error::msg)?;
    let mut _upstream = None;
    let mut _libcoap = None;
    let mut _broker = None;
    let mut broker_port = 0;
    match mode {
        MultipathMode::CoapMptcp | MultipathMode::CoapPaths => {
            let up_addr = SocketAddr::from((bed.cloud_addr(), COAP_PORT));
            let mptcp = mode == MultipathMode::CoapMptcp;
            match config.upstream {
                UpstreamKind::Builtin => {
                    _upstream = Some(
                        bed.cloud
                            .run(move || TcpUpstream::start_on(up_addr, mptcp))
                            .context("starting the CoAP-over-TCP server in the cloud namespace")?,
                    );
                }
                UpstreamKind::Libcoap => {
                    let launcher: &'static [&'static str] =
                        if mptcp { &["mptcpize", "run"] } else { &[] };
                    _libcoap = Some(
                        bed.cloud
                            .run(move || LibcoapServer::server_on(up_addr, launcher))
                            .context("starting libcoap's server in the cloud namespace")?,
                    );
                }
            }
        }
        MultipathMode::MqttPaths => {
            let b = sluice_testkit::Mosquitto::builder()
                .bind_address(std::net::IpAddr::V4(bed.cloud_addr()));
            let broker = bed
                .cloud
                .run(move || b.start())
                .context("starting Mosquitto in the cloud namespace")?;
            broker_port = broker.plain_port();
            _broker = Some(broker);
        }
    }
    let dir = tempfile::tempdir()?;
    let conf = dir.path().join("sluice.toml");
    std::fs::write(&conf, sluice_config(&bed, mode, broker_port))?;
    let stderr = std::fs::File::create(dir.path().join("sluice.stderr"))?;
    let mut sluice = bed
        .gw
        .command(&config.sluice_bin.display().to_string())
        .args(["run", "-c"])
        .arg(&conf)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .context("starting sluice in the gateway namespace")?;
    let result = match mode {
        MultipathMode::CoapMptcp | MultipathMode::CoapPaths => {
            measure(config, &bed, sluice.id(), pt)
        }
        MultipathMode::MqttPaths => measure_mqtt(config, &bed, sluice.id(), pt),
    };
    let _ = sluice.kill();
    let _ = sluice.wait();
    result.with_context(|| {
        format!(
            "sluice stderr:\n{}",
            std::fs::read_to_string(dir.path().join("sluice.stderr")).unwrap_or_default()
        )
    })
}

/// Every link's qdisc counters, both ends.
fn link_counters(bed: &TestBed) -> Vec<LinkCounters> {
    (0..bed.links.len())
        .map(|i| {
            let (g, c) = bed.qdisc(i);
            LinkCounters {
                gw_bytes: g.bytes,
                cloud_bytes: c.bytes,
                drops: g.drops + c.drops,
                overlimits: g.overlimits + c.overlimits,
            }
        })
        .collect()
}

fn measure(
    config: &MultipathScenario,
    bed: &TestBed,
    pid: u32,
    pt: PointSpec,
) -> anyhow::Result<MultipathPoint> {
    let PointSpec { mode, k, n, .. } = pt;
    let target = SocketAddr::from(([127, 0, 0, 1], COAP_PORT));
    bed.gw
        .run(move || probe_coap(target, Duration::from_secs(10)))?;
    let mut load_config = CoapLoadConfig::new(target);
    load_config.sensors = n;
    load_config.threads = config.threads;
    load_config.duration = config.duration;
    load_config.ramp = config.ramp;
    load_config.warmup = config.warmup;
    load_config.payload = pt.payload;
    load_config.request = RequestShape::fixed(sluice_proto::coap::Code::PUT, "/cloud/example_data");
    let (tx, rx) = std::sync::mpsc::channel();
    let load = bed.gw.spawn(move || -> anyhow::Result<CoapLoadReport> {
        let load = spawn_coap_load(load_config)?;
        let _ = tx.send((load.counters().clone(), load.started()));
        load.wait()
    });
    let (counters, started) = rx.recv().context("the generator did not start")?;
    let sampled = sample(config, bed, pid, started, || counters.snapshot().success)?;
    let status = admin_status(bed).unwrap_or_default();
    let link_counters = link_counters(bed);
    let load = load
        .join()
        .map_err(|_| anyhow::anyhow!("the generator thread panicked"))??;
    let conns: Vec<&serde_json::Value> = status["coap_proxy"]
        .as_array()
        .map(|a| a.iter().filter(|u| !u["mptcp"].is_null()).collect())
        .unwrap_or_default();
    let (subflows, mptcp_active) = if mode == MultipathMode::CoapPaths {
        // Paths that carried requests; "active": every path connected at the end.
        let paths: Vec<&serde_json::Value> = status["coap_proxy"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|u| u["paths"].as_array().into_iter().flatten())
            .collect();
        let used: std::collections::BTreeSet<&str> = paths
            .iter()
            .filter(|p| p["requests"].as_u64().unwrap_or(0) > 0)
            .filter_map(|p| p["name"].as_str())
            .collect();
        (
            used.len(),
            !paths.is_empty() && paths.iter().all(|p| p["state"] == "connected"),
        )
    } else {
        let subflows = conns
            .iter()
            .map(|u| u["mptcp"]["subflows"].as_array().map_or(0, Vec::len))
            .sum();
        let active = !conns.is_empty() && conns.iter().all(|u| u["mptcp"]["active"] == true);
        (subflows, active)
    };
    let steady_s = (config.duration - config.warmup).as_secs_f64();
    let failed = load.totals.requests.saturating_sub(load.totals.success);
    Ok(MultipathPoint {
        mode,
        queue: pt.queue.name(),
        payload: pt.payload,
        links: k,
        sensors: n,
        rate: round3(sampled.window as f64 / steady_s),
        latency: load.latency,
        sluice_cpu: sampled.cpu,
        subflows,
        mptcp_active,
        failed,
        stall_ms: sampled.stall_ms,
        buckets: sampled.buckets,
        link_counters,
        load: serde_json::to_value(&load)?,
    })
}

/// What [`sample`] saw.
struct Sampled {
    /// Successes per 100 ms bucket from the start.
    buckets: Vec<u64>,
    /// Successes between the warm-up and the end.
    window: u64,
    /// sluice's CPU over the same window.
    cpu: CpuUsage,
    /// With `kill_link_at`: the longest stall after the cut.
    stall_ms: Option<u64>,
}

/// Sample `successes` (a running count) every 100 ms from `started` to the end of the run,
/// measure sluice's CPU from the warm-up on, and cut link 0 at `kill_link_at`.
fn sample(
    config: &MultipathScenario,
    bed: &TestBed,
    pid: u32,
    started: Instant,
    successes: impl Fn() -> u64,
) -> anyhow::Result<Sampled> {
    let (mut buckets, mut last, mut cpu, mut cut_bucket) = (Vec::new(), 0, None, None);
    let mut window_start = 0;
    let mut t = started;
    while t < started + config.duration {
        t += BUCKET;
        if let Some(d) = t.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let now = successes();
        buckets.push(now - last);
        last = now;
        let elapsed = t - started;
        if cpu.is_none() && elapsed >= config.warmup {
            cpu = Some(CpuMeter::start(Pid::Other(pid))?);
            window_start = now;
        }
        if let Some(at) = config.kill_link_at {
            if cut_bucket.is_none() && elapsed >= at {
                bed.cut(0).map_err(anyhow::Error::msg)?;
                cut_bucket = Some(buckets.len());
                eprintln!("link 0 cut at {elapsed:?}");
            }
        }
    }
    let window = successes() - window_start;
    let cpu = cpu.context("the run ended before the warm-up")?.usage()?;
    let stall_ms = cut_bucket.map(|at| longest_stall(&buckets, config.warmup, at));
    Ok(Sampled {
        buckets,
        window,
        cpu,
        stall_ms,
    })
}

/// The longest run of buckets after `at` under a tenth of the mean rate between the warm-up
/// and `at`, in ms.
fn longest_stall(buckets: &[u64], warmup: Duration, at: usize) -> u64 {
    let from = ((warmup.as_millis() / BUCKET.as_millis()) as usize).min(at);
    let before = &buckets[from..at];
    let base = before.iter().sum::<u64>() as f64 / before.len().max(1) as f64;
    let (mut longest, mut run) = (0u64, 0u64);
    for b in &buckets[at..] {
        if (*b as f64) < base / 10.0 {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    longest * BUCKET.as_millis() as u64
}

fn measure_mqtt(
    config: &MultipathScenario,
    bed: &TestBed,
    pid: u32,
    pt: PointSpec,
) -> anyhow::Result<MultipathPoint> {
    let PointSpec { k, n, .. } = pt;
    use crate::load::devices::{spawn_devices, DevicesConfig, DevicesReport, PayloadSize};
    // sluice's admin answering means it is up; its paths connect within a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_status(bed).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "sluice did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    let mut dc = DevicesConfig::new(SocketAddr::from(([127, 0, 0, 1], 1883)));
    dc.devices = n;
    dc.rate_per_device = config.mqtt_rate;
    dc.payload = PayloadSize {
        min: pt.payload.max(32),
        max: pt.payload.max(32),
    };
    dc.protocol = sluice_proto::mqtt::ProtocolVersion::V5;
    dc.duration = config.duration;
    dc.ramp = config.ramp;
    dc.settle = config.warmup.saturating_sub(config.ramp);
    dc.progress_every = None;
    dc.drain_timeout = Duration::from_secs(10);
    let threads = config.threads.max(1);
    let (tx, rx) = std::sync::mpsc::channel();
    let run = bed.gw.spawn(move || -> anyhow::Result<DevicesReport> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let run = spawn_devices(dc)?;
            let _ = tx.send((run.counters().clone(), run.started().into_std()));
            run.wait().await
        })
    });
    let (counters, started) = rx.recv().context("the devices did not start")?;
    let sampled = sample(config, bed, pid, started, || {
        counters.snapshot().acknowledged
    })?;
    let report = run
        .join()
        .map_err(|_| anyhow::anyhow!("the device thread panicked"))??;
    let status = admin_status(bed).unwrap_or_default();
    let paths: Vec<&serde_json::Value> = status["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| {
            s["uplinks"][0]["lanes"]["normal"]["paths"]
                .as_array()
                .into_iter()
                .flatten()
        })
        .collect();
    let used: std::collections::BTreeSet<&str> = paths
        .iter()
        .filter(|p| p["messages_acked"].as_u64().unwrap_or(0) > 0)
        .filter_map(|p| p["name"].as_str())
        .collect();
    let steady_s = (config.duration - config.warmup).as_secs_f64();
    let link_counters = link_counters(bed);
    Ok(MultipathPoint {
        mode: MultipathMode::MqttPaths,
        queue: pt.queue.name(),
        payload: pt.payload,
        links: k,
        sensors: n,
        rate: round3(sampled.window as f64 / steady_s),
        latency: report.ack_latency_steady,
        sluice_cpu: sampled.cpu,
        subflows: used.len(),
        mptcp_active: !paths.is_empty() && paths.iter().all(|p| p["state"] == "up"),
        failed: report.unacknowledged + report.rejected,
        stall_ms: sampled.stall_ms,
        buckets: sampled.buckets,
        link_counters,
        load: serde_json::to_value(&report)?,
    })
}
