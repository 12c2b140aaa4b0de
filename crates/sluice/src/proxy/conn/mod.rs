//! One upstream of one shard: the requests waiting for it and outstanding on it, and the
//! tasks that keep its CoAP-over-TCP/TLS connections (RFC 8323) and move requests over them:
//! one connection, routed by the kernel, or with `paths` one per path (ADR 0012).
//!
//! Owns: the connections (each opened on the first request, CSM exchange first, Ping when
//! idle, Pong to Pings, closed on Release/Abort, reopened with exponential backoff), token
//! allocation (unique per upstream, so per connection), the outstanding bound and the waiting
//! queue, retry-once of idempotent requests lost with a connection, and the 5.02/5.03/5.04
//! answers the proxy makes up. With `paths`: which path takes a waiting request (pulled by
//! the path [`sched::pick`] names, when it has room), a path declared dead when its
//! connection ends, when it has requests outstanding and read nothing for `path_timeout`
//! (stalled: a blackhole sends no RST) or when the link watcher reports its interface down;
//! a dead path keeps reconnecting with backoff (at once when its link comes back) and takes
//! requests again when it is up. Does not own: which requests come here (`route.rs`).
//!
//! Idempotent (RFC 7252 §5.8, RFC 8132 §2 for FETCH): GET, FETCH, PUT, DELETE; written again
//! once, on another path when there is one, if their connection is lost before the answer.
//! POST, PATCH, iPATCH are not (the server may have acted): answered 5.02 Bad Gateway.
//!
//! Invariants: every request handed to [`Upstream::forward`] resolves exactly once (upstream
//! response, or made-up 5.02/5.03/5.04/4.13) within `request_timeout`; at most
//! `max_outstanding` requests are written and unanswered per connection; a request is written
//! at most twice, the second time only if idempotent.

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

use super::metrics::{
    PathFailover, ProxyMetrics, ProxyPathMetrics, UpstreamMetrics, CONNECTED, CONNECTING,
    DISCONNECTED,
};
use super::sched::{self, PathView};
use crate::config::{CoapProxyConfig, ProxyTarget};
use crate::net::dial::Dial;
use crate::net::links::{LinkTable, LinkWatch};

mod io;

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
    #[error("requests outstanding and nothing read for path_timeout")]
    Stalled,
    #[error("the path's link went down")]
    LinkDown,
}

impl ConnError {
    fn failover(&self) -> PathFailover {
        match self {
            ConnError::Stalled => PathFailover::Stalled,
            ConnError::LinkDown => PathFailover::LinkDown,
            _ => PathFailover::Dead,
        }
    }
}

struct Pending {
    req: Message,
    reply: oneshot::Sender<Message>,
    retried: bool,
    written_at: Instant,
    seq: u64,
    /// The path that lost it (a retry goes elsewhere when it can).
    avoid: Option<usize>,
    /// Encoded size, while outstanding.
    size: usize,
}

/// One connection of an upstream: the only one, or one path's.
struct PathConn {
    name: String,
    dial: Dial,
    weight: u32,
    /// Requests written on this connection and unanswered.
    outstanding: RefCell<HashMap<Token, Pending>>,
    /// Their encoded bytes.
    bytes: Cell<usize>,
    /// When `outstanding` last became non-empty (for the stall deadline).
    busy_since: Cell<Instant>,
    srtt: Cell<Option<Duration>>,
    /// DISCONNECTED, CONNECTING or CONNECTED (CSM exchanged, serving).
    state: Cell<i64>,
    /// The link watcher's view of the path's interface (`None`: unknown or not watched).
    link_up: Cell<Option<bool>>,
    /// Work for this connection (a request waits, a slot freed, another path went down).
    work: Notify,
    /// The path's link changed.
    link: Notify,
    /// The connection's key in the metrics' MPTCP state (0: none kept).
    mptcp_key: Cell<u64>,
}

