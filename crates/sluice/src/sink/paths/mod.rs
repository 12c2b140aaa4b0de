//! Per-path sessions: one uplink lane spread over several paths, for brokers that cannot do
//! MPTCP (the multipath-proxy paper's scheduler, done by sluice instead of the kernel).
//!
//! Owns: [`PathsTransport`], a [`Transport`] over one [`MqttTransport`] per `[[uplink]] paths`
//! entry (client id `"{client_id}-{shard}[-hi]-{path}"`, socket bound to the path's `bind`
//! address and/or `interface`), and [`spawn`], which puts an [`Outbox`] in front of it. Does
//! not own: queueing, ordering across reconnects, retry or the spool (the outbox), MQTT on a
//! path (`sink::mqtt`), link state (`crate::net::links`).
//!
//! # Scheduling (`sched.rs`)
//! A unit goes to the live path with the lowest smoothed ack latency (srtt, an EWMA of send →
//! PUBACK time per path, seeded from the connect time) that has window left, ties broken by
//! inflight ÷ weight (minRTT). **Per-device order**: a flow (a device, or the one flow of all
//! SenML packs) with units unacknowledged on a path stays on it; when that path has no room
//! the flow is *held* ([`Transport::holds`]) and the outbox keeps its messages in order while
//! other flows go. While packs are inflight, device flows go to the packs' path; a pack waits
//! while device units are inflight on more than one path (the switch between packing and
//! single messages keeps order). The high lane with `lane_path` uses that path while it is up.
//! QoS 0 messages are not tracked once written: two of them from one device may overtake each
//! other across paths (at-most-once anyway).
//!
//! # Health and failover
//! Each path has its own session, keep-alive (`path_keep_alive`, whole seconds, at least 1 s:
//! the MQTT keep-alive of the path's session, so an idle dead path is noticed within 1.5 ×),
//! backoff (`reconnect_min` doubling to `path_reconnect_max`) and state. A path is declared
//! dead when its connection fails, when it has units unacknowledged and has heard nothing for
//! `path_timeout` (stalled: a blackhole sends no RST), or when the link watcher reports its
//! interface down. Its unacknowledged units go back to the outbox
//! ([`Feedback::Returned`]), which resends them, in order, on the other paths
//! (at-least-once: the broker may have some already). A link-up event retries a down path at
//! once. Only when no path is up does [`Transport::poll`] fail, and the outbox reconnects as
//! for a single session.
//!
//! # Downlink
//! Only path 0 of shard 0's normal lane subscribes to `receive` (its session is the
//! persistent one); while it is down, the broker keeps the commands for it.
//!
//! Invariant: every outer [`SendId`] in `outer` is in exactly one path's `inflight`, and every
//! flow count in `flows` equals the units of that flow in its path's `inflight`.

mod health;
pub mod metrics;
mod sched;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::config::UplinkConfig;
use crate::net::dial::Dial;
use crate::net::links::LinkWatch;
use crate::sink::mqtt::{MqttTransport, SessionSeed};
use crate::sink::outbox::{Backoff, Outbox, OutboxSeed};
use crate::sink::transport::{Feedback, Flow, LinkLimits, SendId, Transport, Unit, Unsendable};
use crate::sink::{Lane, UplinkError, UplinkMetrics};
pub use metrics::{Failover, PathMetrics, PathState, PathsMetrics};

