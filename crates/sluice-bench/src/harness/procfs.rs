//! Process CPU time and resident memory from Linux `/proc`, for "how much did the system under
//! test (and this tool) use" figures.
//!
//! Owns: reading and parsing `/proc/<pid>/stat` (fields 14 `utime` and 15 `stime`, in clock
//! ticks, summed over all threads of the process; children are not included) and
//! `/proc/<pid>/status` (`VmRSS`, in KiB). Does not own: sampling schedules (the scenario runner
//! decides when to read).
//!
//! `/proc/<pid>/stat` format: `pid (comm) state ppid …`; `comm` may contain spaces and ')' so
//! fields are counted from the *last* ')'. The clock-tick rate comes from `getconf CLK_TCK`
//! (no libc call, so no `unsafe`), falling back to 100 Hz, the value on every mainstream Linux
//! configuration. Resolution is one tick (10 ms): measure over tens of seconds.

use crate::harness::limits::meminfo_kib;
use std::fs;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use serde::Serialize;

/// Which process to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pid {
    /// This process (`/proc/self`).
    OwnProcess,
    /// Another process by id.
    Other(u32),
}

impl Pid {
    fn dir(self) -> String {
        match self {
            Pid::OwnProcess => "/proc/self".to_string(),
            Pid::Other(pid) => format!("/proc/{pid}"),
        }
    }
}

/// Clock ticks per second used by `/proc/<pid>/stat`.
pub fn clock_ticks_per_second() -> u64 {
    static TICKS: OnceLock<u64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|&t| t > 0)
            .unwrap_or(100)
    })
}

/// User + system CPU time consumed so far by `pid`.
pub fn cpu_time(pid: Pid) -> anyhow::Result<Duration> {
    let path = format!("{}/stat", pid.dir());
    let text = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let ticks = parse_stat_cpu_ticks(&text).with_context(|| format!("parsing {path}"))?;
    let per_second = clock_ticks_per_second();
    Ok(Duration::from_nanos(
        ticks.saturating_mul(1_000_000_000 / per_second),
    ))
}

/// Resident set size of `pid`, in KiB.
pub fn rss_kib(pid: Pid) -> anyhow::Result<u64> {
    let path = format!("{}/status", pid.dir());
    let text = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_status_rss_kib(&text).with_context(|| format!("parsing {path}"))
}

/// The fields of `/proc/<pid>/stat` the bench reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatFields {
    pub ppid: u32,
    /// `utime + stime`, clock ticks.
    pub cpu_ticks: u64,
    /// `cutime + cstime` (reaped children's CPU), clock ticks.
    pub children_ticks: u64,
}

/// Parse a `/proc/<pid>/stat` text (fields counted after the last `)`).
pub fn parse_stat(stat: &str) -> anyhow::Result<StatFields> {
    let after_comm = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .ok_or_else(|| anyhow!("no ')' closing the command name"))?;
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let field = |n: usize| -> anyhow::Result<u64> {
        fields
            .get(n - 3)
            .ok_or_else(|| anyhow!("field {n} missing"))?
            .parse::<u64>()
            .with_context(|| format!("field {n} is not a number"))
    };
    Ok(StatFields {
        ppid: u32::try_from(field(4)?).context("ppid out of range")?,
        cpu_ticks: field(14)? + field(15)?,
        children_ticks: field(16)? + field(17)?,
    })
}

/// `utime + stime` (clock ticks) from the text of `/proc/<pid>/stat`.
pub fn parse_stat_cpu_ticks(stat: &str) -> anyhow::Result<u64> {
    parse_stat(stat).map(|f| f.cpu_ticks)
}

/// `VmRSS` in KiB from the text of `/proc/<pid>/status`.
pub fn parse_status_rss_kib(status: &str) -> anyhow::Result<u64> {
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or_else(|| anyhow!("no VmRSS line (is the process a zombie?)"))?;
    let value = line
        .trim_start_matches("VmRSS:")
        .split_whitespace()
        .next()
        .ok_or_else(|| anyhow!("VmRSS has no value"))?;
    value
        .parse::<u64>()
        .with_context(|| format!("VmRSS value {value:?} is not a number"))
}

