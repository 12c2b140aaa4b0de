//! Produce requests: the ready records of each partition with room for another batch in
//! flight become one record batch, the batches of one leader one Produce request
//! ([`KafkaTransport::build_produce`]); a Produce answer becomes feedback for every record of
//! each batch, or ends the connection when the cluster changed
//! ([`KafkaTransport::on_produced`]).

use std::collections::HashMap;
use std::time::Instant;

use bytes::BytesMut;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{ApiKey, ProduceRequest, TopicName};
use kafka_protocol::protocol::StrBytes;
use kafka_protocol::records::{Record, RecordBatchEncoder, RecordEncodeOptions, TimestampType};

use super::answers::ProduceAnswer;
use super::wire::{self, Outcome, WireError};
use super::{protocol, KafkaTransport, SentBatch, Waiting, MAX_INFLIGHT_PER_PARTITION};
use crate::sink::transport::Feedback;
use crate::sink::UplinkError;

impl KafkaTransport {
    /// Move ready records into one Produce request per leader (a record batch per partition
    /// with room for another batch in flight).
    pub(super) fn build_produce(&mut self) -> Result<(), UplinkError> {
        let opts = RecordEncodeOptions {
            version: 2,
            compression: self.params.compression,
        };
        let mut per_leader: HashMap<i32, (ProduceRequest, Vec<SentBatch>)> = HashMap::new();
        for state in self.topics.values_mut() {
            for (p, part) in state.partitions.iter_mut().enumerate() {
                if part.ready.is_empty() || part.inflight >= MAX_INFLIGHT_PER_PARTITION {
                    continue;
                }
                let leader = state.leaders[p];
                if leader < 0 || !self.brokers.contains_key(&leader) {
                    return Err(UplinkError::Protocol(format!(
                        "partition {p} of Kafka topic {} has no leader now",
                        state.name
                    )));
                }
                // The ready records move into the batch (on an error the connection ends and
                // the outbox resends them all).
                let mut ids = Vec::with_capacity(part.ready.len());
                let mut records = Vec::with_capacity(part.ready.len());
                for (i, r) in part.ready.drain(..).enumerate() {
                    self.ready_bytes -= r.key.len() + r.value.len();
                    ids.push(r.id);
                    records.push(Record {
                        transactional: false,
                        control: false,
                        delete_horizon: false,
                        partition_leader_epoch: -1,
                        producer_id: self.producer_id,
                        producer_epoch: self.epoch,
                        timestamp_type: TimestampType::Creation,
                        offset: i as i64,
                        sequence: part.sequence.wrapping_add(i as i32),
                        timestamp: r.timestamp,
                        key: Some(r.key),
                        value: Some(r.value),
                        headers: r.headers,
                    });
                }
                let mut batch = BytesMut::new();
                RecordBatchEncoder::encode(&mut batch, &records, &opts).map_err(|e| {
                    protocol(WireError::Encode {
                        what: "record batch",
                        detail: e.to_string(),
                    })
                })?;
                part.sequence = part.sequence.wrapping_add(records.len() as i32);
                part.inflight += 1;
                let (req, sent) = per_leader.entry(leader).or_insert_with(|| {
                    let mut req = ProduceRequest::default();
                    req.transactional_id = None;
                    req.acks = -1;
                    req.timeout_ms = self
                        .params
                        .request_timeout
                        .as_millis()
                        .min(i32::MAX as u128) as i32;
                    (req, Vec::new())
                });
                let mut pd = PartitionProduceData::default();
                pd.index = p as i32;
                pd.records = Some(batch.freeze());
                match req
                    .topic_data
                    .iter_mut()
                    .find(|t| t.name.0.as_str() == &*state.name)
                {
                    Some(t) => t.partition_data.push(pd),
                    None => {
                        let mut td = TopicProduceData::default();
                        td.name = TopicName(StrBytes::from_string(state.name.to_string()));
                        td.partition_data.push(pd);
                        req.topic_data.push(td);
                    }
                }
                sent.push(SentBatch {
                    topic: state.name.clone(),
                    partition: p as i32,
                    ids,
                });
            }
        }
        for (leader, (req, sent)) in per_leader {
            self.next_corr = self.next_corr.wrapping_add(1);
            let corr = self.next_corr;
            let conn = &mut self.brokers.get_mut(&leader).expect("checked above").1;
            wire::encode_request(
                &mut conn.out,
                ApiKey::Produce,
                wire::PRODUCE_V,
                corr,
                &self.client_id,
                &req,
            )
            .map_err(protocol)?;
            conn.waiting
                .push_back((corr, Waiting::Produce(sent), Instant::now()));
        }
        Ok(())
    }

    pub(super) fn on_produced(
        &mut self,
        sent: Vec<SentBatch>,
        resp: ProduceAnswer,
        feedback: &mut Vec<Feedback>,
    ) -> Result<(), UplinkError> {
        for batch in sent {
            if let Some(part) = self
                .topics
                .get_mut(&batch.topic)
                .and_then(|t| t.partitions.get_mut(batch.partition as usize))
            {
                part.inflight = part.inflight.saturating_sub(1);
            }
            let answer = resp
                .topics
                .iter()
                .filter(|t| t.name == *batch.topic)
                .flat_map(|t| t.partitions.iter())
                .find(|p| p.index == batch.partition);
            let Some(answer) = answer else {
                return Err(UplinkError::Protocol(format!(
                    "the Kafka broker's produce answer left out partition {} of {}",
                    batch.partition, batch.topic
                )));
            };
            if answer.error_code == 0 {
                feedback.extend(batch.ids.into_iter().map(Feedback::Acked));
                continue;
            }
            match wire::classify(answer.error_code) {
                Outcome::Reconnect => {
                    return Err(UplinkError::Protocol(format!(
                        "Kafka answered error {} for partition {} of {} (the cluster changed; reconnecting)",
                        answer.error_code, batch.partition, batch.topic
                    )));
                }
                Outcome::Refuse { code, class } => {
                    tracing::warn!(topic = %batch.topic, partition = batch.partition, error_code = answer.error_code,
                        error_message = answer.error_message.as_deref().unwrap_or(""), "Kafka refused records");
                    feedback.extend(batch.ids.into_iter().map(|id| Feedback::Refused {
                        id,
                        code,
                        class,
                    }));
                }
            }
        }
        Ok(())
    }
}
