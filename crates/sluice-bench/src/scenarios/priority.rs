//! The `priority` scenario: priority lanes (SegaNet §4.3) over a rate-limited uplink. One
//! high-priority device and three normal ones, each 100 msg/s with 1 KB payloads, go through
//! sluice to a cloud Mosquitto over a link that the normal traffic alone saturates; the high
//! device's latency is compared with and without priority lanes, and against its latency on an
//! idle link.
//!
//! Owns: two network namespaces and the veth pair between them, the link's rate limit (when the
//! scenario installs it), the child processes of every mode (cloud Mosquitto, sluice, the
//! `sluice-bench devices` and `sink` children), the per-mode measurements, the verdicts and the
//! reports (JSON and Markdown). Does not own: sluice's own traffic control (`install_tc`, in
//! `sluice::sink::tc`), the device generator ([`crate::load::devices`]) or the sink
//! ([`crate::sinks::sink`]), which run as children of this process inside the namespaces.
//!
//! # Topology (needs root: CAP_SYS_ADMIN for `ip netns add`, CAP_NET_ADMIN for links and tc)
//! ```text
//!  netns slp-gw-PID-K                                 netns slp-cloud-PID-K
//!  devices ─▶ sluice 127.0.0.1:1883 ─▶ veth0 10.231.0.1/30 ══ veth1 10.231.0.2/30 ─▶ Mosquitto :8883 (TLS 1.3)
//!                                      (rate limit on veth0 egress)                  sink (TLS, subscribes '#')
//! ```
//! `veth0` carries `gso_max_segs 1`, so the qdisc sees MTU-sized packets as a real slow link
//! would (a 64 KB GSO burst would hold the link for a quarter of a second at 2 mbit).
//!
//! # Modes (each a separate run of `duration`, after a `warmup` run of the same devices)
//! - `unloaded`: only the high device, priority on, `install_tc = true` (sluice installs its
//!   htb tree): the baseline for the verdicts.
//! - `off`: all devices, no `[priority]` section; the scenario limits `veth0` with an htb root
//!   and one class at the rate (leaf `pfifo_fast`, which maps `SO_PRIORITY` to bands like a
//!   stock Linux interface — irrelevant here since nothing is marked).
//! - `lanes`: priority on (separate high session, `SO_PRIORITY` 6 + DSCP EF, `TCP_NOTSENT_LOWAT`
//!   on the normal socket); the scenario installs the same single-class limit, whose
//!   `pfifo_fast` leaf puts the high lane's priority-6 packets in band 0.
//! - `lanes+tc`: priority on with `install_tc = true`, `tc_interface = "veth0"`,
//!   `tc_rate = RATE`; the scenario installs nothing.
//!
//! Every mode has `[uplink.aggregate] enabled = false` and one shard. Per mode: a fresh cloud
//! Mosquitto and sluice; a warm-up devices run (no subscriber yet, so the cloud drops those
//! messages; it ends only when every PUBLISH was acknowledged, so the measured run starts with
//! empty queues and warm TLS sessions); then the sink subscribes, the measured devices run
//! follows, and the sink stops once nothing arrived for `drain_idle`.
//!
//! # What is measured, per device
//! sent and acknowledged (device side), delivered (unique arrivals at the sink), lost =
//! sent − delivered, end-to-end latency avg/p99 (device send timestamp → sink receive; from the
//! sink's per-device report) and ack latency (PUBLISH → PUBACK at the device; sluice acks after
//! the cloud's PUBACK). Ticks a device skipped because its 64-message window was full are
//! counted (`skipped`): that is back-pressure, not loss. `tc -s` statistics of `veth0` are
//! captured at the end of each mode.
//!
//! # Verdicts (computed from the measured numbers)
//! - high p99 in `lanes+tc` ≤ 2 × the high device's p99 in `unloaded`;
//! - every normal device's p99 in `lanes+tc` ≥ 10 × that same unloaded p99 (only the high device
//!   runs unloaded, and its path differs from a normal one only by the lane);
//! - nothing lost in any mode.
//!
//! The report also gives the high device's avg and p99 change from `off` to `lanes` and to
//! `lanes+tc`, next to SegaNet's −36 % avg / −43 % p99.
//!
//! # Clean-up
//! Namespaces and children are guards whose `Drop` removes them, so every exit path cleans up;
//! Ctrl-C and SIGTERM cancel the run (the same path). Children are started through
//! `setpriv --pdeathsig KILL` when available, so they die with the scenario thread even if this
//! process is killed; namespaces left by a killed run (`slp-*-PID-*` whose PID is gone) are
//! deleted at the next start.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use serde::{Deserialize, Serialize};
use sluice_testkit::TestPki;

