//! The adaptor floor: the least any MQTT → HTTP function adaptor must do per event, and
//! nothing more (`sluice-bench fn-floor`).
//!
//! Owns: a single-threaded epoll loop (mio) that terminates plain-TCP MQTT devices with the
//! kernel floor's framing and device connections ([`super::floor`]), and for every QoS 1
//! PUBLISH writes one HTTP/1.1 POST in CloudEvents binary mode to the function over a
//! keep-alive connection, reads the response and, on a 2xx, writes the device's PUBACK. The
//! request is built by [`encode_request`] and written with one `write`; the response is read
//! by [`parse_response`] (status line, headers, a `Content-Length` body — nothing else).
//! `scenario functions --part adaptor` runs it under the same devices and load as sluice, in
//! front of the same function, so its CPU per event is what relaying costs on this machine
//! with no routing, queueing, retries, metrics or durability: the floor under any adaptor's.
//! Does not own: the MQTT framing (the kernel floor's), the function, or what is measured.
//!
//! Request (the binary-mode CloudEvent sluice also sends, less its optional `ce-time`):
//! `POST / HTTP/1.1`, `Host`, `ce-specversion: 1.0`, `ce-id: <a counter>`,
//! `ce-source: sluice-bench/fn-floor`, `ce-type: io.sluice.message`, `ce-subject: <topic, as
//! sent>`, `Content-Type: application/octet-stream`, `Content-Length`; the body is the payload.
//!
//! Bounds and overflow: at most `connections` requests in flight, one per function connection
//! (opened when needed, kept alive); PUBLISHes that find every connection busy wait in one
//! queue of at most `max_waiting` built requests, and one that finds it full closes its device
//! connection (the device resends). QoS 0 PUBLISHes are not forwarded; QoS 2 closes the device.
//! A non-2xx answer, or a function connection that fails, closes the device whose event it
//! carried (no PUBACK: the device resends). Responses are at most [`MAX_RESPONSE`] bytes.
//!
//! Sockets: TCP_NODELAY on every one; TCP_QUICKACK before every read of a function
//! connection (a server that writes head and body apart, like Python's `http.server`, would
//! otherwise wait for a delayed ACK), as sluice does.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::io;
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};

use super::floor::{
    close, read_some, serve_devices, write_some, DeviceConn, FloorError, FloorHandler, Publish,
    HANDLER_TOKENS,
};

/// The CloudEvents `type` of every event (sluice's).
pub const EVENT_TYPE: &str = "io.sluice.message";
/// The CloudEvents `source` of every event.
pub const EVENT_SOURCE: &str = "sluice-bench/fn-floor";
/// Largest response (head + body) read; larger closes the function connection.
pub const MAX_RESPONSE: usize = 1 << 20;

/// Why a function's response cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("malformed HTTP response head")]
    Malformed,
    #[error("the response has no Content-Length (or is chunked): its end is unknown")]
    Undelimited,
    #[error("response larger than {MAX_RESPONSE} bytes")]
    TooLarge,
}

/// One whole response at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// Bytes of head and body.
    pub used: usize,
    /// The function will close the connection after it (`Connection: close`, or HTTP/1.0).
    pub close: bool,
}

/// The response at the front of `buf`, `None` while incomplete. Only `Content-Length` bodies
/// are read (204 and 304 have none); anything else is [`ResponseError::Undelimited`].
pub fn parse_response(buf: &[u8]) -> Result<Option<Response>, ResponseError> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let head = match response.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_RESPONSE => {
            return Err(ResponseError::TooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(ResponseError::Malformed),
    };
    let status = response.code.ok_or(ResponseError::Malformed)?;
    let mut body = None;
    let mut close = response.version == Some(0);
    for h in response.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let len = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or(ResponseError::Malformed)?;
            body = Some(len);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(ResponseError::Undelimited);
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = h.value.eq_ignore_ascii_case(b"close");
        }
    }
    let body = match body {
        Some(len) => len,
        None if status == 204 || status == 304 => 0,
        None => return Err(ResponseError::Undelimited),
    };
    let used = head.checked_add(body).filter(|&u| u <= MAX_RESPONSE);
    let used = used.ok_or(ResponseError::TooLarge)?;
    Ok((buf.len() >= used).then_some(Response {
        status,
        used,
        close,
    }))
}

