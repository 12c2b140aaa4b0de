//! The CoAP edge against a hostile, spoofing network (issue 28, findings 1–4, 7–9, 12): a
//! real gateway, devices on raw UDP sockets that send exactly the bytes a test gives them and
//! measure every byte the gateway sends back.
//!
//! The rule the amplification tests hold the gateway to: an address that has not proven it
//! receives (RFC 9175 Echo, or an ACK of a CON of the gateway's) gets no datagram larger than
//! 3× the request it answers, and no more than 3× in all for one request.

mod common;
#[path = "coap_hostile/rates_and_blocks.rs"]
mod rates_and_blocks;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_proto::coap::{decode_tcp, encode_tcp, opt, tcp, Block, Code, Message, MsgType, Token};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

const WAIT: Duration = Duration::from_secs(5);

/// A device on its own UDP socket (on `ip`), reading whole datagrams up to 64 KiB.
struct Dev {
    sock: UdpSocket,
    gw: SocketAddr,
    mid: u16,
}

impl Dev {
    async fn new(gw: SocketAddr) -> Dev {
        Dev::on("127.0.0.1", gw).await
    }

    async fn on(ip: &str, gw: SocketAddr) -> Dev {
        let sock = UdpSocket::bind(format!("{ip}:0")).await.expect("bind");
        let mid = sock.local_addr().unwrap().port();
        Dev { sock, gw, mid }
    }

    fn next_mid(&mut self) -> u16 {
        self.mid = self.mid.wrapping_add(1);
        self.mid
    }

    /// Send `m` as is; its size on the wire.
    async fn send(&self, m: &Message) -> usize {
        let wire = m.to_udp();
        self.sock.send_to(&wire, self.gw).await.expect("send");
        wire.len()
    }

    /// The next datagram from the gateway: its size and the message.
    async fn recv(&self, wait: Duration) -> Option<(usize, Message)> {
        let mut buf = vec![0u8; 65_536];
        let (n, _) = tokio::time::timeout(wait, self.sock.recv_from(&mut buf))
            .await
            .ok()?
            .expect("recv");
        let m = Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])).expect("decodes");
        Some((n, m))
    }

    /// Send `m` and return the answer to it (same token), with its size.
    async fn ask(&self, m: &Message) -> (usize, usize, Message) {
        let sent = self.send(m).await;
        loop {
            let (n, r) = self.recv(WAIT).await.expect("an answer");
            if r.token == m.token && !r.code.is_empty() {
                return (sent, n, r);
            }
        }
    }
}

/// A request on `ps/{path}` (`path` split on '/'), token from `mid`.
fn req(mtype: MsgType, code: Code, mid: u16, path: &str) -> Message {
    let mut m = Message::new(
        mtype,
        code,
        mid,
        Token::from_slice(&mid.to_be_bytes()).unwrap(),
    );
    m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
    for seg in path.split('/') {
        m.add_option(opt::URI_PATH, Bytes::copy_from_slice(seg.as_bytes()));
    }
    m
}

fn metric(gw: &sluice::app::RunningGateway, prefix: &str) -> f64 {
    common::metric_sum(&gw.metrics_text(), prefix)
}

/// A retained message of `len` bytes on `topic`, published by an MQTT device and stored.
async fn retain(gw: &sluice::app::RunningGateway, topic: &str, len: usize) -> Vec<u8> {
    let body: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
    let mut mqtt = common::device(gw, "retainer", ProtocolVersion::V5).await;
    mqtt.publish(topic, Bytes::from(body.clone()), QoS::AtLeastOnce, true)
        .await
        .expect("publish retained");
    body
}

