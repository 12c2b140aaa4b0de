//! Traffic control for priority lanes (SegaNet §4.3): an htb tree on the uplink interface that
//! sends the high-priority cloud sessions' packets through their own class, ahead of the rest.
//!
//! Owns: one OS thread (`sluice-tc`) that runs `tc` commands (`std::process::Command`,
//! blocking, so never on a shard's runtime), the root qdisc it installed on one interface, and
//! one filter pair per high-lane source port it was told about. Does not own: deciding which
//! sessions are high priority or when their sockets come and go (the uplink calls
//! [`TcManager::high_port_up`] / [`TcManager::high_port_down`]), socket marks (`SO_PRIORITY`,
//! DSCP, `TCP_NOTSENT_LOWAT` are set on the sockets by the session), or config parsing (the
//! validator calls [`valid_rate`]).
//!
//! # What it installs (`IF` = interface, `RATE` = the link rate as configured)
//! ```text
//! tc qdisc del dev IF root                      # whatever was there; "nothing to delete" is fine
//! tc qdisc replace dev IF root handle 1: htb default 20
//! tc class add dev IF parent 1:  classid 1:1  htb rate RATE ceil RATE
//! tc class add dev IF parent 1:1 classid 1:10 htb rate RATE ceil RATE burst B cburst B prio 0  # high lane
//! tc class add dev IF parent 1:1 classid 1:20 htb rate SHARE ceil RATE prio 1       # the rest
//! # per high-lane source port P, in its own slot k (filter priorities are per slot, so one
//! # port's filters can be deleted without knowing kernel-chosen u32 handles):
//! tc filter add dev IF parent 1: protocol ip   prio (1 + k)     u32 match ip  sport P 0xffff flowid 1:10
//! tc filter add dev IF parent 1: protocol ipv6 prio (32768 + k) u32 match ip6 sport P 0xffff flowid 1:10
//! # high_port_down(P):
//! tc filter del dev IF parent 1: protocol ip   prio (1 + k)
//! tc filter del dev IF parent 1: protocol ipv6 prio (32768 + k)
//! # shutdown / drop:
//! tc qdisc del dev IF root
//! ```
//! `SHARE` (the default class's guaranteed rate) is a tenth of `RATE`, at least 8 kbit (and at
//! most `RATE`), so normal traffic is never starved while the high lane is busy and may borrow
//! the whole link when it is not. `B`, the high class's bucket, holds 50 ms of `RATE` (at least
//! 3200 bytes, two full frames): with htb's default (about one frame at low rates) two
//! high-lane messages written back to back — which happens whenever the shard was busy for a
//! moment — made the second wait for tokens for a frame time, the whole p99 tail of the high
//! lane under load (measured by `sluice-bench scenario priority`, docs/perf/priority.md). With `netns = Some(ns)` every command runs as
//! `ip netns exec NS tc ...` (tests use throw-away namespaces).
//!
//! # Invariants and policies
//! - Never panics; every failure is a [`TcError`] naming what failed, plus one WARN line.
//!   Failures after start-up (a filter that cannot be added or deleted) are logged and do not
//!   stop the manager: the affected session simply is not prioritised.
//! - Bounded: commands go to the thread through a channel of [`COMMAND_QUEUE`] entries; when it
//!   is full, [`TcManager::high_port_up`] / [`TcManager::high_port_down`] drop the request and
//!   log it (a missed "up" leaves that session unprioritised, a missed "down" leaves one stale
//!   filter until shutdown). At most [`MAX_HIGH_PORTS`] ports are classified at once; more are
//!   refused with a WARN.
//! - Shutdown ([`TcManager::shutdown`] or drop) deletes the root qdisc and nothing else: the
//!   interface falls back to the kernel's default qdisc, not to what was there before.
//! - Matching is on the source port only: another connection from the same local port (Linux
//!   may reuse an ephemeral port towards a different destination) would share the high class.

use std::collections::HashMap;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{info, warn};

