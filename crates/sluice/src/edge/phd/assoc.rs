//! PHD signalling on the control plane: the `sluice-phd` thread accepts agents, associates
//! and configures them, answers releases and aborts, and hands an operating agent to its
//! shard at its first measurement (see the module docs of [`super`]).
//!
//! Owns: the accept loop, the per-connection association task, [`signal`] (one signalling
//! APDU through the manager, its answers written and its facts recorded in the room — also
//! used by a shard in the single-plane experiment), and the thread. Does not own: reports
//! (`data.rs`).

use std::net::TcpListener as StdListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use sluice_proto::phd::apdu::{result, DATA_PROTO_20601};
use sluice_proto::phd::config::NOTI_CONFIG;
use sluice_proto::phd::manager::Violation;
use sluice_proto::phd::measure::specialization;
use sluice_proto::phd::{
    Apdu, DataApdu, DataMessage, Manager, Output, PhdAssociationInformation, State,
};
use tokio::sync::{mpsc, watch};

use super::conn::{Conn, Read, Secure};
use super::{Handover, PhdShared};
use crate::control::phd::{hex, AgentEntry, Claim, Taught};
use crate::shard::ShardCmd;

/// What the connection's task does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Go,
    Close,
}

/// Count an APDU from the agent by type.
pub(super) fn count_in(shared: &PhdShared, apdu: &Apdu) {
    let c = &shared.room.metrics.control;
    match apdu {
        Apdu::Aarq(_) => c.aarq.inc(),
        Apdu::Rlrq { .. } => c.rlrq.inc(),
        Apdu::Abrt { .. } => c.abrt_in.inc(),
        Apdu::Prst(DataApdu {
            message:
                DataMessage::EventReport {
                    event_type: NOTI_CONFIG,
                    ..
                },
            ..
        }) => c.config_report.inc(),
        Apdu::Prst(DataApdu {
            message: DataMessage::GetResult { .. },
            ..
        }) => c.get_result.inc(),
        _ => c.other.inc(),
    }
}

fn count_out(shared: &PhdShared, apdu: &Apdu) {
    let c = &shared.room.metrics.control;
    match apdu {
        Apdu::Aare(_) => c.aare.inc(),
        Apdu::Rlre { .. } => c.rlre.inc(),
        Apdu::Abrt { .. } => c.abrt_out.inc(),
        Apdu::Prst(DataApdu {
            message:
                DataMessage::EventReportResult {
                    event_type: NOTI_CONFIG,
                    ..
                },
            ..
        }) => c.config_response.inc(),
        Apdu::Prst(DataApdu {
            message: DataMessage::Get { .. },
            ..
        }) => c.get.inc(),
        _ => {}
    }
}

/// The system id an AARQ announces, if it decodes.
fn aarq_system_id(apdu: &Apdu) -> Option<[u8; 8]> {
    let Apdu::Aarq(aarq) = apdu else {
        return None;
    };
    let proto = aarq.protos.iter().find(|p| p.id == DATA_PROTO_20601)?;
    let info = PhdAssociationInformation::decode(proto.info.clone()).ok()?;
    info.system_id[..].try_into().ok()
}

