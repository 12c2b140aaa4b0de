//! Checks on `[phd]`.
//!
//! Owns: these rules and their wording.

use super::{check_pem, invalid, Files, Pem};
use crate::config::{Config, ConfigError};

/// Smallest APDU limit: an AARQ with one data protocol is 54 bytes; config reports are larger.
const MIN_APDU: u64 = 256;
/// The APDU length field is 16 bits: 65,535 + the 4-byte header.
const MAX_APDU: u64 = 65_539;

/// The topic template names both placeholders and is a valid topic otherwise, the ids and
/// offsets parse, the bounds are at least 1, the timers are non-zero.
pub(in crate::config) fn check_phd(config: &Config, files: Files) -> Result<(), ConfigError> {
    let p = &config.phd;
    if !p.topic.contains("{system_id}") {
        return invalid(
            "phd.topic",
            "must contain {system_id} (one topic per agent: measurements of two agents must not mix)",
        );
    }
    if !p.topic.contains("{metric}") {
        return invalid("phd.topic", "must contain {metric}");
    }
    if p.topic.contains(['#', '+']) || p.topic.starts_with('$') || p.topic.contains('\0') {
        return invalid(
            "phd.topic",
            "must be a topic name: no wildcards, no leading '$'",
        );
    }
    if p.manager_id().is_none() {
        return invalid(
            "phd.system_id",
            "must be 16 hex digits (an EUI-64), e.g. \"8877665544332211\"",
        );
    }
    if let Err(entry) = p.allowed_agents() {
        return invalid(
            "phd.agents",
            &format!("{entry:?} is not 16 hex digits (an agent's EUI-64 system id)"),
        );
    }
    if p.utc_offset_secs().is_none() {
        return invalid(
            "phd.agent_utc_offset",
            "must be ±HH:MM, e.g. \"+00:00\" or \"-05:30\"",
        );
    }
    let apdu = p.max_apdu.as_u64();
    if !(MIN_APDU..=MAX_APDU).contains(&apdu) {
        return invalid(
            "phd.max_apdu",
            &format!("must be between {MIN_APDU} B and {MAX_APDU} B (the 16-bit APDU length + 4)"),
        );
    }
    for (key, v) in [
        ("phd.max_connections", p.max_connections),
        ("phd.max_configs", p.max_configs),
        ("phd.max_agents", p.max_agents),
    ] {
        if v == 0 {
            return invalid(key, "must be at least 1");
        }
    }
    if let Some(t) = &p.tls {
        if t.require_client_cert && t.client_ca_file.is_none() {
            return invalid(
                "phd.tls.require_client_cert",
                "needs phd.tls.client_ca_file (the CAs client certificates must chain to)",
            );
        }
        if files == Files::MustExist {
            check_pem("phd.tls.cert_file", &t.cert_file, Pem::Certificates)?;
            check_pem("phd.tls.key_file", &t.key_file, Pem::PrivateKey)?;
            if let Some(ca) = &t.client_ca_file {
                check_pem("phd.tls.client_ca_file", ca, Pem::Certificates)?;
            }
        }
    }
    for (key, d) in [
        ("phd.association_timeout", p.association_timeout),
        ("phd.configuration_timeout", p.configuration_timeout),
        ("phd.response_timeout", p.response_timeout),
    ] {
        if d.is_zero() {
            return invalid(key, "must be more than 0s");
        }
    }
    Ok(())
}
