//! Observers on a real shard context (trie, router, control plane, retained store) with a
//! recording [`CoapOut`] double whose CON outcomes the tests decide.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use sluice_proto::mqtt::{Properties, QoS};
use tokio::sync::{mpsc, oneshot};

use super::notify::CON_EVERY;
use super::*;
use crate::config::Config;
use crate::control::priority::Priority;
use crate::control::{ControlMetrics, ControlPlane, SubscriptionSnapshot};
use crate::edge::coap::ConOutcome;
use crate::message::DeviceMessage;
use crate::shard::limits::ShardBounds;
use crate::shard::metrics::ShardMetrics;
use crate::shard::trie::TopicTrie;
use crate::shard::{Routed, ShardCmd};

/// Records what the observers send; CONs wait for the test to answer them.
#[derive(Default)]
struct TestOut {
    sent: RefCell<Vec<(SocketAddr, Message)>>,
    cons: RefCell<VecDeque<oneshot::Sender<ConOutcome>>>,
    mid: Cell<u16>,
}

impl CoapOut for TestOut {
    fn send(&self, peer: SocketAddr, msg: &Message) {
        self.sent.borrow_mut().push((peer, msg.clone()));
    }
    fn send_con(&self, peer: SocketAddr, mut msg: Message) -> oneshot::Receiver<ConOutcome> {
        msg.message_id = self.next_message_id();
        self.sent.borrow_mut().push((peer, msg));
        let (tx, rx) = oneshot::channel();
        self.cons.borrow_mut().push_back(tx);
        rx
    }
    fn send_con_limited(
        &self,
        peer: SocketAddr,
        msg: Message,
        _max_retransmit: u8,
    ) -> oneshot::Receiver<ConOutcome> {
        self.send_con(peer, msg)
    }

    /// The unit tests' observers are at verified addresses (the 3× rule is tested end to
    /// end in `tests/coap_hostile.rs`).
    fn verified(&self, _peer: SocketAddr) -> bool {
        true
    }

    fn next_message_id(&self) -> u16 {
        self.mid.set(self.mid.get().wrapping_add(1));
        self.mid.get()
    }
}

impl TestOut {
    fn count(&self) -> usize {
        self.sent.borrow().len()
    }
    fn last(&self) -> Message {
        self.sent
            .borrow()
            .last()
            .expect("something was sent")
            .1
            .clone()
    }
    fn answer_con(&self, outcome: ConOutcome) {
        let tx = self
            .cons
            .borrow_mut()
            .pop_front()
            .expect("a CON is outstanding");
        tx.send(outcome).expect("the observer waits for it");
    }
}

fn run<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&rt, f)
}

/// A one-shard context with a running control plane.
fn shard(config: Config) -> Rc<ShardContext> {
    let (mut shards, _inboxes) = shards(config, 1);
    shards.remove(0)
}

/// `n` shard contexts sharing a running control plane and snapshot, and their inboxes.
fn shards(config: Config, n: usize) -> (Vec<Rc<ShardContext>>, Vec<mpsc::Receiver<ShardCmd>>) {
    let config = Arc::new(config);
    let snapshot = Arc::new(ArcSwap::from_pointee(SubscriptionSnapshot::default()));
    let (control, inbox) = mpsc::channel(64);
    let metrics: Arc<ControlMetrics> = Arc::default();
    let plane = ControlPlane::new(n, 100, snapshot.clone(), metrics);
    tokio::task::spawn_local(plane.run(inbox));
    let (mailboxes, inboxes): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel(64)).unzip();
    let ctxs = (0..n)
        .map(|id| {
            let metrics = Arc::new(ShardMetrics::default());
            Rc::new(ShardContext {
                id,
                config: config.clone(),
                mailboxes: mailboxes.clone(),
                control: control.clone(),
                snapshot: snapshot.clone(),
                subs: RefCell::new(TopicTrie::new()),
                filter_refs: RefCell::new(HashMap::new()),
                sessions: RefCell::new(HashMap::new()),
                uplinks: Default::default(),
                rules: crate::control::live::Rules::new(&config),
                acl: crate::control::acl::Acl::allow_all(),
                limits: Arc::default(),
                metrics: metrics.clone(),
                live_connections: Arc::default(),
                online_devices: Arc::default(),
                shutting_down: Cell::new(false),
                bounds: ShardBounds::new(&config, n, metrics, Arc::default()),
                delivery_seq: Cell::new(0),
                shared: RefCell::new(HashMap::new()),
                share_turn: Cell::new(0),
                proxies: crate::proxy::ShardProxies::default(),
                state: None,
            })
        })
        .collect();
    (ctxs, inboxes)
}

