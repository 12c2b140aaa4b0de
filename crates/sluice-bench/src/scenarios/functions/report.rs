//! The Markdown report of `scenario functions`: the machine line and command, then one
//! section per part that ran, each with its target and whether it was met (and, if not, the
//! figure measured beside it).

use std::fmt::Write as _;

use super::cold::{Pcts, Phase};
use super::FunctionsReport;
use crate::report::markdown::{loadavg_item, machine_line};

fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.2}"))
}

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "**met**",
        Some(false) => "**not met**",
        None => "not measured",
    }
}

pub fn markdown(r: &FunctionsReport) -> String {
    let mut out = String::from("# Edge functions: adaptor cost, idle, cold start, prediction\n\n");
    out.push_str(&machine_line(&r.machine, &[loadavg_item(&r.machine)]));
    let _ = write!(
        out,
        "\n\nCommand: `{}` · sluice shards {} (0: one per core but one, at least one) · placement {}\n",
        r.machine.command_line,
        r.sluice_shards,
        match r.placement {
            super::Placement::Local => "local (sluice starts and stops the instances)",
            super::Placement::Remote => "**remote** (the bench started one instance on $PORT; sluice called its url: no cold starts, no scaling)",
        }
    );
    adaptor(&mut out, r);
    idle(&mut out, r);
    cold(&mut out, r);
    predict(&mut out, r);
    out
}

fn adaptor(out: &mut String, r: &FunctionsReport) {
    if r.adaptor.is_empty() {
        return;
    }
    out.push_str("\n## Adaptor cost (CPU per event)\n\n| adaptor | function | events/s | adaptor µs/event | function µs/event | adaptor ÷ function | all answered | events / ok / failed | PUBACK p50 / p99 ms | machine busy |\n|---|---|---:|---:|---:|---:|---|---|---|---:|\n");
    let one = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.1}"));
    for a in &r.adaptor {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} / {} / {} | {:.2} / {:.2} | {:.0} % |",
            a.adaptor.name(),
            a.function
                .map_or("none (baseline: MQTT in + PUBACK only)", |f| f.name()),
            a.events_per_s,
            one(a.adaptor_us_per_event),
            one(a.function_us_per_event),
            a.ratio.map_or("–".into(), |v| format!("{v:.3}")),
            if a.all_answered { "yes" } else { "**no**" },
            a.events_total,
            a.invocations_ok,
            a.invocations_failed.map_or("–".into(), |v| v.to_string()),
            a.ack_latency.p50_ms,
            a.ack_latency.p99_ms,
            a.machine_busy_percent,
        );
    }
    if let Some(a) = r.adaptor.first() {
        let _ = writeln!(
            out,
            "\n{} devices, QoS 1, {} B payloads, {:.0} events/s offered, window {:.1} s; function = CPU of all of sluice's child processes (live and reaped), or in floor rows of the one instance the bench started on $PORT (events / ok there = the devices' PUBLISHes / PUBACKs: the floor PUBACKs only after a 2xx and counts nothing).",
            a.devices, a.payload_bytes, a.offered_rate, a.window_s
        );
    }
    let floor = match (r.adaptor_target_below_floor, r.adaptor_floor_share_of_python) {
        (Some(true), Some(f)) => format!(
            "; the target is **below the floor** here (the minimal relay alone costs {f:.3} of the Python function, > 0.1)"
        ),
        (Some(false), Some(f)) => format!(
            "; the floor is under the target here (the minimal relay costs {f:.3} of the Python function, ≤ 0.1)"
        ),
        _ => String::new(),
    };
    let _ = writeln!(
        out,
        "\nTarget sluice ≤ 1/10 of the Python function's CPU per event: {}{}{floor}",
        yes_no(r.adaptor_target_met),
        r.adaptor_share_of_python
            .map_or(String::new(), |v| format!(" (measured {v:.3})"))
    );
    if let Some(v) = r.adaptor_increment_share_of_python {
        let _ = writeln!(
            out,
            "\nWhat dispatching adds (sluice with the Python function − the baseline) ÷ the Python function: {v:.3}"
        );
    }
    if let Some(f) = r.adaptor_floor_share_of_python {
        let _ = writeln!(
            out,
            "\nfloor ÷ Python function: {f:.3} (the least an MQTT→HTTP adaptor costs here); sluice ÷ floor: {}",
            r.adaptor_sluice_over_floor
                .map_or("–".into(), |v| format!("{v:.2}"))
        );
    }
}

