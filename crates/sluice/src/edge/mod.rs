//! Device edges: one folder per device protocol (MQTT, CoAP, IEEE 11073), each turning its
//! protocol into the one neutral [`DeviceMessage`].
//!
//! Owns: the device side of the gateway — sockets, protocol state machines, per-device
//! acknowledgement order. Does not own: the neutral types every edge produces
//! ([`DeviceMessage`], [`AckToken`]: `crate::message`, below edges and sinks alike),
//! where a message goes (the router, `crate::shard::router`), priority lanes, the spool,
//! aggregation or any transport (`crate::sink`). Past the edge nothing sees a protocol packet.
//!
//! # The edge contract
//! An edge must:
//! 1. **Decode its protocol** and enforce its own rules (validity, limits, per-connection
//!    state such as MQTT topic aliases), closing only the offending connection.
//! 2. **Build a [`DeviceMessage`]** for each application message, with an [`AckToken`]
//!    (`ack`, made from the connection's [`DeviceAcks`]) when the device expects an
//!    acknowledgement, and `None` when it does not (MQTT QoS 0, a will).
//! 3. **Hand it to the router** (`crate::shard::router::publish`) with the device's
//!    [`Priority`]; the call waits only where a bound is reached for a message that must not
//!    be lost (back-pressure: the edge stops reading that device meanwhile).
//! 4. **Answer the device when its token completes**, in the order the device sent its
//!    messages (drain [`DeviceAcks`]; a failure reason code may come with it).
//! 5. **Close the connection when a token is abandoned** ([`DeviceAcks::is_abandoned`]):
//!    the device resends unacknowledged messages when it reconnects, and only then.
//! 6. **Take local deliveries through `crate::shard::subscriber::LocalSubscriber`** if its
//!    devices subscribe (an MQTT session, a CoAP observer): the router knows no edge's types.
//!
//! # Invariants
//! - A token's acknowledgement reaches the device only after every sink that took the
//!   message is done with it (see `crate::message::ack`); local subscribers never delay it.
//! - A [`DeviceMessage`] owns its bytes (no slice of a read buffer), so what it pins is what
//!   the bounds count.
//!
//! [`Priority`]: crate::control::priority::Priority
//! [`DeviceMessage`]: crate::message::DeviceMessage
//! [`AckToken`]: crate::message::ack::AckToken
//! [`DeviceAcks`]: crate::message::ack::DeviceAcks
//! [`DeviceAcks::is_abandoned`]: crate::message::ack::DeviceAcks::is_abandoned

pub mod coap;
pub mod mqtt;
pub mod phd;
