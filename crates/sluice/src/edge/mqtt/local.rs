//! An MQTT session as the router sees it: a [`LocalSubscriber`], and its end.
//!
//! Owns: how a session takes a message the router matched for it (room in the shard's outbox
//! budget, then its own bounded outbox), how it records its subscriptions (they outlive a
//! reconnect, and `[state] dir` logs them), and ending a session (its will, its
//! subscriptions, its place in the shard's table). The router never sees a [`Session`].

use std::rc::Rc;

use bytestring::ByteString;
use sluice_proto::mqtt::SubscriptionOptions;

use crate::edge::mqtt::session::Session;
use crate::message::{OutMessage, QueueRefusal};
use crate::shard::router as route;
use crate::shard::subscriber::{DeliveryStamp, LocalSubscriber};
use crate::shard::ShardContext;

impl LocalSubscriber for Session {
    fn subscriber_id(&self) -> &ByteString {
        &self.client_id
    }
    fn is_connected(&self) -> bool {
        self.state.borrow().connected
    }
    fn delivery_stamp(&self) -> &DeliveryStamp {
        &self.delivery
    }
    fn deliver(&self, ctx: &ShardContext, msg: OutMessage) -> Result<(), QueueRefusal> {
        crate::shard::limits::make_room(ctx, self, &msg);
        self.enqueue(msg)
    }
    fn add_subscription(
        &self,
        filter: &ByteString,
        options: SubscriptionOptions,
        sub_id: u32,
    ) -> bool {
        let mut st = self.state.borrow_mut();
        st.journal
            .record(|client, _| crate::state::Record::Subscribe {
                client,
                filter: filter.clone(),
                options,
                sub_id,
            });
        st.subscriptions.insert(filter.clone(), options).is_some()
    }
    fn remove_subscription(&self, filter: &ByteString) -> bool {
        let mut st = self.state.borrow_mut();
        let existed = st.subscriptions.remove(filter).is_some();
        if existed {
            st.journal
                .record(|client, _| crate::state::Record::Unsubscribe {
                    client,
                    filter: filter.clone(),
                });
        }
        existed
    }
}

/// End a session: publish its pending will (the session's end is the latest a delayed will
/// waits for), drop its subscriptions and forget it.
pub async fn end_session(ctx: &Rc<ShardContext>, session: &Rc<Session>) {
    let will = {
        let mut st = session.state.borrow_mut();
        st.ended = true;
        // `[state] dir`: the session leaves the state files, and nothing more is logged.
        st.journal
            .record(|client, _| crate::state::Record::SessionEnd { client });
        st.journal.set_on(false);
        st.will.take()
    };
    if let Some(w) = will {
        let (msg, priority) = w.into_message();
        Box::pin(route::publish(ctx, Box::new(msg), priority)).await;
    }
    let filters: Vec<ByteString> = session
        .state
        .borrow()
        .subscriptions
        .keys()
        .cloned()
        .collect();
    for f in &filters {
        route::unsubscribe(ctx, session, f).await;
    }
    let removed = {
        let mut sessions = ctx.sessions.borrow_mut();
        match sessions.get(&session.client_id) {
            Some(s) if Rc::ptr_eq(s, session) => sessions.remove(&session.client_id).is_some(),
            _ => false,
        }
    };
    if removed {
        ctx.metrics.sessions.sub(1);
        ctx.bounds.session_removed();
        session.state.borrow_mut().drop_queued();
    }
}
