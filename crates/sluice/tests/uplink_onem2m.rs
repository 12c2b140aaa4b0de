//! The oneM2M uplink end to end against a real ACME CSE (`pip install acmecse`): MQTT devices
//! publish QoS 1 to a gateway started from TOML, the gateway's oneM2M transport registers its
//! AE and creates containers and contentInstances in ACME, and the tests read them back from
//! ACME over HTTP. ACME keeps its resources in memory, so restarting it loses them all, as a
//! crashed CSE would.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{device_opts, gateway, metric_sum};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use sluice_testkit::{Acme, ConnectOpts, TestClient};

const AE: &str = "/cse-in/sluice-gw";
const SYSTEM_ID: &str = "0011223344556677";

fn onem2m_uplink(acme: &Acme, extra: &str) -> String {
    onem2m_uplink_at(acme.addr(), extra)
}

fn onem2m_uplink_at(addr: std::net::SocketAddr, extra: &str) -> String {
    format!(
        "[[uplink]]\nname = \"in-cse\"\nurl = \"http://{}\"\nallow_plaintext = true\nprotocol = \"onem2m\"\ncse_id = \"/id-in\"\ncse_name = \"cse-in\"\noriginator = \"Csluice-gw\"\nforward = [\"phd/#\", \"notes/#\"]\ncontainer = \"{{device}}/{{last}}\"\nreconnect_min = \"50ms\"\nreconnect_max = \"300ms\"\nrefused_retry_min = \"50ms\"\nrefused_retry_max = \"200ms\"\n{extra}\n",
        addr
    )
}

fn senml(metric: &str, i: usize) -> String {
    format!(
        r#"[{{"bn":"urn:dev:mac:{SYSTEM_ID}:","bt":1700000000,"n":"{metric}","u":"%","v":{i}}}]"#
    )
}

async fn device(gw: &sluice::app::RunningGateway, id: &str) -> TestClient {
    let mut c = device_opts(gw, ConnectOpts::new(ProtocolVersion::V5, id)).await;
    // An ACME restart takes seconds; the device waits for its PUBACKs through it.
    c.set_ack_timeout(Duration::from_secs(90));
    c
}

