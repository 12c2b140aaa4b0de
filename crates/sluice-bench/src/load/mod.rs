//! Load generators: what plays the devices. [`devices`] is the MQTT device fleet (one connection
//! per device, paced publishes, ack latency); [`paced`] is the pipelined fleet of a few fast devices that the throughput
//! scenario steps up to 100k+ msg/s; [`idle`] holds idle connections (the connections scenario). CoAP sensors and PHD agents go beside it, one
//! module each.

pub mod devices;
pub mod idle;
pub mod paced;
