//! The kernel floor: the least any MQTT gateway must do for QoS 1 devices, and nothing more.
//!
//! Owns: a single-threaded epoll loop (mio) that accepts plain-TCP MQTT connections, answers
//! CONNECT with CONNACK, each QoS 1 PUBLISH with a PUBACK (QoS 2 with PUBREC, PUBREL with
//! PUBCOMP) and PINGREQ with PINGRESP, and forwards nothing. `scenario core --sut floor` runs it
//! under the same device load as the gateways, so its CPU per message is what terminating the
//! device connections costs on this machine — the socket reads and writes, the loopback
//! delivery and the wake-ups — which no user-space gateway can go below. Does not own: the
//! MQTT codec (the framing here is the minimum to find packet types and ids; a malformed
//! stream only closes its connection) or any forwarding.
//!
//! Invariants: a ready connection is read until it would block, with one `write` per read that
//! produced answers; reads land in one shared scratch buffer and only an incomplete packet is
//! kept per connection (at most [`MAX_PACKET`] plus one read).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

/// Larger packets close the connection (the devices of the bench send at most a few KiB).
pub const MAX_PACKET: usize = 1 << 20;
const LISTENER: Token = Token(usize::MAX);
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
}

/// What [`respond`] made of the bytes so far.
#[derive(Debug, PartialEq, Eq)]
pub struct Answered {
    /// Bytes of whole packets consumed from the front of the input.
    pub consumed: usize,
    /// The client sent DISCONNECT: close after writing the answers.
    pub disconnect: bool,
}

/// Answer every whole packet at the front of `input`, appending the answers to `out`.
/// `v5` is set once the connection's CONNECT said protocol level 5 (CONNACK then carries an
/// empty property length).
pub fn respond(input: &[u8], v5: &mut bool, out: &mut Vec<u8>) -> Result<Answered, FloorError> {
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
            3 => {
                let qos = (rest[0] >> 1) & 3;
                if qos > 0 {
                    let topic_len = usize::from(u16::from_be_bytes([
                        *body.first().ok_or(FloorError::Truncated("PUBLISH"))?,
                        *body.get(1).ok_or(FloorError::Truncated("PUBLISH"))?,
                    ]));
                    let id = body
                        .get(2 + topic_len..4 + topic_len)
                        .ok_or(FloorError::Truncated("PUBLISH"))?;
                    let answer = if qos == 1 { 0x40 } else { 0x50 };
                    out.extend_from_slice(&[answer, 2, id[0], id[1]]);
                }
            }
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

/// (fixed header length, remaining length) of the packet at the front, `None` while the
/// fixed header is incomplete.
fn frame(buf: &[u8]) -> Result<Option<(usize, usize)>, FloorError> {
    let mut len = 0usize;
    for i in 0..4 {
        let Some(&byte) = buf.get(1 + i) else {
            return Ok(None);
        };
        len |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            if len > MAX_PACKET {
                return Err(FloorError::TooLarge(len));
            }
            return Ok(Some((2 + i, len)));
        }
    }
    Err(FloorError::BadLength)
}

struct Conn {
    stream: TcpStream,
    /// The start of a packet whose rest has not arrived.
    rbuf: Vec<u8>,
    /// Answers the socket did not take yet.
    pending: Vec<u8>,
    v5: bool,
}

/// Serve on `listen` until the process is killed. `ready` gets the bound address (port 0 picks
/// a free port) once the listener accepts connections.
pub fn run_floor(listen: SocketAddr, ready: impl FnOnce(SocketAddr)) -> io::Result<()> {
    let mut poll = Poll::new()?;
    let mut listener = TcpListener::bind(listen)?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    ready(listener.local_addr()?);
    let mut events = Events::with_capacity(1024);
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut next_token = 0usize;
    let mut out = Vec::with_capacity(READ_CHUNK);
    let mut scratch = vec![0u8; READ_CHUNK];
    loop {
        if let Err(e) = poll.poll(&mut events, None) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        for event in &events {
            if event.token() == LISTENER {
                loop {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            stream.set_nodelay(true)?;
                            let token = Token(next_token);
                            next_token += 1;
                            poll.registry().register(
                                &mut stream,
                                token,
                                Interest::READABLE | Interest::WRITABLE,
                            )?;
                            conns.insert(
                                token.0,
                                Conn {
                                    stream,
                                    rbuf: Vec::new(),
                                    pending: Vec::new(),
                                    v5: false,
                                },
                            );
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // Out of files or the like: drop this attempt, keep serving the others.
                        Err(e) => {
                            eprintln!("sluice-bench floor: accept: {e}");
                            break;
                        }
                    }
                }
                continue;
            }
            let token = event.token().0;
            let Some(conn) = conns.get_mut(&token) else {
                continue;
            };
            if serve(conn, &mut scratch, &mut out).is_err() {
                if let Some(mut conn) = conns.remove(&token) {
                    let _ = poll.registry().deregister(&mut conn.stream);
                }
            }
        }
    }
}

/// Read until the socket would block, answer, write. `Err` closes the connection. Reads go
/// into the loop's one scratch buffer; only a partial packet is kept per connection.
fn serve(conn: &mut Conn, scratch: &mut [u8], out: &mut Vec<u8>) -> io::Result<()> {
    if !conn.pending.is_empty() {
        let n = write_some(&mut conn.stream, &conn.pending)?;
        conn.pending.drain(..n);
    }
    loop {
        let n = match conn.stream.read(scratch) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        out.clear();
        let answered = if conn.rbuf.is_empty() {
            let answered = respond(&scratch[..n], &mut conn.v5, out);
            let answered = answered.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            conn.rbuf.extend_from_slice(&scratch[answered.consumed..n]);
            answered
        } else {
            conn.rbuf.extend_from_slice(&scratch[..n]);
            let answered = respond(&conn.rbuf, &mut conn.v5, out);
            let answered = answered.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            conn.rbuf.drain(..answered.consumed);
            answered
        };
        if conn.rbuf.is_empty() {
            conn.rbuf = Vec::new();
        }
        if !out.is_empty() {
            if conn.pending.is_empty() {
                let written = write_some(&mut conn.stream, out)?;
                conn.pending.extend_from_slice(&out[written..]);
            } else {
                conn.pending.extend_from_slice(out);
            }
        }
        if answered.disconnect {
            return Err(io::ErrorKind::ConnectionAborted.into());
        }
    }
}

/// Write what the socket takes now; 0 when it would block.
fn write_some(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<usize> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{Bytes, BytesMut};
    use sluice_proto::mqtt::{encode, Connect, Packet, Properties, ProtocolVersion, Publish, QoS};

    fn connect(version: ProtocolVersion) -> Vec<u8> {
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

    fn publish(version: ProtocolVersion, qos: QoS, id: u16) -> Vec<u8> {
        let mut buf = BytesMut::new();
        let packet = Packet::Publish(Publish {
            dup: false,
            qos,
            retain: false,
            topic: "bench/1".into(),
            packet_id: (qos != QoS::AtMostOnce).then_some(id),
            properties: None,
            payload: Bytes::from_static(&[7; 300]),
        });
        encode(&packet, version, &mut buf).unwrap();
        buf.to_vec()
    }

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
