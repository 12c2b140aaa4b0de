//! The control plane: admission, the device table, subscription bookkeeping and the retained
//! store, on a thread of its own.
//!
//! Owns: every decision that is not per-message. The listener (edge/mqtt/listener.rs) runs here:
//! it reads each new connection's CONNECT, asks [`admission`] whether the device may in
//! (password hashes are checked on the blocking pool, so even expensive hashing stalls
//! neither this thread's other work nor any shard), hashes the device to its shard and hands
//! the socket over. Shards tell the control plane when a filter appears on or leaves a shard;
//! it publishes a read-mostly [`SubscriptionSnapshot`] through `arc-swap`, which shards read
//! without locks to route messages to each other. Shared subscriptions
//! (`$share/{group}/{filter}`) are kept apart in the snapshot: each group once, under its
//! filter, with the shards that have members, so a publishing shard can pick one.
//!
//! Does not own: sessions or per-device subscriptions (their shard does), or any message on
//! its way to the cloud. A storm of connects or subscribes queues here, not on the shards.
//!
//! Invariants: the command mailbox is bounded (`mailbox_capacity`); a subscribe is replied
//! to only after a snapshot containing it is published; the retained store holds at most
//! `max_retained_messages` topics and `max_retained_bytes` bytes (topic + payload + MQTT 5
//! properties + 256 B each); a message that does not fit is refused and counted, and an
//! existing topic keeps its old message.

pub mod admission;
pub mod priority;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{topic, Properties, QoS};
use tokio::sync::{mpsc, oneshot};

use crate::shard::trie::TopicTrie;
use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

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

#[derive(Debug)]
pub enum ControlCmd {
    /// Filters that now have their first subscriber on `shard` (`add`), and filters whose
    /// matching retained messages the subscriber wants (`retained_for`).
    Subscribe {
        shard: usize,
        add: Vec<ByteString>,
        retained_for: Vec<ByteString>,
        reply: oneshot::Sender<Vec<RetainedMessage>>,
    },
    /// Filters that lost their last subscriber on `shard`.
    Unsubscribe {
        shard: usize,
        remove: Vec<ByteString>,
    },
    /// Store (or, with an empty payload, delete) a retained message.
    Retain(RetainedMessage),
    DeviceUp {
        client_id: ByteString,
        shard: usize,
    },
    DeviceDown {
        client_id: ByteString,
        shard: usize,
    },
}

/// Which shards subscribe to which filters, as the data plane reads it.
#[derive(Debug, Default, Clone)]
pub struct SubscriptionSnapshot {
    pub trie: Arc<TopicTrie<u16>>,
    /// Shared subscriptions (`$share/{group}/{filter}`), stored under their filter: each
    /// group once, with the shards that have members.
    pub shared: Arc<TopicTrie<SharedGroup>>,
    /// Filters a shard has just got its first subscriber for and the control plane has not
    /// absorbed into `trie` yet: the shard adds them itself the moment it reads the SUBSCRIBE
    /// (a copy-on-write of this short list; the tries are shared), so a message another shard
    /// routes right after is not missed for as long as the control plane takes to rebuild.
    /// At most [`MAX_PENDING`]; beyond that shards leave it to the control plane, which
    /// removes each entry as it absorbs it.
    pub pending: Vec<(ByteString, u16)>,
}

/// Most entries in [`SubscriptionSnapshot::pending`] (each publish checks them all).
pub const MAX_PENDING: usize = 64;

/// One shared subscription as the data plane sees it: the publishing shard picks one of
/// `shards` (round robin) and that shard picks one of its local members.
#[derive(Debug, Clone)]
pub struct SharedGroup {
    /// The whole subscription, `$share/{group}/{filter}`: the key shards know it by.
    pub key: ByteString,
    /// Shards with at least one member, ascending.
    pub shards: Vec<u16>,
}

