//! The wall clock stepped forward and back by an hour under the real `sluice run` (issue 31:
//! "the clock jumps when NTP finally syncs"), with libfaketime: the gateway runs with
//! `LD_PRELOAD=libfaketimeMT.so.1`, its wall clock read from a file the test rewrites
//! (`FAKETIME_TIMESTAMP_FILE`, `FAKETIME_NO_CACHE=1`), its monotonic clock left alone
//! (`FAKETIME_DONT_FAKE_MONOTONIC=1`), as an NTP step leaves it.
//!
//! Across a +1 h and then a −2 h step, while devices publish with message expiry to
//! persistent sessions: nothing expires wrongly (messages with 2 minutes left are delivered
//! with about that left; a session with a minute left is still there), and every timer keeps
//! firing on time (a 2 s message expiry and a 4 s session expiry do expire, a silent device's
//! keep-alive closes it, an aggregation pack is flushed after its delay, the uplink reconnects
//! after the cloud broker restarts, a pinging device keeps its connection). And a CoAP Echo
//! value issued before the step is still accepted after it (it was stamped with the wall
//! clock, so a backward step made every value in flight look issued in the future).

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_proto::coap::{opt, Code, MsgType};
use sluice_proto::mqtt::{Properties, QoS};
use sluice_testkit::{ConnectOpts, Mosquitto, TestClient};

const FAKETIME_LIBS: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
];

/// Kills the gateway if the test ends early.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The gateway's wall clock, as an offset from the real one ("+0", "+1h", "-1h").
fn set_clock(file: &Path, offset: &str) {
    let tmp = file.with_extension("new");
    std::fs::write(&tmp, format!("{offset}\n")).expect("write the faketime file");
    std::fs::rename(&tmp, file).expect("replace the faketime file");
}

