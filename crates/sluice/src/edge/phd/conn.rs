//! One agent connection's bytes: APDUs off a read buffer (framing, `phd.max_apdu`) and
//! APDUs onto the socket, on whichever runtime holds the connection.
//!
//! Owns: the read buffer (at most `phd.max_apdu` plus one read; back to at most 8 KiB
//! once a larger APDU is taken) and the socket. Does not own: what an APDU means (the manager).
//! Invariant: [`Conn::next`] is cancel-safe (bytes read are kept in the buffer).

use bytes::BytesMut;
use sluice_proto::phd::{decode_apdu, Apdu, DecodeError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Read-buffer capacity kept between APDUs; a larger one (after an APDU of up to
/// `phd.max_apdu`) is given back once it is empty.
const KEEP_BUFFER: usize = 8 * 1024;

/// What the socket gave.
pub enum Read {
    Apdu(Apdu),
    Bad(DecodeError),
    Closed,
}

pub struct Conn {
    pub stream: TcpStream,
    pub buf: BytesMut,
    /// The agent's address (for log lines; `None` if the socket could not tell).
    pub peer: Option<std::net::SocketAddr>,
    max_apdu: usize,
}

impl Conn {
    pub fn new(stream: TcpStream, buf: BytesMut, max_apdu: usize) -> Conn {
        Conn {
            peer: stream.peer_addr().ok(),
            stream,
            buf,
            max_apdu,
        }
    }

    /// The next APDU (reading as needed), a framing error, or the end of the stream.
    pub async fn next(&mut self) -> Read {
        loop {
            match decode_apdu(&mut self.buf, self.max_apdu) {
                Ok(Some(a)) => {
                    if self.buf.is_empty() && self.buf.capacity() > KEEP_BUFFER {
                        // A large APDU went by: do not keep its allocation for the life of
                        // the connection (it is freed when the APDU's bytes are dropped).
                        self.buf = BytesMut::new();
                    }
                    return Read::Apdu(a);
                }
                Err(e) => return Read::Bad(e),
                Ok(None) => {}
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(4096);
            }
            match self.stream.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => return Read::Closed,
                Ok(_) => {}
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
        self.stream.write_all(&out).await
    }

    /// Give the socket up for a hand-over.
    pub fn into_parts(self) -> std::io::Result<(std::net::TcpStream, BytesMut)> {
        let std = self.stream.into_std()?;
        Ok((std, self.buf))
    }
}
