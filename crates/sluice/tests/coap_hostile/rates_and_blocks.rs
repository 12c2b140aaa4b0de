//! Per-address publish rates for plain CoAP devices, and notifications larger than a datagram
//! going block-wise from the notified representation.

use super::*;

/// A publish to `ps/{topic}?c={id}` carrying `payload`.
fn publish_as(mtype: MsgType, mid: u16, topic: &str, id: &str, payload: &[u8]) -> Message {
    let mut m = req(mtype, Code::POST, mid, topic);
    m.add_option(opt::URI_QUERY, Bytes::from(format!("c={id}")));
    m.payload = Bytes::copy_from_slice(payload);
    m
}

/// Issue 28 item 6 for CoAP: `[limits]` publish rates apply to plain CoAP devices, charged to
/// the source address (the `c=` id is the device's own claim: changing it does not refill
/// the bucket, and claiming another's id does not drain that one's). Over the rate a CON is
/// answered 5.03 with Max-Age (when to retry) and not routed; a NON is dropped (answered
/// 5.03 as a NON), counted; another address keeps its own rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_coap_address_over_its_publish_rate_gets_5_03_and_nothing_is_routed() {
    let gw = common::gateway(
        1,
        "[coap]\nlisten = \"127.0.0.1:0\"\n[limits]\npublish_rate = 1\npublish_burst = 2\n",
    );
    let addr = gw.coap_addr.expect("coap");
    let mut sub = common::device(&gw, "watcher", ProtocolVersion::V5).await;
    sub.subscribe(&[("r/#", QoS::AtLeastOnce)])
        .await
        .expect("subscribe");
    let mut dev = Dev::new(addr).await;
    let mut codes = Vec::new();
    for (i, id) in ["a1", "a2", "a3"].iter().enumerate() {
        let m = publish_as(
            MsgType::Con,
            dev.next_mid(),
            "r/t",
            id,
            format!("con-{i}").as_bytes(),
        );
        let (_, _, r) = dev.ask(&m).await;
        codes.push((r.code, r.uint_option(opt::MAX_AGE)));
    }
    assert_eq!(codes[0].0, Code::CHANGED, "{codes:?}");
    assert_eq!(codes[1].0, Code::CHANGED, "{codes:?}");
    assert_eq!(
        codes[2].0,
        Code::SERVICE_UNAVAILABLE,
        "a third id from the same address shares its bucket: {codes:?}"
    );
    assert!(
        codes[2].1.is_some_and(|s| (1..=2).contains(&s)),
        "Max-Age says when: {codes:?}"
    );
    let non = publish_as(MsgType::Non, dev.next_mid(), "r/t", "a4", b"non-dropped");
    let (_, _, r) = dev.ask(&non).await;
    assert_eq!((r.mtype, r.code), (MsgType::Non, Code::SERVICE_UNAVAILABLE));
    // Another address, even claiming a1's id, has its own bucket.
    let mut other = Dev::on("127.0.0.2", addr).await;
    let m = publish_as(
        MsgType::Con,
        other.next_mid(),
        "r/t",
        "a1",
        b"other-address",
    );
    assert_eq!(other.ask(&m).await.2.code, Code::CHANGED);

    let mut got = Vec::new();
    while let Some(p) = sub
        .recv(Duration::from_millis(500))
        .await
        .expect("subscriber")
    {
        got.push(String::from_utf8_lossy(&p.payload).into_owned());
    }
    got.sort();
    assert_eq!(
        got,
        ["con-0", "con-1", "other-address"],
        "nothing refused was routed"
    );
    let m = gw.metrics_text();
    assert_eq!(
        common::metric_sum(&m, "sluice_limits_publish_throttled_total"),
        1.0,
        "{m}"
    );
    assert_eq!(
        common::metric_sum(&m, "sluice_limits_publish_dropped_total"),
        1.0,
        "{m}"
    );
    gw.shutdown();
}

/// The next notification for `token` (ACKing it when CON), skipping anything else.
async fn notification_for(dev: &Dev, token: Token) -> (usize, Message) {
    loop {
        let (n, m) = dev.recv(WAIT).await.expect("a notification");
        if m.mtype == MsgType::Con {
            dev.send(&Message::empty(MsgType::Ack, m.message_id)).await;
        }
        if m.token == token && m.option(opt::OBSERVE).is_some() {
            return (n, m);
        }
    }
}

