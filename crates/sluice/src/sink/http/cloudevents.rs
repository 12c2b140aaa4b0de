//! CloudEvents 1.0 in HTTP binary content mode (CloudEvents HTTP protocol binding §3.1): what
//! one device message looks like to a function.
//!
//! Owns: the attributes sluice sets — `specversion` 1.0, `id` (unique per message), `source`
//! `sluice://{gateway}/{device}`, `type` `io.sluice.message`, `subject` (the topic), `time`
//! (RFC 3339, UTC, milliseconds) — the `Content-Type` of the data (the MQTT 5 content type, SenML
//! when the payload is a SenML pack, else `application/octet-stream`), and writing them as
//! `ce-` headers of a POST. Does not own: connections, retries, which function (the sink).
//!
//! Header values are percent-encoded as the binding asks (§3.1.3.2): every byte outside
//! printable ASCII, and space, `"` and `%`, becomes `%XX` of its UTF-8 bytes; a receiver (the
//! CloudEvents SDKs) decodes them back. The body is the payload, unchanged.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// The `type` of every event sluice sends.
pub const EVENT_TYPE: &str = "io.sluice.message";

/// One event's attributes (the data is the message's payload, sent as the body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvent {
    /// Unique per message (per gateway run and source): e.g. shard, sequence and start time.
    pub id: String,
    /// `sluice://{gateway}/{device}`.
    pub source: String,
    /// The topic.
    pub subject: String,
    pub time: SystemTime,
    /// The data's media type.
    pub content_type: String,
}

impl CloudEvent {
    /// The event of a message from `device` on `topic`, received at `time`.
    pub fn for_message(
        gateway: &str,
        device: &str,
        topic: &str,
        id: String,
        time: SystemTime,
        content_type: &str,
    ) -> CloudEvent {
        CloudEvent {
            id,
            source: format!("{SOURCE_SCHEME}{gateway}/{device}"),
            subject: topic.to_owned(),
            time,
            content_type: content_type.to_owned(),
        }
    }

    /// The headers of a binary-mode POST of this event to `host` (`conn.rs` adds
    /// `Content-Length`). Values are percent-encoded or checked ASCII without CR/LF, so every
    /// one is a valid header value; one that were not would be left out rather than sent.
    ///
    /// Built once per event with one buffer for every value that is not a constant (each
    /// value a shared slice of it, so cloning the map for an attempt copies no value and
    /// allocates none for them), and the constant ones static: the same headers as
    /// [`Self::headers`], in the same order.
    pub fn header_map(&self, host: &str) -> hyper::HeaderMap {
        build_header_map(
            host,
            |b| encode_into(b, &self.id),
            self.id.len(),
            |b| encode_into(b, &self.source),
            self.source.len(),
            &self.subject,
            self.time,
            &self.content_type,
        )
    }

    /// The binary-mode headers: `ce-*` (percent-encoded) and `Content-Type`.
    pub fn headers(&self) -> [(&'static str, String); 7] {
        [
            ("ce-specversion", "1.0".to_owned()),
            ("ce-id", encode(&self.id)),
            ("ce-source", encode(&self.source)),
            ("ce-type", EVENT_TYPE.to_owned()),
            ("ce-subject", encode(&self.subject)),
            ("ce-time", rfc3339(self.time)),
            ("Content-Type", self.content_type.clone()),
        ]
    }
}

/// The data's media type: the MQTT 5 content type when the device gave one, SenML JSON when
/// the payload is a SenML pack, else octet-stream.
pub fn content_type(mqtt_content_type: Option<&str>, payload: &[u8]) -> String {
    content_type_of(mqtt_content_type, payload).to_owned()
}

/// [`content_type`] without the `String`.
pub fn content_type_of<'a>(mqtt_content_type: Option<&'a str>, payload: &[u8]) -> &'a str {
    if let Some(ct) =
        mqtt_content_type.filter(|c| !c.is_empty() && c.is_ascii() && !c.contains(['\r', '\n']))
    {
        return ct;
    }
    match sluice_proto::senml::sniff(payload) {
        Some(f) => f.content_type(),
        None => OCTET_STREAM,
    }
}

