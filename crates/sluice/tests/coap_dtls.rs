//! CoAP over DTLS 1.2 (`coaps://`, `[coap.dtls]`) end to end: libcoap's `coap-client-openssl`
//! as the device (PSK and certificate modes), a real cloud Mosquitto over TLS, and raw
//! datagrams for what a spoofing sender does. The device id a DTLS device publishes under is
//! its authenticated identity, visible at the cloud through the uplink's `topic_template`.

#[path = "coap_support/mod.rs"]
mod coap_support;
mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use coap_support::*;
use common::*;
use sluice::app::RunningGateway;
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::TestClient;

const WAIT: Duration = Duration::from_secs(10);

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// A gateway with `[coap]` and `[coap.dtls]` (with `dtls` lines) on loopback, its uplink
/// publishing `dev/{device}/{topic}` to `cloud`.
fn dtls_gateway(cloud: &Cloud, shards: usize, dtls: &str) -> (RunningGateway, SocketAddr) {
    let extra = format!(
        "[coap]\nlisten = \"127.0.0.1:0\"\n[coap.dtls]\nlisten = \"127.0.0.1:0\"\n{dtls}\n{}",
        cloud.uplink_toml(
            None,
            "topic_template = \"dev/{device}/{topic}\"\n[uplink.aggregate]\nenabled = false"
        )
    );
    let gw = gateway_sections(&format!("shards = {shards}"), "", &extra);
    let addr = gw.coap_dtls_addr.expect("[coap.dtls] listening");
    (gw, addr)
}

fn psk_file(dir: &Path, lines: &[(&str, &str)]) -> String {
    let path = dir.join("coap-psk.txt");
    let mut text = String::from("# identity:hex-key\n");
    for (id, key) in lines {
        text.push_str(&format!("{id}:{}\n", hex(key)));
    }
    std::fs::write(&path, text).expect("write psk file");
    format!("psk_file = \"{}\"", path.display())
}

/// `coap-client-openssl` with `args` (`-v 7`: message dumps, for `libcoap_codes`).
async fn coaps_client(args: &[&str]) -> Output {
    let mut all: Vec<String> = vec!["-v".into(), "7".into(), "-B".into(), "8".into()];
    all.extend(args.iter().map(|s| s.to_string()));
    run(
        peer("coap-client-openssl", "libcoap3-bin"),
        all,
        Duration::from_secs(40),
    )
    .await
}

