//! CoAP over TCP (RFC 8323) framing through the public API: the fact sheet's vectors
//! (copied into tests/vectors/), the signalling helpers, and property tests (round trip,
//! a stream split at every offset, several frames in one buffer, arbitrary bytes).

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use sluice_proto::coap::tcp::{self, signal_opt, Capabilities};
use sluice_proto::coap::{
    decode_tcp, encode_tcp, opt, Code, DecodeErrorKind, Message, MsgType, Token,
};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn decode_one(wire: &[u8]) -> Message {
    let mut buf = BytesMut::from(wire);
    let m = decode_tcp(&mut buf, 1 << 20)
        .unwrap()
        .expect("a whole frame");
    assert!(buf.is_empty(), "frame not consumed whole");
    m
}

fn encoded(m: &Message) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode_tcp(m, &mut out);
    out.to_vec()
}

fn tok(b: &[u8]) -> Token {
    Token::from_slice(b).unwrap()
}

#[test]
fn csm_vector() {
    let wire = hex(include_str!("vectors/coap_tcp_csm.hex"));
    let m = decode_one(&wire);
    assert_eq!(m.code, Code::CSM);
    assert_eq!(m.uint_option(signal_opt::MAX_MESSAGE_SIZE), Some(1152));
    assert_eq!(
        tcp::read_csm(&m, Capabilities::default()),
        Ok(Capabilities {
            max_message_size: 1152,
            block_wise: true
        })
    );
    assert_eq!(encoded(&tcp::csm(1152, true)), wire);
}

#[test]
fn ping_pong_vectors() {
    let ping = hex(include_str!("vectors/coap_tcp_ping.hex"));
    let pong = hex(include_str!("vectors/coap_tcp_pong.hex"));
    assert_eq!(encoded(&tcp::ping(Token::EMPTY)), ping);
    assert_eq!(encoded(&tcp::pong(&decode_one(&ping))), pong);
    let ping_t = hex(include_str!("vectors/coap_tcp_ping_token.hex"));
    let pong_t = hex(include_str!("vectors/coap_tcp_pong_token.hex"));
    let p = decode_one(&ping_t);
    assert_eq!((p.code, p.token), (Code::PING, tok(&[0x5a])));
    assert_eq!(encoded(&tcp::ping(tok(&[0x5a]))), ping_t);
    assert_eq!(
        encoded(&tcp::pong(&p)),
        pong_t,
        "a Pong echoes the Ping's token"
    );
}

#[test]
fn release_vector() {
    let wire = hex(include_str!("vectors/coap_tcp_release.hex"));
    assert_eq!(decode_one(&wire).code, Code::RELEASE);
    assert_eq!(encoded(&tcp::release()), wire);
}

#[test]
fn abort_carries_the_bad_csm_option() {
    let m = decode_one(&encoded(&tcp::abort(Some(9), "bad CSM")));
    assert_eq!(m.code, Code::ABORT);
    assert_eq!(m.uint_option(signal_opt::BAD_CSM_OPTION), Some(9));
    assert_eq!(&m.payload[..], b"bad CSM");
}

