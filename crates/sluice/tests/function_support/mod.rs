//! Set-up for the edge-function tests (`functions_remote.rs`, `functions_local.rs`): the
//! Python function `echo_function.py` (CloudEvents SDK, HTTP/1.1 keep-alive; its docstring
//! lists its modes), started by the test as a remote function or by sluice as a local one, the
//! log it writes of every start and request, `[[function]]` sections, and readers of the
//! function's status, metrics and processes.
//!
//! A Python without the CloudEvents SDK fails the test with a message naming what to install
//! (`./scripts/test` installs it); nothing is skipped.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice::app::RunningGateway;
use sluice_proto::mqtt::{ProtocolVersion, Publish, QoS};
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::time::Instant;

use crate::common::{device_opts, metric_sum, Cloud};

/// The function every test runs (see its docstring).
pub const ECHO_FUNCTION: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/function_support/echo_function.py"
);

/// The Python interpreter itself (`sys.executable` of `python3`, or of `$SLUICE_TEST_PYTHON`),
/// after checking it can import the CloudEvents SDK. The interpreter's own path, not a
/// launcher's (pyenv's `python3` is a shell script whose subshells would show up as extra
/// processes of the function).
pub fn python_with_cloudevents() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let python = std::env::var_os("SLUICE_TEST_PYTHON")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("python3"));
            let out = Command::new(&python)
                .args([
                    "-c",
                    "import sys, cloudevents.core.bindings.http; print(sys.executable)",
                ])
                .stderr(Stdio::null())
                .output();
            let executable = out
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .filter(|p| !p.is_empty());
            match executable {
                Some(p) => PathBuf::from(p),
                None => panic!(
                    "{} cannot import the CloudEvents SDK: the function tests need cloudevents \
                     2.2.0; ./scripts/test installs it (or: python3 -m pip install \
                     cloudevents==2.2.0)",
                    python.display()
                ),
            }
        })
        .clone()
}

/// What the function wrote to its `FN_LOG`: one JSON object per line.
pub struct FunctionLog {
    pub path: PathBuf,
}

impl FunctionLog {
    /// A log file in `dir` (created by the function on its first line).
    pub fn in_dir(dir: &Path) -> FunctionLog {
        FunctionLog {
            path: dir.join("function.log"),
        }
    }

    /// Every line so far (none before the first start).
    pub fn entries(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        text.lines()
            .filter(|l| l.ends_with('}'))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("log line {l:?}: {e}")))
            .collect()
    }

    /// The start records (`{"start": PID, "fd3": BOOL}`), one per process started.
    pub fn starts(&self) -> Vec<serde_json::Value> {
        self.entries()
            .into_iter()
            .filter(|e| e.get("start").is_some())
            .collect()
    }

    /// The request records (`{"pid", "port", "id", "subject", "status", …}`).
    pub fn requests(&self) -> Vec<serde_json::Value> {
        self.entries()
            .into_iter()
            .filter(|e| e.get("port").is_some())
            .collect()
    }

    /// Requests answered with `status` (null: hang or exit).
    pub fn with_status(&self, status: Option<u16>) -> Vec<serde_json::Value> {
        let want = status.map_or(serde_json::Value::Null, |s| s.into());
        self.requests()
            .into_iter()
            .filter(|e| e["status"] == want)
            .collect()
    }
}

/// The function run by the test itself on a free loopback port: a remote function's server.
pub struct RemoteFunction {
    child: Child,
    pub addr: SocketAddr,
    pub log: FunctionLog,
    _dir: tempfile::TempDir,
}

impl RemoteFunction {
    /// Start `echo_function.py` with extra environment `env` (e.g. `FN_MODE`); returns once it
    /// accepts connections.
    pub fn start(env: &[(&str, &str)]) -> RemoteFunction {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = FunctionLog::in_dir(dir.path());
        let mut child = Command::new(python_with_cloudevents())
            .arg(ECHO_FUNCTION)
            .env("PORT", "0")
            .env_remove("LISTEN_FDS")
            .env("FN_LOG", &log.path)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start python3 echo_function.py");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
        let port: u16 = match line.trim().strip_prefix("listening ") {
            Some(p) => p.parse().expect("a port number"),
            None => {
                let _ = child.kill();
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("echo_function.py did not start (stdout {line:?}): {err}");
            }
        };
        RemoteFunction {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
            _dir: dir,
        }
    }

    /// Its `url` for a `[[function]]` section.
    pub fn url(&self) -> String {
        format!("http://{}/events", self.addr)
    }
}

