//! IEEE 11073-20601 APDUs through the public API: every `phd_*` vector of the fact sheet
//! (copied into tests/vectors/) decodes to what the sheet says and re-encodes byte for byte;
//! a stream holding them all, split at every offset, yields the same APDUs; property tests
//! (round trip of generated APDUs, arbitrary bytes never panic).

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use sluice_proto::phd::apdu::{abort, result, AARE, DATA_PROTO_20601};
use sluice_proto::phd::{
    decode_apdu, Aare, Aarq, Apdu, DataApdu, DataMessage, DataProto, DecodeError,
    PhdAssociationInformation,
};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn vector(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/vectors/{name}.hex", env!("CARGO_MANIFEST_DIR"));
    hex(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
}

const VECTORS: &[&str] = &[
    "phd_po_A1_aarq_std0190",
    "phd_po_A2_aare_accepted",
    "phd_po_A3_scan_fixed_std0190",
    "phd_po_A4_scan_fixed_confirm",
    "phd_po_A5_rlrq_normal",
    "phd_po_A6_rlre_normal",
    "phd_po_B1_aarq_ext4000",
    "phd_po_B2_aare_accepted_unknown_config",
    "phd_po_B3_config_report_ext4000",
    "phd_po_B4_config_response_accepted",
    "phd_po_B5_scan_fixed_ext4000",
    "phd_po_B6_scan_fixed_confirm",
    "phd_po_B7_rlrq_normal",
    "phd_po_B8_rlre_normal",
    "phd_po_C1_config_report_std0190",
    "phd_po_C2_config_response_unsupported",
    "phd_po_C3_aare_rejected_no_common_protocol",
    "phd_po_C4_get_mds_request",
    "phd_po_C5_get_mds_response",
    "phd_abrt_undefined",
    "phd_abrt_buffer_overflow",
    "phd_abrt_response_timeout",
    "phd_abrt_configuration_timeout",
    "phd_rlrq_no_more_configurations",
    "phd_rlrq_configuration_changed",
    "phd_ws_D1_config_report_std05dc",
    "phd_ws_D2_scan_fixed_std05dc",
    "phd_ws_D3_scan_fixed_confirm",
    "phd_bp_E1_scan_fixed_std02bc",
    "phd_quirk_po_config_report_0191_time_abs",
];

fn decode_one(wire: &[u8]) -> Apdu {
    let mut buf = BytesMut::from(wire);
    let a = decode_apdu(&mut buf, 65_539)
        .unwrap()
        .expect("a whole APDU");
    assert!(buf.is_empty(), "APDU not consumed whole");
    a
}

fn encoded(a: &Apdu) -> Vec<u8> {
    let mut out = BytesMut::new();
    a.encode(&mut out);
    out.to_vec()
}

#[test]
fn every_vector_decodes_and_reencodes_byte_for_byte() {
    for name in VECTORS {
        let wire = vector(name);
        let a = decode_one(&wire);
        assert_eq!(encoded(&a), wire, "{name}: {a:?}");
    }
}

#[test]
fn the_pulse_oximeter_aarq_carries_its_association_information() {
    let Apdu::Aarq(Aarq {
        assoc_version,
        protos,
    }) = decode_one(&vector("phd_po_A1_aarq_std0190"))
    else {
        panic!("not an AARQ");
    };
    assert_eq!(assoc_version, 0x8000_0000);
    assert_eq!(protos.len(), 1);
    assert_eq!(protos[0].id, DATA_PROTO_20601);
    let info = PhdAssociationInformation::decode(protos[0].info.clone()).unwrap();
    assert_eq!(info.protocol_version, 0x8000_0000);
    assert_eq!(info.encoding_rules & 0x8000, 0x8000, "MDER offered");
    assert_eq!(info.system_type, 0x0080_0000, "sys-type-agent");
    assert_eq!(info.system_id.len(), 8);
    assert_eq!(info.dev_config_id, 0x0190);
    let mut back = BytesMut::new();
    info.encode(&mut back);
    assert_eq!(
        back.freeze(),
        protos[0].info,
        "association information re-encodes"
    );

    let Apdu::Aarq(ext) = decode_one(&vector("phd_po_B1_aarq_ext4000")) else {
        panic!("not an AARQ");
    };
    let info = PhdAssociationInformation::decode(ext.protos[0].info.clone()).unwrap();
    assert_eq!(info.dev_config_id, 0x4000);
}

#[test]
fn aare_results_are_read() {
    for (name, want) in [
        ("phd_po_A2_aare_accepted", result::ACCEPTED),
        (
            "phd_po_B2_aare_accepted_unknown_config",
            result::ACCEPTED_UNKNOWN_CONFIG,
        ),
        (
            "phd_po_C3_aare_rejected_no_common_protocol",
            result::REJECTED_NO_COMMON_PROTOCOL,
        ),
    ] {
        let Apdu::Aare(Aare { result, proto }) = decode_one(&vector(name)) else {
            panic!("{name}: not an AARE");
        };
        assert_eq!(result, want, "{name}");
        let info = PhdAssociationInformation::decode(proto.info).unwrap();
        assert_eq!(info.system_type, 0x8000_0000, "{name}: sys-type-manager");
    }
}

#[test]
fn reports_confirmations_and_release_decode_to_their_fields() {
    let Apdu::Prst(DataApdu {
        invoke_id,
        message:
            DataMessage::EventReport {
                confirmed,
                obj_handle,
                event_type,
                info,
                ..
            },
    }) = decode_one(&vector("phd_po_A3_scan_fixed_std0190"))
    else {
        panic!("not an event report");
    };
    assert_eq!(obj_handle, 0, "the MDS reports");
    assert_eq!(event_type, 0x0D1D, "MDC_NOTI_SCAN_REPORT_FIXED");
    assert!(!info.is_empty());
    assert!(confirmed, "A3 is a confirmed report (A4 confirms it)");
    // The confirmation a manager builds for it is the A4 vector.
    let confirm = DataApdu::confirm(invoke_id, obj_handle, event_type);
    assert_eq!(encoded(&confirm), vector("phd_po_A4_scan_fixed_confirm"));
    let Apdu::Prst(DataApdu {
        message:
            DataMessage::EventReportResult {
                event_type,
                reply_info,
                ..
            },
        ..
    }) = decode_one(&vector("phd_po_A4_scan_fixed_confirm"))
    else {
        panic!("not a confirmation");
    };
    assert_eq!(event_type, 0x0D1D);
    assert!(reply_info.is_empty());
    assert_eq!(
        decode_one(&vector("phd_po_A5_rlrq_normal")),
        Apdu::Rlrq { reason: 0 }
    );
    assert_eq!(
        decode_one(&vector("phd_po_A6_rlre_normal")),
        Apdu::Rlre { reason: 0 }
    );
    assert_eq!(
        decode_one(&vector("phd_abrt_configuration_timeout")),
        Apdu::Abrt {
            reason: abort::CONFIGURATION_TIMEOUT
        }
    );
    let Apdu::Prst(DataApdu {
        invoke_id,
        message: DataMessage::Get {
            obj_handle,
            attribute_ids,
        },
    }) = decode_one(&vector("phd_po_C4_get_mds_request"))
    else {
        panic!("not a GET");
    };
    assert_eq!(
        (obj_handle, attribute_ids.len()),
        (0, 0),
        "all MDS attributes"
    );
    let Apdu::Prst(resp) = decode_one(&vector("phd_po_C5_get_mds_response")) else {
        panic!("not a PRST");
    };
    assert_eq!(
        resp.invoke_id, invoke_id,
        "the response echoes the invoke-id"
    );
    assert!(matches!(resp.message, DataMessage::GetResult { .. }));
}

#[test]
fn a_stream_of_every_vector_split_at_every_offset_yields_the_same_apdus() {
    let mut stream = Vec::new();
    let mut want = Vec::new();
    for name in VECTORS {
        let wire = vector(name);
        want.push(decode_one(&wire));
        stream.extend(wire);
    }
    for split in 0..=stream.len() {
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for part in [&stream[..split], &stream[split..]] {
            buf.extend_from_slice(part);
            while let Some(a) = decode_apdu(&mut buf, 65_539).unwrap() {
                got.push(a);
            }
        }
        assert_eq!(got, want, "split at {split}");
        assert!(buf.is_empty());
    }
}

#[test]
fn an_apdu_over_the_limit_is_refused_from_its_header_and_bad_lengths_are_errors() {
    let mut buf = BytesMut::from(&[0xE7, 0x00, 0xFF, 0xFF][..]);
    assert!(matches!(
        decode_apdu(&mut buf, 1024),
        Err(DecodeError::TooLarge { .. })
    ));
    // PRST whose inner length disagrees with its own.
    let mut buf = BytesMut::from(&[0xE7, 0x00, 0x00, 0x04, 0x00, 0x05, 0x00, 0x00][..]);
    assert!(decode_apdu(&mut buf, 1024).is_err());
    // A SEQUENCE OF claiming more elements than its bytes can hold.
    let mut buf = BytesMut::from(
        &[
            0xE2, 0x00, 0x00, 0x08, 0x80, 0, 0, 0, 0x00, 0x09, 0x00, 0x00,
        ][..],
    );
    assert!(matches!(
        decode_apdu(&mut buf, 1024),
        Err(DecodeError::BadSequence { .. })
    ));
    let mut buf = BytesMut::from(&[0xE9, 0x00, 0x00, 0x00][..]);
    assert_eq!(
        decode_apdu(&mut buf, 1024),
        Err(DecodeError::UnknownApdu(0xE900))
    );
    // An AARE built by a manager round-trips.
    let aare = Apdu::Aare(Aare {
        result: result::ACCEPTED,
        proto: DataProto {
            id: DATA_PROTO_20601,
            info: Bytes::from_static(&[1, 2, 3]),
        },
    });
    let wire = encoded(&aare);
    assert_eq!(&wire[..2], &AARE.to_be_bytes());
    assert_eq!(decode_one(&wire), aare);
}

fn bytes_of(max: usize) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn data_message() -> impl Strategy<Value = DataMessage> {
    prop_oneof![
        (
            any::<bool>(),
            any::<u16>(),
            any::<u32>(),
            any::<u16>(),
            bytes_of(64)
        )
            .prop_map(|(confirmed, obj_handle, event_time, event_type, info)| {
                DataMessage::EventReport {
                    confirmed,
                    obj_handle,
                    event_time,
                    event_type,
                    info,
                }
            }),
        (any::<u16>(), any::<u32>(), any::<u16>(), bytes_of(16)).prop_map(
            |(obj_handle, current_time, event_type, reply_info)| {
                DataMessage::EventReportResult {
                    obj_handle,
                    current_time,
                    event_type,
                    reply_info,
                }
            }
        ),
        (any::<u16>(), proptest::collection::vec(any::<u16>(), 0..8)).prop_map(
            |(obj_handle, attribute_ids)| DataMessage::Get {
                obj_handle,
                attribute_ids
            }
        ),
        (any::<u16>(), bytes_of(16))
            .prop_map(|(error, parameter)| DataMessage::Error { error, parameter }),
        any::<u16>().prop_map(|problem| DataMessage::Reject { problem }),
    ]
}

fn apdu() -> impl Strategy<Value = Apdu> {
    prop_oneof![
        (
            any::<u32>(),
            proptest::collection::vec((any::<u16>(), bytes_of(48)), 0..3)
        )
            .prop_map(|(assoc_version, protos)| Apdu::Aarq(Aarq {
                assoc_version,
                protos: protos
                    .into_iter()
                    .map(|(id, info)| DataProto { id, info })
                    .collect()
            })),
        (any::<u16>(), any::<u16>(), bytes_of(48)).prop_map(|(result, id, info)| Apdu::Aare(
            Aare {
                result,
                proto: DataProto { id, info }
            }
        )),
        any::<u16>().prop_map(|reason| Apdu::Rlrq { reason }),
        any::<u16>().prop_map(|reason| Apdu::Rlre { reason }),
        any::<u16>().prop_map(|reason| Apdu::Abrt { reason }),
        (any::<u16>(), data_message())
            .prop_map(|(invoke_id, message)| Apdu::Prst(DataApdu { invoke_id, message })),
    ]
}

proptest! {
    #[test]
    fn generated_apdus_round_trip(a in apdu()) {
        let wire = encoded(&a);
        prop_assert_eq!(decode_one(&wire), a);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut buf = BytesMut::from(&b[..]);
        for _ in 0..8 {
            match decode_apdu(&mut buf, 65_539) {
                Ok(Some(_)) => continue,
                _ => break,
            }
        }
    }
}