fn idle(out: &mut String, r: &FunctionsReport) {
    let Some(i) = &r.idle else {
        return;
    };
    let state = match i.placement {
        super::Placement::Local => format!(
            "{} function scaled to zero ({} child processes at the end)",
            i.function.name(),
            i.children_at_end
        ),
        super::Placement::Remote => format!(
            "{} function remote and not called (the bench's instance; no local runtime)",
            i.function.name()
        ),
    };
    let _ = write!(
        out,
        "\n## Idle (devices connected and silent, no events)\n\n{} devices connected (keep-alive {} s, one PINGREQ each per 30 s), {state}, window {:.1} s: sluice used **{:.0} ms** CPU by `/proc/PID/stat` (10 ms ticks) = **{:.3} %** of one core; by the threads' `schedstat` {:.1} ms = {:.4} %; {:.2} wake-ups/s in all. Target ≤ 0.1 % of a core: {}{}.\n\n| thread | tid | wake-ups/s (voluntary switches) | involuntary/s | CPU ms (schedstat) |\n|---|---:|---:|---:|---:|\n",
        i.devices_connected,
        i.keep_alive_s,
        i.window_s,
        i.sluice_cpu_ms,
        i.sluice_percent_of_core,
        i.sluice_run_ms_schedstat,
        100.0 * i.sluice_run_ms_schedstat / 1e3 / i.window_s.max(1e-9),
        i.wakeups_per_s,
        yes_no(Some(i.target_met)),
        if i.target_met {
            String::new()
        } else {
            format!(" (measured {:.3} %)", i.sluice_percent_of_core)
        }
    );
    for t in &i.threads {
        let _ = writeln!(
            out,
            "| {}{} | {} | {:.2} | {:.2} | {:.1} |",
            t.comm,
            if t.whole_window {
                ""
            } else {
                " (part of the window)"
            },
            t.tid,
            t.wakeups_per_s,
            t.nonvoluntary_per_s,
            t.run_ms
        );
    }
}

fn pcts(p: &Pcts) -> String {
    format!("{} / {}", ms(p.p50_ms), ms(p.p99_ms))
}

fn cold(out: &mut String, r: &FunctionsReport) {
    if r.cold.is_empty() {
        return;
    }
    out.push_str("\n## Cold start (p50 / p99, ms)\n\n| function | instance | rounds (lost) | publish → function | publish → reply | publish → main | function start-up (main → request) | sluice dispatch mean | sluice dispatch p50 / p99 ≤ bucket | sluice cold_start p50 / p99 ≤ bucket |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for c in &r.cold {
        for (name, p) in [("cold", &c.cold), ("warm", &c.warm)] {
            row(out, c.function.name(), name, p);
        }
    }
    out.push_str("\nsluice's part = `sluice_function_dispatch_seconds` (arrival at sluice → request written to the instance; scaled to zero, the next instance's socket listens as a published standby, so a cold event's request is written into its backlog by the shard at once while the runtime starts the process), exact mean, quantiles to a bucket (50, 100, 250, 500, 750 µs, 1, 1.5, 2, 2.5 ms …). `publish → main` (cold) is sluice's part plus the start of the process (clone/exec) and the loader of the function, plus the probe's MQTT hop.\n\n");
    for c in &r.cold {
        let _ = writeln!(
            out,
            "- {}: the bench's own spawn → main (the function's start-up floor) p50 / p99 {} ms; cold publish → main p50 − that p50 = **{} ms** (sluice's part of a cold start without the function's start-up, a difference of medians)",
            c.function.name(),
            pcts(&c.spawn_to_main),
            ms(c.sluice_part_p50_estimate_ms)
        );
    }
    out.push('\n');
    for c in &r.cold {
        let _ = writeln!(
            out,
            "- {}: sluice's part ≤ 2 ms (dispatch p99, cold and warm): {}{}",
            c.function.name(),
            yes_no(c.target_met),
            match c.target_met {
                Some(false) => format!(
                    " (p99 ≤ {} ms cold, ≤ {} ms warm; means {} / {} ms)",
                    ms(c.cold.sluice_dispatch.p99_le_ms),
                    ms(c.warm.sluice_dispatch.p99_le_ms),
                    ms(c.cold.sluice_dispatch.mean_ms),
                    ms(c.warm.sluice_dispatch.mean_ms)
                ),
                _ => String::new(),
            }
        );
    }
}

