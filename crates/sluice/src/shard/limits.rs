//! Bounds on what devices can make a shard hold or walk: topic depth and length, the session
//! table, the bytes queued for devices (outboxes and inflight), and subscriptions per session.
//!
//! Owns: the policy checks that sit on top of the protocol's own validity rules
//! (`sluice_proto::mqtt::topic`) and the session/queue bookkeeping, their metrics
//! (`sluice_mqtt_*`, rendered with the shard's) and the wording of their logs. Does not own:
//! acting on a refusal (the connection closes, the SUBACK carries a failure code, admission
//! refuses the CONNECT, the caller counts a dropped message) — the callers do that; nor the
//! retained store's bound (`control/`).
//!
//! Invariants:
//! - Every topic name a device publishes to (including a will topic) and every filter it
//!   subscribes to has at most `mqtt.max_topic_levels` levels and `mqtt.max_topic_length`
//!   bytes before anything stores or matches it; the config's own filters obey the same
//!   limits (`config::validate`). Topic checks are linear in the topic's length.
//! - Sessions (connected and offline persistent ones), whole gateway: a new session is created
//!   only while fewer than `mqtt.max_sessions` exist, after evicting the offline session idle
//!   longest (on this shard if it has one, else on the first other shard that has one) if
//!   need be; otherwise the CONNECT is refused (CONNACK 0x97 Quota exceeded / 3.1.1 0x03
//!   Server unavailable). The count is checked (or an evicted session's slot taken) and the
//!   session created without an await in between on a shard, so shards racing each other can
//!   exceed it by at most `shards - 1` sessions.
//! - Bytes queued for devices: every message in a session's outbox or inflight window is
//!   charged [`message_cost`] (topic + payload + properties + 256 B) to its session (at most
//!   `mqtt.max_queued_bytes`, or one message if a single one is larger) and to its shard (at
//!   most `gateway.max_outbox_memory / shards`), from enqueue until it leaves the session
//!   (QoS 0: written; QoS 1/2: acknowledged or dropped). A message that does not fit is not queued (the caller counts the drop).
//!   When it is the shard's budget that is short, [`make_room`] first drops the oldest queued
//!   messages of the session holding the most (a slow reader), if it holds more than the
//!   refused session would: a device that reads is not refused because others do not.
//!   Whatever a session still holds is released when the session ends. A delayed will waiting
//!   after its connection is charged to the shard's budget too ([`WillCharge`]; one that does
//!   not fit is published at once).
//! - Subscriptions per session: at most `mqtt.max_subscriptions_per_session`; a SUBSCRIBE
//!   beyond it gets 0x97 Quota exceeded (3.1.1: 0x80) for the new filters.
//! - Timers: a session has at most one pending expiry task and one delayed-will task
//!   ([`SessionTimers`]).

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use sluice_proto::mqtt::{reason, topic, Properties, ProtocolVersion};

use super::metrics::ShardMetrics;
use super::ShardContext;
use crate::config::{Config, MqttConfig};
use crate::edge::mqtt::session::Session;
use crate::message::OutMessage;
use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// Bytes charged for a queued message besides its topic, payload and properties: the
/// message struct in its queue slot (80 B; a queue keeps at most twice the slots it needs, and
/// an emptied outbox gives its slots back) and the inflight map's entry. The same figure as
/// `gateway.max_buffered` charges per message.
pub const MESSAGE_OVERHEAD: usize = 256;

/// What a message queued for a device is charged: topic + payload + its MQTT 5 properties
/// ([`properties_cost`]) + [`MESSAGE_OVERHEAD`].
pub fn message_cost(msg: &OutMessage) -> usize {
    msg.topic.len()
        + msg.payload.len()
        + msg.properties.as_deref().map_or(0, properties_cost)
        + MESSAGE_OVERHEAD
}

/// The heap a message's properties hold: the struct and every variable-length field (user
/// properties can be as large as the packet, so they are charged like the payload).
pub fn properties_cost(p: &Properties) -> usize {
    let text = |t: &Option<bytestring::ByteString>| t.as_ref().map_or(0, |t| t.len());
    let bytes = |b: &Option<bytes::Bytes>| b.as_ref().map_or(0, |b| b.len());
    std::mem::size_of::<Properties>()
        + text(&p.content_type)
        + text(&p.response_topic)
        + bytes(&p.correlation_data)
        + p.subscription_identifiers.len() * 4
        + text(&p.assigned_client_identifier)
        + text(&p.authentication_method)
        + bytes(&p.authentication_data)
        + text(&p.response_information)
        + text(&p.server_reference)
        + text(&p.reason_string)
        + p.user_properties
            .iter()
            .map(|(k, v)| k.len() + v.len() + 2 * std::mem::size_of::<bytestring::ByteString>())
            .sum::<usize>()
}

