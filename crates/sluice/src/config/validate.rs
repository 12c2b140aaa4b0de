//! Semantic checks on a deserialized [`Config`]: ranges, rules between fields, unique names,
//! valid topic filters, and that referenced files exist and hold what they should.
//!
//! Owns: the rules, and the wording of their errors (`ConfigError::Invalid` / `File`, each
//! naming the key path). Does not own: syntax or types (serde does that in `mod.rs`).
//!
//! The first failing rule is reported; rules are checked in file order (gateway, mqtt, admin,
//! log, then each uplink) so the error points at the earliest problem.

use std::collections::HashSet;
use std::io::BufReader;
use std::path::Path;
use std::time::Duration;

use sluice_proto::mqtt::topic::valid_topic_filter;

use super::{Config, ConfigError, MqttProtocol, UplinkConfig};

mod coap_dtls;
mod coap_proxy;
mod function;
mod mqtt_tls;
mod multipath;
mod phd;
mod uplink;
use uplink::{check_lanes, check_uplink};

/// Whether `check` opens the files the config refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Files {
    MustExist,
    Unchecked,
}

/// Largest packet MQTT can express: 1 byte header + 4 bytes length + 268,435,455.
const MQTT_MAX_PACKET: u64 = 268_435_460;
/// Smallest packet limit we accept: room for a CONNECT with a modest client id and login.
const MIN_PACKET_LIMIT: u64 = 128;

pub(super) fn check(config: &Config, files: Files) -> Result<(), ConfigError> {
    check_gateway(config)?;
    check_mqtt(config)?;
    check_coap(config)?;
    check_admin(config, files)?;
    if config.log.level.trim().is_empty() {
        return invalid(
            "log.level",
            "must not be empty; use e.g. \"info\" or \"info,sluice=debug\"",
        );
    }
    if config.reload.drain_timeout > std::time::Duration::from_secs(600) {
        return invalid(
            "reload.drain_timeout",
            "must be at most 10min (a reload waits for the drain before it answers)",
        );
    }
    check_priority(config)?;
    check_spool(config)?;
    check_state(config)?;
    check_topic_limits(config)?;
    let mut names = HashSet::new();
    // Function sink entries (`Config::with_function_sinks`) are checked as functions.
    for (i, uplink) in config.uplink.iter().enumerate() {
        if uplink.function.is_some() {
            continue;
        }
        check_uplink(i, uplink, files)?;
        check_lanes(i, uplink, config.priority.has_high())?;
        if !names.insert(uplink.name.as_str()) {
            return invalid(
                &format!("uplink[{i}].name"),
                &format!(
                    "duplicate uplink name {:?}; names must be unique",
                    uplink.name
                ),
            );
        }
    }
    coap_proxy::check_coap_proxy(config, files)?;
    coap_dtls::check_coap_dtls(config, files)?;
    multipath::check_multipath(config)?;
    phd::check_phd(config, files)?;
    mqtt_tls::check_mqtt_listeners(config, files)?;
    function::check_functions(config, files)?;
    check_acl(config, files)?;
    check_limits(config)?;
    Ok(())
}

/// `[acl]`: every rule compiles (globs, filters, placeholders), the rules file's too.
fn check_acl(config: &Config, files: Files) -> Result<(), ConfigError> {
    let file = match (&config.acl.file, files) {
        (Some(path), Files::MustExist) => Some(super::read_acl_file(path)?),
        _ => None,
    };
    crate::control::acl::AclSnapshot::compile(&config.acl, file.as_ref(), &config.mqtt)
        .map(|_| ())
        .map_err(|e| ConfigError::Invalid {
            key: e.key,
            reason: e.reason,
        })
}

/// `[limits]`: bursts hold at least one.
fn check_limits(config: &Config) -> Result<(), ConfigError> {
    let l = &config.limits;
    for (key, rate, burst) in [
        ("limits.publish_burst", l.publish_rate, l.publish_burst),
        (
            "limits.connect_burst_per_source",
            l.connect_rate_per_source,
            l.connect_burst_per_source,
        ),
        ("limits.connect_burst", l.connect_rate, l.connect_burst),
    ] {
        if rate > 0 && burst == 0 {
            return invalid(key, "must be at least 1 when its rate is set");
        }
    }
    if l.flap_connects > 0 && (l.flap_window.is_zero() || l.flap_hold.is_zero()) {
        return invalid(
            "limits.flap_window",
            "flap_window and flap_hold must be longer than 0s when flap_connects is set",
        );
    }
    Ok(())
}

