//! The `hostile` scenario (issue 28): every finding of the table replayed by a hostile
//! sender against a sluice release binary, while healthy MQTT devices publish through it.
//!
//! Owns: the bed of one case (cloud Mosquitto, sluice with the case's config, the healthy
//! devices), its phases, what is measured around every case and the report. The cases
//! themselves (what the attacker does and the case's verdict) are in [`cases`] (and its
//! folder); the hostile peers (attacker sockets, a CoAP-over-TCP upstream, a oneM2M CSE) in
//! [`peers`]. Does not own: sluice (any binary: `--sluice PATH`), Mosquitto.
//!
//! Per case, a fresh bed: a TLS 1.3 cloud Mosquitto (with an ACL for case 5), sluice started
//! from `sluice_bin` with a generated config (MQTT, CoAP, PHD, admin; one MQTT 5 uplink to the
//! cloud; the case's additions), and `healthy_devices` MQTT 3.1.1 devices each publishing
//! `healthy_rate` QoS 1 messages per second of `healthy_payload` bytes (the pipelined fleet of
//! [`crate::load::paced`]). Phases: 1 s warm-up (discarded), `baseline` (PUBLISH → PUBACK
//! latency; sluice acknowledges after the cloud's PUBACK, so this is device → sluice → cloud →
//! sluice → device), then the attack (at least `min_attack_window`), whose PUBACK latencies
//! are the "during" figures. sluice's RSS is read from `/proc/<pid>/status` before the attack,
//! every 100 ms during it (peak) and after it.
//!
//! Figures per case: bytes the attacker sent ("in": to sluice) and bytes that came back to the
//! attacker's addresses ("out"), counted at the attacker's sockets; the largest datagram out;
//! RSS before/peak/after and growth; healthy p99 baseline vs during and whether it was kept;
//! what the case observed; its target and verdict.
//!
//! Rules (stated in the report): healthy devices kept their p99 when p99(during) ≤
//! [`KEPT_FACTOR`] × p99(baseline) + [`KEPT_SLACK_MS`] ms and no healthy device lost its
//! connection. RSS growth (cases 2, 3) is bounded when the hostile growth ≤ the growth of the
//! same number of well-formed requests (the case's control, run first on the same sluice) +
//! `rss_bound_kib`; case 10 allows per hostile agent a normal agent's growth + 64 KiB (one
//! `max_apdu` read buffer). Answers to the attacker: bytes out ≤ [`AMPLIFICATION`] × bytes in.
//! Who answers what ([`peers::Behaviour`]): a reflection's source is spoofed, so it answers
//! nothing (cases 1, 9, 12); an attacker holding memory or slots owns its addresses, so it
//! answers RFC 9175 Echo challenges but never acknowledges (2, 3, 7, 8); the anonymous client
//! of case 4 and the legitimate clients of 7 and 8 answer Echo and acknowledge.

pub mod cases;
pub mod peers;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};
use tokio::time::{sleep, Instant};

use crate::harness::libcoap::{free_udp_tcp_port, probe_coap};
use crate::harness::machine::{machine, Machine};
use crate::harness::procfs::{cpu_time, rss_kib, Pid};
use crate::harness::sut::{require_sluice_bin, SluiceChild};
use crate::load::paced::{Fleet, FleetConfig};
use crate::report::markdown::{loadavg_item, machine_line};
use crate::stats::LatencySummary;

use peers::TrafficSnapshot;

/// "Kept": p99 during the attack ≤ this × baseline p99 + [`KEPT_SLACK_MS`].
pub const KEPT_FACTOR: f64 = 1.5;
pub const KEPT_SLACK_MS: f64 = 2.0;
/// Largest answer to an unverified source, as a multiple of the request (issue 28).
pub const AMPLIFICATION: f64 = 3.0;

/// The findings, by number.
pub const ALL_CASES: [u8; 13] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13];

