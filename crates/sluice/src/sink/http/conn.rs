//! One HTTP/1.1 exchange on a keep-alive connection to a function, and the shard's pool of
//! idle connections per instance.
//!
//! Owns: connecting (an instance's loopback address, or a remote function's host), sending one
//! request and reading its response directly on the socket — the request's head and body
//! encoded into one buffer and written at once, the answer decoded by the sans-IO decoder
//! of the oneM2M transport ([`ResponseBuf::one_at_a_time`]: the head, fixed-length, chunked
//! and close-delimited bodies, `Connection: close` and HTTP/1.0) — the body bounded by
//! [`MAX_BODY_BYTES`], and keeping idle connections for reuse. Does not own: timeouts,
//! retries or what an answer means (`dispatch.rs`).
//!
//! A connection is used by one request at a time (no pipelining: Knative's concurrency is
//! requests in flight, each on its own connection). A response that says `Connection: close`
//! (or is HTTP/1.0, or has a body that runs to the close), or any error, ends the
//! connection; otherwise it goes back to the pool (bytes after an answer make its next use
//! fail as a stale connection's). Connections idle for more
//! than [`IDLE_REOPEN`] are not reused, so a server's keep-alive timeout never closes one
//! under a request.
//!
//! Per request, the cost is kept near what any HTTP client must pay (issue 32; figures in
//! docs/perf/functions.md): the exchange runs in the request's own task with no HTTP
//! library's connection machinery between it and the socket (one write; a read only when the
//! socket's readiness says bytes are there, and none once the answer is whole), and the
//! quick-ACK request is made only before such a read. An idle pooled connection is not
//! polled: a server that closed it meanwhile (or said something, such as a 408, before
//! closing) is noticed at its next use, without a system call when the reactor already saw
//! it readable, else as a failure before any answer byte on a reused connection, which
//! `dispatch.rs` sends again at once on a new one.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::task::Context;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use bytestring::ByteString;
use hyper::header::{HeaderMap, CONTENT_LENGTH, TRANSFER_ENCODING};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::sink::onem2m::http::{HttpError, ResponseBuf, MAX_BODY_BYTES};

/// An idle connection older than this is closed instead of reused.
pub const IDLE_REOPEN: Duration = Duration::from_secs(2);
/// Idle connections kept per instance on one shard.
pub const MAX_IDLE_PER_INSTANCE: usize = 64;
/// Room made in the receive buffer before each read.
const READ_CHUNK: usize = 4096;
/// A pooled connection keeps buffers up to this capacity between exchanges (larger ones, left
/// by a large request or answer, are dropped).
const KEEP_BUF_BYTES: usize = 8 * 1024;

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
    Http(#[source] HttpError),
    #[error("response body larger than {MAX_BODY_BYTES} bytes")]
    BodyTooLarge,
    /// `101 Switching Protocols` to a request that asked for no upgrade: not an answer, and
    /// the connection no longer speaks HTTP/1.1.
    #[error("the function answered 101 Switching Protocols to a request without Upgrade")]
    Upgrade,
}

impl From<HttpError> for CallError {
    fn from(e: HttpError) -> CallError {
        match e {
            HttpError::BodyTooLarge(_) => CallError::BodyTooLarge,
            HttpError::Upgrade => CallError::Upgrade,
            e => CallError::Http(e),
        }
    }
}

/// One request as the dispatcher builds it once per event: path, headers (`Host`, `ce-*`,
/// `Content-Type`; [`Conn::call`] adds `Content-Length`) and body.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub path: hyper::Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Outgoing {
    /// Append the request (`POST`, HTTP/1.1) to `out`: head and body in one buffer.
    fn encode(&self, out: &mut BytesMut) {
        let target = match self.path.scheme() {
            // Origin form, what a server expects from a client that is no proxy.
            None => self.path.path_and_query().map_or("/", |p| p.as_str()),
            Some(_) => "",
        };
        let mut len = 64 + target.len() + self.body.len();
        for (name, value) in &self.headers {
            len += name.as_str().len() + value.len() + 4;
        }
        out.reserve(len);
        out.put_slice(b"POST ");
        if target.is_empty() {
            out.put_slice(self.path.to_string().as_bytes());
        } else {
            out.put_slice(target.as_bytes());
        }
        out.put_slice(b" HTTP/1.1\r\n");
        for (name, value) in &self.headers {
            // The body's framing is ours to state (header values hold no CR or LF).
            if name == CONTENT_LENGTH || name == TRANSFER_ENCODING {
                continue;
            }
            out.put_slice(name.as_str().as_bytes());
            out.put_slice(b": ");
            out.put_slice(value.as_bytes());
            out.put_slice(b"\r\n");
        }
        let _ = write!(out, "content-length: {}\r\n\r\n", self.body.len());
        out.put_slice(&self.body);
    }
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

