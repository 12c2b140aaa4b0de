//! Part **adaptor** of `scenario functions` (the paper's Table I): the adaptor's CPU per event
//! beside the function's own, at a paced event rate — the adaptor being sluice, or the
//! adaptor floor (`sluice-bench fn-floor`, [`crate::sinks::adaptor_floor`]: the least any MQTT
//! → HTTP relay does) under the same load.
//!
//! Sluice rows ([`run`]): sluice with the function at `min_instances = 1`, `max_instances =
//! 4`, `concurrency = 8`, `idle = 300s` (instances live through the window), replies discarded
//! (`reply_topic = ""`: the adaptor's cost is MQTT in → CloudEvent POST → answer read).
//! Floor rows ([`run_floor`]): the bench starts one instance of the function on `$PORT` (as
//! `--placement remote` does) and `sluice-bench fn-floor` in front of it with 8 connections
//! (sluice's `concurrency`). Both: `adaptor_devices` MQTT 3.1.1 devices
//! ([`crate::load::devices`], QoS 1, periodic arrivals with random phase, fixed payload)
//! offering `adaptor_rate` events/s in total. After a 1 s ramp and the warm-up, the window:
//! CPU (`utime + stime`) of the adaptor process and of the function — sluice's children (live
//! children's plus sluice's `cutime + cstime`: instances that exited count too,
//! [`super::procs`]), or the one instance the bench started — and the events answered, each
//! read at both ends. Events: sluice's `invocations_total{outcome="ok"}`; the floor's devices'
//! PUBACKs (the floor writes one only after the function's 2xx); the baseline's PUBACKs. Per
//! event = CPU ÷ events in the window. After the devices stop, every event must have been
//! answered: the devices' PUBACKs = sent and, for sluice, `events_total` =
//! `invocations_total{ok}`.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use sluice_proto::mqtt::{ProtocolVersion, QoS};

use super::{prom, ExternalFn, FnKind, FnSettings, FnSluice, FunctionsScenario, FUNCTION};
use crate::harness::procfs::{cpu_time, machine_cpu, machine_cpu_percent, Pid};
use crate::harness::sut::FloorChild;
use crate::load::devices::{
    spawn_devices, Arrivals, DevicesConfig, DevicesReport, DevicesRun, PayloadSize,
};
use crate::stats::LatencySummary;

/// Function connections of the adaptor floor: sluice's `concurrency` in [`run`].
pub const FLOOR_CONNECTIONS: usize = 8;

/// Who takes the devices' events to the function in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Adaptor {
    Sluice,
    /// `sluice-bench fn-floor`: the minimal MQTT → HTTP relay.
    Floor,
}

impl Adaptor {
    pub fn name(self) -> &'static str {
        match self {
            Adaptor::Sluice => "sluice",
            Adaptor::Floor => "floor (minimal MQTT→HTTP relay)",
        }
    }
}

/// One row's adaptor figures.
#[derive(Debug, Clone, Serialize)]
pub struct AdaptorResult {
    pub adaptor: Adaptor,
    /// `None`: the baseline — the same devices and load on topics no function matches, so
    /// sluice only takes the MQTT messages in and acknowledges them (what the adaptor adds is
    /// the difference).
    pub function: Option<FnKind>,
    /// Whether sluice started the instances (local) or the bench did (remote; always for the
    /// floor).
    pub placement: super::Placement,
    pub offered_rate: f64,
    pub devices: u32,
    pub qos: u8,
    pub payload_bytes: usize,
    pub window_s: f64,
    /// Events answered in the window (see the module), and per second.
    pub events_ok: u64,
    pub events_per_s: f64,
    /// CPU of the adaptor process (sluice, or the floor) in the window.
    pub adaptor_cpu_s: f64,
    pub function_cpu_s: f64,
    pub adaptor_us_per_event: Option<f64>,
    pub function_us_per_event: Option<f64>,
    /// adaptor ÷ function, per event.
    pub ratio: Option<f64>,
    /// Machine-wide busy share of all cores in the window, %.
    pub machine_busy_percent: f64,
    /// Distinct instance pids seen at the window's ends.
    pub instance_pids: Vec<u32>,
    /// Whole run, after the devices stopped. sluice: `events_total` and
    /// `invocations_total{ok}` / failed; the floor counts nothing: PUBLISHes sent, PUBACKs,
    /// and `None`.
    pub events_total: u64,
    pub invocations_ok: u64,
    pub invocations_failed: Option<u64>,
    pub devices_sent: u64,
    pub devices_acknowledged: u64,
    /// Every event answered 2xx and every PUBLISH acknowledged.
    pub all_answered: bool,
    /// PUBLISH written → PUBACK read, after the ramp and warm-up.
    pub ack_latency: LatencySummary,
}

