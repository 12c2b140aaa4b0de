use super::pattern::glob_matches;
use super::*;
use crate::config::{AclAction as A, AclPermission as P};

fn limits() -> TopicLimits {
    TopicLimits::new(&MqttConfig::default())
}

fn filter(t: &str) -> Filter {
    Filter::parse(t, &limits()).unwrap()
}

const D1: Subject<'static> = Subject {
    client_id: "d1",
    username: Some("alice"),
};

fn rule(
    devices: Option<&str>,
    users: Option<&str>,
    action: A,
    topics: &[&str],
    p: P,
) -> AclRuleConfig {
    AclRuleConfig {
        devices: devices.map(Into::into),
        users: users.map(Into::into),
        action,
        topics: topics.iter().map(|t| t.to_string()).collect(),
        permission: p,
    }
}

fn acl(default: P, rules: Vec<AclRuleConfig>) -> Arc<Acl> {
    let cfg = AclConfig {
        default,
        file: None,
        rule: rules,
    };
    Acl::new(
        AclSnapshot::compile(&cfg, None, &MqttConfig::default()).unwrap(),
        Arc::default(),
    )
}

/// Every filter of up to 3 levels over {a, $x, +, #} (# last only).
fn all_filters() -> Vec<String> {
    let levels = ["a", "$x", "+", "#"];
    let mut out = Vec::new();
    let mut frontier: Vec<Vec<&str>> = vec![vec![]];
    for _ in 0..3 {
        let mut next = Vec::new();
        for f in &frontier {
            if f.last() == Some(&"#") {
                continue;
            }
            for l in levels {
                let mut g = f.clone();
                g.push(l);
                out.push(g.join("/"));
                next.push(g);
            }
        }
        frontier = next;
    }
    out
}

/// Every topic of up to 4 levels over {a, b, $x, ""}.
fn all_topics() -> Vec<String> {
    let levels = ["a", "b", "$x", ""];
    let mut out = Vec::new();
    let mut frontier: Vec<Vec<&str>> = vec![vec![]];
    for _ in 0..4 {
        let mut next = Vec::new();
        for f in &frontier {
            for l in levels {
                let mut g = f.clone();
                g.push(l);
                out.push(g.join("/"));
                next.push(g);
            }
        }
        frontier = next;
    }
    out.retain(|t| !t.is_empty());
    out
}

#[test]
fn publish_matching_agrees_with_mqtt_matching() {
    let topics = all_topics();
    for f in all_filters() {
        let compiled = filter(&f);
        for t in &topics {
            assert_eq!(
                compiled.matches_name(&D1, t, false),
                topic::matches(&f, t),
                "filter {f:?} topic {t:?}"
            );
        }
    }
}

#[test]
fn covers_is_exactly_the_subset_relation_over_every_small_filter() {
    let topics = all_topics();
    let filters = all_filters();
    for r in &filters {
        let rule = filter(r);
        for f in &filters {
            let subset = topics
                .iter()
                .all(|t| !topic::matches(f, t) || topic::matches(r, t));
            assert_eq!(rule.covers(&D1, f), subset, "rule {r:?} requested {f:?}");
        }
    }
}

#[test]
fn overlaps_is_exactly_a_shared_topic_over_every_small_filter() {
    let topics = all_topics();
    let filters = all_filters();
    for r in &filters {
        let rule = filter(r);
        for f in &filters {
            let shared = topics
                .iter()
                .any(|t| topic::matches(f, t) && topic::matches(r, t));
            assert_eq!(
                rule.overlaps(&D1, f, false),
                shared,
                "rule {r:?} requested {f:?}"
            );
        }
    }
}

#[test]
fn client_id_placeholder_compares_levels_without_widening() {
    let f = filter("devices/%c/#");
    assert!(f.matches_name(&D1, "devices/d1/temp", false));
    assert!(!f.matches_name(&D1, "devices/d2/temp", false));
    assert!(f.covers(&D1, "devices/d1/temp"));
    assert!(f.covers(&D1, "devices/d1/+"));
    assert!(f.covers(&D1, "devices/d1/#"));
    assert!(!f.covers(&D1, "devices/+/temp"));
    assert!(!f.covers(&D1, "#"));
    let mixed = filter("site/dev-%c-%u/x");
    assert!(mixed.matches_name(&D1, "site/dev-d1-alice/x", false));
    assert!(!mixed.matches_name(&D1, "site/dev-d1-bob/x", false));
}

