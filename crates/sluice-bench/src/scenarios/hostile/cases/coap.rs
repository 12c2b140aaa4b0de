//! The CoAP edge's cases (1–4, 7–9): reflection and amplification by GET, the de-duplication
//! table, Observe filters, anonymous access, observer and Block1 slots, escaped diagnostics.
//!
//! Owns: those attacks and their verdicts. Does not own: the attacker sockets
//! ([`super::super::peers`]), the bed or the figures around the attack.

use super::*;

// 1 ----------------------------------------------------------------------------------------

pub(super) async fn case1(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    retain(ctx.bed, "big", Bytes::from(vec![b'R'; 60_000])).await?;
    let traffic = Arc::new(Traffic::default());
    let a = Attacker::new(ctx.bed.coap, traffic.clone(), SPOOFED).await?;
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

pub(super) async fn case2(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    retain(bed, "big", Bytes::from(vec![b'R'; 60_000])).await?;
    retain(bed, "small", Bytes::from_static(b"21.5")).await?;
    let n = 4000;
    let get = |topic: &'static [u8]| {
        move |i: usize, a: &Attacker| {
            request(
                MsgType::Con,
                Code::GET,
                a.mid(),
                tok(i as u64),
                &[b"ps", topic],
            )
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

pub(super) async fn case3(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
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

pub(super) async fn case4(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let traffic = Arc::new(Traffic::default());
    let spy = Attacker::new(bed.coap, traffic.clone(), CLIENT).await?;
    let mut obs = Message::new(MsgType::Con, Code::GET, spy.mid(), tok(4));
    obs.add_uint_option(opt::OBSERVE, 0);
    obs.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
    obs.add_option(opt::URI_PATH, Bytes::from_static(b"#"));
    spy.send(&obs).await?;
    let first = spy
        .wait_for(Duration::from_secs(2), |g| g.answers(tok(4)))
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
    let intruder = Attacker::new(bed.coap, traffic.clone(), CLIENT).await?;
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
        .wait_for(Duration::from_secs(3), |g| g.answers(tok(44)))
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

pub(super) async fn case7(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
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
        let a = Attacker::new(bed.coap, traffic.clone(), SQUATTER).await?;
        a.send(&observe(&a, tok(i), MsgType::Non, &[b"ps", b"obs"]))
            .await?;
        let answer = a
            .wait_for(Duration::from_secs(1), |g| g.answers(tok(i)))
            .await;
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
    let legit = Attacker::new(bed.coap, legit_traffic, CLIENT).await?;
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
            if let Some(g) = legit
                .wait_for(Duration::from_secs(2), |g| g.answers(t))
                .await
            {
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

pub(super) async fn case8(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
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
        let a = Attacker::new(bed.coap, traffic.clone(), SQUATTER).await?;
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
        let _ = a
            .wait_for(Duration::from_secs(2), |g| g.answers(last))
            .await;
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
    // A legitimate block-wise publish (two 64-byte blocks), tried at once and then every 5 s
    // until it ends 2.04 or the expiry wait is over.
    let legit = Attacker::new(bed.coap, Arc::new(Traffic::default()), CLIENT).await?;
    let started = Instant::now();
    let mut attempts = 0u64;
    let mut first_outcome = String::new();
    let mut done_after = None;
    while started.elapsed() <= ctx.s.expiry_wait {
        attempts += 1;
        let outcome = legit_blockwise(&legit, attempts).await?;
        if first_outcome.is_empty() {
            first_outcome = outcome.0.clone();
        }
        if outcome.1 {
            done_after = Some(started.elapsed());
            break;
        }
        sleep(Duration::from_secs(5)).await;
    }
    let met = done_after.is_some_and(|d| d <= ctx.s.expiry_wait);
    let outcome = match done_after {
        Some(d) => format!(
            "first attempt {first_outcome}; ended 2.04 after {:.1} s ({attempts} attempt(s), 5 s apart)",
            d.as_secs_f64()
        ),
        None => format!(
            "first attempt {first_outcome}; still refused after {:.0} s ({attempts} attempts, 5 s apart)",
            started.elapsed().as_secs_f64()
        ),
    };
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

/// One legitimate two-block publish (attempt `n`): what it was answered, and whether it ended
/// 2.04.
async fn legit_blockwise(legit: &Attacker, n: u64) -> anyhow::Result<(String, bool)> {
    let path: [&[u8]; 3] = [b"ps", b"legit", b"blockwise"];
    let t0 = tok(800_000 + 2 * n);
    let mut b0 = request(MsgType::Con, Code::POST, legit.mid(), t0, &path);
    b0.add_uint_option(opt::BLOCK1, block1(0, true, 2));
    b0.payload = Bytes::from(vec![b'l'; 64]);
    legit.send(&b0).await?;
    let first = legit
        .wait_for(Duration::from_secs(3), |g| g.answers(t0))
        .await;
    let outcome = first
        .as_ref()
        .map(|g| code_text(g.code))
        .unwrap_or_else(|| "nothing".to_string());
    if !first.as_ref().is_some_and(|g| g.code == Code::CONTINUE) {
        return Ok((outcome, false));
    }
    let t1 = tok(800_001 + 2 * n);
    let mut b1 = request(MsgType::Con, Code::POST, legit.mid(), t1, &path);
    b1.add_uint_option(opt::BLOCK1, block1(1, false, 2));
    b1.payload = Bytes::from_static(b"end");
    legit.send(&b1).await?;
    let last = legit
        .wait_for(Duration::from_secs(5), |g| g.answers(t1))
        .await
        .map(|g| g.code);
    Ok((
        format!(
            "{outcome} then {}",
            last.map(code_text).unwrap_or_else(|| "nothing".to_string())
        ),
        last == Some(Code::CHANGED),
    ))
}

// 9 ----------------------------------------------------------------------------------------

pub(super) async fn case9(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let traffic = Arc::new(Traffic::default());
    let a = Attacker::new(ctx.bed.coap, traffic.clone(), SPOOFED).await?;
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
        .wait_for(Duration::from_secs(10), |g| {
            g.token == tok(9) && g.code != Code::EMPTY
        })
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
                    .map(|g| String::from_utf8_lossy(&g.payload)
                        .chars()
                        .take(80)
                        .collect::<String>())
                    .unwrap_or_default()
            ),
        ],
        traffic: Some(t),
        target: String::new(),
    })
}
