//! `urls`: an MQTT uplink to several nodes of ONE broker cluster (issue 33), instead of `url`.
//!
//! Owns: the check of the raw TOML that an `[[uplink]]` sets exactly one of `url` and `urls`
//! (serde's default for `url` would hide which one was written), the bound on the list
//! ([`MAX_NODES`]), filling `url` in with the first node after serde ([`fill_first_node`]),
//! and leaving `url` out of the printed form of an uplink with `urls`
//! ([`fix_printed_uplinks`]). Does not own: the rules every node shares with a single `url`
//! (scheme, `allow_plaintext`, TLS names: `validate/uplink.rs`), or connecting and failing
//! over (`crate::sink::mqtt`).
//!
//! Invariant: after [`fill_first_node`], `url == urls[0]` whenever `urls` is non-empty, so
//! code that asks only "TLS or not" or "the first host" reads `url`; code that connects reads
//! [`UplinkConfig::nodes`]. `parse(&config.to_toml())` equals `config` (the printer writes
//! `urls` alone).

use super::{ConfigError, UplinkConfig};

/// Most nodes in one uplink's `urls` (a cluster's seed list, not a fleet inventory).
pub const MAX_NODES: usize = 16;

fn invalid(key: String, message: &str) -> ConfigError {
    ConfigError::Value {
        key,
        message: message.to_string(),
        line: None,
        column: None,
    }
}

/// Before serde: every `[[uplink]]` table sets `url` or `urls`, not both and not neither, and
/// `urls` is a non-empty list of at most [`MAX_NODES`] strings.
pub(super) fn check_raw(table: &toml::Table) -> Result<(), ConfigError> {
    let Some(toml::Value::Array(uplinks)) = table.get("uplink") else {
        return Ok(());
    };
    for (i, up) in uplinks.iter().enumerate() {
        let Some(up) = up.as_table() else { continue };
        // A Kafka uplink names its nodes with `brokers` (`kafka.rs`).
        if super::kafka::is_kafka_table(up) {
            continue;
        }
        match (up.get("url"), up.get("urls")) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    format!("uplink[{i}].urls"),
                    "set either url (one broker) or urls (several nodes of one cluster), not both",
                ))
            }
            (None, None) => {
                return Err(invalid(
                    format!("uplink[{i}].url"),
                    "missing: set url = \"mqtts://host:8883\" (one broker) or urls = [\"mqtts://a:8883\", \"mqtts://b:8883\"] (several nodes of one cluster)",
                ))
            }
            (None, Some(toml::Value::Array(list))) => {
                if list.is_empty() {
                    return Err(invalid(
                        format!("uplink[{i}].urls"),
                        "is empty; list the cluster's nodes (at least one), or use url for one broker",
                    ));
                }
                if list.len() > MAX_NODES {
                    return Err(invalid(
                        format!("uplink[{i}].urls"),
                        &format!("lists {} nodes; at most {MAX_NODES} are allowed (a seed list of the cluster, not every node)", list.len()),
                    ));
                }
                for (j, v) in list.iter().enumerate() {
                    let Some(url) = v.as_str() else { continue };
                    let scheme = url
                        .split_once("://")
                        .map(|(s, _)| s.to_ascii_lowercase())
                        .unwrap_or_default();
                    if scheme == "http" || scheme == "https" {
                        return Err(invalid(
                            format!("uplink[{i}].urls[{j}]"),
                            &format!("{url:?} is an HTTP url, but urls lists MQTT broker nodes; use mqtts://"),
                        ));
                    }
                }
            }
            // Any other type: serde names it with the key path.
            _ => {}
        }
    }
    Ok(())
}

/// After serde: `url` = the first of `urls` (see the module invariant).
pub(super) fn fill_first_node(uplinks: &mut [UplinkConfig]) {
    for u in uplinks {
        if let Some(first) = u.urls.first() {
            u.url = first.clone();
        }
    }
}

