//! Tests of the MQTT codec through its public API: round trips, split input, golden vectors,
//! malformed packets, arbitrary bytes and topic matching.

#[path = "mqtt/arbitrary_bytes.rs"]
mod arbitrary_bytes;
#[path = "mqtt/encoder.rs"]
mod encoder;
#[path = "mqtt/golden.rs"]
mod golden;
#[path = "mqtt/malformed.rs"]
mod malformed;
#[path = "mqtt/read_ahead.rs"]
mod read_ahead;
#[path = "mqtt/round_trip.rs"]
mod round_trip;
#[path = "mqtt/split.rs"]
mod split;
#[path = "mqtt/strategies.rs"]
mod strategies;
#[path = "mqtt/topic.rs"]
mod topic;

use bytes::BytesMut;
use sluice_proto::mqtt::{encode, DecodeError, Decoder, Packet, ProtocolVersion};

/// Wire bytes from a hex string with optional whitespace.
pub fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len().is_multiple_of(2), "odd number of hex digits");
    digits
        .chunks(2)
        .map(|pair| {
            let text = std::str::from_utf8(pair).expect("ascii");
            u8::from_str_radix(text, 16).expect("hex digit")
        })
        .collect()
}

pub fn encoded(packet: &Packet, version: ProtocolVersion) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode(packet, version, &mut out).expect("packet encodes");
    out.to_vec()
}

/// Decode one packet from exactly `bytes` with a client decoder of `version`.
pub fn decode_one(bytes: &[u8], version: ProtocolVersion) -> Result<Option<Packet>, DecodeError> {
    let mut buf = BytesMut::from(bytes);
    let mut decoder = Decoder::client(version, usize::MAX);
    let packet = decoder.decode(&mut buf)?;
    if packet.is_some() {
        assert!(buf.is_empty(), "{} bytes left after one packet", buf.len());
    }
    Ok(packet)
}

/// Feed `chunks` to `decoder` one after another, decoding whatever becomes complete, and
/// checking that `Ok(None)` never consumes a byte.
pub fn decode_chunks<'a>(
    decoder: &mut Decoder,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> Result<Vec<Packet>, DecodeError> {
    let mut buf = BytesMut::new();
    let mut packets = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.clone();
            match decoder.decode(&mut buf)? {
                Some(packet) => packets.push(packet),
                None => {
                    assert_eq!(buf, before, "Ok(None) consumed bytes");
                    break;
                }
            }
        }
    }
    assert!(
        buf.is_empty(),
        "{} undecoded bytes left at the end",
        buf.len()
    );
    Ok(packets)
}
