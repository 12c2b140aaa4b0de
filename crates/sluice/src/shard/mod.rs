//! The per-core data plane.
//!
//! Owns: one OS thread per shard, pinned to a core, running a single-threaded tokio runtime
//! (no work stealing); the device connections placed on it; their sessions and subscriptions;
//! and the shard's own uplink sessions to the cloud. Does not own: admission (control/), the
//! global view of which shard subscribes to what (a read-mostly snapshot published by the
//! control plane), or the retained-message store (control/).
//!
//! Invariants: shards share nothing mutable. They talk to each other and to the control
//! plane only through bounded mailboxes (`tokio::sync::mpsc` with `mailbox_capacity`); QoS 0
//! traffic finding a mailbox full is dropped and counted, QoS 1/2 waits (back-pressure on the
//! publishing device). Everything inside a shard is `Rc`/`RefCell` on one thread.

pub mod hash;
pub mod limits;
pub mod metrics;
pub(crate) mod router;
pub(crate) mod sinks;
pub mod subscriber;
pub mod trie;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use sluice_proto::mqtt::{Connect, Properties, QoS, SubscriptionOptions};
use tokio::sync::{mpsc, watch};

use crate::config::{Config, UplinkConfig};
use crate::control::{ControlCmd, SharedSnapshot};
use crate::edge::mqtt::session::Session;
use crate::sink::{Lane, LaneMetrics, SessionSeed, UplinkQueue, UplinkRoute};
use metrics::ShardMetrics;
use trie::TopicTrie;

pub use sinks::{AttachSink, DetachReport, DetachSink};

pub type ShardId = usize;

/// A device connection admitted by the control plane, handed to its shard.
#[derive(Debug)]
pub struct Adopted {
    /// The socket, with its TLS session and WebSocket state when it has them
    /// (`edge::mqtt::stream`).
    pub stream: crate::edge::mqtt::stream::DetachedStream,
    pub peer: SocketAddr,
    /// The identity admission trusts: the CONNECT's username, or with `identity_from_cert`
    /// the client certificate's name.
    pub username: Option<bytestring::ByteString>,
    /// `username` came from a verified client certificate (`[mqtt.tls] identity_from_cert`).
    pub username_from_cert: bool,
    pub connect: Connect,
    /// Bytes read after the CONNECT packet (the device may pipeline).
    pub buffered: BytesMut,
    /// The gateway chose the client id (the device sent an empty one).
    pub assigned_client_id: bool,
}

impl Adopted {
    /// The username the ACL's `users` globs and `%u` see: the one place that says where a
    /// device's username comes from (today the CONNECT's login).
    pub fn acl_username(connect: &Connect) -> Option<&str> {
        connect.username.as_deref()
    }
}

/// A message routed from one shard to the subscribers on another.
#[derive(Debug, Clone)]
pub struct Routed {
    pub origin: ByteString,
    pub topic: ByteString,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    pub properties: Option<Box<Properties>>,
}

#[derive(Debug)]
pub enum ShardCmd {
    Adopt(Box<Adopted>),
    Deliver(Routed),
    /// Input bounds: end an offline session for another shard's device at `max_sessions`.
    EvictOffline(tokio::sync::oneshot::Sender<bool>),
    /// Deliver to one local member of the shared subscription `key` (`$share/{group}/{filter}`).
    DeliverShared(Routed, ByteString),
    /// A CoAP datagram another shard's socket read for a device of this shard (steering,
    /// `crate::edge::coap::server`); answered from this shard's own socket.
    /// Decoded once, where it was read; boxed to keep the command small.
    CoapDatagram(Box<crate::edge::coap::server::Steered>),
    /// An operating IEEE 11073 agent whose data this shard handles (`crate::edge::phd`).
    PhdAdopt(Box<crate::edge::phd::Handover>),
    /// A reload added an uplink: start its sink on this shard (ADR 0013).
    AttachSink(Box<AttachSink>),
    /// A reload removed an uplink or a function: drain and stop its sink on this shard.
    DetachSink(Box<DetachSink>),
}

/// A subscription of a local subscriber (an MQTT session, a CoAP observer).
#[derive(Clone)]
pub struct LocalSub {
    pub subscriber: Rc<dyn subscriber::LocalSubscriber>,
    pub options: SubscriptionOptions,
    /// MQTT 5 Subscription Identifier of the SUBSCRIBE that made it (0: none).
    pub sub_id: u32,
}

impl PartialEq for LocalSub {
    fn eq(&self, other: &Self) -> bool {
        subscriber::same(&self.subscriber, &other.subscriber)
    }
}

