//! The `sluice-bench` command: argument parsing, runtime and logging set-up, output routing.
//! All logic lives in the library (`sluice_bench`); this file only translates flags into its
//! configs and prints the reports (JSON on stdout or to `--out`; progress and logs on stderr).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;

use sluice_bench::conn::{host_part, resolve};
use sluice_bench::harness::agents::{run_agent, AgentConfig};
use sluice_bench::harness::sut::Sut;
use sluice_bench::load::devices::{run_devices, Arrivals, DevicesConfig, PayloadSize};
use sluice_bench::report::write_json;
use sluice_bench::scenarios::core::{markdown, run_core, CoreScenario};
use sluice_bench::scenarios::seganet::{
    run_seganet, summary as seganet_summary, Constraint, ReportFiles, SegaSut, SeganetScenario,
};
use sluice_bench::sinks::sink::{start_sink, SinkConfig, SinkTls};
use sluice_proto::mqtt::{ProtocolVersion, QoS};

/// sluice-bench — load generator and scenario runner for the sluice IoT gateway.
///
/// Results are JSON on standard output (or in the --out file); progress lines and logs go to
/// standard error (log level via RUST_LOG, default "warn").
#[derive(Parser)]
#[command(name = "sluice-bench", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulate N MQTT devices publishing bench payloads to one broker or gateway (plain TCP).
    ///
    /// Each device has its own connection (client id {client-prefix}-{i}) and publishes to
    /// {topic-prefix}/{i}. Payloads start with a 24-byte header (magic "SLB1", device index u32,
    /// sequence number u64, send time u64 ns since the UNIX epoch, big-endian) followed by random
    /// filler. At the end a JSON report is printed: sent, acknowledged, ack latency percentiles,
    /// reconnects, and this process's own CPU use.
    Devices(DevicesArgs),
    /// Subscribe on a (cloud) broker and measure the bench messages that arrive.
    ///
    /// Records end-to-end latency (receive time minus the send timestamp in the payload, so run
    /// it on the same machine as the devices), unique messages, duplicates, per-device order
    /// violations and gaps; prints a JSON report when done.
    Sink(SinkArgs),
    /// Run a whole scenario on this machine (brokers, system under test, devices and sink).
    #[command(subcommand)]
    Scenario(ScenarioCommand),
    /// One per-device agent process (used by `scenario seganet`): accepts one device's plain
    /// MQTT connection and forwards its PUBLISHes over its own TLS 1.3 session to the cloud,
    /// acknowledging the device after the cloud's PUBACK.
    #[command(hide = true)]
    Agent(AgentArgs),
    /// A fast acknowledging MQTT-over-TLS 1.3 server: a stand-in cloud that PUBACKs every QoS 1
    /// PUBLISH at once and counts messages, bytes and (for bench payloads) end-to-end latency.
    ///
    /// Accepts MQTT 3.1.1 and 5 (advertising Receive Maximum 65535). Runs for --duration, then
    /// prints a JSON report.
    Fastsink(FastsinkArgs),
    /// Hold N idle device connections (used by `scenario connections` to spread connections over
    /// processes): prints a JSON line once every attempt finished, holds until stdin closes,
    /// disconnects and prints a second JSON line.
    #[command(hide = true)]
    Idle(IdleArgs),
    /// The kernel floor: a minimal MQTT responder that answers CONNECT and every QoS 1 PUBLISH
    /// at once and forwards nothing.
    ///
    /// One thread, one epoll loop, no codec beyond finding packet types and ids. Its CPU under a
    /// device load is what terminating the devices' TCP connections costs this machine's kernel
    /// (reads, writes, loopback delivery, wake-ups): the floor under any gateway's CPU per
    /// message. `scenario core --sut floor` (or `--sut all`) measures it beside the gateways.
    /// Prints "listening on HOST:PORT" on stdout, then serves until killed.
    Floor(FloorArgs),
    /// The storage study: append N records with T threads, then read them all back, for the
    /// sluice spool, SQLite and PostgreSQL under the same durability policy.
    ///
    /// For each engine, T and N (N is the total over all T producer threads): append, make
    /// durable (default: group commit every 10 ms — spool fsync, SQLite WAL commit with
    /// synchronous=FULL, PostgreSQL commit with synchronous_commit=on), then scan everything
    /// back with one thread and verify count and checksum. The spool runs one spool per
    /// producer thread (as one per shard); SQLite and PostgreSQL get one writer connection fed
    /// by the producers over a channel, one transaction per commit window. PostgreSQL runs in a
    /// throwaway cluster when its binaries are installed (/usr/lib/postgresql/*/bin), else is
    /// reported as not installed. Points predicted to exceed --max-point-time are skipped.
    /// --recovery SIZE also writes a spool of SIZE and times Spool::open on it, after dropping
    /// the page cache (root) and again warm. Prints the Markdown table; writes JSON to --out,
    /// Markdown to --md and PNG charts {charts}-append.png and {charts}-read.png.
    Storage(StorageArgs),
}

