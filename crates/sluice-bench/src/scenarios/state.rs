//! The `state` scenario: what `[state] dir` (retained messages and persistent sessions kept
//! across restarts, `docs/state.md`) costs, and how long a restart with a large state takes.
//!
//! Owns: the two measurements and their report. Uses: a sluice binary as a child process
//! ([`SluiceChild`]), its `/metrics`, and a minimal MQTT 3.1.1 device written here (one socket
//! split into a reader and a writer task, so receiving never waits for sending).
//!
//! # Load: persistent sessions on vs off (same run, same load)
//! `devices` devices each hold one connection, subscribe QoS 1 to their neighbour's topic
//! (`s/{i+1 mod N}`) and publish QoS 1 to their own (`s/{i}`) at `rate` messages/s with the
//! send time (wall clock, µs) in the payload. Every message therefore goes through a session:
//! queued, written to the subscriber, PUBACKed. "off": clean sessions, no `[state]`; "on":
//! persistent sessions (clean session = 0) and `[state] dir` on a real disk, so every delivery
//! is logged (Enqueue, Send, Acked records) and group-committed. Measured over the window after
//! a warm-up: sluice's CPU (utime + stime) per delivered message, and the publish → delivery
//! latency at the subscriber (p50/p99/max).
//!
//! # Restart
//! With `[state] dir`: `sessions` persistent sessions each subscribe to `q/{i}` and go away; one
//! QoS 1 message is queued for each; `retained` retained messages are published. Once
//! `/metrics` shows all of it in the state writer's image, sluice is killed with SIGKILL and
//! started again on the same directory. Reported: time to the first accepted TCP connection,
//! time until a sampled persistent session reconnects with session present and gets its queued
//! message, and the gateway's own `sluice_state_load_seconds`; and the state directory's
//! size.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use serde::Serialize;
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Packet, ProtocolVersion, PubResponse, Publish, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{sleep, Instant};

use crate::harness::machine::{machine, Machine};
use crate::harness::metrics::metric_sum;
use crate::harness::procfs::{CpuMeter, Pid};
use crate::harness::sut::{require_sluice_bin, SluiceChild};
use crate::report::markdown::machine_line;
use crate::stats::{LatencySummary, ShardedHistogram};

/// Parameters of the `state` scenario.
#[derive(Debug, Clone, Serialize)]
pub struct StateScenario {
    pub sluice_bin: PathBuf,
    pub devices: usize,
    pub rate: f64,
    pub warmup: Duration,
    pub window: Duration,
    pub retained: usize,
    pub sessions: usize,
    /// Where the state directories go (a real disk; default /var/tmp).
    pub work_dir: PathBuf,
    pub skip_load: bool,
    pub skip_restart: bool,
}

