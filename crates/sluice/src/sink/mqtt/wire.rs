//! What goes over an established MQTT connection: PUBLISHes out, packets in, the downlink.
//!
//! Owns: encoding a unit as a PUBLISH into the pending batch, writing the batch, reading and
//! decoding the broker's packets (PUBACK → [`Feedback`], PINGRESP, SUBACK, PUBREL, downlink
//! PUBLISH), keep-alive, delivering downlink messages and their PUBACKs, and DISCONNECT.
//! Does not own: which units go next or what happens to refused ones (the outbox).

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{
    encode, Disconnect, Packet, Properties, ProtocolVersion, PubResponse, Publish, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions, Unsubscribe,
};
use sluice_proto::senml::Format;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, info, warn};

use super::link::READ_CHUNK;
use super::{classify_refusal, MqttTransport};
use crate::config::PackFormat;
use crate::sink::transport::{Feedback, SendId, Unit, Unsendable};
use crate::sink::UplinkError;

/// Bound on writing DISCONNECT and closing TLS at shutdown.
const SHUTDOWN_WRITE_TIMEOUT: Duration = Duration::from_secs(2);

impl MqttTransport {
    /// Encode `unit` as one PUBLISH at the end of the pending batch (see
    /// [`crate::sink::transport::Transport::encode`]).
    pub(super) fn encode_publish(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let (max_packet, retain_available) = self
            .conn
            .as_ref()
            .map_or((usize::MAX, true), |c| (c.max_packet, c.retain_available));
        let (needs_ack, publish) = match unit {
            Unit::Message { msg, resend } => {
                let needs_ack = msg.needs_cloud_ack();
                let packet_id = needs_ack.then(|| self.alloc_packet_id());
                let publish = Packet::Publish(Publish {
                    dup: resend && needs_ack,
                    qos: if needs_ack {
                        QoS::AtLeastOnce
                    } else {
                        QoS::AtMostOnce
                    },
                    retain: msg.retain && retain_available,
                    topic: self.route.cloud_topic(&msg.device, &msg.topic),
                    packet_id,
                    properties: None,
                    payload: msg.payload.clone(),
                });
                (packet_id, publish)
            }
            Unit::Pack {
                payload,
                format,
                needs_ack,
            } => {
                let packet_id = needs_ack.then(|| self.alloc_packet_id());
                (
                    packet_id,
                    self.pack_publish(packet_id, payload.clone(), format),
                )
            }
        };
        let before = self.out.len();
        match encode(&publish, self.version, &mut self.out) {
            Err(e) => {
                self.out.truncate(before);
                Err(Unsendable::Invalid(e.to_string()))
            }
            Ok(()) if self.out.len() - before > max_packet => {
                let size = self.out.len() - before;
                self.out.truncate(before);
                Err(Unsendable::TooLarge {
                    size,
                    max: max_packet,
                })
            }
            Ok(()) => Ok(needs_ack.map(|id| {
                self.ids.insert(id);
                SendId(u64::from(id))
            })),
        }
    }

    /// The PUBLISH carrying a SenML pack.
    fn pack_publish(&self, packet_id: Option<u16>, payload: Bytes, format: Format) -> Packet {
        let properties = (self.version == ProtocolVersion::V5).then(|| {
            Box::new(Properties {
                content_type: Some(ByteString::from_static(format.content_type())),
                ..Properties::default()
            })
        });
        Packet::Publish(Publish {
            dup: false,
            qos: if packet_id.is_some() {
                QoS::AtLeastOnce
            } else {
                QoS::AtMostOnce
            },
            retain: false,
            topic: self
                .route
                .with_aggregate(|a| ByteString::from(a.topic.as_str())),
            packet_id,
            properties,
            payload,
        })
    }