/// Sum of the samples of `name` carrying `label` (e.g. `transport="dtls"`).
fn labeled(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn cloud_quiet(sub: &mut TestClient, quiet: Duration) {
    if let Some(p) = sub.recv(quiet).await.expect("cloud subscriber") {
        panic!(
            "unexpected publish at the cloud: {} {:?}",
            p.topic, p.payload
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_psk_device_publishes_over_dtls_under_its_psk_identity_not_its_query() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dev/#").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("sensor-7", "secret-key-7"), ("other", "k2")]);
    let (gw, addr) = dtls_gateway(&cloud, 2, &psk);

    let out = coaps_client(&[
        "-k",
        "secret-key-7",
        "-u",
        "sensor-7",
        "-m",
        "put",
        "-e",
        "21.5C",
        &format!("coaps://{addr}/ps/room/temp?c=spoofed"),
    ])
    .await;
    assert_eq!(out.libcoap_codes(), vec!["2.04"], "{}", out.text());
    let p = sub
        .recv(WAIT)
        .await
        .expect("cloud")
        .expect("the cloud got the DTLS device's publish");
    assert_eq!(
        &*p.topic, "dev/sensor-7/room/temp",
        "device id = PSK identity"
    );
    assert_eq!(&p.payload[..], b"21.5C");
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_coap_dtls_handshakes_total"),
        1.0,
        "{m}"
    );
    assert_eq!(
        labeled(&m, "sluice_coap_publishes_total", "transport=\"dtls\""),
        1.0
    );
    assert_eq!(
        labeled(&m, "sluice_coap_publishes_total", "") - 1.0,
        0.0,
        "nothing went through the plain edge"
    );
    let status = gw.status_json();
    assert_eq!(status["coap"]["dtls"]["listen"], addr.to_string());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_psk_key_or_unknown_identity_is_refused_and_counted_and_nothing_is_delivered() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dev/#").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("sensor-7", "secret-key-7")]);
    let (gw, addr) = dtls_gateway(&cloud, 1, &format!("{psk}\nhandshake_timeout = \"2s\""));
    let uri = format!("coaps://{addr}/ps/room/temp");

    // A wrong key: DTLS drops the device's Finished it cannot authenticate; the handshake
    // never completes and is given up after handshake_timeout.
    let wrong = coaps_client(&[
        "-B",
        "4",
        "-k",
        "not-the-key",
        "-u",
        "sensor-7",
        "-m",
        "put",
        "-e",
        "x",
        &uri,
    ])
    .await;
    assert!(wrong.libcoap_codes().is_empty(), "{}", wrong.text());
    wait_until("the wrong-key handshake counted as failed", WAIT, || {
        metric_sum(
            &gw.metrics_text(),
            "sluice_coap_dtls_handshake_failures_total",
        ) >= 1.0
    })
    .await;

    // An identity the PSK file does not have: refused during the handshake.
    let unknown = coaps_client(&[
        "-B",
        "4",
        "-k",
        "secret-key-7",
        "-u",
        "intruder",
        "-m",
        "put",
        "-e",
        "y",
        &uri,
    ])
    .await;
    assert!(unknown.libcoap_codes().is_empty(), "{}", unknown.text());
    wait_until("the unknown identity counted as failed", WAIT, || {
        metric_sum(
            &gw.metrics_text(),
            "sluice_coap_dtls_handshake_failures_total",
        ) >= 2.0
    })
    .await;
    cloud_quiet(&mut sub, Duration::from_secs(1)).await;
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_coap_dtls_handshakes_total"),
        0.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "sluice_coap_publishes_total"), 0.0);
    wait_until("no session left", WAIT, || {
        metric_sum(&gw.metrics_text(), "sluice_coap_dtls_sessions{") == 0.0
    })
    .await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observe_over_dtls_gets_notified_of_an_mqtt_publish() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("watcher-1", "watch-key")]);
    let (gw, addr) = dtls_gateway(&cloud, 2, &psk);
    let observer = Peer::spawn(
        peer("coap-client-openssl", "libcoap3-bin"),
        &[
            "-s".into(),
            "20".into(),
            "-k".into(),
            "watch-key".into(),
            "-u".into(),
            "watcher-1".into(),
            "-m".into(),
            "get".into(),
            format!("coaps://{addr}/ps/obs/%23"),
        ],
    );
    let mut dev = device(&gw, "mqtt-sensor", ProtocolVersion::V5).await;
    let mut n = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !observer.stdout_text().contains("<note-") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no notification over DTLS; observer stdout {:?} stderr {}",
            observer.stdout_text(),
            observer.stderr_text()
        );
        n += 1;
        dev.publish(
            "obs/room",
            Bytes::from(format!("<note-{n}>")),
            QoS::AtMostOnce,
            false,
        )
        .await
        .expect("MQTT publish");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = gw.metrics_text();
    assert!(
        metric_sum(&m, "sluice_coap_notifications_total") >= 1.0,
        "{m}"
    );
    assert!(
        labeled(&m, "sluice_coap_datagrams_sent_total", "transport=\"dtls\"") >= 2.0,
        "the response and the notification left through the DTLS session: {m}"
    );
    assert_eq!(
        labeled(&m, "sluice_coap_datagrams_sent_total", "")
            - labeled(&m, "sluice_coap_datagrams_sent_total", "transport=\"dtls\""),
        0.0,
        "nothing left the plain socket"
    );
    assert_eq!(metric_sum(&m, "sluice_coap_dtls_handshakes_total"), 1.0);
    drop(observer);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_device_is_named_by_its_certificate_cn() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dev/#").await;
    let pki = &cloud.pki;
    let dtls = format!(
        "cert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"",
        pki.server_cert_path().display(),
        pki.server_key_path().display(),
        pki.ca_path().display()
    );
    let (gw, addr) = dtls_gateway(&cloud, 1, &dtls);
    let uri = format!("coaps://{addr}/ps/cert/t?c=spoofed");
    let out = coaps_client(&[
        "-c",
        pki.client_cert_path().to_str().expect("utf-8"),
        "-j",
        pki.client_key_path().to_str().expect("utf-8"),
        "-C",
        pki.ca_path().to_str().expect("utf-8"),
        "-m",
        "put",
        "-e",
        "signed",
        &uri,
    ])
    .await;
    assert_eq!(out.libcoap_codes(), vec!["2.04"], "{}", out.text());
    let p = sub.recv(WAIT).await.expect("cloud").expect("published");
    assert_eq!(
        &*p.topic, "dev/sluice-test-client/cert/t",
        "device id = client CN"
    );

    // Without a client certificate: refused (client_ca_file asks for one).
    let anonymous = coaps_client(&[
        "-B",
        "4",
        "-C",
        pki.ca_path().to_str().expect("utf-8"),
        "-m",
        "put",
        "-e",
        "anon",
        &uri,
    ])
    .await;
    assert!(anonymous.libcoap_codes().is_empty(), "{}", anonymous.text());
    cloud_quiet(&mut sub, Duration::from_secs(1)).await;
    assert!(
        metric_sum(
            &gw.metrics_text(),
            "sluice_coap_dtls_handshake_failures_total"
        ) >= 1.0
    );
    gw.shutdown();
}

