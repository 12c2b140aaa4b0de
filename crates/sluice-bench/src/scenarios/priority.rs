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
//! `sluice::uplink::tc`), the device generator ([`crate::load::devices`]) or the sink
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
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use serde::{Deserialize, Serialize};
use sluice_testkit::TestPki;

use crate::harness::machine::{machine, Machine};
use crate::load::devices::PayloadSize;
pub use crate::report::write_json;

/// Address of `veth0` (gateway side) and of `veth1` (cloud side).
const GW_ADDR: &str = "10.231.0.1";
const CLOUD_ADDR: &str = "10.231.0.2";
const PREFIX_LEN: u8 = 30;
const CLOUD_PORT: u16 = 8883;
const DEVICE_PORT: u16 = 1883;
const GW_IF: &str = "veth0";
const CLOUD_IF: &str = "veth1";
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
        if !self.sluice_bin.is_file() {
            bail!(
                "sluice binary {} not found: build it with `cargo build --release -p sluice` or pass --sluice-bin",
                self.sluice_bin.display()
            );
        }
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

/// Cancellation shared by the scenario thread's waits.
struct Cancel<'a>(&'a AtomicBool);

impl Cancel<'_> {
    fn check(&self) -> anyhow::Result<()> {
        if self.0.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }
    /// Sleep `d`, waking early (with an error) when cancelled.
    fn sleep(&self, d: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + d;
        loop {
            self.check()?;
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            std::thread::sleep((until - now).min(Duration::from_millis(50)));
        }
    }
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

