//! Persistent sessions loaded from `[state] dir`, rebuilt on their shard at start.
//!
//! Owns: turning a [`SessionImage`] back into a live offline [`Session`] — subscriptions
//! (through the router, so the shard trie and the control plane's snapshot have them),
//! queued and in-flight messages (charged to the shard's budget as any queued message),
//! incoming QoS 2 ids awaiting PUBREL, the delayed will and the expiry timer. Does not own:
//! loading the files (`crate::state`) or what a reconnecting device then gets (the
//! connection resends in-flight messages with DUP, as after any reconnect).
//!
//! Invariants: a session whose expiry passed while the gateway was down is ended (its will
//! published); at `mqtt.max_sessions` or beyond a session's queue bounds, what does not fit
//! is not restored and counted (`sluice_state_restore_refused_total`), and the session is
//! written again as restored, so the state files keep mirroring the live session; the
//! journal stays off while a session is rebuilt (the files already hold it).

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use sluice_proto::mqtt::{QoS, SubscriptionOptions};

use crate::edge::mqtt::session::{OutStage, PendingWill, Session, SessionState};
use crate::message::DeviceMessage;
use crate::message::OutMessage;
use crate::shard::router as route;
use crate::shard::ShardContext;
use crate::state::{Record, SessionImage, StateLog};

/// Rebuild this shard's restored sessions (before the shard takes its first device).
pub async fn sessions(ctx: &Rc<ShardContext>, restored: Vec<(ByteString, SessionImage)>) {
    let Some(log) = ctx.state.clone() else {
        return;
    };
    let started = Instant::now();
    let count = restored.len();
    for (client, image) in restored {
        session(ctx, &log, client, image).await;
    }
    tracing::info!(
        shard = ctx.id,
        sessions = count,
        ms = started.elapsed().as_millis() as u64,
        "persistent sessions restored"
    );
}

async fn session(ctx: &Rc<ShardContext>, log: &StateLog, client: ByteString, image: SessionImage) {
    let clock = *log.clock();
    let now = clock.now();
    let priority = ctx.rules.load().priority.device(&client);
    let expired = image.expires_at.is_none_or(|at| at <= now);
    let full = ctx.bounds.sessions.load(Ordering::Relaxed) >= ctx.config.mqtt.max_sessions;
    if expired || full {
        if full && !expired {
            metrics(log).restore_refused.inc();
        }
        if let Some((m, _)) = image.will {
            route::publish(ctx, Box::new(will_message(&client, m)), priority).await;
        }
        log.push(Record::SessionEnd { client });
        return;
    }
    let session = Session::with_budget(
        client.clone(),
        ctx.config.mqtt.max_queued_messages,
        ctx.bounds.outbox.clone(),
    );
    ctx.bounds.session_added();
    ctx.sessions
        .borrow_mut()
        .insert(client.clone(), session.clone());
    ctx.metrics.sessions.add(1);
    let mut refused = 0u64;
    {
        let mut st = session.state.borrow_mut();
        st.journal.attach(Some(log.clone()), &session.client_id);
        st.expiry = Duration::from_secs(image.expiry_s as u64);
        st.connected = false;
        st.offline_since = Some(Instant::now());
        for (id, (m, released)) in &image.inflight {
            let msg = OutMessage::from_stored(m.clone(), &clock);
            if st.queued.charge(&msg).is_err() {
                refused += 1;
                continue;
            }
            let stage = if *released {
                OutStage::AwaitingComp
            } else {
                OutStage::AwaitingAck
            };
            st.inflight.insert(*id, (msg, stage));
        }
        for m in &image.outbox {
            let msg = OutMessage::from_stored(m.clone(), &clock);
            if st.outbox.len() >= ctx.config.mqtt.max_queued_messages
                || st.queued.charge(&msg).is_err()
            {
                refused += 1;
                continue;
            }
            st.outbox.push_back(msg);
        }
        let bound = ctx.config.mqtt.receive_maximum as usize;
        for id in &image.awaiting_rel {
            st.awaiting_rel.insert(*id, bound);
        }
    }
    // Subscriptions through the router (shard trie, control plane), grouped by identifier.
    let mut by_id: BTreeMap<u32, Vec<(ByteString, SubscriptionOptions, bool)>> = BTreeMap::new();
    for (filter, (options, sub_id)) in &image.subscriptions {
        by_id
            .entry(*sub_id)
            .or_default()
            .push((filter.clone(), *options, false));
    }
    for (sub_id, filters) in by_id {
        route::subscribe(ctx, &session, &filters, sub_id).await;
    }
    let generation = session.generation.get();
    let expires_at = clock.instant(image.expires_at.unwrap_or(now));
    if let Some((m, publish_at)) = image.will.clone() {
        let message = will_message(&client, m);
        match crate::shard::limits::WillCharge::new(ctx, &message) {
            Some(charge) if publish_at > now => {
                session.state.borrow_mut().will = Some(Box::new(PendingWill { message, priority }));
                let (ctx2, s2) = (ctx.clone(), session.clone());
                let at = clock.instant(publish_at).min(expires_at);
                let timer = tokio::task::spawn_local(async move {
                    let _charge = charge;
                    tokio::time::sleep_until(at.into()).await;
                    if s2.generation.get() != generation {
                        return;
                    }
                    let pending = s2.state.borrow_mut().will.take();
                    if let Some(w) = pending {
                        s2.state
                            .borrow()
                            .journal
                            .record(|client, _| Record::WillDone { client });
                        let (message, priority) = w.into_message();
                        route::publish(&ctx2, Box::new(message), priority).await;
                    }
                });
                session
                    .state
                    .borrow_mut()
                    .timers
                    .set_will(timer.abort_handle());
            }
            _ => {
                route::publish(ctx, Box::new(message), priority).await;
                session.state.borrow_mut().journal.set_on(true);
                session
                    .state
                    .borrow()
                    .journal
                    .record(|client, _| Record::WillDone { client });
            }
        }
    }
    let (ctx2, s2) = (ctx.clone(), session.clone());
    let timer = tokio::task::spawn_local(async move {
        tokio::time::sleep_until(expires_at.into()).await;
        if s2.generation.get() == generation && !s2.state.borrow().connected {
            tracing::debug!(client_id = %s2.client_id, "persistent session expired");
            crate::edge::mqtt::local::end_session(&ctx2, &s2).await;
        }
    });
    let mut st = session.state.borrow_mut();
    st.timers.set_expiry(timer.abort_handle());
    st.journal.set_on(true);
    if refused > 0 {
        metrics(log).restore_refused.add(refused);
        // The files still hold what was not taken back: write the session as it is now.
        st.journal.record(|client, _| Record::SessionEnd { client });
        journal_all(
            &st,
            &image.subscriptions,
            image.expires_at,
            image.will.clone(),
        );
    }
}