/// `mqtt.max_topic_levels` and `mqtt.max_topic_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicLimits {
    pub max_levels: usize,
    pub max_len: usize,
}

/// Why a topic name or filter is refused although the protocol allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TopicLimitExceeded {
    #[error("the topic is {len} bytes long, more than mqtt.max_topic_length ({max} bytes)")]
    TooLong { len: usize, max: usize },
    #[error("the topic has {levels} levels, more than mqtt.max_topic_levels ({max})")]
    TooDeep { levels: usize, max: usize },
}

impl TopicLimits {
    pub fn new(cfg: &MqttConfig) -> TopicLimits {
        TopicLimits {
            max_levels: cfg.max_topic_levels,
            max_len: cfg.max_topic_length.as_usize(),
        }
    }

    /// Whether a topic name or filter is within the limits.
    pub fn check(&self, topic: &str) -> Result<(), TopicLimitExceeded> {
        if topic.len() > self.max_len {
            return Err(TopicLimitExceeded::TooLong {
                len: topic.len(),
                max: self.max_len,
            });
        }
        let levels = topic::levels(topic);
        if levels > self.max_levels {
            return Err(TopicLimitExceeded::TooDeep {
                levels,
                max: self.max_levels,
            });
        }
        Ok(())
    }
}

/// Why a subscription was refused with a SUBACK failure code. A fixed set, so the metric's
/// label cardinality is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscribeRefusal {
    /// The filter is beyond `mqtt.max_topic_levels` or `mqtt.max_topic_length`.
    TopicLimit = 0,
    /// The session holds `mqtt.max_subscriptions_per_session` already.
    Quota = 1,
}

pub const SUBSCRIBE_REFUSALS: [(SubscribeRefusal, &str); 2] = [
    (SubscribeRefusal::TopicLimit, "topic_limit"),
    (SubscribeRefusal::Quota, "quota"),
];

/// Which bound refused a message for a device's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueLimit {
    /// The session's `mqtt.max_queued_bytes`.
    SessionBytes = 0,
    /// The shard's share of `gateway.max_outbox_memory`.
    ShardBudget = 1,
}

pub const QUEUE_LIMITS: [(QueueLimit, &str); 2] = [
    (QueueLimit::SessionBytes, "session_bytes"),
    (QueueLimit::ShardBudget, "shard_budget"),
];

/// The shard's bound-keeping metrics, rendered with [`ShardMetrics`].
#[derive(Debug, Default)]
pub struct BoundsMetrics {
    pub subscriptions_refused: [Counter; SUBSCRIBE_REFUSALS.len()],
    /// Bytes charged to this shard's outboxes and inflight windows.
    pub queued_bytes: Gauge,
    pub queue_refused: [Counter; QUEUE_LIMITS.len()],
    pub sessions_evicted: Counter,
    pub sessions_refused: Counter,
}

/// `sluice_mqtt_*` bound metrics of one shard.
pub fn render(metrics: &ShardMetrics, w: &mut PromWriter, shard: &str) {
    let m = &metrics.bounds;
    for (reason, name) in SUBSCRIBE_REFUSALS {
        w.counter(
            "sluice_mqtt_subscriptions_refused_total",
            "Subscriptions refused with a SUBACK failure, by reason",
            &[("shard", shard), ("reason", name)],
            m.subscriptions_refused[reason as usize].get(),
        );
    }
    w.gauge(
        "sluice_mqtt_queued_bytes",
        "Bytes of messages queued for devices (outboxes and inflight windows), charged topic + payload + 256 B each",
        &[("shard", shard)],
        m.queued_bytes.get(),
    );
    for (limit, name) in QUEUE_LIMITS {
        w.counter(
            "sluice_mqtt_queue_refused_total",
            "Messages for a device not queued because a byte bound was reached (also counted in sluice_mqtt_dropped_total{reason=\"session_queue_full\"}), by bound",
            &[("shard", shard), ("limit", name)],
            m.queue_refused[limit as usize].get(),
        );
    }
    w.counter(
        "sluice_mqtt_sessions_evicted_total",
        "Offline sessions ended early to make room for a new one at mqtt.max_sessions",
        &[("shard", shard)],
        m.sessions_evicted.get(),
    );
    w.counter(
        "sluice_mqtt_sessions_refused_total",
        "Connections refused at mqtt.max_sessions with no offline session to evict (CONNACK 0x97 / 0x03)",
        &[("shard", shard)],
        m.sessions_refused.get(),
    );
}

