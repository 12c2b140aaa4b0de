//! The cases of the `hostile` scenario, numbered as the findings of issue 28's table: what the
//! attacker does, what the case observes and its verdict against the target.
//!
//! Owns: each case's bed additions ([`prepare`]), its attack and verdict ([`attack`]). Does not
//! own: the bed, the healthy devices or the RSS/latency figures around the attack (the
//! scenario), the peers ([`super::peers`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use sluice_proto::mqtt::QoS;
use sluice_testkit::phd::{aare_result, AgentSpec, PhdAgent, PhdDevice, Reading};
use tokio::time::{sleep, Instant};

use super::peers::{
    code_text, request, Attacker, BodyMode, HostileUpstream, SlowCse, Traffic, BIG_PAYLOAD,
    CSE_BODY, SLOW_PAYLOAD,
};
use super::{Bed, BedSpec, HostileScenario, Outcome, AMPLIFICATION};

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
        8 => "a legitimate block-wise publish answered 2.04",
        10 => "RSS per agent ≤ normal + 64 KiB, status ≤ 2× control + 64 KiB",
        11 => "process alive and serving after SIGHUP",
        12 => "bytes out ≤ 3× bytes in (unverified source)",
        13 => "chunked CPU ≤ 2× Content-Length CPU + 50 ms",
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

/// `count` requests made by `make(i, attacker)` spread over `sockets` attacker sockets, paced at
/// `per_second` in total (sluice's per-source limit is 2,000/s with a burst of 500).
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
        attackers.push(Attacker::new(ctx.bed.coap, traffic.clone(), false).await?);
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

// 1 ----------------------------------------------------------------------------------------

async fn case1(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    retain(ctx.bed, "big", Bytes::from(vec![b'R'; 60_000])).await?;
    let traffic = Arc::new(Traffic::default());
    let a = Attacker::new(ctx.bed.coap, traffic.clone(), false).await?;
    let req = request(MsgType::Non, Code::GET, a.mid(), tok(1), &[b"ps", b"big"]);
    let size = a.send(&req).await?;
    let answer = a.wait_for(Duration::from_secs(2), |_| true).await;
    sleep(Duration::from_millis(500)).await;
    let t = traffic.snapshot();
    let mut observed = vec![format!(
        "request {size} B (NON GET /ps/big, 4-byte token); answers: {}",
        codes(std::slice::from_ref(&a))
    )];
    if let Some(g) = answer {
        observed.push(format!(
            "first answer {} {} B in one datagram ({:.0}× the request)",
            code_text(g.code),
            g.len,
            g.len as f64 / size as f64
        ));
    }
    Ok(Outcome {
        met: t.bytes_out as f64 <= AMPLIFICATION * t.bytes_in as f64,
        traffic: Some(t),
        observed,
        target: String::new(),
    })
}

// 2 ----------------------------------------------------------------------------------------

async fn case2(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    retain(bed, "big", Bytes::from(vec![b'R'; 60_000])).await?;
    retain(bed, "small", Bytes::from_static(b"21.5")).await?;
    let n = 4000;
    let get = |topic: &'static [u8]| {
        move |i: usize, a: &Attacker| {
            request(MsgType::Con, Code::GET, a.mid(), tok(i as u64), &[b"ps", topic])
        }
    };
    let rss0 = bed.rss();
    let control_traffic = Arc::new(Traffic::default());
    let control = spray(ctx, &control_traffic, 8, n, 2000.0, get(b"small")).await?;
    sleep(Duration::from_secs(2)).await;
    let rss1 = bed.rss();
    let traffic = Arc::new(Traffic::default());
    let hostile = spray(ctx, &traffic, 8, n, 2000.0, get(b"big")).await?;
    sleep(Duration::from_secs(2)).await;
    let rss2 = bed.rss();
    let (control_growth, growth) = (rss1 as i64 - rss0 as i64, rss2 as i64 - rss1 as i64);
    let t = traffic.snapshot();
    Ok(Outcome {
        met: growth <= control_growth + ctx.s.rss_bound_kib as i64,
        observed: vec![
            format!(
                "control: {n} CON GETs of a 4-byte retained topic: RSS +{}; answers {}",
                mib(control_growth),
                codes(&control)
            ),
            format!(
                "hostile: {n} CON GETs of the 60,000-byte retained topic from 8 sources: RSS +{}; answers {}; {} B received by the attacker",
                mib(growth),
                codes(&hostile),
                t.bytes_out
            ),
        ],
        traffic: Some(t),
        target: format!(
            "RSS growth ≤ control + {}",
            mib(ctx.s.rss_bound_kib as i64)
        ),
    })
}

// 3 ----------------------------------------------------------------------------------------

