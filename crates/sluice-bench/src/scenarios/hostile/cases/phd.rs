//! The PHD edge's cases (5, 6, 10): data the cloud refuses for good, a configuration taught
//! under another agent's system id, 64 KB model strings.
//!
//! Owns: those attacks, the hand-made MDS GET response carrying a large System-Model, and their
//! verdicts. Does not own: the agent (`sluice_testkit::phd`), the bed.

use super::*;

// 5 ----------------------------------------------------------------------------------------

fn glucose() -> Reading {
    Reading::Glucose { mg_dl: (105, 0) }
}

const CLOCK: [u8; 8] = [0x20, 0x26, 0x11, 0x27, 0x08, 0x00, 0x00, 0x00];

pub(super) async fn case5(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
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
        Ok(Some(d)) => (
            false,
            format!(
                "CONFIRMED to the agent after {:.1} ms (the agent now discards the measurement)",
                d.as_secs_f64() * 1e3
            ),
        ),
        Ok(None) => (
            false,
            "sent unconfirmed (no confirmation expected)".to_string(),
        ),
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

/// Where case 6's impostor connects from (the genuine agent: 127.0.0.1).
const IMPOSTOR_IP: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

pub(super) async fn case6(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
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
    // From another host (127.0.0.2: all of 127/8 is loopback): an impostor is another device
    // on the network. One on the genuine agent's own IP cannot be told apart without TLS
    // client certificates ([phd.tls]; ADR 0009).
    let mut a = PhdAgent::connect_from(bed.phd, IMPOSTOR_IP, impostor).await?;
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
        Ok(x) if x.aare_result == aare_result::ACCEPTED || x.config_result == Some(0) => Some(
            g.report(
                &Reading::Oximeter {
                    spo2: (98, 0),
                    pulse: (72, 0),
                },
                CLOCK,
                Duration::from_secs(5),
            )
            .await,
        ),
        _ => None,
    };
    let mut topics = Vec::new();
    while let Some(p) = cloud.recv(Duration::from_secs(2)).await? {
        topics.push(format!(
            "{} {}",
            p.topic,
            String::from_utf8_lossy(&p.payload)
                .chars()
                .take(120)
                .collect::<String>()
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
                "impostor from 127.0.0.2 (system id {hex}, config 0x4000, glucometer table): AARE {}, config result {:?}",
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
            anyhow::ensure!(
                r.aare_result == aare_result::ACCEPTED,
                "AARE {}",
                r.aare_result
            );
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

pub(super) async fn case10(ctx: &Ctx<'_>) -> anyhow::Result<Outcome> {
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
