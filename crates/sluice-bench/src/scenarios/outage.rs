//! `scenario outage`: a cloud outage under load with sluice's durable spool (`[spool]`,
//! `ack = "spool"`), then the drain of the backlog interleaved with live traffic.
//!
//! Owns: the outage scenario — a cloud Mosquitto (TLS 1.3, certificates generated for the
//! run), a relay that is the gateway's link to the cloud and can be cut, a recording
//! subscriber, sluice with a spool in a temporary directory on a real disk, the device fleet,
//! the analysis of what arrived when, and the report (JSON and Markdown). Does not own the
//! gateway, the broker, the devices ([`crate::load::devices`]) or sluice's process handling
//! ([`crate::harness::sut::SluiceChild`]).
//!
//! # Order of one run
//! 1. Cloud Mosquitto; the recorder connects to it directly and subscribes to `#` (QoS 1)
//!    before anything is published. The recorder never loses its connection: it keeps every
//!    arrival (device, seq, send time, arrival time, payload size) for the analysis.
//! 2. The *link*: a TCP relay in front of the broker's TLS port; sluice's uplink points at it.
//!    The outage is the link going away: every relayed connection is dropped and the listening
//!    socket is closed (sluice's reconnects are refused) for `outage`, then the relay listens
//!    again on the same port. The broker itself is not killed: Mosquitto (persistence off)
//!    would lose what it had acknowledged to sluice but not yet delivered to the subscriber,
//!    and the recorder's subscription, and that loss would be charged to the gateway.
//! 3. sluice starts with `[spool] dir` in a fresh directory (ack "spool", the rest sluice's
//!    defaults: fsync "interval" 10 ms, drain_share 0.5, oldest-first), `reconnect_max`
//!    (default 1 s, so the drain starts within about a second of the link returning instead of
//!    up to sluice's default 30 s back-off) and aggregation as given (default off: one PUBLISH
//!    per message, so per-device order is observable message by message).
//! 4. Devices publish (QoS 1, `rate` msg/s each) for `warmup + outage + after`. At `warmup`
//!    the link is cut; after `outage` it is restored; the *reconnect* is the relay's first
//!    accepted connection after that. The load keeps running for `after` (the drain happens
//!    under live traffic); then the runner waits up to `drain_max` for the rest.
//! 5. sluice's `/metrics` is polled every 500 ms (`sluice_spool_*`, summed over shards).
//!
//! # What is measured (from the recorder's arrivals; times are wall clock, same machine)
//! - Backlog at reconnect: distinct messages sent before the reconnect whose first arrival is
//!   after it (and their payload bytes); sluice's own view is the last `/metrics` sample before
//!   the reconnect (`sluice_spool_unacked_records`, `sluice_spool_bytes`) and the peak of
//!   `sluice_spool_backlog_records` after it.
//! - Drain time: reconnect → first arrival of the last message sent before the reconnect.
//! - Live latency: end-to-end (device send → recorder), first arrivals, for messages sent
//!   and delivered before the cut (after the ramp), sent during the drain (reconnect + guard →
//!   drain end) and after it; messages sent within the guard after the reconnect on their own
//!   (sluice's session may not be up yet, so they may travel as backlog).
//! - Device ack latency from the cut to the end of the load (devices are acknowledged by the
//!   spool while the cloud is away) and the PUBACKs received during the outage.
//! - Delivery: unique vs sent, duplicates, per-device gaps.
//! - Order, per device, by arrival: within the *backlog* (sent before reconnect − guard) and
//!   within the *live* stream (sent after reconnect + guard). The two streams interleave by
//!   design (live first), so order across them is not checked; messages sent within `guard`
//!   of the reconnect may be in either stream and are only checked for delivery.
//!
//! Everything shares the machine's cores; the report records nproc, CPU model, kernel,
//! `/proc/loadavg` at the start and end.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::BytesMut;
use hdrhistogram::Histogram;
use serde::Serialize;
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Packet, Properties, ProtocolVersion, PubResponse, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions,
};
use sluice_proto::senml;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{sleep, sleep_until, timeout, Instant};

use crate::conn;
use crate::harness::cloud::start_tls_cloud;
use crate::harness::machine::{loadavg, machine, Machine};
use crate::harness::procfs::round3;
use crate::harness::sut::{AggregateOpts, SluiceChild};
use crate::load::devices::{spawn_devices, DevicesConfig, DevicesReport, PayloadSize};
use crate::payload::{unix_now_ns, PayloadHeader};
use crate::scenarios::storage::{default_dir, file_system};
use crate::stats::{latency_histogram, record_us, LatencySummary};

/// How often sluice's `/metrics` is read.
const METRICS_EVERY: Duration = Duration::from_millis(500);
/// The recorder's keep-alive, seconds; it pings every half of it.
const KEEP_ALIVE_S: u16 = 60;

/// Everything one outage run needs. [`OutageScenario::new`] gives the configuration
/// (256 devices, 60 s outage), [`OutageScenario::quick`] a small one for tests.
#[derive(Debug, Clone)]
pub struct OutageScenario {
    pub sluice_bin: PathBuf,
    pub devices: u32,
    pub rate_per_device: f64,
    pub payload: PayloadSize,
    /// Device connections are spread over this.
    pub ramp: Duration,
    /// From the first device connection to the cut (includes the ramp).
    pub warmup: Duration,
    pub outage: Duration,
    /// How long the load keeps running after the link is restored.
    pub after: Duration,
    /// After the load stops: the longest wait for the remaining messages.
    pub drain_max: Duration,
    /// ... or stop waiting once nothing arrived for this long.
    pub drain_idle: Duration,
    /// sluice's `[gateway] shards`.
    pub shards: u32,
    pub aggregate: AggregateOpts,
    /// sluice's `reconnect_max` for the uplink, with unit.
    pub reconnect_max: String,
    /// Where the spool directory is created (default: `/var/tmp`, or the current directory
    /// when that is a tmpfs).
    pub spool_parent: Option<PathBuf>,
    /// Messages sent within this of the reconnect are not order-checked (either stream).
    pub order_guard: Duration,
    pub progress_every: Option<Duration>,
    pub command_line: String,
}

