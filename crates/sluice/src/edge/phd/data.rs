//! PHD measurements on the agent's shard: scan reports → SenML messages through the router,
//! confirmations once delivered (see the module docs of [`super`]).
//!
//! Owns: the shard's task for an operating agent — decoding reports with the manager's table
//! (no call into the control plane), one `DeviceMessage` per observation on `[phd] topic`,
//! the confirmation of a confirmed report when every sink is done with all its messages
//! (`AckToken` shared over them, keyed by invoke-id), and giving the connection back to the
//! control plane at the first signalling APDU (after its confirmations are written, for at
//! most a third of the response timeout). Does not own: association (`assoc.rs`; run here only in the
//! single-plane experiment).
//!
//! Delivery: a confirmed report's messages are QoS 1 with a token (the agent's confirmation
//! is the acknowledgement); an unconfirmed report's messages are QoS 1 without one (the
//! agent expects no answer; the sinks still treat them as reliable).
//!
//! A device is confirmed only for data that is safe. When an uplink refuses any of a
//! confirmed report's messages for good (the token completed with a failure code: MQTT 5
//! PUBACK ≥ 0x80, oneM2M 4103/5207/…, a message given up), the report is answered with a
//! ROER (same invoke-id; error-value access-denied for a not-authorized refusal,
//! not-allowed-by-object for any other) instead of the confirmation, counted in
//! `sluice_phd_reports_refused_total` and logged (at most once a second). 20601 allows a
//! ROER as the answer to any confirmed invoke; the agent sees the report was not accepted
//! and keeps its measurement (Antidote's agent ignores ROER in Operating, so it waits out
//! its 3 s confirmation timer and aborts: also no confirmation, the data stays on the
//! device). The other messages of a refused report may have reached the cloud: if the agent
//! resends the report they arrive twice (at-least-once, never a false confirmation).
//! A token dropped without completing closes the connection (the agent resends).

use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytestring::ByteString;
use sluice_proto::mqtt::{Properties, ProtocolVersion, QoS};
use sluice_proto::phd::manager::{
    confirmation, report_refused, ROER_ACCESS_DENIED, ROER_NOT_ALLOWED_BY_OBJECT,
};
use sluice_proto::phd::measure::{measurements, senml_json};
use sluice_proto::phd::{Apdu, DataApdu, DataMessage, Manager, Output};

use super::assoc::{forget, signal, sleep_until, sync_agent, Step};
use super::conn::{Conn, Read};
use super::{topic, Handover, PhdShared};
use crate::control::acl::Edge;
use crate::control::phd::hex;
use crate::message::ack::{AckToken, DeviceAcks};
use crate::message::DeviceMessage;
use crate::shard::{router, ShardContext};

/// The ROER error-value for a report an uplink refused with the MQTT 5 reason `code`: the
/// cloud's authorization refusals (0x87 not-authorized, from MQTT 0x87 or oneM2M 4103/4126)
/// are access-denied; any other refusal for good is not-allowed-by-object.
fn refusal_error(code: u8) -> u16 {
    match code {
        0x87 => ROER_ACCESS_DENIED,
        _ => ROER_NOT_ALLOWED_BY_OBJECT,
    }
}

/// A confirmed report waiting for its messages' delivery.
struct Waiting {
    invoke_id: u16,
    obj_handle: u16,
    event_type: u16,
}

/// The shard's task for one agent connection, until it closes or goes back.
pub async fn run(ctx: Rc<ShardContext>, shared: Arc<PhdShared>, h: Box<Handover>) {
    let Handover {
        conn: id,
        stream,
        buffered,
        tls,
        manager,
        first,
    } = *h;
    let agent = manager.agent().map(|a| a.system_id);
    let Ok(stream) = tokio::net::TcpStream::from_std(stream) else {
        forget(&shared, id, agent);
        return shared.closed();
    };
    let conn = Conn::resume(stream, buffered, tls, shared.max_apdu);
    Task {
        id,
        ctx,
        shared,
        conn,
        m: manager,
        acks: DeviceAcks::new(),
        waiting: VecDeque::new(),
        agent,
    }
    .run(first)
    .await;
}

struct Task {
    /// The connection's number.
    id: u64,
    ctx: Rc<ShardContext>,
    shared: Arc<PhdShared>,
    conn: Conn,
    m: Manager,
    acks: Rc<DeviceAcks>,
    waiting: VecDeque<Waiting>,
    agent: Option<[u8; 8]>,
}

enum End {
    Closed,
    Back(Option<Apdu>),
}

