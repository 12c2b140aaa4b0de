//! The cloud side: a PKI generated per run and a TLS 1.3-only cloud Mosquitto
//! ([`start_tls_cloud`]), or a [`Cloud`] of choice with a measuring sink on its own runtime
//! (`start_cloud`: the fast acknowledging sink, or Mosquitto with a measuring subscriber).

use anyhow::{anyhow, Context as _};
use serde::Serialize;
use sluice_proto::mqtt::ProtocolVersion;
use sluice_testkit::{Mosquitto, TestPki};

use crate::sinks::fastsink::{self, start_fast_sink, FastSink, FastSinkConfig, SubscriberConfig};

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

/// Name of the sink runtime's worker thread (≤ 15 bytes: it is the thread's `comm`).
pub(crate) const SINK_THREAD: &str = "fastsink";

/// Where the SUT's uplink goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cloud {
    /// A TLS 1.3 Mosquitto with a measuring subscriber.
    Mosquitto,
    /// The in-process fast acknowledging sink.
    FastSink,
}

impl Cloud {
    pub fn name(self) -> &'static str {
        match self {
            Cloud::Mosquitto => "mosquitto",
            Cloud::FastSink => "fast-sink",
        }
    }
}

/// The sink's runtime: one worker thread named [`SINK_THREAD`]. Shut down without blocking
/// when dropped (dropping a runtime inside another one's task would panic).
pub(crate) struct SinkRuntime(Option<tokio::runtime::Runtime>);

impl SinkRuntime {
    pub(crate) fn new() -> anyhow::Result<SinkRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(SINK_THREAD)
            .enable_all()
            .build()
            .context("starting the sink runtime")?;
        Ok(SinkRuntime(Some(rt)))
    }
    pub(crate) fn handle(&self) -> anyhow::Result<tokio::runtime::Handle> {
        self.0
            .as_ref()
            .map(|rt| rt.handle().clone())
            .ok_or_else(|| anyhow!("the sink runtime is gone"))
    }
}

impl Drop for SinkRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The cloud side of one run.
pub(crate) struct CloudSide {
    pub(crate) sink: FastSink,
    /// The TLS port the SUT connects to.
    pub(crate) port: u16,
    /// The Mosquitto cloud, when there is one.
    pub(crate) broker: Option<Mosquitto>,
}

pub(crate) async fn start_cloud(
    cloud: Cloud,
    pki: &TestPki,
    rt: &SinkRuntime,
) -> anyhow::Result<CloudSide> {
    let handle = rt.handle()?;
    match cloud {
        Cloud::FastSink => {
            let tls = fastsink::tls_server_config(pki.server_cert_path(), pki.server_key_path())?;
            let sink = handle
                .spawn(async move {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                        .await
                        .context("binding the fast sink")?;
                    start_fast_sink(listener, FastSinkConfig::new(tls))
                })
                .await
                .context("fast sink start-up panicked")??;
            Ok(CloudSide {
                port: sink.local_addr().port(),
                sink,
                broker: None,
            })
        }
        Cloud::Mosquitto => {
            let ca = pki.ca_path().to_path_buf();
            let builder = Mosquitto::builder().tls(pki).plain_listener(false);
            let broker = tokio::task::spawn_blocking(move || builder.start())
                .await
                .context("cloud start-up panicked")?
                .context("starting the cloud Mosquitto")?;
            let subscriber = SubscriberConfig {
                broker: broker.tls_addr(),
                ca_file: Some(ca),
                server_name: "127.0.0.1".to_string(),
                topic: "#".to_string(),
                protocol: ProtocolVersion::V311,
                measure_latency: true,
            };
            let sink = handle
                .spawn(fastsink::subscribe_measuring(subscriber))
                .await
                .context("subscriber start-up panicked")??;
            Ok(CloudSide {
                port: broker.tls_port(),
                sink,
                broker: Some(broker),
            })
        }
    }
}