/// A DTLS 1.2 ClientHello datagram (no cookie unless given), as a spoofer would send.
fn client_hello(cookie: &[u8]) -> Vec<u8> {
    let mut body = vec![0xFE, 0xFD];
    body.extend_from_slice(&[0x5A; 32]);
    body.push(0);
    body.push(cookie.len() as u8);
    body.extend_from_slice(cookie);
    // Two suites (PSK-AES128-CCM8, PSK-AES128-GCM-SHA256), null compression.
    body.extend_from_slice(&[0, 4, 0xC0, 0xA8, 0x00, 0xA8, 1, 0]);
    let len = body.len();
    let mut hs = vec![1, 0, 0, len as u8, 0, 0, 0, 0, 0, 0, 0, len as u8];
    hs.extend_from_slice(&body);
    let mut d = vec![22, 0xFE, 0xFD, 0, 0, 0, 0, 0, 0, 0, 0, 0, hs.len() as u8];
    d.extend_from_slice(&hs);
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoofed_client_hello_gets_one_small_hello_verify_request_and_no_session() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("sensor-7", "secret-key-7")]);
    let (gw, addr) = dtls_gateway(&cloud, 1, &psk);
    let raw = RawDevice::new(addr).await;

    let hello = client_hello(&[]);
    raw.send(&hello).await;
    let hvr = raw.recv_raw(WAIT).await.expect("a HelloVerifyRequest");
    assert!(
        hvr.len() <= 3 * hello.len(),
        "{} bytes answered {} bytes",
        hvr.len(),
        hello.len()
    );
    assert!(hvr.len() <= hello.len(), "no amplification at all");
    assert_eq!((hvr[0], hvr[13]), (22, 3), "a HelloVerifyRequest record");
    assert!(
        raw.recv_raw(Duration::from_millis(500)).await.is_none(),
        "exactly one datagram"
    );

    // A made-up cookie: another HelloVerifyRequest, still no session.
    raw.send(&client_hello(&[0x42; 16])).await;
    assert!(raw.recv_raw(WAIT).await.is_some());
    // Not a ClientHello (application data in epoch 1): dropped, unanswered.
    let mut junk = vec![23, 0xFE, 0xFD, 0, 1, 0, 0, 0, 0, 0, 1, 0, 40];
    junk.extend_from_slice(&[0x99; 40]);
    raw.send(&junk).await;
    assert!(raw.recv_raw(Duration::from_millis(500)).await.is_none());

    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_coap_dtls_hello_verify_sent_total"),
        2.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "sluice_coap_dtls_sessions{"),
        0.0,
        "no session for a spoofer"
    );
    assert_eq!(
        labeled(
            &m,
            "sluice_coap_dtls_dropped_total",
            "reason=\"bad_cookie\""
        ),
        1.0
    );
    assert_eq!(
        labeled(
            &m,
            "sluice_coap_dtls_dropped_total",
            "reason=\"no_session\""
        ),
        1.0
    );
    assert_eq!(gw.status_json()["coap"]["dtls"]["sessions"], 0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_sessions_the_least_recently_active_session_is_closed_and_its_observer_deregistered()
{
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dev/#").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(
        dir.path(),
        &[("watcher-1", "watch-key"), ("sensor-7", "secret-key-7")],
    );
    let (gw, addr) = dtls_gateway(
        &cloud,
        1,
        &format!("{psk}\nmax_sessions = 1\nmax_handshakes = 1"),
    );
    let _observer = Peer::spawn(
        peer("coap-client-openssl", "libcoap3-bin"),
        &[
            "-s".into(),
            "30".into(),
            "-k".into(),
            "watch-key".into(),
            "-u".into(),
            "watcher-1".into(),
            "-m".into(),
            "get".into(),
            format!("coaps://{addr}/ps/obs/%23"),
        ],
    );
    wait_until("the DTLS observer registered", WAIT, || {
        metric_sum(&gw.metrics_text(), "sluice_coap_observers{") == 1.0
    })
    .await;

    // A second device needs the only session slot: the idle observer's session goes.
    let out = coaps_client(&[
        "-k",
        "secret-key-7",
        "-u",
        "sensor-7",
        "-m",
        "put",
        "-e",
        "x",
        &format!("coaps://{addr}/ps/t"),
    ])
    .await;
    assert_eq!(out.libcoap_codes(), vec!["2.04"], "{}", out.text());
    let p = sub.recv(WAIT).await.expect("cloud").expect("published");
    assert_eq!(&*p.topic, "dev/sensor-7/t");
    let m = gw.metrics_text();
    assert_eq!(
        labeled(
            &m,
            "sluice_coap_dtls_sessions_ended_total",
            "reason=\"evicted\""
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "sluice_coap_observers{"),
        0.0,
        "the evicted peer's observer is deregistered"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_handshaking_again_from_the_same_address_replaces_its_session() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dev/#").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("sensor-7", "secret-key-7")]);
    let (gw, addr) = dtls_gateway(&cloud, 1, &psk);
    let port = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("free port");
        s.local_addr().expect("addr").port().to_string()
    };
    // The device observes, then dies without a close_notify (killed) ...
    let first = Peer::spawn(
        peer("coap-client-openssl", "libcoap3-bin"),
        &[
            "-p".into(),
            port.clone(),
            "-s".into(),
            "30".into(),
            "-k".into(),
            "secret-key-7".into(),
            "-u".into(),
            "sensor-7".into(),
            "-m".into(),
            "get".into(),
            format!("coaps://{addr}/ps/obs/%23"),
        ],
    );
    wait_until("the first run observes", WAIT, || {
        metric_sum(&gw.metrics_text(), "sluice_coap_observers{") == 1.0
    })
    .await;
    drop(first);
    // ... and comes back from the same address: a new handshake replaces the old session.
    let out = coaps_client(&[
        "-p",
        &port,
        "-k",
        "secret-key-7",
        "-u",
        "sensor-7",
        "-m",
        "put",
        "-e",
        "back",
        &format!("coaps://{addr}/ps/boot"),
    ])
    .await;
    assert_eq!(out.libcoap_codes(), vec!["2.04"], "{}", out.text());
    let p = sub.recv(WAIT).await.expect("cloud").expect("published");
    assert_eq!(&p.payload[..], b"back");
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_coap_dtls_handshakes_total"),
        2.0,
        "{m}"
    );
    assert_eq!(
        labeled(
            &m,
            "sluice_coap_dtls_sessions_ended_total",
            "reason=\"replaced\""
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "sluice_coap_observers{"),
        0.0,
        "the old session's observer ended"
    );
    gw.shutdown();
}

