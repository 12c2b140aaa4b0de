//! The cases that probe one behaviour beside the load: the clock steps (libfaketime's
//! timestamp file, re-read on every call), retained messages and a persistent session across a
//! `kill -9`, and PINGRESP for an MQTT 3.1.1 device pushed past its limit while the cloud is
//! down.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{Packet, Properties, Publish, QoS};
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::time::Instant;

use super::super::bed::Bed;
use super::super::load::Load;
use super::super::pause;
use super::Outcome;
use crate::harness::metrics::metric_sum;

/// Whether `sluice check` accepts a `[state] dir` (branch `state`); without it sluice rejects
/// the unknown table and the case runs without it.
pub fn binary_accepts_state_dir(bin: &Path, dir: &Path) -> bool {
    let Ok(t) = tempfile::tempdir() else {
        return false;
    };
    let cfg = t.path().join("c.toml");
    let text = format!("[state]\ndir = \"{}\"\n", dir.display());
    if std::fs::write(&cfg, text).is_err() {
        return false;
    }
    std::process::Command::new(bin)
        .arg("check")
        .arg("-c")
        .arg(&cfg)
        .output()
        .is_ok_and(|o| o.status.success())
}

pub(crate) async fn clock_step(
    bed: &mut Bed,
    file: Option<&Path>,
    o: &mut Outcome,
) -> anyhow::Result<()> {
    let file = file.context("no faketime file")?;
    // Message expiry across the steps: retained messages with a 10-minute expiry (a +1 h step
    // must not expire them) and with a 3-second one (it must expire on time, whatever the
    // wall clock did: no stuck timer).
    let (mut publisher, _) =
        TestClient::connect(bed.mqtt(), ConnectOpts::v5("faults-expiry-pub")).await?;
    for (i, expiry) in [(0u16, 600u32), (1, 600), (2, 3), (3, 3)] {
        let id = 100 + i;
        publisher
            .send_packet(&Packet::Publish(Publish {
                dup: false,
                qos: QoS::AtLeastOnce,
                retain: true,
                topic: ByteString::from(format!("faults/expiry/{expiry}/{i}")),
                packet_id: Some(id),
                properties: Some(Box::new(Properties {
                    message_expiry_interval: Some(expiry),
                    ..Properties::default()
                })),
                payload: Bytes::from(format!("e{i}")),
            }))
            .await?;
        publisher
            .wait_ack(id)
            .await
            .context("a retained publish with an expiry")?;
    }
    let published = Instant::now();
    let m0 = bed.metrics().await;
    let warn0 = bed.sluice.stderr_count("WARN") + bed.sluice.stderr_count("ERROR");
    let mut steps = Vec::new();
    for (offset, label) in [
        ("+3600", "+1 h"),
        ("+0", "back"),
        ("-3600", "−1 h"),
        ("+0", "back"),
    ] {
        std::fs::write(file, format!("{offset}\n")).context("writing the faketime file")?;
        let t = Instant::now();
        let mut min_connected = u32::MAX;
        while t.elapsed() < Duration::from_secs(8) {
            min_connected = min_connected.min(bed.uplinks_connected().await);
            pause(Duration::from_millis(200)).await;
        }
        steps.push(format!(
            "{label}: fewest uplink sessions connected {min_connected}"
        ));
    }
    // After the steps (32 s): the 10-minute ones are there with what is left of their
    // interval, the 3-second ones are gone.
    let (mut reader, _) =
        TestClient::connect(bed.mqtt(), ConnectOpts::v5("faults-expiry-sub")).await?;
    reader
        .subscribe(&[("faults/expiry/#", QoS::AtLeastOnce)])
        .await?;
    let mut kept = Vec::new();
    while let Some(p) = reader.recv(Duration::from_secs(2)).await? {
        let left = p
            .properties
            .as_ref()
            .and_then(|pr| pr.message_expiry_interval);
        kept.push((p.topic.to_string(), left));
    }
    let elapsed = published.elapsed().as_secs_f64();
    let long_ok = kept
        .iter()
        .filter(|(t, left)| {
            t.starts_with("faults/expiry/600/")
                && left
                    .is_some_and(|l| f64::from(l) <= 600.0 && f64::from(l) >= 600.0 - elapsed - 2.0)
        })
        .count();
    let short_left = kept
        .iter()
        .filter(|(t, _)| t.starts_with("faults/expiry/3/"))
        .count();
    o.observed.push(format!(
        "message expiry: 2 retained with 600 s and 2 with 3 s before the steps; {elapsed:.0} s later {long_ok}/2 of the 600 s ones there with their remaining interval ({}), {short_left}/2 of the 3 s ones still there",
        kept.iter()
            .filter(|(t, _)| t.starts_with("faults/expiry/600/"))
            .map(|(_, l)| l.map_or("none".to_string(), |l| format!("{l} s")))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let expiry_ok = long_ok == 2 && short_left == 0;
    let m1 = bed.metrics().await;
    let d = |n: &str| metric_sum(&m1, n).unwrap_or(0.0) - metric_sum(&m0, n).unwrap_or(0.0);
    let connects = d("sluice_uplink_connects_total");
    let warns = bed.sluice.stderr_count("WARN") + bed.sluice.stderr_count("ERROR") - warn0;
    o.observed.push(format!(
        "sluice under libfaketime (FAKETIME_TIMESTAMP_FILE, monotonic clock not faked), 8 s per step; {}",
        steps.join("; ")
    ));
    o.observed.push(format!(
        "during the steps: uplink connects {connects}, device connections closed {}, sessions evicted {}, WARN/ERROR log lines {warns}",
        d("sluice_mqtt_connections_closed_total"),
        d("sluice_mqtt_sessions_evicted_total"),
    ));
    o.check = "no uplink reconnect, no device connection closed, no WARN/ERROR line; no message expired early, none kept late".to_string();
    o.check_met = connects == 0.0
        && warns == 0
        && d("sluice_mqtt_connections_closed_total") == 0.0
        && expiry_ok;
    Ok(())
}

const RETAINED: u32 = 50;
const QUEUED: u32 = 50;

pub(crate) async fn restart_state(
    bed: &mut Bed,
    load: &mut Load,
    with_state_dir: bool,
    o: &mut Outcome,
) -> anyhow::Result<()> {
    // A persistent session, subscribed, then offline.
    let mut opts = ConnectOpts::v311("faults-state-sub");
    opts.clean_start = false;
    let (mut sub, _) = TestClient::connect(bed.mqtt(), opts.clone()).await?;
    sub.subscribe(&[("state/q/#", QoS::AtLeastOnce)]).await?;
    sub.disconnect().await?;
    // Retained messages and messages queued for the offline session, all acknowledged.
    let (mut publisher, _) =
        TestClient::connect(bed.mqtt(), ConnectOpts::v311("faults-state-pub")).await?;
    for i in 0..RETAINED {
        publisher
            .publish(
                &format!("state/r/{i}"),
                format!("r{i}"),
                QoS::AtLeastOnce,
                true,
            )
            .await
            .context("a retained publish")?;
    }
    for i in 0..QUEUED {
        publisher
            .publish(
                &format!("state/q/{i}"),
                format!("q{i}"),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .context("a queued publish")?;
    }
    let _ = publisher.disconnect().await;
    pause(Duration::from_millis(500)).await;
    bed.sluice.kill_9();
    bed.sluice.start()?;
    bed.sluice.wait_ready().await?;
    load.reassociate_phd().await?;
    // After the restart: the retained messages, and the session with its queue.
    let (mut fresh, _) =
        TestClient::connect(bed.mqtt(), ConnectOpts::v311("faults-state-fresh")).await?;
    fresh.subscribe(&[("state/r/#", QoS::AtLeastOnce)]).await?;
    let mut retained = 0;
    while let Ok(Some(p)) = fresh.recv(Duration::from_secs(2)).await {
        if p.retain {
            retained += 1;
        }
    }
    let (mut sub, connack) = TestClient::connect(bed.mqtt(), opts).await?;
    let mut queued = 0;
    while let Ok(Some(_)) = sub.recv(Duration::from_secs(2)).await {
        queued += 1;
    }
    o.observed.push(format!(
        "{} ; before kill -9: {RETAINED} retained messages and {QUEUED} QoS 1 messages for an offline persistent session (clean session 0), all PUBACKed; after: {retained} retained delivered to a new subscriber, session present = {}, {queued} queued messages delivered",
        if with_state_dir { "[state] dir set" } else { "binary has no [state] dir (sluice check refuses it): state in memory only" },
        connack.session_present,
    ));
    o.check =
        format!("all {RETAINED} retained and {QUEUED} queued messages there after the restart");
    o.check_met = retained == RETAINED && queued == QUEUED && connack.session_present;
    Ok(())
}

pub(crate) async fn pingresp(bed: &mut Bed, o: &mut Outcome) -> anyhow::Result<()> {
    let keep_alive: u16 = 4;
    bed.net.cut(0).map_err(anyhow::Error::msg)?;
    // The check: a device with an inflight window, as MQTT clients have (paho and libmosquitto
    // default to 20 and let it be raised), here 100 against the gateway's receive_maximum of 64,
    // so 36 PUBLISHes (about 8 KiB) and then its PINGREQs wait unread behind the limit.
    let windowed = ping_probe(bed, "faults-ping", WINDOW, 200, keep_alive).await?;
    // The limit beside it: a device without any window writes 768 KiB at once; the kernel's
    // socket buffers take most of it, so its PINGREQ sits hundreds of KiB behind the limit,
    // beyond any bounded read-ahead (mqtt READ_AHEAD_BYTES, 16 KiB, docs/memory.md).
    let flood = ping_probe(bed, "faults-ping-flood", 768, 1024, keep_alive).await?;
    bed.net.restore(0).map_err(anyhow::Error::msg)?;
    o.observed.push(format!(
        "cloud link cut; [mqtt] receive_maximum = 64; a 3.1.1 device (keep-alive {keep_alive} s) with a window of {WINDOW} QoS 1 PUBLISHes × 200 B wrote {}; then PINGREQ every {} s for {} s: {}",
        windowed.pushed(),
        keep_alive / 2,
        3 * keep_alive,
        windowed.summary(),
    ));
    o.observed.push(format!(
        "the limit, not part of the check: a second 3.1.1 device without a window, 1 KiB QoS 1 PUBLISHes, wrote {} (its PINGREQ behind ~{} KiB unread, beyond the 16 KiB read-ahead): {}",
        flood.pushed(),
        768 - 64,
        flood.summary(),
    ));
    o.check = format!(
        "a device with a {WINDOW}-message window past receive_maximum 64: every PINGREQ answered within the keep-alive and the connection kept"
    );
    o.check_met = windowed.passed();
    Ok(())
}

/// The windowed device's inflight window (more than the gateway's `receive_maximum`).
const WINDOW: u16 = 100;

struct PingProbe {
    count: u16,
    pushed_ok: bool,
    answered: u32,
    asked: u32,
    slowest: Option<Duration>,
    first_error: Option<String>,
    alive: bool,
}

impl PingProbe {
    fn passed(&self) -> bool {
        self.pushed_ok && self.asked > 0 && self.answered == self.asked && self.alive
    }

    fn pushed(&self) -> String {
        if self.pushed_ok {
            format!("{} without waiting", self.count)
        } else {
            "NOT all (writes blocked 10 s: sluice stopped reading)".to_string()
        }
    }

    fn summary(&self) -> String {
        format!(
            "{}/{} answered (slowest {}){}; connection alive at the end: {}",
            self.answered,
            self.asked,
            self.slowest.map_or("–".to_string(), |d| format!(
                "{:.0} ms",
                d.as_secs_f64() * 1e3
            )),
            self.first_error
                .as_ref()
                .map(|e| format!("; first failure: {e}"))
                .unwrap_or_default(),
            if self.alive { "yes" } else { "no" },
        )
    }
}

/// One 3.1.1 device: `count` QoS 1 PUBLISHes of `size` bytes written at once (none is
/// acknowledged: the cloud is away and there is no spool), then a PINGREQ every half
/// keep-alive for three keep-alives.
async fn ping_probe(
    bed: &Bed,
    client_id: &str,
    count: u16,
    size: usize,
    keep_alive: u16,
) -> anyhow::Result<PingProbe> {
    let mut opts = ConnectOpts::v311(client_id);
    opts.keep_alive = keep_alive;
    let (mut c, _) = TestClient::connect(bed.mqtt(), opts).await?;
    c.set_ack_timeout(Duration::from_secs(u64::from(keep_alive)));
    let topic = ByteString::from(format!("faults/ping/{client_id}"));
    let payload = Bytes::from(vec![b'p'; size]);
    let pushed = tokio::time::timeout(Duration::from_secs(10), async {
        for id in 1..=count {
            c.send_packet(&Packet::Publish(Publish {
                dup: false,
                qos: QoS::AtLeastOnce,
                retain: false,
                topic: topic.clone(),
                packet_id: Some(id),
                properties: None,
                payload: payload.clone(),
            }))
            .await?;
        }
        anyhow::Ok(())
    })
    .await;
    let mut p = PingProbe {
        count,
        pushed_ok: matches!(pushed, Ok(Ok(()))),
        answered: 0,
        asked: 0,
        slowest: None,
        first_error: None,
        alive: false,
    };
    if p.pushed_ok {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3 * u64::from(keep_alive)) {
            pause(Duration::from_secs(u64::from(keep_alive) / 2)).await;
            p.asked += 1;
            match c.ping().await {
                Ok(rtt) => {
                    p.answered += 1;
                    p.slowest = p.slowest.max(Some(rtt));
                }
                Err(e) => {
                    p.first_error.get_or_insert(format!("{e:#}"));
                    if c.expect_closed(Duration::from_millis(10)).await {
                        break;
                    }
                }
            }
        }
    }
    p.alive = p.pushed_ok && c.ping().await.is_ok();
    Ok(p)
}
