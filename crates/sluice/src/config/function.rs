//! `[[function]]`: edge functions — topics routed to an HTTP function as CloudEvents, run
//! locally (a process sluice starts on demand and stops when idle) or remotely (`url`: a
//! Knative Service, a Knative Broker ingress, any HTTP server).
//!
//! Owns: the config type, its defaults and the sink entry each function becomes
//! ([`FunctionConfig::sink_entry`]). Does not own: the checks (`validate/function.rs`), the
//! dispatcher (`crate::sink::http`) or the local runtime and autoscaler (`crate::functions`).
//!
//! A function is a sink like an uplink: at start-up every `[[function]]` becomes one more
//! entry of the runtime's uplink list (named `function.{name}`, so it can never collide with
//! an uplink, whose names have no dot), with its own outbox, queue, spool and metrics.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units;

/// Prefix of the sink name of a function (`function.{name}`).
pub const FUNCTION_SINK_PREFIX: &str = "function.";

/// The dead-letter topic of a function (`$sluice/dlq/{name}`): events that failed every
/// attempt are published there, to local subscribers only (a `$` topic matches no `#`).
pub fn dead_letter_topic(name: &str) -> String {
    format!("$sluice/dlq/{name}")
}

/// When an instance is started before an event needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Prewarm {
    /// Never: an instance starts on the first event after it was stopped (cold start), and
    /// is stopped after `idle` without events.
    #[default]
    Off,
    /// Learnt per function from its arrivals: the histogram-of-idle-times policy (Shahrad
    /// et al., ATC '20; `functions::predict::histogram`).
    Predict,
    /// Learnt per function: gradient-boosted trees on recent per-interval event counts
    /// (`functions::predict::gbdt`).
    Gbdt,
}

/// How a local instance gets its listening socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SocketMode {
    /// Knative's runtime contract first (default): the instance may bind `$PORT` itself (as
    /// `python -m http.server`, Flask or Express do) or take the socket sluice offers as fd 3;
    /// sluice finds out which. If the command says it takes fd 3 (an argument `fd://3`, as in
    /// `gunicorn --bind fd://3`, or `--fd 3` / `--fd=3`, as in `uvicorn --fd 3`), it is
    /// `Inherit` from the first start. Otherwise the first instance gets both — a listening
    /// socket as fd 3 (`LISTEN_FDS=1`, `LISTEN_PID`) and `PORT` naming another, free port —
    /// and whichever it serves first (its accept queue on fd 3 drains, or `$PORT` accepts a
    /// connection) decides the mode of every later instance of this run of sluice.
    #[default]
    Auto,
    /// sluice binds `127.0.0.1:{port}` and hands the listening socket to the instance as fd 3
    /// (systemd socket activation: `LISTEN_FDS=1`, `LISTEN_PID`; `PORT` is the same port).
    /// Requests queue in the kernel while the instance starts: no readiness polling. A
    /// program that binds `$PORT` itself fails with "Address already in use" in this mode.
    Inherit,
    /// The instance binds `$PORT` itself (Knative's runtime contract); sluice learns it is up
    /// by connecting, retrying with backoff only while the instance starts.
    Port,
}

impl SocketMode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketMode::Auto => "auto",
            SocketMode::Inherit => "inherit",
            SocketMode::Port => "port",
        }
    }
}

/// True if `command`'s arguments say the program serves on an inherited fd 3: an argument
/// `fd://3` (or ending in `=fd://3`: gunicorn's `--bind`), or `--fd 3` / `--fd=3` (uvicorn).
pub fn command_takes_fd3(command: &[String]) -> bool {
    command.iter().enumerate().any(|(i, a)| {
        a == "fd://3"
            || a.ends_with("=fd://3")
            || a == "--fd=3"
            || (a == "--fd" && command.get(i + 1).is_some_and(|n| n == "3"))
    })
}

