//! The `sluice` command: CLI, logging, config load, exit codes — nothing else.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// sluice — an IoT edge gateway: MQTT, CoAP and IEEE 11073 (PHD) devices in; a cloud MQTT
/// broker over TLS 1.3, oneM2M and edge functions out.
#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about,
    long_about = LONG_ABOUT,
    after_help = "Run `sluice help <command>` (or `sluice <command> --help`) for a command's options.",
    after_long_help = EXAMPLES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

const LONG_ABOUT: &str = "\
sluice — an IoT edge gateway.

Devices connect to it over MQTT 3.1.1/5 (plain, TLS, WebSocket), CoAP (UDP, DTLS) and IEEE
11073 (PHD); it answers them at once, keeps their messages in bounded queues and an optional
crash-safe spool, and forwards them to one or more uplinks: a cloud MQTT broker over TLS 1.3,
a oneM2M CSE, or edge functions. Its state is served over HTTP by the admin endpoint
(/metrics, /api/v1/status, /healthz, /readyz).

One TOML file configures it; every option, with its default, is in
/usr/share/doc/sluice/sluice.example.toml (config/sluice.example.toml in the source tree).
Validate a file with `sluice check` before (re)starting the service.";

const EXAMPLES: &str = "\
Examples:
  Validate a configuration and print it with every default filled in:
      sluice check -c /etc/sluice/sluice.toml

  Run in the foreground (logs to standard output; RUST_LOG or [log] level sets the level):
      sluice run -c /etc/sluice/sluice.toml

  Try it without a file: MQTT on 127.0.0.1:1883, CoAP on udp 127.0.0.1:5683, admin on
  127.0.0.1:9100, no uplink:
      sluice run
      mosquitto_pub -h 127.0.0.1 -t sensors/t1 -m 21.5
      curl -s http://127.0.0.1:9100/api/v1/status

  Hash a password for [[mqtt.users]]:
      printf '%s' 's3cret' | sluice passwd

  Look into a spool directory offline (read-only):
      sluice spool stat /var/lib/sluice/spool/cloud/shard-0

  As a service (Debian package): systemctl start sluice; after editing
  /etc/sluice/sluice.toml, `systemctl reload sluice` sends SIGHUP.

Exit status: 0 on success or after SIGTERM/SIGINT; 1 when a command fails or the gateway
cannot start; 2 when `sluice run`'s configuration is invalid.

Docs: docs/ in the source tree, /usr/share/doc/sluice in the package; `man sluice`.";

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (in the foreground; logs to standard output).
    ///
    /// Without -c, embedded defaults: MQTT devices on 127.0.0.1:1883, CoAP devices on udp
    /// 127.0.0.1:5683, admin on 127.0.0.1:9100, no uplink until one is configured.
    /// SIGTERM or SIGINT stops it gracefully; SIGHUP (or POST /api/v1/reload) re-reads the
    /// config file and applies what can change without closing device connections (filters,
    /// topic mapping, priorities, users, ACL, limits, log level, certificates); a bad file
    /// changes nothing; what needs a restart is logged (docs/reload.md). Started by systemd
    /// with Type=notify, it reports readiness (READY=1), reloads (RELOADING=1) and, with
    /// WatchdogSec, pings the watchdog while every gateway thread answers a liveness probe.
    #[command(after_help = "Example:\n    sluice run -c /etc/sluice/sluice.toml")]
    Run {
        /// Config file (TOML); see sluice.example.toml for every option.
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Validate a config file and print the effective configuration (defaults filled in).
    ///
    /// Exits 0 when valid, 1 when not; the reason names the key path (e.g.
    /// `uplink[0].ca_file`). Files the config names (certificates, keys, password files)
    /// are read, so run it as the user the service runs as.
    #[command(
        after_help = "Example:\n    sluice check -c /etc/sluice/sluice.toml && systemctl reload sluice"
    )]
    Check {
        /// Config file (TOML).
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Print an argon2id hash of a password read from standard input, for [[mqtt.users]].
    #[command(after_help = "Example:\n    printf '%s' 's3cret' | sluice passwd")]
    Passwd,
    /// Show a running gateway's devices, rates, uplinks, queue and spool, and drops, read
    /// from its admin endpoint (GET /api/v1/overview); with --devices, which gateway holds
    /// which device (GET /api/v1/devices). Give --admin once per gateway of a site to see
    /// them all. Exits 1 when a gateway cannot be reached.
    #[command(
        after_help = "Examples:\n    sluice status\n    sluice status --watch\n    sluice status --devices --admin http://gw1:9100 --admin http://gw2:9100"
    )]
    Status {
        /// An admin endpoint (admin.listen), as http://host:port, or https://host:port when
        /// admin.cert_file is set. Repeat it for several gateways (the same --ca-file and
        /// --token-file are used for each).
        #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:9100")]
        admin: Vec<String>,
        /// List the MQTT devices each gateway holds (client id, gateway, shard, time
        /// connected) instead of the overview.
        #[arg(long)]
        devices: bool,
        /// With https://: the CA (PEM) that signed admin.cert_file; default the system CA
        /// bundle. The certificate must name the URL's host (DNS name or IP address).
        #[arg(long, value_name = "FILE")]
        ca_file: Option<PathBuf>,
        /// File holding the bearer token (admin.token_file), when the endpoint has one.
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Redraw the table until interrupted, like `top`.
        #[arg(long)]
        watch: bool,
        /// Time between redraws with --watch (e.g. 1s, 500ms).
        #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
        interval: std::time::Duration,
    },
    /// Inspect a durable spool directory offline (read-only: never modifies it).
    #[command(
        after_help = "Example:\n    sluice spool verify /var/lib/sluice/spool/cloud/shard-0"
    )]
    Spool {
        #[command(subcommand)]
        action: SpoolAction,
    },
    /// Print the manual page (roff) to standard output: `sluice man | man -l -`.
    #[command(hide = true)]
    Man,
}

