//! The crowd case: many connections, some of them slow readers subscribed to busy topics.
//! `connections` MQTT connections in all — the load's devices, idle connections
//! ([`crate::load::idle`]) and `slow` subscribers that subscribe (QoS 1) to one busy device
//! topic each and then never read — against a sluice with `max_queued_bytes` and
//! `max_outbox_memory` set small. Measured: sluice's RSS before and with the crowd (peak,
//! sampled every 500 ms), and the healthy MQTT devices' PUBLISH → PUBACK p99 over a baseline
//! window vs a window with the crowd connected.
//!
//! Bounds: the open-file limit of this process (16,000 device sockets plus its own) and of
//! sluice (as many plus its own) are each checked against the need first.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Duration;

use sluice_proto::mqtt::QoS;
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::super::bed::Bed;
use super::super::load::Load;
use super::super::pause;
use super::Outcome;
use crate::harness::procfs::{rss_kib, Pid};
use crate::load::idle::{IdleConfig, IdleFleet};

/// `[gateway] max_outbox_memory` and `[mqtt] max_queued_bytes` of the crowd's sluice.
pub const OUTBOX_MEMORY_MIB: u64 = 32;
pub const QUEUED_KIB: u64 = 64;
/// Allowed per connection beyond the outbox bound (session state, read buffer), KiB.
pub const PER_CONNECTION_KIB: u64 = 16;
/// Healthy p99 with the crowd ≤ this × baseline p99 + [`P99_SLACK_MS`].
pub const P99_FACTOR: f64 = 2.0;
pub const P99_SLACK_MS: f64 = 5.0;

fn open_files_limit() -> u64 {
    std::fs::read_to_string("/proc/self/limits")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .unwrap_or(0)
}

pub(crate) async fn slow_readers(
    bed: &mut Bed,
    load: &Load,
    connections: u32,
    slow: u32,
    busy_topics: u32,
    o: &mut Outcome,
) -> anyhow::Result<()> {
    let limit = open_files_limit();
    anyhow::ensure!(
        u64::from(connections) + 512 <= limit,
        "open-file limit {limit} is below the {connections} connections + 512 this process needs (raise ulimit -n)"
    );
    let pid = bed.sluice.pid().unwrap_or(0);
    let rss = || rss_kib(Pid::Other(pid)).unwrap_or(0);
    let _ = load.mqtt.take_window();
    pause(Duration::from_secs(10)).await;
    let baseline = load.mqtt.take_window();
    let rss_before = rss();
    let idle = connections.saturating_sub(slow);
    let t = Instant::now();
    let mut cfg = IdleConfig::new(bed.mqtt(), idle);
    cfg.client_prefix = "faults-idle".to_string();
    cfg.concurrency = 128;
    let fleet = IdleFleet::open(cfg);
    let mut readers = JoinSet::new();
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    let ok = std::sync::Arc::new(AtomicU32::new(0));
    let failed = std::sync::Arc::new(AtomicU32::new(0));
    for i in 0..slow {
        let (addr, stop, sem) = (bed.mqtt(), stop.clone(), sem.clone());
        let (ok, failed) = (ok.clone(), failed.clone());
        let topic = format!("faults/m/{}", i % busy_topics.max(1));
        readers.spawn(async move {
            let permit = sem.acquire_owned().await;
            let mut opts = ConnectOpts::v311(format!("faults-slow-{i}"));
            opts.keep_alive = 0;
            let Ok((mut c, ack)) = TestClient::connect(addr, opts).await else {
                failed.fetch_add(1, Relaxed);
                return false;
            };
            if ack.code != 0
                || c.subscribe(&[(topic.as_str(), QoS::AtLeastOnce)])
                    .await
                    .is_err()
            {
                failed.fetch_add(1, Relaxed);
                return false;
            }
            ok.fetch_add(1, Relaxed);
            drop(permit);
            // Never read again: sluice's writes fill the socket, then its queue for us.
            stop.notified().await;
            drop(c);
            true
        });
    }
    let idle_report = fleet.wait_connected().await;
    let mut peak = rss();
    while ok.load(Relaxed) + failed.load(Relaxed) < slow && t.elapsed() < Duration::from_secs(120) {
        pause(Duration::from_millis(100)).await;
    }
    let connected_in = t.elapsed();
    let _ = load.mqtt.take_window();
    let w = Instant::now();
    while w.elapsed() < Duration::from_secs(15) {
        peak = peak.max(rss());
        pause(Duration::from_millis(500)).await;
    }
    let during = load.mqtt.take_window();
    peak = peak.max(rss());
    let metrics = bed.metrics().await;
    let refused = crate::harness::metrics::metric_sum(&metrics, "sluice_mqtt_queue_refused_total")
        .unwrap_or(0.0);
    stop.notify_waiters();
    let (subscribed, slow_failed) = (ok.load(Relaxed), failed.load(Relaxed));
    readers.abort_all();
    while readers.join_next().await.is_some() {}
    let _ = fleet.close().await;
    let growth = peak.saturating_sub(rss_before);
    let bound = OUTBOX_MEMORY_MIB * 1024 + u64::from(connections) * PER_CONNECTION_KIB;
    o.observed.push(format!(
        "{} idle connections held ({} failed) and {subscribed} of {slow} slow readers ({slow_failed} failed; QoS 1 on {busy_topics} busy device topics, never reading) connected in {:.1} s; open-file limit here {limit}",
        idle_report.connected,
        idle_report.failed,
        connected_in.as_secs_f64(),
    ));
    o.observed.push(format!(
        "sluice RSS {:.1} MiB before → peak {:.1} MiB with the crowd (growth {:.1} MiB; bound {} MiB outbox + {} KiB × {connections} connections = {:.1} MiB); messages refused to full queues: {refused}",
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0,
        growth as f64 / 1024.0,
        OUTBOX_MEMORY_MIB,
        PER_CONNECTION_KIB,
        bound as f64 / 1024.0,
    ));
    o.observed.push(format!(
        "healthy MQTT devices' p99 (PUBLISH → PUBACK): {:.1} ms baseline (10 s) → {:.1} ms with the crowd (15 s, {} acks)",
        baseline.p99_ms, during.p99_ms, during.count
    ));
    o.check = format!(
        "RSS growth ≤ bound; p99 ≤ {P99_FACTOR} × baseline + {P99_SLACK_MS} ms; every connection held"
    );
    o.check_met = growth <= bound
        && during.count > 0
        && during.p99_ms <= P99_FACTOR * baseline.p99_ms + P99_SLACK_MS
        && idle_report.failed == 0
        && slow_failed == 0;
    Ok(())
}
