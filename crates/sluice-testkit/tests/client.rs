//! `TestClient` against a real Mosquitto: what a test author relies on — messages arrive
//! byte-for-byte over TLS 1.3 in both protocol versions, every QoS flow completes, nothing that
//! arrives while waiting for an ack is lost, and malformed input is observable as a close.

use std::time::Duration;

use bytes::Bytes;
use sluice_proto::mqtt::{Packet, ProtocolVersion, QoS, Will};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};

const WAIT: Duration = Duration::from_secs(5);
/// How long to watch for a message that must not arrive.
const QUIET: Duration = Duration::from_millis(300);

/// Every byte value, twice, plus a multi-byte UTF-8 sequence that is not valid on its own.
fn binary_payload() -> Bytes {
    let mut payload: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
    payload.extend_from_slice(&[0xE2, 0x82]);
    Bytes::from(payload)
}

async fn connect(addr: std::net::SocketAddr, opts: ConnectOpts) -> TestClient {
    let id = opts.client_id.clone();
    let (client, connack) = TestClient::connect(addr, opts)
        .await
        .unwrap_or_else(|e| panic!("{id} connects: {e:#}"));
    assert_eq!(connack.code, 0, "{id} accepted");
    client
}

async fn qos1_over_tls_arrives_byte_for_byte(version: ProtocolVersion) {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .plain_listener(false)
        .start()
        .expect("mosquitto starts");
    let tls = || pki.rustls_client_config(false);
    let mut subscriber = connect(
        broker.tls_addr(),
        ConnectOpts::new(version, "sub").with_tls(tls(), "localhost"),
    )
    .await;
    let mut publisher = connect(
        broker.tls_addr(),
        ConnectOpts::new(version, "pub").with_tls(tls(), "localhost"),
    )
    .await;
    assert_eq!(
        subscriber
            .subscribe(&[("sensors/+/temp", QoS::AtLeastOnce)])
            .await
            .expect("suback"),
        vec![1]
    );

    let payload = binary_payload();
    let code = publisher
        .publish(
            "sensors/dev-1/temp",
            payload.clone(),
            QoS::AtLeastOnce,
            false,
        )
        .await
        .expect("PUBACK");
    assert_eq!(code, 0, "broker accepted the publish");

    let message = subscriber
        .recv(WAIT)
        .await
        .expect("connection healthy")
        .expect("message arrives");
    assert_eq!(&message.topic[..], "sensors/dev-1/temp");
    assert_eq!(message.payload, payload, "payload arrives byte-for-byte");
    assert_eq!(message.qos, QoS::AtLeastOnce);
    assert!(!message.retain);
    assert_eq!(
        subscriber.recv(QUIET).await.expect("healthy"),
        None,
        "delivered once"
    );
    publisher.disconnect().await.expect("disconnect");
    subscriber.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "current_thread")]
async fn qos1_publish_over_tls13_arrives_byte_for_byte_with_mqtt_3_1_1() {
    qos1_over_tls_arrives_byte_for_byte(ProtocolVersion::V311).await;
}

#[tokio::test(flavor = "current_thread")]
async fn qos1_publish_over_tls13_arrives_byte_for_byte_with_mqtt_5() {
    qos1_over_tls_arrives_byte_for_byte(ProtocolVersion::V5).await;
}

