//! The io_uring floor (`sluice-bench floor --io uring`, `scenario core --sut floor-uring`): the
//! kernel floor of [`super::floor`] with completion-based I/O instead of readiness, to measure
//! what io_uring would save a gateway's device side (ADR 0016, `docs/perf/io-uring.md`).
//!
//! Owns: a single-threaded loop over one io_uring ([`ring`]): a multishot accept, one
//! multishot receive per connection into a shared ring of provided buffers, and at most one
//! send per connection in flight carrying every answer gathered since the last; each
//! connection's socket is also in the ring's registered file table while it is open. Each loop turn
//! is one `io_uring_enter` that submits the sends (and re-armed receives) of every connection
//! served in the previous turn and waits for the next completions, so many devices' reads and
//! PUBACK writes share one system call. Answers and framing are the epoll floor's
//! ([`Framer`], [`answer_at_once`]): CONNACK, PUBACK/PUBREC, PUBCOMP, PINGRESP; nothing is
//! forwarded. Does not own: the framing, the ring's memory rules ([`ring`], the crate's only
//! `unsafe`).
//!
//! Invariants: a connection's slot is reused only once neither its receive nor its send is in
//! flight (so a completion always finds its own connection); bad input or a socket error
//! closes only that connection (shutdown, then freed when its operations have completed);
//! per connection only an incomplete packet and the answers not yet written are kept.

#[allow(unsafe_code)]
mod ring;

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use ring::{Event, Ring};

use super::floor::{answer_at_once, Framer};

/// One device connection.
struct Conn {
    stream: TcpStream,
    framer: Framer,
    /// Answers not yet handed to the ring.
    out: Vec<u8>,
    /// The buffer the last finished send gave back, swapped in for `out` at the next send.
    spare: Vec<u8>,
    /// A send is in flight (the ring holds its buffer).
    sending: bool,
    /// The multishot receive is armed.
    receiving: bool,
    /// Closing: nothing more is read; freed once neither operation is in flight.
    closing: bool,
    /// Listed for this turn's sends.
    queued: bool,
}

