//! Part **idle** of `scenario functions`: what sluice costs when nothing happens — devices
//! connected but silent and the function scaled to zero.
//!
//! Run: sluice with the function at `min_instances = 0`, `idle = 1s`; `idle_devices` MQTT
//! 3.1.1 connections ([`crate::load::idle`], keep-alive 60 s: one PINGREQ per device every
//! 30 s, so 100 devices make ~3.3 packets/s that sluice must answer); one event to start an
//! instance, then a wait until `sluice_function_instances` is 0 and sluice has no child
//! process, 2 s of settle, then the window: sluice's `utime + stime` from `/proc/<pid>/stat`
//! and every thread's counters from `/proc/<pid>/task/*/{comm,status,stat}` at both ends
//! ([`super::procs::thread_window`]). Target: ≤ 0.1 % of one core.

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::probe::Probe;
use super::procs::{self, ThreadWindow};
use super::{FnKind, FnSettings, FnSluice, FunctionsScenario};
use crate::harness::procfs::{cpu_time, Pid};
use crate::load::idle::{IdleConfig, IdleFleet};

/// The idle figures.
#[derive(Debug, Clone, Serialize)]
pub struct IdleResult {
    pub function: FnKind,
    pub placement: super::Placement,
    pub devices_connected: u64,
    pub keep_alive_s: u16,
    pub window_s: f64,
    pub sluice_cpu_ms: f64,
    /// sluice's CPU ÷ wall time, % of one core.
    pub sluice_percent_of_core: f64,
    /// The same from the threads' `schedstat` run time (ns resolution; threads alive at both
    /// ends).
    pub sluice_run_ms_schedstat: f64,
    pub target_met: bool,
    /// Voluntary context switches per second, all threads.
    pub wakeups_per_s: f64,
    pub threads: Vec<ThreadWindow>,
    /// Child processes of sluice at the window's end (0: scaled to zero throughout).
    pub children_at_end: usize,
    /// Devices the gateway closed during the window.
    pub devices_dropped: u64,
}

pub async fn run(
    s: &FunctionsScenario,
    kind: FnKind,
    command: &[String],
) -> anyhow::Result<IdleResult> {
    eprintln!(
        "functions: idle, {} silent devices, {} function scaled to zero, {:?} window",
        s.idle_devices,
        kind.name(),
        s.idle_window
    );
    let sluice = FnSluice::start(
        s,
        &FnSettings {
            command: command.to_vec(),
            min_instances: 0,
            max_instances: 1,
            concurrency: 8,
            idle: Duration::from_secs(1),
            reply_topic: "reply/{topic}".into(),
        },
    )
    .await?;
    let keep_alive_s = 60;
    let mut config = IdleConfig::new(sluice.child.device_addr(), s.idle_devices);
    config.keep_alive_s = keep_alive_s;
    config.client_prefix = "fnb-idle".into();
    let fleet = IdleFleet::open(config);
    let connected = fleet.wait_connected().await;
    // One event, so an instance ran and was stopped: the window sees the scaled-to-zero state
    // after real use, not a function never started.
    let mut probe = Probe::connect(sluice.child.device_addr(), "fnb-idle-probe", "reply/#").await?;
    probe
        .publish("fnb/idle", Bytes::from_static(b"wake"))
        .await?;
    probe.next(Duration::from_secs(30)).await?;
    drop(probe);
    if sluice.is_local() {
        sluice
            .wait_instances("0", |n| n == 0.0, Duration::from_secs(30))
            .await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    let pid = sluice.pid();
    let (cpu0, threads0, t0) = (
        cpu_time(Pid::Other(pid))?,
        procs::threads_of(pid),
        Instant::now(),
    );
    tokio::time::sleep(s.idle_window).await;
    let (cpu1, threads1, wall) = (
        cpu_time(Pid::Other(pid))?,
        procs::threads_of(pid),
        t0.elapsed(),
    );
    let children_at_end = procs::children_of(pid).len();
    let closed = fleet.close().await;

    let threads = procs::thread_window(&threads0, &threads1, wall);
    let cpu = cpu1.saturating_sub(cpu0).as_secs_f64();
    let percent = 100.0 * cpu / wall.as_secs_f64();
    let result = IdleResult {
        function: kind,
        placement: s.placement,
        devices_connected: connected.connected,
        keep_alive_s,
        window_s: wall.as_secs_f64(),
        sluice_cpu_ms: cpu * 1e3,
        sluice_percent_of_core: percent,
        sluice_run_ms_schedstat: threads
            .iter()
            .filter(|t| t.whole_window)
            .map(|t| t.run_ms)
            .sum(),
        target_met: percent <= 0.1,
        wakeups_per_s: threads.iter().map(|t| t.wakeups_per_s).sum(),
        threads,
        children_at_end,
        devices_dropped: closed.dropped_while_held,
    };
    eprintln!(
        "functions: idle: sluice {:.0} ms CPU in {:.0} s = {:.3} % of a core, {:.1} wake-ups/s over {} threads",
        result.sluice_cpu_ms,
        result.window_s,
        percent,
        result.wakeups_per_s,
        result.threads.len()
    );
    Ok(result)
}
