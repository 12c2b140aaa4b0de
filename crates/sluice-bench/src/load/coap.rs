//! CoAP sensors: N concurrent clients in a closed loop, modelled on Californium's CoAPBench.
//!
//! Owns: the sensors' UDP sockets (one per sensor, as CoAPBench gives each virtual client its
//! own endpoint: message ids then never repeat within EXCHANGE_LIFETIME at the rates a sensor
//! reaches), their CON exchanges (RFC 7252 §4.2 retransmission, empty-ACK-then-separate-response
//! §5.2.2, ACKing a CON response), and the figures: requests, responses by code, timeouts,
//! request→response latency. Does not own: what answers (sluice, libcoap, the in-process
//! [`responder`], or behind a proxy the CoAP-over-TCP [`tcp_upstream`]) or the CPU accounting of the process under test (the scenario does that).
//!
//! Behaviour:
//! - Each sensor sends one CON request, waits for its response, records the latency from the
//!   first transmission to the response, and sends the next at once (closed loop), or with an
//!   `interval` no earlier than that long after the previous one started (a sensor's rate cap).
//!   Sensors start spread evenly over `ramp`. In the pure closed loop, Little's law ties the
//!   figures: mean latency = sensors ÷ rate.
//! - No ACK after `ack_timeout` × (1..1.5): the same datagram again, the timeout doubled, up to
//!   `max_retransmit` times (RFC 7252 §4.2); then the request counts as a timeout and the sensor
//!   moves on. An empty ACK stops retransmission; the separate response must come within
//!   `response_timeout`, else a timeout. A CON response is ACKed (also a late or repeated one).
//! - After `duration` no new request starts; outstanding ones may finish for up to `drain`;
//!   what is still open then counts as `unfinished`.
//! - Requests are built once per sensor from a template ([`Message::encode_udp`]); per request
//!   only the message id, the 4-byte token and the payload's first bytes (a sequence number)
//!   change. Responses are decoded with [`Message::decode_udp`].
//! - `threads` threads (mio, edge-triggered epoll) share the sensors; counters are atomics
//!   readable while the load runs ([`CoapCounters`]), histograms are per thread, merged at the end.
//!
//! Bounds: one outstanding request per sensor; one 1500-byte receive buffer per thread; a
//! datagram that does not decode is counted and dropped; nothing from the peer panics.

pub mod responder;
pub mod tcp_upstream;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::{Bytes, BytesMut};
use hdrhistogram::Histogram;
use mio::{Events, Interest, Poll};
use rand::{rngs::SmallRng, Rng as _, SeedableRng as _};
use serde::Serialize;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};

use crate::harness::procfs::{round1, round3, CpuMeter, CpuUsage, Pid};
use crate::stats::{latency_histogram, record_us, LatencySummary};

/// Token length of every request (4 bytes: a per-sensor counter).
const TOKEN_LEN: usize = 4;
/// How often each thread looks for due timers (starts, retransmissions, timeouts).
const TIMER_TICK: Duration = Duration::from_millis(2);

/// What every sensor asks.
#[derive(Debug, Clone)]
pub struct RequestShape {
    pub method: Code,
    /// Uri-Path segments common to all sensors.
    pub path: Vec<String>,
    /// Append `{sensor_prefix}{i}` as a last Uri-Path segment (a topic per sensor).
    pub sensor_segment: Option<String>,
    /// Uri-Query `c={client_prefix}{i}` (the device id sluice shards by).
    pub client_prefix: Option<String>,
    /// Proxy-Uri (forward proxying, RFC 7252 §5.7.2); the path then usually stays empty.
    pub proxy_uri: Option<String>,
}

impl RequestShape {
    /// sluice's pub/sub publish: `POST /{pubsub}/{topic}/{sensor-i}?c=sensor-{i}`.
    pub fn publish(pubsub: &str, topic: &str) -> RequestShape {
        let mut path = vec![pubsub.to_string()];
        path.extend(topic.split('/').map(str::to_string));
        RequestShape {
            method: Code::POST,
            path,
            sensor_segment: Some("sensor-".to_string()),
            client_prefix: Some("sensor-".to_string()),
            proxy_uri: None,
        }
    }

    /// A fixed request for every sensor: `method /path...` (e.g. a reverse proxy's prefix).
    pub fn fixed(method: Code, path: &str) -> RequestShape {
        RequestShape {
            method,
            path: path
                .split('/')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            sensor_segment: None,
            client_prefix: None,
            proxy_uri: None,
        }
    }

