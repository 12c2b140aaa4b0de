//! CoAP over DTLS 1.2 (`coaps://`, RFC 7252 §9, RFC 6347): a second CoAP listener whose
//! devices are authenticated by a pre-shared key (the PSK identity is the device id) or a
//! client certificate (its subject CN is the device id).
//!
//! Owns: per shard, one SO_REUSEPORT UDP socket on `coap.dtls.listen`, the stateless cookie
//! exchange in front of it (`hello`), the shard's table of DTLS sessions (`session`; bounded
//! by `coap.dtls.max_sessions`, idle and handshake timeouts), and a CoAP edge of its own
//! (`server::CoapShard` built with [`SessionEgress`]) that the decrypted datagrams enter.
//! Does not own: what a CoAP request means (publish, observe, Block1, proxy: the same code as
//! plain CoAP), the OpenSSL configuration (`context`).
//!
//! Placement: the kernel hashes a peer's 4-tuple to one of the shards' sockets, so a peer's
//! session lives on the shard that reads it, and its requests are served there (no steering
//! by device id as plain CoAP does: the keys are on this shard). Everything a DTLS device
//! has on the gateway (observers, Block1 transfers, exchanges) is on its session's shard.
//!
//! Invariants:
//! - No per-peer state before a peer has echoed a cookie made for its address: a ClientHello
//!   without one gets a HelloVerifyRequest (44 bytes, smaller than the hello) and is
//!   forgotten; any other datagram from an address without a session is dropped (counted).
//! - The DTLS CoAP edge's egress is [`SessionEgress`]: it sends only through an established
//!   session, so nothing for a DTLS peer ever leaves in clear; with no session the datagram
//!   is dropped (counted).
//! - A request's device id is the authenticated identity (a `c=` query is ignored); a
//!   certificate-mode device not asked for a certificate (no `client_ca_file`) has none and
//!   is named as a plain CoAP device is.
//! - A session ending (close_notify, idle, eviction, failure, replacement) deregisters its
//!   observers. A ClientHello with a new client random from an address with a session is a
//!   new handshake (a device restarted on the same port): after the cookie exchange it
//!   replaces the old session; a copy of the old session's own ClientHello does not.
//! - Sessions per shard ≤ `max_sessions / shards`, of which handshaking ≤
//!   `max_handshakes / shards`; a new one beyond closes the oldest handshaking session, else
//!   the least recently active one (counted). A session costs ≈ 50 KB of OpenSSL state
//!   established (measured, `session::tests::memory_per_established_session_is_bounded`); a
//!   handshake at most ≈ 1.2 MB (OpenSSL buffers the current and up to 10 future handshake
//!   messages of up to its 100 KiB `max_cert_list`).

pub mod context;
pub mod hello;
pub mod metrics;
pub mod session;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use sluice_proto::coap::dedup::SweepPace;
use tokio::net::UdpSocket;
use tokio::sync::watch;

pub use context::{ContextError, DtlsContext};
pub use metrics::DtlsMetrics;

use self::hello::ClientHello;
use self::metrics::{Dropped, HandshakeFailure, SessionEnd};
use self::session::{Event, Fed, Session};
use super::endpoint::{Egress, Endpoint, SourceBudget};
use super::metrics::CoapMetrics;
use super::server::CoapShard;
use crate::shard::ShardContext;

/// How often handshaking sessions are driven (OpenSSL's retransmission timer starts at 1 s)
/// and sessions checked for their timeouts.
const TICK: Duration = Duration::from_millis(250);
/// Largest datagram read from the DTLS socket (a DTLS record holds up to 2^14 bytes of
/// plaintext plus its overhead).
const MAX_DATAGRAM: usize = 16 * 1024 + 512;

/// What a shard needs to start its DTLS listener.
pub struct DtlsSeed {
    /// This shard's socket on `coap.dtls.listen` (bound with SO_REUSEPORT, non-blocking).
    pub socket: std::net::UdpSocket,
    pub context: Arc<DtlsContext>,
    pub metrics: Arc<DtlsMetrics>,
    /// The CoAP counters of requests that came over DTLS.
    pub coap_metrics: Arc<CoapMetrics>,
}

