//! One CoAP message (RFC 7252 §3): type, code, message id, token, options, payload — and the
//! UDP encoding of it. The option/payload part is shared with CoAP over TCP (RFC 8323, `tcp`).
//!
//! Invariants: decoding never panics on any input; a decoded message's options are in
//! ascending option-number order (the wire order), repeated options keep their order; a
//! message encoded by [`Message::encode_udp`] decodes back to an equal message.

use bytes::{BufMut, Bytes, BytesMut};

use super::{Code, Token};

/// CoAP over UDP message types (RFC 7252 §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgType {
    /// Confirmable: ACKed or RST by the peer, retransmitted until then.
    Con = 0,
    /// Non-confirmable.
    Non = 1,
    /// Acknowledgement of a CON (same message id), possibly carrying the response.
    Ack = 2,
    /// Reset: the CON or NON with this message id was not processed.
    Rst = 3,
}

impl MsgType {
    fn from_bits(b: u8) -> MsgType {
        match b & 3 {
            0 => MsgType::Con,
            1 => MsgType::Non,
            2 => MsgType::Ack,
            _ => MsgType::Rst,
        }
    }
}

/// One option: its number and raw value. Use [`Message::uint_option`] and friends to read
/// typed values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoapOption {
    pub number: u16,
    pub value: Bytes,
}

/// A CoAP message. Over TCP (RFC 8323) `mtype` and `message_id` are not on the wire: they
/// are `Con` and 0 after decoding and ignored when encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub mtype: MsgType,
    pub code: Code,
    pub message_id: u16,
    pub token: Token,
    /// In ascending option-number order (kept so by [`Message::add_option`]).
    pub options: Vec<CoapOption>,
    pub payload: Bytes,
}

/// The fixed header of a datagram that was readable before the error, so the receiver can
/// answer a CON with RST (RFC 7252 §4.2) or a request with 4.00.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub mtype: MsgType,
    pub code: Code,
    pub message_id: u16,
}

/// Why bytes are not a CoAP message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeErrorKind {
    #[error("shorter than the 4-byte header")]
    TooShort,
    #[error("version {0} (only 1 is CoAP)")]
    BadVersion(u8),
    #[error("token length {0} (at most 8)")]
    TokenTooLong(u8),
    #[error("token runs past the end of the message")]
    TruncatedToken,
    #[error("option nibble 15 (reserved) outside the payload marker")]
    ReservedNibble,
    #[error("option runs past the end of the message")]
    TruncatedOption,
    #[error("option number above 65535")]
    OptionNumberOverflow,
    #[error("payload marker with an empty payload")]
    EmptyPayload,
    #[error("empty message (code 0.00) with a token, options or payload")]
    NonEmptyEmpty,
    /// RFC 8323 framing: the length field announces more than the limit the reader set.
    #[error("message of {0} bytes is over the limit")]
    TooLarge(u64),
}

/// A decoding error, with the header when it was readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct DecodeError {
    pub kind: DecodeErrorKind,
    pub header: Option<Header>,
}

impl DecodeError {
    fn bare(kind: DecodeErrorKind) -> DecodeError {
        DecodeError { kind, header: None }
    }
}

impl Message {
    /// A message with no options and no payload.
    pub fn new(mtype: MsgType, code: Code, message_id: u16, token: Token) -> Message {
        Message {
            mtype,
            code,
            message_id,
            token,
            options: Vec::new(),
            payload: Bytes::new(),
        }
    }

    /// The empty ACK (or RST) for message id `mid`.
    pub fn empty(mtype: MsgType, message_id: u16) -> Message {
        Message::new(mtype, Code::EMPTY, message_id, Token::EMPTY)
    }

    /// Decode one UDP datagram.
    pub fn decode_udp(datagram: &Bytes) -> Result<Message, DecodeError> {
        let b = datagram.as_ref();
        if b.len() < 4 {
            return Err(DecodeError::bare(DecodeErrorKind::TooShort));
        }
        let header = Header {
            mtype: MsgType::from_bits(b[0] >> 4),
            code: Code(b[1]),
            message_id: u16::from_be_bytes([b[2], b[3]]),
        };
        let with = |kind| DecodeError {
            kind,
            header: Some(header),
        };
        let version = b[0] >> 6;
        if version != 1 {
            return Err(with(DecodeErrorKind::BadVersion(version)));
        }
        let tkl = b[0] & 0x0F;
        if tkl > 8 {
            return Err(with(DecodeErrorKind::TokenTooLong(tkl)));
        }
        if header.code == Code::EMPTY && b.len() != 4 {
            return Err(with(DecodeErrorKind::NonEmptyEmpty));
        }
        let end = 4 + tkl as usize;
        if b.len() < end {
            return Err(with(DecodeErrorKind::TruncatedToken));
        }
        let token =
            Token::from_slice(&b[4..end]).ok_or(with(DecodeErrorKind::TokenTooLong(tkl)))?;
        let (options, payload) = decode_options(datagram, end).map_err(with)?;
        Ok(Message {
            mtype: header.mtype,
            code: header.code,
            message_id: header.message_id,
            token,
            options,
            payload,
        })
    }

