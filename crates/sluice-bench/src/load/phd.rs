//! PHD data agents: N IEEE 11073-20601 agents that associate once and then send paced,
//! pipelined, *confirmed* fixed scan reports — the steady data load of the control-storm
//! scenario, and (rate unbounded) its scan-report maximum.
//!
//! Owns: one TCP connection per agent, its association (AARQ → AARE, a config report when the
//! manager asks for one), its token bucket and its window of confirmed reports awaiting their
//! confirmation (by invoke id), and the fleet's counters and confirmation-latency window. Does
//! not own: the encoders (`sluice_testkit::phd`: `aarq`, `config_report`, `scan_report_fixed`)
//! or what the gateway makes of the reports (the cloud subscriber counts those).
//!
//! Shape (as [`crate::load::paced`], for the same reason: a few fast agents cost the generator
//! less than many slow ones):
//! - Agent `i` has system id `system_id_base + i` (big-endian EUI-64), plays the device of
//!   [`PhdFleetConfig::device`] with its standard configuration (default the glucometer,
//!   `0x06A4`: one observation per report, so one report = one SenML message at the cloud).
//! - Rate: the controller sets a total offered rate in reports/s, split evenly; tokens accrue
//!   per agent, capped at [`BURST`] worth (the excess is dropped at the source and counted:
//!   `window_full_drops` when the agent's window was full — the gateway did not confirm in
//!   time — else `late_drops` — the generator did not run in time). `f64::INFINITY` = as fast
//!   as the windows allow.
//! - Window: at most `window` confirmed reports unconfirmed per agent; every report due at a
//!   wake-up goes out in one write.
//! - Latency: report written → its confirmation read. sluice confirms a report only when the
//!   cloud uplink acknowledged every message made of it (the MQTT PUBACK rule), so this is
//!   agent → gateway → cloud broker PUBACK → gateway → agent.
//! - Wire: APDU = choice u16 · length u16 · body; the confirmation is a PRST whose data APDU
//!   is `rors-cmip-confirmed-event-report` (`0x0201`), invoke id at bytes 6..8 (fact sheet
//!   §1, §6). Anything else after the association (ABRT, RLRQ, …) ends the agent (counted).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::{Buf as _, BytesMut};
use hdrhistogram::Histogram;
use serde::Serialize;
use sluice_testkit::phd::{aarq, config_report, scan_report_fixed, AgentSpec, PhdDevice, Reading};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};

use crate::sinks::fastsink::LatencyWindow;

/// Tokens above this much time's worth of reports are dropped (and counted).
pub const BURST: Duration = Duration::from_millis(50);
/// Largest APDU the agents accept from the manager.
pub const MAX_APDU: usize = 64 * 1024;

/// APDU choices and data-APDU choices the agents look at (fact sheet §1, §6).
pub(crate) const AARE: u16 = 0xE300;
pub(crate) const RLRE: u16 = 0xE500;
pub(crate) const PRST: u16 = 0xE700;
pub(crate) const RORS_CONFIRMED_EVENT_REPORT: u16 = 0x0201;
/// AARE results.
pub(crate) const ACCEPTED: u16 = 0;
pub(crate) const ACCEPTED_UNKNOWN_CONFIG: u16 = 3;

/// Parameters of a PHD data fleet.
#[derive(Debug, Clone)]
pub struct PhdFleetConfig {
    /// sluice's `[phd] listen`.
    pub target: SocketAddr,
    pub agents: u32,
    pub device: PhdDevice,
    /// Confirmed reports awaiting confirmation per agent, at most.
    pub window: u16,
    /// Shortest sleep between two wake-ups of one agent (reports are batched within it).
    pub pacing_tick: Duration,
    pub connect_timeout: Duration,
    /// Agent `i`'s system id is `system_id_base + i`.
    pub system_id_base: u64,
}

