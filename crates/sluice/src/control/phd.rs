//! The PHD association room of the control plane: the agent table and the configurations
//! the gateway has learnt.
//!
//! Owns: which IEEE 11073 agents are connected and in which state (for `/api/v1/status`),
//! the extended configurations learnt from config reports (bounded, oldest forgotten,
//! persisted as `phd-configs.json` in `[spool] dir` when there is one), their read-mostly
//! [`PhdSnapshot`] (published through `arc-swap` whenever one is learnt: shards and the
//! association tasks read it without a lock), and the PHD metrics. Does not own: sockets or
//! the protocol (`crate::edge::phd`, `sluice_proto::phd`).
//!
//! # Who touches what
//! The association tasks (thread `sluice-phd`, or a shard in the single-plane experiment)
//! update the agent table under its mutex — a few times per association, never per report —
//! and store configurations. Shards only load the snapshot.
//!
//! # `phd-configs.json`
//! `{"version":1,"configs":[{"system_id":"<16 hex>","config":<ConfigReport event-info as
//! hex>}, …]}`, oldest first; rewritten (temp file + rename) when a configuration is learnt,
//! at most once a second (what is learnt meanwhile is saved by the next learn, or when the
//! room is dropped at shutdown: a crash may forget the last second's, whose agents then
//! configure again).
//! A file that does not parse is logged and ignored (the agents then configure again).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use sluice_proto::phd::config::{standard, ObjectTable};
use sluice_proto::phd::manager::ConfigLookup;

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// How many parts the learnt configurations are split into: learning one copies only its
/// part (about `max_configs / 64` entries), not the whole map.
const BUCKETS: usize = 64;

/// Configurations learnt, as the association tasks (and the single-plane shards) read them:
/// an immutable copy, published whole through `arc-swap`, split into [`BUCKETS`] parts by
/// system id so that publishing a new one copies one part.
#[derive(Debug)]
pub struct PhdSnapshot {
    buckets: Vec<Arc<Part>>,
}

/// One part of the snapshot: (system id, config id) → table.
type Part = HashMap<([u8; 8], u16), Arc<ObjectTable>>;

impl Default for PhdSnapshot {
    fn default() -> Self {
        PhdSnapshot {
            buckets: (0..BUCKETS).map(|_| Arc::default()).collect(),
        }
    }
}

fn bucket(system_id: &[u8; 8]) -> usize {
    crate::shard::hash::jenkins_one_at_a_time(system_id) as usize % BUCKETS
}

impl PhdSnapshot {
    fn get(&self, key: &([u8; 8], u16)) -> Option<&Arc<ObjectTable>> {
        self.buckets[bucket(&key.0)].get(key)
    }

    /// A copy with `key` set (`Some`) or removed (`None`), sharing every other part.
    fn with(&self, key: ([u8; 8], u16), table: Option<Arc<ObjectTable>>) -> PhdSnapshot {
        let mut buckets = self.buckets.clone();
        let b = bucket(&key.0);
        let mut part = (*buckets[b]).clone();
        match table {
            Some(t) => part.insert(key, t),
            None => part.remove(&key),
        };
        buckets[b] = Arc::new(part);
        PhdSnapshot { buckets }
    }
}

impl ConfigLookup for PhdSnapshot {
    fn known(&self, system_id: &[u8], config_id: u16) -> Option<Arc<ObjectTable>> {
        if let Some(t) = standard_table(config_id) {
            return Some(t);
        }
        let id: [u8; 8] = system_id.try_into().ok()?;
        self.get(&(id, config_id)).cloned()
    }
}

/// The built-in tables, shared (one allocation each for the gateway's life).
fn standard_table(config_id: u16) -> Option<Arc<ObjectTable>> {
    static TABLES: std::sync::OnceLock<HashMap<u16, Arc<ObjectTable>>> = std::sync::OnceLock::new();
    TABLES
        .get_or_init(|| {
            sluice_proto::phd::config::STANDARD_IDS
                .iter()
                .filter_map(|&id| standard(id).map(|t| (id, Arc::new(t.clone()))))
                .collect()
        })
        .get(&config_id)
        .cloned()
}

