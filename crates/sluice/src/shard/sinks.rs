//! A shard's sinks as things that start and stop: attaching one a reload added and detaching
//! one a reload removed (ADR 0013), through the shard's mailbox.
//!
//! Owns: [`RunningSink`] (a sink on this shard with its id, its own stop signal and its
//! session tasks), [`attach_sink`] and [`detach_sink`], and the shard's share of
//! `gateway.max_buffered` each time the number of sinks changes. Does not own: deciding what
//! is attached or removed and building what can fail (`app/reload.rs`), the sink itself
//! (`crate::sink`), or the router that offers messages to the list (`router.rs`).
//!
//! Invariants:
//! - The router's list is replaced, never mutated in place: a message being offered finishes
//!   against the list it started with.
//! - A detached sink takes no new message from the moment it leaves the list; what it holds
//!   is sent until the deadline, then its sessions stop (a clean DISCONNECT) and its queues
//!   are closed: every message still held — or still arriving from a device connection that
//!   was blocked on it — is acknowledged to its device with 0x10 and counted
//!   `uplink_removed` (`UplinkQueue::close_removed`). No device token is dropped, so no
//!   device connection closes.
//! - The sum of the queues stays within `max_buffered`: an attach lowers every queue to the
//!   new share before the new sink exists; a detach raises the others only after the removed
//!   one released everything.
//! - Detaching runs on its own task: the shard keeps serving devices while a sink drains.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use tokio::sync::watch;

use super::{router, Routed, ShardContext, ShardUplink};
use crate::app::uplinks::UplinkId;
use crate::config::UplinkConfig;
use crate::sink::{Lane, LaneMetrics, SessionSeed, UplinkQueue, UplinkRoute};

/// Everything a shard needs to run an uplink a reload added, built by the reload before it
/// is sent (nothing here can fail on the shard). MQTT uplinks (with or without `paths`, with
/// or without a spool), oneM2M uplinks and functions' sinks, without `install_tc` (the reload
/// keeps that restart-only).
pub struct AttachSink {
    pub id: UplinkId,
    pub cfg: Arc<UplinkConfig>,
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// This shard's lanes' counters (the admin's table holds the same `Arc`s).
    pub metrics: LaneMetrics,
    pub route: UplinkRoute,
    /// A function's sink: the function's handle (its runtime is started by the reload).
    pub function: Option<Arc<crate::functions::FunctionHandle>>,
    /// With `[spool] dir`: this shard's spool of the uplink, opened (and recovered) by the
    /// reload; the shard sets its share of `max_size` (see [`spool_shares`]).
    pub spool: Option<crate::sink::spool::OpenedSpool>,
    /// Answered once the sink is in the router's list and its tasks are spawned.
    pub done: tokio::sync::oneshot::Sender<()>,
}

impl std::fmt::Debug for AttachSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachSink")
            .field("id", &self.id)
            .field("uplink", &self.cfg.name)
            .finish_non_exhaustive()
    }
}

/// A reload removed a sink: stop offering it messages, drain it until `deadline`, then stop
/// it and acknowledge what is left (see the module docs).
#[derive(Debug)]
pub struct DetachSink {
    pub id: UplinkId,
    pub deadline: Instant,
    pub done: tokio::sync::oneshot::Sender<DetachReport>,
}

/// What a shard did with a removed sink.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DetachReport {
    /// The shard ran the sink (false: unknown id, nothing done).
    pub found: bool,
    /// Messages still held at the deadline, acknowledged to their devices unsent (0x10).
    pub removed_messages: u64,
    pub removed_bytes: u64,
    /// Everything was sent before the deadline.
    pub drained: bool,
}

/// A sink running on this shard.
pub(crate) struct RunningSink {
    pub id: UplinkId,
    pub name: String,
    pub sink: ShardUplink,
    /// Stops this sink's session tasks (the shard's shutdown sends it too).
    pub stop: watch::Sender<bool>,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Stops this sink's spool tasks, after its sessions (so the last acks are committed).
    pub spool_stop: watch::Sender<bool>,
    /// Its spools (this shard's and former shards' it drains) with their tasks.
    pub spools: Vec<SpoolTasks>,
}

