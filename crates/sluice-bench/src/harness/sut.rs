//! The systems under test as processes: sluice (generated config, child process), an edge
//! Mosquitto bridging to the cloud, the kernel floor and the relay floor; starting one waits
//! until its uplink is connected, dropping it stops it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use sluice_testkit::{Mosquitto, TestPki};
use tokio::time::{sleep, Instant};

/// What the systems under test are started with.
#[derive(Debug, Clone)]
pub struct SutSpec {
    pub sluice_bin: PathBuf,
    /// The `sluice-bench` executable that serves `floor`.
    pub floor_bin: PathBuf,
    /// `[gateway] shards` for sluice (0 = one per core but one, at least one).
    pub sluice_shards: u32,
    /// `[uplink.aggregate]` for sluice.
    pub sluice_aggregate: AggregateOpts,
    /// Devices expected (sizes sluice's `max_connections`).
    pub devices: u32,
    /// Devices speak MQTT over TLS 1.3: sluice gets `[mqtt.tls]` (listen, cert_file, key_file:
    /// the run's server certificate) and the edge Mosquitto a TLS 1.3 listener with the same
    /// certificate; [`RunningSut::device_addr`] is then that TLS listener. The floor has none.
    pub device_tls: bool,
    /// TOML appended to sluice's generated config (`--sluice-extra`: e.g. `[acl]` rules for
    /// the ACL cost run); `None`: nothing.
    pub sluice_extra: Option<String>,
}

/// The systems that can be put under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sut {
    /// The sluice gateway binary.
    Sluice,
    /// An edge Mosquitto bridging `topic # out 1` to the cloud over TLS 1.3.
    MosquittoBridge,
    /// `sluice-bench floor`: answers every PUBLISH at once and forwards nothing, so its CPU is
    /// the kernel's cost of the device connections alone (see [`crate::sinks::floor`]).
    Floor,
    /// `sluice-bench floor --io uring`: the same floor over io_uring completions (see
    /// [`crate::sinks::floor_uring`], ADR 0016).
    FloorUring,
    /// `sluice-bench relay-floor`: forwards every PUBLISH over one TLS 1.3 session to the
    /// cloud and acknowledges after the cloud, with nothing else (see
    /// [`crate::sinks::relay_floor`]): the floor under any forwarder's CPU.
    RelayFloor,
}

impl Sut {
    pub fn name(self) -> &'static str {
        match self {
            Sut::Sluice => "sluice",
            Sut::MosquittoBridge => "mosquitto-bridge",
            Sut::Floor => "floor",
            Sut::FloorUring => "floor-uring",
            Sut::RelayFloor => "relay-floor",
        }
    }

    /// A floor (epoll or io_uring): answers the devices and forwards nothing.
    pub fn is_floor(self) -> bool {
        matches!(self, Sut::Floor | Sut::FloorUring)
    }

    /// Served by a `sluice-bench` child process (the floors and the relay floor).
    pub fn runs_bench_bin(self) -> bool {
        matches!(self, Sut::Floor | Sut::FloorUring | Sut::RelayFloor)
    }
}

/// sluice's SenML aggregation settings for a run (`[uplink.aggregate]`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AggregateOpts {
    pub enabled: bool,
    /// Aggregate while more than this many devices are connected.
    pub min_devices: usize,
    /// "json" or "cbor".
    pub format: String,
    /// A size with unit, e.g. "1KiB".
    pub max_pack: String,
    /// A duration with unit, e.g. "1s".
    pub max_delay: String,
    /// `flush` ("idle", "window", "max_delay"; `None`: not written, sluice's default;
    /// binaries before the key existed reject it).
    pub flush: Option<String>,
}

impl Default for AggregateOpts {
    /// Aggregation on, with sluice's pack settings (50 devices, JSON, 1 KiB, 1 s). sluice
    /// itself has aggregation off unless configured; the scenarios write the whole table into
    /// their configs, so they run as they were measured (on unless `--aggregate off`).
    fn default() -> Self {
        AggregateOpts {
            enabled: true,
            min_devices: 50,
            format: "json".to_string(),
            max_pack: "1KiB".to_string(),
            max_delay: "1s".to_string(),
            flush: None,
        }
    }
}

