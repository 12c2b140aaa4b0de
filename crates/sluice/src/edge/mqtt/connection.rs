//! One device connection on its shard: the MQTT server side of a session after CONNECT —
//! the MQTT edge of the edge contract (`crate::edge`).
//!
//! Owns the socket, the per-connection protocol state (topic aliases both ways, QoS 1/2
//! acknowledgement order, keep-alive with the MQTT 5 Server Keep Alive cap) and the will
//! message until the connection ends (a delayed will then moves to the session). What must
//! survive a reconnect — QoS 2 ids awaiting PUBREL, the outbox, messages in flight — is the
//! session's. Does not own: where a message goes (each PUBLISH becomes a
//! [`crate::message::DeviceMessage`] handed to the router) or subscription bookkeeping (the
//! router's). A device may have `receive_maximum` publishes awaiting acknowledgement: MQTT 5
//! devices are told the number, stay read, and are disconnected with 0x93 if they exceed it;
//! 3.1.1 devices, which cannot be told, are simply not read while they are at it,
//! which, with the uplink's memory bound, is how devices are back-pressured when the cloud is
//! slow or away. Acknowledgements to the device go out in the order its PUBLISHes came in.
//! Keep-alive counts only the device's own silence: while the gateway is not reading it
//! (paused, or a publish waiting for room) the device counts as heard from, and its
//! keep-alive period starts again when reads resume.
//!
//! Back-pressure never costs a device its connection: while its messages are withheld (a
//! 3.1.1 device at the limit, any device whose PUBLISH waits for room in a full queue or
//! spool or for its `[limits]` rate) the gateway still reads up to [`READ_AHEAD_BYTES`]
//! ahead, answers the PINGREQs it finds there behind the withheld PUBLISHes, and leaves the
//! rest in the read buffer, handled in order when the device is read again. A device that
//! closes meanwhile is seen closed after what it sent before is handled (a DISCONNECT in the
//! read-ahead still cancels its will). The same path serves MQTT 3.1.1 and 5, over TCP, TLS
//! and WebSocket (the read-ahead is of MQTT bytes, after the stream layer).
//!
//! A protocol violation closes only this connection, with a log line naming the device and
//! what it did wrong (and, for MQTT 5, a DISCONNECT carrying the reason code).
//!
//! This file: accepting the session (CONNECT → CONNACK), the read loop, packet dispatch and
//! closing. By job, the rest: `inbound` (device PUBLISH → router, acknowledgements back),
//! `subscribe` (SUBSCRIBE/UNSUBSCRIBE), `outbound` (the session's outbox to the device, topic
//! aliases, writes), `will` (the end of a connection: will, session expiry timer).

mod inbound;
mod lazy;
mod outbound;
mod subscribe;
mod will;

use lazy::{LazyAcks, LazyMap};

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::edge::mqtt::stream::{DeviceReader, DeviceWriter};
use bytes::BytesMut;
use bytestring::ByteString;
use sluice_proto::mqtt::{
    encode, reason, ConnAck, Decoder, Disconnect, Packet, Properties, ProtocolVersion, PubResponse,
    QoS, Will,
};

use crate::control::acl::Subject;
use crate::control::priority::Priority;
use crate::edge::mqtt::session::{OutStage, Session};
use crate::shard::metrics::CloseReason;
use crate::shard::{Adopted, ShardContext};