/// Finding 1: a small GET of a large retained value from an address that has not proven it
/// receives is answered with at most 3× its size (4.01 + Echo); echoed, the value comes
/// block by block, each within max_message_size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_get_of_a_large_retained_value_is_never_amplified() {
    let gw = common::gateway(2, "[coap]\nlisten = \"127.0.0.1:0\"\n");
    let body = retain(&gw, "big", 60_000).await;
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    // Wait until the retained message is stored (a 4.04 until then, small either way).
    let mut first = None;
    for _ in 0..100 {
        let mut m = Message::new(MsgType::Non, Code::GET, dev.next_mid(), Token::from_u64(1));
        m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
        m.add_option(opt::URI_PATH, Bytes::from_static(b"big"));
        let (sent, got, r) = dev.ask(&m).await;
        assert!(
            got <= 3 * sent,
            "{sent} B in, {got} B out to an unverified address ({:?})",
            r.code
        );
        if r.code != Code::NOT_FOUND {
            eprintln!("finding 1: GET of a 60,000 B retained value: {sent} B in, {got} B out");
            first = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let challenge = first.expect("the retained message was stored");
    assert_eq!(challenge.code, Code::UNAUTHORIZED);
    let echo = challenge.option(opt::ECHO).expect("an Echo option").clone();

    // Repeated with the Echo: the address is verified; block 0, then the rest.
    let mut got = Vec::new();
    let mut num = 0u32;
    loop {
        let mut m = Message::new(MsgType::Con, Code::GET, dev.next_mid(), Token::from_u64(2));
        m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
        m.add_option(opt::URI_PATH, Bytes::from_static(b"big"));
        if num == 0 {
            m.add_option(opt::ECHO, echo.clone());
        } else {
            m.add_uint_option(
                opt::BLOCK2,
                Block {
                    num,
                    more: false,
                    szx: 6,
                }
                .to_uint(),
            );
        }
        let (_, size, r) = dev.ask(&m).await;
        assert!(size <= 1152, "a block within max_message_size: {size}");
        assert_eq!(r.code, Code::CONTENT, "{r:?}");
        if num == 0 {
            assert_eq!(r.uint_option(opt::SIZE2), Some(60_000));
        }
        let b = Block::from_uint(r.uint_option(opt::BLOCK2).expect("Block2")).unwrap();
        got.extend_from_slice(&r.payload);
        if !b.more {
            break;
        }
        num = b.num + 1;
    }
    assert_eq!(got, body);
    assert!(
        metric(
            &gw,
            "sluice_coap_refused_total{shard=\"0\",reason=\"unverified\"}"
        ) + metric(
            &gw,
            "sluice_coap_refused_total{shard=\"1\",reason=\"unverified\"}"
        ) >= 1.0
    );
    assert!(metric(&gw, "sluice_coap_verified_total") >= 1.0);
    gw.shutdown();
}

/// Finding 2: CON GETs answered with large blocks keep the de-duplication table within
/// `max_exchange_bytes` (the oldest exchanges are evicted, counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dedup_table_stays_within_max_exchange_bytes() {
    let gw = common::gateway(
        1,
        "[coap]\nlisten = \"127.0.0.1:0\"\nmax_exchange_bytes = \"16KiB\"\n",
    );
    retain(&gw, "big", 4_000).await;
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    // Verify the address once.
    let mut echo = None;
    for _ in 0..100 {
        let mid = dev.next_mid();
        let (_, _, r) = dev.ask(&req(MsgType::Con, Code::GET, mid, "big")).await;
        if r.code == Code::UNAUTHORIZED {
            echo = r.option(opt::ECHO).cloned();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut m = req(MsgType::Con, Code::GET, dev.next_mid(), "big");
    m.add_option(opt::ECHO, echo.expect("challenged"));
    assert_eq!(dev.ask(&m).await.2.code, Code::CONTENT);
    for _ in 0..200 {
        let mid = dev.next_mid();
        let (_, size, r) = dev.ask(&req(MsgType::Con, Code::GET, mid, "big")).await;
        assert_eq!(r.code, Code::CONTENT);
        assert!(size > 1000);
    }
    let bytes = metric(&gw, "sluice_coap_exchange_bytes{");
    assert!(bytes > 0.0 && bytes <= 16.0 * 1024.0, "{bytes}");
    assert!(metric(&gw, "sluice_coap_dedup_evictions_total") > 100.0);
    gw.shutdown();
}

/// Finding 3: an Observe whose Uri-Path has more segments than `mqtt.max_topic_levels` is
/// refused 4.00 (counted) and registers nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observe_filter_beyond_the_topic_limits_is_refused() {
    let gw = common::gateway(1, "[coap]\nlisten = \"127.0.0.1:0\"\n");
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    let mut m = Message::new(MsgType::Con, Code::GET, dev.next_mid(), Token::from_u64(3));
    m.add_uint_option(opt::OBSERVE, 0);
    m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
    for _ in 0..1_000 {
        m.add_option(opt::URI_PATH, Bytes::new());
    }
    let (sent, size, r) = dev.ask(&m).await;
    assert_eq!(r.code, Code::BAD_REQUEST, "{r:?}");
    assert!(size <= 3 * sent);
    assert_eq!(metric(&gw, "sluice_coap_observers{"), 0.0);
    assert_eq!(
        metric(
            &gw,
            "sluice_coap_refused_total{shard=\"0\",reason=\"topic_limit\"}"
        ),
        1.0
    );
    // A publish to such a topic is refused the same way.
    let mut p = req(MsgType::Con, Code::POST, dev.next_mid(), "a");
    for _ in 0..200 {
        p.add_option(opt::URI_PATH, Bytes::from_static(b"x"));
    }
    p.payload = Bytes::from_static(b"1");
    assert_eq!(dev.ask(&p).await.2.code, Code::BAD_REQUEST);
    gw.shutdown();
}

const USERS: &str = "[[mqtt.users]]\nusername = \"alice\"\npassword_hash = \"$argon2id$v=19$m=19456,t=2,p=1$c2x1aWNlc2FsdDE2Ynl0ZQ$AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8\"\n";

/// Finding 4: with `[[mqtt.users]]` and no `coap.allow_anonymous`, an anonymous CoAP peer
/// may neither publish nor observe (4.01, counted); `allow_anonymous = true` lets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mqtt_users_an_anonymous_coap_peer_may_not_publish_or_observe() {
    let gw = common::gateway(1, &format!("[coap]\nlisten = \"127.0.0.1:0\"\n{USERS}"));
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    let mut p = req(MsgType::Con, Code::POST, dev.next_mid(), "devices/x/t");
    p.payload = Bytes::from_static(b"21.5");
    assert_eq!(dev.ask(&p).await.2.code, Code::UNAUTHORIZED);
    let mut o = req(MsgType::Con, Code::GET, dev.next_mid(), "#");
    o.add_uint_option(opt::OBSERVE, 0);
    let (_, _, r) = dev.ask(&o).await;
    assert_eq!(r.code, Code::UNAUTHORIZED);
    assert!(
        r.option(opt::ECHO).is_none(),
        "refused for good, not challenged"
    );
    assert_eq!(metric(&gw, "sluice_coap_observers{"), 0.0);
    assert_eq!(metric(&gw, "sluice_coap_publishes_total"), 0.0);
    assert_eq!(
        metric(
            &gw,
            "sluice_coap_refused_total{shard=\"0\",reason=\"anonymous\"}"
        ),
        2.0
    );
    gw.shutdown();

    let gw = common::gateway(
        1,
        &format!("[coap]\nlisten = \"127.0.0.1:0\"\nallow_anonymous = true\n{USERS}"),
    );
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    let mut p = req(MsgType::Non, Code::POST, dev.next_mid(), "devices/x/t");
    p.payload = Bytes::from_static(b"21.5");
    assert_eq!(dev.ask(&p).await.2.code, Code::CHANGED);
    gw.shutdown();
}

