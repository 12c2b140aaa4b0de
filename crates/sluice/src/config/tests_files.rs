//! Config tests: the spool, topic limits, the admin API's token, and ACL rules (also from a
//! file).

use super::tests::*;
use super::*;
use std::fs;

#[test]
fn no_spool_dir_means_no_spool_and_the_defaults_are_store_and_forward() {
    let c = parse("").unwrap();
    assert!(!c.spool.enabled());
    let c = parse("[spool]\ndir = \"/tmp/sluice-spool\"\n").unwrap();
    assert!(c.spool.enabled());
    assert_eq!(c.spool.ack, SpoolAck::Spool);
    assert_eq!(c.spool.fsync, FsyncMode::Interval);
    assert_eq!(c.spool.fsync_interval, Duration::from_millis(10));
    assert_eq!(c.spool.when_full, WhenFull::Block);
    assert_eq!(c.spool.drain_share.permille(), 500);
    assert_eq!(c.spool.drain_order, DrainOrder::OldestFirst);
}

#[test]
fn every_spool_option_parses_with_its_unit_and_prints_back() {
    let text = "[gateway]\nshards = 2\n[spool]\ndir = \"/s\"\nack = \"cloud\"\nfsync = \"never\"\nfsync_interval = \"5ms\"\nsegment_size = \"2MiB\"\nmax_size = \"64MiB\"\nwhen_full = \"drop-oldest\"\ndrain_share = 0.25\ndrain_order = \"newest-first\"\n";
    let c = parse(text).unwrap();
    assert_eq!(c.spool.ack, SpoolAck::Cloud);
    assert_eq!(c.spool.fsync, FsyncMode::Never);
    assert_eq!(c.spool.fsync_interval, Duration::from_millis(5));
    assert_eq!(c.spool.segment_size, ByteSize::mib(2));
    assert_eq!(c.spool.max_size, ByteSize::mib(64));
    assert_eq!(c.spool.when_full, WhenFull::DropOldest);
    assert_eq!(c.spool.drain_share.permille(), 250);
    assert_eq!(c.spool.drain_order, DrainOrder::NewestFirst);
    assert_eq!(c.spool.max_bytes_per_spool(2, 1), 32 << 20);
    let printed = c.to_toml();
    assert!(printed.contains("drain_share = 0.25"), "{printed}");
    assert!(printed.contains("when_full = \"drop-oldest\""), "{printed}");
    assert_eq!(parse(&printed).unwrap(), c);
    assert_eq!(
        parse("[spool]\ndrain_share = 1\n")
            .unwrap()
            .spool
            .drain_share
            .permille(),
        1000
    );
}

#[test]
fn unknown_spool_keys_are_rejected_with_their_path() {
    let e = err("[spool]\ndir = \"/s\"\nfsync_intervall = \"10ms\"\n");
    assert!(e.starts_with("spool.fsync_intervall: unknown field"), "{e}");
    assert!(e.contains("line 3"), "{e}");
}

#[test]
fn bad_spool_values_are_rejected_with_their_key() {
    let cases: &[(&str, &str)] = &[
        ("ack = \"device\"", "spool.ack: unknown variant `device`"),
        ("fsync = \"sometimes\"", "spool.fsync: unknown variant"),
        (
            "when_full = \"drop_oldest\"",
            "spool.when_full: unknown variant",
        ),
        (
            "drain_order = \"random\"",
            "spool.drain_order: unknown variant",
        ),
        (
            "drain_share = 0.0",
            "spool.drain_share: 0 is not a fraction",
        ),
        (
            "drain_share = 1.5",
            "spool.drain_share: 1.5 is not a fraction",
        ),
        ("drain_share = 2", "spool.drain_share: 2 is not a fraction"),
        ("drain_share = \"half\"", "spool.drain_share: invalid type"),
        (
            "segment_size = 1048576",
            "spool.segment_size: sizes need a unit",
        ),
        (
            "fsync_interval = 10",
            "spool.fsync_interval: durations need a unit",
        ),
        (
            "fsync_interval = \"0s\"",
            "spool.fsync_interval: must be more than 0s",
        ),
        (
            "fsync_interval = \"2s\"",
            "spool.fsync_interval: must be more than 0s and at most 1s",
        ),
        (
            "segment_size = \"1KiB\"",
            "spool.segment_size: 1KiB must be from",
        ),
        (
            "segment_size = \"2GiB\"",
            "spool.segment_size: 2GiB must be from",
        ),
        ("dir = \"\"", "spool.dir: must not be empty"),
    ];
    for (line, want) in cases {
        let dir = if line.starts_with("dir") {
            ""
        } else {
            "dir = \"/s\"\n"
        };
        let e = err(&format!("[gateway]\nshards = 1\n[spool]\n{dir}{line}\n"));
        assert!(e.starts_with(want), "{line}: {e}");
    }
    let e = err("[gateway]\nshards = 4\n[spool]\ndir = \"/s\"\nsegment_size = \"16MiB\"\nmax_size = \"100MiB\"\n");
    assert!(
        e.starts_with(
            "spool.max_size: 100MiB split over 4 shard(s) and 1 uplink(s) gives each spool 25MiB"
        ),
        "{e}"
    );
}

