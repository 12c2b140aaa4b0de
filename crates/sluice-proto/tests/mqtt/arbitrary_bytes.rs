//! Arbitrary and corrupted bytes never panic any decoder, and whatever they decode to
//! re-encodes to bytes that decode to the same packet (the property the fuzz target checks).

use bytes::BytesMut;
use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::mqtt::{encode, Decoder, Packet, ProtocolVersion};

use crate::encoded;
use crate::strategies::{connect, packet};

const MAX: usize = 64 * 1024;

/// Decode until the decoder needs more bytes or fails; check every packet re-encodes to an
/// equal packet.
fn drain(decoder: &mut Decoder, bytes: &[u8]) {
    let mut buf = BytesMut::from(bytes);
    while let Ok(Some(packet)) = decoder.decode(&mut buf) {
        // A server decoder learns the version from CONNECT; CONNECT names its own.
        let version = match &packet {
            Packet::Connect(c) => c.protocol,
            _ => decoder
                .version()
                .expect("a decoder that produced a non-CONNECT has a version"),
        };
        let mut wire = BytesMut::new();
        encode(&packet, version, &mut wire).expect("every decoded packet re-encodes");
        let again = Decoder::client(version, usize::MAX).decode(&mut wire);
        assert_eq!(again, Ok(Some(packet)));
        assert!(wire.is_empty());
    }
}

fn every_decoder(bytes: &[u8]) {
    drain(&mut Decoder::server(MAX), bytes);
    drain(&mut Decoder::client(ProtocolVersion::V311, MAX), bytes);
    drain(&mut Decoder::client(ProtocolVersion::V5, MAX), bytes);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn arbitrary_bytes_never_panic_any_decoder(bytes in vec(any::<u8>(), 0..512)) {
        every_decoder(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_connect_never_panic_the_server(
        c in prop_oneof![connect(ProtocolVersion::V311), connect(ProtocolVersion::V5)],
        tail in vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = encoded(&Packet::Connect(c.clone()), c.protocol);
        bytes.extend_from_slice(&tail);
        drain(&mut Decoder::server(MAX), &bytes);
    }

    #[test]
    fn valid_packets_with_corrupted_bytes_never_panic(
        packets in vec(prop_oneof![packet(ProtocolVersion::V311), packet(ProtocolVersion::V5)], 1..4),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        // Encode each packet for the version it was generated for: try both and keep what works.
        let mut bytes = Vec::new();
        for p in &packets {
            let mut out = BytesMut::new();
            if encode(p, ProtocolVersion::V5, &mut out).is_err() {
                out.clear();
                let _ = encode(p, ProtocolVersion::V311, &mut out);
            }
            bytes.extend_from_slice(&out);
        }
        if !bytes.is_empty() {
            for (at, byte) in edits {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
        }
        every_decoder(&bytes);
    }
}