impl Drop for RemoteFunction {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `[[function]]` section: `name`, `topics`, `target` (a `url = …` or `command = …` line)
/// and `extra` lines.
pub fn function_toml(name: &str, topics: &[&str], target: &str, extra: &str) -> String {
    let topics: Vec<String> = topics.iter().map(|t| format!("{t:?}")).collect();
    format!(
        "[[function]]\nname = \"{name}\"\ntopics = [{}]\n{target}\n{extra}\n",
        topics.join(", ")
    )
}

/// `command = ["python3", echo_function.py, "--tag", tag]` (the tag finds its processes) and
/// `env` with `FN_LOG` and `vars`, for a local function.
pub fn local_target(tag: &str, log: &FunctionLog, vars: &[(&str, &str)]) -> String {
    let python = python_with_cloudevents();
    let mut env = format!("FN_LOG = {:?}", log.path.display().to_string());
    for (k, v) in vars {
        env.push_str(&format!(", {k} = {v:?}"));
    }
    format!(
        "command = [{:?}, {ECHO_FUNCTION:?}, \"--tag\", {tag:?}]\nenv = {{ {env} }}",
        python.display().to_string()
    )
}

/// The function's entry in /api/v1/status.
pub fn function_status(gw: &RunningGateway, name: &str) -> serde_json::Value {
    let status = gw.status_json();
    status["functions"]
        .as_array()
        .and_then(|a| a.iter().find(|f| f["name"] == name).cloned())
        .unwrap_or_else(|| panic!("function {name} not in the status: {status}"))
}

/// Instances the status lists for the function.
pub fn instance_count(gw: &RunningGateway, name: &str) -> usize {
    function_status(gw, name)["instances"]
        .as_array()
        .map_or(0, Vec::len)
}

/// `sluice_function_{what}{function="name"…}` summed over the remaining labels.
pub fn function_metric(gw: &RunningGateway, what: &str, name: &str) -> f64 {
    metric_sum(
        &gw.metrics_text(),
        &format!("sluice_function_{what}{{function=\"{name}\""),
    )
}

/// `sluice_function_invocations_total` of one outcome (ok, http_error, timeout,
/// connection_error).
pub fn invocations(gw: &RunningGateway, name: &str, outcome: &str) -> f64 {
    metric_sum(
        &gw.metrics_text(),
        &format!("sluice_function_invocations_total{{function=\"{name}\",outcome=\"{outcome}\"}}"),
    )
}

/// Live processes whose command line holds `tag` (zombies have none): (pid, parent pid).
pub fn processes_tagged(tag: &str) -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if !cmdline.split(|&b| b == 0).any(|arg| arg == tag.as_bytes()) {
            continue;
        }
        let ppid = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|s| {
                // pid (comm) state ppid …; comm may hold spaces and parentheses.
                let rest = &s[s.rfind(')')? + 1..];
                rest.split_whitespace().nth(1)?.parse().ok()
            })
            .unwrap_or(0);
        found.push((pid, ppid));
    }
    found
}

/// The machine's host name, as sluice puts it in `ce-source`.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Seconds since the epoch of an RFC 3339 time (`2024-01-02T03:04:05.500000+00:00` or
/// `…Z`), UTC only.
pub fn unix_seconds(rfc3339: &str) -> Option<f64> {
    let (date, rest) = rfc3339.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let clock = rest
        .strip_suffix('Z')
        .or_else(|| rest.strip_suffix("+00:00"))?;
    let mut c = clock.split(':');
    let (h, min) = (
        c.next()?.parse::<i64>().ok()?,
        c.next()?.parse::<i64>().ok()?,
    );
    let s: f64 = c.next()?.parse().ok()?;
    // Days from civil (proleptic Gregorian).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + min * 60) as f64 + s)
}

/// Now, in seconds since the epoch.
pub fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

/// Time allowed for a reply, a dead letter or a cloud message.
pub const T: Duration = Duration::from_secs(15);

/// An MQTT 5 device whose acknowledgement waits may take 25 s (a function's retries).
pub async fn device(gw: &RunningGateway, id: &str) -> TestClient {
    let mut c = device_opts(gw, ConnectOpts::new(ProtocolVersion::V5, id)).await;
    c.set_ack_timeout(Duration::from_secs(25));
    c
}

/// What a failing-function test publishes and observes.
pub struct Stream {
    /// Topic the device publishes on (matched by the function and the uplink).
    pub topic: &'static str,
    pub count: usize,
    pub period: Duration,
}

