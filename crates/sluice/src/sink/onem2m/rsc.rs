//! What a CSE's answer to a create-contentInstance means for the message, and the oneM2M
//! metrics.
//!
//! # Response status codes (X-M2M-RSC, onem2m-http.md §4) → outcome
//! | RSC | outcome | code a device gets (MQTT 5 PUBACK) |
//! |---|---|---|
//! | 2xxx (2001 CREATED) | acknowledged | 0x00 |
//! | 4004 NOT_FOUND | the CSE lost a parent: AE and containers re-created, the request retried once; a second 4004 is unclear | — / 0x80 |
//! | 4008 REQUEST_TIMEOUT, 5000 INTERNAL_SERVER_ERROR, 5103 TARGET_NOT_REACHABLE, 1000 ACCEPTED, other 5xxx | unclear (resent after a backoff; given up as `persistent_error` when it persists) | 0x80 |
//! | 4103 ORIGINATOR_HAS_NO_PRIVILEGE, 4126 APP_RULE_VALIDATION_FAILED | permanent, `not_authorized` | 0x87 |
//! | 4108 INVALID_CHILD_RESOURCE_TYPE | permanent, `topic_name_invalid` (the container template addresses something that is not a container) | 0x90 |
//! | 4000 BAD_REQUEST, 4015 UNSUPPORTED_MEDIA_TYPE, 4102 CONTENTS_UNACCEPTABLE, 6023/6024 | permanent, `payload_format_invalid` | 0x99 |
//! | 5207 NOT_ACCEPTABLE (ACME: one contentInstance larger than the container's `mbs`) | permanent, `other` | 0x83 |
//! | any other 4xxx or 6xxx | permanent, `other` | 0x83 |
//!
//! Without an X-M2M-RSC header the HTTP status decides: 2xx acknowledged, 429 and 503
//! temporary (0x97, resent after a backoff, never given up), other 5xx unclear, 404 as 4004,
//! other 4xx permanent (`other`, 0x83).

use crate::sink::transport::RefusalClass;
use crate::sink::RejectReason;
use crate::telemetry::metrics::{Counter, PromWriter};

/// What one answer means for the contentInstance it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Created,
    /// The target container (or its AE) does not exist.
    NotFound,
    Refused {
        code: u8,
        class: RefusalClass,
    },
}

/// Classify an answer by its RSC, else its HTTP status (module docs).
pub fn classify(status: u16, rsc: Option<u32>) -> Outcome {
    use RefusalClass::*;
    let refused = |code: u8, class: RefusalClass| Outcome::Refused { code, class };
    match rsc {
        Some(2000..=2999) => Outcome::Created,
        Some(4004) => Outcome::NotFound,
        Some(4103 | 4126) => refused(0x87, Permanent(RejectReason::NotAuthorized)),
        Some(4108) => refused(0x90, Permanent(RejectReason::TopicNameInvalid)),
        Some(4000 | 4015 | 4102 | 6023 | 6024) => {
            refused(0x99, Permanent(RejectReason::PayloadFormatInvalid))
        }
        Some(5207) => refused(0x83, Permanent(RejectReason::Other)),
        Some(1000..=1999 | 4008 | 5000..=5999) => refused(0x80, Unclear),
        Some(_) => refused(0x83, Permanent(RejectReason::Other)),
        None => match status {
            200..=299 => Outcome::Created,
            404 => Outcome::NotFound,
            429 | 503 => refused(0x97, Temporary),
            500..=599 => refused(0x80, Unclear),
            _ => refused(0x83, Permanent(RejectReason::Other)),
        },
    }
}

/// The RSC class of an answer, as the `class` label of `sluice_onem2m_responses_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RscClass {
    Informational = 0,
    Success = 1,
    Originator = 2,
    Receiver = 3,
    Network = 4,
    Missing = 5,
}

impl RscClass {
    pub const ALL: [RscClass; 6] = [
        RscClass::Informational,
        RscClass::Success,
        RscClass::Originator,
        RscClass::Receiver,
        RscClass::Network,
        RscClass::Missing,
    ];

    pub fn of(rsc: Option<u32>) -> RscClass {
        match rsc.map(|r| r / 1000) {
            Some(1) => RscClass::Informational,
            Some(2) => RscClass::Success,
            Some(4) => RscClass::Originator,
            Some(5) => RscClass::Receiver,
            Some(6) => RscClass::Network,
            _ => RscClass::Missing,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RscClass::Informational => "1xxx",
            RscClass::Success => "2xxx",
            RscClass::Originator => "4xxx",
            RscClass::Receiver => "5xxx",
            RscClass::Network => "6xxx",
            RscClass::Missing => "none",
        }
    }
}

