//! Checks on multipath settings: `[[uplink]] paths`, `lane_path`, the path timers, and
//! `[multipath] interfaces`.
//!
//! Owns: these rules and their wording. Does not own: the other uplink rules.

use std::collections::HashSet;
use std::time::Duration;

use super::{check_label, invalid};
use crate::config::{Config, ConfigError, UplinkConfig};

/// Linux's IFNAMSIZ less the NUL.
const MAX_IFNAME: usize = 15;

/// Every uplink's paths (names unique labels, a `bind` or an `interface` each, weights
/// 1..=100, no duplicate bind/interface pair), `lane_path` naming one of them, the path
/// timers, and the watched interface names.
pub(in crate::config) fn check_multipath(config: &Config) -> Result<(), ConfigError> {
    for (i, u) in config.uplink.iter().enumerate() {
        check_paths(i, u)?;
    }
    for (j, name) in config.multipath.interfaces.iter().enumerate() {
        check_ifname(&format!("multipath.interfaces[{j}]"), name)?;
    }
    Ok(())
}

fn check_ifname(key: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty()
        || name.len() > MAX_IFNAME
        || name.contains(|c: char| c == '/' || c.is_whitespace() || c.is_control())
    {
        return invalid(
            key,
            &format!("{name:?} is not an interface name (1 to {MAX_IFNAME} characters, no '/' or spaces)"),
        );
    }
    Ok(())
}

fn check_paths(i: usize, u: &UplinkConfig) -> Result<(), ConfigError> {
    let key = |field: &str| format!("uplink[{i}].{field}");
    if u.paths.is_empty() {
        if u.lane_path.is_some() {
            return invalid(&key("lane_path"), "needs paths to pin the high lane to");
        }
        return Ok(());
    }
    let names = check_path_list(&key("paths"), &u.paths, "uplink")?;
    if let Some(lane) = &u.lane_path {
        if !names.contains(lane) {
            return invalid(
                &key("lane_path"),
                &format!("{lane:?} names no path of this uplink"),
            );
        }
    }
    if u.path_timeout < Duration::from_millis(100) {
        return invalid(&key("path_timeout"), "must be at least 100ms");
    }
    if u.path_keep_alive.is_zero() || u.path_keep_alive >= u.path_timeout {
        return invalid(
            &key("path_keep_alive"),
            "must be more than 0s and less than path_timeout, so an idle dead path is noticed in time",
        );
    }
    if u.path_reconnect_max < u.reconnect_min {
        return invalid(&key("path_reconnect_max"), "is less than reconnect_min");
    }
    Ok(())
}

/// A list of paths (`[[uplink]] paths`, `[[coap.proxy]] paths`) at `key`: at most 16, names
/// unique labels, a `bind` or an `interface` each, weights 1..=100, no duplicate
/// bind/interface pair. Returns the names. `owner` words the messages ("uplink", "proxy").
pub(in crate::config) fn check_path_list(
    key: &str,
    paths: &[crate::config::PathConfig],
    owner: &str,
) -> Result<HashSet<String>, ConfigError> {
    if paths.len() > 16 {
        return Err(invalid_err(key, &format!("at most 16 paths per {owner}")));
    }
    let mut names = HashSet::new();
    let mut places = HashSet::new();
    for (j, p) in paths.iter().enumerate() {
        let pkey = |field: &str| format!("{key}[{j}].{field}");
        let label = p.label(j);
        check_label(&pkey("name"), &label)?;
        if !names.insert(label.clone()) {
            return Err(invalid_err(
                &pkey("name"),
                &format!("duplicate path name {label:?}; names must be unique within the {owner}"),
            ));
        }
        if p.bind.is_none() && p.interface.is_none() {
            return Err(invalid_err(
                &format!("{key}[{j}]"),
                "a path needs bind (a local address) or interface (a device name), or both",
            ));
        }
        if let Some(ifname) = &p.interface {
            check_ifname(&pkey("interface"), ifname)?;
        }
        if !(1..=100).contains(&p.weight) {
            return Err(invalid_err(&pkey("weight"), "must be from 1 to 100"));
        }
        if !places.insert((p.bind, p.interface.clone())) {
            return Err(invalid_err(
                &format!("{key}[{j}]"),
                &format!("another path of this {owner} has the same bind and interface"),
            ));
        }
    }
    Ok(names)
}

fn invalid_err(key: &str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.to_string(),
    }
}
