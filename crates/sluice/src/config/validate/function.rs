//! Checks on `[[function]]`.
//!
//! Owns: these rules and their wording.

use std::collections::HashSet;
use std::time::Duration;

use sluice_proto::mqtt::topic::valid_topic_filter;

use super::{check_label, invalid, Files};
use crate::config::{Config, ConfigError, Prewarm, SocketMode};

/// Placeholders `reply_topic` may use.
const REPLY_PLACEHOLDERS: [&str; 3] = ["{topic}", "{device}", "{function}"];

/// Unique names that are labels; topics that are filters; exactly one of `command` and
/// `url`; bounds of at least 1; non-zero timers; a reply topic that is a topic name once its
/// placeholders are filled; options that only a local function has are not set on a remote
/// one.
pub(in crate::config) fn check_functions(config: &Config, files: Files) -> Result<(), ConfigError> {
    let mut names = HashSet::new();
    for (i, f) in config.function.iter().enumerate() {
        let key = |field: &str| format!("function[{i}].{field}");
        check_label(&key("name"), &f.name)?;
        if !names.insert(f.name.as_str()) {
            return invalid(
                &key("name"),
                &format!("duplicate function name {:?}; names must be unique", f.name),
            );
        }
        if f.topics.is_empty() {
            return invalid(
                &key("topics"),
                "must list at least one MQTT topic filter, e.g. [\"sensors/+/temp\"]",
            );
        }
        for (j, t) in f.topics.iter().enumerate() {
            if !valid_topic_filter(t) {
                return invalid(
                    &format!("function[{i}].topics[{j}]"),
                    &format!("{t:?} is not a valid MQTT topic filter"),
                );
            }
        }
        match (&f.command, &f.url) {
            (Some(_), Some(_)) => {
                return invalid(
                    &key("url"),
                    "set either command (a local function) or url (a remote one), not both",
                )
            }
            (None, None) => {
                return invalid(
                    &key("command"),
                    "set command (a local function, e.g. [\"python3\", \"fn.py\"]) or url (a remote one, e.g. \"http://fn.default.example\")",
                )
            }
            (Some(cmd), None) => {
                if cmd.first().is_none_or(|p| p.trim().is_empty()) {
                    return invalid(&key("command"), "must name a program, e.g. [\"python3\", \"fn.py\"]");
                }
                if files == Files::MustExist {
                    if let Some(dir) = &f.dir {
                        if !dir.is_dir() {
                            return invalid(
                                &key("dir"),
                                &format!("{} is not a directory", dir.display()),
                            );
                        }
                    }
                }
            }
            (None, Some(url)) => {
                if let Err(why) = crate::config::parse_remote_url(url) {
                    return invalid(&key("url"), &format!("{url:?}: {why}"));
                }
                for (field, set) in [
                    ("dir", f.dir.is_some()),
                    ("env", !f.env.is_empty()),
                    ("socket", f.socket != SocketMode::default()),
                    ("min_instances", f.min_instances != 0),
                    ("prewarm", f.prewarm != Prewarm::Off),
                ] {
                    if set {
                        return invalid(
                            &key(field),
                            "applies to local functions (command) only; a remote function scales itself",
                        );
                    }
                }
            }
        }
        for (field, v) in [
            ("concurrency", f.concurrency),
            ("max_instances", f.max_instances),
        ] {
            if v == 0 {
                return invalid(&key(field), "must be at least 1");
            }
        }
        if f.concurrency > 4096 {
            return invalid(&key("concurrency"), "must be at most 4096");
        }
        if f.max_instances > 256 {
            return invalid(&key("max_instances"), "must be at most 256");
        }
        if f.min_instances > f.max_instances {
            return invalid(
                &key("min_instances"),
                &format!("must not exceed max_instances ({})", f.max_instances),
            );
        }
        for (field, d) in [
            ("idle", f.idle),
            ("timeout", f.timeout),
            ("start_timeout", f.start_timeout),
            ("retry_min", f.retry_min),
            ("retry_max", f.retry_max),
        ] {
            if d < Duration::from_millis(1) {
                return invalid(&key(field), "must be at least 1ms");
            }
        }
        if f.retry_min > f.retry_max {
            return invalid(&key("retry_min"), "must not exceed retry_max");
        }
        if f.retries > 100 {
            return invalid(&key("retries"), "must be at most 100");
        }
        if f.env
            .keys()
            .any(|k| k.is_empty() || k.contains(['=', '\0']))
        {
            return invalid(
                &key("env"),
                "variable names must be non-empty, without '=' or NUL",
            );
        }
        if !f.reply_topic.is_empty() {
            let mut filled = f.reply_topic.clone();
            for p in REPLY_PLACEHOLDERS {
                filled = filled.replace(p, "x");
            }
            if filled.contains(['{', '}']) {
                return invalid(
                    &key("reply_topic"),
                    "may use only the placeholders {topic}, {device} and {function}",
                );
            }
            if filled.contains(['#', '+', '\0']) || filled.starts_with('$') {
                return invalid(
                    &key("reply_topic"),
                    "must be a topic name: no wildcards, no leading '$'",
                );
            }
        }
    }
    Ok(())
}
