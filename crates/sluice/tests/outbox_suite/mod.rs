//! The outbox's ordering, retry and failover tests, written once for every transport.
//!
//! A transport's test file implements [`Harness`] (make the transport; inject faults; read
//! what the far end received) and instantiates the cases with [`outbox_cases!`]. Each case
//! runs a real [`Outbox`] over a real [`UplinkQueue`] with device ack tokens, so what it
//! asserts is what a device would notice.
#![allow(dead_code)]

use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;
use sluice::config::{UplinkConfig, UplinkUrl};
use sluice::message::ack::{AckToken, DeviceAcks};
use sluice::sink::outbox::{Outbox, OutboxSeed};
use sluice::sink::transport::{RefusalClass, Transport};
use sluice::sink::{DropReason, Lane, RejectReason, UplinkMessage, UplinkMetrics, UplinkQueue};
use sluice_proto::mqtt::{ProtocolVersion, QoS};
use tokio::sync::watch;

use crate::common::wait_until;

/// A unit as the far end got it.
#[derive(Debug, Clone)]
pub struct Received {
    pub payload: Bytes,
    pub dup: bool,
    /// Acknowledged (or needing no ack); false: refused, or its ack withheld.
    pub accepted: bool,
}

/// How the suite drives one kind of transport and its far end.
#[allow(async_fn_in_trait)]
pub trait Harness: Sized {
    type T: Transport + 'static;
    /// Start the far end.
    async fn start() -> Self;
    /// Where the transport connects (the outbox's config is derived from it).
    fn url(&self) -> UplinkUrl {
        UplinkUrl {
            tls: false,
            host: "far.invalid".into(),
            port: 1,
        }
    }
    fn transport(&self, cfg: Rc<UplinkConfig>, metrics: Arc<UplinkMetrics>) -> Self::T;
    /// Drop the link now (the outbox reconnects).
    fn cut_link(&self);
    /// Refuse the next `n` units that need an ack with `code`, which the transport's own
    /// classification maps to `class` (MQTT: 0x97 is temporary, 0x87 permanent).
    fn refuse_next(&self, n: usize, code: u8, class: RefusalClass);
    /// Withhold acknowledgements while `hold`.
    fn hold_acks(&self, hold: bool);
    fn received(&self) -> Vec<Received>;
}

/// Instantiate every case for a harness type.
#[macro_export]
macro_rules! outbox_cases {
    ($h:ty) => {
        #[test]
        fn per_device_order_holds_with_many_devices_and_a_window_above_one() {
            common::run_local(outbox_suite::per_device_order::<$h>());
        }
        #[test]
        fn a_temporary_refusal_is_resent_in_order_after_the_backoff_and_acked_only_then() {
            common::run_local(outbox_suite::temporary_refusal::<$h>());
        }
        #[test]
        fn a_cut_link_with_messages_in_flight_resends_them_in_order_and_loses_none() {
            common::run_local(outbox_suite::link_cut_in_flight::<$h>());
        }
        #[test]
        fn a_permanent_refusal_is_counted_and_completes_the_token_with_its_code() {
            common::run_local(outbox_suite::permanent_refusal::<$h>());
        }
        #[test]
        fn a_qos0_message_is_finished_once_written() {
            common::run_local(outbox_suite::qos0_finished_once_written::<$h>());
        }
    };
}

