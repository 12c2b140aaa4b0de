//! The one interface through which the router hands messages to local subscribers.
//!
//! Owns: the [`LocalSubscriber`] trait and the fan-out's [`DeliveryStamp`]. An MQTT session
//! implements it (`crate::edge::mqtt::local`), and so does every CoAP observer, through the
//! stand-in session it holds; the router (`crate::shard::router`) knows subscribers only
//! through it, never an edge's session type.

use std::cell::Cell;
use std::rc::Rc;

use bytestring::ByteString;
use sluice_proto::mqtt::SubscriptionOptions;

use super::ShardContext;
use crate::message::{OutMessage, QueueRefusal};

/// What the router needs of a local subscriber — an MQTT session, or the stand-in session of
/// a CoAP observer — and all it knows of one: the router matches filters, picks the
/// subscribers and hands each its [`OutMessage`]; how a subscriber queues, bounds and writes
/// it is its own business.
pub trait LocalSubscriber {
    /// Who it is (a device's client id): a message is not delivered back to its origin
    /// through a subscription with MQTT 5's No Local.
    fn subscriber_id(&self) -> &ByteString;
    /// Whether its device is connected now: a shared subscription prefers a connected member.
    fn is_connected(&self) -> bool;
    /// The local fan-out's per-delivery stamp (see [`DeliveryStamp`]).
    fn delivery_stamp(&self) -> &DeliveryStamp;
    /// Take a message matched for it, within its own bounds and the shard's (an MQTT session
    /// makes room in the shard's outbox budget first, `crate::shard::limits::make_room`).
    /// The router counts a refusal.
    fn deliver(&self, ctx: &ShardContext, msg: OutMessage) -> Result<(), QueueRefusal>;
    /// Record a subscription in the subscriber's own state (it outlives a reconnect with the
    /// session); returns whether the subscriber already held `filter`.
    fn add_subscription(
        &self,
        filter: &ByteString,
        options: SubscriptionOptions,
        sub_id: u32,
    ) -> bool;
    /// Forget a subscription; returns whether the subscriber held it.
    fn remove_subscription(&self, filter: &ByteString) -> bool;
}

/// Local fan-out's per-delivery stamp on a subscriber (`crate::shard::router::deliver_local`):
/// the delivery that last counted it and its slot in that delivery's hit list, so a
/// subscriber matched by several filters is found again in O(1).
#[derive(Debug, Default)]
pub struct DeliveryStamp {
    pub mark: Cell<u64>,
    pub slot: Cell<usize>,
}

/// Whether two subscribers are the same one (by address: a `dyn` pointer's vtable may differ
/// between codegen units).
pub fn same(a: &Rc<dyn LocalSubscriber>, b: &Rc<dyn LocalSubscriber>) -> bool {
    std::ptr::addr_eq(Rc::as_ptr(a), Rc::as_ptr(b))
}

/// Whether `a` is `b` (a subscriber seen through the trait, and a concrete one).
pub fn is<T>(a: &Rc<dyn LocalSubscriber>, b: &Rc<T>) -> bool {
    std::ptr::addr_eq(Rc::as_ptr(a), Rc::as_ptr(b))
}
