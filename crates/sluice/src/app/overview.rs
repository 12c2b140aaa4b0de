//! The overview document of a running gateway: what the dashboard, `sluice status` and
//! `/api/v1/overview` show, with rates.
//!
//! Owns: [`OverviewState`] (the previous tick's totals, from which rates, ack-latency
//! quantiles and the spool's age are derived) and the document's layout (docs/api.md).
//! Does not own: the numbers (their modules' metrics), when it is computed (the admin event
//! hub calls [`GatewayStatus::overview_doc`] once per tick, `admin/events.rs`).
//!
//! Invariants: computed from relaxed atomic loads and two short locks (the PHD agent table
//! to count agents per shard, and this state); nothing per device except the first
//! [`PHD_LISTED`] PHD agents; a rate is the difference of a counter between two ticks divided
//! by the time between them (0 at the first tick or when a counter went back). State is
//! bounded: one number per counter key (fixed by shards × uplinks × lanes × reasons), one
//! histogram per uplink lane, and [`SPOOL_HISTORY`] samples per spool.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::status::GatewayStatus;
use crate::telemetry::metrics::LATENCY_BUCKETS_SECONDS;

/// PHD agents listed in the overview (the count covers all).
pub const PHD_LISTED: usize = 20;
/// Samples of each spool's append counter kept to estimate its oldest record's age (10 min at
/// one tick a second).
pub const SPOOL_HISTORY: usize = 600;

/// What the previous tick left behind.
#[derive(Default)]
pub(super) struct OverviewState {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    last: Option<Instant>,
    counters: HashMap<String, u64>,
    /// Per `uplink/lane`: bucket counts (and overflow), sum (µs), count at the previous tick.
    latency: HashMap<String, (Vec<u64>, u64, u64)>,
    /// (ms since `started`, appended totals of every spool by (uplink id, shard)): keyed, not
    /// positional, so a sink attached or detached by a reload never shifts another's history
    /// (ADR 0013).
    spool_samples: VecDeque<(u64, HashMap<(u32, usize), u64>)>,
}

/// The rate of counters between two ticks.
struct Rates<'a> {
    prev: &'a HashMap<String, u64>,
    next: HashMap<String, u64>,
    dt: f64,
}