/// What is valid but probably not meant: printed by `sluice check` and logged at start.
pub(super) fn warnings(config: &Config) -> Vec<String> {
    let mut w = Vec::new();
    if config.coap.enabled && !config.mqtt.users.is_empty() {
        w.push(format!(
            "coap is enabled on plain UDP while [[mqtt.users]] are configured: CoAP peers have no \
             login; coap.allow_anonymous = {} (an anonymous peer {} publish or observe)",
            config.coap.anonymous_allowed(&config.mqtt),
            if config.coap.anonymous_allowed(&config.mqtt) {
                "may"
            } else {
                "may not"
            },
        ));
    }
    w
}

fn invalid(key: &str, reason: &str) -> Result<(), ConfigError> {
    Err(ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.to_string(),
    })
}

fn check_gateway(config: &Config) -> Result<(), ConfigError> {
    let g = &config.gateway;
    if let Some(name) = &g.name {
        if name.is_empty() || name.len() > super::GatewayConfig::MAX_NAME {
            return invalid(
                "gateway.name",
                &format!("must be 1 to {} bytes long", super::GatewayConfig::MAX_NAME),
            );
        }
        if name.chars().any(char::is_control) {
            return invalid("gateway.name", "must not contain control characters");
        }
    }
    if g.shards > super::GatewayConfig::MAX_SHARDS {
        return invalid(
            "gateway.shards",
            &format!(
                "{} is more than the maximum of {}",
                g.shards,
                super::GatewayConfig::MAX_SHARDS
            ),
        );
    }
    if g.mailbox_capacity == 0 {
        return invalid("gateway.mailbox_capacity", "must be at least 1");
    }
    if g.max_buffered < config.mqtt.max_packet_size {
        return invalid(
            "gateway.max_buffered",
            &format!(
                "{} is smaller than mqtt.max_packet_size ({}), so one message could not be buffered",
                g.max_buffered, config.mqtt.max_packet_size
            ),
        );
    }
    Ok(())
}

fn check_mqtt(config: &Config) -> Result<(), ConfigError> {
    let m = &config.mqtt;
    if m.max_connections == 0 {
        return invalid("mqtt.max_connections", "must be at least 1");
    }
    let size = m.max_packet_size.as_u64();
    if !(MIN_PACKET_LIMIT..=MQTT_MAX_PACKET).contains(&size) {
        return invalid(
            "mqtt.max_packet_size",
            &format!(
                "{} is outside the range 128B to 268435460B (MQTT's limit)",
                m.max_packet_size
            ),
        );
    }
    if m.connect_timeout.is_zero() {
        return invalid("mqtt.connect_timeout", "must be more than 0s");
    }
    if m.receive_maximum == 0 {
        return invalid(
            "mqtt.receive_maximum",
            "must be at least 1 (MQTT 5 forbids 0)",
        );
    }
    if m.max_inflight_out == 0 {
        return invalid("mqtt.max_inflight_out", "must be at least 1");
    }
    if m.session_expiry_max > Duration::from_secs(u64::from(u32::MAX)) {
        return invalid(
            "mqtt.session_expiry_max",
            "must be at most 4294967295s (MQTT's limit)",
        );
    }
    if m.max_keep_alive > Duration::from_secs(65_535) || m.max_keep_alive.subsec_nanos() != 0 {
        return invalid(
            "mqtt.max_keep_alive",
            "must be whole seconds, at most 65535s (MQTT's limit)",
        );
    }
    if m.max_client_id_len == 0 || m.max_client_id_len > 65_535 {
        return invalid("mqtt.max_client_id_len", "must be from 1 to 65535");
    }
    for (i, prefix) in m.client_id_prefixes.iter().enumerate() {
        if prefix.is_empty() {
            return invalid(
                &format!("mqtt.client_id_prefixes[{i}]"),
                "must not be empty (an empty prefix admits every client id; use [] instead)",
            );
        }
    }
    let mut usernames = HashSet::new();
    for (i, user) in m.users.iter().enumerate() {
        if user.username.is_empty() {
            return invalid(&format!("mqtt.users[{i}].username"), "must not be empty");
        }
        if !usernames.insert(user.username.as_str()) {
            return invalid(
                &format!("mqtt.users[{i}].username"),
                &format!("duplicate username {:?}", user.username),
            );
        }
        if let Err(reason) = check_password_hash(&user.password_hash) {
            return invalid(&format!("mqtt.users[{i}].password_hash"), &reason);
        }
    }
    if m.auth_concurrency == 0 {
        return invalid("mqtt.auth_concurrency", "must be at least 1");
    }
    if m.allow_anonymous == Some(false) && m.users.is_empty() {
        return invalid(
            "mqtt.allow_anonymous",
            "is false but no [[mqtt.users]] are configured, so no device could connect",
        );
    }
    Ok(())
}

