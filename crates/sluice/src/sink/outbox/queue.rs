//! The per-uplink FIFO between a shard's device connections (or its spool feeder) and its outbox.
//!
//! Bound: bytes. A message costs [`UplinkMessage::cost`] (topic + payload +
//! [`MESSAGE_OVERHEAD_BYTES`]); the cost is reserved at push and released by the outbox only
//! when the message is finished (PUBACK, QoS 0 written, or a counted drop), so the bound
//! covers waiting and inflight messages alike. A message is admitted when it fits, or when
//! nothing at all is reserved (so one message bigger than the whole capacity still passes,
//! alone). Overflow: [`UplinkQueue::push`] waits (back-pressure: the device connection stops
//! reading its socket); [`UplinkQueue::try_push`] hands the message back (the caller drops it
//! and counts `uplink_queue_full`). Waiting pushers are served first come, first served: each
//! takes a ticket in a FIFO; when bytes are released, tickets are granted from the front for as
//! long as the front one fits (its bytes are reserved at the grant), and only those pushers are
//! woken. A later, smaller message never overtakes an earlier waiter, and while anyone waits
//! [`UplinkQueue::try_push`] refuses (a QoS 0 message cannot take the room a waiter needs).
//! A push cancelled while it holds a ticket gives its ticket (and any granted bytes) back.
//!
//! Two streams (used with a spool, see `crate::sink::spool`): *live* (everything pushed with
//! [`UplinkQueue::push`]/[`UplinkQueue::try_push`], and spool records appended since the
//! uplink last connected) and *backlog* (spool records that piled up while it was down,
//! pushed with [`UplinkQueue::push_backlog`]). Each is FIFO; the outbox picks between their
//! fronts with `UplinkQueue::take_next` (the drain share, see `outbox/drain.rs`). With a
//! spool the feeder keeps each stream within half of the capacity
//! ([`UplinkQueue::stream_room`]), so the backlog can never crowd out live messages. Without a spool the backlog stream stays empty and the queue
//! behaves as a single FIFO.
//!
//! Shared with `Rc` on one shard thread; every `RefCell` borrow is released before any await.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;

use tokio::sync::Notify;

use crate::sink::{DropReason, UplinkMessage, UplinkMetrics};

/// Bytes charged per message on top of topic and payload: the `UplinkMessage` itself (~130 B),
/// its ack token, the allocator headers of its topic and payload, and its inflight entry.
/// Measured against RSS under a saturated cloud, 64 undercounted real memory noticeably.
pub const MESSAGE_OVERHEAD_BYTES: usize = 256;

/// A message in the queue, and whether it was sent before (it is resent with DUP set).
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) msg: UplinkMessage,
    pub(crate) resend: bool,
}

#[derive(Debug)]
pub struct UplinkQueue {
    /// Set at start; lowered when a reload attaches another sink (ADR 0013: the shard's
    /// share of `max_buffered` is split again), never below what is reserved being a problem:
    /// a queue over its new capacity admits nothing until releases bring it under.
    capacity_bytes: std::cell::Cell<usize>,
    state: RefCell<State>,
    /// Bytes were released: the spool feeder re-checks its stream's room. (Blocked pushers
    /// wait on their own tickets, see `State::waiters`.)
    space: Notify,
    /// A message was queued: the outbox re-checks (one stored permit at most).
    ready: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The live stream.
    waiting: VecDeque<Queued>,
    /// The backlog stream (spool records from before the uplink's last connect).
    backlog: VecDeque<Queued>,
    /// Cost of waiting plus inflight messages, both streams.
    reserved_bytes: usize,
    /// The backlog stream's part of `reserved_bytes`.
    backlog_bytes: usize,
    /// Where depth, bytes and `uplink_queue_full` drops are reported (set by [`crate::sink::spawn`]).
    metrics: Option<Arc<UplinkMetrics>>,
    /// Blocked pushers in arrival order (see the module docs).
    waiters: VecDeque<Rc<Ticket>>,
    /// Times a blocked pusher was woken (tests check that a release wakes only who fits).
    waiter_wakeups: u64,
}

