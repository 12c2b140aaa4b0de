//! Load generators: what plays the devices.
//! - [`devices`]: the MQTT device fleet (one connection per device, paced publishes, ack
//!   latency, reconnects);
//! - [`paced`]: the pipelined fleet of a few fast devices that the throughput scenario steps up
//!   to 100k+ msg/s;
//! - [`idle`]: idle connections and the `idle` worker processes (the connections scenario);
//! - [`dashboards`]: open dashboards (page load, then the server-sent event stream) on sluice's
//!   admin endpoint;
//! - [`coap`]: CoAP sensors in a closed loop (CoAPBench-like), and a trivial CoAP responder.
//! - [`phd`]: IEEE 11073 PHD agents that associate once and send paced, pipelined, confirmed
//!   scan reports;
//! - [`phd_storm`]: the PHD control storm (short association/configuration/release sessions).

pub mod coap;
pub mod dashboards;
pub mod devices;
pub mod idle;
pub mod paced;
pub mod phd;
pub mod phd_storm;
