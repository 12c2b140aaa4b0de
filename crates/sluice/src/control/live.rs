//! The rules a reload changes under running shards: the priority table and `[limits]`'
//! per-device publish rate.
//!
//! Owns: [`LiveRules`] (immutable once built) and [`Rules`], the handle every shard holds,
//! through which the control side (`app/reload.rs`) publishes a new set with `arc-swap`.
//! Does not own: the forward filters and topic mapping (each uplink's
//! `crate::sink::UplinkRoute`), the ACL (`acl::Acl`), the listener's connection limits
//! (`limits::ConnectLimits`) or logins (`admission::Logins`), which a reload replaces through
//! their own handles; nor deciding what may change live (`app/reload.rs`).
//!
//! Invariants: a shard reads the rules with one atomic load and no lock, and never writes
//! them; each publication carries a generation one higher than the last, so a connection
//! that cached an answer (its device's priority) sees that it must ask again. A device's
//! publish rate is taken from the rules when it connects: a reload changes it for devices
//! connecting afterwards.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};

use super::priority::{Priority, PriorityTable};
use crate::config::{Config, LimitsConfig};

/// One published set of rules.
#[derive(Debug)]
pub struct LiveRules {
    /// 0 for the set the gateway started with, then one more per reload that applied.
    pub generation: u64,
    pub priority: PriorityTable,
    /// `[limits]`: `publish_rate` and friends are read when a device connects.
    pub limits: LimitsConfig,
}

impl LiveRules {
    fn new(config: &Config, generation: u64) -> LiveRules {
        LiveRules {
            generation,
            priority: PriorityTable::new(&config.priority),
            limits: config.limits.clone(),
        }
    }
}

/// The current [`LiveRules`], shared by every shard.
#[derive(Debug)]
pub struct Rules {
    current: ArcSwap<LiveRules>,
    generation: AtomicU64,
}

impl Rules {
    pub fn new(config: &Config) -> Arc<Rules> {
        Arc::new(Rules {
            current: ArcSwap::from_pointee(LiveRules::new(config, 0)),
            generation: AtomicU64::new(0),
        })
    }

    /// The current rules (one atomic load, no lock). Hold the guard briefly: across an
    /// `.await` it stays valid but costs a slower path.
    pub fn load(&self) -> Guard<Arc<LiveRules>> {
        self.current.load()
    }

    /// The current rules as an owned reference (once per connection, not per message).
    pub fn load_full(&self) -> Arc<LiveRules> {
        self.current.load_full()
    }

    /// A device's own priority under the current table.
    pub fn device(&self, client_id: &str) -> Priority {
        self.current.load().priority.device(client_id)
    }

    /// Publish the rules of `config` (a reload); returns their generation.
    pub fn publish(&self, config: &Config) -> u64 {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        self.current
            .store(Arc::new(LiveRules::new(config, generation)));
        generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_table_is_seen_with_a_new_generation() {
        let before = crate::config::parse("").unwrap();
        let rules = Rules::new(&before);
        assert_eq!(rules.load().generation, 0);
        assert_eq!(rules.device("pump-1"), Priority::Normal);
        let after = crate::config::parse("[priority.devices]\n\"pump-*\" = 1\n").unwrap();
        assert_eq!(rules.publish(&after), 1);
        assert_eq!(rules.load().generation, 1);
        assert_eq!(rules.device("pump-1"), Priority::High);
    }
}