/// Requests waiting for the tc thread, at most.
pub const COMMAND_QUEUE: usize = 1024;
/// High-lane source ports classified at once, at most (one filter priority slot each).
pub const MAX_HIGH_PORTS: u16 = 4096;
/// Filter priority of slot 0 for IPv4 (slot k uses `PRIO_V4_BASE + k`).
const PRIO_V4_BASE: u16 = 1;
/// Filter priority of slot 0 for IPv6 (slot k uses `PRIO_V6_BASE + k`).
const PRIO_V6_BASE: u16 = 32768;
/// The default class never gets less than this guaranteed rate, bit/s.
const MIN_DEFAULT_SHARE_BITS: f64 = 8_000.0;
/// The high class's token bucket holds this long at the link rate…
const HIGH_BURST_TIME_S: f64 = 0.05;
/// …and at least this many bytes (two full Ethernet frames).
const HIGH_BURST_MIN_BYTES: f64 = 3200.0;
/// How long [`TcManager::flush`] waits for the thread.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// `CAP_NET_ADMIN` is bit 12 of the capability sets in `/proc/self/status`.
const CAP_NET_ADMIN_BIT: u32 = 12;

/// What went wrong while driving `tc`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TcError {
    #[error("install_tc needs CAP_NET_ADMIN (run sluice as root or grant it the capability): `{command}` failed: {detail}")]
    NotPermitted { command: String, detail: String },
    #[error("install_tc needs the `{program}` command, which was not found: install iproute2 (e.g. `apt-get install iproute2`)")]
    NoTcCommand { program: String },
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("could not run `{command}`: {detail}")]
    Spawn { command: String, detail: String },
    #[error("invalid tc rate {rate:?}: expected a number and a unit such as \"2mbit\", \"512kbit\", \"1gbit\" or \"250kbps\" (bytes/s)")]
    InvalidRate { rate: String },
    #[error("invalid interface name {name:?}: 1 to 15 characters, no whitespace or '/'")]
    InvalidInterface { name: String },
    #[error("`{command}` printed no `dev <interface>`: {output:?}")]
    NoRouteDevice { command: String, output: String },
    #[error("more than {max} high-priority ports at once; port {port} is not classified")]
    TooManyPorts { max: u16, port: u16 },
    #[error("the tc thread is gone (it could not start or it stopped)")]
    ThreadGone,
}

impl TcError {
    /// Whether retrying the same thing could succeed without anyone changing the system.
    pub fn is_retryable(&self) -> bool {
        matches!(self, TcError::CommandFailed { .. } | TcError::Spawn { .. })
    }
}

/// The interface the kernel routes to `ip` would leave through: `ip -o route get IP`, the word
/// after `dev`.
pub fn route_interface(ip: IpAddr) -> Result<String, TcError> {
    route_interface_in(None, ip)
}

/// [`route_interface`] inside network namespace `netns` (when given).
pub fn route_interface_in(netns: Option<&str>, ip: IpAddr) -> Result<String, TcError> {
    let ip_text = ip.to_string();
    let args = ["-o", "route", "get", ip_text.as_str()];
    let (program, argv) = match netns {
        Some(ns) => {
            let mut v = vec!["-n", ns];
            v.extend_from_slice(&args);
            ("ip", v)
        }
        None => ("ip", args.to_vec()),
    };
    let output = run(program, &argv)?;
    parse_route_dev(&output).ok_or_else(|| TcError::NoRouteDevice {
        command: command_text(program, &argv),
        output: output.trim().to_string(),
    })
}

/// The word after `dev` in `ip -o route get` output, e.g.
/// `"10.0.0.2 dev veth0 src 10.0.0.1 uid 0 \\    cache"` → `veth0`.
pub fn parse_route_dev(output: &str) -> Option<String> {
    let mut words = output.split_whitespace();
    while let Some(w) = words.next() {
        if w == "dev" {
            return words.next().map(str::to_string);
        }
    }
    None
}

/// Whether `s` is a tc rate: a positive number followed by `bit`, `kbit`, `mbit`, `gbit`,
/// `tbit` (bits per second, SI) or `bps`, `kbps`, `mbps`, `gbps`, `tbps` (bytes per second,
/// as tc reads them), case-insensitive, e.g. `"2mbit"`, `"1.5Mbit"`, `"250kbps"`.
pub fn valid_rate(s: &str) -> bool {
    rate_bits_per_second(s).is_some()
}

/// The rate in bits per second, if [`valid_rate`].
pub fn rate_bits_per_second(s: &str) -> Option<f64> {
    let s = s.trim().to_ascii_lowercase();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = s.split_at(split);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let factor = match unit {
        "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        "tbps" => 8e12,
        _ => return None,
    };
    let bits = value * factor;
    (bits.is_finite() && bits >= 1.0).then_some(bits)
}

