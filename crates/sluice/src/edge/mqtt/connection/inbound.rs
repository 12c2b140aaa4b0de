//! From the device to the router: a device's PUBLISH checked (topic aliases resolved,
//! topic validity and limits), turned into a [`DeviceMessage`] with an ack token when the
//! device expects an acknowledgement, and handed to the router with the device's priority;
//! and the acknowledgements back to the device, in the order it sent its messages, as the
//! tokens complete.
//!
//! A PUBLISH the ACL refuses (`control/acl/`) is acknowledged in its turn — MQTT 5 with
//! 0x87 Not authorized (PUBACK, or a PUBREC that ends the exchange), 3.1.1 normally, since
//! 3.1.1 has no way to refuse a PUBLISH — and never routed; a refused QoS 0 message is
//! dropped. Over the device's `[limits]` publish rate, a QoS 0 message is dropped and a
//! QoS 1/2 one is routed, after which the device is not read until its tokens are back.
//!
//! Owns the receive side of QoS 1/2 (the pending acknowledgements, QoS 2 duplicates never
//! forwarded twice, the Receive Maximum). Does not own routing (`crate::shard::router`).

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use sluice_proto::mqtt::{reason, topic, Packet, ProtocolVersion, PubResponse, Publish, QoS};
use std::future::Future;
use std::time::{Duration, Instant};

use super::{resp, AckKind, Close, Connection, PendingAck, Subject};
use crate::message::ack::AckToken;
use crate::message::DeviceMessage;
use crate::shard::metrics::CloseReason;
use crate::shard::router as route;