/// Issue 28 item 6 for CoAP over DTLS: a device's `[limits]` publish rate follows its PSK
/// identity whatever address or session it comes from (each `coap-client-openssl` run is a
/// new session from a new port). Over the rate its CON publish is answered 5.03 with Max-Age
/// and not delivered; another identity is not held back; the refusals are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dtls_identity_over_its_publish_rate_gets_5_03_from_any_session_and_others_do_not() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dev/#").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(
        dir.path(),
        &[("fast-1", "key-fast"), ("calm-2", "key-calm")],
    );
    let extra = format!(
        "[coap]\nlisten = \"127.0.0.1:0\"\n[coap.dtls]\nlisten = \"127.0.0.1:0\"\n{psk}\n\
         [limits]\npublish_rate = 1\npublish_burst = 1\n{}",
        cloud.uplink_toml(
            None,
            "topic_template = \"dev/{device}/{topic}\"\n[uplink.aggregate]\nenabled = false"
        )
    );
    let gw = gateway_sections("shards = 2", "", &extra);
    let addr = gw.coap_dtls_addr.expect("[coap.dtls] listening");
    let uri = format!("coaps://{addr}/ps/room/temp");
    let runs = (0..6).map(|i| {
        let uri = uri.clone();
        async move {
            let payload = format!("fast-{i}");
            let out = coaps_client(&[
                "-k", "key-fast", "-u", "fast-1", "-m", "put", "-e", &payload, &uri,
            ])
            .await;
            out.libcoap_codes()
        }
    });
    let all = futures_util::future::join_all(runs).await;
    let ok = all
        .iter()
        .filter(|c| c.contains(&"2.04".to_string()))
        .count();
    let held = all
        .iter()
        .filter(|c| c.contains(&"5.03".to_string()))
        .count();
    assert!(
        held >= 1,
        "six sessions of one identity within seconds share its bucket: {all:?}"
    );
    assert_eq!(ok + held, 6, "{all:?}");
    let calm = coaps_client(&[
        "-k", "key-calm", "-u", "calm-2", "-m", "put", "-e", "calm", &uri,
    ])
    .await;
    assert_eq!(calm.libcoap_codes(), vec!["2.04"], "{}", calm.text());
    let mut got = Vec::new();
    while let Some(p) = sub.recv(Duration::from_secs(2)).await.expect("cloud") {
        got.push((
            p.topic.to_string(),
            String::from_utf8_lossy(&p.payload).into_owned(),
        ));
    }
    assert_eq!(
        got.iter()
            .filter(|(t, _)| t == "dev/fast-1/room/temp")
            .count(),
        ok,
        "{got:?}"
    );
    assert!(
        got.contains(&("dev/calm-2/room/temp".into(), "calm".into())),
        "{got:?}"
    );
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_limits_publish_throttled_total"),
        held as f64,
        "{m}"
    );
    gw.shutdown();
}

