//! The `site` scenario at tiny scale: one and two gateways behind a real HAProxy into a real
//! three-node Kafka cluster; each run delivers, Kafka holds every acknowledged message, and
//! the report has one CPU figure per gateway. Skipped with a printed reason without haproxy,
//! Java or Maven (scripts/test installs them).

mod sluice_binary;

use std::time::Duration;

use sluice_bench::scenarios::site::{markdown, run_site, SiteScenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_and_two_gateways_behind_haproxy_deliver_into_kafka() -> anyhow::Result<()> {
    if sluice_testkit::haproxy::haproxy_bin().is_none() {
        eprintln!("SKIPPED: `haproxy` not installed (scripts/test installs it)");
        return Ok(());
    }
    for tool in ["java", "mvn"] {
        if std::process::Command::new(tool)
            .arg("-version")
            .output()
            .is_err()
        {
            eprintln!("SKIPPED: `{tool}` not found (scripts/test installs it)");
            return Ok(());
        }
    }
    let mut s = SiteScenario::new(sluice_binary::built_now());
    s.cluster_script = sluice_testkit::kafka::default_script();
    s.gateways = vec![1, 2];
    s.devices = 20;
    s.rate_per_device = 10.0;
    s.duration = Duration::from_secs(9);
    s.ramp = Duration::from_secs(1);
    s.settle = Duration::from_secs(1);
    s.command_line = "test".into();
    let report = run_site(&s).await?;
    assert_eq!(report.runs.len(), 2, "{report:#?}");
    for (run, n) in report.runs.iter().zip([1, 2]) {
        assert_eq!(run.gateways, n);
        assert_eq!(run.gateway_cpu_percent.len(), n as usize, "{run:#?}");
        // 200 msg/s offered; a debug build on a busy machine still carries most of it.
        assert!(run.rate > 50.0, "{run:#?}");
        assert!(run.records_in_topic >= run.acknowledged_total, "{run:#?}");
        assert!(run.sluice_cpu_us_per_msg > 0.0 && run.haproxy_cpu_us_per_msg > 0.0);
    }
    let table = markdown(&report);
    assert!(table.contains("| 2 |"), "{table}");
    Ok(())
}
