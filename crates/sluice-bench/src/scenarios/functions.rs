//! `scenario functions` (issue 19, edge functions): what sluice costs in front of a local
//! function, in four parts, each with a fresh `sluice run` (release build) as a child whose
//! `[[function]]` runs one of two minimal echo functions ([`echo`]: a Python `http.server`, and
//! the compiled `sluice-bench fn-echo`) as sluice's own child processes:
//!
//! - **adaptor** ([`adaptor`]): MQTT devices (QoS 1) publish a paced total rate (1,000
//!   events/s) to the function for a window after a warm-up, with `min_instances = 1` and a
//!   long `idle`; sluice's CPU per event beside the function's (all of sluice's children,
//!   live and reaped: [`procs`]). Target: sluice ≤ 1/10 of the Python function. Beside each
//!   function, the same load through the adaptor floor (`sluice-bench fn-floor`, the least
//!   an MQTT → HTTP relay does) in front of an instance the bench starts: the limit the
//!   target is compared with.
//! - **idle** ([`idle`]): devices connected but silent, the function scaled to zero; sluice's
//!   CPU over the window and each thread's wake-ups per second. Target ≤ 0.1 % of a core.
//! - **cold** ([`cold`]): single events, each after the instance stopped (`idle = "300ms"`),
//!   then events while it runs: publish → function → reply percentiles, and sluice's own part
//!   (`sluice_function_dispatch_seconds`, and publish → the function's `main`). Target: sluice's
//!   part ≤ 2 ms.
//! - **predict** ([`predict`]): the synthetic traces of `sluice::functions::predict::traces`
//!   (3 days each) through the real autoscaler on a virtual clock (`runtime::replay`) and the
//!   policies' own replay (library calls, no processes).
//!
//! Owns: the parameters, the generated sluice config ([`sluice_toml`]), [`FnSluice`] (a sluice
//! child with its admin port) and the report. Does not own: the devices
//! ([`crate::load`]), `/proc` basics ([`crate::harness::procfs`]).

pub mod adaptor;
pub mod cold;
pub mod echo;
pub mod idle;
pub mod predict;
pub mod probe;
pub mod procs;
pub mod prom;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::Serialize;

use crate::harness::machine::{machine, Machine};
use crate::harness::metrics::http_get;
use crate::harness::sut::{require_sluice_bin, SluiceChild};

pub use report::markdown;

/// The function name in every generated config (its metrics' `function` label).
pub const FUNCTION: &str = "echo";

/// Which parts to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Part {
    Adaptor,
    Idle,
    Cold,
    Predict,
}

/// The two echo functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FnKind {
    /// `python3 echo.py` (ThreadingHTTPServer).
    Python,
    /// `sluice-bench fn-echo` (std threads).
    Compiled,
}

/// Who starts the function's instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// `command`: sluice's local runtime starts and stops them (the measured design).
    Local,
    /// `url`: the bench starts one instance on `$PORT` before sluice and sluice calls it as a
    /// remote function (no cold starts, no scaling; for a gateway without the local runtime).
    Remote,
}

impl FnKind {
    pub fn name(self) -> &'static str {
        match self {
            FnKind::Python => "python",
            FnKind::Compiled => "compiled",
        }
    }
}

/// The parameters (defaults in [`FunctionsScenario::new`]).
#[derive(Debug, Clone)]
pub struct FunctionsScenario {
    pub sluice_bin: PathBuf,
    /// This executable (serves `fn-echo`).
    pub bench_bin: PathBuf,
    pub parts: Vec<Part>,
    pub kinds: Vec<FnKind>,
    pub placement: Placement,
    /// `[gateway] shards` (0: one per core but one, at least one).
    pub sluice_shards: u32,
    /// Adaptor: events per second, all devices together.
    pub adaptor_rate: f64,
    pub adaptor_devices: u32,
    /// Adaptor: load before the window (not measured), after a 1 s ramp.
    pub adaptor_warmup: Duration,
    pub adaptor_window: Duration,
    /// Adaptor: first the same load on topics no function matches (sluice's MQTT cost alone).
    pub adaptor_baseline: bool,
    /// Adaptor: after each function's sluice row, the same load through the adaptor floor.
    pub adaptor_floor: bool,
    /// Payload bytes of every event (at least the 24-byte bench header).
    pub payload: usize,
    /// Idle: silent devices and the window.
    pub idle_devices: u32,
    pub idle_window: Duration,
    /// Cold: events each after the instance stopped, then events while it runs.
    pub cold_rounds: u32,
    pub warm_rounds: u32,
    /// Cold: the function's `idle` (how soon an instance stops).
    pub cold_idle: Duration,
    pub command_line: String,
}