/// `coap-client-openssl` observing `uri` for `secs` as PSK `identity`, left running.
fn dtls_observer(identity: &str, key: &str, uri: &str, secs: u32) -> Peer {
    Peer::spawn(
        peer("coap-client-openssl", "libcoap3-bin"),
        &[
            "-v".into(),
            "7".into(),
            "-s".into(),
            secs.to_string(),
            "-k".into(),
            key.into(),
            "-u".into(),
            identity.into(),
            "-m".into(),
            "get".into(),
            uri.into(),
        ],
    )
}

/// Issue 28 item 6 for CoAP observers: a DTLS device holds at most
/// `mqtt.max_subscriptions_per_session` observers (as an MQTT session holds that many
/// subscriptions) whatever session or port they come from; one more is answered 5.03
/// (counted); another device is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dtls_device_holds_at_most_its_subscription_quota_of_observers() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("w-1", "key-1"), ("w-2", "key-2")]);
    let extra = format!(
        "[coap]\nlisten = \"127.0.0.1:0\"\n[coap.dtls]\nlisten = \"127.0.0.1:0\"\n{psk}\n{}",
        cloud.uplink_toml(None, "[uplink.aggregate]\nenabled = false")
    );
    let gw = gateway_sections("shards = 1", "max_subscriptions_per_session = 2", &extra);
    let addr = gw.coap_dtls_addr.expect("[coap.dtls] listening");
    let observers = |gw: &RunningGateway| metric_sum(&gw.metrics_text(), "sluice_coap_observers{");
    let _a = dtls_observer("w-1", "key-1", &format!("coaps://{addr}/ps/a"), 30);
    let _b = dtls_observer("w-1", "key-1", &format!("coaps://{addr}/ps/b/%23"), 30);
    wait_until("two observers of w-1", WAIT, || observers(&gw) == 2.0).await;
    let third = coaps_client(&[
        "-s",
        "3",
        "-k",
        "key-1",
        "-u",
        "w-1",
        "-m",
        "get",
        &format!("coaps://{addr}/ps/c"),
    ])
    .await;
    assert!(
        third.libcoap_codes().contains(&"5.03".to_string()),
        "a third observer of w-1 is refused: {}",
        third.text()
    );
    let _other = dtls_observer("w-2", "key-2", &format!("coaps://{addr}/ps/c"), 30);
    wait_until("w-2 observes", WAIT, || observers(&gw) == 3.0).await;
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_coap_observe_refused_per_device_total"),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "sluice_coap_observe_refused_per_source_total"),
        0.0,
        "{m}"
    );
    gw.shutdown();
}

