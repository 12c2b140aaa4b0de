//! Delivery acknowledgements from the uplink back to the device connection that sent a message.
//!
//! A device's QoS 1/2 PUBLISH is acknowledged to the device only after every uplink that took
//! the message got the cloud's PUBACK. The device connection owns a [`DeviceAcks`]; each
//! uplink holding the message holds a clone of its [`AckToken`]. When the last clone is
//! completed, the packet id is queued for the device connection, which writes the PUBACK (or
//! PUBREC). Everything here lives on one shard thread (`Rc`, no locks). If the device
//! disconnected meanwhile, completing is a no-op: the message still reached the cloud and a
//! device that reconnects resends it (duplicates, never loss).
//!
//! Only device tokens live here: this is the edge's contract with everything downstream.
//! Where a message is stored on its way (a spool record, see `crate::sink::spool`) is the
//! sink's business: its outbox item (`crate::sink::UplinkMessage`) carries the record's
//! location next to the device token and acknowledges the record before completing the
//! token, so acknowledgements flow one way, transport → outbox → token → edge.
//!
//! A token may be completed with a failure reason code ([`AckToken::complete_with`]): an
//! uplink's cloud refused the message for good (MQTT 5 PUBACK 0x87, …) or it can never be
//! sent. The device is still acknowledged (nothing is left to retry), and an MQTT 5 device's
//! PUBACK carries the first such code ([`DeviceAcks::take_reason`]); 3.1.1 has no reason codes.
//!
//! A device token whose last clone is dropped without being completed (the spool failed
//! before the message was durable, or anything else lost track of it) marks its
//! [`DeviceAcks`] *abandoned*. The device would never get that PUBACK — and, since PUBACKs go
//! out in the order the device sent its messages, none after it — so its connection closes
//! at once: MQTT devices resend unacknowledged messages when they reconnect, and only then.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use tokio::sync::Notify;

/// Packet ids the cloud has acknowledged, waiting to be acknowledged to the device.
/// `notify` is the device connection's one wake-up (shared with its session's outbox), so a
/// connection waits on a single `Notify` whatever woke it.
#[derive(Debug, Default)]
pub struct DeviceAcks {
    /// Kept inline for the usual one or two ids, so completing a token and draining it touch
    /// no memory beyond this struct (the per-message path is bound by cache misses).
    ready: RefCell<ReadyIds>,
    /// Failure reason codes for packet ids whose message was refused (see the module docs);
    /// at most one entry per packet id, removed when it is taken or the id completes again.
    refused: RefCell<Vec<(u16, u8)>>,
    /// A message of this connection will never be acknowledged (see the module docs).
    /// Shared with the connection's pending tokens, which can still tell after the
    /// connection is gone.
    abandoned: Rc<Cell<bool>>,
    /// The same, set together with `abandoned` while this struct lives: what the connection
    /// checks on every turn, without reaching for the shared flag's own allocation.
    abandoned_here: Cell<bool>,
    pub notify: Rc<Notify>,
}

/// Packet ids ready to be acknowledged, in completion order: the first few inline, the rest
/// (only while the connection is behind) in `more`, which is used once anything is in it.
#[derive(Debug, Default)]
struct ReadyIds {
    inline: [u16; 3],
    len: u8,
    more: VecDeque<u16>,
}

impl ReadyIds {
    fn push(&mut self, id: u16) {
        let n = usize::from(self.len);
        if self.more.is_empty() && n < self.inline.len() {
            self.inline[n] = id;
            self.len += 1;
        } else {
            self.more.push_back(id);
        }
    }

    fn drain_into(&mut self, out: &mut Vec<u16>) {
        out.extend_from_slice(&self.inline[..usize::from(self.len)]);
        self.len = 0;
        if !self.more.is_empty() {
            out.extend(self.more.drain(..));
            // A backlog is over; don't keep its room.
            self.more = VecDeque::new();
        }
    }
}