#[test]
fn a_client_id_with_wildcards_or_slashes_is_never_substituted() {
    let a = acl(
        P::Deny,
        vec![rule(Some("*"), None, A::All, &["devices/%c/#"], P::Allow)],
    );
    for id in ["+", "#", "a/b", "x+"] {
        assert!(
            !a.allows_publish(Edge::Mqtt, id, None, &format!("devices/{id}/t")),
            "{id}"
        );
        assert!(
            !a.allows_subscribe(Edge::Mqtt, id, None, "devices/+/t"),
            "{id}"
        );
    }
    // A deny rule with a value it cannot substitute denies (fail closed).
    let d = acl(
        P::Allow,
        vec![rule(
            Some("*"),
            None,
            A::Publish,
            &["private/%c/#"],
            P::Deny,
        )],
    );
    assert!(d.allows_publish(Edge::Mqtt, "a/b", None, "anything"));
    assert!(
        !d.allows_publish(Edge::Mqtt, "a/b", None, "private/zz/y"),
        "a deny rule reads an unsubstitutable %c as +"
    );
    assert!(d.allows_publish(Edge::Mqtt, "ab", None, "private/zz/y"));
    assert!(!d.allows_publish(Edge::Mqtt, "ab", None, "private/ab/x"));
}

#[test]
fn first_match_wins_and_default_applies_when_none_matches() {
    let a = acl(
        P::Deny,
        vec![
            rule(Some("*"), None, A::Subscribe, &["secret/#"], P::Deny),
            rule(Some("*"), None, A::All, &["devices/%c/#"], P::Allow),
            rule(None, Some("ops-*"), A::Subscribe, &["#"], P::Allow),
            rule(Some("d?"), None, A::Publish, &["shared/+"], P::Allow),
        ],
    );
    assert!(a.allows_publish(Edge::Mqtt, "d1", None, "devices/d1/temp"));
    assert!(!a.allows_publish(Edge::Mqtt, "d1", None, "devices/d2/temp"));
    assert!(a.allows_publish(Edge::Mqtt, "d1", None, "shared/x"));
    assert!(
        !a.allows_publish(Edge::Mqtt, "d10", None, "shared/x"),
        "? is one character"
    );
    assert!(!a.allows_subscribe(Edge::Mqtt, "d1", None, "#"));
    assert!(a.allows_subscribe(Edge::Mqtt, "d1", None, "devices/d1/+"));
    assert!(a.allows_subscribe(Edge::Mqtt, "d1", None, "$share/g/devices/d1/+"));
    assert!(a.allows_subscribe(Edge::Mqtt, "x", Some("ops-1"), "devices/+/temp"));
    assert!(
        !a.allows_subscribe(Edge::Mqtt, "x", Some("ops-1"), "#"),
        "an earlier deny overlapping the filter wins"
    );
    assert!(
        !a.allows_subscribe(Edge::Mqtt, "x", None, "devices/+/temp"),
        "no username"
    );
    assert_eq!(a.metrics.denied(Edge::Mqtt, Action::Subscribe), 3);
    assert_eq!(a.metrics.denied(Edge::Mqtt, Action::Publish), 2);
}

#[test]
fn the_device_view_decides_as_the_lookup_does() {
    let rules = vec![
        rule(Some("d1"), None, A::Publish, &["only/d1"], P::Allow),
        rule(None, Some("alice"), A::Publish, &["alice/#"], P::Allow),
        rule(Some("d*"), None, A::Publish, &["glob/%c"], P::Allow),
        rule(Some("*"), None, A::Publish, &["all/+"], P::Allow),
        rule(Some("*"), None, A::Publish, &["+/deny"], P::Deny),
    ];
    let a = acl(P::Deny, rules);
    let mut view = DeviceAcl::new(&a, &D1);
    for t in [
        "only/d1", "alice/x", "glob/d1", "all/x", "all/deny", "only/d2", "glob/d2", "x/deny",
    ] {
        let lookup = a.current.load().decide(Action::Publish, &D1, t, None);
        assert_eq!(view.allows_publish(&a, &D1, t), lookup, "{t}");
    }
    assert!(view.allows_publish(&a, &D1, "all/x"));
    assert!(
        view.allows_publish(&a, &D1, "all/deny"),
        "the earlier allow wins"
    );
    assert!(!view.allows_publish(&a, &D1, "x/deny"));
    // The same topic again: the remembered decision (no rule walked), still the same answer;
    // then another topic and back.
    assert!(!view.allows_publish(&a, &D1, "x/deny"));
    assert!(view.allows_publish(&a, &D1, "all/x"));
    assert!(!view.allows_publish(&a, &D1, "x/deny"));
    // A new snapshot is picked up, even for the topic whose decision was remembered.
    a.publish(AclSnapshot::default());
    assert!(view.allows_publish(&a, &D1, "x/deny"));
}

