//! The multipath scenario's verdicts against the paper's rates and its markdown report.

use super::*;

pub(super) fn verdicts(config: &MultipathScenario, points: &[MultipathPoint]) -> Vec<Verdict> {
    let mut out = Vec::new();
    for &mode in &config.modes {
        for queue in config.queues.iter().map(|q| q.name()) {
            for &payload in &config.payloads {
                let find = |k: usize, n: u32| {
                    points.iter().find(|p| {
                        p.mode == mode
                            && p.queue == queue
                            && p.payload == payload
                            && p.links == k
                            && p.sensors == n
                    })
                };
                let what = format!("{}, queue {queue}, {payload} B", mode.name());
                for &n in &config.sensors {
                    let Some(one) = find(1, n) else { continue };
                    for &k in config.links.iter().filter(|k| **k > 1) {
                        let Some(p) = find(k, n) else { continue };
                        let ratio = p.rate / (k as f64 * one.rate).max(1e-9);
                        out.push(Verdict {
                            target: format!(
                                "{what}, N = {n}: {k} paths ≥ 0.9 × {k} × one path's rate"
                            ),
                            measured: format!(
                                "{:.0} vs {k} × {:.0} req/s: {ratio:.3}",
                                p.rate, one.rate
                            ),
                            met: ratio >= 0.9,
                        });
                    }
                    if let Some(three) = find(3, n) {
                        if n == 2000 {
                            let ratio = three.latency.p50_ms / one.latency.p50_ms.max(1e-9);
                            out.push(Verdict {
                                target: format!(
                                    "{what}, N = 2000: p50 latency with 3 paths ≤ 1/3 of one path's"
                                ),
                                measured: format!(
                                    "{:.2} vs {:.2} ms: {ratio:.3}",
                                    three.latency.p50_ms, one.latency.p50_ms
                                ),
                                met: ratio <= 1.0 / 3.0,
                            });
                        }
                    }
                }
            }
        }
    }
    if config.kill_link_at.is_some() {
        for p in points {
            out.push(Verdict {
                target: format!(
                    "{}, queue {}, {} B, k = {}, N = {}: a link cut costs 0 acknowledged messages and ≤ 2 s of stalled throughput",
                    p.mode.name(), p.queue, p.payload, p.links, p.sensors
                ),
                measured: format!(
                    "{} {}, longest stall {} ms",
                    p.failed,
                    match p.mode {
                        MultipathMode::CoapMptcp | MultipathMode::CoapPaths => "requests failed",
                        MultipathMode::MqttPaths => "messages unacknowledged at the end",
                    },
                    p.stall_ms.unwrap_or(0)
                ),
                met: p.failed == 0 && p.stall_ms.unwrap_or(0) <= 2000,
            });
        }
    }
    out
}

/// The Markdown report.
pub fn markdown(report: &MultipathReport) -> String {
    let mut out = String::new();
    let p = &report.params;
    let queues: Vec<String> = p.queues.iter().map(|q| q.name()).collect();
    let _ = writeln!(
        out,
        "### Multipath over k links of {} each (tbf, both directions, queue {}): coap-mptcp = closed-loop CoAP sensors → sluice's CoAP proxy → MPTCP `coap+tcp://`; coap-paths = the same with one TCP connection per path; mqtt-paths = MQTT 5 devices at {} msg/s each → sluice's per-path sessions → Mosquitto; upstream {:?}; payloads {:?} B, {} s per point ({} s warm-up){}\n",
        p.rate,
        queues.join(", "),
        p.mqtt_rate,
        p.upstream,
        p.payloads,
        p.duration.as_secs_f64(),
        p.warmup.as_secs_f64(),
        p.kill_link_at.map(|d| format!(", link 0 cut at {d:?}")).unwrap_or_default()
    );
    let m = &report.machine;
    let _ = writeln!(out, "{}\n", machine_line(m, &[loadavg_item(m)]));
    let _ = writeln!(out, "`{}`\n", m.command_line);
    let _ = writeln!(
        out,
        "| mode | queue | payload B | links k | N | req/s or msg/s | ÷ (k × one link) | p50 / p99 ms | subflows (MPTCP) / paths used (all up) | failed | stall ms | kB sent per link, gateway → cloud (drops) | sluice CPU % |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
    );
    for q in &report.points {
        let one = report
            .points
            .iter()
            .find(|o| {
                o.mode == q.mode
                    && o.queue == q.queue
                    && o.payload == q.payload
                    && o.links == 1
                    && o.sensors == q.sensors
            })
            .map(|o| o.rate);
        let per_link: Vec<String> = q
            .link_counters
            .iter()
            .map(|l| format!("{:.0} ({})", l.gw_bytes as f64 / 1000.0, l.drops))
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.0} | {} | {:.2} / {:.2} | {} ({}) | {} | {} | {} | {:.1} |",
            q.mode.name(),
            q.queue,
            q.payload,
            q.links,
            q.sensors,
            q.rate,
            one.map(|o| format!("{:.3}", q.rate / (o * q.links as f64).max(1e-9)))
                .unwrap_or_else(|| "–".into()),
            q.latency.p50_ms,
            q.latency.p99_ms,
            q.subflows,
            match (q.mode, q.mptcp_active) {
                (MultipathMode::CoapMptcp, true) => "active",
                (MultipathMode::CoapMptcp, false) => "not active",
                (_, true) => "all up",
                (_, false) => "not all up",
            },
            q.failed,
            q.stall_ms
                .map(|s| s.to_string())
                .unwrap_or_else(|| "–".into()),
            per_link.join(" / "),
            q.sluice_cpu.percent_of_one_core,
        );
    }
    let _ = writeln!(
        out,
        "\nThe paper's CoAP rates over 1/2/3 LTE paths: {}.",
        PAPER_RATES
            .iter()
            .map(|(k, r)| format!("{k}: {r} req/s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(out, "\n**Verdicts**\n");
    for v in &report.verdicts {
        let _ = writeln!(
            out,
            "- {} {} — measured {}",
            if v.met { "MET" } else { "NOT MET" },
            v.target,
            v.measured
        );
    }
    out
}