    /// The same request through a forward proxy: Proxy-Uri `uri`, no Uri-Path.
    pub fn forward(method: Code, uri: &str) -> RequestShape {
        RequestShape {
            method,
            path: Vec::new(),
            sensor_segment: None,
            client_prefix: None,
            proxy_uri: Some(uri.to_string()),
        }
    }

    /// The request of sensor `i` as a URI-ish string, for reports.
    pub fn describe(&self, i: u32) -> String {
        let mut s = format!("{} /", self.method);
        s.push_str(&self.path.join("/"));
        if let Some(p) = &self.sensor_segment {
            s.push_str(&format!("/{p}{i}"));
        }
        if let Some(c) = &self.client_prefix {
            s.push_str(&format!("?c={c}{i}"));
        }
        if let Some(u) = &self.proxy_uri {
            s.push_str(&format!(" Proxy-Uri: {u}"));
        }
        s
    }

    /// The datagram template of sensor `i` (message id and token zero).
    fn template(&self, i: u32, payload: usize) -> Vec<u8> {
        // Invariant: TOKEN_LEN ≤ 8.
        let token = Token::from_slice(&[0; TOKEN_LEN]).unwrap_or(Token::EMPTY);
        let mut m = Message::new(MsgType::Con, self.method, 0, token);
        if let Some(u) = &self.proxy_uri {
            m.add_option(opt::PROXY_URI, Bytes::from(u.clone()));
        }
        for seg in &self.path {
            m.add_option(opt::URI_PATH, Bytes::from(seg.clone()));
        }
        if let Some(p) = &self.sensor_segment {
            m.add_option(opt::URI_PATH, Bytes::from(format!("{p}{i}")));
        }
        if let Some(c) = &self.client_prefix {
            m.add_option(opt::URI_QUERY, Bytes::from(format!("c={c}{i}")));
        }
        m.payload = Bytes::from(vec![b'x'; payload]);
        let mut out = BytesMut::new();
        m.encode_udp(&mut out);
        out.to_vec()
    }
}

/// The load.
#[derive(Debug, Clone)]
pub struct CoapLoadConfig {
    pub target: SocketAddr,
    pub sensors: u32,
    /// Threads driving the sensors (at least 1).
    pub threads: usize,
    /// New requests start until this long after the start.
    pub duration: Duration,
    /// Sensors start spread evenly over this.
    pub ramp: Duration,
    /// Latencies of requests first sent after this (from the start) are "steady".
    pub warmup: Duration,
    /// Payload bytes per request (CoAPBench: 4, 16, 64).
    pub payload: usize,
    pub request: RequestShape,
    /// ACK_TIMEOUT (RFC 7252 default 2 s).
    pub ack_timeout: Duration,
    /// MAX_RETRANSMIT (default 4).
    pub max_retransmit: u32,
    /// After an empty ACK, how long the separate response may take.
    pub response_timeout: Duration,
    /// A sensor's next request starts no earlier than this after its previous one started
    /// (zero: at once, CoAPBench's closed loop; else each sensor sends at most 1/interval req/s).
    pub interval: Duration,
    /// After `duration`, how long outstanding requests may still finish.
    pub drain: Duration,
}

impl CoapLoadConfig {
    /// Defaults: 100 sensors, 2 threads, 10 s (1 s ramp, 2 s warm-up), 16 B POST publishes.
    pub fn new(target: SocketAddr) -> CoapLoadConfig {
        CoapLoadConfig {
            target,
            sensors: 100,
            threads: 2,
            duration: Duration::from_secs(10),
            ramp: Duration::from_secs(1),
            warmup: Duration::from_secs(2),
            payload: 16,
            request: RequestShape::publish("ps", "bench"),
            ack_timeout: Duration::from_secs(2),
            max_retransmit: 4,
            response_timeout: Duration::from_secs(10),
            interval: Duration::ZERO,
            drain: Duration::from_secs(5),
        }
    }
}

/// Counters readable while the load runs (snapshot them at a window's edges).
#[derive(Debug, Default)]
pub struct CoapCounters {
    /// Requests sent (first transmissions).
    pub requests: AtomicU64,
    pub retransmissions: AtomicU64,
    /// Responses matched to their request (any code).
    pub responses: AtomicU64,
    /// Of those, class 2 (success).
    pub success: AtomicU64,
    /// Empty ACKs (a separate response follows).
    pub empty_acks: AtomicU64,
    /// Requests given up (no ACK after every retransmission, or no separate response).
    pub timeouts: AtomicU64,
    /// Requests answered with RST.
    pub resets: AtomicU64,
}

