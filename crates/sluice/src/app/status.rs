//! What the admin endpoint shows: /metrics and /api/v1/status of a running gateway.
//!
//! Owns: [`GatewayStatus`] (the metrics and tables the threads share with the admin endpoint)
//! and how they are rendered. Does not own: the admin HTTP server (`crate::admin`), or what
//! each metric means (their owners' modules).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::admin::AdminSource;
use crate::control::ControlMetrics;
use crate::shard::metrics::ShardMetrics;
use crate::telemetry::metrics::{Gauge, PromWriter};

/// What the admin endpoint shows.
pub(super) struct GatewayStatus {
    /// `[gateway] name` or the host name.
    pub(super) name: String,
    pub(super) started: Instant,
    /// Which devices are connected on which shard (`/api/v1/devices`).
    pub(super) device_table: crate::control::registry::DeviceTable,
    /// Every sink (uplink or function sink) by stable id, with its `[shard]` lane and spool
    /// counters and its `install_tc` status (`uplinks.rs`, ADR 0013).
    pub(super) uplinks: Arc<super::uplinks::UplinkTable>,
    pub(super) shard_metrics: Vec<Arc<ShardMetrics>>,
    pub(super) devices_per_shard: Arc<Vec<Gauge>>,
    pub(super) control: Arc<ControlMetrics>,
    /// Spools of former shard indexes being drained (counted in the `spool` totals only).
    pub(super) former_spool_metrics: Vec<Arc<crate::sink::spool::SpoolMetrics>>,
    pub(super) spool_dir: Option<std::path::PathBuf>,
    pub(super) spool_ack: crate::config::SpoolAck,
    /// Per shard: the CoAP proxy's upstream connections.
    pub(super) proxy_metrics: Vec<Arc<crate::proxy::ProxyMetrics>>,
    pub(super) coap_addr: Option<SocketAddr>,
    /// Per shard.
    pub(super) coap_metrics: Vec<Arc<crate::edge::coap::CoapMetrics>>,
    pub(super) coap_dtls_addr: Option<SocketAddr>,
    /// Per shard (empty without `[coap.dtls]`): the DTLS listener's counters, and the CoAP
    /// counters of the requests that came over it.
    pub(super) coap_dtls_metrics: Vec<(
        Arc<crate::edge::coap::dtls::DtlsMetrics>,
        Arc<crate::edge::coap::CoapMetrics>,
    )>,
    /// `[mqtt] mptcp`: whether the device listener is an MPTCP one (`None`: not asked).
    pub(super) mqtt_mptcp: Option<bool>,
    /// The watched links (`None`: no watcher).
    pub(super) links: Option<Arc<crate::net::links::LinkMetrics>>,
    /// The PHD agent table (`None` without `[phd] listen`).
    pub(super) phd: Option<Arc<crate::control::phd::PhdRoom>>,
    /// Every `[[function]]`.
    /// Every function and its runtime (a reload adds and removes them).
    pub(super) functions: Arc<crate::functions::live::FunctionSet>,
    /// Reloads (`SIGHUP`, `POST /api/v1/reload`): what they do and how many there were
    /// (`reload.rs`).
    pub(super) reloads: Arc<super::reload::Reloader>,
    /// The previous tick's totals, for the overview's rates (`overview.rs`).
    pub(super) overview: super::overview::OverviewState,
}

