//! IEEE 11073-20601 agents end to end: the testkit's PHD agent (built from the fact sheet's
//! vectors) associates with the gateway over TCP — standard configurations, an extended one
//! learnt from its config report and remembered across a restart, Antidote's quirks — sends
//! scan reports, releases; the SenML records arrive at a real cloud Mosquitto over TLS 1.3
//! with the right topics, names, units, values and times. Bad agents are aborted and counted
//! while a good one goes on. Hostile agents (issue 28): one claiming another's system id
//! cannot re-teach its configuration (also after a restart), only `[phd] agents` associate
//! when the list is set, 64 KB model strings are cut, and over `[phd.tls]` a system id is
//! bound to the client certificate that taught it.

mod common;
#[path = "phd_gateway/hostile.rs"]
mod hostile;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{gateway_sections, metric_sum, wait_until, Cloud};
use sluice::app::RunningGateway;
use sluice_testkit::phd::{bcd_time, AgentSpec, PhdAgent, PhdDevice, Reading};
use sluice_testkit::TestClient;

const T: Duration = Duration::from_secs(10);

fn start(cloud: &Cloud, shards: usize, extra: &str) -> RunningGateway {
    let uplink = cloud.uplink_toml(None, "forward = [\"phd/#\"]");
    gateway_sections(
        &format!("shards = {shards}"),
        "",
        &format!("[phd]\nlisten = \"127.0.0.1:0\"\nresponse_timeout = \"2s\"\n{extra}\n{uplink}"),
    )
}

fn phd_addr(gw: &RunningGateway) -> SocketAddr {
    gw.phd_addr.expect("phd listener")
}

/// The next message at the cloud: (topic, SenML records as JSON).
async fn next(sub: &mut TestClient) -> (String, Vec<serde_json::Value>) {
    let p = sub
        .recv(T)
        .await
        .expect("cloud read")
        .expect("a measurement at the cloud");
    let records: Vec<serde_json::Value> = serde_json::from_slice(&p.payload).expect("SenML JSON");
    (p.topic.to_string(), records)
}