impl std::fmt::Debug for LocalSub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalSub")
            .field("subscriber", &self.subscriber.subscriber_id())
            .field("options", &self.options)
            .field("sub_id", &self.sub_id)
            .finish()
    }
}

/// The local members of one shared subscription, and whose turn it is.
#[derive(Debug, Default)]
pub struct SharedMembers {
    pub members: Vec<LocalSub>,
    pub next: usize,
}

/// One uplink as seen from a shard (now `crate::sink::Sink`, which the router offers each
/// message to; the old name stays for the start-up code).
pub type ShardUplink = crate::sink::Sink;

/// What every task on a shard shares.
pub struct ShardContext {
    pub id: ShardId,
    pub config: Arc<Config>,
    pub mailboxes: Vec<mpsc::Sender<ShardCmd>>,
    pub control: mpsc::Sender<ControlCmd>,
    pub snapshot: SharedSnapshot,
    pub subs: RefCell<TopicTrie<LocalSub>>,
    /// Local subscriptions per filter, to tell the control plane on 0→1 and 1→0 only.
    pub filter_refs: RefCell<HashMap<ByteString, usize>>,
    pub sessions: RefCell<HashMap<ByteString, Rc<Session>>>,
    /// The sinks the router offers each message to, in config order. Replaced (never
    /// mutated in place) when a reload attaches one: the router clones the `Rc` per message,
    /// so no borrow is held across an offer's `await` ([`ShardContext::sinks`]).
    pub uplinks: RefCell<Rc<Vec<ShardUplink>>>,
    /// The priority table and `[limits]` publish rate, read without a lock; a reload
    /// publishes new ones (`control/live.rs`).
    pub rules: Arc<crate::control::live::Rules>,
    /// `[acl]`, read without a lock (`control/acl/`).
    pub acl: Arc<crate::control::acl::Acl>,
    /// `[limits]` counters (per-device publish rates).
    pub limits: Arc<crate::control::limits::LimitsMetrics>,
    pub metrics: Arc<ShardMetrics>,
    /// Open device connections, whole gateway, including ones still before CONNECT
    /// (admission bound).
    pub live_connections: Arc<AtomicUsize>,
    /// Devices connected (admitted and on a shard), whole gateway: aggregation threshold.
    pub online_devices: Arc<AtomicUsize>,
    /// Set once when the gateway stops; connections see it when their session is woken.
    pub shutting_down: std::cell::Cell<bool>,
    /// Input bounds: queued-bytes budget and the gateway-wide session count.
    pub bounds: limits::ShardBounds,
    /// Counts local fan-outs; each stamps the sessions it reached (`router::deliver_local`).
    pub delivery_seq: std::cell::Cell<u64>,
    /// Shared subscriptions with members on this shard, by `$share/{group}/{filter}`.
    pub shared: RefCell<HashMap<ByteString, SharedMembers>>,
    /// Round-robin counter for picking a shard of a shared subscription.
    pub share_turn: std::cell::Cell<usize>,
    /// The CoAP proxy's upstream connections of this shard (`[[coap.proxy]]`).
    pub proxies: crate::proxy::ShardProxies,
    /// `[state] dir`: where persistent sessions log their changes (`crate::state`).
    pub state: Option<crate::state::StateLog>,
}

impl ShardContext {
    /// The sinks now (one `Rc` clone): a message is offered to the list it started with.
    pub fn sinks(&self) -> Rc<Vec<ShardUplink>> {
        self.uplinks.borrow().clone()
    }
}

