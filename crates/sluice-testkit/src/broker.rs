//! A real Mosquitto 2.x broker as a child process, for tests and benchmarks that need a
//! "cloud" (or a reference edge broker) that is not sluice.
//!
//! Owns: one `mosquitto -c <conf>` process, its generated configuration, its log and its
//! temporary directory. Does not own: certificates (copied from a [`TestPki`] into the broker's
//! own directory so the broker survives the PKI being dropped) or clients.
//!
//! Generated configuration, in this order (Mosquitto binds listener options to the preceding
//! `listener` and bridge options to the preceding `connection`, so order matters):
//! ```text
//! per_listener_settings false
//! allow_anonymous true
//! persistence false
//! log_dest file <dir>/mosquitto.log
//! log_type error|warning|notice|information   (+ debug/subscribe/… with `log_all`)
//! connection_messages true
//! max_inflight_messages 0          # unlimited (MQTT 5 clients see receive-maximum 65535)
//! max_queued_messages <n>          # default 1 000 000
//! set_tcp_nodelay true
//! user root                        # only when running as root: keeps mosquitto from switching
//!                                  # to the `mosquitto` user, which could not read our temp dir
//! listener <plain_port> 127.0.0.1  # if enabled
//! listener <tls_port> 127.0.0.1    # if enabled
//! cafile/certfile/keyfile <dir>/…
//! tls_version tlsv1.3
//! require_certificate true|false
//! <extra lines, verbatim>          # e.g. a bridge from `Mosquitto::bridge_config_lines`
//! ```
//!
//! Invariants: the process never outlives its [`Mosquitto`] handle (Drop sends SIGKILL and
//! reaps it); ports are fixed at the first successful start and reused by [`Mosquitto::restart`];
//! the log file is appended to across restarts. Starting blocks the calling thread for up to
//! [`START_TIMEOUT`] while polling the ports — acceptable in tests, never done per message.

use std::fmt::Write as _;
use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use tempfile::TempDir;

use crate::certs::TestPki;
use crate::ports::free_port;

/// How long [`MosquittoBuilder::start`] and [`Mosquitto::restart`] wait for the ports to open.
pub const START_TIMEOUT: Duration = Duration::from_secs(5);
/// How many times a start is retried when a port turns out to be taken.
const BIND_ATTEMPTS: u32 = 5;
/// Environment variable that overrides where the `mosquitto` binary is looked for.
pub const MOSQUITTO_BIN_ENV: &str = "SLUICE_MOSQUITTO";
/// Lines of log shown in errors.
const LOG_TAIL_LINES: usize = 30;

/// Builder for a [`Mosquitto`]. By default: a plain listener only, anonymous access allowed.
#[derive(Debug, Clone)]
pub struct MosquittoBuilder {
    plain_listener: bool,
    tls: Option<TlsFiles>,
    require_client_cert: bool,
    max_queued_messages: u32,
    log_all: bool,
    extra_lines: Vec<String>,
    bind: std::net::IpAddr,
    launcher: Vec<String>,
}

#[derive(Debug, Clone)]
struct TlsFiles {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Default for MosquittoBuilder {
    fn default() -> Self {
        MosquittoBuilder {
            plain_listener: true,
            tls: None,
            require_client_cert: false,
            max_queued_messages: 1_000_000,
            log_all: false,
            extra_lines: Vec::new(),
            bind: std::net::IpAddr::from([127, 0, 0, 1]),
            launcher: Vec::new(),
        }
    }
}

impl MosquittoBuilder {
    /// Listen on `addr` instead of 127.0.0.1 (e.g. a test namespace's service address).
    pub fn bind_address(mut self, addr: std::net::IpAddr) -> Self {
        self.bind = addr;
        self
    }

    /// Start the broker through a launcher, e.g. `["mptcpize", "run"]` (MPTCP sockets).
    pub fn launcher<I: IntoIterator<Item = S>, S: Into<String>>(mut self, argv: I) -> Self {
        self.launcher = argv.into_iter().map(Into::into).collect();
        self
    }

