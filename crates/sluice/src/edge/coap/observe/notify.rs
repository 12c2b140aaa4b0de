//! The notification task of one registration: drains its session's outbox into 2.05
//! notifications through [`CoapOut`](super::CoapOut).
//!
//! Owns: the NON/CON choice (RFC 7641 §4.5: CON at least every [`CON_EVERY`]th notification,
//! and whenever the observer has not been confirmed for `coap.observer_check` — then, if no
//! notification is due, a CON repeating its last state)
//! and the queue while a CON is unacknowledged (at most `coap.max_queued_notifications`, the
//! oldest dropped and counted: an observer wants the latest state), and cutting a notification
//! larger than `max_message_size` to its block 0 (kept whole in the observers' snapshots
//! for the later blocks; verified observers only). Does not own:
//! retransmitting the CON (the edge) or the registration's lifetime (`super::Observers`,
//! which this task asks to deregister on RST or silence).

use std::rc::{Rc, Weak};
use std::time::Instant;

use sluice_proto::coap::{opt, Code, Message, MsgType};

use super::metrics::{Deregistration, NotificationDrop, ObserveMetrics};
use super::{content_format_of, LastState, Observers, Registration, Snapshot};
use crate::edge::coap::ConOutcome;
use crate::message::OutMessage;
use bytes::Bytes;
use sluice_proto::coap::Block;

/// At least every this many notifications, one is sent CON (RFC 7641 §4.5).
pub(super) const CON_EVERY: u32 = 24;

/// Run until the registration ends (then `Observers::remove` aborts it, or it returns after
/// asking for its own removal) or the observers are gone.
pub(super) async fn run(reg: Rc<Registration>, observers: Weak<Observers>) {
    loop {
        let Some(check) = observers
            .upgrade()
            .map(|o| o.ctx.config.coap.observer_check)
        else {
            return;
        };
        let due = reg.confirmed.get() + check;
        let next = reg.session.state.borrow_mut().pop_outbox();
        // `repeat`: nothing to notify, but the observer is due a check: its last state again.
        let (n, repeat) = match next {
            Some(msg) => {
                let Some(obs) = observers.upgrade() else {
                    return;
                };
                if reg.closed.get() {
                    return;
                }
                match obs.notification(&reg, &msg) {
                    Some(n) => (n, false),
                    None => continue,
                }
            }
            None => {
                tokio::select! {
                    _ = reg.session.notify.notified() => continue,
                    _ = tokio::time::sleep_until(due.into()) => {}
                }
                let Some(obs) = observers.upgrade() else {
                    return;
                };
                if reg.closed.get() {
                    return;
                }
                (obs.repeat(&reg), true)
            }
        };
        let Some(obs) = observers.upgrade() else {
            return;
        };
        let mut n = n;
        let metrics = &obs.ctx.metrics.coap_observe;
        let checking = repeat || Instant::now() >= due;
        let max_retransmit = obs.ctx.config.coap.max_retransmit;
        // An address not verified: CON only, within 3× the registration request.
        let unverified = !obs.out.verified(reg.peer);
        let retransmit = if !unverified {
            max_retransmit
        } else {
            let limit = reg.req_size.saturating_mul(3);
            let size = 4 + n.token.len() + n.options_len();
            if size > limit {
                metrics.drop(NotificationDrop::Unverified);
                continue;
            }
            (limit / size)
                .saturating_sub(1)
                .min(max_retransmit as usize) as u8
        };
        if !checking && !unverified && reg.since_con.get() + 1 < CON_EVERY {
            reg.since_con.set(reg.since_con.get() + 1);
            n.mtype = MsgType::Non;
            n.message_id = obs.out.next_message_id();
            obs.out.send(reg.peer, &n);
            obs.sent_non(&reg, n.message_id);
            metrics.notifications_non.inc();
            continue;
        }
        reg.since_con.set(0);
        n.mtype = MsgType::Con;
        metrics.notifications_con.inc();
        let mut outcome = obs.out.send_con_limited(reg.peer, n, retransmit);
        let max = obs.ctx.config.coap.max_queued_notifications.max(1);
        drop(obs);
        // Until the CON is answered, what arrives queues in the session's outbox.
        let result = loop {
            tokio::select! {
                r = &mut outcome => break r,
                _ = reg.session.notify.notified() => {
                    if let Some(obs) = observers.upgrade() {
                        trim(&reg, max, &obs.ctx.metrics.coap_observe);
                    }
                }
            }
        };
        let Some(obs) = observers.upgrade() else {
            return;
        };
        match result {
            Ok(ConOutcome::Acked) => {
                reg.confirmed.set(Instant::now());
                trim(&reg, max, &obs.ctx.metrics.coap_observe)
            }
            Ok(ConOutcome::Reset) => {
                obs.remove(&reg, Deregistration::Reset);
                return;
            }
            // The edge gave up on the CON (or went away without answering): silence.
            Ok(ConOutcome::TimedOut) | Err(_) => {
                let why = if checking || unverified {
                    Deregistration::Unconfirmed
                } else {
                    Deregistration::Silence
                };
                obs.remove(&reg, why);
                return;
            }
        }
    }
}