impl OutageScenario {
    /// The scenario: 256 devices × 10 msg/s, 100–1024 B, 15 s warm-up, 60 s outage,
    /// 60 s of load after it.
    pub fn new(sluice_bin: PathBuf) -> OutageScenario {
        OutageScenario {
            sluice_bin,
            devices: 256,
            rate_per_device: 10.0,
            payload: PayloadSize {
                min: 100,
                max: 1024,
            },
            ramp: Duration::from_secs(5),
            warmup: Duration::from_secs(15),
            outage: Duration::from_secs(60),
            after: Duration::from_secs(60),
            drain_max: Duration::from_secs(120),
            drain_idle: Duration::from_secs(10),
            shards: 2,
            aggregate: AggregateOpts::off(),
            reconnect_max: "1s".to_string(),
            spool_parent: None,
            order_guard: Duration::from_secs(1),
            progress_every: Some(Duration::from_secs(5)),
            command_line: String::new(),
        }
    }

    /// A small run for tests: 16 devices, 3 s warm-up, 5 s outage, 10 s after.
    pub fn quick(sluice_bin: PathBuf) -> OutageScenario {
        OutageScenario {
            devices: 16,
            ramp: Duration::from_secs(1),
            warmup: Duration::from_secs(3),
            outage: Duration::from_secs(5),
            after: Duration::from_secs(10),
            drain_max: Duration::from_secs(30),
            drain_idle: Duration::from_secs(5),
            ..OutageScenario::new(sluice_bin)
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        if !self.sluice_bin.is_file() {
            bail!(
                "sluice binary {} not found: build it with `cargo build --release -p sluice` or pass --sluice-bin",
                self.sluice_bin.display()
            );
        }
        if self.ramp >= self.warmup {
            bail!("the ramp must be shorter than the warm-up (the cut comes after every device connected)");
        }
        if self.outage.is_zero() {
            bail!("the outage must last longer than 0 s");
        }
        if self.devices == 0 || !(self.rate_per_device > 0.0 && self.rate_per_device.is_finite()) {
            bail!("at least one device and a positive rate are needed");
        }
        Ok(())
    }
}

/// Parameters as run.
#[derive(Debug, Clone, Serialize)]
pub struct OutageParams {
    pub devices: u32,
    pub rate_per_device: f64,
    pub offered_rate: f64,
    pub payload_min: usize,
    pub payload_max: usize,
    pub qos: u8,
    pub ramp_s: f64,
    pub warmup_s: f64,
    pub outage_s: f64,
    pub after_s: f64,
    pub drain_max_s: f64,
    pub order_guard_s: f64,
    pub sluice_bin: String,
    pub sluice_config: String,
    pub spool_dir_fs: String,
}

/// The run's timeline, seconds after the first device started.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    pub cut_s: f64,
    pub restored_s: f64,
    /// The relay's first accepted connection after the restore (sluice reconnecting).
    pub reconnect_s: f64,
    /// First arrival of the last message sent before the reconnect.
    pub drain_end_s: Option<f64>,
    /// The devices stopped publishing.
    pub load_end_s: f64,
}

/// The backlog the reconnect found.
#[derive(Debug, Clone, Serialize)]
pub struct Backlog {
    /// Distinct messages sent before the reconnect that first arrived after it.
    pub messages: u64,
    /// Their payload bytes.
    pub payload_bytes: u64,
    /// Of those, sent during the outage (cut → reconnect).
    pub sent_during_outage: u64,
    /// sluice's `sluice_spool_unacked_records` (sum over shards) in the last sample before the
    /// reconnect; `None` when the metric was not exposed.
    pub metric_unacked_records: Option<f64>,
    /// `sluice_spool_bytes` in that sample.
    pub metric_spool_bytes: Option<f64>,
    /// Peak of `sluice_spool_backlog_records` after the reconnect.
    pub metric_backlog_records_peak: Option<f64>,
    /// Seconds from the reconnect until `sluice_spool_backlog_records` read 0 again.
    pub metric_backlog_zero_after_s: Option<f64>,
}

/// Per-device order by arrival, first arrivals only.
#[derive(Debug, Clone, Serialize)]
pub struct OrderCheck {
    pub backlog_checked: u64,
    pub backlog_violations: u64,
    pub live_checked: u64,
    pub live_violations: u64,
    /// Messages sent within the guard of the reconnect (delivery checked, order not).
    pub unchecked_near_reconnect: u64,
    /// Devices with a live message that arrived before one of their older backlog messages
    /// (the interleaving the design intends).
    pub devices_with_live_before_backlog: u64,
}

/// First arrivals in one second of the run, by when the message was sent.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SecondCounts {
    /// Seconds after the first device started.
    pub t_s: u64,
    /// Messages sent before the reconnect.
    pub sent_before_reconnect: u64,
    /// Messages sent at or after the reconnect.
    pub sent_after_reconnect: u64,
}

/// One measured verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub check: String,
    pub pass: bool,
    pub detail: String,
}

/// One sample of sluice's spool metrics.
#[derive(Debug, Clone, Serialize)]
pub struct MetricsSample {
    pub t_s: f64,
    pub backlog_records: Option<f64>,
    pub unacked_records: Option<f64>,
    pub bytes: Option<f64>,
    pub appended: Option<f64>,
    pub acked: Option<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct OutageReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub loadavg_at_end: String,
    pub params: OutageParams,
    pub timeline: Timeline,
    pub sent: u64,
    pub acknowledged: u64,
    /// PUBACKs the devices received while the link was cut.
    pub acknowledged_during_outage: u64,
    pub unique_delivered: u64,
    pub deliveries: u64,
    pub duplicates: u64,
    /// sent − unique.
    pub lost: i64,
    /// Sequence numbers below a device's highest delivered one that never arrived.
    pub gaps: u64,
    pub backlog: Backlog,
    /// Drain time: reconnect → drain end.
    pub drain_s: Option<f64>,
    /// Whether the drain ended while the devices were still publishing.
    pub drain_ended_under_load: bool,
    pub e2e_before_outage: LatencySummary,
    pub e2e_live_during_drain: LatencySummary,
    pub e2e_live_after_drain: LatencySummary,
    /// Messages sent during the outage (cut → reconnect), first arrivals.
    pub e2e_backlog: LatencySummary,
    /// Messages sent within the order guard after the reconnect (before sluice's session is
    /// surely up they count as backlog in sluice), first arrivals.
    pub e2e_near_reconnect: LatencySummary,
    pub ack_latency_whole_run: LatencySummary,
    pub ack_latency_cut_to_end: LatencySummary,
    pub order: OrderCheck,
    pub verdicts: Vec<Verdict>,
    /// First arrivals per second, split by send time (before / after the reconnect).
    pub arrivals_per_second: Vec<SecondCounts>,
    pub metrics_samples: Vec<MetricsSample>,
    pub recorder_error: Option<String>,
    pub sluice_stderr_tail: String,
    pub devices: DevicesReport,
}