impl DeviceAcks {
    pub fn new() -> Rc<DeviceAcks> {
        Rc::new(DeviceAcks::default())
    }
    /// Acks that wake `notify` when ready.
    pub fn with_notify(notify: Rc<Notify>) -> Rc<DeviceAcks> {
        Rc::new(DeviceAcks {
            notify,
            ..DeviceAcks::default()
        })
    }
    /// Whether a message of this connection was dropped unacknowledged (the connection must
    /// close so the device resends it).
    pub fn is_abandoned(&self) -> bool {
        // Every token that sets `abandoned` while this struct lives sets this too.
        self.abandoned_here.get()
    }
    /// Take every packet id that is ready to be acknowledged, in completion order.
    pub fn drain_into(&self, out: &mut Vec<u16>) {
        self.ready.borrow_mut().drain_into(out);
    }
    /// Take every packet id that is ready to be acknowledged, in completion order.
    pub fn drain(&self) -> Vec<u16> {
        let mut out = Vec::new();
        self.drain_into(&mut out);
        out
    }
    /// The reason code for the PUBACK of `packet_id`, taken: 0 (success), or for an MQTT 5
    /// device the failure code its message was completed with.
    pub fn take_reason(&self, packet_id: u16, version: sluice_proto::mqtt::ProtocolVersion) -> u8 {
        let mut refused = self.refused.borrow_mut();
        let Some(i) = refused.iter().position(|(id, _)| *id == packet_id) else {
            return 0;
        };
        let (_, code) = refused.swap_remove(i);
        match version {
            sluice_proto::mqtt::ProtocolVersion::V5 => code,
            sluice_proto::mqtt::ProtocolVersion::V311 => 0,
        }
    }

    /// Remember (or, for 0, forget) the reason code of `packet_id`'s acknowledgement.
    fn set_reason(&self, packet_id: u16, code: u8) {
        let mut refused = self.refused.borrow_mut();
        if !refused.is_empty() {
            refused.retain(|(id, _)| *id != packet_id);
        }
        if code != 0 {
            refused.push((packet_id, code));
        }
    }

    pub fn push(&self, packet_id: u16) {
        self.ready.borrow_mut().push(packet_id);
        self.notify.notify_one();
    }
}

#[derive(Debug)]
struct Pending {
    remaining: Cell<u32>,
    device: Weak<DeviceAcks>,
    /// The device connection's `abandoned` flag.
    abandoned: Rc<Cell<bool>>,
    packet_id: u16,
    /// The first failure reason code a holder completed with, or 0x10 (0: none).
    reason: Cell<u8>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.remaining.get() > 0 {
            // The flag is the connection's own; wake it so it closes.
            self.abandoned.set(true);
            if let Some(device) = self.device.upgrade() {
                device.abandoned_here.set(true);
                device.notify.notify_one();
            }
        }
    }
}

/// One outstanding acknowledgement. Share it ([`AckToken::share`]) once per uplink that
/// carries the message; call [`AckToken::complete`] when that uplink's cloud acknowledged it.
#[derive(Debug)]
pub struct AckToken(Rc<Pending>);

impl AckToken {
    pub fn new(device: &Rc<DeviceAcks>, packet_id: u16) -> AckToken {
        AckToken(Rc::new(Pending {
            remaining: Cell::new(1),
            device: Rc::downgrade(device),
            abandoned: device.abandoned.clone(),
            packet_id,
            reason: Cell::new(0),
        }))
    }

    /// Whether the device this token acknowledges has had another message abandoned (its
    /// connection is closing; storing this one would let it overtake the resent one).
    pub fn device_abandoned(&self) -> bool {
        self.0.abandoned.get()
    }

    /// Another holder (e.g. a second uplink) that must complete before the device is acked.
    pub fn share(&self) -> AckToken {
        let p = &self.0;
        p.remaining.set(p.remaining.get() + 1);
        AckToken(p.clone())
    }

    pub fn complete(self) {
        self.complete_with(0);
    }