impl Connection {
    pub(super) async fn on_publish(&mut self, mut p: Publish) -> Result<(), Close> {
        let received_at = self.last_read;
        // Topic aliases (MQTT 5): resolve, then strip — an alias is per connection.
        if let Some(alias) = p.properties.as_ref().and_then(|pr| pr.topic_alias) {
            if alias == 0 || alias > self.ctx.config.mqtt.topic_alias_maximum {
                tracing::warn!(client_id = %self.client_id, alias, "device used a topic alias out of range; closing");
                return Err(Close(
                    CloseReason::ProtocolError,
                    Some(reason::TOPIC_ALIAS_INVALID),
                ));
            }
            if p.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(t) => p.topic = t.clone(),
                    None => {
                        tracing::warn!(client_id = %self.client_id, alias, "device used an unknown topic alias; closing");
                        return Err(Close(
                            CloseReason::ProtocolError,
                            Some(reason::PROTOCOL_ERROR),
                        ));
                    }
                }
            } else {
                self.aliases.insert(alias, p.topic.clone());
            }
            if let Some(props) = p.properties.as_mut() {
                props.topic_alias = None;
                if props.is_empty() {
                    p.properties = None;
                }
            }
        }
        // Subscription Identifiers are the server's to set, per subscriber (MQTT 5 §3.3.4).
        if let Some(props) = p
            .properties
            .as_mut()
            .filter(|pr| !pr.subscription_identifiers.is_empty())
        {
            props.subscription_identifiers.clear();
            if props.is_empty() {
                p.properties = None;
            }
        }
        if !topic::valid_topic_name(&p.topic) {
            tracing::warn!(client_id = %self.client_id, topic = %p.topic, "device published to an invalid topic name; closing");
            return Err(Close(
                CloseReason::ProtocolError,
                Some(reason::TOPIC_NAME_INVALID),
            ));
        }
        if let Err(error) =
            crate::shard::limits::TopicLimits::new(&self.ctx.config.mqtt).check(&p.topic)
        {
            tracing::warn!(client_id = %self.client_id, peer = %self.peer, %error, "device published to a topic beyond the gateway's limits; closing");
            return Err(Close(
                CloseReason::TopicLimit,
                Some(reason::TOPIC_NAME_INVALID),
            ));
        }
        // [acl]: a refused message is acknowledged (MQTT 5 with 0x87 Not authorized; 3.1.1,
        // which cannot say no, normally) and dropped; QoS 0 is just dropped.
        let allowed = self.acl.allows_publish(
            &self.ctx.acl,
            &Subject {
                client_id: &self.client_id,
                username: self.username.as_deref(),
            },
            &p.topic,
        );
        // [limits]: a QoS 0 message over the device's rate is dropped.
        if allowed && p.qos == QoS::AtMostOnce {
            if let Some(rate) = self.rate.as_mut() {
                if !rate.try_send(p.payload.len(), Instant::now()) {
                    self.ctx.limits.hit(
                        crate::control::limits::Limited::PublishDropped,
                        &self.client_id,
                    );
                    return Ok(());
                }
            }
        }
        self.ctx.metrics.messages_received.inc();
        // Own the bytes: a zero-copy slice would pin its whole read buffer for as long as the
        // message waits for the cloud, making real memory several times what the uplink's
        // byte bound counts. A copy of at most one packet keeps memory equal to the bound.
        // Topic and payload share one allocation, shared from the start: the router and the
        // sinks clone both, which would otherwise allocate each one's shared header on the
        // first clone (four allocations per message instead of two).
        (p.topic, p.payload) = own_topic_and_payload(&p.topic, &p.payload);
        let ack = match (p.qos, p.packet_id) {
            (QoS::AtMostOnce, _) => None,
            (qos, Some(id)) => {
                let awaiting_rel = {
                    let st = self.session.state.borrow();
                    if qos == QoS::ExactlyOnce && st.awaiting_rel.contains(id) {
                        None
                    } else {
                        Some(st.awaiting_rel.len())
                    }
                };
                let Some(awaiting_rel) = awaiting_rel else {
                    // A resent QoS 2 message already PUBREC'd (on this connection or one
                    // before it): acknowledge again, never forward twice.
                    self.write(Packet::PubRec(resp(id)));
                    return Ok(());
                };
                if qos == QoS::ExactlyOnce
                    && self
                        .pending
                        .iter()
                        .any(|a| a.packet_id == id && a.kind == AckKind::PubRec)
                {
                    // Resent before its PUBREC on this connection: the PUBREC is coming.
                    return Ok(());
                }
                // MQTT 5 counts a QoS 2 message against the Receive Maximum until PUBCOMP.
                if self.version == ProtocolVersion::V5
                    && self.pending.len() + awaiting_rel
                        >= self.ctx.config.mqtt.receive_maximum as usize
                {
                    tracing::warn!(client_id = %self.client_id, "device exceeded the receive maximum; closing");
                    return Err(Close(
                        CloseReason::ProtocolError,
                        Some(reason::RECEIVE_MAXIMUM_EXCEEDED),
                    ));
                }
                let kind = if qos == QoS::AtLeastOnce {
                    AckKind::PubAck
                } else {
                    AckKind::PubRec
                };
                self.pending.push_back(PendingAck {
                    packet_id: id,
                    kind,
                    done: false,
                });
                Some(AckToken::new(&self.acks, id))
            }
            (_, None) => {
                return Err(Close(
                    CloseReason::ProtocolError,
                    Some(reason::PROTOCOL_ERROR),
                ))
            }
        };
        if !allowed {
            if let Some(token) = ack {
                token.complete_with(reason::NOT_AUTHORIZED);
            }
            return Ok(());
        }
        // [limits]: QoS 1/2 over the device's rate: routed, then the device is not read
        // until its tokens are back.
        let pause = match (p.qos, self.rate.as_mut()) {
            (QoS::AtMostOnce, _) | (_, None) => Duration::ZERO,
            (_, Some(rate)) => rate.send(p.payload.len(), Instant::now()),
        };
        let msg = DeviceMessage {
            device: self.client_id.clone(),
            topic: p.topic,
            payload: p.payload,
            qos: p.qos,
            retain: p.retain,
            properties: p.properties,
            received_at,
            ack,
        };
        let ctx = self.ctx.clone();
        {
            // A reload may have published another priority table since the last message.
            let rules = ctx.rules.load();
            if rules.generation != self.priority_generation {
                self.priority = rules.priority.device(&self.client_id);
                self.priority_generation = rules.generation;
            }
        }
        let publish = route::publish(&ctx, Box::new(msg), self.priority);
        tokio::pin!(publish);
        // Usually the router takes the message at once: then the device was never left
        // unread, and nothing below (another clock read, the select) is needed.
        let done =
            std::future::poll_fn(|cx| std::task::Poll::Ready(publish.as_mut().poll(cx).is_ready()))
                .await;
        if done && pause.is_zero() {
            return Ok(());
        }
        if !done {
            loop {
                tokio::select! {
                    biased;
                    () = &mut publish => break,
                    // While this publish waits for room (a full uplink queue or spool), earlier
                    // messages may complete (a spool commit, a cloud ack): acknowledge them now,
                    // so a waiting publish never holds back PUBACKs the device is owed. The main
                    // loop re-checks everything this wake-up may also have been for.
                    _ = self.acks.notify.notified() => self.acks_while_withheld().await?,
                    // Meanwhile the device is read ahead, for its PINGREQs (module docs of
                    // `connection`); what else it sent is handled after this publish, in order.
                    read = self.rd.read_more(&mut self.rbuf), if self.may_read_ahead() => {
                        self.read_ahead_while_withheld(read).await?
                    }
                }
            }
        }
        if !pause.is_zero() {
            self.pause_for_rate(pause).await?;
        }
        // Reads stopped while this publish waited for room (a full queue or spool) or for
        // its rate: that silence was the gateway's, not the device's.
        self.last_read = Instant::now();
        Ok(())
    }

    /// While a publish is withheld: acknowledge what the cloud completed meanwhile.
    async fn acks_while_withheld(&mut self) -> Result<(), Close> {
        self.on_cloud_acks();
        self.flush().await.map_err(|reason| Close(reason, None))
    }

    /// While a publish is withheld: take what the read-ahead brought (its PINGREQs are
    /// answered) and write the answers.
    async fn read_ahead_while_withheld(
        &mut self,
        read: std::io::Result<usize>,
    ) -> Result<(), Close> {
        self.on_read_ahead(read)?;
        self.flush().await.map_err(|reason| Close(reason, None))
    }

    /// Stop reading the device for `pause` (its `[limits]` publish rate), acknowledging
    /// what completes meanwhile.
    async fn pause_for_rate(&mut self, pause: Duration) -> Result<(), Close> {
        self.ctx.limits.hit(
            crate::control::limits::Limited::PublishThrottled,
            &self.client_id,
        );
        let until = tokio::time::sleep(pause);
        tokio::pin!(until);
        loop {
            tokio::select! {
                biased;
                () = &mut until => return Ok(()),
                _ = self.acks.notify.notified() => self.acks_while_withheld().await?,
                read = self.rd.read_more(&mut self.rbuf), if self.may_read_ahead() => {
                    self.read_ahead_while_withheld(read).await?
                }
            }
        }
    }

    /// The cloud acknowledged some of this device's messages: acknowledge them to the device,
    /// in the order the device sent them.
    pub(super) fn on_cloud_acks(&mut self) {
        let mut ready = std::mem::take(&mut self.ack_scratch);
        self.acks.drain_into(&mut ready);
        if ready.is_empty() {
            self.ack_scratch = ready;
            return;
        }
        for id in ready.drain(..) {
            if let Some(a) = self
                .pending
                .iter_mut()
                .find(|a| a.packet_id == id && !a.done)
            {
                a.done = true;
            }
        }
        while self.pending.front().is_some_and(|a| a.done) {
            let Some(a) = self.pending.pop_front() else {
                break;
            };
            match a.kind {
                AckKind::PubAck => self.write(Packet::PubAck(PubResponse {
                    reason: self.acks.take_reason(a.packet_id, self.version),
                    ..resp(a.packet_id)
                })),
                AckKind::PubRec => {
                    let code = self.acks.take_reason(a.packet_id, self.version);
                    // A PUBREC with a failure code ends the exchange (MQTT 5 §4.3.3).
                    if code < 0x80 {
                        let bound = self.ctx.config.mqtt.receive_maximum as usize;
                        self.session
                            .state
                            .borrow_mut()
                            .await_rel(a.packet_id, bound);
                    }
                    self.write(Packet::PubRec(PubResponse {
                        reason: code,
                        ..resp(a.packet_id)
                    }));
                }
            }
        }
        self.ack_scratch = ready;
    }
}

