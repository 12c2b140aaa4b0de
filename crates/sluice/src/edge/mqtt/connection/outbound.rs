//! From the gateway to the device: the session's outbox written out within the device's
//! inflight window, server topic aliases, resending what was in flight at a reconnect, and
//! writing the buffered bytes (a device that stops reading for [`WRITE_TIMEOUT`] is a slow
//! consumer and is closed).
//!
//! Slow readers: at most [`WRITE_AHEAD_BYTES`] of the outbox are encoded into the write
//! buffer at a time, so what a device has not read yet waits in its outbox, charged to the
//! session's and the shard's byte bounds, and what does not fit there is dropped and counted
//! (`sluice_mqtt_queue_refused_total`, `sluice_mqtt_messages_dropped_total`). A write that
//! waits on one device's socket waits in that connection's task only: the shard goes on
//! routing, and other devices' outboxes are filled and written meanwhile.
//!
//! Owns the write side of the connection. Does not own the outbox or the inflight table
//! (the session's, so they survive a reconnect). Invariant: a message too large for the
//! device's Maximum Packet Size is never written (dropped and counted), and an alias it
//! would have introduced is given back.

use bytes::BytesMut;
use bytestring::ByteString;
use sluice_proto::mqtt::{Packet, Publish, QoS};
use std::future::Future;
use std::time::Instant;

use super::{resp, Connection, WRITE_AHEAD_BYTES, WRITE_TIMEOUT};
use crate::edge::mqtt::session::OutStage;
use crate::message::OutMessage;
use crate::shard::metrics::{CloseReason, DropReason};

/// Memory: the write buffer capacity kept after a write (enough for the acknowledgements
/// and PINGRESPs of one read); a larger buffer is freed once written, so an idle connection
/// holds at most this.
const WRITE_BUFFER_KEPT: usize = 256;

impl Connection {
    /// Resend QoS 1/2 messages the device had not acknowledged when it last disconnected.
    pub(super) fn resend_inflight(&mut self) {
        let inflight: Vec<(u16, OutMessage, OutStage)> = self
            .session
            .state
            .borrow()
            .inflight
            .iter()
            .map(|(id, (m, s))| (*id, m.clone(), *s))
            .collect();
        for (id, msg, stage) in inflight {
            match stage {
                OutStage::AwaitingAck => {
                    let p = publish_packet(&msg, Some(id), true);
                    self.write(Packet::Publish(p));
                }
                OutStage::AwaitingComp => self.write(Packet::PubRel(resp(id))),
            }
        }
    }

    /// Move queued messages for the device into the write buffer, within its inflight window
    /// and up to [`WRITE_AHEAD_BYTES`]. Returns whether it stopped at that bound with a
    /// message still waiting (write, then take again).
    pub(super) fn take_outbox(&mut self) -> bool {
        if !self.is_current() {
            return false;
        }
        let window = (self
            .ctx
            .config
            .mqtt
            .max_inflight_out
            .min(self.device_receive_max))
        .max(1) as usize;
        // Read the clock only when something is queued: this runs on every turn of the
        // connection's loop, twice per message it publishes.
        let mut now = None;
        loop {
            let (msg, id) = {
                let mut st = self.session.state.borrow_mut();
                let Some(front) = st.outbox.front() else {
                    break;
                };
                if self.wbuf.len() >= WRITE_AHEAD_BYTES {
                    return true;
                }
                if front.is_expired(*now.get_or_insert_with(Instant::now)) {
                    // Leaves the session: its queued bytes go back (input bounds).
                    if let Some(expired) = st.pop_outbox() {
                        if expired.qos != QoS::AtMostOnce {
                            st.queued.release(&expired);
                        }
                    }
                    self.ctx.metrics.count_drop(DropReason::Expired);
                    continue;
                }
                if front.qos != QoS::AtMostOnce && st.inflight.len() >= window {
                    break;
                }
                if front.qos == QoS::AtMostOnce {
                    let Some(msg) = st.pop_outbox() else {
                        break;
                    };
                    (msg, None)
                } else {
                    // The id first, so a message that cannot have one stays queued.
                    let Some(id) = st.allocate_packet_id() else {
                        break;
                    };
                    let Some(msg) = st.send_front(id) else {
                        break;
                    };
                    (msg, Some(id))
                }
            };
            let mut packet = publish_packet(&msg, id, false);
            let new_alias = self.apply_out_alias(&mut packet);
            let before = self.wbuf.len();
            self.write(Packet::Publish(packet));
            let size = self.wbuf.len() - before;
            if self
                .device_max_packet
                .is_some_and(|max| size > max as usize)
            {
                self.wbuf.truncate(before);
                if let Some(alias) = new_alias {
                    // Never sent, so the device never learned it.
                    self.out_aliases.remove(&msg.topic);
                    self.out_alias_next = alias;
                }
                if let Some(id) = id {
                    self.session.state.borrow_mut().remove_inflight(id);
                }
                self.ctx.metrics.count_drop(DropReason::TooLargeForDevice);
                continue;
            }
            self.ctx.metrics.messages_delivered.inc();
        }
        false
    }

