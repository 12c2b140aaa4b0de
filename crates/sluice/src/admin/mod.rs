//! The admin HTTP endpoint: Prometheus metrics, JSON documents, and the dashboard.
//!
//! Owns: the HTTP/1.1 server on the admin listener (optionally over TLS), who may use it
//! ([`Access`]), routing, and its resource bounds. Does not own: what is measured or reported
//! — an [`AdminSource`] (implemented by the app) renders the metrics and the status; this
//! module only serves them (and adds its own refusal counters to `/metrics`).
//!
//! Routes (GET only but for the reload; any other method gets 405 with `Allow: GET` once it
//! passed the access rules below; docs/api.md has examples):
//! - `/metrics` — Prometheus text exposition format 0.0.4.
//! - `/api/v1/status` — `application/json`, the source's status document.
//! - `/api/v1/overview`, `/api/v1/history`, `/api/v1/events` — the live overview, its recent
//!   history, and its server-sent event stream ([`events`]).
//! - `/healthz`, `/readyz` — liveness and readiness ([`health`]).
//! - `/` — the dashboard ([`dashboard`]) for a client that accepts `text/html`; a plain-text
//!   list of these endpoints otherwise. `/index.html`, `/app.js`, `/style.css` — its assets.
//! - `POST /api/v1/reload` — re-read the config file and apply what can change live
//!   (`reload.rs`; a writing request: it always needs the token, see below).
//! - anything else — 404 with a one-line body.
//!
//! Access (issue 28 item 7), checked before routing:
//! - With a token (`admin.token_file`), every request must carry `Authorization: Bearer
//!   <token>` (scheme case-insensitive, token compared in constant time); otherwise 401 with
//!   `WWW-Authenticate: Bearer`. Exception: `GET` of the dashboard's assets, which hold no
//!   gateway data (ADR 0010 addendum). The config refuses a non-loopback `admin.listen`
//!   without a token, so reading without one is possible on loopback only.
//! - Writing (any method but GET) always needs the token: without a token configured it gets
//!   403 saying to configure one, even on loopback. With the token it reaches routing:
//!   `POST /api/v1/reload`, or 405 anywhere else.
//! - Each refusal is counted in `sluice_admin_refused_total{reason}` (`unauthorized`,
//!   `writes_need_token`, `tls_handshake`) and logged at WARN at most once per
//!   [`REFUSAL_LOG_EVERY`] per reason, with the peer's address; the token is never logged.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] connections are served at once (further ones wait in the
//! kernel's accept backlog until a slot frees); a client has [`HEADER_READ_TIMEOUT`] to finish
//! its TLS handshake and to send each request's headers, which also closes idle keep-alive
//! connections; headers are capped at [`MAX_HEADER_BYTES`]. A refusal's answer is a fixed
//! one-line body, smaller than the request that earned it.
//!
//! Shutdown: when the watch channel becomes `true` (or its sender is dropped) the server stops
//! accepting, asks open connections to finish their current response and close, and waits up to
//! [`DRAIN_TIMEOUT`] for them before returning.

pub mod coap_proxy;
pub mod dashboard;
pub mod events;
pub mod health;
mod reload;

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::config::AdminToken;
use crate::telemetry::metrics::{Counter, PromWriter};

/// What the admin endpoint shows. Implemented by the running gateway.
pub trait AdminSource: Send + Sync + 'static {
    /// Writes every metric, in Prometheus text form, into `w`.
    fn render_metrics(&self, w: &mut PromWriter);
    /// The document served at `/api/v1/status`.
    fn status(&self) -> serde_json::Value;
    /// The live overview (`/api/v1/overview`, `/api/v1/events`, the dashboard). Called once
    /// per [`events::TICK`] by the event hub only, so an implementation may keep state between
    /// calls (rates are differences to the previous call). Its `series` object (name → number)
    /// is kept as history for the dashboard's charts.
    fn overview(&self) -> serde_json::Value {
        serde_json::json!({})
    }
    /// `POST /api/v1/reload`: re-read the config file and apply what can change live
    /// (blocking: called on the blocking pool). The answer's status and JSON body; `None`:
    /// this source does not reload (404).
    fn reload(&self) -> Option<(StatusCode, serde_json::Value)> {
        None
    }
}

