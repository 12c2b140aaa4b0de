//! What stands at the cloud end and measures: [`sink`] (a subscriber on a real broker: e2e
//! latency, duplicates, order), [`fastsink`] (an acknowledging MQTT-over-TLS server as a fast
//! cloud) and [`floor`] (the kernel floor: answers devices, forwards nothing).

pub mod fastsink;
pub mod floor;
pub mod sink;