pub struct Running<H: Harness> {
    pub far: H,
    pub queue: Rc<UplinkQueue>,
    pub metrics: Arc<UplinkMetrics>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// An outbox over `H`'s transport with window `inflight`.
pub async fn start<H: Harness>(inflight: u16) -> Running<H> {
    let far = H::start().await;
    let mut cfg = UplinkConfig::new("cloud", far.url());
    cfg.client_id = "gw".into();
    cfg.protocol = sluice::config::MqttProtocol::V5;
    cfg.allow_plaintext = true;
    cfg.inflight = inflight;
    cfg.keep_alive = Duration::from_secs(5);
    cfg.connect_timeout = Duration::from_secs(5);
    cfg.reconnect_min = Duration::from_millis(50);
    cfg.reconnect_max = Duration::from_millis(300);
    cfg.refused_retry_min = Duration::from_millis(200);
    cfg.refused_retry_max = Duration::from_secs(1);
    let cfg = Rc::new(cfg);
    let queue = Rc::new(UplinkQueue::new(4 << 20));
    let metrics = Arc::new(UplinkMetrics::new());
    let transport = far.transport(cfg.clone(), metrics.clone());
    let seed = OutboxSeed {
        shard: 0,
        lane: Lane::Normal,
        cfg,
        queue: queue.clone(),
        metrics: metrics.clone(),
        live_devices: Arc::new(AtomicUsize::new(0)),
        feeders: Default::default(),
    };
    let (shutdown, rx) = watch::channel(false);
    let task = tokio::task::spawn_local(Outbox::new(seed, transport).run(rx));
    Running {
        far,
        queue,
        metrics,
        shutdown,
        task,
    }
}

impl<H: Harness> Running<H> {
    pub async fn stop(self) {
        self.shutdown.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the outbox ends promptly on shutdown")
            .expect("no panic");
    }

    /// Accepted payloads of one device (`"{device}:{n}"`), in arrival order.
    fn accepted_of(&self, device: usize) -> Vec<String> {
        let prefix = format!("d{device}:");
        self.far
            .received()
            .into_iter()
            .filter(|r| r.accepted)
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .filter(|p| p.starts_with(&prefix))
            .collect()
    }
}

pub fn message(device: usize, n: usize, qos: QoS, acks: &Rc<DeviceAcks>) -> UplinkMessage {
    UplinkMessage {
        device: ByteString::from(format!("d{device}")),
        topic: ByteString::from(format!("dev/d{device}")),
        payload: Bytes::from(format!("d{device}:{n}")),
        qos,
        retain: false,
        received_at: Instant::now(),
        ack: Some(AckToken::new(acks, n as u16 + 1)),
        content_type: None,
        user_properties: None,
        stored: None,
    }
}

/// Wait until `acks` acknowledged `n` messages; returns their packet ids sorted.
async fn all_acked(acks: &Rc<DeviceAcks>, n: usize, got: &mut Vec<u16>) {
    wait_until("the device acks", Duration::from_secs(10), || {
        got.extend(acks.drain());
        got.len() >= n
    })
    .await;
    got.sort_unstable();
}

pub async fn per_device_order<H: Harness>() {
    let up = start::<H>(8).await;
    let (devices, each) = (20, 25);
    let acks: Vec<_> = (0..devices).map(|_| DeviceAcks::new()).collect();
    for n in 0..each {
        for (d, a) in acks.iter().enumerate() {
            up.queue.push(message(d, n, QoS::AtLeastOnce, a)).await;
        }
    }
    for a in &acks {
        let mut got = Vec::new();
        all_acked(a, each, &mut got).await;
        assert_eq!(got, (1..=each as u16).collect::<Vec<_>>());
    }
    for d in 0..devices {
        let expected: Vec<String> = (0..each).map(|n| format!("d{d}:{n}")).collect();
        assert_eq!(up.accepted_of(d), expected, "device {d} in its order");
    }
    assert_eq!(up.queue.reserved_bytes(), 0);
    up.stop().await;
}

pub async fn temporary_refusal<H: Harness>() {
    let up = start::<H>(8).await;
    up.far.refuse_next(3, 0x97, RefusalClass::Temporary);
    let acks = DeviceAcks::new();
    let started = Instant::now();
    for n in 0..5 {
        up.queue.push(message(0, n, QoS::AtLeastOnce, &acks)).await;
    }
    wait_until("the refusals", Duration::from_secs(10), || {
        up.metrics.refusals_retried.get() == 3
    })
    .await;
    let early = acks.drain();
    assert!(
        early.iter().all(|id| *id > 3),
        "no refused message acknowledged before the cloud took it: {early:?}"
    );
    let mut got = early;
    all_acked(&acks, 5, &mut got).await;
    assert_eq!(got, vec![1, 2, 3, 4, 5], "each acknowledged once");
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "after a backoff"
    );
    let mut refused: Vec<String> = up
        .accepted_of(0)
        .into_iter()
        .filter(|p| ["d0:0", "d0:1", "d0:2"].contains(&p.as_str()))
        .collect();
    refused.dedup();
    assert_eq!(refused, vec!["d0:0", "d0:1", "d0:2"], "resent in order");
    assert_eq!(up.metrics.dropped(DropReason::CloudRejected), 0);
    up.stop().await;
}

