//! The transport trait: what an outbox ([`crate::sink::outbox::Outbox`]) needs from one link to
//! a far end (a cloud broker today; CoAP over TCP, oneM2M or HTTP later).
//!
//! Owns: the contract between the outbox and a transport, and the small types that cross it
//! ([`LinkLimits`], [`Unit`], [`SendId`], [`Feedback`], [`RefusalClass`], [`Unsendable`]).
//! Does not own: any queueing, packing, ordering, windowing, retry or spool logic — that is
//! the outbox's, written once for every transport. A transport owns its wire protocol: its
//! connection, its encoding, its timers (keep-alive), its own downlink, and the mapping of its
//! refusal codes to a [`RefusalClass`].
//!
//! # One connection, as the outbox drives it
//! [`Transport::connect`] (bounded by the outbox's `connect_timeout`) → repeatedly:
//! [`Transport::encode`] units into the pending batch while
//! [`Transport::pending_bytes`] is below the outbox's batch bound, [`Transport::flush`] (one
//! write), then [`Transport::poll`] raced against the outbox's own wake-ups, then
//! [`Transport::settle`] → until an error (then [`Transport::abort`]) or shutdown (then
//! [`Transport::close`]).
//!
//! # Invariants a transport keeps
//! - Everything runs on one shard thread in a tokio `LocalSet`: no `Send` bound, `Rc` is fine.
//! - [`Transport::poll`] is cancel-safe: the outbox drops it whenever something else woke first,
//!   so it only awaits reads and timers and changes state after its await completed.
//! - A [`SendId`] returned by [`Transport::encode`] is unique among the units of the current
//!   connection not yet acknowledged or refused, and is reported at most once by
//!   [`Feedback`]. A feedback for an id the outbox does not know is ignored (a late answer).
//! - Health: the transport reports its protocol details (socket marks, downlink counters) to
//!   the [`crate::sink::UplinkMetrics`] it was built with; the outbox reports the link state,
//!   connects, failures, sends, acks and drops. Errors carry who is to blame
//!   ([`crate::sink::UplinkError::blame`]).

use std::time::Duration;

use bytes::Bytes;
use sluice_proto::senml::Format;

use crate::sink::{RejectReason, UplinkError, UplinkMessage};

/// The id the far end acknowledges a unit by (an MQTT packet id, for example).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SendId(pub u64);

/// Hashes the ids this side hands out ([`SendId`]s, MQTT packet ids): one multiply instead
/// of SipHash, for the maps looked up once or twice per message. Not for keys a peer
/// chooses: the far end only answers ids we picked, and an unknown one misses like any other.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u16(&mut self, n: u16) {
        self.0 = self.0.rotate_left(16) ^ u64::from(n);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(32) ^ n;
    }
}

/// `HashMap`/`HashSet` state for [`IdHasher`].
pub type BuildIdHasher = std::hash::BuildHasherDefault<IdHasher>;

/// What one connection can take, learnt when it was established.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkLimits {
    /// Units that may be unacknowledged at once (at least 1).
    pub window: usize,
    /// Most encoded payload bytes a SenML pack may have so that its unit fits what the far
    /// end takes (`usize::MAX`: no limit).
    pub pack_limit: usize,
    /// The link's own liveness interval, for the log line (`None`: it has none).
    pub keep_alive: Option<Duration>,
}

/// One unit to send: a device message, or a sealed SenML pack of several.
#[derive(Debug, Clone, Copy)]
pub enum Unit<'a> {
    Message {
        msg: &'a UplinkMessage,
        /// It was sent before on this or an earlier connection (MQTT sets DUP).
        resend: bool,
    },
    Pack {
        payload: &'a Bytes,
        /// The encoding of `payload`.
        format: Format,
        /// Any record came as QoS ≥ 1: the far end must acknowledge the pack.
        needs_ack: bool,
    },
}

/// Why a unit can never be sent on this link (resending cannot help).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsendable {
    #[error("{size} bytes exceed the far end's limit of {max}")]
    TooLarge { size: usize, max: usize },
    #[error("cannot be encoded: {0}")]
    Invalid(String),
}