impl GatewayStatus {
    /// The gateway-wide `spool` object of /api/v1/status (`null` without a spool).
    fn spool_summary(&self) -> serde_json::Value {
        let Some(dir) = &self.spool_dir else {
            return serde_json::Value::Null;
        };
        let uplinks = self.uplinks.load();
        let all = uplinks
            .iter()
            .flat_map(|u| &u.spools)
            .chain(&self.former_spool_metrics);
        let (mut bytes, mut unacked, mut backlog, mut dropped, mut appended, mut acked) =
            (0i64, 0i64, 0i64, 0u64, 0u64, 0u64);
        // The first stalled spool's reason (every spool of a gateway usually shares one disk).
        let mut stalled: Option<&str> = None;
        for m in all {
            stalled = stalled.or(m.stalled_name());
            bytes += m.bytes.get();
            unacked += m.unacked_records.get();
            backlog += m.backlog_records.get();
            dropped += m.dropped_oldest.get();
            appended += m.records_appended.get();
            acked += m.records_acked.get();
        }
        serde_json::json!({
            "dir": dir.display().to_string(),
            "ack": match self.spool_ack {
                crate::config::SpoolAck::Spool => "spool",
                crate::config::SpoolAck::Cloud => "cloud",
            },
            "bytes": bytes,
            "unacked_records": unacked,
            "backlog_records": backlog,
            "records_appended": appended,
            "records_acked": acked,
            "dropped_oldest": dropped,
            "former_shard_spools": self.former_spool_metrics.len(),
            "stalled": stalled,
        })
    }
}

impl AdminSource for GatewayStatus {
    fn render_metrics(&self, w: &mut PromWriter) {
        self.control.render(w);
        self.reloads.render(w);
        crate::functions::metrics::render(w, &self.functions.handles());
        for (i, m) in self.shard_metrics.iter().enumerate() {
            m.render(w, &i.to_string());
        }
        let uplinks = self.uplinks.load();
        for lifecycle in [
            super::uplinks::EntryState::Attaching,
            super::uplinks::EntryState::Running,
            super::uplinks::EntryState::Draining,
            super::uplinks::EntryState::Removed,
        ] {
            w.gauge(
                "sluice_uplinks",
                "Uplinks and function sinks by lifecycle: attaching (added by a reload, not on every shard yet), running, draining (removed by a reload, sending what it holds), removed (kept for its last counts).",
                &[("lifecycle", lifecycle.as_str())],
                uplinks.iter().filter(|u| u.state() == lifecycle).count() as i64,
            );
        }
        // Shard-major, as before the table: each family's lines are grouped by the writer.
        for i in 0..self.shard_metrics.len() {
            for u in uplinks.iter() {
                if let Some(lanes) = u.lanes.get(i) {
                    for (lane, m) in lanes.iter() {
                        m.render(w, &i.to_string(), &u.name, lane.as_str());
                    }
                }
            }
        }
        for i in 0..self.shard_metrics.len() {
            for u in uplinks.iter() {
                if let Some(m) = u.spools.get(i) {
                    m.render(w, &i.to_string(), &u.name);
                }
            }
        }
        crate::admin::coap_proxy::render_proxy_metrics(w, &self.proxy_metrics);
        if let Some(links) = &self.links {
            links.render(w);
        }
        if let Some(phd) = &self.phd {
            phd.metrics.render(w);
        }
        if self.coap_addr.is_some() {
            for (i, m) in self.coap_metrics.iter().enumerate() {
                m.render(w, &i.to_string());
            }
        }
        for (i, (dtls, coap)) in self.coap_dtls_metrics.iter().enumerate() {
            let shard = i.to_string();
            coap.render_labeled(w, &[("shard", &shard), ("transport", "dtls")]);
            dtls.render(w, &shard);
        }
    }

    fn overview(&self) -> serde_json::Value {
        self.overview_doc()
    }

    fn devices(&self, after: Option<&str>, limit: usize) -> Option<serde_json::Value> {
        let page = self.device_table.page(after, limit);
        let now = std::time::SystemTime::now();
        let devices: Vec<serde_json::Value> = page
            .devices
            .iter()
            .map(|(id, held)| {
                serde_json::json!({
                    "client_id": &**id,
                    "shard": held.shard,
                    "connected_seconds": now.duration_since(held.since).map_or(0, |d| d.as_secs()),
                })
            })
            .collect();
        Some(serde_json::json!({
            "gateway": self.name,
            "total": page.total,
            "devices": devices,
            "next": page.next.as_deref(),
        }))
    }

    fn reload(&self) -> Option<(hyper::StatusCode, serde_json::Value)> {
        let outcome = self.reloads.reload(super::reload::ReloadTrigger::Api);
        let status = match outcome {
            super::ReloadOutcome::Done { .. } => hyper::StatusCode::OK,
            super::ReloadOutcome::Invalid(_) => hyper::StatusCode::UNPROCESSABLE_ENTITY,
        };
        Some((status, outcome.to_json()))
    }