/// oneM2M counters of one uplink lane on one shard (inside its `UplinkMetrics`; rendered only
/// once a oneM2M transport used them).
#[derive(Debug, Default)]
pub struct OneM2mMetrics {
    used: std::sync::atomic::AtomicBool,
    responses: [Counter; RscClass::ALL.len()],
    /// AEs registered (2001), at connect or after the CSE lost them.
    pub aes_created: Counter,
    /// Containers created (2001; "already exists" does not count).
    pub containers_created: Counter,
    /// contentInstances answered 4004 whose AE and containers were re-created, then retried.
    pub lost_parents: Counter,
    /// Connections the CSE closed after a response (`Connection: close`), requests resent.
    pub server_closes: Counter,
}

impl OneM2mMetrics {
    pub fn mark_used(&self) {
        self.used.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn record_response(&self, rsc: Option<u32>) {
        self.responses[RscClass::of(rsc) as usize].inc();
    }

    pub fn responses(&self, class: RscClass) -> u64 {
        self.responses[class as usize].get()
    }

    pub fn render(&self, w: &mut PromWriter, labels: &[(&str, &str)]) {
        if !self.used.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        for class in RscClass::ALL {
            let mut l = labels.to_vec();
            l.push(("class", class.as_str()));
            w.counter(
                "sluice_onem2m_responses_total",
                "Responses from the oneM2M CSE, by X-M2M-RSC class (none: no RSC header).",
                &l,
                self.responses(class),
            );
        }
        for (kind, c) in [
            ("ae", &self.aes_created),
            ("container", &self.containers_created),
        ] {
            let mut l = labels.to_vec();
            l.push(("type", kind));
            w.counter(
                "sluice_onem2m_resources_created_total",
                "AEs and containers the CSE created for sluice (2001), first time or re-created after the CSE lost them.",
                &l,
                c.get(),
            );
        }
        w.counter(
            "sluice_onem2m_lost_parents_total",
            "contentInstances answered 4004 (the CSE lost their container), retried after re-creating it.",
            labels,
            self.lost_parents.get(),
        );
        w.counter(
            "sluice_onem2m_server_closes_total",
            "Connections the CSE closed after a response (Connection: close); their unanswered requests were resent.",
            labels,
            self.server_closes.get(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rscs_map_to_outcomes_as_documented() {
        assert_eq!(classify(201, Some(2001)), Outcome::Created);
        assert_eq!(classify(404, Some(4004)), Outcome::NotFound);
        assert_eq!(
            classify(403, Some(4103)),
            Outcome::Refused {
                code: 0x87,
                class: RefusalClass::Permanent(RejectReason::NotAuthorized)
            }
        );
        assert_eq!(
            classify(400, Some(4000)),
            Outcome::Refused {
                code: 0x99,
                class: RefusalClass::Permanent(RejectReason::PayloadFormatInvalid)
            }
        );
        assert_eq!(
            classify(403, Some(4108)),
            Outcome::Refused {
                code: 0x90,
                class: RefusalClass::Permanent(RejectReason::TopicNameInvalid)
            }
        );
        assert_eq!(
            classify(500, Some(5000)),
            Outcome::Refused {
                code: 0x80,
                class: RefusalClass::Unclear
            }
        );
        assert_eq!(
            classify(503, None),
            Outcome::Refused {
                code: 0x97,
                class: RefusalClass::Temporary
            }
        );
        assert_eq!(classify(404, None), Outcome::NotFound);
        assert_eq!(classify(201, None), Outcome::Created);
        assert_eq!(
            classify(405, Some(4005)),
            Outcome::Refused {
                code: 0x83,
                class: RefusalClass::Permanent(RejectReason::Other)
            }
        );
    }

    #[test]
    fn rendered_only_once_used() {
        let m = OneM2mMetrics::default();
        let mut w = PromWriter::new();
        m.render(&mut w, &[("shard", "0")]);
        assert!(!w.finish().contains("sluice_onem2m"));
        m.mark_used();
        m.record_response(Some(2001));
        m.record_response(None);
        let mut w = PromWriter::new();
        m.render(&mut w, &[("shard", "0")]);
        let text = w.finish();
        assert!(
            text.contains("sluice_onem2m_responses_total{shard=\"0\",class=\"2xxx\"} 1"),
            "{text}"
        );
        assert!(text.contains("sluice_onem2m_responses_total{shard=\"0\",class=\"none\"} 1"));
    }
}
