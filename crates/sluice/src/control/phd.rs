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
//! # Bounds
//! The agent table holds at most `max_agents` entries, each with its strings cut to
//! [`MAX_AGENT_TEXT`] bytes (an agent's MDS GET answer may carry 64 KiB of model text): at
//! most `max_agents ×` [`AGENT_BYTES_MAX`] bytes, shown as `sluice_phd_agent_table_bytes`.
//! `/api/v1/status` copies at most [`STATUS_AGENTS`] entries out under the lock and gives the
//! count of all. Learnt configurations: at most `max_configs`, each a checked object table
//! (bounded by `max_apdu`).
//!
//! # Who touches what
//! The association tasks (thread `sluice-phd`, or a shard in the single-plane experiment)
//! update the agent table under its mutex — a few times per association, never per report —
//! and store configurations. Shards only load the snapshot.
//!
//! # Who owns a configuration
//! A configuration learnt is bound to the agent that taught it, and on plain TCP an agent
//! has no identity but the system id its AARQ claims and the address it comes from: **the
//! first agent to teach a configuration for a system id and config id owns it**, and the
//! learnt table is **trusted without re-teaching only from the identity that taught it** —
//! the teacher's IP address (not its port) on plain TCP, its certificate CN with `[phd.tls]`
//! client certificates. An AARQ claiming a learnt (system id, config id) from another
//! address (and no certificate identity that matches) is answered accepted-unknown-config,
//! as for an unknown configuration ([`Claim`]), so the agent sends its table: an identical
//! one is accepted (the teacher stays the original one; counted in
//! `sluice_phd_config_reconfirmed_total`), a different one is a conflict (below). So an
//! impostor that teaches *first*, from another address, cannot make the genuine agent's
//! reports be decoded with its table: the genuine agent is asked, differs, and is refused
//! rather than misread. A later config report with a
//! *different* table for the same (system id, config id) — another device claiming that
//! system id — is refused ([`ConfigLookup::may_learn`]: unsupported-config, then ABRT),
//! counted in `sluice_phd_config_conflicts_total` and logged with both addresses (the
//! refused connection's and the teacher's), unless `[phd] allow_relearn`. The binding is the
//! stored table itself, so it survives restarts with `phd-configs.json`; a configuration
//! forgotten (beyond `max_configs`, oldest first) is unbound and may be taught anew. The
//! same table taught again is accepted (an agent that lost its association, or moved to
//! another address). A device
//! whose table really changed must use a new config id (20601 requires it) or the operator
//! sets `allow_relearn` (or deletes its entry). `[phd] agents` limits which system ids
//! associate at all.
//!
//! With `[phd.tls]` and client certificates the identity is the system id **and** the
//! certificate's subject CN: each configuration learnt records the CN that taught it
//! (`None` without a certificate), and an AARQ claiming a system id whose configurations
//! were taught by another CN — or by a certificate while this agent shows none, or the
//! other way round — is rejected-unauthorized ([`PhdSnapshot::owned_by_another`]), counted
//! in `sluice_phd_identity_refused_total`, unless `allow_relearn`. A system id that only
//! ever used standard configurations has nothing learnt and so no owner.
//!
//! # `phd-configs.json`
//! `{"version":1,"configs":[{"system_id":"<16 hex>","config":<ConfigReport event-info as
//! hex>,"taught_by":"<ip:port>","identity":"<client certificate CN>"}, …]}` (`taught_by`
//! optional: the log, and its IP is the address trusted after a restart — without it every
//! agent is asked for its table once; `identity` present when a certificate identity taught
//! it), oldest
//! first; rewritten (temp file + rename) when a configuration is learnt,
//! at most once a second (what is learnt meanwhile is saved by the next learn, or when the
//! room is dropped at shutdown: a crash may forget the last second's, whose agents then
//! configure again).
//! A file that does not parse is logged and ignored (the agents then configure again).

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
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
    /// `[phd] allow_relearn`: a different table may replace a learnt one.
    allow_relearn: bool,
}

