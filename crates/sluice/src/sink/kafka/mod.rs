//! The Kafka transport: device messages become records in an Apache Kafka cluster, produced
//! with `acks = all` by the idempotent producer. The fourth [`Transport`] behind an outbox,
//! for `protocol = "kafka"` uplinks. Why our own producer on the `kafka-protocol` codec (for
//! requests and record batches; the answers are decoded by our own bounded decoders,
//! `answers.rs`) and not librdkafka: docs/adr/0017-kafka-client.md.
//!
//! Owns: the connections to the cluster (one to a bootstrap broker for cluster requests, one
//! per partition leader for records), the cluster's metadata as far as this transport needs
//! it (leaders of the topics it writes), the producer id, epoch and a sequence number per
//! partition, batching the records of one flush into one Produce request per leader (one
//! record batch per partition), and mapping Kafka's error codes to [`Feedback`]
//! (`wire::classify`). Does not own: queueing, windowing, order across reconnects, retry or
//! the spool (the outbox's), or which topic a message goes to beyond rendering the template.
//!
//! # A record
//! Key: the device id, so one device's records go to one partition (Kafka's default
//! partitioner, `partitioner.rs`: the partition any Kafka client picks for that key) and stay
//! in order there. Value: the payload, unchanged. Headers: the device's MQTT 5 User Properties
//! (name and value as given; a name given twice keeps its last value, as Kafka's record type
//! here holds headers as a map), then `mqtt_topic` (the local topic) and, when the device gave
//! one, `content_type` (these two win a clash with a user property). Timestamp: when the transport encoded it (create
//! time). Topic: the template with `{topic}` replaced by the local topic with `/` as `.`.
//!
//! # Delivery and order
//! A message is acknowledged ([`Feedback::Acked`]) only when the partition leader answered its
//! batch with no error, after `acks = all` (every in-sync replica has it). QoS 0 messages go
//! the same way and also finish on the answer. At most [`MAX_INFLIGHT_PER_PARTITION`] batches
//! of a partition are unanswered at once (the idempotent producer's limit, which keeps their
//! order across broker retries). When the cluster changes under the transport (a leader moved,
//! a broker died, too few replicas, the producer id or a sequence no longer known:
//! `wire::Outcome::Reconnect`), the connection as a whole ends with an error: the outbox
//! requeues every unanswered message in order, connects again (a new producer id, sequences
//! from 0, the metadata read again) and resends them. At-least-once: a resent record may be
//! stored twice; a device's records stay in order.
//!
//! # Bounds
//! Responses above `wire::MAX_RESPONSE` end the connection. Records are held only between
//! `encode` and `flush` (the outbox bounds them by its batch bytes) and, as ids, until their
//! batch is answered (bounded by the outbox's window). The topic table holds at most
//! [`MAX_TOPICS`] topics; beyond that it is cleared and learnt again.

pub mod answers;
mod conn;
mod params;
pub mod partitioner;
mod produce;
pub mod scram;
pub mod wire;

pub use params::{KafkaParams, SaslParams};

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use kafka_protocol::indexmap::IndexMap;
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::{
    ApiKey, InitProducerIdRequest, MetadataRequest, ProducerId, TopicName,
};
use kafka_protocol::protocol::StrBytes;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::sink::transport::{Feedback, LinkLimits, SendId, Transport, Unit, Unsendable};
use crate::sink::{UplinkError, UplinkMessage};
use answers::{Answer, InitProducerIdAnswer, MetadataAnswer, ProduceAnswer};
use conn::{write_out, Call};
use wire::WireError;

/// Batches of one partition unanswered at once (Kafka's limit for the idempotent producer).
pub const MAX_INFLIGHT_PER_PARTITION: usize = 5;
/// Topics whose leaders the transport remembers (the topic template may name many).
pub const MAX_TOPICS: usize = 4096;
/// The pause before asking again for a topic whose metadata was unusable.
pub const METADATA_RETRY: Duration = Duration::from_millis(200);
/// The largest Kafka topic name.
pub const MAX_TOPIC_LEN: usize = 249;

