//! What a message becomes in the CSE: the names of its two containers, and the body of its
//! contentInstance. Pure functions, no I/O.
//!
//! # Container names (`container`, default `"{device}/{topic}"`)
//! A template of two segments separated by one `/`: the device's container (a child of the
//! AE), then the message's container (a child of that one). Placeholders:
//! * `{device}` — the message's device id (MQTT client id; for PHD the system id in hex);
//! * `{topic}` — every level of the topic, each escaped, joined by `_`;
//! * `{last}` — the last level of the topic, escaped.
//!
//! Literal text may use `A-Z a-z 0-9 - _`. Escaping keeps `A-Z a-z 0-9 -` and writes every
//! other byte as `~` and two upper-case hex digits (`_` → `~5F`, `.` → `~2E`, `~` → `~7E`), so a
//! rendered name uses only URL-unreserved characters and never `.`/`..`, and escaping is
//! injective. Hence the default never merges two topics of one device: `{topic}` keeps every
//! level, and its separator `_` cannot come from inside a level. `{last}` *does* merge topics
//! that end alike (`a/x` and `b/x`) — choose it when the topic's last level is the metric, as
//! in `phd/{system-id}/{metric}` with `"{device}/{last}"` → `{system-id}/{metric}`. A segment
//! that renders empty (an empty last level) makes the message unsendable.
//!
//! # contentInstance body
//! `{"m2m:cin": {"cnf": …, "con": …}}` (onem2m-http.md §3): `con` is the payload as a JSON
//! string when it is UTF-8, with `cnf` `application/senml+json:0` when it decodes as SenML
//! JSON, `application/json:0` when it is other JSON, `text/plain:0` otherwise; a payload that
//! is not UTF-8 is base64 (RFC 4648, padded) with `cnf` `application/senml+cbor:2` when it
//! decodes as SenML CBOR, else `application/octet-stream:2` (2: base64 of binary content).

use sluice_proto::senml::{self, Format};

/// Why a container template is not acceptable (a config error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("must have exactly two segments separated by one '/': the device's container, then the topic's (e.g. \"{{device}}/{{topic}}\")")]
    Segments,
    #[error("unknown placeholder {{{0}}}; use {{device}}, {{topic}} or {{last}}")]
    UnknownPlaceholder(String),
    #[error("has a '{{' without a matching '}}'")]
    Unclosed,
    #[error("literal text may only use A-Z, a-z, 0-9, '-' and '_' (found {0:?})")]
    BadLiteral(char),
    #[error("the second segment must use {{topic}} or {{last}}, or every topic of a device would share one container")]
    NoTopic,
}

/// Why a message has no container names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NamingError {
    #[error("the container name for {0} renders empty")]
    Empty(&'static str),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Lit(String),
    Device,
    Topic,
    Last,
}

/// A parsed `container` template (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerTemplate {
    device: Vec<Piece>,
    stream: Vec<Piece>,
}

impl ContainerTemplate {
    pub fn parse(text: &str) -> Result<ContainerTemplate, TemplateError> {
        let (device, stream) = text.split_once('/').ok_or(TemplateError::Segments)?;
        if stream.contains('/') || device.is_empty() || stream.is_empty() {
            return Err(TemplateError::Segments);
        }
        let stream = parse_segment(stream)?;
        if !stream
            .iter()
            .any(|p| matches!(p, Piece::Topic | Piece::Last))
        {
            return Err(TemplateError::NoTopic);
        }
        Ok(ContainerTemplate {
            device: parse_segment(device)?,
            stream,
        })
    }

    /// The device's container name and the message's container name.
    pub fn render(&self, device: &str, topic: &str) -> Result<(String, String), NamingError> {
        let d = render_segment(&self.device, device, topic);
        let s = render_segment(&self.stream, device, topic);
        if d.is_empty() {
            return Err(NamingError::Empty("the device"));
        }
        if s.is_empty() {
            return Err(NamingError::Empty("the topic"));
        }
        Ok((d, s))
    }
}

