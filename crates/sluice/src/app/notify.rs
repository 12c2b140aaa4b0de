//! Telling systemd how `sluice run` is doing: the sd_notify(3) protocol, for the packaged
//! unit's `Type=notify` and `WatchdogSec=` (deploy/sluice.service, docs/packaging.md).
//!
//! Owns: [`Notifier`] (the datagram socket to `$NOTIFY_SOCKET`), the states sluice sends —
//! `READY=1` once every listener is bound and every thread started, `RELOADING=1` then
//! `READY=1` around a SIGHUP reload, `STOPPING=1` at shutdown, `STATUS=…` lines — and the
//! [`Watchdog`] thread that sends `WATCHDOG=1` every half `$WATCHDOG_USEC` only while
//! [`Liveness::probe`] finds every gateway thread's event loop answering. Does not own: when
//! those moments happen (`main.rs`), or the liveness check itself (`liveness.rs`).
//!
//! Wire format (sd_notify(3)): one datagram of newline-separated `KEY=VALUE` lines to the
//! `AF_UNIX` socket named by `$NOTIFY_SOCKET` — a path, or `@name` for Linux's abstract
//! namespace. No answer comes back. Without `$NOTIFY_SOCKET` (not started by systemd, or
//! `Type=simple`) nothing is sent and nothing fails.
//!
//! Invariants: [`from_env`] is called once, first thing in `main`, and removes
//! `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` from the environment (as
//! `sd_notify(unset_environment=1)` does), so local function instances that sluice spawns do not
//! inherit them. A send error is logged (rate-limited by the callers' rarity: a handful of
//! messages per reload, one per watchdog period) and never stops the gateway.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::liveness::Liveness;

/// Why `$NOTIFY_SOCKET` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("NOTIFY_SOCKET {0:?} is neither an absolute path nor an @abstract name")]
    BadAddress(String),
    #[error("cannot open a datagram socket for NOTIFY_SOCKET: {0}")]
    Socket(io::Error),
}

/// What the service manager gave this process: where to send states, and how often to ping.
#[derive(Debug, Default)]
pub struct ServiceManager {
    /// `None`: `$NOTIFY_SOCKET` was not set.
    pub notifier: Option<Notifier>,
    /// `$WATCHDOG_USEC`, when set and meant for this process (`$WATCHDOG_PID` unset or ours).
    pub watchdog: Option<Duration>,
}

/// Read (and remove) `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID`. Call once, before
/// any thread is started.
pub fn from_env() -> Result<ServiceManager, NotifyError> {
    let socket = std::env::var_os("NOTIFY_SOCKET");
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    for key in ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"] {
        std::env::remove_var(key);
    }
    let watchdog = watchdog_period(usec.as_deref(), pid.as_deref(), std::process::id());
    let notifier = match socket {
        None => None,
        Some(s) => Some(Notifier::connect(&s.to_string_lossy())?),
    };
    Ok(ServiceManager { notifier, watchdog })
}

/// `WatchdogSec` from `$WATCHDOG_USEC`, if `$WATCHDOG_PID` is unset or `me`.
fn watchdog_period(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok() != Some(me) {
            return None;
        }
    }
    let usec: u64 = usec?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// A datagram socket that sends states to the service manager.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    address: String,
}

impl Notifier {
    /// A notifier for `address` (`$NOTIFY_SOCKET`: `/path` or `@abstract`).
    pub fn connect(address: &str) -> Result<Notifier, NotifyError> {
        let socket = UnixDatagram::unbound().map_err(NotifyError::Socket)?;
        if let Some(name) = address.strip_prefix('@') {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
                .map_err(|_| NotifyError::BadAddress(address.to_string()))?;
            socket.connect_addr(&addr).map_err(NotifyError::Socket)?;
        } else if address.starts_with('/') {
            socket.connect(address).map_err(NotifyError::Socket)?;
        } else {
            return Err(NotifyError::BadAddress(address.to_string()));
        }
        Ok(Notifier {
            socket,
            address: address.to_string(),
        })
    }

    /// Send `state` (newline-separated `KEY=VALUE` lines); logs a failure.
    pub fn send(&self, state: &str) {
        if let Err(error) = self.socket.send(state.as_bytes()) {
            tracing::warn!(%error, socket = %self.address, "cannot notify the service manager");
        }
    }

    /// Every listener is bound and every thread started.
    pub fn ready(&self, status: &str) {
        self.send(&format!(
            "READY=1\nSTATUS={status}\nMAINPID={}",
            std::process::id()
        ));
    }

    /// A SIGHUP reload begins; `ready` follows when it is done.
    pub fn reloading(&self) {
        self.send("RELOADING=1\nSTATUS=reloading the configuration");
    }

    /// Shutdown begins.
    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=stopping");
    }
}

/// The thread that pings the watchdog while the gateway is live. Stops when dropped.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Every `period / 2`: probe `liveness` (waiting up to a quarter of the period, at most
    /// 5 s) and send `WATCHDOG=1` only when every thread answered; otherwise log which did not
    /// (ERROR) and skip the ping, so systemd restarts the service once `period` passes
    /// without one.
    pub fn start(
        notifier: Arc<Notifier>,
        liveness: Arc<Liveness>,
        period: Duration,
    ) -> io::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let every = (period / 2).max(Duration::from_millis(1));
        let within = (period / 4).min(Duration::from_secs(5));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-watchdog".into())
            .spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    match liveness.probe(within) {
                        Ok(()) => notifier.send("WATCHDOG=1"),
                        Err(unresponsive) => tracing::error!(
                            threads = %unresponsive,
                            "gateway threads did not answer the liveness probe; withholding the watchdog ping"
                        ),
                    }
                    std::thread::park_timeout(every);
                }
            })?;
        Ok(Watchdog {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_period_is_ours_only_when_watchdog_pid_is_unset_or_our_pid() {
        let s = Some("30000000");
        assert_eq!(watchdog_period(s, None, 7), Some(Duration::from_secs(30)));
        assert_eq!(
            watchdog_period(s, Some("7"), 7),
            Some(Duration::from_secs(30))
        );
        assert_eq!(watchdog_period(s, Some("8"), 7), None);
        assert_eq!(watchdog_period(Some("0"), None, 7), None);
        assert_eq!(watchdog_period(Some("soon"), None, 7), None);
        assert_eq!(watchdog_period(None, None, 7), None);
    }

    #[test]
    fn states_arrive_as_one_datagram_each_on_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let manager = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::connect(path.to_str().unwrap()).unwrap();
        n.ready("up");
        let mut buf = [0u8; 512];
        let len = manager.recv(&mut buf).unwrap();
        let got = std::str::from_utf8(&buf[..len]).unwrap();
        assert!(got.starts_with("READY=1\nSTATUS=up\nMAINPID="), "{got}");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("sluice-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let manager = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier::connect(&format!("@{name}")).unwrap();
        n.reloading();
        let len = manager.recv(&mut buf).unwrap();
        assert_eq!(
            &buf[..len],
            b"RELOADING=1\nSTATUS=reloading the configuration"
        );

        assert!(matches!(
            Notifier::connect("relative/path"),
            Err(NotifyError::BadAddress(_))
        ));
    }
}
