//! Reload without restart: what `SIGHUP` and `POST /api/v1/reload` do to a running gateway.
//!
//! Owns: [`Reloader`] — re-reading and validating the config file (and the files it names:
//! the ACL file, certificates), deciding which changes can be applied while devices stay
//! connected and which need a restart, applying the former through the handles the running
//! threads read, and the outcome ([`ReloadOutcome`]), its log line and its counter
//! (`sluice_reloads_total{result}`). Does not own: catching the signal (`main.rs`), the HTTP
//! route and its bearer-token rule (`admin/`), or the snapshots themselves — each is owned by
//! its module and replaced through its handle: the priority table and `[limits]` publish rate
//! (`control::live::Rules`), each uplink's forward filters and topic mapping
//! (`sink::UplinkRoute`), the ACL (`control::acl::Acl`), the logins
//! (`control::admission::Logins`), the listener's connection limits
//! (`control::limits::ConnectLimits`), the device listener's TLS configuration
//! (`edge::mqtt::listener::TlsPolicy`), each TLS uplink's roots and client certificate
//! (`sink::ReloadableClientTls`) and the log filter (`telemetry::set_log_level`).
//!
//! Invariants:
//! - All or nothing: everything that can fail (reading and validating the file, compiling
//!   the ACL, reading and parsing certificates, parsing the log filter) is done before the
//!   first handle is touched; a refused file changes nothing, and the reason is returned,
//!   logged (WARN) and counted (`result="invalid"`).
//! - No lock on the data path: the control side builds each new immutable snapshot and
//!   stores it with `arc-swap`; shards, the listener and transports keep reading with one
//!   atomic load. No device connection is closed by a reload.
//! - An added uplink (MQTT or oneM2M, with or without `paths` or a spool, not `install_tc`;
//!   ADR 0013) is attached on every shard through its mailbox (`ShardCmd::AttachSink`) after
//!   its TLS is built and its spools opened, and gets its entry in the admin's table (`uplinks.rs`); it is remembered
//!   (`Applied::added`) so a later reload neither attaches it again nor names it.
//! - Restart-only changes (listen addresses, shard count, spool, lanes, uplinks removed,
//!   functions, …) are never half-applied: they are named in the answer and the log
//!   (`result="restart_needed"`), and the parts of the same file that can change live are
//!   applied. They are compared with the configuration the gateway started with, so each
//!   later reload names them again until a restart.
//! - Reloads are serialized (one mutex, held only by reloads: a signal and a request never
//!   interleave).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::telemetry::metrics::{Counter, PromWriter};

use super::RunningGateway;

mod diff;
mod sinks;

use diff::{changed_keys, file_changed, is_live, watched_files};
use sinks::{attachable, ClientTls};

/// Who asked for a reload (named in the log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadTrigger {
    Signal,
    Api,
}

impl ReloadTrigger {
    fn as_str(self) -> &'static str {
        match self {
            ReloadTrigger::Signal => "SIGHUP",
            ReloadTrigger::Api => "POST /api/v1/reload",
        }
    }
}

/// What a reload found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// The file is valid. `applied`: the settings now in force (dotted keys, e.g.
    /// `uplink.cloud.forward`, `priority`, `mqtt.tls certificate`); `restart_needed`: the
    /// settings that differ from what the gateway runs with and take effect only at the next
    /// restart. Both empty: nothing differs.
    Done {
        applied: Vec<String>,
        restart_needed: Vec<String>,
    },
    /// The file (or a file it names) cannot be read or is not valid; nothing changed.
    Invalid(String),
}