fn parse_segment(text: &str) -> Result<Vec<Piece>, TemplateError> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('{') {
            let close = after.find('}').ok_or(TemplateError::Unclosed)?;
            out.push(match &after[..close] {
                "device" => Piece::Device,
                "topic" => Piece::Topic,
                "last" => Piece::Last,
                other => return Err(TemplateError::UnknownPlaceholder(other.to_string())),
            });
            rest = &after[close + 1..];
        } else {
            let end = rest.find('{').unwrap_or(rest.len());
            let lit = &rest[..end];
            if let Some(c) = lit
                .chars()
                .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
            {
                return Err(TemplateError::BadLiteral(c));
            }
            out.push(Piece::Lit(lit.to_string()));
            rest = &rest[end..];
        }
    }
    Ok(out)
}

fn render_segment(pieces: &[Piece], device: &str, topic: &str) -> String {
    let mut out = String::new();
    for p in pieces {
        match p {
            Piece::Lit(l) => out.push_str(l),
            Piece::Device => escape_into(device, &mut out),
            Piece::Topic => {
                for (i, level) in topic.split('/').enumerate() {
                    if i > 0 {
                        out.push('_');
                    }
                    escape_into(level, &mut out);
                }
            }
            Piece::Last => escape_into(topic.rsplit('/').next().unwrap_or(topic), &mut out),
        }
    }
    out
}

/// Append `s` escaped (module docs): `A-Z a-z 0-9 -` kept, every other byte `~XX`.
pub fn escape_into(s: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push('~');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 15)]));
        }
    }
}

/// The `cnf` and `con` a payload is sent with (module docs).
pub fn content_info(payload: &[u8]) -> &'static str {
    match std::str::from_utf8(payload) {
        Ok(_) => {
            if senml::sniff(payload) == Some(Format::Json)
                && senml::decode(Format::Json, payload).is_ok()
            {
                "application/senml+json:0"
            } else if serde_json::from_slice::<serde::de::IgnoredAny>(payload).is_ok() {
                "application/json:0"
            } else {
                "text/plain:0"
            }
        }
        Err(_) => {
            if senml::sniff(payload) == Some(Format::Cbor)
                && senml::decode(Format::Cbor, payload).is_ok()
            {
                "application/senml+cbor:2"
            } else {
                "application/octet-stream:2"
            }
        }
    }
}

/// The JSON body of a create-contentInstance request for `payload`.
pub fn cin_body(payload: &[u8]) -> Vec<u8> {
    let cnf = content_info(payload);
    let mut out = Vec::with_capacity(payload.len() + 64);
    out.extend_from_slice(b"{\"m2m:cin\": {\"cnf\": \"");
    out.extend_from_slice(cnf.as_bytes());
    out.extend_from_slice(b"\", \"con\": ");
    match std::str::from_utf8(payload) {
        // Invariant: serializing a &str into a Vec cannot fail.
        Ok(text) => serde_json::to_writer(&mut out, text).expect("a string serializes"),
        Err(_) => {
            out.push(b'"');
            base64_into(payload, &mut out);
            out.push(b'"');
        }
    }
    out.extend_from_slice(b"}}");
    out
}

/// The JSON body of a create-container request.
pub fn cnt_body(name: &str, mni: Option<u64>, mbs: Option<u64>) -> Vec<u8> {
    let mut s = String::with_capacity(64);
    s.push_str("{\"m2m:cnt\": {\"rn\": \"");
    s.push_str(name); // escaped: only URL-unreserved characters
    s.push('"');
    if let Some(mni) = mni {
        s.push_str(&format!(", \"mni\": {mni}"));
    }
    if let Some(mbs) = mbs {
        s.push_str(&format!(", \"mbs\": {mbs}"));
    }
    s.push_str("}}");
    s.into_bytes()
}

