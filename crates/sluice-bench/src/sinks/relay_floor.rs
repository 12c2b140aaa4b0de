//! The relay floor: the least any MQTT forwarder that acknowledges after the cloud must do per
//! message, and nothing more (`sluice-bench relay-floor`, `scenario core --sut relay-floor`).
//!
//! Owns: a single-threaded epoll loop (mio, the kernel floor's [`serve_devices`] with its
//! framing and device connections, [`super::floor`]) that terminates plain-TCP MQTT devices,
//! and one TLS 1.3 MQTT 3.1.1 session (rustls, ring, trusting only the given CA; clean
//! session, keep-alive [`KEEP_ALIVE`]) to the cloud broker. Every device PUBLISH (QoS 0 or 1)
//! goes to the cloud as a QoS 1 PUBLISH with the same topic and payload and a fresh packet id;
//! a QoS 1 device PUBLISH gets its PUBACK only when the cloud's PUBACK for it arrives
//! (ack after the cloud's ack, as sluice does). Does not own: the MQTT framing (the floor's),
//! what is measured, or anything a gateway does beyond that: no spool, routing, topic
//! rewriting, metrics, ACL, aggregation, retries or reconnects. `scenario core` runs it under
//! the same device load and cloud as sluice and the Mosquitto bridge, so its CPU per message is
//! what forwarding itself costs on this machine: the floor under any forwarding gateway's.
//!
//! Batching (what a good forwarder does, and sluice tries to): the PUBLISHes of every device
//! read in one loop turn are encoded into one plaintext buffer and handed to rustls once at
//! the turn's end ([`FloorHandler::turn_end`]): one TLS record per 16 KiB, written with one
//! `writev`. When the cloud socket is ready, everything it holds is read and decrypted at
//! once, and each device's PUBACKs of that read go out in one `write` per device.
//!
//! Bounds and overflow: at most `max_inflight` messages (default and most: 65,535, the packet
//! id space) await the cloud's PUBACK, in a queue in packet-id order (16 bytes a message,
//! grown to the largest number in flight); a PUBLISH that finds it full is refused, which
//! closes its device (the device resends after reconnecting; a line on stderr at the 1st,
//! 2nd, 4th, … time). The TLS write buffer then holds
//! at most `max_inflight` PUBLISHes. QoS 2 closes the device. A cloud PUBACK whose device has closed since is
//! dropped (device tokens are never reused, so it cannot reach another device). The cloud
//! session failing — closed, a TLS error, a packet other than PUBACK or PINGRESP, a PUBACK for
//! no message in flight — ends the relay floor with an error: it has no reconnect.

