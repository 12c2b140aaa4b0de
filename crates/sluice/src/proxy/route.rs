//! Which upstream a device's request is for, and the request as that upstream must see it:
//! reverse proxy by the first Uri-Path segment, forward proxy (RFC 7252 §5.7.2) by
//! Proxy-Uri or Proxy-Scheme + Uri-Host/Uri-Port.
//!
//! Owns: the matching rules and the rewriting. Does not own: the connection (`conn.rs`).
//! Invariant: a request with Proxy-Uri or Proxy-Scheme is always claimed (routed or refused
//! with 5.05): sluice never serves it itself and never proxies to a server not configured.

use bytes::Bytes;
use sluice_proto::coap::{opt, Code, Message};

use crate::config::{CoapProxyConfig, ProxyTarget};

/// How the request is rewritten for the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rewrite {
    /// Reverse proxy: drop the first Uri-Path segment (the prefix).
    StripPrefix,
    /// Forward proxy: drop Proxy-Uri/Proxy-Scheme/Uri-Host/Uri-Port and set this path and
    /// query.
    Forward { path: Vec<Bytes>, query: Vec<Bytes> },
}

/// One configured upstream as routing sees it.
#[derive(Debug, Clone)]
pub struct RouteEntry {
    pub prefix: Option<String>,
    pub forward: bool,
    pub target: Option<ProxyTarget>,
}

impl RouteEntry {
    pub fn new(cfg: &CoapProxyConfig) -> RouteEntry {
        RouteEntry {
            prefix: cfg.prefix.clone(),
            forward: cfg.forward,
            // Validated at load; an unparsable url cannot be named by a Proxy-Uri.
            target: cfg.target().ok(),
        }
    }
}

/// Options this proxy understands; an unsafe option outside this list refuses the request
/// with 4.02 (RFC 7252 §5.7.1).
const KNOWN: [u16; 20] = [
    opt::IF_MATCH,
    opt::URI_HOST,
    opt::ETAG,
    opt::IF_NONE_MATCH,
    opt::OBSERVE,
    opt::URI_PORT,
    opt::LOCATION_PATH,
    opt::URI_PATH,
    opt::CONTENT_FORMAT,
    opt::MAX_AGE,
    opt::URI_QUERY,
    opt::ACCEPT,
    opt::LOCATION_QUERY,
    opt::BLOCK2,
    opt::BLOCK1,
    opt::SIZE2,
    opt::PROXY_URI,
    opt::PROXY_SCHEME,
    opt::SIZE1,
    opt::NO_RESPONSE,
];

/// The upstream index and rewrite for `req`, `None` when it is not for the proxy.
pub fn route(entries: &[RouteEntry], req: &Message) -> Option<Result<(usize, Rewrite), Code>> {
    if !req.code.is_request() {
        return None;
    }
    let routed = if let Some(uri) = req.option(opt::PROXY_URI) {
        Some(forward_uri(entries, uri))
    } else if let Some(scheme) = req.option(opt::PROXY_SCHEME) {
        Some(forward_scheme(entries, req, scheme))
    } else {
        let first = req.uri_path().next()?;
        let i = entries
            .iter()
            .position(|e| e.prefix.as_deref().map(str::as_bytes) == Some(first.as_ref()))?;
        Some(Ok((i, Rewrite::StripPrefix)))
    };
    match routed {
        Some(Ok(r)) => {
            let unknown_unsafe = req
                .options
                .iter()
                .any(|o| opt::is_unsafe(o.number) && !KNOWN.contains(&o.number));
            Some(if unknown_unsafe {
                Err(Code::BAD_OPTION)
            } else {
                Ok(r)
            })
        }
        other => other,
    }
}

/// Apply `rewrite` to `req`: the request as the upstream sees it.
pub fn rewrite(mut req: Message, rewrite: Rewrite) -> Message {
    match rewrite {
        Rewrite::StripPrefix => {
            if let Some(i) = req.options.iter().position(|o| o.number == opt::URI_PATH) {
                req.options.remove(i);
            }
        }
        Rewrite::Forward { path, query } => {
            for n in [
                opt::PROXY_URI,
                opt::PROXY_SCHEME,
                opt::URI_HOST,
                opt::URI_PORT,
                opt::URI_PATH,
                opt::URI_QUERY,
            ] {
                req.remove_option(n);
            }
            for p in path {
                req.add_option(opt::URI_PATH, p);
            }
            for q in query {
                req.add_option(opt::URI_QUERY, q);
            }
        }
    }
    // The proxy relays one response per request; it does not relay notifications.
    req.remove_option(opt::OBSERVE);
    req
}

