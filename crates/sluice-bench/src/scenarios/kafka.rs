//! `scenario kafka`: records per second into a real three-node Apache Kafka cluster (KRaft,
//! started by `scripts/kafka-cluster`), (1) from Kafka's own `kafka-producer-perf-test` beside
//! it (the cluster's maximum on this machine, `acks = all`, idempotent, lz4, the same record
//! size), and (2) through sluice (MQTT devices, QoS 1 → sluice's Kafka uplink → Kafka), with
//! sluice's CPU per message and the devices' PUBACK latency (each PUBACK comes after Kafka's
//! acknowledgement, so it is devices → sluice → Kafka → device).
//!
//! Each phase writes to its own topic of 3 partitions, replication factor 3 and
//! `min.insync.replicas = 2`. The sluice phase runs `sluice run` as a child with the uplink
//! `protocol = "kafka"` (plaintext on loopback, lz4, a fixed topic) and MQTT 5 devices from
//! [`crate::load::devices`] offering `devices × rate` QoS 1 messages per second; the window
//! starts after the ramp and a settle time and ends before the devices stop. After the run,
//! the topic's end offsets (Kafka's `GetOffsetShell`) must hold at least every acknowledged
//! message. The machine runs the cluster (three JVMs), sluice and the devices on the same
//! cores: the figures are CPU-limited, and reported as such.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::Serialize;
use sluice_testkit::KafkaCluster;

use crate::harness::machine::{machine, Machine};
use crate::harness::procfs::{cpu_time, Pid};
use crate::harness::sut::SluiceChild;
use crate::load::devices::{spawn_devices, DevicesConfig};
use crate::stats::LatencySummary;

/// The parameters (CLI defaults in [`KafkaScenario::new`]).
#[derive(Debug, Clone)]
pub struct KafkaScenario {
    pub sluice_bin: PathBuf,
    /// `scripts/kafka-cluster` of this checkout.
    pub cluster_script: PathBuf,
    pub sluice_shards: u32,
    pub devices: u32,
    pub rate_per_device: f64,
    pub payload: usize,
    /// Records the perf test sends.
    pub perf_records: u64,
    pub duration: Duration,
    pub ramp: Duration,
    pub settle: Duration,
    pub command_line: String,
}

impl KafkaScenario {
    pub fn new(sluice_bin: PathBuf) -> KafkaScenario {
        KafkaScenario {
            sluice_bin,
            cluster_script: PathBuf::from("scripts/kafka-cluster"),
            sluice_shards: 1,
            devices: 100,
            rate_per_device: 50.0,
            payload: 200,
            perf_records: 300_000,
            duration: Duration::from_secs(30),
            ramp: Duration::from_secs(2),
            settle: Duration::from_secs(3),
            command_line: String::new(),
        }
    }
}

/// What was measured.
#[derive(Debug, Clone, Serialize)]
pub struct KafkaReport {
    pub scenario: &'static str,
    pub machine: Machine,
    pub sluice_shards: u32,
    pub devices: u32,
    pub offered_rate: f64,
    pub payload_bytes: usize,
    pub window_s: f64,
    /// Kafka's own producer perf test: records per second, and its summary line.
    pub perf_test_rate: f64,
    pub perf_test_line: String,
    /// Device messages per second acknowledged through sluice (each after Kafka's ack).
    pub sluice_rate: f64,
    pub sluice_rejected: u64,
    /// sluice's CPU per acknowledged message in the window, µs.
    pub sluice_cpu_us_per_msg: f64,
    /// sluice's CPU in the window, % of one core.
    pub sluice_cpu_percent: f64,
    /// PUBLISH written → PUBACK decoded, after ramp + settle.
    pub ack_latency: LatencySummary,
    /// Records in the sluice phase's topic after the run (≥ acknowledged: at-least-once).
    pub records_in_topic: u64,
    pub acknowledged_total: u64,
    /// `sluice_rate / perf_test_rate`.
    pub ratio: f64,
}

/// Create `topic` (3 partitions, replication factor 3).
pub(crate) fn create_topic(cluster: &KafkaCluster, topic: &str) -> anyhow::Result<()> {
    let out = cluster.tool(&[
        "org.apache.kafka.tools.TopicCommand",
        "--bootstrap-server",
        &cluster.bootstrap,
        "--create",
        "--topic",
        topic,
        "--partitions",
        "3",
        "--replication-factor",
        "3",
    ]);
    if !out.contains("Created topic") {
        bail!("creating topic {topic}: {out}");
    }
    Ok(())
}

/// The sum of the topic's end offsets (records stored).
pub(crate) fn records(cluster: &KafkaCluster, topic: &str) -> u64 {
    cluster
        .tool(&[
            "org.apache.kafka.tools.GetOffsetShell",
            "--bootstrap-server",
            &cluster.bootstrap,
            "--topic",
            topic,
        ])
        .lines()
        .filter_map(|l| l.rsplit(':').next()?.trim().parse::<u64>().ok())
        .sum()
}

