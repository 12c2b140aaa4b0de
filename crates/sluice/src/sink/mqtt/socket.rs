//! Lane sockets: how each uplink session's TCP socket is marked for the wire (SegaNet §4.3).
//!
//! Owns: resolving the broker, creating the socket, setting the lane's options *before*
//! connecting (so even the SYN carries them) and reading them back for the status API and
//! tests. Does not own: TLS or MQTT on top (`link.rs`, `wire.rs`), or traffic control on the interface
//! (tc.rs).
//!
//! - High lane: `SO_PRIORITY` 6 and DSCP EF (`IP_TOS` 0xB8, or `IPV6_TCLASS` for IPv6), so
//!   Linux's default `pfifo_fast` qdisc puts its packets in the first band, and DSCP-aware
//!   networks can do the same.
//! - Normal lane: `TCP_NOTSENT_LOWAT` (when configured), so the socket reports writable only
//!   while little unsent data is queued in the kernel: normal data waits in sluice's own queue,
//!   where it can be aggregated and where it never sits in front of anything urgent.
//!
//! A mark the kernel refuses is logged once per connection and the connection goes ahead
//! unmarked: a missing mark costs latency, never data.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;

use socket2::SockRef;
#[cfg(test)]
use tokio::net::TcpSocket;
use tokio::net::TcpStream;

use crate::sink::Lane;

/// `SO_PRIORITY` of the high lane: the highest a process may set without CAP_NET_ADMIN, and
/// the value pfifo_fast maps to its first band.
pub const HIGH_SO_PRIORITY: u32 = 6;
/// DSCP Expedited Forwarding (46) in the upper six bits of the TOS / traffic class byte.
pub const HIGH_TOS: u32 = 46 << 2;

/// The marks a connected socket carries, as read back from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct SocketMarks {
    /// `SO_PRIORITY`.
    pub priority: u32,
    /// `IP_TOS` (IPv4) or `IPV6_TCLASS` (IPv6).
    pub tos: u32,
    /// `TCP_NOTSENT_LOWAT` (0 = kernel default).
    pub notsent_lowat: u32,
    /// The local (source) port.
    pub local_port: u16,
}

/// Connect to `host:port` with the lane's marks, dialled as `dial` says (source address,
/// interface, MPTCP), trying each resolved address in turn. Returns the stream and whether
/// its socket is an MPTCP one (see [`crate::net::dial`] for the fallback).
pub async fn connect(
    host: &str,
    port: u16,
    lane: Lane,
    notsent_lowat: u32,
    dial: &crate::net::dial::Dial,
) -> io::Result<(TcpStream, bool)> {
    let mut last_error = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        if dial.bind.is_some_and(|ip| ip.is_ipv4() != addr.is_ipv4()) {
            continue;
        }
        let (socket, mptcp) = match crate::net::dial::socket_for(addr, dial) {
            Ok(s) => s,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        if let Err(error) = mark(&socket, addr, lane, notsent_lowat) {
            tracing::warn!(lane = lane.as_str(), %error, "cannot mark the uplink socket; connecting unmarked");
        }
        match socket.connect(addr).await.and_then(refuse_self_connect) {
            Ok(stream) => return Ok((stream, mptcp)),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{host} resolved to no address"),
        )
    }))
}

/// Fails a connection the kernel made to itself. When nothing listens on a local port in the
/// ephemeral range (a cloud broker on the same host being restarted), a connect can be given
/// that very port as its source and "succeed" by TCP simultaneous open; kept, it would hold
/// the port so the broker could not listen on it again. Closing it at once frees the port and
/// the session retries as for a refused connection.
fn refuse_self_connect(stream: TcpStream) -> io::Result<TcpStream> {
    if stream.local_addr()? == stream.peer_addr()? {
        // Abort rather than close, so the port does not linger in TIME_WAIT.
        let _ = SockRef::from(&stream).set_linger(Some(std::time::Duration::ZERO));
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "connected to itself ({}): nothing listens there and the kernel chose that \
                 port as the source",
                stream.local_addr()?
            ),
        ));
    }
    Ok(stream)
}