    fn status(&self) -> serde_json::Value {
        let table = self.uplinks.load();
        let shards: Vec<serde_json::Value> = self
            .shard_metrics
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let uplinks: Vec<serde_json::Value> = table
                    .iter()
                    .filter_map(|u| Some((u, u.lanes.get(i)?)))
                    .map(|(entry, lanes)| {
                        let lane_status: serde_json::Map<String, serde_json::Value> = lanes
                            .iter()
                            .map(|(lane, m)| {
                                (
                                    lane.as_str().to_string(),
                                    serde_json::json!({
                                        "state": m.state(),
                                        // The cluster node (`urls`) the session is on.
                                        "node": (m.uplink_state() == crate::sink::UplinkState::Connected)
                                            .then(|| m.node())
                                            .flatten(),
                                        "failovers": m.failovers.get(),
                                        "queued": m.queue_messages.get(),
                                        "inflight": m.inflight.get(),
                                        "packs_sent": m.packs_sent.get(),
                                        "socket": m.socket_marks(),
                                        "mptcp": m.mptcp.status(),
                                        "paths": m.paths.status(),
                                        "returned": m.messages_returned.get(),
                                    }),
                                )
                            })
                            .collect();
                        serde_json::json!({
                            "name": entry.name,
                            "id": entry.id.0,
                            "lifecycle": entry.state().as_str(),
                            "state": lanes.normal.state(),
                            "lanes": lane_status,
                        })
                    })
                    .collect();
                let spools: Vec<serde_json::Value> = table
                    .iter()
                    .filter_map(|u| Some((&u.name, u.spools.get(i)?)))
                    .map(|(name, m)| {
                        let mut v = m.status();
                        v["uplink"] = serde_json::json!(name);
                        v
                    })
                    .collect();
                serde_json::json!({
                    "shard": i,
                    "devices": self.devices_per_shard.get(i).map(|g| g.get()).unwrap_or(0),
                    "connections": m.connections.get(),
                    "sessions": m.sessions.get(),
                    "coap_devices": self.coap_metrics.get(i).map(|c| c.devices.get()).unwrap_or(0),
                    "coap_observers": m.coap_observe.observers.get(),
                    "uplinks": uplinks,
                    "spools": spools,
                })
            })
            .collect();
        serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "gateway": self.name,
            "uptime_seconds": self.started.elapsed().as_secs(),
            "devices": self.control.devices_connected.get(),
            "spool": self.spool_summary(),
            "mqtt": { "mptcp": self.mqtt_mptcp },
            "links": self.links.as_ref().map(|l| l.status()),
            "phd": self.phd.as_ref().map(|p| p.status(crate::control::phd::STATUS_AGENTS)),
            "functions": self.functions.status(),
            "coap": match self.coap_addr {
                None => serde_json::Value::Null,
                Some(addr) => serde_json::json!({
                    "listen": addr.to_string(),
                    "devices": self.coap_metrics.iter().map(|c| c.devices.get()).sum::<i64>(),
                    "observers": self.shard_metrics.iter().map(|m| m.coap_observe.observers.get()).sum::<i64>(),
                    "dtls": self.coap_dtls_addr.map(|addr| serde_json::json!({
                        "listen": addr.to_string(),
                        "sessions": self.coap_dtls_metrics.iter().map(|(d, _)| d.sessions.get()).sum::<i64>(),
                        "handshaking": self.coap_dtls_metrics.iter().map(|(d, _)| d.handshaking.get()).sum::<i64>(),
                        "devices": self.coap_dtls_metrics.iter().map(|(_, c)| c.devices.get()).sum::<i64>(),
                    })),
                }),
            },
            "shards": shards,
            "coap_proxy": crate::admin::coap_proxy::proxy_status(&self.proxy_metrics),
            "traffic_control": table
                .iter()
                .map(|u| serde_json::json!({ "uplink": u.name, "tc": u.tc }))
                .collect::<Vec<_>>(),
        })
    }
}
