//! `sluice status`: a running gateway's overview as a compact table, once or redrawn (`--watch`,
//! like `vector top`).
//!
//! Owns: a minimal blocking HTTP/1.1 client for `GET /api/v1/overview` on the admin endpoint
//! (`http://`, or `https://` when the endpoint has `admin.cert_file`: the server certificate
//! is verified against `--ca-file`, else the system bundle, for the URL's host name or IP;
//! the bearer token read from a file), and the table's layout. Does not
//! own: the numbers (the gateway's overview, `app/overview.rs`, computed once a second there —
//! so rates are the gateway's, not differences this command takes).
//!
//! Errors say what to do: an unreachable endpoint names the address and the config key, a 401
//! names `--token-file`. A response is read up to [`MAX_RESPONSE`] bytes within [`TIMEOUT`].

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;

use serde_json::Value;

pub mod devices;

/// Longest wait for connecting, and for the whole answer.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// Largest answer read.
pub const MAX_RESPONSE: usize = 8 << 20;

/// Why the overview could not be had.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("admin URL {0:?}: expected http://host:port or https://host:port")]
    BadUrl(String),
    #[error("--ca-file is for an https:// admin URL; {0} is plain http")]
    CaFileWithoutTls(String),
    #[error("cannot use the CA for the admin endpoint: {0}")]
    Tls(String),
    #[error("TLS with the admin endpoint at {addr} failed: {source} (is it https, and does --ca-file hold the CA that signed admin.cert_file for this host name?)")]
    Handshake {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot reach the admin endpoint at {addr}: {source} (is the gateway running, and is admin.listen this address?)")]
    Unreachable {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot read the token file {path}: {source}")]
    TokenFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the admin endpoint at {0} wants a bearer token: pass --token-file (the file in admin.token_file)")]
    Unauthorized(String),
    #[error("the admin endpoint at {0} refused the token in --token-file (401)")]
    WrongToken(String),
    #[error("the admin endpoint at {addr} answered {status}: {body}")]
    Http {
        addr: String,
        status: u16,
        body: String,
    },
    #[error("the admin endpoint at {addr} sent an answer that is not HTTP or not JSON: {why}")]
    Malformed { addr: String, why: String },
}

/// Where the admin endpoint is and how to talk to it.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port`.
    pub addr: String,
    pub token: Option<String>,
    /// For `https://`: the client configuration and the name the certificate must carry.
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
}

/// One exchange's stream: plain TCP or TLS over it.
trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