pub async fn link_cut_in_flight<H: Harness>() {
    let up = start::<H>(8).await;
    up.far.hold_acks(true);
    let acks = DeviceAcks::new();
    for n in 0..5 {
        up.queue.push(message(0, n, QoS::AtLeastOnce, &acks)).await;
    }
    wait_until("all five in flight", Duration::from_secs(10), || {
        up.far.received().len() == 5
    })
    .await;
    assert!(
        acks.drain().is_empty(),
        "nothing acknowledged while in flight"
    );
    up.far.hold_acks(false);
    up.far.cut_link();
    let mut got = Vec::new();
    all_acked(&acks, 5, &mut got).await;
    assert_eq!(got, vec![1, 2, 3, 4, 5]);
    let resent: Vec<(String, bool)> = up.far.received()[5..]
        .iter()
        .map(|r| (String::from_utf8_lossy(&r.payload).into_owned(), r.dup))
        .collect();
    let expected: Vec<(String, bool)> = (0..5).map(|n| (format!("d0:{n}"), true)).collect();
    assert_eq!(resent, expected, "resent in order, marked as resends");
    assert_eq!(up.metrics.messages_resent.get(), 5);
    assert_eq!(up.queue.reserved_bytes(), 0, "nothing lost or left");
    up.stop().await;
}

pub async fn permanent_refusal<H: Harness>() {
    let up = start::<H>(8).await;
    let not_authorized = RefusalClass::Permanent(RejectReason::NotAuthorized);
    up.far.refuse_next(1, 0x87, not_authorized);
    let acks = DeviceAcks::new();
    up.queue.push(message(0, 0, QoS::AtLeastOnce, &acks)).await;
    up.queue.push(message(0, 1, QoS::AtLeastOnce, &acks)).await;
    let mut got = Vec::new();
    all_acked(&acks, 2, &mut got).await;
    assert_eq!(got, vec![1, 2]);
    assert_eq!(acks.take_reason(1, ProtocolVersion::V5), 0x87);
    assert_eq!(acks.take_reason(2, ProtocolVersion::V5), 0);
    assert_eq!(up.metrics.dropped(DropReason::CloudRejected), 1);
    assert_eq!(up.accepted_of(0), vec!["d0:1"], "the next one flows");
    up.stop().await;
}

pub async fn qos0_finished_once_written<H: Harness>() {
    let up = start::<H>(1).await;
    up.far.hold_acks(true);
    let acks = DeviceAcks::new();
    // The QoS 1 one fills the window of one and is never acknowledged; QoS 0 ones still go.
    up.queue.push(message(0, 0, QoS::AtLeastOnce, &acks)).await;
    up.queue.push(message(1, 1, QoS::AtMostOnce, &acks)).await;
    up.queue.push(message(1, 2, QoS::AtMostOnce, &acks)).await;
    let mut got = Vec::new();
    all_acked(&acks, 2, &mut got).await;
    assert_eq!(
        got,
        vec![2, 3],
        "QoS 0 done once written, the QoS 1 one still waits"
    );
    assert_eq!(up.accepted_of(1), vec!["d1:1", "d1:2"]);
    up.stop().await;
}
