//! Set-up for the CoAP real-peer tests (`coap_peers.rs`): a gateway with a `[coap]` listener
//! in front of a real cloud Mosquitto over TLS, the real device implementations (libcoap's
//! `coap-client-notls`, Python `aiocoap`) run as child processes, and a raw UDP device built
//! on `sluice_proto::coap` for what no well-behaved client sends (duplicates, bad datagrams).
//!
//! A missing peer fails the test with a message naming what to install (`./scripts/test`
//! installs all of them); nothing is skipped.
#![allow(dead_code)]

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sluice::app::RunningGateway;
use sluice_proto::coap::{Code, Message, MsgType, Token};

use crate::common::{gateway_sections, Cloud};

/// The aiocoap device: `publish URI HEX con|non`, `stream URI PREFIX COUNT`, `observe URI N`.
/// One JSON object per line on stdout.
const AIOCOAP_DEVICE: &str = include_str!("aiocoap_device.py");

/// A gateway with `[coap]` on a loopback port and an uplink to `cloud` (aggregation off, so
/// every message reaches the cloud on its own topic, byte for byte).
pub struct CoapGateway {
    pub gw: RunningGateway,
    pub coap: SocketAddr,
}

impl CoapGateway {
    pub fn start(cloud: &Cloud, shards: usize, coap_extra: &str) -> CoapGateway {
        let extra = format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\n{coap_extra}\n{}",
            cloud.uplink_toml(None, "[uplink.aggregate]\nenabled = false")
        );
        let gw = gateway_sections(&format!("shards = {shards}"), "", &extra);
        let coap = gw
            .coap_addr
            .expect("[coap] is enabled: the gateway has a CoAP address");
        CoapGateway { gw, coap }
    }

    /// `coap://127.0.0.1:PORT/ps/{path}` (path may carry `?query`).
    pub fn uri(&self, path: &str) -> String {
        format!("coap://{}/ps/{path}", self.coap)
    }

    pub fn metrics(&self) -> String {
        self.gw.metrics_text()
    }
}

/// Sum of the `sluice_coap_*` samples whose metric name contains one of `words`.
pub fn coap_metric(text: &str, words: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("sluice_coap"))
        .filter(|l| {
            let name = l.split(['{', ' ']).next().unwrap_or("");
            words.iter().any(|w| name.contains(w))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The path of a peer program, or a failure naming the package that provides it.
pub fn peer(program: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{program} not found on PATH: this test needs the real peer from {package}; \
                 ./scripts/test installs it (or: apt-get install {package})"
            )
        })
}

