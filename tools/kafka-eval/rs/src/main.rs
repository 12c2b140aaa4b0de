//! Producer rate of rskafka (pure Rust) into a Kafka cluster: acks=all (rskafka's), lz4,
//! records grouped per partition (key hash), one produce call per partition per window.
#[path = "../../cpu.rs"]
mod cpu;
use rskafka::client::partition::{Compression, UnknownTopicHandling};
use rskafka::client::ClientBuilder;
use rskafka::record::Record;
use std::collections::BTreeMap;
use std::time::Instant;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (bootstrap, topic, n, size, window): (&str, &str, usize, usize, usize) =
        (&a[1], &a[2], a[3].parse().unwrap(), a[4].parse().unwrap(), a[5].parse().unwrap());
    let client = ClientBuilder::new(bootstrap.split(',').map(String::from).collect())
        .build()
        .await
        .expect("client");
    let parts = client
        .list_topics()
        .await
        .unwrap()
        .into_iter()
        .find(|t| t.name == topic)
        .expect("topic exists")
        .partitions
        .len();
    let mut pcs = Vec::new();
    for p in 0..parts as i32 {
        pcs.push(client.partition_client(topic, p, UnknownTopicHandling::Retry).await.unwrap());
    }
    let payload = vec![b'x'; size];
    let keys: Vec<String> = (0..1024).map(|i| format!("dev-{i}")).collect();
    let (c0, t0) = (cpu::cpu_s(), Instant::now());
    let mut failed = 0;
    let mut i = 0;
    while i < n {
        let end = (i + window).min(n);
        let mut per: Vec<Vec<Record>> = (0..parts).map(|_| Vec::new()).collect();
        for j in i..end {
            let k = &keys[j % 1024];
            let p = (j % 1024) % parts; // key -> partition, stable per device
            let mut headers = BTreeMap::new();
            headers.insert("mqtt_topic".to_string(), b"site/dev/temp".to_vec());
            per[p].push(Record {
                key: Some(k.as_bytes().to_vec()),
                value: Some(payload.clone()),
                headers,
                timestamp: chrono::Utc::now(),
            });
        }
        let futs = per.into_iter().enumerate().filter(|(_, r)| !r.is_empty())
            .map(|(p, r)| { let pc = &pcs[p]; async move { pc.produce(r, Compression::Lz4).await } });
        for r in futures::future::join_all(futs).await { if r.is_err() { failed += 1; } }
        i = end;
    }
    let (el, cpu) = (t0.elapsed().as_secs_f64(), cpu::cpu_s() - c0);
    println!("rskafka: {n} records of {size} B, window {window}: {:.0} records/s, {:.2} us CPU/record, failed batches {failed}, {el:.2} s", n as f64 / el, cpu * 1e6 / n as f64);
}
