//! The oneM2M transport: device messages become contentInstances in a oneM2M CSE (an IN-CSE
//! over the Mca reference point, HTTP binding; ground truth `onem2m-http.md`, checked against
//! ACME). The second [`Transport`] behind an [`Outbox`], for `protocol = "onem2m"` uplinks.
//!
//! Owns: a pool of `connections` keep-alive HTTP/1.1 connections per (shard, uplink, lane)
//! with up to `pipeline` requests written ahead on each (`pool.rs`; hyper's client does not
//! pipeline, so the HTTP is ours: `http.rs`), registering the AE, creating the containers,
//! creating one contentInstance per message (`naming.rs`), reading the pipelined responses in
//! order per connection, and mapping the CSE's status codes to [`Feedback`] (`rsc.rs`). Does
//! not own: queueing, order across reconnects, windowing, retry or the spool (the outbox's).
//!
//! # Resources
//! Addressing is SP-relative (`/~{cse_id}/{cse_name}/…`, §1). `connect` opens the pool and
//! registers the AE `{ae_name}` (`POST /~/id-in/cse-in`, ty=2, X-M2M-Origin = `originator`);
//! 2001 and 4117 ("already registered") are success, anything else fails the connect. Each
//! message's containers come from the `container` template (`naming.rs`): the device's under
//! the AE, the message's under the device's, each created (ty=3, with `mni`/`mbs` when set)
//! the first time this transport needs it since it connected — 2001 and 4105 ("already
//! exists") both mean it is there. Then `POST {ae}/{device}/{stream}?rcn=0` ty=4 with
//! `cnf`/`con` (`naming.rs`); [`SendId`] = our request number.
//!
//! # What the CSE lost
//! A CSE that restarts with an in-memory database (ACME) forgets everything. Its restart
//! closes our connections, so the outbox requeues every unanswered message and reconnects;
//! `connect` registers the AE again and forgets which containers exist, so they are created
//! again before the first contentInstance that needs them. If the CSE loses a container while
//! we stay connected, the contentInstance gets 4004: the transport re-registers the AE and
//! re-creates both containers on the same connection, then sends that contentInstance again
//! (not reported as refused); a second 4004 for it is reported as an unclear refusal.
//!
//! # Delivery and order
//! A message is acknowledged ([`Feedback::Acked`]) only on a 2xxx answer to its
//! contentInstance (with `ack = "spool"`, at the spool commit as for MQTT: the outbox's rule).
//! Every message of a device goes on the same connection of the pool (a hash of the device
//! id), and a connection's requests are answered in order, so a device's contentInstances are
//! created in order — except one retried after a 4004, and messages resent after a reconnect
//! (at-least-once: a message the CSE created but whose answer was lost is created twice).
//!
//! QoS 0 messages are sent the same way and also finish on the CSE's answer (not once
//! written): every request gets one, and waiting for it keeps a QoS 0 message's bytes in the
//! queue, which is what bounds how many can be outstanding.
//!
//! # Refusals
//! Mapped in `rsc.rs` (table there): permanent ones complete the device's token with an MQTT 5
//! reason code (0x87, 0x90, 0x99, 0x83), unclear ones are retried until they persist.
//!
//! # Errors and bounds
//! The window is `connections × pipeline` units, shared by the pool: since a device keeps to
//! one connection, a connection carrying busy devices may have more than `pipeline` written
//! ahead while another idles. Each unit may bring two container requests before it. A response
//! with `Connection: close` (ACME's default Werkzeug server answers every request so; run ACME
//! with `[http.wsgi] enable=true` for keep-alive) means the server read nothing after that
//! request: the transport drops that connection itself, and from then on writes one request per
//! connection, opening a new one for the next (the requests that were pipelined behind are
//! written again that way; `sluice_onem2m_server_closes_total`). Any other end of a connection
//! with a request unanswered, an undecodable response (`http.rs` bounds: 16 KiB head, 1 MiB
//! body), or a request unanswered for `request_timeout` is an error: the outbox requeues and
//! reconnects. A connection idle for [`IDLE_REOPEN`] is opened anew before its next request, so
//! a server's keep-alive timeout never closes one under a request. The set of known containers
//! holds at most [`MAX_KNOWN`] names; when full it is cleared (the next messages re-create
//! theirs, answered 4105).

pub mod http;
pub mod naming;
mod pool;
pub mod rsc;

use std::collections::HashSet;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

