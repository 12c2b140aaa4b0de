//! Link state of the host's interfaces for multipath uplinks, and the MPTCP endpoint refresh.
//!
//! Owns: the `sluice-links` thread, which follows the kernel's link and address events
//! through rtnetlink (`rtnetlink` crate: a netlink socket subscribed to RTNLGRP_LINK,
//! RTNLGRP_IPV4_IFADDR and RTNLGRP_IPV6_IFADDR) and after each burst of events re-reads every
//! interface's flags and addresses over the same socket (an RTM_GETLINK and an RTM_GETADDR
//! dump; no process is spawned); the [`LinkTable`] it publishes through a
//! `tokio::sync::watch` channel (per-path sessions read it: a path whose link went down is
//! declared dead at once, one whose link came back is retried at once); and, when a watched
//! link comes back up, deleting and re-adding its MPTCP endpoints (`ip mptcp endpoint`: still
//! iproute2; the `mptcp-pm` crate only reads endpoints, it cannot delete or add), so the kernel's path manager re-creates the subflow within a
//! second instead of many seconds later. Does not own: deciding what a path does
//! (`sink::paths`), MPTCP itself (the kernel).
//!
//! A link is *up* when its flags carry both `IFF_UP` and `IFF_LOWER_UP` (administratively up
//! and a carrier: a modem that lost its signal, or a veth whose peer is down, is not).
//!
//! Bounds: the table holds the host's interfaces (what the kernel lists); one dump per burst
//! of events (the events queued meanwhile are drained first). If the netlink socket cannot be
//! opened at start, the watcher does not start (logged by the caller). If the connection later
//! ends (socket error, e.g. ENOBUFS after a flood of events) or a dump fails, that is logged
//! at ERROR and counted (`sluice_link_monitor_exits_total`), and the monitor reconnects after
//! a backoff (1 s doubling to 60 s; reset after it ran 60 s), the links re-read at once;
//! meanwhile per-path sessions notice dead paths by their own timeouts.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::{StreamExt, TryStreamExt};
use rtnetlink::packet_core::NetlinkMessage;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::{new_multicast_connection, Handle, MulticastGroup};

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
    /// The netlink monitor ended (or the links could not be re-read): reconnected.
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
            "The link monitor (netlink) ended or the links could not be re-read; it reconnects after a backoff.",
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

/// First and longest wait before the monitor reconnects after it ended.
const MONITOR_RESTART_MIN: Duration = Duration::from_secs(1);
const MONITOR_RESTART_MAX: Duration = Duration::from_secs(60);
/// A monitor that ran this long resets the backoff.
const MONITOR_HEALTHY: Duration = Duration::from_secs(60);

/// The running watcher; stopping it (or dropping it) closes its netlink socket and ends the
/// thread.
pub struct LinkWatcher {
    rx: LinkWatch,
    stop_tx: Option<tokio::sync::oneshot::Sender<()>>,
    /// Ends the current netlink connection as if it had failed (tests of the restart path).
    fault: Arc<tokio::sync::Notify>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub metrics: Arc<LinkMetrics>,
}

/// One netlink connection: requests go through `handle`, multicast events arrive on
/// `events`, `task` drives the socket.
struct Monitor {
    handle: Handle,
    events: futures_channel::mpsc::UnboundedReceiver<(
        NetlinkMessage<RouteNetlinkMessage>,
        rtnetlink::sys::SocketAddr,
    )>,
    task: tokio::task::JoinHandle<()>,
}

/// Opens the socket, subscribed to link and address events (call inside the runtime).
fn connect() -> std::io::Result<Monitor> {
    let (conn, handle, events) = new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
    ])?;
    Ok(Monitor {
        handle,
        events,
        task: tokio::spawn(conn),
    })
}

