//! Connection admission: client-id rules and username/password checks.
//!
//! Owns: the identity decision on a CONNECT (client-id length and prefixes, an assigned id
//! for an empty one, anonymous or named login, the will topic's bounds) and the bounded
//! password-check pool. Does not own: reading the CONNECT or answering the device (the device
//! listener, `edge/mqtt/listener.rs`, which calls [`Admission::admit`] on its own thread), nor
//! sessions (the device's shard).
//!
//! Password hashes come from the config as PHC strings (argon2id recommended). Verification is
//! deliberately expensive in CPU and memory (a `sluice passwd` hash takes 19 MiB per check),
//! and anyone who can reach the listener can ask for one by naming a configured user, so:
//!
//! - checks run on the device listener's blocking pool, never on a shard, the listener's
//!   own thread or the control-plane thread;
//! - at most `mqtt.auth_concurrency` run at once (a semaphore; each check holds its slot until
//!   the hash returns, even if its connection is gone), so admission's memory is bounded by
//!   `auth_concurrency` × the hash's memory cost and its CPU by `auth_concurrency` threads;
//! - at most `mqtt.auth_queue` logins wait for a slot, each no later than its CONNECT deadline
//!   (`connect_timeout` from the accept); beyond either bound the login is refused as busy
//!   (CONNACK 0x89 Server busy, 3.1.1: 0x03 Server unavailable), counted in
//!   `sluice_control_auth_busy_total`. A device refused as busy may retry later.
//!
//! Nothing is cached: every login with a password is verified against its hash (a cache of
//! accepted passwords would keep secrets in memory).
//!
//! A client id connecting too often is refused first (`[limits]`, CONNACK 0x9F / 3.1.1
//! 0x03, before any password check); a will topic the device may not publish to
//! (`[acl]`) is refused after the login (CONNACK 0x87 / 3.1.1 0x05).
//!
//! Anonymous devices (no username) are admitted per [`MqttConfig::anonymous_allowed`]: by
//! default only when no users are configured.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytestring::ByteString;
use sluice_proto::mqtt::{reason, Connect, ProtocolVersion};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::MqttConfig;
use crate::shard::limits::TopicLimits;
use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

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
    /// Too many password checks running and waiting (`auth_concurrency`, `auth_queue`), or
    /// the wait reached the CONNECT deadline. The device may retry later.
    #[error("too many logins being checked; try again later")]
    Busy,
    /// Input bounds: the will topic is beyond `mqtt.max_topic_levels`/`max_topic_length`.
    #[error("will topic beyond mqtt.max_topic_levels or mqtt.max_topic_length")]
    WillTopicRefused,
    /// `[acl]`: the device may not publish to its will topic.
    #[error("the access control list does not let this device publish to its will topic")]
    WillNotAuthorized,
    /// `[limits]`: this client id connected more than `flap_connects` times within
    /// `flap_window`; refused for `flap_hold`.
    #[error("client id connecting too often (flapping); refused for a while")]
    ConnectRate,
}

/// MQTT 5 CONNACK 0x9F Connection rate exceeded.
const CONNECTION_RATE_EXCEEDED: u8 = 0x9F;

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
            (Refusal::Busy, ProtocolVersion::V5) => reason::SERVER_BUSY,
            (Refusal::Busy, ProtocolVersion::V311) => reason::V3_SERVER_UNAVAILABLE,
            (Refusal::WillTopicRefused, ProtocolVersion::V5) => reason::TOPIC_NAME_INVALID,
            (Refusal::WillTopicRefused, ProtocolVersion::V311) => reason::V3_NOT_AUTHORIZED,
            (Refusal::WillNotAuthorized, ProtocolVersion::V5) => reason::NOT_AUTHORIZED,
            (Refusal::WillNotAuthorized, ProtocolVersion::V311) => reason::V3_NOT_AUTHORIZED,
            (Refusal::ConnectRate, ProtocolVersion::V5) => CONNECTION_RATE_EXCEEDED,
            (Refusal::ConnectRate, ProtocolVersion::V311) => reason::V3_SERVER_UNAVAILABLE,
        }
    }
}