/// The headers of the binary-mode POST of a message from `device` on `topic` with id
/// `{id_prefix}{seq}`: what [`CloudEvent::for_message`] and [`CloudEvent::header_map`] give,
/// without building the event's strings first (the dispatcher's path, once per event).
#[allow(clippy::too_many_arguments)]
pub fn message_header_map(
    host: &str,
    gateway: &str,
    device: &str,
    topic: &str,
    id_prefix: &str,
    seq: u64,
    time: SystemTime,
    content_type: &str,
) -> hyper::HeaderMap {
    build_header_map(
        host,
        |b| {
            encode_into(b, id_prefix);
            let _ = write!(b, "{seq}");
        },
        id_prefix.len() + 20,
        |b| {
            encode_into(b, SOURCE_SCHEME);
            encode_into(b, gateway);
            encode_into(b, "/");
            encode_into(b, device);
        },
        SOURCE_SCHEME.len() + gateway.len() + 1 + device.len(),
        topic,
        time,
        content_type,
    )
}

/// `source` is `sluice://{gateway}/{device}`.
const SOURCE_SCHEME: &str = "sluice://";

/// The binary-mode headers (see [`CloudEvent::header_map`]), the id and source written by
/// `id` and `source` (about `id_len` and `source_len` bytes before encoding), in one buffer.
#[allow(clippy::too_many_arguments)]
fn build_header_map(
    host: &str,
    id: impl FnOnce(&mut bytes::BytesMut),
    id_len: usize,
    source: impl FnOnce(&mut bytes::BytesMut),
    source_len: usize,
    subject: &str,
    time: SystemTime,
    content_type: &str,
) -> hyper::HeaderMap {
    use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST};
    let mut map = hyper::HeaderMap::with_capacity(8);
    let mut buf = bytes::BytesMut::with_capacity(
        host.len() + id_len + 3 * (source_len + subject.len()) + TIME_LEN + content_type.len(),
    );
    let put = |map: &mut hyper::HeaderMap, name: HeaderName, buf: &mut bytes::BytesMut| {
        if let Ok(v) = HeaderValue::from_maybe_shared(buf.split().freeze()) {
            map.insert(name, v);
        }
    };
    buf.extend_from_slice(host.as_bytes());
    put(&mut map, HOST, &mut buf);
    map.insert(
        HeaderName::from_static("ce-specversion"),
        HeaderValue::from_static("1.0"),
    );
    id(&mut buf);
    put(&mut map, HeaderName::from_static("ce-id"), &mut buf);
    source(&mut buf);
    put(&mut map, HeaderName::from_static("ce-source"), &mut buf);
    map.insert(
        HeaderName::from_static("ce-type"),
        HeaderValue::from_static(EVENT_TYPE),
    );
    encode_into(&mut buf, subject);
    put(&mut map, HeaderName::from_static("ce-subject"), &mut buf);
    let _ = write!(buf, "{}", rfc3339_display(time));
    put(&mut map, HeaderName::from_static("ce-time"), &mut buf);
    match content_type {
        OCTET_STREAM => {
            map.insert(CONTENT_TYPE, HeaderValue::from_static(OCTET_STREAM));
        }
        ct => {
            buf.extend_from_slice(ct.as_bytes());
            put(&mut map, CONTENT_TYPE, &mut buf);
        }
    }
    map
}

/// Percent-encode a header value (binding §3.1.3.2).
pub fn encode(value: &str) -> String {
    let mut out = bytes::BytesMut::with_capacity(value.len());
    encode_into(&mut out, value);
    // Only printable ASCII was written.
    String::from_utf8_lossy(&out).into_owned()
}

