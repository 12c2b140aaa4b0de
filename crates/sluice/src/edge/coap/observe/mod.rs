//! Observe (RFC 7641) subscriptions on the pub/sub resource: `GET {pubsub_path}/{filter}`
//! with Observe=0 registers, every routed message matching `filter` becomes a notification.
//!
//! Owns: the registrations of one shard, keyed by (peer, token); the notification task of
//! each; which recent NON notification went to whom (so an RST for one deregisters).
//! Does not own: the socket, retransmission of CONs and de-duplication (the edge's
//! [`CoapOut`]), routing (`shard::router`), the retained store (control plane).
//!
//! How messages reach an observer: each registration gets its own [`Session`] (client id
//! `coap/{device}/{token hex}`), subscribed to its filter with `router::subscribe` at QoS 0,
//! exactly as an MQTT device's session is; the router's local fan-out queues matching
//! messages in the session's outbox (charged to the shard's queued-bytes budget), other
//! shards reach it through the snapshot and this shard's mailbox, the cloud's `receive`
//! through `deliver_downlink`. The session is *not* in `ShardContext::sessions`: nothing
//! looks it up by client id (no takeover, no eviction, not counted in `mqtt.max_sessions`),
//! so its id cannot collide with an MQTT device's. A local task per registration
//! (`notify::run`) drains the outbox into notifications through [`CoapOut`].
//!
//! A notification larger than `coap.max_message_size` goes to a verified observer block-wise
//! (RFC 7959 §2.6): the notification carries block 0 with an ETag and Size2, and the client
//! GETs the later blocks (without Observe), which are answered from a copy of that very
//! representation ([`Snapshots`]: the latest per (address, filter), within
//! `coap.max_snapshot_bytes / shards`, none older than `exchange_lifetime`) — never from a
//! newer retained value. When the copy is gone (replaced by a newer notification, evicted,
//! expired) a later block comes from the retained value with that value's ETag, or is
//! 4.04: the ETag tells the client the blocks do not belong together. An unverified observer
//! gets no block-wise notification (a block is far more than 3× its registration).
//!
//! A registration from an address that has not proven it receives (see `super::verify`) may
//! be spoofed: until the address is verified, every notification to it is CON, at most 3×
//! the registration request (larger ones are dropped, counted), retransmitted only within
//! 3×; the first one not acknowledged ends the registration. Its ACK verifies the address.
//!
//! Invariants: at most `coap.max_observers / shards` registrations, at most
//! `coap.max_observers_per_source` of one IP address on a shard, and at most
//! `mqtt.max_subscriptions_per_session` of one DTLS-authenticated device on a shard (its
//! identity is the device; a plain CoAP device's `c=` id is only a claim, so it is bounded
//! by its address alone) — beyond each: 5.03 with Max-Age, counted, logged naming the
//! address or device;
//! an observer not confirmed (a CON notification ACKed, or a registration) for
//! `coap.observer_check` gets a CON notification — the next one due, or its last state
//! again when none is — and is removed when that CON is not acknowledged, so a NON observer
//! that went away (or a spoofed one) does not hold its slot for good; a registration leaves the map, its task is stopped, its subscription removed
//! and its queued messages released together (`remove`); Observe values of one
//! (peer, token) only increase (a re-registration continues the sequence), modulo 2^24.

mod format;
mod metrics;
mod notify;
#[cfg(test)]
mod tests;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Instant;

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use sluice_proto::mqtt::{topic, QoS, SubscriptionOptions};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::CoapOut;
use crate::control::{ControlCmd, RetainedMessage};
use crate::edge::mqtt::session::Session;
use crate::shard::{router, ShardContext};

pub use format::{content_format_of, content_type_of};
pub use metrics::{Deregistration, NotificationDrop, ObserveMetrics};

/// Observe values are 24 bits (RFC 7641 §3.4).
const SEQ_MASK: u32 = 0x00FF_FFFF;
/// NON notifications remembered per registration, so an RST for one finds its observer.
const RECENT_MIDS: usize = 8;
/// Bytes a snapshot is charged besides its body and filter: the map entry, its key and the
/// `Snapshot`.
pub(super) const SNAPSHOT_OVERHEAD: usize = 128;

type Key = (SocketAddr, Token);

