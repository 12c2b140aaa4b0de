//! Link state of network interfaces (netlink RTMGRP_LINK / IPv4 and IPv6 addresses), shared
//! with the per-path sessions, and the MPTCP endpoint refresh on link up. SKELETON: filled in
//! by issue 17's link work.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

/// One interface as last reported by the kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkState {
    /// IFF_UP and IFF_LOWER_UP (the carrier) are both set.
    pub up: bool,
    /// [`LinkTable::generation`] when `up` last changed.
    pub changed: u64,
    /// Its addresses.
    pub addrs: Vec<IpAddr>,
}

/// Every watched interface, by name.
#[derive(Debug, Clone, Default)]
pub struct LinkTable {
    /// Bumped at every change.
    pub generation: u64,
    pub links: HashMap<String, LinkState>,
}

impl LinkTable {
    /// The interface named `name`, or the one holding address `ip`.
    pub fn find(&self, name: Option<&str>, ip: Option<IpAddr>) -> Option<(&str, &LinkState)> {
        if let Some(name) = name {
            return self.links.get_key_value(name).map(|(k, v)| (k.as_str(), v));
        }
        let ip = ip?;
        self.links
            .iter()
            .find(|(_, l)| l.addrs.contains(&ip))
            .map(|(k, v)| (k.as_str(), v))
    }
}

/// What a per-path session watches: the table, replaced at every change.
pub type LinkWatch = tokio::sync::watch::Receiver<Arc<LinkTable>>;
