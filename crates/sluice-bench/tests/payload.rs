//! The bench payload header as the sink sees what the devices wrote: round trips over edge
//! values, and foreign payloads rejected without panicking.

use sluice_bench::payload::{PayloadError, PayloadHeader, HEADER_LEN, MAGIC};

#[test]
fn header_round_trips_for_edge_values_and_every_payload_length_from_the_minimum() {
    let headers = [
        PayloadHeader {
            device: 0,
            seq: 0,
            sent_at_ns: 0,
        },
        PayloadHeader {
            device: u32::MAX,
            seq: u64::MAX,
            sent_at_ns: u64::MAX,
        },
        PayloadHeader {
            device: 16_383,
            seq: 599,
            sent_at_ns: 1_763_780_000_000_000_000,
        },
    ];
    for header in headers {
        for len in [HEADER_LEN, HEADER_LEN + 1, 100, 1024] {
            let mut payload = vec![0x5A; len];
            header
                .write_to(&mut payload)
                .expect("payload is at least the header");
            assert_eq!(&payload[..4], &MAGIC);
            assert_eq!(PayloadHeader::parse(&payload), Ok(header), "len {len}");
        }
    }
}

#[test]
fn header_layout_is_big_endian_at_the_documented_offsets() {
    let header = PayloadHeader {
        device: 0x0102_0304,
        seq: 0x1112_1314_1516_1718,
        sent_at_ns: 0x2122_2324_2526_2728,
    };
    let mut payload = [0u8; HEADER_LEN];
    header.write_to(&mut payload).expect("exact size");
    assert_eq!(
        payload,
        [
            b'S', b'L', b'B', b'1', 1, 2, 3, 4, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18,
            0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28
        ]
    );
}

#[test]
fn payloads_that_are_not_bench_payloads_are_reported_not_panicked_on() {
    for len in 0..HEADER_LEN {
        assert_eq!(
            PayloadHeader::parse(&vec![b'S'; len]),
            Err(PayloadError::TooShort(len))
        );
    }
    assert_eq!(
        PayloadHeader::parse(b"hello, this is a sensor reading"),
        Err(PayloadError::BadMagic)
    );
}
