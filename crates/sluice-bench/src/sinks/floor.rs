//! The kernel floor: the least any MQTT gateway must do for QoS 1 devices, and nothing more.
//!
//! Owns: a single-threaded epoll loop (mio) that accepts plain-TCP MQTT connections, answers
//! CONNECT with CONNACK, each QoS 1 PUBLISH with a PUBACK (QoS 2 with PUBREC, PUBREL with
//! PUBCOMP) and PINGREQ with PINGRESP, and forwards nothing. `scenario core --sut floor` runs it
//! under the same device load as the gateways, so its CPU per message is what terminating the
//! device connections costs on this machine — the socket reads and writes, the loopback
//! delivery and the wake-ups — which no user-space gateway can go below. Also owns the pieces
//! the adaptor floor ([`super::adaptor_floor`]) and the relay floor ([`super::relay_floor`])
//! share: the framing with a PUBLISH handler ([`respond_with`]: the PUBLISH's topic, packet id
//! and payload, answered now or later) and the device connection ([`DeviceConn`]) and the
//! event loop ([`serve_devices`] with a [`FloorHandler`], whose turn-end hook lets a handler
//! write what a whole turn gathered at once), and with the io_uring floor
//! ([`super::floor_uring`]) a connection's framing state ([`Framer`]). Does not own: the MQTT codec (the
//! framing here is the minimum to find packet types, ids, topics and payloads; a malformed
//! stream only closes its connection) or any forwarding.
//!
//! Invariants: a ready connection is read until it would block, with one `write` per read that
//! produced answers; reads land in one shared scratch buffer and only an incomplete packet is
//! kept per connection (at most [`MAX_PACKET`] plus one read).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Registry, Token};

/// Larger packets close the connection (the devices of the bench send at most a few KiB).
pub const MAX_PACKET: usize = 1 << 20;
/// The listener's token (device connections count up from 0).
const LISTENER: Token = Token(usize::MAX);
/// A [`FloorHandler`]'s own sockets have tokens from here up (below [`LISTENER`]); devices'
/// are below.
pub const HANDLER_TOKENS: usize = usize::MAX / 2;
/// Bytes read at a time into the loop's scratch buffer.
const READ_CHUNK: usize = 16 * 1024;

/// Why a connection's byte stream cannot be answered.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FloorError {
    #[error("malformed remaining length")]
    BadLength,
    #[error("packet of {0} bytes exceeds the floor's limit")]
    TooLarge(usize),
    #[error("packet type {0} is not answered by the floor")]
    Unsupported(u8),
    #[error("truncated {0} packet")]
    Truncated(&'static str),
    /// The PUBLISH handler would not take it (see [`respond_with`]).
    #[error("PUBLISH refused: {0}")]
    Refused(&'static str),
}

/// What [`respond`] made of the bytes so far.
#[derive(Debug, PartialEq, Eq)]
pub struct Answered {
    /// Bytes of whole packets consumed from the front of the input.
    pub consumed: usize,
    /// The client sent DISCONNECT: close after writing the answers.
    pub disconnect: bool,
}

/// One PUBLISH as the floor's framing sees it (fields borrowed from the input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Publish<'a> {
    /// 0, 1 or 2 (3, malformed, is passed on as it came).
    pub qos: u8,
    /// The packet id's two bytes, big-endian; zero for QoS 0.
    pub packet_id: [u8; 2],
    pub topic: &'a [u8],
    /// After the packet id (and, for MQTT 5, the properties).
    pub payload: &'a [u8],
}

/// Answer every whole packet at the front of `input`, appending the answers to `out`: the
/// floor's own answers, a PUBACK (QoS 1) or PUBREC (QoS 2) for each PUBLISH at once.
/// `v5` is set once the connection's CONNECT said protocol level 5 (CONNACK then carries an
/// empty property length).
pub fn respond(input: &[u8], v5: &mut bool, out: &mut Vec<u8>) -> Result<Answered, FloorError> {
    respond_with(input, v5, out, &mut answer_at_once)
}

