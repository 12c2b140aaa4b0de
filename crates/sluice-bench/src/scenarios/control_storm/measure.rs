//! The control-storm scenario's samples (everything read at both ends of a measured window)
//! and the figures computed from two of them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use hdrhistogram::Histogram;
use sluice_testkit::Mosquitto;
use tokio::time::Instant;

use super::{CpuFigures, LevelResult, Sut};
use crate::harness::metrics::{http_get, metric_sum};
use crate::harness::procfs::{
    busiest_others, cpu_time, process_cpu_ticks, round1, task_cpu_by_name, threads_cpu, MachineCpu,
    Pid,
};
use crate::load::paced::{Fleet, FleetSnapshot};
use crate::load::phd::{PhdFleet, PhdFleetSnapshot};
use crate::load::phd_storm::{Storm, StormSnapshot};
use crate::sinks::fastsink::FastSink;
use crate::stats::LatencySummary;

/// Everything read at one end of a window.
pub(crate) struct Sample {
    pub(crate) at: Instant,
    pub(crate) sink_foreign: u64,
    pub(crate) sink_unique: u64,
    pub(crate) sink_bytes: u64,
    sluice_threads: BTreeMap<String, Duration>,
    own: Duration,
    storm_threads: Duration,
    mosquitto: Duration,
    machine: MachineCpu,
    /// Every process's CPU ticks (to name other work on the machine).
    procs: HashMap<u32, (String, u64)>,
    /// sluice, Mosquitto and this process.
    ours: Vec<u32>,
    storm: Option<StormSnapshot>,
    pub(crate) phd: Option<PhdFleetSnapshot>,
    mqtt: Option<FleetSnapshot>,
    control_total: Option<f64>,
    agents: Option<f64>,
    connections: Option<f64>,
}

impl Sample {
    pub(crate) async fn take(
        sut: &Sut,
        cloud: &Mosquitto,
        sink: &FastSink,
        storm: Option<&Storm>,
        phd: Option<&PhdFleet>,
        mqtt: Option<&Fleet>,
    ) -> Sample {
        let metrics =
            tokio::time::timeout(Duration::from_secs(2), http_get(sut.admin_port, "/metrics"))
                .await
                .ok()
                .and_then(Result::ok);
        let mut s = Sample::take_plain(cloud, sink);
        s.sluice_threads = task_cpu_by_name(sut.child.pid());
        s.ours.push(sut.child.pid());
        s.storm = storm.map(Storm::counters);
        s.phd = phd.map(PhdFleet::counters);
        s.mqtt = mqtt.map(Fleet::counters);
        if let Some(text) = metrics {
            s.control_total = metric_sum(&text, "sluice_phd_control_messages_total");
            s.agents = metric_sum(&text, "sluice_phd_agents");
            s.connections = metric_sum(&text, "sluice_phd_connections");
        }
        s
    }

    /// Without sluice: the cloud, this tool and the machine.
    pub(crate) fn take_plain(cloud: &Mosquitto, sink: &FastSink) -> Sample {
        let c = &sink.stats().counters;
        Sample {
            at: Instant::now(),
            sink_foreign: c.foreign.load(Relaxed),
            sink_unique: c.unique.load(Relaxed),
            sink_bytes: c.payload_bytes.load(Relaxed),
            sluice_threads: BTreeMap::new(),
            own: cpu_time(Pid::OwnProcess).unwrap_or_default(),
            storm_threads: threads_cpu("phd-storm"),
            mosquitto: cloud
                .pid()
                .and_then(|p| cpu_time(Pid::Other(p)).ok())
                .unwrap_or_default(),
            machine: MachineCpu::read(),
            procs: process_cpu_ticks(),
            ours: [Some(std::process::id()), cloud.pid()]
                .into_iter()
                .flatten()
                .collect(),
            storm: None,
            phd: None,
            mqtt: None,
            control_total: None,
            agents: None,
            connections: None,
        }
    }
}

fn percent(d: Duration, secs: f64) -> f64 {
    round1(100.0 * d.as_secs_f64() / secs)
}

