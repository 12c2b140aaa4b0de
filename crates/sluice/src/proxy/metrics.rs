//! Counters of the CoAP proxy, per shard and upstream: requests by response class, upstream
//! latency, connects and reconnects, retries, and the 5.0x answers the proxy made up; the
//! connection state for `/api/v1/status`; with `paths`, the same per path (state, requests
//! and bytes written, outstanding, smoothed RTT, failovers by reason).
//!
//! Owns: the numbers and how they render (Prometheus text and status JSON). Does not own:
//! serving them (`crate::admin`) or deciding what happened (`conn.rs`).

use crate::telemetry::metrics::{Counter, Gauge, Histogram, PromWriter};

/// Connection state values of [`UpstreamMetrics::state`].
pub const DISCONNECTED: i64 = 0;
pub const CONNECTING: i64 = 1;
pub const CONNECTED: i64 = 2;

/// One upstream's numbers on one shard.
#[derive(Debug, Default)]
pub struct UpstreamMetrics {
    /// Responses from the upstream relayed to a device, by class (index 2..=5; others at 0).
    pub responses: [Counter; 6],
    /// Request written to response read.
    pub latency: Histogram,
    /// Connections whose CSM exchange completed.
    pub connects: Counter,
    /// Connections that ended (closed, failed Ping, Release, Abort, error) after connecting.
    pub disconnects: Counter,
    /// Connection attempts that failed before the server's CSM.
    pub connect_failures: Counter,
    /// Requests written again on a new connection (idempotent, once).
    pub retries: Counter,
    /// Answers the proxy made up instead of the upstream.
    pub bad_gateway: Counter,
    pub unavailable: Counter,
    pub timeouts: Counter,
    /// 0 disconnected, 1 connecting, 2 connected.
    pub state: Gauge,
    /// Requests written and not answered yet.
    pub outstanding: Gauge,
    /// Requests waiting for an outstanding slot.
    pub waiting: Gauge,
    /// MPTCP state of the connection (`mptcp = true`).
    pub mptcp: crate::net::mptcp::MptcpMetrics,
    /// One per `paths` entry (empty without `paths`).
    pub paths: Vec<ProxyPathMetrics>,
}

/// Why a path was declared dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathFailover {
    /// The connection failed or was closed (RST, Abort, Release, write error, no Pong).
    Dead,
    /// Requests outstanding and nothing read for `path_timeout`.
    Stalled,
    /// The link watcher saw its interface lose its carrier.
    LinkDown,
}

impl PathFailover {
    pub fn as_str(self) -> &'static str {
        match self {
            PathFailover::Dead => "dead",
            PathFailover::Stalled => "stalled",
            PathFailover::LinkDown => "link_down",
        }
    }
}

/// One path of one upstream on one shard.
#[derive(Debug, Default)]
pub struct ProxyPathMetrics {
    pub name: String,
    /// 0 disconnected, 1 connecting, 2 connected.
    pub state: Gauge,
    pub connects: Counter,
    /// Requests written on this path (a retry counts on the path it is written to).
    pub requests: Counter,
    /// Bytes of requests written on this path.
    pub bytes: Counter,
    /// Responses read on this path.
    pub responses: Counter,
    pub outstanding: Gauge,
    /// Smoothed request → response time on this path, µs (0: none yet).
    pub srtt_us: Gauge,
    /// Failovers by [`PathFailover`]: dead, stalled, link_down.
    pub failovers: [Counter; 3],
}

impl ProxyPathMetrics {
    pub fn new(name: String) -> ProxyPathMetrics {
        ProxyPathMetrics {
            name,
            ..Default::default()
        }
    }

    pub fn failover(&self, why: PathFailover) {
        self.failovers[why as usize].inc();
    }

    fn state_name(&self) -> &'static str {
        match self.state.get() {
            CONNECTED => "connected",
            CONNECTING => "connecting",
            _ => "disconnected",
        }
    }

    fn render(&self, w: &mut PromWriter, shard: &str, upstream: &str) {
        let l: &[(&str, &str)] = &[
            ("shard", shard),
            ("upstream", upstream),
            ("path", &self.name),
        ];
        w.state(
            "sluice_coap_proxy_path_state",
            "Path connection state: 1 for the current state label (disconnected, connecting, connected), 0 for the others.",
            l,
            "state",
            &["disconnected", "connecting", "connected"],
            self.state_name(),
        );
        w.counter(
            "sluice_coap_proxy_path_connects_total",
            "Path connections whose CSM exchange completed.",
            l,
            self.connects.get(),
        );
        w.counter(
            "sluice_coap_proxy_path_requests_total",
            "Requests written on the path.",
            l,
            self.requests.get(),
        );
        w.counter(
            "sluice_coap_proxy_path_bytes_total",
            "Request bytes written on the path.",
            l,
            self.bytes.get(),
        );
        w.counter(
            "sluice_coap_proxy_path_responses_total",
            "Responses read on the path.",
            l,
            self.responses.get(),
        );
        w.gauge(
            "sluice_coap_proxy_path_outstanding",
            "Requests written on the path and not answered yet.",
            l,
            self.outstanding.get(),
        );
        w.gauge_f64(
            "sluice_coap_proxy_path_srtt_seconds",
            "Smoothed request-to-response time on the path.",
            l,
            self.srtt_us.get() as f64 / 1e6,
        );
        for why in [
            PathFailover::Dead,
            PathFailover::Stalled,
            PathFailover::LinkDown,
        ] {
            w.counter(
                "sluice_coap_proxy_path_failovers_total",
                "Times the path was declared dead, by reason (its requests went to the other paths).",
                &[
                    ("shard", shard),
                    ("upstream", upstream),
                    ("path", &self.name),
                    ("reason", why.as_str()),
                ],
                self.failovers[why as usize].get(),
            );
        }
    }

    fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "state": self.state_name(),
            "connects": self.connects.get(),
            "requests": self.requests.get(),
            "bytes": self.bytes.get(),
            "responses": self.responses.get(),
            "outstanding": self.outstanding.get(),
            "srtt_ms": self.srtt_us.get() as f64 / 1000.0,
            "failovers": {
                "dead": self.failovers[0].get(),
                "stalled": self.failovers[1].get(),
                "link_down": self.failovers[2].get(),
            },
        })
    }
}