impl Ctx<'_> {
    fn sluice_config(&self, mode: Mode) -> String {
        let mut toml = format!(
            "# generated by sluice-bench scenario priority (mode {mode})\n\
             [gateway]\nshards = 1\n\n\
             [mqtt]\nlisten = \"127.0.0.1:{DEVICE_PORT}\"\n\n\
             [admin]\nenabled = false\n\n\
             [log]\nlevel = \"info\"\n\n",
            mode = mode.name()
        );
        if mode.priority() {
            toml.push_str("[priority]\ndevices = { \"bench-hi-*\" = 1 }\n\n");
        }
        let _ = write!(
            toml,
            "[[uplink]]\nname = \"cloud\"\nurl = \"mqtts://{CLOUD_ADDR}:{CLOUD_PORT}\"\nca_file = \"{ca}\"\n\
             server_name = \"localhost\"\nclient_id = \"{UPLINK_CLIENT_ID}\"\nforward = [\"#\"]\n",
            ca = toml_escape(&self.pki.ca_path().display().to_string()),
        );
        if mode.sluice_installs_tc() {
            let _ = write!(
                toml,
                "install_tc = true\ntc_interface = \"{GW_IF}\"\ntc_rate = \"{}\"\n",
                toml_escape(&self.config.link_rate)
            );
        }
        toml.push_str("\n[uplink.aggregate]\nenabled = false\n");
        toml
    }

    fn check_sluice_config(&self, mode: Mode) -> anyhow::Result<()> {
        let path = self.work.join(format!("check-{}.toml", file_safe(mode)));
        std::fs::write(&path, self.sluice_config(mode)).context("writing a sluice config")?;
        let out = Command::new(self.sluice_bin)
            .arg("check")
            .arg("-c")
            .arg(&path)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {} check", self.sluice_bin.display()))?;
        if !out.status.success() {
            bail!(
                "{} rejects the config of mode {} — does this build have [priority], install_tc \
                 and [uplink.aggregate]? (rebuild with `cargo build --release -p sluice`):\n{}{}",
                self.sluice_bin.display(),
                mode.name(),
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            );
        }
        Ok(())
    }

    fn run_mode(&self, mode: Mode) -> anyhow::Result<ModeRun> {
        let config = self.config;
        let dir = self.work.join(file_safe(mode));
        std::fs::create_dir_all(&dir).context("creating the mode's directory")?;
        reset_link(&self.net.gw)?;
        let link_setup = if mode.sluice_installs_tc() {
            Vec::new()
        } else {
            limit_link(&self.net.gw, &config.link_rate)?
        };
        let cloud = self.start_cloud(&dir)?;
        let sluice_config = self.sluice_config(mode);
        let sluice = self.start_sluice(&dir, &sluice_config, &cloud, mode)?;

        let (devices, high_share) = match mode {
            Mode::Unloaded => (1, 1.0),
            _ => (
                config.devices,
                f64::from(config.high_devices) / f64::from(config.devices),
            ),
        };
        let mut warmup_sent = 0;
        if !config.warmup.is_zero() {
            let report =
                self.run_devices(&dir, "warmup", devices, high_share, config.warmup, &sluice)?;
            warmup_sent = report.sent;
        }
        let high_session_seen = cloud.log().contains(&format!("{UPLINK_CLIENT_ID}-0-hi"));

        let mut sink = self.start_sink(&dir, devices)?;
        let loadavg_start = crate::harness::machine::loadavg();
        let measured_start = Instant::now();
        let devices_report = self.run_devices(
            &dir,
            "measured",
            devices,
            high_share,
            config.duration,
            &sluice,
        )?;
        let measured_s = measured_start.elapsed().as_secs_f64();
        let loadavg_end = crate::harness::machine::loadavg();
        let tc_stats = tc_stats(&self.net.gw);
        // The sink stops by itself once nothing arrived for drain_idle.
        let status = sink.wait(
            config.drain_idle + config.drain_max + Duration::from_secs(30),
            self.cancel,
        )?;
        if !status.success() {
            bail!("the sink failed ({status}):\n{}", sink.stderr_tail(20));
        }
        let sink_json = read_json(&dir.join("sink.json"))?;
        let sluice_log_tail = sluice.stderr_tail(25);
        drop(sluice);
        drop(cloud);
        reset_link(&self.net.gw)?;
        build_mode_run(ModeParts {
            mode,
            devices_json: read_json(&dir.join("devices-measured.json"))?,
            sink_json,
            devices_report,
            link_setup,
            tc_stats,
            sluice_config,
            sluice_log_tail,
            warmup_sent,
            measured_s,
            loadavg: (loadavg_start, loadavg_end),
            high_session_seen,
            per_device_sink: self.per_device_sink,
        })
    }

    fn spawn(
        &self,
        what: &'static str,
        ns: &str,
        program: &Path,
        args: &[String],
        stderr: &Path,
    ) -> anyhow::Result<NsChild> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns]);
        if self.pdeathsig {
            cmd.args(["setpriv", "--pdeathsig", "KILL", "--"]);
        }
        cmd.arg(program).args(args);
        // stdout and stderr share one file: sluice logs to stdout, the bench tools to stderr.
        let log_file = std::fs::File::create(stderr)
            .with_context(|| format!("creating {}", stderr.display()))?;
        let stdout_file = log_file
            .try_clone()
            .with_context(|| format!("opening {} twice", stderr.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout_file)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {what} ({})", program.display()))?;
        Ok(NsChild {
            what,
            child,
            stderr_path: stderr.to_path_buf(),
            exited: None,
        })
    }

    fn start_cloud(&self, dir: &Path) -> anyhow::Result<CloudBroker> {
        let mosquitto = sluice_testkit::broker::find_mosquitto()?;
        let log_path = dir.join("mosquitto.log");
        let conf_path = dir.join("mosquitto.conf");
        let conf = format!(
            "# generated by sluice-bench scenario priority\n\
             per_listener_settings false\nallow_anonymous true\npersistence false\n\
             log_dest file {log}\nlog_type error\nlog_type warning\nlog_type notice\nlog_type information\n\
             connection_messages true\nmax_inflight_messages 0\nmax_queued_messages 1000000\n\
             set_tcp_nodelay true\nuser root\n\n\
             listener {CLOUD_PORT}\ncafile {ca}\ncertfile {cert}\nkeyfile {key}\n\
             tls_version tlsv1.3\nrequire_certificate false\n",
            log = log_path.display(),
            ca = self.pki.ca_path().display(),
            cert = self.pki.server_cert_path().display(),
            key = self.pki.server_key_path().display(),
        );
        std::fs::write(&conf_path, conf).context("writing mosquitto.conf")?;
        let child = self.spawn(
            "the cloud Mosquitto",
            &self.net.cloud,
            &mosquitto,
            &["-c".to_string(), conf_path.display().to_string()],
            &dir.join("mosquitto.out"),
        )?;
        let mut broker = CloudBroker { child, log_path };
        let deadline = Instant::now() + START_TIMEOUT;
        while !listening(&self.net.cloud, CLOUD_PORT) {
            self.cancel.check()?;
            if broker.child.has_exited() {
                bail!(
                    "the cloud Mosquitto exited during start-up:\n{}\n{}",
                    tail(&broker.log(), 20),
                    broker.child.stderr_tail(20)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "the cloud Mosquitto did not listen on :{CLOUD_PORT} within {START_TIMEOUT:?}"
                );
            }
            self.cancel.sleep(Duration::from_millis(50))?;
        }
        Ok(broker)
    }

    fn start_sluice(
        &self,
        dir: &Path,
        toml: &str,
        cloud: &CloudBroker,
        mode: Mode,
    ) -> anyhow::Result<NsChild> {
        let path = dir.join("sluice.toml");
        std::fs::write(&path, toml).context("writing sluice.toml")?;
        let mut sluice = self.spawn(
            "sluice",
            &self.net.gw,
            self.sluice_bin,
            &[
                "run".to_string(),
                "-c".to_string(),
                path.display().to_string(),
            ],
            &dir.join("sluice.log"),
        )?;
        let normal = format!(" as {UPLINK_CLIENT_ID}-0 ");
        let normal_eol = format!(" as {UPLINK_CLIENT_ID}-0\n");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.cancel.check()?;
            if sluice.has_exited() {
                bail!("sluice exited during start-up:\n{}", sluice.stderr_tail(30));
            }
            let log = cloud.log();
            let connected = log.contains(&normal) || log.contains(&normal_eol);
            if connected && listening(&self.net.gw, DEVICE_PORT) {
                break;
            }
            if Instant::now() >= deadline {
                bail!(
                    "sluice did not listen on :{DEVICE_PORT} and connect to the cloud within \
                     {START_TIMEOUT:?}; sluice:\n{}\ncloud:\n{}",
                    sluice.stderr_tail(30),
                    tail(&log, 20)
                );
            }
            self.cancel.sleep(Duration::from_millis(50))?;
        }
        if mode.priority() {
            // The high lane may connect a moment later (or lazily): give it two seconds; the
            // report records whether the cloud saw it.
            let deadline = Instant::now() + Duration::from_secs(2);
            while !cloud.log().contains(&format!("{UPLINK_CLIENT_ID}-0-hi"))
                && Instant::now() < deadline
            {
                self.cancel.sleep(Duration::from_millis(50))?;
            }
        }
        Ok(sluice)
    }

    fn start_sink(&self, dir: &Path, devices: u32) -> anyhow::Result<NsChild> {
        let config = self.config;
        let max = config.duration + config.drain_max + config.drain_idle + Duration::from_secs(60);
        let mut args: Vec<String> = vec![
            "sink".into(),
            "--broker".into(),
            format!("127.0.0.1:{CLOUD_PORT}"),
            "--tls".into(),
            "--ca".into(),
            self.pki.ca_path().display().to_string(),
            "--server-name".into(),
            "localhost".into(),
            "--topic".into(),
            "#".into(),
            "--expect-devices".into(),
            devices.to_string(),
            "--duration".into(),
            format!("{}ms", max.as_millis()),
            "--idle-exit".into(),
            format!("{}ms", config.drain_idle.as_millis()),
            "--progress".into(),
            "0s".into(),
            "--out".into(),
            dir.join("sink.json").display().to_string(),
        ];
        if self.per_device_sink {
            args.push("--per-device".into());
        }
        let mut sink = self.spawn(
            "the sink",
            &self.net.cloud,
            self.bench_bin,
            &args,
            &dir.join("sink.stderr"),
        )?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.cancel.check()?;
            let stderr = std::fs::read_to_string(dir.join("sink.stderr")).unwrap_or_default();
            if stderr.contains("sink: subscribed") {
                return Ok(sink);
            }
            if sink.has_exited() {
                bail!("the sink exited during start-up:\n{}", sink.stderr_tail(20));
            }
            if Instant::now() >= deadline {
                bail!(
                    "the sink did not subscribe within {START_TIMEOUT:?}:\n{}",
                    sink.stderr_tail(20)
                );
            }
            self.cancel.sleep(Duration::from_millis(50))?;
        }
    }

    /// Run a devices child to completion and return its report.
    fn run_devices(
        &self,
        dir: &Path,
        label: &str,
        devices: u32,
        high_share: f64,
        duration: Duration,
        sluice: &NsChild,
    ) -> anyhow::Result<DevicesJson> {
        let config = self.config;
        let out = dir.join(format!("devices-{label}.json"));
        let ramp = (duration / 10).min(Duration::from_secs(1));
        let payload = if config.payload.min == config.payload.max {
            config.payload.min.to_string()
        } else {
            format!("{}..{}", config.payload.min, config.payload.max)
        };
        let args: Vec<String> = vec![
            "devices".into(),
            "--target".into(),
            format!("127.0.0.1:{DEVICE_PORT}"),
            "-n".into(),
            devices.to_string(),
            "--high-share".into(),
            high_share.to_string(),
            "--rate".into(),
            config.rate_per_device.to_string(),
            "--payload".into(),
            payload,
            "--qos".into(),
            "1".into(),
            "--duration".into(),
            format!("{}ms", duration.as_millis()),
            "--ramp".into(),
            format!("{}ms", ramp.as_millis()),
            "--max-inflight".into(),
            config.max_inflight.to_string(),
            "--drain-timeout".into(),
            format!("{}ms", config.drain_max.as_millis()),
            "--progress".into(),
            if config.verbose { "5s" } else { "0s" }.into(),
            "--out".into(),
            out.display().to_string(),
        ];
        if config.verbose {
            eprintln!(
                "  {label}: {devices} device(s) for {:.1} s",
                duration.as_secs_f64()
            );
        }
        let stderr = dir.join(format!("devices-{label}.stderr"));
        let mut child = self.spawn("the devices", &self.net.gw, self.bench_bin, &args, &stderr)?;
        let limit = duration + config.drain_max + Duration::from_secs(30);
        let status = child.wait(limit, self.cancel)?;
        if !status.success() {
            bail!(
                "the {label} devices run failed ({status}):\n{}\nsluice:\n{}",
                child.stderr_tail(20),
                sluice.stderr_tail(20)
            );
        }
        if config.verbose {
            let text = std::fs::read_to_string(&stderr).unwrap_or_default();
            for line in text.lines().filter(|l| l.starts_with("[devices")) {
                eprintln!("  {line}");
            }
        }
        let value = read_json(&out)?;
        serde_json::from_value(value)
            .with_context(|| format!("reading the devices report {}", out.display()))
    }
}

