//! The function dispatcher: a [`Transport`] that turns each message into a CloudEvents POST
//! to an instance of one function, with retries, dead letters and replies.
//!
//! Owns: one function's requests on one shard — building each event's request once
//! (`cloudevents.rs`), taking an in-flight slot on an instance ([`FunctionHandle::acquire`]) or
//! waiting for one (and asking the runtime for an instance), running each request as its own
//! task on the shard (`conn.rs`), classifying answers, retrying with backoff, dead-lettering,
//! and queueing replies and dead letters for the router. Does not own: the queue, spool and ack
//! rule (the outbox's), instances (the runtime's), routing (the shard's `publish` callback).
//!
//! # One event
//! `encode` builds the request (head + payload) and returns a [`SendId`]; the outbox's window
//! bounds how many are held here. The event waits in `ready` until a slot is free (a local
//! function's event at most `start_timeout.max(timeout)`: then no instance became ready, which
//! counts as a failed attempt, outcome `timeout`), then a task
//! writes it on a pooled connection and reads the answer, bounded by `timeout` (by
//! `start_timeout` on an instance that has not answered yet: its start-up is part of the wait).
//! The bound is kept by one timer per dispatcher, not one per request ([`FunctionTransport`]'s
//! `sweep`: armed at the earliest deadline of the requests under way and moved only when it
//! fires, which aborts the requests past theirs): registering a timer earlier than the
//! runtime's next one wakes the shard's event loop through its eventfd, which a timer per
//! request did once per event (issue 32, docs/perf/functions.md).
//! - **2xx**: acknowledged ([`Feedback::Acked`]: the device's QoS 1 ack follows the outbox's
//!   rule); a non-empty body is published on `reply_topic` when one is set.
//! - **5xx, 408, 429, timeout, connection failure**: retried after `retry_min`, doubling up to
//!   `retry_max`, `retries` times; then dead-lettered.
//! - **Other 4xx**: the function refused the event itself; resending cannot help, so it is
//!   dead-lettered at once.
//!
//! A dead letter is the event's payload published on `$sluice/dlq/{name}` (local subscribers
//! only) with MQTT 5 user properties `topic`, `device`, `error` and `attempts`; then the event
//! is acknowledged. Replies and dead letters are routed like device messages (local and other
//! shards' subscribers, uplinks) but never to a function, so functions cannot loop. Events of
//! one device may be answered out of order (concurrent requests, retries), as on Knative.
//!
//! # Isolation
//! Each function has its own outbox and queue on each shard, so a slow or dead function holds
//! only its own window; its overflow is dead-lettered (`handle.rs`) instead of holding the
//! device, so the cloud uplink and other functions never wait for it.

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{Properties, QoS};
use tokio::sync::mpsc;

use super::cloudevents;
use super::conn::{Answer, CallError, Conn, Outgoing, Pool, Target};
use super::{Overflow, Publish};
use crate::config::FunctionConfig;
use crate::functions::metrics::Outcome;
use crate::functions::{FunctionHandle, Instance, Slot};
use crate::message::DeviceMessage;
use crate::sink::transport::{Feedback, LinkLimits, SendId, Transport, Unit, Unsendable};
use crate::sink::{UplinkError, UplinkMessage};

/// What one event keeps while it is here.
struct Job {
    /// The request, built once (headers and body shared by every attempt).
    request: Rc<Outgoing>,
    body: Bytes,
    device: ByteString,
    topic: ByteString,
    qos: QoS,
    received_at: Instant,
    /// Attempts made so far.
    attempts: u32,
    /// When it last joined `ready` (a local function's event waits there at most
    /// `start_timeout.max(timeout)` for an instance: see [`FunctionTransport::expire_waiting`]).
    ready_since: Instant,
}

/// A request task's result.
struct Done {
    id: SendId,
    /// The job's attempt it answers (a late answer of an attempt that timed out is ignored).
    attempt: u32,
    result: Result<Answer, Failure>,
    instance: Arc<Instance>,
    took: Duration,
}

/// A request under way (its task's abort handle and deadline).
struct Running {
    attempt: u32,
    abort: tokio::task::AbortHandle,
    deadline: Instant,
    limit: Duration,
    started: Instant,
    instance: Arc<Instance>,
}

#[derive(Debug)]
enum Failure {
    Call(CallError),
    Timeout(Duration),
}

