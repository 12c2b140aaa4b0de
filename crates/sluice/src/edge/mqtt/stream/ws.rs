//! MQTT over WebSocket (ws, and wss over TLS): the HTTP/1.1 upgrade on the listener's thread
//! and the framing on the shard.
//!
//! Owns: the upgrade (RFC 6455 §4.2: `GET {path}` with `Upgrade: websocket`,
//! `Connection: Upgrade`, `Sec-WebSocket-Version: 13`, a `Sec-WebSocket-Key`, and
//! `Sec-WebSocket-Protocol` offering `mqtt` (or the older `mqttv3.1`), which is echoed), and
//! [`WsCore`]: a link (TCP or TLS) plus the frame decoder's state, the frame bytes not yet
//! unframed and control frames not yet written. Does not own: the frame format
//! (`sluice_proto::websocket`, sans-IO) or MQTT (binary frames carry a plain byte stream:
//! a packet may span frames, a frame may carry several packets).
//!
//! A refused upgrade gets a short HTTP answer (400, 404 for another path, 426 for another
//! version; no body) and is closed; the request head is bounded ([`MAX_HEAD`]) and must
//! arrive within `connect_timeout`. After the upgrade: a ping is answered with a pong, a
//! close with a close (and the connection ends as if the device closed it), a frame
//! breaking RFC 6455 (unmasked, text, fragmented control, ...) or larger than
//! `mqtt.max_packet_size` with a close carrying 1002/1003/1009 and the connection ends.
//! Each server write is one binary frame. Pongs waiting for a socket that does not take them
//! are bounded (256 B; later pings go unanswered until they are written).
//!
//! Memory: the state is a few integers and two byte buffers that are empty, and released,
//! while the connection is idle; see docs/memory.md for the measured figure.

use std::cell::RefCell;
use std::io;

use base64::Engine as _;
use bytes::{Buf, BytesMut};
use sluice_proto::websocket::{self, Control, FrameDecoder};

use super::{Link, StreamKind};

/// Largest HTTP request head accepted for the upgrade.
pub const MAX_HEAD: usize = 8 * 1024;
/// Most request headers parsed.
const MAX_HEADERS: usize = 32;
/// Control frames (pongs) waiting for the socket, at most; more pings go unanswered.
const MAX_PENDING_CONTROL: usize = 256;
/// The GUID of RFC 6455 §1.3.
const WS_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Why an upgrade was refused; each is a reason label of
/// `sluice_mqtt_ws_upgrade_failures_total`.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("no complete upgrade request within connect_timeout")]
    Timeout,
    #[error("peer closed before the upgrade")]
    Closed,
    #[error("request head larger than {MAX_HEAD} bytes")]
    TooLarge,
    #[error("not a WebSocket upgrade request: {0}")]
    BadRequest(&'static str),
    #[error("path is not the MQTT path")]
    NotFound,
    #[error("WebSocket version is not 13")]
    Version,
    #[error("client did not offer the mqtt subprotocol")]
    Subprotocol,
    #[error("socket: {0}")]
    Io(io::Error),
}

impl UpgradeError {
    /// The metric's reason label.
    pub fn reason(&self) -> &'static str {
        match self {
            UpgradeError::Timeout => "timeout",
            UpgradeError::Closed => "closed",
            UpgradeError::TooLarge => "too_large",
            UpgradeError::BadRequest(_) => "bad_request",
            UpgradeError::NotFound => "not_found",
            UpgradeError::Version => "version",
            UpgradeError::Subprotocol => "subprotocol",
            UpgradeError::Io(_) => "io",
        }
    }

    /// The HTTP answer to send, if any.
    fn response(&self) -> Option<&'static str> {
        match self {
            UpgradeError::TooLarge => Some("HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"),
            UpgradeError::BadRequest(_) | UpgradeError::Subprotocol => {
                Some("HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            }
            UpgradeError::NotFound => {
                Some("HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            }
            UpgradeError::Version => Some("HTTP/1.1 426 Upgrade Required\r\nSec-WebSocket-Version: 13\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"),
            UpgradeError::Timeout | UpgradeError::Closed | UpgradeError::Io(_) => None,
        }
    }
}

/// Read the upgrade request on `link`, answer it, and return the WebSocket connection.
/// Bytes the client sent after its request head are kept as the first frame bytes.
pub(crate) async fn upgrade(
    link: Link,
    path: &str,
    max_frame: u64,
    deadline: tokio::time::Instant,
) -> Result<WsCore, UpgradeError> {
    let mut head = BytesMut::new();
    let parsed = loop {
        if head.len() > MAX_HEAD {
            let error = UpgradeError::TooLarge;
            refuse(&link, &error).await;
            return Err(error);
        }
        match tokio::time::timeout_at(deadline, link.read(&mut head)).await {
            Err(_) => return Err(UpgradeError::Timeout),
            Ok(Ok(0)) => return Err(UpgradeError::Closed),
            Ok(Err(e)) => return Err(UpgradeError::Io(e)),
            Ok(Ok(_)) => {}
        }
        match parse_request(&head, path) {
            Ok(Some(parsed)) => break parsed,
            Ok(None) => continue,
            Err(error) => {
                refuse(&link, &error).await;
                return Err(error);
            }
        }
    };
    let (head_len, accept, protocol) = parsed;
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {protocol}\r\n\r\n"
    );
    match tokio::time::timeout_at(deadline, link.write_all(response.as_bytes())).await {
        Err(_) => return Err(UpgradeError::Timeout),
        Ok(Err(e)) => return Err(UpgradeError::Io(e)),
        Ok(Ok(())) => {}
    }
    head.advance(head_len);
    let raw = if head.is_empty() {
        BytesMut::new()
    } else {
        head
    };
    let kind = match link {
        Link::Tcp(_) => StreamKind::Ws,
        Link::Tls(_) => StreamKind::Wss,
    };
    Ok(WsCore {
        link,
        kind,
        st: RefCell::new(WsState {
            decoder: FrameDecoder::new(max_frame),
            raw,
            ctl_out: BytesMut::new(),
            close_received: false,
            close_sent: false,
        }),
    })
}

async fn refuse(link: &Link, error: &UpgradeError) {
    if let Some(answer) = error.response() {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            link.write_all(answer.as_bytes()),
        )
        .await;
    }
    let _ = link.shutdown().await;
}