/// Admission's password-check metrics (rendered with the control plane's).
#[derive(Debug, Default)]
pub struct AdmissionMetrics {
    /// Checks running now (at most `auth_concurrency`).
    pub verifying: Gauge,
    /// Logins waiting for a check slot (at most `auth_queue`).
    pub waiting: Gauge,
    /// Checks run.
    pub checks: Counter,
    /// Logins refused as busy.
    pub busy: Counter,
}

impl AdmissionMetrics {
    pub fn render(&self, w: &mut PromWriter) {
        w.gauge(
            "sluice_control_auth_verifications",
            "Password checks running now (bounded by mqtt.auth_concurrency)",
            &[],
            self.verifying.get(),
        );
        w.gauge(
            "sluice_control_auth_waiting",
            "Logins waiting for a password check slot (bounded by mqtt.auth_queue)",
            &[],
            self.waiting.get(),
        );
        w.counter(
            "sluice_control_auth_checks_total",
            "Password checks run",
            &[],
            self.checks.get(),
        );
        w.counter(
            "sluice_control_auth_busy_total",
            "Logins refused as busy (CONNACK 0x89 / 0x03): check slots and queue full, or the wait reached the CONNECT deadline",
            &[],
            self.busy.get(),
        );
    }
}

/// What the device's transport proved about it before its CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportIdentity {
    /// Nothing: the CONNECT's username and password decide (plain TCP, WebSocket, TLS
    /// without `identity_from_cert`).
    Login,
    /// `identity_from_cert`: a verified client certificate names the device. This name is its
    /// username (the CONNECT's username and password are ignored, no password is checked, and
    /// the device is not anonymous), as Mosquitto's `use_identity_as_username`.
    Certificate(ByteString),
    /// `identity_from_cert`, but the device presented no certificate, or one naming nothing:
    /// refused as not authorized.
    MissingCertificate,
}

/// Logs a busy refusal at most this often.
const BUSY_LOG_EVERY: Duration = Duration::from_secs(1);

pub struct Admission {
    max_client_id_len: usize,
    allow_empty_client_id: bool,
    prefixes: Vec<String>,
    /// `[[mqtt.users]]` and whether anonymous devices are admitted; a reload replaces them
    /// ([`Admission::logins`]), for CONNECTs read from then on.
    logins: Arc<ArcSwap<Logins>>,
    /// Input bounds: a will topic must be within them.
    topic_limits: TopicLimits,
    /// One permit per check allowed to run (`auth_concurrency`).
    check_slots: Arc<Semaphore>,
    concurrency: usize,
    /// Most logins waiting for a permit (`auth_queue`).
    max_waiting: usize,
    waiting: AtomicUsize,
    /// When a busy refusal was last logged (ms since `started`; 0 = never).
    busy_logged_ms: AtomicU64,
    started: Instant,
    /// `[acl]`: the will topic is checked at CONNECT.
    acl: Option<Arc<crate::control::acl::Acl>>,
    /// `[limits]`: flapping client ids are refused before any password check.
    limits: Option<Arc<crate::control::limits::ConnectLimits>>,
}

/// A running check's slot: released (and the gauge lowered) when the hash returns.
struct CheckSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<AdmissionMetrics>,
}

impl Drop for CheckSlot {
    fn drop(&mut self) {
        self.metrics.verifying.sub(1);
    }
}

/// Who may log in: `[[mqtt.users]]` (username → PHC password hash) and
/// `mqtt.allow_anonymous` (its effective value). Immutable; replaced whole by a reload.
#[derive(Debug, Default)]
pub struct Logins {
    users: HashMap<String, String>,
    allow_anonymous: bool,
}

impl Logins {
    pub fn new(cfg: &MqttConfig) -> Logins {
        Logins {
            users: cfg
                .users
                .iter()
                .map(|u| (u.username.clone(), u.password_hash.clone()))
                .collect(),
            allow_anonymous: cfg.anonymous_allowed(),
        }
    }
}

