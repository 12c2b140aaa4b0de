//! The CoAP proxy: device requests forwarded to upstream CoAP servers over TCP or TLS
//! (RFC 8323), the multipath-proxy paper's end-to-end mode.
//!
//! Owns: per shard, one connection per `[[coap.proxy]]` upstream, shared by every device of
//! the shard (tokens multiplexed), and which upstream a request is for (reverse proxy by path
//! prefix, forward proxy by Proxy-Uri / Proxy-Scheme). Does not own: the device side (the
//! CoAP edge, `crate::edge::coap`, answers the device with what [`ShardProxies::forward`]
//! returns) or routing of published messages (a proxied request is not a publish).

use std::future::Future;

use sluice_proto::coap::{Code, Message};

/// Which upstream a request goes to, and the request as the upstream must see it.
#[derive(Debug)]
pub struct Route {
    /// Index into `config.coap.proxy`.
    pub upstream: usize,
}

/// The upstreams of one shard.
#[derive(Debug, Default)]
pub struct ShardProxies {}

impl ShardProxies {
    /// Whether `req` (a device's request) is for an upstream: `None` when not (the edge
    /// serves it), `Some(Err(code))` when it asks for proxying that cannot be done (e.g. a
    /// Proxy-Uri naming a server that is not configured: 5.05 Proxying Not Supported).
    pub fn route(&self, _req: &Message) -> Option<Result<Route, Code>> {
        None
    }

    /// Forward `req` and resolve with the upstream's response (code, options, payload; the
    /// edge sets type, message id and token), or a 5.0x the proxy made up (5.02 when the
    /// connection died under a non-idempotent request, 5.03 when too many wait, 5.04 on
    /// timeout).
    pub fn forward(&self, route: Route, req: Message) -> impl Future<Output = Message> + 'static {
        let _ = route;
        let mut res = Message::new(req.mtype, Code::PROXYING_NOT_SUPPORTED, 0, req.token);
        res.payload = bytes::Bytes::from_static(b"no upstream configured");
        async move { res }
    }
}