/// The kernel floor's answer to a PUBLISH: PUBACK or PUBREC with its id, nothing for QoS 0.
pub fn answer_at_once(p: Publish<'_>, out: &mut Vec<u8>) -> Result<(), FloorError> {
    if p.qos > 0 {
        let answer = if p.qos == 1 { 0x40 } else { 0x50 };
        out.extend_from_slice(&[answer, 2, p.packet_id[0], p.packet_id[1]]);
    }
    Ok(())
}

/// [`respond`] with the PUBLISHes handed to `on_publish` (which may append an answer to `out`
/// or keep the packet id to answer later, and refuse with an error that closes the
/// connection); CONNECT, PUBREL, PINGREQ and DISCONNECT are answered as by [`respond`].
pub fn respond_with(
    input: &[u8],
    v5: &mut bool,
    out: &mut Vec<u8>,
    on_publish: &mut impl FnMut(Publish<'_>, &mut Vec<u8>) -> Result<(), FloorError>,
) -> Result<Answered, FloorError> {
    let mut at = 0;
    loop {
        let rest = &input[at..];
        let Some((header_len, body_len)) = frame(rest)? else {
            return Ok(Answered {
                consumed: at,
                disconnect: false,
            });
        };
        if rest.len() < header_len + body_len {
            return Ok(Answered {
                consumed: at,
                disconnect: false,
            });
        }
        let body = &rest[header_len..header_len + body_len];
        let kind = rest[0] >> 4;
        match kind {
            1 => {
                // CONNECT: protocol name (2-byte length + bytes), then the level.
                let name_len = usize::from(u16::from_be_bytes(
                    body.get(..2)
                        .ok_or(FloorError::Truncated("CONNECT"))?
                        .try_into()
                        .map_err(|_| FloorError::Truncated("CONNECT"))?,
                ));
                let level = *body
                    .get(2 + name_len)
                    .ok_or(FloorError::Truncated("CONNECT"))?;
                *v5 = level == 5;
                if *v5 {
                    out.extend_from_slice(&[0x20, 3, 0, 0, 0]);
                } else {
                    out.extend_from_slice(&[0x20, 2, 0, 0]);
                }
            }
            3 => on_publish(publish(rest[0], body, *v5)?, out)?,
            6 => {
                // PUBREL → PUBCOMP with the same packet id.
                let id = body.get(..2).ok_or(FloorError::Truncated("PUBREL"))?;
                out.extend_from_slice(&[0x70, 2, id[0], id[1]]);
            }
            12 => out.extend_from_slice(&[0xd0, 0]),
            14 => {
                return Ok(Answered {
                    consumed: at + header_len + body_len,
                    disconnect: true,
                })
            }
            other => return Err(FloorError::Unsupported(other)),
        }
        at += header_len + body_len;
    }
}

/// The fields of a PUBLISH with first byte `first` and variable header + payload `body`:
/// topic (2-byte length + bytes), packet id when QoS > 0, MQTT 5 properties (skipped).
fn publish(first: u8, body: &[u8], v5: bool) -> Result<Publish<'_>, FloorError> {
    const TRUNCATED: FloorError = FloorError::Truncated("PUBLISH");
    let qos = (first >> 1) & 3;
    let topic_len = usize::from(u16::from_be_bytes([
        *body.first().ok_or(TRUNCATED)?,
        *body.get(1).ok_or(TRUNCATED)?,
    ]));
    let topic = body.get(2..2 + topic_len).ok_or(TRUNCATED)?;
    let mut at = 2 + topic_len;
    let mut packet_id = [0; 2];
    if qos > 0 {
        let id = body.get(at..at + 2).ok_or(TRUNCATED)?;
        packet_id = [id[0], id[1]];
        at += 2;
    }
    if v5 {
        let (len_bytes, props_len) = varint(&body[at..])?.ok_or(TRUNCATED)?;
        at = at
            .checked_add(len_bytes + props_len)
            .filter(|&end| end <= body.len())
            .ok_or(TRUNCATED)?;
    }
    Ok(Publish {
        qos,
        packet_id,
        topic,
        payload: &body[at..],
    })
}