impl Rates<'_> {
    /// Records `total` under `key` and returns its rate per second since the previous tick.
    fn rate(&mut self, key: String, total: u64) -> f64 {
        let r = match self.prev.get(&key) {
            Some(&p) if self.dt > 0.0 && total >= p => (total - p) as f64 / self.dt,
            _ => 0.0,
        };
        self.next.insert(key, total);
        round(r)
    }

    /// `{"messages_total", "messages_per_second"[, "bytes_total", "bytes_per_second"]}`.
    fn flow(&mut self, key: &str, messages: u64, bytes: Option<u64>) -> Value {
        let mut v = json!({
            "messages_total": messages,
            "messages_per_second": self.rate(format!("{key}/m"), messages),
        });
        if let Some(b) = bytes {
            v["bytes_total"] = json!(b);
            v["bytes_per_second"] = json!(self.rate(format!("{key}/b"), b));
        }
        v
    }
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Milliseconds of the upper bound of the bucket holding quantile `q` of `deltas` (buckets then
/// overflow); `None` without observations.
fn quantile_ms(deltas: &[u64], q: f64) -> Option<f64> {
    let total: u64 = deltas.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = (q * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, d) in deltas.iter().enumerate() {
        seen += d;
        if seen >= rank {
            return Some(
                LATENCY_BUCKETS_SECONDS
                    .get(i)
                    .map_or(f64::INFINITY, |s| s * 1000.0),
            );
        }
    }
    None
}

impl GatewayStatus {
    /// The overview (see the module docs and docs/api.md). Called once per tick.
    pub(super) fn overview_doc(&self) -> Value {
        let now = Instant::now();
        let mut inner = self
            .overview
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let dt = inner
            .last
            .map_or(0.0, |l| now.saturating_duration_since(l).as_secs_f64());
        inner.last = Some(now);
        let prev = std::mem::take(&mut inner.counters);
        let mut rates = Rates {
            prev: &prev,
            next: HashMap::with_capacity(prev.len()),
            dt,
        };
        let shards = self.shard_metrics.len();

        // Devices, per shard and protocol.
        let phd_per_shard = self
            .phd
            .as_ref()
            .map_or_else(|| vec![0; shards], |p| p.agents_per_shard(shards));
        let shard_rows: Vec<Value> = (0..shards)
            .map(|i| {
                let m = &self.shard_metrics[i];
                json!({
                    "shard": i,
                    "mqtt": m.connections.get(),
                    "sessions": m.sessions.get(),
                    "coap": self.coap_metrics.get(i).map_or(0, |c| c.devices.get()),
                    "coap_dtls": self.coap_dtls_metrics.get(i).map_or(0, |(_, c)| c.devices.get()),
                    "phd": phd_per_shard.get(i).copied().unwrap_or(0),
                })
            })
            .collect();
        let sum = |key: &str| -> i64 {
            shard_rows
                .iter()
                .map(|r| r[key].as_i64().unwrap_or(0))
                .sum()
        };
        let phd_agents = self.phd.as_ref().map_or(0, |p| p.metrics.agents.get());
        let devices = json!({
            "registered": self.control.devices_connected.get(),
            "mqtt": sum("mqtt"),
            "coap": sum("coap"),
            "coap_dtls": sum("coap_dtls"),
            "phd": phd_agents,
        });

        // Device-side traffic.
        let (mut in_msgs, mut in_bytes, mut out_msgs, mut out_bytes) = (0u64, 0u64, 0u64, 0u64);
        for m in &self.shard_metrics {
            in_msgs += m.messages_received.get();
            in_bytes += m.bytes_received.get();
            out_msgs += m.messages_delivered.get();
            out_bytes += m.bytes_sent.get();
        }
        let coap_in: u64 = self
            .coap_metrics
            .iter()
            .map(|c| c.publishes.get())
            .chain(
                self.coap_dtls_metrics
                    .iter()
                    .map(|(_, c)| c.publishes.get()),
            )
            .sum();
        let phd_in = self
            .phd
            .as_ref()
            .map_or(0, |p| p.metrics.observations.get());

        // Uplinks, lanes, paths, latency.
        let mut cloud = (0u64, 0u64, 0u64, 0u64); // sent, bytes, acked, downlink
        let mut lane_totals: Vec<(&'static str, i64, i64, u64)> = Vec::new();
        let mut uplinks = Vec::new();
        let mut worst_p99: Option<f64> = None;
        let (mut all_inflight, mut all_queued) = (0i64, 0i64);
        let table = self.uplinks.load();
        for entry in table.iter() {
            let name = &entry.name;
            let lanes_of: Vec<&crate::sink::LaneMetrics> = entry.lanes.iter().collect();
            let mut lane_rows = Vec::new();
            let lane_kinds: Vec<crate::sink::Lane> = lanes_of
                .first()
                .map(|l| l.iter().map(|(lane, _)| lane).collect())
                .unwrap_or_default();
            let mut uplink_connected = 0;
            for lane in lane_kinds {
                let ms: Vec<&std::sync::Arc<crate::sink::UplinkMetrics>> = lanes_of
                    .iter()
                    .filter_map(|l| l.iter().find(|(k, _)| *k == lane).map(|(_, m)| m))
                    .collect();
                let connected = ms
                    .iter()
                    .filter(|m| m.uplink_state() == crate::sink::UplinkState::Connected)
                    .count();
                let connecting = ms
                    .iter()
                    .filter(|m| m.uplink_state() == crate::sink::UplinkState::Connecting)
                    .count();
                if lane == crate::sink::Lane::Normal {
                    uplink_connected = connected;
                }
                let state = if connected == ms.len() && !ms.is_empty() {
                    "connected"
                } else if connected > 0 {
                    "partly_connected"
                } else if connecting > 0 {
                    "connecting"
                } else {
                    "disconnected"
                };
                let inflight: i64 = ms.iter().map(|m| m.inflight.get()).sum();
                let queued: i64 = ms.iter().map(|m| m.queue_messages.get()).sum();
                let queue_bytes: i64 = ms.iter().map(|m| m.queue_bytes.get()).sum();
                let oldest = ms.iter().filter_map(|m| m.queue_oldest_age()).max();
                let sent: u64 = ms.iter().map(|m| m.messages_sent.get()).sum();
                let bytes: u64 = ms.iter().map(|m| m.bytes_written.get()).sum();
                let acked: u64 = ms.iter().map(|m| m.messages_acked.get()).sum();
                let downlink: u64 = ms.iter().map(|m| m.downlink_messages.get()).sum();
                cloud.0 += sent;
                cloud.1 += bytes;
                cloud.2 += acked;
                cloud.3 += downlink;
                all_inflight += inflight;
                all_queued += queued;
                let key = format!("u/{name}/{}", lane.as_str());
                let sent_rate = rates.rate(format!("{key}/sent"), sent);
                let acked_rate = rates.rate(format!("{key}/acked"), acked);
                let bytes_rate = rates.rate(format!("{key}/bytes"), bytes);
                // Ack latency over the last tick, every shard together.
                let mut buckets = vec![0u64; LATENCY_BUCKETS_SECONDS.len() + 1];
                let (mut lsum, mut lcount) = (0u64, 0u64);
                for m in &ms {
                    let (b, overflow, s, c) = m.ack_latency.snapshot();
                    for (acc, x) in buckets.iter_mut().zip(b.iter().chain([&overflow])) {
                        *acc += x;
                    }
                    lsum += s;
                    lcount += c;
                }
                let latency = match inner
                    .latency
                    .insert(key.clone(), (buckets.clone(), lsum, lcount))
                {
                    Some((pb, ps, pc)) if lcount > pc => {
                        let deltas: Vec<u64> = buckets
                            .iter()
                            .zip(&pb)
                            .map(|(a, b)| a.saturating_sub(*b))
                            .collect();
                        let n = lcount - pc;
                        let p99 = quantile_ms(&deltas, 0.99);
                        if let Some(p) = p99 {
                            worst_p99 = Some(worst_p99.map_or(p, |w: f64| w.max(p)));
                        }
                        json!({
                            "acks": n,
                            "mean_ms": round(lsum.saturating_sub(ps) as f64 / n as f64 / 1000.0),
                            "p50_ms": quantile_ms(&deltas, 0.5),
                            "p99_ms": p99,
                        })
                    }
                    _ => Value::Null,
                };
                // Paths by name, every shard together.
                let mut paths: Vec<(String, Vec<std::sync::Arc<crate::sink::paths::PathMetrics>>)> =
                    Vec::new();
                for m in &ms {
                    for p in m.paths.list() {
                        match paths.iter_mut().find(|(n, _)| *n == p.name) {
                            Some((_, v)) => v.push(p),
                            None => paths.push((p.name.clone(), vec![p])),
                        }
                    }
                }
                let path_rows: Vec<Value> = paths
                    .iter()
                    .map(|(pname, ps)| {
                        let up = ps.iter().filter(|p| p.state.get() == 2).count();
                        let srtts: Vec<i64> = ps
                            .iter()
                            .map(|p| p.srtt_us.get())
                            .filter(|s| *s >= 0)
                            .collect();
                        let srtt = (!srtts.is_empty()).then(|| {
                            round(srtts.iter().sum::<i64>() as f64 / srtts.len() as f64 / 1000.0)
                        });
                        let sent: u64 = ps.iter().map(|p| p.messages_sent.get()).sum();
                        let acked: u64 = ps.iter().map(|p| p.messages_acked.get()).sum();
                        json!({
                            "name": pname,
                            "up_shards": up,
                            "shards": ps.len(),
                            "srtt_ms": srtt,
                            "inflight": ps.iter().map(|p| p.inflight.get()).sum::<i64>(),
                            "sent_per_second": rates.rate(format!("{key}/p/{pname}/sent"), sent),
                            "acked_per_second": rates.rate(format!("{key}/p/{pname}/acked"), acked),
                        })
                    })
                    .collect();
                // Cluster nodes (`urls`) the connected shards are on, and failovers so far.
                let mut nodes: Vec<(String, usize)> = Vec::new();
                for m in &ms {
                    if m.uplink_state() != crate::sink::UplinkState::Connected {
                        continue;
                    }
                    let Some(node) = m.node() else { continue };
                    match nodes.iter_mut().find(|(n, _)| *n == node) {
                        Some((_, c)) => *c += 1,
                        None => nodes.push((node, 1)),
                    }
                }
                let node_rows: Vec<Value> = nodes
                    .iter()
                    .map(|(n, c)| json!({ "node": n, "shards": c }))
                    .collect();
                let failovers: u64 = ms.iter().map(|m| m.failovers.get()).sum();
                match lane_totals.iter_mut().find(|(l, ..)| *l == lane.as_str()) {
                    Some(t) => {
                        t.1 += inflight;
                        t.2 += queued;
                        t.3 += sent;
                    }
                    None => lane_totals.push((lane.as_str(), inflight, queued, sent)),
                }
                lane_rows.push(json!({
                    "lane": lane.as_str(),
                    "state": state,
                    "connected_shards": connected,
                    "shards": ms.len(),
                    "inflight": inflight,
                    "queued": queued,
                    "queue_bytes": queue_bytes,
                    "queue_oldest_age_seconds": oldest.map(|d| round(d.as_secs_f64())),
                    "sent_per_second": sent_rate,
                    "acked_per_second": acked_rate,
                    "bytes_per_second": bytes_rate,
                    "ack_latency": latency,
                    "paths": path_rows,
                    "nodes": node_rows,
                    "failovers": failovers,
                }));
            }
            let removed_unsent: u64 = entry
                .lanes
                .iter()
                .flat_map(|l| l.iter())
                .map(|(_, m)| m.dropped(crate::sink::DropReason::UplinkRemoved))
                .sum();
            uplinks.push(json!({
                "name": name,
                "id": entry.id.0,
                "lifecycle": entry.state().as_str(),
                "removed_unsent": removed_unsent,
                "state": lane_rows.first().map_or(json!("disconnected"), |l| l["state"].clone()),
                "connected_shards": uplink_connected,
                "lanes": lane_rows,
            }));
        }
        let lanes: Vec<Value> = lane_totals
            .iter()
            .map(|(lane, inflight, queued, sent)| {
                json!({
                    "lane": lane,
                    "inflight": inflight,
                    "queued": queued,
                    "sent_per_second": rates.rate(format!("lane/{lane}/sent"), *sent),
                })
            })
            .collect();

        // Drops by reason: the router's (device side), the uplinks' beyond a full queue (that
        // one is the router's `uplink_queue_full` too), the cloud's refusals, the spools'.
        let mut drops: Vec<(&str, &str, u64)> = Vec::new();
        for (reason, label) in crate::shard::metrics::DROP_REASONS {
            let n: u64 = self
                .shard_metrics
                .iter()
                .map(|m| m.dropped[reason as usize].get())
                .sum();
            drops.push(("router", label, n));
        }
        let all_lanes = || {
            table
                .iter()
                .flat_map(|u| &u.lanes)
                .flat_map(|l| l.iter().map(|(_, m)| m.clone()).collect::<Vec<_>>())
        };
        for reason in crate::sink::DropReason::ALL {
            if reason == crate::sink::DropReason::QueueFull {
                continue;
            }
            let n: u64 = all_lanes().map(|m| m.dropped(reason)).sum();
            drops.push(("uplink", reason.as_str(), n));
        }
        for reason in crate::sink::RejectReason::ALL {
            let n: u64 = all_lanes().map(|m| m.rejected(reason)).sum();
            drops.push(("cloud_rejected", reason.as_str(), n));
        }
        let spools = || {
            table
                .iter()
                .flat_map(|u| &u.spools)
                .chain(&self.former_spool_metrics)
        };
        drops.push((
            "spool",
            "dropped_oldest",
            spools().map(|m| m.dropped_oldest.get()).sum(),
        ));
        drops.push((
            "spool",
            "spool_full",
            spools().map(|m| m.dropped_full.get()).sum(),
        ));
        drops.push((
            "spool",
            "spool_stalled",
            spools().map(|m| m.dropped_stalled.get()).sum(),
        ));
        drops.push((
            "spool",
            "too_large",
            spools().map(|m| m.dropped_too_large.get()).sum(),
        ));
        let drop_total: u64 = drops.iter().map(|d| d.2).sum();
        let by_reason: Vec<Value> = drops
            .iter()
            .map(|(place, reason, n)| {
                let r = rates.rate(format!("drop/{place}/{reason}"), *n);
                (place, reason, n, r)
            })
            .filter(|(_, _, n, _)| **n > 0)
            .map(|(place, reason, n, r)| {
                json!({ "where": place, "reason": reason, "total": n, "per_second": r })
            })
            .collect();
        let drop_rate = rates.rate("drop/all".into(), drop_total);

        // Spool, with the oldest unacknowledged record's age estimated from the append
        // counter's history.
        let spool = self.spool_dir.as_ref().map(|_| {
            let now_ms = now.saturating_duration_since(self.started).as_millis() as u64;
            // One per (sink, shard), keyed by the sink's stable id.
            let flat: Vec<(
                (u32, usize),
                &std::sync::Arc<crate::sink::spool::SpoolMetrics>,
            )> = table
                .iter()
                .flat_map(|u| u.spools.iter().enumerate().map(|(i, m)| ((u.id.0, i), m)))
                .collect();
            let appended: Vec<u64> = flat.iter().map(|(_, m)| m.records_appended.get()).collect();
            if inner.spool_samples.len() == SPOOL_HISTORY {
                inner.spool_samples.pop_front();
            }
            inner.spool_samples.push_back((
                now_ms,
                flat.iter()
                    .map(|(k, _)| *k)
                    .zip(appended.iter().copied())
                    .collect(),
            ));
            let mut oldest: Option<(f64, &str)> = None;
            for (i, (key, m)) in flat.iter().enumerate() {
                let unacked = m.unacked_records.get();
                if unacked <= 0 {
                    continue;
                }
                // Append index (0-based, this process) of the oldest unacknowledged record.
                let target = appended[i] as i64 - unacked;
                let estimate = if target < 0 {
                    (now_ms as f64 / 1000.0, "before_start")
                } else {
                    let t = target as u64;
                    match inner
                        .spool_samples
                        .iter()
                        .find(|(_, a)| a.get(key).is_some_and(|&n| n > t))
                    {
                        Some((ms, _))
                            if inner
                                .spool_samples
                                .front()
                                .is_some_and(|(_, a)| a.get(key).is_some_and(|&n| n <= t)) =>
                        {
                            ((now_ms - ms) as f64 / 1000.0, "history")
                        }
                        _ => {
                            let span = inner.spool_samples.front().map_or(0, |(ms, _)| now_ms - ms);
                            (span as f64 / 1000.0, "at_least")
                        }
                    }
                };
                if oldest.is_none_or(|(age, _)| estimate.0 > age) {
                    oldest = Some(estimate);
                }
            }
            let all: Vec<_> = spools().collect();
            let appended_total: u64 = all.iter().map(|m| m.records_appended.get()).sum();
            let acked_total: u64 = all.iter().map(|m| m.records_acked.get()).sum();
            json!({
                "bytes": all.iter().map(|m| m.bytes.get()).sum::<i64>(),
                "unacked_records": all.iter().map(|m| m.unacked_records.get()).sum::<i64>(),
                "backlog_records": all.iter().map(|m| m.backlog_records.get()).sum::<i64>(),
                "appended_per_second": rates.rate("spool/appended".into(), appended_total),
                "acked_per_second": rates.rate("spool/acked".into(), acked_total),
                "oldest_age_seconds": oldest.map(|(a, _)| round(a)),
                "oldest_age_basis": oldest.map(|(_, b)| b),
                "stalled": all.iter().find_map(|m| m.stalled_name()),
            })
        });

        let device_in = rates.flow("in", in_msgs + coap_in + phd_in, Some(in_bytes));
        let device_out = rates.flow("out", out_msgs, Some(out_bytes));
        let cloud_out = rates.flow("cloud_out", cloud.0, Some(cloud.1));
        let cloud_acked = rates.flow("cloud_acked", cloud.2, None);
        let cloud_in = rates.flow("cloud_in", cloud.3, None);
        let by_protocol = json!({
            "mqtt_per_second": rates.rate("in/mqtt".into(), in_msgs),
            "coap_per_second": rates.rate("in/coap".into(), coap_in),
            "phd_per_second": rates.rate("in/phd".into(), phd_in),
        });

        let phd = self.phd.as_ref().map(|p| {
            let m = &p.metrics;
            let mut v = p.status(PHD_LISTED);
            v["connections"] = json!(m.connections.get());
            v["reports_per_second"] = json!(rates.rate("phd/reports".into(), m.reports.get()));
            v["observations_per_second"] =
                json!(rates.rate("phd/obs".into(), m.observations.get()));
            v["violations"] = json!(m.violations.get());
            v
        });
        let mut functions = self.functions.status();
        if let Some(list) = functions.as_array_mut() {
            for f in list.iter_mut() {
                let name = f["name"].as_str().unwrap_or("").to_string();
                let events = f["events"].as_u64().unwrap_or(0);
                f["events_per_second"] = json!(rates.rate(format!("fn/{name}/events"), events));
            }
        }

        let series = json!({
            "devices": devices["mqtt"].as_i64().unwrap_or(0)
                + devices["coap"].as_i64().unwrap_or(0)
                + devices["coap_dtls"].as_i64().unwrap_or(0)
                + phd_agents,
            "device_in_msgs": device_in["messages_per_second"],
            "device_in_bytes": device_in["bytes_per_second"],
            "device_out_msgs": device_out["messages_per_second"],
            "device_out_bytes": device_out["bytes_per_second"],
            "cloud_out_msgs": cloud_out["messages_per_second"],
            "cloud_out_bytes": cloud_out["bytes_per_second"],
            "cloud_acked_msgs": cloud_acked["messages_per_second"],
            "cloud_in_msgs": cloud_in["messages_per_second"],
            "inflight": all_inflight,
            "queued": all_queued,
            "spool_unacked": spool.as_ref().map_or(json!(0), |s| s["unacked_records"].clone()),
            "drops": drop_rate,
            "ack_p99_ms": worst_p99.filter(|p| p.is_finite()).unwrap_or(0.0),
        });

        inner.counters = rates.next;
        let time_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_millis() as u64;
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "gateway": self.name,
            "time_ms": time_ms,
            "uptime_seconds": self.started.elapsed().as_secs(),
            "interval_seconds": round(dt),
            "devices": devices,
            "shards": shard_rows,
            "traffic": {
                "device_in": device_in,
                "device_in_by_protocol": by_protocol,
                "device_out": device_out,
                "cloud_out": cloud_out,
                "cloud_acked": cloud_acked,
                "cloud_in": cloud_in,
            },
            "uplinks": uplinks,
            "lanes": lanes,
            "spool": spool,
            "drops": {
                "total": drop_total,
                "per_second": drop_rate,
                "by_reason": by_reason,
            },
            "phd": phd,
            "functions": functions,
            "coap_proxy": crate::admin::coap_proxy::proxy_status(&self.proxy_metrics),
            "links": self.links.as_ref().map(|l| l.status()),
            "series": series,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_the_upper_bound_of_their_bucket() {
        let mut d = vec![0u64; LATENCY_BUCKETS_SECONDS.len() + 1];
        assert_eq!(quantile_ms(&d, 0.5), None);
        d[5] = 98; // ≤ 1 ms
        d[9] = 2; // ≤ 5 ms
        assert_eq!(quantile_ms(&d, 0.5), Some(1.0));
        assert_eq!(quantile_ms(&d, 0.99), Some(5.0));
        d[LATENCY_BUCKETS_SECONDS.len()] = 100;
        assert_eq!(quantile_ms(&d, 0.99), Some(f64::INFINITY));
    }

    #[test]
    fn rates_are_differences_over_the_tick_and_zero_first() {
        let prev = HashMap::from([("a".to_string(), 100u64), ("b".to_string(), 50)]);
        let mut r = Rates {
            prev: &prev,
            next: HashMap::new(),
            dt: 2.0,
        };
        assert_eq!(r.rate("a".into(), 300), 100.0);
        assert_eq!(r.rate("b".into(), 10), 0.0, "a counter that went back");
        assert_eq!(r.rate("c".into(), 10), 0.0, "first tick");
    }
}