impl PhdFleetConfig {
    /// 32 glucometers, window 32, 5 ms pacing.
    pub fn new(target: SocketAddr) -> PhdFleetConfig {
        PhdFleetConfig {
            target,
            agents: 32,
            device: PhdDevice::Glucometer,
            window: 32,
            pacing_tick: Duration::from_millis(5),
            connect_timeout: Duration::from_secs(10),
            system_id_base: 0x0DA7_A000_0000_0000,
        }
    }
}

/// Live counters of a fleet.
#[derive(Debug, Default)]
pub struct PhdFleetCounters {
    pub associated: AtomicU64,
    pub connect_failures: AtomicU64,
    /// Agents whose connection failed or was aborted after the association (they stop).
    pub agent_failures: AtomicU64,
    pub sent: AtomicU64,
    pub confirmed: AtomicU64,
    pub window_full_drops: AtomicU64,
    pub late_drops: AtomicU64,
}

/// A copy of [`PhdFleetCounters`].
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PhdFleetSnapshot {
    pub associated: u64,
    pub connect_failures: u64,
    pub agent_failures: u64,
    pub sent: u64,
    pub confirmed: u64,
    pub window_full_drops: u64,
    pub late_drops: u64,
}

impl PhdFleetCounters {
    pub fn snapshot(&self) -> PhdFleetSnapshot {
        PhdFleetSnapshot {
            associated: self.associated.load(Relaxed),
            connect_failures: self.connect_failures.load(Relaxed),
            agent_failures: self.agent_failures.load(Relaxed),
            sent: self.sent.load(Relaxed),
            confirmed: self.confirmed.load(Relaxed),
            window_full_drops: self.window_full_drops.load(Relaxed),
            late_drops: self.late_drops.load(Relaxed),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Control {
    per_agent_rate: f64,
    stop: bool,
}

struct Shared {
    config: PhdFleetConfig,
    counters: PhdFleetCounters,
    confirm_latency: LatencyWindow,
    first_error: Mutex<Option<String>>,
    drain_until: Mutex<Option<Instant>>,
}

/// Associated PHD agents; idle until [`PhdFleet::set_total_rate`].
pub struct PhdFleet {
    shared: Arc<Shared>,
    control: watch::Sender<Control>,
    tasks: JoinSet<()>,
}

impl PhdFleet {
    /// Connect and associate every agent (64 at a time); fails if any cannot.
    pub async fn connect(config: PhdFleetConfig) -> anyhow::Result<PhdFleet> {
        if config.agents == 0 || config.window == 0 {
            bail!("at least one agent and a window of at least 1 are needed");
        }
        let shared = Arc::new(Shared {
            config,
            counters: PhdFleetCounters::default(),
            confirm_latency: LatencyWindow::default(),
            first_error: Mutex::new(None),
            drain_until: Mutex::new(None),
        });
        let (control, control_rx) = watch::channel(Control {
            per_agent_rate: 0.0,
            stop: false,
        });
        let slots = Arc::new(Semaphore::new(64));
        let mut tasks = JoinSet::new();
        for index in 0..shared.config.agents {
            tasks.spawn(agent(
                index,
                shared.clone(),
                control_rx.clone(),
                slots.clone(),
            ));
        }
        let fleet = PhdFleet {
            shared,
            control,
            tasks,
        };
        let n = u64::from(fleet.shared.config.agents);
        let deadline = Instant::now() + fleet.shared.config.connect_timeout * 2;
        loop {
            let c = fleet.counters();
            if c.connect_failures > 0 {
                bail!(
                    "{} of {n} PHD agents could not associate with {}: {}",
                    c.connect_failures,
                    fleet.shared.config.target,
                    fleet.first_error()
                );
            }
            if c.associated == n {
                return Ok(fleet);
            }
            if Instant::now() >= deadline {
                bail!("only {} of {n} PHD agents associated in time", c.associated);
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Offer `reports_per_s` in total (`f64::INFINITY`: window-limited; 0: pause).
    pub fn set_total_rate(&self, reports_per_s: f64) {
        let per_agent = reports_per_s.max(0.0) / f64::from(self.shared.config.agents);
        self.control.send_modify(|c| c.per_agent_rate = per_agent);
    }

    pub fn counters(&self) -> PhdFleetSnapshot {
        self.shared.counters.snapshot()
    }

    /// Report written → confirmation read, for confirmations read since the last take.
    pub fn take_confirm_latency(&self) -> Histogram<u64> {
        self.shared.confirm_latency.take()
    }

    pub fn first_error(&self) -> String {
        self.shared
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "no error recorded".to_string())
    }

    /// Stop reporting, wait up to `drain` for outstanding confirmations, close every agent
    /// (without a release: the gateway sees the connection end).
    pub async fn stop(mut self, drain: Duration) -> PhdFleetSnapshot {
        *self
            .shared
            .drain_until
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + drain);
        self.control.send_modify(|c| c.stop = true);
        let _ = timeout(drain + Duration::from_secs(3), async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        self.tasks.abort_all();
        self.counters()
    }
}

/// The agent spec of a fleet agent or storm agent.
pub(crate) fn spec(system_id: u64, device: PhdDevice, config_id: u16) -> AgentSpec {
    AgentSpec {
        system_id: system_id.to_be_bytes(),
        config_id,
        ..AgentSpec::new(device)
    }
}

/// A reading of `device` (fixed values: the gateway's work does not depend on them).
fn reading(device: PhdDevice) -> Reading {
    match device {
        PhdDevice::PulseOximeter => Reading::Oximeter {
            spo2: (98, 0),
            pulse: (72, 0),
        },
        PhdDevice::BloodPressure => Reading::BloodPressure {
            systolic: (120, 0),
            diastolic: (80, 0),
            mean: (93, 0),
            pulse: (72, 0),
        },
        PhdDevice::WeighingScale => Reading::Scale {
            mass_kg: (7_250, -2),
            bmi: (2_310, -2),
        },
        PhdDevice::Glucometer => Reading::Glucose { mg_dl: (105, 0) },
    }
}

async fn agent(
    index: u32,
    shared: Arc<Shared>,
    control: watch::Receiver<Control>,
    slots: Arc<Semaphore>,
) {
    let mut associated = false;
    if let Err(error) = run_agent(index, &shared, control, &slots, &mut associated).await {
        let counter = if associated {
            &shared.counters.agent_failures
        } else {
            &shared.counters.connect_failures
        };
        counter.fetch_add(1, Relaxed);
        let text = format!("PHD agent {index}: {error:#}");
        tracing::warn!(agent = index, error = %text, "PHD data agent failed");
        let mut first = shared.first_error.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(text);
    }
}

/// Connect and associate `spec` (AARQ, and the config report when asked); the AARE result.
pub(crate) async fn associate(
    stream: &mut TcpStream,
    rbuf: &mut BytesMut,
    spec: &AgentSpec,
    wait: Duration,
) -> anyhow::Result<u16> {
    stream
        .write_all(&aarq(spec))
        .await
        .context("writing AARQ")?;
    let aare = timeout(wait, read_apdu(stream, rbuf))
        .await
        .map_err(|_| anyhow!("no AARE within {wait:?}"))??;
    let result = aare_result(&aare)?;
    if result == ACCEPTED_UNKNOWN_CONFIG {
        stream
            .write_all(&config_report(spec, 0))
            .await
            .context("writing the config report")?;
        let rsp = timeout(wait, read_apdu(stream, rbuf))
            .await
            .map_err(|_| anyhow!("no configuration response within {wait:?}"))??;
        if apdu_choice(&rsp) != PRST {
            bail!(
                "the manager answered the config report with APDU 0x{:04x}",
                apdu_choice(&rsp)
            );
        }
    } else if result != ACCEPTED {
        bail!("association rejected (AARE result {result})");
    }
    Ok(result)
}

/// The AARE's result (bytes 4..6), or an error for any other APDU.
pub(crate) fn aare_result(apdu: &[u8]) -> anyhow::Result<u16> {
    if apdu_choice(apdu) != AARE || apdu.len() < 6 {
        bail!("expected AARE, got APDU 0x{:04x}", apdu_choice(apdu));
    }
    Ok(u16::from_be_bytes([apdu[4], apdu[5]]))
}

pub(crate) fn apdu_choice(apdu: &[u8]) -> u16 {
    apdu.get(..2)
        .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]))
}

/// A whole APDU off the front of `buf`, if there is one.
pub(crate) fn take_apdu(buf: &mut BytesMut) -> anyhow::Result<Option<Vec<u8>>> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = 4 + usize::from(u16::from_be_bytes([buf[2], buf[3]]));
    if len > MAX_APDU {
        bail!("APDU of {len} bytes from the manager");
    }
    if buf.len() < len {
        return Ok(None);
    }
    let apdu = buf[..len].to_vec();
    buf.advance(len);
    Ok(Some(apdu))
}

/// The next APDU, reading as needed (cancel-safe: bytes read stay in `buf`).
pub(crate) async fn read_apdu<R: AsyncRead + Unpin>(
    stream: &mut R,
    buf: &mut BytesMut,
) -> anyhow::Result<Vec<u8>> {
    loop {
        if let Some(a) = take_apdu(buf)? {
            return Ok(a);
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(4096);
        }
        if stream
            .read_buf(buf)
            .await
            .context("reading from the manager")?
            == 0
        {
            bail!("the manager closed the connection");
        }
    }
}

async fn run_agent(
    index: u32,
    shared: &Shared,
    mut control: watch::Receiver<Control>,
    slots: &Semaphore,
    associated: &mut bool,
) -> anyhow::Result<()> {
    let config = &shared.config;
    let spec = spec(
        config.system_id_base + u64::from(index),
        config.device,
        config.device.standard_config_id(),
    );
    let reading = reading(config.device);
    let mut rbuf = BytesMut::with_capacity(4096);
    let mut stream = {
        let _slot = slots
            .acquire()
            .await
            .map_err(|_| anyhow!("connect slots closed"))?;
        let mut stream = timeout(config.connect_timeout, TcpStream::connect(config.target))
            .await
            .map_err(|_| anyhow!("TCP connect timed out"))?
            .context("TCP connect")?;
        stream.set_nodelay(true).context("setting TCP_NODELAY")?;
        associate(&mut stream, &mut rbuf, &spec, config.connect_timeout).await?;
        stream
    };
    *associated = true;
    shared.counters.associated.fetch_add(1, Relaxed);
    let window = usize::from(config.window);
    let mut inflight: VecDeque<(u16, Instant)> = VecDeque::with_capacity(window);
    let mut next_invoke: u16 = 1;
    let mut report_no: u16 = 0;
    // Desynchronise the agents' wake-ups.
    let mut tokens = f64::from(index % 97) / 97.0;
    let mut refilled_at = Instant::now();
    let mut wbuf: Vec<u8> = Vec::with_capacity(64 * 64);
    let mut latencies: Vec<u64> = Vec::with_capacity(window);
    let (mut rd, mut wr) = stream.split();
    let time = sluice_testkit::phd::bcd_time(2026, 11, 25, 4, 0, 0, 0);
    let result: anyhow::Result<()> = async {
        loop {
            let ctl = *control.borrow_and_update();
            if ctl.stop {
                return Ok(());
            }
            let now = Instant::now();
            let rate = ctl.per_agent_rate;
            let room = window - inflight.len().min(window);
            let due = if rate.is_infinite() {
                room
            } else {
                tokens += rate * now.duration_since(refilled_at).as_secs_f64();
                (tokens.max(0.0) as usize).min(room)
            };
            refilled_at = now;
            if due > 0 {
                wbuf.clear();
                for _ in 0..due {
                    let id = next_invoke;
                    next_invoke = next_invoke.wrapping_add(1).max(1);
                    wbuf.extend_from_slice(&scan_report_fixed(
                        &spec, id, report_no, &reading, time,
                    ));
                    report_no = report_no.wrapping_add(1);
                    inflight.push_back((id, now));
                }
                wr.write_all(&wbuf).await.context("writing scan reports")?;
                shared.counters.sent.fetch_add(due as u64, Relaxed);
                if rate.is_finite() {
                    tokens -= due as f64;
                }
            }
            let room_left = room - due;
            if rate.is_finite() {
                let cap = (rate * BURST.as_secs_f64()).max(1.0);
                let excess = (tokens - cap).floor();
                if excess >= 1.0 {
                    let counter = if room_left == 0 {
                        &shared.counters.window_full_drops
                    } else {
                        &shared.counters.late_drops
                    };
                    counter.fetch_add(excess as u64, Relaxed);
                    tokens -= excess;
                }
            }
            let wake = (rate > 0.0 && rate.is_finite() && room_left > 0).then(|| {
                let need = (1.0 - tokens).max(0.0) / rate;
                now + Duration::from_secs_f64(need.min(3600.0)).max(config.pacing_tick)
            });
            tokio::select! {
                biased;
                read = rd.read_buf(&mut rbuf) => {
                    if read.context("reading from the manager")? == 0 {
                        bail!("the manager closed the connection");
                    }
                    take_confirmations(&mut rbuf, &mut inflight, &mut latencies, shared)?;
                }
                changed = control.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                }
                () = sleep_until(wake.unwrap_or(now)), if wake.is_some() => {}
            }
        }
    }
    .await;
    result?;
    let drain_until = shared
        .drain_until
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or_else(Instant::now);
    while !inflight.is_empty() {
        match timeout_at(drain_until, rd.read_buf(&mut rbuf)).await {
            Err(_) => break,
            Ok(read) => {
                if read.context("reading from the manager")? == 0 {
                    break;
                }
                take_confirmations(&mut rbuf, &mut inflight, &mut latencies, shared)?;
            }
        }
    }
    Ok(())
}