/// Run the scenario once.
pub async fn run_outage(config: &OutageScenario) -> anyhow::Result<OutageReport> {
    config.validate()?;
    let machine = machine(&config.command_line);
    let (pki, cloud) = start_tls_cloud().await?;

    let recorder = Recorder::start(cloud.tls_addr(), pki.ca_path()).await?;
    let link = Link::start(cloud.tls_addr()).await?;

    let spool_parent = config.spool_parent.clone().unwrap_or_else(default_dir);
    let spool_dir = tempfile::Builder::new()
        .prefix("sluice-bench-outage-spool-")
        .tempdir_in(&spool_parent)
        .with_context(|| format!("creating a spool directory in {}", spool_parent.display()))?;
    let spool_fs = file_system(spool_dir.path()).fs_type;
    let mqtt_port = sluice_testkit::free_port()?;
    let admin_port = sluice_testkit::free_port()?;
    let toml = outage_config(
        config,
        mqtt_port,
        admin_port,
        link.addr,
        pki.ca_path(),
        spool_dir.path(),
    );
    let sluice = SluiceChild::spawn(&config.sluice_bin, mqtt_port, toml)?;
    sluice.wait_ready().await?;
    cloud
        .wait_for_log_async("as sluice-gw", Duration::from_secs(15))
        .await
        .with_context(|| {
            format!(
                "sluice's uplink never connected to the cloud; sluice stderr:\n{}",
                sluice.stderr_tail()
            )
        })?;
    sleep(Duration::from_secs(1)).await;

    let load = config.warmup + config.outage + config.after;
    let mut devices_config = DevicesConfig::new(sluice.device_addr());
    devices_config.devices = config.devices;
    devices_config.rate_per_device = config.rate_per_device;
    devices_config.payload = config.payload;
    devices_config.duration = load;
    devices_config.ramp = config.ramp;
    // "Steady" latencies of the device report = from the cut to the end.
    devices_config.settle = config.warmup - config.ramp;
    devices_config.progress_every = config.progress_every;
    devices_config.drain_timeout = Duration::from_secs(10);
    let devices = spawn_devices(devices_config)?;
    let started = devices.started();
    let started_ns =
        unix_now_ns().saturating_sub(u64::try_from(started.elapsed().as_nanos()).unwrap_or(0));
    let metrics = MetricsPoller::start(admin_port, started_ns);

    sleep_until(started + config.warmup).await;
    let acked_at_cut = devices.counters().snapshot().acknowledged;
    let cut_ns = unix_now_ns();
    link.cut();
    eprintln!(
        "[outage  {:>6.1}s] link to the cloud cut for {:?}",
        started.elapsed().as_secs_f64(),
        config.outage
    );
    sleep(config.outage).await;
    let acked_at_restore = devices.counters().snapshot().acknowledged;
    let restored_ns = unix_now_ns();
    link.restore().await?;
    let reconnect_ns = link
        .wait_accept_after(restored_ns, Duration::from_secs(120))
        .await
        .with_context(|| {
            format!(
                "sluice did not reconnect within 120 s of the link's return; stderr:\n{}",
                sluice.stderr_tail()
            )
        })?;
    eprintln!(
        "[outage  {:>6.1}s] link restored; sluice reconnected {:.3} s later",
        started.elapsed().as_secs_f64(),
        (reconnect_ns.saturating_sub(restored_ns)) as f64 / 1e9
    );

    let devices_report = devices.wait().await?;
    let load_end_ns = started_ns + u64::try_from(load.as_nanos()).unwrap_or(u64::MAX);
    let drain_start = Instant::now();
    loop {
        let idle = recorder.idle_for();
        if recorder.unique() >= devices_report.sent
            || idle >= config.drain_idle
            || drain_start.elapsed() >= config.drain_max
        {
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    let samples = metrics.stop().await;
    let (arrivals, recorder_error) = recorder.stop().await;
    let loadavg_at_end = loadavg();
    let sluice_config = sluice.config_text().to_string();
    let sluice_stderr_tail = sluice.stderr_tail();
    drop(sluice);
    drop(link);
    drop(cloud);
    drop(pki);

    let events = Events {
        started_ns,
        steady_from_ns: started_ns + u64::try_from(config.ramp.as_nanos()).unwrap_or(0),
        cut_ns,
        reconnect_ns,
        load_end_ns,
        guard_ns: u64::try_from(config.order_guard.as_nanos()).unwrap_or(0),
    };
    let analysis = analyse(&arrivals, &events);
    let backlog = Backlog {
        messages: analysis.backlog_messages,
        payload_bytes: analysis.backlog_bytes,
        sent_during_outage: analysis.backlog_sent_during_outage,
        metric_unacked_records: samples
            .iter()
            .rev()
            .find(|s| secs_to_ns(started_ns, s.t_s) < reconnect_ns)
            .and_then(|s| s.unacked_records),
        metric_spool_bytes: samples
            .iter()
            .rev()
            .find(|s| secs_to_ns(started_ns, s.t_s) < reconnect_ns)
            .and_then(|s| s.bytes),
        metric_backlog_records_peak: samples
            .iter()
            .filter(|s| secs_to_ns(started_ns, s.t_s) >= reconnect_ns)
            .filter_map(|s| s.backlog_records)
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))),
        metric_backlog_zero_after_s: {
            let after: Vec<&MetricsSample> = samples
                .iter()
                .filter(|s| secs_to_ns(started_ns, s.t_s) >= reconnect_ns)
                .collect();
            let peaked = after
                .iter()
                .position(|s| s.backlog_records.is_some_and(|v| v > 0.0));
            peaked.and_then(|p| {
                after[p..]
                    .iter()
                    .find(|s| s.backlog_records == Some(0.0))
                    .map(|s| round3(s.t_s - ns_to_s(started_ns, reconnect_ns)))
            })
        },
    };
    let drain_s = analysis
        .drain_end_ns
        .map(|end| round3(end.saturating_sub(reconnect_ns) as f64 / 1e9));
    let drain_ended_under_load = analysis.drain_end_ns.is_some_and(|end| end <= load_end_ns);
    let sent = devices_report.sent;
    let lost = sent as i64 - analysis.unique as i64;
    let mut report = OutageReport {
        scenario: "outage",
        machine,
        loadavg_at_end,
        params: OutageParams {
            devices: config.devices,
            rate_per_device: config.rate_per_device,
            offered_rate: config.rate_per_device * f64::from(config.devices),
            payload_min: config.payload.min,
            payload_max: config.payload.max,
            qos: 1,
            ramp_s: config.ramp.as_secs_f64(),
            warmup_s: config.warmup.as_secs_f64(),
            outage_s: config.outage.as_secs_f64(),
            after_s: config.after.as_secs_f64(),
            drain_max_s: config.drain_max.as_secs_f64(),
            order_guard_s: config.order_guard.as_secs_f64(),
            sluice_bin: config.sluice_bin.display().to_string(),
            sluice_config,
            spool_dir_fs: spool_fs,
        },
        timeline: Timeline {
            cut_s: ns_to_s(started_ns, cut_ns),
            restored_s: ns_to_s(started_ns, restored_ns),
            reconnect_s: ns_to_s(started_ns, reconnect_ns),
            drain_end_s: analysis.drain_end_ns.map(|n| ns_to_s(started_ns, n)),
            load_end_s: ns_to_s(started_ns, load_end_ns),
        },
        sent,
        acknowledged: devices_report.acknowledged,
        acknowledged_during_outage: acked_at_restore.saturating_sub(acked_at_cut),
        unique_delivered: analysis.unique,
        deliveries: arrivals.len() as u64,
        duplicates: arrivals.len() as u64 - analysis.unique,
        lost,
        gaps: analysis.gaps,
        backlog,
        drain_s,
        drain_ended_under_load,
        e2e_before_outage: LatencySummary::from_histogram(&analysis.before),
        e2e_live_during_drain: LatencySummary::from_histogram(&analysis.live_during_drain),
        e2e_live_after_drain: LatencySummary::from_histogram(&analysis.live_after_drain),
        e2e_backlog: LatencySummary::from_histogram(&analysis.backlog),
        e2e_near_reconnect: LatencySummary::from_histogram(&analysis.near_reconnect),
        ack_latency_whole_run: devices_report.ack_latency,
        ack_latency_cut_to_end: devices_report.ack_latency_steady,
        order: analysis.order,
        verdicts: Vec::new(),
        arrivals_per_second: analysis.per_second,
        metrics_samples: samples,
        recorder_error,
        sluice_stderr_tail,
        devices: devices_report,
    };
    report.verdicts = verdicts(&report);
    Ok(report)
}