/// How long a write to a device may stall before the device counts as a slow consumer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Input bounds: how far ahead a device whose messages are withheld is still read (for its
/// PINGREQs): no read starts once the read buffer holds this much, so it holds at most this
/// plus one read (2 KiB plain, one TLS record, what one WebSocket read decodes).
pub const READ_AHEAD_BYTES: usize = 16 * 1024;
/// Input bounds: how much of the session's outbox is encoded into the write buffer at once.
/// The rest stays in the outbox, where it is charged to `max_queued_bytes` and
/// `max_outbox_memory` (so a device that reads slowly holds at most this much uncharged,
/// plus one packet) and where overflow is dropped and counted.
pub const WRITE_AHEAD_BYTES: usize = 64 * 1024;
/// The connection task. Memory: this future is what an idle connection's task holds (see
/// docs/memory.md, per-connection budget), so it holds only the [`Connection`] and the wait
/// in [`Connection::serve`]; opening (with the CONNECT packet and the listener's read buffer)
/// and closing run boxed, their state gone once they are done.
pub async fn run(ctx: Rc<ShardContext>, adopted: Box<Adopted>) {
    let Some(mut conn) = Box::pin(open(ctx, adopted)).await else {
        return;
    };
    let reason = conn.serve().await;
    Box::pin(conn.end(reason)).await;
}

