//! Back-pressure as devices live it: a device held back because the cloud is away still gets
//! its PINGRESPs and keeps its connection (the gateway reads a bounded distance ahead for
//! them); subscribers that stop reading cost the gateway no more memory than its configured
//! bounds and do not slow the devices that read.

mod common;

use std::time::{Duration, Instant};

use bytes::BytesMut;
use sluice_proto::mqtt::{
    encode, Connect, Decoder, Packet, Properties, ProtocolVersion, Publish, QoS,
};
use sluice_testkit::{ConnectOpts, TestClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::{gateway_mqtt, Cloud, Gate};

/// A bare MQTT 3.1.1 client on a TCP socket: every byte it sends is the test's, and it
/// never answers or pings on its own.
struct RawDevice {
    sock: TcpStream,
    rbuf: BytesMut,
    decoder: Decoder,
}

impl RawDevice {
    async fn connect(addr: std::net::SocketAddr, id: &str, keep_alive: u16) -> RawDevice {
        let sock = TcpStream::connect(addr).await.expect("connect to gateway");
        let mut d = RawDevice {
            sock,
            rbuf: BytesMut::new(),
            decoder: Decoder::client(ProtocolVersion::V311, 1 << 20),
        };
        d.send(&[Packet::Connect(Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive,
            client_id: id.into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        })])
        .await;
        match d.next(Duration::from_secs(5)).await {
            Some(Packet::ConnAck(a)) => assert_eq!(a.code, 0, "CONNACK refused"),
            other => panic!("expected CONNACK, got {other:?}"),
        }
        d
    }

    /// Write `packets` in one write.
    async fn send(&mut self, packets: &[Packet]) {
        let mut out = BytesMut::new();
        for p in packets {
            encode(p, ProtocolVersion::V311, &mut out).expect("encode");
        }
        self.sock.write_all(&out).await.expect("write to gateway");
    }

    /// The next packet from the gateway; `None` on timeout. Panics if the gateway closed.
    async fn next(&mut self, timeout: Duration) -> Option<Packet> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(p) = self
                .decoder
                .decode(&mut self.rbuf)
                .expect("gateway bytes decode")
            {
                return Some(p);
            }
            match tokio::time::timeout_at(deadline, self.sock.read_buf(&mut self.rbuf)).await {
                Err(_) => return None,
                Ok(Ok(0)) | Ok(Err(_)) => panic!("the gateway closed the device's connection"),
                Ok(Ok(_)) => {}
            }
        }
    }
}

fn publish(id: u16, topic: &str) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: topic.into(),
        packet_id: Some(id),
        properties: None,
        payload: bytes::Bytes::from(id.to_be_bytes().to_vec()),
    })
}