/// CPU used by a process over a wall-clock interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CpuUsage {
    /// User + system CPU seconds over the interval.
    pub cpu_seconds: f64,
    /// Length of the interval.
    pub wall_seconds: f64,
    /// `cpu_seconds / wall_seconds`, in percent of one core (200 % = two cores busy).
    pub percent_of_one_core: f64,
}

/// A starting point for measuring a process's CPU use: take one, do the work, call
/// [`CpuMeter::usage`].
#[derive(Debug, Clone, Copy)]
pub struct CpuMeter {
    pid: Pid,
    cpu_at_start: Duration,
    wall_at_start: Instant,
}

impl CpuMeter {
    /// Read the process's CPU time now.
    pub fn start(pid: Pid) -> anyhow::Result<CpuMeter> {
        Ok(CpuMeter {
            pid,
            cpu_at_start: cpu_time(pid)?,
            wall_at_start: Instant::now(),
        })
    }

    /// CPU used since [`CpuMeter::start`].
    pub fn usage(&self) -> anyhow::Result<CpuUsage> {
        let cpu = cpu_time(self.pid)?.saturating_sub(self.cpu_at_start);
        Ok(usage_between(cpu, self.wall_at_start.elapsed()))
    }
}

/// Build a [`CpuUsage`] from CPU time used over `wall` time.
pub fn usage_between(cpu: Duration, wall: Duration) -> CpuUsage {
    let wall_seconds = wall.as_secs_f64();
    let cpu_seconds = cpu.as_secs_f64();
    let percent = if wall_seconds > 0.0 {
        100.0 * cpu_seconds / wall_seconds
    } else {
        0.0
    };
    CpuUsage {
        cpu_seconds: round3(cpu_seconds),
        wall_seconds: round3(wall_seconds),
        percent_of_one_core: round1(percent),
    }
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// utime + stime summed over `pids` (processes that are gone count 0).
pub(crate) fn cpu_sum(pids: &[u32]) -> Duration {
    pids.iter()
        .filter_map(|&p| cpu_time(Pid::Other(p)).ok())
        .sum()
}

pub(crate) fn rss_sum(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|&p| rss_kib(Pid::Other(p)).ok())
        .sum()
}

pub(crate) fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    meminfo_kib(&text, "Pss:")
}

pub(crate) fn pss_sum(pids: &[u32]) -> u64 {
    pids.iter().filter_map(|&p| pss_kib(p)).sum()
}

/// Mean PSS of up to 64 of `pids`, KiB.
pub(crate) fn per_process_pss_kib(pids: &[u32]) -> Option<u64> {
    let step = (pids.len() / 64).max(1);
    let values: Vec<u64> = pids
        .iter()
        .step_by(step)
        .filter_map(|&p| pss_kib(p))
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<u64>() / values.len() as u64)
}

/// Aggregate CPU counters of `/proc/stat` ("cpu" line), in clock ticks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MachineCpu {
    busy: u64,
    total: u64,
}

impl MachineCpu {
    pub(crate) fn read() -> MachineCpu {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let fields: Vec<u64> = text
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .take(8)
            .filter_map(|f| f.parse().ok())
            .collect();
        let total: u64 = fields.iter().sum();
        let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
        MachineCpu {
            busy: total.saturating_sub(idle),
            total,
        }
    }

    pub(crate) fn busy_percent_since(&self, start: &MachineCpu) -> f64 {
        let total = self.total.saturating_sub(start.total);
        if total == 0 {
            return 0.0;
        }
        100.0 * self.busy.saturating_sub(start.busy) as f64 / total as f64
    }
}

/// `rchar` of /proc/PID/io: bytes the process read through read-like syscalls (0 if unknown).
pub(crate) fn read_chars(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("rchar:").map(|v| v.trim().parse().ok()))
                .flatten()
        })
        .unwrap_or(0)
}

