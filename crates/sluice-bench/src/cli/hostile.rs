//! `scenario hostile`: its flags and the translation into [`HostileScenario`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use sluice_bench::scenarios::hostile::{markdown, run_hostile, HostileScenario, ALL_CASES};

use super::{command_line, write_outputs};

#[derive(Args)]
pub(crate) struct HostileArgs {
    /// The sluice binary under test (any build: main before or after the fixes).
    #[arg(
        long,
        alias = "sluice-bin",
        default_value = "target/release/sluice",
        value_name = "FILE"
    )]
    sluice: PathBuf,
    /// What the binary is, for the report (e.g. "main 887093d").
    #[arg(long, default_value = "")]
    label: String,
    /// Cases (issue 28's finding numbers), comma-separated; default all 13.
    #[arg(long, value_delimiter = ',')]
    cases: Vec<u8>,
    /// Healthy MQTT devices publishing through sluice during every case.
    #[arg(long, default_value_t = 50)]
    healthy_devices: u32,
    /// Messages per second per healthy device (QoS 1).
    #[arg(long, default_value_t = 10.0)]
    healthy_rate: f64,
    /// Healthy payload bytes (at least 24).
    #[arg(long, default_value_t = 100)]
    healthy_payload: usize,
    /// Baseline phase before each attack.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    baseline: Duration,
    /// The "during" window lasts at least this long.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    min_attack_window: Duration,
    /// RSS growth allowed above the control's (cases 2, 3), MiB.
    #[arg(long, default_value_t = 32)]
    rss_bound_mib: u64,
    /// Case 7: how long a legitimate observer keeps trying (every 5 s).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    expiry_wait: Duration,
    /// `[gateway] shards` (0 = one per core but one, at least one).
    #[arg(long, default_value_t = 0)]
    shards: u32,
    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown report here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn hostile(args: HostileArgs) -> anyhow::Result<()> {
    let mut s = HostileScenario::new(args.sluice);
    s.sluice_label = args.label;
    s.cases = if args.cases.is_empty() {
        ALL_CASES.to_vec()
    } else {
        args.cases
    };
    s.healthy_devices = args.healthy_devices;
    s.healthy_rate = args.healthy_rate;
    s.healthy_payload = args.healthy_payload;
    s.baseline = args.baseline;
    s.min_attack_window = args.min_attack_window;
    s.rss_bound_kib = args.rss_bound_mib * 1024;
    s.expiry_wait = args.expiry_wait;
    s.shards = args.shards;
    s.command_line = command_line();
    let report = run_hostile(&s).await?;
    write_outputs(
        &report,
        &markdown(&report),
        args.out.as_ref(),
        args.markdown.as_ref(),
    )
}
