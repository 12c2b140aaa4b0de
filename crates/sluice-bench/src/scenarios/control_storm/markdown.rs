//! The control-storm report as Markdown: the machine line, the command, the scan-report
//! maximum, one table per plane mode (figures and CPU), and the verdicts.

use std::fmt::Write as _;

use super::{ControlStormReport, LevelResult, PlaneRun};
use crate::report::markdown::{loadavg_item, machine_line};

/// The whole report.
pub fn markdown(r: &ControlStormReport) -> String {
    let mut md = String::new();
    let p = &r.params;
    // `write!` into a String cannot fail.
    let _ = writeln!(md, "## control-storm\n");
    let _ = writeln!(
        md,
        "{}\n",
        machine_line(&r.machine, &[loadavg_item(&r.machine)])
    );
    let _ = writeln!(md, "command: `{}`\n", r.machine.command_line);
    let _ = writeln!(
        md,
        "sluice: shards = 1 (core 0), control_core = 1, no spool, uplink mqtt:// to a local Mosquitto, aggregation off, get_mds = false. \
         Data: {} PHD agents (glucometer, confirmed, window {}) at {:.0} reports/s + {} MQTT devices (QoS 1, {} B) at {:.0} msg/s. \
         Storm: {:.0} % new agents (config 0x4000), {} workers on {} thread(s); levels held {:?} then measured {:?}.\n",
        p.phd_agents,
        p.phd_window,
        p.phd_rate,
        p.mqtt_devices,
        p.mqtt_payload,
        p.mqtt_rate,
        100.0 * p.storm_new_share,
        p.storm_workers,
        p.storm_threads,
        p.settle,
        p.window
    );
    if let Some(m) = &r.max_reports {
        let _ = writeln!(
            md,
            "### Scan-report maximum (control plane, {} agents, window {}, no rate limit)\n",
            m.agents, m.window
        );
        let _ = writeln!(md, "| reports sent/s | confirmed/s | delivered at cloud msg/s | SenML bytes | confirm p50 ms | p99 ms | shard % | sluice % | mosquitto % | bench % | machine % |");
        let _ = writeln!(
            md,
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let _ = writeln!(
            md,
            "| {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            m.reports_sent, m.reports_confirmed, m.delivered, m.payload_bytes, m.confirm.p50_ms, m.confirm.p99_ms,
            m.cpu.shard, m.cpu.sluice_total, m.cpu.mosquitto, m.cpu.bench, m.cpu.machine
        );
        let _ = writeln!(
            md,
            "Other processes ≥ 2 % of a core meanwhile: {}\n",
            others(&m.cpu.others)
        );
        if let Some(d) = &m.direct {
            let _ = writeln!(md, "Mosquitto alone (same run): {} plain MQTT publishers, QoS 1, {} B payloads, no rate limit:\n", d.publishers, d.payload);
            let _ = writeln!(md, "| sent msg/s | delivered at subscriber msg/s | mosquitto % | bench % | machine % |");
            let _ = writeln!(md, "|---:|---:|---:|---:|---:|");
            let _ = writeln!(
                md,
                "| {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |\n",
                d.sent, d.delivered, d.mosquitto_cpu, d.bench_cpu, d.machine_cpu
            );
        }
    }
    for run in &r.planes {
        plane_tables(&mut md, run);
    }
    if !r.verdicts.is_empty() {
        let _ = writeln!(md, "### Verdicts\n");
        let _ = writeln!(md, "| target | measured | met |");
        let _ = writeln!(md, "|---|---|---|");
        for v in &r.verdicts {
            let _ = writeln!(
                md,
                "| {} | {} | {} |",
                v.target,
                v.measured,
                if v.met { "yes" } else { "**no**" }
            );
        }
    }
    md
}

fn others(list: &[String]) -> String {
    if list.is_empty() {
        "-".to_string()
    } else {
        list.join(", ")
    }
}

fn ratio(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |r| format!("{r:.3}"))
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |r| format!("{r:.0}"))
}

fn plane_tables(md: &mut String, run: &PlaneRun) {
    let _ = writeln!(md, "### {}\n", run.plane.name());
    let _ = writeln!(md, "| storm target msg/s | storm achieved msg/s | sluice counted msg/s | sessions/s | failed | not started | AARE p99 ms | data offered msg/s | PHD sent/s | PHD delivered/s | MQTT sent/s | MQTT delivered/s | delivered msg/s | ratio | PHD confirm p50 ms | p99 ms | p99 ratio | MQTT e2e p50 ms | p99 ms | p99 ratio |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for l in &run.levels {
        row(md, l);
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "CPU, % of one core (machine: % of both cores), and sluice's PHD gauges at the window's end:\n");
    let _ = writeln!(md, "| storm target msg/s | sluice-shard-0 | sluice-phd | other sluice | sluice total | mosquitto | bench | of which storm | machine | phd agents | phd connections | other processes ≥ 2 % |");
    let _ = writeln!(
        md,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    for l in &run.levels {
        let c = &l.cpu;
        let _ = writeln!(
            md,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} |",
            l.target,
            c.shard,
            c.phd,
            c.sluice_other,
            c.sluice_total,
            c.mosquitto,
            c.bench,
            c.storm_threads,
            c.machine,
            opt(l.phd_agents_gauge),
            opt(l.phd_connections_gauge),
            others(&c.others)
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "sluice_phd_agents after everything stopped: {}",
        opt(run.agents_after)
    );
    if let Some(e) = &run.storm_first_error {
        let _ = writeln!(md, "\nfirst storm session error: `{e}`");
    }
    for e in &run.data_errors {
        let _ = writeln!(md, "\ndata load: {e}");
    }
    let _ = writeln!(md);
}

fn row(md: &mut String, l: &LevelResult) {
    let _ = writeln!(
        md,
        "| {} | {:.0} | {} | {:.0} | {} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} |",
        l.target,
        l.storm_rate,
        opt(l.sluice_control_rate),
        l.sessions_per_s,
        l.sessions_failed,
        l.not_started,
        l.aare.p99_ms,
        l.data_offered,
        l.phd_sent,
        l.phd_delivered,
        l.mqtt_sent,
        l.mqtt_delivered,
        l.delivered,
        ratio(l.delivered_ratio),
        l.phd_confirm.p50_ms,
        l.phd_confirm.p99_ms,
        ratio(l.phd_p99_ratio),
        l.mqtt_e2e.p50_ms,
        l.mqtt_e2e.p99_ms,
        ratio(l.mqtt_p99_ratio),
    );
}