/// Append the POST of one event to `out`: the head (see the module) and the payload.
pub fn encode_request(out: &mut Vec<u8>, host: &str, id: u64, topic: &[u8], payload: &[u8]) {
    let mut head = String::with_capacity(256);
    let _ = write!(
        head,
        "POST / HTTP/1.1\r\nHost: {host}\r\nce-specversion: 1.0\r\nce-id: {id}\r\nce-source: {EVENT_SOURCE}\r\nce-type: {EVENT_TYPE}\r\nce-subject: "
    );
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(topic);
    head.clear();
    let _ = write!(
        head,
        "\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        payload.len()
    );
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(payload);
}

/// Where an event's PUBACK goes once the function answered 2xx.
#[derive(Debug, Clone, Copy)]
struct Ack {
    device: usize,
    packet_id: [u8; 2],
}

/// One keep-alive connection to the function, with at most one request on it.
struct FnConn {
    stream: TcpStream,
    /// The request being written; `written` of it went out.
    request: Vec<u8>,
    written: usize,
    /// The response so far.
    rbuf: Vec<u8>,
    busy: Option<Ack>,
}

/// The function side: the connection pool and the requests waiting for a connection.
struct Relay {
    function: SocketAddr,
    host: String,
    registry: Registry,
    /// Slot `i` is connection `i` (`None`: not open); `connections` slots.
    pool: Vec<Option<FnConn>>,
    waiting: VecDeque<(Ack, Vec<u8>)>,
    max_waiting: usize,
    next_id: u64,
}

impl FloorHandler for Relay {
    /// Forward a device's PUBLISH.
    fn publish(
        &mut self,
        device: usize,
        p: Publish<'_>,
        _: &mut Vec<u8>,
    ) -> Result<(), FloorError> {
        match p.qos {
            0 => return Ok(()),
            1 => {}
            _ => return Err(FloorError::Refused("only QoS 0 and 1 are relayed")),
        }
        let ack = Ack {
            device,
            packet_id: p.packet_id,
        };
        self.next_id += 1;
        let slot = self
            .pool
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| c.busy.is_none()));
        let slot = slot.or_else(|| self.pool.iter().position(Option::is_none));
        let Some(slot) = slot else {
            if self.waiting.len() >= self.max_waiting {
                return Err(FloorError::Refused(
                    "every function connection busy, queue full",
                ));
            }
            let mut request = Vec::new();
            encode_request(&mut request, &self.host, self.next_id, p.topic, p.payload);
            self.waiting.push_back((ack, request));
            return Ok(());
        };
        let mut request = self.pool[slot]
            .as_mut()
            .map_or_else(Vec::new, |c| std::mem::take(&mut c.request));
        request.clear();
        encode_request(&mut request, &self.host, self.next_id, p.topic, p.payload);
        self.start(slot, ack, request).map_err(|_| {
            self.drop_conn(slot);
            FloorError::Refused("the function connection failed")
        })
    }

    /// A function connection is ready: write the rest of its request, read its response,
    /// PUBACK the device on a 2xx, then start the next waiting request.
    fn ready(
        &mut self,
        token: Token,
        devices: &mut HashMap<usize, DeviceConn>,
        scratch: &mut [u8],
    ) {
        let slot = token.0 - HANDLER_TOKENS;
        if slot >= self.pool.len() {
            return;
        }
        if self.serve(slot, devices, scratch).is_err() {
            if let Some(ack) = self.drop_conn(slot) {
                close(devices, ack.device, &self.registry);
            }
        }
        self.start_waiting(slot, devices);
    }
}

impl Relay {
    /// Close slot `slot`'s connection; the ack of the request it carried, if any.
    fn drop_conn(&mut self, slot: usize) -> Option<Ack> {
        let mut conn = self.pool[slot].take()?;
        let _ = self.registry.deregister(&mut conn.stream);
        conn.busy
    }

