//! The `scenario` subcommands: each an `Args` struct (flags, defaults) and the function that
//! builds the scenario's config, runs it and routes its report ([`super::write_outputs`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use sluice_bench::harness::sut::Sut;
use sluice_bench::load::devices::PayloadSize;
use sluice_bench::scenarios::core::{markdown, run_core, CoreScenario};
use sluice_bench::scenarios::seganet::{
    run_seganet, summary as seganet_summary, Constraint, ReportFiles, SegaSut, SeganetScenario,
};
use sluice_proto::mqtt::QoS;

use super::{
    arrivals, command_line, emit_json, progress, qos, write_outputs, AggregateArgs, LoadArgs,
    MqttVersion, OnOff,
};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum SutChoice {
    /// The sluice gateway (needs --sluice-bin).
    Sluice,
    /// An edge Mosquitto configured as a TLS 1.3 bridge to the cloud.
    MosquittoBridge,
    /// sluice, then the bridge, in one invocation, with a comparison table.
    Both,
    /// `sluice-bench floor`: answers every PUBLISH and forwards nothing (the kernel floor).
    Floor,
    /// `sluice-bench floor --io uring`: the same floor over io_uring (ADR 0016).
    FloorUring,
    /// `sluice-bench relay-floor`: forwards every PUBLISH over one TLS 1.3 session to the
    /// cloud, acknowledging after the cloud's PUBACK, and does nothing else (the floor under
    /// any forwarder); with sluice, the table gains a sluice ÷ relay-floor column.
    RelayFloor,
    /// sluice, the bridge, then the floor: the comparison table plus each one's CPU above the
    /// floor.
    All,
}

#[derive(Args)]
pub(crate) struct CoreArgs {
    /// Number of devices.
    #[arg(short = 'n', long = "n", default_value_t = 1024)]
    devices: u32,
    #[command(flatten)]
    load: LoadArgs,
    /// System(s) under test, run in the order given; a comma-separated list runs each in turn
    /// in one invocation (e.g. `floor,floor-uring,floor-uring,floor` for two alternating
    /// pairs of the two floors).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "both")]
    sut: Vec<SutChoice>,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` in the generated sluice config (0 = one per core but one, at least one).
    #[arg(long, default_value_t = 0)]
    sluice_shards: u32,
    #[command(flatten)]
    aggregate: AggregateArgs,
    /// After the devices stop, the run ends once nothing new reached the sink for this long…
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    drain_idle: Duration,
    /// …or after this long at most. Devices also wait up to this long for their outstanding
    /// PUBACKs before they disconnect.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    drain_max: Duration,
    /// Devices speak MQTT over TLS 1.3 (rustls, the run's CA) to the SUT's TLS listener:
    /// sluice gets `[mqtt.tls]` listen/cert_file/key_file, the edge Mosquitto a TLS 1.3
    /// listener with the same certificate. Not with the floor. Run once with and once without
    /// for CPU per message over TLS vs plain.
    #[arg(long)]
    device_tls: bool,
    /// A TOML file appended to sluice's generated config (extra tables such as `[acl]` with
    /// its rules, for the cost of a config feature in the same run shape). Not for the bridge.
    #[arg(long, value_name = "FILE")]
    sluice_extra: Option<PathBuf>,
    /// Hold N dashboards open on sluice's admin endpoint during the run (each loads the page
    /// and history, then reads /api/v1/events, one overview per second), to measure what
    /// watching costs (docs/perf/dashboard.md). sluice only.
    #[arg(long, default_value_t = 0, value_name = "N")]
    dashboards: u32,
    /// Write the JSON report here (e.g. docs/perf/core-path.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown table here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct SeganetArgs {
    /// Device counts to sweep, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,16,64,256,1024,4096,16384"
    )]
    ns: Vec<u32>,
    /// Systems under test, comma-separated, run in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "sluice,agents,mosquitto-bridge"
    )]
    sut: Vec<SegaSutChoice>,
    /// Length of each point, ramp included.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Device connections start spread over this period. Default: duration/6, at most 5 s.
    #[arg(long, value_parser = humantime::parse_duration)]
    ramp: Option<Duration>,
    /// The steady-state window starts this long after the ramp. Default: duration/12, at most 2 s.
    #[arg(long, value_parser = humantime::parse_duration)]
    settle: Option<Duration>,
    /// Messages per second per device.
    #[arg(long, default_value_t = 10.0, value_name = "MSG/S")]
    rate: f64,
    /// Payload size in bytes, uniformly random in MIN..MAX (inclusive).
    #[arg(long, default_value = "100..1024", value_name = "MIN..MAX")]
    payload: PayloadSize,
    /// Run the SUT like a Raspberry Pi-class gateway: pinned to --core with a cgroup CPU quota
    /// of --quota-percent of that core (cgroup v2 cpu.max, else v1 cfs quota, else taskset only;
    /// the report says which).
    #[arg(long)]
    constrained: bool,
    /// Core for --constrained.
    #[arg(long, default_value_t = 0)]
    core: u32,
    /// CPU quota for --constrained, % of one core.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100))]
    quota_percent: u32,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` for sluice. Default: 0 (one per core but one), 1 with --constrained.
    #[arg(long)]
    sluice_shards: Option<u32>,
    #[command(flatten)]
    aggregate: AggregateArgs,
    /// Skip agent points whose projected memory exceeds this share of MemAvailable.
    #[arg(long, default_value_t = 0.6)]
    memory_fraction: f64,
    /// After the devices stop, a point ends once nothing new reached the sink for this long…
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    drain_idle: Duration,
    /// …or after this long at most. Devices also wait up to this long for their outstanding
    /// PUBACKs before they disconnect: at N = 16,384 the back-pressured backlog takes ~30 s.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    drain_max: Duration,
    /// Directory for the reports.
    #[arg(long, default_value = "docs/perf", value_name = "DIR")]
    out_dir: PathBuf,
    /// Base name of the report files. Default: "seganet", or "seganet-constrained".
    #[arg(long)]
    name: Option<String>,
    /// Progress lines on stderr every this often ("0s" to disable).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    progress: Duration,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum SegaSutChoice {
    /// The sluice gateway.
    Sluice,
    /// One `sluice-bench agent` process per device, each with its own TLS session.
    Agents,
    /// An edge Mosquitto bridging to the cloud over TLS 1.3.
    MosquittoBridge,
}