/// A blocked push's place in line. `granted`: its bytes are reserved and it may queue.
#[derive(Debug)]
struct Ticket {
    cost: usize,
    granted: Cell<bool>,
    wake: Notify,
}

/// Gives a cancelled push's ticket back: out of the line, or its granted bytes released.
struct TicketGuard<'a> {
    queue: &'a UplinkQueue,
    ticket: Rc<Ticket>,
    done: bool,
}

impl Drop for TicketGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        {
            let mut st = self.queue.state.borrow_mut();
            if self.ticket.granted.get() {
                st.reserved_bytes = st.reserved_bytes.saturating_sub(self.ticket.cost);
                UplinkQueue::update_gauges(&st);
            } else {
                st.waiters.retain(|t| !Rc::ptr_eq(t, &self.ticket));
            }
        }
        self.queue.serve_waiters();
    }
}

impl UplinkQueue {
    /// A queue holding at most `capacity_bytes` of waiting and inflight messages. Its metrics
    /// are attached by [`crate::sink::spawn`] (the outbox's [`UplinkMetrics`]).
    pub fn new(capacity_bytes: usize) -> UplinkQueue {
        UplinkQueue {
            capacity_bytes: std::cell::Cell::new(capacity_bytes),
            state: RefCell::new(State::default()),
            space: Notify::new(),
            ready: Notify::new(),
        }
    }

    /// [`UplinkQueue::new`] reporting depth, bytes and refused pushes to `metrics` at once.
    pub fn with_metrics(capacity_bytes: usize, metrics: Arc<UplinkMetrics>) -> UplinkQueue {
        let q = UplinkQueue::new(capacity_bytes);
        q.attach_metrics(metrics);
        q
    }

    /// Report to `metrics` from now on: `queue_messages`, `queue_bytes`, and
    /// `dropped_total{reason="uplink_queue_full"}` for every refused [`UplinkQueue::try_push`].
    pub fn attach_metrics(&self, metrics: Arc<UplinkMetrics>) {
        let mut st = self.state.borrow_mut();
        st.metrics = Some(metrics);
        Self::update_gauges(&st);
    }

    /// Queue `msg`, waiting while its bytes do not fit or earlier pushers still wait (first
    /// come, first served). Never waits when nothing is reserved and nobody waits.
    /// Cancel-safe: dropping the future before it completes drops `msg` unqueued and gives
    /// its place (and any bytes granted to it) back.
    pub async fn push(&self, msg: UplinkMessage) {
        let cost = msg.cost();
        let ticket = {
            let mut st = self.state.borrow_mut();
            if st.waiters.is_empty() && self.fits(&st, cost) {
                drop(st);
                self.admit(msg, cost);
                return;
            }
            let ticket = Rc::new(Ticket {
                cost,
                granted: Cell::new(false),
                wake: Notify::new(),
            });
            st.waiters.push_back(ticket.clone());
            ticket
        };
        let mut guard = TicketGuard {
            queue: self,
            ticket,
            done: false,
        };
        // Invariant: after every release the front ticket is granted if it fits, so a new
        // ticket behind others (or one that does not fit now) just waits for its grant.
        while !guard.ticket.granted.get() {
            // `notify_one` stores a permit, so a grant before this await is not missed.
            guard.ticket.wake.notified().await;
        }
        guard.done = true;
        self.admit_reserved(msg);
    }

    /// Queue `msg` if its bytes fit now; otherwise hand it back (for QoS 0: the caller drops
    /// it). A refusal is counted in this uplink's `dropped_total{reason="uplink_queue_full"}`
    /// (the caller may count it in its own metrics too).
    // Handing the message back by value is the point (no allocation on the drop path).
    #[allow(clippy::result_large_err)]
    pub fn try_push(&self, msg: UplinkMessage) -> Result<(), UplinkMessage> {
        let cost = msg.cost();
        if self.admits(cost) && self.state.borrow().waiters.is_empty() {
            self.admit(msg, cost);
            Ok(())
        } else {
            if let Some(m) = &self.state.borrow().metrics {
                m.record_drop(DropReason::QueueFull);
            }
            Err(msg)
        }
    }