/// A sluice row: sluice with the function `kind` (`None`: the baseline).
pub async fn run(
    s: &FunctionsScenario,
    kind: Option<FnKind>,
    command: &[String],
) -> anyhow::Result<AdaptorResult> {
    announce(s, kind, Adaptor::Sluice);
    let sluice = FnSluice::start(
        s,
        &FnSettings {
            command: command.to_vec(),
            min_instances: 1,
            max_instances: 4,
            concurrency: FLOOR_CONNECTIONS,
            idle: Duration::from_secs(300),
            reply_topic: String::new(),
        },
    )
    .await?;
    let run = spawn_devices(devices_config(
        s,
        sluice.child.device_addr(),
        kind.is_some(),
    ))?;
    tokio::time::sleep(ramp() + s.adaptor_warmup).await;
    let ok_now = |text: &str| {
        prom::sample(
            text,
            "sluice_function_invocations_total",
            &[("function", FUNCTION), ("outcome", "ok")],
        )
        .unwrap_or(0.0) as u64
    };
    let m0 = sluice.metrics().await?;
    let w = window(s, &run, || sluice.cpu()).await?;
    let m1 = sluice.metrics().await?;
    let devices = run.wait().await.context("the device run")?;
    // Let the last answers land before the totals are read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let end = sluice.metrics().await?;

    let events_ok = match kind {
        Some(_) => ok_now(&m1).saturating_sub(ok_now(&m0)),
        None => w.acked,
    };
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
    let all_answered = devices.acknowledged == devices.sent
        && (kind.is_none() || (events_total == invocations_ok && events_total >= devices.sent));
    let totals = Totals {
        events_total,
        invocations_ok,
        invocations_failed: Some(invocations_failed),
        all_answered,
    };
    Ok(finish(
        s,
        kind,
        Adaptor::Sluice,
        s.placement,
        &w,
        events_ok,
        totals,
        &devices,
    ))
}

/// A floor row: the function `kind` started by the bench on `$PORT`, `sluice-bench fn-floor`
/// in front of it.
pub async fn run_floor(
    s: &FunctionsScenario,
    kind: FnKind,
    command: &[String],
) -> anyhow::Result<AdaptorResult> {
    announce(s, Some(kind), Adaptor::Floor);
    let function = ExternalFn::start(command).await?;
    let args = [
        "fn-floor".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--function".into(),
        format!("127.0.0.1:{}", function.port),
        "--connections".into(),
        FLOOR_CONNECTIONS.to_string(),
    ];
    let bin = s.bench_bin.clone();
    let floor = tokio::task::spawn_blocking(move || FloorChild::start(&bin, &args))
        .await
        .context("fn-floor start-up panicked")??;
    let run = spawn_devices(devices_config(s, floor.addr(), true))?;
    tokio::time::sleep(ramp() + s.adaptor_warmup).await;
    let (floor_pid, function_pid) = (floor.pid(), function.pid());
    let w = window(s, &run, || {
        Ok((
            cpu_time(Pid::Other(floor_pid))?,
            cpu_time(Pid::Other(function_pid))?,
            vec![function_pid],
        ))
    })
    .await?;
    let devices = run.wait().await.context("the device run")?;
    let totals = Totals {
        events_total: devices.sent,
        invocations_ok: devices.acknowledged,
        invocations_failed: None,
        all_answered: devices.acknowledged == devices.sent,
    };
    let placement = super::Placement::Remote;
    Ok(finish(
        s,
        Some(kind),
        Adaptor::Floor,
        placement,
        &w,
        w.acked,
        totals,
        &devices,
    ))
}

fn announce(s: &FunctionsScenario, kind: Option<FnKind>, adaptor: Adaptor) {
    eprintln!(
        "functions: adaptor, {} in front of {} function, {} events/s from {} devices",
        adaptor.name(),
        kind.map_or("no (baseline)", FnKind::name),
        s.adaptor_rate,
        s.adaptor_devices
    );
}

fn ramp() -> Duration {
    Duration::from_secs(1)
}