#[derive(Args)]
pub(crate) struct PriorityArgs {
    /// Devices (the first --high are high priority).
    #[arg(short = 'n', long = "devices", default_value_t = 4)]
    devices: u32,
    /// High-priority devices.
    #[arg(long, default_value_t = 1)]
    high: u32,
    /// Messages per second per device.
    #[arg(long, default_value_t = 100.0, value_name = "MSG/S")]
    msg_rate: f64,
    /// Payload size in bytes (MIN..MAX or SIZE; at least 24).
    #[arg(long, default_value = "1024", value_name = "SIZE")]
    payload: PayloadSize,
    /// The uplink's rate, in tc units (e.g. "2mbit", "512kbit").
    #[arg(long, default_value = "2mbit")]
    rate: String,
    /// Measured length of each mode.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Warm-up run before each mode ("0s": none).
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Modes, comma-separated, run in this order: unloaded, off, lanes, lanes+tc.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "unloaded,off,lanes,lanes+tc"
    )]
    modes: Vec<sluice_bench::scenarios::priority::Mode>,
    /// After the devices stop, the sink stops once nothing arrived for this long.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    drain_idle: Duration,
    /// Devices wait at most this long for outstanding PUBACKs.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    drain_max: Duration,
    /// QoS 1 PUBLISHes awaiting PUBACK per device, at most.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    max_inflight: u16,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// Write the JSON report here (e.g. docs/perf/priority.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown summary here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct OutageArgs {
    /// The small configuration of the tests: 16 devices, 1 s ramp, 3 s warm-up, 5 s outage,
    /// 10 s of load after it (flags below still override).
    #[arg(long)]
    quick: bool,
    /// Devices (one MQTT connection each). Default 256 (16 with --quick).
    #[arg(short = 'n', long = "devices")]
    devices: Option<u32>,
    /// Messages per second per device.
    #[arg(long, default_value_t = 10.0, value_name = "MSG/S")]
    rate: f64,
    /// Payload size in bytes (MIN..MAX or SIZE; at least 24).
    #[arg(long, default_value = "100..1024", value_name = "MIN..MAX")]
    payload: PayloadSize,
    /// Device connections are spread over this. Default 5s (1s with --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    ramp: Option<Duration>,
    /// Load before the cut, ramp included. Default 15s (3s with --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    warmup: Option<Duration>,
    /// How long the link to the cloud stays cut. Default 60s (5s with --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    outage: Option<Duration>,
    /// How long the load keeps running after the link is restored. Default 60s (10s with
    /// --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    after: Option<Duration>,
    /// After the load stops, wait at most this long for the remaining messages.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    drain_max: Duration,
    /// sluice's [gateway] shards.
    #[arg(long, default_value_t = 2)]
    shards: u32,
    /// sluice's SenML aggregation: off (default here: one PUBLISH per message, so order and
    /// latency are observed message by message) or on with sluice's pack settings.
    #[arg(long, value_enum, default_value = "off")]
    aggregate: OnOff,
    /// sluice's uplink reconnect_max (the default 30 s would delay the drain's start).
    #[arg(long, default_value = "1s")]
    reconnect_max: String,
    /// Directory in which the spool directory is created (default /var/tmp, or the current
    /// directory when /var/tmp is a tmpfs).
    #[arg(long, value_name = "DIR")]
    spool_parent: Option<PathBuf>,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// Progress lines on stderr every this often ("0s" to disable).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress: Duration,
    /// Write the JSON report here (e.g. docs/perf/outage.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown report here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum TputSutChoice {
    /// The sluice gateway (needs --sluice-bin).
    Sluice,
    /// An edge Mosquitto bridging to the cloud over TLS 1.3.
    MosquittoBridge,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum CloudChoice {
    /// The in-process fast acknowledging sink.
    FastSink,
    /// A TLS 1.3 Mosquitto with a measuring subscriber.
    Mosquitto,
}