impl Admission {
    pub fn new(cfg: &MqttConfig) -> Admission {
        Admission {
            max_client_id_len: cfg.max_client_id_len,
            allow_empty_client_id: cfg.allow_empty_client_id,
            prefixes: cfg.client_id_prefixes.clone(),
            logins: Arc::new(ArcSwap::from_pointee(Logins::new(cfg))),
            check_slots: Arc::new(Semaphore::new(cfg.auth_concurrency.max(1))),
            concurrency: cfg.auth_concurrency.max(1),
            max_waiting: cfg.auth_queue,
            waiting: AtomicUsize::new(0),
            busy_logged_ms: AtomicU64::new(0),
            started: Instant::now(),
            topic_limits: TopicLimits::new(cfg),
            acl: None,
            limits: None,
        }
    }

    /// The handle through which a reload replaces the users and `allow_anonymous`.
    pub fn logins(&self) -> Arc<ArcSwap<Logins>> {
        self.logins.clone()
    }

    /// Check will topics against this ACL.
    pub fn with_acl(mut self, acl: Arc<crate::control::acl::Acl>) -> Admission {
        self.acl = Some(acl);
        self
    }

    /// Refuse flapping client ids (`[limits] flap_connects`).
    pub fn with_limits(mut self, limits: Arc<crate::control::limits::ConnectLimits>) -> Admission {
        self.limits = Some(limits);
        self
    }

    /// Decide on a CONNECT. On success returns whether the gateway assigned the client id
    /// (it is then written into `connect.client_id`). A password check waits for a slot no
    /// later than `deadline`.
    pub async fn admit(
        &self,
        connect: &mut Connect,
        deadline: tokio::time::Instant,
        metrics: &Arc<AdmissionMetrics>,
    ) -> Result<bool, Refusal> {
        self.admit_as(connect, TransportIdentity::Login, deadline, metrics)
            .await
    }

