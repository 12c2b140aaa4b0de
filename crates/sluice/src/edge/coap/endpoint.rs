//! One shard's CoAP socket as a sender: [`Endpoint`] implements [`CoapOut`] (plain sends,
//! CONs retransmitted until ACK/RST/timeout, message ids with `mid % shards == shard`), and
//! [`SourceBudget`], the per-source datagram budget applied before anything is decoded.
//!
//! Owns: the CONs in flight that sluice sent, their retransmission timers, the message
//! id counter, and the shard's table of addresses that proved they receive (an ACK of a CON
//! marks its address here; an Echo is checked by `server`). Does not own: reading the socket or what a message means (`super::server`).
//!
//! Invariants: every message id this endpoint hands out satisfies `mid % shards == shard`,
//! so an empty ACK/RST (no Uri-Query to steer by) reaches the shard that sent the CON.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_proto::coap::dedup::SweepPace;
use sluice_proto::coap::reliability::Retransmit;
use sluice_proto::coap::{Message, MsgType};
use tokio::sync::oneshot;

use super::metrics::CoapMetrics;
use super::verify::Verified;
use super::{CoapOut, ConOutcome};

/// Where an endpoint's datagrams go: the shard's UDP socket, or (`super::dtls`) the peer's
/// DTLS session.
pub trait Egress {
    fn send_to(&self, bytes: &[u8], peer: SocketAddr) -> std::io::Result<()>;
}

impl Egress for std::net::UdpSocket {
    fn send_to(&self, bytes: &[u8], peer: SocketAddr) -> std::io::Result<()> {
        std::net::UdpSocket::send_to(self, bytes, peer).map(drop)
    }
}

/// The sending half of a shard's CoAP socket.
pub struct Endpoint {
    me: Weak<Endpoint>,
    /// A duplicate of the shard's socket, written to directly: a non-blocking send that
    /// does not depend on the reactor having seen the socket writable yet. For the DTLS
    /// edge, its sessions.
    socket: Box<dyn Egress>,
    shard: u32,
    shards: u32,
    /// Message ids of this shard: `shard + k * shards` for `k` in `0..mid_slots`.
    mid_slots: u32,
    mid_next: Cell<u32>,
    ack_timeout: Duration,
    max_retransmit: u8,
    rng: Cell<u64>,
    /// CONs waiting for their ACK or RST, by (peer, message id).
    in_flight: RefCell<HashMap<(SocketAddr, u16), oneshot::Sender<ConOutcome>>>,
    /// Addresses that proved they receive.
    verified: RefCell<Verified>,
    /// Every peer finished a DTLS handshake (the DTLS edge's endpoint): all are verified.
    secure: Cell<bool>,
    pub metrics: Arc<CoapMetrics>,
}

impl Endpoint {
    pub fn new(
        socket: std::net::UdpSocket,
        shard: usize,
        shards: usize,
        ack_timeout: Duration,
        max_retransmit: u8,
        verified_bytes: usize,
        metrics: Arc<CoapMetrics>,
    ) -> Rc<Endpoint> {
        let socket: Box<dyn Egress> = Box::new(socket);
        Endpoint::with_egress(
            socket,
            shard,
            shards,
            ack_timeout,
            max_retransmit,
            verified_bytes,
            metrics,
        )
    }

