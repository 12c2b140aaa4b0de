//! `sluice run` as a child process, for the tests that kill it (`kill -9`) or run several.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a started sluice may take to accept device connections.
pub const START_MAX: Duration = Duration::from_secs(15);

/// The sluice child process; dropping it kills it (also when the test panics).
pub struct SluiceProcess {
    config: PathBuf,
    stderr_path: PathBuf,
    child: Option<Child>,
    /// SIGKILLs so far.
    pub kills: u32,
}

impl SluiceProcess {
    pub fn new(config: &Path, dir: &Path) -> SluiceProcess {
        SluiceProcess {
            config: config.to_path_buf(),
            stderr_path: dir.join("sluice.stderr"),
            child: None,
            kills: 0,
        }
    }

    pub fn start(&mut self) {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_path)
            .expect("open sluice's stderr file");
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("run")
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn sluice");
        self.child = Some(child);
    }

    /// SIGKILL and reap.
    pub fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL sluice");
            child.wait().expect("reap sluice");
            self.kills += 1;
        }
    }

    /// Wait until the device port accepts connections; fail if sluice exited.
    pub async fn wait_accepting(&mut self, addr: SocketAddr) {
        let deadline = Instant::now() + START_MAX;
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return;
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "sluice exited ({status}) after {} kills; stderr:\n{}",
                        self.kills,
                        self.stderr_tail()
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "sluice did not accept connections within {START_MAX:?} after {} kills; stderr:\n{}",
                self.kills,
                self.stderr_tail()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for SluiceProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
