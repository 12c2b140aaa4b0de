//! The `onem2m` scenario at tiny scale against a real ACME (`pip install acmecse`): both
//! phases run, the plain client and sluice both get contentInstances created, and the report
//! says so.

mod sluice_binary;

use std::time::Duration;

use sluice_bench::scenarios::onem2m::{markdown, run_onem2m, OneM2mScenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_the_plain_client_and_sluice_get_content_instances_into_acme() -> anyhow::Result<()> {
    let mut s = OneM2mScenario::new(sluice_binary::built_now());
    s.connections = 2;
    s.pipeline = 4;
    s.devices = 2;
    s.rate_per_device = 20.0;
    s.fast_devices = 4;
    s.duration = Duration::from_secs(8);
    s.ramp = Duration::from_secs(1);
    s.settle = Duration::from_secs(1);
    s.command_line = "test".into();
    let report = run_onem2m(&s).await?;
    assert!(report.cse_max_rate > 10.0, "{report:#?}");
    assert_eq!(report.cse_errors, 0, "{report:#?}");
    // 2 devices × 20 msg/s offered; ACME takes far more, so nearly all of it goes through.
    assert!(report.sluice_rate > 20.0, "{report:#?}");
    assert_eq!(report.sluice_rejected, 0);
    assert!((report.ratio - report.sluice_rate / report.cse_max_rate).abs() < 1e-9);
    assert!(report.sluice_fast_cse_rate > 40.0, "{report:#?}");
    assert!(markdown(&report).contains("MQTT devices → sluice → ACME"));
    Ok(())
}
