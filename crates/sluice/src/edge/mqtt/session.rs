//! MQTT session state of one device, owned by the device's shard.
//!
//! A session outlives its connection when it is persistent (3.1.1 clean session = 0, or an
//! MQTT 5 session expiry > 0): its subscriptions stay in the shard's trie and messages for it
//! queue in its bounded outbox until the device reconnects or the session expires. Because a
//! device always hashes to the same shard, the session is found again without a global
//! lookup. Invariants: the outbox holds at most `max_queued` messages (overflow: the new
//! message is dropped and counted); `inflight` holds QoS 1/2 messages written to the device
//! and not yet acknowledged, resent with DUP when the device reconnects. Input bounds
//! (`shard::limits`): every message in the outbox or inflight is charged to `queued` (the
//! session's `max_queued_bytes` and the shard's share of `max_outbox_memory`) until it leaves
//! through `pop_outbox` (QoS 0), `remove_inflight` (QoS 1/2) or `drop_queued` (session end);
//! `timers` holds at most one pending expiry and one delayed will. Incoming QoS 2
//! state (`awaiting_rel`: ids PUBREC'd, awaiting PUBREL) is the session's too, so a PUBLISH
//! the device resends after a reconnect is acknowledged again and never forwarded twice; it
//! holds at most `receive_maximum` ids. A delayed will waits here while the device is away.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use sluice_proto::mqtt::{QoS, SubscriptionOptions};
use tokio::sync::Notify;

use crate::control::priority::Priority;
use crate::message::{DeviceMessage, OutMessage, QueueRefusal};
use crate::shard::limits::{OutboxBudget, QueuedBytes, SessionTimers};
use crate::shard::subscriber::DeliveryStamp;

/// Where a QoS 1/2 message written to the device is in its acknowledgement flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutStage {
    /// QoS 1 PUBLISH written, waiting for PUBACK; or QoS 2 waiting for PUBREC.
    AwaitingAck,
    /// QoS 2: PUBREL written, waiting for PUBCOMP.
    AwaitingComp,
}

#[derive(Debug)]
pub struct SessionState {
    pub subscriptions: HashMap<ByteString, SubscriptionOptions>,
    pub outbox: VecDeque<OutMessage>,
    pub inflight: BTreeMap<u16, (OutMessage, OutStage)>,
    next_packet_id: u16,
    /// How long the session outlives a disconnect (zero: it ends with the connection).
    pub expiry: Duration,
    pub connected: bool,
    /// Input bounds: bytes of `outbox` + `inflight` charged to the shard (`shard::limits`).
    pub queued: QueuedBytes,
    /// Input bounds: when the device last disconnected (eviction order at `max_sessions`).
    pub offline_since: Option<Instant>,
    /// Input bounds: the session's pending expiry and delayed-will tasks, at most one each.
    pub timers: SessionTimers,
    /// Incoming QoS 2: packet ids PUBREC'd to the device and awaiting its PUBREL, oldest
    /// first. Kept with the session, so a PUBLISH resent (DUP) after a reconnect is
    /// acknowledged again but never forwarded twice.
    pub awaiting_rel: AwaitingRel,
    /// A will waiting for its delay while the device is away (MQTT 5 Will Delay Interval):
    /// cancelled when the device reconnects to this session, published when the delay passes
    /// or the session ends, whichever is first.
    /// Boxed: rare, and `DeviceMessage` inline would cost every session.
    pub will: Option<Box<PendingWill>>,
    /// Set once the session is ending (expired, or a clean-start connection replaced it); a
    /// connection taken over by then publishes its will at once.
    pub ended: bool,
    /// `[state] dir`: where the changes of a persistent session are logged.
    pub journal: Journal,
}

/// Logs the changes of a persistent session to the state directory (`crate::state`).
/// Off for a session that ends with its connection, and without `[state] dir`: then
/// [`Journal::record`] is one branch.
#[derive(Debug, Default)]
pub struct Journal {
    /// The state log and the client id its records name; `None` without `[state] dir`
    /// (memory: then the session keeps no second copy of its client id's handle).
    log: Option<Box<(crate::state::StateLog, ByteString)>>,
    on: bool,
}

