//! Network namespaces, a veth link between them, and tc on it: two namespaces (gateway and
//! cloud) joined by a veth pair with fixed addresses, child processes started inside one
//! (`NsChild`, stopped and reaped on drop), the link's rate limit (a one-class htb) and its
//! `tc -s` statistics, and the preflight check (root, `ip`, `tc`). Every namespace and child is
//! a guard whose `Drop` removes it; namespaces left by a killed run (`slp-*-PID-*` whose PID is
//! gone) are deleted by `remove_stale_namespaces`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};

/// Address of `veth0` (gateway side) and of `veth1` (cloud side).
pub(crate) const GW_ADDR: &str = "10.231.0.1";
pub(crate) const CLOUD_ADDR: &str = "10.231.0.2";
pub(crate) const PREFIX_LEN: u8 = 30;
pub(crate) const CLOUD_PORT: u16 = 8883;
pub(crate) const DEVICE_PORT: u16 = 1883;
pub(crate) const GW_IF: &str = "veth0";
pub(crate) const CLOUD_IF: &str = "veth1";

/// Cancellation shared by the scenario thread's waits.
pub(crate) struct Cancel<'a>(pub(crate) &'a AtomicBool);

impl Cancel<'_> {
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        if self.0.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }
    /// Sleep `d`, waking early (with an error) when cancelled.
    pub(crate) fn sleep(&self, d: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + d;
        loop {
            self.check()?;
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            std::thread::sleep((until - now).min(Duration::from_millis(50)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Children

/// A child process in a namespace; dropping it stops it (SIGTERM, 5 s, SIGKILL) and reaps it.
pub(crate) struct NsChild {
    pub(crate) what: &'static str,
    pub(crate) child: Child,
    pub(crate) stderr_path: PathBuf,
    pub(crate) exited: Option<ExitStatus>,
}

impl NsChild {
    pub(crate) fn has_exited(&mut self) -> bool {
        if self.exited.is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exited = Some(status);
            }
        }
        self.exited.is_some()
    }

    /// Wait for the child to exit by itself, at most `limit`.
    pub(crate) fn wait(&mut self, limit: Duration, cancel: &Cancel) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if self.has_exited() {
                return self.exited.ok_or_else(|| anyhow!("no exit status"));
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not finish within {limit:?}:\n{}",
                    self.what,
                    self.stderr_tail(20)
                );
            }
            cancel.sleep(Duration::from_millis(50))?;
        }
    }

    /// The last `lines` lines of its output, without terminal colour codes.
    pub(crate) fn stderr_tail(&self, lines: usize) -> String {
        strip_ansi(&tail(
            &std::fs::read_to_string(&self.stderr_path).unwrap_or_default(),
            lines,
        ))
    }
}

