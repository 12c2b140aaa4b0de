//! Model-based property test of the delivery model at the gateway's level: devices publish
//! QoS 1 into a real spool (`UplinkSpool`, `ack = "spool"` or `"cloud"`, on a temporary
//! directory) whose
//! commit and feeder tasks fill a real uplink queue, and a real [`Outbox`] sends it over an
//! in-memory transport whose far end (the "cloud") only answers when the schedule says so.
//! The sluice-spool crate's `tests/model.rs` checks the storage engine under file-system
//! faults; this one checks what sits on top: device acknowledgements after the commit, the
//! feeder's live and backlog streams, the outbox's window, resends and refusals, and restarts.
//!
//! A schedule's operations: a device publishes; time passes (commits, feeding, sending); the
//! cloud acknowledges one unit in flight (any order: the transport keys units by `SendId`),
//! or refuses it for now (`Temporary`: resent after the backoff) or for good (`Permanent`:
//! counted, finished); the link drops (everything unacknowledged is resent after the
//! reconnect); the gateway crashes (`kill -9`: every task and the queue are gone at once, the
//! spool's files stay as written) and restarts (recovery, everything unacknowledged becomes
//! backlog). The spool uses small segments, so records cross segment boundaries and trims run.
//!
//! Checked while it runs: the cloud only ever receives messages that were published, and
//! within one connection of one incarnation, each device's messages in each stream (live,
//! backlog) come in publish order, except that a resend in a later write (after a temporary
//! refusal's pause) goes back to the oldest unacknowledged; the queue stays within its byte bound. At the end the link
//! heals and the cloud acknowledges everything: every message a device got its PUBACK for
//! reaches the cloud (accepted at least once) or was refused for good, and the spool ends
//! with nothing unacknowledged.
//!
//! `PROPTEST_CASES` raises the number of schedules (default below).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use proptest::prelude::*;
use sluice::config::{UplinkConfig, UplinkUrl};
use sluice::message::ack::{AckToken, DeviceAcks};
use sluice::sink::outbox::{Feeders, Outbox, OutboxSeed};
use sluice::sink::spool::{encode_message, spool_dir, OpenedSpool, UplinkSpool};
use sluice::sink::transport::*;
use sluice::sink::{Lane, RejectReason, UplinkError, UplinkMetrics, UplinkQueue};
use sluice_proto::mqtt::QoS;
use tokio::sync::{watch, Notify};

const DEVICES: usize = 3;
const QUEUE_BYTES: usize = 64 << 10;

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Device `d` publishes its next message (QoS 1).
    Publish(usize),
    /// Time passes: commits, feeding and sending run.
    Tick,
    /// The cloud acknowledges the i-th unit waiting for an answer.
    Ack(usize),
    /// The cloud refuses the i-th unit waiting: for now (`false`) or for good (`true`).
    Refuse(usize, bool),
    /// The link drops.
    Cut,
    /// The gateway dies (kill -9) and starts again.
    Crash,
    /// Another message of device `d` is lost on its way (its token dropped unfinished): its
    /// connection closes and it reconnects. Under `ack = "cloud"` its messages still in the
    /// spool are not sent (it resends them) but acknowledged there.
    Abandon(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..DEVICES).prop_map(Op::Publish),
        4 => Just(Op::Tick),
        6 => (0usize..64).prop_map(Op::Ack),
        1 => (0usize..64, any::<bool>()).prop_map(|(i, p)| Op::Refuse(i, p)),
        1 => Just(Op::Cut),
        1 => Just(Op::Crash),
        1 => (0..DEVICES).prop_map(Op::Abandon),
    ]
}

/// One unit as the cloud got it.
#[derive(Debug, Clone)]
struct Sent {
    incarnation: u32,
    link: u64,
    device: usize,
    n: usize,
    resend: bool,
    backlog: bool,
    /// Which write (flush) carried it.
    flush: u64,
}

/// The far end: what it received, what waits for its answer, and the model's view of the
/// cloud (accepted and refused messages).
#[derive(Default)]
struct Far {
    /// Bumped by every cut; a connection made at another value is gone.
    link: u64,
    incarnation: u32,
    flushes: u64,
    sent: Vec<Sent>,
    /// Units of the current connection waiting for an answer, in arrival order.
    waiting: Vec<(SendId, (usize, usize))>,
    answers: Vec<Feedback>,
    /// Answer everything at once (the healed end of a schedule).
    auto_ack: bool,
    accepted: HashSet<(usize, usize)>,
    refused: HashSet<(usize, usize)>,
}

