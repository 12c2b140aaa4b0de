//! Pieces every Markdown report shares: the machine line under the title and the line saying
//! how sluice aggregated.

use crate::harness::machine::Machine;
use crate::harness::sut::AggregateOpts;

/// The machine line of a report: `commit `abc1234`[ (work tree dirty)] · nproc N · CPU … ·
/// kernel … · <mosquitto version>`, then ` · item` for each of `extra` (the load average, the
/// start time, what else the scenario wants a reader to see). No trailing newline.
pub fn machine_line(m: &Machine, extra: &[String]) -> String {
    let mut line = format!(
        "commit `{}`{} · nproc {} · CPU {} · kernel {} · {}",
        m.commit,
        if m.worktree_dirty {
            " (work tree dirty)"
        } else {
            ""
        },
        m.nproc,
        m.cpu_model,
        m.kernel,
        m.mosquitto_version
    );
    for item in extra {
        line.push_str(" · ");
        line.push_str(item);
    }
    line
}

/// The line saying how sluice aggregated: `sluice: <describe>`.
pub fn sluice_line(aggregate: &AggregateOpts) -> String {
    format!("sluice: {}", aggregate.describe())
}

/// `loadavg at start …`, the usual extra item of [`machine_line`].
pub fn loadavg_item(m: &Machine) -> String {
    format!("loadavg at start {}", m.loadavg_at_start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(dirty: bool) -> Machine {
        Machine {
            commit: "abc1234".to_string(),
            worktree_dirty: dirty,
            nproc: 2,
            cpu_model: "Test CPU".to_string(),
            kernel: "6.1.0".to_string(),
            mosquitto_version: "mosquitto version 2.0.18".to_string(),
            loadavg_at_start: "0.50 0.40 0.30 1/100 42".to_string(),
            started_at: "2026-11-24T15:00:00Z".to_string(),
            command_line: "sluice-bench scenario core".to_string(),
        }
    }

    #[test]
    fn the_machine_line_lists_commit_cores_cpu_kernel_broker_and_the_extras() {
        let m = machine(true);
        assert_eq!(
            machine_line(&m, &[loadavg_item(&m), "started x".to_string()]),
            "commit `abc1234` (work tree dirty) · nproc 2 · CPU Test CPU · kernel 6.1.0 · \
             mosquitto version 2.0.18 · loadavg at start 0.50 0.40 0.30 1/100 42 · started x"
        );
        assert_eq!(
            machine_line(&machine(false), &[]),
            "commit `abc1234` · nproc 2 · CPU Test CPU · kernel 6.1.0 · mosquitto version 2.0.18"
        );
    }
}
