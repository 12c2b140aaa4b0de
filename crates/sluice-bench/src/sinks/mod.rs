//! What stands at the cloud end and measures: [`sink`] (a subscriber on a real broker: e2e
//! latency, duplicates, order), [`fastsink`] (an acknowledging MQTT-over-TLS server as a fast
//! cloud) [`floor`] (the kernel floor: answers devices, forwards nothing; [`floor_uring`] the
//! same over io_uring), [`adaptor_floor`] (the least an MQTT → HTTP function adaptor does: one
//! POST per QoS 1 PUBLISH), [`relay_floor`] (the least an MQTT forwarder does: one TLS 1.3
//! session to the cloud, ack after the cloud's ack) and [`recorder`] (a subscriber that records
//! every arrival for a scenario's analysis).

pub mod adaptor_floor;
pub mod fastsink;
pub mod floor;
pub mod floor_uring;
pub mod recorder;
pub mod relay_floor;
pub mod sink;