    /// Most payload bytes a pack may have so that its PUBLISH stays within `max_packet`: the
    /// PUBLISH around an empty payload, plus 3 for the remaining-length field growing.
    pub(super) fn pack_payload_limit(&self, max_packet: usize) -> usize {
        // Worked out whether or not aggregation is on now: a reload may turn it on while this
        // connection lasts. (A reloaded aggregate topic or format is measured from the next
        // connect on.)
        let format = self.route.with_aggregate(|a| a.format);
        if max_packet == usize::MAX || self.lane != crate::sink::Lane::Normal {
            return usize::MAX;
        }
        let format = match format {
            PackFormat::Json => Format::Json,
            PackFormat::Cbor => Format::Cbor,
        };
        let mut probe = bytes::BytesMut::new();
        match encode(
            &self.pack_publish(Some(1), Bytes::new(), format),
            self.version,
            &mut probe,
        ) {
            Ok(()) => max_packet.saturating_sub(probe.len() + 3),
            // The aggregate topic cannot be encoded: no pack can be sent; every message goes
            // alone (the outbox hands a refused pack's messages over too).
            Err(_) => 0,
        }
    }

    /// Write the pending batch (one `write_all` + flush), bounded by the connection's I/O
    /// timeout.
    pub(super) async fn write_out(&mut self) -> Result<(), UplinkError> {
        if self.out.is_empty() {
            return Ok(());
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(UplinkError::ConnectionLost(
                std::io::ErrorKind::NotConnected.into(),
            ));
        };
        let limit = c.io_timeout();
        write_all(c, &self.out, limit).await?;
        self.out.clear();
        c.last_write = Instant::now();
        Ok(())
    }

    /// Decode what is buffered, or wait for bytes or the keep-alive timer (cancel-safe: the
    /// only awaits are a read into the buffer and the timer).
    pub(super) async fn read_some(
        &mut self,
        feedback: &mut Vec<Feedback>,
    ) -> Result<(), UplinkError> {
        let Some(c) = self.conn.as_mut() else {
            return Err(UplinkError::ConnectionLost(
                std::io::ErrorKind::NotConnected.into(),
            ));
        };
        let mut packets = std::mem::take(&mut self.packets);
        while let Some(packet) = c.decoder.decode(&mut c.rbuf)? {
            packets.push(packet);
        }
        if packets.is_empty() {
            let keep_alive = c.keep_alive;
            let dead_at = c.last_read + keep_alive * 3 / 2;
            let wake_at = if c.ping_outstanding {
                dead_at
            } else {
                dead_at.min(c.last_read.min(c.last_write) + keep_alive)
            };
            if wake_at < c.armed_at || c.timer.is_elapsed() {
                c.timer.as_mut().reset(wake_at.into());
                c.armed_at = wake_at;
            }
            if c.rbuf.capacity() - c.rbuf.len() < READ_CHUNK / 4 {
                c.rbuf.reserve(READ_CHUNK);
            }
            let read = tokio::select! {
                biased;
                r = c.io.read_buf(&mut c.rbuf) => Some(r),
                _ = &mut c.timer, if !keep_alive.is_zero() => None,
            };
            match read {
                Some(Err(e)) => return Err(UplinkError::ConnectionLost(e)),
                Some(Ok(0)) => return Err(UplinkError::ClosedByCloud),
                Some(Ok(_)) => {
                    c.last_read = Instant::now();
                    while let Some(packet) = c.decoder.decode(&mut c.rbuf)? {
                        packets.push(packet);
                    }
                }
                None => {
                    let now = Instant::now();
                    if now >= dead_at {
                        return Err(UplinkError::KeepAliveTimeout(keep_alive * 3 / 2));
                    }
                    if !c.ping_outstanding && now >= c.last_read.min(c.last_write) + keep_alive {
                        encode(&Packet::PingReq, self.version, &mut self.out)?;
                        c.ping_outstanding = true;
                    }
                }
            }
        }
        for packet in packets.drain(..) {
            self.handle(packet, feedback)?;
        }
        self.packets = packets;
        Ok(())
    }

