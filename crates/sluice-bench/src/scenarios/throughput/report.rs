//! The throughput scenario's report: a line per step and the Markdown summary.

use super::*;
use crate::report::markdown::{loadavg_item, machine_line, sluice_line};

pub(super) fn step_line(s: &StepResult) -> String {
    format!(
        "[step {:>2} {:<6}] offered {:>8.0}  sent {:>8.0}  acked {:>8.0}  achieved {:>8.0} msg/s  \
         e2e p50/p99 {:.2}/{:.2} ms  ack p50/p99 {:.2}/{:.2} ms  SUT {:.0}% {:.2} µs/msg  cloud {:.0}%  \
         gen {:.0}%  machine {:.0}% (other {:.0}%)  drops w/l {}/{}  → {}",
        s.step,
        s.phase,
        s.offered_rate,
        s.sent_rate,
        s.acked_rate,
        s.achieved_rate,
        s.e2e_latency.p50_ms,
        s.e2e_latency.p99_ms,
        s.ack_latency.p50_ms,
        s.ack_latency.p99_ms,
        s.sut_cpu_percent,
        s.sut_cpu_us_per_msg,
        s.cloud_cpu_percent,
        s.generator_cpu_percent,
        s.machine_cpu_percent,
        s.other_cpu_percent,
        s.window_full_drops,
        s.late_drops,
        s.verdict
    ) + &if s.other_processes.is_empty() {
        String::new()
    } else {
        format!("  [others: {}]", s.other_processes.join(", "))
    }
}

// ------------------------------------------------------------------------------------------
// Reports
// ------------------------------------------------------------------------------------------

/// The Markdown summary: one table of maxima, then the steps of every run.
pub fn markdown(report: &ThroughputReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "### throughput: {} devices × window {}, {} B payloads, QoS 1, MQTT {}, TLS 1.3 uplink; steps of {} s ({} s warm-up) from {} msg/s ×{}, p99 bound {} ms, ≥ {:.0} % delivered\n",
        p.devices, p.window, p.payload_bytes, p.mqtt, p.step_s, p.warmup_s, p.start_rate, p.step_factor, p.p99_bound_ms, p.min_delivery * 100.0
    );
    let _ = writeln!(out, "{}\n", machine_line(m, &[loadavg_item(m)]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(out, "{}\n", sluice_line(&report.params.sluice_aggregate));
    let _ = writeln!(
        out,
        "| SUT | cloud | max sustained, msg/s | SUT CPU at max, µs/msg | SUT CPU at max, % of one core | machine CPU at max, % of all cores | what stopped the ramp | limited by |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---|---|");
    for r in &report.runs {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.2} | {:.0} | {:.0} | {} | {} |",
            r.sut.name(),
            r.cloud.name(),
            r.max_sustained_rate,
            r.sut_cpu_us_per_msg_at_max,
            r.sut_cpu_percent_at_max,
            r.machine_cpu_percent_at_max,
            r.stopped_because,
            r.limited_by.as_deref().unwrap_or("—"),
        );
    }
    for r in &report.runs {
        let _ = writeln!(
            out,
            "\n#### {} → {} ({} uplink connection{})\n",
            r.sut.name(),
            r.cloud.name(),
            r.uplink_connections,
            if r.uplink_connections == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            out,
            "| step | offered | sent | acked | achieved | e2e p50 / p99, ms | ack p50 / p99, ms | SUT CPU % | SUT µs/msg | cloud CPU % | generator CPU % | machine CPU % (other work) | drops window / late | verdict |"
        );
        let _ = writeln!(
            out,
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for s in &r.steps {
            let _ = writeln!(
                out,
                "| {}{} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} ({:.0}) | {} / {} | {}{}{}{}{} |",
                s.step,
                if s.phase == "refine" { " (refine)" } else { "" },
                s.offered_rate,
                s.sent_rate,
                s.acked_rate,
                s.achieved_rate,
                s.e2e_latency.p50_ms,
                s.e2e_latency.p99_ms,
                s.ack_latency.p50_ms,
                s.ack_latency.p99_ms,
                s.sut_cpu_percent,
                s.sut_cpu_us_per_msg,
                s.cloud_cpu_percent,
                s.generator_cpu_percent,
                s.machine_cpu_percent,
                s.other_cpu_percent,
                s.window_full_drops,
                s.late_drops,
                s.verdict,
                s.limited_by
                    .as_ref()
                    .map(|l| format!(" — limited by {l}"))
                    .unwrap_or_default(),
                if s.duplicates > 0 {
                    format!(" [{} duplicates]", s.duplicates)
                } else {
                    String::new()
                },
                match s.cooldown_drained {
                    Some(false) => " (started with a backlog: the cool-down did not drain it)",
                    _ => "",
                },
                if s.other_processes.is_empty() {
                    String::new()
                } else {
                    format!(" [other processes: {}]", s.other_processes.join(", "))
                },
            );
        }
    }
    out
}