/// One function's dispatcher on one shard (see the module docs).
pub struct FunctionTransport {
    handle: Arc<FunctionHandle>,
    cfg: Arc<FunctionConfig>,
    gateway: String,
    host: String,
    /// The request target (a remote function's path and query; `/` for a local one).
    uri: hyper::Uri,
    target_remote: Option<Target>,
    id_prefix: String,
    next_id: u64,
    window: usize,
    jobs: HashMap<SendId, Job>,
    ready: VecDeque<SendId>,
    retries: BinaryHeap<std::cmp::Reverse<(Instant, SendId)>>,
    /// Events counted in the handle's `waiting` (ours, in `ready`).
    counted_waiting: usize,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    /// Requests under way, by event.
    running: HashMap<SendId, Running>,
    /// The one timer of the requests' deadlines, armed at `sweep_at` (`None`: disarmed).
    sweep: Pin<Box<tokio::time::Sleep>>,
    sweep_at: Option<Instant>,
    feedback: Vec<Feedback>,
    /// Replies and dead letters to route (in `settle`).
    outgoing: Vec<DeviceMessage>,
    /// Messages the sink could not queue (queue full), dead-lettered here.
    overflow: Rc<Overflow>,
    pool: Rc<RefCell<Pool>>,
    publish: Publish,
}

impl FunctionTransport {
    pub fn new(
        shard: usize,
        handle: Arc<FunctionHandle>,
        publish: Publish,
        overflow: Rc<Overflow>,
    ) -> FunctionTransport {
        let cfg = handle.cfg.clone();
        let (host, path, target_remote) = match &handle.remote {
            Some(r) => (
                r.host_header(),
                r.path.clone(),
                Some(Target::Host(r.host.clone(), r.port)),
            ),
            None => ("127.0.0.1".to_owned(), "/".to_owned(), None),
        };
        let start = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let uri = path.parse().unwrap_or_else(|error| {
            tracing::warn!(function = %cfg.name, %path, %error, "function url path is not a valid request target; using /");
            hyper::Uri::from_static("/")
        });
        FunctionTransport {
            window: (cfg.max_in_flight() * 2).max(2),
            cfg,
            handle,
            // `ce-source`'s gateway: the host name (not `[gateway] name`, which changes
            // nothing the cloud receives).
            gateway: crate::config::host_name(),
            host,
            uri,
            target_remote,
            id_prefix: format!("{start:x}-{shard}-"),
            next_id: 0,
            jobs: HashMap::new(),
            ready: VecDeque::new(),
            retries: BinaryHeap::new(),
            counted_waiting: 0,
            done_tx,
            done_rx,
            running: HashMap::new(),
            sweep: Box::pin(tokio::time::sleep_until(tokio::time::Instant::now())),
            sweep_at: None,
            feedback: Vec::new(),
            outgoing: Vec::new(),
            overflow,
            pool: Rc::new(RefCell::new(Pool::default())),
            publish,
        }
    }

    /// Start a request for every ready event that gets a slot; ask for an instance when one
    /// does not.
    fn dispatch(&mut self) {
        while let Some(&id) = self.ready.front() {
            let Some(slot) = self.handle.acquire() else {
                self.handle.demand();
                break;
            };
            self.ready.pop_front();
            let Some(job) = self.jobs.get_mut(&id) else {
                continue;
            };
            job.attempts += 1;
            self.spawn_request(id, slot);
        }
        self.sync_waiting();
    }

    fn sync_waiting(&mut self) {
        let now = self.ready.len();
        if now > self.counted_waiting {
            self.handle.wait_begin(now - self.counted_waiting);
        } else if now < self.counted_waiting {
            self.handle.wait_end(self.counted_waiting - now);
        }
        self.handle
            .metrics
            .queue_depth
            .add(now as i64 - self.counted_waiting as i64);
        self.counted_waiting = now;
    }

