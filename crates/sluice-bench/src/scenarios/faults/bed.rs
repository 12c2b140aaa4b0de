//! The bed of one fault case: a gateway and a cloud network namespace (`sluice_testkit::netns`,
//! one or two veth links), the cloud Mosquitto in the cloud namespace, sluice as a child
//! process in the gateway namespace that can be killed, stopped and restarted on the same
//! config and spool, and the cloud recorder ([`super::ledger::Recorder`], in the cloud
//! namespace so link faults never touch it).
//!
//! Owns: those processes and the namespaces (dropping the bed removes all of them), the
//! generated sluice config, sluice's `/metrics` reads. Does not own: the load (see
//! [`super::load`]) or what a case does to the bed.
//!
//! Threads: the whole case runs on a tokio runtime built on a thread that entered the gateway
//! namespace ([`run_in_gateway`]), so every socket of the devices and every child started from
//! it (sluice) is in that namespace; sluice listens on its own 127.0.0.1 there. The cloud
//! broker listens on the cloud's service address 10.77.0.1 (TLS 1.3, the run's PKI; sluice
//! verifies it as `localhost`) and, for the recorder only, on a plain port of the cloud
//! namespace's loopback. The broker keeps a persistence file (`autosave_interval 1`): the
//! recorder's session (clean session off) and what is queued for it survive a restart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use sluice_testkit::netns::{BedOptions, TestBed};
use sluice_testkit::{Mosquitto, TestPki};
use tokio::time::{sleep, Instant};

/// Ports inside the gateway namespace (isolated: fixed ports are safe).
pub const MQTT_PORT: u16 = 1883;
pub const COAP_PORT: u16 = 5683;
pub const PHD_PORT: u16 = 6024;
pub const ADMIN_PORT: u16 = 9100;
/// The recorder's plain port on the cloud namespace's loopback.
pub const RECORDER_PORT: u16 = 1884;
/// libfaketime, as installed by Debian's `faketime` package.
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// What a case needs of its bed beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct BedSpec {
    /// Veth links between the namespaces (1, or 2 for multipath).
    pub links: usize,
    /// The `[spool]` table's `dir` (None: no spool, devices are acknowledged after the cloud).
    pub spool_dir: Option<PathBuf>,
    /// Lines added to `[[uplink]]` (before its aggregate table).
    pub uplink_extra: String,
    /// Lines added to `[gateway]`.
    pub gateway_extra: String,
    /// Lines added to `[mqtt]`.
    pub mqtt_extra: String,
    /// Tables appended at the end of the config.
    pub tail: String,
    /// sluice runs under libfaketime reading its offset from this file.
    pub faketime_file: Option<PathBuf>,
}

/// One case's namespaces and processes.
pub struct Bed {
    pub net: Arc<TestBed>,
    pub pki: Arc<TestPki>,
    pub cloud: Arc<Mutex<Mosquitto>>,
    pub sluice: SluiceProc,
    pub dir: tempfile::TempDir,
}

impl Bed {
    pub fn mqtt(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], MQTT_PORT))
    }
    pub fn coap(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], COAP_PORT))
    }
    pub fn phd(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], PHD_PORT))
    }

    /// Run blocking `f` on a thread in the cloud namespace.
    pub async fn in_cloud<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> anyhow::Result<T> {
        let net = self.net.clone();
        tokio::task::spawn_blocking(move || net.cloud.run(f))
            .await
            .map_err(|e| anyhow!("a cloud-namespace task failed: {e}"))
    }

    /// SIGTERM the cloud broker (it writes its persistence file) and reap it.
    pub async fn stop_cloud(&self) -> anyhow::Result<()> {
        let cloud = self.cloud.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let mut c = cloud.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(pid) = c.pid() {
                let _ = Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status();
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while std::path::Path::new(&format!("/proc/{pid}/stat")).exists()
                    && !is_zombie(pid)
                    && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            c.kill()
        })
        .await
        .map_err(|e| anyhow!("stopping the cloud panicked: {e}"))?
    }

    /// Start the cloud broker again on its ports (from the cloud namespace).
    pub async fn start_cloud(&self) -> anyhow::Result<()> {
        let cloud = self.cloud.clone();
        self.in_cloud(move || cloud.lock().unwrap_or_else(|p| p.into_inner()).restart())
            .await?
    }

    /// sluice's `/metrics` text ("" when unreachable).
    pub async fn metrics(&self) -> String {
        crate::harness::metrics::http_get(ADMIN_PORT, "/metrics")
            .await
            .unwrap_or_default()
    }

    /// Uplink sessions (shard × lane × path) sluice reports as connected now.
    pub async fn uplinks_connected(&self) -> u32 {
        connected_sessions(&self.metrics().await)
    }

    /// Wait until at least `n` uplink sessions are connected; how long it took.
    pub async fn wait_uplinks(&self, n: u32, limit: Duration) -> anyhow::Result<Duration> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if self.uplinks_connected().await >= n {
                return Ok(t.elapsed());
            }
            sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "sluice's uplink did not connect within {limit:?}; stderr:\n{}",
            self.sluice.stderr_tail()
        )
    }
}