/// The body of every admin response: a whole one, or a server-sent event stream.
pub type AdminBody = http_body_util::Either<Full<Bytes>, events::EventBody>;

/// What a request may use beyond the source: the event hub, and the notification that closes
/// this connection (a stalled event stream).
#[derive(Clone)]
struct Live {
    hub: Arc<events::EventHub>,
    kill: Arc<tokio::sync::Notify>,
}

/// Most admin connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send a request's headers (and longest a keep-alive connection idles).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head (request line and headers) accepted.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Longest `serve` waits, after shutdown, for open connections to finish.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest silence between two log lines about refused requests of one reason.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Who may use the admin endpoint, from `[admin]`.
#[derive(Clone, Default)]
pub struct Access {
    /// `admin.token_file`'s token: every request must carry it, and writing needs it.
    pub token: Option<AdminToken>,
    /// `admin.cert_file`/`key_file`: serve over TLS.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Why the admin TLS configuration cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum AdminTlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: io::Error,
    },
    #[error("{0}: no PEM certificate")]
    NoCertificate(std::path::PathBuf),
    #[error("{0}: no PEM private key")]
    NoKey(std::path::PathBuf),
    #[error("certificate and key do not make a TLS server: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A TLS 1.2/1.3 server configuration from a PEM certificate chain and private key.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, AdminTlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| AdminTlsError::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    let cert_pem = read(cert)?;
    let chain: Vec<_> = rustls_pemfile::certs(&mut &cert_pem[..])
        .collect::<Result<_, _>>()
        .map_err(|source| AdminTlsError::Read {
            path: cert.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(AdminTlsError::NoCertificate(cert.to_path_buf()));
    }
    let key_pem = read(key)?;
    let key_der = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(|source| AdminTlsError::Read {
            path: key.to_path_buf(),
            source,
        })?
        .ok_or_else(|| AdminTlsError::NoKey(key.to_path_buf()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)?;
    Ok(Arc::new(config))
}

/// Why a request was refused before routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// A token is configured and the request did not carry it.
    Unauthorized,
    /// A writing request, and no token is configured.
    WritesNeedToken,
    /// The TLS handshake failed or timed out.
    TlsHandshake,
}

impl Refusal {
    const ALL: [Refusal; 3] = [
        Refusal::Unauthorized,
        Refusal::WritesNeedToken,
        Refusal::TlsHandshake,
    ];

    fn label(self) -> &'static str {
        match self {
            Refusal::Unauthorized => "unauthorized",
            Refusal::WritesNeedToken => "writes_need_token",
            Refusal::TlsHandshake => "tls_handshake",
        }
    }
}

/// The access rules and refusal counters, shared by every connection.
struct Guard {
    token: Option<AdminToken>,
    refused: [Counter; Refusal::ALL.len()],
    /// Per reason: when its last log line was written (ms since `epoch`, 0 = never).
    logged: [AtomicU64; Refusal::ALL.len()],
    epoch: Instant,
}

impl Guard {
    fn new(token: Option<AdminToken>) -> Guard {
        Guard {
            token,
            refused: Default::default(),
            logged: Default::default(),
            epoch: Instant::now(),
        }
    }

    /// `None` when `request` may go on to routing.
    fn check(&self, request: &Request<Incoming>) -> Option<Refusal> {
        // The dashboard's page, script and style sheet are the same compiled-in bytes for
        // everyone and carry no gateway data: a browser must be able to load them before it
        // can send the token (ADR 0010, issue 29 addendum). Every data endpoint needs it.
        if request.method() == Method::GET && dashboard::is_asset(request.uri().path()) {
            return None;
        }
        match &self.token {
            Some(token) => {
                let carried = request
                    .headers()
                    .get(AUTHORIZATION)
                    .is_some_and(|v| bearer_matches(v.as_bytes(), token.expose()));
                (!carried).then_some(Refusal::Unauthorized)
            }
            None => (request.method() != Method::GET).then_some(Refusal::WritesNeedToken),
        }
    }

