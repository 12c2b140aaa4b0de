//! One HTTP/1.1 exchange on a keep-alive connection to a function, and the shard's pool of
//! idle connections per instance.
//!
//! Owns: connecting (an instance's loopback address, or a remote function's host), sending one
//! request and reading its response through hyper's client connection
//! (`hyper::client::conn::http1`: the head, fixed-length, chunked and close-delimited bodies,
//! keep-alive), the body bounded by [`MAX_BODY_BYTES`], and keeping idle connections for
//! reuse. Does not own: timeouts, retries or what an answer means (`dispatch.rs`).
//!
//! A connection is used by one request at a time (no pipelining: Knative's concurrency is
//! requests in flight, each on its own connection). A response that says `Connection: close`
//! (or is HTTP/1.0), or any error, ends the connection; otherwise it goes back to the pool.
//! Connections idle for more than [`IDLE_REOPEN`] are not reused, so a server's keep-alive
//! timeout never closes one under a request.
//!
//! Per request, the cost is kept near what any HTTP client must pay (issue 32; figures in
//! docs/perf/functions.md): hyper's connection driver is polled by the request's own task
//! ([`Conn::call`] drives it while waiting for readiness, the answer and its body) instead of
//! being a task of its own, so an exchange is no hand-off between two tasks; and the quick-ACK
//! request is made only before a read that the socket's readiness says will happen (hyper
//! polls for reads several times per exchange, most of which find nothing and cost nothing).
//! An idle pooled connection is not polled: a server that closed it meanwhile is noticed at
//! its next use (a failure before any answer byte on a reused connection, which `dispatch.rs`
//! sends again at once on a new one).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderMap, CONNECTION, CONTENT_TYPE};
use hyper::{Method, Request, Version};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::sink::onem2m::http::{MAX_BODY_BYTES, MAX_HEAD_BYTES};

/// An idle connection older than this is closed instead of reused.
pub const IDLE_REOPEN: Duration = Duration::from_secs(2);
/// Idle connections kept per instance on one shard.
pub const MAX_IDLE_PER_INSTANCE: usize = 64;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("cannot connect: {0}")]
    Connect(#[source] std::io::Error),
    #[error("connection failed: {0}")]
    Io(#[source] std::io::Error),
    /// Closed (or the exchange was cut) before any byte of an answer arrived.
    #[error("the function closed the connection before answering")]
    Closed,
    /// A malformed answer, or one cut short after its first byte.
    #[error("malformed or truncated HTTP response: {0}")]
    Http(#[source] hyper::Error),
    #[error("response body larger than {MAX_BODY_BYTES} bytes")]
    BodyTooLarge,
    /// `101 Switching Protocols` to a request that asked for no upgrade: not an answer, and
    /// the connection no longer speaks HTTP/1.1 (hyper hands a 101 over as final).
    #[error("the function answered 101 Switching Protocols to a request without Upgrade")]
    Upgrade,
}

impl From<hyper::Error> for CallError {
    fn from(e: hyper::Error) -> CallError {
        if e.is_incomplete_message() || e.is_canceled() || e.is_closed() {
            CallError::Closed
        } else {
            CallError::Http(e)
        }
    }
}

/// One request as the dispatcher builds it once per event: path, headers (`Host`, `ce-*`,
/// `Content-Type`; hyper adds `Content-Length`) and body.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub path: hyper::Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A function's answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
    /// The server closes the connection after it.
    pub close: bool,
    /// Its `Content-Type` (when present and UTF-8): a reply carries it as the MQTT 5 content
    /// type.
    pub content_type: Option<ByteString>,
}

/// hyper's half of a connection that reads and writes the socket; it makes progress only
/// while polled (by [`drive`], from the task that runs the exchange).
type Driver = Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

/// One open connection.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
    /// `None` once it finished (the server closed the connection, or it failed).
    driver: Option<Driver>,
    /// When the connection last wrote bytes (set by its socket, read after an exchange).
    wrote_at: Arc<Mutex<Option<Instant>>>,
    /// The socket read a byte since the exchange began (set by its socket): an error after
    /// that is a malformed or truncated answer, not a connection closed before answering.
    read_any: Arc<AtomicBool>,
    idle_since: Instant,
    /// It carried an exchange before (a failure before any answer byte may be a stale
    /// keep-alive connection the server closed meanwhile).
    pub reused: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("open", &self.driver.is_some())
            .field("idle_since", &self.idle_since)
            .field("reused", &self.reused)
            .finish()
    }
}