fn take_confirmations(
    rbuf: &mut BytesMut,
    inflight: &mut VecDeque<(u16, Instant)>,
    latencies: &mut Vec<u64>,
    shared: &Shared,
) -> anyhow::Result<()> {
    let now = Instant::now();
    latencies.clear();
    while let Some(apdu) = take_apdu(rbuf)? {
        let choice = apdu_choice(&apdu);
        let data_choice = apdu
            .get(8..10)
            .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
        if choice != PRST || data_choice != RORS_CONFIRMED_EVENT_REPORT {
            bail!(
                "the manager sent APDU 0x{choice:04x} (data choice 0x{data_choice:04x}) while operating"
            );
        }
        let invoke = u16::from_be_bytes([apdu[6], apdu[7]]);
        let pos = match inflight.front() {
            Some(&(id, _)) if id == invoke => Some(0),
            _ => inflight.iter().position(|&(id, _)| id == invoke),
        };
        if let Some((_, sent_at)) = pos.and_then(|p| inflight.remove(p)) {
            latencies.push(u64::try_from((now - sent_at).as_micros()).unwrap_or(u64::MAX));
        }
    }
    shared.confirm_latency.record_all(latencies);
    shared
        .counters
        .confirmed
        .fetch_add(latencies.len() as u64, Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apdus_are_taken_whole_and_only_whole() {
        let mut buf = BytesMut::from(&[0xE3, 0x00, 0x00, 0x02, 0x00][..]);
        assert_eq!(take_apdu(&mut buf).unwrap(), None);
        buf.extend_from_slice(&[0x03, 0xE5]);
        let aare = take_apdu(&mut buf).unwrap().unwrap();
        assert_eq!(aare_result(&aare).unwrap(), ACCEPTED_UNKNOWN_CONFIG);
        assert_eq!(&buf[..], &[0xE5]);
    }
}