use crate::config::UplinkConfig;
use crate::sink::outbox::{Outbox, OutboxSeed};
use crate::sink::transport::{
    Feedback, LinkLimits, RefusalClass, SendId, Transport, Unit, Unsendable,
};
use crate::sink::{Lane, SessionSeed, UplinkError, UplinkMetrics};
use naming::ContainerTemplate;
use pool::{Conn, Dialer, ReadEvent, Req, Waiting};
pub use rsc::OneM2mMetrics;

/// Most container names remembered as existing (per transport).
pub const MAX_KNOWN: usize = 65_536;
/// A connection idle this long is opened anew before its next request, so that a server's
/// keep-alive timeout (Apache's default is 5 s, waitress's 120 s) never closes it under one.
pub const IDLE_REOPEN: Duration = Duration::from_secs(2);

/// Start the outbox of one oneM2M uplink lane on this shard. Must be called inside a
/// `LocalSet`. Runs until `shutdown`.
pub fn spawn(seed: SessionSeed, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    let transport = OneM2mTransport::new(
        seed.shard,
        seed.lane,
        seed.cfg.clone(),
        seed.tls.clone(),
        seed.metrics.clone(),
    );
    let outbox = Outbox::new(OutboxSeed::from(seed), transport);
    tokio::task::spawn_local(outbox.run(shutdown))
}

/// A pool of HTTP/1.1 connections to a oneM2M CSE (see the module docs).
pub struct OneM2mTransport {
    dialer: Dialer,
    metrics: Arc<UplinkMetrics>,
    template: ContainerTemplate,
    /// `Host` header value.
    host: String,
    /// `/~{cse_id}/{cse_name}`.
    base: String,
    /// `{base}/{ae_name}`.
    ae_path: String,
    origin: String,
    ae_body: Bytes,
    mni: Option<u64>,
    mbs: Option<u64>,
    timeout: Duration,
    window: usize,
    conns: Vec<Conn>,
    /// Containers (`device`, `device/stream`) created or found since the last connect.
    known: HashSet<String>,
    /// The AE is believed registered (false after a 4004 until it is registered again).
    ae_known: bool,
    /// The CSE keeps connections open: requests are pipelined. Off for good once a response
    /// said `Connection: close` (then one request per connection).
    keep_alive: bool,
    /// X-M2M-RI prefix (`s{shard}{n|h}-{start time, ms, hex}-`) and counter.
    ri_prefix: String,
    next_ri: u64,
    next_id: u64,
    scratch: Box<[u8]>,
    read_start: usize,
}