/// Parameters of the `hostile` scenario.
#[derive(Debug, Clone, Serialize)]
pub struct HostileScenario {
    pub sluice_bin: PathBuf,
    /// What the binary is (e.g. "main 887093d"), for the report.
    pub sluice_label: String,
    pub cases: Vec<u8>,
    pub healthy_devices: u32,
    /// Messages per second per healthy device.
    pub healthy_rate: f64,
    pub healthy_payload: usize,
    pub baseline: Duration,
    /// The "during" window lasts at least this long.
    pub min_attack_window: Duration,
    /// Hostile RSS growth allowed above the control's, KiB.
    pub rss_bound_kib: u64,
    /// How long case 7 waits for a legitimate observer to be admitted.
    pub expiry_wait: Duration,
    /// `[gateway] shards` (0 = one per core but one, at least one).
    pub shards: u32,
    pub command_line: String,
}

impl HostileScenario {
    /// Every case; 50 healthy devices × 10 msg/s × 100 B; 5 s baseline; 3 s minimum attack
    /// window; 32 MiB RSS bound; 60 s expiry wait.
    pub fn new(sluice_bin: PathBuf) -> HostileScenario {
        HostileScenario {
            sluice_bin,
            sluice_label: String::new(),
            cases: ALL_CASES.to_vec(),
            healthy_devices: 50,
            healthy_rate: 10.0,
            healthy_payload: 100,
            baseline: Duration::from_secs(5),
            min_attack_window: Duration::from_secs(3),
            rss_bound_kib: 32 * 1024,
            expiry_wait: Duration::from_secs(60),
            shards: 0,
            command_line: String::new(),
        }
    }
}

/// The healthy devices around one case.
#[derive(Debug, Clone, Serialize)]
pub struct Healthy {
    pub baseline: LatencySummary,
    pub during: LatencySummary,
    /// Healthy devices whose connection failed during the attack.
    pub failures: u64,
    /// PUBACKs with a failure code during the attack (MQTT 5 only).
    pub rejected: u64,
    pub kept: bool,
}

/// What one case measured.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: u8,
    pub title: String,
    pub traffic: Option<TrafficSnapshot>,
    pub rss_before_kib: u64,
    pub rss_peak_kib: u64,
    pub rss_after_kib: u64,
    pub healthy: Option<Healthy>,
    /// What the case saw, one line each.
    pub observed: Vec<String>,
    /// The target for this case.
    pub target: String,
    pub met: bool,
    /// Set when the case could not be run to the end (then `met` is false).
    pub error: Option<String>,
    pub sluice_config: String,
}

/// Everything the scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct HostileReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub sluice_version: String,
    pub params: HostileScenario,
    pub cases: Vec<CaseResult>,
}

/// A case's own outcome (the bed adds traffic-independent figures around it).
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub traffic: Option<TrafficSnapshot>,
    pub observed: Vec<String>,
    pub target: String,
    pub met: bool,
}

/// What a case needs in its bed beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct BedSpec {
    /// `[[mqtt.users]]` "healthy" and "sensor" with `allow_anonymous = false`.
    pub mqtt_users: bool,
    /// Lines added to `[coap]`.
    pub coap_extra: String,
    /// Text appended after `[coap]` (e.g. `[[coap.proxy]]`).
    pub coap_tables: String,
    /// An ACL file for the cloud Mosquitto (anonymous clients: what it says).
    pub cloud_acl: Option<String>,
    /// The cloud uplink's `forward` (TOML array text); default `["#"]`.
    pub cloud_forward: Option<String>,
    /// Extra `[[uplink]]` tables (appended at the end).
    pub extra_uplinks: String,
}

/// One case's running processes: cloud, sluice, healthy devices.
pub struct Bed {
    pub pki: TestPki,
    pub cloud: Mosquitto,
    pub sluice: SluiceChild,
    pub coap: SocketAddr,
    pub mqtt: SocketAddr,
    pub phd: SocketAddr,
    pub admin_port: u16,
    /// (username, password) of the "sensor" user when the case has users.
    pub sensor_login: Option<(String, String)>,
    fleet: Option<Fleet>,
    _acl_dir: Option<tempfile::TempDir>,
}

