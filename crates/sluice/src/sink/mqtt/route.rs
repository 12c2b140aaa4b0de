//! Which local topics an uplink carries and what they are called in the cloud.
//!
//! `forward` filters select messages (an empty list forwards nothing). The cloud topic is the
//! local topic unchanged by default (the same `ByteString` is returned: no allocation),
//! otherwise `topic_prefix` + (`topic_template` with `{device}` and `{topic}` substituted, or
//! the local topic). The template is parsed once, at construction.
//!
//! A reload changes these rules while devices stay connected (`app/reload.rs`): an
//! [`UplinkRoute`] is a handle on one uplink's rules, shared (cloned) by that uplink's sink,
//! outboxes and transports on every shard, and [`UplinkRoute::replace`] publishes new rules
//! with `arc-swap`. Each question loads the current rules with one atomic load, without a
//! lock; a message already queued or spooled is named by the rules current when its
//! transport encodes it. The handle also carries `[uplink.aggregate]`, which each outbox
//! picks up between packs ([`UplinkRoute::aggregate_if_changed`]), and `receive`, which the
//! session holding the downlink subscription follows with SUBSCRIBE / UNSUBSCRIBE
//! ([`UplinkRoute::receive_if_changed`]); a replacement wakes the outboxes, each through a
//! `Notify` of its own ([`UplinkRoute::watch`]: no waiter list shared across shards).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytestring::ByteString;
use sluice_proto::mqtt::topic;

use crate::config::{AggregateConfig, UplinkConfig};

/// Numbers every set of rules built, so a holder tells a replaced set from the one it saw.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// One uplink's forward filters and topic mapping, as a shared, replaceable handle.
#[derive(Debug, Clone)]
pub struct UplinkRoute {
    rules: Arc<ArcSwap<RouteRules>>,
    /// One `Notify` per watching outbox, each told (`notify_one`: a permit is kept if it is
    /// not waiting) after a replacement. Locked only to register and to replace.
    watchers: Arc<std::sync::Mutex<Vec<std::sync::Weak<tokio::sync::Notify>>>>,
}

/// The rules themselves (immutable once built).
#[derive(Debug)]
struct RouteRules {
    forward: Vec<String>,
    prefix: String,
    template: Option<Vec<Piece>>,
    aggregate: AggregateConfig,
    receive: Vec<String>,
    generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Device,
    Topic,
}

impl UplinkRoute {
    pub fn new(cfg: &UplinkConfig) -> UplinkRoute {
        UplinkRoute {
            rules: Arc::new(ArcSwap::from_pointee(RouteRules::of(cfg))),
            watchers: Arc::default(),
        }
    }

    /// The same as [`UplinkRoute::new`] from the individual settings.
    pub fn from_parts(forward: Vec<String>, prefix: String, template: Option<&str>) -> UplinkRoute {
        UplinkRoute {
            rules: Arc::new(ArcSwap::from_pointee(RouteRules::new(
                forward, prefix, template,
            ))),
            watchers: Arc::default(),
        }
    }

    /// Publish `cfg`'s `forward`, `topic_prefix`, `topic_template` and `aggregate` to every
    /// holder of this handle (a reload). Messages offered from now on are filtered by them,
    /// and every message encoded from now on (queued and spooled ones included) is named by
    /// them; each outbox packs by the new `aggregate` from its next pack on.
    pub fn replace(&self, cfg: &UplinkConfig) {
        self.rules.store(Arc::new(RouteRules::of(cfg)));
        if let Ok(watchers) = self.watchers.lock() {
            for w in watchers.iter().filter_map(std::sync::Weak::upgrade) {
                w.notify_one();
            }
        }
    }

    /// A `Notify` of the caller's own, told after every replacement (a permit is kept when
    /// the caller is not waiting, so a replacement between its check and its wait is not
    /// missed). Dropped watchers are forgotten at the next registration.
    pub fn watch(&self) -> Arc<tokio::sync::Notify> {
        let notify = Arc::new(tokio::sync::Notify::new());
        if let Ok(mut watchers) = self.watchers.lock() {
            watchers.retain(|w| w.strong_count() > 0);
            watchers.push(Arc::downgrade(&notify));
        }
        notify
    }

    /// The current `receive` filters.
    pub fn receive(&self) -> Vec<String> {
        self.rules.load().receive.clone()
    }

    /// The current `receive` filters and their generation, if the generation is not `seen`.
    pub fn receive_if_changed(&self, seen: u64) -> Option<(u64, Vec<String>)> {
        let rules = self.rules.load();
        (rules.generation != seen).then(|| (rules.generation, rules.receive.clone()))
    }

    /// Whether any `receive` filter is set.
    pub fn receives(&self) -> bool {
        !self.rules.load().receive.is_empty()
    }

    /// The current `[uplink.aggregate]` and its generation, if the generation is not `seen`.
    pub fn aggregate_if_changed(&self, seen: u64) -> Option<(u64, AggregateConfig)> {
        let rules = self.rules.load();
        (rules.generation != seen).then(|| (rules.generation, rules.aggregate.clone()))
    }

    /// Answer `f` from the current `[uplink.aggregate]`.
    pub fn with_aggregate<R>(&self, f: impl FnOnce(&AggregateConfig) -> R) -> R {
        f(&self.rules.load().aggregate)
    }