/// One part of the snapshot: (system id, config id) → what was learnt.
type Part = HashMap<([u8; 8], u16), Learned>;

/// A configuration learnt and who taught it.
#[derive(Debug, Clone)]
struct Learned {
    table: Arc<ObjectTable>,
    /// The certificate identity (CN) of the agent that taught it (`None`: plain TCP or no
    /// client certificate): the owner of its system id.
    owner: Option<Arc<str>>,
    /// The IP address the teacher's connection came from (`None`: not known): without a
    /// certificate identity, the only address from which the table is trusted at the AARQ.
    teacher_ip: Option<IpAddr>,
}

impl Default for PhdSnapshot {
    fn default() -> Self {
        PhdSnapshot {
            buckets: (0..BUCKETS).map(|_| Arc::default()).collect(),
            allow_relearn: false,
        }
    }
}

fn bucket(system_id: &[u8; 8]) -> usize {
    crate::shard::hash::jenkins_one_at_a_time(system_id) as usize % BUCKETS
}

impl PhdSnapshot {
    fn get(&self, key: &([u8; 8], u16)) -> Option<&Arc<ObjectTable>> {
        self.buckets[bucket(&key.0)].get(key).map(|l| &l.table)
    }

    fn owner(&self, key: &([u8; 8], u16)) -> Option<&Arc<str>> {
        self.buckets[bucket(&key.0)].get(key)?.owner.as_ref()
    }

    /// Whether an agent with certificate identity `identity` (`None`: none) claiming
    /// `system_id` is someone else than the agent that taught that system id's
    /// configurations (and re-learning is not allowed). Looks through one part (about
    /// `max_configs / 64` entries).
    pub fn owned_by_another(&self, system_id: &[u8; 8], identity: Option<&str>) -> bool {
        !self.allow_relearn
            && self.buckets[bucket(system_id)]
                .iter()
                .any(|(k, l)| k.0 == *system_id && l.owner.as_deref() != identity)
    }

    /// Whether the learnt configuration `(system_id, config_id)` may be used for an agent
    /// connecting from `peer` with certificate identity `identity` without asking it for its
    /// table: yes for a standard configuration and for nothing learnt (nothing to trust); for
    /// a table taught with a certificate identity, when `identity` is that one; otherwise
    /// when `peer` is the teacher's IP address (module docs).
    pub fn trusted(
        &self,
        system_id: &[u8; 8],
        config_id: u16,
        peer: Option<IpAddr>,
        identity: Option<&str>,
    ) -> bool {
        if standard_table(config_id).is_some() {
            return true;
        }
        let Some(l) = self.buckets[bucket(system_id)].get(&(*system_id, config_id)) else {
            return true;
        };
        match &l.owner {
            Some(owner) => identity == Some(&**owner),
            None => l.teacher_ip.is_some() && l.teacher_ip == peer,
        }
    }

    /// A copy with `key` set (`Some`) or removed (`None`), sharing every other part.
    fn with(&self, key: ([u8; 8], u16), table: Option<Learned>) -> PhdSnapshot {
        let mut buckets = self.buckets.clone();
        let b = bucket(&key.0);
        let mut part = (*buckets[b]).clone();
        match table {
            Some(t) => part.insert(key, t),
            None => part.remove(&key),
        };
        buckets[b] = Arc::new(part);
        PhdSnapshot {
            buckets,
            allow_relearn: self.allow_relearn,
        }
    }

