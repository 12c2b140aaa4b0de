//! The CoAP proxy's part of `/metrics` and `/api/v1/status`: every shard's upstream
//! connections (`crate::proxy::ProxyMetrics`).
//!
//! Owns: how the per-shard proxy numbers are laid out for the admin endpoint. Does not own:
//! counting them (`crate::proxy`) or serving them (`admin/mod.rs`).

use std::sync::Arc;

use crate::proxy::ProxyMetrics;
use crate::telemetry::metrics::PromWriter;

/// Render every shard's proxy series (labels `shard`, `upstream`).
pub fn render_proxy_metrics(w: &mut PromWriter, shards: &[Arc<ProxyMetrics>]) {
    for (i, m) in shards.iter().enumerate() {
        m.render(w, i);
    }
}

/// The `coap_proxy` array of /api/v1/status: one entry per shard and upstream, with the
/// connection state; empty without `[[coap.proxy]]`.
pub fn proxy_status(shards: &[Arc<ProxyMetrics>]) -> serde_json::Value {
    serde_json::Value::Array(
        shards
            .iter()
            .enumerate()
            .flat_map(|(i, m)| m.status(i))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_render_per_shard_and_show_in_status() {
        let config = crate::config::parse_unchecked_files(
            "[[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://10.0.0.1\"\nprefix = \"c\"\n",
        )
        .unwrap();
        let shards: Vec<Arc<ProxyMetrics>> = (0..2)
            .map(|_| Arc::new(ProxyMetrics::new(&config)))
            .collect();
        let up = &shards[1].upstreams[0].1;
        up.state.set(crate::proxy::metrics::CONNECTED);
        up.responses[2].inc();
        up.latency.observe(std::time::Duration::from_millis(3));
        let mut w = PromWriter::new();
        render_proxy_metrics(&mut w, &shards);
        let text = w.finish();
        assert!(
            text.contains(
                "sluice_coap_proxy_responses_total{shard=\"1\",upstream=\"cloud\",class=\"2xx\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains(
            "sluice_coap_proxy_upstream_latency_seconds_count{shard=\"1\",upstream=\"cloud\"} 1"
        ), "{text}");
        let status = proxy_status(&shards);
        assert_eq!(status[0]["state"], "disconnected");
        assert_eq!(status[1]["state"], "connected");
        assert_eq!(status[1]["upstream"], "cloud");
    }
}
