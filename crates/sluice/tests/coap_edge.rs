//! The CoAP/UDP device edge end to end: a real gateway (`App`) and a real cloud Mosquitto
//! over TLS; devices are `common::coap::CoapDevice` (UDP, built on `sluice_proto::coap`).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::coap::{request, CoapDevice};
use common::*;
use sluice::app::RunningGateway;
use sluice_proto::coap::{opt, Block, Code, Message, MsgType};

const T: Duration = Duration::from_secs(10);

fn coap_gateway(shards: usize, cloud: &Cloud, coap: &str) -> RunningGateway {
    gateway(
        shards,
        &format!(
            "[coap]\nlisten = \"127.0.0.1:0\"\n{coap}\n{}",
            cloud.uplink_toml(None, "[uplink.aggregate]\nenabled = false")
        ),
    )
}

fn publish(mtype: MsgType, topic: &str, query: &[&str], payload: &[u8]) -> Message {
    request(mtype, Code::POST, &format!("ps/{topic}"), query, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_con_publish_reaches_the_cloud_byte_for_byte_and_is_answered_2_04() {
    let cloud = Cloud::start();
    let mut sub = cloud.subscriber("cloud-sub", "coap/#").await;
    let gw = coap_gateway(2, &cloud, "");
    let mut dev = CoapDevice::new(gw.coap_addr().expect("coap listening")).await;
    let payload: Vec<u8> = (0..200u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut req = publish(MsgType::Con, "coap/meter-1/power", &["c=meter-1"], &payload);
    req.add_uint_option(opt::CONTENT_FORMAT, 110);
    let resp = dev.exchange(req, T).await;
    assert_eq!(resp.code, Code::CHANGED, "{resp:?}");
    let got = sub.recv(T).await.unwrap().expect("cloud got the message");
    assert_eq!(&*got.topic, "coap/meter-1/power");
    assert_eq!(&got.payload[..], &payload[..]);
    let text = gw.metrics_text();
    assert_eq!(metric_sum(&text, "sluice_coap_publishes_total"), 1.0);
    assert_eq!(metric_sum(&text, "sluice_coap_requests_total{shard=\"0\",method=\"POST\"}")
        + metric_sum(&text, "sluice_coap_requests_total{shard=\"1\",method=\"POST\"}"), 1.0);
    let status = gw.status_json();
    assert_eq!(status["coap"]["devices"], 1);
    gw.shutdown();
}
