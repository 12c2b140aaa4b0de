//! Part **cold** of `scenario functions`: from an event's arrival at sluice to the function
//! receiving it, with a cold instance (none running: sluice starts one for the event) and a
//! warm one, and sluice's own part of it.
//!
//! Run: sluice with the function at `min_instances = 0`, `max_instances = 1`, `idle =
//! cold_idle` (300 ms), `reply_topic = "reply/{topic}"`. A [`Probe`] subscribed to `reply/#`
//! publishes one event (QoS 0) per round at `t_pub` (CLOCK_REALTIME, just before the write)
//! and reads the reply at `t_reply`; the echo's body carries `recv_ns` (request read) and
//! `start_ns` (its `main` began) ([`super::echo`]). Cold rounds each wait first until
//! `sluice_function_instances` is 0 and sluice has no child process; warm rounds follow one
//! unmeasured event that starts the instance, 50 ms apart (well inside `idle`).
//!
//! Per event (exact, same clock): `publish → reply`, `publish → function` (`recv_ns −
//! t_pub`), and for cold rounds `publish → main` (`start_ns − t_pub`) and the function's own
//! start-up `main → request read` (`recv_ns − start_ns`).
//!
//! sluice's part, two ways:
//! 1. `sluice_function_dispatch_seconds` (arrival at sluice → request written to the instance),
//!    read before and after each phase, so the difference holds exactly that phase's events.
//!    With the socket handed over as fd 3, a function scaled to zero keeps its next
//!    instance's socket listening as a published standby, so the shard connects and writes
//!    the cold event's request into the backlog at once while the runtime starts the
//!    process: the figure holds sluice's work (the event's arrival, routing, the connection
//!    and the write), not the function's start-up.
//!    Exact mean (`_sum/_count`), quantiles only to a bucket (≤ bound: 50, 100, 250, 500,
//!    750 µs, 1, 1.5, 2, 2.5 ms …).
//! 2. From the compiled echo, per event: `publish → main` is sluice's arrival handling plus
//!    `fork`/`exec` and the loader of the function's binary — an upper bound of sluice's part
//!    that also holds the MQTT hop from the probe (loopback).

use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use serde::Serialize;

use super::echo::EchoReply;
use super::probe::Probe;
use super::prom::{BucketSummary, Buckets};
use super::{percentile, FnKind, FnSettings, FnSluice, FunctionsScenario, FUNCTION};

/// Milliseconds, p50 and p99 (nearest rank) and the count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Pcts {
    pub count: usize,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
}

impl Pcts {
    pub fn of(values_ms: &[f64]) -> Pcts {
        Pcts {
            count: values_ms.len(),
            p50_ms: percentile(values_ms, 0.5),
            p99_ms: percentile(values_ms, 0.99),
            max_ms: percentile(values_ms, 1.0),
        }
    }
}

/// One phase (cold or warm).
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub rounds: u32,
    /// Rounds that got no reply within the timeout.
    pub lost: u32,
    pub publish_to_reply: Pcts,
    pub publish_to_function: Pcts,
    /// Cold only: publish → the function's `main`.
    pub publish_to_main: Pcts,
    /// Cold only: the function's own start-up, `main` → request read.
    pub function_startup: Pcts,
    /// sluice's `dispatch_seconds` over the phase's events.
    pub sluice_dispatch: BucketSummary,
    /// sluice's `cold_start_seconds` over the phase (arrival → first answer).
    pub sluice_cold_start: BucketSummary,
    /// Distinct `start_ns` seen (cold: one instance per round; warm: 1).
    pub instances_seen: usize,
}

/// One function's cold and warm figures.
#[derive(Debug, Clone, Serialize)]
pub struct ColdResult {
    pub function: FnKind,
    pub placement: super::Placement,
    pub idle_ms: u64,
    pub cold: Phase,
    pub warm: Phase,
    /// The bench's own spawn of the same command → the function's `main`, `cold_rounds` times
    /// (std `Command::spawn` from a small process: fork/exec, the loader, an interpreter's or
    /// runtime's start): the part of `publish → main` that is the function's start-up.
    pub spawn_to_main: Pcts,
    /// p50 of cold `publish → main` − p50 of `spawn_to_main`: sluice's part of a cold start
    /// without the function's start-up (a difference of medians, not a per-event figure).
    pub sluice_part_p50_estimate_ms: Option<f64>,
    /// sluice's part ≤ 2 ms: the p99 bucket bound of the dispatch histogram, cold and warm,
    /// is ≤ 2 ms (a bucket bound is 2 ms).
    pub target_met: Option<bool>,
}

