//! The Kafka transport against a real three-node Apache Kafka 4.4.0 cluster in KRaft mode
//! (`scripts/kafka-cluster`): records produced with `acks = all` by the idempotent producer
//! are acknowledged, and Kafka's own console consumer reads every one, each device's in
//! order, keyed by the device and carrying the MQTT topic as a header.
//!
//! Skipped with a printed reason when Java or Maven is missing (scripts/test installs them).
//! The gateway end to end (devices → sluice → Kafka, a leader killed): `uplink_kafka.rs`.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use kafka_protocol::records::Compression;
use sluice::sink::kafka::scram::Mechanism;
use sluice::sink::kafka::{KafkaParams, KafkaTransport, SaslParams};
use sluice::sink::transport::{Feedback, Transport, Unit};
use sluice::sink::UplinkMessage;
use sluice_proto::mqtt::QoS;

use common::kafka::KafkaCluster;

fn msg(device: &str, topic: &str, n: usize) -> UplinkMessage {
    UplinkMessage {
        device: ByteString::from(device),
        topic: ByteString::from(topic),
        payload: Bytes::from(format!("{device} {n}")),
        qos: QoS::AtLeastOnce,
        retain: false,
        received_at: Instant::now(),
        ack: None,
        content_type: None,
        stored: None,
    }
}

#[tokio::test]
async fn records_are_acknowledged_after_acks_all_and_read_back_in_order_per_device() {
    let Some(cluster) = KafkaCluster::start(None) else {
        return;
    };
    let mut t = KafkaTransport::new(KafkaParams {
        brokers: cluster.bootstrap.split(',').map(String::from).collect(),
        topic: "{topic}".into(),
        compression: Compression::Lz4,
        tls: None,
        server_name: None,
        client_id: "sluice-test-0".into(),
        request_timeout: Duration::from_secs(30),
        window: 1000,
        sasl: None,
    });
    t.connect().await.expect("connects to the cluster");
    const DEVICES: usize = 10;
    const EACH: usize = 100;
    let msgs: Vec<UplinkMessage> = (0..EACH)
        .flat_map(|n| (0..DEVICES).map(move |d| msg(&format!("dev-{d}"), "site/telemetry", n)))
        .collect();
    let mut ids = std::collections::HashSet::new();
    let mut acked = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    // In batches of 100, as an outbox would: encode, flush, then poll for answers.
    for chunk in msgs.chunks(100) {
        for m in chunk {
            let id = t
                .encode(Unit::Message {
                    msg: m,
                    resend: false,
                })
                .expect("encodable")
                .expect("Kafka acknowledges every record");
            assert!(ids.insert(id), "ids are unique");
        }
        t.flush().await.expect("flush");
    }
    while acked.len() < ids.len() {
        assert!(
            Instant::now() < deadline,
            "{} of {} acknowledged",
            acked.len(),
            ids.len()
        );
        let mut fb = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), t.poll(&mut fb))
            .await
            .expect("an answer within 30 s")
            .expect("poll");
        for f in fb {
            match f {
                Feedback::Acked(id) => assert!(acked.insert(id), "acknowledged once"),
                other => panic!("unexpected feedback {other:?}"),
            }
        }
        if t.pending_bytes() > 0 {
            t.flush().await.expect("flush");
        }
    }
    // Kafka's own consumer reads them all back: key, header and value, in order per device.
    let records = cluster.consume("site.telemetry", DEVICES * EACH);
    let mut next = vec![0usize; DEVICES];
    let mut read = 0;
    for (headers, key, value) in &records {
        assert!(
            headers.contains("mqtt_topic:site/telemetry"),
            "header in {headers:?}"
        );
        let d: usize = key.trim_start_matches("dev-").parse().unwrap();
        let (dev, n) = value.split_once(' ').unwrap();
        assert_eq!(dev, key, "keyed by its device");
        let n: usize = n.parse().unwrap();
        assert_eq!(n, next[d], "device {d}'s records in order");
        next[d] += 1;
        read += 1;
    }
    assert_eq!(read, DEVICES * EACH, "every record read back once");
}

