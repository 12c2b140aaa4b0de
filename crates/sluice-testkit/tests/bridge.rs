//! The bridge configuration the benchmark uses as its baseline works: an edge Mosquitto
//! configured with `Mosquitto::bridge_config_lines` forwards device publishes to a cloud
//! Mosquitto over TLS 1.3 (client certificate required), QoS 1, byte-for-byte.

use std::time::Duration;

use bytes::Bytes;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "current_thread")]
async fn edge_bridge_forwards_qos1_publishes_to_the_cloud_over_tls13() {
    let pki = TestPki::generate();
    let cloud = Mosquitto::builder()
        .tls(&pki)
        .require_client_cert(true)
        .plain_listener(false)
        .start()
        .expect("cloud starts");
    let edge = Mosquitto::builder()
        .config_lines(Mosquitto::bridge_config_lines(cloud.tls_port(), &pki))
        .start()
        .expect("edge starts with the bridge config");

    let cloud_opts =
        ConnectOpts::v5("cloud-app").with_tls(pki.rustls_client_config(true), "localhost");
    let (mut cloud_app, connack) = TestClient::connect(cloud.tls_addr(), cloud_opts)
        .await
        .expect("cloud app connects");
    assert_eq!(connack.code, 0);
    cloud_app
        .subscribe(&[("plant/#", QoS::AtLeastOnce)])
        .await
        .expect("suback");

    // The bridge's remote client id shows up on the cloud once its TLS 1.3 session is up.
    cloud
        .wait_for_log_async("as sluice-edge-bridge", WAIT)
        .await
        .expect("bridge connected to the cloud");

    let (mut device, connack) = TestClient::connect(
        edge.plain_addr(),
        ConnectOpts::new(ProtocolVersion::V311, "device-7"),
    )
    .await
    .expect("device connects to the edge");
    assert_eq!(connack.code, 0);
    let payload = Bytes::from((0..=255u8).rev().collect::<Vec<u8>>());
    for i in 0..10u8 {
        let topic = format!("plant/line-{i}/temp");
        let code = device
            .publish(&topic, payload.clone(), QoS::AtLeastOnce, false)
            .await
            .expect("edge PUBACK");
        assert_eq!(code, 0);
    }

    for i in 0..10u8 {
        let message = cloud_app
            .recv(WAIT)
            .await
            .expect("cloud connection healthy")
            .unwrap_or_else(|| panic!("message {i} forwarded; edge log:\n{}", edge.log_tail(20)));
        assert_eq!(
            &message.topic[..],
            format!("plant/line-{i}/temp"),
            "order preserved"
        );
        assert_eq!(message.payload, payload, "payload forwarded byte-for-byte");
        assert_eq!(message.qos, QoS::AtLeastOnce, "bridge forwards at QoS 1");
    }
}