/// Register the socket on this shard, make room for the session and answer the CONNECT.
/// `None`: refused or failed (answered and logged here). Consumes `adopted`: the CONNECT and
/// the listener's read buffer are freed when this returns.
async fn open(ctx: Rc<ShardContext>, adopted: Box<Adopted>) -> Option<Connection> {
    let Adopted {
        stream,
        peer,
        // The same as the CONNECT's after admission (`Adopted::acl_username`).
        username: _,
        username_from_cert,
        connect,
        buffered,
        assigned_client_id,
    } = *adopted;
    // Input bounds: what the kernel may hold for a device that reads slowly.
    if let Err(error) = stream.set_send_buffer(ctx.config.mqtt.send_buffer.as_u64()) {
        tracing::debug!(%peer, %error, "cannot set the device socket's send buffer");
    }
    // Plain TCP: `from_std`, nodelay and `into_split`, as always; TLS and WebSocket share
    // their session state between the halves (`edge/mqtt/stream/`).
    let (rd, wr) = match stream.attach() {
        Ok(halves) => halves,
        Err(error) => {
            tracing::warn!(%peer, %error, "cannot register device socket on shard");
            return None;
        }
    };
    // Input bounds: room in the session table (mqtt.max_sessions), or a refusing CONNACK.
    if let Err(code) =
        crate::shard::limits::make_room_for_session(&ctx, &connect.client_id, connect.protocol)
            .await
    {
        crate::shard::limits::refuse_connect(wr, connect.protocol, code).await;
        return None;
    }
    ctx.metrics.connections.add(1);
    // Memory: no read buffer is kept unless the device pipelined bytes behind its CONNECT.
    let buffered = if buffered.is_empty() {
        BytesMut::new()
    } else {
        buffered
    };
    Some(
        Connection::start(
            ctx.clone(),
            (rd, wr),
            connect,
            buffered,
            assigned_client_id,
            peer,
            username_from_cert,
        )
        .await,
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckKind {
    PubAck,
    PubRec,
}

#[derive(Debug)]
struct PendingAck {
    packet_id: u16,
    kind: AckKind,
    done: bool,
}

struct Connection {
    ctx: Rc<ShardContext>,
    session: Rc<Session>,
    generation: u64,
    version: ProtocolVersion,
    client_id: ByteString,
    /// `username` came from a verified client certificate (`identity_from_cert`).
    username_from_cert: bool,
    /// The device's own priority, from the priority table of generation
    /// `priority_generation`; asked again when a reload published another one.
    priority: Priority,
    priority_generation: u64,
    /// The username the ACL sees (`Adopted::acl_username`): the CONNECT's, or with
    /// `identity_from_cert` the certificate's name, as admission left it.
    username: Option<ByteString>,
    /// `[acl]` rules naming this device (`control/acl/`).
    acl: crate::control::acl::DeviceAcl,
    /// `[limits]` publish rate; `None` when no rate is set.
    rate: Option<Box<crate::control::limits::PublishRate>>,
    peer: std::net::SocketAddr,
    rd: DeviceReader,
    wr: DeviceWriter,
    rbuf: BytesMut,
    wbuf: BytesMut,
    decoder: Decoder,
    /// Created at the first PUBLISH that needs an acknowledgement (see [`LazyAcks`]).
    acks: LazyAcks,
    ack_scratch: Vec<u16>,
    pending: VecDeque<PendingAck>,
    aliases: LazyMap<u16, ByteString>,
    /// Topic aliases the gateway assigned for its PUBLISHes to the device, and the next one.
    out_aliases: LazyMap<ByteString, u16>,
    out_alias_next: u16,
    /// How many the gateway may assign: min(device's Topic Alias Maximum, ours).
    out_alias_max: u16,
    keep_alive: Duration,
    last_read: Instant,
    /// Boxed: most devices have none, and `Will` inline would cost every connection.
    will: Option<Box<Will>>,
    device_receive_max: u16,
    device_max_packet: Option<u32>,
    /// `rbuf` holds bytes read ahead while the device's messages were withheld, not yet
    /// handled; `ahead_eof`: the device closed its side behind them.
    ahead: bool,
    ahead_eof: bool,
    /// The gateway closed the connection (a DISCONNECT may be on its way): read and discard
    /// briefly before closing, so unread input does not turn the close into a reset that
    /// destroys the DISCONNECT before the device reads it.
    linger: bool,
}

/// Close now, for this reason; for MQTT 5 with this reason code in a DISCONNECT.
struct Close(CloseReason, Option<u8>);

impl Connection {
    async fn start(
        ctx: Rc<ShardContext>,
        (rd, wr): (DeviceReader, DeviceWriter),
        connect: sluice_proto::mqtt::Connect,
        buffered: BytesMut,
        assigned_client_id: bool,
        peer: std::net::SocketAddr,
        username_from_cert: bool,
    ) -> Connection {
        let cfg = &ctx.config.mqtt;
        let version = connect.protocol;
        // Memory: copies, so nothing kept for the connection's life points into the
        // listener's read buffer, which then goes with the CONNECT.
        let client_id = ByteString::from(&*connect.client_id);
        let max_expiry = cfg.session_expiry_max;
        let expiry = match version {
            ProtocolVersion::V5 => {
                let asked = connect.properties.session_expiry_interval.unwrap_or(0);
                Duration::from_secs(asked as u64).min(max_expiry)
            }
            ProtocolVersion::V311 if connect.clean_start => Duration::ZERO,
            ProtocolVersion::V311 => max_expiry,
        };

        // Find or create the session; an existing connection for it is taken over.
        let existing = ctx.sessions.borrow().get(&client_id).cloned();
        let (session, session_present) = match existing {
            Some(s) if !connect.clean_start => {
                s.take_over();
                s.state.borrow_mut().timers.abort_all(); // input bounds: its will is cancelled
                                                         // Reconnecting within the will delay cancels the will (MQTT 5 §3.1.3.2.2).
                s.state.borrow_mut().will = None;
                (s, true)
            }
            Some(s) => {
                // A clean start ends the old session: its will, pending or not, goes now.
                s.state.borrow_mut().ended = true;
                s.take_over();
                s.state.borrow_mut().timers.abort_all(); // input bounds
                crate::edge::mqtt::local::end_session(&ctx, &s).await;
                (Self::new_session(&ctx, &client_id), false)
            }
            None => (Self::new_session(&ctx, &client_id), false),
        };
        let generation = session.generation.get();
        {
            let mut st = session.state.borrow_mut();
            st.connected = true;
            st.expiry = expiry;
            // `[state] dir`: a persistent session is logged from here on (all of it when it
            // just became persistent); one that no longer is leaves the state files.
            if !expiry.is_zero() {
                if st.journal.is_on() {
                    let expiry_s = expiry.as_secs().min(u32::MAX as u64) as u32;
                    st.journal
                        .record(|client, _| crate::state::Record::SessionOpen { client, expiry_s });
                } else {
                    st.journal.set_on(true);
                    crate::edge::mqtt::restore::journal_all(&st, &Default::default(), None, None);
                }
            } else if st.journal.is_on() {
                st.journal
                    .record(|client, _| crate::state::Record::SessionEnd { client });
                st.journal.set_on(false);
            }
        }
        let _ = ctx.control.try_send(crate::control::ControlCmd::DeviceUp {
            client_id: client_id.clone(),
            shard: ctx.id,
        });

        // Server Keep Alive (MQTT 5 §3.2.2.3.14): a keep-alive beyond the limit, or none, is
        // replaced by the limit and the device is told so.
        let mut keep_alive = connect.keep_alive;
        let max_keep_alive = cfg.max_keep_alive.as_secs().min(u16::MAX as u64) as u16;
        let server_keep_alive = version == ProtocolVersion::V5
            && max_keep_alive > 0
            && (keep_alive == 0 || keep_alive > max_keep_alive);
        if server_keep_alive {
            keep_alive = max_keep_alive;
        }
        let max_packet = cfg.max_packet_size.0.min(u32::MAX as u64) as usize;
        let acks = LazyAcks::new(session.notify.clone());
        let username = Adopted::acl_username(&connect).map(ByteString::from);
        let acl = crate::control::acl::DeviceAcl::new(
            &ctx.acl,
            &crate::control::acl::Subject {
                client_id: &client_id,
                username: username.as_deref(),
            },
        );
        let rules = ctx.rules.load_full();
        let mut conn = Connection {
            username,
            acl,
            // `[limits]` as the last reload left it; fixed for this connection.
            rate: crate::control::limits::PublishRate::new(&rules.limits, max_packet as u64),
            ctx: ctx.clone(),
            session,
            generation,
            version,
            client_id: client_id.clone(),
            username_from_cert,
            priority: rules.priority.device(&client_id),
            priority_generation: rules.generation,
            peer,
            rd,
            wr,
            rbuf: buffered,
            wbuf: BytesMut::new(),
            decoder: Decoder::client(version, max_packet),
            acks,
            ack_scratch: Vec::new(),
            pending: VecDeque::new(),
            aliases: LazyMap::default(),
            out_aliases: LazyMap::default(),
            out_alias_next: 1,
            out_alias_max: match version {
                ProtocolVersion::V5 => connect
                    .properties
                    .topic_alias_maximum
                    .unwrap_or(0)
                    .min(cfg.topic_alias_maximum),
                ProtocolVersion::V311 => 0,
            },
            keep_alive: Duration::from_secs(keep_alive as u64),
            last_read: Instant::now(),
            will: connect.will.as_ref().map(owned_will),
            device_receive_max: connect
                .properties
                .receive_maximum
                .unwrap_or(u16::MAX)
                .max(1),
            device_max_packet: connect.properties.maximum_packet_size,
            ahead: false,
            ahead_eof: false,
            linger: false,
        };

        let mut props = Properties::default();
        if version == ProtocolVersion::V5 {
            props.receive_maximum = Some(cfg.receive_maximum);
            props.maximum_packet_size = Some(max_packet as u32);
            props.topic_alias_maximum = Some(cfg.topic_alias_maximum);
            props.retain_available = Some(1);
            props.wildcard_subscription_available = Some(1);
            props.shared_subscription_available = Some(1);
            props.subscription_identifier_available = Some(1);
            if server_keep_alive {
                props.server_keep_alive = Some(keep_alive);
            }
            if assigned_client_id {
                props.assigned_client_identifier = Some(client_id.clone());
            }
            let asked = connect.properties.session_expiry_interval.unwrap_or(0) as u64;
            if asked > expiry.as_secs() {
                props.session_expiry_interval = Some(expiry.as_secs() as u32);
            }
        }
        conn.write(Packet::ConnAck(ConnAck {
            session_present,
            code: reason::SUCCESS,
            properties: props,
        }));
        conn.resend_inflight();
        conn
    }

    fn new_session(ctx: &ShardContext, client_id: &ByteString) -> Rc<Session> {
        let s = Session::with_budget(
            client_id.clone(),
            ctx.config.mqtt.max_queued_messages,
            ctx.bounds.outbox.clone(),
        );
        s.state
            .borrow_mut()
            .journal
            .attach(ctx.state.clone(), client_id);
        ctx.bounds.session_added();
        ctx.sessions
            .borrow_mut()
            .insert(client_id.clone(), s.clone());
        ctx.metrics.sessions.add(1);
        s
    }

    fn is_current(&self) -> bool {
        self.session.generation.get() == self.generation
    }

    fn write(&mut self, packet: Packet) {
        if let Err(error) = encode(&packet, self.version, &mut self.wbuf) {
            tracing::warn!(client_id = %self.client_id, packet = packet.name(), %error, "cannot encode packet for device");
        }
    }

    async fn serve(&mut self) -> CloseReason {
        let receive_max = self.ctx.config.mqtt.receive_maximum as usize;
        // One timer for the connection's life, re-armed only when it fires: reads just move
        // `last_read`, so the per-message path never touches the timer wheel.
        let keep_alive_on = !self.keep_alive.is_zero();
        let grace = self.keep_alive + self.keep_alive / 2;
        let keep_alive_timer = tokio::time::sleep(grace);
        tokio::pin!(keep_alive_timer);
        let mut was_paused = false;
        // Process anything the device pipelined behind its CONNECT.
        if let Err(Close(reason, code)) = self.process_input_boxed().await {
            return Box::pin(self.close_with(reason, code)).await;
        }
        if self.rbuf.is_empty() {
            self.rbuf = BytesMut::new();
        }
        loop {
            if !self.is_current() {
                return Box::pin(self.close_with(
                    CloseReason::SessionTakenOver,
                    Some(reason::SESSION_TAKEN_OVER),
                ))
                .await;
            }
            if self.ctx.shutting_down.get() {
                return Box::pin(
                    self.close_with(CloseReason::Shutdown, Some(reason::SERVER_UNAVAILABLE)),
                )
                .await;
            }
            if self.acks.created() {
                self.on_cloud_acks();
            }
            // Stopped at WRITE_AHEAD_BYTES with more to write: go round again once written
            // (after anything the device sent meanwhile), not only when the outbox grows.
            let more_out = self.take_outbox();
            if let Err(reason) = self.flush().await {
                return reason;
            }
            if let Err(Close(reason, code)) = self.check_abandoned() {
                return Box::pin(self.close_with(reason, code)).await;
            }
            // 3.1.1 devices are not told the limit: they are simply not read at it. MQTT 5
            // devices are told it and stay read, so a PUBLISH beyond it is seen (0x93) and so
            // are their PINGREQs.
            let paused = self.version == ProtocolVersion::V311 && self.pending.len() >= receive_max;
            if !paused && self.ahead {
                // Read again: first what was read ahead while it was not.
                self.ahead = false;
                if let Err(Close(reason, code)) = self.process_input_boxed().await {
                    return Box::pin(self.close_with(reason, code)).await;
                }
                if self.rbuf.is_empty() {
                    self.rbuf = BytesMut::new();
                }
                continue;
            }
            // Keep-alive measures the device's silence, not the gateway's: while its reads are
            // paused (and when they resume) the device counts as heard from now.
            if paused || was_paused {
                self.last_read = Instant::now();
            }
            was_paused = paused;
            tokio::select! {
                biased;
                // Outbox, takeover, shutdown and cloud acks all wake this one Notify; the top
                // of the loop looks at each.
                _ = self.session.notify.notified() => {}
                read = self.rd.read_more(&mut self.rbuf), if !paused || self.may_read_ahead() => {
                    if paused {
                        self.ahead = true;
                        if let Err(Close(reason, code)) = self.on_read_ahead(read) {
                            return Box::pin(self.close_with(reason, code)).await;
                        }
                        continue;
                    }
                    match read {
                        Ok(0) => return CloseReason::PeerClosed,
                        Ok(n) => {
                            self.ctx.metrics.bytes_received.add(n as u64);
                            self.last_read = Instant::now();
                            if let Err(Close(reason, code)) = self.process_input_boxed().await {
                                return Box::pin(self.close_with(reason, code)).await;
                            }
                            if self.rbuf.is_empty() {
                                // Release it, so an idle connection holds no read buffer.
                                self.rbuf = BytesMut::new();
                            }
                        }
                        Err(error) => return self.read_failed(error),
                    }
                }
                _ = &mut keep_alive_timer, if keep_alive_on => {
                    if paused {
                        self.last_read = Instant::now();
                    }
                    let deadline = self.last_read + grace;
                    if Instant::now() < deadline {
                        keep_alive_timer.as_mut().reset(deadline.into());
                        continue;
                    }
                    tracing::info!(client_id = %self.client_id, peer = %self.peer, keep_alive_s = self.keep_alive.as_secs(),
                        "device silent beyond 1.5x its keep-alive; closing");
                    return Box::pin(self.close_with(CloseReason::KeepAliveTimeout, Some(reason::KEEP_ALIVE_TIMEOUT))).await;
                }
                () = std::future::ready(()), if more_out => {}
            }
        }
    }

    fn read_failed(&self, error: std::io::Error) -> CloseReason {
        if error.kind() == std::io::ErrorKind::InvalidData {
            // TLS alert or WebSocket frame breaking RFC 6455: the stream layer has queued
            // its own close (alert, close frame).
            tracing::warn!(client_id = %self.client_id, peer = %self.peer, %error,
                "bad TLS record or WebSocket frame from device; closing its connection");
            return CloseReason::ProtocolError;
        }
        tracing::debug!(client_id = %self.client_id, %error, "device read failed");
        CloseReason::IoError
    }

    /// Whether the device, its messages withheld, may still be read ahead (see the module
    /// docs): within [`READ_AHEAD_BYTES`], and not after it closed.
    fn may_read_ahead(&self) -> bool {
        !self.ahead_eof && self.rbuf.len() < READ_AHEAD_BYTES
    }

    /// Bytes read ahead while the device's messages are withheld: its PINGREQs among them
    /// are answered now (the caller flushes); the rest waits in `rbuf`, in order.
    fn on_read_ahead(&mut self, read: std::io::Result<usize>) -> Result<(), Close> {
        match read {
            Ok(0) => self.ahead_eof = true,
            Ok(n) => {
                self.ctx.metrics.bytes_received.add(n as u64);
                for _ in 0..self.decoder.take_pingreqs(&mut self.rbuf) {
                    self.write(Packet::PingResp);
                }
                if self.rbuf.is_empty() {
                    self.rbuf = BytesMut::new();
                }
            }
            Err(error) => return Err(Close(self.read_failed(error), None)),
        }
        Ok(())
    }

    /// A message of this connection will never be acknowledged (see `crate::message::ack`): stop
    /// reading — anything handled after it could reach the cloud before the device resends
    /// it — and close, so the device reconnects and resends in order.
    fn check_abandoned(&self) -> Result<(), Close> {
        if !self.acks.created() || !self.acks.is_abandoned() {
            return Ok(());
        }
        tracing::warn!(client_id = %self.client_id, peer = %self.peer,
            "a message from this device was dropped before it was stored or forwarded (see the spool error above); closing the connection so the device resends it");
        Err(Close(CloseReason::AckLost, Some(reason::UNSPECIFIED_ERROR)))
    }

    /// [`Connection::process_input`], boxed: handling a packet may wait (a PUBLISH for room
    /// in a full queue, for its rate; a SUBSCRIBE for the router), and those futures inline
    /// would make every idle connection's task as large as the largest of them (several KiB
    /// per connection). One allocation per read that brought bytes, freed when handled.
    fn process_input_boxed(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Close>> + '_>> {
        Box::pin(self.process_input())
    }

    /// Decode and handle every complete packet in the read buffer.
    async fn process_input(&mut self) -> Result<(), Close> {
        loop {
            self.check_abandoned()?;
            let packet = match self.decoder.decode(&mut self.rbuf) {
                Ok(Some(p)) => p,
                Ok(None) => return Ok(()),
                Err(error) => {
                    tracing::warn!(client_id = %self.client_id, peer = %self.peer, %error, "bad packet from device; closing its connection");
                    return Err(Close(CloseReason::ProtocolError, Some(error.reason_code())));
                }
            };
            // Dispatch before awaiting, so the task's future never holds a whole `Packet`.
            match packet {
                Packet::Publish(p) => self.on_publish(p).await?,
                Packet::Subscribe(s) => Box::pin(self.on_subscribe(s)).await?,
                Packet::Unsubscribe(u) => Box::pin(self.on_unsubscribe(u)).await?,
                other => self.handle(other)?,
            }
        }
    }

    /// Packets that need no waiting.
    fn handle(&mut self, packet: Packet) -> Result<(), Close> {
        match packet {
            Packet::PubAck(r) => {
                let mut st = self.session.state.borrow_mut();
                if matches!(st.inflight.get(&r.packet_id), Some((m, OutStage::AwaitingAck)) if m.qos == QoS::AtLeastOnce)
                {
                    st.remove_inflight(r.packet_id);
                }
                Ok(())
            }
            Packet::PubRec(r) => {
                let known = {
                    let mut st = self.session.state.borrow_mut();
                    match st.inflight.get(&r.packet_id) {
                        Some((m, _)) if m.qos == QoS::ExactlyOnce => {
                            if r.reason >= 0x80 {
                                st.remove_inflight(r.packet_id);
                                false
                            } else {
                                st.mark_released(r.packet_id);
                                true
                            }
                        }
                        _ => false,
                    }
                };
                if known {
                    self.write(Packet::PubRel(resp(r.packet_id)));
                }
                Ok(())
            }
            Packet::PubComp(r) => {
                self.session.state.borrow_mut().remove_inflight(r.packet_id);
                Ok(())
            }
            Packet::PubRel(r) => {
                let found = self.session.state.borrow_mut().rel_done(r.packet_id);
                let mut out = resp(r.packet_id);
                if !found && self.version == ProtocolVersion::V5 {
                    out.reason = reason::PACKET_IDENTIFIER_NOT_FOUND;
                }
                self.write(Packet::PubComp(out));
                Ok(())
            }
            Packet::PingReq => {
                self.write(Packet::PingResp);
                Ok(())
            }
            Packet::Disconnect(d) => {
                if d.reason != reason::DISCONNECT_WITH_WILL {
                    self.will = None;
                }
                if let Some(expiry) = d.properties.session_expiry_interval {
                    let max = self.ctx.config.mqtt.session_expiry_max;
                    self.session.state.borrow_mut().expiry =
                        Duration::from_secs(expiry as u64).min(max);
                }
                Err(Close(CloseReason::ClientDisconnect, None))
            }
            other => {
                tracing::warn!(client_id = %self.client_id, peer = %self.peer, packet = other.name(),
                    "device sent a packet a client may not send here; closing its connection");
                Err(Close(
                    CloseReason::ProtocolError,
                    Some(reason::PROTOCOL_ERROR),
                ))
            }
        }
    }

    /// After `serve` returned: the will, the session, metrics and the linger (boxed by the
    /// caller, so none of it sits in an idle connection's task).
    async fn end(&mut self, reason: CloseReason) {
        self.finish(reason).await;
        tracing::debug!(peer = %self.peer, client_id = %self.client_id, username = ?self.username,
            username_from_cert = self.username_from_cert, reason = ?reason, "device connection closed");
        self.ctx.metrics.connections.sub(1);
        self.ctx.metrics.close(reason);
        // The socket still counts against max_connections until this returns.
        if self.linger {
            linger(&mut self.rd).await;
        }
    }

    async fn close_with(&mut self, reason: CloseReason, code: Option<u8>) -> CloseReason {
        if let (ProtocolVersion::V5, Some(code)) = (self.version, code) {
            self.write(Packet::Disconnect(Disconnect {
                reason: code,
                properties: Properties::default(),
            }));
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let _ = self.wr.write_all(&self.wbuf).await;
            let _ = self.wr.shutdown().await;
        })
        .await;
        self.wbuf.clear();
        self.linger = true;
        reason
    }
}

/// After the gateway closed a connection (write half shut down): discard what the device
/// still sends until it closes too, for at most 2 s and 64 KiB, so the socket closes without
/// a reset and the device can read everything written before it, DISCONNECT included.
async fn linger(rd: &mut DeviceReader) {
    const MAX: usize = 64 * 1024;
    let mut buf = [0u8; 2048];
    let mut total = 0;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while total < MAX {
            match rd.discard(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => total += n,
            }
        }
    })
    .await;
}

