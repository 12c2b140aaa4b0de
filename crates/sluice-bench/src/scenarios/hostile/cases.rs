//! The cases of the `hostile` scenario, numbered as the findings of issue 28's table: what the
//! attacker does, what the case observes and its verdict against the target.
//!
//! Owns: each case's bed additions ([`prepare`]), its attack and verdict ([`attack`]): the
//! CoAP edge's cases in `cases/coap.rs` (1–4, 7–9), the PHD edge's in `cases/phd.rs` (5, 6,
//! 10), the upstreams' in `cases/upstreams.rs` (12, 13), SIGHUP (11) here, with the helpers
//! they share. Does not own: the bed, the healthy devices or the RSS/latency figures around the
//! attack (the scenario), the peers ([`super::peers`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use sluice_proto::mqtt::QoS;
use sluice_testkit::phd::{aare_result, AgentSpec, PhdAgent, PhdDevice, Reading};
use tokio::time::{sleep, Instant};

use super::peers::{
    code_text, request, Attacker, BodyMode, HostileUpstream, SlowCse, Traffic, BIG_PAYLOAD, CLIENT,
    CSE_BODY, SLOW_PAYLOAD, SPOOFED, SQUATTER,
};
use super::{Bed, BedSpec, HostileScenario, Outcome, AMPLIFICATION};

mod coap;
mod phd;
mod upstreams;

use coap::{case1, case2, case3, case4, case7, case8, case9};
use phd::{case10, case5, case6};
use upstreams::{case12, case13};

/// The finding's one-line title.
pub fn title(n: u8) -> &'static str {
    match n {
        1 => "NON GET of a 60 KB retained topic",
        2 => "4,000 CON GETs (distinct message ids) of a 60 KB retained topic",
        3 => "300 Observes of filters of 1,100 (mostly empty) Uri-Path segments",
        4 => "anonymous CoAP with [[mqtt.users]] and allow_anonymous = false",
        5 => "PHD report whose data the cloud refuses for good (MQTT 5 0x87)",
        6 => "PHD agent claiming another's system id with another configuration",
        7 => "NON Observe registrations until max_observers (40) refuses",
        8 => "block-0 datagrams never continued",
        9 => "publish to an invalid topic of 0x01 bytes",
        10 => "200 PHD agents with 64 KB model strings",
        11 => "kill -HUP",
        12 => "CoAP proxy: upstream answers 65,000 B, and late",
        13 => "oneM2M CSE answering in 1-byte chunks",
        _ => "unknown case",
    }
}

/// The target for the case.
pub fn target(n: u8) -> &'static str {
    match n {
        1 | 9 => "bytes out ≤ 3× bytes in",
        2 | 3 => "RSS growth ≤ control + bound",
        4 => "anonymous CoAP reads nothing of an authenticated device, its publish reaches no authenticated subscriber",
        5 => "refused data not confirmed to the agent",
        6 => "genuine agent's data not mislabelled",
        7 => "a legitimate observer admitted within the expiry wait",
        8 => "a legitimate block-wise publish ends 2.04 within the expiry wait",
        10 => "RSS per agent ≤ normal + 64 KiB, status ≤ 2× control + 64 KiB",
        11 => "process alive and serving after SIGHUP",
        12 => "bytes out ≤ 3× bytes in (unverified source)",
        13 => "chunked CPU per wire byte ≤ 2× Content-Length CPU per wire byte (linear)",
        _ => "",
    }
}

/// What a case needs started before its bed (and held until it ends).
#[derive(Default)]
pub struct Prepared {
    pub spec: BedSpec,
    upstream: Option<HostileUpstream>,
    cse: Option<SlowCse>,
}

/// The bed additions of case `n`, and the peers it needs first.
pub fn prepare(n: u8) -> anyhow::Result<Prepared> {
    let mut p = Prepared::default();
    match n {
        1..=3 | 6 | 8..=11 => {}
        4 => p.spec.mqtt_users = true,
        5 => {
            // The cloud takes only the healthy devices' topics from the (anonymous) uplink:
            // everything else is refused with PUBACK 0x87 Not authorized (MQTT 5).
            p.spec.cloud_acl = Some("topic readwrite healthy/#\n".to_string());
        }
        7 => p.spec.coap_extra = "max_observers = 40\n".to_string(),
        12 => {
            let up = HostileUpstream::start().context("starting the hostile upstream")?;
            p.spec.coap_extra = "ack_timeout = \"1s\"\nseparate_after = \"500ms\"\n".to_string();
            p.spec.coap_tables = format!(
                "[[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://{}\"\nprefix = \"cloud\"\n",
                up.addr()
            );
            p.upstream = Some(up);
        }
        13 => {
            let cse = SlowCse::start().context("starting the CSE")?;
            p.spec.cloud_forward = Some("[\"healthy/#\"]".to_string());
            p.spec.extra_uplinks = format!(
                "\n[[uplink]]\nname = \"cse\"\nprotocol = \"onem2m\"\nurl = \"http://{}\"\nallow_plaintext = true\n\
                 cse_id = \"/id-in\"\ncse_name = \"cse-in\"\noriginator = \"Csluice-gw\"\nforward = [\"cse/#\"]\n",
                cse.addr()
            );
            p.cse = Some(cse);
        }
        _ => bail!("no case {n} (cases are 1..=13)"),
    }
    Ok(p)
}