/// One observer: a (peer, token) subscribed to `filter`.
struct Registration {
    /// Unique on the shard: tells a registration from the one that replaced it.
    id: u64,
    peer: SocketAddr,
    token: Token,
    filter: ByteString,
    /// The device's authenticated identity (DTLS), for the per-device cap; `None` for a
    /// plain CoAP observer.
    identity: Option<ByteString>,
    session: Rc<Session>,
    /// The last Observe value sent (response or notification).
    seq: Cell<u32>,
    /// NON notifications sent since the last CON one.
    since_con: Cell<u32>,
    /// The registration request's datagram size: while its address has not proven it
    /// receives, a notification is at most 3× this, CON, retransmitted within 3×.
    req_size: usize,
    /// When the observer last showed it is there: registered, or ACKed a CON notification.
    confirmed: Cell<Instant>,
    /// The last state sent: repeated as a CON when the observer must be checked and no
    /// notification is due. At most `max_message_size` (a block-wise one is kept as its
    /// block 0, copied).
    last: RefCell<LastState>,
    /// Message ids of the latest NON notifications, oldest first.
    recent_mids: RefCell<VecDeque<u16>>,
    task: RefCell<Option<JoinHandle<()>>>,
    closed: Cell<bool>,
}

/// What the last notification (or the registration's answer) carried.
#[derive(Debug, Clone, Default)]
pub(super) struct LastState {
    pub payload: Bytes,
    pub format: Option<u16>,
    /// A block-wise notification's block 0: its Block2 value, Size2 and ETag.
    pub block0: Option<(u32, u32, [u8; 8])>,
}

/// A representation notified block-wise, kept for the client's later-block GETs.
pub(super) struct Snapshot {
    pub etag: [u8; 8],
    pub body: Bytes,
    pub format: Option<u16>,
    /// The block size (SZX) block 0 went with: later blocks are cut the same way.
    pub szx: u8,
    pub at: Instant,
}

/// The snapshots of one shard's observers, by (observer address, filter), within `max`
/// bytes (each charged its body, its filter and [`SNAPSHOT_OVERHEAD`]).
#[derive(Default)]
pub(super) struct Snapshots {
    map: HashMap<(SocketAddr, ByteString), Snapshot>,
    bytes: usize,
    max: usize,
}

impl Snapshots {
    fn cost(filter: &str, body: &Bytes) -> usize {
        body.len() + filter.len() + SNAPSHOT_OVERHEAD
    }

    /// Keep `snap` for (`peer`, `filter`), replacing the one before, after forgetting the
    /// expired ones and then the oldest until it fits; `false` when it cannot fit at all.
    fn insert(
        &mut self,
        peer: SocketAddr,
        filter: &ByteString,
        snap: Snapshot,
        lifetime: std::time::Duration,
    ) -> bool {
        let cost = Self::cost(filter, &snap.body);
        if cost > self.max {
            return false;
        }
        self.remove(peer, filter);
        let now = snap.at;
        {
            // Expired copies go whenever a new one comes (a linear pass: the table holds at
            // most `max / (max_message_size + 128 B)` of them).
            let mut freed = 0;
            self.map.retain(|(_, f), s| {
                let keep = now.duration_since(s.at) < lifetime;
                if !keep {
                    freed += Self::cost(f, &s.body);
                }
                keep
            });
            self.bytes -= freed;
        }
        while self.bytes + cost > self.max {
            let oldest = self
                .map
                .iter()
                .min_by_key(|(_, s)| s.at)
                .map(|(k, _)| k.clone());
            match oldest {
                Some((p, f)) => self.remove(p, &f),
                None => break,
            }
        }
        self.bytes += cost;
        self.map.insert((peer, filter.clone()), snap);
        true
    }

    fn remove(&mut self, peer: SocketAddr, filter: &ByteString) {
        if let Some(old) = self.map.remove(&(peer, filter.clone())) {
            self.bytes -= Self::cost(filter, &old.body);
        }
    }

    fn get(
        &self,
        peer: SocketAddr,
        filter: &str,
        lifetime: std::time::Duration,
    ) -> Option<&Snapshot> {
        self.map
            .get(&(peer, ByteString::from(filter)))
            .filter(|s| s.at.elapsed() < lifetime)
    }

    /// Bytes charged.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Registration {
    fn next_seq(&self) -> u32 {
        let s = (self.seq.get() + 1) & SEQ_MASK;
        self.seq.set(s);
        s
    }
}