/// Polls `fut` to its end, polling the connection's `driver` whenever `fut` waits (hyper's
/// request, answer and body futures complete only as the driver reads and writes). A driver
/// that finished is set to `None` and not polled again; hyper then fails the pending futures
/// of that connection (closed), so `fut` still ends.
async fn drive<F: Future>(driver: &mut Option<Driver>, fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(v);
        }
        let Some(d) = driver.as_mut() else {
            return Poll::Pending;
        };
        if d.as_mut().poll(cx).is_ready() {
            // Its error reaches `fut` (hyper fails the exchange that was running).
            *driver = None;
        }
        // The driver may have completed `fut` (written the request, read the answer).
        fut.as_mut().poll(cx)
    })
    .await
}

/// Where a connection goes.
#[derive(Debug, Clone)]
pub enum Target {
    Addr(SocketAddr),
    /// `host:port` to resolve (a remote function).
    Host(String, u16),
}

impl Conn {
    pub async fn open(target: &Target) -> Result<Conn, CallError> {
        let stream = match target {
            Target::Addr(a) => TcpStream::connect(a).await,
            Target::Host(h, p) => TcpStream::connect((h.as_str(), *p)).await,
        }
        .map_err(CallError::Connect)?;
        let _ = stream.set_nodelay(true);
        let wrote_at = Arc::new(Mutex::new(None));
        let read_any = Arc::new(AtomicBool::new(false));
        let socket = Socket {
            stream,
            wrote_at: wrote_at.clone(),
            read_any: read_any.clone(),
            read: read_quickack,
        };
        Conn::start(socket, wrote_at, read_any).await
    }

    /// A connection over any byte stream (the write time is never noted, so `call`'s
    /// `written` is not called). For the fuzz target `function_response`, which answers
    /// from memory; not an API.
    #[doc(hidden)]
    pub async fn over<T>(io: T) -> Result<Conn, CallError>
    where
        T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let read_any = Arc::new(AtomicBool::new(false));
        let socket = Socket {
            stream: io,
            wrote_at: Arc::new(Mutex::new(None)),
            read_any: read_any.clone(),
            read: |s: &mut T, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>| {
                Pin::new(s).poll_read(cx, buf)
            },
        };
        // Its write time is never read: `call` only reads `Conn::wrote_at`, a fresh one here.
        Conn::start(socket, Arc::new(Mutex::new(None)), read_any).await
    }

    async fn start<T>(
        io: T,
        wrote_at: Arc<Mutex<Option<Instant>>>,
        read_any: Arc<AtomicBool>,
    ) -> Result<Conn, CallError>
    where
        T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let io = TokioIo::new(io);
        let (sender, driver) = hyper::client::conn::http1::Builder::new()
            // Bounds the head (hyper reads the body in pieces; `Limited` bounds it).
            .max_buf_size(MAX_HEAD_BYTES.max(8192))
            .handshake(io)
            .await
            .map_err(|e| CallError::Io(std::io::Error::other(e)))?;
        Ok(Conn {
            sender,
            driver: Some(Box::pin(driver)),
            wrote_at,
            read_any,
            idle_since: Instant::now(),
            reused: false,
        })
    }

    /// Send `request`, tell `written` when it was in the socket, and read its answer.
    pub async fn call(
        &mut self,
        request: &Outgoing,
        written: &dyn Fn(Instant),
    ) -> Result<Answer, CallError> {
        let Conn { sender, driver, .. } = self;
        drive(driver, sender.ready()).await?;
        self.read_any.store(false, Ordering::Relaxed);
        let mut req = Request::new(Full::new(request.body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = request.path.clone();
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = request.headers.clone();
        *self.wrote_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let sent = self.sender.send_request(req);
        let response = drive(&mut self.driver, sent)
            .await
            .map_err(|e| self.classify(e))?;
        if let Some(at) = *self.wrote_at.lock().unwrap_or_else(|p| p.into_inner()) {
            written(at);
        }
        let status = response.status().as_u16();
        if status == 101 {
            return Err(CallError::Upgrade);
        }
        let close = response.version() < Version::HTTP_11
            || response.headers().get_all(CONNECTION).iter().any(|v| {
                v.to_str()
                    .is_ok_and(|v| v.to_ascii_lowercase().contains("close"))
            });
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .map(|s| ByteString::from(s.trim()));
        let collect = Limited::new(response.into_body(), MAX_BODY_BYTES).collect();
        let body = drive(&mut self.driver, collect)
            .await
            .map_err(|e| match e.downcast::<hyper::Error>() {
                Ok(h) => self.classify(*h),
                Err(_) => CallError::BodyTooLarge,
            })?
            .to_bytes();
        Ok(Answer {
            status,
            body,
            close,
            content_type,
        })
    }
}

impl Conn {
    /// An exchange's error: `Closed` only when no answer byte arrived (hyper reports a head
    /// that fails to parse after arriving in pieces as a closed connection).
    fn classify(&self, e: hyper::Error) -> CallError {
        let cut = e.is_incomplete_message() || e.is_canceled() || e.is_closed();
        if cut && self.read_any.load(Ordering::Relaxed) {
            CallError::Http(e)
        } else {
            CallError::from(e)
        }
    }
}

/// The connection's socket for hyper: asks the kernel to acknowledge at once before every
/// read of a TCP stream ([`read_quickack`]), and notes when it last wrote (the dispatch
/// latency's end) and that it read an answer byte. Generic over the stream for
/// [`Conn::over`].
struct Socket<S> {
    stream: S,
    wrote_at: Arc<Mutex<Option<Instant>>>,
    read_any: Arc<AtomicBool>,
    /// How to read (a TCP stream: [`read_quickack`]).
    read: ReadFn<S>,
}

type ReadFn<S> = fn(&mut S, &mut Context<'_>, &mut ReadBuf<'_>) -> Poll<std::io::Result<()>>;

/// A read of a function's TCP connection, preceded by the quick-ACK request (a server that
/// writes its head and body apart with Nagle on — Python's http.server — would otherwise
/// hold the body until our delayed ACK, 40 ms per request; the kernel leaves quick-ack mode
/// by itself). The request is made only when the socket is readable, just before the read
/// that takes the bytes (what the adaptor floor does): hyper polls for a read several times
/// per exchange, and a poll that finds the socket not ready asks nothing of the kernel.
fn read_quickack(
    s: &mut TcpStream,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<std::io::Result<()>> {
    std::task::ready!(s.poll_read_ready(cx))?;
    let _ = socket2::SockRef::from(&*s).set_tcp_quickack(true);
    // Ready, so this reads (or, on stale readiness, clears it and waits again).
    Pin::new(s).poll_read(cx, buf)
}

impl<S: AsyncRead + Unpin> AsyncRead for Socket<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = (this.read)(&mut this.stream, cx, buf);
        if buf.filled().len() > before {
            this.read_any.store(true, Ordering::Relaxed);
        }
        r
    }
}

