//! `POST`/`PUT {pubsub_path}/{topic}`: a device's publish, reassembled from Block1 blocks
//! when it came in several, checked like an MQTT PUBLISH's topic, turned into a
//! [`DeviceMessage`] and handed to the router; the device's 2.04 Changed under the MQTT QoS 1
//! rule (after every sink's cloud ack, or the spool commit with `ack = "spool"`).
//!
//! Owns: the query parameters (`qos`, `retain`), Content-Format → MQTT 5 Content Type, the
//! Block1 transfers of publishes (at most `max_block_transfers_per_source` per IP, their
//! bodies within `max_block_bytes`, forgotten after `block_idle_timeout` without a block),
//! the back-pressure answer (5.03 with Max-Age), and charging each publish to its device's
//! `[limits]` publish rate (ADR 0008: a DTLS device by its identity, a plain CoAP one by its
//! source address; over the rate a CON is answered 5.03 with Max-Age = when its tokens are
//! back and a NON is dropped and answered 5.03 — neither is routed). Does not own: routing
//! (`crate::shard::router`), how the answer travels (`server`), or the buckets
//! (`crate::control::limits::DeviceRates`).
//!
//! Invariants: a QoS 1 publish is answered 2.04 only once its token completed; a token
//! completed with a failure code gets 5.02, an abandoned one 5.03 — never a success for
//! something not delivered; a publish over its device's rate is never routed.

use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Instant;

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::coap::block::{BlockError, Progress};
use sluice_proto::coap::{format, opt, Block, Code, Message, MsgType, Token};
use sluice_proto::mqtt::{topic, Properties, ProtocolVersion, QoS};

use super::metrics::Refusal;
use super::resources::{bad_request, error, unavailable, unavailable_for};
use super::server::{CoapShard, Reply, Transfer, TRANSFER_OVERHEAD};
use super::DeviceIdentity;
use crate::control::limits::RateKey;
use crate::message::ack::{AckToken, DeviceAcks};
use crate::message::DeviceMessage;
use crate::shard::router;

/// The MQTT 5 Content Type for a CoAP Content-Format (none for octet-stream or unknown).
pub(super) fn content_type(cf: u32) -> Option<&'static str> {
    Some(match cf as u16 {
        format::TEXT_PLAIN => "text/plain;charset=utf-8",
        format::LINK_FORMAT => "application/link-format",
        format::JSON => "application/json",
        format::CBOR => "application/cbor",
        format::SENML_JSON => "application/senml+json",
        format::SENML_CBOR => "application/senml+cbor",
        _ => return None,
    })
}

/// Counts a publish as waiting for the router until dropped.
struct Pending(Rc<CoapShard>);