impl StateScenario {
    pub fn new(sluice_bin: PathBuf) -> StateScenario {
        StateScenario {
            sluice_bin,
            devices: 1024,
            rate: 10.0,
            warmup: Duration::from_secs(5),
            window: Duration::from_secs(20),
            retained: 100_000,
            sessions: 10_000,
            work_dir: PathBuf::from("/var/tmp"),
            skip_load: false,
            skip_restart: false,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LoadResult {
    pub mode: &'static str,
    pub published: u64,
    pub delivered: u64,
    pub cpu_seconds: f64,
    pub cpu_us_per_message: f64,
    pub latency: LatencySummary,
    pub state_commits: u64,
    pub state_records: u64,
    pub state_bytes_written: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RestartResult {
    pub retained: usize,
    pub sessions: usize,
    pub prefill_seconds: f64,
    pub state_dir_bytes: u64,
    pub to_first_accept_ms: f64,
    pub to_session_back_ms: f64,
    pub load_ms_metric: u64,
    pub restored_sessions_metric: u64,
    pub restored_retained_metric: u64,
    pub sampled_sessions_ok: usize,
    pub sampled: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct StateReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub params: StateScenario,
    pub load: Vec<LoadResult>,
    pub restart: Option<RestartResult>,
}

pub async fn run_state(s: &StateScenario, command_line: &str) -> anyhow::Result<StateReport> {
    require_sluice_bin(&s.sluice_bin)?;
    let mut load = Vec::new();
    if !s.skip_load {
        for on in [false, true] {
            load.push(load_run(s, on).await?);
        }
    }
    let restart = if s.skip_restart {
        None
    } else {
        Some(restart_run(s).await?)
    };
    Ok(StateReport {
        scenario: "state",
        machine: machine(command_line),
        params: s.clone(),
        load,
        restart,
    })
}

fn config(mqtt_port: u16, admin_port: u16, state: Option<&Path>) -> String {
    let mut t = format!(
        "[gateway]\npin_threads = false\n\n\
         [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nmax_connections = 19000\nmax_sessions = 20000\n\
         max_retained_messages = 200000\nmax_retained_bytes = \"512MiB\"\n\n\
         [coap]\nenabled = false\n\n\
         [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
         [log]\nlevel = \"warn\"\n"
    );
    if let Some(dir) = state {
        let _ = write!(t, "\n[state]\ndir = \"{}\"\n", dir.display());
    }
    t
}

async fn load_run(s: &StateScenario, on: bool) -> anyhow::Result<LoadResult> {
    let work = tempfile::Builder::new()
        .prefix("sluice-bench-state-")
        .tempdir_in(&s.work_dir)
        .with_context(|| format!("a temporary directory in {}", s.work_dir.display()))?;
    let state_dir = work.path().join("state");
    let (mqtt_port, admin_port) = (sluice_testkit::free_port()?, sluice_testkit::free_port()?);
    let sut = SluiceChild::spawn(
        &s.sluice_bin,
        mqtt_port,
        config(mqtt_port, admin_port, on.then_some(state_dir.as_path())),
    )?;
    sut.wait_ready().await?;
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    let n = s.devices;
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let delivered = Arc::new(AtomicU64::new(0));
    let hist = Arc::new(ShardedHistogram::new(16));
    let mut tasks = Vec::new();
    for i in 0..n {
        let addr = sut.device_addr();
        let id = format!("dev-{i}");
        let mut dev = Device::connect(addr, &id, !on).await?;
        dev.subscribe(&format!("s/{}", (i + 1) % n)).await?;
        tasks.push(dev);
    }
    let mut handles = Vec::new();
    let period = Duration::from_secs_f64(1.0 / s.rate);
    for (i, dev) in tasks.into_iter().enumerate() {
        let (measuring, stop, published, delivered, hist) = (
            measuring.clone(),
            stop.clone(),
            published.clone(),
            delivered.clone(),
            hist.clone(),
        );
        // Spread the devices' ticks over one period.
        let offset = period.mul_f64(i as f64 / n as f64);
        handles.push(tokio::spawn(async move {
            dev.run(
                i, offset, period, measuring, stop, published, delivered, hist,
            )
            .await
        }));
    }
    sleep(s.warmup).await;
    let before = metrics(admin).await;
    let cpu = CpuMeter::start(Pid::Other(sut.pid()))?;
    measuring.store(true, Relaxed);
    sleep(s.window).await;
    measuring.store(false, Relaxed);
    let usage = cpu.usage()?;
    let after = metrics(admin).await;
    stop.store(true, Relaxed);
    for h in handles {
        let _ = h.await;
    }
    let delivered = delivered.load(Relaxed);
    let diff = |name: &str| metric(&after, name).saturating_sub(metric(&before, name));
    Ok(LoadResult {
        mode: if on { "on" } else { "off" },
        published: published.load(Relaxed),
        delivered,
        cpu_seconds: usage.cpu_seconds,
        cpu_us_per_message: if delivered == 0 {
            0.0
        } else {
            (usage.cpu_seconds * 1e6 / delivered as f64 * 10.0).round() / 10.0
        },
        latency: LatencySummary::from_histogram(&hist.merged()),
        state_commits: diff("sluice_state_commits_total"),
        state_records: diff("sluice_state_records_total"),
        state_bytes_written: diff("sluice_state_bytes_written_total"),
    })
}

async fn restart_run(s: &StateScenario) -> anyhow::Result<RestartResult> {
    let work = tempfile::Builder::new()
        .prefix("sluice-bench-state-")
        .tempdir_in(&s.work_dir)
        .with_context(|| format!("a temporary directory in {}", s.work_dir.display()))?;
    let state_dir = work.path().join("state");
    let (mqtt_port, admin_port) = (sluice_testkit::free_port()?, sluice_testkit::free_port()?);
    let toml = config(mqtt_port, admin_port, Some(&state_dir));
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    let sut = SluiceChild::spawn(&s.sluice_bin, mqtt_port, toml.clone())?;
    sut.wait_ready().await?;
    let addr = sut.device_addr();
    let started = Instant::now();
    // Sessions: subscribe and go away, 64 at a time.
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut joins = Vec::new();
    for i in 0..s.sessions {
        let permit = sem.clone().acquire_owned().await?;
        joins.push(tokio::spawn(async move {
            let _permit = permit;
            let mut d = Device::connect(addr, &format!("sess-{i}"), false).await?;
            d.subscribe(&format!("q/{i}")).await?;
            anyhow::Ok(())
        }));
    }
    for j in joins {
        j.await??;
    }
    // One queued message per session, and the retained messages, from 8 publishers.
    let per = |total: usize, k: usize| (k * total / 8)..((k + 1) * total / 8);
    let mut joins = Vec::new();
    for k in 0..8 {
        let (sessions, retained) = (per(s.sessions, k), per(s.retained, k));
        joins.push(tokio::spawn(async move {
            let mut p = Device::connect(addr, &format!("filler-{k}"), true).await?;
            for i in sessions {
                p.publish_window(&format!("q/{i}"), false, 64).await?;
            }
            for i in retained {
                p.publish_window(&format!("r/{i}"), true, 64).await?;
            }
            p.drain_acks().await?;
            anyhow::Ok(())
        }));
    }
    for j in joins {
        j.await??;
    }
    // Wait until the writer's image holds all of it.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let m = metrics(admin).await;
        if metric(&m, "sluice_state_sessions") >= s.sessions as u64
            && metric(&m, "sluice_state_retained_messages") >= s.retained as u64
        {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the state never held everything; sluice stderr:\n{}",
                sut.stderr_tail()
            );
        }
        sleep(Duration::from_millis(200)).await;
    }
    // One more commit interval after the image saw everything, then SIGKILL.
    sleep(Duration::from_millis(200)).await;
    let prefill_seconds = started.elapsed().as_secs_f64();
    let dir_bytes = dir_size(&state_dir);
    std::process::Command::new("kill")
        .arg("-KILL")
        .arg(sut.pid().to_string())
        .status()?;
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        sleep(Duration::from_millis(5)).await;
    }
    drop(sut);
    let t0 = Instant::now();
    let sut = SluiceChild::spawn(&s.sluice_bin, mqtt_port, toml)?;
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        sleep(Duration::from_millis(2)).await;
    }
    let to_accept = t0.elapsed();
    // The last session (the last one restored is as likely as any): back with its message.
    let sample: Vec<usize> = (0..20)
        .map(|k| (k * 7919 + s.sessions - 1) % s.sessions)
        .collect();
    let mut ok = 0;
    let mut to_session = None;
    for i in &sample {
        let mut d = Device::connect(addr, &format!("sess-{i}"), false).await?;
        let got = d.present && d.recv_one(Duration::from_secs(10)).await?.is_some();
        if to_session.is_none() {
            to_session = Some(t0.elapsed());
        }
        ok += got as usize;
    }
    let m = metrics(admin).await;
    drop(sut);
    Ok(RestartResult {
        retained: s.retained,
        sessions: s.sessions,
        prefill_seconds: (prefill_seconds * 10.0).round() / 10.0,
        state_dir_bytes: dir_bytes,
        to_first_accept_ms: (to_accept.as_secs_f64() * 1e4).round() / 10.0,
        to_session_back_ms: (to_session.unwrap_or_default().as_secs_f64() * 1e4).round() / 10.0,
        load_ms_metric: (metric_sum(&m, "sluice_state_load_seconds").unwrap_or(0.0) * 1000.0)
            .round() as u64,
        restored_sessions_metric: metric(&m, "sluice_state_restored_sessions"),
        restored_retained_metric: metric(&m, "sluice_state_restored_retained_messages"),
        sampled_sessions_ok: ok,
        sampled: sample.len(),
    })
}

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

