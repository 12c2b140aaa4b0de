//! Tests of the CoAP/UDP codec (RFC 7252) through its public API: the fact sheet's golden
//! vectors (shared/specs/senml-and-coap.md §2.5, copied into tests/vectors/), round trips of
//! random messages, option order and repeats, block values, truncations, and arbitrary
//! bytes.

#[path = "coap/arbitrary_bytes.rs"]
mod arbitrary_bytes;
#[path = "coap/blocks.rs"]
mod blocks;
#[path = "coap/golden.rs"]
mod golden;
#[path = "coap/malformed.rs"]
mod malformed;
#[path = "coap/options.rs"]
mod options;
#[path = "coap/round_trip.rs"]
mod round_trip;
#[path = "coap/strategies.rs"]
mod strategies;

use bytes::Bytes;
use sluice_proto::coap::{DecodeError, Message};

/// Bytes from a hex string with optional whitespace.
pub fn hex(s: &str) -> Bytes {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len().is_multiple_of(2), "odd number of hex digits");
    let bytes: Vec<u8> = digits
        .chunks(2)
        .map(|pair| {
            let text = std::str::from_utf8(pair).expect("ascii");
            u8::from_str_radix(text, 16).expect("hex digit")
        })
        .collect();
    Bytes::from(bytes)
}

/// Decode one datagram.
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    Message::decode_udp(&Bytes::copy_from_slice(bytes))
}

/// Whatever decodes re-encodes to exactly the same bytes (CoAP/UDP has one encoding per
/// message: extended deltas and lengths cannot be padded), and those decode equal again.
pub fn assert_canonical(bytes: &[u8]) {
    if let Ok(message) = decode(bytes) {
        let wire = message.to_udp();
        assert_eq!(&wire[..], bytes, "re-encoding of {message:?}");
        assert_eq!(message.options_len(), wire.len() - 4 - message.token.len());
        assert_eq!(decode(&wire), Ok(message));
    }
}