#[tokio::test]
async fn with_sasl_scram_the_transport_authenticates_and_a_wrong_password_is_refused() {
    let Some(cluster) = KafkaCluster::start(Some("sluice:s3cret-pw")) else {
        return;
    };
    let sasl_bootstrap = cluster.sasl_bootstrap();
    let params = |mechanism, password: &str| KafkaParams {
        brokers: sasl_bootstrap.split(',').map(String::from).collect(),
        topic: "scram-test".into(),
        compression: Compression::Zstd,
        tls: None,
        server_name: None,
        client_id: "sluice-test-0".into(),
        request_timeout: Duration::from_secs(30),
        window: 100,
        sasl: Some(SaslParams {
            mechanism,
            username: "sluice".into(),
            password: password.into(),
        }),
    };
    for mechanism in [Mechanism::Sha256, Mechanism::Sha512] {
        let mut t = KafkaTransport::new(params(mechanism, "s3cret-pw"));
        t.connect().await.expect("authenticates and connects");
        let m = msg("dev-1", "x", 1);
        let id = t
            .encode(Unit::Message {
                msg: &m,
                resend: false,
            })
            .unwrap()
            .unwrap();
        t.flush().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut acked = false;
        while !acked {
            assert!(Instant::now() < deadline, "acknowledged within 30 s");
            let mut fb = Vec::new();
            t.poll(&mut fb).await.unwrap();
            acked = fb.contains(&Feedback::Acked(id));
            if t.pending_bytes() > 0 {
                t.flush().await.unwrap();
            }
        }
    }
    let mut wrong = KafkaTransport::new(params(Mechanism::Sha256, "not-the-password"));
    let err = wrong
        .connect()
        .await
        .err()
        .expect("a wrong password is refused");
    assert!(
        err.to_string().contains("SASL authentication"),
        "the error says so: {err}"
    );
}

#[tokio::test]
async fn over_tls_the_brokers_are_verified_and_an_untrusted_one_is_refused() {
    let pki = sluice_testkit::TestPki::generate();
    let Some(cluster) =
        KafkaCluster::start_with(None, Some((pki.server_cert_path(), pki.server_key_path())))
    else {
        return;
    };
    let params = |tls| KafkaParams {
        brokers: cluster
            .tls_bootstrap()
            .split(',')
            .map(String::from)
            .collect(),
        topic: "tls-test".into(),
        compression: Compression::Lz4,
        tls: Some(tls),
        server_name: None,
        client_id: "sluice-test-0".into(),
        request_timeout: Duration::from_secs(30),
        window: 100,
        sasl: None,
    };
    let mut t = KafkaTransport::new(params(pki.rustls_client_config(false)));
    t.connect()
        .await
        .expect("TLS to the brokers, verified against the CA");
    let m = msg("dev-1", "x", 1);
    let id = t
        .encode(Unit::Message {
            msg: &m,
            resend: false,
        })
        .unwrap()
        .unwrap();
    t.flush().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut acked = false;
    while !acked {
        assert!(Instant::now() < deadline, "acknowledged within 30 s");
        let mut fb = Vec::new();
        t.poll(&mut fb).await.unwrap();
        acked = fb.contains(&Feedback::Acked(id));
        if t.pending_bytes() > 0 {
            t.flush().await.unwrap();
        }
    }
    // Another CA: the brokers' certificates are not trusted.
    let other = sluice_testkit::TestPki::generate();
    let mut wrong = KafkaTransport::new(params(other.rustls_client_config(false)));
    let err = wrong
        .connect()
        .await
        .err()
        .expect("an untrusted broker is refused");
    assert!(err.to_string().contains("TLS"), "the error says so: {err}");
}
