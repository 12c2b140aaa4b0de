//! Filling one batch: which units leave next and in what order.
//!
//! Owns: taking messages from the queue while the window and the batch bound allow, packing
//! them while aggregating (sealing a pack before anything goes alone again), the `alone`
//! line, the QoS 0 bypass of a closed window, and the bookkeeping of what each written unit
//! carried. Does not own: encoding (the transport's [`Transport::encode`]), the drain share's
//! arithmetic (`drain.rs`), acks and refusals (`refusal.rs`).
//!
//! Invariant: a message is either in the queue, the open or sealed pack, `alone`, the
//! inflight map, the refused list, or the batch's no-ack list — never two, never none —
//! until it is finished.
//!
//! # When a pack goes: TCP autocorking's rule, not a timer
//! Each turn takes every message the queue has ready (what the shard's devices sent since the
//! last turn) into the open pack. When nothing more is ready, the open pack is sealed and
//! written in the same turn if the uplink is **idle**; while it is **busy** the pack stays
//! open and keeps taking records, until the uplink is idle again (an acknowledgement wakes
//! the loop), the pack reaches `max_pack`, or its oldest record waited `max_delay` (an upper
//! bound). A lone message on an idle uplink therefore leaves in the turn it arrived, as a pack
//! of one record on the pack topic. Busy ([`Outbox::uplink_busy`]) means one of:
//! - the inflight window has no room for the pack (it could not be written now anyway);
//! - the transport holds the pack flow, or this turn's batch is full (`MAX_BATCH_BYTES`):
//!   earlier bytes still wait to be written, as autocorking corks while earlier data is
//!   still queued in the qdisc/NIC (a write the kernel does not take at once, held back by
//!   `notsent_lowat`, is awaited by the loop, and what arrives meanwhile is packed together
//!   at the next turn);
//! - with `flush = "idle"` (the default), the last *partial* pack written (sealed before
//!   `max_pack`) is not yet acknowledged: Nagle's rule in Minshall's variant, so at most one
//!   partial pack is in flight and the next one waits for at most one cloud round trip.
//!   Full packs never wait for anything but the window. `flush = "window"` leaves this out.
//!
//! `flush = "max_delay"` keeps the timer rule instead (always busy): a pack waits for
//! `max_pack` or `max_delay`, for the most records per PUBLISH.

use std::sync::atomic::Ordering;

use tracing::{debug, trace};

use super::pack::{Packer, SealedPack};
use super::queue::Queued;
use super::{Carried, Inflight, Outbox, MAX_BATCH_BYTES, MAX_HELD};
use crate::sink::transport::{LinkLimits, Transport, Unit, Unsendable};
use crate::sink::{DropReason, UplinkMessage};

impl<T: Transport> Outbox<T> {
    /// Whether records are being packed right now: aggregation is on for this outbox and
    /// more devices are connected than `min_devices`.
    pub(super) fn aggregating(&self) -> bool {
        self.packer.is_some()
            && self.live_devices.load(Ordering::Relaxed) > self.aggregate.min_devices
    }

    /// Take up a reloaded `[uplink.aggregate]` between packs: an open pack is sealed first
    /// (it goes out by the settings it was packed under), and the new settings apply once
    /// no pack is open or sealed. One atomic load when nothing changed.
    pub(super) fn follow_aggregate(&mut self) {
        let Some((route, seen)) = &self.route else {
            return;
        };
        let Some((generation, aggregate)) = route.aggregate_if_changed(*seen) else {
            return;
        };
        if aggregate == self.aggregate {
            self.route = self.route.take().map(|(r, _)| (r, generation));
            return;
        }
        if self.sealed.is_some() {
            return;
        }
        if self.packer.as_ref().is_some_and(|p| !p.is_empty()) {
            self.seal_pack();
            return;
        }
        self.packer = (self.lane == crate::sink::Lane::Normal && aggregate.enabled)
            .then(|| Packer::new(&aggregate));
        self.aggregate = aggregate;
        self.route = self.route.take().map(|(r, _)| (r, generation));
    }