fn secs_to_ns(started_ns: u64, t_s: f64) -> u64 {
    started_ns + (t_s * 1e9) as u64
}

fn ns_to_s(started_ns: u64, ns: u64) -> f64 {
    round3((ns as f64 - started_ns as f64) / 1e9)
}

/// The generated sluice configuration: device listener, admin endpoint, the spool, one TLS 1.3
/// uplink through the link relay.
pub fn outage_config(
    config: &OutageScenario,
    mqtt_port: u16,
    admin_port: u16,
    link: SocketAddr,
    ca_file: &Path,
    spool_dir: &Path,
) -> String {
    let quote = |p: &Path| {
        p.display()
            .to_string()
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
    };
    let max_connections = (u64::from(config.devices) + 1024).max(10_000);
    format!(
        "# generated by sluice-bench scenario outage\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [spool]\ndir = \"{spool}\"\nack = \"spool\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://{link}\"\nca_file = \"{ca}\"\n\
         client_id = \"sluice-gw\"\nforward = [\"#\"]\nreconnect_min = \"100ms\"\nreconnect_max = \"{reconnect_max}\"\n{aggregate}",
        shards = config.shards,
        spool = quote(spool_dir),
        ca = quote(ca_file),
        reconnect_max = config.reconnect_max,
        aggregate = config.aggregate.toml(),
    )
}

// ---------------------------------------------------------------------------------------------
// Analysis (sans-IO: arrivals and event times in, figures out).

/// One PUBLISH-carried bench message as the recorder saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    pub device: u32,
    pub seq: u64,
    pub sent_at_ns: u64,
    pub received_ns: u64,
    pub payload_bytes: u32,
}

/// Event times of a run, ns since the UNIX epoch.
#[derive(Debug, Clone, Copy)]
pub struct Events {
    pub started_ns: u64,
    /// The ramp's end: "before the outage" latencies start here.
    pub steady_from_ns: u64,
    pub cut_ns: u64,
    pub reconnect_ns: u64,
    pub load_end_ns: u64,
    pub guard_ns: u64,
}

/// What [`analyse`] computes from the arrivals.
pub struct Analysis {
    /// Per second after the start: first arrivals of messages sent before the reconnect
    /// (pre-cut traffic and backlog) and after it (live).
    pub per_second: Vec<SecondCounts>,
    pub unique: u64,
    pub gaps: u64,
    pub backlog_messages: u64,
    pub backlog_bytes: u64,
    pub backlog_sent_during_outage: u64,
    pub drain_end_ns: Option<u64>,
    pub before: Histogram<u64>,
    pub live_during_drain: Histogram<u64>,
    pub live_after_drain: Histogram<u64>,
    pub backlog: Histogram<u64>,
    /// Sent within the guard after the reconnect (sluice's session may not be up yet: either
    /// stream).
    pub near_reconnect: Histogram<u64>,
    pub order: OrderCheck,
}