    /// Whether `table` for `system_id` conflicts with a learnt one: a different table is
    /// stored for the same system id and config id (and re-learning is not allowed).
    fn conflicts(&self, system_id: &[u8; 8], table: &ObjectTable) -> bool {
        !self.allow_relearn
            && self
                .get(&(*system_id, table.config_id))
                .is_some_and(|known| **known != *table)
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

    /// First come, first bound: a configuration learnt for a system id is never replaced by
    /// a different table for the same config id, unless `[phd] allow_relearn` (module docs).
    fn may_learn(&self, system_id: &[u8], table: &ObjectTable) -> bool {
        let Ok(id) = <[u8; 8]>::try_from(system_id) else {
            return false;
        };
        !self.conflicts(&id, table)
    }
}

/// What an agent's association sees of the learnt configurations: the snapshot, except that
/// a learnt table is not [`ConfigLookup::known`] to an agent from another address (or
/// certificate identity) than its teacher's — that agent is answered accepted-unknown-config
/// and must send its table, which [`ConfigLookup::may_learn`] then compares with the stored
/// one (module docs).
pub struct Claim<'a> {
    pub snapshot: &'a PhdSnapshot,
    /// The agent connection's peer IP address (`None`: not known, never trusted).
    pub peer: Option<IpAddr>,
    /// The agent's certificate identity (CN), with `[phd.tls]` client certificates.
    pub identity: Option<&'a str>,
}

impl ConfigLookup for Claim<'_> {
    fn known(&self, system_id: &[u8], config_id: u16) -> Option<Arc<ObjectTable>> {
        let id: [u8; 8] = system_id.try_into().ok()?;
        if !self
            .snapshot
            .trusted(&id, config_id, self.peer, self.identity)
        {
            return None;
        }
        self.snapshot.known(system_id, config_id)
    }

    fn may_learn(&self, system_id: &[u8], table: &ObjectTable) -> bool {
        self.snapshot.may_learn(system_id, table)
    }
}

/// What [`PhdRoom::learn`] did with a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taught {
    /// Stored (or a standard table, known to everybody already).
    New,
    /// The same table was stored already: nothing changes, its teacher stays.
    Same,
    /// A different table is stored for the same key (and re-learning is not allowed): the
    /// stored one stays.
    Conflict,
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

/// Longest agent string kept in the table, in bytes (cut at a character boundary; counted in
/// `sluice_phd_agent_strings_truncated_total`): the MDS model ("manufacturer model") today.
pub const MAX_AGENT_TEXT: usize = 64;

/// What one agent takes in the table besides its strings: key, entry and the map's share
/// (hashbrown: a control byte and at most 1/8 empty slots; rounded up).
const AGENT_ENTRY_BYTES: usize = std::mem::size_of::<([u8; 8], AgentEntry)>() * 9 / 8 + 8;

/// What one agent may take in the table at most, strings included: the agent table is bounded
/// by `max_agents ×` this (docs/memory.md).
pub const AGENT_BYTES_MAX: usize = AGENT_ENTRY_BYTES + MAX_AGENT_TEXT;