fn admin_get(addr: SocketAddr, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn metric(text: &str, line_prefix: &str) -> f64 {
    common::metric_sum(text, line_prefix)
}

/// A device of `version` with a persistent session of `expiry` seconds.
fn persistent(id: &str, clean: bool, expiry: u32) -> ConnectOpts {
    let mut o = ConnectOpts::v5(id);
    o.clean_start = clean;
    o.properties.session_expiry_interval = Some(expiry);
    o
}

async fn publish_with_expiry(d: &mut TestClient, id: u16, topic: &str, body: &str, expiry: u32) {
    let props = Properties {
        message_expiry_interval: Some(expiry),
        ..Default::default()
    };
    d.send_packet(&common::packets::publish(
        topic,
        body,
        QoS::AtLeastOnce,
        Some(id),
        props,
    ))
    .await
    .unwrap();
    d.wait_ack(id).await.expect("PUBACK");
}

/// A QoS 1 message to the uplink: acknowledged once the cloud has it (no spool), which with
/// aggregation on means once its pack was flushed, after `max_delay`.
async fn through_the_cloud(d: &mut TestClient, topic: &str, within: Duration) {
    let started = Instant::now();
    d.set_ack_timeout(within);
    d.publish(topic, Bytes::from_static(b"21.5"), QoS::AtLeastOnce, false)
        .await
        .unwrap_or_else(|e| panic!("{topic} not acknowledged by the cloud within {within:?}: {e}"));
    eprintln!(
        "{topic}: acknowledged after the cloud's ack in {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wall_clock_steps_expire_nothing_wrongly_and_stall_no_timer() {
    let lib = FAKETIME_LIBS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("libfaketime is not installed (apt-get install faketime; scripts/test does)");
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("faketime");
    set_clock(&clock, "+0");
    let mut cloud = Mosquitto::builder().start().expect("cloud mosquitto");
    let mqtt_port = sluice_testkit::free_port().unwrap();
    let admin_port = sluice_testkit::free_port().unwrap();
    let coap_port = sluice_testkit::free_port().unwrap();
    let mqtt = SocketAddr::from(([127, 0, 0, 1], mqtt_port));
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    let coap = SocketAddr::from(([127, 0, 0, 1], coap_port));
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        format!(
            "[gateway]\nshards = 1\npin_threads = false\n\
             [mqtt]\nlisten = \"127.0.0.1:{mqtt_port}\"\nsession_expiry_max = \"1h\"\n\
             [coap]\nlisten = \"127.0.0.1:{coap_port}\"\n\
             [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\
             [[uplink]]\nname = \"cloud\"\nurl = \"mqtt://{}\"\nallow_plaintext = true\n\
             client_id = \"gw-clock\"\nforward = [\"agg/#\"]\nkeep_alive = \"2s\"\n\
             reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n\
             [uplink.aggregate]\nenabled = true\nmin_devices = 0\nmax_delay = \"1s\"\n",
            cloud.plain_addr()
        ),
    )
    .unwrap();
    let log = dir.path().join("sluice.log");
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "-c"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .env("LD_PRELOAD", &lib)
        .env("FAKETIME_TIMESTAMP_FILE", &clock)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sluice under libfaketime");
    let mut gw = Guard(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !admin_get(admin, "/metrics").is_some_and(|m| m.contains("sluice_uplink")) {
        assert!(gw.0.try_wait().unwrap().is_none(), "sluice exited");
        assert!(Instant::now() < deadline, "sluice did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();

    // --- Before any step (+0). ---
    // Persistent sessions: `queued` (10 min) collects q/#; `mid` (1 min) and `short` (4 s)
    // only wait.
    for (id, expiry, filter) in [
        ("queued", 600, "q/#"),
        ("mid", 60, "m/#"),
        ("short", 4, "s/#"),
    ] {
        let (mut s, _) = TestClient::connect(mqtt, persistent(id, true, expiry))
            .await
            .unwrap();
        s.subscribe(&[(filter, QoS::AtLeastOnce)]).await.unwrap();
        s.disconnect().await.unwrap();
    }
    let sessions_left = Instant::now();
    // A device that pings every second (keep-alive 2 s) for the whole test.
    let (mut pinger, _) = TestClient::connect(mqtt, {
        let mut o = ConnectOpts::v311("pinger");
        o.keep_alive = 2;
        o
    })
    .await
    .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pinging = {
        let stop = stop.clone();
        tokio::spawn(async move {
            pinger.set_ack_timeout(Duration::from_secs(2));
            let mut pings = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                pinger.ping().await.expect("PINGRESP within 2 s");
                pings += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            pings
        })
    };
    let (mut dev, _) = TestClient::connect(mqtt, ConnectOpts::v5("publisher"))
        .await
        .unwrap();
    publish_with_expiry(&mut dev, 101, "q/1", "one", 120).await;
    publish_with_expiry(&mut dev, 102, "q/short", "expires", 2).await;
    through_the_cloud(&mut dev, "agg/0", Duration::from_secs(10)).await;
    // A CoAP device asks for a large retained value: an unverified address gets 4.01 + Echo.
    dev.publish("big", Bytes::from(vec![b'x'; 4000]), QoS::AtLeastOnce, true)
        .await
        .unwrap();
    let mut coap_dev = common::coap::CoapDevice::new(coap).await;
    let get_big = || common::coap::request(MsgType::Con, Code::GET, "ps/big", &[], b"");
    let mut challenge = None;
    for _ in 0..50 {
        let r = coap_dev.exchange(get_big(), Duration::from_secs(5)).await;
        if r.code == Code::UNAUTHORIZED {
            challenge = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let echo = challenge
        .expect("4.01 + Echo for the large retained value")
        .option(opt::ECHO)
        .expect("an Echo option")
        .clone();

    // --- The wall clock jumps an hour ahead. ---
    set_clock(&clock, "+1h");
    publish_with_expiry(&mut dev, 103, "q/2", "two", 120).await;
    through_the_cloud(&mut dev, "agg/1", Duration::from_secs(10)).await;
    // The cloud broker goes away and comes back: the uplink's retry timers keep running.
    cloud.kill().unwrap();
    let held = dev
        .publish_no_wait(
            "agg/2",
            Bytes::from_static(b"22.0"),
            QoS::AtLeastOnce,
            false,
        )
        .await
        .unwrap()
        .expect("a packet id");
    tokio::time::sleep(Duration::from_secs(1)).await;
    cloud.restart().unwrap();
    dev.set_ack_timeout(Duration::from_secs(15));
    dev.wait_ack(held)
        .await
        .expect("agg/2 acknowledged once the cloud is back");

    // --- And two hours back (an hour behind the real time). ---
    set_clock(&clock, "-1h");
    // The Echo issued before the steps, echoed within its 2 minutes: accepted.
    let mut m = get_big();
    m.add_option(opt::ECHO, echo);
    let r = coap_dev.exchange(m, Duration::from_secs(5)).await;
    assert_eq!(
        r.code,
        Code::CONTENT,
        "an Echo value issued before a backward clock step is still valid: {r:?}"
    );
    publish_with_expiry(&mut dev, 104, "q/3", "three", 120).await;
    through_the_cloud(&mut dev, "agg/3", Duration::from_secs(10)).await;
    // A silent device (keep-alive 1 s) is closed after 1.5 s, not an hour early or late.
    let (mut silent, _) = TestClient::connect(mqtt, {
        let mut o = ConnectOpts::v311("silent");
        o.keep_alive = 1;
        o
    })
    .await
    .unwrap();
    let quiet_from = Instant::now();
    assert!(
        silent.expect_closed(Duration::from_secs(6)).await,
        "keep-alive timer fired"
    );
    let closed_after = quiet_from.elapsed();
    assert!(
        closed_after >= Duration::from_millis(1400),
        "closed {closed_after:?} after connecting"
    );

    // Sessions: the 4 s one expired (its timer fired), the 1 min one did not.
    let left = sessions_left.elapsed();
    if left < Duration::from_secs(6) {
        tokio::time::sleep(Duration::from_secs(6) - left).await;
    }
    let (_s, ack) = TestClient::connect(mqtt, persistent("short", false, 4))
        .await
        .unwrap();
    assert!(!ack.session_present, "the 4 s session expired on time");
    assert!(
        sessions_left.elapsed() < Duration::from_secs(50),
        "test too slow for `mid`"
    );
    let (_m, ack) = TestClient::connect(mqtt, persistent("mid", false, 60))
        .await
        .unwrap();
    assert!(
        ack.session_present,
        "a session with a minute left survived the steps"
    );

    // The queued messages: all there, with most of their 2 minutes left; the 2 s one expired.
    let (mut queued, ack) = TestClient::connect(mqtt, persistent("queued", false, 600))
        .await
        .unwrap();
    assert!(ack.session_present);
    for want in ["one", "two", "three"] {
        let p = queued
            .recv(Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("queued message {want} delivered"));
        assert_eq!(&p.payload[..], want.as_bytes());
        let left = p
            .properties
            .as_ref()
            .and_then(|pr| pr.message_expiry_interval)
            .expect("expiry interval sent on");
        assert!((60..=120).contains(&left), "{want}: {left} s of 120 left");
    }
    assert!(
        queued.recv(Duration::from_secs(1)).await.unwrap().is_none(),
        "the 2 s message expired"
    );
    let m = admin_get(admin, "/metrics").unwrap();
    assert_eq!(
        metric(
            &m,
            "sluice_mqtt_dropped_total{shard=\"0\",reason=\"expired\"}"
        ),
        1.0,
        "exactly the one message with 2 s to live expired"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pings = pinging
        .await
        .expect("the pinging device kept its connection");
    eprintln!("pinging device: {pings} PINGRESPs, connection kept");
    let text = log_text();
    assert!(!text.contains("panicked"), "{text}");
}