/// Classify every first arrival (in arrival order) by its send time relative to the events.
pub fn analyse(arrivals: &[Arrival], e: &Events) -> Analysis {
    let mut seen: HashSet<(u32, u64)> = HashSet::with_capacity(arrivals.len());
    let mut firsts: Vec<Arrival> = Vec::with_capacity(arrivals.len());
    for a in arrivals {
        if seen.insert((a.device, a.seq)) {
            firsts.push(*a);
        }
    }
    let backlog_firsts: Vec<&Arrival> = firsts
        .iter()
        .filter(|a| a.sent_at_ns < e.reconnect_ns && a.received_ns >= e.reconnect_ns)
        .collect();
    let drain_end_ns = backlog_firsts.iter().map(|a| a.received_ns).max();
    let drain_end = drain_end_ns.unwrap_or(e.reconnect_ns);
    let mut before = latency_histogram();
    let mut live_during_drain = latency_histogram();
    let mut live_after_drain = latency_histogram();
    let mut backlog = latency_histogram();
    let mut near_reconnect = latency_histogram();
    let mut max_seq: HashMap<u32, u64> = HashMap::new();
    let mut count: HashMap<u32, u64> = HashMap::new();
    // Per device: highest seq seen so far in the backlog and in the live stream.
    let mut backlog_high: HashMap<u32, u64> = HashMap::new();
    let mut live_high: HashMap<u32, u64> = HashMap::new();
    // Per device: lowest live seq arrived so far (for the interleaving count).
    let mut live_low: HashMap<u32, u64> = HashMap::new();
    let mut interleaved: HashSet<u32> = HashSet::new();
    let mut order = OrderCheck {
        backlog_checked: 0,
        backlog_violations: 0,
        live_checked: 0,
        live_violations: 0,
        unchecked_near_reconnect: 0,
        devices_with_live_before_backlog: 0,
    };
    for a in &firsts {
        let micros = a.received_ns.saturating_sub(a.sent_at_ns) / 1000;
        let m = max_seq.entry(a.device).or_insert(a.seq);
        *m = (*m).max(a.seq);
        *count.entry(a.device).or_insert(0) += 1;
        if a.sent_at_ns >= e.steady_from_ns && a.sent_at_ns < e.cut_ns {
            // In flight at the cut and delivered after the reconnect: part of the backlog.
            if a.received_ns < e.cut_ns {
                record_us(&mut before, micros);
            }
        } else if a.sent_at_ns >= e.cut_ns && a.sent_at_ns < e.reconnect_ns {
            record_us(&mut backlog, micros);
        } else if a.sent_at_ns >= e.reconnect_ns
            && a.sent_at_ns < e.reconnect_ns.saturating_add(e.guard_ns)
        {
            record_us(&mut near_reconnect, micros);
        } else if a.sent_at_ns >= e.reconnect_ns && a.sent_at_ns <= drain_end {
            record_us(&mut live_during_drain, micros);
        } else if a.sent_at_ns > drain_end {
            record_us(&mut live_after_drain, micros);
        }
        let (checked, violations, high) =
            if a.sent_at_ns.saturating_add(e.guard_ns) < e.reconnect_ns {
                if live_low.get(&a.device).is_some_and(|&low| low > a.seq) {
                    interleaved.insert(a.device);
                }
                (
                    &mut order.backlog_checked,
                    &mut order.backlog_violations,
                    &mut backlog_high,
                )
            } else if a.sent_at_ns >= e.reconnect_ns.saturating_add(e.guard_ns) {
                let low = live_low.entry(a.device).or_insert(a.seq);
                *low = (*low).min(a.seq);
                (
                    &mut order.live_checked,
                    &mut order.live_violations,
                    &mut live_high,
                )
            } else {
                order.unchecked_near_reconnect += 1;
                continue;
            };
        *checked += 1;
        match high.get_mut(&a.device) {
            Some(h) if *h > a.seq => *violations += 1,
            Some(h) => *h = a.seq,
            None => {
                high.insert(a.device, a.seq);
            }
        }
    }
    order.devices_with_live_before_backlog = interleaved.len() as u64;
    let mut per_second: Vec<SecondCounts> = Vec::new();
    for a in &firsts {
        let t = a.received_ns.saturating_sub(e.started_ns) / 1_000_000_000;
        let Ok(i) = usize::try_from(t) else { continue };
        if i >= 100_000 {
            continue;
        }
        while per_second.len() <= i {
            per_second.push(SecondCounts {
                t_s: per_second.len() as u64,
                sent_before_reconnect: 0,
                sent_after_reconnect: 0,
            });
        }
        if a.sent_at_ns < e.reconnect_ns {
            per_second[i].sent_before_reconnect += 1;
        } else {
            per_second[i].sent_after_reconnect += 1;
        }
    }
    let gaps = max_seq
        .iter()
        .map(|(d, &m)| (m + 1).saturating_sub(count.get(d).copied().unwrap_or(0)))
        .sum();
    Analysis {
        per_second,
        unique: firsts.len() as u64,
        gaps,
        backlog_messages: backlog_firsts.len() as u64,
        backlog_bytes: backlog_firsts
            .iter()
            .map(|a| u64::from(a.payload_bytes))
            .sum(),
        backlog_sent_during_outage: backlog_firsts
            .iter()
            .filter(|a| a.sent_at_ns >= e.cut_ns)
            .count() as u64,
        drain_end_ns,
        before,
        live_during_drain,
        live_after_drain,
        backlog,
        near_reconnect,
        order,
    }
}

/// The verdicts, from measured numbers only.
pub fn verdicts(r: &OutageReport) -> Vec<Verdict> {
    let mut v = Vec::new();
    v.push(Verdict {
        check: "every message delivered".to_string(),
        pass: r.lost == 0 && r.gaps == 0 && r.recorder_error.is_none(),
        detail: format!(
            "{} of {} sent reached the cloud ({} lost, {} gaps, {} duplicates)",
            r.unique_delivered, r.sent, r.lost, r.gaps, r.duplicates
        ),
    });
    v.push(Verdict {
        check: "every acknowledged message delivered".to_string(),
        pass: r.unique_delivered >= r.acknowledged && r.gaps == 0,
        detail: format!(
            "{} acknowledged by sluice, {} distinct delivered",
            r.acknowledged, r.unique_delivered
        ),
    });
    v.push(Verdict {
        check: "devices acknowledged during the outage".to_string(),
        pass: r.acknowledged_during_outage > 0,
        detail: format!(
            "{} PUBACKs while the link was cut; ack p99 cut→end {:.2} ms",
            r.acknowledged_during_outage, r.ack_latency_cut_to_end.p99_ms
        ),
    });
    v.push(Verdict {
        check: "per-device order within the backlog and within the live stream".to_string(),
        pass: r.order.backlog_violations == 0 && r.order.live_violations == 0,
        detail: format!(
            "backlog {} violations in {} checked, live {} in {} ({} near the reconnect not checked; \
             {} devices saw live messages overtake their backlog, by design)",
            r.order.backlog_violations,
            r.order.backlog_checked,
            r.order.live_violations,
            r.order.live_checked,
            r.order.unchecked_near_reconnect,
            r.order.devices_with_live_before_backlog
        ),
    });
    v.push(Verdict {
        check: "backlog drained while the load was running".to_string(),
        pass: r.drain_ended_under_load && r.drain_s.is_some(),
        detail: match r.drain_s {
            Some(d) => format!(
                "{} backlog messages drained in {d:.3} s after the reconnect",
                r.backlog.messages
            ),
            None => "no backlog arrived after the reconnect".to_string(),
        },
    });
    v
}

