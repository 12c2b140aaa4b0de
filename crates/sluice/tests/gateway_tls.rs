//! MQTT over TLS, WebSocket and WebSocket over TLS, end to end with real clients: Mosquitto's
//! `mosquitto_pub`/`mosquitto_sub` (OpenSSL) and Eclipse paho (python, over TCP and
//! WebSockets), certificates generated at test time (`sluice_testkit::TestPki`). Also: a
//! client certificate from another CA refused at the handshake, `identity_from_cert` admitting
//! a device by its certificate's CN where passwords are required, refusals counted, and the
//! memory an idle TLS connection costs.

mod common;
#[path = "gateway_tls/idle.rs"]
mod idle;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use sluice::app::RunningGateway;
use sluice_testkit::certs::CLIENT_COMMON_NAME;
use sluice_testkit::TestPki;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::{gateway_sections, metric_sum};

/// `[mqtt.tls]` with the PKI's server certificate; `more` adds keys to it.
fn tls_section(pki: &TestPki, more: &str) -> String {
    format!(
        "[mqtt.tls]\nlisten = \"127.0.0.1:0\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n{more}\n",
        pki.server_cert_path().display(),
        pki.server_key_path().display()
    )
}

fn client_ca(pki: &TestPki) -> String {
    format!("client_ca_file = \"{}\"\n", pki.ca_path().display())
}

fn start(mqtt: &str, extra: &str) -> RunningGateway {
    gateway_sections("shards = 2", mqtt, extra)
}

/// TLS options for the mosquitto clients: trust `ca`, present `cert` if given.
fn mosquitto_tls(ca: &Path, cert: Option<(&Path, &Path)>) -> Vec<String> {
    let mut args = vec!["--cafile".to_string(), ca.display().to_string()];
    if let Some((cert, key)) = cert {
        args.extend([
            "--cert".to_string(),
            cert.display().to_string(),
            "--key".to_string(),
            key.display().to_string(),
        ]);
    }
    args
}

