//! One shard's CoAP server: the receive loop on its SO_REUSEPORT socket, steering each
//! datagram to the shard that owns its device, message-id de-duplication, and answering a
//! request piggybacked, separately, or as a NON.
//!
//! Owns: the shard's exchange table, per-source budget, Block1 transfers, device table,
//! `[limits]` publish-rate table (`rates`, used by `publish`) and verified addresses, and the
//! size rule every answer passes (`fit`: at most 3× the request
//! to an address not verified, at most `max_message_size` to any, Block2 beyond).
//! Does not own: what a request means (`resources`, `publish`), the observers (`observe`),
//! or sending/retransmitting (`endpoint`).
//!
//! Invariants: the receive loop never waits for a request to be served (anything slow runs
//! in its own local task); a duplicate CON is answered with what the first got (or an empty
//! ACK while that is still being worked out) and never served twice; a CON whose header was
//! readable but whose message was not gets RST; nothing here panics on any datagram; no
//! answer (piggybacked, separate with its retransmissions, or NON) sends an unverified
//! address more than 3× its request's bytes; the exchange table holds at most
//! `max_exchange_bytes / shards` bytes.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::coap::block::Assembly;
use sluice_proto::coap::dedup::{DedupTable, Seen, SweepPace};
use sluice_proto::coap::{opt, Block, Code, DecodeError, Message, MsgType, Token};
use tokio::net::UdpSocket;
use tokio::sync::watch;

use super::endpoint::{Endpoint, SourceBudget};
use super::metrics::{CoapMetrics, FormatError, Refusal};
use super::observe::Observers;
use super::verify;
use super::{CoapOut, DeviceIdentity};
use crate::shard::{hash, ShardCmd, ShardContext};

/// What serving a request gives: an answer now, or one to wait for.
pub(super) enum Reply {
    Now(Message),
    Later(Pin<Box<dyn Future<Output = Message>>>),
}

/// One exchange in the de-duplication table.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    /// The datagram a duplicate CON gets (the piggybacked response, or the empty ACK of a
    /// separate one); `None` while the answer is being worked out.
    answer: RefCell<Option<Bytes>>,
    /// The CON was ACKed empty: its response goes as a separate CON.
    separated: Cell<bool>,
}

/// A Block1 transfer in progress.
pub(super) struct Transfer {
    pub assembly: Assembly,
    pub last: Instant,
}

/// Bytes a Block1 transfer is charged besides its body so far: the map entry, its key's
/// topic string (up to `mqtt.max_topic_length`, charged at its length) and the assembly.
pub(super) const TRANSFER_OVERHEAD: usize = 192;

/// Bytes an exchange is charged in the de-duplication table besides its stored answer: the
/// map entry and key, its place in the order queue, and the `Exchange` it points to.
pub(super) const EXCHANGE_OVERHEAD: usize = 192;

/// What of a request its answer needs.
#[derive(Clone, Copy)]
struct Asked {
    mtype: MsgType,
    mid: u16,
    token: Token,
    /// RFC 7967 No-Response bits (2: no 2.xx, 8: no 4.xx, 16: no 5.xx).
    no_response: u32,
    /// The request's datagram size: an unverified address gets at most 3× this.
    size: usize,
    /// The request came with an identity (a secure transport): its address is proven.
    authenticated: bool,
    /// The request's Block2 value (which block of a large answer it asks for).
    block2: Option<u32>,
}

/// Who sent a request, as far as the rules of `dispatch` are concerned.
#[derive(Clone, Copy)]
pub(super) struct Caller<'a> {
    pub identity: Option<&'a DeviceIdentity>,
    /// The largest answer the address may get (3× the request) while it has not proven it
    /// receives; `None` once it has.
    pub limit: Option<usize>,
}

