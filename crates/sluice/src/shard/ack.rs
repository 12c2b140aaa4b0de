//! Delivery acknowledgements from the uplink back to the device connection that sent a message.
//!
//! A device's QoS 1/2 PUBLISH is acknowledged to the device only after every uplink that took
//! the message got the cloud's PUBACK. The device connection owns a [`DeviceAcks`]; each
//! uplink holding the message holds a clone of its [`AckToken`]. When the last clone is
//! completed, the packet id is queued for the device connection, which writes the PUBACK (or
//! PUBREC). Everything here lives on one shard thread (`Rc`, no locks). If the device
//! disconnected meanwhile, completing is a no-op: the message still reached the cloud and a
//! device that reconnects resends it (duplicates, never loss).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use tokio::sync::Notify;

/// Packet ids the cloud has acknowledged, waiting to be acknowledged to the device.
/// `notify` is the device connection's one wake-up (shared with its session's outbox), so a
/// connection waits on a single `Notify` whatever woke it.
#[derive(Debug, Default)]
pub struct DeviceAcks {
    ready: RefCell<VecDeque<u16>>,
    pub notify: Rc<Notify>,
}

impl DeviceAcks {
    pub fn new() -> Rc<DeviceAcks> {
        Rc::new(DeviceAcks::default())
    }
    /// Acks that wake `notify` when ready.
    pub fn with_notify(notify: Rc<Notify>) -> Rc<DeviceAcks> {
        Rc::new(DeviceAcks {
            ready: RefCell::default(),
            notify,
        })
    }
    /// Take every packet id that is ready to be acknowledged, in completion order.
    pub fn drain_into(&self, out: &mut Vec<u16>) {
        out.extend(self.ready.borrow_mut().drain(..));
    }
    /// Take every packet id that is ready to be acknowledged, in completion order.
    pub fn drain(&self) -> Vec<u16> {
        self.ready.borrow_mut().drain(..).collect()
    }
    pub fn push(&self, packet_id: u16) {
        self.ready.borrow_mut().push_back(packet_id);
        self.notify.notify_one();
    }
}

#[derive(Debug)]
struct Pending {
    remaining: Cell<u32>,
    device: Weak<DeviceAcks>,
    packet_id: u16,
}

/// One outstanding acknowledgement. Clone it once per uplink that carries the message; call
/// [`AckToken::complete`] when that uplink's cloud acknowledged it.
#[derive(Debug)]
pub struct AckToken(Rc<Pending>);

impl AckToken {
    pub fn new(device: &Rc<DeviceAcks>, packet_id: u16) -> AckToken {
        AckToken(Rc::new(Pending {
            remaining: Cell::new(1),
            device: Rc::downgrade(device),
            packet_id,
        }))
    }
    /// Another holder (e.g. a second uplink) that must complete before the device is acked.
    pub fn share(&self) -> AckToken {
        self.0.remaining.set(self.0.remaining.get() + 1);
        AckToken(self.0.clone())
    }
    pub fn complete(self) {
        let left = self.0.remaining.get().saturating_sub(1);
        self.0.remaining.set(left);
        if left == 0 {
            if let Some(device) = self.0.device.upgrade() {
                device.push(self.0.packet_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_is_acked_only_after_every_uplink_completed() {
        let dev = DeviceAcks::new();
        let a = AckToken::new(&dev, 7);
        let b = a.share();
        a.complete();
        assert!(dev.drain().is_empty());
        b.complete();
        assert_eq!(dev.drain(), vec![7]);
    }

    #[test]
    fn completing_after_device_left_is_harmless() {
        let dev = DeviceAcks::new();
        let t = AckToken::new(&dev, 1);
        drop(dev);
        t.complete();
    }
}
