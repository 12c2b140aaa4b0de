//! The `faults` scenario (issue 31): sluice under load from MQTT, CoAP and PHD devices together
//! while something breaks — the gateway killed, the cloud broker killed, slowed or blackholed,
//! one of two uplink paths flapping, the spool's disk full or read-only, the clock stepped, a
//! restart with retained messages and persistent sessions, an MQTT 3.1.1 device pushed past its
//! limit — and, per case, whether anything acknowledged to a device failed to reach the cloud.
//!
//! Owns: the case list, the run of one case (bed → recorder → load → warm-up → the fault →
//! stop → wait for the cloud → figures → verdict) and the report. The bed (namespaces, cloud,
//! sluice process) is in [`bed`], the devices and the cloud recorder in [`ledger`] and
//! [`load`], what each case does in [`cases`]. Does not own: sluice (any binary: `--sluice`),
//! Mosquitto, libfaketime.
//!
//! Every case gets a fresh bed: a gateway and a cloud network namespace joined by veth links
//! (root needed), a TLS 1.3 cloud Mosquitto in the cloud namespace, sluice (2 shards, MQTT,
//! CoAP, PHD, admin; the spool with `ack = "spool"` unless the case says otherwise; uplink
//! keep-alive 5 s, reconnect back-off 100 ms – 1 s) in the gateway namespace, the recorder on
//! the cloud's side of the links and the load on sluice's. The figures ([`load::Figures`]):
//! messages acknowledged to devices, distinct messages at the cloud, duplicates, per-device
//! order violations, the longest stall of a healthy MQTT device (first send → PUBACK of its
//! slowest message), unacknowledged QoS 0 messages lost, and *acknowledged but missing* —
//! exact for MQTT, a lower bound for CoAP and PHD (see [`load`]). The verdict: PASS when
//! acknowledged-but-missing is 0 and the case's own check holds (each case states it).

pub mod bed;
pub mod cases;
pub mod ledger;
pub mod load;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::harness::machine::{machine, Machine};
use crate::harness::sut::require_sluice_bin;
use crate::report::markdown::{loadavg_item, machine_line};

pub use load::{Figures, LoadSpec};

/// Every case, in the order run.
pub const ALL_CASES: [&str; 12] = [
    "kill9-cloud-up",
    "kill9-cloud-down",
    "cloud-restart",
    "cloud-slow",
    "cloud-blackhole",
    "multipath-flap",
    "disk-full",
    "disk-readonly",
    "clock-step",
    "restart-state",
    "pingresp-311",
    "slow-readers",
];

/// The cases small enough for the CI test (`tests/faults.rs`).
pub const CI_CASES: [&str; 3] = ["kill9-cloud-up", "cloud-restart", "pingresp-311"];

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Size {
    /// Seconds per case, a few kills; what CI and a busy machine afford.
    Small,
    /// The sizes: 100 kills, a 5-minute flap, 16,000 connections.
    Full,
}

/// Parameters of the `faults` scenario.
#[derive(Debug, Clone, Serialize)]
pub struct FaultsScenario {
    pub sluice_bin: PathBuf,
    /// What the binary is (e.g. "main 9df086b"), for the report.
    pub sluice_label: String,
    pub cases: Vec<String>,
    pub size: Size,
    pub load: LoadSpec,
    pub command_line: String,
}

impl FaultsScenario {
    pub fn new(sluice_bin: PathBuf, size: Size) -> FaultsScenario {
        FaultsScenario {
            sluice_bin,
            sluice_label: String::new(),
            cases: ALL_CASES.iter().map(|s| s.to_string()).collect(),
            size,
            load: match size {
                Size::Small => LoadSpec::small(),
                Size::Full => LoadSpec::full(),
            },
            command_line: String::new(),
        }
    }
}

/// One case's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: String,
    pub title: String,
    pub figures: Option<Figures>,
    /// What the case itself measured, one line each.
    pub observed: Vec<String>,
    /// The case's own check, in words, and whether it held.
    pub check: String,
    pub check_met: bool,
    pub pass: bool,
    pub error: Option<String>,
    pub seconds: f64,
    pub sluice_config: String,
}

/// Everything the scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct FaultsReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub sluice_version: String,
    pub params: FaultsScenario,
    pub cases: Vec<CaseResult>,
}