/// The CoAP edge of one shard.
pub struct CoapShard {
    pub(super) ctx: Rc<ShardContext>,
    pub(super) ep: Rc<Endpoint>,
    pub(super) observers: Rc<Observers>,
    pub(super) metrics: Arc<CoapMetrics>,
    exchanges: RefCell<DedupTable<(SocketAddr, u16), Rc<Exchange>>>,
    evictions_seen: Cell<u64>,
    budget: RefCell<SourceBudget>,
    pub(super) transfers: RefCell<HashMap<(SocketAddr, String), Transfer>>,
    /// Publishes handed to the router that it has not taken yet (back-pressure).
    pub(super) pending_publishes: Cell<usize>,
    devices: RefCell<HashMap<ByteString, Instant>>,
    /// Paces sweeps of a full device table.
    devices_swept: RefCell<SweepPace>,
    pub(super) limits: Limits,
    /// `[limits]` publish rates of this edge's devices on this shard (`None`: no rate set).
    pub(super) rates: RefCell<Option<crate::control::limits::DeviceRates>>,
    /// Every peer of this edge finished a DTLS handshake (`super::dtls`): it is authenticated
    /// and has shown it receives at its address, so answers to it need no amplification
    /// limit. False for the plain UDP edge.
    pub(super) secure: bool,
}

/// This shard's share of the gateway-wide `[coap]` bounds.
pub(super) struct Limits {
    pub max_pending: usize,
    pub max_transfers: usize,
    pub max_devices: usize,
    /// Bytes of Block1 bodies (and their overhead) in progress on this shard.
    pub max_block_bytes: usize,
    /// `coap.anonymous_allowed()`: a peer without an identity may publish and observe.
    pub anonymous: bool,
}

/// Start the CoAP edge of shard `ctx.id` on `socket` (bound, non-blocking).
pub fn start(
    ctx: Rc<ShardContext>,
    socket: std::net::UdpSocket,
    metrics: Arc<CoapMetrics>,
    shutdown: watch::Receiver<bool>,
) -> Option<Rc<CoapShard>> {
    let sender = match socket.try_clone() {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(shard = ctx.id, %error, "cannot duplicate the coap socket");
            return None;
        }
    };
    let socket = match UdpSocket::from_std(socket) {
        Ok(s) => Rc::new(s),
        Err(error) => {
            tracing::error!(shard = ctx.id, %error, "cannot register the coap socket");
            return None;
        }
    };
    let cfg = &ctx.config.coap;
    let shards = ctx.mailboxes.len().max(1);
    let ep = Endpoint::new(
        sender,
        ctx.id,
        shards,
        cfg.ack_timeout,
        cfg.max_retransmit,
        (cfg.max_verified_bytes.as_usize() / shards).max(1),
        metrics.clone(),
    );
    let shard = CoapShard::new(ctx, ep, metrics, false);
    tokio::task::spawn_local(receive(shard.clone(), socket, shutdown));
    Some(shard)
}

impl CoapShard {
    /// The edge of shard `ctx.id` sending through `ep`, without a receive loop (the plain
    /// socket's is started by [`start`]; the DTLS listener feeds [`CoapShard::on_secure`]).
    pub(super) fn new(
        ctx: Rc<ShardContext>,
        ep: Rc<Endpoint>,
        metrics: Arc<CoapMetrics>,
        secure: bool,
    ) -> Rc<CoapShard> {
        let cfg = &ctx.config.coap;
        let shards = ctx.mailboxes.len().max(1);
        if secure {
            ep.set_secure();
        }
        let out: Rc<dyn CoapOut> = ep.clone();
        let per_shard = |n: usize| (n / shards).max(1);
        Rc::new(CoapShard {
            observers: Observers::new(ctx.clone(), out),
            exchanges: RefCell::new(DedupTable::with_bytes(
                per_shard(cfg.max_exchanges),
                per_shard(cfg.max_exchange_bytes.as_usize()),
                EXCHANGE_OVERHEAD,
            )),
            evictions_seen: Cell::new(0),
            budget: RefCell::new(SourceBudget::new(
                cfg.source_rate,
                cfg.source_burst,
                per_shard(cfg.max_exchanges),
            )),
            transfers: RefCell::new(HashMap::new()),
            pending_publishes: Cell::new(0),
            devices: RefCell::new(HashMap::new()),
            devices_swept: RefCell::new(SweepPace::default()),
            limits: Limits {
                max_pending: per_shard(cfg.max_pending),
                max_transfers: per_shard(cfg.max_block_transfers),
                max_devices: per_shard(cfg.max_exchanges),
                max_block_bytes: per_shard(cfg.max_block_bytes.as_usize()),
                anonymous: cfg.anonymous_allowed(&ctx.config.mqtt),
            },
            rates: RefCell::new(crate::control::limits::DeviceRates::new(
                &ctx.config.limits,
                cfg.max_body_size.as_u64(),
                per_shard(ctx.config.limits.coap_rates_memory.as_usize()),
                ctx.limits.clone(),
            )),
            metrics,
            ep,
            ctx,
            secure,
        })
    }