    /// Append the UDP encoding to `out`.
    pub fn encode_udp(&self, out: &mut BytesMut) {
        let token = self.token.as_slice();
        out.reserve(4 + token.len() + self.options_len() + 1 + self.payload.len());
        out.put_u8(0x40 | (self.mtype as u8) << 4 | token.len() as u8);
        out.put_u8(self.code.0);
        out.put_u16(self.message_id);
        out.put_slice(token);
        encode_options(&self.options, &self.payload, out);
    }

    /// The UDP encoding as one datagram.
    pub fn to_udp(&self) -> Bytes {
        let mut out = BytesMut::new();
        self.encode_udp(&mut out);
        out.freeze()
    }

    /// Bytes the options and payload take on the wire (marker included).
    pub fn options_len(&self) -> usize {
        let mut last = 0u16;
        let mut n = 0;
        for o in &self.options {
            n += 1 + ext_len((o.number - last) as u32) + ext_len(o.value.len() as u32);
            n += o.value.len();
            last = o.number;
        }
        if !self.payload.is_empty() {
            n += 1 + self.payload.len();
        }
        n
    }

    /// The first value of option `number`.
    pub fn option(&self, number: u16) -> Option<&Bytes> {
        self.options
            .iter()
            .find(|o| o.number == number)
            .map(|o| &o.value)
    }

    /// Every value of option `number`, in order.
    pub fn options_of(&self, number: u16) -> impl Iterator<Item = &Bytes> + '_ {
        self.options
            .iter()
            .filter(move |o| o.number == number)
            .map(|o| &o.value)
    }

    /// Option `number` as a uint (RFC 7252 §3.2); `None` when absent or longer than 4 bytes.
    pub fn uint_option(&self, number: u16) -> Option<u32> {
        let v = self.option(number)?;
        if v.len() > 4 {
            return None;
        }
        Some(v.iter().fold(0u32, |acc, b| acc << 8 | *b as u32))
    }

    /// Add an option, after any with the same number (order of repeats is kept).
    pub fn add_option(&mut self, number: u16, value: impl Into<Bytes>) {
        let at = self.options.partition_point(|o| o.number <= number);
        self.options.insert(
            at,
            CoapOption {
                number,
                value: value.into(),
            },
        );
    }

    /// Add a uint option in its shortest form.
    pub fn add_uint_option(&mut self, number: u16, value: u32) {
        self.add_option(number, Bytes::from(encode_uint(value)));
    }

    /// Remove every option `number`.
    pub fn remove_option(&mut self, number: u16) {
        self.options.retain(|o| o.number != number);
    }

    /// Replace option `number` by one uint value.
    pub fn set_uint_option(&mut self, number: u16, value: u32) {
        self.remove_option(number);
        self.add_uint_option(number, value);
    }

    /// Uri-Path segments (option 11), each as raw bytes.
    pub fn uri_path(&self) -> impl Iterator<Item = &Bytes> + '_ {
        self.options_of(super::opt::URI_PATH)
    }

    /// The Uri-Query option whose key is `key` (`key=value` → `value`; a bare `key` → "").
    pub fn query(&self, key: &str) -> Option<&[u8]> {
        self.options_of(super::opt::URI_QUERY).find_map(|q| {
            let q = q.as_ref();
            let (k, v) = match q.iter().position(|&c| c == b'=') {
                Some(i) => (&q[..i], &q[i + 1..]),
                None => (q, &q[q.len()..]),
            };
            (k == key.as_bytes()).then_some(v)
        })
    }
}

/// A uint in its shortest big-endian form (0 → empty).
pub fn encode_uint(value: u32) -> Vec<u8> {
    let bytes = value.to_be_bytes();
    let skip = (value.leading_zeros() / 8) as usize;
    bytes[skip.min(4)..].to_vec()
}

fn ext_len(v: u32) -> usize {
    match v {
        0..=12 => 0,
        13..=268 => 1,
        _ => 2,
    }
}

fn nibble(v: u32) -> u8 {
    match v {
        0..=12 => v as u8,
        13..=268 => 13,
        _ => 14,
    }
}

fn put_ext(out: &mut BytesMut, v: u32) {
    match v {
        0..=12 => {}
        13..=268 => out.put_u8((v - 13) as u8),
        _ => out.put_u16((v - 269) as u16),
    }
}

/// Append options (which must be in ascending order) and, if non-empty, the payload marker
/// and payload. Shared by the UDP and TCP encodings.
pub(crate) fn encode_options(options: &[CoapOption], payload: &[u8], out: &mut BytesMut) {
    let mut last = 0u16;
    for o in options {
        let delta = o.number.saturating_sub(last) as u32;
        let len = o.value.len() as u32;
        out.put_u8(nibble(delta) << 4 | nibble(len));
        put_ext(out, delta);
        put_ext(out, len);
        out.put_slice(&o.value);
        last = o.number;
    }
    if !payload.is_empty() {
        out.put_u8(0xFF);
        out.put_slice(payload);
    }
}

