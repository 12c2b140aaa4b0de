//! The seganet scenario's reports: per-point lines, the Markdown report, the charts and the
//! JSON/Markdown/PNG files.

use super::*;
use crate::report::markdown::{loadavg_item, machine_line, sluice_line};

/// One line per point, for stderr.
pub(super) fn point_line(p: &PointReport) -> String {
    match (&p.measurement, &p.reason) {
        (Some(m), _) => format!(
            "{} N={}: delivery {:.6} ({} of {}), sent {:.0}/s of {:.0}/s offered, e2e p50/p99 {:.2}/{:.2} ms, \
             ack p99 {:.2} ms, SUT CPU {:.1}% ({} processes), RSS peak {:.1} MiB, PSS {:.1} MiB, tool CPU {:.1}%, \
             machine busy {:.0}%, limited by: {}",
            p.sut.name(),
            p.n,
            m.delivery_ratio,
            m.unique_received,
            m.sent,
            m.achieved_send_rate,
            m.offered_rate,
            m.e2e_latency.p50_ms,
            m.e2e_latency.p99_ms,
            m.ack_latency.p99_ms,
            m.sut_cpu_percent,
            m.sut_processes,
            m.sut_rss_peak_kib as f64 / 1024.0,
            m.sut_pss_end_kib as f64 / 1024.0,
            m.tool_cpu_percent,
            m.machine_busy_percent,
            m.limited_by
        ),
        (None, reason) => format!(
            "{} N={}: {:?} — {}",
            p.sut.name(),
            p.n,
            p.status,
            reason.as_deref().unwrap_or("")
        ),
    }
}

