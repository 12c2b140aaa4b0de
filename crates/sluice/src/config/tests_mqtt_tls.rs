//! `[mqtt.tls]`, `[mqtt.ws]`, `[mqtt.wss]`: defaults, rules, files, printing back.

use super::*;
use std::fs;

const PEM_CERT: &str = "-----BEGIN CERTIFICATE-----\nAAECAwQ=\n-----END CERTIFICATE-----\n";
const PEM_KEY: &str = "-----BEGIN PRIVATE KEY-----\nAAECAwQ=\n-----END PRIVATE KEY-----\n";

const TLS: &str = "[mqtt.tls]\ncert_file = \"s.pem\"\nkey_file = \"s.key\"\n";

fn err(text: &str) -> String {
    match parse_unchecked_files(text) {
        Ok(c) => panic!("expected an error for {text:?}, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn tls_ws_and_wss_sections_take_their_defaults() {
    let c = parse_unchecked_files(&format!("{TLS}[mqtt.ws]\n[mqtt.wss]\n")).expect("valid");
    let tls = c.mqtt.tls.expect("tls");
    assert_eq!(tls.listen, "127.0.0.1:8883".parse().unwrap());
    assert_eq!(tls.min_version, TlsMinVersion::Tls12);
    assert!(!tls.require_client_cert && !tls.identity_from_cert);
    assert_eq!(tls.client_ca_file, None);
    let ws = c.mqtt.ws.expect("ws");
    assert_eq!(
        (ws.listen, ws.path.as_str()),
        ("127.0.0.1:8080".parse().unwrap(), "/mqtt")
    );
    let wss = c.mqtt.wss.expect("wss");
    assert_eq!(wss.listen, "127.0.0.1:8081".parse().unwrap());
    // Absent sections: no listener.
    let c = parse_unchecked_files("").expect("valid");
    assert!(c.mqtt.tls.is_none() && c.mqtt.ws.is_none() && c.mqtt.wss.is_none());
}

#[test]
fn unknown_and_missing_tls_keys_are_named() {
    let e = err(&format!("{TLS}verify = true\n"));
    assert!(
        e.starts_with("mqtt.tls.verify: unknown field `verify`"),
        "{e}"
    );
    let e = err("[mqtt.tls]\ncert_file = \"s.pem\"\n");
    assert!(e.contains("mqtt.tls") && e.contains("key_file"), "{e}");
    let e = err("[mqtt.ws]\nlisten = \"127.0.0.1:9\"\npth = \"/x\"\n");
    assert!(e.starts_with("mqtt.ws.pth: unknown field `pth`"), "{e}");
}

#[test]
fn client_certificate_options_need_a_client_ca() {
    let e = err(&format!("{TLS}require_client_cert = true\n"));
    assert!(e.starts_with("mqtt.tls.require_client_cert: "), "{e}");
    let e = err(&format!("{TLS}identity_from_cert = true\n"));
    assert!(e.starts_with("mqtt.tls.identity_from_cert: "), "{e}");
    assert!(parse_unchecked_files(&format!(
        "{TLS}client_ca_file = \"ca.pem\"\nrequire_client_cert = true\nidentity_from_cert = true\n"
    ))
    .is_ok());
}

#[test]
fn wss_needs_tls_and_paths_and_addresses_are_checked() {
    let e = err("[mqtt.wss]\n");
    assert!(e.starts_with("mqtt.wss: needs [mqtt.tls]"), "{e}");
    let e = err("[mqtt.ws]\npath = \"mqtt\"\n");
    assert!(e.starts_with("mqtt.ws.path: "), "{e}");
    let e = err(&format!(
        "[mqtt]\nlisten = \"127.0.0.1:1883\"\n{TLS}listen = \"127.0.0.1:1883\"\n"
    ));
    assert!(
        e.starts_with("mqtt.tls.listen: is the same address as mqtt.listen"),
        "{e}"
    );
    let e = err("[mqtt.ws]\nlisten = \"127.0.0.1:9100\"\n");
    assert!(
        e.starts_with("mqtt.ws.listen: is the same address as admin.listen"),
        "{e}"
    );
    // Port 0 (tests) never clashes.
    assert!(parse_unchecked_files(&format!(
        "[mqtt]\nlisten = \"127.0.0.1:0\"\n{TLS}listen = \"127.0.0.1:0\"\n[mqtt.ws]\nlisten = \"127.0.0.1:0\"\n"
    ))
    .is_ok());
}

#[test]
fn tls_files_must_exist_and_hold_pem_and_relative_paths_follow_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    fs::write(&path, format!("{TLS}client_ca_file = \"devices/ca.pem\"\n")).unwrap();
    let e = load(Some(&path)).unwrap_err().to_string();
    assert!(
        e.starts_with("mqtt.tls.cert_file: cannot read ") && e.contains("s.pem"),
        "{e}"
    );
    fs::write(dir.path().join("s.pem"), PEM_CERT).unwrap();
    fs::write(dir.path().join("s.key"), "no key here\n").unwrap();
    let e = load(Some(&path)).unwrap_err().to_string();
    assert!(e.starts_with("mqtt.tls.key_file: "), "{e}");
    fs::write(dir.path().join("s.key"), PEM_KEY).unwrap();
    fs::create_dir(dir.path().join("devices")).unwrap();
    fs::write(dir.path().join("devices/ca.pem"), PEM_CERT).unwrap();
    let c = load(Some(&path)).unwrap_or_else(|e| panic!("{e}"));
    let tls = c.mqtt.tls.expect("tls");
    assert_eq!(tls.cert_file, dir.path().join("s.pem"));
    assert_eq!(tls.client_ca_file, Some(dir.path().join("devices/ca.pem")));
}

#[test]
fn listeners_print_back_and_reparse_equal() {
    let text = format!(
        "{TLS}listen = \"0.0.0.0:8883\"\nclient_ca_file = \"ca.pem\"\nidentity_from_cert = true\nmin_version = \"1.3\"\n[mqtt.ws]\npath = \"/ws\"\n[mqtt.wss]\nlisten = \"0.0.0.0:443\"\n"
    );
    let c = parse_unchecked_files(&text).expect("valid");
    let printed = c.to_toml();
    assert!(
        printed.contains("[mqtt.tls]") && printed.contains("[mqtt.wss]"),
        "{printed}"
    );
    assert_eq!(parse_unchecked_files(&printed).expect("reparses"), c);
}