use crate::harness::machine::{machine, Machine};
use crate::harness::netns::*;
use crate::harness::sut::require_sluice_bin;
use crate::load::devices::PayloadSize;
pub use crate::report::write_json;

mod modes;
mod report;

use modes::*;
use report::mode_summary;
pub use report::{markdown, verdicts};

/// The uplink's MQTT client id prefix: sessions are `sluice-gw-0` and `sluice-gw-0-hi`.
const UPLINK_CLIENT_ID: &str = "sluice-gw";
/// How long start-up steps (broker, sluice, sink) may take.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// SegaNet's measured change of the high device's latency with priority lanes.
const SEGANET_AVG_CHANGE_PERCENT: f64 = -36.0;
const SEGANET_P99_CHANGE_PERCENT: f64 = -43.0;
/// Target: high p99 with lanes+tc at most this many times its unloaded p99…
const HIGH_P99_MAX_FACTOR: f64 = 2.0;
/// …while normal p99 grows at least this many times.
const NORMAL_P99_MIN_FACTOR: f64 = 10.0;

/// One run of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Mode {
    #[serde(rename = "unloaded")]
    Unloaded,
    #[serde(rename = "off")]
    Off,
    #[serde(rename = "lanes")]
    Lanes,
    #[serde(rename = "lanes+tc")]
    LanesTc,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Unloaded => "unloaded",
            Mode::Off => "off",
            Mode::Lanes => "lanes",
            Mode::LanesTc => "lanes+tc",
        }
    }

    /// Every mode, in the order they run.
    pub fn all() -> Vec<Mode> {
        vec![Mode::Unloaded, Mode::Off, Mode::Lanes, Mode::LanesTc]
    }

    fn description(self) -> &'static str {
        match self {
            Mode::Unloaded => "only the high device; priority on, sluice installs tc (install_tc)",
            Mode::Off => "all devices; no [priority]; single-class htb limit installed by the scenario",
            Mode::Lanes => "all devices; priority lanes (own session, SO_PRIORITY 6 + DSCP EF); single-class htb limit installed by the scenario",
            Mode::LanesTc => "all devices; priority lanes with install_tc: sluice installs the htb tree and port filters itself",
        }
    }

    fn priority(self) -> bool {
        self != Mode::Off
    }

    fn sluice_installs_tc(self) -> bool {
        matches!(self, Mode::Unloaded | Mode::LanesTc)
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        Mode::all()
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown mode {s:?} (unloaded, off, lanes, lanes+tc)"))
    }
}

/// Parameters of the scenario. [`PriorityScenario::new`] gives the issue's defaults.
#[derive(Debug, Clone)]
pub struct PriorityScenario {
    /// Devices in the loaded modes (the first `high_devices` are high priority).
    pub devices: u32,
    pub high_devices: u32,
    pub rate_per_device: f64,
    pub payload: PayloadSize,
    /// The uplink's rate, in tc units ("2mbit").
    pub link_rate: String,
    /// Measured part of each mode.
    pub duration: Duration,
    /// Warm-up run before each mode (0: none).
    pub warmup: Duration,
    /// Modes, run in this order.
    pub modes: Vec<Mode>,
    /// After the devices stop, the sink stops once nothing arrived for this long.
    pub drain_idle: Duration,
    /// Devices wait at most this long for their outstanding PUBACKs.
    pub drain_max: Duration,
    pub max_inflight: u16,
    pub sluice_bin: PathBuf,
    /// The `sluice-bench` binary whose `devices` and `sink` subcommands run as children.
    pub bench_bin: PathBuf,
    /// Recorded in the report.
    pub command_line: String,
    /// Progress lines on stderr.
    pub verbose: bool,
}

