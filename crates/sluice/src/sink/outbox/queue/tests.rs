use super::*;
use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::QoS;
use std::time::Instant;

fn msg(topic: &str, payload_len: usize, qos: QoS) -> UplinkMessage {
    UplinkMessage {
        device: ByteString::from_static("dev"),
        topic: ByteString::from(topic),
        payload: Bytes::from(vec![7u8; payload_len]),
        qos,
        retain: false,
        received_at: Instant::now(),
        ack: None,
        content_type: None,
        user_properties: None,
        stored: None,
    }
}

fn rt() -> (tokio::runtime::Runtime, tokio::task::LocalSet) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (rt, tokio::task::LocalSet::new())
}

async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[test]
fn queue_is_bounded_by_bytes_not_messages() {
    let m = Arc::new(UplinkMetrics::new());
    // Each message costs 1 + 36 + overhead bytes; three fit, a fourth does not.
    let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
    let q = UplinkQueue::with_metrics(3 * one, m.clone());
    for _ in 0..3 {
        q.try_push(msg("t", 36, QoS::AtMostOnce)).unwrap();
    }
    assert!(q.is_full());
    assert!(q.try_push(msg("t", 0, QoS::AtMostOnce)).is_err());
    assert_eq!(q.len(), 3);
    assert_eq!(q.reserved_bytes(), 3 * one);
    assert_eq!(m.queue_messages.get(), 3);
    assert_eq!(m.queue_bytes.get(), (3 * one) as i64);
    assert_eq!(m.dropped(DropReason::QueueFull), 1);
}

#[test]
fn the_oldest_waiting_messages_age_is_reported_and_cleared_when_none_waits() {
    let m = Arc::new(UplinkMetrics::new());
    let q = UplinkQueue::with_metrics(1 << 20, m.clone());
    assert_eq!(m.queue_oldest_age(), None);
    let mut old = msg("t", 1, QoS::AtLeastOnce);
    old.received_at = Instant::now() - std::time::Duration::from_secs(3);
    q.try_push(old).unwrap();
    q.try_push(msg("t", 1, QoS::AtLeastOnce)).unwrap();
    let age = m.queue_oldest_age().expect("a message waits");
    assert!(age >= std::time::Duration::from_secs(3), "{age:?}");
    assert!(age < std::time::Duration::from_secs(10), "{age:?}");
    // The old one leaves (inflight): the age is the younger one's.
    let _inflight = q.take_front(true).unwrap();
    assert!(m.queue_oldest_age().unwrap() < std::time::Duration::from_secs(3));
    let _second = q.take_front(true).unwrap();
    assert_eq!(m.queue_oldest_age(), None, "nothing waits");
}

#[test]
fn bytes_stay_reserved_while_inflight_and_are_freed_on_release() {
    let m = Arc::new(UplinkMetrics::new());
    let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
    let q = UplinkQueue::with_metrics(2 * one, m.clone());
    q.try_push(msg("t", 36, QoS::AtLeastOnce)).unwrap();
    q.try_push(msg("t", 36, QoS::AtLeastOnce)).unwrap();
    let taken = q.take_front(true).unwrap();
    assert_eq!(q.len(), 1);
    // Taken (inflight) but not finished: still counts against the bound.
    assert!(q.try_push(msg("t", 36, QoS::AtMostOnce)).is_err());
    q.release(taken.msg.cost());
    assert_eq!(m.queue_bytes.get(), one as i64);
    q.try_push(msg("t", 36, QoS::AtMostOnce)).unwrap();
}

#[test]
fn push_waits_while_full_and_resumes_after_release() {
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let m = Arc::new(UplinkMetrics::new());
        let q = std::rc::Rc::new(UplinkQueue::with_metrics(
            1 + 36 + MESSAGE_OVERHEAD_BYTES,
            m,
        ));
        q.push(msg("t", 36, QoS::AtLeastOnce)).await;
        let q2 = q.clone();
        let blocked = tokio::task::spawn_local(async move {
            q2.push(msg("u", 36, QoS::AtLeastOnce)).await;
        });
        settle().await;
        assert!(
            !blocked.is_finished(),
            "push must wait while the queue is full"
        );
        assert_eq!(q.len(), 1);
        let first = q.take_front(true).unwrap();
        settle().await;
        assert!(
            !blocked.is_finished(),
            "taking for send does not free bytes"
        );
        q.release(first.msg.cost());
        settle().await;
        assert!(blocked.is_finished(), "release must wake the waiting push");
        assert_eq!(q.take_front(true).unwrap().msg.topic, "u");
    });
}

