//! The fast acknowledging sink and the `throughput` scenario: the sink PUBACKs and counts QoS 1
//! PUBLISHes over TLS 1.3 for MQTT 3.1.1 and 5, and a tiny step load through sluice and the
//! Mosquitto bridge finds a maximum sustained rate.

mod sluice_binary;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_bench::conn::{handshake, open, read_packet, tls_client_config};
use sluice_bench::harness::sut::Sut;
use sluice_bench::payload::{unix_now_ns, PayloadHeader};
use sluice_bench::scenarios::throughput::{run_throughput, Cloud, ThroughputScenario};
use sluice_bench::sinks::fastsink::{
    start_fast_sink, tls_server_config, FastSinkConfig, RECEIVE_MAXIMUM,
};
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Packet, Properties, ProtocolVersion, Publish, QoS,
};
use sluice_testkit::TestPki;
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;
use tokio::time::timeout;

/// Publish 100 QoS 1 bench messages and one QoS 0 duplicate to a fast sink with one write, and
/// expect one PUBACK per QoS 1 message, in order, and the sink's counters to match.
async fn fast_sink_acks_and_counts(version: ProtocolVersion) -> anyhow::Result<()> {
    let pki = tokio::task::spawn_blocking(TestPki::try_generate).await??;
    let tls = tls_server_config(pki.server_cert_path(), pki.server_key_path())?;
    let sink = start_fast_sink(
        TcpListener::bind("127.0.0.1:0").await?,
        FastSinkConfig::new(tls),
    )?;

    let client_tls = tls_client_config(pki.ca_path(), None)?;
    let mut io = open(
        sink.local_addr(),
        Some((&client_tls, "127.0.0.1")),
        Duration::from_secs(5),
    )
    .await?;
    let (mut rbuf, mut wbuf) = (BytesMut::new(), BytesMut::new());
    let mut decoder = Decoder::client(version, 1 << 20);
    let connack = handshake(
        &mut io,
        Connect {
            protocol: version,
            clean_start: true,
            keep_alive: 30,
            client_id: "fastsink-test".into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        },
        &mut rbuf,
        &mut wbuf,
        &mut decoder,
        Duration::from_secs(5),
    )
    .await?;
    match version {
        ProtocolVersion::V5 => assert_eq!(
            connack.properties.receive_maximum,
            Some(RECEIVE_MAXIMUM),
            "MQTT 5 clients are told the largest Receive Maximum"
        ),
        ProtocolVersion::V311 => assert!(connack.properties.is_empty()),
    }

    let mut payload_bytes = 0u64;
    wbuf.clear();
    for i in 0..101u16 {
        let mut payload = vec![0xAB; 100 + usize::from(i)];
        // The last (QoS 0) message repeats the sequence number of the one before: a duplicate.
        PayloadHeader {
            device: 3,
            seq: u64::from(i.min(99)),
            sent_at_ns: unix_now_ns(),
        }
        .write_to(&mut payload)?;
        payload_bytes += payload.len() as u64;
        let qos1 = i < 100;
        let publish = Publish {
            dup: false,
            qos: if qos1 {
                QoS::AtLeastOnce
            } else {
                QoS::AtMostOnce
            },
            retain: false,
            topic: "dev/3".into(),
            packet_id: qos1.then_some(i + 1),
            properties: None,
            payload: Bytes::from(payload),
        };
        encode(&Packet::Publish(publish), version, &mut wbuf)?;
    }
    io.write_all(&wbuf).await?;
    for expected in 1..=100u16 {
        let packet = timeout(
            Duration::from_secs(5),
            read_packet(&mut io, &mut rbuf, &mut decoder),
        )
        .await??;
        match packet {
            Packet::PubAck(ack) => {
                assert_eq!((ack.packet_id, ack.reason), (expected, 0));
            }
            other => panic!("expected PUBACK {expected}, got {}", other.name()),
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sink.messages() < 101 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = sink.stop().await;
    assert_eq!(report.messages, 101, "{report:?}");
    assert_eq!(report.acks_sent, 100, "QoS 0 is not acknowledged");
    assert_eq!(report.payload_bytes, payload_bytes);
    assert_eq!(report.foreign, 0);
    assert_eq!(report.protocol_errors, 0);
    assert_eq!(report.connections_total, 1);
    assert_eq!((report.unique, report.duplicates), (100, 1));
    assert_eq!(report.e2e_latency.count, 100, "first arrivals only");
    assert!(
        report.e2e_latency.max_ms < 5000.0,
        "{:?}",
        report.e2e_latency
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_sink_acknowledges_and_counts_every_mqtt_311_publish_over_tls13() -> anyhow::Result<()>
{
    fast_sink_acks_and_counts(ProtocolVersion::V311).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_sink_acknowledges_and_counts_every_mqtt_5_publish_over_tls13() -> anyhow::Result<()> {
    fast_sink_acks_and_counts(ProtocolVersion::V5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_step_load_finds_a_sustained_rate_through_sluice_and_the_bridge(
) -> anyhow::Result<()> {
    let mut config = ThroughputScenario::new(sluice_binary::debug_or_release());
    config.suts = vec![Sut::Sluice, Sut::MosquittoBridge];
    config.clouds = vec![Cloud::FastSink];
    config.devices = 8;
    config.start_rate = 400.0;
    config.step_factor = 2.0;
    config.max_steps = 2;
    config.refine_steps = 0;
    config.step_duration = Duration::from_secs(2);
    config.warmup = Duration::from_millis(500);
    // Generous: this checks the machinery, not the machine (tests run side by side).
    config.p99_bound = Duration::from_secs(2);
    config.sluice_shards = 1;
    config.command_line = "test".to_string();
    config.progress = false;
    let report = run_throughput(&config).await?;

    assert_eq!(report.runs.len(), 2);
    for run in &report.runs {
        assert!(
            run.max_sustained_rate > 0.0,
            "{} → {}: no step passed: {:#?}",
            run.sut.name(),
            run.cloud.name(),
            run.steps
        );
        assert_eq!(run.steps.len(), 2, "two ramp steps, no refinement");
        let first = &run.steps[0];
        assert!(
            first.achieved_rate > 300.0 && first.e2e_latency.count > 0,
            "{first:?}"
        );
        assert!(first.sut_cpu_us_per_msg > 0.0, "{first:?}");
        assert_eq!(run.fleet.device_failures, 0);
        assert_eq!(
            run.sink.messages, run.fleet.sent,
            "everything reached the fast sink"
        );
    }
    let table = sluice_bench::scenarios::throughput::markdown(&report);
    assert!(table.contains("| sluice | fast-sink |"), "{table}");
    assert!(
        table.contains("| mosquitto-bridge | fast-sink |"),
        "{table}"
    );
    Ok(())
}
