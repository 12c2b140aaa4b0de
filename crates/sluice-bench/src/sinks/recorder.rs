//! The recording subscriber: subscribes on the cloud broker and records every bench message
//! that arrives (device, sequence number, send and receive time; SenML packs unpacked), with
//! live counters for progress. What it records is analysed by the scenario.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::BytesMut;
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Packet, Properties, ProtocolVersion, PubResponse, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions,
};
use sluice_proto::senml;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

use crate::conn;
use crate::payload::{unix_now_ns, PayloadHeader};

/// One PUBLISH-carried bench message as the recorder saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    pub device: u32,
    pub seq: u64,
    pub sent_at_ns: u64,
    pub received_ns: u64,
    pub payload_bytes: u32,
}

pub(crate) struct RecorderLive {
    pub(crate) unique: AtomicU64,
    pub(crate) last_ms: AtomicU64,
}

/// A subscriber on the cloud broker that keeps every arrival.
pub(crate) struct Recorder {
    pub(crate) live: Arc<RecorderLive>,
    pub(crate) started: Instant,
    pub(crate) stop: watch::Sender<bool>,
    pub(crate) task: tokio::task::JoinHandle<(Vec<Arrival>, Option<String>)>,
}

impl Recorder {
    pub(crate) async fn start(broker: SocketAddr, ca: &Path) -> anyhow::Result<Recorder> {
        let tls = conn::tls_client_config(ca, None)?;
        let mut io = conn::open(broker, Some((&tls, "127.0.0.1")), Duration::from_secs(10)).await?;
        let mut decoder = Decoder::client(ProtocolVersion::V311, conn::MAX_INBOUND_PACKET);
        let mut rbuf = BytesMut::with_capacity(64 * 1024);
        let mut wbuf = BytesMut::with_capacity(256);
        let connect = Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: KEEP_ALIVE_S,
            client_id: format!("outage-recorder-{}", std::process::id()).into(),
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
        .context("the recorder connecting to the cloud")?;
        let subscribe = Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter {
                filter: "#".into(),
                options: SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
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
            other => bail!("the recorder's subscription failed: {}", other.name()),
        }
        let live = Arc::new(RecorderLive {
            unique: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        });
        let started = Instant::now();
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(record(io, decoder, rbuf, live.clone(), started, stop_rx));
        Ok(Recorder {
            live,
            started,
            stop,
            task,
        })
    }

    pub(crate) fn unique(&self) -> u64 {
        self.live.unique.load(Relaxed)
    }

    pub(crate) fn idle_for(&self) -> Duration {
        let last = self.live.last_ms.load(Relaxed);
        self.started
            .elapsed()
            .saturating_sub(Duration::from_millis(last.saturating_sub(1)))
    }

    pub(crate) async fn stop(self) -> (Vec<Arrival>, Option<String>) {
        let _ = self.stop.send(true);
        match self.task.await {
            Ok(result) => result,
            Err(e) => (Vec::new(), Some(format!("the recorder task failed: {e}"))),
        }
    }
}

pub(crate) async fn record(
    mut io: Box<dyn conn::BrokerIo>,
    mut decoder: Decoder,
    mut rbuf: BytesMut,
    live: Arc<RecorderLive>,
    started: Instant,
    mut stop: watch::Receiver<bool>,
) -> (Vec<Arrival>, Option<String>) {
    let mut arrivals = Vec::new();
    let mut seen: HashSet<(u32, u64)> = HashSet::new();
    let mut wbuf = BytesMut::with_capacity(4096);
    let half = Duration::from_secs(u64::from(KEEP_ALIVE_S / 2));
    let mut ping = tokio::time::interval_at(Instant::now() + half, half);
    let error = loop {
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        tokio::select! {
            biased;
            _ = stop.changed() => break None,
            read = io.read_buf(&mut rbuf) => {
                match read {
                    Ok(0) => break Some("the cloud broker closed the recorder's connection".to_string()),
                    Err(e) => break Some(format!("reading from the cloud broker: {e}")),
                    Ok(_) => {}
                }
                let now = unix_now_ns();
                wbuf.clear();
                let mut failed = None;
                loop {
                    let packet = match decoder.decode(&mut rbuf) {
                        Ok(Some(p)) => p,
                        Ok(None) => break,
                        Err(e) => {
                            failed = Some(format!("the cloud broker sent a malformed packet: {e}"));
                            break;
                        }
                    };
                    let Packet::Publish(publish) = packet else { continue };
                    if let (Some(packet_id), QoS::AtLeastOnce) = (publish.packet_id, publish.qos) {
                        let ack = Packet::PubAck(PubResponse { packet_id, reason: 0, properties: None });
                        let _ = encode(&ack, ProtocolVersion::V311, &mut wbuf);
                    }
                    for a in bench_messages(&publish.payload, now) {
                        seen.insert((a.device, a.seq));
                        arrivals.push(a);
                    }
                }
                live.unique.store(seen.len() as u64, Relaxed);
                let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
                live.last_ms.store(ms + 1, Relaxed);
                if let Some(f) = failed {
                    break Some(f);
                }
                if !wbuf.is_empty() {
                    if let Err(e) = io.write_all(&wbuf).await {
                        break Some(format!("writing PUBACKs to the cloud broker: {e}"));
                    }
                }
            }
            _ = ping.tick() => {
                wbuf.clear();
                let _ = encode(&Packet::PingReq, ProtocolVersion::V311, &mut wbuf);
                if let Err(e) = io.write_all(&wbuf).await {
                    break Some(format!("writing PINGREQ to the cloud broker: {e}"));
                }
            }
        }
    };
    (arrivals, error)
}

/// The bench messages in one PUBLISH payload: the payload itself, or the `vd` records of a
/// SenML pack.
pub(crate) fn bench_messages(payload: &[u8], now: u64) -> Vec<Arrival> {
    let arrival = |h: PayloadHeader, len: usize| Arrival {
        device: h.device,
        seq: h.seq,
        sent_at_ns: h.sent_at_ns,
        received_ns: now,
        payload_bytes: u32::try_from(len).unwrap_or(u32::MAX),
    };
    if let Ok(h) = PayloadHeader::parse(payload) {
        return vec![arrival(h, payload.len())];
    }
    let Some(records) = senml::sniff(payload).and_then(|f| senml::decode(f, payload).ok()) else {
        return Vec::new();
    };
    records
        .into_iter()
        .filter_map(|r| match &r.value {
            Some(senml::Value::Data(d)) => {
                PayloadHeader::parse(d).ok().map(|h| arrival(h, d.len()))
            }
            _ => None,
        })
        .collect()
}

/// The recorder's keep-alive, seconds; it pings every half of it.
pub(crate) const KEEP_ALIVE_S: u16 = 60;
