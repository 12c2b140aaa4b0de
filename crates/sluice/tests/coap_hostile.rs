//! The CoAP edge against a hostile, spoofing network (issue 28, findings 1–4, 7–9, 12): a
//! real gateway, devices on raw UDP sockets that send exactly the bytes a test gives them and
//! measure every byte the gateway sends back.
//!
//! The rule the amplification tests hold the gateway to: an address that has not proven it
//! receives (RFC 9175 Echo, or an ACK of a CON of the gateway's) gets no datagram larger than
//! 3× the request it answers, and no more than 3× in all for one request.

mod common;

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