const REPLY_WAIT: Duration = Duration::from_secs(30);

pub async fn run(
    s: &FunctionsScenario,
    kind: FnKind,
    command: &[String],
) -> anyhow::Result<ColdResult> {
    eprintln!(
        "functions: cold start, {} function, {} cold and {} warm rounds",
        kind.name(),
        s.cold_rounds,
        s.warm_rounds
    );
    let sluice = FnSluice::start(
        s,
        &FnSettings {
            command: command.to_vec(),
            min_instances: 0,
            max_instances: 1,
            concurrency: 8,
            idle: s.cold_idle,
            reply_topic: "reply/{topic}".into(),
        },
    )
    .await?;
    let mut probe = Probe::connect(sluice.child.device_addr(), "fnb-cold-probe", "reply/#").await?;
    let wait_zero = (s.cold_idle * 4).max(Duration::from_secs(10)) + Duration::from_secs(10);

    // A remote function is never cold: only the warm phase runs.
    let cold_rounds = if sluice.is_local() { s.cold_rounds } else { 0 };
    let mut cold = Samples::default();
    let before = read_hists(&sluice).await?;
    for round in 0..cold_rounds {
        sluice.wait_instances("0", |n| n == 0.0, wait_zero).await?;
        cold.one(&mut probe, &format!("fnb/cold/{round}"), true)
            .await?;
    }
    let after_cold = read_hists(&sluice).await?;

    // Start the instance with one unmeasured event, then measure while it runs.
    if sluice.is_local() {
        sluice.wait_instances("0", |n| n == 0.0, wait_zero).await?;
    }
    let mut warm = Samples::default();
    warm.one(&mut probe, "fnb/warm/start", false).await?;
    let before_warm = read_hists(&sluice).await?;
    for round in 0..s.warm_rounds {
        tokio::time::sleep(Duration::from_millis(50)).await;
        warm.one(&mut probe, &format!("fnb/warm/{round}"), true)
            .await?;
    }
    let after_warm = read_hists(&sluice).await?;
    if probe.dropped() > 0 {
        bail!("the probe dropped {} replies", probe.dropped());
    }

    drop(sluice);
    let floor = if cold_rounds > 0 {
        spawn_floor(command, cold_rounds).await?
    } else {
        Vec::new()
    };
    let spawn_to_main = Pcts::of(&floor);
    let cold = cold.phase(cold_rounds, &before, &after_cold, true);
    let warm = warm.phase(s.warm_rounds, &before_warm, &after_warm, false);
    let target_met = match (
        cold.sluice_dispatch.p99_le_ms,
        warm.sluice_dispatch.p99_le_ms,
    ) {
        (Some(c), Some(w)) => Some(c <= 2.0 && w <= 2.0),
        (None, Some(w)) if cold_rounds == 0 => Some(w <= 2.0),
        _ => None,
    };
    let result = ColdResult {
        function: kind,
        placement: s.placement,
        idle_ms: s.cold_idle.as_millis() as u64,
        sluice_part_p50_estimate_ms: cold
            .publish_to_main
            .p50_ms
            .zip(spawn_to_main.p50_ms)
            .map(|(a, b)| a - b),
        spawn_to_main,
        cold,
        warm,
        target_met,
    };
    eprintln!(
        "functions: cold {}: publish→function p50 {:?} p99 {:?} ms cold, p50 {:?} p99 {:?} ms warm; sluice dispatch mean {:?} / {:?} ms",
        kind.name(),
        result.cold.publish_to_function.p50_ms,
        result.cold.publish_to_function.p99_ms,
        result.warm.publish_to_function.p50_ms,
        result.warm.publish_to_function.p99_ms,
        result.cold.sluice_dispatch.mean_ms,
        result.warm.sluice_dispatch.mean_ms,
    );
    Ok(result)
}

