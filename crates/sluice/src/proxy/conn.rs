//! One upstream of one shard: the requests waiting for it and outstanding on it, and the task
//! that keeps its CoAP-over-TCP/TLS connection (RFC 8323) and moves requests over it.
//!
//! Owns: the connection (lazily opened on the first request, CSM exchange first, Ping when
//! idle, Pong to Pings, closed on Release/Abort, reopened with exponential backoff), token
//! allocation (unique per upstream, so per connection), the outstanding bound and the waiting
//! queue, retry-once of idempotent requests lost with a connection, and the 5.02/5.03/5.04
//! answers the proxy makes up. Does not own: which requests come here (`route.rs`).
//!
//! Invariants: every request handed to [`Upstream::forward`] resolves exactly once (upstream
//! response, or made-up 5.02/5.03/5.04/4.13); at most `max_outstanding` requests are written
//! and unanswered; a request is written at most twice, the second time only if idempotent.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use sluice_proto::coap::tcp::{self, Capabilities};
use sluice_proto::coap::{decode_tcp, encode_tcp, opt, Code, Message, MsgType, Token};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify};

use super::metrics::{ProxyMetrics, UpstreamMetrics, CONNECTED, CONNECTING, DISCONNECTED};
use crate::config::{CoapProxyConfig, ProxyTarget};

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

trait Io: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> Io for T {}

