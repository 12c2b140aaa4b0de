//! `scenario outage`: a cloud outage under load with sluice's durable spool (`[spool]`,
//! `ack = "spool"`), then the drain of the backlog interleaved with live traffic.
//!
//! Owns: the outage scenario — its parameters, the run's timeline (cut, restore, drain), the
//! analysis of what arrived when (`analysis`), the verdicts and the reports (`report`).
//! Uses from the harness: the cloud Mosquitto and PKI ([`crate::harness::cloud`]), the cuttable
//! relay that is the gateway's link to the cloud ([`crate::harness::link`]), sluice as a process
//! ([`crate::harness::sut::SluiceChild`]) and its `/metrics` ([`crate::harness::metrics`]), the
//! recording subscriber ([`crate::sinks::recorder`]) and the devices ([`crate::load::devices`]).
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
//!   within the *live* stream (sent after reconnect + guard, or after the first arrival after
//!   the reconnect when that is later: sluice's session is up by then). The two streams
//!   interleave by design (live first), so order across them is not checked; messages sent
//!   in between may be in either stream and are only checked for delivery.
//!
//! Everything shares the machine's cores; the report records nproc, CPU model, kernel,
//! `/proc/loadavg` at the start and end.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::time::{sleep, sleep_until, Instant};

use crate::harness::cloud::start_tls_cloud;
use crate::harness::disk::{default_dir, file_system};
use crate::harness::link::Link;
use crate::harness::machine::{loadavg, machine, Machine};
pub use crate::harness::metrics::metric_sum;
pub use crate::harness::metrics::MetricsSample;
use crate::harness::metrics::{ns_to_s, MetricsPoller};
use crate::harness::procfs::round3;
use crate::harness::sut::{require_sluice_bin, AggregateOpts, SluiceChild};
use crate::load::devices::{spawn_devices, DevicesConfig, DevicesReport, PayloadSize};
use crate::payload::unix_now_ns;
pub use crate::sinks::recorder::Arrival;
use crate::sinks::recorder::Recorder;

mod analysis;
mod report;

pub use analysis::{analyse, Analysis, Events};
pub use report::{markdown, verdicts, write_reports};

use crate::stats::{latency_histogram, record_us, LatencySummary};

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
        require_sluice_bin(&self.sluice_bin)?;
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
    /// The first few violations (at most [`MAX_VIOLATION_SAMPLES`]), to find their cause.
    pub first_violations: Vec<OrderViolation>,
}

/// How many violations [`OrderCheck`] keeps as samples.
pub const MAX_VIOLATION_SAMPLES: usize = 8;

/// One message that arrived after a later message of its device (same class), with both
/// messages' send and arrival times in ms relative to the cut.
#[derive(Debug, Clone, Serialize)]
pub struct OrderViolation {
    pub device: u32,
    pub backlog: bool,
    pub seq: u64,
    pub sent_ms: f64,
    pub received_ms: f64,
    /// The later message of the same device that arrived first.
    pub overtaken_by_seq: u64,
    pub overtaken_by_sent_ms: f64,
    pub overtaken_by_received_ms: f64,
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
    sluice.wait_uplink(&cloud).await?;

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
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\nmax_sessions = {max_connections}\n\n\
         [coap]\nenabled = false\n\n\
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

#[cfg(test)]
mod tests;
