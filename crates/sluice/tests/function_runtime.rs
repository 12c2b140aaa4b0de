//! The local function runtime with real processes: a small Python 3 HTTP server (written to a
//! temp dir by each test) started on demand through `functions::runtime::start`, reached with
//! raw HTTP the way a dispatcher would (a slot from the handle, a request to the instance's
//! address), stopped when idle, restarted with backoff when it crashes, killed at shutdown.
//!
//! The tests run one at a time (`SERIAL`): the runtime thread wakes on every SIGCHLD of the
//! process, so another test's children would blur the "nothing wakes" measurement, and the
//! runtime thread of a test is found by name.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sluice::config::FunctionConfig;
use sluice::functions::runtime::{self, FunctionStatus, Runtime};
use sluice::functions::FunctionHandle;

static SERIAL: Mutex<()> = Mutex::new(());

const SERVER: &str = r#"
import http.server, os, signal, socket, sys

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = "pid={} listen_pid={} service={} revision={} function={} port={} greeting={}".format(
            os.getpid(), os.environ.get("LISTEN_PID", ""), os.environ.get("K_SERVICE"),
            os.environ.get("K_REVISION"), os.environ.get("SLUICE_FUNCTION"),
            os.environ.get("PORT"), os.environ.get("GREETING")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("LISTEN_FDS") == "1" and not os.environ.get("BIND_PORT"):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
    srv.socket.close()
    srv.socket = socket.socket(fileno=3)
else:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler)
srv.serve_forever()
"#;

struct Fixture {
    _serial: MutexGuard<'static, ()>,
    dir: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fn.py"), SERVER).unwrap();
    Fixture {
        _serial: serial,
        dir,
    }
}

/// A local function running the test server, with `extra` config lines.
/// `env` defaults to `GREETING = "hello"`.
fn python_function(dir: &Path, extra: &str) -> Arc<FunctionHandle> {
    let env = if extra.contains("env =") {
        ""
    } else {
        "env = { GREETING = \"hello\" }\n"
    };
    function(&format!(
        "command = [\"python3\", \"fn.py\"]\ndir = {:?}\n{env}{extra}",
        dir.to_str().unwrap()
    ))
}

fn function(body: &str) -> Arc<FunctionHandle> {
    let cfg: FunctionConfig =
        toml::from_str(&format!("name = \"enrich\"\ntopics = [\"#\"]\n{body}")).unwrap();
    FunctionHandle::new(0, Arc::new(cfg))
}

/// `GET /` on a fresh connection; the body.
fn get(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: fn\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned()
}

/// One request as a dispatcher makes it: a slot, the request, the first answer moves the
/// instance from starting to running.
fn invoke(h: &Arc<FunctionHandle>) -> String {
    // A dispatcher waits for the instance set to change; an instance started with
    // `socket = "auto"` (the default) is published once it serves.
    let deadline = Instant::now() + Duration::from_secs(10);
    let slot = loop {
        if let Some(slot) = h.acquire() {
            break slot;
        }
        assert!(
            Instant::now() < deadline,
            "an instance with room: starts {} stops {} crashes {} waiting {}",
            h.metrics.starts.get(),
            h.metrics.stops.get(),
            h.metrics.crashes.get(),
            h.waiting()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let body = get(slot.instance().addr.unwrap());
    if slot.instance().mark_answered() {
        h.metrics.instances_starting.sub(1);
        h.metrics.instances_running.add(1);
    }
    body
}

fn field<'a>(body: &'a str, key: &str) -> &'a str {
    body.split(' ')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("{key} in {body}"))
}

/// Scaled to zero with an inherited socket: the published set is one standby (a listening
/// socket, no process) that accepts connections.
fn assert_standby_only(h: &Arc<FunctionHandle>) {
    wait_until(Duration::from_secs(1), "the standby", || {
        let set = h.instances();
        set.len() == 1 && set[0].is_standby()
    });
    let addr = h.instances()[0].addr.expect("a local address");
    std::net::TcpStream::connect(addr).expect("the standby's socket listens");
}

fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn instances(rt: &Runtime) -> Vec<runtime::InstanceStatus> {
    rt.status().into_iter().flat_map(|f| f.instances).collect()
}

fn runtime_threads() -> HashSet<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            // "sluice-functions", cut to Linux's 15 characters.
            (comm.trim() == "sluice-function").then(|| e.file_name().into_string().unwrap())
        })
        .collect()
}

