//! The outbox in front of a transport: everything between the shard's queue and one link to a
//! far end, written once for every [`Transport`].
//!
//! Owns: the byte-bounded queue ([`queue`]), SenML packing ([`pack`]), and the run loop of
//! one [`Outbox`] per (shard, sink, lane): connecting (bounded by `connect_timeout`),
//! reconnecting with a jittered backoff, the inflight map by [`SendId`] with send order,
//! filling each batch (packing, `alone`, the QoS 0 bypass, the drain share between the live
//! and backlog streams), refusals (temporary: pause, back off, resend in order; permanent:
//! count, log, complete with the code), requeueing on connection loss, the link-state hooks
//! of its feeders (the spool), and the sending metrics. Does not own: the wire protocol,
//! encoding, keep-alive or downlink (the transport: `sink::mqtt` is the first), what a
//! spool does when the link changes (`sink::spool`), or acknowledging devices (their
//! connections drain `DeviceAcks`).
//!
//! # Invariants
//! - **Bounded memory.** A message's queue bytes stay reserved until it is finished (acked,
//!   written when it needs no ack, or dropped with a counted reason): then its bytes are
//!   released and only then [`crate::sink::UplinkMessage::complete_with`] is called.
//! - **Order.** Units leave in queue order; a pack is sealed (and written first) before any
//!   message goes alone again. When a connection ends or a temporary refusal's pause ends,
//!   every unacknowledged message goes back to the queue's front in send order, marked as a
//!   resend; so per-device order holds (modulo at-least-once duplicates).
//! - **Ack after the far end's ack**, except a message that can never be sent
//!   (`too_large_for_cloud`, `invalid_for_cloud`: completed with 0x83) or refused for good
//!   (`cloud_rejected`: completed with the far end's code), each counted.
//! - Nothing new is taken while a temporary refusal's backoff runs.
//!
//! # Reconnect policy
//! Any failure logs one WARN line naming who is to blame and the retry delay, then waits a
//! jittered exponential backoff (attempt *n*: random in `[d/2, d]`, `d = min(reconnect_max,
//! reconnect_min · 2ⁿ)`), reset once a connection stayed up `max(reconnect_max, 10 s)`. Only
//! shutdown ends the loop (the transport closes gracefully when connected).

mod drain;
mod fill;
pub mod pack;
pub mod queue;
mod refusal;

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::config::{Share, UplinkConfig};
use crate::sink::transport::{Feedback, Flow, SendId, Transport};
use crate::sink::{Lane, RejectReason, UplinkMessage, UplinkMetrics, UplinkQueue, UplinkState};
use pack::{Packer, SealedPack};
use queue::Queued;

pub use refusal::PERSISTENT_ERROR_ROUNDS;

/// Most encoded bytes put into one batch (one write; TLS splits it into 16 KiB records).
pub const MAX_BATCH_BYTES: usize = 64 * 1024;
/// Most messages held for a flow whose link has no room (see [`Transport::holds`]); at this
/// many, nothing more is taken from the queue until some are sent.
pub const MAX_HELD: usize = 4096;
/// A connection that stayed up this long (or `reconnect_max`, if longer) resets the backoff.
const STABLE_CONNECTION: Duration = Duration::from_secs(10);

/// Who feeds the queue besides device connections (a spool) and wants to hear the link state.
#[derive(Default)]
pub struct Feeders {
    /// The backlog stream's share of the window while live messages wait (`None`: no spool,
    /// so no backlog stream).
    pub drain_share: Option<Share>,
    /// Told `true` when a connection comes up and `false` when it ends.
    pub on_link: Vec<Box<dyn Fn(bool)>>,
}

impl Feeders {
    /// A spool feeds the queue: the backlog may use `drain_share` of the window, and `on_link`
    /// hears the link state. Several spools may feed one queue (a former shard's).
    pub fn attach(&mut self, drain_share: Share, on_link: Box<dyn Fn(bool)>) {
        self.drain_share.get_or_insert(drain_share);
        self.on_link.push(on_link);
    }

    fn link_changed(&self, up: bool) {
        for f in &self.on_link {
            f(up);
        }
    }
}

/// Everything an outbox needs besides its transport.
pub struct OutboxSeed {
    pub shard: usize,
    pub lane: Lane,
    /// The sink's settings: `name`, `connect_timeout`, `reconnect_*`, `refused_retry_*`,
    /// `aggregate` (packing on the normal lane when enabled).
    pub cfg: Rc<UplinkConfig>,
    pub queue: Rc<UplinkQueue>,
    pub metrics: Arc<UplinkMetrics>,
    /// Devices connected to the whole gateway (packing starts above `aggregate.min_devices`).
    pub live_devices: Arc<AtomicUsize>,
    pub feeders: Feeders,
}

