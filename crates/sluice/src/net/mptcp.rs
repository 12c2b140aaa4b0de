//! MPTCP state of connected sockets (RFC 8684 as Linux implements it) and its metrics.
//!
//! Owns: reading a socket's MPTCP state from the kernel — `TCP_IS_MPTCP` (is MPTCP still in
//! use, or did the connection fall back to TCP), `SOL_MPTCP`/`MPTCP_INFO` (subflow count,
//! fallback flag, connection bytes), `MPTCP_SUBFLOW_ADDRS` and `MPTCP_TCPINFO` (each
//! subflow's addresses, TCP state and bytes) — and [`MptcpMetrics`], one per uplink session,
//! which keeps a duplicate of each of its MPTCP connections' descriptors so `/api/v1/status`
//! and `/metrics` read the kernel's current view, with no polling on the data path. Does not
//! own: creating sockets ([`crate::net::dial`]) or adding subflows (the kernel's path manager:
//! `ip mptcp endpoint`, or mptcpd).
//!
//! # Layouts (include/uapi/linux/mptcp.h, linux/tcp.h)
//! `struct mptcp_info`: `mptcpi_subflows` u8 at 0, `mptcpi_flags` u32 at 8 (bit 0: fallback),
//! `mptcpi_bytes_sent` u64 at 56 and `mptcpi_bytes_received` u64 at 64 (kernels ≥ 6.7; older
//! ones return a shorter struct, and those fields are then absent). `MPTCP_SUBFLOW_ADDRS` and
//! `MPTCP_TCPINFO` take a 16-byte `struct mptcp_subflow_data` header (`size_subflow_data`,
//! `num_subflows`, `size_kernel`, `size_user`) followed by `num_subflows` elements of
//! `size_user` bytes: two `sockaddr_storage` (128 bytes each: local, remote) for addresses; a
//! `struct tcp_info` for TCP (`tcpi_state` u8 at 0, `tcpi_bytes_acked` u64 at 120,
//! `tcpi_bytes_received` u64 at 128). Every length the kernel reports is checked; a short or
//! odd answer yields fewer fields, never a panic.
//!
//! # Invariants
//! - A kept descriptor is closed by [`MptcpMetrics::on_close`] with the key
//!   [`MptcpMetrics::on_connect`] returned; the transport calls it whenever its connection
//!   ends (a kept duplicate would otherwise keep the TCP connection open).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::telemetry::metrics::{Counter, PromWriter};

const SOL_TCP: libc::c_int = 6;
const TCP_IS_MPTCP: libc::c_int = 43;
const SOL_MPTCP: libc::c_int = 284;
const MPTCP_INFO: libc::c_int = 1;
const MPTCP_TCPINFO: libc::c_int = 2;
const MPTCP_SUBFLOW_ADDRS: libc::c_int = 3;
const MPTCP_INFO_FLAG_FALLBACK: u32 = 1;
/// Subflows read per connection (the kernel's own limit is 8).
const MAX_SUBFLOWS: usize = 16;
const SUBFLOW_HEADER: usize = 16;
const SOCKADDR_STORAGE: usize = 128;
/// The part of `struct tcp_info` we ask for (up to and including `tcpi_bytes_received`).
const TCP_INFO_USER: usize = 232;

/// Why a connection asked to use MPTCP uses plain TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// This kernel refused an MPTCP socket (no MPTCP, or `net.mptcp.enabled = 0`).
    Kernel,
    /// The peer (or a middlebox) did not answer with MPTCP: the connection fell back to TCP.
    Peer,
}

impl Fallback {
    pub const ALL: [Fallback; 2] = [Fallback::Kernel, Fallback::Peer];

    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::Kernel => "kernel",
            Fallback::Peer => "peer",
        }
    }
}

/// One subflow as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Subflow {
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    pub state: &'static str,
    pub bytes_sent: Option<u64>,
    pub bytes_received: Option<u64>,
}

