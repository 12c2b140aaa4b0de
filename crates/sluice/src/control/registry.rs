//! The device registry: which device is connected on which shard, as gauges for operators.
//!
//! Owns: the client id → shard table fed by `ControlCmd::DeviceUp`/`DeviceDown`, the
//! `devices_connected` gauge and one devices gauge per shard (read by the admin status), and
//! the table's read side for the admin's device list ([`DeviceTable`], `GET /api/v1/devices`:
//! which devices this gateway holds, for a site of several gateways).
//!
//! Does not own: sessions, takeover or will messages (the device's shard does), nor admission
//! (`admission`). It is bookkeeping only: nothing routes by it.
//!
//! Invariants: each client id is counted once, on the shard of its latest `DeviceUp`; a
//! `DeviceDown` from a shard the device has since left (a takeover reported late) changes
//! nothing. The gauges always equal the table: `devices_connected` is its size and each shard's
//! gauge the ids on that shard. The table is behind a mutex only so the admin endpoint can
//! copy a page of it; the control thread holds the lock for one insert or remove, the admin
//! for copying at most [`MAX_PAGE`] entries' handles.
//!
//! Memory: one entry per connected MQTT device (its client id, shared with the session, plus
//! 32 B), bounded by `limits.max_connections` like the sessions themselves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytestring::ByteString;

use super::ControlMetrics;
use crate::telemetry::metrics::Gauge;

/// Most devices one page of [`DeviceTable::page`] lists.
pub const MAX_PAGE: usize = 100_000;

/// Where a connected device is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub shard: usize,
    /// When its session (re)connected here.
    pub since: SystemTime,
}

/// One page of the device list, in client id order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePage {
    /// Devices connected now.
    pub total: usize,
    pub devices: Vec<(ByteString, Held)>,
    /// The last client id listed when more follow (pass it as `after` for the next page).
    pub next: Option<ByteString>,
}

/// The registry's table, shared read-only with the admin endpoint.
#[derive(Clone, Default)]
pub struct DeviceTable(Arc<Mutex<HashMap<ByteString, Held>>>);

impl DeviceTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ByteString, Held>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Up to `limit` (at most [`MAX_PAGE`]) devices whose client id sorts after `after`.
    pub fn page(&self, after: Option<&str>, limit: usize) -> DevicePage {
        let limit = limit.clamp(1, MAX_PAGE);
        let (total, mut devices): (usize, Vec<(ByteString, Held)>) = {
            let table = self.lock();
            let rows = table
                .iter()
                .filter(|(id, _)| after.is_none_or(|a| &***id > a))
                .map(|(id, held)| (id.clone(), *held))
                .collect();
            (table.len(), rows)
        };
        devices.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let next = (devices.len() > limit).then(|| devices[limit - 1].0.clone());
        devices.truncate(limit);
        DevicePage {
            total,
            devices,
            next,
        }
    }
}

pub struct DeviceRegistry {
    devices: DeviceTable,
    per_shard: Arc<Vec<Gauge>>,
    metrics: Arc<ControlMetrics>,
}

impl DeviceRegistry {
    pub fn new(shards: usize, metrics: Arc<ControlMetrics>) -> DeviceRegistry {
        DeviceRegistry {
            devices: DeviceTable::default(),
            per_shard: Arc::new((0..shards).map(|_| Gauge::default()).collect()),
            metrics,
        }
    }

    /// Devices per shard (index = shard), shared with the admin status.
    pub fn per_shard(&self) -> Arc<Vec<Gauge>> {
        self.per_shard.clone()
    }

    /// The table's read side, for the admin's device list.
    pub fn table(&self) -> DeviceTable {
        self.devices.clone()
    }

    /// `client_id` is now connected on `shard` (it may have moved from another).
    pub fn up(&mut self, client_id: ByteString, shard: usize) {
        let held = Held {
            shard,
            since: SystemTime::now(),
        };
        let old = self.devices.lock().insert(client_id, held);
        if let Some(old) = old {
            self.shard_gauge(old.shard, |g| g.sub(1));
        } else {
            self.metrics.devices_connected.add(1);
        }
        self.shard_gauge(shard, |g| g.add(1));
    }

    /// `client_id` left `shard`; ignored unless that is where the registry has it.
    pub fn down(&mut self, client_id: &ByteString, shard: usize) {
        let removed = {
            let mut table = self.devices.lock();
            let here = table.get(client_id).is_some_and(|h| h.shard == shard);
            here && table.remove(client_id).is_some()
        };
        if removed {
            self.shard_gauge(shard, |g| g.sub(1));
            self.metrics.devices_connected.sub(1);
        }
    }

    /// Change the shard's gauge; a shard index beyond the table (a bug, not device input) is
    /// ignored rather than panicking the control plane.
    fn shard_gauge(&self, shard: usize, f: impl FnOnce(&Gauge)) {
        match self.per_shard.get(shard) {
            Some(g) => f(g),
            None => tracing::debug!(shard, "device reported on an unknown shard"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_moving_shards_is_counted_once_and_a_late_down_from_its_old_shard_is_ignored() {
        let metrics = Arc::new(ControlMetrics::default());
        let mut reg = DeviceRegistry::new(2, metrics.clone());
        let gauges = reg.per_shard();
        reg.up("d".into(), 0);
        reg.up("d".into(), 1);
        reg.down(&"d".into(), 0);
        assert_eq!(metrics.devices_connected.get(), 1);
        assert_eq!((gauges[0].get(), gauges[1].get()), (0, 1));
        reg.down(&"d".into(), 1);
        assert_eq!(metrics.devices_connected.get(), 0);
        assert_eq!((gauges[0].get(), gauges[1].get()), (0, 0));
    }

    #[test]
    fn the_device_list_pages_in_client_id_order_and_follows_moves() {
        let mut reg = DeviceRegistry::new(2, Arc::new(ControlMetrics::default()));
        let table = reg.table();
        for id in ["c", "a", "e", "b", "d"] {
            reg.up(id.into(), 0);
        }
        reg.up("d".into(), 1);
        reg.down(&"e".into(), 0);
        let first = table.page(None, 2);
        assert_eq!(first.total, 4);
        let ids: Vec<&str> = first.devices.iter().map(|(id, _)| &**id).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(first.next.as_deref(), Some("b"));
        let second = table.page(first.next.as_deref(), 2);
        let rows: Vec<(&str, usize)> = second
            .devices
            .iter()
            .map(|(id, h)| (&**id, h.shard))
            .collect();
        assert_eq!(rows, [("c", 0), ("d", 1)]);
        assert_eq!(second.next, None, "nothing after d");
        assert!(table.page(Some("d"), 10).devices.is_empty());
    }
}