impl Task {
    async fn run(mut self, mut first: Option<Apdu>) {
        let end = loop {
            if self.acks.is_abandoned() {
                // A message was lost before any sink took it: close, the agent resends.
                break End::Closed;
            }
            let input = match first.take() {
                Some(a) => Read::Apdu(a),
                None => {
                    let deadline = self.m.deadline();
                    let notify = self.acks.notify.clone();
                    tokio::select! {
                        biased;
                        () = notify.notified() => {
                            if self.confirm_delivered().await.is_err() { break End::Closed; }
                            continue;
                        }
                        r = self.conn.next() => r,
                        () = sleep_until(deadline) => {
                            let step = signal(&self.shared, &mut self.conn, &mut self.m, None, Some(self.ctx.id), self.id).await;
                            sync_agent(&self.shared, self.id, &self.m, &mut self.agent);
                            if step == Step::Close { break End::Closed; }
                            continue;
                        }
                    }
                }
            };
            match input {
                Read::Apdu(a) if self.m.is_data(&a) => {
                    if self.report(a).await == Step::Close {
                        break End::Closed;
                    }
                }
                Read::Apdu(a) if self.shared.single_plane => {
                    let step = signal(
                        &self.shared,
                        &mut self.conn,
                        &mut self.m,
                        Some(Ok(a)),
                        Some(self.ctx.id),
                        self.id,
                    )
                    .await;
                    sync_agent(&self.shared, self.id, &self.m, &mut self.agent);
                    if step == Step::Close {
                        break End::Closed;
                    }
                }
                Read::Apdu(a) => break End::Back(Some(a)),
                Read::Bad(e) if self.shared.single_plane => {
                    let step = signal(
                        &self.shared,
                        &mut self.conn,
                        &mut self.m,
                        Some(Err(e)),
                        Some(self.ctx.id),
                        self.id,
                    )
                    .await;
                    sync_agent(&self.shared, self.id, &self.m, &mut self.agent);
                    if step == Step::Close {
                        break End::Closed;
                    }
                }
                Read::Bad(e) => {
                    // Abort here (the bytes cannot go back), then the control plane keeps the
                    // unassociated connection.
                    let step = signal(
                        &self.shared,
                        &mut self.conn,
                        &mut self.m,
                        Some(Err(e)),
                        Some(self.ctx.id),
                        self.id,
                    )
                    .await;
                    sync_agent(&self.shared, self.id, &self.m, &mut self.agent);
                    if step == Step::Close {
                        break End::Closed;
                    }
                    break End::Back(None);
                }
                Read::Closed => break End::Closed,
            }
        };
        match end {
            End::Closed => {
                forget(&self.shared, self.id, self.agent);
                self.shared.closed();
            }
            End::Back(first) => self.give_back(first).await,
        }
    }

    /// Finish the confirmations, then hand the connection to the control plane with
    /// `first`. The wait is bounded by a third of the response timeout: an agent waits for
    /// its RLRE no longer than for a confirmation (Antidote: 3 s), so the release must be
    /// answered well within it even when the cloud is away (the unconfirmed reports are
    /// still delivered; the agent may send them again: at-least-once).
    async fn give_back(mut self, first: Option<Apdu>) {
        let until = Instant::now() + self.shared.manager.response_timeout / 3;
        while !self.waiting.is_empty() && !self.acks.is_abandoned() {
            let notify = self.acks.notify.clone();
            tokio::select! {
                () = notify.notified() => {
                    if self.confirm_delivered().await.is_err() { break; }
                }
                () = tokio::time::sleep_until(until.into()) => break,
            }
        }
        let Task {
            id,
            shared,
            conn,
            m,
            agent,
            ..
        } = self;
        let Ok((stream, buffered, tls)) = conn.into_parts() else {
            forget(&shared, id, agent);
            return shared.closed();
        };
        let h = Box::new(Handover {
            conn: id,
            stream,
            buffered,
            tls,
            manager: m,
            first,
        });
        if shared.back.send(h).await.is_err() {
            forget(&shared, id, agent);
            shared.closed();
        }
    }

