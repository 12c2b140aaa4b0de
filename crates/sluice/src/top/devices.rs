//! `sluice status --devices`: which gateway holds which device, across one or several
//! gateways' admin endpoints (`GET /api/v1/devices`, paged by client id).
//!
//! Owns: fetching every page from each gateway and the merged table (one row per device and
//! gateway, in client id order; a device two gateways both list — an old connection not yet
//! timed out beside its new one — is marked). Does not own: the HTTP client ([`Target`]).

use std::fmt::Write as _;

use serde_json::Value;

use super::{uptime, StatusError, Target};

/// Devices asked for per request.
pub const PAGE: usize = 10_000;

/// One gateway's devices: its name and `(client id, shard, seconds connected)`.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayDevices {
    pub gateway: String,
    pub devices: Vec<(String, u64, u64)>,
}

/// Every device `target` holds, page by page.
pub fn fetch(target: &Target) -> Result<GatewayDevices, StatusError> {
    let mut out = GatewayDevices {
        gateway: String::new(),
        devices: Vec::new(),
    };
    let mut after: Option<String> = None;
    loop {
        let doc = target.devices_page(after.as_deref(), PAGE)?;
        let page = from_page(&doc);
        out.gateway = page.gateway;
        out.devices.extend(page.devices);
        match doc["next"].as_str() {
            // A next that does not advance would loop for ever: stop there.
            Some(n) if after.as_deref() != Some(n) => after = Some(n.to_string()),
            _ => return Ok(out),
        }
    }
}

/// The merged table: a row per device and gateway, then a line per gateway.
pub fn render(all: &[GatewayDevices]) -> String {
    let mut rows: Vec<(&str, &str, u64, u64)> = all
        .iter()
        .flat_map(|g| {
            g.devices
                .iter()
                .map(move |(id, shard, secs)| (id.as_str(), g.gateway.as_str(), *shard, *secs))
        })
        .collect();
    rows.sort_by(|a, b| a.0.cmp(b.0).then(a.1.cmp(b.1)));
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(6);
    let gw_width = all
        .iter()
        .map(|g| g.gateway.len())
        .max()
        .unwrap_or(0)
        .max(7);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:width$}  {:gw_width$}  SHARD  CONNECTED",
        "DEVICE", "GATEWAY"
    );
    for (i, (id, gw, shard, secs)) in rows.iter().enumerate() {
        let twice = (i > 0 && rows[i - 1].0 == *id) || rows.get(i + 1).is_some_and(|r| r.0 == *id);
        let _ = writeln!(
            o,
            "{id:width$}  {gw:gw_width$}  {shard:>5}  {}{}",
            uptime(*secs),
            if twice { "  (on two gateways)" } else { "" }
        );
    }
    let total: usize = all.iter().map(|g| g.devices.len()).sum();
    let per: Vec<String> = all
        .iter()
        .map(|g| format!("{} {}", g.gateway, g.devices.len()))
        .collect();
    let _ = writeln!(
        o,
        "\n{total} device{} on {} gateway{}: {}",
        if total == 1 { "" } else { "s" },
        all.len(),
        if all.len() == 1 { "" } else { "s" },
        per.join(", ")
    );
    o
}

/// Percent-encode a client id for the `after` query parameter.
pub fn encode(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            o.push(b as char);
        } else {
            let _ = write!(o, "%{b:02X}");
        }
    }
    o
}

/// `doc` as one gateway's devices (for tests and callers holding a parsed page).
pub fn from_page(doc: &Value) -> GatewayDevices {
    GatewayDevices {
        gateway: doc["gateway"].as_str().unwrap_or("?").to_string(),
        devices: doc["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| {
                (
                    d["client_id"].as_str().unwrap_or("").to_string(),
                    d["shard"].as_u64().unwrap_or(0),
                    d["connected_seconds"].as_u64().unwrap_or(0),
                )
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_merges_gateways_in_client_id_order_and_marks_a_device_on_two() {
        let a = from_page(&serde_json::json!({
            "gateway": "gw-a", "total": 2, "next": null,
            "devices": [
                {"client_id": "dev-2", "shard": 0, "connected_seconds": 5},
                {"client_id": "dev-9", "shard": 1, "connected_seconds": 65},
            ]
        }));
        let b = from_page(&serde_json::json!({
            "gateway": "gw-b", "total": 1, "next": null,
            "devices": [{"client_id": "dev-2", "shard": 0, "connected_seconds": 1}]
        }));
        let text = render(&[a, b]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("DEVICE"), "{text}");
        assert!(
            lines[1].starts_with("dev-2   gw-a") && lines[1].ends_with("(on two gateways)"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("dev-2   gw-b") && lines[2].ends_with("(on two gateways)"),
            "{text}"
        );
        assert!(
            lines[3].starts_with("dev-9   gw-a") && !lines[3].contains("two"),
            "{text}"
        );
        assert!(
            text.contains("3 devices on 2 gateways: gw-a 2, gw-b 1"),
            "{text}"
        );
    }

    #[test]
    fn client_ids_are_percent_encoded_for_after() {
        assert_eq!(encode("dev-1"), "dev-1");
        assert_eq!(encode("a b/ü&"), "a%20b%2F%C3%BC%26");
    }
}
