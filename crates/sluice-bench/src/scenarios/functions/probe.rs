//! The cold-start probe: one plain MQTT 3.1.1 connection to sluice that publishes single
//! events (QoS 0, so nothing waits on an acknowledgement) and receives the function's replies
//! on the `reply_topic` it subscribed to, each stamped with its arrival time.
//!
//! Owns: the connection, its reader task and the bounded channel of replies ([`REPLIES_MAX`];
//! a full channel drops the reply, counted in [`Probe::dropped`] — the scenario reads one
//! reply per event, so it never fills). Does not own: what the replies mean
//! ([`super::echo::EchoReply`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::{Bytes, BytesMut};
use sluice_proto::mqtt::{
    Connect, Decoder, Packet, Properties, ProtocolVersion, Publish, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions,
};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;
use tokio::time::timeout;

use crate::conn;
use crate::payload::unix_now_ns;

/// Replies waiting to be read, at most.
pub const REPLIES_MAX: usize = 1024;

/// One PUBLISH that reached the probe.
#[derive(Debug, Clone)]
pub struct Received {
    pub topic: String,
    pub payload: Bytes,
    /// CLOCK_REALTIME ns when it was decoded.
    pub at_ns: u64,
}

/// A connected probe.
pub struct Probe {
    write: OwnedWriteHalf,
    wbuf: BytesMut,
    replies: mpsc::Receiver<Received>,
    dropped: Arc<AtomicU64>,
    reader: tokio::task::JoinHandle<anyhow::Error>,
}

impl Probe {
    /// Connect as `client_id` and subscribe to `filter` (QoS 0).
    pub async fn connect(addr: SocketAddr, client_id: &str, filter: &str) -> anyhow::Result<Probe> {
        let mut io = timeout(
            Duration::from_secs(10),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        .map_err(|_| anyhow!("TCP connect to {addr} timed out"))?
        .with_context(|| format!("TCP connect to {addr}"))?;
        io.set_nodelay(true)?;
        let mut decoder = Decoder::client(ProtocolVersion::V311, conn::MAX_INBOUND_PACKET);
        let mut rbuf = BytesMut::with_capacity(16 * 1024);
        let mut wbuf = BytesMut::with_capacity(1024);
        let connect = Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: 0,
            client_id: client_id.into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        };
        conn::handshake(
            &mut io,
            connect,
            &mut rbuf,
            &mut wbuf,
            &mut decoder,
            Duration::from_secs(10),
        )
        .await
        .context("the probe connecting to sluice")?;
        let subscribe = Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter {
                filter: filter.into(),
                options: SubscriptionOptions {
                    qos: QoS::AtMostOnce,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                },
            }],
            properties: Properties::default(),
        });
        conn::send(&mut io, &subscribe, ProtocolVersion::V311, &mut wbuf).await?;
        match timeout(
            Duration::from_secs(10),
            conn::read_packet(&mut io, &mut rbuf, &mut decoder),
        )
        .await
        .map_err(|_| anyhow!("no SUBACK within 10 s"))??
        {
            Packet::SubAck(ack) if ack.codes.first().is_some_and(|&c| c < 0x80) => {}
            other => bail!(
                "sluice refused the probe's subscription to {filter}: {}",
                other.name()
            ),
        }
        let (tx, replies) = mpsc::channel(REPLIES_MAX);
        let dropped = Arc::new(AtomicU64::new(0));
        let (mut read, write) = io.into_split();
        let counted = dropped.clone();
        let reader = tokio::spawn(async move {
            loop {
                match conn::read_packet(&mut read, &mut rbuf, &mut decoder).await {
                    Ok(Packet::Publish(p)) => {
                        let r = Received {
                            topic: p.topic.to_string(),
                            payload: p.payload,
                            at_ns: unix_now_ns(),
                        };
                        if tx.try_send(r).is_err() {
                            counted.fetch_add(1, Relaxed);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => return e,
                }
            }
        });
        Ok(Probe {
            write,
            wbuf,
            replies,
            dropped,
            reader,
        })
    }

    /// Publish `payload` on `topic` (QoS 0); returns CLOCK_REALTIME ns just before the write.
    pub async fn publish(&mut self, topic: &str, payload: Bytes) -> anyhow::Result<u64> {
        let packet = Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: topic.into(),
            packet_id: None,
            properties: None,
            payload,
        });
        let at = unix_now_ns();
        conn::send(
            &mut self.write,
            &packet,
            ProtocolVersion::V311,
            &mut self.wbuf,
        )
        .await?;
        Ok(at)
    }

    /// The next reply, waiting at most `wait`.
    pub async fn next(&mut self, wait: Duration) -> anyhow::Result<Received> {
        if self.reader.is_finished() {
            bail!("the probe's connection to sluice ended");
        }
        timeout(wait, self.replies.recv())
            .await
            .map_err(|_| anyhow!("no reply within {wait:?}"))?
            .ok_or_else(|| anyhow!("the probe's connection to sluice ended"))
    }

    /// Drop every reply already received (stale ones from a timed-out round).
    pub fn clear(&mut self) {
        while self.replies.try_recv().is_ok() {}
    }

    /// Replies dropped because the channel was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.reader.abort();
    }
}
