//! The CoAP proxy: device requests forwarded to upstream CoAP servers over TCP or TLS
//! (RFC 8323), the multipath-proxy paper's end-to-end mode.
//!
//! Owns: per shard, one connection per `[[coap.proxy]]` upstream (one per path with `paths`,
//! ADR 0012), shared by every device of the shard (tokens multiplexed), and which upstream a request is for (reverse proxy by path
//! prefix, forward proxy by Proxy-Uri / Proxy-Scheme). Does not own: the device side (the
//! CoAP edge, `crate::edge::coap`, answers the device with what [`ShardProxies::forward`]
//! returns) or routing of published messages (a proxied request is not a publish).
//!
//! Modules: `route` (matching and rewriting), `conn` (the connection tasks, bounds, retries,
//! path failover), `sched` (which path a request goes to),
//! `tls` (rustls client config), `metrics` (counters and status). Lives on one shard thread:
//! `forward` must be polled inside the shard's `LocalSet` (it spawns the connection task there).

mod conn;
pub mod metrics;
mod route;
mod sched;

use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;

use sluice_proto::coap::{opt, Block, Code, Message};

use crate::config::Config;
pub use metrics::{ProxyMetrics, UpstreamMetrics};
pub use route::Rewrite;

/// Largest frame sluice reads from an upstream, at least: the CSM it announces is this or
/// `coap.max_body_size` + 1 KiB, whichever is larger.
const MIN_UPSTREAM_MESSAGE: usize = 64 * 1024;

/// Which upstream a request goes to, and the request as the upstream must see it.
#[derive(Debug)]
pub struct Route {
    /// Index into `config.coap.proxy`.
    pub upstream: usize,
    /// How the request is rewritten for the upstream.
    pub rewrite: Rewrite,
}

/// The upstreams of one shard.
#[derive(Default)]
pub struct ShardProxies {
    entries: Vec<route::RouteEntry>,
    upstreams: Vec<Rc<conn::Upstream>>,
    metrics: Arc<ProxyMetrics>,
    /// SZX of `coap.block_size`: a GET or FETCH without Block2 asks the upstream for its
    /// first block of this size (RFC 7959 §2.4 early negotiation), so a large resource comes
    /// back block by block in datagrams the device can take.
    block_szx: u8,
}

impl std::fmt::Debug for ShardProxies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardProxies")
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

impl ShardProxies {
    /// The upstreams of `config.coap.proxy`, counting into `metrics` (made by
    /// [`ProxyMetrics::new`] from the same config). Nothing connects until a request comes.
    /// `links`: the link watcher's table, which per-path upstreams follow (`None`: none).
    pub fn new(
        config: &Config,
        metrics: Arc<ProxyMetrics>,
        links: Option<crate::net::links::LinkWatch>,
    ) -> ShardProxies {
        let max_message_size =
            MIN_UPSTREAM_MESSAGE.max(config.coap.max_body_size.0 as usize + 1024);
        ShardProxies {
            entries: config
                .coap
                .proxy
                .iter()
                .map(route::RouteEntry::new)
                .collect(),
            upstreams: config
                .coap
                .proxy
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    Rc::new(conn::Upstream::new(
                        p,
                        config.coap.retry_after,
                        max_message_size,
                        metrics.clone(),
                        i,
                        links.clone(),
                    ))
                })
                .collect(),
            metrics,
            block_szx: Block::szx_for(config.coap.block_size.0 as usize),
        }
    }

    /// This shard's proxy counters.
    pub fn metrics(&self) -> &Arc<ProxyMetrics> {
        &self.metrics
    }

    /// Whether `req` (a device's request) is for an upstream: `None` when not (the edge
    /// serves it), `Some(Err(code))` when it asks for proxying that cannot be done (e.g. a
    /// Proxy-Uri naming a server that is not configured: 5.05 Proxying Not Supported; an
    /// unsafe option the proxy does not know: 4.02 Bad Option).
    pub fn route(&self, req: &Message) -> Option<Result<Route, Code>> {
        route::route(&self.entries, req)
            .map(|r| r.map(|(upstream, rewrite)| Route { upstream, rewrite }))
    }

    /// Forward `req` and resolve with the upstream's response (code, options, payload; the
    /// edge sets type, message id and token), or a 5.0x the proxy made up (5.02 when the
    /// connection died under a non-idempotent request, 5.03 when too many wait, 5.04 on
    /// timeout).
    pub fn forward(&self, route: Route, req: Message) -> impl Future<Output = Message> + 'static {
        let upstream = self.upstreams.get(route.upstream).cloned();
        let szx = self.block_szx;
        async move {
            match upstream {
                Some(up) => {
                    let mut up_req = route::rewrite(req, route.rewrite);
                    if matches!(up_req.code, Code::GET | Code::FETCH)
                        && up_req.option(opt::BLOCK2).is_none()
                    {
                        let first = Block {
                            num: 0,
                            more: false,
                            szx,
                        };
                        up_req.add_uint_option(opt::BLOCK2, first.to_uint());
                    }
                    up.forward(up_req).await
                }
                None => {
                    let mut res = conn::made_up(Code::PROXYING_NOT_SUPPORTED, "no such upstream");
                    res.token = req.token;
                    res.mtype = req.mtype;
                    res
                }
            }
        }
    }
}