impl Target {
    /// From `--admin URL` (`http://host:port`, `https://host:port`, or just `host:port`),
    /// `--token-file` and `--ca-file` (https only; default the system CA bundle).
    pub fn new(
        url: &str,
        token_file: Option<&Path>,
        ca_file: Option<&Path>,
    ) -> Result<Target, StatusError> {
        let (https, rest) = match url.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, url.strip_prefix("http://").unwrap_or(url)),
        };
        if rest.contains("://") || rest.is_empty() {
            return Err(StatusError::BadUrl(url.to_string()));
        }
        let addr = rest.trim_end_matches('/').to_string();
        if addr.contains('/') || !addr.contains(':') {
            return Err(StatusError::BadUrl(url.to_string()));
        }
        let tls = if https {
            // The host part, without the port and an IPv6 address's brackets.
            let host = addr.rsplit_once(':').map_or(&addr[..], |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let name = ServerName::try_from(host.to_string())
                .map_err(|_| StatusError::BadUrl(url.to_string()))?;
            let config =
                crate::sink::mqtt::tls::client_config(ca_file, None, None, rustls::ALL_VERSIONS)
                    .map_err(|e| StatusError::Tls(e.to_string()))?;
            Some((config, name))
        } else {
            if ca_file.is_some() {
                return Err(StatusError::CaFileWithoutTls(url.to_string()));
            }
            None
        };
        let token = match token_file {
            None => None,
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| StatusError::TokenFile {
                        path: path.to_path_buf(),
                        source,
                    })?;
                Some(text.trim().to_string())
            }
        };
        Ok(Target { addr, token, tls })
    }

    /// `GET /api/v1/overview`, parsed.
    pub fn overview(&self) -> Result<Value, StatusError> {
        let body = self.get("/api/v1/overview")?;
        serde_json::from_slice(&body).map_err(|e| StatusError::Malformed {
            addr: self.addr.clone(),
            why: e.to_string(),
        })
    }

    /// `GET /api/v1/devices?after=…&limit=…`, parsed.
    pub fn devices_page(&self, after: Option<&str>, limit: usize) -> Result<Value, StatusError> {
        let mut path = format!("/api/v1/devices?limit={limit}");
        if let Some(a) = after {
            path.push_str("&after=");
            path.push_str(&devices::encode(a));
        }
        let body = self.get(&path)?;
        serde_json::from_slice(&body).map_err(|e| StatusError::Malformed {
            addr: self.addr.clone(),
            why: e.to_string(),
        })
    }

    /// `GET path` on the admin endpoint: the body of a 200 answer (e.g. `/metrics`).
    pub fn get(&self, path: &str) -> Result<Vec<u8>, StatusError> {
        let unreachable = |source| StatusError::Unreachable {
            addr: self.addr.clone(),
            source,
        };
        let addrs: Vec<_> = self.addr.to_socket_addrs().map_err(unreachable)?.collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        let mut stream = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, TIMEOUT) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let tcp = stream.ok_or_else(|| unreachable(last))?;
        let io = |source| StatusError::Unreachable {
            addr: self.addr.clone(),
            source,
        };
        tcp.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
        tcp.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
        let mut stream: Box<dyn Stream> = match &self.tls {
            None => Box::new(tcp),
            Some((config, name)) => {
                let conn = rustls::ClientConnection::new(config.clone(), name.clone())
                    .map_err(|e| StatusError::Tls(e.to_string()))?;
                let mut tls = rustls::StreamOwned::new(conn, tcp);
                // Handshake now, so a certificate problem is named as such.
                while tls.conn.is_handshaking() {
                    tls.conn.complete_io(&mut tls.sock).map_err(|source| {
                        StatusError::Handshake {
                            addr: self.addr.clone(),
                            source,
                        }
                    })?;
                }
                Box::new(tls)
            }
        };
        let auth = self
            .token
            .as_ref()
            .map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\n{auth}Connection: close\r\n\r\n",
            self.addr
        );
        stream.write_all(request.as_bytes()).map_err(io)?;
        let mut raw = Vec::new();
        match stream.take(MAX_RESPONSE as u64).read_to_end(&mut raw) {
            Ok(_) => {}
            // A TLS peer that closes without close_notify: the answer is what arrived (its
            // framing is checked below).
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
            Err(e) => return Err(io(e)),
        }
        let malformed = |why: &str| StatusError::Malformed {
            addr: self.addr.clone(),
            why: why.to_string(),
        };
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        let head_len = match response.parse(&raw) {
            Ok(httparse::Status::Complete(n)) => n,
            _ => return Err(malformed("no complete HTTP response head")),
        };
        let status = response.code.unwrap_or(0);
        let chunked = response.headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("transfer-encoding")
                && String::from_utf8_lossy(h.value)
                    .to_ascii_lowercase()
                    .contains("chunked")
        });
        let body = if chunked {
            dechunk(&raw[head_len..]).ok_or_else(|| malformed("bad chunked body"))?
        } else {
            raw[head_len..].to_vec()
        };
        match status {
            200 => Ok(body),
            401 if self.token.is_some() => Err(StatusError::WrongToken(self.addr.clone())),
            401 => Err(StatusError::Unauthorized(self.addr.clone())),
            _ => Err(StatusError::Http {
                addr: self.addr.clone(),
                status,
                body: String::from_utf8_lossy(&body)
                    .trim()
                    .chars()
                    .take(200)
                    .collect(),
            }),
        }
    }
}

fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&raw[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

// ----- the table -----

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn int(v: &Value) -> String {
    f(v).map_or("-".into(), |x| format!("{}", x.round() as i64))
}

fn rate(v: &Value) -> String {
    match f(v) {
        None => "-".into(),
        Some(x) if x >= 100.0 || x == 0.0 => format!("{}", x.round() as i64),
        Some(x) => format!("{x:.1}"),
    }
}

fn bytes(v: &Value) -> String {
    let Some(mut x) = f(v) else {
        return "-".into();
    };
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut i = 0;
    while x >= 1024.0 && i < units.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{x:.0} B")
    } else {
        format!("{x:.1} {}", units[i])
    }
}

fn secs(v: &Value) -> String {
    match f(v) {
        None => "-".into(),
        Some(x) if x < 1.0 => format!("{:.0}ms", x * 1000.0),
        Some(x) if x < 120.0 => format!("{x:.1}s"),
        Some(x) => format!("{:.0}m", x / 60.0),
    }
}

fn ms(v: &Value) -> String {
    match f(v) {
        None => "-".into(),
        Some(x) if x < 10.0 => format!("{x:.2}ms"),
        Some(x) => format!("{x:.0}ms"),
    }
}

fn uptime(s: u64) -> String {
    let (d, h, m) = (s / 86400, s / 3600 % 24, s / 60 % 60);
    if d > 0 {
        format!("{d}d{h:02}h{m:02}m")
    } else {
        format!("{h}h{m:02}m{:02}s", s % 60)
    }
}