/// [`encode`] appending to `out`.
fn encode_into(out: &mut bytes::BytesMut, value: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in value.as_bytes() {
        if (0x21..=0x7E).contains(&b) && b != b'"' && b != b'%' {
            out.extend_from_slice(&[b]);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
}

/// The media type of data that is neither MQTT-5-typed nor SenML.
const OCTET_STREAM: &str = "application/octet-stream";
/// Length of an [`rfc3339`] time (`2024-01-02T03:04:05.500Z`).
const TIME_LEN: usize = 24;

/// `time` as RFC 3339 in UTC with milliseconds, e.g. `2024-01-02T03:04:05.500Z`
/// (`humantime`). Clamped to 1970-01-01 … 9999-12-31T23:59:59 (humantime panics before the
/// epoch and fails after year 9999; a gateway without a real-time clock may be anywhere).
pub fn rfc3339(time: SystemTime) -> String {
    rfc3339_display(time).to_string()
}

/// [`rfc3339`] without the `String`.
fn rfc3339_display(time: SystemTime) -> humantime::Rfc3339Timestamp {
    let last = UNIX_EPOCH + std::time::Duration::from_secs(253_402_300_799);
    humantime::format_rfc3339_millis(time.clamp(UNIX_EPOCH, last))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        let t = UNIX_EPOCH + Duration::from_millis(1_704_164_645_500);
        assert_eq!(rfc3339(t), "2024-01-02T03:04:05.500Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(
            rfc3339(before),
            "1970-01-01T00:00:00.000Z",
            "clamped, no panic"
        );
        let far = UNIX_EPOCH + Duration::from_secs(300_000_000_000);
        assert_eq!(
            rfc3339(far),
            "9999-12-31T23:59:59.000Z",
            "clamped, no panic"
        );
    }

    #[test]
    fn header_values_are_percent_encoded_where_the_binding_asks() {
        assert_eq!(encode("sensors/a b"), "sensors/a%20b");
        assert_eq!(encode("100%\"ok\""), "100%25%22ok%22");
        assert_eq!(encode("température"), "temp%C3%A9rature");
        assert_eq!(encode("plain-id_1.2:3"), "plain-id_1.2:3");
    }

    /// `header_map` builds its values in one shared buffer: they must stay what `headers()`
    /// says, byte for byte, for every kind of value (encoded, static, typed).
    #[test]
    fn the_header_map_carries_exactly_the_binary_mode_headers() {
        for (device, topic, ct) in [
            ("dév 1", "a b/\"c\"/100%", None),
            ("d", "t", Some("text/plain; charset=utf-8")),
            ("", "x", None),
        ] {
            let e = CloudEvent::for_message(
                "gw",
                device,
                topic,
                "ff-1-9".into(),
                UNIX_EPOCH + Duration::from_millis(1_704_164_645_500),
                &content_type(ct, b"\x00"),
            );
            let map = e.header_map("h:1");
            let got: Vec<(String, String)> = map
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
                .collect();
            let mut want = vec![("host".to_owned(), "h:1".to_owned())];
            want.extend(
                e.headers()
                    .into_iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), v)),
            );
            assert_eq!(got, want);
        }
    }

    /// The dispatcher's path builds no event first: its headers must be the event's.
    #[test]
    fn message_headers_are_the_events_headers() {
        let t = UNIX_EPOCH + Duration::from_millis(1_704_164_645_512);
        for (gw, device, topic, ct) in [
            ("gw 1", "dév/7", "a b/%/\"q\"", Some("text/plain")),
            ("host", "d", "sensors/t", None),
        ] {
            let ct = content_type_of(ct, b"[{\"n\":\"t\",\"v\":1}]");
            let e = CloudEvent::for_message(gw, device, topic, "19a-0-42".into(), t, ct);
            let got = message_header_map("h", gw, device, topic, "19a-0-", 42, t, ct);
            assert_eq!(got, e.header_map("h"));
        }
    }

    #[test]
    fn a_message_becomes_a_binary_mode_post() {
        let e = CloudEvent::for_message(
            "gw1",
            "dev 7",
            "sensors/7/temp",
            "0-42-1700000000".into(),
            UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            &content_type(None, br#"[{"n":"t","v":21.5}]"#),
        );
        let map = e.header_map("127.0.0.1:8080");
        let got: Vec<(String, String)> = map
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        let want = [
            ("host", "127.0.0.1:8080"),
            ("ce-specversion", "1.0"),
            ("ce-id", "0-42-1700000000"),
            ("ce-source", "sluice://gw1/dev%207"),
            ("ce-type", "io.sluice.message"),
            ("ce-subject", "sensors/7/temp"),
            ("ce-time", "2023-11-14T22:13:20.000Z"),
            ("content-type", "application/senml+json"),
        ];
        assert_eq!(
            got,
            want.map(|(k, v)| (k.to_owned(), v.to_owned())).to_vec()
        );
        assert_eq!(content_type(Some("text/plain"), b"x"), "text/plain");
        assert_eq!(content_type(None, b"\x00\x01"), "application/octet-stream");
        assert_eq!(
            content_type(Some("bad\r\nX: y"), b"x"),
            "application/octet-stream",
            "no header injection"
        );
    }
}
