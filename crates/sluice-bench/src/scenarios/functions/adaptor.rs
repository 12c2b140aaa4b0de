//! Part **adaptor** of `scenario functions` (the paper's Table I): sluice's CPU per event
//! beside the function's own, at a paced event rate.
//!
//! Run: sluice with the function at `min_instances = 1`, `max_instances = 4`, `concurrency =
//! 8`, `idle = 300s` (instances live through the window), replies discarded (`reply_topic =
//! ""`: the adaptor's cost is MQTT in → CloudEvent POST → answer read); `adaptor_devices`
//! MQTT 3.1.1 devices ([`crate::load::devices`], QoS 1, periodic arrivals with random phase,
//! fixed payload) offering `adaptor_rate` events/s in total. After a 1 s ramp and the
//! warm-up, the window: CPU of sluice (`utime + stime`) and of its children (live children's
//! plus sluice's `cutime + cstime`: instances that exited count too, [`super::procs`]; with
//! `--placement remote` the one instance the bench started), and
//! the function's `invocations_total{outcome="ok"}`, each read at both ends. Per event =
//! CPU ÷ ok invocations in the window. After the devices stop, every event must have been
//! answered: `events_total` = `invocations_total{ok}` and the devices' PUBACKs = sent.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use sluice_proto::mqtt::{ProtocolVersion, QoS};

use super::{prom, FnKind, FnSettings, FnSluice, FunctionsScenario, FUNCTION};
use crate::harness::procfs::{machine_cpu, machine_cpu_percent};
use crate::load::devices::{spawn_devices, Arrivals, DevicesConfig, PayloadSize};
use crate::stats::LatencySummary;

/// One function's adaptor figures.
#[derive(Debug, Clone, Serialize)]
pub struct AdaptorResult {
    /// `None`: the baseline — the same devices and load on topics no function matches, so
    /// sluice only takes the MQTT messages in and acknowledges them (what the adaptor adds is
    /// the difference).
    pub function: Option<FnKind>,
    /// Whether sluice started the instances (local) or the bench did (remote).
    pub placement: super::Placement,
    pub offered_rate: f64,
    pub devices: u32,
    pub qos: u8,
    pub payload_bytes: usize,
    pub window_s: f64,
    /// `invocations_total{outcome="ok"}` in the window (the baseline: PUBACKs), and per
    /// second.
    pub events_ok: u64,
    pub events_per_s: f64,
    pub sluice_cpu_s: f64,
    pub function_cpu_s: f64,
    pub sluice_us_per_event: Option<f64>,
    pub function_us_per_event: Option<f64>,
    /// sluice ÷ function, per event.
    pub ratio: Option<f64>,
    /// Machine-wide busy share of all cores in the window, %.
    pub machine_busy_percent: f64,
    /// Distinct instance pids seen at the window's ends.
    pub instance_pids: Vec<u32>,
    /// Whole run, after the devices stopped.
    pub events_total: u64,
    pub invocations_ok: u64,
    pub invocations_failed: u64,
    pub devices_sent: u64,
    pub devices_acknowledged: u64,
    /// Every event answered 2xx and every PUBLISH acknowledged.
    pub all_answered: bool,
    /// PUBLISH written → PUBACK read, after the ramp and warm-up.
    pub ack_latency: LatencySummary,
}

