//! The ledger: what the devices were acknowledged and what reached the cloud, message by
//! message where the protocol lets the bench tell messages apart.
//!
//! Owns: the MQTT *ledger devices* ([`MqttLedger`]) and the cloud *recorder* ([`Recorder`]).
//! Does not own: the CoAP and PHD loads (`crate::load::coap`, `crate::load::phd`; their
//! acknowledgements are counted by those generators) or the faults.
//!
//! MQTT ledger device `d` (3.1.1, clean session) publishes on `faults/m/{d}` payloads
//! `"{d}:{seq}:"` plus filler at `rate` msg/s. QoS 1 devices keep at most `window` PUBLISHes
//! awaiting PUBACK (a due send with a full window waits: the device is back-pressured, and the
//! wait is part of its stall), remember every seq they were acknowledged, and after a lost
//! connection reconnect at once and resend every unacknowledged seq with DUP set, oldest first,
//! as a real device does. QoS 0 devices just send. Per QoS 1 device: the longest time a message
//! waited from its first send to its PUBACK (the *stall*), and the ack latency histogram.
//!
//! The recorder is a cloud client (plain MQTT on the cloud namespace's loopback, clean session
//! off, subscribed to `#` at QoS 1, reconnecting after a broker restart) on its own thread in
//! the cloud namespace. It keeps per (device, seq) how often it arrived for MQTT (`faults/m/`)
//! and CoAP (`faults/c/sensor-{i}`, the payload's first 8 bytes are the sensor's sequence
//! number) and counts PHD messages (`phd/…`) and everything else by topic prefix. Order: per
//! device, a first arrival whose seq is below one already seen is an order violation.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use bytestring::ByteString;
use hdrhistogram::Histogram;
use serde::Serialize;
use sluice_proto::mqtt::{Packet, Publish, QoS};
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::time::{sleep, Instant};

use crate::stats::{latency_histogram, record_us, LatencySummary};

/// What reached the cloud, as the recorder saw it.
#[derive(Debug, Default)]
pub struct Tally {
    pub mqtt: HashMap<(u32, u64), u32>,
    pub coap: HashMap<(u32, u64), u32>,
    /// PHD messages (each observation is one).
    pub phd: u64,
    /// Arrivals on other topics, by first topic level.
    pub other: BTreeMap<String, u64>,
    /// Highest seq first seen per device (key: 0 = MQTT, 1 = CoAP; device).
    high: HashMap<(u8, u32), u64>,
    pub order_violations: u64,
    /// Order violations by protocol: `[MQTT, CoAP]`.
    pub order_by_proto: [u64; 2],
    /// The first few order violations, described with their wall-clock arrival time (to set
    /// beside the case's own events).
    pub first_violations: Vec<String>,
    /// Retained / queued test messages by topic (for the state case): topic → arrivals.
    pub by_topic: HashMap<String, u32>,
    pub recorder_reconnects: u64,
}

impl Tally {
    fn add(&mut self, topic: &str, payload: &[u8]) {
        if topic.starts_with("faults/m/") {
            if let Some((dev, seq)) = parse_mqtt(payload) {
                self.first(0, dev, seq);
                *self.mqtt.entry((dev, seq)).or_insert(0) += 1;
                return;
            }
        }
        if let Some(s) = topic.strip_prefix("faults/c/sensor-") {
            if let (Ok(i), Some(b)) = (s.parse::<u32>(), payload.get(..8)) {
                let seq = u64::from_be_bytes(b.try_into().unwrap_or([0; 8]));
                self.first(1, i, seq);
                *self.coap.entry((i, seq)).or_insert(0) += 1;
                return;
            }
        }
        if topic.starts_with("phd/") {
            self.phd += 1;
            return;
        }
        if topic.starts_with("state/") {
            *self.by_topic.entry(topic.to_string()).or_insert(0) += 1;
        }
        let head = topic.split('/').next().unwrap_or("").to_string();
        *self.other.entry(head).or_insert(0) += 1;
    }

