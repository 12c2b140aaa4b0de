//! A network test bed: a "gateway" and a "cloud" network namespace joined by k veth pairs
//! (the links), each optionally limited with tbf, with per-source-address routing so a socket
//! bound to link i's gateway address leaves over link i, and optional MPTCP endpoints so the
//! kernel's path manager adds a subflow per link. Faults: cut a link (carrier loss), blackhole
//! it (everything dropped silently: a `pfifo limit 0` root qdisc on both ends), change its
//! rate. The tbf's queue ([`Queue`]) decides whether a link drops early or queues like an LTE
//! uplink; [`TestBed::qdisc`] reads its counters (bytes sent, drops, overlimits). Used by the
//! multipath tests and by `sluice-bench scenario multipath`.
//!
//! Owns: creating and removing the namespaces (processes inside are killed first), running
//! code inside one ([`Ns::run`], a thread that entered it with `setns`, so every socket it and
//! the threads it starts create belong to it) and commands ([`Ns::command`]). Needs root;
//! [`available`] says why not.
//!
//! Addresses (the same in every bed: namespaces are isolated): link i is 10.77.(i+1).2/24 on
//! the gateway side (`g{i}`) and 10.77.(i+1).1/24 on the cloud side (`c{i}`); the cloud's
//! service address is 10.77.0.1/32 on its `lo`, routed over link 0 by default and over link i
//! for traffic from link i's gateway address (`ip rule from … table 100+i`).

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

static BEDS: AtomicUsize = AtomicUsize::new(0);

/// Ok when this process can build namespaces; Err(reason to print when skipping).
pub fn available() -> Result<(), String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| format!("cannot run `id`: {e}"))?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Err("not root: network namespaces need CAP_SYS_ADMIN".into());
    }
    let name = format!("slprobe{}", std::process::id());
    run(&["ip", "netns", "add", &name]).map_err(|e| format!("`ip netns add` fails: {e}"))?;
    let veth = run(&[
        "ip", "-n", &name, "link", "add", "p0", "type", "veth", "peer", "name", "p1",
    ]);
    let _ = run(&["ip", "netns", "del", &name]);
    veth.map_err(|e| format!("cannot create a veth pair: {e}"))?;
    Ok(())
}

fn run(argv: &[&str]) -> Result<String, String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", argv.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// How much a link's tbf queues before it drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// tbf `latency 200ms` with a 32 kbit burst: the bed's queue before issue 30 (kept for
    /// the figures measured with it).
    Legacy,
    /// tbf `latency 5ms`: a few packets of queue, drops as soon as the link is busy.
    DropEarly,
    /// tbf `latency` of this many ms: the link queues that long before it drops (deep
    /// buffers, as LTE uplinks have).
    Ms(u32),
}

impl Queue {
    /// tbf's `latency` argument.
    pub fn latency(self) -> String {
        match self {
            Queue::Legacy => "200ms".into(),
            Queue::DropEarly => "5ms".into(),
            Queue::Ms(ms) => format!("{ms}ms"),
        }
    }

    /// `drop`, `legacy`, or `100ms`.
    pub fn name(self) -> String {
        match self {
            Queue::Legacy => "legacy".into(),
            Queue::DropEarly => "drop".into(),
            Queue::Ms(ms) => format!("{ms}ms"),
        }
    }

    /// Parse [`Queue::name`]'s forms.
    pub fn parse(s: &str) -> Result<Queue, String> {
        match s {
            "legacy" => Ok(Queue::Legacy),
            "drop" => Ok(Queue::DropEarly),
            _ => s
                .strip_suffix("ms")
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|n| (1..=10_000).contains(n))
                .map(Queue::Ms)
                .ok_or_else(|| format!("{s:?}: expected drop, legacy or <1..10000>ms")),
        }
    }
}

/// A link's qdisc counters on one end (`tc -s -j qdisc show dev …`, the root qdisc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QdiscStats {
    pub bytes: u64,
    pub packets: u64,
    pub drops: u64,
    pub overlimits: u64,
}

/// What to build.
#[derive(Debug, Clone)]
pub struct BedOptions {
    /// Links (veth pairs), 1..=4.
    pub links: usize,
    /// tbf rate on both ends of every link, e.g. `"4mbit"`; `None`: unlimited.
    pub rate: Option<String>,
    /// MPTCP endpoints on the gateway side (`subflow`) for every link but link 0, and
    /// `ip mptcp limits set subflows 8 add_addr_accepted 8` in both namespaces.
    pub mptcp_endpoints: bool,
    /// The tbf queue of every link (with `rate`).
    pub queue: Queue,
}

impl Default for BedOptions {
    fn default() -> Self {
        BedOptions {
            links: 1,
            rate: None,
            mptcp_endpoints: false,
            queue: Queue::Legacy,
        }
    }
}