#[derive(Clone, Default)]
struct Cloud(Rc<RefCell<Far>>, Rc<Notify>);

impl Cloud {
    fn answer(&self, i: usize, refusal: Option<bool>) {
        let mut far = self.0.borrow_mut();
        if far.waiting.is_empty() {
            return;
        }
        let k = i % far.waiting.len();
        let (id, msg) = far.waiting.remove(k);
        let feedback = match refusal {
            None => {
                far.accepted.insert(msg);
                Feedback::Acked(id)
            }
            Some(false) => Feedback::Refused {
                id,
                code: 0x97,
                class: RefusalClass::Temporary,
            },
            Some(true) => {
                far.refused.insert(msg);
                Feedback::Refused {
                    id,
                    code: 0x87,
                    class: RefusalClass::Permanent(RejectReason::NotAuthorized),
                }
            }
        };
        far.answers.push(feedback);
        drop(far);
        self.1.notify_one();
    }

    fn cut(&self) {
        let mut far = self.0.borrow_mut();
        far.link += 1;
        far.waiting.clear();
        far.answers.clear();
        drop(far);
        self.1.notify_one();
    }
}

struct ModelTransport {
    cloud: Cloud,
    link: Option<u64>,
    pending: Vec<(Option<SendId>, Sent)>,
    next_id: u64,
}

fn parse_payload(p: &Bytes) -> (usize, usize) {
    let s = std::str::from_utf8(p).expect("utf-8");
    let (d, n) = s.split_once(':').expect("d:n");
    (d.parse().expect("device"), n.parse().expect("n"))
}

impl Transport for ModelTransport {
    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        self.link = Some(self.cloud.0.borrow().link);
        Ok(LinkLimits {
            window: 4,
            pack_limit: usize::MAX,
            keep_alive: None,
        })
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let Unit::Message { msg, resend } = unit else {
            panic!("aggregation is off: no packs");
        };
        let (device, n) = parse_payload(&msg.payload);
        self.next_id += 1;
        let id = msg.needs_cloud_ack().then_some(SendId(self.next_id));
        let far = self.cloud.0.borrow();
        let sent = Sent {
            incarnation: far.incarnation,
            link: self.link.unwrap_or(u64::MAX),
            device,
            n,
            resend,
            backlog: msg.is_backlog(),
            flush: 0,
        };
        self.pending.push((id, sent));
        Ok(id)
    }

    fn pending_bytes(&self) -> usize {
        self.pending.len() * 16
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        let mut far = self.cloud.0.borrow_mut();
        if self.link != Some(far.link) {
            return Err(UplinkError::ClosedByCloud);
        }
        far.flushes += 1;
        for (id, mut sent) in self.pending.drain(..) {
            sent.flush = far.flushes;
            let msg = (sent.device, sent.n);
            far.sent.push(sent);
            let id = id.expect("QoS 1 only");
            if far.auto_ack {
                far.accepted.insert(msg);
                far.answers.push(Feedback::Acked(id));
            } else {
                far.waiting.push((id, msg));
            }
        }
        drop(far);
        self.cloud.1.notify_one();
        Ok(())
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        loop {
            {
                let mut far = self.cloud.0.borrow_mut();
                if self.link != Some(far.link) {
                    return Err(UplinkError::ClosedByCloud);
                }
                if !far.answers.is_empty() {
                    feedback.append(&mut far.answers);
                    return Ok(());
                }
            }
            let wake = self.cloud.1.clone();
            wake.notified().await;
        }
    }

    fn abort(&mut self) {
        self.link = None;
        self.pending.clear();
    }
}

/// What outlives a crash: the devices, the cloud and the model.
struct World {
    dir: tempfile::TempDir,
    /// `ack = "cloud"` (the device's PUBACK after the cloud's) instead of `"spool"`.
    ack_cloud: bool,
    /// `when_full = "drop-oldest"` with a spool of two small segments (else `block`, and
    /// room for everything).
    drop_oldest: bool,
    /// Records drop-oldest removed (counted) in the incarnations before this one, and in it.
    dropped_before: u64,
    dropped_now: u64,
    cloud: Cloud,
    devices: Vec<Rc<DeviceAcks>>,
    /// Messages published per device.
    published: Vec<usize>,
    /// Messages each device got its PUBACK for.
    device_acked: HashSet<(usize, usize)>,
}

impl World {
    fn new(ack_cloud: bool, drop_oldest: bool) -> World {
        World {
            dir: tempfile::tempdir().expect("tempdir"),
            ack_cloud,
            drop_oldest,
            dropped_before: 0,
            dropped_now: 0,
            cloud: Cloud::default(),
            devices: (0..DEVICES).map(|_| DeviceAcks::new()).collect(),
            published: vec![0; DEVICES],
            device_acked: HashSet::new(),
        }
    }