/// The overview as a compact table (at most ~100 columns).
pub fn render(doc: &Value, addr: &str) -> String {
    let mut o = String::new();
    let shards = doc["shards"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(
        o,
        "sluice {} {} at {} · up {} · {} shard{}",
        doc["version"].as_str().unwrap_or("?"),
        doc["gateway"].as_str().unwrap_or("?"),
        addr,
        uptime(doc["uptime_seconds"].as_u64().unwrap_or(0)),
        shards.len(),
        if shards.len() == 1 { "" } else { "s" }
    );
    let d = &doc["devices"];
    let total: i64 = ["mqtt", "coap", "coap_dtls", "phd"]
        .iter()
        .map(|k| d[k].as_i64().unwrap_or(0))
        .sum();
    let _ = writeln!(
        o,
        "\nDEVICES  {total}   mqtt {}  coap {}  coap-dtls {}  phd {}",
        int(&d["mqtt"]),
        int(&d["coap"]),
        int(&d["coap_dtls"]),
        int(&d["phd"])
    );
    let per_shard: Vec<String> = shards
        .iter()
        .map(|s| {
            let n: i64 = ["mqtt", "coap", "coap_dtls", "phd"]
                .iter()
                .map(|k| s[k].as_i64().unwrap_or(0))
                .sum();
            format!("{}:{}", s["shard"], n)
        })
        .collect();
    if shards.len() > 1 {
        let _ = writeln!(o, "  per shard  {}", per_shard.join("  "));
    }

    let t = &doc["traffic"];
    let _ = writeln!(
        o,
        "\n{:<20} {:>10} {:>12} {:>14}",
        "TRAFFIC", "msg/s", "bytes/s", "messages"
    );
    for (label, key) in [
        ("devices → sluice", "device_in"),
        ("sluice → devices", "device_out"),
        ("sluice → cloud", "cloud_out"),
        ("cloud acks", "cloud_acked"),
        ("cloud → sluice", "cloud_in"),
    ] {
        let flow = &t[key];
        let bps = if flow["bytes_per_second"].is_null() {
            "-".to_string()
        } else {
            format!("{}/s", bytes(&flow["bytes_per_second"]))
        };
        let _ = writeln!(
            o,
            "  {:<18} {:>10} {:>12} {:>14}",
            label,
            rate(&flow["messages_per_second"]),
            bps,
            int(&flow["messages_total"])
        );
    }

    let uplinks = doc["uplinks"].as_array().cloned().unwrap_or_default();
    if uplinks.is_empty() {
        let _ = writeln!(o, "\nUPLINKS  none configured");
    } else {
        let _ = writeln!(
            o,
            "\n{:<16} {:<18} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>8}",
            "UPLINK",
            "STATE",
            "sent/s",
            "acked/s",
            "inflight",
            "queued",
            "oldest",
            "ack p50",
            "ack p99"
        );
        for u in &uplinks {
            let lanes = u["lanes"].as_array().cloned().unwrap_or_default();
            for l in &lanes {
                let name = if lanes.len() > 1 {
                    format!(
                        "{}/{}",
                        u["name"].as_str().unwrap_or("?"),
                        l["lane"].as_str().unwrap_or("?")
                    )
                } else {
                    u["name"].as_str().unwrap_or("?").to_string()
                };
                let state = format!(
                    "{} {}/{}",
                    l["state"].as_str().unwrap_or("?"),
                    l["connected_shards"],
                    l["shards"]
                );
                let _ = writeln!(
                    o,
                    "  {:<14} {:<18} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>8}",
                    name,
                    state,
                    rate(&l["sent_per_second"]),
                    rate(&l["acked_per_second"]),
                    int(&l["inflight"]),
                    int(&l["queued"]),
                    secs(&l["queue_oldest_age_seconds"]),
                    ms(&l["ack_latency"]["p50_ms"]),
                    ms(&l["ack_latency"]["p99_ms"]),
                );
                // A cluster uplink (`urls`): which nodes the sessions are on, once that says
                // more than the one url would (several nodes, or a failover happened).
                let nodes = l["nodes"].as_array().cloned().unwrap_or_default();
                let failovers = l["failovers"].as_u64().unwrap_or(0);
                if nodes.len() > 1 || failovers > 0 {
                    let list: Vec<String> = nodes
                        .iter()
                        .map(|n| format!("{} x{}", n["node"].as_str().unwrap_or("?"), n["shards"]))
                        .collect();
                    let _ = writeln!(
                        o,
                        "    nodes {}   failovers {failovers}",
                        if list.is_empty() {
                            "-".to_string()
                        } else {
                            list.join(", ")
                        },
                    );
                }
                for p in l["paths"].as_array().into_iter().flatten() {
                    let _ = writeln!(
                        o,
                        "    path {:<9} {:<18} {:>8} {:>8} {:>8}   srtt {}",
                        p["name"].as_str().unwrap_or("?"),
                        format!("up {}/{}", p["up_shards"], p["shards"]),
                        rate(&p["sent_per_second"]),
                        rate(&p["acked_per_second"]),
                        int(&p["inflight"]),
                        ms(&p["srtt_ms"]),
                    );
                }
            }
            // A reload added or removed it (ADR 0013): its lifecycle and stable id.
            let lifecycle = u["lifecycle"].as_str().unwrap_or("running");
            if lifecycle != "running" {
                let _ = writeln!(
                    o,
                    "    lifecycle {lifecycle} (id {}, {} acknowledged unsent)",
                    u["id"],
                    int(&u["removed_unsent"]),
                );
            }
        }
    }

    let series = &doc["series"];
    let mut q = format!("\nQUEUE    {} queued", int(&series["queued"]));
    let spool = &doc["spool"];
    if spool.is_null() {
        q.push_str(" · no spool");
    } else {
        let at_least = if spool["oldest_age_basis"] == "at_least" {
            "≥"
        } else {
            ""
        };
        let _ = write!(
            q,
            " · SPOOL {} unacked ({} backlog, {}), oldest {at_least}{}",
            int(&spool["unacked_records"]),
            int(&spool["backlog_records"]),
            bytes(&spool["bytes"]),
            secs(&spool["oldest_age_seconds"])
        );
        match spool["stalled"].as_str() {
            Some("no_space") => q.push_str(" · STALLED: disk full, new messages refused"),
            Some("read_only") => q.push_str(" · STALLED: disk read-only, new messages refused"),
            _ => {}
        }
    }
    let _ = writeln!(o, "{q}");

    let drops = &doc["drops"];
    let _ = write!(
        o,
        "DROPS    {}/s, {} total",
        rate(&drops["per_second"]),
        int(&drops["total"])
    );
    let reasons: Vec<String> = drops["by_reason"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            format!(
                "{}:{} {}",
                r["where"].as_str().unwrap_or("?"),
                r["reason"].as_str().unwrap_or("?"),
                int(&r["total"])
            )
        })
        .collect();
    if !reasons.is_empty() {
        let _ = write!(o, " ({})", reasons.join(", "));
    }
    o.push('\n');

    if let Some(phd) = doc["phd"].as_object() {
        let _ = writeln!(
            o,
            "PHD      {} agents, {} configs, {} obs/s",
            int(&phd["agents"]),
            int(&phd["configs"]),
            rate(&phd["observations_per_second"])
        );
    }
    for fun in doc["functions"].as_array().into_iter().flatten() {
        let instances = fun["instances"].as_array().map_or(0, |i| i.len());
        let _ = writeln!(
            o,
            "FUNCTION {} ({}): {} events/s, {} inflight, {} queued, {} instances, {} dead letters",
            fun["name"].as_str().unwrap_or("?"),
            fun["kind"].as_str().unwrap_or("?"),
            rate(&fun["events_per_second"]),
            int(&fun["inflight"]),
            int(&fun["queued"]),
            instances,
            int(&fun["dead_letters"])
        );
    }
    let proxies = doc["coap_proxy"].as_array().cloned().unwrap_or_default();
    if !proxies.is_empty() {
        let connected = proxies.iter().filter(|p| p["state"] == "connected").count();
        let _ = writeln!(
            o,
            "COAP PROXY {connected}/{} upstream connections up",
            proxies.len()
        );
    }
    o
}