/// CPU between two samples.
pub(crate) fn cpu(a: &Sample, b: &Sample) -> CpuFigures {
    let secs = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
    let used = |name: &str| -> Duration {
        let end = b.sluice_threads.get(name).copied().unwrap_or_default();
        end.saturating_sub(a.sluice_threads.get(name).copied().unwrap_or_default())
    };
    let mut shard = Duration::ZERO;
    let mut phd = Duration::ZERO;
    let mut total = Duration::ZERO;
    for name in b.sluice_threads.keys() {
        let d = used(name);
        total += d;
        if name.starts_with("sluice-shard") {
            shard += d;
        } else if name == "sluice-phd" {
            phd += d;
        }
    }
    CpuFigures {
        shard: percent(shard, secs),
        phd: percent(phd, secs),
        sluice_other: percent(total.saturating_sub(shard + phd), secs),
        sluice_total: percent(total, secs),
        mosquitto: percent(b.mosquitto.saturating_sub(a.mosquitto), secs),
        bench: percent(b.own.saturating_sub(a.own), secs),
        storm_threads: percent(b.storm_threads.saturating_sub(a.storm_threads), secs),
        machine: round1(b.machine.busy_percent_since(&a.machine)),
        others: busiest_others(&a.procs, &b.procs, &b.ours, b.at.duration_since(a.at)),
    }
}

/// One level's figures from its window's samples and latency histograms.
pub(crate) fn level_result(
    target: u64,
    data_offered: f64,
    a: &Sample,
    b: &Sample,
    phd_confirm: &Histogram<u64>,
    mqtt_e2e: &Histogram<u64>,
    aare: &Histogram<u64>,
) -> LevelResult {
    let secs = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
    let rate = |x: u64, y: u64| round1(y.saturating_sub(x) as f64 / secs);
    let storm = a.storm.zip(b.storm);
    let phd = a.phd.zip(b.phd);
    let mqtt = a.mqtt.zip(b.mqtt);
    let phd_delivered = rate(a.sink_foreign, b.sink_foreign);
    let mqtt_delivered = rate(a.sink_unique, b.sink_unique);
    LevelResult {
        target,
        storm_rate: storm.map_or(0.0, |(x, y)| rate(x.messages(), y.messages())),
        sluice_control_rate: a
            .control_total
            .zip(b.control_total)
            .map(|(x, y)| round1((y - x) / secs)),
        sessions_per_s: storm.map_or(0.0, |(x, y)| rate(x.sessions_done, y.sessions_done)),
        sessions_failed: storm.map_or(0, |(x, y)| y.sessions_failed - x.sessions_failed),
        not_started: storm.map_or(0, |(x, y)| y.not_started - x.not_started),
        aare: LatencySummary::from_histogram(aare),
        data_offered,
        phd_sent: phd.map_or(0.0, |(x, y)| rate(x.sent, y.sent)),
        phd_delivered,
        mqtt_sent: mqtt.map_or(0.0, |(x, y)| rate(x.sent, y.sent)),
        mqtt_delivered,
        delivered: round1(phd_delivered + mqtt_delivered),
        phd_confirm: LatencySummary::from_histogram(phd_confirm),
        mqtt_e2e: LatencySummary::from_histogram(mqtt_e2e),
        cpu: cpu(a, b),
        phd_agents_gauge: b.agents,
        phd_connections_gauge: b.connections,
        delivered_ratio: None,
        phd_p99_ratio: None,
        mqtt_p99_ratio: None,
    }
}

impl LevelResult {
    /// Ratios against `base` (the level-0 row).
    pub(crate) fn set_ratios(&mut self, base: &LevelResult) {
        let ratio = |x: f64, y: f64| (y > 0.0).then(|| (x / y * 1000.0).round() / 1000.0);
        self.delivered_ratio = ratio(self.delivered, base.delivered);
        self.phd_p99_ratio = ratio(self.phd_confirm.p99_ms, base.phd_confirm.p99_ms);
        self.mqtt_p99_ratio = ratio(self.mqtt_e2e.p99_ms, base.mqtt_e2e.p99_ms);
    }
}
