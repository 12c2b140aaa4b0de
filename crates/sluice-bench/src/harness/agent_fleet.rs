//! The one-process-per-device agents as a system under test: N `sluice-bench agent` processes
//! (see [`crate::harness::agents`]), each on its own port with its own TLS session to the cloud,
//! started together and waited for (ready files); dropping the fleet kills and reaps every one.

use crate::harness::cgroup::CpuCage;
use crate::harness::procfs::per_process_pss_kib;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use sluice_testkit::{Mosquitto, TestPki};
use tokio::time::{sleep, Instant};

/// N agent processes; dropping the fleet kills (SIGKILL) and reaps every one.
pub(crate) struct AgentFleet {
    pub(crate) children: Vec<Child>,
    pub(crate) addrs: Vec<SocketAddr>,
    pub(crate) command_line: String,
    pub(crate) _dir: tempfile::TempDir,
}

impl AgentFleet {
    pub(crate) async fn start(
        agent_bin: &Path,
        pin_core: Option<u32>,
        n: u32,
        client_prefix: &str,
        pki: &TestPki,
        cloud: &Mosquitto,
        cage: Option<&CpuCage>,
    ) -> anyhow::Result<AgentFleet> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-bench-agents-")
            .tempdir()
            .context("creating the agents' directory")?;
        let log_path = dir.path().join("agents.stderr");
        let log = std::fs::File::create(&log_path).context("creating the agents' log")?;
        let agent_bin = agent_bin.to_path_buf();
        let ca = pki.ca_path().to_path_buf();
        let cloud_addr = cloud.tls_addr();
        let ready_dir = dir.path().to_path_buf();
        let pin = pin_core;
        let prefix = client_prefix.to_string();
        let parent = std::process::id();
        let command_line = format!(
            "{}{} agent --listen 127.0.0.1:0 --cloud {cloud_addr} --ca CA.pem --server-name 127.0.0.1 \
             --client-id {prefix}-I --ready-file DIR/I.ready --parent-pid {parent}",
            pin.map(|c| format!("taskset -c {c} ")).unwrap_or_default(),
            agent_bin.display(),
        );
        let spawned = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<Child>> {
            let mut children = Vec::with_capacity(n as usize);
            for i in 0..n {
                let mut cmd = match pin {
                    Some(core) => {
                        let mut c = Command::new("taskset");
                        c.arg("-c").arg(core.to_string()).arg(&agent_bin);
                        c
                    }
                    None => Command::new(&agent_bin),
                };
                cmd.arg("agent")
                    .arg("--listen")
                    .arg("127.0.0.1:0")
                    .arg("--cloud")
                    .arg(cloud_addr.to_string())
                    .arg("--ca")
                    .arg(&ca)
                    .arg("--server-name")
                    .arg("127.0.0.1")
                    .arg("--client-id")
                    .arg(format!("{prefix}-{i}"))
                    .arg("--ready-file")
                    .arg(ready_dir.join(format!("{i}.ready")))
                    .arg("--parent-pid")
                    .arg(parent.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(log.try_clone().context("sharing the agents' log")?);
                match cmd.spawn() {
                    Ok(child) => children.push(child),
                    Err(e) => {
                        kill_all(&mut children);
                        return Err(anyhow!(e).context(format!("spawning agent {i} of {n}")));
                    }
                }
            }
            Ok(children)
        })
        .await
        .map_err(|e| anyhow!("spawning agents panicked: {e}"))??;
        let mut fleet = AgentFleet {
            children: spawned,
            addrs: Vec::new(),
            command_line,
            _dir: dir,
        };
        if let Some(cage) = cage {
            cage.confine(&fleet.pids(), false)?;
        }
        fleet.wait_ready(n, &log_path).await?;
        Ok(fleet)
    }

    pub(crate) fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// Wait until every agent wrote its ready file (listening, cloud session up).
    pub(crate) async fn wait_ready(&mut self, n: u32, log_path: &Path) -> anyhow::Result<()> {
        let dir = self._dir.path().to_path_buf();
        let limit = Duration::from_secs(20) + Duration::from_millis(10) * n;
        let deadline = Instant::now() + limit;
        let mut last_liveness = Instant::now();
        loop {
            let ready = count_ready(&dir);
            if ready >= n as usize {
                break;
            }
            if last_liveness.elapsed() >= Duration::from_secs(1) {
                last_liveness = Instant::now();
                for (i, child) in self.children.iter_mut().enumerate() {
                    if let Ok(Some(status)) = child.try_wait() {
                        bail!(
                            "agent {i} exited during start-up ({status}); agents' stderr:\n{}",
                            tail(log_path, 20)
                        );
                    }
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "only {ready} of {n} agents were ready after {limit:?}; agents' stderr:\n{}",
                    tail(log_path, 20)
                );
            }
            sleep(Duration::from_millis(100)).await;
        }
        let mut addrs = Vec::with_capacity(n as usize);
        for i in 0..n {
            let path = dir.join(format!("{i}.ready"));
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            addrs.push(
                text.trim()
                    .parse()
                    .with_context(|| format!("{} holds no address", path.display()))?,
            );
        }
        self.addrs = addrs;
        Ok(())
    }
}

impl Drop for AgentFleet {
    fn drop(&mut self) {
        kill_all(&mut self.children);
    }
}

pub(crate) fn kill_all(children: &mut [Child]) {
    for child in children.iter_mut() {
        let _ = child.kill();
    }
    for child in children.iter_mut() {
        let _ = child.wait();
    }
}

pub(crate) fn count_ready(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".ready"))
                .count()
        })
        .unwrap_or(0)
}

pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Start [`PROBE_AGENTS`] agents, read their PSS, stop them: KiB per agent (PSS + kernel).
pub(crate) async fn probe_agent_footprint(
    agent_bin: &Path,
    pki: &TestPki,
    cloud: &Mosquitto,
) -> anyhow::Result<u64> {
    let fleet = AgentFleet::start(
        agent_bin,
        None,
        PROBE_AGENTS,
        "sluice-agent-probe",
        pki,
        cloud,
        None,
    )
    .await?;
    sleep(Duration::from_millis(300)).await;
    let per = per_process_pss_kib(&fleet.pids())
        .ok_or_else(|| anyhow!("could not read the probe agents' PSS"))?;
    drop(fleet);
    Ok(per + KERNEL_KIB_PER_AGENT)
}

/// Agents started to measure the per-agent footprint when no earlier point measured it.
pub const PROBE_AGENTS: u32 = 8;
/// Kernel memory per process not visible in PSS (task, stacks, page tables, sockets), KiB.
pub const KERNEL_KIB_PER_AGENT: u64 = 256;