/// Start the outbox of one uplink lane with `paths` on this shard, over a [`PathsTransport`].
/// Must be called inside a `LocalSet`.
pub fn spawn(seed: SessionSeed, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    let SessionSeed {
        shard,
        lane,
        cfg,
        tls,
        queue,
        downlink,
        metrics,
        live_devices,
        on_port: _,
        feeders,
        links,
        function: _,
        route,
    } = seed;
    let outbox_route = route.clone();
    let make = {
        let (cfg, metrics) = (cfg.clone(), metrics.clone());
        move |path: usize| {
            let p = &cfg.paths[path];
            let mut pcfg = UplinkConfig::clone(&cfg);
            pcfg.keep_alive =
                Duration::from_secs(cfg.path_keep_alive.as_secs_f64().ceil().max(1.0) as u64);
            MqttTransport::new(
                shard,
                lane,
                Rc::new(pcfg),
                tls.clone(),
                downlink.clone(),
                metrics.clone(),
            )
            .with_route(route.clone())
            .for_path(
                cfg.path_client_id(shard, lane == Lane::High, path),
                Dial {
                    mptcp: cfg.mptcp,
                    bind: p.bind,
                    interface: p.interface.clone(),
                },
                path == 0,
            )
        }
    };
    let transport = PathsTransport::new(
        shard,
        lane,
        cfg.clone(),
        metrics.clone(),
        links,
        Box::new(make),
    );
    let outbox = Outbox::new(
        OutboxSeed {
            shard,
            lane,
            cfg,
            queue,
            metrics,
            live_devices,
            feeders,
        },
        transport,
    )
    .with_route(outbox_route);
    tokio::task::spawn_local(outbox.run(shutdown))
}

/// What a connect task hands back: the transport and how its connect went.
type Connected = (MqttTransport, Result<LinkLimits, UplinkError>, Duration);

enum Slot {
    Up {
        t: MqttTransport,
        window: usize,
        pack_limit: usize,
    },
    Connecting(oneshot::Receiver<Connected>),
    /// Not connected; a connect starts at `retry_at`. `None`: the transport went with a
    /// connect task that vanished (rebuilt from the factory).
    Down {
        t: Option<MqttTransport>,
        retry_at: Instant,
    },
}

/// One unit unacknowledged on a path.
struct Unacked {
    outer: SendId,
    flow: Flow,
    sent_at: Instant,
}

struct Path {
    name: String,
    weight: u32,
    interface: Option<String>,
    bind: Option<std::net::IpAddr>,
    slot: Slot,
    /// Inner id (the path session's packet id) → the unit.
    inflight: HashMap<SendId, Unacked>,
    /// (inner, outer, sent at) in send order; entries no longer inflight are dropped from the
    /// front after each batch of answers, so the front is the oldest unit unacknowledged.
    order: std::collections::VecDeque<(SendId, SendId, Instant)>,
    /// Units of device flows in `inflight` (for the pack rule).
    device_units: usize,
    /// Units encoded into the path's pending batch and not yet written.
    pending_units: u64,
    srtt: Option<Duration>,
    backoff: Backoff,
    /// Feedback its last poll produced.
    fb: Vec<Feedback>,
    needs_settle: bool,
    /// The link was seen up at this generation (a later up after a down retries at once).
    link_up: Option<bool>,
    metrics: Arc<PathMetrics>,
}

impl Path {
    /// When the oldest unit unacknowledged here was sent.
    fn oldest(&self) -> Option<Instant> {
        self.order.front().map(|(_, _, at)| *at)
    }

    /// Drop answered units from the front of `order`.
    fn trim_order(&mut self) {
        while let Some((inner, outer, _)) = self.order.front() {
            if self.inflight.get(inner).is_some_and(|u| u.outer == *outer) {
                break;
            }
            self.order.pop_front();
        }
    }

    fn is_up(&self) -> bool {
        matches!(self.slot, Slot::Up { .. })
    }

    fn room(&self) -> bool {
        match &self.slot {
            Slot::Up { window, .. } => self.inflight.len() < *window,
            _ => false,
        }
    }

    fn transport(&mut self) -> Option<&mut MqttTransport> {
        match &mut self.slot {
            Slot::Up { t, .. } => Some(t),
            _ => None,
        }
    }
}

/// One uplink lane over several paths (see the module docs).
pub struct PathsTransport {
    shard: usize,
    lane: Lane,
    cfg: Rc<UplinkConfig>,
    paths: Vec<Path>,
    make: Box<dyn Fn(usize) -> MqttTransport>,
    links: Option<LinkWatch>,
    /// `lane_path`'s index, on the high lane.
    pinned: Option<usize>,
    /// Outer id → (path, inner id).
    outer: HashMap<SendId, (usize, SendId)>,
    /// Flow → (path, units unacknowledged there).
    flows: HashMap<Flow, (usize, usize)>,
    next_id: u64,
    /// Outer ids of units a dead path gave back, reported at the next poll.
    returned: Vec<SendId>,
    last_error: Option<String>,
}

