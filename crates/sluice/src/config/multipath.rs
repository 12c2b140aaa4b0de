//! `[multipath]`: the links sluice watches for its multipath uplinks.
//!
//! Owns: the config type. Does not own: watching the links (`crate::net::links`), the
//! per-path sessions (`crate::sink::paths`) or the checks across sections
//! (`validate.rs`).

use serde::{Deserialize, Serialize};

/// Network interfaces whose link state sluice follows (netlink). When one comes up again,
/// sluice deletes and re-adds its MPTCP endpoints (so the kernel's path manager re-creates
/// the subflow at once instead of many seconds later) and wakes every per-path session bound
/// to it; when one goes down, those sessions are declared dead at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultipathConfig {
    /// Interfaces to watch, e.g. `["wwan0", "wwan1"]`. The interfaces of every
    /// `[[uplink]] paths` entry (by `interface`, or the one holding its `bind` address) are
    /// watched too. Empty and no paths: no watcher thread.
    pub interfaces: Vec<String>,
    /// On link up, delete and re-add the MPTCP endpoints (`ip mptcp endpoint`) whose device
    /// or address is on that interface. Needs CAP_NET_ADMIN; a failure is logged.
    pub refresh_endpoints: bool,
}

impl Default for MultipathConfig {
    fn default() -> Self {
        MultipathConfig {
            interfaces: Vec::new(),
            refresh_endpoints: true,
        }
    }
}