/// Input bounds (the "bounds" part): `mqtt.max_topic_levels` and `mqtt.max_topic_length`
/// in range, sessions ≥ connections, queue and subscription bounds usable, and every topic
/// filter of the config (priority topics, each uplink's `forward`
/// and `receive`) within them — a filter the devices' own topics could not reach is a mistake.
fn check_topic_limits(config: &Config) -> Result<(), ConfigError> {
    let m = &config.mqtt;
    if m.max_topic_levels == 0 || m.max_topic_levels > 65_535 {
        return invalid("mqtt.max_topic_levels", "must be from 1 to 65535");
    }
    if m.max_topic_length.as_u64() == 0 || m.max_topic_length.as_u64() > 65_535 {
        return invalid(
            "mqtt.max_topic_length",
            "must be from 1B to 65535B (MQTT's limit)",
        );
    }
    if m.max_sessions < m.max_connections {
        return invalid(
            "mqtt.max_sessions",
            &format!(
                "{} is less than mqtt.max_connections ({}); every connected device needs a session",
                m.max_sessions, m.max_connections
            ),
        );
    }
    if m.max_queued_bytes.as_u64() == 0 {
        return invalid("mqtt.max_queued_bytes", "must be more than 0B");
    }
    if config.gateway.max_outbox_memory < m.max_queued_bytes {
        return invalid(
            "gateway.max_outbox_memory",
            &format!(
                "{} is smaller than mqtt.max_queued_bytes ({})",
                config.gateway.max_outbox_memory, m.max_queued_bytes
            ),
        );
    }
    if m.max_subscriptions_per_session == 0 {
        return invalid("mqtt.max_subscriptions_per_session", "must be at least 1");
    }
    if m.send_buffer.as_u64() > 1 << 30 {
        return invalid("mqtt.send_buffer", "must be at most 1GiB");
    }
    let limits = crate::shard::limits::TopicLimits::new(m);
    let priority = config
        .priority
        .topics
        .keys()
        .map(|f| (format!("priority.topics.{f:?}"), f));
    let uplinks = config.uplink.iter().enumerate().flat_map(|(i, u)| {
        let forward = u
            .forward
            .iter()
            .enumerate()
            .map(move |(j, f)| (format!("uplink[{i}].forward[{j}]"), f));
        let receive = u
            .receive
            .iter()
            .enumerate()
            .map(move |(j, f)| (format!("uplink[{i}].receive[{j}]"), f));
        forward.chain(receive)
    });
    for (key, filter) in priority.chain(uplinks) {
        if let Err(e) = limits.check(filter) {
            return invalid(&key, &format!("{e}"));
        }
    }
    Ok(())
}

/// A PHC string (`$alg$...$salt$hash`) naming an Argon2 variant, the only one we can verify.
fn check_password_hash(hash: &str) -> Result<(), String> {
    const ADVICE: &str =
        "expected a PHC string such as \"$argon2id$v=19$m=19456,t=2,p=1$<salt>$<hash>\"";
    if !hash.starts_with('$') || hash.split('$').count() < 4 {
        return Err(format!("not a password hash; {ADVICE}"));
    }
    let parsed =
        argon2::PasswordHash::new(hash).map_err(|e| format!("malformed hash ({e}); {ADVICE}"))?;
    let alg = parsed.algorithm.as_str();
    if !matches!(alg, "argon2id" | "argon2i" | "argon2d") {
        return Err(format!("algorithm {alg:?} is not supported; use argon2id"));
    }
    if parsed.hash.is_none() || parsed.salt.is_none() {
        return Err(format!("the hash or salt is missing; {ADVICE}"));
    }
    Ok(())
}