/// `python3` (or `$SLUICE_TEST_PYTHON`) after checking it can import aiocoap.
pub fn python_with_aiocoap() -> PathBuf {
    let python = std::env::var_os("SLUICE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| peer("python3", "python3"));
    let ok = Command::new(&python)
        .args(["-c", "import aiocoap"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import aiocoap: this test needs the real peer aiocoap 0.4.17; \
         ./scripts/test installs it (or: python3 -m pip install aiocoap==0.4.17)",
        python.display()
    );
    python
}

/// What a finished peer process printed.
#[derive(Debug)]
pub struct Output {
    pub success: bool,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Output {
    /// Response codes (`2.04`, `2.31`, `4.13`…) in libcoap's `-v 7` message dumps
    /// (`v:1 t:ACK c:2.04 i:…`), in order. libcoap writes debug output to stdout and
    /// errors to stderr.
    pub fn libcoap_codes(&self) -> Vec<String> {
        let text = format!("{}\n{}", String::from_utf8_lossy(&self.stdout), self.stderr);
        text.lines()
            .filter_map(|l| l.strip_prefix("v:1 "))
            .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("c:")))
            .filter(|c| c.as_bytes().first().is_some_and(|b| b.is_ascii_digit()))
            .map(str::to_string)
            .collect()
    }

    /// stdout and stderr, for failure messages.
    pub fn text(&self) -> String {
        format!("{}\n{}", String::from_utf8_lossy(&self.stdout), self.stderr)
    }

    /// stdout as JSON lines (the aiocoap device).
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        String::from_utf8_lossy(&self.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }
}

/// Run a program to completion (off the async threads), killed after `timeout`.
pub async fn run(program: PathBuf, args: Vec<String>, timeout: Duration) -> Output {
    let what = format!("{} {}", program.display(), args.join(" "));
    tokio::task::spawn_blocking(move || {
        let child = Command::new(&program)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
        let mut p = Peer::watch(child);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = p.child.try_wait().expect("wait for peer") {
                p.join_readers();
                return Output {
                    success: status.success(),
                    stdout: p.stdout.lock().unwrap().clone(),
                    stderr: String::from_utf8_lossy(&p.stderr.lock().unwrap()).into_owned(),
                };
            }
            if std::time::Instant::now() > deadline {
                let err = String::from_utf8_lossy(&p.stderr.lock().unwrap()).into_owned();
                panic!("{what} still running after {timeout:?}; stderr:\n{err}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await
    .expect("peer runner")
}

/// `coap-client-notls` with `args`, its message dumps on stderr (`-v 7`).
pub async fn coap_client(args: &[&str]) -> Output {
    let mut all: Vec<String> = vec!["-v".into(), "7".into(), "-B".into(), "20".into()];
    all.extend(args.iter().map(|s| s.to_string()));
    run(
        peer("coap-client-notls", "libcoap3-bin"),
        all,
        Duration::from_secs(40),
    )
    .await
}

/// Write the aiocoap device script into `dir` and return the command prefix to run it.
pub fn aiocoap_device(dir: &std::path::Path) -> (PathBuf, String) {
    let script = dir.join("aiocoap_device.py");
    std::fs::write(&script, AIOCOAP_DEVICE).expect("write the aiocoap device script");
    (python_with_aiocoap(), script.display().to_string())
}

/// A long-running peer whose stdout and stderr are collected as they come.
pub struct Peer {
    pub child: Child,
    pub stdout: Arc<Mutex<Vec<u8>>>,
    pub stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Peer {
    pub fn spawn(program: PathBuf, args: &[String]) -> Peer {
        let child = Command::new(&program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
        Peer::watch(child)
    }

    fn watch(mut child: Child) -> Peer {
        let stdout: Arc<Mutex<Vec<u8>>> = Arc::default();
        let stderr: Arc<Mutex<Vec<u8>>> = Arc::default();
        let mut readers = Vec::new();
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        for (mut pipe, sink) in [
            (Box::new(out) as Box<dyn Read + Send>, stdout.clone()),
            (Box::new(err) as Box<dyn Read + Send>, stderr.clone()),
        ] {
            readers.push(std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            }));
        }
        Peer {
            child,
            stdout,
            stderr,
            readers,
        }
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().unwrap()).into_owned()
    }

    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A device on a raw UDP socket: sends exactly the bytes a test gives it.
pub struct RawDevice {
    pub sock: tokio::net::UdpSocket,
    pub gw: SocketAddr,
}

impl RawDevice {
    pub async fn new(gw: SocketAddr) -> RawDevice {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind raw device");
        RawDevice { sock, gw }
    }

    pub async fn send(&self, datagram: &[u8]) {
        self.sock
            .send_to(datagram, self.gw)
            .await
            .expect("send datagram");
    }

    /// The next datagram from the gateway, raw, within `timeout`.
    pub async fn recv_raw(&self, timeout: Duration) -> Option<Bytes> {
        let mut buf = vec![0u8; 2048];
        loop {
            let (n, from) = tokio::time::timeout(timeout, self.sock.recv_from(&mut buf))
                .await
                .ok()?
                .expect("recv datagram");
            if from == self.gw {
                return Some(Bytes::copy_from_slice(&buf[..n]));
            }
        }
    }

    /// The next message from the gateway (a datagram that does not decode fails the test).
    pub async fn recv(&self, timeout: Duration) -> Option<Message> {
        let raw = self.recv_raw(timeout).await?;
        Some(Message::decode_udp(&raw).unwrap_or_else(|e| panic!("gateway sent {raw:02x?}: {e}")))
    }

    /// Send a CON request and return the response: piggybacked in the ACK, or (after an
    /// empty ACK) a separate response with the same token, which is acknowledged. The CON
    /// is retransmitted every second, up to 4 times, with the same message id.
    pub async fn request(&self, req: &Message) -> Message {
        assert_eq!(req.mtype, MsgType::Con);
        let wire = req.to_udp();
        let mut acked = false;
        for _ in 0..5 {
            if !acked {
                self.send(&wire).await;
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            while let Some(m) = self
                .recv(deadline.saturating_duration_since(tokio::time::Instant::now()))
                .await
            {
                if m.mtype == MsgType::Ack && m.message_id == req.message_id {
                    if m.code == Code::EMPTY {
                        acked = true;
                        continue;
                    }
                    assert_eq!(m.token, req.token, "piggybacked response token");
                    return m;
                }
                if acked && m.token == req.token && m.code.is_response() {
                    if m.mtype == MsgType::Con {
                        self.send(&Message::empty(MsgType::Ack, m.message_id).to_udp())
                            .await;
                    }
                    return m;
                }
            }
        }
        panic!("no response to {req:?}");
    }
}

/// A CON or NON POST to `/{pubsub}/{path…}` with `?c=device`, token of the message id.
pub fn publish(mtype: MsgType, mid: u16, topic: &str, device: &str, payload: &[u8]) -> Message {
    let mut m = Message::new(
        mtype,
        Code::POST,
        mid,
        Token::from_slice(&mid.to_be_bytes()).expect("2 bytes"),
    );
    m.add_option(sluice_proto::coap::opt::URI_PATH, Bytes::from_static(b"ps"));
    for seg in topic.split('/') {
        m.add_option(
            sluice_proto::coap::opt::URI_PATH,
            Bytes::copy_from_slice(seg.as_bytes()),
        );
    }
    m.add_option(
        sluice_proto::coap::opt::URI_QUERY,
        Bytes::from(format!("c={device}")),
    );
    m.payload = Bytes::copy_from_slice(payload);
    m
}