/// Whether a device may subscribe to `filter` (already a valid filter) under the topic
/// limits. A refusal is logged with the device and counted; the caller answers it in the
/// SUBACK (0x8F Topic Filter invalid for MQTT 5, 0x80 for 3.1.1) and keeps the connection.
pub fn filter_allowed(ctx: &ShardContext, client_id: &str, filter: &str) -> bool {
    match TopicLimits::new(&ctx.config.mqtt).check(filter) {
        Ok(()) => true,
        Err(error) => {
            tracing::info!(client_id, %error, "device subscribed to a filter beyond the gateway's limits; refused in the SUBACK");
            ctx.metrics.bounds.subscriptions_refused[SubscribeRefusal::TopicLimit as usize].inc();
            false
        }
    }
}

/// Whether a session may hold `filter` as well as what it holds and the filters accepted so
/// far in this SUBSCRIBE (`accepted_new`: how many of those are new to the session). A filter
/// the session already has (or just accepted) replaces its options and is always allowed.
/// A refusal is logged and counted; the caller answers 0x97 Quota exceeded (3.1.1: 0x80).
pub fn subscription_allowed<'a>(
    ctx: &ShardContext,
    session: &crate::edge::mqtt::session::Session,
    filter: &str,
    accepted: impl Iterator<Item = &'a str> + Clone,
) -> bool {
    let st = session.state.borrow();
    if st.subscriptions.contains_key(filter) || accepted.clone().any(|f| f == filter) {
        return true;
    }
    let new = accepted
        .filter(|f| !st.subscriptions.contains_key(*f))
        .count();
    let max = ctx.config.mqtt.max_subscriptions_per_session;
    if st.subscriptions.len() + new < max {
        return true;
    }
    tracing::info!(client_id = %session.client_id, max, "device reached mqtt.max_subscriptions_per_session; subscription refused in the SUBACK");
    ctx.metrics.bounds.subscriptions_refused[SubscribeRefusal::Quota as usize].inc();
    false
}

/// The SUBACK failure code for a subscription over the quota.
pub fn quota_exceeded_code(version: ProtocolVersion) -> u8 {
    match version {
        ProtocolVersion::V5 => reason::QUOTA_EXCEEDED,
        ProtocolVersion::V311 => reason::UNSPECIFIED_ERROR,
    }
}

/// One shard's share of the queued-bytes bound, shared by its sessions.
#[derive(Debug)]
pub struct OutboxBudget {
    per_session: usize,
    shard_max: usize,
    used: Cell<usize>,
    metrics: Option<Arc<ShardMetrics>>,
}

impl OutboxBudget {
    pub fn new(
        per_session: usize,
        shard_max: usize,
        metrics: Option<Arc<ShardMetrics>>,
    ) -> Rc<Self> {
        Rc::new(OutboxBudget {
            per_session,
            shard_max,
            used: Cell::new(0),
            metrics,
        })
    }

    /// No bound (sessions made outside a shard, e.g. in unit tests).
    pub fn unbounded() -> Rc<Self> {
        Self::new(usize::MAX, usize::MAX, None)
    }

    /// This shard's budget from the config.
    pub fn for_shard(config: &Config, shards: usize, metrics: Arc<ShardMetrics>) -> Rc<Self> {
        Self::new(
            config.mqtt.max_queued_bytes.as_usize(),
            config.gateway.max_outbox_memory.as_usize() / shards.max(1),
            Some(metrics),
        )
    }

    pub fn used(&self) -> usize {
        self.used.get()
    }

    fn set_used(&self, used: usize) {
        self.used.set(used);
        if let Some(m) = &self.metrics {
            m.bounds.queued_bytes.set(used as i64);
        }
    }