    /// A CoAP datagram decrypted by `peer`'s DTLS session (`super::dtls`): served on this
    /// shard, where the session is; a request's device id is the session's authenticated
    /// `identity` (any `c=` query ignored), or as for plain CoAP when it has none.
    pub(super) fn on_secure(
        self: &Rc<Self>,
        peer: SocketAddr,
        datagram: &[u8],
        identity: Option<ByteString>,
    ) {
        debug_assert!(self.secure, "decrypted datagrams enter the DTLS edge only");
        self.metrics.datagrams_in.inc();
        if datagram.len() > self.ctx.config.coap.max_message_size.as_usize().max(16) {
            self.metrics.format_error(FormatError::TooLarge);
            return;
        }
        let size = datagram.len();
        let bytes = Bytes::copy_from_slice(datagram);
        let message = match Message::decode_udp(&bytes) {
            Ok(m) => m,
            Err(e) => return self.on_message(peer, Err(e), None, None, size),
        };
        // Not steered: the session (and so the only way to answer) is on this shard.
        let identity = identity.map(|device_id| DeviceIdentity { device_id });
        let device = match message.mtype {
            MsgType::Ack | MsgType::Rst => None,
            MsgType::Con | MsgType::Non => Some(match &identity {
                Some(id) => id.device_id.clone(),
                None => device_id(&message, peer),
            }),
        };
        self.on_message(peer, Ok(message), device, identity.as_ref(), size);
    }
}

/// The device id of a request: its `c=` Uri-Query, else the source address.
pub(super) fn device_id(msg: &Message, peer: SocketAddr) -> ByteString {
    match msg.query("c").and_then(|c| std::str::from_utf8(c).ok()) {
        Some(c) if !c.is_empty() => ByteString::from(c),
        _ => ByteString::from(peer.to_string()),
    }
}

/// A datagram decoded where it was read, passed to the shard that owns it with the device id
/// it was steered by (`ShardCmd::CoapDatagram`), so neither is worked out twice.
#[derive(Debug)]
pub struct Steered {
    pub peer: SocketAddr,
    pub message: Message,
    /// The request's device id; `None` for an ACK/RST.
    pub device: Option<ByteString>,
    /// Who a secure transport says sent it; `None` for plain UDP.
    pub identity: Option<DeviceIdentity>,
}

/// The shard that owns `msg`, and for a request its device id: an ACK/RST by its message id
/// (sluice's CONs of shard `s` carry ids `≡ s`), a request by its device id's hash, as MQTT
/// devices are placed.
fn owner_of(
    msg: &Message,
    peer: SocketAddr,
    shards: usize,
    identity: Option<&DeviceIdentity>,
) -> (usize, Option<ByteString>) {
    match msg.mtype {
        MsgType::Ack | MsgType::Rst => (msg.message_id as usize % shards, None),
        MsgType::Con | MsgType::Non => {
            let device = match identity {
                Some(id) => id.device_id.clone(),
                None => device_id(msg, peer),
            };
            (
                hash::shard_for(device.as_bytes(), None, shards),
                Some(device),
            )
        }
    }
}