    /// Complete with a reason code: 0 for success, a PUBACK failure code (≥ 0x80) when the
    /// message was refused for good, or 0x10 ("no matching subscribers") when the holder's
    /// uplink was removed before it could send it (ADR 0013). The device's PUBACK carries the
    /// first failure code of any holder, else 0x10 if a holder gave it (a success code: the
    /// gateway accepted the message), else success (MQTT 5 devices only).
    pub fn complete_with(self, reason: u8) {
        let p = self.0;
        let now = p.reason.get();
        if reason != 0 && (now == 0 || (now < 0x80 && reason >= 0x80)) {
            p.reason.set(reason);
        }
        let left = p.remaining.get().saturating_sub(1);
        p.remaining.set(left);
        if left == 0 {
            if let Some(device) = p.device.upgrade() {
                device.set_reason(p.packet_id, p.reason.get());
                device.push(p.packet_id);
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
    fn a_token_dropped_uncompleted_abandons_the_device_and_a_completed_one_does_not() {
        let dev = DeviceAcks::new();
        AckToken::new(&dev, 1).complete();
        assert!(!dev.is_abandoned());
        assert_eq!(dev.drain(), vec![1]);

        // One uplink completed, the other's clone was dropped: never acknowledged.
        let a = AckToken::new(&dev, 2);
        let b = a.share();
        a.complete();
        assert!(!dev.is_abandoned());
        drop(b);
        assert!(dev.is_abandoned());
        assert!(dev.drain().is_empty());
    }

    #[test]
    fn a_pending_token_still_tells_its_connection_was_abandoned_after_the_connection_is_gone() {
        let dev = DeviceAcks::new();
        let lost = AckToken::new(&dev, 1);
        let later = AckToken::new(&dev, 2);
        let other = AckToken::new(&DeviceAcks::new(), 3);
        assert!(!later.device_abandoned());
        drop(lost);
        assert!(later.device_abandoned());
        // The connection closes and its acks go; the later message's token still knows, so
        // its stored copy is not sent ahead of the device's resend.
        drop(dev);
        assert!(later.device_abandoned());
        assert!(!other.device_abandoned());
    }

    #[test]
    fn a_refusal_by_any_uplink_is_the_reason_an_mqtt5_device_is_told_and_a_later_success_clears_it()
    {
        use sluice_proto::mqtt::ProtocolVersion::{V311, V5};
        let dev = DeviceAcks::new();
        let a = AckToken::new(&dev, 4);
        let b = a.share();
        a.complete_with(0x87);
        b.complete();
        assert_eq!(dev.drain(), vec![4]);
        assert_eq!(dev.take_reason(4, V5), 0x87);
        assert_eq!(dev.take_reason(4, V5), 0, "taken once");

        AckToken::new(&dev, 5).complete_with(0x97);
        assert_eq!(dev.take_reason(5, V311), 0, "3.1.1 has no reason codes");
        // An entry left untaken is cleared when the same packet id completes with success.
        AckToken::new(&dev, 6).complete_with(0x90);
        AckToken::new(&dev, 6).complete();
        assert_eq!(dev.take_reason(6, V5), 0);
    }

    #[test]
    fn a_removed_uplinks_0x10_is_reported_unless_another_holder_refused_for_good() {
        use sluice_proto::mqtt::ProtocolVersion::{V311, V5};
        let dev = DeviceAcks::new();
        let a = AckToken::new(&dev, 1);
        let b = a.share();
        a.complete();
        b.complete_with(0x10);
        assert_eq!(dev.drain(), vec![1]);
        assert_eq!(dev.take_reason(1, V5), 0x10);
        let a = AckToken::new(&dev, 2);
        let b = a.share();
        a.complete_with(0x10);
        b.complete_with(0x87);
        dev.drain();
        assert_eq!(dev.take_reason(2, V5), 0x87);
        AckToken::new(&dev, 3).complete_with(0x10);
        dev.drain();
        assert_eq!(dev.take_reason(3, V311), 0);
    }

    #[test]
    fn ids_come_out_in_completion_order_however_many_are_waiting() {
        let dev = DeviceAcks::new();
        for id in 1..=10 {
            AckToken::new(&dev, id).complete();
        }
        assert_eq!(dev.drain(), (1..=10).collect::<Vec<u16>>());
        AckToken::new(&dev, 11).complete();
        AckToken::new(&dev, 12).complete();
        assert_eq!(dev.drain(), vec![11, 12]);
        for id in 13..=17 {
            AckToken::new(&dev, id).complete();
        }
        let mut out = vec![99];
        dev.drain_into(&mut out);
        assert_eq!(out, vec![99, 13, 14, 15, 16, 17]);
        assert!(dev.drain().is_empty());
    }

    #[test]
    fn dropping_after_the_device_left_is_harmless() {
        let dev = DeviceAcks::new();
        let t = AckToken::new(&dev, 1);
        drop(dev);
        drop(t);
    }

    #[test]
    fn completing_after_device_left_is_harmless() {
        let dev = DeviceAcks::new();
        let t = AckToken::new(&dev, 1);
        drop(dev);
        t.complete();
    }
}
