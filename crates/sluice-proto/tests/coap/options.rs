//! Options: the exact bytes of extended deltas and lengths at the 12/13 and 268/269
//! boundaries, repeated options keeping their order, and the same option set added in any
//! interleaving (split into runs or merged) encoding to the same datagram.

use bytes::Bytes;
use proptest::collection::vec;
use proptest::prelude::*;
use sluice_proto::coap::{opt, Code, Message, MsgType, Token};

use crate::strategies::{build, option_specs, payload, token};
use crate::{decode, hex};

fn post() -> Message {
    Message::new(MsgType::Con, Code::POST, 0x0102, Token::EMPTY)
}

/// The option bytes (after the 4-byte header; no token) of a message with `options`.
fn option_bytes(options: &[(u16, &[u8])]) -> Vec<u8> {
    let mut m = post();
    for (n, v) in options {
        m.add_option(*n, Bytes::copy_from_slice(v));
    }
    let wire = m.to_udp();
    assert_eq!(decode(&wire), Ok(m));
    wire[4..].to_vec()
}

#[test]
fn delta_boundaries() {
    assert_eq!(option_bytes(&[(12, b"")]), vec![0xc0]);
    assert_eq!(option_bytes(&[(13, b"")]), vec![0xd0, 0x00]);
    assert_eq!(option_bytes(&[(268, b"")]), vec![0xd0, 0xff]);
    assert_eq!(option_bytes(&[(269, b"")]), vec![0xe0, 0x00, 0x00]);
    assert_eq!(option_bytes(&[(270, b"")]), vec![0xe0, 0x00, 0x01]);
    assert_eq!(option_bytes(&[(65535, b"")]), vec![0xe0, 0xfe, 0xf2]);
    // Deltas are relative: 258 (No-Response) after 60 (Size1) is delta 198.
    assert_eq!(
        option_bytes(&[(60, b""), (258, b"")]),
        vec![0xd0, 60 - 13, 0xd0, 198 - 13]
    );
}

#[test]
fn length_boundaries() {
    for (len, head) in [
        (12usize, vec![0x1c]),
        (13, vec![0x1d, 0x00]),
        (268, vec![0x1d, 0xff]),
        (269, vec![0x1e, 0x00, 0x00]),
        (1034, vec![0x1e, 0x02, 0xfd]),
    ] {
        let value = vec![0xab; len];
        let bytes = option_bytes(&[(1, &value)]);
        assert_eq!(&bytes[..head.len()], &head[..], "length {len}");
        assert_eq!(bytes.len(), head.len() + len);
    }
    // Both extended at once: delta 269 and length 13.
    let bytes = option_bytes(&[(269, &[7; 13])]);
    assert_eq!(&bytes[..4], &[0xed, 0x00, 0x00, 0x00]);
}

#[test]
fn repeated_options_keep_their_order_around_others() {
    let mut m = post();
    m.add_option(opt::URI_QUERY, &b"c=dev"[..]);
    m.add_option(opt::URI_PATH, &b"ps"[..]);
    m.add_uint_option(opt::CONTENT_FORMAT, 0);
    m.add_option(opt::URI_PATH, &b"a"[..]);
    m.add_option(opt::URI_QUERY, &b"qos=1"[..]);
    m.add_option(opt::URI_PATH, &b"b"[..]);
    let wire = m.to_udp();
    // Uri-Path ×3 (delta 11, 0, 0), Content-Format 0 (delta 1, empty), Uri-Query ×2.
    let expected = hex("40 02 01 02 b2 70 73 01 61 01 62 10 35 63 3d 64 65 76 05 71 6f 73 3d 31");
    assert_eq!(wire, expected);
    let back = decode(&wire).expect("decodes");
    let path: Vec<&[u8]> = back.uri_path().map(|s| s.as_ref()).collect();
    assert_eq!(path, vec![&b"ps"[..], &b"a"[..], &b"b"[..]]);
    assert_eq!(back.query("c"), Some(&b"dev"[..]));
    assert_eq!(back.query("qos"), Some(&b"1"[..]));
    assert_eq!(back.uint_option(opt::CONTENT_FORMAT), Some(0));
}

