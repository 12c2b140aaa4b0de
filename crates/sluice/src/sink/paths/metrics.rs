//! Per-path health of one multipath session, for `/api/v1/status` and `/metrics`.
//!
//! Owns: [`PathsMetrics`] (the paths of one (shard, uplink, lane), registered by the
//! transport when it is built) and [`PathMetrics`] (one path's state, smoothed RTT,
//! inflight, counters, last error). Does not own: deciding anything (the transport).
//! Written on the shard, read by the admin thread: atomics, and one mutex per path for its
//! last error (taken only when a path fails and when status is read).

use std::sync::{Arc, Mutex};

use crate::telemetry::metrics::{Counter, Gauge, MetricKind, PromWriter};

/// Why a path was declared dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failover {
    /// Its connection failed (read/write error, the broker closed it, keep-alive).
    Dead,
    /// Units or a keep-alive unanswered for `path_timeout`.
    Stalled,
    /// The link watcher saw its interface go down.
    LinkDown,
}

impl Failover {
    pub const ALL: [Failover; 3] = [Failover::Dead, Failover::Stalled, Failover::LinkDown];

    pub fn as_str(self) -> &'static str {
        match self {
            Failover::Dead => "dead",
            Failover::Stalled => "stalled",
            Failover::LinkDown => "link_down",
        }
    }
}

/// A path's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    Down = 0,
    Connecting = 1,
    Up = 2,
}

/// One path's health.
#[derive(Debug)]
pub struct PathMetrics {
    pub name: String,
    /// [`PathState`] as an integer (written as the `state` label of `sluice_uplink_path_state`).
    pub state: Gauge,
    /// Smoothed send → ack time, microseconds (-1: no sample yet).
    pub srtt_us: Gauge,
    pub inflight: Gauge,
    pub messages_sent: Counter,
    pub messages_acked: Counter,
    pub bytes: Counter,
    pub connects: Counter,
    failovers: [Counter; Failover::ALL.len()],
    last_error: Mutex<Option<String>>,
}

impl PathMetrics {
    pub fn new(name: String) -> PathMetrics {
        let m = PathMetrics {
            name,
            state: Gauge::default(),
            srtt_us: Gauge::default(),
            inflight: Gauge::default(),
            messages_sent: Counter::default(),
            messages_acked: Counter::default(),
            bytes: Counter::default(),
            connects: Counter::default(),
            failovers: Default::default(),
            last_error: Mutex::new(None),
        };
        m.srtt_us.set(-1);
        m
    }

    pub fn set_state(&self, s: PathState) {
        self.state.set(s as i64);
    }

    pub fn failover(&self, why: Failover, error: String) {
        self.failovers[why as usize].inc();
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
    }

    pub fn failovers(&self, why: Failover) -> u64 {
        self.failovers[why as usize].get()
    }

    pub(crate) fn state_str(&self) -> &'static str {
        match self.state.get() {
            2 => "up",
            1 => "connecting",
            _ => "down",
        }
    }

    fn status(&self) -> serde_json::Value {
        let srtt = self.srtt_us.get();
        serde_json::json!({
            "name": self.name,
            "state": self.state_str(),
            "srtt_ms": (srtt >= 0).then(|| srtt as f64 / 1000.0),
            "inflight": self.inflight.get(),
            "messages_sent": self.messages_sent.get(),
            "messages_acked": self.messages_acked.get(),
            "bytes": self.bytes.get(),
            "connects": self.connects.get(),
            "failovers": Failover::ALL
                .iter()
                .map(|f| (f.as_str().to_string(), serde_json::json!(self.failovers(*f))))
                .collect::<serde_json::Map<_, _>>(),
            "last_error": self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        })
    }
}

/// The paths of one multipath session; empty for a session without `paths`.
#[derive(Debug, Default)]
pub struct PathsMetrics {
    paths: Mutex<Vec<Arc<PathMetrics>>>,
}