/// `[coap]`: sizes CoAP can express, timers in the order RFC 7252 needs them, bounds ≥ 1.
fn check_coap(config: &Config) -> Result<(), ConfigError> {
    let c = &config.coap;
    let block = c.block_size.as_u64();
    if !(16..=1024).contains(&block) || !block.is_power_of_two() {
        return invalid(
            "coap.block_size",
            &format!("{} is not a power of two from 16B to 1KiB", c.block_size),
        );
    }
    let msg = c.max_message_size.as_u64();
    if msg < block + 64 || msg > 65_507 {
        return invalid(
            "coap.max_message_size",
            &format!("{} must hold a block_size block plus 64 bytes of header and options, and fit a UDP datagram (65507B)", c.max_message_size),
        );
    }
    if c.max_body_size.as_u64() > u32::MAX as u64 {
        return invalid("coap.max_body_size", "must fit Size1 (at most 4GiB - 1)");
    }
    let p = &c.pubsub_path;
    if p.is_empty() || p.contains('/') || p == ".well-known" {
        return invalid(
            "coap.pubsub_path",
            "must be one non-empty Uri-Path segment (no '/'), not .well-known",
        );
    }
    for (key, v) in [
        ("coap.max_block_transfers", c.max_block_transfers),
        ("coap.max_exchanges", c.max_exchanges),
        ("coap.max_pending", c.max_pending),
        ("coap.max_observers", c.max_observers),
        ("coap.max_queued_notifications", c.max_queued_notifications),
        ("coap.max_observers_per_source", c.max_observers_per_source),
        (
            "coap.max_block_transfers_per_source",
            c.max_block_transfers_per_source,
        ),
    ] {
        if v == 0 {
            return invalid(key, "must be at least 1");
        }
    }
    for (key, v) in [
        ("coap.block_idle_timeout", c.block_idle_timeout),
        ("coap.observer_check", c.observer_check),
    ] {
        if v.is_zero() {
            return invalid(key, "must be more than 0s");
        }
    }
    if c.observer_check > Duration::from_secs(24 * 3600) {
        return invalid(
            "coap.observer_check",
            "must be at most 24h (RFC 7641 §4.5: a CON notification at least once a day)",
        );
    }
    let m = c.max_message_size.as_u64();
    for (key, v) in [
        ("coap.max_exchange_bytes", c.max_exchange_bytes),
        ("coap.max_block_bytes", c.max_block_bytes),
    ] {
        if v.as_u64() < m {
            return invalid(key, "must hold at least one coap.max_message_size datagram");
        }
    }
    if c.ack_timeout.is_zero() {
        return invalid("coap.ack_timeout", "must be more than 0s");
    }
    if c.separate_after >= c.ack_timeout {
        return invalid(
            "coap.separate_after",
            "must be less than coap.ack_timeout, or the device retransmits before its empty ACK",
        );
    }
    if c.exchange_lifetime < c.ack_timeout || c.non_lifetime.is_zero() {
        return invalid(
            "coap.exchange_lifetime",
            "must be at least coap.ack_timeout (and non_lifetime more than 0s)",
        );
    }
    if c.retry_after.is_zero() || c.retry_after.as_secs() > u32::MAX as u64 {
        return invalid(
            "coap.retry_after",
            "must be from 1s to 2^32 - 1 s (a Max-Age)",
        );
    }
    Ok(())
}

fn check_admin(config: &Config, files: Files) -> Result<(), ConfigError> {
    let a = &config.admin;
    if !a.enabled {
        return Ok(());
    }
    if a.listen.port() != 0 && a.listen == config.mqtt.listen {
        return invalid("admin.listen", "is the same address as mqtt.listen");
    }
    if !a.listen.ip().is_loopback() && a.token_file.is_none() {
        return invalid(
            "admin.token_file",
            &format!(
                "is required when admin.listen ({}) is not a loopback address: every request must then carry `Authorization: Bearer <token>`; put a token (at least {} characters) in a file and name it here, or listen on 127.0.0.1",
                a.listen,
                super::ADMIN_TOKEN_MIN_LEN
            ),
        );
    }
    match (&a.cert_file, &a.key_file) {
        (Some(_), None) => return invalid("admin.key_file", "is required with admin.cert_file"),
        (None, Some(_)) => return invalid("admin.cert_file", "is required with admin.key_file"),
        _ => {}
    }
    if files == Files::MustExist {
        a.read_token()?;
        if let Some(path) = &a.cert_file {
            check_pem("admin.cert_file", path, Pem::Certificates)?;
        }
        if let Some(path) = &a.key_file {
            check_pem("admin.key_file", path, Pem::PrivateKey)?;
        }
    }
    Ok(())
}

fn check_priority(config: &Config) -> Result<(), ConfigError> {
    let p = &config.priority;
    for (device, &prio) in &p.devices {
        let key = format!("priority.devices.{device:?}");
        if !matches!(prio, 1 | 2) {
            return invalid(
                &key,
                &format!("{prio} is not a priority; use 1 (high) or 2 (normal)"),
            );
        }
        let stem = device.strip_suffix('*').unwrap_or(device);
        if stem.contains('*') {
            return invalid(
                &key,
                "'*' is only allowed as the last character (a prefix match)",
            );
        }
        if device.is_empty() {
            return invalid(
                &key,
                "the client id must not be empty; use \"*\" to match all",
            );
        }
    }
    for (filter, &prio) in &p.topics {
        let key = format!("priority.topics.{filter:?}");
        if !matches!(prio, 1 | 2) {
            return invalid(
                &key,
                &format!("{prio} is not a priority; use 1 (high) or 2 (normal)"),
            );
        }
        if !valid_topic_filter(filter) {
            return invalid(
                &key,
                &format!("{filter:?} is not a valid MQTT topic filter"),
            );
        }
    }
    Ok(())
}