/// One agent in the table.
#[derive(Debug, Clone)]
pub struct AgentEntry {
    pub specialization: &'static str,
    pub config_id: u16,
    pub state: &'static str,
    pub model: Option<String>,
    /// The shard its data goes to, once operating.
    pub shard: Option<usize>,
    pub since: Instant,
    /// The connection that holds the agent (an agent reconnecting before its old connection
    /// was seen to close must not be removed by that close).
    pub conn: u64,
}

/// Control messages by type (what a storm is made of).
#[derive(Debug, Default)]
pub struct ControlCounts {
    pub aarq: Counter,
    pub aare: Counter,
    pub config_report: Counter,
    pub config_response: Counter,
    pub rlrq: Counter,
    pub rlre: Counter,
    pub abrt_in: Counter,
    pub abrt_out: Counter,
    pub get: Counter,
    pub get_result: Counter,
    pub other: Counter,
}

#[derive(Debug, Default)]
pub struct PhdMetrics {
    pub control: ControlCounts,
    pub connections: Gauge,
    pub refused_connections: Counter,
    pub agents: Gauge,
    pub configs: Gauge,
    pub associations: Counter,
    pub rejected: Counter,
    pub configs_learnt: Counter,
    pub configs_refused: Counter,
    pub handovers: Counter,
    pub reports: Counter,
    pub reports_refused: Counter,
    pub observations: Counter,
    pub measurements: Counter,
    pub observations_skipped: Counter,
    pub reports_unassociated: Counter,
    pub violations: Counter,
    pub timeouts: Counter,
}

impl PhdMetrics {
    pub fn render(&self, w: &mut PromWriter) {
        let c = &self.control;
        for (kind, dir, v) in [
            ("aarq", "in", &c.aarq),
            ("aare", "out", &c.aare),
            ("config_report", "in", &c.config_report),
            ("config_response", "out", &c.config_response),
            ("rlrq", "in", &c.rlrq),
            ("rlre", "out", &c.rlre),
            ("abrt", "in", &c.abrt_in),
            ("abrt", "out", &c.abrt_out),
            ("get", "out", &c.get),
            ("get_result", "in", &c.get_result),
            ("other", "in", &c.other),
        ] {
            w.counter(
                "sluice_phd_control_messages_total",
                "PHD signalling APDUs (association, configuration, release, abort, MDS GET) by type and direction",
                &[("type", kind), ("direction", dir)],
                v.get(),
            );
        }
        w.gauge(
            "sluice_phd_connections",
            "PHD agent connections open",
            &[],
            self.connections.get(),
        );
        w.counter(
            "sluice_phd_refused_connections_total",
            "PHD connections closed at accept (phd.max_connections)",
            &[],
            self.refused_connections.get(),
        );
        w.gauge(
            "sluice_phd_agents",
            "PHD agents in the agent table (associated or associating)",
            &[],
            self.agents.get(),
        );
        w.gauge(
            "sluice_phd_configs",
            "Extended configurations remembered",
            &[],
            self.configs.get(),
        );
        for (name, help, v) in [
            ("sluice_phd_associations_total", "Associations accepted (known configuration or after configuring)", &self.associations),
            ("sluice_phd_rejected_total", "Association requests rejected", &self.rejected),
            ("sluice_phd_configs_learnt_total", "Configuration reports accepted", &self.configs_learnt),
            ("sluice_phd_configs_refused_total", "Configuration reports answered unsupported-config", &self.configs_refused),
            ("sluice_phd_handovers_total", "Operating agents handed from the control plane to their shard", &self.handovers),
            ("sluice_phd_reports_total", "Scan reports decoded on the shards", &self.reports),
            ("sluice_phd_reports_refused_total", "Confirmed reports answered ROER instead of confirmed: an uplink refused their data for good", &self.reports_refused),
            ("sluice_phd_observations_total", "Observations decoded", &self.observations),
            ("sluice_phd_measurements_total", "Measurements published (one SenML message each)", &self.measurements),
            ("sluice_phd_observations_skipped_total", "Observations dropped: unknown handle, length not matching the value map, special value", &self.observations_skipped),
            ("sluice_phd_reports_unassociated_total", "Reports from agents not associated (answered ABRT or ROER)", &self.reports_unassociated),
            ("sluice_phd_violations_total", "Protocol violations (malformed APDUs, APDUs not allowed in the state)", &self.violations),
            ("sluice_phd_timeouts_total", "Association, configuration or response timeouts", &self.timeouts),
        ] {
            w.counter(name, help, &[], v.get());
        }
    }
}