/// Regression (issue 31): a 3.1.1 device at the gateway's receive maximum was not read at all,
/// so its PINGREQ went unanswered and it dropped itself after 1.5 keep-alives, reconnecting in
/// a loop while the cloud was down. Now its PINGREQs behind the withheld PUBLISHes are
/// answered, it keeps its connection for three keep-alives and more, and every message it
/// sent reaches the cloud, acknowledged in order, once the cloud is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_device_past_its_limit_with_the_cloud_down_still_gets_pingresp() {
    let cloud = Cloud::start();
    let mut at_cloud = cloud.subscriber("watch", "held/#").await;
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false); // the cloud is away: nothing is acknowledged
    let gw = gateway_mqtt(
        1,
        "receive_maximum = 4",
        &cloud.uplink_toml(Some(gate.addr), ""),
    );
    const KEEP_ALIVE: u16 = 2;
    let mut d = RawDevice::connect(gw.mqtt_addr, "held", KEEP_ALIVE).await;
    // Ten QoS 1 publishes (its own window is larger than the gateway's 4), then a PINGREQ:
    // what a device does when its keep-alive comes round while it waits for PUBACKs.
    let publishes: Vec<Packet> = (1..=10).map(|i| publish(i, "held/t")).collect();
    d.send(&publishes).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let keep_alive = Duration::from_secs(KEEP_ALIVE as u64);
    while started.elapsed() < 3 * keep_alive + keep_alive / 2 {
        d.send(&[Packet::PingReq]).await;
        match d.next(keep_alive).await {
            Some(Packet::PingResp) => {}
            other => panic!(
                "expected PINGRESP {:?} into the back-pressure, got {other:?}",
                started.elapsed()
            ),
        }
        tokio::time::sleep(keep_alive / 2).await;
    }
    // Still connected after 3x its keep-alive (`next` panics on a close).
    d.send(&[Packet::PingReq]).await;
    assert!(matches!(d.next(keep_alive).await, Some(Packet::PingResp)));

    // The cloud comes back: all ten arrive and the device gets its PUBACKs in order.
    gate.set_open(true);
    for want in 1..=10u16 {
        match d.next(Duration::from_secs(20)).await {
            Some(Packet::PubAck(a)) => assert_eq!(a.packet_id, want, "PUBACKs in order"),
            other => panic!("expected PUBACK {want}, got {other:?}"),
        }
    }
    let mut got = Vec::new();
    while got.len() < 10 {
        let p = at_cloud
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .expect("message at the cloud");
        got.push(u16::from_be_bytes([p.payload[0], p.payload[1]]));
    }
    assert_eq!(
        got,
        (1..=10).collect::<Vec<u16>>(),
        "at the cloud, in order"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

/// The other way a device is held back: its PUBLISH waits for room because the uplink's
/// memory bound is full (cloud away, no spool). An MQTT 5 device over TLS, waiting there,
/// still gets PINGRESP: the same read-ahead serves both versions and every stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_tls_device_whose_publish_waits_for_room_still_gets_pingresp() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    let tls = format!(
        "[mqtt.tls]\nlisten = \"127.0.0.1:0\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        cloud.pki.server_cert_path().display(),
        cloud.pki.server_key_path().display()
    );
    let gw = common::gateway_sections(
        "shards = 1\nmax_buffered = \"64KiB\"",
        "max_packet_size = \"4KiB\"",
        &format!("{tls}{}", cloud.uplink_toml(Some(gate.addr), "")),
    );
    let mut opts =
        ConnectOpts::v5("waits").with_tls(cloud.pki.rustls_client_config(false), "localhost");
    opts.keep_alive = 2;
    let (mut d, _) = TestClient::connect(gw.tls_addr.expect("TLS listener"), opts)
        .await
        .expect("connect over TLS");
    // 56 x 1 KiB: beyond the 64 KiB the uplink may hold (each message charged 1 KiB + its
    // overhead: about 49 fit), so one of the device's publishes waits, and the few behind it
    // are within the gateway's 16 KiB read-ahead (a PINGREQ further behind is not seen).
    for i in 0..56u8 {
        d.publish_no_wait("room/t", vec![i; 1024], QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.set_ack_timeout(Duration::from_secs(2));
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(7) {
        d.ping()
            .await
            .expect("PINGRESP while its publish waits for room");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    gate.set_open(true);
    tokio::task::block_in_place(|| gw.shutdown());
}

/// Resident memory of this process (the gateway runs in it), from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("statm rss");
    pages * 4096
}

/// A subscriber on a socket with a small receive buffer that reads `chunk` bytes every
/// `every` (never, if `every` is `None`): a device on a slow link. Returns how many bytes it
/// read before the gateway closed it, if it did.
async fn slow_reader(
    addr: std::net::SocketAddr,
    id: String,
    filter: String,
    chunk: usize,
    every: Duration,
    run_for: Duration,
    ready: tokio::sync::mpsc::Sender<()>,
) -> Result<u64, u64> {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(16 * 1024).unwrap();
    let stream = sock.connect(addr).await.expect("connect slow reader");
    let mut d = RawDevice {
        sock: stream,
        rbuf: BytesMut::new(),
        decoder: Decoder::client(ProtocolVersion::V311, 1 << 20),
    };
    d.send(&[Packet::Connect(Connect {
        protocol: ProtocolVersion::V311,
        clean_start: true,
        keep_alive: 0,
        client_id: id.as_str().into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    })])
    .await;
    assert!(matches!(
        d.next(Duration::from_secs(10)).await,
        Some(Packet::ConnAck(_))
    ));
    d.send(&[Packet::Subscribe(sluice_proto::mqtt::Subscribe {
        packet_id: 1,
        filters: vec![common::packets::opts_sub(&filter, QoS::AtMostOnce)],
        properties: Properties::default(),
    })])
    .await;
    assert!(matches!(
        d.next(Duration::from_secs(10)).await,
        Some(Packet::SubAck(_))
    ));
    ready.send(()).await.unwrap();
    let mut buf = vec![0u8; chunk];
    let mut total = 0u64;
    let end = tokio::time::Instant::now() + run_for;
    while tokio::time::Instant::now() < end {
        tokio::time::sleep(every).await;
        match tokio::time::timeout(Duration::from_millis(1), d.sock.read(&mut buf)).await {
            Err(_) => {}
            Ok(Ok(0)) | Ok(Err(_)) => return Err(total),
            Ok(Ok(n)) => total += n as u64,
        }
    }
    Ok(total)
}

/// Issue 31, slow readers: 25 of 195 connections subscribe to busy topics and read far
/// slower than they are sent to. Before, each went round "take the whole outbox into the
/// write buffer, wait for the socket": the outbox bytes, released from the bounds once taken,
/// sat uncharged in the write buffer while the outbox filled again, so a slow reader held
/// about twice its share of `max_outbox_memory`. Now at most 64 KiB per connection is taken
/// at a time: the gateway's memory stays within `max_outbox_memory` plus that write-ahead,
/// what does not fit is dropped and counted, the slow readers keep their connections, and
/// healthy devices on the same shard keep receiving promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_stay_within_the_outbox_bound_and_healthy_devices_keep_flowing() {
    const SLOW: usize = 25;
    const HEALTHY_SUBS: usize = 160;
    const HEALTHY_TOPICS: usize = 9;
    const PAYLOAD: usize = 16 * 1024;
    const OUTBOX_MIB: u64 = 16;
    // What a connection may hold encoded beyond its outbox (edge/mqtt/connection.rs).
    const WRITE_AHEAD: usize = 64 * 1024;
    let gw = common::gateway_sections(
        &format!("shards = 1\nmax_outbox_memory = \"{OUTBOX_MIB}MiB\""),
        // The kernel's share bounded too (else it takes up to 4 MiB per slow reader first).
        "max_queued_bytes = \"1MiB\"\nmax_packet_size = \"64KiB\"\nsend_buffer = \"64KiB\"",
        "",
    );
    let addr = gw.mqtt_addr;
    let run_for = Duration::from_secs(20);

    // 25 slow readers (1 KiB every 100 ms: 10 KiB/s), each on its own busy topic.
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(SLOW);
    let mut slow = Vec::new();
    for i in 0..SLOW {
        slow.push(tokio::spawn(slow_reader(
            addr,
            format!("slow-{i}"),
            format!("busy/{i}"),
            1024,
            Duration::from_millis(100),
            run_for + Duration::from_secs(2),
            ready_tx.clone(),
        )));
    }
    for _ in 0..SLOW {
        ready_rx.recv().await.unwrap();
    }
    // 160 healthy subscribers on 9 calm topics, each fed 10 messages/s stamped with their
    // send time; they count what they get and how late.
    let epoch = Instant::now();
    let latencies = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Duration>::new()));
    let mut healthy = Vec::new();
    for j in 0..HEALTHY_SUBS {
        let mut c = common::device(&gw, &format!("calm-sub-{j}"), ProtocolVersion::V311).await;
        c.subscribe(&[(&format!("calm/{}", j % HEALTHY_TOPICS), QoS::AtMostOnce)])
            .await
            .unwrap();
        let lat = latencies.clone();
        healthy.push(tokio::spawn(async move {
            let mut n = 0u64;
            while let Ok(Some(p)) = c.recv(Duration::from_secs(3)).await {
                let sent =
                    Duration::from_nanos(u64::from_be_bytes(p.payload[..8].try_into().unwrap()));
                lat.lock()
                    .unwrap()
                    .push(epoch.elapsed().saturating_sub(sent));
                n += 1;
            }
            n
        }));
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut calm_pubs = Vec::new();
    for k in 0..HEALTHY_TOPICS {
        let mut p = common::device(&gw, &format!("calm-pub-{k}"), ProtocolVersion::V311).await;
        let stop = stop.clone();
        calm_pubs.push(tokio::spawn(async move {
            let mut sent = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let stamp = (epoch.elapsed().as_nanos() as u64).to_be_bytes().to_vec();
                p.publish(&format!("calm/{k}"), stamp, QoS::AtMostOnce, false)
                    .await
                    .unwrap();
                sent += 1;
            }
            sent
        }));
    }
    // Baseline: the healthy devices alone for 2 s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let baseline_p99 = p99(&latencies.lock().unwrap());
    let rss_before = rss_bytes();

    // The busy flow: one device publishes 16 KiB to each busy topic 8 times a second
    // (128 KiB/s per slow reader, if the gateway keeps up; far more than it reads).
    let mut busy = common::device(&gw, "busy-pub", ProtocolVersion::V311).await;
    let busy_stop = stop.clone();
    let busy_task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(125));
        let payload = vec![0x5a; PAYLOAD];
        while !busy_stop.load(std::sync::atomic::Ordering::Relaxed) {
            tick.tick().await;
            for i in 0..SLOW {
                busy.publish(
                    &format!("busy/{i}"),
                    payload.clone(),
                    QoS::AtMostOnce,
                    false,
                )
                .await
                .unwrap();
            }
        }
    });
    let loaded_from = latencies.lock().unwrap().len();
    let mut peak = 0u64;
    let end = Instant::now() + run_for;
    while Instant::now() < end {
        peak = peak.max(rss_bytes());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy_task.await.unwrap();
    let mut expected = 0;
    for (k, p) in calm_pubs.into_iter().enumerate() {
        let subs = (0..HEALTHY_SUBS)
            .filter(|j| j % HEALTHY_TOPICS == k)
            .count() as u64;
        expected += p.await.unwrap() * subs;
    }
    let mut received = 0;
    for h in healthy {
        received += h.await.unwrap();
    }
    let loaded_p99 = p99(&latencies.lock().unwrap()[loaded_from..]);
    let mut slow_read = 0;
    for s in slow {
        match s.await.unwrap() {
            Ok(n) => slow_read += n,
            Err(n) => panic!("a slow reader that kept reading was disconnected after {n} bytes"),
        }
    }
    let m = gw.metrics_text();
    let refused = common::metric_sum(&m, "sluice_mqtt_queue_refused_total");
    let growth = peak.saturating_sub(rss_before);
    let bound = (OUTBOX_MIB << 20) + (SLOW as u64) * (WRITE_AHEAD + PAYLOAD) as u64 + (6 << 20);
    println!(
        "slow readers: RSS growth {} MiB (bound {} MiB), slow readers read {} MiB, \
         messages refused for full queues {refused}, healthy p99 {:?} alone / {:?} under load, \
         healthy messages {received} of {expected}",
        growth >> 20,
        bound >> 20,
        slow_read >> 20,
        baseline_p99,
        loaded_p99,
    );
    for line in m.lines().filter(|l| {
        (l.starts_with("sluice_mqtt_dropped_total") || l.starts_with("sluice_mqtt_queue_refused"))
            && !l.ends_with(" 0")
    }) {
        println!("  {line}");
    }
    assert!(
        refused > 0.0,
        "overflow for the slow readers was dropped and counted: {m}"
    );
    assert!(
        growth <= bound,
        "memory grew {} MiB, beyond max_outbox_memory + write-ahead ({} MiB)",
        growth >> 20,
        bound >> 20
    );
    // Every healthy subscriber got every message of its topic (QoS 0 on loopback; none is
    // dropped for them), promptly.
    assert_eq!(received, expected, "healthy subscribers got every message");
    assert!(
        loaded_p99 < Duration::from_secs(1),
        "healthy devices' p99 under the slow readers' load: {loaded_p99:?} (alone {baseline_p99:?})"
    );
    tokio::task::block_in_place(|| gw.shutdown());
}