/// The observers of one shard.
pub struct Observers {
    ctx: Rc<ShardContext>,
    out: Rc<dyn CoapOut>,
    regs: RefCell<HashMap<Key, Rc<Registration>>>,
    /// Representations notified block-wise, for the later blocks.
    pub(super) snapshots: RefCell<Snapshots>,
    /// (peer, message id) of a recent NON notification → its registration's token.
    by_mid: RefCell<HashMap<(SocketAddr, u16), Token>>,
    /// This shard's share of `coap.max_observers`.
    limit: usize,
    next_id: Cell<u64>,
    /// When a per-source refusal was last logged (at most one line a second).
    refusal_logged: Cell<Option<Instant>>,
    /// Start of the clock new sequences start from (so a deregistered and re-registered
    /// token likely continues above its old values).
    epoch: Instant,
}

impl Observers {
    pub fn new(ctx: Rc<ShardContext>, out: Rc<dyn CoapOut>) -> Rc<Observers> {
        let shards = ctx.mailboxes.len().max(1);
        let limit = (ctx.config.coap.max_observers / shards).max(1);
        let snapshot_max = ctx.config.coap.max_snapshot_bytes.as_usize() / shards;
        Rc::new(Observers {
            ctx,
            out,
            regs: RefCell::new(HashMap::new()),
            snapshots: RefCell::new(Snapshots {
                max: snapshot_max,
                ..Snapshots::default()
            }),
            by_mid: RefCell::new(HashMap::new()),
            limit,
            next_id: Cell::new(0),
            refusal_logged: Cell::new(None),
            epoch: Instant::now(),
        })
    }

    /// A GET on the pub/sub resource from `device` at `peer`; `filter` is the Uri-Path after
    /// `pubsub_path`, joined by `/`. Returns the response (code, options, payload; the caller
    /// sets type, message id and token and sends it).
    pub async fn on_get(
        self: &Rc<Self>,
        peer: SocketAddr,
        device: &ByteString,
        req: &Message,
        filter: &str,
    ) -> Message {
        self.on_get_from(peer, device, false, req, filter).await
    }

    /// [`Observers::on_get`] from a device that is `authenticated` (over DTLS: `device` is
    /// its identity, and its registrations count against `mqtt.max_subscriptions_per_session`).
    pub async fn on_get_from(
        self: &Rc<Self>,
        peer: SocketAddr,
        device: &ByteString,
        authenticated: bool,
        req: &Message,
        filter: &str,
    ) -> Message {
        if filter.is_empty()
            || !topic::valid_topic_filter(filter)
            || topic::shared_subscription(filter).is_some()
        {
            return diagnostic(req, Code::BAD_REQUEST, "invalid topic filter");
        }
        if !(self.ctx.acl).allows_subscribe(crate::control::acl::Edge::Coap, device, None, filter) {
            return diagnostic(req, Code::FORBIDDEN, "not authorized"); // [acl]: observe and GET
        }
        let plain = topic::valid_topic_name(filter);
        let key = (peer, req.token);
        if req.uint_option(opt::OBSERVE) == Some(0) {
            let identity = authenticated.then(|| device.clone());
            return self
                .register(key, device, identity, req, filter, plain)
                .await;
        }
        // No Observe, Observe = 1, or a value RFC 7641 does not define: a plain GET, which
        // also ends a registration of this endpoint and token (§3.6, §4.1) — except a GET
        // for a later block of a large state, which continues the registration's first
        // answer (RFC 7959 §2.6).
        let later_block = req.uint_option(opt::BLOCK2).is_some_and(|b| b >> 4 > 0);
        if later_block {
            if let Some(m) = self.from_snapshot(peer, req, filter) {
                return m;
            }
        }
        let had = !later_block && self.deregister(peer, req.token, Deregistration::Get).await;
        let retained = if plain {
            retained_of(&self.ctx, filter).await
        } else {
            None
        };
        match retained {
            Some(r) => content(req, None, &r.payload, r.properties.as_deref()),
            None if had => content(req, None, &Bytes::new(), None),
            None if plain => diagnostic(req, Code::NOT_FOUND, "no retained message"),
            None => diagnostic(
                req,
                Code::BAD_REQUEST,
                "a filter has no single retained message",
            ),
        }
    }