/// Register `dev` as an observer of `filter` (answering the Echo challenge); the response.
async fn observe(dev: &mut Dev, filter: &str, token: u64) -> Message {
    let mut echo = None;
    loop {
        let mut m = req(MsgType::Con, Code::GET, dev.next_mid(), filter);
        m.token = Token::from_u64(token);
        m.add_uint_option(opt::OBSERVE, 0);
        if let Some(e) = echo.take() {
            m.add_option(opt::ECHO, e);
        }
        let (_, _, r) = dev.ask(&m).await;
        match (r.code, r.option(opt::ECHO)) {
            (Code::UNAUTHORIZED, Some(e)) => echo = Some(e.clone()),
            _ => return r,
        }
    }
}

/// Finding 7: an observer that never acknowledges is checked with a CON after
/// `observer_check` even when nothing is published, and dropped when the CON goes
/// unanswered; one address cannot take every observer slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_that_never_acknowledge_expire_and_one_address_cannot_fill_the_table() {
    let gw = common::gateway(
        1,
        "[coap]\nlisten = \"127.0.0.1:0\"\nobserver_check = \"1s\"\nack_timeout = \"200ms\"\n\
         separate_after = \"100ms\"\nmax_retransmit = 1\nmax_observers = 8\n\
         max_observers_per_source = 4\n",
    );
    let addr = gw.coap_addr.expect("coap");
    let mut dev = Dev::new(addr).await;
    let r = observe(&mut dev, "quiet/topic", 7).await;
    assert_eq!(r.code, Code::CONTENT, "{r:?}");
    assert_eq!(metric(&gw, "sluice_coap_observers{"), 1.0);
    // Nothing is published; the device never ACKs: a CON check comes, and it goes.
    let (_, check) = dev.recv(Duration::from_secs(4)).await.expect("a CON check");
    assert_eq!((check.mtype, check.code), (MsgType::Con, Code::CONTENT));
    assert!(
        common::eventually(Duration::from_secs(5), || metric(
            &gw,
            "sluice_coap_observers{"
        ) == 0.0)
        .await,
        "an unconfirmed observer is dropped"
    );
    assert_eq!(
        metric(
            &gw,
            "sluice_coap_observe_deregistrations_total{shard=\"0\",reason=\"unconfirmed\"}"
        ),
        1.0
    );

    // Eight registrations from one address: four are held, the rest refused 5.03.
    let mut codes = Vec::new();
    for t in 0..8 {
        codes.push(observe(&mut dev, "a/b", 100 + t).await.code);
    }
    let held = codes.iter().filter(|c| **c == Code::CONTENT).count();
    assert_eq!(held, 4, "{codes:?}");
    assert_eq!(
        metric(&gw, "sluice_coap_observe_refused_per_source_total"),
        4.0
    );
    // Another address still gets a slot.
    let mut other = Dev::on("127.0.0.2", addr).await;
    assert_eq!(observe(&mut other, "a/b", 1).await.code, Code::CONTENT);
    gw.shutdown();
}

