//! Counters of one shard's DTLS listener (`sluice_coap_dtls_*`), atomics read by the admin
//! endpoint. The CoAP counters of the requests that came over DTLS are a `CoapMetrics` of
//! their own, rendered with `transport="dtls"` (`super::DtlsSeed::coap_metrics`).
//!
//! Owns: the counters and their names. Does not own: the CoAP counters.

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// Why a datagram on the DTLS port was dropped before any session saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// From an address with no session, and not a ClientHello.
    NoSession = 0,
    /// Over the per-source budget (`coap.source_rate`).
    Throttled = 1,
    /// A ClientHello whose cookie sluice did not make (or an expired one): answered with a
    /// fresh HelloVerifyRequest, counted here too.
    BadCookie = 2,
}

pub const DROPPED: [(Dropped, &str); 3] = [
    (Dropped::NoSession, "no_session"),
    (Dropped::Throttled, "throttled"),
    (Dropped::BadCookie, "bad_cookie"),
];

/// Why a handshake did not finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// OpenSSL refused it (unknown PSK identity, bad certificate, protocol error).
    Refused = 0,
    /// Not finished within `handshake_timeout` (e.g. a wrong PSK key: DTLS silently drops
    /// records it cannot authenticate, so the peer's Finished never counts).
    Timeout = 1,
    /// Closed to make room for a new session (`max_sessions`).
    Evicted = 2,
}

pub const HANDSHAKE_FAILURES: [(HandshakeFailure, &str); 3] = [
    (HandshakeFailure::Refused, "refused"),
    (HandshakeFailure::Timeout, "timeout"),
    (HandshakeFailure::Evicted, "evicted"),
];

/// Why an established session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// The peer said close_notify.
    Closed = 0,
    /// No datagram either way for `idle_timeout`.
    Idle = 1,
    /// The least recently active, closed to make room (`max_sessions`).
    Evicted = 2,
    /// A fatal alert or a record OpenSSL refused.
    Failed = 3,
    /// The peer started a new handshake (with a valid cookie) from the same address.
    Replaced = 4,
}

pub const SESSION_ENDS: [(SessionEnd, &str); 5] = [
    (SessionEnd::Closed, "closed"),
    (SessionEnd::Idle, "idle"),
    (SessionEnd::Evicted, "evicted"),
    (SessionEnd::Failed, "failed"),
    (SessionEnd::Replaced, "replaced"),
];

#[derive(Debug, Default)]
pub struct DtlsMetrics {
    pub datagrams_in: Counter,
    pub datagrams_out: Counter,
    /// Datagrams the socket could not take.
    pub send_dropped: Counter,
    /// HelloVerifyRequests sent (stateless: no session exists for these peers).
    pub hello_verify_sent: Counter,
    dropped: [Counter; DROPPED.len()],
    /// Handshakes finished (sessions established).
    pub handshakes: Counter,
    failures: [Counter; HANDSHAKE_FAILURES.len()],
    ends: [Counter; SESSION_ENDS.len()],
    /// Application datagrams to a peer without an established session (closed meanwhile).
    pub no_session_egress: Counter,
    /// Sessions held now (handshaking and established).
    pub sessions: Gauge,
    /// Of which handshaking.
    pub handshaking: Gauge,
}

impl DtlsMetrics {
    pub fn dropped(&self, why: Dropped) {
        self.dropped[why as usize].inc();
    }

    pub fn failed(&self, why: HandshakeFailure) {
        self.failures[why as usize].inc();
    }

    pub fn ended(&self, why: SessionEnd) {
        self.ends[why as usize].inc();
    }

    pub fn failures(&self) -> u64 {
        self.failures.iter().map(Counter::get).sum()
    }

    pub fn render(&self, w: &mut PromWriter, shard: &str) {
        let l = [("shard", shard)];
        w.counter(
            "sluice_coap_dtls_datagrams_received_total",
            "Datagrams read on the DTLS port",
            &l,
            self.datagrams_in.get(),
        );
        w.counter(
            "sluice_coap_dtls_datagrams_sent_total",
            "Datagrams written on the DTLS port",
            &l,
            self.datagrams_out.get(),
        );
        w.counter(
            "sluice_coap_dtls_send_dropped_total",
            "DTLS datagrams the socket could not take",
            &l,
            self.send_dropped.get(),
        );
        w.counter(
            "sluice_coap_dtls_hello_verify_sent_total",
            "HelloVerifyRequests sent (stateless cookie exchange)",
            &l,
            self.hello_verify_sent.get(),
        );
        for (why, name) in DROPPED {
            w.counter(
                "sluice_coap_dtls_dropped_total",
                "Datagrams on the DTLS port dropped before any session, by reason",
                &[("shard", shard), ("reason", name)],
                self.dropped[why as usize].get(),
            );
        }
        w.counter(
            "sluice_coap_dtls_handshakes_total",
            "DTLS handshakes finished",
            &l,
            self.handshakes.get(),
        );
        for (why, name) in HANDSHAKE_FAILURES {
            w.counter(
                "sluice_coap_dtls_handshake_failures_total",
                "DTLS handshakes that did not finish, by reason",
                &[("shard", shard), ("reason", name)],
                self.failures[why as usize].get(),
            );
        }
        for (why, name) in SESSION_ENDS {
            w.counter(
                "sluice_coap_dtls_sessions_ended_total",
                "Established DTLS sessions that ended, by reason",
                &[("shard", shard), ("reason", name)],
                self.ends[why as usize].get(),
            );
        }
        w.counter(
            "sluice_coap_dtls_no_session_egress_total",
            "CoAP datagrams for a DTLS peer whose session had ended (dropped, never sent in clear)",
            &l,
            self.no_session_egress.get(),
        );
        w.gauge(
            "sluice_coap_dtls_sessions",
            "DTLS sessions held (handshaking and established)",
            &l,
            self.sessions.get(),
        );
        w.gauge(
            "sluice_coap_dtls_handshaking",
            "DTLS sessions still handshaking",
            &l,
            self.handshaking.get(),
        );
    }
}
