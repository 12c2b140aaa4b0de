//! The CoAP edge (RFC 7252 over UDP): devices that publish with POST/PUT to
//! `coap://gw/{pubsub_path}/{topic}`, subscribe with GET + Observe (RFC 7641), and reach
//! upstream CoAP servers through the proxy (`crate::proxy`).
//!
//! Owns: the per-shard UDP sockets, steering a datagram to its device's shard, message-id
//! de-duplication, CON retransmission of what sluice sends, block-wise transfers, and the
//! observers on each shard. Does not own: routing (`crate::shard::router`), the upstream
//! connections (`crate::proxy`), or the codec (`sluice_proto::coap`).
//!
//! Modules: `socket` (binding one SO_REUSEPORT socket per shard), `server` (the receive
//! loop, steering, de-duplication, answering), `endpoint` (sending, CON retransmission,
//! message ids, the per-source budget), `resources` (dispatch by path, /.well-known/core),
//! `publish` (the pub/sub resource's POST/PUT, Block1), `observe` (GET + Observe),
//! `verify` (RFC 9175 Echo and the addresses that proved they receive), `metrics`, `dtls`
//! (CoAP over DTLS 1.2: its own listener and sessions, feeding a second `CoapShard` whose
//! egress is the peers' sessions).
//!
//! Hostile network rules (issue 28): no answer larger than 3× its request goes to an address
//! that has not proven it receives (`verify`; larger answers become 4.01 Unauthorized with
//! an Echo option, or Block2 blocks within `max_message_size` once verified); an observer
//! at an unverified address gets only CON notifications within 3× its registration, the
//! first unacknowledged one ending it; every per-peer table is bounded in bytes (the
//! de-duplication table by `max_exchange_bytes`, Block1 bodies by `max_block_bytes`,
//! verified addresses by `max_verified_bytes`, observers by count per gateway, per IP and
//! per DTLS device, copies of block-wise notifications by `max_snapshot_bytes`, `[limits]`
//! publish-rate buckets by `limits.coap_rates_memory`). A notification larger than
//! `max_message_size` goes block-wise to a verified observer only (`observe`).
//!
//! Identity seam (for CoAP over DTLS): every datagram enters through
//! [`CoapShard::on_datagram`] with `identity: Option<DeviceIdentity>` — `None` for plain UDP
//! (this module's own socket), `Some` for a datagram a secure transport decrypted and
//! authenticated. The identity is the request's device id (instead of `c=` or the address),
//! counts as proof that the address receives, and is what `coap.allow_anonymous` checks:
//! without one, publish and observe are refused (4.01) when anonymous peers are not allowed.
//! The answer still leaves through this shard's [`CoapOut`]; a DTLS transport must wrap
//! that side too: the DTLS edge's `CoapShard` has a session egress (`endpoint::Egress`).

pub mod dtls;
pub mod endpoint;
pub mod metrics;
pub mod observe;
mod publish;
mod resources;
pub mod server;
pub mod socket;
pub mod verify;

pub use metrics::CoapMetrics;
pub use server::{start, CoapShard};

use std::net::SocketAddr;

use bytestring::ByteString;
use sluice_proto::coap::Message;
use tokio::sync::oneshot;

/// Who sent a datagram, as a secure transport authenticated it (a DTLS PSK identity or a
/// certificate's name): the device id of its requests. Plain CoAP/UDP has none.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceIdentity {
    pub device_id: ByteString,
}

/// What happened to a CON sluice sent (a separate response, a notification).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConOutcome {
    /// The peer acknowledged it.
    Acked,
    /// The peer answered RST: it does not want it (an observer deregisters).
    Reset,
    /// No ACK after MAX_RETRANSMIT retransmissions.
    TimedOut,
}

/// How the parts of the edge on one shard send to devices. Implemented by the shard's CoAP
/// socket (`edge::coap`), used by the observers (`observe`) and the request handlers.
pub trait CoapOut {
    /// Send `msg` as is (NON, ACK, RST; its message id already set).
    fn send(&self, peer: SocketAddr, msg: &Message);
    /// Send `msg` as a CON with a fresh message id, retransmitted (RFC 7252 §4.2) until the
    /// peer ACKs or RSTs it or `max_retransmit` is spent; the receiver tells which.
    fn send_con(&self, peer: SocketAddr, msg: Message) -> oneshot::Receiver<ConOutcome>;
    /// A fresh message id (for a NON sluice sends).
    fn next_message_id(&self) -> u16;
    /// [`CoapOut::send_con`] with at most `max_retransmit` retransmissions (to an address
    /// not verified, whose answers must stay within 3× its request).
    fn send_con_limited(
        &self,
        peer: SocketAddr,
        msg: Message,
        max_retransmit: u8,
    ) -> oneshot::Receiver<ConOutcome>;
    /// Whether `peer` has proven it receives (`verify`).
    fn verified(&self, peer: SocketAddr) -> bool;
}
