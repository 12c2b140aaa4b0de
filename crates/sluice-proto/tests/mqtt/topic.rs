//! Topic names, filters and matching (§4.7), as tables taken from the specification's examples.

use proptest::prelude::*;
use sluice_proto::mqtt::topic::{
    levels, matches, shared_subscription, valid_shared_subscription, valid_topic_filter,
    valid_topic_name,
};

#[test]
fn topic_names_are_non_empty_without_wildcards_or_nul() {
    for name in [
        "a",
        "/",
        "a/b",
        "sport/tennis/player1",
        "/finance",
        "a//b",
        "$SYS/broker",
        "ü/€",
        " ",
    ] {
        assert!(
            valid_topic_name(name),
            "{name:?} should be a valid topic name"
        );
    }
    for name in ["", "a/+", "+", "#", "a/#", "sport+", "a\0b"] {
        assert!(
            !valid_topic_name(name),
            "{name:?} should be rejected as a topic name"
        );
    }
}

#[test]
fn levels_counts_the_separated_parts_including_empty_ones() {
    assert_eq!(levels("a"), 1);
    assert_eq!(levels("/"), 2);
    assert_eq!(levels("a//b"), 3);
    assert_eq!(levels("sport/+/#"), 3);
    assert_eq!(levels(&"/".repeat(65_535)), 65_536);
}

#[test]
fn topic_names_and_filters_are_at_most_65535_bytes() {
    assert!(valid_topic_name(&"a".repeat(65_535)));
    assert!(!valid_topic_name(&"a".repeat(65_536)));
    assert!(valid_topic_filter(&"a".repeat(65_535)));
    assert!(!valid_topic_filter(&"a".repeat(65_536)));
}

#[test]
fn filter_wildcards_must_fill_whole_levels_and_hash_must_be_last() {
    let valid = [
        "#",
        "+",
        "sport/#",
        "sport/tennis/#",
        "+/tennis/#",
        "sport/+/player1",
        "+/+",
        "/+",
        "+/",
        "a//b",
        "$SYS/#",
        "$share/group/a/+",
    ];
    for filter in valid {
        assert!(
            valid_topic_filter(filter),
            "{filter:?} should be a valid filter"
        );
    }
    let invalid = [
        "",
        "sport/tennis#",
        "sport/tennis/#/ranking",
        "sport+",
        "#/a",
        "a/#/",
        "++",
        "a/b#",
        "a\0",
    ];
    for filter in invalid {
        assert!(
            !valid_topic_filter(filter),
            "{filter:?} should be rejected as a filter"
        );
    }
}

#[test]
fn matching_follows_the_specification_examples() {
    let table: &[(&str, &str, bool)] = &[
        // §4.7.1.2 multi-level wildcard
        ("sport/tennis/player1/#", "sport/tennis/player1", true),
        (
            "sport/tennis/player1/#",
            "sport/tennis/player1/ranking",
            true,
        ),
        (
            "sport/tennis/player1/#",
            "sport/tennis/player1/score/wimbledon",
            true,
        ),
        ("sport/#", "sport", true),
        ("#", "sport/tennis", true),
        ("#", "/", true),
        // §4.7.1.3 single-level wildcard
        ("sport/tennis/+", "sport/tennis/player1", true),
        ("sport/tennis/+", "sport/tennis/player2", true),
        ("sport/tennis/+", "sport/tennis/player1/ranking", false),
        ("sport/+", "sport", false),
        ("sport/+", "sport/", true),
        ("+", "sport", true),
        ("+", "/finance", false),
        ("+/+", "/finance", true),
        ("/+", "/finance", true),
        ("+/", "a/", true),
        ("a/+/c", "a//c", true),
        // exact levels, case-sensitive, empty levels significant
        ("a/b", "a/b", true),
        ("a/b", "A/b", false),
        ("a/b", "a/b/", false),
        ("a//b", "a/b", false),
        ("a/b", "a", false),
        ("a", "a/b", false),
        ("/", "/", true),
    ];
    for &(filter, topic, expected) in table {
        assert_eq!(
            matches(filter, topic),
            expected,
            "matches({filter:?}, {topic:?})"
        );
    }
}

#[test]
fn wildcards_at_the_first_level_do_not_match_dollar_topics() {
    let table: &[(&str, &str, bool)] = &[
        ("#", "$SYS/broker/clients", false),
        ("+/monitor/Clients", "$SYS/monitor/Clients", false),
        ("+", "$SYS", false),
        ("$SYS/#", "$SYS/broker/clients", true),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", true),
        ("$SYS/#", "$SYS", true),
        ("$SYS", "$SYS", true),
        ("#", "a/$SYS", true),
        ("a/+", "a/$x", true),
    ];
    for &(filter, topic, expected) in table {
        assert_eq!(
            matches(filter, topic),
            expected,
            "matches({filter:?}, {topic:?})"
        );
    }
}

proptest! {
    #[test]
    fn a_valid_topic_name_used_as_a_filter_matches_exactly_itself(
        name in "[a-z/]{1,8}", other in "[a-z/]{1,8}"
    ) {
        prop_assert!(valid_topic_filter(&name));
        prop_assert!(matches(&name, &name));
        prop_assert_eq!(matches(&name, &other), name == other);
    }

    #[test]
    fn hash_matches_every_topic_not_starting_with_dollar(name in "[a-z$/]{1,8}") {
        prop_assert_eq!(matches("#", &name), !name.starts_with('$'));
    }

    #[test]
    fn validation_and_matching_never_panic(filter in ".{0,12}", topic in ".{0,12}") {
        let _ = valid_topic_name(&topic);
        let _ = valid_topic_filter(&filter);
        let _ = matches(&filter, &topic);
    }
}

#[test]
fn shared_subscriptions_split_into_share_name_and_filter() {
    assert_eq!(
        shared_subscription("$share/g1/a/+/#"),
        Some(("g1", "a/+/#"))
    );
    assert!(valid_shared_subscription("$share/g1/a/+/#"));
    assert!(valid_shared_subscription("$share/g/#"));
    assert_eq!(shared_subscription("a/b"), None);
    for bad in [
        "$share/",
        "$share/g",
        "$share//a",
        "$share/g+/a",
        "$share/g#/a",
        "$share/g/",
        "$share/g/a/#/b",
        "$sharex/g/a",
    ] {
        assert!(!valid_shared_subscription(bad), "{bad}");
    }
}