/// `sluice_uplink_state{…,state="connected"} 1` samples in a `/metrics` text.
pub fn connected_sessions(text: &str) -> u32 {
    text.lines()
        .filter(|l| l.starts_with("sluice_uplink_state{") && l.contains("state=\"connected\""))
        .filter(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(1.0))
        .count() as u32
}

/// Run `f` (the whole case) on a new tokio runtime on a thread inside `net`'s gateway namespace.
pub fn run_in_gateway<T: Send + 'static>(
    net: &TestBed,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>> + Send + 'static,
) -> anyhow::Result<T> {
    net.gw.run(move || -> anyhow::Result<T> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("building the case's runtime")?;
        Ok(rt.block_on(f()))
    })
}

/// The namespaces (root needed).
pub fn make_net(links: usize) -> anyhow::Result<TestBed> {
    sluice_testkit::netns::available().map_err(|e| anyhow!("network namespaces: {e}"))?;
    TestBed::new(BedOptions {
        links,
        ..BedOptions::default()
    })
    .map_err(|e| anyhow!("building the namespaces: {e}"))
}

/// Start the cloud broker in the cloud namespace and sluice in the gateway namespace (call from
/// the gateway thread). Waits until sluice's uplink is connected.
pub async fn start_bed(
    net: Arc<TestBed>,
    sluice_bin: &Path,
    spec: &BedSpec,
) -> anyhow::Result<Bed> {
    let dir = tempfile::Builder::new()
        .prefix("sluice-faults-")
        .tempdir_in(crate::harness::disk::default_dir())
        .context("creating the case directory")?;
    let persistence = dir.path().join("cloud-db");
    std::fs::create_dir_all(&persistence).context("the cloud's persistence directory")?;
    let pki = Arc::new(
        tokio::task::spawn_blocking(TestPki::try_generate)
            .await
            .context("PKI generation panicked")??,
    );
    let service = net.cloud_addr();
    let cloud = {
        let pki = pki.clone();
        let persistence = persistence.clone();
        let net2 = net.clone();
        tokio::task::spawn_blocking(move || {
            let cloud_ns = net2.cloud.name.clone();
            net2.cloud.run(move || {
                Mosquitto::builder()
                    .tls(&pki)
                    .plain_listener(false)
                    .bind_address(service.into())
                    .launcher(["ip", "netns", "exec", cloud_ns.as_str()])
                    .config_lines([
                        format!("listener {RECORDER_PORT} 127.0.0.1"),
                        "persistence true".to_string(),
                        format!("persistence_location {}/", persistence.display()),
                        "autosave_interval 1".to_string(),
                    ])
                    .start()
            })
        })
        .await
        .context("cloud start-up panicked")?
        .context("starting the cloud Mosquitto")?
    };
    let toml = sluice_config(
        spec,
        &format!("{service}:{}", cloud.tls_port()),
        pki.ca_path(),
    );
    let config_path = dir.path().join("sluice.toml");
    std::fs::write(&config_path, &toml).context("writing the sluice config")?;
    let mut sluice = SluiceProc {
        bin: sluice_bin.to_path_buf(),
        config: config_path,
        config_text: toml,
        stderr_path: dir.path().join("sluice.stderr"),
        faketime_file: spec.faketime_file.clone(),
        child: None,
        starts: 0,
    };
    sluice.start()?;
    sluice.wait_ready().await?;
    let bed = Bed {
        net,
        pki,
        cloud: Arc::new(Mutex::new(cloud)),
        sluice,
        dir,
    };
    bed.wait_uplinks(1, Duration::from_secs(20)).await?;
    Ok(bed)
}

