//! Tests of `[coap]`: defaults, what `check_coap` refuses and how it says so.

use super::*;

fn err(text: &str) -> String {
    match parse_unchecked_files(text) {
        Ok(c) => panic!("expected an error for {text:?}, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

fn coap(lines: &str) -> String {
    format!("[coap]\n{lines}\n")
}

#[test]
fn coap_is_on_by_default_on_the_standard_port_with_rfc_7252_timers() {
    let c = parse_unchecked_files("").expect("empty file").coap;
    assert!(c.enabled);
    assert_eq!(c.listen.to_string(), "127.0.0.1:5683");
    assert_eq!(c.pubsub_path, "ps");
    assert_eq!(c.ack_timeout, std::time::Duration::from_secs(2));
    assert_eq!(c.exchange_lifetime, std::time::Duration::from_secs(247));
    assert_eq!((c.source_rate, c.source_burst), (2000, 500));
}

#[test]
fn a_coap_section_with_every_key_parses() {
    let c = parse_unchecked_files(&coap(
        "enabled = true\nlisten = \"0.0.0.0:5783\"\npubsub_path = \"pubsub\"\nmax_message_size = \"1280B\"\n\
         block_size = \"512B\"\nmax_body_size = \"1MiB\"\nmax_block_transfers = 10\nmax_exchanges = 100\n\
         exchange_lifetime = \"100s\"\nnon_lifetime = \"50s\"\nack_timeout = \"3s\"\nmax_retransmit = 2\n\
         separate_after = \"500ms\"\nmax_pending = 5\nretry_after = \"10s\"\nmax_observers = 7\n\
         max_queued_notifications = 3\nsource_rate = 0\nsource_burst = 1",
    ))
    .expect("valid")
    .coap;
    assert_eq!(c.block_size.as_usize(), 512);
    assert_eq!(c.pubsub_path, "pubsub");
    assert_eq!(c.source_rate, 0);
}

#[test]
fn block_size_must_be_a_power_of_two_from_16_bytes_to_1_kib() {
    for bad in ["8B", "24B", "2KiB"] {
        let e = err(&coap(&format!("block_size = \"{bad}\"")));
        assert!(e.contains("coap.block_size"), "{e}");
        assert!(e.contains("power of two"), "{e}");
    }
    for good in ["16B", "64B", "1KiB"] {
        parse_unchecked_files(&coap(&format!("block_size = \"{good}\""))).expect(good);
    }
}

#[test]
fn a_message_must_hold_a_block_and_fit_a_datagram() {
    let e = err(&coap("block_size = \"1KiB\"\nmax_message_size = \"1KiB\""));
    assert!(e.contains("coap.max_message_size"), "{e}");
    let e = err(&coap("max_message_size = \"70000B\""));
    assert!(e.contains("coap.max_message_size"), "{e}");
}

#[test]
fn the_pubsub_path_is_one_segment() {
    for bad in ["\"\"", "\"a/b\"", "\".well-known\""] {
        let e = err(&coap(&format!("pubsub_path = {bad}")));
        assert!(e.contains("coap.pubsub_path"), "{e}");
    }
}

#[test]
fn the_empty_ack_must_go_before_the_device_retransmits() {
    let e = err(&coap("ack_timeout = \"1s\"\nseparate_after = \"1s\""));
    assert!(e.contains("coap.separate_after"), "{e}");
    assert!(e.contains("ack_timeout"), "{e}");
    let e = err(&coap("ack_timeout = \"0s\""));
    assert!(e.contains("coap.ack_timeout"), "{e}");
}

#[test]
fn bounds_must_be_at_least_one() {
    for key in [
        "max_block_transfers",
        "max_exchanges",
        "max_pending",
        "max_observers",
        "max_queued_notifications",
    ] {
        let e = err(&coap(&format!("{key} = 0")));
        assert!(e.contains(&format!("coap.{key}")), "{e}");
        assert!(e.contains("at least 1"), "{e}");
    }
}

#[test]
fn retry_after_is_a_max_age_of_at_least_a_second() {
    let e = err(&coap("retry_after = \"0s\""));
    assert!(e.contains("coap.retry_after"), "{e}");
}

#[test]
fn unknown_coap_keys_are_rejected() {
    let e = err(&coap("listen_port = 5683"));
    assert!(e.contains("listen_port"), "{e}");
}
