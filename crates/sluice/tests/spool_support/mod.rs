//! What the spool's end-to-end tests (`gateway_spool.rs`, `gateway_spool_recovery.rs`) share:
//! a cloud broker behind a closed gate with a subscriber and an empty spool directory
//! ([`GatedCloud`]), gateways on it, publishing and receiving numbered payloads, and reading
//! or damaging the spool's segment files on disk.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use crate::common::*;
use sluice::app::RunningGateway;
use sluice_proto::mqtt::QoS;
use sluice_testkit::TestClient;

pub const WAIT: Duration = Duration::from_secs(20);

/// `[uplink]` lines that turn SenML aggregation off (one PUBLISH per spooled message).
pub const NO_AGGREGATION: &str = "[uplink.aggregate]\nenabled = false";

/// What every test here starts from: a cloud broker with a subscriber, a gate in front of it
/// that starts closed (the cloud is "down"), and an empty spool directory.
pub struct GatedCloud {
    pub cloud: Cloud,
    pub sub: TestClient,
    pub gate: Gate,
    pub dir: tempfile::TempDir,
}

impl GatedCloud {
    /// The cloud, its subscriber on `filter`, the gate closed.
    pub async fn start_closed(filter: &str) -> GatedCloud {
        let cloud = Cloud::start();
        let sub = cloud.subscriber("cloud-sub", filter).await;
        let gate = Gate::start(cloud.broker.tls_addr()).await;
        gate.set_open(false);
        let dir = tempfile::tempdir().expect("tempdir");
        GatedCloud {
            cloud,
            sub,
            gate,
            dir,
        }
    }

    /// `[spool]` in the spool directory (`fsync = "never"`, then `spool_extra`) and an uplink
    /// through the gate (`uplink_extra` in its section).
    pub fn config(&self, spool_extra: &str, uplink_extra: &str) -> String {
        format!(
            "[spool]\ndir = \"{}\"\nfsync = \"never\"\n{spool_extra}\n{}",
            self.dir.path().display(),
            self.cloud.uplink_toml(Some(self.gate.addr), uplink_extra)
        )
    }

    /// A one-shard gateway on [`GatedCloud::config`] without aggregation.
    pub fn gateway(&self, spool_extra: &str, uplink_extra: &str) -> RunningGateway {
        gateway(
            1,
            &self.config(spool_extra, &format!("{uplink_extra}\n{NO_AGGREGATION}")),
        )
    }

    /// A one-shard gateway with `ack` and a 1 KiB uplink queue: while the cloud is away only
    /// the first few records are read into memory, the rest stay on disk.
    pub fn small_queue_gateway(&self, ack: &str) -> RunningGateway {
        gateway_sections(
            "shards = 1\nmax_buffered = \"1KiB\"",
            "max_packet_size = \"1KiB\"",
            &self.config(&format!("ack = \"{ack}\""), NO_AGGREGATION),
        )
    }

    /// A one-shard gateway whose spool holds 16 KiB in 4 KiB segments, `when_full` when it is
    /// full, and devices' packets of at most 1 KiB.
    pub fn small_spool_gateway(&self, when_full: &str) -> RunningGateway {
        let text = self.config(
            &format!("segment_size = \"4KiB\"\nmax_size = \"16KiB\"\nwhen_full = \"{when_full}\""),
            NO_AGGREGATION,
        );
        gateway_mqtt(1, "max_packet_size = \"1KiB\"", &text)
    }
}

pub fn payload(device: &str, i: usize) -> String {
    format!("{device}:{i:06}:")
}

pub fn index_of(p: &[u8]) -> (String, usize) {
    let s = std::str::from_utf8(p).expect("utf-8 payload");
    let mut parts = s.split(':');
    let dev = parts.next().expect("device").to_string();
    let i = parts.next().expect("index").parse().expect("number");
    (dev, i)
}

/// Publishes `n` QoS 1 messages keeping up to `window` unacknowledged; returns once every
/// PUBACK arrived (fails the test after the client's ack timeout).
pub async fn publish_all(
    c: &mut TestClient,
    device: &str,
    topic: &str,
    range: std::ops::Range<usize>,
    window: usize,
) {
    let mut pending = std::collections::VecDeque::new();
    for i in range {
        if pending.len() >= window {
            let id = pending.pop_front().expect("pending");
            assert_eq!(c.wait_ack(id).await.expect("PUBACK"), 0);
        }
        let id = c
            .publish_no_wait(topic, payload(device, i), QoS::AtLeastOnce, false)
            .await
            .expect("publish")
            .expect("QoS 1 has a packet id");
        pending.push_back(id);
    }
    for id in pending {
        assert_eq!(c.wait_ack(id).await.expect("PUBACK"), 0);
    }
}

/// Receives until `n` messages arrived or nothing came for `quiet`.
pub async fn receive(sub: &mut TestClient, n: usize, quiet: Duration) -> Vec<(String, usize)> {
    let mut got = Vec::new();
    while got.len() < n {
        match sub.recv(quiet).await.expect("cloud subscriber") {
            Some(p) => got.push(index_of(&p.payload)),
            None => break,
        }
    }
    got
}

/// The gateway's metric lines starting with `prefix`, for failure messages.
pub fn metric_lines(gw: &RunningGateway, prefix: &str) -> String {
    gw.metrics_text()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn uplink_connected(gw: &RunningGateway) -> bool {
    gw.status_json()["shards"]
        .as_array()
        .is_some_and(|s| s.iter().all(|s| s["uplinks"][0]["state"] == "connected"))
}

/// Every segment file's bytes, concatenated.
pub fn spool_bytes(dir: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for entry in walk(dir) {
        if entry.extension().is_some_and(|e| e == "seg") {
            out.extend(std::fs::read(&entry).expect("read segment"));
        }
    }
    out
}

pub fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Flips one byte of the payload `needle` in the spool segment that holds it, in place (the
/// running gateway's open file sees it), as a flash bit flip would.
pub fn damage_on_disk(dir: &Path, needle: &str) {
    let mut damaged = 0;
    for path in walk(dir) {
        if path.extension().is_none_or(|e| e != "seg") {
            continue;
        }
        let mut bytes = std::fs::read(&path).expect("read segment");
        if let Some(at) = bytes
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
        {
            bytes[at + 3] ^= 0x40;
            std::fs::write(&path, &bytes).expect("rewrite segment");
            damaged += 1;
        }
    }
    assert_eq!(damaged, 1, "{needle} is in exactly one segment");
}
