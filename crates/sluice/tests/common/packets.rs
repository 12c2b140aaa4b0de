//! MQTT 5 packets the gateway tests build by hand.

use bytes::Bytes;
use sluice_proto::mqtt::{Packet, Properties, Publish, QoS, SubscribeFilter, SubscriptionOptions};

/// A subscription at `qos` with every other option at its default.
pub fn opts_sub(filter: &str, qos: QoS) -> SubscribeFilter {
    SubscribeFilter {
        filter: filter.into(),
        options: SubscriptionOptions {
            qos,
            no_local: false,
            retain_as_published: false,
            retain_handling: 0,
        },
    }
}

/// A PUBLISH (properties omitted when empty).
pub fn publish(topic: &str, payload: &str, qos: QoS, id: Option<u16>, props: Properties) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos,
        retain: false,
        topic: topic.into(),
        packet_id: id,
        properties: (!props.is_empty()).then(|| Box::new(props)),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
    })
}
