//! `[limits]`: per-device rates, connection rates at accept, flapping devices (ADR 0008).
//!
//! Owns: the config type and its defaults. Does not own: applying them
//! (`crate::control::limits` for connections and flapping, the MQTT connection and the CoAP
//! edge for publish rates).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units::{self, ByteSize};

/// `[limits]`. Publish rates are off by default (devices' rates differ by orders of
/// magnitude, and `gateway.max_buffered` already bounds what a fast device can make the
/// gateway hold); so are connection rates (fleets behind one NAT address, and a whole site
/// reconnecting after an outage, would be refused by any one number; `max_connections`,
/// `connect_timeout` and `auth_queue` already bound what connections cost). Flapping is on:
/// no healthy device connects 20 times a minute with one client id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Messages per second one device may publish (token bucket); 0: no limit.
    pub publish_rate: u32,
    /// Messages a device may publish in a burst above `publish_rate`.
    pub publish_burst: u32,
    /// Payload bytes per second one device may publish; 0 B: no limit.
    pub publish_bytes_rate: ByteSize,
    /// Bytes a device may publish in a burst above `publish_bytes_rate` (at least one
    /// `mqtt.max_packet_size` is allowed whatever this says).
    pub publish_bytes_burst: ByteSize,
    /// New MQTT connections per second from one source address; 0: no limit.
    pub connect_rate_per_source: u32,
    pub connect_burst_per_source: u32,
    /// New MQTT connections per second, whole gateway; 0: no limit.
    pub connect_rate: u32,
    pub connect_burst: u32,
    /// Memory for the per-source connection table (oldest-refilled sources forgotten first).
    pub connect_sources_memory: ByteSize,
    /// A client id that connects more than this many times within `flap_window` is refused
    /// (CONNACK 0x9F / 3.1.1 0x03) for `flap_hold`; 0: never.
    pub flap_connects: u32,
    #[serde(with = "units::duration")]
    pub flap_window: Duration,
    #[serde(with = "units::duration")]
    pub flap_hold: Duration,
    /// Memory for the table of recently connecting client ids.
    pub flap_memory: ByteSize,
    /// Memory for the CoAP edge's per-device publish-rate table (CoAP has no connection to
    /// keep a device's buckets), whole gateway, for each CoAP edge (plain and DTLS).
    pub coap_rates_memory: ByteSize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            publish_rate: 0,
            publish_burst: 100,
            publish_bytes_rate: ByteSize(0),
            publish_bytes_burst: ByteSize::mib(1),
            connect_rate_per_source: 0,
            connect_burst_per_source: 20,
            connect_rate: 0,
            connect_burst: 1_000,
            connect_sources_memory: ByteSize::mib(1),
            flap_connects: 20,
            flap_window: Duration::from_secs(60),
            flap_hold: Duration::from_secs(60),
            flap_memory: ByteSize::mib(1),
            coap_rates_memory: ByteSize::mib(1),
        }
    }
}
