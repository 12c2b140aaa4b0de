//! The mixed load of every fault case: MQTT ledger devices ([`super::ledger`]), CoAP sensors
//! (the closed-loop generator of `scenario coap`, paced by an interval, CON publishes at QoS 1
//! on `faults/c/sensor-{i}`) and PHD glucometers (the paced agents of `scenario
//! control-storm`), together; and the figures of a case from what they were acknowledged and
//! what the recorder saw at the cloud.
//!
//! Owns: starting and stopping the three loads, re-associating the PHD agents after sluice
//! restarted (those agents end on a lost connection; a new fleet takes over), and the
//! accounting ([`Figures`]). Does not own: the generators themselves.
//!
//! Accounting: MQTT is exact (every acknowledged (device, seq) is looked up at the cloud).
//! CoAP and PHD acknowledgements are counts (2.04 responses, confirmations) and the cloud sees
//! sensor sequence numbers (CoAP) or only messages (PHD), so for them "acknowledged but
//! missing" is the lower bound `acknowledged − distinct arrivals` (0 when more arrived: a
//! request that timed out at the sensor may still have arrived).

use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use super::ledger::{LedgerConfig, LedgerReport, MqttLedger, Tally};
use crate::load::coap::{spawn_coap_load, CoapLoad, CoapLoadConfig, RequestShape};
use crate::load::phd::{PhdFleet, PhdFleetConfig};

/// How much load.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSpec {
    pub mqtt_qos1: u32,
    pub mqtt_qos0: u32,
    /// Messages per second per MQTT device.
    pub mqtt_rate: f64,
    pub mqtt_payload: usize,
    pub coap_sensors: u32,
    /// Requests per second per CoAP sensor.
    pub coap_rate: f64,
    pub phd_agents: u32,
    /// Reports per second per PHD agent.
    pub phd_rate: f64,
}

impl LoadSpec {
    pub fn small() -> LoadSpec {
        LoadSpec {
            mqtt_qos1: 16,
            mqtt_qos0: 2,
            mqtt_rate: 10.0,
            mqtt_payload: 200,
            coap_sensors: 8,
            coap_rate: 5.0,
            phd_agents: 4,
            phd_rate: 5.0,
        }
    }
    pub fn full() -> LoadSpec {
        LoadSpec {
            mqtt_qos1: 64,
            mqtt_qos0: 8,
            coap_sensors: 32,
            phd_agents: 16,
            ..LoadSpec::small()
        }
    }
}

/// The three loads, running.
pub struct Load {
    pub mqtt: MqttLedger,
    coap: Option<CoapLoad>,
    phd: Option<PhdFleet>,
    phd_confirmed_before: u64,
    phd_failures_before: u64,
    phd_addr: SocketAddr,
    spec: LoadSpec,
    pub phd_reassociations: u32,
    /// When the planned load ends (the case stops the devices then).
    ends: tokio::time::Instant,
}

impl Load {
    /// How long the planned load still runs.
    pub fn remaining(&self) -> Duration {
        self.ends
            .saturating_duration_since(tokio::time::Instant::now())
    }

    /// Start every load; CoAP sensors send for `duration` (then stop by themselves).
    pub async fn start(
        spec: &LoadSpec,
        mqtt: SocketAddr,
        coap: SocketAddr,
        phd: SocketAddr,
        duration: Duration,
    ) -> anyhow::Result<Load> {
        let ends = tokio::time::Instant::now() + duration;
        let ledger = MqttLedger::start(LedgerConfig {
            target: mqtt,
            qos1: spec.mqtt_qos1,
            qos0: spec.mqtt_qos0,
            rate: spec.mqtt_rate,
            window: 16,
            payload: spec.mqtt_payload,
        });
        let coap = if spec.coap_sensors > 0 {
            let mut c = CoapLoadConfig::new(coap);
            c.sensors = spec.coap_sensors;
            c.threads = 1;
            c.duration = duration;
            c.ramp = Duration::from_millis(500);
            c.warmup = Duration::ZERO;
            c.payload = 16;
            c.request = RequestShape::publish("ps", "faults/c");
            c.interval = Duration::from_secs_f64(1.0 / spec.coap_rate.max(0.01));
            c.drain = Duration::from_secs(20);
            Some(spawn_coap_load(c)?)
        } else {
            None
        };
        let mut load = Load {
            mqtt: ledger,
            coap,
            phd: None,
            phd_confirmed_before: 0,
            phd_failures_before: 0,
            phd_addr: phd,
            spec: spec.clone(),
            phd_reassociations: 0,
            ends,
        };
        load.connect_phd().await?;
        Ok(load)
    }

    async fn connect_phd(&mut self) -> anyhow::Result<()> {
        if self.spec.phd_agents == 0 {
            return Ok(());
        }
        let mut c = PhdFleetConfig::new(self.phd_addr);
        c.agents = self.spec.phd_agents;
        c.window = 8;
        let fleet = PhdFleet::connect(c).await?;
        fleet.set_total_rate(self.spec.phd_rate * f64::from(self.spec.phd_agents));
        self.phd = Some(fleet);
        Ok(())
    }