#[test]
fn uint_options_set_and_remove() {
    let mut m = post();
    m.add_uint_option(opt::MAX_AGE, 60);
    m.set_uint_option(opt::MAX_AGE, 0x0001_0000);
    assert_eq!(m.options_of(opt::MAX_AGE).count(), 1);
    let back = decode(&m.to_udp()).expect("decodes");
    assert_eq!(back.uint_option(opt::MAX_AGE), Some(0x0001_0000));
    m.remove_option(opt::MAX_AGE);
    assert_eq!(m.option(opt::MAX_AGE), None);
    assert_eq!(m.to_udp().len(), 4);
    // A uint longer than 4 bytes is not a uint.
    let mut m = post();
    m.add_option(opt::SIZE1, &[1u8, 2, 3, 4, 5][..]);
    assert_eq!(
        decode(&m.to_udp())
            .expect("decodes")
            .uint_option(opt::SIZE1),
        None
    );
}

/// Re-add the options of `m` in the order `keys` gives, keeping the relative order of
/// options with the same number: the same option set, added in another order.
fn interleave(m: &Message, keys: &[u32]) -> Message {
    let mut order: Vec<usize> = (0..m.options.len()).collect();
    order.sort_by_key(|&i| keys.get(i).copied().unwrap_or(0));
    // Stable per number: the k-th option with number n still comes k-th among those.
    let mut by_number: std::collections::BTreeMap<u16, Vec<&Bytes>> = Default::default();
    for o in &m.options {
        by_number.entry(o.number).or_default().push(&o.value);
    }
    let mut next: std::collections::BTreeMap<u16, usize> = Default::default();
    let mut out = Message::new(m.mtype, m.code, m.message_id, m.token);
    out.payload = m.payload.clone();
    for i in order {
        let n = m.options[i].number;
        let k = next.entry(n).or_default();
        out.add_option(n, by_number[&n][*k].clone());
        *k += 1;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The option list split into runs added in any order, or merged from several messages'
    /// lists, encodes to the same bytes and decodes equal.
    #[test]
    fn any_insertion_order_encodes_the_same(
        tok in token(),
        specs in option_specs(),
        body in payload(),
        keys in vec(any::<u32>(), 0..8),
    ) {
        let m = build(MsgType::Con, Code::POST.0, 7, tok, &specs, body);
        let shuffled = interleave(&m, &keys);
        prop_assert_eq!(&shuffled, &m);
        prop_assert_eq!(shuffled.to_udp(), m.to_udp());
        prop_assert_eq!(decode(&shuffled.to_udp()), Ok(m));
    }

    /// Two option lists merged (each option added to one message) decode to the union, in
    /// number order, with each list's repeats in their own order after the other's.
    #[test]
    fn merged_lists_decode_as_the_union(
        a in option_specs(),
        b in option_specs(),
    ) {
        let ma = build(MsgType::Non, Code::PUT.0, 1, Token::EMPTY, &a, Bytes::new());
        let mb = build(MsgType::Non, Code::PUT.0, 1, Token::EMPTY, &b, Bytes::new());
        let mut merged = ma.clone();
        for o in &mb.options {
            merged.add_option(o.number, o.value.clone());
        }
        let back = decode(&merged.to_udp()).expect("decodes");
        prop_assert_eq!(back.options.len(), ma.options.len() + mb.options.len());
        prop_assert!(back.options.windows(2).all(|w| w[0].number <= w[1].number));
        for n in back.options.iter().map(|o| o.number) {
            let got: Vec<&Bytes> = back.options_of(n).collect();
            let want: Vec<&Bytes> = ma.options_of(n).chain(mb.options_of(n)).collect();
            prop_assert_eq!(got, want);
        }
    }
}
