//! A CPU constraint for the processes under test: pinned to one core (taskset) and put in a
//! child cgroup with a CPU quota (cgroup v2 or v1 cpu controller); removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::Serialize;

/// The CPU constraint of one point: a child cgroup with a quota (v2 `cpu.max` where the cpu
/// controller is available to cgroup v2, else v1 `cpu.cfs_quota_us`), plus taskset to one core.
/// Dropping it moves any process still inside back to the parent cgroup and removes the child.
pub(crate) struct CpuCage {
    pub(crate) constraint: Constraint,
    pub(crate) cgroup: Option<Cgroup>,
}

#[derive(Debug, Clone)]
pub(crate) struct Cgroup {
    pub(crate) dir: PathBuf,
    pub(crate) parent: PathBuf,
    pub(crate) version: u8,
}

/// cgroup hierarchies found in `/proc/mounts`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupMounts {
    /// cgroup v2 mount point and whether "cpu" is in its `cgroup.controllers`.
    pub v2: Option<(PathBuf, bool)>,
    /// cgroup v1 mount point of the `cpu` controller.
    pub v1_cpu: Option<PathBuf>,
}

/// Find the cgroup mounts in `/proc/mounts` text; `v2_has_cpu` reads a v2 root's controllers.
pub fn parse_cgroup_mounts(mounts: &str, v2_has_cpu: impl Fn(&Path) -> bool) -> CgroupMounts {
    let mut found = CgroupMounts::default();
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(dir), Some(kind), Some(opts)) = (fields.get(1), fields.get(2), fields.get(3))
        else {
            continue;
        };
        let dir = PathBuf::from(dir);
        match *kind {
            "cgroup2" if found.v2.is_none() => {
                let cpu = v2_has_cpu(&dir);
                found.v2 = Some((dir, cpu));
            }
            "cgroup" if opts.split(',').any(|o| o == "cpu") && found.v1_cpu.is_none() => {
                found.v1_cpu = Some(dir);
            }
            _ => {}
        }
    }
    found
}

impl CpuCage {
    pub(crate) fn mounts() -> CgroupMounts {
        let text = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        parse_cgroup_mounts(&text, |dir| {
            std::fs::read_to_string(dir.join("cgroup.controllers"))
                .map(|c| c.split_whitespace().any(|x| x == "cpu"))
                .unwrap_or(false)
        })
    }

    /// How a constraint will be applied here, without applying it.
    pub(crate) fn describe(c: Constraint) -> (String, Vec<String>) {
        let probe = CpuCage::create(c);
        let mechanism = match &probe.cgroup {
            Some(g) if g.version == 2 => format!(
                "taskset to core {} + cgroup v2 cpu.max {}% of one core",
                c.core, c.quota_percent
            ),
            Some(_) => format!(
                "taskset to core {} + cgroup v1 cpu.cfs_quota_us {}% of one core",
                c.core, c.quota_percent
            ),
            None => format!("taskset to core {} only (no CPU quota)", c.core),
        };
        let mut notes = Vec::new();
        let m = CpuCage::mounts();
        match &m.v2 {
            None => notes.push("no cgroup v2 hierarchy is mounted".to_string()),
            Some((dir, false)) => notes.push(format!(
                "cgroup v2 is mounted at {} but its cpu controller is not available there \
                 (cgroup.controllers lacks \"cpu\"; on this hybrid set-up it is bound to the v1 \
                 hierarchy), so cpu.max cannot be used",
                dir.display()
            )),
            Some((_, true)) => {}
        }
        if probe.cgroup.is_none() {
            notes.push(
                "no writable cgroup with a cpu controller was found: the SUT is only pinned \
                 to one core and may use all of it"
                    .to_string(),
            );
        }
        (mechanism, notes)
    }

