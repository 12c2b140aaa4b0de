//! proptest strategies that generate only packets valid for a given protocol version.
//!
//! The allow-lists here (which property goes on which packet, which reason codes) are restated
//! from the specification tables rather than imported from the codec, so a wrong table in the
//! codec shows up as a failing round trip instead of being copied into the test.

use bytes::Bytes;
use bytestring::ByteString;
use proptest::collection::vec;
use proptest::option::{of, weighted};
use proptest::prelude::*;
use proptest::sample::select;
use sluice_proto::mqtt::{
    Auth, ConnAck, Connect, Disconnect, Packet, Properties, ProtocolVersion, PubResponse, Publish,
    QoS, SubAck, Subscribe, SubscribeFilter, SubscriptionOptions, UnsubAck, Unsubscribe, Will,
};

pub const V5_CONNACK: &[u8] = &[
    0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97,
    0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F,
];
pub const V5_PUBACK: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];
pub const V5_PUBREL: &[u8] = &[0x00, 0x92];
pub const V5_SUBACK: &[u8] = &[
    0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2,
];
pub const V3_SUBACK: &[u8] = &[0x00, 0x01, 0x02, 0x80];
pub const V5_UNSUBACK: &[u8] = &[0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91];
pub const V5_DISCONNECT: &[u8] = &[
    0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
];
pub const V5_AUTH: &[u8] = &[0x00, 0x18, 0x19];

/// Where a property block sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ctx {
    Connect,
    Will,
    ConnAck,
    Publish,
    PubResponse,
    Subscribe,
    SubAck,
    Unsubscribe,
    UnsubAck,
    Disconnect,
    Auth,
}

pub fn string() -> impl Strategy<Value = ByteString> + Clone {
    "[^\u{0}]{0,8}".prop_map(ByteString::from)
}

pub fn topic_name() -> impl Strategy<Value = ByteString> + Clone {
    "[a-z0-9$é _/]{1,16}".prop_map(ByteString::from)
}

pub fn topic_filter() -> impl Strategy<Value = ByteString> + Clone {
    (
        vec(prop_oneof!["[a-z0-9]{0,4}", Just("+".to_owned())], 1..4),
        any::<bool>(),
    )
        .prop_map(|(levels, hash)| {
            let mut filter = levels.join("/");
            if hash {
                filter.push_str("/#");
            }
            ByteString::from(filter)
        })
}

pub fn binary() -> impl Strategy<Value = Bytes> + Clone {
    vec(any::<u8>(), 0..24).prop_map(Bytes::from)
}

pub fn qos() -> impl Strategy<Value = QoS> + Clone {
    prop_oneof![
        Just(QoS::AtMostOnce),
        Just(QoS::AtLeastOnce),
        Just(QoS::ExactlyOnce)
    ]
}

pub fn packet_id() -> impl Strategy<Value = u16> + Clone {
    1..=u16::MAX
}

/// Properties with every field possibly set (to valid values), before [`restrict`].
fn any_properties() -> impl Strategy<Value = Properties> {
    let w = 0.25;
    (
        (
            weighted(w, 0u8..=1),
            weighted(w, any::<u32>()),
            weighted(w, string()),
            weighted(w, topic_name()),
            weighted(w, binary()),
            vec(1u32..=268_435_455, 0..3),
            weighted(w, any::<u32>()),
            weighted(w, string()),
            weighted(w, any::<u16>()),
        ),
        (
            weighted(w, string()),
            weighted(w, binary()),
            weighted(w, 0u8..=1),
            weighted(w, any::<u32>()),
            weighted(w, 0u8..=1),
            weighted(w, string()),
            weighted(w, string()),
            weighted(w, string()),
            weighted(w, 1u16..),
        ),
        (
            weighted(w, any::<u16>()),
            weighted(w, 1u16..),
            weighted(w, 0u8..=1),
            weighted(w, 0u8..=1),
            vec((string(), string()), 0..3),
            weighted(w, 1u32..),
            weighted(w, 0u8..=1),
            weighted(w, 0u8..=1),
            weighted(w, 0u8..=1),
        ),
    )
        .prop_map(|(a, b, c)| Properties {
            payload_format_indicator: a.0,
            message_expiry_interval: a.1,
            content_type: a.2,
            response_topic: a.3,
            correlation_data: a.4,
            subscription_identifiers: a.5,
            session_expiry_interval: a.6,
            assigned_client_identifier: a.7,
            server_keep_alive: a.8,
            authentication_method: b.0,
            authentication_data: b.1,
            request_problem_information: b.2,
            will_delay_interval: b.3,
            request_response_information: b.4,
            response_information: b.5,
            server_reference: b.6,
            reason_string: b.7,
            receive_maximum: b.8,
            topic_alias_maximum: c.0,
            topic_alias: c.1,
            maximum_qos: c.2,
            retain_available: c.3,
            user_properties: c.4,
            maximum_packet_size: c.5,
            wildcard_subscription_available: c.6,
            subscription_identifier_available: c.7,
            shared_subscription_available: c.8,
        })
}