    fn first(&mut self, proto: u8, dev: u32, seq: u64) {
        let seen = match proto {
            0 => self.mqtt.contains_key(&(dev, seq)),
            _ => self.coap.contains_key(&(dev, seq)),
        };
        if seen {
            return;
        }
        let high = self.high.entry((proto, dev)).or_insert(seq);
        if seq < *high {
            self.order_violations += 1;
            self.order_by_proto[usize::from(proto.min(1))] += 1;
            if self.first_violations.len() < FIRST_VIOLATIONS {
                self.first_violations.push(format!(
                    "{} {dev} seq {seq} after {} at {}",
                    if proto == 0 {
                        "MQTT device"
                    } else {
                        "CoAP sensor"
                    },
                    *high,
                    wall_clock(std::time::SystemTime::now()),
                ));
            }
        } else {
            *high = seq;
        }
    }
}

/// How many order violations are described in [`Tally::first_violations`].
const FIRST_VIOLATIONS: usize = 4;

/// `HH:MM:SS.mmm` (UTC) of `t`, for the report's event times.
pub fn wall_clock(t: std::time::SystemTime) -> String {
    let s = humantime::format_rfc3339_millis(t).to_string();
    s.get(11..23).unwrap_or(&s).to_string()
}

/// The cloud recorder; stop it to get the tally.
pub struct Recorder {
    pub tally: Arc<Mutex<Tally>>,
    pub error: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Recorder {
    /// Start in the cloud namespace of `net`; returns once subscribed.
    pub async fn start(
        net: &sluice_testkit::netns::TestBed,
        port: u16,
    ) -> anyhow::Result<Recorder> {
        let tally = Arc::new(Mutex::new(Tally::default()));
        let error = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let thread = {
            let (tally, error, stop) = (tally.clone(), error.clone(), stop.clone());
            net.cloud.spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("recorder runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(record(port, tally, error, stop, ready_tx));
            })
        };
        match tokio::time::timeout(Duration::from_secs(20), ready_rx).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => anyhow::bail!("the recorder: {e}"),
            _ => anyhow::bail!("the recorder did not subscribe within 20 s"),
        }
        Ok(Recorder {
            tally,
            error,
            stop,
            thread: Some(thread),
        })
    }

    /// Distinct MQTT + CoAP messages and PHD messages seen so far.
    pub fn seen(&self) -> u64 {
        let t = self.tally.lock().unwrap_or_else(|p| p.into_inner());
        (t.mqtt.len() + t.coap.len()) as u64 + t.phd
    }

    pub fn stop(mut self) -> (Arc<Mutex<Tally>>, Option<String>) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let e = self.error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        (self.tally.clone(), e)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

