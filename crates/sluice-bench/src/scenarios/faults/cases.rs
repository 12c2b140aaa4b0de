//! The cases of `scenario faults`: what each does to the bed while the load runs, and its own
//! check. The disk, clock and state cases' helpers (tmpfs, loop device, libfaketime file,
//! retained/session probe) are in [`disk`] and [`probes`].
//!
//! Owns: one case's run from the namespaces to its [`CaseResult`] ([`run_case`]). Does not own:
//! the bed ([`super::bed`]) or the accounting ([`super::load`]).

mod crowd;
mod disk;
mod probes;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rand::{Rng as _, SeedableRng as _};
use tokio::time::Instant;

use super::bed::{make_net, run_in_gateway, start_bed, Bed, BedSpec, RECORDER_PORT};
use super::ledger::Recorder;
use super::load::{figures, Load};
use super::{pause, CaseResult, FaultsScenario, Size};
use crate::harness::metrics::metric_sum;

/// One line per case, for the report.
pub fn title(name: &str) -> &'static str {
    match name {
        "kill9-cloud-up" => "kill -9 of sluice at random moments, restarted on the same spool, cloud up",
        "kill9-cloud-down" => "the same with the cloud link down throughout (restored at the end)",
        "cloud-restart" => "the cloud broker stopped and started again",
        "cloud-slow" => "the link to the cloud slowed to 256 kbit/s (tc tbf)",
        "cloud-blackhole" => "every packet to and from the cloud dropped silently (no RST)",
        "multipath-flap" => "one of two uplink paths losing its carrier every 2–5 s",
        "disk-full" => "the spool's file system (a tmpfs) filled to the last byte, then freed",
        "disk-readonly" => "the spool's file system (ext4 on a loop device) remounted read-only by an error, then read-write",
        "clock-step" => "the wall clock stepped +1 h, back, −1 h, back (libfaketime)",
        "restart-state" => "retained messages and a persistent session's queue across a kill -9",
        "pingresp-311" => "an MQTT 3.1.1 device past its limit with the cloud down: PINGRESP and connection kept",
        "slow-readers" => "many connections, some slow readers subscribed to busy topics: RSS bound, healthy p99",
        _ => "unknown case",
    }
}

/// What a case body returns besides the figures.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub observed: Vec<String>,
    pub check: String,
    pub check_met: bool,
}

/// How long a case's load runs (the CoAP sensors are told this up front).
fn planned(s: &FaultsScenario, name: &str) -> Duration {
    let small = s.size == Size::Small;
    Duration::from_secs(match name {
        "kill9-cloud-up" | "kill9-cloud-down" => kills(s) as u64 + 8,
        "cloud-restart" => 20,
        "cloud-slow" => {
            if small {
                25
            } else {
                45
            }
        }
        "cloud-blackhole" => 25,
        "multipath-flap" => {
            if small {
                65
            } else {
                305
            }
        }
        "disk-full" | "disk-readonly" => {
            if small {
                30
            } else {
                45
            }
        }
        "clock-step" => 45,
        "restart-state" => 20,
        "pingresp-311" => 45,
        "slow-readers" => {
            if small {
                60
            } else {
                150
            }
        }
        _ => 10,
    })
}

fn kills(s: &FaultsScenario) -> u32 {
    match s.size {
        Size::Small => 10,
        Size::Full => 100,
    }
}

/// Run case `name` from scratch (blocking: builds namespaces, runs a runtime on a thread).
pub fn run_case(s: &FaultsScenario, name: &str) -> anyhow::Result<CaseResult> {
    let links = if name == "multipath-flap" { 2 } else { 1 };
    let net = Arc::new(make_net(links)?);
    let mut spec = BedSpec {
        links,
        ..BedSpec::default()
    };
    let work = tempfile::Builder::new()
        .prefix("sluice-faults-work-")
        .tempdir_in(crate::harness::disk::default_dir())
        .context("a work directory")?;
    let mut mount: Option<disk::Mount> = None;
    match name {
        "multipath-flap" | "pingresp-311" => {}
        "disk-full" => {
            let m = disk::Mount::tmpfs(&work.path().join("spool-fs"), "32m")?;
            spec.spool_dir = Some(m.dir.join("spool"));
            mount = Some(m);
        }
        "disk-readonly" => {
            let m = disk::Mount::ext4_loop(&work.path().join("spool-fs"), work.path(), 64)?;
            spec.spool_dir = Some(m.dir.join("spool"));
            mount = Some(m);
        }
        _ => spec.spool_dir = Some(work.path().join("spool")),
    }
    match name {
        "multipath-flap" => {
            spec.uplink_extra = format!(
                "paths = [{{ name = \"a\", bind = \"{}\" }}, {{ name = \"b\", bind = \"{}\" }}]\n",
                net.links[0].gw_addr, net.links[1].gw_addr
            );
        }
        "pingresp-311" => spec.mqtt_extra = "receive_maximum = 64\n".to_string(),
        "slow-readers" => {
            spec.gateway_extra =
                format!("max_outbox_memory = \"{}MiB\"\n", crowd::OUTBOX_MEMORY_MIB);
            spec.mqtt_extra = format!(
                "max_connections = 20000\nmax_sessions = 20000\nmax_queued_bytes = \"{}KiB\"\n",
                crowd::QUEUED_KIB
            );
        }
        "clock-step" => {
            let f = work.path().join("faketime");
            std::fs::write(&f, "+0\n").context("the faketime file")?;
            spec.faketime_file = Some(f);
        }
        "restart-state" => {
            let dir = work.path().join("state");
            if probes::binary_accepts_state_dir(&s.sluice_bin, &dir) {
                spec.tail = format!("\n[state]\ndir = \"{}\"\n", dir.display());
            }
        }
        _ => {}
    }
    let s = s.clone();
    let name = name.to_string();
    let net2 = net.clone();
    let result = run_in_gateway(&net, move || {
        Box::pin(async move { case_body(&s, &name, net2, spec, mount).await })
    })?;
    drop(work);
    result
}

