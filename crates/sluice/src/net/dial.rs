//! Dialling an outgoing TCP connection: the socket's protocol (TCP or MPTCP), its source
//! address and its interface, set before `connect` so the SYN already carries them.
//!
//! Owns: [`Dial`] (what a connection asks for) and [`socket_for`] (an unconnected tokio
//! socket for it). Does not own: lane marks (`sink::mqtt::socket`), reading MPTCP state
//! after the connect ([`crate::net::mptcp`]).
//!
//! MPTCP fallback: a kernel without MPTCP (or with `net.mptcp.enabled = 0`) refuses the
//! socket (EPROTONOSUPPORT, ENOPROTOOPT or EINVAL); the connection then goes ahead over
//! plain TCP and [`socket_for`] says so. A peer without MPTCP is found after the connect
//! ([`crate::net::mptcp::info`]): the kernel falls back to TCP on the same socket.

use std::io;
use std::net::{IpAddr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpSocket;

/// How one outgoing connection is opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dial {
    /// Open the socket with IPPROTO_MPTCP (falls back to TCP when the kernel refuses).
    pub mptcp: bool,
    /// Bind to this local address before connecting (policy routing picks the link).
    pub bind: Option<IpAddr>,
    /// SO_BINDTODEVICE: the connection leaves through this interface only.
    pub interface: Option<String>,
}

/// An unconnected socket for `addr`, and whether it is an MPTCP socket (`false` when MPTCP
/// was not asked for, or the kernel refused it: see the module docs).
pub fn socket_for(addr: SocketAddr, dial: &Dial) -> io::Result<(TcpSocket, bool)> {
    let domain = Domain::for_address(addr);
    let (socket, mptcp) = if dial.mptcp {
        match Socket::new(domain, Type::STREAM, Some(Protocol::MPTCP)) {
            Ok(s) => (s, true),
            Err(e) if kernel_lacks_mptcp(&e) => (Socket::new(domain, Type::STREAM, None)?, false),
            Err(e) => return Err(e),
        }
    } else {
        (Socket::new(domain, Type::STREAM, None)?, false)
    };
    socket.set_nonblocking(true)?;
    socket.set_cloexec(true)?;
    if let Some(name) = &dial.interface {
        socket.bind_device(Some(name.as_bytes())).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot bind the socket to interface {name:?}: {e}"),
            )
        })?;
    }
    if let Some(ip) = dial.bind {
        if ip.is_ipv4() != addr.is_ipv4() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bind address {ip} and destination {addr} are of different IP families"),
            ));
        }
        socket
            .bind(&SocketAddr::new(ip, 0).into())
            .map_err(|e| io::Error::new(e.kind(), format!("cannot bind to {ip}: {e}")))?;
    }
    let std: std::net::TcpStream = socket.into();
    Ok((TcpSocket::from_std_stream(std), mptcp))
}

/// The errors a kernel without (enabled) MPTCP gives for an IPPROTO_MPTCP socket.
pub fn kernel_lacks_mptcp(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == libc_consts::EPROTONOSUPPORT
            || code == libc_consts::ENOPROTOOPT
            || code == libc_consts::EINVAL
    )
}

/// errno values (Linux, every architecture sluice builds for).
mod libc_consts {
    pub const EPROTONOSUPPORT: i32 = 93;
    pub const ENOPROTOOPT: i32 = 92;
    pub const EINVAL: i32 = 22;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bound_socket_leaves_from_its_address() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let dial = Dial {
            bind: Some("127.0.0.2".parse().unwrap()),
            ..Dial::default()
        };
        let (socket, mptcp) = socket_for(addr, &dial).unwrap();
        assert!(!mptcp);
        let stream = socket.connect(addr).await.unwrap();
        let (_, peer) = listener.accept().await.unwrap();
        assert_eq!(peer.ip(), "127.0.0.2".parse::<IpAddr>().unwrap());
        assert_eq!(stream.local_addr().unwrap().ip(), peer.ip());
    }

    #[test]
    fn a_bind_address_of_the_other_family_is_a_clear_error() {
        let dial = Dial {
            bind: Some("::1".parse().unwrap()),
            ..Dial::default()
        };
        let err = socket_for("127.0.0.1:1".parse().unwrap(), &dial).unwrap_err();
        assert!(err.to_string().contains("different IP families"), "{err}");
    }
}