/// One shard's DTLS listener.
pub struct DtlsShard {
    tls: Arc<DtlsContext>,
    /// A duplicate of the shard's DTLS socket, written to directly (as `Endpoint` does).
    sender: std::net::UdpSocket,
    sessions: RefCell<HashMap<SocketAddr, Session>>,
    /// The CoAP edge the decrypted datagrams enter; its egress is this listener's sessions.
    coap: Rc<CoapShard>,
    pub metrics: Arc<DtlsMetrics>,
    budget: RefCell<SourceBudget>,
    /// This shard's share of `max_sessions`.
    limit: usize,
    /// This shard's share of `max_handshakes`.
    handshake_limit: usize,
    /// Paces the failure log lines (at most one a second per shard).
    log_pace: RefCell<SweepPace>,
    /// Paces the log lines of dropped datagrams (at most one a second per shard).
    drop_log_pace: RefCell<SweepPace>,
}

/// The DTLS CoAP edge's way out: through the peer's established session, or nowhere.
pub struct SessionEgress(Weak<DtlsShard>);

impl Egress for SessionEgress {
    fn send_to(&self, bytes: &[u8], peer: SocketAddr) -> std::io::Result<()> {
        match self.0.upgrade() {
            Some(dtls) => dtls.send_app(peer, bytes),
            None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }
}

/// Start the DTLS listener of shard `ctx.id`.
pub fn start(
    ctx: Rc<ShardContext>,
    seed: DtlsSeed,
    shutdown: watch::Receiver<bool>,
) -> Option<Rc<DtlsShard>> {
    let DtlsSeed {
        socket,
        context,
        metrics,
        coap_metrics,
    } = seed;
    let sender = match socket.try_clone() {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(shard = ctx.id, %error, "cannot duplicate the coap dtls socket");
            return None;
        }
    };
    let socket = match UdpSocket::from_std(socket) {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(shard = ctx.id, %error, "cannot register the coap dtls socket");
            return None;
        }
    };
    let shards = ctx.mailboxes.len().max(1);
    let cfg = &ctx.config.coap;
    let limit = (context.config.max_sessions / shards).max(1);
    let handshake_limit = (context.config.max_handshakes / shards).max(1);
    let budget = SourceBudget::new(cfg.source_rate, cfg.source_burst, limit.max(1024));
    let (ack_timeout, max_retransmit) = (cfg.ack_timeout, cfg.max_retransmit);
    let dtls = Rc::new_cyclic(|me: &Weak<DtlsShard>| {
        let ep = Endpoint::with_egress(
            Box::new(SessionEgress(me.clone())),
            ctx.id,
            shards,
            ack_timeout,
            max_retransmit,
            // Every peer of this edge finished a handshake: the verified table stays small.
            (cfg.max_verified_bytes.as_usize() / shards).max(1),
            coap_metrics.clone(),
        );
        DtlsShard {
            coap: CoapShard::new(ctx.clone(), ep, coap_metrics, true),
            tls: context,
            sender,
            sessions: RefCell::new(HashMap::new()),
            metrics,
            budget: RefCell::new(budget),
            limit,
            handshake_limit,
            log_pace: RefCell::new(SweepPace::default()),
            drop_log_pace: RefCell::new(SweepPace::default()),
        }
    });
    tokio::task::spawn_local(receive(dtls.clone(), socket, shutdown));
    Some(dtls)
}

async fn receive(dtls: Rc<DtlsShard>, socket: UdpSocket, mut shutdown: watch::Receiver<bool>) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            r = socket.recv_from(&mut buf) => match r {
                Ok((n, peer)) => dtls.on_datagram(peer, &buf[..n], Instant::now()),
                Err(error) => tracing::debug!(%error, "coap dtls receive error"),
            },
            _ = tick.tick() => dtls.on_tick(Instant::now()),
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() { break; }
            }
        }
    }
    // Say close_notify to every established peer, so devices do not wait for a dead session.
    let peers: Vec<SocketAddr> = dtls.sessions.borrow().keys().copied().collect();
    for peer in peers {
        dtls.end(peer, None);
    }
    tracing::debug!("coap dtls receive loop stopped");
}

impl DtlsShard {
    /// Sessions held (handshaking and established).
    pub fn sessions(&self) -> usize {
        self.sessions.borrow().len()
    }