#[derive(Args)]
pub(crate) struct ThroughputArgs {
    /// Systems under test, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "sluice,mosquitto-bridge"
    )]
    sut: Vec<TputSutChoice>,
    /// Clouds, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "fast-sink,mosquitto"
    )]
    cloud: Vec<CloudChoice>,
    /// Devices (connections); the offered rate is split evenly over them.
    #[arg(short = 'n', long = "devices", default_value_t = 128)]
    devices: u32,
    /// QoS 1 PUBLISHes awaiting PUBACK per device, at most.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    window: u16,
    /// Payload size in bytes (at least 24).
    #[arg(long, default_value_t = 1024)]
    payload: usize,
    #[arg(long, value_enum, default_value = "3.1.1")]
    mqtt: MqttVersion,
    /// Offered rate of the first step, msg/s (all devices together).
    #[arg(long, default_value_t = 10_000.0)]
    start_rate: f64,
    /// Each passing step multiplies the offered rate by this.
    #[arg(long, default_value_t = 1.25)]
    step_factor: f64,
    #[arg(long, default_value_t = 20)]
    max_steps: u32,
    /// Bisection steps between the last passing and the first failing rate.
    #[arg(long, default_value_t = 2)]
    refine_steps: u32,
    /// Length of each step.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    step: Duration,
    /// The first part of each step, not measured.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// A step fails when its p99 end-to-end latency is above this.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    p99_bound: Duration,
    /// A step fails when achieved ÷ offered is below this.
    #[arg(long, default_value_t = 0.95)]
    min_delivery: f64,
    /// Shortest sleep of a device between two batches of PUBLISHes.
    #[arg(long, default_value = "5ms", value_parser = humantime::parse_duration)]
    pacing_tick: Duration,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` in the generated sluice config (0 = one per core but one, at least one).
    #[arg(long, default_value_t = 0)]
    sluice_shards: u32,
    /// `inflight` of sluice's uplink (default: sluice's own default).
    #[arg(long)]
    sluice_uplink_inflight: Option<u16>,
    #[command(flatten)]
    aggregate: AggregateArgs,
    /// Write the JSON report here (e.g. docs/perf/throughput.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown summary here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum EdgeSutChoice {
    /// The sluice gateway (needs --sluice-bin).
    Sluice,
    /// A plain Mosquitto broker.
    Mosquitto,
}

#[derive(Args)]
pub(crate) struct ConnectionsArgs {
    /// Systems under test, comma-separated; the first fixes N when --n is "max".
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "sluice,mosquitto"
    )]
    sut: Vec<EdgeSutChoice>,
    /// Connections: a number, or "max" (the first SUT's open-file limit less its open files).
    #[arg(long = "n", default_value = "max")]
    n: String,
    /// Connections per tool process at most (more are spread over child processes).
    #[arg(long, default_value_t = 19_000)]
    per_process: u32,
    /// Connection attempts in progress at once, per process.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Keep-alive of the idle devices, seconds.
    #[arg(long, default_value_t = 60)]
    keep_alive: u16,
    #[arg(long, value_enum, default_value = "3.1.1")]
    mqtt: MqttVersion,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` in the generated sluice config (0 = one per core but one, at least one).
    #[arg(long, default_value_t = 0)]
    sluice_shards: u32,
    /// Write the JSON report here (e.g. docs/perf/connections.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown summary here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn core(args: CoreArgs) -> anyhow::Result<()> {
    let suts: Vec<Sut> = args
        .sut
        .iter()
        .flat_map(|choice| match choice {
            SutChoice::Sluice => vec![Sut::Sluice],
            SutChoice::MosquittoBridge => vec![Sut::MosquittoBridge],
            SutChoice::Both => vec![Sut::Sluice, Sut::MosquittoBridge],
            SutChoice::Floor => vec![Sut::Floor],
            SutChoice::FloorUring => vec![Sut::FloorUring],
            SutChoice::RelayFloor => vec![Sut::RelayFloor],
            SutChoice::All => vec![Sut::Sluice, Sut::MosquittoBridge, Sut::Floor],
        })
        .collect();
    if args.load.ramp + args.load.settle >= args.load.duration {
        bail!(
            "--ramp plus --settle must be shorter than --duration (CPU is measured between them)"
        );
    }
    let config = CoreScenario {
        devices: args.devices,
        rate_per_device: args.load.rate,
        duration: args.load.duration,
        ramp: args.load.ramp,
        settle: args.load.settle,
        payload: args.load.payload,
        protocol: args.load.mqtt.into(),
        qos: qos(args.load.qos),
        arrivals: arrivals(args.load.poisson),
        suts,
        sluice_bin: args.sluice_bin,
        floor_bin: std::env::current_exe().context("locating this executable")?,
        sluice_shards: args.sluice_shards,
        sluice_aggregate: args.aggregate.opts(),
        drain_idle: args.drain_idle,
        drain_max: args.drain_max,
        command_line: command_line(),
        progress_every: progress(args.load.progress),
        device_tls: args.device_tls,
        sluice_extra: match &args.sluice_extra {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading --sluice-extra {}", path.display()))?,
            ),
            None => None,
        },
        dashboards: args.dashboards,
    };
    let report = run_core(&config).await?;
    let table = markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}

