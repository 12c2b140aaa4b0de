//! Checks on `[mqtt.tls]`, `[mqtt.ws]` and `[mqtt.wss]`.
//!
//! Owns: these rules and their wording. The certificate files are opened and parsed here
//! (when `files` says they must exist); the TLS config itself is built at start-up
//! (`crate::edge::mqtt::stream::tls::server_config`).

use std::net::SocketAddr;

use super::{check_pem, invalid, Files, Pem};
use crate::config::{Config, ConfigError};

/// Client-certificate options name a CA; wss has a certificate; paths are paths; no two
/// device listeners (nor the admin endpoint) share an address.
pub(in crate::config) fn check_mqtt_listeners(
    config: &Config,
    files: Files,
) -> Result<(), ConfigError> {
    let m = &config.mqtt;
    if let Some(tls) = &m.tls {
        if tls.client_ca_file.is_none() {
            if tls.require_client_cert {
                return invalid(
                    "mqtt.tls.require_client_cert",
                    "is true, so client_ca_file is required (the CA devices' certificates must chain to)",
                );
            }
            if tls.identity_from_cert {
                return invalid(
                    "mqtt.tls.identity_from_cert",
                    "is true, so client_ca_file is required (the CA devices' certificates must chain to)",
                );
            }
        }
        if files == Files::MustExist {
            check_pem("mqtt.tls.cert_file", &tls.cert_file, Pem::Certificates)?;
            check_pem("mqtt.tls.key_file", &tls.key_file, Pem::PrivateKey)?;
            if let Some(ca) = &tls.client_ca_file {
                check_pem("mqtt.tls.client_ca_file", ca, Pem::Certificates)?;
            }
        }
    }
    if m.wss.is_some() && m.tls.is_none() {
        return invalid(
            "mqtt.wss",
            "needs [mqtt.tls]: wss uses its certificate, key and client-certificate rules",
        );
    }
    for (key, path) in [
        ("mqtt.ws.path", m.ws.as_ref().map(|w| &w.path)),
        ("mqtt.wss.path", m.wss.as_ref().map(|w| &w.path)),
    ] {
        if let Some(path) = path {
            if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c == '?') {
                return invalid(
                    key,
                    &format!(
                        "{path:?} must be an absolute HTTP path without a query, e.g. \"/mqtt\""
                    ),
                );
            }
        }
    }
    let mut seen: Vec<(&str, SocketAddr)> = vec![("mqtt.listen", m.listen)];
    if config.admin.enabled {
        seen.push(("admin.listen", config.admin.listen));
    }
    for (key, addr) in [
        ("mqtt.tls.listen", m.tls.as_ref().map(|t| t.listen)),
        ("mqtt.ws.listen", m.ws.as_ref().map(|w| w.listen)),
        ("mqtt.wss.listen", m.wss.as_ref().map(|w| w.listen)),
    ] {
        let Some(addr) = addr else { continue };
        if addr.port() != 0 {
            if let Some((other, _)) = seen.iter().find(|(_, a)| *a == addr) {
                return invalid(key, &format!("is the same address as {other}"));
            }
        }
        seen.push((key, addr));
    }
    Ok(())
}
