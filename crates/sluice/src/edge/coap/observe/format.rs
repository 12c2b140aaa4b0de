//! Content types between MQTT 5 (`content_type`, a MIME string) and CoAP (Content-Format, a
//! registered number, RFC 7252 §12.3 and the IANA CoAP Content-Formats registry).
//!
//! Owns: the mapping table, both ways. Does not own: deciding what to do with a type that has
//! no counterpart (the caller leaves the option or property out).

/// (Content-Format, MIME type as CoAP registers it), the common ones.
const TABLE: [(u16, &str); 15] = [
    (0, "text/plain;charset=utf-8"),
    (40, "application/link-format"),
    (41, "application/xml"),
    (42, "application/octet-stream"),
    (47, "application/exi"),
    (50, "application/json"),
    (51, "application/json-patch+json"),
    (52, "application/merge-patch+json"),
    (60, "application/cbor"),
    (61, "application/cwt"),
    (110, "application/senml+json"),
    (111, "application/sensml+json"),
    (112, "application/senml+cbor"),
    (113, "application/sensml+cbor"),
    (114, "application/senml-exi"),
];

/// The CoAP Content-Format of an MQTT 5 content type: compared case-insensitively without
/// spaces; `text/plain` with or without `charset=utf-8` is 0. `None` for anything else.
pub fn content_format_of(content_type: &str) -> Option<u16> {
    let norm: String = content_type
        .chars()
        .filter(|c| !c.is_whitespace())
        .flat_map(char::to_lowercase)
        .collect();
    if norm == "text/plain" {
        return Some(0);
    }
    TABLE.iter().find(|(_, t)| *t == norm).map(|(f, _)| *f)
}

/// The MIME type (an MQTT 5 content type) of a CoAP Content-Format, `None` when unknown.
pub fn content_type_of(format: u16) -> Option<&'static str> {
    TABLE.iter().find(|(f, _)| *f == format).map(|(_, t)| *t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_types_map_both_ways() {
        assert_eq!(content_format_of("application/json"), Some(50));
        assert_eq!(content_format_of("Text/Plain; charset=UTF-8"), Some(0));
        assert_eq!(content_format_of("text/plain"), Some(0));
        assert_eq!(content_format_of("application/senml+cbor"), Some(112));
        assert_eq!(content_format_of("image/png"), None);
        assert_eq!(content_type_of(60), Some("application/cbor"));
        assert_eq!(content_type_of(9999), None);
        for (f, t) in TABLE {
            assert_eq!(content_format_of(t), Some(f));
        }
    }
}
