//! The end of a connection: its will and its session's timers.
//!
//! Owns publishing the will (as a [`DeviceMessage`] without an ack token, handed to the
//! router with the device's priority) at once or after its Will Delay Interval, and the
//! session's expiry timer. Invariants (input bounds): at most one pending will and one expiry
//! timer per session; a waiting will is charged to the shard's queued bytes.

use std::time::{Duration, Instant};

use sluice_proto::mqtt::Will;

use super::Connection;
use crate::edge::mqtt::session::PendingWill;
use crate::message::DeviceMessage;
use crate::shard::metrics::CloseReason;
use crate::shard::router as route;

impl Connection {
    /// After the connection ended: publish the will if due, and keep or end the session.
    pub(super) async fn finish(&mut self, reason: CloseReason) {
        if let Some(will) = self.will.take() {
            if reason != CloseReason::ClientDisconnect {
                self.on_will(*will, reason).await;
            }
        }
        if !self.is_current() {
            return; // taken over: the session belongs to the new connection now
        }
        let _ = self
            .ctx
            .control
            .try_send(crate::control::ControlCmd::DeviceDown {
                client_id: self.client_id.clone(),
                shard: self.ctx.id,
            });
        let expiry = {
            let mut st = self.session.state.borrow_mut();
            st.connected = false;
            st.offline_since = Some(Instant::now());
            let expiry = st.expiry;
            if !expiry.is_zero() && reason != CloseReason::Shutdown {
                st.journal
                    .record(|client, clock| crate::state::Record::SessionOffline {
                        client,
                        expires_at: clock.mono(Instant::now() + expiry),
                    });
            }
            expiry
        };
        if expiry.is_zero() || reason == CloseReason::Shutdown {
            self.session.state.borrow_mut().timers.abort_all(); // input bounds
            crate::edge::mqtt::local::end_session(&self.ctx, &self.session).await;
            return;
        }
        let ctx = self.ctx.clone();
        let session = self.session.clone();
        let generation = self.generation;
        let timer = tokio::task::spawn_local(async move {
            tokio::time::sleep(expiry).await;
            if session.generation.get() == generation && !session.state.borrow().connected {
                tracing::debug!(client_id = %session.client_id, "persistent session expired");
                crate::edge::mqtt::local::end_session(&ctx, &session).await;
            }
        });
        // Input bounds: one expiry timer per session (an older one could not fire anyway).
        self.session
            .state
            .borrow_mut()
            .timers
            .set_expiry(timer.abort_handle());
    }

    /// The connection ended without a normal DISCONNECT: publish the will now, or hold it in
    /// the session for its delay. MQTT 5 §3.1.3.2.2: the will goes at the earlier of the Will
    /// Delay Interval and the end of the session; a reconnect to the session within the delay
    /// cancels it, a clean start (which ends the session) publishes it at once.
    async fn on_will(&mut self, will: Will, reason: CloseReason) {
        let delay = Duration::from_secs(will.properties.will_delay_interval.unwrap_or(0) as u64);
        let message = will_message(will, self.client_id.clone());
        let (ended, expiry) = {
            let st = self.session.state.borrow();
            (st.ended, st.expiry)
        };
        let now = if !self.is_current() {
            // Taken over: a clean start ended the session (publish now); a connection that
            // continues it arrived within the delay (no will), unless there was no delay.
            if !ended && !delay.is_zero() {
                return;
            }
            true
        } else {
            delay.is_zero() || expiry.is_zero() || reason == CloseReason::Shutdown
        };
        let priority = self.priority;
        // Input bounds: a waiting will is charged to the shard's queued bytes; one that does
        // not fit is published now.
        let charge = if now {
            None
        } else {
            crate::shard::limits::WillCharge::new(&self.ctx, &message)
        };
        if now || charge.is_none() {
            route::publish(&self.ctx, Box::new(message), priority).await;
            return;
        }
        {
            let mut st = self.session.state.borrow_mut();
            let publish_at = Instant::now() + delay.min(expiry);
            st.journal
                .record(|client, clock| crate::state::Record::Will {
                    client,
                    msg: crate::state::StoredMessage {
                        topic: message.topic.clone(),
                        payload: message.payload.clone(),
                        qos: message.qos,
                        retain: message.retain,
                        properties: message.properties.clone(),
                        expires_at: None,
                    },
                    publish_at: clock.mono(publish_at),
                });
            st.will = Some(Box::new(PendingWill { message, priority }));
        }
        let ctx = self.ctx.clone();
        let session = self.session.clone();
        let generation = self.generation;
        let timer = tokio::task::spawn_local(async move {
            let _charge = charge;
            tokio::time::sleep(delay.min(expiry)).await;
            if session.generation.get() != generation {
                return; // reconnected (cancelled) or replaced (published by end_session)
            }
            let pending = session.state.borrow_mut().will.take();
            if let Some(w) = pending {
                session
                    .state
                    .borrow()
                    .journal
                    .record(|client, _| crate::state::Record::WillDone { client });
                let (message, priority) = w.into_message();
                route::publish(&ctx, Box::new(message), priority).await;
            }
        });
        // Input bounds: one pending will per session (an older one could not fire anyway).
        self.session
            .state
            .borrow_mut()
            .timers
            .set_will(timer.abort_handle());
    }
}

/// The message a will becomes (its will-only properties removed): from `device`, no ack
/// token (nobody waits for an acknowledgement of a will).
fn will_message(will: Will, device: bytestring::ByteString) -> DeviceMessage {
    let properties = if will.properties.is_empty() {
        None
    } else {
        let mut p = will.properties;
        p.will_delay_interval = None;
        if p.is_empty() {
            None
        } else {
            Some(Box::new(p))
        }
    };
    DeviceMessage {
        device,
        topic: will.topic,
        payload: will.payload,
        qos: will.qos,
        retain: will.retain,
        properties,
        received_at: Instant::now(),
        ack: None,
    }
}
