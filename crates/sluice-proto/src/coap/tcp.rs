//! CoAP over TCP and TLS (RFC 8323 §3): the stream framing and the signalling messages
//! (7.01 CSM, 7.02 Ping, 7.03 Pong, 7.04 Release, 7.05 Abort). Sans-IO: bytes in a buffer in,
//! messages out.
//!
//! Owns: `Len | TKL`, the extended length, code and token of a frame, and building and
//! reading the signals. Does not own: the option/payload encoding (shared with UDP in
//! `message.rs`), or the connection's rules (who sends CSM first, when to Ping: the caller).
//!
//! Invariants: [`decode_tcp`] never panics on any input; `Ok(None)` consumes nothing; a
//! message encoded by [`encode_tcp`] decodes back to an equal message once its type and
//! message id are `Con` and 0 (they are not on the TCP wire).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::message::{decode_options, encode_options, encode_uint};
use super::{Code, DecodeError, DecodeErrorKind, Header, Message, MsgType, Token};

/// Option numbers of the signalling messages (RFC 8323 §5); each is specific to its code.
pub mod signal_opt {
    /// CSM: the largest message the sender accepts (uint; 1152 when absent).
    pub const MAX_MESSAGE_SIZE: u16 = 2;
    /// CSM: the sender supports block-wise transfer (empty).
    pub const BLOCK_WISE_TRANSFER: u16 = 4;
    /// Ping and Pong: hold the Pong until every earlier request is answered (empty).
    pub const CUSTODY: u16 = 2;
    /// Release: where to reconnect (string).
    pub const ALTERNATIVE_ADDRESS: u16 = 2;
    /// Release: seconds to wait before reconnecting (uint).
    pub const HOLD_OFF: u16 = 4;
    /// Abort: the CSM option that could not be processed (uint).
    pub const BAD_CSM_OPTION: u16 = 2;
}

/// Max-Message-Size when a peer's CSM does not say (RFC 8323 §5.3.1).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 1152;

/// Append the RFC 8323 frame of `msg` to `out` (its `mtype` and `message_id` are ignored).
pub fn encode_tcp(msg: &Message, out: &mut BytesMut) {
    let token = msg.token.as_slice();
    let len = msg.options_len();
    out.reserve(1 + 4 + 1 + token.len() + len);
    let tkl = token.len() as u8;
    match len {
        0..=12 => out.put_u8((len as u8) << 4 | tkl),
        13..=268 => {
            out.put_u8(13 << 4 | tkl);
            out.put_u8((len - 13) as u8);
        }
        269..=65_804 => {
            out.put_u8(14 << 4 | tkl);
            out.put_u16((len - 269) as u16);
        }
        _ => {
            out.put_u8(15 << 4 | tkl);
            // A message over 4 GiB cannot be built in memory first; saturate rather than wrap.
            out.put_u32(u32::try_from(len - 65_805).unwrap_or(u32::MAX));
        }
    }
    out.put_u8(msg.code.0);
    out.put_slice(token);
    encode_options(&msg.options, &msg.payload, out);
}

/// The RFC 8323 frame of `msg` as bytes.
pub fn to_tcp(msg: &Message) -> Bytes {
    let mut out = BytesMut::new();
    encode_tcp(msg, &mut out);
    out.freeze()
}

/// Where the frame at the start of `buf` ends: `(bytes before the code, whole frame)`, or
/// `None` when the first byte and extended length have not all arrived.
fn frame_bounds(buf: &[u8]) -> Option<(usize, u64)> {
    let first = *buf.first()?;
    let (ext, base) = match first >> 4 {
        n @ 0..=12 => (0usize, n as u64),
        13 => (1, 13),
        14 => (2, 269),
        _ => (4, 65_805),
    };
    let ext_bytes = buf.get(1..1 + ext)?;
    let ext_value = ext_bytes.iter().fold(0u64, |acc, b| acc << 8 | *b as u64);
    let tkl = (first & 0x0F) as u64;
    let head = 1 + ext;
    Some((head, head as u64 + 1 + tkl + base + ext_value))
}

/// Decode one frame from the front of `buf` and consume it. `Ok(None)`: the frame has not
/// all arrived (nothing consumed). A frame larger than `max_message_size` bytes is
/// [`DecodeErrorKind::TooLarge`] as soon as its length is known (nothing consumed); a
/// malformed frame is consumed and its error returned (on a stream either is fatal: the
/// caller sends Abort and closes). Decoded messages are `Con` with message id 0.
pub fn decode_tcp(
    buf: &mut BytesMut,
    max_message_size: usize,
) -> Result<Option<Message>, DecodeError> {
    let Some((head, total)) = frame_bounds(buf) else {
        return Ok(None);
    };
    if total > max_message_size as u64 {
        return Err(DecodeError {
            kind: DecodeErrorKind::TooLarge(total),
            header: None,
        });
    }
    let total = total as usize; // fits: at most max_message_size
    if buf.len() < total {
        return Ok(None);
    }
    let tkl = buf[0] & 0x0F;
    let frame = buf.split_to(total).freeze();
    let code = Code(frame[head]);
    let header = Header {
        mtype: MsgType::Con,
        code,
        message_id: 0,
    };
    let with = |kind| DecodeError {
        kind,
        header: Some(header),
    };
    if tkl > 8 {
        return Err(with(DecodeErrorKind::TokenTooLong(tkl)));
    }
    let start = head + 1;
    let end = start + tkl as usize;
    let token =
        Token::from_slice(&frame[start..end]).ok_or(with(DecodeErrorKind::TokenTooLong(tkl)))?;
    let (options, payload) = decode_options(&frame, end).map_err(with)?;
    Ok(Some(Message {
        mtype: MsgType::Con,
        code,
        message_id: 0,
        token,
        options,
        payload,
    }))
}

