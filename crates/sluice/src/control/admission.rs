//! Connection admission: client-id rules and username/password checks.
//!
//! Password hashes come from the config as PHC strings (argon2id recommended). Verification is
//! deliberately expensive, so it runs on the blocking pool: a storm of CONNECTs with slow
//! hashes delays other admissions, never a shard.

use std::collections::HashMap;
use std::sync::Arc;

use bytestring::ByteString;
use sluice_proto::mqtt::{reason, Connect, ProtocolVersion};

use crate::config::MqttConfig;
use crate::shard::limits::TopicLimits;

/// Why a device was refused; carries the CONNACK code for its protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("client identifier refused by the gateway's rules")]
    ClientIdRejected,
    #[error("bad user name or password")]
    BadCredentials,
    #[error("anonymous devices are not allowed")]
    NotAuthorized,
    #[error("enhanced authentication (MQTT 5 AUTH) is not supported")]
    BadAuthMethod,
    /// Input bounds: the will topic is beyond `mqtt.max_topic_levels`/`max_topic_length`.
    #[error("will topic beyond mqtt.max_topic_levels or mqtt.max_topic_length")]
    WillTopicRefused,
}

impl Refusal {
    pub fn connack_code(self, version: ProtocolVersion) -> u8 {
        match (self, version) {
            (Refusal::ClientIdRejected, ProtocolVersion::V5) => reason::CLIENT_IDENTIFIER_NOT_VALID,
            (Refusal::ClientIdRejected, ProtocolVersion::V311) => reason::V3_IDENTIFIER_REJECTED,
            (Refusal::BadCredentials, ProtocolVersion::V5) => reason::BAD_USER_NAME_OR_PASSWORD,
            (Refusal::BadCredentials, ProtocolVersion::V311) => {
                reason::V3_BAD_USER_NAME_OR_PASSWORD
            }
            (Refusal::NotAuthorized, ProtocolVersion::V5) => reason::NOT_AUTHORIZED,
            (Refusal::NotAuthorized, ProtocolVersion::V311) => reason::V3_NOT_AUTHORIZED,
            (Refusal::BadAuthMethod, ProtocolVersion::V5) => 0x8C,
            (Refusal::BadAuthMethod, ProtocolVersion::V311) => reason::V3_NOT_AUTHORIZED,
            (Refusal::WillTopicRefused, ProtocolVersion::V5) => reason::TOPIC_NAME_INVALID,
            (Refusal::WillTopicRefused, ProtocolVersion::V311) => reason::V3_NOT_AUTHORIZED,
        }
    }
}

pub struct Admission {
    max_client_id_len: usize,
    allow_empty_client_id: bool,
    prefixes: Vec<String>,
    allow_anonymous: bool,
    users: Arc<HashMap<String, String>>,
    /// Input bounds: a will topic must be within them.
    topic_limits: TopicLimits,
}

impl Admission {
    pub fn new(cfg: &MqttConfig) -> Admission {
        Admission {
            max_client_id_len: cfg.max_client_id_len,
            allow_empty_client_id: cfg.allow_empty_client_id,
            prefixes: cfg.client_id_prefixes.clone(),
            allow_anonymous: cfg.allow_anonymous,
            users: Arc::new(
                cfg.users
                    .iter()
                    .map(|u| (u.username.clone(), u.password_hash.clone()))
                    .collect(),
            ),
            topic_limits: TopicLimits::new(cfg),
        }
    }

    /// Decide on a CONNECT. On success returns whether the gateway assigned the client id
    /// (it is then written into `connect.client_id`).
    pub async fn admit(&self, connect: &mut Connect) -> Result<bool, Refusal> {
        if connect.properties.authentication_method.is_some() {
            return Err(Refusal::BadAuthMethod);
        }
        if let Some(will) = &connect.will {
            (self.topic_limits.check(&will.topic)).map_err(|_| Refusal::WillTopicRefused)?;
        }
        let mut assigned = false;
        if connect.client_id.is_empty() {
            // 3.1.1 §3.1.3.1: an empty id requires a clean session.
            if !self.allow_empty_client_id
                || (connect.protocol == ProtocolVersion::V311 && !connect.clean_start)
            {
                return Err(Refusal::ClientIdRejected);
            }
            connect.client_id = ByteString::from(format!("sluice-{:016x}", rand::random::<u64>()));
            assigned = true;
        } else {
            if connect.client_id.len() > self.max_client_id_len {
                return Err(Refusal::ClientIdRejected);
            }
            if !self.prefixes.is_empty()
                && !self
                    .prefixes
                    .iter()
                    .any(|p| connect.client_id.starts_with(p.as_str()))
            {
                return Err(Refusal::ClientIdRejected);
            }
        }
        match &connect.username {
            None if self.allow_anonymous => Ok(assigned),
            None => Err(Refusal::NotAuthorized),
            Some(user) => match self.users.get(&user[..]) {
                None if self.users.is_empty() && self.allow_anonymous => Ok(assigned),
                None => Err(Refusal::BadCredentials),
                Some(hash) => {
                    let hash = hash.clone();
                    let password = connect.password.clone().unwrap_or_default();
                    let ok = tokio::task::spawn_blocking(move || verify_password(&hash, &password))
                        .await
                        .unwrap_or(false);
                    if ok {
                        Ok(assigned)
                    } else {
                        Err(Refusal::BadCredentials)
                    }
                }
            },
        }
    }
}

/// Check a password against a PHC-format hash (argon2i/d/id).
pub fn verify_password(phc: &str, password: &[u8]) -> bool {
    use argon2::password_hash::{PasswordHash, PasswordVerifier};
    match PasswordHash::new(phc) {
        Ok(parsed) => argon2::Argon2::default()
            .verify_password(password, &parsed)
            .is_ok(),
        Err(_) => false,
    }
}

/// Hash a password for the config file (`sluice passwd`).
pub fn hash_password(password: &[u8]) -> Result<String, String> {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let salt = SaltString::encode_b64(&rand::random::<[u8; 16]>()).map_err(|e| e.to_string())?;
    argon2::Argon2::default()
        .hash_password(password, &salt)
        .map(|h| h.to_string())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_password_verifies_and_wrong_one_does_not() {
        let h = hash_password(b"s3cret").expect("hash");
        assert!(verify_password(&h, b"s3cret"));
        assert!(!verify_password(&h, b"wrong"));
        assert!(!verify_password("not a phc string", b"s3cret"));
    }
}
