//! `[[function]]`s added, removed and changed by a reload (issue 29 item 3, ADR 0013): the
//! routes to functions change live, a removed function's instances stop, devices stay
//! connected.
//!
//! Real peers: the Python function `function_support/echo_function.py` (CloudEvents SDK),
//! started by sluice as a local function; MQTT devices on real sockets.

mod common;
mod function_support;
mod reload_support;

use std::time::{Duration, Instant};

use function_support::{
    device, function_status, function_toml, local_target, processes_tagged, FunctionLog,
};
use reload_support::*;
use sluice_proto::mqtt::QoS;
use sluice_testkit::TestClient;

/// Poll `cond` until it holds or `limit` passes (then fail naming `what` and the last state).
async fn within<S: std::fmt::Debug>(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> (bool, S),
) {
    let deadline = Instant::now() + limit;
    loop {
        let (ok, state) = cond();
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}; last: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The next reply the app receives: (topic, the function's tag from the reply's `data`).
async fn reply(app: &mut TestClient) -> String {
    let p = app
        .recv(Duration::from_secs(20))
        .await
        .expect("receive")
        .expect("a reply from the function");
    p.topic.to_string()
}

fn names(gw: &sluice::app::RunningGateway) -> Vec<String> {
    gw.status_json()["functions"]
        .as_array()
        .expect("functions")
        .iter()
        .filter_map(|f| f["name"].as_str().map(str::to_owned))
        .collect()
}

/// A local function with one instance kept running (`min_instances = 1`) is removed by a
/// reload while another is added: the reload answers both; the removed one's process stops
/// and its topics reach no function any more; the added one answers its topics; a change of
/// its topics replaces it live; the devices' connections stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_removes_and_replaces_functions_and_a_removed_ones_instances_stop() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    for sub in ["a", "b"] {
        std::fs::create_dir_all(dir.path().join(sub)).unwrap();
    }
    let log_a = FunctionLog::in_dir(&dir.path().join("a"));
    let log_b = FunctionLog::in_dir(&dir.path().join("b"));
    let (tag_a, tag_b) = ("fn-reload-a", "fn-reload-b");
    let extra = "reply_topic = \"{topic}/out\"\nidle = \"30s\"\ngrace = \"1s\"\nmin_instances = 1";
    let fa = function_toml(
        "fa",
        &["sensors/#"],
        &local_target(tag_a, &log_a, &[]),
        extra,
    );
    let fb = |topic: &str| function_toml("fb", &[topic], &local_target(tag_b, &log_b, &[]), extra);
    std::fs::write(&path, base_config(dir.path(), &fa)).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("+/+/+/out", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-f").await;
    assert_eq!(
        dev.publish("sensors/dev-f/t", "1", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(reply(&mut app).await, "sensors/dev-f/t/out");
    within("fa's instance", Duration::from_secs(10), || {
        let p = processes_tagged(tag_a);
        (p.len() == 1, p)
    })
    .await;

    // fa removed, fb added.
    std::fs::write(&path, base_config(dir.path(), &fb("other/#"))).unwrap();
    let (status, answer) = post_reload(admin_addr);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "applied", "{answer}");
    let applied: Vec<&str> = answer["applied"]
        .as_array()
        .expect("applied")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(applied.contains(&"function.fa (removed)"), "{answer}");
    assert!(applied.contains(&"function.fb (added)"), "{answer}");
    within(
        "the removed function's process to stop",
        Duration::from_secs(10),
        || {
            let p = processes_tagged(tag_a);
            (p.is_empty(), p)
        },
    )
    .await;
    assert_eq!(names(&gw), ["fb"]);
    assert_eq!(
        dev.publish("other/dev-f/t", "2", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(reply(&mut app).await, "other/dev-f/t/out");
    // fa's topic reaches no function now.
    assert_eq!(
        dev.publish("sensors/dev-f/t", "3", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert!(
        app.recv(Duration::from_millis(700))
            .await
            .expect("receive")
            .is_none(),
        "no reply for the removed function's topic"
    );

    // fb's topics change: replaced live (a new sink, a new runtime).
    std::fs::write(&path, base_config(dir.path(), &fb("more/#"))).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(answer["applied"][0], "function.fb (replaced)", "{answer}");
    assert_eq!(
        dev.publish("more/dev-f/t", "4", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(reply(&mut app).await, "more/dev-f/t/out");
    assert_eq!(function_status(&gw, "fb")["kind"], "local");
    dev.ping().await.expect("the device is still connected");
    app.ping().await.expect("the app is still connected");
    gw.shutdown();
    within("no function process left", Duration::from_secs(10), || {
        let p = processes_tagged(tag_b);
        (p.is_empty(), p)
    })
    .await;
}

/// ADR 0013 test 5, under load: a function holding an event it does not answer (`hang`) is
/// removed with `drain_timeout = "1s"`: the waiting device gets its PUBACK with 0x10 (counted
/// in the answer), stays connected, and the hanging instance is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_function_that_holds_an_event_acknowledges_the_device_and_stops_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sluice.toml");
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-reload-hang";
    let drain = "[reload]\ndrain_timeout = \"1s\"\n";
    let fh = function_toml(
        "fh",
        &["jobs/#"],
        &local_target(tag, &log, &[]),
        "idle = \"30s\"\ngrace = \"1s\"\ntimeout = \"30s\"",
    );
    std::fs::write(&path, base_config(dir.path(), &format!("{drain}{fh}"))).unwrap();
    let gw = gateway_from(&path);
    let admin_addr = gw.admin_addr.expect("admin");
    let mut dev = device(&gw, "dev-h").await;
    let waiting = dev
        .publish_no_wait("jobs/hang/1", "x", QoS::AtLeastOnce, false)
        .await
        .expect("publish")
        .expect("a packet id");
    within(
        "the function to hold the event",
        Duration::from_secs(20),
        || {
            let r = log.requests();
            (!r.is_empty(), r)
        },
    )
    .await;

    std::fs::write(&path, base_config(dir.path(), drain)).unwrap();
    let (_, answer) = post_reload(admin_addr);
    assert_eq!(answer["result"], "applied", "{answer}");
    assert_eq!(
        answer["applied"][0], "function.fh (removed: 1 messages acknowledged unsent)",
        "{answer}"
    );
    assert_eq!(
        dev.wait_ack(waiting)
            .await
            .expect("a PUBACK after the removal"),
        0x10
    );
    within(
        "the hanging instance to stop",
        Duration::from_secs(10),
        || {
            let p = processes_tagged(tag);
            (p.is_empty(), p)
        },
    )
    .await;
    dev.ping().await.expect("the device is still connected");
    assert!(names(&gw).is_empty());
    gw.shutdown();
}