    /// Add a TLS 1.3-only listener using the PKI's CA, server certificate and key. The files
    /// are copied when the broker starts, so `pki` may be dropped afterwards.
    pub fn tls(mut self, pki: &TestPki) -> Self {
        self.tls = Some(TlsFiles {
            ca: pki.ca_path().to_path_buf(),
            cert: pki.server_cert_path().to_path_buf(),
            key: pki.server_key_path().to_path_buf(),
        });
        self
    }
    /// Make the TLS listener require a client certificate signed by the CA
    /// (`require_certificate true`). No effect without [`MosquittoBuilder::tls`].
    pub fn require_client_cert(mut self, require: bool) -> Self {
        self.require_client_cert = require;
        self
    }
    /// Enable or disable the plain-TCP listener (enabled by default).
    pub fn plain_listener(mut self, enabled: bool) -> Self {
        self.plain_listener = enabled;
        self
    }
    /// Per-client queue bound (`max_queued_messages`); 0 means unlimited. Default 1 000 000.
    pub fn max_queued_messages(mut self, messages: u32) -> Self {
        self.max_queued_messages = messages;
        self
    }
    /// Log every event type (`log_type all`), including each PUBLISH — slow, for debugging.
    pub fn log_all(mut self, all: bool) -> Self {
        self.log_all = all;
        self
    }
    /// Append one configuration line verbatim, after the listeners.
    pub fn config_line(mut self, line: impl Into<String>) -> Self {
        self.extra_lines.push(line.into());
        self
    }
    /// Append configuration lines verbatim, after the listeners.
    pub fn config_lines<I, S>(mut self, lines: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_lines.extend(lines.into_iter().map(Into::into));
        self
    }

    /// Write the configuration, launch mosquitto and wait until every listener accepts TCP
    /// connections. Blocks the calling thread for up to [`START_TIMEOUT`] per attempt.
    pub fn start(self) -> anyhow::Result<Mosquitto> {
        if !self.plain_listener && self.tls.is_none() {
            bail!("Mosquitto needs at least one listener: enable the plain listener or add TLS");
        }
        let binary = find_mosquitto()?;
        let dir = tempfile::Builder::new()
            .prefix("sluice-testkit-mosquitto-")
            .tempdir()
            .context("creating the broker's temporary directory")?;
        let tls_files = match &self.tls {
            Some(files) => Some(copy_tls_files(files, dir.path())?),
            None => None,
        };
        let mut broker = Mosquitto {
            binary,
            bind: self.bind,
            launcher: self.launcher.clone(),
            conf_path: dir.path().join("mosquitto.conf"),
            log_path: dir.path().join("mosquitto.log"),
            stderr_path: dir.path().join("mosquitto.stderr"),
            plain_port: None,
            tls_port: None,
            child: None,
            dir,
        };
        let mut last_error = None;
        for _attempt in 0..BIND_ATTEMPTS {
            broker.plain_port = if self.plain_listener {
                Some(free_port()?)
            } else {
                None
            };
            broker.tls_port = if tls_files.is_some() {
                Some(free_port()?)
            } else {
                None
            };
            let conf = self.render(&broker, tls_files.as_ref());
            fs::write(&broker.conf_path, conf)
                .with_context(|| format!("writing {}", broker.conf_path.display()))?;
            match broker.launch() {
                Ok(()) => return Ok(broker),
                Err(LaunchError::AddressInUse(e)) => last_error = Some(e),
                Err(LaunchError::Other(e)) => return Err(e),
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("no start attempt was made"))).context(format!(
            "mosquitto could not bind free ports in {BIND_ATTEMPTS} attempts"
        ))
    }

    fn render(&self, broker: &Mosquitto, tls_files: Option<&TlsFiles>) -> String {
        let mut conf = String::new();
        // `write!` into a String cannot fail; the results are ignored for that reason.
        let _ = writeln!(conf, "# generated by sluice-testkit");
        let _ = writeln!(conf, "per_listener_settings false");
        let _ = writeln!(conf, "allow_anonymous true");
        let _ = writeln!(conf, "persistence false");
        let _ = writeln!(conf, "log_dest file {}", broker.log_path.display());
        if self.log_all {
            let _ = writeln!(conf, "log_type all");
        } else {
            for t in ["error", "warning", "notice", "information"] {
                let _ = writeln!(conf, "log_type {t}");
            }
        }
        let _ = writeln!(conf, "connection_messages true");
        let _ = writeln!(conf, "max_inflight_messages 0");
        let _ = writeln!(conf, "max_queued_messages {}", self.max_queued_messages);
        let _ = writeln!(conf, "set_tcp_nodelay true");
        if running_as_root(broker.dir.path()) {
            let _ = writeln!(conf, "user root");
        }
        if let Some(port) = broker.plain_port {
            let _ = writeln!(conf, "\nlistener {port} {}", self.bind);
        }
        if let (Some(port), Some(files)) = (broker.tls_port, tls_files) {
            let _ = writeln!(conf, "\nlistener {port} {}", self.bind);
            let _ = writeln!(conf, "cafile {}", files.ca.display());
            let _ = writeln!(conf, "certfile {}", files.cert.display());
            let _ = writeln!(conf, "keyfile {}", files.key.display());
            let _ = writeln!(conf, "tls_version tlsv1.3");
            let _ = writeln!(conf, "require_certificate {}", self.require_client_cert);
        }
        if !self.extra_lines.is_empty() {
            let _ = writeln!(conf);
            for line in &self.extra_lines {
                let _ = writeln!(conf, "{line}");
            }
        }
        conf
    }
}

/// A running (or killed, restartable) Mosquitto process. Dropping it kills the process.
#[derive(Debug)]
pub struct Mosquitto {
    binary: PathBuf,
    bind: std::net::IpAddr,
    launcher: Vec<String>,
    conf_path: PathBuf,
    log_path: PathBuf,
    stderr_path: PathBuf,
    plain_port: Option<u16>,
    tls_port: Option<u16>,
    child: Option<Child>,
    // Last field: dropped after the process is killed in `Drop`.
    dir: TempDir,
}

enum LaunchError {
    AddressInUse(anyhow::Error),
    Other(anyhow::Error),
}

impl Mosquitto {
    /// Start configuring a broker.
    pub fn builder() -> MosquittoBuilder {
        MosquittoBuilder::default()
    }