fn spec(device: PhdDevice, id: u8, config_id: u16, confirmed: bool) -> AgentSpec {
    AgentSpec {
        system_id: [0x00, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, id],
        device,
        config_id,
        confirmed,
        antidote_quirks: false,
    }
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_and_extended_agents_reach_the_cloud_as_senml() {
    let cloud = Cloud::start();
    let gw = start(&cloud, 2, "");
    let mut sub = cloud.subscriber("app", "phd/#").await;
    let at = bcd_time(2024, 1, 2, 3, 4, 5, 50);
    let at_unix = 1_704_164_645.5; // 2024-01-02T03:04:05.50Z

    // A pulse oximeter with the standard configuration 0x0190 (SFLOAT only: no time stamp).
    let mut ox = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 1, 0x0190, true),
    )
    .await
    .unwrap();
    let a = ox.associate().await.unwrap();
    assert_eq!(
        (a.aare_result, a.config_result),
        (0, None),
        "0x0190 is known"
    );
    let before = now_unix();
    let took = ox
        .report(
            &Reading::Oximeter {
                spo2: (98, 0),
                pulse: (72, 0),
            },
            at,
            T,
        )
        .await
        .unwrap();
    assert!(took.is_some(), "a confirmed report is confirmed");
    let (topic, r) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6001/spo2");
    assert_eq!(r[0]["n"], "urn:dev:mac:001b2c3d4e5f6001:spo2");
    assert_eq!(
        (r[0]["u"].as_str(), r[0]["v"].as_f64()),
        (Some("/"), Some(0.98))
    );
    let t = r[0]["t"].as_f64().unwrap();
    assert!(
        t >= before - 1.0 && t <= now_unix() + 1.0,
        "no time stamp: the gateway's time ({t})"
    );
    let (topic, r) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6001/pulse");
    assert_eq!(
        (r[0]["u"].as_str(), r[0]["v"].as_f64()),
        (Some("beat/min"), Some(72.0))
    );

    // The same oximeter model with an extended configuration: learnt from its config report.
    let ext = spec(PhdDevice::PulseOximeter, 2, 0x4000, true);
    let mut ox2 = PhdAgent::connect(phd_addr(&gw), ext.clone()).await.unwrap();
    let a = ox2.associate().await.unwrap();
    assert_eq!(
        (a.aare_result, a.config_result),
        (3, Some(0)),
        "configured, accepted"
    );
    ox2.report(
        &Reading::Oximeter {
            spo2: (975, -1),
            pulse: (60, 0),
        },
        at,
        T,
    )
    .await
    .unwrap();
    let (topic, r) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6002/spo2");
    assert_eq!(r[0]["v"].as_f64(), Some(0.975));
    assert_eq!(r[0]["t"].as_f64(), Some(at_unix), "the agent's time stamp");
    next(&mut sub).await;

    // The agent table lists both, operating.
    let status = gw.status_json();
    let list = status["phd"]["list"].as_array().unwrap().clone();
    assert_eq!(list.len(), 2, "{status}");
    assert!(
        list.iter()
            .all(|a| a["state"] == "operating" && a["specialization"] == "pulse-oximeter"),
        "{list:?}"
    );
    assert_eq!(ox2.release().await.unwrap(), 0);
    // Returning with the same extended configuration: known, no configuration exchange.
    drop(ox2);
    let mut ox2 = PhdAgent::connect(phd_addr(&gw), ext).await.unwrap();
    let a = ox2.associate().await.unwrap();
    assert_eq!((a.aare_result, a.config_result), (0, None), "remembered");

    // Blood pressure (compound, in pascal) and its pulse.
    let mut bp = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::BloodPressure, 3, 0x02BC, true),
    )
    .await
    .unwrap();
    assert_eq!(bp.associate().await.unwrap().aare_result, 0);
    bp.report(
        &Reading::BloodPressure {
            systolic: (120, 0),
            diastolic: (80, 0),
            mean: (95, 0),
            pulse: (600, -1),
        },
        at,
        T,
    )
    .await
    .unwrap();
    let (topic, r) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6003/bp");
    let values: Vec<_> = r
        .iter()
        .map(|x| {
            (
                x["n"]
                    .as_str()
                    .unwrap()
                    .rsplit(':')
                    .next()
                    .unwrap()
                    .to_owned(),
                x["v"].as_f64().unwrap(),
                x["u"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        values,
        [
            ("sys".into(), 15999.0, "Pa".into()),
            ("dia".into(), 10666.0, "Pa".into()),
            ("mean".into(), 12666.0, "Pa".into())
        ],
        "the fact sheet's example 3"
    );
    let (topic, r) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6003/pulse");
    assert_eq!(r[0]["v"].as_f64(), Some(60.0));

    // Unconfirmed reports work too (no confirmation expected).
    let mut ox3 = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 4, 0x0190, false),
    )
    .await
    .unwrap();
    ox3.associate().await.unwrap();
    assert_eq!(
        ox3.report(
            &Reading::Oximeter {
                spo2: (99, 0),
                pulse: (61, 0)
            },
            at,
            T
        )
        .await
        .unwrap(),
        None
    );
    let (topic, _) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6004/spo2");
    next(&mut sub).await;

    for agent in [&mut ox, &mut bp, &mut ox3, &mut ox2] {
        assert_eq!(agent.release().await.unwrap(), 0, "RLRE normal");
    }
    let metrics = gw.metrics_text();
    assert_eq!(metric_sum(&metrics, "sluice_phd_configs_learnt_total"), 1.0);
    assert!(
        metric_sum(
            &metrics,
            "sluice_phd_control_messages_total{type=\"get_result\""
        ) >= 4.0,
        "MDS GET answers taken on the shards are counted too: {metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "sluice_phd_handovers_total"),
        4.0,
        "one per agent that reported: the MDS GET's answer after a report stays on the shard"
    );
    assert!(
        metric_sum(&metrics, "sluice_phd_control_messages_total{type=\"aarq\"") >= 5.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "sluice_phd_measurements_total"),
        8.0,
        "2 each from 4 reports"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn antidote_agents_are_taken_with_their_quirks() {
    let cloud = Cloud::start();
    let gw = start(&cloud, 1, "");
    let mut sub = cloud.subscriber("app", "phd/#").await;
    let at = bcd_time(2025, 6, 30, 23, 59, 58, 0);

    // Oximeter: unconfirmed reports, all with invoke-id 0x1111, 10-byte observations.
    let mut ox = PhdAgent::connect(phd_addr(&gw), AgentSpec::antidote(PhdDevice::PulseOximeter))
        .await
        .unwrap();
    ox.associate().await.unwrap();
    for spo2 in [97, 96] {
        ox.report(
            &Reading::Oximeter {
                spo2: (spo2, 0),
                pulse: (70, 0),
            },
            at,
            T,
        )
        .await
        .unwrap();
        let (topic, r) = next(&mut sub).await;
        assert!(topic.ends_with("/spo2"), "{topic}");
        assert_eq!(r[0]["v"].as_f64(), Some(f64::from(spo2) / 100.0));
        assert_eq!(
            r[0]["t"].as_f64(),
            Some(1_751_327_998.0),
            "its time stamp was read"
        );
        next(&mut sub).await;
    }
    // Scale: weight and BMI twice in one confirmed report.
    let mut scale = PhdAgent::connect(
        phd_addr(&gw),
        AgentSpec {
            system_id: [9; 8],
            ..AgentSpec::antidote(PhdDevice::WeighingScale)
        },
    )
    .await
    .unwrap();
    scale.associate().await.unwrap();
    let took = scale
        .report(
            &Reading::Scale {
                mass_kg: (762, -1),
                bmi: (243, -1),
            },
            at,
            T,
        )
        .await
        .unwrap();
    assert!(
        took.unwrap() < Duration::from_secs(3),
        "confirmed within Antidote's 3 s"
    );
    let mut got = Vec::new();
    for _ in 0..4 {
        let (topic, r) = next(&mut sub).await;
        got.push((
            topic.rsplit('/').next().unwrap().to_owned(),
            r[0]["v"].as_f64().unwrap(),
            r[0]["u"].as_str().unwrap().to_owned(),
        ));
    }
    let mass = ("mass".to_owned(), 76.2, "kg".to_owned());
    let bmi = ("bmi".to_owned(), 24.3, "kg/m2".to_owned());
    assert_eq!(got, [mass.clone(), bmi.clone(), mass, bmi]);
    // Glucometer: two trailing bytes after its report.
    let mut glu = PhdAgent::connect(
        phd_addr(&gw),
        AgentSpec {
            system_id: [7; 8],
            ..AgentSpec::antidote(PhdDevice::Glucometer)
        },
    )
    .await
    .unwrap();
    glu.associate().await.unwrap();
    glu.report(&Reading::Glucose { mg_dl: (105, 0) }, at, T)
        .await
        .unwrap()
        .expect("confirmed");
    let (topic, r) = next(&mut sub).await;
    assert_eq!(topic, "phd/0707070707070707/glucose");
    assert_eq!(
        (r[0]["v"].as_f64(), r[0]["u"].as_str()),
        (Some(105.0), Some("mg/dL"))
    );
    for a in [&mut ox, &mut scale, &mut glu] {
        assert_eq!(a.release().await.unwrap(), 0);
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_agents_are_aborted_and_counted_while_a_good_one_goes_on() {
    let cloud = Cloud::start();
    let gw = start(
        &cloud,
        2,
        "max_apdu = \"1KiB\"\nassociation_timeout = \"1s\"",
    );
    let mut sub = cloud.subscriber("app", "phd/#").await;
    let at = bcd_time(2024, 1, 1, 0, 0, 0, 0);
    let mut good = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 1, 0x0190, true),
    )
    .await
    .unwrap();
    good.associate().await.unwrap();

    // A report before association: ABRT, connection closed.
    let mut early = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 2, 0x0190, true),
    )
    .await
    .unwrap();
    early
        .send_raw(&sluice_testkit::phd::scan_report_fixed(
            &spec(PhdDevice::PulseOximeter, 2, 0x0190, true),
            1,
            0,
            &Reading::Oximeter {
                spo2: (1, 0),
                pulse: (1, 0),
            },
            at,
        ))
        .await
        .unwrap();
    let abrt = early.read_apdu(T).await.unwrap().expect("ABRT");
    assert_eq!(abrt, [0xE6, 0x00, 0x00, 0x02, 0x00, 0x00], "ABRT undefined");
    assert_eq!(early.read_apdu(T).await.unwrap(), None, "then closed");

    // An APDU larger than max_apdu: ABRT buffer-overflow.
    let mut big = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 3, 0x0190, true),
    )
    .await
    .unwrap();
    big.send_raw(&[0xE2, 0x00, 0x10, 0x00]).await.unwrap();
    assert_eq!(
        big.read_apdu(T).await.unwrap().expect("ABRT"),
        [0xE6, 0x00, 0x00, 0x02, 0x00, 0x01]
    );

    // An unknown APDU choice: ABRT undefined.
    let mut odd = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 4, 0x0190, true),
    )
    .await
    .unwrap();
    odd.send_raw(&[0xAB, 0xCD, 0x00, 0x00]).await.unwrap();
    assert_eq!(
        odd.read_apdu(T).await.unwrap().expect("ABRT"),
        [0xE6, 0x00, 0x00, 0x02, 0x00, 0x00]
    );

    // A silent connection is closed after the association timeout.
    let mut silent = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 5, 0x0190, true),
    )
    .await
    .unwrap();
    assert_eq!(
        silent.read_apdu(Duration::from_secs(5)).await.unwrap(),
        None
    );

    // The good agent goes on, and a second AARQ from it while operating is a violation.
    good.report(
        &Reading::Oximeter {
            spo2: (95, 0),
            pulse: (80, 0),
        },
        at,
        T,
    )
    .await
    .unwrap()
    .expect("confirmed");
    let (topic, _) = next(&mut sub).await;
    assert_eq!(topic, "phd/001b2c3d4e5f6001/spo2");
    let metrics = gw.metrics_text();
    assert!(
        metric_sum(&metrics, "sluice_phd_violations_total") >= 3.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "sluice_phd_reports_unassociated_total"),
        1.0,
        "the early report, counted"
    );
    wait_until("closed connections leave the gauge", T, || {
        metric_sum(&gw.metrics_text(), "sluice_phd_connections") == 1.0
    })
    .await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learnt_configurations_survive_a_restart_with_a_spool_dir() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().unwrap();
    let spool = format!("[spool]\ndir = \"{}\"\n", dir.path().display());
    let ext = spec(PhdDevice::WeighingScale, 8, 0x4123, true);
    {
        let gw = start(&cloud, 1, &spool.replace("[spool]", "\n[spool]"));
        let mut agent = PhdAgent::connect(phd_addr(&gw), ext.clone()).await.unwrap();
        assert_eq!(agent.associate().await.unwrap().aare_result, 3);
        agent.release().await.unwrap();
        gw.shutdown();
    }
    let gw = start(&cloud, 1, &spool.replace("[spool]", "\n[spool]"));
    let mut agent = PhdAgent::connect(phd_addr(&gw), ext).await.unwrap();
    assert_eq!(
        agent.associate().await.unwrap().aare_result,
        0,
        "known after the restart"
    );
    agent.release().await.unwrap();
    gw.shutdown();
}

