//! The outbox over a transport with two links: the flow rules a multipath transport relies
//! on ([`Transport::holds`], [`Transport::window`], [`Feedback::Returned`]). The far end is a
//! test double because the faults are injected: one link's acks withheld, one link dying with
//! units unacknowledged on it.
//!
//! What a device would notice is asserted: every message acknowledged once, in its order, and
//! the far end's accepted copies in each device's order.

mod common;
mod outbox_suite;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sluice::config::{UplinkConfig, UplinkUrl};
use sluice::message::ack::DeviceAcks;
use sluice::sink::outbox::{Outbox, OutboxSeed};
use sluice::sink::transport::*;
use sluice::sink::{Lane, UplinkError, UplinkMetrics, UplinkQueue};
use sluice_proto::mqtt::QoS;
use tokio::sync::{watch, Notify};

use common::{run_local, wait_until};
use outbox_suite::message;

/// Units each link may have unacknowledged.
const LINK_WINDOW: usize = 2;

/// One unit as the far end got it.
#[derive(Debug, Clone)]
struct Got {
    link: usize,
    payload: Bytes,
    dup: bool,
}

#[derive(Default)]
struct Far {
    got: Vec<Got>,
    /// Per link: acks withheld while set.
    hold: [bool; 2],
    /// Per link: units written and not yet answered (id, flow).
    unanswered: [Vec<(SendId, Flow)>; 2],
    /// Per link: kill it at the next poll (its unanswered units are returned).
    kill: [bool; 2],
    /// The outbox asked `holds` and was told to wait, per link.
    held_asks: [usize; 2],
}

#[derive(Clone, Default)]
struct Shared(Rc<RefCell<Far>>, Rc<Notify>);

/// Two links; a flow sticks to the link it has units unacknowledged on.
struct TwoLinks {
    far: Shared,
    pending: Vec<(usize, Option<SendId>, Flow, Bytes, bool)>,
    next_id: u64,
}

impl TwoLinks {
    /// The link where `flow` has units written or encoded and not yet answered.
    fn sticky(&self, flow: Flow) -> Option<usize> {
        let far = self.far.0.borrow();
        (0..2).find(|&l| {
            far.unanswered[l].iter().any(|(_, f)| *f == flow)
                || self
                    .pending
                    .iter()
                    .any(|p| p.0 == l && p.1.is_some() && p.2 == flow)
        })
    }

    fn inflight(&self, link: usize) -> usize {
        self.far.0.borrow().unanswered[link].len()
            + self
                .pending
                .iter()
                .filter(|p| p.0 == link && p.1.is_some())
                .count()
    }

    fn pick(&self, flow: Flow) -> Option<usize> {
        match self.sticky(flow) {
            Some(l) => (self.inflight(l) < LINK_WINDOW).then_some(l),
            None => (0..2)
                .filter(|&l| self.inflight(l) < LINK_WINDOW)
                .min_by_key(|&l| self.inflight(l)),
        }
    }
}