/// A copy of [`CoapCounters`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CoapSnapshot {
    pub requests: u64,
    pub retransmissions: u64,
    pub responses: u64,
    pub success: u64,
    pub empty_acks: u64,
    pub timeouts: u64,
    pub resets: u64,
}

impl CoapCounters {
    pub fn snapshot(&self) -> CoapSnapshot {
        CoapSnapshot {
            requests: self.requests.load(Relaxed),
            retransmissions: self.retransmissions.load(Relaxed),
            responses: self.responses.load(Relaxed),
            success: self.success.load(Relaxed),
            empty_acks: self.empty_acks.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
            resets: self.resets.load(Relaxed),
        }
    }
}

/// What the load did.
#[derive(Debug, Clone, Serialize)]
pub struct CoapLoadReport {
    pub target: String,
    pub sensors: u32,
    pub threads: usize,
    pub payload: usize,
    pub interval_ms: f64,
    /// Sensor 0's request.
    pub request: String,
    pub duration_s: f64,
    pub totals: CoapSnapshot,
    /// Responses by code ("2.04": n).
    pub codes: BTreeMap<String, u64>,
    /// Responses to a request already given up, or repeated (ACKed, not counted as responses).
    pub late_responses: u64,
    /// Requests still open when the drain ended.
    pub unfinished: u64,
    /// Datagrams that did not decode.
    pub bad_datagrams: u64,
    /// Sends the kernel refused (counted as lost transmissions; the timer retransmits).
    pub send_errors: u64,
    /// Success responses ÷ `duration_s`.
    pub success_rate: f64,
    /// Requests first sent after the warm-up.
    pub latency: LatencySummary,
    /// Every request.
    pub latency_all: LatencySummary,
    /// This process's CPU over the run (the generator and whatever else runs in it).
    pub tool_cpu: CpuUsage,
}

/// A running load.
pub struct CoapLoad {
    counters: Arc<CoapCounters>,
    started: Instant,
    threads: Vec<JoinHandle<io::Result<ThreadStats>>>,
    config: CoapLoadConfig,
    cpu: CpuMeter,
}

/// Start the sensors (their sockets are bound and connected before this returns).
pub fn spawn_coap_load(config: CoapLoadConfig) -> anyhow::Result<CoapLoad> {
    anyhow::ensure!(config.sensors > 0, "at least one sensor");
    let threads = config.threads.clamp(1, config.sensors as usize);
    let counters = Arc::new(CoapCounters::default());
    let cpu = CpuMeter::start(Pid::OwnProcess)?;
    let started = Instant::now() + Duration::from_millis(20);
    let mut handles = Vec::new();
    for t in 0..threads {
        let ids: Vec<u32> = (0..config.sensors)
            .filter(|i| *i as usize % threads == t)
            .collect();
        let mut worker = Worker::new(&config, &ids, started, counters.clone())
            .with_context(|| format!("binding the sockets of {} sensors", ids.len()))?;
        let handle = std::thread::Builder::new()
            .name(format!("coap-load-{t}"))
            .spawn(move || worker.run())
            .context("spawning a load thread")?;
        handles.push(handle);
    }
    Ok(CoapLoad {
        counters,
        started,
        threads: handles,
        config,
        cpu,
    })
}

impl CoapLoad {
    pub fn counters(&self) -> &Arc<CoapCounters> {
        &self.counters
    }

    /// When sensor 0 sends its first request.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Wait until the load and its drain are over (blocking; use `spawn_blocking` from async).
    pub fn wait(self) -> anyhow::Result<CoapLoadReport> {
        let mut total = ThreadStats::new();
        for h in self.threads {
            let stats = h
                .join()
                .map_err(|_| anyhow::anyhow!("a load thread panicked"))?
                .context("a load thread failed")?;
            total.merge(stats);
        }
        let tool_cpu = self.cpu.usage()?;
        let totals = self.counters.snapshot();
        let c = &self.config;
        let duration_s = c.duration.as_secs_f64();
        Ok(CoapLoadReport {
            target: c.target.to_string(),
            sensors: c.sensors,
            threads: c.threads,
            payload: c.payload,
            interval_ms: c.interval.as_secs_f64() * 1e3,
            request: c.request.describe(0),
            duration_s,
            totals,
            codes: total
                .codes
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(code, n)| (Code(code as u8).to_string(), *n))
                .collect(),
            late_responses: total.late,
            unfinished: total.unfinished,
            bad_datagrams: total.bad,
            send_errors: total.send_errors,
            success_rate: round1(totals.success as f64 / duration_s.max(1e-9)),
            latency: LatencySummary::from_histogram(&total.steady),
            latency_all: LatencySummary::from_histogram(&total.all),
            tool_cpu,
        })
    }

    /// [`CoapLoad::wait`] on a blocking thread.
    pub async fn finish(self) -> anyhow::Result<CoapLoadReport> {
        tokio::task::spawn_blocking(move || self.wait())
            .await
            .context("the load's waiter panicked")?
    }
}

