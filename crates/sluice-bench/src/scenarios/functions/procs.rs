//! What the `functions` scenario reads from Linux `/proc` beyond [`crate::harness::procfs`]:
//! the CPU of a process's children (live and reaped), and per-thread context switches.
//!
//! Owns: parsing `/proc/<pid>/stat` fields 4 (`ppid`), 14–17 (`utime`, `stime`, `cutime`,
//! `cstime`, clock ticks) and the `voluntary_ctxt_switches` / `nonvoluntary_ctxt_switches`
//! lines of `/proc/<pid>/task/<tid>/status`; [`ChildrenCpu`] and [`ThreadSample`]. Does not own:
//! when to sample (the scenario's parts).
//!
//! Children's CPU: at any instant a child's CPU is either in its own `stat` (alive, or a zombie
//! not yet reaped) or, once its parent reaped it, in the parent's `cutime + cstime` — never in
//! both. So `Σ children's utime+stime + parent's cutime+cstime` only grows, and its difference
//! over a window is what the children used in it, instances that exited included (grand-
//! children count once reaped by a child; the echo functions start none).
//!
//! Wake-ups: a thread's voluntary context switches are the times it blocked (on epoll, a
//! futex, a read) and was woken again; over an idle window they are its wake-ups.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{anyhow, Context as _};
use serde::Serialize;

use crate::harness::procfs::clock_ticks_per_second;

pub use crate::harness::procfs::{parse_stat, StatFields};

fn read_stat(path: &str) -> Option<StatFields> {
    parse_stat(&std::fs::read_to_string(path).ok()?).ok()
}

/// Pids whose parent is `parent`, with their stat fields.
pub fn children_of(parent: u32) -> Vec<(u32, StatFields)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, read_stat(&format!("/proc/{pid}/stat"))?)))
        .filter(|(_, s)| s.ppid == parent)
        .collect()
}

fn ticks(t: u64) -> Duration {
    Duration::from_nanos(t.saturating_mul(1_000_000_000 / clock_ticks_per_second()))
}

/// CPU used so far by `parent` itself, and by its children (live + reaped), plus the live
/// children's pids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyCpu {
    pub own: Duration,
    pub children: Duration,
    pub live_children: Vec<u32>,
}

/// Read [`FamilyCpu`] of `parent` now.
pub fn family_cpu(parent: u32) -> anyhow::Result<FamilyCpu> {
    let me = read_stat(&format!("/proc/{parent}/stat"))
        .ok_or_else(|| anyhow!("process {parent} is gone"))?;
    let kids = children_of(parent);
    let live: u64 = kids.iter().map(|(_, s)| s.cpu_ticks).sum();
    Ok(FamilyCpu {
        own: ticks(me.cpu_ticks),
        children: ticks(me.children_ticks + live),
        live_children: kids.into_iter().map(|(p, _)| p).collect(),
    })
}

/// `(voluntary, nonvoluntary)` context switches from a `/proc/<pid>/task/<tid>/status` text.
pub fn parse_ctxt_switches(status: &str) -> anyhow::Result<(u64, u64)> {
    let value = |key: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .ok_or_else(|| anyhow!("no {key} line"))?
            .trim()
            .parse()
            .with_context(|| format!("{key} is not a number"))
    };
    Ok((
        value("voluntary_ctxt_switches:")?,
        value("nonvoluntary_ctxt_switches:")?,
    ))
}

/// One thread's counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadCounters {
    pub comm: String,
    pub voluntary: u64,
    pub nonvoluntary: u64,
    pub cpu: Duration,
    /// Time on a CPU from `schedstat` (ns resolution; zero where the kernel has no
    /// schedstats).
    pub run: Duration,
}

/// Every thread of a process at one moment, by tid.
pub type ThreadSample = BTreeMap<u32, ThreadCounters>;

/// Read every thread of `pid` (threads that vanish while reading are skipped).
pub fn threads_of(pid: u32) -> ThreadSample {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in entries.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let dir = e.path();
        let (Ok(comm), Ok(status), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("status")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue;
        };
        let (Ok((voluntary, nonvoluntary)), Ok(s)) =
            (parse_ctxt_switches(&status), parse_stat(&stat))
        else {
            continue;
        };
        let run = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|t| t.split_whitespace().next()?.parse().ok())
            .map_or(Duration::ZERO, Duration::from_nanos);
        out.insert(
            tid,
            ThreadCounters {
                comm: comm.trim().to_string(),
                voluntary,
                nonvoluntary,
                cpu: ticks(s.cpu_ticks),
                run,
            },
        );
    }
    out
}