    /// Whether the reserved bytes reached the capacity (no message fits until some are released).
    pub fn is_full(&self) -> bool {
        self.state.borrow().reserved_bytes >= self.capacity_bytes.get()
    }

    /// Messages waiting to be sent, both streams (inflight ones excluded).
    pub fn len(&self) -> usize {
        let st = self.state.borrow();
        st.waiting.len() + st.backlog.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Times a blocked pusher was woken (for tests of the wake-up policy).
    pub fn waiter_wakeups(&self) -> u64 {
        self.state.borrow().waiter_wakeups
    }

    /// Bytes reserved by waiting and inflight messages.
    pub fn reserved_bytes(&self) -> usize {
        self.state.borrow().reserved_bytes
    }

    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes.get()
    }

    /// Lower the capacity (a reload attached another sink and the shard's share of
    /// `max_buffered` is split again). Raising it would have to wake blocked pushers: not
    /// needed until sinks are detached live (ADR 0013 step 6), so a larger value is ignored.
    pub fn lower_capacity_bytes(&self, capacity_bytes: usize) {
        if capacity_bytes < self.capacity_bytes.get() {
            self.capacity_bytes.set(capacity_bytes);
        }
    }

    fn admits(&self, cost: usize) -> bool {
        self.fits(&self.state.borrow(), cost)
    }

    fn fits(&self, st: &State, cost: usize) -> bool {
        st.reserved_bytes == 0
            || st.reserved_bytes.saturating_add(cost) <= self.capacity_bytes.get()
    }

    fn admit(&self, msg: UplinkMessage, cost: usize) {
        self.state.borrow_mut().reserved_bytes += cost;
        self.admit_reserved(msg);
    }

    /// Queue a message whose bytes are already reserved.
    fn admit_reserved(&self, msg: UplinkMessage) {
        {
            let mut st = self.state.borrow_mut();
            st.waiting.push_back(Queued { msg, resend: false });
            Self::update_gauges(&st);
        }
        self.ready.notify_one();
    }

    /// Grant tickets from the front of the line while the front one fits: reserve its bytes
    /// and wake that pusher only.
    fn serve_waiters(&self) {
        let mut st = self.state.borrow_mut();
        while let Some(front) = st.waiters.front() {
            if !self.fits(&st, front.cost) {
                break;
            }
            let Some(ticket) = st.waiters.pop_front() else {
                break;
            };
            st.reserved_bytes += ticket.cost;
            st.waiter_wakeups += 1;
            ticket.granted.set(true);
            ticket.wake.notify_one();
        }
        Self::update_gauges(&st);
    }

    /// Queue a spool record of the backlog stream (the feeder checked
    /// [`UplinkQueue::stream_room`] first; this never waits).
    pub fn push_backlog(&self, msg: UplinkMessage) {
        let cost = msg.cost();
        {
            let mut st = self.state.borrow_mut();
            st.reserved_bytes += cost;
            st.backlog_bytes += cost;
            st.backlog.push_back(Queued { msg, resend: false });
            Self::update_gauges(&st);
        }
        self.ready.notify_one();
    }

    /// Queue a spool record of the live stream without waiting (the feeder checked
    /// [`UplinkQueue::stream_room`] first).
    pub fn push_live_now(&self, msg: UplinkMessage) {
        let cost = msg.cost();
        self.admit(msg, cost);
    }

    /// Bytes the feeder may still put into one stream: each stream gets half the capacity.
    pub fn stream_room(&self, backlog: bool) -> usize {
        let st = self.state.borrow();
        let used = if backlog {
            st.backlog_bytes
        } else {
            st.reserved_bytes.saturating_sub(st.backlog_bytes)
        };
        (self.capacity_bytes.get() / 2).saturating_sub(used)
    }

