//! Golden vectors: wire bytes written out by hand from the examples and layouts in the
//! specifications (3.1.1 §3.1.2.10 CONNECT, §3.3.2.3 PUBLISH, §3.8.3.1 SUBSCRIBE; 5.0
//! §3.1.2.11 CONNECT properties), asserting the exact decode and the exact encode.

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{
    ConnAck, Connect, Disconnect, Packet, Properties, ProtocolVersion, PubResponse, Publish, QoS,
    SubAck, Subscribe, SubscribeFilter, SubscriptionOptions, UnsubAck, Unsubscribe, Will,
};

use crate::{decode_one, encoded, hex};

const V3: ProtocolVersion = ProtocolVersion::V311;
const V5: ProtocolVersion = ProtocolVersion::V5;

fn s(text: &'static str) -> ByteString {
    ByteString::from_static(text)
}

fn qos_only(qos: QoS) -> SubscriptionOptions {
    SubscriptionOptions {
        qos,
        no_local: false,
        retain_as_published: false,
        retain_handling: 0,
    }
}

/// The bytes decode to exactly `packet`, and `packet` encodes to exactly the bytes.
fn assert_golden(wire: &str, version: ProtocolVersion, packet: Packet) {
    let bytes = hex(wire);
    assert_eq!(
        decode_one(&bytes, version),
        Ok(Some(packet.clone())),
        "decode of {wire}"
    );
    assert_eq!(encoded(&packet, version), bytes, "encode of {packet:?}");
}

#[test]
fn v311_connect_with_will_user_and_password_matches_the_spec_layout() {
    // Flags 0xCE as in the spec example: user name, password, will QoS 1, will, clean session.
    assert_golden(
        "10 22  00 04 4d 51 54 54  04  ce  00 0a
         00 06 73 6c 75 69 63 65  00 03 77 2f 74  00 03 62 79 65  00 01 75  00 01 70",
        V3,
        Packet::Connect(Connect {
            protocol: V3,
            clean_start: true,
            keep_alive: 10,
            client_id: s("sluice"),
            will: Some(Will {
                topic: s("w/t"),
                payload: Bytes::from_static(b"bye"),
                qos: QoS::AtLeastOnce,
                retain: false,
                properties: Properties::default(),
            }),
            username: Some(s("u")),
            password: Some(Bytes::from_static(b"p")),
            properties: Properties::default(),
        }),
    );
}

#[test]
fn v311_qos1_publish_carries_topic_packet_id_and_payload() {
    // Spec example variable header: topic "a/b", packet identifier 10.
    assert_golden(
        "32 09  00 03 61 2f 62  00 0a  68 69",
        V3,
        Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain: false,
            topic: s("a/b"),
            packet_id: Some(10),
            properties: None,
            payload: Bytes::from_static(b"hi"),
        }),
    );
}

#[test]
fn v311_subscribe_lists_filters_with_requested_qos() {
    // Spec example payload: "a/b" QoS 1, "c/d" QoS 2; packet identifier 10.
    assert_golden(
        "82 0e  00 0a  00 03 61 2f 62 01  00 03 63 2f 64 02",
        V3,
        Packet::Subscribe(Subscribe {
            packet_id: 10,
            filters: vec![
                SubscribeFilter {
                    filter: s("a/b"),
                    options: qos_only(QoS::AtLeastOnce),
                },
                SubscribeFilter {
                    filter: s("c/d"),
                    options: qos_only(QoS::ExactlyOnce),
                },
            ],
            properties: Properties::default(),
        }),
    );
}

#[test]
fn v311_suback_unsubscribe_unsuback_and_connack_have_their_fixed_layouts() {
    assert_golden(
        "90 05 00 0a 01 02 80",
        V3,
        Packet::SubAck(SubAck {
            packet_id: 10,
            codes: vec![1, 2, 0x80],
            properties: Properties::default(),
        }),
    );
    assert_golden(
        "a2 07 00 0b 00 03 61 2f 62",
        V3,
        Packet::Unsubscribe(Unsubscribe {
            packet_id: 11,
            filters: vec![s("a/b")],
            properties: Properties::default(),
        }),
    );
    assert_golden(
        "b0 02 00 0b",
        V3,
        Packet::UnsubAck(UnsubAck {
            packet_id: 11,
            codes: vec![],
            properties: Properties::default(),
        }),
    );
    assert_golden(
        "20 02 01 00",
        V3,
        Packet::ConnAck(ConnAck {
            session_present: true,
            code: 0,
            properties: Properties::default(),
        }),
    );
    assert_golden(
        "62 02 00 0a",
        V3,
        Packet::PubRel(PubResponse {
            packet_id: 10,
            reason: 0,
            properties: None,
        }),
    );
}

#[test]
fn pingreq_is_c0_00_and_disconnect_is_e0_00() {
    for version in [V3, V5] {
        assert_golden("c0 00", version, Packet::PingReq);
        assert_golden("d0 00", version, Packet::PingResp);
        assert_golden(
            "e0 00",
            version,
            Packet::Disconnect(Disconnect {
                reason: 0,
                properties: Properties::default(),
            }),
        );
    }
}