async fn case_body(
    s: &FaultsScenario,
    name: &str,
    net: Arc<sluice_testkit::netns::TestBed>,
    spec: BedSpec,
    mount: Option<disk::Mount>,
) -> anyhow::Result<CaseResult> {
    let mut bed = start_bed(net, &s.sluice_bin, &spec).await?;
    let config = bed.sluice.config_text.clone();
    let recorder = Recorder::start(&bed.net, RECORDER_PORT).await?;
    let plan = planned(s, name);
    let mut load = Load::start(&s.load, bed.mqtt(), bed.coap(), bed.phd(), plan).await?;
    let started = Instant::now();
    pause(Duration::from_secs(3)).await;
    let mut outcome = Outcome::default();
    let o = &mut outcome;
    let ran = match name {
        "kill9-cloud-up" => kill9(s, &mut bed, &mut load, false, o).await,
        "kill9-cloud-down" => kill9(s, &mut bed, &mut load, true, o).await,
        "cloud-restart" => cloud_restart(&mut bed, o).await,
        "cloud-slow" => cloud_slow(s, &mut bed, o).await,
        "cloud-blackhole" => cloud_blackhole(&mut bed, o).await,
        "multipath-flap" => multipath_flap(s, &mut bed, o).await,
        "disk-full" | "disk-readonly" => {
            disk::disk_fault(name, &mut bed, &mut load, mount.as_ref(), o).await
        }
        "clock-step" => probes::clock_step(&mut bed, spec.faketime_file.as_deref(), o).await,
        "restart-state" => {
            probes::restart_state(&mut bed, &mut load, !spec.tail.is_empty(), o).await
        }
        "pingresp-311" => probes::pingresp(&mut bed, o).await,
        "slow-readers" => {
            let (n, slow) = match s.size {
                Size::Small => (2_000, 200),
                Size::Full => (16_000, 1_000),
            };
            crowd::slow_readers(&mut bed, &load, n, slow, s.load.mqtt_qos1, o).await
        }
        other => Err(anyhow::anyhow!("unknown case {other}")),
    };
    // Let the CoAP sensors finish their planned time (they stop by themselves).
    if let Some(rest) = plan.checked_sub(started.elapsed()) {
        pause(rest).await;
    }
    let result = load.stop(Duration::from_secs(60)).await?;
    wait_for_cloud(&recorder, &result).await;
    let (tally, recorder_error) = tokio::task::block_in_place(|| recorder.stop());
    let tally = tally.lock().unwrap_or_else(|p| p.into_inner());
    let figures = figures(&result, &tally);
    if tally.order_violations > 0 {
        outcome.observed.push(format!(
            "order violations: MQTT {}, CoAP {}; the first: {}",
            tally.order_by_proto[0],
            tally.order_by_proto[1],
            tally.first_violations.join("; ")
        ));
    }
    let error = ran.err().map(|e| format!("{e:#}"));
    if let Some(e) = recorder_error {
        outcome
            .observed
            .push(format!("the cloud recorder's last connection error: {e}"));
    }
    outcome.observed.push(format!(
        "PHD agents re-associated {} times, {} agent connections ended; sluice started {} times",
        result.phd_reassociations, result.phd_agent_failures, bed.sluice.starts
    ));
    if !bed.sluice.running() {
        outcome.observed.push(format!(
            "sluice is not running at the end; stderr:\n{}",
            bed.sluice.stderr_tail()
        ));
    }
    let pass = error.is_none() && figures.acked_missing == 0 && outcome.check_met;
    drop(mount);
    Ok(CaseResult {
        case: name.to_string(),
        title: title(name).to_string(),
        figures: Some(figures),
        observed: outcome.observed,
        check: outcome.check,
        check_met: outcome.check_met,
        pass,
        error,
        seconds: 0.0,
        sluice_config: config,
    })
}