/// The parts of a mode's result.
struct ModeParts {
    mode: Mode,
    devices_json: serde_json::Value,
    sink_json: serde_json::Value,
    devices_report: DevicesJson,
    link_setup: Vec<String>,
    tc_stats: String,
    sluice_config: String,
    sluice_log_tail: String,
    warmup_sent: u64,
    measured_s: f64,
    loadavg: (String, String),
    high_session_seen: bool,
    /// Whether the sink was asked for per-device latency (otherwise its list is empty).
    per_device_sink: bool,
}

fn build_mode_run(p: ModeParts) -> anyhow::Result<ModeRun> {
    let sink: SinkJson = serde_json::from_value(p.sink_json.clone())
        .context("reading the sink report (unexpected shape)")?;
    let sink_per_device = if p.per_device_sink {
        Some(sink.per_device.unwrap_or_default())
    } else {
        None
    };
    let d = &p.devices_report;
    if d.per_device.is_empty() {
        bail!("the devices report has no per-device counts (needs at most 64 devices)");
    }
    let rows = d
        .per_device
        .iter()
        .map(|t| {
            let e2e = sink_per_device
                .as_ref()
                .and_then(|all| all.iter().find(|l| l.device() == Some(t.device)));
            let delivered = sink_per_device
                .as_ref()
                .map(|_| e2e.map_or(0, |l| l.received));
            DeviceRow {
                device: t.device,
                client_id: t.client_id.clone(),
                high: t.high,
                sent: t.sent,
                acknowledged: t.acknowledged,
                delivered,
                lost: delivered.map(|r| t.sent as i64 - r as i64),
                skipped: Some(t.skipped_inflight_full),
                e2e_mean_ms: e2e.map(|l| l.mean_ms),
                e2e_p50_ms: e2e.map(|l| l.p50_ms),
                e2e_p99_ms: e2e.map(|l| l.p99_ms),
                e2e_max_ms: e2e.map(|l| l.max_ms),
                ack_mean_ms: t.ack_latency_steady.mean_ms,
                ack_p99_ms: t.ack_latency_steady.p99_ms,
            }
        })
        .collect();
    Ok(ModeRun {
        mode: p.mode,
        description: p.mode.description().to_string(),
        devices: rows,
        sent: d.sent,
        acknowledged: d.acknowledged,
        delivered: sink.unique,
        lost: d.sent as i64 - sink.unique as i64,
        duplicates: sink.duplicates,
        order_violations: sink.order_violations,
        skipped_inflight_full: d.skipped_inflight_full,
        device_reconnects: d.reconnects,
        device_connect_failures: d.connect_failures,
        high_session_seen: p.high_session_seen,
        link_setup: p.link_setup,
        tc_stats: p.tc_stats,
        sluice_config: p.sluice_config,
        sluice_log_tail: p.sluice_log_tail,
        warmup_sent: p.warmup_sent,
        measured_s: (p.measured_s * 1000.0).round() / 1000.0,
        loadavg_start: p.loadavg.0,
        loadavg_end: p.loadavg.1,
        devices_report: p.devices_json,
        sink_report: p.sink_json,
    })
}

