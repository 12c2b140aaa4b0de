//! `Decoder::take_pingreqs`: the look-ahead a gateway uses to answer a back-pressured
//! device's PINGREQs takes exactly the complete, well-formed PINGREQs and leaves every other
//! byte where it was, so the rest decodes as it would have.

use bytes::BytesMut;
use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::mqtt::{Decoder, Packet, ProtocolVersion};

use crate::strategies::packet;
use crate::{decode_chunks, encoded, hex};

const MAX: usize = 1 << 20;

fn packets_with_pings() -> impl Strategy<Value = Vec<Packet>> {
    vec(
        prop_oneof![packet(ProtocolVersion::V311), Just(Packet::PingReq)],
        1..8,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn pingreqs_anywhere_are_taken_and_everything_else_decodes_in_order(
        packets in packets_with_pings(),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut wire = Vec::new();
        let mut ends = Vec::new();
        for p in &packets {
            wire.extend(encoded(p, ProtocolVersion::V311));
            ends.push(wire.len());
        }
        // Any prefix of the stream: only PINGREQs complete within it are taken.
        let cut = cut.index(wire.len() + 1);
        let decoder = Decoder::client(ProtocolVersion::V311, MAX);
        let mut buf = BytesMut::from(&wire[..cut]);
        let taken = decoder.take_pingreqs(&mut buf);
        let complete = ends.iter().take_while(|&&e| e <= cut).count();
        let pings = packets[..complete].iter().filter(|p| matches!(p, Packet::PingReq)).count();
        prop_assert_eq!(taken, pings);
        buf.extend_from_slice(&wire[cut..]);
        let rest = decode_chunks(&mut decoder.clone(), [&buf[..]]).expect("decodes");
        let mut want: Vec<Packet> = packets[..complete]
            .iter()
            .filter(|p| !matches!(p, Packet::PingReq))
            .cloned()
            .collect();
        want.extend(packets[complete..].iter().cloned());
        prop_assert_eq!(rest, want);
    }
}

#[test]
fn look_ahead_stops_at_an_oversized_or_malformed_header() {
    // A PUBLISH (QoS 0, topic "t", payload "x"), then PINGREQ, then PINGREQ.
    let publish = hex("30 04 00 01 74 78");
    let mut wire = publish.clone();
    wire.extend(hex("c0 00 c0 00"));
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(
        Decoder::client(ProtocolVersion::V311, MAX).take_pingreqs(&mut buf),
        2
    );
    assert_eq!(&buf[..], &publish[..]);
    // The PUBLISH is larger than the maximum packet size: that is the decoder's to refuse,
    // and nothing behind it is looked at.
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(
        Decoder::client(ProtocolVersion::V311, 4).take_pingreqs(&mut buf),
        0
    );
    assert_eq!(&buf[..], &wire[..]);
    // A PINGREQ with flags set, or a remaining length of five bytes, is malformed: left alone.
    let mut buf = BytesMut::from(&hex("c1 00 c0 00")[..]);
    assert_eq!(
        Decoder::client(ProtocolVersion::V311, MAX).take_pingreqs(&mut buf),
        1
    );
    assert_eq!(&buf[..], &hex("c1 00")[..]);
    let mut buf = BytesMut::from(&hex("30 ff ff ff ff 01 c0 00")[..]);
    assert_eq!(
        Decoder::client(ProtocolVersion::V311, MAX).take_pingreqs(&mut buf),
        0
    );
}
