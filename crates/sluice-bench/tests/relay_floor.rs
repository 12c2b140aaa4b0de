//! The relay floor against a real Mosquitto over TLS 1.3: a device's QoS 1 PUBLISHes reach a
//! cloud subscriber with their topics and payloads, in order, and the device's PUBACK comes only
//! after the cloud acknowledged (a stopped cloud broker holds it back); and `scenario core
//! --sut floor,relay-floor,sluice` measures it beside the floor and sluice, every message
//! delivered once and in order, with sluice ÷ relay-floor in the table.

mod sluice_binary;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use sluice_bench::harness::sut::{AggregateOpts, Sut};
use sluice_bench::load::devices::{Arrivals, PayloadSize};
use sluice_bench::scenarios::core::{markdown, run_core, CoreScenario};
use sluice_bench::sinks::relay_floor::{run_relay_floor, RelayFloor};
use sluice_proto::mqtt::{Packet, ProtocolVersion, QoS};
use sluice_testkit::broker::Mosquitto;
use sluice_testkit::certs::TestPki;
use sluice_testkit::client::{ConnectOpts, TestClient};

/// Sends `signal` (STOP, CONT) to `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Continues the cloud broker when dropped, so a failing assertion never leaves it stopped.
struct Continue(u32);

impl Drop for Continue {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_reach_the_cloud_in_order_and_the_device_is_acked_only_after_the_cloud(
) -> anyhow::Result<()> {
    let (pki, cloud) = tokio::task::spawn_blocking(|| -> anyhow::Result<_> {
        let pki = TestPki::try_generate()?;
        let cloud = Mosquitto::builder()
            .tls(&pki)
            .plain_listener(false)
            .start()?;
        Ok((pki, cloud))
    })
    .await??;
    let cloud_pid = cloud.pid().expect("the cloud broker runs");
    let tls = ConnectOpts::v311("cloud-subscriber")
        .with_tls(pki.rustls_client_config(false), "127.0.0.1");
    let (mut subscriber, _) = TestClient::connect(cloud.tls_addr(), tls).await?;
    subscriber.subscribe(&[("#", QoS::AtLeastOnce)]).await?;

    let (tx, rx) = std::sync::mpsc::channel();
    let cfg = RelayFloor::new(
        "127.0.0.1:0".parse()?,
        cloud.tls_addr(),
        pki.ca_path().to_path_buf(),
    );
    std::thread::spawn(move || run_relay_floor(&cfg, |addr| tx.send(addr).unwrap()));
    let relay =
        tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(15))).await??;
    cloud
        .wait_for_log_async("as relay-floor", Duration::from_secs(5))
        .await?;

    // Twenty QoS 1 PUBLISHes in one burst, from an MQTT 5 device: each acknowledged, each at
    // the cloud once, in order, with its topic and payload.
    let (mut device, _) = TestClient::connect(relay, ConnectOpts::v5("device-1")).await?;
    let mut ids = Vec::new();
    for i in 0..20u8 {
        let topic = format!("bench/{}", i % 3);
        let id = device
            .publish_no_wait(
                &topic,
                vec![i; 100 + usize::from(i)],
                QoS::AtLeastOnce,
                false,
            )
            .await?;
        ids.push(id.expect("a QoS 1 packet id"));
    }
    for id in ids {
        assert_eq!(device.wait_ack(id).await?, 0, "PUBACK {id}");
    }
    for i in 0..20u8 {
        let p = subscriber
            .recv(Duration::from_secs(5))
            .await?
            .unwrap_or_else(|| panic!("message {i} never reached the cloud subscriber"));
        assert_eq!(&*p.topic, format!("bench/{}", i % 3));
        assert_eq!(
            p.payload.as_ref(),
            vec![i; 100 + usize::from(i)],
            "message {i}"
        );
    }

    // The cloud stopped: the PUBLISH cannot be acknowledged by it, so the device gets nothing.
    signal(cloud_pid, "STOP");
    let resume = Continue(cloud_pid);
    let id = device
        .publish_no_wait(
            "bench/held",
            &b"after the cloud"[..],
            QoS::AtLeastOnce,
            false,
        )
        .await?
        .expect("a QoS 1 packet id");
    match device.recv_packet(Duration::from_millis(700)).await? {
        None => {}
        Some(Packet::PubAck(ack)) => {
            panic!(
                "PUBACK {} while the cloud broker was stopped",
                ack.packet_id
            )
        }
        Some(other) => panic!("unexpected {}", other.name()),
    }
    // Continued: the cloud acknowledges, then the device is.
    drop(resume);
    assert_eq!(device.wait_ack(id).await?, 0);
    let p = subscriber
        .recv(Duration::from_secs(5))
        .await?
        .expect("the held message at the cloud");
    assert_eq!(
        (&*p.topic, p.payload.as_ref()),
        ("bench/held", &b"after the cloud"[..])
    );
    assert!(
        subscriber.recv(Duration::from_millis(200)).await?.is_none(),
        "no duplicate"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_core_measures_the_relay_floor_beside_the_floor_and_sluice() -> anyhow::Result<()>
{
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
        suts: vec![Sut::Floor, Sut::RelayFloor, Sut::Sluice],
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
        dashboards: 0,
    };
    let report = run_core(&config).await?;
    let relay = report
        .runs
        .iter()
        .find(|r| r.sut == Sut::RelayFloor)
        .expect("the relay floor ran");
    assert!(relay.sent >= 4 * 20 * 2, "sent only {}", relay.sent);
    assert_eq!(
        relay.devices.acknowledged, relay.sent,
        "every PUBLISH acknowledged"
    );
    assert_eq!(relay.delivery_ratio, 1.0, "{:?}", relay.sink);
    assert_eq!((relay.duplicates, relay.order_violations), (0, 0));
    assert_eq!(
        (relay.devices.reconnects, relay.devices.connect_failures),
        (0, 0)
    );
    assert!(relay.steady_messages > 0 && relay.sut_cpu_us_per_msg > 0.0);
    assert!(relay.sut_config.contains("relay-floor --listen 127.0.0.1:"));

    let us = |sut: Sut| {
        report
            .runs
            .iter()
            .find(|r| r.sut == sut)
            .map(|r| r.sut_cpu_us_per_msg)
            .unwrap()
    };
    let r = report.relay_floor.as_ref().expect("the relay comparison");
    assert_eq!(r.relay_floor_us_per_msg, us(Sut::RelayFloor));
    let sluice_over = r.sluice_over_relay_floor.expect("sluice ran");
    assert!((sluice_over - us(Sut::Sluice) / us(Sut::RelayFloor)).abs() < 0.001);
    if us(Sut::Floor) > 0.0 {
        let over_floor = r.relay_floor_over_floor.expect("the floor ran");
        assert!((over_floor - us(Sut::RelayFloor) / us(Sut::Floor)).abs() < 0.001);
    }
    assert_eq!(r.bridge_over_relay_floor, None, "the bridge did not run");
    let table = markdown(&report);
    assert!(
        table.contains("| floor | relay-floor | sluice | sluice ÷ relay-floor |"),
        "{table}"
    );
    assert!(table.contains("**Relay floor.**"), "{table}");
    let cpu_row = table
        .lines()
        .find(|l| l.starts_with("| SUT CPU per message, µs |"))
        .expect("the CPU row");
    assert!(
        cpu_row.ends_with(&format!(" {:.2} |", us(Sut::Sluice) / us(Sut::RelayFloor))),
        "{cpu_row}"
    );
    Ok(())
}

