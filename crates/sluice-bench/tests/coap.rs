//! `scenario coap` at tiny scale: the generator's floor against the in-process responder and
//! libcoap's proxy to the in-process CoAP-over-TCP upstream (separate responses) close the loop
//! with no timeouts; through sluice, every 2.04 has its PUBLISH at the cloud and the reverse
//! proxy answers every request.

mod sluice_binary;

use std::path::PathBuf;
use std::time::Duration;

use sluice_bench::scenarios::coap::{markdown, run_coap, CoapMode, CoapScenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floor_and_libcoap_proxy_close_the_loop() -> anyhow::Result<()> {
    let mut config = CoapScenario::new(PathBuf::from("unused"));
    config.sensors = vec![20];
    config.modes = vec![CoapMode::Floor, CoapMode::ProxyLibcoap];
    config.duration = Duration::from_secs(2);
    config.ramp = Duration::from_millis(200);
    config.warmup = Duration::from_millis(500);
    config.command_line = "test".to_string();
    let report = run_coap(&config).await?;
    assert_eq!(report.points.len(), 2);
    for p in &report.points {
        let t = p.load.totals;
        assert!(p.window.success > 0, "{:?}", p.mode);
        assert_eq!(t.timeouts, 0, "{:?}", p.mode);
        assert_eq!(t.responses, t.requests, "{:?}", p.mode);
        assert_eq!(p.load.unfinished, 0);
        assert!(p.latency.count > 0);
    }
    let proxy = &report.points[1];
    // libcoap's proxy answers with an empty ACK, then the upstream's response as a CON.
    assert!(proxy.load.totals.empty_acks > 0);
    assert!(proxy.cpu.cpu_seconds > 0.0);
    assert!(report
        .verdicts
        .iter()
        .any(|v| v.target.starts_with("floor")));
    let table = markdown(&report);
    assert!(table.contains("| proxy-libcoap | 20 |"), "{table}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_proxy_through_sluice() -> anyhow::Result<()> {
    let mut config = CoapScenario::new(sluice_binary::built_now());
    config.sensors = vec![20];
    config.modes = vec![CoapMode::Publish, CoapMode::ProxySluice];
    config.duration = Duration::from_secs(2);
    config.ramp = Duration::from_millis(200);
    config.warmup = Duration::from_millis(500);
    config.sluice_shards = 2;
    config.command_line = "test".to_string();
    let report = run_coap(&config).await?;
    let publish = &report.points[0];
    let t = publish.load.totals;
    assert!(t.success > 0 && t.timeouts == 0, "{t:?}");
    let d = publish.delivery.expect("publish measures delivery");
    assert_eq!(d.changed, t.success);
    assert!(d.at_cloud >= d.changed && d.ratio >= 1.0, "{d:?}");
    let proxy = &report.points[1];
    assert_eq!(proxy.mode, CoapMode::ProxySluice);
    assert!(proxy.load.totals.success > 0);
    assert_eq!(proxy.load.totals.responses, proxy.load.totals.requests);
    assert_eq!(
        proxy.load.codes.get("2.04"),
        Some(&proxy.load.totals.success)
    );
    Ok(())
}
