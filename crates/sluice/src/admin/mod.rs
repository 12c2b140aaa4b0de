//! The admin HTTP endpoint: Prometheus metrics, a JSON status document, and an index.
//!
//! Owns: the HTTP/1.1 server on the admin listener, routing, and its resource bounds. Does not
//! own: what is measured or reported — an [`AdminSource`] (implemented by the app) renders the
//! metrics and the status; this module only serves them.
//!
//! Routes (GET only; any other method gets 405 with `Allow: GET`):
//! - `/metrics` — Prometheus text exposition format 0.0.4.
//! - `/api/v1/status` — `application/json`, the source's status document.
//! - `/` — a plain-text list of these endpoints.
//! - anything else — 404 with a one-line body.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] connections are served at once (further ones wait in the
//! kernel's accept backlog until a slot frees); a client has [`HEADER_READ_TIMEOUT`] to send each
//! request's headers, which also closes idle keep-alive connections; headers are capped at
//! [`MAX_HEADER_BYTES`]. There is no authentication: bind the endpoint to localhost or a
//! management network.
//!
//! Shutdown: when the watch channel becomes `true` (or its sender is dropped) the server stops
//! accepting, asks open connections to finish their current response and close, and waits up to
//! [`DRAIN_TIMEOUT`] for them before returning.

pub mod coap_proxy;

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use crate::telemetry::metrics::PromWriter;

/// What the admin endpoint shows. Implemented by the running gateway.
pub trait AdminSource: Send + Sync + 'static {
    /// Writes every metric, in Prometheus text form, into `w`.
    fn render_metrics(&self, w: &mut PromWriter);
    /// The document served at `/api/v1/status`.
    fn status(&self) -> serde_json::Value;
}

/// Most admin connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send a request's headers (and longest a keep-alive connection idles).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head (request line and headers) accepted.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Longest `serve` waits, after shutdown, for open connections to finish.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
const INDEX: &str = "sluice admin endpoint\n\
\n\
GET /metrics         Prometheus metrics (text format 0.0.4)\n\
GET /api/v1/status   gateway status (JSON)\n";

/// Serves the admin endpoint on `listener` until `shutdown` becomes `true`.
///
/// Returns `Ok(())` after shutdown. Accept errors (e.g. out of file descriptors) are logged and
/// retried after a pause rather than returned, so a busy host does not lose its admin endpoint.
pub async fn serve(
    listener: TcpListener,
    source: Arc<dyn AdminSource>,
    shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let limits = Limits {
        max_connections: MAX_CONNECTIONS,
        header_read_timeout: HEADER_READ_TIMEOUT,
    };
    serve_with(listener, source, shutdown, limits).await
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
    mut shutdown: watch::Receiver<bool>,
    limits: Limits,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
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
        let stream = tokio::select! {
            biased;
            () = shutdown_requested(&mut shutdown) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
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
        let shutdown = shutdown.clone();
        tokio::task::spawn(async move {
            serve_connection(stream, source, shutdown, limits).await;
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

async fn serve_connection(
    stream: TcpStream,
    source: Arc<dyn AdminSource>,
    mut shutdown: watch::Receiver<bool>,
    limits: Limits,
) {
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let response = respond(&request, source.as_ref());
        async move { Ok::<_, Infallible>(response) }
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
    };
    if let Err(error) = result {
        tracing::debug!(%error, "admin connection ended with an error");
    }
}

/// Routes one request. Request bodies are never read.
fn respond(request: &Request<Incoming>, source: &dyn AdminSource) -> Response<Full<Bytes>> {
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
        "/" => text(StatusCode::OK, INDEX.to_string()),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; GET / lists the endpoints\n".to_string(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    with_type(status, "text/plain; charset=utf-8", body.into_bytes())
}

fn with_type(
    status: StatusCode,
    content_type: &'static str,
    body: Vec<u8>,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(serve_with(listener, Arc::new(FakeSource), shutdown, limits));
        Server { addr, stop, task }
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
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
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
    async fn methods_other_than_get_get_405_with_allow_get() {
        let server = start_default().await;
        for method in ["POST", "PUT", "DELETE"] {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange(&mut stream, method, "/metrics").await;
            assert_eq!(
                reply.status_line, "HTTP/1.1 405 Method Not Allowed",
                "{method}"
            );
            assert_eq!(reply.header("allow"), Some("GET"));
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
