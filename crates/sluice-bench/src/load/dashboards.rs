//! Open dashboards: what N browsers showing sluice's dashboard cost the gateway.
//!
//! Owns: one task per dashboard that loads the page the way a browser does (`GET /` with
//! `Accept: text/html`, `/app.js`, `/style.css`, `/api/v1/history`), then holds
//! `GET /api/v1/events` open and reads every server-sent event, counting events and bytes; and
//! reading one thread's CPU time (`/proc/<pid>/task/<tid>/stat`, found by its name) so a
//! scenario can report the admin thread's own share. Does not own: when they run (the
//! scenario opens them before its steady-state window and drops them after).
//!
//! The JavaScript's work happens in the browser, not in sluice, so a stream reader is what the
//! gateway sees of a dashboard.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Counters every dashboard task adds to.
#[derive(Debug, Default)]
pub struct DashboardCounters {
    /// Server-sent events received (one per gateway tick per dashboard).
    pub events: AtomicU64,
    /// Bytes received on the event streams.
    pub stream_bytes: AtomicU64,
    /// Bytes of the page loads (assets and history).
    pub page_bytes: AtomicU64,
    /// Streams that ended or failed.
    pub stream_ends: AtomicU64,
}

/// Open dashboards; dropping this closes them.
pub struct Dashboards {
    pub counters: Arc<DashboardCounters>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Dashboards {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The admin endpoint's `listen` from a generated sluice config (its `[admin]` table).
pub fn admin_addr_from_config(config_text: &str) -> anyhow::Result<SocketAddr> {
    let admin = config_text
        .split("\n[admin]")
        .nth(1)
        .ok_or_else(|| anyhow!("the sluice config has no [admin] table"))?;
    let line = admin
        .lines()
        .take_while(|l| !l.starts_with('['))
        .find(|l| l.trim_start().starts_with("listen"))
        .ok_or_else(|| anyhow!("[admin] has no listen"))?;
    let value = line
        .split('"')
        .nth(1)
        .ok_or_else(|| anyhow!("[admin] listen is not a string: {line}"))?;
    value
        .parse()
        .with_context(|| format!("[admin] listen {value:?}"))
}

/// One whole `GET` (Connection: close): the body's length.
async fn get(addr: SocketAddr, path: &str, accept: &str) -> anyhow::Result<usize> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw)).await??;
    if !raw.starts_with(b"HTTP/1.1 200") {
        bail!(
            "GET {path}: {}",
            String::from_utf8_lossy(&raw[..raw.len().min(80)])
        );
    }
    Ok(raw.len())
}

async fn dashboard(addr: SocketAddr, counters: Arc<DashboardCounters>) -> anyhow::Result<()> {
    for (path, accept) in [
        ("/", "text/html"),
        ("/app.js", "*/*"),
        ("/style.css", "text/css"),
        ("/api/v1/history", "application/json"),
    ] {
        let n = get(addr, path, accept).await?;
        counters.page_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    let mut s = TcpStream::connect(addr).await?;
    let req =
        format!("GET /api/v1/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            bail!("event stream closed");
        }
        counters.stream_bytes.fetch_add(n as u64, Ordering::Relaxed);
        // Count "event: overview" lines, also when split across reads.
        tail.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&tail);
        let found = text.matches("event: overview").count();
        counters.events.fetch_add(found as u64, Ordering::Relaxed);
        let keep = tail.len().min(16);
        let cut = match text.rfind("event: overview") {
            Some(i) => i + "event: overview".len(),
            None => tail.len() - keep,
        };
        tail.drain(..cut.min(tail.len()));
    }
}

/// Opens `n` dashboards on the admin endpoint at `addr`.
pub fn open(addr: SocketAddr, n: u32) -> Dashboards {
    let counters = Arc::new(DashboardCounters::default());
    let tasks = (0..n)
        .map(|i| {
            let counters = counters.clone();
            tokio::spawn(async move {
                if let Err(error) = dashboard(addr, counters.clone()).await {
                    eprintln!("dashboard {i}: {error:#}");
                }
                counters.stream_ends.fetch_add(1, Ordering::Relaxed);
            })
        })
        .collect();
    Dashboards { counters, tasks }
}

/// CPU time of the thread of `pid` named `name` (its `comm`): from `schedstat` (time on a CPU,
/// in nanoseconds, exact) when the kernel has it, else `stat`'s user + system ticks (10 ms
/// resolution: a thread using less than a tick over the window reads 0).
pub fn thread_cpu_time(pid: u32, name: &str) -> anyhow::Result<Duration> {
    let dir = format!("/proc/{pid}/task");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let path = entry?.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let ns = std::fs::read_to_string(path.join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            if let Some(ns) = ns {
                return Ok(Duration::from_nanos(ns));
            }
            let stat = std::fs::read_to_string(path.join("stat"))?;
            let ticks = crate::harness::procfs::parse_stat_cpu_ticks(&stat)?;
            let per_s = crate::harness::procfs::clock_ticks_per_second();
            return Ok(Duration::from_nanos(ticks * 1_000_000_000 / per_s));
        }
    }
    bail!("no thread named {name} in process {pid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_address_is_read_from_the_generated_config() {
        let toml = "[gateway]\nshards = 0\n\n[admin]\nenabled = true\nlisten = \"127.0.0.1:4567\"\n\n[[uplink]]\nlisten = \"x\"\n";
        assert_eq!(
            admin_addr_from_config(toml).unwrap(),
            "127.0.0.1:4567".parse().unwrap()
        );
        assert!(admin_addr_from_config("[gateway]\n").is_err());
    }
}
