//! `scenario outage`: a cloud outage under load with `[spool] ack = "spool"`. Afterwards every
//! message is delivered, per-device order holds within the backlog and within the live
//! stream, devices were acknowledged while the cloud was away, and the backlog drained.
//!
//! Two sizes: the quick one (16 devices, 5 s outage) and the (256 devices × 10 msg/s,
//! 60 s outage; about two minutes). Latency figures are printed, never asserted.

mod sluice_binary;

use std::time::{Duration, Instant};

use sluice_bench::scenarios::outage::{markdown, run_outage, OutageReport, OutageScenario};

/// The scenarios measure the machine: never two at once.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `config`, prints the report and how long the run took, and asserts it survived.
async fn run_and_assert_survived(config: &OutageScenario) -> anyhow::Result<()> {
    let started = Instant::now();
    let report = run_outage(config).await?;
    eprintln!("{}", markdown(&report));
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
    assert_outage_survived(&report);
    Ok(())
}

fn assert_outage_survived(report: &OutageReport) {
    let text = markdown(report);
    assert!(
        report.recorder_error.is_none(),
        "the recorder failed: {:?}\n{text}",
        report.recorder_error
    );
    assert!(report.sent > 0, "nothing was sent\n{text}");
    assert_eq!(
        report.unique_delivered, report.sent,
        "every message sent reaches the cloud\n{text}\nsluice stderr:\n{}",
        report.sluice_stderr_tail
    );
    assert_eq!(report.gaps, 0, "no gaps\n{text}");
    assert!(
        report.unique_delivered >= report.acknowledged,
        "every acknowledged message reaches the cloud\n{text}"
    );
    assert!(
        report.acknowledged_during_outage > 0,
        "devices are acknowledged by the spool while the cloud is away\n{text}"
    );
    assert!(
        report.backlog.messages > 0,
        "the outage left a backlog\n{text}"
    );
    assert!(report.drain_s.is_some(), "the backlog drained\n{text}");
    assert_eq!(
        report.order.backlog_violations, 0,
        "per-device order within the backlog\n{text}"
    );
    assert_eq!(
        report.order.live_violations, 0,
        "per-device order within the live stream\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_outage_loses_nothing_and_keeps_per_device_order() -> anyhow::Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut config = OutageScenario::quick(sluice_binary::built_now());
    config.command_line = "test (quick)".to_string();
    config.progress_every = None;
    run_and_assert_survived(&config).await
}

/// The scenario: 256 devices × 10 msg/s, a 60 s outage, 20 s of load after it (the
/// runner then waits for the rest of the backlog).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_60_s_outage_under_256_devices_loses_nothing_and_keeps_per_device_order(
) -> anyhow::Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut config = OutageScenario::new(sluice_binary::built_now());
    config.warmup = Duration::from_secs(10);
    config.after = Duration::from_secs(20);
    config.drain_max = Duration::from_secs(90);
    config.command_line = "test (256 devices, 60 s outage)".to_string();
    config.progress_every = Some(Duration::from_secs(10));
    run_and_assert_survived(&config).await
}