#[test]
fn v5_connect_with_session_expiry_receive_maximum_and_will_delay() {
    // Variable header as in the 5.0 spec example (flags 0xCE, keep alive 10, Session Expiry
    // Interval 10), plus Receive Maximum 20 and a will with Will Delay Interval 5.
    assert_golden(
        "10 31  00 04 4d 51 54 54  05  ce  00 0a
         08  11 00 00 00 0a  21 00 14
         00 06 73 6c 75 69 63 65
         05  18 00 00 00 05
         00 03 77 2f 74  00 03 62 79 65  00 01 75  00 01 70",
        V5,
        Packet::Connect(Connect {
            protocol: V5,
            clean_start: true,
            keep_alive: 10,
            client_id: s("sluice"),
            will: Some(Will {
                topic: s("w/t"),
                payload: Bytes::from_static(b"bye"),
                qos: QoS::AtLeastOnce,
                retain: false,
                properties: Properties {
                    will_delay_interval: Some(5),
                    ..Properties::default()
                },
            }),
            username: Some(s("u")),
            password: Some(Bytes::from_static(b"p")),
            properties: Properties {
                session_expiry_interval: Some(10),
                receive_maximum: Some(20),
                ..Properties::default()
            },
        }),
    );
}

#[test]
fn v5_puback_with_success_and_no_properties_is_the_two_byte_short_form() {
    assert_golden(
        "40 02 00 0a",
        V5,
        Packet::PubAck(PubResponse {
            packet_id: 10,
            reason: 0,
            properties: None,
        }),
    );
    assert_golden(
        "40 03 00 0a 10",
        V5,
        Packet::PubAck(PubResponse {
            packet_id: 10,
            reason: 0x10,
            properties: None,
        }),
    );
    assert_golden(
        "40 08 00 0a 80 04 1f 00 01 78",
        V5,
        Packet::PubAck(PubResponse {
            packet_id: 10,
            reason: 0x80,
            properties: Some(Box::new(Properties {
                reason_string: Some(s("x")),
                ..Properties::default()
            })),
        }),
    );
}

#[test]
fn v5_puback_long_form_with_empty_properties_decodes_like_the_short_form() {
    let short = Packet::PubAck(PubResponse {
        packet_id: 10,
        reason: 0,
        properties: None,
    });
    assert_eq!(
        decode_one(&hex("40 04 00 0a 00 00"), V5),
        Ok(Some(short.clone()))
    );
    assert_eq!(decode_one(&hex("40 03 00 0a 00"), V5), Ok(Some(short)));
}

#[test]
fn v5_connack_carries_assigned_client_id_receive_maximum_and_topic_alias_maximum() {
    assert_golden(
        "20 0f  00 00  0c  12 00 03 61 62 63  21 00 0a  22 00 05",
        V5,
        Packet::ConnAck(ConnAck {
            session_present: false,
            code: 0,
            properties: Properties {
                assigned_client_identifier: Some(s("abc")),
                receive_maximum: Some(10),
                topic_alias_maximum: Some(5),
                ..Properties::default()
            },
        }),
    );
}

#[test]
fn v5_publish_and_subscribe_always_carry_a_property_length() {
    assert_golden(
        "30 07  00 03 61 2f 62  00  68",
        V5,
        Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: s("a/b"),
            packet_id: None,
            properties: None,
            payload: Bytes::from_static(b"h"),
        }),
    );
    // Options 0x2d: QoS 1, No Local, Retain As Published, Retain Handling 2.
    assert_golden(
        "82 09  00 01  02 0b 07  00 01 23 2d",
        V5,
        Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter {
                filter: s("#"),
                options: SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
                    no_local: true,
                    retain_as_published: true,
                    retain_handling: 2,
                },
            }],
            properties: Properties {
                subscription_identifiers: vec![7],
                ..Properties::default()
            },
        }),
    );
    assert_golden(
        "b0 04  00 01  00  11",
        V5,
        Packet::UnsubAck(UnsubAck {
            packet_id: 1,
            codes: vec![0x11],
            properties: Properties::default(),
        }),
    );
}

#[test]
fn v5_disconnect_with_a_reason_and_no_properties_is_one_byte_long() {
    assert_golden(
        "e0 01 8e",
        V5,
        Packet::Disconnect(Disconnect {
            reason: 0x8e,
            properties: Properties::default(),
        }),
    );
}

#[test]
fn v5_auth_with_success_and_no_properties_is_empty() {
    use sluice_proto::mqtt::Auth;
    assert_golden(
        "f0 00",
        V5,
        Packet::Auth(Auth {
            reason: 0,
            properties: Properties::default(),
        }),
    );
    assert_golden(
        "f0 08 18 06 15 00 03 61 62 63",
        V5,
        Packet::Auth(Auth {
            reason: 0x18,
            properties: Properties {
                authentication_method: Some(s("abc")),
                ..Properties::default()
            },
        }),
    );
}