/// Keep only the properties MQTT 5 Table 2-4 allows in `ctx`, and make the rest consistent.
pub fn restrict(p: Properties, ctx: Ctx) -> Properties {
    let mut out = Properties {
        user_properties: p.user_properties,
        ..Properties::default()
    };
    match ctx {
        Ctx::Connect => {
            out.session_expiry_interval = p.session_expiry_interval;
            out.authentication_method = p.authentication_method;
            out.authentication_data = p.authentication_data;
            out.request_problem_information = p.request_problem_information;
            out.request_response_information = p.request_response_information;
            out.receive_maximum = p.receive_maximum;
            out.topic_alias_maximum = p.topic_alias_maximum;
            out.maximum_packet_size = p.maximum_packet_size;
        }
        Ctx::Will => {
            out.payload_format_indicator = p.payload_format_indicator;
            out.message_expiry_interval = p.message_expiry_interval;
            out.content_type = p.content_type;
            out.response_topic = p.response_topic;
            out.correlation_data = p.correlation_data;
            out.will_delay_interval = p.will_delay_interval;
        }
        Ctx::ConnAck => {
            out.session_expiry_interval = p.session_expiry_interval;
            out.assigned_client_identifier = p.assigned_client_identifier;
            out.server_keep_alive = p.server_keep_alive;
            out.authentication_method = p.authentication_method;
            out.authentication_data = p.authentication_data;
            out.response_information = p.response_information;
            out.server_reference = p.server_reference;
            out.reason_string = p.reason_string;
            out.receive_maximum = p.receive_maximum;
            out.topic_alias_maximum = p.topic_alias_maximum;
            out.maximum_qos = p.maximum_qos;
            out.retain_available = p.retain_available;
            out.maximum_packet_size = p.maximum_packet_size;
            out.wildcard_subscription_available = p.wildcard_subscription_available;
            out.subscription_identifier_available = p.subscription_identifier_available;
            out.shared_subscription_available = p.shared_subscription_available;
        }
        Ctx::Publish => {
            out.payload_format_indicator = p.payload_format_indicator;
            out.message_expiry_interval = p.message_expiry_interval;
            out.content_type = p.content_type;
            out.response_topic = p.response_topic;
            out.correlation_data = p.correlation_data;
            out.subscription_identifiers = p.subscription_identifiers;
            out.topic_alias = p.topic_alias;
        }
        Ctx::PubResponse | Ctx::SubAck | Ctx::UnsubAck => {
            out.reason_string = p.reason_string;
        }
        Ctx::Subscribe => {
            out.subscription_identifiers = p.subscription_identifiers.into_iter().take(1).collect();
        }
        Ctx::Unsubscribe => {}
        Ctx::Disconnect => {
            out.session_expiry_interval = p.session_expiry_interval;
            out.reason_string = p.reason_string;
            out.server_reference = p.server_reference;
        }
        Ctx::Auth => {
            out.authentication_method = p.authentication_method;
            out.authentication_data = p.authentication_data;
            out.reason_string = p.reason_string;
        }
    }
    if out.authentication_data.is_some() && out.authentication_method.is_none() {
        out.authentication_method = Some(ByteString::from_static("SCRAM-SHA-256"));
    }
    out
}