/// Agents listed in `/api/v1/status` at most (the count covers all of them).
pub const STATUS_AGENTS: usize = 100;

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
    pub agent_table_bytes: Gauge,
    pub agent_strings_truncated: Counter,
    pub configs: Gauge,
    pub associations: Counter,
    pub rejected: Counter,
    pub configs_learnt: Counter,
    pub config_reconfirmed: Counter,
    pub configs_refused: Counter,
    pub config_conflicts: Counter,
    pub agents_not_allowed: Counter,
    pub identity_refused: Counter,
    pub tls_failures: Counter,
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
            "sluice_phd_agent_table_bytes",
            "Bytes the PHD agent table holds (entries and their strings; at most max_agents x the per-agent bound)",
            &[],
            self.agent_table_bytes.get(),
        );
        w.counter(
            "sluice_phd_agent_strings_truncated_total",
            "Agent strings (MDS model) cut to 64 bytes before being kept",
            &[],
            self.agent_strings_truncated.get(),
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
            ("sluice_phd_configs_learnt_total", "Configuration reports accepted and stored (a new table)", &self.configs_learnt),
            ("sluice_phd_config_reconfirmed_total", "Configuration reports identical to the stored table, sent by an agent asked again (from another address than its teacher's): accepted, the teacher stays", &self.config_reconfirmed),
            ("sluice_phd_configs_refused_total", "Configuration reports answered unsupported-config", &self.configs_refused),
            ("sluice_phd_config_conflicts_total", "Configuration reports refused (then aborted): another table for a system id and config id another agent taught first", &self.config_conflicts),
            ("sluice_phd_agents_not_allowed_total", "Association requests rejected-unauthorized: system id not in [phd] agents", &self.agents_not_allowed),
            ("sluice_phd_identity_refused_total", "Association requests rejected-unauthorized: the system id's configurations were taught by another certificate identity (or none)", &self.identity_refused),
            ("sluice_phd_tls_failures_total", "PHD connections closed in the TLS handshake (bad or missing client certificate, not TLS, timeout)", &self.tls_failures),
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
    /// Who taught each configuration (the peer address of the connection; for the log line
    /// of a conflict). Same keys as `order` (when known).
    taught_by: HashMap<([u8; 8], u16), SocketAddr>,
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
    agents: Mutex<AgentTable>,
    learnt: Mutex<Learnt>,
    snapshot: ArcSwap<PhdSnapshot>,
    max_agents: usize,
    pub metrics: Arc<PhdMetrics>,
    /// Refusals and conflicts are counted every time, logged at most once a second.
    pub log_gate: LogGate,
}

/// The agent table and what its strings take.
#[derive(Default)]
struct AgentTable {
    map: HashMap<[u8; 8], AgentEntry>,
    /// Bytes of the entries' strings (each at most [`MAX_AGENT_TEXT`]).
    text_bytes: usize,
}

fn text_len(a: &AgentEntry) -> usize {
    a.model.as_ref().map_or(0, String::capacity)
}

/// Cut `text` to [`MAX_AGENT_TEXT`] bytes at a character boundary; whether it was cut.
fn bound_text(text: &mut String) -> bool {
    if text.len() <= MAX_AGENT_TEXT {
        text.shrink_to_fit();
        return false;
    }
    let mut end = MAX_AGENT_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.shrink_to_fit();
    true
}

impl AgentTable {
    /// Bound the strings of `a` (counting what was cut).
    fn bound(a: &mut AgentEntry, metrics: &PhdMetrics) {
        if let Some(m) = a.model.as_mut() {
            if bound_text(m) {
                metrics.agent_strings_truncated.inc();
            }
        }
    }