impl OneM2mTransport {
    /// A transport for one lane of oneM2M uplink `cfg` on `shard` (not connected). `tls` must
    /// be `Some` when `cfg.url.tls`. The config was validated, so the template parses.
    pub fn new(
        shard: usize,
        lane: Lane,
        cfg: Rc<UplinkConfig>,
        tls: Option<Arc<rustls::ClientConfig>>,
        metrics: Arc<UplinkMetrics>,
    ) -> OneM2mTransport {
        metrics.onem2m.mark_used();
        // A validated config's template parses; an unvalidated one falls back to the default.
        let template = ContainerTemplate::parse(cfg.onem2m_container()).unwrap_or_else(|_| {
            ContainerTemplate::parse(crate::config::ONEM2M_DEFAULT_CONTAINER)
                .expect("the default template parses")
        });
        let base = format!(
            "/~{}/{}",
            cfg.cse_id.as_deref().unwrap_or("/id-in"),
            cfg.cse_name.as_deref().unwrap_or("cse-in")
        );
        let ae_name = cfg.onem2m_ae_name();
        let host = if cfg.url.host.contains(':') {
            format!("[{}]:{}", cfg.url.host, cfg.url.port)
        } else {
            format!("{}:{}", cfg.url.host, cfg.url.port)
        };
        let conns = cfg.onem2m_connections().max(1);
        OneM2mTransport {
            metrics,
            template,
            host,
            ae_path: format!("{base}/{ae_name}"),
            base,
            origin: cfg.originator.clone().unwrap_or_else(|| "Csluice".into()),
            ae_body: Bytes::from(naming::ae_body(&ae_name, cfg.onem2m_app_id())),
            mni: cfg.mni,
            mbs: crate::config::onem2m_mbs_bytes(cfg.mbs),
            timeout: cfg.onem2m_request_timeout(),
            window: conns * cfg.onem2m_pipeline().max(1),
            conns: (0..conns).map(|_| Conn::default()).collect(),
            known: HashSet::new(),
            ae_known: false,
            keep_alive: true,
            // Unique across shards, lanes and (by the start time) restarts of the gateway.
            ri_prefix: format!(
                "s{shard}{}-{:x}-",
                if lane == Lane::High { 'h' } else { 'n' },
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis())
            ),
            next_ri: 0,
            next_id: 0,
            scratch: vec![0; pool::READ_CHUNK].into_boxed_slice(),
            read_start: 0,
            dialer: Dialer {
                cfg,
                lane,
                tls: tls.map(TlsConnector::from),
            },
        }
    }

    /// Add `req` to connection `c`'s waiting list; with keep-alive also encode it into the
    /// connection's pending bytes (without, `write` encodes one request at a time).
    fn queue(&mut self, c: usize, req: Req) {
        if self.keep_alive {
            let mut out = std::mem::take(&mut self.conns[c].out);
            self.encode_req(&req, &mut out);
            self.conns[c].out = out;
        }
        self.conns[c].waiting.push_back(Waiting {
            req,
            since: Instant::now(),
        });
    }

    /// Append the HTTP request for `req` (with a fresh X-M2M-RI) to `out`.
    fn encode_req(&mut self, req: &Req, out: &mut BytesMut) {
        self.next_ri += 1;
        let ri = format!("{}{}", self.ri_prefix, self.next_ri);
        let cnt_body;
        let cnt_target;
        let (target, ty, body): (&str, u8, &[u8]) = match req {
            Req::Ae => (&self.base, 2, &self.ae_body[..]),
            Req::Cnt { parent, name, .. } => {
                cnt_body = naming::cnt_body(name, self.mni, self.mbs);
                cnt_target = format!("{parent}?rcn=0");
                (&cnt_target, 3, &cnt_body)
            }
            Req::Cin { target, body, .. } => (target, 4, &body[..]),
        };
        http::Request {
            method: "POST",
            target,
            host: &self.host,
            origin: &self.origin,
            ri: &ri,
            ty: Some(ty),
            body,
        }
        .encode(out);
    }

    /// Queue on `c` whatever of the AE and the two containers is not known to exist.
    fn queue_parents(&mut self, c: usize, device: &str, stream_key: &str, stream: &str) {
        if self.known.len() + 2 > MAX_KNOWN {
            self.known.clear();
        }
        if !self.ae_known {
            self.ae_known = true;
            self.queue(c, Req::Ae);
        }
        if !self.known.contains(device) {
            self.known.insert(device.to_owned());
            let parent = self.ae_path.clone();
            self.queue(
                c,
                Req::Cnt {
                    parent,
                    name: device.to_owned(),
                    key: device.to_owned(),
                },
            );
        }
        if !self.known.contains(stream_key) {
            self.known.insert(stream_key.to_owned());
            let parent = format!("{}/{device}", self.ae_path);
            self.queue(
                c,
                Req::Cnt {
                    parent,
                    name: stream.to_owned(),
                    key: stream_key.to_owned(),
                },
            );
        }
    }

    /// Handle every complete response buffered on connection `c`.
    fn take_responses(
        &mut self,
        c: usize,
        feedback: &mut Vec<Feedback>,
    ) -> Result<(), UplinkError> {
        while let Some(resp) = self.conns[c].rbuf.decode()? {
            self.metrics.onem2m.record_response(resp.rsc);
            let conn = &mut self.conns[c];
            if conn.written == 0 {
                return Err(UplinkError::Protocol(
                    "the CSE answered a request never sent".into(),
                ));
            }
            conn.written -= 1;
            let Some(w) = conn.waiting.pop_front() else {
                return Err(UplinkError::Protocol(
                    "the CSE answered a request never sent".into(),
                ));
            };
            if resp.close {
                self.server_closed(c);
            }
            let created = resp.rsc == Some(2001) || (resp.rsc.is_none() && resp.status == 201);
            match w.req {
                Req::Ae => match resp.rsc {
                    _ if created => self.metrics.onem2m.aes_created.inc(),
                    Some(4117) => {}
                    rsc => {
                        self.ae_known = false;
                        tracing::warn!(rsc = ?rsc, status = resp.status, "oneM2M CSE refused the AE registration");
                    }
                },
                Req::Cnt { key, .. } => match resp.rsc {
                    _ if created => self.metrics.onem2m.containers_created.inc(),
                    Some(4105) => {}
                    rsc => {
                        // Try again for the next message; this one's contentInstance will tell.
                        self.known.remove(&key);
                        tracing::trace!(rsc = ?rsc, status = resp.status, container = %key, "oneM2M CSE refused a container");
                    }
                },
                Req::Cin {
                    id,
                    target,
                    body,
                    device_key,
                    stream_key,
                    retried,
                } => match rsc::classify(resp.status, resp.rsc) {
                    rsc::Outcome::Created => feedback.push(Feedback::Acked(id)),
                    rsc::Outcome::NotFound if !retried => {
                        self.metrics.onem2m.lost_parents.inc();
                        self.known.remove(&device_key);
                        self.known.remove(&stream_key);
                        self.ae_known = false;
                        let stream = stream_key
                            .rsplit('/')
                            .next()
                            .unwrap_or(&stream_key)
                            .to_owned();
                        self.queue_parents(c, &device_key, &stream_key, &stream);
                        self.queue(
                            c,
                            Req::Cin {
                                id,
                                target,
                                body,
                                device_key,
                                stream_key,
                                retried: true,
                            },
                        );
                    }
                    rsc::Outcome::NotFound => feedback.push(Feedback::Refused {
                        id,
                        code: 0x80,
                        class: RefusalClass::Unclear,
                    }),
                    rsc::Outcome::Refused { code, class } => {
                        tracing::trace!(rsc = ?resp.rsc, status = resp.status, "oneM2M CSE refused a contentInstance");
                        feedback.push(Feedback::Refused { id, code, class })
                    }
                },
            }
        }
        Ok(())
    }

    /// The server said it closes connection `c` after its last response: it read nothing
    /// after that request, so the connection is dropped here and its other requests are
    /// written again, and from now on one request per connection (`keep_alive` off: no more
    /// pipelining into a server that would drop it).
    fn server_closed(&mut self, c: usize) {
        self.metrics.onem2m.server_closes.inc();
        if self.keep_alive {
            self.keep_alive = false;
            tracing::warn!(
                "oneM2M CSE closes the connection after every response; sending one request per connection"
            );
            // Nothing unwritten stays encoded: `write` encodes one request at a time now.
            for conn in &mut self.conns {
                conn.out.clear();
            }
        }
        let conn = &mut self.conns[c];
        conn.io = None;
        conn.rbuf.clear();
        conn.written = 0;
    }

    /// Connection `c` ended. With a request written and unanswered it is an error (the
    /// outbox resends); otherwise the next write opens it again.
    fn on_eof(&mut self, c: usize) -> Result<(), UplinkError> {
        let conn = &mut self.conns[c];
        conn.io = None;
        conn.rbuf.clear();
        if conn.written > 0 {
            return Err(UplinkError::ClosedByCloud);
        }
        Ok(())
    }

    /// When the oldest unanswered request times out.
    fn deadline(&self) -> Option<Instant> {
        self.conns
            .iter()
            .filter(|c| c.io.is_some() && c.written > 0)
            .filter_map(|c| c.waiting.front().map(|w| w.since + self.timeout))
            .min()
    }

    /// Register the AE on connection 0 and wait for the answer (part of `connect`).
    async fn register(&mut self) -> Result<(), UplinkError> {
        self.queue(0, Req::Ae);
        self.write(0).await?;
        let mut feedback = Vec::new();
        while !self.conns[0].waiting.is_empty() {
            let ev = tokio::time::timeout(
                self.timeout,
                pool::read_any(&mut self.conns[..1], &mut self.scratch, 0),
            )
            .await
            .map_err(|_| UplinkError::ResponseTimeout(self.timeout))?;
            match ev {
                ReadEvent::Data(_) => {
                    // Take the answer by hand: `take_responses` would only log a refusal.
                    if let Some(resp) = self.conns[0].rbuf.decode()? {
                        self.metrics.onem2m.record_response(resp.rsc);
                        self.conns[0].waiting.pop_front();
                        self.conns[0].written = 0;
                        match resp.rsc {
                            Some(2001) => self.metrics.onem2m.aes_created.inc(),
                            Some(4117) => {}
                            rsc => {
                                return Err(UplinkError::AeRegistration {
                                    status: resp.status,
                                    rsc: rsc.unwrap_or(0),
                                })
                            }
                        }
                        if resp.close {
                            self.server_closed(0);
                        }
                        self.take_responses(0, &mut feedback)?;
                    }
                }
                ReadEvent::Eof(_) => return Err(UplinkError::ClosedByCloud),
                ReadEvent::Failed(e) => return Err(UplinkError::ConnectionLost(e)),
            }
        }
        self.ae_known = true;
        Ok(())
    }

    /// Write connection `c`'s pending requests (opening it first when closed): all of them
    /// with keep-alive, else the next one once the previous was answered.
    async fn write(&mut self, c: usize) -> Result<(), UplinkError> {
        let count = if self.keep_alive {
            if self.conns[c].out.is_empty() {
                return Ok(());
            }
            self.conns[c].waiting.len() - self.conns[c].written
        } else {
            let conn = &self.conns[c];
            if conn.written > 0 || conn.waiting.is_empty() {
                return Ok(());
            }
            let req = conn.waiting[0].req.clone();
            let mut out = std::mem::take(&mut self.conns[c].out);
            self.encode_req(&req, &mut out);
            self.conns[c].out = out;
            1
        };
        let conn = &mut self.conns[c];
        if conn.written == 0 && conn.last_io.elapsed() > IDLE_REOPEN {
            conn.io = None;
        }
        if self.conns[c].io.is_none() {
            let io = self.dialer.open().await?;
            self.conns[c].io = Some(io);
            self.conns[c].last_io = Instant::now();
        }
        let conn = &mut self.conns[c];
        let (Some(io), out) = (conn.io.as_mut(), &mut conn.out) else {
            return Ok(());
        };
        let write = async {
            io.write_all(out).await?;
            io.flush().await
        };
        match tokio::time::timeout(self.timeout, write).await {
            Ok(Ok(())) => {
                out.clear();
                conn.last_io = Instant::now();
                conn.written += count;
                if let Some(w) = conn.waiting.get_mut(conn.written - 1) {
                    w.since = Instant::now();
                }
                Ok(())
            }
            Ok(Err(e)) => Err(UplinkError::ConnectionLost(e)),
            Err(_) => Err(UplinkError::WriteTimeout(self.timeout)),
        }
    }
}