/// Properties valid in `ctx` for `version` (always empty for 3.1.1).
pub fn properties(version: ProtocolVersion, ctx: Ctx) -> BoxedStrategy<Properties> {
    match version {
        ProtocolVersion::V311 => Just(Properties::default()).boxed(),
        ProtocolVersion::V5 => any_properties().prop_map(move |p| restrict(p, ctx)).boxed(),
    }
}

fn boxed(p: Properties) -> Option<Box<Properties>> {
    if p.is_empty() {
        None
    } else {
        Some(Box::new(p))
    }
}

fn will(version: ProtocolVersion) -> impl Strategy<Value = Will> {
    (
        topic_name(),
        binary(),
        qos(),
        any::<bool>(),
        properties(version, Ctx::Will),
    )
        .prop_map(|(topic, payload, qos, retain, properties)| Will {
            topic,
            payload,
            qos,
            retain,
            properties,
        })
}

pub fn connect(version: ProtocolVersion) -> impl Strategy<Value = Connect> {
    (
        any::<bool>(),
        any::<u16>(),
        string(),
        of(will(version)),
        of(string()),
        of(binary()),
        properties(version, Ctx::Connect),
    )
        .prop_map(
            move |(
                clean_start,
                keep_alive,
                client_id,
                will,
                mut username,
                password,
                properties,
            )| {
                if version == ProtocolVersion::V311 && password.is_some() && username.is_none() {
                    username = Some(ByteString::from_static("user"));
                }
                Connect {
                    protocol: version,
                    clean_start,
                    keep_alive,
                    client_id,
                    will,
                    username,
                    password,
                    properties,
                }
            },
        )
}

fn connack(version: ProtocolVersion) -> BoxedStrategy<ConnAck> {
    let codes: &[u8] = match version {
        ProtocolVersion::V311 => &[0, 1, 2, 3, 4, 5],
        ProtocolVersion::V5 => V5_CONNACK,
    };
    (
        any::<bool>(),
        select(codes),
        properties(version, Ctx::ConnAck),
    )
        .prop_map(|(session_present, code, properties)| ConnAck {
            session_present: session_present && code == 0,
            code,
            properties,
        })
        .boxed()
}

pub fn publish(version: ProtocolVersion) -> impl Strategy<Value = Publish> {
    (
        qos(),
        any::<bool>(),
        any::<bool>(),
        topic_name(),
        packet_id(),
        properties(version, Ctx::Publish),
        any::<bool>(),
        vec(any::<u8>(), 0..64),
    )
        .prop_map(
            |(qos, dup, retain, topic, id, properties, alias_only, payload)| {
                let has_alias = properties.topic_alias.is_some();
                Publish {
                    dup: dup && qos != QoS::AtMostOnce,
                    qos,
                    retain,
                    topic: if has_alias && alias_only {
                        ByteString::new()
                    } else {
                        topic
                    },
                    packet_id: (qos != QoS::AtMostOnce).then_some(id),
                    properties: boxed(properties),
                    payload: Bytes::from(payload),
                }
            },
        )
}

fn pub_response(version: ProtocolVersion, codes: &'static [u8]) -> BoxedStrategy<PubResponse> {
    let codes: &'static [u8] = match version {
        ProtocolVersion::V311 => &[0],
        ProtocolVersion::V5 => codes,
    };
    (
        packet_id(),
        select(codes),
        properties(version, Ctx::PubResponse),
    )
        .prop_map(|(packet_id, reason, properties)| PubResponse {
            packet_id,
            reason,
            properties: boxed(properties),
        })
        .boxed()
}