    fn spawn_request(&mut self, id: SendId, slot: Slot) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let inst = slot.instance().clone();
        let target = match (&self.target_remote, inst.addr) {
            (Some(t), _) => t.clone(),
            (None, Some(a)) => Target::Addr(a),
            (None, None) => return,
        };
        let limit = if inst.has_answered() || self.target_remote.is_some() {
            self.cfg.timeout
        } else {
            self.cfg.start_timeout.max(self.cfg.timeout)
        };
        let request = job.request.clone();
        let attempt = job.attempts;
        let first = attempt == 1;
        let received_at = job.received_at;
        let tx = self.done_tx.clone();
        let pool = self.pool.clone();
        let handle = self.handle.clone();
        let started = Instant::now();
        let instance = inst.clone();
        let task = tokio::task::spawn_local(async move {
            let _slot = slot;
            let observed = std::cell::Cell::new(false);
            let result = exchange(&pool, inst.id, &target, &request, |at| {
                if first && !observed.replace(true) {
                    handle
                        .metrics
                        .dispatch_latency
                        .observe(at.saturating_duration_since(received_at));
                }
            })
            .await
            .map_err(Failure::Call);
            let _ = tx.send(Done {
                id,
                attempt,
                result,
                instance: inst,
                took: started.elapsed(),
            });
        });
        let deadline = started + limit;
        self.running.insert(
            id,
            Running {
                attempt,
                abort: task.abort_handle(),
                deadline,
                limit,
                started,
                instance,
            },
        );
        // Moved only to an earlier deadline (rare: a cold instance's longer limit came
        // first); otherwise it fires at the deadline it has and is re-armed then.
        if self.sweep_at.is_none_or(|at| deadline < at) {
            self.arm_sweep(deadline);
        }
    }

    fn arm_sweep(&mut self, at: Instant) {
        self.sweep.as_mut().reset(at.into());
        self.sweep_at = Some(at);
    }

    /// The sweep timer fired: every request past its deadline is aborted and fails as a
    /// timeout; the timer is re-armed at the earliest deadline left.
    fn expire_running(&mut self) {
        self.sweep_at = None;
        let now = Instant::now();
        let expired: Vec<SendId> = self
            .running
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let Some(r) = self.running.remove(&id) else {
                continue;
            };
            // Dropping the exchange drops its connection and frees its slot.
            r.abort.abort();
            self.finish(Done {
                id,
                attempt: r.attempt,
                result: Err(Failure::Timeout(r.limit)),
                instance: r.instance,
                took: now.saturating_duration_since(r.started),
            });
        }
        if let Some(next) = self.running.values().map(|r| r.deadline).min() {
            self.arm_sweep(next);
        }
    }

    /// A request task's result: taken when it answers the attempt under way (not one that
    /// already timed out).
    fn on_done(&mut self, done: Done) {
        match self.running.get(&done.id) {
            Some(r) if r.attempt == done.attempt => {
                self.running.remove(&done.id);
                self.finish(done);
            }
            _ => {}
        }
    }

    fn finish(&mut self, done: Done) {
        let m = &self.handle.metrics;
        let Done {
            id,
            attempt: _,
            result,
            instance,
            took,
        } = done;
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let answered = result.is_ok();
        if answered && instance.mark_answered() && self.target_remote.is_none() {
            m.instances_starting.sub(1);
            m.instances_running.add(1);
            if !instance.prewarmed() {
                m.cold_start_latency.observe(
                    job.received_at
                        .elapsed()
                        .min(instance.started_at().elapsed()),
                );
            }
        }
        let (retryable, error) = match &result {
            Ok(a) if (200..300).contains(&a.status) => {
                m.invocation(Outcome::Ok);
                m.invocation_latency.observe(took);
                let job = self.jobs.remove(&id).expect("present");
                self.reply(&job, a);
                self.feedback.push(Feedback::Acked(id));
                return;
            }
            Ok(a) => {
                m.invocation(Outcome::HttpError);
                m.invocation_latency.observe(took);
                let retry = a.status >= 500 || a.status == 408 || a.status == 429;
                (retry, format!("HTTP {}", a.status))
            }
            Err(Failure::Timeout(d)) => {
                m.invocation(Outcome::Timeout);
                (true, format!("no answer within {d:?}"))
            }
            Err(Failure::Call(e)) => {
                m.invocation(Outcome::ConnectionError);
                (true, e.to_string())
            }
        };
        self.failed(id, retryable, error);
    }

    /// An attempt of `id` failed: retry it after a backoff, or dead-letter it.
    fn failed(&mut self, id: SendId, retryable: bool, error: String) {
        let m = &self.handle.metrics;
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let attempts = job.attempts;
        if retryable && attempts <= self.cfg.retries {
            m.retries.inc();
            let backoff = self
                .cfg
                .retry_min
                .saturating_mul(1u32 << (attempts - 1).min(20))
                .min(self.cfg.retry_max);
            tracing::debug!(function = %self.cfg.name, %error, attempts, ?backoff, "function call failed; retrying");
            self.retries
                .push(std::cmp::Reverse((Instant::now() + backoff, id)));
        } else {
            let job = self.jobs.remove(&id).expect("present");
            tracing::warn!(function = %self.cfg.name, topic = %job.topic, %error, attempts, "event dead-lettered");
            self.dead_letter(job.device, job.topic, job.body, job.qos, &error, attempts);
            self.feedback.push(Feedback::Acked(id));
        }
    }

    /// Publish a 2xx answer's body on `reply_topic`, with its Content-Type as the MQTT 5
    /// content type.
    fn reply(&mut self, job: &Job, answer: &Answer) {
        let body = &answer.body;
        if self.cfg.reply_topic.is_empty() || body.is_empty() {
            return;
        }
        let topic = self
            .cfg
            .reply_topic
            .replace("{topic}", &job.topic)
            .replace("{device}", &job.device)
            .replace("{function}", &self.cfg.name);
        if !sluice_proto::mqtt::topic::valid_topic_name(&topic) {
            tracing::warn!(function = %self.cfg.name, %topic, "reply topic is not a valid topic name; reply dropped");
            return;
        }
        self.handle.metrics.replies.inc();
        self.outgoing.push(DeviceMessage {
            device: job.device.clone(),
            topic: topic.into(),
            payload: body.clone(),
            qos: job.qos,
            retain: false,
            properties: answer.content_type.clone().map(|content_type| {
                Box::new(Properties {
                    content_type: Some(content_type),
                    ..Default::default()
                })
            }),
            received_at: Instant::now(),
            ack: None,
        });
    }

    fn dead_letter(
        &mut self,
        device: ByteString,
        topic: ByteString,
        payload: Bytes,
        qos: QoS,
        error: &str,
        attempts: u32,
    ) {
        self.handle.metrics.dead_letters.inc();
        let props = Properties {
            user_properties: vec![
                ("topic".into(), topic),
                ("device".into(), device.clone()),
                ("error".into(), error.into()),
                ("attempts".into(), attempts.to_string().into()),
            ],
            ..Default::default()
        };
        self.outgoing.push(DeviceMessage {
            device,
            topic: crate::config::dead_letter_topic(&self.cfg.name).into(),
            payload,
            qos,
            retain: false,
            properties: Some(Box::new(props)),
            received_at: Instant::now(),
            ack: None,
        });
    }

    fn take_overflow(&mut self) {
        let msgs: Vec<UplinkMessage> = std::mem::take(&mut *self.overflow.msgs.borrow_mut());
        for msg in msgs {
            self.handle.note_arrival();
            let (device, topic, payload, qos) = (
                msg.device.clone(),
                msg.topic.clone(),
                msg.payload.clone(),
                msg.qos,
            );
            self.dead_letter(device, topic, payload, qos, "queue full", 0);
            // Finished once its dead letter is queued: the device's share completes.
            msg.complete_with(0);
        }
    }

    /// How long a local function's event waits in `ready` for an instance to take it.
    fn wait_limit(&self) -> Option<Duration> {
        self.target_remote
            .is_none()
            .then(|| self.cfg.start_timeout.max(self.cfg.timeout))
    }

    /// When the oldest waiting event's wait ends (`ready` is in the order events joined it).
    fn wait_deadline(&self) -> Option<Instant> {
        let limit = self.wait_limit()?;
        let job = self.jobs.get(self.ready.front()?)?;
        Some(job.ready_since + limit)
    }

    /// A local function's events that waited `start_timeout.max(timeout)` for an instance
    /// (none became ready: one that crashes on start, or never serves) count a failed attempt
    /// each — retried, then dead-lettered — as they would have against an instance published
    /// before it started (`socket = "inherit"`).
    fn expire_waiting(&mut self) {
        let Some(limit) = self.wait_limit() else {
            return;
        };
        let now = Instant::now();
        while let Some(&id) = self.ready.front() {
            let Some(job) = self.jobs.get_mut(&id) else {
                self.ready.pop_front();
                continue;
            };
            if now < job.ready_since + limit {
                break;
            }
            self.ready.pop_front();
            job.attempts += 1;
            self.handle.metrics.invocation(Outcome::Timeout);
            self.failed(id, true, format!("no instance ready within {limit:?}"));
        }
        self.sync_waiting();
    }

    fn due_retries(&mut self) {
        let now = Instant::now();
        while let Some(std::cmp::Reverse((at, id))) = self.retries.peek().copied() {
            if at > now {
                break;
            }
            self.retries.pop();
            if let Some(job) = self.jobs.get_mut(&id) {
                job.ready_since = now;
                self.ready.push_back(id);
            }
        }
    }
}

