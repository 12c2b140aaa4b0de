//! The uplink's failures: TLS configuration errors name the file, keep-alive detects a frozen
//! broker, messages over the broker's maximum packet size, refused CONNECTs retried.

use super::*;

#[test]
fn tls_config_errors_name_the_offending_file() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let url = UplinkUrl {
        tls: true,
        host: "127.0.0.1".into(),
        port: 8883,
    };
    let base = {
        let mut c = UplinkConfig::new("cloud", url);
        c.ca_file = Some(pki.ca_path().to_path_buf());
        c
    };
    assert!(uplink::client_tls_config(&base).is_ok());

    let missing = dir.path().join("missing-ca.pem");
    let mut c = base.clone();
    c.ca_file = Some(missing.clone());
    let e = uplink::client_tls_config(&c).unwrap_err();
    assert!(matches!(e, UplinkError::ReadFile { what: "ca", .. }), "{e}");
    assert!(e.to_string().contains("missing-ca.pem"), "{e}");

    let not_pem: PathBuf = dir.path().join("not-a-cert.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    c.ca_file = Some(not_pem);
    let e = uplink::client_tls_config(&c).unwrap_err();
    assert!(
        e.to_string().contains("not-a-cert.pem") && e.to_string().contains("no PEM certificate"),
        "{e}"
    );

    let mut c = base.clone();
    c.cert_file = Some(pki.client_cert_path().to_path_buf());
    let e = uplink::client_tls_config(&c).unwrap_err();
    assert!(matches!(e, UplinkError::HalfClientIdentity { .. }), "{e}");

    c.key_file = Some(pki.client_cert_path().to_path_buf()); // a certificate, not a key
    let e = uplink::client_tls_config(&c).unwrap_err();
    assert!(
        matches!(e, UplinkError::NoPrivateKey { .. }) && e.to_string().contains("client.pem"),
        "{e}"
    );

    c.key_file = Some(pki.client_key_path().to_path_buf());
    assert!(
        uplink::client_tls_config(&c).is_ok(),
        "PKCS#8 client key accepted"
    );
}

/// Mosquitto drops a client that sends nothing for 1.5 × keep-alive, so staying connected while
/// idle proves the PINGREQs; a frozen (SIGSTOP) broker answers nothing, so the uplink must give
/// up on it after 1.5 × keep-alive and reconnect once it runs again.
#[test]
fn idle_session_pings_and_a_frozen_broker_is_detected_by_keep_alive() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut cfg = cloud_config(&pki, &broker, MqttProtocol::V5);
        cfg.keep_alive = Duration::from_secs(1);
        cfg.connect_timeout = Duration::from_secs(2);
        let up = start_uplink(cfg, 64 * 1024);
        wait_until("connected", Duration::from_secs(5), || {
            up.metrics.state() == "connected"
        })
        .await;
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert_eq!(
            up.metrics.state(),
            "connected",
            "idle for 3.5 × keep-alive and still connected"
        );
        assert_eq!(up.metrics.connects.get(), 1);

        signal(&broker, "-STOP");
        let frozen_at = Instant::now();
        wait_until(
            "the dead connection to be noticed",
            Duration::from_secs(4),
            || up.metrics.state() != "connected",
        )
        .await;
        let noticed_after = frozen_at.elapsed();
        signal(&broker, "-CONT");
        wait_until("a new connection", Duration::from_secs(10), || {
            up.metrics.connects.get() == 2
        })
        .await;
        println!("frozen broker noticed after {noticed_after:?} (keep-alive 1 s)");
        assert!(
            noticed_after <= Duration::from_millis(2500),
            "{noticed_after:?}"
        );
        up.stop().await;
    });
}

/// A message the broker's Maximum Packet Size (MQTT 5 CONNACK) cannot carry would be refused
/// forever; it is dropped, counted, and its device acknowledged so the device is not stuck.
/// The messages around it are delivered.
#[test]
fn message_over_the_brokers_maximum_packet_size_is_dropped_counted_and_released() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .config_line("max_packet_size 2048")
        .start()
        .expect("mosquitto starts");
    run_local(async {
        let mut sub = subscriber(&pki, &broker, "cloud-app", "dev/#").await;
        let up = start_uplink(cloud_config(&pki, &broker, MqttProtocol::V5), 64 * 1024);
        let acks = DeviceAcks::new();
        let mut big = message(1, 0, &acks);
        big.payload = Bytes::from(vec![0xAB; 4096]);
        up.queue.push(big).await;
        up.queue.push(message(1, 1, &acks)).await;

        let got = sub
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("the small message");
        assert_eq!(got.payload, payload(1, 1));
        assert!(
            sub.recv(Duration::from_millis(300))
                .await
                .unwrap()
                .is_none(),
            "the big one never reached the cloud"
        );
        let mut acked = Vec::new();
        wait_until("both device acks", Duration::from_secs(5), || {
            acked.extend(acks.drain());
            acked.len() == 2
        })
        .await;
        assert_eq!(acked, vec![1, 2]);
        let m = &up.metrics;
        assert_eq!(m.dropped(uplink::DropReason::TooLargeForCloud), 1);
        assert_eq!(m.messages_sent.get(), 1);
        assert_eq!(m.queue_bytes.get(), 0);
        assert_eq!(
            m.state(),
            "connected",
            "the session was not broken by the oversized message"
        );
        up.stop().await;
    });
}

/// The password file is read at every connection attempt: a refused CONNECT (bad password) is
/// counted and retried, and fixing the file is enough for the next attempt to succeed.
#[test]
fn refused_connect_is_retried_and_a_corrected_password_file_is_picked_up() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("mosquitto.passwd");
    let status = std::process::Command::new("mosquitto_passwd")
        .arg("-b")
        .arg("-c")
        .arg(&users)
        .args(["gw-user", "s3cret"])
        .status()
        .expect("mosquitto_passwd (part of the mosquitto package) runs");
    assert!(status.success());
    let broker = Mosquitto::builder()
        .tls(&pki)
        .config_lines([
            "allow_anonymous false".to_string(),
            format!("password_file {}", users.display()),
        ])
        .start()
        .expect("mosquitto starts");
    let password_file = dir.path().join("uplink.password");
    std::fs::write(&password_file, "wrong\n").unwrap();
    run_local(async {
        let mut cfg = cloud_config(&pki, &broker, MqttProtocol::V311);
        cfg.username = Some("gw-user".into());
        cfg.password_file = Some(password_file.clone());
        cfg.reconnect_min = Duration::from_millis(20);
        cfg.reconnect_max = Duration::from_millis(100);
        let up = start_uplink(cfg, 64 * 1024);
        wait_until("refused attempts", Duration::from_secs(5), || {
            up.metrics.connect_failures.get() >= 3
        })
        .await;
        assert_eq!(
            up.metrics.connects.get(),
            0,
            "a bad password is never accepted"
        );

        std::fs::write(&password_file, "s3cret\n").unwrap();
        wait_until(
            "a connection with the corrected password",
            Duration::from_secs(5),
            || up.metrics.state() == "connected",
        )
        .await;
        let acks = DeviceAcks::new();
        up.queue.push(message(0, 0, &acks)).await;
        wait_until("the device ack", Duration::from_secs(5), || {
            !acks.drain().is_empty()
        })
        .await;
        println!(
            "{} refused attempts before the password was fixed",
            up.metrics.connect_failures.get()
        );
        up.stop().await;
    });
}
