//! The byte streams an MQTT device connection runs over: plain TCP, TLS over TCP, WebSocket
//! over TCP (ws) and WebSocket over TLS (wss).
//!
//! Owns: the read and write halves the connection code uses ([`DeviceReader`],
//! [`DeviceWriter`]), the hand-over form that moves a connection from the listener's thread
//! to its shard ([`DetachedStream`]), the TLS record layer after the handshake (`tls.rs`) and
//! the WebSocket upgrade and framing glue (`ws.rs`). Does not own: MQTT (the bytes are opaque
//! here), the listener's accept loop or admission (`listener.rs`), the TLS configuration's
//! policy (`config/mqtt_tls.rs`).
//!
//! Shape: an enum, not a generic, so the connection task is compiled once and the plain
//! variant is exactly the code that ran before TLS existed (`OwnedReadHalf` /
//! `OwnedWriteHalf`, the same readiness-first read). TLS and WebSocket state is shared by the
//! two halves of one connection through an `Rc` (a shard is single-threaded and both halves
//! live in the same task): rustls' `ServerConnection` reads and writes one state machine, and
//! a WebSocket ping read must be answered on the write side.
//!
//! Invariants:
//! - Idle, no half holds a read buffer of its own beyond what rustls keeps (its record
//!   buffer, see `tls.rs`); the WebSocket layer's frame buffer is released when empty.
//! - Every read is cancel-safe (the connection selects on it): state lives in the halves,
//!   and a read only awaits socket readiness.
//! - Reads and writes of one connection never overlap in time (one task does both in turn);
//!   control frames a read must answer are queued and written at once if the socket takes
//!   them, else before the next write.

pub mod tls;
pub mod ws;

use std::io;
use std::rc::Rc;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use tls::TlsCore;
use ws::WsCore;

/// Read buffer growth step.
pub const READ_CHUNK: usize = 2 * 1024;

/// What a connection runs over; for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Tcp,
    Tls,
    Ws,
    Wss,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Tcp => "tcp",
            StreamKind::Tls => "tls",
            StreamKind::Ws => "ws",
            StreamKind::Wss => "wss",
        }
    }
}

/// A connection between two runtimes: the listener's thread has done the TLS handshake and
/// the WebSocket upgrade and read the CONNECT; the shard registers the socket with its own
/// runtime ([`DetachedStream::attach`]). `Send`: rustls' `ServerConnection` is.
pub struct DetachedStream {
    tcp: std::net::TcpStream,
    layer: DetachedLayer,
}

enum DetachedLayer {
    Plain,
    Tls(Box<rustls::ServerConnection>),
    Ws(Box<ws::WsDetached>),
}

impl std::fmt::Debug for DetachedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DetachedStream")
            .field("tcp", &self.tcp)
            .field("kind", &self.kind())
            .finish()
    }
}

impl DetachedStream {
    /// A plain TCP connection (tests and the plain listener).
    pub fn plain(tcp: std::net::TcpStream) -> DetachedStream {
        DetachedStream {
            tcp,
            layer: DetachedLayer::Plain,
        }
    }

    pub fn kind(&self) -> StreamKind {
        match &self.layer {
            DetachedLayer::Plain => StreamKind::Tcp,
            DetachedLayer::Tls(_) => StreamKind::Tls,
            DetachedLayer::Ws(w) => w.kind(),
        }
    }

    /// Set the socket's kernel send buffer (SO_SNDBUF; `mqtt.send_buffer`). 0: leave it.
    pub fn set_send_buffer(&self, bytes: u64) -> io::Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        socket2::SockRef::from(&self.tcp).set_send_buffer_size(bytes as usize)
    }

    /// Register the socket with the calling runtime and split it into its halves.
    pub fn attach(self) -> io::Result<(DeviceReader, DeviceWriter)> {
        let tcp = TcpStream::from_std(self.tcp)?;
        let _ = tcp.set_nodelay(true);
        Ok(match self.layer {
            DetachedLayer::Plain => {
                let (rd, wr) = tcp.into_split();
                (DeviceReader::Tcp(rd), DeviceWriter::Tcp(wr))
            }
            DetachedLayer::Tls(conn) => {
                let core = Rc::new(TlsCore::new(tcp, conn));
                (DeviceReader::Tls(core.clone()), DeviceWriter::Tls(core))
            }
            DetachedLayer::Ws(detached) => {
                let core = Rc::new(detached.attach(tcp));
                (DeviceReader::Ws(core.clone()), DeviceWriter::Ws(core))
            }
        })
    }
}

/// The read half of a device connection.
pub enum DeviceReader {
    Tcp(OwnedReadHalf),
    Tls(Rc<TlsCore>),
    Ws(Rc<WsCore>),
}

/// The write half of a device connection.
pub enum DeviceWriter {
    Tcp(OwnedWriteHalf),
    Tls(Rc<TlsCore>),
    Ws(Rc<WsCore>),
}