/// The high class's burst and cburst for a link of `rate`, as a tc size (`"12500b"`).
fn high_burst(rate_bits: f64) -> String {
    let bytes = (rate_bits / 8.0 * HIGH_BURST_TIME_S).max(HIGH_BURST_MIN_BYTES);
    format!("{}b", bytes.round() as u64)
}

/// The guaranteed rate of the default class for a link of `rate`: a tenth, at least 8 kbit,
/// at most the whole link, as a tc rate string (`"200000bit"`).
fn default_share(rate_bits: f64) -> String {
    let share = (rate_bits / 10.0)
        .max(MIN_DEFAULT_SHARE_BITS)
        .min(rate_bits);
    format!("{}bit", share.round() as u64)
}

/// The htb tree on one interface and the thread that maintains it.
#[derive(Debug)]
pub struct TcManager {
    interface: String,
    commands: Option<SyncSender<Request>>,
    thread: Option<JoinHandle<()>>,
}

enum Request {
    PortUp(u16),
    PortDown(u16),
    /// Answered once every earlier request was handled.
    Flush(SyncSender<()>),
    /// Remove the root qdisc, answer, and end the thread.
    Shutdown(SyncSender<Result<(), TcError>>),
}

impl TcManager {
    /// Start the tc thread and install the htb tree on `interface` with link rate `rate`
    /// (e.g. `"2mbit"`); returns once it is installed, or with the first failure (after
    /// removing whatever part was installed).
    pub fn start(
        netns: Option<String>,
        interface: String,
        rate: String,
    ) -> Result<TcManager, TcError> {
        let Some(rate_bits) = rate_bits_per_second(&rate) else {
            return Err(TcError::InvalidRate { rate });
        };
        if interface.is_empty()
            || interface.len() > 15
            || interface
                .chars()
                .any(|c| c.is_whitespace() || c == '/' || c == '\0')
        {
            return Err(TcError::InvalidInterface { name: interface });
        }
        if netns.is_none() && lacks_net_admin() {
            let error = TcError::NotPermitted {
                command: format!("tc qdisc replace dev {interface} root"),
                detail: "this process does not have CAP_NET_ADMIN".to_string(),
            };
            warn!(interface = %interface, error = %error, "traffic control not installed");
            return Err(error);
        }
        let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE);
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let worker = Worker {
            tc: Tc {
                netns,
                interface: interface.clone(),
            },
            slots: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("sluice-tc".to_string())
            .spawn(move || worker.run(&rate, rate_bits, rx, ready_tx))
            .map_err(|e| TcError::Spawn {
                command: "the sluice-tc thread".to_string(),
                detail: e.to_string(),
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(TcManager {
                interface,
                commands: Some(tx),
                thread: Some(thread),
            }),
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            Err(_) => {
                let _ = thread.join();
                Err(TcError::ThreadGone)
            }
        }
    }

    /// The interface the tree is installed on.
    pub fn interface(&self) -> &str {
        &self.interface
    }

    /// Classify packets from local TCP port `port` (a high-lane socket) into the high class.
    /// Returns at once; the filter is added by the tc thread (see [`TcManager::flush`]).
    pub fn high_port_up(&self, port: u16) {
        self.send(Request::PortUp(port), "high_port_up", port);
    }

    /// Remove the filters of `port` (its socket closed). Returns at once.
    pub fn high_port_down(&self, port: u16) {
        self.send(Request::PortDown(port), "high_port_down", port);
    }

    /// Wait until every request made so far has been carried out.
    pub fn flush(&self) -> Result<(), TcError> {
        let commands = self.commands.as_ref().ok_or(TcError::ThreadGone)?;
        let (tx, rx) = mpsc::sync_channel(1);
        commands
            .send(Request::Flush(tx))
            .map_err(|_| TcError::ThreadGone)?;
        rx.recv_timeout(FLUSH_TIMEOUT)
            .map_err(|_| TcError::ThreadGone)
    }

    /// Remove the root qdisc (and with it every class and filter) and stop the thread.
    pub fn shutdown(mut self) -> Result<(), TcError> {
        self.stop()
    }

    fn send(&self, request: Request, what: &'static str, port: u16) {
        let Some(commands) = &self.commands else {
            warn!(interface = %self.interface, port, request = what, "tc thread already stopped; request ignored");
            return;
        };
        match commands.try_send(request) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                warn!(interface = %self.interface, port, request = what, capacity = COMMAND_QUEUE, "tc request queue full; request dropped");
            }
            Err(TrySendError::Disconnected(_)) => {
                warn!(interface = %self.interface, port, request = what, "tc thread is gone; request dropped");
            }
        }
    }

    fn stop(&mut self) -> Result<(), TcError> {
        let Some(commands) = self.commands.take() else {
            return Ok(());
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let result = match commands.send(Request::Shutdown(tx)) {
            Ok(()) => rx.recv().unwrap_or(Err(TcError::ThreadGone)),
            Err(_) => Err(TcError::ThreadGone),
        };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        result
    }
}