/// CPU time used so far by this process's threads whose name starts with `prefix`.
pub(crate) fn threads_cpu(prefix: &str) -> Duration {
    let Ok(entries) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let per_second = clock_ticks_per_second();
    let mut ticks = 0u64;
    for entry in entries.flatten() {
        let dir = entry.path();
        let named = std::fs::read_to_string(dir.join("comm"))
            .map(|c| c.trim().starts_with(prefix))
            .unwrap_or(false);
        if !named {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(dir.join("stat")) {
            ticks += parse_stat_cpu_ticks(&stat).unwrap_or(0);
        }
    }
    Duration::from_nanos(ticks.saturating_mul(1_000_000_000 / per_second))
}

/// CPU ticks so far of every process: pid → (command name, utime + stime).
pub(crate) fn process_cpu_ticks() -> std::collections::HashMap<u32, (String, u64)> {
    let mut out = std::collections::HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let comm = stat
            .find('(')
            .zip(stat.rfind(')'))
            .and_then(|(a, b)| stat.get(a + 1..b))
            .unwrap_or("?")
            .to_string();
        if let Ok(ticks) = parse_stat_cpu_ticks(&stat) {
            out.insert(pid, (comm, ticks));
        }
    }
    out
}

/// Processes other than `ours` that used at least 2 % of one core between two snapshots,
/// busiest first, at most five: "comm (pid) N %".
pub(crate) fn busiest_others(
    before: &std::collections::HashMap<u32, (String, u64)>,
    after: &std::collections::HashMap<u32, (String, u64)>,
    ours: &[u32],
    wall: Duration,
) -> Vec<String> {
    let ticks_per_s = clock_ticks_per_second() as f64;
    let secs = wall.as_secs_f64().max(1e-9);
    let mut busy: Vec<(f64, String)> = after
        .iter()
        .filter(|(pid, _)| !ours.contains(pid))
        .filter_map(|(pid, (comm, ticks))| {
            let start = before.get(pid).map_or(0, |(_, t)| *t);
            let percent = ticks.saturating_sub(start) as f64 / ticks_per_s / secs * 100.0;
            (percent >= 2.0).then(|| (percent, format!("{comm} ({pid}) {percent:.0} %")))
        })
        .collect();
    busy.sort_by(|a, b| b.0.total_cmp(&a.0));
    busy.into_iter().take(5).map(|(_, s)| s).collect()
}

/// (busy, total) jiffies of all CPUs from the first line of /proc/stat.
pub(crate) fn machine_cpu() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().next() else {
        return (0, 0);
    };
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    // idle (4th) and iowait (5th) are not busy.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

pub(crate) fn machine_cpu_percent(before: (u64, u64), after: (u64, u64)) -> f64 {
    let total = after.1.saturating_sub(before.1);
    if total == 0 {
        return 0.0;
    }
    round1(after.0.saturating_sub(before.0) as f64 / total as f64 * 100.0)
}

/// CPU time used so far by each thread name (`comm`) of process `pid` (threads of one name
/// summed), from `/proc/<pid>/task/*/stat`. Empty when the process is gone.
pub(crate) fn task_cpu_by_name(pid: u32) -> std::collections::BTreeMap<String, Duration> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    let ns_per_tick = 1_000_000_000 / clock_ticks_per_second();
    for entry in entries.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let comm = stat
            .find('(')
            .zip(stat.rfind(')'))
            .and_then(|(a, b)| stat.get(a + 1..b))
            .unwrap_or("?")
            .to_string();
        if let Ok(ticks) = parse_stat_cpu_ticks(&stat) {
            *out.entry(comm).or_insert(Duration::ZERO) +=
                Duration::from_nanos(ticks.saturating_mul(ns_per_tick));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_after_a_command_name_with_spaces_and_parens() {
        let stat = "4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    1234 567 0 0 20 0 3 0 100 1000 10 18446744073709551615";
        assert_eq!(parse_stat_cpu_ticks(stat).expect("valid stat"), 1234 + 567);
    }

    #[test]
    fn truncated_stat_is_an_error() {
        assert!(parse_stat_cpu_ticks("1 (x) S 1 2").is_err());
        assert!(parse_stat_cpu_ticks("garbage").is_err());
    }

    #[test]
    fn rss_is_read_from_the_vmrss_line() {
        let status = "Name:\tmosquitto\nVmPeak:\t  20000 kB\nVmRSS:\t    8124 kB\nThreads:\t1\n";
        assert_eq!(parse_status_rss_kib(status).expect("valid status"), 8124);
        assert!(parse_status_rss_kib("Name:\tzombie\n").is_err());
    }

    #[test]
    fn own_process_figures_are_readable() {
        assert!(cpu_time(Pid::OwnProcess).is_ok());
        assert!(rss_kib(Pid::OwnProcess).expect("own VmRSS") > 0);
    }
}