#[derive(Subcommand)]
enum ScenarioCommand {
    /// The core path: devices → system under test → cloud Mosquitto over TLS 1.3, QoS 1.
    ///
    /// Starts a cloud Mosquitto (TLS 1.3 listener, certificates generated for the run), a sink
    /// subscribed to '#', then the system under test: sluice (child process, generated config
    /// with one uplink to the cloud) and/or an edge Mosquitto bridging 'topic # out 1' to the
    /// cloud. Devices publish to the SUT's plain MQTT port. Reports delivery ratio, end-to-end
    /// and ack latency, SUT CPU (% of one core and µs per message, measured after the ramp),
    /// SUT RSS (start/peak/end) and this tool's own CPU. Prints a Markdown table; writes JSON to
    /// --out (or prints it on stdout, with the table on stderr, when --out is not given).
    Core(CoreArgs),
    /// The SegaNet experiment: sluice vs one-process-per-device agents vs a Mosquitto bridge,
    /// swept over the number of devices N.
    ///
    /// For each system under test and each N: a fresh cloud Mosquitto (TLS 1.3, certificates
    /// generated), the SUT, N devices at --rate msg/s with --payload bytes, QoS 1, and a sink.
    /// Measures p99 latency, the SUT's CPU (all its processes) and memory, the offered vs
    /// achieved send rate and this tool's CPU. Writes {out-dir}/{name}.json, {name}.md and
    /// {name}-p99.png, -cpu.png, -rss.png after every point; prints the table at the end.
    Seganet(SeganetArgs),
    /// Maximum sustained throughput: a step load of 1 KB QoS 1 messages, increased until the
    /// p99 end-to-end latency passes --p99-bound or delivery falls behind, for each system under
    /// test into each cloud (a TLS 1.3 Mosquitto, and the in-process fast acknowledging sink).
    ///
    /// Reports per step: offered, sent, acknowledged and achieved (reached the cloud) rates,
    /// e2e and ack latency p50/p99, SUT CPU (% and µs per message), cloud, generator and
    /// whole-machine CPU; and the maximum sustained rate per SUT and cloud. Prints a Markdown
    /// summary; writes JSON to --out (or prints it on stdout when --out is not given).
    Throughput(ThroughputArgs),
    /// Idle device connections: as many as the open-file limit allows (or --n), RSS per
    /// connection, connect rate and CONNACK latency, for sluice and an edge Mosquitto.
    ///
    /// Raises this tool's soft open-file limit to the hard limit (the SUTs inherit it) and
    /// spreads connections over `sluice-bench idle` child processes of at most --per-process
    /// connections each.
    Connections(ConnectionsArgs),
    /// Priority lanes (SegaNet §4.3) over a rate-limited uplink: 4 devices (1 high, client id
    /// bench-hi-0), each 100 msg/s × 1 KB, through sluice to a TLS 1.3 cloud Mosquitto over a
    /// veth link the normal devices saturate. Needs root.
    ///
    /// Builds two network namespaces (gateway, cloud) and a veth pair; the cloud Mosquitto and
    /// the sink run in the cloud namespace, sluice and the devices in the gateway one. Modes,
    /// each a separate run of --duration after a --warmup run: unloaded (only the high device,
    /// priority on), off (no [priority]; the scenario rate-limits the link with a one-class htb),
    /// lanes (priority on; the same limit), lanes+tc (priority on; sluice installs the htb itself
    /// with install_tc). Reports per device and mode: sent, delivered, lost, avg and p99
    /// latency; and verdicts against the target (high p99 with lanes+tc ≤ 2× unloaded; normal
    /// p99 ≥ 10×; nothing lost). Prints a Markdown table; writes JSON to --out.
    Priority(PriorityArgs),
    /// A cloud outage under load with sluice's durable spool (ack "spool"): N devices publish,
    /// sluice's link to a TLS 1.3 cloud Mosquitto is cut for --outage and restored; reports the
    /// backlog at the reconnect, the drain time, live traffic's e2e p50/p99 during the drain vs
    /// before the outage, device ack latency, delivery, duplicates and per-device order within
    /// the backlog and within the live stream, with verdicts. --quick: 16 devices, 5 s outage.
    /// Prints the Markdown report; writes JSON to --out and Markdown to --markdown.
    Outage(OutageArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum MqttVersion {
    #[value(name = "3.1.1")]
    V311,
    #[value(name = "5")]
    V5,
}

impl From<MqttVersion> for ProtocolVersion {
    fn from(v: MqttVersion) -> Self {
        match v {
            MqttVersion::V311 => ProtocolVersion::V311,
            MqttVersion::V5 => ProtocolVersion::V5,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum SutChoice {
    /// The sluice gateway (needs --sluice-bin).
    Sluice,
    /// An edge Mosquitto configured as a TLS 1.3 bridge to the cloud.
    MosquittoBridge,
    /// sluice, then the bridge, in one invocation, with a comparison table.
    Both,
    /// `sluice-bench floor`: answers every PUBLISH and forwards nothing (the kernel floor).
    Floor,
    /// sluice, the bridge, then the floor: the comparison table plus each one's CPU above the
    /// floor.
    All,
}

/// sluice's SenML aggregation (`[uplink.aggregate]`) in the generated config.
#[derive(Args, Clone)]
struct AggregateArgs {
    /// Aggregate normal records into SenML packs above --min-devices (on in the scenarios as
    /// measured; sluice's own default is off, so the generated config always says which).
    #[arg(long, value_enum, default_value = "on")]
    aggregate: OnOff,
    /// Aggregate while more than this many devices are connected.
    #[arg(long, default_value_t = 50)]
    min_devices: usize,
    /// SenML encoding of packs.
    #[arg(long, value_enum, default_value = "json")]
    pack_format: PackFormatArg,
    /// Publish a pack once it reaches this size (with unit, e.g. "1KiB", "16KiB").
    #[arg(long, default_value = "1KiB")]
    max_pack: String,
    /// ... or once its oldest record waited this long (with unit, e.g. "1s", "200ms").
    #[arg(long, default_value = "1s")]
    max_delay: String,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PackFormatArg {
    Json,
    Cbor,
}

impl AggregateArgs {
    fn opts(&self) -> sluice_bench::harness::sut::AggregateOpts {
        sluice_bench::harness::sut::AggregateOpts {
            enabled: self.aggregate == OnOff::On,
            min_devices: self.min_devices,
            format: match self.pack_format {
                PackFormatArg::Json => "json",
                PackFormatArg::Cbor => "cbor",
            }
            .to_string(),
            max_pack: self.max_pack.clone(),
            max_delay: self.max_delay.clone(),
        }
    }
}

/// Options shared by everything that generates load.
#[derive(Args, Clone)]
struct LoadArgs {
    /// Messages per second per device (0: connect and stay idle).
    #[arg(long, default_value_t = 10.0, value_name = "MSG/S")]
    rate: f64,
    /// Payload size in bytes, uniformly random in MIN..MAX (inclusive), or a fixed SIZE.
    /// At least 24 (the bench header).
    #[arg(long, default_value = "100..1024", value_name = "MIN..MAX")]
    payload: PayloadSize,
    /// QoS of the PUBLISHes: 0 (fire and forget) or 1 (wait for PUBACK, measure ack latency).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    qos: u8,
    /// MQTT protocol version the devices speak.
    #[arg(long, value_enum, default_value = "3.1.1")]
    mqtt: MqttVersion,
    /// Length of the whole run, ramp included, e.g. "60s", "2m".
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Device connections are started evenly spread over this period, e.g. "5s".
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    ramp: Duration,
    /// Steady state starts this long after the ramp: latencies labelled "steady" (and, for
    /// `scenario`, the CPU window) only count what happens after it, e.g. "5s".
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// Poisson arrivals (exponential gaps) instead of a fixed period with a random phase.
    #[arg(long)]
    poisson: bool,
    /// Progress line on stderr every this often ("0s" to disable).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress: Duration,
}

#[derive(Args)]
struct DevicesArgs {
    /// Broker or gateway to connect to, HOST:PORT (plain TCP MQTT).
    #[arg(long, value_name = "HOST:PORT")]
    target: String,
    /// Number of devices (one MQTT connection each).
    #[arg(short = 'n', long = "devices", default_value_t = 1)]
    devices: u32,
    #[command(flatten)]
    load: LoadArgs,
    /// Topics are {topic-prefix}/{device index}.
    #[arg(long, default_value = "dev")]
    topic_prefix: String,
    /// Client ids are {client-prefix}-{device index}.
    #[arg(long, default_value = "bench")]
    client_prefix: String,
    /// Share of high-priority devices, 0.0–1.0: the first round(N·F) devices (lowest indices)
    /// use client id {client-prefix}-hi-{device index} (topics unchanged). The report's
    /// "high_devices" says how many.
    #[arg(long, default_value_t = 0.0, value_name = "F", value_parser = parse_share)]
    high_share: f64,
    /// QoS 1 PUBLISHes awaiting PUBACK per device, at most. A tick that finds the window full is
    /// skipped and counted ("skipped_inflight_full"), not queued. MQTT 5: also capped by the
    /// broker's Receive Maximum.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    max_inflight: u16,
    /// After publishing stops, how long devices wait for outstanding PUBACKs.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Seed for payload sizes, phases, filler and back-off jitter (runs are reproducible in what
    /// they send, not in timing).
    #[arg(long, default_value_t = 0x5111_CE00)]
    seed: u64,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct SinkArgs {
    /// Broker to subscribe on, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    broker: String,
    /// Use TLS 1.3 (rustls, ring provider); requires --ca.
    #[arg(long, requires = "ca")]
    tls: bool,
    /// PEM file of the CA certificate(s) that signed the broker's certificate (no system roots).
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Client certificate chain (PEM) to present, with --key.
    #[arg(long, value_name = "FILE", requires = "key")]
    cert: Option<PathBuf>,
    /// Private key (PEM) of --cert.
    #[arg(long, value_name = "FILE", requires = "cert")]
    key: Option<PathBuf>,
    /// Name to verify the broker certificate against. Default: the host of --broker.
    #[arg(long)]
    server_name: Option<String>,
    /// Topic filter to subscribe to.
    #[arg(long, default_value = "#")]
    topic: String,
    /// Subscription QoS: 0 or 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    qos: u8,
    /// MQTT protocol version.
    #[arg(long, value_enum, default_value = "3.1.1")]
    mqtt: MqttVersion,
    /// Stop after this long, e.g. "70s" (start the sink before the devices and let it run a
    /// little longer than they do).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Stop earlier once at least one message arrived and then nothing for this long, e.g. "3s".
    #[arg(long, value_parser = humantime::parse_duration)]
    idle_exit: Option<Duration>,
    /// Number of devices expected (the report says how many were heard from).
    #[arg(long, default_value_t = 0)]
    expect_devices: u32,
    /// Also measure end-to-end latency per device: one line per device on stderr at the end,
    /// and "per_device" in the JSON report.
    #[arg(long)]
    per_device: bool,
    /// Number of messages the devices sent, for the delivery ratio.
    #[arg(long, conflicts_with = "sent_file")]
    sent: Option<u64>,
    /// A file read at the end of the run holding the sent count: the JSON report of
    /// `sluice-bench devices` (its "sent" field) or a bare number.
    #[arg(long, value_name = "FILE")]
    sent_file: Option<PathBuf>,
    /// MQTT client id (default: unique per run).
    #[arg(long)]
    client_id: Option<String>,
    /// Progress line on stderr every this often ("0s" to disable).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress: Duration,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct CoreArgs {
    /// Number of devices.
    #[arg(short = 'n', long = "n", default_value_t = 1024)]
    devices: u32,
    #[command(flatten)]
    load: LoadArgs,
    /// System(s) under test.
    #[arg(long, value_enum, default_value = "both")]
    sut: SutChoice,
    /// The sluice binary (build it with `cargo build --release -p sluice`).
    #[arg(long, default_value = "target/release/sluice", value_name = "FILE")]
    sluice_bin: PathBuf,
    /// `[gateway] shards` in the generated sluice config (0 = one per core).
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
    /// Write the JSON report here (e.g. docs/perf/core-path.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown table here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

#[derive(Args)]
struct AgentArgs {
    /// Plain-TCP MQTT address to accept the device on (port 0: any free port; the address is
    /// written to --ready-file).
    #[arg(long, value_name = "HOST:PORT")]
    listen: SocketAddr,
    /// The cloud broker's TLS 1.3 MQTT address.
    #[arg(long, value_name = "HOST:PORT")]
    cloud: SocketAddr,
    /// PEM CA certificate(s) of the cloud broker.
    #[arg(long, value_name = "FILE")]
    ca: PathBuf,
    /// Name to verify the cloud certificate against. Default: the IP address of --cloud.
    #[arg(long)]
    server_name: Option<String>,
    /// MQTT client id of the cloud session.
    #[arg(long, default_value = "sluice-agent")]
    client_id: String,
    /// QoS 1 messages awaiting the cloud's PUBACK, at most.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    max_inflight: u16,
    /// Write the listening address here once the first cloud session is up.
    #[arg(long, value_name = "FILE")]
    ready_file: Option<PathBuf>,
    /// Exit when the parent process is no longer this pid.
    #[arg(long)]
    parent_pid: Option<u32>,
}

#[derive(Args)]
struct SeganetArgs {
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
    /// `[gateway] shards` for sluice. Default: 0 (one per core), 1 with --constrained.
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

#[derive(Args)]
struct PriorityArgs {
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

#[derive(Clone, Copy, ValueEnum)]
enum SegaSutChoice {
    /// The sluice gateway.
    Sluice,
    /// One `sluice-bench agent` process per device, each with its own TLS session.
    Agents,
    /// An edge Mosquitto bridging to the cloud over TLS 1.3.
    MosquittoBridge,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Floor(args) = &cli.command {
        // A plain epoll loop on this thread: no runtime, so nothing but the floor's own work.
        let served = sluice_bench::sinks::floor::run_floor(args.listen, |addr| {
            println!("listening on {addr}");
            let _ = std::io::Write::flush(&mut std::io::stdout());
        });
        return match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice-bench floor: {}: {e}", args.listen);
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    // One agent process = one thread: thousands of them run side by side.
    let mut builder = match cli.command {
        Command::Agent(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice-bench: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Devices(args) => devices(args).await,
        Command::Sink(args) => sink(args).await,
        Command::Scenario(ScenarioCommand::Core(args)) => core(args).await,
        Command::Scenario(ScenarioCommand::Seganet(args)) => seganet(args).await,
        Command::Agent(args) => agent(args).await,
        Command::Fastsink(args) => fastsink(args).await,
        Command::Idle(args) => idle(args).await,
        Command::Scenario(ScenarioCommand::Throughput(args)) => throughput(args).await,
        Command::Scenario(ScenarioCommand::Connections(args)) => connections(args).await,
        Command::Scenario(ScenarioCommand::Priority(args)) => priority(args).await,
        Command::Scenario(ScenarioCommand::Outage(args)) => outage(args).await,
        Command::Storage(args) => storage(args).await,
        Command::Floor(_) => unreachable!("served in main without a runtime"),
    }
}

/// A share between 0.0 and 1.0.
fn parse_share(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} is not between 0.0 and 1.0"))
    }
}

fn qos(v: u8) -> QoS {
    if v == 0 {
        QoS::AtMostOnce
    } else {
        QoS::AtLeastOnce
    }
}

fn progress(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

fn arrivals(poisson: bool) -> Arrivals {
    if poisson {
        Arrivals::Poisson
    } else {
        Arrivals::Periodic
    }
}

fn emit_json<T: serde::Serialize>(report: &T, out: Option<&PathBuf>) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(report).context("serialising the report")?;
    println!("{json}");
    if let Some(path) = out {
        std::fs::write(path, format!("{json}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn devices(args: DevicesArgs) -> anyhow::Result<()> {
    let mut config = DevicesConfig::new(resolve(&args.target).await?);
    config.devices = args.devices;
    config.rate_per_device = args.load.rate;
    config.payload = args.load.payload;
    config.qos = qos(args.load.qos);
    config.protocol = args.load.mqtt.into();
    config.duration = args.load.duration;
    config.ramp = args.load.ramp;
    config.settle = args.load.settle;
    config.arrivals = arrivals(args.load.poisson);
    config.progress_every = progress(args.load.progress);
    config.topic_prefix = args.topic_prefix;
    config.client_prefix = args.client_prefix;
    config.high_share = args.high_share;
    config.max_inflight = args.max_inflight;
    config.drain_timeout = args.drain_timeout;
    config.seed = args.seed;
    if config.high_share > 0.0 {
        eprintln!(
            "devices: {} of {} are high-priority (client ids {}-hi-0 …)",
            config.high_devices(),
            config.devices,
            config.client_prefix
        );
    }
    let report = run_devices(config).await?;
    emit_json(&report, args.out.as_ref())
}

async fn sink(args: SinkArgs) -> anyhow::Result<()> {
    let mut config = SinkConfig::new(resolve(&args.broker).await?);
    if args.tls {
        let Some(ca) = args.ca.clone() else {
            bail!("--tls needs --ca FILE")
        };
        config.tls = Some(SinkTls {
            ca_file: ca,
            client_cert: args.cert.clone().zip(args.key.clone()),
            server_name: args
                .server_name
                .clone()
                .unwrap_or_else(|| host_part(&args.broker).to_string()),
        });
    }
    config.topic = args.topic.clone();
    config.qos = qos(args.qos);
    config.protocol = args.mqtt.into();
    config.expect_devices = args.expect_devices;
    config.per_device = args.per_device;
    config.progress_every = progress(args.progress);
    if let Some(id) = args.client_id.clone() {
        config.client_id = id;
    }
    let handle = start_sink(config).await?;
    eprintln!("sink: subscribed to {:?} on {}", args.topic, args.broker);
    let deadline = tokio::time::Instant::now() + args.duration;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            break;
        }
        if let Some(idle) = args.idle_exit {
            if handle.received() > 0 && handle.idle_for() >= idle {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100).min(deadline - now)).await;
    }
    let sent = match (&args.sent, &args.sent_file) {
        (Some(n), _) => Some(*n),
        (None, Some(path)) => Some(read_sent_file(path)?),
        (None, None) => None,
    };
    let report = handle.stop(sent).await?;
    if report.packs > 0 {
        eprintln!(
            "sink: {} of {} PUBLISHes were SenML packs holding {} records",
            report.packs, report.received, report.records_in_packs
        );
    }
    for device in &report.per_device {
        eprintln!("sink: {device}");
    }
    if report.per_device_omitted > 0 {
        eprintln!(
            "sink: {} arrivals of device indices >= {} have no per-device line",
            report.per_device_omitted,
            sluice_bench::stats::MAX_PER_DEVICE_LATENCY
        );
    }
    emit_json(&report, args.out.as_ref())
}

/// The sent count from a devices JSON report (`"sent"`) or a file holding just a number.
fn read_sent_file(path: &PathBuf) -> anyhow::Result<u64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(n) = text.trim().parse::<u64>() {
        return Ok(n);
    }
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is neither a number nor JSON", path.display()))?;
    value
        .get("sent")
        .and_then(serde_json::Value::as_u64)
        .with_context(|| format!("{} has no numeric \"sent\" field", path.display()))
}

async fn core(args: CoreArgs) -> anyhow::Result<()> {
    let suts = match args.sut {
        SutChoice::Sluice => vec![Sut::Sluice],
        SutChoice::MosquittoBridge => vec![Sut::MosquittoBridge],
        SutChoice::Both => vec![Sut::Sluice, Sut::MosquittoBridge],
        SutChoice::Floor => vec![Sut::Floor],
        SutChoice::All => vec![Sut::Sluice, Sut::MosquittoBridge, Sut::Floor],
    };
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
    };
    let report = run_core(&config).await?;
    let table = markdown(&report);
    if let Some(path) = &args.markdown {
        std::fs::write(path, &table).with_context(|| format!("writing {}", path.display()))?;
    }
    match &args.out {
        Some(path) => {
            write_json(&report, path)?;
            println!("{table}");
            eprintln!("report written to {}", path.display());
        }
        None => {
            eprintln!("{table}");
            println!(
                "{}",
                serde_json::to_string_pretty(&report).context("serialising the report")?
            );
        }
    }
    Ok(())
}

async fn agent(args: AgentArgs) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let mut config = AgentConfig::new(args.cloud, args.ca, args.client_id);
    if let Some(name) = args.server_name {
        config.server_name = name;
    }
    config.max_inflight = args.max_inflight;
    config.ready_file = args.ready_file;
    config.parent_pid = args.parent_pid;
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    run_agent(listener, config, shutdown).await
}

async fn seganet(args: SeganetArgs) -> anyhow::Result<()> {
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

#[derive(Args)]
struct OutageArgs {
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

async fn outage(args: OutageArgs) -> anyhow::Result<()> {
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

/// This process's command line, shell-quoted where needed.
fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Args)]
struct FloorArgs {
    /// Plain-TCP MQTT address to listen on (port 0: any free port, printed on stdout).
    #[arg(long, default_value = "127.0.0.1:1883", value_name = "HOST:PORT")]
    listen: SocketAddr,
}

#[derive(Args)]
struct FastsinkArgs {
    /// Address to listen on, HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:8883", value_name = "HOST:PORT")]
    listen: String,
    /// Server certificate chain (PEM).
    #[arg(long, value_name = "FILE")]
    cert: PathBuf,
    /// Private key of --cert (PEM).
    #[arg(long, value_name = "FILE")]
    key: PathBuf,
    /// Do not parse the bench header (no latency measurement).
    #[arg(long)]
    no_latency: bool,
    /// Open connections at most.
    #[arg(long, default_value_t = 1024)]
    max_connections: u64,
    /// Stop after this long, e.g. "60s".
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Progress line on stderr every this often ("0s" to disable).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress: Duration,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct IdleArgs {
    /// Broker or gateway, HOST:PORT (plain TCP).
    #[arg(long, value_name = "HOST:PORT")]
    target: String,
    /// Connections to open.
    #[arg(short = 'n', long = "connections")]
    connections: u32,
    /// Client ids are {client-prefix}-{first-index + i}.
    #[arg(long, default_value_t = 0)]
    first_index: u32,
    #[arg(long, default_value = "idle")]
    client_prefix: String,
    #[arg(long, value_enum, default_value = "3.1.1")]
    mqtt: MqttVersion,
    /// Keep-alive in CONNECT, seconds (a PINGREQ every half of it).
    #[arg(long, default_value_t = 60)]
    keep_alive: u16,
    /// Connection attempts in progress at once.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// Disconnect after this long even if stdin stays open.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    hold_max: Duration,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TputSutChoice {
    /// The sluice gateway (needs --sluice-bin).
    Sluice,
    /// An edge Mosquitto bridging to the cloud over TLS 1.3.
    MosquittoBridge,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CloudChoice {
    /// The in-process fast acknowledging sink.
    FastSink,
    /// A TLS 1.3 Mosquitto with a measuring subscriber.
    Mosquitto,
}

#[derive(Args)]
struct ThroughputArgs {
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
    /// `[gateway] shards` in the generated sluice config (0 = one per core).
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
enum EdgeSutChoice {
    /// The sluice gateway (needs --sluice-bin).
    Sluice,
    /// A plain Mosquitto broker.
    Mosquitto,
}

#[derive(Args)]
struct ConnectionsArgs {
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
    /// `[gateway] shards` in the generated sluice config (0 = one per core).
    #[arg(long, default_value_t = 0)]
    sluice_shards: u32,
    /// Write the JSON report here (e.g. docs/perf/connections.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Also write the Markdown summary here.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

async fn fastsink(args: FastsinkArgs) -> anyhow::Result<()> {
    use sluice_bench::sinks::fastsink::{start_fast_sink, tls_server_config, FastSinkConfig};
    let tls = tls_server_config(&args.cert, &args.key)?;
    let listener = tokio::net::TcpListener::bind(resolve(&args.listen).await?)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let mut config = FastSinkConfig::new(tls);
    config.measure_latency = !args.no_latency;
    config.max_connections = args.max_connections;
    let sink = start_fast_sink(listener, config)?;
    eprintln!("fastsink: listening on {} (TLS 1.3)", sink.local_addr());
    let deadline = tokio::time::Instant::now() + args.duration;
    let mut last = (tokio::time::Instant::now(), 0u64);
    let mut next_progress = progress(args.progress).map(|p| tokio::time::Instant::now() + p);
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            break;
        }
        if let (Some(at), Some(every)) = (next_progress, progress(args.progress)) {
            if now >= at {
                let messages = sink.messages();
                let dt = last.0.elapsed().as_secs_f64().max(1e-9);
                eprintln!(
                    "[fastsink] connections {}  messages {} ({:.0}/s)",
                    sink.connections_open(),
                    messages,
                    (messages - last.1) as f64 / dt
                );
                last = (now, messages);
                next_progress = Some(at + every);
            }
        }
        tokio::time::sleep(Duration::from_millis(100).min(deadline - now)).await;
    }
    let report = sink.stop().await;
    emit_json(&report, args.out.as_ref())
}

async fn idle(args: IdleArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::connections::{raise_fd_limit, run_idle_worker, IdleConfig};
    raise_fd_limit()?;
    let mut config = IdleConfig::new(resolve(&args.target).await?, args.connections);
    config.first_index = args.first_index;
    config.client_prefix = args.client_prefix;
    config.protocol = args.mqtt.into();
    config.keep_alive_s = args.keep_alive;
    config.concurrency = args.concurrency;
    config.connect_timeout = args.connect_timeout;
    run_idle_worker(config, args.hold_max).await
}

async fn throughput(args: ThroughputArgs) -> anyhow::Result<()> {
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
    if let Some(path) = &args.markdown {
        std::fs::write(path, &table).with_context(|| format!("writing {}", path.display()))?;
    }
    match &args.out {
        Some(path) => {
            tput::write_json(&report, path)?;
            println!("{table}");
            eprintln!("report written to {}", path.display());
        }
        None => {
            eprintln!("{table}");
            emit_json(&report, None)?;
        }
    }
    Ok(())
}

async fn connections(args: ConnectionsArgs) -> anyhow::Result<()> {
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
    if let Some(path) = &args.markdown {
        std::fs::write(path, &table).with_context(|| format!("writing {}", path.display()))?;
    }
    match &args.out {
        Some(path) => {
            conns::write_json(&report, path)?;
            println!("{table}");
            eprintln!("report written to {}", path.display());
        }
        None => {
            eprintln!("{table}");
            emit_json(&report, None)?;
        }
    }
    Ok(())
}

async fn priority(args: PriorityArgs) -> anyhow::Result<()> {
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
    if let Some(path) = &args.markdown {
        std::fs::write(path, &table).with_context(|| format!("writing {}", path.display()))?;
    }
    match &args.out {
        Some(path) => {
            prio::write_json(&report, path)?;
            println!("{table}");
            eprintln!("report written to {}", path.display());
        }
        None => {
            eprintln!("{table}");
            emit_json(&report, None)?;
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StorageEngineChoice {
    /// The sluice spool, one per producer thread.
    Spool,
    /// SQLite (bundled) in WAL mode, one writer connection.
    Sqlite,
    /// PostgreSQL in a throwaway cluster (skipped when not installed).
    Postgres,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DurabilityChoice {
    /// Group commit every --commit-interval, each commit fsynced.
    Interval,
    /// One fsynced commit per producer batch of --batch records.
    Always,
    /// Commit every --commit-interval without fsync.
    Never,
}

#[derive(Args)]
struct StorageArgs {
    /// Total records per point (N, over all threads), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "5000,50000,500000,5000000"
    )]
    records: Vec<u64>,
    /// A smaller sweep: N = 5000,50000,500000 (replaces the default --records).
    #[arg(long)]
    quick: bool,
    /// Producer threads per point (T), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    threads: Vec<usize>,
    /// Record body size in bytes (at least 12).
    #[arg(long, default_value_t = 256)]
    record_bytes: usize,
    /// Engines, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "spool,sqlite,postgres"
    )]
    engines: Vec<StorageEngineChoice>,
    /// When records are made durable.
    #[arg(long, value_enum, default_value = "interval")]
    durability: DurabilityChoice,
    /// The group-commit window (interval, never).
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    commit_interval: Duration,
    /// Records a producer appends (or hands to the writer) at a time; the commit unit of
    /// --durability always.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// The spool's max_batch_bytes: most bytes one commit job carries (a full batch makes the
    /// producer wait for the commit in flight).
    #[arg(long, default_value = "16MiB", value_parser = sluice_bench::scenarios::storage::parse_bytes)]
    spool_batch_bytes: u64,
    /// Skip a point whose predicted append+read time exceeds this; cut one that runs 3× over.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    max_point_time: Duration,
    /// Where the files go (a fresh subdirectory, removed afterwards). Default /var/tmp, or the
    /// current directory when /var/tmp is a tmpfs.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Also write a spool of this size (e.g. 1GiB) and time its recovery (Spool::open).
    #[arg(long, value_name = "SIZE", value_parser = sluice_bench::scenarios::storage::parse_bytes)]
    recovery: Option<u64>,
    /// Skip the engine × N × T study (e.g. with --recovery).
    #[arg(long)]
    no_study: bool,
    /// Before the study, time plain 1 MiB writes of this much to a new file (no fsync, and
    /// with one fsync) on the same file system, for scale; 0 skips it.
    #[arg(long, value_name = "SIZE", default_value = "512MiB", value_parser = sluice_bench::scenarios::storage::parse_bytes)]
    baseline: u64,
    /// Write the JSON report here (e.g. docs/perf/storage.json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Write the Markdown report here (e.g. docs/perf/storage.md).
    #[arg(long, value_name = "FILE")]
    md: Option<PathBuf>,
    /// Chart prefix: writes PREFIX-append.png and PREFIX-read.png (default: --out without
    /// its extension; no charts without either).
    #[arg(long, value_name = "PREFIX")]
    charts: Option<PathBuf>,
}

async fn storage(args: StorageArgs) -> anyhow::Result<()> {
    use sluice_bench::scenarios::storage::{self as st, Durability, Engine, StorageConfig};
    let dir = args.dir.unwrap_or_else(st::default_dir);
    let mut config = StorageConfig::new(dir);
    config.records = if args.quick {
        vec![5_000, 50_000, 500_000]
    } else {
        args.records
    };
    config.threads = args.threads;
    config.record_bytes = args.record_bytes;
    config.engines = args
        .engines
        .iter()
        .map(|e| match e {
            StorageEngineChoice::Spool => Engine::Spool,
            StorageEngineChoice::Sqlite => Engine::Sqlite,
            StorageEngineChoice::Postgres => Engine::Postgres,
        })
        .collect();
    config.commit_interval = args.commit_interval;
    config.durability = match args.durability {
        DurabilityChoice::Interval => Durability::Interval(args.commit_interval),
        DurabilityChoice::Always => Durability::Always,
        DurabilityChoice::Never => Durability::Never,
    };
    config.batch = args.batch;
    config.spool_batch_bytes = args.spool_batch_bytes;
    config.max_point_time = args.max_point_time;
    config.study = !args.no_study;
    config.baseline_bytes = args.baseline;
    config.recovery_bytes = args.recovery;
    config.command_line = command_line();
    let charts = args
        .charts
        .or_else(|| args.out.as_ref().map(|p| p.with_extension("")));
    let files = st::ReportFiles {
        json: args.out,
        markdown: args.md,
        charts,
    };
    let table = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        let report = st::run_storage(&config)?;
        st::write_reports(&report, &files)
    })
    .await
    .context("the storage study thread")??;
    println!("{table}");
    Ok(())
}
