//! Authorization for every edge: `[acl]` compiled into an immutable [`AclSnapshot`] that the
//! shards read without a lock (ADR 0008).
//!
//! Owns: compiling the rules (globs, MQTT filters with `%c`/`%u`), the decision for a publish
//! or a subscription, the per-connection [`DeviceAcl`] view, and the denial metric
//! (`sluice_acl_denied_total{edge,action}`) and its rate-limited log line. Does not own: what a
//! denial looks like on the wire (each edge answers in its protocol: MQTT 5 0x87, CoAP 4.03,
//! PHD measurement dropped), nor identity (who the device is: the edges and admission).
//!
//! Semantics (docs/security.md, "Access control"):
//! - rules are tried in order, the first that matches decides (`permission`); none →
//!   `default`. The rules file's rules come after the config's;
//! - a rule matches a device when its `devices` glob matches the client id and its `users`
//!   glob the username (both when both are given; a device without a username never matches
//!   a `users` rule), its action is the one asked (`all`: both), and one of its topics matches;
//! - `%c` and `%u` in a topic are the device's id and username. A value containing `+`, `#`
//!   or `/` (or an empty one, or no username) is never substituted (as Mosquitto): an allow
//!   rule using it does not match, a deny rule reads that level as `+` (fail closed);
//! - publish: the topic name matches the rule's filter (MQTT matching, `$` topics not matched
//!   by a leading wildcard);
//! - subscribe (shared subscriptions by their inner filter): an allow rule matches when its
//!   filter covers the requested one (every topic the requested filter can match, the rule's
//!   matches too: `devices/%c/#` covers `devices/d1/+`, not `devices/+/temp` nor `#`); a deny
//!   rule matches when the two filters overlap (some topic matches both), so `#` is refused
//!   by an earlier `deny secret/#`.
//!
//! Invariants: a snapshot never changes once built (a new one is published with `arc-swap`);
//! deciding allocates nothing (placeholders are compared level by level with the device's id,
//! never substituted into a string); cost does not grow with rules that cannot apply: rules
//! are indexed per action by whom they name (exact client id, exact username, every device,
//! other globs) and the every-device ones by their topics' first literal level, and an MQTT
//! connection keeps the indexes of the rules naming it ([`DeviceAcl`], 4 B each).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use sluice_proto::mqtt::topic;

use crate::config::{AclAction, AclConfig, AclFile, AclPermission, AclRuleConfig, MqttConfig};
use crate::shard::limits::TopicLimits;
use crate::telemetry::metrics::{Counter, PromWriter};

mod pattern;
use pattern::{Filter, Glob};

/// What a device asks to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Publish = 0,
    Subscribe = 1,
}

const ACTIONS: [(Action, &str); 2] = [
    (Action::Publish, "publish"),
    (Action::Subscribe, "subscribe"),
];

/// Which edge asked (the metric's `edge` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edge {
    Mqtt = 0,
    Coap = 1,
    Phd = 2,
}

const EDGES: [(Edge, &str); 3] = [
    (Edge::Mqtt, "mqtt"),
    (Edge::Coap, "coap"),
    (Edge::Phd, "phd"),
];

/// Who asks: the device's id and, if it logged in, its username.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    pub client_id: &'a str,
    pub username: Option<&'a str>,
}

/// A rule that does not compile, with the key path at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct AclCompileError {
    pub key: String,
    pub reason: String,
}

#[derive(Debug, Clone)]
struct Rule {
    devices: Option<Glob>,
    users: Option<Glob>,
    actions: [bool; 2],
    topics: Box<[Filter]>,
    allow: bool,
}

/// How a rule is found from a subject (see [`Index`]).
enum Class<'a> {
    Everyone,
    Device(&'a str),
    User(&'a str),
    Other,
}

impl Rule {
    fn applies(&self, s: &Subject) -> bool {
        self.devices.as_ref().is_none_or(|g| g.matches(s.client_id))
            && self
                .users
                .as_ref()
                .is_none_or(|g| s.username.is_some_and(|u| g.matches(u)))
    }

    fn class(&self) -> Class<'_> {
        match (&self.devices, &self.users) {
            (Some(Glob::Exact(d)), _) => Class::Device(d),
            (_, Some(Glob::Exact(u))) => Class::User(u),
            (None | Some(Glob::Any), None) => Class::Everyone,
            _ => Class::Other,
        }
    }

    /// Does one of its topics match (publish: the name; subscribe: see the module docs)?
    fn matches_topic(&self, s: &Subject, action: Action, t: &str) -> bool {
        self.topics.iter().any(|f| {
            // Fail closed: an allow rule cannot use the value, a deny rule reads it as `+`.
            let widen = !f.substitutable(s);
            if widen && self.allow {
                return false;
            }
            match action {
                Action::Publish => f.matches_name(s, t, widen),
                Action::Subscribe if self.allow => f.covers(s, t),
                Action::Subscribe => f.overlaps(s, t, widen),
            }
        })
    }
}