impl Drop for TcManager {
    fn drop(&mut self) {
        // Errors were already logged by the thread.
        let _ = self.stop();
    }
}

/// Where commands run.
struct Tc {
    netns: Option<String>,
    interface: String,
}

impl Tc {
    /// Run `tc ARGS` (inside the namespace when there is one); stdout on success.
    fn run(&self, args: &[&str]) -> Result<String, TcError> {
        match &self.netns {
            Some(ns) => {
                let mut argv = vec!["netns", "exec", ns.as_str(), "tc"];
                argv.extend_from_slice(args);
                run("ip", &argv)
            }
            None => run("tc", args),
        }
    }
}

/// State of the tc thread.
struct Worker {
    tc: Tc,
    /// High-lane port → its slot (filter priorities `PRIO_V4_BASE + slot`, `PRIO_V6_BASE + slot`).
    slots: HashMap<u16, u16>,
}

impl Worker {
    fn run(
        mut self,
        rate: &str,
        rate_bits: f64,
        requests: Receiver<Request>,
        ready: SyncSender<Result<(), TcError>>,
    ) {
        if let Err(error) = self.install(rate, rate_bits) {
            warn!(interface = %self.tc.interface, error = %error, "traffic control not installed");
            if !matches!(
                error,
                TcError::NotPermitted { .. } | TcError::NoTcCommand { .. }
            ) {
                let _ = self.remove_root();
            }
            let _ = ready.send(Err(error));
            return;
        }
        info!(interface = %self.tc.interface, rate, "traffic control installed (htb: 1:10 high lane, 1:20 default)");
        if ready.send(Ok(())).is_err() {
            let _ = self.remove_root();
            return;
        }
        while let Ok(request) = requests.recv() {
            match request {
                Request::PortUp(port) => {
                    if let Err(error) = self.port_up(port) {
                        warn!(interface = %self.tc.interface, port, error = %error, "high-lane filter not added; this session is not prioritised");
                    }
                }
                Request::PortDown(port) => {
                    if let Err(error) = self.port_down(port) {
                        warn!(interface = %self.tc.interface, port, error = %error, "high-lane filter not removed");
                    }
                }
                Request::Flush(done) => {
                    let _ = done.send(());
                }
                Request::Shutdown(done) => {
                    let _ = done.send(self.remove_root());
                    return;
                }
            }
        }
        // Every sender is gone without a shutdown request (cannot happen through TcManager,
        // whose Drop always asks): clean up anyway.
        let _ = self.remove_root();
    }

    fn install(&mut self, rate: &str, rate_bits: f64) -> Result<(), TcError> {
        let dev = self.tc.interface.clone();
        // Start from a clean slate: a tree left by an earlier run would keep stale filters.
        // "Nothing to delete" is the normal case; only a permission problem is worth stopping.
        match self.tc.run(&["qdisc", "del", "dev", &dev, "root"]) {
            Ok(_) | Err(TcError::CommandFailed { .. }) => {}
            Err(e) => return Err(e),
        }
        let share = default_share(rate_bits);
        let burst = high_burst(rate_bits);
        self.tc.run(&[
            "qdisc", "replace", "dev", &dev, "root", "handle", "1:", "htb", "default", "20",
        ])?;
        self.tc.run(&[
            "class", "add", "dev", &dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
            "ceil", rate,
        ])?;
        self.tc.run(&[
            "class", "add", "dev", &dev, "parent", "1:1", "classid", "1:10", "htb", "rate", rate,
            "ceil", rate, "burst", &burst, "cburst", &burst, "prio", "0",
        ])?;
        self.tc.run(&[
            "class", "add", "dev", &dev, "parent", "1:1", "classid", "1:20", "htb", "rate", &share,
            "ceil", rate, "prio", "1",
        ])?;
        Ok(())
    }