use std::collections::HashMap;
use std::io::{self, Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use rustls::pki_types::ServerName;
use rustls::ClientConnection;
use sluice_proto::mqtt::{encode, Connect, Packet, Properties, ProtocolVersion};

use super::floor::{
    close, serve_devices, DeviceConn, FloorError, FloorHandler, Publish, HANDLER_TOKENS,
};

/// Keep-alive announced to the cloud; a PINGREQ goes out after half of it without a write.
pub const KEEP_ALIVE: Duration = Duration::from_secs(60);
/// The cloud connection's token.
const CLOUD: Token = Token(HANDLER_TOKENS);
/// A slot's device for a QoS 0 device PUBLISH: nobody to acknowledge.
const NO_DEVICE: usize = usize::MAX;

/// The relay floor's settings.
#[derive(Debug, Clone)]
pub struct RelayFloor {
    /// Plain-TCP MQTT address for the devices (port 0: a free port).
    pub listen: SocketAddr,
    /// The cloud broker's TLS address.
    pub cloud: SocketAddr,
    /// Name the cloud's certificate is verified against (an IP address: its IP SANs).
    pub server_name: String,
    /// CA certificate(s), PEM, that signed the cloud's certificate (no system roots).
    pub ca_file: PathBuf,
    /// The cloud session's MQTT client id.
    pub client_id: String,
    /// Messages awaiting the cloud's PUBACK, at most: 1 ..= 65,535.
    pub max_inflight: usize,
    /// TCP connect, TLS handshake and CONNACK, each at most this long.
    pub connect_timeout: Duration,
}

impl RelayFloor {
    /// Defaults: client id `relay-floor`, 65,535 in flight, 10 s to connect; the server name
    /// is the cloud's IP address.
    pub fn new(listen: SocketAddr, cloud: SocketAddr, ca_file: PathBuf) -> RelayFloor {
        RelayFloor {
            listen,
            cloud,
            server_name: cloud.ip().to_string(),
            ca_file,
            client_id: "relay-floor".to_string(),
            max_inflight: usize::from(u16::MAX),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Connect to the cloud (blocking), then serve devices on `cfg.listen` until the process is
/// killed or the cloud session fails. `ready` gets the bound device address once the cloud's
/// CONNACK arrived and the listener accepts connections.
pub fn run_relay_floor(cfg: &RelayFloor, ready: impl FnOnce(SocketAddr)) -> io::Result<()> {
    if !(1..=usize::from(u16::MAX)).contains(&cfg.max_inflight) {
        return Err(invalid_input(format!(
            "max_inflight {} is not between 1 and 65535",
            cfg.max_inflight
        )));
    }
    serve_devices(cfg.listen, ready, |registry| Relay::connect(cfg, registry))
}

/// A message sent to the cloud: the device's token ([`NO_DEVICE`] for QoS 0) and its packet
/// id; `acked` once the cloud's PUBACK came (it leaves the queue when all before it did too).
#[derive(Debug, Clone, Copy)]
struct Slot {
    device: usize,
    device_id: [u8; 2],
    acked: bool,
}

/// The cloud packet id of the `seq`-th message sent: 1, 2, …, 65535, 1, …
fn cloud_id(seq: u64) -> u16 {
    (seq % u64::from(u16::MAX)) as u16 + 1
}

/// The messages sent to the cloud and not yet acknowledged, oldest first; the `i`-th has
/// sequence number `base + i`, so cloud packet id [`cloud_id`]`(base + i)`.
#[derive(Debug, Default)]
struct Inflight {
    slots: std::collections::VecDeque<Slot>,
    base: u64,
}

impl Inflight {
    /// Queue a message; its cloud packet id.
    fn push(&mut self, slot: Slot) -> u16 {
        self.slots.push_back(slot);
        cloud_id(self.base + self.slots.len() as u64 - 1)
    }

    /// The message the cloud acknowledged with `id` (`None`: not in flight), removed with every
    /// acknowledged one before it.
    fn ack(&mut self, id: u16) -> Option<Slot> {
        let max = u64::from(u16::MAX);
        let first = u64::from(cloud_id(self.base));
        let index = (u64::from(id) + max - first) % max;
        let slot = self.slots.get_mut(usize::try_from(index).ok()?)?;
        if id == 0 || slot.acked {
            return None;
        }
        slot.acked = true;
        let taken = *slot;
        while self.slots.front().is_some_and(|s| s.acked) {
            self.slots.pop_front();
            self.base += 1;
        }
        Some(taken)
    }
}

/// The cloud side: the TLS session and what is in flight on it.
struct Relay {
    stream: TcpStream,
    tls: ClientConnection,
    registry: Registry,
    /// This turn's PUBLISHes, plaintext, handed to rustls at the turn's end.
    out: Vec<u8>,
    /// Cloud plaintext: an incomplete packet's start.
    rbuf: Vec<u8>,
    inflight: Inflight,
    max_inflight: usize,
    /// Devices closed because the window was full.
    window_full: u64,
    /// The PUBACKs of one cloud read, (device, device packet id), in the cloud's order.
    acks: Vec<(usize, [u8; 2])>,
    ackbuf: Vec<u8>,
    last_write: Instant,
    /// The cloud session failed in [`FloorHandler::ready`]; reported at the turn's end.
    failed: Option<io::Error>,
}

impl Relay {
    /// TCP, the TLS 1.3 handshake, CONNECT and CONNACK, blocking with time-outs; then the
    /// socket goes non-blocking into `registry`.
    fn connect(cfg: &RelayFloor, registry: &Registry) -> io::Result<Relay> {
        let config = crate::conn::tls_client_config(&cfg.ca_file, None)
            .map_err(|e| invalid_input(format!("{e:#}")))?;
        let name = ServerName::try_from(cfg.server_name.clone())
            .map_err(|e| invalid_input(format!("server name {:?}: {e}", cfg.server_name)))?;
        let mut tls = ClientConnection::new(Arc::clone(&config), name).map_err(io::Error::other)?;
        // The in-flight window bounds what waits in rustls (see the module).
        tls.set_buffer_limit(None);
        let mut tcp = std::net::TcpStream::connect_timeout(&cfg.cloud, cfg.connect_timeout)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(cfg.connect_timeout))?;
        tcp.set_write_timeout(Some(cfg.connect_timeout))?;
        while tls.is_handshaking() {
            tls.complete_io(&mut tcp)?;
        }
        let mut connect = BytesMut::new();
        let packet = Packet::Connect(Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: KEEP_ALIVE.as_secs() as u16,
            client_id: cfg.client_id.as_str().into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        });
        encode(&packet, ProtocolVersion::V311, &mut connect).map_err(io::Error::other)?;
        tls.writer().write_all(&connect)?;
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while got.len() < 4 {
            while tls.wants_write() {
                tls.write_tls(&mut tcp)?;
            }
            if tls.read_tls(&mut tcp)? == 0 {
                return Err(cloud_error(
                    "the cloud closed the connection before CONNACK",
                ));
            }
            tls.process_new_packets().map_err(invalid_data)?;
            loop {
                match tls.reader().read(&mut buf) {
                    Ok(0) => {
                        return Err(cloud_error("the cloud closed the session before CONNACK"))
                    }
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
        }
        if got[..2] != [0x20, 2] || got[3] != 0 {
            return Err(cloud_error(format!(
                "the cloud refused the session (answered {:02x?})",
                &got[..4]
            )));
        }
        tcp.set_read_timeout(None)?;
        tcp.set_write_timeout(None)?;
        tcp.set_nonblocking(true)?;
        let mut stream = TcpStream::from_std(tcp);
        registry.register(&mut stream, CLOUD, Interest::READABLE | Interest::WRITABLE)?;
        Ok(Relay {
            stream,
            tls,
            registry: registry.try_clone()?,
            out: Vec::with_capacity(16 * 1024),
            rbuf: got[4..].to_vec(),
            inflight: Inflight::default(),
            max_inflight: cfg.max_inflight,
            window_full: 0,
            acks: Vec::new(),
            ackbuf: Vec::new(),
            last_write: Instant::now(),
            failed: None,
        })
    }

    /// Write what rustls holds until the socket would block.
    fn flush(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.stream) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The cloud socket is ready: write what waits, read and decrypt everything it has, then
    /// PUBACK each device once for all of its messages the cloud acknowledged.
    fn serve(
        &mut self,
        devices: &mut HashMap<usize, DeviceConn>,
        scratch: &mut [u8],
    ) -> io::Result<()> {
        self.flush()?;
        loop {
            match self.tls.read_tls(&mut self.stream) {
                Ok(0) => return Err(cloud_error("the cloud closed the connection")),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            self.tls.process_new_packets().map_err(invalid_data)?;
            loop {
                match self.tls.reader().read(scratch) {
                    Ok(0) => return Err(cloud_error("the cloud closed the session")),
                    Ok(n) => self.rbuf.extend_from_slice(&scratch[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
        }
        let used = self.take_acks()?;
        self.rbuf.drain(..used);
        // One write per device: its PUBACKs in the order the cloud acknowledged them.
        self.acks.sort_by_key(|&(device, _)| device);
        let mut at = 0;
        while at < self.acks.len() {
            let device = self.acks[at].0;
            self.ackbuf.clear();
            while at < self.acks.len() && self.acks[at].0 == device {
                let id = self.acks[at].1;
                self.ackbuf.extend_from_slice(&[0x40, 2, id[0], id[1]]);
                at += 1;
            }
            if let Some(conn) = devices.get_mut(&device) {
                if conn.send(&self.ackbuf).is_err() {
                    close(devices, device, &self.registry);
                }
            }
        }
        self.acks.clear();
        Ok(())
    }

    /// Consume the whole packets of `rbuf` (PUBACK, PINGRESP), adding each PUBACK's device
    /// answer to `acks`; the bytes used.
    fn take_acks(&mut self) -> io::Result<usize> {
        let mut at = 0;
        while let Some(header) = self.rbuf.get(at..at + 2) {
            match header {
                [0x40, 2] => {
                    let Some(id) = self.rbuf.get(at + 2..at + 4) else {
                        break;
                    };
                    let id = u16::from_be_bytes([id[0], id[1]]);
                    let Some(slot) = self.inflight.ack(id) else {
                        return Err(cloud_error(format!("a PUBACK for {id}, not in flight")));
                    };
                    if slot.device != NO_DEVICE {
                        self.acks.push((slot.device, slot.device_id));
                    }
                    at += 4;
                }
                [0xd0, 0] => at += 2,
                other => {
                    return Err(cloud_error(format!(
                        "the cloud sent {other:02x?}, not a PUBACK or PINGRESP"
                    )))
                }
            }
        }
        Ok(at)
    }
}

impl FloorHandler for Relay {
    /// Take a cloud packet id and add the cloud PUBLISH to this turn's batch.
    fn publish(
        &mut self,
        device: usize,
        p: Publish<'_>,
        _: &mut Vec<u8>,
    ) -> Result<(), FloorError> {
        let device = match p.qos {
            0 => NO_DEVICE,
            1 => device,
            _ => return Err(FloorError::Refused("QoS 2 is not relayed")),
        };
        if self.inflight.slots.len() >= self.max_inflight {
            // Said on stderr at the 1st, 2nd, 4th, 8th, … time: a run that lost devices shows why.
            self.window_full += 1;
            if self.window_full.is_power_of_two() {
                eprintln!(
                    "sluice-bench relay-floor: {} messages await the cloud's PUBACK: closed a \
                     device ({} times so far)",
                    self.max_inflight, self.window_full
                );
            }
            return Err(FloorError::Refused("the cloud's in-flight window is full"));
        }
        let id = self.inflight.push(Slot {
            device,
            device_id: p.packet_id,
            acked: false,
        });
        encode_publish(&mut self.out, id, p.topic, p.payload);
        Ok(())
    }

    fn ready(
        &mut self,
        token: Token,
        devices: &mut HashMap<usize, DeviceConn>,
        scratch: &mut [u8],
    ) {
        if token != CLOUD || self.failed.is_some() {
            return;
        }
        if let Err(e) = self.serve(devices, scratch) {
            self.failed = Some(e);
        }
    }

    /// Hand the turn's PUBLISHes to rustls at once and write them (a PINGREQ instead after
    /// half the keep-alive without a write).
    fn turn_end(&mut self, _: &mut HashMap<usize, DeviceConn>) -> io::Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let now = Instant::now();
        if self.out.is_empty() && now.duration_since(self.last_write) >= KEEP_ALIVE / 2 {
            self.out.extend_from_slice(&[0xc0, 0]);
        }
        if !self.out.is_empty() {
            self.tls.writer().write_all(&self.out)?;
            self.out.clear();
            self.last_write = now;
        }
        self.flush()
    }

    fn poll_timeout(&self) -> Option<Duration> {
        Some(KEEP_ALIVE / 2)
    }
}

/// Append a QoS 1 PUBLISH (no DUP, no retain) with packet id `id` to `out`.
pub fn encode_publish(out: &mut Vec<u8>, id: u16, topic: &[u8], payload: &[u8]) {
    let remaining = 2 + topic.len() + 2 + payload.len();
    out.push(0x32);
    let mut len = remaining;
    loop {
        let byte = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            out.push(byte);
            break;
        }
        out.push(byte | 0x80);
    }
    // The floor's framing took the topic from a 2-byte length: it fits.
    out.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    out.extend_from_slice(topic);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(payload);
}

fn invalid_input(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

fn invalid_data(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

fn cloud_error(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use sluice_proto::mqtt::{Decoder, QoS};

    fn slot(device: usize) -> Slot {
        Slot {
            device,
            device_id: [0, device as u8],
            acked: false,
        }
    }

    #[test]
    fn cloud_ids_run_1_to_65535_and_acks_in_any_order_find_their_message_once() {
        // Start near the wrap so ids 65534, 65535, 1, 2, … are in flight together.
        let mut inflight = Inflight {
            base: u64::from(u16::MAX) - 2,
            ..Inflight::default()
        };
        let ids: Vec<u16> = (0..6).map(|d| inflight.push(slot(d))).collect();
        assert_eq!(ids, [65534, 65535, 1, 2, 3, 4]);
        assert!(inflight.ack(0).is_none(), "0 is no packet id");
        assert!(inflight.ack(5).is_none(), "not sent yet");
        assert_eq!(inflight.ack(1).map(|s| s.device), Some(2));
        assert!(inflight.ack(1).is_none(), "a second PUBACK for 1");
        assert_eq!(inflight.slots.len(), 6, "the oldest is still out");
        assert_eq!(inflight.ack(65534).map(|s| s.device), Some(0));
        assert_eq!(inflight.ack(65535).map(|s| s.device), Some(1));
        assert_eq!(
            inflight.slots.len(),
            3,
            "acknowledged in front leave the queue"
        );
        for (id, device) in [(4, 5), (2, 3), (3, 4)] {
            assert_eq!(inflight.ack(id).map(|s| s.device), Some(device));
        }
        assert!(inflight.slots.is_empty());
        assert_eq!(inflight.push(slot(9)), 5, "ids go on after the last");
    }

    #[test]
    fn a_forwarded_publish_decodes_with_its_topic_payload_and_fresh_id() {
        for payload_len in [0, 1, 100, 127 - 12, 128, 1024, 20_000] {
            let payload: Vec<u8> = (0..payload_len).map(|i| i as u8).collect();
            let mut out = Vec::new();
            encode_publish(&mut out, 0xbeef, b"bench/7", &payload);
            encode_publish(&mut out, 1, b"t", b"x");
            let mut buf = BytesMut::from(&out[..]);
            let mut decoder = Decoder::client(ProtocolVersion::V311, 1 << 20);
            for (id, topic, body) in [
                (0xbeef, "bench/7", Bytes::from(payload.clone())),
                (1, "t", Bytes::from_static(b"x")),
            ] {
                match decoder.decode(&mut buf).unwrap() {
                    Some(Packet::Publish(p)) => {
                        assert_eq!(p.qos, QoS::AtLeastOnce);
                        assert_eq!(p.packet_id, Some(id));
                        assert_eq!(&*p.topic, topic);
                        assert_eq!(p.payload, body, "{payload_len}");
                        assert!(!p.dup && !p.retain);
                    }
                    other => panic!("{payload_len}: {other:?}"),
                }
            }
            assert!(buf.is_empty());
        }
    }
}
