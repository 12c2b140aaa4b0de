//! Telemetry: logging set-up and the metrics primitives every subsystem uses.
//!
//! Owns: the `tracing` subscriber initialisation (`[log] level` and `format`: text or JSON
//! lines) and lock-free metric types with their Prometheus writer. Does not own:
//! what is measured (each subsystem keeps its own metric structs) or how they are served
//! (admin/). Invariant: recording a metric is a few relaxed atomic operations — no lock, no
//! allocation — so it is safe on the per-message path of every shard.

pub mod metrics;

/// Initialise logging to standard output: `log.level` (an EnvFilter directive list; `RUST_LOG`
/// wins when set) and `log.format` (`text`, or `json`: one JSON object per line with
/// `timestamp`, `level`, `fields` — `message` and the event's fields — and the current span).
///
/// The subscriber is a registry with the line formatter as its first layer and the level filter
/// on top, so the filter can be swapped (reloaded) without touching the formatter's type.
pub fn init_logging(log: &crate::config::LogConfig) {
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::{EnvFilter, Layer, Registry};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.level));
    let lines: Box<dyn Layer<Registry> + Send + Sync> = match log.format {
        crate::config::LogFormat::Text => {
            tracing_subscriber::fmt::layer().with_target(false).boxed()
        }
        crate::config::LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(lines)
        .with(filter)
        .try_init();
}