/// Per-thread figures, merged at the end.
struct ThreadStats {
    steady: Histogram<u64>,
    all: Histogram<u64>,
    codes: [u64; 256],
    late: u64,
    unfinished: u64,
    bad: u64,
    send_errors: u64,
}

impl ThreadStats {
    fn new() -> ThreadStats {
        ThreadStats {
            steady: latency_histogram(),
            all: latency_histogram(),
            codes: [0; 256],
            late: 0,
            unfinished: 0,
            bad: 0,
            send_errors: 0,
        }
    }

    fn merge(&mut self, o: ThreadStats) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.steady.add(&o.steady);
        let _ = self.all.add(&o.all);
        for (a, b) in self.codes.iter_mut().zip(o.codes.iter()) {
            *a += b;
        }
        self.late += o.late;
        self.unfinished += o.unfinished;
        self.bad += o.bad;
        self.send_errors += o.send_errors;
    }
}

/// Where a sensor's current exchange is.
#[derive(Debug, Clone, Copy)]
enum State {
    /// First request not sent yet.
    Waiting { start_at: Instant },
    /// CON sent, no ACK yet: retransmit at `deadline`.
    AwaitAck {
        first_sent: Instant,
        deadline: Instant,
        timeout: Duration,
        retries: u32,
    },
    /// Empty ACK received; the separate response is due by `deadline`.
    AwaitResponse {
        first_sent: Instant,
        deadline: Instant,
    },
    /// The load is over for this sensor.
    Done,
}

struct Sensor {
    socket: mio::net::UdpSocket,
    datagram: Vec<u8>,
    mid: u16,
    token: u32,
    seq: u64,
    payload_at: usize,
    state: State,
}

impl Sensor {
    fn token_bytes(&self) -> [u8; TOKEN_LEN] {
        self.token.to_be_bytes()
    }
}

struct Worker {
    poll: Poll,
    sensors: Vec<Sensor>,
    started: Instant,
    stop_at: Instant,
    drain_until: Instant,
    warm_at: Instant,
    ack_timeout: Duration,
    max_retransmit: u32,
    response_timeout: Duration,
    interval: Duration,
    payload: usize,
    counters: Arc<CoapCounters>,
    stats: ThreadStats,
    rng: SmallRng,
    stopping: bool,
}

impl Worker {
    fn new(
        c: &CoapLoadConfig,
        ids: &[u32],
        started: Instant,
        counters: Arc<CoapCounters>,
    ) -> io::Result<Worker> {
        let poll = Poll::new()?;
        let mut rng = SmallRng::from_entropy();
        let bind: SocketAddr = if c.target.is_ipv4() {
            "127.0.0.1:0".parse().map_err(io::Error::other)?
        } else {
            "[::1]:0".parse().map_err(io::Error::other)?
        };
        let bind = if c.target.ip().is_loopback() {
            bind
        } else {
            SocketAddr::new(
                if c.target.is_ipv4() {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                },
                0,
            )
        };
        let n = c.sensors.max(1);
        let mut sensors = Vec::with_capacity(ids.len());
        for (k, &i) in ids.iter().enumerate() {
            let mut socket = mio::net::UdpSocket::bind(bind)?;
            socket.connect(c.target)?;
            poll.registry()
                .register(&mut socket, mio::Token(k), Interest::READABLE)?;
            let datagram = c.request.template(i, c.payload);
            let payload_at = datagram.len() - c.payload;
            let offset = c.ramp.mul_f64(f64::from(i) / f64::from(n));
            sensors.push(Sensor {
                socket,
                datagram,
                mid: rng.gen(),
                token: rng.gen(),
                seq: 0,
                payload_at,
                state: State::Waiting {
                    start_at: started + offset,
                },
            });
        }
        Ok(Worker {
            poll,
            sensors,
            started,
            stop_at: started + c.duration,
            drain_until: started + c.duration + c.drain,
            warm_at: started + c.warmup,
            ack_timeout: c.ack_timeout,
            max_retransmit: c.max_retransmit,
            response_timeout: c.response_timeout,
            interval: c.interval,
            payload: c.payload,
            counters,
            stats: ThreadStats::new(),
            rng,
            stopping: false,
        })
    }

