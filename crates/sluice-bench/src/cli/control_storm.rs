//! `scenario control-storm`: its flags and the translation into [`ControlStormScenario`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use sluice_bench::scenarios::control_storm::{
    markdown, run_control_storm, ControlStormScenario, Plane,
};

use super::{command_line, write_outputs};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum PlaneChoice {
    /// Association on the control plane (sluice-phd on the control core): sluice's design.
    Control,
    /// `[phd] single_plane = true`: association on the shard thread (the contrast).
    Single,
}

#[derive(Args)]
pub(crate) struct ControlStormArgs {
    /// Plane modes, comma-separated, run in this order (a fresh sluice each).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "control,single"
    )]
    planes: Vec<PlaneChoice>,
    /// Storm levels in control messages/s (APDUs sent + answers read), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,1000,5000,10000,20000,40000"
    )]
    levels: Vec<u64>,
    /// Each level runs this long before its window opens.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// Each level's measured window.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    window: Duration,
    /// Data load before the first level (not measured).
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// PHD data agents (glucometers, confirmed fixed scan reports).
    #[arg(long, default_value_t = 32)]
    phd_agents: u32,
    /// Confirmed reports awaiting confirmation per data agent, at most.
    #[arg(long, default_value_t = 32)]
    phd_window: u16,
    /// Scan reports/s offered by the PHD data agents in total (one SenML message each).
    #[arg(long, default_value_t = 15000.0)]
    phd_rate: f64,
    /// MQTT devices (QoS 1 publishes to dev/{i}).
    #[arg(long, default_value_t = 16)]
    mqtt_devices: u32,
    /// MQTT messages/s offered in total.
    #[arg(long, default_value_t = 5000.0)]
    mqtt_rate: f64,
    /// MQTT payload bytes (bench header included).
    #[arg(long, default_value_t = 128)]
    mqtt_payload: usize,
    /// Share of storm sessions played by new agents (the rest return), 0..1.
    #[arg(long, default_value_t = 0.5)]
    storm_new_share: f64,
    /// Storm sessions in flight at most.
    #[arg(long, default_value_t = 512)]
    storm_workers: usize,
    /// Storm generator threads.
    #[arg(long, default_value_t = 1)]
    storm_threads: usize,
    /// Skip the scan-report maximum.
    #[arg(long)]
    no_max: bool,
    /// Run only the scan-report maximum (no storm levels).
    #[arg(long)]
    max_only: bool,
    /// Agents of the scan-report maximum.
    #[arg(long, default_value_t = 64)]
    max_agents: u32,
    /// Window per agent of the scan-report maximum.
    #[arg(long, default_value_t = 64)]
    max_window: u16,
    /// Measured window of the scan-report maximum (and of Mosquitto alone).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    max_duration: Duration,
    /// Plain MQTT publishers straight into Mosquitto beside the maximum (0: skip).
    #[arg(long, default_value_t = 8)]
    direct_publishers: u32,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown report here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn control_storm(args: ControlStormArgs) -> anyhow::Result<()> {
    let mut s = ControlStormScenario::new(args.sluice_bin);
    s.planes = args
        .planes
        .iter()
        .map(|p| match p {
            PlaneChoice::Control => Plane::Control,
            PlaneChoice::Single => Plane::Single,
        })
        .collect();
    s.levels = args.levels;
    s.settle = args.settle;
    s.window = args.window;
    s.warmup = args.warmup;
    s.phd_agents = args.phd_agents;
    s.phd_window = args.phd_window;
    s.phd_rate = args.phd_rate;
    s.mqtt_devices = args.mqtt_devices;
    s.mqtt_rate = args.mqtt_rate;
    s.mqtt_payload = args.mqtt_payload;
    s.storm_new_share = args.storm_new_share;
    s.storm_workers = args.storm_workers;
    s.storm_threads = args.storm_threads;
    s.max_reports = !args.no_max;
    s.storm = !args.max_only;
    s.max_agents = args.max_agents;
    s.max_window = args.max_window;
    s.max_duration = args.max_duration;
    s.direct_publishers = args.direct_publishers;
    s.command_line = command_line();
    let report = run_control_storm(&s).await?;
    write_outputs(
        &report,
        &markdown(&report),
        args.out.as_ref(),
        args.markdown.as_ref(),
    )
}