/// Keep at most `max` messages waiting; the oldest go, counted.
fn trim(reg: &Registration, max: usize, metrics: &ObserveMetrics) {
    let mut st = reg.session.state.borrow_mut();
    while st.outbox.len() > max {
        if st.pop_outbox().is_none() {
            break;
        }
        metrics.drop(NotificationDrop::QueueFull);
    }
}

impl Observers {
    /// The notification for `msg` (type and message id still to set), with the next Observe
    /// value; `None` (counted) when it expired or would not fit one datagram (an Observe
    /// value skipped is harmless: only the order matters).
    fn notification(&self, reg: &Registration, msg: &OutMessage) -> Option<Message> {
        let metrics = &self.ctx.metrics.coap_observe;
        let now = Instant::now();
        if msg.is_expired(now) {
            metrics.drop(NotificationDrop::Expired);
            return None;
        }
        let mut n = Message::new(MsgType::Non, Code::CONTENT, 0, reg.token);
        n.add_uint_option(opt::OBSERVE, reg.next_seq());
        if let Some(f) = msg
            .properties
            .as_deref()
            .and_then(|p| p.content_type.as_deref())
            .and_then(content_format_of)
        {
            n.add_uint_option(opt::CONTENT_FORMAT, f as u32);
        }
        if let Some(at) = msg.expires_at {
            // Max-Age: how long the value stays fresh (its MQTT 5 expiry, rounded up).
            let left = at.saturating_duration_since(now).as_millis().div_ceil(1000);
            n.add_uint_option(opt::MAX_AGE, left.min(u32::MAX as u128) as u32);
        }
        n.payload = msg.payload.clone();
        let size = 4 + reg.token.len() + n.options_len();
        let format = n.uint_option(opt::CONTENT_FORMAT).map(|f| f as u16);
        if size > self.ctx.config.coap.max_message_size.as_usize() {
            return self.block0(reg, n, format);
        }
        *reg.last.borrow_mut() = LastState {
            payload: n.payload.clone(),
            format,
            block0: None,
        };
        Some(n)
    }

    /// `n` (too large for one datagram) as its block 0 with an ETag and Size2, its whole
    /// representation copied into the snapshots for the later blocks; `None` (counted) when
    /// the observer's address is not verified or the copy cannot be kept.
    fn block0(&self, reg: &Registration, mut n: Message, format: Option<u16>) -> Option<Message> {
        let metrics = &self.ctx.metrics.coap_observe;
        if !self.out.verified(reg.peer) {
            // A block is far more than 3× a registration: never to an unproven address.
            metrics.drop(NotificationDrop::Unverified);
            return None;
        }
        let cfg = &self.ctx.config.coap;
        // Copied: the snapshot holds exactly its charged bytes, not the buffer it came in.
        let body = Bytes::copy_from_slice(&std::mem::take(&mut n.payload));
        let etag = super::super::resources::etag_of(&body, format.map(u32::from));
        n.add_option(opt::ETAG, Bytes::copy_from_slice(&etag));
        // Block2 (≤ 3 bytes), Size2 (≤ 4), their headers (≤ 3 each) and the payload marker.
        let room = cfg
            .max_message_size
            .as_usize()
            .saturating_sub(4 + reg.token.len() + n.options_len() + 14);
        let ours = Block::szx_for(cfg.block_size.as_usize());
        let Some(szx) = (0..=ours).rev().find(|s| 16usize << s <= room) else {
            metrics.drop(NotificationDrop::TooLarge);
            return None;
        };
        let snap = Snapshot {
            etag,
            body: body.clone(),
            format,
            szx,
            at: Instant::now(),
        };
        let before = self.snapshots.borrow().bytes();
        let kept =
            self.snapshots
                .borrow_mut()
                .insert(reg.peer, &reg.filter, snap, cfg.exchange_lifetime);
        self.snapshots_changed(before);
        if !kept {
            metrics.drop(NotificationDrop::TooLarge);
            return None;
        }
        metrics.blockwise.inc();
        let n = super::super::resources::slice_block2(None, szx, n, body);
        *reg.last.borrow_mut() = LastState {
            payload: Bytes::copy_from_slice(&n.payload),
            format,
            block0: n
                .uint_option(opt::BLOCK2)
                .zip(n.uint_option(opt::SIZE2))
                .map(|(b, s)| (b, s, etag)),
        };
        Some(n)
    }

    /// A notification repeating the last state sent to `reg` (to check the observer is
    /// still there when nothing else is due), with the next Observe value.
    fn repeat(&self, reg: &Registration) -> Message {
        let mut n = Message::new(MsgType::Con, Code::CONTENT, 0, reg.token);
        n.add_uint_option(opt::OBSERVE, reg.next_seq());
        let last = reg.last.borrow().clone();
        if let Some(f) = last.format {
            n.add_uint_option(opt::CONTENT_FORMAT, f as u32);
        }
        if let Some((block2, size2, etag)) = last.block0 {
            n.add_option(opt::ETAG, Bytes::copy_from_slice(&etag));
            n.add_uint_option(opt::BLOCK2, block2);
            n.add_uint_option(opt::SIZE2, size2);
        }
        n.payload = last.payload;
        n
    }
}