    /// [`Admission::admit`] for a device whose transport may have named it already. With a
    /// certificate identity, `connect.username` becomes that name and `connect.password` is
    /// dropped, so whoever reads the CONNECT after admission (the shard, ACLs) sees the
    /// identity the gateway trusts.
    pub async fn admit_as(
        &self,
        connect: &mut Connect,
        identity: TransportIdentity,
        deadline: tokio::time::Instant,
        metrics: &Arc<AdmissionMetrics>,
    ) -> Result<bool, Refusal> {
        if connect.properties.authentication_method.is_some() {
            return Err(Refusal::BadAuthMethod);
        }
        if let Some(will) = &connect.will {
            (self.topic_limits.check(&will.topic)).map_err(|_| Refusal::WillTopicRefused)?;
        }
        if let Some(limits) = &self.limits {
            if !limits.admit_client(&connect.client_id) {
                return Err(Refusal::ConnectRate);
            }
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
        let admitted = match identity {
            TransportIdentity::Login => {
                // One set of logins for the whole CONNECT, even if a reload lands meanwhile.
                let logins = self.logins.load_full();
                let admitted = self
                    .login(&logins, connect, assigned, deadline, metrics)
                    .await?;
                if connect
                    .username
                    .as_deref()
                    .is_some_and(|u| !logins.users.contains_key(u))
                {
                    // Admitted without a password check (no users configured, anonymous
                    // allowed): a username nobody verified names no one. Dropped, so that
                    // ACL rules by `users` never trust a self-asserted name.
                    connect.username = None;
                }
                admitted
            }
            TransportIdentity::Certificate(name) => {
                connect.username = Some(name);
                connect.password = None;
                assigned
            }
            TransportIdentity::MissingCertificate => return Err(Refusal::NotAuthorized),
        };
        if let (Some(acl), Some(will)) = (&self.acl, &connect.will) {
            let username = crate::shard::Adopted::acl_username(connect);
            if !acl.allows_publish(
                crate::control::acl::Edge::Mqtt,
                &connect.client_id,
                username,
                &will.topic,
            ) {
                return Err(Refusal::WillNotAuthorized);
            }
        }
        Ok(admitted)
    }

    /// The login part of [`Admission::admit_as`]: anonymous or a checked password.
    async fn login(
        &self,
        logins: &Logins,
        connect: &Connect,
        assigned: bool,
        deadline: tokio::time::Instant,
        metrics: &Arc<AdmissionMetrics>,
    ) -> Result<bool, Refusal> {
        match &connect.username {
            None if logins.allow_anonymous => Ok(assigned),
            None => Err(Refusal::NotAuthorized),
            Some(user) => match logins.users.get(&user[..]) {
                None if logins.users.is_empty() && logins.allow_anonymous => Ok(assigned),
                None => Err(Refusal::BadCredentials),
                Some(hash) => {
                    let slot = self.check_slot(deadline, metrics).await?;
                    let hash = hash.clone();
                    let password = connect.password.clone().unwrap_or_default();
                    metrics.checks.inc();
                    // The slot moves into the blocking task: it is held until the hash
                    // returns, even if this future is dropped.
                    let ok = tokio::task::spawn_blocking(move || {
                        let _slot = slot;
                        verify_password(&hash, &password)
                    })
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

    /// A slot to run one password check: at once if one is free, else after waiting in the
    /// bounded queue until `deadline`; `Busy` when the queue is full or the deadline passes.
    async fn check_slot(
        &self,
        deadline: tokio::time::Instant,
        metrics: &Arc<AdmissionMetrics>,
    ) -> Result<CheckSlot, Refusal> {
        let permit = match self.check_slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let queued = self
                    .waiting
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                        (n < self.max_waiting).then_some(n + 1)
                    })
                    .is_ok();
                if !queued {
                    return Err(self.busy(metrics));
                }
                metrics.waiting.add(1);
                let acquired =
                    tokio::time::timeout_at(deadline, self.check_slots.clone().acquire_owned())
                        .await;
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                metrics.waiting.sub(1);
                match acquired {
                    Ok(Ok(p)) => p,
                    // Timed out (or the semaphore closed, which never happens).
                    _ => return Err(self.busy(metrics)),
                }
            }
        };
        metrics.verifying.add(1);
        Ok(CheckSlot {
            _permit: permit,
            metrics: metrics.clone(),
        })
    }

    /// Counts a busy refusal; logs one WARN a second at most.
    fn busy(&self, metrics: &AdmissionMetrics) -> Refusal {
        metrics.busy.inc();
        let now = u64::try_from(self.started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let last = self.busy_logged_ms.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= BUSY_LOG_EVERY.as_millis() as u64;
        if due
            && self
                .busy_logged_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                concurrency = self.concurrency,
                queue = self.max_waiting,
                refused_total = metrics.busy.get(),
                "password checks and their queue are full; refusing logins as busy"
            );
        }
        Refusal::Busy
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

    fn connect(username: Option<&str>, password: Option<&[u8]>) -> Connect {
        Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: 30,
            client_id: ByteString::from("dev-1"),
            will: None,
            username: username.map(ByteString::from),
            password: password.map(bytes::Bytes::copy_from_slice),
            properties: Default::default(),
        }
    }

    #[tokio::test]
    async fn replaced_logins_decide_the_next_connect() {
        let admission = Admission::new(&MqttConfig::default());
        let metrics = Arc::new(AdmissionMetrics::default());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut c = connect(None, None);
        assert_eq!(
            admission.admit(&mut c, deadline, &metrics).await,
            Ok(false),
            "no users: anonymous is admitted"
        );
        let mut cfg = MqttConfig::default();
        cfg.users.push(crate::config::UserConfig {
            username: "new".into(),
            password_hash: hash_password(b"pw").expect("hash"),
        });
        admission.logins().store(Arc::new(Logins::new(&cfg)));
        let mut c = connect(None, None);
        assert_eq!(
            admission.admit(&mut c, deadline, &metrics).await,
            Err(Refusal::NotAuthorized),
            "a user configured by the reload: anonymous is refused"
        );
        let mut c = connect(Some("new"), Some(b"pw"));
        assert_eq!(admission.admit(&mut c, deadline, &metrics).await, Ok(false));
    }