impl Bed {
    pub fn pid(&self) -> u32 {
        self.sluice.pid()
    }

    /// sluice's RSS now (KiB); 0 when it cannot be read (process gone).
    pub fn rss(&self) -> u64 {
        rss_kib(Pid::Other(self.pid())).unwrap_or(0)
    }

    /// sluice's CPU time so far, seconds.
    pub fn cpu_seconds(&self) -> f64 {
        cpu_time(Pid::Other(self.pid()))
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    }

    /// A client of the cloud broker (TLS), as an operator's subscriber.
    pub async fn cloud_client(&self, id: &str) -> anyhow::Result<TestClient> {
        let opts =
            ConnectOpts::v311(id).with_tls(self.pki.rustls_client_config(false), "127.0.0.1");
        let (client, connack) = TestClient::connect(self.cloud.tls_addr(), opts)
            .await
            .context("connecting to the cloud broker")?;
        anyhow::ensure!(
            connack.code == 0,
            "the cloud refused {id}: {}",
            connack.code
        );
        Ok(client)
    }

    /// An MQTT device on sluice (with the "sensor" login when the case has users).
    pub async fn device(&self, id: &str) -> anyhow::Result<TestClient> {
        let mut opts = ConnectOpts::v311(id);
        if let Some((user, password)) = &self.sensor_login {
            opts.username = Some(user.clone());
            opts.password = Some(bytes::Bytes::copy_from_slice(password.as_bytes()));
        }
        let (client, connack) = TestClient::connect(self.mqtt, opts)
            .await
            .context("connecting a device to sluice")?;
        anyhow::ensure!(connack.code == 0, "sluice refused {id}: {}", connack.code);
        Ok(client)
    }

    /// `GET /api/v1/status`: (body bytes, how long it took).
    pub async fn status(&self) -> anyhow::Result<(usize, Duration)> {
        let t = Instant::now();
        let body = crate::harness::metrics::http_get(self.admin_port, "/api/v1/status").await?;
        Ok((body.len(), t.elapsed()))
    }

    /// sluice's `/metrics` text.
    pub async fn metrics(&self) -> String {
        crate::harness::metrics::http_get(self.admin_port, "/metrics")
            .await
            .unwrap_or_default()
    }
}

