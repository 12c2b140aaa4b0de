//! Random messages survive encode → decode unchanged, and every truncation of their encoding
//! is an error or a shorter valid message (never a panic, never a different message).

use proptest::prelude::*;
use sluice_proto::coap::{DecodeErrorKind, Message};

use crate::strategies::message;
use crate::{assert_canonical, decode};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn encode_then_decode_is_identity(m in message()) {
        let wire = m.to_udp();
        prop_assert_eq!(wire.len(), 4 + m.token.len() + m.options_len());
        let back = Message::decode_udp(&wire).expect("an encoded message decodes");
        prop_assert_eq!(&back, &m);
        assert_canonical(&wire);
        // encode_udp appends: two messages in one buffer are the two encodings back to back.
        let mut out = bytes::BytesMut::from(&b"xy"[..]);
        m.encode_udp(&mut out);
        prop_assert_eq!(&out[2..], &wire[..]);
    }

    #[test]
    fn every_truncation_is_an_error_or_a_prefix(m in message()) {
        let wire = m.to_udp();
        for cut in 0..wire.len() {
            let short = &wire[..cut];
            match decode(short) {
                Err(e) => {
                    if cut < 4 {
                        prop_assert_eq!(e.kind, DecodeErrorKind::TooShort);
                        prop_assert!(e.header.is_none());
                    } else {
                        // Past the header, the header is reported for an RST.
                        let h = e.header.expect("header kept");
                        prop_assert_eq!((h.mtype, h.code, h.message_id), (m.mtype, m.code, m.message_id));
                    }
                }
                Ok(p) => {
                    // A cut between options or inside the payload: same header and token,
                    // the first options, a prefix of the payload.
                    prop_assert_eq!((p.mtype, p.code, p.message_id, p.token), (m.mtype, m.code, m.message_id, m.token));
                    prop_assert!(p.options.len() <= m.options.len());
                    prop_assert_eq!(&p.options[..], &m.options[..p.options.len()]);
                    if p.options.len() < m.options.len() {
                        prop_assert!(p.payload.is_empty());
                    } else {
                        prop_assert!(p.payload.len() < m.payload.len());
                        prop_assert_eq!(&p.payload[..], &m.payload[..p.payload.len()]);
                    }
                    assert_canonical(short);
                }
            }
        }
        prop_assert_eq!(decode(&wire), Ok(m));
    }
}