/// `[state]`: a usable directory name and a sane commit period.
fn check_state(config: &Config) -> Result<(), ConfigError> {
    let s = &config.state;
    let Some(dir) = &s.dir else {
        return Ok(());
    };
    if dir.as_os_str().is_empty() {
        return invalid(
            "state.dir",
            "must not be empty; leave it out to keep retained messages and sessions in memory only",
        );
    }
    if s.commit_interval.is_zero() || s.commit_interval > Duration::from_secs(10) {
        return invalid(
            "state.commit_interval",
            "must be more than 0s and at most 10s",
        );
    }
    if s.max_log_size < super::ByteSize::mib(1) {
        return invalid("state.max_log_size", "must be at least 1MiB");
    }
    if s.max_pending < super::ByteSize::kib(64) {
        return invalid("state.max_pending", "must be at least 64KiB");
    }
    if config.spool.dir.as_ref().is_some_and(|spool| spool == dir) {
        return invalid(
            "state.dir",
            "must not be the spool's directory (use a sibling, e.g. /var/lib/sluice/state)",
        );
    }
    Ok(())
}

/// `[spool]`: sizes that the storage engine can work with, and a sane commit period.
fn check_spool(config: &Config) -> Result<(), ConfigError> {
    let s = &config.spool;
    let Some(dir) = &s.dir else {
        return Ok(());
    };
    if dir.as_os_str().is_empty() {
        return invalid(
            "spool.dir",
            "must not be empty; leave it out to run without a spool",
        );
    }
    if s.fsync_interval.is_zero() || s.fsync_interval > Duration::from_secs(1) {
        return invalid(
            "spool.fsync_interval",
            "must be more than 0s and at most 1s",
        );
    }
    let record = super::SpoolConfig::max_record_bytes(
        config.mqtt.max_packet_size,
        config.mqtt.max_client_id_len,
    );
    let min_segment = (record + 32).max(4096);
    if s.segment_size.as_u64() < min_segment || s.segment_size > super::ByteSize::gib(1) {
        return invalid(
            "spool.segment_size",
            &format!(
                "{} must be from {} (one record of mqtt.max_packet_size plus headers) to 1GiB",
                s.segment_size,
                super::ByteSize(min_segment)
            ),
        );
    }
    let shards = config.gateway.shard_count();
    let uplinks = config.uplink.len().max(1);
    let per_spool = s.max_bytes_per_spool(shards, uplinks);
    if per_spool < 2 * s.segment_size.as_u64() {
        return invalid(
            "spool.max_size",
            &format!(
                "{} split over {shards} shard(s) and {uplinks} uplink(s) gives each spool {}, less than two segments of spool.segment_size ({}); raise max_size or lower segment_size",
                s.max_size,
                super::ByteSize(per_spool),
                s.segment_size
            ),
        );
    }
    Ok(())
}
/// A name that is also a metric label: non-empty, `[a-zA-Z0-9_-]+`.
fn check_label(key: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return invalid(
            key,
            &format!("{name:?} must be non-empty and use only a-z, A-Z, 0-9, '_' and '-'"),
        );
    }
    Ok(())
}

enum Pem {
    Certificates,
    PrivateKey,
}

fn check_pem(key: &str, path: &Path, want: Pem) -> Result<(), ConfigError> {
    let file_error = |source| ConfigError::File {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(file_error)?;
    let mut reader = BufReader::new(file);
    let bad = |what: &str| {
        Err(ConfigError::Invalid {
            key: key.to_string(),
            reason: format!("{}: {what}", path.display()),
        })
    };
    match want {
        Pem::Certificates => {
            let mut count = 0;
            for cert in rustls_pemfile::certs(&mut reader) {
                if let Err(e) = cert {
                    return bad(&format!("malformed PEM ({e})"));
                }
                count += 1;
            }
            if count == 0 {
                return bad("contains no PEM certificates (\"-----BEGIN CERTIFICATE-----\")");
            }
        }
        Pem::PrivateKey => match rustls_pemfile::private_key(&mut reader) {
            Ok(Some(_)) => {}
            Ok(None) => return bad("contains no PEM private key"),
            Err(e) => return bad(&format!("malformed PEM ({e})")),
        },
    }
    Ok(())
}

#[cfg(test)]
mod tests;
