//! The outage scenario's verdicts and reports (Markdown and JSON files).

use super::*;

/// The verdicts, from measured numbers only.
pub fn verdicts(r: &OutageReport) -> Vec<Verdict> {
    let mut v = Vec::new();
    v.push(Verdict {
        check: "every message delivered".to_string(),
        pass: r.lost == 0 && r.gaps == 0 && r.recorder_error.is_none(),
        detail: format!(
            "{} of {} sent reached the cloud ({} lost, {} gaps, {} duplicates)",
            r.unique_delivered, r.sent, r.lost, r.gaps, r.duplicates
        ),
    });
    v.push(Verdict {
        check: "every acknowledged message delivered".to_string(),
        pass: r.unique_delivered >= r.acknowledged && r.gaps == 0,
        detail: format!(
            "{} acknowledged by sluice, {} distinct delivered",
            r.acknowledged, r.unique_delivered
        ),
    });
    v.push(Verdict {
        check: "devices acknowledged during the outage".to_string(),
        pass: r.acknowledged_during_outage > 0,
        detail: format!(
            "{} PUBACKs while the link was cut; ack p99 cut→end {:.2} ms",
            r.acknowledged_during_outage, r.ack_latency_cut_to_end.p99_ms
        ),
    });
    v.push(Verdict {
        check: "per-device order within the backlog and within the live stream".to_string(),
        pass: r.order.backlog_violations == 0 && r.order.live_violations == 0,
        detail: format!(
            "backlog {} violations in {} checked, live {} in {} ({} near the reconnect not checked; \
             {} devices saw live messages overtake their backlog, by design)",
            r.order.backlog_violations,
            r.order.backlog_checked,
            r.order.live_violations,
            r.order.live_checked,
            r.order.unchecked_near_reconnect,
            r.order.devices_with_live_before_backlog
        ),
    });
    v.push(Verdict {
        check: "backlog drained while the load was running".to_string(),
        pass: r.drain_ended_under_load && r.drain_s.is_some(),
        detail: match r.drain_s {
            Some(d) => format!(
                "{} backlog messages drained in {d:.3} s after the reconnect",
                r.backlog.messages
            ),
            None => "no backlog arrived after the reconnect".to_string(),
        },
    });
    v
}

// ---------------------------------------------------------------------------------------------
// Report output.