fn row(out: &mut String, function: &str, phase: &str, p: &Phase) {
    let _ = writeln!(
        out,
        "| {function} | {phase} | {} ({}) | {} | {} | {} | {} | {} | {} / {} | {} / {} |",
        p.rounds,
        p.lost,
        pcts(&p.publish_to_function),
        pcts(&p.publish_to_reply),
        pcts(&p.publish_to_main),
        pcts(&p.function_startup),
        ms(p.sluice_dispatch.mean_ms),
        ms(p.sluice_dispatch.p50_le_ms),
        ms(p.sluice_dispatch.p99_le_ms),
        ms(p.sluice_cold_start.p50_le_ms),
        ms(p.sluice_cold_start.p99_le_ms),
    );
}

fn predict(out: &mut String, r: &FunctionsReport) {
    let Some(p) = &r.predict else {
        return;
    };
    let _ = write!(
        out,
        "\n## Prediction (synthetic traces of `sluice::functions::predict::traces`, seed {}, {} h each at real scale on virtual clocks; {})\n\nhistogram = `prewarm = \"predict\"`, gbdt = `prewarm = \"gbdt\"`, both with `idle = \"90s\"`; fixed = keep-alive after the last arrival, never pre-warms.\n\n| trace | policy | arrivals | cold starts | cold-start rate | warm instance-hours | % of always-warm | predict::replay: cold starts | predict::replay: warm instance-hours |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
        p.seed, p.trace_hours, p.engine
    );
    for row in &p.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.1} % | {:.2} | {:.1} % | {} | {:.2} |",
            row.trace,
            row.policy,
            row.arrivals,
            row.cold_starts,
            row.cold_start_percent,
            row.warm_instance_hours,
            row.warm_percent_of_always,
            row.predict_replay_cold_starts,
            row.predict_replay_warm_instance_hours
        );
    }
    let _ = writeln!(
        out,
        "\nTarget: a learned policy with ≤ 1/4 of the cold starts of fixed keep-alive 60 s + 30 s and no more warm instance-time, through the real autoscaler (`runtime::replay`):\n"
    );
    for t in &p.targets {
        let learned: Vec<String> = t
            .learned
            .iter()
            .map(|l| {
                format!(
                    "{} {} cold ({:.2}×), {:.2} h ({:.2}×)",
                    l.policy,
                    l.cold_starts,
                    l.cold_start_ratio,
                    l.warm_instance_hours,
                    l.warm_ratio
                )
            })
            .collect();
        let by: Vec<&str> = t
            .learned
            .iter()
            .filter(|l| l.meets)
            .map(|l| l.policy)
            .collect();
        let _ = write!(
            out,
            "- {}: fixed 60 s + 30 s {} cold, {:.2} h; {}: {}",
            t.trace,
            t.fixed_cold_starts,
            t.fixed_warm_instance_hours,
            learned.join("; "),
            yes_no(Some(t.met)),
        );
        if t.met {
            let _ = write!(out, " (by {})", by.join(", "));
        }
        if let Some(b) = t.oracle_cold_starts_at_fixed {
            let _ = write!(
                out,
                "; oracle bound at fixed 60 s + 30 s's instance-hours: ≥ {b:.1} expected cold starts against the target's ≤ {}{}",
                t.fixed_cold_starts / 4,
                match t.beyond_any_policy {
                    Some(true) => ": beyond any policy (by more than 4 standard deviations)",
                    _ => "",
                }
            );
        }
        out.push('\n');
    }
}