    fn send_raw(&self, peer: SocketAddr, bytes: &[u8]) {
        match self.sender.send_to(bytes, peer) {
            Ok(_) => self.metrics.datagrams_out.inc(),
            Err(error) => {
                self.metrics.send_dropped.inc();
                tracing::debug!(%peer, %error, "coap dtls datagram not sent");
            }
        }
    }

    /// One CoAP datagram for `peer`, encrypted in its session.
    fn send_app(&self, peer: SocketAddr, bytes: &[u8]) -> std::io::Result<()> {
        let out = {
            let mut sessions = self.sessions.borrow_mut();
            match sessions.get_mut(&peer) {
                Some(s) if s.is_established() => s.send(bytes, Instant::now()),
                _ => {
                    self.metrics.no_session_egress.inc();
                    return Err(std::io::ErrorKind::NotConnected.into());
                }
            }
        };
        match out {
            Ok(out) => {
                for d in out {
                    self.send_raw(peer, &d);
                }
                Ok(())
            }
            Err(reason) => Err(std::io::Error::other(reason)),
        }
    }

    fn on_datagram(&self, peer: SocketAddr, d: &[u8], now: Instant) {
        self.metrics.datagrams_in.inc();
        if !self.budget.borrow_mut().allow(peer, now) {
            return self.drop(peer, Dropped::Throttled, now);
        }
        let hello = ClientHello::parse(d);
        // Some(true): a ClientHello with another client random than the one that started the
        // peer's session: a new handshake (a device that restarted on the same port). A copy
        // of the session's own ClientHello (a late duplicate, a replay) goes to the session,
        // which ignores it. Some(false): anything else for its session.
        let restart = self
            .sessions
            .borrow()
            .get(&peer)
            .map(|s| hello.is_some_and(|h| h.random(d) != s.hello_random.as_slice()));
        match (restart, hello) {
            // No session, or a new handshake: the stateless exchange first.
            (None | Some(true), Some(hello)) => self.on_hello(peer, d, hello, now),
            (None, None) => self.drop(peer, Dropped::NoSession, now),
            (Some(_), _) => {
                let fed = match self.sessions.borrow_mut().get_mut(&peer) {
                    Some(s) => s.feed(d, now),
                    None => return,
                };
                self.after(peer, fed);
            }
        }
    }

    /// A ClientHello from `peer`: a HelloVerifyRequest unless it carries a valid cookie, then
    /// a session.
    fn on_hello(&self, peer: SocketAddr, d: &[u8], hello: ClientHello, now: Instant) {
        let cookie = hello.cookie(d);
        if !self.tls.cookie_valid(peer, cookie, now) {
            if !cookie.is_empty() {
                self.drop(peer, Dropped::BadCookie, now);
            }
            if let Some(c) = self.tls.cookie_for(peer, now) {
                self.send_raw(peer, &hello.verify_request(&c));
                self.metrics.hello_verify_sent.inc();
            }
            return;
        }
        if self.sessions.borrow().contains_key(&peer) {
            self.end(peer, Some(SessionEnd::Replaced));
        }
        self.make_room();
        let accepted = self
            .tls
            .new_ssl(cookie)
            .map_err(|e| e.to_string())
            .and_then(|ssl| Session::accept(ssl, hello.without_cookie(d), d, now));
        match accepted {
            Ok((mut session, fed)) => {
                session.hello_random = hello.random(d).to_vec();
                self.sessions.borrow_mut().insert(peer, session);
                self.after(peer, fed);
            }
            Err(reason) => self.handshake_failed(peer, HandshakeFailure::Refused, &reason),
        }
        self.gauges();
    }