/// The verdicts against the issue's target, plus the SegaNet comparison.
pub fn verdicts(modes: &[ModeRun]) -> Vec<Verdict> {
    let find = |m: Mode| modes.iter().find(|r| r.mode == m);
    let mut out = Vec::new();
    let base = find(Mode::Unloaded)
        .and_then(|r| r.high())
        .map(DeviceRow::p99_ms);
    let tc = find(Mode::LanesTc);
    let high_tc = tc.and_then(|r| r.high()).map(DeviceRow::p99_ms);
    out.push(match (base, high_tc) {
        (Some(b), Some(h)) => Verdict {
            name: "high device p99 stays within 2× its unloaded p99 (lanes+tc)".to_string(),
            target: format!(
                "≤ {HIGH_P99_MAX_FACTOR}× {b:.2} ms = {:.2} ms",
                HIGH_P99_MAX_FACTOR * b
            ),
            measured: format!("{h:.2} ms ({:.2}×)", ratio(h, b)),
            pass: Some(h <= HIGH_P99_MAX_FACTOR * b),
        },
        _ => not_run(
            "high device p99 stays within 2× its unloaded p99 (lanes+tc)",
            "unloaded and lanes+tc",
        ),
    });
    let normal_tc = tc.map(|r| r.normals().map(DeviceRow::p99_ms).collect::<Vec<_>>());
    out.push(match (base, normal_tc) {
        (Some(b), Some(ps)) if !ps.is_empty() => {
            let min = ps.iter().copied().fold(f64::INFINITY, f64::min);
            Verdict {
                name: "normal p99 grows ≥ 10× (lanes+tc, every normal device, vs the unloaded p99)"
                    .to_string(),
                target: format!(
                    "≥ {NORMAL_P99_MIN_FACTOR}× {b:.2} ms = {:.2} ms",
                    NORMAL_P99_MIN_FACTOR * b
                ),
                measured: format!(
                    "lowest normal p99 {min:.2} ms ({:.1}×); all: {}",
                    ratio(min, b),
                    ps.iter()
                        .map(|p| format!("{p:.1}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                pass: Some(min >= NORMAL_P99_MIN_FACTOR * b),
            }
        }
        _ => not_run("normal p99 grows ≥ 10× (lanes+tc)", "unloaded and lanes+tc"),
    });
    let lost: Vec<String> = modes
        .iter()
        .map(|r| format!("{} {}", r.mode.name(), r.lost))
        .collect();
    out.push(Verdict {
        name: "nothing lost (sent − delivered, every mode)".to_string(),
        target: "0 in every mode".to_string(),
        measured: lost.join(", "),
        pass: (!modes.is_empty()).then(|| modes.iter().all(|r| r.lost == 0)),
    });
    let off_high = find(Mode::Off).and_then(|r| r.high());
    for mode in [Mode::Lanes, Mode::LanesTc] {
        let name = format!(
            "high device avg / p99 change, off → {} (SegaNet: {SEGANET_AVG_CHANGE_PERCENT:+.0} % / {SEGANET_P99_CHANGE_PERCENT:+.0} %)",
            mode.name()
        );
        out.push(match (off_high, find(mode).and_then(|r| r.high())) {
            (Some(o), Some(n)) => Verdict {
                name,
                target: "informational".to_string(),
                measured: format!(
                    "avg {:.2} → {:.2} ms ({:+.0} %), p99 {:.2} → {:.2} ms ({:+.0} %)",
                    o.mean_ms(),
                    n.mean_ms(),
                    change_percent(o.mean_ms(), n.mean_ms()),
                    o.p99_ms(),
                    n.p99_ms(),
                    change_percent(o.p99_ms(), n.p99_ms())
                ),
                pass: None,
            },
            _ => not_run(&name, &format!("off and {}", mode.name())),
        });
    }
    out
}

fn not_run(name: &str, needs: &str) -> Verdict {
    Verdict {
        name: name.to_string(),
        target: format!("needs modes {needs}"),
        measured: "not run".to_string(),
        pass: None,
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::INFINITY
    }
}

fn change_percent(from: f64, to: f64) -> f64 {
    if from > 0.0 {
        (to - from) / from * 100.0
    } else {
        0.0
    }
}

fn mode_summary(r: &ModeRun) -> String {
    let mut s = format!(
        "{}: sent {} delivered {} lost {} dup {} skipped(window full) {}",
        r.mode.name(),
        r.sent,
        r.delivered,
        r.lost,
        r.duplicates,
        r.skipped_inflight_full
    );
    for d in &r.devices {
        let _ = write!(
            s,
            "\n  {:<12} {:<6} avg {:>8.2} ms  p99 {:>8.2} ms  (ack p99 {:>8.2} ms)",
            d.client_id,
            if d.high { "high" } else { "normal" },
            d.mean_ms(),
            d.p99_ms(),
            d.ack_p99_ms
        );
    }
    s
}

/// The Markdown summary: parameters, one table row per device and mode, the verdicts.
pub fn markdown(report: &PriorityReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    let _ = writeln!(
        out,
        "### priority lanes: {} devices ({} high) × {} msg/s × {} B over a {} uplink, {} s per mode (after a {} s warm-up)\n",
        p.devices,
        p.high_devices,
        p.rate_per_device,
        if p.payload_min == p.payload_max {
            p.payload_min.to_string()
        } else {
            format!("{}..{}", p.payload_min, p.payload_max)
        },
        p.link_rate,
        p.duration_s,
        p.warmup_s
    );
    let _ = writeln!(
        out,
        "commit `{}`{} · nproc {} · CPU {} · kernel {} · {}\n",
        m.commit,
        if m.worktree_dirty {
            " (work tree dirty)"
        } else {
            ""
        },
        m.nproc,
        m.cpu_model,
        m.kernel,
        m.mosquitto_version
    );
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(
        out,
        "Offered payload: normal {:.2} Mbit/s, high {:.2} Mbit/s, link {:.2} Mbit/s (MQTT, TLS and TCP/IP overhead come on top). Latency: {}.\n",
        p.offered_payload_bits_per_s_normal / 1e6,
        p.offered_payload_bits_per_s_high / 1e6,
        p.link_bits_per_s / 1e6,
        if p.latency_source == "sink e2e" {
            "end to end, device send → sink receive"
        } else {
            "device ack (PUBLISH → PUBACK; the sink had no per-device report)"
        }
    );
    let _ = writeln!(
        out,
        "| mode | device | lane | sent | delivered | lost | avg ms | p99 ms | ack avg / p99 ms |"
    );
    let _ = writeln!(out, "|---|---|---|---:|---:|---:|---:|---:|---:|");
    for r in &report.modes {
        for d in &r.devices {
            let opt = |v: Option<u64>| v.map_or("–".to_string(), |v| v.to_string());
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} / {:.2} |",
                r.mode.name(),
                d.client_id,
                if d.high { "high" } else { "normal" },
                d.sent,
                opt(d.delivered),
                d.lost.map_or("–".to_string(), |v| v.to_string()),
                d.mean_ms(),
                d.p99_ms(),
                d.ack_mean_ms,
                d.ack_p99_ms
            );
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| mode | sent | delivered | lost | duplicates | ticks skipped (window full) | high session seen | loadavg start → end |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---|---|");
    for r in &report.modes {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} → {} |",
            r.mode.name(),
            r.sent,
            r.delivered,
            r.lost,
            r.duplicates,
            r.skipped_inflight_full,
            if r.mode.priority() {
                if r.high_session_seen {
                    "yes"
                } else {
                    "no"
                }
            } else {
                "–"
            },
            first_fields(&r.loadavg_start, 3),
            first_fields(&r.loadavg_end, 3)
        );
    }
    let _ = writeln!(out, "\n**Verdicts**\n");
    for v in &report.verdicts {
        let mark = match v.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "info",
        };
        let _ = writeln!(
            out,
            "- {mark} — {}: {} (target {})",
            v.name, v.measured, v.target
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Children

/// A child process in a namespace; dropping it stops it (SIGTERM, 5 s, SIGKILL) and reaps it.
struct NsChild {
    what: &'static str,
    child: Child,
    stderr_path: PathBuf,
    exited: Option<ExitStatus>,
}

impl NsChild {
    fn has_exited(&mut self) -> bool {
        if self.exited.is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exited = Some(status);
            }
        }
        self.exited.is_some()
    }

    /// Wait for the child to exit by itself, at most `limit`.
    fn wait(&mut self, limit: Duration, cancel: &Cancel) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if self.has_exited() {
                return self.exited.ok_or_else(|| anyhow!("no exit status"));
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not finish within {limit:?}:\n{}",
                    self.what,
                    self.stderr_tail(20)
                );
            }
            cancel.sleep(Duration::from_millis(50))?;
        }
    }

    /// The last `lines` lines of its output, without terminal colour codes.
    fn stderr_tail(&self, lines: usize) -> String {
        strip_ansi(&tail(
            &std::fs::read_to_string(&self.stderr_path).unwrap_or_default(),
            lines,
        ))
    }
}