    /// Whether the open pack should keep waiting for records (see the module docs, "When a
    /// pack goes"): the window has no room for it, the transport holds packs or this turn's
    /// batch is full, or (`flush = "idle"`) the last partial pack is unacknowledged;
    /// `flush = "max_delay"`: always.
    pub(super) fn uplink_busy(&self, window: usize) -> bool {
        use crate::config::Flush;
        if self.aggregate.flush == Flush::MaxDelay {
            return true;
        }
        let needs_ack = self.packer.as_ref().is_some_and(Packer::needs_ack);
        (needs_ack && self.inflight.len() >= window)
            || self.transport.pending_bytes() >= MAX_BATCH_BYTES
            || self.transport.holds(crate::sink::transport::Flow::Packs)
            || (self.aggregate.flush == Flush::Idle && self.partial_unacked())
    }

    /// Whether the last partial pack written is still unacknowledged (its id still maps to
    /// the same send in the inflight map; an id reused by a later unit does not count).
    fn partial_unacked(&self) -> bool {
        self.last_partial
            .is_some_and(|(id, seq)| self.inflight.get(&id).is_some_and(|i| i.seq == seq))
    }

    /// Seal the open pack, unless one is already waiting for the window.
    pub(super) fn seal_pack(&mut self) {
        if self.sealed.is_none() {
            self.sealed = self.packer.as_mut().and_then(Packer::seal);
            self.pack_mix = (0, 0);
        }
    }

    /// Take queued messages while the window and the batch size allow, encoding them after
    /// whatever the transport already has pending. Returns (units, of which resends). While
    /// aggregating, messages go into the open pack instead, and a sealed pack is written as
    /// one unit; order is kept across both paths because a pack is sealed (and written
    /// first) before any message is sent on its own again. A message that would take the
    /// pack past the link's `pack_limit` seals the pack and starts the next one; if even an
    /// empty pack cannot hold it, it is sent alone (in its place). Nothing is taken while a
    /// temporary refusal's backoff runs.
    pub(super) fn fill_batch(
        &mut self,
        limits: &LinkLimits,
        unacked_in_write: &mut Vec<UplinkMessage>,
    ) -> (u64, u64) {
        let (mut sent, mut resent) = (0, 0);
        self.follow_aggregate();
        let window = self.window(limits);
        let mut held_tried = false;
        while self.transport.pending_bytes() < MAX_BATCH_BYTES && self.paused_until.is_none() {
            let window_open = self.inflight.len() < window;
            if let Some(pack) = self.sealed.take() {
                if (pack.needs_ack() && !window_open)
                    || self.transport.holds(crate::sink::transport::Flow::Packs)
                {
                    self.sealed = Some(pack);
                    break;
                }
                sent += u64::from(self.write_pack(pack, unacked_in_write));
                continue;
            }
            if let Some(front) = self.alone.front() {
                if (front.msg.needs_cloud_ack() && !window_open)
                    || (T::MAY_HOLD && self.transport.holds(front.msg.flow()))
                {
                    break;
                }
                if let Some(q) = self.alone.pop_front() {
                    let (s, r) = self.send_single(q, unacked_in_write);
                    sent += s;
                    resent += r;
                }
                continue;
            }
            let aggregating = self.aggregating();
            if self.held_len > 0 {
                if !held_tried {
                    held_tried = true;
                    let (s, r) = self.send_held(window, unacked_in_write);
                    sent += s;
                    resent += r;
                    continue;
                }
                // Packs mix devices: none starts before every held message went.
                if aggregating || self.held_len >= MAX_HELD {
                    break;
                }
            }
            if !aggregating && self.packer.as_ref().is_some_and(|p| !p.is_empty()) {
                // Crossed below the threshold: what is packed goes before anything single.
                self.seal_pack();
                continue;
            }
            if self.packer.as_ref().is_some_and(Packer::is_full) {
                // Filled by a message that started it while the previous pack was sealed.
                self.seal_pack();
                continue;
            }
            let backlog_turn = self.backlog_turn(window, aggregating);
            let Some(Queued { msg, resend }) = self
                .queue
                .take_next(window_open || aggregating, backlog_turn)
            else {
                // Nothing more ready this turn: an idle uplink takes the open pack now.
                if self.packer.as_ref().is_some_and(|p| !p.is_empty())
                    && self.sealed.is_none()
                    && !self.uplink_busy(window)
                {
                    self.seal_pack();
                    continue;
                }
                break;
            };
            let backlog = msg.is_backlog();
            self.last_took_backlog = backlog;
            if aggregating {
                self.pack_mix.0 += usize::from(backlog);
                self.pack_mix.1 += 1;
                resent += u64::from(resend);
                self.pack_or_hold(Queued { msg, resend }, limits.pack_limit);
                continue;
            }
            // Only a transport over several links holds flows: the others pay no hash here.
            let flow = if T::MAY_HOLD { Some(msg.flow()) } else { None };
            if let Some(flow) =
                flow.filter(|f| self.held.contains_key(f) || self.transport.holds(*f))
            {
                self.held_seq += 1;
                let seq = self.held_seq;
                self.held
                    .entry(flow)
                    .or_default()
                    .push_back((seq, Queued { msg, resend }));
                self.held_len += 1;
                continue;
            }
            let (s, r) = self.send_single(Queued { msg, resend }, unacked_in_write);
            sent += s;
            resent += r;
        }
        self.metrics.inflight.set(self.inflight.len() as i64);
        (sent, resent)
    }

