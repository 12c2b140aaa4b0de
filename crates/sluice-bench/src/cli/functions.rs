//! `scenario functions` (issue 19): its flags and the translation into [`FunctionsScenario`].
//!
//! [`FunctionsScenario`]: sluice_bench::scenarios::functions::FunctionsScenario

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use super::{command_line, write_outputs};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PartChoice {
    Adaptor,
    Idle,
    Cold,
    Predict,
    All,
}

#[derive(Args)]
pub(crate) struct FunctionsArgs {
    /// Parts, comma-separated, run in this order (a fresh sluice each).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    part: Vec<PartChoice>,
    /// Adaptor: events per second, all devices together.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Adaptor: MQTT devices (QoS 1) sharing --rate.
    #[arg(long, default_value_t = 10)]
    devices: u32,
    /// Adaptor: load before the measured window.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Adaptor: the measured window.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    window: Duration,
    /// Adaptor: skip the baseline run (the same load on topics no function matches).
    #[arg(long)]
    no_baseline: bool,
    /// Adaptor: skip the floor rows (the same load through `sluice-bench fn-floor`, the
    /// minimal MQTT → HTTP relay, in front of an instance the bench starts).
    #[arg(long)]
    no_floor: bool,
    /// Payload bytes of each event (at least 24).
    #[arg(long, default_value_t = 128)]
    payload: usize,
    /// Idle: silent devices connected.
    #[arg(long, default_value_t = 100)]
    idle_devices: u32,
    /// Idle: the measured window.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    idle_window: Duration,
    /// Cold: events each after the instance stopped.
    #[arg(long, default_value_t = 30)]
    cold_rounds: u32,
    /// Cold: events while the instance runs.
    #[arg(long, default_value_t = 30)]
    warm_rounds: u32,
    /// Cold: the function's `idle` (an instance stops this long after its last request).
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    cold_idle: Duration,
    /// Only the Python function, or only the compiled one (default both).
    #[arg(long, value_delimiter = ',', default_value = "python,compiled")]
    function: Vec<String>,
    /// "local": sluice starts the instances (command); "remote": the bench starts one on
    /// $PORT and sluice calls its url (no cold starts; for a sluice without the runtime).
    #[arg(long, default_value = "local")]
    placement: String,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` of sluice (0: one per core but one, at least one).
    #[arg(long, default_value_t = 0)]
    sluice_shards: u32,
    /// Write the JSON report here (e.g. docs/perf/functions.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown report here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn functions(args: FunctionsArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::functions::{self as fns, FnKind, FunctionsScenario, Part};
    let bench_bin = std::env::current_exe().context("locating the sluice-bench binary")?;
    let mut s = FunctionsScenario::new(args.sluice_bin, bench_bin);
    if !args.part.contains(&PartChoice::All) {
        s.parts = args
            .part
            .iter()
            .map(|p| match p {
                PartChoice::Adaptor => Part::Adaptor,
                PartChoice::Idle => Part::Idle,
                PartChoice::Cold => Part::Cold,
                _ => Part::Predict,
            })
            .collect();
    }
    s.kinds = args
        .function
        .iter()
        .map(|f| match f.as_str() {
            "python" => Ok(FnKind::Python),
            "compiled" => Ok(FnKind::Compiled),
            other => Err(anyhow::anyhow!("--function {other:?}: python or compiled")),
        })
        .collect::<anyhow::Result<_>>()?;
    s.placement = match args.placement.as_str() {
        "local" => fns::Placement::Local,
        "remote" => fns::Placement::Remote,
        other => anyhow::bail!("--placement {other:?}: local or remote"),
    };
    s.adaptor_rate = args.rate;
    s.adaptor_devices = args.devices;
    s.adaptor_warmup = args.warmup;
    s.adaptor_window = args.window;
    s.adaptor_baseline = !args.no_baseline;
    s.adaptor_floor = !args.no_floor;
    s.payload = args.payload.max(24);
    s.idle_devices = args.idle_devices;
    s.idle_window = args.idle_window;
    s.cold_rounds = args.cold_rounds;
    s.warm_rounds = args.warm_rounds;
    s.cold_idle = args.cold_idle;
    s.sluice_shards = args.sluice_shards;
    s.command_line = command_line();
    let report = fns::run_functions(&s).await?;
    write_outputs(
        &report,
        &fns::markdown(&report),
        args.out.as_ref(),
        args.markdown.as_ref(),
    )
}