    /// Count `why`, and log it unless one of its kind was logged less than
    /// [`REFUSAL_LOG_EVERY`] ago.
    fn refuse(&self, why: Refusal, peer: SocketAddr, method: &str) {
        let i = why as usize;
        self.refused[i].inc();
        let now = (self.epoch.elapsed().as_millis() as u64).max(1);
        let last = self.logged[i].load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= REFUSAL_LOG_EVERY.as_millis() as u64;
        if due
            && self.logged[i]
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                reason = why.label(),
                %peer,
                method,
                refused_so_far = self.refused[i].get(),
                "admin request refused"
            );
        }
    }

    fn render(&self, w: &mut PromWriter) {
        for why in Refusal::ALL {
            w.counter(
                "sluice_admin_refused_total",
                "Admin endpoint requests refused before routing, by reason: unauthorized (no or wrong bearer token), writes_need_token (a writing request and no admin.token_file), tls_handshake.",
                &[("reason", why.label())],
                self.refused[why as usize].get(),
            );
        }
    }
}

/// Whether an `Authorization` value is `Bearer <token>` (scheme case-insensitive, RFC 9110
/// §11.1), the token compared in constant time.
fn bearer_matches(value: &[u8], token: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    let Some((scheme, rest)) = value.split_first_chunk::<7>() else {
        return false;
    };
    scheme.eq_ignore_ascii_case(b"bearer ") && rest.trim_ascii().ct_eq(token).into()
}

fn refusal_response(why: Refusal) -> Response<AdminBody> {
    match why {
        Refusal::Unauthorized => {
            let mut response = text(
                StatusCode::UNAUTHORIZED,
                "unauthorized: send Authorization: Bearer <the token in admin.token_file>\n"
                    .to_string(),
            );
            response.headers_mut().insert(
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"sluice admin\""),
            );
            response
        }
        Refusal::WritesNeedToken => text(
            StatusCode::FORBIDDEN,
            "forbidden: writing to the admin endpoint needs a bearer token; configure admin.token_file\n"
                .to_string(),
        ),
        // Never sent: without a handshake there is no HTTP to answer in.
        Refusal::TlsHandshake => text(StatusCode::BAD_REQUEST, String::new()),
    }
}

const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
const INDEX: &str = "sluice admin endpoint\n\
\n\
GET /                  the dashboard (in a browser; this list otherwise)\n\
GET /metrics           Prometheus metrics (text format 0.0.4)\n\
GET /api/v1/status     gateway status (JSON)\n\
GET /api/v1/overview   the dashboard's numbers, with rates (JSON, new each second)\n\
GET /api/v1/history    the last minutes of the overview's series (JSON)\n\
GET /api/v1/events     the overview as server-sent events, one per second\n\
GET /healthz           200 while the process serves (liveness)\n\
GET /readyz            200 when every uplink is connected, 503 with the reason otherwise\n\
POST /api/v1/reload    re-read the config file, apply what can change live (bearer token)\n";

/// Serves the admin endpoint on `listener` until `shutdown` becomes `true`, under `access`.
///
/// Returns `Ok(())` after shutdown. Accept errors (e.g. out of file descriptors) are logged and
/// retried after a pause rather than returned, so a busy host does not lose its admin endpoint.
pub async fn serve(
    listener: TcpListener,
    source: Arc<dyn AdminSource>,
    access: Access,
    shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let limits = Limits {
        max_connections: MAX_CONNECTIONS,
        header_read_timeout: HEADER_READ_TIMEOUT,
    };
    serve_with(listener, source, access, shutdown, limits).await
}

/// Bounds of one server; tests shrink them.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    header_read_timeout: Duration,
}