/// After the load stopped: wait until every acknowledged MQTT message is at the cloud, or
/// nothing new arrived for 10 s, at most 90 s.
async fn wait_for_cloud(recorder: &Recorder, result: &super::load::LoadResult) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = (recorder.seen(), Instant::now());
    loop {
        let missing = {
            let t = recorder.tally.lock().unwrap_or_else(|p| p.into_inner());
            result
                .mqtt
                .acked_keys
                .iter()
                .filter(|k| !t.mqtt.contains_key(k))
                .count()
                + result.coap_acknowledged.saturating_sub(t.coap.len() as u64) as usize
                + result.phd_confirmed.saturating_sub(t.phd) as usize
        };
        let seen = recorder.seen();
        if seen != last.0 {
            last = (seen, Instant::now());
        }
        if missing == 0 || Instant::now() >= deadline || last.1.elapsed() > Duration::from_secs(10)
        {
            // A little longer, so late redeliveries show in the duplicates.
            pause(Duration::from_millis(500)).await;
            return;
        }
        pause(Duration::from_millis(200)).await;
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

async fn kill9(
    s: &FaultsScenario,
    bed: &mut Bed,
    load: &mut Load,
    cloud_down: bool,
    o: &mut Outcome,
) -> anyhow::Result<()> {
    let n = kills(s);
    if cloud_down {
        bed.net.cut(0).map_err(anyhow::Error::msg)?;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5B00_1C4A);
    let mut restart = Vec::new();
    let mut done = 0;
    // Each process's spool counters, read just before it is killed, summed.
    let (mut full, mut peak_unacked) = (0.0, 0.0f64);
    for _ in 0..n {
        pause(Duration::from_millis(rng.gen_range(300..1200))).await;
        let m = bed.metrics().await;
        full += metric_sum(&m, "sluice_spool_full_total").unwrap_or(0.0);
        peak_unacked =
            peak_unacked.max(metric_sum(&m, "sluice_spool_unacked_records").unwrap_or(0.0));
        bed.sluice.kill_9();
        bed.sluice.start()?;
        restart.push(bed.sluice.wait_ready().await?);
        done += 1;
        load.reassociate_phd()
            .await
            .context("re-associating the PHD agents")?;
    }
    let m = bed.metrics().await;
    full += metric_sum(&m, "sluice_spool_full_total").unwrap_or(0.0);
    peak_unacked = peak_unacked.max(metric_sum(&m, "sluice_spool_unacked_records").unwrap_or(0.0));
    o.observed.push(format!(
        "spool, read from each process just before its kill: unacked records at most {peak_unacked:.0}; sluice_spool_full_total summed over the processes {full:.0}"
    ));
    if cloud_down {
        let at = super::ledger::wall_clock(std::time::SystemTime::now());
        bed.net.restore(0).map_err(anyhow::Error::msg)?;
        let t = bed.wait_uplinks(1, Duration::from_secs(30)).await?;
        o.observed.push(format!(
            "cloud link restored at {at} (load planned until {}); uplink connected after {}",
            super::ledger::wall_clock(std::time::SystemTime::now() + load.remaining()),
            ms(t)
        ));
    }
    restart.sort();
    o.observed.push(format!(
        "{done} kill -9 at 0.3–1.2 s intervals; start → accepting devices: median {}, max {}",
        ms(restart.get(restart.len() / 2).copied().unwrap_or_default()),
        ms(restart.last().copied().unwrap_or_default()),
    ));
    o.check = format!("{n} kills done");
    o.check_met = done == n;
    Ok(())
}

async fn cloud_restart(bed: &mut Bed, o: &mut Outcome) -> anyhow::Result<()> {
    let down = Duration::from_secs(5);
    bed.stop_cloud().await?;
    let t = Instant::now();
    let mut noticed = None;
    while t.elapsed() < down {
        if noticed.is_none() && bed.uplinks_connected().await == 0 {
            noticed = Some(t.elapsed());
        }
        pause(Duration::from_millis(50)).await;
    }
    bed.start_cloud().await?;
    let back = bed.wait_uplinks(1, Duration::from_secs(30)).await;
    o.observed.push(format!(
        "broker stopped (SIGTERM) for {} s; sluice saw the session down after {}; reconnected {} after the broker's restart",
        down.as_secs(),
        noticed.map_or("(not seen)".to_string(), ms),
        back.as_ref().map_or_else(|e| format!("never ({e})"), |d| ms(*d)),
    ));
    o.check = "uplink reconnected within 5 s of the broker's return".to_string();
    o.check_met = back.is_ok_and(|d| d <= Duration::from_secs(5));
    Ok(())
}

async fn spool_backlog(bed: &Bed) -> f64 {
    metric_sum(&bed.metrics().await, "sluice_spool_unacked_records").unwrap_or(0.0)
}

async fn cloud_slow(s: &FaultsScenario, bed: &mut Bed, o: &mut Outcome) -> anyhow::Result<()> {
    let slow = Duration::from_secs(if s.size == Size::Small { 10 } else { 30 });
    let connects0 = metric_sum(&bed.metrics().await, "sluice_uplink_connects_total").unwrap_or(0.0);
    bed.net.set_rate(0, "256kbit").map_err(anyhow::Error::msg)?;
    let t = Instant::now();
    let mut peak: f64 = 0.0;
    while t.elapsed() < slow {
        peak = peak.max(spool_backlog(bed).await);
        pause(Duration::from_millis(250)).await;
    }
    bed.net.unblackhole(0).map_err(anyhow::Error::msg)?;
    let r = Instant::now();
    let mut drained = None;
    while r.elapsed() < Duration::from_secs(60) {
        if spool_backlog(bed).await < 50.0 {
            drained = Some(r.elapsed());
            break;
        }
        pause(Duration::from_millis(200)).await;
    }
    let connects1 = metric_sum(&bed.metrics().await, "sluice_uplink_connects_total").unwrap_or(0.0);
    o.observed.push(format!(
        "link at 256 kbit/s (tbf, both ends) for {} s: spool unacked records peaked at {peak:.0}; after the rate was lifted the backlog drained in {}; uplink connects meanwhile: {}",
        slow.as_secs(),
        drained.map_or("(not within 60 s)".to_string(), ms),
        connects1 - connects0
    ));
    o.check = "backlog drained within 60 s of the link's recovery".to_string();
    o.check_met = drained.is_some();
    Ok(())
}

async fn cloud_blackhole(bed: &mut Bed, o: &mut Outcome) -> anyhow::Result<()> {
    let before = bed.uplinks_connected().await;
    bed.net.blackhole(0).map_err(anyhow::Error::msg)?;
    let t = Instant::now();
    let mut noticed = None;
    while t.elapsed() < Duration::from_secs(20) {
        if bed.uplinks_connected().await < before {
            noticed = Some(t.elapsed());
            break;
        }
        pause(Duration::from_millis(100)).await;
    }
    pause(Duration::from_secs(2)).await;
    bed.net.unblackhole(0).map_err(anyhow::Error::msg)?;
    let back = bed.wait_uplinks(before, Duration::from_secs(30)).await;
    o.observed.push(format!(
        "{before} uplink sessions connected; blackholed (pfifo limit 0, both ends); first session seen down after {}; link back after that + 2 s; all sessions reconnected {} later",
        noticed.map_or("(not within 20 s)".to_string(), ms),
        back.as_ref().map_or_else(|e| format!("never ({e})"), |d| ms(*d)),
    ));
    o.check = "noticed within 1.5 × keep-alive (5 s) + 1 s, and reconnected".to_string();
    o.check_met = noticed.is_some_and(|d| d <= Duration::from_millis(8500)) && back.is_ok();
    Ok(())
}

async fn multipath_flap(s: &FaultsScenario, bed: &mut Bed, o: &mut Outcome) -> anyhow::Result<()> {
    let total = Duration::from_secs(if s.size == Size::Small { 60 } else { 300 });
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xF1A9);
    let t = Instant::now();
    let mut flaps = 0u32;
    let mut down = false;
    let m0 = bed.metrics().await;
    while t.elapsed() < total {
        pause(Duration::from_millis(rng.gen_range(2000..5000))).await;
        if down {
            bed.net.restore(0).map_err(anyhow::Error::msg)?;
        } else {
            bed.net.cut(0).map_err(anyhow::Error::msg)?;
            flaps += 1;
        }
        down = !down;
    }
    if down {
        bed.net.restore(0).map_err(anyhow::Error::msg)?;
    }
    pause(Duration::from_secs(3)).await;
    let m1 = bed.metrics().await;
    let delta = |n: &str| metric_sum(&m1, n).unwrap_or(0.0) - metric_sum(&m0, n).unwrap_or(0.0);
    o.observed.push(format!(
        "path a cut {flaps} times over {} s (down and up every 2–5 s), path b steady; sluice: path failovers {}, path connects {}; no spool (devices acknowledged after the cloud's PUBACK)",
        total.as_secs(),
        delta("sluice_uplink_path_failovers_total"),
        delta("sluice_uplink_path_connects_total"),
    ));
    o.check = "sluice still running, path failovers counted".to_string();
    o.check_met = bed.sluice.running() && delta("sluice_uplink_path_failovers_total") > 0.0;
    Ok(())
}
