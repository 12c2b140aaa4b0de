//! Topic names and filters (MQTT §4.7). (Implementation in progress.)

/// A topic name a client may publish to: non-empty, no wildcards, no NUL, ≤ 65535 bytes.
pub fn valid_topic_name(topic: &str) -> bool {
    let _ = topic;
    todo!()
}

/// A topic filter a client may subscribe to: `+` fills a whole level, `#` only last and whole.
pub fn valid_topic_filter(filter: &str) -> bool {
    let _ = filter;
    todo!()
}

/// Whether `filter` matches `topic`. Wildcards at the first level do not match topics that
/// begin with `$` (§4.7.2).
pub fn matches(filter: &str, topic: &str) -> bool {
    let _ = (filter, topic);
    todo!()
}
