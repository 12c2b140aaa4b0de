//! `scenario control-storm`: a steady data load through sluice while a storm of PHD control
//! messages rises — issue 18's experiment (the paper's "control storm"), run once with
//! association on the control plane (sluice's design) and once on the shard thread (the
//! `[phd] single_plane = true` experiment switch: the paper's single-plane curve). Also the
//! maximum rate of PHD scan reports sluice converts and delivers to a cloud Mosquitto.
//!
//! # The run
//! - **Cloud**: one Mosquitto on this machine, plain TCP (TLS would add the same cost to both
//!   plane modes and take CPU this 2-core machine does not have to spare), and one measuring
//!   subscriber on `#` ([`crate::sinks::fastsink::subscribe_measuring`], its own runtime
//!   thread `fastsink`): MQTT bench payloads give end-to-end latency and are counted as
//!   `unique`, PHD SenML messages as `foreign`.
//! - **SUT**: the release `sluice` binary, a fresh process per mode, `[gateway] shards = 1`,
//!   `pin_threads = true` (shard 0 on core 0), `control_core = 1` (`sluice-control`,
//!   `sluice-listener`, `sluice-phd` on core 1); `[phd] listen` with `get_mds = false` (the
//!   storm is exactly what issue 18 lists: association, configuration, release — the MDS GET
//!   would add one exchange per association) and `single_plane` per mode; no spool (devices
//!   and agents are answered after the cloud's PUBACK); one uplink `mqtt://` forwarding
//!   `phd/#` and `dev/#`, aggregation off (one PUBLISH per message).
//! - **Data load** (fixed offered rate through every level): `phd_agents` PHD agents
//!   ([`crate::load::phd`]: glucometers, standard config, one observation per report = one
//!   SenML message at the cloud) sending confirmed fixed scan reports at `phd_rate` in total,
//!   pipelined (window `phd_window`); and `mqtt_devices` MQTT devices
//!   ([`crate::load::paced`]) publishing QoS 1 at `mqtt_rate` in total. PHD latency is report
//!   → confirmation (sluice confirms only once the cloud acknowledged the message, so it
//!   includes the uplink); MQTT latency is send → arrival at the cloud subscriber (payload
//!   time stamp). The offered rate is chosen near what one shard sustains: see
//!   `docs/perf/control-storm.md` for how it was picked (from the scan-report maximum).
//! - **Storm** ([`crate::load::phd_storm`], its own runtime on `storm_threads` threads named
//!   `phd-storm`): short connections doing AARQ → AARE → (new agents: config report →
//!   response) → RLRQ → RLRE, half new agents with extended config `0x4000`, half returning
//!   ones whose configuration the gateway learnt earlier in the run. Stepped through `levels`
//!   (control messages/s: APDUs sent + answers read), each held `settle` and then measured
//!   over `window`. sluice's own count (`sluice_phd_control_messages_total`, in + out) is
//!   read from `/metrics` at both ends of each window as a cross-check.
//! - **Per level**: storm rate achieved (generator and sluice), sessions failed, data offered
//!   and delivered (msgs/s at the cloud, PHD + MQTT), PHD confirmation and MQTT end-to-end
//!   p50/p99, CPU per sluice thread (`/proc/PID/task/*/stat`: `sluice-shard-0`, `sluice-phd`,
//!   the rest), Mosquitto, this tool (the storm threads separately) and the whole machine, and
//!   ratios against the level-0 row.
//! - **Scan-report maximum** (`max_reports`): `max_agents` agents with window `max_window`
//!   and no rate limit into sluice (control-plane mode) for `max_duration`, counted at the
//!   cloud; then, in the same run, what Mosquitto takes from `direct_publishers` plain MQTT
//!   publishers (QoS 1, payload the size of the SenML messages just seen) with nothing in
//!   between, to show whether Mosquitto or the generator is the limit.
//!
//! # What is not measured
//! The machine has 2 cores: sluice's two pinned threads share them with Mosquitto, the
//! subscriber and all generators. The per-level machine CPU column says when the machine, not
//! sluice, ran out; the report reads the figures with that in mind.

mod markdown;
mod measure;

pub use markdown::markdown;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::ProtocolVersion;
use sluice_testkit::Mosquitto;
use tokio::time::{sleep, Instant};

