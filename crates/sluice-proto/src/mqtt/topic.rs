//! Topic names and topic filters (MQTT 3.1.1 and 5.0 §4.7).
//!
//! Owns: validity of names and filters and matching one against the other, and splitting a
//! shared subscription (`$share/{ShareName}/{filter}`, MQTT 5 §4.8.2) into its parts; the
//! session matches topics against the filter part. Does not own topic aliases.
//!
//! Rules: levels are separated by `/` and may be empty. A topic name is non-empty, at most
//! 65535 bytes, and has no `+`, `#` or U+0000. A filter is the same except that `+` may fill a
//! whole level anywhere and `#` may fill a whole level only as the last one. `#` also matches
//! the parent level (`sport/#` matches `sport`); `+` matches exactly one level, which may be
//! empty. Topics starting with `$` are not matched by a filter whose first level is a wildcard.
//!
//! The protocol allows up to 32,768 levels (65,535 bytes) in a name and 65,536 in a filter;
//! a server caps both lower as policy (sluice: `mqtt.max_topic_levels`/`max_topic_length`),
//! using [`levels()`].
//!
//! Invariants: nothing here allocates, panics or recurses; every function is linear in its
//! input ([`matches()`] in the shorter one). [`matches()`] assumes a valid filter and name; on
//! invalid input it returns some answer.

/// Longest topic name or filter: a UTF-8 string's length prefix is a `u16`.
const MAX_LEN: usize = u16::MAX as usize;

/// A topic name a client may publish to: non-empty, no wildcards, no NUL, ≤ 65535 bytes.
pub fn valid_topic_name(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= MAX_LEN
        && !topic.bytes().any(|b| matches!(b, b'+' | b'#' | 0))
}

/// A topic filter a client may subscribe to: `+` fills a whole level, `#` only last and whole.
pub fn valid_topic_filter(filter: &str) -> bool {
    if filter.is_empty() || filter.len() > MAX_LEN {
        return false;
    }
    let mut levels = filter.split('/').peekable();
    while let Some(level) = levels.next() {
        let is_last = levels.peek().is_none();
        let valid = match level {
            "+" => true,
            "#" => is_last,
            _ => !level.bytes().any(|b| matches!(b, b'+' | b'#' | 0)),
        };
        if !valid {
            return false;
        }
    }
    true
}

/// The number of levels in a topic name or filter: one more than its `/` separators.
pub fn levels(topic: &str) -> usize {
    topic.bytes().filter(|&b| b == b'/').count() + 1
}

/// The share name and topic filter of a shared subscription `$share/{ShareName}/{filter}`,
/// or `None` if `filter` is not one. The caller checks `valid_shared_subscription` first.
pub fn shared_subscription(filter: &str) -> Option<(&str, &str)> {
    let rest = filter.strip_prefix("$share/")?;
    let (group, inner) = rest.split_once('/')?;
    Some((group, inner))
}

/// A valid shared subscription: a non-empty share name without `/`, `+`, `#` or U+0000, and a
/// valid topic filter after it.
pub fn valid_shared_subscription(filter: &str) -> bool {
    match shared_subscription(filter) {
        Some((group, inner)) => {
            !group.is_empty()
                && !group.bytes().any(|b| matches!(b, b'+' | b'#' | 0))
                && valid_topic_filter(inner)
        }
        None => false,
    }
}

/// Whether `filter` matches `topic`. Wildcards at the first level do not match topics that
/// begin with `$` (§4.7.2).
pub fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && matches!(filter.as_bytes().first(), Some(b'+' | b'#')) {
        return false;
    }
    let mut filter_levels = filter.split('/');
    let mut topic_levels = topic.split('/');
    loop {
        match (filter_levels.next(), topic_levels.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(f), Some(t)) if f == t => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}