pub(crate) async fn seganet(args: SeganetArgs) -> anyhow::Result<()> {
    let constrained = args.constrained.then_some(Constraint {
        core: args.core,
        quota_percent: args.quota_percent,
    });
    let ramp = args
        .ramp
        .unwrap_or_else(|| (args.duration / 6).min(Duration::from_secs(5)));
    let settle = args
        .settle
        .unwrap_or_else(|| (args.duration / 12).min(Duration::from_secs(2)));
    let name = args.name.unwrap_or_else(|| {
        if constrained.is_some() {
            "seganet-constrained".to_string()
        } else {
            "seganet".to_string()
        }
    });
    let config = SeganetScenario {
        ns: args.ns,
        suts: args
            .sut
            .iter()
            .map(|s| match s {
                SegaSutChoice::Sluice => SegaSut::Sluice,
                SegaSutChoice::Agents => SegaSut::Agents,
                SegaSutChoice::MosquittoBridge => SegaSut::MosquittoBridge,
            })
            .collect(),
        rate_per_device: args.rate,
        payload: args.payload,
        qos: QoS::AtLeastOnce,
        duration: args.duration,
        ramp,
        settle,
        constrained,
        sluice_bin: args.sluice_bin,
        sluice_shards: args
            .sluice_shards
            .unwrap_or(if constrained.is_some() { 1 } else { 0 }),
        sluice_aggregate: args.aggregate.opts(),
        agent_bin: std::env::current_exe().context("locating this executable")?,
        memory_fraction: args.memory_fraction,
        drain_idle: args.drain_idle,
        drain_max: args.drain_max,
        command_line: command_line(),
        progress_every: progress(args.progress),
        out: Some(ReportFiles {
            dir: args.out_dir.clone(),
            name: name.clone(),
        }),
    };
    let report = run_seganet(&config).await?;
    println!("{}", seganet_summary(&report));
    eprintln!(
        "reports written to {}",
        args.out_dir.join(format!("{name}.{{json,md}}")).display()
    );
    Ok(())
}

