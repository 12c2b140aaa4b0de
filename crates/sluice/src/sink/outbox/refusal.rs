//! What the outbox does with the far end's answers: acks, refusals, and requeueing.
//!
//! Owns: the refusal policy — a temporary refusal pauses sending for a jittered backoff
//! (`refused_retry_min` doubling to `refused_retry_max`, reset by the next success), after
//! which every unacknowledged message is requeued in send order and resent; an unclear one
//! ([`RefusalClass::Unclear`], MQTT 0x80/0x83) counts as temporary until it persisted for
//! [`PERSISTENT_ERROR_ROUNDS`] rounds; a permanent one is counted by reason, logged (one
//! WARN per reason per minute) and its messages completed with the far end's code. Also
//! requeueing everything unacknowledged when a connection ends. Does not own: mapping wire
//! codes to a class (the transport does that).
//!
//! Invariant: after [`Outbox::requeue_unacked`] nothing is inflight, refused, sealed, alone
//! or packed: it is all back at the queue's front in the order it was first taken.

use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::queue::Queued;
use super::{Backoff, Carried, Inflight, Outbox};
use crate::config::UplinkConfig;
use crate::sink::transport::{Feedback, RefusalClass, Transport};
use crate::sink::{DropReason, RejectReason, UplinkMessage};

/// Unclear refusals (MQTT 0x80/0x83) are retried like a quota until this many refusal rounds
/// passed without any success in between; then they count as permanent (`persistent_error`).
pub const PERSISTENT_ERROR_ROUNDS: u32 = 8;
/// At most one WARN per refusal reason per this long (the counter has every one).
const REJECT_WARN_EVERY: Duration = Duration::from_secs(60);
/// Floor of the refusal backoff, whatever the config says (a zero delay would spin).
const MIN_REFUSAL_DELAY: Duration = Duration::from_millis(10);

/// What a refusal means for the messages it refused, after the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Resend after a backoff, in order.
    Temporary,
    /// Count, log, complete the ack token: no resend can help.
    Permanent(RejectReason),
}

/// Apply the policy to a class. `rounds`: refusal rounds since the last success.
pub(crate) fn refusal_policy(class: RefusalClass, rounds: u32) -> Refusal {
    match class {
        RefusalClass::Temporary => Refusal::Temporary,
        RefusalClass::Unclear if rounds >= PERSISTENT_ERROR_ROUNDS => {
            Refusal::Permanent(RejectReason::PersistentError)
        }
        RefusalClass::Unclear => Refusal::Temporary,
        RefusalClass::Permanent(reason) => Refusal::Permanent(reason),
    }
}

/// Units' messages in send order, each marked as a resend.
fn resends_in_order(mut units: Vec<(u64, Carried)>) -> Vec<Queued> {
    units.sort_unstable_by_key(|(seq, _)| *seq);
    units
        .into_iter()
        .flat_map(|(_, carried)| carried.into_messages())
        .map(|msg| Queued { msg, resend: true })
        .collect()
}

/// The refusal backoff of an uplink's config.
pub(super) fn backoff(cfg: &UplinkConfig) -> Backoff {
    Backoff::new(
        cfg.refused_retry_min.max(MIN_REFUSAL_DELAY),
        cfg.refused_retry_max.max(MIN_REFUSAL_DELAY),
    )
}

impl<T: Transport> Outbox<T> {
    /// One answer from the far end, read at `now` (one clock read serves every answer of
    /// one read).
    pub(super) fn on_feedback(&mut self, feedback: Feedback, now: Instant) {
        let (id, refusal) = match feedback {
            Feedback::Acked(id) => (id, None),
            Feedback::Refused { id, code, class } => (id, Some((code, class))),
            Feedback::Returned(id) => {
                if let Some(f) = self.inflight.remove(&id) {
                    self.inflight_backlog =
                        self.inflight_backlog.saturating_sub(usize::from(f.backlog));
                    self.metrics.inflight.set(self.inflight.len() as i64);
                    self.returned.push((f.seq, f.carried));
                }
                return;
            }
        };
        let Some(Inflight {
            seq,
            carried,
            backlog,
        }) = self.inflight.remove(&id)
        else {
            // A duplicate or late answer (e.g. for an id of an earlier connection): harmless.
            debug!(shard = self.shard, uplink = %self.cfg.name, id = id.0, "answer for an id not inflight; ignored");
            return;
        };
        self.inflight_backlog = self.inflight_backlog.saturating_sub(usize::from(backlog));
        self.metrics.inflight.set(self.inflight.len() as i64);
        let Some((code, class)) = refusal else {
            self.refusal_backoff.reset();
            self.refusal_rounds = 0;
            match carried {
                Carried::One(msg) => self.acked(msg, now),
                Carried::Pack(msgs) => {
                    for msg in msgs {
                        self.acked(msg, now);
                    }
                }
            }
            return;
        };
        match refusal_policy(class, self.refusal_rounds) {
            Refusal::Temporary => {
                self.metrics.refusals_retried.add(carried.len() as u64);
                self.refused.push((seq, carried));
                if self.paused_until.is_none() {
                    let delay = self.refusal_backoff.next_delay();
                    self.refusal_rounds = self.refusal_rounds.saturating_add(1);
                    self.paused_until = Some(Instant::now() + delay);
                    warn!(
                        shard = self.shard,
                        uplink = %self.cfg.name,
                        lane = self.lane.as_str(),
                        blame = "cloud",
                        code = format_args!("{code:#04x}"),
                        retry_in = ?delay,
                        "cloud broker refused messages for now; resending them in order after a backoff"
                    );
                }
            }
            Refusal::Permanent(reason) => {
                let msgs = carried.into_messages();
                self.metrics.record_rejected(reason, msgs.len() as u64);
                let now = Instant::now();
                let last = &mut self.reject_warned[reason as usize];
                if last.is_none_or(|at| now.duration_since(at) >= REJECT_WARN_EVERY) {
                    *last = Some(now);
                    warn!(
                        shard = self.shard,
                        uplink = %self.cfg.name,
                        lane = self.lane.as_str(),
                        blame = "cloud",
                        code = format_args!("{code:#04x}"),
                        reason = reason.as_str(),
                        total = self.metrics.rejected(reason),
                        "cloud broker refused a message for good; counted and acknowledged to the device (logged at most once a minute per reason)"
                    );
                }
                for msg in msgs {
                    self.metrics.record_drop(DropReason::CloudRejected);
                    self.finish(msg, code);
                }
            }
        }
    }

