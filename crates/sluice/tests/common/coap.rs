//! A CoAP/UDP test device built on `sluice_proto::coap`: sends requests to the gateway and
//! reads its answers, following a separate response (empty ACK, later CON) to its end.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use tokio::net::UdpSocket;

pub struct CoapDevice {
    pub sock: UdpSocket,
    pub server: SocketAddr,
    mid: u16,
    token: u64,
}

/// A request to `path` (`a/b/c`) with Uri-Query entries `query`.
pub fn request(mtype: MsgType, code: Code, path: &str, query: &[&str], payload: &[u8]) -> Message {
    let mut m = Message::new(mtype, code, 0, Token::EMPTY);
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        m.add_option(opt::URI_PATH, Bytes::copy_from_slice(seg.as_bytes()));
    }
    for q in query {
        m.add_option(opt::URI_QUERY, Bytes::copy_from_slice(q.as_bytes()));
    }
    m.payload = Bytes::copy_from_slice(payload);
    m
}

impl CoapDevice {
    pub async fn new(server: SocketAddr) -> CoapDevice {
        let sock = UdpSocket::bind("127.0.0.1:0").await.expect("bind device");
        let seed = sock.local_addr().expect("addr").port();
        CoapDevice {
            sock,
            server,
            mid: seed.wrapping_mul(7),
            token: seed as u64 * 1000,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.sock.local_addr().expect("addr")
    }

    /// Give `m` a fresh message id and token.
    pub fn stamp(&mut self, m: &mut Message) {
        self.mid = self.mid.wrapping_add(1);
        self.token += 1;
        m.message_id = self.mid;
        m.token = Token::from_slice(&self.token.to_be_bytes()[4..]).expect("4-byte token");
    }

    pub async fn send(&self, m: &Message) {
        self.send_raw(&m.to_udp()).await;
    }

    pub async fn send_raw(&self, bytes: &[u8]) {
        self.sock.send_to(bytes, self.server).await.expect("send");
    }

    /// The next datagram from the gateway, decoded; `None` after `timeout`.
    pub async fn recv(&self, timeout: Duration) -> Option<Message> {
        let mut buf = vec![0u8; 2048];
        let (n, _) = tokio::time::timeout(timeout, self.sock.recv_from(&mut buf))
            .await
            .ok()?
            .expect("recv");
        Some(Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])).expect("gateway sent a valid message"))
    }

    /// Send `m` (stamped) and return its response: piggybacked, or — after an empty ACK —
    /// the separate response (ACKed if it is a CON). Panics after `timeout`.
    pub async fn exchange(&mut self, mut m: Message, timeout: Duration) -> Message {
        self.stamp(&mut m);
        self.send(&m).await;
        self.response_to(&m, timeout).await.expect("a response in time")
    }

    /// The response to `req` (already sent); `None` after `timeout`.
    pub async fn response_to(&self, req: &Message, timeout: Duration) -> Option<Message> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let r = self.recv(left).await?;
            if r.mtype == MsgType::Ack && r.message_id == req.message_id && r.code.is_empty() {
                continue; // empty ACK: the response comes separately
            }
            if r.token != req.token {
                continue;
            }
            if r.mtype == MsgType::Con {
                self.send(&Message::empty(MsgType::Ack, r.message_id)).await;
            }
            return Some(r);
        }
    }
}
