//! Start-up of the spools: opening and recovering every (uplink, shard) spool before any
//! shard thread starts, and the spools of shard indexes no longer configured.
//!
//! Owns: [`open_all`] (one `Spool::open` per directory, each recovery report logged: INFO
//! when clean, WARN naming what was skipped), the directory layout ([`spool_dir`]:
//! `DIR/{uplink}/shard-{n}/`), finding former shard directories (`shard-N`, `N >= shards`,
//! with unacknowledged records: WARN, drained by shard `N % shards`; empty ones: INFO, left
//! alone), the WARN about directories of uplinks that are not configured, and the gauges
//! every commit refreshes ([`update_gauges`]). Does not own: recovery itself
//! (`sluice-spool`), or reopening after a failure at run time (`commit.rs`, which reuses
//! [`log_recovery`]).
//!
//! Invariant: a directory of an uplink that is not configured is never opened (nothing could
//! send it); a spool is opened only from here or from the commit task's reopen.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_spool::{RecoveryReport, Spool, SpoolError};
use tracing::{info, warn};

use super::{SpoolMetrics, ENGINE_ACK_WINDOW};
use crate::config::Config;

/// Why the spools could not be opened at start-up.
#[derive(Debug, thiserror::Error)]
pub enum SpoolStartError {
    /// The spool directory could not be opened or recovered (local; fix the disk or path).
    #[error("cannot open spool {dir}: {source}")]
    Open {
        dir: PathBuf,
        #[source]
        source: SpoolError,
    },
}

/// A spool opened (and recovered) at start-up, on its way to its shard thread.
pub struct OpenedSpool {
    pub spool: Spool,
    pub dir: PathBuf,
    pub engine: sluice_spool::SpoolConfig,
    pub metrics: Arc<SpoolMetrics>,
}

/// The spool directory of one uplink on one shard.
pub fn spool_dir(base: &Path, uplink: &str, shard: usize) -> PathBuf {
    base.join(uplink).join(format!("shard-{shard}"))
}

/// Every spool the gateway runs, opened and recovered at start-up.
#[derive(Default)]
pub struct OpenedSpools {
    /// `[uplink][shard]`.
    pub per_uplink: Vec<Vec<OpenedSpool>>,
    /// Spools of shard indexes no longer configured (the shard count went down), with
    /// unacknowledged records: `(uplink index, former shard index, spool)`. Shard
    /// `former % shards` drains them into that uplink's backlog; nothing is appended to them.
    pub former: Vec<(usize, usize, OpenedSpool)>,
}

/// Opens every (uplink, shard) spool, logging each recovery report. Directories of shard
/// indexes no longer configured are opened too and drained by a current shard (WARN); a
/// directory of an uplink that is not configured is named in a WARN and left alone (there is
/// nowhere to send it).
pub fn open_all(config: &Config, shards: usize) -> Result<OpenedSpools, SpoolStartError> {
    let Some(base) = &config.spool.dir else {
        return Ok(OpenedSpools::default());
    };
    let engine = engine_config(config, shards, config.uplink.len());
    warn_unknown_uplinks(base, config);
    let mut all = Vec::new();
    for u in &config.uplink {
        all.push(open_uplink(base, &u.name, shards, &engine)?);
    }
    let mut former = Vec::new();
    for (ui, u) in config.uplink.iter().enumerate() {
        for index in former_shards(&base.join(&u.name), shards) {
            let opened = open_one(base, &u.name, index, &engine)?;
            let (spool, dir) = (&opened.spool, &opened.dir);
            let unacked = (spool.next_seq().0 - 1).saturating_sub(spool.ack_cursor().0);
            if unacked == 0 {
                info!(uplink = %u.name, dir = %dir.display(), shards, "spool directory of a shard index no longer configured holds nothing unacknowledged; it can be removed");
                continue;
            }
            warn!(uplink = %u.name, dir = %dir.display(), shards, unacked, drained_by = index % shards, "spool directory of a shard index no longer configured (fewer shards now); a current shard drains it");
            former.push((ui, index, opened));
        }
    }
    Ok(OpenedSpools {
        per_uplink: all,
        former,
    })
}