/// A full in-flight window closes the device whose PUBLISH found it full (no PUBACK for it),
/// and the relay goes on serving: the held message is acknowledged once the cloud is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_in_flight_window_closes_the_device_that_overflows_it() -> anyhow::Result<()> {
    let (pki, cloud) = tokio::task::spawn_blocking(|| -> anyhow::Result<_> {
        let pki = TestPki::try_generate()?;
        let cloud = Mosquitto::builder()
            .tls(&pki)
            .plain_listener(false)
            .start()?;
        Ok((pki, cloud))
    })
    .await??;
    let cloud_pid = cloud.pid().expect("the cloud broker runs");
    let (tx, rx) = std::sync::mpsc::channel();
    let mut cfg = RelayFloor::new(
        "127.0.0.1:0".parse()?,
        cloud.tls_addr(),
        pki.ca_path().to_path_buf(),
    );
    cfg.max_inflight = 1;
    std::thread::spawn(move || run_relay_floor(&cfg, |addr| tx.send(addr).unwrap()));
    let relay =
        tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(15))).await??;
    let (mut first, _) = TestClient::connect(relay, ConnectOpts::v311("first")).await?;
    let (mut second, _) = TestClient::connect(relay, ConnectOpts::v311("second")).await?;

    signal(cloud_pid, "STOP");
    let resume = Continue(cloud_pid);
    let held = first
        .publish_no_wait("bench/1", &b"held"[..], QoS::AtLeastOnce, false)
        .await?
        .expect("a QoS 1 packet id");
    // The relay answers this PINGREQ after reading the PUBLISH before it: that one is in flight.
    first.ping().await?;
    second
        .publish_no_wait("bench/2", &b"overflow"[..], QoS::AtLeastOnce, false)
        .await?;
    assert!(
        second.recv_packet(Duration::from_secs(5)).await.is_err(),
        "the overflowing device is closed, without a PUBACK"
    );
    drop(resume);
    assert_eq!(
        first.wait_ack(held).await?,
        0,
        "the held message, once the cloud is back"
    );
    Ok(())
}