    /// Send `request` on slot `slot` (opening its connection if closed).
    fn start(&mut self, slot: usize, ack: Ack, request: Vec<u8>) -> io::Result<()> {
        if self.pool[slot].is_none() {
            let std = std::net::TcpStream::connect(self.function)?;
            std.set_nodelay(true)?;
            std.set_nonblocking(true)?;
            let mut stream = TcpStream::from_std(std);
            let token = Token(HANDLER_TOKENS + slot);
            self.registry
                .register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)?;
            self.pool[slot] = Some(FnConn {
                stream,
                request: Vec::new(),
                written: 0,
                rbuf: Vec::new(),
                busy: None,
            });
        }
        let Some(conn) = self.pool[slot].as_mut() else {
            unreachable!("the slot was filled above");
        };
        conn.request = request;
        conn.busy = Some(ack);
        conn.written = write_some(&mut conn.stream, &conn.request)?;
        Ok(())
    }

    fn serve(
        &mut self,
        slot: usize,
        devices: &mut HashMap<usize, DeviceConn>,
        scratch: &mut [u8],
    ) -> io::Result<()> {
        let Some(conn) = self.pool[slot].as_mut() else {
            return Ok(());
        };
        if conn.written < conn.request.len() {
            conn.written += write_some(&mut conn.stream, &conn.request[conn.written..])?;
        }
        loop {
            let _ = socket2::SockRef::from(&conn.stream).set_tcp_quickack(true);
            let Some(n) = read_some(&mut conn.stream, scratch)? else {
                return Ok(());
            };
            conn.rbuf.extend_from_slice(&scratch[..n]);
            let parsed = parse_response(&conn.rbuf)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let Some(response) = parsed else {
                continue;
            };
            let ack = conn
                .busy
                .take()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "an unasked response"))?;
            conn.rbuf.drain(..response.used);
            if (200..300).contains(&response.status) {
                let puback = [0x40, 2, ack.packet_id[0], ack.packet_id[1]];
                if let Some(device) = devices.get_mut(&ack.device) {
                    if device.send(&puback).is_err() {
                        close(devices, ack.device, &self.registry);
                    }
                }
            } else {
                close(devices, ack.device, &self.registry);
            }
            if response.close {
                return Err(io::ErrorKind::ConnectionAborted.into());
            }
        }
    }

    /// If slot `slot` is free (idle or closed), give it the first waiting request.
    fn start_waiting(&mut self, slot: usize, devices: &mut HashMap<usize, DeviceConn>) {
        let free = self.pool[slot].as_ref().is_none_or(|c| c.busy.is_none());
        if !free {
            return;
        }
        let Some((ack, request)) = self.waiting.pop_front() else {
            return;
        };
        if self.start(slot, ack, request).is_err() {
            self.drop_conn(slot);
            close(devices, ack.device, &self.registry);
        }
    }
}

/// The adaptor floor's settings.
#[derive(Debug, Clone, Copy)]
pub struct AdaptorFloor {
    /// Plain-TCP MQTT address for the devices (port 0: a free port).
    pub listen: SocketAddr,
    /// The function's HTTP address.
    pub function: SocketAddr,
    /// Function connections, each with at most one request in flight (at least 1).
    pub connections: usize,
    /// Requests waiting for a connection before a device's PUBLISH is refused.
    pub max_waiting: usize,
}