impl FunctionsScenario {
    pub fn new(sluice_bin: PathBuf, bench_bin: PathBuf) -> FunctionsScenario {
        FunctionsScenario {
            sluice_bin,
            bench_bin,
            parts: vec![Part::Adaptor, Part::Idle, Part::Cold, Part::Predict],
            kinds: vec![FnKind::Python, FnKind::Compiled],
            placement: Placement::Local,
            sluice_shards: 0,
            adaptor_rate: 1000.0,
            adaptor_devices: 10,
            adaptor_warmup: Duration::from_secs(5),
            adaptor_window: Duration::from_secs(30),
            adaptor_baseline: true,
            adaptor_floor: true,
            payload: 128,
            idle_devices: 100,
            idle_window: Duration::from_secs(60),
            cold_rounds: 30,
            warm_rounds: 30,
            cold_idle: Duration::from_millis(300),
            command_line: String::new(),
        }
    }
}

/// What was measured; parts not run are `None` / empty.
#[derive(Debug, Clone, Serialize)]
pub struct FunctionsReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub sluice_shards: u32,
    pub placement: Placement,
    pub parts: Vec<Part>,
    pub adaptor: Vec<adaptor::AdaptorResult>,
    /// sluice's µs per event with the Python function ÷ the Python function's (≤ 0.1 wanted).
    pub adaptor_share_of_python: Option<f64>,
    pub adaptor_target_met: Option<bool>,
    /// (sluice's µs per event with the Python function − the baseline's) ÷ the Python
    /// function's: what dispatching to the function adds, beside the function.
    pub adaptor_increment_share_of_python: Option<f64>,
    /// The floor's µs per event ÷ the Python function's, in the floor's Python row: the
    /// least an MQTT → HTTP adaptor costs beside that function here.
    pub adaptor_floor_share_of_python: Option<f64>,
    /// sluice's µs per event with the Python function ÷ the floor's with it.
    pub adaptor_sluice_over_floor: Option<f64>,
    /// Whether the target (≤ 0.1) is below the floor (the floor's share is above it).
    pub adaptor_target_below_floor: Option<bool>,
    pub idle: Option<idle::IdleResult>,
    pub cold: Vec<cold::ColdResult>,
    pub predict: Option<predict::PredictResult>,
}

pub async fn run_functions(s: &FunctionsScenario) -> anyhow::Result<FunctionsReport> {
    let needs_sluice = s.parts.iter().any(|p| *p != Part::Predict);
    if needs_sluice {
        require_sluice_bin(&s.sluice_bin)?;
    }
    let machine = machine(&s.command_line);
    let dir = tempfile::Builder::new()
        .prefix("sluice-bench-fn-")
        .tempdir()
        .context("creating a temporary directory")?;
    let script = echo::write_python_echo(dir.path())?;
    let mut report = FunctionsReport {
        scenario: "functions",
        machine,
        sluice_shards: s.sluice_shards,
        placement: s.placement,
        parts: s.parts.clone(),
        adaptor: Vec::new(),
        adaptor_share_of_python: None,
        adaptor_target_met: None,
        adaptor_increment_share_of_python: None,
        adaptor_floor_share_of_python: None,
        adaptor_sluice_over_floor: None,
        adaptor_target_below_floor: None,
        idle: None,
        cold: Vec::new(),
        predict: None,
    };
    for part in &s.parts {
        match part {
            Part::Adaptor => {
                if s.adaptor_baseline {
                    let cmd = command(FnKind::Compiled, &script, &s.bench_bin);
                    report.adaptor.push(adaptor::run(s, None, &cmd).await?);
                }
                for &kind in &s.kinds {
                    let cmd = command(kind, &script, &s.bench_bin);
                    report
                        .adaptor
                        .push(adaptor::run(s, Some(kind), &cmd).await?);
                    if s.adaptor_floor {
                        report
                            .adaptor
                            .push(adaptor::run_floor(s, kind, &cmd).await?);
                    }
                }
                adaptor_summary(&mut report);
            }
            Part::Idle => {
                let kind = s.kinds.first().copied().unwrap_or(FnKind::Compiled);
                let cmd = command(kind, &script, &s.bench_bin);
                report.idle = Some(idle::run(s, kind, &cmd).await?);
            }
            Part::Cold => {
                for &kind in &s.kinds {
                    let cmd = command(kind, &script, &s.bench_bin);
                    report.cold.push(cold::run(s, kind, &cmd).await?);
                }
            }
            Part::Predict => report.predict = Some(predict::run()),
        }
    }
    Ok(report)
}

