//! The state image: retained messages and persistent sessions as the state files say they
//! are, rebuilt by applying [`Record`]s in order.
//!
//! Owns: what each record does ([`Image::apply`]), the image's bounds, and turning the image
//! back into records ([`Image::to_records`], what a snapshot holds). Does not own: files
//! (`store`) or the live stores (the control plane's retained store, the shards' sessions),
//! which the image mirrors: the writer thread applies the same changes the live stores made,
//! in the order they made them.
//!
//! Invariants: applying `to_records()` to an empty image gives an equal image; a record that
//! names a session the image does not have (or a packet id it does not hold) changes nothing
//! (a torn or dropped change never makes the image invent state); the image never holds more
//! than its [`Bounds`] (a retained message or queued message beyond them is not stored,
//! counted in `refused`).

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytestring::ByteString;
use sluice_proto::mqtt::{QoS, SubscriptionOptions};

use super::record::{MonoMs, Record, StoredMessage};

/// The image's bounds: the same limits the live stores have (`[mqtt]`).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_retained_messages: usize,
    pub max_retained_bytes: usize,
    pub max_sessions: usize,
    pub max_queued_messages: usize,
    /// Subscriptions per session kept (the shard's quota is lower or equal).
    pub max_subscriptions: usize,
}

impl Bounds {
    /// Bounds that never refuse (tests).
    pub fn unbounded() -> Bounds {
        Bounds {
            max_retained_messages: usize::MAX,
            max_retained_bytes: usize::MAX,
            max_sessions: usize::MAX,
            max_queued_messages: usize::MAX,
            max_subscriptions: usize::MAX,
        }
    }

    pub fn from_config(c: &crate::config::Config) -> Bounds {
        Bounds {
            max_retained_messages: c.mqtt.max_retained_messages,
            max_retained_bytes: c.mqtt.max_retained_bytes.as_usize(),
            max_sessions: c.mqtt.max_sessions,
            max_queued_messages: c.mqtt.max_queued_messages,
            max_subscriptions: 65_536,
        }
    }
}

/// One persistent session in the image.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionImage {
    pub expiry_s: u32,
    /// A device was connected when this was last written.
    pub online: bool,
    /// When the session ends, once offline.
    pub expires_at: Option<MonoMs>,
    pub subscriptions: BTreeMap<ByteString, (SubscriptionOptions, u32)>,
    pub outbox: VecDeque<StoredMessage>,
    /// Packet id → message and whether PUBREL was written (QoS 2 awaiting PUBCOMP).
    pub inflight: BTreeMap<u16, (StoredMessage, bool)>,
    /// Incoming QoS 2 ids PUBREC'd and awaiting PUBREL, oldest first.
    pub awaiting_rel: VecDeque<u16>,
    pub will: Option<(StoredMessage, MonoMs)>,
}

/// Retained messages and persistent sessions (see the module docs).
#[derive(Debug, Clone)]
pub struct Image {
    pub retained: HashMap<ByteString, StoredMessage>,
    retained_bytes: usize,
    pub sessions: HashMap<ByteString, SessionImage>,
    bounds: Bounds,
    /// Records not applied because they would break a bound.
    pub refused: u64,
    /// The last `Clock` record applied: (monotonic ms, wall ms).
    pub clock: Option<(MonoMs, u64)>,
}

impl PartialEq for Image {
    fn eq(&self, other: &Image) -> bool {
        self.retained == other.retained && self.sessions == other.sessions
    }
}

/// What a retained message is charged against `max_retained_bytes` (as the live store does).
pub fn retained_cost(m: &StoredMessage) -> usize {
    use crate::shard::limits::{properties_cost, MESSAGE_OVERHEAD};
    m.topic.len()
        + m.payload.len()
        + m.properties.as_deref().map_or(0, properties_cost)
        + MESSAGE_OVERHEAD
}

impl Image {
    pub fn new(bounds: Bounds) -> Image {
        Image {
            retained: HashMap::new(),
            retained_bytes: 0,
            sessions: HashMap::new(),
            bounds,
            refused: 0,
            clock: None,
        }
    }

    pub fn retained_bytes(&self) -> usize {
        self.retained_bytes
    }

