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
//! Removal (ADR 0013): once a reload's drain deadline passed and the sink's sessions stopped,
//! [`UplinkQueue::close_removed`] finishes everything it holds with 0x10 (counted
//! `uplink_removed`, spool records left unacknowledged); from then on anything pushed,
//! granted or requeued (a device connection that was blocked on it, a late outbox) is
//! finished the same way at once, so no device token is ever dropped uncompleted.
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
    /// Its sink was removed ([`UplinkQueue::close_removed`]).
    closed: Cell<bool>,
    /// Messages and bytes finished because the sink was removed.
    removed: Cell<(u64, u64)>,
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
            closed: Cell::new(false),
            removed: Cell::new((0, 0)),
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
        if self.closed.get() {
            self.finish_removed(msg);
            return;
        }
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
            if self.closed.get() {
                // Out of the line already (`close_removed`); nothing granted.
                guard.done = true;
                self.finish_removed(msg);
                return;
            }
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
        if self.closed.get() {
            self.finish_removed(msg);
            return Ok(());
        }
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

    /// Set the capacity (a reload attached or removed a sink and the shard's share of
    /// `max_buffered` is split again). A queue over a lowered capacity admits nothing until
    /// releases bring it under; a raised one grants waiting pushers at once.
    pub fn set_capacity_bytes(&self, capacity_bytes: usize) {
        let raised = capacity_bytes > self.capacity_bytes.get();
        self.capacity_bytes.set(capacity_bytes);
        if raised {
            self.serve_waiters();
            self.space.notify_waiters();
        }
    }

    /// The sink was removed and its sessions stopped (see the module docs): finish what is
    /// waiting with 0x10, wake blocked pushers to do the same with theirs, and finish
    /// anything that arrives later at once. Returns the messages and bytes finished so far
    /// this way (inflight ones included once the stopped outbox requeued them).
    pub fn close_removed(&self) -> (u64, u64) {
        self.closed.set(true);
        let (items, waiters) = {
            let mut guard = self.state.borrow_mut();
            let st = &mut *guard;
            let items: Vec<Queued> = st.waiting.drain(..).chain(st.backlog.drain(..)).collect();
            let waiters: Vec<Rc<Ticket>> = st.waiters.drain(..).collect();
            (items, waiters)
        };
        for q in items {
            self.release_msg(&q.msg);
            self.finish_removed(q.msg);
        }
        for t in waiters {
            t.wake.notify_one();
        }
        self.removed.get()
    }

    /// A device token of a removed sink held outside the queue (by its spool): counted like
    /// a message, completed with 0x10.
    pub fn finish_removed_token(&self, token: crate::message::ack::AckToken) {
        let (n, bytes) = self.removed.get();
        self.removed.set((n + 1, bytes));
        if let Some(m) = &self.state.borrow().metrics {
            m.record_drop(DropReason::UplinkRemoved);
        }
        token.complete_with(crate::sink::REMOVED_REASON);
    }

    /// Messages and bytes finished because the sink was removed.
    pub fn removed(&self) -> (u64, u64) {
        self.removed.get()
    }

    /// A message of a removed sink: counted, then finished with 0x10 (its bytes are not, or
    /// no longer, reserved).
    fn finish_removed(&self, msg: UplinkMessage) {
        let (n, bytes) = self.removed.get();
        self.removed.set((n + 1, bytes + msg.cost() as u64));
        if let Some(m) = &self.state.borrow().metrics {
            m.record_drop(DropReason::UplinkRemoved);
        }
        msg.complete_removed();
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
        if self.closed.get() {
            self.release_msg(&msg);
            self.finish_removed(msg);
            return;
        }
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
        if self.closed.get() {
            self.finish_removed(msg);
            return;
        }
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
    ///
    /// A live front older than the backlog's front (a spool record of the live stream from
    /// before the reconnect that made the backlog: a message resent because its connection
    /// dropped, or read ahead before it) goes first even on the backlog's turn: the backlog
    /// starts where the live stream stopped, so sending it first would put a device's later
    /// messages before its earlier ones.
    pub(crate) fn take_next(&self, window_open: bool, backlog_turn: bool) -> Option<Queued> {
        let mut st = self.state.borrow_mut();
        let spool_seq = |q: &VecDeque<Queued>| {
            q.front()
                .and_then(|f| f.msg.stored.as_ref())
                .map(|s| s.seq())
        };
        let live_is_older = matches!(
            (spool_seq(&st.waiting), spool_seq(&st.backlog)),
            (Some(live), Some(backlog)) if live < backlog
        );
        let backlog_first =
            !st.backlog.is_empty() && (st.waiting.is_empty() || (backlog_turn && !live_is_older));
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
        if self.closed.get() {
            for q in items {
                self.release_msg(&q.msg);
                self.finish_removed(q.msg);
            }
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
mod tests;
