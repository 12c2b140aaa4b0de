//! Fuzz target for the MQTT decoder (crates/sluice-proto/src/mqtt).
//!
//! Feeds the input to a server decoder (which must first see CONNECT) and to client decoders
//! for 3.1.1 and 5.0, each in a loop until it fails or needs more bytes. Checks, besides "no
//! panic": `Ok(None)` consumes nothing, and every decoded packet re-encodes for its version
//! to bytes that decode to an equal packet. The first input byte also picks a split point, so
//! the incremental path (packet arriving in two pieces) is exercised too.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice_proto::mqtt::{encode, Decoder, Packet, ProtocolVersion};

const MAX_PACKET_SIZE: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = usize::from(split).min(data.len());
    for decoder in [
        Decoder::server(MAX_PACKET_SIZE),
        Decoder::client(ProtocolVersion::V311, MAX_PACKET_SIZE),
        Decoder::client(ProtocolVersion::V5, MAX_PACKET_SIZE),
    ] {
        let whole = drain(decoder.clone(), &[data]);
        let pieces = drain(decoder, &[&data[..split], &data[split..]]);
        assert_eq!(whole, pieces, "result depends on how the input was split");
    }
});

/// Decode `chunks` delivered one after another; returns the packets and whether it ended in
/// an error. Asserts the re-encode round trip for every packet.
fn drain(mut decoder: Decoder, chunks: &[&[u8]]) -> (Vec<Packet>, bool) {
    let mut buf = BytesMut::new();
    let mut packets = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match decoder.decode(&mut buf) {
                Ok(Some(packet)) => {
                    check_round_trip(&packet, &decoder);
                    packets.push(packet);
                }
                Ok(None) => {
                    assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                    break;
                }
                Err(_) => return (packets, true),
            }
        }
    }
    (packets, false)
}

fn check_round_trip(packet: &Packet, decoder: &Decoder) {
    let version = match packet {
        Packet::Connect(c) => c.protocol,
        _ => match decoder.version() {
            Some(v) => v,
            None => panic!("decoded {} without a version", packet.name()),
        },
    };
    let mut wire = BytesMut::new();
    if let Err(e) = encode(packet, version, &mut wire) {
        panic!("decoded packet does not re-encode: {e}: {packet:?}");
    }
    let again = Decoder::client(version, usize::MAX).decode(&mut wire);
    assert_eq!(
        again.as_ref(),
        Ok(&Some(packet.clone())),
        "re-encoded packet differs"
    );
    assert!(wire.is_empty(), "re-encoded packet has trailing bytes");
}