use crate::harness::cloud::SinkRuntime;
use crate::harness::machine::{machine, Machine};
use crate::harness::metrics::{http_get, metric_sum};
use crate::harness::sut::{require_sluice_bin, SluiceChild};
use crate::load::paced::{Fleet, FleetConfig};
use crate::load::phd::{PhdFleet, PhdFleetConfig};
use crate::load::phd_storm::{Storm, StormConfig};
use crate::sinks::fastsink::{self, FastSink, SubscriberConfig};
use crate::stats::LatencySummary;
use measure::{level_result, Sample};

/// Where association runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Plane {
    /// sluice's design: `sluice-phd` on the control core.
    Control,
    /// `[phd] single_plane = true`: on the shard thread.
    Single,
}

impl Plane {
    pub fn name(self) -> &'static str {
        match self {
            Plane::Control => "control-plane",
            Plane::Single => "single-plane",
        }
    }
}

/// The parameters.
#[derive(Debug, Clone, Serialize)]
pub struct ControlStormScenario {
    #[serde(skip)]
    pub sluice_bin: PathBuf,
    pub planes: Vec<Plane>,
    /// Storm levels, control messages/s.
    pub levels: Vec<u64>,
    /// Data load before the first level (not measured).
    pub warmup: Duration,
    /// Each level runs this long before its window opens.
    pub settle: Duration,
    /// Each level's measured window.
    pub window: Duration,
    pub phd_agents: u32,
    pub phd_window: u16,
    /// Scan reports/s offered in total.
    pub phd_rate: f64,
    pub mqtt_devices: u32,
    /// QoS 1 messages/s offered in total.
    pub mqtt_rate: f64,
    pub mqtt_payload: usize,
    pub storm_new_share: f64,
    pub storm_workers: usize,
    pub storm_threads: usize,
    /// Run the scan-report maximum first.
    pub max_reports: bool,
    pub max_agents: u32,
    pub max_window: u16,
    pub max_duration: Duration,
    pub direct_publishers: u32,
    /// Run the storm levels (off: only the maximum).
    pub storm: bool,
    pub command_line: String,
}

impl ControlStormScenario {
    /// Levels 0, 1k, 5k, 10k, 20k, 40k msg/s for 10 s each (2 s settle), both planes, and the
    /// scan-report maximum.
    pub fn new(sluice_bin: PathBuf) -> ControlStormScenario {
        ControlStormScenario {
            sluice_bin,
            planes: vec![Plane::Control, Plane::Single],
            levels: vec![0, 1_000, 5_000, 10_000, 20_000, 40_000],
            warmup: Duration::from_secs(3),
            settle: Duration::from_secs(2),
            window: Duration::from_secs(10),
            phd_agents: 32,
            phd_window: 32,
            phd_rate: 15_000.0,
            mqtt_devices: 16,
            mqtt_rate: 5_000.0,
            mqtt_payload: 128,
            storm_new_share: 0.5,
            storm_workers: 512,
            storm_threads: 1,
            max_reports: true,
            max_agents: 64,
            max_window: 64,
            max_duration: Duration::from_secs(10),
            direct_publishers: 8,
            storm: true,
            command_line: String::new(),
        }
    }
}

/// CPU over a window, % of one core.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuFigures {
    /// `sluice-shard-0` (all shard threads when there are more).
    pub shard: f64,
    /// `sluice-phd`.
    pub phd: f64,
    /// Every other sluice thread (`sluice-control`, `sluice-listener`, uplink, admin, …).
    pub sluice_other: f64,
    pub sluice_total: f64,
    pub mosquitto: f64,
    /// This tool (generators, subscriber, sampling).
    pub bench: f64,
    /// Of which the storm generator's threads.
    pub storm_threads: f64,
    /// Whole machine, % of all cores (100 = every core busy).
    pub machine: f64,
    /// Other processes that used ≥ 2 % of a core meanwhile (other work on the machine).
    pub others: Vec<String>,
}

