//! Message format errors (RFC 7252 §3, §4.1): each is refused with its kind, and with the
//! header whenever the 4 header bytes were there, so the receiver can RST a CON or answer a
//! request 4.00.

use sluice_proto::coap::{Code, DecodeErrorKind, MsgType};

use crate::{decode, hex};

fn kind(wire: &str) -> DecodeErrorKind {
    decode(&hex(wire)).expect_err("malformed").kind
}

#[test]
fn truncated_headers_have_no_header() {
    for wire in ["", "40", "40 02", "40 02 00"] {
        let e = decode(&hex(wire)).expect_err("too short");
        assert_eq!(e.kind, DecodeErrorKind::TooShort);
        assert_eq!(e.header, None);
    }
}

#[test]
fn versions_other_than_one() {
    for (byte, version) in [(0x00u8, 0u8), (0x80, 2), (0xc0, 3)] {
        let e = decode(&[byte, 0x01, 0x00, 0x05]).expect_err("bad version");
        assert_eq!(e.kind, DecodeErrorKind::BadVersion(version));
        assert_eq!(e.header.expect("header").message_id, 5);
    }
}

#[test]
fn token_lengths_nine_to_fifteen() {
    for tkl in 9u8..=15 {
        let mut wire = vec![0x40 | tkl, 0x02, 0xbe, 0xef];
        wire.extend(std::iter::repeat_n(0u8, 15));
        let e = decode(&wire).expect_err("token too long");
        assert_eq!(e.kind, DecodeErrorKind::TokenTooLong(tkl));
        let h = e.header.expect("header");
        assert_eq!(
            (h.mtype, h.code, h.message_id),
            (MsgType::Con, Code::POST, 0xbeef)
        );
    }
    assert_eq!(kind("44 01 00 01 aa bb"), DecodeErrorKind::TruncatedToken);
}

#[test]
fn reserved_nibbles() {
    // Delta nibble 15 with any length nibble except the 0xFF marker, and length nibble 15.
    for first in 0xf0u8..=0xfe {
        assert_eq!(
            decode(&[0x40, 0x01, 0, 1, first, 0, 0, 0])
                .expect_err("reserved")
                .kind,
            DecodeErrorKind::ReservedNibble,
            "{first:#x}"
        );
    }
    assert_eq!(kind("40 01 00 01 bf 00"), DecodeErrorKind::ReservedNibble);
    // After a valid option too.
    assert_eq!(
        kind("40 01 00 01 b1 61 0f"),
        DecodeErrorKind::ReservedNibble
    );
}

#[test]
fn truncated_options() {
    for wire in [
        "40 01 00 01 d0",       // extended delta byte missing
        "40 01 00 01 e0 00",    // second extended delta byte missing
        "40 01 00 01 1d",       // extended length byte missing
        "40 01 00 01 1e 00",    // second extended length byte missing
        "40 01 00 01 b3 61 62", // value one byte short
        "40 01 00 01 1d 00 00", // 13-byte value, 1 byte there
    ] {
        assert_eq!(kind(wire), DecodeErrorKind::TruncatedOption, "{wire}");
    }
}

#[test]
fn option_numbers_past_65535() {
    // 65535 is the last number; one more delta overflows.
    assert!(decode(&hex("40 01 00 01 e0 fe f2")).is_ok());
    assert_eq!(
        kind("40 01 00 01 e0 fe f2 10"),
        DecodeErrorKind::OptionNumberOverflow
    );
    assert_eq!(
        kind("40 01 00 01 e0 ff ff e0 ff ff"),
        DecodeErrorKind::OptionNumberOverflow
    );
}

#[test]
fn payload_marker_without_payload() {
    assert_eq!(kind("40 02 00 01 ff"), DecodeErrorKind::EmptyPayload);
    assert_eq!(kind("40 02 00 01 b1 61 ff"), DecodeErrorKind::EmptyPayload);
    // A marker with one byte is a payload.
    let m = decode(&hex("40 02 00 01 ff 00")).expect("payload of one byte");
    assert_eq!(&m.payload[..], &[0]);
}

#[test]
fn empty_messages_are_exactly_four_bytes() {
    for wire in ["40 00 00 01 ff 01", "70 00 00 01 b1 61", "61 00 00 01 aa"] {
        let e = decode(&hex(wire)).expect_err("non-empty empty");
        assert_eq!(e.kind, DecodeErrorKind::NonEmptyEmpty, "{wire}");
        assert_eq!(e.header.expect("header").code, Code::EMPTY);
    }
    // TKL > 0 but nothing after the header: refused too (the token is missing).
    assert!(decode(&hex("41 00 00 01")).is_err());
}