/// A connection's MPTCP state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MptcpInfo {
    /// MPTCP is in use (not fallen back).
    pub active: bool,
    pub subflows: Vec<Subflow>,
    pub bytes_sent: Option<u64>,
    pub bytes_received: Option<u64>,
}

/// The crate's one `unsafe` (ADR 0004): `getsockopt` into a byte buffer. Also used by the
/// function runtime to read a listening socket's accept queue (`TCP_INFO`).
#[allow(unsafe_code)]
pub(crate) fn getsockopt(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    buf: &mut [u8],
) -> io::Result<usize> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: `buf` is valid for `len` bytes for the duration of the call, and `len` is a
    // valid in/out length; the kernel writes at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((len as usize).min(buf.len()))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Whether the socket still uses MPTCP (`TCP_IS_MPTCP`); an error for a kernel without it.
pub fn is_mptcp<S: AsFd>(socket: &S) -> io::Result<bool> {
    let mut b = [0u8; 4];
    let n = getsockopt(socket.as_fd(), SOL_TCP, TCP_IS_MPTCP, &mut b)?;
    Ok(n == 4 && u32::from_ne_bytes(b) != 0)
}

/// The MPTCP state of a connected MPTCP socket.
pub fn info<S: AsFd>(socket: &S) -> io::Result<MptcpInfo> {
    let fd = socket.as_fd();
    let active = is_mptcp(&fd)?;
    if !active {
        return Ok(MptcpInfo {
            active: false,
            subflows: Vec::new(),
            bytes_sent: None,
            bytes_received: None,
        });
    }
    let mut b = [0u8; 128];
    let (flags, bytes_sent, bytes_received) = match getsockopt(fd, SOL_MPTCP, MPTCP_INFO, &mut b) {
        Ok(n) => parse_info(&b[..n]),
        Err(_) => (0, None, None),
    };
    let addrs = subflow_data(fd, MPTCP_SUBFLOW_ADDRS, 2 * SOCKADDR_STORAGE)
        .map(|v| v.iter().map(|e| parse_addrs(e)).collect::<Vec<_>>())
        .unwrap_or_default();
    let tcp = subflow_data(fd, MPTCP_TCPINFO, TCP_INFO_USER).unwrap_or_default();
    let n = addrs.len().max(tcp.len());
    let subflows = (0..n)
        .map(|i| {
            let (local, remote) = addrs.get(i).copied().unwrap_or((None, None));
            let t = tcp.get(i).map(Vec::as_slice).unwrap_or(&[]);
            Subflow {
                local,
                remote,
                state: tcp_state(t.first().copied()),
                bytes_sent: u64_at(t, 120),
                bytes_received: u64_at(t, 128),
            }
        })
        .collect();
    Ok(MptcpInfo {
        active: flags & MPTCP_INFO_FLAG_FALLBACK == 0,
        subflows,
        bytes_sent,
        bytes_received,
    })
}

/// `struct mptcp_info`: (flags, bytes sent, bytes received).
fn parse_info(b: &[u8]) -> (u32, Option<u64>, Option<u64>) {
    (u32_at(b, 8).unwrap_or(0), u64_at(b, 56), u64_at(b, 64))
}

/// One `MPTCP_SUBFLOW_ADDRS` / `MPTCP_TCPINFO` answer: its elements.
fn subflow_data(
    fd: BorrowedFd<'_>,
    name: libc::c_int,
    size_user: usize,
) -> io::Result<Vec<Vec<u8>>> {
    let mut b = vec![0u8; SUBFLOW_HEADER + MAX_SUBFLOWS * size_user];
    b[0..4].copy_from_slice(&(SUBFLOW_HEADER as u32).to_ne_bytes());
    b[12..16].copy_from_slice(&(size_user as u32).to_ne_bytes());
    let n = getsockopt(fd, SOL_MPTCP, name, &mut b)?;
    Ok(parse_subflow_data(&b[..n]))
}