/// One signalling APDU (or `None`: the manager's deadline passed) through the manager: its
/// answers are written, its facts recorded in the room. `shard`: where the agent's data goes
/// (known on a shard; on the control plane it is chosen at the hand-over).
pub async fn signal(
    shared: &PhdShared,
    conn: &mut Conn,
    m: &mut Manager,
    input: Option<Result<Apdu, sluice_proto::phd::DecodeError>>,
    shard: Option<usize>,
    conn_id: u64,
) -> Step {
    let now = Instant::now();
    let mut out = Vec::new();
    match input {
        Some(Ok(apdu)) => {
            count_in(shared, &apdu);
            if m.state() == State::Unassociated && matches!(&apdu, Apdu::Prst(_)) {
                shared.room.metrics.reports_unassociated.inc();
                tracing::debug!("PHD data before association: ABRT");
            }
            if let Some(id) = aarq_system_id(&apdu) {
                let listed = shared.allowed.as_ref().is_none_or(|a| a.contains(&id));
                if m.state() == State::Unassociated && !listed {
                    // Not in `[phd] agents`: never accepted.
                    shared.room.metrics.agents_not_allowed.inc();
                    if shared.room.log_gate.open() {
                        tracing::warn!(system_id = %hex(&id), peer = ?conn.peer, "PHD agent not in [phd] agents; association rejected");
                    }
                    reject(shared, result::REJECTED_UNAUTHORIZED, &mut out);
                    return apply(shared, conn, m, out, shard, conn_id).await;
                }
                let identity = conn.identity().map(|i| &**i);
                if m.state() == State::Unassociated
                    && shared.room.snapshot().owned_by_another(&id, identity)
                {
                    // Its configurations were taught by another certificate identity.
                    shared.room.metrics.identity_refused.inc();
                    if shared.room.log_gate.open() {
                        let taught_by = shared.room.taught_by_any(&id);
                        tracing::warn!(system_id = %hex(&id), peer = ?conn.peer, identity = ?identity, taught_by = ?taught_by, "PHD agent claims a system id another identity taught; association rejected");
                    }
                    reject(shared, result::REJECTED_UNAUTHORIZED, &mut out);
                    return apply(shared, conn, m, out, shard, conn_id).await;
                }
                if m.state() == State::Unassociated && !shared.room.has_room(&id) {
                    // The agent table is full: try later.
                    reject(shared, result::REJECTED_TRANSIENT, &mut out);
                    return apply(shared, conn, m, out, shard, conn_id).await;
                }
            }
            // A learnt table is trusted only from its teacher's address or identity: any
            // other agent claiming it is asked for its table (control::phd module docs).
            let snapshot = shared.room.snapshot();
            let claim = Claim {
                snapshot: &snapshot,
                peer: conn.peer.map(|p| p.ip()),
                identity: conn.identity().map(|i| &**i),
            };
            m.on_apdu(apdu, now, &claim, &mut out);
        }
        Some(Err(e)) => m.on_decode_error(&e, now, &mut out),
        None => {
            shared.room.metrics.timeouts.inc();
            m.on_timeout(now, &mut out);
        }
    }
    apply(shared, conn, m, out, shard, conn_id).await
}

/// Answer an AARQ with a rejection (`result`) before the manager sees it.
fn reject(shared: &PhdShared, result: u16, out: &mut Vec<Output>) {
    let aare = sluice_proto::phd::manager::rejection(&shared.manager, result);
    out.push(Output::Send(aare));
    out.push(Output::Rejected { result });
}

async fn apply(
    shared: &PhdShared,
    conn: &mut Conn,
    m: &Manager,
    out: Vec<Output>,
    shard: Option<usize>,
    conn_id: u64,
) -> Step {
    let room = &shared.room;
    let metrics = &room.metrics;
    let mut sends = Vec::new();
    let mut step = Step::Go;
    for o in out {
        match o {
            Output::Send(a) => {
                count_out(shared, &a);
                sends.push(a);
            }
            Output::Associated { agent } => {
                metrics.associations.inc();
                tracing::debug!(system_id = %hex(&agent.system_id), config_id = agent.config_id, "PHD agent associated (known configuration)");
                let spec = m.table().map(|t| specialization(t)).unwrap_or("unknown");
                room.agent_up(
                    agent.system_id,
                    entry(spec, agent.config_id, "operating", shard, conn_id),
                );
            }
            Output::Configuring { agent } => {
                tracing::debug!(system_id = %hex(&agent.system_id), config_id = agent.config_id, "PHD agent associated; configuration unknown, waiting for its report");
                room.agent_up(
                    agent.system_id,
                    entry("unknown", agent.config_id, "configuring", shard, conn_id),
                );
            }
            Output::ConfigAccepted { agent, table } => {
                metrics.associations.inc();
                let spec = specialization(&table);
                let config_id = table.config_id;
                let objects = table.objects.len();
                match room.learn(agent.system_id, table, conn.peer, conn.identity().cloned()) {
                    Taught::New => {
                        metrics.configs_learnt.inc();
                        tracing::debug!(system_id = %hex(&agent.system_id), config_id, objects, "PHD configuration accepted and stored");
                    }
                    Taught::Same => {
                        // Asked again (another address than the teacher's): the same table.
                        metrics.config_reconfirmed.inc();
                        tracing::debug!(system_id = %hex(&agent.system_id), config_id, peer = ?conn.peer, "PHD configuration re-sent unchanged; accepted, its teacher stays");
                    }
                    Taught::Conflict => {
                        // Lost a race with another connection teaching a different table
                        // (single-plane shards only): the first stays stored; this
                        // connection goes on with its own table for its own reports.
                        conflict(shared, &agent.system_id, config_id, conn.peer);
                    }
                }
                room.update(&agent.system_id, |e| {
                    e.state = "operating";
                    e.specialization = spec;
                    e.config_id = agent.config_id;
                });
            }
            Output::ConfigConflict { agent } => {
                conflict(shared, &agent.system_id, agent.config_id, conn.peer);
            }
            Output::ConfigRefused { config_id, result } => {
                metrics.configs_refused.inc();
                tracing::debug!(config_id, result, "PHD configuration refused");
            }
            Output::Rejected { result } => {
                metrics.rejected.inc();
                tracing::debug!(result, "PHD association rejected");
            }
            Output::MdsAttributes(attrs) => {
                if let Some(agent) = m.agent() {
                    let (model, _clock) = sluice_proto::phd::manager::mds_summary(&attrs);
                    room.update(&agent.system_id, |e| e.model = model);
                }
            }
            Output::Released => tracing::debug!("PHD association released"),
            Output::Aborted { by_agent, reason } => {
                tracing::debug!(by_agent, reason, "PHD association aborted")
            }
            Output::Violation(v) => {
                metrics.violations.inc();
                if v == Violation::ReportNotOperating {
                    metrics.reports_unassociated.inc(); // configuring: not yet operating
                }
                tracing::debug!(violation = ?v, "PHD agent broke the protocol");
            }
            Output::Report { .. } => {} // never from signalling: data goes to `data.rs`
            Output::Close => step = Step::Close,
        }
    }
    if conn.send(&sends).await.is_err() {
        return Step::Close;
    }
    step
}

