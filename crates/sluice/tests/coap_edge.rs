//! The CoAP/UDP device edge end to end: a real gateway (`App`) and a real cloud Mosquitto
//! over TLS; devices are `common::coap::CoapDevice` (UDP, built on `sluice_proto::coap`).

mod common;

use std::time::Duration;

use common::coap::{request, CoapDevice};
use common::*;
use sluice::app::RunningGateway;
use sluice_proto::coap::{opt, Block, Code, Message, MsgType, Token};

const T: Duration = Duration::from_secs(10);

fn coap_gateway(shards: usize, cloud: &Cloud, coap: &str) -> RunningGateway {
    gateway(
        shards,
        &format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\n{coap}\n{}",
            cloud.uplink_toml(None, "[uplink.aggregate]\nenabled = false")
        ),
    )
}

fn publish(mtype: MsgType, topic: &str, query: &[&str], payload: &[u8]) -> Message {
    request(mtype, Code::POST, &format!("ps/{topic}"), query, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_con_publish_reaches_the_cloud_byte_for_byte_and_is_answered_2_04() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "coap/#").await;
    let gw = coap_gateway(2, &cloud, "");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap listening")).await;
    let payload: Vec<u8> = (0..200u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut req = publish(MsgType::Con, "coap/meter-1/power", &["c=meter-1"], &payload);
    req.add_uint_option(opt::CONTENT_FORMAT, 110);
    let resp = dev.exchange(req, T).await;
    assert_eq!(resp.code, Code::CHANGED, "{resp:?}");
    let got = sub.recv(T).await.unwrap().expect("cloud got the message");
    assert_eq!(&*got.topic, "coap/meter-1/power");
    assert_eq!(&got.payload[..], &payload[..]);
    let text = gw.metrics_text();
    assert_eq!(metric_sum(&text, "sluice_coap_publishes_total"), 1.0);
    assert_eq!(
        metric_sum(
            &text,
            "sluice_coap_requests_total{shard=\"0\",method=\"POST\"}"
        ) + metric_sum(
            &text,
            "sluice_coap_requests_total{shard=\"1\",method=\"POST\"}"
        ),
        1.0
    );
    let status = gw.status_json();
    assert_eq!(status["coap"]["devices"], 1);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_con_publish_is_answered_only_after_the_cloud_took_it_separately_when_late() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "late/#").await;
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    // Two shards: the device's ACK of the separate response has no Uri-Query and must reach
    // the shard that sent it by its message id, or the response is retransmitted.
    let gw = gateway(
        2,
        &format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\nseparate_after = \"200ms\"\nack_timeout = \"500ms\"\n{}",
            cloud.uplink_toml(Some(gate.addr), "[uplink.aggregate]\nenabled = false")
        ),
    );
    let dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    let mut req = publish(MsgType::Con, "late/x", &["c=late-1"], b"held");
    req.message_id = 0x1234;
    req.token = Token::from_slice(b"tok1").unwrap();
    dev.send(&req).await;
    // The cloud is unreachable: an empty ACK (separate response coming), no 2.04.
    let ack = dev.recv(T).await.expect("an empty ACK");
    assert_eq!(
        (ack.mtype, ack.code, ack.message_id),
        (MsgType::Ack, Code::EMPTY, 0x1234)
    );
    assert!(
        dev.recv(Duration::from_millis(800)).await.is_none(),
        "no 2.04 before the cloud's ack"
    );
    gate.set_open(true);
    let resp = dev
        .response_to(&req, T)
        .await
        .expect("the separate response");
    assert_eq!((resp.mtype, resp.code), (MsgType::Con, Code::CHANGED));
    assert_eq!(resp.token, req.token);
    let got = sub.recv(T).await.unwrap().expect("cloud got it");
    assert_eq!(&got.payload[..], b"held");
    assert!(
        dev.recv(Duration::from_secs(1)).await.is_none(),
        "ACKed: not retransmitted"
    );
    let text = gw.metrics_text();
    assert_eq!(metric_sum(&text, "sluice_coap_retransmissions_total"), 0.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_publish_is_qos_0_and_answered_with_a_non() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "non/#").await;
    let gw = coap_gateway(2, &cloud, "");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    let resp = dev
        .exchange(
            publish(MsgType::Non, "non/t", &["c=n1"], b"fire and forget"),
            T,
        )
        .await;
    assert_eq!((resp.mtype, resp.code), (MsgType::Non, Code::CHANGED));
    let got = sub.recv(T).await.unwrap().expect("cloud got it");
    assert_eq!(&got.payload[..], b"fire and forget");
    assert_eq!(got.qos, sluice_proto::mqtt::QoS::AtMostOnce);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_con_is_answered_from_the_table_and_published_once() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "dup/#").await;
    let gw = coap_gateway(2, &cloud, "");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    let mut req = publish(MsgType::Con, "dup/t", &["c=dup-1"], b"once");
    dev.stamp(&mut req);
    dev.send(&req).await;
    let first = dev.response_to(&req, T).await.expect("answer");
    assert_eq!((first.mtype, first.code), (MsgType::Ack, Code::CHANGED));
    dev.send(&req).await;
    let again = dev.recv(T).await.expect("the same answer again");
    assert_eq!(again, first);
    assert!(sub.recv(T).await.unwrap().is_some());
    assert!(
        sub.recv(Duration::from_millis(500))
            .await
            .unwrap()
            .is_none(),
        "published once"
    );
    let text = gw.metrics_text();
    assert_eq!(metric_sum(&text, "sluice_coap_duplicates_total"), 1.0);
    assert_eq!(metric_sum(&text, "sluice_coap_publishes_total"), 1.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_4_kib_payload_arrives_by_block1_and_bad_transfers_are_refused() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "big/#").await;
    let gw = coap_gateway(2, &cloud, "max_body_size = \"8KiB\"");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    let body: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
    for (num, chunk) in body.chunks(1024).enumerate() {
        let more = num < 3;
        let mut req = publish(MsgType::Con, "big/blob", &["c=big-1"], chunk);
        req.add_uint_option(
            opt::BLOCK1,
            Block {
                num: num as u32,
                more,
                szx: 6,
            }
            .to_uint(),
        );
        let resp = dev.exchange(req, T).await;
        let echo = Block::from_uint(resp.uint_option(opt::BLOCK1).expect("Block1 echoed")).unwrap();
        assert_eq!(echo.num, num as u32);
        if more {
            assert_eq!(resp.code, Code::CONTINUE);
        } else {
            assert_eq!(resp.code, Code::CHANGED);
        }
    }
    let got = sub.recv(T).await.unwrap().expect("cloud got the body");
    assert_eq!(&got.payload[..], &body[..]);

    // A missing block: 4.08.
    let mut b0 = publish(MsgType::Con, "big/gap", &["c=big-1"], &[1; 64]);
    b0.add_uint_option(
        opt::BLOCK1,
        Block {
            num: 0,
            more: true,
            szx: 2,
        }
        .to_uint(),
    );
    assert_eq!(dev.exchange(b0, T).await.code, Code::CONTINUE);
    let mut b2 = publish(MsgType::Con, "big/gap", &["c=big-1"], &[1; 64]);
    b2.add_uint_option(
        opt::BLOCK1,
        Block {
            num: 2,
            more: true,
            szx: 2,
        }
        .to_uint(),
    );
    assert_eq!(
        dev.exchange(b2, T).await.code,
        Code::REQUEST_ENTITY_INCOMPLETE
    );
    // Announced larger than max_body_size: 4.13 with Size1.
    let mut big = publish(MsgType::Con, "big/huge", &["c=big-1"], &[1; 1024]);
    big.add_uint_option(
        opt::BLOCK1,
        Block {
            num: 0,
            more: true,
            szx: 6,
        }
        .to_uint(),
    );
    big.add_uint_option(opt::SIZE1, 100_000);
    let resp = dev.exchange(big, T).await;
    assert_eq!(resp.code, Code::REQUEST_ENTITY_TOO_LARGE);
    assert_eq!(resp.uint_option(opt::SIZE1), Some(8192));
    let text = gw.metrics_text();
    assert_eq!(
        metric_sum(&text, "sluice_coap_block_transfers_completed_total"),
        1.0
    );
    assert_eq!(
        metric_sum(&text, "sluice_coap_block_transfers_failed_total"),
        2.0
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn well_known_core_lists_the_pubsub_resource_in_block2_blocks() {
    let cloud = Cloud::start();
    let gw = coap_gateway(1, &cloud, "block_size = \"16B\"");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    let mut doc = Vec::new();
    for num in 0.. {
        let mut req = request(MsgType::Con, Code::GET, ".well-known/core", &[], b"");
        if num > 0 {
            req.add_uint_option(
                opt::BLOCK2,
                Block {
                    num,
                    more: false,
                    szx: 0,
                }
                .to_uint(),
            );
        }
        let resp = dev.exchange(req, T).await;
        assert_eq!(resp.code, Code::CONTENT);
        assert_eq!(resp.uint_option(opt::CONTENT_FORMAT), Some(40));
        let b = Block::from_uint(resp.uint_option(opt::BLOCK2).expect("Block2")).unwrap();
        assert_eq!((b.num, b.szx), (num, 0));
        doc.extend_from_slice(&resp.payload);
        if !b.more {
            break;
        }
    }
    assert_eq!(
        String::from_utf8(doc).unwrap(),
        "</ps>;rt=\"core.ps\";ct=40"
    );
    let mut json = request(MsgType::Con, Code::GET, ".well-known/core", &[], b"");
    json.add_uint_option(opt::ACCEPT, 50);
    assert_eq!(dev.exchange(json, T).await.code, Code::NOT_ACCEPTABLE);
    // Other paths and methods.
    let nf = dev
        .exchange(
            request(MsgType::Con, Code::GET, "nothing/here", &[], b""),
            T,
        )
        .await;
    assert_eq!(nf.code, Code::NOT_FOUND);
    let na = dev
        .exchange(
            request(MsgType::Con, Code::DELETE, ".well-known/core", &[], b""),
            T,
        )
        .await;
    assert_eq!(na.code, Code::METHOD_NOT_ALLOWED);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_datagrams_are_answered_per_rfc_and_counted_while_a_healthy_device_goes_on() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "ok/#").await;
    let gw = coap_gateway(2, &cloud, "source_rate = 200\nsource_burst = 50");
    let addr = gw.coap_addr().expect("coap");
    let mut healthy = CoapDevice::new(addr).await;
    let bad = CoapDevice::new(addr).await;
    let flood = CoapDevice::new(addr).await;
    let flooding = tokio::spawn(async move {
        let junk = request(MsgType::Non, Code::GET, "nothing", &["c=flood"], b"").to_udp();
        for _ in 0..3000 {
            flood.send_raw(&junk).await;
        }
        flood
    });
    // Truncated header: nothing to answer.
    bad.send_raw(&[0x40, 0x01, 0x00]).await;
    // Bad option delta (nibble 15 outside the payload marker) in a CON: RST.
    bad.send_raw(&[0x40, 0x02, 0x12, 0x34, 0xF1, 0x00]).await;
    let rst = bad.recv(T).await.expect("RST");
    assert_eq!(
        (rst.mtype, rst.code, rst.message_id),
        (MsgType::Rst, Code::EMPTY, 0x1234)
    );
    // Token length 9 in a CON: RST.
    let mut tkl9 = vec![0x49, 0x01, 0x12, 0x35];
    tkl9.extend_from_slice(&[0; 9]);
    bad.send_raw(&tkl9).await;
    let rst = bad.recv(T).await.expect("RST");
    assert_eq!((rst.mtype, rst.message_id), (MsgType::Rst, 0x1235));
    // A CoAP ping (empty CON): RST.
    bad.send_raw(&[0x40, 0x00, 0x12, 0x36]).await;
    assert_eq!(bad.recv(T).await.expect("pong").message_id, 0x1236);
    // An unknown critical option (9): 4.02 with a diagnostic payload.
    let mut crit = publish(MsgType::Con, "ok/x", &["c=bad"], b"x");
    crit.add_option(9, &b"?"[..]);
    crit.message_id = 0x1237;
    bad.send(&crit).await;
    let r = bad.recv(T).await.expect("4.02");
    assert_eq!(
        (r.mtype, r.code, r.message_id),
        (MsgType::Ack, Code::BAD_OPTION, 0x1237)
    );
    assert!(!r.payload.is_empty());
    // Larger than max_message_size (1152 B): RST, not read further.
    let mut huge = publish(MsgType::Con, "ok/x", &["c=bad"], &[0; 1200]);
    huge.message_id = 0x1239;
    bad.send(&huge).await;
    let r = bad.recv(T).await.expect("RST");
    assert_eq!((r.mtype, r.message_id), (MsgType::Rst, 0x1239));
    // A topic with a wildcard: 4.00.
    let mut wild = publish(MsgType::Con, "ok/+", &["c=bad"], b"x");
    wild.message_id = 0x1238;
    bad.send(&wild).await;
    assert_eq!(bad.recv(T).await.expect("4.00").code, Code::BAD_REQUEST);

    for i in 0..20u8 {
        let r = healthy
            .exchange(publish(MsgType::Con, "ok/h", &["c=healthy"], &[i]), T)
            .await;
        assert_eq!(r.code, Code::CHANGED);
    }
    for i in 0..20u8 {
        let got = sub.recv(T).await.unwrap().expect("healthy message");
        assert_eq!(&got.payload[..], &[i]);
    }
    flooding.await.unwrap();
    let text = gw.metrics_text();
    let count = |reason: &str| {
        metric_sum(
            &text,
            &format!("sluice_coap_format_errors_total{{shard=\"0\",reason=\"{reason}\"}}"),
        ) + metric_sum(
            &text,
            &format!("sluice_coap_format_errors_total{{shard=\"1\",reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(count("too_short"), 1.0);
    assert_eq!(count("bad_option"), 1.0);
    assert_eq!(count("token_too_long"), 1.0);
    assert_eq!(count("unknown_critical_option"), 1.0);
    assert_eq!(count("bad_request"), 1.0);
    assert_eq!(count("too_large"), 1.0);
    assert!(metric_sum(&text, "sluice_coap_rst_sent_total") >= 3.0);
    assert!(
        metric_sum(&text, "sluice_coap_throttled_total") > 0.0,
        "the flood was throttled"
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_the_uplink_cannot_take_is_answered_5_03_with_max_age() {
    let dead = sluice_testkit::free_port().expect("port");
    let gw = gateway_sections(
        "shards = 1\nmax_buffered = \"64KiB\"",
        "max_packet_size = \"64KiB\"",
        &format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\nmax_pending = 1\nretry_after = \"3s\"\nseparate_after = \"100ms\"\n\
             [[uplink]]\nname = \"down\"\nurl = \"mqtt://127.0.0.1:{dead}\"\nclient_id = \"gw\"\nallow_plaintext = true\n\
             reconnect_min = \"1s\"\nreconnect_max = \"1s\"\n[uplink.aggregate]\nenabled = false\n"
        ),
    );
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    let mut sent = Vec::new();
    for _ in 0..120 {
        let mut req = publish(MsgType::Con, "bp/t", &["c=bp"], &[0x55; 1000]);
        dev.stamp(&mut req);
        dev.send(&req).await;
        sent.push(req);
    }
    let (mut unavailable, mut changed) = (0, 0);
    while let Some(r) = dev.recv(Duration::from_millis(1500)).await {
        if r.code == Code::SERVICE_UNAVAILABLE {
            unavailable += 1;
            assert_eq!(r.uint_option(opt::MAX_AGE), Some(3));
            assert!(!r.payload.is_empty());
        }
        changed += (r.code == Code::CHANGED) as usize;
    }
    assert!(unavailable > 0, "back-pressure answered 5.03");
    assert_eq!(changed, 0, "nothing acknowledged that the cloud never took");
    let text = gw.metrics_text();
    assert_eq!(
        metric_sum(&text, "sluice_coap_unavailable_total"),
        unavailable as f64
    );
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_device_is_served_by_the_shard_its_id_hashes_to_whichever_socket_read_it() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "st/#").await;
    let gw = coap_gateway(2, &cloud, "");
    let addr = gw.coap_addr().expect("coap");
    let ids = ids_on_shards("steer", 2, 10);
    let mut tasks = Vec::new();
    for id in ids.into_iter().flatten() {
        tasks.push(tokio::spawn(async move {
            let mut dev = CoapDevice::new(addr).await;
            for seq in 0..5u8 {
                let q = format!("c={id}");
                let req = publish(MsgType::Con, &format!("st/{id}"), &[&q], &[seq]);
                assert_eq!(dev.exchange(req, T).await.code, Code::CHANGED);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut got = std::collections::HashMap::<String, Vec<u8>>::new();
    for _ in 0..100 {
        let m = sub.recv(T).await.unwrap().expect("every message");
        got.entry(m.topic.to_string())
            .or_default()
            .push(m.payload[0]);
    }
    assert_eq!(got.len(), 20);
    assert!(
        got.values().all(|v| v == &[0, 1, 2, 3, 4]),
        "in order per device: {got:?}"
    );
    let text = gw.metrics_text();
    for shard in 0..2 {
        let p = metric_sum(
            &text,
            &format!("sluice_coap_publishes_total{{shard=\"{shard}\"}}"),
        );
        assert_eq!(p, 50.0, "shard {shard} served its own 10 devices");
    }
    // The kernel spreads sources over both sockets; a datagram read by the wrong one is steered.
    let out = metric_sum(&text, "sluice_coap_steered_out_total");
    assert_eq!(out, metric_sum(&text, "sluice_coap_steered_in_total"));
    assert_eq!(metric_sum(&text, "sluice_coap_steer_dropped_total"), 0.0);
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ack_spool_a_con_publish_is_answered_once_committed_while_the_cloud_is_down() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "sp/#").await;
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    let dir = tempfile::tempdir().expect("spool dir");
    let gw = gateway(
        1,
        &format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\n[spool]\ndir = \"{}\"\nfsync = \"never\"\nack = \"spool\"\n{}",
            dir.path().display(),
            cloud.uplink_toml(Some(gate.addr), "[uplink.aggregate]\nenabled = false")
        ),
    );
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    for i in 0..5u8 {
        let r = dev
            .exchange(publish(MsgType::Con, "sp/x", &["c=sp"], &[i]), T)
            .await;
        assert_eq!(r.code, Code::CHANGED, "the spool acknowledged it");
    }
    assert!(sub
        .recv(Duration::from_millis(300))
        .await
        .unwrap()
        .is_none());
    gate.set_open(true);
    for i in 0..5u8 {
        let got = sub
            .recv(T)
            .await
            .unwrap()
            .expect("delivered from the spool");
        assert_eq!(&got.payload[..], &[i]);
    }
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_response_suppresses_the_answers_a_device_does_not_want() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "nr/#").await;
    let gw = coap_gateway(1, &cloud, "");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    // NON, no 2.xx wanted: published, not answered.
    let mut quiet = publish(MsgType::Non, "nr/a", &["c=nr"], b"quiet");
    quiet.add_uint_option(opt::NO_RESPONSE, 2);
    dev.stamp(&mut quiet);
    dev.send(&quiet).await;
    assert_eq!(
        &sub.recv(T).await.unwrap().expect("published").payload[..],
        b"quiet"
    );
    assert!(dev.recv(Duration::from_millis(300)).await.is_none());
    // CON, no 2.xx wanted: an empty ACK only.
    let mut con = publish(MsgType::Con, "nr/b", &["c=nr"], b"con");
    con.add_uint_option(opt::NO_RESPONSE, 2);
    dev.stamp(&mut con);
    dev.send(&con).await;
    let ack = dev.recv(T).await.expect("empty ACK");
    assert_eq!(
        (ack.mtype, ack.code, ack.message_id),
        (MsgType::Ack, Code::EMPTY, con.message_id)
    );
    // No 4.xx wanted, but a 2.xx is: a bad request is not answered.
    let mut bad = publish(MsgType::Non, "nr/+", &["c=nr"], b"x");
    bad.add_uint_option(opt::NO_RESPONSE, 8);
    dev.stamp(&mut bad);
    dev.send(&bad).await;
    assert!(dev.recv(Duration::from_millis(300)).await.is_none());
    gw.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coap_device_listed_in_priority_takes_the_high_lane_as_an_mqtt_device_would() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "vital/#").await;
    let gw = gateway(
        1,
        &format!(
            "[priority]\ndevices = {{ \"ecg-*\" = 1 }}\n[coap]\nlisten = \"127.0.0.1:0\"\n{}",
            cloud.uplink_toml(None, "[uplink.aggregate]\nenabled = false")
        ),
    );
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap")).await;
    for (device, topic) in [("ecg-7", "vital/ecg-7"), ("thermo-1", "vital/thermo-1")] {
        let req = publish(MsgType::Con, topic, &[&format!("c={device}")], b"x");
        assert_eq!(dev.exchange(req, T).await.code, Code::CHANGED);
        let got = sub.recv(T).await.unwrap().expect("cloud got it");
        assert_eq!(&*got.topic, topic);
    }
    let lane = |lane: &str| {
        metric_sum(
            &gw.metrics_text(),
            &format!(
                "sluice_uplink_messages_acked_total{{shard=\"0\",uplink=\"cloud\",lane=\"{lane}\"}}"
            ),
        )
    };
    // 2.04 follows the cloud's PUBACK, which the uplink counts before completing the token.
    assert_eq!(
        lane("high"),
        1.0,
        "the ecg device's message took the high lane"
    );
    assert_eq!(
        lane("normal"),
        1.0,
        "the thermometer's took the normal lane"
    );
    gw.shutdown();
}