impl Conn {
    /// Stop reading and writing: the socket is shut down, so an armed receive completes.
    /// `keep_answers`: the client said DISCONNECT, its answers are written first.
    fn close(&mut self, keep_answers: bool) {
        self.closing = true;
        if !keep_answers {
            self.out.clear();
        }
        if self.out.is_empty() && (!self.sending || !keep_answers) {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
    }

    fn done(&self) -> bool {
        self.closing && !self.sending && !self.receiving
    }
}

/// The connections by slot, and the free slots.
#[derive(Default)]
struct Conns {
    slots: Vec<Option<Conn>>,
    free: Vec<u32>,
}

impl Conns {
    fn insert(&mut self, conn: Conn) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(conn);
                id
            }
            None => {
                self.slots.push(Some(conn));
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn get(&mut self, id: u32) -> Option<&mut Conn> {
        self.slots.get_mut(id as usize).and_then(Option::as_mut)
    }

    /// Free `id`'s slot (taking it out of the ring's file table, closing its socket) if it is
    /// closed and idle.
    fn release_if_done(&mut self, id: u32, ring: &mut Ring) {
        if self.get(id).is_some_and(|c| c.done()) {
            ring.detach(id);
            self.slots[id as usize] = None;
            self.free.push(id);
        }
    }
}

/// Serve on `listen` until the process is killed, like [`super::floor::run_floor`] but over
/// io_uring. `ready` gets the bound address once the multishot accept is armed. Fails at once
/// where the kernel has no io_uring with provided-buffer rings (5.19) or it is disabled.
pub fn run_floor_uring(listen: SocketAddr, ready: impl FnOnce(SocketAddr)) -> io::Result<()> {
    let listener = TcpListener::bind(listen)?;
    let mut ring = Ring::new()?;
    ring.push_accept(&listener)?;
    ring.submit_and_wait(0)?;
    ready(listener.local_addr()?);
    let mut conns = Conns::default();
    let mut events = Vec::with_capacity(1024);
    let mut to_send: Vec<u32> = Vec::new();
    loop {
        ring.submit_and_wait(1)?;
        ring.complete(&mut events);
        for event in events.drain(..) {
            match event {
                Event::Accepted { result, more } => {
                    match result.and_then(|s| s.set_nodelay(true).map(|()| s)) {
                        Ok(stream) => {
                            let fd = stream.as_raw_fd();
                            let id = conns.insert(Conn {
                                stream,
                                framer: Framer::default(),
                                out: Vec::new(),
                                spare: Vec::new(),
                                sending: false,
                                receiving: true,
                                closing: false,
                                queued: false,
                            });
                            ring.attach(id, fd);
                            ring.push_recv(id, fd)?;
                        }
                        Err(e) => eprintln!("sluice-bench: accept: {e}"),
                    }
                    if !more {
                        ring.push_accept(&listener)?;
                    }
                }
                Event::Received { conn, result, more } => {
                    let Some(c) = conns.get(conn) else {
                        if let Ok(Some(buf)) = result {
                            ring.recycle(buf);
                        }
                        continue;
                    };
                    c.receiving = more;
                    match result {
                        Ok(Some(buf)) => {
                            if !c.closing {
                                let answered =
                                    c.framer
                                        .feed(ring.data(&buf), &mut c.out, &mut answer_at_once);
                                if !c.out.is_empty() && !c.queued {
                                    c.queued = true;
                                    to_send.push(conn);
                                }
                                match answered {
                                    Ok(false) => {}
                                    Ok(true) => c.close(true),
                                    Err(_) => c.close(false),
                                }
                            }
                            ring.recycle(buf);
                        }
                        Ok(None) => c.close(false),
                        // Out of provided buffers: the receive stopped; it is armed again
                        // below, with this turn's buffers back in the ring.
                        Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                        Err(_) => c.close(false),
                    }
                    if !c.receiving && !c.closing {
                        c.receiving = true;
                        ring.push_recv(conn, c.stream.as_raw_fd())?;
                    }
                    conns.release_if_done(conn, &mut ring);
                }
                Event::Sent { conn, result, buf } => {
                    let Some(c) = conns.get(conn) else { continue };
                    c.sending = false;
                    match result {
                        Ok(n) if n == buf.len() => {
                            let mut buf = buf;
                            buf.clear();
                            c.spare = buf;
                            if !c.out.is_empty() && !c.queued {
                                c.queued = true;
                                to_send.push(conn);
                            } else if c.closing && c.out.is_empty() {
                                let _ = c.stream.shutdown(Shutdown::Both);
                            }
                        }
                        Ok(n) if n > 0 && !c.closing => {
                            // The socket took part: the rest goes first, the newer answers after.
                            let mut rest = buf;
                            rest.drain(..n);
                            c.sending = true;
                            ring.push_send(conn, c.stream.as_raw_fd(), rest)?;
                        }
                        _ => c.close(false),
                    }
                    conns.release_if_done(conn, &mut ring);
                }
            }
        }
        for id in to_send.drain(..) {
            let Some(c) = conns.get(id) else { continue };
            c.queued = false;
            if c.sending || c.out.is_empty() {
                continue;
            }
            let buf = std::mem::replace(&mut c.out, std::mem::take(&mut c.spare));
            c.sending = true;
            ring.push_send(id, c.stream.as_raw_fd(), buf)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::floor::test_packets::{connect, publish};
    use sluice_proto::mqtt::{ProtocolVersion, QoS};
    use std::io::{Read as _, Write as _};
    use std::time::Duration;

    fn start() -> SocketAddr {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            run_floor_uring("127.0.0.1:0".parse().unwrap(), |a| tx.send(a).unwrap())
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the io_uring floor started")
    }

    fn device(addr: SocketAddr) -> std::net::TcpStream {
        let s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    #[test]
    fn devices_get_a_connack_and_a_puback_per_qos1_publish_over_io_uring() {
        let addr = start();
        let v = ProtocolVersion::V311;
        let mut devices: Vec<_> = (0..8).map(|_| device(addr)).collect();
        for (i, d) in devices.iter_mut().enumerate() {
            let mut buf = connect(v);
            for id in 1..=20u16 {
                buf.extend(publish(v, QoS::AtLeastOnce, id + i as u16 * 100));
            }
            buf.extend(publish(v, QoS::AtMostOnce, 0));
            d.write_all(&buf).unwrap();
        }
        for (i, d) in devices.iter_mut().enumerate() {
            let mut answers = vec![0u8; 4 + 20 * 4];
            d.read_exact(&mut answers).unwrap();
            assert_eq!(answers[..4], [0x20, 2, 0, 0], "CONNACK of device {i}");
            let acked: Vec<u16> = answers[4..]
                .chunks(4)
                .map(|a| {
                    assert_eq!(a[..2], [0x40, 2], "a PUBACK");
                    u16::from_be_bytes([a[2], a[3]])
                })
                .collect();
            let want: Vec<u16> = (1..=20).map(|id| id + i as u16 * 100).collect();
            assert_eq!(
                acked, want,
                "device {i}: every QoS 1 PUBLISH once, in order"
            );
        }
        // A PINGREQ gets its PINGRESP; a packet split across writes is answered once whole.
        let d = &mut devices[0];
        d.write_all(&[0xc0, 0]).unwrap();
        let p = publish(v, QoS::AtLeastOnce, 4242);
        d.write_all(&p[..5]).unwrap();
        d.flush().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        d.write_all(&p[5..]).unwrap();
        let mut answers = [0u8; 6];
        d.read_exact(&mut answers).unwrap();
        assert_eq!(answers, [0xd0, 0, 0x40, 2, 0x10, 0x92]);
    }

    #[test]
    fn bad_input_and_disconnect_close_only_that_connection() {
        let addr = start();
        let v = ProtocolVersion::V5;
        let mut good = device(addr);
        let mut bad = device(addr);
        let mut leaving = device(addr);
        bad.write_all(&[0x82, 1, 0]).unwrap(); // SUBSCRIBE: not answered by the floor
        let mut rest = Vec::new();
        bad.read_to_end(&mut rest).unwrap();
        assert!(
            rest.is_empty(),
            "the bad connection is closed with no answer"
        );
        let mut buf = connect(v);
        buf.extend(publish(v, QoS::AtLeastOnce, 7));
        buf.extend([0xe0, 0]); // DISCONNECT
        leaving.write_all(&buf).unwrap();
        let mut got = Vec::new();
        leaving.read_to_end(&mut got).unwrap();
        assert_eq!(
            got,
            [0x20, 3, 0, 0, 0, 0x40, 2, 0, 7],
            "answers, then closed"
        );
        let mut buf = connect(v);
        buf.extend(publish(v, QoS::AtLeastOnce, 9));
        good.write_all(&buf).unwrap();
        let mut answers = [0u8; 9];
        good.read_exact(&mut answers).unwrap();
        assert_eq!(answers, [0x20, 3, 0, 0, 0, 0x40, 2, 0, 9]);
        // Many connections opened and closed reuse slots without confusion.
        for _ in 0..50 {
            let mut d = device(addr);
            d.write_all(&connect(v)).unwrap();
            let mut a = [0u8; 5];
            d.read_exact(&mut a).unwrap();
        }
        good.write_all(&publish(v, QoS::AtLeastOnce, 10)).unwrap();
        let mut a = [0u8; 4];
        good.read_exact(&mut a).unwrap();
        assert_eq!(a, [0x40, 2, 0, 10]);
    }
}
