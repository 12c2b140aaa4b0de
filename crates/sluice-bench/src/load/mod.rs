//! Load generators: what plays the devices. [`devices`] is the MQTT device fleet (one connection
//! per device, paced publishes, ack latency). CoAP sensors and PHD agents go beside it, one
//! module each.

pub mod devices;
