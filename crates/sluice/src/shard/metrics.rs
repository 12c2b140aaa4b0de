//! Metrics of one shard's device side. One struct per shard, shared with the admin endpoint.

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// Why a message was dropped. A fixed set, so the label's cardinality is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// A QoS 0 message found the uplink's memory bound reached.
    UplinkQueueFull = 0,
    /// A QoS 0 message found another shard's mailbox full.
    MailboxFull = 1,
    /// A device's outbox (queued while offline or slow) was full.
    SessionQueueFull = 2,
    /// Larger than the maximum packet size the receiving device announced.
    TooLargeForDevice = 3,
    /// The retained-message store is at its bound.
    RetainedStoreFull = 4,
    /// A QoS 0 message found the uplink's spool full (`when_full = "block"`).
    SpoolFull = 5,
    /// A queued message for a device passed its MQTT 5 Message Expiry Interval.
    Expired = 6,
    /// A shared subscription's member left between the publisher's pick and the delivery.
    SharedMemberGone = 7,
    /// The shard's outbox budget was full: the oldest queued message of the session holding
    /// the most went, to make room for a session holding less (`shard::limits::make_room`).
    CrowdedOut = 8,
    /// A QoS 0 message found the uplink's spool stalled (its file system full or read-only).
    SpoolStalled = 9,
}

pub const DROP_REASONS: [(DropReason, &str); 10] = [
    (DropReason::UplinkQueueFull, "uplink_queue_full"),
    (DropReason::MailboxFull, "mailbox_full"),
    (DropReason::SessionQueueFull, "session_queue_full"),
    (DropReason::TooLargeForDevice, "too_large_for_device"),
    (DropReason::RetainedStoreFull, "retained_store_full"),
    (DropReason::SpoolFull, "spool_full"),
    (DropReason::Expired, "expired"),
    (DropReason::SharedMemberGone, "shared_member_gone"),
    (DropReason::CrowdedOut, "crowded_out"),
    (DropReason::SpoolStalled, "spool_stalled"),
];

/// Why the gateway closed a device connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    ClientDisconnect = 0,
    PeerClosed = 1,
    ProtocolError = 2,
    KeepAliveTimeout = 3,
    SessionTakenOver = 4,
    SlowConsumer = 5,
    IoError = 6,
    Shutdown = 7,
    /// A message of the device was dropped before it was acknowledged (e.g. the spool
    /// failed); the device must reconnect to resend it.
    AckLost = 8,
    /// Input bounds: the device published to a topic beyond `mqtt.max_topic_levels` or
    /// `mqtt.max_topic_length`.
    TopicLimit = 9,
}

pub const CLOSE_REASONS: [(CloseReason, &str); 10] = [
    (CloseReason::ClientDisconnect, "client_disconnect"),
    (CloseReason::PeerClosed, "peer_closed"),
    (CloseReason::ProtocolError, "protocol_error"),
    (CloseReason::KeepAliveTimeout, "keep_alive_timeout"),
    (CloseReason::SessionTakenOver, "session_taken_over"),
    (CloseReason::SlowConsumer, "slow_consumer"),
    (CloseReason::IoError, "io_error"),
    (CloseReason::Shutdown, "shutdown"),
    (CloseReason::AckLost, "ack_lost"),
    (CloseReason::TopicLimit, "topic_limit"),
];

#[derive(Debug, Default)]
pub struct ShardMetrics {
    pub connections: Gauge,
    pub sessions: Gauge,
    pub subscriptions: Gauge,
    pub messages_received: Counter,
    pub bytes_received: Counter,
    pub messages_delivered: Counter,
    pub bytes_sent: Counter,
    pub messages_forwarded: Counter,
    pub cross_shard_sent: Counter,
    pub cross_shard_received: Counter,
    pub dropped: [Counter; DROP_REASONS.len()],
    pub closed: [Counter; CLOSE_REASONS.len()],
    /// CoAP Observe registrations and notifications on this shard (`edge::coap::observe`).
    pub coap_observe: crate::edge::coap::observe::ObserveMetrics,
    /// Input bounds (`shard::limits`).
    pub bounds: crate::shard::limits::BoundsMetrics,
}

impl ShardMetrics {
    pub fn count_drop(&self, reason: DropReason) {
        self.dropped[reason as usize].inc();
    }
    pub fn close(&self, reason: CloseReason) {
        self.closed[reason as usize].inc();
    }

    pub fn render(&self, w: &mut PromWriter, shard: &str) {
        let l = [("shard", shard)];
        w.gauge(
            "sluice_mqtt_connections",
            "Device connections open",
            &l,
            self.connections.get(),
        );
        w.gauge(
            "sluice_mqtt_sessions",
            "Device sessions held (connected or persistent)",
            &l,
            self.sessions.get(),
        );
        w.gauge(
            "sluice_mqtt_subscriptions",
            "Device subscriptions held",
            &l,
            self.subscriptions.get(),
        );
        w.counter(
            "sluice_mqtt_messages_received_total",
            "PUBLISH packets received from devices",
            &l,
            self.messages_received.get(),
        );
        w.counter(
            "sluice_mqtt_received_bytes_total",
            "Bytes read from device connections",
            &l,
            self.bytes_received.get(),
        );
        w.counter(
            "sluice_mqtt_messages_delivered_total",
            "PUBLISH packets written to devices",
            &l,
            self.messages_delivered.get(),
        );
        w.counter(
            "sluice_mqtt_sent_bytes_total",
            "Bytes written to device connections",
            &l,
            self.bytes_sent.get(),
        );
        w.counter(
            "sluice_mqtt_messages_forwarded_total",
            "Device messages handed to an uplink",
            &l,
            self.messages_forwarded.get(),
        );
        w.counter(
            "sluice_shard_cross_sent_total",
            "Messages sent to other shards' subscribers",
            &l,
            self.cross_shard_sent.get(),
        );
        w.counter(
            "sluice_shard_cross_received_total",
            "Messages received from other shards",
            &l,
            self.cross_shard_received.get(),
        );
        for (reason, name) in DROP_REASONS {
            w.counter(
                "sluice_mqtt_dropped_total",
                "Messages dropped, by reason",
                &[("shard", shard), ("reason", name)],
                self.dropped[reason as usize].get(),
            );
        }
        crate::shard::limits::render(self, w, shard);
        self.coap_observe.render(w, shard);
        for (reason, name) in CLOSE_REASONS {
            w.counter(
                "sluice_mqtt_connections_closed_total",
                "Device connections ended, by reason",
                &[("shard", shard), ("reason", name)],
                self.closed[reason as usize].get(),
            );
        }
    }
}