    /// Configuration lines that make this broker an MQTT 3.1.1 bridge forwarding every topic
    /// (`topic # out 1`) over TLS 1.3 to a broker on `127.0.0.1:<cloud_tls_port>` whose
    /// certificate is signed by `pki`'s CA. The bridge presents `pki`'s client certificate if
    /// asked, uses a persistent remote session (`cleansession false`, so QoS 1 messages are
    /// queued while the cloud is away) and retries every second. The lines reference `pki`'s
    /// files, so `pki` must outlive the broker. Pass them to [`MosquittoBuilder::config_lines`].
    pub fn bridge_config_lines(cloud_tls_port: u16, pki: &TestPki) -> Vec<String> {
        vec![
            "connection sluice-bench-cloud".to_string(),
            format!("address 127.0.0.1:{cloud_tls_port}"),
            "topic # out 1".to_string(),
            "bridge_protocol_version mqttv311".to_string(),
            format!("bridge_cafile {}", pki.ca_path().display()),
            format!("bridge_certfile {}", pki.client_cert_path().display()),
            format!("bridge_keyfile {}", pki.client_key_path().display()),
            "bridge_tls_version tlsv1.3".to_string(),
            "bridge_insecure false".to_string(),
            "remote_clientid sluice-edge-bridge".to_string(),
            "cleansession false".to_string(),
            "try_private false".to_string(),
            "notifications false".to_string(),
            "restart_timeout 1".to_string(),
            "start_type automatic".to_string(),
        ]
    }

