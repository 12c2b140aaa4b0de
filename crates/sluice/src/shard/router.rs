//! Where a device's message goes: local subscribers, other shards' subscribers, the retained
//! store and the sinks — and the subscription bookkeeping that decides it.
//!
//! Owns: routing one [`DeviceMessage`] (whatever edge produced it; the router never sees a
//! protocol packet) and the shard's subscription tables. Does not own: decoding or
//! answering devices (`crate::edge`), or what a sink does with a message it takes (its lane
//! queue, spool, overflow policy: `crate::sink::Sink::offer`).
//!
//! A device's message is delivered to matching sessions on this shard, sent once to every
//! other shard whose snapshot entry matches (that shard matches its own sessions), given to
//! one member of each matching shared subscription (one shard picked round robin from the
//! snapshot, then one member there), sent to the control plane if it is retained, and offered
//! to every sink, which takes it if its `forward` filters match. Local and retained delivery
//! carry the message's MQTT 5 properties. The device's acknowledgement waits for every sink
//! that took the message (its cloud acknowledgement, or its spool's group commit with
//! `ack = "spool"`; see `crate::message::ack`); local and cross-shard delivery do not delay it.
//! With a spool, a normal-lane message is appended to the sink's spool on this shard, its
//! record encoded once for all sinks; high-lane messages never go through the spool.

use std::rc::Rc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use sluice_proto::mqtt::{topic, Properties, QoS, SubscriptionOptions};
use tokio::sync::{mpsc, oneshot};

use super::metrics::{DropReason, ShardMetrics};
use super::subscriber::{is, LocalSubscriber};
use super::{LocalSub, Routed, ShardCmd, ShardContext};
use crate::control::priority::Priority;
use crate::control::{ControlCmd, RetainedMessage};
use crate::message::DeviceMessage;
use crate::message::{OutMessage, QueueRefusal};
use crate::sink::{Offer, OfferCounters, OfferDrop};

/// Route a device's message: local subscribers, other shards, shared subscriptions, the
/// retained store, then every sink (each takes it if its forward filters match). Waits
/// (back-pressure) only where a bound is reached for a QoS 1/2 message; QoS 0 messages are
/// dropped and counted instead. `device` is the publishing device's own priority; with the
/// topic it picks each sink's lane. The router's own share of `msg.ack` completes after every
/// sink was asked, so the device is answered once every sink is done with the message.
/// `msg` comes boxed: this future lives inside every device connection's task while a publish
/// waits, and a connection's task is as large as its largest state — an inline message would
/// cost each idle connection its size (measured: 7.78 vs 7.58 KiB per idle connection).
pub async fn publish(ctx: &Rc<ShardContext>, msg: Box<DeviceMessage>, device: Priority) {
    publish_to(ctx, msg, device, true).await
}

/// Route a function's reply or dead letter (`crate::sink::http`): like a device's message,
/// but never offered to a function's sink, so functions cannot feed each other in a loop.
pub async fn publish_from_function(ctx: &Rc<ShardContext>, msg: DeviceMessage) {
    let device = ctx.rules.device(&msg.device);
    publish_to(ctx, Box::new(msg), device, false).await
}

async fn publish_to(
    ctx: &Rc<ShardContext>,
    msg: Box<DeviceMessage>,
    device: Priority,
    to_functions: bool,
) {
    // Most gateways forward to the cloud and have no device subscribers: then the message
    // is not cloned for a fan-out that would find nobody.
    if may_have_subscribers(ctx) {
        let routed = Routed {
            origin: msg.device.clone(),
            topic: own_topic(&msg.topic, &msg.payload),
            payload: msg.payload.clone(),
            qos: msg.qos,
            retain: msg.retain,
            properties: msg.properties.clone(),
        };
        deliver_local(ctx, &routed);
        deliver_other_shards(ctx, &routed).await;
        deliver_shared(ctx, &routed).await;
    }
    if msg.retain {
        let retained = RetainedMessage {
            topic: own_topic(&msg.topic, &msg.payload),
            payload: msg.payload.clone(),
            qos: msg.qos,
            properties: msg.properties.clone(),
            expires_at: expiry_of(msg.properties.as_deref()),
        };
        if Box::pin(ctx.control.send(ControlCmd::Retain(retained)))
            .await
            .is_err()
        {
            tracing::debug!("control plane gone; retained message not stored");
        }
    }
    // The rules current now; held while every sink is offered the message (a reload in the
    // meantime applies from the next message).
    let rules = ctx.rules.load();
    let offer = Offer::new(&msg, device, &rules.priority, &*ctx.metrics);
    let sinks = ctx.sinks();
    for sink in sinks.iter() {
        if to_functions || sink.overflow.is_none() {
            sink.offer(&offer).await;
        }
    }
    drop(offer);
    drop(rules);
    if let Some(ack) = msg.ack {
        ack.complete();
    }
}