async fn case3(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let n = 300;
    let rss0 = bed.rss();
    let control_traffic = Arc::new(Traffic::default());
    let control = spray(ctx, &control_traffic, 10, n, 500.0, |i, a| {
        let mut m = Message::new(MsgType::Con, Code::GET, a.mid(), tok(i as u64));
        m.add_uint_option(opt::OBSERVE, 0);
        for seg in [&b"ps"[..], b"obs", format!("{i}").as_bytes()] {
            m.add_option(opt::URI_PATH, Bytes::copy_from_slice(seg));
        }
        m
    })
    .await?;
    sleep(Duration::from_secs(2)).await;
    let rss1 = bed.rss();
    let traffic = Arc::new(Traffic::default());
    let hostile = spray(ctx, &traffic, 10, n, 500.0, |i, a| {
        let mut m = Message::new(MsgType::Con, Code::GET, a.mid(), tok(i as u64));
        m.add_uint_option(opt::OBSERVE, 0);
        // A distinct first level per observer, so no two filters share a path.
        m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
        m.add_option(opt::URI_PATH, Bytes::from(format!("{i}")));
        for _ in 0..1099 {
            m.add_option(opt::URI_PATH, Bytes::new());
        }
        m
    })
    .await?;
    sleep(Duration::from_secs(2)).await;
    let rss2 = bed.rss();
    let (control_growth, growth) = (rss1 as i64 - rss0 as i64, rss2 as i64 - rss1 as i64);
    let t = traffic.snapshot();
    let admitted = |xs: &[Attacker]| {
        xs.iter()
            .flat_map(|a| a.received())
            .filter(|g| g.observe.is_some())
            .count()
    };
    Ok(Outcome {
        met: growth <= control_growth + ctx.s.rss_bound_kib as i64,
        observed: vec![
            format!(
                "control: {n} Observes of ps/obs/{{i}}: RSS +{}; {} admitted (answers {})",
                mib(control_growth),
                admitted(&control),
                codes(&control)
            ),
            format!(
                "hostile: {n} Observes of ps/{{i}} + 1,099 empty segments (≤ {} B each): RSS +{} ({:.0} KiB per observer); {} admitted (answers {})",
                t.largest_in,
                mib(growth),
                growth as f64 / n as f64,
                admitted(&hostile),
                codes(&hostile)
            ),
        ],
        traffic: Some(t),
        target: format!(
            "RSS growth ≤ control + {}",
            mib(ctx.s.rss_bound_kib as i64)
        ),
    })
}

// 4 ----------------------------------------------------------------------------------------

async fn case4(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let traffic = Arc::new(Traffic::default());
    let spy = Attacker::new(bed.coap, traffic.clone(), true).await?;
    let mut obs = Message::new(MsgType::Con, Code::GET, spy.mid(), tok(4));
    obs.add_uint_option(opt::OBSERVE, 0);
    obs.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
    obs.add_option(opt::URI_PATH, Bytes::from_static(b"#"));
    spy.send(&obs).await?;
    let first = spy
        .wait_for(Duration::from_secs(2), |g| g.token == tok(4))
        .await;
    let mut subscriber = bed.device("sensor-sub").await?;
    subscriber.subscribe(&[("cmd/#", QoS::AtLeastOnce)]).await?;
    let mut sensor = bed.device("sensor-1").await?;
    for i in 0..5 {
        sensor
            .publish(
                "secret/sensor-1/temp",
                format!("secret-reading-{i}"),
                QoS::AtLeastOnce,
                false,
            )
            .await?;
    }
    sleep(Duration::from_secs(2)).await;
    let got = spy.received();
    let secrets = got
        .iter()
        .filter(|g| g.payload.windows(14).any(|w| w == b"secret-reading"))
        .count();
    let notifications = got.iter().filter(|g| g.observe.is_some()).count();
    // The anonymous publish of a retained command.
    let intruder = Attacker::new(bed.coap, traffic.clone(), false).await?;
    let mut post = request(
        MsgType::Con,
        Code::POST,
        intruder.mid(),
        tok(44),
        &[b"ps", b"cmd", b"sensor-1"],
    );
    post.add_option(opt::URI_QUERY, Bytes::from_static(b"retain=true"));
    post.payload = Bytes::from_static(b"hostile-command");
    intruder.send(&post).await?;
    let answer = intruder
        .wait_for(Duration::from_secs(3), |g| g.token == tok(44))
        .await;
    let mut live = 0;
    while let Some(p) = subscriber.recv(Duration::from_secs(2)).await? {
        if &p.payload[..] == b"hostile-command" {
            live += 1;
        }
    }
    let mut later = bed.device("sensor-late").await?;
    later.subscribe(&[("cmd/#", QoS::AtLeastOnce)]).await?;
    let mut retained = 0;
    while let Some(p) = later.recv(Duration::from_secs(2)).await? {
        if &p.payload[..] == b"hostile-command" {
            retained += 1;
        }
    }
    let t = traffic.snapshot();
    Ok(Outcome {
        met: secrets == 0 && live == 0 && retained == 0,
        observed: vec![
            format!(
                "anonymous Observe of ps/# answered {}; it then received {notifications} notifications, {secrets} of the 5 messages the authenticated device sensor-1 published",
                first
                    .map(|g| format!("{}{}", code_text(g.code), if g.observe.is_some() { " with Observe" } else { "" }))
                    .unwrap_or_else(|| "nothing".to_string())
            ),
            format!(
                "anonymous POST ps/cmd/sensor-1?retain=true answered {}; the authenticated subscriber to cmd/# received it {live} time(s), a later authenticated subscriber {retained} time(s) (retained)",
                answer.map(|g| code_text(g.code)).unwrap_or_else(|| "nothing".to_string())
            ),
        ],
        traffic: Some(t),
        target: String::new(),
    })
}