/// What woke [`PathsTransport::poll`].
enum Woke {
    Polled(usize, Result<(), UplinkError>),
    Connected(usize, Result<Connected, oneshot::error::RecvError>),
    Timer,
    Links,
}

impl PathsTransport {
    pub fn new(
        shard: usize,
        lane: Lane,
        cfg: Rc<UplinkConfig>,
        metrics: Arc<UplinkMetrics>,
        links: Option<LinkWatch>,
        make: Box<dyn Fn(usize) -> MqttTransport>,
    ) -> PathsTransport {
        let paths: Vec<Path> = cfg
            .paths
            .iter()
            .enumerate()
            .map(|(i, p)| Path {
                name: p.label(i),
                weight: p.weight.max(1),
                interface: p.interface.clone(),
                bind: p.bind,
                slot: Slot::Down {
                    t: Some(make(i)),
                    retry_at: Instant::now(),
                },
                inflight: HashMap::new(),
                order: std::collections::VecDeque::new(),
                device_units: 0,
                pending_units: 0,
                srtt: None,
                backoff: Backoff::new(cfg.reconnect_min, cfg.path_reconnect_max),
                fb: Vec::new(),
                needs_settle: false,
                link_up: None,
                metrics: Arc::new(PathMetrics::new(p.label(i))),
            })
            .collect();
        metrics
            .paths
            .register(paths.iter().map(|p| p.metrics.clone()).collect());
        let pinned = match lane {
            Lane::High => cfg
                .lane_path
                .as_ref()
                .and_then(|name| paths.iter().position(|p| &p.name == name)),
            Lane::Normal => None,
        };
        PathsTransport {
            shard,
            lane,
            cfg,
            paths,
            make,
            links,
            pinned,
            outer: HashMap::new(),
            flows: HashMap::new(),
            next_id: 0,
            returned: Vec::new(),
            last_error: None,
        }
    }

    fn window_now(&self) -> usize {
        self.paths
            .iter()
            .map(|p| match &p.slot {
                Slot::Up { window, .. } => *window,
                _ => 0,
            })
            .sum()
    }

    /// A unit of `flow` left on path `i` (`None`: acknowledged, refused or returned).
    fn flow_add(&mut self, flow: Flow, i: usize) {
        let e = self.flows.entry(flow).or_insert((i, 0));
        e.0 = i;
        e.1 += 1;
        if matches!(flow, Flow::Device(_)) {
            self.paths[i].device_units += 1;
        }
    }

    fn flow_done(&mut self, flow: Flow, i: usize) {
        if let Some(e) = self.flows.get_mut(&flow) {
            e.1 = e.1.saturating_sub(1);
            if e.1 == 0 {
                self.flows.remove(&flow);
            }
        }
        if matches!(flow, Flow::Device(_)) {
            self.paths[i].device_units = self.paths[i].device_units.saturating_sub(1);
        }
    }

    /// Map one path's feedback to outer ids, updating srtt and flows.
    fn take_feedback(&mut self, i: usize, out: &mut Vec<Feedback>) {
        let fb = std::mem::take(&mut self.paths[i].fb);
        let now = Instant::now();
        for f in fb {
            let inner = match f {
                Feedback::Acked(id) | Feedback::Returned(id) => id,
                Feedback::Refused { id, .. } => id,
            };
            let Some(u) = self.paths[i].inflight.remove(&inner) else {
                continue;
            };
            self.outer.remove(&u.outer);
            self.flow_done(u.flow, i);
            let p = &mut self.paths[i];
            p.metrics.inflight.set(p.inflight.len() as i64);
            match f {
                Feedback::Acked(_) => {
                    let sample = now.saturating_duration_since(u.sent_at);
                    let srtt = match p.srtt {
                        Some(s) => (s * 7 + sample) / 8,
                        None => sample,
                    };
                    p.srtt = Some(srtt);
                    p.metrics.srtt_us.set(srtt.as_micros() as i64);
                    p.metrics.messages_acked.inc();
                    out.push(Feedback::Acked(u.outer));
                }
                Feedback::Refused { code, class, .. } => out.push(Feedback::Refused {
                    id: u.outer,
                    code,
                    class,
                }),
                Feedback::Returned(_) => out.push(Feedback::Returned(u.outer)),
            }
        }
        self.paths[i].trim_order();
    }

