//! One simulated device: its session (connect, CONNACK, reconnect with back-off) and its publish
//! loop (paced sends within the inflight window, PUBACK matching, keep-alive pings).

use super::*;

/// Per-device state that survives reconnects.
pub(super) struct DeviceState {
    pub(super) index: u32,
    pub(super) client_id: String,
    /// PUBLISH with topic set; cloned per message (reference counts only).
    pub(super) template: Publish,
    pub(super) seq: u64,
    pub(super) next_send: Option<Instant>,
    pub(super) rng: SmallRng,
    pub(super) next_packet_id: u16,
    /// (packet id, when written) of QoS 1 PUBLISHes awaiting PUBACK.
    pub(super) inflight: Vec<(u16, Instant)>,
    pub(super) rbuf: BytesMut,
    pub(super) wbuf: BytesMut,
    /// This device's own counters, for runs that report devices separately.
    pub(super) own: Option<OwnCounters>,
}

/// One device's counters (plain integers: only its own task touches them).
pub(super) struct OwnCounters {
    pub(super) sent: u64,
    pub(super) acknowledged: u64,
    pub(super) rejected: u64,
    pub(super) unacknowledged: u64,
    pub(super) skipped_inflight_full: u64,
    pub(super) ack_latency_steady: hdrhistogram::Histogram<u64>,
}

/// How one connection ended.
pub(super) enum SessionEnd {
    /// Publishing time is over and the device closed cleanly.
    Finished,
    /// The connection failed; `connected` tells whether CONNACK had been received.
    Failed {
        connected: bool,
        error: anyhow::Error,
    },
}

/// One device, from its first connection to its last; its own tally when the run reports
/// devices separately.
pub(super) async fn device(
    index: u32,
    start_at: Instant,
    shared: Arc<Shared>,
) -> Option<DeviceTally> {
    sleep_until(start_at).await;
    let config = &shared.config;
    let mut st = DeviceState {
        index,
        client_id: config.client_id(index),
        template: Publish {
            dup: false,
            qos: config.qos,
            retain: false,
            topic: format!("{}/{index}", config.topic_prefix).as_str().into(),
            packet_id: None,
            properties: None,
            payload: Bytes::new(),
        },
        seq: 0,
        next_send: None,
        rng: SmallRng::seed_from_u64(config.seed ^ (u64::from(index) << 17 | 0x9e37)),
        next_packet_id: 1,
        inflight: Vec::with_capacity(usize::from(config.max_inflight.min(256))),
        rbuf: BytesMut::with_capacity(256),
        wbuf: BytesMut::with_capacity(config.payload.max + 128),
        own: (config.devices <= PER_DEVICE_REPORT_MAX).then(|| OwnCounters {
            sent: 0,
            acknowledged: 0,
            rejected: 0,
            unacknowledged: 0,
            skipped_inflight_full: 0,
            ack_latency_steady: crate::stats::latency_histogram(),
        }),
    };
    let mut backoff = BACKOFF_MIN;
    while Instant::now() < shared.stop_at {
        let end = session(&mut st, &shared).await;
        let lost = st.inflight.len() as u64;
        st.inflight.clear();
        shared.counters.unacknowledged.fetch_add(lost, Relaxed);
        if let Some(own) = &mut st.own {
            own.unacknowledged += lost;
        }
        match end {
            SessionEnd::Finished => break,
            SessionEnd::Failed { connected, error } => {
                let counter = if connected {
                    backoff = BACKOFF_MIN;
                    &shared.counters.reconnects
                } else {
                    &shared.counters.connect_failures
                };
                counter.fetch_add(1, Relaxed);
                tracing::debug!(device = index, connected, error = %format!("{error:#}"), "device connection failed");
            }
        }
        let pause = backoff.mul_f64(st.rng.gen_range(0.5..1.5));
        backoff = (backoff * 2).min(BACKOFF_MAX);
        sleep_until((Instant::now() + pause).min(shared.stop_at)).await;
        // Ticks that fell into the outage are not made up for.
        st.next_send = None;
    }
    let high = index < config.high_devices();
    st.own.map(|own| DeviceTally {
        device: index,
        client_id: st.client_id,
        high,
        sent: own.sent,
        acknowledged: own.acknowledged,
        rejected: own.rejected,
        unacknowledged: own.unacknowledged,
        skipped_inflight_full: own.skipped_inflight_full,
        ack_latency_steady: LatencySummary::from_histogram(&own.ack_latency_steady),
    })
}