async fn serve_with(
    listener: TcpListener,
    source: Arc<dyn AdminSource>,
    access: Access,
    mut shutdown: watch::Receiver<bool>,
    limits: Limits,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let guard = Arc::new(Guard::new(access.token));
    let hub = events::EventHub::new();
    // The first overview before the first request, so no reader ever sees an empty one.
    hub.tick(source.as_ref());
    tokio::task::spawn(hub.clone().run(source.clone(), shutdown.clone()));
    let tls = access.tls.map(tokio_rustls::TlsAcceptor::from);
    loop {
        let permit = tokio::select! {
            biased;
            () = shutdown_requested(&mut shutdown) => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                // Invariant: `slots` is never closed; stop serving rather than panic.
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            biased;
            () = shutdown_requested(&mut shutdown) => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) if is_connection_error(&error) => continue,
                Err(error) => {
                    tracing::warn!(%error, "admin endpoint cannot accept a connection; retrying in 1s");
                    tokio::select! {
                        () = shutdown_requested(&mut shutdown) => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        let source = source.clone();
        let guard = guard.clone();
        let hub = hub.clone();
        let shutdown = shutdown.clone();
        let tls = tls.clone();
        tokio::task::spawn(async move {
            match tls {
                None => serve_connection(stream, peer, source, guard, hub, shutdown, limits).await,
                Some(acceptor) => {
                    // Fallible: on failure the socket comes back, so it is counted before
                    // the peer sees it close.
                    let handshake = tokio::time::timeout(
                        limits.header_read_timeout,
                        acceptor.accept(stream).into_fallible(),
                    );
                    match handshake.await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, peer, source, guard, hub, shutdown, limits)
                                .await
                        }
                        Ok(Err((_error, stream))) => {
                            guard.refuse(Refusal::TlsHandshake, peer, "-");
                            drop(stream);
                        }
                        Err(_elapsed) => guard.refuse(Refusal::TlsHandshake, peer, "-"),
                    }
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    // Every connection task holds one permit until it ends; getting all of them back means
    // every connection has closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(DRAIN_TIMEOUT, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::debug!("admin connections still open after the drain timeout");
    }
    Ok(())
}

/// Resolves once shutdown is requested or the sender is gone.
async fn shutdown_requested(shutdown: &mut watch::Receiver<bool>) {
    // `wait_for` errs only when the sender is dropped, which also means: stop.
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Errors that concern one incoming connection, not the listener.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

async fn serve_connection<S>(
    stream: S,
    peer: SocketAddr,
    source: Arc<dyn AdminSource>,
    guard: Arc<Guard>,
    hub: Arc<events::EventHub>,
    mut shutdown: watch::Receiver<bool>,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let kill = Arc::new(tokio::sync::Notify::new());
    let live = Live {
        hub,
        kill: kill.clone(),
    };
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let (source, guard, live) = (source.clone(), guard.clone(), live.clone());
        async move {
            let response = match guard.check(&request) {
                Some(why) => {
                    guard.refuse(why, peer, request.method().as_str());
                    refusal_response(why)
                }
                None if request.uri().path() == reload::PATH => {
                    reload::answer(request.method(), source).await
                }
                None => respond(&request, source.as_ref(), &guard, &live),
            };
            Ok::<_, Infallible>(response)
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .max_buf_size(MAX_HEADER_BYTES.max(8192));
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = shutdown_requested(&mut shutdown) => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
        // An event stream that stopped reading (`events::STALL_TIMEOUT`): drop the connection.
        () = kill.notified() => Ok(()),
    };
    if let Err(error) = result {
        tracing::debug!(%error, "admin connection ended with an error");
    }
}

/// Routes one request that passed the access rules. Request bodies are never read.
fn respond(
    request: &Request<Incoming>,
    source: &dyn AdminSource,
    guard: &Guard,
    live: &Live,
) -> Response<AdminBody> {
    if request.method() != Method::GET {
        let mut response = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: the admin endpoint only serves GET\n".to_string(),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    match request.uri().path() {
        "/metrics" => {
            let mut w = PromWriter::new();
            source.render_metrics(&mut w);
            guard.render(&mut w);
            live.hub.render(&mut w);
            with_type(
                StatusCode::OK,
                METRICS_CONTENT_TYPE,
                w.finish().into_bytes(),
            )
        }
        "/api/v1/status" => {
            let mut body = source.status().to_string().into_bytes();
            body.push(b'\n');
            with_type(StatusCode::OK, "application/json", body)
        }
        "/api/v1/overview" => {
            with_bytes(StatusCode::OK, "application/json", live.hub.latest_json())
        }
        "/api/v1/history" => {
            with_bytes(StatusCode::OK, "application/json", live.hub.history_json())
        }
        "/api/v1/events" => dashboard::event_stream(&live.hub, live.kill.clone()),
        "/healthz" => health::healthz(source).map(http_body_util::Either::Left),
        "/readyz" => health::readyz(source).map(http_body_util::Either::Left),
        "/" if !dashboard::wants_html(request) => text(StatusCode::OK, INDEX.to_string()),
        path if dashboard::is_asset(path) => dashboard::asset(path),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; GET / lists the endpoints\n".to_string(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<AdminBody> {
    with_type(status, "text/plain; charset=utf-8", body.into_bytes())
}

fn with_type(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<AdminBody> {
    with_bytes(status, content_type, Bytes::from(body))
}

fn with_bytes(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<AdminBody> {
    let mut response = Response::new(http_body_util::Either::Left(Full::new(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    struct FakeSource;

    impl AdminSource for FakeSource {
        fn render_metrics(&self, w: &mut PromWriter) {
            w.counter(
                "sluice_test_messages_total",
                "Messages seen.",
                &[("shard", "0")],
                42,
            );
        }
        fn status(&self) -> serde_json::Value {
            serde_json::json!({ "shards": 2, "uplinks": [{ "name": "cloud", "connected": true }] })
        }
    }

    struct Server {
        addr: SocketAddr,
        stop: watch::Sender<bool>,
        task: tokio::task::JoinHandle<io::Result<()>>,
    }

    async fn start(limits: Limits) -> Server {
        start_with(Access::default(), limits).await
    }

    async fn start_with(access: Access, limits: Limits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(serve_with(
            listener,
            Arc::new(FakeSource),
            access,
            shutdown,
            limits,
        ));
        Server { addr, stop, task }
    }

    const TOKEN: &str = "0123456789abcdef-token";

    async fn start_with_token() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
        let admin = crate::config::AdminConfig {
            token_file: Some(path),
            ..Default::default()
        };
        let access = Access {
            token: admin.read_token().unwrap(),
            tls: None,
        };
        start_with(
            access,
            Limits {
                max_connections: MAX_CONNECTIONS,
                header_read_timeout: HEADER_READ_TIMEOUT,
            },
        )
        .await
    }

    async fn start_default() -> Server {
        start(Limits {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
        })
        .await
    }

    /// Status line, lower-cased headers, and body of one `Connection: close` exchange.
    struct Reply {
        status_line: String,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        }
    }

    async fn exchange(stream: &mut TcpStream, method: &str, path: &str) -> Reply {
        exchange_with(stream, method, path, "").await
    }

    async fn exchange_with(
        stream: &mut TcpStream,
        method: &str,
        path: &str,
        headers: &str,
    ) -> Reply {
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\n{headers}Connection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
            .await
            .expect("reply within 10s")
            .unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").expect("a complete head");
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap().to_string();
        let headers = lines
            .map(|l| {
                let (k, v) = l.split_once(':').unwrap();
                (k.trim().to_ascii_lowercase(), v.trim().to_string())
            })
            .collect();
        Reply {
            status_line,
            headers,
            body: body.to_string(),
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        exchange(&mut stream, "GET", path).await
    }

    #[tokio::test]
    async fn metrics_endpoint_serves_the_sources_metrics_as_prometheus_text() {
        let server = start_default().await;
        let reply = get(server.addr, "/metrics").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
        assert!(reply
            .header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"));
        assert!(
            reply
                .body
                .contains("# TYPE sluice_test_messages_total counter\n"),
            "{}",
            reply.body
        );
        assert!(
            reply
                .body
                .contains("sluice_test_messages_total{shard=\"0\"} 42\n"),
            "{}",
            reply.body
        );
    }

    #[tokio::test]
    async fn status_endpoint_serves_the_sources_json() {
        let server = start_default().await;
        let reply = get(server.addr, "/api/v1/status?verbose=1").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        let doc: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(doc, FakeSource.status());
    }

    #[tokio::test]
    async fn index_lists_the_endpoints() {
        let server = start_default().await;
        let reply = get(server.addr, "/").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
        assert!(
            reply.body.contains("/metrics") && reply.body.contains("/api/v1/status"),
            "{}",
            reply.body
        );
    }

    #[tokio::test]
    async fn unknown_paths_get_404_with_a_one_line_body() {
        let server = start_default().await;
        for path in ["/nope", "/metrics/", "/api/v1"] {
            let reply = get(server.addr, path).await;
            assert_eq!(reply.status_line, "HTTP/1.1 404 Not Found", "{path}");
            assert_eq!(reply.body.lines().count(), 1, "{path}: {}", reply.body);
        }
    }

    #[tokio::test]
    async fn without_a_token_writing_methods_get_403_saying_to_configure_one() {
        let server = start_default().await;
        for method in ["POST", "PUT", "DELETE"] {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange(&mut stream, method, "/metrics").await;
            assert_eq!(reply.status_line, "HTTP/1.1 403 Forbidden", "{method}");
            assert!(reply.body.contains("admin.token_file"), "{}", reply.body);
        }
        let m = get(server.addr, "/metrics").await.body;
        assert!(
            m.contains("sluice_admin_refused_total{reason=\"writes_need_token\"} 3\n"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn the_reload_route_is_a_writing_one_and_only_takes_post() {
        // No token configured: refused before the source is asked, even on loopback.
        let server = start_default().await;
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange(&mut stream, "POST", "/api/v1/reload").await;
        assert_eq!(reply.status_line, "HTTP/1.1 403 Forbidden");
        // With the token: GET is answered 405 naming POST; a source that does not reload
        // answers POST with 404.
        let server = start_with_token().await;
        let bearer = format!("Authorization: Bearer {TOKEN}\r\n");
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange_with(&mut stream, "GET", "/api/v1/reload", &bearer).await;
        assert_eq!(reply.status_line, "HTTP/1.1 405 Method Not Allowed");
        assert_eq!(reply.header("allow"), Some("POST"));
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange_with(&mut stream, "POST", "/api/v1/reload", &bearer).await;
        assert_eq!(reply.status_line, "HTTP/1.1 404 Not Found");
    }

    #[tokio::test]
    async fn with_a_token_every_request_needs_it_and_writing_methods_then_get_405() {
        let server = start_with_token().await;
        let bearer = format!("Authorization: Bearer {TOKEN}\r\n");
        for (headers, want) in [
            (String::new(), "HTTP/1.1 401 Unauthorized"),
            (
                "Authorization: Bearer 0123456789abcdef-tokeN\r\n".to_string(),
                "HTTP/1.1 401 Unauthorized",
            ),
            (
                format!("Authorization: Bearer {TOKEN}x\r\n"),
                "HTTP/1.1 401 Unauthorized",
            ),
            (
                format!("Authorization: Basic {TOKEN}\r\n"),
                "HTTP/1.1 401 Unauthorized",
            ),
            (bearer.clone(), "HTTP/1.1 200 OK"),
            (
                format!("Authorization: bearer {TOKEN}\r\n"),
                "HTTP/1.1 200 OK",
            ),
        ] {
            for path in ["/metrics", "/api/v1/status", "/api/v1/overview"] {
                let mut stream = TcpStream::connect(server.addr).await.unwrap();
                let reply = exchange_with(&mut stream, "GET", path, &headers).await;
                assert_eq!(reply.status_line, want, "{path} with {headers:?}");
                if want.contains("401") {
                    assert_eq!(
                        reply.header("www-authenticate"),
                        Some("Bearer realm=\"sluice admin\"")
                    );
                    assert!(!reply.body.contains(TOKEN), "{}", reply.body);
                }
            }
        }
        for method in ["POST", "PUT", "DELETE"] {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange(&mut stream, method, "/metrics").await;
            assert_eq!(reply.status_line, "HTTP/1.1 401 Unauthorized", "{method}");
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange_with(&mut stream, method, "/metrics", &bearer).await;
            assert_eq!(
                reply.status_line, "HTTP/1.1 405 Method Not Allowed",
                "{method}"
            );
            assert_eq!(reply.header("allow"), Some("GET"));
        }
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let m = exchange_with(&mut stream, "GET", "/metrics", &bearer)
            .await
            .body;
        // 4 refused headers × 3 paths + 3 writing methods without the token.
        assert!(
            m.contains("sluice_admin_refused_total{reason=\"unauthorized\"} 15\n"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn with_a_token_the_dashboard_assets_load_but_its_data_needs_the_token() {
        let server = start_with_token().await;
        for path in ["/", "/app.js", "/style.css"] {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange_with(&mut stream, "GET", path, "Accept: text/html,*/*\r\n").await;
            assert_eq!(reply.status_line, "HTTP/1.1 200 OK", "{path}");
            assert!(reply
                .header("content-security-policy")
                .is_some_and(|c| c.contains("default-src 'none'")));
        }
        for path in ["/api/v1/events", "/api/v1/history", "/api/v1/overview"] {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange(&mut stream, "GET", path).await;
            assert_eq!(reply.status_line, "HTTP/1.1 401 Unauthorized", "{path}");
        }
        // Writing to an asset path is not exempt.
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange(&mut stream, "POST", "/").await;
        assert_eq!(reply.status_line, "HTTP/1.1 401 Unauthorized");
    }

    #[tokio::test]
    async fn a_browser_gets_the_dashboard_at_the_root_and_curl_the_list() {
        let server = start_default().await;
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange_with(&mut stream, "GET", "/", "Accept: text/html\r\n").await;
        assert_eq!(
            reply.header("content-type"),
            Some("text/html; charset=utf-8")
        );
        assert!(
            reply.body.contains("<script src=\"app.js\">"),
            "{}",
            reply.body
        );
        let reply = get(server.addr, "/").await;
        assert!(reply.body.contains("/api/v1/events"), "{}", reply.body);
    }

    #[tokio::test]
    async fn the_overview_is_there_from_the_first_request() {
        let server = start_default().await;
        let reply = get(server.addr, "/api/v1/overview").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
        let doc: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert!(doc["seq"].as_u64() >= Some(1), "{doc}");
    }

    /// Reads from `stream` until `want` complete events (blank-line separated) arrived.
    async fn read_events(stream: &mut TcpStream, want: usize) -> String {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        while String::from_utf8_lossy(&raw)
            .matches("event: overview")
            .count()
            < want
        {
            let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
                .await
                .expect("an event within 5 s")
                .unwrap();
            assert!(n > 0, "stream closed: {}", String::from_utf8_lossy(&raw));
            raw.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&raw).into_owned()
    }

    #[tokio::test]
    async fn the_event_stream_sends_an_overview_each_tick_and_refuses_streams_beyond_its_bound() {
        let server = start_default().await;
        let mut streams = Vec::new();
        for _ in 0..events::MAX_STREAMS {
            let mut s = TcpStream::connect(server.addr).await.unwrap();
            s.write_all(b"GET /api/v1/events HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .unwrap();
            streams.push(s);
        }
        let text = read_events(&mut streams[0], 2).await;
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(text.contains("content-type: text/event-stream"), "{text}");
        assert!(text.contains("data: {"), "{text}");
        let mut extra = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange(&mut extra, "GET", "/api/v1/events").await;
        assert_eq!(reply.status_line, "HTTP/1.1 503 Service Unavailable");
        assert_eq!(reply.header("retry-after"), Some("5"));
        drop(streams.pop());
        // The closed stream's place is free again once the server noticed (next tick).
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut s = TcpStream::connect(server.addr).await.unwrap();
            s.write_all(b"GET /api/v1/events HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .unwrap();
            let mut head = [0u8; 12];
            s.read_exact(&mut head).await.unwrap();
            if &head == b"HTTP/1.1 200" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the freed stream slot was not reused"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let m = get(server.addr, "/metrics").await.body;
        assert!(
            m.contains("sluice_admin_event_streams_refused_total "),
            "{m}"
        );
    }

    #[test]
    fn bearer_values_match_only_the_exact_token() {
        let t = b"0123456789abcdef";
        assert!(bearer_matches(b"Bearer 0123456789abcdef", t));
        assert!(bearer_matches(b"BEARER 0123456789abcdef ", t));
        for v in [
            &b""[..],
            b"Bearer",
            b"Bearer ",
            b"Bearer 0123456789abcde",
            b"Bearer 0123456789abcdefg",
            b"Basic 0123456789abcdef",
            b"Bearer0123456789abcdef",
        ] {
            assert!(!bearer_matches(v, t), "{}", String::from_utf8_lossy(v));
        }
    }

    #[tokio::test]
    async fn keep_alive_connection_serves_several_requests() {
        let server = start_default().await;
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = stream.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK"));
        let reply = exchange(&mut stream, "GET", "/api/v1/status").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    }

    #[tokio::test]
    async fn client_that_never_finishes_its_headers_is_disconnected() {
        let server = start(Limits {
            max_connections: 4,
            header_read_timeout: Duration::from_millis(200),
        })
        .await;
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: te")
            .await
            .unwrap();
        let mut rest = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
        assert!(read.is_ok(), "the server kept a stalled connection open");
        assert!(!String::from_utf8_lossy(&rest).contains("200 OK"));
    }

    #[tokio::test]
    async fn idle_connections_are_closed_after_the_header_timeout() {
        let server = start(Limits {
            max_connections: 4,
            header_read_timeout: Duration::from_millis(200),
        })
        .await;
        let mut silent = TcpStream::connect(server.addr).await.unwrap();
        let mut kept_alive = TcpStream::connect(server.addr).await.unwrap();
        kept_alive
            .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        for stream in [&mut silent, &mut kept_alive] {
            let mut rest = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
            assert!(read.is_ok(), "an idle connection stayed open");
        }
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_for_a_free_slot() {
        let server = start(Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(30),
        })
        .await;
        let hog = TcpStream::connect(server.addr).await.unwrap();
        // Let the server accept the hog and take the only slot.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut waiting = TcpStream::connect(server.addr).await.unwrap();
        waiting
            .write_all(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let early = tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut buf)).await;
        assert!(
            early.is_err(),
            "a second connection was served while the cap was reached"
        );
        drop(hog);
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), waiting.read_to_end(&mut raw))
            .await
            .unwrap()
            .unwrap();
        assert!(
            raw.starts_with(b"HTTP/1.1 200 OK"),
            "{}",
            String::from_utf8_lossy(&raw)
        );
    }

    #[tokio::test]
    async fn shutdown_stops_accepting_and_closes_idle_connections() {
        let server = start_default().await;
        let mut idle = TcpStream::connect(server.addr).await.unwrap();
        assert_eq!(get(server.addr, "/").await.status_line, "HTTP/1.1 200 OK");
        server.stop.send(true).unwrap();
        let result = tokio::time::timeout(Duration::from_secs(5), server.task).await;
        assert!(
            matches!(result, Ok(Ok(Ok(())))),
            "serve did not return Ok after shutdown"
        );
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(1), idle.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok(),
            "an idle connection stayed open after shutdown"
        );
        assert!(
            TcpStream::connect(server.addr).await.is_err(),
            "the listener still accepts"
        );
    }
}