impl ReloadOutcome {
    /// The `result` label of `sluice_reloads_total`.
    pub fn label(&self) -> &'static str {
        match self {
            ReloadOutcome::Done {
                restart_needed,
                applied,
            } => {
                if !restart_needed.is_empty() {
                    "restart_needed"
                } else if !applied.is_empty() {
                    "applied"
                } else {
                    "unchanged"
                }
            }
            ReloadOutcome::Invalid(_) => "invalid",
        }
    }

    /// The JSON answer of `POST /api/v1/reload`.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            ReloadOutcome::Done {
                applied,
                restart_needed,
            } => serde_json::json!({
                "result": self.label(),
                "applied": applied,
                "restart_needed": restart_needed,
            }),
            ReloadOutcome::Invalid(error) => serde_json::json!({
                "result": "invalid",
                "error": error,
            }),
        }
    }
}

/// Reloads asked for, by outcome.
#[derive(Debug, Default)]
pub struct ReloadMetrics {
    unchanged: Counter,
    applied: Counter,
    restart_needed: Counter,
    invalid: Counter,
}

impl ReloadMetrics {
    fn count(&self, outcome: &ReloadOutcome) {
        match outcome.label() {
            "unchanged" => self.unchanged.inc(),
            "applied" => self.applied.inc(),
            "restart_needed" => self.restart_needed.inc(),
            _ => self.invalid.inc(),
        }
    }

    pub fn render(&self, w: &mut PromWriter) {
        for (result, c) in [
            ("unchanged", &self.unchanged),
            ("applied", &self.applied),
            ("restart_needed", &self.restart_needed),
            ("invalid", &self.invalid),
        ] {
            w.counter(
                "sluice_reloads_total",
                "Configuration reloads asked for (SIGHUP, POST /api/v1/reload), by result: unchanged, applied (every change in force), restart_needed (what could change live was applied; some changes wait for a restart), invalid (refused, nothing changed).",
                &[("result", result)],
                c.get(),
            );
        }
    }
}

/// The handles through which a reload replaces what the running threads read.
pub(super) struct LiveHandles {
    pub rules: Arc<crate::control::live::Rules>,
    /// Per uplink of the configuration the gateway started with (same order).
    pub routes: Vec<crate::sink::UplinkRoute>,
    /// Per uplink (same order): its TLS roots and client certificate (`None`: no TLS).
    pub uplink_tls: Vec<Option<Arc<crate::sink::ReloadableClientTls>>>,
    pub acl: Arc<crate::control::acl::Acl>,
    pub logins: Arc<arc_swap::ArcSwap<crate::control::admission::Logins>>,
    pub connect_limits: Arc<crate::control::limits::ConnectLimits>,
    /// `[mqtt.tls]`'s listener policy (shared by the tls and wss listeners), if any.
    pub device_tls: Option<Arc<crate::edge::mqtt::listener::TlsPolicy>>,
    /// Every shard's mailbox: an added uplink is attached through it (ADR 0013).
    pub shards: Vec<tokio::sync::mpsc::Sender<crate::shard::ShardCmd>>,
    /// The admin's table of sinks: an added uplink gets its entry there.
    pub table: Arc<super::uplinks::UplinkTable>,
    /// Every function and its runtime: a reload adds and removes them.
    pub functions: Arc<crate::functions::live::FunctionSet>,
}

/// How long a reload waits for every shard to attach an added uplink before it answers
/// (the entry then stays `attaching` until they do).
const ATTACH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Re-reads the config file and applies what can change live (see the module docs).
pub struct Reloader {
    /// The file `sluice run -c` was given (`None`: started on the embedded defaults).
    path: Option<PathBuf>,
    /// What the gateway started with: restart-only settings are compared with it.
    started: Arc<Config>,
    /// The last configuration whose live settings are in force, and what the files it names
    /// held then; the mutex serializes reloads.
    state: Mutex<Applied>,
    handles: LiveHandles,
    metrics: ReloadMetrics,
}

struct Applied {
    config: Arc<Config>,
    /// Uplinks a reload attached (not in the configuration the gateway started with), with
    /// the settings they were attached with and their route handle.
    added: Vec<Added>,
    /// Uplinks of the configuration the gateway started with that a reload removed live:
    /// their started settings no longer count (added again, they are in `added`).
    removed: Vec<String>,
    /// A fingerprint of the ACL file, the device certificates and each uplink's certificate
    /// files when last applied: a file changed under the same name is applied too. (Not the
    /// bytes: no second copy of a private key is kept.)
    files: BTreeMap<String, u64>,
}

