//! The device registry: which device is connected on which shard, as gauges for operators.
//!
//! Owns: the client id → shard table fed by `ControlCmd::DeviceUp`/`DeviceDown`, the
//! `devices_connected` gauge and one devices gauge per shard (read by the admin status).
//!
//! Does not own: sessions, takeover or will messages (the device's shard does), nor admission
//! (`admission`). It is bookkeeping only: nothing routes by it.
//!
//! Invariants: each client id is counted once, on the shard of its latest `DeviceUp`; a
//! `DeviceDown` from a shard the device has since left (a takeover reported late) changes
//! nothing. The gauges always equal the table: `devices_connected` is its size and each shard's
//! gauge the ids on that shard.

use std::collections::HashMap;
use std::sync::Arc;

use bytestring::ByteString;

use super::ControlMetrics;
use crate::telemetry::metrics::Gauge;

pub struct DeviceRegistry {
    devices: HashMap<ByteString, usize>,
    per_shard: Arc<Vec<Gauge>>,
    metrics: Arc<ControlMetrics>,
}

impl DeviceRegistry {
    pub fn new(shards: usize, metrics: Arc<ControlMetrics>) -> DeviceRegistry {
        DeviceRegistry {
            devices: HashMap::new(),
            per_shard: Arc::new((0..shards).map(|_| Gauge::default()).collect()),
            metrics,
        }
    }

    /// Devices per shard (index = shard), shared with the admin status.
    pub fn per_shard(&self) -> Arc<Vec<Gauge>> {
        self.per_shard.clone()
    }

    /// `client_id` is now connected on `shard` (it may have moved from another).
    pub fn up(&mut self, client_id: ByteString, shard: usize) {
        if let Some(old) = self.devices.insert(client_id, shard) {
            self.shard_gauge(old, |g| g.sub(1));
        } else {
            self.metrics.devices_connected.add(1);
        }
        self.shard_gauge(shard, |g| g.add(1));
    }

    /// `client_id` left `shard`; ignored unless that is where the registry has it.
    pub fn down(&mut self, client_id: &ByteString, shard: usize) {
        if self.devices.get(client_id) == Some(&shard) {
            self.devices.remove(client_id);
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
}
