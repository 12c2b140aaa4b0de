//! Checks on `[[uplink]]`: URL, client id, lanes, topic mapping, templates, TLS files.
//!
//! Owns: these rules and their wording.

use super::*;

/// `notsent_lowat`, `install_tc`/`tc_*` and `[uplink.aggregate]`.
pub(super) fn check_lanes(i: usize, u: &UplinkConfig, has_high: bool) -> Result<(), ConfigError> {
    let key = |field: &str| format!("uplink[{i}].{field}");
    if u.notsent_lowat.as_u64() > u64::from(u32::MAX) {
        return invalid(&key("notsent_lowat"), "must be at most 4GiB");
    }
    if let Some(iface) = &u.tc_interface {
        if iface.is_empty()
            || iface.len() > 15
            || iface.contains(|c: char| c == '/' || c.is_whitespace())
        {
            return invalid(
                &key("tc_interface"),
                &format!(
                    "{iface:?} is not a network interface name (1-15 characters, no '/' or spaces)"
                ),
            );
        }
    }
    if let Some(rate) = &u.tc_rate {
        if !crate::sink::tc::valid_rate(rate) {
            return invalid(
                &key("tc_rate"),
                &format!(
                    "{rate:?} is not a tc rate; write e.g. \"2mbit\", \"100mbit\" or \"1gbit\""
                ),
            );
        }
    }
    if u.install_tc {
        if u.tc_rate.is_none() {
            return invalid(
                &key("tc_rate"),
                "install_tc = true needs tc_rate, the uplink's rate (e.g. \"10mbit\")",
            );
        }
        if !has_high {
            return invalid(
                &key("install_tc"),
                "install_tc = true, but no [priority] entry is 1 (high), so there is no high lane to put first",
            );
        }
    }
    let a = &u.aggregate;
    if a.max_pack.as_u64() < 64 || a.max_pack > crate::config::ByteSize::mib(256) {
        return invalid(&key("aggregate.max_pack"), "must be from 64B to 256MiB");
    }
    if a.max_delay.is_zero() || a.max_delay > Duration::from_secs(3600) {
        return invalid(
            &key("aggregate.max_delay"),
            "must be more than 0s and at most 1h",
        );
    }
    if a.topic.is_empty() || has_wildcard_or_nul(&a.topic) || a.topic.len() > 65_535 {
        return invalid(
            &key("aggregate.topic"),
            "must be a non-empty MQTT topic name without '+', '#' or NUL",
        );
    }
    Ok(())
}