impl Drop for NsChild {
    fn drop(&mut self) {
        if self.has_exited() {
            return;
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.has_exited() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cloud Mosquitto in the cloud namespace.
struct CloudBroker {
    child: NsChild,
    log_path: PathBuf,
}

impl CloudBroker {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// Namespaces and the link

/// The two namespaces and the veth pair; dropping it deletes both namespaces (and so the pair).
struct Namespaces {
    gw: String,
    cloud: String,
}

impl Namespaces {
    fn create() -> anyhow::Result<Namespaces> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let gw = format!("slp-gw-{pid}-{k}");
        let cloud = format!("slp-cloud-{pid}-{k}");
        ip(&["netns", "add", &gw]).map_err(|e| {
            anyhow!(
                "cannot create network namespace {gw}: {e:#}\nscenario priority needs root \
                 (CAP_SYS_ADMIN and CAP_NET_ADMIN) on a kernel with network namespaces and veth"
            )
        })?;
        // From here on, Drop deletes whatever exists.
        let mut net = Namespaces {
            gw,
            cloud: String::new(),
        };
        ip(&["netns", "add", &cloud])
            .with_context(|| format!("creating network namespace {cloud}"))?;
        net.cloud = cloud;
        let (gw, cloud) = (net.gw.as_str(), net.cloud.as_str());
        ip(&[
            "-n", gw, "link", "add", GW_IF, "type", "veth", "peer", "name", CLOUD_IF, "netns",
            cloud,
        ])
        .context("creating the veth pair (is the veth module available?)")?;
        let gw_cidr = format!("{GW_ADDR}/{PREFIX_LEN}");
        let cloud_cidr = format!("{CLOUD_ADDR}/{PREFIX_LEN}");
        ip(&["-n", gw, "addr", "add", &gw_cidr, "dev", GW_IF])?;
        ip(&["-n", cloud, "addr", "add", &cloud_cidr, "dev", CLOUD_IF])?;
        // MTU-sized packets at the qdisc, as on a real slow link.
        ip(&["-n", gw, "link", "set", GW_IF, "gso_max_segs", "1"])?;
        for (ns, dev) in [(gw, GW_IF), (gw, "lo"), (cloud, CLOUD_IF), (cloud, "lo")] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(net)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [&self.gw, &self.cloud] {
            if !ns.is_empty() {
                let _ = Command::new("ip")
                    .args(["netns", "del", ns])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

/// Delete `slp-gw-PID-K` / `slp-cloud-PID-K` namespaces whose PID no longer runs (left by a
/// killed scenario).
fn remove_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if let Some(pid) = stale_namespace_pid(name) {
            if !process_alive(pid) {
                eprintln!(
                    "scenario priority: deleting namespace {name} left by a run that is gone"
                );
                let _ = Command::new("ip").args(["netns", "del", name]).status();
            }
        }
    }
}

/// Whether `pid` runs (exists and is not a zombie waiting to be reaped).
fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s.get(i + 1..))
                .map(|rest| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// The PID in a scenario namespace name, e.g. `slp-gw-1234-0` → 1234.
pub fn stale_namespace_pid(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("slp-gw-")
        .or_else(|| name.strip_prefix("slp-cloud-"))?;
    let (pid, k) = rest.split_once('-')?;
    k.parse::<u32>().ok()?;
    pid.parse().ok()
}

/// Remove whatever root qdisc veth0 has (back to the default).
fn reset_link(gw: &str) -> anyhow::Result<()> {
    // "Cannot delete qdisc with handle of zero" when there is none: fine.
    let _ = tc(gw, &["qdisc", "del", "dev", GW_IF, "root"]);
    Ok(())
}

/// The single-class limit of the `off` and `lanes` modes; returns the commands run.
fn limit_link(gw: &str, rate: &str) -> anyhow::Result<Vec<String>> {
    let commands: [&[&str]; 3] = [
        &[
            "qdisc", "replace", "dev", GW_IF, "root", "handle", "1:", "htb", "default", "1",
        ],
        &[
            "class", "add", "dev", GW_IF, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
            "ceil", rate,
        ],
        &[
            "qdisc",
            "add",
            "dev",
            GW_IF,
            "parent",
            "1:1",
            "handle",
            "10:",
            "pfifo_fast",
        ],
    ];
    let mut done = Vec::new();
    for args in commands {
        tc(gw, args).context("limiting the uplink")?;
        done.push(format!("tc {}", args.join(" ")));
    }
    Ok(done)
}

fn tc_stats(gw: &str) -> String {
    let mut out = String::new();
    for args in [
        &["-s", "qdisc", "show", "dev", GW_IF][..],
        &["-s", "class", "show", "dev", GW_IF][..],
        &["filter", "show", "dev", GW_IF][..],
    ] {
        let _ = writeln!(out, "$ tc {}", args.join(" "));
        match tc(gw, args) {
            Ok(text) => out.push_str(&text),
            Err(e) => {
                let _ = writeln!(out, "({e:#})");
            }
        }
    }
    out
}

/// `tc -n NS ARGS`; stdout.
fn tc(ns: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut argv = vec!["-n", ns];
    argv.extend_from_slice(args);
    run_tool("tc", &argv)
}

fn ip(args: &[&str]) -> anyhow::Result<String> {
    run_tool("ip", args)
}

fn run_tool(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} (install iproute2)"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether something listens on TCP `port` inside `ns`.
fn listening(ns: &str, port: u16) -> bool {
    Command::new("ip")
        .args(["netns", "exec", ns, "ss", "-Hltn"])
        .arg(format!("sport = :{port}"))
        .stderr(Stdio::null())
        .output()
        .map(|o| o.status.success() && !String::from_utf8_lossy(&o.stdout).trim().is_empty())
        .unwrap_or(false)
}

/// Root, and the tools the scenario runs.
fn preflight() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if effective_uid(&status) != Some(0) {
        bail!(
            "scenario priority needs root: it creates network namespaces, a veth pair and tc \
             qdiscs (CAP_SYS_ADMIN and CAP_NET_ADMIN); run it with sudo"
        );
    }
    for tool in ["ip", "tc", "ss"] {
        if !which(tool) {
            bail!("scenario priority needs `{tool}` (install iproute2)");
        }
    }
    sluice_testkit::broker::find_mosquitto()
        .context("scenario priority needs mosquitto (apt-get install mosquitto)")?;
    Ok(())
}

/// The effective uid from a `/proc/<pid>/status` text.
pub fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
                .any(|dir| dir.join(tool).is_file())
        })
        .unwrap_or(false)
}

/// Whether this sluice-bench's sink can report per-device latency (`sink --per-device`).
fn sink_has_per_device(bench_bin: &Path) -> bool {
    Command::new(bench_bin)
        .args(["sink", "--help"])
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("--per-device"))
        .unwrap_or(false)
}