    fn collect_device_acks(&mut self) {
        for (d, acks) in self.devices.iter().enumerate() {
            for pid in acks.drain() {
                self.device_acked.insert((d, usize::from(pid) - 1));
            }
        }
    }

    /// The checks that hold at every moment.
    fn check(&self) {
        let far = self.cloud.0.borrow();
        let mut last: HashMap<(u32, u64, bool, usize), &Sent> = HashMap::new();
        for s in &far.sent {
            assert!(
                s.n < self.published[s.device],
                "the cloud got d{}:{} which was never published",
                s.device,
                s.n
            );
            // Within one connection and stream a device's messages go in publish order; only
            // a resend in a later write (after a refusal's pause) may go back.
            let key = (s.incarnation, s.link, s.backlog, s.device);
            if let Some(prev) = last.insert(key, s) {
                assert!(
                    s.n > prev.n || (s.resend && s.flush != prev.flush),
                    "device {} out of order in one stream of one connection: {prev:?} then {s:?}",
                    s.device,
                );
            }
        }
    }
}

/// One incarnation of the gateway: the spool, its tasks and the outbox.
struct Gateway {
    spool: Rc<UplinkSpool>,
    queue: Rc<UplinkQueue>,
    shutdown: watch::Sender<bool>,
}

fn start(world: &World) -> Gateway {
    let config = sluice::config::parse(&format!(
        "[spool]\ndir = \"{}\"\nfsync = \"never\"\nack = \"{}\"\nwhen_full = \"{}\"\n",
        world.dir.path().display(),
        if world.ack_cloud { "cloud" } else { "spool" },
        if world.drop_oldest {
            "drop-oldest"
        } else {
            "block"
        },
    ))
    .expect("config");
    let mut engine = config.spool.engine_config(1, 1, 256, 64);
    // Small segments: records cross segment boundaries and acknowledged ones get trimmed.
    engine.segment_bytes = 512;
    engine.max_bytes = if world.drop_oldest { 1024 } else { 16 << 20 };
    let sdir = spool_dir(world.dir.path(), "cloud", 0);
    let (engine_spool, _) = sluice_spool::Spool::open(&sdir, engine.clone()).expect("open");
    let opened = OpenedSpool {
        spool: engine_spool,
        dir: sdir,
        engine,
        metrics: Arc::default(),
    };
    let queue = Rc::new(UplinkQueue::new(QUEUE_BYTES));
    let spool = UplinkSpool::new(0, "cloud", &config, opened, queue.clone());
    let (shutdown, rx) = watch::channel(false);
    spool.spawn_tasks(rx.clone());

    let mut cfg = UplinkConfig::new(
        "cloud",
        UplinkUrl {
            tls: false,
            host: "far.invalid".into(),
            port: 1,
        },
    );
    cfg.inflight = 4;
    cfg.connect_timeout = Duration::from_secs(5);
    cfg.reconnect_min = Duration::from_millis(1);
    cfg.reconnect_max = Duration::from_millis(5);
    cfg.refused_retry_min = Duration::from_millis(1);
    cfg.refused_retry_max = Duration::from_millis(5);
    let mut feeders = Feeders::default();
    let hook = spool.clone();
    feeders.attach(
        config.spool.drain_share,
        Box::new(move |up| hook.link_changed(up)),
    );
    let seed = OutboxSeed {
        shard: 0,
        lane: Lane::Normal,
        cfg: Rc::new(cfg),
        queue: queue.clone(),
        metrics: Arc::new(UplinkMetrics::new()),
        live_devices: Arc::new(AtomicUsize::new(0)),
        feeders,
    };
    let transport = ModelTransport {
        cloud: world.cloud.clone(),
        link: None,
        pending: Vec::new(),
        next_id: 0,
    };
    tokio::task::spawn_local(Outbox::new(seed, transport).run(rx));
    Gateway {
        spool,
        queue,
        shutdown,
    }
}

