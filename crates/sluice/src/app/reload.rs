//! What `SIGHUP` does to a running gateway: re-read and validate the config file, and say
//! what differs from the running configuration.
//!
//! Owns: [`RunningGateway::reload`] (the one seam a live reload fills in, issue 29), its
//! outcome, log line and counter (`sluice_reloads_total{result}`). Does not own: catching the
//! signal (`main.rs`), or applying anything — live reload is not supported yet, so the
//! running configuration never changes here; a changed file takes effect at the next restart.
//!
//! Invariant: a reload never stops the gateway, whatever the file holds (unreadable, invalid,
//! changed): it only reads the file, compares, logs and counts.

use std::path::Path;

use crate::config::Config;
use crate::telemetry::metrics::{Counter, PromWriter};

use super::RunningGateway;

/// What a reload found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// The file is valid and says what the gateway runs with.
    Unchanged,
    /// The file is valid and differs in these top-level sections (`mqtt`, `uplink`, …); not
    /// applied (live reload is not supported yet).
    NotApplied(Vec<String>),
    /// The file cannot be read or is not valid; the running configuration stays.
    Invalid(String),
}

impl ReloadOutcome {
    /// The `result` label of `sluice_reloads_total`.
    pub fn label(&self) -> &'static str {
        match self {
            ReloadOutcome::Unchanged => "unchanged",
            ReloadOutcome::NotApplied(_) => "not_applied",
            ReloadOutcome::Invalid(_) => "invalid",
        }
    }
}

/// Reloads asked for, by outcome.
#[derive(Debug, Default)]
pub struct ReloadMetrics {
    unchanged: Counter,
    not_applied: Counter,
    invalid: Counter,
}

impl ReloadMetrics {
    fn count(&self, outcome: &ReloadOutcome) {
        match outcome {
            ReloadOutcome::Unchanged => self.unchanged.inc(),
            ReloadOutcome::NotApplied(_) => self.not_applied.inc(),
            ReloadOutcome::Invalid(_) => self.invalid.inc(),
        }
    }

    pub fn render(&self, w: &mut PromWriter) {
        for (result, c) in [
            ("unchanged", &self.unchanged),
            ("not_applied", &self.not_applied),
            ("invalid", &self.invalid),
        ] {
            w.counter(
                "sluice_reloads_total",
                "Configuration reloads asked for (SIGHUP), by result: unchanged, not_applied (the file differs; live reload is not supported yet), invalid.",
                &[("result", result)],
                c.get(),
            );
        }
    }
}

impl RunningGateway {
    /// Re-read the config file at `path` (`None`: the embedded defaults) and compare it with
    /// the configuration the gateway runs with. Nothing is applied yet; logs the outcome (at
    /// INFO, WARN when the file is invalid) and counts it.
    pub fn reload(&self, path: Option<&Path>) -> ReloadOutcome {
        let outcome = match crate::config::load(path) {
            Err(error) => ReloadOutcome::Invalid(error.to_string()),
            Ok(fresh) => {
                let differs = differing_sections(&self.config, &fresh.with_function_sinks());
                if differs.is_empty() {
                    ReloadOutcome::Unchanged
                } else {
                    ReloadOutcome::NotApplied(differs)
                }
            }
        };
        self.status.reloads.count(&outcome);
        match &outcome {
            ReloadOutcome::Unchanged => tracing::info!(
                "reload asked (SIGHUP): the config file is valid and unchanged; live reload is not supported yet"
            ),
            ReloadOutcome::NotApplied(sections) => tracing::info!(
                differs = %sections.join(", "),
                "reload asked (SIGHUP): the config file is valid but live reload is not supported yet; the changes take effect at the next restart"
            ),
            ReloadOutcome::Invalid(error) => tracing::warn!(
                %error,
                "reload asked (SIGHUP): the config file is invalid; the running configuration stays"
            ),
        }
        outcome
    }
}

/// The top-level sections (`gateway`, `mqtt`, `uplink`, …) whose values differ.
fn differing_sections(running: &Config, fresh: &Config) -> Vec<String> {
    // Invariant: every Config serializes (see `Config::to_toml`); an error compares unequal.
    let table = |c: &Config| toml::Table::try_from(c).unwrap_or_default();
    let (a, b) = (table(running), table(fresh));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_that_differ_are_named_once_each() {
        let running = crate::config::parse("[mqtt]\nmax_connections = 10\n").unwrap();
        let same = crate::config::parse("[mqtt]\nmax_connections = 10\n").unwrap();
        assert!(differing_sections(&running, &same).is_empty());
        let fresh =
            crate::config::parse("[mqtt]\nmax_connections = 11\n[log]\nlevel = \"debug\"\n")
                .unwrap();
        assert_eq!(differing_sections(&running, &fresh), vec!["log", "mqtt"]);
    }
}