    /// After sluice restarted: replace the PHD agents (theirs ended with the old process).
    /// Retries for up to 10 s.
    pub async fn reassociate_phd(&mut self) -> anyhow::Result<()> {
        if let Some(old) = self.phd.take() {
            let s = old.stop(Duration::ZERO).await;
            self.phd_confirmed_before += s.confirmed;
            self.phd_failures_before += s.agent_failures;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match self.connect_phd().await {
                Ok(()) => {
                    self.phd_reassociations += 1;
                    return Ok(());
                }
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Acknowledgements so far (MQTT + CoAP + PHD), for progress and "resumed" checks.
    pub fn acked_now(&self) -> u64 {
        self.mqtt.acked.load(std::sync::atomic::Ordering::Relaxed)
            + self
                .coap
                .as_ref()
                .map_or(0, |c| c.counters().snapshot().success)
            + self.phd_confirmed_before
            + self.phd.as_ref().map_or(0, |p| p.counters().confirmed)
    }

    /// Stop everything; wait up to `drain` for acknowledgements.
    pub async fn stop(mut self, drain: Duration) -> anyhow::Result<LoadResult> {
        let phd = match self.phd.take() {
            Some(f) => {
                let s = f.stop(drain.min(Duration::from_secs(10))).await;
                (
                    s.confirmed + self.phd_confirmed_before,
                    s.agent_failures + self.phd_failures_before,
                )
            }
            None => (self.phd_confirmed_before, self.phd_failures_before),
        };
        let mqtt = self.mqtt.stop(drain).await;
        let coap = match self.coap.take() {
            Some(c) => {
                let r = tokio::task::spawn_blocking(move || c.wait())
                    .await
                    .map_err(|e| anyhow::anyhow!("the CoAP load panicked: {e}"))??;
                (r.totals.requests, r.totals.success, r.totals.timeouts)
            }
            None => (0, 0, 0),
        };
        Ok(LoadResult {
            mqtt,
            coap_requests: coap.0,
            coap_acknowledged: coap.1,
            coap_timeouts: coap.2,
            phd_confirmed: phd.0,
            phd_agent_failures: phd.1,
            phd_reassociations: self.phd_reassociations,
        })
    }
}

/// What the devices saw.
#[derive(Debug, Clone, Serialize)]
pub struct LoadResult {
    pub mqtt: LedgerReport,
    pub coap_requests: u64,
    pub coap_acknowledged: u64,
    pub coap_timeouts: u64,
    pub phd_confirmed: u64,
    pub phd_agent_failures: u64,
    pub phd_reassociations: u32,
}

/// The figures every case prints.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Messages acknowledged to devices (MQTT QoS 1 + CoAP 2.04 + PHD confirmations).
    pub acknowledged: u64,
    /// Distinct messages at the cloud (MQTT + CoAP distinct, PHD messages).
    pub at_cloud: u64,
    /// Deliveries beyond the first (MQTT + CoAP).
    pub duplicates: u64,
    /// Per device, first arrivals below a seq already seen (MQTT + CoAP).
    pub order_violations: u64,
    /// The longest any MQTT QoS 1 message waited for its PUBACK (first send → PUBACK), ms.
    pub longest_stall_ms: f64,
    pub ack_p99_ms: f64,
    /// MQTT: acknowledged (device, seq) never seen at the cloud (exact).
    pub mqtt_acked_missing: u64,
    /// CoAP and PHD: acknowledged − distinct arrivals, when positive (a lower bound).
    pub coap_acked_missing_min: u64,
    pub phd_acked_missing_min: u64,
    /// The verdict's figure: the sum of the three above.
    pub acked_missing: u64,
    /// QoS 0 MQTT messages sent and never seen at the cloud (never acknowledged: reported,
    /// not a loss of the promise).
    pub qos0_lost: u64,
    pub qos0_sent: u64,
    /// Sent and never acknowledged by the end (devices resend them; not lost either).
    pub never_acknowledged: u64,
    pub device_reconnects: u64,
    pub coap_timeouts: u64,
    pub recorder_reconnects: u64,
}

/// Compare what the devices were acknowledged with what the recorder saw.
pub fn figures(load: &LoadResult, tally: &Tally) -> Figures {
    let m = &load.mqtt;
    let mqtt_missing = m
        .acked_keys
        .iter()
        .filter(|k| !tally.mqtt.contains_key(k))
        .count() as u64;
    let qos0_first = m.qos1_devices;
    let qos0_seen = tally.mqtt.keys().filter(|(d, _)| *d >= qos0_first).count() as u64;
    let mqtt_qos1_seen = tally.mqtt.len() as u64 - qos0_seen;
    let coap_missing = load
        .coap_acknowledged
        .saturating_sub(tally.coap.len() as u64);
    let phd_missing = load.phd_confirmed.saturating_sub(tally.phd);
    let deliveries: u64 = tally
        .mqtt
        .values()
        .chain(tally.coap.values())
        .map(|&n| u64::from(n))
        .sum();
    Figures {
        acknowledged: m.acknowledged + load.coap_acknowledged + load.phd_confirmed,
        at_cloud: mqtt_qos1_seen + tally.coap.len() as u64 + tally.phd,
        duplicates: deliveries - (tally.mqtt.len() + tally.coap.len()) as u64,
        order_violations: tally.order_violations,
        longest_stall_ms: m.longest_stall_ms,
        ack_p99_ms: m.ack_latency.p99_ms,
        mqtt_acked_missing: mqtt_missing,
        coap_acked_missing_min: coap_missing,
        phd_acked_missing_min: phd_missing,
        acked_missing: mqtt_missing + coap_missing + phd_missing,
        qos0_lost: m.qos0_sent.saturating_sub(qos0_seen),
        qos0_sent: m.qos0_sent,
        never_acknowledged: m.never_acknowledged,
        device_reconnects: m.reconnects,
        coap_timeouts: load.coap_timeouts,
        recorder_reconnects: tally.recorder_reconnects,
    }
}