// 5 ----------------------------------------------------------------------------------------

fn glucose() -> Reading {
    Reading::Glucose { mg_dl: (105, 0) }
}

const CLOCK: [u8; 8] = [0x20, 0x26, 0x11, 0x27, 0x08, 0x00, 0x00, 0x00];

async fn case5(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let spec = AgentSpec {
        system_id: 0x0DA7_A000_0000_0005u64.to_be_bytes(),
        ..AgentSpec::new(PhdDevice::Glucometer)
    };
    let mut agent = PhdAgent::connect(bed.phd, spec).await?;
    let assoc = agent.associate().await?;
    anyhow::ensure!(
        assoc.aare_result == aare_result::ACCEPTED,
        "association refused: {:?}",
        assoc
    );
    let confirmed = agent
        .report(&glucose(), CLOCK, Duration::from_secs(5))
        .await;
    sleep(Duration::from_millis(500)).await;
    let denied = bed.cloud.log().matches("Denied PUBLISH").count();
    let refused = crate::harness::metrics::metric_sum(
        &bed.metrics().await,
        "sluice_uplink_cloud_rejected_total",
    );
    let (met, what) = match &confirmed {
        Ok(Some(d)) => (false, format!("CONFIRMED to the agent after {:.1} ms (the agent now discards the measurement)", d.as_secs_f64() * 1e3)),
        Ok(None) => (false, "sent unconfirmed (no confirmation expected)".to_string()),
        Err(e) => (true, format!("not confirmed: {e:#}")),
    };
    Ok(Outcome {
        met,
        observed: vec![
            format!("glucometer report (confirmed) → sluice → cloud; the cloud's ACL refused {denied} PUBLISH(es) from the uplink (Mosquitto log \"Denied PUBLISH\"); sluice_uplink_cloud_rejected_total = {}", refused.map_or("–".to_string(), |v| v.to_string())),
            format!("the report was {what}"),
        ],
        traffic: None,
        target: String::new(),
    })
}

// 6 ----------------------------------------------------------------------------------------

async fn case6(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let system_id: u64 = 0x1122_3344_5566_7788;
    let hex = format!("{system_id:016x}");
    let mut cloud = bed.cloud_client("operator-6").await?;
    cloud
        .subscribe(&[(&format!("phd/{hex}/#"), QoS::AtLeastOnce)])
        .await?;
    // The impostor: the oximeter's system id and extended config id 0x4000, but a glucometer's
    // object table (handle 1 = glucose).
    let impostor = AgentSpec {
        system_id: system_id.to_be_bytes(),
        config_id: 0x4000,
        ..AgentSpec::new(PhdDevice::Glucometer)
    };
    let mut a = PhdAgent::connect(bed.phd, impostor).await?;
    let taught = a.associate().await?;
    let _ = a.release().await;
    drop(a);
    // The genuine pulse oximeter with the same system id and config id.
    let genuine = AgentSpec {
        system_id: system_id.to_be_bytes(),
        config_id: 0x4000,
        ..AgentSpec::new(PhdDevice::PulseOximeter)
    };
    let mut g = PhdAgent::connect(bed.phd, genuine).await?;
    let assoc = g.associate().await;
    let report = match &assoc {
        Ok(x) if x.aare_result == aare_result::ACCEPTED
            || x.config_result == Some(0) =>
        {
            Some(
                g.report(
                    &Reading::Oximeter {
                        spo2: (98, 0),
                        pulse: (72, 0),
                    },
                    CLOCK,
                    Duration::from_secs(5),
                )
                .await,
            )
        }
        _ => None,
    };
    let mut topics = Vec::new();
    while let Some(p) = cloud.recv(Duration::from_secs(2)).await? {
        topics.push(format!(
            "{} {}",
            p.topic,
            String::from_utf8_lossy(&p.payload).chars().take(120).collect::<String>()
        ));
    }
    let mislabelled = topics
        .iter()
        .filter(|t| !(t.contains("/spo2 ") || t.contains("/pulse ")))
        .count();
    Ok(Outcome {
        met: mislabelled == 0,
        observed: vec![
            format!(
                "impostor (system id {hex}, config 0x4000, glucometer table): AARE {}, config result {:?}",
                taught.aare_result, taught.config_result
            ),
            format!(
                "genuine oximeter (same id and config): association {}; its SpO2 98 % / pulse 72 report {}",
                match &assoc {
                    Ok(x) => format!("AARE {} config result {:?}", x.aare_result, x.config_result),
                    Err(e) => format!("failed: {e:#}"),
                },
                match &report {
                    Some(Ok(Some(_))) => "confirmed".to_string(),
                    Some(Ok(None)) => "sent".to_string(),
                    Some(Err(e)) => format!("failed: {e:#}"),
                    None => "not sent (not associated)".to_string(),
                }
            ),
            format!(
                "the cloud received {} message(s) for {hex}, {mislabelled} not spo2/pulse: {}",
                topics.len(),
                if topics.is_empty() { "none".to_string() } else { topics.join(" | ") }
            ),
        ],
        traffic: None,
        target: String::new(),
    })
}