/// `topic` and `payload` copied into one buffer of exactly their size, split into two views
/// of it (one allocation plus its shared header; clones only count references). Owning the
/// bytes keeps a message from pinning its read buffer (see [`Connection::on_publish`]); the
/// router gives holders that may keep the topic longer than the payload (subscribers, the
/// retained store) a copy of their own (`shard::router`).
fn own_topic_and_payload(topic: &ByteString, payload: &Bytes) -> (ByteString, Bytes) {
    let mut buf = BytesMut::with_capacity(topic.len() + payload.len());
    buf.extend_from_slice(topic.as_bytes());
    buf.extend_from_slice(payload);
    let topic_bytes = buf.split_to(topic.len()).freeze();
    // Invariant: these are a `ByteString`'s bytes, so valid UTF-8; the fallback never runs.
    let topic = ByteString::try_from(topic_bytes).unwrap_or_else(|_| topic.clone());
    (topic, buf.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_and_payload_are_owned_copies_of_exactly_their_bytes() {
        let read_buffer = Bytes::from(vec![b'x'; 4096]);
        let topic = ByteString::from("sensors/a/temp");
        let payload = read_buffer.slice(100..160);
        let (t, p) = own_topic_and_payload(&topic, &payload);
        assert_eq!(t, topic);
        assert_eq!(p, payload);
        assert_ne!(
            p.as_ptr(),
            payload.as_ptr(),
            "a copy, not a view of the read buffer"
        );
        let (t, p) = own_topic_and_payload(&ByteString::from(""), &Bytes::new());
        assert!(t.is_empty() && p.is_empty());
    }
}
