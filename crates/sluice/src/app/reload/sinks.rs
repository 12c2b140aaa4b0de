//! A reload's uplinks and functions that start or stop: attaching an added one on every
//! shard and detaching a removed one (ADR 0013), through the shards' mailboxes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;

use super::Reloader;
use crate::app::uplinks::EntryState;

impl Reloader {
    /// Attach `u` on every shard and give it its admin entry; waits up to [`super::ATTACH_WAIT`]
    /// for the shards (the entry stays `attaching` until every shard answered).
    pub(super) fn attach_uplink(
        &self,
        u: &crate::config::UplinkConfig,
        tls: Option<Arc<rustls::ClientConfig>>,
        function: Option<Arc<crate::functions::FunctionHandle>>,
        spools: Vec<crate::sink::spool::OpenedSpool>,
    ) -> crate::sink::UplinkRoute {
        let high = self.started.priority.has_high();
        let route = crate::sink::UplinkRoute::new(u);
        let lanes: Vec<crate::sink::LaneMetrics> = self
            .handles
            .shards
            .iter()
            .map(|_| crate::sink::LaneMetrics::new(high))
            .collect();
        let entry = self.handles.table.attach(
            usize::MAX,
            crate::app::uplinks::StartEntry {
                name: u.name.clone(),
                lanes: lanes.clone(),
                spools: spools.iter().map(|s| s.metrics.clone()).collect(),
                tc: serde_json::Value::Null,
            },
        );
        let cfg = Arc::new(u.clone());
        let mut waits = Vec::new();
        let mut cmds = Vec::new();
        let mut spools = spools.into_iter();
        for (shard, metrics) in self.handles.shards.iter().zip(lanes) {
            let (done, wait) = tokio::sync::oneshot::channel();
            waits.push(wait);
            cmds.push((
                shard.clone(),
                crate::shard::ShardCmd::AttachSink(Box::new(crate::shard::AttachSink {
                    id: entry.id,
                    cfg: cfg.clone(),
                    tls: tls.clone(),
                    metrics,
                    route: route.clone(),
                    function: function.clone(),
                    spool: spools.next(),
                    done,
                })),
            ));
        }
        // A thread of its own: a reload may be called from inside a runtime (the signal
        // task), where blocking on a mailbox is not allowed; the wait is bounded.
        let (tx, rx) = std::sync::mpsc::channel();
        let name = u.name.clone();
        let running = entry.clone();
        let spawned = std::thread::Builder::new()
            .name("sluice-attach".into())
            .spawn(move || {
                for (shard, cmd) in cmds {
                    if shard.blocking_send(cmd).is_err() {
                        // The gateway is stopping.
                        return;
                    }
                }
                if waits.into_iter().all(|w| w.blocking_recv().is_ok()) {
                    // Also when the reload stopped waiting: the entry leaves `attaching`.
                    running.set_state(crate::app::uplinks::EntryState::Running);
                    let _ = tx.send(());
                }
            });
        if let Err(error) = spawned {
            tracing::error!(uplink = %name, %error, "cannot start the thread that attaches an uplink; it is not attached");
        } else if rx.recv_timeout(super::ATTACH_WAIT).is_ok() {
            tracing::info!(uplink = %name, id = entry.id.0, "uplink attached on every shard");
        } else {
            tracing::warn!(uplink = %name, id = entry.id.0, "uplink not attached on every shard yet; it stays attaching until they are");
        }
        route
    }
}

/// An uplink's client TLS configuration and the handle a reload replaces its parts through.
pub(super) type ClientTls = (
    Arc<rustls::ClientConfig>,
    Arc<crate::sink::ReloadableClientTls>,
);