// 7 ----------------------------------------------------------------------------------------

/// Fresh sources tried at most (cases 7, 8).
const MAX_SOURCES: u64 = 200;
/// Sources refused in a row that say every shard's share is full (cases 7, 8): a source lands
/// on a shard with room with probability ≥ 1/2 per try while one has room.
const REFUSED_IN_A_ROW: usize = 8;

fn observe(a: &Attacker, t: Token, mtype: MsgType, path: &[&[u8]]) -> Message {
    let mut m = request(mtype, Code::GET, a.mid(), t, path);
    m.add_uint_option(opt::OBSERVE, 0);
    m
}

async fn case7(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let traffic = Arc::new(Traffic::default());
    // One NON Observe per fresh source until REFUSED_IN_A_ROW in a row are not admitted: the
    // observer table may be split over the shards (SO_REUSEPORT picks the shard by source), so
    // a fixed 40 may leave one shard room; this fills every shard's share.
    let mut squatters = Vec::new();
    let mut refused_in_a_row = 0;
    let mut admitted = 0;
    for i in 0..MAX_SOURCES {
        if refused_in_a_row >= REFUSED_IN_A_ROW {
            break;
        }
        let a = Attacker::new(bed.coap, traffic.clone(), false).await?;
        a.send(&observe(&a, tok(i), MsgType::Non, &[b"ps", b"obs"]))
            .await?;
        let answer = a.wait_for(Duration::from_secs(1), |g| g.token == tok(i)).await;
        if answer.is_some_and(|g| g.observe.is_some()) {
            admitted += 1;
            refused_in_a_row = 0;
        } else {
            refused_in_a_row += 1;
        }
        squatters.push(a);
    }
    let sent = squatters.len();
    // Notifications flow to the squatters meanwhile (QoS 1 publishes every 500 ms).
    let mut publisher = bed.device("obs-publisher").await?;
    let legit_traffic = Arc::new(Traffic::default());
    let legit = Attacker::new(bed.coap, legit_traffic, true).await?;
    let started = Instant::now();
    let mut attempts = 0u32;
    let mut admitted_after = None;
    let mut first_refusal = String::new();
    let mut next_try = Instant::now();
    let mut seq = 0u64;
    while started.elapsed() < ctx.s.expiry_wait + Duration::from_secs(1) {
        publisher
            .publish("obs", format!("reading {seq}"), QoS::AtLeastOnce, false)
            .await?;
        seq += 1;
        if Instant::now() >= next_try {
            attempts += 1;
            let t = tok(1000 + u64::from(attempts));
            legit
                .send(&observe(&legit, t, MsgType::Con, &[b"ps", b"obs"]))
                .await?;
            if let Some(g) = legit.wait_for(Duration::from_secs(2), |g| g.token == t).await {
                if g.observe.is_some() {
                    admitted_after = Some(started.elapsed());
                    break;
                }
                if first_refusal.is_empty() {
                    first_refusal = format!("{} without Observe", code_text(g.code));
                    if g.code != Code::CONTENT {
                        first_refusal = code_text(g.code);
                    }
                }
            } else if first_refusal.is_empty() {
                first_refusal = "no answer".to_string();
            }
            next_try = Instant::now() + Duration::from_secs(5);
        }
        sleep(Duration::from_millis(500)).await;
    }
    let notified = squatters.iter().map(|a| a.count()).sum::<usize>();
    let t = traffic.snapshot();
    Ok(Outcome {
        met: admitted_after.is_some_and(|d| d <= ctx.s.expiry_wait),
        observed: vec![
            format!("NON Observes of ps/obs, one per fresh source (never answering), until {REFUSED_IN_A_ROW} in a row were refused: {sent} sent, {admitted} admitted; {notified} datagrams sent to them in all"),
            match admitted_after {
                Some(d) => format!(
                    "a legitimate CON observer (ACKing) was admitted after {:.1} s ({attempts} attempt(s), 5 s apart; first refusal: {})",
                    d.as_secs_f64(),
                    if first_refusal.is_empty() { "none" } else { &first_refusal }
                ),
                None => format!(
                    "a legitimate CON observer was refused for {:.0} s ({attempts} attempts, 5 s apart: {first_refusal}) while ps/obs got a publish every 500 ms",
                    started.elapsed().as_secs_f64()
                ),
            },
        ],
        traffic: Some(t),
        target: format!(
            "a legitimate observer admitted within {:.0} s",
            ctx.s.expiry_wait.as_secs_f64()
        ),
    })
}