impl Transport for TwoLinks {
    const MAY_HOLD: bool = true;

    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        Ok(LinkLimits {
            window: 2 * LINK_WINDOW,
            pack_limit: usize::MAX,
            keep_alive: None,
        })
    }

    fn window(&self) -> Option<usize> {
        Some(2 * LINK_WINDOW)
    }

    fn holds(&self, flow: Flow) -> bool {
        let held = self.pick(flow).is_none();
        if held {
            if let Some(l) = self.sticky(flow) {
                self.far.0.borrow_mut().held_asks[l] += 1;
            }
        }
        held
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let Unit::Message { msg, resend } = unit else {
            return Err(Unsendable::Invalid("no packs here".into()));
        };
        let flow = msg.flow();
        let link = self
            .pick(flow)
            .expect("the outbox asked holds() before encoding");
        self.next_id += 1;
        let id = msg.needs_cloud_ack().then_some(SendId(self.next_id));
        self.pending
            .push((link, id, flow, msg.payload.clone(), resend));
        Ok(id)
    }

    fn pending_bytes(&self) -> usize {
        self.pending.iter().map(|p| p.3.len() + 1).sum()
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        let mut far = self.far.0.borrow_mut();
        for (link, id, flow, payload, dup) in self.pending.drain(..) {
            far.got.push(Got { link, payload, dup });
            if let Some(id) = id {
                far.unanswered[link].push((id, flow));
            }
        }
        drop(far);
        self.far.1.notify_one();
        Ok(())
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        loop {
            {
                let mut far = self.far.0.borrow_mut();
                for l in 0..2 {
                    if std::mem::take(&mut far.kill[l]) {
                        let dead = std::mem::take(&mut far.unanswered[l]);
                        feedback.extend(dead.into_iter().map(|(id, _)| Feedback::Returned(id)));
                    } else if !far.hold[l] {
                        let acked = std::mem::take(&mut far.unanswered[l]);
                        feedback.extend(acked.into_iter().map(|(id, _)| Feedback::Acked(id)));
                    }
                }
            }
            if !feedback.is_empty() {
                return Ok(());
            }
            let wake = self.far.1.clone();
            wake.notified().await;
        }
    }

    fn abort(&mut self) {
        self.pending.clear();
    }
}

struct Running {
    far: Shared,
    queue: Rc<UplinkQueue>,
    metrics: Arc<UplinkMetrics>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

fn start() -> Running {
    let url = UplinkUrl {
        tls: false,
        host: "far.invalid".into(),
        port: 1,
    };
    let mut cfg = UplinkConfig::new("cloud", url);
    cfg.allow_plaintext = true;
    let far = Shared::default();
    let queue = Rc::new(UplinkQueue::new(4 << 20));
    let metrics = Arc::new(UplinkMetrics::new());
    let seed = OutboxSeed {
        shard: 0,
        lane: Lane::Normal,
        cfg: Rc::new(cfg),
        queue: queue.clone(),
        metrics: metrics.clone(),
        live_devices: Arc::new(AtomicUsize::new(0)),
        feeders: Default::default(),
    };
    let transport = TwoLinks {
        far: far.clone(),
        pending: Vec::new(),
        next_id: 0,
    };
    let (shutdown, rx) = watch::channel(false);
    let task = tokio::task::spawn_local(Outbox::new(seed, transport).run(rx));
    Running {
        far,
        queue,
        metrics,
        shutdown,
        task,
    }
}

impl Running {
    fn set(&self, f: impl FnOnce(&mut Far)) {
        f(&mut self.far.0.borrow_mut());
        self.far.1.notify_one();
    }

    /// Payloads of `device` the far end got on a link that then acknowledged them, in order.
    fn got_of(&self, device: usize) -> Vec<Got> {
        let prefix = format!("d{device}:");
        self.far
            .0
            .borrow()
            .got
            .iter()
            .filter(|g| g.payload.starts_with(prefix.as_bytes()))
            .cloned()
            .collect()
    }