/// The topic for a holder that may outlive the payload: its own copy when it shares the
/// payload's buffer (as an MQTT device's message does, see `edge::mqtt::connection::inbound`),
/// else a clone. A topic kept as a map key — a subscriber's topic alias, the retained store,
/// which keeps the first key of a topic when the message is replaced — would otherwise keep
/// a whole payload alive that no bound counts.
fn own_topic(topic: &ByteString, payload: &bytes::Bytes) -> ByteString {
    let t = topic.as_bytes();
    if !t.is_empty() && t.as_ptr_range().end == payload.as_ptr() {
        ByteString::from(&**topic)
    } else {
        topic.clone()
    }
}

/// Whether any subscription could match: a local one, a shared one anywhere, or (with
/// several shards) another shard's. `false` means local, cross-shard and shared delivery
/// would each find nobody.
fn may_have_subscribers(ctx: &ShardContext) -> bool {
    if !ctx.subs.borrow().is_empty() {
        return true;
    }
    let snapshot = ctx.snapshot.load();
    !snapshot.shared.is_empty()
        || (ctx.mailboxes.len() >= 2 && !(snapshot.trie.is_empty() && snapshot.pending.is_empty()))
}

/// Sinks count into the shard's metrics.
impl OfferCounters for ShardMetrics {
    fn forwarded(&self) {
        self.messages_forwarded.inc();
    }
    fn dropped(&self, why: OfferDrop) {
        self.count_drop(match why {
            OfferDrop::QueueFull => DropReason::UplinkQueueFull,
            OfferDrop::SpoolFull => DropReason::SpoolFull,
            OfferDrop::SpoolStalled => DropReason::SpoolStalled,
        });
    }
}

async fn deliver_other_shards(ctx: &Rc<ShardContext>, routed: &Routed) {
    if ctx.mailboxes.len() < 2 {
        return;
    }
    let snapshot = ctx.snapshot.load();
    if snapshot.trie.is_empty() && snapshot.pending.is_empty() {
        return;
    }
    let mut targets: u128 = 0;
    let mut extra: Vec<usize> = Vec::new();
    snapshot.trie.for_each_match(&routed.topic, |&shard| {
        let shard = shard as usize;
        if shard == ctx.id {
            return;
        }
        if shard < 128 {
            targets |= 1 << shard;
        } else if !extra.contains(&shard) {
            extra.push(shard);
        }
    });
    for (filter, shard) in &snapshot.pending {
        let shard = *shard as usize;
        if shard != ctx.id && topic::matches(filter, &routed.topic) {
            if shard < 128 {
                targets |= 1 << shard;
            } else if !extra.contains(&shard) {
                extra.push(shard);
            }
        }
    }
    drop(snapshot);
    let shards = (0..128usize)
        .filter(|s| targets & (1 << s) != 0)
        .chain(extra);
    for shard in shards {
        send_to_shard(ctx, shard, routed.qos, ShardCmd::Deliver(routed.clone())).await;
    }
}

/// Hand `cmd` (a message of QoS `qos`) to another shard's mailbox: QoS 0 is dropped and
/// counted when the mailbox is full; QoS 1/2 waits for room (back-pressure).
async fn send_to_shard(ctx: &ShardContext, shard: usize, qos: QoS, cmd: ShardCmd) {
    let Some(mailbox) = ctx.mailboxes.get(shard) else {
        return;
    };
    ctx.metrics.cross_shard_sent.inc();
    match mailbox.try_send(cmd) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) if qos == QoS::AtMostOnce => {
            ctx.metrics.count_drop(DropReason::MailboxFull);
        }
        Err(mpsc::error::TrySendError::Full(cmd)) => {
            // Boxed, as this is the rare case.
            if Box::pin(mailbox.send(cmd)).await.is_err() {
                tracing::debug!(shard, "shard mailbox closed");
            }
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            tracing::debug!(shard, "shard mailbox closed")
        }
    }
}

