//! The machine and commit header every report carries.

use std::process::{Command, Stdio};

use serde::Serialize;

/// Where and on what the scenario ran.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub commit: String,
    /// Uncommitted changes to tracked files in the work tree at run time.
    pub worktree_dirty: bool,
    pub nproc: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub mosquitto_version: String,
    /// `/proc/loadavg` when the scenario started: other work on the machine skews CPU figures.
    pub loadavg_at_start: String,
    pub started_at: String,
    pub command_line: String,
}

/// Commit, machine and command line of a run.
pub fn machine(command_line: &str) -> Machine {
    let run = |cmd: &str, args: &[&str]| -> Option<String> {
        let out = Command::new(cmd)
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string());
    let mosquitto_version = sluice_testkit::broker::find_mosquitto()
        .ok()
        .and_then(|bin| Command::new(bin).arg("-h").output().ok())
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string());
    Machine {
        commit: run("git", &["rev-parse", "--short", "HEAD"])
            .unwrap_or_else(|| "unknown".to_string()),
        worktree_dirty: run("git", &["status", "--porcelain", "--untracked-files=no"])
            .is_some_and(|s| !s.is_empty()),
        nproc: run("nproc", &[])
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            }),
        cpu_model,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        mosquitto_version,
        loadavg_at_start: loadavg(),
        started_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        command_line: command_line.to_string(),
    }
}

/// `/proc/loadavg`, trimmed.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