// 8 ----------------------------------------------------------------------------------------

/// Block1 option value: NUM, M, SZX (RFC 7959 §2.2).
fn block1(num: u32, more: bool, szx: u32) -> u32 {
    num << 4 | u32::from(more) << 3 | szx
}

async fn case8(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let traffic = Arc::new(Traffic::default());
    // Each fresh source sends PER_SOURCE block-0s at once, until REFUSED_IN_A_ROW sources in a
    // row got no 2.31 (the slots may be split over the shards, which pick by source).
    const PER_SOURCE: usize = 50;
    let mut attackers: Vec<Attacker> = Vec::new();
    let mut refused_in_a_row = 0;
    let mut n = 0usize;
    for src in 0..MAX_SOURCES as usize {
        if refused_in_a_row >= REFUSED_IN_A_ROW {
            break;
        }
        let a = Attacker::new(bed.coap, traffic.clone(), false).await?;
        for k in 0..PER_SOURCE {
            let i = src * PER_SOURCE + k;
            let mut m = request(
                MsgType::Con,
                Code::POST,
                a.mid(),
                tok(i as u64),
                &[b"ps", b"blk", format!("{i}").as_bytes()],
            );
            m.add_uint_option(opt::BLOCK1, block1(0, true, 6));
            m.payload = Bytes::from(vec![b'b'; 1024]);
            a.send(&m).await?;
            n += 1;
        }
        let last = tok((src * PER_SOURCE + PER_SOURCE - 1) as u64);
        let _ = a.wait_for(Duration::from_secs(2), |g| g.token == last).await;
        if a.received().iter().any(|g| g.code == Code::CONTINUE) {
            refused_in_a_row = 0;
        } else {
            refused_in_a_row += 1;
        }
        attackers.push(a);
    }
    sleep(Duration::from_millis(500)).await;
    let held = attackers
        .iter()
        .flat_map(|a| a.received())
        .filter(|g| g.code == Code::CONTINUE)
        .count();
    let rss_held = bed.rss();
    // A legitimate block-wise publish: two 64-byte blocks.
    let legit = Attacker::new(bed.coap, Arc::new(Traffic::default()), true).await?;
    let t0 = tok(800_000);
    let mut b0 = request(MsgType::Con, Code::POST, legit.mid(), t0, &[b"ps", b"legit", b"blockwise"]);
    b0.add_uint_option(opt::BLOCK1, block1(0, true, 2));
    b0.payload = Bytes::from(vec![b'l'; 64]);
    legit.send(&b0).await?;
    let first = legit
        .wait_for(Duration::from_secs(3), |g| g.token == t0 && g.mtype != MsgType::Con)
        .await;
    let mut outcome = first
        .as_ref()
        .map(|g| code_text(g.code))
        .unwrap_or_else(|| "nothing".to_string());
    let mut met = false;
    if first.as_ref().is_some_and(|g| g.code == Code::CONTINUE) {
        let t1 = tok(800_001);
        let mut b1 = request(MsgType::Con, Code::POST, legit.mid(), t1, &[b"ps", b"legit", b"blockwise"]);
        b1.add_uint_option(opt::BLOCK1, block1(1, false, 2));
        b1.payload = Bytes::from_static(b"end");
        legit.send(&b1).await?;
        let last = legit
            .wait_for(Duration::from_secs(5), |g| g.token == t1 && g.code != Code::EMPTY)
            .await;
        let c = last.map(|g| g.code);
        met = c == Some(Code::CHANGED);
        outcome = format!(
            "{outcome} then {}",
            c.map(code_text).unwrap_or_else(|| "nothing".to_string())
        );
    }
    let t = traffic.snapshot();
    Ok(Outcome {
        met,
        observed: vec![
            format!(
                "{n} CON POSTs with Block1 0/M=1 (1 KiB), {PER_SOURCE} per fresh source until {REFUSED_IN_A_ROW} sources in a row got no 2.31 ({} sources), never continued: {held} answered 2.31 Continue (slots taken); answers {}; RSS {} with them held",
                attackers.len(),
                codes(&attackers),
                mib(rss_held as i64)
            ),
            format!("then a legitimate 2-block publish: {outcome}"),
        ],
        traffic: Some(t),
        target: String::new(),
    })
}