    /// Apply one change.
    pub fn apply(&mut self, record: Record) {
        match record {
            Record::Clock { mono_ms, wall_ms } => self.clock = Some((mono_ms, wall_ms)),
            Record::Retain(m) => self.retain(m),
            Record::SessionOpen { client, expiry_s } => {
                if !self.sessions.contains_key(&client)
                    && self.sessions.len() >= self.bounds.max_sessions
                {
                    self.refused += 1;
                    return;
                }
                let s = self.sessions.entry(client).or_default();
                s.expiry_s = expiry_s;
                s.online = true;
                s.expires_at = None;
                s.will = None;
            }
            Record::SessionOffline { client, expires_at } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.online = false;
                    s.expires_at = Some(expires_at);
                }
            }
            Record::SessionEnd { client } => {
                self.sessions.remove(&client);
            }
            Record::Subscribe {
                client,
                filter,
                options,
                sub_id,
            } => {
                let max = self.bounds.max_subscriptions;
                if let Some(s) = self.sessions.get_mut(&client) {
                    if s.subscriptions.len() >= max && !s.subscriptions.contains_key(&filter) {
                        self.refused += 1;
                        return;
                    }
                    s.subscriptions.insert(filter, (options, sub_id));
                }
            }
            Record::Unsubscribe { client, filter } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.subscriptions.remove(&filter);
                }
            }
            Record::Enqueue { client, msg } => {
                let max = self.bounds.max_queued_messages;
                if let Some(s) = self.sessions.get_mut(&client) {
                    if msg.qos == QoS::AtMostOnce || s.outbox.len() >= max {
                        self.refused += 1;
                        return;
                    }
                    s.outbox.push_back(msg);
                }
            }
            Record::PopOutbox { client } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.outbox.pop_front();
                }
            }
            Record::Send { client, packet_id } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    if let Some(m) = s.outbox.pop_front() {
                        s.inflight.insert(packet_id, (m, false));
                    }
                }
            }
            Record::Released { client, packet_id } => {
                if let Some((_, released)) = self
                    .sessions
                    .get_mut(&client)
                    .and_then(|s| s.inflight.get_mut(&packet_id))
                {
                    *released = true;
                }
            }
            Record::Acked { client, packet_id } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.inflight.remove(&packet_id);
                }
            }
            Record::AwaitRel {
                client,
                packet_id,
                bound,
            } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    if !s.awaiting_rel.contains(&packet_id) {
                        s.awaiting_rel.push_back(packet_id);
                    }
                    while s.awaiting_rel.len() > bound.max(1) as usize {
                        s.awaiting_rel.pop_front();
                    }
                }
            }
            Record::RelDone { client, packet_id } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.awaiting_rel.retain(|id| *id != packet_id);
                }
            }
            Record::Will {
                client,
                msg,
                publish_at,
            } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.will = Some((msg, publish_at));
                }
            }
            Record::WillDone { client } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.will = None;
                }
            }
            Record::DropQueued { client } => {
                if let Some(s) = self.sessions.get_mut(&client) {
                    s.outbox.clear();
                    s.inflight.clear();
                }
            }
        }
    }

    fn retain(&mut self, m: StoredMessage) {
        let old = self.retained.get(&m.topic).map_or(0, retained_cost);
        if m.payload.is_empty() {
            if self.retained.remove(&m.topic).is_some() {
                self.retained_bytes -= old;
            }
            return;
        }
        let new = retained_cost(&m);
        if (old == 0 && self.retained.len() >= self.bounds.max_retained_messages)
            || self.retained_bytes - old + new > self.bounds.max_retained_bytes
        {
            self.refused += 1;
            return;
        }
        self.retained_bytes = self.retained_bytes - old + new;
        self.retained.insert(m.topic.clone(), m);
    }

    /// Records that rebuild this image from an empty one (a snapshot's body), in a
    /// deterministic order (sorted by topic and client id). `emit` is called once per record.
    pub fn to_records(&self, mut emit: impl FnMut(Record)) {
        let mut topics: Vec<&ByteString> = self.retained.keys().collect();
        topics.sort();
        for t in topics {
            emit(Record::Retain(self.retained[t].clone()));
        }
        let mut clients: Vec<&ByteString> = self.sessions.keys().collect();
        clients.sort();
        for c in clients {
            let s = &self.sessions[c];
            emit(Record::SessionOpen {
                client: c.clone(),
                expiry_s: s.expiry_s,
            });
            for (filter, (options, sub_id)) in &s.subscriptions {
                emit(Record::Subscribe {
                    client: c.clone(),
                    filter: filter.clone(),
                    options: *options,
                    sub_id: *sub_id,
                });
            }
            for (id, (m, released)) in &s.inflight {
                emit(Record::Enqueue {
                    client: c.clone(),
                    msg: m.clone(),
                });
                emit(Record::Send {
                    client: c.clone(),
                    packet_id: *id,
                });
                if *released {
                    emit(Record::Released {
                        client: c.clone(),
                        packet_id: *id,
                    });
                }
            }
            for m in &s.outbox {
                emit(Record::Enqueue {
                    client: c.clone(),
                    msg: m.clone(),
                });
            }
            for id in &s.awaiting_rel {
                emit(Record::AwaitRel {
                    client: c.clone(),
                    packet_id: *id,
                    bound: u16::MAX,
                });
            }
            if let Some(at) = s.expires_at.filter(|_| !s.online) {
                emit(Record::SessionOffline {
                    client: c.clone(),
                    expires_at: at,
                });
            }
            if let Some((m, at)) = &s.will {
                emit(Record::Will {
                    client: c.clone(),
                    msg: m.clone(),
                    publish_at: *at,
                });
            }
        }
    }

    /// Move every deadline by `delta` ms (after a restart: from the old process's monotonic
    /// clock to this one's, see `store::rebase`). Online sessions become offline from
    /// `now` (their device is gone with the old process) and end `expiry_s` later.
    pub fn rebase(&mut self, delta: i64, now: MonoMs) {
        let shift = |t: &mut MonoMs| *t = t.saturating_add(delta);
        for m in self.retained.values_mut() {
            if let Some(t) = m.expires_at.as_mut() {
                shift(t);
            }
        }
        for s in self.sessions.values_mut() {
            if s.online {
                s.online = false;
                s.expires_at = Some(now.saturating_add(s.expiry_s as i64 * 1000));
            } else if let Some(t) = s.expires_at.as_mut() {
                shift(t);
            }
            for m in s
                .outbox
                .iter_mut()
                .chain(s.inflight.values_mut().map(|(m, _)| m))
            {
                if let Some(t) = m.expires_at.as_mut() {
                    shift(t);
                }
            }
            if let Some((m, at)) = s.will.as_mut() {
                shift(at);
                if let Some(t) = m.expires_at.as_mut() {
                    shift(t);
                }
            }
        }
    }
}
