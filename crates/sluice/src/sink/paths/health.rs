//! A path's life: connecting in its own task, being declared dead (connection failed,
//! stalled past `path_timeout`, link down) and giving its units back, reacting to the link
//! table, and the one timer for stall deadlines and retries.
//!
//! Owns: these `PathsTransport` methods. Does not own: choosing paths (`sched.rs`) or the
//! `Transport` calls (`mod.rs`).

use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tracing::{info, warn};

use super::{Connected, Failover, PathState, PathsTransport, Slot, Unacked};
use crate::sink::transport::Transport;
use crate::sink::UplinkError;

impl PathsTransport {
    /// Start a connect task for path `i` (if it is down).
    pub(super) fn start_connect(&mut self, i: usize) {
        let p = &mut self.paths[i];
        let Slot::Down { t, .. } = &mut p.slot else {
            return;
        };
        let mut t = t.take().unwrap_or_else(|| (self.make)(i));
        let (tx, rx) = oneshot::channel();
        let timeout = self.cfg.connect_timeout;
        tokio::task::spawn_local(async move {
            let started = Instant::now();
            let r = tokio::time::timeout(timeout, t.connect())
                .await
                .unwrap_or(Err(UplinkError::ConnectTimeout(timeout)));
            if r.is_err() {
                t.abort();
            }
            let _ = tx.send((t, r, started.elapsed()));
        });
        p.slot = Slot::Connecting(rx);
        p.metrics.set_state(PathState::Connecting);
    }

    /// Start the connects that are due.
    pub(super) fn start_due_connects(&mut self, now: Instant) {
        for i in 0..self.paths.len() {
            if matches!(self.paths[i].slot, Slot::Down { retry_at, .. } if retry_at <= now)
                && self.link_allows(i)
            {
                self.start_connect(i);
            }
        }
    }

    /// Whether the link watcher lets path `i` try (unknown links are tried).
    pub(super) fn link_allows(&self, i: usize) -> bool {
        self.paths[i].link_up != Some(false)
    }

    /// A connect task finished.
    pub(super) fn on_connected(
        &mut self,
        i: usize,
        r: Result<Connected, oneshot::error::RecvError>,
    ) {
        let now = Instant::now();
        let p = &mut self.paths[i];
        match r {
            Ok((t, Ok(limits), took)) => {
                p.srtt.get_or_insert(took / 3);
                p.backoff.reset();
                p.metrics.connects.inc();
                p.metrics.set_state(PathState::Up);
                info!(shard = self.shard, uplink = %self.cfg.name, lane = self.lane.as_str(), path = %p.name, window = limits.window, "path connected");
                p.slot = Slot::Up {
                    t,
                    window: limits.window.max(1),
                    pack_limit: limits.pack_limit,
                };
            }
            Ok((t, Err(e), _)) => {
                let delay = p.backoff.next_delay();
                warn!(shard = self.shard, uplink = %self.cfg.name, lane = self.lane.as_str(), path = %p.name, error = %e, retry_in = ?delay, "path connect failed");
                self.last_error = Some(format!("path {}: {e}", p.name));
                p.metrics.set_state(PathState::Down);
                p.slot = Slot::Down {
                    t: Some(t),
                    retry_at: now + delay,
                };
            }
            Err(_) => {
                p.metrics.set_state(PathState::Down);
                p.slot = Slot::Down {
                    t: None,
                    retry_at: now,
                };
            }
        }
    }