fn start_acme() -> Arc<Mutex<Acme>> {
    Arc::new(Mutex::new(
        Acme::start().unwrap_or_else(|e| panic!("ACME: {e:#}")),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ae_containers_and_every_content_instance_exist_in_acme_with_con_and_cnf() {
    let acme = start_acme();
    let gw = gateway(2, &onem2m_uplink(&acme.lock().unwrap(), ""));
    let mut dev = device(&gw, SYSTEM_ID).await;
    let mut sent = Vec::new();
    for i in 0..20 {
        for metric in ["spo2", "pulse"] {
            let payload = senml(metric, i);
            let code = dev
                .publish(
                    &format!("phd/{SYSTEM_ID}/{metric}"),
                    payload.clone(),
                    QoS::AtLeastOnce,
                    false,
                )
                .await
                .expect("PUBACK");
            assert_eq!(code, 0, "PUBACK for {metric} {i}");
            sent.push((metric, payload));
        }
    }
    let code = dev
        .publish("notes/today", "fine, thanks", QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK");
    assert_eq!(code, 0);

    let acme = acme.lock().unwrap();
    let ae = acme.get(AE, "CAdmin").expect("GET AE");
    assert_eq!(ae.rsc, Some(2000), "the AE exists: {}", ae.body);
    assert_eq!(ae.json()["m2m:ae"]["aei"], "Csluice-gw");
    let containers: BTreeSet<String> = acme
        .discover(AE, 3)
        .expect("discover")
        .into_iter()
        .collect();
    for c in [
        format!("cse-in/sluice-gw/{SYSTEM_ID}"),
        format!("cse-in/sluice-gw/{SYSTEM_ID}/spo2"),
        format!("cse-in/sluice-gw/{SYSTEM_ID}/pulse"),
        format!("cse-in/sluice-gw/{SYSTEM_ID}/today"),
    ] {
        assert!(containers.contains(&c), "{c} missing from {containers:?}");
    }
    for metric in ["spo2", "pulse"] {
        let got = acme
            .content_instances(&format!("{AE}/{SYSTEM_ID}/{metric}"))
            .expect("contentInstances");
        let want: Vec<(String, String)> = sent
            .iter()
            .filter(|(m, _)| *m == metric)
            .map(|(_, p)| ("application/senml+json:0".to_string(), p.clone()))
            .collect();
        assert_eq!(
            got, want,
            "{metric}: every message once, in order, as SenML JSON"
        );
    }
    let notes = acme
        .content_instances(&format!("{AE}/{SYSTEM_ID}/today"))
        .expect("contentInstances");
    assert_eq!(
        notes,
        vec![("text/plain:0".to_string(), "fine, thanks".to_string())]
    );

    let text = gw.metrics_text();
    assert!(metric_sum(&text, "sluice_onem2m_responses_total{shard=\"0\",uplink=\"in-cse\",lane=\"normal\",class=\"2xxx\"") + metric_sum(&text, "sluice_onem2m_responses_total{shard=\"1\",uplink=\"in-cse\",lane=\"normal\",class=\"2xxx\"") >= 41.0, "{text}");
    assert!(
        metric_sum(&text, "sluice_onem2m_resources_created_total") >= 5.0,
        "AE and 4 containers"
    );
    // Both shards registered the AE: one got 2001, the other 4117 ("already registered"),
    // which counts as success.
    assert_eq!(
        metric_sum(&text, "sluice_onem2m_resources_created_total{shard=\"0\",uplink=\"in-cse\",lane=\"normal\",type=\"ae\"")
            + metric_sum(&text, "sluice_onem2m_resources_created_total{shard=\"1\",uplink=\"in-cse\",lane=\"normal\",type=\"ae\""),
        1.0,
        "{text}"
    );
    assert!(metric_sum(&text, "sluice_onem2m_responses_total{shard=\"0\",uplink=\"in-cse\",lane=\"normal\",class=\"4xxx\"") + metric_sum(&text, "sluice_onem2m_responses_total{shard=\"1\",uplink=\"in-cse\",lane=\"normal\",class=\"4xxx\"") >= 1.0, "the second registration was answered 4117: {text}");
    let status = gw.status_json();
    assert!(
        status.to_string().contains("in-cse"),
        "the uplink shows in the status: {status}"
    );
    gw.shutdown();
}

/// Publish `total` QoS 1 messages with up to 16 unacknowledged while ACME restarts once a third
/// of them were sent (the last third waits for the restart to finish). Returns every
/// acknowledged payload with whether it was sent after the restart had finished, and the
/// gateway's metrics text. With a `gate` in front of ACME the
/// gateway's connections are cut first and ACME is restarted once it is idle (see the test
/// that uses it).
async fn publish_through_a_restart(
    acme: &Arc<Mutex<Acme>>,
    total: usize,
    gate: Option<Arc<common::Gate>>,
) -> (Vec<(String, bool)>, String) {
    const WINDOW: usize = 16;
    let addr = gate
        .as_ref()
        .map_or_else(|| acme.lock().unwrap().addr(), |g| g.addr);
    let gw = gateway(1, &onem2m_uplink_at(addr, ""));
    let mut dev = device(&gw, SYSTEM_ID).await;
    let topic = format!("phd/{SYSTEM_ID}/spo2");
    let mut inflight = std::collections::VecDeque::new();
    let mut acked = Vec::new();
    let mut restart: Option<std::thread::JoinHandle<Result<(), String>>> = None;
    for i in 0..total {
        if i == total / 3 {
            let acme = acme.clone();
            let gate = gate.clone();
            restart = Some(std::thread::spawn(move || {
                if let Some(gate) = &gate {
                    gate.set_open(false);
                    std::thread::sleep(Duration::from_millis(1500));
                }
                let restarted = acme.lock().unwrap().restart().map_err(|e| format!("{e:#}"));
                if let Some(gate) = &gate {
                    gate.set_open(true);
                }
                restarted
            }));
        }
        if i == 2 * total / 3 {
            // The last third goes out only once the CSE is back, however fast the first two
            // thirds were acknowledged (a busy machine may ack them all before the restart).
            while !restart.as_ref().is_some_and(|r| r.is_finished()) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let payload = senml("spo2", i);
        let id = dev
            .publish_no_wait(&topic, payload.clone(), QoS::AtLeastOnce, false)
            .await
            .expect("publish")
            .expect("QoS 1 has a packet id");
        // Sent once the restart had finished: only the restarted CSE can have answered it (a
        // PUBACK read after the restart may still be for a 2001 of the CSE before it).
        let after = restart.as_ref().is_some_and(|r| r.is_finished());
        inflight.push_back((id, payload, after));
        if inflight.len() == WINDOW {
            let (id, payload, after) = inflight.pop_front().expect("non-empty");
            let code = dev.wait_ack(id).await.expect("PUBACK");
            assert_eq!(code, 0, "PUBACK success for {payload}");
            acked.push((payload, after));
        }
    }
    while let Some((id, payload, after)) = inflight.pop_front() {
        let code = dev.wait_ack(id).await.expect("PUBACK");
        assert_eq!(code, 0, "PUBACK success for {payload}");
        acked.push((payload, after));
    }
    restart
        .expect("restarted")
        .join()
        .expect("restart thread")
        .expect("ACME restarted");
    let text = gw.metrics_text();
    gw.shutdown();
    (acked, text)
}

fn content_of(acme: &Arc<Mutex<Acme>>) -> BTreeSet<String> {
    acme.lock()
        .unwrap()
        .content_instances(&format!("{AE}/{SYSTEM_ID}/spo2"))
        .expect("contentInstances after the restart")
        .into_iter()
        .map(|(_, con)| con)
        .collect()
}

/// ACME keeps its resources across this restart (TinyDB). ACME itself loses creates it answered
/// 2001 when it is stopped while requests are being processed (a plain Python client saw 4 of
/// 412 lost, SIGINT under load), so the gateway's connections are first cut by a relay, as a
/// restart cuts them, and ACME is stopped once idle: every acknowledged measurement must be
/// there afterwards, before and after the restart alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cse_restarted_mid_stream_with_its_database_loses_no_acknowledged_measurement() {
    const TOTAL: usize = 300;
    let acme = Arc::new(Mutex::new(
        Acme::builder()
            .persistent()
            .start()
            .unwrap_or_else(|e| panic!("ACME: {e:#}")),
    ));
    let addr = acme.lock().unwrap().addr();
    let gate = Arc::new(common::Gate::start(addr).await);
    let (acked, _) = publish_through_a_restart(&acme, TOTAL, Some(gate)).await;
    assert_eq!(acked.len(), TOTAL, "every message was acknowledged");
    let got = content_of(&acme);
    let missing: Vec<_> = acked.iter().filter(|(p, _)| !got.contains(p)).collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged but not in ACME, e.g. {:?}",
        missing.len(),
        missing.first()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cse_restarted_empty_mid_stream_gets_its_ae_and_containers_back_and_every_later_measurement(
) {
    const TOTAL: usize = 300;
    let acme = start_acme();
    let (acked, text) = publish_through_a_restart(&acme, TOTAL, None).await;
    assert_eq!(acked.len(), TOTAL, "every message was acknowledged");
    // The in-memory CSE forgot everything from before its restart; everything acknowledged
    // after it is there, so sluice registered the AE and created the containers again.
    let got = content_of(&acme);
    let after: Vec<_> = acked.iter().filter(|(_, after)| *after).collect();
    assert!(
        after.len() >= TOTAL / 3,
        "{} sent after the restart",
        after.len()
    );
    let missing: Vec<_> = after.iter().filter(|(p, _)| !got.contains(p)).collect();
    assert!(
        missing.is_empty(),
        "{} sent after the restart and acknowledged but not in ACME, e.g. {:?}",
        missing.len(),
        missing.first()
    );
    assert!(
        metric_sum(&text, "sluice_onem2m_resources_created_total{shard=\"0\",uplink=\"in-cse\",lane=\"normal\",type=\"ae\"") >= 2.0,
        "the AE was registered again: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_instance_the_cse_refuses_for_good_fails_the_devices_puback() {
    let acme = start_acme();
    // mbs = 64 bytes: ACME refuses a bigger contentInstance with 5207 NOT_ACCEPTABLE.
    let gw = gateway(1, &onem2m_uplink(&acme.lock().unwrap(), "mbs = \"64B\"\n"));
    let mut dev = device(&gw, "dev-small").await;
    let small = dev
        .publish("notes/a", "short", QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK");
    assert_eq!(small, 0);
    let big = dev
        .publish("notes/a", "x".repeat(200), QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK");
    assert_eq!(
        big, 0x83,
        "a permanent refusal reaches an MQTT 5 device as a failure code"
    );
    let after = dev
        .publish("notes/a", "short again", QoS::AtLeastOnce, false)
        .await
        .expect("PUBACK");
    assert_eq!(after, 0, "the uplink goes on after a refusal");
    let got = acme
        .lock()
        .unwrap()
        .content_instances(&format!("{AE}/dev-small/a"))
        .expect("contentInstances");
    let cons: Vec<String> = got.into_iter().map(|(_, c)| c).collect();
    assert_eq!(cons, vec!["short".to_string(), "short again".to_string()]);
    let text = gw.metrics_text();
    assert_eq!(
        metric_sum(&text, "sluice_uplink_cloud_rejected_total{shard=\"0\",uplink=\"in-cse\",lane=\"normal\",reason=\"other\"}"),
        1.0,
        "{text}"
    );
    gw.shutdown();
}

/// A container deleted while sluice stays connected: the next contentInstance gets 4004, and
/// sluice re-creates the container and sends it again instead of refusing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_the_cse_lost_while_connected_is_re_created_and_the_message_retried() {
    let acme = start_acme();
    let gw = gateway(1, &onem2m_uplink(&acme.lock().unwrap(), ""));
    let mut dev = device(&gw, SYSTEM_ID).await;
    let topic = format!("phd/{SYSTEM_ID}/pulse");
    for i in 0..3 {
        let code = dev
            .publish(&topic, senml("pulse", i), QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK");
        assert_eq!(code, 0);
    }
    let deleted = acme
        .lock()
        .unwrap()
        .delete(&format!("{AE}/{SYSTEM_ID}"))
        .expect("DELETE");
    assert_eq!(deleted.rsc, Some(2002), "{}", deleted.body);
    for i in 3..6 {
        let code = dev
            .publish(&topic, senml("pulse", i), QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK");
        assert_eq!(code, 0, "message {i} after the container was deleted");
    }
    let got: Vec<String> = acme
        .lock()
        .unwrap()
        .content_instances(&format!("{AE}/{SYSTEM_ID}/pulse"))
        .expect("the container is back")
        .into_iter()
        .map(|(_, con)| con)
        .collect();
    let want: Vec<String> = (3..6).map(|i| senml("pulse", i)).collect();
    assert_eq!(
        got, want,
        "the messages after the deletion, each once, in order"
    );
    let text = gw.metrics_text();
    assert_eq!(
        metric_sum(&text, "sluice_onem2m_lost_parents_total"),
        1.0,
        "one 4004, retried: {text}"
    );
    assert_eq!(metric_sum(&text, "sluice_uplink_cloud_rejected_total"), 0.0);
    gw.shutdown();
}

/// ACME's default server (Werkzeug) answers every request with `Connection: close`: requests
/// pipelined behind the first are never read, and sluice writes them again on a new
/// connection; every message still arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cse_that_closes_after_every_response_still_gets_every_message_once() {
    let acme = Arc::new(Mutex::new(
        Acme::builder()
            .werkzeug()
            .start()
            .unwrap_or_else(|e| panic!("ACME: {e:#}")),
    ));
    let gw = gateway(1, &onem2m_uplink(&acme.lock().unwrap(), ""));
    let mut dev = device(&gw, SYSTEM_ID).await;
    let topic = format!("phd/{SYSTEM_ID}/spo2");
    let mut ids = Vec::new();
    for i in 0..30 {
        let id = dev
            .publish_no_wait(&topic, senml("spo2", i), QoS::AtLeastOnce, false)
            .await
            .expect("publish")
            .expect("packet id");
        ids.push(id);
    }
    for id in ids {
        assert_eq!(dev.wait_ack(id).await.expect("PUBACK"), 0);
    }
    let got: Vec<String> = acme
        .lock()
        .unwrap()
        .content_instances(&format!("{AE}/{SYSTEM_ID}/spo2"))
        .expect("contentInstances")
        .into_iter()
        .map(|(_, con)| con)
        .collect();
    let want: Vec<String> = (0..30).map(|i| senml("spo2", i)).collect();
    assert_eq!(got, want, "each once, in order");
    let text = gw.metrics_text();
    assert!(
        metric_sum(&text, "sluice_onem2m_server_closes_total") >= 1.0,
        "{text}"
    );
    gw.shutdown();
}

/// `https://` to the CSE: TLS 1.3 with the uplink's `ca_file` and `server_name`, the same rustls
/// set-up as an MQTT uplink. ACME's keep-alive server (waitress) speaks no TLS, so a TLS
/// terminator with a certificate generated at test time stands in front of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_uplink_verifies_the_cse_with_ca_file_and_delivers() {
    let acme = start_acme();
    let upstream = acme.lock().unwrap().addr();
    let pki = sluice_testkit::TestPki::generate();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.rustls_server_config(false));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let tls_addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                }
            });
        }
    });
    let uplink = onem2m_uplink_at(
        tls_addr,
        &format!(
            "ca_file = \"{}\"\nserver_name = \"localhost\"\n",
            pki.ca_path().display()
        ),
    )
    .replace("http://", "https://")
    .replace("allow_plaintext = true\n", "");
    let gw = gateway(1, &uplink);
    let mut dev = device(&gw, SYSTEM_ID).await;
    for i in 0..5 {
        let code = dev
            .publish(
                &format!("phd/{SYSTEM_ID}/spo2"),
                senml("spo2", i),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .expect("PUBACK");
        assert_eq!(code, 0);
    }
    let got: Vec<String> = acme
        .lock()
        .unwrap()
        .content_instances(&format!("{AE}/{SYSTEM_ID}/spo2"))
        .expect("contentInstances")
        .into_iter()
        .map(|(_, con)| con)
        .collect();
    assert_eq!(got, (0..5).map(|i| senml("spo2", i)).collect::<Vec<_>>());
    gw.shutdown();
}

/// With a spool and `ack = "spool"` a device is acknowledged at the commit, while the CSE is
/// unreachable; once it is reachable every stored message becomes a contentInstance, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ack_spool_devices_are_acked_at_the_commit_and_the_cse_gets_everything_later() {
    let acme = start_acme();
    let addr = acme.lock().unwrap().addr();
    let gate = common::Gate::start(addr).await;
    gate.set_open(false);
    let dir = tempfile::tempdir().expect("spool dir");
    let config = format!(
        "[spool]\ndir = \"{}\"\nfsync = \"never\"\nack = \"spool\"\n{}",
        dir.path().display(),
        onem2m_uplink_at(gate.addr, "")
    );
    let gw = gateway(1, &config);
    let mut dev = device(&gw, SYSTEM_ID).await;
    dev.set_ack_timeout(Duration::from_secs(10));
    let topic = format!("phd/{SYSTEM_ID}/spo2");
    for i in 0..20 {
        let code = dev
            .publish(&topic, senml("spo2", i), QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK while the CSE is unreachable");
        assert_eq!(code, 0);
    }
    let none = acme.lock().unwrap().get(AE, "CAdmin").expect("GET AE");
    assert_eq!(none.rsc, Some(4004), "nothing reached the CSE yet");
    gate.set_open(true);
    let want: Vec<String> = (0..20).map(|i| senml("spo2", i)).collect();
    let path = format!("{AE}/{SYSTEM_ID}/spo2");
    let mut got = Vec::new();
    let arrived = common::eventually(Duration::from_secs(30), || {
        got = acme
            .lock()
            .unwrap()
            .content_instances(&path)
            .map(|v| v.into_iter().map(|(_, con)| con).collect())
            .unwrap_or_default();
        got.len() >= want.len()
    })
    .await;
    assert!(arrived, "only {} of 20 arrived", got.len());
    assert_eq!(got, want, "every stored message, once, in order");
    gw.shutdown();
}