impl PathsMetrics {
    /// The transport registers its paths once, when it is built (a rebuild replaces them).
    pub fn register(&self, paths: Vec<Arc<PathMetrics>>) {
        *self.paths.lock().unwrap_or_else(|p| p.into_inner()) = paths;
    }

    /// The paths registered, in config order.
    pub fn list(&self) -> Vec<Arc<PathMetrics>> {
        self.paths.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The status JSON: one object per path (`[]` without paths).
    pub fn status(&self) -> serde_json::Value {
        serde_json::Value::Array(self.list().iter().map(|p| p.status()).collect())
    }

    pub fn render(&self, w: &mut PromWriter, labels: &[(&str, &str)]) {
        for p in self.list() {
            let mut l: Vec<(&str, &str)> = labels.to_vec();
            l.push(("path", &p.name));
            w.state(
                "sluice_uplink_path_state",
                "Path state of a per-path session: 1 for the current state label (down, connecting, up), 0 for the others.",
                &l,
                "state",
                &["down", "connecting", "up"],
                p.state_str(),
            );
            let srtt = p.srtt_us.get();
            if srtt >= 0 {
                w.gauge_f64(
                    "sluice_uplink_path_srtt_seconds",
                    "Smoothed send-to-ack time of the path (no sample before the first ack).",
                    &l,
                    srtt as f64 / 1e6,
                );
            } else {
                w.describe(
                    "sluice_uplink_path_srtt_seconds",
                    MetricKind::Gauge,
                    "Smoothed send-to-ack time of the path (no sample before the first ack).",
                );
            }
            w.gauge(
                "sluice_uplink_path_inflight",
                "Messages unacknowledged on the path.",
                &l,
                p.inflight.get(),
            );
            w.counter(
                "sluice_uplink_path_messages_sent_total",
                "Messages written on the path, resends included.",
                &l,
                p.messages_sent.get(),
            );
            w.counter(
                "sluice_uplink_path_messages_acked_total",
                "Messages the broker acknowledged on the path.",
                &l,
                p.messages_acked.get(),
            );
            w.counter(
                "sluice_uplink_path_bytes_total",
                "MQTT bytes written on the path.",
                &l,
                p.bytes.get(),
            );
            w.counter(
                "sluice_uplink_path_connects_total",
                "Successful connections of the path's session.",
                &l,
                p.connects.get(),
            );
            for f in Failover::ALL {
                let mut lf = l.clone();
                lf.push(("reason", f.as_str()));
                w.counter(
                    "sluice_uplink_path_failovers_total",
                    "Times the path was declared dead and its messages given to other paths.",
                    &lf,
                    p.failovers(f),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two paths of one session, one up with an ack seen, one never connected: the exposition
    /// passes the strict reader (before: `sluice_uplink_path_srtt_microseconds`, a non-base
    /// unit, with -1 for "no ack yet", and the state as 0/1/2).
    #[test]
    fn path_metrics_use_seconds_and_state_labels() {
        let up = Arc::new(PathMetrics::new("wan".into()));
        up.set_state(PathState::Up);
        up.srtt_us.set(1_500);
        let down = Arc::new(PathMetrics::new("lte".into()));
        let paths = PathsMetrics::default();
        paths.register(vec![up, down]);
        let mut w = PromWriter::new();
        paths.render(&mut w, &[("shard", "0"), ("uplink", "cloud")]);
        let text = w.finish();
        let exp = sluice_testkit::prom::check(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let srtt = exp
            .family("sluice_uplink_path_srtt_seconds")
            .expect("srtt family");
        assert_eq!(
            srtt.samples.len(),
            1,
            "no sample before the first ack: {text}"
        );
        assert_eq!(srtt.samples[0].label("path"), Some("wan"));
        assert_eq!(srtt.samples[0].value, 0.0015);
        let state = |path, state| {
            exp.sum(
                "sluice_uplink_path_state",
                &[("path", path), ("state", state)],
            )
        };
        assert_eq!((state("wan", "up"), state("wan", "down")), (1.0, 0.0));
        assert_eq!(
            (state("lte", "down"), state("lte", "connecting")),
            (1.0, 0.0)
        );
    }
}