impl Journal {
    pub fn new() -> Journal {
        Journal::default()
    }
    /// Log to `log` (if any), naming `client` in the records.
    pub fn attach(&mut self, log: Option<crate::state::StateLog>, client: &ByteString) {
        self.log = log.map(|log| Box::new((log, client.clone())));
    }
    pub fn is_on(&self) -> bool {
        self.on && self.log.is_some()
    }
    pub fn set_on(&mut self, on: bool) {
        self.on = on;
    }
    /// Log the record `make` builds from the client id and the state clock, if on.
    pub fn record(
        &self,
        make: impl FnOnce(ByteString, &crate::state::StateClock) -> crate::state::Record,
    ) {
        if !self.on {
            return;
        }
        if let Some(log) = &self.log {
            let (log, client) = &**log;
            log.push(make(client.clone(), log.clock()));
        }
    }
}

impl OutMessage {
    /// As the state files keep it (deadline on the state clock).
    pub fn stored(&self, clock: &crate::state::StateClock) -> crate::state::StoredMessage {
        crate::state::StoredMessage {
            topic: self.topic.clone(),
            payload: self.payload.clone(),
            qos: self.qos,
            retain: self.retain,
            properties: self.properties.clone(),
            expires_at: self.expires_at.map(|t| clock.mono(t)),
        }
    }
    /// Back from the state files.
    pub fn from_stored(
        m: crate::state::StoredMessage,
        clock: &crate::state::StateClock,
    ) -> OutMessage {
        OutMessage {
            topic: m.topic,
            payload: m.payload,
            qos: m.qos,
            retain: m.retain,
            properties: m.properties,
            expires_at: m.expires_at.map(|t| clock.instant(t)),
        }
    }
}

/// A delayed will held by a session whose connection is gone: the message it becomes (no
/// ack token: nobody is waiting for an acknowledgement) and its device's priority.
#[derive(Debug)]
pub struct PendingWill {
    pub message: DeviceMessage,
    pub priority: Priority,
}

impl PendingWill {
    /// The will as the router takes it; a will counts as received when it is published.
    // Takes the box the session held (`SessionState::will`), so callers need not unbox.
    #[allow(clippy::boxed_local)]
    pub fn into_message(self: Box<Self>) -> (DeviceMessage, Priority) {
        let mut message = self.message;
        message.received_at = Instant::now();
        (message, self.priority)
    }
}

/// The QoS 2 packet ids PUBREC'd and awaiting PUBREL. Bounded by the caller: an MQTT 5 device
/// may have at most the gateway's Receive Maximum QoS 2 messages unfinished (more is a
/// protocol error, 0x93); for a 3.1.1 device, which is not told the limit, the oldest id is
/// forgotten at the bound (its late PUBREL still gets a PUBCOMP).
#[derive(Debug, Default)]
pub struct AwaitingRel(Option<Box<AwaitingRelIds>>);

/// Boxed, and only while an id is awaited: most sessions never see QoS 2, and the two
/// collections inline would cost every session 80 bytes.
#[derive(Debug, Default)]
struct AwaitingRelIds {
    ids: HashSet<u16>,
    order: VecDeque<u16>,
}

impl AwaitingRel {
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |a| a.ids.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn contains(&self, id: u16) -> bool {
        self.0.as_ref().is_some_and(|a| a.ids.contains(&id))
    }
    /// The ids, oldest first.
    pub fn ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.0.iter().flat_map(|a| a.order.iter().copied())
    }
    /// Add `id`; at `bound` entries the oldest is forgotten first. Returns whether one was.
    pub fn insert(&mut self, id: u16, bound: usize) -> bool {
        let a = self.0.get_or_insert_with(Default::default);
        if !a.ids.insert(id) {
            return false;
        }
        a.order.push_back(id);
        let mut evicted = false;
        while a.ids.len() > bound.max(1) {
            match a.order.pop_front() {
                Some(old) => evicted |= a.ids.remove(&old),
                None => break,
            }
        }
        evicted
    }
    pub fn remove(&mut self, id: u16) -> bool {
        let Some(a) = self.0.as_mut() else {
            return false;
        };
        if !a.ids.remove(&id) {
            return false;
        }
        if let Some(pos) = a.order.iter().position(|x| *x == id) {
            a.order.remove(pos);
        }
        if a.ids.is_empty() {
            self.0 = None; // memory: nothing kept once nothing is awaited
        }
        true
    }
}