/// A Block1 block 0 of a publish to `topic` with more to come.
fn block0(mid: u16, topic: &str) -> Message {
    let mut m = req(MsgType::Con, Code::POST, mid, topic);
    m.add_uint_option(
        opt::BLOCK1,
        Block {
            num: 0,
            more: true,
            szx: 2,
        }
        .to_uint(),
    );
    m.payload = Bytes::from(vec![b'x'; 64]);
    m
}

/// Finding 8: block-0s that never continue hold a transfer slot only for
/// `block_idle_timeout`, and one address holds at most `max_block_transfers_per_source`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_block1_transfers_free_their_slots_and_one_address_holds_few() {
    let gw = common::gateway(1, "[coap]\nlisten = \"127.0.0.1:0\"\n");
    let addr = gw.coap_addr.expect("coap");
    let mut dev = Dev::new(addr).await;
    let mut codes = Vec::new();
    for i in 0..6 {
        let mid = dev.next_mid();
        let m = block0(mid, &format!("up/{i}"));
        codes.push(dev.ask(&m).await.2.code);
    }
    assert_eq!(
        codes,
        [
            Code::CONTINUE,
            Code::CONTINUE,
            Code::CONTINUE,
            Code::CONTINUE,
            Code::SERVICE_UNAVAILABLE,
            Code::SERVICE_UNAVAILABLE
        ]
    );
    assert_eq!(
        metric(
            &gw,
            "sluice_coap_refused_total{shard=\"0\",reason=\"block_per_source\"}"
        ),
        2.0
    );
    gw.shutdown();

    let gw = common::gateway(
        1,
        "[coap]\nlisten = \"127.0.0.1:0\"\nmax_block_transfers = 2\nblock_idle_timeout = \"1s\"\n",
    );
    let addr = gw.coap_addr.expect("coap");
    let a = Dev::on("127.0.0.3", addr).await;
    let b = Dev::on("127.0.0.4", addr).await;
    let mut c = Dev::on("127.0.0.5", addr).await;
    assert_eq!(a.ask(&block0(1, "t/a")).await.2.code, Code::CONTINUE);
    assert_eq!(b.ask(&block0(1, "t/b")).await.2.code, Code::CONTINUE);
    let mid = c.next_mid();
    assert_eq!(
        c.ask(&block0(mid, "t/c")).await.2.code,
        Code::SERVICE_UNAVAILABLE,
        "both slots held"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mid = c.next_mid();
    assert_eq!(
        c.ask(&block0(mid, "t/c")).await.2.code,
        Code::CONTINUE,
        "the idle ones were forgotten"
    );
    assert_eq!(
        metric(&gw, "sluice_coap_block_transfers_expired_total"),
        2.0
    );
    gw.shutdown();
}