/// An uplink a reload attached: the settings it was attached with and its live handles.
struct Added {
    cfg: crate::config::UplinkConfig,
    route: crate::sink::UplinkRoute,
    /// Its TLS roots and client certificate (`None`: no TLS).
    tls: Option<Arc<crate::sink::ReloadableClientTls>>,
}

/// Everything built from the fresh file before any handle is touched.
struct Prepared {
    acl: Option<crate::control::acl::AclSnapshot>,
    device_tls: Option<Arc<rustls::ServerConfig>>,
    /// Per running uplink index: the new roots and client certificate.
    uplink_tls: Vec<(usize, crate::sink::ClientTlsParts)>,
    files: BTreeMap<String, u64>,
    /// `[acl]` or its file changed (a users-only change recompiles the ACL silently).
    acl_changed: bool,
    /// Uplinks to attach (added, and of a kind that can be added live), with their TLS and,
    /// with `[spool] dir`, their spool on every shard (opened and recovered here).
    attach: Vec<(
        crate::config::UplinkConfig,
        Option<ClientTls>,
        Vec<crate::sink::spool::OpenedSpool>,
    )>,
    /// Uplinks attached by an earlier reload whose certificate files changed: by name.
    added_tls: Vec<(String, crate::sink::ClientTlsParts)>,
}

impl Reloader {
    pub(super) fn new(
        path: Option<PathBuf>,
        started: Arc<Config>,
        handles: LiveHandles,
    ) -> Reloader {
        let files = watched_files(&started);
        Reloader {
            path,
            state: Mutex::new(Applied {
                config: started.clone(),
                added: Vec::new(),
                removed: Vec::new(),
                files,
            }),
            started,
            handles,
            metrics: ReloadMetrics::default(),
        }
    }

    pub fn render(&self, w: &mut PromWriter) {
        self.metrics.render(w);
    }

    /// Re-read the file the gateway was started with, validate it, apply what can change
    /// live and report the rest; logs and counts the outcome.
    pub fn reload(&self, trigger: ReloadTrigger) -> ReloadOutcome {
        self.reload_from(self.path.as_deref(), trigger)
    }

    /// [`Reloader::reload`] from `path` (`None`: the embedded defaults).
    pub fn reload_from(&self, path: Option<&Path>, trigger: ReloadTrigger) -> ReloadOutcome {
        let mut state = match self.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        let outcome = match crate::config::load(path) {
            Err(error) => ReloadOutcome::Invalid(error.to_string()),
            Ok(fresh) => {
                let fresh = fresh.with_function_sinks();
                match self.prepare(&state, &fresh) {
                    Err(error) => ReloadOutcome::Invalid(error),
                    Ok(prepared) => self.apply(&mut state, fresh, prepared),
                }
            }
        };
        self.metrics.count(&outcome);
        let trigger = trigger.as_str();
        match &outcome {
            ReloadOutcome::Done {
                applied,
                restart_needed,
            } if restart_needed.is_empty() => tracing::info!(
                trigger,
                applied = %applied.join(", "),
                "configuration reloaded: every change is in force (no device connection closed)"
            ),
            ReloadOutcome::Done {
                applied,
                restart_needed,
            } => tracing::warn!(
                trigger,
                applied = %applied.join(", "),
                restart_needed = %restart_needed.join(", "),
                "configuration reloaded: the changes named in restart_needed take effect only at the next restart"
            ),
            ReloadOutcome::Invalid(error) => tracing::warn!(
                trigger,
                %error,
                "configuration reload refused: the file is invalid; nothing changed"
            ),
        }
        outcome
    }