    fn refused(&self, limit: QueueLimit) {
        if let Some(m) = &self.metrics {
            m.bounds.queue_refused[limit as usize].inc();
        }
    }
}

/// A delayed will waiting in its timer task, charged to the shard's [`OutboxBudget`] like a
/// queued message (topic + payload + properties + 256 B); released when dropped, i.e. when the
/// will is published or its task is aborted.
#[derive(Debug)]
pub struct WillCharge {
    budget: Rc<OutboxBudget>,
    cost: usize,
}

impl WillCharge {
    /// Charge a will that is to wait; `None` if the shard's budget cannot hold it (the caller
    /// publishes it at once instead; counted as `limit="shard_budget"`).
    pub fn new(ctx: &ShardContext, will: &crate::message::DeviceMessage) -> Option<WillCharge> {
        let budget = &ctx.bounds.outbox;
        let cost = will.topic.len()
            + will.payload.len()
            + will.properties.as_deref().map_or(0, properties_cost)
            + MESSAGE_OVERHEAD;
        if budget.used() + cost > budget.shard_max {
            budget.refused(QueueLimit::ShardBudget);
            return None;
        }
        budget.set_used(budget.used() + cost);
        Some(WillCharge {
            budget: budget.clone(),
            cost,
        })
    }
}

impl Drop for WillCharge {
    fn drop(&mut self) {
        self.budget
            .set_used(self.budget.used().saturating_sub(self.cost));
    }
}

/// The bytes one session has charged to its shard's [`OutboxBudget`]; released when dropped.
#[derive(Debug)]
pub struct QueuedBytes {
    used: usize,
    budget: Rc<OutboxBudget>,
}

impl QueuedBytes {
    pub fn new(budget: Rc<OutboxBudget>) -> QueuedBytes {
        QueuedBytes { used: 0, budget }
    }

    pub fn used(&self) -> usize {
        self.used
    }

    /// Charge `msg`, or say which bound it would cross. The session's bound admits one
    /// message of any size into an empty session; the shard's bound admits nothing past it.
    pub fn charge(&mut self, msg: &OutMessage) -> Result<(), QueueLimit> {
        let cost = message_cost(msg);
        if self.used > 0 && self.used + cost > self.budget.per_session {
            self.budget.refused(QueueLimit::SessionBytes);
            return Err(QueueLimit::SessionBytes);
        }
        let shard = self.budget.used();
        if shard + cost > self.budget.shard_max {
            self.budget.refused(QueueLimit::ShardBudget);
            return Err(QueueLimit::ShardBudget);
        }
        self.used += cost;
        self.budget.set_used(shard + cost);
        Ok(())
    }

    /// `msg` left the session (written at QoS 0, acknowledged, or dropped).
    pub fn release(&mut self, msg: &OutMessage) {
        let cost = message_cost(msg).min(self.used);
        self.used -= cost;
        self.budget
            .set_used(self.budget.used().saturating_sub(cost));
    }
}

impl QueuedBytes {
    /// Everything the session held left it (the session ended).
    pub fn release_all(&mut self) {
        self.budget
            .set_used(self.budget.used().saturating_sub(self.used));
        self.used = 0;
    }
}

impl Drop for QueuedBytes {
    fn drop(&mut self) {
        self.budget
            .set_used(self.budget.used().saturating_sub(self.used));
    }
}

/// A session's pending timer tasks: its expiry after a disconnect and its delayed will. Each
/// new one aborts the one it replaces (which would find the session taken over and do
/// nothing), so a device that reconnects in a loop leaves one of each, not one per connection.
#[derive(Debug, Default)]
pub struct SessionTimers {
    expiry: Option<tokio::task::AbortHandle>,
    will: Option<tokio::task::AbortHandle>,
}

impl SessionTimers {
    pub fn set_expiry(&mut self, task: tokio::task::AbortHandle) {
        if let Some(old) = self.expiry.replace(task) {
            old.abort();
        }
    }

    pub fn set_will(&mut self, task: tokio::task::AbortHandle) {
        if let Some(old) = self.will.replace(task) {
            old.abort();
        }
    }

    /// End both (the session is being ended by someone else than these tasks).
    pub fn abort_all(&mut self) {
        for task in [self.expiry.take(), self.will.take()].into_iter().flatten() {
            task.abort();
        }
    }
}

