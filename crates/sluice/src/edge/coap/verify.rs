//! Return-routability of CoAP peers (RFC 9175 §2.4): which source addresses have proven they
//! receive what sluice sends them, so that nothing larger than 3× a request goes to an
//! address that may be spoofed.
//!
//! Owns: the Echo values sluice hands out and checks (stateless: `t ‖ HMAC-SHA256(key, t ‖
//! ip ‖ port)[..8]`, `t` in seconds of the process's monotonic clock — never the wall clock,
//! which an NTP step would move, invalidating every value in flight or stretching their
//! validity by the step — with a per-process random key, so issuing one costs no state), and the shard's table of verified addresses. Does not own: deciding what to send
//! (`server::answer` applies the 3× rule) or retransmitting (`endpoint`).
//!
//! An address is verified when it echoes an Echo value issued to it at most
//! [`ECHO_VALIDITY`] ago, or when it ACKs a CON sluice sent it (a completed CON exchange).
//! A peer authenticated by a secure transport (DTLS) has proven it receives by its handshake:
//! the server treats a request carrying an identity as verified without this table.
//!
//! Invariants: at most `coap.max_verified_peers / shards` addresses per shard, each charged
//! [`VERIFIED_ENTRY_BYTES`]; the address verified longest ago goes first when full; an entry
//! is forgotten [`VERIFIED_FOR`] after its last proof.
//!
//! HMAC-SHA256 comes from rustls's crypto provider (ring), already a dependency: no new crate.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustls::crypto::tls13::OkmBlock;
use rustls::SupportedCipherSuite;

/// How long an Echo value sluice issued is accepted back (RFC 9175 §2.3: a few round trips,
/// with room for a client's retransmissions).
pub const ECHO_VALIDITY: Duration = Duration::from_secs(120);
/// How long an address stays verified after its last proof (an Echo or an ACK).
pub const VERIFIED_FOR: Duration = Duration::from_secs(3600);
/// Bytes one verified address is charged: the map entry (address 32 B, two instants 24 B,
/// hash slot) and its place in the order queue.
pub const VERIFIED_ENTRY_BYTES: usize = 96;
/// Length of the Echo values sluice issues: 4 bytes of time, 8 of tag.
pub const ECHO_LEN: usize = 12;

/// The per-process key of Echo tags (the same on every shard: a request carrying an Echo may
/// be served by another shard than the one that issued it).
fn key() -> &'static OkmBlock {
    static KEY: OnceLock<OkmBlock> = OnceLock::new();
    KEY.get_or_init(|| OkmBlock::new(&rand::random::<[u8; 32]>()))
}

fn tag(t: u32, peer: SocketAddr) -> [u8; 8] {
    let mut msg = Vec::with_capacity(4 + 16 + 2);
    msg.extend_from_slice(&t.to_be_bytes());
    match peer.ip() {
        IpAddr::V4(ip) => msg.extend_from_slice(&ip.octets()),
        IpAddr::V6(ip) => msg.extend_from_slice(&ip.octets()),
    }
    msg.extend_from_slice(&peer.port().to_be_bytes());
    let SupportedCipherSuite::Tls13(suite) =
        rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
    else {
        unreachable!("a TLS 1.3 suite");
    };
    let full = suite.hkdf_provider.hmac_sign(key(), &msg);
    let mut out = [0u8; 8];
    out.copy_from_slice(&full.as_ref()[..8]);
    out
}

/// Seconds since this process first issued or checked an Echo value, on the monotonic clock
/// (the key is per process, so no value outlives the clock it was stamped on).
fn clock_now() -> u32 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs() as u32
}

/// A fresh Echo value for `peer`.
pub fn echo_for(peer: SocketAddr) -> [u8; ECHO_LEN] {
    echo_at(peer, clock_now())
}

fn echo_at(peer: SocketAddr, t: u32) -> [u8; ECHO_LEN] {
    let mut v = [0u8; ECHO_LEN];
    v[..4].copy_from_slice(&t.to_be_bytes());
    v[4..].copy_from_slice(&tag(t, peer));
    v
}

/// Whether `value` is an Echo sluice issued to `peer` within [`ECHO_VALIDITY`].
pub fn echo_valid(peer: SocketAddr, value: &[u8]) -> bool {
    echo_valid_at(peer, value, clock_now())
}

