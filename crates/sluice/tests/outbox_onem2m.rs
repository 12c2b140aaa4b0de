//! The outbox suite run over the oneM2M transport, against a small fault-injecting CSE on a
//! loopback socket (keep-alive HTTP/1.1, pipelined requests answered in order): it answers
//! AE and container creates with 2001, records each contentInstance's `con`, and can refuse
//! the next ones (503 without an RSC: temporary; RSC 4103: permanent, not authorized), hold
//! its answers, or cut every connection.
//!
//! oneM2M has no DUP flag: the far end counts a `con` it had seen before as a resend. The
//! QoS 0 case of the suite does not apply: the transport waits for the CSE's answer to every
//! request, QoS 0 ones included (their queue bytes are what bounds them), so a QoS 0 message
//! is not finished once written.

mod common;
mod outbox_suite;

use std::collections::HashSet;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use bytes::{Buf, Bytes, BytesMut};
use outbox_suite::{Harness, Received};
use sluice::config::{MqttProtocol, UplinkConfig, UplinkUrl};
use sluice::sink::onem2m::OneM2mTransport;
use sluice::sink::transport::RefusalClass;
use sluice::sink::{Lane, UplinkMetrics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

#[derive(Default)]
struct Log {
    received: Vec<Received>,
    seen: HashSet<Bytes>,
    /// Answers for the next contentInstances: (HTTP status, RSC).
    refuse: Vec<(u16, Option<u32>)>,
}

struct FakeCse {
    addr: std::net::SocketAddr,
    log: Arc<Mutex<Log>>,
    /// (hold answers, cut generation).
    control: watch::Sender<(bool, u64)>,
}

impl FakeCse {
    async fn serve(
        mut tcp: tokio::net::TcpStream,
        log: Arc<Mutex<Log>>,
        mut control: watch::Receiver<(bool, u64)>,
    ) {
        let generation = control.borrow().1;
        let mut buf = BytesMut::new();
        // Answers not yet written, each with whether it answers a contentInstance and the
        // index of the log entry it accepts. Holding holds contentInstance answers (and,
        // to keep the order, everything behind them), never the AE's or a container's.
        let mut held: Vec<(Vec<u8>, bool, Option<usize>)> = Vec::new();
        loop {
            tokio::select! {
                n = tcp.read_buf(&mut buf) => {
                    if !matches!(n, Ok(n) if n > 0) {
                        return;
                    }
                    while let Some(answer) = Self::answer(&mut buf, &log) {
                        held.push(answer);
                    }
                }
                changed = control.changed() => {
                    if changed.is_err() || control.borrow().1 != generation {
                        return; // cut
                    }
                }
            }
            let hold = control.borrow().0;
            let ready = held
                .iter()
                .position(|(_, cin, _)| hold && *cin)
                .unwrap_or(held.len());
            for (bytes, _, entry) in held.drain(..ready) {
                if tcp.write_all(&bytes).await.is_err() {
                    return;
                }
                if let Some(i) = entry {
                    log.lock().unwrap().received[i].accepted = true;
                }
            }
        }
    }

    /// Decode one request from `buf` and make its answer (with the log entry a 2001 accepts).
    fn answer(buf: &mut BytesMut, log: &Arc<Mutex<Log>>) -> Option<(Vec<u8>, bool, Option<usize>)> {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        let head = match req.parse(buf) {
            Ok(httparse::Status::Complete(n)) => n,
            _ => return None,
        };
        let header = |name: &str| {
            req.headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| String::from_utf8_lossy(h.value).into_owned())
        };
        let len: usize = header("content-length")?.parse().ok()?;
        let ty = header("content-type").unwrap_or_default();
        if buf.len() < head + len {
            return None;
        }
        let body = buf[head..head + len].to_vec();
        buf.advance(head + len);
        let cin = ty.ends_with("ty=4");
        let (status, rsc, entry) = if cin {
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            let con = Bytes::from(v["m2m:cin"]["con"].as_str()?.to_owned());
            let mut log = log.lock().unwrap();
            let dup = !log.seen.insert(con.clone());
            log.received.push(Received {
                payload: con,
                dup,
                accepted: false,
            });
            let i = log.received.len() - 1;
            if log.refuse.is_empty() {
                (201, Some(2001), Some(i))
            } else {
                let (status, rsc) = log.refuse.remove(0);
                (status, rsc, None)
            }
        } else {
            (201, Some(2001), None)
        };
        let rsc = rsc.map_or(String::new(), |r| format!("X-M2M-RSC: {r}\r\n"));
        let answer = format!("HTTP/1.1 {status} X\r\n{rsc}Content-Length: 0\r\n\r\n").into_bytes();
        Some((answer, cin, entry))
    }
}