    /// Declare path `i` dead: abort its session, give its unacknowledged units back, retry it
    /// after its backoff (at once after a link-up).
    pub(super) fn kill(&mut self, i: usize, why: Failover, error: String) {
        let now = Instant::now();
        let delay = {
            let p = &mut self.paths[i];
            let t = match std::mem::replace(
                &mut p.slot,
                Slot::Down {
                    t: None,
                    retry_at: now,
                },
            ) {
                Slot::Up { mut t, .. } => {
                    t.abort();
                    Some(t)
                }
                Slot::Down { t, .. } => t,
                // A connect in flight: let it finish, then judge it.
                Slot::Connecting(rx) => {
                    p.slot = Slot::Connecting(rx);
                    return;
                }
            };
            let delay = p.backoff.next_delay();
            p.slot = Slot::Down {
                t,
                retry_at: now + delay,
            };
            p.metrics.set_state(PathState::Down);
            p.metrics.failover(why, error.clone());
            p.metrics.inflight.set(0);
            p.needs_settle = false;
            p.pending_units = 0;
            delay
        };
        self.paths[i].order.clear();
        let gone: Vec<Unacked> = self.paths[i].inflight.drain().map(|(_, u)| u).collect();
        self.paths[i].device_units = 0;
        for u in &gone {
            self.outer.remove(&u.outer);
            self.returned.push(u.outer);
        }
        self.flows.retain(|_, (p, _)| *p != i);
        warn!(
            shard = self.shard,
            uplink = %self.cfg.name,
            lane = self.lane.as_str(),
            path = %self.paths[i].name,
            reason = why.as_str(),
            %error,
            returned = gone.len(),
            retry_in = ?delay,
            "path declared dead; its unacknowledged messages go to the other paths"
        );
        self.last_error = Some(format!("path {}: {error}", self.paths[i].name));
    }

    /// React to the link table: a path whose link went down is dead now; one whose link
    /// came back is retried now.
    pub(super) fn on_links(&mut self) {
        let Some(links) = &self.links else {
            return;
        };
        let table = links.borrow().clone();
        for i in 0..self.paths.len() {
            let p = &self.paths[i];
            let Some((_, state)) = table.find(p.interface.as_deref(), p.bind) else {
                continue;
            };
            let was = p.link_up;
            self.paths[i].link_up = Some(state.up);
            match (was, state.up) {
                (_, false) if !matches!(self.paths[i].slot, Slot::Down { .. }) => {
                    self.kill(i, Failover::LinkDown, "link down".into());
                }
                (Some(false), true) => {
                    let p = &mut self.paths[i];
                    p.backoff.reset();
                    if let Slot::Down { retry_at, .. } = &mut p.slot {
                        *retry_at = Instant::now();
                    }
                }
                _ => {}
            }
        }
    }

    /// The earliest time a stall could be declared or a connect is due.
    pub(super) fn next_timer(&self, now: Instant) -> Instant {
        let mut at = now + Duration::from_secs(3600);
        for p in &self.paths {
            match &p.slot {
                Slot::Up { t, .. } if !p.inflight.is_empty() => {
                    if let Some(heard) = t.last_heard() {
                        let oldest = p.oldest().unwrap_or(now);
                        at = at.min(heard.max(oldest) + self.cfg.path_timeout);
                    }
                }
                Slot::Down { retry_at, .. } if p.link_up != Some(false) => at = at.min(*retry_at),
                _ => {}
            }
        }
        at
    }

    /// Declare stalled paths dead: units unacknowledged and nothing heard for `path_timeout`
    /// since the later of the last read and the oldest unit's send.
    pub(super) fn check_stalls(&mut self, now: Instant) {
        for i in 0..self.paths.len() {
            let p = &self.paths[i];
            let Slot::Up { t, .. } = &p.slot else {
                continue;
            };
            if p.inflight.is_empty() {
                continue;
            }
            let Some(heard) = t.last_heard() else {
                continue;
            };
            let oldest = p.oldest().unwrap_or(now);
            let quiet = now.saturating_duration_since(heard.max(oldest));
            if quiet >= self.cfg.path_timeout {
                let msg = format!(
                    "{} unacknowledged, nothing heard for {quiet:?} (path_timeout {:?})",
                    p.inflight.len(),
                    self.cfg.path_timeout
                );
                self.kill(i, Failover::Stalled, msg);
            }
        }
    }
}
