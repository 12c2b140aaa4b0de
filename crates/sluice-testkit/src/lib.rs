//! Test support for sluice: everything a test needs that is not sluice itself.
//!
//! Owns: a throw-away PKI generated at test time ([`certs`]), a real Mosquitto broker as a
//! child process ([`broker`]), a real ACME oneM2M CSE as a child process ([`acme`]), an MQTT
//! test client on sluice-proto's codec ([`client`]), free-port helpers ([`ports`]), an IEEE
//! 11073-20601 (PHD) test agent over TCP with its pure APDU encoders ([`phd`]), a strict
//! Prometheus text-format reader that names the family at fault ([`prom`]), a tmpfs of a
//! given size to fill up or remount read-only ([`tmpfs`], root only). Does not own:
//! any production code path — nothing here is
//! linked into the `sluice` binary.
//!
//! Invariants: hermetic (temp dirs, loopback ports, no system trust store); every resource a
//! helper starts (broker process, temp dir) is released when its handle is dropped.
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! use sluice_proto::mqtt::QoS;
//! use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};
//!
//! let pki = TestPki::generate();
//! let cloud = Mosquitto::builder().tls(&pki).start()?; // TLS 1.3 only
//! let tls = pki.rustls_client_config(false);
//! let (mut sub, _) =
//!     TestClient::connect(cloud.tls_addr(), ConnectOpts::v5("sub").with_tls(tls, "localhost")).await?;
//! sub.subscribe(&[("sensors/#", QoS::AtLeastOnce)]).await?;
//! let (mut publ, _) = TestClient::connect(cloud.plain_addr(), ConnectOpts::v311("pub")).await?;
//! assert_eq!(publ.publish("sensors/t", &b"21.5"[..], QoS::AtLeastOnce, false).await?, 0);
//! let message = sub.recv(std::time::Duration::from_secs(5)).await?.expect("delivered");
//! assert_eq!(&message.payload[..], b"21.5");
//! # Ok(()) }
//! ```
#![deny(unsafe_code)] // one exception: netns::enter (setns), test-only

pub mod acme;
pub mod broker;
pub mod certs;
pub mod client;
pub mod haproxy;
pub mod kafka;
pub mod netns;
pub mod phd;
pub mod ports;
pub mod prom;
pub mod tmpfs;

pub use acme::{Acme, AcmeBuilder, AcmeResponse};
pub use broker::{Mosquitto, MosquittoBuilder};
pub use certs::TestPki;
pub use client::{ConnectOpts, TestClient};
pub use haproxy::Haproxy;
pub use kafka::KafkaCluster;
pub use phd::{AgentSpec, Association, PhdAgent, PhdDevice, Reading};
pub use ports::{free_port, wait_for_port, wait_for_port_blocking};
pub use tmpfs::Tmpfs;