/// Learnt configurations, oldest first, bounded; and when they were last saved.
struct Learnt {
    order: VecDeque<([u8; 8], u16)>,
    max: usize,
    file: Option<PathBuf>,
    saved_at: Option<Instant>,
    /// Learnt since the last save (saved at most once a second, and when the room is dropped).
    dirty: bool,
}

/// Least time between two saves of `phd-configs.json`: a storm of new agents must not
/// rewrite the file for each.
const SAVE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The room.
pub struct PhdRoom {
    agents: Mutex<HashMap<[u8; 8], AgentEntry>>,
    learnt: Mutex<Learnt>,
    snapshot: ArcSwap<PhdSnapshot>,
    max_agents: usize,
    pub metrics: Arc<PhdMetrics>,
    /// Refusals and conflicts are counted every time, logged at most once a second.
    pub log_gate: LogGate,
}

/// At most one log line a second through one gate (the metrics count every event).
#[derive(Debug, Default)]
pub struct LogGate {
    /// Milliseconds since [`log_epoch`] when the gate opens next.
    next_ms: std::sync::atomic::AtomicU64,
}

fn log_epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl LogGate {
    /// Whether a line may be logged now (then closed for a second).
    pub fn open(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let now = log_epoch().elapsed().as_millis() as u64;
        let next = self.next_ms.load(Relaxed);
        now >= next
            && self
                .next_ms
                .compare_exchange(next, now + 1000, Relaxed, Relaxed)
                .is_ok()
    }
}

impl PhdRoom {
    /// A room; with `dir`, learnt configurations are loaded from and saved to
    /// `dir/phd-configs.json`.
    pub fn new(max_agents: usize, max_configs: usize, dir: Option<PathBuf>) -> PhdRoom {
        let file = dir.map(|d| d.join("phd-configs.json"));
        let metrics = Arc::new(PhdMetrics::default());
        let mut snapshot = PhdSnapshot::default();
        let mut order = VecDeque::new();
        if let Some(f) = &file {
            for (id, table) in load(f) {
                let key = (id, table.config_id);
                if snapshot.get(&key).is_none() {
                    order.push_back(key);
                }
                snapshot = snapshot.with(key, Some(Arc::new(table)));
            }
            while order.len() > max_configs.max(1) {
                if let Some(k) = order.pop_front() {
                    snapshot = snapshot.with(k, None);
                }
            }
        }
        metrics.configs.set(order.len() as i64);
        PhdRoom {
            agents: Mutex::new(HashMap::new()),
            learnt: Mutex::new(Learnt {
                order,
                max: max_configs.max(1),
                file,
                saved_at: None,
                dirty: false,
            }),
            snapshot: ArcSwap::from_pointee(snapshot),
            max_agents,
            metrics,
            log_gate: LogGate::default(),
        }
    }

    /// The configurations, as the association tasks read them.
    pub fn snapshot(&self) -> Arc<PhdSnapshot> {
        self.snapshot.load_full()
    }