fn subscribe(version: ProtocolVersion) -> impl Strategy<Value = Subscribe> {
    let options =
        (qos(), any::<bool>(), any::<bool>(), 0u8..=2).prop_map(move |(qos, nl, rap, rh)| {
            match version {
                ProtocolVersion::V311 => SubscriptionOptions {
                    qos,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                },
                ProtocolVersion::V5 => SubscriptionOptions {
                    qos,
                    no_local: nl,
                    retain_as_published: rap,
                    retain_handling: rh,
                },
            }
        });
    (
        packet_id(),
        vec(
            (topic_filter(), options)
                .prop_map(|(filter, options)| SubscribeFilter { filter, options }),
            1..4,
        ),
        properties(version, Ctx::Subscribe),
    )
        .prop_map(|(packet_id, filters, properties)| Subscribe {
            packet_id,
            filters,
            properties,
        })
}

fn suback(version: ProtocolVersion) -> impl Strategy<Value = SubAck> {
    let codes = match version {
        ProtocolVersion::V311 => V3_SUBACK,
        ProtocolVersion::V5 => V5_SUBACK,
    };
    (
        packet_id(),
        vec(select(codes), 1..5),
        properties(version, Ctx::SubAck),
    )
        .prop_map(|(packet_id, codes, properties)| SubAck {
            packet_id,
            codes,
            properties,
        })
}

fn unsubscribe(version: ProtocolVersion) -> impl Strategy<Value = Unsubscribe> {
    (
        packet_id(),
        vec(topic_filter(), 1..4),
        properties(version, Ctx::Unsubscribe),
    )
        .prop_map(|(packet_id, filters, properties)| Unsubscribe {
            packet_id,
            filters,
            properties,
        })
}

fn unsuback(version: ProtocolVersion) -> impl Strategy<Value = UnsubAck> {
    let count = match version {
        ProtocolVersion::V311 => 0..1,
        ProtocolVersion::V5 => 1..5,
    };
    (
        packet_id(),
        vec(select(V5_UNSUBACK), count),
        properties(version, Ctx::UnsubAck),
    )
        .prop_map(|(packet_id, codes, properties)| UnsubAck {
            packet_id,
            codes,
            properties,
        })
}

fn disconnect(version: ProtocolVersion) -> impl Strategy<Value = Disconnect> {
    let codes: &'static [u8] = match version {
        ProtocolVersion::V311 => &[0],
        ProtocolVersion::V5 => V5_DISCONNECT,
    };
    (select(codes), properties(version, Ctx::Disconnect))
        .prop_map(|(reason, properties)| Disconnect { reason, properties })
}

fn auth() -> impl Strategy<Value = Auth> {
    (select(V5_AUTH), properties(ProtocolVersion::V5, Ctx::Auth))
        .prop_map(|(reason, properties)| Auth { reason, properties })
}

/// Any packet valid for `version`, every packet type equally likely.
pub fn packet(version: ProtocolVersion) -> BoxedStrategy<Packet> {
    let mut choices: Vec<BoxedStrategy<Packet>> = vec![
        connect(version).prop_map(Packet::Connect).boxed(),
        connack(version).prop_map(Packet::ConnAck).boxed(),
        publish(version).prop_map(Packet::Publish).boxed(),
        pub_response(version, V5_PUBACK)
            .prop_map(Packet::PubAck)
            .boxed(),
        pub_response(version, V5_PUBACK)
            .prop_map(Packet::PubRec)
            .boxed(),
        pub_response(version, V5_PUBREL)
            .prop_map(Packet::PubRel)
            .boxed(),
        pub_response(version, V5_PUBREL)
            .prop_map(Packet::PubComp)
            .boxed(),
        subscribe(version).prop_map(Packet::Subscribe).boxed(),
        suback(version).prop_map(Packet::SubAck).boxed(),
        unsubscribe(version).prop_map(Packet::Unsubscribe).boxed(),
        unsuback(version).prop_map(Packet::UnsubAck).boxed(),
        Just(Packet::PingReq).boxed(),
        Just(Packet::PingResp).boxed(),
        disconnect(version).prop_map(Packet::Disconnect).boxed(),
    ];
    if version == ProtocolVersion::V5 {
        choices.push(auth().prop_map(Packet::Auth).boxed());
    }
    proptest::strategy::Union::new(choices).boxed()
}