fn setup(config: Config) -> (Rc<ShardContext>, Rc<TestOut>, Rc<Observers>) {
    let ctx = shard(config);
    let out = Rc::new(TestOut::default());
    let obs = Observers::new(ctx.clone(), out.clone());
    (ctx, out, obs)
}

fn peer(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn get(token: u64, observe: Option<u32>) -> Message {
    let mut m = Message::new(MsgType::Con, Code::GET, 7, Token::from_u64(token));
    if let Some(o) = observe {
        m.add_uint_option(opt::OBSERVE, o);
    }
    m
}

async fn observe(obs: &Rc<Observers>, port: u16, token: u64, filter: &str) -> Message {
    let dev = ByteString::from("sensor-1");
    obs.on_get(peer(port), &dev, &get(token, Some(0)), filter)
        .await
}

/// What an MQTT device's PUBLISH becomes on its shard: `router::publish`.
async fn publish(ctx: &Rc<ShardContext>, topic: &str, payload: &str, props: Option<Properties>) {
    publish_full(ctx, topic, payload, props, false).await
}

async fn publish_full(
    ctx: &Rc<ShardContext>,
    topic: &str,
    payload: &str,
    props: Option<Properties>,
    retain: bool,
) {
    let msg = DeviceMessage {
        device: "mqtt-dev".into(),
        topic: ByteString::from(topic),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
        qos: QoS::AtLeastOnce,
        retain,
        properties: props.map(Box::new),
        received_at: Instant::now(),
        ack: None,
    };
    router::publish(ctx, Box::new(msg), Priority::Normal).await;
}

/// Let the notification tasks and the control plane run.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

fn subscribers(ctx: &ShardContext, topic: &str) -> usize {
    let mut n = 0;
    ctx.subs.borrow().for_each_match(topic, |_| n += 1);
    n
}

fn observe_of(m: &Message) -> Option<u32> {
    m.uint_option(opt::OBSERVE)
}

#[test]
fn a_published_message_becomes_a_notification_with_the_observers_token() {
    run(async {
        let (ctx, out, obs) = setup(Config::default());
        let resp = observe(&obs, 5001, 0xA1, "sensors/+/temp").await;
        assert_eq!(resp.code, Code::CONTENT);
        assert!(resp.payload.is_empty(), "no retained message for a filter");
        let first = observe_of(&resp).expect("the registration is confirmed with Observe");
        assert_eq!(obs.len(), 1);
        assert_eq!(subscribers(&ctx, "sensors/kitchen/temp"), 1);
        assert!(ctx.snapshot.load().pending.is_empty() || ctx.mailboxes.len() < 2);

        let props = Properties {
            content_type: Some("application/json".into()),
            ..Properties::default()
        };
        publish(&ctx, "sensors/kitchen/temp", "{\"t\":21}", Some(props)).await;
        publish(&ctx, "sensors/kitchen/humidity", "no", None).await;
        settle().await;
        assert_eq!(out.count(), 1, "only the matching topic notifies");
        let (to, n) = out.sent.borrow()[0].clone();
        assert_eq!(to, peer(5001));
        assert_eq!(n.mtype, MsgType::Non);
        assert_eq!(n.code, Code::CONTENT);
        assert_eq!(n.token, Token::from_u64(0xA1));
        assert_eq!(&n.payload[..], b"{\"t\":21}");
        assert_eq!(n.uint_option(opt::CONTENT_FORMAT), Some(50));
        let second = observe_of(&n).expect("a notification carries Observe");
        assert!(second > first, "Observe increases: {first} then {second}");

        // The cloud's `receive` reaches the observer too.
        let routed = Routed {
            origin: ByteString::from_static(""),
            topic: "sensors/hall/temp".into(),
            payload: Bytes::from_static(b"from-cloud"),
            qos: QoS::AtMostOnce,
            retain: false,
            properties: None,
        };
        router::deliver_downlink(&ctx, routed).await;
        settle().await;
        assert_eq!(out.count(), 2);
        let n = out.last();
        assert_eq!(&n.payload[..], b"from-cloud");
        assert_eq!(n.uint_option(opt::CONTENT_FORMAT), None);
        assert!(observe_of(&n).unwrap() > second);
        let m = &ctx.metrics.coap_observe;
        assert_eq!(m.notifications_non.get(), 2);
        assert_eq!(m.registrations.get(), 1);
        assert_eq!(m.observers.get(), 1);
    });
}

#[test]
fn retained_messages_answer_registrations_and_plain_gets() {
    run(async {
        let (ctx, _out, obs) = setup(Config::default());
        let props = Properties {
            content_type: Some("text/plain".into()),
            ..Properties::default()
        };
        publish_full(&ctx, "state/door", "open", Some(props), true).await;
        let resp = observe(&obs, 5002, 1, "state/door").await;
        assert_eq!(resp.code, Code::CONTENT);
        assert_eq!(&resp.payload[..], b"open");
        assert_eq!(resp.uint_option(opt::CONTENT_FORMAT), Some(0));
        assert!(observe_of(&resp).is_some());

        let dev = ByteString::from("sensor-2");
        let plain = obs
            .on_get(peer(5003), &dev, &get(9, None), "state/door")
            .await;
        assert_eq!(plain.code, Code::CONTENT);
        assert_eq!(&plain.payload[..], b"open");
        assert_eq!(observe_of(&plain), None);
        assert_eq!(obs.len(), 1, "a plain GET registers nothing");

        let none = obs
            .on_get(peer(5003), &dev, &get(9, None), "state/window")
            .await;
        assert_eq!(none.code, Code::NOT_FOUND);
        assert!(
            !none.payload.is_empty(),
            "4.04 carries a diagnostic payload"
        );

        let bad = obs
            .on_get(peer(5003), &dev, &get(9, Some(0)), "a/#/b")
            .await;
        assert_eq!(bad.code, Code::BAD_REQUEST);
        let shared = obs
            .on_get(peer(5003), &dev, &get(9, Some(0)), "$share/g/a")
            .await;
        assert_eq!(shared.code, Code::BAD_REQUEST);
        assert_eq!(obs.len(), 1);
    });
}

#[test]
fn every_24th_notification_is_con_and_others_queue_behind_it() {
    run(async {
        let mut config = Config::default();
        config.coap.max_queued_notifications = 4;
        let (ctx, out, obs) = setup(config);
        observe(&obs, 5004, 2, "burst/#").await;
        for i in 0..30 {
            publish(&ctx, "burst/x", &format!("m{i}"), None).await;
        }
        settle().await;
        let types: Vec<MsgType> = out.sent.borrow().iter().map(|(_, m)| m.mtype).collect();
        assert_eq!(types.len(), CON_EVERY as usize, "sending stops at the CON");
        assert!(types[..23].iter().all(|t| *t == MsgType::Non));
        assert_eq!(types[23], MsgType::Con, "the 24th is confirmable");
        // 6 waited behind the CON; the 2 oldest were dropped at max_queued_notifications.
        let m = &ctx.metrics.coap_observe;
        assert_eq!(m.dropped[NotificationDrop::QueueFull as usize].get(), 2);
        assert!(
            ctx.bounds.outbox.used() > 0,
            "queued notifications are charged"
        );

        out.answer_con(ConOutcome::Acked);
        settle().await;
        let sent = out.sent.borrow().clone();
        assert_eq!(sent.len(), 28);
        let tail: Vec<&[u8]> = sent[24..].iter().map(|(_, m)| &m.payload[..]).collect();
        assert_eq!(
            tail,
            [&b"m26"[..], b"m27", b"m28", b"m29"],
            "the newest are kept"
        );
        let seqs: Vec<u32> = sent.iter().map(|(_, m)| observe_of(m).unwrap()).collect();
        assert!(
            seqs.windows(2).all(|w| w[1] > w[0]),
            "Observe increases: {seqs:?}"
        );
        assert_eq!(
            ctx.bounds.outbox.used(),
            0,
            "sent notifications are released"
        );

        // The count restarts after a CON: the next CON is 24 notifications later.
        for i in 0..CON_EVERY {
            publish(&ctx, "burst/y", &format!("n{i}"), None).await;
        }
        settle().await;
        // 4 NON went after the first CON, so the 20th of these 24 is the next CON.
        let sent = out.sent.borrow().clone();
        assert_eq!(sent.len(), 48);
        let cons: Vec<usize> = (0..sent.len())
            .filter(|i| sent[*i].1.mtype == MsgType::Con)
            .collect();
        assert_eq!(cons, [23, 47]);
        out.answer_con(ConOutcome::Acked);
        settle().await;
        assert_eq!(out.count(), 52);
        assert_eq!(m.notifications_con.get(), 2);
        assert_eq!(m.notifications_non.get(), 50);
    });
}

#[test]
fn rst_of_a_non_notification_deregisters_and_frees_the_subscription() {
    run(async {
        let (ctx, out, obs) = setup(Config::default());
        observe(&obs, 5005, 3, "rst/t").await;
        publish(&ctx, "rst/t", "one", None).await;
        settle().await;
        let mid = out.last().message_id;
        obs.on_reset(peer(5006), mid);
        assert_eq!(obs.len(), 1, "an RST from another peer does not match");
        obs.on_reset(peer(5005), mid.wrapping_add(100));
        assert_eq!(obs.len(), 1, "an RST for another message id does not match");
        assert!(obs.reset_matched(peer(5005), mid));
        assert_eq!(obs.len(), 0);
        assert!(!obs.reset_matched(peer(5005), mid), "only once");
        settle().await;
        assert_eq!(
            subscribers(&ctx, "rst/t"),
            0,
            "the subscription left the trie"
        );
        assert!(ctx.filter_refs.borrow().is_empty());
        assert!(
            ctx.snapshot.load().trie.is_empty(),
            "the control plane forgot it"
        );
        publish(&ctx, "rst/t", "two", None).await;
        settle().await;
        assert_eq!(out.count(), 1, "no notification after the RST");
        let m = &ctx.metrics.coap_observe;
        assert_eq!(m.deregistrations[Deregistration::Reset as usize].get(), 1);
        assert_eq!(m.observers.get(), 0);
    });
}

#[test]
fn rst_or_silence_on_a_con_notification_deregisters_and_releases_the_queue() {
    for (outcome, why) in [
        (ConOutcome::Reset, Deregistration::Reset),
        (ConOutcome::TimedOut, Deregistration::Silence),
    ] {
        run(async {
            let (ctx, out, obs) = setup(Config::default());
            observe(&obs, 5007, 4, "c/t").await;
            for i in 0..CON_EVERY + 3 {
                publish(&ctx, "c/t", &format!("{i}"), None).await;
            }
            settle().await;
            assert_eq!(out.last().mtype, MsgType::Con);
            assert!(ctx.bounds.outbox.used() > 0);
            out.answer_con(outcome);
            settle().await;
            assert_eq!(obs.len(), 0, "{outcome:?} deregisters");
            assert_eq!(subscribers(&ctx, "c/t"), 0);
            assert_eq!(ctx.bounds.outbox.used(), 0, "queued notifications released");
            assert_eq!(
                out.count(),
                CON_EVERY as usize,
                "nothing sent after {outcome:?}"
            );
            let m = &ctx.metrics.coap_observe;
            assert_eq!(m.deregistrations[why as usize].get(), 1);
        });
    }
}

#[test]
fn re_registration_replaces_and_a_get_without_observe_deregisters() {
    run(async {
        let (ctx, out, obs) = setup(Config::default());
        let first = observe(&obs, 5008, 5, "room/1").await;
        let second = observe(&obs, 5008, 5, "room/2").await;
        assert_eq!(obs.len(), 1, "same endpoint and token: replaced");
        assert_eq!(
            obs.filter_of(peer(5008), Token::from_u64(5)).as_deref(),
            Some("room/2")
        );
        assert!(observe_of(&second).unwrap() > observe_of(&first).unwrap());
        // Another token of the same peer is another observer.
        observe(&obs, 5008, 6, "room/1").await;
        assert_eq!(obs.len(), 2);
        settle().await;
        assert_eq!(
            subscribers(&ctx, "room/1"),
            1,
            "the replaced subscription is gone"
        );
        assert_eq!(subscribers(&ctx, "room/2"), 1);

        publish(&ctx, "room/2", "to-5", None).await;
        settle().await;
        assert_eq!(out.count(), 1);
        assert_eq!(out.last().token, Token::from_u64(5));
        let last_seq = observe_of(&out.last()).unwrap();

        let dev = ByteString::from("sensor-1");
        let bye = obs
            .on_get(peer(5008), &dev, &get(5, Some(1)), "room/2")
            .await;
        assert_eq!(bye.code, Code::CONTENT);
        assert_eq!(
            observe_of(&bye),
            None,
            "a deregistration is answered without Observe"
        );
        assert_eq!(obs.len(), 1);
        assert_eq!(subscribers(&ctx, "room/2"), 0, "gone before the answer");
        let bye = obs.on_get(peer(5008), &dev, &get(6, None), "room/1").await;
        assert_eq!(bye.code, Code::CONTENT, "a plain GET also deregisters");
        assert_eq!(obs.len(), 0);
        publish(&ctx, "room/2", "late", None).await;
        publish(&ctx, "room/1", "late", None).await;
        settle().await;
        assert_eq!(out.count(), 1);
        let m = &ctx.metrics.coap_observe;
        assert_eq!(
            m.deregistrations[Deregistration::Replaced as usize].get(),
            1
        );
        assert_eq!(m.deregistrations[Deregistration::Get as usize].get(), 2);
        assert!(last_seq > 0);
    });
}

#[test]
fn registrations_beyond_the_shards_share_get_503_with_max_age() {
    run(async {
        let mut config = Config::default();
        config.coap.max_observers = 2;
        let (ctx, _out, obs) = setup(config);
        assert_eq!(obs.limit(), 2);
        observe(&obs, 5009, 1, "l/1").await;
        observe(&obs, 5009, 2, "l/2").await;
        let full = observe(&obs, 5009, 3, "l/3").await;
        assert_eq!(full.code, Code::SERVICE_UNAVAILABLE);
        assert_eq!(full.uint_option(opt::MAX_AGE), Some(2));
        assert_eq!(obs.len(), 2);
        assert_eq!(subscribers(&ctx, "l/3"), 0);
        // Replacing an existing one is not a new observer.
        let again = observe(&obs, 5009, 2, "l/3").await;
        assert_eq!(again.code, Code::CONTENT);
        assert_eq!(ctx.metrics.coap_observe.refused.get(), 1);
    });
}

#[test]
fn expired_messages_and_oversized_ones_that_cannot_be_kept_are_not_notified() {
    run(async {
        let mut config = Config::default();
        config.coap.max_message_size = crate::config::ByteSize(64);
        // No room for the representation of a block-wise notification: dropped, counted.
        config.coap.max_snapshot_bytes = crate::config::ByteSize(0);
        let (ctx, out, obs) = setup(config);
        observe(&obs, 5010, 7, "x").await;
        publish(&ctx, "x", &"z".repeat(100), None).await;
        let props = Properties {
            message_expiry_interval: Some(30),
            ..Properties::default()
        };
        publish(&ctx, "x", "fresh", Some(props)).await;
        settle().await;
        assert_eq!(out.count(), 1);
        let n = out.last();
        assert_eq!(&n.payload[..], b"fresh");
        assert_eq!(
            n.uint_option(opt::MAX_AGE),
            Some(30),
            "Max-Age from the expiry"
        );
        let m = &ctx.metrics.coap_observe;
        assert_eq!(m.dropped[NotificationDrop::TooLarge as usize].get(), 1);
        let mut w = crate::telemetry::metrics::PromWriter::new();
        ctx.metrics.render(&mut w, "0");
        let text = w.finish();
        assert!(
            text.contains("sluice_coap_observers{shard=\"0\"} 1"),
            "{text}"
        );
        assert!(text.contains("sluice_coap_notifications_total{shard=\"0\",type=\"non\"} 1"));
    });
}

#[test]
fn a_message_published_on_another_shard_reaches_the_observer_through_its_mailbox() {
    run(async {
        let mut config = Config::default();
        config.coap.max_observers = 4;
        let (ctxs, mut inboxes) = shards(config, 2);
        let (publisher, observer) = (ctxs[0].clone(), ctxs[1].clone());
        // Shard 1's command loop, as `shard::run` does it for deliveries.
        let mut inbox = inboxes.remove(1);
        let loop_ctx = observer.clone();
        tokio::task::spawn_local(async move {
            while let Some(cmd) = inbox.recv().await {
                if let ShardCmd::Deliver(routed) = cmd {
                    router::deliver_local(&loop_ctx, &routed);
                }
            }
        });
        let out = Rc::new(TestOut::default());
        let obs = Observers::new(observer.clone(), out.clone());
        assert_eq!(obs.limit(), 2, "max_observers is split over the shards");
        observe(&obs, 5011, 8, "far/+").await;
        publish(&publisher, "far/away", "crossed", None).await;
        settle().await;
        assert_eq!(out.count(), 1);
        assert_eq!(&out.last().payload[..], b"crossed");
        assert_eq!(publisher.metrics.cross_shard_sent.get(), 1);

        let dev = ByteString::from("sensor-1");
        obs.on_get(peer(5011), &dev, &get(8, Some(1)), "far/+")
            .await;
        settle().await;
        assert!(
            observer.snapshot.load().trie.is_empty(),
            "the filter left the snapshot"
        );
        publish(&publisher, "far/away", "not any more", None).await;
        settle().await;
        assert_eq!(out.count(), 1);
    });
}

#[test]
fn an_oversized_message_is_notified_as_block_0_and_its_snapshot_stays_within_its_bytes() {
    run(async {
        let mut config = Config::default();
        config.coap.max_message_size = crate::config::ByteSize(64);
        // Room for one 100-byte body (+ filter + overhead) at a time.
        config.coap.max_snapshot_bytes =
            crate::config::ByteSize((100 + 1 + super::SNAPSHOT_OVERHEAD) as u64);
        let (ctx, out, obs) = setup(config);
        observe(&obs, 5012, 7, "x").await;
        observe(&obs, 5013, 8, "x").await;
        publish(&ctx, "x", &"z".repeat(100), None).await;
        settle().await;
        let sent = out.sent.borrow().clone();
        let blocks: Vec<_> = sent
            .iter()
            .filter(|(_, m)| m.option(opt::BLOCK2).is_some())
            .collect();
        assert_eq!(blocks.len(), 2, "{sent:?}");
        for (_, n) in &blocks {
            assert!(n.to_udp().len() <= 64);
            assert_eq!(n.uint_option(opt::SIZE2), Some(100));
            assert!(n.option(opt::ETAG).is_some());
        }
        assert_eq!(blocks[0].1.option(opt::ETAG), blocks[1].1.option(opt::ETAG));
        // One snapshot fits: the second observer's replaced the first's.
        let held = obs.snapshots.borrow().bytes();
        assert_eq!(held, 100 + 1 + super::SNAPSHOT_OVERHEAD);
        assert_eq!(ctx.metrics.coap_observe.snapshot_bytes.get(), held as i64);
        assert_eq!(ctx.metrics.coap_observe.blockwise.get(), 2);
    });
}