pub(super) fn check_uplink(i: usize, u: &UplinkConfig, files: Files) -> Result<(), ConfigError> {
    let key = |field: &str| format!("uplink[{i}].{field}");

    check_label(&key("name"), &u.name)?;

    // Transport and TLS.
    let (secure, plain) = if u.is_onem2m() {
        ("https://", "http://")
    } else if u.is_kafka() {
        // Brokers are host:port; TLS or not is `security_protocol`'s (`config/kafka.rs`).
        ("ssl://", "plaintext://")
    } else {
        ("mqtts://", "mqtt://")
    };
    // Every node of `urls` follows the rules of a single `url`, and all are reached the same
    // way (one TLS setup, one set of credentials for the whole cluster).
    let node_key = |j: usize| {
        if u.is_kafka() {
            format!("uplink[{i}].brokers[{j}]")
        } else if u.urls.is_empty() {
            key("url")
        } else {
            format!("uplink[{i}].urls[{j}]")
        }
    };
    for (j, node) in u.nodes().iter().enumerate() {
        if node.tls != u.url.tls {
            return invalid(
                &node_key(j),
                &format!(
                    "{node} mixes {secure} and {plain} nodes; every node of one cluster is reached the same way"
                ),
            );
        }
        if let Some(k) = u.nodes()[..j].iter().position(|n| n == node) {
            return invalid(
                &node_key(j),
                &format!("{node} is listed twice (also urls[{k}])"),
            );
        }
        if node.tls {
            let name = u.tls_server_name_of(node);
            if rustls::pki_types::ServerName::try_from(name).is_err() {
                let field = if u.server_name.is_some() {
                    key("server_name")
                } else {
                    node_key(j)
                };
                return invalid(&field, &format!("{name:?} is not a valid TLS server name"));
            }
        } else if !u.allow_plaintext && u.is_kafka() {
            return invalid(
                &key("security_protocol"),
                &format!(
                    "{}:{} would be reached unencrypted; use security_protocol = \"ssl\" (or \"sasl_ssl\"), or set allow_plaintext = true to accept that",
                    node.host, node.port
                ),
            );
        } else if !u.allow_plaintext {
            return invalid(
                &node_key(j),
                &format!(
                    "{plain}{}:{} is unencrypted; use {secure}, or set allow_plaintext = true to accept that",
                    node.host, node.port
                ),
            );
        }
    }
    if u.url.tls {
        if u.ca_file.is_none() {
            return invalid(
                &key("ca_file"),
                &format!(
                    "ca_file is required for {} uplinks",
                    secure.trim_end_matches("://")
                ),
            );
        }
    } else {
        for (field, set) in [
            ("ca_file", u.ca_file.is_some()),
            ("cert_file", u.cert_file.is_some()),
            ("key_file", u.key_file.is_some()),
            ("server_name", u.server_name.is_some()),
        ] {
            if set {
                return invalid(
                    &key(field),
                    &format!("only applies to {secure} urls, but the url is {plain}"),
                );
            }
        }
    }
    match (&u.cert_file, &u.key_file) {
        (Some(_), None) => {
            return invalid(
                &key("key_file"),
                "cert_file is set, so key_file is required too",
            )
        }
        (None, Some(_)) => {
            return invalid(
                &key("cert_file"),
                "key_file is set, so cert_file is required too",
            )
        }
        _ => {}
    }

    // Session.
    if u.client_id.is_empty() {
        return invalid(&key("client_id"), "must not be empty");
    }
    if u.username.as_deref() == Some("") {
        return invalid(&key("username"), "must not be empty; omit it instead");
    }
    if u.password_file.is_some() && u.username.is_none() && u.protocol == MqttProtocol::V311 {
        return invalid(
            &key("password_file"),
            "MQTT 3.1.1 requires a username when a password is set",
        );
    }

    // Topics.
    if u.forward.is_empty() && u.receive.is_empty() {
        return invalid(
            &key("forward"),
            "forward and receive are both empty, so this uplink would carry nothing",
        );
    }
    for (list, filters) in [("forward", &u.forward), ("receive", &u.receive)] {
        for (j, filter) in filters.iter().enumerate() {
            if !valid_topic_filter(filter) {
                return invalid(
                    &format!("uplink[{i}].{list}[{j}]"),
                    &format!("{filter:?} is not a valid MQTT topic filter"),
                );
            }
        }
    }
    if has_wildcard_or_nul(&u.topic_prefix) {
        return invalid(&key("topic_prefix"), "must not contain '+', '#' or NUL");
    }
    if let Some(template) = &u.topic_template {
        if !u.topic_prefix.is_empty() {
            return invalid(
                &key("topic_template"),
                "topic_template and topic_prefix cannot both be set; put the prefix in the template",
            );
        }
        if let Err(reason) = check_template(template) {
            return invalid(&key("topic_template"), &reason);
        }
    }

    // Flow control and timing.
    if u.inflight == 0 {
        return invalid(&key("inflight"), "must be at least 1");
    }
    if u.keep_alive > Duration::from_secs(65_535) || u.keep_alive.subsec_nanos() != 0 {
        return invalid(
            &key("keep_alive"),
            "must be whole seconds from 0s to 65535s (MQTT's limit)",
        );
    }
    if u.connect_timeout.is_zero() {
        return invalid(&key("connect_timeout"), "must be more than 0s");
    }
    if u.reconnect_min.is_zero() {
        return invalid(&key("reconnect_min"), "must be more than 0s");
    }
    if u.reconnect_max < u.reconnect_min {
        return invalid(
            &key("reconnect_max"),
            &format!(
                "{} is less than reconnect_min ({})",
                humantime::format_duration(u.reconnect_max),
                humantime::format_duration(u.reconnect_min)
            ),
        );
    }

    // The MQTT keys above hold their defaults on a oneM2M or Kafka uplink (`check_raw`).
    if u.is_onem2m() {
        crate::config::onem2m::check(i, u)?;
    }
    if u.is_kafka() {
        crate::config::kafka::check(i, u)?;
    }
    check_files(i, u, files)
}

/// The uplink's TLS and password files can be opened (when `files` says they must exist).
pub(super) fn check_files(i: usize, u: &UplinkConfig, files: Files) -> Result<(), ConfigError> {
    let key = |field: &str| format!("uplink[{i}].{field}");
    if files == Files::MustExist {
        if let Some(path) = &u.ca_file {
            check_pem(&key("ca_file"), path, Pem::Certificates)?;
        }
        if let Some(path) = &u.cert_file {
            check_pem(&key("cert_file"), path, Pem::Certificates)?;
        }
        if let Some(path) = &u.key_file {
            check_pem(&key("key_file"), path, Pem::PrivateKey)?;
        }
        u.read_password(i)?;
    }
    Ok(())
}

pub(super) fn has_wildcard_or_nul(s: &str) -> bool {
    s.contains(['+', '#', '\0'])
}

/// A template uses only `{device}` and `{topic}`, at least one of them, and no wildcards.
pub(super) fn check_template(template: &str) -> Result<(), String> {
    if has_wildcard_or_nul(template) {
        return Err("must not contain '+', '#' or NUL".to_string());
    }
    let mut rest = template;
    let mut placeholders = 0;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or("has a '{' without a matching '}'")?;
        match &after[..close] {
            "device" | "topic" => placeholders += 1,
            other => {
                return Err(format!(
                    "unknown placeholder {{{other}}}; use {{device}} or {{topic}}"
                ))
            }
        }
        rest = &after[close + 1..];
    }
    if rest.contains('}') {
        return Err("has a '}' without a matching '{'".to_string());
    }
    if placeholders == 0 {
        return Err("must contain {topic} or {device}".to_string());
    }
    Ok(())
}