/// One `[[function]]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionConfig {
    /// Unique among functions, `[a-zA-Z0-9_-]+`; a metric label and the dead-letter topic's
    /// last level.
    pub name: String,
    /// MQTT topic filters whose messages are sent to the function (from any device protocol).
    pub topics: Vec<String>,
    /// A local function: the program and its arguments, started on demand. Relative paths in
    /// the arguments are the program's business; the working directory is `dir` (default:
    /// the config file's directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// A remote function: `http://host[:port][/path]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Working directory of a local function's instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Extra environment of a local function's instances (beside `PORT`, `K_SERVICE`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// How a local instance gets its socket (see [`SocketMode`]).
    #[serde(default)]
    pub socket: SocketMode,
    /// Requests in flight per instance (Knative's container concurrency); a remote function
    /// takes `concurrency × max_instances` in flight.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Most instances of a local function at once.
    #[serde(default = "default_max_instances")]
    pub max_instances: usize,
    /// Instances kept running even without events; 0 = scale to zero.
    #[serde(default)]
    pub min_instances: usize,
    /// An instance without a request for this long is stopped (down to `min_instances`).
    #[serde(default = "default_idle", with = "units::duration")]
    pub idle: Duration,
    #[serde(default)]
    pub prewarm: Prewarm,
    /// Longest wait for a function's answer to one event (its start-up included for the first
    /// event of a cold instance: see `start_timeout`).
    #[serde(default = "default_timeout", with = "units::duration")]
    pub timeout: Duration,
    /// Longest wait for a starting instance to answer its first request.
    #[serde(default = "default_start_timeout", with = "units::duration")]
    pub start_timeout: Duration,
    /// Attempts after the first; then the event is dead-lettered.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Wait before the first retry; doubles per retry up to `retry_max`.
    #[serde(default = "default_retry_min", with = "units::duration")]
    pub retry_min: Duration,
    #[serde(default = "default_retry_max", with = "units::duration")]
    pub retry_max: Duration,
    /// Time between SIGTERM and SIGKILL when an instance is stopped.
    #[serde(default = "default_grace", with = "units::duration")]
    pub grace: Duration,
    /// Where a 2xx answer's body is published (`{topic}`: the event's topic, `{device}`: its
    /// device, `{function}`: the name); `""` (default) discards answers.
    #[serde(default)]
    pub reply_topic: String,
}

fn default_concurrency() -> usize {
    8
}
fn default_max_instances() -> usize {
    4
}
fn default_idle() -> Duration {
    Duration::from_secs(60)
}
fn default_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_start_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_retries() -> u32 {
    3
}
fn default_retry_min() -> Duration {
    Duration::from_millis(100)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(10)
}
fn default_grace() -> Duration {
    Duration::from_secs(5)
}

impl FunctionConfig {
    /// The name of the sink this function becomes (`function.{name}`).
    pub fn sink_name(&self) -> String {
        format!("{FUNCTION_SINK_PREFIX}{}", self.name)
    }

    /// A local function (started by sluice) rather than a remote `url`.
    pub fn is_local(&self) -> bool {
        self.command.is_some()
    }

    /// Requests in flight at once over the whole gateway.
    pub fn max_in_flight(&self) -> usize {
        self.concurrency.max(1) * self.max_instances.max(1)
    }