fn read_json(path: &Path) -> anyhow::Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `text` without ANSI escape sequences (`ESC [ … letter`), which tracing writes even to files.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The first `n` whitespace-separated fields of `s` (the 1, 5 and 15 minute load averages).
fn first_fields(s: &str, n: usize) -> String {
    s.split_whitespace().take(n).collect::<Vec<_>>().join(" ")
}

fn toml_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn file_safe(mode: Mode) -> String {
    mode.name().replace('+', "-")
}

// ---------------------------------------------------------------------------------------------
// The children's JSON reports (only the fields used here).

#[derive(Debug, Deserialize)]
struct DevicesJson {
    sent: u64,
    acknowledged: u64,
    skipped_inflight_full: u64,
    reconnects: u64,
    connect_failures: u64,
    #[serde(default)]
    per_device: Vec<DeviceTallyJson>,
}

#[derive(Debug, Deserialize)]
struct DeviceTallyJson {
    device: u32,
    client_id: String,
    high: bool,
    sent: u64,
    acknowledged: u64,
    #[serde(default)]
    skipped_inflight_full: u64,
    ack_latency_steady: LatencyJson,
}

#[derive(Debug, Deserialize)]
struct LatencyJson {
    mean_ms: f64,
    p99_ms: f64,
}

#[derive(Debug, Deserialize)]
struct SinkJson {
    unique: u64,
    duplicates: u64,
    order_violations: u64,
    #[serde(default)]
    per_device: Option<Vec<DeviceLatencyJson>>,
}

