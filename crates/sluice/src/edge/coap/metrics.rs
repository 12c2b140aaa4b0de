//! Counters of one shard's CoAP edge (atomics, read by the admin endpoint on another thread).
//!
//! Owns: the counters and their Prometheus names. Does not own: the observers' or the
//! proxy's counters (their own modules).

use sluice_proto::coap::{Code, DecodeErrorKind};

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// Why a datagram was not a message sluice could serve. A fixed set (bounded labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatError {
    TooShort = 0,
    BadVersion = 1,
    TokenTooLong = 2,
    Truncated = 3,
    BadOption = 4,
    EmptyPayload = 5,
    NonEmptyEmpty = 6,
    /// Larger than `coap.max_message_size`.
    TooLarge = 7,
    /// A request with an unknown critical option (answered 4.02).
    UnknownCriticalOption = 8,
    /// A request with a bad value: topic, query, Uri-Path not UTF-8 (answered 4.00).
    BadRequest = 9,
    /// A message sluice does not expect from a device (a response, a non-empty ACK/RST).
    Unexpected = 10,
}

pub const FORMAT_ERRORS: [(FormatError, &str); 11] = [
    (FormatError::TooShort, "too_short"),
    (FormatError::BadVersion, "bad_version"),
    (FormatError::TokenTooLong, "token_too_long"),
    (FormatError::Truncated, "truncated"),
    (FormatError::BadOption, "bad_option"),
    (FormatError::EmptyPayload, "empty_payload"),
    (FormatError::NonEmptyEmpty, "non_empty_empty"),
    (FormatError::TooLarge, "too_large"),
    (
        FormatError::UnknownCriticalOption,
        "unknown_critical_option",
    ),
    (FormatError::BadRequest, "bad_request"),
    (FormatError::Unexpected, "unexpected"),
];

impl From<DecodeErrorKind> for FormatError {
    fn from(kind: DecodeErrorKind) -> FormatError {
        match kind {
            DecodeErrorKind::TooShort => FormatError::TooShort,
            DecodeErrorKind::BadVersion(_) => FormatError::BadVersion,
            DecodeErrorKind::TokenTooLong(_) => FormatError::TokenTooLong,
            DecodeErrorKind::TruncatedToken | DecodeErrorKind::TruncatedOption => {
                FormatError::Truncated
            }
            DecodeErrorKind::ReservedNibble | DecodeErrorKind::OptionNumberOverflow => {
                FormatError::BadOption
            }
            DecodeErrorKind::EmptyPayload => FormatError::EmptyPayload,
            DecodeErrorKind::NonEmptyEmpty => FormatError::NonEmptyEmpty,
            DecodeErrorKind::TooLarge(_) => FormatError::TooLarge,
        }
    }
}

/// Why a request was refused by a bound of the hostile-network rules (issue 28). A fixed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// An answer larger than 3× its request, or an Observe registration, from an address
    /// that has not proven it receives: answered 4.01 with an Echo option.
    Unverified = 0,
    /// A publish or observe without an identity while `coap.allow_anonymous` is false.
    Anonymous = 1,
    /// A topic or filter beyond `mqtt.max_topic_levels` / `mqtt.max_topic_length`.
    TopicLimit = 2,
    /// `coap.max_block_transfers_per_source` reached.
    BlockPerSource = 3,
    /// `coap.max_block_bytes` reached.
    BlockBytes = 4,
    /// An answer larger than `max_message_size` that cannot go block-wise (5.00 instead).
    TooLarge = 5,
}

/// (Observe registrations refused per source are `sluice_coap_observe_refused_per_source_total`.)
pub const REFUSALS: [(Refusal, &str); 6] = [
    (Refusal::Unverified, "unverified"),
    (Refusal::Anonymous, "anonymous"),
    (Refusal::TopicLimit, "topic_limit"),
    (Refusal::BlockPerSource, "block_per_source"),
    (Refusal::BlockBytes, "block_bytes"),
    (Refusal::TooLarge, "too_large"),
];

const METHODS: [&str; 6] = ["GET", "POST", "PUT", "DELETE", "FETCH", "other"];
const CLASSES: [&str; 4] = ["2xx", "4xx", "5xx", "other"];

