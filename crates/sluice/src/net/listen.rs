//! Listening sockets for the device edges and the admin endpoint: TCP or MPTCP, with
//! SO_REUSEADDR and the gateway's backlog, non-blocking for tokio.
//!
//! Owns: creating and binding them. Does not own: accepting (each edge's listener).

use std::net::SocketAddr;

/// Connections the kernel completes and queues for `accept` per listener (capped by
/// `net.core.somaxconn`, 4096 by default since Linux 5.4). The standard library's 128 drops
/// the SYNs of a reconnect storm beyond it, and each dropped device waits out a 1 s, then 3 s
/// SYN retransmission before it gets in.
pub const LISTEN_BACKLOG: i32 = 4096;

/// The device listener: an MPTCP one when `[mqtt] mptcp` asks and the kernel has MPTCP (plain
/// TCP clients still connect to it), else TCP. Returns whether it is MPTCP (`None`: not asked).
pub fn bind_devices(
    addr: SocketAddr,
    mptcp: bool,
) -> std::io::Result<(std::net::TcpListener, Option<bool>)> {
    if !mptcp {
        return Ok((bind(addr)?, None));
    }
    match bind_with(addr, socket2::Protocol::MPTCP) {
        Ok(l) => Ok((l, Some(true))),
        Err(e) if crate::net::dial::kernel_lacks_mptcp(&e) => {
            tracing::warn!(blame = "local", error = %e, "[mqtt] mptcp = true, but this kernel refused an MPTCP listener (is net.mptcp.enabled = 1?); devices connect over plain TCP");
            Ok((bind(addr)?, Some(false)))
        }
        Err(e) => Err(e),
    }
}

pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    bind_with(addr, socket2::Protocol::TCP)
}

pub fn bind_with(
    addr: SocketAddr,
    protocol: socket2::Protocol,
) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(protocol))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Far more connections than the standard library's backlog of 128 complete their
    /// handshake while nobody accepts.
    #[test]
    fn the_listener_queues_a_connection_storm_beyond_128() {
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if somaxconn <= 200 {
            eprintln!("net.core.somaxconn is {somaxconn}: the kernel caps the backlog; skipped");
            return;
        }
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let storm = somaxconn.min(1000);
        let mut held = Vec::with_capacity(storm);
        for i in 0..storm {
            // A SYN beyond the accept queue is dropped: connect would wait for a retransmission.
            let stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
                .unwrap_or_else(|e| panic!("connection {i} of {storm} not queued: {e}"));
            held.push(stream);
        }
        assert_eq!(held.len(), storm);
    }
}