impl PartialEq for SharedGroup {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

pub type SharedSnapshot = Arc<ArcSwap<SubscriptionSnapshot>>;

#[derive(Debug, Default)]
pub struct ControlMetrics {
    pub admitted: Counter,
    pub rejected: Counter,
    pub refused_over_limit: Counter,
    pub handshake_failures: Counter,
    pub snapshot_rebuilds: Counter,
    pub retained: Gauge,
    pub retained_refused: Counter,
    pub devices_connected: Gauge,
    /// Password checks (admission's own block).
    pub admission: Arc<admission::AdmissionMetrics>,
    /// Input bounds: bytes of the retained store (topic + payload + 256 B each).
    pub retained_bytes: Gauge,
}

/// What a retained message is charged against `mqtt.max_retained_bytes`.
fn retained_cost(m: &RetainedMessage) -> usize {
    use crate::shard::limits::{properties_cost, MESSAGE_OVERHEAD};
    m.topic.len()
        + m.payload.len()
        + m.properties.as_deref().map_or(0, properties_cost)
        + MESSAGE_OVERHEAD
}

impl ControlMetrics {
    pub fn render(&self, w: &mut PromWriter) {
        w.counter(
            "sluice_control_admitted_total",
            "Device connections admitted",
            &[],
            self.admitted.get(),
        );
        w.counter(
            "sluice_control_rejected_total",
            "Device connections rejected by admission (CONNACK with an error code)",
            &[],
            self.rejected.get(),
        );
        w.counter(
            "sluice_control_refused_total",
            "Device connections refused at max_connections",
            &[],
            self.refused_over_limit.get(),
        );
        w.counter(
            "sluice_control_handshake_failures_total",
            "Connections closed before a valid CONNECT (timeout, bad packet)",
            &[],
            self.handshake_failures.get(),
        );
        w.counter(
            "sluice_control_snapshot_rebuilds_total",
            "Subscription snapshots published",
            &[],
            self.snapshot_rebuilds.get(),
        );
        w.gauge(
            "sluice_control_retained_messages",
            "Retained messages stored",
            &[],
            self.retained.get(),
        );
        w.counter(
            "sluice_control_retained_refused_total",
            "Retained messages refused at max_retained_messages or max_retained_bytes",
            &[],
            self.retained_refused.get(),
        );
        w.gauge(
            "sluice_control_retained_bytes",
            "Bytes of retained messages stored, charged topic + payload + 256 B each",
            &[],
            self.retained_bytes.get(),
        );
        w.gauge(
            "sluice_control_devices_connected",
            "Devices connected, all shards",
            &[],
            self.devices_connected.get(),
        );
        self.admission.render(w);
    }
}

/// The control plane's state, driven by [`ControlPlane::run`].
pub struct ControlPlane {
    shard_filters: HashMap<ByteString, BTreeSet<u16>>,
    retained: HashMap<ByteString, RetainedMessage>,
    devices: HashMap<ByteString, usize>,
    devices_per_shard: Arc<Vec<Gauge>>,
    snapshot: SharedSnapshot,
    max_retained: usize,
    metrics: Arc<ControlMetrics>,
    /// Input bounds: `mqtt.max_retained_bytes` and the bytes stored.
    max_retained_bytes: usize,
    retained_bytes: usize,
}

impl ControlPlane {
    pub fn new(
        shards: usize,
        max_retained: usize,
        snapshot: SharedSnapshot,
        metrics: Arc<ControlMetrics>,
    ) -> ControlPlane {
        ControlPlane {
            shard_filters: HashMap::new(),
            retained: HashMap::new(),
            devices: HashMap::new(),
            devices_per_shard: Arc::new((0..shards).map(|_| Gauge::default()).collect()),
            snapshot,
            max_retained,
            metrics,
            max_retained_bytes: usize::MAX,
            retained_bytes: 0,
        }
    }

    /// Input bounds: cap the retained store's bytes (`mqtt.max_retained_bytes`).
    pub fn with_max_retained_bytes(mut self, max: usize) -> ControlPlane {
        self.max_retained_bytes = max;
        self
    }

    pub fn devices_per_shard(&self) -> Arc<Vec<Gauge>> {
        self.devices_per_shard.clone()
    }

    /// Apply commands until every sender is gone. Commands that arrive together are applied
    /// together and the snapshot is rebuilt once for the batch.
    pub async fn run(mut self, mut inbox: mpsc::Receiver<ControlCmd>) {
        let mut batch = Vec::with_capacity(256);
        while inbox.recv_many(&mut batch, 256).await > 0 {
            let mut changed = false;
            let mut replies = Vec::new();
            // (filter, shard) pairs this batch added or removed: off the pending overlay.
            let mut absorbed: Vec<(ByteString, u16)> = Vec::new();
            for cmd in batch.drain(..) {
                match cmd {
                    ControlCmd::Subscribe {
                        shard,
                        add,
                        retained_for,
                        reply,
                    } => {
                        for f in add {
                            absorbed.push((f.clone(), shard as u16));
                            changed |= self
                                .shard_filters
                                .entry(f)
                                .or_default()
                                .insert(shard as u16);
                        }
                        let retained = self.retained_matching(&retained_for);
                        replies.push((reply, retained));
                    }
                    ControlCmd::Unsubscribe { shard, remove } => {
                        for f in remove {
                            absorbed.push((f.clone(), shard as u16));
                            if let Some(set) = self.shard_filters.get_mut(&f) {
                                changed |= set.remove(&(shard as u16));
                                if set.is_empty() {
                                    self.shard_filters.remove(&f);
                                }
                            }
                        }
                    }
                    ControlCmd::Retain(msg) => self.retain(msg),
                    ControlCmd::DeviceUp { client_id, shard } => {
                        if let Some(old) = self.devices.insert(client_id, shard) {
                            self.devices_per_shard[old].sub(1);
                        } else {
                            self.metrics.devices_connected.add(1);
                        }
                        self.devices_per_shard[shard].add(1);
                    }
                    ControlCmd::DeviceDown { client_id, shard } => {
                        if self.devices.get(&client_id) == Some(&shard) {
                            self.devices.remove(&client_id);
                            self.devices_per_shard[shard].sub(1);
                            self.metrics.devices_connected.sub(1);
                        }
                    }
                }
            }
            if changed || !absorbed.is_empty() {
                self.publish_snapshot(&absorbed);
            }
            for (reply, retained) in replies {
                let _ = reply.send(retained);
            }
        }
    }

