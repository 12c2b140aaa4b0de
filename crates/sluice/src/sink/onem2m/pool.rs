//! The transport's pool of keep-alive HTTP/1.1 connections to the CSE, and the requests each
//! one waits on.
//!
//! Owns: opening one connection (TCP with the lane's socket marks, TLS with the uplink's
//! rustls configuration), a connection's pending bytes, read buffer and the FIFO of requests
//! written on it (HTTP/1.1 answers pipelined requests in order, so the front one is what the
//! next response answers), and reading any connection of the pool cancel-safely. Does not own:
//! what a request or response means (`mod.rs`) or their bytes (`http.rs`).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::Poll;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::TlsConnector;

use crate::config::UplinkConfig;
use crate::sink::transport::SendId;
use crate::sink::{Lane, UplinkError};

/// Bytes read from one connection at a time.
pub(super) const READ_CHUNK: usize = 16 * 1024;

pub(super) trait Io: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> Io for T {}

/// A request the transport can write again (after the CSE closed a connection before
/// answering it, or after a 4004): each write gets a fresh X-M2M-RI.
#[derive(Debug, Clone)]
pub(super) enum Req {
    /// Register the AE (`POST {base}`, ty=2).
    Ae,
    /// Create container `name` under `parent` (ty=3); `key` is its entry in the known set.
    Cnt {
        parent: String,
        name: String,
        key: String,
    },
    /// Create a contentInstance (ty=4) in `target` (`?rcn=0`).
    Cin {
        id: SendId,
        target: String,
        body: Bytes,
        device_key: String,
        stream_key: String,
        /// It was answered 4004 once and retried after re-creating its parents.
        retried: bool,
    },
}

/// One request written (or about to be) on a connection, waiting for its response.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) req: Req,
    pub(super) since: Instant,
}

/// One keep-alive connection of the pool.
pub(super) struct Conn {
    /// `None` while closed (the next flush opens it again).
    pub(super) io: Option<Box<dyn Io>>,
    /// Encoded requests not yet written.
    pub(super) out: BytesMut,
    /// Received bytes and the response decoder's progress through them.
    pub(super) rbuf: super::http::ResponseBuf,
    /// Requests in the order they were (or will be) written.
    pub(super) waiting: VecDeque<Waiting>,
    /// How many of `waiting` (from the front) were written and await their response.
    pub(super) written: usize,
    /// When it last wrote or read anything (or was opened).
    pub(super) last_io: Instant,
}

impl Default for Conn {
    fn default() -> Conn {
        Conn {
            io: None,
            out: BytesMut::new(),
            rbuf: super::http::ResponseBuf::new(),
            waiting: VecDeque::new(),
            written: 0,
            last_io: Instant::now(),
        }
    }
}

impl Conn {
    pub(super) fn close(&mut self) {
        self.io = None;
        self.out.clear();
        self.rbuf.clear();
        self.waiting.clear();
        self.written = 0;
    }
}

/// What reading the pool found.
pub(super) enum ReadEvent {
    /// Bytes appended to `conns[i].rbuf`.
    Data(usize),
    /// Connection `i` reached end of stream.
    Eof(usize),
    Failed(std::io::Error),
}

/// Read whichever open connection has bytes first, starting the scan at `start` (fairness).
/// Cancel-safe: bytes are appended in the same poll that returns them.
pub(super) async fn read_any(conns: &mut [Conn], scratch: &mut [u8], start: usize) -> ReadEvent {
    std::future::poll_fn(|cx| {
        let n = conns.len();
        for k in 0..n {
            let i = (start + k) % n;
            let conn = &mut conns[i];
            let Some(io) = conn.io.as_mut() else { continue };
            let mut rb = ReadBuf::new(scratch);
            match Pin::new(io).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    return Poll::Ready(ReadEvent::Eof(i))
                }
                Poll::Ready(Ok(())) => {
                    conn.rbuf.extend_from_slice(rb.filled());
                    conn.last_io = Instant::now();
                    return Poll::Ready(ReadEvent::Data(i));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(ReadEvent::Failed(e)),
                Poll::Pending => {}
            }
        }
        Poll::Pending
    })
    .await
}

/// How to open connections to the CSE.
pub(super) struct Dialer {
    pub(super) cfg: std::rc::Rc<UplinkConfig>,
    pub(super) lane: Lane,
    pub(super) tls: Option<TlsConnector>,
}

impl Dialer {
    /// TCP (and TLS) to the CSE.
    pub(super) async fn open(&self) -> Result<Box<dyn Io>, UplinkError> {
        let cfg = &self.cfg;
        let host = cfg.url.host.as_str();
        let port = cfg.url.port;
        let tls = if cfg.url.tls {
            let connector = self.tls.clone().ok_or(UplinkError::TlsConfigMissing)?;
            let name = cfg.tls_server_name().to_owned();
            let server_name = ServerName::try_from(name.clone())
                .map_err(|_| UplinkError::InvalidServerName(name))?;
            Some((connector, server_name))
        } else if !cfg.allow_plaintext {
            return Err(UplinkError::PlaintextNotAllowed);
        } else {
            None
        };
        let lowat = u32::try_from(cfg.notsent_lowat.as_u64()).unwrap_or(u32::MAX);
        let dial = crate::net::dial::Dial::default();
        let (tcp, _) = crate::sink::socket::connect(host, port, self.lane, lowat, &dial)
            .await
            .map_err(|source| UplinkError::CloudUnreachable {
                addr: format!("{host}:{port}"),
                source,
            })?;
        // Requests are coalesced by the outbox; Nagle would only delay a lone one.
        let _ = tcp.set_nodelay(true);
        Ok(match tls {
            Some((connector, server_name)) => Box::new(
                connector
                    .connect(server_name, tcp)
                    .await
                    .map_err(|e| crate::sink::mqtt::tls_error(e, UplinkError::TlsHandshake))?,
            ),
            None => Box::new(tcp),
        })
    }
}