fn sluice_config(spec: &BedSpec, cloud: &str, ca: &Path) -> String {
    let spool = match &spec.spool_dir {
        Some(d) => format!(
            "[spool]\ndir = \"{}\"\nack = \"spool\"\nfsync = \"interval\"\nfsync_interval = \"10ms\"\nsegment_size = \"2MiB\"\nmax_size = \"16MiB\"\n\n",
            d.display()
        ),
        None => String::new(),
    };
    format!(
        "# generated by sluice-bench scenario faults\n\
         [gateway]\nshards = 2\npin_threads = false\n{gateway_extra}\n\
         [mqtt]\nlisten = \"127.0.0.1:{MQTT_PORT}\"\n{mqtt_extra}\n\
         [coap]\nenabled = true\nlisten = \"127.0.0.1:{COAP_PORT}\"\n\n\
         [phd]\nlisten = \"127.0.0.1:{PHD_PORT}\"\n\n\
         [admin]\nenabled = true\nlisten = \"127.0.0.1:{ADMIN_PORT}\"\n\n\
         [log]\nlevel = \"warn\"\n\n{spool}\
         [[uplink]]\nname = \"cloud\"\nurl = \"mqtts://{cloud}\"\nca_file = \"{ca}\"\n\
         server_name = \"localhost\"\nclient_id = \"sluice-gw\"\nforward = [\"#\"]\n\
         keep_alive = \"5s\"\nreconnect_min = \"100ms\"\nreconnect_max = \"1s\"\n{uplink_extra}\n\
         [uplink.aggregate]\nenabled = false\n{tail}",
        gateway_extra = spec.gateway_extra,
        mqtt_extra = spec.mqtt_extra,
        ca = ca.display(),
        uplink_extra = spec.uplink_extra,
        tail = spec.tail,
    )
}

/// sluice as a child process on a fixed config; start, kill -9, stop and start again.
pub struct SluiceProc {
    pub bin: PathBuf,
    pub config: PathBuf,
    pub config_text: String,
    pub stderr_path: PathBuf,
    pub faketime_file: Option<PathBuf>,
    child: Option<Child>,
    /// Processes started so far.
    pub starts: u32,
}

impl SluiceProc {
    pub fn start(&mut self) -> anyhow::Result<()> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_path)
            .context("sluice's stderr file")?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("run")
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if let Some(file) = &self.faketime_file {
            cmd.env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME_TIMESTAMP_FILE", file)
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                .env("FAKETIME_NO_CACHE", "1");
        }
        self.child = Some(
            cmd.spawn()
                .with_context(|| format!("spawning {}", self.bin.display()))?,
        );
        self.starts += 1;
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL and reap.
    pub fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, wait up to 10 s (then SIGKILL); whether it exited by itself.
    pub async fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Wait until the device port accepts connections; fail if sluice exited.
    pub async fn wait_ready(&mut self) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let addr = SocketAddr::from(([127, 0, 0, 1], MQTT_PORT));
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(t.elapsed());
            }
            if !self.running() {
                bail!("sluice exited; stderr:\n{}", self.stderr_tail());
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!(
                    "sluice did not accept connections within 20 s; stderr:\n{}",
                    self.stderr_tail()
                );
            }
            sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Lines of sluice's stderr containing `needle`.
    pub fn stderr_count(&self, needle: &str) -> usize {
        std::fs::read_to_string(&self.stderr_path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}

impl Drop for SluiceProc {
    fn drop(&mut self) {
        self.kill_9();
    }
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