    fn all_down(&self) -> Result<(), UplinkError> {
        if self.paths.iter().any(Path::is_up) {
            Ok(())
        } else {
            Err(UplinkError::AllPathsDown(
                self.last_error
                    .clone()
                    .unwrap_or_else(|| "no path connected".into()),
            ))
        }
    }

    /// Wait for whichever comes first: a path's input, a connect finishing, a timer, a link
    /// change. Cancel-safe: every branch only awaits.
    async fn wait(&mut self) -> Woke {
        let now = Instant::now();
        let timer_at = self.next_timer(now);
        let mut futs: Vec<Pin<Box<dyn Future<Output = Woke> + '_>>> = Vec::new();
        for (i, p) in self.paths.iter_mut().enumerate() {
            let Path { slot, fb, .. } = p;
            match slot {
                Slot::Up { t, .. } => {
                    futs.push(Box::pin(async move { Woke::Polled(i, t.poll(fb).await) }))
                }
                Slot::Connecting(rx) => {
                    futs.push(Box::pin(async move { Woke::Connected(i, rx.await) }))
                }
                Slot::Down { .. } => {}
            }
        }
        futs.push(Box::pin(async move {
            tokio::time::sleep_until(timer_at.into()).await;
            Woke::Timer
        }));
        if let Some(links) = self.links.as_mut() {
            futs.push(Box::pin(async move {
                match links.changed().await {
                    Ok(()) => Woke::Links,
                    Err(_) => std::future::pending().await,
                }
            }));
        }
        futures_util::future::select_all(futs).await.0
    }
}

