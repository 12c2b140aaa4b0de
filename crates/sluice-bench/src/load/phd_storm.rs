//! The PHD control storm: many short agent connections that only associate, (for new agents)
//! configure, and release — signalling and no data — at a controlled rate of control
//! messages per second.
//!
//! Owns: its own tokio runtime (threads named `phd-storm`, [`StormConfig::threads`] of them,
//! so the storm competes with the data load through the kernel's scheduler, not inside the
//! data generators' runtime where it would delay their send time stamps), a pacer, a pool of
//! worker tasks, the pool of "returning" agents, and the counters. Does not own: the encoders
//! (`sluice_testkit::phd`) or the data load ([`crate::load::phd`]).
//!
//! One session (one TCP connection, `TCP_NODELAY`, closed with `SO_LINGER` 0 so that no
//! TIME_WAIT socket is left per session: at thousands of sessions a second the ephemeral
//! ports would otherwise run out):
//! - **new** agent (a fresh system id, pulse oximeter, extended config `0x4000`): AARQ →
//!   AARE accepted-unknown-config → config report → response → RLRQ → RLRE: 6 messages;
//! - **returning** agent (a system id whose `0x4000` configuration the gateway learnt in this
//!   run, taken from the pool so no two sessions use one id at once): AARQ → AARE accepted →
//!   RLRQ → RLRE: 4 messages (6 if the gateway forgot the configuration and asks for it).
//!
//! A control message is an APDU the generator sent or an answer it read; the rate is their
//! sum per second, the same thing sluice counts in `sluice_phd_control_messages_total`
//! (in + out). The pacer turns the target rate into sessions per second using the expected
//! messages per session (`6·new_share + 4·(1 − new_share)`), starting sessions in 1 ms batches
//! (a semaphore the workers take permits from). When more than 50 ms worth of sessions wait for
//! a free worker the pacer stops adding them and counts them in `not_started`: the generator
//! (its workers, or the CPU it gets) is then the limit, and the achieved rate says how far it
//! got.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use bytes::BytesMut;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use serde::Serialize;
use sluice_testkit::phd::{config_report, rlrq, PhdDevice};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};
use tokio::time::{timeout, Instant};

use crate::load::phd::{
    aare_result, apdu_choice, read_apdu, spec, ACCEPTED, ACCEPTED_UNKNOWN_CONFIG, PRST, RLRE,
};
use crate::sinks::fastsink::LatencyWindow;

/// The extended configuration every storm agent uses.
pub const STORM_CONFIG_ID: u16 = 0x4000;
/// AARE rejected-transient (the gateway's agent table is full).
const REJECTED_TRANSIENT: u16 = 2;

/// Parameters of a storm generator.
#[derive(Debug, Clone)]
pub struct StormConfig {
    /// sluice's `[phd] listen`.
    pub target: SocketAddr,
    /// Share of sessions played by new agents (the rest return), 0..=1.
    pub new_share: f64,
    /// Sessions in flight at most (worker tasks).
    pub workers: usize,
    /// Runtime threads of the generator.
    pub threads: usize,
    /// Returning agents kept (the most recent new ones); keep it below `[phd] max_configs`.
    pub returning_pool: usize,
    /// Connect and each answer.
    pub answer_timeout: Duration,
    /// New agents get system ids from here upwards.
    pub system_id_base: u64,
    pub seed: u64,
}

impl StormConfig {
    /// Half new, half returning; 512 workers on 1 thread; a pool of 512.
    pub fn new(target: SocketAddr) -> StormConfig {
        StormConfig {
            target,
            new_share: 0.5,
            workers: 512,
            threads: 1,
            returning_pool: 512,
            answer_timeout: Duration::from_secs(10),
            system_id_base: 0x5707_0000_0000_0000,
            seed: 0x5707_2026,
        }
    }

    /// Control messages a session exchanges on average.
    pub fn messages_per_session(&self) -> f64 {
        6.0 * self.new_share + 4.0 * (1.0 - self.new_share)
    }
}

/// Live counters of the storm.
#[derive(Debug, Default)]
pub struct StormCounters {
    pub sessions_started: AtomicU64,
    pub sessions_done: AtomicU64,
    pub sessions_failed: AtomicU64,
    pub new_sessions: AtomicU64,
    pub returning_sessions: AtomicU64,
    /// APDUs the generator wrote.
    pub apdus_sent: AtomicU64,
    /// APDUs the generator read (answers).
    pub apdus_received: AtomicU64,
    pub aare_accepted: AtomicU64,
    pub aare_unknown_config: AtomicU64,
    pub aare_rejected: AtomicU64,
    /// Sessions the pacer did not start: no worker was free (the generator is the limit).
    pub not_started: AtomicU64,
}

