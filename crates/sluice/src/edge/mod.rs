//! Device edges: one folder per device protocol (MQTT today; CoAP and IEEE 11073 next), each
//! turning its protocol into the one neutral [`DeviceMessage`].
//!
//! Owns: the device side of the gateway — sockets, protocol state machines, per-device
//! acknowledgement order — and the [`DeviceMessage`] type every edge produces. Does not own:
//! where a message goes (the router, `crate::shard::router`), priority lanes, the spool,
//! aggregation or any transport (`crate::sink`). Past the edge nothing sees a protocol packet.
//!
//! # The edge contract
//! An edge must:
//! 1. **Decode its protocol** and enforce its own rules (validity, limits, per-connection
//!    state such as MQTT topic aliases), closing only the offending connection.
//! 2. **Build a [`DeviceMessage`]** for each application message, with an [`AckToken`]
//!    (`ack`, made from the connection's [`ack::DeviceAcks`]) when the device expects an
//!    acknowledgement, and `None` when it does not (MQTT QoS 0, a will).
//! 3. **Hand it to the router** (`crate::shard::router::publish`) with the device's
//!    [`Priority`]; the call waits only where a bound is reached for a message that must not
//!    be lost (back-pressure: the edge stops reading that device meanwhile).
//! 4. **Answer the device when its token completes**, in the order the device sent its
//!    messages (drain [`ack::DeviceAcks`]; a failure reason code may come with it).
//! 5. **Close the connection when a token is abandoned** ([`ack::DeviceAcks::is_abandoned`]):
//!    the device resends unacknowledged messages when it reconnects, and only then.
//!
//! # Invariants
//! - A token's acknowledgement reaches the device only after every sink that took the
//!   message is done with it (see [`ack`]); local subscribers never delay it.
//! - A [`DeviceMessage`] owns its bytes (no slice of a read buffer), so what it pins is what
//!   the bounds count.
//!
//! [`Priority`]: crate::control::priority::Priority

pub mod ack;
pub mod coap;
pub mod mqtt;
pub mod phd;

use std::time::Instant;

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{Properties, QoS};

use ack::AckToken;

/// One application message from a device, in no protocol's shape: what every edge hands the
/// router, and all the router and the sinks see of it.
#[derive(Debug)]
pub struct DeviceMessage {
    /// The device's identity (its MQTT client id; `{device}` in uplink topic templates).
    pub device: ByteString,
    /// The local topic (validated by the edge).
    pub topic: ByteString,
    pub payload: Bytes,
    /// The delivery guarantee the device asked for (local subscribers get at most this).
    pub qos: QoS,
    /// Keep it as the topic's retained message.
    pub retain: bool,
    /// MQTT 5 application properties carried to local subscribers and the retained store
    /// (Message Expiry, Content Type, User Properties, …); per-connection ones (topic alias,
    /// subscription identifiers) already removed. Other edges set what maps onto them.
    pub properties: Option<Box<Properties>>,
    /// When the gateway read it from the device (start of the ack-latency histogram, the
    /// spool record's time).
    pub received_at: Instant,
    /// `Some` when the device expects an acknowledgement: completed once every sink is done
    /// with the message (see [`ack`]).
    pub ack: Option<AckToken>,
}