/// The Markdown report.
pub fn markdown(r: &OutageReport) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let p = &r.params;
    let _ = writeln!(s, "# sluice-bench scenario outage\n");
    let _ = writeln!(
        s,
        "commit `{}`{} · {} × {} (nproc {}) · kernel {} · {} · loadavg at start `{}`, at end `{}` · started {}\n",
        m.commit,
        if m.worktree_dirty { " (work tree with uncommitted changes)" } else { "" },
        m.nproc,
        m.cpu_model,
        m.nproc,
        m.kernel,
        m.mosquitto_version,
        m.loadavg_at_start,
        r.loadavg_at_end,
        m.started_at
    );
    let _ = writeln!(s, "command: `{}`\n", m.command_line);
    let _ = writeln!(
        s,
        "{} devices × {} msg/s ({} msg/s offered), payload {}–{} B, QoS 1; warm-up {} s, link cut {} s, \
         load {} s more after the restore; spool on {} (ack \"spool\", sluice's default drain settings)\n",
        p.devices, p.rate_per_device, p.offered_rate, p.payload_min, p.payload_max, p.warmup_s,
        p.outage_s, p.after_s, p.spool_dir_fs
    );
    let t = &r.timeline;
    let _ = writeln!(
        s,
        "timeline (s after the first device): cut {:.3}, restored {:.3}, sluice reconnected {:.3}, \
         drain end {}, load end {:.3}\n",
        t.cut_s,
        t.restored_s,
        t.reconnect_s,
        t.drain_end_s.map_or("—".to_string(), |d| format!("{d:.3}")),
        t.load_end_s
    );
    let opt = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(s, "| measure | value |\n|---|---|");
    let _ = writeln!(
        s,
        "| sent / acknowledged by sluice | {} / {} |",
        r.sent, r.acknowledged
    );
    let _ = writeln!(
        s,
        "| acknowledged while the link was cut | {} |",
        r.acknowledged_during_outage
    );
    let _ = writeln!(
        s,
        "| delivered (distinct) / deliveries / duplicates / lost / gaps | {} / {} / {} / {} / {} |",
        r.unique_delivered, r.deliveries, r.duplicates, r.lost, r.gaps
    );
    let _ = writeln!(
        s,
        "| backlog at reconnect: messages (payload bytes) | {} ({:.1} MiB) |",
        r.backlog.messages,
        r.backlog.payload_bytes as f64 / 1048576.0
    );
    let _ = writeln!(
        s,
        "| sluice metrics before the reconnect: unacked records / spool bytes | {} / {} |",
        opt(r.backlog.metric_unacked_records),
        opt(r.backlog.metric_spool_bytes)
    );
    let _ = writeln!(
        s,
        "| sluice_spool_backlog_records peak after reconnect / back to 0 after | {} / {} |",
        opt(r.backlog.metric_backlog_records_peak),
        r.backlog
            .metric_backlog_zero_after_s
            .map_or("—".to_string(), |v| format!("{v:.1} s"))
    );
    let _ = writeln!(
        s,
        "| drain time (reconnect → last backlog message delivered) | {} |",
        r.drain_s.map_or("—".to_string(), |d| format!("{d:.3} s"))
    );
    let _ = writeln!(s, "\n| e2e latency, first arrivals | count | p50 ms | p99 ms | p99.9 ms | max ms |\n|---|---|---|---|---|---|");
    for (name, l) in [
        ("live, before the outage", &r.e2e_before_outage),
        (
            "live, during the drain (sent from reconnect + guard)",
            &r.e2e_live_during_drain,
        ),
        ("live, after the drain", &r.e2e_live_after_drain),
        ("backlog (sent during the outage)", &r.e2e_backlog),
        (
            "sent within the guard after the reconnect",
            &r.e2e_near_reconnect,
        ),
        ("device ack (PUBACK), cut → end", &r.ack_latency_cut_to_end),
        ("device ack (PUBACK), whole run", &r.ack_latency_whole_run),
    ] {
        let _ = writeln!(
            s,
            "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
            l.count, l.p50_ms, l.p99_ms, l.p999_ms, l.max_ms
        );
    }
    let _ = writeln!(s, "\n| verdict | result | measured |\n|---|---|---|");
    for v in &r.verdicts {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            v.check,
            if v.pass { "PASS" } else { "FAIL" },
            v.detail
        );
    }
    if !r.order.first_violations.is_empty() {
        let _ = writeln!(
            s,
            "\nfirst order violations (ms after the cut; reconnect at {:.0} ms):\n\n\
             | device | stream | seq | sent | arrived | overtaken by seq | its send | its arrival |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|",
            (r.timeline.reconnect_s - r.timeline.cut_s) * 1000.0
        );
        for v in &r.order.first_violations {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.0} | {:.0} | {} | {:.0} | {:.0} |",
                v.device,
                if v.backlog { "backlog" } else { "live" },
                v.seq,
                v.sent_ms,
                v.received_ms,
                v.overtaken_by_seq,
                v.overtaken_by_sent_ms,
                v.overtaken_by_received_ms
            );
        }
    }
    if let Some(e) = &r.recorder_error {
        let _ = writeln!(s, "\nrecorder error: {e}");
    }
    s
}

/// Write the JSON report (and Markdown, if asked).
pub fn write_reports(
    r: &OutageReport,
    json: Option<&Path>,
    md: Option<&Path>,
) -> anyhow::Result<()> {
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(r).context("serialising the report")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = md {
        std::fs::write(path, markdown(r)).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