    /// Store a configuration accepted from `system_id` and publish a new snapshot.
    pub fn learn(&self, system_id: [u8; 8], table: Arc<ObjectTable>) {
        if standard_table(table.config_id).is_some_and(|t| *t == *table) {
            return; // a standard table: known to everybody already
        }
        let mut learnt = self.learnt.lock().unwrap_or_else(|e| e.into_inner());
        let key = (system_id, table.config_id);
        let current = self.snapshot.load();
        if current.get(&key).is_none() {
            learnt.order.push_back(key);
        }
        let mut next = current.with(key, Some(table));
        while learnt.order.len() > learnt.max {
            if let Some(old) = learnt.order.pop_front() {
                next = next.with(old, None);
            }
        }
        self.metrics.configs.set(learnt.order.len() as i64);
        self.snapshot.store(Arc::new(next));
        learnt.dirty = true;
        if learnt.saved_at.is_none_or(|t| t.elapsed() >= SAVE_EVERY) {
            self.save(&mut learnt);
        }
    }

    /// Save the learnt configurations now if any were learnt since the last save.
    pub fn flush(&self) {
        let mut learnt = self.learnt.lock().unwrap_or_else(|e| e.into_inner());
        self.save(&mut learnt);
    }

    fn save(&self, learnt: &mut Learnt) {
        if !learnt.dirty {
            return;
        }
        if let Some(f) = &learnt.file {
            save(f, &learnt.order, &self.snapshot.load());
        }
        learnt.saved_at = Some(Instant::now());
        learnt.dirty = false;
    }

    /// Put or update an agent; `false` when the table is full (the AARQ is then refused).
    pub fn agent_up(&self, system_id: [u8; 8], entry: AgentEntry) -> bool {
        let mut agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        if !agents.contains_key(&system_id) && agents.len() >= self.max_agents {
            return false;
        }
        agents.insert(system_id, entry);
        self.metrics.agents.set(agents.len() as i64);
        true
    }

    /// Change an agent's fields in place.
    pub fn update(&self, system_id: &[u8; 8], f: impl FnOnce(&mut AgentEntry)) {
        let mut agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = agents.get_mut(system_id) {
            f(a);
        }
    }

    /// Connection `conn` no longer holds `system_id`.
    pub fn agent_down(&self, system_id: &[u8; 8], conn: u64) {
        let mut agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        if agents.get(system_id).is_some_and(|a| a.conn == conn) {
            agents.remove(system_id);
        }
        self.metrics.agents.set(agents.len() as i64);
    }

    /// Whether the table has room for a new agent (without taking it).
    pub fn has_room(&self, system_id: &[u8; 8]) -> bool {
        let agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        agents.contains_key(system_id) || agents.len() < self.max_agents
    }

    /// The agent table for `/api/v1/status` (at most `limit` agents listed).
    pub fn status(&self, limit: usize) -> serde_json::Value {
        let agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        let list: Vec<_> = agents
            .iter()
            .take(limit)
            .map(|(id, a)| {
                serde_json::json!({
                    "system_id": hex(id),
                    "specialization": a.specialization,
                    "config_id": format!("0x{:04x}", a.config_id),
                    "state": a.state,
                    "model": a.model,
                    "shard": a.shard,
                    "for_seconds": a.since.elapsed().as_secs(),
                })
            })
            .collect();
        serde_json::json!({
            "agents": agents.len(),
            "configs": self.metrics.configs.get(),
            "list": list,
        })
    }
}

impl Drop for PhdRoom {
    fn drop(&mut self) {
        self.flush();
    }
}