pub(super) async fn session(st: &mut DeviceState, shared: &Shared) -> SessionEnd {
    let config = &shared.config;
    let mut decoder = Decoder::client(config.protocol, crate::conn::MAX_INBOUND_PACKET);
    let target = match config.targets.len() {
        0 => config.target,
        n => config.targets[st.index as usize % n],
    };
    let tcp = match timeout(config.connect_timeout, TcpStream::connect(target)).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return failed(false, anyhow!(e).context("TCP connect")),
        Err(_) => return failed(false, anyhow!("TCP connect timed out")),
    };
    let _ = tcp.set_nodelay(true);
    match &config.tls {
        None => session_on(st, shared, tcp, &mut decoder).await,
        Some(tls) => {
            let name = match rustls::pki_types::ServerName::try_from(tls.server_name.clone()) {
                Ok(name) => name,
                Err(e) => return failed(false, anyhow!(e).context("the TLS server name")),
            };
            let connector = tokio_rustls::TlsConnector::from(tls.config.clone());
            match timeout(config.connect_timeout, connector.connect(name, tcp)).await {
                Ok(Ok(stream)) => session_on(st, shared, stream, &mut decoder).await,
                Ok(Err(e)) => failed(false, anyhow!(e).context("TLS handshake")),
                Err(_) => failed(false, anyhow!("TLS handshake timed out")),
            }
        }
    }
}

/// A connection's streams, plain or TLS: split into halves the publish loop drives at once.
pub(super) trait DeviceStream:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send
{
    fn halves(
        &mut self,
    ) -> (
        Box<dyn tokio::io::AsyncRead + Unpin + Send + '_>,
        Box<dyn tokio::io::AsyncWrite + Unpin + Send + '_>,
    );
}

impl DeviceStream for TcpStream {
    fn halves(
        &mut self,
    ) -> (
        Box<dyn tokio::io::AsyncRead + Unpin + Send + '_>,
        Box<dyn tokio::io::AsyncWrite + Unpin + Send + '_>,
    ) {
        let (rd, wr) = self.split();
        (Box::new(rd), Box::new(wr))
    }
}

impl DeviceStream for tokio_rustls::client::TlsStream<TcpStream> {
    fn halves(
        &mut self,
    ) -> (
        Box<dyn tokio::io::AsyncRead + Unpin + Send + '_>,
        Box<dyn tokio::io::AsyncWrite + Unpin + Send + '_>,
    ) {
        let (rd, wr) = tokio::io::split(self);
        (Box::new(rd), Box::new(wr))
    }
}

/// CONNECT/CONNACK and the publish loop on an open connection.
async fn session_on<S: DeviceStream>(
    st: &mut DeviceState,
    shared: &Shared,
    mut tcp: S,
    decoder: &mut Decoder,
) -> SessionEnd {
    let config = &shared.config;
    st.rbuf.clear();
    let connect = Connect {
        protocol: config.protocol,
        clean_start: true,
        keep_alive: KEEP_ALIVE_S,
        client_id: st.client_id.as_str().into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    };
    let connack = match handshake(
        &mut tcp,
        connect,
        &mut st.rbuf,
        &mut st.wbuf,
        decoder,
        config.connect_timeout,
    )
    .await
    {
        Ok(ack) => ack,
        Err(e) => return failed(false, e),
    };
    shared.counters.connected.fetch_add(1, Relaxed);
    let result = publish_loop(st, shared, &mut tcp, decoder, &connack).await;
    shared.counters.connected.fetch_sub(1, Relaxed);
    match result {
        Ok(()) => SessionEnd::Finished,
        Err(e) => failed(true, e),
    }
}

pub(super) fn failed(connected: bool, error: anyhow::Error) -> SessionEnd {
    SessionEnd::Failed { connected, error }
}

