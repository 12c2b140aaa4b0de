//! CoAP Observe (RFC 7641) end to end over real UDP: a device observes
//! `coap://gw/ps/{filter}` and receives what an MQTT device publishes, as notifications —
//! CON first (until its address is verified), then NON with CON every 24th — until it
//! deregisters by RST or GET; and libcoap's `coap-client` as a real observer.

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use tokio::net::UdpSocket;

const WAIT: Duration = Duration::from_secs(5);

fn coap_gateway(shards: usize) -> sluice::app::RunningGateway {
    common::gateway(shards, "[coap]\nlisten = \"127.0.0.1:0\"\n")
}

/// A CoAP device on a UDP socket of its own.
struct Device {
    sock: UdpSocket,
    gw: SocketAddr,
    mid: u16,
}

impl Device {
    async fn new(gw: SocketAddr) -> Device {
        let sock = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        Device { sock, gw, mid: 100 }
    }

    async fn send(&self, m: &Message) {
        self.sock.send_to(&m.to_udp(), self.gw).await.expect("send");
    }

    async fn recv(&self) -> Message {
        self.try_recv(WAIT)
            .await
            .expect("a datagram from the gateway")
    }

    async fn try_recv(&self, wait: Duration) -> Option<Message> {
        let mut buf = vec![0u8; 2048];
        let (n, _) = tokio::time::timeout(wait, self.sock.recv_from(&mut buf))
            .await
            .ok()?
            .expect("recv");
        Some(Message::decode_udp(&Bytes::copy_from_slice(&buf[..n])).expect("decodes"))
    }

    /// A CON GET on `ps/{path}` as device `id`, with `observe` when given. A 4.01 with an
    /// Echo option (the gateway asks an address it has not verified to prove it receives,
    /// RFC 9175) is answered as a client does: the request again, with the Echo.
    async fn get(&mut self, id: &str, path: &str, token: u64, observe: Option<u32>) -> Message {
        let mut echo: Option<Bytes> = None;
        loop {
            self.mid += 1;
            let mut m = Message::new(MsgType::Con, Code::GET, self.mid, Token::from_u64(token));
            if let Some(o) = observe {
                m.add_uint_option(opt::OBSERVE, o);
            }
            m.add_option(opt::URI_PATH, Bytes::from_static(b"ps"));
            for seg in path.split('/') {
                m.add_option(opt::URI_PATH, Bytes::copy_from_slice(seg.as_bytes()));
            }
            m.add_option(opt::URI_QUERY, Bytes::from(format!("c={id}")));
            if let Some(e) = echo.take() {
                m.add_option(opt::ECHO, e);
            }
            self.send(&m).await;
            let resp = self.recv().await;
            assert_eq!(
                resp.message_id, self.mid,
                "piggybacked on the ACK: {resp:?}"
            );
            assert_eq!(resp.mtype, MsgType::Ack);
            match (resp.code, resp.option(opt::ECHO)) {
                (Code::UNAUTHORIZED, Some(e)) => echo = Some(e.clone()),
                _ => return resp,
            }
        }
    }

    /// The next notification (ACKing it when CON).
    async fn notification(&self) -> Message {
        let n = self.recv().await;
        if n.mtype == MsgType::Con {
            self.send(&Message::empty(MsgType::Ack, n.message_id)).await;
        }
        n
    }
}

fn observers(gw: &sluice::app::RunningGateway) -> f64 {
    common::metric_sum(&gw.metrics_text(), "sluice_coap_observers{")
}

