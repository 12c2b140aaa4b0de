//! Binding the CoAP listener: one UDP socket per shard on the same address with
//! SO_REUSEPORT, so the kernel spreads datagrams over the shards by their 4-tuple hash and
//! each shard answers from a socket with the same local address the device sent to.
//!
//! Owns: the sockets' options (SO_REUSEPORT, a larger SO_RCVBUF, non-blocking). Does not own:
//! reading them (`server`).

use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};

/// Receive buffer asked for each socket (the kernel caps it at `net.core.rmem_max`): a burst
/// of datagrams waits here while the shard is busy.
const RECV_BUFFER: usize = 4 << 20;

/// `shards` non-blocking UDP sockets bound to `addr` (port 0: one free port, the same for
/// all of them).
pub fn bind(addr: SocketAddr, shards: usize) -> std::io::Result<Vec<std::net::UdpSocket>> {
    if addr.port() != 0 {
        // With SO_REUSEPORT a second sluice (same user) would bind the port too and the two
        // would silently split the devices' datagrams: make sure nobody holds it first.
        let probe = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        probe.bind(&addr.into())?;
    }
    let first = one(addr)?;
    let port = first
        .local_addr()?
        .as_socket()
        .map(|a| a.port())
        .unwrap_or(addr.port());
    let mut addr = addr;
    addr.set_port(port);
    let mut sockets = vec![first.into()];
    for _ in 1..shards.max(1) {
        sockets.push(one(addr)?.into());
    }
    Ok(sockets)
}

fn one(addr: SocketAddr) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_port(true)?;
    if let Err(error) = s.set_recv_buffer_size(RECV_BUFFER) {
        tracing::debug!(%error, "coap: SO_RCVBUF not raised");
    }
    s.bind(&addr.into())?;
    s.set_nonblocking(true)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shard_socket_shares_one_port_and_a_taken_port_is_refused() {
        let socks = bind("127.0.0.1:0".parse().unwrap(), 3).unwrap();
        let port = socks[0].local_addr().unwrap().port();
        assert_ne!(port, 0);
        assert!(socks.iter().all(|s| s.local_addr().unwrap().port() == port));
        let again = bind(SocketAddr::from(([127, 0, 0, 1], port)), 1);
        assert!(
            again.is_err(),
            "a second gateway on the same port is refused"
        );
    }
}