/// Shared subscriptions (`$share/{group}/{filter}`, MQTT 5 §4.8.2): each matching group gets
/// the message once. The snapshot lists, per group, the shards with members; the publishing
/// shard picks one of them round robin and that shard picks one of its members
/// ([`deliver_shared_member`]). Another shard is reached with `ShardCmd::DeliverShared`, under
/// the same mailbox policy as `Deliver` (QoS 0 dropped and counted when full, QoS 1/2 waits).
async fn deliver_shared(ctx: &Rc<ShardContext>, routed: &Routed) {
    let snapshot = ctx.snapshot.load();
    if snapshot.shared.is_empty() {
        return;
    }
    let mut picks: Vec<(usize, ByteString)> = Vec::new();
    snapshot.shared.for_each_match(&routed.topic, |group| {
        if group.shards.is_empty() {
            return;
        }
        let turn = ctx.share_turn.get();
        ctx.share_turn.set(turn.wrapping_add(1));
        let shard = group.shards[turn % group.shards.len()] as usize;
        picks.push((shard, group.key.clone()));
    });
    drop(snapshot);
    for (shard, key) in picks {
        if shard == ctx.id {
            deliver_shared_member(ctx, routed, &key);
            continue;
        }
        let cmd = ShardCmd::DeliverShared(routed.clone(), key);
        send_to_shard(ctx, shard, routed.qos, cmd).await;
    }
}

/// Deliver to one local member of shared subscription `key`, round robin, preferring members
/// whose device is connected. If the group has no member here any more (it left after the
/// publisher read the snapshot), the message is dropped and counted (`shared_member_gone`).
pub fn deliver_shared_member(ctx: &ShardContext, routed: &Routed, key: &ByteString) {
    let picked = {
        let mut shared = ctx.shared.borrow_mut();
        let Some(group) = shared.get_mut(key).filter(|g| !g.members.is_empty()) else {
            drop(shared);
            ctx.metrics.count_drop(DropReason::SharedMemberGone);
            return;
        };
        let n = group.members.len();
        let start = group.next % n;
        let idx = (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| group.members[i].subscriber.is_connected())
            .unwrap_or(start);
        group.next = idx + 1;
        group.members[idx].clone()
    };
    let properties = if picked.sub_id == 0 {
        routed.properties.clone()
    } else {
        let mut p = routed.properties.clone().unwrap_or_default();
        p.subscription_identifiers = vec![picked.sub_id];
        Some(p)
    };
    let msg = OutMessage {
        topic: routed.topic.clone(),
        payload: routed.payload.clone(),
        qos: routed.qos.min(picked.options.qos),
        retain: routed.retain && picked.options.retain_as_published,
        properties,
        expires_at: expiry_of(routed.properties.as_deref()),
    };
    match picked.subscriber.deliver(ctx, msg) {
        Ok(()) => {}
        Err(QueueRefusal::Full) => ctx.metrics.count_drop(DropReason::SessionQueueFull),
        Err(QueueRefusal::Offline) => {}
    }
}

/// One subscriber reached by a local fan-out, with what its matching subscriptions add up to.
struct Hit {
    subscriber: Rc<dyn LocalSubscriber>,
    qos: QoS,
    retain_as_published: bool,
    /// Subscription Identifiers of every matching subscription that has one.
    ids: Vec<u32>,
}