/// One storm level.
#[derive(Debug, Clone, Serialize)]
pub struct LevelResult {
    pub target: u64,
    /// Control messages/s the generator exchanged (sent + read).
    pub storm_rate: f64,
    /// sluice's count over the window (`sluice_phd_control_messages_total`, in + out) per s.
    pub sluice_control_rate: Option<f64>,
    pub sessions_per_s: f64,
    pub sessions_failed: u64,
    /// Sessions the pacer could not start (no free worker).
    pub not_started: u64,
    pub aare: LatencySummary,
    pub data_offered: f64,
    pub phd_sent: f64,
    pub phd_delivered: f64,
    pub mqtt_sent: f64,
    pub mqtt_delivered: f64,
    /// PHD + MQTT messages/s at the cloud subscriber.
    pub delivered: f64,
    pub phd_confirm: LatencySummary,
    pub mqtt_e2e: LatencySummary,
    pub cpu: CpuFigures,
    /// `sluice_phd_agents` and `sluice_phd_connections` at the window's end.
    pub phd_agents_gauge: Option<f64>,
    pub phd_connections_gauge: Option<f64>,
    /// Against the level-0 row of the same mode.
    pub delivered_ratio: Option<f64>,
    pub phd_p99_ratio: Option<f64>,
    pub mqtt_p99_ratio: Option<f64>,
}

/// One plane mode's run.
#[derive(Debug, Clone, Serialize)]
pub struct PlaneRun {
    pub plane: Plane,
    pub levels: Vec<LevelResult>,
    pub storm_first_error: Option<String>,
    pub data_errors: Vec<String>,
    /// `sluice_phd_agents` after the storm and the data agents stopped (a leak shows here).
    pub agents_after: Option<f64>,
    pub sluice_config: String,
}

/// What Mosquitto takes from plain publishers, next to the scan-report maximum.
#[derive(Debug, Clone, Serialize)]
pub struct DirectResult {
    pub publishers: u32,
    pub payload: usize,
    pub sent: f64,
    pub delivered: f64,
    pub mosquitto_cpu: f64,
    pub bench_cpu: f64,
    pub machine_cpu: f64,
}

/// The scan-report maximum.
#[derive(Debug, Clone, Serialize)]
pub struct MaxReportsResult {
    pub agents: u32,
    pub window: u16,
    pub reports_sent: f64,
    pub reports_confirmed: f64,
    /// SenML messages/s at the cloud subscriber (one per report: glucometers).
    pub delivered: f64,
    /// Mean SenML payload size at the cloud, bytes.
    pub payload_bytes: f64,
    pub confirm: LatencySummary,
    pub cpu: CpuFigures,
    pub direct: Option<DirectResult>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub target: String,
    pub measured: String,
    pub met: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ControlStormReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: ControlStormScenario,
    pub max_reports: Option<MaxReportsResult>,
    pub planes: Vec<PlaneRun>,
    pub verdicts: Vec<Verdict>,
}

/// Run the scenario.
pub async fn run_control_storm(s: &ControlStormScenario) -> anyhow::Result<ControlStormReport> {
    require_sluice_bin(&s.sluice_bin)?;
    let machine = machine(&s.command_line);
    let sink_rt = SinkRuntime::new()?;
    let max_reports = if s.max_reports {
        eprintln!("control-storm: scan-report maximum");
        let (cloud, sink) = start_cloud(&sink_rt).await?;
        let max = run_max(s, &cloud, &sink).await?;
        let _ = sink.stop().await;
        Some(max)
    } else {
        None
    };
    let mut planes = Vec::new();
    if s.storm {
        for &plane in &s.planes {
            eprintln!("control-storm: {}", plane.name());
            // A fresh cloud and subscriber per mode: the subscriber tracks (device, sequence)
            // pairs, and the second mode's devices start their sequences at 0 again.
            let (cloud, sink) = start_cloud(&sink_rt).await?;
            planes.push(run_plane(s, plane, &cloud, &sink).await?);
            let _ = sink.stop().await;
        }
    }
    let verdicts = verdicts(s, max_reports.as_ref(), &planes);
    Ok(ControlStormReport {
        scenario: "control-storm",
        machine,
        params: s.clone(),
        max_reports,
        planes,
        verdicts,
    })
}