    /// Act on what feeding `peer`'s session gave: send, note the identity, hand the CoAP
    /// datagrams to the edge, end the session on failure or close.
    fn after(&self, peer: SocketAddr, fed: Fed) {
        for d in &fed.out {
            self.send_raw(peer, d);
        }
        let mut identity = None;
        {
            let mut sessions = self.sessions.borrow_mut();
            if let Some(s) = sessions.get_mut(&peer) {
                if fed.event == Some(Event::Established) {
                    s.identity =
                        context::identity_of(s.ssl(), self.tls.client_certs).map(ByteString::from);
                    self.metrics.handshakes.inc();
                    tracing::debug!(%peer, identity = ?s.identity, "coap dtls session established");
                }
                identity = s.identity.clone();
            }
        }
        if fed.event == Some(Event::Established) {
            self.gauges();
        }
        // Borrows released: serving a request sends through `send_app`.
        for app in &fed.app {
            self.coap.on_secure(peer, app, identity.clone());
        }
        match fed.event {
            Some(Event::Closed) => self.end(peer, Some(SessionEnd::Closed)),
            Some(Event::Failed(reason)) => {
                let established = self
                    .sessions
                    .borrow()
                    .get(&peer)
                    .is_some_and(Session::is_established);
                if established {
                    self.end(peer, Some(SessionEnd::Failed));
                } else {
                    self.sessions.borrow_mut().remove(&peer);
                    self.handshake_failed(peer, HandshakeFailure::Refused, &reason);
                    self.gauges();
                }
            }
            _ => {}
        }
    }

    fn drop(&self, peer: SocketAddr, why: Dropped, now: Instant) {
        self.metrics.dropped(why);
        if self.drop_log_pace.borrow_mut().due(now) {
            tracing::info!(%peer, ?why, "coap dtls datagram dropped before any session");
        }
    }

    fn handshake_failed(&self, peer: SocketAddr, why: HandshakeFailure, reason: &str) {
        self.metrics.failed(why);
        if self.log_pace.borrow_mut().due(Instant::now()) {
            tracing::warn!(%peer, ?why, reason, "coap dtls handshake failed");
        }
    }

    /// Remove `peer`'s session: close_notify if it was established, its observers
    /// deregistered; counted as `why` (`None`: shutting down).
    fn end(&self, peer: SocketAddr, why: Option<SessionEnd>) {
        let Some(mut s) = self.sessions.borrow_mut().remove(&peer) else {
            return;
        };
        if s.is_established() {
            for d in s.close() {
                self.send_raw(peer, &d);
            }
            if let Some(why) = why {
                self.metrics.ended(why);
            }
            self.coap.observers.forget_peer(peer);
        } else if why.is_some() {
            self.metrics.failed(HandshakeFailure::Evicted);
        }
        self.gauges();
    }

    /// At the shard's share of `max_handshakes`: abandon the oldest handshake; at its share of
    /// `max_sessions`: close the oldest handshaking session, else the least recently active
    /// one.
    fn make_room(&self) {
        let victim = {
            let sessions = self.sessions.borrow();
            let handshaking = sessions.values().filter(|s| !s.is_established()).count();
            if handshaking >= self.handshake_limit {
                sessions
                    .iter()
                    .filter(|(_, s)| !s.is_established())
                    .min_by_key(|(_, s)| s.started)
                    .map(|(p, _)| *p)
            } else if sessions.len() >= self.limit {
                sessions
                    .iter()
                    .min_by_key(|(_, s)| (s.is_established(), s.last_active))
                    .map(|(p, _)| *p)
            } else {
                None
            }
        };
        if let Some(peer) = victim {
            self.end(peer, Some(SessionEnd::Evicted));
        }
    }

    fn on_tick(&self, now: Instant) {
        let cfg = &self.tls.config;
        let mut timed_out = Vec::new();
        let mut idle = Vec::new();
        let mut driven = Vec::new();
        for (peer, s) in self.sessions.borrow_mut().iter_mut() {
            if s.is_established() {
                if now.duration_since(s.last_active) >= cfg.idle_timeout {
                    idle.push(*peer);
                }
            } else if now.duration_since(s.started) >= cfg.handshake_timeout {
                timed_out.push(*peer);
            } else {
                let fed = s.poll_timer();
                if !fed.out.is_empty() || fed.event.is_some() {
                    driven.push((*peer, fed));
                }
            }
        }
        for (peer, fed) in driven {
            self.after(peer, fed);
        }
        for peer in timed_out {
            self.sessions.borrow_mut().remove(&peer);
            self.handshake_failed(peer, HandshakeFailure::Timeout, "handshake_timeout passed");
        }
        for peer in idle {
            self.end(peer, Some(SessionEnd::Idle));
        }
        self.gauges();
    }

    fn gauges(&self) {
        let sessions = self.sessions.borrow();
        self.metrics.sessions.set(sessions.len() as i64);
        self.metrics
            .handshaking
            .set(sessions.values().filter(|s| !s.is_established()).count() as i64);
    }
}