    pub(crate) fn create(c: Constraint) -> CpuCage {
        let m = CpuCage::mounts();
        let name = format!("sluice-bench-seganet-{}", std::process::id());
        let quota_us = u64::from(c.quota_percent) * 1000;
        let cgroup = match (&m.v2, &m.v1_cpu) {
            (Some((root, true)), _) => {
                let dir = root.join(&name);
                let ok = std::fs::create_dir_all(&dir).is_ok()
                    && std::fs::write(dir.join("cpu.max"), format!("{quota_us} 100000")).is_ok();
                if ok {
                    Some(Cgroup {
                        dir,
                        parent: root.clone(),
                        version: 2,
                    })
                } else {
                    let _ = std::fs::remove_dir(&dir);
                    None
                }
            }
            (_, Some(root)) => {
                let dir = root.join(&name);
                let ok = std::fs::create_dir_all(&dir).is_ok()
                    && std::fs::write(dir.join("cpu.cfs_period_us"), "100000").is_ok()
                    && std::fs::write(dir.join("cpu.cfs_quota_us"), quota_us.to_string()).is_ok();
                if ok {
                    Some(Cgroup {
                        dir,
                        parent: root.clone(),
                        version: 1,
                    })
                } else {
                    let _ = std::fs::remove_dir(&dir);
                    None
                }
            }
            _ => None,
        };
        CpuCage {
            constraint: c,
            cgroup,
        }
    }

    /// Move `pids` into the cgroup and, if `pin`, pin all their threads to the core (agents are
    /// started under `taskset` already).
    pub(crate) fn confine(&self, pids: &[u32], pin: bool) -> anyhow::Result<()> {
        if let Some(g) = &self.cgroup {
            for pid in pids {
                std::fs::write(g.dir.join("cgroup.procs"), pid.to_string()).with_context(|| {
                    format!("moving pid {pid} into the cgroup {}", g.dir.display())
                })?;
            }
        }
        if pin {
            for pid in pids {
                let status = Command::new("taskset")
                    .args(["-a", "-p", "-c"])
                    .arg(self.constraint.core.to_string())
                    .arg(pid.to_string())
                    .stdout(Stdio::null())
                    .status()
                    .context("running taskset")?;
                if !status.success() {
                    bail!(
                        "taskset could not pin pid {pid} to core {}",
                        self.constraint.core
                    );
                }
            }
        }
        Ok(())
    }

    /// The cgroup's throttling counters so far.
    pub(crate) fn throttling(&self) -> Option<Throttling> {
        let g = self.cgroup.as_ref()?;
        let text = std::fs::read_to_string(g.dir.join("cpu.stat")).ok()?;
        let field = |key: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        };
        let throttled_s = if g.version == 2 {
            field("throttled_usec ")? as f64 / 1e6
        } else {
            field("throttled_time ")? as f64 / 1e9
        };
        Some(Throttling {
            periods: field("nr_periods ")?,
            throttled_periods: field("nr_throttled ")?,
            throttled_s,
        })
    }
}

impl Drop for CpuCage {
    fn drop(&mut self) {
        let Some(g) = &self.cgroup else {
            return;
        };
        for _ in 0..50 {
            if std::fs::remove_dir(&g.dir).is_ok() {
                return;
            }
            let procs = std::fs::read_to_string(g.dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.split_whitespace() {
                let _ = std::fs::write(g.parent.join("cgroup.procs"), pid);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(dir = %g.dir.display(), "could not remove the benchmark cgroup");
    }
}

/// "Raspberry Pi-class" gateway: one core, a fraction of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Constraint {
    /// The core every SUT process is pinned to.
    pub core: u32,
    /// CPU quota of the SUT's cgroup, % of one core.
    pub quota_percent: u32,
}

/// CPU throttling of the SUT's cgroup over the point (constrained runs).
#[derive(Debug, Clone, Serialize)]
pub struct Throttling {
    pub periods: u64,
    pub throttled_periods: u64,
    pub throttled_s: f64,
}