// 9 ----------------------------------------------------------------------------------------

async fn case9(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let traffic = Arc::new(Traffic::default());
    let a = Attacker::new(ctx.bed.coap, traffic.clone(), false).await?;
    // Within max_topic_length (1 KiB), and invalid (a '#' in a topic name), so it is refused
    // with the name in the diagnostic.
    let mut topic = vec![0x01u8; 1000];
    topic.push(b'#');
    let mut m = request(MsgType::Con, Code::POST, a.mid(), tok(9), &[b"ps", &topic]);
    m.payload = Bytes::from(vec![b'x'; 77]);
    let size = a.send(&m).await?;
    // The final answer may come as a separate response after an empty ACK (QoS 1: after the
    // cloud); the attacker never acknowledges it, so it is counted once.
    let answer = a
        .wait_for(Duration::from_secs(10), |g| g.token == tok(9) && g.code != Code::EMPTY)
        .await;
    sleep(Duration::from_millis(500)).await;
    let t = traffic.snapshot();
    let seen = a
        .received()
        .iter()
        .map(|g| format!("{} {} {} B", mtype_text(g.mtype), code_text(g.code), g.len))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Outcome {
        met: t.bytes_out as f64 <= AMPLIFICATION * t.bytes_in as f64,
        observed: vec![
            format!(
                "CON POST /ps/<1,000 × 0x01>#, 77 B payload ({size} B): final answer {}",
                answer
                    .as_ref()
                    .map(|g| format!("{} {} B", code_text(g.code), g.len))
                    .unwrap_or_else(|| "none within 10 s".to_string())
            ),
            format!("datagrams back: {seen}"),
            format!(
                "answer payload starts {:?}",
                answer
                    .map(|g| String::from_utf8_lossy(&g.payload).chars().take(80).collect::<String>())
                    .unwrap_or_default()
            ),
        ],
        traffic: Some(t),
        target: String::new(),
    })
}

// 10 ---------------------------------------------------------------------------------------

/// A GET response (rors-cmip-get on the MDS) carrying only System-Model with `model`.
fn model_response(invoke_id: u16, model: &[u8]) -> Vec<u8> {
    let manufacturer = b"TheCompany";
    let mut value = Vec::new();
    value.extend_from_slice(&(manufacturer.len() as u16).to_be_bytes());
    value.extend_from_slice(manufacturer);
    let padded = model.len() + model.len() % 2;
    value.extend_from_slice(&(padded as u16).to_be_bytes());
    value.extend_from_slice(model);
    if model.len() % 2 == 1 {
        value.push(0);
    }
    let mut list = Vec::new();
    list.extend_from_slice(&0x0928u16.to_be_bytes()); // MDC_ATTR_ID_MODEL
    list.extend_from_slice(&(value.len() as u16).to_be_bytes());
    list.extend_from_slice(&value);
    let mut body = Vec::new();
    body.extend_from_slice(&0u16.to_be_bytes()); // obj-handle: the MDS
    body.extend_from_slice(&1u16.to_be_bytes()); // count
    body.extend_from_slice(&(list.len() as u16).to_be_bytes());
    body.extend_from_slice(&list);
    let mut data = Vec::new();
    data.extend_from_slice(&invoke_id.to_be_bytes());
    data.extend_from_slice(&0x0203u16.to_be_bytes()); // rors-cmip-get
    data.extend_from_slice(&(body.len() as u16).to_be_bytes());
    data.extend_from_slice(&body);
    let mut apdu = Vec::new();
    apdu.extend_from_slice(&0xE700u16.to_be_bytes());
    apdu.extend_from_slice(&((data.len() + 2) as u16).to_be_bytes());
    apdu.extend_from_slice(&(data.len() as u16).to_be_bytes());
    apdu.extend_from_slice(&data);
    apdu
}

