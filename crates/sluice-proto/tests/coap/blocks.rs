//! Block1/Block2 option values (RFC 7959 §2.2): every 0–3 byte uint is a block and round
//! trips; sizes and offsets follow SZX; the value travels in its shortest uint form.

use proptest::prelude::*;
use sluice_proto::coap::{opt, Block, Code, Message, MsgType, Token};

use crate::decode;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn block_values_round_trip(v in 0u32..=0x00FF_FFFF) {
        let b = Block::from_uint(v).expect("three bytes are a block");
        prop_assert_eq!(b.to_uint(), v);
        prop_assert_eq!(b.size(), 16usize << b.szx.min(6));
        prop_assert_eq!(b.offset(), b.num as usize * b.size());
        // As an option on the wire: the shortest uint, decoded back to the same block.
        let mut m = Message::new(MsgType::Con, Code::POST, 1, Token::EMPTY);
        m.add_uint_option(opt::BLOCK1, v);
        let back = decode(&m.to_udp()).expect("decodes");
        let len = back.option(opt::BLOCK1).expect("Block1").len();
        prop_assert_eq!(len, (4 - v.leading_zeros() as usize / 8).min(3));
        prop_assert_eq!(Block::from_uint(back.uint_option(opt::BLOCK1).expect("uint")), Some(b));
    }

    #[test]
    fn values_over_three_bytes_are_not_blocks(v in 0x0100_0000u32..) {
        prop_assert_eq!(Block::from_uint(v), None);
    }

    #[test]
    fn szx_for_picks_the_largest_block_that_fits(bytes in 0usize..5000) {
        let szx = Block::szx_for(bytes);
        prop_assert!(szx <= 6);
        let size = 16usize << szx;
        prop_assert!(size <= bytes.max(16));
        prop_assert!(szx == 6 || size * 2 > bytes);
    }
}

#[test]
fn block_zero_is_an_empty_option() {
    let b = Block {
        num: 0,
        more: false,
        szx: 0,
    };
    assert_eq!(b.to_uint(), 0);
    let mut m = Message::new(MsgType::Con, Code::GET, 1, Token::EMPTY);
    m.add_uint_option(opt::BLOCK2, b.to_uint());
    // Delta 23 (nibble 13, 23 - 13), length 0.
    assert_eq!(&m.to_udp()[4..], &[0xd0, 10]);
}