/// With the cloud subscribed and the uplink up, publish `s.count` QoS 1 messages (`m-{i}`) at
/// `s.period` without waiting for their PUBACKs, and check that the cloud receives each in
/// order within a second of its publish, whatever the function does. Returns the device with
/// the packet ids still to be acknowledged.
pub async fn publish_at_rate_and_check_the_cloud(
    gw: &RunningGateway,
    cloud: &Cloud,
    s: &Stream,
) -> (TestClient, Vec<u16>) {
    let mut cloud_sub = cloud.subscriber("cloud-app", "#").await;
    let mut dev = device(gw, "dev-c").await;
    // The uplink session of the device's shard is up once a message not for the function
    // reaches the cloud.
    assert_eq!(
        dev.publish("warmup/dev-c", "w", QoS::AtLeastOnce, false)
            .await
            .unwrap(),
        0
    );
    let w = cloud_sub
        .recv(T)
        .await
        .unwrap()
        .expect("warm-up at the cloud");
    assert_eq!(&*w.topic, "warmup/dev-c");

    let count = s.count;
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.len() < count && Instant::now() < deadline {
            match cloud_sub.recv(Duration::from_millis(500)).await.unwrap() {
                Some(p) => got.push((
                    p.topic.to_string(),
                    String::from_utf8_lossy(&p.payload).into_owned(),
                    Instant::now(),
                )),
                None => continue,
            }
        }
        got
    });
    let mut sent_at = Vec::new();
    let mut ids = Vec::new();
    let mut tick = tokio::time::interval(s.period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for i in 0..count {
        tick.tick().await;
        let id = dev
            .publish_no_wait(s.topic, format!("m-{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap()
            .unwrap();
        sent_at.push(Instant::now());
        ids.push(id);
    }
    let got = reader.await.unwrap();
    assert_eq!(
        got.len(),
        count,
        "the cloud got every message while the function failed: {got:?}"
    );
    let mut worst = Duration::ZERO;
    for (i, (topic, payload, at)) in got.iter().enumerate() {
        assert_eq!(
            (topic.as_str(), payload.as_str()),
            (s.topic, format!("m-{i}").as_str())
        );
        worst = worst.max(at.saturating_duration_since(sent_at[i]));
    }
    assert!(
        worst < Duration::from_secs(1),
        "each message reached the cloud within 1 s of its publish (at {:?} intervals) while \
         the function failed; the slowest took {worst:?}",
        s.period
    );
    (dev, ids)
}

/// A local MQTT 5 subscriber of `$sluice/dlq/{name}`.
pub async fn dlq_subscriber(gw: &RunningGateway, name: &str) -> TestClient {
    let mut dlq = device(gw, "ops").await;
    assert_eq!(
        dlq.subscribe(&[(format!("$sluice/dlq/{name}").as_str(), QoS::AtLeastOnce)])
            .await
            .unwrap(),
        vec![1]
    );
    dlq
}

/// Every acknowledgement arrives (a dead-lettered event is done), and `$sluice/dlq/{name}`
/// holds every message once with its user properties (`attempts` as given, when given);
/// returns the `error` properties.
pub async fn expect_dead_letters(
    dev: &mut TestClient,
    ids: Vec<u16>,
    dlq: &mut TestClient,
    s: &Stream,
    attempts: Option<&str>,
) -> BTreeSet<String> {
    for id in ids {
        assert_eq!(
            dev.wait_ack(id)
                .await
                .expect("PUBACK after the dead letter"),
            0
        );
    }
    let mut payloads = BTreeSet::new();
    let mut errors = BTreeSet::new();
    while payloads.len() < s.count {
        let p = dlq
            .recv(T)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("every event dead-lettered; got {payloads:?}"));
        assert_eq!(
            user_property(&p, "topic").as_deref(),
            Some(s.topic),
            "{p:?}"
        );
        assert_eq!(
            user_property(&p, "device").as_deref(),
            Some("dev-c"),
            "{p:?}"
        );
        let tried = user_property(&p, "attempts").expect("an attempts property");
        if let Some(attempts) = attempts {
            assert_eq!(tried, attempts, "{p:?}");
        }
        errors.insert(user_property(&p, "error").expect("an error property"));
        assert!(
            payloads.insert(String::from_utf8_lossy(&p.payload).into_owned()),
            "dead-lettered once: {p:?}"
        );
    }
    let want: BTreeSet<String> = (0..s.count).map(|i| format!("m-{i}")).collect();
    assert_eq!(payloads, want);
    errors
}

/// The MQTT 5 user property `key` of a message.
pub fn user_property(p: &Publish, key: &str) -> Option<String> {
    p.properties.as_ref().and_then(|props| {
        props
            .user_properties
            .iter()
            .find(|(k, _)| &**k == key)
            .map(|(_, v)| v.to_string())
    })
}