impl AggregateOpts {
    /// Aggregation off: every message on its own topic.
    pub fn off() -> AggregateOpts {
        AggregateOpts {
            enabled: false,
            ..AggregateOpts::default()
        }
    }

    /// The `[uplink.aggregate]` table (must come after the uplink's plain keys).
    pub fn toml(&self) -> String {
        let mut t = format!(
            "\n[uplink.aggregate]\nenabled = {}\nmin_devices = {}\nformat = \"{}\"\nmax_pack = \"{}\"\nmax_delay = \"{}\"\n",
            self.enabled, self.min_devices, self.format, self.max_pack, self.max_delay
        );
        if let Some(f) = &self.flush {
            t.push_str(&format!("flush = \"{f}\"\n"));
        }
        t
    }

    /// One line for reports.
    pub fn describe(&self) -> String {
        if self.enabled {
            let ack = match &self.flush {
                Some(f) => format!(", flush {f}"),
                None => String::new(),
            };
            format!(
                "SenML aggregation on above {} devices ({}, packs up to {}, at most {} wait{ack})",
                self.min_devices, self.format, self.max_pack, self.max_delay
            )
        } else {
            "aggregation off (one PUBLISH per message)".to_string()
        }
    }
}

/// A started system under test; stopping it is dropping it.
pub struct RunningSut {
    pub pid: u32,
    pub device_addr: std::net::SocketAddr,
    pub config_text: String,
    _process: SutProcess,
}

/// Held only to be dropped: dropping stops the process.
enum SutProcess {
    Sluice { _child: SluiceChild },
    Bridge { _edge: Mosquitto },
    Floor { _child: FloorChild },
}

/// Start `kind` against `cloud` and wait until its uplink is connected (also used by `seganet`).
pub async fn start_sut(
    kind: Sut,
    config: &SutSpec,
    pki: &TestPki,
    cloud: &Mosquitto,
) -> anyhow::Result<RunningSut> {
    match kind {
        Sut::Sluice => {
            let mut child = SluiceChild::start(config, pki, cloud.tls_port())?;
            child.wait_ready().await?;
            if let Some(tls) = child.device_tls_addr {
                // Ready = the plain port accepts; from now on the devices use the TLS one.
                child.device_addr = tls;
                child.wait_ready().await?;
            }
            let device_addr = child.device_addr;
            child.wait_uplink(cloud).await?;
            Ok(RunningSut {
                pid: child.pid(),
                device_addr,
                config_text: child.config_text.clone(),
                _process: SutProcess::Sluice { _child: child },
            })
        }
        Sut::MosquittoBridge => {
            let (edge, config_text) =
                start_bridge_with(cloud.tls_port(), pki, config.device_tls).await?;
            cloud
                .wait_for_log_async("sluice-edge-bridge", Duration::from_secs(15))
                .await
                .context("the edge bridge never connected to the cloud")?;
            sleep(Duration::from_secs(1)).await;
            let pid = edge
                .pid()
                .ok_or_else(|| anyhow!("the edge Mosquitto is not running"))?;
            Ok(RunningSut {
                pid,
                device_addr: if config.device_tls {
                    edge.tls_addr()
                } else {
                    edge.plain_addr()
                },
                config_text,
                _process: SutProcess::Bridge { _edge: edge },
            })
        }
        Sut::Floor | Sut::FloorUring => {
            if config.device_tls {
                bail!("the floor has no TLS listener: leave it out of a --device-tls run");
            }
            let bin = config.floor_bin.clone();
            let io = if kind == Sut::FloorUring {
                "uring"
            } else {
                "epoll"
            };
            let args = ["floor", "--listen", "127.0.0.1:0", "--io", io].map(String::from);
            let child = tokio::task::spawn_blocking(move || FloorChild::start(&bin, &args))
                .await
                .context("floor start-up panicked")??;
            Ok(RunningSut {
                pid: child.child.id(),
                device_addr: child.addr,
                config_text: format!(
                    "{} floor --listen {} --io {io}",
                    config.floor_bin.display(),
                    child.addr
                ),
                _process: SutProcess::Floor { _child: child },
            })
        }
        Sut::RelayFloor => {
            if config.device_tls {
                bail!("the relay floor has no TLS device listener: leave it out of a --device-tls run");
            }
            let bin = config.floor_bin.clone();
            let args = [
                "relay-floor".to_string(),
                "--listen".to_string(),
                "127.0.0.1:0".to_string(),
                "--cloud".to_string(),
                format!("mqtts://127.0.0.1:{}", cloud.tls_port()),
                "--ca-file".to_string(),
                pki.ca_path().display().to_string(),
            ];
            let command = format!("{} {}", bin.display(), args.join(" "));
            // It prints its address only once the cloud's CONNACK arrived.
            let child = tokio::task::spawn_blocking(move || FloorChild::start(&bin, &args))
                .await
                .context("relay floor start-up panicked")??;
            Ok(RunningSut {
                pid: child.child.id(),
                device_addr: child.addr,
                config_text: command.replace("127.0.0.1:0", &child.addr.to_string()),
                _process: SutProcess::Floor { _child: child },
            })
        }
    }
}

