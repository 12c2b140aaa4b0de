//! Link state of the host's interfaces for multipath uplinks, and the MPTCP endpoint refresh.
//!
//! Owns: the `sluice-links` thread, which follows the kernel's link and address events
//! (netlink RTMGRP_LINK / IFADDR, read through iproute2's `ip -o monitor link address`, the
//! same tool `install_tc` uses for tc) and after each event re-reads every interface's flags
//! and addresses (`ip -j addr show`); the [`LinkTable`] it publishes through a
//! `tokio::sync::watch` channel (per-path sessions read it: a path whose link went down is
//! declared dead at once, one whose link came back is retried at once); and, when a watched
//! link comes back up, deleting and re-adding its MPTCP endpoints (`ip mptcp endpoint`), so
//! the kernel's path manager re-creates the subflow within a second instead of many seconds
//! later. Does not own: deciding what a path does (`sink::paths`), MPTCP itself (the kernel).
//!
//! A link is *up* when its flags carry both `UP` and `LOWER_UP` (administratively up and a
//! carrier: a modem that lost its signal, or a veth whose peer is down, is not).
//!
//! Bounds: the table holds the host's interfaces (what the kernel lists); one `ip addr`
//! read per event. If `ip` is missing at start, the watcher does not start (logged by the
//! caller). If `ip monitor` later ends on its own (killed, crashed) or the links cannot be
//! re-read, that is logged at ERROR and counted (`sluice_link_monitor_exits_total`), and the
//! monitor is started again after a backoff (1 s doubling to 60 s; reset after it ran 60 s),
//! the links re-read at once; meanwhile per-path sessions notice dead paths by their own
//! timeouts. (Issue 29 asks for netlink here, `rtnetlink`/`mptcp-pm`, instead of spawning
//! `ip`: not done yet.)

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// One interface as last reported by the kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkState {
    /// IFF_UP and IFF_LOWER_UP (the carrier) are both set.
    pub up: bool,
    /// [`LinkTable::generation`] when `up` last changed.
    pub changed: u64,
    /// Its addresses.
    pub addrs: Vec<IpAddr>,
}

/// Every interface, by name.
#[derive(Debug, Clone, Default)]
pub struct LinkTable {
    /// Bumped at every change.
    pub generation: u64,
    pub links: HashMap<String, LinkState>,
}

impl LinkTable {
    /// The interface named `name`, or the one holding address `ip`.
    pub fn find(&self, name: Option<&str>, ip: Option<IpAddr>) -> Option<(&str, &LinkState)> {
        if let Some(name) = name {
            return self.links.get_key_value(name).map(|(k, v)| (k.as_str(), v));
        }
        let ip = ip?;
        self.links
            .iter()
            .find(|(_, l)| l.addrs.contains(&ip))
            .map(|(k, v)| (k.as_str(), v))
    }
}

/// What a per-path session watches: the table, replaced at every change.
pub type LinkWatch = tokio::sync::watch::Receiver<Arc<LinkTable>>;

/// Counters of one watched interface.
#[derive(Debug, Default)]
struct Watched {
    up: Gauge,
    changes: Counter,
    refreshed: Counter,
    refresh_failed: Counter,
}

/// The watched interfaces' counters, for status and `/metrics`.
#[derive(Debug, Default)]
pub struct LinkMetrics {
    watched: Mutex<BTreeMap<String, Arc<Watched>>>,
    addrs: Mutex<BTreeMap<String, Vec<IpAddr>>>,
    /// `ip monitor` ended on its own (or the links could not be re-read): restarted.
    pub monitor_exits: Counter,
}

