//! One HTTP/1.1 exchange on a keep-alive connection to a function, and the shard's pool of
//! idle connections per instance.
//!
//! Owns: connecting (an instance's loopback address, or a remote function's host), writing one
//! request, reading its response (decoded by the sans-IO parser shared with the oneM2M
//! transport, `sink::onem2m::http`, plus close-delimited bodies, which a server that answers
//! one request per connection may send), and keeping idle connections for reuse. Does not own:
//! timeouts, retries or what an answer means (`dispatch.rs`).
//!
//! A connection is used by one request at a time (no pipelining: Knative's concurrency is
//! requests in flight, each on its own connection). A response that says `Connection: close`,
//! or any error, ends the connection; otherwise it goes back to the pool. Connections idle for
//! more than [`IDLE_REOPEN`] are not reused, so a server's keep-alive timeout never closes one
//! under a request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::sink::onem2m::http::{self, HttpError, MAX_BODY_BYTES, MAX_HEAD_BYTES};

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
    Http(#[from] HttpError),
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
    stream: TcpStream,
    /// Received bytes and the decoder's progress through them.
    buf: http::ResponseBuf,
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
        Ok(Conn {
            stream,
            buf: http::ResponseBuf::new(),
            idle_since: Instant::now(),
            reused: false,
        })
    }

    /// Write `request`, tell `written` when it is in the socket, and read its answer.
    pub async fn call(
        &mut self,
        request: &[u8],
        written: &dyn Fn(Instant),
    ) -> Result<Answer, CallError> {
        self.stream
            .write_all(request)
            .await
            .map_err(CallError::Io)?;
        written(Instant::now());
        self.read_answer().await
    }

    async fn read_answer(&mut self) -> Result<Answer, CallError> {
        self.buf.clear();
        loop {
            match self.buf.decode() {
                Ok(Some(r)) => {
                    return Ok(Answer {
                        status: r.status,
                        body: r.body,
                        close: r.close,
                        content_type: r.content_type.and_then(|c| ByteString::try_from(c).ok()),
                    })
                }
                Ok(None) => {}
                Err(HttpError::Undelimited) => return self.read_to_end().await,
                Err(e) => return Err(e.into()),
            }
            if self.buf.len() > MAX_HEAD_BYTES + MAX_BODY_BYTES {
                return Err(HttpError::HeadTooLarge.into());
            }
            self.buf.unparsed_mut().reserve(4096);
            // Acknowledge at once what the function sends: a server that writes its head and
            // body apart with Nagle on (Python's http.server) would otherwise hold the body
            // until our delayed ACK, 40 ms per request. The kernel leaves quick-ack mode by
            // itself, so it is asked again before every read.
            let _ = socket2::SockRef::from(&self.stream).set_tcp_quickack(true);
            let n = self
                .stream
                .read_buf(self.buf.unparsed_mut())
                .await
                .map_err(CallError::Io)?;
            if n == 0 {
                return Err(CallError::Closed);
            }
        }
    }

    /// A response whose body ends with the connection (HTTP/1.0 style).
    async fn read_to_end(&mut self) -> Result<Answer, CallError> {
        loop {
            if self.buf.len() > MAX_HEAD_BYTES + MAX_BODY_BYTES {
                return Err(HttpError::BodyTooLarge(self.buf.len() as u64).into());
            }
            self.buf.unparsed_mut().reserve(4096);
            let n = self
                .stream
                .read_buf(self.buf.unparsed_mut())
                .await
                .map_err(CallError::Io)?;
            if n == 0 {
                break;
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; http::MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(self.buf.unparsed_mut()) {
            Ok(httparse::Status::Complete(head)) => {
                let status = resp.code.unwrap_or(0);
                let content_type = resp
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-type"))
                    .and_then(|h| std::str::from_utf8(h.value.trim_ascii()).ok())
                    .map(ByteString::from);
                let body = self.buf.unparsed_mut().split_off(head).freeze();
                Ok(Answer {
                    status,
                    body,
                    close: true,
                    content_type,
                })
            }
            _ => Err(HttpError::BadHead("incomplete response before close").into()),
        }
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
    use tokio::net::TcpListener;

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
        let answer = conn
            .call(
                b"POST / HTTP/1.1\r\nHost: f\r\nContent-Length: 0\r\n\r\n",
                &|_| {},
            )
            .await
            .unwrap();
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
}
