//! The trivial CoAP responder: the generator's floor, and the peer of its tests.
//!
//! Owns: one UDP socket on one thread, answering every CON request at once. Does not own:
//! resources, de-duplication, or anything a real server does: its cost is the kernel's cost of
//! the datagrams plus a header rewrite, so the generator's rate against it is what the generator
//! can reach on this machine.
//!
//! Modes: [`Mode::Piggybacked`] answers a CON request with an ACK carrying 2.05 (GET) or 2.04
//! (other methods); [`Mode::Separate`] sends an empty ACK, then the response as a CON with its
//! own message id (the client's ACK of it is read and ignored); [`Mode::Silent`] answers nothing
//! (timeouts). Non-requests are ignored. Invariant: nothing the client sends panics it.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_proto::coap::{Code, Message, MsgType};

/// How the responder answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Piggybacked,
    Separate,
    Silent,
}

/// A running responder; dropping it stops its thread.
pub struct Responder {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Responder {
    /// Bind 127.0.0.1:0 and answer in `mode` on a thread of its own.
    pub fn start(mode: Mode) -> io::Result<Responder> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        socket.set_read_timeout(Some(Duration::from_millis(100)))?;
        let addr = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, requests) = (stop.clone(), requests.clone());
            std::thread::Builder::new()
                .name("coap-responder".to_string())
                .spawn(move || serve(&socket, mode, &stop, &requests))?
        };
        Ok(Responder {
            addr,
            stop,
            requests,
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests received (retransmissions included).
    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(socket: &UdpSocket, mode: Mode, stop: &AtomicBool, requests: &AtomicU64) {
    let mut buf = vec![0u8; 1500];
    let mut out = BytesMut::with_capacity(64);
    let mut mid: u16 = 0x8000;
    while !stop.load(Relaxed) {
        let (n, peer) = match socket.recv_from(&mut buf) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let Ok(req) = Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])) else {
            continue;
        };
        if req.mtype != MsgType::Con || !req.code.is_request() {
            continue;
        }
        requests.fetch_add(1, Relaxed);
        let code = if req.code == Code::GET {
            Code::CONTENT
        } else {
            Code::CHANGED
        };
        out.clear();
        match mode {
            Mode::Silent => continue,
            Mode::Piggybacked => {
                Message::new(MsgType::Ack, code, req.message_id, req.token).encode_udp(&mut out);
            }
            Mode::Separate => {
                Message::empty(MsgType::Ack, req.message_id).encode_udp(&mut out);
                let _ = socket.send_to(&out, peer);
                out.clear();
                mid = mid.wrapping_add(1);
                Message::new(MsgType::Con, code, mid, req.token).encode_udp(&mut out);
            }
        }
        let _ = socket.send_to(&out, peer);
    }
}
