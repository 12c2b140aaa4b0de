//! The MQTT device listener: accept, read CONNECT, admit, place on a shard.
//!
//! Owns: the device listening socket, each new connection until its CONNECT is admitted or
//! refused, the `max_connections` bound at accept, and the hand-over to the device's shard
//! (`ShardCmd::Adopt`, the shard chosen by hashing the client id).
//!
//! Does not own: the admission rules and password checks (`control::admission`), the session
//! and everything after CONNACK (`edge/mqtt/connection.rs` on the shard), subscription
//! snapshots or the admin endpoint (the control-plane thread).
//!
//! Runs on a thread of its own (`sluice-listener`, a current-thread runtime started last and
//! joined first by `app/`), so a reconnect storm — sockets that never send CONNECT, logins
//! queueing for password checks — costs this thread and never the control plane's snapshot
//! publication, the admin API or a shard. Each accepted socket gets `connect_timeout` to
//! deliver a complete, valid CONNECT; a refused device gets a CONNACK with the reason and is
//! closed.
//!
//! Invariants: the number of open device connections (here and on the shards) is bounded by
//! `max_connections`: beyond it, new sockets are closed at once (counted, logged at most once
//! a second); a connection's count is released here unless a shard took it over. Password
//! checks are bounded by admission (`auth_concurrency` running on this runtime's blocking
//! pool, `auth_queue` waiting, each wait ending at the CONNECT deadline); logins beyond are
//! refused as busy.

use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use sluice_proto::mqtt::{encode, ConnAck, Decoder, Packet, Properties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::control::admission::{Admission, Refusal};
use crate::control::ControlMetrics;
use crate::shard::{hash, Adopted, ShardCmd};

pub struct MqttListener {
    pub admission: Admission,
    pub shards: Vec<mpsc::Sender<ShardCmd>>,
    pub live_connections: Arc<AtomicUsize>,
    pub max_connections: usize,
    pub max_packet_size: usize,
    pub connect_timeout: Duration,
    pub metrics: Arc<ControlMetrics>,
    /// `[limits]` connection rates (`control/limits.rs`).
    pub limits: Arc<crate::control::limits::ConnectLimits>,
}

impl MqttListener {
    /// Accept until `shutdown` turns true. Must run inside a `LocalSet`.
    pub async fn serve(self, listener: TcpListener, mut shutdown: watch::Receiver<bool>) {
        let this = Rc::new(self);
        let mut last_refusal_log: Option<Instant> = None;
        // False once the gateway was dropped without `shutdown`: keep accepting, as the
        // shards keep serving, without polling a closed channel in a loop.
        let mut watching = true;
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                changed = shutdown.changed(), if watching => {
                    if changed.is_err() {
                        watching = false;
                    } else if *shutdown.borrow() {
                        return;
                    }
                    continue;
                }
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(error) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !this.limits.admit_source(peer) {
                continue; // [limits]: over the source's or the gateway's connection rate
            }
            if this.live_connections.fetch_add(1, Ordering::Relaxed) >= this.max_connections {
                this.live_connections.fetch_sub(1, Ordering::Relaxed);
                this.metrics.refused_over_limit.inc();
                if last_refusal_log.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                    tracing::warn!(%peer, max = this.max_connections, "max_connections reached; refusing new device connections");
                    last_refusal_log = Some(Instant::now());
                }
                drop(stream);
                continue;
            }
            let this = this.clone();
            tokio::task::spawn_local(async move {
                if !this.handshake(stream, peer).await {
                    this.live_connections.fetch_sub(1, Ordering::Relaxed);
                }
            });
        }
    }

    /// Returns true when the connection was handed to a shard (which then owns the count).
    async fn handshake(&self, mut stream: TcpStream, peer: std::net::SocketAddr) -> bool {
        let mut buf = BytesMut::with_capacity(512);
        let mut decoder = Decoder::server(self.max_packet_size);
        let deadline = tokio::time::Instant::now() + self.connect_timeout;
        let connect = loop {
            match decoder.decode(&mut buf) {
                Ok(Some(Packet::Connect(c))) => break c,
                Ok(Some(other)) => {
                    tracing::warn!(%peer, packet = other.name(), "first packet was not CONNECT; closing");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%peer, %error, "bad CONNECT; closing");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
            }
            match tokio::time::timeout_at(deadline, stream.read_buf(&mut buf)).await {
                Ok(Ok(0)) => {
                    self.metrics.handshake_failures.inc();
                    return false;
                }
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "read failed before CONNECT");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
                Err(_) => {
                    tracing::info!(%peer, timeout_s = self.connect_timeout.as_secs_f32(), "no CONNECT in time; closing");
                    self.metrics.handshake_failures.inc();
                    return false;
                }
            }
        };
        let mut connect = connect;
        let version = connect.protocol;
        let assigned = match self
            .admission
            .admit(&mut connect, deadline, &self.metrics.admission)
            .await
        {
            Ok(assigned) => assigned,
            Err(refusal) => {
                // Busy and flapping refusals come in storms; they are logged at most once a
                // second where they are decided.
                if !matches!(refusal, Refusal::Busy | Refusal::ConnectRate) {
                    tracing::info!(%peer, client_id = %connect.client_id, reason = %refusal, "device refused");
                }
                self.metrics.rejected.inc();
                let mut out = BytesMut::new();
                let ack = ConnAck {
                    session_present: false,
                    code: refusal.connack_code(version),
                    properties: Properties::default(),
                };
                if encode(&Packet::ConnAck(ack), version, &mut out).is_ok() {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(1), stream.write_all(&out)).await;
                }
                let _ = stream.shutdown().await;
                return false;
            }
        };
        self.metrics.admitted.inc();
        let shard = hash::shard_for(connect.client_id.as_bytes(), None, self.shards.len());
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%peer, %error, "cannot detach device socket for its shard");
                return false;
            }
        };
        let adopted = Adopted {
            stream: std_stream,
            peer,
            connect,
            buffered: buf,
            assigned_client_id: assigned,
        };
        if self.shards[shard]
            .send(ShardCmd::Adopt(Box::new(adopted)))
            .await
            .is_err()
        {
            tracing::warn!(shard, "shard is gone; dropping device connection");
            return false;
        }
        true
    }
}