/// What `sluice status` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Show {
    /// Each gateway's overview table.
    Overview,
    /// Which gateway holds which device (`--devices`).
    Devices,
}

/// One screen for every target, and an error line per target that did not answer.
fn screen(targets: &[Target], show: Show) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut errors = Vec::new();
    let mut held = Vec::new();
    for target in targets {
        let asked = match show {
            Show::Overview => target.overview().map(|doc| {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(&render(&doc, &target.addr));
            }),
            Show::Devices => devices::fetch(target).map(|d| held.push(d)),
        };
        if let Err(error) = asked {
            errors.push(format!("sluice status: {error}"));
        }
    }
    if show == Show::Devices && !held.is_empty() {
        out.push_str(&devices::render(&held));
    }
    (out, errors)
}

/// Runs `sluice status` for one or several gateways: prints once, or with `watch` redraws
/// every `interval` until killed. Returns the process's exit code: 0 printed, 1 when (not
/// watching) a gateway could not be asked (what the others answered is still printed; the
/// errors go to standard error).
pub fn run(targets: &[Target], show: Show, watch: Option<Duration>) -> i32 {
    match watch {
        None => {
            let (text, errors) = screen(targets, show);
            print!("{text}");
            for e in &errors {
                eprintln!("{e}");
            }
            i32::from(!errors.is_empty())
        }
        Some(interval) => loop {
            let (mut screen, errors) = screen(targets, show);
            for e in &errors {
                let _ = writeln!(screen, "{e}");
            }
            if !errors.is_empty() {
                let _ = writeln!(screen, "(retrying every {interval:?})");
            }
            // Home, clear, draw: one write so the terminal never shows half a table.
            let mut out = std::io::stdout().lock();
            let _ = write!(out, "\x1b[H\x1b[2J{screen}");
            let _ = out.flush();
            drop(out);
            std::thread::sleep(interval);
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_host_and_port_over_http_or_https() {
        assert_eq!(
            Target::new("http://127.0.0.1:9100/", None, None)
                .unwrap()
                .addr,
            "127.0.0.1:9100"
        );
        assert_eq!(
            Target::new("localhost:9100", None, None).unwrap().addr,
            "localhost:9100"
        );
        let pki = sluice_testkit::TestPki::generate();
        let t = Target::new("https://[::1]:9100", None, Some(pki.ca_path())).unwrap();
        assert_eq!(t.addr, "[::1]:9100");
        assert!(t.tls.is_some());
        for bad in ["ftp://gw:9100", "http://gw", "https://gw:9100/api", ""] {
            assert!(
                matches!(Target::new(bad, None, None), Err(StatusError::BadUrl(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            Target::new("http://gw:9100", None, Some(pki.ca_path())),
            Err(StatusError::CaFileWithoutTls(_))
        ));
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert!(dechunk(b"5\r\nab").is_none());
    }

    #[test]
    fn an_unreachable_gateway_is_a_clear_error() {
        // A port nothing listens on: bind one, learn it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t = Target::new(&format!("http://127.0.0.1:{port}"), None, None).unwrap();
        let e = t.overview().unwrap_err().to_string();
        assert!(
            e.contains("cannot reach the admin endpoint") && e.contains("admin.listen"),
            "{e}"
        );
    }

    #[test]
    fn the_table_shows_devices_traffic_uplinks_queue_and_drops() {
        let doc = serde_json::json!({
            "version": "0.1.0", "uptime_seconds": 3725,
            "devices": {"registered": 3, "mqtt": 3, "coap": 1, "coap_dtls": 0, "phd": 2},
            "shards": [{"shard": 0, "mqtt": 2, "coap": 1, "coap_dtls": 0, "phd": 0},
                       {"shard": 1, "mqtt": 1, "coap": 0, "coap_dtls": 0, "phd": 2}],
            "traffic": {"device_in": {"messages_total": 5000, "messages_per_second": 30.0,
                                      "bytes_total": 1_000_000, "bytes_per_second": 2048.0}},
            "uplinks": [{"name": "cloud", "lanes": [{"lane": "normal", "state": "connected",
                "connected_shards": 2, "shards": 2, "sent_per_second": 30.0, "inflight": 4,
                "queued": 1, "queue_oldest_age_seconds": 0.004,
                "ack_latency": {"p50_ms": 1.0, "p99_ms": 5.0}, "paths": []}]}],
            "series": {"queued": 1},
            "spool": null,
            "drops": {"total": 7, "per_second": 0.5, "by_reason": [
                {"where": "router", "reason": "uplink_queue_full", "total": 7, "per_second": 0.5}]},
            "functions": [], "coap_proxy": [], "phd": null,
        });
        let text = render(&doc, "127.0.0.1:9100");
        for want in [
            "up 1h02m05s",
            "DEVICES  6",
            "per shard  0:3  1:3",
            "devices → sluice",
            "2.0 KiB/s",
            "connected 2/2",
            "5.00ms",
            "no spool",
            "router:uplink_queue_full 7",
        ] {
            assert!(text.contains(want), "{want:?} missing in\n{text}");
        }
        assert!(text.lines().all(|l| l.chars().count() <= 100), "{text}");
    }

    #[test]
    fn an_uplink_a_reload_removed_shows_its_lifecycle_and_id() {
        let doc = serde_json::json!({
            "uplinks": [{"name": "old", "id": 3, "lifecycle": "removed", "removed_unsent": 12,
                "lanes": [{"lane": "normal", "state": "disconnected", "connected_shards": 0,
                "shards": 2, "paths": []}]}],
        });
        let text = render(&doc, "127.0.0.1:9100");
        assert!(
            text.contains("lifecycle removed (id 3, 12 acknowledged unsent)"),
            "{text}"
        );
    }

    #[test]
    fn a_cluster_uplink_shows_the_nodes_its_shards_are_on_and_its_failovers() {
        let doc = serde_json::json!({
            "uplinks": [{"name": "cloud", "lanes": [{"lane": "normal", "state": "connected",
                "connected_shards": 2, "shards": 2, "paths": [], "failovers": 1,
                "nodes": [{"node": "mqtts://b:8883", "shards": 2}]}]},
                {"name": "single", "lanes": [{"lane": "normal", "state": "connected",
                "connected_shards": 2, "shards": 2, "paths": [], "failovers": 0,
                "nodes": [{"node": "mqtts://one:8883", "shards": 2}]}]}],
        });
        let text = render(&doc, "127.0.0.1:9100");
        assert!(
            text.contains("nodes mqtts://b:8883 x2   failovers 1"),
            "{text}"
        );
        assert!(
            !text.contains("mqtts://one"),
            "one url and no failover: no node line\n{text}"
        );
    }
}
