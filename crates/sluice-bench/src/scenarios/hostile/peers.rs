//! The hostile peers of the `hostile` scenario: the attacker's UDP sockets (which count what
//! they send and what comes back to them), a CoAP-over-TCP upstream that answers 65,000-byte
//! bodies or answers late, and a oneM2M CSE that answers in many small HTTP chunks.
//!
//! Owns: those sockets and servers and their byte counters. Does not own: what a case makes of
//! the figures (the cases), sluice or the cloud (the bed).
//!
//! Bounds: an attacker socket keeps at most [`MAX_KEPT`] decoded answers and of each payload
//! its first [`KEEP_PAYLOAD`] bytes (sizes are counted whole); the servers serve one thread per
//! connection and stop with their guard.

use std::io::{self, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use bytes::{Bytes, BytesMut};
use serde::Serialize;
use sluice_proto::coap::tcp::{csm, decode_tcp, encode_tcp, pong};
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use tokio::net::UdpSocket;

use crate::load::coap::tcp_upstream::read_within;
use tokio::time::{sleep, Instant};

/// Decoded answers kept per attacker socket.
pub const MAX_KEPT: usize = 20_000;
/// Bytes of each answer's payload kept (the rest only counted).
pub const KEEP_PAYLOAD: usize = 4096;

/// What the attacker sent and what came back to its addresses, as seen at its sockets.
#[derive(Debug, Default)]
pub struct Traffic {
    pub bytes_in: AtomicU64,
    pub datagrams_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub datagrams_out: AtomicU64,
    pub largest_out: AtomicU64,
    pub largest_in: AtomicU64,
}

/// A copy of [`Traffic`]. "in" = to sluice (what the attacker sent), "out" = from sluice.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TrafficSnapshot {
    pub bytes_in: u64,
    pub datagrams_in: u64,
    pub bytes_out: u64,
    pub datagrams_out: u64,
    pub largest_out: u64,
    pub largest_in: u64,
}

impl Traffic {
    pub fn snapshot(&self) -> TrafficSnapshot {
        TrafficSnapshot {
            bytes_in: self.bytes_in.load(Relaxed),
            datagrams_in: self.datagrams_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed),
            datagrams_out: self.datagrams_out.load(Relaxed),
            largest_out: self.largest_out.load(Relaxed),
            largest_in: self.largest_in.load(Relaxed),
        }
    }
}

impl TrafficSnapshot {
    /// bytes out ÷ bytes in.
    pub fn ratio(&self) -> f64 {
        self.bytes_out as f64 / self.bytes_in.max(1) as f64
    }
}

/// The Echo option (RFC 9175 §2.2.1): a server's challenge to an address that has not proven
/// it receives; a client proves it by repeating the request with the value.
pub const ECHO: u16 = 252;

/// How an attacker socket treats what comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Behaviour {
    /// Acknowledge confirmable messages (notifications, separate responses).
    pub ack_con: bool,
    /// Answer a 4.01 carrying Echo by repeating the request with it (RFC 9175).
    pub answer_echo: bool,
}

/// A spoofed source: the victim at that address never answers anything.
pub const SPOOFED: Behaviour = Behaviour {
    ack_con: false,
    answer_echo: false,
};
/// An attacker on its own address: proves it receives (Echo) but never acknowledges.
pub const SQUATTER: Behaviour = Behaviour {
    ack_con: false,
    answer_echo: true,
};
/// A well-behaved client: answers Echo challenges and acknowledges confirmable messages.
pub const CLIENT: Behaviour = Behaviour {
    ack_con: true,
    answer_echo: true,
};

/// One answer as the attacker saw it.
#[derive(Debug, Clone)]
pub struct Got {
    pub mtype: MsgType,
    pub code: Code,
    pub mid: u16,
    pub token: Token,
    /// Datagram size.
    pub len: usize,
    pub observe: Option<u32>,
    /// A 4.01 with an Echo option: a return-routability challenge, not a final answer.
    pub echo_challenge: bool,
    /// The payload's first [`KEEP_PAYLOAD`] bytes.
    pub payload: Bytes,
}

impl Got {
    /// A final answer to the request with `token` (not an empty ACK, not an Echo challenge).
    pub fn answers(&self, token: Token) -> bool {
        self.token == token && self.code != Code::EMPTY && !self.echo_challenge
    }
}

/// One attacker UDP socket aimed at sluice's CoAP listener. A reader task counts and keeps
/// what comes back and answers per its [`Behaviour`]: acknowledging confirmable messages and
/// repeating a request challenged with Echo (requests are remembered by token for that, at most
/// [`MAX_KEPT`]).
pub struct Attacker {
    sock: Arc<UdpSocket>,
    target: SocketAddr,
    traffic: Arc<Traffic>,
    got: Arc<Mutex<Vec<Got>>>,
    sent: Arc<Mutex<std::collections::HashMap<Token, Message>>>,
    behaviour: Behaviour,
    reader: tokio::task::JoinHandle<()>,
    next_mid: Arc<std::sync::atomic::AtomicU32>,
}

