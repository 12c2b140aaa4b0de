//! One sink as a shard's router sees it: its forward filters, its lanes' queues and its spool,
//! and the one question the router asks it — "take this message?" ([`Sink::offer`]).
//!
//! Owns: turning a [`DeviceMessage`] into what the sink keeps — an [`UplinkMessage`] on the
//! lane queue its priority picks, or a spool record (normal lane with `[spool] dir`) — with
//! the overflow policy of each: QoS 0 finding the queue full is dropped and counted, QoS 1/2
//! waits for room (back-pressure on the publishing device); a full spool follows the spool's
//! own policy. Does not own: which sinks exist (the shard builds them from the config), the
//! sessions that drain the queues (`crate::sink::mqtt`), or the spool itself
//! (`crate::sink::spool`).
//!
//! Invariants: each sink that takes a message takes its own share of the device's
//! [`AckToken`]; the router completes its own share after asking every sink, so the device
//! is answered once every sink is done. What is worked out once per message (its priority,
//! the spool record body) is worked out on first need and shared by every sink ([`Offer`]).

use std::cell::{Cell, OnceCell};
use std::rc::Rc;

use sluice_proto::mqtt::QoS;

use super::spool::{Appended, UplinkSpool};
use super::{UplinkMessage, UplinkQueue, UplinkRoute};
use crate::control::priority::{Priority, PriorityTable};
use crate::edge::ack::AckToken;
use crate::edge::DeviceMessage;

/// One uplink as seen from a shard: its normal lane, its high lane when the priority table
/// has any high entry, and its spool when `[spool] dir` is set (normal lane only).
pub struct Sink {
    pub route: UplinkRoute,
    pub queue: Rc<UplinkQueue>,
    pub high: Option<Rc<UplinkQueue>>,
    pub spool: Option<Rc<UplinkSpool>>,
}

/// Why a sink dropped a message it would have forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfferDrop {
    /// QoS 0 and the lane's queue was full.
    QueueFull,
    /// The spool was full (QoS 0 under `block`, or any message under its drop policy).
    SpoolFull,
}

/// Where sinks count what they did with offered messages (the shard's metrics).
pub trait OfferCounters {
    /// The message matched the sink's forward filters and is on its way to it.
    fn forwarded(&self);
    /// A forwarded message was dropped.
    fn dropped(&self, why: OfferDrop);
}

/// One device message offered to every sink in turn, with what is computed once for all of
/// them on first need.
pub struct Offer<'m> {
    msg: &'m DeviceMessage,
    /// The publishing device's own priority.
    device: Priority,
    table: &'m PriorityTable,
    counters: &'m dyn OfferCounters,
    /// The message's priority (device and topic), asked of the table once.
    priority: Cell<Option<Priority>>,
    /// The spool record body, encoded once for all sinks (`None` inside: not encodable).
    spool_body: OnceCell<Option<Vec<u8>>>,
}

impl<'m> Offer<'m> {
    pub fn new(
        msg: &'m DeviceMessage,
        device: Priority,
        table: &'m PriorityTable,
        counters: &'m dyn OfferCounters,
    ) -> Offer<'m> {
        Offer {
            msg,
            device,
            table,
            counters,
            priority: Cell::new(None),
            spool_body: OnceCell::new(),
        }
    }

    fn priority(&self) -> Priority {
        match self.priority.get() {
            Some(p) => p,
            None => {
                let p = self.table.message(self.device, &self.msg.topic);
                self.priority.set(Some(p));
                p
            }
        }
    }

    /// The QoS towards the cloud: `ExactlyOnce` is sent as `AtLeastOnce`.
    fn uplink_qos(&self) -> QoS {
        if self.msg.qos == QoS::AtMostOnce {
            QoS::AtMostOnce
        } else {
            QoS::AtLeastOnce
        }
    }

    fn spool_body(&self) -> &Option<Vec<u8>> {
        self.spool_body.get_or_init(|| {
            let m = self.msg;
            super::spool::encode_message(
                &m.device,
                &m.topic,
                &m.payload,
                self.uplink_qos(),
                m.retain,
                m.received_at,
            )
        })
    }
}

impl Sink {
    /// The queue a message of this priority goes to.
    pub fn queue_for(&self, priority: Priority) -> &Rc<UplinkQueue> {
        match (priority, &self.high) {
            (Priority::High, Some(high)) => high,
            _ => &self.queue,
        }
    }

    /// Take the message if this sink's forward filters match: into the spool (normal lane
    /// with a spool), else onto its lane's queue. Waits only where a bound is reached for a
    /// QoS 1/2 message (see the module docs).
    pub async fn offer(&self, offer: &Offer<'_>) {
        let msg = offer.msg;
        if !self.route.forwards(&msg.topic) {
            return;
        }
        let queue = self.queue_for(offer.priority());
        let qos = offer.uplink_qos();
        if let (Some(spool), true) = (&self.spool, Rc::ptr_eq(queue, &self.queue)) {
            let body = offer.spool_body();
            offer.counters.forwarded();
            let share = msg.ack.as_ref().map(AckToken::share);
            match body {
                Some(body) => {
                    if spool.append(body, qos, share).await == Appended::DroppedFull {
                        offer.counters.dropped(OfferDrop::SpoolFull);
                    }
                }
                // Not encodable (a device id or topic over 64 KiB): can never be sent.
                None => {
                    if let Some(t) = share {
                        t.complete();
                    }
                }
            }
            return;
        }
        let up = UplinkMessage {
            device: msg.device.clone(),
            topic: msg.topic.clone(),
            payload: msg.payload.clone(),
            qos,
            retain: msg.retain,
            received_at: msg.received_at,
            ack: msg.ack.as_ref().map(AckToken::share),
        };
        offer.counters.forwarded();
        if msg.qos == QoS::AtMostOnce {
            if queue.try_push(up).is_err() {
                offer.counters.dropped(OfferDrop::QueueFull);
            }
        } else {
            queue.push(up).await;
        }
    }
}