#[tokio::test(flavor = "current_thread")]
async fn qos2_publish_completes_and_is_delivered_exactly_once() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let mut subscriber = connect(broker.plain_addr(), ConnectOpts::new(version, "sub2")).await;
        let mut publisher = connect(broker.plain_addr(), ConnectOpts::new(version, "pub2")).await;
        assert_eq!(
            subscriber
                .subscribe(&[("q2", QoS::ExactlyOnce)])
                .await
                .expect("suback"),
            vec![2]
        );
        let code = publisher
            .publish("q2", &b"exactly once"[..], QoS::ExactlyOnce, false)
            .await
            .expect("PUBCOMP");
        assert_eq!(code, 0);
        let message = subscriber
            .recv(WAIT)
            .await
            .expect("healthy")
            .expect("message arrives");
        assert_eq!(message.qos, QoS::ExactlyOnce);
        assert_eq!(&message.payload[..], b"exactly once");
        assert_eq!(
            subscriber.recv(QUIET).await.expect("healthy"),
            None,
            "{version:?}: delivered once"
        );
        // The subscriber completed PUBREC/PUBREL/PUBCOMP: the session is still usable.
        subscriber
            .ping()
            .await
            .expect("PINGRESP after the QoS 2 flow");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn publishes_arriving_while_waiting_for_acks_are_kept_in_order_for_recv() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let mut client = connect(broker.plain_addr(), ConnectOpts::v5("echo")).await;
    client
        .subscribe(&[("loop/#", QoS::AtLeastOnce)])
        .await
        .expect("suback");
    for i in 0..20u32 {
        // Mosquitto sends the copy for our own subscription around the PUBACK.
        let code = client
            .publish(
                &format!("loop/{i}"),
                i.to_be_bytes().to_vec(),
                QoS::AtLeastOnce,
                false,
            )
            .await;
        assert_eq!(code.expect("PUBACK"), 0);
    }
    for i in 0..20u32 {
        let message = client
            .recv(WAIT)
            .await
            .expect("healthy")
            .unwrap_or_else(|| panic!("message {i} kept"));
        assert_eq!(&message.topic[..], format!("loop/{i}"));
        assert_eq!(&message.payload[..], &i.to_be_bytes());
    }
    assert_eq!(client.recv(QUIET).await.expect("healthy"), None);
}

