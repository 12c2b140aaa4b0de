//! `[state] dir`: what a `kill -9` used to forget — retained messages, a persistent session's
//! subscriptions and queued QoS 1 messages, incoming QoS 2 ids awaiting PUBREL — is there
//! after a restart.
//!
//! The real `sluice` binary runs as a child process on a config with `[state] dir` in a
//! temporary directory (no uplink: retained messages and sessions are local). Before each
//! `kill -9` the test waits until `/metrics` shows the changes were committed
//! (`sluice_state_records_total`), the event the state's group commit reports; it never
//! sleeps to let time pass. Every child process is killed by a guard, also on panic.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice_proto::mqtt::QoS;
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const START_MAX: Duration = Duration::from_secs(20);
const WAIT: Duration = Duration::from_secs(10);

struct Sluice {
    config: PathBuf,
    stderr: PathBuf,
    child: Option<Child>,
    mqtt: SocketAddr,
    admin: SocketAddr,
}

impl Sluice {
    fn new(dir: &Path, state: bool) -> Sluice {
        Sluice::with_extra(dir, state, "")
    }

    fn with_extra(dir: &Path, state: bool, extra: &str) -> Sluice {
        let mqtt_port = sluice_testkit::free_port().expect("a free port");
        let admin_port = sluice_testkit::free_port().expect("a free port");
        let config = dir.join("sluice.toml");
        let state = if state {
            format!(
                "[state]\ndir = \"{}\"\ncommit_interval = \"10ms\"\n",
                dir.join("state").display()
            )
        } else {
            String::new()
        };
        std::fs::write(
            &config,
            format!(
                "[gateway]\nshards = 2\npin_threads = false\n\n\
                 [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\n\n\
                 [coap]\nenabled = false\n\n\
                 [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\n\
                 [log]\nlevel = \"info\"\n\n{state}\n{extra}"
            ),
        )
        .expect("write the config");
        Sluice {
            config,
            stderr: dir.join("sluice.stderr"),
            child: None,
            mqtt: SocketAddr::from(([127, 0, 0, 1], mqtt_port)),
            admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
        }
    }