/// mosquitto_sub waits for one message on `topic` while mosquitto_pub publishes it (again
/// every 200 ms until the subscriber has it, since the subscription's moment is unknown).
/// Returns what the subscriber printed.
async fn mosquitto_round_trip(port: u16, tls: &[String], topic: &str, payload: &str) -> Output {
    let mut sub = tokio::process::Command::new("mosquitto_sub");
    sub.args([
        "-h",
        "localhost",
        "-p",
        &port.to_string(),
        "-t",
        topic,
        "-C",
        "1",
        "-W",
        "15",
        "-q",
        "1",
    ])
    .args(tls)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let sub = sub.spawn().expect("mosquitto_sub");
    let waiting = tokio::spawn(sub.wait_with_output());
    for _ in 0..50 {
        if waiting.is_finished() {
            break;
        }
        let _ = tokio::process::Command::new("mosquitto_pub")
            .args([
                "-h",
                "localhost",
                "-p",
                &port.to_string(),
                "-t",
                topic,
                "-m",
                payload,
                "-q",
                "1",
            ])
            .args(tls)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    waiting.await.expect("join").expect("mosquitto_sub output")
}

/// A mosquitto_pub that should be refused; returns its exit status and stderr.
fn mosquitto_pub_once(port: u16, tls: &[String], extra: &[&str]) -> Output {
    Command::new("mosquitto_pub")
        .args([
            "-h",
            "localhost",
            "-p",
            &port.to_string(),
            "-t",
            "t/refused",
            "-m",
            "x",
        ])
        .args(tls)
        .args(extra)
        .output()
        .expect("mosquitto_pub")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mosquitto_clients_publish_and_subscribe_over_tls_without_client_certificates() {
    let pki = TestPki::generate();
    let gw = start("", &tls_section(&pki, ""));
    let port = gw.tls_addr.expect("tls listener").port();
    let out = mosquitto_round_trip(
        port,
        &mosquitto_tls(pki.ca_path(), None),
        "tls/plain",
        "over-tls",
    )
    .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "over-tls",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mosquitto_clients_with_client_certificates_and_a_certificate_from_another_ca_refused() {
    let pki = TestPki::generate();
    let other = TestPki::generate();
    let gw = start(
        "",
        &tls_section(
            &pki,
            &format!("{}require_client_cert = true\n", client_ca(&pki)),
        ),
    );
    let port = gw.tls_addr.expect("tls listener").port();
    let with_cert = mosquitto_tls(
        pki.ca_path(),
        Some((pki.client_cert_path(), pki.client_key_path())),
    );
    let out = mosquitto_round_trip(port, &with_cert, "tls/cert", "with-cert").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "with-cert",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A certificate signed by another CA: refused at the handshake, nothing admitted.
    let admitted = metric_sum(&gw.metrics_text(), "sluice_control_admitted_total");
    let foreign = mosquitto_tls(
        pki.ca_path(),
        Some((other.client_cert_path(), other.client_key_path())),
    );
    let refused = mosquitto_pub_once(port, &foreign, &[]);
    assert!(
        !refused.status.success(),
        "a foreign CA's certificate was accepted"
    );
    // No certificate at all, where one is required: refused too.
    let refused = mosquitto_pub_once(port, &mosquitto_tls(pki.ca_path(), None), &[]);
    assert!(
        !refused.status.success(),
        "a device without a certificate was accepted"
    );
    // Counted once the gateway's handshake task ends, which may be just after the client
    // read the alert and exited.
    let counted = common::eventually(Duration::from_secs(2), || {
        metric_sum(
            &gw.metrics_text(),
            "sluice_mqtt_tls_handshake_failures_total{reason=\"certificate\"}",
        ) >= 2.0
    })
    .await;
    let m = gw.metrics_text();
    assert!(counted, "{m}");
    assert_eq!(metric_sum(&m, "sluice_control_admitted_total"), admitted);
    gw.shutdown();
}

/// The paho script: connect (TCP or WebSockets, TLS when `ca` is given), subscribe, publish
/// one QoS 1 message to itself, print what came back.
const PAHO_ROUND_TRIP: &str = r#"
import sys, threading
import paho.mqtt.client as mqtt
host, port, transport, ca, cert, key, topic = sys.argv[1:8]
got = threading.Event()
out = {}
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-" + transport + "-" + port, transport=transport)
if transport == "websockets":
    c.ws_set_options(path="/mqtt")
if ca != "-":
    c.tls_set(ca_certs=ca, certfile=None if cert == "-" else cert, keyfile=None if key == "-" else key)
def on_connect(c, u, flags, rc, props):
    if rc != 0:
        out["refused"] = str(rc)
        got.set()
        return
    c.subscribe(topic, qos=1)
def on_subscribe(c, u, mid, rcs, props):
    c.publish(topic, ("hello-" + transport).encode(), qos=1)
def on_message(c, u, m):
    out["m"] = m.payload.decode()
    got.set()
c.on_connect = on_connect
c.on_subscribe = on_subscribe
c.on_message = on_message
c.connect(host, int(port), keepalive=30)
c.loop_start()
got.wait(15)
c.loop_stop()
print(out.get("m", "refused " + out["refused"] if "refused" in out else "timeout"))
"#;

fn paho(addr: SocketAddr, transport: &str, tls: Option<(&Path, Option<(&Path, &Path)>)>) -> String {
    let dash = Path::new("-");
    let (ca, cert, key) = match tls {
        None => (dash, dash, dash),
        Some((ca, None)) => (ca, dash, dash),
        Some((ca, Some((cert, key)))) => (ca, cert, key),
    };
    let out = Command::new("python3")
        .arg("-c")
        .arg(PAHO_ROUND_TRIP)
        .arg("localhost")
        .arg(addr.port().to_string())
        .arg(transport)
        .args([ca, cert, key])
        .arg(format!("paho/{transport}"))
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "paho failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paho_round_trips_over_tls_with_and_without_a_client_certificate() {
    let pki = TestPki::generate();
    let gw = start("", &tls_section(&pki, &client_ca(&pki)));
    let addr = gw.tls_addr.expect("tls listener");
    let (a, b) = tokio::task::block_in_place(|| {
        (
            paho(addr, "tcp", Some((pki.ca_path(), None))),
            paho(
                addr,
                "tcp",
                Some((
                    pki.ca_path(),
                    Some((pki.client_cert_path(), pki.client_key_path())),
                )),
            ),
        )
    });
    assert_eq!(a, "hello-tcp");
    assert_eq!(b, "hello-tcp");
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_from_cert_admits_a_device_by_its_cn_where_passwords_are_required() {
    let pki = TestPki::generate();
    let hash = sluice::control::admission::hash_password(b"secret").expect("hash");
    // Logins are required (a user is configured, anonymous devices are refused), and no
    // user is named like the certificate.
    let mqtt = format!(
        "allow_anonymous = false\n[[mqtt.users]]\nusername = \"someone-else\"\npassword_hash = \"{hash}\"\n"
    );
    let gw = start(
        &mqtt,
        &tls_section(
            &pki,
            &format!("{}identity_from_cert = true\n", client_ca(&pki)),
        ),
    );
    let port = gw.tls_addr.expect("tls listener").port();
    let with_cert = mosquitto_tls(
        pki.ca_path(),
        Some((pki.client_cert_path(), pki.client_key_path())),
    );
    // No username, no password: the certificate's CN is the identity.
    let out = mosquitto_round_trip(port, &with_cert, "tls/identity", "by-cn").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "by-cn",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A username and a wrong password in the CONNECT do not matter either.
    let out = mosquitto_pub_once(port, &with_cert, &["-u", "someone-else", "-P", "wrong"]);
    assert!(
        out.status.success(),
        "a certificate-identified device was refused: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without a certificate on this listener the device is not authorized (CONNACK 5).
    let out = mosquitto_pub_once(port, &mosquitto_tls(pki.ca_path(), None), &[]);
    assert!(
        !out.status.success(),
        "a device without a certificate was admitted"
    );
    // And on the plain listener, the same anonymous device is refused as before.
    let plain = Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &gw.mqtt_addr.port().to_string(),
            "-t",
            "t",
            "-m",
            "x",
        ])
        .output()
        .expect("mosquitto_pub");
    assert!(!plain.status.success());
    let m = gw.metrics_text();
    assert!(
        metric_sum(&m, "sluice_mqtt_cert_identities_total") >= 2.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "sluice_mqtt_cert_missing_total"), 1.0, "{m}");
    assert_eq!(CLIENT_COMMON_NAME, "sluice-test-client");
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_certificate_identity_is_the_username_acl_rules_see() {
    let pki = TestPki::generate();
    // Default deny; devices whose verified username matches `sluice-test-*` may use their own
    // tree `devices/%u/#`. The CONNECT carries no username: only the certificate names it.
    let acl = "[acl]\ndefault = \"deny\"\n[[acl.rule]]\nusers = \"sluice-test-*\"\n\
               action = \"all\"\ntopics = [\"devices/%u/#\"]\npermission = \"allow\"\n";
    let tls = tls_section(
        &pki,
        &format!("{}identity_from_cert = true\n", client_ca(&pki)),
    );
    let gw = start("", &format!("{tls}{acl}"));
    let port = gw.tls_addr.expect("tls listener").port();
    let with_cert = mosquitto_tls(
        pki.ca_path(),
        Some((pki.client_cert_path(), pki.client_key_path())),
    );
    let own = format!("devices/{CLIENT_COMMON_NAME}/t");
    let out = mosquitto_round_trip(port, &with_cert, &own, "mine").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "mine",
        "the certificate's own tree: stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let denied = |m: &str| {
        m.lines()
            .filter(|l| {
                l.starts_with("sluice_acl_denied_total")
                    && l.contains("edge=\"mqtt\"")
                    && l.contains("action=\"publish\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(denied(&gw.metrics_text()), 0.0);
    // Another device's tree, with its name claimed as the CONNECT's username: denied.
    Command::new("mosquitto_pub")
        .args([
            "-h",
            "localhost",
            "-p",
            &port.to_string(),
            "-V",
            "mqttv5",
            "-q",
            "1",
        ])
        .args([
            "-t",
            "devices/sluice-test-other/t",
            "-m",
            "x",
            "-u",
            "sluice-test-other",
        ])
        .args(&with_cert)
        .output()
        .expect("mosquitto_pub");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while denied(&gw.metrics_text()) < 1.0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(denied(&gw.metrics_text()), 1.0, "{}", gw.metrics_text());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paho_round_trips_over_websocket_and_secure_websocket() {
    let pki = TestPki::generate();
    let extra = format!(
        "{}[mqtt.ws]\nlisten = \"127.0.0.1:0\"\n[mqtt.wss]\nlisten = \"127.0.0.1:0\"\n",
        tls_section(&pki, "")
    );
    let gw = start("", &extra);
    let ws = gw.ws_addr.expect("ws listener");
    let wss = gw.wss_addr.expect("wss listener");
    let (a, b) = tokio::task::block_in_place(|| {
        (
            paho(ws, "websockets", None),
            paho(wss, "websockets", Some((pki.ca_path(), None))),
        )
    });
    assert_eq!(a, "hello-websockets");
    assert_eq!(b, "hello-websockets");
    gw.shutdown();
}

/// A raw WebSocket client: upgrade, then MQTT bytes in frames of our choosing.
async fn ws_upgrade(addr: SocketAddr, path: &str) -> (tokio::net::TcpStream, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: gw\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await {
            Ok(Ok(1)) => head.push(b[0]),
            _ => break,
        }
    }
    (s, String::from_utf8_lossy(&head).to_string())
}

fn masked_frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
    let mask = [0x11, 0x22, 0x33, 0x44];
    let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
    assert!(payload.len() < 126);
    f.push(0x80 | payload.len() as u8);
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_frames_split_packets_pings_are_answered_and_bad_upgrades_refused() {
    let gw = start("", "[mqtt.ws]\nlisten = \"127.0.0.1:0\"\n");
    let ws = gw.ws_addr.expect("ws listener");

    let (_, head) = ws_upgrade(ws, "/elsewhere").await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");

    let (mut s, head) = ws_upgrade(ws, "/mqtt").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
        "{head}"
    );
    assert!(head.contains("Sec-WebSocket-Protocol: mqtt"), "{head}");
    // A CONNECT split over two frames (the first not final), a ping between them, then a
    // PINGREQ in the same frame as nothing else.
    let connect: &[u8] = b"\x10\x0f\x00\x04MQTT\x04\x02\x00\x3c\x00\x03ws1";
    s.write_all(&masked_frame(0x2, false, &connect[..5]))
        .await
        .expect("w");
    s.write_all(&masked_frame(0x9, true, b"hi"))
        .await
        .expect("w");
    s.write_all(&masked_frame(0x0, true, &connect[5..]))
        .await
        .expect("w");
    s.write_all(&masked_frame(0x2, true, b"\xc0\x00"))
        .await
        .expect("w");
    // Server frames (unmasked, short): the pong, and binary frames whose payloads together
    // are CONNACK then PINGRESP (in one frame or two, as the writes happen to go).
    let mut pongs = Vec::new();
    let mut stream_bytes = Vec::new();
    let want: &[u8] = b"\x20\x02\x00\x00\xd0\x00";
    while stream_bytes.len() < want.len() {
        let mut h = [0u8; 2];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut h))
            .await
            .expect("answers in time")
            .expect("frame header");
        assert!(h[1] < 126, "unexpected frame {h:x?}");
        let mut payload = vec![0u8; h[1] as usize];
        s.read_exact(&mut payload).await.expect("payload");
        match h[0] {
            0x8A => pongs.push(payload),
            0x82 => stream_bytes.extend_from_slice(&payload),
            other => panic!("unexpected opcode {other:#x}"),
        }
    }
    assert_eq!(stream_bytes, want);
    assert_eq!(pongs, vec![b"hi".to_vec()]);
    // An unmasked frame breaks RFC 6455: close frame 1002, connection closed.
    s.write_all(b"\x82\x02\xc0\x00").await.expect("w");
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert!(rest.starts_with(b"\x88\x02\x03\xea"), "{rest:x?}");

    // The refusal is counted after its 404 is written (the client may read it first).
    let counted = common::eventually(Duration::from_secs(2), || {
        metric_sum(
            &gw.metrics_text(),
            "sluice_mqtt_ws_upgrade_failures_total{reason=\"not_found\"}",
        ) == 1.0
    })
    .await;
    assert!(counted, "{}", gw.metrics_text());
    // The device that broke the framing was closed as a protocol error.
    let counted = common::eventually(Duration::from_secs(2), || {
        gw.metrics_text().lines().any(|l| {
            l.starts_with("sluice_mqtt_connections_closed_total{")
                && l.contains("reason=\"protocol_error\"")
                && !l.ends_with(" 0")
        })
    })
    .await;
    assert!(counted, "{}", gw.metrics_text());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_finishes_its_tls_handshake_is_closed_at_connect_timeout() {
    let pki = TestPki::generate();
    let gw = start("connect_timeout = \"1s\"\n", &tls_section(&pki, ""));
    let addr = gw.tls_addr.expect("tls listener");
    let started = std::time::Instant::now();
    let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut b))
        .await
        .expect("closed by the gateway in time")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(started.elapsed() >= Duration::from_millis(900));
    // Counted as the socket closes (the count may land just after the client sees EOF).
    let counted = common::eventually(Duration::from_secs(2), || {
        metric_sum(
            &gw.metrics_text(),
            "sluice_mqtt_tls_handshake_failures_total{reason=\"timeout\"}",
        ) == 1.0
    })
    .await;
    assert!(counted, "{}", gw.metrics_text());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_1_2_is_offered_by_default_and_refused_with_min_version_1_3() {
    use sluice_testkit::{ConnectOpts, TestClient};
    let pki = TestPki::generate();
    let tls12_only = pki.rustls_client_config_with_versions(false, &[&rustls::version::TLS12]);
    let gw = start("", &tls_section(&pki, ""));
    let opts = ConnectOpts::v311("old-stack").with_tls(tls12_only.clone(), "localhost");
    let (c, ack) = TestClient::connect(gw.tls_addr.expect("tls"), opts)
        .await
        .expect("a TLS 1.2 device connects by default");
    assert_eq!(ack.code, 0);
    drop(c);
    gw.shutdown();

    let gw = start("", &tls_section(&pki, "min_version = \"1.3\"\n"));
    let opts = ConnectOpts::v311("old-stack").with_tls(tls12_only, "localhost");
    assert!(TestClient::connect(gw.tls_addr.expect("tls"), opts)
        .await
        .is_err());
    let counted = common::eventually(Duration::from_secs(2), || {
        metric_sum(
            &gw.metrics_text(),
            "sluice_mqtt_tls_handshake_failures_total{reason=\"protocol\"}",
        ) == 1.0
    })
    .await;
    assert!(counted, "{}", gw.metrics_text());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wss_devices_are_identified_by_their_certificate_too() {
    let pki = TestPki::generate();
    let hash = sluice::control::admission::hash_password(b"secret").expect("hash");
    let mqtt = format!(
        "allow_anonymous = false\n[[mqtt.users]]\nusername = \"someone-else\"\npassword_hash = \"{hash}\"\n"
    );
    let extra = format!(
        "{}[mqtt.wss]\nlisten = \"127.0.0.1:0\"\n",
        tls_section(
            &pki,
            &format!("{}identity_from_cert = true\n", client_ca(&pki))
        )
    );
    let gw = start(&mqtt, &extra);
    let wss = gw.wss_addr.expect("wss listener");
    let (with_cert, without) = tokio::task::block_in_place(|| {
        (
            paho(
                wss,
                "websockets",
                Some((
                    pki.ca_path(),
                    Some((pki.client_cert_path(), pki.client_key_path())),
                )),
            ),
            paho(wss, "websockets", Some((pki.ca_path(), None))),
        )
    });
    assert_eq!(with_cert, "hello-websockets");
    assert!(without.starts_with("refused"), "{without}");
    let m = gw.metrics_text();
    assert_eq!(
        metric_sum(&m, "sluice_mqtt_cert_identities_total"),
        1.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "sluice_mqtt_cert_missing_total"), 1.0, "{m}");
    gw.shutdown();
}
