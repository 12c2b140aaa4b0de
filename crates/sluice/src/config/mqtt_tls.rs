//! `[mqtt.tls]`, `[mqtt.ws]`, `[mqtt.wss]`: the device listeners besides plain MQTT over TCP.
//!
//! Owns: the config types and their defaults. Does not own: acting on them (the listener,
//! `crate::edge::mqtt::listener`, and the streams, `crate::edge::mqtt::stream`) or checks
//! across sections (`validate/mqtt_tls.rs`). Each table is optional: absent, that listener is
//! not started. The server certificate and key (and the devices' CA) are read by path, at
//! start-up; a key is never printed.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::units;

/// `[mqtt.tls]`: MQTT over TLS on a listener of its own (8883).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttTlsConfig {
    /// Where TLS devices connect. Default `127.0.0.1:8883` (local only, as `[mqtt] listen`).
    #[serde(with = "units::socket_addr", default = "default_tls_listen")]
    pub listen: SocketAddr,
    /// The server certificate chain (PEM), leaf first. Required.
    pub cert_file: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1). Required.
    pub key_file: PathBuf,
    /// CA certificates (PEM) that devices' client certificates must chain to. Absent: devices
    /// are not asked for a certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
    /// Refuse, at the handshake, a device that presents no certificate (needs
    /// `client_ca_file`). A certificate from another CA is always refused at the handshake.
    #[serde(default)]
    pub require_client_cert: bool,
    /// The device's certificate names it, as Mosquitto's `use_identity_as_username`: its
    /// subject CN (else its first DNS SAN, else its first URI SAN) becomes the username, the
    /// CONNECT's username and password are ignored, and no password is checked. A device
    /// without a certificate is refused (CONNACK not authorized). Needs `client_ca_file`.
    #[serde(default)]
    pub identity_from_cert: bool,
    /// Oldest TLS version offered: `"1.2"` (the default, for older device stacks; TLS 1.3 is
    /// always offered) or `"1.3"`.
    #[serde(default)]
    pub min_version: TlsMinVersion,
}

/// `[mqtt.tls] min_version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TlsMinVersion {
    #[default]
    #[serde(rename = "1.2")]
    Tls12,
    #[serde(rename = "1.3")]
    Tls13,
}

/// `[mqtt.ws]`: MQTT over WebSocket (RFC 6455), plain, for browser and JS clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MqttWsConfig {
    /// Where WebSocket clients connect. Default `127.0.0.1:8080`.
    #[serde(with = "units::socket_addr")]
    pub listen: SocketAddr,
    /// The one HTTP path upgraded to a WebSocket. Default `/mqtt`.
    pub path: String,
}

impl Default for MqttWsConfig {
    fn default() -> Self {
        MqttWsConfig {
            listen: local(8080),
            path: DEFAULT_WS_PATH.to_string(),
        }
    }
}

/// `[mqtt.wss]`: MQTT over WebSocket over TLS, with `[mqtt.tls]`'s certificate and client
/// certificate rules (so `[mqtt.tls]` is required).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MqttWssConfig {
    /// Where secure WebSocket clients connect. Default `127.0.0.1:8081`.
    #[serde(with = "units::socket_addr")]
    pub listen: SocketAddr,
    /// The one HTTP path upgraded to a WebSocket. Default `/mqtt`.
    pub path: String,
}

impl Default for MqttWssConfig {
    fn default() -> Self {
        MqttWssConfig {
            listen: local(8081),
            path: DEFAULT_WS_PATH.to_string(),
        }
    }
}

/// The path MQTT-over-WebSocket clients use by convention (Mosquitto, EMQX, HiveMQ, paho.js).
pub const DEFAULT_WS_PATH: &str = "/mqtt";

fn local(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

fn default_tls_listen() -> SocketAddr {
    local(8883)
}
