//! Input split at any byte offset decodes to the same packets; `Ok(None)` never consumes.

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::mqtt::{
    Connect, Decoder, Packet, Properties, ProtocolVersion, PubResponse, Publish, QoS,
};

use crate::strategies::{connect, packet, publish};
use crate::{decode_chunks, encoded};

const MAX: usize = 1 << 20;

fn sample_publish(version: ProtocolVersion, len: usize) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: true,
        topic: ByteString::from_static("sensors/ünit-7/temperature"),
        packet_id: Some(300),
        properties: match version {
            ProtocolVersion::V311 => None,
            ProtocolVersion::V5 => Some(Box::new(Properties {
                message_expiry_interval: Some(60),
                user_properties: vec![(ByteString::from_static("k"), ByteString::from_static("v"))],
                ..Properties::default()
            })),
        },
        payload: Bytes::from((0..len).map(|i| i as u8).collect::<Vec<u8>>()),
    })
}

fn sample_connect(version: ProtocolVersion) -> Packet {
    Packet::Connect(Connect {
        protocol: version,
        clean_start: true,
        keep_alive: 30,
        client_id: ByteString::from_static("dev-1"),
        will: None,
        username: Some(ByteString::from_static("dev")),
        password: Some(Bytes::from_static(b"secret")),
        properties: Properties::default(),
    })
}

/// A connection's worth of packets: CONNECT first, then a mix, one with a 2-byte length.
fn sample_stream(version: ProtocolVersion) -> Vec<Packet> {
    vec![
        sample_connect(version),
        sample_publish(version, 5),
        sample_publish(version, 200),
        Packet::PubAck(PubResponse {
            packet_id: 300,
            reason: 0,
            properties: None,
        }),
        Packet::PingReq,
        sample_publish(version, 0),
    ]
}

fn wire(packets: &[Packet], version: ProtocolVersion) -> Vec<u8> {
    packets.iter().flat_map(|p| encoded(p, version)).collect()
}

#[test]
fn publish_split_at_every_byte_offset_decodes_identically() {
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let packets = vec![sample_publish(version, 300)];
        let bytes = wire(&packets, version);
        for at in 0..=bytes.len() {
            let (a, b) = bytes.split_at(at);
            let mut decoder = Decoder::client(version, MAX);
            assert_eq!(
                decode_chunks(&mut decoder, [a, b]),
                Ok(packets.clone()),
                "split at {at}"
            );
        }
    }
}

#[test]
fn a_connection_split_in_two_at_every_offset_decodes_identically_on_the_server() {
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let packets = sample_stream(version);
        let bytes = wire(&packets, version);
        for at in 0..=bytes.len() {
            let (a, b) = bytes.split_at(at);
            let mut decoder = Decoder::server(MAX);
            assert_eq!(
                decode_chunks(&mut decoder, [a, b]),
                Ok(packets.clone()),
                "split at {at}"
            );
            assert_eq!(decoder.version(), Some(version));
        }
    }
}

#[test]
fn a_connection_fed_byte_by_byte_decodes_identically_on_the_server() {
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let packets = sample_stream(version);
        let bytes = wire(&packets, version);
        let mut decoder = Decoder::server(MAX);
        assert_eq!(decode_chunks(&mut decoder, bytes.chunks(1)), Ok(packets));
    }
}

#[test]
fn decoded_publish_topic_and_payload_point_into_the_input_buffer() {
    let packet = sample_publish(ProtocolVersion::V5, 100);
    let mut buf = BytesMut::from(&encoded(&packet, ProtocolVersion::V5)[..]);
    let range = buf.as_ptr_range();
    let mut decoder = Decoder::client(ProtocolVersion::V5, MAX);
    let Some(Packet::Publish(p)) = decoder.decode(&mut buf).unwrap() else {
        panic!("expected a PUBLISH");
    };
    assert!(range.contains(&p.payload.as_ptr()), "payload was copied");
    assert!(
        range.contains(&p.topic.as_bytes().as_ptr()),
        "topic was copied"
    );
}

