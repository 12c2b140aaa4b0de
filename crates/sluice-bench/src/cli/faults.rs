//! `scenario faults`: its flags and the translation into [`FaultsScenario`].

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use sluice_bench::scenarios::faults::{markdown, run_faults, FaultsScenario, Size};

use super::{command_line, write_outputs};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum SizeArg {
    Small,
    Full,
}

#[derive(Args)]
pub(crate) struct FaultsArgs {
    /// The sluice binary under test.
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice: PathBuf,
    /// What the binary is, for the report (e.g. "main 9df086b").
    #[arg(long, default_value = "")]
    label: String,
    /// A case to run (repeat or comma-separate); default every case. Cases: kill9-cloud-up,
    /// kill9-cloud-down, cloud-restart, cloud-slow, cloud-blackhole, multipath-flap,
    /// disk-full, disk-readonly, clock-step, restart-state, pingresp-311, slow-readers.
    #[arg(long = "case", value_delimiter = ',')]
    cases: Vec<String>,
    /// small: 10 kills, a 60 s flap, seconds per fault; full: 100 kills, a 5-minute flap,
    /// more devices, 16,000 connections.
    #[arg(long, value_enum, default_value = "small")]
    size: SizeArg,
    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown report here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn faults(args: FaultsArgs) -> anyhow::Result<()> {
    let size = match args.size {
        SizeArg::Small => Size::Small,
        SizeArg::Full => Size::Full,
    };
    let mut s = FaultsScenario::new(args.sluice, size);
    s.sluice_label = args.label;
    if !args.cases.is_empty() {
        s.cases = args.cases;
    }
    s.command_line = command_line();
    let report = run_faults(&s).await?;
    write_outputs(
        &report,
        &markdown(&report),
        args.out.as_ref(),
        args.markdown.as_ref(),
    )
}