impl Drop for NsChild {
    fn drop(&mut self) {
        if self.has_exited() {
            return;
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.has_exited() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cloud Mosquitto in the cloud namespace.
pub(crate) struct CloudBroker {
    pub(crate) child: NsChild,
    pub(crate) log_path: PathBuf,
}

impl CloudBroker {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// Namespaces and the link

/// The two namespaces and the veth pair; dropping it deletes both namespaces (and so the pair).
pub(crate) struct Namespaces {
    pub(crate) gw: String,
    pub(crate) cloud: String,
}

impl Namespaces {
    pub(crate) fn create() -> anyhow::Result<Namespaces> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let gw = format!("slp-gw-{pid}-{k}");
        let cloud = format!("slp-cloud-{pid}-{k}");
        ip(&["netns", "add", &gw]).map_err(|e| {
            anyhow!(
                "cannot create network namespace {gw}: {e:#}\nscenario priority needs root \
                 (CAP_SYS_ADMIN and CAP_NET_ADMIN) on a kernel with network namespaces and veth"
            )
        })?;
        // From here on, Drop deletes whatever exists.
        let mut net = Namespaces {
            gw,
            cloud: String::new(),
        };
        ip(&["netns", "add", &cloud])
            .with_context(|| format!("creating network namespace {cloud}"))?;
        net.cloud = cloud;
        let (gw, cloud) = (net.gw.as_str(), net.cloud.as_str());
        ip(&[
            "-n", gw, "link", "add", GW_IF, "type", "veth", "peer", "name", CLOUD_IF, "netns",
            cloud,
        ])
        .context("creating the veth pair (is the veth module available?)")?;
        let gw_cidr = format!("{GW_ADDR}/{PREFIX_LEN}");
        let cloud_cidr = format!("{CLOUD_ADDR}/{PREFIX_LEN}");
        ip(&["-n", gw, "addr", "add", &gw_cidr, "dev", GW_IF])?;
        ip(&["-n", cloud, "addr", "add", &cloud_cidr, "dev", CLOUD_IF])?;
        // MTU-sized packets at the qdisc, as on a real slow link.
        ip(&["-n", gw, "link", "set", GW_IF, "gso_max_segs", "1"])?;
        for (ns, dev) in [(gw, GW_IF), (gw, "lo"), (cloud, CLOUD_IF), (cloud, "lo")] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(net)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [&self.gw, &self.cloud] {
            if !ns.is_empty() {
                let _ = Command::new("ip")
                    .args(["netns", "del", ns])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

/// Delete `slp-gw-PID-K` / `slp-cloud-PID-K` namespaces whose PID no longer runs (left by a
/// killed scenario).
pub(crate) fn remove_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if let Some(pid) = stale_namespace_pid(name) {
            if !process_alive(pid) {
                eprintln!(
                    "scenario priority: deleting namespace {name} left by a run that is gone"
                );
                let _ = Command::new("ip").args(["netns", "del", name]).status();
            }
        }
    }
}

/// Whether `pid` runs (exists and is not a zombie waiting to be reaped).
pub(crate) fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s.get(i + 1..))
                .map(|rest| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// The PID in a scenario namespace name, e.g. `slp-gw-1234-0` → 1234.
pub fn stale_namespace_pid(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("slp-gw-")
        .or_else(|| name.strip_prefix("slp-cloud-"))?;
    let (pid, k) = rest.split_once('-')?;
    k.parse::<u32>().ok()?;
    pid.parse().ok()
}

/// Remove whatever root qdisc veth0 has (back to the default).
pub(crate) fn reset_link(gw: &str) -> anyhow::Result<()> {
    // "Cannot delete qdisc with handle of zero" when there is none: fine.
    let _ = tc(gw, &["qdisc", "del", "dev", GW_IF, "root"]);
    Ok(())
}

/// The single-class limit of the `off` and `lanes` modes; returns the commands run.
pub(crate) fn limit_link(gw: &str, rate: &str) -> anyhow::Result<Vec<String>> {
    let commands: [&[&str]; 3] = [
        &[
            "qdisc", "replace", "dev", GW_IF, "root", "handle", "1:", "htb", "default", "1",
        ],
        &[
            "class", "add", "dev", GW_IF, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
            "ceil", rate,
        ],
        &[
            "qdisc",
            "add",
            "dev",
            GW_IF,
            "parent",
            "1:1",
            "handle",
            "10:",
            "pfifo_fast",
        ],
    ];
    let mut done = Vec::new();
    for args in commands {
        tc(gw, args).context("limiting the uplink")?;
        done.push(format!("tc {}", args.join(" ")));
    }
    Ok(done)
}

pub(crate) fn tc_stats(gw: &str) -> String {
    let mut out = String::new();
    for args in [
        &["-s", "qdisc", "show", "dev", GW_IF][..],
        &["-s", "class", "show", "dev", GW_IF][..],
        &["filter", "show", "dev", GW_IF][..],
    ] {
        let _ = writeln!(out, "$ tc {}", args.join(" "));
        match tc(gw, args) {
            Ok(text) => out.push_str(&text),
            Err(e) => {
                let _ = writeln!(out, "({e:#})");
            }
        }
    }
    out
}

/// `tc -n NS ARGS`; stdout.
pub(crate) fn tc(ns: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut argv = vec!["-n", ns];
    argv.extend_from_slice(args);
    run_tool("tc", &argv)
}

pub(crate) fn ip(args: &[&str]) -> anyhow::Result<String> {
    run_tool("ip", args)
}

pub(crate) fn run_tool(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} (install iproute2)"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether something listens on TCP `port` inside `ns`.
pub(crate) fn listening(ns: &str, port: u16) -> bool {
    Command::new("ip")
        .args(["netns", "exec", ns, "ss", "-Hltn"])
        .arg(format!("sport = :{port}"))
        .stderr(Stdio::null())
        .output()
        .map(|o| o.status.success() && !String::from_utf8_lossy(&o.stdout).trim().is_empty())
        .unwrap_or(false)
}

/// Root, and the tools the scenario runs.
pub(crate) fn preflight() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if effective_uid(&status) != Some(0) {
        bail!(
            "scenario priority needs root: it creates network namespaces, a veth pair and tc \
             qdiscs (CAP_SYS_ADMIN and CAP_NET_ADMIN); run it with sudo"
        );
    }
    for tool in ["ip", "tc", "ss"] {
        if !which(tool) {
            bail!("scenario priority needs `{tool}` (install iproute2)");
        }
    }
    sluice_testkit::broker::find_mosquitto()
        .context("scenario priority needs mosquitto (apt-get install mosquitto)")?;
    Ok(())
}

/// The effective uid from a `/proc/<pid>/status` text.
pub fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

pub(crate) fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
                .any(|dir| dir.join(tool).is_file())
        })
        .unwrap_or(false)
}

pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `text` without ANSI escape sequences (`ESC [ … letter`), which tracing writes even to files.
pub(crate) fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
