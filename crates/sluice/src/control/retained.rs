//! The retained store: the last retained message of each topic, replayed to new subscribers.
//!
//! Owns: the topic → message map, its bounds and what each message is charged, expiry on
//! replay (MQTT 5 Message Expiry Interval), and matching a subscriber's filters against the
//! stored topics.
//!
//! Does not own: deciding that a message is retained (the shard routing it sends
//! `ControlCmd::Retain`), delivering the replay (the subscriber's shard does), or subscription
//! bookkeeping (`subscriptions`).
//!
//! Invariants: at most `max_retained_messages` topics and `max_retained_bytes` bytes (topic +
//! payload + MQTT 5 properties + 256 B each); a message that does not fit is refused and
//! counted, and an existing topic keeps its old message. An empty payload deletes. The
//! `retained` and `retained_bytes` gauges equal the store's size after every change. An
//! expired message is never replayed (it stays stored until replaced or deleted).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{topic, Properties, QoS};

use super::ControlMetrics;

/// A retained message as stored and as replayed to new subscribers.
#[derive(Debug, Clone)]
pub struct RetainedMessage {
    pub topic: ByteString,
    pub payload: Bytes,
    pub qos: QoS,
    pub properties: Option<Box<Properties>>,
    /// MQTT 5 Message Expiry Interval as a deadline: an expired message is no longer replayed.
    pub expires_at: Option<std::time::Instant>,
}

/// What a retained message is charged against `mqtt.max_retained_bytes`.
fn retained_cost(m: &RetainedMessage) -> usize {
    use crate::shard::limits::{properties_cost, MESSAGE_OVERHEAD};
    m.topic.len()
        + m.payload.len()
        + m.properties.as_deref().map_or(0, properties_cost)
        + MESSAGE_OVERHEAD
}

/// The bounded retained store (see the module docs).
pub struct RetainedStore {
    messages: HashMap<ByteString, RetainedMessage>,
    /// `mqtt.max_retained_messages`.
    max_messages: usize,
    /// `mqtt.max_retained_bytes`, and the bytes charged now.
    max_bytes: usize,
    bytes: usize,
    metrics: Arc<ControlMetrics>,
    /// `[state] dir`: every accepted change is logged here (`crate::state`).
    log: Option<crate::state::StateLog>,
}

impl RetainedStore {
    pub fn new(max_messages: usize, metrics: Arc<ControlMetrics>) -> RetainedStore {
        RetainedStore {
            messages: HashMap::new(),
            max_messages,
            max_bytes: usize::MAX,
            bytes: 0,
            metrics,
            log: None,
        }
    }

    /// `[state] dir`: take back the messages loaded at start (within this store's bounds;
    /// what does not fit is refused and counted as any message), then log every change.
    pub fn restore(
        &mut self,
        log: crate::state::StateLog,
        messages: Vec<crate::state::StoredMessage>,
    ) {
        for m in messages {
            let clock = *log.clock();
            self.retain(RetainedMessage {
                topic: m.topic,
                payload: m.payload,
                qos: m.qos,
                properties: m.properties,
                expires_at: m.expires_at.map(|t| clock.instant(t)),
            });
        }
        self.log = Some(log);
    }

    fn journal(&self, msg: &RetainedMessage) {
        if let Some(log) = &self.log {
            let clock = log.clock();
            log.push(crate::state::Record::Retain(crate::state::StoredMessage {
                topic: msg.topic.clone(),
                payload: msg.payload.clone(),
                qos: msg.qos,
                retain: true,
                properties: msg.properties.clone(),
                expires_at: msg.expires_at.map(|t| clock.mono(t)),
            }));
        }
    }

    /// Input bounds: cap the store's bytes (`mqtt.max_retained_bytes`).
    pub fn set_max_bytes(&mut self, max: usize) {
        self.max_bytes = max;
    }

    /// Store `msg` under its topic, or delete the topic's message when the payload is empty.
    pub fn retain(&mut self, msg: RetainedMessage) {
        let old = self.messages.get(&msg.topic).map_or(0, retained_cost);
        if msg.payload.is_empty() {
            if self.messages.remove(&msg.topic).is_some() {
                self.journal(&msg);
            }
            self.bytes -= old;
        } else if self.messages.len() >= self.max_messages && old == 0 {
            self.metrics.retained_refused.inc();
            tracing::warn!(topic = %msg.topic, max = self.max_messages, "retained store full; message not retained");
        } else if self.bytes - old + retained_cost(&msg) > self.max_bytes {
            // Input bounds: an update that does not fit leaves the old message in place.
            self.metrics.retained_refused.inc();
            tracing::warn!(topic = %msg.topic, max_bytes = self.max_bytes, "retained store at max_retained_bytes; message not retained");
        } else {
            self.bytes = self.bytes - old + retained_cost(&msg);
            self.journal(&msg);
            self.messages.insert(msg.topic.clone(), msg);
        }
        self.metrics.retained.set(self.messages.len() as i64);
        self.metrics.retained_bytes.set(self.bytes as i64);
    }

    /// The unexpired messages whose topic matches any of `filters`.
    pub fn matching(&self, filters: &[ByteString]) -> Vec<RetainedMessage> {
        if filters.is_empty() {
            return Vec::new();
        }
        let now = std::time::Instant::now();
        self.messages
            .values()
            .filter(|m| m.expires_at.is_none_or(|at| at > now))
            .filter(|m| filters.iter().any(|f| topic::matches(f, &m.topic)))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(topic: &str, payload: &'static [u8]) -> RetainedMessage {
        RetainedMessage {
            topic: topic.into(),
            payload: Bytes::from_static(payload),
            qos: QoS::AtMostOnce,
            properties: None,
            expires_at: None,
        }
    }

    #[test]
    fn a_full_store_refuses_new_topics_but_updates_and_deletes_existing_ones() {
        let metrics = Arc::new(ControlMetrics::default());
        let mut store = RetainedStore::new(1, metrics.clone());
        store.retain(msg("a", b"1"));
        store.retain(msg("b", b"1"));
        assert_eq!(metrics.retained_refused.get(), 1);
        store.retain(msg("a", b"22"));
        let got = store.matching(&["#".into()]);
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].payload[..], b"22");
        store.retain(msg("a", b""));
        assert!(store.matching(&["#".into()]).is_empty());
        assert_eq!(
            (metrics.retained.get(), metrics.retained_bytes.get()),
            (0, 0)
        );
    }

    #[test]
    fn an_expired_message_is_not_replayed() {
        let mut store = RetainedStore::new(10, Arc::default());
        let mut m = msg("x/y", b"1");
        m.expires_at = Some(std::time::Instant::now() - std::time::Duration::from_millis(1));
        store.retain(m);
        store.retain(msg("x/z", b"1"));
        let got = store.matching(&["x/+".into()]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].topic, "x/z");
    }
}
