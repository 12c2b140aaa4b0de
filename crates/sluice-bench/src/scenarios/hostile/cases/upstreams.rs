//! The upstream cases (12, 13): a CoAP-over-TCP server behind sluice's proxy answering
//! 65,000 B or late, and a oneM2M CSE answering in 1-byte chunks.
//!
//! Owns: those attacks and their verdicts. Does not own: the servers
//! ([`super::super::peers`]), the bed.

use super::*;

// 12 ---------------------------------------------------------------------------------------

pub(super) async fn case12(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
    let bed = ctx.bed;
    let traffic = Arc::new(Traffic::default());
    // (a) a 65,000-byte upstream answer, NON and CON, to sources that never proved anything.
    let a = Attacker::new(bed.coap, traffic.clone(), SPOOFED).await?;
    let non = request(
        MsgType::Non,
        Code::GET,
        a.mid(),
        tok(120),
        &[b"cloud", b"big"],
    );
    let non_size = a.send(&non).await?;
    let non_answer = a
        .wait_for(Duration::from_secs(3), |g| g.token == tok(120))
        .await;
    let con = request(
        MsgType::Con,
        Code::GET,
        a.mid(),
        tok(121),
        &[b"cloud", b"big"],
    );
    a.send(&con).await?;
    let con_answer = a
        .wait_for(Duration::from_secs(3), |g| g.token == tok(121))
        .await;
    // (b) a late answer: sluice sends an empty ACK, then the response as a separate CON that
    // the source never acknowledges.
    let b = Attacker::new(bed.coap, traffic.clone(), SPOOFED).await?;
    let slow = request(
        MsgType::Con,
        Code::GET,
        b.mid(),
        tok(122),
        &[b"cloud", b"slow"],
    );
    let slow_size = b.send(&slow).await?;
    // ack_timeout 1 s × up to 1.5, doubled 4 times: the last copy ≤ 22.5 s after the first.
    sleep(Duration::from_secs(26)).await;
    let copies = b
        .received()
        .iter()
        .filter(|g| g.token == tok(122) && g.code != Code::EMPTY)
        .count();
    let empties = b
        .received()
        .iter()
        .filter(|g| g.code == Code::EMPTY)
        .count();
    let b_bytes: usize = b.received().iter().map(|g| g.len).sum();
    let t = traffic.snapshot();
    let show = |g: Option<crate::scenarios::hostile::peers::Got>| {
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

pub(super) async fn case13(ctx: &Ctx<'_>, cse: &SlowCse) -> anyhow::Result<Outcome> {
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
        .publish(
            "cse/dev/t",
            Bytes::from_static(b"21.5"),
            QoS::AtLeastOnce,
            false,
        )
        .await?;
    anyhow::ensure!(code == 0, "the warm-up publish got {code:#x}");
    let (cpu_len, wall_len, wire_len) =
        cse_phase(ctx, cse, &mut dev, BodyMode::Length, messages).await?;
    let (cpu_chunk, wall_chunk, wire_chunk) =
        cse_phase(ctx, cse, &mut dev, BodyMode::Chunked, messages).await?;
    Ok(Outcome {
        // Linear work: a chunked body of 1-byte chunks is ~6 wire bytes per body byte, so the
        // rule compares CPU per wire byte, not per response (quadratic re-parsing showed as
        // ~9× per byte on 887093d).
        met: per_byte(cpu_chunk, wire_chunk) <= 2.0 * per_byte(cpu_len, wire_len),
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
            format!(
                "CPU per wire byte: Content-Length {:.1} ns, chunked {:.1} ns ({:.2}×)",
                per_byte(cpu_len, wire_len) * 1e9,
                per_byte(cpu_chunk, wire_chunk) * 1e9,
                per_byte(cpu_chunk, wire_chunk) / per_byte(cpu_len, wire_len).max(1e-12)
            ),
        ],
        traffic: None,
        target: String::new(),
    })
}

/// CPU seconds per byte on the wire (0 for no bytes).
fn per_byte(cpu: f64, wire: impl Into<u64>) -> f64 {
    let wire = wire.into();
    if wire == 0 {
        0.0
    } else {
        cpu / wire as f64
    }
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