/// Split a subflow-data answer into its elements (header checked; elements cut to what
/// was returned).
fn parse_subflow_data(b: &[u8]) -> Vec<Vec<u8>> {
    let (Some(hdr), Some(num), Some(size_kernel), Some(size_user)) =
        (u32_at(b, 0), u32_at(b, 4), u32_at(b, 8), u32_at(b, 12))
    else {
        return Vec::new();
    };
    let (hdr, size_user) = (hdr as usize, size_user as usize);
    if hdr < SUBFLOW_HEADER || size_user == 0 {
        return Vec::new();
    }
    let elem = size_user.min(size_kernel as usize).max(1);
    (0..(num as usize).min(MAX_SUBFLOWS))
        .filter_map(|i| {
            let at = hdr.checked_add(i.checked_mul(size_user)?)?;
            b.get(at..at + elem.min(b.len().saturating_sub(at)))
                .map(<[u8]>::to_vec)
        })
        .filter(|e| !e.is_empty())
        .collect()
}

/// Two `sockaddr_storage`: local, remote.
fn parse_addrs(e: &[u8]) -> (Option<SocketAddr>, Option<SocketAddr>) {
    (
        parse_sockaddr(e.get(..SOCKADDR_STORAGE).unwrap_or(&[])),
        parse_sockaddr(e.get(SOCKADDR_STORAGE..).unwrap_or(&[])),
    )
}

fn parse_sockaddr(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes(b.get(0..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(b.get(2..4)?.try_into().ok()?);
    match i32::from(family) {
        libc::AF_INET => {
            let ip: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port))
        }
        libc::AF_INET6 => {
            let ip: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port))
        }
        _ => None,
    }
}

fn tcp_state(s: Option<u8>) -> &'static str {
    match s {
        Some(1) => "established",
        Some(2) => "syn_sent",
        Some(3) => "syn_recv",
        Some(4) => "fin_wait1",
        Some(5) => "fin_wait2",
        Some(6) => "time_wait",
        Some(7) => "close",
        Some(8) => "close_wait",
        Some(9) => "last_ack",
        Some(10) => "listen",
        Some(11) => "closing",
        _ => "unknown",
    }
}

/// MPTCP status of one uplink session (or one proxy upstream), for `/api/v1/status` and
/// `/metrics`.
#[derive(Debug, Default)]
pub struct MptcpMetrics {
    asked: AtomicBool,
    /// Duplicates of the session's MPTCP connections, by key.
    conns: Mutex<Vec<(u64, OwnedFd)>>,
    next_key: AtomicU64,
    fallbacks: [Counter; Fallback::ALL.len()],
    last_fallback: Mutex<Option<Fallback>>,
    /// The fallback WARN was written (once per session).
    warned: AtomicBool,
}

impl MptcpMetrics {
    /// A connection of this session was established: `asked` whether MPTCP was configured,
    /// `mptcp_socket` whether the socket is an MPTCP one (the kernel took IPPROTO_MPTCP).
    /// Returns the key to pass to [`MptcpMetrics::on_close`] (0: nothing kept).
    pub fn on_connect<S: AsFd>(&self, socket: &S, asked: bool, mptcp_socket: bool) -> u64 {
        if !asked {
            return 0;
        }
        self.asked.store(true, Ordering::Relaxed);
        let fallback = if !mptcp_socket {
            Some(Fallback::Kernel)
        } else {
            match is_mptcp(socket) {
                Ok(true) => None,
                _ => Some(Fallback::Peer),
            }
        };
        *self.last_fallback.lock().unwrap_or_else(|p| p.into_inner()) = fallback;
        if let Some(f) = fallback {
            self.fallbacks[f as usize].inc();
            if !self.warned.swap(true, Ordering::Relaxed) {
                let (blame, why) = match f {
                    Fallback::Kernel => (
                        "local",
                        "this kernel refused an MPTCP socket (is net.mptcp.enabled = 1?)",
                    ),
                    Fallback::Peer => ("cloud", "the peer did not answer with MPTCP"),
                };
                tracing::warn!(blame, reason = f.as_str(), "MPTCP asked for but not in use: {why}; the connection uses plain TCP (logged once per session; counted in sluice_uplink_mptcp_fallbacks_total)");
            }
            return 0;
        }
        let Ok(dup) = socket.as_fd().try_clone_to_owned() else {
            return 0;
        };
        let key = self.next_key.fetch_add(1, Ordering::Relaxed) + 1;
        self.conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((key, dup));
        key
    }

