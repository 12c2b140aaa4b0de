//! The generator against the in-process responder: counts add up in each answering mode.

use std::time::Duration;

use super::responder::{Mode, Responder};
use super::{spawn_coap_load, CoapLoadConfig, RequestShape};
use sluice_proto::coap::Code;

fn config(target: std::net::SocketAddr) -> CoapLoadConfig {
    let mut c = CoapLoadConfig::new(target);
    c.sensors = 20;
    c.threads = 2;
    c.duration = Duration::from_millis(600);
    c.ramp = Duration::from_millis(100);
    c.warmup = Duration::from_millis(200);
    c.drain = Duration::from_secs(2);
    c
}

#[test]
fn piggybacked_responses_close_the_loop() {
    let responder = Responder::start(Mode::Piggybacked).unwrap();
    let report = spawn_coap_load(config(responder.addr()))
        .unwrap()
        .wait()
        .unwrap();
    let t = report.totals;
    assert!(
        t.requests > 100,
        "closed loop should run many requests: {t:?}"
    );
    assert_eq!(t.responses, t.requests, "{report:?}");
    assert_eq!(t.success, t.requests);
    assert_eq!((t.timeouts, t.resets, t.empty_acks), (0, 0, 0));
    assert_eq!(report.unfinished, 0);
    assert_eq!(report.codes.get("2.04"), Some(&t.success));
    assert_eq!(responder.requests(), t.requests + t.retransmissions);
    assert_eq!(report.latency_all.count, t.responses);
    assert!(report.latency.count > 0 && report.latency.count < t.responses);
}

#[test]
fn separate_responses_are_acked_and_counted() {
    let responder = Responder::start(Mode::Separate).unwrap();
    let mut c = config(responder.addr());
    c.request = RequestShape::fixed(Code::GET, "/cloud/time");
    let report = spawn_coap_load(c).unwrap().wait().unwrap();
    let t = report.totals;
    assert!(t.requests > 50, "{t:?}");
    assert_eq!(t.responses, t.requests);
    assert_eq!(t.empty_acks, t.requests);
    assert_eq!(report.codes.get("2.05"), Some(&t.requests));
    assert_eq!(t.timeouts, 0);
}

#[test]
fn silence_is_retransmitted_then_timed_out() {
    let responder = Responder::start(Mode::Silent).unwrap();
    let mut c = config(responder.addr());
    c.sensors = 4;
    c.ack_timeout = Duration::from_millis(40);
    c.max_retransmit = 2;
    c.duration = Duration::from_millis(500);
    let report = spawn_coap_load(c).unwrap().wait().unwrap();
    let t = report.totals;
    assert_eq!(t.responses, 0);
    assert!(t.timeouts >= 4, "{t:?}");
    // Every timed-out request was sent three times.
    assert!(t.retransmissions >= 2 * t.timeouts, "{t:?}");
    assert_eq!(t.timeouts + report.unfinished, t.requests, "{report:?}");
    assert_eq!(responder.requests(), t.requests + t.retransmissions);
}

#[test]
fn tcp_upstream_answers_every_pipelined_request_in_order() {
    use bytes::{Bytes, BytesMut};
    use sluice_proto::coap::tcp::{decode_tcp, encode_tcp};
    use sluice_proto::coap::{opt, Message, MsgType, Token};
    use std::io::{Read as _, Write as _};

    let up = super::tcp_upstream::TcpUpstream::start().unwrap();
    let mut conn = std::net::TcpStream::connect(up.addr()).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // 1000 PUTs with 4-byte tokens in one write: what libcoap 4.3.1's TCP server misreads.
    let mut out = BytesMut::new();
    encode_tcp(&sluice_proto::coap::tcp::csm(1152, false), &mut out);
    for i in 0u32..1000 {
        let token = Token::from_slice(&i.to_be_bytes()).unwrap();
        let mut m = Message::new(MsgType::Con, Code::PUT, 0, token);
        m.add_option(opt::URI_PATH, Bytes::from_static(b"example_data"));
        m.payload = Bytes::from_static(b"0123456789abcdef");
        encode_tcp(&m, &mut out);
    }
    conn.write_all(&out).unwrap();
    let mut inbuf = BytesMut::new();
    let mut chunk = [0u8; 8192];
    let mut answers = Vec::new();
    while answers.len() < 1001 {
        let n = conn.read(&mut chunk).unwrap();
        assert!(n > 0, "closed after {} frames", answers.len());
        inbuf.extend_from_slice(&chunk[..n]);
        while let Some(m) = decode_tcp(&mut inbuf, 65536).unwrap() {
            answers.push(m);
        }
    }
    assert_eq!(answers[0].code, Code::CSM);
    for (i, m) in answers[1..].iter().enumerate() {
        assert_eq!(m.code, Code::CHANGED);
        assert_eq!(m.token.as_slice(), (i as u32).to_be_bytes());
    }
    assert_eq!(up.requests(), 1000);
}

#[test]
fn an_interval_caps_each_sensor_rate() {
    let responder = Responder::start(Mode::Piggybacked).unwrap();
    let mut c = config(responder.addr());
    c.sensors = 10;
    c.interval = Duration::from_millis(50);
    c.duration = Duration::from_millis(1000);
    c.ramp = Duration::ZERO;
    let report = spawn_coap_load(c).unwrap().wait().unwrap();
    let t = report.totals;
    // At most 1000 ms / 50 ms + 1 = 21 requests per sensor.
    assert!(t.requests <= 10 * 21 && t.requests >= 10 * 15, "{t:?}");
    assert_eq!(t.responses, t.requests);
}