/// The printed form of `uplinks` (the `uplink` array of a printed config): an uplink with
/// `urls` is written without `url` (a file may set only one of them).
pub(super) fn fix_printed_uplinks(uplinks: &mut [toml::Value], config: &[UplinkConfig]) {
    for (value, u) in uplinks.iter_mut().zip(config) {
        if u.urls.is_empty() {
            continue;
        }
        if let Some(t) = value.as_table_mut() {
            t.remove("url");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{parse_unchecked_files, ConfigError};

    const TAIL: &str = "allow_plaintext = true\n";

    fn uplink(keys: &str) -> Result<crate::config::Config, ConfigError> {
        parse_unchecked_files(&format!("[[uplink]]\nname = \"c\"\n{keys}\n{TAIL}"))
    }

    fn error(keys: &str) -> (String, String) {
        let e = uplink(keys).expect_err(keys);
        (e.key().unwrap_or_default().to_string(), e.to_string())
    }

    #[test]
    fn urls_lists_the_nodes_and_url_holds_the_first() {
        let c = uplink("urls = [\"mqtt://a:1883\", \"mqtt://b:1884\", \"mqtt://c\"]").unwrap();
        let u = &c.uplink[0];
        let nodes: Vec<String> = u.nodes().iter().map(ToString::to_string).collect();
        assert_eq!(nodes, ["mqtt://a:1883", "mqtt://b:1884", "mqtt://c:1883"]);
        assert_eq!(u.url.to_string(), "mqtt://a:1883");
        let single = uplink("url = \"mqtt://a:1883\"").unwrap();
        assert_eq!(single.uplink[0].nodes(), [single.uplink[0].url.clone()]);
    }

    #[test]
    fn url_and_urls_together_or_neither_or_an_empty_list_are_refused_by_key() {
        let (key, msg) = error("url = \"mqtt://a\"\nurls = [\"mqtt://b\"]");
        assert_eq!(key, "uplink[0].urls");
        assert!(msg.contains("not both"), "{msg}");
        let (key, msg) = error("");
        assert_eq!(key, "uplink[0].url");
        assert!(msg.contains("urls"), "{msg}");
        let (key, msg) = error("urls = []");
        assert_eq!(key, "uplink[0].urls");
        assert!(msg.contains("empty"), "{msg}");
        let many: Vec<String> = (0..17).map(|n| format!("\"mqtt://n{n}\"")).collect();
        let (key, msg) = error(&format!("urls = [{}]", many.join(", ")));
        assert_eq!(key, "uplink[0].urls");
        assert!(msg.contains("at most 16"), "{msg}");
    }

    #[test]
    fn every_node_follows_the_rules_of_a_single_url() {
        // A malformed node is named by its index.
        let (key, msg) = error("urls = [\"mqtt://a\", \"mqtt://b:0\"]");
        assert_eq!(key, "uplink[0].urls[1]", "{msg}");
        let (key, _) = error("urls = [\"mqtt://a\", \"https://b\"]");
        assert_eq!(key, "uplink[0].urls[1]");
        // Mixed schemes, and plaintext without allow_plaintext.
        let e = parse_unchecked_files(
            "[[uplink]]\nname = \"c\"\nurls = [\"mqtts://a\", \"mqtt://b\"]\nca_file = \"/ca.pem\"\n",
        )
        .expect_err("mixed schemes");
        assert_eq!(e.key(), Some("uplink[0].urls[1]"), "{e}");
        assert!(e.to_string().contains("mqtts://"), "{e}");
        let e = parse_unchecked_files(
            "[[uplink]]\nname = \"c\"\nurls = [\"mqtt://a\", \"mqtt://b\"]\n",
        )
        .expect_err("plaintext");
        assert_eq!(e.key(), Some("uplink[0].urls[0]"), "{e}");
        assert!(e.to_string().contains("allow_plaintext"), "{e}");
        // The same node twice.
        let (key, msg) = error("urls = [\"mqtt://a:1883\", \"mqtt://a\"]");
        assert_eq!(key, "uplink[0].urls[1]");
        assert!(msg.contains("twice"), "{msg}");
        // A oneM2M uplink has one url.
        let e = parse_unchecked_files(
            "[[uplink]]\nname = \"c\"\nprotocol = \"onem2m\"\nurls = [\"http://a\"]\nallow_plaintext = true\n",
        )
        .expect_err("onem2m urls");
        assert_eq!(e.key(), Some("uplink[0].urls"), "{e}");
    }

    #[test]
    fn a_printed_config_with_urls_parses_back_to_the_same_config() {
        let c = uplink("urls = [\"mqtt://a:1883\", \"mqtt://[::1]:1884\"]").unwrap();
        let printed = c.to_toml();
        assert!(!printed.contains("\nurl = "), "{printed}");
        assert!(printed.contains("urls = ["), "{printed}");
        assert_eq!(parse_unchecked_files(&printed).unwrap(), c);
    }
}