/// Runs `ops` on one incarnation until a crash (returns how many ops it consumed), or to the
/// end, then heals and checks that everything acknowledged arrives (returns `None`).
async fn incarnation(world: &mut World, ops: &[Op]) -> Option<usize> {
    // Every device reconnects to the new process: new connections.
    world.devices = (0..DEVICES).map(|_| DeviceAcks::new()).collect();
    let gw = start(world);
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Publish(d) => {
                let n = world.published[d];
                world.published[d] += 1;
                let payload = Bytes::from(format!("{d}:{n}"));
                let device = ByteString::from(format!("d{d}"));
                let topic = ByteString::from(format!("t/{d}"));
                let body = encode_message(
                    &device,
                    &topic,
                    &payload,
                    QoS::AtLeastOnce,
                    false,
                    Instant::now(),
                )
                .expect("encodes");
                let token = AckToken::new(&world.devices[d], u16::try_from(n + 1).expect("pid"));
                gw.spool.append(&body, QoS::AtLeastOnce, Some(token)).await;
            }
            Op::Tick => tokio::time::sleep(Duration::from_millis(2)).await,
            Op::Ack(k) => world.cloud.answer(k, None),
            Op::Refuse(k, permanent) => world.cloud.answer(k, Some(permanent)),
            Op::Cut => world.cloud.cut(),
            Op::Crash => {
                world.dropped_before += std::mem::take(&mut world.dropped_now);
                return Some(i + 1);
            }
            Op::Abandon(d) => {
                world.collect_device_acks();
                drop(AckToken::new(&world.devices[d], u16::MAX));
                world.devices[d] = DeviceAcks::new();
            }
        }
        tokio::task::yield_now().await;
        world.dropped_now = gw.spool.metrics().dropped_oldest.get();
        world.collect_device_acks();
        world.check();
        assert!(
            gw.queue.reserved_bytes() <= QUEUE_BYTES,
            "the queue holds {} bytes, bound {QUEUE_BYTES}",
            gw.queue.reserved_bytes()
        );
    }
    // Healed: the cloud answers everything, until every acknowledged message is there.
    world.cloud.0.borrow_mut().auto_ack = true;
    world.cloud.cut();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        world.collect_device_acks();
        world.check();
        let lost: Vec<(usize, usize)> = {
            let far = world.cloud.0.borrow();
            let mut v: Vec<_> = world
                .device_acked
                .iter()
                .filter(|m| !far.accepted.contains(m) && !far.refused.contains(m))
                .copied()
                .collect();
            v.sort_unstable();
            v
        };
        let unacked = gw.spool.metrics().unacked_records.get();
        // Drop-oldest may remove acknowledged messages: the configured policy, counted.
        let dropped = world.dropped_before + gw.spool.metrics().dropped_oldest.get();
        if lost.len() as u64 <= dropped && unacked == 0 {
            world.dropped_now = gw.spool.metrics().dropped_oldest.get();
            break;
        }
        assert!(
            Instant::now() < deadline,
            "acknowledged to their devices and not at the cloud: {lost:?}; spool unacked {unacked}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = gw.shutdown.send(true);
    None
}

fn run(ack_cloud: bool, drop_oldest: bool, ops: &[Op]) {
    let mut world = World::new(ack_cloud, drop_oldest);
    let mut rest = ops;
    loop {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let local = tokio::task::LocalSet::new();
        let crashed = local.block_on(&rt, incarnation(&mut world, rest));
        // kill -9: every task, the queue and what was in flight are gone (the runtime waits
        // for a commit or read job already running on the blocking pool, as the kernel
        // finishes a write already issued).
        drop(local);
        drop(rt);
        world.cloud.0.borrow_mut().incarnation += 1;
        world.cloud.cut();
        match crashed {
            Some(used) => rest = &rest[used..],
            None => break,
        }
    }
    let far = world.cloud.0.borrow();
    if std::env::var("MODEL_STATS").is_ok() {
        let counts: BTreeMap<&str, usize> = [
            ("published", world.published.iter().sum()),
            ("device_acked", world.device_acked.len()),
            ("sent", far.sent.len()),
            ("accepted", far.accepted.len()),
            ("refused", far.refused.len()),
            ("incarnations", far.incarnation as usize),
            (
                "dropped_oldest",
                (world.dropped_before + world.dropped_now) as usize,
            ),
        ]
        .into_iter()
        .collect();
        eprintln!("model stats: {counts:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn delivery_through_spool_and_outbox_matches_the_model(
        ack_cloud in any::<bool>(),
        drop_oldest in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        run(ack_cloud, drop_oldest, &ops);
    }
}

/// Found by this model: under `ack = "cloud"`, a record whose device connection was abandoned
/// is acknowledged in the spool instead of being sent, but no commit was asked for: the
/// cursor stayed unpersisted and `sluice_spool_unacked_records` stale until something else
/// happened (on an idle gateway: never; after a restart the record was sent again).
#[test]
fn a_record_skipped_for_an_abandoned_device_is_committed() {
    use Op::*;
    run(true, false, &[Publish(0), Abandon(0), Tick, Tick]);
}
