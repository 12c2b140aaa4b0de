//! `[state]`: where retained messages and persistent MQTT sessions are kept across restarts.
//!
//! Owns: the config type and its defaults. Does not own: checking it against the rest of the
//! config (`validate.rs`) or the state files (`crate::state`).
//!
//! Without `dir` the gateway keeps retained messages and sessions in memory only, as before:
//! a restart forgets them. The default is no `dir` (see `docs/state.md` for why): the packaged
//! config (`deploy/sluice.toml`) sets `/var/lib/sluice/state`, beside the spool, inside the
//! unit's `StateDirectory`.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units::{self, ByteSize};

/// `[state]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Directory of the state files; absent: memory only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Group-commit period: changes are written and fsynced together this often. A `kill -9`
    /// loses at most the changes of the last period.
    #[serde(with = "units::duration")]
    pub commit_interval: Duration,
    /// The change log is compacted into a new snapshot when it grows past this size (or
    /// past twice the last snapshot, whichever is larger).
    pub max_log_size: ByteSize,
    /// Changes waiting for the writer, whole gateway (input bound). Beyond it a change is
    /// dropped and counted (`sluice_state_changes_dropped_total`) and the next commit writes a
    /// full snapshot instead of the log, so the files never hold a state with a gap.
    pub max_pending: ByteSize,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            dir: None,
            commit_interval: Duration::from_millis(50),
            max_log_size: ByteSize::mib(64),
            max_pending: ByteSize::mib(16),
        }
    }
}

impl StateConfig {
    /// Whether retained messages and persistent sessions are written to disk.
    pub fn enabled(&self) -> bool {
        self.dir.is_some()
    }
}