#[test]
fn post_senml_vector_uses_one_extended_length_byte() {
    let wire = hex(include_str!("vectors/coap_tcp_post_senml.hex"));
    assert_eq!(wire.len(), 52);
    assert_eq!(wire[0] >> 4, 13);
    let m = decode_one(&wire);
    assert_eq!(m.code, Code::POST);
    assert_eq!(m.token, tok(&[0xa1, 0xb2]));
    let path: Vec<&[u8]> = m.uri_path().map(|s| s.as_ref()).collect();
    assert_eq!(path, vec![&b"sensors"[..], &b"spo2"[..]]);
    assert_eq!(m.uint_option(opt::CONTENT_FORMAT), Some(110));
    assert_eq!(&m.payload[..], br#"[{"n":"spo2","u":"/","v":0.98}]"#);
    assert_eq!(encoded(&m), wire);
}

#[test]
fn small_vectors() {
    let created = hex(include_str!("vectors/coap_tcp_201.hex"));
    let m = decode_one(&created);
    assert_eq!((m.code, m.token), (Code::CREATED, tok(&[0xa1, 0xb2])));
    assert_eq!(encoded(&m), created);
    let get = hex(include_str!("vectors/coap_tcp_get_small.hex"));
    let m = decode_one(&get);
    assert_eq!((m.code, m.token), (Code::GET, tok(&[1])));
    assert_eq!(m.option(opt::URI_PATH).map(|v| &v[..]), Some(&b"a"[..]));
    assert_eq!(encoded(&m), get);
}

#[test]
fn bad_frames_are_errors_not_panics() {
    // TKL 9
    let mut buf = BytesMut::from(&[0x09u8, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]);
    assert_eq!(
        decode_tcp(&mut buf, 1024).unwrap_err().kind,
        DecodeErrorKind::TokenTooLong(9)
    );
    // an option running past the frame's end (Len 1: one byte, "0x11" wants one more)
    let mut buf = BytesMut::from(&[0x10u8, 0x01, 0x11, 0x00][..]);
    assert_eq!(
        decode_tcp(&mut buf, 1024).unwrap_err().kind,
        DecodeErrorKind::TruncatedOption
    );
    assert_eq!(
        &buf[..],
        &[0x00],
        "the bad frame is consumed, the next byte stays"
    );
    // payload marker with nothing after it
    let mut buf = BytesMut::from(&[0x10u8, 0x45, 0xff][..]);
    assert_eq!(
        decode_tcp(&mut buf, 1024).unwrap_err().kind,
        DecodeErrorKind::EmptyPayload
    );
    // over the limit: known from the header, nothing consumed
    let mut buf = BytesMut::from(&[0xd0u8, 0xff][..]);
    assert_eq!(
        decode_tcp(&mut buf, 100).unwrap_err().kind,
        DecodeErrorKind::TooLarge(2 + 1 + 13 + 255)
    );
    assert_eq!(buf.len(), 2);
}

fn message() -> impl Strategy<Value = Message> {
    let code = prop_oneof![
        (0u8..=7).prop_map(|d| Code::new(0, d)),
        (2u8..=5, 0u8..32).prop_map(|(c, d)| Code::new(c, d)),
        (1u8..=5).prop_map(|d| Code::new(7, d)),
    ];
    let options = proptest::collection::vec(
        (
            prop_oneof![1u16..=60, 0u16..=u16::MAX],
            proptest::collection::vec(any::<u8>(), 0..300),
        ),
        0..6,
    );
    let payload = prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => proptest::collection::vec(any::<u8>(), 0..70_000),
    ];
    (
        code,
        proptest::collection::vec(any::<u8>(), 0..=8),
        options,
        payload,
    )
        .prop_map(|(code, token, options, payload)| {
            let mut m = Message::new(MsgType::Con, code, 0, Token::from_slice(&token).unwrap());
            for (n, v) in options {
                m.add_option(n, Bytes::from(v));
            }
            m.payload = Bytes::from(payload);
            m
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn encode_then_decode_round_trips(m in message()) {
        let wire = encoded(&m);
        let mut buf = BytesMut::from(&wire[..]);
        prop_assert_eq!(decode_tcp(&mut buf, usize::MAX).unwrap(), Some(m));
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn several_frames_in_one_buffer_split_anywhere(
        ms in proptest::collection::vec(message(), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut stream = Vec::new();
        for m in &ms {
            stream.extend(encoded(m));
        }
        // all at once
        let mut buf = BytesMut::from(&stream[..]);
        let mut got = Vec::new();
        while let Some(m) = decode_tcp(&mut buf, usize::MAX).unwrap() {
            got.push(m);
        }
        prop_assert_eq!(&got, &ms);
        prop_assert!(buf.is_empty());
        // in two pieces cut at a random offset
        let cut = cut.index(stream.len() + 1);
        let mut buf = BytesMut::from(&stream[..cut]);
        let mut got = Vec::new();
        loop {
            let before = buf.len();
            match decode_tcp(&mut buf, usize::MAX).unwrap() {
                Some(m) => got.push(m),
                None => {
                    prop_assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                    break;
                }
            }
        }
        buf.extend_from_slice(&stream[cut..]);
        while let Some(m) = decode_tcp(&mut buf, usize::MAX).unwrap() {
            got.push(m);
        }
        prop_assert_eq!(got, ms);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(_)) = decode_tcp(&mut buf, 4096) {}
    }
}

/// A small stream split at every offset decodes to the same messages.
#[test]
fn a_stream_split_at_every_offset_decodes_the_same() {
    let mut stream = Vec::new();
    for f in [
        "csm",
        "ping_token",
        "post_senml",
        "201",
        "get_small",
        "release",
    ] {
        let text = std::fs::read_to_string(format!(
            "{}/tests/vectors/coap_tcp_{f}.hex",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        stream.extend(hex(&text));
    }
    let mut whole = BytesMut::from(&stream[..]);
    let mut expected = Vec::new();
    while let Some(m) = decode_tcp(&mut whole, 1152).unwrap() {
        expected.push(m);
    }
    assert_eq!(expected.len(), 6);
    for cut in 0..=stream.len() {
        let mut buf = BytesMut::from(&stream[..cut]);
        let mut got = Vec::new();
        while let Some(m) = decode_tcp(&mut buf, 1152).unwrap() {
            got.push(m);
        }
        buf.extend_from_slice(&stream[cut..]);
        while let Some(m) = decode_tcp(&mut buf, 1152).unwrap() {
            got.push(m);
        }
        assert_eq!(got, expected, "cut at {cut}");
    }
}
