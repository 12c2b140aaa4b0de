//! Shared set-up for the gateway's end-to-end tests: a real cloud Mosquitto with TLS 1.3 and
//! certificates generated at test time, a gateway started in-process from a TOML config, and a
//! gate-able TCP relay used only to inject a fault (hold the gateway off the cloud).
#![allow(dead_code)]

pub mod coap;
pub mod fault_broker;
pub mod packets;
pub mod process;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sluice::app::{Gateway, RunningGateway};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient, TestPki};

pub struct Cloud {
    pub pki: TestPki,
    pub broker: Mosquitto,
}

impl Cloud {
    pub fn start() -> Cloud {
        let pki = TestPki::generate();
        let broker = Mosquitto::builder()
            .tls(&pki)
            .plain_listener(false)
            .start()
            .expect("start cloud mosquitto");
        Cloud { pki, broker }
    }

    /// A TLS 1.3 client of the cloud broker.
    pub async fn client(&self, id: &str) -> TestClient {
        let opts =
            ConnectOpts::v311(id).with_tls(self.pki.rustls_client_config(false), "localhost");
        let (c, ack) = TestClient::connect(self.broker.tls_addr(), opts)
            .await
            .expect("connect to cloud");
        assert_eq!(ack.code, 0);
        c
    }

    pub async fn subscriber(&self, id: &str, filter: &str) -> TestClient {
        let mut c = self.client(id).await;
        let codes = c
            .subscribe(&[(filter, QoS::AtLeastOnce)])
            .await
            .expect("subscribe at cloud");
        assert_eq!(codes, vec![1]);
        c
    }

    /// An `[[uplink]]` section pointing at this broker (or at `via`, a relay in front of it).
    pub fn uplink_toml(&self, via: Option<SocketAddr>, extra: &str) -> String {
        self.uplink_toml_named("cloud", "gw-test", via, extra)
    }

    /// [`Cloud::uplink_toml`] with its own uplink name and client id (a second uplink).
    pub fn uplink_toml_named(
        &self,
        name: &str,
        client_id: &str,
        via: Option<SocketAddr>,
        extra: &str,
    ) -> String {
        let addr = via.unwrap_or(self.broker.tls_addr());
        format!(
            "[[uplink]]\nname = \"{name}\"\nurl = \"mqtts://{addr}\"\nca_file = \"{}\"\nserver_name = \"localhost\"\nclient_id = \"{client_id}\"\nreconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n{extra}\n",
            self.pki.ca_path().display()
        )
    }
}

/// Start a gateway on free loopback ports with `shards` shards and extra TOML.
pub fn gateway(shards: usize, extra: &str) -> RunningGateway {
    gateway_mqtt(shards, "", extra)
}

/// [`gateway`] with extra lines in the `[mqtt]` section.
pub fn gateway_mqtt(shards: usize, mqtt: &str, extra: &str) -> RunningGateway {
    gateway_sections(&format!("shards = {shards}"), mqtt, extra)
}

/// A gateway on free loopback ports with `gateway` lines in `[gateway]` (which must set
/// `shards`; threads are never pinned), `mqtt` lines in `[mqtt]` and extra TOML after. The
/// CoAP listener is on a free port too, unless `extra` has a `[coap]` section of its own
/// (which must then set `listen`).
pub fn gateway_sections(gateway: &str, mqtt: &str, extra: &str) -> RunningGateway {
    let coap = if extra.contains("[coap]") {
        ""
    } else {
        "[coap]\nlisten = \"127.0.0.1:0\"\n"
    };
    let text = format!(
        "[gateway]\npin_threads = false\n{gateway}\n[mqtt]\nlisten = \"127.0.0.1:0\"\n{mqtt}\n{coap}[admin]\nlisten = \"127.0.0.1:0\"\n{extra}\n"
    );
    let config =
        sluice::config::parse(&text).unwrap_or_else(|e| panic!("test config invalid: {e}\n{text}"));
    Gateway::build(config)
        .expect("build gateway")
        .start()
        .expect("start gateway")
}

pub async fn device(gw: &RunningGateway, id: &str, version: ProtocolVersion) -> TestClient {
    device_opts(gw, ConnectOpts::new(version, id)).await
}

pub async fn device_opts(gw: &RunningGateway, opts: ConnectOpts) -> TestClient {
    let (c, ack) = TestClient::connect(gw.mqtt_addr, opts)
        .await
        .expect("connect device");
    assert_eq!(ack.code, 0, "device refused: {ack:?}");
    c
}

/// Client ids that hash to each shard, so a test can place devices deliberately.
pub fn ids_on_shards(prefix: &str, shards: usize, per_shard: usize) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new(); shards];
    let mut i = 0;
    while out.iter().any(|v| v.len() < per_shard) {
        let id = format!("{prefix}-{i}");
        let s = sluice::shard::hash::shard_for(id.as_bytes(), None, shards);
        if out[s].len() < per_shard {
            out[s].push(id);
        }
        i += 1;
    }
    out
}

/// A TCP relay that can refuse new connections and cut existing ones: the fault injector that
/// decides when the gateway may reach the cloud again.
pub struct Gate {
    pub addr: SocketAddr,
    open: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Gate {
    pub async fn start(upstream: SocketAddr) -> Gate {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind relay");
        let addr = listener.local_addr().expect("relay addr");
        let open = Arc::new(tokio::sync::watch::Sender::new(true));
        let gate = open.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = listener.accept().await else {
                    return;
                };
                if !*gate.borrow() {
                    drop(down);
                    continue;
                }
                let mut closed = gate.subscribe();
                tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                            // Closing the gate cuts the connections through it.
                            _ = closed.wait_for(|open| !*open) => {}
                        }
                    }
                });
            }
        });
        Gate { addr, open }
    }

    /// Open lets new connections through; closing refuses new ones and cuts those open.
    pub fn set_open(&self, open: bool) {
        self.open.send_replace(open);
    }
}

/// Poll `f` until it is true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// The value of a metric line (sum over all label sets matching `prefix`).
pub fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Run `f` on a current-thread runtime inside a `LocalSet` (what a shard runs on), for tests
/// that drive shard-side types (`Rc`, `spawn_local`) directly.
pub fn run_local<F: std::future::Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&rt, f)
}

/// Poll `cond` every 5 ms until it holds; panics naming `what` after `timeout`.
pub async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