fn metrics(log: &StateLog) -> &crate::state::StateMetrics {
    log.metrics()
}

fn will_message(client: &ByteString, m: crate::state::StoredMessage) -> DeviceMessage {
    DeviceMessage {
        device: client.clone(),
        topic: m.topic,
        payload: m.payload,
        qos: m.qos,
        retain: m.retain,
        properties: m.properties,
        received_at: Instant::now(),
        ack: None,
    }
}

/// Log the whole session (it becomes persistent, or was restored only in part), so the state
/// files mirror it from here on. `subscriptions` carries the subscription identifiers (the
/// session keeps only the options); `expires_at`: when an offline session ends.
pub fn journal_all(
    st: &SessionState,
    subscriptions: &BTreeMap<ByteString, (SubscriptionOptions, u32)>,
    expires_at: Option<crate::state::MonoMs>,
    will: Option<(crate::state::StoredMessage, crate::state::MonoMs)>,
) {
    let expiry_s = st.expiry.as_secs().min(u32::MAX as u64) as u32;
    st.journal
        .record(|client, _| Record::SessionOpen { client, expiry_s });
    for (filter, options) in &st.subscriptions {
        let sub_id = subscriptions.get(filter).map_or(0, |(_, id)| *id);
        st.journal.record(|client, _| Record::Subscribe {
            client,
            filter: filter.clone(),
            options: *options,
            sub_id,
        });
    }
    for (id, (m, stage)) in &st.inflight {
        if m.qos == QoS::AtMostOnce {
            continue;
        }
        st.journal.record(|client, clock| Record::Enqueue {
            client,
            msg: m.stored(clock),
        });
        st.journal.record(|client, _| Record::Send {
            client,
            packet_id: *id,
        });
        if *stage == OutStage::AwaitingComp {
            st.journal.record(|client, _| Record::Released {
                client,
                packet_id: *id,
            });
        }
    }
    for m in st.outbox.iter().filter(|m| m.qos != QoS::AtMostOnce) {
        st.journal.record(|client, clock| Record::Enqueue {
            client,
            msg: m.stored(clock),
        });
    }
    for id in st.awaiting_rel.ids() {
        st.journal.record(|client, _| Record::AwaitRel {
            client,
            packet_id: id,
            bound: u16::MAX,
        });
    }
    if let Some(at) = expires_at.filter(|_| !st.connected) {
        st.journal.record(|client, _| Record::SessionOffline {
            client,
            expires_at: at,
        });
    }
    if let Some((msg, publish_at)) = will.filter(|_| st.will.is_some()) {
        st.journal.record(|client, _| Record::Will {
            client,
            msg,
            publish_at,
        });
    }
}