/// The adaptor part's ratios across its rows (see [`FunctionsReport`]).
fn adaptor_summary(report: &mut FunctionsReport) {
    use adaptor::Adaptor;
    let row = |adaptor: Adaptor, function: Option<FnKind>| {
        report
            .adaptor
            .iter()
            .find(|a| a.adaptor == adaptor && a.function == function)
    };
    let python = row(Adaptor::Sluice, Some(FnKind::Python));
    let base = row(Adaptor::Sluice, None);
    let floor = row(Adaptor::Floor, Some(FnKind::Python));
    report.adaptor_share_of_python = python.and_then(|p| p.ratio);
    report.adaptor_increment_share_of_python = python.zip(base).and_then(|(p, b)| {
        let (ps, bs, pf) = (
            p.adaptor_us_per_event?,
            b.adaptor_us_per_event?,
            p.function_us_per_event?,
        );
        (pf > 0.0).then(|| (ps - bs) / pf)
    });
    report.adaptor_target_met = report.adaptor_share_of_python.map(|r| r <= 0.1);
    report.adaptor_floor_share_of_python = floor.and_then(|f| f.ratio);
    report.adaptor_sluice_over_floor = python.zip(floor).and_then(|(p, f)| {
        let (ps, fs) = (p.adaptor_us_per_event?, f.adaptor_us_per_event?);
        (fs > 0.0).then(|| ps / fs)
    });
    report.adaptor_target_below_floor = report.adaptor_floor_share_of_python.map(|r| r > 0.1);
}

/// The command line of a function instance.
pub fn command(kind: FnKind, script: &Path, bench_bin: &Path) -> Vec<String> {
    match kind {
        FnKind::Python => vec!["python3".into(), script.display().to_string()],
        FnKind::Compiled => vec![bench_bin.display().to_string(), "fn-echo".into()],
    }
}

/// The `[[function]]` settings a part runs with.
#[derive(Debug, Clone)]
pub struct FnSettings {
    pub command: Vec<String>,
    pub min_instances: usize,
    pub max_instances: usize,
    pub concurrency: usize,
    pub idle: Duration,
    /// `""`: answers discarded.
    pub reply_topic: String,
}

/// Topic filter of the function: every event topic starts with `fnb/`.
pub const TOPICS: &str = "fnb/#";

/// The generated config: the device listener, admin, no uplink, one `[[function]]` — local
/// (`command`), or remote at `url` when given (then `min_instances` is left out).
pub fn sluice_toml(
    shards: u32,
    mqtt_port: u16,
    admin_port: u16,
    f: &FnSettings,
    url: Option<&str>,
) -> String {
    let quote = |s: &str| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
    let command: Vec<String> = f.command.iter().map(|a| quote(a)).collect();
    let (target, min) = match url {
        Some(u) => (format!("url = {}", quote(u)), 0),
        // Both echo functions take fd 3: `inherit` from the first start, as before issue 29
        // made `auto` the default (whose first instance is watched, not pre-published).
        None => (
            format!("command = [{}]\nsocket = \"inherit\"", command.join(", ")),
            f.min_instances,
        ),
    };
    format!(
        "# generated by sluice-bench scenario functions\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n\
         [coap]\nenabled = false\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [[function]]\nname = \"{FUNCTION}\"\ntopics = [\"{TOPICS}\"]\n{target}\n\
         concurrency = {concurrency}\nmax_instances = {max}\nmin_instances = {min}\n\
         idle = \"{idle}ms\"\nprewarm = \"off\"\ntimeout = \"5s\"\nretries = 3\nreply_topic = {reply}\n",
        concurrency = f.concurrency,
        max = f.max_instances,
        idle = f.idle.as_millis(),
        reply = quote(&f.reply_topic),
    )
}

/// A running sluice with one function, and its admin port.
pub struct FnSluice {
    pub child: SluiceChild,
    pub admin_port: u16,
    /// The instance the bench started ([`Placement::Remote`]).
    pub external: Option<ExternalFn>,
}