async fn receive(shard: Rc<CoapShard>, socket: Rc<UdpSocket>, mut shutdown: watch::Receiver<bool>) {
    let max = shard.ctx.config.coap.max_message_size.as_usize().max(16);
    let mut buf = vec![0u8; max + 1];
    loop {
        let (n, peer) = tokio::select! {
            r = socket.recv_from(&mut buf) => match r {
                Ok(v) => v,
                Err(error) => {
                    // ICMP port unreachable from a device that went away, and the like.
                    tracing::debug!(%error, "coap receive error");
                    continue;
                }
            },
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() { break; }
                continue;
            }
        };
        shard.metrics.datagrams_in.inc();
        if !shard.budget.borrow_mut().allow(peer, Instant::now()) {
            shard.metrics.throttled.inc();
            continue;
        }
        if n > max {
            // Over `max_message_size`: not read further. A CON gets RST (its header is all
            // that is needed for one), anything else is dropped.
            shard.metrics.format_error(FormatError::TooLarge);
            if buf[0] >> 6 == 1 && (buf[0] >> 4) & 3 == 0 {
                let mid = u16::from_be_bytes([buf[2], buf[3]]);
                shard.ep.send(peer, &Message::empty(MsgType::Rst, mid));
            }
            continue;
        }
        let bytes = Bytes::copy_from_slice(&buf[..n]);
        shard.on_datagram(peer, bytes, None);
    }
    tracing::debug!(shard = shard.ctx.id, "coap receive loop stopped");
}

impl CoapShard {
    /// The one way a datagram enters the edge: read from this shard's UDP socket
    /// (`identity` `None`), or decrypted by a secure transport that authenticated its sender
    /// (`Some`, the device id). Served here, or passed to the shard that owns its device.
    /// `bytes` is at most `coap.max_message_size` long.
    pub fn on_datagram(
        self: &Rc<Self>,
        peer: SocketAddr,
        bytes: Bytes,
        identity: Option<DeviceIdentity>,
    ) {
        let shards = self.ctx.mailboxes.len().max(1);
        let size = bytes.len();
        let message = match Message::decode_udp(&bytes) {
            Ok(m) => m,
            // Answered (RST) or dropped where it was read.
            Err(e) => return self.on_message(peer, Err(e), None, None, size),
        };
        let (owner, device) = owner_of(&message, peer, shards, identity.as_ref());
        if owner == self.ctx.id {
            self.on_message(peer, Ok(message), device, identity.as_ref(), size);
            return;
        }
        let cmd = ShardCmd::CoapDatagram(Box::new(Steered {
            peer,
            message,
            device,
            identity,
        }));
        let sent = self
            .ctx
            .mailboxes
            .get(owner)
            .is_some_and(|m| m.try_send(cmd).is_ok());
        if sent {
            self.metrics.steered_out.inc();
        } else {
            // Full: dropped like any UDP datagram; a CON is retransmitted.
            self.metrics.steer_dropped.inc();
        }
    }

    /// A datagram another shard read for a device of this one.
    pub fn on_steered(self: &Rc<Self>, steered: Box<Steered>) {
        self.metrics.steered_in.inc();
        let Steered {
            peer,
            message,
            device,
            identity,
        } = *steered;
        // Re-encoded, the datagram is as long as it was (options are kept as sent, sorted).
        let size = 4 + message.token.len() + message.options_len();
        self.on_message(peer, Ok(message), device, identity.as_ref(), size);
    }

    /// CoAP devices seen on this shard within EXCHANGE_LIFETIME.
    pub fn devices(&self) -> usize {
        self.devices.borrow().len()
    }

    fn reset_if_con(&self, peer: SocketAddr, e: &DecodeError) {
        if let Some(h) = e.header.filter(|h| h.mtype == MsgType::Con) {
            self.ep
                .send(peer, &Message::empty(MsgType::Rst, h.message_id));
        }
    }

    /// Whether `peer` has proven it receives.
    pub(super) fn is_verified(&self, peer: SocketAddr) -> bool {
        self.secure || self.ep.is_verified(peer)
    }

