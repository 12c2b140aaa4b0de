//! Uplink metrics: one [`UplinkMetrics`] per (shard, uplink), written by that shard's session
//! task and queue, read by the admin thread (relaxed atomics only, `Send + Sync`).

use crate::telemetry::metrics::{Counter, Gauge, Histogram, PromWriter};

/// The session's connection state, as the `sluice_uplink_state` gauge value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UplinkState {
    Disconnected = 0,
    Connecting = 1,
    Connected = 2,
}

impl UplinkState {
    pub fn as_str(self) -> &'static str {
        match self {
            UplinkState::Disconnected => "disconnected",
            UplinkState::Connecting => "connecting",
            UplinkState::Connected => "connected",
        }
    }
}

/// Why a message bound for the cloud was not delivered. A fixed set, so the
/// `reason` label stays low-cardinality.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// QoS 0 message refused by [`super::UplinkQueue::try_push`] (counted by the caller).
    QueueFull = 0,
    /// Larger than the broker's Maximum Packet Size; its ack token was completed.
    TooLargeForCloud = 1,
    /// Could not be encoded (e.g. templated topic too long); its ack token was completed.
    InvalidForCloud = 2,
    /// MQTT 5 PUBACK with a failure reason code; its ack token was completed.
    CloudRejected = 3,
    /// QoS 0 message in a write that failed.
    ConnectionLost = 4,
}

impl DropReason {
    pub const ALL: [DropReason; 5] = [
        DropReason::QueueFull,
        DropReason::TooLargeForCloud,
        DropReason::InvalidForCloud,
        DropReason::CloudRejected,
        DropReason::ConnectionLost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "uplink_queue_full",
            DropReason::TooLargeForCloud => "too_large_for_cloud",
            DropReason::InvalidForCloud => "invalid_for_cloud",
            DropReason::CloudRejected => "cloud_rejected",
            DropReason::ConnectionLost => "connection_lost",
        }
    }
}

/// Metrics of one uplink session on one shard.
#[derive(Debug, Default)]
pub struct UplinkMetrics {
    /// [`UplinkState`] as an integer.
    pub state: Gauge,
    /// Connections that reached a successful CONNACK.
    pub connects: Counter,
    /// Connection attempts that failed before a successful CONNACK.
    pub connect_failures: Counter,
    /// PUBLISH packets written (including resends).
    pub messages_sent: Counter,
    /// PUBLISH packets written again after a reconnect (DUP set).
    pub messages_resent: Counter,
    /// QoS 1 messages the cloud acknowledged with success.
    pub messages_acked: Counter,
    /// Bytes handed to the (TLS) stream.
    pub bytes_written: Counter,
    /// `write_all` calls; `messages_sent / writes` is the coalescing factor.
    pub writes: Counter,
    /// QoS 1 messages sent and not yet acknowledged.
    pub inflight: Gauge,
    /// Messages waiting in the queue (not yet sent).
    pub queue_messages: Gauge,
    /// Bytes reserved in the queue: waiting *and* inflight messages (the bounded quantity).
    pub queue_bytes: Gauge,
    drops: [Counter; DropReason::ALL.len()],
    /// Device read → cloud PUBACK.
    pub ack_latency: Histogram,
    /// PUBLISH packets received from the cloud and handed to the downlink.
    pub downlink_messages: Counter,
}

impl UplinkMetrics {
    pub fn new() -> UplinkMetrics {
        UplinkMetrics::default()
    }