    /// Whether any `forward` filter matches the local `topic`.
    pub fn forwards(&self, topic: &str) -> bool {
        self.rules
            .load()
            .forward
            .iter()
            .any(|f| topic::matches(f, topic))
    }

    /// The cloud topic for a message `device` published on local `topic`.
    pub fn cloud_topic(&self, device: &str, topic: &ByteString) -> ByteString {
        let rules = self.rules.load();
        match &rules.template {
            None if rules.prefix.is_empty() => topic.clone(),
            None => {
                let mut s = String::with_capacity(rules.prefix.len() + topic.len());
                s.push_str(&rules.prefix);
                s.push_str(topic);
                ByteString::from(s)
            }
            Some(pieces) => {
                let mut s =
                    String::with_capacity(rules.prefix.len() + topic.len() + device.len() + 32);
                s.push_str(&rules.prefix);
                for p in pieces {
                    match p {
                        Piece::Literal(l) => s.push_str(l),
                        Piece::Device => s.push_str(device),
                        Piece::Topic => s.push_str(topic),
                    }
                }
                ByteString::from(s)
            }
        }
    }
}

impl RouteRules {
    fn new(forward: Vec<String>, prefix: String, template: Option<&str>) -> RouteRules {
        RouteRules {
            forward,
            prefix,
            template: template.map(parse_template),
            aggregate: AggregateConfig::default(),
            receive: Vec::new(),
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn of(cfg: &UplinkConfig) -> RouteRules {
        RouteRules {
            aggregate: cfg.aggregate.clone(),
            receive: cfg.receive.clone(),
            ..RouteRules::new(
                cfg.forward.clone(),
                cfg.topic_prefix.clone(),
                cfg.topic_template.as_deref(),
            )
        }
    }
}

/// Split a template into literals and `{device}` / `{topic}` placeholders. Any other brace
/// text is kept literally.
fn parse_template(t: &str) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut lit = String::new();
    let mut rest = t;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("{device}") {
            pieces.push(Piece::Literal(std::mem::take(&mut lit)));
            pieces.push(Piece::Device);
            rest = r;
        } else if let Some(r) = rest.strip_prefix("{topic}") {
            pieces.push(Piece::Literal(std::mem::take(&mut lit)));
            pieces.push(Piece::Topic);
            rest = r;
        } else {
            let c = rest.chars().next().unwrap_or_default();
            lit.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    pieces.push(Piece::Literal(lit));
    pieces.retain(|p| !matches!(p, Piece::Literal(l) if l.is_empty()));
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(s: &str) -> ByteString {
        ByteString::from(s)
    }

    #[test]
    fn topic_is_unchanged_by_default_without_allocating() {
        let r = UplinkRoute::from_parts(vec!["#".into()], String::new(), None);
        let t = bs("sensors/1/temp");
        let out = r.cloud_topic("dev1", &t);
        assert_eq!(out, "sensors/1/temp");
        // Same backing buffer: a refcount clone, not a copy.
        assert_eq!(out.as_bytes().as_ptr(), t.as_bytes().as_ptr());
    }

    #[test]
    fn prefix_is_prepended() {
        let r = UplinkRoute::from_parts(vec![], "site-7/".into(), None);
        assert_eq!(
            r.cloud_topic("dev1", &bs("sensors/1/temp")),
            "site-7/sensors/1/temp"
        );
    }

    #[test]
    fn template_substitutes_device_and_topic() {
        let r = UplinkRoute::from_parts(vec![], String::new(), Some("gw/{device}/up/{topic}"));
        assert_eq!(r.cloud_topic("dev1", &bs("a/b")), "gw/dev1/up/a/b");
        let r = UplinkRoute::from_parts(vec![], "p/".into(), Some("{topic}@{device}{x}"));
        assert_eq!(r.cloud_topic("d", &bs("t")), "p/t@d{x}");
        let r = UplinkRoute::from_parts(vec![], String::new(), Some("fixed/é"));
        assert_eq!(r.cloud_topic("d", &bs("t")), "fixed/é");
    }

    #[test]
    fn forwards_when_any_filter_matches() {
        let r = UplinkRoute::from_parts(
            vec!["sensors/+/temp".into(), "alarms/#".into()],
            String::new(),
            None,
        );
        assert!(r.forwards("sensors/1/temp"));
        assert!(r.forwards("alarms/fire/kitchen"));
        assert!(!r.forwards("sensors/1/humidity"));
        let none = UplinkRoute::from_parts(vec![], String::new(), None);
        assert!(
            !none.forwards("sensors/1/temp"),
            "an empty forward list forwards nothing"
        );
    }

    #[test]
    fn a_replaced_route_is_seen_by_every_clone() {
        let r = UplinkRoute::from_parts(vec!["a/#".into()], String::new(), None);
        let held_by_a_transport = r.clone();
        let mut cfg = crate::config::parse(
            "[[uplink]]\nname = \"c\"\nurl = \"mqtt://127.0.0.1:1883\"\nallow_plaintext = true\nforward = [\"b/#\"]\ntopic_prefix = \"site/\"\n",
        )
        .unwrap();
        r.replace(&cfg.uplink.remove(0));
        assert!(!held_by_a_transport.forwards("a/1"));
        assert!(held_by_a_transport.forwards("b/1"));
        assert_eq!(held_by_a_transport.cloud_topic("d", &bs("b/1")), "site/b/1");
    }
}