/// One network namespace.
#[derive(Debug)]
pub struct Ns {
    pub name: String,
}

impl Ns {
    /// Run `f` on a new thread inside this namespace; returns its result.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        match self.spawn(f).join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    }

    /// Start `f` on a new thread inside this namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            enter(&path).unwrap_or_else(|e| panic!("cannot enter network namespace {path}: {e}"));
            f()
        })
    }

    /// `ip netns exec <name> <program>`.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Run a command inside the namespace: Ok(stdout) or Err(with stderr).
    pub fn exec(&self, argv: &[&str]) -> Result<String, String> {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(argv);
        run(&full)
    }
}

/// Enter the network namespace at `path` on this thread.
#[allow(unsafe_code)]
fn enter(path: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    // SAFETY: setns takes a valid open descriptor (held by `f` for the call) and a flag; it
    // changes only this thread's network namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One link of the bed.
#[derive(Debug, Clone)]
pub struct Link {
    pub index: usize,
    pub gw_if: String,
    pub cloud_if: String,
    pub gw_addr: Ipv4Addr,
    pub cloud_peer: Ipv4Addr,
}

/// The bed; dropping it removes both namespaces (and what runs inside).
#[derive(Debug)]
pub struct TestBed {
    pub gw: Ns,
    pub cloud: Ns,
    pub links: Vec<Link>,
    rate: Option<String>,
    queue: Queue,
}

impl TestBed {
    pub fn new(opts: BedOptions) -> Result<TestBed, String> {
        if !(1..=4).contains(&opts.links) {
            return Err(format!("1 to 4 links, not {}", opts.links));
        }
        let n = BEDS.fetch_add(1, Ordering::Relaxed);
        let tag = format!("sl{}x{n}", std::process::id());
        let bed = TestBed {
            gw: Ns {
                name: format!("{tag}g"),
            },
            cloud: Ns {
                name: format!("{tag}c"),
            },
            links: (0..opts.links)
                .map(|i| Link {
                    index: i,
                    gw_if: format!("g{i}"),
                    cloud_if: format!("c{i}"),
                    gw_addr: Ipv4Addr::new(10, 77, i as u8 + 1, 2),
                    cloud_peer: Ipv4Addr::new(10, 77, i as u8 + 1, 1),
                })
                .collect(),
            rate: opts.rate.clone(),
            queue: opts.queue,
        };
        // From here on, Drop cleans up whatever was made.
        bed.build(&opts)?;
        Ok(bed)
    }

    fn build(&self, opts: &BedOptions) -> Result<(), String> {
        let (g, c) = (self.gw.name.as_str(), self.cloud.name.as_str());
        run(&["ip", "netns", "add", g])?;
        run(&["ip", "netns", "add", c])?;
        for ns in [g, c] {
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
            for key in [
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ] {
                run(&["ip", "netns", "exec", ns, "sysctl", "-qw", key])?;
            }
        }
        let service = format!("{}/32", self.cloud_addr());
        run(&["ip", "-n", c, "addr", "add", &service, "dev", "lo"])?;
        for l in &self.links {
            run(&[
                "ip",
                "-n",
                g,
                "link",
                "add",
                &l.gw_if,
                "type",
                "veth",
                "peer",
                "name",
                &l.cloud_if,
                "netns",
                c,
            ])?;
            run(&[
                "ip",
                "-n",
                g,
                "addr",
                "add",
                &format!("{}/24", l.gw_addr),
                "dev",
                &l.gw_if,
            ])?;
            run(&[
                "ip",
                "-n",
                c,
                "addr",
                "add",
                &format!("{}/24", l.cloud_peer),
                "dev",
                &l.cloud_if,
            ])?;
            run(&["ip", "-n", g, "link", "set", &l.gw_if, "up"])?;
            run(&["ip", "-n", c, "link", "set", &l.cloud_if, "up"])?;
            let table = (100 + l.index).to_string();
            run(&[
                "ip",
                "-n",
                g,
                "rule",
                "add",
                "from",
                &l.gw_addr.to_string(),
                "table",
                &table,
            ])?;
            run(&[
                "ip",
                "-n",
                g,
                "route",
                "add",
                &service,
                "via",
                &l.cloud_peer.to_string(),
                "dev",
                &l.gw_if,
                "table",
                &table,
            ])?;
            if l.index == 0 {
                run(&[
                    "ip",
                    "-n",
                    g,
                    "route",
                    "add",
                    &service,
                    "via",
                    &l.cloud_peer.to_string(),
                    "dev",
                    &l.gw_if,
                ])?;
            }
            if let Some(rate) = &opts.rate {
                self.set_rate(l.index, rate)?;
            }
        }
        if opts.mptcp_endpoints {
            for ns in [g, c] {
                run(&[
                    "ip",
                    "-n",
                    ns,
                    "mptcp",
                    "limits",
                    "set",
                    "subflows",
                    "8",
                    "add_addr_accepted",
                    "8",
                ])?;
            }
            for l in self.links.iter().skip(1) {
                run(&[
                    "ip",
                    "-n",
                    g,
                    "mptcp",
                    "endpoint",
                    "add",
                    &l.gw_addr.to_string(),
                    "dev",
                    &l.gw_if,
                    "subflow",
                ])?;
            }
        }
        Ok(())
    }

    /// The cloud's service address (on its `lo`, reachable over every link).
    pub fn cloud_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, 1)
    }

    /// Carrier loss on link i: the cloud side goes down; the gateway side has no carrier.
    pub fn cut(&self, i: usize) -> Result<(), String> {
        run(&[
            "ip",
            "-n",
            &self.cloud.name,
            "link",
            "set",
            &self.links[i].cloud_if,
            "down",
        ])
        .map(drop)
    }

    /// The carrier comes back.
    pub fn restore(&self, i: usize) -> Result<(), String> {
        run(&[
            "ip",
            "-n",
            &self.cloud.name,
            "link",
            "set",
            &self.links[i].cloud_if,
            "up",
        ])
        .map(drop)
    }

    /// Link i drops every packet both ways, silently; its carrier stays up.
    pub fn blackhole(&self, i: usize) -> Result<(), String> {
        for (ns, dev) in self.ends(i) {
            self.tc(
                ns,
                &[
                    "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0",
                ],
            )?;
        }
        Ok(())
    }

    /// Undo `blackhole` (back to the bed's rate, or no qdisc).
    pub fn unblackhole(&self, i: usize) -> Result<(), String> {
        match self.rate.clone() {
            Some(rate) => self.set_rate(i, &rate),
            None => {
                for (ns, dev) in self.ends(i) {
                    self.tc(ns, &["qdisc", "del", "dev", dev, "root"])?;
                }
                Ok(())
            }
        }
    }

    /// Limit link i to `rate` (tc units, e.g. `"4mbit"`) on both ends with tbf (32 kbit
    /// burst, the bed's [`Queue`]).
    pub fn set_rate(&self, i: usize, rate: &str) -> Result<(), String> {
        let latency = self.queue.latency();
        for (ns, dev) in self.ends(i) {
            self.tc(
                ns,
                &[
                    "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
                    "latency", &latency,
                ],
            )?;
        }
        Ok(())
    }

    /// Link i's root qdisc counters: (gateway side, cloud side). Zeros when unreadable.
    pub fn qdisc(&self, i: usize) -> (QdiscStats, QdiscStats) {
        let read = |(ns, dev): (&str, &str)| -> QdiscStats {
            let Ok(out) = run(&[
                "ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev", dev,
            ]) else {
                return QdiscStats::default();
            };
            let Ok(serde_json::Value::Array(q)) = serde_json::from_str::<serde_json::Value>(&out)
            else {
                return QdiscStats::default();
            };
            let Some(root) = q.iter().find(|x| x["root"] == true) else {
                return QdiscStats::default();
            };
            let n = |k: &str| root[k].as_u64().unwrap_or(0);
            QdiscStats {
                bytes: n("bytes"),
                packets: n("packets"),
                drops: n("drops"),
                overlimits: n("overlimits"),
            }
        };
        let [g, c] = self.ends(i);
        (read(g), read(c))
    }

    /// Bytes sent on link i's gateway side (`/sys/class/net/…/statistics/tx_bytes`).
    pub fn tx_bytes(&self, i: usize) -> u64 {
        self.gw
            .exec(&[
                "cat",
                &format!("/sys/class/net/{}/statistics/tx_bytes", self.links[i].gw_if),
            ])
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Link i's two veth ends: (namespace, interface), gateway side first.
    fn ends(&self, i: usize) -> [(&str, &str); 2] {
        let l = &self.links[i];
        [(&self.gw.name, &l.gw_if), (&self.cloud.name, &l.cloud_if)]
    }

    fn tc(&self, ns: &str, args: &[&str]) -> Result<(), String> {
        let mut full = vec!["ip", "netns", "exec", ns, "tc"];
        full.extend_from_slice(args);
        run(&full).map(drop)
    }
}

impl Drop for TestBed {
    fn drop(&mut self) {
        for ns in [&self.gw.name, &self.cloud.name] {
            if let Ok(pids) = run(&["ip", "netns", "pids", ns]) {
                for pid in pids.split_whitespace() {
                    let _ = run(&["kill", "-9", pid]);
                }
            }
            let _ = run(&["ip", "netns", "del", ns]);
        }
    }
}