/// A variable byte integer at the front of `buf`: (its length in bytes, its value); `None`
/// while incomplete.
fn varint(buf: &[u8]) -> Result<Option<(usize, usize)>, FloorError> {
    let mut value = 0usize;
    for i in 0..4 {
        let Some(&byte) = buf.get(i) else {
            return Ok(None);
        };
        value |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(Some((i + 1, value)));
        }
    }
    Err(FloorError::BadLength)
}

/// (fixed header length, remaining length) of the packet at the front, `None` while the
/// fixed header is incomplete.
fn frame(buf: &[u8]) -> Result<Option<(usize, usize)>, FloorError> {
    match varint(buf.get(1..).unwrap_or_default())? {
        None => Ok(None),
        Some((_, len)) if len > MAX_PACKET => Err(FloorError::TooLarge(len)),
        Some((len_bytes, len)) => Ok(Some((1 + len_bytes, len))),
    }
}

/// A connection's inbound framing state: the start of a packet whose rest has not arrived, and
/// whether its CONNECT said MQTT 5. Shared by the epoll floor ([`DeviceConn`]) and the
/// io_uring floor ([`super::floor_uring`]), which differ only in how bytes come and go.
#[derive(Debug, Default)]
pub struct Framer {
    rbuf: Vec<u8>,
    v5: bool,
}

impl Framer {
    /// Answer the whole packets of what was kept plus `chunk` through [`respond_with`],
    /// appending the answers to `out`, and keep only an incomplete packet's start (the buffer
    /// is freed once empty). `Ok(true)`: the client sent DISCONNECT (close after writing).
    pub fn feed(
        &mut self,
        chunk: &[u8],
        out: &mut Vec<u8>,
        on_publish: &mut impl FnMut(Publish<'_>, &mut Vec<u8>) -> Result<(), FloorError>,
    ) -> Result<bool, FloorError> {
        let answered = if self.rbuf.is_empty() {
            let answered = respond_with(chunk, &mut self.v5, out, on_publish)?;
            self.rbuf.extend_from_slice(&chunk[answered.consumed..]);
            answered
        } else {
            self.rbuf.extend_from_slice(chunk);
            let answered = respond_with(&self.rbuf, &mut self.v5, out, on_publish)?;
            self.rbuf.drain(..answered.consumed);
            answered
        };
        if self.rbuf.is_empty() {
            self.rbuf = Vec::new();
        }
        Ok(answered.disconnect)
    }
}

/// One device connection: its stream, its framing state, and the answers the socket did not
/// take yet.
pub struct DeviceConn {
    stream: TcpStream,
    framer: Framer,
    pending: Vec<u8>,
}

impl DeviceConn {
    pub fn new(stream: TcpStream) -> DeviceConn {
        DeviceConn {
            stream,
            framer: Framer::default(),
            pending: Vec::new(),
        }
    }