fn toml_str(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn random_password() -> String {
    format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

/// Start the cloud, sluice with `spec`, and the healthy devices (connected, not yet sending).
pub async fn start_bed(s: &HostileScenario, spec: &BedSpec) -> anyhow::Result<Bed> {
    let (acl_dir, acl_path) = match &spec.cloud_acl {
        Some(text) => {
            let dir = tempfile::tempdir().context("ACL directory")?;
            let path = dir.path().join("acl");
            std::fs::write(&path, text).context("writing the cloud ACL")?;
            (Some(dir), Some(path))
        }
        None => (None, None),
    };
    let (pki, cloud) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let pki = TestPki::try_generate()?;
        let mut builder = Mosquitto::builder().tls(&pki).plain_listener(false);
        if let Some(path) = acl_path {
            builder = builder
                .config_line(format!("acl_file {}", path.display()))
                .log_all(true);
        }
        let cloud = builder.start().context("starting the cloud Mosquitto")?;
        Ok((pki, cloud))
    })
    .await
    .context("cloud start-up panicked")??;
    let mqtt_port = sluice_testkit::free_port()?;
    let admin_port = sluice_testkit::free_port()?;
    let phd_port = sluice_testkit::free_port()?;
    let coap_port = free_udp_tcp_port()?;
    let (users, healthy_login, sensor_login) = if spec.mqtt_users {
        let healthy = ("healthy".to_string(), random_password());
        let sensor = ("sensor".to_string(), random_password());
        let mut text = String::new();
        for (user, password) in [&healthy, &sensor] {
            let hash = sluice::control::admission::hash_password(password.as_bytes())
                .map_err(|e| anyhow::anyhow!("hashing a password: {e}"))?;
            let _ = write!(
                text,
                "\n[[mqtt.users]]\nusername = \"{user}\"\npassword_hash = \"{}\"\n",
                toml_str(&hash)
            );
        }
        (text, Some(healthy), Some(sensor))
    } else {
        (String::new(), None, None)
    };
    let toml = format!(
        "# generated by sluice-bench scenario hostile\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n{anonymous}{users}\n\
         [coap]\nenabled = true\nlisten = \"127.0.0.1:{coap_port}\"\n{coap_extra}\n{coap_tables}\n\
         [phd]\nlisten = \"127.0.0.1:{phd_port}\"\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://127.0.0.1:{cloud_port}\"\nca_file = \"{ca}\"\n\
         client_id = \"sluice-gw\"\nprotocol = \"5\"\nforward = {forward}\n\n\
         [uplink.aggregate]\nenabled = false\n{extra_uplinks}",
        shards = s.shards,
        anonymous = if spec.mqtt_users {
            "allow_anonymous = false\n"
        } else {
            ""
        },
        coap_extra = spec.coap_extra,
        coap_tables = spec.coap_tables,
        cloud_port = cloud.tls_port(),
        ca = toml_str(&pki.ca_path().display().to_string()),
        forward = spec.cloud_forward.as_deref().unwrap_or("[\"#\"]"),
        extra_uplinks = spec.extra_uplinks,
    );
    let sluice = SluiceChild::spawn(&s.sluice_bin, mqtt_port, toml)?;
    sluice.wait_ready().await?;
    sluice.wait_uplink(&cloud).await?;
    let coap = SocketAddr::from(([127, 0, 0, 1], coap_port));
    tokio::task::spawn_blocking(move || probe_coap(coap, Duration::from_secs(10)))
        .await
        .context("CoAP probe panicked")?
        .with_context(|| format!("sluice's CoAP listener; stderr:\n{}", sluice.stderr_tail()))?;
    let fleet = Fleet::connect(FleetConfig {
        devices: s.healthy_devices,
        payload_size: s.healthy_payload,
        client_prefix: "healthy".to_string(),
        topic_prefix: "healthy".to_string(),
        credentials: healthy_login,
        ..FleetConfig::new(sluice.device_addr())
    })
    .await
    .context("connecting the healthy devices")?;
    Ok(Bed {
        pki,
        cloud,
        mqtt: sluice.device_addr(),
        sluice,
        coap,
        phd: SocketAddr::from(([127, 0, 0, 1], phd_port)),
        admin_port,
        sensor_login,
        fleet: Some(fleet),
        _acl_dir: acl_dir,
    })
}

/// Run the chosen cases, each in its own bed.
pub async fn run_hostile(s: &HostileScenario) -> anyhow::Result<HostileReport> {
    require_sluice_bin(&s.sluice_bin)?;
    let machine = machine(&s.command_line);
    let sluice_version = std::process::Command::new(&s.sluice_bin)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mut results = Vec::new();
    for &n in &s.cases {
        let title = cases::title(n).to_string();
        eprintln!("=== scenario hostile: case {n} — {title} ===");
        let r = match run_case(s, n).await {
            Ok(r) => r,
            Err(e) => CaseResult {
                case: n,
                title,
                traffic: None,
                rss_before_kib: 0,
                rss_peak_kib: 0,
                rss_after_kib: 0,
                healthy: None,
                observed: Vec::new(),
                target: cases::target(n).to_string(),
                met: false,
                error: Some(format!("{e:#}")),
                sluice_config: String::new(),
            },
        };
        eprintln!("{}", summary_line(&r));
        results.push(r);
    }
    Ok(HostileReport {
        scenario: "hostile",
        machine,
        sluice_version,
        params: s.clone(),
        cases: results,
    })
}

