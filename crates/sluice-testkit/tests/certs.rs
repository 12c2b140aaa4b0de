//! The generated test PKI is usable as-is: a TLS 1.3 client trusting only the test CA accepts
//! the server certificate under both names it is issued for, client certificates are checked,
//! and the PEM files are where the accessors say. Handshakes run in memory (tokio duplex).

use std::sync::Arc;

use rustls::pki_types::ServerName;
use sluice_testkit::TestPki;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Handshake `client` against `server` over an in-memory pipe and echo one byte through it.
async fn handshake(
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
    server_name: &str,
) -> Result<rustls::ProtocolVersion, String> {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let name = ServerName::try_from(server_name.to_string()).map_err(|e| e.to_string())?;
    let server_task = tokio::spawn(async move {
        let mut tls = TlsAcceptor::from(server)
            .accept(server_io)
            .await
            .map_err(|e| e.to_string())?;
        let mut byte = [0u8; 1];
        tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
        tls.write_all(&byte).await.map_err(|e| e.to_string())?;
        tls.flush().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(())
    });
    let client_result = async {
        let mut tls = TlsConnector::from(client)
            .connect(name, client_io)
            .await
            .map_err(|e| e.to_string())?;
        let version = tls
            .get_ref()
            .1
            .protocol_version()
            .ok_or("no version negotiated")?;
        tls.write_all(b"x").await.map_err(|e| e.to_string())?;
        tls.flush().await.map_err(|e| e.to_string())?;
        let mut byte = [0u8; 1];
        tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(version)
    }
    .await;
    let server_result = server_task.await.map_err(|e| e.to_string())?;
    let version = client_result?;
    server_result?;
    Ok(version)
}

#[test]
fn pki_writes_all_five_pem_files_into_its_directory() {
    let pki = TestPki::generate();
    for path in [
        pki.ca_path(),
        pki.server_cert_path(),
        pki.server_key_path(),
        pki.client_cert_path(),
        pki.client_key_path(),
    ] {
        assert!(
            path.starts_with(pki.dir()),
            "{} is outside the PKI dir",
            path.display()
        );
        let text = std::fs::read_to_string(path).expect("PEM file is readable");
        assert!(
            text.starts_with("-----BEGIN "),
            "{} is not PEM",
            path.display()
        );
    }
    let dir = pki.dir().to_path_buf();
    drop(pki);
    assert!(!dir.exists(), "dropping the PKI removes its directory");
}

#[tokio::test(flavor = "current_thread")]
async fn server_certificate_is_trusted_for_localhost_and_127_0_0_1_over_tls13() {
    let pki = TestPki::generate();
    for name in ["localhost", "127.0.0.1"] {
        let version = handshake(
            pki.rustls_client_config(false),
            pki.rustls_server_config(false),
            name,
        )
        .await
        .unwrap_or_else(|e| panic!("handshake as {name} failed: {e}"));
        assert_eq!(version, rustls::ProtocolVersion::TLSv1_3);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn server_certificate_is_rejected_for_another_host_name() {
    let pki = TestPki::generate();
    let err = handshake(
        pki.rustls_client_config(false),
        pki.rustls_server_config(false),
        "example.com",
    )
    .await
    .expect_err("certificate is not valid for example.com");
    assert!(
        err.to_lowercase().contains("certificate"),
        "unexpected error: {err}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn server_requiring_client_certificate_accepts_the_test_client_and_refuses_anonymous() {
    let pki = TestPki::generate();
    handshake(
        pki.rustls_client_config(true),
        pki.rustls_server_config(true),
        "localhost",
    )
    .await
    .expect("client with the test client certificate is accepted");
    handshake(
        pki.rustls_client_config(false),
        pki.rustls_server_config(true),
        "localhost",
    )
    .await
    .expect_err("client without a certificate is refused");
}

#[tokio::test(flavor = "current_thread")]
async fn tls12_only_client_cannot_handshake_with_tls13_only_server() {
    let pki = TestPki::generate();
    let tls12_only = pki.rustls_client_config_with_versions(false, &[&rustls::version::TLS12]);
    handshake(tls12_only, pki.rustls_server_config(false), "localhost")
        .await
        .expect_err("TLS 1.2-only client is refused");
}
