//! What differs between two configurations, key by key, and which changed keys a reload
//! can apply live (`super`'s module docs); fingerprints of the files a reload re-reads.

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::Config;

/// Whether a changed key (as [`changed_keys`] names it) can be applied live.
pub(super) fn is_live(key: &str) -> bool {
    const LIVE: [&str; 9] = [
        "priority",
        "reload",
        "limits",
        "acl",
        "log.level",
        "mqtt.users",
        "mqtt.allow_anonymous",
        "mqtt.tls.cert_file",
        "mqtt.tls.key_file",
    ];
    const LIVE_TLS: [&str; 3] = [
        "mqtt.tls.client_ca_file",
        "mqtt.tls.require_client_cert",
        "mqtt.tls.min_version",
    ];
    const LIVE_UPLINK: [&str; 7] = [
        "forward",
        "receive",
        "topic_prefix",
        "topic_template",
        "ca_file",
        "cert_file",
        "key_file",
    ];
    if LIVE
        .iter()
        .chain(LIVE_TLS.iter())
        .any(|l| key == *l || key.starts_with(&format!("{l}.")))
    {
        return true;
    }
    match key.strip_prefix("uplink.") {
        // `uplink.{name}.{key}`; a name may contain dots, the key does not.
        Some(rest) => {
            rest.contains(".aggregate.")
                || rest
                    .rsplit_once('.')
                    .is_some_and(|(_, k)| LIVE_UPLINK.contains(&k))
        }
        None => false,
    }
}

/// The settings that differ between `a` and `b`, as dotted keys: tables are compared key by
/// key, uplinks by name (`uplink.{name}.{key}`; an uplink only one side has is
/// `uplink.{name} (added)` or `(removed)`), any other array as a whole.
pub(super) fn changed_keys(a: &Config, b: &Config) -> Vec<String> {
    // Invariant: every Config serializes (see `Config::to_toml`); an error compares unequal.
    let table = |c: &Config| toml::Table::try_from(c).unwrap_or_default();
    let (ta, tb) = (table(a), table(b));
    let mut out = Vec::new();
    diff_tables("", &ta, &tb, &mut out);
    out
}

fn diff_tables(prefix: &str, a: &toml::Table, b: &toml::Table, out: &mut Vec<String>) {
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        let path = format!("{prefix}{k}");
        match (a.get(k), b.get(k)) {
            (Some(x), Some(y)) if x == y => {}
            (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
                diff_tables(&format!("{path}."), x, y, out)
            }
            (Some(toml::Value::Array(x)), Some(toml::Value::Array(y)))
                if prefix.is_empty() && k == "uplink" =>
            {
                diff_uplinks(x, y, out)
            }
            // No uplink at all on one side (an empty list is not written): every uplink of
            // the other side is added or removed, by name.
            (Some(toml::Value::Array(x)), None) if prefix.is_empty() && k == "uplink" => {
                diff_uplinks(x, &[], out)
            }
            (None, Some(toml::Value::Array(y))) if prefix.is_empty() && k == "uplink" => {
                diff_uplinks(&[], y, out)
            }
            _ => out.push(path),
        }
    }
}

/// Uplinks matched by name.
fn diff_uplinks(a: &[toml::Value], b: &[toml::Value], out: &mut Vec<String>) {
    let named = |v: &[toml::Value]| -> BTreeMap<String, toml::Table> {
        v.iter()
            .filter_map(|u| u.as_table())
            .map(|t| {
                let name = t.get("name").and_then(|n| n.as_str()).unwrap_or_default();
                (name.to_string(), t.clone())
            })
            .collect()
    };
    let (na, nb) = (named(a), named(b));
    for (name, ta) in &na {
        match nb.get(name) {
            Some(tb) => diff_tables(&format!("uplink.{name}."), ta, tb, out),
            None => out.push(format!("uplink.{name} (removed)")),
        }
    }
    for name in nb.keys().filter(|n| !na.contains_key(*n)) {
        out.push(format!("uplink.{name} (added)"));
    }
}

/// Fingerprints of the files whose contents a reload applies even under an unchanged name.
pub(super) fn watched_files(config: &Config) -> BTreeMap<String, u64> {
    use std::hash::{Hash, Hasher};
    let mut files = BTreeMap::new();
    let mut add = |key: String, path: Option<&Path>| {
        if let Some(bytes) = path.and_then(|p| std::fs::read(p).ok()) {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut h);
            files.insert(key, h.finish());
        }
    };
    add("acl.file".into(), config.acl.file.as_deref());
    if let Some(tls) = &config.mqtt.tls {
        add("mqtt.tls.cert_file".into(), Some(&tls.cert_file));
        add("mqtt.tls.key_file".into(), Some(&tls.key_file));
        add(
            "mqtt.tls.client_ca_file".into(),
            tls.client_ca_file.as_deref(),
        );
    }
    for u in &config.uplink {
        add(format!("uplink.{}.ca_file", u.name), u.ca_file.as_deref());
        add(
            format!("uplink.{}.cert_file", u.name),
            u.cert_file.as_deref(),
        );
        add(format!("uplink.{}.key_file", u.name), u.key_file.as_deref());
    }
    files
}

