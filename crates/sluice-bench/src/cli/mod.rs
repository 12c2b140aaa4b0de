//! The command line's pieces, apart from the top-level command list in `main.rs`: the argument
//! groups shared by several commands (load, aggregation, MQTT version), the translation helpers
//! and the output routing every scenario uses ([`write_outputs`]). [`tools`] holds the single
//! tools (devices, sink, fastsink, floor, agent, idle), [`scenarios`] the whole-machine
//! scenarios and [`storage`] the storage study: each an `Args` struct and the function that
//! turns it into the library's config and prints the report.

pub(crate) mod coap;
pub(crate) mod control_storm;
pub(crate) mod faults;
pub(crate) mod functions;
pub(crate) mod hostile;
pub(crate) mod multipath;
pub(crate) mod scenarios;
pub(crate) mod site;
pub(crate) mod state;
pub(crate) mod storage;
pub(crate) mod tools;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use sluice_bench::load::devices::{Arrivals, PayloadSize};
use sluice_proto::mqtt::{ProtocolVersion, QoS};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum MqttVersion {
    #[value(name = "3.1.1")]
    V311,
    #[value(name = "5")]
    V5,
}

impl From<MqttVersion> for ProtocolVersion {
    fn from(v: MqttVersion) -> Self {
        match v {
            MqttVersion::V311 => ProtocolVersion::V311,
            MqttVersion::V5 => ProtocolVersion::V5,
        }
    }
}

/// sluice's SenML aggregation (`[uplink.aggregate]`) in the generated config.
#[derive(Args, Clone)]
pub(crate) struct AggregateArgs {
    /// Aggregate normal records into SenML packs above --min-devices (on in the scenarios as
    /// measured; sluice's own default is off, so the generated config always says which).
    #[arg(long, value_enum, default_value = "on")]
    aggregate: OnOff,
    /// Aggregate while more than this many devices are connected.
    #[arg(long, default_value_t = 50)]
    min_devices: usize,
    /// SenML encoding of packs.
    #[arg(long, value_enum, default_value = "json")]
    pack_format: PackFormatArg,
    /// Publish a pack once it reaches this size (with unit, e.g. "1KiB", "16KiB").
    #[arg(long, default_value = "1KiB")]
    max_pack: String,
    /// ... or once its oldest record waited this long (with unit, e.g. "1s", "200ms").
    #[arg(long, default_value = "1s")]
    max_delay: String,
    /// `flush` in the generated `[uplink.aggregate]`: "idle", "window" or "max_delay" (not
    /// written when absent: sluice's default, and binaries from before the key accept it).
    #[arg(long, value_parser = ["idle", "window", "max_delay"])]
    flush: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PackFormatArg {
    Json,
    Cbor,
}

impl AggregateArgs {
    fn opts(&self) -> sluice_bench::harness::sut::AggregateOpts {
        sluice_bench::harness::sut::AggregateOpts {
            enabled: self.aggregate == OnOff::On,
            min_devices: self.min_devices,
            format: match self.pack_format {
                PackFormatArg::Json => "json",
                PackFormatArg::Cbor => "cbor",
            }
            .to_string(),
            max_pack: self.max_pack.clone(),
            max_delay: self.max_delay.clone(),
            flush: self.flush.clone(),
        }
    }
}

/// Options shared by everything that generates load.
#[derive(Args, Clone)]
pub(crate) struct LoadArgs {
    /// Messages per second per device (0: connect and stay idle).
    #[arg(long, default_value_t = 10.0, value_name = "MSG/S")]
    rate: f64,
    /// Payload size in bytes, uniformly random in MIN..MAX (inclusive), or a fixed SIZE.
    /// At least 24 (the bench header).
    #[arg(long, default_value = "100..1024", value_name = "MIN..MAX")]
    payload: PayloadSize,
    /// QoS of the PUBLISHes: 0 (fire and forget) or 1 (wait for PUBACK, measure ack latency).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    qos: u8,
    /// MQTT protocol version the devices speak.
    #[arg(long, value_enum, default_value = "3.1.1")]
    mqtt: MqttVersion,
    /// Length of the whole run, ramp included, e.g. "60s", "2m".
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Device connections are started evenly spread over this period, e.g. "5s".
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    ramp: Duration,
    /// Steady state starts this long after the ramp: latencies labelled "steady" (and, for
    /// `scenario`, the CPU window) only count what happens after it, e.g. "5s".
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// Poisson arrivals (exponential gaps) instead of a fixed period with a random phase.
    #[arg(long)]
    poisson: bool,
    /// Progress line on stderr every this often ("0s" to disable).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress: Duration,
}

/// A share between 0.0 and 1.0.
pub(crate) fn parse_share(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} is not between 0.0 and 1.0"))
    }
}

pub(crate) fn qos(v: u8) -> QoS {
    if v == 0 {
        QoS::AtMostOnce
    } else {
        QoS::AtLeastOnce
    }
}

pub(crate) fn progress(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

pub(crate) fn arrivals(poisson: bool) -> Arrivals {
    if poisson {
        Arrivals::Poisson
    } else {
        Arrivals::Periodic
    }
}

pub(crate) fn emit_json<T: serde::Serialize>(
    report: &T,
    out: Option<&PathBuf>,
) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(report).context("serialising the report")?;
    println!("{json}");
    if let Some(path) = out {
        std::fs::write(path, format!("{json}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// This process's command line, shell-quoted where needed.
pub(crate) fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A scenario's report out: the Markdown table to `markdown` when given; then, with `out`, the
/// JSON to that file and the table on stdout, else the JSON on stdout and the table on stderr.
pub(crate) fn write_outputs<T: serde::Serialize>(
    report: &T,
    table: &str,
    out: Option<&PathBuf>,
    markdown: Option<&PathBuf>,
) -> anyhow::Result<()> {
    if let Some(path) = markdown {
        std::fs::write(path, table).with_context(|| format!("writing {}", path.display()))?;
    }
    match out {
        Some(path) => {
            sluice_bench::report::write_json(report, path)?;
            println!("{table}");
            eprintln!("report written to {}", path.display());
        }
        None => {
            eprintln!("{table}");
            emit_json(report, None)?;
        }
    }
    Ok(())
}