/// Set the lane's options on an unconnected socket.
pub fn mark<S: AsFd>(
    socket: &S,
    addr: SocketAddr,
    lane: Lane,
    notsent_lowat: u32,
) -> io::Result<()> {
    let s = SockRef::from(socket);
    match lane {
        Lane::High => {
            // TOS first: on some kernels setting IP_TOS also rewrites SO_PRIORITY.
            match addr {
                SocketAddr::V4(_) => s.set_tos_v4(HIGH_TOS)?,
                SocketAddr::V6(_) => s.set_tclass_v6(HIGH_TOS)?,
            }
            s.set_priority(HIGH_SO_PRIORITY)?;
        }
        Lane::Normal => {
            if notsent_lowat > 0 {
                s.set_tcp_notsent_lowat(notsent_lowat)?;
            }
        }
    }
    Ok(())
}

/// Read a socket's marks back from the kernel.
pub fn marks<S: AsFd>(socket: &S) -> io::Result<SocketMarks> {
    let s = SockRef::from(socket);
    let local = s
        .local_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not an IP socket"))?;
    let tos = match local {
        SocketAddr::V4(_) => s.tos_v4()?,
        SocketAddr::V6(_) => s.tclass_v6()?,
    };
    Ok(SocketMarks {
        priority: s.priority()?,
        tos,
        notsent_lowat: s.tcp_notsent_lowat()?,
        local_port: local.port(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(lane: Lane, lowat: u32) -> (TcpStream, SocketMarks) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let (stream, _) = connect("127.0.0.1", port, lane, lowat, &Default::default())
            .await
            .unwrap();
        let marks = marks(&stream).unwrap();
        let _server = accept.await.unwrap();
        assert_eq!(marks.local_port, stream.local_addr().unwrap().port());
        (stream, marks)
    }

    #[tokio::test]
    async fn high_lane_socket_carries_priority_6_and_dscp_ef() {
        let (_s, m) = pair(Lane::High, 16 * 1024).await;
        assert_eq!(m.priority, 6);
        assert_eq!(m.tos, 0xB8);
        assert_eq!(m.notsent_lowat, 0, "the high lane is not throttled");
    }

    #[tokio::test]
    async fn normal_lane_socket_is_kept_shallow_and_unmarked() {
        let (_s, m) = pair(Lane::Normal, 16 * 1024).await;
        assert_eq!(m.notsent_lowat, 16 * 1024);
        assert_eq!(m.priority, 0);
        assert_eq!(m.tos, 0);
        let (_s, m) = pair(Lane::Normal, 0).await;
        assert_eq!(m.notsent_lowat, 0, "0 leaves the kernel default");
    }

    #[tokio::test]
    async fn a_connection_the_kernel_made_to_itself_is_refused_and_frees_the_port() {
        // Bind a socket and connect it to its own address: TCP simultaneous open, the same
        // thing the kernel does when a connect to a closed ephemeral port picks that port.
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        let stream = socket
            .connect(addr)
            .await
            .expect("Linux allows a self-connect");
        assert_eq!(stream.local_addr().unwrap(), stream.peer_addr().unwrap());
        let error = refuse_self_connect(stream).expect_err("a self-connect is refused");
        assert_eq!(error.kind(), io::ErrorKind::ConnectionRefused);
        assert!(error.to_string().contains("connected to itself"), "{error}");
        // The port is free again for the broker that belongs there.
        let listener = tokio::net::TcpListener::bind(addr).await;
        assert!(listener.is_ok(), "{listener:?}");
    }

    #[tokio::test]
    async fn unresolvable_host_is_an_error_not_a_panic() {
        assert!(connect(
            "no-such-host.invalid",
            1,
            Lane::High,
            0,
            &Default::default()
        )
        .await
        .is_err());
    }
}