/// Decode the options and payload of `buf` from `pos`. Shared by the UDP and TCP decodings.
pub(crate) fn decode_options(
    buf: &Bytes,
    mut pos: usize,
) -> Result<(Vec<CoapOption>, Bytes), DecodeErrorKind> {
    let b = buf.as_ref();
    let mut options = Vec::new();
    let mut number: u32 = 0;
    while pos < b.len() {
        let first = b[pos];
        pos += 1;
        if first == 0xFF {
            if pos == b.len() {
                return Err(DecodeErrorKind::EmptyPayload);
            }
            return Ok((options, buf.slice(pos..)));
        }
        let delta = read_ext(b, &mut pos, first >> 4)?;
        let len = read_ext(b, &mut pos, first & 0x0F)? as usize;
        number += delta;
        if number > u16::MAX as u32 {
            return Err(DecodeErrorKind::OptionNumberOverflow);
        }
        if b.len() - pos < len {
            return Err(DecodeErrorKind::TruncatedOption);
        }
        options.push(CoapOption {
            number: number as u16,
            value: buf.slice(pos..pos + len),
        });
        pos += len;
    }
    Ok((options, Bytes::new()))
}

fn read_ext(b: &[u8], pos: &mut usize, nib: u8) -> Result<u32, DecodeErrorKind> {
    match nib {
        0..=12 => Ok(nib as u32),
        13 => {
            let v = *b.get(*pos).ok_or(DecodeErrorKind::TruncatedOption)?;
            *pos += 1;
            Ok(v as u32 + 13)
        }
        14 => {
            let hi = *b.get(*pos).ok_or(DecodeErrorKind::TruncatedOption)?;
            let lo = *b.get(*pos + 1).ok_or(DecodeErrorKind::TruncatedOption)?;
            *pos += 2;
            Ok(u16::from_be_bytes([hi, lo]) as u32 + 269)
        }
        _ => Err(DecodeErrorKind::ReservedNibble),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coap::opt;

    fn hex(s: &str) -> Bytes {
        let s: String = s.split_whitespace().collect();
        Bytes::from(
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect::<Vec<u8>>(),
        )
    }

    #[test]
    fn a_con_post_round_trips() {
        let mut m = Message::new(
            MsgType::Con,
            Code::POST,
            0x1234,
            Token::from_slice(&[0xa1, 0xb2]).unwrap(),
        );
        m.add_option(opt::URI_PATH, &b"sensors"[..]);
        m.add_option(opt::URI_PATH, &b"spo2"[..]);
        m.add_uint_option(opt::CONTENT_FORMAT, 110);
        m.payload = Bytes::from_static(b"[{\"n\":\"spo2\"}]");
        let wire = m.to_udp();
        assert_eq!(&wire[..4], &[0x42, 0x02, 0x12, 0x34]);
        let back = Message::decode_udp(&wire).unwrap();
        assert_eq!(back, m);
        let path: Vec<&[u8]> = back.uri_path().map(|s| s.as_ref()).collect();
        assert_eq!(path, vec![&b"sensors"[..], &b"spo2"[..]]);
        assert_eq!(back.uint_option(opt::CONTENT_FORMAT), Some(110));
    }

    #[test]
    fn format_errors_keep_the_header_for_an_rst() {
        let e = Message::decode_udp(&hex("49 01 00 07 00")).unwrap_err();
        assert_eq!(e.kind, DecodeErrorKind::TokenTooLong(9));
        assert_eq!(e.header.unwrap().message_id, 7);
        let e = Message::decode_udp(&hex("40 01 00 07 f0")).unwrap_err();
        assert_eq!(e.kind, DecodeErrorKind::ReservedNibble);
        let e = Message::decode_udp(&hex("40 01 00 07 ff")).unwrap_err();
        assert_eq!(e.kind, DecodeErrorKind::EmptyPayload);
        let e = Message::decode_udp(&hex("40 00 00 07 ff 01")).unwrap_err();
        assert_eq!(e.kind, DecodeErrorKind::NonEmptyEmpty);
        let e = Message::decode_udp(&hex("40 01")).unwrap_err();
        assert_eq!(e.kind, DecodeErrorKind::TooShort);
    }

    #[test]
    fn uints_are_shortest() {
        assert_eq!(encode_uint(0), Vec::<u8>::new());
        assert_eq!(encode_uint(60), vec![60]);
        assert_eq!(encode_uint(0x1234), vec![0x12, 0x34]);
        assert_eq!(encode_uint(u32::MAX), vec![0xff; 4]);
    }

    #[test]
    fn queries_by_key() {
        let mut m = Message::new(MsgType::Non, Code::POST, 1, Token::EMPTY);
        m.add_option(opt::URI_QUERY, &b"c=dev-1"[..]);
        m.add_option(opt::URI_QUERY, &b"retain"[..]);
        assert_eq!(m.query("c"), Some(&b"dev-1"[..]));
        assert_eq!(m.query("retain"), Some(&b""[..]));
        assert_eq!(m.query("qos"), None);
    }
}