pub(super) async fn publish_loop<S: DeviceStream>(
    st: &mut DeviceState,
    shared: &Shared,
    tcp: &mut S,
    decoder: &mut Decoder,
    connack: &sluice_proto::mqtt::ConnAck,
) -> anyhow::Result<()> {
    let config = &shared.config;
    let window = match connack.properties.receive_maximum {
        Some(rm) if config.protocol == ProtocolVersion::V5 => config.max_inflight.min(rm.max(1)),
        _ => config.max_inflight,
    };
    let ping_after = match connack.properties.server_keep_alive {
        Some(ka) if ka > 0 => PING_AFTER.min(Duration::from_secs(u64::from(ka)) / 2),
        _ => PING_AFTER,
    };
    let now = Instant::now();
    if st.next_send.is_none() {
        st.next_send = first_send(st, config, now);
    }
    let mut last_write = now;
    let (mut rd, mut wr) = tcp.halves();
    let sleep = sleep_until(wake_at(
        st.next_send,
        last_write + ping_after,
        shared.stop_at,
    ));
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            biased;
            read = rd.read_buf(&mut st.rbuf) => {
                if read.context("reading from the broker")? == 0 {
                    bail!("the broker closed the connection");
                }
                drain_packets(st, shared, decoder)?;
            }
            () = &mut sleep => {
                let now = Instant::now();
                if now >= shared.stop_at {
                    break;
                }
                if let Some(due) = st.next_send.filter(|&due| now >= due) {
                    let lag = u64::try_from((now - due).as_micros()).unwrap_or(u64::MAX);
                    shared.counters.max_send_lag_us.fetch_max(lag, Relaxed);
                    if config.qos == QoS::AtLeastOnce && st.inflight.len() >= usize::from(window) {
                        shared.counters.skipped_inflight_full.fetch_add(1, Relaxed);
                        if let Some(own) = &mut st.own {
                            own.skipped_inflight_full += 1;
                        }
                    } else {
                        if let Some(id) = build_publish(st, shared)? {
                            st.inflight.push((id, Instant::now()));
                        }
                        wr.write_all(&st.wbuf).await.context("writing PUBLISH")?;
                        shared.counters.sent.fetch_add(1, Relaxed);
                        if let Some(own) = &mut st.own {
                            own.sent += 1;
                        }
                        last_write = Instant::now();
                    }
                    st.next_send = next_after(st, config, due);
                } else if now >= last_write + ping_after {
                    st.wbuf.clear();
                    encode(&Packet::PingReq, config.protocol, &mut st.wbuf).context("encoding PINGREQ")?;
                    wr.write_all(&st.wbuf).await.context("writing PINGREQ")?;
                    last_write = now;
                }
                sleep.as_mut().reset(wake_at(st.next_send, last_write + ping_after, shared.stop_at));
            }
        }
    }
    // Publishing is over: collect outstanding PUBACKs, then say goodbye.
    let drain_until = shared.stop_at + config.drain_timeout;
    while !st.inflight.is_empty() {
        match timeout_at(drain_until, rd.read_buf(&mut st.rbuf)).await {
            Err(_) => break,
            Ok(read) => {
                if read.context("reading from the broker")? == 0 {
                    bail!("the broker closed the connection during the ack drain");
                }
                drain_packets(st, shared, decoder)?;
            }
        }
    }
    st.wbuf.clear();
    let disconnect = Packet::Disconnect(Disconnect {
        reason: 0,
        properties: Properties::default(),
    });
    encode(&disconnect, config.protocol, &mut st.wbuf).context("encoding DISCONNECT")?;
    // Best effort: the run is over whatever the broker does with it.
    let _ = timeout(Duration::from_secs(1), async {
        let _ = wr.write_all(&st.wbuf).await;
        let _ = wr.shutdown().await;
    })
    .await;
    Ok(())
}

impl DeviceState {
    /// The next packet id (1..=65535, wrapping) not awaiting a PUBACK. Terminates because at
    /// most 65,535 ids exist and the window is at most 65,535 (and in practice ≤ 64).
    pub(super) fn allocate_packet_id(&mut self) -> u16 {
        loop {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.inflight.iter().any(|&(p, _)| p == id) {
                return id;
            }
        }
    }
}