#[test]
fn a_relative_spool_dir_is_resolved_against_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    fs::write(&path, "[spool]\ndir = \"spool\"\n").unwrap();
    let c = load(Some(&path)).unwrap();
    assert_eq!(
        c.spool.dir.as_deref(),
        Some(dir.path().join("spool").as_path())
    );
}

// --- Input bounds ---

#[test]
fn topic_limits_are_in_range_and_the_configs_own_filters_obey_them() {
    let c = Config::default();
    assert_eq!(
        (c.mqtt.max_topic_levels, c.mqtt.max_topic_length),
        (32, ByteSize::kib(1))
    );
    for (text, prefix) in [
        ("[mqtt]\nmax_topic_levels = 0", "mqtt.max_topic_levels: "),
        (
            "[mqtt]\nmax_topic_levels = 65536",
            "mqtt.max_topic_levels: ",
        ),
        (
            "[mqtt]\nmax_topic_length = \"0B\"",
            "mqtt.max_topic_length: ",
        ),
        (
            "[mqtt]\nmax_topic_length = \"64KiB\"",
            "mqtt.max_topic_length: ",
        ),
    ] {
        let e = err(text);
        assert!(e.starts_with(prefix), "{text:?} gave {e}");
    }
    let limits = "[mqtt]\nmax_topic_levels = 3\nmax_topic_length = \"16B\"\n";
    let e = err(&format!(
        "{limits}{}",
        plaintext_uplink("forward = [\"a/b/#\", \"a/b/c/d\"]")
    ));
    assert_eq!(
        e,
        "uplink[0].forward[1]: the topic has 4 levels, more than mqtt.max_topic_levels (3)"
    );
    let e = err(&format!(
        "{limits}{}",
        plaintext_uplink("receive = [\"cmd/0123456789abcdef\"]")
    ));
    assert!(
        e.starts_with("uplink[0].receive[0]: the topic is 20 bytes long"),
        "{e}"
    );
    let e = err(&format!(
        "{limits}[priority]\ntopics = {{ \"a/b/c/d\" = 1 }}\n"
    ));
    assert!(e.starts_with("priority.topics.\"a/b/c/d\": "), "{e}");
    for (text, prefix) in [
        (
            "[mqtt]\nmax_connections = 10\nmax_sessions = 9",
            "mqtt.max_sessions: 9 is less than mqtt.max_connections (10)",
        ),
        (
            "[mqtt]\nmax_queued_bytes = \"0B\"",
            "mqtt.max_queued_bytes: ",
        ),
        (
            "[gateway]\nmax_outbox_memory = \"1MiB\"",
            "gateway.max_outbox_memory: ",
        ),
        (
            "[mqtt]\nmax_subscriptions_per_session = 0",
            "mqtt.max_subscriptions_per_session: ",
        ),
    ] {
        let e = err(text);
        assert!(e.starts_with(prefix), "{text:?} gave {e}");
    }
    assert!(parse_unchecked_files(&format!(
        "{limits}{}",
        plaintext_uplink("forward = [\"a/b/#\"]")
    ))
    .is_ok());
}

#[test]
fn admin_off_loopback_requires_a_token_file_with_a_clear_error() {
    for listen in ["0.0.0.0:9100", "192.0.2.7:9100", "[::]:9100"] {
        let e = err(&format!("[admin]\nlisten = \"{listen}\"\n"));
        assert!(
            e.starts_with("admin.token_file: is required when admin.listen")
                && e.contains("not a loopback address")
                && e.contains("Authorization: Bearer"),
            "{listen}: {e}"
        );
    }
    // Loopback needs none; a disabled endpoint is not checked.
    for text in [
        "[admin]\nlisten = \"127.0.0.1:9100\"\n",
        "[admin]\nlisten = \"[::1]:9100\"\n",
        "[admin]\nenabled = false\nlisten = \"0.0.0.0:9100\"\n",
        "[admin]\nlisten = \"0.0.0.0:9100\"\ntoken_file = \"admin.token\"\n",
    ] {
        assert!(parse_unchecked_files(text).is_ok(), "{text}");
    }
    let e = err("[admin]\ncert_file = \"a.pem\"\n");
    assert!(e.starts_with("admin.key_file: "), "{e}");
    let e = err("[admin]\nkey_file = \"a.key\"\n");
    assert!(e.starts_with("admin.cert_file: "), "{e}");
}

