//! What a device's request is for: `/.well-known/core` (RFC 6690), the pub/sub resource
//! (`{pubsub_path}/{topic}`: POST/PUT publish, GET observe), a `[[coap.proxy]]` upstream, or
//! nothing (4.04).
//!
//! Owns: the dispatch by path and method, the option checks every request passes (unknown
//! critical options: 4.02), who may publish and observe (`coap.allow_anonymous`), the topic
//! limits of an Observe filter, the
//! link-format document and Block2 slicing of local responses.
//!
//! Invariant: a diagnostic payload is a constant or a short formatted number, never the
//! request's own bytes (an answer stays small whatever the request held).
//! Does not own: publishing (`publish`), observing (`observe`), proxying (`crate::proxy`).

use std::net::SocketAddr;
use std::rc::Rc;

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::coap::link::{Attr, LinkWriter};
use sluice_proto::coap::{block, format, opt, Block, Code, Message, MsgType, Token};

use super::metrics::{FormatError, Refusal};
use super::server::{Caller, CoapShard, Reply};

/// Critical options sluice understands (RFC 7252 §5.4.1: any other critical option in a
/// request gets 4.02 Bad Option).
const KNOWN_CRITICAL: [u16; 11] = [
    opt::IF_MATCH,
    opt::URI_HOST,
    opt::IF_NONE_MATCH,
    opt::URI_PORT,
    opt::URI_PATH,
    opt::URI_QUERY,
    opt::ACCEPT,
    opt::BLOCK2,
    opt::BLOCK1,
    opt::PROXY_URI,
    opt::PROXY_SCHEME,
];

/// A response with `code` and a diagnostic payload (RFC 7252 §5.5.2).
pub(super) fn error(code: Code, diagnostic: impl Into<Bytes>) -> Message {
    let mut m = Message::new(MsgType::Ack, code, 0, Token::EMPTY);
    m.payload = diagnostic.into();
    m
}

/// 5.03 Service Unavailable with Max-Age = `retry_after`.
pub(super) fn unavailable(shard: &CoapShard, why: &'static str) -> Message {
    unavailable_for(shard.ctx.config.coap.retry_after, why)
}

/// 5.03 Service Unavailable with Max-Age = `retry` (whole seconds, rounded up, at least 1):
/// when the device may try again (RFC 7252 §5.9.3.4).
pub(super) fn unavailable_for(retry: std::time::Duration, why: &'static str) -> Message {
    let mut m = error(
        Code::SERVICE_UNAVAILABLE,
        Bytes::from_static(why.as_bytes()),
    );
    let secs = retry.as_millis().div_ceil(1000).clamp(1, u32::MAX as u128);
    m.add_uint_option(opt::MAX_AGE, secs as u32);
    m
}

/// 4.00 Bad Request with a constant diagnostic (never the request's bytes).
pub(super) fn bad_request(shard: &CoapShard, diagnostic: &'static str) -> Reply {
    shard.metrics.format_error(FormatError::BadRequest);
    Reply::Now(error(
        Code::BAD_REQUEST,
        Bytes::from_static(diagnostic.as_bytes()),
    ))
}

pub(super) fn dispatch(
    shard: &Rc<CoapShard>,
    peer: SocketAddr,
    req: &Message,
    device: &ByteString,
    caller: Caller<'_>,
) -> Reply {
    // A proxied request goes first: a proxy forwards the safe-to-forward options it does not
    // know, critical or not, and leaves them to the server (RFC 7252 §5.7.1); `route` refuses
    // unknown unsafe ones itself (4.02).
    if let Some(route) = shard.ctx.proxies.route(req) {
        return match route {
            Ok(route) => Reply::Later(Box::pin(shard.ctx.proxies.forward(route, req.clone()))),
            Err(code) => Reply::Now(error(code, "cannot proxy this request")),
        };
    }
    if req
        .options
        .iter()
        .any(|o| opt::is_critical(o.number) && !KNOWN_CRITICAL.contains(&o.number))
    {
        shard
            .metrics
            .format_error(FormatError::UnknownCriticalOption);
        return Reply::Now(error(
            Code::BAD_OPTION,
            Bytes::from_static(b"unknown critical option"),
        ));
    }
    if req.option(opt::PROXY_URI).is_some() || req.option(opt::PROXY_SCHEME).is_some() {
        return Reply::Now(error(
            Code::PROXYING_NOT_SUPPORTED,
            "no configured upstream for this Proxy-Uri",
        ));
    }
    // A topic has at most `mqtt.max_topic_levels` levels: more Uri-Path segments than that
    // (plus the resource's own) are refused before anything is built from them.
    let limits = crate::shard::limits::TopicLimits::new(&shard.ctx.config.mqtt);
    if req.uri_path().count() > limits.max_levels.saturating_add(1) {
        shard.metrics.refused(Refusal::TopicLimit, peer);
        return bad_request(shard, "topic beyond the gateway's limits");
    }
    let mut path = Vec::new();
    for seg in req.uri_path() {
        match std::str::from_utf8(seg) {
            Ok(s) => path.push(s),
            Err(_) => return bad_request(shard, "Uri-Path is not UTF-8"),
        }
    }
    let ps = shard.ctx.config.coap.pubsub_path.as_str();
    match path.as_slice() {
        [".well-known", "core"] => match req.code {
            Code::GET => Reply::Now(well_known(shard, req)),
            _ => Reply::Now(error(Code::METHOD_NOT_ALLOWED, "GET only")),
        },
        [first, rest @ ..]
            if *first == ps
                && matches!(req.code, Code::POST | Code::PUT | Code::GET)
                && caller.identity.is_none()
                && !shard.limits.anonymous =>
        {
            // `coap.allow_anonymous` (by default as MQTT): no identity, no data.
            shard.metrics.refused(Refusal::Anonymous, peer);
            Reply::Now(error(
                Code::UNAUTHORIZED,
                Bytes::from_static(b"anonymous peers may not publish or observe"),
            ))
        }
        [first, rest @ ..] if *first == ps => match req.code {
            Code::POST | Code::PUT => {
                super::publish::publish(shard, peer, req, device, caller.identity, rest)
            }
            Code::GET => {
                let filter = rest.join("/");
                if limits.check(&filter).is_err() {
                    shard.metrics.refused(Refusal::TopicLimit, peer);
                    return bad_request(shard, "topic filter beyond the gateway's limits");
                }
                let observers = shard.observers.clone();
                let (device, req) = (device.clone(), req.clone());
                let authenticated = caller.identity.is_some();
                let max = shard.ctx.config.coap.max_message_size.as_usize();
                let limit = caller.limit.map(|l| l.min(max));
                Reply::Later(Box::pin(async move {
                    let resp = observers
                        .on_get_from(peer, &device, authenticated, &req, &filter)
                        .await;
                    // A registration whose first answer is too large for an address not
                    // verified gets 4.01 + Echo instead (`server::fit`): it does not stay
                    // registered; the client registers again with the Echo.
                    let size = 4 + req.token.len() + resp.options_len();
                    if resp.option(opt::OBSERVE).is_some() && limit.is_some_and(|l| size > l) {
                        observers.withdraw(peer, req.token).await;
                    }
                    resp
                }))
            }
            _ => Reply::Now(error(Code::METHOD_NOT_ALLOWED, "POST, PUT or GET")),
        },
        _ => Reply::Now(error(Code::NOT_FOUND, "no such resource")),
    }
}

