//! HTTP sinks for edge functions (issue 19): one adaptor for every topic, each message an
//! HTTP POST in CloudEvents 1.0 binary mode, so the same function runs unchanged on sluice
//! and on Knative.
//!
//! Owns: [`cloudevents`] (the event's attributes and their binary-mode HTTP form), the
//! dispatcher ([`dispatch::FunctionTransport`], a [`crate::sink::transport::Transport`] behind
//! the generic outbox: one per function, shard and lane), its connections (`conn.rs`), and the
//! overflow hand-off from the router ([`Overflow`]). Does not own: instances and scaling
//! (`crate::functions::runtime`), the slots they offer (`crate::functions::FunctionHandle`), or
//! routing replies (the shard's [`Publish`] callback).
//!
//! There is no process or task per topic or per function on the sluice side beyond this one
//! outbox per (function, shard, lane); requests in flight each run as a short task on the shard.

pub mod cloudevents;
pub mod conn;
pub mod dispatch;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::functions::FunctionHandle;
use crate::message::DeviceMessage;
use crate::sink::outbox::{Outbox, OutboxSeed};
use crate::sink::{DownlinkDelivery, SessionSeed, UplinkMessage};

/// Routes a reply or a dead letter like a device message, to every subscriber and uplink but
/// never to a function (the shard builds it; see `shard::router::publish_from_function`).
pub type Publish = Rc<dyn Fn(DeviceMessage) -> DownlinkDelivery>;

/// Messages a function's sink could not queue (its queue was full): the router leaves them
/// here instead of waiting, and the dispatcher dead-letters them, so a slow function never
/// holds a device (and with it the cloud uplink).
#[derive(Default)]
pub struct Overflow {
    pub msgs: RefCell<Vec<UplinkMessage>>,
    pub wake: tokio::sync::Notify,
}

impl Overflow {
    pub fn push(&self, msg: UplinkMessage) {
        self.msgs.borrow_mut().push(msg);
        self.wake.notify_one();
    }
}

/// What a function's outbox needs beyond an uplink's.
#[derive(Clone)]
pub struct FunctionSeed {
    pub handle: Arc<FunctionHandle>,
    pub publish: Publish,
    pub overflow: Rc<Overflow>,
}

/// Start the outbox of one function lane on this shard. Must be called inside a `LocalSet`.
pub fn spawn(seed: SessionSeed, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    let f = seed
        .function
        .clone()
        .expect("a function sink's seed carries its handle");
    let transport = dispatch::FunctionTransport::new(seed.shard, f.handle, f.publish, f.overflow);
    let outbox = Outbox::new(OutboxSeed::from(seed), transport);
    tokio::task::spawn_local(outbox.run(shutdown))
}