pub async fn run(
    s: &FunctionsScenario,
    kind: Option<FnKind>,
    command: &[String],
) -> anyhow::Result<AdaptorResult> {
    let name = kind.map_or("no (baseline)", FnKind::name);
    eprintln!(
        "functions: adaptor, {name} function, {} events/s from {} devices",
        s.adaptor_rate, s.adaptor_devices
    );
    let sluice = FnSluice::start(
        s,
        &FnSettings {
            command: command.to_vec(),
            min_instances: 1,
            max_instances: 4,
            concurrency: 8,
            idle: Duration::from_secs(300),
            reply_topic: String::new(),
        },
    )
    .await?;
    let ramp = Duration::from_secs(1);
    let mut config = DevicesConfig::new(sluice.child.device_addr());
    config.devices = s.adaptor_devices;
    config.rate_per_device = s.adaptor_rate / f64::from(s.adaptor_devices.max(1));
    config.payload = PayloadSize {
        min: s.payload,
        max: s.payload,
    };
    config.qos = QoS::AtLeastOnce;
    config.protocol = ProtocolVersion::V311;
    config.arrivals = Arrivals::Periodic;
    config.ramp = ramp;
    config.settle = s.adaptor_warmup;
    config.duration = ramp + s.adaptor_warmup + s.adaptor_window + Duration::from_secs(1);
    config.drain_timeout = Duration::from_secs(10);
    config.topic_prefix = if kind.is_some() {
        "fnb/adaptor".into()
    } else {
        "nofn/adaptor".into()
    };
    config.client_prefix = "fnb".into();
    config.progress_every = None;
    let run = spawn_devices(config)?;
    tokio::time::sleep(ramp + s.adaptor_warmup).await;

    let ok_now = |text: &str| {
        prom::sample(
            text,
            "sluice_function_invocations_total",
            &[("function", FUNCTION), ("outcome", "ok")],
        )
        .unwrap_or(0.0) as u64
    };
    let m0 = sluice.metrics().await?;
    let acked0 = run.counters().snapshot().acknowledged;
    let f0 = sluice.cpu()?;
    let (mach0, t0) = (machine_cpu(), Instant::now());
    tokio::time::sleep(s.adaptor_window).await;
    let f1 = sluice.cpu()?;
    let (mach1, wall) = (machine_cpu(), t0.elapsed());
    let m1 = sluice.metrics().await?;
    let acked1 = run.counters().snapshot().acknowledged;
    let devices = run.wait().await.context("the device run")?;
    // Let the last answers land before the totals are read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let end = sluice.metrics().await?;

    let events_ok = match kind {
        Some(_) => ok_now(&m1).saturating_sub(ok_now(&m0)),
        None => acked1.saturating_sub(acked0),
    };
    let sluice_cpu = f1.0.saturating_sub(f0.0).as_secs_f64();
    let function_cpu = f1.1.saturating_sub(f0.1).as_secs_f64();
    let per_event = |cpu: f64| (events_ok > 0).then(|| cpu * 1e6 / events_ok as f64);
    let (sluice_us, function_us) = (per_event(sluice_cpu), per_event(function_cpu));
    let mut instance_pids = f0.2.clone();
    instance_pids.extend(&f1.2);
    instance_pids.sort_unstable();
    instance_pids.dedup();
    let fn_label = [("function", FUNCTION)];
    let events_total =
        prom::sample(&end, "sluice_function_events_total", &fn_label).unwrap_or(0.0) as u64;
    let invocations_ok = ok_now(&end);
    let invocations_failed = ["http_error", "timeout", "connection_error"]
        .iter()
        .map(|o| {
            prom::sample(
                &end,
                "sluice_function_invocations_total",
                &[("function", FUNCTION), ("outcome", o)],
            )
            .unwrap_or(0.0) as u64
        })
        .sum();
    let result = AdaptorResult {
        function: kind,
        placement: s.placement,
        offered_rate: s.adaptor_rate,
        devices: s.adaptor_devices,
        qos: 1,
        payload_bytes: s.payload,
        window_s: wall.as_secs_f64(),
        events_ok,
        events_per_s: events_ok as f64 / wall.as_secs_f64(),
        sluice_cpu_s: sluice_cpu,
        function_cpu_s: function_cpu,
        sluice_us_per_event: sluice_us,
        function_us_per_event: function_us,
        ratio: sluice_us
            .zip(function_us)
            .and_then(|(a, b)| (b > 0.0).then(|| a / b)),
        machine_busy_percent: machine_cpu_percent(mach0, mach1),
        instance_pids,
        events_total,
        invocations_ok,
        invocations_failed,
        devices_sent: devices.sent,
        devices_acknowledged: devices.acknowledged,
        all_answered: devices.acknowledged == devices.sent
            && (kind.is_none() || (events_total == invocations_ok && events_total >= devices.sent)),
        ack_latency: devices.ack_latency_steady,
    };
    eprintln!(
        "functions: adaptor {name}: {:.0} events/s, sluice {:.1} µs/event, function {:.1} µs/event, ratio {:.3}, all answered: {}",
        result.events_per_s,
        sluice_us.unwrap_or(f64::NAN),
        function_us.unwrap_or(f64::NAN),
        result.ratio.unwrap_or(f64::NAN),
        result.all_answered
    );
    Ok(result)
}