/// The CONNECT's will with its own copy of the topic and payload (see `Connection::start`);
/// its properties, rarely set, keep pointing into the CONNECT's buffer.
fn owned_will(will: &Will) -> Box<Will> {
    let mut will = will.clone();
    will.topic = ByteString::from(&*will.topic);
    will.payload = bytes::Bytes::copy_from_slice(&will.payload);
    Box::new(will)
}

fn resp(packet_id: u16) -> PubResponse {
    PubResponse {
        packet_id,
        reason: reason::SUCCESS,
        properties: None,
    }
}

/// What an idle device connection holds (the figures behind docs/perf/connections.md's
/// breakdown and docs/memory.md's per-connection budget). Sizes as compiled for tests
/// (unoptimised futures are larger than release ones; the bounds leave room for that).
#[cfg(test)]
mod sizes {
    use super::*;
    use crate::message::ack::DeviceAcks;
    use std::mem::size_of;

    fn future_size<A, B, F: std::future::Future>(_: fn(A, B) -> F) -> usize {
        size_of::<F>()
    }

    fn serve_size<F: std::future::Future>(_: fn(&'static mut Connection) -> F) -> usize {
        size_of::<F>()
    }

    #[test]
    fn an_idle_connection_holds_a_small_task_and_state() {
        let run = future_size(run);
        let serve = serve_size(Connection::serve);
        let conn = size_of::<Connection>();
        let session = size_of::<Session>();
        println!(
            "run future {run} B, serve future {serve} B, Connection {conn} B, Session {session} B, SessionState {} B, DeviceAcks {} B, Notify {} B, Sleep {} B, DeviceAcl {} B, Will {} B, PendingWill {} B, Journal {} B, DeviceReader {} B, Adopted {} B",
            size_of::<crate::edge::mqtt::session::SessionState>(),
            size_of::<DeviceAcks>(),
            size_of::<tokio::sync::Notify>(),
            size_of::<tokio::time::Sleep>(),
            size_of::<crate::control::acl::DeviceAcl>(),
            size_of::<Will>(),
            size_of::<crate::edge::mqtt::session::PendingWill>(),
            size_of::<crate::edge::mqtt::session::Journal>(),
            size_of::<DeviceReader>(),
            size_of::<Adopted>(),
        );
        // Before the idle-memory work (docs/perf/connections.md): run future 4,992 B,
        // Connection 1,048 B, Session 528 B (this build), 8.6 KiB of RSS per idle connection.
        assert!(run <= 1280, "run future {run} B");
        assert!(conn <= 512, "Connection {conn} B");
        assert!(session <= 320, "Session {session} B");
    }
}