/// What a case gets to work with.
pub struct Ctx<'a> {
    pub s: &'a HostileScenario,
    pub bed: &'a Bed,
    /// sluice's CPU seconds per second with only the healthy devices (the baseline).
    pub baseline_cpu_rate: f64,
}

/// Run case `n`'s attack and judge it.
pub async fn attack(n: u8, ctx: &Ctx<'_>, p: &mut Prepared) -> anyhow::Result<Outcome> {
    let mut o = match n {
        1 => case1(ctx).await,
        2 => case2(ctx).await,
        3 => case3(ctx).await,
        4 => case4(ctx).await,
        5 => case5(ctx).await,
        6 => case6(ctx).await,
        7 => case7(ctx).await,
        8 => case8(ctx).await,
        9 => case9(ctx).await,
        10 => case10(ctx).await,
        11 => case11(ctx).await,
        12 => case12(ctx).await,
        13 => case13(ctx, p.cse.as_ref().context("the CSE")?).await,
        _ => bail!("no case {n}"),
    }?;
    if o.target.is_empty() {
        o.target = target(n).to_string();
    }
    Ok(o)
}

fn tok(i: u64) -> Token {
    Token::from_slice(&(i as u32).to_be_bytes()).unwrap_or(Token::EMPTY)
}

/// Publish `payload` retained on `topic` through sluice (QoS 1, waits for the PUBACK).
async fn retain(bed: &Bed, topic: &str, payload: Bytes) -> anyhow::Result<()> {
    let mut dev = bed.device("hostile-retainer").await?;
    let code = dev
        .publish(topic, payload, QoS::AtLeastOnce, true)
        .await
        .context("publishing the retained message")?;
    anyhow::ensure!(code == 0, "the retained publish got {code:#x}");
    let _ = dev.disconnect().await;
    Ok(())
}

fn mib(kib: i64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// `count` requests made by `make(i, attacker)` spread over `sockets` attacker sockets (on their
/// own addresses: they answer Echo challenges, never acknowledge), paced at `per_second` in
/// total (sluice's per-source limit is 2,000/s with a burst of 500).
async fn spray(
    ctx: &Ctx<'_>,
    traffic: &Arc<Traffic>,
    sockets: usize,
    count: usize,
    per_second: f64,
    make: impl Fn(usize, &Attacker) -> Message,
) -> anyhow::Result<Vec<Attacker>> {
    let mut attackers = Vec::with_capacity(sockets);
    for _ in 0..sockets {
        attackers.push(Attacker::new(ctx.bed.coap, traffic.clone(), SQUATTER).await?);
    }
    let started = Instant::now();
    for i in 0..count {
        let a = &attackers[i % sockets];
        a.send(&make(i, a)).await?;
        if i % 50 == 49 {
            let due = started + Duration::from_secs_f64((i + 1) as f64 / per_second);
            tokio::time::sleep_until(due).await;
        }
    }
    Ok(attackers)
}

fn mtype_text(t: MsgType) -> &'static str {
    match t {
        MsgType::Con => "CON",
        MsgType::Non => "NON",
        MsgType::Ack => "ACK",
        MsgType::Rst => "RST",
    }
}

fn codes(attackers: &[Attacker]) -> String {
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    for a in attackers {
        for g in a.received() {
            *counts.entry(code_text(g.code)).or_default() += 1;
        }
    }
    if counts.is_empty() {
        return "no answer".to_string();
    }
    counts
        .iter()
        .map(|(c, n)| format!("{n} × {c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

// 11 ---------------------------------------------------------------------------------------

async fn case11(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let pid = bed.pid();
    // A SIGHUP ignored by this tool (started under `nohup`) is inherited by sluice: the case
    // would then say nothing about sluice's own handling.
    let sig_ign = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:").map(|v| v.trim().to_string()))
        .and_then(|v| u64::from_str_radix(&v, 16).ok())
        .unwrap_or(0);
    if sig_ign & 1 != 0 {
        bail!("this tool ignores SIGHUP (started under nohup?), and sluice inherits that: run it without nohup");
    }
    let status = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(pid.to_string())
        .status()
        .context("running kill -HUP")?;
    anyhow::ensure!(status.success(), "kill -HUP {pid} failed");
    sleep(Duration::from_secs(2)).await;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let alive = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .is_some_and(|rest| !rest.trim_start().starts_with('Z'));
    let serving = tokio::net::TcpStream::connect(bed.mqtt).await.is_ok();
    Ok(Outcome {
        met: alive && serving,
        observed: vec![format!(
            "2 s after SIGHUP: process {}; device port {}",
            if alive { "alive" } else { "gone" },
            if serving {
                "accepts connections"
            } else {
                "closed"
            }
        )],
        traffic: None,
        target: String::new(),
    })
}