async fn record(
    port: u16,
    tally: Arc<Mutex<Tally>>,
    error: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    ready: tokio::sync::oneshot::Sender<Result<(), String>>,
) {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut ready = Some(ready);
    let mut first = true;
    while !stop.load(Relaxed) {
        let mut opts = ConnectOpts::v311("faults-recorder");
        opts.clean_start = false;
        opts.keep_alive = 30;
        opts.timeout = Duration::from_secs(2);
        let mut client = match TestClient::connect(addr, opts).await {
            Ok((c, ack)) if ack.code == 0 => c,
            _ => {
                sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if first {
            match client.subscribe(&[("#", QoS::AtLeastOnce)]).await {
                Ok(codes) if codes.first().is_some_and(|&c| c < 0x80) => {}
                other => {
                    if let Some(r) = ready.take() {
                        let _ = r.send(Err(format!("subscribing: {other:?}")));
                    }
                    return;
                }
            }
            // Let the broker's autosave (every 1 s) write the session down.
            sleep(Duration::from_millis(1500)).await;
            if let Some(r) = ready.take() {
                let _ = r.send(Ok(()));
            }
            first = false;
        } else {
            tally
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .recorder_reconnects += 1;
        }
        let mut last_ping = Instant::now();
        while !stop.load(Relaxed) {
            match client.recv(Duration::from_millis(100)).await {
                Ok(Some(p)) => tally
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .add(&p.topic, &p.payload),
                Ok(None) => {}
                Err(e) => {
                    *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("{e:#}"));
                    break;
                }
            }
            if last_ping.elapsed() > Duration::from_secs(10) {
                last_ping = Instant::now();
                let _ = client.send_packet(&Packet::PingReq).await;
            }
        }
    }
}

fn parse_mqtt(payload: &[u8]) -> Option<(u32, u64)> {
    let text = std::str::from_utf8(payload.get(..payload.len().min(40))?).ok()?;
    let mut parts = text.splitn(3, ':');
    let d = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    Some((d, seq))
}

/// `"{d}:{seq}:"` padded with filler to `len` bytes.
fn payload_of(d: u32, seq: u64, len: usize) -> Bytes {
    let mut text = format!("{d}:{seq}:").into_bytes();
    text.resize(len.max(text.len()), b'.');
    Bytes::from(text)
}

/// Parameters of the MQTT ledger devices.
#[derive(Debug, Clone)]
pub struct LedgerConfig {
    pub target: SocketAddr,
    /// QoS 1 devices (indices 0..qos1).
    pub qos1: u32,
    /// QoS 0 devices (indices after the QoS 1 ones).
    pub qos0: u32,
    pub rate: f64,
    pub window: usize,
    pub payload: usize,
}

/// What one device returns.
#[derive(Debug, Default)]
struct DeviceResult {
    /// First send of the oldest message not yet acknowledged.
    oldest_unacked: Option<Instant>,
    acked: Vec<u64>,
    sent_qos0: u64,
    /// Sent (first time) and never acknowledged by the end.
    unacked: u64,
    max_wait: Duration,
    reconnects: u64,
}

/// Totals over the MQTT ledger devices.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerReport {
    pub qos1_devices: u32,
    pub qos0_devices: u32,
    /// Distinct (device, seq) acknowledged.
    pub acknowledged: u64,
    /// Sent at least once and never acknowledged by the end of the drain.
    pub never_acknowledged: u64,
    pub qos0_sent: u64,
    pub reconnects: u64,
    /// The longest any QoS 1 message waited from its first send to its PUBACK, ms.
    pub longest_stall_ms: f64,
    /// PUBLISH → PUBACK, first sends only.
    pub ack_latency: LatencySummary,
    #[serde(skip)]
    pub acked_keys: Vec<(u32, u64)>,
}

/// The running MQTT ledger devices.
pub struct MqttLedger {
    stop: Arc<AtomicBool>,
    tasks: Vec<(tokio::task::JoinHandle<()>, Arc<Mutex<DeviceResult>>)>,
    hist: Arc<Mutex<Histogram<u64>>>,
    window: Arc<Mutex<Histogram<u64>>>,
    pub sent: Arc<AtomicU64>,
    pub acked: Arc<AtomicU64>,
    config: LedgerConfig,
}

impl MqttLedger {
    pub fn start(config: LedgerConfig) -> MqttLedger {
        let stop = Arc::new(AtomicBool::new(false));
        let hist = Arc::new(Mutex::new(latency_histogram()));
        let window = Arc::new(Mutex::new(latency_histogram()));
        let sent = Arc::new(AtomicU64::new(0));
        let acked = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for d in 0..config.qos1 + config.qos0 {
            let qos1 = d < config.qos1;
            let result = Arc::new(Mutex::new(DeviceResult::default()));
            let task = tokio::spawn(device(
                d,
                qos1,
                config.clone(),
                DeviceWires {
                    stop: stop.clone(),
                    hists: [hist.clone(), window.clone()],
                    sent: sent.clone(),
                    acked_total: acked.clone(),
                    shared: result.clone(),
                },
            ));
            tasks.push((task, result));
        }
        MqttLedger {
            stop,
            tasks,
            hist,
            window,
            sent,
            acked,
            config,
        }
    }