/// A copy of [`StormCounters`].
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct StormSnapshot {
    pub sessions_started: u64,
    pub sessions_done: u64,
    pub sessions_failed: u64,
    pub new_sessions: u64,
    pub returning_sessions: u64,
    pub apdus_sent: u64,
    pub apdus_received: u64,
    pub aare_accepted: u64,
    pub aare_unknown_config: u64,
    pub aare_rejected: u64,
    pub not_started: u64,
}

impl StormSnapshot {
    /// Control messages (sent + received).
    pub fn messages(&self) -> u64 {
        self.apdus_sent + self.apdus_received
    }
}

impl StormCounters {
    pub fn snapshot(&self) -> StormSnapshot {
        StormSnapshot {
            sessions_started: self.sessions_started.load(Relaxed),
            sessions_done: self.sessions_done.load(Relaxed),
            sessions_failed: self.sessions_failed.load(Relaxed),
            new_sessions: self.new_sessions.load(Relaxed),
            returning_sessions: self.returning_sessions.load(Relaxed),
            apdus_sent: self.apdus_sent.load(Relaxed),
            apdus_received: self.apdus_received.load(Relaxed),
            aare_accepted: self.aare_accepted.load(Relaxed),
            aare_unknown_config: self.aare_unknown_config.load(Relaxed),
            aare_rejected: self.aare_rejected.load(Relaxed),
            not_started: self.not_started.load(Relaxed),
        }
    }
}

struct Shared {
    config: StormConfig,
    counters: StormCounters,
    /// AARQ written → AARE read.
    aare_latency: LatencyWindow,
    /// Returning agents available (system ids), oldest first.
    pool: Mutex<VecDeque<u64>>,
    next_new: AtomicU64,
    first_error: Mutex<Option<String>>,
}

