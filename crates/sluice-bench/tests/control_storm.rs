//! `scenario control-storm` at tiny scale: a short scan-report maximum and two storm levels in
//! both plane modes; the data load arrives at the cloud, the storm's control messages are the
//! ones sluice counts, no storm session fails, and the agent table is empty at the end.

mod sluice_binary;

use std::time::Duration;

use sluice_bench::scenarios::control_storm::{
    markdown, run_control_storm, ControlStormScenario, Plane,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_planes_carry_the_data_through_a_small_storm() -> anyhow::Result<()> {
    let mut s = ControlStormScenario::new(sluice_binary::built_now());
    s.levels = vec![0, 500];
    s.warmup = Duration::from_millis(500);
    s.settle = Duration::from_millis(500);
    s.window = Duration::from_secs(2);
    s.phd_agents = 4;
    s.phd_rate = 200.0;
    s.mqtt_devices = 2;
    s.mqtt_rate = 100.0;
    s.storm_workers = 16;
    s.max_agents = 4;
    s.max_window = 4;
    s.max_duration = Duration::from_secs(1);
    s.direct_publishers = 1;
    s.command_line = "test".to_string();
    let report = run_control_storm(&s).await?;
    let max = report.max_reports.as_ref().expect("the maximum ran");
    assert!(
        max.delivered > 0.0 && max.reports_confirmed > 0.0,
        "{max:?}"
    );
    assert!(max.direct.as_ref().is_some_and(|d| d.delivered > 0.0));
    assert_eq!(report.planes.len(), 2);
    for run in &report.planes {
        let [quiet, storm] = &run.levels[..] else {
            panic!("two levels expected");
        };
        assert_eq!(quiet.storm_rate, 0.0);
        assert!(
            quiet.phd_delivered > 0.0 && quiet.mqtt_delivered > 0.0,
            "{:?}: {quiet:?}",
            run.plane
        );
        assert!(storm.storm_rate > 250.0, "{:?}: {storm:?}", run.plane);
        assert_eq!(
            storm.sessions_failed, 0,
            "{:?}: {:?}",
            run.plane, run.storm_first_error
        );
        let counted = storm.sluice_control_rate.expect("sluice's /metrics read");
        assert!(
            (counted - storm.storm_rate).abs() <= 0.2 * storm.storm_rate,
            "{counted} vs {}",
            storm.storm_rate
        );
        assert!(run.data_errors.is_empty(), "{:?}", run.data_errors);
        assert_eq!(
            run.agents_after,
            Some(0.0),
            "{:?}: the agent table leaks",
            run.plane
        );
    }
    assert_eq!(report.planes[1].plane, Plane::Single);
    let md = markdown(&report);
    assert!(
        md.contains("### single-plane") && md.contains("### Verdicts"),
        "{md}"
    );
    Ok(())
}