    /// The connection `key` ended: its duplicate descriptor is closed.
    pub fn on_close(&self, key: u64) {
        if key == 0 {
            return;
        }
        self.conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(k, _)| *k != key);
    }

    /// The current state of each kept connection.
    pub fn infos(&self) -> Vec<MptcpInfo> {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.iter().filter_map(|(_, fd)| info(fd).ok()).collect()
    }

    pub fn fallbacks(&self, f: Fallback) -> u64 {
        self.fallbacks[f as usize].get()
    }

    /// The status JSON (`null` while MPTCP was never asked for): `asked`, `active` (every
    /// live connection uses MPTCP), `fallback` (the last connection's reason, or null), the
    /// subflows of every live connection, and the fallback counts.
    pub fn status(&self) -> serde_json::Value {
        if !self.asked.load(Ordering::Relaxed) {
            return serde_json::Value::Null;
        }
        let infos = self.infos();
        let fallback = *self.last_fallback.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::json!({
            "asked": true,
            "active": !infos.is_empty() && infos.iter().all(|i| i.active),
            "fallback": fallback,
            "connections": infos,
            "subflows": infos.iter().flat_map(|i| i.subflows.clone()).collect::<Vec<_>>(),
            "fallbacks": Fallback::ALL.iter().map(|f| (f.as_str().to_string(), serde_json::json!(self.fallbacks(*f)))).collect::<serde_json::Map<_, _>>(),
        })
    }

    /// Render `{prefix}_mptcp_active`, `_subflows` and `_fallbacks_total` (prefix
    /// `sluice_uplink` for uplink sessions, `sluice_coap_proxy` for proxy upstreams).
    pub fn render(&self, w: &mut PromWriter, prefix: &str, labels: &[(&str, &str)]) {
        if !self.asked.load(Ordering::Relaxed) {
            return;
        }
        let infos = self.infos();
        w.gauge(
            &format!("{prefix}_mptcp_active"),
            "Connections of the session using MPTCP (not fallen back).",
            labels,
            infos.iter().filter(|i| i.active).count() as i64,
        );
        w.gauge(
            &format!("{prefix}_mptcp_subflows"),
            "MPTCP subflows of the session's connections, as the kernel reports them.",
            labels,
            infos.iter().map(|i| i.subflows.len()).sum::<usize>() as i64,
        );
        for f in Fallback::ALL {
            let mut l = labels.to_vec();
            l.push(("reason", f.as_str()));
            w.counter(
                &format!("{prefix}_mptcp_fallbacks_total"),
                "Connections that asked for MPTCP and use plain TCP (kernel: no MPTCP socket here; peer: it did not answer with MPTCP).",
                &l,
                self.fallbacks(f),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sockaddr_v4(ip: [u8; 4], port: u16) -> Vec<u8> {
        let mut b = vec![0u8; SOCKADDR_STORAGE];
        b[0..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        b[2..4].copy_from_slice(&port.to_be_bytes());
        b[4..8].copy_from_slice(&ip);
        b
    }

    #[test]
    fn subflow_addresses_are_read_from_the_kernels_layout() {
        let mut b = Vec::new();
        b.extend((SUBFLOW_HEADER as u32).to_ne_bytes());
        b.extend(2u32.to_ne_bytes());
        b.extend((2 * SOCKADDR_STORAGE as u32).to_ne_bytes());
        b.extend((2 * SOCKADDR_STORAGE as u32).to_ne_bytes());
        for (l, r) in [
            ([10, 0, 1, 2], [10, 0, 0, 1]),
            ([10, 0, 2, 2], [10, 0, 0, 1]),
        ] {
            b.extend(sockaddr_v4(l, 40000));
            b.extend(sockaddr_v4(r, 8883));
        }
        let elems = parse_subflow_data(&b);
        assert_eq!(elems.len(), 2);
        let (local, remote) = parse_addrs(&elems[1]);
        assert_eq!(local, Some("10.0.2.2:40000".parse().unwrap()));
        assert_eq!(remote, Some("10.0.0.1:8883".parse().unwrap()));
    }

    #[test]
    fn a_short_or_inconsistent_answer_yields_fewer_fields_not_a_panic() {
        assert!(parse_subflow_data(&[1, 2, 3]).is_empty());
        let mut b = Vec::new();
        b.extend((SUBFLOW_HEADER as u32).to_ne_bytes());
        b.extend(5u32.to_ne_bytes()); // claims 5, carries 1 truncated
        b.extend(232u32.to_ne_bytes());
        b.extend(232u32.to_ne_bytes());
        b.extend([1u8; 40]);
        let e = parse_subflow_data(&b);
        assert_eq!(e.len(), 1);
        assert_eq!(u64_at(&e[0], 120), None);
        assert_eq!(parse_info(&[0u8; 12]), (0, None, None));
        assert_eq!(tcp_state(e[0].first().copied()), "established");
    }

    proptest! {
        #[test]
        fn any_bytes_parse_without_panicking(b in proptest::collection::vec(any::<u8>(), 0..2048)) {
            for e in parse_subflow_data(&b) {
                let _ = parse_addrs(&e);
                let _ = tcp_state(e.first().copied());
            }
            let _ = parse_info(&b);
        }
    }

    #[test]
    fn a_loopback_mptcp_connection_reports_itself_and_a_plain_peer_falls_back() {
        use socket2::{Domain, Protocol, Socket, Type};
        use std::net::{TcpListener, TcpStream};
        let mptcp_listener = match Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::MPTCP)) {
            Ok(s) => s,
            Err(e) => {
                println!("skipped: this kernel has no MPTCP ({e})");
                return;
            }
        };
        mptcp_listener
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        mptcp_listener.listen(8).unwrap();
        let addr = mptcp_listener.local_addr().unwrap().as_socket().unwrap();
        let client = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::MPTCP)).unwrap();
        client.connect(&addr.into()).unwrap();
        let (_server, _) = mptcp_listener.accept().unwrap();
        let client: TcpStream = client.into();
        let i = info(&client).unwrap();
        assert!(i.active, "{i:?}");
        assert!(!i.subflows.is_empty(), "{i:?}");
        assert_eq!(i.subflows[0].remote, Some(addr));

        let metrics = MptcpMetrics::default();
        let key = metrics.on_connect(&client, true, true);
        assert_ne!(key, 0);
        assert_eq!(metrics.status()["active"], true);
        metrics.on_close(key);
        assert!(metrics.infos().is_empty());

        let plain = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::MPTCP)).unwrap();
        client.connect(&plain.local_addr().unwrap().into()).unwrap();
        let _server = plain.accept().unwrap();
        let client: TcpStream = client.into();
        assert!(!is_mptcp(&client).unwrap(), "a plain TCP peer: fallen back");
        assert_eq!(metrics.on_connect(&client, true, true), 0);
        assert_eq!(metrics.fallbacks(Fallback::Peer), 1);
        assert_eq!(metrics.status()["fallback"], "peer");
    }
}
