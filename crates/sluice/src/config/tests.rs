//! Tests of the whole pipeline: TOML text → errors a user reads, or a `Config` that prints back.

use super::*;
use std::fs;

/// A syntactically valid Argon2id PHC string (it verifies no password we use).
const HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$c2x1aWNlc2FsdDE2Ynl0ZQ$AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8";

const PEM_CERT: &str = "-----BEGIN CERTIFICATE-----\nAAECAwQ=\n-----END CERTIFICATE-----\n";
const PEM_KEY: &str = "-----BEGIN PRIVATE KEY-----\nAAECAwQ=\n-----END PRIVATE KEY-----\n";

pub(super) fn err(text: &str) -> String {
    match parse_unchecked_files(text) {
        Ok(c) => panic!("expected an error for {text:?}, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

/// A plaintext uplink plus `extra` lines, so file checks do not get in the way.
pub(super) fn plaintext_uplink(extra: &str) -> String {
    format!("[[uplink]]\nname = \"cloud\"\nurl = \"mqtt://10.0.0.1\"\nallow_plaintext = true\n{extra}\n")
}

pub(super) fn tls_uplink(extra: &str) -> String {
    format!("[[uplink]]\nname = \"cloud\"\nurl = \"mqtts://broker.example.com\"\nca_file = \"ca.pem\"\n{extra}\n")
}

/// A config with every field away from its default and every optional field set.
pub(super) fn everything_set() -> Config {
    let mut c = Config {
        gateway: GatewayConfig {
            name: Some("site-a-gw1".to_string()),
            shards: 3,
            pin_threads: false,
            mailbox_capacity: 17,
            max_buffered: ByteSize(1_000_000_000),
            // Input bounds.
            max_outbox_memory: ByteSize(2_000_000_000),
            control_core: Some(1),
        },
        ..Config::default()
    };
    c.phd = crate::config::PhdConfig {
        listen: Some("127.0.0.1:6024".parse().unwrap()),
        topic: "health/{metric}/{system_id}".into(),
        system_id: "0011223344556677".into(),
        max_apdu: ByteSize::kib(8),
        max_connections: 5,
        association_timeout: std::time::Duration::from_secs(4),
        configuration_timeout: std::time::Duration::from_secs(5),
        response_timeout: std::time::Duration::from_secs(2),
        get_mds: false,
        max_configs: 7,
        max_agents: 9,
        agent_utc_offset: "-05:30".into(),
        allow_relearn: true,
        agents: vec!["0011223344556688".into()],
        tls: Some(crate::config::PhdTlsConfig {
            cert_file: "phd.pem".into(),
            key_file: "phd.key".into(),
            client_ca_file: Some("agents-ca.pem".into()),
            require_client_cert: true,
        }),
        single_plane: true,
    };
    c.mqtt.listen = "[::]:11883".parse().unwrap();
    c.mqtt.max_connections = 5;
    c.mqtt.max_packet_size = ByteSize(1536);
    c.mqtt.connect_timeout = Duration::from_millis(1500);
    c.mqtt.receive_maximum = 7;
    c.mqtt.max_inflight_out = 9;
    c.mqtt.topic_alias_maximum = 0;
    c.mqtt.session_expiry_max = Duration::from_secs(90);
    c.mqtt.max_queued_messages = 11;
    c.mqtt.max_retained_messages = 12;
    c.mqtt.max_client_id_len = 23;
    c.mqtt.allow_empty_client_id = false;
    c.mqtt.client_id_prefixes = vec!["sensor-".into(), "meter-".into()];
    c.mqtt.allow_anonymous = Some(false);
    c.mqtt.auth_concurrency = 3;
    c.mqtt.auth_queue = 5;
    // Input bounds.
    c.mqtt.max_topic_levels = 8;
    c.mqtt.max_topic_length = ByteSize(300);
    c.mqtt.max_sessions = 6;
    c.mqtt.max_queued_bytes = ByteSize(3000);
    c.mqtt.max_retained_bytes = ByteSize(5000);
    c.mqtt.max_subscriptions_per_session = 4;
    c.mqtt.users = vec![UserConfig {
        username: "dev1".into(),
        password_hash: HASH.into(),
    }];
    c.admin = AdminConfig {
        enabled: false,
        listen: "0.0.0.0:9200".parse().unwrap(),
        token_file: Some("admin.token".into()),
        cert_file: Some("certs/admin.pem".into()),
        key_file: Some("certs/admin.key".into()),
    };
    c.log.level = "info,sluice::sink=debug".into();
    c.log.format = LogFormat::Json;
    let mut u = UplinkConfig::new("cloud-1", "mqtts://[2001:db8::1]:8884".parse().unwrap());
    u.ca_file = Some("certs/ca.pem".into());
    u.cert_file = Some("certs/gw.pem".into());
    u.key_file = Some("certs/gw.key".into());
    u.server_name = Some("broker.example.com".into());
    u.client_id = "gw17".into();
    u.username = Some("gw17".into());
    u.password_file = Some("secrets/pw".into());
    u.protocol = MqttProtocol::V311;
    u.forward = vec!["sensors/#".into(), "+/status".into()];
    u.receive = vec!["commands/gw17/#".into()];
    u.topic_template = Some("site1/{device}/{topic}".into());
    u.inflight = 1;
    u.keep_alive = Duration::from_secs(0);
    u.connect_timeout = Duration::from_secs(3);
    u.reconnect_min = Duration::from_millis(250);
    u.reconnect_max = Duration::from_secs(3600 + 60 + 1);
    let mut plain = UplinkConfig::new("lab", "mqtt://127.0.0.1:1884".parse().unwrap());
    plain.allow_plaintext = true;
    plain.topic_prefix = "lab/".into();
    c.uplink = vec![u, plain];
    c.spool = SpoolConfig {
        dir: Some("/var/lib/sluice/spool".into()),
        ack: SpoolAck::Cloud,
        fsync: FsyncMode::Always,
        fsync_interval: Duration::from_millis(25),
        segment_size: ByteSize::mib(8),
        max_size: ByteSize::gib(2),
        when_full: WhenFull::DropOldest,
        drain_share: Share::from_permille(250),
        drain_order: DrainOrder::NewestFirst,
    };
    c
}

#[test]
fn defaults_equal_parsing_an_empty_file() {
    assert_eq!(parse("").unwrap(), Config::default());
    assert_eq!(load(None).unwrap(), Config::default());
}

#[test]
fn defaults_match_the_documented_values() {
    let c = Config::default();
    assert_eq!(c.gateway.max_buffered, ByteSize::mib(64));
    assert_eq!(c.mqtt.listen.to_string(), "127.0.0.1:1883");
    assert_eq!(c.mqtt.session_expiry_max, Duration::from_secs(7200));
    assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9100");
    assert!(c.uplink.is_empty());
    let u = parse_unchecked_files(&tls_uplink(""))
        .unwrap()
        .uplink
        .remove(0);
    assert_eq!(
        u,
        UplinkConfig {
            ca_file: Some("ca.pem".into()),
            ..UplinkConfig::new("cloud", u.url.clone())
        }
    );
    assert_eq!(
        (u.url.port, u.protocol, u.forward.as_slice()),
        (8883, MqttProtocol::V5, &["#".to_string()][..])
    );
    assert_eq!(
        (u.inflight, u.reconnect_min),
        (256, Duration::from_millis(100))
    );
}

#[test]
fn unknown_top_level_key_is_rejected_with_its_path() {
    let e = err("gatway = 1");
    assert!(e.starts_with("gatway: unknown field `gatway`"), "{e}");
    assert!(e.contains("line 1"), "{e}");
}

#[test]
fn unknown_nested_key_is_rejected_with_its_path() {
    let e = err("[mqtt]\nlisten = \"0.0.0.0:1883\"\nmax_conections = 5\n");
    assert!(e.starts_with("mqtt.max_conections: unknown field"), "{e}");
    assert!(e.contains("line 3"), "{e}");
    let e = err("[[mqtt.users]]\nusername = \"a\"\npassword_hash = \"x\"\npassword = \"x\"\n");
    assert!(
        e.starts_with("mqtt.users[0].password: unknown field"),
        "{e}"
    );
}

#[test]
fn unknown_key_inside_an_uplink_is_rejected_with_its_index_path() {
    let text = format!(
        "{}{}",
        plaintext_uplink(""),
        plaintext_uplink("forwrd = [\"#\"]").replace("cloud", "two")
    );
    let e = err(&text);
    assert!(
        e.starts_with("uplink[1].forwrd: unknown field `forwrd`"),
        "{e}"
    );
}

#[test]
fn missing_required_uplink_fields_are_named() {
    let e = err("[[uplink]]\nname = \"cloud\"\n");
    // `url` or `urls` (`cluster.rs`): the error names the key and both ways to set it.
    assert!(e.starts_with("uplink[0].url: missing"), "{e}");
    assert!(e.contains("urls = ["), "{e}");
}

#[test]
fn bare_number_size_is_rejected_with_advice_to_add_a_unit() {
    let e = err("[mqtt]\nmax_packet_size = 1048576\n");
    assert!(
        e.starts_with("mqtt.max_packet_size: sizes need a unit, e.g. \"64MiB\""),
        "{e}"
    );
    let e = err("[gateway]\nmax_buffered = \"64\"\n");
    assert!(
        e.starts_with("gateway.max_buffered: ") && e.contains("need a unit"),
        "{e}"
    );
}

#[test]
fn bare_number_duration_is_rejected_with_advice_to_add_a_unit() {
    let e = err("[mqtt]\nconnect_timeout = 10\n");
    assert!(
        e.starts_with("mqtt.connect_timeout: durations need a unit"),
        "{e}"
    );
    let e = err(&plaintext_uplink("keep_alive = \"30\""));
    assert!(
        e.starts_with("uplink[0].keep_alive: ") && e.contains("need a unit"),
        "{e}"
    );
}

#[test]
fn values_of_the_wrong_type_name_their_key_and_line() {
    let e = err("[gateway]\nshards = \"four\"\n");
    assert!(e.starts_with("gateway.shards: invalid type"), "{e}");
    assert!(e.ends_with("(line 2, column 10)"), "{e}");
    let e = err("[admin]\nlisten = \"localhost:9100\"\n");
    assert!(
        e.starts_with("admin.listen: ") && e.contains("host names are not resolved"),
        "{e}"
    );
}

#[test]
fn syntax_errors_report_line_and_column_on_one_line() {
    let e = parse("[mqtt]\nlisten = \"0.0.0.0:1883\n").unwrap_err();
    match &e {
        ConfigError::Syntax { line, .. } => assert_eq!(*line, 2),
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert!(!e.to_string().contains('\n'), "{e}");
}

#[test]
fn units_round_trip_through_the_file() {
    let text = "[gateway]\nmax_buffered = \"1000KiB\"\n[mqtt]\nmax_packet_size = \"1MB\"\nconnect_timeout = \"1500ms\"\nsession_expiry_max = \"1h 30m\"\n";
    let c = parse(text).unwrap();
    assert_eq!(c.gateway.max_buffered, ByteSize(1_024_000));
    assert_eq!(c.mqtt.max_packet_size, ByteSize(1_000_000));
    assert_eq!(c.mqtt.connect_timeout, Duration::from_millis(1500));
    let printed = c.to_toml();
    for written in [
        "max_buffered = \"1000KiB\"",
        "max_packet_size = \"1MB\"",
        "connect_timeout = \"1s 500ms\"",
        "session_expiry_max = \"1h 30m\"",
    ] {
        assert!(printed.contains(written), "{written} not in\n{printed}");
    }
    assert_eq!(parse(&printed).unwrap(), c);
}

#[test]
fn to_toml_reparses_to_an_equal_effective_config() {
    for config in [Config::default(), everything_set()] {
        let printed = config.to_toml();
        let reparsed = parse_unchecked_files(&printed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
        assert_eq!(reparsed, config, "\n{printed}");
    }
    assert!(everything_set().to_toml().contains("protocol = \"3.1.1\""));
}

#[test]
fn plaintext_uplink_is_rejected_unless_allow_plaintext_is_set() {
    let text = "[[uplink]]\nname = \"cloud\"\nurl = \"mqtt://10.0.0.1\"\n";
    let e = err(text);
    assert!(
        e.starts_with("uplink[0].url: ") && e.contains("allow_plaintext"),
        "{e}"
    );
    let c = parse_unchecked_files(&plaintext_uplink("")).unwrap();
    assert_eq!(
        c.uplink[0].url,
        UplinkUrl {
            tls: false,
            host: "10.0.0.1".into(),
            port: 1883
        }
    );
}

#[test]
fn tls_settings_on_a_plaintext_uplink_are_rejected() {
    let e = err(&plaintext_uplink("ca_file = \"ca.pem\""));
    assert!(
        e.starts_with("uplink[0].ca_file: only applies to mqtts://"),
        "{e}"
    );
}

#[test]
fn tls_uplink_requires_a_ca_file() {
    let e = err("[[uplink]]\nname = \"cloud\"\nurl = \"mqtts://broker.example.com\"\n");
    assert_eq!(
        e,
        "uplink[0].ca_file: ca_file is required for mqtts uplinks"
    );
}

#[test]
fn client_certificate_needs_both_cert_and_key() {
    let e = err(&tls_uplink("cert_file = \"gw.pem\""));
    assert!(e.starts_with("uplink[0].key_file: "), "{e}");
    let e = err(&tls_uplink("key_file = \"gw.key\""));
    assert!(e.starts_with("uplink[0].cert_file: "), "{e}");
    assert!(
        parse_unchecked_files(&tls_uplink("cert_file = \"gw.pem\"\nkey_file = \"gw.key\"")).is_ok()
    );
}

#[test]
fn topic_template_and_topic_prefix_are_mutually_exclusive() {
    let e = err(&plaintext_uplink(
        "topic_prefix = \"site1/\"\ntopic_template = \"site1/{device}/{topic}\"",
    ));
    assert!(
        e.starts_with("uplink[0].topic_template: ") && e.contains("topic_prefix"),
        "{e}"
    );
    assert!(parse_unchecked_files(&plaintext_uplink(
        "topic_template = \"site1/{device}/{topic}\""
    ))
    .is_ok());
    assert!(parse_unchecked_files(&plaintext_uplink("topic_prefix = \"site1/\"")).is_ok());
}

#[test]
fn topic_template_must_name_the_topic_or_the_device() {
    let e = err(&plaintext_uplink("topic_template = \"site1/all\""));
    assert!(e.contains("must contain {topic} or {device}"), "{e}");
    let e = err(&plaintext_uplink(
        "topic_template = \"site1/{client}/{topic}\"",
    ));
    assert!(e.contains("unknown placeholder {client}"), "{e}");
}

#[test]
fn invalid_topic_filters_are_rejected_with_their_index() {
    let e = err(&plaintext_uplink("forward = [\"a/#\", \"a/#/b\"]"));
    assert!(
        e.starts_with("uplink[0].forward[1]: \"a/#/b\" is not a valid MQTT topic filter"),
        "{e}"
    );
    let e = err(&plaintext_uplink("receive = [\"cmd+\"]"));
    assert!(e.starts_with("uplink[0].receive[0]: "), "{e}");
    let e = err(&plaintext_uplink("topic_prefix = \"site/+/\""));
    assert!(e.starts_with("uplink[0].topic_prefix: "), "{e}");
}

#[test]
fn uplink_names_must_be_unique_and_label_safe() {
    let e = err(&format!("{}{}", plaintext_uplink(""), plaintext_uplink("")));
    assert!(
        e.starts_with("uplink[1].name: duplicate uplink name \"cloud\""),
        "{e}"
    );
    let e = err(&plaintext_uplink("").replace("\"cloud\"", "\"my cloud\""));
    assert!(e.starts_with("uplink[0].name: "), "{e}");
}

#[test]
fn protocol_is_a_quoted_version_string() {
    let c = parse_unchecked_files(&plaintext_uplink("protocol = \"3.1.1\"\nusername = \"gw\""))
        .unwrap();
    assert_eq!(c.uplink[0].protocol, MqttProtocol::V311);
    let e = err(&plaintext_uplink("protocol = 5"));
    assert!(
        e.starts_with("uplink[0].protocol: ") && e.contains("quote it"),
        "{e}"
    );
    let e = err(&plaintext_uplink("protocol = \"4\""));
    assert!(e.starts_with("uplink[0].protocol: "), "{e}");
}

#[test]
fn range_rules_name_the_offending_key() {
    let cases = [
        ("[mqtt]\nreceive_maximum = 0", "mqtt.receive_maximum: "),
        ("[gateway]\nshards = 1025", "gateway.shards: "),
        (
            "[gateway]\nmailbox_capacity = 0",
            "gateway.mailbox_capacity: ",
        ),
        (
            "[gateway]\nmax_buffered = \"512KiB\"",
            "gateway.max_buffered: ",
        ),
        (
            "[mqtt]\nmax_packet_size = \"16B\"",
            "mqtt.max_packet_size: ",
        ),
        ("[mqtt]\nallow_anonymous = false", "mqtt.allow_anonymous: "),
        ("[mqtt]\nauth_concurrency = 0", "mqtt.auth_concurrency: "),
        ("[log]\nlevel = \" \"", "log.level: "),
        ("[log]\nformat = \"xml\"", "log.format: "),
        ("[admin]\nlisten = \"127.0.0.1:1883\"", "admin.listen: "),
        ("[phd]\nagents = [\"00112233\"]", "phd.agents: "),
        (
            "[phd.tls]\ncert_file = \"a.pem\"\nkey_file = \"a.key\"\nrequire_client_cert = true",
            "phd.tls.require_client_cert: ",
        ),
    ];
    for (text, prefix) in cases {
        let e = err(text);
        assert!(e.starts_with(prefix), "{text:?} gave {e}");
    }
    assert!(parse("[gateway]\nshards = 1024").is_ok());
    let e = err(&plaintext_uplink(
        "reconnect_min = \"5s\"\nreconnect_max = \"1s\"",
    ));
    assert_eq!(
        e,
        "uplink[0].reconnect_max: 1s is less than reconnect_min (5s)"
    );
    let e = err(&plaintext_uplink("inflight = 0"));
    assert!(e.starts_with("uplink[0].inflight: "), "{e}");
    let e = err(&plaintext_uplink("keep_alive = \"1500ms\""));
    assert!(e.starts_with("uplink[0].keep_alive: "), "{e}");
}

#[test]
fn user_password_hashes_must_be_argon2_phc_strings() {
    let ok = format!("[[mqtt.users]]\nusername = \"dev1\"\npassword_hash = \"{HASH}\"\n");
    assert_eq!(parse(&ok).unwrap().mqtt.users[0].username, "dev1");
    for bad in [
        "plaintext",
        "$argon2id$v=19",
        "$2b$12$abcdefghijklmnopqrstuv",
    ] {
        let e = err(&format!(
            "[[mqtt.users]]\nusername = \"dev1\"\npassword_hash = \"{bad}\"\n"
        ));
        assert!(e.starts_with("mqtt.users[0].password_hash: "), "{bad}: {e}");
    }
    let e = err(&format!("{ok}{ok}"));
    assert!(e.starts_with("mqtt.users[1].username: duplicate"), "{e}");
}

#[test]
fn coap_anonymous_peers_follow_mqtt_unless_set_and_check_warns_beside_mqtt_users() {
    let users = format!("[[mqtt.users]]\nusername = \"dev1\"\npassword_hash = \"{HASH}\"\n");
    let plain = parse("").unwrap();
    assert!(plain.coap.anonymous_allowed(&plain.mqtt));
    assert!(plain.warnings().is_empty());
    let with_users = parse(&users).unwrap();
    assert_eq!(with_users.coap.allow_anonymous, None);
    assert!(
        !with_users.coap.anonymous_allowed(&with_users.mqtt),
        "MQTT users close the CoAP door too"
    );
    let w = with_users.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("plain UDP") && w[0].contains("may not"),
        "{}",
        w[0]
    );
    let open = parse(&format!("[coap]\nallow_anonymous = true\n{users}")).unwrap();
    assert!(open.coap.anonymous_allowed(&open.mqtt));
    assert!(open.warnings()[0].contains("may publish"));
    assert_eq!(parse(&open.to_toml()).unwrap(), open, "round trip");
    let off = parse(&format!("[coap]\nenabled = false\n{users}")).unwrap();
    assert!(off.warnings().is_empty(), "no plain CoAP, no warning");
}

#[test]
fn coap_hostile_network_bounds_have_defaults_and_are_checked() {
    let c = parse("").unwrap().coap;
    assert_eq!(c.max_exchange_bytes, units::ByteSize::mib(4));
    assert_eq!(c.max_verified_bytes, units::ByteSize::mib(1));
    assert_eq!(c.max_block_bytes, units::ByteSize::mib(8));
    assert_eq!(c.block_idle_timeout, std::time::Duration::from_secs(30));
    assert_eq!(c.max_block_transfers_per_source, 4);
    assert_eq!(c.max_observers_per_source, 64);
    assert_eq!(c.observer_check, std::time::Duration::from_secs(120));
    for (text, key) in [
        ("[coap]\nobserver_check = \"25h\"", "coap.observer_check: "),
        ("[coap]\nobserver_check = \"0s\"", "coap.observer_check: "),
        (
            "[coap]\nblock_idle_timeout = \"0s\"",
            "coap.block_idle_timeout: ",
        ),
        (
            "[coap]\nmax_exchange_bytes = \"1KiB\"",
            "coap.max_exchange_bytes: ",
        ),
        (
            "[coap]\nmax_block_bytes = \"100B\"",
            "coap.max_block_bytes: ",
        ),
        (
            "[coap]\nmax_observers_per_source = 0",
            "coap.max_observers_per_source: ",
        ),
        (
            "[coap]\nmax_block_transfers_per_source = 0",
            "coap.max_block_transfers_per_source: ",
        ),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.starts_with(key), "{text}: {e}");
    }
}

#[test]
fn anonymous_devices_are_allowed_by_default_only_without_users() {
    let users = format!("[[mqtt.users]]\nusername = \"dev1\"\npassword_hash = \"{HASH}\"\n");
    let no_users = parse("").unwrap();
    assert!(no_users.mqtt.anonymous_allowed());
    let with_users = parse(&users).unwrap();
    assert_eq!(with_users.mqtt.allow_anonymous, None);
    assert!(!with_users.mqtt.anonymous_allowed(), "users close the door");
    for explicit in [true, false] {
        let c = parse(&format!("[mqtt]\nallow_anonymous = {explicit}\n{users}")).unwrap();
        assert_eq!(
            c.mqtt.anonymous_allowed(),
            explicit,
            "an explicit value wins"
        );
        assert_eq!(parse(&c.to_toml()).unwrap(), c, "round trip");
    }
    assert_eq!(
        parse(&with_users.to_toml()).unwrap(),
        with_users,
        "round trip"
    );
}

#[test]
fn debug_output_redacts_the_password_hash() {
    let c = everything_set();
    let debug = format!("{c:?}");
    assert!(!debug.contains(HASH), "{debug}");
    assert!(debug.contains("dev1"));
}

#[test]
fn missing_referenced_files_are_reported_with_key_and_path() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("absent-ca.pem");
    let text = format!(
        "[[uplink]]\nname = \"cloud\"\nurl = \"mqtts://broker.example.com\"\nca_file = {:?}\n",
        ca.display().to_string()
    );
    let e = parse(&text).unwrap_err();
    assert!(matches!(e, ConfigError::File { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.starts_with("uplink[0].ca_file: cannot read ") && e.contains("absent-ca.pem"),
        "{e}"
    );
    // The same text passes when file checks are skipped.
    assert!(parse_unchecked_files(&text).is_ok());
}

#[test]
fn a_ca_file_without_certificates_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    fs::write(&ca, "not a certificate\n").unwrap();
    let text = format!(
        "[[uplink]]\nname = \"cloud\"\nurl = \"mqtts://b.example\"\nca_file = {:?}\n",
        ca.display().to_string()
    );
    let e = parse(&text).unwrap_err().to_string();
    assert!(
        e.starts_with("uplink[0].ca_file: ") && e.contains("no PEM certificates"),
        "{e}"
    );
}

#[test]
fn load_resolves_relative_paths_against_the_config_directory() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("certs")).unwrap();
    fs::write(dir.path().join("certs/ca.pem"), PEM_CERT).unwrap();
    fs::write(dir.path().join("certs/gw.pem"), PEM_CERT).unwrap();
    fs::write(dir.path().join("certs/gw.key"), PEM_KEY).unwrap();
    fs::write(dir.path().join("pw"), "s3cret\n").unwrap();
    let path = dir.path().join("sluice.toml");
    fs::write(
        &path,
        tls_uplink("cert_file = \"certs/gw.pem\"\nkey_file = \"certs/gw.key\"\nusername = \"gw\"\npassword_file = \"pw\"")
            .replace("\"ca.pem\"", "\"certs/ca.pem\""),
    )
    .unwrap();
    let c = load(Some(&path)).unwrap();
    let u = &c.uplink[0];
    assert_eq!(
        u.ca_file.as_deref(),
        Some(dir.path().join("certs/ca.pem").as_path())
    );
    assert_eq!(u.read_password(0).unwrap().unwrap().expose(), "s3cret");
    assert_eq!(u.tls_server_name(), "broker.example.com");
    assert_eq!(u.session_client_id(3), "sluice-3");
    // The printed effective config carries the resolved paths and loads again unchanged.
    fs::write(&path, c.to_toml()).unwrap();
    assert_eq!(load(Some(&path)).unwrap(), c);
}

#[test]
fn a_missing_config_file_is_reported_with_its_path() {
    let e = load(Some(Path::new("/nonexistent/sluice.toml")))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cannot read config file /nonexistent/sluice.toml: "),
        "{e}"
    );
}

// ----- [spool] -----

#[test]
fn shards_0_is_one_per_core_but_one_and_at_least_one() {
    assert_eq!(GatewayConfig::auto_shards(1), 1);
    assert_eq!(GatewayConfig::auto_shards(2), 1);
    assert_eq!(GatewayConfig::auto_shards(4), 3);
    assert_eq!(GatewayConfig::auto_shards(64), 63);
    assert_eq!(GatewayConfig::auto_shards(4096), GatewayConfig::MAX_SHARDS);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let auto = parse("[gateway]\nshards = 0").expect("parses");
    assert_eq!(
        auto.gateway.shard_count(),
        GatewayConfig::auto_shards(cores)
    );
    let three = parse("[gateway]\nshards = 3").expect("parses");
    assert_eq!(three.gateway.shard_count(), 3);
}
