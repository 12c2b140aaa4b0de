//! `scenario hostile` at tiny scale against this work tree's sluice: two cases (9, the
//! escaped-topic answer; 11, SIGHUP) run to the end, with the attacker's bytes counted at its
//! socket, the healthy devices measured in both phases and the report rendered. The verdicts
//! themselves are not asserted: they change as issue 28's fixes land.

mod sluice_binary;

use std::time::Duration;

use sluice_bench::scenarios::hostile::{markdown, run_hostile, HostileScenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cases_run_and_are_reported() -> anyhow::Result<()> {
    let mut s = HostileScenario::new(sluice_binary::debug_or_release());
    s.cases = vec![9, 11];
    s.healthy_devices = 4;
    s.baseline = Duration::from_secs(1);
    s.min_attack_window = Duration::from_secs(1);
    s.command_line = "test".to_string();
    let report = run_hostile(&s).await?;
    assert_eq!(report.cases.len(), 2);
    let nine = &report.cases[0];
    assert_eq!(nine.error, None, "{nine:?}");
    let t = nine.traffic.expect("case 9 counts the attacker's bytes");
    assert!(t.bytes_in > 1000, "{t:?}");
    assert!(t.bytes_out > 0, "sluice answers the POST: {t:?}");
    let h = nine.healthy.as_ref().expect("healthy devices measured");
    assert!(h.baseline.count > 0 && h.during.count > 0, "{h:?}");
    assert!(nine.rss_before_kib > 0);
    let eleven = &report.cases[1];
    assert_eq!(eleven.error, None, "{eleven:?}");
    assert_eq!(eleven.observed.len(), 1);
    let table = markdown(&report);
    assert!(
        table.contains("| 9 | publish to an invalid topic of 0x01 bytes |"),
        "{table}"
    );
    assert!(table.contains("| 11 | kill -HUP |"), "{table}");
    Ok(())
}
