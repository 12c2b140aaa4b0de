//! A minimal MQTT 5 broker on plain TCP that injects the faults Mosquitto cannot be made to
//! produce: refuse the next PUBLISHes with a chosen PUBACK code (0x97 Quota exceeded for now,
//! 0x87 Not authorized for good), withhold PUBACKs, cut the connection. It answers a SUBSCRIBE
//! with one QoS 1 command (packet id [`COMMAND_ID`]) and logs the PUBACKs the gateway sends,
//! to see exactly when the gateway acknowledges a downlink command.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use sluice_proto::mqtt::{
    encode, ConnAck, Decoder, Packet, Properties, ProtocolVersion, PubResponse, Publish, QoS,
    SubAck,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// The command the fake broker sends once the gateway subscribed.
pub const COMMAND_ID: u16 = 7;

/// One PUBLISH as the broker got it.
#[derive(Debug, Clone)]
pub struct Got {
    pub topic: String,
    pub payload: Bytes,
    pub dup: bool,
    pub qos: QoS,
    /// Answered with success (or QoS 0); false: refused, or its PUBACK withheld.
    pub accepted: bool,
}

/// What the broker saw: the payloads it accepted in arrival order, the packet ids of the
/// PUBACKs the gateway sent for its downlink command, and every PUBLISH.
#[derive(Default)]
pub struct FakeLog {
    pub publishes: Vec<Bytes>,
    pub pubacks: Vec<u16>,
    pub received: Vec<Got>,
}

/// The faults to inject next.
#[derive(Default)]
struct Faults {
    /// Refuse this many more PUBLISHes with `refuse_code`.
    refuse: usize,
    refuse_code: u8,
    /// Withhold PUBACKs (the gateway's messages stay inflight).
    hold: bool,
}

pub struct FaultBroker {
    pub addr: SocketAddr,
    pub log: Arc<Mutex<FakeLog>>,
    faults: Arc<Mutex<Faults>>,
    cut: watch::Sender<u64>,
}

impl FaultBroker {
    /// Refuse the next `n` PUBLISHes with PUBACK `code`.
    pub fn refuse_next(&self, n: usize, code: u8) {
        let mut f = self.faults.lock().unwrap();
        f.refuse = n;
        f.refuse_code = code;
    }

    /// Withhold PUBACKs while `hold` (they are never sent for what arrived meanwhile).
    pub fn hold_acks(&self, hold: bool) {
        self.faults.lock().unwrap().hold = hold;
    }

    /// Close every open connection now.
    pub fn cut(&self) {
        self.cut.send_modify(|g| *g += 1);
    }
}

/// The broker, refusing the first `refuse` PUBLISHes with 0x97 (Quota exceeded).
pub async fn quota_broker(refuse: usize) -> (SocketAddr, Arc<Mutex<FakeLog>>) {
    let b = start().await;
    b.refuse_next(refuse, 0x97);
    (b.addr, b.log.clone())
}

/// Start the broker on a free port (it runs until the runtime ends).
pub async fn start() -> FaultBroker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Mutex::new(FakeLog::default()));
    let faults = Arc::new(Mutex::new(Faults::default()));
    let (cut, cuts) = watch::channel(0u64);
    let (seen, f) = (log.clone(), faults.clone());
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let mut cuts = cuts.clone();
            cuts.mark_unchanged();
            tokio::spawn(serve(sock, seen.clone(), f.clone(), cuts));
        }
    });
    FaultBroker {
        addr,
        log,
        faults,
        cut,
    }
}

async fn serve(
    mut sock: tokio::net::TcpStream,
    seen: Arc<Mutex<FakeLog>>,
    faults: Arc<Mutex<Faults>>,
    mut cuts: watch::Receiver<u64>,
) {
    let mut dec = Decoder::server(1 << 20);
    let mut buf = BytesMut::new();
    loop {
        let packet = match dec.decode(&mut buf) {
            Ok(Some(p)) => p,
            Ok(None) => {
                tokio::select! {
                    r = sock.read_buf(&mut buf) => if r.unwrap_or(0) == 0 { return },
                    _ = cut_signal(&mut cuts) => return,
                }
                continue;
            }
            Err(_) => return,
        };
        let replies: Vec<Packet> = match packet {
            Packet::Connect(_) => vec![Packet::ConnAck(ConnAck {
                session_present: false,
                code: 0,
                properties: Properties::default(),
            })],
            Packet::Publish(p) => {
                let reason = {
                    let mut f = faults.lock().unwrap();
                    if f.refuse > 0 && p.packet_id.is_some() {
                        f.refuse -= 1;
                        Some(f.refuse_code)
                    } else if f.hold && p.packet_id.is_some() {
                        None
                    } else {
                        Some(0)
                    }
                };
                let mut log = seen.lock().unwrap();
                if reason == Some(0) {
                    log.publishes.push(p.payload.clone());
                }
                log.received.push(Got {
                    topic: p.topic.to_string(),
                    payload: p.payload.clone(),
                    dup: p.dup,
                    qos: p.qos,
                    accepted: reason == Some(0),
                });
                match (p.packet_id, reason) {
                    (Some(packet_id), Some(reason)) => vec![Packet::PubAck(PubResponse {
                        packet_id,
                        reason,
                        properties: None,
                    })],
                    _ => Vec::new(),
                }
            }
            Packet::PingReq => vec![Packet::PingResp],
            // Grant the downlink subscription, then send one QoS 1 command.
            Packet::Subscribe(sub) => vec![
                Packet::SubAck(SubAck {
                    packet_id: sub.packet_id,
                    codes: vec![1; sub.filters.len()],
                    properties: Properties::default(),
                }),
                Packet::Publish(Publish {
                    dup: false,
                    qos: QoS::AtLeastOnce,
                    retain: false,
                    topic: ByteString::from_static("cmd/valve/open"),
                    packet_id: Some(COMMAND_ID),
                    properties: None,
                    payload: Bytes::from_static(b"open"),
                }),
            ],
            Packet::PubAck(a) => {
                seen.lock().unwrap().pubacks.push(a.packet_id);
                Vec::new()
            }
            _ => Vec::new(),
        };
        let mut out = BytesMut::new();
        for r in &replies {
            encode(r, ProtocolVersion::V5, &mut out).unwrap();
        }
        if !out.is_empty() && sock.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Resolves when the link is cut; never once the broker's handle is gone.
async fn cut_signal(cuts: &mut watch::Receiver<u64>) {
    if cuts.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}