/// Encode the next PUBLISH of this device into its write buffer; returns its packet id (QoS 1).
pub(super) fn build_publish(st: &mut DeviceState, shared: &Shared) -> anyhow::Result<Option<u16>> {
    let config = &shared.config;
    let size = if config.payload.min == config.payload.max {
        config.payload.min
    } else {
        st.rng.gen_range(config.payload.min..=config.payload.max)
    };
    let packet_id = (config.qos == QoS::AtLeastOnce).then(|| st.allocate_packet_id());
    let packet = Packet::Publish(Publish {
        packet_id,
        payload: shared.filler.slice(..size),
        ..st.template.clone()
    });
    st.wbuf.clear();
    encode(&packet, config.protocol, &mut st.wbuf).context("encoding PUBLISH")?;
    // The payload is the last `size` bytes of a PUBLISH: patch the header in place.
    let end = st.wbuf.len();
    let header = PayloadHeader {
        device: st.index,
        seq: st.seq,
        sent_at_ns: unix_now_ns(),
    };
    header
        .write_to(&mut st.wbuf[end - size..])
        .context("writing the bench header")?;
    st.seq += 1;
    Ok(packet_id)
}

/// Handle every complete packet in the read buffer.
pub(super) fn drain_packets(
    st: &mut DeviceState,
    shared: &Shared,
    decoder: &mut Decoder,
) -> anyhow::Result<()> {
    while let Some(packet) = decoder
        .decode(&mut st.rbuf)
        .context("the broker sent a malformed packet")?
    {
        match packet {
            Packet::PubAck(ack) => {
                let Some(pos) = st.inflight.iter().position(|&(id, _)| id == ack.packet_id) else {
                    continue; // An ack for nothing we await (e.g. a duplicate): ignore.
                };
                let (_, sent_at) = st.inflight.swap_remove(pos);
                let micros = u64::try_from(sent_at.elapsed().as_micros()).unwrap_or(u64::MAX);
                shared.ack_latency.record_us(st.index as usize, micros);
                let steady = sent_at >= shared.steady_from;
                if steady {
                    shared
                        .ack_latency_steady
                        .record_us(st.index as usize, micros);
                }
                let rejected = ack.reason >= reason::UNSPECIFIED_ERROR;
                if rejected {
                    shared.counters.rejected.fetch_add(1, Relaxed);
                } else {
                    shared.counters.acknowledged.fetch_add(1, Relaxed);
                }
                if let Some(own) = &mut st.own {
                    if steady {
                        crate::stats::record_us(&mut own.ack_latency_steady, micros);
                    }
                    if rejected {
                        own.rejected += 1;
                    } else {
                        own.acknowledged += 1;
                    }
                }
            }
            Packet::PingResp => {}
            Packet::Disconnect(d) => {
                bail!("the broker sent DISCONNECT (reason 0x{:02x})", d.reason)
            }
            other => tracing::trace!(packet = other.name(), "ignoring an unexpected packet"),
        }
    }
    // Keep the buffer from shrinking to nothing after `split_to` in the decoder.
    if st.rbuf.capacity() - st.rbuf.len() < 64 {
        st.rbuf.reserve(256);
    }
    Ok(())
}

pub(super) fn first_send(
    st: &mut DeviceState,
    config: &DevicesConfig,
    now: Instant,
) -> Option<Instant> {
    if config.rate_per_device <= 0.0 {
        return None;
    }
    let mean = 1.0 / config.rate_per_device;
    let gap = match config.arrivals {
        Arrivals::Periodic => mean * st.rng.gen::<f64>(),
        Arrivals::Poisson => exponential(&mut st.rng, mean),
    };
    Some(now + Duration::from_secs_f64(gap))
}

pub(super) fn next_after(
    st: &mut DeviceState,
    config: &DevicesConfig,
    due: Instant,
) -> Option<Instant> {
    let mean = 1.0 / config.rate_per_device;
    let gap = match config.arrivals {
        Arrivals::Periodic => mean,
        Arrivals::Poisson => exponential(&mut st.rng, mean),
    };
    Some(due + Duration::from_secs_f64(gap))
}

/// An exponentially distributed value with the given mean (inverse transform sampling).
pub(super) fn exponential(rng: &mut SmallRng, mean: f64) -> f64 {
    let u: f64 = rng.gen(); // [0, 1)
    -(1.0 - u).ln() * mean
}

pub(super) fn wake_at(next_send: Option<Instant>, ping_at: Instant, stop_at: Instant) -> Instant {
    let wake = ping_at.min(stop_at);
    next_send.map_or(wake, |s| s.min(wake))
}