    async fn start(&mut self) {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr)
            .expect("open stderr file");
        self.child = Some(
            Command::new(env!("CARGO_BIN_EXE_sluice"))
                .arg("run")
                .arg("-c")
                .arg(&self.config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .expect("spawn sluice"),
        );
        let deadline = Instant::now() + START_MAX;
        while tokio::net::TcpStream::connect(self.mqtt).await.is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("sluice exited ({status}); stderr:\n{}", self.stderr_tail());
            }
            assert!(
                Instant::now() < deadline,
                "sluice did not start; stderr:\n{}",
                self.stderr_tail()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL sluice");
            child.wait().expect("reap sluice");
        }
    }

    fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// One metric's value from `/metrics` (0 when absent).
    async fn metric(&self, name: &str) -> u64 {
        let Ok(mut s) = tokio::net::TcpStream::connect(self.admin).await else {
            return 0;
        };
        let req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
        if s.write_all(req.as_bytes()).await.is_err() {
            return 0;
        }
        let mut body = String::new();
        let _ = tokio::time::timeout(WAIT, s.read_to_string(&mut body)).await;
        body.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .map_or(0, |v| v as u64)
    }

    /// Wait until the state writer has committed at least `n` changes.
    async fn committed(&self, n: u64) {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.metric("sluice_state_records_total").await;
            if got >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {got} of {n} state changes committed; stderr:\n{}",
                self.stderr_tail()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn persistent(id: &str) -> ConnectOpts {
    let mut o = ConnectOpts::v311(id);
    o.clean_start = false;
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_and_a_persistent_sessions_queue_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut sluice = Sluice::new(dir.path(), true);
    sluice.start().await;

    // A device with a persistent session subscribes, then goes away.
    let (mut sub, ack) = TestClient::connect(sluice.mqtt, persistent("sleeper"))
        .await
        .unwrap();
    assert!(!ack.session_present);
    assert_eq!(
        sub.subscribe(&[("q/#", QoS::AtLeastOnce)]).await.unwrap(),
        vec![1]
    );
    sub.disconnect().await.unwrap();

    // Meanwhile: a retained message, and three QoS 1 messages queued for the sleeper.
    let (mut publisher, _) = TestClient::connect(sluice.mqtt, ConnectOpts::v311("pub"))
        .await
        .unwrap();
    publisher
        .publish("r/1", "kept", QoS::AtLeastOnce, true)
        .await
        .unwrap();
    for i in 0..3 {
        publisher
            .publish("q/x", format!("m{i}"), QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    // SessionOpen, Subscribe, SessionOffline, Retain, 3 x Enqueue.
    sluice.committed(7).await;
    sluice.kill_9();
    sluice.start().await;

    // The retained message is replayed to a new subscriber.
    let (mut fresh, _) = TestClient::connect(sluice.mqtt, ConnectOpts::v311("fresh"))
        .await
        .unwrap();
    fresh.subscribe(&[("r/#", QoS::AtLeastOnce)]).await.unwrap();
    let m = fresh
        .recv(WAIT)
        .await
        .unwrap()
        .expect("the retained message after the restart");
    assert_eq!(
        (&*m.topic, &m.payload[..], m.retain),
        ("r/1", &b"kept"[..], true)
    );

    // The sleeper's session is there, with its queue, and its subscription still routes.
    let (mut sub, ack) = TestClient::connect(sluice.mqtt, persistent("sleeper"))
        .await
        .unwrap();
    assert!(
        ack.session_present,
        "the persistent session survived the restart"
    );
    let mut got = Vec::new();
    for _ in 0..3 {
        let m = sub
            .recv(WAIT)
            .await
            .unwrap()
            .expect("a queued message after the restart");
        got.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    assert_eq!(got, ["m0", "m1", "m2"], "queued QoS 1 messages, in order");
    let (mut publisher, _) = TestClient::connect(sluice.mqtt, ConnectOpts::v311("pub"))
        .await
        .unwrap();
    publisher
        .publish("q/y", "after", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let m = sub
        .recv(WAIT)
        .await
        .unwrap()
        .expect("the restored subscription routes new messages");
    assert_eq!(&m.payload[..], b"after");
    let metric = sluice.metric("sluice_state_restored_sessions").await;
    assert_eq!(metric, 1);
}

/// A 3.1.1 device over a raw socket (the test client answers PUBREC by itself; this device
/// must be able not to).
struct RawDevice(tokio::net::TcpStream);

impl RawDevice {
    async fn connect(addr: SocketAddr, client_id: &str) -> (RawDevice, bool) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0, 0, 60];
        body.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
        body.extend_from_slice(client_id.as_bytes());
        let mut packet = vec![0x10, body.len() as u8];
        packet.extend_from_slice(&body);
        s.write_all(&packet).await.unwrap();
        let connack = RawDevice(s).read(4).await;
        (RawDevice(connack.1), connack.0[2] == 1)
    }
    async fn read(mut self, n: usize) -> (Vec<u8>, tokio::net::TcpStream) {
        let mut b = vec![0; n];
        tokio::time::timeout(WAIT, self.0.read_exact(&mut b))
            .await
            .expect("an answer in time")
            .expect("read from sluice");
        (b, self.0)
    }
    /// Send `bytes`, return the 4-byte answer.
    async fn exchange(&mut self, bytes: &[u8]) -> Vec<u8> {
        self.0.write_all(bytes).await.unwrap();
        let mut b = vec![0; 4];
        tokio::time::timeout(WAIT, self.0.read_exact(&mut b))
            .await
            .expect("an answer in time")
            .expect("read from sluice");
        b
    }
}

/// PUBLISH QoS 2, packet id 5, topic "z/1", payload "once" (DUP when `dup`).
fn qos2_publish(dup: bool) -> Vec<u8> {
    let mut p = vec![
        0x34 | if dup { 0x08 } else { 0 },
        11,
        0,
        3,
        b'z',
        b'/',
        b'1',
        0,
        5,
    ];
    p.extend_from_slice(b"once");
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_publish_resent_after_kill_9_is_not_forwarded_twice() {
    let dir = tempfile::tempdir().unwrap();
    let mut sluice = Sluice::new(dir.path(), true);
    sluice.start().await;

    // A persistent device sends a QoS 2 PUBLISH and gets PUBREC, then sluice dies before
    // the device's PUBREL.
    let (mut dev, present) = RawDevice::connect(sluice.mqtt, "meter").await;
    assert!(!present);
    assert_eq!(
        dev.exchange(&qos2_publish(false)).await,
        [0x50, 2, 0, 5],
        "PUBREC"
    );
    // SessionOpen, AwaitRel.
    sluice.committed(2).await;
    sluice.kill_9();
    drop(dev);
    sluice.start().await;

    let (mut watch, _) = TestClient::connect(sluice.mqtt, ConnectOpts::v311("watch"))
        .await
        .unwrap();
    watch.subscribe(&[("z/#", QoS::AtLeastOnce)]).await.unwrap();
    // The device resends with DUP, as MQTT asks, and finishes the exchange.
    let (mut dev, present) = RawDevice::connect(sluice.mqtt, "meter").await;
    assert!(present, "the persistent session survived the restart");
    assert_eq!(
        dev.exchange(&qos2_publish(true)).await,
        [0x50, 2, 0, 5],
        "PUBREC again"
    );
    assert_eq!(
        dev.exchange(&[0x62, 2, 0, 5]).await,
        [0x70, 2, 0, 5],
        "PUBCOMP"
    );
    // Then a marker: the watcher's first message must be the marker.
    let marker = [
        0x30, 10, 0, 3, b'z', b'/', b'2', b'm', b'a', b'r', b'k', b'r',
    ];
    dev.0.write_all(&marker).await.unwrap();
    let m = watch.recv(WAIT).await.unwrap().expect("the marker");
    assert_eq!(
        &*m.topic, "z/2",
        "the resent QoS 2 message was forwarded a second time"
    );
}

/// Without `[state] dir` nothing is kept (today's behaviour, the default), which is what the
/// tests above would see without the state directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_state_dir_a_restart_forgets_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let mut sluice = Sluice::new(dir.path(), false);
    sluice.start().await;
    let (sub, _) = TestClient::connect(sluice.mqtt, persistent("sleeper"))
        .await
        .unwrap();
    sub.disconnect().await.unwrap();
    sluice.kill_9();
    sluice.start().await;
    let (_sub, ack) = TestClient::connect(sluice.mqtt, persistent("sleeper"))
        .await
        .unwrap();
    assert!(!ack.session_present);
    assert!(!dir.path().join("state").exists());
}

/// A clean stop (SIGTERM) ends every connection, and with it the sessions it closes — but not
/// in the state directory: the next start has them back, as after a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_keeps_persistent_sessions_for_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    // With an uplink the shards wait for it at a stop, so connections close and end their
    // sessions (reason: shutdown) before the process exits.
    let cloud = sluice_testkit::Mosquitto::builder()
        .start()
        .expect("start the cloud mosquitto");
    let uplink = format!(
        "[[uplink]]\nname = \"cloud\"\nurl = \"mqtt://127.0.0.1:{}\"\nclient_id = \"gw-state\"\nallow_plaintext = true\nforward = [\"#\"]\n",
        cloud.plain_port()
    );
    let mut sluice = Sluice::with_extra(dir.path(), true, &uplink);
    sluice.start().await;
    let (mut online, _) = TestClient::connect(sluice.mqtt, persistent("online"))
        .await
        .unwrap();
    online
        .subscribe(&[("o/#", QoS::AtLeastOnce)])
        .await
        .unwrap();
    sluice.committed(2).await;
    let mut child = sluice.child.take().expect("sluice runs");
    let _ = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let status = child.wait().expect("sluice stops");
    assert!(status.success(), "clean exit: {status}");
    drop(online);
    sluice.start().await;
    let (_online, ack) = TestClient::connect(sluice.mqtt, persistent("online"))
        .await
        .unwrap();
    assert!(ack.session_present, "the session outlived a clean stop");
}