impl DeviceReader {
    /// Wait until there is something to read, then read it into `buf`. The buffer is only
    /// grown once there is something to read, so an idle connection holds no read buffer.
    /// `Ok(0)`: the device closed. Cancel-safe.
    pub async fn read_more(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            DeviceReader::Tcp(rd) => {
                rd.readable().await?;
                if buf.capacity() - buf.len() < READ_CHUNK {
                    buf.reserve(READ_CHUNK);
                }
                // `read_buf` (unlike `try_read_buf`) clears the readiness after a short read,
                // saving an EAGAIN read per message.
                rd.read_buf(buf).await
            }
            // Boxed (here and in the writer): the plain arm's future is what an idle plain
            // connection's task holds; inline, the larger TLS and WebSocket futures would
            // make every plain connection pay their size.
            DeviceReader::Tls(core) => Box::pin(core.read_plain(buf)).await,
            DeviceReader::Ws(core) => Box::pin(core.read_payload(buf)).await,
        }
    }

    /// Read whatever comes next into `buf` (the listener's CONNECT read: plain TCP reads
    /// into the buffer it is given, as it always did). `Ok(0)`: the device closed.
    pub async fn read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            DeviceReader::Tcp(rd) => rd.read_buf(buf).await,
            other => other.read_more(buf).await,
        }
    }

    /// Read and discard (after the gateway closed): returns how many bytes went.
    pub async fn discard(&mut self, scratch: &mut [u8]) -> io::Result<usize> {
        match self {
            DeviceReader::Tcp(rd) => rd.read(scratch).await,
            other => {
                let mut buf = BytesMut::new();
                other.read_more(&mut buf).await
            }
        }
    }

    /// Put the halves back together as a [`DetachedStream`] for another runtime. Fails if
    /// the halves are not of one connection.
    pub fn detach(self, writer: DeviceWriter) -> io::Result<DetachedStream> {
        let mismatch = || io::Error::other("read and write halves of different connections");
        match (self, writer) {
            (DeviceReader::Tcp(rd), DeviceWriter::Tcp(wr)) => {
                let tcp = rd.reunite(wr).map_err(|_| mismatch())?.into_std()?;
                Ok(DetachedStream::plain(tcp))
            }
            (DeviceReader::Tls(rd), DeviceWriter::Tls(wr)) => {
                drop(wr);
                let core = Rc::try_unwrap(rd).map_err(|_| mismatch())?;
                let (tcp, conn) = core.into_parts()?;
                Ok(DetachedStream {
                    tcp,
                    layer: DetachedLayer::Tls(conn),
                })
            }
            (DeviceReader::Ws(rd), DeviceWriter::Ws(wr)) => {
                drop(wr);
                let core = Rc::try_unwrap(rd).map_err(|_| mismatch())?;
                let (tcp, detached) = core.into_parts()?;
                Ok(DetachedStream {
                    tcp,
                    layer: DetachedLayer::Ws(Box::new(detached)),
                })
            }
            _ => Err(mismatch()),
        }
    }
}

/// A TLS or WebSocket write, boxed so the plain arm stays the size it always was.
type BoxedIo<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<()>> + 'a>>;

