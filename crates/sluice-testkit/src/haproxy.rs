//! A real HAProxy (Debian's `haproxy` package) in TCP mode as a child process: one address in
//! front of several gateways, as a site of several sluice instances runs behind it
//! (docs/scale-out.md).
//!
//! Owns: one `haproxy -db -f <cfg>` process, its generated configuration and its temporary
//! directory. Does not own: the backends (the gateways the caller starts and kills).
//!
//! The configuration is what docs/scale-out.md recommends for MQTT devices: `mode tcp`,
//! `balance leastconn` (a gateway that comes back is filled first), health checks every
//! [`CHECK_INTERVAL`] marking a backend down after two failed checks, `on-marked-down
//! shutdown-sessions` (devices of a dead gateway are disconnected at once, so they reconnect
//! to a live one), and `option redispatch 1` with retries (a connection refused by a dead
//! backend is tried on another).
//!
//! `maxconn 8000`: each proxied connection holds two descriptors, and this machine allows a
//! process 20,000.
//!
//! Invariants: the process never outlives its [`Haproxy`] handle (Drop sends SIGKILL and reaps
//! it). Starting blocks the calling thread until the frontend port accepts, within
//! [`START_TIMEOUT`].

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use tempfile::TempDir;

use crate::ports::{free_port, wait_for_port_blocking};

/// How long [`Haproxy::start`] waits for the frontend to accept.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Time between two health checks of a backend.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// A running HAProxy in TCP mode.
#[derive(Debug)]
pub struct Haproxy {
    child: Child,
    /// The address devices connect to.
    pub addr: SocketAddr,
    dir: TempDir,
}

/// Where the `haproxy` binary is: `$PATH`, then `/usr/sbin` (Debian's place, often not on a
/// user's `PATH`).
pub fn haproxy_bin() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("PATH") {
        for d in std::env::split_paths(&path) {
            let p = d.join("haproxy");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let p = Path::new("/usr/sbin/haproxy");
    p.is_file().then(|| p.to_path_buf())
}

/// The configuration [`Haproxy::start`] writes: one TCP frontend on `listen`, one backend per
/// entry of `backends`.
pub fn config(listen: SocketAddr, backends: &[SocketAddr]) -> String {
    let ms = CHECK_INTERVAL.as_millis();
    let mut c = format!(
        "global\n    maxconn 8000\n\n\
defaults\n    mode tcp\n    timeout connect 1s\n    timeout client 10m\n    timeout server 10m\n    \
retries 3\n    option redispatch 1\n\n\
frontend devices\n    bind {listen}\n    default_backend gateways\n\n\
backend gateways\n    balance leastconn\n    \
default-server check inter {ms}ms fall 2 rise 2 on-marked-down shutdown-sessions\n"
    );
    for (i, b) in backends.iter().enumerate() {
        let _ = writeln!(c, "    server gw{i} {b}");
    }
    c
}

impl Haproxy {
    /// Start HAProxy in front of `backends` on a free loopback port. `Ok(None)` when the
    /// `haproxy` binary is not installed (the caller prints why it skips).
    pub fn start(backends: &[SocketAddr]) -> anyhow::Result<Option<Haproxy>> {
        let Some(bin) = haproxy_bin() else {
            return Ok(None);
        };
        let dir = tempfile::tempdir()?;
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let cfg = dir.path().join("haproxy.cfg");
        std::fs::write(&cfg, config(addr, backends))?;
        let log = std::fs::File::create(dir.path().join("haproxy.log"))?;
        let child = Command::new(&bin)
            .arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut h = Haproxy { child, addr, dir };
        if let Err(e) = wait_for_port_blocking(addr, START_TIMEOUT) {
            let _ = h.child.kill();
            bail!("haproxy did not listen on {addr} ({e}): {}", h.log());
        }
        Ok(Some(h))
    }

    /// The process id (for CPU accounting).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("haproxy.log")).unwrap_or_default()
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_lists_every_backend_with_checks() {
        let a: SocketAddr = "127.0.0.1:1883".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:1884".parse().unwrap();
        let l: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let c = config(l, &[a, b]);
        assert!(c.contains("bind 127.0.0.1:9000"), "{c}");
        assert!(c.contains("server gw0 127.0.0.1:1883"), "{c}");
        assert!(c.contains("server gw1 127.0.0.1:1884"), "{c}");
        assert!(c.contains("on-marked-down shutdown-sessions"), "{c}");
        assert!(c.contains("mode tcp"), "{c}");
    }
}