impl UpstreamMetrics {
    pub fn state_name(&self) -> &'static str {
        match self.state.get() {
            CONNECTED => "connected",
            CONNECTING => "connecting",
            _ => "disconnected",
        }
    }

    /// Render this upstream's series with labels `shard` and `upstream`.
    pub fn render(&self, w: &mut PromWriter, shard: &str, upstream: &str) {
        let l: &[(&str, &str)] = &[("shard", shard), ("upstream", upstream)];
        for (class, name) in [(2, "2xx"), (4, "4xx"), (5, "5xx")] {
            w.counter(
                "sluice_coap_proxy_responses_total",
                "Upstream responses relayed to devices, by class.",
                &[("shard", shard), ("upstream", upstream), ("class", name)],
                self.responses[class].get(),
            );
        }
        for (code, c) in [
            ("5.02", &self.bad_gateway),
            ("5.03", &self.unavailable),
            ("5.04", &self.timeouts),
        ] {
            w.counter(
                "sluice_coap_proxy_made_up_total",
                "Answers the proxy made up (5.02 connection lost, 5.03 too many waiting, 5.04 timeout).",
                &[("shard", shard), ("upstream", upstream), ("code", code)],
                c.get(),
            );
        }
        w.histogram(
            "sluice_coap_proxy_upstream_latency_seconds",
            "Time from writing a request to the upstream to reading its response.",
            l,
            &self.latency,
        );
        w.counter(
            "sluice_coap_proxy_connects_total",
            "Upstream connections whose CSM exchange completed.",
            l,
            self.connects.get(),
        );
        w.counter(
            "sluice_coap_proxy_disconnects_total",
            "Upstream connections that ended after connecting (each is followed by a reconnect).",
            l,
            self.disconnects.get(),
        );
        w.counter(
            "sluice_coap_proxy_connect_failures_total",
            "Upstream connection attempts that failed before the server's CSM.",
            l,
            self.connect_failures.get(),
        );
        w.counter(
            "sluice_coap_proxy_retries_total",
            "Idempotent requests written again on a new connection.",
            l,
            self.retries.get(),
        );
        w.state(
            "sluice_coap_proxy_state",
            "Upstream connection state: 1 for the current state label (disconnected, connecting, connected), 0 for the others.",
            l,
            "state",
            &["disconnected", "connecting", "connected"],
            self.state_name(),
        );
        w.gauge(
            "sluice_coap_proxy_outstanding",
            "Requests written to the upstream and not answered yet.",
            l,
            self.outstanding.get(),
        );
        w.gauge(
            "sluice_coap_proxy_waiting",
            "Requests waiting for an outstanding slot (back-pressure).",
            l,
            self.waiting.get(),
        );
        self.mptcp.render(w, "sluice_coap_proxy", l);
        for p in &self.paths {
            p.render(w, shard, upstream);
        }
    }

    /// The status entry of this upstream on one shard.
    pub fn status(&self, shard: usize, upstream: &str) -> serde_json::Value {
        serde_json::json!({
            "shard": shard,
            "upstream": upstream,
            "state": self.state_name(),
            "outstanding": self.outstanding.get(),
            "waiting": self.waiting.get(),
            "connects": self.connects.get(),
            "retries": self.retries.get(),
            "mptcp": self.mptcp.status(),
            "paths": self.paths.iter().map(ProxyPathMetrics::status).collect::<Vec<_>>(),
        })
    }
}

/// Every upstream of one shard, by `config.coap.proxy` index.
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    pub upstreams: Vec<(String, UpstreamMetrics)>,
}

impl ProxyMetrics {
    pub fn new(config: &crate::config::Config) -> ProxyMetrics {
        ProxyMetrics {
            upstreams: config
                .coap
                .proxy
                .iter()
                .map(|p| {
                    let m = UpstreamMetrics {
                        paths: p
                            .paths
                            .iter()
                            .enumerate()
                            .map(|(i, path)| ProxyPathMetrics::new(path.label(i)))
                            .collect(),
                        ..Default::default()
                    };
                    (p.name.clone(), m)
                })
                .collect(),
        }
    }

    pub fn render(&self, w: &mut PromWriter, shard: usize) {
        let shard = shard.to_string();
        for (name, m) in &self.upstreams {
            m.render(w, &shard, name);
        }
    }

    pub fn status(&self, shard: usize) -> Vec<serde_json::Value> {
        self.upstreams
            .iter()
            .map(|(name, m)| m.status(shard, name))
            .collect()
    }
}
