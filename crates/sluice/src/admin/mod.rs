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
    /// `GET /api/v1/devices`: up to `limit` connected devices whose client id sorts after
    /// `after`, with the gateway's name (which gateway holds which device). `None`: this
    /// source has no device list (404).
    fn devices(&self, after: Option<&str>, limit: usize) -> Option<serde_json::Value> {
        let _ = (after, limit);
        None
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
GET /api/v1/devices    the MQTT devices this gateway holds, by client id (JSON; ?after=ID&limit=N)\n\
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
        "/api/v1/devices" => devices(source, request.uri().query()),
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

/// Devices one `/api/v1/devices` answer lists unless `limit` says otherwise.
pub const DEVICES_PAGE: usize = 1000;

/// `/api/v1/devices?after=ID&limit=N` (both optional; `after` percent-encoded).
fn devices(source: &dyn AdminSource, query: Option<&str>) -> Response<AdminBody> {
    let mut after = None;
    let mut limit = DEVICES_PAGE;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "after" => match percent_decode(value) {
                Some(v) => after = Some(v),
                None => {
                    return text(
                        StatusCode::BAD_REQUEST,
                        "after: not valid percent-encoded UTF-8\n".to_string(),
                    )
                }
            },
            "limit" => match value.parse::<usize>() {
                Ok(n) if (1..=crate::control::registry::MAX_PAGE).contains(&n) => limit = n,
                _ => {
                    return text(
                        StatusCode::BAD_REQUEST,
                        format!(
                            "limit: a number from 1 to {}\n",
                            crate::control::registry::MAX_PAGE
                        ),
                    )
                }
            },
            _ => {}
        }
    }
    match source.devices(after.as_deref(), limit) {
        Some(doc) => {
            let mut body = doc.to_string().into_bytes();
            body.push(b'\n');
            with_type(StatusCode::OK, "application/json", body)
        }
        None => text(
            StatusCode::NOT_FOUND,
            "not found; GET / lists the endpoints\n".to_string(),
        ),
    }
}

/// `%XX` decoded (RFC 3986); `None` for a bad escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    String::from_utf8(sluice_proto::uri::percent_decode(s)?).ok()
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
mod tests;