impl PriorityScenario {
    /// 4 devices (1 high) × 100 msg/s × 1024 B over 2 mbit, 20 s per mode after a 3 s warm-up.
    pub fn new(sluice_bin: PathBuf, bench_bin: PathBuf) -> PriorityScenario {
        PriorityScenario {
            devices: 4,
            high_devices: 1,
            rate_per_device: 100.0,
            payload: PayloadSize {
                min: 1024,
                max: 1024,
            },
            link_rate: "2mbit".to_string(),
            duration: Duration::from_secs(20),
            warmup: Duration::from_secs(3),
            modes: Mode::all(),
            drain_idle: Duration::from_secs(3),
            drain_max: Duration::from_secs(30),
            max_inflight: 64,
            sluice_bin,
            bench_bin,
            command_line: String::new(),
            verbose: true,
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.devices == 0 || self.high_devices == 0 || self.high_devices >= self.devices {
            bail!(
                "need at least one high and one normal device (devices {}, high {})",
                self.devices,
                self.high_devices
            );
        }
        if self.modes.is_empty() {
            bail!("no mode selected");
        }
        if !valid_link_rate(&self.link_rate) {
            bail!(
                "link rate {:?} is not a tc rate such as \"2mbit\" or \"512kbit\"",
                self.link_rate
            );
        }
        if !(self.rate_per_device.is_finite() && self.rate_per_device > 0.0) {
            bail!("the rate per device must be a positive number of messages per second");
        }
        if self.duration.is_zero() {
            bail!("the duration must be more than 0");
        }
        require_sluice_bin(&self.sluice_bin)?;
        if !self.bench_bin.is_file() {
            bail!("sluice-bench binary {} not found", self.bench_bin.display());
        }
        Ok(())
    }
}

/// Parameters as run.
#[derive(Debug, Clone, Serialize)]
pub struct PriorityParams {
    pub devices: u32,
    pub high_devices: u32,
    pub rate_per_device: f64,
    pub payload_min: usize,
    pub payload_max: usize,
    pub link_rate: String,
    /// Link rate in bit/s, and what the devices offer (payload only, no MQTT/TLS/TCP overhead).
    pub link_bits_per_s: f64,
    pub offered_payload_bits_per_s_normal: f64,
    pub offered_payload_bits_per_s_high: f64,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub drain_idle_s: f64,
    pub drain_max_s: f64,
    pub max_inflight: u16,
    pub shards: u32,
    pub sluice_bin: String,
    /// "sink e2e" (device send → sink receive) or "device ack" when the sink has no
    /// per-device report.
    pub latency_source: String,
}

/// One device in one mode.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceRow {
    pub device: u32,
    pub client_id: String,
    pub high: bool,
    pub sent: u64,
    pub acknowledged: u64,
    /// Unique arrivals at the sink (`None` when the sink has no per-device report).
    pub delivered: Option<u64>,
    /// sent − delivered.
    pub lost: Option<i64>,
    /// Ticks skipped because the device's inflight window was full (back-pressure).
    pub skipped: Option<u64>,
    /// End to end (send → sink), ms.
    pub e2e_mean_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    pub e2e_max_ms: Option<f64>,
    /// PUBLISH → PUBACK at the device, ms.
    pub ack_mean_ms: f64,
    pub ack_p99_ms: f64,
}

impl DeviceRow {
    /// The latency the verdicts use: e2e when the sink reported it, else ack.
    fn mean_ms(&self) -> f64 {
        self.e2e_mean_ms.unwrap_or(self.ack_mean_ms)
    }
    fn p99_ms(&self) -> f64 {
        self.e2e_p99_ms.unwrap_or(self.ack_p99_ms)
    }
}

