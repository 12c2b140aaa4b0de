//! The Mosquitto launcher gives tests a real broker: TLS 1.3 only, restartable on the same
//! ports, and gone when the handle is dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use sluice_testkit::{Mosquitto, TestPki};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Try a TLS handshake; `Ok(version)` if it completed.
async fn tls_handshake(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<rustls::ProtocolVersion, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("tcp: {e}"))?;
    let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let tls = tokio::time::timeout(
        Duration::from_secs(5),
        TlsConnector::from(config).connect(name, tcp),
    )
    .await
    .map_err(|_| "handshake timed out".to_string())?
    .map_err(|e| format!("tls: {e}"))?;
    tls.get_ref()
        .1
        .protocol_version()
        .ok_or_else(|| "no version".to_string())
}

fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "current_thread")]
async fn tls_broker_starts_and_negotiates_tls13_with_the_test_ca() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    let version = tls_handshake(broker.tls_addr(), pki.rustls_client_config(false))
        .await
        .expect("TLS handshake with mosquitto");
    assert_eq!(version, rustls::ProtocolVersion::TLSv1_3);
    assert_ne!(
        broker.tls_port(),
        broker.plain_port(),
        "two listeners, two ports"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn tls12_only_client_is_refused_by_the_tls13_broker() {
    let pki = TestPki::generate();
    let broker = Mosquitto::builder()
        .tls(&pki)
        .plain_listener(false)
        .start()
        .expect("mosquitto starts");
    let tls12_only = pki.rustls_client_config_with_versions(false, &[&rustls::version::TLS12]);
    let err = tls_handshake(broker.tls_addr(), tls12_only)
        .await
        .expect_err("TLS 1.2 is refused");
    assert!(
        err.starts_with("tls:"),
        "refused during the handshake, got: {err}"
    );
}

#[test]
fn killed_broker_restarts_on_the_same_ports_with_a_new_process() {
    let pki = TestPki::generate();
    let mut broker = Mosquitto::builder()
        .tls(&pki)
        .start()
        .expect("mosquitto starts");
    let (tls_port, plain_port) = (broker.tls_port(), broker.plain_port());
    let first_pid = broker.pid().expect("running");

    broker.kill().expect("kill");
    assert_eq!(broker.pid(), None);
    assert!(!process_exists(first_pid), "killed process is reaped");
    assert!(
        std::net::TcpStream::connect(broker.plain_addr()).is_err(),
        "nothing listens while the broker is down"
    );

    broker.restart().expect("restart");
    let second_pid = broker.pid().expect("running again");
    assert_ne!(first_pid, second_pid);
    assert_eq!(
        (broker.tls_port(), broker.plain_port()),
        (tls_port, plain_port)
    );
    std::net::TcpStream::connect(broker.plain_addr()).expect("plain port accepts again");
    std::net::TcpStream::connect(broker.tls_addr()).expect("TLS port accepts again");
}

#[test]
fn dropping_the_handle_kills_the_broker() {
    let broker = Mosquitto::builder().start().expect("mosquitto starts");
    let pid = broker.pid().expect("running");
    let addr = broker.plain_addr();
    assert!(process_exists(pid));
    drop(broker);
    assert!(!process_exists(pid), "process {pid} is gone after drop");
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "port {addr} is closed after drop"
    );
}

#[test]
fn invalid_extra_config_fails_start_with_the_broker_log_in_the_error() {
    let err = Mosquitto::builder()
        .config_line("this_is_not_a_mosquitto_option 1")
        .start()
        .expect_err("mosquitto rejects the config");
    let message = format!("{err:#}");
    assert!(message.contains("exited during start-up"), "{message}");
    assert!(
        message.contains("this_is_not_a_mosquitto_option"),
        "log tail names the bad line: {message}"
    );
}