/// One action's rules, by how they are found. Every list is in rule order.
#[derive(Debug, Default)]
struct Index {
    /// Rules for every device, by their topics' first literal level (sorted by it: a binary
    /// search of a few keys costs less than hashing the topic's first level)...
    everyone_by_first: Vec<(Box<str>, Vec<u32>)>,
    /// ...and those with a topic starting with a wildcard or placeholder.
    everyone_generic: Vec<u32>,
    everyone_all: Vec<u32>,
    by_device: HashMap<Box<str>, Vec<u32>>,
    by_user: HashMap<Box<str>, Vec<u32>>,
    /// Globs other than `*` and exact names: matched one by one.
    other: Vec<u32>,
}

/// `[acl]`, compiled. Immutable; published as a whole.
#[derive(Debug)]
pub struct AclSnapshot {
    rules: Vec<Rule>,
    default_allow: bool,
    index: [Index; 2],
}

impl Default for AclSnapshot {
    fn default() -> Self {
        AclSnapshot {
            rules: Vec::new(),
            default_allow: true,
            index: [Index::default(), Index::default()],
        }
    }
}

impl AclSnapshot {
    /// Compile the config's rules, then the file's (`file`, read by the caller).
    pub fn compile(
        cfg: &AclConfig,
        file: Option<&AclFile>,
        mqtt: &MqttConfig,
    ) -> Result<AclSnapshot, AclCompileError> {
        let limits = TopicLimits::new(mqtt);
        let file_key = cfg
            .file
            .as_ref()
            .map(|p| format!("acl.file({})", p.display()))
            .unwrap_or_default();
        let config_rules = cfg
            .rule
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("acl.rule[{i}]"), r));
        let file_rules = file
            .into_iter()
            .flat_map(|f| f.rule.iter().enumerate())
            .map(|(i, r)| (format!("{file_key}.rule[{i}]"), r));
        let mut rules = Vec::new();
        for (key, r) in config_rules.chain(file_rules) {
            rules.push(compile_rule(&key, r, &limits)?);
        }
        if rules.len() > u32::MAX as usize {
            return Err(AclCompileError {
                key: "acl.rule".into(),
                reason: "too many rules".into(),
            });
        }
        let mut index = [Index::default(), Index::default()];
        for (i, rule) in rules.iter().enumerate() {
            let i = i as u32;
            for (a, ix) in index.iter_mut().enumerate() {
                if !rule.actions[a] {
                    continue;
                }
                match rule.class() {
                    Class::Everyone => {
                        ix.everyone_all.push(i);
                        let mut generic = false;
                        for f in rule.topics.iter() {
                            match f.first_literal() {
                                Some(first) => {
                                    let v = match ix
                                        .everyone_by_first
                                        .iter()
                                        .position(|(k, _)| **k == *first)
                                    {
                                        Some(p) => &mut ix.everyone_by_first[p].1,
                                        None => {
                                            ix.everyone_by_first.push((first.into(), Vec::new()));
                                            let last = ix.everyone_by_first.len() - 1;
                                            &mut ix.everyone_by_first[last].1
                                        }
                                    };
                                    if v.last() != Some(&i) {
                                        v.push(i);
                                    }
                                }
                                None => generic = true,
                            }
                        }
                        if generic {
                            ix.everyone_generic.push(i);
                        }
                    }
                    Class::Device(d) => ix.by_device.entry(d.into()).or_default().push(i),
                    Class::User(u) => ix.by_user.entry(u.into()).or_default().push(i),
                    Class::Other => ix.other.push(i),
                }
            }
        }
        for ix in &mut index {
            ix.everyone_by_first.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Ok(AclSnapshot {
            rules,
            default_allow: cfg.default == AclPermission::Allow,
            index,
        })
    }

    pub fn rules(&self) -> usize {
        self.rules.len()
    }

    /// The rules that name this subject (not the every-device ones), per action, in order.
    fn named(&self, s: &Subject) -> [Box<[u32]>; 2] {
        let mut out: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        for (a, ix) in self.index.iter().enumerate() {
            let v = &mut out[a];
            v.extend(ix.by_device.get(s.client_id).into_iter().flatten());
            if let Some(u) = s.username {
                v.extend(ix.by_user.get(u).into_iter().flatten());
            }
            v.extend(ix.other.iter());
            v.retain(|&r| self.rules[r as usize].applies(s));
            v.sort_unstable();
            v.dedup();
        }
        out.map(Vec::into_boxed_slice)
    }

    /// The decision, given the lists of rules naming the subject (`checked`: already known to
    /// apply) or `None` to look them up.
    fn decide(&self, action: Action, s: &Subject, t: &str, named: Option<&[u32]>) -> bool {
        if self.rules.is_empty() {
            return self.default_allow;
        }
        let ix = &self.index[action as usize];
        let first = t.split('/').next().unwrap_or("");
        let (a, b): (&[u32], &[u32]) =
            if action == Action::Subscribe && (first == "+" || first == "#") {
                (&ix.everyone_all, &[])
            } else {
                (
                    ix.everyone_by_first
                        .binary_search_by(|(k, _)| (**k).cmp(first))
                        .map_or(&[][..], |p| &ix.everyone_by_first[p].1),
                    &ix.everyone_generic,
                )
            };
        let empty: &[u32] = &[];
        let lists: [&[u32]; 5] = match named {
            Some(n) => [a, b, n, empty, empty],
            None => [
                a,
                b,
                ix.by_device.get(s.client_id).map_or(empty, |v| v),
                s.username
                    .and_then(|u| ix.by_user.get(u))
                    .map_or(empty, |v| v),
                &ix.other,
            ],
        };
        let check_applies = named.is_none();
        first_in_order(lists, |r| {
            let rule = &self.rules[r as usize];
            if check_applies && !rule.applies(s) {
                return None;
            }
            rule.matches_topic(s, action, t).then_some(rule.allow)
        })
        .unwrap_or(self.default_allow)
    }
}

