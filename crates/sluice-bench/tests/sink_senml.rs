//! The sink unpacks SenML packs that arrive through a real Mosquitto: a publisher sends a JSON
//! pack, a CBOR pack and a lone bench payload into the broker's plain listener; the sink,
//! subscribed over TLS 1.3 with per-device latency on, counts every bench payload inside the
//! packs as its own message.

use std::time::Duration;

use bytes::Bytes;
use sluice_bench::payload::{unix_now_ns, PayloadHeader};
use sluice_bench::sinks::sink::{start_sink, SinkConfig, SinkTls};
use sluice_proto::mqtt::QoS;
use sluice_proto::senml::{Format, PackWriter, Record, Value};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};

fn bench_payload(device: u32, seq: u64) -> Bytes {
    let mut bytes = vec![0u8; 64];
    PayloadHeader {
        device,
        seq,
        sent_at_ns: unix_now_ns(),
    }
    .write_to(&mut bytes)
    .expect("64 bytes hold the header");
    Bytes::from(bytes)
}

fn record(name: &str, value: Value) -> Record {
    Record {
        name: name.to_string(),
        time: 0.0,
        unit: None,
        value: Some(value),
        sum: None,
        update_time: None,
    }
}

fn pack(format: Format, records: &[Record]) -> Bytes {
    let mut writer = PackWriter::new(format);
    for r in records {
        writer.push(r).expect("valid record");
    }
    writer.finish()
}

fn data(device: u32, seq: u64) -> Record {
    record(
        &format!("urn:dev:bench:{device}"),
        Value::Data(bench_payload(device, seq)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn senml_packs_through_mosquitto_are_counted_record_by_record() -> anyhow::Result<()> {
    let (pki, broker) = tokio::task::spawn_blocking(|| -> anyhow::Result<_> {
        let pki = TestPki::try_generate()?;
        let broker = Mosquitto::builder()
            .tls(&pki)
            .plain_listener(true)
            .start()?;
        Ok((pki, broker))
    })
    .await??;

    let mut config = SinkConfig::new(broker.tls_addr());
    config.tls = Some(SinkTls {
        ca_file: pki.ca_path().to_path_buf(),
        client_cert: None,
        server_name: "127.0.0.1".to_string(),
    });
    config.expect_devices = 2;
    config.progress_every = None;
    config.per_device = true;
    let sink = start_sink(config).await?;

    let (mut publisher, connack) =
        TestClient::connect(broker.plain_addr(), ConnectOpts::v311("senml-publisher")).await?;
    assert_eq!(connack.code, 0);
    let json = pack(Format::Json, &[data(0, 0), data(0, 1), data(1, 0)]);
    let cbor = pack(
        Format::Cbor,
        &[
            data(1, 1),
            data(0, 1), // a duplicate of the JSON pack's second record
            record("urn:dev:bench:1:temp", Value::Number(36.6)),
        ],
    );
    for payload in [json, cbor, bench_payload(0, 2)] {
        let code = publisher
            .publish("gw/1/senml", payload, QoS::AtLeastOnce, false)
            .await?;
        assert_eq!(code, 0);
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sink.received() < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = sink.stop(Some(5)).await?;

    assert_eq!(report.received, 3, "PUBLISHes: {report:?}");
    assert_eq!((report.packs, report.records_in_packs), (2, 6));
    assert_eq!(report.unique, 5, "device 0 seq 0-2, device 1 seq 0-1");
    assert_eq!(report.duplicates, 1);
    assert_eq!(report.foreign, 1, "the numeric record");
    assert_eq!((report.order_violations, report.gaps), (0, 0));
    assert_eq!(report.devices_seen, 2);
    assert_eq!(report.delivery_ratio, Some(1.0));
    assert_eq!(report.e2e_latency.count, 5);
    let per_device: Vec<(u32, u64)> = report
        .per_device
        .iter()
        .map(|d| (d.device, d.received))
        .collect();
    assert_eq!(per_device, [(0, 3), (1, 2)]);
    for d in &report.per_device {
        assert!(
            d.max_ms > 0.0 && d.max_ms < 5000.0 && d.p50_ms <= d.p99_ms,
            "{d:?}"
        );
    }
    Ok(())
}