/// One entry of the sink's per-device report: `{device, received, mean_ms, p50_ms, p99_ms,
/// max_ms}`.
#[derive(Debug, Deserialize)]
struct DeviceLatencyJson {
    device: serde_json::Value,
    received: u64,
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl DeviceLatencyJson {
    /// The device index, whether the sink writes it as a number or a string.
    fn device(&self) -> Option<u32> {
        match &self.device {
            serde_json::Value::Number(n) => n.as_u64().and_then(|v| u32::try_from(v).ok()),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_namespace_names_carry_the_pid_of_their_run() {
        assert_eq!(stale_namespace_pid("slp-gw-1234-0"), Some(1234));
        assert_eq!(stale_namespace_pid("slp-cloud-77-12"), Some(77));
        assert_eq!(stale_namespace_pid("slp-gw-1234"), None);
        assert_eq!(stale_namespace_pid("sluice-tc-1-0"), None);
        assert_eq!(stale_namespace_pid("slp-gw-x-0"), None);
    }

    #[test]
    fn the_effective_uid_is_the_second_uid_field() {
        assert_eq!(effective_uid("Name:\tx\nUid:\t1000\t0\t0\t0\n"), Some(0));
        assert_eq!(effective_uid("Uid:\t0\t1000\t1000\t1000\n"), Some(1000));
        assert_eq!(effective_uid("Name:\tx\n"), None);
    }

    #[test]
    fn colour_codes_are_stripped_from_logs() {
        assert_eq!(
            strip_ansi("\u{1b}[2m2026\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m up \u{1b}[3mshard\u{1b}[0m\u{1b}[2m=\u{1b}[0m0"),
            "2026  INFO up shard=0"
        );
    }

    #[test]
    fn link_rates_are_tc_rates() {
        assert_eq!(link_rate_bits("2mbit"), Some(2e6));
        assert_eq!(link_rate_bits("512Kbit"), Some(512e3));
        assert_eq!(link_rate_bits("250kbps"), Some(2e6));
        assert!(!valid_link_rate("2"));
        assert!(!valid_link_rate("fast"));
        assert!(!valid_link_rate("0mbit"));
    }

    fn row(
        client_id: &str,
        high: bool,
        sent: u64,
        delivered: u64,
        mean: f64,
        p99: f64,
    ) -> DeviceRow {
        DeviceRow {
            device: 0,
            client_id: client_id.to_string(),
            high,
            sent,
            acknowledged: sent,
            delivered: Some(delivered),
            lost: Some(sent as i64 - delivered as i64),
            skipped: None,
            e2e_mean_ms: Some(mean),
            e2e_p50_ms: Some(mean),
            e2e_p99_ms: Some(p99),
            e2e_max_ms: Some(p99),
            ack_mean_ms: 0.0,
            ack_p99_ms: 0.0,
        }
    }

    fn mode(mode: Mode, devices: Vec<DeviceRow>) -> ModeRun {
        let sent = devices.iter().map(|d| d.sent).sum::<u64>();
        let delivered = devices
            .iter()
            .map(|d| d.delivered.unwrap_or(0))
            .sum::<u64>();
        ModeRun {
            mode,
            description: String::new(),
            devices,
            sent,
            acknowledged: sent,
            delivered,
            lost: sent as i64 - delivered as i64,
            duplicates: 0,
            order_violations: 0,
            skipped_inflight_full: 0,
            device_reconnects: 0,
            device_connect_failures: 0,
            high_session_seen: true,
            link_setup: Vec::new(),
            tc_stats: String::new(),
            sluice_config: String::new(),
            sluice_log_tail: String::new(),
            warmup_sent: 0,
            measured_s: 1.0,
            loadavg_start: String::new(),
            loadavg_end: String::new(),
            devices_report: serde_json::Value::Null,
            sink_report: serde_json::Value::Null,
        }
    }

    #[test]
    fn verdicts_are_computed_from_the_measured_latencies() {
        let modes = vec![
            mode(
                Mode::Unloaded,
                vec![row("bench-hi-0", true, 100, 100, 4.0, 8.0)],
            ),
            mode(
                Mode::Off,
                vec![
                    row("bench-hi-0", true, 100, 100, 200.0, 400.0),
                    row("bench-1", false, 100, 100, 400.0, 800.0),
                ],
            ),
            mode(
                Mode::LanesTc,
                vec![
                    row("bench-hi-0", true, 100, 100, 6.0, 12.0),
                    row("bench-1", false, 100, 100, 500.0, 900.0),
                    row("bench-2", false, 100, 99, 500.0, 79.0),
                ],
            ),
        ];
        let v = verdicts(&modes);
        assert_eq!(v[0].pass, Some(true), "{:?}", v[0]);
        assert!(v[0].measured.starts_with("12.00 ms (1.50×)"), "{:?}", v[0]);
        assert_eq!(v[1].pass, Some(false), "79 ms < 10 × 8 ms: {:?}", v[1]);
        assert_eq!(v[2].pass, Some(false), "one message lost: {:?}", v[2]);
        assert!(v[2].measured.contains("lanes+tc 1"), "{:?}", v[2]);
        assert_eq!(v[3].measured, "not run");
        assert!(
            v[4].measured
                .contains("avg 200.00 → 6.00 ms (-97 %), p99 400.00 → 12.00 ms (-97 %)"),
            "{:?}",
            v[4]
        );
    }

    #[test]
    fn without_the_baseline_the_target_verdicts_are_not_run() {
        let modes = vec![mode(
            Mode::Off,
            vec![row("bench-hi-0", true, 10, 10, 1.0, 2.0)],
        )];
        let v = verdicts(&modes);
        assert_eq!(v[0].pass, None);
        assert_eq!(v[1].pass, None);
        assert_eq!(v[2].pass, Some(true));
    }

    #[test]
    fn the_sink_per_device_entries_may_name_the_device_by_number_or_string() {
        let j: DeviceLatencyJson = serde_json::from_str(
            r#"{"device": 3, "received": 5, "mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}"#,
        )
        .unwrap();
        assert_eq!(j.device(), Some(3));
        let j: DeviceLatencyJson = serde_json::from_str(
            r#"{"device": "2", "received": 5, "mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}"#,
        )
        .unwrap();
        assert_eq!(j.device(), Some(2));
    }

    #[test]
    fn the_off_mode_config_has_no_priority_and_lanes_tc_installs_tc() {
        let pki = TestPki::try_generate().unwrap();
        let cancel = AtomicBool::new(false);
        let cancel = Cancel(&cancel);
        let net = Namespaces {
            gw: String::new(),
            cloud: String::new(),
        };
        let config = PriorityScenario::new(PathBuf::from("sluice"), PathBuf::from("bench"));
        let ctx = Ctx {
            config: &config,
            cancel: &cancel,
            net: &net,
            pki: &pki,
            work: Path::new("/tmp"),
            sluice_bin: Path::new("sluice"),
            bench_bin: Path::new("bench"),
            per_device_sink: true,
            pdeathsig: false,
        };
        let off = ctx.sluice_config(Mode::Off);
        assert!(!off.contains("[priority]"), "{off}");
        assert!(!off.contains("install_tc"), "{off}");
        assert!(off.contains("[uplink.aggregate]\nenabled = false"), "{off}");
        let lanes = ctx.sluice_config(Mode::Lanes);
        assert!(
            lanes.contains("[priority]\ndevices = { \"bench-hi-*\" = 1 }"),
            "{lanes}"
        );
        assert!(!lanes.contains("install_tc"), "{lanes}");
        let tc = ctx.sluice_config(Mode::LanesTc);
        assert!(
            tc.contains("install_tc = true\ntc_interface = \"veth0\"\ntc_rate = \"2mbit\""),
            "{tc}"
        );
    }
}
