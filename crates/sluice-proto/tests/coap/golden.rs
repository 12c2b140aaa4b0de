//! The fact sheet's CoAP/UDP vectors (senml-and-coap.md §2.5, verified with aiocoap 0.4.17):
//! each decodes to the documented fields, and the same message built field by field encodes
//! to the same bytes.

use bytes::Bytes;
use sluice_proto::coap::{format, opt, Block, Code, Message, MsgType, Token};

use crate::{assert_canonical, hex};

const CON_POST_SENML: &str = include_str!("../vectors/coap_udp_con_post_senml.hex");
const ACK_201: &str = include_str!("../vectors/coap_udp_ack_201_piggybacked.hex");
const EMPTY_ACK: &str = include_str!("../vectors/coap_udp_empty_ack.hex");
const RST: &str = include_str!("../vectors/coap_udp_rst.hex");
const PING: &str = include_str!("../vectors/coap_udp_ping.hex");
const GET_BLOCK2: &str = include_str!("../vectors/coap_udp_con_get_block2.hex");
const NON_LONG_PATH: &str = include_str!("../vectors/coap_udp_non_post_long_path.hex");
const SENML_EX2_CBOR: &str = include_str!("../vectors/senml_ex2_scale_cbor.hex");

fn token(bytes: &[u8]) -> Token {
    Token::from_slice(bytes).expect("at most 8 bytes")
}

/// Decode `wire`, compare with `expected`, and check `expected` encodes to `wire`.
fn check(wire: &str, expected: &Message) -> Message {
    let wire = hex(wire);
    let decoded = Message::decode_udp(&wire).expect("the vector decodes");
    assert_eq!(&decoded, expected);
    assert_eq!(expected.to_udp(), wire, "encoding of {expected:?}");
    assert_canonical(&wire);
    decoded
}

#[test]
fn con_post_senml() {
    let mut m = Message::new(MsgType::Con, Code::POST, 0x1234, token(&[0xa1, 0xb2]));
    m.add_option(opt::URI_PATH, &b"sensors"[..]);
    m.add_option(opt::URI_PATH, &b"spo2"[..]);
    m.add_uint_option(opt::CONTENT_FORMAT, format::SENML_JSON as u32);
    m.payload = Bytes::from_static(br#"[{"n":"spo2","u":"/","v":0.98}]"#);
    let d = check(CON_POST_SENML, &m);
    assert_eq!(hex(CON_POST_SENML).len(), 53);
    assert_eq!(d.payload.len(), 31);
    let path: Vec<&[u8]> = d.uri_path().map(|s| s.as_ref()).collect();
    assert_eq!(path, vec![&b"sensors"[..], &b"spo2"[..]]);
    assert_eq!(d.uint_option(opt::CONTENT_FORMAT), Some(110));
    assert!(d.code.is_request());
    assert_eq!(d.options.len(), 3);
}

#[test]
fn ack_201_piggybacked() {
    let m = Message::new(MsgType::Ack, Code::CREATED, 0x1234, token(&[0xa1, 0xb2]));
    let d = check(ACK_201, &m);
    assert_eq!(d.code.to_string(), "2.01");
    assert!(d.options.is_empty() && d.payload.is_empty());
}

#[test]
fn empty_ack_rst_and_ping() {
    let d = check(EMPTY_ACK, &Message::empty(MsgType::Ack, 0x1234));
    assert!(d.code.is_empty() && d.token.is_empty());
    check(RST, &Message::empty(MsgType::Rst, 0x1234));
    check(PING, &Message::empty(MsgType::Con, 0x0001));
}

#[test]
fn con_get_block2() {
    let mut m = Message::new(MsgType::Con, Code::GET, 0x1235, token(&[0x07]));
    m.add_option(opt::URI_PATH, &b"fw"[..]);
    let block = Block {
        num: 1,
        more: false,
        szx: 2,
    };
    m.add_uint_option(opt::BLOCK2, block.to_uint());
    let d = check(GET_BLOCK2, &m);
    let b = Block::from_uint(d.uint_option(opt::BLOCK2).expect("Block2")).expect("3 bytes");
    assert_eq!(b, block);
    assert_eq!((b.size(), b.offset()), (64, 64));
}

#[test]
fn non_post_long_path() {
    let mut m = Message::new(MsgType::Non, Code::POST, 0x1236, token(&[0x42]));
    m.add_option(opt::URI_PATH, &b"measurements-2024"[..]);
    m.add_uint_option(opt::CONTENT_FORMAT, format::SENML_CBOR as u32);
    m.payload = hex(SENML_EX2_CBOR);
    assert_eq!(m.payload.len(), 65);
    let d = check(NON_LONG_PATH, &m);
    let wire = hex(NON_LONG_PATH);
    assert_eq!(wire.len(), 92);
    // Extended length: nibble 13, one byte holding 17 - 13.
    assert_eq!(&wire[..7], &[0x51, 0x02, 0x12, 0x36, 0x42, 0xbd, 0x04]);
    assert_eq!(d.uri_path().next().map(|s| s.len()), Some(17));
}
