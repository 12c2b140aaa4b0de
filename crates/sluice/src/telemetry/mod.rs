//! Telemetry: logging set-up and the metrics primitives every subsystem uses.
//!
//! Owns: the `tracing` subscriber initialisation and lock-free metric types. Does not own:
//! what is measured (each subsystem keeps its own metric structs) or how they are served
//! (admin/). Invariant: recording a metric is a few relaxed atomic operations — no lock, no
//! allocation — so it is safe on the per-message path of every shard.

pub mod metrics;

/// Initialise logging. `RUST_LOG` wins over `level` when set.
pub fn init_logging(level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}