/// Any byte stream, for [`Conn::over`].
trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

enum Io {
    Tcp(TcpStream),
    Other(Box<dyn Stream>),
}

/// One open connection.
pub struct Conn {
    io: Io,
    /// The request being written (kept between exchanges, within [`KEEP_BUF_BYTES`]).
    out: BytesMut,
    /// Received bytes and the answer's decoding.
    rx: ResponseBuf,
    /// Bytes came after the last answer: not ours to guess at, so the connection's next use
    /// fails as a stale one (whatever the timing of those bytes: they may as well arrive
    /// while it is idle).
    spoke_unasked: bool,
    idle_since: Instant,
    /// It carried an exchange before (a failure before any answer byte may be a stale
    /// keep-alive connection the server closed meanwhile).
    pub reused: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("tcp", &matches!(self.io, Io::Tcp(_)))
            .field("idle_since", &self.idle_since)
            .field("reused", &self.reused)
            .finish()
    }
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
        Ok(Conn::with(Io::Tcp(stream)))
    }

    /// A connection over any byte stream (no quick-ACK; `call`'s `written` is still told).
    /// For the fuzz target `function_response`, which answers from memory; not an API.
    #[doc(hidden)]
    pub async fn over<T>(io: T) -> Result<Conn, CallError>
    where
        T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        Ok(Conn::with(Io::Other(Box::new(io))))
    }

    fn with(io: Io) -> Conn {
        Conn {
            io,
            out: BytesMut::new(),
            rx: ResponseBuf::one_at_a_time(),
            spoke_unasked: false,
            idle_since: Instant::now(),
            reused: false,
        }
    }

    /// Send `request`, tell `written` when it was in the socket, and read its answer.
    pub async fn call(
        &mut self,
        request: &Outgoing,
        written: &dyn Fn(Instant),
    ) -> Result<Answer, CallError> {
        if self.reused {
            self.check_idle()?;
        }
        self.out.clear();
        request.encode(&mut self.out);
        let sent = match &mut self.io {
            Io::Tcp(s) => s.write_all(&self.out).await,
            Io::Other(s) => s.write_all(&self.out).await,
        };
        // A write that fails found the connection closed (or reset) before any answer.
        sent.map_err(CallError::Io)?;
        written(Instant::now());
        if self.out.capacity() > KEEP_BUF_BYTES {
            self.out = BytesMut::new();
        }
        let r = self.answer().await;
        if !self.rx.is_empty() {
            self.spoke_unasked = true;
        }
        if !self.rx.is_empty() || self.rx.unparsed_mut().capacity() > KEEP_BUF_BYTES {
            self.rx = ResponseBuf::one_at_a_time();
        }
        r
    }

    /// Read until the answer is whole.
    async fn answer(&mut self) -> Result<Answer, CallError> {
        self.rx.clear();
        let mut read_any = false;
        loop {
            if let Some(r) = self.rx.decode()? {
                let close = r.close;
                return Ok(answer_of(r, close));
            }
            let n = match read(&mut self.io, self.rx.unparsed_mut()).await {
                Ok(n) => n,
                Err(e) if read_any => return Err(CallError::Http(io_truncated(e))),
                Err(e) => return Err(CallError::Io(e)),
            };
            if n == 0 {
                return match self.rx.finish() {
                    Ok(Some(r)) => Ok(answer_of(r, true)),
                    Ok(None) if !read_any => Err(CallError::Closed),
                    Ok(None) => Err(CallError::Http(HttpError::Truncated)),
                    Err(e) => Err(e.into()),
                };
            }
            read_any = true;
        }
    }

    /// Before reusing an idle connection: if bytes came after its last answer, or the
    /// reactor already saw it readable, the server closed it (or spoke unasked, such as a
    /// 408 before closing) — a stale connection,
    /// failed as closed before any answer (`dispatch.rs` opens a new one). Costs a system
    /// call only when the socket is readable.
    fn check_idle(&mut self) -> Result<(), CallError> {
        if self.spoke_unasked {
            return Err(CallError::Closed);
        }
        let Io::Tcp(s) = &mut self.io else {
            return Ok(());
        };
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if s.poll_read_ready(&mut cx).is_pending() {
            return Ok(());
        }
        let mut probe = [0u8; 1];
        match s.try_read(&mut probe) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            _ => Err(CallError::Closed),
        }
    }
}

