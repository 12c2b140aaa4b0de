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
