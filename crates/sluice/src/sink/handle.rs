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
//! the spool record body, its user properties) is worked out on first need and shared by every sink ([`Offer`]).

use std::cell::{Cell, OnceCell};
use std::rc::Rc;

use bytestring::ByteString;
use sluice_proto::mqtt::QoS;

use super::spool::{Appended, UplinkSpool};
use super::{UplinkMessage, UplinkQueue, UplinkRoute};
use crate::control::priority::{Priority, PriorityTable};
use crate::message::ack::AckToken;
use crate::message::DeviceMessage;

/// One uplink as seen from a shard: its normal lane, its high lane when the priority table
/// has any high entry, and its spool when `[spool] dir` is set (normal lane only).
#[derive(Clone)]
pub struct Sink {
    pub route: UplinkRoute,
    pub queue: Rc<UplinkQueue>,
    pub high: Option<Rc<UplinkQueue>>,
    pub spool: Option<Rc<UplinkSpool>>,
    /// `Some` for a function's sink: a message its queue cannot take goes here (to be
    /// dead-lettered) instead of waiting, so a slow function never holds the device.
    pub overflow: Option<Rc<crate::sink::http::Overflow>>,
}

/// Why a sink dropped a message it would have forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfferDrop {
    /// QoS 0 and the lane's queue was full.
    QueueFull,
    /// The spool was full (QoS 0 under `block`, or any message under its drop policy).
    SpoolFull,
    /// QoS 0 and the spool's file system was full or read-only (the spool stalled).
    SpoolStalled,
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
    /// The device's MQTT 5 User Properties, copied once into a shared slice for all sinks.
    user_properties: OnceCell<Option<std::sync::Arc<[(ByteString, ByteString)]>>>,
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
            user_properties: OnceCell::new(),
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

    fn user_properties(&self) -> Option<std::sync::Arc<[(ByteString, ByteString)]>> {
        self.user_properties
            .get_or_init(|| {
                self.msg
                    .properties
                    .as_ref()
                    .filter(|p| !p.user_properties.is_empty())
                    .map(|p| std::sync::Arc::from(p.user_properties.as_slice()))
            })
            .clone()
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
                Some(body) => match spool.append(body, qos, share).await {
                    Appended::DroppedFull => offer.counters.dropped(OfferDrop::SpoolFull),
                    Appended::DroppedStalled => offer.counters.dropped(OfferDrop::SpoolStalled),
                    _ => {}
                },
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
            content_type: msg.properties.as_ref().and_then(|p| p.content_type.clone()),
            user_properties: offer.user_properties(),
            stored: None,
        };
        offer.counters.forwarded();
        if let Some(overflow) = &self.overflow {
            if let Err(up) = queue.try_push(up) {
                overflow.push(up);
            }
        } else if msg.qos == QoS::AtMostOnce {
            if queue.try_push(up).is_err() {
                offer.counters.dropped(OfferDrop::QueueFull);
            }
        } else {
            queue.push(up).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PriorityConfig;
    use crate::message::ack::DeviceAcks;
    use std::cell::RefCell;
    use std::time::Instant;

    #[derive(Default)]
    struct Counted {
        forwarded: Cell<usize>,
        dropped: RefCell<Vec<OfferDrop>>,
    }

    impl OfferCounters for Counted {
        fn forwarded(&self) {
            self.forwarded.set(self.forwarded.get() + 1);
        }
        fn dropped(&self, why: OfferDrop) {
            self.dropped.borrow_mut().push(why);
        }
    }

    fn message(topic: &str, qos: QoS, ack: Option<AckToken>) -> DeviceMessage {
        DeviceMessage {
            device: "dev-1".into(),
            topic: topic.into(),
            payload: bytes::Bytes::from_static(b"21.5"),
            qos,
            retain: false,
            properties: None,
            received_at: Instant::now(),
            ack,
        }
    }

    fn sink(forward: &str, capacity: usize, high_lane: bool) -> Sink {
        Sink {
            route: UplinkRoute::from_parts(vec![forward.into()], String::new(), None),
            queue: Rc::new(UplinkQueue::new(capacity)),
            high: high_lane.then(|| Rc::new(UplinkQueue::new(capacity))),
            spool: None,
            overflow: None,
        }
    }

    fn run(f: impl std::future::Future<Output = ()>) {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f);
    }

    #[test]
    fn a_sink_whose_filters_do_not_match_takes_nothing_and_counts_nothing() {
        let table = PriorityTable::new(&PriorityConfig::default());
        let counted = Counted::default();
        let s = sink("cloud/#", 1 << 20, false);
        let msg = message("local/temp", QoS::AtLeastOnce, None);
        run(s.offer(&Offer::new(&msg, Priority::Normal, &table, &counted)));
        assert!(s.queue.is_empty());
        assert_eq!(counted.forwarded.get(), 0);
    }

    #[test]
    fn a_qos0_message_finding_the_queue_full_is_dropped_and_counted() {
        let table = PriorityTable::new(&PriorityConfig::default());
        let counted = Counted::default();
        // Capacity 1 byte: the first message is admitted alone, the next finds it full.
        let s = sink("#", 1, false);
        let first = message("a", QoS::AtMostOnce, None);
        let second = message("b", QoS::AtMostOnce, None);
        run(async {
            s.offer(&Offer::new(&first, Priority::Normal, &table, &counted))
                .await;
            s.offer(&Offer::new(&second, Priority::Normal, &table, &counted))
                .await;
        });
        assert_eq!(s.queue.len(), 1);
        assert_eq!(counted.forwarded.get(), 2);
        assert_eq!(*counted.dropped.borrow(), vec![OfferDrop::QueueFull]);
    }

    #[test]
    fn a_high_priority_message_takes_the_high_lane_with_its_own_share_of_the_device_token() {
        let table = PriorityTable::new(&PriorityConfig::default());
        let counted = Counted::default();
        let s = sink("#", 1 << 20, true);
        let acks = DeviceAcks::new();
        let mut msg = message("alarm", QoS::ExactlyOnce, Some(AckToken::new(&acks, 7)));
        run(s.offer(&Offer::new(&msg, Priority::High, &table, &counted)));
        assert!(s.queue.is_empty());
        assert_eq!(s.high.as_ref().map(|q| q.len()), Some(1));
        // The router's own share completing does not answer the device: the sink holds one.
        if let Some(token) = msg.ack.take() {
            token.complete();
        }
        assert!(acks.drain().is_empty());
    }
}