fn find_forward(
    entries: &[RouteEntry],
    scheme: &str,
    host: &str,
    port: Option<u16>,
) -> Option<usize> {
    let host = host.to_ascii_lowercase();
    entries.iter().position(|e| {
        e.forward
            && e.target.as_ref().is_some_and(|t| {
                t.scheme() == scheme
                    && t.host == host
                    && t.port == port.unwrap_or(if t.tls { 5684 } else { 5683 })
            })
    })
}

fn forward_uri(entries: &[RouteEntry], uri: &Bytes) -> Result<(usize, Rewrite), Code> {
    let uri = std::str::from_utf8(uri).map_err(|_| Code::BAD_OPTION)?;
    let (scheme, rest) = uri.split_once("://").ok_or(Code::BAD_OPTION)?;
    let scheme = scheme.to_ascii_lowercase();
    let (authority, path_query) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let (host, port) = split_authority(authority)?;
    let i = find_forward(entries, &scheme, host, port).ok_or(Code::PROXYING_NOT_SUPPORTED)?;
    let (path, query) = match path_query.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path_query, None),
    };
    let path = path
        .split('/')
        .skip(1) // before the leading '/'
        .filter(|s| !s.is_empty())
        .map(percent_decode)
        .collect::<Result<Vec<_>, _>>()?;
    let query = query
        .map(|q| {
            q.split('&')
                .filter(|s| !s.is_empty())
                .map(percent_decode)
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?
        .unwrap_or_default();
    Ok((i, Rewrite::Forward { path, query }))
}

fn forward_scheme(
    entries: &[RouteEntry],
    req: &Message,
    scheme: &Bytes,
) -> Result<(usize, Rewrite), Code> {
    let scheme = std::str::from_utf8(scheme)
        .map_err(|_| Code::BAD_OPTION)?
        .to_ascii_lowercase();
    let host = req
        .option(opt::URI_HOST)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or(Code::PROXYING_NOT_SUPPORTED)?;
    let port = match req.option(opt::URI_PORT) {
        Some(_) => Some(
            req.uint_option(opt::URI_PORT)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or(Code::BAD_OPTION)?,
        ),
        None => None,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let i = find_forward(entries, &scheme, host, port).ok_or(Code::PROXYING_NOT_SUPPORTED)?;
    Ok((
        i,
        Rewrite::Forward {
            path: req.uri_path().cloned().collect(),
            query: req.options_of(opt::URI_QUERY).cloned().collect(),
        },
    ))
}

fn split_authority(authority: &str) -> Result<(&str, Option<u16>), Code> {
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or(Code::BAD_OPTION)?;
        (h, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => Some(p.parse::<u16>().map_err(|_| Code::BAD_OPTION)?),
        None => None,
    };
    if host.is_empty() {
        return Err(Code::BAD_OPTION);
    }
    Ok((host, port))
}

fn percent_decode(s: &str) -> Result<Bytes, Code> {
    sluice_proto::uri::percent_decode(s)
        .map(Bytes::from)
        .ok_or(Code::BAD_OPTION)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::coap::{MsgType, Token};

    fn entries() -> Vec<RouteEntry> {
        let cfg = |name: &str, url: &str, prefix: Option<&str>, forward: bool| CoapProxyConfig {
            name: name.into(),
            url: url.into(),
            prefix: prefix.map(Into::into),
            forward,
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            max_outstanding: 1,
            max_waiting: 1,
            request_timeout: std::time::Duration::from_secs(1),
            ping_interval: std::time::Duration::from_secs(1),
            connect_timeout: std::time::Duration::from_secs(1),
            mptcp: false,
            paths: Vec::new(),
            path_timeout: std::time::Duration::from_secs(3),
        };
        vec![
            RouteEntry::new(&cfg("a", "coap+tcp://cloud.example", Some("cloud"), false)),
            RouteEntry::new(&cfg("b", "coaps+tcp://10.0.0.9:6000", None, true)),
        ]
    }

    fn get(path: &[&str]) -> Message {
        let mut m = Message::new(MsgType::Con, Code::GET, 1, Token::EMPTY);
        for p in path {
            m.add_option(opt::URI_PATH, Bytes::copy_from_slice(p.as_bytes()));
        }
        m
    }

    fn path_of(m: &Message) -> Vec<&[u8]> {
        m.uri_path().map(|p| p.as_ref()).collect()
    }

    #[test]
    fn a_prefix_routes_and_is_stripped() {
        let e = entries();
        let req = get(&["cloud", "sensors", "t"]);
        let (i, rw) = route(&e, &req).unwrap().unwrap();
        assert_eq!((i, &rw), (0, &Rewrite::StripPrefix));
        let up = rewrite(req, rw);
        assert_eq!(path_of(&up), vec![&b"sensors"[..], b"t"]);
        assert!(route(&e, &get(&["ps", "x"])).is_none());
        assert!(route(&e, &get(&[])).is_none());
    }

    #[test]
    fn proxy_uri_naming_a_forward_upstream_is_rewritten() {
        let e = entries();
        let mut req = get(&[]);
        req.add_option(
            opt::PROXY_URI,
            &b"coaps+tcp://10.0.0.9:6000/a%20b/c?x=1&y"[..],
        );
        let (i, rw) = route(&e, &req).unwrap().unwrap();
        assert_eq!(i, 1);
        let up = rewrite(req, rw);
        assert_eq!(path_of(&up), vec![&b"a b"[..], b"c"]);
        let q: Vec<&[u8]> = up.options_of(opt::URI_QUERY).map(|q| q.as_ref()).collect();
        assert_eq!(q, vec![&b"x=1"[..], b"y"]);
        assert!(up.option(opt::PROXY_URI).is_none());
    }

    #[test]
    fn proxy_uri_naming_anything_else_is_5_05() {
        let e = entries();
        for uri in [
            "coap+tcp://cloud.example/x", // configured, but not forward = true
            "coap://10.0.0.9:6000/x",
            "coaps+tcp://10.0.0.9/x", // default port 5684, not 6000
            "http://example.com/",
        ] {
            let mut req = get(&[]);
            req.add_option(opt::PROXY_URI, Bytes::copy_from_slice(uri.as_bytes()));
            assert_eq!(
                route(&e, &req),
                Some(Err(Code::PROXYING_NOT_SUPPORTED)),
                "{uri}"
            );
        }
        assert!(route(&[], &{
            let mut r = get(&[]);
            r.add_option(opt::PROXY_URI, &b"coap+tcp://x/"[..]);
            r
        })
        .is_some());
    }

    #[test]
    fn proxy_scheme_uses_uri_host_and_port() {
        let e = entries();
        let mut req = get(&["r"]);
        req.add_option(opt::URI_HOST, &b"10.0.0.9"[..]);
        req.add_uint_option(opt::URI_PORT, 6000);
        req.add_option(opt::PROXY_SCHEME, &b"coaps+tcp"[..]);
        let (i, rw) = route(&e, &req).unwrap().unwrap();
        assert_eq!(i, 1);
        let up = rewrite(req, rw);
        assert_eq!(path_of(&up), vec![&b"r"[..]]);
        assert!(up.option(opt::URI_HOST).is_none() && up.option(opt::PROXY_SCHEME).is_none());
    }

    #[test]
    fn unknown_unsafe_options_are_4_02() {
        let e = entries();
        let mut req = get(&["cloud", "x"]);
        req.add_option(2, &b"?"[..]); // unsafe, unknown
        assert_eq!(route(&e, &req), Some(Err(Code::BAD_OPTION)));
        let mut req = get(&["cloud", "x"]);
        req.add_option(2052, &b"?"[..]); // safe-to-forward (bit 1 clear): passed on
        assert!(matches!(route(&e, &req), Some(Ok(_))));
    }
}