    /// Server topic aliases (MQTT 5 §3.3.2.3.4): the first PUBLISH of a topic to the device
    /// carries the topic and a new alias while aliases are left (the device's Topic Alias
    /// Maximum, capped by our own `topic_alias_maximum`); later ones carry only the alias.
    /// Aliases are never reassigned. Returns the alias this packet newly assigned.
    fn apply_out_alias(&mut self, p: &mut Publish) -> Option<u16> {
        if self.out_alias_max == 0 {
            return None;
        }
        let (alias, new) = match self.out_aliases.get(&p.topic) {
            Some(&a) => (a, false),
            None if self.out_alias_next <= self.out_alias_max => {
                let a = self.out_alias_next;
                self.out_alias_next += 1;
                self.out_aliases.insert(p.topic.clone(), a);
                (a, true)
            }
            None => return None,
        };
        let mut props = p.properties.take().unwrap_or_default();
        props.topic_alias = Some(alias);
        p.properties = Some(props);
        if !new {
            p.topic = ByteString::from_static("");
        }
        new.then_some(alias)
    }

    pub(super) async fn flush(&mut self) -> Result<(), CloseReason> {
        if self.wbuf.is_empty() {
            return Ok(());
        }
        let n = self.wbuf.len();
        let written = {
            let write = self.wr.write_all(&self.wbuf);
            tokio::pin!(write);
            // Usually the socket takes it all at once (a PUBACK): no timer, nor its clock
            // read, for that; only a write that has to wait is bounded by WRITE_TIMEOUT.
            let first = std::future::poll_fn(|cx| match write.as_mut().poll(cx) {
                std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
                std::task::Poll::Pending => std::task::Poll::Ready(None),
            })
            .await;
            match first {
                Some(r) => Ok(r),
                None => tokio::time::timeout(WRITE_TIMEOUT, write).await,
            }
        };
        match written {
            Ok(Ok(())) => {
                self.ctx.metrics.bytes_sent.add(n as u64);
                self.wbuf.clear();
                if self.wbuf.capacity() > WRITE_BUFFER_KEPT {
                    // Memory: only an acknowledgement's or a PINGRESP's few bytes are kept
                    // (no allocation per PUBACK); anything larger goes once written.
                    self.wbuf = BytesMut::new();
                }
                Ok(())
            }
            Ok(Err(error)) => {
                tracing::debug!(client_id = %self.client_id, %error, "device write failed");
                Err(CloseReason::IoError)
            }
            Err(_) => {
                tracing::warn!(client_id = %self.client_id, peer = %self.peer, "device stopped reading for 30s; closing (slow consumer)");
                Err(CloseReason::SlowConsumer)
            }
        }
    }
}

fn publish_packet(msg: &OutMessage, packet_id: Option<u16>, dup: bool) -> Publish {
    Publish {
        dup,
        qos: msg.qos,
        retain: msg.retain,
        topic: msg.topic.clone(),
        packet_id,
        properties: msg.properties_now(Instant::now()),
        payload: msg.payload.clone(),
    }
}
