//! A device's SUBSCRIBE and UNSUBSCRIBE: filters checked (validity, the gateway's limits and
//! quotas), handed to the router's subscription bookkeeping, answered with SUBACK/UNSUBACK,
//! and the matching retained messages queued to the session.
//!
//! A filter the ACL refuses (`control/acl/`: an allow rule must cover it) gets SUBACK 0x87
//! (3.1.1: 0x80) and is not subscribed.
//!
//! Owns only the protocol side; what a subscription means for routing is the router's.

use bytestring::ByteString;
use sluice_proto::mqtt::{
    reason, topic, Packet, Properties, ProtocolVersion, QoS, SubAck, Subscribe, UnsubAck,
    Unsubscribe,
};

use super::{Close, Connection, Subject};
use crate::message::OutMessage;
use crate::shard::metrics::DropReason;
use crate::shard::router as route;

impl Connection {
    pub(super) async fn on_subscribe(&mut self, s: Subscribe) -> Result<(), Close> {
        let mut codes = Vec::with_capacity(s.filters.len());
        let mut accepted = Vec::new();
        for f in &s.filters {
            let shared = f.filter.starts_with("$share/");
            // (No Local on a shared subscription is already refused by the decoder.)
            let valid = if shared {
                topic::valid_shared_subscription(&f.filter)
            } else {
                topic::valid_topic_filter(&f.filter)
            };
            if !valid
                || !crate::shard::limits::filter_allowed(&self.ctx, &self.client_id, &f.filter)
            {
                codes.push(match self.version {
                    ProtocolVersion::V5 => reason::TOPIC_FILTER_INVALID,
                    ProtocolVersion::V311 => reason::UNSPECIFIED_ERROR,
                });
            } else if !self.acl.allows_subscribe(
                &self.ctx.acl,
                &Subject {
                    client_id: &self.client_id,
                    username: self.username.as_deref(),
                },
                &f.filter,
            ) {
                // [acl]: not authorized (3.1.1 has only 0x80 Failure).
                codes.push(match self.version {
                    ProtocolVersion::V5 => reason::NOT_AUTHORIZED,
                    ProtocolVersion::V311 => reason::UNSPECIFIED_ERROR,
                });
            } else if !crate::shard::limits::subscription_allowed(
                &self.ctx,
                &self.session,
                &f.filter,
                accepted.iter().map(|a: &(ByteString, _, _)| &*a.0),
            ) {
                codes.push(crate::shard::limits::quota_exceeded_code(self.version));
            } else {
                codes.push(f.options.qos as u8);
                accepted.push((f.filter.clone(), f.options, true));
            }
        }
        let sub_id = s
            .properties
            .subscription_identifiers
            .first()
            .copied()
            .unwrap_or(0);
        let retained = route::subscribe(&self.ctx, &self.session, &accepted, sub_id).await;
        self.write(Packet::SubAck(SubAck {
            packet_id: s.packet_id,
            codes,
            properties: Properties::default(),
        }));
        for m in retained {
            let granted = accepted
                .iter()
                .filter(|(f, _, _)| topic::matches(f, &m.topic))
                .map(|(_, o, _)| o.qos)
                .max()
                .unwrap_or(QoS::AtMostOnce);
            let properties = if sub_id == 0 {
                m.properties
            } else {
                let mut p = m.properties.unwrap_or_default();
                p.subscription_identifiers = vec![sub_id];
                Some(p)
            };
            let msg = OutMessage {
                topic: m.topic,
                payload: m.payload,
                qos: m.qos.min(granted),
                retain: true,
                properties,
                expires_at: m.expires_at,
            };
            if self.session.enqueue(msg).is_err() {
                self.ctx.metrics.count_drop(DropReason::SessionQueueFull);
            }
        }
        Ok(())
    }

    pub(super) async fn on_unsubscribe(&mut self, u: Unsubscribe) -> Result<(), Close> {
        let mut codes = Vec::with_capacity(u.filters.len());
        for f in &u.filters {
            let existed = route::unsubscribe(&self.ctx, &self.session, f).await;
            codes.push(if existed {
                reason::SUCCESS
            } else {
                reason::NO_SUBSCRIPTION_EXISTED
            });
        }
        if self.version == ProtocolVersion::V311 {
            codes.clear();
        }
        self.write(Packet::UnsubAck(UnsubAck {
            packet_id: u.packet_id,
            codes,
            properties: Properties::default(),
        }));
        Ok(())
    }
}
