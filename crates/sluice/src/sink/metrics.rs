//! Uplink metrics: one [`UplinkMetrics`] per (shard, uplink, lane), written by that shard's session
//! task and queue, read by the admin thread (relaxed atomics only, `Send + Sync`).

use super::socket::SocketMarks;
use crate::telemetry::metrics::{Counter, Gauge, Histogram, PromWriter, ValueHistogram};

/// The session's connection state: the `state` label of `sluice_uplink_state` whose value is 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UplinkState {
    Disconnected = 0,
    Connecting = 1,
    Connected = 2,
}

impl UplinkState {
    pub const ALL: [UplinkState; 3] = [
        UplinkState::Disconnected,
        UplinkState::Connecting,
        UplinkState::Connected,
    ];

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
    /// MQTT 5 PUBACK with a permanent failure reason code; its ack token was completed with it.
    CloudRejected = 3,
    /// QoS 0 message in a write that failed.
    ConnectionLost = 4,
    /// Still held when a reload removed its uplink and the drain deadline passed (ADR 0013):
    /// its ack token was completed with 0x10 ("no matching subscribers").
    UplinkRemoved = 5,
}

impl DropReason {
    pub const ALL: [DropReason; 6] = [
        DropReason::QueueFull,
        DropReason::TooLargeForCloud,
        DropReason::InvalidForCloud,
        DropReason::CloudRejected,
        DropReason::ConnectionLost,
        DropReason::UplinkRemoved,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "uplink_queue_full",
            DropReason::TooLargeForCloud => "too_large_for_cloud",
            DropReason::InvalidForCloud => "invalid_for_cloud",
            DropReason::CloudRejected => "cloud_rejected",
            DropReason::ConnectionLost => "connection_lost",
            DropReason::UplinkRemoved => "uplink_removed",
        }
    }
}

/// Why the cloud broker refused a message for good (MQTT 5 PUBACK reason codes that no resend
/// can change), as the `reason` label of `sluice_uplink_cloud_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// 0x87.
    NotAuthorized = 0,
    /// 0x90.
    TopicNameInvalid = 1,
    /// 0x99.
    PayloadFormatInvalid = 2,
    /// 0x80 or 0x83 still refused after many backoff rounds with no success in between.
    PersistentError = 3,
    /// Any other failure code.
    Other = 4,
}

impl RejectReason {
    pub const ALL: [RejectReason; 5] = [
        RejectReason::NotAuthorized,
        RejectReason::TopicNameInvalid,
        RejectReason::PayloadFormatInvalid,
        RejectReason::PersistentError,
        RejectReason::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::NotAuthorized => "not_authorized",
            RejectReason::TopicNameInvalid => "topic_name_invalid",
            RejectReason::PayloadFormatInvalid => "payload_format_invalid",
            RejectReason::PersistentError => "persistent_error",
            RejectReason::Other => "other",
        }
    }
}

