//! The dual-plane paper's system end to end: IEEE 11073 agents (the testkit's PHD agent)
//! → sluice's PHD edge → the oneM2M uplink → a real ACME IN-CSE. Each measurement becomes a
//! contentInstance (SenML JSON) under the agent's container and the metric's, and a confirmed
//! report is confirmed to the agent only once the CSE answered 2001 for all its measurements:
//! with the CSE stopped the agent gets no confirmation, and once it is back every measurement
//! is there.

mod common;

use std::time::Duration;

use common::gateway_sections;
use sluice_testkit::phd::{bcd_time, AgentSpec, PhdAgent, PhdDevice, Reading};
use sluice_testkit::Acme;

const AE: &str = "/cse-in/sluice-gw";

fn config(acme: std::net::SocketAddr) -> String {
    format!(
        "[phd]\nlisten = \"127.0.0.1:0\"\n\n[[uplink]]\nname = \"in-cse\"\nurl = \"http://{acme}\"\nallow_plaintext = true\nprotocol = \"onem2m\"\ncse_id = \"/id-in\"\ncse_name = \"cse-in\"\noriginator = \"Csluice-gw\"\nforward = [\"phd/#\"]\ncontainer = \"{{device}}/{{last}}\"\nreconnect_min = \"50ms\"\nreconnect_max = \"300ms\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phd_measurements_become_content_instances_and_are_confirmed_after_the_cse() {
    let mut acme = Acme::start().unwrap_or_else(|e| panic!("ACME: {e:#}"));
    let gw = gateway_sections("shards = 2", "", &config(acme.addr()));
    let addr = gw.phd_addr.expect("phd listener");
    let spec = AgentSpec {
        system_id: [0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77],
        device: PhdDevice::BloodPressure,
        config_id: 0x02BC,
        confirmed: true,
        antidote_quirks: false,
    };
    let mut agent = PhdAgent::connect(addr, spec).await.unwrap();
    assert_eq!(agent.associate().await.unwrap().aare_result, 0);
    let at = bcd_time(2024, 5, 6, 7, 8, 9, 0);
    let reading = |sys: i32| Reading::BloodPressure {
        systolic: (sys, 0),
        diastolic: (80, 0),
        mean: (95, 0),
        pulse: (70, 0),
    };
    for sys in [120, 121] {
        agent
            .report(&reading(sys), at, Duration::from_secs(20))
            .await
            .unwrap()
            .expect("confirmed once the CSE has it");
    }
    let bp = acme
        .content_instances(&format!("{AE}/0011223344556677/bp"))
        .expect("bp container");
    assert_eq!(bp.len(), 2, "{bp:?}");
    assert!(bp.iter().all(|(cnf, _)| cnf == "application/senml+json:0"));
    let first: serde_json::Value = serde_json::from_str(&bp[0].1).unwrap();
    assert_eq!(first[0]["n"], "urn:dev:mac:0011223344556677:sys");
    assert_eq!(first[0]["v"], 15999, "120 mmHg in Pa");
    assert_eq!(
        acme.content_instances(&format!("{AE}/0011223344556677/pulse"))
            .unwrap()
            .len(),
        2
    );

    // The CSE goes away: the next report is not confirmed (the agent's wait runs out) …
    acme.stop();
    let unconfirmed = agent
        .report(&reading(130), at, Duration::from_millis(1500))
        .await;
    assert!(
        unconfirmed.is_err(),
        "no confirmation while the CSE is down: {unconfirmed:?}"
    );
    // … and once it is back (empty: ACME keeps nothing), sluice re-creates the AE and
    // containers and delivers what it holds.
    acme.restart().unwrap();
    let mut found = Vec::new();
    for _ in 0..100 {
        if let Ok(v) = acme.content_instances(&format!("{AE}/0011223344556677/bp")) {
            found = v;
            if !found.is_empty() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        found.len(),
        1,
        "the unconfirmed report's measurement arrived after the restart: {found:?}"
    );
    let v: serde_json::Value = serde_json::from_str(&found[0].1).unwrap();
    assert_eq!(v[0]["v"], (130.0f64 * 133.322387415).round() as i64);
    gw.shutdown();
}

/// Finding 5 of issue 28: a report whose data the CSE refuses for good (here 5207: every
/// contentInstance is larger than the container's `mbs`) is not confirmed to the agent — it
/// gets a ROER (not-allowed-by-object) for that invoke-id and keeps its measurement — and the
/// refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_the_cse_refuses_for_good_is_answered_roer_not_confirmed() {
    let acme = Acme::start().unwrap_or_else(|e| panic!("ACME: {e:#}"));
    let toml = config(acme.addr()).replace("[[uplink]]\n", "[[uplink]]\nmbs = \"64B\"\n");
    let gw = gateway_sections("shards = 1", "", &toml);
    let addr = gw.phd_addr.expect("phd listener");
    let spec = AgentSpec {
        system_id: [0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x88],
        device: PhdDevice::BloodPressure,
        config_id: 0x02BC,
        confirmed: true,
        antidote_quirks: false,
    };
    let mut agent = PhdAgent::connect(addr, spec).await.unwrap();
    assert_eq!(agent.associate().await.unwrap().aare_result, 0);
    let reading = Reading::BloodPressure {
        systolic: (120, 0),
        diastolic: (80, 0),
        mean: (95, 0),
        pulse: (70, 0),
    };
    let answer = agent
        .report(
            &reading,
            bcd_time(2024, 5, 6, 7, 8, 9, 0),
            Duration::from_secs(20),
        )
        .await;
    let error = format!(
        "{:#}",
        answer.expect_err("a refused report is not confirmed")
    );
    assert!(
        error.contains("ROER error-value Some(24)"),
        "the agent is told in its protocol: {error}"
    );
    assert_eq!(agent.confirmations_received(), 0);
    assert!(
        agent.closed().is_none(),
        "the association goes on: {agent:?}"
    );
    assert_eq!(
        common::metric_sum(&gw.metrics_text(), "sluice_phd_reports_refused_total"),
        1.0
    );
    gw.shutdown();
}
