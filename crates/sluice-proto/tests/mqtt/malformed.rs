//! Every malformation the specifications define gives its own error, and the size limit is
//! enforced before the body arrives. (What the encoder refuses to write: `encoder.rs`.)

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use sluice_proto::mqtt::{Auth, DecodeError, Decoder, Packet, Properties, ProtocolVersion};

use crate::hex;

const V3: ProtocolVersion = ProtocolVersion::V311;
const V5: ProtocolVersion = ProtocolVersion::V5;

/// A packet with first byte `first` and body `body` (hex), remaining length filled in.
fn packet(first: u8, body: &str) -> Vec<u8> {
    let body = hex(body);
    let mut out = vec![first];
    let mut len = body.len();
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if len == 0 {
            break;
        }
    }
    out.extend(body);
    out
}

fn decode_with(decoder: &mut Decoder, bytes: &[u8]) -> Result<Option<Packet>, DecodeError> {
    decoder.decode(&mut BytesMut::from(bytes))
}

fn client_error(version: ProtocolVersion, bytes: &[u8]) -> DecodeError {
    decode_with(&mut Decoder::client(version, usize::MAX), bytes).expect_err("must be rejected")
}

fn server_error(bytes: &[u8]) -> DecodeError {
    decode_with(&mut Decoder::server(usize::MAX), bytes).expect_err("must be rejected")
}

fn malformed(packet: &'static str, reason: &'static str) -> DecodeError {
    DecodeError::Malformed { packet, reason }
}

/// CONNECT for `level` with connect `flags`, keep alive 60, and payload `payload` (hex).
fn connect(level: u8, flags: u8, payload: &str) -> Vec<u8> {
    let props = if level == 5 { "00" } else { "" };
    packet(
        0x10,
        &format!("00 04 4d 51 54 54 {level:02x} {flags:02x} 00 3c {props} {payload}"),
    )
}

// ---- size limits --------------------------------------------------------------------------

