//! encode → decode → equal, for every packet type and both versions.

use bytes::BytesMut;
use proptest::prelude::*;
use sluice_proto::mqtt::{encode, Decoder, Packet, ProtocolVersion};

use crate::strategies::{connect, packet};

fn assert_round_trip(packet: &Packet, version: ProtocolVersion) {
    let mut wire = BytesMut::new();
    encode(packet, version, &mut wire).expect("a valid packet encodes");
    let bytes = wire.clone();
    let mut decoder = Decoder::client(version, usize::MAX);
    let decoded = decoder
        .decode(&mut wire)
        .expect("an encoded packet decodes");
    assert_eq!(decoded.as_ref(), Some(packet));
    assert!(wire.is_empty(), "decoder left {} bytes", wire.len());
    let mut again = BytesMut::new();
    encode(packet, version, &mut again).expect("encodes again");
    assert_eq!(again, bytes, "encoding is deterministic");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn every_valid_v311_packet_decodes_to_what_was_encoded(p in packet(ProtocolVersion::V311)) {
        assert_round_trip(&p, ProtocolVersion::V311);
    }

    #[test]
    fn every_valid_v5_packet_decodes_to_what_was_encoded(p in packet(ProtocolVersion::V5)) {
        assert_round_trip(&p, ProtocolVersion::V5);
    }

    #[test]
    fn server_decoder_learns_the_version_from_connect(c in prop_oneof![
        connect(ProtocolVersion::V311), connect(ProtocolVersion::V5)
    ]) {
        let mut wire = BytesMut::new();
        encode(&Packet::Connect(c.clone()), c.protocol, &mut wire).unwrap();
        let mut decoder = Decoder::server(usize::MAX);
        prop_assert_eq!(decoder.version(), None);
        let decoded = decoder.decode(&mut wire).unwrap();
        prop_assert_eq!(decoded, Some(Packet::Connect(c.clone())));
        prop_assert_eq!(decoder.version(), Some(c.protocol));
    }
}

#[test]
fn encode_appends_to_what_is_already_in_the_buffer() {
    let mut out = BytesMut::from(&b"xy"[..]);
    encode(&Packet::PingReq, ProtocolVersion::V311, &mut out).unwrap();
    assert_eq!(&out[..], b"xy\xc0\x00");
}
