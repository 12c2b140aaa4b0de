//! One DTLS peer's session, sans-IO: an OpenSSL `SslStream` over a [`Pipe`] that takes one
//! datagram in and collects the datagrams OpenSSL writes, so the shard's socket, clock and
//! tables stay outside (the quinn-proto shape, STYLE.md).
//!
//! Owns: the peer's `Ssl` (handshake state, keys, replay window), its authenticated
//! identity, and its activity times. Does not own: the socket (`super`), the cookie exchange
//! before it exists (`super::hello`), or what the decrypted CoAP messages mean (`server`).
//!
//! Invariants: a `Pipe` holds at most one inbound datagram and is drained of outbound ones
//! after every call, so a session buffers nothing between calls apart from OpenSSL's own
//! state; a failed or closed session is never fed again (the caller removes it).
//!
//! Timers: OpenSSL keeps its DTLS retransmission timer (1 s doubling) itself and acts on it
//! when it is next driven; [`Session::poll_timer`] drives a handshaking session from the
//! shard's tick, so a lost server flight is resent.

use std::io::{self, Read, Write};
use std::time::Instant;

use openssl::ssl::{ErrorCode, Ssl, SslStream};

/// Largest decrypted record read at once (a DTLS record carries at most 2^14 bytes).
const MAX_PLAINTEXT: usize = 16 * 1024;

/// The session's I/O: one datagram in, the datagrams written out.
#[derive(Debug, Default)]
pub struct Pipe {
    inbound: Option<Vec<u8>>,
    pub outbound: Vec<Vec<u8>>,
}

impl Read for Pipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inbound.take() {
            Some(d) => {
                // A datagram longer than OpenSSL's buffer is cut, as a socket read would be;
                // its records then fail their checks and are discarded.
                let n = d.len().min(buf.len());
                buf[..n].copy_from_slice(&d[..n]);
                Ok(n)
            }
            None => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.outbound.push(buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What feeding a session produced.
#[derive(Debug, Default)]
pub struct Fed {
    /// Datagrams to send to the peer, in order.
    pub out: Vec<Vec<u8>>,
    /// Decrypted application datagrams (CoAP messages), in order.
    pub app: Vec<Vec<u8>>,
    pub event: Option<Event>,
}

/// A change of the session's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The handshake finished.
    Established,
    /// The handshake or the session failed (an alert was sent when OpenSSL had one).
    Failed(String),
    /// The peer closed the session (close_notify).
    Closed,
}

/// A peer's DTLS session.
pub struct Session {
    stream: SslStream<Pipe>,
    established: bool,
    pub started: Instant,
    pub last_active: Instant,
    /// The authenticated identity (set when established; `None`: an anonymous peer).
    pub identity: Option<bytestring::ByteString>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("established", &self.established)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A server session for a peer whose cookie-bearing ClientHello `hello` was checked:
    /// `first` (the same hello without cookie, `hello::ClientHello::without_cookie`) is
    /// shown first and its HelloVerifyRequest discarded, then `hello` itself. An error: the
    /// handshake failed at once (its alert, if any, is lost with the session).
    pub fn accept(
        ssl: Ssl,
        first: Vec<u8>,
        hello: &[u8],
        now: Instant,
    ) -> Result<(Session, Fed), String> {
        let stream = SslStream::new(ssl, Pipe::default()).map_err(|e| e.to_string())?;
        let mut s = Session {
            stream,
            established: false,
            started: now,
            last_active: now,
            identity: None,
        };
        s.stream.get_mut().inbound = Some(first);
        let r = s.stream.accept();
        s.stream.get_mut().outbound.clear();
        if let Err(e) = r {
            if e.code() != ErrorCode::WANT_READ {
                return Err(e.to_string());
            }
        }
        let fed = s.feed(hello, now);
        Ok((s, fed))
    }

    pub fn is_established(&self) -> bool {
        self.established
    }

    pub fn ssl(&self) -> &openssl::ssl::SslRef {
        self.stream.ssl()
    }

    /// A datagram from the peer.
    pub fn feed(&mut self, datagram: &[u8], now: Instant) -> Fed {
        self.last_active = now;
        self.stream.get_mut().inbound = Some(datagram.to_vec());
        self.drive()
    }

    /// Let OpenSSL act on its retransmission timer (a handshaking session only).
    pub fn poll_timer(&mut self) -> Fed {
        if self.established {
            return Fed::default();
        }
        self.drive()
    }

    /// Encrypt one application datagram.
    pub fn send(&mut self, bytes: &[u8], now: Instant) -> Result<Vec<Vec<u8>>, String> {
        if !self.established {
            return Err("handshake not finished".into());
        }
        self.last_active = now;
        let r = self.stream.ssl_write(bytes);
        let out = std::mem::take(&mut self.stream.get_mut().outbound);
        match r {
            Ok(_) => Ok(out),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Say close_notify; the datagrams to send.
    pub fn close(&mut self) -> Vec<Vec<u8>> {
        let _ = self.stream.shutdown();
        std::mem::take(&mut self.stream.get_mut().outbound)
    }

    fn drive(&mut self) -> Fed {
        let mut fed = Fed::default();
        let was = self.established;
        // SSL_read drives the handshake too, then yields the records' plaintext.
        let mut buf = vec![0u8; MAX_PLAINTEXT];
        loop {
            match self.stream.ssl_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => fed.app.push(buf[..n].to_vec()),
                Err(e) => match e.code() {
                    ErrorCode::WANT_READ | ErrorCode::WANT_WRITE => break,
                    ErrorCode::ZERO_RETURN => {
                        fed.event = Some(Event::Closed);
                        break;
                    }
                    _ => {
                        fed.event = Some(Event::Failed(e.to_string()));
                        break;
                    }
                },
            }
        }
        if !was && fed.event.is_none() && self.stream.ssl().is_init_finished() {
            self.established = true;
            fed.event = Some(Event::Established);
        }
        fed.out = std::mem::take(&mut self.stream.get_mut().outbound);
        fed
    }
}