    /// The block a later-block GET asks for, cut from the representation last notified
    /// block-wise to `peer` under `filter`, with its ETag; `None` when none is kept.
    fn from_snapshot(&self, peer: SocketAddr, req: &Message, filter: &str) -> Option<Message> {
        let lifetime = self.ctx.config.coap.exchange_lifetime;
        let snaps = self.snapshots.borrow();
        let snap = snaps.get(peer, filter, lifetime)?;
        let mut m = Message::new(MsgType::Ack, Code::CONTENT, 0, req.token);
        if let Some(f) = snap.format {
            m.add_uint_option(opt::CONTENT_FORMAT, f as u32);
        }
        m.add_option(opt::ETAG, Bytes::copy_from_slice(&snap.etag));
        let asked = req.uint_option(opt::BLOCK2);
        Some(super::resources::slice_block2(
            asked,
            snap.szx,
            m,
            snap.body.clone(),
        ))
    }

    /// End the registration of (`peer`, `token`) whose first answer could not be sent (too
    /// large for an address that has not proven it receives).
    pub async fn withdraw(&self, peer: SocketAddr, token: Token) {
        self.deregister(peer, token, Deregistration::Unconfirmed)
            .await;
    }

    /// An RST from `peer` for message id `mid` that matched no CON sluice is retransmitting
    /// (a NON notification the device no longer wants).
    pub fn on_reset(&self, peer: SocketAddr, mid: u16) {
        self.reset_matched(peer, mid);
    }

    /// [`Observers::on_reset`], telling whether the RST was for a recent notification (and
    /// deregistered its observer); the edge counts the others as unmatched.
    pub fn reset_matched(&self, peer: SocketAddr, mid: u16) -> bool {
        let token = self.by_mid.borrow().get(&(peer, mid)).copied();
        let reg = token.and_then(|t| self.regs.borrow().get(&(peer, t)).cloned());
        match reg {
            Some(reg) if reg.recent_mids.borrow().contains(&mid) => {
                self.remove(&reg, Deregistration::Reset);
                true
            }
            _ => false,
        }
    }

    /// End every registration of `peer` (its DTLS session ended: nothing can reach it).
    pub fn forget_peer(&self, peer: SocketAddr) {
        let gone: Vec<Rc<Registration>> = self
            .regs
            .borrow()
            .values()
            .filter(|r| r.peer == peer)
            .cloned()
            .collect();
        for reg in gone {
            self.remove(&reg, Deregistration::Silence);
        }
    }