/// A running storm generator (idle at rate 0). Dropping it stops its runtime.
pub struct Storm {
    shared: Arc<Shared>,
    rate: watch::Sender<f64>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Storm {
    /// Start the runtime, the pacer and the workers (idle until [`Storm::set_rate`]).
    pub fn start(config: StormConfig) -> anyhow::Result<Storm> {
        if !(0.0..=1.0).contains(&config.new_share) || config.workers == 0 || config.threads == 0 {
            bail!("new_share must be 0..=1, workers and threads at least 1");
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("phd-storm")
            .enable_all()
            .build()
            .context("starting the storm runtime")?;
        let shared = Arc::new(Shared {
            next_new: AtomicU64::new(config.system_id_base),
            config,
            counters: StormCounters::default(),
            aare_latency: LatencyWindow::default(),
            pool: Mutex::new(VecDeque::new()),
            first_error: Mutex::new(None),
        });
        let (rate, rate_rx) = watch::channel(0.0f64);
        let permits = Arc::new(Semaphore::new(0));
        runtime.spawn(pacer(shared.clone(), rate_rx, permits.clone()));
        for w in 0..shared.config.workers {
            runtime.spawn(worker(shared.clone(), permits.clone(), w as u64));
        }
        Ok(Storm {
            shared,
            rate,
            runtime: Some(runtime),
        })
    }

    /// Aim at `messages_per_s` control messages per second (0: stop starting sessions).
    pub fn set_rate(&self, messages_per_s: f64) {
        let _ = self.rate.send(messages_per_s.max(0.0));
    }

    pub fn counters(&self) -> StormSnapshot {
        self.shared.counters.snapshot()
    }

    /// AARQ → AARE latency since the last take.
    pub fn take_aare_latency(&self) -> Histogram<u64> {
        self.shared.aare_latency.take()
    }

    pub fn first_error(&self) -> Option<String> {
        self.shared
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for Storm {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Turn the target rate into session permits, 1 ms at a time.
async fn pacer(shared: Arc<Shared>, mut rate: watch::Receiver<f64>, permits: Arc<Semaphore>) {
    let per_session = shared.config.messages_per_session();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sessions_per_s = 0.0;
    let mut since = Instant::now();
    let mut issued = 0u64;
    loop {
        tick.tick().await;
        if rate.has_changed().unwrap_or(false) {
            sessions_per_s = *rate.borrow_and_update() / per_session;
            since = Instant::now();
            issued = 0;
        }
        if sessions_per_s <= 0.0 {
            continue;
        }
        let due = (sessions_per_s * since.elapsed().as_secs_f64()) as u64;
        let add = due.saturating_sub(issued);
        if add == 0 {
            continue;
        }
        issued = due;
        let backlog_cap = (sessions_per_s * 0.05).max(1.0) as usize;
        let room = backlog_cap.saturating_sub(permits.available_permits());
        let granted = (add as usize).min(room);
        if granted > 0 {
            permits.add_permits(granted);
        }
        let refused = add - granted as u64;
        if refused > 0 {
            shared.counters.not_started.fetch_add(refused, Relaxed);
        }
    }
}

async fn worker(shared: Arc<Shared>, permits: Arc<Semaphore>, index: u64) {
    let mut rng = SmallRng::seed_from_u64(shared.config.seed ^ index);
    let mut rbuf = BytesMut::with_capacity(1024);
    loop {
        match permits.acquire().await {
            Ok(p) => p.forget(),
            Err(_) => return,
        }
        let returning = if rng.gen::<f64>() < shared.config.new_share {
            None
        } else {
            shared
                .pool
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front()
        };
        let (id, new) = match returning {
            Some(id) => (id, false),
            None => (shared.next_new.fetch_add(1, Relaxed), true),
        };
        let c = &shared.counters;
        c.sessions_started.fetch_add(1, Relaxed);
        if new {
            c.new_sessions.fetch_add(1, Relaxed);
        } else {
            c.returning_sessions.fetch_add(1, Relaxed);
        }
        rbuf.clear();
        match session(&shared, id, &mut rbuf).await {
            Ok(configured) => {
                c.sessions_done.fetch_add(1, Relaxed);
                if configured || !new {
                    let mut pool = shared.pool.lock().unwrap_or_else(|p| p.into_inner());
                    pool.push_back(id);
                    while pool.len() > shared.config.returning_pool {
                        pool.pop_front();
                    }
                }
            }
            Err(error) => {
                c.sessions_failed.fetch_add(1, Relaxed);
                let text = format!("storm session (agent {id:016x}): {error:#}");
                tracing::debug!(error = %text, "storm session failed");
                let mut first = shared.first_error.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(text);
            }
        }
    }
}

/// One session; `Ok(true)` when the agent's configuration is known to the gateway afterwards.
async fn session(shared: &Shared, id: u64, rbuf: &mut BytesMut) -> anyhow::Result<bool> {
    let wait = shared.config.answer_timeout;
    let c = &shared.counters;
    let spec = spec(id, PhdDevice::PulseOximeter, STORM_CONFIG_ID);
    let mut stream = timeout(wait, TcpStream::connect(shared.config.target))
        .await
        .map_err(|_| anyhow!("TCP connect timed out"))?
        .context("TCP connect")?;
    stream.set_nodelay(true).context("setting TCP_NODELAY")?;
    // Linger 0: the close is a RST, immediate (it cannot block) and leaves no TIME_WAIT.
    socket2::SockRef::from(&stream)
        .set_linger(Some(Duration::ZERO))
        .context("setting SO_LINGER")?;
    let t0 = Instant::now();
    stream
        .write_all(&sluice_testkit::phd::aarq(&spec))
        .await
        .context("writing AARQ")?;
    c.apdus_sent.fetch_add(1, Relaxed);
    let aare = answer(shared, &mut stream, rbuf, "AARE").await?;
    let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
    shared.aare_latency.record_all(&[us]);
    let result = aare_result(&aare)?;
    match result {
        ACCEPTED => {
            c.aare_accepted.fetch_add(1, Relaxed);
        }
        ACCEPTED_UNKNOWN_CONFIG => {
            c.aare_unknown_config.fetch_add(1, Relaxed);
            stream
                .write_all(&config_report(&spec, 0))
                .await
                .context("writing the config report")?;
            c.apdus_sent.fetch_add(1, Relaxed);
            let rsp = answer(shared, &mut stream, rbuf, "configuration response").await?;
            if apdu_choice(&rsp) != PRST {
                bail!(
                    "config report answered with APDU 0x{:04x}",
                    apdu_choice(&rsp)
                );
            }
        }
        REJECTED_TRANSIENT => {
            c.aare_rejected.fetch_add(1, Relaxed);
            bail!("association rejected-transient (agent table full)");
        }
        other => {
            c.aare_rejected.fetch_add(1, Relaxed);
            bail!("association rejected (AARE result {other})");
        }
    }
    stream.write_all(&rlrq(0)).await.context("writing RLRQ")?;
    c.apdus_sent.fetch_add(1, Relaxed);
    let rlre = answer(shared, &mut stream, rbuf, "RLRE").await?;
    if apdu_choice(&rlre) != RLRE {
        bail!("RLRQ answered with APDU 0x{:04x}", apdu_choice(&rlre));
    }
    Ok(true)
}

async fn answer(
    shared: &Shared,
    stream: &mut TcpStream,
    rbuf: &mut BytesMut,
    what: &str,
) -> anyhow::Result<Vec<u8>> {
    let wait = shared.config.answer_timeout;
    let apdu = timeout(wait, read_apdu(stream, rbuf))
        .await
        .map_err(|_| anyhow!("no {what} within {wait:?}"))??;
    shared.counters.apdus_received.fetch_add(1, Relaxed);
    Ok(apdu)
}