    /// Answer the confirmed reports whose messages every sink is done with: the confirmation
    /// when all were taken (acknowledged or spooled), a ROER when an uplink refused any of
    /// them for good (see the module docs).
    async fn confirm_delivered(&mut self) -> std::io::Result<()> {
        let done = self.acks.drain();
        let mut out = Vec::with_capacity(done.len());
        for id in done {
            // The first failure code any holder completed the report's token with (0: none).
            let code = self.acks.take_reason(id, ProtocolVersion::V5);
            let Some(i) = self.waiting.iter().position(|w| w.invoke_id == id) else {
                continue;
            };
            let Some(w) = self.waiting.remove(i) else {
                continue;
            };
            if code == 0 {
                out.push(confirmation(w.invoke_id, w.obj_handle, w.event_type));
                continue;
            }
            let error = refusal_error(code);
            self.shared.room.metrics.reports_refused.inc();
            if self.shared.room.log_gate.open() {
                tracing::warn!(
                    system_id = %self.agent.map(|a| hex(&a)).unwrap_or_default(),
                    invoke_id = w.invoke_id,
                    reason_code = code,
                    roer = error,
                    "PHD report refused (by an uplink or the ACL); answered ROER instead of confirming"
                );
            }
            out.push(report_refused(w.invoke_id, error));
        }
        self.conn.send(&out).await
    }

    /// One scan report (or the MDS GET's answer): decode, publish its measurements, and
    /// arrange its confirmation.
    async fn report(&mut self, apdu: Apdu) -> Step {
        let mut out = Vec::new();
        let snapshot = self.shared.room.snapshot();
        if !matches!(
            &apdu,
            Apdu::Prst(DataApdu {
                message: DataMessage::EventReport { .. },
                ..
            })
        ) {
            super::assoc::count_in(&self.shared, &apdu); // the MDS GET's answer
        }
        self.m.on_apdu(apdu, Instant::now(), &*snapshot, &mut out);
        let metrics = self.shared.room.metrics.clone();
        let mut sends = Vec::new();
        let mut step = Step::Go;
        for o in out {
            match o {
                Output::Report {
                    invoke_id,
                    confirmed,
                    obj_handle,
                    event_type,
                    report,
                } => {
                    metrics.reports.inc();
                    metrics.observations.add(report.observations.len() as u64);
                    metrics
                        .observations_skipped
                        .add(report.skipped.len() as u64);
                    let (Some(agent), Some(table)) = (self.m.agent(), self.m.table()) else {
                        continue;
                    };
                    let received = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    let (ms, none) = measurements(
                        &agent.system_id,
                        table,
                        &report,
                        received,
                        self.shared.utc_offset_secs,
                    );
                    metrics.observations_skipped.add(none as u64);
                    metrics.measurements.add(ms.len() as u64);
                    let device = ByteString::from(hex(&agent.system_id));
                    let token = confirmed.then(|| AckToken::new(&self.acks, invoke_id));
                    if confirmed {
                        self.waiting.push_back(Waiting {
                            invoke_id,
                            obj_handle,
                            event_type,
                        });
                    }
                    let priority = self.ctx.rules.device(&device);
                    for mm in ms {
                        let topic =
                            ByteString::from(topic(&self.shared.topic, &device, &mm.metric));
                        if !self
                            .ctx
                            .acl
                            .allows_publish(Edge::Phd, &device, None, &topic)
                        {
                            // [acl]: dropped, counted; the report is answered ROER
                            // access-denied, not confirmed (ADR 0008, 0009).
                            if let Some(t) = &token {
                                t.share().complete_with(0x87);
                            }
                            continue;
                        }
                        let msg = Box::new(DeviceMessage {
                            device: device.clone(),
                            topic,
                            payload: senml_json(&mm.records),
                            qos: QoS::AtLeastOnce,
                            retain: false,
                            properties: Some(Box::new(Properties {
                                content_type: Some(ByteString::from_static(
                                    "application/senml+json",
                                )),
                                ..Properties::default()
                            })),
                            received_at: Instant::now(),
                            ack: token.as_ref().map(AckToken::share),
                        });
                        self.ctx.metrics.messages_received.inc();
                        router::publish(&self.ctx, msg, priority).await;
                    }
                    // The report's own hold: released now, so the confirmation waits only
                    // for the messages' holders (none: confirmed at once).
                    if let Some(t) = token {
                        t.complete();
                    }
                }
                Output::Send(a) => sends.push(a),
                Output::Close => step = Step::Close,
                Output::Violation(v) => {
                    metrics.violations.inc();
                    tracing::debug!(violation = ?v, "PHD report not fully read");
                }
                Output::MdsAttributes(attrs) => {
                    // Once per association: the agent's model for the agent table.
                    if let Some(agent) = self.m.agent() {
                        let (model, _clock) = sluice_proto::phd::manager::mds_summary(&attrs);
                        self.shared
                            .room
                            .update(&agent.system_id, |e| e.model = model);
                    }
                }
                _ => {}
            }
        }
        if self.conn.send(&sends).await.is_err() {
            return Step::Close;
        }
        sync_agent(&self.shared, self.id, &self.m, &mut self.agent);
        step
    }
}