    /// Send the held messages whose flow the transport takes again, each flow in its order,
    /// while there is room. Costs O(held flows), not O(held messages). Returns (units, of
    /// which resends).
    fn send_held(
        &mut self,
        window: usize,
        unacked_in_write: &mut Vec<UplinkMessage>,
    ) -> (u64, u64) {
        let (mut sent, mut resent) = (0, 0);
        let flows: Vec<crate::sink::transport::Flow> = self.held.keys().copied().collect();
        for flow in flows {
            loop {
                if self.transport.pending_bytes() >= MAX_BATCH_BYTES || self.transport.holds(flow) {
                    break;
                }
                let Some(queue) = self.held.get_mut(&flow) else {
                    break;
                };
                let Some((_, front)) = queue.front() else {
                    self.held.remove(&flow);
                    break;
                };
                if front.msg.needs_cloud_ack() && self.inflight.len() >= window {
                    break;
                }
                let Some((_, q)) = queue.pop_front() else {
                    break;
                };
                if queue.is_empty() {
                    self.held.remove(&flow);
                }
                self.held_len -= 1;
                let (s, r) = self.send_single(q, unacked_in_write);
                sent += s;
                resent += r;
            }
            if self.inflight.len() >= window {
                // The window is full: held QoS 0 messages wait for the next fill too.
                break;
            }
        }
        (sent, resent)
    }

    /// Put a message into the open pack if it fits within `limit`; otherwise seal the pack
    /// and try an empty one; a message even an empty pack cannot hold is held to go alone.
    fn pack_or_hold(&mut self, q: Queued, limit: usize) {
        let Queued { msg, resend } = q;
        let Some(packer) = self.packer.as_mut() else {
            self.alone.push_back(Queued { msg, resend });
            return;
        };
        let msg = match packer.add(msg, limit) {
            Ok(full) => {
                if full {
                    self.seal_pack();
                }
                return;
            }
            Err(msg) if packer.is_empty() => {
                self.alone.push_back(Queued { msg, resend });
                return;
            }
            Err(msg) => msg,
        };
        // The open pack is full for this message: seal it (it goes first), start a new one.
        // `sealed` is empty here: fill_batch writes (or waits for) a sealed pack first.
        self.seal_pack();
        if let Some(sealed) = self.sealed.as_mut() {
            // As large as the link takes: it goes without waiting, like one at max_pack.
            sealed.full = true;
        }
        let Some(packer) = self.packer.as_mut() else {
            return;
        };
        // If this fills the new pack at once, fill_batch seals it after the sealed one went.
        if let Err(msg) = packer.add(msg, limit) {
            self.alone.push_back(Queued { msg, resend });
        }
    }