    fn mark_verified(&self, peer: SocketAddr) {
        self.ep.mark_verified(peer);
    }

    fn on_message(
        self: &Rc<Self>,
        peer: SocketAddr,
        decoded: Result<Message, DecodeError>,
        device: Option<ByteString>,
        identity: Option<&DeviceIdentity>,
        size: usize,
    ) {
        let m = match decoded {
            Ok(m) => m,
            Err(e) => {
                self.metrics.format_error(e.kind.into());
                tracing::debug!(%peer, error = %e, "bad coap datagram");
                self.reset_if_con(peer, &e);
                return;
            }
        };
        match m.mtype {
            MsgType::Ack | MsgType::Rst => {
                let reset = m.mtype == MsgType::Rst;
                if reset {
                    self.metrics.rst_received.inc();
                }
                if !m.code.is_empty() {
                    // A piggybacked response: sluice sends no requests to devices.
                    self.metrics.format_error(FormatError::Unexpected);
                    return;
                }
                if !self.ep.on_answer(peer, m.message_id, reset) && reset {
                    self.observers.on_reset(peer, m.message_id);
                }
            }
            MsgType::Con | MsgType::Non => {
                if m.code.is_empty() {
                    // CoAP ping (RFC 7252 §4.3): answered with RST.
                    if m.mtype == MsgType::Con {
                        self.ep
                            .send(peer, &Message::empty(MsgType::Rst, m.message_id));
                    }
                    return;
                }
                if !m.code.is_request() {
                    self.metrics.format_error(FormatError::Unexpected);
                    if m.mtype == MsgType::Con {
                        self.ep
                            .send(peer, &Message::empty(MsgType::Rst, m.message_id));
                    }
                    return;
                }
                let device = device.unwrap_or_else(|| match identity {
                    Some(id) => id.device_id.clone(),
                    None => device_id(&m, peer),
                });
                self.on_request(peer, m, device, identity, size);
            }
        }
    }

    fn on_request(
        self: &Rc<Self>,
        peer: SocketAddr,
        mut m: Message,
        device: ByteString,
        identity: Option<&DeviceIdentity>,
        size: usize,
    ) {
        let now = Instant::now();
        let key = (peer, m.message_id);
        let seen = match self.exchanges.borrow().check(&key, now) {
            Seen::Done(x) => Some(x.clone()),
            Seen::InProgress => Some(Rc::default()),
            Seen::New => None,
        };
        if let Some(x) = seen {
            if m.mtype == MsgType::Con {
                self.metrics.duplicates_con.inc();
                let again = x.answer.borrow().clone();
                match again {
                    Some(bytes) => self.ep.send_bytes(peer, &bytes),
                    None => self.ack_empty(peer, m.message_id, &x),
                }
            } else {
                self.metrics.duplicates_non.inc();
            }
            return;
        }
        let x = Rc::new(Exchange::default());
        {
            let cfg = &self.ctx.config.coap;
            let lifetime = match m.mtype {
                MsgType::Con => cfg.exchange_lifetime,
                _ => cfg.non_lifetime,
            };
            let mut table = self.exchanges.borrow_mut();
            table.insert(key, lifetime, now);
            table.complete(&key, x.clone());
        }
        self.exchanges_changed();
        // An Echo sluice issued to this address (RFC 9175): it receives. The option is
        // sluice's own, not passed on (to an upstream).
        if let Some(echo) = m.option(opt::ECHO) {
            if identity.is_none() && verify::echo_valid(peer, echo) {
                self.metrics.verified_echo.inc();
                self.mark_verified(peer);
            }
            m.remove_option(opt::ECHO);
        }
        self.metrics.request(m.code);
        self.seen_device(&device, now);
        let asked = Asked {
            mtype: m.mtype,
            mid: m.message_id,
            token: m.token,
            no_response: m.uint_option(opt::NO_RESPONSE).unwrap_or(0),
            size,
            authenticated: identity.is_some(),
            block2: m.uint_option(opt::BLOCK2),
        };
        let caller = Caller {
            identity,
            limit: if identity.is_some() || self.is_verified(peer) {
                None
            } else {
                Some(size.saturating_mul(3))
            },
        };
        match super::resources::dispatch(self, peer, &m, &device, caller) {
            Reply::Now(resp) => self.answer(peer, asked, resp, &x),
            Reply::Later(fut) => {
                let this = self.clone();
                let separate_after = self.ctx.config.coap.separate_after;
                tokio::task::spawn_local(async move {
                    let mut fut = fut;
                    if asked.mtype == MsgType::Con {
                        tokio::select! {
                            biased;
                            resp = &mut fut => return this.answer(peer, asked, resp, &x),
                            () = tokio::time::sleep(separate_after) => {}
                        }
                        // A duplicate may have been ACKed empty already.
                        if !x.separated.get() {
                            this.ack_empty(peer, asked.mid, &x);
                        }
                    }
                    let resp = fut.await;
                    this.answer(peer, asked, resp, &x);
                });
            }
        }
    }