fn vector(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../sluice-proto/tests/vectors/{name}.hex",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let digits: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

/// Send an agent vector, expect the manager vectors (in order) as the gateway's answers.
async fn replay(agent: &mut PhdAgent, send: &str, expect: &[&str]) {
    agent.send_raw(&vector(send)).await.unwrap();
    for name in expect {
        let got = agent
            .read_apdu(T)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{send}: closed before {name}"));
        assert_eq!(got, vector(name), "{send} → {name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_the_fact_sheet_sessions_over_tcp_gets_the_specified_bytes() {
    let cloud = Cloud::start();
    let gw = start(&cloud, 2, "get_mds = false");
    let mut sub = cloud.subscriber("app", "phd/#").await;
    let raw = |id: u8| spec(PhdDevice::PulseOximeter, id, 0x0190, true);
    // Session A: standard 0x0190.
    let mut a = PhdAgent::connect(phd_addr(&gw), raw(1)).await.unwrap();
    replay(
        &mut a,
        "phd_po_A1_aarq_std0190",
        &["phd_po_A2_aare_accepted"],
    )
    .await;
    replay(
        &mut a,
        "phd_po_A3_scan_fixed_std0190",
        &["phd_po_A4_scan_fixed_confirm"],
    )
    .await;
    let (topic, _) = next(&mut sub).await;
    assert_eq!(topic, "phd/1122334455667704/spo2", "A1's system id");
    next(&mut sub).await;
    replay(&mut a, "phd_po_A5_rlrq_normal", &["phd_po_A6_rlre_normal"]).await;
    // Session B: extended 0x4000, then C1 on the same connection is not needed; B3..B8.
    let mut b = PhdAgent::connect(phd_addr(&gw), raw(2)).await.unwrap();
    replay(
        &mut b,
        "phd_po_B1_aarq_ext4000",
        &["phd_po_B2_aare_accepted_unknown_config"],
    )
    .await;
    replay(
        &mut b,
        "phd_po_B3_config_report_ext4000",
        &["phd_po_B4_config_response_accepted"],
    )
    .await;
    replay(
        &mut b,
        "phd_po_B5_scan_fixed_ext4000",
        &["phd_po_B6_scan_fixed_confirm"],
    )
    .await;
    replay(&mut b, "phd_po_B7_rlrq_normal", &["phd_po_B8_rlre_normal"]).await;
    // The scale: D1 after accepted-unknown-config (A1's AARQ names 0x0190, D1 reports 0x05DC:
    // accepted under the report's id), then D2 → D3.
    let mut d = PhdAgent::connect(phd_addr(&gw), raw(3)).await.unwrap();
    let mut aarq = vector("phd_po_B1_aarq_ext4000");
    aarq[43] = 0x01; // system id's last byte: another agent than B's (its 0x4000 is known now)
    d.send_raw(&aarq).await.unwrap();
    assert_eq!(
        d.read_apdu(T).await.unwrap().unwrap(),
        vector("phd_po_B2_aare_accepted_unknown_config")
    );
    replay(&mut d, "phd_ws_D1_config_report_std05dc", &[]).await;
    let rsp = d.read_apdu(T).await.unwrap().unwrap();
    assert_eq!(
        &rsp[rsp.len() - 4..],
        [0x05, 0xDC, 0x00, 0x00],
        "accepted-config for 0x05DC"
    );
    replay(
        &mut d,
        "phd_ws_D2_scan_fixed_std05dc",
        &["phd_ws_D3_scan_fixed_confirm"],
    )
    .await;
    // A GET of the MDS attributes when get_mds is on: A1 → A2 + C4; C5 is read silently.
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mds_get_is_the_fact_sheets_c4_and_its_answer_is_taken() {
    let cloud = Cloud::start();
    let gw = start(&cloud, 1, "");
    let mut a = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::PulseOximeter, 1, 0x0190, true),
    )
    .await
    .unwrap();
    a.set_answer_gets(false);
    replay(
        &mut a,
        "phd_po_A1_aarq_std0190",
        &["phd_po_A2_aare_accepted", "phd_po_C4_get_mds_request"],
    )
    .await;
    a.send_raw(&vector("phd_po_C5_get_mds_response"))
        .await
        .unwrap();
    wait_until("the model is in the agent table", T, || {
        gw.status_json()["phd"]["list"][0]["model"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    })
    .await;
    replay(&mut a, "phd_po_A5_rlrq_normal", &["phd_po_A6_rlre_normal"]).await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_plane_experiment_associates_on_the_shard_and_delivers_the_same() {
    let cloud = Cloud::start();
    let gw = start(&cloud, 2, "single_plane = true");
    let mut sub = cloud.subscriber("app", "phd/#").await;
    let at = bcd_time(2024, 1, 2, 3, 4, 5, 0);
    for id in 1..=3u8 {
        let mut agent = PhdAgent::connect(
            phd_addr(&gw),
            spec(PhdDevice::PulseOximeter, id, 0x4000 + u16::from(id), true),
        )
        .await
        .unwrap();
        assert_eq!(agent.associate().await.unwrap().config_result, Some(0));
        agent
            .report(
                &Reading::Oximeter {
                    spo2: (90 + i32::from(id), 0),
                    pulse: (60, 0),
                },
                at,
                T,
            )
            .await
            .unwrap()
            .expect("confirmed");
        let (topic, r) = next(&mut sub).await;
        assert_eq!(topic, format!("phd/001b2c3d4e5f60{id:02x}/spo2"));
        assert_eq!(
            r[0]["v"].as_f64(),
            Some(f64::from(90 + u32::from(id)) / 100.0)
        );
        next(&mut sub).await;
        assert_eq!(agent.release().await.unwrap(), 0);
    }
    let metrics = gw.metrics_text();
    assert_eq!(
        metric_sum(&metrics, "sluice_phd_handovers_total"),
        0.0,
        "nothing moved between planes"
    );
    assert_eq!(metric_sum(&metrics, "sluice_phd_configs_learnt_total"), 3.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variable_and_multi_person_reports_give_the_same_measurements() {
    let cloud = Cloud::start();
    let gw = start(&cloud, 1, "");
    let mut sub = cloud.subscriber("app", "phd/#").await;
    let at = bcd_time(2024, 3, 4, 5, 6, 7, 0);
    let mut bp = PhdAgent::connect(
        phd_addr(&gw),
        spec(PhdDevice::BloodPressure, 9, 0x02BC, true),
    )
    .await
    .unwrap();
    bp.associate().await.unwrap();
    let reading = Reading::BloodPressure {
        systolic: (118, 0),
        diastolic: (79, 0),
        mean: (92, 0),
        pulse: (66, 0),
    };
    let mut got = Vec::new();
    bp.report_var(&reading, at, T)
        .await
        .unwrap()
        .expect("confirmed");
    for _ in 0..2 {
        got.push(next(&mut sub).await);
    }
    bp.report_mp_fixed(3, &reading, at, T)
        .await
        .unwrap()
        .expect("confirmed");
    for _ in 0..2 {
        got.push(next(&mut sub).await);
    }
    let topics: Vec<_> = got
        .iter()
        .map(|(t, _)| t.rsplit('/').next().unwrap().to_owned())
        .collect();
    assert_eq!(
        topics,
        ["bp", "pulse", "bp-p3", "pulse-p3"],
        "the person is part of the metric"
    );
    for (_, records) in &got {
        assert_eq!(
            records[0]["t"].as_f64(),
            Some(1_709_528_767.0),
            "its time stamp"
        );
    }
    let sys = |r: &Vec<serde_json::Value>| r[0]["v"].as_f64();
    assert_eq!(sys(&got[0].1), Some((118.0f64 * 133.322387415).round()));
    assert_eq!(sys(&got[0].1), sys(&got[2].1), "same values either way");
    bp.release().await.unwrap();
    gw.shutdown();
}
