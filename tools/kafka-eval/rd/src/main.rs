//! Producer rate of rdkafka (librdkafka, static) into a Kafka cluster: acks=all, idempotent, lz4.
#[path = "../../cpu.rs"]
mod cpu;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Instant;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (bootstrap, topic, n, size, window): (&str, &str, usize, usize, usize) =
        (&a[1], &a[2], a[3].parse().unwrap(), a[4].parse().unwrap(), a[5].parse().unwrap());
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .set("queue.buffering.max.kbytes", "16384")
        .create()
        .expect("producer");
    let payload = vec![b'x'; size];
    let keys: Vec<String> = (0..1024).map(|i| format!("dev-{i}")).collect();
    let (c0, t0) = (cpu::cpu_s(), Instant::now());
    let mut inflight = std::collections::VecDeque::new();
    let mut failed = 0;
    for i in 0..n {
        let rec = FutureRecord::to(topic)
            .key(&keys[i % 1024])
            .payload(&payload)
            .headers(OwnedHeaders::new().insert(Header { key: "mqtt_topic", value: Some("site/dev/temp") }));
        inflight.push_back(p.send_result(rec).map_err(|(e, _)| e).expect("queue has room"));
        if inflight.len() >= window {
            if !matches!(inflight.pop_front().unwrap().await, Ok(Ok(_))) { failed += 1; }
        }
    }
    for f in inflight { if !matches!(f.await, Ok(Ok(_))) { failed += 1; } }
    let (el, cpu) = (t0.elapsed().as_secs_f64(), cpu::cpu_s() - c0);
    println!("rdkafka: {n} records of {size} B, window {window}: {:.0} records/s, {:.2} us CPU/record, failed {failed}, {el:.2} s", n as f64 / el, cpu * 1e6 / n as f64);
}