impl PathConn {
    fn new(name: String, dial: Dial, weight: u32) -> PathConn {
        PathConn {
            name,
            dial,
            weight,
            outstanding: RefCell::new(HashMap::new()),
            bytes: Cell::new(0),
            busy_since: Cell::new(Instant::now()),
            srtt: Cell::new(None),
            state: Cell::new(DISCONNECTED),
            link_up: Cell::new(None),
            work: Notify::new(),
            link: Notify::new(),
            mptcp_key: Cell::new(0),
        }
    }

    /// Remove `token` from the outstanding requests.
    fn take(&self, token: &Token) -> Option<Pending> {
        let p = self.outstanding.borrow_mut().remove(token)?;
        self.bytes.set(self.bytes.get().saturating_sub(p.size));
        Some(p)
    }
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
    /// Requests not written yet, oldest first (a retry goes first).
    waiting: RefCell<VecDeque<(Token, Pending)>>,
    /// One entry without `paths`; else one per path.
    conns: Vec<PathConn>,
    next_token: Cell<u64>,
    task_running: Cell<bool>,
    /// Link state, for `paths` (`None`: no watcher).
    links: Option<LinkWatch>,
}

/// A response the proxy makes up.
pub fn made_up(code: Code, diagnostic: &'static str) -> Message {
    let mut m = Message::new(MsgType::Con, code, 0, Token::EMPTY);
    m.payload = Bytes::from_static(diagnostic.as_bytes());
    m
}

/// RFC 7252 §5.8 (GET, PUT, DELETE) and RFC 8132 §2 (FETCH); POST, PATCH and iPATCH are not.
pub fn idempotent(code: Code) -> bool {
    matches!(code, Code::GET | Code::PUT | Code::DELETE | Code::FETCH)
}