impl Pending {
    fn new(shard: &Rc<CoapShard>) -> Pending {
        let c: &Cell<usize> = &shard.pending_publishes;
        c.set(c.get() + 1);
        Pending(shard.clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let c = &self.0.pending_publishes;
        c.set(c.get().saturating_sub(1));
    }
}

pub(super) fn publish(
    shard: &Rc<CoapShard>,
    peer: SocketAddr,
    req: &Message,
    device: &ByteString,
    identity: Option<&DeviceIdentity>,
    segments: &[&str],
) -> Reply {
    let name = segments.join("/");
    // Diagnostics are constants: an answer never echoes the request's bytes (issue 28 #9).
    if !topic::valid_topic_name(&name) {
        return bad_request(shard, "invalid topic name");
    }
    if crate::shard::limits::TopicLimits::new(&shard.ctx.config.mqtt)
        .check(&name)
        .is_err()
    {
        shard.metrics.refused(Refusal::TopicLimit, peer);
        return bad_request(shard, "topic beyond the gateway's limits");
    }
    if !(shard.ctx.acl).allows_publish(crate::control::acl::Edge::Coap, device, None, &name) {
        return Reply::Now(error(Code::FORBIDDEN, "not authorized")); // [acl], counted there
    }
    let qos = match req.query("qos") {
        None if req.mtype == MsgType::Con => QoS::AtLeastOnce,
        None => QoS::AtMostOnce,
        Some(b"0") => QoS::AtMostOnce,
        Some(b"1") => QoS::AtLeastOnce,
        Some(_) => return bad_request(shard, "qos must be 0 or 1"),
    };
    let retain = match req.query("retain") {
        None | Some(b"false") | Some(b"0") => false,
        Some(b"true") | Some(b"1") | Some(b"") => true,
        Some(_) => return bad_request(shard, "retain must be true or false"),
    };
    let mut final_block = None;
    let payload = match req.uint_option(opt::BLOCK1) {
        None => req.payload.clone(),
        Some(v) => match block1(shard, peer, &name, req, v) {
            Ok((body, b)) => {
                final_block = Some(b);
                body
            }
            Err(reply) => return reply,
        },
    };
    if shard.pending_publishes.get() >= shard.limits.max_pending {
        return Reply::Now(unavailable(shard, "gateway busy; retry after Max-Age"));
    }
    if let Some(rates) = shard.rates.borrow_mut().as_mut() {
        let (key, who) = match identity {
            Some(id) => (
                RateKey::Identity(id.device_id.clone()),
                Who::Identity(device),
            ),
            None => (RateKey::address(peer.ip()), Who::Address(peer, device)),
        };
        let confirmable = req.mtype == MsgType::Con;
        if let Err(wait) = rates.admit(&key, payload.len(), confirmable, &who) {
            return Reply::Now(unavailable_for(wait, "over this device's publish rate"));
        }
    }
    let properties = req
        .uint_option(opt::CONTENT_FORMAT)
        .and_then(content_type)
        .map(|ct| {
            Box::new(Properties {
                content_type: Some(ByteString::from_static(ct)),
                ..Properties::default()
            })
        });
    let acks = (qos == QoS::AtLeastOnce).then(DeviceAcks::new);
    let msg = Box::new(DeviceMessage {
        device: device.clone(),
        topic: ByteString::from(name),
        payload,
        qos,
        retain,
        properties,
        received_at: Instant::now(),
        ack: acks.as_ref().map(|a| AckToken::new(a, 0)),
    });
    shard.ctx.metrics.messages_received.inc();
    shard.metrics.publishes.inc();
    let priority = shard.ctx.rules.device(device);
    let pending = Pending::new(shard);
    let ctx = shard.ctx.clone();
    let changed = move || {
        let mut m = Message::new(MsgType::Ack, Code::CHANGED, 0, Token::EMPTY);
        if let Some(b) = final_block {
            m.add_uint_option(opt::BLOCK1, b.to_uint());
        }
        m
    };
    let Some(acks) = acks else {
        tokio::task::spawn_local(async move {
            router::publish(&ctx, msg, priority).await;
            drop(pending);
        });
        return Reply::Now(changed());
    };
    let shard = shard.clone();
    Reply::Later(Box::pin(async move {
        router::publish(&ctx, msg, priority).await;
        drop(pending);
        loop {
            if !acks.drain().is_empty() {
                let reason = acks.take_reason(0, ProtocolVersion::V5);
                if reason >= 0x80 {
                    return error(
                        Code::BAD_GATEWAY,
                        format!("the cloud refused the message (reason 0x{reason:02x})"),
                    );
                }
                return changed();
            }
            if acks.is_abandoned() {
                return unavailable(&shard, "message lost before it was stored; send again");
            }
            acks.notify.notified().await;
        }
    }))
}

/// The device a `[limits]` log line names.
enum Who<'a> {
    Identity(&'a ByteString),
    /// A plain CoAP device: charged to its address, named with the id it gave.
    Address(SocketAddr, &'a ByteString),
}

impl std::fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Identity(id) => write!(f, "coaps:{id}"),
            Who::Address(peer, id) => write!(f, "coap:{} (as {id})", peer.ip()),
        }
    }
}

