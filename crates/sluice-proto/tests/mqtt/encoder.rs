//! What the encoder refuses to write: packets that would be malformed on the wire (values the
//! MQTT version cannot carry, sizes past the format's limits) are an `EncodeError`, never bytes.

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use sluice_proto::mqtt::{
    encode, Auth, ConnAck, Connect, Disconnect, EncodeError, Packet, Properties, ProtocolVersion,
    PubResponse, Publish, QoS, Subscribe, SubscribeFilter, SubscriptionOptions, UnsubAck,
};

use crate::hex;

const V3: ProtocolVersion = ProtocolVersion::V311;
const V5: ProtocolVersion = ProtocolVersion::V5;

// ---- encoder ------------------------------------------------------------------------------

fn encode_error(packet: &Packet, version: ProtocolVersion) -> EncodeError {
    let mut out = BytesMut::from(&b"kept"[..]);
    let err = encode(packet, version, &mut out).expect_err("must be refused");
    assert_eq!(&out[..], b"kept", "a refused packet writes nothing");
    err
}

fn publish(topic: &str, qos: QoS, packet_id: Option<u16>) -> Publish {
    Publish {
        dup: false,
        qos,
        retain: false,
        topic: ByteString::from(topic),
        packet_id,
        properties: None,
        payload: Bytes::new(),
    }
}

#[test]
fn encoder_refuses_auth_and_v5_only_reason_codes_in_v311() {
    let auth = Packet::Auth(Auth {
        reason: 0,
        properties: Properties::default(),
    });
    assert_eq!(encode_error(&auth, V3), EncodeError::NotInVersion("AUTH"));
    let puback = Packet::PubAck(PubResponse {
        packet_id: 1,
        reason: 0x87,
        properties: None,
    });
    assert!(matches!(
        encode_error(&puback, V3),
        EncodeError::NotInVersion(_)
    ));
    let disconnect = Packet::Disconnect(Disconnect {
        reason: 0x04,
        properties: Properties::default(),
    });
    assert!(matches!(
        encode_error(&disconnect, V3),
        EncodeError::NotInVersion(_)
    ));
    let unsuback = Packet::UnsubAck(UnsubAck {
        packet_id: 1,
        codes: vec![0x87],
        properties: Properties::default(),
    });
    assert!(matches!(
        encode_error(&unsuback, V3),
        EncodeError::NotInVersion(_)
    ));
    let connack = Packet::ConnAck(ConnAck {
        session_present: false,
        code: 0x86,
        properties: Properties::default(),
    });
    assert!(matches!(
        encode_error(&connack, V3),
        EncodeError::NotInVersion(_)
    ));
}

#[test]
fn v311_encoding_drops_properties_and_success_codes() {
    let mut out = BytesMut::new();
    let puback = Packet::PubAck(PubResponse {
        packet_id: 7,
        reason: 0x10,
        properties: Some(Box::new(Properties {
            reason_string: Some("r".into()),
            ..Properties::default()
        })),
    });
    encode(&puback, V3, &mut out).unwrap();
    assert_eq!(&out[..], &hex("40 02 00 07")[..]);
    out.clear();
    let disconnect = Packet::Disconnect(Disconnect {
        reason: 0,
        properties: Properties {
            session_expiry_interval: Some(5),
            ..Properties::default()
        },
    });
    encode(&disconnect, V3, &mut out).unwrap();
    assert_eq!(&out[..], &hex("e0 00")[..]);
}

#[test]
fn encoder_refuses_packets_a_decoder_would_reject() {
    assert_eq!(
        encode_error(&Packet::Publish(publish("a/+", QoS::AtMostOnce, None)), V5),
        EncodeError::Invalid("topic name is not valid")
    );
    assert!(matches!(
        encode_error(&Packet::Publish(publish("a", QoS::AtLeastOnce, None)), V3),
        EncodeError::Invalid(_)
    ));
    assert!(matches!(
        encode_error(&Packet::Publish(publish("a", QoS::AtMostOnce, Some(1))), V3),
        EncodeError::Invalid(_)
    ));
    assert_eq!(
        encode_error(
            &Packet::Publish(publish("a", QoS::AtLeastOnce, Some(0))),
            V3
        ),
        EncodeError::Invalid("packet identifier is 0")
    );
    let mut dup = publish("a", QoS::AtMostOnce, None);
    dup.dup = true;
    assert!(matches!(
        encode_error(&Packet::Publish(dup), V3),
        EncodeError::Invalid(_)
    ));
    let mut with_session_expiry = publish("a", QoS::AtMostOnce, None);
    with_session_expiry.properties = Some(Box::new(Properties {
        session_expiry_interval: Some(1),
        ..Properties::default()
    }));
    assert_eq!(
        encode_error(&Packet::Publish(with_session_expiry), V5),
        EncodeError::PropertyNotAllowed("Session Expiry Interval")
    );
    let empty_subscribe = Packet::Subscribe(Subscribe {
        packet_id: 1,
        filters: vec![],
        properties: Properties::default(),
    });
    assert!(matches!(
        encode_error(&empty_subscribe, V5),
        EncodeError::Invalid(_)
    ));
    let no_local_v3 = Packet::Subscribe(Subscribe {
        packet_id: 1,
        filters: vec![SubscribeFilter {
            filter: "a".into(),
            options: SubscriptionOptions {
                qos: QoS::AtMostOnce,
                no_local: true,
                retain_as_published: false,
                retain_handling: 0,
            },
        }],
        properties: Properties::default(),
    });
    assert!(matches!(
        encode_error(&no_local_v3, V3),
        EncodeError::NotInVersion(_)
    ));
    let v5_connect_as_v3 = Packet::Connect(Connect {
        protocol: V5,
        clean_start: true,
        keep_alive: 0,
        client_id: "c".into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    });
    assert!(matches!(
        encode_error(&v5_connect_as_v3, V3),
        EncodeError::Invalid(_)
    ));
}

#[test]
fn fields_longer_than_65535_bytes_are_refused() {
    let connect = Packet::Connect(Connect {
        protocol: V3,
        clean_start: true,
        keep_alive: 0,
        client_id: ByteString::from("x".repeat(65_536)),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    });
    assert_eq!(encode_error(&connect, V3), EncodeError::FieldTooLong);
    let connect = Packet::Connect(Connect {
        protocol: V3,
        clean_start: true,
        keep_alive: 0,
        client_id: ByteString::from("x".repeat(65_535)),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    });
    let mut out = BytesMut::new();
    encode(&connect, V3, &mut out).unwrap();
    assert_eq!(out.len(), 1 + 3 + 10 + 2 + 65_535);
}

#[test]
fn packets_above_the_largest_remaining_length_are_refused() {
    // 268,435,455 is the largest remaining length; topic (2 + 1 bytes) + payload exceeds it.
    let mut p = publish("a", QoS::AtMostOnce, None);
    p.payload = Bytes::from(vec![0u8; 268_435_455 - 2]);
    assert_eq!(
        encode_error(&Packet::Publish(p), V3),
        EncodeError::TooLarge(268_435_456)
    );
}
