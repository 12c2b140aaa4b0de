//! One agent connection's bytes: APDUs off a read buffer (framing, `phd.max_apdu`) and
//! APDUs onto the socket — through TLS records when the listener has `[phd.tls]` — on
//! whichever runtime holds the connection.
//!
//! Owns: the read buffer (at most `phd.max_apdu` plus one read; a fresh one after an APDU
//! over 8 KiB, so a large APDU's allocation is not kept), the socket and its TLS session after the handshake
//! (`tls.rs` runs that), and the agent's identity (its client certificate's CN, if any).
//! Does not own: what an APDU means (the manager).
//! Invariant: [`Conn::next`] is cancel-safe (bytes read are kept in the buffer or in the TLS
//! session; nothing is written while reading).

use std::io::Read as _;
use std::sync::Arc;

use bytes::BytesMut;
use rustls::ServerConnection;
use sluice_proto::phd::{decode_apdu, Apdu, DecodeError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An APDU larger than this leaves the read buffer's allocation with the APDU (the bytes
/// after it are copied to a new buffer): a connection does not keep `phd.max_apdu` bytes
/// after one large APDU.
const KEEP_BUFFER: usize = 8 * 1024;

/// What the socket gave.
pub enum Read {
    Apdu(Apdu),
    Bad(DecodeError),
    Closed,
}

/// A connection's TLS session and who the agent proved to be (moves with the socket).
#[derive(Debug)]
pub struct Secure {
    pub session: Box<ServerConnection>,
    /// The subject CN of the agent's verified client certificate.
    pub identity: Option<Arc<str>>,
}

pub struct Conn {
    pub stream: TcpStream,
    pub buf: BytesMut,
    /// The agent's address (for log lines; `None` if the socket could not tell).
    pub peer: Option<std::net::SocketAddr>,
    /// The TLS session (`None`: plain TCP).
    pub tls: Option<Secure>,
    max_apdu: usize,
}

impl Conn {
    pub fn new(stream: TcpStream, buf: BytesMut, max_apdu: usize) -> Conn {
        Conn::resume(stream, buf, None, max_apdu)
    }

    /// A connection that moved here (with its TLS session, if it has one).
    pub fn resume(stream: TcpStream, buf: BytesMut, tls: Option<Secure>, max_apdu: usize) -> Conn {
        Conn {
            peer: stream.peer_addr().ok(),
            stream,
            buf,
            tls,
            max_apdu,
        }
    }

    /// The agent's certificate identity (`None`: plain TCP, or TLS without a certificate).
    pub fn identity(&self) -> Option<&Arc<str>> {
        self.tls.as_ref()?.identity.as_ref()
    }

    /// The next APDU (reading as needed), a framing error, or the end of the stream.
    pub async fn next(&mut self) -> Read {
        loop {
            let before = self.buf.len();
            match decode_apdu(&mut self.buf, self.max_apdu) {
                Ok(Some(a)) => {
                    if before - self.buf.len() > KEEP_BUFFER {
                        // A large APDU went by, and its bytes share the buffer's allocation:
                        // what follows it moves to a fresh, small one, so the allocation is
                        // freed with the APDU instead of staying with the connection.
                        self.buf = BytesMut::from(&self.buf[..]);
                    }
                    return Read::Apdu(a);
                }
                Err(e) => return Read::Bad(e),
                Ok(None) => {}
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(4096);
            }
            let Some(tls) = self.tls.as_mut() else {
                match self.stream.read_buf(&mut self.buf).await {
                    Ok(0) | Err(_) => return Read::Closed,
                    Ok(_) => continue,
                }
            };
            // Plaintext the session already holds first, then more records.
            let mut plain = [0u8; 4096];
            match tls.session.reader().read(&mut plain) {
                Ok(0) => return Read::Closed, // close_notify
                Ok(n) => {
                    self.buf.extend_from_slice(&plain[..n]);
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Read::Closed,
            }
            let mut records = [0u8; 4096];
            let n = match self.stream.read(&mut records).await {
                Ok(0) | Err(_) => return Read::Closed,
                Ok(n) => n,
            };
            let mut input = &records[..n];
            while !input.is_empty() {
                if tls.session.read_tls(&mut input).is_err()
                    || tls.session.process_new_packets().is_err()
                {
                    return Read::Closed;
                }
            }
        }
    }

    /// An APDU is already buffered whole (no read needed).
    pub fn has_whole(&self) -> bool {
        self.buf.len() >= 4
            && self.buf.len() >= 4 + usize::from(u16::from_be_bytes([self.buf[2], self.buf[3]]))
    }

    /// Write APDUs in one write.
    pub async fn send(&mut self, apdus: &[Apdu]) -> std::io::Result<()> {
        if apdus.is_empty() {
            return Ok(());
        }
        let mut out = BytesMut::new();
        for a in apdus {
            a.encode(&mut out);
        }
        match self.tls.as_mut() {
            None => self.stream.write_all(&out).await,
            Some(tls) => {
                std::io::Write::write_all(&mut tls.session.writer(), &out)?;
                super::tls::write_pending(&mut self.stream, &mut tls.session).await
            }
        }
    }

    /// Give the socket (and its TLS session) up for a hand-over.
    pub fn into_parts(self) -> std::io::Result<(std::net::TcpStream, BytesMut, Option<Secure>)> {
        let std = self.stream.into_std()?;
        Ok((std, self.buf, self.tls))
    }
}
