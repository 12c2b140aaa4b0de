//! `scenario core`'s Markdown report and its one-line summary per run (the tables, the
//! floor and relay-floor paragraphs), from a [`ScenarioReport`].

use std::fmt::Write as _;

use super::{ScenarioReport, SutRun};
use crate::harness::sut::Sut;
use crate::report::markdown::{loadavg_item, machine_line, sluice_line};

/// One line per run, for stderr.
pub(super) fn run_summary_line(r: &SutRun) -> String {
    format!(
        "{}: delivery {:.6} ({} of {}), dup {}, order violations {}, e2e p50/p99/p99.9 {:.2}/{:.2}/{:.2} ms, \
         ack p50/p99 {:.2}/{:.2} ms, SUT CPU {:.1}% ({:.1} µs/msg), RSS peak {:.1} MiB, tool CPU {:.1}%",
        r.sut.name(),
        r.delivery_ratio,
        r.unique_received,
        r.sent,
        r.duplicates,
        r.order_violations,
        r.e2e_latency.p50_ms,
        r.e2e_latency.p99_ms,
        r.e2e_latency.p999_ms,
        r.ack_latency.p50_ms,
        r.ack_latency.p99_ms,
        r.sut_cpu_percent,
        r.sut_cpu_us_per_msg,
        r.sut_rss.peak_kib as f64 / 1024.0,
        r.tool_cpu_percent,
    )
}

