//! The phases of a steady-load run and the pieces every such run repeats.
//!
//! A run goes ramp → settle → steady → drain: devices connect spread over `ramp`; the
//! *steady-state window* is `[start + ramp + settle, start + duration]`, over which CPU, rates
//! and steady latencies are measured; after the load stops, the drain waits until the sink has
//! every message, nothing new arrived for `drain_idle`, or `drain_max` passed. Warm-up, where a
//! scenario has one, is a separate run before all this (see the priority and throughput
//! scenarios). Also here: the measuring sink on the TLS cloud ([`cloud_sink`]) and the RSS
//! sampler that runs from the SUT's start to the end of the drain ([`RssSampler`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_testkit::{Mosquitto, TestPki};
use tokio::sync::watch;
use tokio::time::{sleep, sleep_until, Instant};

use crate::load::devices::DevicesConfig;
use crate::sinks::sink::{start_sink, SinkConfig, SinkHandle, SinkTls};

/// The timing of one steady-load run.
#[derive(Debug, Clone, Copy)]
pub struct Phases {
    /// From the first device's start to the end of the load.
    pub duration: Duration,
    /// Device connections are spread over this.
    pub ramp: Duration,
    /// The steady-state window starts this long after the ramp.
    pub settle: Duration,
    /// The drain ends when nothing new arrived at the sink for this long…
    pub drain_idle: Duration,
    /// …or after this long at most.
    pub drain_max: Duration,
}

impl Phases {
    /// Phases of these lengths.
    pub fn new(
        duration: Duration,
        ramp: Duration,
        settle: Duration,
        drain_idle: Duration,
        drain_max: Duration,
    ) -> Phases {
        Phases {
            duration,
            ramp,
            settle,
            drain_idle,
            drain_max,
        }
    }

    /// Give the devices this timing. They also wait for their outstanding PUBACKs as long as
    /// the drain may take: a device that closed its socket earlier would discard what the
    /// kernel still held for a back-pressuring SUT, and count it lost although the SUT never
    /// received it.
    pub fn apply_to(&self, devices: &mut DevicesConfig) {
        devices.duration = self.duration;
        devices.ramp = self.ramp;
        devices.settle = self.settle;
        devices.drain_timeout = self.drain_max;
    }

    /// How long the steady-state window lasts: `duration − (ramp + settle)`.
    pub fn steady_window(&self) -> Duration {
        self.duration.saturating_sub(self.ramp + self.settle)
    }

    /// Sleep until the steady-state window opens (the devices started at `started`).
    pub async fn until_steady(&self, started: Instant) {
        sleep_until(started + self.ramp + self.settle).await;
    }

    /// Sleep until the load ends.
    pub async fn until_end(&self, started: Instant) {
        sleep_until(started + self.duration).await;
    }

    /// Wait until `sink` holds `sent` unique messages, nothing new arrived for `drain_idle`,
    /// or `drain_max` passed; how long that took.
    pub async fn drain(&self, sink: &SinkHandle, sent: u64) -> Duration {
        let drain_start = Instant::now();
        while sink.unique() < sent
            && sink.idle_for() < self.drain_idle
            && drain_start.elapsed() < self.drain_max
        {
            sleep(Duration::from_millis(100)).await;
        }
        drain_start.elapsed()
    }
}

/// The measured window of the uplink scenarios (kafka, onem2m, site): from `ramp + settle`
/// to 2 s before the devices stop, so their last acknowledgements are not cut off.
pub fn uplink_window(
    duration: Duration,
    ramp: Duration,
    settle: Duration,
) -> anyhow::Result<Duration> {
    duration
        .checked_sub(ramp + settle + Duration::from_secs(2))
        .ok_or_else(|| anyhow::anyhow!("--duration must exceed ramp + settle + 2 s"))
}

/// The measuring sink on the cloud broker: TLS 1.3 with the run's CA, subscribed to `#` (QoS 1)
/// before anything is published.
pub async fn cloud_sink(
    pki: &TestPki,
    cloud: &Mosquitto,
    expect_devices: u32,
    progress_every: Option<Duration>,
) -> anyhow::Result<SinkHandle> {
    let mut sink_config = SinkConfig::new(cloud.tls_addr());
    sink_config.tls = Some(SinkTls {
        ca_file: pki.ca_path().to_path_buf(),
        client_cert: None,
        server_name: "127.0.0.1".to_string(),
    });
    sink_config.expect_devices = expect_devices;
    sink_config.progress_every = progress_every;
    start_sink(sink_config).await
}

/// Resident memory sampled every second (read on a blocking thread) until stopped.
pub struct RssSampler {
    samples: Arc<Mutex<Vec<u64>>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    /// Start with `first` (the sample taken right before) as the first sample; `read` gives
    /// the current RSS in KiB, or `None` when it cannot be read (that tick is skipped).
    pub fn start<F>(first: u64, read: F) -> RssSampler
    where
        F: Fn() -> Option<u64> + Clone + Send + 'static,
    {
        let samples = Arc::new(Mutex::new(vec![first]));
        let (stop, mut stopped) = watch::channel(false);
        let task = {
            let samples = samples.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = stopped.changed() => return,
                        _ = tick.tick() => {
                            let read = read.clone();
                            if let Ok(Some(kib)) = tokio::task::spawn_blocking(read).await {
                                samples.lock().unwrap_or_else(|p| p.into_inner()).push(kib);
                            }
                        }
                    }
                }
            })
        };
        RssSampler {
            samples,
            stop,
            task,
        }
    }

    /// Stop sampling; every sample taken, the first included.
    pub async fn stop(self) -> Vec<u64> {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples.clone()
    }
}
