//! The Kafka transport against a real three-node Apache Kafka 4.4.0 cluster in KRaft mode
//! (`scripts/kafka-cluster`): records produced with `acks = all` by the idempotent producer
//! are acknowledged, and Kafka's own console consumer reads every one, each device's in
//! order, keyed by the device and carrying the MQTT topic as a header.
//!
//! Skipped with a printed reason when Java or Maven is missing (scripts/test installs them).
//! The gateway end to end (devices → sluice → Kafka, a leader killed): `uplink_kafka.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use kafka_protocol::records::Compression;
use sluice::sink::kafka::scram::Mechanism;
use sluice::sink::kafka::{KafkaParams, KafkaTransport, SaslParams};
use sluice::sink::transport::{Feedback, Transport, Unit};
use sluice::sink::UplinkMessage;
use sluice_proto::mqtt::QoS;

use sluice_testkit::KafkaCluster;

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
        user_properties: None,
        stored: None,
    }
}

/// Produce `msgs` as an outbox would: encode in batches of 100, flush, poll for answers. When
/// the transport ends the connection (the cluster changed under it, e.g. a partition's
/// leadership settling right after the topic was created: NOT_LEADER_OR_FOLLOWER), connect
/// again and resend what is unacknowledged, in order. Returns the reconnects it took.
async fn produce_all(t: &mut KafkaTransport, msgs: &[UplinkMessage]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut acked = vec![false; msgs.len()];
    let mut reconnects = 0;
    loop {
        let pending: Vec<usize> = (0..msgs.len()).filter(|i| !acked[*i]).collect();
        if pending.is_empty() {
            return reconnects;
        }
        let mut by_id = HashMap::new();
        let mut failed = None;
        for chunk in pending.chunks(100) {
            for &i in chunk {
                let id = t
                    .encode(Unit::Message {
                        msg: &msgs[i],
                        resend: reconnects > 0,
                    })
                    .expect("encodable")
                    .expect("Kafka acknowledges every record");
                assert!(by_id.insert(id, i).is_none(), "ids are unique");
            }
            if let Err(e) = t.flush().await {
                failed = Some(e);
                break;
            }
        }
        while failed.is_none() && by_id.values().any(|&i| !acked[i]) {
            assert!(Instant::now() < deadline, "all acknowledged within 90 s");
            let mut fb = Vec::new();
            let polled = tokio::time::timeout(Duration::from_secs(30), t.poll(&mut fb))
                .await
                .expect("an answer within 30 s");
            for f in fb {
                match f {
                    Feedback::Acked(id) => acked[by_id[&id]] = true,
                    other => panic!("unexpected feedback {other:?}"),
                }
            }
            if let Err(e) = polled {
                failed = Some(e);
            } else if t.pending_bytes() > 0 {
                failed = t.flush().await.err();
            }
        }
        if let Some(e) = failed {
            reconnects += 1;
            eprintln!("the transport ended the connection ({e}); reconnecting and resending");
            assert!(reconnects <= 5, "at most 5 reconnects: {e}");
            t.abort();
            tokio::time::sleep(Duration::from_millis(200)).await;
            t.connect().await.expect("reconnects");
        }
    }
}

/// Produce one record and wait until Kafka acknowledged it.
async fn produce_one(t: &mut KafkaTransport) {
    produce_all(t, &[msg("dev-1", "x", 1)]).await;
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
    // The topic does not exist yet: the transport's Metadata request creates it.
    let reconnects = produce_all(&mut t, &msgs).await;
    // Kafka's own consumer reads them all back: key, header and value; every message, the
    // first arrivals of each device in order (a resend after a reconnect may repeat some).
    let records = cluster.consume("site.telemetry", DEVICES * EACH + 1000);
    let mut firsts: HashMap<String, Vec<usize>> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for (headers, key, value) in &records {
        assert!(
            headers.contains("mqtt_topic:site/telemetry"),
            "header in {headers:?}"
        );
        let (dev, n) = value.split_once(' ').unwrap();
        assert_eq!(dev, key, "keyed by its device");
        let n: usize = n.parse().unwrap();
        if seen.insert((key.clone(), n)) {
            firsts.entry(key.clone()).or_default().push(n);
        }
    }
    assert_eq!(seen.len(), DEVICES * EACH, "every record read back");
    for (dev, ns) in &firsts {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "{dev}'s records in order"
        );
    }
    if reconnects == 0 {
        assert_eq!(records.len(), DEVICES * EACH, "no reconnect, no repeat");
    }
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
        produce_one(&mut t).await;
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
    produce_one(&mut t).await;
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