impl Transport for OneM2mTransport {
    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        self.abort();
        for c in 0..self.conns.len() {
            let io = self.dialer.open().await?;
            self.conns[c].io = Some(io);
            self.conns[c].last_io = Instant::now();
        }
        self.register().await?;
        Ok(LinkLimits {
            window: self.window,
            pack_limit: usize::MAX,
            keep_alive: None,
        })
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let msg = match unit {
            Unit::Message { msg, .. } => msg,
            Unit::Pack { .. } => {
                return Err(Unsendable::Invalid(
                    "SenML packs cannot go to oneM2M (aggregation is refused by the config)".into(),
                ))
            }
        };
        let (device, stream) = self
            .template
            .render(&msg.device, &msg.topic)
            .map_err(|e| Unsendable::Invalid(e.to_string()))?;
        let c = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            msg.device.as_bytes().hash(&mut h);
            (h.finish() % self.conns.len() as u64) as usize
        };
        let stream_key = format!("{device}/{stream}");
        self.queue_parents(c, &device, &stream_key, &stream);
        self.next_id += 1;
        let id = SendId(self.next_id);
        let target = format!("{}/{stream_key}?rcn=0", self.ae_path);
        let body = Bytes::from(naming::cin_body(&msg.payload));
        self.queue(
            c,
            Req::Cin {
                id,
                target,
                body,
                device_key: device,
                stream_key,
                retried: false,
            },
        );
        Ok(Some(id))
    }

    fn pending_bytes(&self) -> usize {
        if self.keep_alive {
            return self.conns.iter().map(|c| c.out.len()).sum();
        }
        // One request at a time per connection: the next one is due when none is written.
        self.conns
            .iter()
            .filter(|c| c.written == 0 && !c.waiting.is_empty())
            .count()
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        for c in 0..self.conns.len() {
            self.write(c).await?;
        }
        Ok(())
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        let deadline = self.deadline();
        self.read_start = (self.read_start + 1) % self.conns.len();
        let start = self.read_start;
        let ev = tokio::select! {
            ev = pool::read_any(&mut self.conns, &mut self.scratch, start) => ev,
            _ = sleep_until_opt(deadline), if deadline.is_some() => {
                return Err(UplinkError::ResponseTimeout(self.timeout));
            }
        };
        match ev {
            ReadEvent::Data(c) => self.take_responses(c, feedback),
            ReadEvent::Eof(c) => {
                self.take_responses(c, feedback)?;
                self.on_eof(c)
            }
            ReadEvent::Failed(e) => Err(UplinkError::ConnectionLost(e)),
        }
    }

    fn abort(&mut self) {
        for c in &mut self.conns {
            c.close();
        }
        self.known.clear();
        self.ae_known = false;
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