    fn publish(&self, metrics: &PhdMetrics) {
        metrics.agents.set(self.map.len() as i64);
        metrics
            .agent_table_bytes
            .set((self.map.len() * AGENT_ENTRY_BYTES + self.text_bytes) as i64);
    }
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
    pub fn new(
        max_agents: usize,
        max_configs: usize,
        dir: Option<PathBuf>,
        allow_relearn: bool,
    ) -> PhdRoom {
        let file = dir.map(|d| d.join("phd-configs.json"));
        let metrics = Arc::new(PhdMetrics::default());
        let mut snapshot = PhdSnapshot {
            allow_relearn,
            ..PhdSnapshot::default()
        };
        let mut order = VecDeque::new();
        let mut taught_by = HashMap::new();
        if let Some(f) = &file {
            for (id, table, by, owner) in load(f) {
                let key = (id, table.config_id);
                if snapshot.get(&key).is_none() {
                    order.push_back(key);
                }
                if let Some(by) = by {
                    taught_by.insert(key, by);
                }
                let table = Arc::new(table);
                let teacher_ip = by.map(|a| a.ip());
                snapshot = snapshot.with(
                    key,
                    Some(Learned {
                        table,
                        owner,
                        teacher_ip,
                    }),
                );
            }
            while order.len() > max_configs.max(1) {
                if let Some(k) = order.pop_front() {
                    snapshot = snapshot.with(k, None);
                    taught_by.remove(&k);
                }
            }
        }
        metrics.configs.set(order.len() as i64);
        PhdRoom {
            agents: Mutex::new(AgentTable::default()),
            learnt: Mutex::new(Learnt {
                order,
                taught_by,
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

    /// Store a configuration accepted from `system_id` (taught over the connection from
    /// `by`, by the agent with certificate identity `owner`) and publish a new snapshot.
    /// [`Taught::Same`] when that very table is stored already: nothing changes (its teacher
    /// stays: an agent re-sending it from another address does not move the trust there).
    /// [`Taught::Conflict`] when a different table for the same key was learnt meanwhile and
    /// re-learning is not allowed: the first one stays (the association tasks check
    /// [`ConfigLookup::may_learn`] first; this closes the race between two single-plane
    /// shards).
    pub fn learn(
        &self,
        system_id: [u8; 8],
        table: Arc<ObjectTable>,
        by: Option<SocketAddr>,
        owner: Option<Arc<str>>,
    ) -> Taught {
        if standard_table(table.config_id).is_some_and(|t| *t == *table) {
            return Taught::New; // a standard table: known to everybody already
        }
        let mut learnt = self.learnt.lock().unwrap_or_else(|e| e.into_inner());
        let key = (system_id, table.config_id);
        let current = self.snapshot.load();
        if current.get(&key).is_some_and(|known| **known == *table) {
            return Taught::Same;
        }
        if current.conflicts(&system_id, &table) {
            return Taught::Conflict;
        }
        if current.get(&key).is_none() {
            learnt.order.push_back(key);
        }
        match by {
            Some(by) => learnt.taught_by.insert(key, by),
            None => learnt.taught_by.remove(&key),
        };
        let teacher_ip = by.map(|a| a.ip());
        let mut next = current.with(
            key,
            Some(Learned {
                table,
                owner,
                teacher_ip,
            }),
        );
        while learnt.order.len() > learnt.max {
            if let Some(old) = learnt.order.pop_front() {
                next = next.with(old, None);
                learnt.taught_by.remove(&old);
            }
        }
        self.metrics.configs.set(learnt.order.len() as i64);
        self.snapshot.store(Arc::new(next));
        learnt.dirty = true;
        if learnt.saved_at.is_none_or(|t| t.elapsed() >= SAVE_EVERY) {
            self.save(&mut learnt);
        }
        Taught::New
    }

    /// The address of a connection that taught one of `system_id`'s configurations (for the
    /// log line of a refusal; looks through all of them).
    pub fn taught_by_any(&self, system_id: &[u8; 8]) -> Option<SocketAddr> {
        let learnt = self.learnt.lock().unwrap_or_else(|e| e.into_inner());
        learnt
            .taught_by
            .iter()
            .find_map(|(k, a)| (k.0 == *system_id).then_some(*a))
    }

    /// The address of the connection that taught the configuration `(system_id, config_id)`.
    pub fn taught_by(&self, system_id: &[u8; 8], config_id: u16) -> Option<SocketAddr> {
        let learnt = self.learnt.lock().unwrap_or_else(|e| e.into_inner());
        learnt.taught_by.get(&(*system_id, config_id)).copied()
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
            save(f, &learnt.order, &learnt.taught_by, &self.snapshot.load());
        }
        learnt.saved_at = Some(Instant::now());
        learnt.dirty = false;
    }

    /// Put or update an agent; `false` when the table is full (the AARQ is then refused).
    pub fn agent_up(&self, system_id: [u8; 8], mut entry: AgentEntry) -> bool {
        AgentTable::bound(&mut entry, &self.metrics);
        let mut t = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        if !t.map.contains_key(&system_id) && t.map.len() >= self.max_agents {
            return false;
        }
        t.text_bytes += text_len(&entry);
        if let Some(old) = t.map.insert(system_id, entry) {
            t.text_bytes -= text_len(&old);
        }
        t.publish(&self.metrics);
        true
    }

    /// Change an agent's fields in place (its strings are bounded after).
    pub fn update(&self, system_id: &[u8; 8], f: impl FnOnce(&mut AgentEntry)) {
        let mut t = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *t;
        if let Some(a) = t.map.get_mut(system_id) {
            let before = text_len(a);
            f(a);
            AgentTable::bound(a, &self.metrics);
            t.text_bytes = t.text_bytes - before + text_len(a);
            t.publish(&self.metrics);
        }
    }

    /// Connection `conn` no longer holds `system_id`.
    pub fn agent_down(&self, system_id: &[u8; 8], conn: u64) {
        let mut t = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        if t.map.get(system_id).is_some_and(|a| a.conn == conn) {
            if let Some(old) = t.map.remove(system_id) {
                t.text_bytes -= text_len(&old);
            }
        }
        t.publish(&self.metrics);
    }

    /// Whether the table has room for a new agent (without taking it).
    pub fn has_room(&self, system_id: &[u8; 8]) -> bool {
        let t = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        t.map.contains_key(system_id) || t.map.len() < self.max_agents
    }

    /// The agent table for `/api/v1/status`: the count of all agents and at most `limit` of
    /// them listed. Only a bounded copy (entries with strings of at most
    /// [`MAX_AGENT_TEXT`] bytes) is taken under the table's lock; the JSON is built after.
    pub fn status(&self, limit: usize) -> serde_json::Value {
        let (total, copied): (usize, Vec<([u8; 8], AgentEntry)>) = {
            let t = self.agents.lock().unwrap_or_else(|e| e.into_inner());
            let copied = t
                .map
                .iter()
                .take(limit)
                .map(|(id, a)| (*id, a.clone()))
                .collect();
            (t.map.len(), copied)
        };
        let list: Vec<_> = copied
            .iter()
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
            "agents": total,
            "listed": list.len(),
            "configs": self.metrics.configs.get(),
            "list": list,
        })
    }
}

impl PhdRoom {
    /// Agents whose data goes to each of `shards` shards (operating agents only), for the
    /// dashboard's devices-per-shard view. Walks the (bounded) table under its lock.
    pub fn agents_per_shard(&self, shards: usize) -> Vec<u64> {
        let mut counts = vec![0u64; shards];
        let t = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        for a in t.map.values() {
            if let Some(c) = a.shard.and_then(|s| counts.get_mut(s)) {
                *c += 1;
            }
        }
        counts
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

/// One configuration of the file: system id, table, who taught it (address, identity).
type Stored = ([u8; 8], ObjectTable, Option<SocketAddr>, Option<Arc<str>>);

fn load(file: &std::path::Path) -> Vec<Stored> {
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
                    let by = c["taught_by"].as_str().and_then(|a| a.parse().ok());
                    let owner = c["identity"].as_str().map(Arc::from);
                    Some((id, table, by, owner))
                })
                .collect::<Option<Vec<_>>>()
        });
    parsed.unwrap_or_else(|| {
        tracing::warn!(file = %file.display(), "learnt PHD configurations do not parse; ignored (agents will configure again)");
        Vec::new()
    })
}

fn save(
    file: &std::path::Path,
    order: &VecDeque<([u8; 8], u16)>,
    taught_by: &HashMap<([u8; 8], u16), SocketAddr>,
    tables: &PhdSnapshot,
) {
    let configs: Vec<_> = order
        .iter()
        .filter_map(|k| {
            let t = tables.get(k)?;
            let mut c =
                serde_json::json!({ "system_id": hex(&k.0), "config": hex(&t.encode_report()) });
            if let Some(by) = taught_by.get(k) {
                c["taught_by"] = by.to_string().into();
            }
            if let Some(owner) = tables.owner(k) {
                c["identity"] = owner.to_string().into();
            }
            Some(c)
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
mod tests;