    fn exchanges_changed(&self) {
        let table = self.exchanges.borrow();
        let evicted = table.evictions();
        self.metrics
            .dedup_evictions
            .add(evicted - self.evictions_seen.replace(evicted));
        self.metrics.exchanges.set(table.len() as i64);
        self.metrics.exchange_bytes.set(table.bytes() as i64);
    }

    /// Keep `bytes` as the answer a duplicate of (`peer`, `mid`) gets, charged to the table.
    fn store_answer(&self, peer: SocketAddr, mid: u16, x: &Exchange, bytes: Bytes) {
        let len = bytes.len();
        if x.answer.replace(Some(bytes)).is_none() {
            self.exchanges
                .borrow_mut()
                .charge(&(peer, mid), len, Instant::now());
            self.exchanges_changed();
        }
    }

    /// ACK a CON empty: its response will come as a separate CON.
    fn ack_empty(&self, peer: SocketAddr, mid: u16, x: &Exchange) {
        x.separated.set(true);
        let bytes = Message::empty(MsgType::Ack, mid).to_udp();
        self.ep.send_bytes(peer, &bytes);
        self.store_answer(peer, mid, x, bytes);
    }

    /// `resp` as it may go to `peer`: as is when it fits; else, to an address that has not
    /// proven it receives, 4.01 Unauthorized with an Echo option (the client repeats the
    /// request with it, RFC 9175 §2.4) — or without its diagnostic when that is enough;
    /// to a verified one, the Block2 block asked for, within `max_message_size`.
    fn fit(&self, peer: SocketAddr, asked: &Asked, mut resp: Message) -> Message {
        let verified = asked.authenticated || self.is_verified(peer);
        let max = self.ctx.config.coap.max_message_size.as_usize();
        let limit = if verified {
            max
        } else {
            max.min(asked.size.saturating_mul(3))
        };
        let size = |m: &Message| 4 + m.token.len() + m.options_len();
        if size(&resp) <= limit {
            return resp;
        }
        if !verified {
            if resp.code.class() != 2 && !resp.payload.is_empty() {
                // A diagnostic is optional (RFC 7252 §5.5.2).
                resp.payload = Bytes::new();
                if size(&resp) <= limit {
                    return resp;
                }
            }
            self.metrics.refused(Refusal::Unverified, peer);
            let mut m = Message::new(resp.mtype, Code::UNAUTHORIZED, 0, asked.token);
            m.add_option(opt::ECHO, Bytes::copy_from_slice(&verify::echo_for(peer)));
            if size(&m) > limit {
                m.remove_option(opt::ECHO);
            }
            return m;
        }
        if resp.code.class() == 2 && !resp.payload.is_empty() && resp.option(opt::BLOCK2).is_none()
        {
            let body = std::mem::take(&mut resp.payload);
            if resp.option(opt::ETAG).is_none() {
                // Every block carries it: a client sees when the representation changed
                // between its block requests.
                let format = resp.uint_option(opt::CONTENT_FORMAT);
                let etag = super::resources::etag_of(&body, format);
                resp.add_option(opt::ETAG, Bytes::copy_from_slice(&etag));
            }
            // Block2 (≤ 3 bytes), Size2 (≤ 4), their headers (≤ 2 each) and the marker.
            let room = max.saturating_sub(size(&resp) + 12);
            let ours = Block::szx_for(self.ctx.config.coap.block_size.as_usize());
            if let Some(szx) = (0..=ours).rev().find(|s| 16usize << s <= room) {
                return super::resources::slice_block2(asked.block2, szx, resp, body);
            }
        }
        self.metrics.refused(Refusal::TooLarge, peer);
        let mut m = Message::new(resp.mtype, Code::INTERNAL_SERVER_ERROR, 0, asked.token);
        m.payload = Bytes::from_static(b"response too large");
        m
    }

