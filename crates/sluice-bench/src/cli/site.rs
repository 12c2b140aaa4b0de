//! `scenario site`'s arguments: a site of 1, 2, 3 … gateways behind HAProxy into Kafka.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{command_line, write_outputs};

#[derive(Args, Debug)]
pub(crate) struct SiteArgs {
    /// Site sizes to run, in order: gateways behind the one HAProxy address.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    gateways: Vec<u32>,
    /// MQTT 5 devices publishing QoS 1 through HAProxy (the same in every run).
    #[arg(long, default_value_t = 300)]
    devices: u32,
    /// Messages per second per device.
    #[arg(long, default_value_t = 10.0)]
    msg_rate: f64,
    /// Payload bytes.
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// Each run, ramp and settle included (e.g. "30s").
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// The script that fetches, starts and stops the Kafka cluster (needs Java 17+ and Maven).
    #[arg(long, default_value = "scripts/kafka-cluster", value_name = "FILE")]
    cluster_script: PathBuf,
    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown summary here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn site(args: SiteArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::site::{self as s, SiteScenario};
    if args.gateways.is_empty() || args.gateways.contains(&0) {
        anyhow::bail!("--gateways: one or more site sizes of at least 1, e.g. 1,2,3");
    }
    let mut config = SiteScenario::new(args.sluice_bin);
    config.gateways = args.gateways;
    config.devices = args.devices;
    config.rate_per_device = args.msg_rate;
    config.payload = args.payload;
    config.duration = args.duration;
    config.cluster_script = args.cluster_script;
    config.command_line = command_line();
    let report = s::run_site(&config).await?;
    let table = s::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}