/// Serve until the process is killed. `ready` gets the bound device address once the listener
/// accepts connections.
pub fn run_adaptor_floor(cfg: AdaptorFloor, ready: impl FnOnce(SocketAddr)) -> io::Result<()> {
    serve_devices(cfg.listen, ready, |registry| {
        Ok(Relay {
            function: cfg.function,
            host: cfg.function.to_string(),
            registry: registry.try_clone()?,
            pool: (0..cfg.connections.max(1)).map(|_| None).collect(),
            waiting: VecDeque::new(),
            max_waiting: cfg.max_waiting,
            next_id: 0,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng as _, SeedableRng as _};
    use std::io::Read as _;

    #[test]
    fn a_request_is_a_binary_mode_cloudevent_with_the_payload_as_body() {
        let mut out = Vec::new();
        encode_request(
            &mut out,
            "127.0.0.1:8080",
            42,
            b"fnb/adaptor/3",
            b"\x00\x01hi",
        );
        let want = b"POST / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nce-specversion: 1.0\r\nce-id: 42\r\nce-source: sluice-bench/fn-floor\r\nce-type: io.sluice.message\r\nce-subject: fnb/adaptor/3\r\nContent-Type: application/octet-stream\r\nContent-Length: 4\r\n\r\n\x00\x01hi";
        assert_eq!(out, want.to_vec());
        // and an HTTP parser reads it back whole
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut headers);
        let head = match req.parse(&out).unwrap() {
            httparse::Status::Complete(n) => n,
            httparse::Status::Partial => panic!("partial"),
        };
        assert_eq!((req.method, req.path), (Some("POST"), Some("/")));
        assert_eq!(&out[head..], b"\x00\x01hi");
    }

    #[test]
    fn python_and_compiled_echo_responses_are_read_whole() {
        // http.server: its head and body arrive apart; the compiled echo: one write.
        let python = b"HTTP/1.1 200 OK\r\nServer: BaseHTTP/0.6 Python/3.11.7\r\nDate: Wed, 25 Nov 2026 09:00:00 GMT\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{\"a\":12}\n";
        let head_len = python.len() - 9;
        assert_eq!(parse_response(&python[..head_len]), Ok(None));
        assert_eq!(
            parse_response(python),
            Ok(Some(Response {
                status: 200,
                used: python.len(),
                close: false
            }))
        );
        let closing = b"HTTP/1.0 503 Busy\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(
            parse_response(closing),
            Ok(Some(Response {
                status: 503,
                used: closing.len(),
                close: true
            }))
        );
        assert_eq!(
            parse_response(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"),
            Ok(Some(Response {
                status: 204,
                used: 46,
                close: true
            }))
        );
    }

    #[test]
    fn undelimited_malformed_and_huge_responses_are_errors() {
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Err(ResponseError::Undelimited)
        );
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\n\r\nbody until close"),
            Err(ResponseError::Undelimited)
        );
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
            Err(ResponseError::Malformed)
        );
        assert_eq!(
            parse_response(b"SSH-2.0-OpenSSH\r\n\r\n"),
            Err(ResponseError::Malformed)
        );
        let huge = format!("HTTP/1.1 200 OK\r\nContent-Length: {MAX_RESPONSE}\r\n\r\n");
        assert_eq!(
            parse_response(huge.as_bytes()),
            Err(ResponseError::TooLarge)
        );
        let mut endless = b"HTTP/1.1 200 OK\r\nX-Endless: ".to_vec();
        endless.resize(MAX_RESPONSE + 1, b'a');
        assert_eq!(parse_response(&endless), Err(ResponseError::TooLarge));
    }

    /// A random well-formed response: (its bytes, what parsing it must give).
    fn arbitrary_response(rng: &mut SmallRng) -> (Vec<u8>, Response) {
        let status: u16 = rng.gen_range(200..600);
        let version = if rng.gen_bool(0.1) { 0 } else { 1 };
        let close = match rng.gen_range(0..3) {
            0 => Some(true),
            1 => Some(false),
            _ => None,
        };
        let body_len = rng.gen_range(0..300);
        let mut head = format!("HTTP/1.{version} {status} Whatever Reason\r\n");
        for i in 0..rng.gen_range(0..6) {
            let value: String = (0..rng.gen_range(0..40))
                .map(|_| char::from(rng.gen_range(b' '..=b'~')))
                .collect();
            head.push_str(&format!("X-Header-{i}: {}\r\n", value.trim()));
        }
        if let Some(c) = close {
            head.push_str(if c {
                "Connection: close\r\n"
            } else {
                "connection: keep-alive\r\n"
            });
        }
        head.push_str(&format!("CONTENT-LENGTH: {body_len}\r\n\r\n"));
        let mut bytes = head.into_bytes();
        bytes.extend((0..body_len).map(|_| rng.gen::<u8>()));
        let want = Response {
            status,
            used: bytes.len(),
            close: close.unwrap_or(version == 0),
        };
        (bytes, want)
    }

    #[test]
    fn property_any_response_split_anywhere_is_read_once_whole_and_the_next_is_left() {
        let mut rng = SmallRng::seed_from_u64(19);
        for _ in 0..300 {
            let (bytes, want) = arbitrary_response(&mut rng);
            for cut in 0..bytes.len() {
                assert_eq!(parse_response(&bytes[..cut]), Ok(None), "cut {cut}");
            }
            let (next, _) = arbitrary_response(&mut rng);
            let mut two = bytes.clone();
            two.extend(&next);
            assert_eq!(parse_response(&two), Ok(Some(want)));
            assert_eq!(parse_response(&bytes), Ok(Some(want)));
        }
    }

    #[test]
    fn property_arbitrary_bytes_never_panic() {
        let mut rng = SmallRng::seed_from_u64(20);
        for _ in 0..20_000 {
            let len = rng.gen_range(0..64);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.5) {
                let prefix = b"HTTP/1.1 200 OK\r\nContent-Length: ";
                bytes.splice(0..0, prefix.iter().copied());
            }
            let _ = parse_response(&bytes);
        }
    }

    /// A device publishing QoS 1 through a relay in front of `function`, on threads.
    fn relay_in_front_of(function: SocketAddr) -> SocketAddr {
        let (tx, rx) = std::sync::mpsc::channel();
        let cfg = AdaptorFloor {
            listen: "127.0.0.1:0".parse().unwrap(),
            function,
            connections: 2,
            max_waiting: 64,
        };
        std::thread::spawn(move || run_adaptor_floor(cfg, |a| tx.send(a).unwrap()));
        rx.recv().unwrap()
    }

    #[test]
    fn every_qos1_publish_is_posted_and_acknowledged_only_after_the_function_answers() {
        use crate::scenarios::functions::echo::serve_on;
        use crate::sinks::floor::test_packets::{connect, publish};
        use sluice_proto::mqtt::{ProtocolVersion, QoS};
        use std::io::Write as _;
        use std::time::Duration;

        let function = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let function_addr = function.local_addr().unwrap();
        std::thread::spawn(move || serve_on(function, 1));
        let relay = relay_in_front_of(function_addr);
        let v = ProtocolVersion::V311;
        let mut buf = connect(v);
        for id in 1..=20u16 {
            buf.extend(publish(v, QoS::AtLeastOnce, id));
        }
        let mut device = std::net::TcpStream::connect(relay).unwrap();
        device
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        device.write_all(&buf).unwrap();
        let mut answers = vec![0u8; 4 + 20 * 4];
        device.read_exact(&mut answers).unwrap();
        assert_eq!(answers[..4], [0x20, 2, 0, 0], "CONNACK");
        let mut acked: Vec<u16> = answers[4..]
            .chunks(4)
            .map(|a| {
                assert_eq!(a[..2], [0x40, 2], "a PUBACK");
                u16::from_be_bytes([a[2], a[3]])
            })
            .collect();
        acked.sort_unstable();
        assert_eq!(acked, (1..=20).collect::<Vec<_>>(), "each PUBLISH once");
    }

    #[test]
    fn a_failing_function_gets_no_puback_and_the_device_is_closed() {
        // A function that answers 500 to everything.
        let function = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let function_addr = function.local_addr().unwrap();
        std::thread::spawn(move || {
            for tcp in function.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut tcp = tcp;
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = tcp.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let _ = std::io::Write::write_all(
                            &mut tcp,
                            b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n",
                        );
                    }
                });
            }
        });
        let relay = relay_in_front_of(function_addr);
        let mut device = std::net::TcpStream::connect(relay).unwrap();
        device
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        // CONNECT (3.1.1, client "d"), then PUBLISH QoS 1 id 7 on "t" with "x".
        std::io::Write::write_all(
            &mut device,
            &[
                0x10, 13, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 30, 0, 1, b'd', 0x32, 6, 0, 1,
                b't', 0, 7, b'x',
            ],
        )
        .unwrap();
        let mut got = Vec::new();
        device.read_to_end(&mut got).unwrap();
        assert_eq!(got, [0x20, 2, 0, 0], "the CONNACK, no PUBACK, then closed");
    }
}