fn p99(samples: &[Duration]) -> Duration {
    let mut v = samples.to_vec();
    v.sort();
    v.get(v.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or_default()
}

/// Eclipse paho (python) over WebSocket, MQTT 3.1.1, keep-alive 2 s, pushing 10 QoS 1
/// messages into a receive maximum of 4 with the cloud away; it disconnects itself when a
/// PINGREQ goes unanswered for a keep-alive. Prints its disconnects and PUBACKs after 12 s.
const PAHO_HELD_BACK: &str = r#"
import sys, time
import paho.mqtt.client as mqtt
port = int(sys.argv[1])
seen = {"disconnects": 0, "pubacks": 0}
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-held", transport="websockets",
                protocol=mqtt.MQTTv311)
c.ws_set_options(path="/mqtt")
c.max_inflight_messages_set(20)
def on_connect(c, u, flags, rc, props):
    if seen["disconnects"] == 0:
        for i in range(10):
            c.publish("held/ws", str(i).encode(), qos=1)
def on_disconnect(c, u, flags, rc, props):
    seen["disconnects"] += 1
def on_publish(c, u, mid, rc, props):
    seen["pubacks"] += 1
c.on_connect = on_connect
c.on_disconnect = on_disconnect
c.on_publish = on_publish
c.connect("127.0.0.1", port, keepalive=2)
c.loop_start()
time.sleep(12)
c.loop_stop()
print("disconnects=%d pubacks=%d" % (seen["disconnects"], seen["pubacks"]))
"#;