/// Deliver to the matching subscribers on this shard: each once, at the highest QoS of its
/// matching subscriptions, with the Subscription Identifiers of all of them. Cost: one trie
/// walk plus O(1) per matching subscription — a subscriber is recognised as already hit by
/// the delivery's stamp on it (`LocalSubscriber::delivery_stamp`), not by searching the hits.
pub fn deliver_local(ctx: &ShardContext, routed: &Routed) {
    let stamp = ctx.delivery_seq.get() + 1;
    ctx.delivery_seq.set(stamp);
    let mut hits: Vec<Hit> = Vec::new();
    {
        let subs = ctx.subs.borrow();
        subs.for_each_match(&routed.topic, |sub: &LocalSub| {
            if sub.options.no_local && *sub.subscriber.subscriber_id() == routed.origin {
                return;
            }
            let mark = sub.subscriber.delivery_stamp();
            let hit = if mark.mark.get() == stamp {
                match hits.get_mut(mark.slot.get()) {
                    Some(hit) => hit,
                    None => return, // invariant: the slot was set with the stamp
                }
            } else {
                mark.mark.set(stamp);
                mark.slot.set(hits.len());
                hits.push(Hit {
                    subscriber: sub.subscriber.clone(),
                    qos: QoS::AtMostOnce,
                    retain_as_published: false,
                    ids: Vec::new(),
                });
                let last = hits.len() - 1;
                &mut hits[last]
            };
            hit.qos = hit.qos.max(sub.options.qos);
            hit.retain_as_published |= sub.options.retain_as_published;
            if sub.sub_id != 0 {
                hit.ids.push(sub.sub_id);
            }
        });
    }
    if hits.is_empty() {
        return;
    }
    let expires_at = expiry_of(routed.properties.as_deref());
    for hit in hits {
        let properties = if hit.ids.is_empty() {
            routed.properties.clone()
        } else {
            let mut p = routed.properties.clone().unwrap_or_default();
            p.subscription_identifiers = hit.ids;
            Some(p)
        };
        let msg = OutMessage {
            topic: routed.topic.clone(),
            payload: routed.payload.clone(),
            qos: routed.qos.min(hit.qos),
            retain: routed.retain && hit.retain_as_published,
            properties,
            expires_at,
        };
        match hit.subscriber.deliver(ctx, msg) {
            Ok(()) => {}
            Err(QueueRefusal::Full) => ctx.metrics.count_drop(DropReason::SessionQueueFull),
            Err(QueueRefusal::Offline) => {}
        }
    }
}

/// When a message with these properties expires, counted from now (MQTT 5 Message Expiry
/// Interval; messages from another shard or the cloud are a moment old, which is not counted).
pub fn expiry_of(properties: Option<&Properties>) -> Option<Instant> {
    let secs = properties?.message_expiry_interval?;
    Instant::now().checked_add(Duration::from_secs(secs as u64))
}

/// Add subscriptions for a subscriber; returns the retained messages matching the filters
/// that asked for them. The control plane's snapshot includes the new filters before this
/// returns, so a message published anywhere after the SUBACK reaches the subscriber.
pub async fn subscribe<S: LocalSubscriber + 'static>(
    ctx: &Rc<ShardContext>,
    subscriber: &Rc<S>,
    filters: &[(ByteString, SubscriptionOptions, bool)],
    sub_id: u32,
) -> Vec<RetainedMessage> {
    let mut add = Vec::new();
    let mut retained_for = Vec::new();
    let dyn_subscriber: Rc<dyn LocalSubscriber> = subscriber.clone();
    for (filter, options, want_retained) in filters {
        let existed = subscriber.add_subscription(filter, *options, sub_id);
        let sub = LocalSub {
            subscriber: dyn_subscriber.clone(),
            options: *options,
            sub_id,
        };
        let shared = topic::shared_subscription(filter).is_some();
        if shared {
            let mut groups = ctx.shared.borrow_mut();
            let group = groups.entry(filter.clone()).or_default();
            match group.members.iter_mut().find(|m| **m == sub) {
                Some(m) => *m = sub,
                None => group.members.push(sub),
            }
        } else {
            ctx.subs.borrow_mut().insert(filter, sub);
        }
        if !existed {
            ctx.metrics.subscriptions.add(1);
            let mut refs = ctx.filter_refs.borrow_mut();
            let n = refs.entry(filter.clone()).or_insert(0);
            *n += 1;
            if *n == 1 {
                add.push(filter.clone());
            }
        }
        // retain_handling: 0 = always send, 1 = only for a new subscription, 2 = never.
        let send = match options.retain_handling {
            0 => true,
            1 => !existed,
            _ => false,
        };
        // Retained messages are not sent for a shared subscription (MQTT 5 §4.8.2).
        if *want_retained && send && !shared {
            retained_for.push(filter.clone());
        }
    }
    if add.is_empty() && retained_for.is_empty() {
        return Vec::new();
    }
    announce_pending(ctx, &add);
    let (tx, rx) = oneshot::channel();
    let cmd = ControlCmd::Subscribe {
        shard: ctx.id,
        add,
        retained_for,
        reply: tx,
    };
    if ctx.control.send(cmd).await.is_err() {
        return Vec::new();
    }
    rx.await.unwrap_or_default()
}

