//! Bounds on what one device can make the gateway hold or walk: topic depth and length.
//!
//! Owns: the policy checks that sit on top of the protocol's own validity rules
//! (`sluice_proto::mqtt::topic`), and their wording in logs and errors. Does not own: acting
//! on a refusal (the connection closes, the SUBACK carries a failure code, admission refuses
//! the CONNECT) — the callers do that.
//!
//! Invariants: every topic name a device publishes to (including a will topic) and every
//! filter it subscribes to has at most `mqtt.max_topic_levels` levels and
//! `mqtt.max_topic_length` bytes before anything stores or matches it; the config's own
//! filters obey the same limits (`config::validate`). Checks are linear in the topic's length
//! and never allocate.

use sluice_proto::mqtt::topic;

use super::metrics::ShardMetrics;
use super::ShardContext;
use crate::config::MqttConfig;
use crate::telemetry::metrics::PromWriter;

/// `mqtt.max_topic_levels` and `mqtt.max_topic_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicLimits {
    pub max_levels: usize,
    pub max_len: usize,
}

/// Why a topic name or filter is refused although the protocol allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TopicLimitExceeded {
    #[error("the topic is {len} bytes long, more than mqtt.max_topic_length ({max} bytes)")]
    TooLong { len: usize, max: usize },
    #[error("the topic has {levels} levels, more than mqtt.max_topic_levels ({max})")]
    TooDeep { levels: usize, max: usize },
}

impl TopicLimits {
    pub fn new(cfg: &MqttConfig) -> TopicLimits {
        TopicLimits {
            max_levels: cfg.max_topic_levels,
            max_len: cfg.max_topic_length.as_usize(),
        }
    }

    /// Whether a topic name or filter is within the limits.
    pub fn check(&self, topic: &str) -> Result<(), TopicLimitExceeded> {
        if topic.len() > self.max_len {
            return Err(TopicLimitExceeded::TooLong {
                len: topic.len(),
                max: self.max_len,
            });
        }
        let levels = topic::levels(topic);
        if levels > self.max_levels {
            return Err(TopicLimitExceeded::TooDeep {
                levels,
                max: self.max_levels,
            });
        }
        Ok(())
    }
}

/// Why a subscription was refused with a SUBACK failure code. A fixed set, so the metric's
/// label cardinality is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscribeRefusal {
    /// The filter is beyond `mqtt.max_topic_levels` or `mqtt.max_topic_length`.
    TopicLimit = 0,
}

pub const SUBSCRIBE_REFUSALS: [(SubscribeRefusal, &str); 1] =
    [(SubscribeRefusal::TopicLimit, "topic_limit")];

/// Whether a device may subscribe to `filter` (already a valid filter) under the topic
/// limits. A refusal is logged with the device and counted; the caller answers it in the
/// SUBACK (0x8F Topic Filter invalid for MQTT 5, 0x80 for 3.1.1) and keeps the connection.
pub fn filter_allowed(ctx: &ShardContext, client_id: &str, filter: &str) -> bool {
    match TopicLimits::new(&ctx.config.mqtt).check(filter) {
        Ok(()) => true,
        Err(error) => {
            tracing::info!(client_id, %error, "device subscribed to a filter beyond the gateway's limits; refused in the SUBACK");
            ctx.metrics.subscriptions_refused[SubscribeRefusal::TopicLimit as usize].inc();
            false
        }
    }
}

/// `sluice_mqtt_subscriptions_refused_total{shard, reason}`.
pub fn render_refusals(metrics: &ShardMetrics, w: &mut PromWriter, shard: &str) {
    for (reason, name) in SUBSCRIBE_REFUSALS {
        w.counter(
            "sluice_mqtt_subscriptions_refused_total",
            "Subscriptions refused with a SUBACK failure, by reason",
            &[("shard", shard), ("reason", name)],
            metrics.subscriptions_refused[reason as usize].get(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_within_both_limits_pass_and_others_say_which_limit() {
        let limits = TopicLimits {
            max_levels: 3,
            max_len: 10,
        };
        assert_eq!(limits.check("a/b/c"), Ok(()));
        assert_eq!(limits.check("+/+/#"), Ok(()));
        assert_eq!(limits.check("//"), Ok(()));
        assert_eq!(
            limits.check("a/b/c/d"),
            Err(TopicLimitExceeded::TooDeep { levels: 4, max: 3 })
        );
        assert_eq!(
            limits.check("///"),
            Err(TopicLimitExceeded::TooDeep { levels: 4, max: 3 })
        );
        assert_eq!(
            limits.check("abcdefghijk"),
            Err(TopicLimitExceeded::TooLong { len: 11, max: 10 })
        );
    }
}
