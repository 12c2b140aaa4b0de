//! The priority table: which devices and topics are urgent (SegaNet §4.3).
//!
//! Owns: compiling `[priority]` into a lookup structure and answering two questions — a
//! device's priority (asked when its connection lands on a shard, and again after a reload
//! published another table) and a message's priority (asked per message, cheap when there
//! are no topic rules). Does not own: what a priority does (shards pick the uplink lane from
//! it; the uplink keeps lanes apart), or publishing a reloaded table (`live.rs`).
//!
//! Invariants: the table comes from the config file and is immutable once built; a reload
//! builds a new one and publishes it as a snapshot (`live::Rules`, `arc-swap`), so shards
//! read it without locks. A device's priority is never lowered by a topic rule.

use std::collections::HashMap;

use sluice_proto::mqtt::topic;

use crate::config::PriorityConfig;

/// A record's urgency. Lower is more urgent, as in SegaNet and the config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    /// Never aggregated; its own uplink session and queue, marked for the wire.
    High = 1,
    #[default]
    Normal = 2,
}

impl Priority {
    fn from_level(level: u8) -> Priority {
        if level == 1 {
            Priority::High
        } else {
            Priority::Normal
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
        }
    }
}

/// `[priority]`, compiled.
#[derive(Debug, Default)]
pub struct PriorityTable {
    exact: HashMap<String, Priority>,
    /// Longest prefix first, so the first match is the most specific.
    prefixes: Vec<(String, Priority)>,
    /// Topic rules of priority 1 only (a rule of 2 can never raise a message's priority).
    high_topics: Vec<String>,
    has_high: bool,
}

impl PriorityTable {
    pub fn new(cfg: &PriorityConfig) -> PriorityTable {
        let mut exact = HashMap::new();
        let mut prefixes = Vec::new();
        for (key, &level) in &cfg.devices {
            let prio = Priority::from_level(level);
            match key.strip_suffix('*') {
                Some(prefix) => prefixes.push((prefix.to_string(), prio)),
                None => {
                    exact.insert(key.clone(), prio);
                }
            }
        }
        prefixes.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        let high_topics = cfg
            .topics
            .iter()
            .filter(|(_, &level)| level == 1)
            .map(|(filter, _)| filter.clone())
            .collect();
        PriorityTable {
            exact,
            prefixes,
            high_topics,
            has_high: cfg.has_high(),
        }
    }

    /// Whether anything can be high priority (so a high lane is needed at all).
    pub fn has_high(&self) -> bool {
        self.has_high
    }

    /// A device's own priority: an exact entry, else the longest matching prefix, else normal.
    pub fn device(&self, client_id: &str) -> Priority {
        if let Some(&p) = self.exact.get(client_id) {
            return p;
        }
        self.prefixes
            .iter()
            .find(|(prefix, _)| client_id.starts_with(prefix.as_str()))
            .map_or(Priority::Normal, |&(_, p)| p)
    }

    /// A message's priority: high when its device is high or its topic matches a rule of 1.
    pub fn message(&self, device: Priority, topic_name: &str) -> Priority {
        if device == Priority::High
            || self
                .high_topics
                .iter()
                .any(|filter| topic::matches(filter, topic_name))
        {
            Priority::High
        } else {
            Priority::Normal
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(devices: &[(&str, u8)], topics: &[(&str, u8)]) -> PriorityTable {
        PriorityTable::new(&PriorityConfig {
            devices: devices.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            topics: topics.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        })
    }

    #[test]
    fn empty_table_makes_everything_normal() {
        let t = table(&[], &[]);
        assert!(!t.has_high());
        assert_eq!(t.device("ecg-1"), Priority::Normal);
        assert_eq!(t.message(Priority::Normal, "alarms/fire"), Priority::Normal);
    }

    #[test]
    fn exact_beats_prefix_and_longer_prefix_beats_shorter() {
        let t = table(
            &[
                ("ecg-*", 1),
                ("ecg-test-*", 2),
                ("ecg-test-7", 1),
                ("fire", 1),
            ],
            &[],
        );
        assert!(t.has_high());
        assert_eq!(t.device("ecg-1"), Priority::High);
        assert_eq!(t.device("ecg-test-1"), Priority::Normal);
        assert_eq!(t.device("ecg-test-7"), Priority::High);
        assert_eq!(t.device("fire"), Priority::High);
        assert_eq!(t.device("fire-2"), Priority::Normal, "no '*': exact only");
        assert_eq!(t.device("thermo"), Priority::Normal);
    }

    #[test]
    fn topic_rules_raise_a_normal_device_and_never_lower_a_high_one() {
        let t = table(&[("ecg-1", 1)], &[("alarms/#", 1), ("ecg/+/raw", 2)]);
        assert_eq!(t.message(Priority::Normal, "alarms/fire/3"), Priority::High);
        assert_eq!(t.message(Priority::Normal, "telemetry/3"), Priority::Normal);
        assert_eq!(t.message(Priority::High, "ecg/1/raw"), Priority::High);
    }

    #[test]
    fn star_alone_matches_every_device() {
        let t = table(&[("*", 1)], &[]);
        assert_eq!(t.device(""), Priority::High);
        assert_eq!(t.device("anything"), Priority::High);
    }
}