/// Whether an added uplink can be attached live (ADR 0013): not a function's sink (those
/// come with their `[[function]]`) and no `install_tc` (its tc tree is installed with
/// privileges at start). `paths` can: per-path sessions read the link watcher's table, which
/// lists every interface (without a watcher started at start they notice a dead path by their
/// own timeouts, as when netlink is unavailable). With `[spool] dir` it gets a spool on every
/// shard ([`open_spools`]; the shards set its share of `max_size`).
pub(super) fn attachable(u: &crate::config::UplinkConfig) -> bool {
    u.function.is_none() && !u.install_tc
}

/// With `[spool] dir` (as the gateway started: `[spool]` changes need a restart): the added
/// uplink `u`'s spool on each of `shards` shards, opened and recovered (a directory left by an
/// uplink of the same name holds what it did not send: it is sent now). Its bound here is
/// provisional; the shard sets its share (`shard/sinks.rs`, `spool_shares`). An error refuses
/// the reload, naming the directory.
pub(super) fn open_spools(
    started: &Config,
    shards: usize,
    u: &crate::config::UplinkConfig,
) -> Result<Vec<crate::sink::spool::OpenedSpool>, String> {
    let Some(base) = &started.spool.dir else {
        return Ok(Vec::new());
    };
    let engine = crate::sink::spool::engine_config(started, shards, started.uplink.len() + 1);
    crate::sink::spool::open_uplink(base, &u.name, shards, &engine)
        .map_err(|e| format!("uplink {:?}: {e}", u.name))
}

/// How much longer than the drain deadline a reload waits for every shard's answer before it
/// answers anyway (the entry then stays `draining` until they report).
const DETACH_MARGIN: Duration = Duration::from_secs(5);

impl Reloader {
    /// Remove the running sinks `names` from every shard (ADR 0013): each stops taking
    /// messages at once, drains until `drain` has passed, then acknowledges what is left
    /// unsent (0x10). Waits for every shard's answer up to `drain` + [`DETACH_MARGIN`];
    /// returns what to name in `applied`, one per sink.
    pub(super) fn detach_sinks(&self, names: &[String], drain: Duration) -> Vec<String> {
        let deadline = Instant::now() + drain;
        let mut waits = Vec::new();
        for name in names {
            let Some(entry) = self.handles.table.active(name) else {
                continue;
            };
            entry.set_state(EntryState::Draining);
            let mut answers = Vec::new();
            let mut cmds = Vec::new();
            for shard in &self.handles.shards {
                let (done, answer) = tokio::sync::oneshot::channel();
                answers.push(answer);
                cmds.push((
                    shard.clone(),
                    crate::shard::ShardCmd::DetachSink(Box::new(crate::shard::DetachSink {
                        id: entry.id,
                        deadline,
                        done,
                    })),
                ));
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let table = self.handles.table.clone();
            let id = entry.id;
            let who = name.clone();
            // A thread of its own, as for attaching: bounded waits, never on a runtime.
            let spawned = std::thread::Builder::new()
                .name("sluice-detach".into())
                .spawn(move || {
                    for (shard, cmd) in cmds {
                        if shard.blocking_send(cmd).is_err() {
                            return;
                        }
                    }
                    let mut total = crate::shard::DetachReport::default();
                    for answer in answers {
                        let Ok(r) = answer.blocking_recv() else {
                            return;
                        };
                        total.removed_messages += r.removed_messages;
                        total.removed_bytes += r.removed_bytes;
                    }
                    // Also when the reload stopped waiting: the entry leaves `draining`.
                    table.retire(id);
                    tracing::info!(
                        uplink = %who,
                        id = id.0,
                        unsent = total.removed_messages,
                        "uplink removed on every shard"
                    );
                    let _ = tx.send(total);
                });
            match spawned {
                Ok(_) => waits.push((name.clone(), rx)),
                Err(error) => {
                    tracing::error!(uplink = %name, %error, "cannot start the thread that removes an uplink; it keeps running");
                    entry.set_state(EntryState::Running);
                }
            }
        }
        let until = deadline + DETACH_MARGIN;
        waits
            .into_iter()
            .map(|(name, rx)| {
                match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                    Ok(r) if r.removed_messages == 0 => format!("uplink.{name} (removed)"),
                    Ok(r) => format!(
                        "uplink.{name} (removed: {} messages acknowledged unsent)",
                        r.removed_messages
                    ),
                    Err(_) => {
                        tracing::warn!(uplink = %name, "removed uplink not stopped on every shard yet; it stays draining until it is");
                        format!("uplink.{name} (removed: still draining)")
                    }
                }
            })
            .collect()
    }
}