pub async fn run_kafka(s: &KafkaScenario) -> anyhow::Result<KafkaReport> {
    crate::harness::sut::require_sluice_bin(&s.sluice_bin)?;
    let machine = machine(&s.command_line);
    let window = crate::harness::phases::uplink_window(s.duration, s.ramp, s.settle)?;
    eprintln!(
        "kafka: starting a three-node cluster ({})",
        s.cluster_script.display()
    );
    let script = s.cluster_script.clone();
    let cluster =
        tokio::task::spawn_blocking(move || KafkaCluster::launch(&script, None, None)).await??;

    eprintln!(
        "kafka: phase 1, kafka-producer-perf-test ({} records of {} B)",
        s.perf_records, s.payload
    );
    create_topic(&cluster, "perf")?;
    let perf_line = cluster
        .tool(&[
            "org.apache.kafka.tools.ProducerPerformance",
            "--topic",
            "perf",
            "--num-records",
            &s.perf_records.to_string(),
            "--record-size",
            &s.payload.to_string(),
            "--throughput",
            "-1",
            "--producer-props",
            &format!("bootstrap.servers={}", cluster.bootstrap),
            "acks=all",
            "enable.idempotence=true",
            "compression.type=lz4",
            "linger.ms=5",
        ])
        .lines()
        .rev()
        .find(|l| l.contains("records sent"))
        .unwrap_or_default()
        .to_string();
    let perf_test_rate: f64 = perf_line
        .split(", ")
        .nth(1)
        .and_then(|f| f.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no rate in the perf test's summary {perf_line:?}"))?;
    eprintln!("kafka: {perf_line}");

    eprintln!("kafka: phase 2, MQTT devices → sluice → Kafka ({window:?} window)");
    create_topic(&cluster, "sluice")?;
    let mqtt_port = sluice_testkit::free_port()?;
    let sluice = SluiceChild::spawn(
        &s.sluice_bin,
        mqtt_port,
        sluice_toml(s, mqtt_port, &cluster.bootstrap),
    )?;
    sluice.wait_ready().await?;
    let run = spawn_devices(DevicesConfig::steady_qos1(
        sluice.device_addr(),
        s.devices,
        s.rate_per_device,
        s.payload,
        (s.duration, s.ramp, s.settle),
        "k",
    ))?;
    tokio::time::sleep(s.ramp + s.settle).await;
    let pid = Pid::Other(sluice.pid());
    let (start, cpu0, t0) = (run.counters().snapshot(), cpu_time(pid)?, Instant::now());
    tokio::time::sleep(window).await;
    let (end, cpu1, elapsed) = (run.counters().snapshot(), cpu_time(pid)?, t0.elapsed());
    let report = run.wait().await?;
    let acked = end.acknowledged - start.acknowledged;
    if acked == 0 {
        bail!(
            "no message went through sluice; its stderr:\n{}",
            sluice.stderr_tail()
        );
    }
    let cpu = (cpu1 - cpu0).as_secs_f64();
    let sluice_rate = acked as f64 / elapsed.as_secs_f64();
    drop(sluice);
    let records_in_topic = records(&cluster, "sluice");
    if records_in_topic < report.acknowledged {
        bail!(
            "Kafka holds {records_in_topic} records, fewer than the {} acknowledged",
            report.acknowledged
        );
    }
    eprintln!("kafka: {sluice_rate:.0} messages/s acknowledged through sluice; {records_in_topic} records in the topic");
    Ok(KafkaReport {
        scenario: "kafka",
        machine,
        sluice_shards: s.sluice_shards,
        devices: s.devices,
        offered_rate: f64::from(s.devices) * s.rate_per_device,
        payload_bytes: s.payload,
        window_s: elapsed.as_secs_f64(),
        perf_test_rate,
        perf_test_line: perf_line,
        sluice_rate,
        sluice_rejected: report.rejected,
        sluice_cpu_us_per_msg: cpu * 1e6 / acked as f64,
        sluice_cpu_percent: cpu * 100.0 / elapsed.as_secs_f64(),
        ack_latency: report.ack_latency_steady.clone(),
        records_in_topic,
        acknowledged_total: report.acknowledged,
        ratio: if perf_test_rate > 0.0 {
            sluice_rate / perf_test_rate
        } else {
            0.0
        },
    })
}

fn sluice_toml(s: &KafkaScenario, mqtt_port: u16, bootstrap: &str) -> String {
    let brokers: Vec<String> = bootstrap.split(',').map(|b| format!("{b:?}")).collect();
    let admin = sluice_testkit::free_port().unwrap_or(0);
    format!(
        "# generated by sluice-bench scenario kafka\n[gateway]\nshards = {}\n\n[mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n[coap]\nenabled = false\n\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n\n[log]\nlevel = \"warn\"\n\n[[uplink]]\nname = \"kafka\"\nprotocol = \"kafka\"\nbrokers = [{}]\nsecurity_protocol = \"plaintext\"\nallow_plaintext = true\ntopic = \"sluice\"\ncompression = \"lz4\"\ninflight = 1024\nforward = [\"#\"]\n",
        s.sluice_shards,
        brokers.join(", ")
    )
}

/// The report as Markdown.
pub fn markdown(r: &KafkaReport) -> String {
    format!(
        "### kafka: {} devices × {:.0} msg/s, {} B, QoS 1 → sluice → 3-node Kafka (acks = all, idempotent, lz4)\n\n\
| | records/s | sluice CPU | PUBACK p50 / p99 |\n|---|---:|---:|---|\n\
| `kafka-producer-perf-test` (the cluster's maximum here) | {:.0} | | |\n\
| through sluice (offered {:.0}/s) | {:.0} | {:.1} % ({:.1} µs/msg) | {:.2} / {:.2} ms |\n\n\
sluice ÷ perf test: {:.3}. Records in sluice's topic after the run: {} (acknowledged: {}; at-least-once). Rejected: {}. \
Cluster, sluice and devices share this machine's cores (CPU-limited).\n\nPerf test: `{}`\n",
        r.devices,
        r.offered_rate / f64::from(r.devices.max(1)),
        r.payload_bytes,
        r.perf_test_rate,
        r.offered_rate,
        r.sluice_rate,
        r.sluice_cpu_percent,
        r.sluice_cpu_us_per_msg,
        r.ack_latency.p50_ms,
        r.ack_latency.p99_ms,
        r.ratio,
        r.records_in_topic,
        r.acknowledged_total,
        r.sluice_rejected,
        r.perf_test_line
    )
}