    /// End a refusal pause once its deadline passed and nothing is inflight: everything
    /// unacknowledged goes back to the queue's front in send order, to be sent again.
    pub(super) fn maybe_resume(&mut self) {
        let Some(at) = self.paused_until else {
            return;
        };
        if Instant::now() >= at && self.inflight.is_empty() {
            self.requeue_unacked();
        }
    }

    fn acked(&self, msg: UplinkMessage, now: Instant) {
        self.metrics.messages_acked.inc();
        self.metrics
            .ack_latency
            .observe(now.saturating_duration_since(msg.received_at));
        self.finish(msg, 0);
    }

    /// The message can never reach the far end: count it and complete its token with 0x83
    /// Implementation specific error when the gateway cannot send it at all (an MQTT 5 device
    /// sees it in its PUBACK), or 0 for other reasons (a QoS 0 write lost).
    pub(super) fn finish_dropped(&self, msg: UplinkMessage, reason: DropReason) {
        let code = match reason {
            DropReason::TooLargeForCloud | DropReason::InvalidForCloud => {
                sluice_proto::mqtt::reason::IMPLEMENTATION_SPECIFIC_ERROR
            }
            _ => 0,
        };
        self.metrics.record_drop(reason);
        self.finish(msg, code);
    }

    /// Put the units the transport gave back ([`Feedback::Returned`]) at the front of the
    /// queue in send order, followed by everything taken after them and not yet written (a
    /// sealed pack's, those held to go alone, the open pack's, the held flows'), so every
    /// device's order holds. Units still inflight elsewhere stay inflight: they belong to
    /// other flows (the transport keeps a flow on one link while it has units there).
    pub(super) fn requeue_returned(&mut self) {
        if self.returned.is_empty() {
            return;
        }
        let mut items = resends_in_order(std::mem::take(&mut self.returned));
        self.metrics.messages_returned.add(items.len() as u64);
        self.take_unwritten(&mut items);
        self.queue.requeue_front_queued(items);
    }

    /// Append what was taken from the queue and not written yet, in the order taken. A
    /// held message keeps its resend mark; the others are marked (as they always were).
    fn take_unwritten(&mut self, items: &mut Vec<Queued>) {
        let resend = |msg| Queued { msg, resend: true };
        if let Some(sealed) = self.sealed.take() {
            items.extend(sealed.msgs.into_iter().map(resend));
        }
        items.extend(self.alone.drain(..).map(|q| resend(q.msg)));
        if let Some(packer) = &mut self.packer {
            items.extend(packer.take_messages().into_iter().map(resend));
        }
        let mut held: Vec<(u64, Queued)> = self.held.drain().flat_map(|(_, q)| q).collect();
        held.sort_unstable_by_key(|(seq, _)| *seq);
        items.extend(held.into_iter().map(|(_, q)| q));
        self.held_len = 0;
        self.pack_mix = (0, 0);
    }

    /// Put every unacknowledged message back at the front of the queue in send order: the
    /// inflight and refused ones (by send order), then a sealed pack's, then those held to go
    /// alone, then the open pack's. Ends a refusal pause.
    pub(super) fn requeue_unacked(&mut self) {
        let pending: Vec<(u64, Carried)> = self
            .inflight
            .drain()
            .map(|(_, f)| (f.seq, f.carried))
            .chain(self.refused.drain(..))
            .chain(self.returned.drain(..))
            .collect();
        let mut items = resends_in_order(pending);
        self.take_unwritten(&mut items);
        self.queue.requeue_front_queued(items);
        self.inflight_backlog = 0;
        self.paused_until = None;
        self.metrics.inflight.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unclear_refusals_are_temporary_until_they_persist_and_the_others_keep_their_class() {
        assert_eq!(
            refusal_policy(RefusalClass::Temporary, 1000),
            Refusal::Temporary
        );
        assert_eq!(refusal_policy(RefusalClass::Unclear, 0), Refusal::Temporary);
        assert_eq!(
            refusal_policy(RefusalClass::Unclear, PERSISTENT_ERROR_ROUNDS),
            Refusal::Permanent(RejectReason::PersistentError)
        );
        assert_eq!(
            refusal_policy(RefusalClass::Permanent(RejectReason::NotAuthorized), 0),
            Refusal::Permanent(RejectReason::NotAuthorized)
        );
    }
}
