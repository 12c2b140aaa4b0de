//! The `state` scenario's flags and output (`docs/perf/state.md`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{command_line, write_outputs};

#[derive(Args)]
pub(crate) struct StateArgs {
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// Devices of the load part.
    #[arg(long, default_value_t = 1024)]
    devices: usize,
    /// Messages per second per device.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// The measured window of each mode.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    window: Duration,
    /// Retained messages before the restart.
    #[arg(long, default_value_t = 100_000)]
    retained: usize,
    /// Persistent sessions before the restart.
    #[arg(long, default_value_t = 10_000)]
    sessions: usize,
    /// Where the state directories go (a real disk).
    #[arg(long, default_value = "/var/tmp")]
    work_dir: PathBuf,
    /// Only the restart part.
    #[arg(long)]
    skip_load: bool,
    /// Only the load part.
    #[arg(long)]
    skip_restart: bool,
    /// Write the JSON report here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the Markdown report here.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

pub(crate) async fn state(args: StateArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::state::{self as st, StateScenario};
    let mut s = StateScenario::new(args.sluice_bin);
    s.devices = args.devices;
    s.rate = args.rate;
    s.warmup = args.warmup;
    s.window = args.window;
    s.retained = args.retained;
    s.sessions = args.sessions;
    s.work_dir = args.work_dir;
    s.skip_load = args.skip_load;
    s.skip_restart = args.skip_restart;
    let report = st::run_state(&s, &command_line()).await?;
    let table = st::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())?;
    println!("{table}");
    Ok(())
}
