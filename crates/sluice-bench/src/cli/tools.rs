//! The single tools: `devices`, `sink`, `fastsink`, `floor`, `fn-floor`, `relay-floor`, and the hidden
//! `agent` and `idle` that scenarios start as child processes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use sluice_bench::conn::{host_part, resolve};
use sluice_bench::harness::agents::{run_agent, AgentConfig};
use sluice_bench::load::devices::{run_devices, DevicesConfig};
use sluice_bench::sinks::sink::{start_sink, SinkConfig, SinkTls};

use super::{arrivals, emit_json, parse_share, progress, qos, LoadArgs, MqttVersion};

#[derive(Args)]
pub(crate) struct DevicesArgs {
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
    /// MQTT over TLS 1.3 (rustls): trust only the CA certificates in this PEM file. The
    /// target is then the broker's or gateway's TLS listener.
    #[arg(long, value_name = "CA_FILE")]
    device_tls: Option<PathBuf>,
    /// Name the server certificate is verified for (default: the host part of --target).
    #[arg(long, requires = "device_tls")]
    tls_server_name: Option<String>,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct SinkArgs {
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
pub(crate) struct AgentArgs {
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
pub(crate) struct FloorArgs {
    /// Plain-TCP MQTT address to listen on (port 0: any free port, printed on stdout).
    #[arg(long, default_value = "127.0.0.1:1883", value_name = "HOST:PORT")]
    listen: SocketAddr,
    /// The I/O interface: `epoll` (readiness, one read and one write per ready device) or
    /// `uring` (io_uring completions: one `io_uring_enter` per loop turn carrying many
    /// devices' receives and PUBACK writes; needs Linux ≥ 5.19; ADR 0016).
    #[arg(long, value_enum, default_value = "epoll")]
    io: FloorIo,
}

/// `floor --io`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum FloorIo {
    Epoll,
    Uring,
}

#[derive(Args)]
pub(crate) struct FnFloorArgs {
    /// Plain-TCP MQTT address to listen on (port 0: any free port, printed on stdout).
    #[arg(long, default_value = "127.0.0.1:1883", value_name = "HOST:PORT")]
    listen: SocketAddr,
    /// The function's HTTP address (each event is POSTed to / there).
    #[arg(long, value_name = "HOST:PORT")]
    function: SocketAddr,
    /// Keep-alive connections to the function, one request in flight on each.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Events waiting for a free connection before a device's PUBLISH is refused (its
    /// connection closed).
    #[arg(long, default_value_t = 4096)]
    max_waiting: usize,
}

#[derive(Args)]
pub(crate) struct RelayFloorArgs {
    /// Plain-TCP MQTT address to listen on for devices (port 0: any free port, printed on
    /// stdout).
    #[arg(long, default_value = "127.0.0.1:1883", value_name = "HOST:PORT")]
    listen: SocketAddr,
    /// The cloud broker: mqtts://HOST[:PORT] (TLS 1.3 only; port 8883 if none). The
    /// certificate is verified against HOST (an IP address: the certificate's IP SANs).
    #[arg(long, value_name = "URL", value_parser = parse_mqtts_url)]
    cloud: (String, u16),
    /// CA certificate(s), PEM, that signed the cloud's certificate (no system roots).
    #[arg(long, value_name = "FILE")]
    ca_file: PathBuf,
    /// MQTT client id of the cloud session (MQTT 3.1.1, clean session).
    #[arg(long, default_value = "relay-floor")]
    client_id: String,
    /// Messages awaiting the cloud's PUBACK, at most (1 to 65535, the packet id space); a
    /// device PUBLISH that finds the window full closes its device.
    #[arg(long, default_value_t = 65535)]
    max_inflight: usize,
}

/// `--cloud mqtts://HOST[:PORT]` → (HOST, PORT).
fn parse_mqtts_url(url: &str) -> Result<(String, u16), String> {
    let rest = url
        .strip_prefix("mqtts://")
        .ok_or("expected mqtts://HOST[:PORT] (the relay floor speaks TLS only)")?;
    let rest = rest.trim_end_matches('/');
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && !port.contains(']') => (
            host,
            port.parse::<u16>()
                .map_err(|_| format!("{port:?} is not a port number"))?,
        ),
        _ => (rest, 8883),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err("no host in the URL".to_string());
    }
    Ok((host.to_string(), port))
}

#[derive(Args)]
pub(crate) struct FastsinkArgs {
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
pub(crate) struct IdleArgs {
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

pub(crate) async fn devices(args: DevicesArgs) -> anyhow::Result<()> {
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
    if let Some(ca) = &args.device_tls {
        let name = args
            .tls_server_name
            .clone()
            .unwrap_or_else(|| sluice_bench::conn::host_part(&args.target).to_string());
        config.tls = Some(sluice_bench::load::devices::DeviceTls::from_ca_file(
            ca, &name,
        )?);
    }
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

pub(crate) async fn sink(args: SinkArgs) -> anyhow::Result<()> {
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
pub(crate) fn read_sent_file(path: &PathBuf) -> anyhow::Result<u64> {
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

pub(crate) async fn agent(args: AgentArgs) -> anyhow::Result<()> {
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

pub(crate) async fn fastsink(args: FastsinkArgs) -> anyhow::Result<()> {
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

pub(crate) async fn idle(args: IdleArgs) -> anyhow::Result<()> {
    use sluice_bench::harness::limits::raise_fd_limit;
    use sluice_bench::load::idle::{run_idle_worker, IdleConfig};
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

/// `floor`: a plain epoll (or io_uring) loop on this thread, no runtime, so nothing but the
/// floor's own work.
pub(crate) fn floor(args: &FloorArgs) -> ExitCode {
    let served = match args.io {
        FloorIo::Epoll => sluice_bench::sinks::floor::run_floor(args.listen, print_listening),
        FloorIo::Uring => {
            sluice_bench::sinks::floor_uring::run_floor_uring(args.listen, print_listening)
        }
    };
    exit_code("floor", args.listen, served)
}

/// `fn-floor`: the adaptor floor, like `floor` on this thread with no runtime.
pub(crate) fn fn_floor(args: &FnFloorArgs) -> ExitCode {
    use sluice_bench::sinks::adaptor_floor::{run_adaptor_floor, AdaptorFloor};
    let cfg = AdaptorFloor {
        listen: args.listen,
        function: args.function,
        connections: args.connections,
        max_waiting: args.max_waiting,
    };
    exit_code(
        "fn-floor",
        args.listen,
        run_adaptor_floor(cfg, print_listening),
    )
}

/// `relay-floor`: the relay floor, like `floor` on this thread with no runtime.
pub(crate) fn relay_floor(args: &RelayFloorArgs) -> ExitCode {
    use sluice_bench::sinks::relay_floor::{run_relay_floor, RelayFloor};
    use std::net::ToSocketAddrs as _;
    let (host, port) = &args.cloud;
    let cloud = match (host.as_str(), *port)
        .to_socket_addrs()
        .map(|mut a| a.next())
    {
        Ok(Some(addr)) => addr,
        Ok(None) | Err(_) => {
            eprintln!("sluice-bench relay-floor: cannot resolve the cloud host {host:?}");
            return ExitCode::FAILURE;
        }
    };
    let mut cfg = RelayFloor::new(args.listen, cloud, args.ca_file.clone());
    cfg.server_name = host.clone();
    cfg.client_id = args.client_id.clone();
    cfg.max_inflight = args.max_inflight;
    exit_code(
        "relay-floor",
        args.listen,
        run_relay_floor(&cfg, print_listening),
    )
}

/// The line a parent reads to learn the bound address.
fn print_listening(addr: SocketAddr) {
    println!("listening on {addr}");
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

fn exit_code(command: &str, listen: SocketAddr, served: std::io::Result<()>) -> ExitCode {
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice-bench {command}: {listen}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_mqtts_url;

    #[test]
    fn the_cloud_url_gives_host_and_port_and_only_mqtts_is_taken() {
        let ok = |url: &str| parse_mqtts_url(url).unwrap();
        assert_eq!(ok("mqtts://127.0.0.1:18883"), ("127.0.0.1".into(), 18883));
        assert_eq!(ok("mqtts://cloud.example"), ("cloud.example".into(), 8883));
        assert_eq!(ok("mqtts://[::1]:9000/"), ("::1".into(), 9000));
        assert_eq!(ok("mqtts://[::1]"), ("::1".into(), 8883));
        assert!(parse_mqtts_url("mqtt://127.0.0.1:1883").is_err());
        assert!(parse_mqtts_url("mqtts://host:port").is_err());
        assert!(parse_mqtts_url("mqtts://").is_err());
    }
}