    async fn stop(self) {
        self.shutdown.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the outbox ends promptly")
            .expect("no panic");
    }
}

/// The numbers in `got`'s payloads (`"d{device}:{n}"`).
fn numbers(got: &[Got]) -> Vec<usize> {
    got.iter()
        .map(|g| {
            let s = String::from_utf8_lossy(&g.payload);
            s.rsplit(':').next().unwrap().parse().unwrap()
        })
        .collect()
}

#[test]
fn a_held_flow_waits_in_order_while_other_flows_go_on_the_other_link() {
    run_local(async {
        let up = start();
        // Link 0 answers nothing for now: whoever lands there first gets stuck there.
        up.set(|f| f.hold[0] = true);
        let acks: Vec<_> = (0..4).map(|_| DeviceAcks::new()).collect();
        for n in 0..6 {
            for (d, a) in acks.iter().enumerate() {
                up.queue.push(message(d, n, QoS::AtLeastOnce, a)).await;
            }
        }
        // Devices that never touched link 0 finish; those stuck on it do not.
        let mut done: HashMap<usize, Vec<u16>> = HashMap::new();
        wait_until(
            "the devices on link 1 finish",
            Duration::from_secs(5),
            || {
                for (d, a) in acks.iter().enumerate() {
                    done.entry(d).or_default().extend(a.drain());
                }
                done.values().filter(|v| v.len() == 6).count() >= 2
            },
        )
        .await;
        let stuck: Vec<usize> = (0..4).filter(|d| done[d].len() < 6).collect();
        assert_eq!(stuck.len(), 2, "two devices wait on link 0: {done:?}");
        for d in &stuck {
            assert!(
                up.got_of(*d).iter().all(|g| g.link == 0),
                "device {d} never moved"
            );
        }
        assert!(
            up.far.0.borrow().held_asks[0] > 0,
            "the outbox asked and held the stuck flows"
        );
        // Link 0 answers again: everything completes, each device in its order, sent once.
        up.set(|f| f.hold[0] = false);
        wait_until("every device finishes", Duration::from_secs(5), || {
            for (d, a) in acks.iter().enumerate() {
                done.entry(d).or_default().extend(a.drain());
            }
            done.values().all(|v| v.len() == 6)
        })
        .await;
        for d in 0..4 {
            assert_eq!(
                done[&d],
                (1..=6).collect::<Vec<u16>>(),
                "device {d}'s acks in order"
            );
            assert_eq!(
                numbers(&up.got_of(d)),
                (0..6).collect::<Vec<_>>(),
                "device {d} sent once, in order"
            );
        }
        assert_eq!(up.queue.reserved_bytes(), 0);
        up.stop().await;
    });
}

#[test]
fn units_returned_by_a_dead_link_are_resent_before_their_devices_later_messages() {
    run_local(async {
        let up = start();
        up.set(|f| f.hold[0] = true);
        let acks: Vec<_> = (0..4).map(|_| DeviceAcks::new()).collect();
        for n in 0..8 {
            for (d, a) in acks.iter().enumerate() {
                up.queue.push(message(d, n, QoS::AtLeastOnce, a)).await;
            }
        }
        wait_until("link 0 holds units", Duration::from_secs(5), || {
            up.far.0.borrow().unanswered[0].len() == LINK_WINDOW
        })
        .await;
        // Link 0 dies with its units unacknowledged; afterwards it is healthy again.
        up.set(|f| {
            f.kill[0] = true;
            f.hold[0] = false;
        });
        let mut done: HashMap<usize, Vec<u16>> = HashMap::new();
        wait_until("every device finishes", Duration::from_secs(5), || {
            for (d, a) in acks.iter().enumerate() {
                done.entry(d).or_default().extend(a.drain());
            }
            done.values().all(|v| v.len() == 8)
        })
        .await;
        let mut resent = 0;
        for d in 0..4 {
            assert_eq!(
                done[&d],
                (1..=8).collect::<Vec<u16>>(),
                "device {d}'s acks in order"
            );
            let got = up.got_of(d);
            resent += got.iter().filter(|g| g.dup).count();
            // What the far end kept (everything after the dead link's copies) is in order.
            let killed = got.iter().take_while(|g| g.link == 0 && !g.dup).count();
            let kept: Vec<Got> = if got.iter().any(|g| g.dup) {
                got[killed..].to_vec()
            } else {
                got.clone()
            };
            assert_eq!(
                numbers(&kept),
                (0..8).collect::<Vec<_>>(),
                "device {d}: {got:?}"
            );
        }
        assert_eq!(resent as u64, up.metrics.messages_returned.get());
        assert!(
            resent >= LINK_WINDOW,
            "the dead link's units were resent: {resent}"
        );
        assert_eq!(up.queue.reserved_bytes(), 0);
        up.stop().await;
    });
}