    /// Encode one message as its own unit (or finish it with a counted drop when the far
    /// end can never take it). Returns (units, of which resends).
    fn send_single(&mut self, q: Queued, unacked_in_write: &mut Vec<UplinkMessage>) -> (u64, u64) {
        let Queued { msg, resend } = q;
        let backlog = msg.is_backlog();
        let id = match self.transport.encode(Unit::Message { msg: &msg, resend }) {
            Ok(id) => id,
            Err(e) => {
                let reason = match e {
                    Unsendable::TooLarge { .. } => DropReason::TooLargeForCloud,
                    Unsendable::Invalid(_) => DropReason::InvalidForCloud,
                };
                debug!(shard = self.shard, uplink = %self.cfg.name, error = %e, "message can never be sent to the far end; dropped");
                self.finish_dropped(msg, reason);
                return (0, 0);
            }
        };
        trace!(shard = self.shard, id = ?id, resend, "unit written");
        match id {
            Some(id) => self.track(id, Carried::One(msg), backlog),
            None => unacked_in_write.push(msg),
        }
        (1, u64::from(resend))
    }

    /// Write a sealed pack as one unit; returns whether it was written. A pack the far end
    /// cannot take (not expected: packs are kept within `pack_limit`) is not dropped: its
    /// messages go one by one, before anything later.
    fn write_pack(&mut self, pack: SealedPack, unacked_in_write: &mut Vec<UplinkMessage>) -> bool {
        let format = match &self.packer {
            Some(p) => p.format(),
            None => sluice_proto::senml::Format::Json,
        };
        let unit = Unit::Pack {
            payload: &pack.payload,
            format,
            needs_ack: pack.needs_ack(),
        };
        let id = match self.transport.encode(unit) {
            Ok(id) => id,
            Err(e) => {
                debug!(
                    shard = self.shard,
                    uplink = %self.cfg.name,
                    records = pack.records,
                    bytes = pack.payload.len(),
                    error = %e,
                    "SenML pack cannot be sent to the far end; its messages go one by one"
                );
                for (i, msg) in pack.msgs.into_iter().enumerate() {
                    self.alone.insert(i, Queued { msg, resend: false });
                }
                return false;
            }
        };
        self.metrics.packs_sent.inc();
        self.metrics.records_packed.add(pack.msgs.len() as u64);
        self.metrics.pack_records.observe(pack.records as u64);
        self.metrics.pack_bytes.observe(pack.payload.len() as u64);
        trace!(shard = self.shard, id = ?id, records = pack.records, "pack written");
        match id {
            Some(id) => {
                let backlog = pack.msgs.first().is_some_and(UplinkMessage::is_backlog);
                self.track(id, Carried::Pack(pack.msgs), backlog);
                if !pack.full {
                    self.last_partial = Some((id, self.send_seq));
                }
            }
            None => unacked_in_write.extend(pack.msgs),
        }
        true
    }

    /// Remember a written unit until the far end answers for `id`.
    fn track(&mut self, id: crate::sink::transport::SendId, carried: Carried, backlog: bool) {
        self.send_seq += 1;
        self.inflight_backlog += usize::from(backlog);
        let seq = self.send_seq;
        self.inflight.insert(
            id,
            Inflight {
                seq,
                carried,
                backlog,
            },
        );
    }
}
