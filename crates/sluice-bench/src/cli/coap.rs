//! `scenario coap`: its flags and the translation into [`CoapScenario`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use sluice_bench::scenarios::coap::{markdown, run_coap, CoapMode, CoapScenario, Upstream};

use super::{command_line, write_outputs};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ModeChoice {
    /// The generator against an in-process trivial responder.
    Floor,
    /// POST publishes through sluice to the TLS cloud Mosquitto.
    Publish,
    /// Through libcoap's coap-server-notls as a forward proxy to a CoAP-over-TCP server.
    ProxyLibcoap,
    /// Through sluice's [[coap.proxy]] (reverse, prefix "cloud") to the same kind of server.
    ProxySluice,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ProxyMethod {
    Get,
    Put,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum UpstreamChoice {
    /// The in-process CoAP-over-TCP responder (answers at once; its CPU is this tool's).
    Responder,
    /// libcoap's coap-server-notls (4.3.1 loses pipelined requests over TCP).
    Libcoap,
}

#[derive(Args)]
pub(crate) struct CoapArgs {
    /// Sensor counts, comma-separated; every mode runs at each.
    #[arg(long, value_delimiter = ',', default_value = "250,500,1000,2000")]
    sensors: Vec<u32>,
    /// Modes, comma-separated, run in this order at each N.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "floor,publish,proxy-libcoap,proxy-sluice"
    )]
    modes: Vec<ModeChoice>,
    /// Length of each point (new requests start until then).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Sensors start spread over this.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    ramp: Duration,
    /// Rates, CPU and latency are measured from this long after the start to the end.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Payload bytes per request (CoAPBench used 4, 16, 64).
    #[arg(long, default_value_t = 16)]
    payload: usize,
    /// Each sensor starts its next request no earlier than this after its previous one
    /// ("0s": CoAPBench's pure closed loop; "64ms" at N = 2000 offers ≈ 31,000 req/s, the
    /// publish target's load; the 2 ms timer tick adds to the interval).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Generator threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Method of the proxy modes' request to /example_data.
    #[arg(long, value_enum, default_value = "put")]
    proxy_method: ProxyMethod,
    /// The CoAP-over-TCP server behind both proxies.
    #[arg(long, value_enum, default_value = "responder")]
    upstream: UpstreamChoice,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` in the generated sluice config (0 = one per core but one, at least one).
    #[arg(long, default_value_t = 0)]
    sluice_shards: u32,
    /// Write the JSON report here (e.g. docs/perf/coap.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown report here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn coap(args: CoapArgs) -> anyhow::Result<()> {
    let mut config = CoapScenario::new(args.sluice_bin);
    config.sensors = args.sensors;
    config.modes = args
        .modes
        .iter()
        .map(|m| match m {
            ModeChoice::Floor => CoapMode::Floor,
            ModeChoice::Publish => CoapMode::Publish,
            ModeChoice::ProxyLibcoap => CoapMode::ProxyLibcoap,
            ModeChoice::ProxySluice => CoapMode::ProxySluice,
        })
        .collect();
    config.duration = args.duration;
    config.ramp = args.ramp;
    config.warmup = args.warmup;
    config.payload = args.payload;
    config.threads = args.threads;
    config.interval = args.interval;
    config.proxy_method = match args.proxy_method {
        ProxyMethod::Get => "get",
        ProxyMethod::Put => "put",
    };
    config.upstream = match args.upstream {
        UpstreamChoice::Responder => Upstream::Responder,
        UpstreamChoice::Libcoap => Upstream::Libcoap,
    };
    config.sluice_shards = args.sluice_shards;
    config.command_line = command_line();
    let report = run_coap(&config).await?;
    write_outputs(
        &report,
        &markdown(&report),
        args.out.as_ref(),
        args.markdown.as_ref(),
    )
}