#[tokio::test(flavor = "current_thread")]
async fn pipelined_publishes_are_all_acked_and_delivered() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let mut subscriber = connect(broker.plain_addr(), ConnectOpts::v311("sink")).await;
    let mut publisher = connect(broker.plain_addr(), ConnectOpts::v311("firehose")).await;
    subscriber
        .subscribe(&[("fire", QoS::AtLeastOnce)])
        .await
        .expect("suback");
    let mut ids = Vec::new();
    for i in 0..500u32 {
        let id = publisher
            .publish_no_wait("fire", i.to_be_bytes().to_vec(), QoS::AtLeastOnce, false)
            .await;
        ids.push(id.expect("sent").expect("QoS 1 has a packet id"));
    }
    for id in ids {
        assert_eq!(publisher.wait_ack(id).await.expect("PUBACK"), 0);
    }
    for i in 0..500u32 {
        let message = subscriber
            .recv(WAIT)
            .await
            .expect("healthy")
            .unwrap_or_else(|| panic!("message {i}"));
        assert_eq!(&message.payload[..], &i.to_be_bytes(), "in publish order");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn one_mebibyte_payload_round_trips_over_tls() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    let opts =
        |id: &str| ConnectOpts::v5(id).with_tls(pki.rustls_client_config(false), "localhost");
    let mut subscriber = connect(broker.tls_addr(), opts("big-sub")).await;
    let mut publisher = connect(broker.tls_addr(), opts("big-pub")).await;
    subscriber
        .subscribe(&[("big", QoS::AtMostOnce)])
        .await
        .expect("suback");
    let payload: Bytes = (0..1024 * 1024)
        .map(|i: u32| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    assert_eq!(
        publisher
            .publish("big", payload.clone(), QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK"),
        0
    );
    let message = subscriber
        .recv(WAIT)
        .await
        .expect("healthy")
        .expect("arrives");
    assert_eq!(
        message.qos,
        QoS::AtMostOnce,
        "downgraded to the subscription's QoS"
    );
    assert!(message.payload == payload, "1 MiB payload intact");
}

#[tokio::test(flavor = "current_thread")]
async fn retained_message_reaches_a_later_subscriber_and_unsubscribe_stops_delivery() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let mut publisher = connect(broker.plain_addr(), ConnectOpts::v311("retainer")).await;
    publisher
        .publish("state/door", &b"open"[..], QoS::AtLeastOnce, true)
        .await
        .expect("PUBACK");

    let mut late = connect(broker.plain_addr(), ConnectOpts::v5("late")).await;
    late.subscribe(&[("state/#", QoS::AtLeastOnce)])
        .await
        .expect("suback");
    let retained = late
        .recv(WAIT)
        .await
        .expect("healthy")
        .expect("retained message");
    assert!(retained.retain);
    assert_eq!(&retained.payload[..], b"open");

    assert_eq!(
        late.unsubscribe(&["state/#"]).await.expect("unsuback"),
        vec![0],
        "MQTT 5 reason: success"
    );
    publisher
        .publish("state/door", &b"closed"[..], QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK");
    assert_eq!(
        late.recv(QUIET).await.expect("healthy"),
        None,
        "no delivery after unsubscribe"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn will_is_published_when_a_client_vanishes_without_disconnect() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let mut watcher = connect(broker.plain_addr(), ConnectOpts::v311("watcher")).await;
    watcher
        .subscribe(&[("wills/#", QoS::AtLeastOnce)])
        .await
        .expect("suback");
    let mut opts = ConnectOpts::v311("doomed");
    opts.will = Some(Will {
        topic: "wills/doomed".into(),
        payload: Bytes::from_static(b"gone"),
        qos: QoS::AtLeastOnce,
        retain: false,
        properties: Default::default(),
    });
    let doomed = connect(broker.plain_addr(), opts).await;
    drop(doomed);
    let will = watcher
        .recv(WAIT)
        .await
        .expect("healthy")
        .expect("will published");
    assert_eq!(&will.topic[..], "wills/doomed");
    assert_eq!(&will.payload[..], b"gone");
}

#[tokio::test(flavor = "current_thread")]
async fn broker_requiring_client_certificates_accepts_the_test_client_and_refuses_anonymous() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .require_client_cert(true)
        .start()
        .expect("mosquitto starts");
    let with_cert =
        ConnectOpts::v311("with-cert").with_tls(pki.rustls_client_config(true), "localhost");
    connect(broker.tls_addr(), with_cert).await;

    let without =
        ConnectOpts::v311("without-cert").with_tls(pki.rustls_client_config(false), "127.0.0.1");
    let err = TestClient::connect(broker.tls_addr(), without)
        .await
        .expect_err("refused");
    // TLS 1.3: the client finishes its handshake before the server checks the certificate,
    // so the refusal shows up as an alert or close instead of a CONNACK.
    let message = format!("{err:#}");
    assert!(
        message.contains("CONNACK") || message.contains("TLS"),
        "{message}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn broker_closes_the_connection_on_a_malformed_packet() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let mut client = connect(broker.plain_addr(), ConnectOpts::v311("garbage")).await;
    // PUBLISH whose remaining length has five continuation bytes (at most four are allowed).
    client
        .send_raw(&[0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F])
        .await
        .expect("sent");
    let (bytes, closed) = client.read_raw_until_closed(WAIT).await;
    assert!(closed, "broker hung up");
    assert!(
        bytes.is_empty(),
        "3.1.1 has no DISCONNECT from the server, got {bytes:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn broker_answers_an_unsupported_protocol_level_with_a_refusing_connack() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let mut client = TestClient::open(broker.plain_addr(), &ConnectOpts::v311("raw"))
        .await
        .expect("tcp");
    // CONNECT, protocol name "MQTT", level 9, clean session, keep-alive 60, client id "x".
    let connect = [
        0x10, 13, 0, 4, b'M', b'Q', b'T', b'T', 9, 0x02, 0, 60, 0, 1, b'x',
    ];
    client.send_raw(&connect).await.expect("sent");
    match client.recv_packet(WAIT).await {
        Ok(Some(Packet::ConnAck(connack))) => {
            assert_eq!(connack.code, 0x01, "unacceptable protocol version")
        }
        other => panic!("expected a CONNACK refusal, got {other:?}"),
    }
    assert!(
        client.expect_closed(WAIT).await,
        "broker hung up after refusing"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn connected_client_sees_a_killed_broker_and_reconnects_after_restart() {
    let pki = TestPki::generate();
    let mut broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    let opts =
        || ConnectOpts::v5("survivor").with_tls(pki.rustls_client_config(false), "localhost");
    let mut client = connect(broker.tls_addr(), opts()).await;

    broker.kill().expect("kill");
    assert!(
        client.expect_closed(WAIT).await,
        "client notices the broker is gone"
    );
    let err = TestClient::connect(broker.tls_addr(), opts())
        .await
        .expect_err("nobody listens");
    assert!(format!("{err:#}").contains("TCP connect"), "{err:#}");

    broker.restart().expect("restart");
    let mut client = connect(broker.tls_addr(), opts()).await;
    client.ping().await.expect("new session works");
}
