//! `scenario core` at tiny scale against all three systems under test: sluice and the bridge
//! deliver everything, the floor acknowledges everything and forwards nothing, and the report
//! sets each gateway's CPU against the floor's; two dashboards held open on sluice stream; the
//! io_uring floor beside the epoll one.

mod sluice_binary;

use std::path::PathBuf;
use std::time::Duration;

use sluice_bench::harness::sut::{AggregateOpts, Sut};
use sluice_bench::load::devices::{Arrivals, PayloadSize};
use sluice_bench::scenarios::core::{markdown, run_core, CoreScenario};
use sluice_proto::mqtt::{ProtocolVersion, QoS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_devices_through_sluice_the_bridge_and_the_floor() -> anyhow::Result<()> {
    let config = CoreScenario {
        devices: 4,
        rate_per_device: 20.0,
        duration: Duration::from_secs(3),
        ramp: Duration::from_millis(300),
        settle: Duration::from_millis(200),
        payload: PayloadSize {
            min: 100,
            max: 1024,
        },
        protocol: ProtocolVersion::V5,
        qos: QoS::AtLeastOnce,
        arrivals: Arrivals::Periodic,
        suts: vec![Sut::Sluice, Sut::MosquittoBridge, Sut::Floor],
        sluice_bin: sluice_binary::debug_or_release(),
        floor_bin: PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
        sluice_shards: 1,
        sluice_aggregate: AggregateOpts::off(),
        drain_idle: Duration::from_secs(2),
        drain_max: Duration::from_secs(5),
        command_line: "test".to_string(),
        progress_every: None,
        device_tls: false,
        sluice_extra: None,
        dashboards: 2,
    };
    let report = run_core(&config).await?;
    assert_eq!(report.runs.len(), 3);
    // `dashboards` holds two open on sluice (only): each loaded the page and streamed.
    for run in &report.runs {
        match (&run.dashboards, run.sut) {
            (Some(d), Sut::Sluice) => {
                assert_eq!(d.open, 2);
                assert!(d.events_in_window >= 2, "{d:?}");
                assert!(d.page_load_bytes > 2 * 20_000, "{d:?}");
                assert_eq!(d.streams_ended, 0, "{d:?}");
                assert!(run.control_thread_cpu_percent.is_some());
            }
            (None, Sut::Sluice) => panic!("no dashboards report for sluice"),
            (d, _) => assert!(d.is_none()),
        }
    }
    for run in &report.runs {
        let name = run.sut.name();
        assert!(run.sent >= 4 * 20 * 2, "{name}: sent only {}", run.sent);
        assert_eq!(
            run.devices.acknowledged, run.sent,
            "{name}: every QoS 1 PUBLISH acknowledged"
        );
        assert_eq!(
            (run.devices.reconnects, run.devices.connect_failures),
            (0, 0),
            "{name}"
        );
        assert!(run.steady_messages > 0, "{name}: nothing in the window");
        if run.sut == Sut::Floor {
            assert_eq!(run.unique_received, 0, "the floor forwards nothing");
            assert_eq!(run.drain_s, 0.0, "nothing to drain from the floor");
        } else {
            assert_eq!(run.delivery_ratio, 1.0, "{name}: {:?}", run.sink);
            assert_eq!(run.order_violations, 0, "{name}");
        }
    }
    let floor = report.floor.as_ref().expect("the floor ran");
    let us = |sut: Sut| {
        report
            .runs
            .iter()
            .find(|r| r.sut == sut)
            .map(|r| r.sut_cpu_us_per_msg)
            .unwrap()
    };
    assert_eq!(floor.floor_us_per_msg, us(Sut::Floor));
    assert_eq!(floor.sluice_us_per_msg, Some(us(Sut::Sluice)));
    assert_eq!(floor.bridge_us_per_msg, Some(us(Sut::MosquittoBridge)));
    if us(Sut::MosquittoBridge) > 0.0 {
        let share = floor.floor_share_of_bridge.expect("bridge CPU measured");
        let expected = us(Sut::Floor) / us(Sut::MosquittoBridge);
        assert!((share - expected).abs() < 0.006, "{share} vs {expected}");
    }
    let table = markdown(&report);
    assert!(table.contains("| floor |"), "{table}");
    assert!(table.contains("n/a (forwards nothing)"), "{table}");
    assert!(table.contains("**Floor.**"), "{table}");
    Ok(())
}

/// `--sut floor,floor-uring`: the io_uring floor answers every QoS 1 PUBLISH of devices driven
/// by the scenario like the epoll floor, and the report sets it against the epoll floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_devices_through_the_epoll_and_the_io_uring_floor() -> anyhow::Result<()> {
    let config = CoreScenario {
        devices: 4,
        rate_per_device: 20.0,
        duration: Duration::from_secs(3),
        ramp: Duration::from_millis(300),
        settle: Duration::from_millis(200),
        payload: PayloadSize {
            min: 100,
            max: 1024,
        },
        protocol: ProtocolVersion::V311,
        qos: QoS::AtLeastOnce,
        arrivals: Arrivals::Periodic,
        suts: vec![Sut::Floor, Sut::FloorUring],
        sluice_bin: PathBuf::from("unused"),
        floor_bin: PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
        sluice_shards: 1,
        sluice_aggregate: AggregateOpts::off(),
        drain_idle: Duration::from_secs(2),
        drain_max: Duration::from_secs(5),
        command_line: "test".to_string(),
        progress_every: None,
        device_tls: false,
        sluice_extra: None,
        dashboards: 0,
    };
    let report = run_core(&config).await?;
    assert_eq!(report.runs.len(), 2);
    for run in &report.runs {
        let name = run.sut.name();
        assert!(run.sent >= 4 * 20 * 2, "{name}: sent only {}", run.sent);
        assert_eq!(
            run.devices.acknowledged, run.sent,
            "{name}: every QoS 1 PUBLISH acknowledged"
        );
        assert_eq!(
            (run.devices.reconnects, run.devices.connect_failures),
            (0, 0),
            "{name}"
        );
        assert_eq!(run.unique_received, 0, "{name} forwards nothing");
        assert_eq!(run.drain_s, 0.0, "{name}: nothing to drain");
    }
    assert!(report.runs[1].sut_config.ends_with("--io uring"));
    let floor = report.floor.as_ref().expect("the floor ran");
    let uring = report.runs[1].sut_cpu_us_per_msg;
    assert_eq!(floor.floor_uring_us_per_msg, Some(uring));
    if floor.floor_us_per_msg > 0.0 {
        let ratio = floor.uring_over_epoll.expect("both measured");
        assert!((ratio - uring / floor.floor_us_per_msg).abs() < 0.001);
    }
    let table = markdown(&report);
    assert!(table.contains("| floor | floor-uring |"), "{table}");
    assert!(
        table.contains("`floor-uring` (the same floor over io_uring)"),
        "{table}"
    );
    Ok(())
}

