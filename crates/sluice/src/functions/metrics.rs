//! Per-function metrics (issue 19, point 6), shared by the shards' dispatchers and the runtime
//! (atomics, no locks) and written to /metrics by [`render`].
//!
//! Owns: the counters, gauges and histograms of one function and their names. Does not own:
//! when they move (the dispatcher counts events, invocations, retries, dead letters, replies
//! and the latency of invocations and cold starts; the runtime counts starts, stops, crashes,
//! cold starts and pre-warm hits and misses, and sets the instance gauges).

use crate::telemetry::metrics::{Counter, Gauge, Histogram, PromWriter};

/// How one invocation (one HTTP attempt) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer.
    Ok,
    /// A non-2xx answer (4xx or 5xx).
    HttpError,
    /// No answer within `timeout`.
    Timeout,
    /// The connection failed or ended before the answer.
    ConnectionError,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [
        Outcome::Ok,
        Outcome::HttpError,
        Outcome::Timeout,
        Outcome::ConnectionError,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::HttpError => "http_error",
            Outcome::Timeout => "timeout",
            Outcome::ConnectionError => "connection_error",
        }
    }
}

/// One function's metrics.
#[derive(Debug, Default)]
pub struct FunctionMetrics {
    /// Messages that matched the function's topics.
    pub events: Counter,
    invocations: [Counter; 4],
    /// Attempts after a failed one.
    pub retries: Counter,
    /// Events published to `$sluice/dlq/{name}` after their last attempt failed.
    pub dead_letters: Counter,
    /// 2xx answers published on `reply_topic`.
    pub replies: Counter,
    /// Events that found no running instance, so one was started for them.
    pub cold_starts: Counter,
    /// From a cold-starting event's arrival at sluice to the new instance's first answer.
    pub cold_start_latency: Histogram,
    /// From sending an invocation to its answer (every outcome but connection errors).
    pub invocation_latency: Histogram,
    /// From an event's arrival at sluice to its request written to an instance (sluice's own
    /// part of the path, cold or warm).
    pub dispatch_latency: Histogram,
    /// Instances serving.
    pub instances_running: Gauge,
    /// Instances started that have not answered yet.
    pub instances_starting: Gauge,
    /// Events waiting for a slot on an instance, gateway-wide.
    pub queue_depth: Gauge,
    /// Instances started (every reason).
    pub starts: Counter,
    /// Instances stopped after `idle` (or by the predictor).
    pub stops: Counter,
    /// Instances that exited on their own (crashed), restarted with backoff.
    pub crashes: Counter,
    /// Pre-warmed instances that served an event before being stopped.
    pub prewarm_hits: Counter,
    /// Pre-warmed instances stopped without serving an event.
    pub prewarm_misses: Counter,
}

impl FunctionMetrics {
    pub fn invocation(&self, outcome: Outcome) {
        self.invocations[outcome as usize].inc();
    }
    pub fn invocations(&self, outcome: Outcome) -> u64 {
        self.invocations[outcome as usize].get()
    }
}

/// Write every function's metrics (`sluice_function_*{function="…"}`).
pub fn render(w: &mut PromWriter, functions: &[std::sync::Arc<super::FunctionHandle>]) {
    for f in functions {
        let m = &f.metrics;
        let name = f.name();
        let l = [("function", name)];
        w.counter(
            "sluice_function_events_total",
            "Messages that matched the function's topics.",
            &l,
            m.events.get(),
        );
        for o in Outcome::ALL {
            w.counter(
                "sluice_function_invocations_total",
                "HTTP attempts by outcome (ok: 2xx; http_error: other status; timeout; connection_error).",
                &[("function", name), ("outcome", o.as_str())],
                m.invocations(o),
            );
        }
        for (metric, help, c) in [
            (
                "sluice_function_retries_total",
                "Attempts after a failed one.",
                &m.retries,
            ),
            (
                "sluice_function_dead_letters_total",
                "Events published to $sluice/dlq/{function} after every attempt failed.",
                &m.dead_letters,
            ),
            (
                "sluice_function_replies_total",
                "2xx answers published on reply_topic.",
                &m.replies,
            ),
            (
                "sluice_function_cold_starts_total",
                "Events that found no running instance, so one was started for them.",
                &m.cold_starts,
            ),
            (
                "sluice_function_instance_starts_total",
                "Instances started.",
                &m.starts,
            ),
            (
                "sluice_function_instance_stops_total",
                "Instances stopped (idle, or by the predictor).",
                &m.stops,
            ),
            (
                "sluice_function_instance_crashes_total",
                "Instances that exited on their own.",
                &m.crashes,
            ),
            (
                "sluice_function_prewarm_hits_total",
                "Pre-warmed instances that served an event.",
                &m.prewarm_hits,
            ),
            (
                "sluice_function_prewarm_misses_total",
                "Pre-warmed instances stopped without serving an event.",
                &m.prewarm_misses,
            ),
        ] {
            w.counter(metric, help, &l, c.get());
        }
        w.gauge(
            "sluice_function_instances",
            "Instances by state.",
            &[("function", name), ("state", "running")],
            m.instances_running.get(),
        );
        w.gauge(
            "sluice_function_instances",
            "Instances by state.",
            &[("function", name), ("state", "starting")],
            m.instances_starting.get(),
        );
        w.gauge(
            "sluice_function_queue_depth",
            "Events waiting for a slot on an instance.",
            &l,
            m.queue_depth.get(),
        );
        w.histogram(
            "sluice_function_cold_start_seconds",
            "From a cold-starting event's arrival to the new instance's first answer.",
            &l,
            &m.cold_start_latency,
        );
        w.histogram(
            "sluice_function_invocation_seconds",
            "From sending an invocation to its answer.",
            &l,
            &m.invocation_latency,
        );
        w.histogram(
            "sluice_function_dispatch_seconds",
            "From an event's arrival at sluice to its request written to an instance.",
            &l,
            &m.dispatch_latency,
        );
    }
}
