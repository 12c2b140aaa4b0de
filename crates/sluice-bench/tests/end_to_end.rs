//! A tiny end-to-end run against a real Mosquitto: devices publish straight into its plain
//! listener while the sink subscribes on the same broker's TLS 1.3 listener. Everything sent
//! must arrive once and in order.

use std::time::Duration;

use sluice_bench::load::devices::{run_devices, DevicesConfig};
use sluice_bench::sinks::sink::{start_sink, SinkConfig, SinkTls};
use sluice_testkit::{Mosquitto, TestPki};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_devices_through_mosquitto_deliver_everything_once_and_in_order() -> anyhow::Result<()>
{
    let (pki, broker) = tokio::task::spawn_blocking(|| -> anyhow::Result<_> {
        let pki = TestPki::try_generate()?;
        let broker = Mosquitto::builder()
            .tls(&pki)
            .plain_listener(true)
            .start()?;
        Ok((pki, broker))
    })
    .await??;

    let mut sink = SinkConfig::new(broker.tls_addr());
    sink.tls = Some(SinkTls {
        ca_file: pki.ca_path().to_path_buf(),
        client_cert: None,
        server_name: "127.0.0.1".to_string(),
    });
    sink.expect_devices = 4;
    sink.progress_every = None;
    let sink = start_sink(sink).await?;

    let mut devices = DevicesConfig::new(broker.plain_addr());
    devices.devices = 4;
    devices.rate_per_device = 20.0;
    devices.duration = Duration::from_secs(2);
    devices.ramp = Duration::from_millis(200);
    devices.progress_every = None;
    let sent = run_devices(devices).await?;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sink.unique() < sent.sent && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let received = sink.stop(Some(sent.sent)).await?;

    assert!(
        sent.sent >= 4 * 20,
        "4 devices × 20 msg/s × ~1.8 s should send well over 80, sent {}",
        sent.sent
    );
    assert_eq!(
        sent.acknowledged, sent.sent,
        "every QoS 1 PUBLISH was acknowledged"
    );
    assert_eq!((sent.reconnects, sent.connect_failures), (0, 0));
    assert_eq!(sent.ack_latency.count, sent.sent);
    assert!(
        sent.ack_latency_steady.count > 0 && sent.ack_latency_steady.count < sent.sent,
        "PUBLISHes after the 200 ms ramp are the steady-state subset: {} of {}",
        sent.ack_latency_steady.count,
        sent.sent
    );
    assert_eq!(received.delivery_ratio, Some(1.0), "{received:?}");
    assert_eq!(received.duplicates, 0);
    assert_eq!(received.order_violations, 0);
    assert_eq!(received.gaps, 0);
    assert_eq!(received.foreign, 0);
    assert_eq!(received.devices_seen, 4);
    assert_eq!(received.e2e_latency.count, sent.sent);
    assert!(
        received.e2e_latency.p50_ms > 0.0 && received.e2e_latency.max_ms < 1000.0,
        "{:?}",
        received.e2e_latency
    );
    Ok(())
}