/// Walk several ascending lists as one (duplicates once), stopping at the first `Some`.
fn first_in_order<const N: usize>(
    lists: [&[u32]; N],
    mut f: impl FnMut(u32) -> Option<bool>,
) -> Option<bool> {
    let mut pos = [0usize; N];
    loop {
        let mut best: Option<u32> = None;
        for (l, p) in lists.iter().zip(&pos) {
            if let Some(&v) = l.get(*p) {
                if best.is_none_or(|b| v < b) {
                    best = Some(v);
                }
            }
        }
        let v = best?;
        for (l, p) in lists.iter().zip(pos.iter_mut()) {
            if l.get(*p) == Some(&v) {
                *p += 1;
            }
        }
        if let Some(d) = f(v) {
            return Some(d);
        }
    }
}

fn compile_rule(
    key: &str,
    r: &AclRuleConfig,
    limits: &TopicLimits,
) -> Result<Rule, AclCompileError> {
    let err = |sub: &str, reason: String| AclCompileError {
        key: format!("{key}.{sub}"),
        reason,
    };
    let devices = r
        .devices
        .as_deref()
        .map(Glob::parse)
        .transpose()
        .map_err(|e| err("devices", e))?;
    let users = r
        .users
        .as_deref()
        .map(Glob::parse)
        .transpose()
        .map_err(|e| err("users", e))?;
    if devices.is_none() && users.is_none() {
        return Err(AclCompileError {
            key: key.to_string(),
            reason: "a rule names devices (client-id glob) or users (username glob); devices = \"*\" for every device".into(),
        });
    }
    if r.topics.is_empty() {
        return Err(err(
            "topics",
            "a rule needs at least one topic filter".into(),
        ));
    }
    let topics = r
        .topics
        .iter()
        .enumerate()
        .map(|(i, t)| Filter::parse(t, limits).map_err(|e| err(&format!("topics[{i}]"), e)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Rule {
        devices,
        users,
        actions: match r.action {
            AclAction::Publish => [true, false],
            AclAction::Subscribe => [false, true],
            AclAction::All => [true, true],
        },
        topics: topics.into(),
        allow: r.permission == AclPermission::Allow,
    })
}

/// `sluice_acl_denied_total{edge,action}`.
#[derive(Debug, Default)]
pub struct AclMetrics {
    denied: [[Counter; 2]; 3],
}

impl AclMetrics {
    pub fn denied(&self, edge: Edge, action: Action) -> u64 {
        self.denied[edge as usize][action as usize].get()
    }

    pub fn render(&self, w: &mut PromWriter) {
        for (edge, e) in EDGES {
            for (action, a) in ACTIONS {
                w.counter(
                    "sluice_acl_denied_total",
                    "Publishes and subscriptions refused by [acl], by edge and action",
                    &[("edge", e), ("action", a)],
                    self.denied(edge, action),
                );
            }
        }
    }
}

/// Logs a denial at most this often (the counter counts every one).
const LOG_EVERY: Duration = Duration::from_secs(1);

/// The ACL as every thread sees it: the current snapshot, the metrics.
#[derive(Debug)]
pub struct Acl {
    current: ArcSwap<AclSnapshot>,
    pub metrics: Arc<AclMetrics>,
    logged_ms: AtomicU64,
    started: Instant,
}

impl Acl {
    pub fn new(snapshot: AclSnapshot, metrics: Arc<AclMetrics>) -> Arc<Acl> {
        Arc::new(Acl {
            current: ArcSwap::from_pointee(snapshot),
            metrics,
            logged_ms: AtomicU64::new(0),
            started: Instant::now(),
        })
    }

    /// An ACL that allows everything (tests, and a gateway without `[acl]`).
    pub fn allow_all() -> Arc<Acl> {
        Acl::new(AclSnapshot::default(), Arc::default())
    }

    /// Replace the rules (a reload); connections pick the new snapshot up at their next check.
    pub fn publish(&self, snapshot: AclSnapshot) {
        self.current.store(Arc::new(snapshot));
    }

    /// May `device` (logged in as `username`) publish to `topic`? A denial is counted and
    /// logged (rate-limited) for `edge`.
    pub fn allows_publish(
        &self,
        edge: Edge,
        device: &str,
        username: Option<&str>,
        topic: &str,
    ) -> bool {
        let s = Subject {
            client_id: device,
            username,
        };
        let ok = self.current.load().decide(Action::Publish, &s, topic, None);
        if !ok {
            self.denied(edge, Action::Publish, device, topic);
        }
        ok
    }

    /// May `device` subscribe to (or observe) `filter`? Counted and logged like a publish.
    pub fn allows_subscribe(
        &self,
        edge: Edge,
        device: &str,
        username: Option<&str>,
        filter: &str,
    ) -> bool {
        let s = Subject {
            client_id: device,
            username,
        };
        let inner = topic::shared_subscription(filter).map_or(filter, |(_, f)| f);
        let ok = self
            .current
            .load()
            .decide(Action::Subscribe, &s, inner, None);
        if !ok {
            self.denied(edge, Action::Subscribe, device, filter);
        }
        ok
    }

    /// Count a denial; log it, naming the device, at most once a second.
    pub fn denied(&self, edge: Edge, action: Action, device: &str, topic: &str) {
        let c = &self.metrics.denied[edge as usize][action as usize];
        c.inc();
        let now = u64::try_from(self.started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let last = self.logged_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= LOG_EVERY.as_millis() as u64)
            && self
                .logged_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                edge = EDGES[edge as usize].1,
                action = ACTIONS[action as usize].1,
                device,
                topic,
                denied_total = c.get(),
                "refused by the access control list (more such refusals within a second are only counted)"
            );
        }
    }
}