/// Another table for a configuration another agent taught: counted, logged with both
/// addresses.
fn conflict(
    shared: &PhdShared,
    system_id: &[u8; 8],
    config_id: u16,
    peer: Option<std::net::SocketAddr>,
) {
    shared.room.metrics.config_conflicts.inc();
    if shared.room.log_gate.open() {
        let taught_by = shared.room.taught_by(system_id, config_id);
        tracing::warn!(
            system_id = %hex(system_id),
            config_id,
            peer = ?peer,
            taught_by = ?taught_by,
            "PHD agent reported another table for a configuration another agent taught; refused"
        );
    }
}

fn entry(
    spec: &'static str,
    config_id: u16,
    state: &'static str,
    shard: Option<usize>,
    conn: u64,
) -> AgentEntry {
    AgentEntry {
        specialization: spec,
        config_id,
        state,
        model: None,
        shard,
        since: Instant::now(),
        conn,
    }
}

/// Forget the agent of a connection that ended (or was released/aborted).
pub fn forget(shared: &PhdShared, conn: u64, last: Option<[u8; 8]>) {
    if let Some(id) = last {
        shared.room.agent_down(&id, conn);
    }
}

/// One connection on the control plane, until it closes or goes to its shard.
async fn control_conn(
    shared: Arc<PhdShared>,
    id: u64,
    mut conn: Conn,
    mut m: Manager,
    mut first: Option<Apdu>,
) {
    let mut agent = m.agent().map(|a| a.system_id);
    loop {
        let input = match first.take() {
            Some(a) => Read::Apdu(a),
            None => {
                let deadline = m.deadline();
                tokio::select! {
                    r = conn.next() => r,
                    () = sleep_until(deadline) => {
                        if signal(&shared, &mut conn, &mut m, None, None, id).await == Step::Close { break; }
                        sync_agent(&shared, id, &m, &mut agent);
                        continue;
                    }
                }
            }
        };
        let step = match input {
            Read::Apdu(a) if m.is_data(&a) => {
                let Some(system_id) = m.agent().map(|a| a.system_id) else {
                    break;
                };
                let device = hex(&system_id);
                let shard = shared.shard_of(&device);
                shared.room.update(&system_id, |e| e.shard = Some(shard));
                let Ok((stream, buffered, tls)) = conn.into_parts() else {
                    forget(&shared, id, agent);
                    shared.closed();
                    return;
                };
                shared.room.metrics.handovers.inc();
                let h = Box::new(Handover {
                    conn: id,
                    stream,
                    buffered,
                    tls,
                    manager: m,
                    first: Some(a),
                });
                if shared.shards[shard]
                    .send(ShardCmd::PhdAdopt(h))
                    .await
                    .is_err()
                {
                    forget(&shared, id, agent);
                    shared.closed();
                }
                return;
            }
            Read::Apdu(a) => signal(&shared, &mut conn, &mut m, Some(Ok(a)), None, id).await,
            Read::Bad(e) => signal(&shared, &mut conn, &mut m, Some(Err(e)), None, id).await,
            Read::Closed => Step::Close,
        };
        sync_agent(&shared, id, &m, &mut agent);
        if step == Step::Close {
            break;
        }
    }
    forget(&shared, id, agent);
    shared.closed();
}

/// After a release or abort the manager has no agent: drop it from the table.
pub fn sync_agent(shared: &PhdShared, conn: u64, m: &Manager, agent: &mut Option<[u8; 8]>) {
    let now = m.agent().map(|a| a.system_id);
    if *agent != now {
        if let Some(old) = agent.take() {
            shared.room.agent_down(&old, conn);
        }
        *agent = now;
    }
}