    fn run(&mut self) -> io::Result<ThreadStats> {
        let mut events = Events::with_capacity(1024);
        let mut buf = vec![0u8; 1500];
        let mut next_tick = self.started;
        loop {
            let now = Instant::now();
            if now >= next_tick {
                if !self.stopping && now >= self.stop_at {
                    self.stopping = true;
                }
                let open = self.tick(now);
                if self.stopping && (open == 0 || now >= self.drain_until) {
                    self.stats.unfinished = open as u64;
                    break;
                }
                next_tick = now + TIMER_TICK;
            }
            let wait = next_tick.saturating_duration_since(Instant::now());
            self.poll.poll(&mut events, Some(wait))?;
            for ev in events.iter() {
                let k = ev.token().0;
                self.drain_socket(k, &mut buf);
            }
        }
        Ok(std::mem::replace(&mut self.stats, ThreadStats::new()))
    }

    /// Fire due timers; how many exchanges are still open.
    fn tick(&mut self, now: Instant) -> usize {
        let mut open = 0;
        for k in 0..self.sensors.len() {
            match self.sensors[k].state {
                State::Waiting { start_at } if now >= start_at => {
                    if self.stopping {
                        self.sensors[k].state = State::Done;
                    } else {
                        self.send_next(k, now);
                        open += 1;
                    }
                }
                State::AwaitAck {
                    first_sent,
                    deadline,
                    timeout,
                    retries,
                } => {
                    open += 1;
                    if now < deadline {
                        continue;
                    }
                    if retries < self.max_retransmit {
                        let timeout = timeout * 2;
                        self.sensors[k].state = State::AwaitAck {
                            first_sent,
                            deadline: now + timeout,
                            timeout,
                            retries: retries + 1,
                        };
                        self.counters.retransmissions.fetch_add(1, Relaxed);
                        self.transmit(k);
                    } else {
                        self.counters.timeouts.fetch_add(1, Relaxed);
                        open -= usize::from(self.finish(k, now));
                    }
                }
                State::AwaitResponse { deadline, .. } => {
                    open += 1;
                    if now >= deadline {
                        self.counters.timeouts.fetch_add(1, Relaxed);
                        open -= usize::from(self.finish(k, now));
                    }
                }
                State::Waiting { .. } => open += usize::from(!self.stopping),
                State::Done => {}
            }
        }
        open
    }

    /// The exchange of sensor `k` is over: next request, or done when stopping. True when the
    /// sensor is done.
    fn finish(&mut self, k: usize, now: Instant) -> bool {
        if self.stopping || now >= self.stop_at {
            self.sensors[k].state = State::Done;
            return true;
        }
        let first_sent = match self.sensors[k].state {
            State::AwaitAck { first_sent, .. } | State::AwaitResponse { first_sent, .. } => {
                Some(first_sent)
            }
            _ => None,
        };
        match first_sent.map(|t| t + self.interval) {
            Some(start_at) if start_at > now => {
                self.sensors[k].state = State::Waiting { start_at };
            }
            _ => self.send_next(k, now),
        }
        false
    }

    /// Start sensor `k`'s next exchange: new message id, token and sequence number.
    fn send_next(&mut self, k: usize, now: Instant) {
        let factor = self.rng.gen_range(1.0..1.5);
        let timeout = self.ack_timeout.mul_f64(factor);
        let payload = self.payload;
        let s = &mut self.sensors[k];
        s.mid = s.mid.wrapping_add(1);
        s.token = s.token.wrapping_add(1);
        s.seq += 1;
        let (mid, token, seq) = (s.mid.to_be_bytes(), s.token_bytes(), s.seq.to_be_bytes());
        s.datagram[2..4].copy_from_slice(&mid);
        s.datagram[4..4 + TOKEN_LEN].copy_from_slice(&token);
        let n = payload.min(8);
        let at = s.payload_at;
        s.datagram[at..at + n].copy_from_slice(&seq[8 - n..]);
        s.state = State::AwaitAck {
            first_sent: now,
            deadline: now + timeout,
            timeout,
            retries: 0,
        };
        self.counters.requests.fetch_add(1, Relaxed);
        self.transmit(k);
    }

