//! proptest strategies for CoAP messages: any type and code, tokens of 0 to 8 bytes, options
//! whose deltas and lengths sit on and around the extended-encoding boundaries (12/13,
//! 268/269), repeated options, and payloads. Code 0.00 messages are always empty (anything
//! else is a format error, RFC 7252 §4.1).

use bytes::Bytes;
use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::coap::{Code, Message, MsgType, Token};

pub fn mtype() -> impl Strategy<Value = MsgType> {
    prop_oneof![
        Just(MsgType::Con),
        Just(MsgType::Non),
        Just(MsgType::Ack),
        Just(MsgType::Rst),
    ]
}

pub fn token() -> impl Strategy<Value = Token> {
    vec(any::<u8>(), 0..=8).prop_map(|b| Token::from_slice(&b).expect("at most 8 bytes"))
}

/// A delta or a length: mostly small, often exactly on an encoding boundary.
pub fn boundary_number(max: u32) -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..=12,
        3 => prop::sample::select(vec![0u32, 1, 12, 13, 14, 267, 268, 269, 270]),
        1 => 13u32..=268,
        1 => 269u32..=max,
    ]
    .prop_map(move |v| v.min(max))
}

/// Options as (delta from the previous option, value length, fill byte); numbers stay within
/// u16 because the sum of deltas is capped when the message is built.
pub fn option_specs() -> impl Strategy<Value = Vec<(u32, u32, u8)>> {
    vec(
        (boundary_number(2000), boundary_number(600), any::<u8>()),
        0..8,
    )
}

pub fn payload() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        2 => Just(Bytes::new()),
        3 => vec(any::<u8>(), 1..64).prop_map(Bytes::from),
        1 => vec(any::<u8>(), 64..1500).prop_map(Bytes::from),
    ]
}

/// Build a message from option specs (numbers ascending by construction).
pub fn build(
    mtype: MsgType,
    code: u8,
    mid: u16,
    token: Token,
    specs: &[(u32, u32, u8)],
    payload: Bytes,
) -> Message {
    let mut m = Message::new(mtype, Code(code), mid, token);
    if m.code == Code::EMPTY {
        m.token = Token::EMPTY;
        return m;
    }
    let mut number = 0u32;
    for &(delta, len, fill) in specs {
        number = (number + delta).min(u16::MAX as u32);
        let value: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
        m.add_option(number as u16, value);
    }
    m.payload = payload;
    m
}

/// Any valid message.
pub fn message() -> impl Strategy<Value = Message> {
    (
        mtype(),
        prop_oneof![1 => Just(0u8), 6 => any::<u8>()],
        any::<u16>(),
        token(),
        option_specs(),
        payload(),
    )
        .prop_map(|(t, code, mid, tok, specs, payload)| build(t, code, mid, tok, &specs, payload))
}
