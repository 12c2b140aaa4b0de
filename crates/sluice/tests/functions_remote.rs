//! Remote edge functions (issue 19) end to end: a `[[function]]` with a `url` pointing at a
//! real Python function server (`function_support/echo_function.py`, run by the test) that
//! parses every request with the CloudEvents SDK. Devices publish over MQTT 5, and over CoAP
//! and IEEE 11073 (PHD) to the same Python function started by sluice itself; the tests check what the function receives (CloudEvents attributes,
//! keep-alive connections), what comes back (replies on `reply_topic`, dead letters on
//! `$sluice/dlq/{name}` with their user properties, the device's PUBACK), the function's
//! metrics, and that a failing or hanging function leaves the cloud uplink (a real Mosquitto
//! over TLS 1.3) receiving every message at the rate the device publishes.

mod common;
mod function_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use common::coap::{request, CoapDevice};
use common::{gateway, gateway_sections, ids_on_shards, Cloud};
use function_support::*;
use sluice::app::RunningGateway;
use sluice_proto::coap::{opt, Code, MsgType};
use sluice_proto::mqtt::{Packet, Properties, Publish, QoS};
use sluice_testkit::phd::{bcd_time, AgentSpec, PhdAgent, PhdDevice, Reading};

/// A QoS 1 PUBLISH with packet id `id` and, if given, an MQTT 5 Content Type.
fn publish_packet(topic: &str, payload: Bytes, content_type: Option<&str>, id: u16) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: topic.into(),
        packet_id: Some(id),
        properties: content_type.map(|ct| {
            Box::new(Properties {
                content_type: Some(ct.into()),
                ..Properties::default()
            })
        }),
        payload,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_a_valid_cloudevent_and_the_answer_is_published_on_the_reply_topic() {
    let f = RemoteFunction::start(&[]);
    let gw = gateway(
        2,
        &function_toml(
            "enrich",
            &["sensors/#"],
            &format!("url = {:?}", f.url()),
            "reply_topic = \"{topic}/out\"\nconcurrency = 4\nmax_instances = 1",
        ),
    );
    let mut app = device(&gw, "app").await;
    assert_eq!(
        app.subscribe(&[("sensors/+/+/out", QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1]
    );
    let mut dev = device(&gw, "dev-a").await;
    let senml = r#"[{"bn":"urn:dev:mac:0024befffe804ff1:","n":"temp","u":"Cel","v":21.5}]"#;
    // (topic, payload, MQTT 5 content type, expected datacontenttype, expected data as the
    // SDK gives it: parsed JSON, text, or hex of binary data)
    let cases: Vec<(&str, Bytes, Option<&str>, &str, serde_json::Value)> = vec![
        (
            "sensors/dev-a/temp",
            Bytes::from_static(b"21.5"),
            Some("text/plain"),
            "text/plain",
            serde_json::json!("21.5"),
        ),
        (
            "sensors/dev-a/json",
            Bytes::from_static(br#"{"rh":40}"#),
            Some("application/json"),
            "application/json",
            serde_json::json!({"rh": 40}),
        ),
        (
            "sensors/dev-a/senml",
            Bytes::from(senml),
            None,
            "application/senml+json",
            serde_json::from_str(senml).unwrap(),
        ),
        (
            "sensors/dev-a/raw",
            Bytes::from_static(b"\x00\xff\x10"),
            None,
            "application/octet-stream",
            serde_json::json!({"hex": "00ff10"}),
        ),
        (
            // Percent-encoded in ce-subject; the SDK decodes it back.
            "sensors/dev-a/température 2",
            Bytes::from_static(b"x"),
            None,
            "application/octet-stream",
            serde_json::json!("x"),
        ),
    ];
    let before = now_unix();
    for (i, (topic, payload, ct, _, _)) in cases.iter().enumerate() {
        let id = 1000 + i as u16;
        dev.send_packet(&publish_packet(topic, payload.clone(), *ct, id))
            .await
            .unwrap();
        assert_eq!(
            dev.wait_ack(id)
                .await
                .expect("PUBACK once the function answered"),
            0,
            "{topic}"
        );
    }
    // A device id that needs percent-encoding in ce-source.
    let mut odd = device(&gw, "capteur é 7").await;
    assert_eq!(
        odd.publish("sensors/odd/temp", "19", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    // An answer without a body (204) acknowledges the event and publishes nothing.
    assert_eq!(
        dev.publish("sensors/dev-a/quiet", "q", QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK after the 204"),
        0
    );
    let after = now_unix();
    let mut replies = BTreeMap::new();
    while replies.len() < cases.len() + 1 {
        let p = app
            .recv(T)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("a reply for each event; got {replies:?}"));
        let body: serde_json::Value = serde_json::from_slice(&p.payload).expect("JSON reply");
        // The function's Content-Type travels with its answer (MQTT 5 content type).
        assert_eq!(
            p.properties
                .as_ref()
                .and_then(|pr| pr.content_type.as_deref()),
            Some("application/json"),
            "{p:?}"
        );
        replies.insert(p.topic.to_string(), body);
    }
    let source = format!("sluice://{}/dev-a", hostname());
    let mut ids = BTreeSet::new();
    for (topic, _, _, content_type, data) in &cases {
        let r = replies
            .get(&format!("{topic}/out"))
            .unwrap_or_else(|| panic!("no reply on {topic}/out: {replies:?}"));
        assert_eq!(r["subject"], *topic, "{r}");
        assert_eq!(r["source"], source, "{r}");
        assert_eq!(r["type"], "io.sluice.message", "{r}");
        assert_eq!(r["specversion"], "1.0", "{r}");
        assert_eq!(r["datacontenttype"], *content_type, "{r}");
        match data.get("hex") {
            Some(hex) => assert_eq!(r["data_hex"], *hex, "{r}"),
            None => assert_eq!(r["data"], *data, "{r}"),
        }
        let t = unix_seconds(r["time"].as_str().expect("a time")).expect("RFC 3339 UTC");
        assert!(
            t >= before - 1.0 && t <= after + 1.0,
            "time {} is when the message arrived ({before}..{after})",
            r["time"]
        );
        let id = r["id"].as_str().expect("an id").to_owned();
        assert!(!id.is_empty());
        ids.insert(id);
    }
    let r = &replies["sensors/odd/temp/out"];
    assert_eq!(
        r["source"],
        format!("sluice://{}/capteur é 7", hostname()),
        "{r}"
    );
    ids.insert(r["id"].as_str().expect("an id").to_owned());
    assert_eq!(
        ids.len(),
        cases.len() + 1,
        "every event has its own id: {ids:?}"
    );

    // No reply for the 204; and the replies matched `sensors/#` too, but a function's output
    // never goes to a function.
    let extra = app.recv(Duration::from_millis(300)).await.unwrap();
    assert!(extra.is_none(), "nothing more: {extra:?}");
    let requests = f.log.requests();
    let events = cases.len() + 2;
    assert_eq!(requests.len(), events, "{requests:?}");
    assert_eq!(f.log.with_status(Some(204)).len(), 1);
    assert_eq!(
        f.log.with_status(Some(200)).len(),
        events - 1,
        "the SDK parsed every event: {requests:?}"
    );
    let n = events as f64;
    assert_eq!(function_metric(&gw, "events_total", "enrich"), n);
    assert_eq!(invocations(&gw, "enrich", "ok"), n);
    assert_eq!(function_metric(&gw, "replies_total", "enrich"), n - 1.0);
    assert_eq!(function_metric(&gw, "dead_letters_total", "enrich"), 0.0);
    let status = function_status(&gw, "enrich");
    assert_eq!(status["kind"], "remote", "{status}");
    assert_eq!(status["events"], events, "{status}");
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_sent_at_once_on_one_shard_are_all_answered() {
    // Four events reach one shard together: four requests start at once, each on a new
    // connection (the pool is empty), and every one must be answered and acknowledged.
    let f = RemoteFunction::start(&[]);
    let gw = gateway(
        1,
        &function_toml(
            "at-once",
            &["meters/#"],
            &format!("url = {:?}", f.url()),
            "concurrency = 4\nmax_instances = 1",
        ),
    );
    let mut dev = device(&gw, "dev-4").await;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(
            dev.publish_no_wait("meters/dev-4", format!("{i}"), QoS::AtLeastOnce, false)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    dev.set_ack_timeout(Duration::from_secs(10));
    for id in ids {
        assert_eq!(
            dev.wait_ack(id)
                .await
                .expect("PUBACK once the function answered"),
            0
        );
    }
    assert_eq!(f.log.with_status(Some(200)).len(), 4);
    assert_eq!(invocations(&gw, "at-once", "ok"), 4.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_events_reuse_a_few_keep_alive_connections() {
    const SHARDS: usize = 2;
    const CONCURRENCY: usize = 2;
    const PER_DEVICE: usize = 50;
    let f = RemoteFunction::start(&[]);
    let gw = gateway(
        SHARDS,
        &function_toml(
            "count",
            &["meters/#"],
            &format!("url = {:?}", f.url()),
            &format!("concurrency = {CONCURRENCY}\nmax_instances = 1"),
        ),
    );
    // Two devices on each shard, each with up to 10 QoS 1 messages unacknowledged.
    let mut tasks = Vec::new();
    for id in ids_on_shards("ka", SHARDS, 2).into_iter().flatten() {
        let mut dev = device(&gw, &id).await;
        tasks.push(tokio::spawn(async move {
            let mut inflight = std::collections::VecDeque::new();
            for i in 0..PER_DEVICE {
                let pid = dev
                    .publish_no_wait(
                        &format!("meters/{id}"),
                        format!("{i}"),
                        QoS::AtLeastOnce,
                        false,
                    )
                    .await
                    .unwrap()
                    .unwrap();
                inflight.push_back(pid);
                if inflight.len() == 10 {
                    let pid = inflight.pop_front().unwrap();
                    assert_eq!(dev.wait_ack(pid).await.unwrap(), 0);
                }
            }
            for pid in inflight {
                assert_eq!(dev.wait_ack(pid).await.unwrap(), 0);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let total = 4 * PER_DEVICE;
    let requests = f.log.requests();
    assert_eq!(requests.len(), total, "every event once");
    assert!(requests.iter().all(|r| r["status"] == 200));
    // A connection lives from its first request to its last (in the order the function
    // logged them). sluice keeps one per request in flight on each shard and replaces one
    // only after it idled (`IDLE_REOPEN`), so at no point are more than concurrency × shards
    // of them in use, and all the events share a few.
    let ports: Vec<u64> = requests
        .iter()
        .map(|r| r["port"].as_u64().unwrap())
        .collect();
    let mut lifetimes: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for (i, port) in ports.iter().enumerate() {
        lifetimes.entry(*port).or_insert((i, i)).1 = i;
    }
    let most_at_once = (0..ports.len())
        .map(|i| {
            lifetimes
                .values()
                .filter(|(a, b)| *a <= i && i <= *b)
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(
        most_at_once <= CONCURRENCY * SHARDS,
        "{most_at_once} connections in use at once; at most concurrency × shards = {}: {ports:?}",
        CONCURRENCY * SHARDS
    );
    assert!(
        lifetimes.len() <= total / 10,
        "{total} events came on {} connections: keep-alive reuses them: {ports:?}",
        lifetimes.len()
    );
    assert_eq!(invocations(&gw, "count", "ok"), total as f64);
    gw.shutdown();
}

/// Each event id reached the function exactly `attempts` times (retries resend the same
/// event).
fn assert_each_event_tried(f: &RemoteFunction, count: usize, attempts: usize) {
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for r in f.log.requests() {
        *per_id
            .entry(r["id"].as_str().expect("an id").to_owned())
            .or_default() += 1;
    }
    assert_eq!(per_id.len(), count, "{per_id:?}");
    assert!(
        per_id.values().all(|&n| n == attempts),
        "each event tried {attempts} times: {per_id:?}"
    );
}

fn failing_gateway(cloud: &Cloud, f: &RemoteFunction, extra: &str) -> RunningGateway {
    gateway(
        2,
        &format!(
            "{}{}",
            cloud.uplink_toml(None, "forward = [\"sensors/#\", \"warmup/#\"]"),
            function_toml(
                "flaky",
                &["sensors/#"],
                &format!("url = {:?}", f.url()),
                &format!("retries = 2\nretry_min = \"20ms\"\nretry_max = \"100ms\"\nmax_instances = 1\n{extra}"),
            )
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_function_is_retried_then_dead_lettered_while_the_cloud_keeps_its_rate() {
    let cloud = Cloud::start();
    let f = RemoteFunction::start(&[("FN_MODE", "fail")]);
    let gw = failing_gateway(&cloud, &f, "concurrency = 4");
    let mut dlq = dlq_subscriber(&gw, "flaky").await;
    let s = Stream {
        topic: "sensors/dev-c/temp",
        count: 30,
        period: Duration::from_millis(40),
    };
    let (mut dev, ids) = publish_at_rate_and_check_the_cloud(&gw, &cloud, &s).await;
    let errors = expect_dead_letters(&mut dev, ids, &mut dlq, &s, Some("3")).await;
    assert_eq!(errors, BTreeSet::from(["HTTP 500".to_owned()]));
    assert_each_event_tried(&f, s.count, 3);
    assert_eq!(f.log.with_status(Some(500)).len(), 3 * s.count);
    let n = s.count as f64;
    assert_eq!(invocations(&gw, "flaky", "http_error"), 3.0 * n);
    assert_eq!(invocations(&gw, "flaky", "ok"), 0.0);
    assert_eq!(function_metric(&gw, "retries_total", "flaky"), 2.0 * n);
    assert_eq!(function_metric(&gw, "dead_letters_total", "flaky"), n);
    assert_eq!(function_metric(&gw, "events_total", "flaky"), n);
    assert_eq!(function_status(&gw, "flaky")["dead_letters"], s.count);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_function_times_out_and_is_dead_lettered_while_the_cloud_keeps_its_rate() {
    let cloud = Cloud::start();
    let f = RemoteFunction::start(&[("FN_MODE", "hang"), ("FN_HANG_S", "30")]);
    let gw = failing_gateway(&cloud, &f, "concurrency = 8\ntimeout = \"300ms\"");
    let mut dlq = dlq_subscriber(&gw, "flaky").await;
    let s = Stream {
        topic: "sensors/dev-c/temp",
        count: 20,
        period: Duration::from_millis(50),
    };
    let (mut dev, ids) = publish_at_rate_and_check_the_cloud(&gw, &cloud, &s).await;
    let errors = expect_dead_letters(&mut dev, ids, &mut dlq, &s, Some("3")).await;
    assert!(
        errors.iter().all(|e| e.contains("no answer within 300ms")),
        "{errors:?}"
    );
    assert_each_event_tried(&f, s.count, 3);
    let n = s.count as f64;
    assert_eq!(invocations(&gw, "flaky", "timeout"), 3.0 * n);
    assert_eq!(invocations(&gw, "flaky", "ok"), 0.0);
    assert_eq!(function_metric(&gw, "retries_total", "flaky"), 2.0 * n);
    assert_eq!(function_metric(&gw, "dead_letters_total", "flaky"), n);
    gw.shutdown();
}

/// The instances tagged `tag` are gone (they die with the gateway).
async fn within_processes_gone(tag: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = processes_tagged(tag);
        if p.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "still running: {p:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coap_and_phd_devices_reach_the_function_too() {
    // A local function this time: the Python function sluice starts itself (as in
    // functions_local.rs), so a CoAP or PHD message reaches the same kind of instance.
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-coap-phd";
    let gw = gateway_sections(
        "shards = 2",
        "",
        &format!(
            "[phd]\nlisten = \"127.0.0.1:0\"\n{}",
            function_toml(
                "edge",
                &["coap/#", "phd/#"],
                &local_target(tag, &log, &[]),
                ""
            )
        ),
    );

    // A CoAP device: its CON publish is answered 2.04 once the function answered.
    let mut coap = CoapDevice::new(gw.coap_addr().expect("coap listener")).await;
    let mut req = request(
        MsgType::Con,
        Code::POST,
        "ps/coap/meter-1/power",
        &["c=meter-1"],
        br#"{"w":230.5}"#,
    );
    req.add_uint_option(opt::CONTENT_FORMAT, 50); // application/json
    let resp = coap.exchange(req, T).await;
    assert_eq!(resp.code, Code::CHANGED, "{resp:?}");

    // A PHD agent: its confirmed report is confirmed once the function answered.
    let spec = AgentSpec {
        system_id: [0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77],
        device: PhdDevice::BloodPressure,
        config_id: 0x02BC,
        confirmed: true,
        antidote_quirks: false,
    };
    let mut agent = PhdAgent::connect(gw.phd_addr.expect("phd listener"), spec)
        .await
        .unwrap();
    assert_eq!(agent.associate().await.unwrap().aare_result, 0);
    let reading = Reading::BloodPressure {
        systolic: (120, 0),
        diastolic: (80, 0),
        mean: (95, 0),
        pulse: (70, 0),
    };
    agent
        .report(&reading, bcd_time(2024, 5, 6, 7, 8, 9, 0), T)
        .await
        .unwrap()
        .expect("confirmed once the function has it");

    let host = hostname();
    let requests = log.requests();
    assert!(requests.iter().all(|r| r["status"] == 200), "{requests:?}");
    let coap_events: Vec<_> = requests
        .iter()
        .filter(|r| r["subject"] == "coap/meter-1/power")
        .collect();
    assert_eq!(coap_events.len(), 1, "{requests:?}");
    assert_eq!(coap_events[0]["source"], format!("sluice://{host}/meter-1"));
    assert_eq!(coap_events[0]["datacontenttype"], "application/json");
    assert_eq!(coap_events[0]["type"], "io.sluice.message");
    let phd_events: Vec<_> = requests
        .iter()
        .filter(|r| {
            r["subject"]
                .as_str()
                .is_some_and(|s| s.starts_with("phd/0011223344556677/"))
        })
        .collect();
    assert!(!phd_events.is_empty(), "{requests:?}");
    for e in &phd_events {
        assert_eq!(e["source"], format!("sluice://{host}/0011223344556677"));
        assert_eq!(e["datacontenttype"], "application/senml+json");
    }
    assert_eq!(
        requests.len(),
        1 + phd_events.len(),
        "nothing else: {requests:?}"
    );
    assert_eq!(log.starts().len(), 1, "one instance started by sluice");
    gw.shutdown();
    within_processes_gone(tag).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_function_refuses_is_dead_lettered_at_once_without_retries() {
    let f = RemoteFunction::start(&[]);
    let gw = gateway(
        1,
        &function_toml(
            "picky",
            &["orders/#"],
            &format!("url = {:?}", f.url()),
            "retries = 3\nretry_min = \"20ms\"\nreply_topic = \"{topic}/out\"",
        ),
    );
    let mut dlq = dlq_subscriber(&gw, "picky").await;
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("orders/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-r").await;
    // A 422 is the function's own refusal: resending cannot help.
    assert_eq!(
        dev.publish("orders/reject/1", "bad order", QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK after the dead letter"),
        0
    );
    let p = dlq.recv(T).await.unwrap().expect("a dead letter");
    assert_eq!(&*p.topic, "$sluice/dlq/picky");
    assert_eq!(&p.payload[..], b"bad order");
    assert_eq!(
        user_property(&p, "topic").as_deref(),
        Some("orders/reject/1")
    );
    assert_eq!(user_property(&p, "device").as_deref(), Some("dev-r"));
    assert_eq!(user_property(&p, "error").as_deref(), Some("HTTP 422"));
    assert_eq!(user_property(&p, "attempts").as_deref(), Some("1"));
    // The next event is answered as usual.
    assert_eq!(
        dev.publish("orders/ok/2", "good order", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    // The subscriber of orders/# saw both orders and the reply to the good one, nothing
    // for the refused one.
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let p = app.recv(T).await.unwrap().expect("orders and a reply");
        seen.push(p.topic.to_string());
    }
    seen.sort();
    assert_eq!(seen, ["orders/ok/2", "orders/ok/2/out", "orders/reject/1"]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(f.log.with_status(Some(422)).len(), 1, "tried once");
    assert_eq!(invocations(&gw, "picky", "http_error"), 1.0);
    assert_eq!(function_metric(&gw, "retries_total", "picky"), 0.0);
    assert_eq!(function_metric(&gw, "dead_letters_total", "picky"), 1.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_function_queue_dead_letters_at_once_instead_of_holding_the_device() {
    // One shard and two sinks (the cloud, the function) in 128 KiB: 64 KiB each. The function
    // hangs, so its queue fills with 4 KiB messages and the rest overflow.
    let cloud = Cloud::start();
    let f = RemoteFunction::start(&[("FN_MODE", "hang"), ("FN_HANG_S", "30")]);
    let gw = gateway_sections(
        "shards = 1\nmax_buffered = \"128KiB\"",
        "max_packet_size = \"64KiB\"",
        &format!(
            "{}{}",
            cloud.uplink_toml(None, "forward = [\"sensors/#\", \"warmup/#\"]"),
            function_toml(
                "slow",
                &["sensors/#"],
                &format!("url = {:?}", f.url()),
                "concurrency = 1\nmax_instances = 1\ntimeout = \"500ms\"\nretries = 0",
            )
        ),
    );
    let mut dlq = dlq_subscriber(&gw, "slow").await;
    let mut cloud_sub = cloud.subscriber("cloud-app", "sensors/#").await;
    let mut dev = device(&gw, "dev-q").await;
    assert_eq!(
        dev.publish("warmup/dev-q", "w", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    const COUNT: usize = 40;
    let payload = |i: usize| format!("{i:04}{}", "x".repeat(4096));
    let mut ids = Vec::new();
    for i in 0..COUNT {
        ids.push(
            dev.publish_no_wait("sensors/dev-q/blob", payload(i), QoS::AtLeastOnce, false)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let sent = Instant::now();
    // The cloud has every message.
    for i in 0..COUNT {
        let p = cloud_sub
            .recv(T)
            .await
            .unwrap()
            .expect("every message at the cloud");
        assert_eq!(&p.payload[..4], format!("{i:04}").as_bytes());
    }
    // What overflowed is dead-lettered at once (no attempt), long before the hanging
    // function could have timed out on it.
    let mut queue_full = Vec::new();
    let mut letters = BTreeSet::new();
    while letters.len() < COUNT {
        let p = dlq
            .recv(T)
            .await
            .unwrap()
            .expect("every event dead-lettered");
        if user_property(&p, "error").as_deref() == Some("queue full") {
            assert_eq!(user_property(&p, "attempts").as_deref(), Some("0"));
            queue_full.push(sent.elapsed());
        }
        letters.insert(p.payload[..4].to_vec());
    }
    assert!(
        queue_full.len() >= COUNT / 4,
        "most of the burst overflowed the 64 KiB queue: {} of {COUNT}",
        queue_full.len()
    );
    assert!(
        queue_full.iter().all(|d| *d < Duration::from_secs(3)),
        "overflow dead-lettered at once: {queue_full:?}"
    );
    // The device gets every PUBACK (in order: those behind the queued events wait for them).
    for id in ids {
        assert_eq!(dev.wait_ack(id).await.expect("every PUBACK"), 0);
    }
    assert_eq!(
        function_metric(&gw, "dead_letters_total", "slow"),
        COUNT as f64
    );
    gw.shutdown();
}

/// With `[spool] ack = "spool"`, a device's event is acknowledged at the spool commit, and an
/// event the function has not taken yet survives a restart of the gateway: the function (down
/// before, up after) receives every one once the gateway is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spooled_events_reach_the_function_after_a_restart() {
    let spool = tempfile::tempdir().expect("spool dir");
    // A port nobody listens on: every attempt fails, and with many slow retries the events
    // are still waiting (unacknowledged in the spool) when the gateway stops.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}/events", dead.local_addr().unwrap());
    drop(dead);
    let config = |url: &str| {
        format!(
            "[spool]\ndir = {:?}\nack = \"spool\"\n\n{}",
            spool.path().display().to_string(),
            function_toml(
                "keep",
                &["spooled/#"],
                &format!("url = {url:?}"),
                "retries = 50\nretry_min = \"2s\"\nretry_max = \"2s\"",
            )
        )
    };
    let gw = gateway(2, &config(&dead_url));
    let mut dev = device(&gw, "spooler").await;
    for i in 0..5u16 {
        let code = dev
            .publish(
                &format!("spooled/{i}"),
                format!("m{i}").into_bytes(),
                QoS::AtLeastOnce,
                false,
            )
            .await
            .unwrap();
        assert_eq!(code, 0, "acknowledged at the spool commit");
    }
    drop(dev);
    gw.shutdown();

    let f = RemoteFunction::start(&[]);
    let gw = gateway(2, &config(&f.url()));
    let deadline = Instant::now() + Duration::from_secs(20);
    let subjects = loop {
        let got: BTreeSet<String> = f
            .log
            .requests()
            .iter()
            .filter_map(|r| r["subject"].as_str().map(str::to_owned))
            .collect();
        if got.len() == 5 || Instant::now() > deadline {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let want: BTreeSet<String> = (0..5).map(|i| format!("spooled/{i}")).collect();
    assert_eq!(
        subjects, want,
        "every spooled event reached the function after the restart"
    );
    gw.shutdown();
}