/// Fail unless `sluice_bin` is a file, saying how to build it.
pub fn require_sluice_bin(sluice_bin: &Path) -> anyhow::Result<()> {
    if !sluice_bin.is_file() {
        bail!(
            "sluice binary {} not found: build it with `cargo build --release -p sluice` or pass --sluice-bin",
            sluice_bin.display()
        );
    }
    Ok(())
}

/// An edge Mosquitto bridging `topic # out 1` to the cloud's TLS port (started on a blocking
/// thread), and its config text.
pub async fn start_bridge(
    cloud_tls_port: u16,
    pki: &TestPki,
) -> anyhow::Result<(Mosquitto, String)> {
    start_bridge_with(cloud_tls_port, pki, false).await
}

/// [`start_bridge`], with `device_tls` also a TLS 1.3 listener for the devices (the run's
/// server certificate, no client certificate required) beside the plain one.
pub async fn start_bridge_with(
    cloud_tls_port: u16,
    pki: &TestPki,
    device_tls: bool,
) -> anyhow::Result<(Mosquitto, String)> {
    let lines = Mosquitto::bridge_config_lines(cloud_tls_port, pki);
    let mut config_text = lines.join("\n");
    let mut builder = Mosquitto::builder();
    if device_tls {
        builder = builder.tls(pki);
        config_text.push_str(
            "\n# plus a TLS 1.3 device listener (cafile/certfile/keyfile of the run's PKI)",
        );
    }
    let edge = tokio::task::spawn_blocking(move || builder.config_lines(lines).start())
        .await
        .context("edge start-up panicked")?
        .context("starting the edge Mosquitto bridge")?;
    Ok((edge, config_text))
}

/// A `sluice-bench` server command (`floor`, `fn-floor`) as a child process that prints
/// "listening on HOST:PORT" once it serves; dropping it kills it.
pub struct FloorChild {
    child: Child,
    addr: std::net::SocketAddr,
}

impl FloorChild {
    /// Run `bin args…` and wait for its address line (blocking).
    pub fn start(bin: &Path, args: &[String]) -> anyhow::Result<FloorChild> {
        let what = format!("{} {}", bin.display(), args.join(" "));
        let mut child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
            .with_context(|| format!("reading the address of {what}"))?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok());
        match addr {
            Some(addr) => Ok(FloorChild { child, addr }),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{what} did not start (it printed {line:?})")
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The address it listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for FloorChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// sluice as a child process with a generated config in its own temporary directory. Dropping
/// it sends SIGTERM, waits up to 5 s, then SIGKILLs.
pub struct SluiceChild {
    child: Child,
    device_addr: std::net::SocketAddr,
    /// The `[mqtt.tls]` listener, when the config has one (see [`SutSpec::device_tls`]).
    device_tls_addr: Option<std::net::SocketAddr>,
    config_text: String,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl SluiceChild {
    fn start(config: &SutSpec, pki: &TestPki, cloud_tls_port: u16) -> anyhow::Result<SluiceChild> {
        let mqtt_port = sluice_testkit::free_port()?;
        let admin_port = sluice_testkit::free_port()?;
        let mut toml = sluice_config(config, mqtt_port, admin_port, cloud_tls_port, pki.ca_path());
        let tls_port = if config.device_tls {
            let port = sluice_testkit::free_port()?;
            let table = format!(
                "\n[mqtt.tls]\nlisten = \"127.0.0.1:{port}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n\n[coap]",
                toml_path(pki.server_cert_path()),
                toml_path(pki.server_key_path())
            );
            toml = toml.replacen("\n[coap]", &table, 1);
            Some(port)
        } else {
            None
        };
        if let Some(extra) = &config.sluice_extra {
            toml.push('\n');
            toml.push_str(extra);
        }
        let mut child = SluiceChild::spawn(&config.sluice_bin, mqtt_port, toml)?;
        child.device_tls_addr = tls_port.map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)));
        Ok(child)
    }