/// One spool of a sink and its tasks.
pub(crate) type SpoolTasks = (
    Rc<crate::sink::spool::UplinkSpool>,
    Vec<tokio::task::JoinHandle<()>>,
);

/// How long spool tasks get to commit the last acks when they stop (as at shutdown).
pub(crate) const SPOOL_GRACE: Duration = Duration::from_secs(5);

/// The sinks a shard runs, in config order.
pub(crate) type Running = Rc<RefCell<Vec<RunningSink>>>;

/// The share of `gateway.max_buffered` of one lane of one of `sinks` sinks on this shard.
pub(crate) fn per_lane_bytes(ctx: &ShardContext, sinks: usize, lanes: u64) -> usize {
    let shards = ctx.mailboxes.len().max(1) as u64;
    (ctx.config.gateway.max_buffered.0 / shards / sinks.max(1) as u64 / lanes).max(64 * 1024)
        as usize
}

fn set_capacity(sinks: &[ShardUplink], bytes: usize) {
    for sink in sinks {
        sink.queue.set_capacity_bytes(bytes);
        if let Some(high) = &sink.high {
            high.set_capacity_bytes(bytes);
        }
    }
}

/// What a transport does with a cloud message on this shard: deliver it locally.
pub(crate) fn downlink(ctx: &Rc<ShardContext>) -> crate::sink::Downlink {
    let downlink_ctx = ctx.clone();
    Rc::new(move |p: crate::sink::CloudMessage| {
        let ctx = downlink_ctx.clone();
        Box::pin(async move {
            let routed = Routed {
                origin: ByteString::from_static(""),
                topic: p.topic,
                payload: p.payload,
                qos: p.qos,
                retain: false,
                properties: p.properties,
            };
            router::deliver_downlink(&ctx, routed).await;
        }) as crate::sink::DownlinkDelivery
    })
}

/// How a function's outbox publishes what the function answers: through this shard's router.
pub(crate) fn function_publish(ctx: &Rc<ShardContext>) -> crate::sink::http::Publish {
    let publish_ctx = ctx.clone();
    Rc::new(move |msg| {
        let ctx = publish_ctx.clone();
        Box::pin(async move { router::publish_from_function(&ctx, msg).await })
            as crate::sink::DownlinkDelivery
    })
}

