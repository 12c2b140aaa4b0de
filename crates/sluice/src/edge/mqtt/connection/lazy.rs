//! Per-connection state that costs (almost) nothing until a device uses it: an idle
//! connection's memory is the budget here (docs/perf/connections.md, issue 32).

use std::collections::HashMap;
use std::rc::Rc;

use crate::message::ack::DeviceAcks;

/// A map that costs one pointer until its first entry (topic aliases: most devices use
/// none, and an empty `HashMap` inline is 48 bytes in every connection).
// Boxed on purpose: `Option<Box<_>>` is one word, `Option<HashMap>` 48 bytes.
#[allow(clippy::box_collection)]
pub(super) struct LazyMap<K, V>(Option<Box<HashMap<K, V>>>);

impl<K, V> Default for LazyMap<K, V> {
    fn default() -> Self {
        LazyMap(None)
    }
}

impl<K: std::hash::Hash + Eq, V> LazyMap<K, V> {
    pub(super) fn get(&self, key: &K) -> Option<&V> {
        self.0.as_ref()?.get(key)
    }
    pub(super) fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.0
            .get_or_insert_with(Default::default)
            .insert(key, value)
    }
    pub(super) fn remove(&mut self, key: &K) -> Option<V> {
        self.0.as_mut()?.remove(key)
    }
}

/// The connection's [`DeviceAcks`], created when first used (the first QoS 1/2 PUBLISH):
/// a device that never sends one — most idle devices — never pays for it.
pub(super) struct LazyAcks {
    acks: std::cell::OnceCell<Rc<DeviceAcks>>,
    /// The session's wake-up, which the acks share.
    notify: Rc<tokio::sync::Notify>,
}

impl LazyAcks {
    pub(super) fn new(notify: Rc<tokio::sync::Notify>) -> LazyAcks {
        LazyAcks {
            acks: std::cell::OnceCell::new(),
            notify,
        }
    }
    pub(super) fn created(&self) -> bool {
        self.acks.get().is_some()
    }
}

impl std::ops::Deref for LazyAcks {
    type Target = Rc<DeviceAcks>;
    fn deref(&self) -> &Rc<DeviceAcks> {
        self.acks
            .get_or_init(|| DeviceAcks::with_notify(self.notify.clone()))
    }
}