impl LinkWatcher {
    /// Read the links once and start following them. Fails when the netlink socket cannot be
    /// opened or the links cannot be read.
    pub fn start(spec: WatchSpec) -> std::io::Result<LinkWatcher> {
        // The socket and the first read are made on the thread itself (its own runtime), so
        // start may be called from inside another runtime; start waits for that first read.
        let metrics = Arc::new(LinkMetrics::default());
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let fault = Arc::new(tokio::sync::Notify::new());
        let m = metrics.clone();
        let f = fault.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-links".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .enable_time()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = first_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let mut table = LinkTable::default();
                    let first = async {
                        let monitor = connect()?;
                        let now = read_links(&monitor.handle).await?;
                        apply(&mut table, now, &spec, &m, false);
                        Ok::<_, std::io::Error>(monitor)
                    }
                    .await;
                    let monitor = match first {
                        Ok(monitor) => monitor,
                        Err(e) => {
                            let _ = first_tx.send(Err(e));
                            return;
                        }
                    };
                    let (tx, rx) = tokio::sync::watch::channel(Arc::new(table.clone()));
                    if first_tx.send(Ok(rx)).is_err() {
                        return;
                    }
                    follow(monitor, table, spec, m, tx, stop_rx, f).await;
                });
            })?;
        let rx = first_rx
            .recv()
            .map_err(|_| std::io::Error::other("the link watcher thread ended at start"))??;
        Ok(LinkWatcher {
            rx,
            stop_tx: Some(stop_tx),
            fault,
            thread: Some(thread),
            metrics,
        })
    }

    pub fn watch(&self) -> LinkWatch {
        self.rx.clone()
    }

    /// End the current netlink connection as a socket error would (for tests).
    pub fn break_monitor(&self) {
        self.fault.notify_one();
    }

    /// Close the socket and join the thread.
    pub fn stop(mut self) {
        self.stop_tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for LinkWatcher {
    fn drop(&mut self) {
        self.stop_tx = None; // the thread sees the channel closed and ends
    }
}

/// The thread's loop: follow events, re-read the links at each burst, reconnect with backoff
/// when the connection ends; returns when `stop` fires or its sender is dropped.
async fn follow(
    first: Monitor,
    mut table: LinkTable,
    spec: WatchSpec,
    m: Arc<LinkMetrics>,
    tx: tokio::sync::watch::Sender<Arc<LinkTable>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    fault: Arc<tokio::sync::Notify>,
) {
    let mut monitor = Some(first);
    let mut backoff = MONITOR_RESTART_MIN;
    loop {
        if let Some(mut mon) = monitor.take() {
            let started = Instant::now();
            let why = loop {
                tokio::select! {
                    _ = &mut stop => {
                        mon.task.abort();
                        return;
                    }
                    _ = fault.notified() => break "connection broken on purpose".to_owned(),
                    event = mon.events.next() => {
                        if event.is_none() {
                            break "the netlink connection ended".to_owned();
                        }
                        // A change comes as several messages: drain what is queued, then
                        // read once; only a real difference is published.
                        while mon.events.try_recv().is_ok() {}
                        match read_links(&mon.handle).await {
                            Ok(now) => {
                                if apply(&mut table, now, &spec, &m, true) {
                                    tx.send_replace(Arc::new(table.clone()));
                                }
                            }
                            Err(error) => break format!("cannot read the links: {error}"),
                        }
                    }
                }
            };
            mon.task.abort();
            if started.elapsed() >= MONITOR_HEALTHY {
                backoff = MONITOR_RESTART_MIN;
            }
            m.monitor_exits.inc();
            tracing::error!(
                reason = %why,
                restart_in_ms = backoff.as_millis() as u64,
                "link monitor stopped following link changes; reconnecting (paths rely on their own timeouts meanwhile)"
            );
        }
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MONITOR_RESTART_MAX);
        let reconnected = match connect() {
            Ok(mon) => match read_links(&mon.handle).await {
                // Changes while it was down were missed: read the links now.
                Ok(now) => {
                    if apply(&mut table, now, &spec, &m, true) {
                        tx.send_replace(Arc::new(table.clone()));
                    }
                    Ok(mon)
                }
                Err(error) => {
                    mon.task.abort();
                    Err(format!("cannot read the links: {error}"))
                }
            },
            Err(error) => Err(format!("cannot open the netlink socket: {error}")),
        };
        match reconnected {
            Ok(mon) => monitor = Some(mon),
            Err(reason) => {
                m.monitor_exits.inc();
                tracing::error!(%reason, restart_in_ms = backoff.as_millis() as u64, "link monitor cannot reconnect; retrying");
            }
        }
    }
}