/// A plain-TCP cloud Mosquitto and the measuring subscriber on `#` (on `rt`).
async fn start_cloud(rt: &SinkRuntime) -> anyhow::Result<(Mosquitto, FastSink)> {
    let cloud = tokio::task::spawn_blocking(|| Mosquitto::builder().start())
        .await
        .context("cloud start-up panicked")?
        .context("starting the cloud Mosquitto")?;
    let subscriber = SubscriberConfig {
        broker: cloud.plain_addr(),
        ca_file: None,
        server_name: "127.0.0.1".to_string(),
        topic: "#".to_string(),
        protocol: ProtocolVersion::V311,
        measure_latency: true,
    };
    let sink = rt
        .handle()?
        .spawn(fastsink::subscribe_measuring(subscriber))
        .await
        .context("subscriber start-up panicked")??;
    Ok((cloud, sink))
}

/// A started sluice and its PHD listener and admin port.
pub(crate) struct Sut {
    pub(crate) child: SluiceChild,
    pub(crate) phd: SocketAddr,
    pub(crate) admin_port: u16,
}

async fn start_sluice(
    s: &ControlStormScenario,
    plane: Plane,
    cloud: &Mosquitto,
) -> anyhow::Result<Sut> {
    let mqtt_port = sluice_testkit::free_port()?;
    let admin_port = sluice_testkit::free_port()?;
    let phd_port = sluice_testkit::free_port()?;
    let toml = format!(
        "# generated by sluice-bench scenario control-storm\n\
         [gateway]\nshards = 1\npin_threads = true\ncontrol_core = 1\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n\
         [coap]\nenabled = false\n\n\
         [phd]\nlisten = \"127.0.0.1:{phd_port}\"\nget_mds = false\nsingle_plane = {single}\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtt://127.0.0.1:{cloud_port}\"\nallow_plaintext = true\n\
         client_id = \"sluice-gw\"\nforward = [\"phd/#\", \"dev/#\"]\n",
        single = plane == Plane::Single,
        cloud_port = cloud.plain_port(),
    );
    let child = SluiceChild::spawn(&s.sluice_bin, mqtt_port, toml)?;
    child.wait_ready().await?;
    child.wait_uplink(cloud).await?;
    let phd = SocketAddr::from(([127, 0, 0, 1], phd_port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(phd).await.is_err() {
        if Instant::now() >= deadline {
            bail!(
                "sluice's PHD listener {phd} never opened; stderr:\n{}",
                child.stderr_tail()
            );
        }
        sleep(Duration::from_millis(50)).await;
    }
    Ok(Sut {
        child,
        phd,
        admin_port,
    })
}

async fn run_plane(
    s: &ControlStormScenario,
    plane: Plane,
    cloud: &Mosquitto,
    sink: &FastSink,
) -> anyhow::Result<PlaneRun> {
    let sut = start_sluice(s, plane, cloud).await?;
    let phd = PhdFleet::connect(PhdFleetConfig {
        agents: s.phd_agents,
        window: s.phd_window,
        ..PhdFleetConfig::new(sut.phd)
    })
    .await?;
    let mqtt = Fleet::connect(FleetConfig {
        devices: s.mqtt_devices,
        payload_size: s.mqtt_payload,
        client_prefix: "dev".to_string(),
        topic_prefix: "dev".to_string(),
        ..FleetConfig::new(sut.child.device_addr())
    })
    .await?;
    let storm = Storm::start(StormConfig {
        new_share: s.storm_new_share,
        workers: s.storm_workers,
        threads: s.storm_threads,
        ..StormConfig::new(sut.phd)
    })?;
    phd.set_total_rate(s.phd_rate);
    mqtt.set_total_rate(s.mqtt_rate);
    sleep(s.warmup).await;
    let mut levels: Vec<LevelResult> = Vec::new();
    for &target in &s.levels {
        storm.set_rate(target as f64);
        sleep(s.settle).await;
        let start = Sample::take(&sut, cloud, sink, Some(&storm), Some(&phd), Some(&mqtt)).await;
        let _ = phd.take_confirm_latency();
        let _ = sink.stats().latency_window.take();
        let _ = storm.take_aare_latency();
        sleep(s.window).await;
        let end = Sample::take(&sut, cloud, sink, Some(&storm), Some(&phd), Some(&mqtt)).await;
        let mut level = level_result(
            target,
            s.phd_rate + s.mqtt_rate,
            &start,
            &end,
            &phd.take_confirm_latency(),
            &sink.stats().latency_window.take(),
            &storm.take_aare_latency(),
        );
        let base = levels.first().unwrap_or(&level).clone();
        level.set_ratios(&base);
        eprintln!(
            "control-storm: {} level {target}: storm {:.0} msg/s, delivered {:.0} msg/s, PHD p99 {} ms, MQTT p99 {} ms",
            plane.name(),
            level.storm_rate,
            level.delivered,
            level.phd_confirm.p99_ms,
            level.mqtt_e2e.p99_ms
        );
        levels.push(level);
    }
    storm.set_rate(0.0);
    let storm_first_error = storm.first_error();
    drop(storm);
    let mut data_errors = Vec::new();
    let phd_end = phd.counters();
    if phd_end.agent_failures > 0 {
        data_errors.push(format!(
            "{} PHD agents failed: {}",
            phd_end.agent_failures,
            phd.first_error()
        ));
    }
    let _ = phd.stop(Duration::from_secs(3)).await;
    let mqtt_end = mqtt.stop(Duration::from_secs(3)).await;
    if mqtt_end.device_failures > 0 {
        data_errors.push(format!("{} MQTT devices failed", mqtt_end.device_failures));
    }
    // Everything is closed: the agent table should be empty within the manager's timeouts.
    sleep(Duration::from_secs(2)).await;
    let agents_after = match http_get(sut.admin_port, "/metrics").await {
        Ok(text) => metric_sum(&text, "sluice_phd_agents"),
        Err(_) => None,
    };
    let sluice_config = sut.child.config_text().to_string();
    drop(sut);
    Ok(PlaneRun {
        plane,
        levels,
        storm_first_error,
        data_errors,
        agents_after,
        sluice_config,
    })
}

async fn run_max(
    s: &ControlStormScenario,
    cloud: &Mosquitto,
    sink: &FastSink,
) -> anyhow::Result<MaxReportsResult> {
    let sut = start_sluice(s, Plane::Control, cloud).await?;
    let phd = PhdFleet::connect(PhdFleetConfig {
        agents: s.max_agents,
        window: s.max_window,
        system_id_base: 0x0AA7_0000_0000_0000,
        ..PhdFleetConfig::new(sut.phd)
    })
    .await?;
    phd.set_total_rate(f64::INFINITY);
    sleep(s.settle + Duration::from_secs(1)).await;
    let start = Sample::take(&sut, cloud, sink, None, Some(&phd), None).await;
    let _ = phd.take_confirm_latency();
    sleep(s.max_duration).await;
    let end = Sample::take(&sut, cloud, sink, None, Some(&phd), None).await;
    let confirm = LatencySummary::from_histogram(&phd.take_confirm_latency());
    let _ = phd.stop(Duration::from_secs(3)).await;
    drop(sut);
    let secs = end.at.duration_since(start.at).as_secs_f64().max(1e-9);
    let messages = end.sink_foreign.saturating_sub(start.sink_foreign) as f64;
    let bytes = end.sink_bytes.saturating_sub(start.sink_bytes) as f64;
    let payload_bytes = if messages > 0.0 {
        bytes / messages
    } else {
        0.0
    };
    let (Some(p0), Some(p1)) = (start.phd, end.phd) else {
        bail!("the PHD fleet's counters are missing");
    };
    let cpu = measure::cpu(&start, &end);
    eprintln!(
        "control-storm: maximum {:.0} reports/s delivered",
        messages / secs
    );
    sleep(Duration::from_secs(1)).await;
    let direct = if s.direct_publishers > 0 {
        Some(run_direct(s, cloud, sink, (payload_bytes.round() as usize).max(24)).await?)
    } else {
        None
    };
    Ok(MaxReportsResult {
        agents: s.max_agents,
        window: s.max_window,
        reports_sent: (p1.sent - p0.sent) as f64 / secs,
        reports_confirmed: (p1.confirmed - p0.confirmed) as f64 / secs,
        delivered: messages / secs,
        payload_bytes,
        confirm,
        cpu,
        direct,
    })
}

/// Plain QoS 1 publishers straight into the cloud Mosquitto, as fast as their windows allow.
async fn run_direct(
    s: &ControlStormScenario,
    cloud: &Mosquitto,
    sink: &FastSink,
    payload: usize,
) -> anyhow::Result<DirectResult> {
    let fleet = Fleet::connect(FleetConfig {
        devices: s.direct_publishers,
        payload_size: payload,
        client_prefix: "direct".to_string(),
        topic_prefix: "direct".to_string(),
        ..FleetConfig::new(cloud.plain_addr())
    })
    .await?;
    fleet.set_total_rate(f64::INFINITY);
    sleep(s.settle).await;
    let start = Sample::take_plain(cloud, sink);
    let sent0 = fleet.counters().sent;
    sleep(s.max_duration).await;
    let end = Sample::take_plain(cloud, sink);
    let sent1 = fleet.counters().sent;
    let _ = fleet.stop(Duration::from_secs(3)).await;
    let secs = end.at.duration_since(start.at).as_secs_f64().max(1e-9);
    let cpu = measure::cpu(&start, &end);
    Ok(DirectResult {
        publishers: s.direct_publishers,
        payload,
        sent: (sent1 - sent0) as f64 / secs,
        delivered: end.sink_unique.saturating_sub(start.sink_unique) as f64 / secs,
        mosquitto_cpu: cpu.mosquitto,
        bench_cpu: cpu.bench,
        machine_cpu: cpu.machine,
    })
}

fn verdicts(
    s: &ControlStormScenario,
    max: Option<&MaxReportsResult>,
    planes: &[PlaneRun],
) -> Vec<Verdict> {
    let mut out = Vec::new();
    let last = |plane: Plane| {
        planes
            .iter()
            .find(|p| p.plane == plane)
            .and_then(|p| p.levels.last().map(|l| (p, l)))
    };
    if let Some((_, l)) = last(Plane::Control) {
        let ratio = l.delivered_ratio.unwrap_or(0.0);
        out.push(Verdict {
            target: format!(
                "control plane: delivered data rate at the highest level (target {} msg/s) ≥ 98 % of no storm",
                l.target
            ),
            measured: format!("{:.1} % (storm reached {:.0} msg/s)", 100.0 * ratio, l.storm_rate),
            met: ratio >= 0.98,
        });
        let (phd, mqtt) = (
            l.phd_p99_ratio.unwrap_or(f64::INFINITY),
            l.mqtt_p99_ratio.unwrap_or(f64::INFINITY),
        );
        out.push(Verdict {
            target: "control plane: data p99 at the highest level ≤ 2× no storm (PHD confirmation and MQTT e2e)".to_string(),
            measured: format!("PHD {phd:.2}×, MQTT {mqtt:.2}×"),
            met: phd <= 2.0 && mqtt <= 2.0,
        });
        out.push(Verdict {
            target: format!(
                "storm reaches {} control msg/s",
                s.levels.iter().max().copied().unwrap_or(0)
            ),
            measured: format!(
                "{:.0} msg/s (sluice counted {})",
                l.storm_rate,
                l.sluice_control_rate
                    .map_or("-".to_string(), |r| format!("{r:.0}"))
            ),
            met: l.storm_rate >= 0.95 * s.levels.iter().max().copied().unwrap_or(0) as f64,
        });
    }
    if let Some((_, l)) = last(Plane::Single) {
        let ratio = l.delivered_ratio.unwrap_or(0.0);
        let phd = l.phd_p99_ratio.unwrap_or(f64::INFINITY);
        let mqtt = l.mqtt_p99_ratio.unwrap_or(f64::INFINITY);
        out.push(Verdict {
            target: "single plane (contrast): the data path collapses at the highest level (delivered < 98 % or p99 > 2×)".to_string(),
            measured: format!("delivered {:.1} %, PHD p99 {phd:.2}×, MQTT p99 {mqtt:.2}× (storm {:.0} msg/s)", 100.0 * ratio, l.storm_rate),
            met: ratio < 0.98 || phd > 2.0 || mqtt > 2.0,
        });
    }
    if let Some(m) = max {
        out.push(Verdict {
            target: "≥ 20,000 PHD scan reports/s converted and delivered to the cloud Mosquitto"
                .to_string(),
            measured: format!("{:.0} reports/s delivered", m.delivered),
            met: m.delivered >= 20_000.0,
        });
    }
    out
}
