//! Observe (RFC 7641) subscriptions on the pub/sub resource: `GET {pubsub_path}/{filter}`
//! with Observe=0 registers, every routed message matching `filter` becomes a notification.

use std::net::SocketAddr;
use std::rc::Rc;

use bytestring::ByteString;
use sluice_proto::coap::{Code, Message, MsgType};

use super::CoapOut;
use crate::shard::ShardContext;

/// The observers of one shard.
pub struct Observers {
    #[allow(dead_code)]
    ctx: Rc<ShardContext>,
    #[allow(dead_code)]
    out: Rc<dyn CoapOut>,
}

impl Observers {
    pub fn new(ctx: Rc<ShardContext>, out: Rc<dyn CoapOut>) -> Rc<Observers> {
        Rc::new(Observers { ctx, out })
    }

    /// A GET on the pub/sub resource from `device` at `peer`; `filter` is the Uri-Path after
    /// `pubsub_path`, joined by `/`. Returns the response (code, options, payload; the caller
    /// sets type, message id and token and sends it).
    pub async fn on_get(
        self: &Rc<Self>,
        _peer: SocketAddr,
        _device: &ByteString,
        req: &Message,
        _filter: &str,
    ) -> Message {
        Message::new(MsgType::Ack, Code::NOT_IMPLEMENTED, 0, req.token)
    }

    /// An RST from `peer` for message id `mid` that matched no CON sluice is retransmitting
    /// (a NON notification the device no longer wants).
    pub fn on_reset(&self, _peer: SocketAddr, _mid: u16) {}

    /// Observers registered on this shard.
    pub fn len(&self) -> usize {
        0
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