/// Context switches of thread `tid` of this process so far.
fn switches(tid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("ctxt_switches"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

#[test]
fn an_instance_starts_on_demand_answers_a_queued_request_then_stops_when_idle_and_nothing_wakes() {
    let fx = fixture();
    let h = python_function(
        fx.dir.path(),
        "socket = \"inherit\"\nidle = \"300ms\"\nconcurrency = 4\n",
    );
    let before = runtime_threads();
    let rt = runtime::start(vec![h.clone()]).unwrap();
    let mut tid = None;
    wait_until(Duration::from_secs(1), "the runtime thread (named)", || {
        tid = runtime_threads().difference(&before).next().cloned();
        tid.is_some()
    });
    let tid = tid.unwrap();

    std::thread::sleep(Duration::from_millis(200));
    assert!(instances(&rt).is_empty(), "no instance before a demand");
    assert_standby_only(&h);

    // Sent at once into the standby's backlog; taking its slot asks for the process, and the
    // answer comes once Python has started.
    let body = invoke(&h);
    let st = instances(&rt);
    assert_eq!(st.len(), 1);
    let pid = st[0].pid;
    assert_eq!(field(&body, "pid"), pid.to_string());
    assert_eq!(
        field(&body, "listen_pid"),
        pid.to_string(),
        "LISTEN_PID is the child's pid"
    );
    assert_eq!(field(&body, "service"), "enrich");
    assert_eq!(field(&body, "revision"), "enrich-1");
    assert_eq!(field(&body, "function"), "enrich");
    assert_eq!(field(&body, "port"), st[0].port.to_string());
    assert_eq!(field(&body, "greeting"), "hello", "the configured env");
    assert_eq!(instances(&rt)[0].state, "running");
    let used = Instant::now();

    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(instances(&rt).len(), 1, "still there before idle");
    wait_until(Duration::from_secs(2), "the idle stop", || {
        instances(&rt).is_empty() && !alive(pid)
    });
    assert!(used.elapsed() >= Duration::from_millis(300));
    assert_standby_only(&h);
    let m = &h.metrics;
    assert_eq!((m.starts.get(), m.stops.get(), m.crashes.get()), (1, 1, 0));
    assert_eq!(m.cold_starts.get(), 1);
    assert_eq!(
        (m.instances_starting.get(), m.instances_running.get()),
        (0, 0)
    );

    // Scaled to zero, no predictor: the thread sleeps until the next event.
    std::thread::sleep(Duration::from_millis(100));
    let s0 = switches(&tid);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        switches(&tid),
        s0,
        "the runtime thread woke with nothing to do"
    );
    rt.stop();
}

#[test]
fn load_beyond_one_instance_starts_more_up_to_max_instances() {
    let fx = fixture();
    let h = python_function(fx.dir.path(), "concurrency = 2\nmax_instances = 3\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    h.wait_begin(9); // nine events wait: ceil(9 / 2) = 5, clamped to 3
    h.demand();
    wait_until(Duration::from_secs(2), "three instances", || {
        h.instances().len() == 3
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(instances(&rt).len(), 3, "never above max_instances");
    h.wait_end(9);
    for _ in 0..3 {
        invoke(&h);
    }
    assert_eq!(h.metrics.cold_starts.get(), 1, "one demand, one cold start");
    let pids: Vec<u32> = instances(&rt).iter().map(|i| i.pid).collect();
    rt.stop();
    assert!(pids.iter().all(|&p| !alive(p)));
}

#[test]
fn port_mode_publishes_the_instance_once_it_accepts_connections() {
    let fx = fixture();
    let h = python_function(fx.dir.path(), "socket = \"port\"\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    h.wait_begin(1);
    h.demand();
    wait_until(Duration::from_secs(10), "a published instance", || {
        !h.instances().is_empty()
    });
    h.wait_end(1);
    let addr = h.instances()[0].addr.unwrap();
    TcpStream::connect(addr).expect("published only once it accepts");
    let body = invoke(&h);
    assert_eq!(
        field(&body, "listen_pid"),
        "",
        "no socket activation in port mode"
    );
    assert_eq!(field(&body, "port"), addr.port().to_string());
    let pid = instances(&rt)[0].pid;
    rt.stop();
    assert!(!alive(pid));
}

/// The default (`socket = "auto"`) with a server that takes fd 3 when offered: the first
/// instance is watched (not published before it serves), its fd 3 is found in use, and every
/// later start is the fd-3 fast start (a standby while scaled to zero).
#[test]
fn auto_finds_a_function_serving_fd3_and_keeps_the_fast_start_for_later_instances() {
    let fx = fixture();
    let h = python_function(fx.dir.path(), "idle = \"300ms\"\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(h.instances().is_empty(), "no standby before it is known");
    assert_eq!(rt.status()[0].socket, "detecting");
    h.wait_begin(1); // an event waits, as a dispatcher's would: no idle stop meanwhile
    h.demand();
    let body = invoke(&h);
    h.wait_end(1);
    let st = instances(&rt);
    assert_eq!(field(&body, "listen_pid"), st[0].pid.to_string(), "fd 3");
    assert_eq!(rt.status()[0].socket, "inherit");
    let pid = st[0].pid;
    wait_until(Duration::from_secs(5), "the idle stop", || !alive(pid));
    assert_standby_only(&h);
    let body = invoke(&h);
    assert_eq!(
        field(&body, "port"),
        h.instances()[0].addr.unwrap().port().to_string(),
        "the fast start: PORT is fd 3's port"
    );
    rt.stop();
}

/// The default with a server written to Knative's contract (binds `$PORT`, ignores
/// `LISTEN_FDS`, as `python -m http.server`, Flask, Express): it starts and answers (with
/// `socket = "inherit"` it would die on "Address already in use"), and later instances get
/// only `PORT`.
#[test]
fn auto_lets_a_function_bind_port_itself_and_later_instances_get_only_port() {
    let fx = fixture();
    let h = python_function(
        fx.dir.path(),
        "idle = \"300ms\"\nenv = { BIND_PORT = \"1\" }\n",
    );
    let rt = runtime::start(vec![h.clone()]).unwrap();
    h.wait_begin(1);
    h.demand();
    let body = invoke(&h);
    h.wait_end(1);
    let addr = h.instances()[0].addr.unwrap();
    assert_eq!(
        field(&body, "port"),
        addr.port().to_string(),
        "it serves $PORT"
    );
    assert_eq!(rt.status()[0].socket, "port");
    assert_eq!(h.metrics.crashes.get(), 0);
    let pid = instances(&rt)[0].pid;
    wait_until(Duration::from_secs(5), "the idle stop", || !alive(pid));
    std::thread::sleep(Duration::from_millis(100));
    assert!(h.instances().is_empty(), "no standby for a $PORT function");
    h.wait_begin(1);
    h.demand();
    let body = invoke(&h);
    h.wait_end(1);
    assert_eq!(field(&body, "listen_pid"), "", "no fd 3 once it is known");
    assert_eq!(h.metrics.crashes.get(), 0);
    rt.stop();
}

#[test]
fn a_command_that_exits_at_once_counts_crashes_with_a_growing_backoff_not_a_busy_loop() {
    let _fx = fixture();
    let h =
        function("command = [\"sh\", \"-c\", \"exit 3\"]\nmin_instances = 1\nmax_instances = 1\n");
    let remote = function("url = \"http://127.0.0.1:9/x\"\n");
    let rt = runtime::start(vec![remote.clone(), h.clone()]).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    // Starts at 0, 0.1, 0.3, 0.7, 1.5 s (holds of 100, 200, 400, 800 ms): about 5.
    let crashes = h.metrics.crashes.get();
    assert!((3..=6).contains(&crashes), "{crashes} crashes in 2 s");
    let st: Vec<FunctionStatus> = rt.status();
    assert_eq!(st.len(), 1, "a remote function has no runtime part");
    assert_eq!(
        remote.instances().len(),
        1,
        "its pseudo-instance is left alone"
    );
    assert_eq!(u64::from(st[0].consecutive_crashes), crashes);
    assert!(
        st[0].restart_backoff_ms >= 800,
        "backoff grew: {}",
        st[0].restart_backoff_ms
    );
    assert_eq!(
        h.metrics.starts.get(),
        crashes + u64::from(!st[0].instances.is_empty())
    );
    assert_eq!(h.metrics.stops.get(), 0);
    rt.stop();
    assert_eq!(h.metrics.instances_starting.get(), 0);
}

#[test]
fn stopping_or_dropping_the_runtime_kills_its_children() {
    let fx = fixture();
    let h = python_function(fx.dir.path(), "min_instances = 2\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    wait_until(Duration::from_secs(2), "min_instances", || {
        instances(&rt).len() == 2
    });
    let pids: Vec<u32> = instances(&rt).iter().map(|i| i.pid).collect();
    invoke(&h);
    let t = Instant::now();
    rt.stop();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "SIGTERM suffices: no grace wait"
    );
    assert!(pids.iter().all(|&p| !alive(p)), "children reaped");
    assert!(h.instances().is_empty());

    let h = python_function(fx.dir.path(), "min_instances = 1\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    wait_until(Duration::from_secs(2), "min_instances", || {
        instances(&rt).len() == 1
    });
    let pid = instances(&rt)[0].pid;
    drop(rt);
    assert!(!alive(pid));
}

#[test]
fn a_child_that_ignores_sigterm_is_killed_after_grace() {
    let fx = fixture();
    let h = python_function(
        fx.dir.path(),
        "min_instances = 1\ngrace = \"400ms\"\nenv = { IGNORE_TERM = \"1\" }\n",
    );
    let rt = runtime::start(vec![h.clone()]).unwrap();
    wait_until(Duration::from_secs(2), "min_instances", || {
        !h.instances().is_empty()
    });
    invoke(&h); // answered: its SIGTERM handler is in place
    let pid = instances(&rt)[0].pid;
    let t = Instant::now();
    rt.stop();
    let took = t.elapsed();
    assert!(!alive(pid));
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(3),
        "stopped after {took:?}"
    );
}

#[test]
fn with_prewarm_predict_and_little_history_an_instance_is_kept_idle_after_the_last_arrival() {
    let fx = fixture();
    let h = python_function(fx.dir.path(), "idle = \"1s\"\nprewarm = \"predict\"\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    let arrival = Instant::now();
    h.note_arrival(); // as a dispatcher does for each event, then finds no instance
    h.demand();
    wait_until(Duration::from_secs(2), "an instance", || {
        !instances(&rt).is_empty()
    });
    let pid = instances(&rt)[0].pid;
    invoke(&h);
    // The histogram policy has no history: its fallback keeps the instance `idle` after the
    // last arrival it heard of (not after the last use, as prewarm = "off" does).
    std::thread::sleep(Duration::from_millis(700).saturating_sub(arrival.elapsed()));
    assert_eq!(instances(&rt).len(), 1);
    wait_until(Duration::from_secs(2), "the stop", || {
        instances(&rt).is_empty() && !alive(pid)
    });
    assert!(arrival.elapsed() >= Duration::from_secs(1));
    let m = &h.metrics;
    assert_eq!((m.stops.get(), m.crashes.get()), (1, 0));
    assert_eq!(
        (m.prewarm_hits.get(), m.prewarm_misses.get()),
        (0, 0),
        "nothing pre-warmed"
    );
    rt.stop();
}

#[test]
fn a_program_that_cannot_start_is_retried_with_backoff_too() {
    let _fx = fixture();
    for command in ["[\"no-such-program-in-path\"]", "[\"/nonexistent/fn\"]"] {
        let h = function(&format!("command = {command}\nmin_instances = 1\n"));
        let rt = runtime::start(vec![h.clone()]).unwrap();
        std::thread::sleep(Duration::from_millis(800));
        // Attempts at 0, 0.1, 0.3, 0.7 s.
        let crashes = h.metrics.crashes.get();
        assert!(
            (2..=5).contains(&crashes),
            "{command}: {crashes} failed starts"
        );
        assert_eq!(h.metrics.starts.get(), 0);
        assert_eq!(h.metrics.instances_starting.get(), 0);
        assert!(instances(&rt).is_empty());
        // An inherited socket's instance is published before its fork; a failed exec takes
        // it back out, so no dispatcher is left writing into a closed backlog (a fresh
        // standby may stand in its place).
        assert!(
            h.instances().iter().all(|i| i.is_standby()),
            "{command}: a failed start left an instance to dispatch to"
        );
        rt.stop();
    }
}

#[test]
fn a_running_instance_that_dies_is_unpublished_counted_and_replaced_after_a_backoff() {
    let fx = fixture();
    let h = python_function(fx.dir.path(), "min_instances = 1\n");
    let rt = runtime::start(vec![h.clone()]).unwrap();
    wait_until(Duration::from_secs(2), "min_instances", || {
        !h.instances().is_empty()
    });
    invoke(&h);
    let first = instances(&rt)[0].clone();
    let killed = Instant::now();
    std::process::Command::new("kill")
        .args(["-KILL", &first.pid.to_string()])
        .status()
        .unwrap();
    wait_until(Duration::from_secs(2), "a replacement", || {
        instances(&rt).iter().any(|i| i.id != first.id)
    });
    assert!(
        killed.elapsed() >= Duration::from_millis(90),
        "restarted only after the backoff"
    );
    assert_eq!(h.metrics.crashes.get(), 1);
    assert_eq!(rt.status()[0].consecutive_crashes, 1);
    assert_eq!(h.instances().len(), 1);
    assert_ne!(h.instances()[0].id, first.id, "the dead one is unpublished");
    assert_eq!(
        (
            h.metrics.instances_running.get(),
            h.metrics.instances_starting.get()
        ),
        (0, 1),
        "the dead one had answered: running - 1; the new one is starting"
    );
    invoke(&h);
    rt.stop();
}
