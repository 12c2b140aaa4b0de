//! Counters of the observers on one shard (`sluice_coap_observe_*`), kept on the shard's
//! `ShardMetrics` so /metrics renders them with the shard's other counters.
//!
//! Owns: the counters and their rendering. Does not own: the observers (`super::Observers`).

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// Why an observer was deregistered. A fixed set, so the label's cardinality is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deregistration {
    /// A GET without Observe, or with Observe = 1 (RFC 7641 §3.6).
    Get = 0,
    /// The device answered a notification with RST.
    Reset = 1,
    /// A CON notification was never acknowledged (MAX_RETRANSMIT spent): the device is gone.
    Silence = 2,
    /// A new registration with the same endpoint and token replaced it.
    Replaced = 3,
    /// The CON sent after `coap.observer_check` without confirmation, or to an address not
    /// verified yet, was never acknowledged (a NON observer that went away, or a spoofed one).
    Unconfirmed = 4,
}

pub const DEREGISTRATIONS: [(Deregistration, &str); 5] = [
    (Deregistration::Get, "get"),
    (Deregistration::Reset, "reset"),
    (Deregistration::Silence, "silence"),
    (Deregistration::Replaced, "replaced"),
    (Deregistration::Unconfirmed, "unconfirmed"),
];

/// Why a notification was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotificationDrop {
    /// More than `max_queued_notifications` waited behind an unacknowledged CON: the oldest
    /// went.
    QueueFull = 0,
    /// Its MQTT 5 Message Expiry Interval passed while it waited.
    Expired = 1,
    /// Larger than `coap.max_message_size` and its representation could not be kept for
    /// the later blocks (larger than this shard's share of `coap.max_snapshot_bytes`).
    TooLarge = 2,
    /// Larger than 3× the registration request (or than `max_message_size`: block-wise)
    /// while the observer's address has not proven it receives.
    Unverified = 3,
}

pub const NOTIFICATION_DROPS: [(NotificationDrop, &str); 4] = [
    (NotificationDrop::QueueFull, "queue_full"),
    (NotificationDrop::Expired, "expired"),
    (NotificationDrop::TooLarge, "too_large"),
    (NotificationDrop::Unverified, "unverified"),
];

#[derive(Debug, Default)]
pub struct ObserveMetrics {
    /// Observers registered now.
    pub observers: Gauge,
    pub registrations: Counter,
    /// Registrations refused at the shard's share of `coap.max_observers` (answered 5.03).
    pub refused: Counter,
    /// Registrations refused at `coap.max_observers_per_source` (answered 5.03).
    pub refused_per_source: Counter,
    /// Registrations of an authenticated (DTLS) device refused at
    /// `mqtt.max_subscriptions_per_session` (answered 5.03).
    pub refused_per_device: Counter,
    pub deregistrations: [Counter; DEREGISTRATIONS.len()],
    pub notifications_non: Counter,
    pub notifications_con: Counter,
    /// Notifications sent block-wise (block 0 with an ETag; the rest fetched by the client).
    pub blockwise: Counter,
    /// Bytes charged to this shard's snapshots of block-wise notifications.
    pub snapshot_bytes: Gauge,
    pub dropped: [Counter; NOTIFICATION_DROPS.len()],
}

impl ObserveMetrics {
    pub fn deregistered(&self, why: Deregistration) {
        self.deregistrations[why as usize].inc();
    }
    pub fn drop(&self, why: NotificationDrop) {
        self.dropped[why as usize].inc();
    }

    pub fn render(&self, w: &mut PromWriter, shard: &str) {
        let l = [("shard", shard)];
        w.gauge(
            "sluice_coap_observers",
            "CoAP Observe registrations held",
            &l,
            self.observers.get(),
        );
        w.counter(
            "sluice_coap_observe_registrations_total",
            "CoAP Observe registrations accepted (new or replacing)",
            &l,
            self.registrations.get(),
        );
        w.counter(
            "sluice_coap_observe_refused_total",
            "CoAP Observe registrations refused at coap.max_observers (5.03)",
            &l,
            self.refused.get(),
        );
        w.counter(
            "sluice_coap_observe_refused_per_source_total",
            "CoAP Observe registrations refused at coap.max_observers_per_source (5.03)",
            &l,
            self.refused_per_source.get(),
        );
        w.counter(
            "sluice_coap_observe_refused_per_device_total",
            "CoAP Observe registrations of a DTLS-authenticated device refused at mqtt.max_subscriptions_per_session (5.03)",
            &l,
            self.refused_per_device.get(),
        );
        for (why, name) in DEREGISTRATIONS {
            w.counter(
                "sluice_coap_observe_deregistrations_total",
                "CoAP Observe registrations ended, by reason",
                &[("shard", shard), ("reason", name)],
                self.deregistrations[why as usize].get(),
            );
        }
        for (ty, value) in [
            ("non", self.notifications_non.get()),
            ("con", self.notifications_con.get()),
        ] {
            w.counter(
                "sluice_coap_notifications_total",
                "CoAP Observe notifications sent, by message type",
                &[("shard", shard), ("type", ty)],
                value,
            );
        }
        w.counter(
            "sluice_coap_notifications_blockwise_total",
            "CoAP notifications larger than coap.max_message_size sent as their Block2 block 0 with an ETag",
            &l,
            self.blockwise.get(),
        );
        w.gauge(
            "sluice_coap_snapshot_bytes",
            "Bytes held for the later blocks of block-wise notifications (coap.max_snapshot_bytes)",
            &l,
            self.snapshot_bytes.get(),
        );
        for (why, name) in NOTIFICATION_DROPS {
            w.counter(
                "sluice_coap_notifications_dropped_total",
                "CoAP Observe notifications not sent, by reason",
                &[("shard", shard), ("reason", name)],
                self.dropped[why as usize].get(),
            );
        }
    }
}