#[tokio::test]
async fn an_observer_receives_what_an_mqtt_device_publishes_until_it_deregisters() {
    let gw = coap_gateway(2);
    // The publisher on shard 0, the observer on shard 1: delivery crosses shards.
    let ids = common::ids_on_shards("dev", 2, 1);
    let mut dev = Device::new(gw.coap_addr.expect("coap listener")).await;
    let mut mqtt = common::device(&gw, &ids[0][0], ProtocolVersion::V5).await;

    let reg = dev.get(&ids[1][0], "room/+/temp", 0xBEEF, Some(0)).await;
    assert_eq!(reg.code, Code::CONTENT);
    let first = reg.uint_option(opt::OBSERVE).expect("registered");
    assert_eq!(observers(&gw), 1.0);
    let text = gw.metrics_text();
    assert_eq!(
        common::metric_sum(&text, "sluice_coap_observers{shard=\"1\"}"),
        1.0,
        "the observer is on its device's shard"
    );

    mqtt.publish("room/kitchen/temp", &b"21.5"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    let n = dev.notification().await;
    assert_eq!(n.code, Code::CONTENT);
    assert_eq!(n.token, Token::from_u64(0xBEEF));
    assert_eq!(&n.payload[..], b"21.5");
    let mut last = n.uint_option(opt::OBSERVE).expect("Observe");
    assert!(last > first);

    // 24 more. The first notification was CON: the device's address had not proven it
    // receives (issue 28), and its ACK verified it; from then on every 24th is CON.
    let mut types = vec![n.mtype];
    for i in 0..24 {
        let p = format!("v{i}");
        mqtt.publish(
            "room/hall/temp",
            Bytes::copy_from_slice(p.as_bytes()),
            QoS::AtMostOnce,
            false,
        )
        .await
        .expect("publish");
        let n = dev.notification().await;
        assert_eq!(&n.payload[..], p.as_bytes());
        let seq = n.uint_option(opt::OBSERVE).expect("Observe");
        assert!(seq > last, "Observe increases");
        last = seq;
        types.push(n.mtype);
    }
    let cons: Vec<usize> = (0..types.len())
        .filter(|i| types[*i] == MsgType::Con)
        .collect();
    assert_eq!(cons, [0, 24], "{types:?}");

    // An RST for a NON notification deregisters.
    mqtt.publish("room/attic/temp", &b"30"[..], QoS::AtMostOnce, false)
        .await
        .expect("publish");
    let n = dev.recv().await;
    assert_eq!(n.mtype, MsgType::Non);
    let rebuilds =
        || common::metric_sum(&gw.metrics_text(), "sluice_control_snapshot_rebuilds_total");
    let before = rebuilds();
    dev.send(&Message::empty(MsgType::Rst, n.message_id)).await;
    assert!(
        common::eventually(WAIT, || observers(&gw) == 0.0).await,
        "deregistered by RST"
    );
    // The control plane publishes the subscription snapshot without the filter after the
    // observer count drops (the unsubscribe runs in a task of its own): until then a publish
    // on shard 0 would still cross, and be dropped on shard 1.
    assert!(
        common::eventually(WAIT, || rebuilds() > before).await,
        "the snapshot without the filter is published"
    );
    mqtt.publish("room/attic/temp", &b"31"[..], QoS::AtMostOnce, false)
        .await
        .expect("publish");
    assert!(
        dev.try_recv(Duration::from_millis(300)).await.is_none(),
        "nothing after the RST"
    );
    let text = gw.metrics_text();
    assert_eq!(
        common::metric_sum(
            &text,
            "sluice_coap_observe_deregistrations_total{shard=\"1\",reason=\"reset\"}"
        ),
        1.0
    );
    assert_eq!(
        common::metric_sum(
            &text,
            "sluice_coap_notifications_total{shard=\"1\",type=\"con\"}"
        ),
        2.0
    );
    // 26 crossed to shard 1; the one after the RST did not even leave shard 0 (the filter
    // left the snapshot).
    let crossed = common::metric_sum(&text, "sluice_shard_cross_sent_total{shard=\"0\"}");
    assert_eq!(crossed, 26.0);
}

#[tokio::test]
async fn re_registration_replaces_and_get_deregisters() {
    let gw = coap_gateway(1);
    let mut dev = Device::new(gw.coap_addr.expect("coap listener")).await;
    let mut mqtt = common::device(&gw, "pub-2", ProtocolVersion::V311).await;
    mqtt.publish("door/1", &b"closed"[..], QoS::AtLeastOnce, true)
        .await
        .expect("publish retained");
    tokio::time::sleep(Duration::from_millis(100)).await;

    let reg = dev.get("obs-2", "door/1", 7, Some(0)).await;
    assert_eq!(&reg.payload[..], b"closed", "the retained message answers");
    let again = dev.get("obs-2", "door/2", 7, Some(0)).await;
    assert_eq!(again.code, Code::CONTENT);
    assert!(again.uint_option(opt::OBSERVE) > reg.uint_option(opt::OBSERVE));
    assert_eq!(observers(&gw), 1.0, "same endpoint and token: replaced");

    mqtt.publish("door/1", &b"open"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    mqtt.publish("door/2", &b"ajar"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    let n = dev.notification().await;
    assert_eq!(&n.payload[..], b"ajar", "only the new filter notifies");

    let bye = dev.get("obs-2", "door/2", 7, Some(1)).await;
    assert_eq!(bye.code, Code::CONTENT);
    assert_eq!(bye.uint_option(opt::OBSERVE), None);
    assert_eq!(observers(&gw), 0.0);
    mqtt.publish("door/2", &b"gone"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    assert!(dev.try_recv(Duration::from_millis(300)).await.is_none());
}

/// libcoap's client observes for a few seconds and prints each notification's payload.
#[tokio::test]
async fn libcoap_client_observes_mqtt_publishes() {
    let gw = coap_gateway(2);
    let coap = gw.coap_addr.expect("coap listener");
    let child = tokio::process::Command::new("coap-client-notls")
        .args(["-m", "get", "-s", "3", "-B", "4"])
        .arg(format!("coap://{coap}/ps/plant/+/level?c=libcoap-1"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("coap-client-notls installed");
    let registered = common::eventually(WAIT, || observers(&gw) == 1.0).await;
    assert!(registered, "coap-client registered");
    let mut mqtt = common::device(&gw, "pub-3", ProtocolVersion::V5).await;
    for p in ["level-one", "level-two"] {
        mqtt.publish(
            "plant/tank/level",
            Bytes::copy_from_slice(p.as_bytes()),
            QoS::AtLeastOnce,
            false,
        )
        .await
        .expect("publish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = child.wait_with_output().await.expect("coap-client ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("level-one") && stdout.contains("level-two"),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 28: a notification larger than `max_message_size` reaches libcoap's client whole:
/// block 0 comes in the notification (with an ETag), the client fetches the later blocks
/// itself and prints the body it put together. (Its first, small notification is a CON the
/// client ACKs, which proves its address receives.)
#[tokio::test]
async fn libcoap_client_gets_a_large_notification_block_wise() {
    let gw = coap_gateway(2);
    let coap = gw.coap_addr.expect("coap listener");
    let child = tokio::process::Command::new("coap-client-notls")
        .args(["-m", "get", "-s", "4", "-B", "5"])
        .arg(format!("coap://{coap}/ps/plant/+/image?c=libcoap-2"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("coap-client-notls installed");
    let registered = common::eventually(WAIT, || observers(&gw) == 1.0).await;
    assert!(registered, "coap-client registered");
    let mut mqtt = common::device(&gw, "pub-4", ProtocolVersion::V5).await;
    mqtt.publish(
        "plant/cam/image",
        &b"small-first"[..],
        QoS::AtLeastOnce,
        false,
    )
    .await
    .expect("publish");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let big: String = (0..400).map(|i| format!("row-{i:05}|")).collect();
    assert!(big.len() > 3_000);
    mqtt.publish(
        "plant/cam/image",
        Bytes::from(big.clone()),
        QoS::AtLeastOnce,
        false,
    )
    .await
    .expect("publish");
    let out = child.wait_with_output().await.expect("coap-client ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("small-first") && stdout.contains(&big),
        "stdout: {stdout}\nstderr: {}\nmetrics: {}",
        String::from_utf8_lossy(&out.stderr),
        gw.metrics_text()
    );
}