/// The JSON body of the AE registration.
pub fn ae_body(name: &str, app_id: &str) -> Vec<u8> {
    format!("{{\"m2m:ae\": {{\"rn\": \"{name}\", \"api\": \"{app_id}\", \"rr\": false, \"srv\": [\"3\"]}}}}")
        .into_bytes()
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64_into(data: &[u8], out: &mut Vec<u8>) {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(A[(n >> 18) as usize & 63]);
        out.push(A[(n >> 12) as usize & 63]);
        out.push(if chunk.len() > 1 {
            A[(n >> 6) as usize & 63]
        } else {
            b'='
        });
        out.push(if chunk.len() > 2 {
            A[n as usize & 63]
        } else {
            b'='
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn render(t: &str, device: &str, topic: &str) -> (String, String) {
        ContainerTemplate::parse(t)
            .unwrap()
            .render(device, topic)
            .unwrap()
    }

    #[test]
    fn phd_topics_give_system_id_and_metric_containers() {
        assert_eq!(
            render(
                "{device}/{last}",
                "1122334455667704",
                "phd/1122334455667704/spo2"
            ),
            ("1122334455667704".into(), "spo2".into())
        );
        assert_eq!(
            render("{device}/{topic}", "dev.1", "a/b_c"),
            ("dev~2E1".into(), "a_b~5Fc".into())
        );
        assert_eq!(
            render("po-{device}/m-{last}", "d", "x/y"),
            ("po-d".into(), "m-y".into())
        );
    }

    #[test]
    fn bad_templates_are_refused_with_a_reason() {
        for (t, e) in [
            ("{device}", TemplateError::Segments),
            ("{device}/a/{topic}", TemplateError::Segments),
            (
                "{dev}/{topic}",
                TemplateError::UnknownPlaceholder("dev".into()),
            ),
            ("{device/{topic}", TemplateError::Unclosed),
            ("x.y/{topic}", TemplateError::BadLiteral('.')),
            ("{device}/metric", TemplateError::NoTopic),
            ("{device}/{topic", TemplateError::Unclosed),
        ] {
            assert_eq!(ContainerTemplate::parse(t), Err(e), "{t}");
        }
        let t = ContainerTemplate::parse("{device}/{last}").unwrap();
        assert!(t.render("d", "a/").is_err(), "an empty last level");
    }

    #[test]
    fn content_info_follows_the_payload() {
        assert_eq!(
            content_info(br#"[{"n":"t","v":1}]"#),
            "application/senml+json:0"
        );
        assert_eq!(content_info(br#"{"t":1}"#), "application/json:0");
        assert_eq!(content_info(b"21.5 C"), "text/plain:0");
        assert_eq!(content_info(&[0xff, 0x00]), "application/octet-stream:2");
        let body = cin_body(&[0xff, 0x00, 0x01, 0x02]);
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"m2m:cin": {"cnf": "application/octet-stream:2", "con": "/wABAg=="}}"#
        );
        let body = cin_body(br#"[{"n":"t"}]"#);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["m2m:cin"]["con"], r#"[{"n":"t"}]"#);
    }

    proptest! {
        #[test]
        fn the_default_template_never_merges_two_topics_of_a_device(
            a in "[a-z_./~-]{0,6}(/[a-z_./~-]{0,6}){0,3}",
            b in "[a-z_./~-]{0,6}(/[a-z_./~-]{0,6}){0,3}",
        ) {
            let t = ContainerTemplate::parse(crate::config::ONEM2M_DEFAULT_CONTAINER).unwrap();
            let ra = t.render("d", &a);
            let rb = t.render("d", &b);
            if a != b {
                if let (Ok(ra), Ok(rb)) = (ra, rb) {
                    prop_assert_ne!(ra, rb);
                }
            }
        }

        #[test]
        fn cin_bodies_are_json_holding_the_payload(payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let body = cin_body(&payload);
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let con = v["m2m:cin"]["con"].as_str().unwrap().to_string();
            if let Ok(text) = std::str::from_utf8(&payload) {
                prop_assert_eq!(con, text);
            } else {
                prop_assert_eq!(con.len(), payload.len().div_ceil(3) * 4);
            }
        }
    }
}
