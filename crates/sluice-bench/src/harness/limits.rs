//! What the machine can hold: memory, process, thread, port and open-file limits (reading and
//! raising RLIMIT_NOFILE), and the admission checks that refuse a point (N connections, N agent
//! processes) that would exceed them.

use crate::harness::agent_fleet::KERNEL_KIB_PER_AGENT;

use std::process::Stdio;

use anyhow::{anyhow, Context as _};
use serde::{Deserialize, Serialize};

use crate::harness::machine::{self};
use crate::harness::procfs::Pid;

/// System limits that bound how many processes and connections a point may use.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Limits {
    pub mem_available_kib: u64,
    pub pid_max: u64,
    pub threads_max: u64,
    /// RLIMIT_NPROC (soft) of this process.
    pub max_user_processes: u64,
    /// RLIMIT_NOFILE (soft) of this process (the devices, the sink and, inherited, the cloud
    /// broker's limit).
    pub max_open_files: u64,
    /// Threads on the machine now (`/proc/loadavg`, 4th field).
    pub tasks_now: u64,
    /// Size of the local (ephemeral) port range, `ip_local_port_range`.
    pub ephemeral_ports: u64,
}

impl Limits {
    pub fn read() -> Limits {
        let read_u64 = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let loadavg = machine::loadavg();
        Limits {
            mem_available_kib: meminfo_kib(&meminfo, "MemAvailable:").unwrap_or(0),
            pid_max: read_u64("/proc/sys/kernel/pid_max").unwrap_or(32_768),
            threads_max: read_u64("/proc/sys/kernel/threads-max").unwrap_or(u64::MAX),
            max_user_processes: soft_limit(&limits, "Max processes").unwrap_or(u64::MAX),
            max_open_files: soft_limit(&limits, "Max open files").unwrap_or(1024),
            tasks_now: loadavg
                .split_whitespace()
                .nth(3)
                .and_then(|f| f.split_once('/'))
                .and_then(|(_, total)| total.parse().ok())
                .unwrap_or(0),
            ephemeral_ports: std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
                .ok()
                .and_then(|s| {
                    let mut it = s.split_whitespace().filter_map(|x| x.parse::<u64>().ok());
                    Some(it.next_back()? + 1 - it.next()?)
                })
                .unwrap_or(28_232),
        }
    }
}

/// `KEY: value kB` from `/proc/meminfo` text.
pub fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(key))?
        .trim_start_matches(key)
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The soft limit of `name` from `/proc/<pid>/limits` text ("unlimited" → `u64::MAX`).
pub fn soft_limit(text: &str, name: &str) -> Option<u64> {
    let rest = text
        .lines()
        .find(|l| l.starts_with(name))?
        .get(name.len()..)?;
    let soft = rest.split_whitespace().next()?;
    if soft == "unlimited" {
        Some(u64::MAX)
    } else {
        soft.parse().ok()
    }
}

/// Whether N device connections fit this process's open-file limit (every SUT).
pub fn admit_connections(n: u32, limits: &Limits) -> Result<(), String> {
    let need = u64::from(n) + 1024;
    if need > limits.max_open_files {
        return Err(format!(
            "{n} devices need about {need} open files in sluice-bench and in the cloud broker; \
             the limit is {} (raise it with `ulimit -n`)",
            limits.max_open_files
        ));
    }
    Ok(())
}

/// Whether N agent processes of `per_agent_kib` each fit the machine (see the module docs).
pub fn admit_agents(
    n: u32,
    per_agent_kib: u64,
    limits: &Limits,
    memory_fraction: f64,
) -> Result<(), String> {
    let projected = u64::from(n) * per_agent_kib;
    let bound = (limits.mem_available_kib as f64 * memory_fraction) as u64;
    if projected > bound {
        return Err(format!(
            "{n} agents × {:.1} MiB (measured PSS + {KERNEL_KIB_PER_AGENT} KiB kernel allowance) = \
             {:.1} GiB projected, over {:.0}% of MemAvailable ({:.1} GiB)",
            per_agent_kib as f64 / 1024.0,
            projected as f64 / 1048576.0,
            memory_fraction * 100.0,
            limits.mem_available_kib as f64 / 1048576.0
        ));
    }
    let process_limit = limits
        .pid_max
        .min(limits.threads_max)
        .min(limits.max_user_processes);
    let process_bound = process_limit / 10 * 8;
    if limits.tasks_now + u64::from(n) > process_bound {
        return Err(format!(
            "{n} agent processes on top of the {} threads already running exceed 80% of the \
             process limit ({process_limit}: min of pid_max, threads-max, ulimit -u)",
            limits.tasks_now
        ));
    }
    // Each agent takes a listening port from the ephemeral range (it binds port 0) and its
    // cloud connection takes another (all go to the same cloud address, so they cannot share).
    let ports = 2 * u64::from(n) + 2048;
    if ports > limits.ephemeral_ports {
        return Err(format!(
            "{n} agents need about {ports} local ports (a listener and a cloud connection each, \
             plus slack for connections still in TIME_WAIT) but the ephemeral range \
             (ip_local_port_range) holds {}",
            limits.ephemeral_ports
        ));
    }
    Ok(())
}