impl LinkMetrics {
    fn get(&self, name: &str) -> Arc<Watched> {
        self.watched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// `[{name, up, addrs, changes, endpoint_refreshes}]` for `/api/v1/status`.
    pub fn status(&self) -> serde_json::Value {
        let addrs = self.addrs.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::Value::Array(
            watched
                .iter()
                .map(|(name, w)| {
                    serde_json::json!({
                        "name": name,
                        "up": w.up.get() == 1,
                        "addrs": addrs.get(name).cloned().unwrap_or_default(),
                        "changes": w.changes.get(),
                        "endpoint_refreshes": w.refreshed.get(),
                        "endpoint_refresh_failures": w.refresh_failed.get(),
                    })
                })
                .collect(),
        )
    }

    pub fn render(&self, w: &mut PromWriter) {
        w.counter(
            "sluice_link_monitor_exits_total",
            "The link monitor (ip monitor) ended on its own or the links could not be re-read; it is restarted after a backoff.",
            &[],
            self.monitor_exits.get(),
        );
        let watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        for (name, m) in watched.iter() {
            let l: &[(&str, &str)] = &[("interface", name)];
            w.gauge(
                "sluice_link_up",
                "Watched link state: 1 up (UP and LOWER_UP), 0 down.",
                l,
                m.up.get(),
            );
            w.counter(
                "sluice_link_changes_total",
                "Up/down changes of the watched link.",
                l,
                m.changes.get(),
            );
            for (outcome, c) in [("ok", &m.refreshed), ("failed", &m.refresh_failed)] {
                w.counter(
                    "sluice_mptcp_endpoint_refreshes_total",
                    "MPTCP endpoints of the link deleted and re-added after it came back up.",
                    &[("interface", name), ("outcome", outcome)],
                    c.get(),
                );
            }
        }
    }
}

/// What the watcher follows.
#[derive(Debug, Clone, Default)]
pub struct WatchSpec {
    /// Interfaces by name (`[multipath] interfaces`, the paths' `interface`).
    pub interfaces: Vec<String>,
    /// Addresses whose interface is watched too (the paths' `bind`).
    pub addrs: Vec<IpAddr>,
    /// `[multipath] refresh_endpoints`.
    pub refresh_endpoints: bool,
}

/// First and longest wait before `ip monitor` is started again after it ended on its own.
const MONITOR_RESTART_MIN: Duration = Duration::from_secs(1);
const MONITOR_RESTART_MAX: Duration = Duration::from_secs(60);
/// A monitor that ran this long resets the backoff.
const MONITOR_HEALTHY: Duration = Duration::from_secs(60);

/// The running watcher; stopping it (or dropping it) ends `ip monitor` and the thread.
pub struct LinkWatcher {
    rx: LinkWatch,
    child: Arc<Mutex<Option<Child>>>,
    stopping: Arc<AtomicBool>,
    /// Dropped to wake the thread out of a restart backoff.
    stop_tx: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub metrics: Arc<LinkMetrics>,
}

fn spawn_monitor() -> std::io::Result<(Child, ChildStdout)> {
    let mut child = Command::new("ip")
        .args(["-o", "monitor", "link", "address"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()?;
    match child.stdout.take() {
        Some(out) => Ok((child, out)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(std::io::Error::other("ip monitor has no stdout"))
        }
    }
}

impl LinkWatcher {
    /// Read the links once and start following them. Fails when `ip` cannot be run.
    pub fn start(spec: WatchSpec) -> std::io::Result<LinkWatcher> {
        let metrics = Arc::new(LinkMetrics::default());
        let mut table = LinkTable::default();
        apply(&mut table, read_links()?, &spec, &metrics, false);
        let (tx, rx) = tokio::sync::watch::channel(Arc::new(table.clone()));
        let (child, stdout) = spawn_monitor()?;
        let child = Arc::new(Mutex::new(Some(child)));
        let stopping = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let m = metrics.clone();
        let (slot, stop_flag) = (child.clone(), stopping.clone());
        let thread = std::thread::Builder::new()
            .name("sluice-links".into())
            .spawn(move || {
                let mut stdout = Some(stdout);
                let mut backoff = MONITOR_RESTART_MIN;
                loop {
                    let started = Instant::now();
                    let mut why = "ip monitor ended".to_owned();
                    if let Some(out) = stdout.take() {
                        let mut lines = BufReader::new(out).lines();
                        while let Some(Ok(_event)) = lines.next() {
                            // Several lines come per change; the table is re-read at each and
                            // only a real difference is published.
                            match read_links() {
                                Ok(now) => {
                                    if apply(&mut table, now, &spec, &m, true) {
                                        tx.send_replace(Arc::new(table.clone()));
                                    }
                                }
                                Err(error) => {
                                    why = format!("cannot read the links: {error}");
                                    break;
                                }
                            }
                        }
                    }
                    // The monitor ended (or is abandoned): reap it, unless stop() did.
                    let status = {
                        let mut c = slot.lock().unwrap_or_else(|p| p.into_inner());
                        if stop_flag.load(Ordering::Acquire) {
                            return;
                        }
                        c.take().map(|mut c| {
                            let _ = c.kill();
                            c.wait().map_or_else(|e| e.to_string(), |s| s.to_string())
                        })
                    };
                    if started.elapsed() >= MONITOR_HEALTHY {
                        backoff = MONITOR_RESTART_MIN;
                    }
                    m.monitor_exits.inc();
                    tracing::error!(
                        reason = %why,
                        status = status.as_deref().unwrap_or("not running"),
                        restart_in_ms = backoff.as_millis() as u64,
                        "link monitor stopped following link changes; restarting it (paths rely on their own timeouts meanwhile)"
                    );
                    match stop_rx.recv_timeout(backoff) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    backoff = (backoff * 2).min(MONITOR_RESTART_MAX);
                    match spawn_monitor() {
                        Ok((child, out)) => {
                            let mut c = slot.lock().unwrap_or_else(|p| p.into_inner());
                            if stop_flag.load(Ordering::Acquire) {
                                let mut child = child;
                                let _ = child.kill();
                                let _ = child.wait();
                                return;
                            }
                            *c = Some(child);
                            drop(c);
                            stdout = Some(out);
                            // Changes while it was down were missed: read the links now.
                            if let Ok(now) = read_links() {
                                if apply(&mut table, now, &spec, &m, true) {
                                    tx.send_replace(Arc::new(table.clone()));
                                }
                            }
                        }
                        Err(error) => why = format!("cannot start ip monitor: {error}"),
                    }
                }
            })?;
        Ok(LinkWatcher {
            rx,
            child,
            stopping,
            stop_tx: Some(stop_tx),
            thread: Some(thread),
            metrics,
        })
    }

    pub fn watch(&self) -> LinkWatch {
        self.rx.clone()
    }

    /// The running `ip monitor`'s pid (none between a failure and its restart).
    pub fn monitor_pid(&self) -> Option<u32> {
        self.child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Child::id)
    }

    /// End `ip monitor` and join the thread.
    pub fn stop(mut self) {
        self.kill();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    fn kill(&mut self) {
        self.stopping.store(true, Ordering::Release);
        self.stop_tx = None;
        if let Some(mut c) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LinkWatcher {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One interface as `ip -j addr show` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    name: String,
    up: bool,
    addrs: Vec<IpAddr>,
}

fn read_links() -> std::io::Result<Vec<Listed>> {
    let out = Command::new("ip").args(["-j", "addr", "show"]).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "`ip -j addr show` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(parse_links(&out.stdout))
}

/// Parse `ip -j addr show`; anything unexpected is skipped.
fn parse_links(json: &[u8]) -> Vec<Listed> {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_slice::<serde_json::Value>(json)
    else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| {
            let name = i.get("ifname")?.as_str()?.to_string();
            let flags: Vec<&str> = i
                .get("flags")?
                .as_array()?
                .iter()
                .filter_map(|f| f.as_str())
                .collect();
            let addrs = i
                .get("addr_info")
                .and_then(|a| a.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.get("local")?.as_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            Some(Listed {
                up: flags.contains(&"UP") && flags.contains(&"LOWER_UP"),
                name,
                addrs,
            })
        })
        .collect()
}

/// Bring `table` up to date with `now`; returns whether anything changed. Watched links
/// that came back up get their MPTCP endpoints refreshed (when `act`).
fn apply(
    table: &mut LinkTable,
    now: Vec<Listed>,
    spec: &WatchSpec,
    m: &LinkMetrics,
    act: bool,
) -> bool {
    let mut changed = false;
    let generation = table.generation + 1;
    let names: Vec<String> = now.iter().map(|l| l.name.clone()).collect();
    for l in now {
        let watched =
            spec.interfaces.contains(&l.name) || l.addrs.iter().any(|a| spec.addrs.contains(a));
        let prev = table.links.get(&l.name).cloned();
        let came_up = prev.as_ref().is_some_and(|p| !p.up) && l.up;
        let flipped = prev.as_ref().is_none_or(|p| p.up != l.up);
        if prev
            .as_ref()
            .is_none_or(|p| p.up != l.up || p.addrs != l.addrs)
        {
            changed = true;
        }
        if watched {
            let w = m.get(&l.name);
            w.up.set(i64::from(l.up));
            if flipped && prev.is_some() {
                w.changes.inc();
                tracing::info!(interface = %l.name, up = l.up, "watched link changed");
            }
            m.addrs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(l.name.clone(), l.addrs.clone());
            if came_up && act && spec.refresh_endpoints {
                match refresh_endpoints(&l.name, &l.addrs) {
                    Ok(0) => {}
                    Ok(n) => {
                        w.refreshed.add(n);
                        tracing::info!(interface = %l.name, endpoints = n, "MPTCP endpoints re-added after the link came back");
                    }
                    Err(error) => {
                        w.refresh_failed.inc();
                        tracing::warn!(interface = %l.name, %error, blame = "local", "cannot refresh the link's MPTCP endpoints (needs CAP_NET_ADMIN); the kernel re-creates its subflows late");
                    }
                }
            }
        }
        let e = table.links.entry(l.name).or_default();
        if flipped {
            e.changed = generation;
        }
        e.up = l.up;
        e.addrs = l.addrs;
    }
    let before = table.links.len();
    table.links.retain(|k, _| names.contains(k));
    changed |= table.links.len() != before;
    if changed {
        table.generation = generation;
    }
    changed
}

/// Delete and re-add (same id, address, device, flags) every MPTCP endpoint on interface
/// `name` (by `dev`, or by an address it holds). Returns how many.
fn refresh_endpoints(name: &str, addrs: &[IpAddr]) -> std::io::Result<u64> {
    let out = Command::new("ip")
        .args(["-j", "mptcp", "endpoint", "show"])
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    let mut n = 0;
    for e in parse_endpoints(&out.stdout) {
        let on_link = e.dev.as_deref() == Some(name) || addrs.contains(&e.address);
        if !on_link {
            continue;
        }
        run_ip(&["mptcp", "endpoint", "delete", "id", &e.id.to_string()])?;
        let mut args = vec![
            "mptcp".to_string(),
            "endpoint".into(),
            "add".into(),
            e.address.to_string(),
            "id".into(),
            e.id.to_string(),
        ];
        if let Some(dev) = &e.dev {
            args.extend(["dev".into(), dev.clone()]);
        }
        if let Some(port) = e.port {
            args.extend(["port".into(), port.to_string()]);
        }
        args.extend(e.flags.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_ip(&args)?;
        n += 1;
    }
    Ok(n)
}

fn run_ip(args: &[&str]) -> std::io::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// One MPTCP endpoint as `ip -j mptcp endpoint show` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Endpoint {
    id: u32,
    address: IpAddr,
    dev: Option<String>,
    port: Option<u16>,
    /// `subflow`, `signal`, `backup`, `fullmesh` (each a `true` key in the JSON).
    flags: Vec<String>,
}

fn parse_endpoints(json: &[u8]) -> Vec<Endpoint> {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_slice::<serde_json::Value>(json)
    else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| {
            Some(Endpoint {
                id: u32::try_from(i.get("id")?.as_u64()?).ok()?,
                address: i.get("address")?.as_str()?.parse().ok()?,
                dev: i.get("dev").and_then(|d| d.as_str()).map(str::to_string),
                port: i
                    .get("port")
                    .and_then(|p| p.as_u64())
                    .and_then(|p| u16::try_from(p).ok()),
                flags: ["subflow", "signal", "backup", "fullmesh"]
                    .iter()
                    .filter(|f| i.get(**f).and_then(|v| v.as_bool()) == Some(true))
                    .map(|f| f.to_string())
                    .collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_parse_from_ip_json_and_up_needs_a_carrier() {
        let json = br#"[{"ifindex":1,"ifname":"lo","flags":["LOOPBACK","UP","LOWER_UP"],"addr_info":[{"family":"inet","local":"127.0.0.1","prefixlen":8}]},
            {"ifindex":5,"ifname":"wwan0","flags":["NO-CARRIER","BROADCAST","UP"],"addr_info":[{"family":"inet","local":"10.0.1.2"}]},
            {"bogus":true}]"#;
        let l = parse_links(json);
        assert_eq!(l.len(), 2);
        assert!(l[0].up);
        assert!(!l[1].up, "UP without LOWER_UP is down (no carrier)");
        assert_eq!(l[1].addrs, vec!["10.0.1.2".parse::<IpAddr>().unwrap()]);
        assert!(parse_links(b"not json").is_empty());
    }

    /// Issue 29: a dead `ip monitor` was silent (the thread ended, link changes no longer
    /// followed). Now it is counted, logged and restarted after the backoff.
    #[test]
    fn a_killed_monitor_is_counted_and_restarted() {
        let w = LinkWatcher::start(WatchSpec::default()).expect("ip is installed");
        let first = w.monitor_pid().expect("a running monitor");
        std::process::Command::new("kill")
            .args(["-KILL", &first.to_string()])
            .status()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while w.monitor_pid().is_none_or(|p| p == first) {
            assert!(Instant::now() < deadline, "no restart");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(w.metrics.monitor_exits.get(), 1);
        let mut text = PromWriter::default();
        w.metrics.render(&mut text);
        assert!(
            text.finish().contains("sluice_link_monitor_exits_total 1"),
            "counted in /metrics"
        );
        let second = w.monitor_pid().unwrap();
        let t = Instant::now();
        w.stop();
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "stop does not wait out a backoff"
        );
        assert!(
            !std::path::Path::new(&format!("/proc/{second}")).exists(),
            "the restarted monitor is stopped with the watcher"
        );
    }

    #[test]
    fn endpoints_parse_with_their_flags() {
        let json = br#"[{"address":"10.0.2.2","id":2,"subflow":true,"backup":true,"dev":"veth1"},{"address":"x","id":3}]"#;
        let e = parse_endpoints(json);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].id, 2);
        assert_eq!(e[0].dev.as_deref(), Some("veth1"));
        assert_eq!(
            e[0].flags,
            vec!["subflow".to_string(), "backup".to_string()]
        );
    }

    #[test]
    fn a_flap_is_published_and_counted_for_watched_links_only() {
        let spec = WatchSpec {
            interfaces: vec!["wwan0".into()],
            addrs: vec![],
            refresh_endpoints: false,
        };
        let m = LinkMetrics::default();
        let mut t = LinkTable::default();
        let l = |up| {
            vec![
                Listed {
                    name: "wwan0".into(),
                    up,
                    addrs: vec![],
                },
                Listed {
                    name: "eth9".into(),
                    up,
                    addrs: vec![],
                },
            ]
        };
        assert!(apply(&mut t, l(true), &spec, &m, true));
        assert!(
            !apply(&mut t, l(true), &spec, &m, true),
            "no change, nothing published"
        );
        assert!(apply(&mut t, l(false), &spec, &m, true));
        assert!(!t.find(Some("wwan0"), None).unwrap().1.up);
        assert!(apply(&mut t, l(true), &spec, &m, true));
        let st = m.status();
        assert_eq!(st.as_array().unwrap().len(), 1, "{st}");
        assert_eq!(st[0]["changes"], 2);
        assert_eq!(st[0]["up"], true);
    }
}