/// Skip the frame at the front of `buf` without decoding it; `false` when it has not all
/// arrived.
pub fn skip_tcp(buf: &mut BytesMut) -> bool {
    match frame_bounds(buf) {
        Some((_, total)) if (buf.len() as u64) >= total => {
            buf.advance(total as usize);
            true
        }
        _ => false,
    }
}

fn signal(code: Code, token: Token) -> Message {
    Message::new(MsgType::Con, code, 0, token)
}

/// A CSM (7.01) announcing the largest message this end accepts, and block-wise support.
pub fn csm(max_message_size: u32, block_wise: bool) -> Message {
    let mut m = signal(Code::CSM, Token::EMPTY);
    m.add_uint_option(signal_opt::MAX_MESSAGE_SIZE, max_message_size);
    if block_wise {
        m.add_option(signal_opt::BLOCK_WISE_TRANSFER, Bytes::new());
    }
    m
}

/// What a peer's CSM says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The largest message the peer accepts.
    pub max_message_size: usize,
    pub block_wise: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            block_wise: false,
        }
    }
}

/// Read a CSM on top of what was known (`prev`: options absent keep their value, RFC 8323
/// §5.3). `Err(number)`: an unknown critical option, to be answered by Abort with
/// Bad-CSM-Option = number.
pub fn read_csm(msg: &Message, prev: Capabilities) -> Result<Capabilities, u16> {
    let mut caps = prev;
    for o in &msg.options {
        match o.number {
            signal_opt::MAX_MESSAGE_SIZE => {
                if o.value.len() > 4 {
                    return Err(o.number);
                }
                caps.max_message_size =
                    o.value.iter().fold(0usize, |acc, b| acc << 8 | *b as usize);
            }
            signal_opt::BLOCK_WISE_TRANSFER => caps.block_wise = true,
            n if super::opt::is_critical(n) => return Err(n),
            _ => {}
        }
    }
    Ok(caps)
}

/// A Ping (7.02) with `token` (the Pong echoes it).
pub fn ping(token: Token) -> Message {
    signal(Code::PING, token)
}

/// The Pong (7.03) answering `ping`: same token (RFC 8323 §5.4).
pub fn pong(ping: &Message) -> Message {
    signal(Code::PONG, ping.token)
}

/// A Release (7.04) with no options: "close this connection when you are done".
pub fn release() -> Message {
    signal(Code::RELEASE, Token::EMPTY)
}

/// An Abort (7.05), with the Bad-CSM-Option that caused it when there is one and a
/// diagnostic payload.
pub fn abort(bad_csm_option: Option<u16>, diagnostic: &'static str) -> Message {
    let mut m = signal(Code::ABORT, Token::EMPTY);
    if let Some(n) = bad_csm_option {
        m.add_option(
            signal_opt::BAD_CSM_OPTION,
            Bytes::from(encode_uint(n as u32)),
        );
    }
    m.payload = Bytes::from_static(diagnostic.as_bytes());
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_lengths_follow_the_table() {
        // (options+payload length, expected first-byte nibble and extended bytes)
        let cases: [(usize, u8, &[u8]); 7] = [
            (12, 12, &[]),
            (13, 13, &[0x00]),
            (268, 13, &[0xff]),
            (269, 14, &[0x00, 0x00]),
            (1152, 14, &[0x03, 0x73]),
            (65_804, 14, &[0xff, 0xff]),
            (65_805, 15, &[0, 0, 0, 0]),
        ];
        for (len, nib, ext) in cases {
            let mut m = Message::new(MsgType::Con, Code::POST, 0, Token::EMPTY);
            m.payload = Bytes::from(vec![7u8; len - 1]); // + the payload marker
            let wire = to_tcp(&m);
            assert_eq!(wire[0] >> 4, nib, "len {len}");
            assert_eq!(&wire[1..1 + ext.len()], ext, "len {len}");
            assert_eq!(wire.len(), 1 + ext.len() + 1 + len);
            let mut buf = BytesMut::from(&wire[..]);
            assert_eq!(decode_tcp(&mut buf, usize::MAX).unwrap(), Some(m));
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn csm_reading_keeps_what_is_absent_and_rejects_unknown_critical_options() {
        let caps = read_csm(&csm(4096, true), Capabilities::default()).unwrap();
        assert_eq!(
            caps,
            Capabilities {
                max_message_size: 4096,
                block_wise: true
            }
        );
        let mut m = signal(Code::CSM, Token::EMPTY);
        m.add_option(6, Bytes::new()); // elective, unknown: ignored
        assert_eq!(read_csm(&m, caps), Ok(caps));
        m.add_option(9, Bytes::new()); // critical, unknown
        assert_eq!(read_csm(&m, caps), Err(9));
    }

    #[test]
    fn too_large_is_seen_from_the_header_alone() {
        let mut buf = BytesMut::from(&[0xe0u8, 0x10, 0x00][..]); // Len 14: 269 + 4096
        let e = decode_tcp(&mut buf, 1152).unwrap_err();
        assert_eq!(e.kind, DecodeErrorKind::TooLarge(3 + 1 + 269 + 4096));
        assert_eq!(buf.len(), 3);
    }
}
