use super::*;

fn config(devices: u32, high_share: f64) -> DevicesConfig {
    let mut c = DevicesConfig::new(std::net::SocketAddr::from(([127, 0, 0, 1], 1883)));
    c.devices = devices;
    c.high_share = high_share;
    c
}

#[test]
fn the_high_share_rounds_to_whole_devices() {
    assert_eq!(high_devices(4, 0.0), 0);
    assert_eq!(high_devices(4, 0.25), 1);
    assert_eq!(high_devices(4, 0.3), 1);
    assert_eq!(high_devices(4, 0.4), 2);
    assert_eq!(high_devices(3, 0.5), 2, "1.5 rounds half away from zero");
    assert_eq!(high_devices(1, 0.49), 0);
    assert_eq!(high_devices(1, 1.0), 1);
    assert_eq!(high_devices(16384, 0.01), 164);
    assert_eq!(high_devices(10, 7.0), 10, "clamped");
    assert_eq!(high_devices(10, f64::NAN), 0);
}

#[test]
fn the_lowest_indices_are_high_and_get_a_hi_client_id() {
    let c = config(4, 0.25);
    assert_eq!(c.high_devices(), 1);
    assert_eq!(c.client_id(0), "bench-hi-0");
    assert_eq!(c.client_id(1), "bench-1");
    assert_eq!(c.client_id(3), "bench-3");
    let mut c = config(5, 0.4);
    c.client_prefix = "meter".to_string();
    let ids: Vec<String> = (0..5).map(|i| c.client_id(i)).collect();
    assert_eq!(
        ids,
        ["meter-hi-0", "meter-hi-1", "meter-2", "meter-3", "meter-4"]
    );
    let c = config(3, 0.0);
    assert_eq!(c.client_id(0), "bench-0", "no share, no high devices");
}

#[test]
fn a_high_share_outside_zero_to_one_is_refused() {
    for bad in [-0.1, 1.01, f64::NAN, f64::INFINITY] {
        let e = config(4, bad).validate().unwrap_err();
        assert!(e.to_string().contains("between 0.0 and 1.0"), "{e}");
    }
    for ok in [0.0, 0.5, 1.0] {
        config(4, ok).validate().expect("valid share");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_devices_connect_with_their_hi_client_id_and_each_device_is_reported(
) -> anyhow::Result<()> {
    let broker =
        tokio::task::spawn_blocking(|| sluice_testkit::Mosquitto::builder().start()).await??;
    let mut c = DevicesConfig::new(broker.plain_addr());
    c.devices = 4;
    c.high_share = 0.25;
    c.rate_per_device = 50.0;
    c.payload = PayloadSize { min: 64, max: 64 };
    c.duration = Duration::from_millis(600);
    c.ramp = Duration::from_millis(100);
    c.progress_every = None;
    let report = run_devices(c).await?;
    assert_eq!(report.high_devices, 1);
    assert_eq!(report.per_device.len(), 4);
    let ids: Vec<&str> = report
        .per_device
        .iter()
        .map(|t| t.client_id.as_str())
        .collect();
    assert_eq!(ids, ["bench-hi-0", "bench-1", "bench-2", "bench-3"]);
    assert_eq!(
        report.per_device.iter().map(|t| t.high).collect::<Vec<_>>(),
        [true, false, false, false]
    );
    let sent: u64 = report.per_device.iter().map(|t| t.sent).sum();
    assert_eq!(sent, report.sent);
    for t in &report.per_device {
        assert!(t.sent > 0, "{t:?}");
        assert_eq!(t.acknowledged, t.sent, "{t:?}");
        assert!(t.ack_latency_steady.count > 0, "{t:?}");
    }
    broker
        .wait_for_log_async("as bench-hi-0", Duration::from_secs(2))
        .await?;
    broker
        .wait_for_log_async("as bench-3", Duration::from_secs(2))
        .await?;
    Ok(())
}
