//! Local edge functions (issue 19) end to end: a `[[function]]` with a `command` that sluice
//! starts on demand — the Python function `function_support/echo_function.py`, which takes
//! its listening socket as fd 3 and parses every request with the CloudEvents SDK. The tests
//! watch what a user would: replies on `reply_topic`, the status at /api/v1/status, the
//! metrics, and the function's processes (children of this test process, found in /proc by
//! a tag on their command line): none before the first event, one after it, none once idle,
//! as many as the load needs up to `max_instances`, and a function that crashes on start
//! restarted with a growing backoff while the cloud uplink (a real Mosquitto over TLS 1.3)
//! goes on receiving at the device's rate.

mod common;
mod function_support;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{gateway, ids_on_shards, Cloud};
use function_support::*;
use sluice::app::RunningGateway;
use sluice_proto::mqtt::QoS;
use sluice_testkit::TestClient;
use tokio::time::Instant;

/// Poll `cond` every 20 ms for at most `limit`; panics naming `what` (and the last state).
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

/// The function's processes (by tag) and its instances in the status.
fn observed(gw: &RunningGateway, name: &str, tag: &str) -> (usize, Vec<(u32, u32)>) {
    (instance_count(gw, name), processes_tagged(tag))
}

/// Wait until the function has no instance and no process.
async fn scaled_to_zero(gw: &RunningGateway, name: &str, tag: &str, limit: Duration) {
    within("no instance and no process", limit, || {
        let (n, procs) = observed(gw, name, tag);
        (n == 0 && procs.is_empty(), (n, procs))
    })
    .await;
}

/// Publish `payloads` (QoS 1) on `topic` with up to `window` unacknowledged; every PUBACK
/// must be a success.
async fn publish_all(dev: &mut TestClient, topic: &str, payloads: &[String], window: usize) {
    let mut inflight = VecDeque::new();
    for p in payloads {
        let id = dev
            .publish_no_wait(topic, p.clone(), QoS::AtLeastOnce, false)
            .await
            .unwrap()
            .unwrap();
        inflight.push_back(id);
        if inflight.len() == window {
            let id = inflight.pop_front().unwrap();
            assert_eq!(dev.wait_ack(id).await.expect("PUBACK"), 0);
        }
    }
    for id in inflight {
        assert_eq!(dev.wait_ack(id).await.expect("PUBACK"), 0);
    }
}