/// `GET /.well-known/core`: the pub/sub resource and each reverse-proxy prefix.
fn well_known(shard: &CoapShard, req: &Message) -> Message {
    if req
        .uint_option(opt::ACCEPT)
        .is_some_and(|a| a != format::LINK_FORMAT as u32)
    {
        return error(Code::NOT_ACCEPTABLE, "only application/link-format (40)");
    }
    let cfg = &shard.ctx.config.coap;
    let mut w = LinkWriter::new();
    w.link(
        &[cfg.pubsub_path.as_str()],
        &[("rt", Attr::Quoted("core.ps")), ("ct", Attr::Uint(40))],
    );
    for p in &cfg.proxy {
        if let Some(prefix) = &p.prefix {
            let segs: Vec<&str> = prefix.split('/').filter(|s| !s.is_empty()).collect();
            w.link(&segs, &[("title", Attr::Quoted(&p.name))]);
        }
    }
    let body = Bytes::from(w.finish());
    let mut resp = Message::new(MsgType::Ack, Code::CONTENT, 0, Token::EMPTY);
    resp.add_uint_option(opt::CONTENT_FORMAT, format::LINK_FORMAT as u32);
    with_block2(shard, req, resp, body)
}

/// Put `body` into `resp`, as the Block2 block the request asks for (or block 0) when it is
/// larger than `block_size` or the request asked for blocks.
pub(super) fn with_block2(
    shard: &CoapShard,
    req: &Message,
    mut resp: Message,
    body: Bytes,
) -> Message {
    let ours = Block::szx_for(shard.ctx.config.coap.block_size.as_usize());
    let asked = req.uint_option(opt::BLOCK2);
    if asked.is_none() && body.len() <= 1 << (ours + 4) {
        resp.payload = body;
        return resp;
    }
    slice_block2(asked, ours, resp, body)
}

/// The ETag of a representation sent block-wise (RFC 7959 §2.4: every block of one
/// representation carries the same ETag, so a client can tell when blocks come from
/// different ones): 8 bytes of a hash of its bytes and Content-Format. A digest of the
/// content, so the same bytes keep their ETag on every shard (and across restarts of one
/// build: `DefaultHasher::new` has fixed keys).
pub(super) fn etag_of(body: &[u8], format: Option<u32>) -> [u8; 8] {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    body.hash(&mut h);
    format.hash(&mut h);
    h.finish().to_be_bytes()
}

/// Put block `asked` (a request's Block2 value; block 0 when absent) of `body` into `resp`,
/// in blocks of at most SZX `ours`; Size2 with block 0.
pub(super) fn slice_block2(
    asked: Option<u32>,
    ours: u8,
    mut resp: Message,
    body: Bytes,
) -> Message {
    let asked = asked.and_then(Block::from_uint);
    let (num, szx) = match asked {
        Some(b) if b.szx <= 6 => (b.num, b.szx.min(ours)),
        // A client asking with a larger size continues at ours (RFC 7959 §2.4).
        Some(b) => (b.num, ours),
        None => (0, ours),
    };
    // A smaller size than asked: the asked block's offset in our blocks.
    let num = match asked {
        Some(b) if b.szx.min(6) > szx => ((b.offset()) >> (szx + 4)) as u32,
        _ => num,
    };
    match block::slice(&body, num, szx) {
        Some((part, b)) => {
            resp.add_uint_option(opt::BLOCK2, b.to_uint());
            if num == 0 {
                resp.add_uint_option(opt::SIZE2, body.len() as u32);
            }
            resp.payload = part;
            resp
        }
        None => error(Code::BAD_OPTION, "Block2 past the end of the resource"),
    }
}