    /// Start `sluice run -c <config>` with the given config text, whose device listener is
    /// 127.0.0.1:`mqtt_port` (also used by the `throughput` and `connections` scenarios).
    pub fn spawn(sluice_bin: &Path, mqtt_port: u16, toml: String) -> anyhow::Result<SluiceChild> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-bench-")
            .tempdir()
            .context("creating a temporary directory")?;
        let config_path = dir.path().join("sluice.toml");
        std::fs::write(&config_path, &toml).context("writing the sluice config")?;
        let stderr_path = dir.path().join("sluice.stderr");
        let stderr =
            std::fs::File::create(&stderr_path).context("creating sluice's stderr file")?;
        let child = Command::new(sluice_bin)
            .arg("run")
            .arg("-c")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("spawning {}", sluice_bin.display()))?;
        Ok(SluiceChild {
            child,
            device_addr: std::net::SocketAddr::from(([127, 0, 0, 1], mqtt_port)),
            device_tls_addr: None,
            config_text: toml,
            stderr_path,
            _dir: dir,
        })
    }

    /// The device listener.
    pub fn device_addr(&self) -> std::net::SocketAddr {
        self.device_addr
    }

    /// The config file it runs with.
    pub fn config_text(&self) -> &str {
        &self.config_text
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Wait until the cloud broker logs sluice's uplink client (`sluice-gw…`), then 1 s more.
    pub async fn wait_uplink(&self, cloud: &Mosquitto) -> anyhow::Result<()> {
        cloud
            .wait_for_log_async("as sluice-gw", Duration::from_secs(15))
            .await
            .with_context(|| {
                format!(
                    "sluice's uplink never connected to the cloud; sluice stderr:\n{}",
                    self.stderr_tail()
                )
            })?;
        sleep(Duration::from_secs(1)).await;
        Ok(())
    }

    /// Wait until the device port accepts connections, failing early if sluice exits.
    pub async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if tokio::net::TcpStream::connect(self.device_addr)
                .await
                .is_ok()
            {
                return Ok(());
            }
            if !Path::new(&format!("/proc/{}", self.pid())).exists() || is_zombie(self.pid()) {
                bail!(
                    "sluice exited during start-up; stderr:\n{}",
                    self.stderr_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "sluice did not open {} within 15 s; stderr:\n{}",
                    self.device_addr,
                    self.stderr_tail()
                );
            }
            sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A path as a TOML basic string's content.
fn toml_path(path: &Path) -> String {
    path.display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s.get(i + 1..))
                .map(|rest| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

impl Drop for SluiceChild {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The generated sluice configuration: device listener, admin endpoint, one TLS 1.3 uplink
/// forwarding everything to the cloud broker.
pub fn sluice_config(
    config: &SutSpec,
    mqtt_port: u16,
    admin_port: u16,
    cloud_tls_port: u16,
    ca_file: &Path,
) -> String {
    let max_connections = (u64::from(config.devices) + 1024).max(10_000);
    format!(
        "# generated by sluice-bench scenario core\n\
         [gateway]\nshards = {shards}\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = {max_connections}\nmax_sessions = {max_connections}\n\n\
         [coap]\nenabled = false\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n\n\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://127.0.0.1:{cloud_tls_port}\"\nca_file = \"{ca}\"\n\
         client_id = \"sluice-gw\"\nforward = [\"#\"]\n{aggregate}",
        shards = config.sluice_shards,
        ca = ca_file.display().to_string().replace('\\', "\\\\").replace('"', "\\\""),
        aggregate = config.sluice_aggregate.toml(),
    )
}