#[test]
fn bad_rules_are_refused_with_their_key_path() {
    let cases: [(AclRuleConfig, &str); 6] = [
        (
            rule(Some("[ab]"), None, A::All, &["a"], P::Allow),
            "acl.rule[0].devices",
        ),
        (
            rule(None, Some(""), A::All, &["a"], P::Allow),
            "acl.rule[0].users",
        ),
        (rule(None, None, A::All, &["a"], P::Allow), "acl.rule[0]"),
        (
            rule(Some("*"), None, A::All, &["a/#/b"], P::Allow),
            "acl.rule[0].topics[0]",
        ),
        (
            rule(Some("*"), None, A::All, &["a", "%x"], P::Allow),
            "acl.rule[0].topics[1]",
        ),
        (
            rule(Some("*"), None, A::All, &[], P::Allow),
            "acl.rule[0].topics",
        ),
    ];
    for (r, key) in cases {
        let cfg = AclConfig {
            default: P::Allow,
            file: None,
            rule: vec![r],
        };
        let e = AclSnapshot::compile(&cfg, None, &MqttConfig::default()).unwrap_err();
        assert_eq!(e.key, key, "{e}");
    }
}

#[test]
fn globs_match_like_shell_patterns() {
    for (p, s, want) in [
        ("*", "", true),
        ("d-*", "d-1", true),
        ("d-*", "e-1", false),
        ("*-x", "a-b-x", true),
        ("a*b*c", "aXbYc", true),
        ("a*b*c", "aXbY", false),
        ("??", "é1", true),
        ("?", "ab", false),
    ] {
        assert_eq!(glob_matches(p, s), want, "{p} {s}");
    }
}

/// Not a benchmark of record (that is `docs/perf/`): a guard that 1,000 rules naming other
/// devices cost a check nearly nothing, because of the indexes.
#[test]
fn a_thousand_rules_for_other_devices_are_not_walked() {
    let mut rules: Vec<AclRuleConfig> = (0..1000)
        .map(|i| {
            rule(
                Some(&format!("dev-{i}")),
                None,
                A::Publish,
                &[&format!("devices/dev-{i}/#")],
                P::Allow,
            )
        })
        .collect();
    rules.push(rule(
        Some("*"),
        None,
        A::Publish,
        &["devices/%c/#"],
        P::Allow,
    ));
    let a = acl(P::Deny, rules);
    let s = Subject {
        client_id: "dev-7",
        username: None,
    };
    let view = DeviceAcl::new(&a, &s);
    assert_eq!(view.named[0].len(), 1, "only its own rule is kept");
    let snap = a.current.load();
    let lists: Vec<_> = snap.index[0]
        .everyone_by_first
        .iter()
        .map(|(k, v)| (&**k, v.len()))
        .collect();
    assert_eq!(lists, [("devices", 1)]);
}

/// Prints the cost of one publish check with no rules and with 1,000 (`--ignored
/// --nocapture`): 998 rules naming one device each, plus two for every device.
#[test]
#[ignore]
fn print_the_cost_of_a_check() {
    let mut rules: Vec<AclRuleConfig> = (0..998)
        .map(|i| {
            rule(
                Some(&format!("dev-{i}")),
                None,
                A::Publish,
                &[&format!("devices/dev-{i}/#")],
                P::Allow,
            )
        })
        .collect();
    rules.push(rule(Some("*"), None, A::Subscribe, &["$SYS/#"], P::Deny));
    rules.push(rule(
        Some("*"),
        None,
        A::Publish,
        &["devices/%c/#"],
        P::Allow,
    ));
    let none = acl(P::Allow, Vec::new());
    let two = acl(P::Deny, rules[998..].to_vec());
    let thousand = acl(P::Deny, rules);
    let s = Subject {
        client_id: "dev-999",
        username: None,
    };
    const N: u32 = 1_000_000;
    for (name, a) in [
        ("0 rules", &none),
        ("2 rules", &two),
        ("1000 rules", &thousand),
    ] {
        let mut view = DeviceAcl::new(a, &s);
        let t = Instant::now();
        let mut ok = 0u32;
        for _ in 0..N {
            ok +=
                u32::from(view.allows_publish(a, &s, std::hint::black_box("devices/dev-999/temp")));
        }
        let per = t.elapsed() / N;
        assert_eq!(ok, N);
        println!("{name}: {per:?} per publish check (view)");
        let t = Instant::now();
        for _ in 0..N {
            a.allows_publish(
                Edge::Coap,
                std::hint::black_box("dev-999"),
                None,
                "devices/dev-999/temp",
            );
        }
        println!(
            "{name}: {:?} per publish check (lookup, CoAP/PHD)",
            t.elapsed() / N
        );
    }
}