/// A DTLS observer proved its address in its handshake: its very first notification may be
/// larger than a datagram, and reaches it block-wise (libcoap fetches the later blocks in the
/// same session), nothing in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dtls_observer_gets_a_large_first_notification_block_wise() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let psk = psk_file(dir.path(), &[("cam-1", "cam-key")]);
    let (gw, addr) = dtls_gateway(&cloud, 2, &psk);
    // No message dumps: libcoap logs on stdout, between the parts of the body it prints.
    let observer = Peer::spawn(
        peer("coap-client-openssl", "libcoap3-bin"),
        &[
            "-s".into(),
            "20".into(),
            "-k".into(),
            "cam-key".into(),
            "-u".into(),
            "cam-1".into(),
            "-m".into(),
            "get".into(),
            format!("coaps://{addr}/ps/cam/image"),
        ],
    );
    wait_until("observing", WAIT, || {
        metric_sum(&gw.metrics_text(), "sluice_coap_observers{") == 1.0
    })
    .await;
    let big: String = (0..500).map(|i| format!("px-{i:06}|")).collect();
    let mut dev = device(&gw, "mqtt-cam", ProtocolVersion::V5).await;
    dev.publish(
        "cam/image",
        Bytes::from(big.clone()),
        QoS::AtLeastOnce,
        false,
    )
    .await
    .expect("MQTT publish");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !observer.stdout_text().contains(&big) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the whole {} B body over DTLS; stdout {:?} metrics {}",
            big.len(),
            observer.stdout_text(),
            gw.metrics_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_coap_notifications_blockwise_total"),
        1.0,
        "{m}"
    );
    assert_eq!(
        labeled(&m, "sluice_coap_datagrams_sent_total", "")
            - labeled(&m, "sluice_coap_datagrams_sent_total", "transport=\"dtls\""),
        0.0,
        "nothing left the plain socket"
    );
    drop(observer);
    gw.shutdown();
}
