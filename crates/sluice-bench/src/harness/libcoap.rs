//! libcoap's `coap-server-notls` as a child process (an upstream CoAP server on UDP and TCP, or
//! a forward proxy), a port free for both UDP and TCP, and a CoAP readiness probe.
//!
//! Owns: the child's lifetime (dropping it kills it). Does not own: what the server answers.
//!
//! The proxy form is `coap-server-notls -p PORT -P ,NAME`: no next hop before the comma, so
//! libcoap connects directly to the host of each request's Proxy-Uri (here a
//! `coap+tcp://127.0.0.1:UPSTREAM/...` URI) and answers the device with an empty ACK followed
//! by the upstream's response as a separate CON (checked by hand with
//! `coap-client-notls -P coap://127.0.0.1:PORT coap+tcp://127.0.0.1:UPSTREAM/time`).

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::{Bytes, BytesMut};
use sluice_proto::coap::{Code, Message, MsgType, Token};

/// The libcoap server binary (Debian `libcoap3-bin`).
pub const COAP_SERVER_BIN: &str = "coap-server-notls";

/// `coap-server-notls` running; dropping it kills it.
pub struct LibcoapServer {
    child: Child,
    pub addr: SocketAddr,
    pub command_line: String,
}

impl LibcoapServer {
    /// A plain server on 127.0.0.1:`port` (UDP and TCP).
    pub fn server(port: u16) -> anyhow::Result<LibcoapServer> {
        LibcoapServer::start(SocketAddr::from(([127, 0, 0, 1], port)), &[], &[])
    }

    /// A plain server on `addr` (UDP and TCP) run by `launcher` (e.g. `["mptcpize", "run"]`:
    /// its TCP listener then takes MPTCP), in the calling thread's network namespace.
    pub fn server_on(addr: SocketAddr, launcher: &[&str]) -> anyhow::Result<LibcoapServer> {
        LibcoapServer::start(addr, launcher, &[])
    }

    /// A forward proxy on 127.0.0.1:`port` that connects directly to each Proxy-Uri's host.
    pub fn proxy(port: u16) -> anyhow::Result<LibcoapServer> {
        LibcoapServer::start(
            SocketAddr::from(([127, 0, 0, 1], port)),
            &[],
            &["-P", ",sluice-bench-proxy"],
        )
    }

    fn start(addr: SocketAddr, launcher: &[&str], extra: &[&str]) -> anyhow::Result<LibcoapServer> {
        let (ip_s, port_s) = (addr.ip().to_string(), addr.port().to_string());
        let mut args: Vec<&str> = launcher.to_vec();
        args.extend_from_slice(&[COAP_SERVER_BIN, "-A", &ip_s, "-p", &port_s, "-v", "0"]);
        args.extend_from_slice(extra);
        let child = Command::new(args[0])
            .args(&args[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} (install libcoap3-bin)", args.join(" ")))?;
        let server = LibcoapServer {
            child,
            addr,
            command_line: args.join(" "),
        };
        probe_coap(addr, Duration::from_secs(5))
            .with_context(|| format!("{} did not answer", server.command_line))?;
        Ok(server)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LibcoapServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port on 127.0.0.1 free for both UDP and TCP right now.
pub fn free_udp_tcp_port() -> anyhow::Result<u16> {
    for _ in 0..50 {
        let udp = UdpSocket::bind("127.0.0.1:0").context("binding a UDP socket")?;
        let port = udp.local_addr()?.port();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no port free for both UDP and TCP after 50 tries")
}

/// Send `CON GET /.well-known/core` to `addr` until anything CoAP comes back (any code: the
/// listener is up), for up to `within`.
pub fn probe_coap(addr: SocketAddr, within: Duration) -> anyhow::Result<()> {
    let socket = UdpSocket::bind("127.0.0.1:0")?;
    socket.connect(addr)?;
    socket.set_read_timeout(Some(Duration::from_millis(100)))?;
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 1500];
    let mut mid: u16 = 1;
    while Instant::now() < deadline {
        let token = Token::from_slice(&[0xb0, 0x0b]).unwrap_or(Token::EMPTY);
        let mut m = Message::new(MsgType::Con, Code::GET, mid, token);
        m.add_option(
            sluice_proto::coap::opt::URI_PATH,
            Bytes::from_static(b".well-known"),
        );
        m.add_option(
            sluice_proto::coap::opt::URI_PATH,
            Bytes::from_static(b"core"),
        );
        let mut out = BytesMut::new();
        m.encode_udp(&mut out);
        let _ = socket.send(&out);
        if let Ok(n) = socket.recv(&mut buf) {
            if Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])).is_ok() {
                return Ok(());
            }
        }
        mid = mid.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("no CoAP answer from {addr} within {within:?}")
}