impl DeviceWriter {
    /// Write all of `data` (one WebSocket binary frame on ws/wss). Not an `async fn`: the
    /// plain arm returns tokio's own future, so a plain connection's task (which holds this
    /// future while a write waits) is no larger than before TLS existed; the other arms are
    /// boxed.
    pub fn write_all<'a>(
        &'a mut self,
        data: &'a [u8],
    ) -> impl std::future::Future<Output = io::Result<()>> + 'a {
        use futures_util::future::Either;
        match self {
            DeviceWriter::Tcp(wr) => Either::Left(wr.write_all(data)),
            DeviceWriter::Tls(core) => Either::Right(Box::pin(core.write_all(data)) as BoxedIo<'a>),
            DeviceWriter::Ws(core) => {
                Either::Right(Box::pin(core.write_frame(data)) as BoxedIo<'a>)
            }
        }
    }

    /// Close the sending direction (TLS: close_notify first; WebSocket: a close frame).
    pub fn shutdown(&mut self) -> impl std::future::Future<Output = io::Result<()>> + '_ {
        use futures_util::future::Either;
        match self {
            DeviceWriter::Tcp(wr) => Either::Left(wr.shutdown()),
            DeviceWriter::Tls(core) => Either::Right(Box::pin(core.shutdown()) as BoxedIo<'_>),
            DeviceWriter::Ws(core) => Either::Right(Box::pin(core.shutdown()) as BoxedIo<'_>),
        }
    }
}

/// The byte carrier under a WebSocket: TCP or TLS. Plaintext in and out.
pub(crate) enum Link {
    Tcp(TcpStream),
    Tls(TlsCore),
}

impl Link {
    fn tcp(&self) -> &TcpStream {
        match self {
            Link::Tcp(t) => t,
            Link::Tls(core) => core.tcp(),
        }
    }

    /// Read what is there without waiting; `WouldBlock` when nothing is.
    fn try_read(&self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            Link::Tcp(t) => {
                if buf.capacity() - buf.len() < READ_CHUNK {
                    buf.reserve(READ_CHUNK);
                }
                t.try_read_buf(buf)
            }
            Link::Tls(core) => core.try_read_plain(buf),
        }
    }

    /// Read, waiting for the socket as needed. Cancel-safe.
    async fn read(&self, buf: &mut BytesMut) -> io::Result<usize> {
        loop {
            match self.try_read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.tcp().readable().await?,
                other => return other,
            }
        }
    }

    /// Write as much of `data` as the socket takes now.
    fn try_write(&self, data: &[u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(t) => t.try_write(data),
            Link::Tls(core) => core.try_write(data),
        }
    }

    async fn write_all(&self, data: &[u8]) -> io::Result<()> {
        match self {
            Link::Tcp(t) => {
                let mut data = data;
                while !data.is_empty() {
                    match t.try_write(data) {
                        Ok(n) => data = &data[n..],
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => t.writable().await?,
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
            Link::Tls(core) => core.write_all(data).await,
        }
    }

    async fn shutdown(&self) -> io::Result<()> {
        match self {
            Link::Tcp(t) => shutdown_write(t),
            Link::Tls(core) => core.shutdown().await,
        }
    }

    fn into_std(self) -> io::Result<(std::net::TcpStream, Option<Box<rustls::ServerConnection>>)> {
        match self {
            Link::Tcp(t) => Ok((t.into_std()?, None)),
            Link::Tls(core) => {
                let (tcp, conn) = core.into_parts()?;
                Ok((tcp, Some(conn)))
            }
        }
    }
}

/// Half-close a socket shared by reference (tokio's `shutdown` wants it owned).
fn shutdown_write(tcp: &TcpStream) -> io::Result<()> {
    socket2::SockRef::from(tcp).shutdown(std::net::Shutdown::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// What plain TCP pays for the other stream kinds: the enum's tag next to the half it
    /// always had (the halves sit in every connection's task, idle or not).
    #[test]
    fn the_plain_halves_grow_by_at_most_a_word() {
        let (rd, wr) = (size_of::<DeviceReader>(), size_of::<DeviceWriter>());
        let (plain_rd, plain_wr) = (size_of::<OwnedReadHalf>(), size_of::<OwnedWriteHalf>());
        println!("DeviceReader {rd} B (OwnedReadHalf {plain_rd} B), DeviceWriter {wr} B (OwnedWriteHalf {plain_wr} B)");
        assert!(rd <= plain_rd + 8, "{rd} vs {plain_rd}");
        assert!(wr <= plain_wr + 8, "{wr} vs {plain_wr}");
    }
}

/// The futures an idle plain connection's task holds (the read it waits on, a write that
/// waits for the socket) must stay the size they were before the other stream kinds: a
/// larger future is paid by every plain device. (Measured: inline TLS/WebSocket arms made
/// the write future 336 B instead of 24 B, +365 B of RSS per idle plain connection.)
#[cfg(test)]
mod plain_future_sizes {
    use super::*;

    /// The read as it was written before `DeviceReader` existed.
    async fn read_before(rd: &mut OwnedReadHalf, buf: &mut BytesMut) -> io::Result<usize> {
        rd.readable().await?;
        if buf.capacity() - buf.len() < READ_CHUNK {
            buf.reserve(READ_CHUNK);
        }
        rd.read_buf(buf).await
    }

    #[tokio::test]
    async fn plain_reads_and_writes_hold_futures_no_larger_than_before() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let (mut rd, mut wr) = TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect")
            .into_split();
        let mut buf = BytesMut::new();
        let read_old = std::mem::size_of_val(&read_before(&mut rd, &mut buf));
        let write_old = std::mem::size_of_val(&wr.write_all(b"x"));
        let shutdown_old = std::mem::size_of_val(&wr.shutdown());
        let mut reader = DeviceReader::Tcp(rd);
        let mut writer = DeviceWriter::Tcp(wr);
        let read_new = std::mem::size_of_val(&reader.read_more(&mut buf));
        let write_new = std::mem::size_of_val(&writer.write_all(b"x"));
        let shutdown_new = std::mem::size_of_val(&writer.shutdown());
        println!("read {read_old} -> {read_new} B, write {write_old} -> {write_new} B, shutdown {shutdown_old} -> {shutdown_new} B");
        assert!(read_new <= read_old);
        assert!(write_new <= write_old);
        assert!(shutdown_new <= shutdown_old + 8);
    }
}