// ---------------------------------------------------------------------------------------------
// Report output.

/// The Markdown report.
pub fn markdown(r: &OutageReport) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let p = &r.params;
    let _ = writeln!(s, "# sluice-bench scenario outage\n");
    let _ = writeln!(
        s,
        "commit `{}`{} · {} × {} (nproc {}) · kernel {} · {} · loadavg at start `{}`, at end `{}` · started {}\n",
        m.commit,
        if m.worktree_dirty { " (work tree with uncommitted changes)" } else { "" },
        m.nproc,
        m.cpu_model,
        m.nproc,
        m.kernel,
        m.mosquitto_version,
        m.loadavg_at_start,
        r.loadavg_at_end,
        m.started_at
    );
    let _ = writeln!(s, "command: `{}`\n", m.command_line);
    let _ = writeln!(
        s,
        "{} devices × {} msg/s ({} msg/s offered), payload {}–{} B, QoS 1; warm-up {} s, link cut {} s, \
         load {} s more after the restore; spool on {} (ack \"spool\", sluice's default drain settings)\n",
        p.devices, p.rate_per_device, p.offered_rate, p.payload_min, p.payload_max, p.warmup_s,
        p.outage_s, p.after_s, p.spool_dir_fs
    );
    let t = &r.timeline;
    let _ = writeln!(
        s,
        "timeline (s after the first device): cut {:.3}, restored {:.3}, sluice reconnected {:.3}, \
         drain end {}, load end {:.3}\n",
        t.cut_s,
        t.restored_s,
        t.reconnect_s,
        t.drain_end_s.map_or("—".to_string(), |d| format!("{d:.3}")),
        t.load_end_s
    );
    let opt = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(s, "| measure | value |\n|---|---|");
    let _ = writeln!(
        s,
        "| sent / acknowledged by sluice | {} / {} |",
        r.sent, r.acknowledged
    );
    let _ = writeln!(
        s,
        "| acknowledged while the link was cut | {} |",
        r.acknowledged_during_outage
    );
    let _ = writeln!(
        s,
        "| delivered (distinct) / deliveries / duplicates / lost / gaps | {} / {} / {} / {} / {} |",
        r.unique_delivered, r.deliveries, r.duplicates, r.lost, r.gaps
    );
    let _ = writeln!(
        s,
        "| backlog at reconnect: messages (payload bytes) | {} ({:.1} MiB) |",
        r.backlog.messages,
        r.backlog.payload_bytes as f64 / 1048576.0
    );
    let _ = writeln!(
        s,
        "| sluice metrics before the reconnect: unacked records / spool bytes | {} / {} |",
        opt(r.backlog.metric_unacked_records),
        opt(r.backlog.metric_spool_bytes)
    );
    let _ = writeln!(
        s,
        "| sluice_spool_backlog_records peak after reconnect / back to 0 after | {} / {} |",
        opt(r.backlog.metric_backlog_records_peak),
        r.backlog
            .metric_backlog_zero_after_s
            .map_or("—".to_string(), |v| format!("{v:.1} s"))
    );
    let _ = writeln!(
        s,
        "| drain time (reconnect → last backlog message delivered) | {} |",
        r.drain_s.map_or("—".to_string(), |d| format!("{d:.3} s"))
    );
    let _ = writeln!(s, "\n| e2e latency, first arrivals | count | p50 ms | p99 ms | p99.9 ms | max ms |\n|---|---|---|---|---|---|");
    for (name, l) in [
        ("live, before the outage", &r.e2e_before_outage),
        (
            "live, during the drain (sent from reconnect + guard)",
            &r.e2e_live_during_drain,
        ),
        ("live, after the drain", &r.e2e_live_after_drain),
        ("backlog (sent during the outage)", &r.e2e_backlog),
        (
            "sent within the guard after the reconnect",
            &r.e2e_near_reconnect,
        ),
        ("device ack (PUBACK), cut → end", &r.ack_latency_cut_to_end),
        ("device ack (PUBACK), whole run", &r.ack_latency_whole_run),
    ] {
        let _ = writeln!(
            s,
            "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
            l.count, l.p50_ms, l.p99_ms, l.p999_ms, l.max_ms
        );
    }
    let _ = writeln!(s, "\n| verdict | result | measured |\n|---|---|---|");
    for v in &r.verdicts {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            v.check,
            if v.pass { "PASS" } else { "FAIL" },
            v.detail
        );
    }
    if let Some(e) = &r.recorder_error {
        let _ = writeln!(s, "\nrecorder error: {e}");
    }
    s
}