    fn transmit(&mut self, k: usize) {
        let s = &self.sensors[k];
        if s.socket.send(&s.datagram).is_err() {
            self.stats.send_errors += 1;
        }
    }

    fn send_empty_ack(&mut self, k: usize, mid: u16) {
        let m = Message::empty(MsgType::Ack, mid);
        let mut out = BytesMut::with_capacity(4);
        m.encode_udp(&mut out);
        if self.sensors[k].socket.send(&out).is_err() {
            self.stats.send_errors += 1;
        }
    }

    /// Read every datagram waiting on sensor `k`'s socket.
    fn drain_socket(&mut self, k: usize, buf: &mut [u8]) {
        if k >= self.sensors.len() {
            return;
        }
        loop {
            let n = match self.sensors[k].socket.recv(buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // ICMP port unreachable and the like: the peer is gone; timers handle it.
                Err(_) => return,
            };
            let now = Instant::now();
            match Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])) {
                Ok(m) => self.on_message(k, m, now),
                Err(_) => self.stats.bad += 1,
            }
        }
    }

    fn on_message(&mut self, k: usize, m: Message, now: Instant) {
        let s = &self.sensors[k];
        let (first_sent, awaiting_ack) = match s.state {
            State::AwaitAck { first_sent, .. } => (Some(first_sent), true),
            State::AwaitResponse { first_sent, .. } => (Some(first_sent), false),
            _ => (None, false),
        };
        let ours = first_sent.is_some() && m.token.as_slice() == s.token_bytes();
        match m.mtype {
            MsgType::Ack if m.message_id == s.mid && awaiting_ack => {
                if m.code.is_empty() {
                    self.counters.empty_acks.fetch_add(1, Relaxed);
                    if let Some(first_sent) = first_sent {
                        self.sensors[k].state = State::AwaitResponse {
                            first_sent,
                            deadline: now + self.response_timeout,
                        };
                    }
                } else if ours {
                    self.complete(k, m.code, first_sent, now);
                } else {
                    self.stats.late += 1;
                }
            }
            MsgType::Rst if m.message_id == s.mid && awaiting_ack => {
                self.counters.resets.fetch_add(1, Relaxed);
                self.finish(k, now);
            }
            MsgType::Con | MsgType::Non if m.code.is_response() => {
                if m.mtype == MsgType::Con {
                    self.send_empty_ack(k, m.message_id);
                }
                if ours {
                    self.complete(k, m.code, first_sent, now);
                } else {
                    self.stats.late += 1;
                }
            }
            MsgType::Con => {
                // A request or an empty CON (ping) to a client: RST (RFC 7252 §4.2/§4.3).
                let rst = Message::empty(MsgType::Rst, m.message_id);
                let mut out = BytesMut::with_capacity(4);
                rst.encode_udp(&mut out);
                let _ = self.sensors[k].socket.send(&out);
            }
            _ => self.stats.late += 1,
        }
    }

    fn complete(&mut self, k: usize, code: Code, first_sent: Option<Instant>, now: Instant) {
        self.counters.responses.fetch_add(1, Relaxed);
        if code.is_success() {
            self.counters.success.fetch_add(1, Relaxed);
        }
        self.stats.codes[usize::from(code.0)] += 1;
        if let Some(first_sent) = first_sent {
            let us = now.saturating_duration_since(first_sent).as_micros() as u64;
            record_us(&mut self.stats.all, us);
            if first_sent >= self.warm_at {
                record_us(&mut self.stats.steady, us);
            }
        }
        self.finish(k, now);
    }
}

/// Rates and a window's figures from two snapshots.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CoapWindow {
    pub window_s: f64,
    pub requests: u64,
    pub responses: u64,
    pub success: u64,
    pub timeouts: u64,
    pub retransmissions: u64,
    /// Success responses per second in the window.
    pub success_rate: f64,
}

impl CoapWindow {
    pub fn between(before: CoapSnapshot, after: CoapSnapshot, window: Duration) -> CoapWindow {
        let s = window.as_secs_f64().max(1e-9);
        let success = after.success - before.success;
        CoapWindow {
            window_s: round3(s),
            requests: after.requests - before.requests,
            responses: after.responses - before.responses,
            success,
            timeouts: after.timeouts - before.timeouts,
            retransmissions: after.retransmissions - before.retransmissions,
            success_rate: round1(success as f64 / s),
        }
    }
}
