//! Fuzz target for the topic-filter trie (crates/sluice/src/shard/trie.rs) against the
//! reference matcher `sluice_proto::mqtt::topic::matches` (the spec's rule, one filter at a
//! time).
//!
//! The input is lines of operations: `i<filter>` inserts a filter (with a fresh value),
//! `r<filter>` removes every value under it, `m<topic>` matches a topic; other lines, and
//! filters or topics the protocol rejects, are skipped. After every insert the filter's own
//! "instance" (each `+` → `x`, a final `#` → `x/y`) is matched too, so matches happen without
//! the fuzzer guessing both halves. Checks, besides "no panic" (and no stack overflow, however
//! many levels): every match returns exactly the values of the live filters the reference
//! matcher says match, each once; `remove_where` removes exactly the live values of that
//! filter; `len()` follows the model; and the trie is dropped with whatever is left in it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::shard::trie::TopicTrie;
use sluice_proto::mqtt::topic::{matches, valid_topic_filter, valid_topic_name};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut trie = TopicTrie::new();
    let mut live: Vec<(String, u32)> = Vec::new();
    let mut next = 0u32;
    for line in text.split('\n') {
        let Some(op) = line.chars().next() else {
            continue;
        };
        let arg = &line[op.len_utf8()..];
        match op {
            'i' if valid_topic_filter(arg) => {
                trie.insert(arg, next);
                live.push((arg.to_string(), next));
                next += 1;
                check_match(&trie, &live, &instance(arg));
            }
            'r' if valid_topic_filter(arg) => {
                let removed = trie.remove_where(arg, |_| true);
                let before = live.len();
                live.retain(|(f, _)| f != arg);
                assert_eq!(removed, before - live.len(), "removed count for {arg:?}");
            }
            'm' => check_match(&trie, &live, arg),
            _ => {}
        }
        assert_eq!(trie.len(), live.len(), "len after {line:?}");
    }
});

/// A topic name the filter matches: each `+` level becomes `x`, a final `#` becomes `x/y`.
fn instance(filter: &str) -> String {
    filter
        .split('/')
        .map(|level| match level {
            "+" => "x",
            "#" => "x/y",
            other => other,
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn check_match(trie: &TopicTrie<u32>, live: &[(String, u32)], topic: &str) {
    if !valid_topic_name(topic) {
        return;
    }
    let mut got = Vec::new();
    trie.for_each_match(topic, |v| got.push(*v));
    got.sort_unstable();
    let mut want: Vec<u32> = live
        .iter()
        .filter(|(f, _)| matches(f, topic))
        .map(|(_, v)| *v)
        .collect();
    want.sort_unstable();
    assert_eq!(got, want, "matches for {topic:?}");
}