/// The Markdown summary: one column per run, and sluice ÷ bridge and sluice ÷ relay-floor when
/// those ran beside sluice.
pub fn markdown(report: &ScenarioReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "### core path: {} devices × {} msg/s ({} msg/s offered), {}..{} B, QoS {}, MQTT {}{}, {} s ({} s ramp, steady-state window {} s)\n",
        p.devices, p.rate_per_device, p.offered_rate, p.payload_min, p.payload_max, p.qos, p.mqtt,
        if p.device_tls { " over TLS 1.3" } else { "" },
        p.duration_s, p.ramp_s, p.steady_window_s
    );
    let _ = writeln!(out, "{}\n", machine_line(m, &[loadavg_item(m)]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(out, "{}\n", sluice_line(&p.sluice_aggregate));
    let run = |sut| report.runs.iter().find(|r| r.sut == sut);
    // Ratio columns: sluice ÷ each of these that ran beside it (first run of each).
    let ratio_columns: Vec<(&SutRun, &SutRun)> = [Sut::MosquittoBridge, Sut::RelayFloor]
        .into_iter()
        .filter_map(|other| Some((run(Sut::Sluice)?, run(other)?)))
        .collect();
    let mut header = String::from("| metric |");
    let mut rule = String::from("|---|");
    for r in &report.runs {
        let _ = write!(header, " {} |", r.sut.name());
        rule.push_str("---:|");
    }
    for (_, other) in &ratio_columns {
        let _ = write!(
            header,
            " sluice ÷ {} |",
            other.sut.name().trim_start_matches("mosquitto-")
        );
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    type Metric = (
        &'static str,
        fn(&SutRun) -> String,
        Option<fn(&SutRun) -> f64>,
    );
    let rows: Vec<Metric> = vec![
        ("messages sent", |r| r.sent.to_string(), None),
        (
            "delivery ratio (unique received ÷ sent)",
            |r| forwarded(r, || format!("{:.6}", r.delivery_ratio)),
            Some(|r| r.delivery_ratio),
        ),
        (
            "duplicates / order violations",
            |r| forwarded(r, || format!("{} / {}", r.duplicates, r.order_violations)),
            None,
        ),
        (
            "e2e latency p50 / p99 / p99.9, ms (steady state)",
            |r| {
                forwarded(r, || {
                    format!(
                        "{:.2} / {:.2} / {:.2}",
                        r.e2e_latency.p50_ms, r.e2e_latency.p99_ms, r.e2e_latency.p999_ms
                    )
                })
            },
            Some(|r| r.e2e_latency.p99_ms),
        ),
        (
            "ack latency p50 / p99 / p99.9, ms (steady state)",
            |r| {
                format!(
                    "{:.2} / {:.2} / {:.2}",
                    r.ack_latency.p50_ms, r.ack_latency.p99_ms, r.ack_latency.p999_ms
                )
            },
            Some(|r| r.ack_latency.p99_ms),
        ),
        (
            "e2e latency p50 / p99 / p99.9, ms (whole run, ramp included)",
            |r| {
                forwarded(r, || {
                    format!(
                        "{:.2} / {:.2} / {:.2}",
                        r.e2e_latency_all.p50_ms,
                        r.e2e_latency_all.p99_ms,
                        r.e2e_latency_all.p999_ms
                    )
                })
            },
            None,
        ),
        (
            "SUT CPU, % of one core (steady state)",
            |r| format!("{:.1}", r.sut_cpu_percent),
            Some(|r| r.sut_cpu_percent),
        ),
        (
            "SUT CPU per message, µs",
            |r| format!("{:.2}", r.sut_cpu_us_per_msg),
            Some(|r| r.sut_cpu_us_per_msg),
        ),
        (
            "sluice-control thread CPU (control plane, admin), % of one core",
            |r| {
                r.control_thread_cpu_percent
                    .map_or("–".into(), |c| format!("{c:.3}"))
            },
            None,
        ),
        (
            "dashboards open / events received in the window / stream KiB",
            |r| {
                r.dashboards.as_ref().map_or("0".into(), |d| {
                    format!(
                        "{} / {} / {:.0}",
                        d.open,
                        d.events_in_window,
                        d.stream_bytes_in_window as f64 / 1024.0
                    )
                })
            },
            None,
        ),
        (
            "SUT RSS start / peak / end, MiB",
            |r| {
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    r.sut_rss.start_kib as f64 / 1024.0,
                    r.sut_rss.peak_kib as f64 / 1024.0,
                    r.sut_rss.end_kib as f64 / 1024.0
                )
            },
            Some(|r| r.sut_rss.peak_kib as f64),
        ),
        (
            "cloud broker CPU, % of one core",
            |r| format!("{:.1}", r.cloud_broker_cpu_percent),
            None,
        ),
        (
            "sluice-bench CPU, % of one core",
            |r| format!("{:.1}", r.tool_cpu_percent),
            None,
        ),
        (
            "device reconnects / connect failures",
            |r| format!("{} / {}", r.devices.reconnects, r.devices.connect_failures),
            None,
        ),
    ];
    for (name, cell, ratio) in rows {
        let mut line = format!("| {name} |");
        for r in &report.runs {
            let _ = write!(line, " {} |", cell(r));
        }
        for (s, other) in &ratio_columns {
            let text = match ratio {
                Some(f) if f(other) != 0.0 => format!("{:.2}", f(s) / f(other)),
                _ => String::new(),
            };
            let _ = write!(line, " {text} |");
        }
        let _ = writeln!(out, "{line}");
    }
    if !ratio_columns.is_empty() {
        let _ = writeln!(out, "\nWhere a cell holds several figures, the ratio is of the p99 (latencies) or the peak (RSS).");
    }
    if let Some(f) = &report.floor {
        let _ = writeln!(
            out,
            "\n**Floor.** `floor` answers each PUBLISH and forwards nothing: {:.2} µs of CPU per \
             message is what the device connections alone cost this machine's kernel.",
            f.floor_us_per_msg
        );
        if let (Some(share), Some(b)) = (f.floor_share_of_bridge, f.bridge_us_per_msg) {
            let _ = writeln!(
                out,
                "That is {share:.2} of the bridge's {b:.2} µs: no gateway that terminates the \
                 devices' connections can use a smaller share of the bridge's CPU."
            );
        }
        for (name, above) in [
            ("sluice", f.sluice_above_floor_us),
            ("mosquitto-bridge", f.bridge_above_floor_us),
        ] {
            if let Some(above) = above {
                let _ = writeln!(out, "{name} above the floor: {above:.2} µs per message.");
            }
        }
        if let (Some(u), Some(r)) = (f.floor_uring_us_per_msg, f.uring_over_epoll) {
            let _ = writeln!(
                out,
                "`floor-uring` (the same floor over io_uring): {u:.2} µs per message, {r:.3} of \
                 the epoll floor's."
            );
        }
    }
    if let Some(r) = &report.relay_floor {
        let _ = writeln!(
            out,
            "\n**Relay floor.** `relay-floor` forwards each PUBLISH over one TLS 1.3 session and \
             acknowledges after the cloud, with nothing else: {:.2} µs of CPU per message is the \
             least a forwarding gateway costs here.",
            r.relay_floor_us_per_msg
        );
        for (what, ratio) in [
            ("relay-floor ÷ floor", r.relay_floor_over_floor),
            ("relay-floor ÷ bridge", r.relay_floor_over_bridge),
            ("sluice ÷ relay-floor", r.sluice_over_relay_floor),
            ("bridge ÷ relay-floor", r.bridge_over_relay_floor),
        ] {
            if let Some(ratio) = ratio {
                let _ = writeln!(out, "{what}: {ratio:.3}.");
            }
        }
    }
    out
}

/// A cell about what reached the cloud; the floor forwards nothing.
fn forwarded(r: &SutRun, cell: impl FnOnce() -> String) -> String {
    if r.sut.is_floor() {
        "n/a (forwards nothing)".to_string()
    } else {
        cell()
    }
}
