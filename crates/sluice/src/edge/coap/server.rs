//! One shard's CoAP server: the receive loop on its SO_REUSEPORT socket, steering each
//! datagram to the shard that owns its device, message-id de-duplication, and answering a
//! request piggybacked, separately, or as a NON.
//!
//! Owns: the shard's exchange table, per-source budget, Block1 transfers and device table.
//! Does not own: what a request means (`resources`, `publish`), the observers (`observe`),
//! or sending/retransmitting (`endpoint`).
//!
//! Invariants: the receive loop never waits for a request to be served (anything slow runs
//! in its own local task); a duplicate CON is answered with what the first got (or an empty
//! ACK while that is still being worked out) and never served twice; a CON whose header was
//! readable but whose message was not gets RST; nothing here panics on any datagram.

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
use sluice_proto::coap::{opt, DecodeError, Message, MsgType, Token};
use tokio::net::UdpSocket;
use tokio::sync::watch;

use super::endpoint::{Endpoint, SourceBudget};
use super::metrics::{CoapMetrics, FormatError};
use super::observe::Observers;
use super::CoapOut;
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

/// What of a request its answer needs.
#[derive(Clone, Copy)]
struct Asked {
    mtype: MsgType,
    mid: u16,
    token: Token,
    /// RFC 7967 No-Response bits (2: no 2.xx, 8: no 4.xx, 16: no 5.xx).
    no_response: u32,
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
        let out: Rc<dyn CoapOut> = ep.clone();
        let per_shard = |n: usize| (n / shards).max(1);
        Rc::new(CoapShard {
            observers: Observers::new(ctx.clone(), out),
            exchanges: RefCell::new(DedupTable::new(per_shard(cfg.max_exchanges))),
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
            },
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
        let decoded = Message::decode_udp(&Bytes::copy_from_slice(datagram));
        self.on_message(peer, decoded, identity);
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
}

/// The shard that owns `msg`, and for a request its device id: an ACK/RST by its message id
/// (sluice's CONs of shard `s` carry ids `≡ s`), a request by its device id's hash, as MQTT
/// devices are placed.
fn owner_of(msg: &Message, peer: SocketAddr, shards: usize) -> (usize, Option<ByteString>) {
    match msg.mtype {
        MsgType::Ack | MsgType::Rst => (msg.message_id as usize % shards, None),
        MsgType::Con | MsgType::Non => {
            let device = device_id(msg, peer);
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
        shard.steer(peer, bytes);
    }
    tracing::debug!(shard = shard.ctx.id, "coap receive loop stopped");
}

impl CoapShard {
    /// A datagram read from this shard's socket: served here, or passed to its owner.
    fn steer(self: &Rc<Self>, peer: SocketAddr, bytes: Bytes) {
        let shards = self.ctx.mailboxes.len().max(1);
        let message = match Message::decode_udp(&bytes) {
            Ok(m) => m,
            // Answered (RST) or dropped where it was read.
            Err(e) => return self.on_message(peer, Err(e), None),
        };
        let (owner, device) = owner_of(&message, peer, shards);
        if owner == self.ctx.id {
            self.on_message(peer, Ok(message), device);
            return;
        }
        let cmd = ShardCmd::CoapDatagram(Box::new(Steered {
            peer,
            message,
            device,
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
        } = *steered;
        self.on_message(peer, Ok(message), device);
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

    fn on_message(
        self: &Rc<Self>,
        peer: SocketAddr,
        decoded: Result<Message, DecodeError>,
        device: Option<ByteString>,
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
                let device = device.unwrap_or_else(|| device_id(&m, peer));
                self.on_request(peer, m, device);
            }
        }
    }

    fn on_request(self: &Rc<Self>, peer: SocketAddr, m: Message, device: ByteString) {
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
            let evicted = table.evictions();
            self.metrics
                .dedup_evictions
                .add(evicted - self.evictions_seen.replace(evicted));
            self.metrics.exchanges.set(table.len() as i64);
        }
        self.metrics.request(m.code);
        self.seen_device(&device, now);
        let asked = Asked {
            mtype: m.mtype,
            mid: m.message_id,
            token: m.token,
            no_response: m.uint_option(opt::NO_RESPONSE).unwrap_or(0),
        };
        match super::resources::dispatch(self, peer, &m, &device) {
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

    /// ACK a CON empty: its response will come as a separate CON.
    fn ack_empty(&self, peer: SocketAddr, mid: u16, x: &Exchange) {
        x.separated.set(true);
        let bytes = Message::empty(MsgType::Ack, mid).to_udp();
        self.ep.send_bytes(peer, &bytes);
        *x.answer.borrow_mut() = Some(bytes);
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
        match asked.mtype {
            MsgType::Con if !x.separated.get() => {
                if suppressed {
                    return self.ack_empty(peer, asked.mid, x);
                }
                resp.mtype = MsgType::Ack;
                resp.message_id = asked.mid;
                let bytes = resp.to_udp();
                self.metrics.response(resp.code);
                self.ep.send_bytes(peer, &bytes);
                *x.answer.borrow_mut() = Some(bytes);
            }
            MsgType::Con => {
                if !suppressed {
                    // The outcome is the device's business: it ACKs or it does not.
                    drop(self.ep.send_con(peer, resp));
                }
            }
            _ => {
                if !suppressed {
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

    /// Forget Block1 transfers idle for longer than EXCHANGE_LIFETIME.
    pub(super) fn expire_transfers(&self, now: Instant) {
        let lifetime: Duration = self.ctx.config.coap.exchange_lifetime;
        let mut expired = 0;
        self.transfers.borrow_mut().retain(|_, t| {
            let keep = now.duration_since(t.last) < lifetime;
            expired += !keep as u64;
            keep
        });
        self.metrics.block_transfers_failed.add(expired);
    }
}