/// One request on a pooled (or new) connection; a reused connection that fails before any
/// answer is replaced once by a new one (the server may have closed it while idle).
async fn exchange(
    pool: &Rc<RefCell<Pool>>,
    instance: u64,
    target: &Target,
    request: &Outgoing,
    written: impl Fn(Instant),
) -> Result<Answer, CallError> {
    // Not borrowed across the connect: other requests on this shard use the pool meanwhile.
    let pooled = pool.borrow_mut().take(instance);
    let mut conn = match pooled {
        Some(c) => c,
        None => Conn::open(target).await?,
    };
    let answer = match conn.call(request, &written).await {
        Err(CallError::Closed | CallError::Io(_)) if conn.reused => {
            conn = Conn::open(target).await?;
            conn.call(request, &written).await?
        }
        r => r?,
    };
    if !answer.close {
        pool.borrow_mut().put(instance, conn);
    }
    Ok(answer)
}

impl Transport for FunctionTransport {
    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        Ok(LinkLimits {
            window: self.window,
            pack_limit: usize::MAX,
            keep_alive: None,
        })
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let Unit::Message { msg, .. } = unit else {
            return Err(Unsendable::Invalid(
                "a SenML pack cannot go to a function".into(),
            ));
        };
        self.handle.note_arrival();
        self.next_id += 1;
        let id = SendId(self.next_id);
        let time = SystemTime::now() - msg.received_at.elapsed();
        // The event's headers straight from the message (no CloudEvent strings first).
        let headers = cloudevents::message_header_map(
            &self.host,
            &self.gateway,
            &msg.device,
            &msg.topic,
            &self.id_prefix,
            self.next_id,
            time,
            cloudevents::content_type_of(msg.content_type.as_deref(), &msg.payload),
        );
        let request = Rc::new(Outgoing {
            path: self.uri.clone(),
            headers,
            body: msg.payload.clone(),
        });
        self.jobs.insert(
            id,
            Job {
                request,
                body: msg.payload.clone(),
                device: msg.device.clone(),
                topic: msg.topic.clone(),
                qos: msg.qos,
                received_at: msg.received_at,
                attempts: 0,
                ready_since: Instant::now(),
            },
        );
        self.ready.push_back(id);
        Ok(Some(id))
    }

    fn pending_bytes(&self) -> usize {
        0
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        self.dispatch();
        Ok(())
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        if !self.feedback.is_empty() || !self.overflow.msgs.borrow().is_empty() {
            self.take_overflow();
            feedback.append(&mut self.feedback);
            return Ok(());
        }
        self.due_retries();
        self.dispatch();
        self.expire_waiting();
        let handle = self.handle.clone();
        let changed = handle.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        // A slot may have freed between dispatch and enable: try once more.
        if !self.ready.is_empty() {
            self.dispatch();
        }
        let next_retry = self.retries.peek().map(|r| r.0 .0);
        let next_retry = match (next_retry, self.wait_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let waiting = !self.ready.is_empty();
        let overflow = self.overflow.clone();
        tokio::select! {
            Some(done) = self.done_rx.recv() => {
                self.on_done(done);
                while let Ok(done) = self.done_rx.try_recv() {
                    self.on_done(done);
                }
            }
            _ = async {
                match next_retry {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => {
                self.due_retries();
                self.expire_waiting();
            }
            _ = self.sweep.as_mut(), if self.sweep_at.is_some() => {
                self.expire_running();
            }
            _ = changed, if waiting => {}
            _ = overflow.wake.notified() => {}
        }
        self.take_overflow();
        feedback.append(&mut self.feedback);
        Ok(())
    }

    async fn settle(&mut self) -> Result<(), UplinkError> {
        for msg in std::mem::take(&mut self.outgoing) {
            (self.publish)(msg).await;
        }
        Ok(())
    }

    async fn close(&mut self) {}

    fn abort(&mut self) {
        // Every job is requeued by the outbox on reconnect; requests under way finish in their
        // tasks and are then unknown ids (ignored).
        self.jobs.clear();
        self.ready.clear();
        self.retries.clear();
        self.running.clear();
        self.sync_waiting();
    }
}

impl Drop for FunctionTransport {
    fn drop(&mut self) {
        self.ready.clear();
        self.sync_waiting();
    }
}