/// Finding 9: an error answer does not echo the request's bytes (an invalid topic name of
/// control characters was echoed escaped: 5× the request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_does_not_echo_the_request() {
    let gw = common::gateway(1, "[coap]\nlisten = \"127.0.0.1:0\"\n");
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    let mut m = Message::new(MsgType::Con, Code::POST, dev.next_mid(), Token::from_u64(9));
    m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
    m.add_option(opt::URI_PATH, Bytes::from(vec![0x01u8; 200]));
    m.add_option(opt::URI_PATH, Bytes::from(vec![0x01u8; 200]));
    // A wildcard makes it an invalid topic name.
    m.add_option(opt::URI_PATH, Bytes::from_static(b"+"));
    m.payload = Bytes::from_static(b"x");
    let (sent, size, r) = dev.ask(&m).await;
    assert_eq!(r.code, Code::BAD_REQUEST);
    eprintln!("finding 9: invalid topic: {sent} B in, {size} B out");
    assert!(size < 64, "{sent} B in, {size} B out");
    assert!(!r
        .payload
        .windows(2)
        .any(|w| w == &b"\\u"[..] || w == &[1u8, 1][..]));
    gw.shutdown();
}

/// An RFC 8323 upstream that answers every request with `body` (ignoring Block2) after
/// `delay`.
async fn upstream(body: Bytes, delay: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = BytesMut::new();
                let mut out = BytesMut::new();
                encode_tcp(&tcp::csm(1 << 20, false), &mut out);
                if s.write_all(&out).await.is_err() {
                    return;
                }
                loop {
                    let m = loop {
                        if let Some(m) = decode_tcp(&mut buf, 1 << 20).unwrap() {
                            break m;
                        }
                        if s.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    };
                    if !m.code.is_request() {
                        continue;
                    }
                    tokio::time::sleep(delay).await;
                    let mut res = Message::new(MsgType::Con, Code::CONTENT, 0, m.token);
                    res.payload = body.clone();
                    let mut out = BytesMut::new();
                    encode_tcp(&res, &mut out);
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// Finding 12: a 60 KiB upstream answer is not relayed in one datagram (4.01 + Echo to an
/// unverified address, then Block2 within max_message_size), and a separate response to an
/// unverified address is not retransmitted beyond 3× the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_relays_stay_within_the_3x_rule_and_max_message_size() {
    let big = Bytes::from(vec![b'p'; 60_000]);
    let port = upstream(big, Duration::ZERO).await;
    let slow = upstream(Bytes::from_static(b"ok"), Duration::from_millis(400)).await;
    let gw = common::gateway(
        1,
        &format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\nack_timeout = \"300ms\"\nseparate_after = \"100ms\"\n\
             [[coap.proxy]]\nname = \"up\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"up\"\n\
             [[coap.proxy]]\nname = \"slow\"\nurl = \"coap+tcp://127.0.0.1:{slow}\"\nprefix = \"slow\"\n"
        ),
    );
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    let get = |mid: u16, prefix: &'static str| {
        let mut m = Message::new(MsgType::Con, Code::GET, mid, Token::from_u64(mid as u64));
        m.add_option(opt::URI_PATH, Bytes::from_static(prefix.as_bytes()));
        m.add_option(opt::URI_PATH, Bytes::from_static(b"r"));
        m
    };
    let mid = dev.next_mid();
    let (sent, size, r) = dev.ask(&get(mid, "up")).await;
    eprintln!(
        "finding 12: proxied GET of a 60,000 B answer, unverified: {sent} B in, {size} B out"
    );
    assert!(size <= 3 * sent, "{sent} B in, {size} B out");
    assert_eq!(r.code, Code::UNAUTHORIZED);
    let mut m = get(dev.next_mid(), "up");
    m.add_option(opt::ECHO, r.option(opt::ECHO).expect("Echo").clone());
    let (_, size, r) = dev.ask(&m).await;
    eprintln!("finding 12: the same, verified: {size} B out (Block2)");
    assert!(size <= 1152, "{size}");
    assert_eq!(r.code, Code::CONTENT);
    assert!(r.option(opt::BLOCK2).is_some());

    // A separate response to an address never verified: at most 3× the request in all.
    let other = Dev::on("127.0.0.6", gw.coap_addr.unwrap()).await;
    let m = get(0x5151, "slow");
    let sent = other.send(&m).await;
    let mut total = 0;
    while let Some((n, r)) = other.recv(Duration::from_secs(3)).await {
        total += n;
        assert!(r.mtype != MsgType::Con || r.code == Code::CONTENT, "{r:?}");
    }
    eprintln!("finding 12: separate response never ACKed: {sent} B in, {total} B out");
    assert!(total > 0, "answered");
    assert!(
        total <= 3 * sent,
        "{sent} B in, {total} B out (never ACKed)"
    );
    gw.shutdown();
}