#[derive(Debug)]
pub struct Session {
    pub client_id: ByteString,
    pub state: RefCell<SessionState>,
    /// Incremented whenever a new connection takes the session over; a connection whose
    /// generation is stale closes itself.
    pub generation: Cell<u64>,
    /// Woken when the outbox gains a message, the session is taken over, the shard shuts
    /// down, or (shared with the connection's `DeviceAcks`) the cloud acknowledged something.
    pub notify: Rc<Notify>,
    max_queued: usize,
    /// Local fan-out's per-delivery stamp (`crate::shard::subscriber`).
    pub delivery: DeliveryStamp,
}

impl Session {
    pub fn new(client_id: ByteString, max_queued: usize) -> Rc<Session> {
        Self::with_budget(client_id, max_queued, OutboxBudget::unbounded())
    }

    /// A session whose queued bytes are charged to `budget` (its shard's).
    pub fn with_budget(
        client_id: ByteString,
        max_queued: usize,
        budget: Rc<OutboxBudget>,
    ) -> Rc<Session> {
        let journal = Journal::new();
        Rc::new(Session {
            client_id,
            state: RefCell::new(SessionState {
                subscriptions: HashMap::new(),
                outbox: VecDeque::new(),
                inflight: BTreeMap::new(),
                next_packet_id: 1,
                expiry: Duration::ZERO,
                connected: false,
                queued: QueuedBytes::new(budget),
                offline_since: None,
                timers: SessionTimers::default(),
                awaiting_rel: AwaitingRel::default(),
                will: None,
                ended: false,
                journal,
            }),
            generation: Cell::new(0),
            notify: Rc::new(Notify::new()),
            max_queued,
            delivery: DeliveryStamp::default(),
        })
    }

    /// Queue a message for the device. QoS 0 messages are not kept for offline devices.
    pub fn enqueue(&self, msg: OutMessage) -> Result<(), QueueRefusal> {
        let mut st = self.state.borrow_mut();
        if !st.connected && msg.qos == QoS::AtMostOnce {
            return Err(QueueRefusal::Offline);
        }
        if st.outbox.len() >= self.max_queued || st.queued.charge(&msg).is_err() {
            return Err(QueueRefusal::Full);
        }
        if msg.qos != QoS::AtMostOnce {
            st.journal
                .record(|client, clock| crate::state::Record::Enqueue {
                    client,
                    msg: msg.stored(clock),
                });
        }
        st.outbox.push_back(msg);
        drop(st);
        self.notify.notify_one();
        Ok(())
    }

    /// Start a new connection generation (session takeover); returns it.
    pub fn take_over(&self) -> u64 {
        let g = self.generation.get() + 1;
        self.generation.set(g);
        self.notify.notify_waiters();
        self.notify.notify_one();
        g
    }
}

impl SessionState {
    /// Take the next message of the outbox. A QoS 0 message leaves the session here; a QoS
    /// 1/2 one stays charged (`shard::limits`) until [`SessionState::remove_inflight`].
    pub fn pop_outbox(&mut self) -> Option<OutMessage> {
        let msg = self.outbox.pop_front()?;
        if msg.qos == QoS::AtMostOnce {
            self.queued.release(&msg);
        } else {
            self.journal
                .record(|client, _| crate::state::Record::PopOutbox { client });
        }
        if self.outbox.is_empty() && self.outbox.capacity() > 64 {
            // A burst is over: give its slots back (they are not charged once empty).
            self.outbox = VecDeque::new();
        }
        Some(msg)
    }

    /// The session ended: drop every message still queued or inflight, releasing their bytes
    /// now rather than when the last reference to the session goes.
    pub fn drop_queued(&mut self) {
        self.journal
            .record(|client, _| crate::state::Record::DropQueued { client });
        self.outbox = VecDeque::new();
        self.inflight.clear();
        self.queued.release_all();
    }

    /// A QoS 1/2 message written to the device leaves the session (acknowledged or dropped).
    pub fn remove_inflight(&mut self, packet_id: u16) -> Option<(OutMessage, OutStage)> {
        let removed = self.inflight.remove(&packet_id)?;
        self.journal
            .record(|client, _| crate::state::Record::Acked { client, packet_id });
        self.queued.release(&removed.0);
        Some(removed)
    }

