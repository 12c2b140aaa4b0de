//! The priority scenario's verdicts and Markdown report.

use super::*;
use crate::report::markdown::machine_line;

/// The verdicts against the target, plus the SegaNet comparison.
pub fn verdicts(modes: &[ModeRun]) -> Vec<Verdict> {
    let find = |m: Mode| modes.iter().find(|r| r.mode == m);
    let mut out = Vec::new();
    let base = find(Mode::Unloaded)
        .and_then(|r| r.high())
        .map(DeviceRow::p99_ms);
    let tc = find(Mode::LanesTc);
    let high_tc = tc.and_then(|r| r.high()).map(DeviceRow::p99_ms);
    out.push(match (base, high_tc) {
        (Some(b), Some(h)) => Verdict {
            name: "high device p99 stays within 2× its unloaded p99 (lanes+tc)".to_string(),
            target: format!(
                "≤ {HIGH_P99_MAX_FACTOR}× {b:.2} ms = {:.2} ms",
                HIGH_P99_MAX_FACTOR * b
            ),
            measured: format!("{h:.2} ms ({:.2}×)", ratio(h, b)),
            pass: Some(h <= HIGH_P99_MAX_FACTOR * b),
        },
        _ => not_run(
            "high device p99 stays within 2× its unloaded p99 (lanes+tc)",
            "unloaded and lanes+tc",
        ),
    });
    let normal_tc = tc.map(|r| r.normals().map(DeviceRow::p99_ms).collect::<Vec<_>>());
    out.push(match (base, normal_tc) {
        (Some(b), Some(ps)) if !ps.is_empty() => {
            let min = ps.iter().copied().fold(f64::INFINITY, f64::min);
            Verdict {
                name: "normal p99 grows ≥ 10× (lanes+tc, every normal device, vs the unloaded p99)"
                    .to_string(),
                target: format!(
                    "≥ {NORMAL_P99_MIN_FACTOR}× {b:.2} ms = {:.2} ms",
                    NORMAL_P99_MIN_FACTOR * b
                ),
                measured: format!(
                    "lowest normal p99 {min:.2} ms ({:.1}×); all: {}",
                    ratio(min, b),
                    ps.iter()
                        .map(|p| format!("{p:.1}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                pass: Some(min >= NORMAL_P99_MIN_FACTOR * b),
            }
        }
        _ => not_run("normal p99 grows ≥ 10× (lanes+tc)", "unloaded and lanes+tc"),
    });
    let lost: Vec<String> = modes
        .iter()
        .map(|r| format!("{} {}", r.mode.name(), r.lost))
        .collect();
    out.push(Verdict {
        name: "nothing lost (sent − delivered, every mode)".to_string(),
        target: "0 in every mode".to_string(),
        measured: lost.join(", "),
        pass: (!modes.is_empty()).then(|| modes.iter().all(|r| r.lost == 0)),
    });
    let off_high = find(Mode::Off).and_then(|r| r.high());
    for mode in [Mode::Lanes, Mode::LanesTc] {
        let name = format!(
            "high device avg / p99 change, off → {} (SegaNet: {SEGANET_AVG_CHANGE_PERCENT:+.0} % / {SEGANET_P99_CHANGE_PERCENT:+.0} %)",
            mode.name()
        );
        out.push(match (off_high, find(mode).and_then(|r| r.high())) {
            (Some(o), Some(n)) => Verdict {
                name,
                target: "informational".to_string(),
                measured: format!(
                    "avg {:.2} → {:.2} ms ({:+.0} %), p99 {:.2} → {:.2} ms ({:+.0} %)",
                    o.mean_ms(),
                    n.mean_ms(),
                    change_percent(o.mean_ms(), n.mean_ms()),
                    o.p99_ms(),
                    n.p99_ms(),
                    change_percent(o.p99_ms(), n.p99_ms())
                ),
                pass: None,
            },
            _ => not_run(&name, &format!("off and {}", mode.name())),
        });
    }
    out
}

pub(super) fn not_run(name: &str, needs: &str) -> Verdict {
    Verdict {
        name: name.to_string(),
        target: format!("needs modes {needs}"),
        measured: "not run".to_string(),
        pass: None,
    }
}

pub(super) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::INFINITY
    }
}

pub(super) fn change_percent(from: f64, to: f64) -> f64 {
    if from > 0.0 {
        (to - from) / from * 100.0
    } else {
        0.0
    }
}

pub(super) fn mode_summary(r: &ModeRun) -> String {
    let mut s = format!(
        "{}: sent {} delivered {} lost {} dup {} skipped(window full) {}",
        r.mode.name(),
        r.sent,
        r.delivered,
        r.lost,
        r.duplicates,
        r.skipped_inflight_full
    );
    for d in &r.devices {
        let _ = write!(
            s,
            "\n  {:<12} {:<6} avg {:>8.2} ms  p99 {:>8.2} ms  (ack p99 {:>8.2} ms)",
            d.client_id,
            if d.high { "high" } else { "normal" },
            d.mean_ms(),
            d.p99_ms(),
            d.ack_p99_ms
        );
    }
    s
}

/// The Markdown summary: parameters, one table row per device and mode, the verdicts.
pub fn markdown(report: &PriorityReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let p = &report.params;
    let _ = writeln!(
        out,
        "### priority lanes: {} devices ({} high) × {} msg/s × {} B over a {} uplink, {} s per mode (after a {} s warm-up)\n",
        p.devices,
        p.high_devices,
        p.rate_per_device,
        if p.payload_min == p.payload_max {
            p.payload_min.to_string()
        } else {
            format!("{}..{}", p.payload_min, p.payload_max)
        },
        p.link_rate,
        p.duration_s,
        p.warmup_s
    );
    let _ = writeln!(out, "{}\n", machine_line(m, &[]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(
        out,
        "Offered payload: normal {:.2} Mbit/s, high {:.2} Mbit/s, link {:.2} Mbit/s (MQTT, TLS and TCP/IP overhead come on top). Latency: {}.\n",
        p.offered_payload_bits_per_s_normal / 1e6,
        p.offered_payload_bits_per_s_high / 1e6,
        p.link_bits_per_s / 1e6,
        if p.latency_source == "sink e2e" {
            "end to end, device send → sink receive"
        } else {
            "device ack (PUBLISH → PUBACK; the sink had no per-device report)"
        }
    );
    let _ = writeln!(
        out,
        "| mode | device | lane | sent | delivered | lost | avg ms | p99 ms | ack avg / p99 ms |"
    );
    let _ = writeln!(out, "|---|---|---|---:|---:|---:|---:|---:|---:|");
    for r in &report.modes {
        for d in &r.devices {
            let opt = |v: Option<u64>| v.map_or("–".to_string(), |v| v.to_string());
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} / {:.2} |",
                r.mode.name(),
                d.client_id,
                if d.high { "high" } else { "normal" },
                d.sent,
                opt(d.delivered),
                d.lost.map_or("–".to_string(), |v| v.to_string()),
                d.mean_ms(),
                d.p99_ms(),
                d.ack_mean_ms,
                d.ack_p99_ms
            );
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| mode | sent | delivered | lost | duplicates | ticks skipped (window full) | high session seen | loadavg start → end |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---|---|");
    for r in &report.modes {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} → {} |",
            r.mode.name(),
            r.sent,
            r.delivered,
            r.lost,
            r.duplicates,
            r.skipped_inflight_full,
            if r.mode.priority() {
                if r.high_session_seen {
                    "yes"
                } else {
                    "no"
                }
            } else {
                "–"
            },
            first_fields(&r.loadavg_start, 3),
            first_fields(&r.loadavg_end, 3)
        );
    }
    let _ = writeln!(out, "\n**Verdicts**\n");
    for v in &report.verdicts {
        let mark = match v.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "info",
        };
        let _ = writeln!(
            out,
            "- {mark} — {}: {} (target {})",
            v.name, v.measured, v.target
        );
    }
    out
}
