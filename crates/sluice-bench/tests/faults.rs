//! `scenario faults` at its small size against this work tree's sluice, the cases that fit a CI
//! budget ([`CI_CASES`]: 10 × kill -9 with the spool and the cloud up, the cloud broker stopped
//! and started, PINGRESP for an MQTT 3.1.1 device past its limit): every case runs to the end
//! under MQTT, CoAP and PHD load and nothing acknowledged to a device is missing at the cloud,
//! and the PINGRESP case's own check holds (a device with a 100-message window past
//! `receive_maximum` gets every PINGRESP and keeps its connection). Needs root (network
//! namespaces); skipped, saying why, without.

mod sluice_binary;

use sluice_bench::scenarios::faults::{markdown, run_faults, FaultsScenario, Size, CI_CASES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_acknowledged_is_lost_in_the_ci_fault_cases() -> anyhow::Result<()> {
    if let Err(why) = sluice_testkit::netns::available() {
        eprintln!("skipped: {why}");
        return Ok(());
    }
    let mut s = FaultsScenario::new(sluice_binary::debug_or_release(), Size::Small);
    s.cases = CI_CASES.iter().map(|c| c.to_string()).collect();
    s.command_line = "test".to_string();
    let report = run_faults(&s).await?;
    eprintln!("{}", markdown(&report));
    assert_eq!(report.cases.len(), CI_CASES.len());
    for case in &report.cases {
        assert_eq!(case.error, None, "{}: {case:?}", case.case);
        let f = case.figures.as_ref().expect("figures");
        assert!(
            f.acknowledged > 100,
            "{}: too little load: {f:?}",
            case.case
        );
        assert_eq!(
            f.acked_missing, 0,
            "{}: acknowledged but missing at the cloud: {f:?}",
            case.case
        );
        if case.case == "pingresp-311" {
            assert!(case.check_met, "{}: {:?}", case.check, case.observed);
        }
    }
    Ok(())
}