/// What a refusal means, as the transport classifies its own codes; the outbox applies the
/// policy (pause and resend, or count and complete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalClass {
    /// The far end cannot take it now (a quota); resend in order after a backoff.
    Temporary,
    /// An unspecified failure: treated as temporary until it persisted for
    /// [`crate::sink::outbox::PERSISTENT_ERROR_ROUNDS`] refusal rounds without a success.
    Unclear,
    /// No resend can help: count it by reason and complete the device's token with the code.
    Permanent(RejectReason),
}

/// Whose order a unit must keep: a transport that spreads units over several links
/// (`sink::paths`) keeps each flow on one link while it has units unacknowledged there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flow {
    /// One device's messages (a hash of its id; a collision only merges two flows).
    Device(u64),
    /// SenML packs: one flow, since a pack mixes devices.
    Packs,
}

/// What the far end said about a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    Acked(SendId),
    /// The unit was not acknowledged and never will be on the link it went out on (that link
    /// of several died or stalled, the connection as a whole lives on): the outbox puts it
    /// back at the queue's front, in send order, to be sent again. At-least-once: the far
    /// end may have it already.
    Returned(SendId),
    /// `code`: the far end's code, handed to the device when the refusal is permanent.
    Refused {
        id: SendId,
        code: u8,
        class: RefusalClass,
    },
}

/// One link to a far end, driven by an outbox (see the module docs for the call order).
#[allow(async_fn_in_trait)] // single-threaded by design: no Send bound wanted.
pub trait Transport {
    /// Establish a connection (TCP, TLS, handshake …), replacing any earlier one.
    async fn connect(&mut self) -> Result<LinkLimits, UplinkError>;

    /// The window now, when it changes while connected (several links coming and going);
    /// `None`: the [`LinkLimits::window`] of [`Transport::connect`] holds. Default `None`.
    fn window(&self) -> Option<usize> {
        None
    }

    /// Whether [`Transport::holds`] can ever say yes (a transport over several links). When
    /// false, the outbox does not compute flows at all. Default false.
    const MAY_HOLD: bool = false;

    /// Whether a unit of `flow` must wait now (its link has no room and the flow may not
    /// move while units of it are unacknowledged there). The outbox keeps such units, and
    /// the flow's later ones, in order, and sends other flows meanwhile. Default: never.
    fn holds(&self, _flow: Flow) -> bool {
        false
    }

    /// Encode `unit` into the pending batch. `Ok(Some(id))`: the far end will acknowledge it
    /// by `id`; `Ok(None)`: it is done once the batch is written; `Err`: it can never be sent
    /// here (nothing was added).
    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable>;

    /// Bytes waiting in the pending batch (units and the transport's own packets).
    fn pending_bytes(&self) -> usize;

    /// Write the pending batch in one write; nothing to do when it is empty.
    async fn flush(&mut self) -> Result<(), UplinkError>;

    /// Wait for input or the transport's own timers, and add what the far end said about
    /// units to `feedback`. May return with nothing added (e.g. a keep-alive probe was put
    /// into the pending batch). Cancel-safe.
    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError>;

    /// Follow a reloaded route while connected (the MQTT transport: SUBSCRIBE / UNSUBSCRIBE
    /// the `receive` filters that changed, into the pending batch). Called by the outbox
    /// before each batch; cheap when nothing changed.
    fn follow_route(&mut self) -> Result<(), UplinkError> {
        Ok(())
    }

    /// Work after a poll that must not be cancelled (MQTT: deliver downlink messages, then
    /// queue their acknowledgements into the pending batch). Default: nothing.
    async fn settle(&mut self) -> Result<(), UplinkError> {
        Ok(())
    }

    /// Shutdown: end the connection gracefully (flushing what is pending), bounded in time.
    /// Default: nothing (the outbox then calls [`Transport::abort`]).
    async fn close(&mut self) {}

    /// The connection ended (an error, or after `close`): forget it. Idempotent.
    fn abort(&mut self);
}
