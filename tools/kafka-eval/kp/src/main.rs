//! Producer rate of a minimal own client on the `kafka-protocol` codec: Metadata,
//! InitProducerId (idempotent), Produce v9 acks=all lz4 to each partition's leader, one
//! request per leader per window, all leaders at once.
#[path = "../../cpu.rs"]
mod cpu;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use indexmap::IndexMap;
use kafka_protocol::messages::*;
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, StrBytes};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::records::{Compression, Record, RecordBatchEncoder, RecordEncodeOptions, TimestampType};
use std::collections::HashMap;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Conn { s: TcpStream, corr: i32 }

impl Conn {
    async fn call<R: Encodable + HeaderVersion>(&mut self, key: ApiKey, ver: i16, req: &R) -> BytesMut {
        self.corr += 1;
        let mut body = BytesMut::new();
        let mut h = RequestHeader::default();
        h.request_api_key = key as i16;
        h.request_api_version = ver;
        h.correlation_id = self.corr;
        h.client_id = Some(StrBytes::from_static_str("keval"));
        h.encode(&mut body, R::header_version(ver)).unwrap();
        req.encode(&mut body, ver).unwrap();
        let mut frame = BytesMut::with_capacity(body.len() + 4);
        frame.put_u32(body.len() as u32);
        frame.extend_from_slice(&body);
        self.s.write_all(&frame).await.unwrap();
        let n = self.s.read_u32().await.unwrap() as usize;
        let mut resp = BytesMut::zeroed(n);
        self.s.read_exact(&mut resp).await.unwrap();
        let hv = key.response_header_version(ver);
        let rh = ResponseHeader::decode(&mut resp, hv).unwrap();
        assert_eq!(rh.correlation_id, self.corr);
        resp
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (bootstrap, topic, n, size, window): (&str, &str, usize, usize, usize) =
        (&a[1], &a[2], a[3].parse().unwrap(), a[4].parse().unwrap(), a[5].parse().unwrap());
    let first = bootstrap.split(',').next().unwrap();
    let mut c = Conn { s: TcpStream::connect(first).await.unwrap(), corr: 0 };
    let mut mreq = MetadataRequest::default();
    let mut t = MetadataRequestTopic::default();
    t.name = Some(TopicName(StrBytes::from_string(topic.to_string())));
    mreq.topics = Some(vec![t]);
    let mut buf = c.call(ApiKey::Metadata, 12, &mreq).await;
    let meta = MetadataResponse::decode(&mut buf, 12).unwrap();
    let brokers: HashMap<i32, String> = meta.brokers.iter().map(|b| (b.node_id.0, format!("{}:{}", b.host, b.port))).collect();
    let parts: Vec<(i32, i32)> = meta.topics[0].partitions.iter().map(|p| (p.partition_index, p.leader_id.0)).collect();
    let iv: i16 = 4;
    let mut ireq = InitProducerIdRequest::default();
    ireq.transaction_timeout_ms = 60_000;
    // Not transactional: null (kafka-protocol's default is the empty string, which the
    // broker answers with INVALID_REQUEST).
    ireq.transactional_id = None;
    ireq.producer_id = ProducerId(-1);
    ireq.producer_epoch = -1;
    let mut buf = c.call(ApiKey::InitProducerId, iv, &ireq).await;
    let init = InitProducerIdResponse::decode(&mut buf, iv).unwrap();
    assert_eq!(init.error_code, 0, "InitProducerId");
    let (pid, epoch) = (init.producer_id.0, init.producer_epoch);
    let mut conns: HashMap<i32, Conn> = HashMap::new();
    for (_, leader) in &parts {
        if !conns.contains_key(leader) {
            conns.insert(*leader, Conn { s: TcpStream::connect(&brokers[leader]).await.unwrap(), corr: 0 });
        }
    }
    let np = parts.len();
    let mut seq = vec![0i32; np];
    let payload = Bytes::from(vec![b'x'; size]);
    let keys: Vec<Bytes> = (0..1024).map(|i| Bytes::from(format!("dev-{i}"))).collect();
    let opts = RecordEncodeOptions { version: 2, compression: Compression::Lz4 };
    let (c0, t0) = (cpu::cpu_s(), Instant::now());
    let mut failed = 0;
    let mut i = 0;
    while i < n {
        let end = (i + window).min(n);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        let mut per: Vec<Vec<Record>> = (0..np).map(|_| Vec::new()).collect();
        for j in i..end {
            let p = (j % 1024) % np;
            let mut headers = IndexMap::new();
            headers.insert(StrBytes::from_static_str("mqtt_topic"), Some(Bytes::from_static(b"site/dev/temp")));
            let k = per[p].len();
            per[p].push(Record {
                transactional: false, control: false, delete_horizon: false,
                partition_leader_epoch: -1, producer_id: pid, producer_epoch: epoch,
                timestamp_type: TimestampType::Creation, offset: k as i64,
                sequence: seq[p] + k as i32, timestamp: now,
                key: Some(keys[j % 1024].clone()), value: Some(payload.clone()), headers,
            });
        }
        // One ProduceRequest per leader.
        let mut reqs: HashMap<i32, ProduceRequest> = HashMap::new();
        for (p, recs) in per.iter().enumerate() {
            if recs.is_empty() { continue; }
            let mut b = BytesMut::new();
            RecordBatchEncoder::encode(&mut b, recs, &opts).unwrap();
            seq[p] += recs.len() as i32;
            let leader = parts[p].1;
            let r = reqs.entry(leader).or_insert_with(|| {
                let mut r = ProduceRequest::default();
                r.acks = -1;
                r.transactional_id = None;
                r.timeout_ms = 30_000;
                let mut td = TopicProduceData::default();
                td.name = TopicName(StrBytes::from_string(topic.to_string()));
                r.topic_data = vec![td];
                r
            });
            let mut pd = PartitionProduceData::default();
            pd.index = parts[p].0;
            pd.records = Some(b.freeze());
            r.topic_data[0].partition_data.push(pd);
        }
        let mut futs = Vec::new();
        for (leader, conn) in conns.iter_mut() {
            if let Some(r) = reqs.remove(leader) {
                futs.push(async move {
                    let mut buf = conn.call(ApiKey::Produce, 9, &r).await;
                    ProduceResponse::decode(&mut buf, 9).unwrap()
                });
            }
        }
        for resp in futures::future::join_all(futs).await {
            for t in &resp.responses { for p in &t.partition_responses { if p.error_code != 0 { failed += 1; eprintln!("error {}", p.error_code); } } }
        }
        i = end;
    }
    let _ = buf.remaining();
    let (el, cpu) = (t0.elapsed().as_secs_f64(), cpu::cpu_s() - c0);
    println!("own (kafka-protocol): {n} records of {size} B, window {window}: {:.0} records/s, {:.2} us CPU/record, failed partitions {failed}, {el:.2} s", n as f64 / el, cpu * 1e6 / n as f64);
}