    /// Send `resp` (code, options, payload) as the answer to the request `asked`.
    fn answer(&self, peer: SocketAddr, asked: Asked, mut resp: Message, x: &Exchange) {
        let suppressed = match resp.code.class() {
            2 => asked.no_response & 2 != 0,
            4 => asked.no_response & 8 != 0,
            5 => asked.no_response & 16 != 0,
            _ => false,
        };
        resp.token = asked.token;
        let resp = self.fit(peer, &asked, resp);
        match asked.mtype {
            MsgType::Con if !x.separated.get() => {
                if suppressed {
                    return self.ack_empty(peer, asked.mid, x);
                }
                let mut resp = resp;
                resp.mtype = MsgType::Ack;
                resp.message_id = asked.mid;
                let bytes = resp.to_udp();
                self.metrics.response(resp.code);
                self.ep.send_bytes(peer, &bytes);
                self.store_answer(peer, asked.mid, x, bytes);
            }
            MsgType::Con => {
                if !suppressed {
                    // To an address not verified, the separate response and its
                    // retransmissions together stay within 3× the request (the empty ACK
                    // counted): fewer retransmissions, never a larger answer.
                    let max = self.ctx.config.coap.max_retransmit;
                    let retransmit = if asked.authenticated || self.is_verified(peer) {
                        max
                    } else {
                        let room = (asked.size * 3).saturating_sub(4);
                        let each = 4 + resp.token.len() + resp.options_len();
                        (room / each.max(1)).saturating_sub(1).min(max as usize) as u8
                    };
                    // The outcome is the device's business: it ACKs or it does not.
                    drop(self.ep.send_con_with(peer, resp, retransmit));
                }
            }
            _ => {
                if !suppressed {
                    let mut resp = resp;
                    resp.mtype = MsgType::Non;
                    resp.message_id = self.ep.next_message_id();
                    self.ep.send(peer, &resp);
                }
            }
        }
    }

    fn seen_device(&self, device: &ByteString, now: Instant) {
        let mut devices = self.devices.borrow_mut();
        if let Some(at) = devices.get_mut(device) {
            *at = now;
            return;
        }
        if devices.len() >= self.limits.max_devices && self.devices_swept.borrow_mut().due(now) {
            let lifetime = self.ctx.config.coap.exchange_lifetime;
            devices.retain(|_, at| now.duration_since(*at) < lifetime);
        }
        if devices.len() < self.limits.max_devices {
            devices.insert(device.clone(), now);
        }
        self.metrics.devices.set(devices.len() as i64);
    }

    /// Forget Block1 transfers idle for longer than `coap.block_idle_timeout`.
    pub(super) fn expire_transfers(&self, now: Instant) {
        let idle: Duration = self.ctx.config.coap.block_idle_timeout;
        let mut expired = 0;
        self.transfers.borrow_mut().retain(|_, t| {
            let keep = now.duration_since(t.last) < idle;
            expired += !keep as u64;
            keep
        });
        self.metrics.block_transfers_failed.add(expired);
        self.metrics.block_transfers_expired.add(expired);
    }
}