    /// PUBLISH → PUBACK of the messages acknowledged since the last call.
    pub fn take_window(&self) -> LatencySummary {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let summary = LatencySummary::from_histogram(&w);
        w.reset();
        summary
    }

    /// Stop sending; wait up to `drain` for outstanding acknowledgements.
    pub async fn stop(self, drain: Duration) -> LedgerReport {
        self.stop.store(true, Relaxed);
        let deadline = Instant::now() + drain;
        let mut r = LedgerReport {
            qos1_devices: self.config.qos1,
            qos0_devices: self.config.qos0,
            acknowledged: 0,
            never_acknowledged: 0,
            qos0_sent: 0,
            reconnects: 0,
            longest_stall_ms: 0.0,
            ack_latency: LatencySummary::from_histogram(&latency_histogram()),
            acked_keys: Vec::new(),
        };
        let mut max_wait = Duration::ZERO;
        for (d, (mut t, shared)) in self.tasks.into_iter().enumerate() {
            if tokio::time::timeout_at(deadline + Duration::from_secs(2), &mut t)
                .await
                .is_err()
            {
                t.abort();
            }
            let res = std::mem::take(&mut *shared.lock().unwrap_or_else(|p| p.into_inner()));
            let dev_wait = res
                .oldest_unacked
                .map_or(res.max_wait, |t| res.max_wait.max(t.elapsed()));
            r.acknowledged += res.acked.len() as u64;
            r.acked_keys
                .extend(res.acked.iter().map(|&s| (d as u32, s)));
            r.never_acknowledged += res.unacked;
            r.qos0_sent += res.sent_qos0;
            r.reconnects += res.reconnects;
            max_wait = max_wait.max(dev_wait);
        }
        r.longest_stall_ms = (max_wait.as_secs_f64() * 1e4).round() / 10.0;
        r.ack_latency =
            LatencySummary::from_histogram(&self.hist.lock().unwrap_or_else(|p| p.into_inner()));
        r
    }
}

/// What a device task shares with the fleet.
struct DeviceWires {
    stop: Arc<AtomicBool>,
    /// The whole run's and the current window's ack latency.
    hists: [Arc<Mutex<Histogram<u64>>>; 2],
    sent: Arc<AtomicU64>,
    acked_total: Arc<AtomicU64>,
    shared: Arc<Mutex<DeviceResult>>,
}