/// `Ok(None)`: the head is not complete yet. `Ok(Some((head length, Sec-WebSocket-Accept,
/// subprotocol)))`.
fn parse_request(
    head: &[u8],
    path: &str,
) -> Result<Option<(usize, String, &'static str)>, UpgradeError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(head) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(UpgradeError::TooLarge),
        Err(_) => return Err(UpgradeError::BadRequest("malformed HTTP request")),
    };
    if req.method != Some("GET") {
        return Err(UpgradeError::BadRequest("method is not GET"));
    }
    let target = req.path.unwrap_or("");
    if target.split('?').next() != Some(path) {
        return Err(UpgradeError::NotFound);
    }
    let headers: &[httparse::Header<'_>] = req.headers;
    let header = |name: &'static str| {
        headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
            .filter_map(|h| std::str::from_utf8(h.value).ok())
    };
    let has_token = |name: &'static str, token: &str| {
        header(name).any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    };
    if !has_token("upgrade", "websocket") {
        return Err(UpgradeError::BadRequest("no Upgrade: websocket"));
    }
    if !has_token("connection", "upgrade") {
        return Err(UpgradeError::BadRequest("no Connection: Upgrade"));
    }
    if !header("sec-websocket-version").any(|v| v.trim() == "13") {
        return Err(UpgradeError::Version);
    }
    let key = header("sec-websocket-key")
        .next()
        .map(str::trim)
        .filter(|k| k.len() == 24)
        .ok_or(UpgradeError::BadRequest("no valid Sec-WebSocket-Key"))?;
    let protocol = if has_token("sec-websocket-protocol", "mqtt") {
        "mqtt"
    } else if has_token("sec-websocket-protocol", "mqttv3.1") {
        "mqttv3.1"
    } else {
        return Err(UpgradeError::Subprotocol);
    };
    Ok(Some((len, accept_key(key), protocol)))
}

/// `Sec-WebSocket-Accept` for a `Sec-WebSocket-Key` (RFC 6455 §4.2.2).
fn accept_key(key: &str) -> String {
    let mut input = String::with_capacity(key.len() + WS_GUID.len());
    input.push_str(key);
    input.push_str(WS_GUID);
    let digest = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, input.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
}

/// One WebSocket connection after its upgrade, shared by the connection's two halves.
pub struct WsCore {
    link: Link,
    kind: StreamKind,
    st: RefCell<WsState>,
}

struct WsState {
    decoder: FrameDecoder,
    /// Frame bytes read and not yet unframed (released when empty).
    raw: BytesMut,
    /// Control frames (pong, close) not yet written.
    ctl_out: BytesMut,
    close_received: bool,
    close_sent: bool,
}

/// A WebSocket connection between runtimes (see [`super::DetachedStream`]).
pub struct WsDetached {
    tls: Option<Box<rustls::ServerConnection>>,
    st: WsState,
}

impl WsDetached {
    pub(super) fn kind(&self) -> StreamKind {
        if self.tls.is_some() {
            StreamKind::Wss
        } else {
            StreamKind::Ws
        }
    }

    pub(super) fn attach(self, tcp: tokio::net::TcpStream) -> WsCore {
        let kind = self.kind();
        let link = match self.tls {
            Some(conn) => Link::Tls(super::tls::TlsCore::new(tcp, conn)),
            None => Link::Tcp(tcp),
        };
        WsCore {
            link,
            kind,
            st: RefCell::new(self.st),
        }
    }
}

impl WsCore {
    pub fn kind(&self) -> StreamKind {
        self.kind
    }

    pub(super) fn into_parts(self) -> io::Result<(std::net::TcpStream, WsDetached)> {
        let (tcp, tls) = self.link.into_std()?;
        Ok((
            tcp,
            WsDetached {
                tls,
                st: self.st.into_inner(),
            },
        ))
    }