/// `count` glucometers associated and held; with `model`, each answers the manager's MDS GET
/// with that System-Model instead of the standard one.
async fn agents(
    bed: &Bed,
    base: u64,
    count: u32,
    model: Option<Arc<Vec<u8>>>,
) -> anyhow::Result<Vec<PhdAgent>> {
    let mut set = tokio::task::JoinSet::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(16));
    for i in 0..count {
        let (addr, model, slots) = (bed.phd, model.clone(), slots.clone());
        set.spawn(async move {
            let _slot = slots.acquire().await;
            let spec = AgentSpec {
                system_id: (base + u64::from(i)).to_be_bytes(),
                ..AgentSpec::new(PhdDevice::Glucometer)
            };
            let mut a = PhdAgent::connect(addr, spec).await?;
            if model.is_some() {
                a.set_answer_gets(false);
            }
            let r = a.associate().await?;
            anyhow::ensure!(r.aare_result == aare_result::ACCEPTED, "AARE {}", r.aare_result);
            if let Some(model) = model {
                let get = a
                    .read_apdu(Duration::from_secs(5))
                    .await?
                    .context("closed before the MDS GET")?;
                anyhow::ensure!(
                    get.len() >= 10 && get[8..10] == [0x01, 0x03],
                    "expected the MDS GET, got {:02x?}",
                    &get[..get.len().min(12)]
                );
                let invoke = u16::from_be_bytes([get[6], get[7]]);
                a.send_raw(&model_response(invoke, &model)).await?;
            }
            Ok::<_, anyhow::Error>(a)
        });
    }
    let mut out = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(a)) => out.push(a),
            Ok(Err(e)) => {
                errors += 1;
                first_error.get_or_insert(format!("{e:#}"));
            }
            Err(e) => bail!("an agent task panicked: {e}"),
        }
    }
    if errors > 0 && out.is_empty() {
        bail!("no agent associated: {}", first_error.unwrap_or_default());
    }
    if errors > 0 {
        tracing::warn!(errors, first = ?first_error, "some agents failed");
    }
    Ok(out)
}

/// A connection may hold one APDU of `[phd] max_apdu` (64 KiB by default).
const APDU_KIB: f64 = 64.0;

async fn case10(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let n = 200;
    let (status0, _) = bed.status().await?;
    let rss0 = bed.rss();
    let control = agents(bed, 0x0C0F_0000_0000_0000, n, None).await?;
    sleep(Duration::from_secs(2)).await;
    let rss1 = bed.rss();
    let (status1, took1) = bed.status().await?;
    let model = Arc::new(vec![b'M'; 64_000]);
    let hostile = agents(bed, 0x0BAD_0000_0000_0000, n, Some(model)).await?;
    sleep(Duration::from_secs(2)).await;
    let rss2 = bed.rss();
    let (status2, took2) = bed.status().await?;
    let (control_growth, growth) = (rss1 as i64 - rss0 as i64, rss2 as i64 - rss1 as i64);
    let control_status = status1.saturating_sub(status0);
    let status_ok = status2.saturating_sub(status1) <= 2 * control_status + 64 * 1024;
    // Per hostile agent: what a normal agent costs plus one max_apdu read buffer (64 KiB).
    let per_control = control_growth.max(0) as f64 / control.len().max(1) as f64;
    let allowed = (per_control + APDU_KIB) * hostile.len() as f64;
    let out = Outcome {
        met: (growth as f64) <= allowed && status_ok,
        observed: vec![
            format!(
                "control: {} glucometers with the standard model: RSS +{} ({:.1} KiB each); /api/v1/status {status1} B ({:.1} ms)",
                control.len(),
                mib(control_growth),
                control_growth as f64 / control.len().max(1) as f64,
                took1.as_secs_f64() * 1e3
            ),
            format!(
                "hostile: {} more answering the MDS GET with a 64,000-byte System-Model: RSS +{} ({:.1} KiB each); /api/v1/status {status2} B ({:.1} ms)",
                hostile.len(),
                mib(growth),
                growth as f64 / hostile.len().max(1) as f64,
                took2.as_secs_f64() * 1e3
            ),
        ],
        traffic: None,
        target: format!(
            "RSS growth per agent ≤ a normal agent's + {APDU_KIB} KiB (one max_apdu buffer), status growth ≤ 2× control's + 64 KiB"
        ),
    };
    drop(control);
    drop(hostile);
    Ok(out)
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
            if serving { "accepts connections" } else { "closed" }
        )],
        traffic: None,
        target: String::new(),
    })
}

// 12 ---------------------------------------------------------------------------------------