/// Start the outbox of one Kafka uplink lane on this shard. Must be called inside a
/// `LocalSet`. Runs until `shutdown`.
pub fn spawn(
    seed: crate::sink::SessionSeed,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let transport = KafkaTransport::new(KafkaParams::from_config(
        &seed.cfg,
        seed.shard,
        seed.tls.clone(),
    ));
    let outbox =
        crate::sink::outbox::Outbox::new(crate::sink::outbox::OutboxSeed::from(seed), transport);
    tokio::task::spawn_local(outbox.run(shutdown))
}

trait Io: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> Io for T {}

/// A request written and not yet answered, in the order written (Kafka answers in order).
enum Waiting {
    Metadata,
    Produce(Vec<SentBatch>),
}

struct SentBatch {
    topic: Arc<str>,
    partition: i32,
    ids: Vec<SendId>,
}

#[derive(Default)]
struct Conn {
    io: Option<Box<dyn Io>>,
    out: BytesMut,
    rbuf: BytesMut,
    waiting: VecDeque<(i32, Waiting, Instant)>,
}

struct Pending {
    id: SendId,
    key: Bytes,
    value: Bytes,
    headers: IndexMap<StrBytes, Option<Bytes>>,
    timestamp: i64,
}

#[derive(Default)]
struct PartitionState {
    /// The next sequence number (idempotent producer), from 0 for each producer id.
    sequence: i32,
    inflight: usize,
    ready: Vec<Pending>,
}

struct TopicState {
    name: Arc<str>,
    /// Leader broker id of each partition, by partition index.
    leaders: Vec<i32>,
    partitions: Vec<PartitionState>,
}

/// The producer (see the module docs).
pub struct KafkaTransport {
    params: KafkaParams,
    client_id: StrBytes,
    /// The bootstrap connection (Metadata requests).
    control: Conn,
    brokers: HashMap<i32, (String, Conn)>,
    topics: HashMap<Arc<str>, TopicState>,
    /// Records of topics whose metadata was asked for and not yet known.
    unrouted: HashMap<Arc<str>, Vec<Pending>>,
    metadata_asked: bool,
    /// When to ask again for topics whose metadata came back unusable (a topic being
    /// created answers LEADER_NOT_AVAILABLE for a moment).
    metadata_retry_at: Option<Instant>,
    producer_id: i64,
    epoch: i16,
    next_corr: i32,
    next_id: u64,
    ready_bytes: usize,
    scratch: Box<[u8]>,
    /// `topic` has no `{topic}`: every message goes to the same Kafka topic.
    fixed_topic: bool,
    /// The template's last rendering (local topic, Kafka topic), so a run of messages on one
    /// topic (or any message, with a fixed topic) renders and checks it once.
    last_topic: Option<(ByteString, Arc<str>)>,
}

impl KafkaTransport {
    pub fn new(params: KafkaParams) -> KafkaTransport {
        KafkaTransport {
            client_id: StrBytes::from_string(params.client_id.clone()),
            control: Conn::default(),
            brokers: HashMap::new(),
            topics: HashMap::new(),
            unrouted: HashMap::new(),
            metadata_asked: false,
            metadata_retry_at: None,
            producer_id: -1,
            epoch: -1,
            next_corr: 0,
            next_id: 0,
            ready_bytes: 0,
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
            fixed_topic: !params.topic.contains("{topic}"),
            last_topic: None,
            params,
        }
    }

    /// [`Self::topic_for`] of `local`, rendered again only when it differs from the last.
    fn kafka_topic(&mut self, local: &ByteString) -> Result<Arc<str>, Unsendable> {
        if let Some((last, topic)) = &self.last_topic {
            if self.fixed_topic || last == local {
                return Ok(topic.clone());
            }
        }
        let topic: Arc<str> = Arc::from(Self::topic_for(&self.params.topic, local)?);
        self.last_topic = Some((local.clone(), topic.clone()));
        Ok(topic)
    }