    /// Port of the TLS 1.3 listener.
    ///
    /// # Panics
    /// If the broker was built without [`MosquittoBuilder::tls`] (a bug in the test).
    pub fn tls_port(&self) -> u16 {
        match self.tls_port {
            Some(port) => port,
            None => panic!("this Mosquitto has no TLS listener; build it with .tls(&pki)"),
        }
    }
    /// Port of the plain-TCP listener.
    ///
    /// # Panics
    /// If the plain listener was disabled with `plain_listener(false)` (a bug in the test).
    pub fn plain_port(&self) -> u16 {
        match self.plain_port {
            Some(port) => port,
            None => panic!("this Mosquitto has no plain listener; it was disabled"),
        }
    }
    /// `127.0.0.1:<tls_port>`; panics like [`Mosquitto::tls_port`].
    pub fn tls_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.tls_port())
    }
    /// `127.0.0.1:<plain_port>`; panics like [`Mosquitto::plain_port`].
    pub fn plain_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.plain_port())
    }
    /// Process id while running, `None` after [`Mosquitto::kill`].
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
    /// Whether the process is still alive (it may have exited on its own).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }
    /// The generated configuration file.
    pub fn config_path(&self) -> &Path {
        &self.conf_path
    }
    /// The broker's log file (appended to across restarts).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }
    /// Everything logged so far (empty if nothing was logged yet).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }
    /// The last `lines` lines of the log and of mosquitto's stderr.
    pub fn log_tail(&self, lines: usize) -> String {
        let mut out = tail(&self.log(), lines);
        let stderr = fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let stderr = stderr.trim();
        if !stderr.is_empty() {
            out.push_str("\n--- stderr ---\n");
            out.push_str(&tail(stderr, lines));
        }
        out
    }

    /// Wait (blocking, polling every 20 ms) until a log line contains `needle`, e.g.
    /// `"Connecting bridge"` on an edge or `"sluice-edge-bridge"` on the cloud.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "mosquitto did not log {needle:?} within {timeout:?}; log tail:\n{}",
            self.log_tail(LOG_TAIL_LINES)
        )
    }

    /// Async variant of [`Mosquitto::wait_for_log`] that does not block the runtime.
    pub async fn wait_for_log_async(&self, needle: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bail!(
            "mosquitto did not log {needle:?} within {timeout:?}; log tail:\n{}",
            self.log_tail(LOG_TAIL_LINES)
        )
    }

    /// SIGKILL the broker and reap it. Open connections see a reset or EOF; with persistence
    /// off, all sessions and queued messages are lost. No-op if already killed.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            // `kill` fails only if the process was already reaped, which `take` rules out;
            // if it already exited on its own, `wait` below still reaps it.
            let _ = child.kill();
            child
                .wait()
                .context("reaping the killed mosquitto process")?;
        }
        Ok(())
    }

    /// Kill the broker if it is running, then start it again with the same configuration on
    /// the same ports. Retries for a while if a port is momentarily still taken.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill()?;
        let mut last_error = None;
        for _attempt in 0..BIND_ATTEMPTS {
            match self.launch() {
                Ok(()) => return Ok(()),
                Err(LaunchError::AddressInUse(e)) => {
                    last_error = Some(e);
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(LaunchError::Other(e)) => return Err(e),
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("no restart attempt was made")))
            .context("restarting mosquitto on its previous ports failed: a port is taken")
    }

    fn ports(&self) -> Vec<u16> {
        self.plain_port.into_iter().chain(self.tls_port).collect()
    }

    /// Spawn the process and wait for every port; on failure the process is killed.
    fn launch(&mut self) -> Result<(), LaunchError> {
        let stderr = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_path)
            .with_context(|| format!("opening {}", self.stderr_path.display()))
            .map_err(LaunchError::Other)?;
        let log_len_before = fs::metadata(&self.log_path).map(|m| m.len()).unwrap_or(0);
        let mut cmd = match self.launcher.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        let child = cmd
            .arg("-c")
            .arg(&self.conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("spawning {}", self.binary.display()))
            .map_err(LaunchError::Other)?;
        self.child = Some(child);

        let deadline = Instant::now() + START_TIMEOUT;
        let mut pending = self.ports();
        loop {
            pending.retain(|&port| {
                let addr = SocketAddr::new(self.bind, port);
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err()
            });
            if pending.is_empty() {
                return Ok(());
            }
            let exited = match self.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                Some(Ok(None)) => None,
                Some(Err(e)) => Some(format!("unknown status ({e})")),
                None => Some("not running".to_string()),
            };
            if let Some(status) = exited {
                self.child = None;
                let new_log = self.log_since(log_len_before);
                let stderr = fs::read_to_string(&self.stderr_path).unwrap_or_default();
                let error = anyhow!(
                    "mosquitto exited during start-up ({status}); config {}; log tail:\n{}",
                    self.conf_path.display(),
                    self.log_tail(LOG_TAIL_LINES)
                );
                if new_log.contains("Address already in use")
                    || stderr.contains("Address already in use")
                {
                    return Err(LaunchError::AddressInUse(error));
                }
                return Err(LaunchError::Other(error));
            }
            if Instant::now() >= deadline {
                let _ = self.kill();
                return Err(LaunchError::Other(anyhow!(
                    "mosquitto did not open ports {pending:?} within {START_TIMEOUT:?}; log tail:\n{}",
                    self.log_tail(LOG_TAIL_LINES)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_since(&self, offset: u64) -> String {
        let log = self.log();
        let offset = usize::try_from(offset).unwrap_or(usize::MAX);
        log.get(offset..).unwrap_or("").to_string()
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        // Errors cannot be reported from Drop; the process is gone or was never started.
        let _ = self.kill();
    }
}

/// Locate the mosquitto binary: `$SLUICE_MOSQUITTO`, the Debian locations, then `$PATH`.
pub fn find_mosquitto() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(MOSQUITTO_BIN_ENV) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        bail!(
            "${MOSQUITTO_BIN_ENV} points to {}, which is not a file",
            path.display()
        );
    }
    let mut candidates = vec![
        PathBuf::from("/usr/sbin/mosquitto"),
        PathBuf::from("/usr/local/sbin/mosquitto"),
    ];
    if let Some(path_var) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path_var).map(|dir| dir.join("mosquitto")));
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        anyhow!(
            "mosquitto broker not found in /usr/sbin, /usr/local/sbin or $PATH; install it with \
             `apt-get install mosquitto mosquitto-clients` or set ${MOSQUITTO_BIN_ENV}"
        )
    })
}

fn copy_tls_files(files: &TlsFiles, dir: &Path) -> anyhow::Result<TlsFiles> {
    let copy = |from: &Path, name: &str| -> anyhow::Result<PathBuf> {
        let to = dir.join(name);
        fs::copy(from, &to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        Ok(to)
    };
    Ok(TlsFiles {
        ca: copy(&files.ca, "ca.pem")?,
        cert: copy(&files.cert, "server.pem")?,
        key: copy(&files.key, "server.key")?,
    })
}

/// Whether this process runs as root, judged by the owner of a directory it just created
/// (avoids `unsafe` libc calls).
fn running_as_root(fresh_dir: &Path) -> bool {
    fs::metadata(fresh_dir)
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