    pub fn record_drop(&self, reason: DropReason) {
        self.drops[reason as usize].inc();
    }

    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.drops[reason as usize].get()
    }

    pub(crate) fn set_state(&self, state: UplinkState) {
        self.state.set(state as i64);
    }

    pub fn uplink_state(&self) -> UplinkState {
        match self.state.get() {
            1 => UplinkState::Connecting,
            2 => UplinkState::Connected,
            _ => UplinkState::Disconnected,
        }
    }

    /// "disconnected", "connecting" or "connected", for the status API.
    pub fn state(&self) -> &'static str {
        self.uplink_state().as_str()
    }

    /// Average PUBLISH packets per write (0 before the first write).
    pub fn messages_per_write(&self) -> f64 {
        let writes = self.writes.get();
        if writes == 0 {
            0.0
        } else {
            self.messages_sent.get() as f64 / writes as f64
        }
    }

    pub fn render(&self, w: &mut PromWriter, shard: &str, uplink: &str) {
        let l: &[(&str, &str)] = &[("shard", shard), ("uplink", uplink)];
        w.gauge(
            "sluice_uplink_state",
            "Cloud session state: 0 disconnected, 1 connecting, 2 connected.",
            l,
            self.state.get(),
        );
        w.counter(
            "sluice_uplink_connects_total",
            "Connections to the cloud broker that were accepted (CONNACK success).",
            l,
            self.connects.get(),
        );
        w.counter(
            "sluice_uplink_connect_failures_total",
            "Connection attempts to the cloud broker that failed before CONNACK success.",
            l,
            self.connect_failures.get(),
        );
        w.counter(
            "sluice_uplink_messages_sent_total",
            "PUBLISH packets written to the cloud broker, resends included.",
            l,
            self.messages_sent.get(),
        );
        w.counter(
            "sluice_uplink_messages_resent_total",
            "PUBLISH packets written again (DUP) after a reconnect.",
            l,
            self.messages_resent.get(),
        );
        w.counter(
            "sluice_uplink_messages_acked_total",
            "QoS 1 messages the cloud broker acknowledged.",
            l,
            self.messages_acked.get(),
        );
        w.counter(
            "sluice_uplink_written_bytes_total",
            "Bytes of MQTT packets written to the cloud connection (before TLS).",
            l,
            self.bytes_written.get(),
        );
        w.counter(
            "sluice_uplink_writes_total",
            "Coalesced writes to the cloud connection; messages_sent / writes = messages per write.",
            l,
            self.writes.get(),
        );
        w.gauge(
            "sluice_uplink_inflight_messages",
            "QoS 1 messages sent to the cloud and not yet acknowledged.",
            l,
            self.inflight.get(),
        );
        w.gauge(
            "sluice_uplink_queue_messages",
            "Messages waiting in the uplink queue (not yet sent).",
            l,
            self.queue_messages.get(),
        );
        w.gauge(
            "sluice_uplink_queue_bytes",
            "Bytes reserved by the uplink queue: waiting and inflight messages.",
            l,
            self.queue_bytes.get(),
        );
        for reason in DropReason::ALL {
            w.counter(
                "sluice_uplink_dropped_total",
                "Messages bound for the cloud that were not delivered, by reason.",
                &[
                    ("shard", shard),
                    ("uplink", uplink),
                    ("reason", reason.as_str()),
                ],
                self.dropped(reason),
            );
        }
        w.histogram(
            "sluice_uplink_ack_latency_seconds",
            "Time from reading a message from the device to the cloud broker's PUBACK.",
            l,
            &self.ack_latency,
        );
        w.counter(
            "sluice_uplink_downlink_messages_total",
            "PUBLISH packets received from the cloud broker.",
            l,
            self.downlink_messages.get(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_names_every_metric_with_shard_and_uplink_labels() {
        let m = UplinkMetrics::new();
        m.messages_sent.add(10);
        m.writes.add(2);
        m.record_drop(DropReason::QueueFull);
        m.set_state(UplinkState::Connected);
        let mut w = PromWriter::new();
        m.render(&mut w, "0", "cloud");
        let text = w.finish();
        assert!(text.contains("sluice_uplink_messages_sent_total{shard=\"0\",uplink=\"cloud\"} 10"));
        assert!(text.contains("sluice_uplink_state{shard=\"0\",uplink=\"cloud\"} 2"));
        assert!(text.contains(
            "sluice_uplink_dropped_total{shard=\"0\",uplink=\"cloud\",reason=\"uplink_queue_full\"} 1"
        ));
        assert!(text
            .contains("sluice_uplink_ack_latency_seconds_count{shard=\"0\",uplink=\"cloud\"} 0"));
        assert!(text.contains("sluice_uplink_inflight_messages{"));
        assert!(text.contains("sluice_uplink_queue_messages{"));
        assert!(text.contains("sluice_uplink_queue_bytes{"));
        assert_eq!(m.state(), "connected");
        assert_eq!(m.messages_per_write(), 5.0);
    }
}