    /// An endpoint that sends through `socket`.
    pub fn with_egress(
        socket: Box<dyn Egress>,
        shard: usize,
        shards: usize,
        ack_timeout: Duration,
        max_retransmit: u8,
        verified_bytes: usize,
        metrics: Arc<CoapMetrics>,
    ) -> Rc<Endpoint> {
        let shards = shards.clamp(1, 65536) as u32;
        let shard = (shard as u32).min(shards - 1);
        let seed = Instant::now().elapsed().as_nanos() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x9E37_79B9)
            ^ (shard as u64) << 32;
        let mid_slots = (65535 - shard) / shards + 1;
        Rc::new_cyclic(|me| Endpoint {
            me: me.clone(),
            socket,
            shard,
            shards,
            mid_slots,
            // Start anywhere: a restarted gateway should not reuse the ids it just used.
            mid_next: Cell::new((seed % mid_slots as u64) as u32),
            ack_timeout,
            max_retransmit,
            rng: Cell::new(seed | 1),
            in_flight: RefCell::new(HashMap::new()),
            verified: RefCell::new(Verified::new(verified_bytes)),
            secure: Cell::new(false),
            metrics,
        })
    }

    /// Send raw bytes; a full socket buffer drops them (counted): UDP, a CON is resent.
    pub fn send_bytes(&self, peer: SocketAddr, bytes: &[u8]) {
        match self.socket.send_to(bytes, peer) {
            Ok(()) => self.metrics.datagrams_out.inc(),
            Err(error) => {
                self.metrics.send_dropped.inc();
                tracing::debug!(%peer, %error, "coap datagram not sent");
            }
        }
    }

    /// An ACK or RST from `peer` for `mid`: completes the CON it answers. False when it
    /// answers no CON in flight.
    pub fn on_answer(&self, peer: SocketAddr, mid: u16, reset: bool) -> bool {
        let Some(tx) = self.in_flight.borrow_mut().remove(&(peer, mid)) else {
            return false;
        };
        if !reset {
            // A completed CON exchange: the address receives what sluice sends.
            self.metrics.verified_ack.inc();
            self.mark_verified(peer);
        }
        let _ = tx.send(if reset {
            ConOutcome::Reset
        } else {
            ConOutcome::Acked
        });
        true
    }

    /// [`CoapOut::send_con`] with at most `max_retransmit` retransmissions (fewer than the
    /// configured number: to an address that has not proven it receives).
    pub fn send_con_with(
        &self,
        peer: SocketAddr,
        mut msg: Message,
        max_retransmit: u8,
    ) -> oneshot::Receiver<ConOutcome> {
        let (tx, rx) = oneshot::channel();
        let Some(me) = self.me.upgrade() else {
            let _ = tx.send(ConOutcome::TimedOut);
            return rx;
        };
        msg.mtype = MsgType::Con;
        msg.message_id = self.next_message_id();
        if msg.code.is_response() {
            self.metrics.response(msg.code);
        }
        let bytes = msg.to_udp();
        let key = (peer, msg.message_id);
        let (answer_tx, mut answer) = oneshot::channel();
        // A CON still in flight under the same id (65536 / shards ids ago) is given up.
        self.in_flight.borrow_mut().insert(key, answer_tx);
        let mut schedule = Retransmit::new(
            self.ack_timeout,
            max_retransmit.min(self.max_retransmit),
            self.random(),
        );
        tokio::task::spawn_local(async move {
            loop {
                me.send_bytes(peer, &bytes);
                match tokio::time::timeout(schedule.timeout(), &mut answer).await {
                    Ok(Ok(outcome)) => {
                        let _ = tx.send(outcome);
                        return;
                    }
                    // Replaced by a newer CON under the same id.
                    Ok(Err(_)) => {
                        let _ = tx.send(ConOutcome::TimedOut);
                        return;
                    }
                    Err(_) if schedule.retransmit() => me.metrics.retransmissions.inc(),
                    Err(_) => {
                        me.in_flight.borrow_mut().remove(&key);
                        me.metrics.con_timeouts.inc();
                        let _ = tx.send(ConOutcome::TimedOut);
                        return;
                    }
                }
            }
        });
        rx
    }

    /// Whether `peer` has proven it receives (within `verify::VERIFIED_FOR`).
    pub fn is_verified(&self, peer: SocketAddr) -> bool {
        self.secure.get() || self.verified.borrow().contains(peer, Instant::now())
    }

    /// Every peer of this endpoint finished a DTLS handshake: each proved it receives (so
    /// its observers get RFC 7641's NON/CON and Block2 notifications like a verified one).
    pub fn set_secure(&self) {
        self.secure.set(true);
    }

    /// `peer` just proved it receives.
    pub fn mark_verified(&self, peer: SocketAddr) {
        let mut v = self.verified.borrow_mut();
        v.insert(peer, Instant::now());
        self.metrics.verified_peers.set(v.len() as i64);
    }

    /// CONs in flight (waiting for their ACK).
    pub fn in_flight(&self) -> usize {
        self.in_flight.borrow().len()
    }

    /// A number in `[0, 1)` (xorshift; for the retransmission jitter only).
    fn random(&self) -> f64 {
        let mut x = self.rng.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl CoapOut for Endpoint {
    fn send(&self, peer: SocketAddr, msg: &Message) {
        if msg.mtype == MsgType::Rst {
            self.metrics.rst_sent.inc();
        }
        if msg.code.is_response() {
            self.metrics.response(msg.code);
        }
        self.send_bytes(peer, &msg.to_udp());
    }

    fn send_con(&self, peer: SocketAddr, msg: Message) -> oneshot::Receiver<ConOutcome> {
        self.send_con_with(peer, msg, self.max_retransmit)
    }

    fn send_con_limited(
        &self,
        peer: SocketAddr,
        msg: Message,
        max_retransmit: u8,
    ) -> oneshot::Receiver<ConOutcome> {
        self.send_con_with(peer, msg, max_retransmit)
    }

    fn verified(&self, peer: SocketAddr) -> bool {
        self.is_verified(peer)
    }

    fn next_message_id(&self) -> u16 {
        let k = self.mid_next.get();
        self.mid_next.set((k + 1) % self.mid_slots);
        // Invariant: k < mid_slots, so shard + k * shards <= 65535.
        (self.shard + k * self.shards) as u16
    }
}

/// A token bucket per source address: `rate` datagrams per second, `burst` above it.
#[derive(Debug)]
pub struct SourceBudget {
    rate: f64,
    burst: f64,
    cap: usize,
    buckets: HashMap<SocketAddr, (f64, Instant)>,
    sweeps: SweepPace,
}

impl SourceBudget {
    /// `rate` 0: unlimited. At most `cap` sources are tracked; beyond, idle ones are
    /// forgotten, and a new source finding the table still full is let through untracked
    /// (a flood from one source is already in the table).
    pub fn new(rate: u32, burst: u32, cap: usize) -> SourceBudget {
        SourceBudget {
            rate: rate as f64,
            burst: burst.max(1) as f64,
            cap: cap.max(16),
            buckets: HashMap::new(),
            sweeps: SweepPace::default(),
        }
    }

    /// Whether a datagram from `peer` at `now` is within its budget.
    pub fn allow(&mut self, peer: SocketAddr, now: Instant) -> bool {
        if self.rate <= 0.0 {
            return true;
        }
        let (rate, burst) = (self.rate, self.burst);
        if !self.buckets.contains_key(&peer) && self.buckets.len() >= self.cap {
            // A bucket that refilled is the same as no bucket. Swept at most once a second,
            // so a flood of new sources costs no scan per datagram.
            if self.sweeps.due(now) {
                self.buckets.retain(|_, (tokens, at)| {
                    *tokens + now.duration_since(*at).as_secs_f64() * rate < burst
                });
            }
            if self.buckets.len() >= self.cap {
                return true;
            }
        }
        let (tokens, at) = self.buckets.entry(peer).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_gets_its_burst_then_its_rate_and_others_are_unaffected() {
        let t0 = Instant::now();
        let mut b = SourceBudget::new(100, 10, 16);
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let c: SocketAddr = "10.0.0.2:5000".parse().unwrap();
        assert_eq!((0..20).filter(|_| b.allow(a, t0)).count(), 10);
        assert!(b.allow(c, t0), "another source has its own budget");
        // 100 ms later: 10 more.
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!((0..20).filter(|_| b.allow(a, t1)).count(), 10);
        assert!(SourceBudget::new(0, 0, 1).allow(a, t0), "0 = unlimited");
    }

    #[test]
    fn message_ids_of_a_shard_are_congruent_to_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            for (shard, shards) in [(0, 1), (2, 3), (6, 7), (0, 4)] {
                let ep = Endpoint::new(
                    socket.try_clone().unwrap(),
                    shard,
                    shards,
                    Duration::from_secs(2),
                    4,
                    1 << 20,
                    Arc::default(),
                );
                let mut seen = std::collections::HashSet::new();
                for _ in 0..70_000 {
                    let mid = ep.next_message_id();
                    assert_eq!(mid as usize % shards, shard);
                    seen.insert(mid);
                }
                assert_eq!(seen.len(), (65535 - shard) / shards + 1, "every id is used");
            }
        });
    }
}