/// One interface as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    name: String,
    up: bool,
    addrs: Vec<IpAddr>,
}

/// Every interface with its flags (RTM_GETLINK dump) and addresses (RTM_GETADDR dump; an
/// address's IFA_LOCAL, else its IFA_ADDRESS, as `ip addr` shows).
async fn read_links(handle: &Handle) -> std::io::Result<Vec<Listed>> {
    let err = |e: rtnetlink::Error| std::io::Error::other(e.to_string());
    let mut by_index: BTreeMap<u32, Listed> = BTreeMap::new();
    let mut links = handle.link().get().execute();
    while let Some(l) = links.try_next().await.map_err(err)? {
        let Some(name) = l.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        }) else {
            continue;
        };
        let flags = l.header.flags;
        by_index.insert(
            l.header.index,
            Listed {
                name,
                up: flags.contains(LinkFlags::Up) && flags.contains(LinkFlags::LowerUp),
                addrs: Vec::new(),
            },
        );
    }
    let mut addrs = handle.address().get().execute();
    while let Some(a) = addrs.try_next().await.map_err(err)? {
        let pick = |want_local: bool| {
            a.attributes.iter().find_map(|x| match x {
                AddressAttribute::Local(ip) if want_local => Some(*ip),
                AddressAttribute::Address(ip) if !want_local => Some(*ip),
                _ => None,
            })
        };
        if let (Some(l), Some(ip)) = (
            by_index.get_mut(&a.header.index),
            pick(true).or_else(|| pick(false)),
        ) {
            l.addrs.push(ip);
        }
    }
    Ok(by_index.into_values().collect())
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
    fn the_links_are_read_over_netlink_and_loopback_is_up_with_its_address() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let links = rt.block_on(async {
            let mon = connect().unwrap();
            let l = read_links(&mon.handle).await.unwrap();
            mon.task.abort();
            l
        });
        let lo = links.iter().find(|l| l.name == "lo").expect("lo is listed");
        assert!(lo.up, "lo has IFF_UP and IFF_LOWER_UP");
        assert!(lo.addrs.contains(&"127.0.0.1".parse::<IpAddr>().unwrap()));
    }

    /// Issue 29: a dead monitor was silent (the thread ended, link changes no longer
    /// followed). Now it is counted, logged and reconnected after the backoff.
    #[test]
    fn a_broken_monitor_is_counted_and_reconnected_and_stop_does_not_wait_out_the_backoff() {
        let w = LinkWatcher::start(WatchSpec::default()).expect("a netlink socket");
        w.break_monitor();
        let deadline = Instant::now() + Duration::from_secs(5);
        while w.metrics.monitor_exits.get() == 0 {
            assert!(Instant::now() < deadline, "not counted");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut text = PromWriter::default();
        w.metrics.render(&mut text);
        assert!(
            text.finish().contains("sluice_link_monitor_exits_total 1"),
            "counted in /metrics"
        );
        // Reconnected after 1 s: a second break is counted again.
        std::thread::sleep(Duration::from_millis(1300));
        w.break_monitor();
        let deadline = Instant::now() + Duration::from_secs(5);
        while w.metrics.monitor_exits.get() < 2 {
            assert!(Instant::now() < deadline, "not reconnected");
            std::thread::sleep(Duration::from_millis(10));
        }
        let t = Instant::now();
        w.stop();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "stop waited out a backoff"
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
