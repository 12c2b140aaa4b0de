//! Arbitrary and corrupted datagrams never panic the decoder, and whatever decodes
//! re-encodes to exactly the input (the property the fuzz target checks).

use proptest::collection::vec;
use proptest::prelude::*;

use crate::assert_canonical;
use crate::strategies::message;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn arbitrary_bytes(bytes in vec(any::<u8>(), 0..300)) {
        assert_canonical(&bytes);
    }

    /// Valid CoAP headers with arbitrary bodies reach the option decoder more often.
    #[test]
    fn valid_header_then_arbitrary_bytes(
        first in 0x40u8..=0x7f,
        rest in vec(any::<u8>(), 3..200),
    ) {
        let mut bytes = vec![first];
        bytes.extend(rest);
        assert_canonical(&bytes);
    }

    #[test]
    fn corrupted_messages(
        m in message(),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut bytes = m.to_udp().to_vec();
        for (at, xor) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= xor;
        }
        assert_canonical(&bytes);
    }
}