/// One thread over a window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThreadWindow {
    pub tid: u32,
    pub comm: String,
    /// Voluntary context switches per second (wake-ups after blocking).
    pub wakeups_per_s: f64,
    pub nonvoluntary_per_s: f64,
    /// CPU from `stat` (10 ms ticks).
    pub cpu_ms: f64,
    /// CPU from `schedstat` (ns).
    pub run_ms: f64,
    /// Whether the thread existed for the whole window (else counted from 0 or to its end).
    pub whole_window: bool,
}

/// Per-thread rates between two samples `wall` apart, busiest waker first.
pub fn thread_window(
    before: &ThreadSample,
    after: &ThreadSample,
    wall: Duration,
) -> Vec<ThreadWindow> {
    let secs = wall.as_secs_f64().max(1e-9);
    let mut out: Vec<ThreadWindow> = after
        .iter()
        .map(|(&tid, a)| {
            let b = before.get(&tid);
            let (v0, n0, c0, r0) = b.map_or((0, 0, Duration::ZERO, Duration::ZERO), |b| {
                (b.voluntary, b.nonvoluntary, b.cpu, b.run)
            });
            ThreadWindow {
                tid,
                comm: a.comm.clone(),
                wakeups_per_s: a.voluntary.saturating_sub(v0) as f64 / secs,
                nonvoluntary_per_s: a.nonvoluntary.saturating_sub(n0) as f64 / secs,
                cpu_ms: a.cpu.saturating_sub(c0).as_secs_f64() * 1e3,
                run_ms: a.run.saturating_sub(r0).as_secs_f64() * 1e3,
                whole_window: b.is_some(),
            }
        })
        .collect();
    for (&tid, b) in before {
        if !after.contains_key(&tid) {
            out.push(ThreadWindow {
                tid,
                comm: format!("{} (exited)", b.comm),
                wakeups_per_s: 0.0,
                nonvoluntary_per_s: 0.0,
                cpu_ms: 0.0,
                run_ms: 0.0,
                whole_window: false,
            });
        }
    }
    out.sort_by(|x, y| {
        y.wakeups_per_s
            .total_cmp(&x.wakeups_per_s)
            .then(x.tid.cmp(&y.tid))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_a_command_name_with_spaces_and_parens() {
        let stat = "4242 (py (echo) 1) S 77 4242 4242 0 -1 4194560 100 0 0 0 \
                    1234 567 40 2 20 0 3 0 100 1000 10 18446744073709551615";
        let s = parse_stat(stat).unwrap();
        assert_eq!(
            s,
            StatFields {
                ppid: 77,
                cpu_ticks: 1234 + 567,
                children_ticks: 42
            }
        );
        assert!(parse_stat("1 (x) S 1 2 3").is_err());
    }

    #[test]
    fn context_switches_come_from_their_two_status_lines() {
        let status = "Name:\tsluice-shard-0\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t1200\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(parse_ctxt_switches(status).unwrap(), (1200, 7));
        assert!(parse_ctxt_switches("Name:\tx\n").is_err());
    }

    #[test]
    fn thread_rates_count_new_threads_from_zero_and_list_exited_ones() {
        let t = |comm: &str, v, cpu_ms| ThreadCounters {
            comm: comm.into(),
            voluntary: v,
            nonvoluntary: 0,
            cpu: Duration::from_millis(cpu_ms),
            run: Duration::from_millis(cpu_ms),
        };
        let before: ThreadSample = [(1, t("main", 10, 5)), (2, t("gone", 3, 1))].into();
        let after: ThreadSample = [(1, t("main", 30, 7)), (3, t("new", 4, 0))].into();
        let w = thread_window(&before, &after, Duration::from_secs(2));
        assert_eq!(w[0].comm, "main");
        assert_eq!((w[0].wakeups_per_s, w[0].whole_window), (10.0, true));
        assert!((w[0].cpu_ms - 2.0).abs() < 1e-9 && (w[0].run_ms - 2.0).abs() < 1e-9);
        assert_eq!(
            (w[1].comm.as_str(), w[1].wakeups_per_s, w[1].whole_window),
            ("new", 2.0, false)
        );
        assert_eq!(w[2].comm, "gone (exited)");
    }

    #[test]
    fn own_threads_and_children_are_readable() {
        let me = std::process::id();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let fam = family_cpu(me).unwrap();
        assert!(fam.live_children.contains(&child.id()));
        assert!(!threads_of(me).is_empty());
        let _ = child.kill();
        let _ = child.wait();
    }
}