/// Spawn `command` (with `$PORT`) `rounds` times from the bench and read its `main`'s start
/// time from one request each: spawn → main, ms.
async fn spawn_floor(command: &[String], rounds: u32) -> anyhow::Result<Vec<f64>> {
    let mut out = Vec::new();
    for _ in 0..rounds {
        let t0 = crate::payload::unix_now_ns();
        let f = super::ExternalFn::start(command).await?;
        let port = f.port;
        let reply = tokio::task::spawn_blocking(move || post_once(port))
            .await
            .context("the floor's request panicked")??;
        out.push((reply.start_ns as f64 - t0 as f64) / 1e6);
    }
    Ok(out)
}

/// One POST to 127.0.0.1:`port`, its echo reply.
fn post_once(port: u16) -> anyhow::Result<EchoReply> {
    use std::io::{Read as _, Write as _};
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    tcp.write_all(
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
    )?;
    let mut buf = Vec::new();
    tcp.read_to_end(&mut buf)?;
    let body = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| &buf[i + 4..])
        .context("no HTTP head in the echo's answer")?;
    EchoReply::parse(body).context("the answer is not an echo's")
}

/// sluice's dispatch and cold-start histograms now.
async fn read_hists(sluice: &FnSluice) -> anyhow::Result<(Buckets, Buckets)> {
    let text = sluice.metrics().await?;
    let l = [("function", FUNCTION)];
    Ok((
        Buckets::read(&text, "sluice_function_dispatch_seconds", &l),
        Buckets::read(&text, "sluice_function_cold_start_seconds", &l),
    ))
}

/// Per-event times of one phase, ms.
#[derive(Default)]
struct Samples {
    to_reply: Vec<f64>,
    to_function: Vec<f64>,
    to_main: Vec<f64>,
    startup: Vec<f64>,
    starts: Vec<u64>,
    lost: u32,
}

impl Samples {
    /// Publish one event on `topic` and wait for its reply; recorded when `record`.
    async fn one(&mut self, probe: &mut Probe, topic: &str, record: bool) -> anyhow::Result<()> {
        probe.clear();
        let t_pub = probe
            .publish(topic, Bytes::from_static(b"{\"bench\":\"cold\"}"))
            .await?;
        let want = format!("reply/{topic}");
        let reply = loop {
            match probe.next(REPLY_WAIT).await {
                Ok(r) if r.topic == want => break Some(r),
                Ok(_) => continue,
                Err(e) if e.to_string().starts_with("no reply") => break None,
                Err(e) => return Err(e).context("waiting for the function's reply"),
            }
        };
        let Some(reply) = reply else {
            self.lost += 1;
            return Ok(());
        };
        let echo = EchoReply::parse(&reply.payload).with_context(|| {
            format!(
                "the reply on {want} is not an echo's: {:?}",
                String::from_utf8_lossy(&reply.payload)
            )
        })?;
        if record {
            let ms = |a: u64, b: u64| (a as f64 - b as f64) / 1e6;
            self.to_reply.push(ms(reply.at_ns, t_pub));
            self.to_function.push(ms(echo.recv_ns, t_pub));
            self.to_main.push(ms(echo.start_ns, t_pub));
            self.startup.push(ms(echo.recv_ns, echo.start_ns));
            self.starts.push(echo.start_ns);
        }
        Ok(())
    }

    fn phase(
        &self,
        rounds: u32,
        before: &(Buckets, Buckets),
        after: &(Buckets, Buckets),
        cold: bool,
    ) -> Phase {
        let mut starts = self.starts.clone();
        starts.sort_unstable();
        starts.dedup();
        let empty = Pcts::of(&[]);
        Phase {
            rounds,
            lost: self.lost,
            publish_to_reply: Pcts::of(&self.to_reply),
            publish_to_function: Pcts::of(&self.to_function),
            publish_to_main: if cold { Pcts::of(&self.to_main) } else { empty },
            function_startup: if cold { Pcts::of(&self.startup) } else { empty },
            sluice_dispatch: BucketSummary::from(&after.0.since(&before.0)),
            sluice_cold_start: BucketSummary::from(&after.1.since(&before.1)),
            instances_seen: starts.len(),
        }
    }
}
