//! A transport that only prints what it is given, and the outbox suite run over it: the
//! smallest [`Transport`] there is, as a test double. Its far end is a shared log with the
//! faults the suite injects (refuse for now or for good, withhold acks, cut the link).

mod common;
mod outbox_suite;

use std::{cell::RefCell, collections::VecDeque, rc::Rc, sync::Arc};

use bytes::Bytes;
use outbox_suite::{Harness, Received};
use sluice::config::UplinkConfig;
use sluice::sink::transport::*;
use sluice::sink::{UplinkError, UplinkMetrics};
use tokio::sync::Notify;

/// The far end: what it received, and the faults to inject next.
#[derive(Default)]
struct Far {
    received: Vec<Received>,
    /// Answers for the next units that need one: (code, class) refusals.
    refusals: VecDeque<(u8, RefusalClass)>,
    hold: bool,
    /// Bumped by every cut; a connection made at another value is gone.
    link: u64,
}

#[derive(Clone, Default)]
struct Shared(Rc<RefCell<Far>>, Rc<Notify>);

#[derive(Default)]
struct PrintTransport {
    far: Shared,
    window: usize,
    /// The link this connection belongs to (`None`: not connected).
    link: Option<u64>,
    pending: Vec<(Option<SendId>, Bytes, bool)>,
    answers: Vec<Feedback>,
    next_id: u64,
}

impl Transport for PrintTransport {
    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        self.link = Some(self.far.0.borrow().link);
        let (window, pack_limit) = (self.window, usize::MAX);
        Ok(LinkLimits {
            window,
            pack_limit,
            keep_alive: None,
        })
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let (payload, dup, needs_ack) = match unit {
            Unit::Message { msg, resend } => (msg.payload.clone(), resend, msg.needs_cloud_ack()),
            Unit::Pack {
                payload, needs_ack, ..
            } => (payload.clone(), false, needs_ack),
        };
        self.next_id += 1;
        let id = needs_ack.then_some(SendId(self.next_id));
        self.pending.push((id, payload, dup));
        Ok(id)
    }

    fn pending_bytes(&self) -> usize {
        self.pending.iter().map(|(_, p, _)| p.len() + 1).sum()
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        let mut far = self.far.0.borrow_mut();
        if self.link != Some(far.link) {
            return Err(UplinkError::ClosedByCloud);
        }
        for (id, payload, dup) in self.pending.drain(..) {
            println!("print transport: {payload:?} dup={dup}");
            let answer = match id {
                None => None,
                Some(id) => match far.refusals.pop_front() {
                    Some((code, class)) => Some(Feedback::Refused { id, code, class }),
                    None if far.hold => None,
                    None => Some(Feedback::Acked(id)),
                },
            };
            let accepted = id.is_none() || matches!(answer, Some(Feedback::Acked(_)));
            far.received.push(Received {
                payload,
                dup,
                accepted,
            });
            self.answers.extend(answer);
        }
        Ok(())
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        loop {
            if self.link != Some(self.far.0.borrow().link) {
                return Err(UplinkError::ClosedByCloud);
            }
            if !self.answers.is_empty() {
                feedback.append(&mut self.answers);
                return Ok(());
            }
            let wake = self.far.1.clone();
            wake.notified().await;
        }
    }

    fn abort(&mut self) {
        self.link = None;
        self.pending.clear();
        self.answers.clear();
    }
}

impl Harness for Shared {
    type T = PrintTransport;
    async fn start() -> Self {
        Shared::default()
    }
    fn transport(&self, cfg: Rc<UplinkConfig>, _: Arc<UplinkMetrics>) -> PrintTransport {
        let (far, window) = (self.clone(), cfg.inflight.into());
        PrintTransport {
            far,
            window,
            ..Default::default()
        }
    }
    fn cut_link(&self) {
        self.0.borrow_mut().link += 1;
        self.1.notify_one();
    }
    fn refuse_next(&self, n: usize, code: u8, class: RefusalClass) {
        self.0
            .borrow_mut()
            .refusals
            .extend(std::iter::repeat_n((code, class), n));
    }
    fn hold_acks(&self, hold: bool) {
        self.0.borrow_mut().hold = hold;
    }
    fn received(&self) -> Vec<Received> {
        self.0.borrow().received.clone()
    }
}

outbox_cases!(Shared);