    fn port_up(&mut self, port: u16) -> Result<(), TcError> {
        if self.slots.contains_key(&port) {
            return Ok(());
        }
        let slot = (0..MAX_HIGH_PORTS)
            .find(|s| !self.slots.values().any(|used| used == s))
            .ok_or(TcError::TooManyPorts {
                max: MAX_HIGH_PORTS,
                port,
            })?;
        let dev = self.tc.interface.clone();
        let port_text = port.to_string();
        let v4 = (PRIO_V4_BASE + slot).to_string();
        let v6 = (PRIO_V6_BASE + slot).to_string();
        self.tc.run(&[
            "filter", "add", "dev", &dev, "parent", "1:", "protocol", "ip", "prio", &v4, "u32",
            "match", "ip", "sport", &port_text, "0xffff", "flowid", "1:10",
        ])?;
        let v6_result = self.tc.run(&[
            "filter", "add", "dev", &dev, "parent", "1:", "protocol", "ipv6", "prio", &v6, "u32",
            "match", "ip6", "sport", &port_text, "0xffff", "flowid", "1:10",
        ]);
        // The slot is taken from here on: the IPv4 filter exists whatever happens to IPv6.
        self.slots.insert(port, slot);
        v6_result.map(|_| ())
    }

    fn port_down(&mut self, port: u16) -> Result<(), TcError> {
        let Some(slot) = self.slots.remove(&port) else {
            return Ok(());
        };
        let dev = self.tc.interface.clone();
        let v4 = (PRIO_V4_BASE + slot).to_string();
        let v6 = (PRIO_V6_BASE + slot).to_string();
        let r4 = self.tc.run(&[
            "filter", "del", "dev", &dev, "parent", "1:", "protocol", "ip", "prio", &v4,
        ]);
        let r6 = self.tc.run(&[
            "filter", "del", "dev", &dev, "parent", "1:", "protocol", "ipv6", "prio", &v6,
        ]);
        r4.and(r6).map(|_| ())
    }

    fn remove_root(&mut self) -> Result<(), TcError> {
        self.slots.clear();
        let dev = self.tc.interface.clone();
        let result = self
            .tc
            .run(&["qdisc", "del", "dev", &dev, "root"])
            .map(|_| ());
        match &result {
            Ok(()) => info!(interface = %dev, "traffic control removed"),
            Err(error) => {
                warn!(interface = %dev, error = %error, "traffic control not removed")
            }
        }
        result
    }
}

/// Run `program ARGS`, classifying failures; stdout on success.
fn run(program: &str, args: &[&str]) -> Result<String, TcError> {
    let command = command_text(program, args);
    let output = match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(TcError::NoTcCommand {
                program: program.to_string(),
            })
        }
        Err(e) => {
            return Err(TcError::Spawn {
                command,
                detail: e.to_string(),
            })
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        return Ok(stdout);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    Err(classify_failure(
        command,
        &output.status.to_string(),
        stderr.trim(),
    ))
}

/// Turn a failed command into the matching error.
fn classify_failure(command: String, status: &str, stderr: &str) -> TcError {
    let first_line = |s: &str| {
        s.lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string()
    };
    if stderr.contains("Operation not permitted") || stderr.contains("Permission denied") {
        return TcError::NotPermitted {
            command,
            detail: first_line(stderr),
        };
    }
    // `ip netns exec NS tc …` when tc is missing.
    if stderr.contains("exec of \"tc\" failed") && stderr.contains("No such file") {
        return TcError::NoTcCommand {
            program: "tc".to_string(),
        };
    }
    TcError::CommandFailed {
        command,
        status: status.to_string(),
        stderr: stderr.lines().take(5).collect::<Vec<_>>().join(" | "),
    }
}

fn command_text(program: &str, args: &[&str]) -> String {
    let mut text = program.to_string();
    for a in args {
        text.push(' ');
        text.push_str(a);
    }
    text
}

/// True when `/proc/self/status` says the effective capability set lacks CAP_NET_ADMIN;
/// false when it has it or cannot be read (then tc itself will tell).
fn lacks_net_admin() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| has_net_admin(&s))
        .is_some_and(|has| !has)
}

/// Whether the `CapEff:` line of a `/proc/<pid>/status` text includes CAP_NET_ADMIN.
fn has_net_admin(status: &str) -> Option<bool> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    Some(caps & (1 << CAP_NET_ADMIN_BIT) != 0)
}

#[cfg(test)]
mod tests;