    pub fn stream_mut(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Write what is pending, then read until the socket would block, answer through
    /// [`respond_with`] and write the answers. `Err` closes the connection. Reads go into the
    /// loop's one scratch buffer; only a partial packet is kept per connection.
    pub fn serve(
        &mut self,
        scratch: &mut [u8],
        out: &mut Vec<u8>,
        on_publish: &mut impl FnMut(Publish<'_>, &mut Vec<u8>) -> Result<(), FloorError>,
    ) -> io::Result<()> {
        if !self.pending.is_empty() {
            let n = write_some(&mut self.stream, &self.pending)?;
            self.pending.drain(..n);
        }
        let invalid = |e| io::Error::new(io::ErrorKind::InvalidData, e);
        while let Some(n) = read_some(&mut self.stream, scratch)? {
            out.clear();
            let disconnect = self
                .framer
                .feed(&scratch[..n], out, on_publish)
                .map_err(invalid)?;
            self.send(out)?;
            if disconnect {
                return Err(io::ErrorKind::ConnectionAborted.into());
            }
        }
        Ok(())
    }

    /// Write `bytes` now, or keep them behind what is pending until the socket is writable.
    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        if self.pending.is_empty() {
            let written = write_some(&mut self.stream, bytes)?;
            self.pending.extend_from_slice(&bytes[written..]);
        } else {
            self.pending.extend_from_slice(bytes);
        }
        Ok(())
    }
}

/// Accept every connection waiting on `listener`, with TCP_NODELAY, registered readable and
/// writable under the next token. An accept error other than "would block" (out of files or
/// the like) drops that attempt and keeps serving the others.
fn accept_all(
    listener: &mut TcpListener,
    registry: &Registry,
    next_token: &mut usize,
    conns: &mut HashMap<usize, DeviceConn>,
) -> io::Result<()> {
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nodelay(true)?;
                let token = Token(*next_token);
                *next_token += 1;
                registry.register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)?;
                conns.insert(token.0, DeviceConn::new(stream));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => {
                eprintln!("sluice-bench: accept: {e}");
                return Ok(());
            }
        }
    }
}

/// What a floor does with its devices' PUBLISHes, and with the events of sockets of its own.
pub trait FloorHandler {
    /// A PUBLISH of device `device` (its token): append an answer to `out`, keep what is
    /// needed to answer later ([`DeviceConn::send`]), or refuse (the device is closed).
    fn publish(
        &mut self,
        device: usize,
        p: Publish<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), FloorError>;

    /// An event of a socket the handler registered itself, under a token from
    /// [`HANDLER_TOKENS`] up; `scratch` is the loop's read buffer.
    fn ready(
        &mut self,
        _token: Token,
        _devices: &mut HashMap<usize, DeviceConn>,
        _scratch: &mut [u8],
    ) {
    }

    /// The end of one loop turn, after every ready socket was served: write what the turn
    /// gathered (the relay floor's one TLS write per turn). `Err` ends the loop (and the floor).
    fn turn_end(&mut self, _devices: &mut HashMap<usize, DeviceConn>) -> io::Result<()> {
        Ok(())
    }

    /// The longest the loop sleeps in `epoll_wait` before a turn without events (`None`: until
    /// an event), for a handler with timers of its own (the relay floor's keep-alive).
    fn poll_timeout(&self) -> Option<std::time::Duration> {
        None
    }
}

/// The kernel floor's handler: [`answer_at_once`].
struct AnswerAtOnce;

impl FloorHandler for AnswerAtOnce {
    fn publish(&mut self, _: usize, p: Publish<'_>, out: &mut Vec<u8>) -> Result<(), FloorError> {
        answer_at_once(p, out)
    }
}

/// Serve on `listen` until the process is killed. `ready` gets the bound address (port 0 picks
/// a free port) once the listener accepts connections.
pub fn run_floor(listen: SocketAddr, ready: impl FnOnce(SocketAddr)) -> io::Result<()> {
    serve_devices(listen, ready, |_| Ok(AnswerAtOnce))
}

/// The floors' event loop, until the process is killed: accept devices on `listen` (`ready`
/// gets the bound address), serve each ready device with the handler `make` builds (given the
/// loop's registry, for sockets of its own), pass it the events of its own sockets and end
/// each turn with [`FloorHandler::turn_end`] (whose error ends the loop).
pub fn serve_devices<H: FloorHandler>(
    listen: SocketAddr,
    ready: impl FnOnce(SocketAddr),
    make: impl FnOnce(&Registry) -> io::Result<H>,
) -> io::Result<()> {
    let mut poll = Poll::new()?;
    let mut listener = TcpListener::bind(listen)?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut handler = make(poll.registry())?;
    ready(listener.local_addr()?);
    let mut events = Events::with_capacity(1024);
    let mut devices: HashMap<usize, DeviceConn> = HashMap::new();
    let mut next_token = 0usize;
    let mut out = Vec::with_capacity(READ_CHUNK);
    let mut scratch = vec![0u8; READ_CHUNK];
    loop {
        if let Err(e) = poll.poll(&mut events, handler.poll_timeout()) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        for event in &events {
            let token = event.token();
            if token == LISTENER {
                accept_all(
                    &mut listener,
                    poll.registry(),
                    &mut next_token,
                    &mut devices,
                )?;
            } else if token.0 >= HANDLER_TOKENS {
                handler.ready(token, &mut devices, &mut scratch);
            } else if let Some(device) = devices.get_mut(&token.0) {
                let mut on_publish =
                    |p: Publish<'_>, out: &mut Vec<u8>| handler.publish(token.0, p, out);
                if device
                    .serve(&mut scratch, &mut out, &mut on_publish)
                    .is_err()
                {
                    close(&mut devices, token.0, poll.registry());
                }
            }
        }
        handler.turn_end(&mut devices)?;
    }
}