    /// The topic a message goes to: the template rendered, checked against Kafka's rules.
    pub fn topic_for(template: &str, local_topic: &str) -> Result<String, Unsendable> {
        let topic = template.replace("{topic}", &local_topic.replace('/', "."));
        let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if topic.is_empty()
            || topic.len() > MAX_TOPIC_LEN
            || topic == "."
            || topic == ".."
            || !topic.chars().all(legal)
        {
            return Err(Unsendable::Invalid(format!(
                "{topic:?} is not a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -)"
            )));
        }
        Ok(topic)
    }

    fn corr(&mut self) -> i32 {
        self.next_corr = self.next_corr.wrapping_add(1);
        self.next_corr
    }

    /// One request on the control connection and its answer, waited for (while connecting;
    /// the request goes out as the answer's api key and version).
    async fn call<Req, Resp>(&mut self, req: &Req, what: &'static str) -> Result<Resp, UplinkError>
    where
        Req: kafka_protocol::protocol::Encodable + kafka_protocol::protocol::HeaderVersion,
        Resp: Answer,
    {
        let corr = self.corr();
        let conn = &mut self.control;
        let io = conn.io.as_mut().ok_or(UplinkError::ClosedByCloud)?;
        let call = Call {
            client_id: &self.client_id,
            timeout: self.params.request_timeout,
        };
        call.exchange(io, &mut conn.rbuf, corr, req, what).await
    }

    /// Learn the leaders of `topics` from a Metadata answer.
    fn learn(&mut self, meta: MetadataAnswer) {
        for b in &meta.brokers {
            let addr = if b.host.contains(':') {
                format!("[{}]:{}", b.host, b.port)
            } else {
                format!("{}:{}", b.host, b.port)
            };
            let entry = self
                .brokers
                .entry(b.node_id)
                .or_insert_with(|| (addr.clone(), Conn::default()));
            if entry.0 != addr {
                *entry = (addr, Conn::default());
            }
        }
        if self.topics.len() + meta.topics.len() > MAX_TOPICS {
            self.topics.clear();
        }
        for t in meta.topics {
            let Some(name) = t.name else { continue };
            let name: Arc<str> = Arc::from(name);
            let waiting = self.unrouted.remove(&name);
            if t.error_code != 0 || t.partitions.is_empty() {
                // Asked again with the next record of this topic.
                tracing::debug!(topic = %name, error_code = t.error_code, "Kafka has no usable metadata for this topic yet");
                if let Some(w) = waiting {
                    self.unrouted.insert(name, w);
                    self.metadata_retry_at = Some(Instant::now() + METADATA_RETRY);
                }
                continue;
            }
            let mut leaders = vec![-1; t.partitions.len()];
            for p in &t.partitions {
                if let Some(l) = leaders.get_mut(p.partition_index as usize) {
                    *l = p.leader_id;
                }
            }
            let n = leaders.len();
            let state = self
                .topics
                .entry(name.clone())
                .or_insert_with(|| TopicState {
                    name: name.clone(),
                    leaders: Vec::new(),
                    partitions: Vec::new(),
                });
            state.leaders = leaders;
            state.partitions.resize_with(n, PartitionState::default);
            for rec in waiting.into_iter().flatten() {
                let p = partitioner::partition_for(&rec.key, n);
                self.ready_bytes += rec.key.len() + rec.value.len();
                state.partitions[p].ready.push(rec);
            }
        }
        self.metadata_asked = false;
    }

    /// Encode a Metadata request for the topics still unrouted into the control connection.
    fn ask_metadata(&mut self) -> Result<(), UplinkError> {
        if self.metadata_asked || self.metadata_retry_at.is_some() || self.unrouted.is_empty() {
            return Ok(());
        }
        let mut req = MetadataRequest::default();
        req.allow_auto_topic_creation = true;
        req.topics = Some(
            self.unrouted
                .keys()
                .map(|t| {
                    let mut mt = MetadataRequestTopic::default();
                    mt.name = Some(TopicName(StrBytes::from_string(t.to_string())));
                    mt
                })
                .collect(),
        );
        let corr = self.corr();
        wire::encode_request(
            &mut self.control.out,
            ApiKey::Metadata,
            wire::METADATA_V,
            corr,
            &self.client_id,
            &req,
        )
        .map_err(protocol)?;
        self.control
            .waiting
            .push_back((corr, Waiting::Metadata, Instant::now()));
        self.metadata_asked = true;
        Ok(())
    }

    /// Handle every complete answer buffered on a connection (`None`: the control one).
    fn take_answers(
        &mut self,
        broker: Option<i32>,
        feedback: &mut Vec<Feedback>,
    ) -> Result<(), UplinkError> {
        loop {
            let conn = match broker {
                None => &mut self.control,
                Some(b) => match self.brokers.get_mut(&b) {
                    Some((_, c)) => c,
                    None => return Ok(()),
                },
            };
            let Some(frame) = wire::next_frame(&mut conn.rbuf).map_err(protocol)? else {
                return Ok(());
            };
            let corr = wire::peek_correlation_id(&frame).map_err(protocol)?;
            let Some((expected, waiting, _)) = conn.waiting.pop_front() else {
                return Err(UplinkError::Protocol(
                    "the Kafka broker answered a request never sent".into(),
                ));
            };
            if corr != expected {
                return Err(UplinkError::Protocol(format!(
                    "the Kafka broker answered request {corr} where {expected} was due"
                )));
            }
            match waiting {
                Waiting::Metadata => {
                    let meta: MetadataAnswer =
                        wire::decode_response(&frame, "metadata").map_err(protocol)?;
                    self.learn(meta);
                }
                Waiting::Produce(sent) => {
                    let resp: ProduceAnswer =
                        wire::decode_response(&frame, "produce answer").map_err(protocol)?;
                    self.on_produced(sent, resp, feedback)?;
                }
            }
        }
    }

    /// The oldest unanswered request's deadline.
    fn deadline(&self) -> Option<Instant> {
        std::iter::once(&self.control)
            .chain(self.brokers.values().map(|(_, c)| c))
            .filter_map(|c| c.waiting.front().map(|w| w.2 + self.params.request_timeout))
            .min()
    }
}

fn protocol(e: WireError) -> UplinkError {
    UplinkError::Protocol(e.to_string())
}

fn to_io(e: WireError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

impl Transport for KafkaTransport {
    async fn connect(&mut self) -> Result<LinkLimits, UplinkError> {
        self.abort();
        let mut last = None;
        for addr in self.params.brokers.clone() {
            match self.dial(&addr).await {
                Ok(io) => {
                    self.control.io = Some(io);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if self.control.io.is_none() {
            return Err(last.unwrap_or(UplinkError::ClosedByCloud));
        }
        // The brokers and their addresses (no topics: those are asked as they are needed).
        let mut req = MetadataRequest::default();
        req.topics = Some(Vec::new());
        let meta: MetadataAnswer = self.call(&req, "metadata").await?;
        self.learn(meta);
        let mut init = InitProducerIdRequest::default();
        // Not transactional: null (kafka-protocol's default is the empty string, which the
        // broker answers with INVALID_REQUEST).
        init.transactional_id = None;
        init.transaction_timeout_ms = 60_000;
        init.producer_id = ProducerId(-1);
        init.producer_epoch = -1;
        // A cluster just started answers COORDINATOR_LOAD_IN_PROGRESS (14) or
        // COORDINATOR_NOT_AVAILABLE (15) for a while: retriable codes are asked again, with
        // a growing pause, within the request timeout.
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
        let resp = loop {
            let resp: InitProducerIdAnswer = self.call(&init, "producer id answer").await?;
            use kafka_protocol::error::ParseResponseErrorCode;
            let retriable = resp.error_code.err().is_some_and(|e| e.is_retriable());
            if resp.error_code == 0
                || !retriable
                || started.elapsed() + pause > self.params.request_timeout
            {
                break resp;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        };
        if resp.error_code != 0 {
            return Err(UplinkError::Protocol(format!(
                "Kafka refused a producer id: error {}",
                resp.error_code
            )));
        }
        self.producer_id = resp.producer_id;
        self.epoch = resp.producer_epoch;
        Ok(LinkLimits {
            window: self.params.window.max(1),
            pack_limit: usize::MAX,
            keep_alive: None,
        })
    }

    fn encode(&mut self, unit: Unit<'_>) -> Result<Option<SendId>, Unsendable> {
        let msg: &UplinkMessage = match unit {
            Unit::Message { msg, .. } => msg,
            Unit::Pack { .. } => {
                return Err(Unsendable::Invalid(
                    "SenML packs cannot go to Kafka (aggregation is refused by the config)".into(),
                ))
            }
        };
        let topic = self.kafka_topic(&msg.topic)?;
        self.next_id += 1;
        let id = SendId(self.next_id);
        let mut headers = IndexMap::new();
        // The device's MQTT 5 User Properties first, so the two below win a name clash.
        // (A ByteString is UTF-8, so `from_utf8` only re-checks it, sharing the buffer.)
        for (name, value) in msg.user_properties.iter().flat_map(|p| p.iter()) {
            if let Ok(name) = StrBytes::from_utf8(name.as_bytes().clone()) {
                headers.insert(name, Some(value.as_bytes().clone()));
            }
        }
        headers.insert(
            StrBytes::from_static_str("mqtt_topic"),
            Some(msg.topic.as_bytes().clone()),
        );
        if let Some(ct) = &msg.content_type {
            headers.insert(
                StrBytes::from_static_str("content_type"),
                Some(ct.as_bytes().clone()),
            );
        }
        let rec = Pending {
            id,
            key: msg.device.as_bytes().clone(),
            value: msg.payload.clone(),
            headers,
            timestamp: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64),
        };
        match self.topics.get_mut(&topic) {
            Some(state) => {
                let p = partitioner::partition_for(&rec.key, state.partitions.len());
                self.ready_bytes += rec.key.len() + rec.value.len();
                state.partitions[p].ready.push(rec);
            }
            None => {
                self.unrouted.entry(topic).or_default().push(rec);
                // The control connection's pending bytes now hold the Metadata request.
                if self.ask_metadata().is_err() {
                    return Err(Unsendable::Invalid("cannot ask Kafka for metadata".into()));
                }
            }
        }
        Ok(Some(id))
    }

    fn pending_bytes(&self) -> usize {
        self.ready_bytes
            + self.control.out.len()
            + self
                .brokers
                .values()
                .map(|(_, c)| c.out.len())
                .sum::<usize>()
    }

    async fn flush(&mut self) -> Result<(), UplinkError> {
        self.ask_metadata()?;
        self.build_produce()?;
        let timeout = self.params.request_timeout;
        if !self.control.out.is_empty() {
            let io = self.control.io.as_mut().ok_or(UplinkError::ClosedByCloud)?;
            write_out(io, &mut self.control.out, timeout).await?;
        }
        let ids: Vec<i32> = self
            .brokers
            .iter()
            .filter(|(_, (_, c))| !c.out.is_empty())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if self.brokers[&id].1.io.is_none() {
                let addr = self.brokers[&id].0.clone();
                let io = self.dial(&addr).await?;
                self.brokers.get_mut(&id).expect("listed").1.io = Some(io);
            }
            let conn = &mut self.brokers.get_mut(&id).expect("listed").1;
            let io = conn.io.as_mut().expect("opened above");
            write_out(io, &mut conn.out, timeout).await?;
        }
        Ok(())
    }

    async fn poll(&mut self, feedback: &mut Vec<Feedback>) -> Result<(), UplinkError> {
        let deadline = self.deadline();
        let scratch = &mut self.scratch;
        let control = &mut self.control;
        let brokers = &mut self.brokers;
        let read = std::future::poll_fn(|cx| {
            use std::task::Poll;
            let mut try_read = |conn: &mut Conn| -> Poll<std::io::Result<usize>> {
                let Some(io) = conn.io.as_mut() else {
                    return Poll::Pending;
                };
                let mut buf = tokio::io::ReadBuf::new(&mut scratch[..]);
                match std::pin::Pin::new(io).poll_read(cx, &mut buf) {
                    Poll::Ready(Ok(())) => {
                        let n = buf.filled().len();
                        conn.rbuf.extend_from_slice(buf.filled());
                        Poll::Ready(Ok(n))
                    }
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                }
            };
            if let Poll::Ready(r) = try_read(control) {
                return Poll::Ready((None, r));
            }
            for (id, (_, conn)) in brokers.iter_mut() {
                if let Poll::Ready(r) = try_read(conn) {
                    return Poll::Ready((Some(*id), r));
                }
            }
            Poll::Pending
        });
        let retry_at = self.metadata_retry_at;
        let (which, r) = tokio::select! {
            x = read => x,
            _ = sleep_until_opt(deadline), if deadline.is_some() => {
                return Err(UplinkError::ResponseTimeout(self.params.request_timeout));
            }
            _ = sleep_until_opt(retry_at), if retry_at.is_some() => {
                // The request goes out with the next flush (pending bytes).
                self.metadata_retry_at = None;
                return self.ask_metadata();
            }
        };
        match r {
            Ok(0) => {
                let conn = match which {
                    None => &mut self.control,
                    Some(b) => &mut self.brokers.get_mut(&b).expect("read from it").1,
                };
                conn.io = None;
                if conn.waiting.is_empty() && which.is_some() {
                    // An idle leader connection closed (the broker's idle timeout): the
                    // next batch for it opens it again.
                    return Ok(());
                }
                Err(UplinkError::ClosedByCloud)
            }
            Ok(_) => self.take_answers(which, feedback),
            Err(e) => Err(UplinkError::ConnectionLost(e)),
        }
    }

    fn abort(&mut self) {
        self.control = Conn::default();
        self.brokers.clear();
        self.topics.clear();
        self.unrouted.clear();
        self.metadata_asked = false;
        self.metadata_retry_at = None;
        self.ready_bytes = 0;
        self.producer_id = -1;
        self.epoch = -1;
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_render_with_slashes_as_dots_and_bad_names_are_unsendable() {
        assert_eq!(
            KafkaTransport::topic_for("{topic}", "site/dev-1/temp").unwrap(),
            "site.dev-1.temp"
        );
        assert_eq!(
            KafkaTransport::topic_for("iot-telemetry", "a/b").unwrap(),
            "iot-telemetry"
        );
        assert_eq!(
            KafkaTransport::topic_for("sluice.{topic}", "x").unwrap(),
            "sluice.x"
        );
        for bad in ["a b", "a+b", "ä", ""] {
            assert!(
                KafkaTransport::topic_for("{topic}", bad).is_err(),
                "{bad:?} must be refused"
            );
        }
        assert!(KafkaTransport::topic_for("{topic}", &"x".repeat(250)).is_err());
    }

    #[test]
    fn the_rendered_topic_is_reused_while_it_cannot_differ() {
        let transport = |topic: &str| {
            KafkaTransport::new(KafkaParams {
                brokers: vec!["127.0.0.1:9092".into()],
                topic: topic.into(),
                compression: kafka_protocol::records::Compression::None,
                tls: None,
                server_name: None,
                client_id: "t".into(),
                request_timeout: Duration::from_secs(1),
                window: 1,
                sasl: None,
            })
        };
        let mut fixed = transport("iot");
        let a = fixed.kafka_topic(&"a/b".into()).unwrap();
        let b = fixed.kafka_topic(&"c/d".into()).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "a fixed topic is rendered once");
        let mut per_topic = transport("{topic}");
        let a = per_topic.kafka_topic(&"a/b".into()).unwrap();
        let again = per_topic.kafka_topic(&"a/b".into()).unwrap();
        assert!(Arc::ptr_eq(&a, &again));
        assert_eq!(&*per_topic.kafka_topic(&"c/d".into()).unwrap(), "c.d");
        assert!(per_topic.kafka_topic(&"bad topic".into()).is_err());
        assert_eq!(&*per_topic.kafka_topic(&"a/b".into()).unwrap(), "a.b");
    }
}