impl Attacker {
    pub async fn new(
        target: SocketAddr,
        traffic: Arc<Traffic>,
        behaviour: Behaviour,
    ) -> anyhow::Result<Attacker> {
        let std_sock = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )
        .context("attacker socket")?;
        let _ = std_sock.set_recv_buffer_size(8 << 20);
        std_sock
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .context("binding an attacker socket")?;
        std_sock.set_nonblocking(true)?;
        let sock = Arc::new(UdpSocket::from_std(std_sock.into())?);
        let got = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(Mutex::new(
            std::collections::HashMap::<Token, Message>::new(),
        ));
        let next_mid = Arc::new(std::sync::atomic::AtomicU32::new(u32::from(
            rand::random::<u16>(),
        )));
        let reader = {
            let (sock, traffic, got) = (sock.clone(), traffic.clone(), got.clone());
            let (sent, next_mid) = (sent.clone(), next_mid.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 70_000];
                loop {
                    let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                        return;
                    };
                    traffic.bytes_out.fetch_add(n as u64, Relaxed);
                    traffic.datagrams_out.fetch_add(1, Relaxed);
                    traffic.largest_out.fetch_max(n as u64, Relaxed);
                    let Ok(m) = Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])) else {
                        continue;
                    };
                    if behaviour.ack_con && m.mtype == MsgType::Con {
                        let ack = Message::empty(MsgType::Ack, m.message_id).to_udp();
                        let _ = sock.send_to(&ack, from).await;
                        traffic.bytes_in.fetch_add(ack.len() as u64, Relaxed);
                        traffic.datagrams_in.fetch_add(1, Relaxed);
                    }
                    let echo = (m.code == Code::UNAUTHORIZED)
                        .then(|| m.option(ECHO).cloned())
                        .flatten();
                    if behaviour.answer_echo {
                        if let Some(value) = &echo {
                            let again = sent
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get(&m.token)
                                .cloned();
                            if let Some(mut again) = again {
                                again.remove_option(ECHO);
                                again.add_option(ECHO, value.clone());
                                again.message_id = next_mid.fetch_add(1, Relaxed) as u16;
                                let bytes = again.to_udp();
                                let _ = sock.send_to(&bytes, from).await;
                                traffic.bytes_in.fetch_add(bytes.len() as u64, Relaxed);
                                traffic.datagrams_in.fetch_add(1, Relaxed);
                            }
                        }
                    }
                    let mut kept = got.lock().unwrap_or_else(|p| p.into_inner());
                    if kept.len() < MAX_KEPT {
                        kept.push(Got {
                            mtype: m.mtype,
                            code: m.code,
                            mid: m.message_id,
                            token: m.token,
                            len: n,
                            observe: m.uint_option(opt::OBSERVE),
                            echo_challenge: echo.is_some(),
                            payload: m.payload.slice(..m.payload.len().min(KEEP_PAYLOAD)),
                        });
                    }
                }
            })
        };
        Ok(Attacker {
            sock,
            target,
            traffic,
            got,
            sent,
            behaviour,
            reader,
            next_mid,
        })
    }

    /// A fresh message id.
    pub fn mid(&self) -> u16 {
        self.next_mid.fetch_add(1, Relaxed) as u16
    }

    /// Send `msg` to sluice; its size.
    pub async fn send(&self, msg: &Message) -> anyhow::Result<usize> {
        if self.behaviour.answer_echo {
            let mut sent = self.sent.lock().unwrap_or_else(|p| p.into_inner());
            if sent.len() < MAX_KEPT || sent.contains_key(&msg.token) {
                sent.insert(msg.token, msg.clone());
            }
        }
        let bytes = msg.to_udp();
        self.sock
            .send_to(&bytes, self.target)
            .await
            .context("sending a datagram to sluice")?;
        self.traffic.bytes_in.fetch_add(bytes.len() as u64, Relaxed);
        self.traffic.datagrams_in.fetch_add(1, Relaxed);
        self.traffic
            .largest_in
            .fetch_max(bytes.len() as u64, Relaxed);
        Ok(bytes.len())
    }

    /// Everything received so far.
    pub fn received(&self) -> Vec<Got> {
        self.got.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Answers received so far.
    pub fn count(&self) -> usize {
        self.got.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Wait until an answer matching `pred` arrived (it is returned) or `within` passed.
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&Got) -> bool) -> Option<Got> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(g) = self
                .got
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|g| pred(g))
                .cloned()
            {
                return Some(g);
            }
            if Instant::now() >= deadline {
                return None;
            }
            sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A CoAP request with `path` segments (each one Uri-Path option, as bytes).