impl Transport for PathsTransport {
    const MAY_HOLD: bool = true;

    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        if self.links.is_some() {
            self.on_links();
        }
        for i in 0..self.paths.len() {
            if self.link_allows(i) {
                self.start_connect(i);
            }
        }
        loop {
            if let Some(limits) = self.limits() {
                return Ok(limits);
            }
            if !self
                .paths
                .iter()
                .any(|p| matches!(p.slot, Slot::Connecting(_)))
            {
                return Err(UplinkError::AllPathsDown(
                    self.last_error
                        .clone()
                        .unwrap_or_else(|| "no path could connect".into()),
                ));
            }
            match self.wait().await {
                Woke::Connected(i, r) => self.on_connected(i, r),
                Woke::Polled(i, r) => {
                    if let Err(e) = r {
                        self.kill(i, Failover::Dead, e.to_string());
                    }
                }
                Woke::Links => self.on_links(),
                Woke::Timer => {}
            }
        }
    }

    fn window(&self) -> Option<usize> {
        Some(self.window_now().max(1))
    }

    fn holds(&self, flow: Flow) -> bool {
        self.pick(flow).is_none()
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let flow = match unit {
            Unit::Message { msg, .. } => msg.flow(),
            Unit::Pack { .. } => Flow::Packs,
        };
        // The outbox asked `holds` first; if no path can take it anyway (all went down in
        // between), it goes to a live path, or is given back at once.
        let Some(i) = self
            .pick(flow)
            .or_else(|| self.paths.iter().position(Path::is_up))
        else {
            self.next_id += 1;
            let id = SendId(self.next_id);
            self.returned.push(id);
            return Ok(Some(id));
        };
        let Some(t) = self.paths[i].transport() else {
            unreachable!("pick returns live paths");
        };
        let inner = t.encode(unit)?;
        let p = &mut self.paths[i];
        p.pending_units += 1;
        let Some(inner) = inner else {
            return Ok(None);
        };
        self.next_id += 1;
        let outer = SendId(self.next_id);
        let now = Instant::now();
        p.inflight.insert(
            inner,
            Unacked {
                outer,
                flow,
                sent_at: now,
            },
        );
        p.order.push_back((inner, outer, now));
        p.metrics.inflight.set(p.inflight.len() as i64);
        self.outer.insert(outer, (i, inner));
        self.flow_add(flow, i);
        Ok(Some(outer))
    }

    fn pending_bytes(&self) -> usize {
        self.paths
            .iter()
            .map(|p| match &p.slot {
                Slot::Up { t, .. } => t.pending_bytes(),
                _ => 0,
            })
            .sum()
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        for i in 0..self.paths.len() {
            let Some(t) = self.paths[i].transport() else {
                continue;
            };
            let bytes = t.pending_bytes();
            if bytes == 0 {
                continue;
            }
            match t.flush().await {
                Ok(()) => {
                    let p = &mut self.paths[i];
                    p.metrics.bytes.add(bytes as u64);
                    p.metrics.messages_sent.add(p.pending_units);
                    p.pending_units = 0;
                }
                Err(e) => self.kill(i, Failover::Dead, e.to_string()),
            }
        }
        self.all_down()
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        loop {
            self.start_due_connects(Instant::now());
            if !self.returned.is_empty() {
                feedback.extend(self.returned.drain(..).map(Feedback::Returned));
                return self.all_down();
            }
            match self.wait().await {
                Woke::Polled(i, Ok(())) => {
                    self.paths[i].needs_settle = true;
                    self.take_feedback(i, feedback);
                    return Ok(());
                }
                Woke::Polled(i, Err(e)) => self.kill(i, Failover::Dead, e.to_string()),
                Woke::Connected(i, r) => {
                    self.on_connected(i, r);
                    if self.paths[i].is_up() {
                        // The window grew: let the outbox fill again.
                        return Ok(());
                    }
                }
                Woke::Timer => self.check_stalls(Instant::now()),
                Woke::Links => self.on_links(),
            }
            if !self.returned.is_empty() {
                feedback.extend(self.returned.drain(..).map(Feedback::Returned));
                return self.all_down();
            }
            self.all_down()?;
        }
    }

    async fn settle(&mut self) -> Result<(), UplinkError> {
        for i in 0..self.paths.len() {
            if !std::mem::take(&mut self.paths[i].needs_settle) {
                continue;
            }
            let Some(t) = self.paths[i].transport() else {
                continue;
            };
            if let Err(e) = t.settle().await {
                self.kill(i, Failover::Dead, e.to_string());
            }
        }
        self.all_down()
    }

    async fn close(&mut self) {
        for p in &mut self.paths {
            if let Slot::Up { t, .. } = &mut p.slot {
                t.close().await;
            }
        }
    }

    fn abort(&mut self) {
        let now = Instant::now();
        for p in &mut self.paths {
            if let Slot::Up { t, .. } = &mut p.slot {
                t.abort();
            }
            if let Slot::Up { .. } = p.slot {
                let Slot::Up { t, .. } = std::mem::replace(
                    &mut p.slot,
                    Slot::Down {
                        t: None,
                        retry_at: now,
                    },
                ) else {
                    unreachable!()
                };
                p.slot = Slot::Down {
                    t: Some(t),
                    retry_at: now,
                };
                p.metrics.set_state(PathState::Down);
            }
            p.inflight.clear();
            p.order.clear();
            p.device_units = 0;
            p.pending_units = 0;
            p.needs_settle = false;
            p.fb.clear();
            p.metrics.inflight.set(0);
        }
        self.outer.clear();
        self.flows.clear();
        self.returned.clear();
    }
}

impl PathsTransport {
    /// The link limits while at least one path is up.
    fn limits(&self) -> Option<LinkLimits> {
        let live: Vec<usize> = self
            .paths
            .iter()
            .filter_map(|p| match &p.slot {
                Slot::Up { pack_limit, .. } => Some(*pack_limit),
                _ => None,
            })
            .collect();
        let pack_limit = *live.iter().min()?;
        Some(LinkLimits {
            window: self.window_now().max(1),
            pack_limit,
            keep_alive: Some(self.cfg.path_keep_alive),
        })
    }
}