async fn metrics(admin: SocketAddr) -> String {
    let Ok(mut s) = TcpStream::connect(admin).await else {
        return String::new();
    };
    let req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut body)).await;
    body
}

/// An unlabelled sample's value, 0 when absent (as a count).
fn metric(text: &str, name: &str) -> u64 {
    metric_sum(text, name).map_or(0, |v| v as u64)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A minimal MQTT 3.1.1 device.
struct Device {
    stream: TcpStream,
    rbuf: BytesMut,
    decoder: Decoder,
    present: bool,
    next_id: u16,
    unacked: usize,
}

impl Device {
    async fn connect(addr: SocketAddr, id: &str, clean: bool) -> anyhow::Result<Device> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut d = Device {
            stream,
            rbuf: BytesMut::new(),
            decoder: Decoder::client(ProtocolVersion::V311, 1 << 20),
            present: false,
            next_id: 1,
            unacked: 0,
        };
        d.send(&Packet::Connect(Connect {
            protocol: ProtocolVersion::V311,
            clean_start: clean,
            keep_alive: 0,
            client_id: ByteString::from(id),
            will: None,
            username: None,
            password: None,
            properties: Default::default(),
        }))
        .await?;
        match d.read(Duration::from_secs(30)).await? {
            Some(Packet::ConnAck(a)) if a.code == 0 => d.present = a.session_present,
            other => bail!("{id}: no CONNACK: {other:?}"),
        }
        Ok(d)
    }

    async fn send(&mut self, p: &Packet) -> anyhow::Result<()> {
        let mut b = BytesMut::new();
        encode(p, ProtocolVersion::V311, &mut b)?;
        self.stream.write_all(&b).await?;
        Ok(())
    }

    async fn read(&mut self, wait: Duration) -> anyhow::Result<Option<Packet>> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(p) = self.decoder.decode(&mut self.rbuf)? {
                return Ok(Some(p));
            }
            let n = match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.rbuf))
                .await
            {
                Ok(r) => r?,
                Err(_) => return Ok(None),
            };
            if n == 0 {
                bail!("sluice closed the connection");
            }
        }
    }

    async fn subscribe(&mut self, filter: &str) -> anyhow::Result<()> {
        self.send(&Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter {
                filter: ByteString::from(filter),
                options: SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                },
            }],
            properties: Default::default(),
        }))
        .await?;
        loop {
            match self.read(Duration::from_secs(30)).await? {
                Some(Packet::SubAck(_)) => return Ok(()),
                Some(Packet::Publish(p)) => self.ack(&p).await?,
                Some(_) => {}
                None => bail!("no SUBACK"),
            }
        }
    }

    async fn ack(&mut self, p: &Publish) -> anyhow::Result<()> {
        if let Some(id) = p.packet_id {
            self.send(&Packet::PubAck(PubResponse {
                packet_id: id,
                reason: 0,
                properties: None,
            }))
            .await?;
        }
        Ok(())
    }

    fn publish_packet(&mut self, topic: &str, retain: bool, payload: Bytes) -> Packet {
        let id = self.next_id;
        self.next_id = self.next_id.checked_add(1).unwrap_or(1);
        Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain,
            topic: ByteString::from(topic),
            packet_id: Some(id),
            properties: None,
            payload,
        })
    }

    /// Publish QoS 1 keeping at most `window` unacknowledged.
    async fn publish_window(
        &mut self,
        topic: &str,
        retain: bool,
        window: usize,
    ) -> anyhow::Result<()> {
        while self.unacked >= window {
            self.wait_ack().await?;
        }
        let p = self.publish_packet(topic, retain, Bytes::from_static(&[0x5a; 64]));
        self.send(&p).await?;
        self.unacked += 1;
        Ok(())
    }

    async fn wait_ack(&mut self) -> anyhow::Result<()> {
        match self.read(Duration::from_secs(30)).await? {
            Some(Packet::PubAck(_)) => self.unacked -= 1,
            Some(_) => {}
            None => bail!("no PUBACK within 30 s"),
        }
        Ok(())
    }

    async fn drain_acks(&mut self) -> anyhow::Result<()> {
        while self.unacked > 0 {
            self.wait_ack().await?;
        }
        Ok(())
    }

    async fn recv_one(&mut self, wait: Duration) -> anyhow::Result<Option<Publish>> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.read(left).await? {
                Some(Packet::Publish(p)) => {
                    self.ack(&p).await?;
                    return Ok(Some(p));
                }
                Some(_) => {}
                None => return Ok(None),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        self,
        index: usize,
        offset: Duration,
        period: Duration,
        measuring: Arc<AtomicBool>,
        stop: Arc<AtomicBool>,
        published: Arc<AtomicU64>,
        delivered: Arc<AtomicU64>,
        hist: Arc<ShardedHistogram>,
    ) -> anyhow::Result<()> {
        let Device {
            stream,
            mut rbuf,
            mut decoder,
            mut next_id,
            ..
        } = self;
        let (mut rd, mut wr) = stream.into_split();
        let (ack_tx, mut ack_rx) = tokio::sync::mpsc::channel::<u16>(256);
        let stop_r = stop.clone();
        let measuring_r = measuring.clone();
        let reader = tokio::spawn(async move {
            loop {
                while let Ok(Some(p)) = decoder.decode(&mut rbuf) {
                    if let Packet::Publish(p) = p {
                        if measuring_r.load(Relaxed) && p.payload.len() >= 8 {
                            let mut ts = [0u8; 8];
                            ts.copy_from_slice(&p.payload[..8]);
                            let sent = u64::from_le_bytes(ts);
                            hist.record_us(index, now_us().saturating_sub(sent));
                            delivered.fetch_add(1, Relaxed);
                        }
                        if let Some(id) = p.packet_id {
                            let _ = ack_tx.send(id).await;
                        }
                    }
                }
                if stop_r.load(Relaxed) {
                    return;
                }
                match tokio::time::timeout(Duration::from_millis(200), rd.read_buf(&mut rbuf)).await
                {
                    Ok(Ok(0)) | Ok(Err(_)) => return,
                    _ => {}
                }
            }
        });
        let topic = ByteString::from(format!("s/{index}"));
        let mut tick = tokio::time::interval_at(Instant::now() + offset, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut out = BytesMut::new();
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if stop.load(Relaxed) {
                        break;
                    }
                    let mut payload = BytesMut::with_capacity(64);
                    payload.extend_from_slice(&now_us().to_le_bytes());
                    payload.resize(64, 0x5a);
                    let id = next_id;
                    next_id = next_id.checked_add(1).unwrap_or(1);
                    let p = Packet::Publish(Publish {
                        dup: false,
                        qos: QoS::AtLeastOnce,
                        retain: false,
                        topic: topic.clone(),
                        packet_id: Some(id),
                        properties: None,
                        payload: payload.freeze(),
                    });
                    out.clear();
                    encode(&p, ProtocolVersion::V311, &mut out)?;
                    wr.write_all(&out).await?;
                    if measuring.load(Relaxed) {
                        published.fetch_add(1, Relaxed);
                    }
                }
                Some(id) = ack_rx.recv() => {
                    out.clear();
                    encode(&Packet::PubAck(PubResponse { packet_id: id, reason: 0, properties: None }), ProtocolVersion::V311, &mut out)?;
                    wr.write_all(&out).await?;
                }
            }
        }
        let _ = reader.await;
        Ok(())
    }
}