/// Drop the connection of `token` (if still open) and deregister it.
pub fn close(conns: &mut HashMap<usize, DeviceConn>, token: usize, registry: &Registry) {
    if let Some(mut conn) = conns.remove(&token) {
        let _ = registry.deregister(&mut conn.stream);
    }
}

/// Read what the socket has into `scratch`: `None` when it would block; the peer's close is
/// an error.
pub fn read_some(stream: &mut TcpStream, scratch: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        return match stream.read(scratch) {
            Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

/// Write what the socket takes now; 0 when it would block.
pub fn write_some(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < bytes.len() {
        match stream.write(&bytes[done..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// MQTT packets for the floors' tests, encoded by `sluice_proto`.
#[cfg(test)]
pub(crate) mod test_packets {
    use bytes::{Bytes, BytesMut};
    use sluice_proto::mqtt::{encode, Connect, Packet, Properties, ProtocolVersion, Publish, QoS};

    pub fn connect(version: ProtocolVersion) -> Vec<u8> {
        let mut buf = BytesMut::new();
        let packet = Packet::Connect(Connect {
            protocol: version,
            clean_start: true,
            keep_alive: 30,
            client_id: "dev-1".into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        });
        encode(&packet, version, &mut buf).unwrap();
        buf.to_vec()
    }

    pub fn publish(version: ProtocolVersion, qos: QoS, id: u16) -> Vec<u8> {
        publish_with(version, qos, id, None)
    }

    pub fn publish_with(
        version: ProtocolVersion,
        qos: QoS,
        id: u16,
        properties: Option<Properties>,
    ) -> Vec<u8> {
        let mut buf = BytesMut::new();
        let packet = Packet::Publish(Publish {
            dup: false,
            qos,
            retain: false,
            topic: "bench/1".into(),
            packet_id: (qos != QoS::AtMostOnce).then_some(id),
            properties: properties.map(Box::new),
            payload: Bytes::from_static(&[7; 300]),
        });
        encode(&packet, version, &mut buf).unwrap();
        buf.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::test_packets::{connect, publish, publish_with};
    use super::*;
    use sluice_proto::mqtt::{Properties, ProtocolVersion, QoS};

    #[test]
    fn a_v311_session_gets_connack_and_one_puback_per_qos1_publish() {
        let v = ProtocolVersion::V311;
        let mut input = connect(v);
        input.extend(publish(v, QoS::AtLeastOnce, 0x0102));
        input.extend(publish(v, QoS::AtMostOnce, 0));
        input.extend(publish(v, QoS::AtLeastOnce, 0x0a0b));
        let (mut v5, mut out) = (false, Vec::new());
        let answered = respond(&input, &mut v5, &mut out).unwrap();
        assert_eq!(answered.consumed, input.len());
        assert!(!v5 && !answered.disconnect);
        assert_eq!(
            out,
            [0x20, 2, 0, 0, 0x40, 2, 1, 2, 0x40, 2, 0x0a, 0x0b],
            "CONNACK, then a PUBACK per QoS 1 PUBLISH with its id, none for QoS 0"
        );
    }

    #[test]
    fn a_v5_connack_carries_an_empty_property_length() {
        let v = ProtocolVersion::V5;
        let mut input = connect(v);
        input.extend(publish(v, QoS::AtLeastOnce, 9));
        let (mut v5, mut out) = (false, Vec::new());
        respond(&input, &mut v5, &mut out).unwrap();
        assert!(v5);
        assert_eq!(out, [0x20, 3, 0, 0, 0, 0x40, 2, 0, 9]);
    }

    #[test]
    fn split_input_is_answered_only_once_whole_at_every_offset() {
        let v = ProtocolVersion::V311;
        let mut input = connect(v);
        input.extend(publish(v, QoS::AtLeastOnce, 5));
        input.extend([0xc0, 0]); // PINGREQ
        input.extend([0xe0, 0]); // DISCONNECT
        for cut in 0..input.len() {
            let (mut v5, mut out) = (false, Vec::new());
            let first = respond(&input[..cut], &mut v5, &mut out).unwrap();
            assert!(!first.disconnect);
            let second = respond(&input[first.consumed..], &mut v5, &mut out).unwrap();
            assert_eq!(first.consumed + second.consumed, input.len(), "cut {cut}");
            assert!(second.disconnect);
            assert_eq!(out, [0x20, 2, 0, 0, 0x40, 2, 0, 5, 0xd0, 0], "cut {cut}");
        }
    }

    #[test]
    fn a_publish_handler_gets_topic_id_and_payload_and_answers_when_it_likes() {
        for v in [ProtocolVersion::V311, ProtocolVersion::V5] {
            let mut input = connect(v);
            let properties = (v == ProtocolVersion::V5).then(|| Properties {
                content_type: Some("application/octet-stream".into()),
                message_expiry_interval: Some(60),
                ..Properties::default()
            });
            input.extend(publish_with(v, QoS::AtLeastOnce, 0x0304, properties));
            input.extend(publish(v, QoS::AtMostOnce, 0));
            let (mut v5, mut out, mut seen) = (false, Vec::new(), Vec::new());
            let answered = respond_with(&input, &mut v5, &mut out, &mut |p, _| {
                seen.push((p.qos, p.packet_id, p.topic.to_vec(), p.payload.to_vec()));
                Ok(())
            })
            .unwrap();
            assert_eq!(answered.consumed, input.len(), "{v:?}");
            assert_eq!(
                seen,
                [
                    (1, [3, 4], b"bench/1".to_vec(), vec![7; 300]),
                    (0, [0, 0], b"bench/1".to_vec(), vec![7; 300])
                ],
                "{v:?}: the MQTT 5 properties are not part of the payload"
            );
            assert_eq!(out.len(), if v5 { 5 } else { 4 }, "only the CONNACK: {v:?}");
            let refused = respond_with(&input, &mut v5, &mut out, &mut |_, _| {
                Err(FloorError::Refused("full"))
            });
            assert_eq!(refused, Err(FloorError::Refused("full")));
        }
    }

    #[test]
    fn bad_streams_are_errors_not_panics() {
        let (mut v5, mut out) = (false, Vec::new());
        assert_eq!(
            respond(&[0x30, 0xff, 0xff, 0xff, 0xff], &mut v5, &mut out),
            Err(FloorError::BadLength)
        );
        assert_eq!(
            respond(&[0x82, 1, 0], &mut v5, &mut out),
            Err(FloorError::Unsupported(8))
        );
        assert_eq!(
            respond(&[0x32, 2, 0, 5], &mut v5, &mut out),
            Err(FloorError::Truncated("PUBLISH"))
        );
        assert!(matches!(
            respond(&[0x30, 0xff, 0xff, 0x7f], &mut v5, &mut out),
            Err(FloorError::TooLarge(_))
        ));
        // Arbitrary bytes never panic.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 24) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (seed >> (i % 8 * 8)) as u8).collect();
            let _ = respond(&bytes, &mut v5, &mut out);
        }
    }
}
