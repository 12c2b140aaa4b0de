//! Which node of a broker cluster (`urls`) a session connects to next, and noticing when the
//! session moved to another node (issue 33).
//!
//! Owns: [`NodeCursor`] (per session: the node of the next attempt and the node last
//! connected to), the failover count (`sluice_uplink_failovers_total`), the session's current
//! node in its metrics (shown by /api/v1/status), and the rate-limited log line naming the
//! node left and the node taken. Does not own: connecting (`link.rs`), the retry delay (the
//! outbox's backoff), or what is resent on the new node (the outbox requeues everything
//! unacknowledged when a connection ends, and the transport marks it DUP).
//!
//! Policy: shard `i` starts at node `i mod n`, so a gateway's sessions spread over the
//! cluster. Every attempt takes the node after the previous attempt's: a failed connect tries
//! the next node on the next attempt, and so does the reconnect after an established link
//! dropped (the node it was on may be the one that died). With one node (`url`), every
//! attempt goes to it and nothing counts as a failover.
//!
//! Invariant: the index handed out is `< nodes.len()` of the configuration it was asked
//! with (a reload never changes an uplink's nodes in place: `urls` is restart-only).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::config::UplinkConfig;
use crate::sink::{Lane, UplinkMetrics};

/// At most one failover line per this interval for the whole process (a dead node moves
/// every shard's sessions at once); the others are counted in the next line's `suppressed`.
const LOG_EVERY: Duration = Duration::from_secs(1);

/// One session's position in its uplink's node list.
#[derive(Debug)]
pub(super) struct NodeCursor {
    next: usize,
    connected: Option<usize>,
}

impl NodeCursor {
    /// A cursor whose first attempt goes to node `start mod n` (`start`: the shard index).
    pub(super) fn new(start: usize) -> NodeCursor {
        NodeCursor {
            next: start,
            connected: None,
        }
    }

    /// The node of this attempt, among `n` (`n ≥ 1`); the next call returns the one after it.
    pub(super) fn take_next(&mut self, n: usize) -> usize {
        let n = n.max(1);
        let index = self.next % n;
        self.next = (index + 1) % n;
        index
    }

    /// The session reached CONNACK success on node `index`: record it in the metrics, and
    /// count and log a failover when it is not the node last connected to.
    pub(super) fn connected(
        &mut self,
        index: usize,
        cfg: &UplinkConfig,
        shard: usize,
        lane: Lane,
        metrics: &UplinkMetrics,
    ) -> bool {
        let nodes = cfg.nodes();
        let taken = nodes
            .get(index)
            .map(ToString::to_string)
            .unwrap_or_default();
        metrics.set_node(Some(taken.clone()));
        let previous = self.connected.replace(index);
        let Some(left) = previous.filter(|&p| p != index) else {
            return false;
        };
        metrics.failovers.inc();
        if let Some(suppressed) = may_log() {
            tracing::warn!(
                uplink = %cfg.name,
                shard,
                lane = lane.as_str(),
                left = %nodes.get(left).map(ToString::to_string).unwrap_or_default(),
                taken = %taken,
                suppressed,
                "uplink session moved to another cluster node"
            );
        }
        true
    }
}

/// Whether a failover line may be written now; `Some(lines suppressed since the last one)`.
fn may_log() -> Option<u64> {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    static LAST_MS: AtomicU64 = AtomicU64::new(u64::MAX);
    static SUPPRESSED: AtomicU64 = AtomicU64::new(0);
    let now = EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64;
    let last = LAST_MS.load(Ordering::Relaxed);
    let due = last == u64::MAX || now.saturating_sub(last) >= LOG_EVERY.as_millis() as u64;
    if due
        && LAST_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        Some(SUPPRESSED.swap(0, Ordering::Relaxed))
    } else {
        SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::UplinkConfig;

    fn cluster(n: usize) -> UplinkConfig {
        let urls: Vec<crate::config::UplinkUrl> = (0..n)
            .map(|i| format!("mqtt://node{i}:1883").parse().unwrap())
            .collect();
        let mut cfg = UplinkConfig::new("c", urls[0].clone());
        cfg.urls = urls;
        cfg
    }

    #[test]
    fn shard_i_starts_at_node_i_mod_n_and_each_attempt_takes_the_next() {
        let starts: Vec<usize> = (0..5).map(|s| NodeCursor::new(s).take_next(3)).collect();
        assert_eq!(starts, [0, 1, 2, 0, 1]);
        let mut c = NodeCursor::new(2);
        let seq: Vec<usize> = (0..4).map(|_| c.take_next(3)).collect();
        assert_eq!(seq, [2, 0, 1, 2]);
        let mut one = NodeCursor::new(7);
        assert_eq!((one.take_next(1), one.take_next(1)), (0, 0));
    }

    #[test]
    fn connecting_to_another_node_than_the_last_counts_one_failover_and_shows_the_node() {
        let cfg = cluster(3);
        let m = UplinkMetrics::new();
        let mut c = NodeCursor::new(1);
        let first = c.take_next(3);
        assert!(
            !c.connected(first, &cfg, 1, Lane::Normal, &m),
            "the first connect is no failover"
        );
        assert_eq!(m.node().as_deref(), Some("mqtt://node1:1883"));
        // The link drops; the reconnect goes to the next node.
        let second = c.take_next(3);
        assert_eq!(second, 2);
        assert!(c.connected(second, &cfg, 1, Lane::Normal, &m));
        assert_eq!(m.failovers.get(), 1);
        assert_eq!(m.node().as_deref(), Some("mqtt://node2:1883"));
        // Back on the same node after failed attempts elsewhere: no new failover.
        let mut single = NodeCursor::new(0);
        let cfg1 = cluster(1);
        let m1 = UplinkMetrics::new();
        for _ in 0..3 {
            let i = single.take_next(1);
            assert!(!single.connected(i, &cfg1, 0, Lane::Normal, &m1));
        }
        assert_eq!(m1.failovers.get(), 0);
    }
}
