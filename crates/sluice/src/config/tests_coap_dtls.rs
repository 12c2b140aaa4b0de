//! Tests of `[coap.dtls]`: defaults, the PSK file, and what `check_coap_dtls` refuses.

use super::*;

fn err(text: &str) -> String {
    match parse_unchecked_files(text) {
        Ok(c) => panic!("expected an error for {text:?}, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

fn dtls(lines: &str) -> String {
    format!("[coap.dtls]\n{lines}\n")
}

#[test]
fn dtls_is_off_by_default_and_a_psk_section_gets_port_5684_and_its_bounds() {
    assert_eq!(parse_unchecked_files("").expect("empty").coap.dtls, None);
    let d = parse_unchecked_files(&dtls("psk_file = \"coap-psk.txt\""))
        .expect("valid")
        .coap
        .dtls
        .expect("section present");
    assert_eq!(d.listen.to_string(), "0.0.0.0:5684");
    assert_eq!((d.max_sessions, d.max_handshakes), (1024, 64));
    assert_eq!(d.idle_timeout, std::time::Duration::from_secs(300));
    assert_eq!(d.handshake_timeout, std::time::Duration::from_secs(30));
    assert_eq!(d.mtu.as_u64(), 1280);
}

#[test]
fn a_dtls_section_without_credentials_or_with_half_a_pair_is_refused_naming_the_key() {
    assert!(err(&dtls("")).contains("coap.dtls: needs psk_file"));
    assert!(err(&dtls("cert_file = \"s.pem\"")).contains("coap.dtls.key_file"));
    assert!(err(&dtls("key_file = \"s.key\"")).contains("coap.dtls.cert_file"));
    assert!(err(&dtls("psk_file = \"p\"\nclient_ca_file = \"ca.pem\""))
        .contains("coap.dtls.client_ca_file"));
    assert!(err(&dtls("psk_file = \"p\"\nmax_handshakes = 2000")).contains("max_handshakes"));
    assert!(err(&dtls("psk_file = \"p\"\nmtu = \"100B\"")).contains("coap.dtls.mtu"));
    assert!(err(&dtls("psk_file = \"p\"\nmax_session = 3")).contains("max_session"));
    assert!(err(&format!(
        "[coap]\nenabled = false\n{}",
        dtls("psk_file = \"p\"")
    ))
    .contains("coap.dtls: needs [coap] enabled"));
}

#[test]
fn the_psk_file_is_read_when_files_must_exist_and_its_errors_name_the_line_not_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("psk.txt");
    std::fs::write(
        &path,
        "# comment\n\nsensor-7:0x736563726574\nurn:dev:mac:0a0b:00ff\n",
    )
    .expect("write");
    let text = dtls(&format!(
        "listen = \"127.0.0.1:0\"\npsk_file = \"{}\"",
        path.display()
    ));
    let config = parse(&text).expect("valid psk file");
    let table = config
        .coap
        .dtls
        .expect("dtls")
        .read_psk_file()
        .expect("read");
    assert_eq!(table.len(), 2);
    assert_eq!(table.key(b"sensor-7"), Some(&b"secret"[..]));
    assert_eq!(
        table.key(b"urn:dev:mac:0a0b"),
        Some(&[0x00, 0xff][..]),
        "the last ':' splits"
    );
    assert_eq!(table.key(b"nobody"), None);
    assert!(
        !format!("{table:?}").contains("736563"),
        "Debug redacts keys"
    );

    for (bad, why) in [
        ("sensor-7 736563\n", "line 1: expected identity:hex-key"),
        ("a:abc\n", "line 1: the key must be 1 to 64 bytes in hex"),
        ("a:zz\n", "line 1: the key must be 1 to 64 bytes in hex"),
        ("a:00\n# x\na:01\n", "line 3: identity \"a\" appears twice"),
        ("a+b:00\n", "line 1: the identity"),
        (":00\n", "line 1: the identity must be 1 to 128 bytes"),
    ] {
        std::fs::write(&path, bad).expect("write");
        let e = parse(&text).expect_err(bad).to_string();
        assert!(
            e.contains("coap.dtls.psk_file") && e.contains(why),
            "{bad:?}: {e}"
        );
    }
    std::fs::write(&path, "# nothing\n").expect("write");
    assert!(parse(&text)
        .expect_err("empty")
        .to_string()
        .contains("holds no identity"));
    std::fs::remove_file(&path).expect("rm");
    assert!(parse(&text)
        .expect_err("missing")
        .to_string()
        .contains("cannot read"));
}