#[test]
fn a_message_larger_than_capacity_is_admitted_when_nothing_is_held() {
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let q = UplinkQueue::new(100);
        q.push(msg("big", 10_000, QoS::AtLeastOnce)).await;
        assert_eq!(q.len(), 1);
        assert!(q.is_full());
        // But not while something else is held.
        assert!(q.try_push(msg("big", 10_000, QoS::AtMostOnce)).is_err());
    });
}

#[test]
fn take_front_respects_the_window_and_never_skips_ahead() {
    let q = UplinkQueue::new(10_000);
    q.try_push(msg("a", 1, QoS::AtLeastOnce)).unwrap();
    q.try_push(msg("b", 1, QoS::AtMostOnce)).unwrap();
    assert!(
        q.take_front(false).is_none(),
        "QoS 1 front needs window room"
    );
    assert_eq!(q.take_front(true).unwrap().msg.topic, "a");
    assert_eq!(q.front_needs_ack(), Some(false));
    assert_eq!(
        q.take_front(false).unwrap().msg.topic,
        "b",
        "QoS 0 needs no window"
    );
    assert_eq!(q.front_needs_ack(), None);
}

#[test]
fn take_next_serves_the_backlog_only_on_its_turn_or_when_nothing_live_waits() {
    let q = UplinkQueue::new(100_000);
    q.push_backlog(msg("b1", 1, QoS::AtLeastOnce));
    q.push_backlog(msg("b2", 1, QoS::AtLeastOnce));
    q.try_push(msg("l1", 1, QoS::AtLeastOnce)).unwrap();
    assert_eq!(q.len(), 3);
    assert_eq!(q.backlog_len(), 2);
    assert_eq!(q.take_next(true, false).unwrap().msg.topic, "l1");
    // Live is empty now: the backlog goes whatever the turn says.
    assert_eq!(q.take_next(true, false).unwrap().msg.topic, "b1");
    q.try_push(msg("l2", 1, QoS::AtLeastOnce)).unwrap();
    assert_eq!(q.take_next(true, true).unwrap().msg.topic, "b2");
    assert_eq!(q.take_next(true, true).unwrap().msg.topic, "l2");
    assert!(q.take_next(true, true).is_none());
}

#[test]
fn a_closed_window_lets_only_a_qos0_front_of_the_other_stream_pass() {
    let q = UplinkQueue::new(100_000);
    q.push_backlog(msg("b1", 1, QoS::AtLeastOnce));
    q.try_push(msg("l0", 1, QoS::AtMostOnce)).unwrap();
    assert_eq!(q.front_needs_ack(), Some(false));
    assert_eq!(q.take_next(false, true).unwrap().msg.topic, "l0");
    assert_eq!(q.front_needs_ack(), Some(true));
    assert!(q.take_next(false, true).is_none());
}

#[test]
fn each_stream_gets_half_the_capacity_as_read_ahead() {
    let one = 1 + 10 + MESSAGE_OVERHEAD_BYTES;
    let q = UplinkQueue::new(4 * one);
    assert_eq!(q.stream_room(true), 2 * one);
    q.push_backlog(msg("b", 10, QoS::AtLeastOnce));
    q.push_backlog(msg("b", 10, QoS::AtLeastOnce));
    assert_eq!(q.stream_room(true), 0);
    assert_eq!(
        q.stream_room(false),
        2 * one,
        "the backlog never eats the live share"
    );
    q.try_push(msg("l", 10, QoS::AtLeastOnce)).unwrap();
    assert_eq!(q.stream_room(false), one);
    let taken = q.take_next(true, false).unwrap();
    assert_eq!(taken.msg.topic, "l");
    q.release_msg(&taken.msg);
    assert_eq!(q.stream_room(false), 2 * one);
}

