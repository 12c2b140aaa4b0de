//! Per-path sessions: one uplink lane spread over several paths (issue 17). SKELETON: the
//! multipath transport is filled in by issue 17's per-path work.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::sink::mqtt::SessionSeed;

/// Per-path health of one multipath session (status and metrics); empty for a session
/// without `paths`.
#[derive(Debug, Default)]
pub struct PathsMetrics {}

impl PathsMetrics {
    /// The status JSON: one object per path (`[]` without paths).
    pub fn status(&self) -> serde_json::Value {
        serde_json::Value::Array(Vec::new())
    }

    pub fn render(&self, _w: &mut crate::telemetry::metrics::PromWriter, _labels: &[(&str, &str)]) {
    }
}

/// Start the outbox of one uplink lane with `paths` on this shard, over a multipath
/// transport. Must be called inside a `LocalSet`.
pub fn spawn(seed: SessionSeed, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    // SKELETON: until the multipath transport exists, the lane uses one session.
    crate::sink::mqtt::spawn(seed, shutdown)
}