/// The outbox's part of a lane's seed (what every transport's `spawn` hands the outbox).
impl From<crate::sink::SessionSeed> for OutboxSeed {
    fn from(seed: crate::sink::SessionSeed) -> OutboxSeed {
        OutboxSeed {
            shard: seed.shard,
            lane: seed.lane,
            cfg: seed.cfg,
            queue: seed.queue,
            metrics: seed.metrics,
            live_devices: seed.live_devices,
            feeders: seed.feeders,
        }
    }
}

/// What one unit written and not yet acknowledged carried.
pub(crate) enum Carried {
    One(UplinkMessage),
    /// A SenML pack: its messages in order.
    Pack(Vec<UplinkMessage>),
}

impl Carried {
    fn into_messages(self) -> Vec<UplinkMessage> {
        match self {
            Carried::One(m) => vec![m],
            Carried::Pack(v) => v,
        }
    }

    fn len(&self) -> usize {
        match self {
            Carried::One(_) => 1,
            Carried::Pack(v) => v.len(),
        }
    }
}

/// A unit written and not yet acknowledged; `seq` is its send order; `backlog`: it counts
/// against the drain share.
struct Inflight {
    seq: u64,
    carried: Carried,
    backlog: bool,
}

/// A generic outbox driving one transport `T` (see the module docs).
pub struct Outbox<T: Transport> {
    transport: T,
    shard: usize,
    lane: Lane,
    cfg: Rc<UplinkConfig>,
    queue: Rc<UplinkQueue>,
    metrics: Arc<UplinkMetrics>,
    live_devices: Arc<AtomicUsize>,
    feeders: Feeders,
    /// `Some` on the normal lane when aggregation is enabled.
    packer: Option<Packer>,
    /// `[uplink.aggregate]` as this outbox packs by it, and where a reload's new one comes
    /// from (`with_route`; its generation as last seen).
    aggregate: crate::config::AggregateConfig,
    route: Option<(crate::sink::UplinkRoute, u64)>,
    /// Told when the route is replaced (this outbox's own).
    route_watch: Option<Arc<tokio::sync::Notify>>,
    /// A pack sealed and waiting for the window; nothing more is taken meanwhile.
    sealed: Option<SealedPack>,
    /// The id and send order of the last partial pack written (`flush = "idle"`: the uplink is
    /// busy while it is inflight).
    last_partial: Option<(SendId, u64)>,
    /// Messages to send on their own before anything taken after them: one too big for any
    /// pack, or the messages of a pack the far end could not take.
    alone: VecDeque<Queued>,
    inflight: HashMap<SendId, Inflight, crate::sink::transport::BuildIdHasher>,
    send_seq: u64,
    /// Inflight units carrying backlog records.
    inflight_backlog: usize,
    /// With a window of one, backlog and live alternate.
    last_took_backlog: bool,
    /// (backlog, all) records added to the open pack: the drain share while aggregating.
    pack_mix: (usize, usize),
    /// Units refused for now (with their send order), resent when the pause ends.
    refused: Vec<(u64, Carried)>,
    /// Messages taken from the queue whose flow the transport holds for now
    /// ([`Transport::holds`]), in the order taken; sent before anything newer of their flow.
    /// By flow, each with the order it was taken in (to requeue everything in that order).
    held: HashMap<Flow, VecDeque<(u64, Queued)>>,
    /// Messages in `held`.
    held_len: usize,
    /// Take order of held messages.
    held_seq: u64,
    /// Units the transport gave back ([`Feedback::Returned`]) during the current poll, with
    /// their send order; requeued once the poll's feedback is applied.
    returned: Vec<(u64, Carried)>,
    /// While set, nothing is sent: a temporary refusal's backoff runs until then (and until
    /// nothing is inflight), then everything unacknowledged is requeued in order.
    paused_until: Option<Instant>,
    refusal_backoff: Backoff,
    /// Refusal rounds since the last success.
    refusal_rounds: u32,
    /// When each permanent refusal reason was last logged.
    reject_warned: [Option<Instant>; RejectReason::ALL.len()],
}

/// What woke the serve loop.
enum Event {
    Shutdown,
    Polled(Result<(), crate::sink::UplinkError>),
    Queued,
    PackDue,
    RetryDue,
    RouteChanged,
}