/// One mode, measured.
#[derive(Debug, Clone, Serialize)]
pub struct ModeRun {
    pub mode: Mode,
    pub description: String,
    pub devices: Vec<DeviceRow>,
    pub sent: u64,
    pub acknowledged: u64,
    /// Unique arrivals at the sink.
    pub delivered: u64,
    /// sent − delivered, all devices.
    pub lost: i64,
    pub duplicates: u64,
    pub order_violations: u64,
    pub skipped_inflight_full: u64,
    pub device_reconnects: u64,
    pub device_connect_failures: u64,
    /// Whether the cloud saw the high lane's session (`sluice-gw-0-hi`).
    pub high_session_seen: bool,
    /// Commands the scenario ran to limit the link (empty when sluice installed tc).
    pub link_setup: Vec<String>,
    /// `tc -s qdisc`, `tc -s class` and `tc filter` of veth0 at the end of the measured run.
    pub tc_stats: String,
    /// The generated sluice config.
    pub sluice_config: String,
    /// Last lines sluice logged (level info, stdout and stderr).
    pub sluice_log_tail: String,
    pub warmup_sent: u64,
    pub measured_s: f64,
    /// `/proc/loadavg` when the measured run started and when it ended: other work on this
    /// machine shows up here (and in the latency tails).
    pub loadavg_start: String,
    pub loadavg_end: String,
    /// The devices child's full JSON report.
    pub devices_report: serde_json::Value,
    /// The sink child's full JSON report.
    pub sink_report: serde_json::Value,
}

impl ModeRun {
    fn high(&self) -> Option<&DeviceRow> {
        self.devices.iter().find(|d| d.high)
    }
    fn normals(&self) -> impl Iterator<Item = &DeviceRow> {
        self.devices.iter().filter(|d| !d.high)
    }
}

/// A check of the target, or a comparison, computed from measured numbers.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub name: String,
    pub target: String,
    pub measured: String,
    /// `None`: informational, or a mode it needs did not run.
    pub pass: Option<bool>,
}

/// Everything the scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct PriorityReport {
    pub scenario: String,
    pub machine: Machine,
    pub params: PriorityParams,
    pub topology: String,
    pub modes: Vec<ModeRun>,
    pub verdicts: Vec<Verdict>,
}

/// Run the scenario; Ctrl-C or SIGTERM cancel it (children and namespaces are cleaned up
/// either way). The work happens on one dedicated thread, the parent of every child process.
pub async fn run_priority(config: &PriorityScenario) -> anyhow::Result<PriorityReport> {
    config.validate()?;
    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let worker = {
        let config = config.clone();
        let cancel = cancel.clone();
        std::thread::Builder::new()
            .name("scenario-priority".to_string())
            .spawn(move || {
                let _ = tx.send(run_blocking(&config, &cancel));
            })
            .context("starting the scenario thread")?
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing a SIGTERM handler")?;
    tokio::pin!(rx);
    let result = tokio::select! {
        r = &mut rx => r,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("scenario priority: interrupted; cleaning up");
            cancel.store(true, Ordering::Relaxed);
            rx.await
        }
        _ = term.recv() => {
            eprintln!("scenario priority: terminated; cleaning up");
            cancel.store(true, Ordering::Relaxed);
            rx.await
        }
    };
    let _ = tokio::task::spawn_blocking(move || worker.join()).await;
    result.map_err(|_| anyhow!("the scenario thread ended without a result"))?
}

/// Whether `s` is a tc rate (number + bit/kbit/mbit/gbit or bps/kbps/mbps/gbps).
pub fn valid_link_rate(s: &str) -> bool {
    link_rate_bits(s).is_some()
}

fn link_rate_bits(s: &str) -> Option<f64> {
    let s = s.trim().to_ascii_lowercase();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = s.split_at(split);
    let value: f64 = number.parse().ok()?;
    let factor = match unit {
        "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        _ => return None,
    };
    let bits = value * factor;
    (bits.is_finite() && bits >= 1.0).then_some(bits)
}

