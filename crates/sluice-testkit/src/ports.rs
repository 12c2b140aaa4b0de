//! Loopback port helpers for tests that must hand a port number to another process.
//!
//! Owns: picking a currently free TCP port on 127.0.0.1 and waiting until something accepts
//! connections on an address. Does not own: the listener itself. A port from [`free_port`] is
//! free only at the moment it is returned — another process may take it before it is used — so
//! callers that launch servers must retry on "address in use" (the broker launcher does).
//! In-process servers should bind port 0 themselves instead.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

/// How long to wait between connection attempts while polling a port.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
pub fn free_port() -> anyhow::Result<u16> {
    let listener =
        TcpListener::bind(("127.0.0.1", 0)).context("binding 127.0.0.1:0 to find a free port")?;
    let port = listener
        .local_addr()
        .context("reading the bound address")?
        .port();
    Ok(port)
}

/// Wait until `addr` accepts a TCP connection, polling every 20 ms for at most `timeout`.
pub async fn wait_for_port(addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let last_error =
            match tokio::time::timeout(POLL_INTERVAL * 5, tokio::net::TcpStream::connect(addr))
                .await
            {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "connect timed out".to_string(),
            };
        if Instant::now() >= deadline {
            bail!("{addr} did not accept a TCP connection within {timeout:?} (last error: {last_error})");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Blocking variant of [`wait_for_port`], for use outside an async context.
pub fn wait_for_port_blocking(addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect_timeout(&addr, POLL_INTERVAL * 5) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!("{addr} did not accept a TCP connection within {timeout:?} (last error: {e})")
            }
            Err(_) => std::thread::sleep(POLL_INTERVAL),
        }
    }
}