    /// Build everything the fresh file needs, failing before anything is applied.
    fn prepare(&self, state: &Applied, fresh: &Config) -> Result<Prepared, String> {
        crate::telemetry::check_log_level(&fresh.log.level)?;
        let files = watched_files(fresh);
        let old = &state.config;
        let acl_changed = fresh.acl != old.acl || file_changed(&files, &state.files, "acl.file");
        let acl = if acl_changed || fresh.mqtt.users != old.mqtt.users {
            let file = match &fresh.acl.file {
                Some(path) => Some(crate::config::read_acl_file(path).map_err(|e| e.to_string())?),
                None => None,
            };
            Some(
                crate::control::acl::AclSnapshot::compile(&fresh.acl, file.as_ref(), &fresh.mqtt)
                    .map_err(|e| format!("access control list: {e}"))?,
            )
        } else {
            None
        };
        // What the handshake uses (not `listen` or `identity_from_cert`: restart-only).
        let handshake = |t: &crate::config::MqttTlsConfig| {
            (
                t.cert_file.clone(),
                t.key_file.clone(),
                t.client_ca_file.clone(),
                t.require_client_cert,
                t.min_version,
            )
        };
        let device_tls = match (&self.handles.device_tls, &fresh.mqtt.tls) {
            (Some(_), Some(tls))
                if old.mqtt.tls.as_ref().map(handshake) != Some(handshake(tls))
                    || [
                        "mqtt.tls.cert_file",
                        "mqtt.tls.key_file",
                        "mqtt.tls.client_ca_file",
                    ]
                    .iter()
                    .any(|k| file_changed(&files, &state.files, k)) =>
            {
                Some(
                    crate::edge::mqtt::stream::tls::server_config(tls)
                        .map_err(|e| format!("mqtt.tls: {e}"))?,
                )
            }
            _ => None,
        };
        let mut uplink_tls = Vec::new();
        for (i, running) in self.started.uplink.iter().enumerate() {
            if state.removed.contains(&running.name) {
                continue;
            }
            let (Some(Some(_)), Some(u)) = (
                self.handles.uplink_tls.get(i),
                fresh.uplink.iter().find(|u| u.name == running.name),
            ) else {
                continue;
            };
            let before = old.uplink.iter().find(|o| o.name == u.name);
            let keys = ["ca_file", "cert_file", "key_file"];
            let changed = before.is_none_or(|b| {
                (&b.ca_file, &b.cert_file, &b.key_file) != (&u.ca_file, &u.cert_file, &u.key_file)
            }) || keys
                .iter()
                .any(|k| file_changed(&files, &state.files, &format!("uplink.{}.{k}", u.name)));
            if changed && u.url.tls {
                let parts = crate::sink::ClientTlsParts::load(u)
                    .map_err(|e| format!("uplink {:?}: {e}", u.name))?;
                uplink_tls.push((i, parts));
            }
        }
        // Added uplinks that can be attached live: their TLS is built now (a bad CA refuses
        // the whole reload, nothing attached).
        let mut attach = Vec::new();
        for u in &fresh.uplink {
            let running = (self.started.uplink.iter().any(|r| r.name == u.name)
                && !state.removed.contains(&u.name))
                || state.added.iter().any(|a| a.cfg.name == u.name);
            if running || !attachable(u) {
                continue;
            }
            // Its spool directories must not still be open: a removal that has not finished
            // draining waits (the name stays in restart_needed until a later reload).
            let draining = self
                .handles
                .table
                .by_name(&u.name)
                .is_some_and(|e| e.state() == crate::app::uplinks::EntryState::Draining);
            if self.started.spool.dir.is_some() && draining {
                continue;
            }
            let tls = if u.url.tls {
                Some(
                    crate::sink::reloadable_client_tls(u)
                        .map_err(|e| format!("uplink {:?}: {e}", u.name))?,
                )
            } else {
                None
            };
            let spools = sinks::open_spools(&self.started, self.handles.shards.len(), u)?;
            attach.push((u.clone(), tls, spools));
        }
        // Uplinks a reload attached: new roots or client certificate, as for the others.
        let mut added_tls = Vec::new();
        for a in &state.added {
            let (Some(_), Some(u)) = (&a.tls, fresh.uplink.iter().find(|u| u.name == a.cfg.name))
            else {
                continue;
            };
            let before = old
                .uplink
                .iter()
                .find(|o| o.name == u.name)
                .unwrap_or(&a.cfg);
            let keys = ["ca_file", "cert_file", "key_file"];
            let changed = (&before.ca_file, &before.cert_file, &before.key_file)
                != (&u.ca_file, &u.cert_file, &u.key_file)
                || keys
                    .iter()
                    .any(|k| file_changed(&files, &state.files, &format!("uplink.{}.{k}", u.name)));
            if changed && u.url.tls {
                let parts = crate::sink::ClientTlsParts::load(u)
                    .map_err(|e| format!("uplink {:?}: {e}", u.name))?;
                added_tls.push((u.name.clone(), parts));
            }
        }
        Ok(Prepared {
            attach,
            added_tls,
            acl_changed,
            acl,
            device_tls,
            uplink_tls,
            files,
        })
    }