/// Why a connection ended (for the log).
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("connect: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    Timeout,
    #[error("closed by the server")]
    Closed,
    #[error("no Pong within ping_interval")]
    PingTimeout,
    #[error("server sent Release")]
    Release,
    #[error("server sent Abort")]
    Abort,
    #[error("server's first message was not a CSM")]
    NoCsm,
    #[error("bad CSM option {0}")]
    BadCsm(u16),
    #[error("bad frame: {0}")]
    Decode(#[from] sluice_proto::coap::DecodeError),
    #[error("no usable TLS configuration: {0}")]
    Tls(String),
    #[error("bad url")]
    BadUrl,
}

struct Pending {
    req: Message,
    reply: oneshot::Sender<Message>,
    retried: bool,
    written_at: Instant,
    seq: u64,
}

#[derive(Default)]
struct Queues {
    waiting: VecDeque<(Token, Pending)>,
    outstanding: HashMap<Token, Pending>,
}

/// One upstream on one shard.
pub struct Upstream {
    cfg: CoapProxyConfig,
    target: Option<ProxyTarget>,
    tls: Option<Result<Arc<rustls::ClientConfig>, String>>,
    /// Max-Age of a made-up 5.03.
    retry_after: Duration,
    /// Largest frame read from the upstream (announced in our CSM).
    max_message_size: usize,
    metrics: Arc<ProxyMetrics>,
    index: usize,
    queues: RefCell<Queues>,
    notify: Notify,
    next_token: Cell<u64>,
    task_running: Cell<bool>,
    /// The connection's key in the metrics' MPTCP state (0: none kept).
    mptcp_key: Cell<u64>,
}

/// A response the proxy makes up.
pub fn made_up(code: Code, diagnostic: &'static str) -> Message {
    let mut m = Message::new(MsgType::Con, code, 0, Token::EMPTY);
    m.payload = Bytes::from_static(diagnostic.as_bytes());
    m
}

fn idempotent(code: Code) -> bool {
    matches!(code, Code::GET | Code::PUT | Code::DELETE | Code::FETCH)
}

impl Upstream {
    pub fn new(
        cfg: &CoapProxyConfig,
        retry_after: Duration,
        max_message_size: usize,
        metrics: Arc<ProxyMetrics>,
        index: usize,
    ) -> Upstream {
        let target = cfg.target().ok();
        let tls = target.as_ref().filter(|t| t.tls).map(|_| {
            crate::sink::mqtt::tls::client_config(
                cfg.ca_file.as_deref(),
                cfg.cert_file.as_deref(),
                cfg.key_file.as_deref(),
                rustls::DEFAULT_VERSIONS,
            )
            .map_err(|e| {
                tracing::error!(upstream = %cfg.name, error = %e, "cannot build the upstream's TLS configuration");
                e.to_string()
            })
        });
        Upstream {
            cfg: cfg.clone(),
            target,
            tls,
            retry_after,
            max_message_size,
            metrics,
            index,
            queues: RefCell::new(Queues::default()),
            notify: Notify::new(),
            next_token: Cell::new(1),
            task_running: Cell::new(false),
            mptcp_key: Cell::new(0),
        }
    }

    fn m(&self) -> &UpstreamMetrics {
        &self.metrics.upstreams[self.index].1
    }

    fn gauges(&self, q: &Queues) {
        self.m().outstanding.set(q.outstanding.len() as i64);
        self.m().waiting.set(q.waiting.len() as i64);
    }

    /// Send `req` (already rewritten for the upstream) and resolve with the response; the
    /// response's token and type are the request's.
    pub async fn forward(self: Rc<Self>, req: Message) -> Message {
        let (device_token, mtype) = (req.token, req.mtype);
        let mut res = self.exchange(req).await;
        res.token = device_token;
        res.mtype = mtype;
        res
    }

    async fn exchange(self: &Rc<Self>, mut req: Message) -> Message {
        let seq = self.next_token.get();
        self.next_token.set(seq + 1);
        let token = Token::from_slice(&sluice_proto::coap::message::encode_uint(seq as u32))
            .filter(|_| seq <= u32::MAX as u64)
            .unwrap_or(Token::from_u64(seq));
        let (tx, rx) = oneshot::channel();
        {
            let mut q = self.queues.borrow_mut();
            if q.outstanding.len() + q.waiting.len()
                >= self.cfg.max_outstanding + self.cfg.max_waiting
            {
                self.m().unavailable.inc();
                let mut res = made_up(Code::SERVICE_UNAVAILABLE, "upstream busy");
                res.add_uint_option(opt::MAX_AGE, self.retry_after.as_secs().max(1) as u32);
                return res;
            }
            req.token = token;
            q.waiting.push_back((
                token,
                Pending {
                    req,
                    reply: tx,
                    retried: false,
                    written_at: Instant::now(),
                    seq,
                },
            ));
            self.gauges(&q);
        }
        self.ensure_task();
        self.notify.notify_one();
        match tokio::time::timeout(self.cfg.request_timeout, rx).await {
            Ok(Ok(res)) => res,
            Ok(Err(_)) => {
                self.m().bad_gateway.inc();
                made_up(Code::BAD_GATEWAY, "upstream connection lost")
            }
            Err(_) => {
                {
                    let mut q = self.queues.borrow_mut();
                    q.outstanding.remove(&token);
                    q.waiting.retain(|(t, _)| *t != token);
                    self.gauges(&q);
                }
                self.notify.notify_one(); // a slot may have freed
                self.m().timeouts.inc();
                made_up(Code::GATEWAY_TIMEOUT, "upstream did not answer in time")
            }
        }
    }

    fn ensure_task(self: &Rc<Self>) {
        if !self.task_running.replace(true) {
            tokio::task::spawn_local(self.clone().run());
        }
    }

    async fn run(self: Rc<Self>) {
        let mut backoff = MIN_BACKOFF;
        loop {
            let idle = {
                let q = self.queues.borrow();
                q.waiting.is_empty() && q.outstanding.is_empty()
            };
            if idle && backoff > MIN_BACKOFF {
                // Lost the connection with nothing to do: reconnect when there is.
                self.notify.notified().await;
            }
            self.m().state.set(CONNECTING);
            match tokio::time::timeout(self.cfg.connect_timeout, self.connect()).await {
                Ok(Ok((mut io, mut rbuf, caps))) => {
                    backoff = MIN_BACKOFF;
                    self.m().connects.inc();
                    self.m().state.set(CONNECTED);
                    tracing::info!(upstream = %self.cfg.name, "CoAP upstream connected");
                    let why = self.serve(&mut io, &mut rbuf, caps).await;
                    self.m().disconnects.inc();
                    tracing::warn!(upstream = %self.cfg.name, reason = %why, "CoAP upstream connection ended");
                }
                Ok(Err(e)) => {
                    self.m().connect_failures.inc();
                    tracing::warn!(upstream = %self.cfg.name, error = %e, "CoAP upstream connect failed");
                }
                Err(_) => {
                    self.m().connect_failures.inc();
                    tracing::warn!(upstream = %self.cfg.name, error = %ConnError::Timeout, "CoAP upstream connect failed");
                }
            }
            self.m().state.set(DISCONNECTED);
            self.connection_lost();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// TCP (or MPTCP with `mptcp = true`) to the upstream, trying each resolved address; the
    /// connection's MPTCP state is kept for status until `connection_lost`.
    async fn dial(&self, target: &ProxyTarget) -> std::io::Result<TcpStream> {
        let dial = crate::net::dial::Dial {
            mptcp: self.cfg.mptcp,
            ..Default::default()
        };
        let mut last = None;
        for addr in tokio::net::lookup_host((target.host.as_str(), target.port)).await? {
            let (socket, mptcp_socket) = crate::net::dial::socket_for(addr, &dial)?;
            match socket.connect(addr).await {
                Ok(tcp) => {
                    let key = self.m().mptcp.on_connect(&tcp, dial.mptcp, mptcp_socket);
                    self.m().mptcp.on_close(self.mptcp_key.replace(key));
                    return Ok(tcp);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} resolved to no address", target.host),
            )
        }))
    }

    async fn connect(&self) -> Result<(Box<dyn Io>, BytesMut, Capabilities), ConnError> {
        let target = self.target.as_ref().ok_or(ConnError::BadUrl)?;
        let tcp = self.dial(target).await?;
        tcp.set_nodelay(true)?;
        let mut io: Box<dyn Io> = match &self.tls {
            None => Box::new(tcp),
            Some(Err(e)) => return Err(ConnError::Tls(e.clone())),
            Some(Ok(config)) => {
                let name = self
                    .cfg
                    .server_name
                    .clone()
                    .unwrap_or_else(|| target.host.clone());
                let name = rustls::pki_types::ServerName::try_from(name)
                    .map_err(|e| ConnError::Tls(e.to_string()))?;
                let connector = tokio_rustls::TlsConnector::from(config.clone());
                Box::new(connector.connect(name, tcp).await?)
            }
        };
        let mut out = BytesMut::new();
        encode_tcp(&tcp::csm(self.max_message_size as u32, false), &mut out);
        io.write_all(&out).await?;
        io.flush().await?;
        let mut rbuf = BytesMut::with_capacity(4096);
        let first = loop {
            if let Some(m) = decode_tcp(&mut rbuf, self.max_message_size)? {
                break m;
            }
            if io.read_buf(&mut rbuf).await? == 0 {
                return Err(ConnError::Closed);
            }
        };
        if first.code != Code::CSM {
            let _ = self
                .send_abort(&mut io, None, "first message must be a CSM")
                .await;
            return Err(ConnError::NoCsm);
        }
        match tcp::read_csm(&first, Capabilities::default()) {
            Ok(caps) => Ok((io, rbuf, caps)),
            Err(n) => {
                let _ = self
                    .send_abort(&mut io, Some(n), "unknown critical CSM option")
                    .await;
                Err(ConnError::BadCsm(n))
            }
        }
    }

    async fn send_abort(
        &self,
        io: &mut Box<dyn Io>,
        option: Option<u16>,
        why: &'static str,
    ) -> std::io::Result<()> {
        let mut out = BytesMut::new();
        encode_tcp(&tcp::abort(option, why), &mut out);
        io.write_all(&out).await?;
        io.flush().await
    }

    /// Move requests over a connected `io` until it ends.
    async fn serve(
        &self,
        io: &mut Box<dyn Io>,
        rbuf: &mut BytesMut,
        mut caps: Capabilities,
    ) -> ConnError {
        enum Ev {
            Read(std::io::Result<usize>),
            Work,
            Idle,
        }
        let mut last_read = tokio::time::Instant::now();
        let mut ping_sent = false;
        let mut wbuf = BytesMut::new();
        loop {
            // Frames already buffered (the server may send more right behind its CSM).
            loop {
                match decode_tcp(rbuf, self.max_message_size) {
                    Ok(Some(m)) => {
                        if let Err(e) = self.on_message(m, &mut caps, &mut ping_sent, &mut wbuf) {
                            return e;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = self.send_abort(io, None, "bad frame").await;
                        return ConnError::Decode(e);
                    }
                }
            }
            self.fill(&caps, &mut wbuf);
            if !wbuf.is_empty() {
                let written = async {
                    io.write_all(&wbuf).await?;
                    io.flush().await
                };
                if let Err(e) = written.await {
                    return ConnError::Io(e);
                }
                wbuf.clear();
            }
            let deadline = last_read + self.cfg.ping_interval;
            let ev = tokio::select! {
                r = io.read_buf(rbuf) => Ev::Read(r),
                _ = self.notify.notified() => Ev::Work,
                _ = tokio::time::sleep_until(deadline) => Ev::Idle,
            };
            match ev {
                Ev::Read(Ok(0)) => return ConnError::Closed,
                Ev::Read(Err(e)) => return ConnError::Io(e),
                Ev::Read(Ok(_)) => {
                    last_read = tokio::time::Instant::now();
                    ping_sent = false;
                }
                Ev::Work => {}
                Ev::Idle if ping_sent => return ConnError::PingTimeout,
                Ev::Idle => {
                    encode_tcp(&tcp::ping(Token::EMPTY), &mut wbuf);
                    ping_sent = true;
                    last_read = tokio::time::Instant::now();
                }
            }
        }
    }

    /// One frame from the upstream.
    fn on_message(
        &self,
        m: Message,
        caps: &mut Capabilities,
        ping_sent: &mut bool,
        wbuf: &mut BytesMut,
    ) -> Result<(), ConnError> {
        match m.code {
            Code::PING => encode_tcp(&tcp::pong(&m), wbuf),
            Code::PONG => *ping_sent = false,
            Code::RELEASE => return Err(ConnError::Release),
            Code::ABORT => return Err(ConnError::Abort),
            Code::CSM => *caps = tcp::read_csm(&m, *caps).map_err(ConnError::BadCsm)?,
            c if c.is_response() => {
                let mut q = self.queues.borrow_mut();
                let Some(p) = q.outstanding.remove(&m.token) else {
                    // Answered after its 5.04, or not ours.
                    return Ok(());
                };
                self.gauges(&q);
                drop(q);
                self.m().latency.observe(p.written_at.elapsed());
                self.m().responses[c.class() as usize].inc();
                let mut res = m;
                res.remove_option(opt::OBSERVE);
                let _ = p.reply.send(res);
                // A slot freed: more may go out.
                self.notify.notify_one();
            }
            _ => {} // empty (keep-alive), requests to the proxy, unknown signals: ignored
        }
        Ok(())
    }

    /// Move waiting requests to outstanding while slots allow, encoding them into `wbuf`.
    fn fill(&self, caps: &Capabilities, wbuf: &mut BytesMut) {
        let mut q = self.queues.borrow_mut();
        while q.outstanding.len() < self.cfg.max_outstanding {
            let Some((token, mut p)) = q.waiting.pop_front() else {
                break;
            };
            if p.reply.is_closed() {
                continue; // timed out while waiting
            }
            let before = wbuf.len();
            encode_tcp(&p.req, wbuf);
            if wbuf.len() - before > caps.max_message_size {
                wbuf.truncate(before);
                let mut res = made_up(
                    Code::REQUEST_ENTITY_TOO_LARGE,
                    "over the upstream's Max-Message-Size",
                );
                res.add_uint_option(
                    opt::SIZE1,
                    caps.max_message_size.min(u32::MAX as usize) as u32,
                );
                let _ = p.reply.send(res);
                continue;
            }
            p.written_at = Instant::now();
            q.outstanding.insert(token, p);
        }
        self.gauges(&q);
    }

    /// The connection is gone: idempotent requests written once go first in line again,
    /// others are answered 5.02.
    fn connection_lost(&self) {
        self.m().mptcp.on_close(self.mptcp_key.take());
        let mut q = self.queues.borrow_mut();
        let mut lost: Vec<(Token, Pending)> = q.outstanding.drain().collect();
        lost.sort_by_key(|(_, p)| p.seq);
        for (token, mut p) in lost.into_iter().rev() {
            if p.reply.is_closed() {
                continue;
            }
            if idempotent(p.req.code) && !p.retried {
                p.retried = true;
                self.m().retries.inc();
                q.waiting.push_front((token, p));
            } else {
                self.m().bad_gateway.inc();
                let _ = p
                    .reply
                    .send(made_up(Code::BAD_GATEWAY, "upstream connection lost"));
            }
        }
        self.gauges(&q);
    }
}
