//! The control plane: every decision that is not per-message, one room per job, on a thread
//! of its own.
//!
//! Rooms:
//! - [`admission`] — identity: client-id rules and password checks (run by the device
//!   listener, `edge/mqtt/listener.rs`, on its own thread; see `app/`);
//! - [`registry`] — which device is connected on which shard (`DeviceUp`/`DeviceDown`);
//! - [`subscriptions`] — which shards subscribe to which filters, published incrementally as a
//!   read-mostly [`SubscriptionSnapshot`] through `arc-swap`, which shards read without locks
//!   to route messages to each other (shared subscriptions kept apart, each group once);
//! - [`retained`] — the bounded retained store and its replay to new subscribers;
//! - [`priority`] — the priority table (immutable; a reload publishes a new one through
//!   [`live`], with `[limits]`' publish rate);
//! - [`acl`] — authorization for every edge, an immutable snapshot published with `arc-swap`;
//! - [`limits`] — connection rates at accept and flapping client ids (the listener asks);
//! - [`phd`] — IEEE 11073 agents and their learnt configurations (the association room; its
//!   tasks run on the `sluice-phd` thread, `crate::edge::phd::assoc`).
//!
//! This file owns the wiring: [`ControlCmd`], the [`ControlPlane`] loop that applies commands
//! to the rooms in batches, and [`ControlMetrics`].
//!
//! Does not own: sessions or per-device subscriptions (their shard does), accepting sockets
//! (the listener thread), or any message on its way to the cloud. A storm of subscribes
//! queues here, not on the shards; a storm of connects queues on the listener thread, not
//! here.
//!
//! Invariants: the command mailbox is bounded (`mailbox_capacity`); commands that arrive
//! together are applied together and published in one snapshot; a subscribe is replied to
//! only after a snapshot containing it is published.

pub mod acl;
pub mod admission;
pub mod limits;
pub mod live;
pub mod phd;
pub mod priority;
pub mod registry;
pub mod retained;
pub mod subscriptions;

use std::sync::Arc;

use bytestring::ByteString;
use tokio::sync::{mpsc, oneshot};

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};
use registry::DeviceRegistry;
use retained::RetainedStore;
use subscriptions::SubscriptionStore;

pub use retained::RetainedMessage;
pub use subscriptions::{SharedGroup, SharedSnapshot, SubscriptionSnapshot, MAX_PENDING};

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

#[derive(Debug, Default)]
pub struct ControlMetrics {
    pub admitted: Counter,
    pub rejected: Counter,
    pub refused_over_limit: Counter,
    pub handshake_failures: Counter,
    /// Subscription snapshots published (the name predates incremental publication).
    pub snapshot_rebuilds: Counter,
    /// Publications that built the tries from the whole table (a reader held the spare copy).
    pub snapshot_full_builds: Counter,
    pub retained: Gauge,
    pub retained_refused: Counter,
    pub devices_connected: Gauge,
    /// Password checks (admission's own block).
    pub admission: Arc<admission::AdmissionMetrics>,
    /// Input bounds: bytes of the retained store (topic + payload + 256 B each).
    pub retained_bytes: Gauge,
    /// `[acl]` denials, all edges.
    pub acl: Arc<acl::AclMetrics>,
    /// `[limits]` refusals and drops.
    pub limits: Arc<limits::LimitsMetrics>,
    /// The TLS and WebSocket listeners' refusals before CONNECT, certificate identities.
    pub listeners: crate::edge::mqtt::listener::ListenerMetrics,
    /// `[state] dir`: the state writer's counters.
    pub state: Arc<crate::state::StateMetrics>,
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
        w.counter(
            "sluice_control_snapshot_full_builds_total",
            "Subscription snapshots built from the whole filter table instead of patched",
            &[],
            self.snapshot_full_builds.get(),
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
        self.acl.render(w);
        self.limits.render(w);
        self.listeners.render(w);
        self.state.render(w);
    }
}

/// The control plane's state, driven by [`ControlPlane::run`].
pub struct ControlPlane {
    subscriptions: SubscriptionStore,
    retained: RetainedStore,
    devices: DeviceRegistry,
}

impl ControlPlane {
    pub fn new(
        shards: usize,
        max_retained: usize,
        snapshot: SharedSnapshot,
        metrics: Arc<ControlMetrics>,
    ) -> ControlPlane {
        ControlPlane {
            subscriptions: SubscriptionStore::new(snapshot, metrics.clone()),
            retained: RetainedStore::new(max_retained, metrics.clone()),
            devices: DeviceRegistry::new(shards, metrics),
        }
    }

    /// `[state] dir`: the retained messages loaded at start, and where changes go.
    pub fn with_state(
        mut self,
        log: crate::state::StateLog,
        retained: Vec<crate::state::StoredMessage>,
    ) -> ControlPlane {
        self.retained.restore(log, retained);
        self
    }

    /// Input bounds: cap the retained store's bytes (`mqtt.max_retained_bytes`).
    pub fn with_max_retained_bytes(mut self, max: usize) -> ControlPlane {
        self.retained.set_max_bytes(max);
        self
    }

    pub fn devices_per_shard(&self) -> Arc<Vec<Gauge>> {
        self.devices.per_shard()
    }

    /// Which devices are connected on which shard, for the admin's device list.
    pub fn device_table(&self) -> registry::DeviceTable {
        self.devices.table()
    }

    /// Apply commands until every sender is gone. Commands that arrive together are applied
    /// together and published in one snapshot.
    pub async fn run(mut self, mut inbox: mpsc::Receiver<ControlCmd>) {
        let mut batch = Vec::with_capacity(256);
        while inbox.recv_many(&mut batch, 256).await > 0 {
            let mut replies = Vec::new();
            for cmd in batch.drain(..) {
                match cmd {
                    ControlCmd::Subscribe {
                        shard,
                        add,
                        retained_for,
                        reply,
                    } => {
                        for f in add {
                            self.subscriptions.add(shard as u16, f);
                        }
                        replies.push((reply, self.retained.matching(&retained_for)));
                    }
                    ControlCmd::Unsubscribe { shard, remove } => {
                        for f in remove {
                            self.subscriptions.remove(shard as u16, f);
                        }
                    }
                    ControlCmd::Retain(msg) => self.retained.retain(msg),
                    ControlCmd::DeviceUp { client_id, shard } => self.devices.up(client_id, shard),
                    ControlCmd::DeviceDown { client_id, shard } => {
                        self.devices.down(&client_id, shard)
                    }
                }
            }
            self.subscriptions.publish();
            for (reply, retained) in replies {
                let _ = reply.send(retained);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arc_swap::ArcSwap;

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