pub(crate) async fn outage(args: OutageArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::outage::{self as out, OutageScenario};
    let mut config = if args.quick {
        OutageScenario::quick(args.sluice_bin)
    } else {
        OutageScenario::new(args.sluice_bin)
    };
    config.devices = args.devices.unwrap_or(config.devices);
    config.rate_per_device = args.rate;
    config.payload = args.payload;
    config.ramp = args.ramp.unwrap_or(config.ramp);
    config.warmup = args.warmup.unwrap_or(config.warmup);
    config.outage = args.outage.unwrap_or(config.outage);
    config.after = args.after.unwrap_or(config.after);
    config.drain_max = args.drain_max;
    config.shards = args.shards;
    if args.aggregate == OnOff::On {
        config.aggregate = sluice_bench::harness::sut::AggregateOpts::default();
    }
    config.reconnect_max = args.reconnect_max;
    config.spool_parent = args.spool_parent;
    config.progress_every = progress(args.progress);
    config.command_line = command_line();
    let report = out::run_outage(&config).await?;
    out::write_reports(&report, args.out.as_deref(), args.markdown.as_deref())?;
    let table = out::markdown(&report);
    if args.out.is_some() {
        println!("{table}");
    } else {
        eprintln!("{table}");
        emit_json(&report, None)?;
    }
    Ok(())
}

pub(crate) async fn throughput(args: ThroughputArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::throughput::{self as tput, Cloud, ThroughputScenario};
    let mut config = ThroughputScenario::new(args.sluice_bin);
    config.suts = args
        .sut
        .iter()
        .map(|s| match s {
            TputSutChoice::Sluice => Sut::Sluice,
            TputSutChoice::MosquittoBridge => Sut::MosquittoBridge,
        })
        .collect();
    config.clouds = args
        .cloud
        .iter()
        .map(|c| match c {
            CloudChoice::FastSink => Cloud::FastSink,
            CloudChoice::Mosquitto => Cloud::Mosquitto,
        })
        .collect();
    config.devices = args.devices;
    config.window = args.window;
    config.payload_size = args.payload;
    config.protocol = args.mqtt.into();
    config.start_rate = args.start_rate;
    config.step_factor = args.step_factor;
    config.max_steps = args.max_steps;
    config.refine_steps = args.refine_steps;
    config.step_duration = args.step;
    config.warmup = args.warmup;
    config.p99_bound = args.p99_bound;
    config.min_delivery = args.min_delivery;
    config.pacing_tick = args.pacing_tick;
    config.sluice_shards = args.sluice_shards;
    config.sluice_uplink_inflight = args.sluice_uplink_inflight;
    config.sluice_aggregate = args.aggregate.opts();
    config.command_line = command_line();
    let report = tput::run_throughput(&config).await?;
    let table = tput::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}

pub(crate) async fn connections(args: ConnectionsArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::connections::{self as conns, ConnectionsScenario, EdgeSut};
    let bench_bin = std::env::current_exe().context("locating the sluice-bench binary")?;
    let mut config = ConnectionsScenario::new(args.sluice_bin, bench_bin);
    config.suts = args
        .sut
        .iter()
        .map(|s| match s {
            EdgeSutChoice::Sluice => EdgeSut::Sluice,
            EdgeSutChoice::Mosquitto => EdgeSut::Mosquitto,
        })
        .collect();
    config.n = match args.n.as_str() {
        "max" => None,
        n => Some(
            n.parse()
                .with_context(|| format!("--n {n:?} is neither \"max\" nor a number"))?,
        ),
    };
    config.per_process = args.per_process;
    config.concurrency = args.concurrency;
    config.keep_alive_s = args.keep_alive;
    config.protocol = args.mqtt.into();
    config.sluice_shards = args.sluice_shards;
    config.command_line = command_line();
    let report = conns::run_connections(&config).await?;
    let table = conns::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}