    fn publish_snapshot(&self, absorbed: &[(ByteString, u16)]) {
        let mut trie = TopicTrie::new();
        let mut shared = TopicTrie::new();
        for (filter, shards) in &self.shard_filters {
            if let Some((_, inner)) = topic::shared_subscription(filter) {
                let group = SharedGroup {
                    key: filter.clone(),
                    shards: shards.iter().copied().collect(),
                };
                shared.insert(inner, group);
                continue;
            }
            for s in shards {
                trie.insert(filter, *s);
            }
        }
        let (trie, shared) = (Arc::new(trie), Arc::new(shared));
        self.snapshot.rcu(|old| SubscriptionSnapshot {
            trie: trie.clone(),
            shared: shared.clone(),
            pending: old
                .pending
                .iter()
                .filter(|p| !absorbed.contains(p))
                .cloned()
                .collect(),
        });
        self.metrics.snapshot_rebuilds.inc();
    }

    fn retain(&mut self, msg: RetainedMessage) {
        let old = self.retained.get(&msg.topic).map_or(0, retained_cost);
        if msg.payload.is_empty() {
            self.retained.remove(&msg.topic);
            self.retained_bytes -= old;
        } else if self.retained.len() >= self.max_retained && old == 0 {
            self.metrics.retained_refused.inc();
            tracing::warn!(topic = %msg.topic, max = self.max_retained, "retained store full; message not retained");
        } else if self.retained_bytes - old + retained_cost(&msg) > self.max_retained_bytes {
            // Input bounds: an update that does not fit leaves the old message in place.
            self.metrics.retained_refused.inc();
            tracing::warn!(topic = %msg.topic, max_bytes = self.max_retained_bytes, "retained store at max_retained_bytes; message not retained");
        } else {
            self.retained_bytes = self.retained_bytes - old + retained_cost(&msg);
            self.retained.insert(msg.topic.clone(), msg);
        }
        self.metrics.retained.set(self.retained.len() as i64);
        self.metrics.retained_bytes.set(self.retained_bytes as i64);
    }

    fn retained_matching(&self, filters: &[ByteString]) -> Vec<RetainedMessage> {
        if filters.is_empty() {
            return Vec::new();
        }
        let now = std::time::Instant::now();
        self.retained
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

    #[tokio::test]
    async fn the_control_plane_absorbs_pending_filters_and_keeps_the_others() {
        let snapshot: SharedSnapshot = Arc::new(ArcSwap::from_pointee(SubscriptionSnapshot {
            pending: vec![("a/+".into(), 1), ("b".into(), 0)],
            ..SubscriptionSnapshot::default()
        }));
        let cp = ControlPlane::new(2, 10, snapshot.clone(), Arc::default());
        let (tx, rx) = mpsc::channel(8);
        let task = tokio::spawn(cp.run(rx));
        let (reply, done) = oneshot::channel();
        tx.send(ControlCmd::Subscribe {
            shard: 1,
            add: vec!["a/+".into(), "$share/g/c".into()],
            retained_for: Vec::new(),
            reply,
        })
        .await
        .unwrap();
        done.await.unwrap();
        let s = snapshot.load();
        assert_eq!(s.pending, vec![("b".into(), 0)], "absorbed entry left");
        let mut shards = Vec::new();
        s.trie.for_each_match("a/x", |v| shards.push(*v));
        assert_eq!(shards, [1]);
        let mut groups = Vec::new();
        s.shared.for_each_match("c", |g| groups.push(g.clone()));
        assert_eq!(groups.len(), 1);
        assert_eq!(
            (groups[0].key.as_ref(), &groups[0].shards[..]),
            ("$share/g/c", &[1u16][..])
        );
        let mut none = Vec::new();
        s.trie.for_each_match("$share/g/c", |v| none.push(*v));
        assert!(
            none.is_empty(),
            "a shared subscription is not an ordinary filter"
        );
        drop(tx);
        task.await.unwrap();
    }
}