/// Findings 1 and 7: an Observe registration may come from a spoofed address. Until the
/// address proves it receives, every notification is CON, at most 3× the registration
/// request (a larger one is dropped, counted), retransmitted only within 3×; the first one
/// not acknowledged ends the registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_at_an_unverified_address_gets_little_and_goes_when_silent() {
    let gw = common::gateway(
        1,
        "[coap]\nlisten = \"127.0.0.1:0\"\nack_timeout = \"200ms\"\nseparate_after = \"100ms\"\n",
    );
    let mut dev = Dev::new(gw.coap_addr.expect("coap")).await;
    let mut m = req(MsgType::Con, Code::GET, dev.next_mid(), "s/t");
    m.add_uint_option(opt::OBSERVE, 0);
    let (sent, size, r) = dev.ask(&m).await;
    assert_eq!(r.code, Code::CONTENT, "{r:?}");
    assert!(size <= 3 * sent);
    let mut mqtt = common::device(&gw, "pub", ProtocolVersion::V5).await;
    // Too large for an unverified observer: not sent.
    mqtt.publish("s/t", Bytes::from(vec![b'L'; 500]), QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    mqtt.publish("s/t", &b"21.5"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    let mut total = 0;
    while let Some((n, r)) = dev.recv(Duration::from_secs(2)).await {
        assert_eq!(r.mtype, MsgType::Con, "{r:?}");
        assert_eq!(&r.payload[..], b"21.5");
        assert!(n <= 3 * sent);
        total += n;
    }
    eprintln!("unverified observer never ACKing: {sent} B registration, {total} B notifications");
    assert!(total > 0 && total <= 3 * sent, "{sent} B in, {total} B out");
    assert!(
        common::eventually(WAIT, || metric(&gw, "sluice_coap_observers{") == 0.0).await,
        "the silent observer is gone"
    );
    assert_eq!(
        metric(
            &gw,
            "sluice_coap_notifications_dropped_total{shard=\"0\",reason=\"unverified\"}"
        ),
        1.0
    );

    // A registration whose first answer (a large retained value) is too large for the
    // address: 4.01 + Echo, and nothing stays registered.
    retain(&gw, "s/big", 2_000).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut m = req(MsgType::Con, Code::GET, dev.next_mid(), "s/big");
    m.add_uint_option(opt::OBSERVE, 0);
    let (sent, size, r) = dev.ask(&m).await;
    assert_eq!(r.code, Code::UNAUTHORIZED, "{r:?}");
    assert!(size <= 3 * sent);
    assert!(
        common::eventually(WAIT, || metric(&gw, "sluice_coap_observers{") == 0.0).await,
        "not left registered"
    );
    // With the Echo: registered, the value in Block2 blocks.
    let mut m = req(MsgType::Con, Code::GET, dev.next_mid(), "s/big");
    m.add_uint_option(opt::OBSERVE, 0);
    m.add_option(opt::ECHO, r.option(opt::ECHO).expect("Echo").clone());
    let (_, size, r) = dev.ask(&m).await;
    assert_eq!(r.code, Code::CONTENT);
    assert!(size <= 1152 && r.option(opt::BLOCK2).is_some() && r.option(opt::OBSERVE).is_some());
    assert_eq!(metric(&gw, "sluice_coap_observers{"), 1.0);
    gw.shutdown();
}
