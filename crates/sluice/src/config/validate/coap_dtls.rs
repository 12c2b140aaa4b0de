//! Checks on `[coap.dtls]`: a credential mode (PSK file, certificate and key, or both), files
//! that go together, bounds, and (when files must exist) the PSK file's lines and the PEMs.
//!
//! Owns: the DTLS listener's rules and their wording. Does not own: building the OpenSSL
//! context from them (`crate::edge::coap::dtls::context`).

use super::{check_pem, invalid, Files, Pem};
use crate::config::{Config, ConfigError};

pub(in crate::config) fn check_coap_dtls(config: &Config, files: Files) -> Result<(), ConfigError> {
    let Some(d) = &config.coap.dtls else {
        return Ok(());
    };
    if !config.coap.enabled {
        return invalid(
            "coap.dtls",
            "needs [coap] enabled = true (the DTLS listener serves the CoAP edge's resources)",
        );
    }
    if d.listen.port() != 0 && d.listen == config.coap.listen {
        return invalid("coap.dtls.listen", "is the same address as coap.listen");
    }
    match (&d.cert_file, &d.key_file) {
        (Some(_), None) => {
            return invalid(
                "coap.dtls.key_file",
                "cert_file is set, so key_file is required too",
            )
        }
        (None, Some(_)) => {
            return invalid(
                "coap.dtls.cert_file",
                "key_file is set, so cert_file is required too",
            )
        }
        _ => {}
    }
    if d.psk_file.is_none() && d.cert_file.is_none() {
        return invalid(
            "coap.dtls",
            "needs psk_file, or cert_file and key_file (or both): devices need credentials",
        );
    }
    if d.client_ca_file.is_some() && d.cert_file.is_none() {
        return invalid(
            "coap.dtls.client_ca_file",
            "client certificates are asked for in certificate mode only: set cert_file and key_file",
        );
    }
    if d.max_sessions == 0 {
        return invalid("coap.dtls.max_sessions", "must be at least 1");
    }
    if d.max_handshakes == 0 || d.max_handshakes > d.max_sessions {
        return invalid(
            "coap.dtls.max_handshakes",
            "must be from 1 to coap.dtls.max_sessions",
        );
    }
    if d.idle_timeout.is_zero() || d.handshake_timeout.is_zero() {
        return invalid(
            "coap.dtls.idle_timeout",
            "idle_timeout and handshake_timeout must be more than 0s",
        );
    }
    let mtu = d.mtu.as_u64();
    if !(256..=65_507).contains(&mtu) {
        return invalid(
            "coap.dtls.mtu",
            &format!("{} must be from 256B to 65507B (a UDP datagram)", d.mtu),
        );
    }
    if files == Files::MustExist {
        if let Some(path) = &d.cert_file {
            check_pem("coap.dtls.cert_file", path, Pem::Certificates)?;
        }
        if let Some(path) = &d.key_file {
            check_pem("coap.dtls.key_file", path, Pem::PrivateKey)?;
        }
        if let Some(path) = &d.client_ca_file {
            check_pem("coap.dtls.client_ca_file", path, Pem::Certificates)?;
        }
        let psk = d.read_psk_file()?;
        if d.psk_file.is_some() && psk.is_empty() {
            return invalid("coap.dtls.psk_file", "holds no identity:hex-key line");
        }
    }
    Ok(())
}