/// Run the chosen cases, each in its own bed (blocking threads: call from a runtime).
pub async fn run_faults(s: &FaultsScenario) -> anyhow::Result<FaultsReport> {
    require_sluice_bin(&s.sluice_bin)?;
    for c in &s.cases {
        anyhow::ensure!(
            ALL_CASES.contains(&c.as_str()),
            "unknown case {c:?}; cases: {}",
            ALL_CASES.join(", ")
        );
    }
    let machine = machine(&s.command_line);
    let sluice_version = std::process::Command::new(&s.sluice_bin)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mut results = Vec::new();
    for name in &s.cases {
        eprintln!("=== scenario faults: {name} — {} ===", cases::title(name));
        let started = std::time::Instant::now();
        let s2 = Arc::new(s.clone());
        let n2 = name.clone();
        let r = tokio::task::spawn_blocking(move || cases::run_case(&s2, &n2))
            .await
            .map_err(|e| anyhow::anyhow!("case {name} panicked: {e}"))
            .and_then(|r| r);
        let mut r = r.unwrap_or_else(|e| CaseResult {
            case: name.clone(),
            title: cases::title(name).to_string(),
            figures: None,
            observed: Vec::new(),
            check: String::new(),
            check_met: false,
            pass: false,
            error: Some(format!("{e:#}")),
            seconds: 0.0,
            sluice_config: String::new(),
        });
        r.seconds = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;
        eprintln!("{}", summary_line(&r));
        results.push(r);
    }
    Ok(FaultsReport {
        scenario: "faults",
        machine,
        sluice_version,
        params: s.clone(),
        cases: results,
    })
}

fn summary_line(r: &CaseResult) -> String {
    let f = r.figures.clone().unwrap_or_default();
    format!(
        "{}: acked {} | at cloud {} | dup {} | order {} | stall {:.0} ms | qos0 lost {}/{} | acked missing {} | {}{}\n  {}",
        r.case,
        f.acknowledged,
        f.at_cloud,
        f.duplicates,
        f.order_violations,
        f.longest_stall_ms,
        f.qos0_lost,
        f.qos0_sent,
        f.acked_missing,
        verdict(r),
        r.error
            .as_ref()
            .map(|e| format!(" (error: {e})"))
            .unwrap_or_default(),
        r.observed.join("\n  "),
    )
}

fn verdict(r: &CaseResult) -> &'static str {
    if r.error.is_some() {
        "ERROR"
    } else if r.pass {
        "PASS"
    } else {
        "FAIL"
    }
}

/// The Markdown report: the set-up, one table row per case, then what each case observed.
pub fn markdown(report: &FaultsReport) -> String {
    let mut out = String::new();
    let p = &report.params;
    let _ = writeln!(
        out,
        "### Fault campaign against {} ({}), size {}\n",
        p.sluice_bin.display(),
        if p.sluice_label.is_empty() {
            report.sluice_version.clone()
        } else {
            format!("{}, {}", p.sluice_label, report.sluice_version)
        },
        match p.size {
            Size::Small => "small",
            Size::Full => "full",
        }
    );
    let m = &report.machine;
    let _ = writeln!(out, "{}\n", machine_line(m, &[loadavg_item(m)]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let l = &p.load;
    let _ = writeln!(
        out,
        "Load in every case: {} MQTT 3.1.1 QoS 1 + {} QoS 0 devices × {} msg/s × {} B, {} CoAP sensors × {} CON publishes/s (QoS 1), {} PHD glucometers × {} confirmed reports/s. Acked = acknowledged to devices (PUBACK, 2.04, confirmation); at cloud = distinct messages the cloud subscriber got; stall = the longest an MQTT QoS 1 message waited from its first send to its PUBACK; acked missing = acknowledged and never at the cloud (MQTT exact, CoAP/PHD a lower bound). PASS = acked missing 0 and the case's check.\n",
        l.mqtt_qos1, l.mqtt_qos0, l.mqtt_rate, l.mqtt_payload, l.coap_sensors, l.coap_rate, l.phd_agents, l.phd_rate,
    );
    let _ = writeln!(
        out,
        "| case | acked | at cloud | dup | order viol. | longest stall | QoS 0 lost / sent | acked missing | case check | verdict |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---|"
    );
    for r in &report.cases {
        let f = r.figures.clone().unwrap_or_default();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.1} s | {} / {} | {} | {} {} | {} |",
            r.case,
            f.acknowledged,
            f.at_cloud,
            f.duplicates,
            f.order_violations,
            f.longest_stall_ms / 1000.0,
            f.qos0_lost,
            f.qos0_sent,
            f.acked_missing,
            r.check,
            if r.check_met { "✔" } else { "✘" },
            verdict(r),
        );
    }
    let _ = writeln!(out, "\n**What each case did and saw**\n");
    for r in &report.cases {
        let _ = writeln!(out, "- **{}** — {} ({:.0} s)", r.case, r.title, r.seconds);
        for line in &r.observed {
            let _ = writeln!(out, "  - {line}");
        }
        if let Some(f) = &r.figures {
            let _ = writeln!(
                out,
                "  - missing by protocol: MQTT {} (exact), CoAP ≥ {}, PHD ≥ {}; never acknowledged (resent, not owed) {}; device reconnects {}; CoAP timeouts {}; MQTT ack p99 {:.1} ms",
                f.mqtt_acked_missing, f.coap_acked_missing_min, f.phd_acked_missing_min, f.never_acknowledged, f.device_reconnects, f.coap_timeouts, f.ack_p99_ms
            );
        }
        if let Some(e) = &r.error {
            let _ = writeln!(out, "  - error: {e}");
        }
    }
    out
}

/// Sleep helper shared by the cases.
pub(crate) async fn pause(d: Duration) {
    tokio::time::sleep(d).await;
}