/// Sleep until `deadline`, or forever without one.
pub async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// The `sluice-phd` thread: accept agents, run their association tasks, take connections
/// back from the shards; until shutdown.
pub fn spawn(
    shared: Arc<PhdShared>,
    listener: StdListener,
    back: mpsc::Receiver<Box<Handover>>,
    mut shutdown: watch::Receiver<bool>,
    core: Option<usize>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let thread = move || {
        crate::app::pin_control_thread(core, "sluice-phd");
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(error) => {
                tracing::error!(%error, "cannot build the PHD control-plane runtime");
                return;
            }
        };
        tokio::task::LocalSet::new().block_on(&rt, async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(error) => return tracing::error!(%error, "cannot register the PHD listener"),
            };
            tokio::task::spawn_local(take_back(shared.clone(), back));
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, peer)) => accept(&shared, stream, peer).await,
                        Err(error) => {
                            tracing::warn!(%error, "PHD accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        }
                    },
                    _ = shutdown.wait_for(|s| *s) => break,
                }
            }
            shared.room.flush();
        });
    };
    std::thread::Builder::new()
        .name("sluice-phd".into())
        .spawn(thread)
}

async fn accept(
    shared: &Arc<PhdShared>,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
) {
    let open = shared.connections.fetch_add(1, Ordering::Relaxed) + 1;
    if open > shared.max_connections {
        shared.closed();
        shared.room.metrics.refused_connections.inc();
        return;
    }
    shared.room.metrics.connections.set(open as i64);
    let _ = stream.set_nodelay(true);
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    tokio::task::spawn_local(start(shared.clone(), id, stream, peer));
}

/// A new connection: the TLS handshake first with `[phd.tls]` (identity before any APDU),
/// then its association task here (or, in the single-plane experiment, on a shard).
async fn start(
    shared: Arc<PhdShared>,
    id: u64,
    mut stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
) {
    let tls = match &shared.tls {
        None => None,
        Some(config) => match secure(&shared, config, &mut stream, peer).await {
            Some(s) => Some(s),
            None => return shared.closed(),
        },
    };
    let manager = Manager::new(shared.manager.clone(), Instant::now());
    if shared.single_plane {
        // The experiment: the shard does everything, chosen by the peer (no system id yet).
        let shard = shared.shard_of(&peer.to_string());
        let Ok(stream) = stream.into_std() else {
            return shared.closed();
        };
        let h = Box::new(Handover {
            conn: id,
            stream,
            buffered: BytesMut::new(),
            tls,
            manager,
            first: None,
        });
        if shared.shards[shard]
            .send(ShardCmd::PhdAdopt(h))
            .await
            .is_err()
        {
            shared.closed();
        }
        return;
    }
    let conn = Conn::resume(stream, BytesMut::new(), tls, shared.max_apdu);
    control_conn(shared, id, conn, manager, None).await;
}

/// The TLS handshake, bounded by the association timeout; the session and the agent's
/// certificate identity, or `None` (counted, logged at most once a second).
async fn secure(
    shared: &PhdShared,
    config: &Arc<rustls::ServerConfig>,
    stream: &mut tokio::net::TcpStream,
    peer: std::net::SocketAddr,
) -> Option<Secure> {
    let result = match rustls::ServerConnection::new(config.clone()) {
        Ok(mut session) => {
            let wait = shared.manager.association_timeout;
            match tokio::time::timeout(wait, super::tls::handshake(stream, &mut session)).await {
                Ok(Ok(())) => Ok(session),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("handshake timed out".to_string()),
            }
        }
        Err(e) => Err(e.to_string()),
    };
    match result {
        Ok(session) => {
            let identity = super::tls::identity(&session);
            Some(Secure {
                session: Box::new(session),
                identity,
            })
        }
        Err(error) => {
            shared.room.metrics.tls_failures.inc();
            if shared.room.log_gate.open() {
                tracing::warn!(%peer, %error, "PHD TLS handshake failed; connection closed");
            }
            None
        }
    }
}

/// Connections the shards give back (signalling seen), resumed here.
async fn take_back(shared: Arc<PhdShared>, mut back: mpsc::Receiver<Box<Handover>>) {
    while let Some(h) = back.recv().await {
        let Handover {
            conn: id,
            stream,
            buffered,
            tls,
            manager,
            first,
        } = *h;
        let Ok(stream) = tokio::net::TcpStream::from_std(stream) else {
            if let Some(a) = manager.agent() {
                shared.room.agent_down(&a.system_id, id);
            }
            shared.closed();
            continue;
        };
        let conn = Conn::resume(stream, buffered, tls, shared.max_apdu);
        tokio::task::spawn_local(control_conn(shared.clone(), id, conn, manager, first));
    }
}