/// Write `{name}.json`, `{name}.md` and the charts.
pub fn write_reports(report: &SeganetReport, out: &ReportFiles) -> anyhow::Result<()> {
    std::fs::create_dir_all(&out.dir).with_context(|| format!("creating {}", out.dir.display()))?;
    let json = serde_json::to_string_pretty(report).context("serialising the report")?;
    let json_path = out.path(".json");
    std::fs::write(&json_path, format!("{json}\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    for (suffix, chart) in charts_of(report) {
        charts::write_png(&chart, &out.path(suffix))?;
    }
    let md_path = out.path(".md");
    std::fs::write(&md_path, markdown(report, &out.name))
        .with_context(|| format!("writing {}", md_path.display()))?;
    Ok(())
}

pub(super) fn series(report: &SeganetReport, value: fn(&Measurement) -> f64) -> Vec<Series> {
    report
        .params
        .suts
        .iter()
        .map(|&sut| Series {
            label: sut.name().to_string(),
            points: report
                .points
                .iter()
                .filter(|p| p.sut == sut)
                .filter_map(|p| {
                    let m = p.measurement.as_ref()?;
                    Some(ChartPoint {
                        n: f64::from(p.n),
                        value: value(m),
                        hollow: m.limited_by != "-",
                    })
                })
                .collect(),
        })
        .collect()
}

/// The charts of a report, with their file suffixes.
pub fn charts_of(report: &SeganetReport) -> Vec<(&'static str, Chart)> {
    let setting = match &report.constraint {
        Some(c) => format!(", SUT on 1 core at {}%", c.quota_percent),
        None => String::new(),
    };
    let load = format!(
        "{} msg/s per device, QoS 1, TLS 1.3 uplink{setting}",
        report.params.rate_per_device
    );
    let footnote = Some(
        "hollow marker: the point did not sustain the offered load (see 'limited by' in the report)"
            .to_string(),
    );
    vec![
        (
            "-p99.png",
            Chart {
                title: format!("p99 end-to-end latency vs devices ({load})"),
                y_label: "p99 latency, ms (log scale)".to_string(),
                log_y: true,
                footnote: footnote.clone(),
                series: series(report, |m| m.e2e_latency.p99_ms),
            },
        ),
        (
            "-cpu.png",
            Chart {
                title: format!("Gateway CPU vs devices ({load})"),
                y_label: "CPU, % of one core (all SUT processes)".to_string(),
                log_y: false,
                footnote: footnote.clone(),
                series: series(report, |m| m.sut_cpu_percent),
            },
        ),
        (
            "-rss.png",
            Chart {
                title: format!("Gateway memory vs devices ({load})"),
                y_label: "PSS at end, MiB (log scale)".to_string(),
                log_y: true,
                footnote,
                series: series(report, |m| m.sut_pss_end_kib as f64 / 1024.0),
            },
        ),
    ]
}

/// The Markdown report (machine, command, table, charts, skipped points, caveats).
pub fn markdown(report: &SeganetReport, name: &str) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "# SegaNet experiment{}: {}\n",
        if report.constraint.is_some() {
            " (constrained SUT)"
        } else {
            ""
        },
        p.suts
            .iter()
            .map(|s| match s {
                SegaSut::Sluice => "sluice",
                SegaSut::Agents => "per-device agents",
                SegaSut::MosquittoBridge => "Mosquitto bridge",
            })
            .collect::<Vec<_>>()
            .join(" vs ")
    );
    let _ = writeln!(
        out,
        "Generated by `sluice-bench scenario seganet`; raw figures in [`{name}.json`]({name}.json).\n"
    );
    let _ = writeln!(
        out,
        "{}\n",
        machine_line(m, &[loadavg_item(m), format!("started {}", m.started_at)])
    );
    let _ = writeln!(out, "```sh\n{}\n```\n", m.command_line);
    let _ = writeln!(out, "{}\n", sluice_line(&report.params.sluice_aggregate));
    let _ = writeln!(
        out,
        "Load: N devices × {} msg/s, payload {}..{} B, QoS {}, MQTT {}; uplink TLS 1.3, QoS 1. \
         Each point {} s ({} s ramp, {} s settle, steady-state window {} s).\n",
        p.rate_per_device,
        p.payload_min,
        p.payload_max,
        p.qos,
        p.mqtt,
        p.duration_s,
        round3(p.ramp_s),
        round3(p.settle_s),
        round3(p.steady_window_s)
    );
    if let Some(c) = &report.constraint {
        let _ = writeln!(out, "Constraint: {}.", c.mechanism);
        for note in &c.notes {
            let _ = writeln!(out, "- {note}");
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "## Charts\n");
    for (suffix, chart) in charts_of(report) {
        let _ = writeln!(out, "![{}]({name}{suffix})\n", chart.title);
    }
    let _ = writeln!(out, "## Results\n");
    let _ = writeln!(out, "{}", table(report));
    let failed: Vec<&PointReport> = report
        .points
        .iter()
        .filter(|p| p.status != PointStatus::Measured)
        .collect();
    if !failed.is_empty() {
        let _ = writeln!(out, "### Points not measured\n");
        for p in failed {
            let _ = writeln!(
                out,
                "- **{} N={}** ({:?}): {}",
                p.sut.name(),
                p.n,
                p.status,
                one_line(p.reason.as_deref().unwrap_or(""))
            );
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "## How to read it\n");
    let _ = writeln!(
        out,
        "- **e2e** = sink receive time − send timestamp in the payload (same clock), messages sent \
         in the steady-state window. **ack** = device PUBLISH → PUBACK. sluice and the agents \
         acknowledge a device only after the cloud acknowledged the message; the Mosquitto bridge \
         acknowledges on receipt, so its ack latency is not like for like.\n\
         - **SUT CPU** = utime + stime summed over every SUT process (N processes for `agents`) \
         over the window, % of one core; **µs/msg** divides by the PUBACKs received in the window.\n\
         - **RSS** sums VmRSS over the SUT processes (for `agents` this counts the shared binary \
         and libraries N times); **PSS** (from smaps_rollup, at the end) shares those pages out \
         and is the better measure of memory the agents really take.\n\
         - **offered / sent / acked** rates are per second over the window. **limited by** says \
         what kept a point from sustaining its offered load (`-`: nothing): SUT \
         backpressure (device in-flight windows of 64 full, ticks skipped), the SUT falling \
         behind (sent at the offered rate but acknowledged more slowly: a backlog grows and \
         latency is dominated by queueing), the load generator, or both cores saturated. \
         Hollow markers in the charts are such points.\n\
         - **machine busy** = all non-idle CPU time of the machine over the window (both cores = \
         100%), including other users of the machine."
    );
    let _ = writeln!(out, "\n## Caveats\n");
    let _ = writeln!(
        out,
        "- Everything (devices, sink, cloud broker, SUT) shares {} cores; the load generator \
         costs CPU per message, so at large N the generator — not the SUT — may cap the rate. \
         Read `sent/s` against `offered/s` and the tool's CPU before comparing SUTs at a point.\n\
         - Other engineers' builds and benchmarks may run on the same machine: see the load \
         average at start and at the end of each window.\n\
         - One run per point; no repetitions, so differences of a few percent are within noise.",
        m.nproc
    );
    out
}

/// A multi-line reason on one line, repeated lines (e.g. the same error from many agents)
/// written once with a count.
pub(super) fn one_line(text: &str) -> String {
    let mut parts: Vec<(String, usize)> = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match parts.iter_mut().find(|(l, _)| l == line) {
            Some((_, count)) => *count += 1,
            None => parts.push((line.to_string(), 1)),
        }
    }
    parts
        .into_iter()
        .map(|(line, count)| match count {
            1 => line,
            n => format!("{line} (×{n})"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn table(report: &SeganetReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| SUT | N | procs | offered/s | sent/s | acked/s | delivery | e2e p50 / p99 ms | ack p99 ms | \
         SUT CPU % | µs/msg | RSS peak MiB | PSS MiB | tool CPU % | cloud CPU % | cloud PUBLISH/s | cloud records/s | cloud bytes in/s | machine busy % | limited by | loadavg (window end) |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    );
    for p in &report.points {
        match &p.measurement {
            Some(m) => {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.6} | {:.2} / {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |",
                    p.sut.name(),
                    p.n,
                    m.sut_processes,
                    m.offered_rate,
                    m.achieved_send_rate,
                    m.acked_rate,
                    m.delivery_ratio,
                    m.e2e_latency.p50_ms,
                    m.e2e_latency.p99_ms,
                    m.ack_latency.p99_ms,
                    m.sut_cpu_percent,
                    m.sut_cpu_us_per_msg,
                    m.sut_rss_peak_kib as f64 / 1024.0,
                    m.sut_pss_end_kib as f64 / 1024.0,
                    m.tool_cpu_percent,
                    m.cloud_broker_cpu_percent,
                    m.cloud_publishes_per_s,
                    m.cloud_records_per_s,
                    m.cloud_read_bytes_per_s,
                    m.machine_busy_percent,
                    m.limited_by,
                    m.loadavg_at_window_end
                        .split_whitespace()
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" "),
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "| {} | {} | | | | | {} | | | | | | | | | | | | | see below | |",
                    p.sut.name(),
                    p.n,
                    match p.status {
                        PointStatus::Skipped => "skipped",
                        _ => "failed",
                    }
                );
            }
        }
    }
    out
}

/// The printed summary table (what the command prints at the end).
pub fn summary(report: &SeganetReport) -> String {
    table(report)
}