    /// Messages waiting in the backlog stream.
    pub fn backlog_len(&self) -> usize {
        self.state.borrow().backlog.len()
    }

    /// Messages waiting in one stream (inflight ones excluded).
    pub fn stream_waiting(&self, backlog: bool) -> usize {
        let st = self.state.borrow();
        if backlog {
            st.backlog.len()
        } else {
            st.waiting.len()
        }
    }

    /// A future that resolves when bytes are released (for the spool feeder). Create it,
    /// `enable` it, then check the room, then await it.
    pub fn space_released(&self) -> tokio::sync::futures::Notified<'_> {
        self.space.notified()
    }

    fn update_gauges(st: &State) {
        if let Some(m) = &st.metrics {
            m.queue_messages
                .set((st.waiting.len() + st.backlog.len()) as i64);
            m.queue_bytes.set(st.reserved_bytes as i64);
            let live = st.waiting.front().map(|q| q.msg.received_at);
            let backlog = st.backlog.front().map(|q| q.msg.received_at);
            m.set_queue_oldest(match (live, backlog) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            });
        }
    }

    // ----- outbox side -----

    /// Resolves after a message was queued since the last call (or immediately if a
    /// notification is stored). Spurious wake-ups are possible: re-check.
    pub(crate) async fn wait_ready(&self) {
        self.ready.notified().await
    }

    /// Whether a front message exists and they all need a cloud ack (`None`: queue empty;
    /// `Some(false)`: a stream's front can go without the window).
    pub(crate) fn front_needs_ack(&self) -> Option<bool> {
        let st = self.state.borrow();
        let live = st.waiting.front().map(|q| q.msg.needs_cloud_ack());
        let backlog = st.backlog.front().map(|q| q.msg.needs_cloud_ack());
        match (live, backlog) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(true) && b.unwrap_or(true)),
        }
    }

    /// Whether live messages are waiting.
    pub(crate) fn live_waiting(&self) -> bool {
        !self.state.borrow().waiting.is_empty()
    }

    /// Take the next message of one stream: the backlog's front when the live stream is
    /// empty or it is the backlog's turn (`backlog_turn`, the outbox's drain share), else
    /// the live front. A front that needs a cloud ack waits for `window_open`; then only the
    /// other stream's front may go, and only if it needs no ack (QoS 0). Order within a
    /// stream is never skipped.
    pub(crate) fn take_next(&self, window_open: bool, backlog_turn: bool) -> Option<Queued> {
        let mut st = self.state.borrow_mut();
        let backlog_first = !st.backlog.is_empty() && (st.waiting.is_empty() || backlog_turn);
        let mut took = None;
        for (i, backlog) in [backlog_first, !backlog_first].into_iter().enumerate() {
            let q = if backlog {
                &mut st.backlog
            } else {
                &mut st.waiting
            };
            let Some(front) = q.front() else { continue };
            let needs = front.msg.needs_cloud_ack();
            if needs && !window_open {
                continue;
            }
            if i == 1 && needs {
                break;
            }
            took = q.pop_front();
            break;
        }
        Self::update_gauges(&st);
        took
    }

    /// Take the front message (live first), unless it needs a cloud ack and `window_open` is
    /// false (order is never skipped: a QoS 0 message behind it waits too). Its bytes stay
    /// reserved.
    #[cfg(test)]
    pub(crate) fn take_front(&self, window_open: bool) -> Option<Queued> {
        self.take_next(window_open, false)
    }

    /// Put messages that were sent but not acknowledged back at the front, in the given
    /// (original) order, marked for resend. Their bytes are still reserved.
    #[cfg(test)]
    pub(crate) fn requeue_front(&self, msgs: Vec<UplinkMessage>) {
        self.requeue_front_queued(
            msgs.into_iter()
                .map(|msg| Queued { msg, resend: true })
                .collect(),
        );
    }

    /// Put messages taken earlier back at the front, in the given order, each keeping its
    /// resend mark (one never written is not a resend). Their bytes are still reserved.
    pub(crate) fn requeue_front_queued(&self, items: Vec<Queued>) {
        if items.is_empty() {
            return;
        }
        {
            let mut st = self.state.borrow_mut();
            for item in items.into_iter().rev() {
                let q = if is_backlog(&item.msg) {
                    &mut st.backlog
                } else {
                    &mut st.waiting
                };
                q.push_front(item);
            }
            Self::update_gauges(&st);
        }
        self.ready.notify_one();
    }

    /// `msg` is finished: release its reservation (in its stream) and wake pushers.
    pub(crate) fn release_msg(&self, msg: &UplinkMessage) {
        if is_backlog(msg) {
            let mut st = self.state.borrow_mut();
            st.backlog_bytes = st.backlog_bytes.saturating_sub(msg.cost());
        }
        self.release(msg.cost());
    }

    /// A message of `cost` bytes is finished: release its reservation and wake pushers.
    pub(crate) fn release(&self, cost: usize) {
        {
            let mut st = self.state.borrow_mut();
            // Invariant: every release matches one admitted message; saturate rather than panic.
            st.reserved_bytes = st.reserved_bytes.saturating_sub(cost);
            Self::update_gauges(&st);
        }
        self.serve_waiters();
        self.space.notify_waiters();
    }
}