/// `n` replies (JSON bodies), by topic and data.
async fn replies(app: &mut TestClient, n: usize) -> Vec<(String, serde_json::Value)> {
    let mut out = Vec::new();
    while out.len() < n {
        let p = app
            .recv(T)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{n} replies; got {}: {out:?}", out.len()));
        out.push((
            p.topic.to_string(),
            serde_json::from_slice(&p.payload).expect("JSON reply"),
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_started_by_sluice_gets_valid_events_on_its_inherited_socket_and_replies() {
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-valid-events";
    let gw = gateway(
        2,
        &function_toml(
            "local",
            &["sensors/#"],
            &local_target(tag, &log, &[]),
            "reply_topic = \"{topic}/out\"\nidle = \"30s\"\ngrace = \"1s\"",
        ),
    );
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("sensors/+/+/out", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-l").await;
    let sent: Vec<String> = (0..5).map(|i| format!("t-{i}")).collect();
    for p in &sent {
        assert_eq!(
            dev.publish("sensors/dev-l/temp", p.clone(), QoS::AtLeastOnce, false)
                .await
                .expect("PUBACK once the function answered"),
            0
        );
    }
    let got = replies(&mut app, sent.len()).await;
    let source = format!("sluice://{}/dev-l", hostname());
    let mut ids = BTreeSet::new();
    let mut data = BTreeSet::new();
    for (topic, r) in &got {
        assert_eq!(topic, "sensors/dev-l/temp/out");
        assert_eq!(r["subject"], "sensors/dev-l/temp", "{r}");
        assert_eq!(r["source"], source, "{r}");
        assert_eq!(r["type"], "io.sluice.message", "{r}");
        assert_eq!(r["specversion"], "1.0", "{r}");
        assert_eq!(r["datacontenttype"], "application/octet-stream", "{r}");
        ids.insert(r["id"].as_str().expect("id").to_owned());
        data.insert(r["data"].as_str().expect("text data").to_owned());
    }
    assert_eq!(ids.len(), sent.len(), "unique ids");
    assert_eq!(data, sent.iter().cloned().collect::<BTreeSet<_>>());

    let starts = log.starts();
    assert_eq!(starts.len(), 1, "one instance: {starts:?}");
    assert_eq!(
        starts[0]["fd3"], true,
        "socket = \"inherit\": it listens on fd 3 (LISTEN_FDS, LISTEN_PID)"
    );
    let requests = log.requests();
    assert_eq!(requests.len(), sent.len());
    assert!(requests.iter().all(|r| r["status"] == 200), "{requests:?}");
    let procs = processes_tagged(tag);
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(
        procs[0].1,
        std::process::id(),
        "the instance is a child of the gateway's process"
    );
    assert_eq!(starts[0]["start"], procs[0].0, "the process that answered");
    assert_eq!(instance_count(&gw, "local"), 1);
    assert_eq!(function_status(&gw, "local")["kind"], "local");
    assert_eq!(
        function_status(&gw, "local")["socket"],
        "inherit",
        "the default (auto) saw it serve fd 3: later instances start the fast way"
    );
    assert_eq!(function_metric(&gw, "cold_starts_total", "local"), 1.0);
    assert_eq!(function_metric(&gw, "instance_starts_total", "local"), 1.0);
    assert_eq!(invocations(&gw, "local", "ok"), 5.0);
    gw.shutdown();
    within(
        "the instance stopped with the gateway",
        Duration::from_secs(10),
        || {
            let p = processes_tagged(tag);
            (p.is_empty(), p)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_with_socket_port_binds_port_itself_and_answers() {
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-socket-port";
    let gw = gateway(
        1,
        &function_toml(
            "ported",
            &["sensors/#"],
            &local_target(tag, &log, &[]),
            "socket = \"port\"\nreply_topic = \"{topic}/out\"\nidle = \"30s\"\ngrace = \"1s\"",
        ),
    );
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("sensors/+/+/out", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-p").await;
    for p in ["one", "two"] {
        assert_eq!(
            dev.publish("sensors/dev-p/temp", p, QoS::AtLeastOnce, false)
                .await
                .expect("PUBACK once the function answered"),
            0
        );
    }
    let got: BTreeSet<String> = replies(&mut app, 2)
        .await
        .into_iter()
        .map(|(_, r)| r["data"].as_str().expect("text").to_owned())
        .collect();
    assert_eq!(got, BTreeSet::from(["one".to_owned(), "two".to_owned()]));
    let starts = log.starts();
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert_eq!(
        starts[0]["fd3"], false,
        "socket = \"port\": no LISTEN_FDS, it bound $PORT itself"
    );
    assert_eq!(function_metric(&gw, "cold_starts_total", "ported"), 1.0);
    gw.shutdown();
}

/// Issue 29 item 8: a function written to Knative's runtime contract only — it binds `$PORT`
/// itself and ignores `LISTEN_FDS`, as `python -m http.server $PORT`, Flask or Express do —
/// under the default config (no `socket` key). Before, sluice held `$PORT` for fd 3 by
/// default: the function died on "Address already in use" at every start and every event was
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_that_binds_port_itself_works_with_the_default_config_and_nothing_is_dead_lettered(
) {
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-contract-port";
    let gw = gateway(
        1,
        &function_toml(
            "contract",
            &["sensors/#"],
            &local_target(tag, &log, &[("FN_BIND", "port")]),
            "reply_topic = \"{topic}/out\"\nidle = \"1s\"\ngrace = \"1s\"\nretries = 1",
        ),
    );
    let mut dlq = dlq_subscriber(&gw, "contract").await;
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("sensors/+/+/out", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-k").await;
    let mut sent = BTreeSet::new();
    // Two cold starts: the first instance (sluice learns it binds $PORT) and, after it went
    // idle, the next (started with $PORT only).
    for round in 0..2 {
        for i in 0..3 {
            let p = format!("r{round}-{i}");
            assert_eq!(
                dev.publish("sensors/dev-k/temp", p.clone(), QoS::AtLeastOnce, false)
                    .await
                    .expect("PUBACK once the function answered"),
                0
            );
            sent.insert(p);
        }
        if round == 0 {
            scaled_to_zero(&gw, "contract", tag, Duration::from_secs(10)).await;
        }
    }
    let got: BTreeSet<String> = replies(&mut app, sent.len())
        .await
        .into_iter()
        .map(|(_, r)| r["data"].as_str().expect("text").to_owned())
        .collect();
    assert_eq!(got, sent, "every event answered");
    assert_eq!(function_metric(&gw, "dead_letters_total", "contract"), 0.0);
    assert!(
        dlq.recv(Duration::from_millis(300))
            .await
            .unwrap()
            .is_none(),
        "nothing dead-lettered"
    );
    let starts = log.starts();
    assert_eq!(starts.len(), 2, "two cold starts, no crash: {starts:?}");
    assert!(starts.iter().all(|s| s["fd3"] == false), "{starts:?}");
    assert_eq!(
        function_metric(&gw, "instance_crashes_total", "contract"),
        0.0
    );
    assert_eq!(function_status(&gw, "contract")["socket"], "port");
    assert_eq!(invocations(&gw, "contract", "ok"), 6.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_scales_to_zero_when_idle_and_cold_starts_again_without_losing_events() {
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-scale-to-zero";
    let gw = gateway(
        2,
        &function_toml(
            "sleepy",
            &["sensors/#"],
            &local_target(tag, &log, &[]),
            "reply_topic = \"{topic}/out\"\nidle = \"1s\"\ngrace = \"1s\"\nmax_instances = 1",
        ),
    );
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("sensors/+/+/out", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-z").await;

    // No event yet: nothing runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(observed(&gw, "sleepy", tag), (0, vec![]));
    assert!(log.starts().is_empty());
    assert_eq!(function_metric(&gw, "cold_starts_total", "sleepy"), 0.0);

    // The first event starts one instance, which answers it.
    assert_eq!(
        dev.publish("sensors/dev-z/temp", "first", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    let got = replies(&mut app, 1).await;
    assert_eq!(got[0].1["data"], "first");
    let (n, procs) = observed(&gw, "sleepy", tag);
    assert_eq!(
        (n, procs.len()),
        (1, 1),
        "one instance after the first event: {procs:?}"
    );
    assert_eq!(procs[0].1, std::process::id());
    assert_eq!(function_metric(&gw, "cold_starts_total", "sleepy"), 1.0);

    // Idle for 1 s: stopped, process gone.
    scaled_to_zero(&gw, "sleepy", tag, Duration::from_secs(10)).await;
    assert!(function_metric(&gw, "instance_stops_total", "sleepy") >= 1.0);

    // The next events cold-start it again; none is lost.
    let sent: Vec<String> = (0..10).map(|i| format!("again-{i}")).collect();
    publish_all(&mut dev, "sensors/dev-z/temp", &sent, 10).await;
    let got: BTreeSet<String> = replies(&mut app, sent.len())
        .await
        .into_iter()
        .map(|(_, r)| r["data"].as_str().expect("text").to_owned())
        .collect();
    assert_eq!(got, sent.iter().cloned().collect::<BTreeSet<_>>());
    assert_eq!(log.starts().len(), 2, "{:?}", log.starts());
    assert_eq!(log.with_status(Some(200)).len(), 11);
    assert_eq!(function_metric(&gw, "cold_starts_total", "sleepy"), 2.0);
    assert_eq!(function_metric(&gw, "instance_starts_total", "sleepy"), 2.0);
    assert_eq!(function_metric(&gw, "replies_total", "sleepy"), 11.0);
    assert_eq!(function_metric(&gw, "dead_letters_total", "sleepy"), 0.0);
    scaled_to_zero(&gw, "sleepy", tag, Duration::from_secs(10)).await;
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_scales_out_to_max_instances_and_back_to_zero() {
    const MAX_INSTANCES: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-burst";
    let gw = Arc::new(gateway(
        2,
        &function_toml(
            "busy",
            &["burst/#"],
            &local_target(tag, &log, &[("FN_SLEEP_MS", "50")]),
            &format!(
                "concurrency = 2\nmax_instances = {MAX_INSTANCES}\nidle = \"1s\"\ngrace = \"1s\""
            ),
        ),
    ));
    // Watch instances and processes while the burst runs.
    let most_instances = Arc::new(AtomicUsize::new(0));
    let most_processes = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (gw, mi, mp, done) = (
            gw.clone(),
            most_instances.clone(),
            most_processes.clone(),
            done.clone(),
        );
        tokio::spawn(async move {
            while !done.load(Ordering::Acquire) {
                let (n, procs) = observed(&gw, "busy", tag);
                mi.fetch_max(n, Ordering::AcqRel);
                mp.fetch_max(procs.len(), Ordering::AcqRel);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // 200 events: four devices (two per shard), 50 each, up to 20 unacknowledged each.
    let started = Instant::now();
    let mut tasks = Vec::new();
    for id in ids_on_shards("burst", 2, 2).into_iter().flatten() {
        let mut dev = device(&gw, &id).await;
        tasks.push(tokio::spawn(async move {
            let sent: Vec<String> = (0..50).map(|i| format!("{id}-{i}")).collect();
            publish_all(&mut dev, &format!("burst/{id}"), &sent, 20).await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let took = started.elapsed();
    done.store(true, Ordering::Release);
    watcher.await.unwrap();

    let requests = log.with_status(Some(200));
    assert_eq!(requests.len(), 200, "every event answered once");
    let mut per_pid: BTreeMap<u64, usize> = BTreeMap::new();
    for r in &requests {
        *per_pid.entry(r["pid"].as_u64().unwrap()).or_default() += 1;
    }
    assert_eq!(
        per_pid.len(),
        MAX_INSTANCES,
        "the burst ({took:?}) was served by max_instances processes: {per_pid:?}"
    );
    assert_eq!(most_instances.load(Ordering::Acquire), MAX_INSTANCES);
    assert!(
        most_processes.load(Ordering::Acquire) <= MAX_INSTANCES,
        "never more than max_instances processes: {} at once; starts {:?}; status {}",
        most_processes.load(Ordering::Acquire),
        log.starts(),
        function_status(&gw, "busy")
    );
    assert_eq!(
        function_metric(&gw, "instance_starts_total", "busy"),
        MAX_INSTANCES as f64
    );
    // Idle for 1 s: back to zero.
    scaled_to_zero(&gw, "busy", tag, Duration::from_secs(15)).await;
    assert_eq!(
        function_metric(&gw, "instance_stops_total", "busy"),
        MAX_INSTANCES as f64
    );
    let gw = Arc::try_unwrap(gw).unwrap_or_else(|_| panic!("the watcher is done"));
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_that_crashes_on_start_is_backed_off_while_the_cloud_keeps_its_rate() {
    let cloud = Cloud::start();
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-crash-on-start";
    let gw = gateway(
        2,
        &format!(
            "{}{}",
            cloud.uplink_toml(None, "forward = [\"sensors/#\", \"warmup/#\"]"),
            function_toml(
                "crashy",
                &["sensors/#"],
                &local_target(tag, &log, &[("FN_CRASH_ON_START", "1")]),
                "start_timeout = \"1s\"\ntimeout = \"1s\"\nretries = 1\nretry_min = \"50ms\"\nretry_max = \"200ms\"\ngrace = \"200ms\"\nmax_instances = 1",
            )
        ),
    );
    let mut dlq = dlq_subscriber(&gw, "crashy").await;
    let s = Stream {
        topic: "sensors/dev-c/temp",
        count: 20,
        period: Duration::from_millis(50),
    };
    let started = Instant::now();
    let (mut dev, ids) = publish_at_rate_and_check_the_cloud(&gw, &cloud, &s).await;

    // Restarted, but with a growing backoff: a handful of starts in 4 s, not a busy loop
    // (a Python start takes ~50 ms here, so a loop without backoff would start ~80).
    let watch_until = started + Duration::from_secs(4);
    tokio::time::sleep_until(watch_until).await;
    let crashes = function_metric(&gw, "instance_crashes_total", "crashy");
    let starts = log.starts();
    assert!(
        crashes >= 2.0,
        "the crashing instance was restarted and crashed again: {crashes}"
    );
    assert!(
        starts.len() <= 12,
        "{} starts in 4 s: a crash loop without backoff: {starts:?}",
        starts.len()
    );
    let times: Vec<f64> = starts.iter().filter_map(|s| s["t"].as_f64()).collect();
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps.len() >= 2 && gaps[gaps.len() - 1] > gaps[0],
        "the wait between restarts grows: {gaps:?}"
    );
    assert!(
        log.requests().is_empty(),
        "no instance lived to answer: {:?}",
        log.requests()
    );

    // The events could not be delivered: each is dead-lettered and acknowledged.
    let errors = expect_dead_letters(&mut dev, ids, &mut dlq, &s, None).await;
    assert!(!errors.is_empty());
    assert_eq!(
        function_metric(&gw, "dead_letters_total", "crashy"),
        s.count as f64
    );
    assert_eq!(invocations(&gw, "crashy", "ok"), 0.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_dies_mid_request_is_replaced_and_later_events_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let log = FunctionLog::in_dir(dir.path());
    let tag = "fn-test-dies-mid-request";
    let gw = gateway(
        1,
        &function_toml(
            "fragile",
            &["jobs/#"],
            &local_target(tag, &log, &[]),
            "reply_topic = \"{topic}/out\"\nretries = 1\nretry_min = \"50ms\"\nidle = \"30s\"\ngrace = \"1s\"\nmax_instances = 1",
        ),
    );
    let mut dlq = dlq_subscriber(&gw, "fragile").await;
    let mut app = device(&gw, "app").await;
    app.subscribe(&[("jobs/+/+/out", QoS::AtLeastOnce)])
        .await
        .unwrap();
    let mut dev = device(&gw, "dev-f").await;
    assert_eq!(
        dev.publish("jobs/ok/1", "before", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    // The instance exits while handling this one, and so does its replacement on the retry.
    assert_eq!(
        dev.publish("jobs/exit/2", "deadly", QoS::AtLeastOnce, false)
            .await
            .expect("PUBACK after the dead letter"),
        0
    );
    let p = dlq
        .recv(T)
        .await
        .unwrap()
        .expect("the deadly event dead-lettered");
    assert_eq!(&p.payload[..], b"deadly");
    assert_eq!(user_property(&p, "attempts").as_deref(), Some("2"));
    // A new instance answers what comes next.
    for i in 3..6 {
        assert_eq!(
            dev.publish(&format!("jobs/ok/{i}"), "after", QoS::AtLeastOnce, false)
                .await
                .expect("PUBACK from a new instance"),
            0
        );
    }
    let got: BTreeSet<String> = replies(&mut app, 4)
        .await
        .into_iter()
        .map(|(topic, _)| topic)
        .collect();
    let want: BTreeSet<String> = [1, 3, 4, 5]
        .iter()
        .map(|i| format!("jobs/ok/{i}/out"))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        function_metric(&gw, "instance_crashes_total", "fragile"),
        2.0,
        "one exit per attempt"
    );
    let starts = log.starts();
    assert_eq!(
        starts.len(),
        3,
        "the first, the retry's, the next events': {starts:?}"
    );
    let procs = processes_tagged(tag);
    assert_eq!(procs.len(), 1, "only the last instance runs: {procs:?}");
    assert_eq!(starts[2]["start"], procs[0].0);
    gw.shutdown();
}