    /// React to one packet from the broker; replies go into the pending batch.
    fn handle(&mut self, packet: Packet, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        match packet {
            Packet::PubAck(ack) => {
                self.ids.remove(&ack.packet_id);
                let id = SendId(u64::from(ack.packet_id));
                feedback.push(if ack.reason < 0x80 {
                    Feedback::Acked(id)
                } else {
                    Feedback::Refused {
                        id,
                        code: ack.reason,
                        class: classify_refusal(ack.reason),
                    }
                });
            }
            Packet::Publish(p) => {
                if p.topic.is_empty() {
                    return Err(UplinkError::Protocol(
                        "PUBLISH with an empty topic (no topic aliases were allowed)".into(),
                    ));
                }
                if p.qos != QoS::AtMostOnce && p.packet_id.is_none() {
                    return Err(UplinkError::Protocol(
                        "QoS>0 PUBLISH without packet id".into(),
                    ));
                }
                self.metrics.downlink_messages.inc();
                // Delivered (and acknowledged) by deliver_downlinks, in arrival order.
                self.downlink_pending.push_back(p);
            }
            Packet::PubRel(r) => encode(
                &Packet::PubComp(ok_response(r.packet_id)),
                self.version,
                &mut self.out,
            )?,
            Packet::SubAck(s) => {
                if self.pending_subscribe == Some(s.packet_id) {
                    self.pending_subscribe = None;
                    for (filter, code) in self.pending_filters.iter().zip(&s.codes) {
                        if *code >= 0x80 {
                            warn!(
                                shard = self.shard,
                                uplink = %self.cfg.name,
                                filter = %filter,
                                code = format_args!("{code:#04x}"),
                                "cloud broker refused a downlink subscription"
                            );
                        }
                    }
                }
            }
            Packet::PingResp => {
                if let Some(c) = self.conn.as_mut() {
                    c.ping_outstanding = false;
                }
            }
            Packet::UnsubAck(u) => {
                if self.pending_unsubscribe == Some(u.packet_id) {
                    self.pending_unsubscribe = None;
                }
            }
            Packet::Disconnect(d) => return Err(UplinkError::DisconnectedByCloud(d.reason)),
            other => {
                return Err(UplinkError::Protocol(format!(
                    "unexpected {} from the broker",
                    other.name()
                )))
            }
        }
        Ok(())
    }

    /// Deliver the cloud PUBLISHes decoded so far, in order; a QoS 1 one is acknowledged to
    /// the cloud (PUBACK into the pending batch) only after the shard accepted it. (We
    /// subscribe with QoS 1, so a conforming broker never sends QoS 2; if it does, PUBREC
    /// follows delivery the same way and a resent duplicate may repeat it.)
    pub(super) async fn deliver_downlinks(&mut self) -> Result<(), UplinkError> {
        while let Some(p) = self.downlink_pending.pop_front() {
            let reply = match (p.qos, p.packet_id) {
                (QoS::AtLeastOnce, Some(id)) => Some(Packet::PubAck(ok_response(id))),
                (QoS::ExactlyOnce, Some(id)) => Some(Packet::PubRec(ok_response(id))),
                _ => None,
            };
            let downlink = self.downlink.clone();
            downlink(crate::sink::CloudMessage {
                topic: p.topic,
                payload: p.payload,
                qos: p.qos,
                properties: p.properties,
            })
            .await;
            if let Some(reply) = reply {
                encode(&reply, self.version, &mut self.out)?;
                self.metrics.downlink_acked.inc();
            }
        }
        Ok(())
    }

    /// SUBSCRIBE to the `receive` filters; `session_present`: the broker kept our session
    /// (MQTT 5 then asks for no retained messages again: Retain Handling 1).
    pub(super) fn encode_subscribe(&mut self, session_present: bool) -> Result<(), UplinkError> {
        let (generation, want) = self.route.receive_if_changed(0).unwrap_or_default();
        self.receive_seen = generation;
        // A kept session still holds what a reload removed while we were away.
        let gone: Vec<String> = self
            .subscribed
            .iter()
            .filter(|f| session_present && !want.contains(f))
            .cloned()
            .collect();
        self.encode_unsubscribe(gone)?;
        self.subscribed = want.clone();
        self.encode_subscribe_filters(want, session_present)
    }