async fn case12(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let traffic = Arc::new(Traffic::default());
    // (a) a 65,000-byte upstream answer, NON and CON, to sources that never proved anything.
    let a = Attacker::new(bed.coap, traffic.clone(), false).await?;
    let non = request(MsgType::Non, Code::GET, a.mid(), tok(120), &[b"cloud", b"big"]);
    let non_size = a.send(&non).await?;
    let non_answer = a.wait_for(Duration::from_secs(3), |g| g.token == tok(120)).await;
    let con = request(MsgType::Con, Code::GET, a.mid(), tok(121), &[b"cloud", b"big"]);
    a.send(&con).await?;
    let con_answer = a.wait_for(Duration::from_secs(3), |g| g.token == tok(121)).await;
    // (b) a late answer: sluice sends an empty ACK, then the response as a separate CON that
    // the source never acknowledges.
    let b = Attacker::new(bed.coap, traffic.clone(), false).await?;
    let slow = request(MsgType::Con, Code::GET, b.mid(), tok(122), &[b"cloud", b"slow"]);
    let slow_size = b.send(&slow).await?;
    // ack_timeout 1 s × up to 1.5, doubled 4 times: the last copy ≤ 22.5 s after the first.
    sleep(Duration::from_secs(26)).await;
    let copies = b
        .received()
        .iter()
        .filter(|g| g.token == tok(122) && g.code != Code::EMPTY)
        .count();
    let empties = b.received().iter().filter(|g| g.code == Code::EMPTY).count();
    let b_bytes: usize = b.received().iter().map(|g| g.len).sum();
    let t = traffic.snapshot();
    let show = |g: Option<super::peers::Got>| {
        g.map(|g| format!("{} in one {}-byte datagram", code_text(g.code), g.len))
            .unwrap_or_else(|| "nothing".to_string())
    };
    Ok(Outcome {
        met: t.bytes_out as f64 <= AMPLIFICATION * t.bytes_in as f64,
        observed: vec![
            format!(
                "NON GET /cloud/big ({non_size} B) to sluice's [[coap.proxy]], upstream answering {BIG_PAYLOAD} B: {}",
                show(non_answer)
            ),
            format!("CON GET /cloud/big: {}", show(con_answer)),
            format!(
                "CON GET /cloud/slow ({slow_size} B), upstream answering {SLOW_PAYLOAD} B after 1.5 s, never acknowledged: {empties} empty ACK(s), {copies} copies of the separate response ({b_bytes} B in all, {:.1}× the request)",
                b_bytes as f64 / slow_size as f64
            ),
        ],
        traffic: Some(t),
        target: String::new(),
    })
}

// 13 ---------------------------------------------------------------------------------------

async fn case13(ctx: &Ctx<'_>, cse: &SlowCse) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let deadline = Instant::now() + Duration::from_secs(15);
    while cse.requests() == 0 {
        if Instant::now() >= deadline {
            bail!("sluice never registered with the CSE");
        }
        sleep(Duration::from_millis(100)).await;
    }
    let mut dev = bed.device("cse-device").await?;
    let messages = 10;
    // Warm-up: containers created, one instance answered.
    let code = dev
        .publish("cse/dev/t", Bytes::from_static(b"21.5"), QoS::AtLeastOnce, false)
        .await?;
    anyhow::ensure!(code == 0, "the warm-up publish got {code:#x}");
    let (cpu_len, wall_len, wire_len) =
        cse_phase(ctx, cse, &mut dev, BodyMode::Length, messages).await?;
    let (cpu_chunk, wall_chunk, wire_chunk) =
        cse_phase(ctx, cse, &mut dev, BodyMode::Chunked, messages).await?;
    Ok(Outcome {
        met: cpu_chunk <= 2.0 * cpu_len + 0.05,
        observed: vec![
            format!(
                "{messages} contentInstances, each answered with a {CSE_BODY}-byte body in 1,500-byte writes 200 µs apart; sluice CPU above its baseline rate ({:.1} % of a core):",
                ctx.baseline_cpu_rate * 100.0
            ),
            format!(
                "Content-Length: {:.1} ms CPU ({:.2} ms per response), {wire_len} B, {wall_len:.2} s",
                cpu_len * 1e3,
                cpu_len * 1e3 / f64::from(messages)
            ),
            format!(
                "chunked, 1 byte per chunk: {:.1} ms CPU ({:.2} ms per response), {wire_chunk} B, {wall_chunk:.2} s",
                cpu_chunk * 1e3,
                cpu_chunk * 1e3 / f64::from(messages)
            ),
        ],
        traffic: None,
        target: String::new(),
    })
}

/// `messages` QoS 1 publishes to the CSE with its bodies in `mode`: (sluice CPU seconds above
/// the baseline rate, wall seconds, response bytes written).
async fn cse_phase(
    ctx: &Ctx<'_>,
    cse: &SlowCse,
    dev: &mut sluice_testkit::TestClient,
    mode: BodyMode,
    messages: u32,
) -> anyhow::Result<(f64, f64, u64)> {
    cse.set_mode(mode);
    let wire0 = cse.wire_bytes();
    let cpu0 = ctx.bed.cpu_seconds();
    let t0 = Instant::now();
    for i in 0..messages {
        let code = dev
            .publish("cse/dev/t", format!("{i}"), QoS::AtLeastOnce, false)
            .await?;
        anyhow::ensure!(code == 0, "publish {i} got {code:#x}");
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = ctx.bed.cpu_seconds() - cpu0 - ctx.baseline_cpu_rate * wall;
    Ok((cpu.max(0.0), wall, cse.wire_bytes() - wire0))
}