/// Everything a shard thread needs to start; `Send` so it can cross into the thread.
pub struct ShardSeed {
    pub id: ShardId,
    pub config: Arc<Config>,
    pub mailboxes: Vec<mpsc::Sender<ShardCmd>>,
    pub inbox: mpsc::Receiver<ShardCmd>,
    pub control: mpsc::Sender<ControlCmd>,
    pub snapshot: SharedSnapshot,
    pub metrics: Arc<ShardMetrics>,
    pub rules: Arc<crate::control::live::Rules>,
    pub acl: Arc<crate::control::acl::Acl>,
    pub limits: Arc<crate::control::limits::LimitsMetrics>,
    pub uplink_metrics: Vec<LaneMetrics>,
    pub uplink_tls: Vec<Option<Arc<rustls::ClientConfig>>>,
    /// Per uplink, told the high lane's source port on connect (`install_tc`).
    pub uplink_ports: Vec<Option<crate::sink::PortSink>>,
    pub live_connections: Arc<AtomicUsize>,
    pub online_devices: Arc<AtomicUsize>,
    pub shutdown: watch::Receiver<bool>,
    pub core: Option<core_affinity::CoreId>,
    /// Per uplink, this shard's spool (opened and recovered at start-up); empty without
    /// `[spool] dir`.
    pub spools: Vec<crate::sink::spool::OpenedSpool>,
    /// Spools of former shard indexes this shard drains: `(uplink index, former index, spool)`.
    pub former_spools: Vec<(usize, usize, crate::sink::spool::OpenedSpool)>,
    /// Input bounds: sessions on every shard (`mqtt.max_sessions`).
    pub sessions_total: Arc<AtomicUsize>,
    /// This shard's CoAP proxy counters (`[[coap.proxy]]` upstreams), shown by the admin.
    pub proxy_metrics: Arc<crate::proxy::ProxyMetrics>,
    /// This shard's CoAP socket (`[coap] enabled`), bound with SO_REUSEPORT.
    pub coap: Option<std::net::UdpSocket>,
    pub coap_metrics: Arc<crate::edge::coap::CoapMetrics>,
    /// This shard's DTLS listener (`[coap.dtls]`).
    pub coap_dtls: Option<crate::edge::coap::dtls::DtlsSeed>,
    /// Link state of the watched interfaces, for per-path sessions (`None`: no watcher).
    pub links: Option<crate::net::links::LinkWatch>,
    /// The PHD edge (`[phd] listen`), for agents handed to this shard.
    pub phd: Option<Arc<crate::edge::phd::PhdShared>>,
    /// Every `[[function]]`'s handle (its sink entries are in `config.uplink`).
    pub functions: Vec<Arc<crate::functions::FunctionHandle>>,
    /// The watchdog's liveness table: the shard registers its runtime there.
    pub liveness: Arc<crate::app::liveness::Liveness>,
    /// Per uplink, its forward filters and topic mapping: one handle shared by every shard,
    /// replaced by a reload (`app/reload.rs`).
    pub routes: Vec<UplinkRoute>,
    /// `[state] dir`: the state log, and this shard's sessions loaded from it at start.
    pub state: Option<crate::state::StateLog>,
    pub restored_sessions: Vec<(ByteString, crate::state::SessionImage)>,
}

/// Start a shard thread.
pub fn spawn(seed: ShardSeed) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("sluice-shard-{}", seed.id))
        .spawn(move || {
            if let Some(core) = seed.core {
                if !core_affinity::set_for_current(core) {
                    tracing::warn!(
                        shard = seed.id,
                        core = core.id,
                        "could not pin shard thread to its core"
                    );
                }
            }
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(error) => {
                    tracing::error!(shard = seed.id, %error, "cannot build the shard runtime");
                    return;
                }
            };
            seed.liveness
                .register(format!("shard-{}", seed.id), rt.handle().clone());
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, run(seed));
        })
}