/// Take one Block1 block of a publish to `name`: the whole body with the last block's value
/// when complete, else the answer to send now (2.31 Continue, 4.08, 4.13, 5.03).
fn block1(
    shard: &Rc<CoapShard>,
    peer: SocketAddr,
    name: &str,
    req: &Message,
    value: u32,
) -> Result<(Bytes, Block), Reply> {
    let Some(b) = Block::from_uint(value).filter(|b| b.szx <= 6) else {
        return Err(bad_request(shard, "bad Block1 value"));
    };
    let cfg = &shard.ctx.config.coap;
    let max = cfg.max_body_size.as_usize();
    let too_large = |shard: &CoapShard| {
        shard.metrics.block_transfers_failed.inc();
        let mut m = error(Code::REQUEST_ENTITY_TOO_LARGE, "body too large");
        m.add_uint_option(opt::SIZE1, max.min(u32::MAX as usize) as u32);
        Reply::Now(m)
    };
    let now = Instant::now();
    let key = (peer, name.to_string());
    let mut transfers = shard.transfers.borrow_mut();
    if b.num == 0 {
        if !b.more {
            // The whole body in one block.
            return if req.payload.len() > max {
                Err(too_large(shard))
            } else {
                Ok((req.payload.clone(), b))
            };
        }
        if !transfers.contains_key(&key) {
            drop(transfers);
            shard.expire_transfers(now);
            transfers = shard.transfers.borrow_mut();
            if transfers.len() >= shard.limits.max_transfers {
                return Err(Reply::Now(unavailable(shard, "too many block transfers")));
            }
            let ip = peer.ip();
            let of_source = transfers.keys().filter(|(p, _)| p.ip() == ip).count();
            if of_source >= cfg.max_block_transfers_per_source {
                shard.metrics.refused(Refusal::BlockPerSource, peer);
                return Err(Reply::Now(unavailable(
                    shard,
                    "too many block transfers from this address",
                )));
            }
            shard.metrics.block_transfers_started.inc();
        }
        // Block 0 again starts the transfer over.
        let ours = Block::szx_for(cfg.block_size.as_usize());
        transfers.insert(
            key.clone(),
            Transfer {
                assembly: sluice_proto::coap::block::Assembly::new(max, ours),
                last: now,
            },
        );
    }
    let Some(t) = transfers.get_mut(&key) else {
        shard.metrics.block_transfers_failed.inc();
        return Err(Reply::Now(error(
            Code::REQUEST_ENTITY_INCOMPLETE,
            "no transfer in progress: start with block 0",
        )));
    };
    t.last = now;
    // Bodies in progress on this shard stay within their share of `coap.max_block_bytes`.
    let held = transfers
        .iter()
        .map(|((_, topic), t)| t.assembly.len() + topic.len() + TRANSFER_OVERHEAD)
        .sum::<usize>();
    if held + req.payload.len() > shard.limits.max_block_bytes {
        transfers.remove(&key);
        drop(transfers);
        shard.metrics.block_transfers_failed.inc();
        shard.metrics.refused(Refusal::BlockBytes, peer);
        return Err(Reply::Now(unavailable(
            shard,
            "too many block bytes in progress",
        )));
    }
    let Some(t) = transfers.get_mut(&key) else {
        return Err(Reply::Now(unavailable(shard, "transfer gone")));
    };
    let size1 = req.uint_option(opt::SIZE1);
    match t.assembly.push(b, &req.payload, size1) {
        Ok(Progress::Continue(echo)) => {
            let mut m = Message::new(MsgType::Ack, Code::CONTINUE, 0, Token::EMPTY);
            m.add_uint_option(opt::BLOCK1, echo.to_uint());
            Err(Reply::Now(m))
        }
        Ok(Progress::Complete(body)) => {
            transfers.remove(&key);
            shard.metrics.block_transfers_completed.inc();
            Ok((body, b))
        }
        Err(e) => {
            transfers.remove(&key);
            drop(transfers);
            match e {
                BlockError::TooLarge { .. } => Err(too_large(shard)),
                BlockError::OutOfOrder { .. } => {
                    shard.metrics.block_transfers_failed.inc();
                    Err(Reply::Now(error(
                        Code::REQUEST_ENTITY_INCOMPLETE,
                        Bytes::from_static(b"block out of order"),
                    )))
                }
                BlockError::BadSize => {
                    shard.metrics.block_transfers_failed.inc();
                    Err(bad_request(shard, "bad block size"))
                }
            }
        }
    }
}