impl<T: Transport> Outbox<T> {
    pub fn new(seed: OutboxSeed, transport: T) -> Outbox<T> {
        let OutboxSeed {
            shard,
            lane,
            cfg,
            queue,
            metrics,
            live_devices,
            feeders,
        } = seed;
        queue.attach_metrics(metrics.clone());
        let packer =
            (lane == Lane::Normal && cfg.aggregate.enabled).then(|| Packer::new(&cfg.aggregate));
        Outbox {
            transport,
            shard,
            lane,
            packer,
            aggregate: cfg.aggregate.clone(),
            route: None,
            route_watch: None,
            sealed: None,
            last_partial: None,
            alone: VecDeque::new(),
            inflight: HashMap::default(),
            send_seq: 0,
            inflight_backlog: 0,
            last_took_backlog: false,
            pack_mix: (0, 0),
            refused: Vec::new(),
            held: HashMap::new(),
            held_len: 0,
            held_seq: 0,
            returned: Vec::new(),
            paused_until: None,
            refusal_backoff: refusal::backoff(&cfg),
            refusal_rounds: 0,
            reject_warned: [None; RejectReason::ALL.len()],
            cfg,
            queue,
            metrics,
            live_devices,
            feeders,
        }
    }

    /// Run until `shutdown` becomes `true` (or its sender is dropped): connect, serve,
    /// reconnect. At shutdown the transport closes gracefully; unacknowledged messages stay
    /// in the queue.
    /// Follow `route`'s `[uplink.aggregate]`, which a reload may replace
    /// (`UplinkRoute::replace`), instead of keeping the configuration's own for good.
    pub fn with_route(mut self, route: crate::sink::UplinkRoute) -> Self {
        self.route_watch = Some(route.watch());
        self.route = Some((route, 0));
        self
    }

    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.cfg.reconnect_min, self.cfg.reconnect_max);
        let stable_after = self.cfg.reconnect_max.max(STABLE_CONNECTION);
        loop {
            if *shutdown.borrow() {
                break;
            }
            self.metrics.set_state(UplinkState::Connecting);
            let connect_timeout = self.cfg.connect_timeout;
            let attempt = tokio::select! {
                r = tokio::time::timeout(connect_timeout, self.transport.connect()) => {
                    r.unwrap_or(Err(crate::sink::UplinkError::ConnectTimeout(connect_timeout)))
                }
                _ = shutdown_signal(&mut shutdown) => break,
            };
            let (error, was_connected) = match attempt {
                Err(e) => {
                    self.transport.abort();
                    self.metrics.connect_failures.inc();
                    (e, false)
                }
                Ok(limits) => {
                    self.metrics.connects.inc();
                    self.metrics.set_state(UplinkState::Connected);
                    self.feeders.link_changed(true);
                    info!(
                        shard = self.shard,
                        uplink = %self.cfg.name,
                        lane = self.lane.as_str(),
                        window = limits.window,
                        keep_alive = ?limits.keep_alive,
                        queued = self.queue.len(),
                        "uplink connected"
                    );
                    let up_since = Instant::now();
                    let result = self.serve(limits, &mut shutdown).await;
                    self.transport.abort();
                    self.requeue_unacked();
                    self.feeders.link_changed(false);
                    self.metrics.set_state(UplinkState::Disconnected);
                    match result {
                        Ok(()) => {
                            info!(shard = self.shard, uplink = %self.cfg.name, "uplink disconnected for shutdown");
                            break;
                        }
                        Err(e) => {
                            if up_since.elapsed() >= stable_after {
                                backoff.reset();
                            }
                            (e, true)
                        }
                    }
                }
            };
            self.metrics.set_state(UplinkState::Disconnected);
            let delay = backoff.next_delay();
            if was_connected {
                warn!(
                    shard = self.shard,
                    uplink = %self.cfg.name,
                    blame = error.blame().as_str(),
                    error = %error,
                    retry_in = ?delay,
                    "uplink connection lost; reconnecting"
                );
            } else {
                warn!(
                    shard = self.shard,
                    uplink = %self.cfg.name,
                    blame = error.blame().as_str(),
                    error = %error,
                    retry_in = ?delay,
                    "uplink connect failed; retrying"
                );
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown_signal(&mut shutdown) => break,
            }
        }
        self.metrics.set_state(UplinkState::Disconnected);
    }

    /// Serve one connection until an error (returned) or shutdown (`Ok`, closed gracefully).
    async fn serve(
        &mut self,
        limits: crate::sink::transport::LinkLimits,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), crate::sink::UplinkError> {
        // Messages in the pending batch that need no ack: finished once it is written.
        let mut unacked_in_write: Vec<UplinkMessage> = Vec::new();
        let mut feedback: Vec<Feedback> = Vec::new();
        // Whatever the far end sent together with its handshake answer.
        self.transport.settle().await?;
        // Woken by a reload's new route (`UplinkRoute::watch`); never without a route.
        let changed = self.route_watch.clone();
        let queue = self.queue.clone();
        // The waits that outlive a turn of the loop are made once (and again only after they
        // fired), not on every turn: each would register and unregister with its `Notify`.
        let mut stop = std::pin::pin!(shutdown_signal(shutdown));
        let mut route_changed = std::pin::pin!(notified_opt(changed.as_deref()));
        let mut queued = std::pin::pin!(queue.wait_ready());
        loop {
            self.transport.follow_route()?;
            let (sent, resent) = self.fill_batch(&limits, &mut unacked_in_write);
            let bytes = self.transport.pending_bytes();
            if bytes > 0 {
                if let Err(e) = self.transport.flush().await {
                    for msg in unacked_in_write.drain(..) {
                        self.finish_dropped(msg, crate::sink::DropReason::ConnectionLost);
                    }
                    return Err(e);
                }
                self.metrics.writes.inc();
                self.metrics.bytes_written.add(bytes as u64);
                self.metrics.messages_sent.add(sent);
                self.metrics.messages_resent.add(resent);
                for msg in unacked_in_write.drain(..) {
                    self.finish(msg, 0);
                }
            }

            let window = self.window(&limits);
            let window_open = self.inflight.len() < window;
            let held = self.sealed.is_some() || !self.alone.is_empty();
            let can_take = self.paused_until.is_none()
                && !held
                && (self.aggregating()
                    || window_open
                    || self.queue.front_needs_ack() == Some(false));
            // The pause ends at its deadline once nothing is inflight (an ack re-checks).
            let retry_at = self
                .paused_until
                .filter(|at| self.inflight.is_empty() || *at > Instant::now());
            let pack_due = match &self.sealed {
                Some(_) => None,
                None => self.packer.as_ref().and_then(Packer::deadline),
            };
            let event = tokio::select! {
                biased;
                _ = &mut stop => Event::Shutdown,
                r = self.transport.poll(&mut feedback) => Event::Polled(r),
                _ = &mut queued, if can_take => {
                    queued.set(queue.wait_ready());
                    Event::Queued
                }
                _ = sleep_until_opt(pack_due), if pack_due.is_some() => Event::PackDue,
                _ = sleep_until_opt(retry_at), if retry_at.is_some() => Event::RetryDue,
                _ = &mut route_changed => {
                    route_changed.set(notified_opt(changed.as_deref()));
                    Event::RouteChanged
                }
            };
            match event {
                Event::Shutdown => {
                    self.transport.close().await;
                    return Ok(());
                }
                Event::Polled(r) => {
                    if !feedback.is_empty() {
                        let now = Instant::now();
                        for f in feedback.drain(..) {
                            self.on_feedback(f, now);
                        }
                    }
                    self.requeue_returned();
                    r?;
                    self.transport.settle().await?;
                    self.maybe_resume();
                }
                Event::Queued => {}
                Event::PackDue => self.seal_pack(),
                Event::RetryDue => self.maybe_resume(),
                // Followed at the top of the loop.
                Event::RouteChanged => {}
            }
        }
    }

    /// The inflight window now: the transport's current one, else the connection's.
    pub(super) fn window(&self, limits: &crate::sink::transport::LinkLimits) -> usize {
        self.transport.window().unwrap_or(limits.window).max(1)
    }

    /// The message is done: release its queue bytes, then complete it with `code` for the
    /// device (0: success).
    fn finish(&self, msg: UplinkMessage, code: u8) {
        self.queue.release_msg(&msg);
        msg.complete_with(code);
    }
}