/// Write the JSON report (and Markdown, if asked).
pub fn write_reports(
    r: &OutageReport,
    json: Option<&Path>,
    md: Option<&Path>,
) -> anyhow::Result<()> {
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(r).context("serialising the report")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = md {
        std::fs::write(path, markdown(r)).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The link relay.

/// A TCP relay between sluice and the cloud broker that can be cut (every connection dropped,
/// the port closed) and restored (listening again on the same port).
struct Link {
    addr: SocketAddr,
    up: watch::Sender<bool>,
    accepts: Arc<Mutex<Vec<u64>>>,
    upstream: SocketAddr,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Link {
    async fn start(upstream: SocketAddr) -> anyhow::Result<Link> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the link relay")?;
        let addr = listener.local_addr()?;
        let (up, _) = watch::channel(true);
        let link = Link {
            addr,
            up,
            accepts: Arc::default(),
            upstream,
            task: Mutex::new(None),
        };
        link.serve(listener);
        Ok(link)
    }

    fn serve(&self, listener: TcpListener) {
        let mut up = self.up.subscribe();
        let accepts = self.accepts.clone();
        let upstream = self.upstream;
        let pipes_up = self.up.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = up.wait_for(|u| !*u) => return,
                    accepted = listener.accept() => {
                        let Ok((down, _)) = accepted else { continue };
                        accepts.lock().unwrap_or_else(|p| p.into_inner()).push(unix_now_ns());
                        tokio::spawn(pipe(down, upstream, pipes_up.subscribe()));
                    }
                }
            }
        });
        *self.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
    }

    /// Drop every relayed connection and close the port.
    fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Listen again on the same port.
    async fn restore(&self) -> anyhow::Result<()> {
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        self.up.send_replace(true);
        let mut last = None;
        for _ in 0..100 {
            match TcpListener::bind(self.addr).await {
                Ok(listener) => {
                    self.serve(listener);
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
            sleep(Duration::from_millis(50)).await;
        }
        Err(anyhow!(
            "re-binding the link relay on {}: {last:?}",
            self.addr
        ))
    }

    /// The first accepted connection at or after `after_ns`.
    async fn wait_accept_after(&self, after_ns: u64, wait: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(&t) = self
                .accepts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|&&t| t >= after_ns)
            {
                return Ok(t);
            }
            if Instant::now() >= deadline {
                bail!("no connection through the link within {wait:?}");
            }
            sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.up.send_replace(false);
    }
}

async fn pipe(mut down: TcpStream, upstream: SocketAddr, mut up: watch::Receiver<bool>) {
    let Ok(mut upper) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = down.set_nodelay(true);
    let _ = upper.set_nodelay(true);
    tokio::select! {
        _ = up.wait_for(|u| !*u) => {}
        _ = tokio::io::copy_bidirectional(&mut down, &mut upper) => {}
    }
}

// ---------------------------------------------------------------------------------------------
// The recorder.

struct RecorderLive {
    unique: AtomicU64,
    last_ms: AtomicU64,
}

/// A subscriber on the cloud broker that keeps every arrival.
struct Recorder {
    live: Arc<RecorderLive>,
    started: Instant,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<(Vec<Arrival>, Option<String>)>,
}

impl Recorder {
    async fn start(broker: SocketAddr, ca: &Path) -> anyhow::Result<Recorder> {
        let tls = conn::tls_client_config(ca, None)?;
        let mut io = conn::open(broker, Some((&tls, "127.0.0.1")), Duration::from_secs(10)).await?;
        let mut decoder = Decoder::client(ProtocolVersion::V311, conn::MAX_INBOUND_PACKET);
        let mut rbuf = BytesMut::with_capacity(64 * 1024);
        let mut wbuf = BytesMut::with_capacity(256);
        let connect = Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: KEEP_ALIVE_S,
            client_id: format!("outage-recorder-{}", std::process::id()).into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        };
        conn::handshake(
            &mut io,
            connect,
            &mut rbuf,
            &mut wbuf,
            &mut decoder,
            Duration::from_secs(10),
        )
        .await
        .context("the recorder connecting to the cloud")?;
        let subscribe = Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter {
                filter: "#".into(),
                options: SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                },
            }],
            properties: Properties::default(),
        });
        conn::send(&mut io, &subscribe, ProtocolVersion::V311, &mut wbuf).await?;
        match timeout(
            Duration::from_secs(10),
            conn::read_packet(&mut io, &mut rbuf, &mut decoder),
        )
        .await
        .map_err(|_| anyhow!("no SUBACK within 10 s"))??
        {
            Packet::SubAck(ack) if ack.codes.first().is_some_and(|&c| c < 0x80) => {}
            other => bail!("the recorder's subscription failed: {}", other.name()),
        }
        let live = Arc::new(RecorderLive {
            unique: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        });
        let started = Instant::now();
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(record(io, decoder, rbuf, live.clone(), started, stop_rx));
        Ok(Recorder {
            live,
            started,
            stop,
            task,
        })
    }

    fn unique(&self) -> u64 {
        self.live.unique.load(Relaxed)
    }

    fn idle_for(&self) -> Duration {
        let last = self.live.last_ms.load(Relaxed);
        self.started
            .elapsed()
            .saturating_sub(Duration::from_millis(last.saturating_sub(1)))
    }

    async fn stop(self) -> (Vec<Arrival>, Option<String>) {
        let _ = self.stop.send(true);
        match self.task.await {
            Ok(result) => result,
            Err(e) => (Vec::new(), Some(format!("the recorder task failed: {e}"))),
        }
    }
}

async fn record(
    mut io: Box<dyn conn::BrokerIo>,
    mut decoder: Decoder,
    mut rbuf: BytesMut,
    live: Arc<RecorderLive>,
    started: Instant,
    mut stop: watch::Receiver<bool>,
) -> (Vec<Arrival>, Option<String>) {
    let mut arrivals = Vec::new();
    let mut seen: HashSet<(u32, u64)> = HashSet::new();
    let mut wbuf = BytesMut::with_capacity(4096);
    let half = Duration::from_secs(u64::from(KEEP_ALIVE_S / 2));
    let mut ping = tokio::time::interval_at(Instant::now() + half, half);
    let error = loop {
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        tokio::select! {
            biased;
            _ = stop.changed() => break None,
            read = io.read_buf(&mut rbuf) => {
                match read {
                    Ok(0) => break Some("the cloud broker closed the recorder's connection".to_string()),
                    Err(e) => break Some(format!("reading from the cloud broker: {e}")),
                    Ok(_) => {}
                }
                let now = unix_now_ns();
                wbuf.clear();
                let mut failed = None;
                loop {
                    let packet = match decoder.decode(&mut rbuf) {
                        Ok(Some(p)) => p,
                        Ok(None) => break,
                        Err(e) => {
                            failed = Some(format!("the cloud broker sent a malformed packet: {e}"));
                            break;
                        }
                    };
                    let Packet::Publish(publish) = packet else { continue };
                    if let (Some(packet_id), QoS::AtLeastOnce) = (publish.packet_id, publish.qos) {
                        let ack = Packet::PubAck(PubResponse { packet_id, reason: 0, properties: None });
                        let _ = encode(&ack, ProtocolVersion::V311, &mut wbuf);
                    }
                    for a in bench_messages(&publish.payload, now) {
                        seen.insert((a.device, a.seq));
                        arrivals.push(a);
                    }
                }
                live.unique.store(seen.len() as u64, Relaxed);
                let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
                live.last_ms.store(ms + 1, Relaxed);
                if let Some(f) = failed {
                    break Some(f);
                }
                if !wbuf.is_empty() {
                    if let Err(e) = io.write_all(&wbuf).await {
                        break Some(format!("writing PUBACKs to the cloud broker: {e}"));
                    }
                }
            }
            _ = ping.tick() => {
                wbuf.clear();
                let _ = encode(&Packet::PingReq, ProtocolVersion::V311, &mut wbuf);
                if let Err(e) = io.write_all(&wbuf).await {
                    break Some(format!("writing PINGREQ to the cloud broker: {e}"));
                }
            }
        }
    };
    (arrivals, error)
}

