//! The cloud side: a PKI generated per run and a TLS 1.3-only cloud Mosquitto.

use anyhow::Context as _;
use sluice_testkit::{Mosquitto, TestPki};

/// A PKI generated now and the cloud Mosquitto with it: TLS 1.3 only, no plain listener
/// (started on a blocking thread).
pub async fn start_tls_cloud() -> anyhow::Result<(TestPki, Mosquitto)> {
    tokio::task::spawn_blocking(|| -> anyhow::Result<(TestPki, Mosquitto)> {
        let pki = TestPki::try_generate()?;
        let cloud = Mosquitto::builder()
            .tls(&pki)
            .plain_listener(false)
            .start()
            .context("starting the cloud Mosquitto")?;
        Ok((pki, cloud))
    })
    .await
    .context("cloud start-up panicked")?
}