pub fn request(mtype: MsgType, code: Code, mid: u16, token: Token, path: &[&[u8]]) -> Message {
    let mut m = Message::new(mtype, code, mid, token);
    for seg in path {
        m.add_option(opt::URI_PATH, Bytes::copy_from_slice(seg));
    }
    m
}

/// The code as "c.dd".
pub fn code_text(code: Code) -> String {
    format!("{}.{:02}", code.0 >> 5, code.0 & 0x1f)
}

// ------------------------------------------------------------------------------------------
// The hostile CoAP-over-TCP upstream (case 12)
// ------------------------------------------------------------------------------------------

/// Size of `/big`'s payload: one UDP datagram can still carry it (65,507 bytes at most).
pub const BIG_PAYLOAD: usize = 65_000;
/// How late `/slow` is answered (past sluice's `separate_after`).
pub const SLOW_DELAY: Duration = Duration::from_millis(1500);
/// Size of `/slow`'s payload.
pub const SLOW_PAYLOAD: usize = 200;

/// An RFC 8323 server: CSM (Max-Message-Size 128 KiB) first; `GET …/big` answered at once with
/// [`BIG_PAYLOAD`] bytes, `GET …/slow` after [`SLOW_DELAY`] with [`SLOW_PAYLOAD`] bytes, anything
/// else 2.05 "ok"; Ping → Pong.
pub struct HostileUpstream {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl HostileUpstream {
    pub fn start() -> io::Result<HostileUpstream> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("hostile-up".to_string())
                .spawn(move || {
                    while !stop.load(Relaxed) {
                        match listener.accept() {
                            Ok((conn, _)) => {
                                let stop = stop.clone();
                                let _ = std::thread::Builder::new()
                                    .name("hostile-up-c".to_string())
                                    .spawn(move || {
                                        let _ = serve_upstream(conn, &stop);
                                    });
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(20)),
                        }
                    }
                })?
        };
        Ok(HostileUpstream {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HostileUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve_upstream(conn: TcpStream, stop: &AtomicBool) -> io::Result<()> {
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(Duration::from_millis(200)))?;
    let writer = Arc::new(Mutex::new(conn.try_clone()?));
    let mut reader = conn;
    let mut out = BytesMut::new();
    encode_tcp(&csm(128 * 1024, false), &mut out);
    writer
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .write_all(&out)?;
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    while !stop.load(Relaxed) {
        let n = match read_within(&mut reader, &mut chunk)? {
            None => continue,
            Some(0) => return Ok(()),
            Some(n) => n,
        };
        inbuf.extend_from_slice(&chunk[..n]);
        loop {
            let msg = match decode_tcp(&mut inbuf, 128 * 1024) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(_) => return Ok(()),
            };
            let mut out = BytesMut::new();
            if msg.code == Code::PING {
                encode_tcp(&pong(&msg), &mut out);
            } else if msg.code == Code::RELEASE || msg.code == Code::ABORT {
                return Ok(());
            } else if msg.code.is_request() {
                let last = msg.uri_path().last().cloned().unwrap_or_default();
                let mut resp = Message::new(MsgType::Con, Code::CONTENT, 0, msg.token);
                if &last[..] == b"big" {
                    resp.payload = Bytes::from(vec![b'B'; BIG_PAYLOAD]);
                } else if &last[..] == b"slow" {
                    resp.payload = Bytes::from(vec![b'S'; SLOW_PAYLOAD]);
                    encode_tcp(&resp, &mut out);
                    let writer = writer.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(SLOW_DELAY);
                        let _ = writer
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .write_all(&out);
                    });
                    continue;
                } else {
                    resp.payload = Bytes::from_static(b"ok");
                }
                encode_tcp(&resp, &mut out);
            }
            if !out.is_empty() {
                writer
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write_all(&out)?;
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The oneM2M CSE answering in small chunks (case 13)
// ------------------------------------------------------------------------------------------

/// How the CSE delimits contentInstance response bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BodyMode {
    /// `Content-Length`, the body written in the same pieces as the chunked one.
    Length = 0,
    /// `Transfer-Encoding: chunked`, one byte per chunk.
    Chunked = 1,
}

/// Body size of a contentInstance response.
pub const CSE_BODY: usize = 128 * 1024;
/// Bytes per write of a contentInstance response, and the pause between two writes.
pub const CSE_PIECE: usize = 1500;
pub const CSE_PAUSE: Duration = Duration::from_micros(200);

/// A oneM2M CSE over HTTP/1.1 that accepts everything (2001): registration and containers
/// answered at once with an empty body; contentInstances with a [`CSE_BODY`]-byte body in
/// [`BodyMode`], written in [`CSE_PIECE`]-byte pieces [`CSE_PAUSE`] apart, so the client reads
/// it in many reads.
pub struct SlowCse {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    mode: Arc<AtomicU8>,
    requests: Arc<AtomicU64>,
    instances: Arc<AtomicU64>,
    wire_bytes: Arc<AtomicU64>,
    accept: Option<JoinHandle<()>>,
}

impl SlowCse {
    pub fn start() -> io::Result<SlowCse> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let mode = Arc::new(AtomicU8::new(BodyMode::Length as u8));
        let requests = Arc::new(AtomicU64::new(0));
        let instances = Arc::new(AtomicU64::new(0));
        let wire_bytes = Arc::new(AtomicU64::new(0));
        let accept = {
            let shared = (
                stop.clone(),
                mode.clone(),
                requests.clone(),
                instances.clone(),
                wire_bytes.clone(),
            );
            std::thread::Builder::new()
                .name("slow-cse".to_string())
                .spawn(move || {
                    while !shared.0.load(Relaxed) {
                        match listener.accept() {
                            Ok((conn, _)) => {
                                let shared = shared.clone();
                                let _ = std::thread::Builder::new()
                                    .name("slow-cse-c".to_string())
                                    .spawn(move || {
                                        let _ = serve_cse(
                                            conn, &shared.0, &shared.1, &shared.2, &shared.3,
                                            &shared.4,
                                        );
                                    });
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(20)),
                        }
                    }
                })?
        };
        Ok(SlowCse {
            addr,
            stop,
            mode,
            requests,
            instances,
            wire_bytes,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    pub fn set_mode(&self, mode: BodyMode) {
        self.mode.store(mode as u8, Relaxed);
    }
    /// Requests answered.
    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }
    /// contentInstance requests answered.
    pub fn instances(&self) -> u64 {
        self.instances.load(Relaxed)
    }
    /// Bytes of contentInstance responses written.
    pub fn wire_bytes(&self) -> u64 {
        self.wire_bytes.load(Relaxed)
    }
}

impl Drop for SlowCse {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn serve_cse(
    mut conn: TcpStream,
    stop: &AtomicBool,
    mode: &AtomicU8,
    requests: &AtomicU64,
    instances: &AtomicU64,
    wire_bytes: &AtomicU64,
) -> io::Result<()> {
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut inbuf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    while !stop.load(Relaxed) {
        // One whole request (head + Content-Length body) at the front of `inbuf`?
        if let Some(end) = find(&inbuf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&inbuf[..end]).to_string();
            let length = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if inbuf.len() >= end + 4 + length {
                inbuf.drain(..end + 4 + length);
                requests.fetch_add(1, Relaxed);
                let ri = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.trim()
                            .eq_ignore_ascii_case("x-m2m-ri")
                            .then(|| v.trim().to_string())
                    })
                    .unwrap_or_default();
                let instance = head.to_ascii_lowercase().contains("ty=4");
                let base = format!(
                    "HTTP/1.1 201 Created\r\nX-M2M-RSC: 2001\r\nX-M2M-RI: {ri}\r\nX-M2M-RVI: 3\r\nContent-Type: application/json\r\n"
                );
                if !instance {
                    conn.write_all(format!("{base}Content-Length: 0\r\n\r\n").as_bytes())?;
                    continue;
                }
                instances.fetch_add(1, Relaxed);
                let mut body = Vec::with_capacity(CSE_BODY);
                body.extend_from_slice(b"{\"m2m:cin\":{\"con\":\"");
                body.resize(CSE_BODY - 3, b'x');
                body.extend_from_slice(b"\"}}");
                let wire = if mode.load(Relaxed) == BodyMode::Chunked as u8 {
                    let mut w = format!("{base}Transfer-Encoding: chunked\r\n\r\n").into_bytes();
                    for b in &body {
                        w.extend_from_slice(b"1\r\n");
                        w.push(*b);
                        w.extend_from_slice(b"\r\n");
                    }
                    w.extend_from_slice(b"0\r\n\r\n");
                    w
                } else {
                    let mut w =
                        format!("{base}Content-Length: {}\r\n\r\n", body.len()).into_bytes();
                    w.extend_from_slice(&body);
                    w
                };
                wire_bytes.fetch_add(wire.len() as u64, Relaxed);
                for piece in wire.chunks(CSE_PIECE) {
                    conn.write_all(piece)?;
                    std::thread::sleep(CSE_PAUSE);
                }
                continue;
            }
        }
        let n = match read_within(&mut conn, &mut chunk)? {
            None => continue,
            Some(0) => return Ok(()),
            Some(n) => n,
        };
        inbuf.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}