/// Whether a message belongs to the backlog stream (a spool record read as backlog).
pub(crate) fn is_backlog(msg: &UplinkMessage) -> bool {
    msg.is_backlog()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use bytestring::ByteString;
    use sluice_proto::mqtt::QoS;
    use std::time::Instant;

    fn msg(topic: &str, payload_len: usize, qos: QoS) -> UplinkMessage {
        UplinkMessage {
            device: ByteString::from_static("dev"),
            topic: ByteString::from(topic),
            payload: Bytes::from(vec![7u8; payload_len]),
            qos,
            retain: false,
            received_at: Instant::now(),
            ack: None,
            content_type: None,
            stored: None,
        }
    }

    fn rt() -> (tokio::runtime::Runtime, tokio::task::LocalSet) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (rt, tokio::task::LocalSet::new())
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[test]
    fn queue_is_bounded_by_bytes_not_messages() {
        let m = Arc::new(UplinkMetrics::new());
        // Each message costs 1 + 36 + overhead bytes; three fit, a fourth does not.
        let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
        let q = UplinkQueue::with_metrics(3 * one, m.clone());
        for _ in 0..3 {
            q.try_push(msg("t", 36, QoS::AtMostOnce)).unwrap();
        }
        assert!(q.is_full());
        assert!(q.try_push(msg("t", 0, QoS::AtMostOnce)).is_err());
        assert_eq!(q.len(), 3);
        assert_eq!(q.reserved_bytes(), 3 * one);
        assert_eq!(m.queue_messages.get(), 3);
        assert_eq!(m.queue_bytes.get(), (3 * one) as i64);
        assert_eq!(m.dropped(DropReason::QueueFull), 1);
    }

    #[test]
    fn the_oldest_waiting_messages_age_is_reported_and_cleared_when_none_waits() {
        let m = Arc::new(UplinkMetrics::new());
        let q = UplinkQueue::with_metrics(1 << 20, m.clone());
        assert_eq!(m.queue_oldest_age(), None);
        let mut old = msg("t", 1, QoS::AtLeastOnce);
        old.received_at = Instant::now() - std::time::Duration::from_secs(3);
        q.try_push(old).unwrap();
        q.try_push(msg("t", 1, QoS::AtLeastOnce)).unwrap();
        let age = m.queue_oldest_age().expect("a message waits");
        assert!(age >= std::time::Duration::from_secs(3), "{age:?}");
        assert!(age < std::time::Duration::from_secs(10), "{age:?}");
        // The old one leaves (inflight): the age is the younger one's.
        let _inflight = q.take_front(true).unwrap();
        assert!(m.queue_oldest_age().unwrap() < std::time::Duration::from_secs(3));
        let _second = q.take_front(true).unwrap();
        assert_eq!(m.queue_oldest_age(), None, "nothing waits");
    }

    #[test]
    fn bytes_stay_reserved_while_inflight_and_are_freed_on_release() {
        let m = Arc::new(UplinkMetrics::new());
        let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
        let q = UplinkQueue::with_metrics(2 * one, m.clone());
        q.try_push(msg("t", 36, QoS::AtLeastOnce)).unwrap();
        q.try_push(msg("t", 36, QoS::AtLeastOnce)).unwrap();
        let taken = q.take_front(true).unwrap();
        assert_eq!(q.len(), 1);
        // Taken (inflight) but not finished: still counts against the bound.
        assert!(q.try_push(msg("t", 36, QoS::AtMostOnce)).is_err());
        q.release(taken.msg.cost());
        assert_eq!(m.queue_bytes.get(), one as i64);
        q.try_push(msg("t", 36, QoS::AtMostOnce)).unwrap();
    }

    #[test]
    fn push_waits_while_full_and_resumes_after_release() {
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let m = Arc::new(UplinkMetrics::new());
            let q = std::rc::Rc::new(UplinkQueue::with_metrics(
                1 + 36 + MESSAGE_OVERHEAD_BYTES,
                m,
            ));
            q.push(msg("t", 36, QoS::AtLeastOnce)).await;
            let q2 = q.clone();
            let blocked = tokio::task::spawn_local(async move {
                q2.push(msg("u", 36, QoS::AtLeastOnce)).await;
            });
            settle().await;
            assert!(
                !blocked.is_finished(),
                "push must wait while the queue is full"
            );
            assert_eq!(q.len(), 1);
            let first = q.take_front(true).unwrap();
            settle().await;
            assert!(
                !blocked.is_finished(),
                "taking for send does not free bytes"
            );
            q.release(first.msg.cost());
            settle().await;
            assert!(blocked.is_finished(), "release must wake the waiting push");
            assert_eq!(q.take_front(true).unwrap().msg.topic, "u");
        });
    }

    #[test]
    fn a_message_larger_than_capacity_is_admitted_when_nothing_is_held() {
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let q = UplinkQueue::new(100);
            q.push(msg("big", 10_000, QoS::AtLeastOnce)).await;
            assert_eq!(q.len(), 1);
            assert!(q.is_full());
            // But not while something else is held.
            assert!(q.try_push(msg("big", 10_000, QoS::AtMostOnce)).is_err());
        });
    }

    #[test]
    fn take_front_respects_the_window_and_never_skips_ahead() {
        let q = UplinkQueue::new(10_000);
        q.try_push(msg("a", 1, QoS::AtLeastOnce)).unwrap();
        q.try_push(msg("b", 1, QoS::AtMostOnce)).unwrap();
        assert!(
            q.take_front(false).is_none(),
            "QoS 1 front needs window room"
        );
        assert_eq!(q.take_front(true).unwrap().msg.topic, "a");
        assert_eq!(q.front_needs_ack(), Some(false));
        assert_eq!(
            q.take_front(false).unwrap().msg.topic,
            "b",
            "QoS 0 needs no window"
        );
        assert_eq!(q.front_needs_ack(), None);
    }

    #[test]
    fn take_next_serves_the_backlog_only_on_its_turn_or_when_nothing_live_waits() {
        let q = UplinkQueue::new(100_000);
        q.push_backlog(msg("b1", 1, QoS::AtLeastOnce));
        q.push_backlog(msg("b2", 1, QoS::AtLeastOnce));
        q.try_push(msg("l1", 1, QoS::AtLeastOnce)).unwrap();
        assert_eq!(q.len(), 3);
        assert_eq!(q.backlog_len(), 2);
        assert_eq!(q.take_next(true, false).unwrap().msg.topic, "l1");
        // Live is empty now: the backlog goes whatever the turn says.
        assert_eq!(q.take_next(true, false).unwrap().msg.topic, "b1");
        q.try_push(msg("l2", 1, QoS::AtLeastOnce)).unwrap();
        assert_eq!(q.take_next(true, true).unwrap().msg.topic, "b2");
        assert_eq!(q.take_next(true, true).unwrap().msg.topic, "l2");
        assert!(q.take_next(true, true).is_none());
    }

    #[test]
    fn a_closed_window_lets_only_a_qos0_front_of_the_other_stream_pass() {
        let q = UplinkQueue::new(100_000);
        q.push_backlog(msg("b1", 1, QoS::AtLeastOnce));
        q.try_push(msg("l0", 1, QoS::AtMostOnce)).unwrap();
        assert_eq!(q.front_needs_ack(), Some(false));
        assert_eq!(q.take_next(false, true).unwrap().msg.topic, "l0");
        assert_eq!(q.front_needs_ack(), Some(true));
        assert!(q.take_next(false, true).is_none());
    }

    #[test]
    fn each_stream_gets_half_the_capacity_as_read_ahead() {
        let one = 1 + 10 + MESSAGE_OVERHEAD_BYTES;
        let q = UplinkQueue::new(4 * one);
        assert_eq!(q.stream_room(true), 2 * one);
        q.push_backlog(msg("b", 10, QoS::AtLeastOnce));
        q.push_backlog(msg("b", 10, QoS::AtLeastOnce));
        assert_eq!(q.stream_room(true), 0);
        assert_eq!(
            q.stream_room(false),
            2 * one,
            "the backlog never eats the live share"
        );
        q.try_push(msg("l", 10, QoS::AtLeastOnce)).unwrap();
        assert_eq!(q.stream_room(false), one);
        let taken = q.take_next(true, false).unwrap();
        assert_eq!(taken.msg.topic, "l");
        q.release_msg(&taken.msg);
        assert_eq!(q.stream_room(false), 2 * one);
    }

    #[test]
    fn requeued_messages_go_first_in_original_order_marked_for_resend() {
        let q = UplinkQueue::new(10_000);
        for t in ["1", "2", "3", "4"] {
            q.try_push(msg(t, 1, QoS::AtLeastOnce)).unwrap();
        }
        let a = q.take_front(true).unwrap();
        let b = q.take_front(true).unwrap();
        q.requeue_front(vec![a.msg, b.msg]);
        let order: Vec<(String, bool)> = std::iter::from_fn(|| q.take_front(true))
            .map(|q| (q.msg.topic.to_string(), q.resend))
            .collect();
        assert_eq!(
            order,
            vec![
                ("1".into(), true),
                ("2".into(), true),
                ("3".into(), false),
                ("4".into(), false)
            ]
        );
        assert_eq!(q.reserved_bytes(), 4 * (2 + MESSAGE_OVERHEAD_BYTES));
    }

    /// Three pushers block on a full queue, in the order 1, 2, 3. Releasing room for one
    /// message admits exactly one, the first to arrive; the others stay asleep (not woken to
    /// find no room); the next release admits the second, and so on.
    #[test]
    fn blocked_pushers_are_admitted_first_come_first_served_one_release_at_a_time() {
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
            let q = std::rc::Rc::new(UplinkQueue::new(one));
            q.push(msg("0", 36, QoS::AtLeastOnce)).await;
            let polls = std::rc::Rc::new(std::cell::RefCell::new(Vec::<&'static str>::new()));
            let mut tasks = Vec::new();
            for topic in ["1", "2", "3"] {
                let (q, polls) = (q.clone(), polls.clone());
                tasks.push(tokio::task::spawn_local(async move {
                    let m = msg(topic, 36, QoS::AtLeastOnce);
                    q.push(m).await;
                    polls.borrow_mut().push(topic);
                }));
                // Arrival order is the spawn order.
                settle().await;
            }
            let wakeups_before = q.waiter_wakeups();
            for expect in ["1", "2", "3"] {
                let front = q.take_front(true).unwrap();
                q.release_msg(&front.msg);
                settle().await;
                assert_eq!(
                    polls.borrow().last().copied(),
                    Some(expect),
                    "the earliest waiter is admitted first"
                );
                assert_eq!(q.len(), 1, "exactly one waiter admitted per release");
            }
            assert_eq!(*polls.borrow(), vec!["1", "2", "3"]);
            assert_eq!(
                q.waiter_wakeups() - wakeups_before,
                3,
                "each release woke only the waiter that fits"
            );
            for t in tasks {
                t.await.unwrap();
            }
        });
    }

    /// Small messages behind a large one wait their turn: releasing room for the small ones
    /// only does not let them overtake the large waiter that arrived first.
    #[test]
    fn a_small_pusher_does_not_overtake_a_large_one_waiting_before_it() {
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let small = 1 + 10 + MESSAGE_OVERHEAD_BYTES;
            let q = std::rc::Rc::new(UplinkQueue::new(3 * small));
            for _ in 0..3 {
                q.push(msg("0", 10, QoS::AtLeastOnce)).await;
            }
            let order = std::rc::Rc::new(std::cell::RefCell::new(Vec::<&'static str>::new()));
            let mut tasks = Vec::new();
            for (topic, len) in [("b", 2 * small - 1 - MESSAGE_OVERHEAD_BYTES - 1), ("s", 10)] {
                let (q, order) = (q.clone(), order.clone());
                tasks.push(tokio::task::spawn_local(async move {
                    q.push(msg(topic, len, QoS::AtLeastOnce)).await;
                    order.borrow_mut().push(topic);
                }));
                settle().await;
            }
            let first = q.take_front(true).unwrap();
            q.release_msg(&first.msg);
            settle().await;
            assert!(
                order.borrow().is_empty(),
                "room for the small one only: it still waits behind the big one"
            );
            let second = q.take_front(true).unwrap();
            q.release_msg(&second.msg);
            settle().await;
            assert_eq!(*order.borrow(), vec!["b"]);
            let third = q.take_front(true).unwrap();
            q.release_msg(&third.msg);
            settle().await;
            assert_eq!(*order.borrow(), vec!["b", "s"]);
            for t in tasks {
                t.await.unwrap();
            }
        });
    }

    /// A blocked push that is dropped (its device connection closed) leaves the line: the
    /// waiter behind it is served by the next release, and a push dropped after its grant
    /// gives the granted bytes back.
    #[test]
    fn a_cancelled_waiting_push_gives_its_place_and_its_bytes_back() {
        let (rt, local) = rt();
        local.block_on(&rt, async {
            let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
            let q = std::rc::Rc::new(UplinkQueue::new(one));
            q.push(msg("0", 36, QoS::AtLeastOnce)).await;
            let q1 = q.clone();
            let first = tokio::task::spawn_local(async move {
                q1.push(msg("1", 36, QoS::AtLeastOnce)).await;
            });
            settle().await;
            let q2 = q.clone();
            let second = tokio::task::spawn_local(async move {
                q2.push(msg("2", 36, QoS::AtLeastOnce)).await;
            });
            settle().await;
            first.abort();
            settle().await;
            let front = q.take_front(true).unwrap();
            q.release_msg(&front.msg);
            settle().await;
            assert!(
                second.is_finished(),
                "the waiter behind the cancelled one got the room"
            );
            assert_eq!(q.take_front(true).unwrap().msg.topic, "2");
            assert_eq!(q.reserved_bytes(), one);

            // Granted, then dropped before it ran: the bytes come back.
            let q3 = q.clone();
            let third = tokio::task::spawn_local(async move {
                q3.push(msg("3", 36, QoS::AtLeastOnce)).await;
            });
            settle().await;
            q.release(one);
            // Granted now (bytes reserved for it), but the task has not run yet.
            assert_eq!(q.reserved_bytes(), one);
            third.abort();
            settle().await;
            assert_eq!(q.reserved_bytes(), 0, "a dropped grant releases its bytes");
            assert!(q.is_empty());
        });
    }
}