pub fn markdown(r: &StateReport) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "# Persistent state: cost and restart time\n");
    let _ = writeln!(t, "{}\n", machine_line(&r.machine, &[]));
    let _ = writeln!(t, "Command: `{}`\n", r.machine.command_line);
    if !r.load.is_empty() {
        let p = &r.params;
        let _ = writeln!(
            t,
            "## {} devices x {} msg/s, each message QoS 1 to one subscribing device ({} s window after {} s warm-up)\n",
            p.devices,
            p.rate,
            p.window.as_secs(),
            p.warmup.as_secs()
        );
        let _ = writeln!(t, "| persistent sessions + [state] | published | delivered | sluice CPU s | CPU µs/message | p50 ms | p99 ms | max ms | state commits | state records | state bytes written |");
        let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|");
        for l in &r.load {
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                l.mode,
                l.published,
                l.delivered,
                l.cpu_seconds,
                l.cpu_us_per_message,
                l.latency.p50_ms,
                l.latency.p99_ms,
                l.latency.max_ms,
                l.state_commits,
                l.state_records,
                l.state_bytes_written
            );
        }
        t.push('\n');
    }
    if let Some(x) = &r.restart {
        let _ = writeln!(t, "## Restart after kill -9 with {} retained messages and {} persistent sessions (one queued QoS 1 message each)\n", x.retained, x.sessions);
        let _ = writeln!(t, "| prefill s | state dir bytes | spawn → first TCP accept ms | spawn → a session back with its message ms | sluice_state_load_seconds × 1000 | restored sessions | restored retained | sampled sessions back with message |");
        let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {}/{} |",
            x.prefill_seconds,
            x.state_dir_bytes,
            x.to_first_accept_ms,
            x.to_session_back_ms,
            x.load_ms_metric,
            x.restored_sessions_metric,
            x.restored_retained_metric,
            x.sampled_sessions_ok,
            x.sampled
        );
    }
    t
}