#[test]
fn packet_larger_than_the_maximum_is_rejected_from_its_fixed_header_alone() {
    let mut decoder = Decoder::client(V3, 1024);
    // PUBLISH announcing 65,535 bytes of body; none of the body has arrived.
    let mut buf = BytesMut::from(&hex("30 ff ff 03")[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Err(DecodeError::PacketTooLarge {
            size: 4 + 65_535,
            max: 1024
        })
    );
}

#[test]
fn server_rejects_an_oversized_connect_before_its_body_arrives() {
    let mut decoder = Decoder::server(100);
    let mut buf = BytesMut::from(&hex("10 e5 00")[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Err(DecodeError::PacketTooLarge {
            size: 3 + 101,
            max: 100
        })
    );
}

#[test]
fn packet_exactly_at_the_maximum_size_is_accepted_and_one_byte_more_is_not() {
    let bytes = packet(0x30, "00 01 61 00 01 02 03 04 05 06 07 08 09");
    let mut at_limit = Decoder::client(V3, bytes.len());
    assert!(matches!(
        decode_with(&mut at_limit, &bytes),
        Ok(Some(Packet::Publish(_)))
    ));
    let mut below = Decoder::client(V3, bytes.len() - 1);
    assert_eq!(
        decode_with(&mut below, &bytes),
        Err(DecodeError::PacketTooLarge {
            size: bytes.len(),
            max: bytes.len() - 1
        })
    );
}

#[test]
fn lowering_the_maximum_applies_to_the_next_packet() {
    let bytes = packet(0x30, "00 01 61 00 01 02 03");
    let mut decoder = Decoder::client(V3, 1000);
    decoder.set_max_packet_size(4);
    assert!(matches!(
        decode_with(&mut decoder, &bytes),
        Err(DecodeError::PacketTooLarge { .. })
    ));
}

#[test]
fn remaining_length_longer_than_four_bytes_is_malformed() {
    assert_eq!(
        client_error(V3, &hex("30 ff ff ff ff 01")),
        DecodeError::MalformedLength
    );
    // Known after the fourth length byte, before a fifth arrives.
    assert_eq!(
        client_error(V3, &hex("30 80 80 80 80")),
        DecodeError::MalformedLength
    );
}

#[test]
fn incomplete_remaining_length_asks_for_more_without_consuming() {
    let mut buf = BytesMut::from(&hex("30 ff ff")[..]);
    assert_eq!(Decoder::client(V3, usize::MAX).decode(&mut buf), Ok(None));
    assert_eq!(buf.len(), 3);
    let mut empty = BytesMut::new();
    assert_eq!(Decoder::server(10).decode(&mut empty), Ok(None));
}

#[test]
fn v5_rejects_a_non_minimal_remaining_length_and_v311_tolerates_it() {
    assert_eq!(
        client_error(V5, &hex("c0 80 00")),
        malformed("PINGREQ", "remaining length not minimally encoded")
    );
    assert_eq!(
        decode_with(&mut Decoder::client(V3, 10), &hex("c0 80 00")),
        Ok(Some(Packet::PingReq))
    );
}

// ---- packet types and the first packet ----------------------------------------------------

#[test]
fn server_requires_connect_as_the_first_packet() {
    let first_must_be_connect = DecodeError::Protocol("first packet must be CONNECT");
    assert_eq!(server_error(&hex("c0 00")), first_must_be_connect);
    // Known from the first byte.
    assert_eq!(server_error(&hex("30")), first_must_be_connect);
    assert_eq!(server_error(&hex("00 00")), first_must_be_connect);
}

#[test]
fn reserved_packet_types_are_unknown_and_auth_does_not_exist_in_v311() {
    assert_eq!(
        client_error(V3, &hex("00 00")),
        DecodeError::UnknownPacketType(0)
    );
    assert_eq!(
        client_error(V5, &hex("00 00")),
        DecodeError::UnknownPacketType(0)
    );
    assert_eq!(
        client_error(V3, &hex("f0 00")),
        DecodeError::UnknownPacketType(15)
    );
    assert_eq!(
        decode_with(&mut Decoder::client(V5, 10), &hex("f0 00")),
        Ok(Some(Packet::Auth(Auth {
            reason: 0,
            properties: Properties::default()
        })))
    );
}

#[test]
fn reserved_fixed_header_flags_are_malformed() {
    let not_0010 = "reserved fixed-header flags are not 0010";
    let not_0000 = "reserved fixed-header flags are not 0000";
    assert_eq!(
        client_error(V3, &hex("60 02 00 01")),
        malformed("PUBREL", not_0010)
    );
    assert_eq!(
        client_error(V3, &hex("80 06 00 01 00 01 61 00")),
        malformed("SUBSCRIBE", not_0010)
    );
    assert_eq!(
        client_error(V3, &hex("a3 05 00 01 00 01 61")),
        malformed("UNSUBSCRIBE", not_0010)
    );
    assert_eq!(
        client_error(V3, &hex("41 02 00 01")),
        malformed("PUBACK", not_0000)
    );
    assert_eq!(
        client_error(V5, &hex("c1 00")),
        malformed("PINGREQ", not_0000)
    );
    assert_eq!(
        client_error(V5, &hex("e8 00")),
        malformed("DISCONNECT", not_0000)
    );
    assert_eq!(
        server_error(&packet(0x12, "00 04 4d 51 54 54 04 02 00 3c 00 00")),
        malformed("CONNECT", not_0000)
    );
}

#[test]
fn publish_with_qos_3_or_dup_on_qos_0_is_malformed() {
    assert_eq!(
        client_error(V3, &hex("36 05 00 01 61 00 01")),
        malformed("PUBLISH", "QoS 3")
    );
    assert_eq!(
        client_error(V3, &hex("38 03 00 01 61")),
        malformed("PUBLISH", "DUP set on a QoS 0 message")
    );
}

// ---- CONNECT ------------------------------------------------------------------------------

#[test]
fn connect_with_another_protocol_level_is_unsupported() {
    let mqisdp = packet(0x10, "00 06 4d 51 49 73 64 70 03 02 00 3c 00 00");
    assert_eq!(
        server_error(&mqisdp),
        DecodeError::UnsupportedProtocolLevel(3)
    );
    assert_eq!(
        server_error(&connect(3, 0x02, "00 00")),
        DecodeError::UnsupportedProtocolLevel(3)
    );
    assert_eq!(
        server_error(&connect(6, 0x02, "00 00")),
        DecodeError::UnsupportedProtocolLevel(6)
    );
    let mut decoder = Decoder::server(1000);
    let _ = decode_with(&mut decoder, &mqisdp);
    assert_eq!(
        decoder.version(),
        None,
        "a rejected CONNECT fixes no version"
    );
}

#[test]
fn connect_with_a_protocol_name_other_than_mqtt_is_malformed() {
    let bytes = packet(0x10, "00 04 4d 51 54 58 04 02 00 3c 00 00");
    assert_eq!(
        server_error(&bytes),
        malformed("CONNECT", "protocol name is not MQTT")
    );
}

#[test]
fn connect_flag_rules_are_enforced() {
    assert_eq!(
        server_error(&connect(4, 0x03, "00 00")),
        malformed("CONNECT", "reserved connect flag is set")
    );
    let no_will = "will QoS or will retain set without a will";
    assert_eq!(
        server_error(&connect(4, 0x0a, "00 00")),
        malformed("CONNECT", no_will)
    );
    assert_eq!(
        server_error(&connect(5, 0x22, "00 00")),
        malformed("CONNECT", no_will)
    );
    assert_eq!(
        server_error(&connect(4, 0x1e, "00 00 00 01 74 00 00")),
        malformed("CONNECT", "will QoS 3")
    );
}

#[test]
fn password_without_user_name_is_malformed_in_v311_and_allowed_in_v5() {
    assert_eq!(
        server_error(&connect(4, 0x42, "00 00 00 01 70")),
        malformed("CONNECT", "password without user name")
    );
    let mut decoder = Decoder::server(1000);
    let Ok(Some(Packet::Connect(c))) =
        decode_with(&mut decoder, &connect(5, 0x42, "00 00 00 01 70"))
    else {
        panic!("v5 CONNECT with only a password must decode");
    };
    assert_eq!(
        (c.username, c.password),
        (None, Some(Bytes::from_static(b"p")))
    );
}

#[test]
fn connect_with_a_wildcard_will_topic_is_malformed() {
    assert_eq!(
        server_error(&connect(4, 0x06, "00 00 00 01 23 00 00")),
        malformed("CONNECT", "will topic is not a valid topic name")
    );
}

#[test]
fn connect_with_bytes_after_the_last_field_is_malformed() {
    assert_eq!(
        server_error(&connect(4, 0x02, "00 00 ff")),
        malformed("CONNECT", "trailing bytes after the last field")
    );
}

#[test]
fn connect_ending_inside_a_field_is_malformed() {
    assert_eq!(
        server_error(&connect(4, 0x82, "00 00 00 05 75")),
        malformed("CONNECT", "packet ends inside a field")
    );
}

// ---- strings ------------------------------------------------------------------------------

#[test]
fn strings_must_be_valid_utf8_without_nul() {
    assert_eq!(
        client_error(V3, &hex("30 04 00 02 c3 28")),
        malformed("PUBLISH", "string is not valid UTF-8")
    );
    // An encoded surrogate (U+D800) is not valid UTF-8.
    assert_eq!(
        client_error(V3, &hex("30 05 00 03 ed a0 80")),
        malformed("PUBLISH", "string is not valid UTF-8")
    );
    assert_eq!(
        client_error(V3, &hex("30 05 00 03 61 00 62")),
        malformed("PUBLISH", "string contains U+0000")
    );
    assert_eq!(
        server_error(&connect(4, 0x02, "00 01 00")),
        malformed("CONNECT", "string contains U+0000")
    );
}

#[test]
fn publish_topic_must_be_a_topic_name() {
    assert_eq!(
        client_error(V3, &hex("30 05 00 03 61 2f 2b")),
        malformed("PUBLISH", "topic name contains a wildcard")
    );
    assert_eq!(
        client_error(V3, &hex("30 02 00 00")),
        malformed("PUBLISH", "empty topic name")
    );
    assert_eq!(
        client_error(V5, &hex("30 03 00 00 00")),
        DecodeError::Protocol("PUBLISH with empty topic and no Topic Alias")
    );
    // With a Topic Alias the topic may be empty.
    assert!(matches!(
        decode_with(
            &mut Decoder::client(V5, 100),
            &hex("30 06 00 00 03 23 00 01")
        ),
        Ok(Some(Packet::Publish(_)))
    ));
}

// ---- packet identifiers -------------------------------------------------------------------

#[test]
fn packet_identifier_zero_is_malformed_wherever_one_is_required() {
    let zero = "packet identifier is 0";
    assert_eq!(
        client_error(V3, &hex("32 05 00 01 61 00 00")),
        malformed("PUBLISH", zero)
    );
    assert_eq!(
        client_error(V3, &hex("40 02 00 00")),
        malformed("PUBACK", zero)
    );
    assert_eq!(
        client_error(V5, &hex("50 02 00 00")),
        malformed("PUBREC", zero)
    );
    assert_eq!(
        client_error(V3, &hex("62 02 00 00")),
        malformed("PUBREL", zero)
    );
    assert_eq!(
        client_error(V5, &hex("70 02 00 00")),
        malformed("PUBCOMP", zero)
    );
    assert_eq!(
        client_error(V3, &hex("82 06 00 00 00 01 61 00")),
        malformed("SUBSCRIBE", zero)
    );
    assert_eq!(
        client_error(V3, &hex("90 03 00 00 00")),
        malformed("SUBACK", zero)
    );
    assert_eq!(
        client_error(V3, &hex("a2 05 00 00 00 01 61")),
        malformed("UNSUBSCRIBE", zero)
    );
    assert_eq!(
        client_error(V3, &hex("b0 02 00 00")),
        malformed("UNSUBACK", zero)
    );
}

// ---- SUBSCRIBE / UNSUBSCRIBE --------------------------------------------------------------

#[test]
fn subscribe_and_unsubscribe_without_filters_are_protocol_errors() {
    assert_eq!(
        client_error(V3, &hex("82 02 00 01")),
        DecodeError::Protocol("SUBSCRIBE without topic filters")
    );
    assert_eq!(
        client_error(V5, &hex("82 03 00 01 00")),
        DecodeError::Protocol("SUBSCRIBE without topic filters")
    );
    assert_eq!(
        client_error(V3, &hex("a2 02 00 01")),
        DecodeError::Protocol("UNSUBSCRIBE without topic filters")
    );
    assert_eq!(
        client_error(V5, &hex("a2 03 00 01 00")),
        DecodeError::Protocol("UNSUBSCRIBE without topic filters")
    );
}

#[test]
fn subscription_option_reserved_bits_and_values_are_checked() {
    let reserved = malformed("SUBSCRIBE", "reserved subscription option bits are set");
    // 3.1.1: only the QoS bits exist.
    assert_eq!(client_error(V3, &hex("82 06 00 01 00 01 61 04")), reserved);
    // 5.0: bits 6 and 7 are reserved.
    assert_eq!(
        client_error(V5, &hex("82 07 00 01 00 00 01 61 40")),
        reserved
    );
    assert_eq!(
        client_error(V5, &hex("82 07 00 01 00 00 01 61 03")),
        malformed("SUBSCRIBE", "QoS 3")
    );
    assert_eq!(
        client_error(V5, &hex("82 07 00 01 00 00 01 61 30")),
        malformed("SUBSCRIBE", "retain handling 3")
    );
    assert_eq!(
        client_error(V5, &hex("82 0d 00 01 00  00 07 24 73 68 61 72 65 2f  04")),
        DecodeError::Protocol("No Local set on a shared subscription")
    );
}

#[test]
fn subscribe_ending_after_a_filter_without_options_is_malformed() {
    assert_eq!(
        client_error(V3, &hex("82 05 00 01 00 01 61")),
        malformed("SUBSCRIBE", "packet ends inside a field")
    );
}

// ---- acknowledgements ---------------------------------------------------------------------

#[test]
fn acknowledgements_must_carry_reason_codes_their_packet_allows() {
    let not_allowed = "reason code not allowed on this packet";
    assert_eq!(
        client_error(V5, &hex("40 03 00 01 92")),
        malformed("PUBACK", not_allowed)
    );
    assert_eq!(
        client_error(V5, &hex("62 03 00 01 10")),
        malformed("PUBREL", not_allowed)
    );
    assert_eq!(
        client_error(V3, &hex("90 03 00 01 87")),
        malformed("SUBACK", not_allowed)
    );
    assert_eq!(
        client_error(V3, &hex("20 02 00 06")),
        malformed("CONNACK", not_allowed)
    );
    assert_eq!(
        client_error(V5, &hex("e0 01 01")),
        malformed("DISCONNECT", not_allowed)
    );
    assert_eq!(
        client_error(V5, &hex("b0 04 00 01 00 12")),
        malformed("UNSUBACK", not_allowed)
    );
    assert_eq!(
        client_error(V3, &hex("90 02 00 01")),
        malformed("SUBACK", "no reason codes")
    );
    assert_eq!(
        client_error(V5, &hex("b0 03 00 01 00")),
        malformed("UNSUBACK", "no reason codes")
    );
}

#[test]
fn connack_flags_and_session_present_rules_are_enforced() {
    assert_eq!(
        client_error(V3, &hex("20 02 02 00")),
        malformed("CONNACK", "reserved acknowledge flags are set")
    );
    assert_eq!(
        client_error(V5, &hex("20 03 01 80 00")),
        DecodeError::Protocol("CONNACK has session present with a non-zero code")
    );
}

#[test]
fn v311_acknowledgements_have_fixed_lengths() {
    let trailing = "trailing bytes after the last field";
    assert_eq!(
        client_error(V3, &hex("40 03 00 01 00")),
        malformed("PUBACK", trailing)
    );
    assert_eq!(
        client_error(V3, &hex("b0 03 00 01 00")),
        malformed("UNSUBACK", trailing)
    );
    assert_eq!(
        client_error(V3, &hex("20 03 00 00 00")),
        malformed("CONNACK", trailing)
    );
    assert_eq!(
        client_error(V3, &hex("e0 01 00")),
        malformed("DISCONNECT", trailing)
    );
    assert_eq!(
        client_error(V3, &hex("c0 01 00")),
        malformed("PINGREQ", trailing)
    );
    assert_eq!(
        client_error(V5, &hex("d0 01 00")),
        malformed("PINGRESP", trailing)
    );
    assert_eq!(
        client_error(V5, &hex("40 05 00 01 00 00 ff")),
        malformed("PUBACK", trailing)
    );
}

#[test]
fn v5_auth_of_one_byte_is_malformed() {
    assert_eq!(
        client_error(V5, &hex("f0 01 00")),
        malformed("AUTH", "packet ends inside a field")
    );
}

// ---- properties ---------------------------------------------------------------------------

#[test]
fn property_not_allowed_on_the_packet_is_rejected() {
    // Session Expiry Interval on PUBLISH.
    assert_eq!(
        client_error(V5, &hex("30 09 00 01 61 05 11 00 00 00 01")),
        DecodeError::PropertyNotAllowed {
            packet: "PUBLISH",
            property: 0x11
        }
    );
    // Unknown identifier 0x7f.
    assert_eq!(
        client_error(V5, &hex("30 06 00 01 61 02 7f 00")),
        DecodeError::PropertyNotAllowed {
            packet: "PUBLISH",
            property: 0x7f
        }
    );
    // Will Delay Interval belongs in the will properties, not the CONNECT properties.
    assert_eq!(
        server_error(&packet(
            0x10,
            "00 04 4d 51 54 54 05 02 00 3c 05 18 00 00 00 01 00 00"
        )),
        DecodeError::PropertyNotAllowed {
            packet: "CONNECT",
            property: 0x18
        }
    );
    // UNSUBSCRIBE allows only User Property.
    assert_eq!(
        client_error(V5, &hex("a2 08 00 01 02 0b 01 00 01 61")),
        DecodeError::PropertyNotAllowed {
            packet: "UNSUBSCRIBE",
            property: 0x0b
        }
    );
}

#[test]
fn duplicate_single_occurrence_property_is_rejected() {
    assert_eq!(
        client_error(V5, &hex("30 0e 00 01 61 0a 02 00 00 00 01 02 00 00 00 02")),
        DecodeError::DuplicateProperty {
            packet: "PUBLISH",
            property: "Message Expiry Interval"
        }
    );
    assert_eq!(
        client_error(V5, &hex("82 0b 00 01 04 0b 01 0b 02 00 01 61 00")),
        DecodeError::DuplicateProperty {
            packet: "SUBSCRIBE",
            property: "Subscription Identifier"
        }
    );
}

#[test]
fn repeatable_properties_may_repeat() {
    let bytes = hex("30 0d 00 01 61 09 0b 01 0b 02 26 00 00 00 00");
    let Ok(Some(Packet::Publish(p))) = decode_with(&mut Decoder::client(V5, 100), &bytes) else {
        panic!("PUBLISH with repeated properties must decode");
    };
    let props = p.properties.expect("properties present");
    assert_eq!(props.subscription_identifiers, vec![1, 2]);
    assert_eq!(
        props.user_properties,
        vec![(ByteString::new(), ByteString::new())]
    );
}

#[test]
fn forbidden_property_values_are_protocol_errors() {
    assert_eq!(
        server_error(&packet(
            0x10,
            "00 04 4d 51 54 54 05 02 00 3c 03 21 00 00 00 00"
        )),
        DecodeError::Protocol("Receive Maximum is 0")
    );
    assert_eq!(
        client_error(V5, &hex("30 06 00 01 61 02 01 02")),
        DecodeError::Protocol("Payload Format Indicator is not 0 or 1")
    );
    assert_eq!(
        client_error(V5, &hex("30 07 00 01 61 03 23 00 00")),
        DecodeError::Protocol("Topic Alias is 0")
    );
    assert_eq!(
        client_error(V5, &hex("82 08 00 01 02 0b 00 00 01 61 00")),
        DecodeError::Protocol("Subscription Identifier is 0 or above 268,435,455")
    );
    assert_eq!(
        client_error(V5, &hex("f0 06 18 04 16 00 01 78")),
        DecodeError::Protocol("Authentication Data without Authentication Method")
    );
}

#[test]
fn property_block_longer_than_the_packet_is_malformed() {
    assert_eq!(
        client_error(V5, &hex("30 06 00 01 61 05 01 00")),
        malformed("PUBLISH", "packet ends inside a field")
    );
    assert_eq!(
        client_error(V5, &hex("30 08 00 01 61 80 80 80 80 01")),
        malformed("PUBLISH", "variable byte integer longer than 4 bytes")
    );
}

#[test]
fn decode_errors_map_to_the_mqtt5_reason_code_for_the_closing_packet() {
    assert_eq!(
        DecodeError::PacketTooLarge { size: 2, max: 1 }.reason_code(),
        0x95
    );
    assert_eq!(malformed("PUBLISH", "QoS 3").reason_code(), 0x81);
    assert_eq!(DecodeError::Protocol("x").reason_code(), 0x82);
    assert_eq!(DecodeError::UnsupportedProtocolLevel(3).reason_code(), 0x84);
}