    #[tokio::test]
    async fn a_certificate_identity_is_the_username_and_no_password_is_checked() {
        let mut cfg = MqttConfig::default();
        cfg.users.push(crate::config::UserConfig {
            username: "someone".into(),
            password_hash: hash_password(b"pw").expect("hash"),
        });
        let admission = Admission::new(&cfg);
        let metrics = Arc::new(AdmissionMetrics::default());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        // Anonymous is refused here (users configured)...
        let mut c = connect(None, None);
        assert_eq!(
            admission.admit(&mut c, deadline, &metrics).await,
            Err(Refusal::NotAuthorized)
        );
        // ...but a certificate names the device: admitted, the CN is now its username, the
        // CONNECT's username and password are gone, and no hash was computed.
        let mut c = connect(Some("someone"), Some(b"wrong"));
        let cn = TransportIdentity::Certificate(ByteString::from("sensor-7"));
        assert_eq!(
            admission.admit_as(&mut c, cn, deadline, &metrics).await,
            Ok(false)
        );
        assert_eq!(c.username.as_deref(), Some("sensor-7"));
        assert_eq!(c.password, None);
        assert_eq!(metrics.checks.get(), 0);
        // Where the certificate is the identity, none is none: not authorized.
        let mut c = connect(Some("someone"), Some(b"pw"));
        assert_eq!(
            admission
                .admit_as(
                    &mut c,
                    TransportIdentity::MissingCertificate,
                    deadline,
                    &metrics
                )
                .await,
            Err(Refusal::NotAuthorized)
        );
        // Client-id rules still apply to certificate-identified devices.
        let mut cfg = cfg.clone();
        cfg.client_id_prefixes = vec!["meter-".into()];
        let admission = Admission::new(&cfg);
        let mut c = connect(None, None);
        let cn = TransportIdentity::Certificate(ByteString::from("sensor-7"));
        assert_eq!(
            admission.admit_as(&mut c, cn, deadline, &metrics).await,
            Err(Refusal::ClientIdRejected)
        );
    }

    #[tokio::test]
    async fn a_username_nobody_checked_is_dropped_so_acl_user_rules_never_trust_it() {
        // No users configured: anonymous devices are admitted, and so is any claimed username,
        // unchecked. It must not reach the ACL as if it named someone.
        let admission = Admission::new(&MqttConfig::default());
        let metrics = Arc::new(AdmissionMetrics::default());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut c = connect(Some("ops-admin"), Some(b"anything"));
        assert_eq!(admission.admit(&mut c, deadline, &metrics).await, Ok(false));
        assert_eq!(c.username, None, "an unchecked username names no one");
        assert_eq!(crate::shard::Adopted::acl_username(&c), None);
        // A checked one stays.
        let mut cfg = MqttConfig::default();
        cfg.users.push(crate::config::UserConfig {
            username: "ops-admin".into(),
            password_hash: hash_password(b"pw").expect("hash"),
        });
        let admission = Admission::new(&cfg);
        let mut c = connect(Some("ops-admin"), Some(b"pw"));
        assert_eq!(admission.admit(&mut c, deadline, &metrics).await, Ok(false));
        assert_eq!(crate::shard::Adopted::acl_username(&c), Some("ops-admin"));
    }

    #[test]
    fn hashed_password_verifies_and_wrong_one_does_not() {
        let h = hash_password(b"s3cret").expect("hash");
        assert!(verify_password(&h, b"s3cret"));
        assert!(!verify_password(&h, b"wrong"));
        assert!(!verify_password("not a phc string", b"s3cret"));
    }
}