/// Files left unused below a SUT's limit when the target is "max" (accept slack, logs, the
/// odd file a SUT opens later).
pub const FD_MARGIN: u64 = 16;

/// RLIMIT_NOFILE of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdLimit {
    pub soft: u64,
    pub hard: u64,
}

/// The "Max open files" line of `/proc/<pid>/limits` ("unlimited" reads as `u64::MAX`).
pub fn fd_limit(pid: Pid) -> anyhow::Result<FdLimit> {
    let path = match pid {
        Pid::OwnProcess => "/proc/self/limits".to_string(),
        Pid::Other(p) => format!("/proc/{p}/limits"),
    };
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_fd_limit(&text).with_context(|| format!("parsing {path}"))
}

/// Parse the "Max open files" line of a `/proc/<pid>/limits` text.
pub fn parse_fd_limit(limits: &str) -> anyhow::Result<FdLimit> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .ok_or_else(|| anyhow!("no \"Max open files\" line"))?;
    let mut values = line["Max open files".len()..].split_whitespace().map(|v| {
        if v == "unlimited" {
            Ok(u64::MAX)
        } else {
            v.parse::<u64>()
                .with_context(|| format!("{v:?} is not a number"))
        }
    });
    let soft = values.next().ok_or_else(|| anyhow!("no soft limit"))??;
    let hard = values.next().ok_or_else(|| anyhow!("no hard limit"))??;
    Ok(FdLimit { soft, hard })
}

/// Open files of a process right now (entries of `/proc/<pid>/fd`).
pub fn open_fds(pid: Pid) -> anyhow::Result<u64> {
    let path = match pid {
        Pid::OwnProcess => "/proc/self/fd".to_string(),
        Pid::Other(p) => format!("/proc/{p}/fd"),
    };
    Ok(std::fs::read_dir(&path)
        .with_context(|| format!("listing {path}"))?
        .count() as u64)
}

/// This process's limit before and after [`raise_fd_limit`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct FdLimitChange {
    pub before: FdLimit,
    pub after: FdLimit,
}

/// Raise this process's soft open-file limit to its hard limit with util-linux `prlimit
/// --pid` (children spawned afterwards inherit it). Not raising it is not an error: the
/// returned `after` says what the limit is.
pub fn raise_fd_limit() -> anyhow::Result<FdLimitChange> {
    let before = fd_limit(Pid::OwnProcess)?;
    if before.soft < before.hard {
        let hard = if before.hard == u64::MAX {
            "unlimited".to_string()
        } else {
            before.hard.to_string()
        };
        let status = std::process::Command::new("prlimit")
            .arg("--pid")
            .arg(std::process::id().to_string())
            .arg(format!("--nofile={hard}:{hard}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match status {
            Ok(out) if out.status.success() => {}
            Ok(out) => tracing::warn!(
                stderr = %String::from_utf8_lossy(&out.stderr).trim(),
                "prlimit could not raise the open-file limit"
            ),
            Err(error) => tracing::warn!(%error, "prlimit (util-linux) is not available"),
        }
    }
    Ok(FdLimitChange {
        before,
        after: fd_limit(Pid::OwnProcess)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_limit_is_read_from_the_max_open_files_line() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max processes             95000                95000                processes \n\
                    Max open files            1024                 20000                files     \n";
        assert_eq!(
            parse_fd_limit(text).expect("valid limits"),
            FdLimit {
                soft: 1024,
                hard: 20000
            }
        );
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(
            parse_fd_limit(unlimited).expect("valid limits").hard,
            u64::MAX
        );
        assert!(parse_fd_limit("Max processes 1 2\n").is_err());
    }
}