fn assert_same_outcome_for_every_split(bytes: &[u8], decoder: &Decoder) {
    let whole = decode_chunks(&mut decoder.clone(), [bytes]);
    for at in 0..=bytes.len() {
        let (a, b) = bytes.split_at(at);
        let split = decode_chunks(&mut decoder.clone(), [a, b]);
        assert_eq!(split, whole, "split at {at}");
    }
    let bytewise = decode_chunks(&mut decoder.clone(), bytes.chunks(1));
    assert_eq!(bytewise, whole, "byte by byte");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn any_v311_packet_sequence_split_anywhere_decodes_identically(
        packets in vec(packet(ProtocolVersion::V311), 1..4)
    ) {
        let bytes = wire(&packets, ProtocolVersion::V311);
        let decoder = Decoder::client(ProtocolVersion::V311, MAX);
        assert_same_outcome_for_every_split(&bytes, &decoder);
        prop_assert_eq!(decode_chunks(&mut decoder.clone(), [&bytes[..]]), Ok(packets));
    }

    #[test]
    fn any_v5_packet_sequence_split_anywhere_decodes_identically(
        packets in vec(packet(ProtocolVersion::V5), 1..4)
    ) {
        let bytes = wire(&packets, ProtocolVersion::V5);
        let decoder = Decoder::client(ProtocolVersion::V5, MAX);
        assert_same_outcome_for_every_split(&bytes, &decoder);
        prop_assert_eq!(decode_chunks(&mut decoder.clone(), [&bytes[..]]), Ok(packets));
    }

    #[test]
    fn a_server_connection_split_anywhere_decodes_identically(
        (connect, publishes) in prop_oneof![
            (connect(ProtocolVersion::V311), vec(publish(ProtocolVersion::V311), 0..3)),
            (connect(ProtocolVersion::V5), vec(publish(ProtocolVersion::V5), 0..3)),
        ]
    ) {
        let version = connect.protocol;
        let mut packets = vec![Packet::Connect(connect)];
        packets.extend(publishes.into_iter().map(Packet::Publish));
        let bytes = wire(&packets, version);
        let decoder = Decoder::server(MAX);
        assert_same_outcome_for_every_split(&bytes, &decoder);
        prop_assert_eq!(decode_chunks(&mut decoder.clone(), [&bytes[..]]), Ok(packets));
    }

    #[test]
    fn corrupted_input_gives_the_same_result_however_it_is_split(
        packets in vec(packet(ProtocolVersion::V5), 1..3),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let mut bytes = wire(&packets, ProtocolVersion::V5);
        let i = flip.index(bytes.len());
        bytes[i] = byte;
        // The corruption may leave a partial packet at the end, so compare outcomes (packets
        // and error or bytes left over) rather than requiring a clean decode.
        let decoder = Decoder::client(ProtocolVersion::V5, MAX);
        let whole = outcome(&bytes, &decoder, &[bytes.len()]);
        for at in 0..=bytes.len() {
            prop_assert_eq!(&outcome(&bytes, &decoder, &[at, bytes.len()]), &whole, "split at {}", at);
        }
    }
}

/// Decode `bytes` delivered up to each cut in turn: the packets, and how it ended.
fn outcome(
    bytes: &[u8],
    decoder: &Decoder,
    cuts: &[usize],
) -> (Vec<Packet>, Result<usize, sluice_proto::mqtt::DecodeError>) {
    let mut decoder = decoder.clone();
    let mut buf = BytesMut::new();
    let mut packets = Vec::new();
    let mut from = 0;
    for &cut in cuts {
        buf.extend_from_slice(&bytes[from..cut]);
        from = cut;
        loop {
            let before = buf.len();
            match decoder.decode(&mut buf) {
                Ok(Some(p)) => packets.push(p),
                Ok(None) => {
                    assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                    break;
                }
                Err(e) => return (packets, Err(e)),
            }
        }
    }
    let left = buf.len();
    (packets, Ok(left))
}
