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
//! `metrics`, `dtls` (CoAP over DTLS 1.2: its own listener and sessions, feeding a second
//! `CoapShard` whose egress is the peers' sessions).

pub mod dtls;
pub mod endpoint;
pub mod metrics;
pub mod observe;
mod publish;
mod resources;
pub mod server;
pub mod socket;

pub use metrics::CoapMetrics;
pub use server::{start, CoapShard};

use std::net::SocketAddr;

use sluice_proto::coap::Message;
use tokio::sync::oneshot;

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
}