/// The storage engine's settings for each of the spools of `uplinks` uplinks on `shards`
/// shards (the bound is one share of `spool.max_size`).
pub fn engine_config(config: &Config, shards: usize, uplinks: usize) -> sluice_spool::SpoolConfig {
    let record_max = crate::config::SpoolConfig::max_record_bytes(
        config.mqtt.max_packet_size,
        config.mqtt.max_client_id_len,
    );
    config
        .spool
        .engine_config(shards, uplinks, record_max, ENGINE_ACK_WINDOW)
}

/// `uplink`'s spools on shards `0..shards` under `base`, opened and recovered (at start, and
/// for an uplink a reload adds).
pub fn open_uplink(
    base: &Path,
    uplink: &str,
    shards: usize,
    engine: &sluice_spool::SpoolConfig,
) -> Result<Vec<OpenedSpool>, SpoolStartError> {
    (0..shards)
        .map(|shard| open_one(base, uplink, shard, engine))
        .collect()
}

/// One spool directory (`DIR/{uplink}/shard-{index}`), opened and recovered, its report
/// logged and its gauges set.
fn open_one(
    base: &Path,
    uplink: &str,
    index: usize,
    engine: &sluice_spool::SpoolConfig,
) -> Result<OpenedSpool, SpoolStartError> {
    let dir = spool_dir(base, uplink, index);
    let (spool, report) =
        Spool::open(&dir, engine.clone()).map_err(|source| SpoolStartError::Open {
            dir: dir.clone(),
            source,
        })?;
    log_recovery(index, uplink, &dir, &spool, &report);
    let metrics = Arc::new(SpoolMetrics::default());
    update_gauges(&spool, &metrics);
    Ok(OpenedSpool {
        spool,
        dir,
        engine: engine.clone(),
        metrics,
    })
}

/// Indexes of `shard-N` directories under `uplink_dir` with `N >= shards`, ascending.
fn former_shards(uplink_dir: &Path, shards: usize) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(uplink_dir) else {
        return Vec::new();
    };
    let mut v: Vec<usize> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("shard-")?
                .parse::<usize>()
                .ok()
        })
        .filter(|&n| n >= shards)
        .collect();
    v.sort_unstable();
    v
}

/// Logs one recovery report: INFO when clean, WARN naming what was skipped.
pub(super) fn log_recovery(
    shard: usize,
    uplink: &str,
    dir: &Path,
    spool: &Spool,
    r: &RecoveryReport,
) {
    let unacked = spool.next_seq().0 - 1 - spool.ack_cursor().0.min(spool.next_seq().0 - 1);
    if r.is_clean() {
        info!(
            shard,
            uplink,
            dir = %dir.display(),
            segments = r.segments_scanned,
            records = r.records_found,
            unacked,
            cursor = ?r.cursor,
            "spool recovered"
        );
    } else {
        warn!(
            shard,
            uplink,
            dir = %dir.display(),
            segments = r.segments_scanned,
            records = r.records_found,
            unacked,
            skipped_ranges = r.skipped_ranges,
            skipped_bytes = r.skipped_bytes,
            torn_tails = r.torn_tails.len(),
            quarantined = r.quarantined.len(),
            cursor = ?r.cursor,
            "spool recovered with damage skipped (see DIR/quarantine)"
        );
    }
}

/// WARN about spool directories of uplinks that are not configured.
fn warn_unknown_uplinks(base: &Path, config: &Config) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() && !config.uplink.iter().any(|u| u.name == name) {
            warn!(dir = %e.path().display(), "spool directory of an uplink that is not configured; its records are not sent");
        }
    }
}

/// The size and unacknowledged-record gauges, from the engine.
pub(super) fn update_gauges(spool: &Spool, m: &SpoolMetrics) {
    m.bytes.set(spool.total_bytes() as i64);
    m.max_bytes
        .set(i64::try_from(spool.config().max_bytes).unwrap_or(i64::MAX));
    let last = spool.next_seq().0 - 1;
    m.unacked_records
        .set(last.saturating_sub(spool.ack_cursor().0) as i64);
}
