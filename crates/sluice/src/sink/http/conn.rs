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
//! timeout never closes one under a request. Each connection's hyper driver is a task of its
//! own; it ends when the connection's [`Conn`] is dropped or the server closes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
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
    #[error("the function closed the connection before answering")]
    Closed,
    #[error("malformed HTTP response: {0}")]
    Http(#[source] hyper::Error),
    #[error("response body larger than {MAX_BODY_BYTES} bytes")]
    BodyTooLarge,
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

/// One open connection.
#[derive(Debug)]
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
    /// When the connection last wrote bytes (set by its socket, read after an exchange).
    wrote_at: Arc<Mutex<Option<Instant>>>,
    idle_since: Instant,
    /// It carried an exchange before (a failure before any answer byte may be a stale
    /// keep-alive connection the server closed meanwhile).
    pub reused: bool,
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
        let socket = Socket {
            stream,
            wrote_at: wrote_at.clone(),
        };
        Conn::start(socket, wrote_at).await
    }

    /// A connection over any byte stream (the write time is never noted, so `call`'s
    /// `written` is not called). For the fuzz target `function_response`, which answers
    /// from memory; not an API.
    #[doc(hidden)]
    pub async fn over<T>(io: T) -> Result<Conn, CallError>
    where
        T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        Conn::start(io, Arc::new(Mutex::new(None))).await
    }

    async fn start<T>(io: T, wrote_at: Arc<Mutex<Option<Instant>>>) -> Result<Conn, CallError>
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
        tokio::spawn(async move {
            // Ends with the connection; its errors reach the exchange that was running.
            let _ = driver.await;
        });
        Ok(Conn {
            sender,
            wrote_at,
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
        self.sender.ready().await?;
        let mut req = Request::new(Full::new(request.body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = request.path.clone();
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = request.headers.clone();
        *self.wrote_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let response = self.sender.send_request(req).await?;
        if let Some(at) = *self.wrote_at.lock().unwrap_or_else(|p| p.into_inner()) {
            written(at);
        }
        let status = response.status().as_u16();
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
        let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| match e.downcast::<hyper::Error>() {
                Ok(h) => CallError::from(*h),
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

/// The connection's socket for hyper: asks the kernel to acknowledge at once before every
/// read (a server that writes its head and body apart with Nagle on — Python's http.server —
/// would otherwise hold the body until our delayed ACK, 40 ms per request; the kernel leaves
/// quick-ack mode by itself), and notes when it last wrote (the dispatch latency's end).
struct Socket {
    stream: TcpStream,
    wrote_at: Arc<Mutex<Option<Instant>>>,
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let _ = socket2::SockRef::from(&this.stream).set_tcp_quickack(true);
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl Socket {
    fn wrote(&self, n: usize) {
        if n > 0 {
            *self.wrote_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    }
}

impl AsyncWrite for Socket {
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

    #[tokio::test]
    async fn one_connection_carries_several_requests_and_says_when_each_was_written() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for _ in 0..3 {
                let mut req = Vec::new();
                while !req.ends_with(b"\r\n\r\nx") {
                    let mut buf = [0u8; 1024];
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0, "closed early");
                    req.extend_from_slice(&buf[..n]);
                }
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
