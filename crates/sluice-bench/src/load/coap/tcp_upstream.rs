//! A trivial CoAP-over-TCP server (RFC 8323): the upstream the proxy modes forward to.
//!
//! Owns: a listener on 127.0.0.1 and one blocking thread per connection. Each connection gets
//! a CSM first; every request is answered at once with the same token (2.05 with a 4-byte
//! payload for GET, 2.04 otherwise), in the order received, the answers to one read written
//! together; Ping gets Pong; Release or a malformed frame closes the connection. Does not own:
//! resources or state, so its cost is the kernel's plus framing, the same for every proxy.
//!
//! Why not libcoap's `coap-server-notls` as the upstream: libcoap 4.3.1's TCP server loses
//! requests that arrive pipelined (a proxy with many requests outstanding on one connection):
//! 1000 PUTs with 4-byte tokens written at once got 716 answers, then 4.05 and empty
//! messages (frames misread), so an outstanding window leaks until the proxy's timeout.
//! (Found while trialling `scenario coap`; `--upstream libcoap` still selects it.)

use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_proto::coap::tcp::{csm, decode_tcp, encode_tcp, pong};
use sluice_proto::coap::{Code, Message, MsgType};

/// Largest frame accepted (and announced in the CSM).
const MAX_MESSAGE: usize = 64 * 1024;

/// The running server; dropping it stops accepting (open connections end with their peer).
pub struct TcpUpstream {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
    accept: Option<JoinHandle<()>>,
}

impl TcpUpstream {
    pub fn start() -> io::Result<TcpUpstream> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), false)
    }

    /// Listen on `addr`, with IPPROTO_MPTCP when `mptcp` (the multipath scenario's cloud
    /// server: the kernel accepts the gateway's extra subflows).
    pub fn start_on(addr: SocketAddr, mptcp: bool) -> io::Result<TcpUpstream> {
        use socket2::{Domain, Protocol, Socket, Type};
        let protocol = if mptcp {
            Protocol::MPTCP
        } else {
            Protocol::TCP
        };
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(protocol))?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        let listener: TcpListener = socket.into();
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let accept = {
            let (stop, requests) = (stop.clone(), requests.clone());
            std::thread::Builder::new()
                .name("coap-tcp-up".to_string())
                .spawn(move || {
                    while !stop.load(Relaxed) {
                        match listener.accept() {
                            Ok((conn, _)) => {
                                let (stop, requests) = (stop.clone(), requests.clone());
                                let _ = std::thread::Builder::new()
                                    .name("coap-tcp-conn".to_string())
                                    .spawn(move || {
                                        let _ = serve(conn, &stop, &requests);
                                    });
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(20)),
                        }
                    }
                })?
        };
        Ok(TcpUpstream {
            addr,
            stop,
            requests,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }
}

impl Drop for TcpUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut conn: TcpStream, stop: &AtomicBool, requests: &AtomicU64) -> io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut out = BytesMut::with_capacity(16 * 1024);
    encode_tcp(&csm(MAX_MESSAGE as u32, false), &mut out);
    conn.write_all(&out)?;
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    let body = Bytes::from_static(b"22.5");
    while !stop.load(Relaxed) {
        let n = match read_within(&mut conn, &mut chunk)? {
            None => continue,
            Some(0) => return Ok(()),
            Some(n) => n,
        };
        inbuf.extend_from_slice(&chunk[..n]);
        out.clear();
        loop {
            let msg = match decode_tcp(&mut inbuf, MAX_MESSAGE) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(_) => return Ok(()),
            };
            if msg.code == Code::PING {
                encode_tcp(&pong(&msg), &mut out);
            } else if msg.code == Code::RELEASE || msg.code == Code::ABORT {
                return Ok(());
            } else if msg.code.is_request() {
                requests.fetch_add(1, Relaxed);
                let mut resp = Message::new(MsgType::Con, Code::CHANGED, 0, msg.token);
                if msg.code == Code::GET {
                    resp.code = Code::CONTENT;
                    resp.payload = body.clone();
                }
                encode_tcp(&resp, &mut out);
            }
        }
        if !out.is_empty() {
            conn.write_all(&out)?;
        }
    }
    Ok(())
}

/// One read from a blocking socket with a read timeout: `None` when the timeout passed with
/// nothing to read (so the caller can look at its stop flag), `Some(0)` when the peer closed.
pub(crate) fn read_within(conn: &mut TcpStream, buf: &mut [u8]) -> io::Result<Option<usize>> {
    match conn.read(buf) {
        Ok(n) => Ok(Some(n)),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