/// Start a sink a reload added: lower every queue to the new share of `max_buffered`, build
/// the sink's queues, publish the new sink list to the router, spawn its lanes' sessions, and
/// answer.
pub(crate) fn attach_sink(
    ctx: &Rc<ShardContext>,
    running: &Running,
    attach: AttachSink,
    lanes: u64,
    links: &Option<crate::net::links::LinkWatch>,
) {
    let AttachSink {
        id,
        cfg,
        tls,
        metrics,
        route,
        function,
        spool,
        done,
    } = attach;
    let current = ctx.sinks();
    let per_lane = per_lane_bytes(ctx, current.len() + 1, lanes);
    set_capacity(&current, per_lane);
    let queue = Rc::new(UplinkQueue::with_metrics(per_lane, metrics.normal.clone()));
    let spool = spool.map(|opened| {
        let spool = crate::sink::spool::UplinkSpool::new(
            ctx.id,
            &cfg.name,
            &ctx.config,
            opened,
            queue.clone(),
        );
        spool_shares(ctx, running, &spool);
        spool
    });
    let mut feeders = crate::sink::outbox::Feeders::default();
    let (spool_stop, _) = watch::channel(false);
    let mut spools = Vec::new();
    if let Some(spool) = &spool {
        let weak = Rc::downgrade(spool);
        feeders.attach(
            ctx.config.spool.drain_share,
            Box::new(move |up| {
                if let Some(s) = weak.upgrade() {
                    s.link_changed(up);
                }
            }),
        );
        let tasks = spool.spawn_tasks(spool_stop.subscribe());
        spools.push((spool.clone(), tasks));
    }
    let high = metrics
        .high
        .as_ref()
        .map(|m| Rc::new(UplinkQueue::with_metrics(per_lane, m.clone())));
    let overflow = function
        .as_ref()
        .map(|_| Rc::new(crate::sink::http::Overflow::default()));
    let function = match (function, &overflow) {
        (Some(handle), Some(overflow)) => Some(crate::sink::http::FunctionSeed {
            handle,
            publish: function_publish(ctx),
            overflow: overflow.clone(),
        }),
        _ => None,
    };
    let sink = ShardUplink {
        route: route.clone(),
        queue: queue.clone(),
        high: high.clone(),
        spool,
        overflow,
    };
    let mut next: Vec<ShardUplink> = current.as_ref().clone();
    next.push(sink.clone());
    *ctx.uplinks.borrow_mut() = Rc::new(next);
    let (stop, stopped) = watch::channel(false);
    let downlink = downlink(ctx);
    let cfg = Rc::new(UplinkConfig::clone(&cfg));
    let mut tasks = vec![crate::sink::spawn(
        SessionSeed {
            shard: ctx.id,
            lane: Lane::Normal,
            cfg: cfg.clone(),
            tls: tls.clone(),
            queue,
            downlink: downlink.clone(),
            metrics: metrics.normal.clone(),
            live_devices: ctx.online_devices.clone(),
            on_port: None,
            feeders,
            links: links.clone(),
            function: function.clone(),
            route: route.clone(),
        },
        stopped.clone(),
    )];
    if let (Some(queue), Some(m)) = (high, &metrics.high) {
        tasks.push(crate::sink::spawn(
            SessionSeed {
                shard: ctx.id,
                lane: Lane::High,
                cfg: cfg.clone(),
                tls,
                queue,
                downlink,
                metrics: m.clone(),
                live_devices: ctx.online_devices.clone(),
                on_port: None,
                feeders: Default::default(),
                links: links.clone(),
                function,
                route,
            },
            stopped,
        ));
    }
    running.borrow_mut().push(RunningSink {
        id,
        name: cfg.name.clone(),
        sink,
        stop,
        tasks,
        spool_stop,
        spools,
    });
    let _ = done.send(());
}

/// Give `added`, a spool a reload opened on this shard, its share of `[spool] max_size`
/// (`max_size / shards`, split evenly over this shard's spools of running uplinks, the new
/// one included) and lower every other such spool to that share. A spool holding more than
/// the new share keeps it (its appends wait until acknowledgements bring it under), so the
/// new spool's bound is the share minus what the others hold above theirs — the spools
/// together stay within `max_size` — though never below two segments (the engine's minimum:
/// the one way they may pass `max_size`, by at most two segments per shard, while the others
/// drain). The new spool keeps that bound until a restart.
fn spool_shares(ctx: &ShardContext, running: &Running, added: &crate::sink::spool::UplinkSpool) {
    let shards = ctx.mailboxes.len().max(1) as u64;
    let budget = ctx.config.spool.max_size.as_u64() / shards;
    let others: Vec<Rc<crate::sink::spool::UplinkSpool>> = running
        .borrow()
        .iter()
        .flat_map(|r| r.spools.iter().map(|(s, _)| s.clone()))
        .filter(|s| !s.is_former())
        .collect();
    let share = budget / (others.len() as u64 + 1);
    let mut above = 0u64;
    for s in &others {
        s.set_max_bytes(share);
        above += s.total_bytes().saturating_sub(share);
    }
    let got = added.set_max_bytes(share.saturating_sub(above));
    tracing::info!(
        shard = ctx.id,
        share,
        bound = got,
        spools = others.len() + 1,
        "spool of an added uplink opened; each spool's share of spool.max_size lowered"
    );
}