pub(super) fn file_changed(
    now: &BTreeMap<String, u64>,
    then: &BTreeMap<String, u64>,
    key: &str,
) -> bool {
    now.get(key) != then.get(key)
}

#[cfg(test)]
mod tests {
    use super::super::ReloadOutcome;
    use super::*;

    fn parse(text: &str) -> Config {
        crate::config::parse(text).unwrap()
    }

    #[test]
    fn changed_keys_are_named_down_to_the_setting_and_uplinks_by_name() {
        let uplink = |name: &str, forward: &str| {
            format!("[[uplink]]\nname = \"{name}\"\nurl = \"mqtt://10.0.0.1\"\nallow_plaintext = true\nforward = [\"{forward}\"]\n")
        };
        let running = parse(&format!(
            "[mqtt]\nmax_connections = 10\n{}{}",
            uplink("a", "x/#"),
            uplink("b", "y/#")
        ));
        assert!(changed_keys(&running, &running.clone()).is_empty());
        let fresh = parse(&format!(
            "[mqtt]\nmax_connections = 11\n[log]\nlevel = \"debug\"\n{}{}",
            uplink("a", "z/#"),
            uplink("c", "y/#")
        ));
        assert_eq!(
            changed_keys(&running, &fresh),
            vec![
                "log.level",
                "mqtt.max_connections",
                "uplink.a.forward",
                "uplink.b (removed)",
                "uplink.c (added)"
            ]
        );
        let with_function = parse(
            "[[function]]\nname = \"f\"\ntopics = [\"x/#\"]\nurl = \"http://127.0.0.1:8080/\"\n",
        )
        .with_function_sinks();
        assert_eq!(
            changed_keys(&with_function, &parse("")),
            vec!["function", "uplink.function.f (removed)"]
        );
        let local = parse(
            "[[function]]\nname = \"f\"\ntopics = [\"x/#\"]\ncommand = [\"/bin/true\"]\nenv = { A = \"b\" }\nidle = \"30s\"\n",
        )
        .with_function_sinks();
        assert_eq!(
            changed_keys(&local, &parse("")),
            vec!["function", "uplink.function.f (removed)"]
        );
        // Every uplink removed, or the first added: still named by uplink.
        let none = parse("[mqtt]\nmax_connections = 10\n");
        assert_eq!(
            changed_keys(&running, &none),
            vec!["uplink.a (removed)", "uplink.b (removed)"]
        );
        assert_eq!(
            changed_keys(&none, &running),
            vec!["uplink.a (added)", "uplink.b (added)"]
        );
    }

    #[test]
    fn live_keys_are_told_from_restart_only_ones() {
        for live in [
            "priority.devices",
            "limits.publish_rate",
            "reload.drain_timeout",
            "acl.rules",
            "log.level",
            "mqtt.users",
            "mqtt.tls.cert_file",
            "uplink.cloud.forward",
            "uplink.cloud.topic_template",
            "uplink.a.b.forward",
            "uplink.cloud.ca_file",
            "uplink.cloud.aggregate.enabled",
            "uplink.cloud.aggregate.min_devices",
            "uplink.cloud.receive",
        ] {
            assert!(is_live(live), "{live}");
        }
        for restart in [
            "mqtt.listen",
            "mqtt.tls.listen",
            "mqtt.tls.identity_from_cert",
            "gateway.shards",
            "spool.dir",
            "uplink.cloud.url",
            "uplink.cloud.urls",
            "uplink.new (added)",
            "function",
            "coap.listen",
            "admin.listen",
            "log.format",
        ] {
            assert!(!is_live(restart), "{restart}");
        }
    }

    #[test]
    fn outcome_labels_follow_what_was_done() {
        let done = |a: &[&str], r: &[&str]| ReloadOutcome::Done {
            applied: a.iter().map(|s| s.to_string()).collect(),
            restart_needed: r.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(done(&[], &[]).label(), "unchanged");
        assert_eq!(done(&["priority"], &[]).label(), "applied");
        assert_eq!(
            done(&["priority"], &["mqtt.listen"]).label(),
            "restart_needed"
        );
        assert_eq!(ReloadOutcome::Invalid("x".into()).label(), "invalid");
        let json = done(&["acl"], &["spool.dir"]).to_json();
        assert_eq!(json["result"], "restart_needed");
        assert_eq!(json["restart_needed"][0], "spool.dir");
    }
}