/// The CoAP edge's counters on one shard.
#[derive(Debug, Default)]
pub struct CoapMetrics {
    pub datagrams_in: Counter,
    pub datagrams_out: Counter,
    /// Datagrams the socket could not take (send buffer full): UDP, so dropped.
    pub send_dropped: Counter,
    requests: [Counter; 6],
    responses: [Counter; 4],
    /// Duplicate CONs answered from the de-duplication table.
    pub duplicates_con: Counter,
    /// Duplicate NONs dropped.
    pub duplicates_non: Counter,
    pub rst_sent: Counter,
    pub rst_received: Counter,
    format_errors: [Counter; FORMAT_ERRORS.len()],
    refusals: [Counter; REFUSALS.len()],
    /// Addresses verified by an Echo they echoed, and by an ACK of a CON sluice sent.
    pub verified_echo: Counter,
    pub verified_ack: Counter,
    /// Addresses in the shard's verified table.
    pub verified_peers: Gauge,
    /// Bytes charged to the de-duplication table.
    pub exchange_bytes: Gauge,
    /// Block1 transfers forgotten after `coap.block_idle_timeout`.
    pub block_transfers_expired: Counter,
    /// Exchanges evicted from the de-duplication table before their lifetime ended.
    pub dedup_evictions: Counter,
    pub block_transfers_started: Counter,
    pub block_transfers_completed: Counter,
    /// 4.08, 4.13 or expiry.
    pub block_transfers_failed: Counter,
    /// 5.03 Service Unavailable answers (back-pressure, too many transfers, abandoned).
    pub unavailable: Counter,
    /// Messages handed to the router (CoAP publishes).
    pub publishes: Counter,
    /// Datagrams received here for a device of another shard and passed to its mailbox.
    pub steered_out: Counter,
    /// Datagrams received from another shard's socket.
    pub steered_in: Counter,
    /// Datagrams for another shard whose mailbox was full (dropped; a CON is resent).
    pub steer_dropped: Counter,
    /// Datagrams dropped by the per-source budget (`coap.source_rate`).
    pub throttled: Counter,
    /// Retransmissions of CONs sluice sent; and CONs given up (no ACK).
    pub retransmissions: Counter,
    pub con_timeouts: Counter,
    /// CoAP devices seen on this shard within EXCHANGE_LIFETIME.
    pub devices: Gauge,
    /// Exchanges held in the de-duplication table.
    pub exchanges: Gauge,
    /// When a refusal was last logged (rate limit of the log line).
    refusal_logged: std::sync::Mutex<Option<std::time::Instant>>,
}

impl CoapMetrics {
    pub fn request(&self, code: Code) {
        let i = match code {
            Code::GET => 0,
            Code::POST => 1,
            Code::PUT => 2,
            Code::DELETE => 3,
            Code::FETCH => 4,
            _ => 5,
        };
        self.requests[i].inc();
    }

    pub fn response(&self, code: Code) {
        let i = match code.class() {
            2 => 0,
            4 => 1,
            5 => 2,
            _ => 3,
        };
        self.responses[i].inc();
        if code == Code::SERVICE_UNAVAILABLE {
            self.unavailable.inc();
        }
    }

    pub fn format_error(&self, reason: FormatError) {
        self.format_errors[reason as usize].inc();
    }