impl FnSluice {
    /// Start sluice with `f` (and, for [`Placement::Remote`], the function first) and wait
    /// until its device port accepts connections.
    pub async fn start(s: &FunctionsScenario, f: &FnSettings) -> anyhow::Result<FnSluice> {
        let external = match s.placement {
            Placement::Local => None,
            Placement::Remote => Some(ExternalFn::start(&f.command).await?),
        };
        let url = external
            .as_ref()
            .map(|e| format!("http://127.0.0.1:{}/", e.port));
        let mqtt_port = sluice_testkit::free_port()?;
        let admin_port = sluice_testkit::free_port()?;
        let toml = sluice_toml(s.sluice_shards, mqtt_port, admin_port, f, url.as_deref());
        let child = SluiceChild::spawn(&s.sluice_bin, mqtt_port, toml)?;
        child.wait_ready().await?;
        Ok(FnSluice {
            child,
            admin_port,
            external,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Whether sluice starts the instances itself.
    pub fn is_local(&self) -> bool {
        self.external.is_none()
    }

    /// CPU used so far by sluice and by the function's processes (local: all of sluice's
    /// children, live and reaped; remote: the instance the bench started), and their pids.
    pub fn cpu(&self) -> anyhow::Result<(Duration, Duration, Vec<u32>)> {
        let fam = procs::family_cpu(self.pid())?;
        match &self.external {
            None => Ok((fam.own, fam.children, fam.live_children)),
            Some(e) => Ok((
                fam.own,
                crate::harness::procfs::cpu_time(crate::harness::procfs::Pid::Other(e.pid()))?,
                vec![e.pid()],
            )),
        }
    }

    /// The admin `/metrics` text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        tokio::time::timeout(
            Duration::from_secs(5),
            http_get(self.admin_port, "/metrics"),
        )
        .await
        .context("sluice's /metrics did not answer within 5 s")?
    }

    /// `sluice_function_instances` (running + starting) of the function.
    pub async fn instances(&self) -> anyhow::Result<f64> {
        let text = self.metrics().await?;
        let series = |state| {
            prom::sample(
                &text,
                "sluice_function_instances",
                &[("function", FUNCTION), ("state", state)],
            )
        };
        match (series("running"), series("starting")) {
            (None, None) => bail!(
                "sluice's /metrics has no sluice_function_instances for {FUNCTION}: does this sluice run functions? stderr:\n{}",
                self.child.stderr_tail()
            ),
            (r, st) => Ok(r.unwrap_or(0.0) + st.unwrap_or(0.0)),
        }
    }

    /// Wait until the function has `pred(instances)` true per /metrics and per /proc (no child
    /// process when 0 is wanted), at most `max`.
    pub async fn wait_instances(
        &self,
        what: &str,
        pred: impl Fn(f64) -> bool,
        max: Duration,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + max;
        loop {
            let n = self.instances().await?;
            let kids = procs::children_of(self.pid()).len();
            if pred(n) && (n > 0.0 || kids == 0) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("the function's instances never became {what} within {max:?} (metrics say {n}, {kids} child processes)");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A function instance the bench runs itself on `127.0.0.1:$PORT`; dropping it kills it.
pub struct ExternalFn {
    child: std::process::Child,
    pub port: u16,
}

impl ExternalFn {
    /// Start `command` with `PORT` set and wait until it accepts connections (15 s at most).
    pub async fn start(command: &[String]) -> anyhow::Result<ExternalFn> {
        let port = sluice_testkit::free_port()?;
        let (program, args) = command.split_first().context("an empty function command")?;
        let child = std::process::Command::new(program)
            .args(args)
            .env("PORT", port.to_string())
            .env_remove("LISTEN_FDS")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        let f = ExternalFn { child, port };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if tokio::time::Instant::now() >= deadline {
                bail!("the function {program} did not listen on port {port} within 15 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(f)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ExternalFn {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Nearest-rank percentile of `values` (sorted here), `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generated_config_quotes_the_command_and_states_every_function_setting() {
        let f = FnSettings {
            command: vec!["python3".into(), "/tmp/a \"b\"/echo.py".into()],
            min_instances: 1,
            max_instances: 4,
            concurrency: 8,
            idle: Duration::from_millis(300),
            reply_topic: "reply/{topic}".into(),
        };
        let t = sluice_toml(1, 1883, 9000, &f, None);
        assert!(
            t.contains(r#"command = ["python3", "/tmp/a \"b\"/echo.py"]"#),
            "{t}"
        );
        assert!(
            t.contains("idle = \"300ms\"") && t.contains("min_instances = 1"),
            "{t}"
        );
        assert!(t.contains("reply_topic = \"reply/{topic}\""), "{t}");
        // sluice's own parser and checks accept it as it is generated
        let config = sluice::config::parse_unchecked_files(&t).expect("a valid sluice config");
        let function = &config.function[0];
        assert_eq!((function.max_instances, function.concurrency), (4, 8));
        assert_eq!(function.idle, Duration::from_millis(300));
        assert_eq!(
            function.command.as_ref().unwrap()[1],
            "/tmp/a \"b\"/echo.py"
        );
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