/// The same over WebSocket with a real client: paho, held back past the gateway's receive
/// maximum while the cloud is away, keeps its connection (its own keep-alive check would
/// drop it after an unanswered PINGREQ), and gets its ten PUBACKs once the cloud is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paho_over_websocket_held_back_keeps_its_connection() {
    let cloud = Cloud::start();
    let gate = Gate::start(cloud.broker.tls_addr()).await;
    gate.set_open(false);
    let gw = common::gateway_sections(
        "shards = 1",
        "receive_maximum = 4",
        &format!(
            "[mqtt.ws]\nlisten = \"127.0.0.1:0\"\n{}",
            cloud.uplink_toml(Some(gate.addr), "")
        ),
    );
    let ws = gw.ws_addr.expect("ws listener");
    let paho = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(PAHO_HELD_BACK)
        .arg(ws.port().to_string())
        .output();
    let opener = async {
        // Nine seconds held back (four keep-alives), then the cloud comes back.
        tokio::time::sleep(Duration::from_secs(9)).await;
        gate.set_open(true);
    };
    let (out, ()) = tokio::join!(paho, opener);
    let out = out.expect("python3");
    assert!(
        out.status.success(),
        "paho failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(printed, "disconnects=0 pubacks=10", "paho over WebSocket");
    tokio::task::block_in_place(|| gw.shutdown());
}