/// `--device-tls`: the devices' rustls sessions to the edge Mosquitto's TLS 1.3 listener carry
/// every QoS 1 PUBLISH to the cloud (sluice's `[mqtt.tls]` listener is not on this branch yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_over_tls_through_the_bridge() -> anyhow::Result<()> {
    let config = CoreScenario {
        devices: 4,
        rate_per_device: 20.0,
        duration: Duration::from_secs(3),
        ramp: Duration::from_millis(300),
        settle: Duration::from_millis(200),
        payload: PayloadSize { min: 100, max: 200 },
        protocol: ProtocolVersion::V311,
        qos: QoS::AtLeastOnce,
        arrivals: Arrivals::Periodic,
        suts: vec![Sut::MosquittoBridge],
        sluice_bin: PathBuf::from("unused"),
        floor_bin: PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
        sluice_shards: 1,
        sluice_aggregate: AggregateOpts::off(),
        drain_idle: Duration::from_secs(2),
        drain_max: Duration::from_secs(5),
        command_line: "test".to_string(),
        progress_every: None,
        device_tls: true,
        sluice_extra: None,
        dashboards: 0,
    };
    let report = run_core(&config).await?;
    let run = &report.runs[0];
    assert!(run.sent >= 4 * 20 * 2, "sent only {}", run.sent);
    assert_eq!(run.devices.acknowledged, run.sent);
    assert_eq!(run.devices.connect_failures, 0);
    assert_eq!(run.delivery_ratio, 1.0, "{:?}", run.sink);
    assert!(markdown(&report).contains("over TLS 1.3"));
    Ok(())
}