fn answer_of(r: crate::sink::onem2m::http::Response, close: bool) -> Answer {
    Answer {
        status: r.status,
        body: r.body,
        close,
        content_type: r.content_type.and_then(|c| ByteString::try_from(c).ok()),
    }
}

/// An I/O error after some of the answer arrived: a truncated answer.
fn io_truncated(_: std::io::Error) -> HttpError {
    HttpError::Truncated
}

/// Read what is there into `buf` (0: end of stream).
async fn read(io: &mut Io, buf: &mut BytesMut) -> std::io::Result<usize> {
    buf.reserve(READ_CHUNK);
    match io {
        Io::Tcp(s) => {
            s.readable().await?;
            quickack(s);
            // Through `AsyncRead` rather than `try_read_buf`: a read shorter than the room
            // given clears the socket's readiness (tokio), so the next exchange's reuse check
            // and read cost no `recvfrom` that finds nothing (one per event otherwise, seen
            // with `scripts/fn-syscalls-per-event`).
            s.read_buf(buf).await
        }
        Io::Other(s) => s.read_buf(buf).await,
    }
}

/// The quick-ACK request before a read of a function's TCP connection (a server that
/// writes its head and body apart with Nagle on — Python's http.server — would otherwise
/// hold the body until our delayed ACK, 40 ms per request; the kernel leaves quick-ack mode
/// by itself). Made only when the socket is readable, just before the read that takes the
/// bytes (what the adaptor floor does).
fn quickack(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_tcp_quickack(true);
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
    use crate::sink::onem2m::http::MAX_HEAD_BYTES;
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

    /// Issue 32 item 6: the request goes out as one buffer (head and body), in origin form,
    /// with the dispatcher's headers and our own `Content-Length` (any in the map dropped).
    #[test]
    fn a_request_is_encoded_whole_in_one_buffer() {
        let mut r = request();
        r.path = hyper::Uri::from_static("/fn/a?x=1");
        r.headers
            .insert(hyper::header::CONTENT_LENGTH, "99".parse().unwrap());
        r.headers.insert("ce-id", "7".parse().unwrap());
        r.body = Bytes::from_static(b"body");
        let mut out = BytesMut::new();
        r.encode(&mut out);
        assert_eq!(
            &out[..],
            &b"POST /fn/a?x=1 HTTP/1.1\r\nhost: f\r\nce-id: 7\r\ncontent-length: 4\r\n\r\nbody"[..]
        );
    }

    /// Bytes after a complete answer (a server that answers twice, or pipelines junk) leave
    /// the connection in an unknown state: the answer stands, and the connection's next use
    /// fails as a stale one's (sent again on a new connection by `dispatch.rs`) without
    /// writing to it.
    #[tokio::test]
    async fn bytes_after_the_answer_make_the_connection_stale() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            read_request(&mut s).await;
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1")
                .await
                .unwrap();
            let mut rest = [0u8; 64];
            s.read(&mut rest).await.unwrap()
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        let a = conn.call(&request(), &|_| {}).await.unwrap();
        assert_eq!((a.status, &a.body[..]), (200, &b"ok"[..]));
        conn.reused = true;
        let err = conn.call(&request(), &|_| {}).await.unwrap_err();
        assert!(matches!(err, CallError::Closed), "{err:?}");
        drop(conn);
        assert_eq!(server.await.unwrap(), 0, "no second request written");
    }

    /// A pooled connection the server closed while it was idle (here after a `408`, as
    /// servers do at their keep-alive timeout) fails as closed before any answer — what
    /// `dispatch.rs` sends again at once on a new connection — and the request is not
    /// written to it.
    #[tokio::test]
    async fn a_reused_connection_the_server_closed_while_idle_fails_as_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            read_request(&mut s).await;
            s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                .await
                .unwrap();
            s.write_all(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            s.shutdown().await.unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            rest
        });
        let mut conn = Conn::open(&Target::Addr(addr)).await.unwrap();
        // (The 408 may arrive with the 204: then the first answer already ends the connection.)
        let first = conn.call(&request(), &|_| {}).await.unwrap();
        assert_eq!(first.status, 204);
        let mut pool = Pool::default();
        pool.put(1, conn);
        let mut conn = pool.take(1).expect("pooled");
        if let Io::Tcp(s) = &conn.io {
            s.readable().await.unwrap();
        }
        let err = conn.call(&request(), &|_| {}).await.unwrap_err();
        assert!(matches!(err, CallError::Closed), "{err:?}");
        drop(conn);
        assert_eq!(server.await.unwrap(), b"", "no second request written");
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