/// The bench messages in one PUBLISH payload: the payload itself, or the `vd` records of a
/// SenML pack.
fn bench_messages(payload: &[u8], now: u64) -> Vec<Arrival> {
    let arrival = |h: PayloadHeader, len: usize| Arrival {
        device: h.device,
        seq: h.seq,
        sent_at_ns: h.sent_at_ns,
        received_ns: now,
        payload_bytes: u32::try_from(len).unwrap_or(u32::MAX),
    };
    if let Ok(h) = PayloadHeader::parse(payload) {
        return vec![arrival(h, payload.len())];
    }
    let Some(records) = senml::sniff(payload).and_then(|f| senml::decode(f, payload).ok()) else {
        return Vec::new();
    };
    records
        .into_iter()
        .filter_map(|r| match &r.value {
            Some(senml::Value::Data(d)) => {
                PayloadHeader::parse(d).ok().map(|h| arrival(h, d.len()))
            }
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// sluice's /metrics.

struct MetricsPoller {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<MetricsSample>>,
}

impl MetricsPoller {
    fn start(admin_port: u16, started_ns: u64) -> MetricsPoller {
        let (stop, mut stop_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(METRICS_EVERY);
            loop {
                tokio::select! {
                    _ = stop_rx.changed() => return samples,
                    _ = tick.tick() => {}
                }
                let t_s = ns_to_s(started_ns, unix_now_ns());
                if let Ok(Ok(text)) =
                    timeout(Duration::from_secs(2), http_get(admin_port, "/metrics")).await
                {
                    samples.push(MetricsSample {
                        t_s,
                        backlog_records: metric_sum(&text, "sluice_spool_backlog_records"),
                        unacked_records: metric_sum(&text, "sluice_spool_unacked_records"),
                        bytes: metric_sum(&text, "sluice_spool_bytes"),
                        appended: metric_sum(&text, "sluice_spool_records_appended_total"),
                        acked: metric_sum(&text, "sluice_spool_records_acked_total"),
                    });
                }
            }
        });
        MetricsPoller { stop, task }
    }

    async fn stop(self) -> Vec<MetricsSample> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

async fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await?;
    let text = String::from_utf8_lossy(&body).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map_or(text.clone(), |(_, b)| b.to_string()))
}

/// The sum of every sample of `name` (any labels) in a Prometheus text exposition; `None` when
/// there is none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            sum = Some(sum.unwrap_or(0.0) + v);
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(device: u32, seq: u64, sent_s: u64, recv_s: u64) -> Arrival {
        Arrival {
            device,
            seq,
            sent_at_ns: sent_s * 1_000_000_000,
            received_ns: recv_s * 1_000_000_000 + 1_000_000,
            payload_bytes: 100,
        }
    }

    #[test]
    fn metric_sum_adds_every_labelled_sample_and_ignores_other_names() {
        let text = "# HELP sluice_spool_bytes x\nsluice_spool_bytes{shard=\"0\",uplink=\"cloud\"} 10\n\
                    sluice_spool_bytes{shard=\"1\",uplink=\"cloud\"} 5\nsluice_spool_bytes_other 99\n";
        assert_eq!(metric_sum(text, "sluice_spool_bytes"), Some(15.0));
        assert_eq!(metric_sum(text, "sluice_spool_backlog_records"), None);
    }

    #[test]
    fn live_messages_overtaking_the_backlog_are_not_order_violations_but_reordering_within_a_stream_is(
    ) {
        // cut at 10 s, reconnect at 20 s; device 0 sent 0..=1 before, 2..=3 during the
        // outage, 4..=5 after the reconnect (guard 1 s).
        let e = Events {
            started_ns: 0,
            steady_from_ns: 0,
            cut_ns: 10_000_000_000,
            reconnect_ns: 20_000_000_000,
            load_end_ns: 40_000_000_000,
            guard_ns: 1_000_000_000,
        };
        let arrivals = vec![
            a(0, 0, 1, 1),
            a(0, 1, 2, 2),
            a(0, 4, 22, 22), // live first
            a(0, 2, 12, 23), // backlog
            a(0, 3, 13, 24),
            a(0, 3, 13, 24), // duplicate
            a(0, 5, 25, 25),
        ];
        let r = analyse(&arrivals, &e);
        assert_eq!(r.unique, 6);
        assert_eq!(r.gaps, 0);
        assert_eq!(r.backlog_messages, 2);
        assert_eq!(r.backlog_sent_during_outage, 2);
        assert_eq!(r.drain_end_ns, Some(24_001_000_000));
        assert_eq!(r.order.backlog_violations, 0);
        assert_eq!(r.order.live_violations, 0);
        assert_eq!(r.order.devices_with_live_before_backlog, 1);

        let swapped = vec![
            a(0, 0, 1, 1),
            a(0, 3, 13, 23),
            a(0, 2, 12, 24),
            a(0, 5, 25, 25),
        ];
        let r = analyse(&swapped, &e);
        assert_eq!(r.order.backlog_violations, 1);
        assert_eq!(r.gaps, 2, "seqs 1 and 4 never arrived");
    }
}