pub(crate) async fn priority(args: PriorityArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::priority::{self as prio, PriorityScenario};
    let bench_bin = std::env::current_exe().context("locating the sluice-bench binary")?;
    let mut config = PriorityScenario::new(args.sluice_bin, bench_bin);
    config.devices = args.devices;
    config.high_devices = args.high;
    config.rate_per_device = args.msg_rate;
    config.payload = args.payload;
    config.link_rate = args.rate;
    config.duration = args.duration;
    config.warmup = args.warmup;
    config.modes = args.modes;
    config.drain_idle = args.drain_idle;
    config.drain_max = args.drain_max;
    config.max_inflight = args.max_inflight;
    config.command_line = command_line();
    let report = prio::run_priority(&config).await?;
    let table = prio::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}

#[derive(Args, Debug)]
pub(crate) struct KafkaArgs {
    /// MQTT 5 devices publishing QoS 1 to sluice.
    #[arg(long, default_value_t = 100)]
    devices: u32,
    /// Messages per second per device.
    #[arg(long, default_value_t = 50.0)]
    msg_rate: f64,
    /// Payload bytes (the perf test's record size too).
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// Records `kafka-producer-perf-test` sends.
    #[arg(long, default_value_t = 300_000)]
    perf_records: u64,
    /// The sluice phase's run, ramp and settle included (e.g. "30s").
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` of sluice.
    #[arg(long, default_value_t = 1)]
    sluice_shards: u32,
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

pub(crate) async fn kafka(args: KafkaArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::kafka::{self as k, KafkaScenario};
    let mut config = KafkaScenario::new(args.sluice_bin);
    config.devices = args.devices;
    config.rate_per_device = args.msg_rate;
    config.payload = args.payload;
    config.perf_records = args.perf_records;
    config.duration = args.duration;
    config.sluice_shards = args.sluice_shards;
    config.cluster_script = args.cluster_script;
    config.command_line = command_line();
    let report = k::run_kafka(&config).await?;
    let table = k::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}

#[derive(Args, Debug)]
pub(crate) struct OneM2mArgs {
    /// HTTP connections: the plain client's, and sluice's `connections` per shard.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Requests outstanding per connection (sluice's `pipeline`).
    #[arg(long, default_value_t = 16)]
    pipeline: usize,
    /// MQTT 5 devices publishing QoS 1 to sluice.
    #[arg(long, default_value_t = 10)]
    devices: u32,
    /// Messages per second per device.
    #[arg(long, default_value_t = 50.0)]
    msg_rate: f64,
    /// Devices of the third phase (sluice in front of a stand-in CSE that answers at once).
    #[arg(long, default_value_t = 100)]
    fast_devices: u32,
    /// Payload bytes (binary, so base64 in `con`).
    #[arg(long, default_value_t = 128)]
    payload: usize,
    /// Each phase's run, ramp and settle included (e.g. "30s").
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` of sluice.
    #[arg(long, default_value_t = 1)]
    sluice_shards: u32,
    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown summary here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

pub(crate) async fn onem2m(args: OneM2mArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::onem2m::{self as m2m, OneM2mScenario};
    let mut config = OneM2mScenario::new(args.sluice_bin);
    config.connections = args.connections;
    config.pipeline = args.pipeline;
    config.devices = args.devices;
    config.rate_per_device = args.msg_rate;
    config.fast_devices = args.fast_devices;
    config.payload = args.payload;
    config.duration = args.duration;
    config.sluice_shards = args.sluice_shards;
    config.command_line = command_line();
    let report = m2m::run_onem2m(&config).await?;
    let table = m2m::markdown(&report);
    write_outputs(&report, &table, args.out.as_ref(), args.markdown.as_ref())
}