fn echo_valid_at(peer: SocketAddr, value: &[u8], now: u32) -> bool {
    if value.len() != ECHO_LEN {
        return false;
    }
    let t = u32::from_be_bytes([value[0], value[1], value[2], value[3]]);
    // A second of clock skew between shards' reads of the clock is allowed.
    if t > now.saturating_add(1) || now.saturating_sub(t) as u64 > ECHO_VALIDITY.as_secs() {
        return false;
    }
    // Constant time is not needed for an 8-byte tag that expires in minutes and costs the
    // guesser a datagram per try, but is cheap.
    tag(t, peer)
        .iter()
        .zip(&value[4..])
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// The addresses of one shard that proved they receive.
#[derive(Debug)]
pub struct Verified {
    /// Address → (verified at, order stamp).
    map: HashMap<SocketAddr, (Instant, u64)>,
    /// Proof order, oldest first; stale stamps (re-proved addresses) are skipped.
    order: VecDeque<(SocketAddr, u64)>,
    cap: usize,
    stamp: u64,
}

impl Verified {
    /// A table of at most `max_bytes / VERIFIED_ENTRY_BYTES` addresses (at least 16).
    pub fn new(max_bytes: usize) -> Verified {
        Verified {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap: (max_bytes / VERIFIED_ENTRY_BYTES).max(16),
            stamp: 0,
        }
    }

    /// Whether `peer` proved it receives within [`VERIFIED_FOR`].
    pub fn contains(&self, peer: SocketAddr, now: Instant) -> bool {
        self.map
            .get(&peer)
            .is_some_and(|(at, _)| now.duration_since(*at) < VERIFIED_FOR)
    }

    /// `peer` just proved it receives.
    pub fn insert(&mut self, peer: SocketAddr, now: Instant) {
        self.stamp += 1;
        self.map.insert(peer, (now, self.stamp));
        self.order.push_back((peer, self.stamp));
        while self.map.len() > self.cap {
            let Some((p, s)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&p).is_some_and(|(_, st)| *st == s) {
                self.map.remove(&p);
            }
        }
        // Forget expired ones from the front.
        while let Some(&(p, s)) = self.order.front() {
            match self.map.get(&p) {
                Some((at, st)) if *st == s && now.duration_since(*at) < VERIFIED_FOR => break,
                Some((_, st)) if *st == s => {
                    self.map.remove(&p);
                }
                _ => {}
            }
            self.order.pop_front();
        }
        // An address re-proved often leaves stale entries behind: compact (amortised O(1):
        // afterwards the queue is no longer than the map).
        if self.order.len() > self.cap.saturating_mul(2) {
            let map = &self.map;
            self.order
                .retain(|(p, s)| map.get(p).is_some_and(|(_, st)| st == s));
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes charged for the table as it is.
    pub fn bytes(&self) -> usize {
        self.map.len() * VERIFIED_ENTRY_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echo_verifies_only_its_own_address_and_only_while_fresh() {
        let a: SocketAddr = "192.0.2.1:5683".parse().unwrap();
        let b: SocketAddr = "192.0.2.1:5684".parse().unwrap();
        let t = 1_700_000_000;
        let e = echo_at(a, t);
        assert!(echo_valid_at(a, &e, t));
        assert!(echo_valid_at(a, &e, t + 120));
        assert!(!echo_valid_at(a, &e, t + 121), "expired");
        assert!(!echo_valid_at(b, &e, t), "another port");
        let mut forged = e;
        forged[11] ^= 1;
        assert!(!echo_valid_at(a, &forged, t));
        assert!(!echo_valid_at(a, &e[..8], t));
    }

    #[test]
    fn the_table_is_bounded_and_forgets_the_oldest() {
        let t0 = Instant::now();
        let mut v = Verified::new(16 * VERIFIED_ENTRY_BYTES);
        for port in 0..100u16 {
            v.insert(SocketAddr::from(([10, 0, 0, 1], port)), t0);
            // Re-proving one address often must not grow the order queue without bound.
            v.insert(SocketAddr::from(([10, 0, 0, 2], 1)), t0);
        }
        assert!(v.len() <= 16, "{}", v.len());
        assert!(v.order.len() <= 32, "{}", v.order.len());
        assert!(v.contains(SocketAddr::from(([10, 0, 0, 1], 99)), t0));
        assert!(!v.contains(SocketAddr::from(([10, 0, 0, 1], 0)), t0));
        assert!(!v.contains(SocketAddr::from(([10, 0, 0, 1], 99)), t0 + VERIFIED_FOR));
    }
}