/// The devices of every row, at `target`; topics a function matches unless `to_function` is
/// false (the baseline).
fn devices_config(
    s: &FunctionsScenario,
    target: std::net::SocketAddr,
    to_function: bool,
) -> DevicesConfig {
    let mut config = DevicesConfig::new(target);
    config.devices = s.adaptor_devices;
    config.rate_per_device = s.adaptor_rate / f64::from(s.adaptor_devices.max(1));
    config.payload = PayloadSize {
        min: s.payload,
        max: s.payload,
    };
    config.qos = QoS::AtLeastOnce;
    config.protocol = ProtocolVersion::V311;
    config.arrivals = Arrivals::Periodic;
    config.ramp = ramp();
    config.settle = s.adaptor_warmup;
    config.duration = ramp() + s.adaptor_warmup + s.adaptor_window + Duration::from_secs(1);
    config.drain_timeout = Duration::from_secs(10);
    config.topic_prefix = if to_function {
        "fnb/adaptor".into()
    } else {
        "nofn/adaptor".into()
    };
    config.client_prefix = "fnb".into();
    config.progress_every = None;
    config
}

/// What one window measured.
struct Window {
    wall: Duration,
    /// The devices' PUBACKs in the window.
    acked: u64,
    adaptor_cpu: Duration,
    function_cpu: Duration,
    machine_busy_percent: f64,
    instance_pids: Vec<u32>,
}

/// The measured window: `cpu` (adaptor, function, instance pids) and the devices' PUBACKs
/// read at both ends of `s.adaptor_window`.
async fn window(
    s: &FunctionsScenario,
    run: &DevicesRun,
    cpu: impl Fn() -> anyhow::Result<(Duration, Duration, Vec<u32>)>,
) -> anyhow::Result<Window> {
    let acked0 = run.counters().snapshot().acknowledged;
    let c0 = cpu()?;
    let (mach0, t0) = (machine_cpu(), Instant::now());
    tokio::time::sleep(s.adaptor_window).await;
    let c1 = cpu()?;
    let (mach1, wall) = (machine_cpu(), t0.elapsed());
    let acked1 = run.counters().snapshot().acknowledged;
    let mut instance_pids = c0.2;
    instance_pids.extend(&c1.2);
    instance_pids.sort_unstable();
    instance_pids.dedup();
    Ok(Window {
        wall,
        acked: acked1.saturating_sub(acked0),
        adaptor_cpu: c1.0.saturating_sub(c0.0),
        function_cpu: c1.1.saturating_sub(c0.1),
        machine_busy_percent: machine_cpu_percent(mach0, mach1),
        instance_pids,
    })
}

/// A row's whole-run counts.
struct Totals {
    events_total: u64,
    invocations_ok: u64,
    invocations_failed: Option<u64>,
    all_answered: bool,
}

#[allow(clippy::too_many_arguments)]
fn finish(
    s: &FunctionsScenario,
    kind: Option<FnKind>,
    adaptor: Adaptor,
    placement: super::Placement,
    w: &Window,
    events_ok: u64,
    totals: Totals,
    devices: &DevicesReport,
) -> AdaptorResult {
    let per_event =
        |cpu: Duration| (events_ok > 0).then(|| cpu.as_secs_f64() * 1e6 / events_ok as f64);
    let (adaptor_us, function_us) = (per_event(w.adaptor_cpu), per_event(w.function_cpu));
    let result = AdaptorResult {
        adaptor,
        function: kind,
        placement,
        offered_rate: s.adaptor_rate,
        devices: s.adaptor_devices,
        qos: 1,
        payload_bytes: s.payload,
        window_s: w.wall.as_secs_f64(),
        events_ok,
        events_per_s: events_ok as f64 / w.wall.as_secs_f64(),
        adaptor_cpu_s: w.adaptor_cpu.as_secs_f64(),
        function_cpu_s: w.function_cpu.as_secs_f64(),
        adaptor_us_per_event: adaptor_us,
        function_us_per_event: function_us,
        ratio: adaptor_us
            .zip(function_us)
            .and_then(|(a, b)| (b > 0.0).then(|| a / b)),
        machine_busy_percent: w.machine_busy_percent,
        instance_pids: w.instance_pids.clone(),
        events_total: totals.events_total,
        invocations_ok: totals.invocations_ok,
        invocations_failed: totals.invocations_failed,
        devices_sent: devices.sent,
        devices_acknowledged: devices.acknowledged,
        all_answered: totals.all_answered,
        ack_latency: devices.ack_latency_steady,
    };
    eprintln!(
        "functions: adaptor {} / {}: {:.0} events/s, adaptor {:.1} µs/event, function {:.1} µs/event, ratio {:.3}, all answered: {}",
        adaptor.name(),
        kind.map_or("baseline", FnKind::name),
        result.events_per_s,
        adaptor_us.unwrap_or(f64::NAN),
        function_us.unwrap_or(f64::NAN),
        result.ratio.unwrap_or(f64::NAN),
        result.all_answered
    );
    result
}