/// Waits for `notify`; never resolves for `None`.
async fn notified_opt(notify: Option<&tokio::sync::Notify>) {
    match notify {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`; never resolves for `None` (callers also guard the branch).
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Resolves when shutdown was requested or its sender is gone.
pub(crate) async fn shutdown_signal(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Jittered exponential backoff: attempt n waits uniformly in
/// `[max(min, d/2), d]` with `d = clamp(min · 2ⁿ, min, max)`.
#[derive(Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max: max.max(min),
            attempt: 0,
        }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn next_delay(&mut self) -> Duration {
        let d = self
            .min
            .saturating_mul(1u32 << self.attempt.min(30))
            .clamp(self.min, self.max);
        self.attempt = self.attempt.saturating_add(1);
        let lo = (d / 2).max(self.min);
        let (lo_ns, hi_ns) = (lo.as_nanos() as u64, d.as_nanos() as u64);
        if hi_ns <= lo_ns {
            return d;
        }
        Duration::from_nanos(rand::thread_rng().gen_range(lo_ns..=hi_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_within_bounds_and_resets() {
        let min = Duration::from_millis(100);
        let max = Duration::from_secs(5);
        let mut b = Backoff::new(min, max);
        assert_eq!(b.next_delay(), min);
        let second = b.next_delay();
        assert!(second >= min && second <= min * 2, "{second:?}");
        for _ in 0..40 {
            let d = b.next_delay();
            assert!(d >= min && d <= max, "{d:?}");
        }
        let late = b.next_delay();
        assert!(
            late >= max / 2,
            "after many failures the delay is near the max: {late:?}"
        );
        b.reset();
        assert_eq!(b.next_delay(), min);
    }
}
