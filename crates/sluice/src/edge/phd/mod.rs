//! The IEEE 11073-20601 edge: personal health devices (agents) over TCP (`[phd] listen`).
//!
//! Owns: the agent sockets and what happens on them, split by plane:
//! - [`assoc`] — **control plane** (thread `sluice-phd`): accepting, the association
//!   (AARQ → AARE), the configuration exchange, the MDS GET, releases and aborts, driven by
//!   the sans-IO [`sluice_proto::phd::Manager`] and recorded in the agent table
//!   ([`crate::control::phd::PhdRoom`]). An agent's connection stays here until its first
//!   measurement: agents that only associate and release (a control storm) never reach a
//!   shard.
//! - [`data`] — **data plane** (the agent's shard, `Jenkins(system id) % shards`): scan
//!   reports decoded with the table the manager carries (taken from the room's snapshot at
//!   association; nothing is asked of the control plane per report), each observation
//!   published as one SenML JSON message on `[phd] topic` through the router, and a
//!   confirmed report confirmed only when every sink is done with its messages (the MQTT
//!   PUBACK rule). Any signalling APDU (RLRQ, a new AARQ, …) makes the shard finish its
//!   confirmations and hand the connection back to the control plane with that APDU.
//!
//! The hand-over in both directions moves the socket (`into_std`), the bytes read and not yet
//! decoded, the manager (state, agent, table, timers) and the APDU that caused it.
//!
//! With `[phd] single_plane = true` (an experiment switch for the control-storm benchmark)
//! the listener hands every new connection to a shard at once (by the peer address: the
//! system id is not known yet) and the shard runs the association too — the paper's
//! single-plane gateway.
//!
//! Identity: on plain TCP an agent is the system id its AARQ claims. `[phd] agents` (an
//! allow-list of system ids) rejects the others at the AARQ (rejected-unauthorized); a
//! configuration learnt is bound to the first agent that taught it for that system id
//! (see [`crate::control::phd`]): another table for the same system id and config id is
//! refused, and the learnt table is used without asking only for an agent from the
//! teacher's IP address (or with its certificate CN) — any other is answered
//! accepted-unknown-config and must send its table, which must be the same.
//!
//! Bounds: `phd.max_connections` open connections (more closed at accept, counted),
//! `phd.max_apdu` per APDU (ABRT buffer-overflow), `phd.max_agents` in the table (AARQ
//! rejected-transient), the manager's timers for every wait on an agent.

pub mod assoc;
pub mod conn;
pub mod data;
pub mod tls;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use sluice_proto::phd::{Apdu, Manager, ManagerConfig};
use tokio::sync::mpsc;

use crate::config::PhdConfig;
use crate::control::phd::PhdRoom;
use crate::shard::ShardCmd;

/// A connection moving between the planes.
#[derive(Debug)]
pub struct Handover {
    /// The connection's number (unique per gateway run).
    pub conn: u64,
    pub stream: std::net::TcpStream,
    /// Bytes read and not yet decoded.
    pub buffered: BytesMut,
    /// The TLS session and the agent's identity (`[phd.tls]`; `None`: plain TCP).
    pub tls: Option<conn::Secure>,
    pub manager: Manager,
    /// The APDU that caused the move, to be handled first where it goes.
    pub first: Option<Apdu>,
}

/// What both planes share about the PHD edge (thread-safe; one per gateway).
pub struct PhdShared {
    pub room: Arc<PhdRoom>,
    pub manager: Arc<ManagerConfig>,
    pub topic: String,
    pub utc_offset_secs: i64,
    pub max_apdu: usize,
    pub single_plane: bool,
    pub max_connections: usize,
    /// `[phd] agents`: the system ids allowed to associate (`None`: all).
    pub allowed: Option<std::collections::HashSet<[u8; 8]>>,
    pub connections: AtomicUsize,
    /// The next connection's number.
    pub next_conn: std::sync::atomic::AtomicU64,
    /// The shards' mailboxes (hand-over to the data plane).
    pub shards: Vec<mpsc::Sender<ShardCmd>>,
    /// Back to the control plane (a shard saw signalling).
    pub back: mpsc::Sender<Box<Handover>>,
    /// `[phd.tls]`: the listener's TLS configuration.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl PhdShared {
    pub fn new(
        config: &PhdConfig,
        room: Arc<PhdRoom>,
        shards: Vec<mpsc::Sender<ShardCmd>>,
        back: mpsc::Sender<Box<Handover>>,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> PhdShared {
        let manager = ManagerConfig {
            system_id: config
                .manager_id()
                .unwrap_or([0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]),
            association_timeout: config.association_timeout,
            configuration_timeout: config.configuration_timeout,
            response_timeout: config.response_timeout,
            release_timeout: config.association_timeout,
            get_mds: config.get_mds,
            ..ManagerConfig::default()
        };
        PhdShared {
            room,
            manager: Arc::new(manager),
            topic: config.topic.clone(),
            utc_offset_secs: config.utc_offset_secs().unwrap_or(0),
            max_apdu: config.max_apdu.as_usize(),
            single_plane: config.single_plane,
            max_connections: config.max_connections,
            // Checked by the config's validation; an entry that does not parse allows nobody
            // rather than everybody.
            allowed: match config.allowed_agents() {
                Ok(list) => list.map(|l| l.into_iter().collect()),
                Err(_) => Some(Default::default()),
            },
            connections: AtomicUsize::new(0),
            next_conn: std::sync::atomic::AtomicU64::new(1),
            shards,
            back,
            tls,
        }
    }

    /// The shard of an agent (its device id is the system id in hex, hashed as a client id).
    pub fn shard_of(&self, device: &str) -> usize {
        crate::shard::hash::shard_for(device.as_bytes(), None, self.shards.len())
    }

    /// A connection ended (wherever it was).
    pub fn closed(&self) {
        self.connections.fetch_sub(1, Ordering::Relaxed);
        self.room
            .metrics
            .connections
            .set(self.connections.load(Ordering::Relaxed) as i64);
    }
}

/// The local topic of a measurement.
pub fn topic(template: &str, system_id: &str, metric: &str) -> String {
    template
        .replace("{system_id}", system_id)
        .replace("{metric}", metric)
}

/// The PHD edge before its thread starts: built in `Gateway::start` once the shards'
/// mailboxes exist, so that every shard seed can hold [`PhdShared`].
pub struct PhdStart {
    pub shared: Arc<PhdShared>,
    listener: std::net::TcpListener,
    back: mpsc::Receiver<Box<Handover>>,
}

impl PhdStart {
    pub fn new(
        config: &crate::config::Config,
        listener: std::net::TcpListener,
        shards: Vec<mpsc::Sender<ShardCmd>>,
    ) -> Result<PhdStart, tls::PhdTlsError> {
        let p = &config.phd;
        let tls = p.tls.as_ref().map(tls::server_config).transpose()?;
        let room = Arc::new(PhdRoom::new(
            p.max_agents,
            p.max_configs,
            config.spool.dir.clone(),
            p.allow_relearn,
        ));
        // Bounded: a shard gives a connection back only on signalling, and waits for room.
        let (back_tx, back) = mpsc::channel(config.gateway.mailbox_capacity.max(1));
        Ok(PhdStart {
            shared: Arc::new(PhdShared::new(p, room, shards, back_tx, tls)),
            listener,
            back,
        })
    }

    /// Start the `sluice-phd` thread.
    pub fn spawn(
        self,
        shutdown: tokio::sync::watch::Receiver<bool>,
        core: Option<usize>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        assoc::spawn(self.shared, self.listener, self.back, shutdown, core)
    }
}