fn run_blocking(config: &PriorityScenario, cancel: &AtomicBool) -> anyhow::Result<PriorityReport> {
    let cancel = Cancel(cancel);
    preflight()?;
    remove_stale_namespaces();
    let machine = machine(&config.command_line);
    let sluice_bin = std::fs::canonicalize(&config.sluice_bin)
        .with_context(|| format!("resolving {}", config.sluice_bin.display()))?;
    let bench_bin = std::fs::canonicalize(&config.bench_bin)
        .with_context(|| format!("resolving {}", config.bench_bin.display()))?;
    let per_device_sink = sink_has_per_device(&bench_bin);
    if !per_device_sink {
        eprintln!(
            "scenario priority: this sluice-bench's sink has no --per-device report yet; \
             per-device latencies are device ack latencies (PUBLISH → PUBACK), not end to end"
        );
    }
    let pki = TestPki::try_generate().context("generating certificates")?;
    let work = tempfile::Builder::new()
        .prefix("sluice-priority-")
        .tempdir()
        .context("creating a temporary directory")?;
    let net = Namespaces::create()?;
    let ctx = Ctx {
        config,
        cancel: &cancel,
        net: &net,
        pki: &pki,
        work: work.path(),
        sluice_bin: &sluice_bin,
        bench_bin: &bench_bin,
        per_device_sink,
        pdeathsig: which("setpriv"),
    };
    // Check every generated config before anything runs: a sluice without the priority keys
    // fails here, with sluice's own message.
    for &mode in &config.modes {
        ctx.check_sluice_config(mode)?;
    }
    let mut modes = Vec::new();
    for &mode in &config.modes {
        cancel.check()?;
        eprintln!(
            "=== scenario priority: mode {} — {} ===",
            mode.name(),
            mode.description()
        );
        let run = ctx
            .run_mode(mode)
            .with_context(|| format!("mode {}", mode.name()))?;
        eprintln!("{}", mode_summary(&run));
        modes.push(run);
    }
    let verdicts = verdicts(&modes);
    let rate_bits = link_rate_bits(&config.link_rate).unwrap_or(0.0);
    let payload_bits = (config.payload.min + config.payload.max) as f64 / 2.0 * 8.0;
    Ok(PriorityReport {
        scenario: "priority".to_string(),
        machine,
        params: PriorityParams {
            devices: config.devices,
            high_devices: config.high_devices,
            rate_per_device: config.rate_per_device,
            payload_min: config.payload.min,
            payload_max: config.payload.max,
            link_rate: config.link_rate.clone(),
            link_bits_per_s: rate_bits,
            offered_payload_bits_per_s_normal: f64::from(config.devices - config.high_devices)
                * config.rate_per_device
                * payload_bits,
            offered_payload_bits_per_s_high: f64::from(config.high_devices)
                * config.rate_per_device
                * payload_bits,
            duration_s: config.duration.as_secs_f64(),
            warmup_s: config.warmup.as_secs_f64(),
            drain_idle_s: config.drain_idle.as_secs_f64(),
            drain_max_s: config.drain_max.as_secs_f64(),
            max_inflight: config.max_inflight,
            shards: 1,
            sluice_bin: config.sluice_bin.display().to_string(),
            latency_source: if per_device_sink {
                "sink e2e".to_string()
            } else {
                "device ack".to_string()
            },
        },
        topology: format!(
            "netns {gw}: devices → sluice 127.0.0.1:{DEVICE_PORT} → {GW_IF} {GW_ADDR}/{PREFIX_LEN} \
             (gso_max_segs 1; rate limit on egress) ══ netns {cloud}: {CLOUD_IF} {CLOUD_ADDR}/{PREFIX_LEN} → \
             Mosquitto :{CLOUD_PORT} (TLS 1.3) → sink",
            gw = net.gw,
            cloud = net.cloud
        ),
        modes,
        verdicts,
    })
}

/// Everything a mode needs.
struct Ctx<'a> {
    config: &'a PriorityScenario,
    cancel: &'a Cancel<'a>,
    net: &'a Namespaces,
    pki: &'a TestPki,
    work: &'a Path,
    sluice_bin: &'a Path,
    bench_bin: &'a Path,
    per_device_sink: bool,
    pdeathsig: bool,
}

#[cfg(test)]
mod tests;
