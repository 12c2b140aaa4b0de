//! The `sluice-bench` command: the list of commands (their help text), runtime and logging
//! set-up, and dispatch. The flags of each command and their translation into the library's
//! configs live in [`cli`]; all logic lives in the library (`sluice_bench`). Results are JSON on
//! stdout or in `--out`; progress and logs go to stderr.
#![forbid(unsafe_code)]

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use cli::coap::CoapArgs;
use cli::control_storm::ControlStormArgs;
use cli::faults::FaultsArgs;
use cli::functions::FunctionsArgs;
use cli::hostile::HostileArgs;
use cli::multipath::MultipathArgs;
use cli::scenarios::{
    ConnectionsArgs, CoreArgs, KafkaArgs, OneM2mArgs, OutageArgs, PriorityArgs, SeganetArgs,
    ThroughputArgs,
};
use cli::state::StateArgs;
use cli::storage::StorageArgs;
use cli::tools::{
    AgentArgs, DevicesArgs, FastsinkArgs, FloorArgs, FnFloorArgs, IdleArgs, RelayFloorArgs,
    SinkArgs,
};

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
    /// `--io uring` serves the same answers over io_uring completions instead (`scenario core
    /// --sut floor,floor-uring` compares the two in one run; ADR 0016).
    /// Prints "listening on HOST:PORT" on stdout, then serves until killed.
    Floor(FloorArgs),
    /// The adaptor floor: a minimal MQTT → HTTP relay that POSTs every QoS 1 PUBLISH to a
    /// function as a binary-mode CloudEvent and PUBACKs it after the function's 2xx.
    ///
    /// One thread, one epoll loop, the floor's framing, a pool of --connections keep-alive
    /// connections to the function (one request in flight on each), one write per request,
    /// minimal response parsing; no routing, queue beyond the pool, retries or metrics. Its CPU
    /// under a device load is the least an MQTT → HTTP function adaptor costs on this machine.
    /// `scenario functions --part adaptor` measures it beside sluice. Prints "listening on
    /// HOST:PORT" on stdout, then serves until killed.
    FnFloor(FnFloorArgs),
    /// The relay floor: a minimal MQTT forwarder that relays every device PUBLISH over one
    /// TLS 1.3 session to a cloud broker and PUBACKs the device after the cloud's PUBACK.
    ///
    /// Devices: plain-TCP MQTT 3.1.1 or 5, the floor's framing and epoll loop (one thread).
    /// Cloud: one MQTT 3.1.1 session (clean session, keep-alive 60 s) over TLS 1.3 (rustls,
    /// trusting only --ca-file); each device PUBLISH goes up as a QoS 1 PUBLISH with the same
    /// topic and payload and a fresh packet id, and a QoS 1 device PUBLISH is acknowledged only
    /// when the cloud acknowledged it. Batched: the PUBLISHes read in one loop turn go to the
    /// cloud in one TLS write; each cloud read's PUBACKs reach each device in one write. No
    /// spool, routing, metrics, ACL, retries or reconnect (the cloud session failing ends it):
    /// its CPU under a device load is the least a forwarding gateway costs on this machine.
    /// `scenario core --sut relay-floor` measures it beside sluice and the bridge. Prints
    /// "listening on HOST:PORT" on stdout once the cloud session is up, then serves until
    /// killed.
    RelayFloor(RelayFloorArgs),
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
    /// A minimal edge function (used by `scenario functions`): answers every HTTP/1.1 request
    /// 200 with {"recv_ns","start_ns","bytes"}, on the listening socket handed over as fd 3
    /// (LISTEN_FDS) or on 127.0.0.1:$PORT. One thread per connection, no async runtime.
    #[command(hide = true)]
    FnEcho,
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
    /// contentInstances per second into a real ACME oneM2M CSE: a plain pipelined HTTP client
    /// (the CSE's maximum), then MQTT devices through sluice's oneM2M uplink; both and their
    /// ratio (needs `acmecse` on PATH).
    Onem2m(OneM2mArgs),
    /// Records per second into a real three-node Apache Kafka cluster (`scripts/kafka-cluster`,
    /// Java 17+ and Maven): Kafka's own `kafka-producer-perf-test` (the cluster's maximum), then
    /// MQTT devices through sluice's Kafka uplink; sluice's CPU per message and PUBACK p99.
    Kafka(KafkaArgs),
    /// A site of 1, 2, 3 … gateways (`sluice run` children, one shard each) behind one HAProxy
    /// in TCP mode, into a real three-node Kafka cluster: the same devices and load each
    /// time; msg/s, each gateway's CPU and the sum per message, HAProxy's CPU, PUBACK p99.
    /// Needs haproxy, Java 17+ and Maven.
    Site(cli::site::SiteArgs),
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
    /// What `[state] dir` costs: N devices x R msg/s, each QoS 1 message delivered to one
    /// subscribing device, with clean sessions and no state vs persistent sessions and
    /// `[state] dir` (sluice CPU per message, p50/p99); then the restart time after kill -9
    /// with --retained retained messages and --sessions persistent sessions. Prints Markdown;
    /// writes JSON to --out and Markdown to --markdown.
    State(StateArgs),
    /// CoAP sensors (closed loop, CoAPBench-like: each sends its next CON request when the
    /// previous response arrives) at N = 250..2000: through sluice's publish path to a TLS 1.3
    /// cloud Mosquitto, through libcoap's proxy and sluice's proxy to a CoAP-over-TCP
    /// coap-server-notls, and against a trivial in-process responder (the generator's floor).
    ///
    /// Reports per mode and N: requests/s, p50/p99, CPU µs/request of the process under test,
    /// timeouts and (publish) delivery at the cloud ÷ 2.04s; verdicts against issue 16's
    /// targets. Prints the Markdown report; writes JSON to --out and Markdown to --markdown.
    Coap(CoapArgs),
    /// The multipath-proxy paper's experiment (needs root: network namespaces): k = 1, 2, 3
    /// veth links of --rate each between a gateway and a cloud namespace; closed-loop CoAP
    /// sensors through sluice's CoAP proxy over an MPTCP coap+tcp:// upstream (one subflow per
    /// link from the kernel's path manager) to a CoAP-over-TCP server in the cloud namespace.
    ///
    /// Reports per k and N: requests/s (and ÷ k × one link), p50/p99, subflows, sluice CPU,
    /// beside the paper's 1,600 / 4,000 / 5,900 req/s; with --kill-link-at, failed requests and
    /// the longest stall after link 0 is cut. Writes JSON to --out and Markdown to --markdown.
    Multipath(MultipathArgs),
    /// Issue 18's control storm: a steady data load (PHD agents' confirmed scan reports and
    /// MQTT devices' QoS 1 publishes) through sluice (shards = 1 on core 0, control plane on
    /// core 1) while a storm of PHD control messages (AARQ, configuration, release of new and
    /// returning agents on short connections) steps through --levels msg/s.
    ///
    /// Runs once per --planes mode: association on the control plane (sluice's design) and on
    /// the shard thread (`[phd] single_plane = true`, an experiment switch). Reports per level:
    /// storm rate achieved (and sluice's own count), data offered and delivered at a cloud
    /// Mosquitto subscriber, PHD confirmation and MQTT end-to-end p50/p99, CPU per sluice
    /// thread, Mosquitto, this tool and the machine, with ratios to the no-storm level. First
    /// (unless --no-max) the maximum PHD scan reports/s delivered to the cloud, beside
    /// Mosquitto's own rate from plain publishers. Writes JSON to --out and Markdown to
    /// --markdown.
    ControlStorm(ControlStormArgs),
    /// Edge functions (issue 19): sluice in front of a local function it starts (a Python
    /// http.server echo and the compiled `fn-echo`), in parts: adaptor (sluice's CPU per event
    /// beside the function's at 1,000 events/s, and the same for `fn-floor`, a minimal
    /// MQTT → HTTP relay, as the floor), idle (silent devices, function scaled to zero:
    /// sluice's CPU and per-thread wake-ups), cold (publish → function p50/p99 for cold and
    /// warm instances, sluice's own part), predict (the shared synthetic traces through the
    /// real autoscaler with each pre-warm policy). Writes JSON to --out and Markdown to
    /// --markdown.
    Functions(FunctionsArgs),
    /// Issue 28's findings replayed by a hostile sender against a sluice binary (--sluice),
    /// one fresh sluice and cloud per case, while healthy MQTT devices publish through it.
    ///
    /// Per case: bytes the attacker sent vs bytes that came back to its addresses (at its
    /// sockets), sluice's RSS before/peak/after (from /proc), the healthy devices' PUBACK p99
    /// in a baseline phase vs during the attack (kept = ≤ 1.5× + 2 ms, none lost), what the
    /// case observed and a verdict against the target. Prints the Markdown report;
    /// writes JSON to --out and Markdown to --markdown (e.g. appended to docs/reliability.md).
    Hostile(HostileArgs),
    /// Issue 31's fault campaign against a sluice binary (--sluice): per case (kill -9, cloud
    /// broker stopped / slowed / blackholed, a flapping multipath link, the spool's disk full
    /// or read-only, clock steps, state across a restart, PINGRESP under back-pressure) under
    /// MQTT, CoAP and PHD load: messages acknowledged, at the cloud, duplicates, order
    /// violations, the longest stall, QoS 0 lost and acknowledged-but-missing, with a verdict.
    /// Needs root (network namespaces, mounts). JSON to --out, Markdown to --markdown.
    Faults(FaultsArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Floor(args) = &cli.command {
        return cli::tools::floor(args);
    }
    if let Command::FnFloor(args) = &cli.command {
        return cli::tools::fn_floor(args);
    }
    if let Command::RelayFloor(args) = &cli.command {
        return cli::tools::relay_floor(args);
    }
    if let Command::FnEcho = &cli.command {
        // Served before any runtime or logger: its start-up is part of what a cold start costs.
        return match sluice_bench::scenarios::functions::echo::serve() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice-bench fn-echo: {e:#}");
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
        Command::Devices(args) => cli::tools::devices(args).await,
        Command::Sink(args) => cli::tools::sink(args).await,
        Command::Scenario(ScenarioCommand::Core(args)) => cli::scenarios::core(args).await,
        Command::Scenario(ScenarioCommand::Seganet(args)) => cli::scenarios::seganet(args).await,
        Command::Agent(args) => cli::tools::agent(args).await,
        Command::Fastsink(args) => cli::tools::fastsink(args).await,
        Command::Idle(args) => cli::tools::idle(args).await,
        Command::Scenario(ScenarioCommand::Throughput(args)) => {
            cli::scenarios::throughput(args).await
        }
        Command::Scenario(ScenarioCommand::Connections(args)) => {
            cli::scenarios::connections(args).await
        }
        Command::Scenario(ScenarioCommand::Priority(args)) => cli::scenarios::priority(args).await,
        Command::Scenario(ScenarioCommand::Onem2m(args)) => cli::scenarios::onem2m(args).await,
        Command::Scenario(ScenarioCommand::Kafka(args)) => cli::scenarios::kafka(args).await,
        Command::Scenario(ScenarioCommand::Site(args)) => cli::site::site(args).await,
        Command::Scenario(ScenarioCommand::Outage(args)) => cli::scenarios::outage(args).await,
        Command::Scenario(ScenarioCommand::State(args)) => cli::state::state(args).await,
        Command::Scenario(ScenarioCommand::Coap(args)) => cli::coap::coap(args).await,
        Command::Scenario(ScenarioCommand::Multipath(args)) => {
            cli::multipath::multipath(args).await
        }
        Command::Scenario(ScenarioCommand::ControlStorm(args)) => {
            cli::control_storm::control_storm(args).await
        }
        Command::Storage(args) => cli::storage::storage(args).await,
        Command::Scenario(ScenarioCommand::Functions(args)) => {
            cli::functions::functions(args).await
        }
        Command::Scenario(ScenarioCommand::Hostile(args)) => cli::hostile::hostile(args).await,
        Command::Scenario(ScenarioCommand::Faults(args)) => cli::faults::faults(args).await,
        Command::Floor(_) | Command::FnFloor(_) | Command::RelayFloor(_) | Command::FnEcho => {
            unreachable!("served in main without a runtime")
        }
    }
}