impl<S> Socket<S> {
    fn wrote(&self, n: usize) {
        if n > 0 {
            *self.wrote_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Socket<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            this.wrote(n);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            this.wrote(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Idle connections per instance id, on one shard.
#[derive(Debug, Default)]
pub struct Pool {
    idle: HashMap<u64, Vec<Conn>>,
}

impl Pool {
    /// A fresh-enough idle connection to instance `id`, if any.
    pub fn take(&mut self, id: u64) -> Option<Conn> {
        let list = self.idle.get_mut(&id)?;
        while let Some(mut c) = list.pop() {
            if c.idle_since.elapsed() < IDLE_REOPEN {
                c.reused = true;
                return Some(c);
            }
        }
        None
    }

    /// Keep `conn` for the next request to instance `id`.
    pub fn put(&mut self, id: u64, mut conn: Conn) {
        conn.idle_since = Instant::now();
        let list = self.idle.entry(id).or_default();
        if list.len() < MAX_IDLE_PER_INSTANCE {
            list.push(conn);
        }
    }

    /// Forget the connections of instances not in `live` (stopped ones).
    pub fn retain(&mut self, live: impl Fn(u64) -> bool) {
        self.idle.retain(|id, _| live(*id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn request() -> Outgoing {
        let mut headers = HeaderMap::new();
        headers.insert(hyper::header::HOST, "f".parse().unwrap());
        Outgoing {
            path: hyper::Uri::from_static("/"),
            headers,
            body: Bytes::from_static(b"x"),
        }
    }

    /// A server that reads one request and answers with `pieces`, one write each (with a
    /// pause between, so they arrive apart), then closes.
    async fn answer_with(pieces: Vec<&'static [u8]>) -> Answer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await.unwrap();
            for p in pieces {
                s.write_all(p).await.unwrap();
                s.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        let answer = conn.call(&request(), &|_| {}).await.unwrap();
        server.await.unwrap();
        answer
    }

    /// Found by the fuzz target `function_response`: a malformed answer whose head arrived in
    /// two reads was reported as `Closed` ("closed before answering"), so the dispatcher sent
    /// the event again at once on a new connection (the stale keep-alive rule), uncounted;
    /// the same bytes in one read were a counted `Http` failure.
    #[tokio::test]
    async fn a_malformed_answer_arriving_in_pieces_is_not_taken_for_a_closed_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await.unwrap();
            s.write_all(b"HTTP/1.1 204").await.unwrap();
            s.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = s.write_all(b" No Content\r\nServe'\0\0\0\0\0\0\0").await;
            let _ = s.shutdown().await;
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        let err = conn.call(&request(), &|_| {}).await.unwrap_err();
        assert!(
            !matches!(err, CallError::Closed | CallError::Io(_)),
            "a malformed answer was taken for a closed connection: {err:?}"
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_close_delimited_answer_arriving_in_pieces_is_read_to_the_end() {
        let a = answer_with(vec![
            b"HTTP/1.0 200 OK\r\nContent-",
            b"Type: text/plain\r\n\r\nhel",
            b"lo",
        ])
        .await;
        assert_eq!((a.status, &a.body[..], a.close), (200, &b"hello"[..], true));
        assert_eq!(a.content_type.as_deref(), Some("text/plain"));
    }

    #[tokio::test]
    async fn a_chunked_answer_arriving_in_pieces_is_decoded() {
        let a = answer_with(vec![
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab",
            b"c\r\n2\r",
            b"\nde\r\n0\r\n\r\n",
        ])
        .await;
        assert_eq!(
            (a.status, &a.body[..], a.close),
            (200, &b"abcde"[..], false)
        );
    }

    #[tokio::test]
    async fn a_body_many_times_the_head_limit_is_read_whole() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let n = MAX_BODY_BYTES / 2;
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await.unwrap();
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n");
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(&vec![b'a'; n]).await;
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        let a = conn.call(&request(), &|_| {}).await.unwrap();
        assert_eq!(a.body.len(), n);
    }

    #[tokio::test]
    async fn a_head_over_the_limit_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await.unwrap();
            let big = "a".repeat(MAX_HEAD_BYTES + 1);
            let head = format!("HTTP/1.1 200 OK\r\nX-Big: {big}\r\nContent-Length: 0\r\n\r\n");
            let _ = s.write_all(head.as_bytes()).await;
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        assert!(conn.call(&request(), &|_| {}).await.is_err());
    }

    /// Found by the `function_response` fuzz target: hyper hands `101 Switching Protocols`
    /// over as a final answer; sluice never asks for an upgrade, so it is a failed exchange
    /// and the connection is not pooled again.
    #[tokio::test]
    async fn a_101_answer_is_a_failure_not_an_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await.unwrap();
            let _ = s
                .write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")
                .await;
            let _ = s.read(&mut req).await;
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        let err = conn.call(&request(), &|_| {}).await.unwrap_err();
        assert!(matches!(err, CallError::Upgrade), "{err}");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await.unwrap();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                MAX_BODY_BYTES + 1
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(&vec![b'a'; MAX_BODY_BYTES + 1]).await;
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        let err = conn.call(&request(), &|_| {}).await.unwrap_err();
        assert!(matches!(err, CallError::BodyTooLarge), "{err}");
    }

    /// Issue 32: each connection's hyper driver was a task of its own, so every exchange was a
    /// hand-off between two tasks (the request's and the driver's); the request's task drives
    /// it now. Before the change one task stayed alive per open connection.
    #[tokio::test]
    async fn an_open_connection_has_no_task_of_its_own() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        // A thread of its own, so the runtime under test counts none of the server's tasks.
        let listener = listener.into_std().unwrap();
        let server = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).unwrap();
                let (mut s, _) = listener.accept().await.unwrap();
                for _ in 0..2 {
                    read_request(&mut s).await;
                    s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await
                        .unwrap();
                }
                let _ = stop_rx.await;
            });
        });
        let tasks = || {
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
        };
        let before = tasks();
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        for _ in 0..2 {
            let a = conn.call(&request(), &|_| {}).await.unwrap();
            assert_eq!((a.status, &a.body[..]), (200, &b"ok"[..]));
            assert_eq!(tasks(), before, "no task per connection");
        }
        drop(conn);
        let _ = stop_tx.send(());
        server.join().unwrap();
    }

    /// Read one test request (its body is the single byte `x`) from the server's side.
    async fn read_request(s: &mut tokio::net::TcpStream) -> Vec<u8> {
        let mut req = Vec::new();
        while !req.ends_with(b"\r\n\r\nx") {
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early");
            req.extend_from_slice(&buf[..n]);
        }
        req
    }

    #[tokio::test]
    async fn one_connection_carries_several_requests_and_says_when_each_was_written() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for _ in 0..3 {
                let req = read_request(&mut s).await;
                assert!(req.starts_with(b"POST / HTTP/1.1\r\n"));
                s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                    .await
                    .unwrap();
            }
            1
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        for _ in 0..3 {
            let seen = std::cell::Cell::new(false);
            let a = conn.call(&request(), &|_| seen.set(true)).await.unwrap();
            assert_eq!((a.status, a.close), (204, false));
            assert!(seen.get(), "written reported");
        }
        assert_eq!(accepted.await.unwrap(), 1, "one connection");
    }
}