impl Harness for FakeCse {
    type T = OneM2mTransport;

    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let log = Arc::new(Mutex::new(Log::default()));
        let (control, _) = watch::channel((false, 0));
        let (l, rx) = (log.clone(), control.subscribe());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(FakeCse::serve(tcp, l.clone(), rx.clone()));
            }
        });
        FakeCse { addr, log, control }
    }

    fn url(&self) -> UplinkUrl {
        UplinkUrl {
            tls: false,
            host: "127.0.0.1".into(),
            port: self.addr.port(),
        }
    }

    /// The suite's window (`inflight`) as `connections × pipeline`.
    fn transport(&self, cfg: Rc<UplinkConfig>, metrics: Arc<UplinkMetrics>) -> OneM2mTransport {
        let mut c = UplinkConfig::clone(&cfg);
        c.protocol = MqttProtocol::OneM2m;
        c.cse_id = Some("/id-in".into());
        c.cse_name = Some("cse-in".into());
        c.originator = Some("Cgw".into());
        let window = usize::from(cfg.inflight.max(1));
        let connections = if window >= 2 { 2 } else { 1 };
        c.connections = Some(connections);
        c.pipeline = Some(window / connections);
        OneM2mTransport::new(0, Lane::Normal, Rc::new(c), None, metrics)
    }

    fn cut_link(&self) {
        self.control.send_modify(|(_, generation)| *generation += 1);
    }

    fn refuse_next(&self, n: usize, _code: u8, class: RefusalClass) {
        let answer = match class {
            RefusalClass::Temporary => (503, None),
            _ => (403, Some(4103)),
        };
        self.log
            .lock()
            .unwrap()
            .refuse
            .extend(std::iter::repeat_n(answer, n));
    }

    fn hold_acks(&self, hold: bool) {
        self.control.send_modify(|(h, _)| *h = hold);
    }

    fn received(&self) -> Vec<Received> {
        self.log.lock().unwrap().received.clone()
    }
}

#[test]
fn per_device_order_holds_with_many_devices_and_a_window_above_one() {
    common::run_local(outbox_suite::per_device_order::<FakeCse>());
}
#[test]
fn a_temporary_refusal_is_resent_in_order_after_the_backoff_and_acked_only_then() {
    common::run_local(outbox_suite::temporary_refusal::<FakeCse>());
}
#[test]
fn a_cut_link_with_messages_in_flight_resends_them_in_order_and_loses_none() {
    common::run_local(outbox_suite::link_cut_in_flight::<FakeCse>());
}
#[test]
fn a_permanent_refusal_is_counted_and_completes_the_token_with_its_code() {
    common::run_local(outbox_suite::permanent_refusal::<FakeCse>());
}

/// A CSE closing idle keep-alive connections (its keep-alive timeout) is no failure: nothing
/// was waiting on them, the next request opens a new one, and the outbox never reconnects.
#[test]
fn idle_connections_the_cse_closed_are_reopened_without_a_reconnect() {
    common::run_local(async {
        let up = outbox_suite::start::<FakeCse>(8).await;
        let acks = sluice::message::ack::DeviceAcks::new();
        up.queue
            .push(outbox_suite::message(
                0,
                0,
                sluice_proto::mqtt::QoS::AtLeastOnce,
                &acks,
            ))
            .await;
        common::wait_until("the first ack", std::time::Duration::from_secs(10), || {
            !acks.drain().is_empty()
        })
        .await;
        up.far.cut_link();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        up.queue
            .push(outbox_suite::message(
                0,
                1,
                sluice_proto::mqtt::QoS::AtLeastOnce,
                &acks,
            ))
            .await;
        common::wait_until("the second ack", std::time::Duration::from_secs(10), || {
            !acks.drain().is_empty()
        })
        .await;
        assert_eq!(up.metrics.connects.get(), 1, "no reconnect");
        assert_eq!(up.metrics.connect_failures.get(), 0);
        let payloads: Vec<Bytes> = up.far.received().into_iter().map(|r| r.payload).collect();
        assert_eq!(
            payloads,
            vec![Bytes::from("d0:0"), Bytes::from("d0:1")],
            "each once"
        );
        up.stop().await;
    });
}