async fn run(seed: ShardSeed) {
    let ShardSeed {
        id,
        config,
        mailboxes,
        mut inbox,
        control,
        snapshot,
        metrics,
        rules,
        acl,
        limits: limits_metrics,
        uplink_metrics,
        uplink_tls,
        uplink_ports,
        live_connections,
        online_devices,
        mut shutdown,
        spools,
        former_spools,
        sessions_total,
        proxy_metrics,
        coap,
        coap_metrics,
        coap_dtls,
        links,
        phd,
        functions,
        routes,
        state,
        restored_sessions,
        ..
    } = seed;
    let shards = mailboxes.len().max(1);
    // max_buffered is split evenly over shards, uplinks and lanes.
    // Lanes are made once: a reload that adds the first high entry (or removes the last)
    // needs a restart to add (or remove) the high lanes (`app/reload.rs` says so).
    let lanes = if rules.load().priority.has_high() {
        2
    } else {
        1
    };
    let per_lane_bytes = if config.uplink.is_empty() {
        0
    } else {
        (config.gateway.max_buffered.0 / shards as u64 / config.uplink.len() as u64 / lanes)
            .max(64 * 1024)
    };
    let mut spools = spools.into_iter();
    let uplinks: Vec<ShardUplink> = config
        .uplink
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let queue = Rc::new(UplinkQueue::with_metrics(
                per_lane_bytes as usize,
                uplink_metrics[i].normal.clone(),
            ));
            let spool = spools.next().map(|opened| {
                crate::sink::spool::UplinkSpool::new(id, &u.name, &config, opened, queue.clone())
            });
            ShardUplink {
                route: routes
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| UplinkRoute::new(u)),
                queue,
                high: uplink_metrics[i].high.as_ref().map(|m| {
                    Rc::new(UplinkQueue::with_metrics(
                        per_lane_bytes as usize,
                        m.clone(),
                    ))
                }),
                spool,
                overflow: u
                    .function
                    .as_ref()
                    .map(|_| Rc::new(crate::sink::http::Overflow::default())),
            }
        })
        .collect();
    let bounds = limits::ShardBounds::new(&config, shards, metrics.clone(), sessions_total);
    let ctx = Rc::new(ShardContext {
        id,
        config: config.clone(),
        mailboxes,
        control,
        snapshot,
        subs: RefCell::new(TopicTrie::new()),
        filter_refs: RefCell::new(HashMap::new()),
        sessions: RefCell::new(HashMap::new()),
        uplinks: RefCell::new(Rc::new(uplinks)),
        rules,
        acl,
        limits: limits_metrics,
        metrics,
        live_connections,
        online_devices: online_devices.clone(),
        shutting_down: std::cell::Cell::new(false),
        bounds,
        delivery_seq: std::cell::Cell::new(0),
        shared: RefCell::new(HashMap::new()),
        share_turn: std::cell::Cell::new(0),
        proxies: crate::proxy::ShardProxies::new(&config, proxy_metrics, links.clone()),
        state,
    });
    // Before the first device is taken from the mailbox, so its session is found.
    if !restored_sessions.is_empty() {
        crate::edge::mqtt::restore::sessions(&ctx, restored_sessions).await;
    }
    // The gateway-wide shutdown channel is watched here only; tasks on this shard get a
    // shard-local channel, so their per-iteration waits never touch another core's cache lines.
    let (local_shutdown_tx, local_shutdown) = watch::channel(false);
    // Spool tasks stop after the uplink sessions, so the last acks are committed; each
    // uplink's spools (its own and former shards') have their own stop signal, so a reload can
    // stop them alone (`sinks.rs`).
    let mut spool_stops: Vec<(watch::Sender<bool>, Vec<sinks::SpoolTasks>)> = config
        .uplink
        .iter()
        .map(|_| (watch::channel(false).0, Vec::new()))
        .collect();
    let mut former = Vec::new();
    let sinks = ctx.sinks();
    for (uplink, index, opened) in former_spools {
        if let (Some(u), Some(ucfg)) = (sinks.get(uplink), config.uplink.get(uplink)) {
            let spool = crate::sink::spool::UplinkSpool::new(
                index,
                &ucfg.name,
                &config,
                opened,
                u.queue.clone(),
            );
            spool.set_former();
            former.push((uplink, spool));
        }
    }
    let all_spools = sinks
        .iter()
        .enumerate()
        .filter_map(|(i, u)| u.spool.clone().map(|s| (i, s)))
        .chain(former);
    // Each uplink's normal-lane outbox hears of its feeders' link state (and drain share).
    let mut feeders: Vec<crate::sink::outbox::Feeders> =
        config.uplink.iter().map(|_| Default::default()).collect();
    for (i, spool) in all_spools {
        // A weak reference: the outbox must not keep its own feeder alive in a cycle.
        let weak = Rc::downgrade(&spool);
        feeders[i].attach(
            config.spool.drain_share,
            Box::new(move |up| {
                if let Some(s) = weak.upgrade() {
                    s.link_changed(up);
                }
            }),
        );
        let tasks = spool.spawn_tasks(spool_stops[i].0.subscribe());
        spool_stops[i].1.push((spool, tasks));
    }

    // Every sink with its own stop signal, so a reload can stop one alone (`sinks.rs`); at
    // start its id is its position in the config (`app::uplinks::UplinkTable::at_start`).
    let running: sinks::Running = Default::default();
    for (i, ucfg) in config.uplink.iter().enumerate() {
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        let downlink = sinks::downlink(&ctx);
        let cfg = Rc::new(UplinkConfig::clone(ucfg));
        let function = ucfg.function.as_ref().and_then(|f| {
            let handle = functions.iter().find(|h| h.cfg.name == f.name)?.clone();
            Some(crate::sink::http::FunctionSeed {
                handle,
                publish: sinks::function_publish(&ctx),
                overflow: sinks[i].overflow.clone()?,
            })
        });
        tasks.push(crate::sink::spawn(
            SessionSeed {
                shard: id,
                lane: Lane::Normal,
                cfg: cfg.clone(),
                tls: uplink_tls[i].clone(),
                queue: sinks[i].queue.clone(),
                downlink: downlink.clone(),
                metrics: uplink_metrics[i].normal.clone(),
                live_devices: online_devices.clone(),
                on_port: None,
                feeders: std::mem::take(&mut feeders[i]),
                links: links.clone(),
                function: function.clone(),
                route: sinks[i].route.clone(),
            },
            stopped.clone(),
        ));
        if let (Some(queue), Some(metrics)) = (&sinks[i].high, &uplink_metrics[i].high) {
            let on_port = uplink_ports[i].clone().map(|sink| {
                let cell = std::cell::Cell::new(None::<u16>);
                Box::new(move |port: Option<u16>| {
                    if let Some(old) = cell.replace(port) {
                        sink.port_down(old);
                    }
                    if let Some(new) = port {
                        sink.port_up(new);
                    }
                }) as Box<dyn Fn(Option<u16>)>
            });
            tasks.push(crate::sink::spawn(
                SessionSeed {
                    shard: id,
                    lane: Lane::High,
                    cfg: cfg.clone(),
                    tls: uplink_tls[i].clone(),
                    queue: queue.clone(),
                    downlink,
                    metrics: metrics.clone(),
                    live_devices: online_devices.clone(),
                    on_port,
                    feeders: Default::default(),
                    links: links.clone(),
                    function,
                    route: sinks[i].route.clone(),
                },
                stopped,
            ));
        }
        let (spool_stop, spools) =
            std::mem::replace(&mut spool_stops[i], (watch::channel(false).0, Vec::new()));
        running.borrow_mut().push(sinks::RunningSink {
            id: crate::app::uplinks::UplinkId(i as u32),
            name: ucfg.name.clone(),
            sink: sinks[i].clone(),
            stop,
            tasks,
            spool_stop,
            spools,
        });
    }
    let coap = coap.and_then(|socket| {
        crate::edge::coap::start(ctx.clone(), socket, coap_metrics, local_shutdown.clone())
    });
    // Serves its own peers (no steering): kept alive by its receive task.
    let _coap_dtls = coap_dtls
        .and_then(|seed| crate::edge::coap::dtls::start(ctx.clone(), seed, local_shutdown.clone()));
    tracing::debug!(shard = id, uplinks = config.uplink.len(), "shard started");

    loop {
        tokio::select! {
            cmd = inbox.recv() => match cmd {
                Some(ShardCmd::Adopt(adopted)) => {
                    let ctx = ctx.clone();
                    ctx.online_devices.fetch_add(1, Ordering::Relaxed);
                    tokio::task::spawn_local(async move {
                        crate::edge::mqtt::connection::run(ctx.clone(), adopted).await;
                        ctx.online_devices.fetch_sub(1, Ordering::Relaxed);
                        ctx.live_connections.fetch_sub(1, Ordering::Relaxed);
                    });
                }
                Some(ShardCmd::Deliver(routed)) => {
                    ctx.metrics.cross_shard_received.inc();
                    router::deliver_local(&ctx, &routed);
                }
                Some(ShardCmd::EvictOffline(reply)) => limits::on_evict_request(&ctx, reply),
                Some(ShardCmd::DeliverShared(routed, key)) => {
                    ctx.metrics.cross_shard_received.inc();
                    router::deliver_shared_member(&ctx, &routed, &key);
                }
                Some(ShardCmd::CoapDatagram(steered)) => {
                    if let Some(coap) = &coap {
                        coap.on_steered(steered);
                    }
                }
                Some(ShardCmd::PhdAdopt(handover)) => {
                    if let Some(phd) = &phd {
                        tokio::task::spawn_local(crate::edge::phd::data::run(ctx.clone(), phd.clone(), handover));
                    }
                }
                Some(ShardCmd::AttachSink(attach)) => {
                    sinks::attach_sink(&ctx, &running, *attach, lanes, &links);
                }
                Some(ShardCmd::DetachSink(detach)) => {
                    tokio::task::spawn_local(sinks::detach_sink(ctx.clone(), running.clone(), *detach, lanes));
                }
                None => break,
            },
            _ = shutdown.changed() => {
                if *shutdown.borrow() { break; }
            }
        }
    }
    ctx.shutting_down.set(true);
    // Sessions the shutdown ends stay in the state directory for the next start.
    if let Some(log) = &ctx.state {
        log.freeze();
    }
    let _ = local_shutdown_tx.send(true);
    for session in ctx.sessions.borrow().values() {
        session.notify.notify_one();
    }
    // Give connections and uplinks a moment to say goodbye.
    for t in sinks::stop_all(&running) {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), t).await;
    }
    for t in sinks::stop_spools(&running) {
        let _ = tokio::time::timeout(sinks::SPOOL_GRACE, t).await;
    }
    tracing::debug!(shard = id, "shard stopped");
}