#[test]
fn requeued_messages_go_first_in_original_order_marked_for_resend() {
    let q = UplinkQueue::new(10_000);
    for t in ["1", "2", "3", "4"] {
        q.try_push(msg(t, 1, QoS::AtLeastOnce)).unwrap();
    }
    let a = q.take_front(true).unwrap();
    let b = q.take_front(true).unwrap();
    q.requeue_front(vec![a.msg, b.msg]);
    let order: Vec<(String, bool)> = std::iter::from_fn(|| q.take_front(true))
        .map(|q| (q.msg.topic.to_string(), q.resend))
        .collect();
    assert_eq!(
        order,
        vec![
            ("1".into(), true),
            ("2".into(), true),
            ("3".into(), false),
            ("4".into(), false)
        ]
    );
    assert_eq!(q.reserved_bytes(), 4 * (2 + MESSAGE_OVERHEAD_BYTES));
}

/// Three pushers block on a full queue, in the order 1, 2, 3. Releasing room for one
/// message admits exactly one, the first to arrive; the others stay asleep (not woken to
/// find no room); the next release admits the second, and so on.
#[test]
fn blocked_pushers_are_admitted_first_come_first_served_one_release_at_a_time() {
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
        let q = std::rc::Rc::new(UplinkQueue::new(one));
        q.push(msg("0", 36, QoS::AtLeastOnce)).await;
        let polls = std::rc::Rc::new(std::cell::RefCell::new(Vec::<&'static str>::new()));
        let mut tasks = Vec::new();
        for topic in ["1", "2", "3"] {
            let (q, polls) = (q.clone(), polls.clone());
            tasks.push(tokio::task::spawn_local(async move {
                let m = msg(topic, 36, QoS::AtLeastOnce);
                q.push(m).await;
                polls.borrow_mut().push(topic);
            }));
            // Arrival order is the spawn order.
            settle().await;
        }
        let wakeups_before = q.waiter_wakeups();
        for expect in ["1", "2", "3"] {
            let front = q.take_front(true).unwrap();
            q.release_msg(&front.msg);
            settle().await;
            assert_eq!(
                polls.borrow().last().copied(),
                Some(expect),
                "the earliest waiter is admitted first"
            );
            assert_eq!(q.len(), 1, "exactly one waiter admitted per release");
        }
        assert_eq!(*polls.borrow(), vec!["1", "2", "3"]);
        assert_eq!(
            q.waiter_wakeups() - wakeups_before,
            3,
            "each release woke only the waiter that fits"
        );
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// Small messages behind a large one wait their turn: releasing room for the small ones
/// only does not let them overtake the large waiter that arrived first.
#[test]
fn a_small_pusher_does_not_overtake_a_large_one_waiting_before_it() {
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let small = 1 + 10 + MESSAGE_OVERHEAD_BYTES;
        let q = std::rc::Rc::new(UplinkQueue::new(3 * small));
        for _ in 0..3 {
            q.push(msg("0", 10, QoS::AtLeastOnce)).await;
        }
        let order = std::rc::Rc::new(std::cell::RefCell::new(Vec::<&'static str>::new()));
        let mut tasks = Vec::new();
        for (topic, len) in [("b", 2 * small - 1 - MESSAGE_OVERHEAD_BYTES - 1), ("s", 10)] {
            let (q, order) = (q.clone(), order.clone());
            tasks.push(tokio::task::spawn_local(async move {
                q.push(msg(topic, len, QoS::AtLeastOnce)).await;
                order.borrow_mut().push(topic);
            }));
            settle().await;
        }
        let first = q.take_front(true).unwrap();
        q.release_msg(&first.msg);
        settle().await;
        assert!(
            order.borrow().is_empty(),
            "room for the small one only: it still waits behind the big one"
        );
        let second = q.take_front(true).unwrap();
        q.release_msg(&second.msg);
        settle().await;
        assert_eq!(*order.borrow(), vec!["b"]);
        let third = q.take_front(true).unwrap();
        q.release_msg(&third.msg);
        settle().await;
        assert_eq!(*order.borrow(), vec!["b", "s"]);
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// A blocked push that is dropped (its device connection closed) leaves the line: the
/// waiter behind it is served by the next release, and a push dropped after its grant
/// gives the granted bytes back.
#[test]
fn a_cancelled_waiting_push_gives_its_place_and_its_bytes_back() {
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let one = 1 + 36 + MESSAGE_OVERHEAD_BYTES;
        let q = std::rc::Rc::new(UplinkQueue::new(one));
        q.push(msg("0", 36, QoS::AtLeastOnce)).await;
        let q1 = q.clone();
        let first = tokio::task::spawn_local(async move {
            q1.push(msg("1", 36, QoS::AtLeastOnce)).await;
        });
        settle().await;
        let q2 = q.clone();
        let second = tokio::task::spawn_local(async move {
            q2.push(msg("2", 36, QoS::AtLeastOnce)).await;
        });
        settle().await;
        first.abort();
        settle().await;
        let front = q.take_front(true).unwrap();
        q.release_msg(&front.msg);
        settle().await;
        assert!(
            second.is_finished(),
            "the waiter behind the cancelled one got the room"
        );
        assert_eq!(q.take_front(true).unwrap().msg.topic, "2");
        assert_eq!(q.reserved_bytes(), one);

        // Granted, then dropped before it ran: the bytes come back.
        let q3 = q.clone();
        let third = tokio::task::spawn_local(async move {
            q3.push(msg("3", 36, QoS::AtLeastOnce)).await;
        });
        settle().await;
        q.release(one);
        // Granted now (bytes reserved for it), but the task has not run yet.
        assert_eq!(q.reserved_bytes(), one);
        third.abort();
        settle().await;
        assert_eq!(q.reserved_bytes(), 0, "a dropped grant releases its bytes");
        assert!(q.is_empty());
    });
}

#[test]
fn a_closed_queue_acknowledges_what_it_holds_and_what_arrives_later_with_0x10() {
    use crate::message::ack::{AckToken, DeviceAcks};
    use sluice_proto::mqtt::ProtocolVersion::V5;
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let m = Arc::new(UplinkMetrics::new());
        let one = 1 + 4 + MESSAGE_OVERHEAD_BYTES;
        let q = Rc::new(UplinkQueue::with_metrics(one, m.clone()));
        let dev = DeviceAcks::new();
        let with_token = |id| {
            let mut x = msg("t", 4, QoS::AtLeastOnce);
            x.ack = Some(AckToken::new(&dev, id));
            x
        };
        q.push(with_token(1)).await;
        // A second device message waits for room (back-pressure).
        let blocked = tokio::task::spawn_local({
            let q = q.clone();
            let x = with_token(2);
            async move { q.push(x).await }
        });
        settle().await;
        assert!(!blocked.is_finished());
        assert_eq!(q.close_removed(), (1, one as u64));
        blocked.await.unwrap();
        q.push(with_token(3)).await;
        assert!(q.try_push(with_token(4)).is_ok());
        assert_eq!(dev.drain(), vec![1, 2, 3, 4]);
        for id in 1..=4 {
            assert_eq!(dev.take_reason(id, V5), 0x10, "packet {id}");
        }
        assert_eq!(q.removed().0, 4);
        assert_eq!(q.reserved_bytes(), 0);
        assert_eq!(q.len(), 0);
        assert_eq!(m.dropped(DropReason::UplinkRemoved), 4);
        assert!(!dev.is_abandoned());
    });
}

#[test]
fn a_raised_capacity_grants_a_waiting_pusher() {
    let (rt, local) = rt();
    local.block_on(&rt, async {
        let one = 1 + 4 + MESSAGE_OVERHEAD_BYTES;
        let q = Rc::new(UplinkQueue::new(one));
        q.push(msg("t", 4, QoS::AtLeastOnce)).await;
        let blocked = tokio::task::spawn_local({
            let q = q.clone();
            async move { q.push(msg("t", 4, QoS::AtLeastOnce)).await }
        });
        settle().await;
        assert!(!blocked.is_finished());
        q.set_capacity_bytes(2 * one);
        blocked.await.unwrap();
        assert_eq!(q.len(), 2);
    });
}