/// What a shard keeps for the bounds: its queued-bytes budget and the gateway-wide count of
/// sessions.
pub struct ShardBounds {
    pub outbox: Rc<OutboxBudget>,
    /// Sessions on every shard (connected and offline).
    pub sessions: Arc<AtomicUsize>,
    /// The session last found holding the most of `outbox` ([`make_room`]); searched for
    /// again only when it no longer does.
    hog: RefCell<Weak<Session>>,
    /// When a search last found no session to make room from, and the most a session held
    /// then: a session holding about that much does not search again for
    /// [`HOG_SEARCH_PAUSE`] (a budget full of equal sessions costs no scan per message).
    hog_search_failed: Cell<Option<(std::time::Instant, usize)>>,
}

/// See [`ShardBounds::hog_search_failed`].
const HOG_SEARCH_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

impl ShardBounds {
    pub fn new(
        config: &Config,
        shards: usize,
        metrics: Arc<ShardMetrics>,
        sessions: Arc<AtomicUsize>,
    ) -> ShardBounds {
        ShardBounds {
            outbox: OutboxBudget::for_shard(config, shards, metrics),
            sessions,
            hog: RefCell::new(Weak::new()),
            hog_search_failed: Cell::new(None),
        }
    }

    /// A session was added to / removed from this shard's table.
    pub fn session_added(&self) {
        self.sessions.fetch_add(1, Ordering::Relaxed);
    }
    pub fn session_removed(&self) {
        self.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Before `msg` is queued for `session`: if the shard's outbox budget cannot take it, the
/// devices that read must not pay for those that do not (a slow reader's outbox would
/// otherwise hold the shared budget and every other device's messages be refused). So while
/// the budget is short and the session holding the most on this shard holds more than
/// `session` will with the message (by at least the message's size again), that session's
/// oldest queued (not yet written) messages are dropped, counted as `crowded_out`. Max-min
/// fairness: the session holding the most pays first; between sessions holding about the
/// same, nothing moves (the message is refused as before). Cost: O(1) while the same session
/// stays the largest; a scan of the shard's sessions when it no longer is, at most every
/// [`HOG_SEARCH_PAUSE`] while scans find none.
pub fn make_room(ctx: &ShardContext, session: &Session, msg: &OutMessage) {
    let budget = &ctx.bounds.outbox;
    let cost = message_cost(msg);
    if budget.used() + cost <= budget.shard_max {
        return;
    }
    let own = {
        let st = session.state.borrow();
        if !st.connected && msg.qos == sluice_proto::mqtt::QoS::AtMostOnce {
            return; // not queued anyway
        }
        st.queued.used()
    };
    if own > 0 && own + cost > budget.per_session {
        return; // its own bound refuses it anyway
    }
    // `try_borrow`: a session borrowed further up this call (none is today) is skipped.
    let enough = |s: &Session| {
        s.state
            .try_borrow()
            .is_ok_and(|st| !st.outbox.is_empty() && st.queued.used() > own + 2 * cost)
    };
    while budget.used() + cost > budget.shard_max {
        let cached = ctx.bounds.hog.borrow().upgrade();
        let hog = match cached {
            Some(h) if !std::ptr::eq(Rc::as_ptr(&h), session) && enough(&h) => h,
            _ => {
                let now = std::time::Instant::now();
                let paused = ctx
                    .bounds
                    .hog_search_failed
                    .get()
                    .is_some_and(|(at, most)| {
                        now.duration_since(at) < HOG_SEARCH_PAUSE && most <= own + 2 * cost
                    });
                if paused {
                    return;
                }
                let found = ctx
                    .sessions
                    .borrow()
                    .values()
                    .filter(|s| !std::ptr::eq(Rc::as_ptr(s), session))
                    .max_by_key(|s| s.state.try_borrow().map_or(0, |st| st.queued.used()))
                    .cloned();
                // Kept even if it does not qualify for this session: it may for the next.
                *ctx.bounds.hog.borrow_mut() = found.as_ref().map_or_else(Weak::new, Rc::downgrade);
                match found {
                    Some(h) if enough(&h) => h,
                    other => {
                        let most = other
                            .map_or(0, |h| h.state.try_borrow().map_or(0, |st| st.queued.used()));
                        ctx.bounds.hog_search_failed.set(Some((now, most)));
                        return;
                    }
                }
            }
        };
        let Ok(mut st) = hog.state.try_borrow_mut() else {
            return;
        };
        if let Some(dropped) = st.pop_outbox() {
            if dropped.qos != sluice_proto::mqtt::QoS::AtMostOnce {
                st.queued.release(&dropped);
            }
            ctx.metrics
                .count_drop(super::metrics::DropReason::CrowdedOut);
        }
    }
}

/// Make room for the session of a device that is connecting, before its CONNACK. A device
/// that resumes or replaces its own session needs no room. At `mqtt.max_sessions`, the
/// offline session idle longest on this shard is ended; if this shard has none, the other
/// shards are asked in turn (`ShardCmd::EvictOffline`) to end theirs; if none has one, the
/// device is refused (`Err(CONNACK code)`), logged and counted.
pub async fn make_room_for_session(
    ctx: &Rc<ShardContext>,
    client_id: &str,
    version: ProtocolVersion,
) -> Result<(), u8> {
    let max = ctx.config.mqtt.max_sessions;
    if ctx.sessions.borrow().contains_key(client_id)
        || ctx.bounds.sessions.load(Ordering::Relaxed) < max
    {
        return Ok(());
    }
    if evict_idlest_offline(ctx, client_id, false).await {
        return Ok(());
    }
    let shards = ctx.mailboxes.len();
    for other in (1..shards).map(|i| (ctx.id + i) % shards) {
        let (reply, evicted) = tokio::sync::oneshot::channel();
        if ctx.mailboxes[other]
            .send(super::ShardCmd::EvictOffline(reply))
            .await
            .is_err()
        {
            continue;
        }
        if evicted.await == Ok(true) {
            // The other shard kept the slot for us (see `on_evict_request`); take it now,
            // with no await before the session is created.
            ctx.bounds.session_removed();
            return Ok(());
        }
    }
    tracing::warn!(
        client_id,
        max,
        "mqtt.max_sessions reached and no offline session to evict; device refused"
    );
    ctx.metrics.bounds.sessions_refused.inc();
    Err(match version {
        ProtocolVersion::V5 => reason::QUOTA_EXCEEDED,
        ProtocolVersion::V311 => reason::V3_SERVER_UNAVAILABLE,
    })
}

/// Another shard's device needs a session at `mqtt.max_sessions`: end this shard's offline
/// session idle longest, if any, and answer whether one was ended. The slot it frees is kept
/// counted until the asking shard takes it, so no third shard can take it meanwhile.
pub fn on_evict_request(ctx: &Rc<ShardContext>, reply: tokio::sync::oneshot::Sender<bool>) {
    let ctx = ctx.clone();
    tokio::task::spawn_local(async move {
        let evicted = evict_idlest_offline(&ctx, "(on another shard)", true).await;
        let _ = reply.send(evicted);
    });
}

/// End this shard's offline session idle longest; whether there was one. With `keep_slot`
/// the gateway-wide count is not lowered (the slot is handed to another shard).
async fn evict_idlest_offline(ctx: &Rc<ShardContext>, for_device: &str, keep_slot: bool) -> bool {
    let idlest = ctx
        .sessions
        .borrow()
        .values()
        .filter_map(|s| {
            let st = s.state.borrow();
            (!st.connected).then(|| (st.offline_since, s.clone()))
        })
        .min_by_key(|(since, _)| *since)
        .map(|(_, s)| s);
    let Some(session) = idlest else {
        return false;
    };
    tracing::info!(evicted = %session.client_id, for_device, max = ctx.config.mqtt.max_sessions,
        "mqtt.max_sessions reached; ending the offline session idle longest");
    ctx.metrics.bounds.sessions_evicted.inc();
    session.state.borrow_mut().timers.abort_all();
    crate::edge::mqtt::local::end_session(ctx, &session).await;
    if keep_slot {
        // No await since end_session lowered the count: the dip is one atomic step long.
        ctx.bounds.session_added();
    }
    true
}

/// Refuse a device before its session exists: CONNACK with `code`, then close.
pub async fn refuse_connect(
    mut stream: crate::edge::mqtt::stream::DeviceWriter,
    version: ProtocolVersion,
    code: u8,
) {
    let mut out = bytes::BytesMut::new();
    let ack = sluice_proto::mqtt::Packet::ConnAck(sluice_proto::mqtt::ConnAck {
        session_present: false,
        code,
        properties: Default::default(),
    });
    if sluice_proto::mqtt::encode(&ack, version, &mut out).is_ok() {
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(&out)).await;
    }
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_within_both_limits_pass_and_others_say_which_limit() {
        let limits = TopicLimits {
            max_levels: 3,
            max_len: 10,
        };
        assert_eq!(limits.check("a/b/c"), Ok(()));
        assert_eq!(limits.check("+/+/#"), Ok(()));
        assert_eq!(limits.check("//"), Ok(()));
        assert_eq!(
            limits.check("a/b/c/d"),
            Err(TopicLimitExceeded::TooDeep { levels: 4, max: 3 })
        );
        assert_eq!(
            limits.check("///"),
            Err(TopicLimitExceeded::TooDeep { levels: 4, max: 3 })
        );
        assert_eq!(
            limits.check("abcdefghijk"),
            Err(TopicLimitExceeded::TooLong { len: 11, max: 10 })
        );
    }

    fn msg(payload: usize, qos: sluice_proto::mqtt::QoS) -> OutMessage {
        OutMessage {
            topic: "t".into(),
            payload: bytes::Bytes::from(vec![0u8; payload]),
            qos,
            retain: false,
            properties: None,
            expires_at: None,
        }
    }

    #[test]
    fn a_session_is_charged_until_its_messages_leave_and_its_bytes_stop_at_its_bound() {
        use sluice_proto::mqtt::QoS;
        let budget = OutboxBudget::new(3000, 1_000_000, None);
        let mut q = QueuedBytes::new(budget.clone());
        let m = msg(1000, QoS::AtLeastOnce);
        let cost = message_cost(&m);
        assert_eq!(cost, 1 + 1000 + MESSAGE_OVERHEAD);
        assert_eq!(q.charge(&m), Ok(()));
        assert_eq!(q.charge(&m), Ok(()));
        assert_eq!(q.charge(&m), Err(QueueLimit::SessionBytes));
        assert_eq!((q.used(), budget.used()), (2 * cost, 2 * cost));
        q.release(&m);
        assert_eq!((q.used(), budget.used()), (cost, cost));
        // An empty session takes one message of any size.
        let mut big = QueuedBytes::new(budget.clone());
        assert_eq!(big.charge(&msg(10_000, QoS::AtMostOnce)), Ok(()));
        assert_eq!(
            big.charge(&msg(1, QoS::AtMostOnce)),
            Err(QueueLimit::SessionBytes)
        );
        // Dropping a session releases what it still held.
        drop(big);
        drop(q);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn the_shards_budget_bounds_all_its_sessions_together() {
        use sluice_proto::mqtt::QoS;
        let m = msg(1000, QoS::ExactlyOnce);
        let cost = message_cost(&m);
        let budget = OutboxBudget::new(10 * cost, 3 * cost, None);
        let mut a = QueuedBytes::new(budget.clone());
        let mut b = QueuedBytes::new(budget.clone());
        assert_eq!(a.charge(&m), Ok(()));
        assert_eq!(b.charge(&m), Ok(()));
        assert_eq!(a.charge(&m), Ok(()));
        assert_eq!(b.charge(&m), Err(QueueLimit::ShardBudget));
        assert_eq!(budget.used(), 3 * cost);
        a.release(&m);
        assert_eq!(b.charge(&m), Ok(()));
        assert_eq!(
            (a.used(), b.used(), budget.used()),
            (cost, 2 * cost, 3 * cost)
        );
    }

    #[test]
    fn a_new_timer_aborts_the_one_it_replaces() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let sleeper = || {
                tokio::task::spawn_local(tokio::time::sleep(std::time::Duration::from_secs(3600)))
            };
            let mut timers = SessionTimers::default();
            let (e1, e2, w1, w2) = (sleeper(), sleeper(), sleeper(), sleeper());
            timers.set_expiry(e1.abort_handle());
            timers.set_expiry(e2.abort_handle());
            timers.set_will(w1.abort_handle());
            timers.set_will(w2.abort_handle());
            assert!(e1.await.unwrap_err().is_cancelled(), "older expiry aborted");
            assert!(w1.await.unwrap_err().is_cancelled(), "older will aborted");
            assert!(!e2.is_finished() && !w2.is_finished());
            timers.abort_all();
            assert!(e2.await.unwrap_err().is_cancelled());
            assert!(w2.await.unwrap_err().is_cancelled());
        });
    }
}