    /// Observers registered on this shard.
    pub fn len(&self) -> usize {
        self.regs.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether (`peer`, `token`) observes, and its filter.
    pub fn filter_of(&self, peer: SocketAddr, token: Token) -> Option<ByteString> {
        self.regs
            .borrow()
            .get(&(peer, token))
            .map(|r| r.filter.clone())
    }

    /// This shard's share of `coap.max_observers`.
    pub fn limit(&self) -> usize {
        self.limit
    }

    async fn register(
        self: &Rc<Self>,
        key: Key,
        device: &ByteString,
        identity: Option<ByteString>,
        req: &Message,
        filter: &str,
        plain: bool,
    ) -> Message {
        let metrics = &self.ctx.metrics.coap_observe;
        let old = self.regs.borrow().get(&key).cloned();
        let start = match &old {
            Some(old) => {
                let last = old.seq.get();
                self.remove(old, Deregistration::Replaced);
                last
            }
            None if self.len() >= self.limit => {
                metrics.refused.inc();
                return self.busy(req, "too many observers");
            }
            None if self.of_source(key.0) >= self.ctx.config.coap.max_observers_per_source => {
                metrics.refused_per_source.inc();
                if self.refusal_log_due() {
                    tracing::info!(peer = %key.0, "coap observe refused: coap.max_observers_per_source reached");
                }
                return self.busy(req, "too many observers from this address");
            }
            None if identity.as_ref().is_some_and(|id| {
                self.of_device(id) >= self.ctx.config.mqtt.max_subscriptions_per_session
            }) =>
            {
                metrics.refused_per_device.inc();
                if self.refusal_log_due() {
                    tracing::info!(device = %device, peer = %key.0, max = self.ctx.config.mqtt.max_subscriptions_per_session,
                        "coap observe refused: the device holds mqtt.max_subscriptions_per_session observers");
                }
                return self.busy(req, "too many observers for this device");
            }
            None => (self.epoch.elapsed().as_millis() / 8) as u32 & SEQ_MASK,
        };
        let id = self.next_id.get() + 1;
        self.next_id.set(id);
        let mut client_id = format!("coap/{device}/");
        for b in key.1.as_slice() {
            let _ = write!(client_id, "{b:02x}");
        }
        let q = self.ctx.config.coap.max_queued_notifications.max(1);
        let session = Session::with_budget(
            ByteString::from(client_id),
            q.saturating_mul(4).max(64),
            self.ctx.bounds.outbox.clone(),
        );
        session.state.borrow_mut().connected = true;
        let reg = Rc::new(Registration {
            id,
            peer: key.0,
            token: key.1,
            filter: ByteString::from(filter),
            identity,
            session: session.clone(),
            seq: Cell::new(start),
            since_con: Cell::new(0),
            req_size: 4 + req.token.len() + req.options_len(),
            confirmed: Cell::new(Instant::now()),
            last: RefCell::new(LastState::default()),
            recent_mids: RefCell::new(VecDeque::new()),
            task: RefCell::new(None),
            closed: Cell::new(false),
        });
        // In the map before the first await: a second GET or an RST meanwhile sees it.
        self.regs.borrow_mut().insert(key, reg.clone());
        metrics.registrations.inc();
        metrics.observers.add(1);
        let options = SubscriptionOptions {
            qos: QoS::AtMostOnce,
            no_local: false,
            retain_as_published: false,
            retain_handling: 0,
        };
        let retained = router::subscribe(
            &self.ctx,
            &session,
            &[(reg.filter.clone(), options, plain)],
            0,
        )
        .await;
        if reg.closed.get() {
            // Deregistered while subscribing (an RST, a plain GET): `remove` cleaned up.
            return content(req, None, &Bytes::new(), None);
        }
        let task = tokio::task::spawn_local(notify::run(reg.clone(), Rc::downgrade(self)));
        *reg.task.borrow_mut() = Some(task);
        let seq = reg.next_seq();
        let first = match retained.first() {
            Some(r) => content(req, Some(seq), &r.payload, r.properties.as_deref()),
            None => content(req, Some(seq), &Bytes::new(), None),
        };
        // A first answer too large for one datagram goes block-wise (`server::fit`); a check
        // repeats nothing larger than a datagram.
        if first.payload.len() <= self.ctx.config.coap.max_message_size.as_usize() {
            *reg.last.borrow_mut() = LastState {
                payload: first.payload.clone(),
                format: first
                    .uint_option(opt::CONTENT_FORMAT)
                    .map(|f| f.min(u16::MAX as u32) as u16),
                block0: None,
            };
        }
        first
    }

    /// Registrations of `peer`'s IP address on this shard.
    fn of_source(&self, peer: SocketAddr) -> usize {
        let ip = peer.ip();
        self.regs
            .borrow()
            .keys()
            .filter(|(p, _)| p.ip() == ip)
            .count()
    }

    /// The snapshots held `before` bytes: move the shard's gauge (shared by both CoAP edges)
    /// by the difference.
    fn snapshots_changed(&self, before: usize) {
        let after = self.snapshots.borrow().bytes();
        let gauge = &self.ctx.metrics.coap_observe.snapshot_bytes;
        gauge.add(after as i64 - before as i64);
    }

    /// Registrations of the authenticated device `identity` on this shard.
    /// Whether a refusal may be logged now: at most one line a second per shard.
    fn refusal_log_due(&self) -> bool {
        let now = Instant::now();
        let due = self
            .refusal_logged
            .get()
            .is_none_or(|t| now.duration_since(t).as_secs() >= 1);
        if due {
            self.refusal_logged.set(Some(now));
        }
        due
    }

    fn of_device(&self, identity: &ByteString) -> usize {
        self.regs
            .borrow()
            .values()
            .filter(|r| r.identity.as_ref() == Some(identity))
            .count()
    }

    /// 5.03 with Max-Age = `coap.retry_after`.
    fn busy(&self, req: &Message, why: &'static str) -> Message {
        let mut m = diagnostic(req, Code::SERVICE_UNAVAILABLE, why);
        let secs = self.ctx.config.coap.retry_after.as_secs().max(1);
        m.add_uint_option(opt::MAX_AGE, secs.min(u32::MAX as u64) as u32);
        m
    }

    /// End the registration of (`peer`, `token`), if any; returns whether there was one.
    /// Waits until its subscription is gone from the shard's trie and the control plane.
    async fn deregister(&self, peer: SocketAddr, token: Token, why: Deregistration) -> bool {
        let reg = self.regs.borrow().get(&(peer, token)).cloned();
        match reg {
            Some(reg) => {
                if let Some(cleanup) = self.remove(&reg, why) {
                    let _ = cleanup.await;
                }
                true
            }
            None => false,
        }
    }

    /// Take `reg` out (if it is still registered): stop its task, forget its message ids,
    /// and remove its subscription and queued messages in a task of their own (returned), so
    /// this works from inside `reg`'s own task and from synchronous callers.
    fn remove(&self, reg: &Rc<Registration>, why: Deregistration) -> Option<JoinHandle<()>> {
        if reg.closed.replace(true) {
            return None;
        }
        {
            let mut regs = self.regs.borrow_mut();
            if regs
                .get(&(reg.peer, reg.token))
                .is_some_and(|r| r.id == reg.id)
            {
                regs.remove(&(reg.peer, reg.token));
            }
        }
        {
            let mut by_mid = self.by_mid.borrow_mut();
            for mid in reg.recent_mids.borrow_mut().drain(..) {
                if by_mid.get(&(reg.peer, mid)) == Some(&reg.token) {
                    by_mid.remove(&(reg.peer, mid));
                }
            }
        }
        let others = self
            .regs
            .borrow()
            .values()
            .any(|r| r.peer == reg.peer && r.filter == reg.filter);
        if !others {
            let before = self.snapshots.borrow().bytes();
            self.snapshots.borrow_mut().remove(reg.peer, &reg.filter);
            self.snapshots_changed(before);
        }
        let metrics = &self.ctx.metrics.coap_observe;
        metrics.deregistered(why);
        metrics.observers.sub(1);
        tracing::debug!(peer = %reg.peer, filter = %reg.filter, ?why, "coap observer deregistered");
        // Aborting the running task from inside itself only takes effect at its next await,
        // which it never reaches: it returns right after calling this.
        if let Some(task) = reg.task.borrow_mut().take() {
            task.abort();
        }
        let ctx = self.ctx.clone();
        let session = reg.session.clone();
        let filter = reg.filter.clone();
        Some(tokio::task::spawn_local(async move {
            router::unsubscribe(&ctx, &session, &filter).await;
            session.state.borrow_mut().drop_queued();
        }))
    }

    /// Remember that NON notification `mid` went to `reg` (for `on_reset`).
    fn sent_non(&self, reg: &Registration, mid: u16) {
        let mut by_mid = self.by_mid.borrow_mut();
        let mut recent = reg.recent_mids.borrow_mut();
        if recent.len() >= RECENT_MIDS {
            if let Some(old) = recent.pop_front() {
                if by_mid.get(&(reg.peer, old)) == Some(&reg.token) {
                    by_mid.remove(&(reg.peer, old));
                }
            }
        }
        recent.push_back(mid);
        by_mid.insert((reg.peer, mid), reg.token);
    }
}

/// The retained message of topic `name`, asked of the control plane without subscribing.
async fn retained_of(ctx: &ShardContext, name: &str) -> Option<RetainedMessage> {
    let (reply, rx) = oneshot::channel();
    let cmd = ControlCmd::Subscribe {
        shard: ctx.id,
        add: Vec::new(),
        retained_for: vec![ByteString::from(name)],
        reply,
    };
    ctx.control.send(cmd).await.ok()?;
    let now = Instant::now();
    rx.await
        .ok()?
        .into_iter()
        .find(|r| r.topic == name && !matches!(r.expires_at, Some(at) if at <= now))
}

/// A 2.05 Content response: Observe `seq` when given, Content-Format from the message's
/// MQTT 5 content type when it has a CoAP one, `payload`.
fn content(
    req: &Message,
    seq: Option<u32>,
    payload: &Bytes,
    properties: Option<&sluice_proto::mqtt::Properties>,
) -> Message {
    let mut m = Message::new(MsgType::Ack, Code::CONTENT, 0, req.token);
    if let Some(seq) = seq {
        m.add_uint_option(opt::OBSERVE, seq);
    }
    if let Some(f) = properties
        .and_then(|p| p.content_type.as_deref())
        .and_then(content_format_of)
    {
        m.add_uint_option(opt::CONTENT_FORMAT, f as u32);
    }
    m.payload = payload.clone();
    m
}

/// An error response with a diagnostic payload (RFC 7252 §5.5.2).
fn diagnostic(req: &Message, code: Code, text: &'static str) -> Message {
    let mut m = Message::new(MsgType::Ack, code, 0, req.token);
    m.payload = Bytes::from_static(text.as_bytes());
    m
}
