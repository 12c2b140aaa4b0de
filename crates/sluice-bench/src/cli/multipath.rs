//! `scenario multipath`: its flags and the translation into [`MultipathScenario`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use sluice_bench::scenarios::multipath::{
    markdown, run_multipath, MultipathMode, MultipathScenario, UpstreamKind,
};
use sluice_testkit::netns::Queue;

use super::{command_line, write_outputs};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ModeChoice {
    /// CoAP sensors through sluice's CoAP proxy over an MPTCP coap+tcp:// upstream.
    CoapMptcp,
    /// CoAP sensors through sluice's CoAP proxy with one TCP connection per link (`paths`).
    CoapPaths,
    /// MQTT devices through sluice's per-path sessions (one per link) to Mosquitto.
    MqttPaths,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum UpstreamChoice {
    /// libcoap's coap-server-notls (under `mptcpize run` for coap-mptcp).
    Libcoap,
    /// The bench's own CoAP-over-TCP server.
    Builtin,
}

#[derive(Args)]
pub(crate) struct MultipathArgs {
    /// Modes, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "coap-mptcp,mqtt-paths"
    )]
    modes: Vec<ModeChoice>,
    /// Messages per second per MQTT device (mqtt-paths).
    #[arg(long, default_value_t = 20.0)]
    mqtt_rate: f64,
    /// Link counts k, comma-separated; each point builds fresh namespaces with k links.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    links: Vec<usize>,
    /// Sensor (CoAP) or device (MQTT) counts N, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "250,2000")]
    sensors: Vec<u32>,
    /// Rate of every link, both directions, in tc units (tbf): the link, not the CPU, should
    /// be the bottleneck of one path.
    #[arg(long, default_value = "1mbit")]
    rate: String,
    /// Payload bytes per request, comma-separated (CoAPBench: 4, 16, 64; 900 for large).
    #[arg(long, value_delimiter = ',', default_value = "16")]
    payload: Vec<usize>,
    /// tbf queue of every link, comma-separated: `drop` (5 ms: drops as soon as busy),
    /// `100ms`, `300ms` (any `<n>ms`: queues like an LTE uplink), `legacy` (200 ms, the
    /// setting before issue 30).
    #[arg(long, value_delimiter = ',', default_value = "legacy", value_parser = Queue::parse)]
    queue: Vec<Queue>,
    /// The CoAP upstream in the cloud namespace.
    #[arg(long, value_enum, default_value = "libcoap")]
    upstream: UpstreamChoice,
    /// Length of each point.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Rates, CPU and latency are measured from this long after the start.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Sensors start spread over this.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    ramp: Duration,
    /// Generator threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Cut link 0 (the first subflow's) this long after the start of each point, and report
    /// failed requests and the longest stall.
    #[arg(long, value_parser = humantime::parse_duration)]
    kill_link_at: Option<Duration>,
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

pub(crate) async fn multipath(args: MultipathArgs) -> anyhow::Result<()> {
    let mut config = MultipathScenario::new(args.sluice_bin);
    config.modes = args
        .modes
        .iter()
        .map(|m| match m {
            ModeChoice::CoapMptcp => MultipathMode::CoapMptcp,
            ModeChoice::CoapPaths => MultipathMode::CoapPaths,
            ModeChoice::MqttPaths => MultipathMode::MqttPaths,
        })
        .collect();
    config.mqtt_rate = args.mqtt_rate;
    config.links = args.links;
    config.sensors = args.sensors;
    config.rate = args.rate;
    config.payloads = args.payload;
    config.queues = args.queue;
    config.upstream = match args.upstream {
        UpstreamChoice::Libcoap => UpstreamKind::Libcoap,
        UpstreamChoice::Builtin => UpstreamKind::Builtin,
    };
    config.duration = args.duration;
    config.warmup = args.warmup;
    config.ramp = args.ramp;
    config.threads = args.threads;
    config.kill_link_at = args.kill_link_at;
    config.command_line = command_line();
    let report = tokio::task::spawn_blocking(move || run_multipath(&config)).await??;
    write_outputs(
        &report,
        &markdown(&report),
        args.out.as_ref(),
        args.markdown.as_ref(),
    )
}