/// One MQTT connection's view: the snapshot it was built from and the rules naming the
/// device, so a check walks only the rules that can apply, and the last publish decision: a
/// device publishing to the topic it published to last (the common telemetry pattern) is
/// answered without walking any rule. Rebuilt (and the decision forgotten) when a new
/// snapshot is published. The remembered topic reuses one buffer: no allocation per message
/// once it has grown to the device's longest topic (at most `mqtt.max_topic_length`).
#[derive(Debug)]
pub struct DeviceAcl {
    snapshot: Arc<AclSnapshot>,
    named: [Box<[u32]>; 2],
    /// The topic of the last publish decided, and the decision (`None`: none yet).
    last_topic: String,
    last_publish: Option<bool>,
}

impl DeviceAcl {
    pub fn new(acl: &Acl, s: &Subject) -> DeviceAcl {
        let snapshot = acl.current.load_full();
        let named = snapshot.named(s);
        DeviceAcl {
            snapshot,
            named,
            last_topic: String::new(),
            last_publish: None,
        }
    }

    fn fresh(&mut self, acl: &Acl, s: &Subject) {
        let current = acl.current.load();
        if !Arc::ptr_eq(&current, &self.snapshot) {
            drop(current);
            *self = DeviceAcl::new(acl, s);
        }
    }

    /// [`Acl::allows_publish`] for this connection's device.
    pub fn allows_publish(&mut self, acl: &Acl, s: &Subject, topic: &str) -> bool {
        self.fresh(acl, s);
        let ok = match self.last_publish {
            Some(ok) if self.last_topic == topic => ok,
            _ => {
                let ok = self
                    .snapshot
                    .decide(Action::Publish, s, topic, Some(&self.named[0]));
                self.last_topic.clear();
                self.last_topic.push_str(topic);
                self.last_publish = Some(ok);
                ok
            }
        };
        if !ok {
            acl.denied(Edge::Mqtt, Action::Publish, s.client_id, topic);
        }
        ok
    }

    /// [`Acl::allows_subscribe`] for this connection's device.
    pub fn allows_subscribe(&mut self, acl: &Acl, s: &Subject, filter: &str) -> bool {
        self.fresh(acl, s);
        let inner = topic::shared_subscription(filter).map_or(filter, |(_, f)| f);
        let ok = self
            .snapshot
            .decide(Action::Subscribe, s, inner, Some(&self.named[1]));
        if !ok {
            acl.denied(Edge::Mqtt, Action::Subscribe, s.client_id, filter);
        }
        ok
    }
}

#[cfg(test)]
mod tests;