async fn device(d: u32, qos1: bool, c: LedgerConfig, w: DeviceWires) {
    let DeviceWires {
        stop,
        hists,
        sent,
        acked_total,
        shared,
    } = w;
    let topic = ByteString::from(format!("faults/m/{d}"));
    let period = Duration::from_secs_f64(1.0 / c.rate.max(0.001));
    // Random phase so devices do not send in lockstep.
    let mut next_due = Instant::now() + period.mul_f64(f64::from(d % 97) / 97.0);
    let mut next_seq = 0u64;
    // seq → (payload, first send).
    let mut unacked: BTreeMap<u64, (Bytes, Instant)> = BTreeMap::new();
    let lock = || shared.lock().unwrap_or_else(|p| p.into_inner());
    let mut connected_once = false;
    let mut drain_deadline: Option<Instant> = None;
    loop {
        if stop.load(Relaxed) {
            let dl =
                *drain_deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(60));
            if unacked.is_empty() || !qos1 || Instant::now() >= dl {
                break;
            }
        }
        let mut opts = ConnectOpts::v311(format!("faults-m-{d}"));
        opts.timeout = Duration::from_secs(2);
        opts.keep_alive = 30;
        let mut client = match TestClient::connect(c.target, opts).await {
            Ok((client, ack)) if ack.code == 0 => client,
            _ => {
                sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if connected_once {
            lock().reconnects += 1;
        }
        connected_once = true;
        // packet id → seq.
        let mut in_flight: HashMap<u16, u64> = HashMap::new();
        let mut next_id: u16 = 1;
        let mut alloc = || {
            let id = next_id;
            next_id = next_id.checked_add(1).unwrap_or(1);
            id
        };
        let session: anyhow::Result<()> = async {
            if qos1 {
                let resend: Vec<(u64, Bytes)> =
                    unacked.iter().map(|(s, (p, _))| (*s, p.clone())).collect();
                for (seq, payload) in resend {
                    let id = alloc();
                    client
                        .send_packet(&publish(&topic, Some(id), payload, true))
                        .await?;
                    in_flight.insert(id, seq);
                }
            }
            loop {
                let stopping = stop.load(Relaxed);
                if stopping && (in_flight.is_empty() || !qos1) {
                    return Ok(());
                }
                let now = Instant::now();
                while !stopping && now >= next_due && (!qos1 || in_flight.len() < c.window) {
                    let payload = payload_of(d, next_seq, c.payload);
                    if qos1 {
                        let id = alloc();
                        unacked.insert(next_seq, (payload.clone(), Instant::now()));
                        {
                            let mut out = lock();
                            out.unacked = unacked.len() as u64;
                            if unacked.len() == 1 {
                                out.oldest_unacked = Some(Instant::now());
                            }
                        }
                        client
                            .send_packet(&publish(&topic, Some(id), payload, false))
                            .await?;
                        in_flight.insert(id, next_seq);
                    } else {
                        client
                            .send_packet(&publish(&topic, None, payload, false))
                            .await?;
                        lock().sent_qos0 += 1;
                    }
                    sent.fetch_add(1, Relaxed);
                    next_seq += 1;
                    next_due += period;
                }
                let wait = if stopping || (qos1 && in_flight.len() >= c.window) {
                    Duration::from_millis(200)
                } else {
                    next_due
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1))
                };
                if let Some(Packet::PubAck(r)) = client.recv_packet(wait).await? {
                    if let Some(seq) = in_flight.remove(&r.packet_id) {
                        anyhow::ensure!(r.reason < 0x80, "PUBACK refused {:#x}", r.reason);
                        if let Some((_, first)) = unacked.remove(&seq) {
                            let waited = first.elapsed();
                            let mut out = lock();
                            out.max_wait = out.max_wait.max(waited);
                            out.oldest_unacked = unacked.first_key_value().map(|(_, (_, t))| *t);
                            out.unacked = unacked.len() as u64;
                            let us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
                            for h in &hists {
                                record_us(&mut h.lock().unwrap_or_else(|p| p.into_inner()), us);
                            }
                            out.acked.push(seq);
                            acked_total.fetch_add(1, Relaxed);
                        }
                    }
                }
                // A device whose oldest message waits this long gives up on the connection
                // (a real device's PUBACK timeout) and resends on a new one.
                if let Some((_, (_, first))) = unacked.first_key_value() {
                    if first.elapsed() > Duration::from_secs(30) && !in_flight.is_empty() {
                        anyhow::bail!("no PUBACK for 30 s");
                    }
                }
            }
        }
        .await;
        if session.is_ok() {
            break;
        }
        // Catch up the schedule: messages not sent while disconnected are not owed.
        if next_due < Instant::now() {
            next_due = Instant::now();
        }
        sleep(Duration::from_millis(20)).await;
    }
    let mut out = lock();
    out.unacked = unacked.len() as u64;
    out.oldest_unacked = unacked.first_key_value().map(|(_, (_, t))| *t);
}

fn publish(topic: &ByteString, id: Option<u16>, payload: Bytes, dup: bool) -> Packet {
    Packet::Publish(Publish {
        dup,
        qos: if id.is_some() {
            QoS::AtLeastOnce
        } else {
            QoS::AtMostOnce
        },
        retain: false,
        topic: topic.clone(),
        packet_id: id,
        properties: None,
        payload,
    })
}