/// An EUI-64 as 16 lowercase hex digits.
pub use sluice_proto::phd::measure::hex;

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn load(file: &std::path::Path) -> Vec<([u8; 8], ObjectTable)> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(error) => {
            tracing::warn!(file = %file.display(), %error, "cannot read the learnt PHD configurations; agents will configure again");
            return Vec::new();
        }
    };
    let parsed = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v["configs"]
                .as_array()?
                .iter()
                .map(|c| {
                    let id: [u8; 8] = unhex(c["system_id"].as_str()?)?.try_into().ok()?;
                    let table =
                        ObjectTable::decode_report(Bytes::from(unhex(c["config"].as_str()?)?))
                            .ok()?;
                    table.check().ok()?;
                    Some((id, table))
                })
                .collect::<Option<Vec<_>>>()
        });
    parsed.unwrap_or_else(|| {
        tracing::warn!(file = %file.display(), "learnt PHD configurations do not parse; ignored (agents will configure again)");
        Vec::new()
    })
}

fn save(file: &std::path::Path, order: &VecDeque<([u8; 8], u16)>, tables: &PhdSnapshot) {
    let configs: Vec<_> = order
        .iter()
        .filter_map(|k| {
            let t = tables.get(k)?;
            Some(serde_json::json!({ "system_id": hex(&k.0), "config": hex(&t.encode_report()) }))
        })
        .collect();
    let text = serde_json::json!({ "version": 1, "configs": configs }).to_string();
    let tmp = file.with_extension("json.tmp");
    let result = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, file));
    if let Err(error) = result {
        tracing::warn!(file = %file.display(), %error, "cannot save the learnt PHD configurations");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::phd::config::{attr, class, MetricObject};

    fn table(config_id: u16) -> Arc<ObjectTable> {
        Arc::new(ObjectTable {
            config_id,
            objects: vec![MetricObject {
                class: class::METRIC_NU,
                handle: 1,
                kind: (2, 0x4BB8),
                unit: Some(0x0220),
                value_map: vec![(attr::NU_VAL_OBS_BASIC, 2)],
                components: vec![],
            }],
        })
    }

    #[test]
    fn learnt_configs_are_bounded_persisted_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let room = PhdRoom::new(10, 2, Some(dir.path().to_path_buf()));
        for (i, id) in [0x4000u16, 0x4001, 0x4002].into_iter().enumerate() {
            room.learn([i as u8; 8], table(id));
        }
        room.flush(); // the last ones came within a second of the first save
        let snap = room.snapshot();
        assert!(
            snap.known(&[0; 8], 0x4000).is_none(),
            "the oldest is forgotten"
        );
        assert!(snap.known(&[2; 8], 0x4002).is_some());
        assert!(snap.known(&[2; 8], 0x4001).is_none(), "kept per agent");
        assert!(
            snap.known(&[9; 8], 0x0190).is_some(),
            "standard ones for everybody"
        );
        let again = PhdRoom::new(10, 2, Some(dir.path().to_path_buf()));
        let snap = again.snapshot();
        assert_eq!(snap.known(&[1; 8], 0x4001), Some(table(0x4001)));
        assert_eq!(snap.known(&[2; 8], 0x4002), Some(table(0x4002)));
        assert_eq!(again.metrics.configs.get(), 2);
    }

    #[test]
    fn the_agent_table_is_bounded() {
        let room = PhdRoom::new(1, 1, None);
        let entry = AgentEntry {
            specialization: "pulse-oximeter",
            config_id: 0x0190,
            state: "operating",
            model: None,
            shard: None,
            since: Instant::now(),
            conn: 1,
        };
        assert!(room.agent_up([1; 8], entry.clone()));
        assert!(!room.agent_up([2; 8], entry.clone()));
        assert!(
            room.agent_up([1; 8], AgentEntry { conn: 2, ..entry }),
            "the same agent again"
        );
        room.agent_down(&[1; 8], 1);
        assert_eq!(
            room.metrics.agents.get(),
            1,
            "the old connection's close leaves the new one"
        );
        room.agent_down(&[1; 8], 2);
        assert_eq!(room.metrics.agents.get(), 0);
    }
}