#[derive(Subcommand)]
enum SpoolAction {
    /// Sizes, segment count, ack cursor, oldest and newest record, quarantined bytes.
    Stat(SpoolArgs),
    /// Check every record's checksum; exits 1 when damaged ranges or a damaged cursor are found.
    Verify(SpoolArgs),
    /// Print every intact record (seq, length, body as escaped text) to standard output.
    Dump(SpoolArgs),
}

#[derive(clap::Args)]
struct SpoolArgs {
    /// The spool directory (one shard's).
    dir: PathBuf,
    /// Largest record the spool was written with; longer frames count as damage.
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES")]
    max_record: u32,
}

fn main() -> ExitCode {
    // First, before any thread starts: what systemd gave us for sd_notify (removed from the
    // environment, so spawned function instances do not inherit it).
    let manager = sluice::app::notify::from_env();
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => match sluice::config::load(Some(&config)) {
            Ok(mut cfg) => {
                // Print the effective value of a default that depends on other keys.
                cfg.mqtt.allow_anonymous = Some(cfg.mqtt.anonymous_allowed());
                cfg.coap.allow_anonymous = Some(cfg.coap.anonymous_allowed(&cfg.mqtt));
                for warning in cfg.warnings() {
                    eprintln!("{}: warning: {warning}", config.display());
                }
                print!("{}", cfg.to_toml());
                eprintln!("{}: valid", config.display());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("{}: {error}", config.display());
                ExitCode::FAILURE
            }
        },
        Command::Passwd => {
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).is_err() {
                eprintln!("cannot read a password from standard input");
                return ExitCode::FAILURE;
            }
            match sluice::control::admission::hash_password(
                line.trim_end_matches(['\r', '\n']).as_bytes(),
            ) {
                Ok(h) => {
                    println!("{h}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("cannot hash the password: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Run { config } => run(config, manager),
        Command::Status {
            admin,
            devices,
            ca_file,
            token_file,
            watch,
            interval,
        } => {
            let targets: Result<Vec<_>, _> = admin
                .iter()
                .map(|a| sluice::top::Target::new(a, token_file.as_deref(), ca_file.as_deref()))
                .collect();
            match targets {
                Ok(targets) => {
                    let show = if devices {
                        sluice::top::Show::Devices
                    } else {
                        sluice::top::Show::Overview
                    };
                    let code = sluice::top::run(&targets, show, watch.then_some(interval));
                    ExitCode::from(u8::try_from(code).unwrap_or(1))
                }
                Err(error) => {
                    eprintln!("sluice status: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Man => {
            let page = clap_mangen::Man::new(<Cli as clap::CommandFactory>::command());
            match page.render(&mut std::io::stdout().lock()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("sluice man: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Spool { action } => spool(action),
    }
}

fn spool(action: SpoolAction) -> ExitCode {
    let fail = |dir: &std::path::Path, error: &dyn std::fmt::Display| {
        eprintln!("sluice spool: {}: {error}", dir.display());
        ExitCode::FAILURE
    };
    match action {
        SpoolAction::Stat(a) => match sluice_spool::stat(&a.dir, a.max_record) {
            Ok(s) => {
                let seq = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                println!("dir            {}", a.dir.display());
                println!("segments       {} ({} bytes)", s.segments, s.segment_bytes);
                println!("ack cursor     {} ({:?})", seq(s.ack_cursor), s.cursor);
                println!("oldest seq     {}", seq(s.oldest_seq));
                println!("newest seq     {}", seq(s.newest_seq));
                println!(
                    "quarantine     {} files ({} bytes)",
                    s.quarantine_files, s.quarantine_bytes
                );
                ExitCode::SUCCESS
            }
            Err(error) => fail(&a.dir, &error),
        },
        SpoolAction::Verify(a) => match sluice_spool::verify(&a.dir, a.max_record) {
            Ok(r) => {
                println!(
                    "{}: {} segments, {} bytes, {} intact records, {} damaged ranges ({} bytes), cursor {:?}",
                    a.dir.display(),
                    r.segments,
                    r.bytes,
                    r.records,
                    r.damaged_ranges,
                    r.damaged_bytes,
                    r.cursor
                );
                for d in &r.damaged {
                    let last = d.seqs.last.map_or("?".to_string(), |l| l.to_string());
                    println!(
                        "damaged: {} at offset {}, {} bytes, seqs {}..={}",
                        d.file.display(),
                        d.offset,
                        d.bytes,
                        d.seqs.first,
                        last
                    );
                }
                if r.is_clean() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Err(error) => fail(&a.dir, &error),
        },
        SpoolAction::Dump(a) => {
            let out = std::io::BufWriter::new(std::io::stdout().lock());
            match sluice_spool::dump(&a.dir, a.max_record, out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => fail(&a.dir, &error),
            }
        }
    }
}

fn run(
    path: Option<PathBuf>,
    manager: Result<sluice::app::notify::ServiceManager, sluice::app::notify::NotifyError>,
) -> ExitCode {
    let config = match sluice::config::load(path.as_deref()) {
        Ok(c) => c,
        Err(error) => {
            eprintln!("sluice: config: {error}");
            return ExitCode::from(2);
        }
    };
    sluice::telemetry::init_logging(&config.log);
    for warning in config.warnings() {
        tracing::warn!(%warning, "config");
    }
    if config.uplink.is_empty() && config.function.is_empty() {
        tracing::warn!("no [[uplink]] configured: messages stay local until one is");
    } else if config.uplink.is_empty() {
        tracing::warn!(
            "no [[uplink]] configured: messages go to local subscribers and functions only"
        );
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(error) => {
            eprintln!("sluice: cannot build the signal runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    // Signal handlers first: from the first accepted device on, SIGHUP must not kill us.
    let signals = {
        let _runtime = rt.enter();
        Signals::install()
    };
    let mut signals = match signals {
        Ok(s) => s,
        Err(error) => {
            eprintln!("sluice: cannot install the signal handlers: {error}");
            return ExitCode::FAILURE;
        }
    };
    let manager = manager.unwrap_or_else(|error| {
        tracing::warn!(%error, "not notifying the service manager");
        Default::default()
    });
    let gateway = match sluice::app::Gateway::build(config)
        .and_then(|g| g.with_config_file(path.clone()).start())
    {
        Ok(g) => g,
        Err(error) => {
            tracing::error!(%error, "cannot start");
            eprintln!("sluice: {error}");
            return ExitCode::FAILURE;
        }
    };
    let notifier = manager.notifier.map(std::sync::Arc::new);
    // READY=1 before the first watchdog ping.
    let serving = format!("serving devices on {}", gateway.mqtt_addr);
    if let Some(n) = &notifier {
        n.ready(&serving);
    }
    let watchdog = match (&notifier, manager.watchdog) {
        (Some(notifier), Some(period)) => {
            match sluice::app::notify::Watchdog::start(notifier.clone(), gateway.liveness(), period)
            {
                Ok(w) => Some(w),
                Err(error) => {
                    tracing::error!(%error, "cannot start the watchdog thread; systemd will restart sluice after WatchdogSec");
                    None
                }
            }
        }
        _ => None,
    };
    let signal = rt.block_on(async {
        loop {
            tokio::select! {
                _ = signals.interrupt.recv() => break "SIGINT",
                _ = signals.terminate.recv() => break "SIGTERM",
                _ = signals.hangup.recv() => {
                    if let Some(n) = &notifier {
                        n.reloading();
                    }
                    gateway.reload(path.as_deref());
                    if let Some(n) = &notifier {
                        n.ready(&serving);
                    }
                }
            }
        }
    });
    tracing::info!(signal, "shutting down");
    if let Some(n) = &notifier {
        n.stopping();
    }
    // No pings while the threads stop (the probe would find them gone).
    drop(watchdog);
    gateway.shutdown();
    ExitCode::SUCCESS
}

/// The signals `sluice run` handles: SIGINT and SIGTERM stop it gracefully (devices and
/// uplinks are disconnected cleanly, spools closed); SIGHUP reloads the config file
/// (`RunningGateway::reload`) and never stops it.
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    /// Must run inside a tokio runtime context.
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }
}