/// Bucket bounds of the records-per-pack histogram.
pub const PACK_RECORD_BUCKETS: [u64; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
/// Bucket bounds (bytes) of the pack-size histogram.
pub const PACK_BYTE_BUCKETS: [u64; 10] = [
    256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262_144, 1_048_576,
];

/// Metrics of one uplink session (one lane) on one shard.
#[derive(Debug)]
pub struct UplinkMetrics {
    /// [`UplinkState`] as an integer.
    pub state: Gauge,
    /// Connections that reached a successful CONNACK.
    pub connects: Counter,
    /// Connection attempts that failed before a successful CONNACK.
    pub connect_failures: Counter,
    /// Connections made to another node of the cluster (`urls`) than the one last connected
    /// to (`sink/mqtt/failover.rs`).
    pub failovers: Counter,
    /// The node (url) the session last reached CONNACK success on; with `paths`, the last of
    /// the lane's path sessions to connect. Written once per connection.
    node: arc_swap::ArcSwapOption<String>,
    /// PUBLISH packets written (including resends).
    pub messages_sent: Counter,
    /// PUBLISH packets written again after a reconnect (DUP set).
    pub messages_resent: Counter,
    /// Messages given back by a dead or stalled path of several, to be resent on another.
    pub messages_returned: Counter,
    /// MPTCP state of the session's connection (`mptcp = true`).
    pub mptcp: crate::net::mptcp::MptcpMetrics,
    /// Per-path health of a multipath session (`paths`); empty otherwise.
    pub paths: crate::sink::paths::PathsMetrics,
    /// oneM2M counters (`sluice_onem2m_*`), rendered only for a oneM2M uplink.
    pub onem2m: crate::sink::onem2m::OneM2mMetrics,
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
    /// When the oldest message waiting in the queue was read from its device: microseconds
    /// from [`queue_epoch`] (negative before it: a spool record from an earlier run);
    /// [`NOTHING_WAITS`] when nothing waits. See [`UplinkMetrics::queue_oldest_age`].
    pub queue_oldest: Gauge,
    drops: [Counter; DropReason::ALL.len()],
    /// Device messages the cloud refused for good, by [`RejectReason`] (a pack counts each of
    /// its messages).
    rejected: [Counter; RejectReason::ALL.len()],
    /// Device messages resent after a temporary refusal (PUBACK 0x97, 0x80, 0x83, 0x91).
    pub refusals_retried: Counter,
    /// Downlink QoS 1 messages whose PUBACK to the cloud waited for local delivery.
    pub downlink_acked: Counter,
    /// Device read → cloud PUBACK.
    pub ack_latency: Histogram,
    /// PUBLISH packets received from the cloud and handed to the downlink.
    pub downlink_messages: Counter,
    /// SenML packs published (each one PUBLISH, counted in `messages_sent` too).
    pub packs_sent: Counter,
    /// Device messages that went to the cloud inside a pack.
    pub records_packed: Counter,
    /// Records per pack.
    pub pack_records: ValueHistogram,
    /// Encoded bytes per pack.
    pub pack_bytes: ValueHistogram,
    /// The session socket's marks as read back after connecting: SO_PRIORITY, TOS,
    /// TCP_NOTSENT_LOWAT and local port (all -1 before the first connection).
    socket: [Gauge; 4],
}

impl Default for UplinkMetrics {
    fn default() -> Self {
        // Fix the epoch early, so offsets stay small.
        let _ = queue_epoch();
        UplinkMetrics {
            state: Gauge::default(),
            connects: Counter::default(),
            connect_failures: Counter::default(),
            failovers: Counter::default(),
            node: arc_swap::ArcSwapOption::empty(),
            messages_sent: Counter::default(),
            messages_resent: Counter::default(),
            messages_returned: Counter::default(),
            mptcp: Default::default(),
            paths: Default::default(),
            onem2m: Default::default(),
            messages_acked: Counter::default(),
            bytes_written: Counter::default(),
            writes: Counter::default(),
            inflight: Gauge::default(),
            queue_messages: Gauge::default(),
            queue_bytes: Gauge::default(),
            queue_oldest: {
                let g = Gauge::default();
                g.set(NOTHING_WAITS);
                g
            },
            drops: Default::default(),
            rejected: Default::default(),
            refusals_retried: Counter::default(),
            downlink_acked: Counter::default(),
            ack_latency: Histogram::default(),
            downlink_messages: Counter::default(),
            packs_sent: Counter::default(),
            records_packed: Counter::default(),
            pack_records: ValueHistogram::new(&PACK_RECORD_BUCKETS),
            pack_bytes: ValueHistogram::new(&PACK_BYTE_BUCKETS),
            socket: std::array::from_fn(|_| {
                let g = Gauge::default();
                g.set(-1);
                g
            }),
        }
    }
}

/// [`UplinkMetrics::queue_oldest`] when the queue is empty.
pub const NOTHING_WAITS: i64 = i64::MIN;

/// The instant [`UplinkMetrics::queue_oldest`] counts from (fixed at first use, when the
/// first metrics are built; a receive time before it — a spool record from an earlier run — is
/// a negative offset).
pub fn queue_epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

impl UplinkMetrics {
    pub fn new() -> UplinkMetrics {
        UplinkMetrics::default()
    }

    /// Record when the oldest waiting message was received (`None`: the queue is empty).
    pub(crate) fn set_queue_oldest(&self, received_at: Option<std::time::Instant>) {
        let epoch = queue_epoch();
        let v = received_at.map_or(NOTHING_WAITS, |t| {
            if t >= epoch {
                t.duration_since(epoch).as_micros() as i64
            } else {
                -(epoch.duration_since(t).as_micros() as i64)
            }
        });
        self.queue_oldest.set(v);
    }

    /// How long the oldest message waiting in the queue has waited since its device sent it
    /// (`None`: nothing waits).
    pub fn queue_oldest_age(&self) -> Option<std::time::Duration> {
        let v = self.queue_oldest.get();
        if v == NOTHING_WAITS {
            return None;
        }
        let now = std::time::Instant::now();
        let since_epoch = now.saturating_duration_since(queue_epoch());
        let offset = std::time::Duration::from_micros(v.unsigned_abs());
        Some(if v >= 0 {
            since_epoch.saturating_sub(offset)
        } else {
            since_epoch + offset
        })
    }

    pub fn record_drop(&self, reason: DropReason) {
        self.drops[reason as usize].inc();
    }

    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.drops[reason as usize].get()
    }

    pub fn record_rejected(&self, reason: RejectReason, messages: u64) {
        self.rejected[reason as usize].add(messages);
    }

    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected[reason as usize].get()
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

    /// The socket marks read back after the last connect.
    pub fn socket_marks(&self) -> Option<SocketMarks> {
        let [priority, tos, lowat, port] = &self.socket;
        if port.get() < 0 {
            return None;
        }
        Some(SocketMarks {
            priority: priority.get() as u32,
            tos: tos.get() as u32,
            notsent_lowat: lowat.get() as u32,
            local_port: port.get() as u16,
        })
    }

    pub(crate) fn set_socket_marks(&self, marks: &SocketMarks) {
        let [priority, tos, lowat, port] = &self.socket;
        priority.set(i64::from(marks.priority));
        tos.set(i64::from(marks.tos));
        lowat.set(i64::from(marks.notsent_lowat));
        port.set(i64::from(marks.local_port));
    }

    /// The node the session last connected to (see the field).
    pub fn node(&self) -> Option<String> {
        self.node.load_full().map(|n| String::clone(&n))
    }

    pub(crate) fn set_node(&self, node: Option<String>) {
        self.node.store(node.map(std::sync::Arc::new));
    }

    pub fn render(&self, w: &mut PromWriter, shard: &str, uplink: &str, lane: &str) {
        let l: &[(&str, &str)] = &[("shard", shard), ("uplink", uplink), ("lane", lane)];
        w.state(
            "sluice_uplink_state",
            "Cloud session state: 1 for the current state label (disconnected, connecting, connected), 0 for the others.",
            l,
            "state",
            &UplinkState::ALL.map(UplinkState::as_str),
            self.state(),
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
            "sluice_uplink_failovers_total",
            "Connections made to another node of the broker cluster (urls) than the one last connected to.",
            l,
            self.failovers.get(),
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
            "sluice_uplink_messages_returned_total",
            "Messages a dead or stalled path gave back, resent on another path.",
            l,
            self.messages_returned.get(),
        );
        self.mptcp.render(w, "sluice_uplink", l);
        self.paths.render(w, l);
        self.onem2m.render(w, l);
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
        w.gauge_f64(
            "sluice_uplink_queue_oldest_age_seconds",
            "Time the oldest message waiting in the uplink queue (not yet sent) has waited since it was received; 0 when none waits.",
            l,
            self.queue_oldest_age().map_or(0.0, |d| d.as_secs_f64()),
        );
        for reason in DropReason::ALL {
            w.counter(
                "sluice_uplink_dropped_total",
                "Messages bound for the cloud that were not delivered, by reason.",
                &[
                    ("shard", shard),
                    ("uplink", uplink),
                    ("lane", lane),
                    ("reason", reason.as_str()),
                ],
                self.dropped(reason),
            );
        }
        for reason in RejectReason::ALL {
            w.counter(
                "sluice_uplink_cloud_rejected_total",
                "Messages the cloud broker refused for good (MQTT 5 PUBACK failure code), by reason; counted, logged and acknowledged to the device.",
                &[
                    ("shard", shard),
                    ("uplink", uplink),
                    ("lane", lane),
                    ("reason", reason.as_str()),
                ],
                self.rejected(reason),
            );
        }
        w.counter(
            "sluice_uplink_cloud_refusals_retried_total",
            "Messages resent after the cloud broker refused them for now (PUBACK 0x97, 0x80, 0x83, 0x91).",
            l,
            self.refusals_retried.get(),
        );
        w.counter(
            "sluice_uplink_downlink_acked_total",
            "Downlink QoS 1 messages acknowledged to the cloud after local delivery was accepted.",
            l,
            self.downlink_acked.get(),
        );
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
        w.counter(
            "sluice_uplink_packs_sent_total",
            "SenML packs of aggregated records published to the cloud.",
            l,
            self.packs_sent.get(),
        );
        w.counter(
            "sluice_uplink_records_packed_total",
            "Device messages sent to the cloud inside SenML packs.",
            l,
            self.records_packed.get(),
        );
        w.value_histogram(
            "sluice_uplink_pack_records",
            "Records per SenML pack.",
            l,
            &self.pack_records,
        );
        w.value_histogram(
            "sluice_uplink_pack_bytes",
            "Encoded bytes per SenML pack.",
            l,
            &self.pack_bytes,
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
        m.pack_records.observe(3);
        m.pack_bytes.observe(900);
        m.render(&mut w, "0", "cloud", "normal");
        let text = w.finish();
        let l = "shard=\"0\",uplink=\"cloud\",lane=\"normal\"";
        assert!(text.contains(&format!("sluice_uplink_messages_sent_total{{{l}}} 10")));
        assert!(text.contains(&format!("sluice_uplink_state{{{l},state=\"connected\"}} 1")));
        assert!(text.contains(&format!(
            "sluice_uplink_state{{{l},state=\"disconnected\"}} 0"
        )));
        assert!(text.contains(&format!(
            "sluice_uplink_dropped_total{{{l},reason=\"uplink_queue_full\"}} 1"
        )));
        assert!(text.contains(&format!("sluice_uplink_ack_latency_seconds_count{{{l}}} 0")));
        assert!(text.contains(&format!(
            "sluice_uplink_pack_records_bucket{{{l},le=\"2\"}} 0"
        )));
        assert!(text.contains(&format!(
            "sluice_uplink_pack_records_bucket{{{l},le=\"4\"}} 1"
        )));
        assert!(text.contains(&format!("sluice_uplink_pack_bytes_sum{{{l}}} 900")));
        assert!(text.contains("sluice_uplink_inflight_messages{"));
        assert!(text.contains("sluice_uplink_queue_messages{"));
        assert!(text.contains("sluice_uplink_queue_bytes{"));
        assert!(text.contains("sluice_uplink_queue_oldest_age_seconds{"));
        assert_eq!(m.state(), "connected");
        assert_eq!(m.messages_per_write(), 5.0);
    }
}