    /// Follow a reloaded `receive` while connected: UNSUBSCRIBE what went, SUBSCRIBE what
    /// came (one change at a time: a later one waits for the broker's answers).
    pub(super) fn follow_receive(&mut self) -> Result<(), UplinkError> {
        if self.conn.is_none()
            || !self.holds_downlink()
            || self.pending_subscribe.is_some()
            || self.pending_unsubscribe.is_some()
        {
            return Ok(());
        }
        let Some((generation, want)) = self.route.receive_if_changed(self.receive_seen) else {
            return Ok(());
        };
        self.receive_seen = generation;
        if want == self.subscribed {
            return Ok(());
        }
        let gone: Vec<String> = self
            .subscribed
            .iter()
            .filter(|f| !want.contains(f))
            .cloned()
            .collect();
        let new: Vec<String> = want
            .iter()
            .filter(|f| !self.subscribed.contains(f))
            .cloned()
            .collect();
        info!(
            shard = self.shard,
            uplink = %self.cfg.name,
            subscribe = ?new,
            unsubscribe = ?gone,
            "downlink subscription follows the reloaded receive filters"
        );
        self.encode_unsubscribe(gone)?;
        self.subscribed = want;
        if new.is_empty() {
            return Ok(());
        }
        self.encode_subscribe_filters(new, true)
    }

    fn encode_unsubscribe(&mut self, filters: Vec<String>) -> Result<(), UplinkError> {
        if filters.is_empty() {
            return Ok(());
        }
        let packet_id = self.alloc_packet_id();
        self.pending_unsubscribe = Some(packet_id);
        let unsub = Packet::Unsubscribe(Unsubscribe {
            packet_id,
            filters: filters.into_iter().map(ByteString::from).collect(),
            properties: Properties::default(),
        });
        encode(&unsub, self.version, &mut self.out)?;
        Ok(())
    }

    /// SUBSCRIBE to `receive` (QoS 1); `session_present`: MQTT 5 asks for no retained
    /// messages again (Retain Handling 1).
    fn encode_subscribe_filters(
        &mut self,
        receive: Vec<String>,
        session_present: bool,
    ) -> Result<(), UplinkError> {
        let packet_id = self.alloc_packet_id();
        self.pending_subscribe = Some(packet_id);
        let v5 = self.version == ProtocolVersion::V5;
        let filters = receive
            .iter()
            .map(|f| SubscribeFilter {
                filter: ByteString::from(f.as_str()),
                options: SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
                    no_local: v5,
                    retain_as_published: false,
                    retain_handling: u8::from(session_present),
                },
            })
            .collect();
        let sub = Packet::Subscribe(Subscribe {
            packet_id,
            filters,
            properties: Properties::default(),
        });
        encode(&sub, self.version, &mut self.out)?;
        self.pending_filters = receive;
        Ok(())
    }

    /// DISCONNECT (after whatever is pending) and close TLS, each bounded in time.
    pub(super) async fn disconnect(&mut self) {
        let packet = Packet::Disconnect(Disconnect {
            reason: 0,
            properties: Properties::default(),
        });
        if encode(&packet, self.version, &mut self.out).is_err() {
            return;
        }
        let Some(c) = self.conn.as_mut() else {
            return;
        };
        if let Err(e) = write_all(c, &self.out, SHUTDOWN_WRITE_TIMEOUT).await {
            debug!(shard = self.shard, uplink = %self.cfg.name, error = %e, "DISCONNECT not delivered");
            return;
        }
        self.out.clear();
        let _ = tokio::time::timeout(SHUTDOWN_WRITE_TIMEOUT, c.io.shutdown()).await;
    }
}

fn ok_response(packet_id: u16) -> PubResponse {
    PubResponse {
        packet_id,
        reason: 0,
        properties: None,
    }
}

async fn write_all(
    c: &mut super::link::Connection,
    bytes: &[u8],
    limit: Duration,
) -> Result<(), UplinkError> {
    let write = async {
        c.io.write_all(bytes).await?;
        c.io.flush().await
    };
    tokio::pin!(write);
    // Usually the socket takes it all at once: no timer (nor its clock read) for that.
    let first = std::future::poll_fn(|cx| match write.as_mut().poll(cx) {
        std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await;
    if let Some(r) = first {
        return r.map_err(UplinkError::ConnectionLost);
    }
    match tokio::time::timeout(limit, write).await {
        Err(_) => Err(UplinkError::WriteTimeout(limit)),
        Ok(Err(e)) => Err(UplinkError::ConnectionLost(e)),
        Ok(Ok(())) => Ok(()),
    }
}