/// GET block `num` (size `szx`) of `ps/{topic}` as a client continuing a block-wise
/// notification does (no Observe, a new token); the answer and its size.
async fn later_block(dev: &mut Dev, topic: &str, num: u32, szx: u8) -> (usize, Message) {
    let mut m = req(MsgType::Con, Code::GET, dev.next_mid(), topic);
    m.add_uint_option(
        opt::BLOCK2,
        Block {
            num,
            more: false,
            szx,
        }
        .to_uint(),
    );
    let (_, n, r) = dev.ask(&m).await;
    (n, r)
}

/// Issue 28 (CoAP, notifications larger than max_message_size): a verified observer gets
/// a large notification as its Block2 block 0 with an ETag (RFC 7959 §2.6) and fetches the
/// rest; the later blocks come from the representation that was notified — not from the
/// topic's (different) retained value — and once a newer one was notified, a later block
/// carries that one's ETag, so the client sees the blocks do not belong together. Every
/// datagram stays within max_message_size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_larger_than_a_datagram_goes_block_wise_from_the_notified_representation() {
    let gw = common::gateway(
        1,
        "[coap]\nlisten = \"127.0.0.1:0\"\nack_timeout = \"200ms\"\nseparate_after = \"100ms\"\n",
    );
    let retained = retain(&gw, "big/t", 2_000).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    // The retained value is too large for an unproven address: the Echo verifies it.
    let first = observe(&mut dev, "big/t", 77).await;
    assert_eq!(first.code, Code::CONTENT, "{first:?}");
    assert!(
        first.option(opt::BLOCK2).is_some(),
        "the retained value, block-wise"
    );
    let token = Token::from_u64(77);
    let mut mqtt = common::device(&gw, "pub", ProtocolVersion::V5).await;
    let a: Vec<u8> = (0..3_000).map(|i| b'A' + (i % 7) as u8).collect();
    mqtt.publish("big/t", Bytes::from(a.clone()), QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    let (n, block0) = notification_for(&dev, token).await;
    assert!(n <= 1152, "block 0 is {n} B");
    let b2 = Block::from_uint(block0.uint_option(opt::BLOCK2).expect("Block2")).unwrap();
    assert!(b2.num == 0 && b2.more, "{b2:?}");
    assert_eq!(block0.uint_option(opt::SIZE2), Some(3_000));
    let etag_a = block0.option(opt::ETAG).expect("an ETag").clone();
    let mut body = block0.payload.to_vec();
    let mut num = 1;
    loop {
        let (n, r) = later_block(&mut dev, "big/t", num, b2.szx).await;
        assert_eq!(r.code, Code::CONTENT, "{r:?}");
        assert!(n <= 1152, "block {num} is {n} B");
        assert_eq!(
            r.option(opt::ETAG),
            Some(&etag_a),
            "block {num}: same representation"
        );
        body.extend_from_slice(&r.payload);
        let b = Block::from_uint(r.uint_option(opt::BLOCK2).expect("Block2")).unwrap();
        if !b.more {
            break;
        }
        num += 1;
    }
    assert_eq!(body, a, "the notified message, not the retained value");
    assert_ne!(body, retained);

    // A newer representation notified: a late request for the old one's block 1 carries the
    // newer ETag.
    let b: Vec<u8> = (0..3_000).map(|i| b'a' + (i % 5) as u8).collect();
    mqtt.publish("big/t", Bytes::from(b), QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    let (_, block0_b) = notification_for(&dev, token).await;
    let etag_b = block0_b.option(opt::ETAG).expect("an ETag").clone();
    assert_ne!(etag_a, etag_b);
    let (_, r) = later_block(&mut dev, "big/t", 1, b2.szx).await;
    assert_eq!(r.option(opt::ETAG), Some(&etag_b), "{r:?}");
    let m = gw.metrics_text();
    assert_eq!(
        common::metric_sum(&m, "sluice_coap_notifications_blockwise_total"),
        2.0,
        "{m}"
    );
    assert_eq!(
        common::metric_sum(
            &m,
            "sluice_coap_notifications_dropped_total{shard=\"0\",reason=\"too_large\"}"
        ),
        0.0
    );
    gw.shutdown();
}