impl Upstream {
    pub fn new(
        cfg: &CoapProxyConfig,
        retry_after: Duration,
        max_message_size: usize,
        metrics: Arc<ProxyMetrics>,
        index: usize,
        links: Option<LinkWatch>,
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
        let conns = if cfg.paths.is_empty() {
            vec![PathConn::new(
                String::new(),
                Dial {
                    mptcp: cfg.mptcp,
                    ..Default::default()
                },
                1,
            )]
        } else {
            cfg.paths
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    PathConn::new(
                        p.label(i),
                        Dial {
                            mptcp: false,
                            bind: p.bind,
                            interface: p.interface.clone(),
                        },
                        p.weight,
                    )
                })
                .collect()
        };
        Upstream {
            cfg: cfg.clone(),
            target,
            tls,
            retry_after,
            max_message_size,
            metrics,
            index,
            waiting: RefCell::new(VecDeque::new()),
            conns,
            next_token: Cell::new(1),
            task_running: Cell::new(false),
            links: if cfg.paths.is_empty() { None } else { links },
        }
    }

    fn m(&self) -> &UpstreamMetrics {
        &self.metrics.upstreams[self.index].1
    }

    /// Path `i`'s metrics (`None` without `paths`).
    fn pm(&self, i: usize) -> Option<&ProxyPathMetrics> {
        self.m().paths.get(i)
    }

    fn multipath(&self) -> bool {
        !self.cfg.paths.is_empty()
    }

    fn gauges(&self) {
        let outstanding: usize = self
            .conns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let n = c.outstanding.borrow().len();
                if let Some(pm) = self.pm(i) {
                    pm.outstanding.set(n as i64);
                }
                n
            })
            .sum();
        self.m().outstanding.set(outstanding as i64);
        self.m().waiting.set(self.waiting.borrow().len() as i64);
    }

    fn set_state(&self, i: usize, state: i64) {
        self.conns[i].state.set(state);
        if let Some(pm) = self.pm(i) {
            pm.state.set(state);
        }
        let best = self.conns.iter().map(|c| c.state.get()).max();
        self.m().state.set(best.unwrap_or(DISCONNECTED));
    }

    /// Wake every connection's task: one of them takes the work.
    fn kick(&self) {
        for c in &self.conns {
            c.work.notify_one();
        }
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
        // Fixed 4-byte tokens (8 past 2^32): libcoap 4.3's server drops the connection when
        // many requests with 1- and 2-byte tokens are outstanding at once (issue 30: 250
        // concurrent 16 B PUTs; tested in tests/coap_proxy.rs).
        let token = u32::try_from(seq)
            .ok()
            .and_then(|s| Token::from_slice(&s.to_be_bytes()))
            .unwrap_or(Token::from_u64(seq));
        let (tx, rx) = oneshot::channel();
        {
            let outstanding: usize = self
                .conns
                .iter()
                .map(|c| c.outstanding.borrow().len())
                .sum();
            let mut waiting = self.waiting.borrow_mut();
            if outstanding + waiting.len()
                >= self.cfg.max_outstanding * self.conns.len() + self.cfg.max_waiting
            {
                self.m().unavailable.inc();
                let mut res = made_up(Code::SERVICE_UNAVAILABLE, "upstream busy");
                res.add_uint_option(opt::MAX_AGE, self.retry_after.as_secs().max(1) as u32);
                return res;
            }
            req.token = token;
            waiting.push_back((
                token,
                Pending {
                    req,
                    reply: tx,
                    retried: false,
                    written_at: Instant::now(),
                    seq,
                    avoid: None,
                    size: 0,
                },
            ));
        }
        self.gauges();
        self.ensure_task();
        self.kick();
        match tokio::time::timeout(self.cfg.request_timeout, rx).await {
            Ok(Ok(res)) => res,
            Ok(Err(_)) => {
                self.m().bad_gateway.inc();
                made_up(Code::BAD_GATEWAY, "upstream connection lost")
            }
            Err(_) => {
                for c in &self.conns {
                    c.take(&token);
                }
                self.waiting.borrow_mut().retain(|(t, _)| *t != token);
                self.gauges();
                self.kick(); // a slot may have freed
                self.m().timeouts.inc();
                made_up(Code::GATEWAY_TIMEOUT, "upstream did not answer in time")
            }
        }
    }

    fn ensure_task(self: &Rc<Self>) {
        if !self.task_running.replace(true) {
            for i in 0..self.conns.len() {
                tokio::task::spawn_local(self.clone().run(i));
            }
            if let Some(links) = self.links.clone() {
                tokio::task::spawn_local(self.clone().watch_links(links));
            }
        }
    }

    /// Follow the link table: a path whose link went down ends its connection at once (its
    /// requests go elsewhere); one whose link came back reconnects at once.
    async fn watch_links(self: Rc<Self>, mut links: LinkWatch) {
        loop {
            let table = links.borrow_and_update().clone();
            self.apply_links(&table);
            if links.changed().await.is_err() {
                return;
            }
        }
    }

    fn apply_links(&self, table: &LinkTable) {
        for c in &self.conns {
            let Some((_, st)) = table.find(c.dial.interface.as_deref(), c.dial.bind) else {
                continue;
            };
            if c.link_up.replace(Some(st.up)) != Some(st.up) {
                c.link.notify_one();
            }
        }
    }

    /// Connection `i`'s task: connect, serve, and after a loss wait out the backoff (a
    /// returning link cuts it short). Without `paths` a connection that failed to open
    /// waits for work before trying again; a path keeps trying, so it is ready when needed.
    async fn run(self: Rc<Self>, i: usize) {
        let c = &self.conns[i];
        let mut backoff = MIN_BACKOFF;
        loop {
            while c.link_up.get() == Some(false) {
                c.link.notified().await;
                backoff = MIN_BACKOFF;
            }
            let idle = self.waiting.borrow().is_empty() && c.outstanding.borrow().is_empty();
            if idle && backoff > MIN_BACKOFF && !self.multipath() {
                // Lost the connection with nothing to do: reconnect when there is.
                c.work.notified().await;
            }
            self.set_state(i, CONNECTING);
            match tokio::time::timeout(self.cfg.connect_timeout, self.connect(i)).await {
                Ok(Ok((mut io, mut rbuf, caps))) => {
                    backoff = MIN_BACKOFF;
                    self.m().connects.inc();
                    if let Some(pm) = self.pm(i) {
                        pm.connects.inc();
                    }
                    self.set_state(i, CONNECTED);
                    tracing::info!(upstream = %self.cfg.name, path = %c.name, "CoAP upstream connected");
                    self.kick();
                    let why = self.serve(i, &mut io, &mut rbuf, caps).await;
                    self.m().disconnects.inc();
                    if let Some(pm) = self.pm(i) {
                        pm.failover(why.failover());
                    }
                    tracing::warn!(upstream = %self.cfg.name, path = %c.name, reason = %why, "CoAP upstream connection ended");
                }
                Ok(Err(e)) => {
                    self.m().connect_failures.inc();
                    tracing::warn!(upstream = %self.cfg.name, path = %c.name, error = %e, "CoAP upstream connect failed");
                }
                Err(_) => {
                    self.m().connect_failures.inc();
                    tracing::warn!(upstream = %self.cfg.name, path = %c.name, error = %ConnError::Timeout, "CoAP upstream connect failed");
                }
            }
            self.set_state(i, DISCONNECTED);
            self.connection_lost(i);
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = c.link.notified() => {
                    // Down: wait above; up again: try at once.
                    backoff = MIN_BACKOFF;
                    continue;
                }
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    fn views(&self) -> Vec<PathView> {
        self.conns
            .iter()
            .map(|c| PathView {
                up: c.state.get() == CONNECTED && c.link_up.get() != Some(false),
                room: c.outstanding.borrow().len() < self.cfg.max_outstanding,
                bytes: c.bytes.get(),
                srtt: c.srtt.get(),
                weight: c.weight,
            })
            .collect()
    }

    /// Move waiting requests to connection `i`'s outstanding while it has room and the
    /// scheduler picks it, encoding them into `wbuf`. A request the scheduler gives to
    /// another path stays first in line (that path was woken).
    fn fill(&self, i: usize, caps: &Capabilities, wbuf: &mut BytesMut) {
        let c = &self.conns[i];
        let multipath = self.multipath();
        loop {
            let mut waiting = self.waiting.borrow_mut();
            let Some((closed, avoid)) = waiting
                .front()
                .map(|(_, head)| (head.reply.is_closed(), head.avoid))
            else {
                break;
            };
            if closed {
                waiting.pop_front(); // timed out while waiting
                continue;
            }
            if c.outstanding.borrow().len() >= self.cfg.max_outstanding {
                break;
            }
            if multipath {
                drop(waiting);
                match sched::pick(&self.views(), avoid) {
                    Some(j) if j == i => {}
                    Some(j) => {
                        self.conns[j].work.notify_one();
                        break;
                    }
                    None => break,
                }
                waiting = self.waiting.borrow_mut();
            }
            let Some((token, mut p)) = waiting.pop_front() else {
                break;
            };
            drop(waiting);
            let before = wbuf.len();
            encode_tcp(&p.req, wbuf);
            let size = wbuf.len() - before;
            if size > caps.max_message_size {
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
            p.size = size;
            if let Some(pm) = self.pm(i) {
                pm.requests.inc();
                pm.bytes.add(size as u64);
            }
            let mut out = c.outstanding.borrow_mut();
            if out.is_empty() {
                c.busy_since.set(Instant::now());
            }
            out.insert(token, p);
            c.bytes.set(c.bytes.get() + size);
        }
        self.gauges();
    }

    /// Connection `i` is gone: idempotent requests written once go first in line again (to
    /// another path when there is one), others are answered 5.02.
    fn connection_lost(&self, i: usize) {
        let c = &self.conns[i];
        self.m().mptcp.on_close(c.mptcp_key.take());
        let mut lost: Vec<(Token, Pending)> = c.outstanding.borrow_mut().drain().collect();
        c.bytes.set(0);
        lost.sort_by_key(|(_, p)| p.seq);
        let mut waiting = self.waiting.borrow_mut();
        for (token, mut p) in lost.into_iter().rev() {
            if p.reply.is_closed() {
                continue;
            }
            if idempotent(p.req.code) && !p.retried {
                p.retried = true;
                p.avoid = Some(i);
                p.size = 0;
                self.m().retries.inc();
                waiting.push_front((token, p));
            } else {
                self.m().bad_gateway.inc();
                let _ = p
                    .reply
                    .send(made_up(Code::BAD_GATEWAY, "upstream connection lost"));
            }
        }
        drop(waiting);
        self.gauges();
        self.kick();
    }
}