/// How often a draining sink is checked for being empty (a rare, control-side wait).
const DRAIN_POLL: Duration = Duration::from_millis(20);
/// How long a removed sink's sessions get to say goodbye (as at shutdown).
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Remove a sink (see the module docs); runs on its own task, answers `done` at the end.
pub(crate) async fn detach_sink(
    ctx: Rc<ShardContext>,
    running: Running,
    detach: DetachSink,
    lanes: u64,
) {
    let DetachSink { id, deadline, done } = detach;
    let found = {
        let mut r = running.borrow_mut();
        r.iter().position(|s| s.id == id).map(|at| r.remove(at))
    };
    let Some(mut rs) = found else {
        let _ = done.send(DetachReport::default());
        return;
    };
    // 1. No new message is offered to it.
    let next: Vec<ShardUplink> = ctx
        .sinks()
        .iter()
        .filter(|s| !Rc::ptr_eq(&s.queue, &rs.sink.queue))
        .cloned()
        .collect();
    *ctx.uplinks.borrow_mut() = Rc::new(next);
    // 2. What it holds is sent until the deadline.
    let queues: Vec<Rc<UplinkQueue>> = std::iter::once(rs.sink.queue.clone())
        .chain(rs.sink.high.clone())
        .collect();
    let held = |qs: &[Rc<UplinkQueue>]| qs.iter().any(|q| q.reserved_bytes() > 0);
    while held(&queues) && Instant::now() < deadline {
        tokio::time::sleep(DRAIN_POLL.min(deadline.saturating_duration_since(Instant::now())))
            .await;
    }
    let drained = !held(&queues);
    // 3. Its sessions stop (unacknowledged messages go back to its queues).
    let _ = rs.stop.send(true);
    for t in rs.tasks {
        let _ = tokio::time::timeout(STOP_GRACE, t).await;
    }
    // Its spools stop after the sessions (the last acks are committed); their directories
    // stay on disk with what was not sent.
    let _ = rs.spool_stop.send(true);
    for (_, tasks) in rs.spools.iter_mut() {
        for t in tasks.iter_mut() {
            let _ = tokio::time::timeout(SPOOL_GRACE, t).await;
        }
    }
    // 4. What is left is acknowledged unsent (0x10), counted; a function's overflow and the
    // device tokens its spools still hold too.
    for q in &queues {
        q.close_removed();
    }
    for (spool, _) in &rs.spools {
        for token in spool.take_device_tokens() {
            rs.sink.queue.finish_removed_token(token);
        }
        {
            tracing::warn!(
                shard = ctx.id,
                uplink = %rs.name,
                dir = %spool.dir().display(),
                "spool directory of a removed uplink left on disk with what it did not send (an uplink configured again under this name sends it)"
            );
        }
    }
    if let Some(overflow) = &rs.sink.overflow {
        let left: Vec<crate::sink::UplinkMessage> = overflow.msgs.borrow_mut().drain(..).collect();
        for msg in left {
            // A closed queue finishes it at once (0x10, counted).
            let _ = rs.sink.queue.try_push(msg);
        }
    }
    let (messages, bytes) = queues.iter().fold((0, 0), |(n, b), q| {
        let (qn, qb) = q.removed();
        (n + qn, b + qb)
    });
    if messages > 0 {
        tracing::warn!(
            shard = ctx.id,
            uplink = %rs.name,
            id = id.0,
            messages,
            bytes,
            "removed uplink still held messages at the drain deadline; they were acknowledged to their devices unsent (reason 0x10)"
        );
    }
    // 5. The others get the freed share.
    let rest = ctx.sinks();
    set_capacity(&rest, per_lane_bytes(&ctx, rest.len(), lanes));
    let _ = done.send(DetachReport {
        found: true,
        removed_messages: messages,
        removed_bytes: bytes,
        drained,
    });
}

/// Stop every running sink's spool tasks (the shard stops, after the sessions) and return
/// them.
pub(crate) fn stop_spools(running: &Running) -> Vec<tokio::task::JoinHandle<()>> {
    let mut out = Vec::new();
    for rs in running.borrow_mut().iter_mut() {
        let _ = rs.spool_stop.send(true);
        for (_, tasks) in &mut rs.spools {
            out.append(tasks);
        }
    }
    out
}

/// Stop every running sink's sessions (the shard stops) and return their tasks.
pub(crate) fn stop_all(running: &Running) -> Vec<tokio::task::JoinHandle<()>> {
    let mut out = Vec::new();
    for rs in running.borrow_mut().iter_mut() {
        let _ = rs.stop.send(true);
        out.append(&mut rs.tasks);
    }
    out
}