    /// Count a refusal, and log it at most once a second per shard (constant message).
    pub fn refused(&self, why: Refusal, peer: std::net::SocketAddr) {
        self.refusals[why as usize].inc();
        let now = std::time::Instant::now();
        let mut last = self
            .refusal_logged
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| now.duration_since(t) >= std::time::Duration::from_secs(1)) {
            *last = Some(now);
            tracing::info!(%peer, reason = REFUSALS[why as usize].1, "coap request refused by a bound");
        }
    }

    pub fn refusals(&self, why: Refusal) -> u64 {
        self.refusals[why as usize].get()
    }

    pub fn format_errors(&self, reason: FormatError) -> u64 {
        self.format_errors[reason as usize].get()
    }

    pub fn render(&self, w: &mut PromWriter, shard: &str) {
        self.render_labeled(w, &[("shard", shard)]);
    }

    /// Render with `labels` on every sample (`shard`, and `transport="dtls"` for the DTLS
    /// edge's counters).
    pub fn render_labeled(&self, w: &mut PromWriter, labels: &[(&str, &str)]) {
        let l = labels;
        let with = |k: &'static str, v: &'static str| {
            let mut all = labels.to_vec();
            all.push((k, v));
            all
        };
        let c = |w: &mut PromWriter, name: &str, help: &str, v: &Counter| {
            w.counter(name, help, l, v.get())
        };
        c(
            w,
            "sluice_coap_datagrams_received_total",
            "CoAP datagrams read from devices",
            &self.datagrams_in,
        );
        c(
            w,
            "sluice_coap_datagrams_sent_total",
            "CoAP datagrams written to devices",
            &self.datagrams_out,
        );
        c(
            w,
            "sluice_coap_send_dropped_total",
            "CoAP datagrams the socket could not take",
            &self.send_dropped,
        );
        for (i, m) in METHODS.iter().enumerate() {
            w.counter(
                "sluice_coap_requests_total",
                "CoAP requests from devices, by method",
                &with("method", m),
                self.requests[i].get(),
            );
        }
        for (i, class) in CLASSES.iter().enumerate() {
            w.counter(
                "sluice_coap_responses_total",
                "CoAP responses to devices, by code class",
                &with("class", class),
                self.responses[i].get(),
            );
        }
        w.counter(
            "sluice_coap_duplicates_total",
            "Duplicate CoAP messages (same peer and message id)",
            &with("type", "con"),
            self.duplicates_con.get(),
        );
        w.counter(
            "sluice_coap_duplicates_total",
            "Duplicate CoAP messages (same peer and message id)",
            &with("type", "non"),
            self.duplicates_non.get(),
        );
        c(
            w,
            "sluice_coap_rst_sent_total",
            "CoAP RSTs sent",
            &self.rst_sent,
        );
        c(
            w,
            "sluice_coap_rst_received_total",
            "CoAP RSTs received",
            &self.rst_received,
        );
        for (reason, name) in FORMAT_ERRORS {
            w.counter(
                "sluice_coap_format_errors_total",
                "CoAP datagrams or requests refused, by reason",
                &with("reason", name),
                self.format_errors[reason as usize].get(),
            );
        }
        for (why, name) in REFUSALS {
            w.counter(
                "sluice_coap_refused_total",
                "CoAP requests refused by a hostile-network bound, by reason",
                &with("reason", name),
                self.refusals[why as usize].get(),
            );
        }
        for (how, v) in [("echo", &self.verified_echo), ("ack", &self.verified_ack)] {
            w.counter(
                "sluice_coap_verified_total",
                "Addresses that proved they receive, by how",
                &with("how", how),
                v.get(),
            );
        }
        w.gauge(
            "sluice_coap_verified_peers",
            "Addresses in the verified table",
            &l,
            self.verified_peers.get(),
        );
        w.gauge(
            "sluice_coap_exchange_bytes",
            "Bytes charged to the de-duplication table",
            &l,
            self.exchange_bytes.get(),
        );
        c(
            w,
            "sluice_coap_block_transfers_expired_total",
            "Block1 transfers forgotten after block_idle_timeout",
            &self.block_transfers_expired,
        );
        c(
            w,
            "sluice_coap_dedup_evictions_total",
            "Exchanges evicted from the de-duplication table before their lifetime",
            &self.dedup_evictions,
        );
        c(
            w,
            "sluice_coap_block_transfers_started_total",
            "Block1 transfers started",
            &self.block_transfers_started,
        );
        c(
            w,
            "sluice_coap_block_transfers_completed_total",
            "Block1 transfers completed",
            &self.block_transfers_completed,
        );
        c(
            w,
            "sluice_coap_block_transfers_failed_total",
            "Block1 transfers refused or expired",
            &self.block_transfers_failed,
        );
        c(
            w,
            "sluice_coap_unavailable_total",
            "5.03 Service Unavailable answers",
            &self.unavailable,
        );
        c(
            w,
            "sluice_coap_publishes_total",
            "CoAP publishes handed to the router",
            &self.publishes,
        );
        c(
            w,
            "sluice_coap_steered_out_total",
            "Datagrams passed to the owning shard",
            &self.steered_out,
        );
        c(
            w,
            "sluice_coap_steered_in_total",
            "Datagrams received from another shard's socket",
            &self.steered_in,
        );
        c(
            w,
            "sluice_coap_steer_dropped_total",
            "Datagrams dropped: the owning shard's mailbox was full",
            &self.steer_dropped,
        );
        c(
            w,
            "sluice_coap_throttled_total",
            "Datagrams dropped by the per-source budget",
            &self.throttled,
        );
        c(
            w,
            "sluice_coap_retransmissions_total",
            "Retransmissions of CONs sent to devices",
            &self.retransmissions,
        );
        c(
            w,
            "sluice_coap_con_timeouts_total",
            "CONs sent to devices never acknowledged",
            &self.con_timeouts,
        );
        w.gauge(
            "sluice_coap_devices",
            "CoAP devices seen within EXCHANGE_LIFETIME",
            l,
            self.devices.get(),
        );
        w.gauge(
            "sluice_coap_exchanges",
            "Exchanges in the de-duplication table",
            l,
            self.exchanges.get(),
        );
    }
}