/// Put this shard's new filters on the snapshot's pending overlay at once (see
/// `SubscriptionSnapshot::pending`), unless it is full; the control plane absorbs them.
fn announce_pending(ctx: &ShardContext, add: &[ByteString]) {
    let add: Vec<&ByteString> = add
        .iter()
        .filter(|f| topic::shared_subscription(f).is_none())
        .collect();
    if add.is_empty() || ctx.mailboxes.len() < 2 {
        return;
    }
    let shard = ctx.id as u16;
    ctx.snapshot.rcu(|old| {
        let mut next = crate::control::SubscriptionSnapshot::clone(old);
        for f in &add {
            if next.pending.len() < crate::control::MAX_PENDING {
                next.pending.push(((*f).clone(), shard));
            }
        }
        next
    });
}

/// Remove a subscriber's subscription; returns whether it existed.
pub async fn unsubscribe<S: LocalSubscriber + 'static>(
    ctx: &Rc<ShardContext>,
    subscriber: &Rc<S>,
    filter: &ByteString,
) -> bool {
    if !subscriber.remove_subscription(filter) {
        return false;
    }
    if topic::shared_subscription(filter).is_some() {
        let mut groups = ctx.shared.borrow_mut();
        if let Some(group) = groups.get_mut(filter) {
            group.members.retain(|m| !is(&m.subscriber, subscriber));
            if group.members.is_empty() {
                groups.remove(filter);
            }
        }
    } else {
        ctx.subs
            .borrow_mut()
            .remove_where(filter, |s| is(&s.subscriber, subscriber));
    }
    ctx.metrics.subscriptions.sub(1);
    let gone = {
        let mut refs = ctx.filter_refs.borrow_mut();
        match refs.get_mut(filter) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                refs.remove(filter);
                true
            }
            None => false,
        }
    };
    if gone {
        let _ = ctx
            .control
            .send(ControlCmd::Unsubscribe {
                shard: ctx.id,
                remove: vec![filter.clone()],
            })
            .await;
    }
    true
}

/// A command from the cloud (the uplink's one downlink session, on shard 0): delivered to the
/// matching sessions on this shard and sent once to every other shard whose snapshot entry
/// matches, and once to each matching shared group (one member, picked as for a device's
/// PUBLISH), as a device's PUBLISH is. Resolves when the delivery was *accepted*: queued to
/// every matching local session (an offline persistent session keeps QoS 1/2; a full outbox
/// drops and counts, as for any message) and handed to every other matching shard's mailbox
/// (QoS 1/2 waits for room). The uplink acknowledges the command to the cloud only then.
pub async fn deliver_downlink(ctx: &Rc<ShardContext>, routed: Routed) {
    deliver_local(ctx, &routed);
    deliver_other_shards(ctx, &routed).await;
    deliver_shared(ctx, &routed).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_sharing_its_payloads_buffer_is_copied_for_holders_that_may_keep_it_longer() {
        let mut buf = bytes::BytesMut::from(&b"a/topicPAYLOAD"[..]);
        let topic = ByteString::try_from(buf.split_to(7).freeze()).expect("utf-8");
        let payload = buf.freeze();
        let kept = own_topic(&topic, &payload);
        assert_eq!(kept, topic);
        assert_ne!(
            kept.as_bytes().as_ptr(),
            topic.as_bytes().as_ptr(),
            "its own buffer"
        );
        // A topic with a buffer of its own is only cloned.
        let alone = ByteString::from("b/topic");
        let kept = own_topic(&alone, &payload);
        assert_eq!(kept.as_bytes().as_ptr(), alone.as_bytes().as_ptr());
    }
}