impl Reloader {
    /// The functions `fresh` adds, removes or changes (by name) compared with `old`: the
    /// names to detach (removed and changed functions' sinks) and the functions to add
    /// (added and changed ones).
    pub(super) fn function_changes(
        old: &Config,
        fresh: &Config,
    ) -> (Vec<String>, Vec<crate::config::FunctionConfig>) {
        let mut detach = Vec::new();
        let mut add = Vec::new();
        for f in &old.function {
            match fresh.function.iter().find(|n| n.name == f.name) {
                None => detach.push(f.name.clone()),
                Some(n) if n != f => {
                    detach.push(f.name.clone());
                    add.push(n.clone());
                }
                Some(_) => {}
            }
        }
        for n in &fresh.function {
            if !old.function.iter().any(|f| f.name == n.name) {
                add.push(n.clone());
            }
        }
        (detach, add)
    }

    /// Start the functions `add` (their runtime, if local) and attach their sinks on every
    /// shard; returns what to name in `applied` and in `restart_needed` (a runtime thread
    /// that cannot start).
    pub(super) fn attach_functions(
        &self,
        fresh: &Config,
        add: Vec<crate::config::FunctionConfig>,
        replaced: &[String],
    ) -> (Vec<String>, Vec<String>) {
        let (mut applied, mut failed) = (Vec::new(), Vec::new());
        for f in add {
            let name = f.name.clone();
            let cfg = Arc::new(f);
            let Some(entry) = fresh
                .uplink
                .iter()
                .find(|u| u.function.as_ref().is_some_and(|g| g.name == name))
            else {
                continue;
            };
            match self.handles.functions.add(cfg) {
                Ok(live) => {
                    self.attach_uplink(entry, None, Some(live.handle.clone()), Vec::new());
                    applied.push(if replaced.contains(&name) {
                        format!("function.{name} (replaced)")
                    } else {
                        format!("function.{name} (added)")
                    });
                }
                Err(error) => {
                    tracing::error!(function = %name, %error, "cannot start the runtime of an added function; it waits for a restart");
                    failed.push(format!(
                        "function.{name} (its runtime could not start: {error})"
                    ));
                }
            }
        }
        (applied, failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_are_told_added_removed_and_changed_by_name() {
        let f = |name: &str, topic: &str| {
            format!("[[function]]\nname = \"{name}\"\ntopics = [\"{topic}\"]\nurl = \"http://127.0.0.1:8080/\"\n")
        };
        let parse = |text: String| crate::config::parse(&text).expect("valid");
        let old = parse(format!(
            "{}{}{}",
            f("a", "x/#"),
            f("b", "y/#"),
            f("c", "z/#")
        ));
        let fresh = parse(format!(
            "{}{}{}",
            f("a", "x/#"),
            f("c", "w/#"),
            f("d", "v/#")
        ));
        let (detach, add) = Reloader::function_changes(&old, &fresh);
        assert_eq!(detach, ["b", "c"]);
        let added: Vec<(&str, &str)> = add
            .iter()
            .map(|f| (f.name.as_str(), f.topics[0].as_str()))
            .collect();
        assert_eq!(added, [("c", "w/#"), ("d", "v/#")]);
        let (detach, add) = Reloader::function_changes(&fresh, &fresh.clone());
        assert!(detach.is_empty() && add.is_empty());
    }
}