    /// Apply the live changes of `fresh` (validated and prepared) and name the rest.
    fn apply(&self, state: &mut Applied, fresh: Config, prepared: Prepared) -> ReloadOutcome {
        let old = state.config.clone();
        let mut applied = Vec::new();
        let mut restart_needed = Vec::new();

        // What differs from the running configuration, key by key. A function's sink entry
        // (`with_function_sinks`) is named by its `function` key instead: functions restart.
        let function_sinks: Vec<String> = self
            .started
            .uplink
            .iter()
            .chain(&fresh.uplink)
            .filter(|u| u.function.is_some())
            .map(|u| format!("uplink.{}", u.name))
            .collect();
        // Uplinks removed: detached on every shard after everything else is applied.
        let mut detach: Vec<String> = Vec::new();
        let of_uplink = |key: &str, name: &str| {
            key.strip_prefix(&format!("uplink.{name}"))
                .is_some_and(|r| r.starts_with(['.', ' ']))
        };
        for key in changed_keys(&self.started, &fresh) {
            let of_function = function_sinks.iter().any(|f| {
                key.strip_prefix(f.as_str())
                    .is_some_and(|r| r.starts_with(['.', ' ']))
            });
            // A started uplink a reload removed: what runs under its name now, if anything,
            // was attached by a reload and is compared below.
            if state.removed.iter().any(|r| of_uplink(&key, r)) {
                continue;
            }
            if let Some(name) = key
                .strip_suffix(" (removed)")
                .and_then(|k| k.strip_prefix("uplink."))
            {
                if !of_function {
                    detach.push(name.to_string());
                    continue;
                }
            }
            let attached = key
                .strip_suffix(" (added)")
                .and_then(|k| k.strip_prefix("uplink."))
                .is_some_and(|name| {
                    prepared.attach.iter().any(|(u, _, _)| u.name == name)
                        || state.added.iter().any(|a| a.cfg.name == name)
                });
            // Functions added, removed or changed are applied below (ADR 0013).
            let functions = key == "function" || key.starts_with("function.");
            if !of_function && !attached && !functions && !is_live(&key) {
                restart_needed.push(key);
            }
        }
        // An uplink attached by an earlier reload: removed, it is detached; changing what is
        // not live waits for a restart.
        for Added { cfg: u, .. } in &state.added {
            match fresh.uplink.iter().find(|f| f.name == u.name) {
                None => detach.push(u.name.clone()),
                Some(f) => {
                    let mut a = u.clone();
                    let mut b = f.clone();
                    for c in [&mut a, &mut b] {
                        c.forward = Vec::new();
                        c.receive = Vec::new();
                        c.topic_prefix = String::new();
                        c.topic_template = None;
                        c.aggregate = Default::default();
                        // Live through the TLS handle, below.
                        c.ca_file = None;
                        c.cert_file = None;
                        c.key_file = None;
                    }
                    if a != b {
                        restart_needed.push(format!("uplink.{} (attached by a reload; settings beyond forward, receive, mapping and certificates)", u.name));
                    }
                }
            }
        }
        if self.started.priority.has_high() != fresh.priority.has_high() {
            restart_needed.push(
                "priority (high lanes are made at start: the first priority-1 entry added or the last removed)"
                    .to_string(),
            );
        }
        if std::env::var_os("RUST_LOG").is_some() && fresh.log.level != self.started.log.level {
            restart_needed.push("log.level (RUST_LOG is set and wins)".to_string());
        }

        // The priority table and the publish rate (shards, per message / per connect).
        if fresh.priority != old.priority || fresh.limits != old.limits {
            self.handles.rules.publish(&fresh);
            if fresh.priority != old.priority {
                applied.push("priority".to_string());
            }
        }
        if fresh.limits != old.limits {
            self.handles.connect_limits.reconfigure(&fresh.limits);
            applied.push("limits".to_string());
        }
        // Forward filters and topic mapping, per uplink the gateway runs.
        for (i, running) in self.started.uplink.iter().enumerate() {
            if running.function.is_some() || state.removed.contains(&running.name) {
                continue;
            }
            let (Some(u), Some(route)) = (
                fresh.uplink.iter().find(|u| u.name == running.name),
                self.handles.routes.get(i),
            ) else {
                continue;
            };
            let Some(before) = old.uplink.iter().find(|o| o.name == u.name) else {
                continue;
            };
            if (
                &u.forward,
                &u.receive,
                &u.topic_prefix,
                &u.topic_template,
                &u.aggregate,
            ) != (
                &before.forward,
                &before.receive,
                &before.topic_prefix,
                &before.topic_template,
                &before.aggregate,
            ) {
                route.replace(u);
                for (key, changed) in [
                    ("forward", u.forward != before.forward),
                    ("receive", u.receive != before.receive),
                    ("topic_prefix", u.topic_prefix != before.topic_prefix),
                    ("topic_template", u.topic_template != before.topic_template),
                    ("aggregate", u.aggregate != before.aggregate),
                ] {
                    if changed {
                        applied.push(format!("uplink.{}.{key}", u.name));
                    }
                }
            }
        }
        // The same for uplinks a reload attached.
        for Added { cfg: u, route, .. } in &state.added {
            let Some(f) = fresh.uplink.iter().find(|f| f.name == u.name) else {
                continue;
            };
            let before = old.uplink.iter().find(|o| o.name == u.name).unwrap_or(u);
            if (
                &f.forward,
                &f.receive,
                &f.topic_prefix,
                &f.topic_template,
                &f.aggregate,
            ) != (
                &before.forward,
                &before.receive,
                &before.topic_prefix,
                &before.topic_template,
                &before.aggregate,
            ) {
                route.replace(f);
                for (key, changed) in [
                    ("forward", f.forward != before.forward),
                    ("receive", f.receive != before.receive),
                    ("topic_prefix", f.topic_prefix != before.topic_prefix),
                    ("topic_template", f.topic_template != before.topic_template),
                    ("aggregate", f.aggregate != before.aggregate),
                ] {
                    if changed {
                        applied.push(format!("uplink.{}.{key}", f.name));
                    }
                }
            }
        }
        // Uplinks added: attached on every shard (ADR 0013).
        for (name, parts) in prepared.added_tls {
            if let Some(tls) = state
                .added
                .iter()
                .find(|a| a.cfg.name == name)
                .and_then(|a| a.tls.as_ref())
            {
                tls.replace(parts);
                applied.push(format!("uplink.{name} certificates (next connect)"));
            }
        }
        for (u, tls, spools) in prepared.attach {
            let (client, live) = match tls {
                Some((client, live)) => (Some(client), Some(live)),
                None => (None, None),
            };
            let route = self.attach_uplink(&u, client, None, spools);
            applied.push(format!("uplink.{} (added)", u.name));
            state.added.push(Added {
                cfg: u,
                route,
                tls: live,
            });
        }
        for (i, parts) in prepared.uplink_tls {
            if let Some(Some(tls)) = self.handles.uplink_tls.get(i) {
                tls.replace(parts);
                applied.push(format!(
                    "uplink.{} certificates (next connect)",
                    self.started.uplink[i].name
                ));
            }
        }
        // Logins, then the ACL that may name them.
        if fresh.mqtt.users != old.mqtt.users
            || fresh.mqtt.anonymous_allowed() != old.mqtt.anonymous_allowed()
        {
            self.handles
                .logins
                .store(Arc::new(crate::control::admission::Logins::new(
                    &fresh.mqtt,
                )));
            applied.push("mqtt.users".to_string());
        }
        if let Some(acl) = prepared.acl {
            self.handles.acl.publish(acl);
            if prepared.acl_changed {
                applied.push("acl".to_string());
            }
        }
        if let (Some(policy), Some(config)) = (&self.handles.device_tls, prepared.device_tls) {
            policy.config.store(config);
            applied.push("mqtt.tls certificate".to_string());
        }
        if fresh.log.level != old.log.level {
            match crate::telemetry::set_log_level(&fresh.log.level) {
                Ok(crate::telemetry::LogLevelChange::Applied) => {
                    applied.push("log.level".to_string())
                }
                // Named in restart_needed above.
                Ok(crate::telemetry::LogLevelChange::EnvWins) => {}
                Ok(crate::telemetry::LogLevelChange::NotInstalled) | Err(_) => {
                    restart_needed.push("log.level".to_string())
                }
            }
        }
        // Last, because it waits for the drain: the uplinks removed, and the sinks of the
        // functions removed or changed; then those functions' runtimes stop and the added
        // or changed functions start.
        let (functions_gone, functions_new) = Reloader::function_changes(&old, &fresh);
        let function_sinks: Vec<String> = functions_gone
            .iter()
            .map(|n| format!("{}{n}", crate::config::FUNCTION_SINK_PREFIX))
            .collect();
        if !functions_gone.is_empty() {
            for line in self.detach_sinks(&function_sinks, fresh.reload.drain_timeout) {
                let line = line.replacen("uplink.function.", "function.", 1);
                // A replaced function is named once, by its attach below.
                let replaced = functions_new
                    .iter()
                    .any(|f| line.starts_with(&format!("function.{} (", f.name)));
                if !replaced {
                    applied.push(line);
                }
            }
            for name in &functions_gone {
                // Its runtime (and instances) stop once nothing holds it any more.
                drop(self.handles.functions.remove(name));
            }
        }
        if !functions_new.is_empty() {
            let (ok, failed) = self.attach_functions(&fresh, functions_new, &functions_gone);
            applied.extend(ok);
            restart_needed.extend(failed);
        }
        if !detach.is_empty() {
            applied.extend(self.detach_sinks(&detach, fresh.reload.drain_timeout));
            for name in &detach {
                if self.started.uplink.iter().any(|u| &u.name == name)
                    && !state.removed.contains(name)
                {
                    state.removed.push(name.clone());
                }
            }
            state.added.retain(|a| !detach.contains(&a.cfg.name));
        }
        restart_needed.sort();
        restart_needed.dedup();
        state.config = Arc::new(fresh);
        state.files = prepared.files;
        ReloadOutcome::Done {
            applied,
            restart_needed,
        }
    }
}

impl RunningGateway {
    /// Re-read the config file at `path` (`None`: the embedded defaults), apply what can
    /// change live and report the rest (see [`Reloader`]). What `SIGHUP` calls.
    pub fn reload(&self, path: Option<&Path>) -> ReloadOutcome {
        self.status.reloads.reload_from(path, ReloadTrigger::Signal)
    }
}
