//! Which local topics an uplink carries and what they are called in the cloud.
//!
//! `forward` filters select messages (an empty list forwards nothing). The cloud topic is the
//! local topic unchanged by default (the same `ByteString` is returned: no allocation),
//! otherwise `topic_prefix` + (`topic_template` with `{device}` and `{topic}` substituted, or
//! the local topic). The template is parsed once, at construction.

use bytestring::ByteString;
use sluice_proto::mqtt::topic;

use crate::config::UplinkConfig;

#[derive(Debug, Clone)]
pub struct UplinkRoute {
    forward: Vec<String>,
    prefix: String,
    template: Option<Vec<Piece>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Device,
    Topic,
}

impl UplinkRoute {
    pub fn new(cfg: &UplinkConfig) -> UplinkRoute {
        UplinkRoute::from_parts(
            cfg.forward.clone(),
            cfg.topic_prefix.clone(),
            cfg.topic_template.as_deref(),
        )
    }

    /// The same as [`UplinkRoute::new`] from the individual settings.
    pub fn from_parts(forward: Vec<String>, prefix: String, template: Option<&str>) -> UplinkRoute {
        UplinkRoute {
            forward,
            prefix,
            template: template.map(parse_template),
        }
    }

    /// Whether any `forward` filter matches the local `topic`.
    pub fn forwards(&self, topic: &str) -> bool {
        self.forward.iter().any(|f| topic::matches(f, topic))
    }

    /// The cloud topic for a message `device` published on local `topic`.
    pub fn cloud_topic(&self, device: &str, topic: &ByteString) -> ByteString {
        match &self.template {
            None if self.prefix.is_empty() => topic.clone(),
            None => {
                let mut s = String::with_capacity(self.prefix.len() + topic.len());
                s.push_str(&self.prefix);
                s.push_str(topic);
                ByteString::from(s)
            }
            Some(pieces) => {
                let mut s =
                    String::with_capacity(self.prefix.len() + topic.len() + device.len() + 32);
                s.push_str(&self.prefix);
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
}