    /// The uplink-list entry this function becomes: an outbox whose transport is the
    /// function dispatcher. Its url is the function's (or a loopback placeholder for a local
    /// function: the dispatcher connects to instances, not to it). Only for validated configs.
    pub fn sink_entry(self: &Arc<Self>) -> super::UplinkConfig {
        let url = match self.remote() {
            Some(Ok(r)) => format!("http://{}:{}", bracket(&r.host), r.port),
            _ => "http://127.0.0.1:9".into(),
        };
        let mut table = toml::Table::new();
        table.insert("name".into(), self.sink_name().into());
        table.insert("url".into(), url.into());
        table.insert("allow_plaintext".into(), true.into());
        table.insert(
            "forward".into(),
            toml::Value::Array(self.topics.iter().map(|t| t.clone().into()).collect()),
        );
        table.insert(
            "inflight".into(),
            (self.max_in_flight().min(u16::MAX as usize) as i64).into(),
        );
        let mut entry: super::UplinkConfig = toml::Value::Table(table)
            .try_into()
            .expect("a function's sink entry is a valid uplink table");
        entry.function = Some(self.clone());
        entry
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// A remote function's address, from `url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    /// A DNS name or IP address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
    /// The request path, `/` at least (query included).
    pub path: String,
}

impl RemoteUrl {
    /// The `Host` header value.
    pub fn host_header(&self) -> String {
        if self.port == 80 {
            bracket(&self.host)
        } else {
            format!("{}:{}", bracket(&self.host), self.port)
        }
    }
}

impl FunctionConfig {
    /// `url` parsed (`None` for a local function).
    pub fn remote(&self) -> Option<Result<RemoteUrl, String>> {
        self.url.as_deref().map(parse_remote_url)
    }
}

/// Parses `http://host[:port][/path]`. https is refused with the reason (not supported yet).
pub fn parse_remote_url(s: &str) -> Result<RemoteUrl, String> {
    let Some((scheme, rest)) = s.split_once("://") else {
        return Err("expected http://host[:port][/path]".into());
    };
    match scheme.to_ascii_lowercase().as_str() {
        "http" => {}
        "https" => {
            return Err("https:// function urls are not supported yet; reach the function over http:// (inside a cluster, or through a local TLS-terminating proxy)".into())
        }
        _ => return Err("the scheme must be http://".into()),
    }
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_owned()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_owned()),
    };
    if authority.contains('@') {
        return Err("credentials do not belong in the url".into());
    }
    if path.contains('#') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err("the path may not hold a fragment, spaces or control characters".into());
    }
    let (host, port) = if let Some(b) = authority.strip_prefix('[') {
        let end = b.find(']').ok_or("missing ']' after the IPv6 address")?;
        let port = match &b[end + 1..] {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or("expected ':port' after ']'")?),
        };
        (b[..end].to_owned(), port)
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (authority.to_owned(), None),
        }
    };
    if host.is_empty() {
        return Err("the host is missing".into());
    }
    let port = match port {
        None => 80,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or("the port must be 1-65535")?,
    };
    Ok(RemoteUrl { host, port, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_urls_keep_their_path_and_default_to_port_80() {
        let u = parse_remote_url("http://enrich.default.example").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("enrich.default.example", 80, "/")
        );
        let u = parse_remote_url("http://127.0.0.1:8080/default/broker?x=1").unwrap();
        assert_eq!((u.port, u.path.as_str()), (8080, "/default/broker?x=1"));
        assert_eq!(u.host_header(), "127.0.0.1:8080");
        let u = parse_remote_url("http://[::1]:81").unwrap();
        assert_eq!(
            (u.host.as_str(), u.host_header().as_str()),
            ("::1", "[::1]:81")
        );
        assert!(parse_remote_url("https://x")
            .unwrap_err()
            .contains("not supported"));
        assert!(parse_remote_url("http://x:0").is_err());
        assert!(parse_remote_url("ftp://x").is_err());
        assert!(parse_remote_url("http://u:p@x").is_err());
    }

    #[test]
    fn commands_that_name_fd3_take_the_inherited_socket_and_others_do_not() {
        let c = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(command_takes_fd3(&c(&[
            "gunicorn", "--bind", "fd://3", "app:app"
        ])));
        assert!(command_takes_fd3(&c(&[
            "gunicorn",
            "--bind=fd://3",
            "app:app"
        ])));
        assert!(command_takes_fd3(&c(&["uvicorn", "--fd", "3", "app:app"])));
        assert!(command_takes_fd3(&c(&["uvicorn", "--fd=3", "app:app"])));
        assert!(!command_takes_fd3(&c(&[
            "python3",
            "-m",
            "http.server",
            "8080"
        ])));
        assert!(!command_takes_fd3(&c(&["uvicorn", "--fd", "4", "app:app"])));
        assert!(!command_takes_fd3(&c(&["node", "server.js", "3"])));
        let d: FunctionConfig =
            toml::from_str("name = \"f\"\ntopics = [\"#\"]\ncommand = [\"x\"]").unwrap();
        assert_eq!(
            d.socket,
            SocketMode::Auto,
            "the default follows Knative's contract"
        );
    }
}