#[test]
fn the_admin_token_is_read_from_its_file_checked_and_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let token = "s3cret-token-0123456789";
    let token_path = dir.path().join("admin.token");
    let config_path = dir.path().join("sluice.toml");
    fs::write(
        &config_path,
        "[admin]\nlisten = \"0.0.0.0:0\"\ntoken_file = \"admin.token\"\n",
    )
    .unwrap();
    // Missing file: named with its key.
    let e = load(Some(&config_path)).unwrap_err().to_string();
    assert!(e.starts_with("admin.token_file: "), "{e}");
    for bad in ["short\n", "has a space in the middle\n", "\n"] {
        fs::write(&token_path, bad).unwrap();
        let e = load(Some(&config_path)).unwrap_err().to_string();
        assert!(
            e.starts_with("admin.token_file: ") && e.contains("at least 16 visible ASCII"),
            "{bad:?}: {e}"
        );
    }
    fs::write(&token_path, format!("{token}\n")).unwrap();
    let c = load(Some(&config_path)).unwrap();
    // Relative to the config file's directory.
    assert_eq!(c.admin.token_file.as_deref(), Some(token_path.as_path()));
    let read = c.admin.read_token().unwrap().unwrap();
    assert_eq!(read.expose(), token.as_bytes());
    for shown in [c.to_toml(), format!("{c:?}"), format!("{read:?}")] {
        assert!(!shown.contains(token), "the token was printed: {shown}");
    }
    assert!(c.to_toml().contains("token_file = "), "{}", c.to_toml());
}

#[test]
fn acl_rules_and_limits_are_checked_with_their_key_path() {
    let rule = |body: &str| format!("[acl]\n[[acl.rule]]\n{body}\n");
    let cases = [
        (
            rule("devices = \"d[0-9]\"\naction = \"all\"\ntopics = [\"a\"]\npermission = \"allow\""),
            "acl.rule[0].devices: ",
        ),
        (
            rule("devices = \"*\"\naction = \"read\"\ntopics = [\"a\"]\npermission = \"allow\""),
            "acl.rule[0].action: ",
        ),
        (
            rule("devices = \"*\"\naction = \"all\"\ntopics = [\"a\", \"b/#/c\"]\npermission = \"allow\""),
            "acl.rule[0].topics[1]: ",
        ),
        (
            rule("action = \"all\"\ntopics = [\"a\"]\npermission = \"allow\""),
            "acl.rule[0]: ",
        ),
        ("[acl]\ndefault = \"maybe\"".to_string(), "acl.default: "),
        (
            "[limits]\npublish_rate = 5\npublish_burst = 0".to_string(),
            "limits.publish_burst: ",
        ),
        ("[limits]\nflap_window = \"0s\"".to_string(), "limits.flap_window: "),
    ];
    for (text, prefix) in cases {
        let e = err(&text);
        assert!(e.starts_with(prefix), "{text:?} gave {e}");
    }
}

#[test]
fn acl_rules_from_a_file_are_read_and_checked_with_the_files_key_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("acl.toml");
    fs::write(
        &file,
        "[[rule]]\nusers = \"ops-*\"\naction = \"subscribe\"\ntopics = [\"%u/+/x\"]\npermission = \"allow\"\n",
    )
    .unwrap();
    let text = format!(
        "[acl]\ndefault = \"deny\"\nfile = {:?}\n",
        file.display().to_string()
    );
    let c = parse(&text).unwrap();
    assert_eq!(c.acl.file.as_deref(), Some(file.as_path()));
    fs::write(
        &file,
        "[[rule]]\ndevices = \"*\"\naction = \"all\"\ntopics = [\"%q\"]\npermission = \"allow\"\n",
    )
    .unwrap();
    let e = parse(&text).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("acl.file({}).rule[0].topics[0]: ", file.display())),
        "{e}"
    );
    let missing = format!(
        "[acl]\nfile = {:?}\n",
        dir.path().join("none.toml").display().to_string()
    );
    assert!(parse(&missing)
        .unwrap_err()
        .to_string()
        .starts_with("acl.file: cannot read"));
}