    /// The outbox's front QoS 1/2 message is written to the device as `packet_id`: it moves
    /// to `inflight` (still charged) and is returned.
    pub fn send_front(&mut self, packet_id: u16) -> Option<OutMessage> {
        let msg = self.outbox.pop_front()?;
        self.journal
            .record(|client, _| crate::state::Record::Send { client, packet_id });
        self.inflight
            .insert(packet_id, (msg.clone(), OutStage::AwaitingAck));
        if self.outbox.is_empty() && self.outbox.capacity() > 64 {
            self.outbox = VecDeque::new();
        }
        Some(msg)
    }

    /// QoS 2 out: PUBREC received for `packet_id`, PUBREL written.
    pub fn mark_released(&mut self, packet_id: u16) {
        if let Some((_, stage)) = self.inflight.get_mut(&packet_id) {
            *stage = OutStage::AwaitingComp;
            self.journal
                .record(|client, _| crate::state::Record::Released { client, packet_id });
        }
    }

    /// QoS 2 in: `packet_id` PUBREC'd, awaiting PUBREL (at most `bound` kept).
    pub fn await_rel(&mut self, packet_id: u16, bound: usize) {
        self.awaiting_rel.insert(packet_id, bound);
        self.journal
            .record(|client, _| crate::state::Record::AwaitRel {
                client,
                packet_id,
                bound: bound.min(u16::MAX as usize) as u16,
            });
    }

    /// QoS 2 in: PUBREL for `packet_id`; whether it was awaited.
    pub fn rel_done(&mut self, packet_id: u16) -> bool {
        let found = self.awaiting_rel.remove(packet_id);
        if found {
            self.journal
                .record(|client, _| crate::state::Record::RelDone { client, packet_id });
        }
        found
    }

    /// A packet id not currently in flight to the device.
    pub fn allocate_packet_id(&mut self) -> Option<u16> {
        for _ in 0..u16::MAX {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.inflight.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn msg(qos: QoS) -> OutMessage {
        OutMessage {
            topic: "t".into(),
            payload: Bytes::from_static(b"x"),
            qos,
            retain: false,
            properties: None,
            expires_at: None,
        }
    }

    #[test]
    fn offline_session_keeps_qos1_but_not_qos0_and_is_bounded() {
        let s = Session::new("d".into(), 2);
        assert_eq!(s.enqueue(msg(QoS::AtMostOnce)), Err(QueueRefusal::Offline));
        assert!(s.enqueue(msg(QoS::AtLeastOnce)).is_ok());
        assert!(s.enqueue(msg(QoS::AtLeastOnce)).is_ok());
        assert_eq!(s.enqueue(msg(QoS::AtLeastOnce)), Err(QueueRefusal::Full));
    }

    #[test]
    fn message_expiry_is_lowered_by_the_wait_and_expired_messages_say_so() {
        let now = Instant::now();
        let mut m = msg(QoS::AtLeastOnce);
        assert_eq!(m.properties_now(now), None);
        m.expires_at = Some(now + Duration::from_millis(2_300));
        let p = m.properties_now(now).unwrap();
        assert_eq!(p.message_expiry_interval, Some(3));
        assert!(!m.is_expired(now));
        assert!(m.is_expired(now + Duration::from_secs(3)));
        let late = m.properties_now(now + Duration::from_secs(9)).unwrap();
        assert_eq!(late.message_expiry_interval, Some(1));
    }

    #[test]
    fn awaiting_rel_is_bounded_and_forgets_the_oldest() {
        let mut a = AwaitingRel::default();
        assert!(!a.insert(1, 2));
        assert!(!a.insert(2, 2));
        assert!(!a.insert(2, 2), "a duplicate is not added twice");
        assert!(a.insert(3, 2), "the oldest goes at the bound");
        assert!(!a.contains(1) && a.contains(2) && a.contains(3));
        assert!(a.remove(2));
        assert!(!a.remove(2));
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn packet_ids_skip_those_in_flight_and_wrap() {
        let s = Session::new("d".into(), 2);
        let mut st = s.state.borrow_mut();
        st.next_packet_id = u16::MAX;
        st.inflight
            .insert(1, (msg(QoS::AtLeastOnce), OutStage::AwaitingAck));
        assert_eq!(st.allocate_packet_id(), Some(u16::MAX));
        assert_eq!(st.allocate_packet_id(), Some(2));
    }
}