/// Samples sluice's RSS every 100 ms; the peak.
struct Peak {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Peak {
    fn start(pid: u32, first: u64) -> Peak {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(first));
        let task = {
            let (stop, peak) = (stop.clone(), peak.clone());
            tokio::spawn(async move {
                while !stop.load(Relaxed) {
                    if let Ok(kib) = rss_kib(Pid::Other(pid)) {
                        peak.fetch_max(kib, Relaxed);
                    }
                    sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Peak { stop, peak, task }
    }

    async fn stop(self) -> u64 {
        self.stop.store(true, Relaxed);
        let _ = self.task.await;
        self.peak.load(Relaxed)
    }
}

async fn run_case(s: &HostileScenario, n: u8) -> anyhow::Result<CaseResult> {
    let mut prepared = cases::prepare(n)?;
    let mut bed = start_bed(s, &prepared.spec).await?;
    let config = bed.sluice.config_text().to_string();
    let fleet = bed.fleet.take().context("the healthy devices")?;
    fleet.set_total_rate(f64::from(s.healthy_devices) * s.healthy_rate);
    sleep(Duration::from_secs(1)).await;
    let _ = fleet.take_ack_latency();
    let cpu_at_baseline = bed.cpu_seconds();
    let baseline_started = Instant::now();
    sleep(s.baseline).await;
    let base_hist = fleet.take_ack_latency();
    let baseline_cpu_rate =
        (bed.cpu_seconds() - cpu_at_baseline) / baseline_started.elapsed().as_secs_f64();
    let before = fleet.counters();
    let rss_before = bed.rss();
    let peak = Peak::start(bed.pid(), rss_before);
    let started = Instant::now();
    let ctx = cases::Ctx {
        s,
        bed: &bed,
        baseline_cpu_rate,
    };
    let outcome = cases::attack(n, &ctx, &mut prepared).await;
    if let Some(rest) = s.min_attack_window.checked_sub(started.elapsed()) {
        sleep(rest).await;
    }
    let during_hist = fleet.take_ack_latency();
    let after = fleet.counters();
    let rss_after = bed.rss();
    let rss_peak = peak.stop().await.max(rss_after);
    fleet.set_total_rate(0.0);
    let _ = fleet.stop(Duration::from_secs(2)).await;
    let baseline = LatencySummary::from_histogram(&base_hist);
    let during = LatencySummary::from_histogram(&during_hist);
    let failures = after.device_failures - before.device_failures;
    let rejected = after.rejected - before.rejected;
    let kept = during.count > 0
        && failures == 0
        && rejected == 0
        && during.p99_ms <= KEPT_FACTOR * baseline.p99_ms + KEPT_SLACK_MS;
    let (outcome, error) = match outcome {
        Ok(o) => (o, None),
        Err(e) => (
            Outcome {
                target: cases::target(n).to_string(),
                ..Outcome::default()
            },
            Some(format!("{e:#}")),
        ),
    };
    drop(prepared);
    drop(bed);
    Ok(CaseResult {
        case: n,
        title: cases::title(n).to_string(),
        traffic: outcome.traffic,
        rss_before_kib: rss_before,
        rss_peak_kib: rss_peak,
        rss_after_kib: rss_after,
        healthy: Some(Healthy {
            baseline,
            during,
            failures,
            rejected,
            kept,
        }),
        observed: outcome.observed,
        target: outcome.target,
        met: outcome.met && error.is_none(),
        error,
        sluice_config: config,
    })
}

fn mib(kib: i64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

fn traffic_cell(t: &Option<TrafficSnapshot>) -> String {
    match t {
        Some(t) => format!(
            "{} / {} ({:.2}×; largest {})",
            t.bytes_in,
            t.bytes_out,
            t.ratio(),
            t.largest_out
        ),
        None => "–".to_string(),
    }
}

fn healthy_cell(h: &Option<Healthy>) -> String {
    match h {
        Some(h) => format!(
            "{:.1} → {:.1} ms{}{} {}",
            h.baseline.p99_ms,
            h.during.p99_ms,
            if h.failures > 0 {
                format!(", {} lost", h.failures)
            } else {
                String::new()
            },
            if h.rejected > 0 {
                format!(", {} rejected", h.rejected)
            } else {
                String::new()
            },
            if h.kept { "kept" } else { "NOT kept" }
        ),
        None => "–".to_string(),
    }
}

fn summary_line(r: &CaseResult) -> String {
    format!(
        "case {}: {} | in/out {} | RSS {} → {} MiB (peak {}) | healthy p99 {} | {}{}\n  {}",
        r.case,
        r.title,
        traffic_cell(&r.traffic),
        mib(r.rss_before_kib as i64),
        mib(r.rss_after_kib as i64),
        mib(r.rss_peak_kib as i64),
        healthy_cell(&r.healthy),
        if r.met { "MET" } else { "NOT MET" },
        r.error
            .as_ref()
            .map(|e| format!(" (error: {e})"))
            .unwrap_or_default(),
        r.observed.join("\n  "),
    )
}

/// The Markdown report: parameters and rules, one table row per case, then what each case
/// observed.
pub fn markdown(report: &HostileReport) -> String {
    let mut out = String::new();
    let p = &report.params;
    let _ = writeln!(
        out,
        "### Hostile senders (issue 28) against {} ({})\n",
        p.sluice_bin.display(),
        if p.sluice_label.is_empty() {
            report.sluice_version.clone()
        } else {
            format!("{}, {}", p.sluice_label, report.sluice_version)
        }
    );
    let m = &report.machine;
    let _ = writeln!(out, "{}\n", machine_line(m, &[loadavg_item(m)]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(
        out,
        "Healthy load: {} MQTT 3.1.1 devices × {} msg/s × {} B, QoS 1, through sluice to a TLS 1.3 cloud Mosquitto; p99 of PUBLISH → PUBACK (sluice acknowledges after the cloud's PUBACK) over {} s baseline vs during the attack (≥ {} s). Kept = p99 during ≤ {KEPT_FACTOR} × baseline + {KEPT_SLACK_MS} ms, no healthy device lost, no PUBACK refused. In/out = bytes the attacker sent to sluice / bytes that came back to the attacker's addresses (at its sockets). RSS bound (cases 2, 3): hostile growth ≤ control growth + {} MiB. A fresh cloud and sluice per case.\n",
        p.healthy_devices,
        p.healthy_rate,
        p.healthy_payload,
        p.baseline.as_secs_f64(),
        p.min_attack_window.as_secs_f64(),
        p.rss_bound_kib / 1024,
    );
    let _ = writeln!(
        out,
        "| # | case | in / out bytes | RSS before → after (peak), MiB | healthy p99 baseline → during | target | verdict |\n|---:|---|---:|---:|---|---|---|"
    );
    for r in &report.cases {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} → {} ({}) | {} | {} | {} |",
            r.case,
            r.title,
            traffic_cell(&r.traffic),
            mib(r.rss_before_kib as i64),
            mib(r.rss_after_kib as i64),
            mib(r.rss_peak_kib as i64),
            healthy_cell(&r.healthy),
            r.target,
            if r.error.is_some() {
                "ERROR"
            } else if r.met {
                "MET"
            } else {
                "NOT MET"
            },
        );
    }
    let _ = writeln!(out, "\n**What each case observed**\n");
    for r in &report.cases {
        let _ = writeln!(out, "- **{}. {}**", r.case, r.title);
        for line in &r.observed {
            let _ = writeln!(out, "  - {line}");
        }
        if let Some(e) = &r.error {
            let _ = writeln!(out, "  - error: {e}");
        }
    }
    out
}
