//! Telemetry: logging set-up and the metrics primitives every subsystem uses.
//!
//! Owns: the `tracing` subscriber initialisation (`[log] level` and `format`: text or JSON
//! lines; the level filter reloadable: [`set_log_level`]) and lock-free metric types with their
//! Prometheus writer. Does not own:
//! what is measured (each subsystem keeps its own metric structs) or how they are served
//! (admin/). Invariant: recording a metric is a few relaxed atomic operations — no lock, no
//! allocation — so it is safe on the per-message path of every shard.

pub mod metrics;

/// Initialise logging to standard output: `log.level` (an EnvFilter directive list; `RUST_LOG`
/// wins when set) and `log.format` (`text`, coloured only on a terminal, or `json`: one JSON
/// object per line with `timestamp`, `level`, `fields` — `message` and the event's fields — and
/// the current span).
///
/// The level filter is the registry's first layer, behind a reload layer, so [`set_log_level`]
/// changes it while running; the line formatter (text or JSON) sits on top.
pub fn init_logging(log: &crate::config::LogConfig) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.level));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let (text, json) = match log.format {
        crate::config::LogFormat::Text => (
            Some(
                tracing_subscriber::fmt::layer()
                    .with_target(false)
                    .with_ansi(colour_output()),
            ),
            None,
        ),
        crate::config::LogFormat::Json => (
            None,
            Some(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(false),
            ),
        ),
    };
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json)
        .try_init();
    if installed.is_ok() {
        let _ = LOG_FILTER.set(handle);
    }
}

/// Colours in text lines only on a terminal, and not when `NO_COLOR` is set
/// (<https://no-color.org>). Under systemd standard output is the journal, which stores a line
/// holding an escape byte as binary (`journalctl -o json` shows its MESSAGE as an array of
/// numbers); files and pipes to log shippers get plain text too.
fn colour_output() -> bool {
    use std::io::IsTerminal;
    let no_color = matches!(std::env::var_os("NO_COLOR"), Some(v) if !v.is_empty());
    std::io::stdout().is_terminal() && !no_color
}

/// The installed filter's reload handle (unset until [`init_logging`] installed one).
static LOG_FILTER: std::sync::OnceLock<
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>,
> = std::sync::OnceLock::new();

/// What [`set_log_level`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevelChange {
    /// The new filter is in force.
    Applied,
    /// `RUST_LOG` is set: it keeps winning over `[log] level` until a restart without it.
    EnvWins,
    /// No reloadable subscriber is installed (a library user's own, or tests).
    NotInstalled,
}

/// Whether `level` is a valid `[log] level` (a level or an EnvFilter directive list).
pub fn check_log_level(level: &str) -> Result<(), String> {
    tracing_subscriber::EnvFilter::try_new(level)
        .map(|_| ())
        .map_err(|e| format!("log.level {level:?}: {e}"))
}

/// Replace the log filter with `level` (a reload), unless `RUST_LOG` is set.
pub fn set_log_level(level: &str) -> Result<LogLevelChange, String> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .map_err(|e| format!("log.level {level:?}: {e}"))?;
    if std::env::var_os("RUST_LOG").is_some() {
        return Ok(LogLevelChange::EnvWins);
    }
    match LOG_FILTER.get() {
        Some(handle) => handle
            .reload(filter)
            .map(|()| LogLevelChange::Applied)
            .map_err(|e| e.to_string()),
        None => Ok(LogLevelChange::NotInstalled),
    }
}
