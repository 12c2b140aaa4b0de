//! Checks on `[[coap.proxy]]` entries: url, names, prefixes, TLS files.
//!
//! Owns: the proxy rules and their wording. Does not own: the `[coap]` listener's rules.

use std::collections::HashSet;

use super::{check_label, check_pem, invalid, Files, Pem};
use crate::config::{Config, ConfigError};

/// Every `[[coap.proxy]]`: url `coap+tcp://` or `coaps+tcp://` (ports 5683/5684 by
/// default), names unique and `[a-zA-Z0-9_-]+`, prefixes unique single path segments other
/// than the pub/sub path and `.well-known`, `ca_file` for `coaps+tcp`, files readable PEM.
pub(in crate::config) fn check_coap_proxy(
    config: &Config,
    files: Files,
) -> Result<(), ConfigError> {
    let mut names = HashSet::new();
    let mut prefixes = HashSet::new();
    for (i, p) in config.coap.proxy.iter().enumerate() {
        let key = |field: &str| format!("coap.proxy[{i}].{field}");
        check_label(&key("name"), &p.name)?;
        if !names.insert(p.name.as_str()) {
            return invalid(
                &key("name"),
                &format!("duplicate proxy name {:?}; names must be unique", p.name),
            );
        }
        let target = match p.target() {
            Ok(t) => t,
            Err(reason) => return invalid(&key("url"), &reason),
        };
        if let Some(prefix) = &p.prefix {
            if prefix.is_empty() || prefix.contains(['/', '?', '#']) {
                return invalid(
                    &key("prefix"),
                    &format!("{prefix:?} must be one non-empty path segment (no '/', '?', '#')"),
                );
            }
            if *prefix == config.coap.pubsub_path || prefix == ".well-known" {
                return invalid(
                    &key("prefix"),
                    &format!("{prefix:?} is taken (coap.pubsub_path or .well-known)"),
                );
            }
            if !prefixes.insert(prefix.as_str()) {
                return invalid(
                    &key("prefix"),
                    &format!("duplicate prefix {prefix:?}; prefixes must be unique"),
                );
            }
        } else if !p.forward {
            return invalid(
                &key("prefix"),
                "an upstream needs a prefix (reverse proxy) or forward = true (forward proxy)",
            );
        }
        if target.tls {
            if p.ca_file.is_none() {
                return invalid(
                    &key("ca_file"),
                    "ca_file is required for coaps+tcp upstreams",
                );
            }
            let name = p.server_name.as_deref().unwrap_or(&target.host);
            if rustls::pki_types::ServerName::try_from(name).is_err() {
                return invalid(
                    &key(if p.server_name.is_some() {
                        "server_name"
                    } else {
                        "url"
                    }),
                    &format!("{name:?} is not a valid TLS server name"),
                );
            }
            if p.cert_file.is_some() != p.key_file.is_some() {
                return invalid(
                    &key("cert_file"),
                    "cert_file and key_file must be given together",
                );
            }
        } else {
            for (field, set) in [
                ("ca_file", p.ca_file.is_some()),
                ("cert_file", p.cert_file.is_some()),
                ("key_file", p.key_file.is_some()),
                ("server_name", p.server_name.is_some()),
            ] {
                if set {
                    return invalid(&key(field), "only meaningful for coaps+tcp:// upstreams");
                }
            }
        }
        for (field, zero) in [
            ("max_outstanding", p.max_outstanding == 0),
            ("request_timeout", p.request_timeout.is_zero()),
            ("ping_interval", p.ping_interval.is_zero()),
            ("connect_timeout", p.connect_timeout.is_zero()),
        ] {
            if zero {
                return invalid(&key(field), "must be more than 0");
            }
        }
        if !p.paths.is_empty() {
            super::multipath::check_path_list(&key("paths"), &p.paths, "proxy")?;
            if p.mptcp {
                return invalid(
                    &key("mptcp"),
                    "mptcp = true and paths exclude each other: the kernel would add subflows on every link to each path's connection (ADR 0012)",
                );
            }
            if p.path_timeout < std::time::Duration::from_millis(100) {
                return invalid(&key("path_timeout"), "must be at least 100ms");
            }
        }
        if files == Files::MustExist {
            if let Some(path) = &p.ca_file {
                check_pem(&key("ca_file"), path, Pem::Certificates)?;
            }
            if let Some(path) = &p.cert_file {
                check_pem(&key("cert_file"), path, Pem::Certificates)?;
            }
            if let Some(path) = &p.key_file {
                check_pem(&key("key_file"), path, Pem::PrivateKey)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::parse_unchecked_files;

    fn err(text: &str) -> String {
        match parse_unchecked_files(text) {
            Ok(c) => panic!("expected an error for {text:?}, got {:?}", c.coap.proxy),
            Err(e) => e.to_string(),
        }
    }

    fn proxy(fields: &str) -> String {
        format!("[[coap.proxy]]\n{fields}\n")
    }

    #[test]
    fn urls_take_coap_tcp_schemes_and_default_ports() {
        let c = parse_unchecked_files(&format!(
            "{}{}",
            proxy("name = \"a\"\nurl = \"coap+tcp://Cloud.example\"\nprefix = \"cloud\""),
            proxy(
                "name = \"b\"\nurl = \"coaps+tcp://[::1]\"\nforward = true\nca_file = \"ca.pem\""
            ),
        ))
        .unwrap();
        let a = c.coap.proxy[0].target().unwrap();
        assert_eq!(
            (a.tls, a.host.as_str(), a.port),
            (false, "cloud.example", 5683)
        );
        let b = c.coap.proxy[1].target().unwrap();
        assert_eq!((b.tls, b.host.as_str(), b.port), (true, "::1", 5684));
        let e = err(&proxy("name = \"a\"\nurl = \"coap://x\"\nprefix = \"p\""));
        assert!(e.starts_with("coap.proxy[0].url:"), "{e}");
        let e = err(&proxy(
            "name = \"a\"\nurl = \"coap+tcp://x:0\"\nprefix = \"p\"",
        ));
        assert!(e.contains("bad port"), "{e}");
        let e = err(&proxy(
            "name = \"a\"\nurl = \"coap+tcp://x/path\"\nprefix = \"p\"",
        ));
        assert!(e.contains("no path"), "{e}");
    }

    #[test]
    fn names_and_prefixes_are_unique_and_well_formed() {
        let e = err(&proxy(
            "name = \"a b\"\nurl = \"coap+tcp://x\"\nprefix = \"p\"",
        ));
        assert!(e.starts_with("coap.proxy[0].name:"), "{e}");
        let two = |n2: &str, p2: &str| {
            format!(
                "{}{}",
                proxy("name = \"a\"\nurl = \"coap+tcp://x\"\nprefix = \"p\""),
                proxy(&format!(
                    "name = \"{n2}\"\nurl = \"coap+tcp://y\"\nprefix = \"{p2}\""
                ))
            )
        };
        assert!(err(&two("a", "q")).starts_with("coap.proxy[1].name: duplicate"));
        assert!(err(&two("b", "p")).starts_with("coap.proxy[1].prefix: duplicate"));
        assert!(parse_unchecked_files(&two("b", "q")).is_ok());
        for bad in ["a/b", "", "ps", ".well-known"] {
            let e = err(&proxy(&format!(
                "name = \"a\"\nurl = \"coap+tcp://x\"\nprefix = \"{bad}\""
            )));
            assert!(e.starts_with("coap.proxy[0].prefix:"), "{bad}: {e}");
        }
        let e = err(&proxy("name = \"a\"\nurl = \"coap+tcp://x\""));
        assert!(e.contains("forward = true"), "{e}");
    }

    #[test]
    fn tls_needs_a_ca_and_plain_tcp_refuses_tls_files() {
        let e = err(&proxy(
            "name = \"a\"\nurl = \"coaps+tcp://x\"\nprefix = \"p\"",
        ));
        assert!(e.starts_with("coap.proxy[0].ca_file:"), "{e}");
        let e = err(&proxy(
            "name = \"a\"\nurl = \"coap+tcp://x\"\nprefix = \"p\"\nca_file = \"ca.pem\"",
        ));
        assert!(e.contains("only meaningful"), "{e}");
        let e = err(&proxy(
            "name = \"a\"\nurl = \"coaps+tcp://x\"\nprefix = \"p\"\nca_file = \"ca.pem\"\ncert_file = \"c.pem\"",
        ));
        assert!(e.contains("together"), "{e}");
    }

    #[test]
    fn paths_need_a_place_unique_names_and_no_mptcp() {
        let base = "name = \"a\"\nurl = \"coap+tcp://x\"\nprefix = \"p\"\n";
        let c = parse_unchecked_files(&proxy(&format!(
            "{base}paths = [{{ bind = \"10.0.1.2\" }}, {{ interface = \"wwan1\", weight = 2 }}]\npath_timeout = \"2s\""
        )))
        .unwrap();
        let p = &c.coap.proxy[0];
        assert_eq!(p.paths.len(), 2);
        assert_eq!(p.paths[1].label(1), "p1");
        assert_eq!(p.path_timeout, std::time::Duration::from_secs(2));
        let e = err(&proxy(&format!("{base}paths = [{{ name = \"x\" }}]")));
        assert!(e.starts_with("coap.proxy[0].paths[0]:"), "{e}");
        let e = err(&proxy(&format!(
            "{base}paths = [{{ bind = \"10.0.1.2\", name = \"x\" }}, {{ bind = \"10.0.2.2\", name = \"x\" }}]"
        )));
        assert!(e.contains("duplicate path name"), "{e}");
        let e = err(&proxy(&format!(
            "{base}mptcp = true\npaths = [{{ bind = \"10.0.1.2\" }}]"
        )));
        assert!(e.starts_with("coap.proxy[0].mptcp:"), "{e}");
        let e = err(&proxy(&format!(
            "{base}paths = [{{ bind = \"10.0.1.2\" }}]\npath_timeout = \"10ms\""
        )));
        assert!(e.starts_with("coap.proxy[0].path_timeout:"), "{e}");
        let e = err(&proxy(&format!(
            "{base}paths = [{{ bind = \"10.0.1.2\", mtu = 1 }}]"
        )));
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn tls_files_must_exist_when_checked() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "[[coap.proxy]]\nname = \"a\"\nurl = \"coaps+tcp://x\"\nprefix = \"p\"\nca_file = \"{}\"\n",
            dir.path().join("missing.pem").display()
        );
        let c = parse_unchecked_files(&text).unwrap();
        let e = super::check_coap_proxy(&c, super::Files::MustExist).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("coap.proxy[0].ca_file: cannot read"),
            "{e}"
        );
    }
}