    /// Wait for binary payload and append it to `buf`: `Ok(0)` once the client closed (a
    /// close frame, or the socket), `InvalidData` for a frame breaking the rules (after a
    /// close frame with its code is queued). Cancel-safe: all state is in `self`.
    pub(super) async fn read_payload(&self, buf: &mut BytesMut) -> io::Result<usize> {
        loop {
            {
                let mut guard = self.st.borrow_mut();
                let st = &mut *guard;
                if st.close_received {
                    return Ok(0);
                }
                let before = buf.len();
                let result = st.decoder.decode(&mut st.raw, buf);
                if st.raw.is_empty() {
                    st.raw = BytesMut::new();
                }
                let got = buf.len() - before;
                match result {
                    Ok(None) => {}
                    Ok(Some(Control::Ping(payload))) => {
                        // A client that pings and never reads must not grow the queue: with
                        // a pong still unsent, later pings go unanswered (RFC 6455 §5.5.3
                        // allows answering only the most recent one).
                        if st.ctl_out.len() < MAX_PENDING_CONTROL {
                            websocket::encode_pong(&payload, &mut st.ctl_out);
                        }
                        self.try_flush_ctl(st);
                        if got > 0 {
                            return Ok(got);
                        }
                        continue;
                    }
                    Ok(Some(Control::Close(_))) => {
                        st.close_received = true;
                        if !st.close_sent {
                            websocket::encode_close(websocket::CLOSE_NORMAL, &mut st.ctl_out);
                            st.close_sent = true;
                        }
                        self.try_flush_ctl(st);
                        return Ok(got);
                    }
                    Err(error) => {
                        if !st.close_sent {
                            websocket::encode_close(error.close_code(), &mut st.ctl_out);
                            st.close_sent = true;
                        }
                        self.try_flush_ctl(st);
                        return Err(io::Error::new(io::ErrorKind::InvalidData, error));
                    }
                }
                if got > 0 {
                    return Ok(got);
                }
                match self.link.try_read(&mut st.raw) {
                    Ok(0) => return Ok(0),
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if st.raw.is_empty() {
                            st.raw = BytesMut::new(); // idle: hold no buffer
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            self.link.tcp().readable().await?;
        }
    }

    /// Write queued control frames as far as the socket takes them now.
    fn try_flush_ctl(&self, st: &mut WsState) {
        while !st.ctl_out.is_empty() {
            match self.link.try_write(&st.ctl_out) {
                Ok(0) | Err(_) => break,
                Ok(n) => st.ctl_out.advance(n),
            }
        }
        if st.ctl_out.is_empty() {
            st.ctl_out = BytesMut::new();
        }
    }

    /// Write `data` as one binary frame (after any queued control frame).
    pub(super) async fn write_frame(&self, data: &[u8]) -> io::Result<()> {
        let frame = {
            let mut st = self.st.borrow_mut();
            if st.close_sent {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "WebSocket closed",
                ));
            }
            let mut frame = BytesMut::with_capacity(st.ctl_out.len() + 10 + data.len());
            frame.extend_from_slice(&st.ctl_out);
            st.ctl_out = BytesMut::new();
            if !data.is_empty() {
                websocket::encode_binary_header(data.len(), &mut frame);
                frame.extend_from_slice(data);
            }
            frame
        };
        self.link.write_all(&frame).await
    }

    /// Send a close frame (unless one went already) and half-close the link.
    pub(super) async fn shutdown(&self) -> io::Result<()> {
        let pending = {
            let mut st = self.st.borrow_mut();
            if !st.close_sent {
                websocket::encode_close(websocket::CLOSE_NORMAL, &mut st.ctl_out);
                st.close_sent = true;
            }
            std::mem::take(&mut st.ctl_out)
        };
        self.link.write_all(&pending).await?;
        self.link.shutdown().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_key_matches_rfc6455_example() {
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    fn request(path: &str, extra: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nHost: gw\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{extra}\r\n")
    }

    #[test]
    fn upgrade_requests_are_checked() {
        let ok = request(
            "/mqtt",
            "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n",
        );
        let (len, accept, protocol) = parse_request(ok.as_bytes(), "/mqtt")
            .expect("valid")
            .expect("complete");
        assert_eq!(len, ok.len());
        assert_eq!(accept, "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
        assert_eq!(protocol, "mqtt");
        assert!(parse_request(&ok.as_bytes()[..20], "/mqtt")
            .expect("partial")
            .is_none());
        assert!(matches!(
            parse_request(ok.as_bytes(), "/other"),
            Err(UpgradeError::NotFound)
        ));
        let v8 = request(
            "/mqtt",
            "Sec-WebSocket-Version: 8\r\nSec-WebSocket-Protocol: mqtt\r\n",
        );
        assert!(matches!(
            parse_request(v8.as_bytes(), "/mqtt"),
            Err(UpgradeError::Version)
        ));
        let no_proto = request("/mqtt", "Sec-WebSocket-Version: 13\r\n");
        assert!(matches!(
            parse_request(no_proto.as_bytes(), "/mqtt"),
            Err(UpgradeError::Subprotocol)
        ));
    }
}
